-- Sessions deleted through the sessions API. A deleted session's id never names a sandbox
-- again: opening a per-session machine under it is refused (`SessionDeleted`, HTTP 410
-- `session_deleted`) instead of quietly making a new, empty sandbox under the old id.
CREATE TABLE retired_sessions (
    session_id  TEXT PRIMARY KEY,
    retired_at  TEXT NOT NULL                       -- UTC ISO 8601, see store.db.timestamp
);
