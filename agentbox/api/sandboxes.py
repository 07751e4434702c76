"""Sandboxes: the machine a request acts on, and their lifecycle API.

Root routes act on the default session's sandbox; `/sandboxes/{session_id}/...` on that
session's, opened lazily. Each machine has one watch hub, one command manager and one editor
history for its whole life (they survive the sandbox being reclaimed and rebuilt, since the
machine object does): the system's `Services` (`agentbox.tools.services`), which the turn
loop's tools and MCP share.

A sandbox and a session share one id. A session of `/v1/sessions` runs its turns in the
sandbox of its id (on the machine it was created with); `/sandboxes/{id}/...`, `agentbox exec
--session ID` and `agentbox mcp --session ID` reach that same sandbox. Any other id names a
sandbox of its own on the default machine, made on first use, with no session. So:

    GET    /v1/sandboxes           ?after&limit   {items, has_more, next_after}
    GET    /v1/sandboxes/{id}                     one sandbox (404 not_found if the id holds none)
    DELETE /v1/sandboxes/{id}                     stops its machines, removes its workspace

Deleting a sandbox frees it, and its id stays usable: the next request (or the session's
next turn) starts an empty one; a sandbox whose session has a turn open is not deleted (409
conflict: abort the turn first). Deleting a session retires its id: every later request to
its sandbox, by any surface, is refused with 410 `session_deleted` (v1 routes too) instead
of making a new empty sandbox; GET and DELETE here answer the same 410. On a shared machine
(local, ssh) an id holds no state of its own, so there is nothing to list or refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.requests import HTTPConnection

from agentbox.agent.worker import NO_MACHINE
from agentbox.api.callers import caller_level
from agentbox.api.envelope import failure
from agentbox.api.schemas import failures, plain_reply
from agentbox.api.sessions import LIST_LIMIT_DEFAULT
from agentbox.machines.errors import MachineError, MachineNotFound
from agentbox.machines.registry import SandboxState, deleted
from agentbox.store.db import timestamp
from agentbox.store.sessions import Session, SessionNotFound
from agentbox.system import System
from agentbox.tools.services import MachineServices
from agentbox.workspace.errors import WorkspaceError, translate

#: What a route acts on: one machine and its services.
Sandbox = MachineServices
#: The most sandboxes one page may ask for (each item measures its workspace on disk).
SANDBOXES_LIMIT_MAX = 200


async def current(request: HTTPConnection) -> Sandbox:
    """FastAPI dependency (and a WebSocket route's call): the machine of the session the
    route's prefix names (the default session's without one). A session of the sessions API acts on the machine it was created
    with; any other id, on the default machine."""
    system = cast(System, request.app.state.system)
    session_id = request.path_params.get("session_id")
    machine = await session_machine(system, session_id)
    return await system.services.get(session_id, machine, level=caller_level(request))


async def session_machine(system: System, session_id: str | None) -> str | None:
    """The machine a sessions-API session runs on; None (the default) for an id with no session.

    Looked up once per id, with or without a session: the server mints every session's id
    (`ids.new_id`), so an id asked for without one never gets one later, and an id's sandbox
    requests cost no database transaction after the first.
    """
    if session_id is None:
        return None
    machine = system.services.routes.get(session_id)
    if machine is None:
        try:
            machine = (await system.store.get_session(session_id)).machine or ""
        except SessionNotFound:
            machine = ""  # the default; remembered too, since no session can appear under this id later
        system.services.remember(session_id, machine)
    if machine == NO_MACHINE:  # every time, not only on the lookup that remembered it
        raise MachineNotFound(f"session {session_id} was created without a machine")
    return machine or None


#: A route parameter that receives the current sandbox: `sandbox: CurrentSandbox`.
CurrentSandbox = Annotated[Sandbox, Depends(current)]


# ---------------------------------------------------------------- the lifecycle API


class LifecycleRoute(APIRoute):
    """Failures in the envelope with their error type's status: these are not AIO's v1 routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handle(request)
            except MachineError as exc:
                return failure(translate(exc, "sandbox", exc.path))
            except WorkspaceError as exc:
                return failure(exc)

        return guarded


router = APIRouter(
    prefix="/v1/sandboxes",
    tags=["sandboxes"],
    route_class=LifecycleRoute,
    responses=failures(404, 409, 410, 500, 503),
)


