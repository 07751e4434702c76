"""The MCP server, driven by the real `mcp` Python client over both transports.

stdio: `python -m agentbox mcp` spawned by `mcp.client.stdio.stdio_client`, with its own
AGENTBOX_HOME (a real sandbox per session). Streamable HTTP: `/mcp` of the session-wide
real `agentbox serve` (the `server` fixture), the session chosen by header or query.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp.types as mt
import pytest
from conftest import Server, on_kinds, start_server, stop_server
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from agentbox.machines.local import LocalMachine
from agentbox.mcp import (
    DATA_META_KEY,
    INVALID_REQUEST,
    ChoiceError,
    call_result,
    check_session,
    check_toolset,
    describe_tool,
)
from agentbox.tools.base import ImageBlock, TextBlock, ToolResult
from agentbox.tools.toolsets import toolset

#: Seconds any one MCP request may take (a sandbox start included).
REQUEST_TIMEOUT = 60.0
#: The default toolset as a server without a search provider offers it (so no `web_search`).
DEFAULT_NAMES = [
    "bash", "read_file", "write_file", "edit_file", "glob", "grep", "todo_write", "deliver_file",
    "use_skill", "read_image", "web_fetch", "list", "search",
]  # fmt: skip


def png_1x1() -> bytes:
    """A real one-pixel PNG (signature, IHDR, IDAT, IEND)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def text_of(result: mt.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, mt.TextContent))


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


# ---------------------------------------------------------------------------- clients


def stdio_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    return {**env, "AGENTBOX_HOME": str(home), "AGENTBOX_NETWORK": "off"}


@asynccontextmanager
async def stdio_session(home: Path, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentbox", "mcp", *args],
        env=stdio_env(home),
        cwd=home.parent,  # no agentbox.toml of the repo's working directory
    )
    with open(home.parent / "mcp-stderr.log", "a") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


@asynccontextmanager
async def http_session(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers=headers or {}, timeout=REQUEST_TIMEOUT) as client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


# ---------------------------------------------------------------------------- the common checks


async def check_default_toolset(session: ClientSession) -> dict[str, mt.Tool]:
    """Names in the default toolset's order; schema and annotations as the tools themselves say."""
    listed = (await session.list_tools()).tools
    assert [t.name for t in listed] == DEFAULT_NAMES
    ours = toolset("default")
    for tool in listed:
        assert tool.input_schema == ours[tool.name].schema()
        assert tool.description == ours[tool.name].description
        assert tool.annotations is not None
        assert tool.annotations.read_only_hint is ours[tool.name].read_only, tool.name
        assert tool.annotations.destructive_hint is ours[tool.name].destructive, tool.name
    by_name = {t.name: t for t in listed}
    assert by_name["read_file"].annotations.read_only_hint is True  # type: ignore[union-attr]
    assert by_name["grep"].annotations.open_world_hint is False  # type: ignore[union-attr]
    assert by_name["bash"].annotations.read_only_hint is False  # type: ignore[union-attr]
    assert by_name["bash"].annotations.destructive_hint is True  # type: ignore[union-attr]
    assert by_name["write_file"].annotations.destructive_hint is True  # type: ignore[union-attr]
    assert by_name["web_fetch"].annotations.open_world_hint is True  # type: ignore[union-attr]
    return by_name


