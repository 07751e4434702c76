"""The sessions API: sessions, messages, the event log, turns, approvals, change sets.

    POST   /v1/sessions                                   201 the session
    GET    /v1/sessions                 ?after&limit      {items, has_more, next_after}
    GET    /v1/sessions/{id}                              the session + status, sandbox, usage, last_seq
    PATCH  /v1/sessions/{id}            permission_mode, metadata (the rest: 400 not supported)
    DELETE /v1/sessions/{id}                              {id, deleted: true}; retires the id
    POST   /v1/sessions/{id}/messages   {content, files}  202 {turn_id, ...}; Idempotency-Key
    GET    /v1/sessions/{id}/events     ?after&limit      {items, has_more, next_after}
    GET    /v1/sessions/{id}/events/stream                SSE, resumable (Last-Event-ID / ?after)
    GET    /v1/sessions/{id}/turns[/{turn_id}]            POST .../turns/{turn_id}/abort, .../abort
    GET    /v1/sessions/{id}/subagents[/{run_id}]         subagent runs; one with its transcript
    GET    /v1/sessions/{id}/approvals  ?status=pending   POST .../approvals/{approval_id}
    GET    /v1/sessions/{id}/changes[/{cid}]              POST .../changes/{cid}/apply|reject
    POST   /v1/sessions/{id}/browser/takeover | release   the user drives the session's browser

Mounted once at the root: a session is not a sandbox route. The routes only translate HTTP
to the `Worker` (writes) and the stores (reads); every refusal of theirs is an error type
mapped to a status in `ERRORS` (by `SessionRoute`), sent in the envelope of the rest of the
API. A body that does not parse is a 400 here (not the 422 of the sandbox routes): the
sessions API has one status for "bad input", whether the shape or a value is wrong.

The SSE stream is a view of the same log as the JSON page: `id: <seq>`, `event: <type>`,
`data: <the event's JSON>`; it replays from the cursor, then tails (`EventBus.subscribe`
reads every event from the database, so the two views cannot differ). `until=turn_end`
closes after the terminal event of the turn open at request time; with none open, of the
last turn: at once, after what follows the cursor, when the cursor is already past its end
(nothing is left to wait for), and of the first turn when the session has had none. So a
client posts its message first, then opens the stream with the cursor it had. A comment line is sent after `heartbeat` seconds without events.
With `?deltas=true` the stream also carries the reply text as it is produced: `event:
agent.message.delta` frames (`{type, session_id, turn_id, text, index}`) WITHOUT an `id:` line,
so they never move a client's Last-Event-ID; they are not stored, so the JSON page and a
replay never have them, and the `agent.message` after them carries the whole text.

Applying or rejecting a change set appends `change_set.updated` (the set's id, status and each
operation's status) to the session's log, committed then published, as a session-level event
(no turn_id): it is the user's act, and often comes after the turn that staged the set ended.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from agentbox.agent.events import Delta
from agentbox.agent.models import ModelError, model_name_problem
from agentbox.agent.vision import MODEL_MEDIA_TYPES
from agentbox.agent.worker import NO_MACHINE, PLAN
from agentbox.api.callers import caller_level
from agentbox.api.envelope import BodyError, body_errors, failure, json_body, parse_body, query_error, wire
from agentbox.api.schemas import event_stream, failures, plain_reply
from agentbox.config import MAX_LEVEL
from agentbox.machines.errors import MachineDenied, MachineNotFound
from agentbox.store.approvals import Approval, ApprovalNotFound, ApprovalNotPending
from agentbox.store.changes import (
    ChangeSet,
    ChangeSetNotFound,
    OperationNotFound,
    OperationNotPending,
    OperationStatus,
    SetStatus,
)
from agentbox.store.images import ImageNotFound
from agentbox.store.sessions import (
    MAX_EVENTS_PAGE,
    MAX_SEQ,
    TERMINAL_EVENTS,
    UPDATABLE,
    Event,
    IdempotencyConflict,
    NewEvent,
    Session,
    SessionNotFound,
    SessionStore,
    Turn,
    TurnNotFound,
    UnknownFiles,
    UnsupportedUpdate,
)
from agentbox.store.subagents import SubagentRun, SubagentRunNotFound
from agentbox.system import System
from agentbox.tools.browser import has_browser
from agentbox.tools.changes import GovernedMachine
from agentbox.workspace.browser import Browser
from agentbox.workspace.errors import WorkspaceError

#: Model names besides "scripted": `<provider>:<model>` (runs fail until the runtime issue adds them).
#: Longest `Idempotency-Key` accepted (a UUID is 36; room for client prefixes).
MAX_IDEMPOTENCY_KEY_CHARS = 255
#: Sessions and events listed per page when `limit` is not given.
LIST_LIMIT_DEFAULT = 100
#: The most sessions one page may ask for.
SESSIONS_LIMIT_MAX = 1000
#: Seconds without an event before the stream sends a heartbeat comment (default, least, most).
HEARTBEAT_DEFAULT_S = 15.0
HEARTBEAT_MIN_S = 1.0
HEARTBEAT_MAX_S = 300.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

#: Each refusal of the layers below: (HTTP status, the envelope's `error_type`).
ERRORS: dict[type[Exception], tuple[int, str]] = {
    SessionNotFound: (404, "not_found"),
    TurnNotFound: (404, "not_found"),
    SubagentRunNotFound: (404, "not_found"),
    ImageNotFound: (404, "not_found"),
    ApprovalNotFound: (404, "not_found"),
    ChangeSetNotFound: (404, "not_found"),
    OperationNotFound: (404, "not_found"),
    UnknownFiles: (400, "bad_request"),
    UnsupportedUpdate: (400, "not_supported"),
    MachineNotFound: (400, "bad_request"),
    MachineDenied: (403, "machine_denied"),
    ModelError: (400, "bad_request"),  # a malformed script (ScriptError)
    ValueError: (400, "bad_request"),  # the worker's and repos' validation of values
    IdempotencyConflict: (409, "conflict"),
    ApprovalNotPending: (409, "conflict"),
    OperationNotPending: (409, "conflict"),
}


class NotInSession(LookupError):
    """An approval, change set or turn that exists, but in another session: reported as not found."""


ERRORS[NotInSession] = (404, "not_found")


class InPlanMode(Exception):
    """The session is in plan mode, where nothing changes: its change sets wait until it leaves."""


ERRORS[InPlanMode] = (409, "conflict")


def refusal(exc: Exception) -> JSONResponse:
    status, error_type = next(v for t, v in ERRORS.items() if isinstance(exc, t))
    detail = WorkspaceError(error_type, str(exc), "session", exception_type=type(exc).__name__)
    response = failure(detail)
    response.status_code = status
    return response


class SessionRoute(APIRoute):
    """Maps `ERRORS` to envelopes and a bad body to 400, for every route of this router."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                await check_level(request)
                return await handle(request)
            except BodyError as exc:
                response = body_errors(exc.errors)
                response.status_code = 400
                return response
            except tuple(ERRORS) as exc:
                return refusal(exc)

        return guarded


