"""A web page the operator opens must not drive a loopback `agentbox serve`.

Three ways in, each refused in the envelope: a JSON body sent as a CORS "simple request"
(`text/plain`, a form type or no type: no preflight) is 415; a request carrying a foreign
`Origin` is 403; a `Host` that is not loopback (DNS rebinding: the page's own name resolving to
127.0.0.1) is 403. The server's own origin, the operator's allow-lists and the real clients
(the AIO SDK, an MCP client) keep working.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_sandbox import Sandbox
from conftest import Server, start_server, stop_server, traversable

#: What the operator allows in this module's server (config through the environment).
PROXY_HOST = "agentbox.proxy.example"
UI_ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("guard"), tmp_path_factory) / "home"
    home.mkdir()
    env = {"AGENTBOX_ALLOWED_HOSTS": f"{PROXY_HOST}, other.example", "AGENTBOX_ALLOWED_ORIGINS": UI_ORIGIN}
    server = start_server(home, env)
    yield server
    stop_server(server)


@pytest.fixture
def http(guarded: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{guarded.url}/sandboxes/g-{uuid.uuid4().hex[:10]}", timeout=60) as client:
        yield client


def refused(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    reply = response.json()
    assert reply["success"] is False and reply["message"], reply
    return reply  # type: ignore[no-any-return]


def exists(http: httpx.Client, path: str) -> bool:
    reply = http.get("/v2/fs/read", params={"path": path})
    return reply.status_code == 200


# ---------------------------------------------------------------- content type


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None]
)
def test_json_body_sent_as_a_simple_request_is_415_and_runs_nothing(
    http: httpx.Client, content_type: str | None
) -> None:
    body = b'{"command": "touch /tmp/pwned"}'
    headers = {"content-type": content_type} if content_type else {}
    request = http.build_request("POST", "/v2/commands", content=body, headers=headers)
    if content_type is None:
        request.headers.pop("content-type", None)  # a fetch() of a Blob without a type sends none
    reply = refused(http.send(request), 415)
    assert "application/json" in reply["message"]
    assert not exists(http, "/tmp/pwned")


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.agentbox+json"])
def test_json_and_plus_json_bodies_are_accepted(http: httpx.Client, content_type: str) -> None:
    body = b'{"command": "echo ok"}'
    reply = http.post("/v2/commands", content=body, headers={"content-type": content_type})
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"]["stdout"] == "ok\n"


def test_v1_json_route_refuses_text_plain_too(http: httpx.Client) -> None:
    body = b'{"command": "touch /tmp/pwned-v1"}'
    refused(http.post("/v1/shell/exec", content=body, headers={"content-type": "text/plain"}), 415)
    assert not exists(http, "/tmp/pwned-v1")


def test_mcp_refuses_text_plain_too(guarded: Server) -> None:
    """`/mcp` parses its own JSON-RPC bodies; the MCP server refuses other types itself (400)."""
    initialize = b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}'
    headers = {"content-type": "text/plain", "accept": "application/json, text/event-stream"}
    reply = httpx.post(f"{guarded.url}/mcp", content=initialize, headers=headers, timeout=60)
    assert reply.status_code == 400 and "Content-Type" in reply.text, reply.text


def test_empty_body_without_a_type_is_still_an_empty_object(guarded: Server) -> None:
    """The AIO SDK sends some calls with no body at all: those stay `{}`."""
    reply = httpx.post(f"{guarded.url}/v1/sessions", timeout=60)
    assert reply.status_code != 415, reply.text


# ---------------------------------------------------------------- Origin


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://ui.example:444"]
)
def test_foreign_origin_is_403_on_every_route(guarded: Server, http: httpx.Client, origin: str) -> None:
    write = {"path": "/tmp/from-page", "content": "x"}
    refused(http.post("/v2/fs/write", json=write, headers={"origin": origin}), 403)
    assert not exists(http, "/tmp/from-page")
    refused(http.get("/v2/fs/list", params={"path": "/tmp"}, headers={"origin": origin}), 403)
    refused(httpx.get(f"{guarded.url}/health", headers={"origin": origin}), 403)
    refused(httpx.post(f"{guarded.url}/mcp", json={}, headers={"origin": origin}), 403)


def test_own_origin_and_allow_listed_origin_pass(guarded: Server, http: httpx.Client) -> None:
    for origin in (guarded.url, guarded.url.replace("127.0.0.1", "localhost"), UI_ORIGIN):
        host = origin.split("://", 1)[1]
        headers = {"origin": origin} | ({"host": host} if origin != UI_ORIGIN else {})
        reply = http.post("/v2/fs/write", json={"path": "/tmp/ok", "content": "x"}, headers=headers)
        assert reply.status_code == 200, (origin, reply.text)


def test_allow_listed_origin_gets_cors_headers(guarded: Server) -> None:
    preflight = httpx.options(
        f"{guarded.url}/v2/fs/list",
        headers={"origin": UI_ORIGIN, "access-control-request-method": "GET"},
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == UI_ORIGIN


# ---------------------------------------------------------------- Host (DNS rebinding)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example:{port}", ""])
def test_rebinding_host_is_403(guarded: Server, http: httpx.Client, host: str) -> None:
    port = guarded.url.rsplit(":", 1)[1]
    headers = {"host": host.format(port=port)}
    refused(http.post("/v2/fs/write", json={"path": "/tmp/rebound", "content": "x"}, headers=headers), 403)
    assert not exists(http, "/tmp/rebound")
    refused(httpx.get(f"{guarded.url}/health", headers=headers), 403)


@pytest.mark.parametrize(
    "host", ["localhost:{port}", "127.0.0.1", "[::1]:{port}", "LOCALHOST", PROXY_HOST, "other.example:8443"]
)
def test_loopback_and_allow_listed_hosts_pass(guarded: Server, host: str) -> None:
    port = guarded.url.rsplit(":", 1)[1]
    reply = httpx.get(f"{guarded.url}/health", headers={"host": host.format(port=port)})
    assert reply.status_code == 200, reply.text


def test_same_origin_behind_an_allowed_proxy_host(guarded: Server) -> None:
    headers = {"host": PROXY_HOST, "origin": f"https://{PROXY_HOST}"}
    assert httpx.get(f"{guarded.url}/health", headers=headers).status_code == 200


# ---------------------------------------------------------------- the real clients


def test_aio_sdk_still_works(guarded: Server) -> None:
    client = Sandbox(base_url=f"{guarded.url}/sandboxes/sdk-{uuid.uuid4().hex[:10]}")
    client.file.write_file(file="/tmp/sdk.txt", content="hello")
    assert client.file.read_file(file="/tmp/sdk.txt").data.content == "hello"
    assert client.shell.exec_command(command="echo hi").data.output.strip() == "hi"


async def test_mcp_client_still_works(guarded: Server) -> None:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx.AsyncClient(timeout=60) as client,
        streamable_http_client(guarded.url + "/mcp", http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        tools = await session.list_tools()
        assert tools.tools
