"""Session markers (seed 004): which per-session machines are open, so a restart can reconnect.

Opening a per-session machine appends a marker (machine name, kind, sandbox id, whatever
state reconnecting needs); closing it appends a clear, so a restarted server never
reconnects to a sandbox that is gone. Rows are only ever appended; for each
(session, machine) the newest row is the truth. `live()` is what the server reads at start.

Deleting a session retires its id (`retire`, the `retired_sessions` table): no machine is
opened under it again, by any surface, after any restart.

`MarkersRepo` is the store's implementation of the machine registry's `MarkerLog` protocol;
the registry depends on that protocol, never on this module.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agentbox.store.db import Database
from agentbox.timestamps import parse_timestamp, timestamp


@dataclass(frozen=True)
class Marker:
    """An open per-session machine as last recorded."""

    id: int
    session_id: str
    machine: str
    kind: str
    sandbox_id: str
    data: dict[str, Any]
    created_at: datetime


class MarkersRepo:
    """The `machine_markers` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def append(
        self, session_id: str, machine: str, kind: str, sandbox_id: str, data: dict[str, Any]
    ) -> None:
        """Record that `machine` of `session_id` is open as `sandbox_id`; `data` must be JSON."""
        if not isinstance(data, dict):
            raise TypeError(f"marker data must be a dict, not {type(data).__name__}")
        await self.db.execute(
            "INSERT INTO machine_markers (session_id, machine, kind, sandbox_id, data, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (session_id, machine, kind, sandbox_id, json.dumps(data, separators=(",", ":")), timestamp()),
        )

    async def clear(self, session_id: str, machine: str) -> None:
        """Record that `machine` of `session_id` is closed: nothing to reconnect to."""
        await self.db.execute(
            "INSERT INTO machine_markers (session_id, machine, cleared, created_at) VALUES (?, ?, 1, ?)",
            (session_id, machine, timestamp()),
        )

    async def retire(self, session_id: str) -> None:
        """Record that `session_id` was deleted: nothing may open under it from now on."""
        await self.db.execute(
            "INSERT OR IGNORE INTO retired_sessions (session_id, retired_at) VALUES (?, ?)",
            (session_id, timestamp()),
        )

    async def retired(self, session_id: str) -> bool:
        row = await self.db.fetchone("SELECT 1 FROM retired_sessions WHERE session_id = ?", (session_id,))
        return row is not None

    async def latest(self, session_id: str, machine: str) -> Marker | None:
        """The newest marker of `machine` in `session_id`; None if there is none or it was cleared."""
        row = await self.db.fetchone(
            "SELECT * FROM machine_markers WHERE session_id = ? AND machine = ? ORDER BY id DESC LIMIT 1",
            (session_id, machine),
        )
        return None if row is None or row["cleared"] else _marker(row)

    async def live(self) -> list[Marker]:
        """The newest marker of every (session, machine) that is not cleared, oldest first."""
        rows = await self.db.fetchall(
            "SELECT * FROM machine_markers"
            " WHERE id IN (SELECT MAX(id) FROM machine_markers GROUP BY session_id, machine)"
            " AND cleared = 0 ORDER BY id"
        )
        return [_marker(row) for row in rows]


def _marker(row: sqlite3.Row) -> Marker:
    return Marker(
        id=row["id"],
        session_id=row["session_id"],
        machine=row["machine"],
        kind=row["kind"],
        sandbox_id=row["sandbox_id"],
        data=json.loads(row["data"]),
        created_at=parse_timestamp(row["created_at"]),
    )
