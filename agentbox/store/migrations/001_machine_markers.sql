-- Session markers (seed 004): opening a per-session machine appends a marker naming the
-- machine, its kind and its sandbox; closing it appends a clear. Append-only; for each
-- (session, machine) the row with the highest id is the current state. The server reads
-- the live ones at start to reconnect to (or rebuild) the sandboxes it had.
CREATE TABLE machine_markers (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id  TEXT    NOT NULL,
    machine     TEXT    NOT NULL,
    kind        TEXT,                               -- NULL on a clear
    sandbox_id  TEXT,                               -- NULL on a clear
    data        TEXT    NOT NULL DEFAULT '{}',      -- JSON object: whatever reconnecting needs
    cleared     INTEGER NOT NULL DEFAULT 0 CHECK (cleared IN (0, 1)),
    created_at  TEXT    NOT NULL,                   -- UTC ISO 8601, see store.db.timestamp
    CHECK (cleared = 1 OR (kind IS NOT NULL AND sandbox_id IS NOT NULL)),
    CHECK (json_valid(data) AND json_type(data) = 'object')
);

CREATE INDEX machine_markers_latest ON machine_markers (session_id, machine, id);