async def check_calls(session: ClientSession, workspace: Path, root: str = "/workspace") -> None:
    """bash, write_file, read_file, grep, read_image and a bad call, over one client session whose
    machine has `root` (the host directory `workspace`) as its working directory."""
    result = await session.call_tool("bash", {"command": "echo hi"})
    assert not result.is_error, text_of(result)
    assert "hi" in text_of(result).splitlines()
    assert result.meta is not None and result.meta[DATA_META_KEY]["exit_code"] == 0

    result = await session.call_tool("write_file", {"path": f"{root}/notes/plan.md", "content": "x"})
    assert result.is_error  # the parent folder does not exist: an error result, not a crash
    result = await session.call_tool("write_file", {"path": f"{root}/plan.md", "content": "step one: mcp\n"})
    assert not result.is_error, text_of(result)
    assert (workspace / "plan.md").read_text() == "step one: mcp\n"

    result = await session.call_tool("read_file", {"path": f"{root}/plan.md"})
    assert not result.is_error, text_of(result)
    assert "step one: mcp" in text_of(result)

    result = await session.call_tool("grep", {"pattern": "one: m[c]p"})
    assert not result.is_error, text_of(result)
    assert f"{root}/plan.md:1:step one: mcp" in text_of(result)

    (workspace / "dot.png").write_bytes(png_1x1())
    result = await session.call_tool("read_image", {"path": f"{root}/dot.png"})
    assert not result.is_error, text_of(result)
    images = [c for c in result.content if isinstance(c, mt.ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data) == png_1x1()

    for bad in ({"command": 5}, {}, {"command": "true", "timeoutSeconds": "soon"}):
        result = await session.call_tool("bash", bad)
        assert result.is_error, bad
        assert text_of(result).startswith("Invalid arguments for bash:"), text_of(result)
    result = await session.call_tool("no_such_tool", {})
    assert result.is_error and "bash" in text_of(result)
    # The connection survived the bad calls.
    assert not (await session.call_tool("bash", {"command": "true"})).is_error


# ---------------------------------------------------------------------------- stdio


async def test_stdio_serves_the_default_toolset_over_a_session_sandbox(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    async with stdio_session(home, "--session", "mcp-stdio") as session:
        assert session.initialize_result is not None
        assert "full-auto" in (session.initialize_result.instructions or "")
        tools = await check_default_toolset(session)
        # The sandbox has no network here, so its commands stay in a closed world.
        assert tools["bash"].annotations.open_world_hint is False  # type: ignore[union-attr]
        await check_calls(session, home / "sessions" / "mcp-stdio" / "workspace")
        result = await session.call_tool("bash", {"command": "cat /workspace/plan.md"})
        assert "step one: mcp" in text_of(result)


async def test_stdio_toolset_option(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    async with stdio_session(home, "--session", "mcp-flue", "--toolset", "workbench") as session:
        names = [t.name for t in (await session.list_tools()).tools]
        assert names == [n for n in ("search", "read", "list", "edit", "write", "exec") if n in names]
        assert {"read", "write", "exec"} <= set(names)
        result = await session.call_tool("exec", {"command": "echo hi"})
        assert "hi" in text_of(result).splitlines()


LOCAL_MACHINE = '[machines.local]\nkind = "local"\nroot = "{root}"\n'


async def test_stdio_on_a_machine_that_is_not_isolated(sandbox_tmp: Path) -> None:
    """full-ask with nobody to ask: exec refused at once, writes staged; --client-approves: full-auto
    where the operator allows it on that machine, refused at start where not."""
    home = sandbox_tmp / "home"
    root = home / "local"
    root.mkdir(parents=True)
    (root / "seen.txt").write_text("local text\n")
    config = home / "agentbox.toml"  # the host is a machine only when the operator configures it
    config.write_text(LOCAL_MACHINE.format(root=root))
    async with stdio_session(home, "--machine", "local") as session:
        assert "full-ask" in (session.initialize_result.instructions or "")  # type: ignore[union-attr]
        assert "bash" in [t.name for t in (await session.list_tools()).tools]
        result = await session.call_tool("bash", {"command": "touch ran"})
        assert result.is_error and "nobody can approve" in text_of(result)
        assert "--client-approves" in text_of(result)
        assert not (root / "ran").exists()
        result = await session.call_tool("write_file", {"path": str(root / "new.txt"), "content": "x\n"})
        assert not result.is_error, text_of(result)
        assert "Staged" in text_of(result) and result.meta is not None
        assert result.meta[DATA_META_KEY]["change_set_id"].startswith("chg_")
        assert not (root / "new.txt").exists()
        result = await session.call_tool("read_file", {"path": str(root / "seen.txt")})
        assert text_of(result) == "local text\n"
        # A read outside the machine's root asks while running; nobody answers, so it is refused.
        result = await session.call_tool("read_file", {"path": str(home / "agentbox.db")})
        assert result.is_error and "nobody can approve" in text_of(result)
    refused = subprocess.run(
        [sys.executable, "-m", "agentbox", "mcp", "--machine", "local", "--client-approves"],
        env=stdio_env(home), cwd=sandbox_tmp, capture_output=True, timeout=REQUEST_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert refused.returncode == 2 and "allow_full_auto" in refused.stderr.decode()
    config.write_text(LOCAL_MACHINE.format(root=root) + "allow_full_auto = true\n")
    async with stdio_session(home, "--machine", "local", "--client-approves") as session:
        assert "full-auto" in (session.initialize_result.instructions or "")  # type: ignore[union-attr]
        result = await session.call_tool("bash", {"command": "echo hi > ran; cat ran"})
        assert not result.is_error and "hi" in text_of(result).splitlines()
        assert (root / "ran").read_text() == "hi\n"


def test_cli_refuses_an_unknown_toolset_or_session(sandbox_tmp: Path) -> None:
    for args, expected in ((["--toolset", "nope"], "unknown toolset"), (["--session", "../x"], "session id")):
        done = subprocess.run(
            [sys.executable, "-m", "agentbox", "mcp", *args],
            env=stdio_env(sandbox_tmp / "home"), cwd=sandbox_tmp, capture_output=True, timeout=REQUEST_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 2
        assert expected in done.stderr.decode()
        assert done.stdout == b""


# ---------------------------------------------------------------------------- streamable HTTP


#: The kinds whose default tier is full-auto: an ssh host is not isolated, so its tier asks and
#: nobody over HTTP MCP can answer (test_mcp_on_a_machine_that_is_not_isolated has that case).
ISOLATED_KINDS = on_kinds("sandbox", "docker")


@ISOLATED_KINDS
async def test_http_serves_the_session_named_by_the_header(kind_server: Server) -> None:
    server, sid = kind_server, "mcp-http"
    root = server.root
    async with http_session(server.url + "/mcp", {"X-Agentbox-Session": sid}) as session:
        await check_default_toolset(session)
        await check_calls(session, server.workspace(sid), root)
    # The query parameter names the same session; the toolset too. Its reads map lasts across
    # connections: write (overwrite) is allowed after a read in an earlier connection.
    async with http_session(server.url + f"/mcp?session={sid}&toolset=flue") as session:
        names = [t.name for t in (await session.list_tools()).tools]
        assert names[:6] == ["read", "write", "edit", "bash", "grep", "glob"]
        result = await session.call_tool("read", {"path": f"{root}/plan.md"})
        assert "step one: mcp" in text_of(result)
        result = await session.call_tool("write", {"path": f"{root}/plan.md", "content": "step two\n"})
        assert not result.is_error, text_of(result)
    assert (server.workspace(sid) / "plan.md").read_text() == "step two\n"


@ISOLATED_KINDS  # and per session: an ssh host is one machine every session shares
async def test_http_default_session_and_session_separation(kind_server: Server) -> None:
    server = kind_server
    async with http_session(server.url + "/mcp", {"X-Agentbox-Session": "mcp-a"}) as a:
        await a.call_tool("write_file", {"path": "/workspace/only-a.txt", "content": "a\n"})
    async with http_session(server.url + "/mcp", {"X-Agentbox-Session": "mcp-b"}) as b:
        result = await b.call_tool("read_file", {"path": "/workspace/only-a.txt"})
        assert result.is_error
    async with http_session(server.url + "/mcp") as default:
        result = await default.call_tool("bash", {"command": "echo $((6 * 7))"})
        assert "42" in text_of(result).splitlines()
    assert server.workspace("default").is_dir()


@on_kinds("ssh")
async def test_mcp_on_a_machine_that_is_not_isolated(kind_server: Server) -> None:
    """Over HTTP on an ssh host: full-ask, and nobody on this side can approve, so exec is refused
    and writes are staged (as over stdio on a local machine, above)."""
    root, remote = kind_server.shared_root, kind_server.root
    assert root is not None
    (root / "seen.txt").write_text("remote text\n")
    async with http_session(kind_server.url + "/mcp", {"X-Agentbox-Session": "mcp-not-isolated"}) as session:
        result = await session.call_tool("bash", {"command": "touch ran"})
        assert result.is_error and "nobody can approve" in text_of(result)
        assert "full-ask" in text_of(result)
        assert not (root / "ran").exists()
        result = await session.call_tool("write_file", {"path": f"{remote}/new.txt", "content": "x\n"})
        assert not result.is_error and "Staged" in text_of(result), text_of(result)
        assert not (root / "new.txt").exists()
        result = await session.call_tool("read_file", {"path": f"{remote}/seen.txt"})
        assert text_of(result) == "remote text\n"


async def test_http_refuses_a_bad_choice(server: Server) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    for extra, url in (
        ({"X-Agentbox-Session": "../etc"}, "/mcp"),
        ({}, "/mcp?session=" + "s" * 129),
        ({"X-Agentbox-Toolset": "nope"}, "/mcp"),
    ):
        response = httpx.post(
            server.url + url, json=body, headers={**headers, **extra}, timeout=REQUEST_TIMEOUT
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == -32602
    # The real client fails its handshake with that message (inside the task groups' exception group).
    with pytest.raises(BaseExceptionGroup) as caught:
        async with http_session(server.url + "/mcp", {"X-Agentbox-Toolset": "nope"}):
            pass
    errors = [e for e in leaves(caught.value) if isinstance(e, MCPError)]
    assert errors and "unknown toolset 'nope'" in str(errors[0])


async def test_http_mcp_needs_the_api_key(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    home.mkdir()
    s = start_server(home, env={"AGENTBOX_API_KEY": "k-123", "AGENTBOX_NETWORK": "off"})
    try:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        assert httpx.post(s.url + "/mcp", json=body, timeout=REQUEST_TIMEOUT).status_code == 401

        async with http_session(s.url + "/mcp", {"Authorization": "Bearer k-123"}) as session:
            assert [t.name for t in (await session.list_tools()).tools] == DEFAULT_NAMES
    finally:
        stop_server(s)


# ---------------------------------------------------------------------------- translation and limits


def test_session_id_length_boundary() -> None:
    assert check_session("s" * 128) == "s" * 128
    for bad in ("s" * 129, "", ".hidden", "a/b", "../x"):
        with pytest.raises(ChoiceError):
            check_session(bad)
    with pytest.raises(ChoiceError):
        check_toolset("Default")


def test_results_become_mcp_content() -> None:
    png = base64.b64encode(png_1x1()).decode()
    result = call_result(
        ToolResult([TextBlock("an image"), ImageBlock("image/png", png)], False, {"n": Path("/x")})
    )
    assert [type(c) for c in result.content] == [mt.TextContent, mt.ImageContent]
    assert result.content[1].data == png  # type: ignore[union-attr]
    assert result.is_error is False
    assert result.meta == {DATA_META_KEY: {"n": "/x"}}
    wire: dict[str, Any] = json.loads(
        call_result(ToolResult.error("no")).model_dump_json(by_alias=True, exclude_none=True)
    )
    assert wire["isError"] is True and wire["content"] == [{"type": "text", "text": "no"}]


def test_annotations_on_the_wire(tmp_path: Path) -> None:
    """On the host (not isolated) commands reach whatever the host reaches: an open world.
    (A sandbox without network is the closed case, checked over stdio above.)"""
    host = LocalMachine("local", tmp_path)
    tools = toolset("default")
    wire = describe_tool(tools["bash"], host).model_dump(by_alias=True, exclude_none=True)
    assert wire["annotations"] == {"readOnlyHint": False, "destructiveHint": True, "openWorldHint": True}
    assert wire["inputSchema"] == tools["bash"].schema()
    wire = describe_tool(tools["read_file"], host).model_dump(by_alias=True, exclude_none=True)
    assert wire["annotations"] == {"readOnlyHint": True, "destructiveHint": False, "openWorldHint": False}


def test_http_get_answers_at_once_without_a_stream(server: Server) -> None:
    """A stateless endpoint has no server-to-client stream: 405 at once, whatever the headers."""
    for headers in ({}, {"Accept": "text/event-stream"}, {"Accept": "application/json, text/event-stream"}):
        r = httpx.get(server.url + "/mcp", headers=headers, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
        assert r.json()["error"]["code"] == INVALID_REQUEST
