"""A session's external MCP servers as `mcp__<server>__<tool>` tools, against real servers.

Here they are the operator's servers (`host()`: configured, named by the session), which run
on the host: stdio, a small lowlevel MCP server written by the test and run with this
interpreter; streamable HTTP, `/mcp` of the session-wide real `agentbox serve` (the `server`
fixture). Failures are real too: a command that exits at once, one that does not exist, a
closed port. A session's own servers (run in its sandbox, URLs under its reach) are
tests/adversarial/test_session_supplied.py's and the end of this file's.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import Server
from mcp.shared.message import SessionMessage

from agentbox.agent import mcp_tools
from agentbox.agent.mcp_tools import (
    McpConfigError,
    McpTools,
    ServerSpec,
    check_servers,
    mangle,
)
from agentbox.agent.reach import Reach
from agentbox.config import MachineConfig
from agentbox.machines.base import ExecRequest
from agentbox.machines.local import LocalMachine
from agentbox.tools.base import Action, ImageBlock, TextBlock, Tool, ToolResult
from agentbox.tools.tiers import Decision, Tier, decide

SERVER_SCRIPT = textwrap.dedent(
    """
    import anyio
    import mcp.types as mt
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    TOOLS = [
        mt.Tool(name="echo.v1", description="Echo the text.", input_schema=SCHEMA,
                annotations=mt.ToolAnnotations(read_only_hint=True)),
        mt.Tool(name="fail", description="Always fails.", input_schema={"type": "object"}),
        mt.Tool(name="picture", description="A tiny image.", input_schema={"type": "object"},
                annotations=mt.ToolAnnotations(read_only_hint=False)),
    ]

    async def on_list_tools(ctx, params):
        return mt.ListToolsResult(tools=TOOLS)

    async def on_call_tool(ctx, params):
        args = params.arguments or {}
        if params.name == "echo.v1":
            return mt.CallToolResult(content=[mt.TextContent(type="text", text="echo: " + args["text"])])
        if params.name == "picture":
            return mt.CallToolResult(content=[
                mt.TextContent(type="text", text="here"),
                mt.ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png"),
            ])
        return mt.CallToolResult(content=[mt.TextContent(type="text", text="it broke")], is_error=True)

    async def main():
        server = Server("test-server", on_list_tools=on_list_tools, on_call_tool=on_call_tool)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "server.py"
    path.write_text(SERVER_SCRIPT)
    return path


def stdio(name: str, script: Path, **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": [sys.executable, str(script)], **extra}


def host(entries: list[Any]) -> McpTools:
    """`entries` as the operator's configured servers, and a session that names each of them."""
    operator = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries}
    return McpTools([{"server": name} for name in operator], operator)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def call(tool: Tool, args: dict[str, Any]) -> ToolResult:
    return await tool.run(None, tool.params.model_validate(args))  # type: ignore[arg-type]


def test_names_are_mangled() -> None:
    assert mangle("files", "read") == "mcp__files__read"
    assert mangle("my server.v2", "echo/it!") == "mcp__my_server_v2__echo_it_"
    assert mangle("a-b_C9", "x-y_Z0") == "mcp__a-b_C9__x-y_Z0"


def test_entries_are_checked() -> None:
    spec = ServerSpec.parse({"name": "s", "url": "http://x/mcp", "headers": {"A": "b"}, "trusted": True})
    assert (spec.url, spec.headers, spec.trusted, spec.command) == ("http://x/mcp", {"A": "b"}, True, [])
    assert ServerSpec.parse({"name": "s", "command": "srv"}).command == ["srv"]
    assert ServerSpec.parse({"name": "s", "command": ["srv"], "trusted": "yes"}).trusted is False
    for bad in (
        "srv",
        {"command": ["srv"]},
        {"name": "s"},
        {"name": "s", "command": ["srv"], "url": "http://x"},
        {"name": "s", "command": []},
        {"name": "s", "command": ["srv"], "env": {"A": 1}},
    ):
        with pytest.raises(McpConfigError):
            ServerSpec.parse(bad)


