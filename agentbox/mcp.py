"""Serving a toolset over MCP: `agentbox mcp` on stdio, `/mcp` on `agentbox serve` (streamable HTTP).

Agents that already exist (Claude Code, Cursor, any MCP client) work inside an agentbox
sandbox through the tools the runtime offers a model. Every call goes through
`SessionTools`, so toolsets, the tier table, change sets and the stale-write check are the
runtime's own, not a second implementation; this module only translates.

Which session (and machine, and toolset):

    stdio   `agentbox mcp --session ID --toolset NAME --machine NAME`: one session for the
            life of the process (`default`, the default toolset, the default machine).
    HTTP    per request: the `X-Agentbox-Session` header or the `?session=` query parameter,
            `X-Agentbox-Toolset` / `?toolset=` likewise; the default machine.

A session's `SessionTools` (one per session and toolset) is built on first use and kept
for the server's life, so the reads map (what `write_file` may overwrite) lasts across
calls and connections, as it does across a runtime session's turns.

Which tier: the machine's default, decided by `session_tier` as for every session. On an
isolated sandbox that is `full-auto`: the sandbox is the boundary, and the MCP client asks
its own user before it calls a tool. On a machine that is not isolated (a `local` machine
the operator configured) it is `full-ask`, and nobody on this side of MCP can answer an
approval: a call that must ask is refused at once with a text saying so (nothing waits, no
approval row is written; a session-wide grant already given to the session still counts),
and writes become pending change sets for the user to review, as in any full-ask session.
An operator whose MCP client confirms every call with its user says so with
`agentbox mcp --client-approves`, which asks for `full-auto`: on an isolated machine always
granted, on the host only where the machine's entry has `allow_full_auto = true` (refused at
start otherwise). HTTP has no such switch: an HTTP caller cannot raise its own tier.

MCP has no turns: each `tools/call` counts as its own turn for per-turn limits (at most 10
deliveries), and staged writes collect in the session's change set without a turn.

What the client sees: per offered tool its name, description, `inputSchema` (the pydantic
JSON schema) and annotations set from the tool itself (`readOnlyHint`, `destructiveHint`;
`openWorldHint` for tools that reach outside the machine: web, browser, external MCP, and
commands on a machine with a network). Results are text and image content, `isError` as the
tool said, and the tool's structured extras (change set ids, delivered files) under
`_meta["agentbox/data"]`.

HTTP is stateless (no MCP session outlives a request), so there is no server-to-client stream
for a `GET` to open: every `GET /mcp` is answered 405 at once (`Allow: POST`), as the
streamable-HTTP transport permits, instead of an event stream that would never carry anything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import mcp.types as mt
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from agentbox import __version__
from agentbox.api.callers import caller_level
from agentbox.config import MAX_LEVEL, Settings
from agentbox.ids import SESSION_ID_RULE, is_session_id
from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError
from agentbox.machines.registry import DEFAULT_SESSION, Registry
from agentbox.store.approvals import ApprovalsRepo
from agentbox.system import System, opened_system
from agentbox.tools.approvals import Approvals
from agentbox.tools.base import Action, Block, ImageBlock, Tool, ToolResult
from agentbox.tools.knowledge_bases import selection
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import Decision, FullAutoRefused, Tier, decide, session_tier
from agentbox.tools.toolsets import DEFAULT_TOOLSET, TOOLSETS
from agentbox.tools.toolsets import toolset as make_toolset

log = logging.getLogger(__name__)

#: Name the server gives itself in the MCP handshake.
SERVER_NAME = "agentbox"
#: HTTP: the request header and query parameter naming the session (`default` without either).
SESSION_HEADER = "x-agentbox-session"
SESSION_PARAM = "session"
#: HTTP: the request header and query parameter naming the toolset (`default` without either).
TOOLSET_HEADER = "x-agentbox-toolset"
TOOLSET_PARAM = "toolset"
#: Key of `CallToolResult._meta` holding the tool's structured extras (`ToolResult.data`).
DATA_META_KEY = "agentbox/data"
#: Actions whose tools reach outside the machine whatever its network (MCP's `openWorldHint`).
OPEN_WORLD_ACTIONS = frozenset({Action.WEB, Action.BROWSER_READ, Action.BROWSER_WRITE, Action.MCP})
#: JSON-RPC "invalid params": what a bad session or toolset choice is answered with over HTTP.
INVALID_PARAMS = -32602
#: JSON-RPC's code for a request the server will not take (a key whose level is too low).
INVALID_REQUEST = -32600
#: JSON-RPC's code for a request the server will not take as sent.
INVALID_REQUEST = -32600
#: JSON-RPC "internal error": the session's machine could not be opened.
INTERNAL_ERROR = -32603

NOBODY_TO_ASK = (
    "nobody can approve calls over this MCP connection: the machine is not isolated, so its tier "
    "({tier}) asks the user first, and agentbox has no user to ask here. If the MCP client confirms every "
    "call with its user, the operator can serve with `agentbox mcp --client-approves`; otherwise use an "
    "isolated sandbox machine."
)


class ChoiceError(ValueError):
    """A session or toolset name a client asked for that cannot be served."""


def check_session(session_id: str) -> str:
    """The session id, if it is one (it becomes a directory name); else `ChoiceError`."""
    if not is_session_id(session_id):
        raise ChoiceError(f"invalid session id {session_id!r}: {SESSION_ID_RULE}")
    return session_id


def served(tools: dict[str, Tool]) -> dict[str, Tool]:
    """The tools an MCP client gets: all but `task`, which needs a model of our own to run a
    subagent; over MCP the client is the agent, and delegates with its own means."""
    return {name: tool for name, tool in tools.items() if tool.action != Action.TASK}


def check_toolset(name: str) -> str:
    if name not in TOOLSETS:
        raise ChoiceError(f"unknown toolset {name!r}; choose one of {', '.join(sorted(TOOLSETS))}")
    return name


# ---------------------------------------------------------------------------- approvals


class Unattended(Approvals):
    """Approvals with nobody to answer them: a question is refused at once, never left waiting.

    A session-wide grant the session already has (given through another channel) still
    allows, as it would in a runtime session.
    """

    def __init__(self, repo: ApprovalsRepo, tier: Tier) -> None:
        super().__init__(repo)
        self.tier = tier

    async def request_and_wait(
        self, session_id: str, turn_id: str | None, tool: str, action: str, detail: dict[str, Any]
    ) -> tuple[bool, str | None]:
        if await self.granted(session_id, tool, action):
            return True, None
        return False, NOBODY_TO_ASK.format(tier=self.tier)


# ---------------------------------------------------------------------------- sessions


@dataclass
class ToolHost:
    """Builds each session's `SessionTools` over the system's machine and services, once, and keeps it.

    Change sets, todos, the file store and each machine's services are the system's own, so
    what a client does here the sessions API and `/v2/...` see.
    """

    system: System
    machine_name: str | None = None
    client_approves: bool = False
    """The MCP client confirms every call with its user: ask for full-auto (`session_tier`)."""
    _sessions: dict[tuple[str, str], SessionTools] = field(init=False, default_factory=dict)

    @property
    def registry(self) -> Registry:
        return self.system.registry

    def tier(self) -> Tier:
        """The served machine's tier (`session_tier`); full-auto refused there is a `ChoiceError`."""
        requested = Tier.FULL_AUTO if self.client_approves else None
        try:
            return session_tier(self.registry.config(self.machine_name), requested)
        except FullAutoRefused as exc:
            raise ChoiceError(f"--client-approves: {exc}") from exc

    async def tools(self, session_id: str, toolset: str = DEFAULT_TOOLSET) -> SessionTools:
        """The session's tools over its machine, opened (or resumed) for this call."""
        check_session(session_id)
        check_toolset(toolset)
        services = await self.system.services.get(session_id, self.machine_name)
        machine = services.machine
        key = (session_id, toolset)
        tools = self._sessions.get(key)
        if tools is None:
            tier = self.tier()
            tools = SessionTools(
                machine=machine,
                session_id=session_id,
                tier=tier,
                toolset=served(make_toolset(toolset)),
                changes=self.system.changes,
                approvals=Unattended(ApprovalsRepo(self.system.db), tier),
                todos=self.system.todos,
                files=self.system.files,
                services=services,
                config=self.system.settings.tools,
                knowledge=selection(self.system.settings.knowledge_bases, self.machine_name),
                file_ids=self.system.worker.file_ids,
            )
            self._sessions[key] = tools
        tools.machine, tools.services = machine, services  # the same unless the session was reopened
        return tools


