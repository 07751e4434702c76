-- A subagent run cut short (its turn aborted, the server stopped or died) ends `interrupted`,
-- apart from `failed` (its model failed). A background run (`task` with `background: true`)
-- keeps its end for the parent: `notice_pending` while the parent has not been told it, and
-- `result`, the final message (or why it ended) the notice carries, so a notice survives a
-- restart. SQLite cannot change a CHECK in place, so both tables are rebuilt; the messages
-- table goes first, so that dropping the runs cascades to nothing.
CREATE TABLE subagent_runs_new (
    id              TEXT PRIMARY KEY,                       -- sub_<ulid>
    session_id      TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn_id         TEXT,                                   -- the turn whose call started it (NULL: none)
    tool_use_id     TEXT NOT NULL,                          -- that call
    agent           TEXT NOT NULL,
    tier            TEXT NOT NULL,                          -- the intersected tier it runs under
    plan            INTEGER NOT NULL DEFAULT 0 CHECK (plan IN (0, 1)),
    status          TEXT NOT NULL DEFAULT 'running'
                    CHECK (status IN ('running', 'completed', 'failed', 'max_steps', 'interrupted')),
    background      INTEGER NOT NULL DEFAULT 0 CHECK (background IN (0, 1)),
    notice_pending  INTEGER NOT NULL DEFAULT 0 CHECK (notice_pending IN (0, 1)),
    result          TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL
);

INSERT INTO subagent_runs_new (id, session_id, turn_id, tool_use_id, agent, tier, plan, status, created_at, updated_at)
    SELECT id, session_id, turn_id, tool_use_id, agent, tier, plan, status, created_at, updated_at FROM subagent_runs;

CREATE TABLE subagent_messages_new (
    id          INTEGER PRIMARY KEY,
    run_id      TEXT NOT NULL REFERENCES subagent_runs_new (id) ON DELETE CASCADE,
    role        TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content     TEXT NOT NULL CHECK (json_valid(content) AND json_type(content) = 'object'),
    created_at  TEXT NOT NULL
);

INSERT INTO subagent_messages_new (id, run_id, role, content, created_at)
    SELECT id, run_id, role, content, created_at FROM subagent_messages;

DROP TABLE subagent_messages;
DROP TABLE subagent_runs;
ALTER TABLE subagent_runs_new RENAME TO subagent_runs;
ALTER TABLE subagent_messages_new RENAME TO subagent_messages;

CREATE INDEX subagent_runs_session ON subagent_runs (session_id, id);
CREATE INDEX subagent_runs_pending ON subagent_runs (notice_pending) WHERE notice_pending = 1;
CREATE INDEX subagent_messages_run ON subagent_messages (run_id, id);