async def check_level(request: Request) -> None:
    """A caller below `MAX_LEVEL` reaches a session only if its level admits the session's
    machine (`api.callers`): every route under `/v1/sessions/{id}` acts on or shows it."""
    level, session_id = caller_level(request), request.path_params.get("session_id")
    if level >= MAX_LEVEL or session_id is None:
        return
    p = platform(request)
    try:
        session = await p.store.get_session(session_id)
    except SessionNotFound:
        return  # the route says so (or acts on an MCP client's id, opening at the caller's level)
    if session.machine != NO_MACHINE:
        p.registry.check(p.registry.config(session.machine or None), level)


router = APIRouter(
    prefix="/v1/sessions",
    tags=["sessions"],
    route_class=SessionRoute,
    responses=failures(*sorted({status for status, _ in ERRORS.values()})),
)


# ---------------------------------------------------------------- the services behind the routes


def platform(request: Request) -> System:
    """The server's one `System` (`agentbox.system`), built in the app's lifespan."""
    return cast(System, request.app.state.system)


# ---------------------------------------------------------------- bodies


KNOWLEDGE_BASES_DOC = (
    "Folders of the workspace this session treats as knowledge bases besides the whole workspace and the "
    "configured ones: [{id, path, name}], `path` relative to the workspace root and inside it."
)
KNOWLEDGE_BASE_IDS_DOC = (
    "The knowledge bases the tools work in, first the one relative paths start from; absent: every one "
    "(`workspace` first). Any other path is external to the tools."
)


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description='"scripted", "openai:<name>" or "anthropic:<name>".')
    instructions: str = ""
    mcp_servers: list[Any] = Field(
        default_factory=list,
        description='{"name", "command"} (runs in the session\'s machine), {"name", "url"}, or {"server": "<name>"} '
        "(the operator's); see agentbox.agent.mcp_tools.",
    )
    toolset: str = "default"
    permission_mode: str | None = Field(
        None,
        description="A tier or `plan`; absent: the machine's default (full-auto in a sandbox, full-ask on the host).",
    )
    machine: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    script: list[Any] | None = Field(None, description="The scripted model's steps.")
    model_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Provider options: base_url, api_key, timeout, context_window, max_output_tokens; "
        "other keys (temperature, max_tokens, ...) go into each request body. Secrets are redacted when shown.",
    )
    compaction: bool | dict[str, Any] | None = Field(
        None,
        description="false, or {reserve_tokens, keep_recent_tokens, model}; absent = the defaults. `model` "
        "writes the summary: the session's own or a configured one.",
    )
    knowledge_bases: list[Any] = Field(
        default_factory=list,
        description=KNOWLEDGE_BASES_DOC,
    )
    knowledge_base_ids: list[str] | None = Field(None, description=KNOWLEDGE_BASE_IDS_DOC)


