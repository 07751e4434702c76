-- The model's task list (`todo_write`), one per session, replaced whole on every write.
-- `items` is a JSON array of {id, content, status}; the tool validates it before it lands here.
CREATE TABLE todos (
    session_id  TEXT PRIMARY KEY,
    items       TEXT NOT NULL DEFAULT '[]',
    updated_at  TEXT NOT NULL,                       -- UTC ISO 8601, see store.db.timestamp
    CHECK (json_valid(items) AND json_type(items) = 'array')
);