# ---------------------------------------------------------------------------- translation


def open_world(tool: Tool, machine: Machine | None) -> bool:
    """Whether the tool may reach beyond the machine: the web, or commands on a networked machine."""
    if tool.action in OPEN_WORLD_ACTIONS:
        return True
    if tool.action == Action.EXEC:
        return machine is not None and (not machine.isolated or machine.network_on)
    return False


def describe_tool(tool: Tool, machine: Machine | None) -> mt.Tool:
    return mt.Tool(
        name=tool.name,
        description=tool.description,
        input_schema=tool.schema(),
        annotations=mt.ToolAnnotations(
            read_only_hint=tool.read_only,
            destructive_hint=tool.destructive,
            open_world_hint=open_world(tool, machine),
        ),
    )


def content(block: Block) -> mt.TextContent | mt.ImageContent:
    if isinstance(block, ImageBlock):
        return mt.ImageContent(type="image", data=block.data, mime_type=block.media_type)
    return mt.TextContent(type="text", text=block.text)


def call_result(result: ToolResult) -> mt.CallToolResult:
    meta = {DATA_META_KEY: json.loads(json.dumps(result.data, default=str))} if result.data else None
    return mt.CallToolResult(
        content=[content(b) for b in result.content], is_error=result.is_error, _meta=meta
    )