class UpdateSession(BaseModel):
    """Only these may change; any other field is refused as not supported."""

    model_config = ConfigDict(extra="allow")

    permission_mode: str | None = None
    metadata: dict[str, Any] | None = None
    knowledge_bases: list[Any] | None = Field(None, description=KNOWLEDGE_BASES_DOC)
    knowledge_base_ids: list[str] | None = Field(None, description=KNOWLEDGE_BASE_IDS_DOC + " null: all.")


class PostMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    files: list[str] = Field(default_factory=list, description="File ids from POST /v1/files.")


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["allow", "deny"]
    scope: Literal["once", "session"] = "once"
    message: str | None = Field(None, description="For a deny: what the model is told.")


class Decide(BaseModel):
    model_config = ConfigDict(extra="forbid")

    operations: list[str] | None = Field(None, description="Operation ids; all pending ones when absent.")
    message: str | None = Field(None, description="For a reject: kept as the reason.")


# ---------------------------------------------------------------- replies
# The routes return plain dicts: these document them (`responses=`) and never filter them.


class SandboxRef(BaseModel):
    machine: str
    state: str
    generation: int


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    model_calls: int


class SessionView(BaseModel):
    """A session's record (secrets redacted), what it is doing, its sandbox and its usage."""

    id: str
    model: str
    instructions: str
    mcp_servers: list[Any]
    toolset: str
    permission_mode: str
    machine: str | None
    metadata: dict[str, Any]
    script: list[Any] | None
    status: str = Field(description="What it is doing now: idle, or its active turn's state.")
    created_at: str
    updated_at: str
    model_options: dict[str, Any]
    compaction: Any
    knowledge_bases: list[dict[str, Any]] = Field(description=KNOWLEDGE_BASES_DOC)
    knowledge_base_ids: list[str] | None = Field(description=KNOWLEDGE_BASE_IDS_DOC)
    sandbox: SandboxRef | None
    usage: Usage
    last_seq: int


class SessionPage(BaseModel):
    items: list[SessionView]
    has_more: bool
    next_after: str | None


class SessionDeleted(BaseModel):
    id: str
    deleted: bool


class Submitted(BaseModel):
    """An accepted message: its turn, and whether this request created it (an idempotent retry: not)."""

    turn_id: str
    created: bool
    turn: Turn


class TurnList(BaseModel):
    items: list[Turn]


class AbortedTurn(BaseModel):
    turn: Turn | None


class SubagentRunList(BaseModel):
    items: list[SubagentRun]


class KnowledgeBaseView(BaseModel):
    id: str
    name: str
    path: str = Field(description="Its folder, relative to the workspace root (`.`: the workspace itself).")
    source: Literal["workspace", "config", "session"]
    selected: bool
    base: bool = Field(description="Whether relative paths start at its root (the first selected).")


class KnowledgeBaseList(BaseModel):
    items: list[KnowledgeBaseView]


class SubagentMessage(BaseModel):
    """One message of a child's conversation (as the child's model saw it)."""

    role: Literal["user", "assistant", "tool"]
    text: str
    tool_calls: list[dict[str, Any]]
    tool_use_id: str | None
    is_error: bool
    blocks: list[dict[str, Any]] | None = Field(
        None,
        description="A tool result that showed images: its texts and images in order, each image "
        "by `image_id` (its bytes at `GET /v1/sessions/{id}/images/{image_id}`).",
    )
    created_at: str


class SubagentTranscript(BaseModel):
    """A subagent run and its whole conversation."""

    run: SubagentRun
    messages: list[SubagentMessage]


class SessionEvent(BaseModel):
    """An event: these keys, and its type's payload beside them (flat)."""

    id: str
    seq: int
    type: str
    session_id: str
    turn_id: str | None
    created_at: str


class EventPage(BaseModel):
    items: list[SessionEvent]
    has_more: bool
    next_after: int


class ApprovalList(BaseModel):
    items: list[Approval]