class SandboxMachine(BaseModel):
    name: str
    kind: str
    state: str


class SandboxView(BaseModel):
    """A sandbox: its id (a session's, or any other id's), the machine its requests act on, its state."""

    session_id: str
    session: bool = Field(description="Whether a session of the sessions API has this id.")
    machine: str | None
    kind: str | None
    state: str = Field(description="running, or stopped (reclaimed when idle, or only a workspace on disk).")
    machines: list[SandboxMachine]
    workspace_bytes: int
    last_used_at: str | None


class SandboxPage(BaseModel):
    items: list[SandboxView]
    has_more: bool
    next_after: str | None


class SandboxDeleted(BaseModel):
    session_id: str
    deleted: bool


@router.get("", responses=plain_reply(SandboxPage))
async def list_sandboxes(
    request: Request,
    after: Annotated[str | None, Query(description="The `next_after` of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=SANDBOXES_LIMIT_MAX)] = LIST_LIMIT_DEFAULT,
) -> Any:
    """Every sandbox in id order: a per-session machine open (running, or reclaimed when idle:
    stopped) or a workspace on disk (stopped until its next use)."""
    system = platform(request)
    states = await system.registry.sandboxes(after, limit + 1)
    page = states[:limit]
    has_more = len(states) > limit
    items = [await view(system, state) for state in page]
    return {"items": items, "has_more": has_more, "next_after": page[-1].session_id if has_more else None}


@router.get("/{session_id}", responses=plain_reply(SandboxView))
async def get_sandbox(request: Request, session_id: str) -> Any:
    """One sandbox; 404 `not_found` if the id holds none, 410 `session_deleted` if its session was deleted."""
    system = platform(request)
    return await view(system, await held(system, session_id))


@router.delete("/{session_id}", responses=plain_reply(SandboxDeleted))
async def delete_sandbox(request: Request, session_id: str) -> Any:
    """Stop the sandbox's machines and remove its workspace (as a session delete does to its
    sandbox); the session, if any, stays, and its next turn starts an empty sandbox. 409
    `conflict` while the session has a turn open."""
    system = platform(request)
    await held(system, session_id)
    session = await session_of(system, session_id)
    if session is not None and await system.store.activity(session_id) != "idle":
        raise WorkspaceError("conflict", f"session {session_id} has a turn open: abort it first", "sandbox")
    await system.registry.close_session(session_id, purge=True)
    await system.services.forget(session_id)
    return {"session_id": session_id, "deleted": True}


def platform(request: Request) -> System:
    return cast(System, request.app.state.system)


async def held(system: System, session_id: str) -> SandboxState:
    """The id's sandbox, or the refusal: `session_deleted` for a retired id, else `not_found`."""
    state = await system.registry.sandbox(session_id)
    if state is not None:
        return state
    if await system.registry.retired(session_id):
        raise deleted(session_id)
    raise WorkspaceError(
        "not_found", f"no sandbox has the id {session_id}", "sandbox", exception_type="SandboxNotFound"
    )


async def session_of(system: System, session_id: str) -> Session | None:
    try:
        return await system.store.get_session(session_id)
    except SessionNotFound:
        return None


async def view(system: System, state: SandboxState) -> dict[str, Any]:
    """A sandbox as the API shows it; `machine` and `kind` are those its requests act on."""
    session = await session_of(system, state.session_id)
    machines = [{"name": name, "kind": kind, "state": s} for name, kind, s in state.machines]
    machine, kind = (machines[0]["name"], machines[0]["kind"]) if machines else routed(system, session)
    last = state.last_used
    return {
        "session_id": state.session_id,
        "session": session is not None,
        "machine": machine,
        "kind": kind,
        "state": state.state,
        "machines": machines,
        "workspace_bytes": state.workspace_bytes,
        "last_used_at": None if last is None else timestamp(datetime.fromtimestamp(last, UTC)),
    }


def routed(system: System, session: Session | None) -> tuple[str | None, str | None]:
    """The machine an id's requests would open: its session's, else the default."""
    try:
        config = system.registry.config(session.machine if session is not None else None)
    except MachineNotFound:
        return None, None
    return config.name, config.kind


__all__ = ["CurrentSandbox", "MachineError", "Sandbox", "current", "router"]
