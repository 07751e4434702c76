"""The machine a request acts on, with the services that live beside it.

Root routes act on the default session's sandbox; `/sandboxes/{session_id}/...` on that
session's, opened lazily. Each machine has one watch hub, one command manager and one editor
history for its whole life (they survive the sandbox being reclaimed and rebuilt, since the
machine object does): the system's `Services` (`agentbox.tools.services`), which the turn
loop's tools and MCP share.
"""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from agentbox.agent.worker import NO_MACHINE
from agentbox.machines.errors import MachineError, MachineNotFound
from agentbox.store.sessions import SessionNotFound
from agentbox.system import System
from agentbox.tools.services import MachineServices

#: What a route acts on: one machine and its services.
Sandbox = MachineServices


async def current(request: Request) -> Sandbox:
    """FastAPI dependency: the machine of the session the route's prefix names (the default
    session's without one). A session of the sessions API acts on the machine it was created
    with; any other id, on the default machine."""
    system = cast(System, request.app.state.system)
    session_id = request.path_params.get("session_id")
    return await system.services.get(session_id, await session_machine(system, session_id))


async def session_machine(system: System, session_id: str | None) -> str | None:
    """The machine a sessions-API session runs on; None (the default) for an id with no session."""
    if session_id is None:
        return None
    known = system.services.routes.get(session_id)
    if known is not None:
        return known or None
    try:
        machine = (await system.store.get_session(session_id)).machine or ""
    except SessionNotFound:
        return None  # nothing to remember: a session made later under this id gets its own machine
    system.services.remember(session_id, machine)
    if machine == NO_MACHINE:
        raise MachineNotFound(f"session {session_id} was created without a machine")
    return machine or None


#: A route parameter that receives the current sandbox: `sandbox: CurrentSandbox`.
CurrentSandbox = Annotated[Sandbox, Depends(current)]


__all__ = ["CurrentSandbox", "MachineError", "Sandbox", "current"]