class OperationView(BaseModel):
    """One staged operation (its full texts left out; `diff` only in a single set's view)."""

    id: str
    change_set_id: str
    seq: int
    tool: str
    kind: str
    path: str
    dest: str | None
    summary: str
    diff: str | None = None
    before_chars: int
    after_chars: int
    files: int
    warnings: list[str]
    status: OperationStatus
    reason: str | None
    trash_path: str | None
    created_at: str
    resolved_at: str | None


class ChangeSetView(BaseModel):
    id: str
    session_id: str
    turn_id: str | None
    status: SetStatus
    created_at: str
    updated_at: str
    operations: list[OperationView]
    machine: str | None


class ChangeSetList(BaseModel):
    items: list[ChangeSetView]


# ---------------------------------------------------------------- sessions


@router.post(
    "", status_code=201, openapi_extra=json_body(CreateSession), responses=plain_reply(SessionView, 201)
)
async def create_session(request: Request) -> Any:
    body = await parse_body(request, CreateSession)
    problem = model_name_problem(body.model)
    if problem is not None:
        raise ValueError(f"model {problem}")
    p = platform(request)
    if body.machine != NO_MACHINE:  # the caller's level must admit the machine it asks for
        p.registry.check(p.registry.config(body.machine), caller_level(request))
    session = await p.worker.create_session(
        body.model, permission_mode=body.permission_mode, instructions=body.instructions,
        mcp_servers=body.mcp_servers, toolset=body.toolset, machine=body.machine,
        metadata=body.metadata, script=body.script, model_options=body.model_options,
        compaction=body.compaction, knowledge_bases=body.knowledge_bases,
        knowledge_base_ids=body.knowledge_base_ids,
    )  # fmt: skip
    return JSONResponse(await view(p, session), status_code=201)


