-- The file store of seed 000: uploads (given to an agent) and deliveries (`deliver_file`).
-- Bytes live on disk as content-addressed blobs, AGENTBOX_HOME/blobs/<sha256[:2]>/<sha256>;
-- a row is one file as a user sees it (its id, name, size). Two rows with the same bytes share
-- one blob. Deleting sets `deleted_at` (the row stays for history); the blob goes once no live
-- row names it. Files outlive their session: `session_id` is a plain column, not a foreign key.
CREATE TABLE files (
    id           TEXT    PRIMARY KEY,                 -- file_<ulid>: sorts by creation
    filename     TEXT    NOT NULL CHECK (length(filename) > 0),
    bytes        INTEGER NOT NULL CHECK (bytes >= 0),
    sha256       TEXT    NOT NULL CHECK (length(sha256) = 64),
    session_id   TEXT,                                -- NULL: uploaded outside any session
    source       TEXT    NOT NULL CHECK (source IN ('upload', 'delivery')),
    turn_id      TEXT,                                -- the turn that delivered it
    tool_use_id  TEXT,                                -- the deliver_file call that delivered it
    created_at   TEXT    NOT NULL,                    -- UTC ISO 8601, see store.db.timestamp
    deleted_at   TEXT                                 -- NULL while the file is live
);

CREATE INDEX files_live_by_session ON files (session_id, id) WHERE deleted_at IS NULL;
CREATE INDEX files_live_by_sha256 ON files (sha256) WHERE deleted_at IS NULL;
