-- A session's knowledge bases (agentbox.tools.knowledge_bases): the folders of the workspace it
-- registered ([{id, path, name}], paths relative to the workspace root) and the ids it selected
-- (NULL: every knowledge base its machine has, the workspace first).
ALTER TABLE sessions ADD COLUMN knowledge_bases TEXT NOT NULL DEFAULT '[]'
    CHECK (json_valid(knowledge_bases) AND json_type(knowledge_bases) = 'array');
ALTER TABLE sessions ADD COLUMN knowledge_base_ids TEXT
    CHECK (knowledge_base_ids IS NULL OR (json_valid(knowledge_base_ids) AND json_type(knowledge_base_ids) = 'array'));

-- The file ids a session's tools showed (`list`, `search`), so `read` can take one instead of
-- a path: an id names a file this session was shown. Sessions of `agentbox mcp` have none of
-- their own rows in `sessions`, so there is no foreign key; deleting a session removes them.
CREATE TABLE file_ids (
    session_id  TEXT NOT NULL,
    file_id     TEXT NOT NULL,                      -- file_<20 hex>: derived from session and path
    path        TEXT NOT NULL,                      -- the absolute path on the session's machine
    seen_at     TEXT NOT NULL,                      -- UTC ISO 8601, last shown
    PRIMARY KEY (session_id, file_id)
);
CREATE INDEX file_ids_seen ON file_ids (session_id, seen_at);
