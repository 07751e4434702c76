"""Waiting for the user: a tool call that must ask blocks here until someone answers.

`Approvals.request_and_wait` first looks for a session-wide grant of the same (tool,
action), except for the actions asked for on every call (`EACH_CALL`: exec, external reads,
web), whose answers are never kept for the session; otherwise it records a pending approval (a row first, so a restart keeps the
question), tells the listeners (the sessions API turns that into an `approval.requested`
event), and waits on an `asyncio.Event` that `resolve` sets, from whichever task answers.
The row is the truth: the waiter reads the decision back from it.

One `Approvals` per server: `resolve` can only wake waiters of the same instance. A
waiting call that is cancelled (its turn was stopped) marks its approval `cancelled`; a
process that dies leaves it `pending`, and `wait(approval_id)` can pick it up again. So does
a shutdown: once `shutting_down` is set, cancelled waiters leave their approvals pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from agentbox.store.approvals import Approval, ApprovalNotPending, ApprovalsRepo, Decision, Scope
from agentbox.tools.tiers import EACH_CALL

log = logging.getLogger(__name__)

EventKind = Literal["approval.requested", "approval.resolved"]
Listener = Callable[[EventKind, Approval], Awaitable[None] | None]


class Approvals:
    def __init__(self, repo: ApprovalsRepo) -> None:
        self.repo = repo
        self.listeners: list[Listener] = []
        """Called with ("approval.requested" | "approval.resolved", approval); may be async."""
        self._events: dict[str, asyncio.Event] = {}
        self.shutting_down = False
        """Set by the server's shutdown: a waiter cancelled now keeps its question for the next start."""

    async def request_and_wait(
        self, session_id: str, turn_id: str | None, tool: str, action: str, detail: dict[str, Any]
    ) -> tuple[bool, str | None]:
        """(allowed, the user's message) once answered; at once if the session already granted it."""
        if await self.granted(session_id, tool, action):
            return True, None
        approval = await self.repo.request(session_id, turn_id, tool, action, detail)
        self._events.setdefault(approval.id, asyncio.Event())
        await self._notify("approval.requested", approval)
        return await self.wait(approval.id)

    async def granted(self, session_id: str, tool: str, action: str) -> bool:
        """Whether an answer for the session lets (tool, action) through without asking; never
        for the `EACH_CALL` actions, whatever an older answer recorded."""
        return action not in EACH_CALL and await self.repo.granted(session_id, tool, action)

    async def wait(self, approval_id: str) -> tuple[bool, str | None]:
        """Wait for an approval (also one left pending by an earlier process) to be answered."""
        event = self._events.setdefault(approval_id, asyncio.Event())
        try:
            approval = await self.repo.get(approval_id)
            if approval.status == "pending":
                await event.wait()
                approval = await self.repo.get(approval_id)
        except asyncio.CancelledError:
            if self.shutting_down:
                raise
            with contextlib.suppress(ApprovalNotPending):
                cancelled = await asyncio.shield(self.repo.cancel(approval_id))
                await self._notify("approval.resolved", cancelled)
            raise
        finally:
            self._events.pop(approval_id, None)
        return approval.allowed, approval.message

    async def resolve(
        self, approval_id: str, decision: Decision, scope: Scope = "once", message: str | None = None
    ) -> Approval:
        """Answer an approval (see `ApprovalsRepo.resolve`) and wake the call waiting for it. An
        allow for the session of an `EACH_CALL` action is recorded as `once`: it never silences
        the next call."""
        if scope == "session" and (await self.repo.get(approval_id)).action in EACH_CALL:
            scope = "once"
        approval = await self.repo.resolve(approval_id, decision, scope, message)
        event = self._events.get(approval_id)
        if event is not None:
            event.set()
        await self._notify("approval.resolved", approval)
        return approval

    async def _notify(self, kind: EventKind, approval: Approval) -> None:
        for listener in list(self.listeners):
            try:
                result = listener(kind, approval)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("approval listener failed on %s of %s", kind, approval.id)