async def test_lists_wraps_and_gates_the_tools(script: Path) -> None:
    async with host([stdio("plain server", script), stdio("trusted", script, trusted=True)]) as mcp:
        assert mcp.errors == []
        assert sorted(mcp.tools) == [
            "mcp__plain_server__echo_v1", "mcp__plain_server__fail", "mcp__plain_server__picture",
            "mcp__trusted__echo_v1", "mcp__trusted__fail", "mcp__trusted__picture",
        ]  # fmt: skip
        plain, trusted = mcp.tools["mcp__plain_server__echo_v1"], mcp.tools["mcp__trusted__echo_v1"]
        # the server's read-only hint only counts for a server the session trusts
        assert (plain.action, plain.read_only) == (Action.MCP, False)
        assert (trusted.action, trusted.read_only) == (Action.READ, True)
        assert mcp.tools["mcp__trusted__picture"].action == Action.MCP
        assert mcp.tools["mcp__trusted__fail"].action == Action.MCP  # no annotation at all
        assert plain.schema()["required"] == ["text"]
        assert "Echo the text." in plain.description
        assert decide(Tier.READ_ONLY, plain.action) == Decision.FORBID
        assert decide(Tier.FULL_ASK, plain.action) == Decision.ASK
        assert decide(Tier.READ_ONLY, trusted.action) == Decision.ALLOW


async def test_calls_return_text_images_and_errors(script: Path) -> None:
    async with host([stdio("s", script)]) as mcp:
        echoed = await call(mcp.tools["mcp__s__echo_v1"], {"text": "hi"})
        assert (echoed.is_error, echoed.content) == (False, [TextBlock("echo: hi")])
        picture = await call(mcp.tools["mcp__s__picture"], {})
        assert picture.content == [TextBlock("here"), ImageBlock("image/png", "iVBORw0KGgo=")]
        failed = await call(mcp.tools["mcp__s__fail"], {})
        assert (failed.is_error, failed.as_text()) == (True, "it broke")
        invalid = await call(mcp.tools["mcp__s__echo_v1"], {})  # the server checks its own schema
        assert invalid.is_error


async def test_failed_connections_are_recorded_not_raised(script: Path, tmp_path: Path) -> None:
    entries: list[Any] = [
        {"name": "exits", "command": [sys.executable, "-c", "import sys; sys.stderr.write('no config')"]},
        {"name": "missing", "command": [str(tmp_path / "no-such-server")]},
        {"name": "closed", "url": f"http://127.0.0.1:{closed_port()}/mcp"},
        {"name": "broken"},
        stdio("good", script),
    ]
    async with host(entries) as mcp:
        assert sorted(mcp.tools) == ["mcp__good__echo_v1", "mcp__good__fail", "mcp__good__picture"]
        errors = {e.server: e.message for e in mcp.errors}
        assert sorted(errors) == ["broken", "closed", "exits", "missing"]
        assert "failed to connect" in errors["exits"] and "no config" in errors["exits"]
        assert "failed to connect" in errors["missing"] and "failed to connect" in errors["closed"]


async def test_a_call_after_the_server_went_away_is_an_error_result(script: Path) -> None:
    mcp = host([stdio("s", script)])
    await mcp.connect()
    tool = mcp.tools["mcp__s__echo_v1"]
    await mcp.close()
    result = await call(tool, {"text": "hi"})
    assert result.is_error and "not connected" in result.as_text()
    await mcp.close()  # closing twice is harmless


async def test_streamable_http_with_headers(server: Server) -> None:
    entry = {
        "name": "agentbox",
        "url": server.url + "/mcp",
        "headers": {"X-Agentbox-Session": "mcp-tools-http"},
        "trusted": True,
    }
    async with host([entry]) as mcp:
        assert mcp.errors == []
        assert mcp.tools["mcp__agentbox__read_file"].action == Action.READ
        assert mcp.tools["mcp__agentbox__write_file"].action == Action.MCP
        assert mcp.tools["mcp__agentbox__bash"].action == Action.MCP
        result = await call(mcp.tools["mcp__agentbox__read_file"], {"path": "no-such-file.txt"})
        assert result.is_error
    assert (server.home / "sessions" / "mcp-tools-http").is_dir()  # the header chose the session


async def test_a_silent_server_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mcp_tools, "CONNECT_TIMEOUT", 0.5)
    silent = {"name": "silent", "command": [sys.executable, "-c", "import time; time.sleep(60)"]}
    async with host([silent]) as mcp:
        assert mcp.tools == {}
        assert [e.message for e in mcp.errors] == [
            "MCP server 'silent' failed to connect: no answer within 0.5 s"
        ]


