"""The model's task list (`todo_write`), stored with its session.

One row per session holding the whole list as JSON; every write replaces it, because the
tool always sends the full list (as Claude Code's TodoWrite does), so there is nothing to
merge. The tool validates items; this module only keeps what it is given.

`TodoRepo` is the store's implementation of the tools' `TodoStore` protocol.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.store.db import Database
from agentbox.timestamps import timestamp


class TodoRepo:
    """The `todos` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def get(self, session_id: str) -> list[dict[str, Any]]:
        """The session's list as last written; empty if it never wrote one."""
        row = await self.db.fetchone("SELECT items FROM todos WHERE session_id = ?", (session_id,))
        if row is None:
            return []
        items: list[dict[str, Any]] = json.loads(row["items"])
        return items

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        """Replace the session's list; `items` must be JSON (a list of objects)."""
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise TypeError("todo items must be a list of dicts")
        await self.db.execute(
            "INSERT INTO todos (session_id, items, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (session_id) DO UPDATE SET items = excluded.items, updated_at = excluded.updated_at",
            (session_id, json.dumps(items, ensure_ascii=False, separators=(",", ":")), timestamp()),
        )