@router.get("", responses=plain_reply(SessionPage))
async def list_sessions(
    request: Request,
    after: Annotated[str | None, Query(description="The `next_after` of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=SESSIONS_LIMIT_MAX)] = LIST_LIMIT_DEFAULT,
) -> Any:
    p = platform(request)
    level = caller_level(request)
    if level >= MAX_LEVEL:
        rows = await p.store.list_sessions(after=after, limit=limit + 1)
    else:  # a caller sees only the sessions it may reach (`check_level`)
        machines = p.registry.settings.machines
        allowed = [name for name, config in machines.items() if level >= config.required_level]
        rows = await p.store.list_sessions(
            after=after, limit=limit + 1, machines=[*allowed, NO_MACHINE],
            default_machine=p.registry.settings.default_machine in allowed,
        )  # fmt: skip
    page = rows[:limit]
    has_more = len(rows) > limit
    items = [await view(p, s) for s in page]
    return {"items": items, "has_more": has_more, "next_after": page[-1].id if has_more else None}


@router.get("/{session_id}", responses=plain_reply(SessionView))
async def get_session(request: Request, session_id: str) -> Any:
    p = platform(request)
    return await view(p, await p.store.get_session(session_id))


#: Updatable fields whose null means something (`knowledge_base_ids`: every knowledge base).
NULLABLE = frozenset({"knowledge_base_ids"})


@router.patch("/{session_id}", openapi_extra=json_body(UpdateSession), responses=plain_reply(SessionView))
async def update_session(request: Request, session_id: str) -> Any:
    body = await parse_body(request, UpdateSession)
    changes = body.model_dump(exclude_unset=True)
    nulls = [k for k in UPDATABLE - NULLABLE if k in changes and changes[k] is None]
    if nulls:
        raise ValueError(f"{', '.join(sorted(nulls))} cannot be null")
    p = platform(request)
    return await view(p, await p.worker.update_session(session_id, changes))


@router.delete("/{session_id}", responses=plain_reply(SessionDeleted))
async def delete_session(request: Request, session_id: str) -> Any:
    """Aborts the active turn, removes the session's events and its sandbox (machines stopped,
    workspace removed); its files stay. The id is retired: later requests to its sandbox are
    refused with 410 `session_deleted` (see `agentbox.api.sandboxes`)."""
    p = platform(request)
    await p.store.get_session(session_id)  # 404 before anything is retired
    await p.registry.retire(session_id)  # first: no request brings an empty sandbox back while it closes
    await p.worker.delete_session(session_id)
    await p.services.forget(session_id)
    return {"id": session_id, "deleted": True}


async def view(p: System, session: Session) -> dict[str, Any]:
    """The session as the API shows it: its record, what it is doing, its sandbox and usage."""
    data = session.to_dict()
    data["status"] = await p.store.activity(session.id)
    entry = None if session.machine == NO_MACHINE else p.registry.entry(session.id, session.machine)
    data["sandbox"] = (
        None
        if entry is None
        else {"machine": entry.config.name, "state": entry.state, "generation": entry.generation}
    )
    data["usage"] = await usage(p.store, session.id)
    data["last_seq"] = await p.store.last_seq(session.id)
    return data


async def usage(store: SessionStore, session_id: str) -> dict[str, int]:
    """Tokens and model calls summed over the session's `model.usage` events."""
    totals = {"input_tokens": 0, "output_tokens": 0, "model_calls": 0}
    cursor = 0
    while page := await store.list_events(
        session_id, after=cursor, limit=MAX_EVENTS_PAGE, types=["model.usage"]
    ):
        for event in page:
            totals["input_tokens"] += int(event.data.get("input_tokens") or 0)
            totals["output_tokens"] += int(event.data.get("output_tokens") or 0)
            totals["model_calls"] += 1
        cursor = page[-1].seq
    return totals


# ---------------------------------------------------------------- messages and turns


@router.post(
    "/{session_id}/messages",
    status_code=202,
    openapi_extra=json_body(PostMessage),
    responses=plain_reply(Submitted, 202),
)
async def post_message(
    request: Request,
    session_id: str,
    idempotency_key: Annotated[str | None, Header(max_length=MAX_IDEMPOTENCY_KEY_CHARS)] = None,
) -> Any:
    """Accepted = committed (turn, `user.message`, `turn.queued`); a retry with the same key
    returns the first turn (`created: false`) and writes nothing."""
    body = await parse_body(request, PostMessage)
    p = platform(request)
    submission = await p.worker.submit(session_id, body.content, body.files, idempotency_key or None)
    turn = submission.turn
    data = {"turn_id": turn.id, "created": submission.created, "turn": turn.to_dict()}
    return JSONResponse(data, status_code=202)


@router.get("/{session_id}/turns", responses=plain_reply(TurnList))
async def list_turns(request: Request, session_id: str) -> Any:
    p = platform(request)
    await p.store.get_session(session_id)
    return {"items": [t.to_dict() for t in await p.store.list_turns(session_id)]}


@router.get("/{session_id}/knowledge-bases", responses=plain_reply(KnowledgeBaseList))
async def list_knowledge_bases(request: Request, session_id: str) -> Any:
    """Every knowledge base the session has (the workspace, the configured ones of its machine,
    its own), and which it selected; change them with PATCH `knowledge_bases` / `knowledge_base_ids`."""
    p = platform(request)
    session = await p.store.get_session(session_id)
    scope = p.worker.knowledge(session).scope("/")
    return {
        "items": [
            {"id": kb.id, "name": kb.name, "path": posixpath.relpath(kb.root, "/"),
             "source": kb.source, "selected": kb.id in scope.selected, "base": kb.id == scope.selected[0]}
            for kb in scope.registered
        ]
    }  # fmt: skip


@router.get("/{session_id}/subagents", responses=plain_reply(SubagentRunList))
async def list_subagents(request: Request, session_id: str) -> Any:
    """The session's subagent runs (each `task` call's child), oldest first."""
    p = platform(request)
    await p.store.get_session(session_id)
    return {"items": [r.to_dict() for r in await p.worker.runs.of_session(session_id)]}


@router.get("/{session_id}/subagents/{run_id}", responses=plain_reply(SubagentTranscript))
async def get_subagent(request: Request, session_id: str, run_id: str) -> Any:
    """One run with its transcript; a run of another session is not found."""
    p = platform(request)
    await p.store.get_session(session_id)
    run = await p.worker.runs.get(session_id, run_id)
    return {"run": run.to_dict(), "messages": [m.to_dict() for m in await p.worker.runs.messages(run.id)]}


BINARY = {"type": "string", "format": "binary"}
#: Headers of an image a transcript showed: its bytes never change under its id (its sha256).
IMAGE_HEADERS = {"Cache-Control": "private, max-age=31536000, immutable", "X-Content-Type-Options": "nosniff"}


@router.get(
    "/{session_id}/images/{image_id}",
    response_class=Response,
    responses={200: {"description": "The image's bytes, as the model was shown them",
                     "content": {m: {"schema": BINARY} for m in sorted(MODEL_MEDIA_TYPES)}}},
)  # fmt: skip
async def get_image(request: Request, session_id: str, image_id: str) -> Response:
    """An image the session's transcript names (`agent.tool_result` content blocks of type
    `image` carry its `image_id`): the bytes the model was shown, after fitting. An id that
    this session's transcript does not name is not found, whatever other sessions saw."""
    p = platform(request)
    await p.store.get_session(session_id)
    media_type = await p.store.shown_image(session_id, image_id)
    if media_type is None:
        raise ImageNotFound(image_id)
    return Response(await p.worker.images.get(image_id), media_type=media_type, headers=IMAGE_HEADERS)


@router.get("/{session_id}/turns/{turn_id}", responses=plain_reply(Turn))
async def get_turn(request: Request, session_id: str, turn_id: str) -> Any:
    return (await platform(request).store.get_turn(turn_id, session_id)).to_dict()


@router.post("/{session_id}/turns/{turn_id}/abort", responses=plain_reply(Turn))
async def abort_turn(request: Request, session_id: str, turn_id: str) -> Any:
    """The turn as it stands after: `aborted`, or the terminal state it had reached already."""
    p = platform(request)
    await p.store.get_turn(turn_id, session_id)
    return (await p.worker.abort(turn_id)).to_dict()


@router.post("/{session_id}/abort", responses=plain_reply(AbortedTurn))
async def abort_active(request: Request, session_id: str) -> Any:
    """Abort the session's active turn; `turn` is null when nothing was open."""
    p = platform(request)
    await p.store.get_session(session_id)
    turn = await p.worker.abort_active(session_id)
    return {"turn": turn.to_dict() if turn is not None else None}


# ---------------------------------------------------------------- the browser


class BrowserControl(BaseModel):
    """Who drives the session's browser after the call."""

    taken_over: bool
    cancelled: int = Field(description="Browser actions under way that the takeover cancelled.")


class NoBrowser(ValueError):
    """The session's machine has no browser to take over."""


async def session_browser(p: System, session_id: str) -> Browser:
    session = await p.store.get_session(session_id)
    if session.machine == NO_MACHINE:
        raise NoBrowser(f"session {session_id} has no machine, so no browser")
    services = await p.services.get(session_id, session.machine or None)
    if not has_browser(services.machine):
        raise NoBrowser(
            f"machine {services.machine.name!r} has no browser (its entry does not set `browser = true`)"
        )
    return services.browser()


async def browser_event(p: System, session_id: str, kind: str, data: dict[str, Any]) -> None:
    turn = await p.store.active_turn(session_id)
    p.bus.publish(await p.store.append(session_id, turn.id if turn else None, [NewEvent(kind, data)]))


@router.post("/{session_id}/browser/takeover", responses=plain_reply(BrowserControl))
async def take_over_browser(request: Request, session_id: str) -> Any:
    """The user drives the session's browser: the action under way is cancelled, the turn's
    remaining tool calls are not run (the turn ends with `user_takeover`), and the agent's
    browser calls are refused until `release`. Emits `browser.takeover`."""
    p = platform(request)
    browser = await session_browser(p, session_id)
    cancelled = await browser.take_over()
    await browser_event(p, session_id, "browser.takeover", {"cancelled": cancelled})
    return {"taken_over": True, "cancelled": cancelled}


@router.post("/{session_id}/browser/release", responses=plain_reply(BrowserControl))
async def release_browser(request: Request, session_id: str) -> Any:
    """Hand the browser back to the agent. Emits `browser.released`."""
    p = platform(request)
    browser = await session_browser(p, session_id)
    browser.release()
    await browser_event(p, session_id, "browser.released", {})
    return {"taken_over": False, "cancelled": 0}


# ---------------------------------------------------------------- events


@router.get("/{session_id}/events", responses=plain_reply(EventPage))
async def list_events(
    request: Request,
    session_id: str,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="Events with a greater seq.")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS_PAGE)] = LIST_LIMIT_DEFAULT,
) -> Any:
    p = platform(request)
    await p.store.get_session(session_id)
    events = await p.store.list_events(session_id, after=after, limit=limit)
    last = await p.store.last_seq(session_id)
    has_more = bool(events) and events[-1].seq < last
    return {
        "items": [e.to_dict() for e in events],
        "has_more": has_more,
        "next_after": events[-1].seq if events else after,
    }


