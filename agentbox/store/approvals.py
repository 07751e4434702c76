"""Approvals (seed 001): a tool call's question to the user, kept as a row until answered.

A call that its tier says must ask (an exec in `full-ask`, a read outside the workspace, a
write outside the machine's root) becomes a `pending` row before anyone is told about it,
so a restart loses no question: after one, the row is still pending and the sessions API
still lists it. The user answers once: `allowed` (scope `once`, or `session` to let the same
(tool, action) through for the rest of the session) or `denied` with a message the model
reads. `cancelled` records that the call which asked is gone (its turn was stopped).

Every way this repository refuses:

    LookupError
    └── ApprovalNotFound     no approval has that id
    ApprovalNotPending       it was already answered (or cancelled); answers are final
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from agentbox import ids
from agentbox.store.db import Database
from agentbox.timestamps import parse_timestamp, timestamp

ApprovalStatus = Literal["pending", "allowed", "denied", "cancelled"]
Decision = Literal["allow", "deny"]
Scope = Literal["once", "session"]

DECISIONS: tuple[str, ...] = ("allow", "deny")
SCOPES: tuple[str, ...] = ("once", "session")


class ApprovalNotFound(LookupError):
    pass


class ApprovalNotPending(Exception):
    """The approval was answered already; `approval` is how it stands."""

    def __init__(self, approval: Approval) -> None:
        super().__init__(f"approval {approval.id} is already {approval.status}")
        self.approval = approval


@dataclass(frozen=True)
class Approval:
    id: str
    session_id: str
    turn_id: str | None
    tool: str
    action: str
    detail: dict[str, Any]
    status: ApprovalStatus
    scope: Scope | None
    message: str | None
    created_at: datetime
    resolved_at: datetime | None

    @property
    def allowed(self) -> bool:
        return self.status == "allowed"


class ApprovalsRepo:
    """The `approvals` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def request(
        self, session_id: str, turn_id: str | None, tool: str, action: str, detail: dict[str, Any]
    ) -> Approval:
        """Record a new pending question; `detail` (a JSON object) is what the user is shown."""
        if not isinstance(detail, dict):
            raise TypeError(f"approval detail must be a dict, not {type(detail).__name__}")
        row = await self.db.fetchone(
            "INSERT INTO approvals (id, session_id, turn_id, tool, action, detail, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (ids.new_id(ids.APPROVAL), session_id, turn_id, tool, action, _json(detail), timestamp()),
        )
        assert row is not None
        return _approval(row)

    async def get(self, approval_id: str) -> Approval:
        row = await self.db.fetchone("SELECT * FROM approvals WHERE id = ?", (approval_id,))
        if row is None:
            raise ApprovalNotFound(f"no approval {approval_id}")
        return _approval(row)

    async def resolve(
        self, approval_id: str, decision: Decision, scope: Scope = "once", message: str | None = None
    ) -> Approval:
        """Answer a pending approval; a deny's `message` goes back to the model.

        Only an allow can have scope `session` (a deny is about this call). Answering twice
        raises `ApprovalNotPending`: the first answer may already have run the tool.
        """
        if decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, not {decision!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        if decision == "deny" and scope != "once":
            raise ValueError("a deny is for this call only: scope must be 'once'")
        status: ApprovalStatus = "allowed" if decision == "allow" else "denied"
        return await self._finish(approval_id, status, scope, message)

    async def cancel(self, approval_id: str) -> Approval:
        """Mark a pending approval as no longer awaited (the call that asked was stopped)."""
        return await self._finish(approval_id, "cancelled", None, None)

    async def _finish(
        self, approval_id: str, status: ApprovalStatus, scope: Scope | None, message: str | None
    ) -> Approval:
        row = await self.db.fetchone(
            "UPDATE approvals SET status = ?, scope = ?, message = ?, resolved_at = ?"
            " WHERE id = ? AND status = 'pending' RETURNING *",
            (status, scope, message, timestamp(), approval_id),
        )
        if row is None:
            raise ApprovalNotPending(await self.get(approval_id))
        return _approval(row)

    async def granted(self, session_id: str, tool: str, action: str) -> bool:
        """Whether the user allowed (tool, action) for the rest of `session_id`."""
        row = await self.db.fetchone(
            "SELECT 1 FROM approvals WHERE session_id = ? AND tool = ? AND action = ?"
            " AND status = 'allowed' AND scope = 'session' LIMIT 1",
            (session_id, tool, action),
        )
        return row is not None

    async def pending(self, session_id: str | None = None) -> list[Approval]:
        """Unanswered approvals, oldest first; of one session, or of all."""
        if session_id is None:
            rows = await self.db.fetchall("SELECT * FROM approvals WHERE status = 'pending' ORDER BY id")
        else:
            rows = await self.db.fetchall(
                "SELECT * FROM approvals WHERE session_id = ? AND status = 'pending' ORDER BY id",
                (session_id,),
            )
        return [_approval(row) for row in rows]

    async def of_session(self, session_id: str) -> list[Approval]:
        """Every approval of a session, oldest first."""
        rows = await self.db.fetchall(
            "SELECT * FROM approvals WHERE session_id = ? ORDER BY id", (session_id,)
        )
        return [_approval(row) for row in rows]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _approval(row: sqlite3.Row) -> Approval:
    return Approval(
        id=row["id"],
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        tool=row["tool"],
        action=row["action"],
        detail=json.loads(row["detail"]),
        status=row["status"],
        scope=row["scope"],
        message=row["message"],
        created_at=parse_timestamp(row["created_at"]),
        resolved_at=parse_timestamp(row["resolved_at"]) if row["resolved_at"] else None,
    )
