"""The sandbox a request acts on, with the services that live beside it.

Root routes act on the default session's sandbox; `/sandboxes/{session_id}/...` on that
session's, created lazily. Each machine gets one watch hub, one command manager and one
editor history for its whole life (they survive the sandbox being reclaimed and rebuilt,
since the machine object does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError
from agentbox.machines.registry import DEFAULT_SESSION, Registry
from agentbox.workspace.commands import CommandManager
from agentbox.workspace.editor import Editor
from agentbox.workspace.watch import WatchHub


@dataclass
class Sandbox:
    """One machine and its per-machine services."""

    session_id: str
    machine: Machine
    watches: WatchHub
    commands: CommandManager
    editor: Editor


class Sandboxes:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._services: dict[int, Sandbox] = {}

    async def get(self, session_id: str | None = None) -> Sandbox:
        sid = session_id or DEFAULT_SESSION  # the registry refuses an id that is not one
        machine = await self.registry.open(sid)
        key = id(machine)
        sandbox = self._services.get(key)
        if sandbox is None:
            assert isinstance(machine, Machine)
            sandbox = Sandbox(sid, machine, WatchHub(machine), CommandManager(machine), Editor())  # type: ignore[arg-type]
            self._services[key] = sandbox
        return sandbox

    async def forget(self, session_id: str) -> None:
        for key, sandbox in list(self._services.items()):
            if sandbox.session_id == session_id:
                await sandbox.watches.close()
                await sandbox.commands.close()
                del self._services[key]

    async def close(self) -> None:
        for sandbox in self._services.values():
            await sandbox.watches.close()
            await sandbox.commands.close()
        self._services.clear()


async def current(request: Request) -> Sandbox:
    """FastAPI dependency: the sandbox named by the route's prefix (or the default one)."""
    sandboxes: Sandboxes = request.app.state.sandboxes
    return await sandboxes.get(request.path_params.get("session_id"))


#: A route parameter that receives the current sandbox: `sandbox: CurrentSandbox`.
CurrentSandbox = Annotated[Sandbox, Depends(current)]


__all__ = ["CurrentSandbox", "MachineError", "Sandbox", "Sandboxes", "current"]