@router.get(
    "/{session_id}/events/stream",
    response_class=StreamingResponse,
    responses=event_stream("The events, replayed then live: `event` is the type, `id` the seq"),
)
async def stream_events(
    request: Request,
    session_id: str,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="Replay events with a greater seq.")] = 0,
    until: Annotated[Literal["turn_end"] | None, Query(description="Close after a turn's end.")] = None,
    heartbeat: Annotated[float, Query(ge=HEARTBEAT_MIN_S, le=HEARTBEAT_MAX_S)] = HEARTBEAT_DEFAULT_S,
    deltas: Annotated[bool, Query(description="Also send unstored `agent.message.delta` frames.")] = False,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    """`Last-Event-ID` (a reconnecting client's cursor) wins over `after`."""
    p = platform(request)
    await p.store.get_session(session_id)
    cursor = after
    if last_event_id is not None:
        seq = last_event_id.strip()
        if not (seq.isascii() and seq.isdigit()) or len(seq) > len(str(MAX_SEQ)) or int(seq) > MAX_SEQ:
            return query_error(f"Invalid request parameters: Last-Event-ID: {last_event_id!r} is not a seq")
        cursor = int(seq)
    target = await turn_to_follow(p.store, session_id, cursor) if until == "turn_end" else None
    frames = sse(p, session_id, cursor, target, heartbeat, deltas)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


