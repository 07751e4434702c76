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

from agentbox.machines.errors import MachineError
from agentbox.system import System
from agentbox.tools.services import MachineServices

#: What a route acts on: one machine and its services.
Sandbox = MachineServices


async def current(request: Request) -> Sandbox:
    """FastAPI dependency: the machine named by the route's prefix (or the default session's)."""
    system = cast(System, request.app.state.system)
    return await system.services.get(request.path_params.get("session_id"))


#: A route parameter that receives the current sandbox: `sandbox: CurrentSandbox`.
CurrentSandbox = Annotated[Sandbox, Depends(current)]


__all__ = ["CurrentSandbox", "MachineError", "Sandbox", "current"]