def refusal(text: str) -> mt.CallToolResult:
    return call_result(ToolResult.error(text))


async def list_tools(tools: SessionTools) -> mt.ListToolsResult:
    return mt.ListToolsResult(tools=[describe_tool(t, tools.machine) for t in tools.offered()])


async def call_tool(tools: SessionTools, name: str, arguments: dict[str, Any] | None) -> mt.CallToolResult:
    """One `tools/call`: the runner's result, except that a question nobody can answer is refused here."""
    tool = tools.toolset.get(name)
    if (
        tool is not None
        and decide(tools.tier, tool.action, plan=tools.plan) == Decision.ASK
        and not await tools.approvals.repo.granted(tools.session_id, name, str(tool.action))
    ):
        return refusal(f"{name} cannot run: " + NOBODY_TO_ASK.format(tier=tools.tier))
    tools.begin_turn(None)
    return call_result(await tools.call(name, arguments or {}))


# ---------------------------------------------------------------------------- the server

Resolve = Callable[[ServerRequestContext[Any, Any]], Awaitable[SessionTools]]


def build_server(resolve: Resolve, instructions: str | None = None) -> Server[Any]:
    """An MCP server whose two handlers act on the `SessionTools` that `resolve` picks per request."""

    async def on_list_tools(
        ctx: ServerRequestContext[Any, Any], params: mt.PaginatedRequestParams | None
    ) -> mt.ListToolsResult:
        try:
            tools = await resolve(ctx)
        except ChoiceError as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from exc
        except MachineError as exc:
            raise MCPError(INTERNAL_ERROR, f"the session's machine is not available: {exc}") from exc
        return await list_tools(tools)

    async def on_call_tool(
        ctx: ServerRequestContext[Any, Any], params: mt.CallToolRequestParams
    ) -> mt.CallToolResult:
        try:
            tools = await resolve(ctx)
        except (ChoiceError, MachineError) as exc:
            return refusal(f"The session's machine is not available: {exc}")
        return await call_tool(tools, params.name, params.arguments)

    return Server(
        SERVER_NAME,
        version=__version__,
        instructions=instructions,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )


def machine_line(tools: SessionTools) -> str:
    m = tools.machine
    where = f"Machine: {m.name} ({m.kind}, {m.os}), workspace {m.root}" if m is not None else "No machine"
    return f"{where}; session {tools.session_id}, permission tier {tools.tier}."