@dataclass
class Follow:
    """The turn `until=turn_end` waits for: `turn_id`, or else the first turn with an id > `floor`;
    `ended`: that turn's end is already behind the cursor, so the stream only replays."""

    turn_id: str | None
    floor: str
    ended: bool = False

    def matches(self, event: Event) -> bool:
        if self.turn_id is None and event.turn_id is not None and event.turn_id > self.floor:
            self.turn_id = event.turn_id  # turn ids sort by creation: this is the next turn
        return event.turn_id is not None and event.turn_id == self.turn_id and event.type in TERMINAL_EVENTS


async def turn_to_follow(store: SessionStore, session_id: str, cursor: int) -> Follow:
    """The open turn that runs now; else the last turn, `ended` if its end is not after `cursor`
    (the client has seen it); else, in a session that has had no turn, the first one."""
    turns = await store.list_turns(session_id)  # before active_turn: a turn submitted between is caught
    active = await store.active_turn(session_id)
    if active is not None:
        return Follow(active.id, "")
    if not turns:
        return Follow(None, "")
    last = turns[-1]
    unseen = await store.list_events(
        session_id, after=cursor, turn_id=last.id, types=TERMINAL_EVENTS, limit=1
    )
    return Follow(last.id, last.id, ended=not unseen)


async def sse(
    p: System, session_id: str, after: int, follow: Follow | None, heartbeat: float, deltas: bool = False
) -> AsyncIterator[str]:
    if follow is not None and follow.ended:
        async for stored in replay(p.store, session_id, after):
            yield frame(stored)
        return
    async for event in p.bus.subscribe(session_id, after, idle_timeout=heartbeat, deltas=deltas):
        if event is None:
            if not await session_exists(p.store, session_id):
                return  # deleted while streaming: nothing more will come
            yield ": heartbeat\n\n"
            continue
        if isinstance(event, Delta):
            yield f"event: {event.type}\ndata: {_json(event.to_dict())}\n\n"  # no id: not in the log
            continue
        yield frame(event)
        if follow is not None and follow.matches(event):
            return


async def replay(store: SessionStore, session_id: str, after: int) -> AsyncIterator[Event]:
    """The stored events after `after`, page by page, as they stand now."""
    while page := await store.list_events(session_id, after=after, limit=MAX_EVENTS_PAGE):
        for event in page:
            yield event
        after = page[-1].seq


def frame(event: Event) -> str:
    return f"id: {event.seq}\nevent: {event.type}\ndata: {_json(event.to_dict())}\n\n"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def session_exists(store: SessionStore, session_id: str) -> bool:
    try:
        await store.get_session(session_id)
    except SessionNotFound:
        return False
    return True


# ---------------------------------------------------------------- approvals


@router.get("/{session_id}/approvals", responses=plain_reply(ApprovalList))
async def list_approvals(
    request: Request,
    session_id: str,
    status: Annotated[Literal["pending"] | None, Query(description="Only unanswered ones.")] = None,
) -> Any:
    p = platform(request)
    await p.store.get_session(session_id)
    repo = p.approvals.repo
    rows = await (repo.pending(session_id) if status == "pending" else repo.of_session(session_id))
    return {"items": wire(rows)}


@router.post(
    "/{session_id}/approvals/{approval_id}", openapi_extra=json_body(Answer), responses=plain_reply(Approval)
)
async def answer_approval(request: Request, session_id: str, approval_id: str) -> Any:
    """Answer once (a second answer is 409); an allow with scope `session` covers later calls."""
    body = await parse_body(request, Answer)
    p = platform(request)
    approval = await p.approvals.repo.get(approval_id)
    if approval.session_id != session_id:
        raise NotInSession(f"no approval {approval_id} in session {session_id}")
    answered = await p.approvals.resolve(approval_id, body.decision, body.scope, body.message)
    return wire(answered)


# ---------------------------------------------------------------- change sets


