"""What a session supplies (MCP commands and URLs, a model `base_url`, the machine it asks
for) never reaches the host or the server's credentials unless the operator's config says so.

Against a real `agentbox serve` started per test with its own config (`AGENTBOX_CONFIG`),
the scripted model, real bubblewrap sandboxes, and a loopback model server that records
what it is sent.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.test_api_sessions import DEADLINE, frames
from tests.test_mcp_tools import SERVER_SCRIPT
from tests.test_providers import Canned, Loopback, delta, finish, openai_sse

#: What the server holds in its environment and must never send where a session points it.
SERVER_KEY = "sk-server-secret-never-leaves"

#: A stdio MCP server on the standard library only (the sandbox sees the host's /usr, not the
#: venv): newline-delimited JSON-RPC, one tool `where` that writes a file and says who it is.
SANDBOX_MCP_SERVER = textwrap.dedent(
    """
    import json, os, sys

    TOOL = {"name": "where", "description": "Say where this runs.", "inputSchema": {"type": "object"}}

    def answer(request):
        method = request.get("method")
        if method == "initialize":
            return {"protocolVersion": request["params"]["protocolVersion"],
                    "capabilities": {"tools": {}}, "serverInfo": {"name": "box", "version": "1"}}
        if method == "tools/list":
            return {"tools": [TOOL]}
        if method == "tools/call":
            with open("made-by-mcp", "w") as f:
                f.write("here")
            text = "uid=%d cwd=%s" % (os.getuid(), os.getcwd())
            return {"content": [{"type": "text", "text": text}]}
        if method == "ping":
            return {}
        return None

    for line in sys.stdin:
        request = json.loads(line)
        if "id" not in request:
            continue
        result = answer(request)
        reply = {"jsonrpc": "2.0", "id": request["id"]}
        if result is None:
            reply["error"] = {"code": -32601, "message": "no such method"}
        else:
            reply["result"] = result
        sys.stdout.write(json.dumps(reply) + "\\n")
        sys.stdout.flush()
    """
)


def text_reply(text: str) -> Canned:
    return Canned(body=openai_sse(delta(role="assistant", content=text), finish("stop")))


@pytest.fixture
async def llm() -> AsyncIterator[Loopback]:
    """A loopback OpenAI-compatible model that records every request (headers included)."""
    loopback = Loopback(respond=lambda received: text_reply("hello"))
    loopback.server = await asyncio.start_server(loopback.handle, "127.0.0.1", 0)
    yield loopback
    loopback.stop.set()
    loopback.server.close()
    await loopback.server.wait_closed()


def serve(home: Path, config: str = "", **env: str) -> Server:
    """`agentbox serve` on `home` with `config` as its TOML file (an empty one: the defaults)."""
    home.mkdir(exist_ok=True)
    path = home.parent / f"agentbox-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(config)
    return start_server(home, {"AGENTBOX_CONFIG": str(path), **env})


@pytest.fixture
def plain(sandbox_tmp: Path) -> Iterator[Server]:
    """A server with no config: the built-in `sandbox` machine only, the server's key in its env."""
    server = serve(sandbox_tmp / "home", OPENAI_API_KEY=SERVER_KEY)
    yield server
    stop_server(server)


