"""A session's external MCP servers as `mcp__<server>__<tool>` tools, against real servers.

stdio: a small lowlevel MCP server written by the test and run with this interpreter.
Streamable HTTP: `/mcp` of the session-wide real `agentbox serve` (the `server` fixture).
Failures are real too: a command that exits at once, one that does not exist, a closed port.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import Server

from agentbox.agent import mcp_tools
from agentbox.agent.mcp_tools import (
    McpConfigError,
    McpTools,
    ServerSpec,
    mangle,
)
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
    async with McpTools([stdio("plain server", script), stdio("trusted", script, trusted=True)]) as mcp:
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
    async with McpTools([stdio("s", script)]) as mcp:
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
    async with McpTools(entries) as mcp:
        assert sorted(mcp.tools) == ["mcp__good__echo_v1", "mcp__good__fail", "mcp__good__picture"]
        errors = {e.server: e.message for e in mcp.errors}
        assert sorted(errors) == ["broken", "closed", "exits", "missing"]
        assert "failed to connect" in errors["exits"] and "no config" in errors["exits"]
        assert "failed to connect" in errors["missing"] and "failed to connect" in errors["closed"]


async def test_a_call_after_the_server_went_away_is_an_error_result(script: Path) -> None:
    mcp = McpTools([stdio("s", script)])
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
    async with McpTools([entry]) as mcp:
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
    async with McpTools([silent]) as mcp:
        assert mcp.tools == {}
        assert [e.message for e in mcp.errors] == [
            "MCP server 'silent' failed to connect: no answer within 0.5 s"
        ]


async def test_only_the_tail_of_stderr_is_quoted() -> None:
    code = f"import sys; sys.stderr.write('x' * 10 + 'y' * {mcp_tools.STDERR_TAIL})"
    async with McpTools([{"name": "noisy", "command": [sys.executable, "-c", code]}]) as mcp:
        (error,) = mcp.errors
        assert error.message.endswith("stderr: " + "y" * mcp_tools.STDERR_TAIL)
