"""Subagent runs and their transcripts (the `subagent_runs` and `subagent_messages` tables).

A child agent's conversation is kept like the parent's: one row per message, written as the
child makes it, so that it can be read through the sessions API and resumed by a later `task`
call of the same session. A run records what it was allowed when it started (its intersected
`tier` and `plan`), which is what a resume is checked against (`agent/subagents.py`).

A background run's end is owed to its parent: `notice_pending` from its start until the parent
is told (`told`), with `result`, the final message the notice carries. A run a dead or
stopped process left `running` ends `interrupted` at the next start (`interrupt_running`);
`pending_notices` then gives every end still owed, so no notice is lost to a restart.

Content of a message row: `{"text", "tool_calls": [{id, name, input}], "tool_use_id",
"is_error"}` (the `ChatMessage` fields; the agent layer converts).

Every way it refuses:

    SubagentRunNotFound   no run has that id in that session (another session's is not found)
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from agentbox import ids
from agentbox.store.db import Database
from agentbox.timestamps import timestamp

RunStatus = Literal["running", "completed", "failed", "max_steps", "interrupted"]


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
    background: bool
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
        self,
        session_id: str,
        turn_id: str | None,
        tool_use_id: str,
        agent: str,
        tier: str,
        plan: bool,
        background: bool = False,
    ) -> SubagentRun:
        """A new run, `running`; a background one owes its parent the notice of its end."""
        run_id, now = ids.new_id(ids.SUBAGENT), timestamp()

        def write(conn: sqlite3.Connection) -> SubagentRun:
            conn.execute(
                "INSERT INTO subagent_runs (id, session_id, turn_id, tool_use_id, agent, tier, plan,"
                " background, notice_pending, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, session_id, turn_id, tool_use_id, agent, tier, int(plan), int(background),
                 int(background), now, now),
            )  # fmt: skip
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

    async def set_status(
        self, run_id: str, status: RunStatus, turn_id: str | None = None, result: str | None = None
    ) -> None:
        """The run's state; `turn_id` when a resume moves it to the turn that resumed it;
        `result`, the final message a background run's notice carries."""
        await self.db.execute(
            "UPDATE subagent_runs SET status = ?, turn_id = COALESCE(?, turn_id),"
            " result = COALESCE(?, result), updated_at = ? WHERE id = ?",
            (status, turn_id, result, timestamp(), run_id),
        )

    async def interrupt_running(self) -> list[SubagentRun]:
        """At start (one process owns a home): the runs a dead or stopped process left `running`
        ended with it; each is now `interrupted` (resumable), and returned."""

        def write(conn: sqlite3.Connection) -> list[SubagentRun]:
            rows = conn.execute("SELECT * FROM subagent_runs WHERE status = 'running' ORDER BY id").fetchall()
            conn.execute(
                "UPDATE subagent_runs SET status = 'interrupted', updated_at = ? WHERE status = 'running'",
                (timestamp(),),
            )
            return [replace(_run(row), status="interrupted") for row in rows]

        return await self.db.transaction(write)

    async def pending_notices(self) -> list[tuple[SubagentRun, str | None]]:
        """Background runs that ended and whose parent was not told yet, oldest first, each
        with its result (None: it never recorded one, having been cut short)."""
        rows = await self.db.fetchall(
            "SELECT * FROM subagent_runs WHERE notice_pending = 1 AND status != 'running' ORDER BY id"
        )
        return [(_run(row), row["result"]) for row in rows]

    async def told(self, run_ids: Sequence[str]) -> None:
        """The parent was told these runs' ends: no notice is owed for them any more."""
        if not run_ids:
            return
        marks = ", ".join("?" * len(run_ids))
        await self.db.execute(f"UPDATE subagent_runs SET notice_pending = 0 WHERE id IN ({marks})", tuple(run_ids))


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
        background=bool(row["background"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