async def create(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/sessions", json={"model": "scripted", "script": [], **fields})


async def run_turn(client: httpx.AsyncClient, sid: str, content: str = "go") -> list[dict[str, Any]]:
    """Post a message and return the turn's events once it ended."""
    r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": content})
    assert r.status_code == 202, r.text
    turn = r.json()["turn_id"]
    got = await frames(client, sid, params={"until": "turn_end"})
    return [f.data for f in got if f.data is not None and f.data.get("turn_id") in (turn, None)]


def refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert all(w in message for w in words), message


# ---------------------------------------------------------------- MCP servers a session names


async def test_a_session_mcp_command_never_runs_on_the_host(plain: Server) -> None:
    proof = Path(f"/tmp/agentbox-proof-{uuid.uuid4().hex}")
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await create(client, mcp_servers=[{"name": "x", "command": ["sh", "-c", f"id > {proof}"]}])
        assert r.status_code == 201, r.text
        log = await run_turn(client, r.json()["id"])
    try:
        assert log[-1]["type"] == "turn.completed"
        assert not proof.exists(), f"the session's MCP command ran on the host: {proof.read_text()!r}"
    finally:
        proof.unlink(missing_ok=True)


async def test_a_stdio_mcp_server_in_the_workspace_runs_inside_the_sandbox(plain: Server) -> None:
    script = [{"tool_calls": [{"name": "mcp__box__where", "input": {}}]}, {"text": "done"}]
    server = {"name": "box", "command": ["python3", "/workspace/box_server.py"]}
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await create(client, script=script, mcp_servers=[server])
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        w = await client.post(
            f"/sandboxes/{sid}/v1/file/write",
            json={"file": "/workspace/box_server.py", "content": SANDBOX_MCP_SERVER},
        )
        assert w.status_code == 200 and w.json()["success"], w.text
        log = await run_turn(client, sid)
    errors = [e for e in log if e["type"] == "session.error"]
    assert not errors, errors
    (result,) = [e for e in log if e["type"] == "agent.tool_result"]
    assert not result["is_error"], result
    assert "cwd=/workspace" in result["content"][0]["text"]
    made = plain.home / "sessions" / sid / "workspace" / "made-by-mcp"
    assert made.read_text() == "here" and made.stat().st_uid != 0  # written as the sandbox's uid


async def test_stdio_mcp_servers_need_a_machine(plain: Server) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await create(client, machine="none", mcp_servers=[{"name": "x", "command": ["true"]}])
    refused(r, "machine")


async def test_a_session_url_mcp_server_on_loopback_is_refused(plain: Server) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await create(client, mcp_servers=[{"name": "api", "url": plain.url + "/mcp"}])
        refused(r, "api", "127.0.0.1")
        r = await create(client, mcp_servers=[{"name": "ops", "server": "nowhere"}])
        refused(r, "nowhere")


async def test_an_operator_mcp_server_runs_on_the_host_by_name(sandbox_tmp: Path) -> None:
    script_path = sandbox_tmp / "ops_server.py"
    script_path.write_text(SERVER_SCRIPT)
    config = f"[mcp_servers.ops]\ncommand = {json.dumps([sys.executable, str(script_path)])}\n"
    server = serve(sandbox_tmp / "home", config)
    try:
        script = [
            {"tool_calls": [{"name": "mcp__ops__echo_v1", "input": {"text": "hi"}}]},
            {"expect": {"tool_result_contains": "echo: hi"}, "text": "done"},
        ]
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            r = await create(client, script=script, machine="none", mcp_servers=[{"server": "ops"}])
            assert r.status_code == 201, r.text
            log = await run_turn(client, r.json()["id"])
        assert log[-1]["type"] == "turn.completed", log[-1]
    finally:
        stop_server(server)


# ---------------------------------------------------------------- the host machine


async def test_local_is_refused_unless_the_operator_configured_it(plain: Server) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await create(client, machine="local")
    refused(r, "local")


LOCAL_CONFIG = """
[machines.host]
kind = "local"
root = "{root}"

[machines.trusted]
kind = "local"
root = "{root}"
allow_full_auto = true
"""


@pytest.fixture
def with_local(sandbox_tmp: Path) -> Iterator[Server]:
    root = sandbox_tmp / "hostroot"
    root.mkdir()
    server = serve(sandbox_tmp / "home", LOCAL_CONFIG.format(root=root))
    yield server
    stop_server(server)


async def test_a_configured_local_machine_asks_before_bash_by_default(with_local: Server) -> None:
    script = [{"tool_calls": [{"name": "bash", "input": {"command": "id"}}]}, {"text": "done"}]
    async with httpx.AsyncClient(base_url=with_local.url, timeout=DEADLINE) as client:
        r = await create(client, script=script, machine="host")
        assert r.status_code == 201, r.text
        assert r.json()["permission_mode"] == "full-ask"
        sid = r.json()["id"]
        r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
        asked = await frames(client, sid, stop=lambda f: f.event in ("approval.requested", "turn.completed"))
        assert asked[-1].event == "approval.requested" and asked[-1].data is not None
        assert asked[-1].data["tool"] == "bash"
        assert not [f for f in asked if f.event == "agent.tool_result"]  # nothing ran yet
        await client.post(f"/v1/sessions/{sid}/abort")


async def test_full_auto_on_the_host_needs_the_operator_setting(with_local: Server) -> None:
    async with httpx.AsyncClient(base_url=with_local.url, timeout=DEADLINE) as client:
        r = await create(client, machine="host", permission_mode="full-auto")
        refused(r, "allow_full_auto", "host")
        r = await create(client, machine="host", permission_mode="full-ask")
        assert r.status_code == 201, r.text
        patched = await client.patch(f"/v1/sessions/{r.json()['id']}", json={"permission_mode": "full-auto"})
        refused(patched, "allow_full_auto")
        r = await create(client, machine="trusted", permission_mode="full-auto")
        assert r.status_code == 201, r.text
        r = await create(client, machine="trusted")
        assert r.json()["permission_mode"] == "full-ask"  # allowed is not the default


# ---------------------------------------------------------------- a session's model endpoint


def openai_session(base_url: str, **options: Any) -> dict[str, Any]:
    return {"model": "openai:local-model", "model_options": {"base_url": base_url, **options}}


async def test_a_session_base_url_on_loopback_is_refused_unless_allow_listed(
    plain: Server, llm: Loopback
) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=DEADLINE) as client:
        r = await client.post("/v1/sessions", json=openai_session(llm.url + "/v1"))
        refused(r, "base_url", "127.0.0.1")
        r = await client.post("/v1/sessions", json=openai_session("file:///etc/passwd"))
        refused(r, "base_url")
    assert llm.requests == []


async def test_a_session_base_url_never_gets_the_server_key(sandbox_tmp: Path, llm: Loopback) -> None:
    config = f'model_endpoints = ["{llm.url}/v1"]\n'
    server = serve(sandbox_tmp / "home", config, OPENAI_API_KEY=SERVER_KEY)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            r = await client.post("/v1/sessions", json=openai_session(llm.url + "/v1"))
            assert r.status_code == 201, r.text
            log = await run_turn(client, r.json()["id"])
            assert log[-1]["type"] == "turn.completed", log[-1]
            r = await client.post("/v1/sessions", json=openai_session(llm.url + "/v1", api_key="sk-own"))
            log = await run_turn(client, r.json()["id"])
            assert log[-1]["type"] == "turn.completed", log[-1]
    finally:
        stop_server(server)
    sent = [q.headers.get("authorization") for q in llm.requests]
    assert sent == [None, "Bearer sk-own"], sent
    assert not any(SERVER_KEY in json.dumps(q.headers) for q in llm.requests)
