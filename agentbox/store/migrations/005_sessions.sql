-- Sessions, turns, their event log and the model transcript (issue 5, seed 000 + Flue's
-- submissions). Durability lives here, not only in code:
--   * a turn reaches exactly one terminal state: leaving a terminal status is refused by a
--     trigger, and a second terminal event for a turn is refused by a partial unique index;
--   * a terminal event must name the status its turn already has (a trigger), so the row and
--     the log can never disagree;
--   * event `seq` is per session and gap-free: assigned as MAX(seq)+1 inside the write
--     transaction (BEGIN IMMEDIATE holds the write lock), unique per session;
--   * a tool call has at most one recorded result (first write wins; never re-run).

-- A session's configuration. model, instructions and mcp_servers are fixed at creation
-- (seed 000); permission_mode and metadata may change. `status` is the row's lifecycle
-- (`active` / `deleted`); whether it is idle, running or awaiting approval is derived from
-- its turns.
CREATE TABLE sessions (
    id               TEXT PRIMARY KEY,                   -- ses_<ulid>
    model            TEXT NOT NULL,                      -- "scripted", "openai:<name>", "anthropic:<name>"
    instructions     TEXT NOT NULL DEFAULT '',
    mcp_servers      TEXT NOT NULL DEFAULT '[]',         -- JSON array
    toolset          TEXT NOT NULL DEFAULT 'default',
    permission_mode  TEXT NOT NULL,                      -- a tools.tiers.Tier value or 'plan'
    machine          TEXT,                               -- NULL: the server's default machine
    metadata         TEXT NOT NULL DEFAULT '{}',         -- JSON object
    script           TEXT,                               -- JSON array: the scripted model's steps
    status           TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'deleted')),
    created_at       TEXT NOT NULL,                      -- UTC ISO 8601, see store.db.timestamp
    updated_at       TEXT NOT NULL,
    CHECK (json_valid(mcp_servers) AND json_type(mcp_servers) = 'array'),
    CHECK (json_valid(metadata) AND json_type(metadata) = 'object'),
    CHECK (script IS NULL OR (json_valid(script) AND json_type(script) = 'array'))
);

-- One accepted message and the work it causes (a Flue submission). `seq` orders a
-- session's turns (FIFO). `content` / `files` are the message as accepted.
CREATE TABLE turns (
    id               TEXT PRIMARY KEY,                   -- trn_<ulid>
    session_id       TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq              INTEGER NOT NULL CHECK (seq >= 1),
    status           TEXT NOT NULL DEFAULT 'queued'
                     CHECK (status IN ('queued', 'running', 'awaiting_approval',
                                       'completed', 'failed', 'aborted')),
    idempotency_key  TEXT,
    content          TEXT NOT NULL,
    files            TEXT NOT NULL DEFAULT '[]',         -- JSON array of {file_id, filename}
    stop_reason      TEXT,                               -- completed: end_turn | max_steps
    error            TEXT,                               -- failed: JSON {type, message, retryable}
    attempt          INTEGER NOT NULL DEFAULT 0,         -- times a worker started it (1 + restarts)
    created_at       TEXT NOT NULL,
    started_at       TEXT,
    ended_at         TEXT,
    UNIQUE (session_id, seq),
    CHECK (json_valid(files) AND json_type(files) = 'array'),
    CHECK (error IS NULL OR json_valid(error)),
    CHECK ((status IN ('completed', 'failed', 'aborted')) = (ended_at IS NOT NULL))
);

CREATE UNIQUE INDEX turns_idempotency ON turns (session_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX turns_open ON turns (session_id, seq)
    WHERE status IN ('queued', 'running', 'awaiting_approval');

-- No way out of a terminal state, whoever writes.
CREATE TRIGGER turns_terminal_is_final BEFORE UPDATE OF status ON turns
WHEN OLD.status IN ('completed', 'failed', 'aborted') AND NEW.status IS NOT OLD.status
BEGIN
    SELECT RAISE(ABORT, 'turn is already terminal');
END;

-- The session log: both the event list and the SSE stream read it.
CREATE TABLE events (
    id          TEXT PRIMARY KEY,                        -- evt_<ulid>
    session_id  TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL CHECK (seq >= 1),
    type        TEXT NOT NULL,
    turn_id     TEXT,                                    -- NULL for session-level events
    data        TEXT NOT NULL DEFAULT '{}',              -- JSON object: the payload
    created_at  TEXT NOT NULL,
    UNIQUE (session_id, seq),
    CHECK (json_valid(data) AND json_type(data) = 'object')
);

CREATE INDEX events_turn ON events (turn_id, seq) WHERE turn_id IS NOT NULL;

-- Exactly one terminal event per turn.
CREATE UNIQUE INDEX events_one_terminal ON events (turn_id)
    WHERE type IN ('turn.completed', 'turn.failed', 'turn.aborted');

-- A terminal event only after its turn row took that very status.
CREATE TRIGGER events_terminal_matches_turn BEFORE INSERT ON events
WHEN NEW.type IN ('turn.completed', 'turn.failed', 'turn.aborted')
     AND (SELECT status FROM turns WHERE id = NEW.turn_id) IS NOT substr(NEW.type, 6)
BEGIN
    SELECT RAISE(ABORT, 'terminal event does not match the turn status');
END;

-- The model conversation, as recorded: what a resumed turn replays instead of redoing.
--   user       {text, files}
--   assistant  {text, tool_calls: [{id, name, input}]}; status streaming while the model
--              call is in flight, then complete / aborted / error (one row per model call)
--   tool       {tool_use_id, name, content, is_error}
CREATE TABLE messages (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id   TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn_id      TEXT NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    role         TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    status       TEXT NOT NULL DEFAULT 'complete'
                 CHECK (status IN ('streaming', 'complete', 'aborted', 'error')),
    tool_use_id  TEXT,                                   -- tool rows only
    content      TEXT NOT NULL DEFAULT '{}',             -- JSON object, shape by role (above)
    created_at   TEXT NOT NULL,
    CHECK (json_valid(content) AND json_type(content) = 'object'),
    CHECK ((role = 'tool') = (tool_use_id IS NOT NULL)),
    CHECK (role = 'assistant' OR status = 'complete')
);

CREATE INDEX messages_session ON messages (session_id, id);
-- One result per tool call: a recorded result is never replaced (nor the call re-run).
CREATE UNIQUE INDEX messages_one_result ON messages (session_id, tool_use_id) WHERE role = 'tool';
