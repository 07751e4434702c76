-- Governance (issue 4, seed 001): approvals and change sets, durable so that a restart loses
-- neither a question waiting for the user nor an edit waiting for review.

-- One question to the user: may this tool do this action now? `pending` until resolved,
-- then `allowed` / `denied` (with the user's message for the model) or `cancelled` (the call
-- that asked is gone). An `allowed` row with scope `session` lets the same (tool, action)
-- through for the rest of the session without asking again.
CREATE TABLE approvals (
    id           TEXT PRIMARY KEY,                   -- apr_<ulid>
    session_id   TEXT NOT NULL,
    turn_id      TEXT,                               -- NULL outside a turn (e.g. over MCP)
    tool         TEXT NOT NULL,                      -- the tool name as the model called it
    action       TEXT NOT NULL,                      -- agentbox.tools.base.Action value
    detail       TEXT NOT NULL DEFAULT '{}',         -- JSON object shown to the user (command, path, ...)
    status       TEXT NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'allowed', 'denied', 'cancelled')),
    scope        TEXT CHECK (scope IN ('once', 'session')),
    message      TEXT,                               -- the user's words, carried back to the model
    created_at   TEXT NOT NULL,                      -- UTC ISO 8601, see store.db.timestamp
    resolved_at  TEXT,
    CHECK (json_valid(detail) AND json_type(detail) = 'object'),
    CHECK ((status = 'pending') = (resolved_at IS NULL)),
    CHECK ((status IN ('allowed', 'denied')) = (scope IS NOT NULL)),
    CHECK (status <> 'denied' OR scope = 'once')
);

CREATE INDEX approvals_session ON approvals (session_id, status, id);
CREATE INDEX approvals_grants ON approvals (session_id, tool, action)
    WHERE status = 'allowed' AND scope = 'session';

-- The pending changes of one turn: every staged write / edit / mkdir / move / rename /
-- delete of (session, turn) lands in the same set. `open` while any operation waits for a
-- decision; once none does: `applied` (all applied), `rejected` (none applied) or
-- `partially_applied`.
CREATE TABLE change_sets (
    id           TEXT PRIMARY KEY,                   -- chg_<ulid>
    session_id   TEXT NOT NULL,
    turn_id      TEXT,                               -- NULL outside a turn
    status       TEXT NOT NULL DEFAULT 'open'
                 CHECK (status IN ('open', 'partially_applied', 'applied', 'rejected')),
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);

CREATE UNIQUE INDEX change_sets_turn ON change_sets (session_id, COALESCE(turn_id, ''));

-- One planned operation of a change set, applied or rejected on its own. The full texts are
-- kept for the diff and for the stale check (`expect`); tool results never carry them.
CREATE TABLE change_operations (
    id             TEXT PRIMARY KEY,                 -- '<change set id>:<seq>'
    change_set_id  TEXT NOT NULL REFERENCES change_sets (id) ON DELETE CASCADE,
    seq            INTEGER NOT NULL CHECK (seq >= 1),
    tool           TEXT NOT NULL,
    kind           TEXT NOT NULL
                   CHECK (kind IN ('write', 'edit', 'mkdir', 'move', 'rename', 'delete')),
    path           TEXT NOT NULL,
    dest           TEXT,                             -- target of move / rename
    before_text    TEXT,                             -- NULL: no file before (a new file)
    after_text     TEXT,
    expect         TEXT,                             -- fingerprint the file had when planned
    summary        TEXT NOT NULL DEFAULT '',
    diff           TEXT NOT NULL DEFAULT '',         -- unified diff for write / edit, else ''
    before_chars   INTEGER NOT NULL DEFAULT 0,
    after_chars    INTEGER NOT NULL DEFAULT 0,
    files          INTEGER NOT NULL DEFAULT 0,       -- files affected (a folder's contents count)
    warnings       TEXT NOT NULL DEFAULT '[]',       -- JSON array of strings
    status         TEXT NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'applied', 'rejected', 'failed')),
    reason         TEXT,                             -- why it failed, or the reviewer's message
    trash_path     TEXT,                             -- where an applied delete put the path
    created_at     TEXT NOT NULL,
    resolved_at    TEXT,
    UNIQUE (change_set_id, seq),
    CHECK (json_valid(warnings) AND json_type(warnings) = 'array'),
    CHECK ((status = 'pending') = (resolved_at IS NULL)),
    CHECK ((kind IN ('move', 'rename')) = (dest IS NOT NULL))
);

CREATE INDEX change_operations_status ON change_operations (change_set_id, status, seq);
