"""Inputs a fuzzer finds that used to be 500s or broken streams, each now a clear 400.

A brace-bomb glob (`{a,b}` twenty times: a million alternatives, wcmatch's
`PatternLimitException`) in every route that matches globs; an events cursor past SQLite's
INTEGER (`OverflowError`); a command longer than one argv string may be (E2BIG from the
kernel) or than the exec agent's control message (the agent's message limit, which also
leaked the sandbox's running-command count so it was never reclaimed).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import SandboxFactory, Server

from agentbox.api.sessions import HEARTBEAT_MIN_S
from agentbox.machines.base import ExecRequest
from agentbox.machines.errors import MachineError
from agentbox.store.sessions import MAX_SEQ
from agentbox.workspace.commands import MAX_COMMAND_BYTES, MAX_ENV_BYTES
from agentbox.workspace.patterns import MAX_PATTERN_CHARS

BOMB = "{a,b}" * 20


@pytest.fixture
def sb(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/sandboxes/f-{uuid.uuid4().hex[:10]}", timeout=60) as client:
        assert client.post("/v2/fs/mkdir", json={"path": "/tmp/f/sub", "parents": True}).status_code == 200
        assert (
            client.post("/v2/fs/write", json={"path": "/tmp/f/sub/a.txt", "content": "hit\n"}).status_code
            == 200
        )
        yield client


def bad_request(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    reply = response.json()
    assert reply["success"] is False, reply
    assert reply["data"]["error_type"] == "bad_request", reply
    return reply  # type: ignore[no-any-return]


# ---------------------------------------------------------------- globs


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v2/fs/search", {"path": "/tmp/f", "pattern": BOMB}),
        ("/v2/fs/search", {"path": "/tmp/f", "pattern": "**/*", "exclude": [BOMB]}),
        ("/v2/fs/search", {"path": "/tmp/f", "pattern": "**/*", "exclude": [f"sub/{BOMB}"]}),
        ("/v2/fs/search", {"path": "/tmp/f", "pattern": "x" * (MAX_PATTERN_CHARS + 1)}),
        ("/v2/fs/grep", {"path": "/tmp/f", "pattern": "hit", "include": [BOMB]}),
        ("/v2/fs/grep", {"path": "/tmp/f", "pattern": "hit", "exclude": [BOMB]}),
        ("/v2/watch", {"path": "/tmp/f", "exclude": [BOMB]}),
        ("/v1/file/find", {"path": "/tmp/f", "glob": BOMB}),
        ("/v1/file/glob", {"path": "/tmp/f", "pattern": BOMB}),
        ("/v1/file/glob", {"path": "/tmp/f", "pattern": "**/*", "exclude": [BOMB]}),
        ("/v1/file/grep", {"path": "/tmp/f", "pattern": "hit", "include": [BOMB]}),
        ("/v1/file/watch", {"path": "/tmp/f", "exclude": [BOMB]}),
    ],
)
def test_brace_bomb_glob_is_bad_request(sb: httpx.Client, route: str, body: dict[str, Any]) -> None:
    response = sb.get(route, params=body) if route == "/v2/fs/search" else sb.post(route, json=body)
    v1_envelope = route.startswith("/v1/") and route != "/v1/file/watch"  # watch/create keeps HTTP statuses
    reply = bad_request(response, 200 if v1_envelope else 400)
    assert "pattern" in reply["message"]


def test_glob_at_the_limits_still_matches(sb: httpx.Client) -> None:
    """512 alternatives and a MAX_PATTERN_CHARS pattern are fine."""
    pattern = "**/" + "{a,b}" * 9 + "*"
    reply = sb.get("/v2/fs/search", params={"path": "/tmp/f", "pattern": pattern})
    assert reply.status_code == 200, reply.text
    long = "**/" + "*" * (MAX_PATTERN_CHARS - len("**/a.txt")) + "a.txt"
    assert len(long) == MAX_PATTERN_CHARS
    reply = sb.get("/v2/fs/search", params={"path": "/tmp/f", "pattern": long})
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"]["files"] == ["/tmp/f/sub/a.txt"]


# ---------------------------------------------------------------- event cursors


@pytest.fixture
def session(server: Server) -> Iterator[tuple[httpx.Client, str]]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        created = client.post("/v1/sessions", json={"model": "scripted", "script": []})
        assert created.status_code == 201, created.text
        yield client, created.json()["id"]


@pytest.mark.parametrize("after", [MAX_SEQ + 1, 2**64, 10**30, -1])
def test_events_cursor_out_of_range_is_400(session: tuple[httpx.Client, str], after: int) -> None:
    client, sid = session
    listed = client.get(f"/v1/sessions/{sid}/events", params={"after": after})
    assert listed.status_code == 400, listed.text
    streamed = client.get(f"/v1/sessions/{sid}/events/stream", params={"after": after})
    assert streamed.status_code == 400, streamed.text


@pytest.mark.parametrize("last_event_id", [str(MAX_SEQ + 1), "9" * 40, "9" * 5000, "\u00b2"])
def test_stream_last_event_id_out_of_range_is_400(
    session: tuple[httpx.Client, str], last_event_id: str
) -> None:
    client, sid = session
    streamed = client.get(
        f"/v1/sessions/{sid}/events/stream", headers={"last-event-id": last_event_id.encode("latin-1")}
    )
    assert streamed.status_code == 400, streamed.text


def test_events_cursor_at_the_limit_is_an_empty_page_and_an_open_stream(
    session: tuple[httpx.Client, str],
) -> None:
    client, sid = session
    listed = client.get(f"/v1/sessions/{sid}/events", params={"after": MAX_SEQ})
    assert listed.status_code == 200, listed.text
    assert listed.json()["items"] == []
    params = {"after": MAX_SEQ, "heartbeat": HEARTBEAT_MIN_S}
    with client.stream("GET", f"/v1/sessions/{sid}/events/stream", params=params) as stream:
        assert stream.status_code == 200
        first = next(stream.iter_lines())
        assert first == ": heartbeat"


# ---------------------------------------------------------------- command size


def filler(size: int) -> str:
    """A command of exactly `size` bytes that runs and succeeds."""
    return ": " + "x" * (size - 2)


@pytest.mark.parametrize("size", [MAX_COMMAND_BYTES + 1, 200 * 1024, 2 * 1024 * 1024])
def test_oversized_command_is_bad_request_before_any_spawn(sb: httpx.Client, size: int) -> None:
    bad_request(sb.post("/v2/commands", json={"command": filler(size)}))
    bad_request(sb.post("/v1/shell/exec", json={"command": filler(size)}), 200)
    ran = sb.post("/v2/commands", json={"command": "echo still here"})
    assert ran.status_code == 200 and ran.json()["data"]["stdout"] == "still here\n", ran.text


def test_command_at_the_limit_runs(sb: httpx.Client) -> None:
    ran = sb.post("/v2/commands", json={"command": filler(MAX_COMMAND_BYTES)})
    assert ran.status_code == 200, ran.text
    assert ran.json()["data"]["exit_code"] == 0


def environment(size: int) -> dict[str, str]:
    """Variables whose `KEY=VALUE` plus NUL come to exactly `size` bytes."""
    env, left = {}, size
    for i in range(64):
        key = f"V{i:02d}"
        value = "v" * min(left - len(key) - 2, 4000)
        env[key] = value
        left -= len(key) + len(value) + 2
        if left == 0:
            return env
    raise AssertionError(size)


def test_largest_command_with_the_largest_environment_runs(sb: httpx.Client) -> None:
    """Together they still fit one exec-agent message; one byte more of env is a 400."""
    body = {"command": filler(MAX_COMMAND_BYTES), "env": environment(MAX_ENV_BYTES)}
    ran = sb.post("/v2/commands", json=body)
    assert ran.status_code == 200 and ran.json()["data"]["exit_code"] == 0, ran.text
    bad_request(sb.post("/v2/commands", json={**body, "env": environment(MAX_ENV_BYTES + 1)}))


def test_multibyte_command_is_measured_in_bytes(sb: httpx.Client) -> None:
    command = ": " + "é" * (MAX_COMMAND_BYTES // 2)  # fewer characters than the limit, more bytes
    assert len(command) <= MAX_COMMAND_BYTES < len(command.encode())
    bad_request(sb.post("/v2/commands", json={"command": command}))


@pytest.mark.parametrize("size", [300 * 1024, 1024 * 1024 + 1, 2 * 1024 * 1024])
async def test_sandbox_spawn_of_an_oversized_message_leaks_nothing(
    make_sandbox: SandboxFactory, size: int
) -> None:
    m = await make_sandbox()
    with pytest.raises((OSError, MachineError)) as raised:
        await m.spawn(ExecRequest(argv=("/bin/true", "x" * size)))
    assert m.running == 0 and not m.busy()  # else the sandbox is never reclaimed
    assert isinstance(raised.value, OSError), raised.value  # E2BIG: the agent is not gone
    result = await m.exec(ExecRequest(command="echo alive"))
    assert (result.exit_code, result.stdout) == (0, b"alive\n")