# ---------------------------------------------------------------------------- stdio


async def serve_stdio(
    settings: Settings,
    session_id: str = DEFAULT_SESSION,
    toolset: str = DEFAULT_TOOLSET,
    machine: str | None = None,
    *,
    client_approves: bool = False,
) -> None:
    """Serve one session's tools on stdin/stdout until the client closes stdin.

    The machine is opened before the handshake, so a misconfigured one fails at start (with
    `ChoiceError` or `MachineError`) rather than on the first call; everything is closed on exit.
    """
    check_session(session_id)
    check_toolset(toolset)
    async with opened_system(settings, turns=False) as system:
        host = ToolHost(system, machine, client_approves)
        first = await host.tools(session_id, toolset)

        async def resolve(ctx: ServerRequestContext[Any, Any]) -> SessionTools:
            return await host.tools(session_id, toolset)

        server = build_server(resolve, instructions=machine_line(first))
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())


# ---------------------------------------------------------------------------- HTTP


def choice(request: Request, header: str, param: str, default: str) -> str:
    return request.headers.get(header) or request.query_params.get(param) or default


HTTP_INSTRUCTIONS = (
    "agentbox tools over one session's machine. The session is the X-Agentbox-Session header or the "
    "?session= query parameter (default: 'default'); the toolset X-Agentbox-Toolset or ?toolset= "
    f"({', '.join(TOOLSETS)}; default: {DEFAULT_TOOLSET})."
)


def no_stream() -> JSONResponse:
    """The answer to `GET /mcp`: a stateless server offers no stream (405, a JSON-RPC error body)."""
    message = "this endpoint is stateless and offers no event stream: send JSON-RPC requests with POST"
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": message}}
    return JSONResponse(body, status_code=405, headers={"Allow": "POST"})


class McpHttp:
    """`/mcp` of the HTTP app: a stateless streamable-HTTP endpoint over the app's registry.

    Stateless because nothing lives in an MCP session here: each request names its agentbox
    session, and what lasts (the reads map, change sets) lives in the `ToolHost`. Run its
    session manager in the app's lifespan (`running()`); it reads the system from `app.state`
    on first use, after the lifespan has put it there.
    """

    def __init__(self) -> None:
        self.server = build_server(self._resolve, instructions=HTTP_INSTRUCTIONS)
        self.manager: StreamableHTTPSessionManager | None = None
        self._host: ToolHost | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve requests while inside; a manager runs only once, so each lifespan gets its own."""
        self.manager = StreamableHTTPSessionManager(self.server, stateless=True)
        try:
            async with self.manager.run():
                yield
        finally:
            self.manager = None
            self._host = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            await no_stream()(scope, receive, send)
            return
        if scope["type"] == "http" and caller_level(Request(scope)) < MAX_LEVEL:
            message = (
                "/mcp takes the server's own api_key: it opens any session's machine, whatever its level"
            )
            body = {"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": message}}
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        if scope["type"] == "http":
            try:
                self._choices(Request(scope))
            except ChoiceError as exc:
                body = {"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_PARAMS, "message": str(exc)}}
                await JSONResponse(body, status_code=400)(scope, receive, send)
                return
        if self.manager is None:
            raise RuntimeError("/mcp is served only while the app's lifespan runs (McpHttp.running)")
        await self.manager.handle_request(scope, receive, send)

    def _choices(self, request: Request) -> tuple[str, str]:
        session = check_session(choice(request, SESSION_HEADER, SESSION_PARAM, DEFAULT_SESSION))
        toolset = check_toolset(choice(request, TOOLSET_HEADER, TOOLSET_PARAM, DEFAULT_TOOLSET))
        return session, toolset

    def host(self, state: Any) -> ToolHost:
        if self._host is None:
            self._host = ToolHost(state.system)
        return self._host

    async def _resolve(self, ctx: ServerRequestContext[Any, Any]) -> SessionTools:
        request = ctx.request
        if not isinstance(request, Request):
            raise ChoiceError("this endpoint serves HTTP requests only")
        session, toolset = self._choices(request)
        return await self.host(request.app.state).tools(session, toolset)