async def test_only_the_tail_of_stderr_is_quoted() -> None:
    code = f"import sys; sys.stderr.write('x' * 10 + 'y' * {mcp_tools.STDERR_TAIL})"
    async with host([{"name": "noisy", "command": [sys.executable, "-c", code]}]) as mcp:
        (error,) = mcp.errors
        assert error.message.endswith("stderr: " + "y" * mcp_tools.STDERR_TAIL)


# ---------------------------------------------------------------- a session's own servers


def test_an_entry_names_the_operators_server_or_is_the_sessions_own() -> None:
    operator = {"ops": {"command": ["srv"], "trusted": True}}
    named = ServerSpec.parse({"server": "ops"}, operator)
    assert (named.name, named.command, named.trusted, named.host) == ("ops", ["srv"], True, True)
    assert ServerSpec.parse({"server": "ops", "name": "tools"}, operator).name == "tools"
    assert ServerSpec.parse({"name": "ops", "command": ["srv"]}, operator).host is False  # same name: its own
    for bad in ({"server": "nope"}, {"server": "ops", "command": ["sh"]}, {"server": 3}):
        with pytest.raises(McpConfigError):
            ServerSpec.parse(bad, operator)


async def test_a_sessions_servers_are_checked_at_creation(tmp_path: Path) -> None:
    sandbox = MachineConfig("sandbox", "sandbox", {"network": "off"})
    host_machine = MachineConfig("host", "local")
    trusted_host = MachineConfig("ops", "local", allow_full_auto=True)
    command = [{"name": "c", "command": ["srv"]}]
    assert await check_servers(command, {}, sandbox, Reach(network=False))
    assert await check_servers(command, {}, trusted_host, Reach())
    for machine, words in ((None, "machine: none"), (host_machine, "allow_full_auto")):
        with pytest.raises(McpConfigError, match=words):
            await check_servers(command, {}, machine, Reach())
    loopback = [{"name": "u", "url": "http://127.0.0.1:9/mcp"}]
    with pytest.raises(McpConfigError, match="non-public"):
        await check_servers(loopback, {}, sandbox, Reach())
    with pytest.raises(McpConfigError, match="no network"):
        await check_servers([{"name": "u", "url": "https://example.com/mcp"}], {}, sandbox, Reach(False))
    assert await check_servers(loopback, {}, sandbox, Reach(False, ("http://127.0.0.1:9/",)))
    operators = {"o": {"command": ["srv"]}}
    assert await check_servers([{"server": "o"}], operators, None, Reach())  # the operator's: host-side


async def test_a_sessions_url_is_reached_only_where_its_reach_allows(server: Server) -> None:
    entry = {"name": "agentbox", "url": server.url + "/mcp", "headers": {"X-Agentbox-Session": "mcp-reach"}}
    async with McpTools([entry]) as mcp:  # loopback, not listed: refused before any connection
        assert mcp.tools == {}
        assert "non-public address" in mcp.errors[0].message
    async with McpTools([entry], reach=Reach(allowed=(server.url,))) as mcp:  # listed: pinned and used
        assert mcp.errors == [] and "mcp__agentbox__read_file" in mcp.tools


async def test_a_sessions_command_needs_its_machine() -> None:
    async with McpTools([{"name": "c", "command": ["true"]}]) as mcp:
        assert mcp.tools == {} and "runs inside its machine" in mcp.errors[0].message


async def test_a_line_past_the_limit_ends_the_connection(tmp_path: Path) -> None:
    """`process_streams` over a real process: a line of `max_line` bytes passes, one more does not."""
    limit = 200
    head = '{"jsonrpc":"2.0","id":1,"result":{"p":"'
    fitting = head + "x" * (limit - len(head) - 3) + '"}}'
    assert len(fitting) == limit
    code = f"import sys; sys.stdout.write({fitting!r} + chr(10) + {fitting[:-3] + 'x' + fitting[-3:]!r} + chr(10))"
    machine = LocalMachine("local", tmp_path)
    process = await machine.spawn(ExecRequest(argv=(sys.executable, "-c", code), interactive=True))
    async with mcp_tools.process_streams(process, bytearray(), max_line=limit) as (read, _write):
        first = await read.receive()
        assert isinstance(first, SessionMessage) and first.message.id == 1
        with pytest.raises(anyio.EndOfStream):
            await read.receive()
