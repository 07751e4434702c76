"""The file ids a session's tools have shown (`list`, `search`) and `read` accepts.

An id is derived from the session and the file's path (`file_id`), so listing a file twice
gives the same id and an id from another session names nothing here. The table maps it back
to the path; `read` by id still checks that path as a read of the path would (the id is a
handle, not a grant). A session keeps at most `MAX_FILE_IDS` ids: past it, the ones shown
longest ago are dropped, and reading one says to list again.

`FileIdRepo` is the store's implementation of the tools' `FileIds` protocol.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable

from agentbox.store.db import Database
from agentbox.timestamps import timestamp

#: File ids one session keeps; the oldest shown go first.
MAX_FILE_IDS = 50_000
#: What every file id starts with (then FILE_ID_DIGITS hex digits).
FILE_ID_PREFIX = "file_"
FILE_ID_DIGITS = 20
#: Characters of a file id; a longer one a model passes is refused by the schema.
FILE_ID_CHARS = len(FILE_ID_PREFIX) + FILE_ID_DIGITS


def file_id(session_id: str, path: str) -> str:
    digest = hashlib.sha256(f"{session_id}\0{path}".encode()).hexdigest()
    return FILE_ID_PREFIX + digest[:FILE_ID_DIGITS]


class FileIdRepo:
    """The `file_ids` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def remember(self, session_id: str, paths: Iterable[str]) -> dict[str, str]:
        """Ids for `paths` (absolute paths on the session's machine), recorded; path -> id."""
        ids = {path: file_id(session_id, path) for path in paths}
        if not ids:
            return ids
        now = timestamp()

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO file_ids (session_id, file_id, path, seen_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (session_id, file_id) DO UPDATE SET seen_at = excluded.seen_at",
                [(session_id, fid, path, now) for path, fid in ids.items()],
            )
            (count,) = conn.execute(
                "SELECT COUNT(*) FROM file_ids WHERE session_id = ?", (session_id,)
            ).fetchone()
            if count > MAX_FILE_IDS:
                conn.execute(
                    "DELETE FROM file_ids WHERE rowid IN (SELECT rowid FROM file_ids WHERE session_id = ?"
                    " ORDER BY seen_at, rowid LIMIT ?)",
                    (session_id, count - MAX_FILE_IDS),
                )

        await self.db.transaction(write)
        return ids

    async def path_of(self, session_id: str, fid: str) -> str | None:
        row = await self.db.fetchone(
            "SELECT path FROM file_ids WHERE session_id = ? AND file_id = ?", (session_id, fid)
        )
        return None if row is None else str(row["path"])

    async def forget(self, session_id: str) -> None:
        await self.db.execute("DELETE FROM file_ids WHERE session_id = ?", (session_id,))
