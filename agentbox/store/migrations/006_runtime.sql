-- The agent runtime (issue 6): provider options, compaction settings, and the frozen
-- system prompt per baseline.

-- Per-session provider options (`base_url`, `api_key`, `temperature`, `context_window`, ...)
-- and the compaction setting: NULL = defaults, `false` = off, or {reserve_tokens, keep_recent_tokens}.
ALTER TABLE sessions ADD COLUMN model_options TEXT NOT NULL DEFAULT '{}'
    CHECK (json_valid(model_options) AND json_type(model_options) = 'object');
ALTER TABLE sessions ADD COLUMN compaction TEXT
    CHECK (compaction IS NULL OR json_valid(compaction));

-- One baseline per prompt composition (Flue a.6/a.10): the first turn writes one, every
-- compaction another. The newest is what the model sees: its frozen `system` prompt, then
-- its `summary` (if compacted) and the transcript from `first_kept` on. `environment` is what
-- that prompt told the model (JSON, agent.signals.Environment); signals after it are message
-- rows that carry their own snapshot. `last_message` is the newest message id when it was
-- written: provider-reported token counts from before it describe a context that is gone.
CREATE TABLE baselines (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id    TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn_id       TEXT REFERENCES turns (id) ON DELETE SET NULL,
    system        TEXT NOT NULL,
    environment   TEXT NOT NULL,
    summary       TEXT,
    first_kept    INTEGER,                              -- messages.id; NULL: from the start
    last_message  INTEGER NOT NULL DEFAULT 0,
    created_at    TEXT NOT NULL,
    CHECK (json_valid(environment) AND json_type(environment) = 'object'),
    CHECK ((summary IS NULL) = (first_kept IS NULL))
);

CREATE INDEX baselines_session ON baselines (session_id, id);
