"""Subagent runs and their transcripts (the `subagent_runs` and `subagent_messages` tables).

A child agent's conversation is kept like the parent's: one row per message, written as the
child makes it, so that it can be read through the sessions API and resumed by a later `task`
call of the same session. A run records what it was allowed when it started (its intersected
`tier` and `plan`), which is what a resume is checked against (`agent/subagents.py`).

Content of a message row: `{"text", "tool_calls": [{id, name, input}], "tool_use_id",
"is_error"}` (the `ChatMessage` fields; the agent layer converts).

Every way it refuses:

    SubagentRunNotFound   no run has that id in that session (another session's is not found)
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from agentbox import ids
from agentbox.store.db import Database
from agentbox.timestamps import timestamp

RunStatus = Literal["running", "completed", "failed", "max_steps"]


class SubagentRunNotFound(LookupError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"no subagent run {run_id!r} in this session")
        self.run_id = run_id


@dataclass(frozen=True)
class SubagentRun:
    id: str
    session_id: str
    turn_id: str | None
    tool_use_id: str
    agent: str
    tier: str
    plan: bool
    status: RunStatus
    created_at: str
    updated_at: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunMessage:
    role: Literal["user", "assistant", "tool"]
    content: dict[str, Any]
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, **self.content, "created_at": self.created_at}


class SubagentRuns:
    """The subagent tables of one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self, session_id: str, turn_id: str | None, tool_use_id: str, agent: str, tier: str, plan: bool
    ) -> SubagentRun:
        run_id, now = ids.new_id(ids.SUBAGENT), timestamp()

        def write(conn: sqlite3.Connection) -> SubagentRun:
            conn.execute(
                "INSERT INTO subagent_runs (id, session_id, turn_id, tool_use_id, agent, tier, plan,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, session_id, turn_id, tool_use_id, agent, tier, int(plan), now, now),
            )
            return _run(conn.execute("SELECT * FROM subagent_runs WHERE id = ?", (run_id,)).fetchone())

        return await self.db.transaction(write)

    async def get(self, session_id: str, run_id: str) -> SubagentRun:
        row = await self.db.fetchone(
            "SELECT * FROM subagent_runs WHERE id = ? AND session_id = ?", (run_id, session_id)
        )
        if row is None:
            raise SubagentRunNotFound(run_id)
        return _run(row)

    async def of_session(self, session_id: str) -> list[SubagentRun]:
        rows = await self.db.fetchall(
            "SELECT * FROM subagent_runs WHERE session_id = ? ORDER BY id", (session_id,)
        )
        return [_run(row) for row in rows]

    async def messages(self, run_id: str) -> list[RunMessage]:
        rows = await self.db.fetchall(
            "SELECT role, content, created_at FROM subagent_messages WHERE run_id = ? ORDER BY id", (run_id,)
        )
        return [RunMessage(row["role"], json.loads(row["content"]), row["created_at"]) for row in rows]

    async def append(self, run_id: str, role: str, content: Mapping[str, Any]) -> None:
        await self.db.execute(
            "INSERT INTO subagent_messages (run_id, role, content, created_at) VALUES (?, ?, ?, ?)",
            (run_id, role, json.dumps(dict(content), ensure_ascii=False), timestamp()),
        )

    async def set_status(self, run_id: str, status: RunStatus, turn_id: str | None = None) -> None:
        """The run's state; `turn_id` when a resume moves it to the turn that resumed it."""
        await self.db.execute(
            "UPDATE subagent_runs SET status = ?, turn_id = COALESCE(?, turn_id), updated_at = ? WHERE id = ?",
            (status, turn_id, timestamp(), run_id),
        )

    async def interrupt_running(self) -> int:
        """At start (one process owns a home): runs a dead process left `running` ended with it,
        as `failed`, so they can be resumed; how many there were."""
        return await self.db.execute(
            "UPDATE subagent_runs SET status = 'failed', updated_at = ? WHERE status = 'running'",
            (timestamp(),),
        )


def _run(row: sqlite3.Row) -> SubagentRun:
    return SubagentRun(
        id=row["id"],
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        tool_use_id=row["tool_use_id"],
        agent=row["agent"],
        tier=row["tier"],
        plan=bool(row["plan"]),
        status=row["status"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
