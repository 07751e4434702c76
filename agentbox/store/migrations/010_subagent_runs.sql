-- A subagent's run (the child a `task` call starts) and its own transcript, kept like the
-- parent's: readable through the sessions API, and resumable by a later `task` call of the
-- same session while the permissions it ran under still hold (`tier`, `plan`).
CREATE TABLE subagent_runs (
    id           TEXT PRIMARY KEY,                       -- sub_<ulid>
    session_id   TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn_id      TEXT,                                   -- the turn whose call started it (NULL: none)
    tool_use_id  TEXT NOT NULL,                          -- that call
    agent        TEXT NOT NULL,
    tier         TEXT NOT NULL,                          -- the intersected tier it runs under
    plan         INTEGER NOT NULL DEFAULT 0 CHECK (plan IN (0, 1)),
    status       TEXT NOT NULL DEFAULT 'running'
                 CHECK (status IN ('running', 'completed', 'failed', 'max_steps')),
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);

CREATE INDEX subagent_runs_session ON subagent_runs (session_id, id);

CREATE TABLE subagent_messages (
    id          INTEGER PRIMARY KEY,
    run_id      TEXT NOT NULL REFERENCES subagent_runs (id) ON DELETE CASCADE,
    role        TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content     TEXT NOT NULL CHECK (json_valid(content) AND json_type(content) = 'object'),
    created_at  TEXT NOT NULL
);

CREATE INDEX subagent_messages_run ON subagent_messages (run_id, id);
