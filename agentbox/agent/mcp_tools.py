"""A session's external MCP servers as tools named `mcp__<server>__<tool>`.

A session lists `mcp_servers`, each one of:

    {"name", "command": [...], "env": {...}}          stdio, run INSIDE the session's machine
    {"name", "url", "headers": {...}}                 streamable HTTP, reached under the session's
                                                      network policy (`agentbox.agent.reach`)
    {"server": "<name>"}                              the operator's `[mcp_servers.<name>]` (config
                                                      TOML): the only way to a host-side server

plus `"trusted": bool` on the session's own entries (the operator's entry says it for its own).
Nothing a session supplies runs on the host: its stdio command is spawned in its sandbox
(`Machine.spawn`, newline-delimited JSON-RPC over the process's stdin/stdout, the way
`mcp.client.stdio` speaks it), so a session without a machine (`machine: none`) cannot have
one, and neither can a machine that is not isolated unless its operator allows full-auto
there (the command would otherwise run with the host's rights before any approval). Its URLs
are public addresses only, resolved once and pinned, and refused when its machine has no
network, unless the operator lists them (`model_endpoints`). `check_servers` refuses all of
this when the session is created; the connection checks again.

`McpTools` connects them with the official `mcp` client, lists their tools and wraps each as
a `Tool` with `Action.MCP`, so the permission tier gates it like exec. A server's own
read-only annotation is only believed when the server is marked `trusted`: then the tool is
`Action.READ`.

A server that cannot be reached never fails a turn: its failure is recorded in `errors`
(the caller turns each into a `session.error` event) and a call to one of its tools, or to
a tool whose server went away, comes back as an error result for the model.

Each connection lives in its own task: the client's transports are anyio context managers
whose cancel scopes must be entered and left by the same task, so the owning task enters
them, reports readiness and waits for `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import anyio
import httpx2
import mcp.types as mt
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from pydantic import BaseModel, ConfigDict

from agentbox.agent.reach import Reach, Unreachable
from agentbox.config import MachineConfig
from agentbox.machines.base import ExecRequest, Machine, Process
from agentbox.tools.base import Action, Block, ImageBlock, TextBlock, Tool, ToolContext, ToolResult

PREFIX = "mcp"
"""Tool names are `mcp__<server>__<tool>`."""
CONNECT_TIMEOUT = 30.0
"""Seconds a server gets to start, complete the handshake and list its tools."""
CALL_TIMEOUT = 300.0
"""Seconds one `tools/call` may take before the model gets an error result."""
CLOSE_TIMEOUT = 10.0
"""Seconds `close()` waits for a connection to shut down before cancelling it."""
STDERR_TAIL = 2000
"""Characters of a failed stdio server's stderr quoted in its error."""
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Bytes one JSON-RPC line from a server in a machine may have; a longer one ends the connection."""
READ_CHUNK = 65536
"""Bytes read from a machine process's stdout at a time."""