@router.get("/{session_id}/changes", responses=plain_reply(ChangeSetList))
async def list_changes(request: Request, session_id: str) -> Any:
    """A session's change sets: a sessions-API session's, or those MCP staged under its id."""
    p = platform(request)
    sets = await p.changes.repo.of_session(session_id)
    if not sets:
        await p.store.get_session(session_id)  # 404 for an id nothing has used
    return {"items": [change_set_view(s, diffs=False) for s in sets]}


@router.get("/{session_id}/changes/{change_set_id}", responses=plain_reply(ChangeSetView))
async def get_changes(request: Request, session_id: str, change_set_id: str) -> Any:
    return change_set_view(await change_set_of(platform(request), session_id, change_set_id), diffs=True)


@router.post(
    "/{session_id}/changes/{change_set_id}/apply",
    openapi_extra=json_body(Decide),
    responses=plain_reply(ChangeSetView),
)
async def apply_changes(request: Request, session_id: str, change_set_id: str) -> Any:
    """Apply the named operations (all pending when none are named); each ends applied or failed."""
    body = await parse_body(request, Decide)
    p = platform(request)
    change_set = await change_set_of(p, session_id, change_set_id)
    chosen = operations_of(change_set, body.operations)
    try:
        session: Session | None = await p.store.get_session(session_id)
    except SessionNotFound:
        if change_set.machine is None:
            raise
        session = None  # an MCP client's id: no session row, never in plan
    if session is not None and session.permission_mode == PLAN:
        raise InPlanMode(
            f"session {session_id} is in plan mode, where nothing changes: switch its permission_mode to "
            "a tier first, then apply"
        )
    name = change_set.machine or cast(Session, session).machine
    machine = cast(GovernedMachine, await p.registry.open(session_id, name, level=caller_level(request)))
    await p.changes.apply(machine, chosen)
    return change_set_view(await changes_updated(p, change_set_id), diffs=True)


@router.post(
    "/{session_id}/changes/{change_set_id}/reject",
    openapi_extra=json_body(Decide),
    responses=plain_reply(ChangeSetView),
)
async def reject_changes(request: Request, session_id: str, change_set_id: str) -> Any:
    """Reject the named operations (all pending when none are named); nothing touches the disk."""
    body = await parse_body(request, Decide)
    p = platform(request)
    change_set = await change_set_of(p, session_id, change_set_id)
    await p.changes.reject(operations_of(change_set, body.operations), body.message)
    return change_set_view(await changes_updated(p, change_set_id), diffs=True)


async def changes_updated(p: System, change_set_id: str) -> ChangeSet:
    """The set as it stands after a decision, told to the session's log (`change_set.updated`);
    an MCP client's session id has no log to tell."""
    change_set = await p.changes.repo.get(change_set_id)
    data = {
        "change_set_id": change_set.id,
        "status": change_set.status,
        "operations": [
            {"id": op.id, "summary": op.summary, "status": op.status, "reason": op.reason}
            for op in change_set.operations
        ],
    }
    try:
        appended = await p.store.append(change_set.session_id, None, [NewEvent("change_set.updated", data)])
    except SessionNotFound:
        return change_set
    p.bus.publish(appended)
    return change_set


async def change_set_of(p: System, session_id: str, change_set_id: str) -> ChangeSet:
    """The change set, which must be the session's (a session of the API, or an MCP client's id)."""
    change_set = await p.changes.repo.get(change_set_id)
    if change_set.session_id != session_id:
        raise NotInSession(f"no change set {change_set_id} in session {session_id}")
    return change_set


def operations_of(change_set: ChangeSet, named: list[str] | None) -> list[str]:
    """The ids to decide: the named ones (which must be this set's), or every pending one."""
    if named is None:
        return [op.id for op in change_set.pending()]
    known = {op.id for op in change_set.operations}
    foreign = [op_id for op_id in named if op_id not in known]
    if foreign:
        raise ValueError(f"not operations of change set {change_set.id}: {', '.join(foreign)}")
    if not named:
        raise ValueError("`operations` is empty: name at least one, or leave it out for all pending")
    return list(dict.fromkeys(named))


#: Operation fields left out of views: the full texts (the diff shows the change) and the fingerprint.
_HIDDEN: tuple[str, ...] = ("before", "after", "expect")


def change_set_view(change_set: ChangeSet, *, diffs: bool) -> dict[str, Any]:
    hidden = _HIDDEN if diffs else (*_HIDDEN, "diff")
    operations: list[Mapping[str, Any]] = [
        {k: v for k, v in wire(op).items() if k not in hidden} for op in change_set.operations
    ]
    data = wire(change_set)
    data["operations"] = operations
    return cast(dict[str, Any], data)
