"""What a sandbox is and can do: `GET /v2/sandbox` and `GET /v1/capabilities` (seed 002).

Seed 002 asks that both list `files`. `/v2/sandbox` adds the session, the machine
(name, kind, os, root) and, for a bubblewrap sandbox, how it is isolated as the host
measured it (`SandboxHost.capabilities`). `/v1/capabilities` is not upstream AIO (no SDK
method calls it); its list is in `data.capabilities` and, for a caller that reads the
reply as the list's holder, at the top level too.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox import __version__
from agentbox.api.envelope import ok
from agentbox.api.sandboxes import CurrentSandbox, Sandbox
from agentbox.api.schemas import SANDBOX_FAILURES, Envelope, failures
from agentbox.machines.base import Lifetime

router = APIRouter(tags=["sandbox"])

#: Feature groups this server offers on every sandbox: `/v2/fs/*` and `/v1/file/*`,
#: `/v2/watch`, `/v2/commands`.
CAPABILITIES: tuple[str, ...] = ("files", "watch", "commands")


class MachineInfo(BaseModel):
    name: str
    kind: str
    os: str
    root: str
    isolated: bool


class SandboxInfo(BaseModel):
    """What `GET /v2/sandbox` says: the session, what the API can do, the machine, its isolation."""

    session_id: str | None
    version: str
    capabilities: list[str]
    machine: MachineInfo
    isolation: dict[str, Any] | None


class Capabilities(BaseModel):
    capabilities: list[str]
    version: str


class CapabilitiesReply(Envelope[Capabilities]):
    """The list in `data.capabilities` and at the top level too."""

    capabilities: list[str]


def machine_info(sandbox: Sandbox) -> dict[str, Any]:
    machine = sandbox.machine
    return {
        "name": machine.name,
        "kind": machine.kind,
        "os": machine.os,
        "root": machine.root,
        "isolated": machine.isolated,
    }


def isolation(sandbox: Sandbox) -> dict[str, Any] | None:
    """How the machine is isolated, for the sandbox kind; None for shared machines."""
    machine = sandbox.machine
    if isinstance(machine, Lifetime):
        return machine.capabilities()
    return None


@router.get("/v2/sandbox", response_model=Envelope[SandboxInfo], responses=failures(*SANDBOX_FAILURES))
async def describe(sandbox: CurrentSandbox) -> JSONResponse:
    return ok(
        {
            "session_id": sandbox.session_id,
            "version": __version__,
            "capabilities": list(CAPABILITIES),
            "machine": machine_info(sandbox),
            "isolation": isolation(sandbox),
        }
    )


@router.get("/v1/capabilities", response_model=CapabilitiesReply)
async def capabilities() -> JSONResponse:
    names = list(CAPABILITIES)
    return ok({"capabilities": names, "version": __version__}, capabilities=names)