MachineOpener = Callable[[], Awaitable[Machine | None]]
"""Opens (or resumes) the session's machine; None for a session without one."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class McpConfigError(ValueError):
    """An `mcp_servers` entry that names neither a command nor a URL, or is malformed."""


@dataclass(frozen=True)
class ServerSpec:
    """One `mcp_servers` entry, checked."""

    name: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    trusted: bool = False
    host: bool = False
    """The operator's server (config): runs or is reached from the host. A session's own
    entries never are: their commands run in the session's machine, their URLs under its reach."""

    @classmethod
    def parse(cls, entry: Any, operator: Mapping[str, Mapping[str, Any]] | None = None) -> ServerSpec:
        """A session's entry; `{"server": name}` picks the operator's entry of that name."""
        if isinstance(entry, dict) and "server" in entry:
            return cls.operators(entry, operator or {})
        return cls.read(entry)

    @classmethod
    def operators(cls, entry: dict[str, Any], operator: Mapping[str, Mapping[str, Any]]) -> ServerSpec:
        ref, name = entry.get("server"), entry.get("name", entry.get("server"))
        extra = sorted(set(entry) - {"server", "name"})
        if extra:
            raise McpConfigError(
                f"MCP server {ref!r}: an entry naming the operator's server takes no {extra}"
            )
        if not isinstance(ref, str) or ref not in operator:
            known = ", ".join(sorted(operator)) or "none"
            raise McpConfigError(f"no MCP server {ref!r} is configured by the operator (configured: {known})")
        spec = cls.read({**operator[ref], "name": name})
        return cls(spec.name, spec.command, spec.env, spec.url, spec.headers, spec.trusted, host=True)

    @classmethod
    def read(cls, entry: Any) -> ServerSpec:
        if not isinstance(entry, dict):
            raise McpConfigError(f"an MCP server entry must be an object, not {type(entry).__name__}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise McpConfigError("an MCP server entry needs a non-empty 'name'")
        command, url = entry.get("command"), entry.get("url")
        if isinstance(command, str):
            command = [command]
        if (command is None) == (url is None):
            raise McpConfigError(f"MCP server {name!r} needs exactly one of 'command' or 'url'")
        if command is not None and (not command or not all(isinstance(c, str) for c in command)):
            raise McpConfigError(f"MCP server {name!r}: 'command' must be a non-empty list of strings")
        if url is not None and not isinstance(url, str):
            raise McpConfigError(f"MCP server {name!r}: 'url' must be a string")
        return cls(
            name=name,
            command=list(command or []),
            env=_strings(name, "env", entry.get("env")),
            url=url,
            headers=_strings(name, "headers", entry.get("headers")),
            trusted=entry.get("trusted") is True,
        )


def _strings(server: str, key: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise McpConfigError(f"MCP server {server!r}: {key!r} must map names to strings")
    return {str(k): v for k, v in value.items()}


async def check_servers(
    entries: Sequence[Any],
    operator: Mapping[str, Mapping[str, Any]],
    machine: MachineConfig | None,
    reach: Reach,
) -> list[ServerSpec]:
    """A new session's entries, refused (`McpConfigError`, a ValueError) where they could not be
    used safely: a malformed entry, an unknown operator server, a command with no isolated
    machine to run it in, a URL its reach refuses (resolved now; checked again at connect)."""
    specs = [ServerSpec.parse(entry, operator) for entry in entries]
    for spec in specs:
        if spec.host:
            continue
        if spec.command:
            runs_here(spec, machine)
        elif spec.url is not None:
            try:
                await reach.pin(spec.url, f"MCP server {spec.name!r} url")
            except Unreachable as exc:
                raise McpConfigError(str(exc)) from exc
    return specs


def runs_here(spec: ServerSpec, machine: MachineConfig | None) -> None:
    """A session's stdio server needs a machine to run in, isolated or trusted with full-auto."""
    if machine is None:
        raise McpConfigError(
            f"MCP server {spec.name!r}: a session's stdio MCP server runs inside its machine, and this "
            "session has none (machine: none); use a machine, or a server the operator configured "
            '({"server": "<name>"})'
        )
    if not machine.isolated and not machine.allow_full_auto:
        raise McpConfigError(
            f"MCP server {spec.name!r}: machine {machine.name!r} is the host, not isolated, and a server's "
            f"command would run there before any approval; its operator must set allow_full_auto = true in "
            f"[machines.{machine.name}] to allow it"
        )


@dataclass(frozen=True)
class ServerError:
    """A server that could not be used; the caller reports it as a `session.error` event."""

    server: str
    message: str


def mangle(server: str, tool: str) -> str:
    """`mcp__<server>__<tool>` with every character outside `[A-Za-z0-9_-]` replaced by `_`."""
    return f"{PREFIX}__{_UNSAFE.sub('_', server)}__{_UNSAFE.sub('_', tool)}"


def action_of(spec: ServerSpec, tool: mt.Tool) -> Action:
    """READ only for a read-only-annotated tool of a trusted server; MCP (gated like exec) otherwise."""
    annotations = tool.annotations
    if spec.trusted and annotations is not None and annotations.read_only_hint is True:
        return Action.READ
    return Action.MCP


def params_model(schema: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model that accepts any object and reports the server's own input schema.

    The server validates its arguments itself; the runner only needs an object to pass on.
    """

    class Arguments(BaseModel):
        model_config = ConfigDict(extra="allow")

        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return schema

    return Arguments


def block_of(item: Any) -> Block:
    if isinstance(item, mt.TextContent):
        return TextBlock(item.text)
    if isinstance(item, mt.ImageContent):
        return ImageBlock(item.mime_type, item.data)
    if isinstance(item, mt.ResourceLink):
        return TextBlock(f"[resource {item.uri}]")
    if isinstance(item, mt.EmbeddedResource):
        text = getattr(item.resource, "text", None)
        return TextBlock(text if isinstance(text, str) else f"[resource {item.resource.uri}]")
    return TextBlock(f"[{getattr(item, 'type', type(item).__name__)} content]")


def tool_result(result: Any) -> ToolResult:
    """A `tools/call` answer as a `ToolResult`: text and image blocks, and the server's isError."""
    if not isinstance(result, mt.CallToolResult):
        return ToolResult.error(f"The MCP server answered with an unsupported {type(result).__name__}.")
    blocks = [block_of(item) for item in result.content]
    if not blocks and result.structured_content is not None:
        blocks = [TextBlock(json.dumps(result.structured_content))]
    if not blocks:
        blocks = [TextBlock("(no output)")]
    return ToolResult(blocks, bool(result.is_error))


def describe_failure(exc: BaseException) -> str:
    """The innermost useful message of an exception (anyio wraps failures in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def with_stderr(message: str, stderr: IO[str]) -> str:
    """`message` followed by the tail of what a stdio server wrote to stderr (why it died)."""
    stderr.flush()
    stderr.seek(0)
    tail = stderr.read()[-STDERR_TAIL:].strip()
    return f"{message}; stderr: {tail}" if tail else message


class Connection:
    """One server: connected by its own task, which holds the client open until `close()`."""

    def __init__(
        self, spec: ServerSpec, machine: MachineOpener | None = None, reach: Reach | None = None
    ) -> None:
        self.spec = spec
        self.machine = machine
        self.reach = reach or Reach()
        self.session: ClientSession | None = None
        self.tools: list[mt.Tool] = []
        self.error: str | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def connect(self) -> str | None:
        """Start and wait for the handshake; None when connected, else why not."""
        self._task = asyncio.create_task(self._hold(), name=f"mcp:{self.spec.name}")
        try:
            await asyncio.wait_for(self._ready.wait(), CONNECT_TIMEOUT)
        except TimeoutError:
            self._task.cancel()  # stuck in the handshake: nothing to shut down gracefully
            await asyncio.gather(self._task, return_exceptions=True)
            self.error = f"no answer within {CONNECT_TIMEOUT:g} s"
        return self.error

    async def _hold(self) -> None:
        try:
            if self.spec.url is not None:
                await self._hold_http(self.spec.url)
            else:
                await self._hold_stdio()
        except Exception as exc:
            self.error = self.error or describe_failure(exc)
        finally:
            self.session = None
            if self.error is None:
                self.error = "the connection closed"
            self._ready.set()

    async def _hold_stdio(self) -> None:
        if not self.spec.host:
            await self._hold_in_machine()
            return
        params = StdioServerParameters(
            command=self.spec.command[0], args=self.spec.command[1:], env=self.spec.env or None
        )
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
            try:
                async with stdio_client(params, errlog=stderr) as (read, write):
                    await self._serve(read, write)
            except Exception as exc:
                self.error = self.error or with_stderr(describe_failure(exc), stderr)

    async def _hold_in_machine(self) -> None:
        """The session's own command, spawned inside its machine and spoken to over its pipes."""
        machine = await self.machine() if self.machine is not None else None
        if machine is None:
            self.error = "a session's stdio MCP server runs inside its machine, and there is none"
            return
        request = ExecRequest(argv=tuple(self.spec.command), env=self.spec.env, interactive=True)
        process = await machine.spawn(request)
        stderr = bytearray()
        try:
            async with process_streams(process, stderr) as (read, write):
                await self._serve(read, write)
        except Exception as exc:
            tail = stderr.decode("utf-8", "replace")[-STDERR_TAIL:].strip()
            message = describe_failure(exc)
            self.error = self.error or (f"{message}; stderr: {tail}" if tail else message)

    async def _hold_http(self, url: str) -> None:
        timeout = httpx2.Timeout(CONNECT_TIMEOUT, read=CALL_TIMEOUT)
        if self.spec.host:
            client = httpx2.AsyncClient(headers=self.spec.headers, timeout=timeout)
        else:  # a session's URL: checked, and pinned to the address that passed
            pin = await self.reach.pin(url, f"MCP server {self.spec.name!r} url")
            transport = pin.transport(httpx2.AsyncHTTPTransport())
            client = httpx2.AsyncClient(  # the pinned transport has httpx2's transport interface
                headers=self.spec.headers,
                timeout=timeout,
                transport=transport,  # type: ignore[arg-type]
                trust_env=False,
            )
        async with client as http, streamable_http_client(url, http_client=http) as (read, write):
            await self._serve(read, write)

    async def _serve(self, read: Any, write: Any) -> None:
        async with ClientSession(read, write) as session:
            await session.initialize()
            self.tools = await self._list(session)
            self.session = session
            self._ready.set()
            await self._stop.wait()
            self.error = "the connection was closed"

    @staticmethod
    async def _list(session: ClientSession) -> list[mt.Tool]:
        tools: list[mt.Tool] = []
        cursor: str | None = None
        while True:
            page = await session.list_tools(
                params=mt.PaginatedRequestParams(cursor=cursor) if cursor else None
            )
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        session = self.session
        if session is None:
            return ToolResult.error(f"MCP server {self.spec.name!r} is not connected: {self.error}")
        try:
            result = await session.call_tool(tool, arguments, read_timeout_seconds=CALL_TIMEOUT)
        except Exception as exc:
            return ToolResult.error(
                f"MCP server {self.spec.name!r} failed on {tool}: {describe_failure(exc)}"
            )
        return tool_result(result)

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@asynccontextmanager
async def process_streams(
    process: Process, stderr: bytearray, max_line: int = MAX_MESSAGE_BYTES
) -> AsyncIterator[tuple[Any, Any]]:
    """The `ClientSession` streams over a machine process: newline-delimited JSON-RPC on its
    stdout (each line at most `max_line` bytes; a longer one ends the connection, so memory
    stays bounded) and stdin; the tail of its stderr is kept in `stderr`. On exit the
    process's group is killed."""
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def pump_out() -> None:
        async with read_writer:
            buffer = bytearray()
            while chunk := await process.stdout.read(READ_CHUNK):
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0:
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    if len(line) > max_line:
                        return  # past the limit: the connection ends, the session sees it close
                    if line.strip():
                        await read_writer.send(parse_line(line))
                if len(buffer) > max_line:
                    return

    async def pump_in() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.write_stdin((data + "\n").encode())
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_writer.aclose()  # the process is gone: let pending requests fail

    async def pump_err() -> None:
        while chunk := await process.stderr.read(READ_CHUNK):
            stderr.extend(chunk)
            del stderr[: max(0, len(stderr) - STDERR_TAIL * 4)]

    async with anyio.create_task_group() as tasks:
        for pump in (pump_out, pump_in, pump_err):
            tasks.start_soon(pump)
        try:
            yield read_stream, write_stream
        finally:
            process.kill()
            with anyio.CancelScope(shield=True), contextlib.suppress(OSError):
                await process.close_stdin()
                with anyio.move_on_after(CLOSE_TIMEOUT):
                    await process.wait()
            tasks.cancel_scope.cancel()


def parse_line(line: bytes) -> SessionMessage | Exception:
    """One line from the server; a line that is not JSON-RPC is passed on as the error it is."""
    try:
        return SessionMessage(mt.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


@dataclass
class McpTools:
    """A session's MCP servers: `await connect()`, then `tools`, `errors`; `await close()` at the end.

    `operator`: the operator's servers by name (the config's `mcp_servers`); `machine` opens
    the session's machine, where its own stdio servers run, and `where` is that machine's
    configuration (checked again here by `runs_here`: the config may have changed since the
    session was created); `reach`: its network policy."""

    entries: list[Any]
    operator: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    machine: MachineOpener | None = None
    reach: Reach = field(default_factory=Reach)
    where: MachineConfig | None = None
    tools: dict[str, Tool] = field(default_factory=dict)
    errors: list[ServerError] = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)

    async def connect(self) -> None:
        specs: list[ServerSpec] = []
        for entry in self.entries:
            try:
                spec = ServerSpec.parse(entry, self.operator)
                if spec.command and not spec.host:
                    runs_here(spec, self.where)
                specs.append(spec)
            except McpConfigError as exc:
                name = (entry.get("name") or entry.get("server")) if isinstance(entry, dict) else None
                self.errors.append(ServerError(str(name or "?"), str(exc)))
        self.connections = [Connection(spec, self.machine, self.reach) for spec in specs]
        failures = await asyncio.gather(*(c.connect() for c in self.connections))
        for connection, failure in zip(self.connections, failures, strict=True):
            if failure is not None:
                message = f"MCP server {connection.spec.name!r} failed to connect: {failure}"
                self.errors.append(ServerError(connection.spec.name, message))
                continue
            for remote in connection.tools:
                self._add(connection, remote)

    def _add(self, connection: Connection, remote: mt.Tool) -> None:
        name = mangle(connection.spec.name, remote.name)
        if name in self.tools:
            message = (
                f"MCP tool {remote.name!r} of {connection.spec.name!r} is skipped: {name} already exists"
            )
            self.errors.append(ServerError(connection.spec.name, message))
            return
        self.tools[name] = wrap(connection, remote)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections))

    async def __aenter__(self) -> McpTools:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def wrap(connection: Connection, remote: mt.Tool) -> Tool:
    """One remote tool as a local `Tool`; its run forwards the arguments unchanged."""
    spec = connection.spec
    action = action_of(spec, remote)
    annotations = remote.annotations
    destructive = action != Action.READ and (annotations is None or annotations.destructive_hint is not False)
    description = f"(MCP server {spec.name}) {remote.description or remote.title or remote.name}"

    async def run(ctx: ToolContext, params: Any) -> ToolResult:
        return await connection.call(remote.name, params.model_dump())

    return Tool(
        mangle(spec.name, remote.name),
        description,
        params_model(dict(remote.input_schema)),
        action,
        run,
        read_only=action == Action.READ,
        destructive=destructive,
        machine=False,
    )
