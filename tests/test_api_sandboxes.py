"""The sandbox lifecycle API against real servers: list, get and delete sandboxes; a deleted
session's sandbox refuses instead of coming back empty, across a restart too."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import datetime
from typing import Any

import httpx
import pytest

from agentbox.api.sandboxes import SANDBOXES_LIMIT_MAX
from tests.conftest import Server, start_server, stop_server, traversable
from tests.test_api_sessions import DEADLINE, bash, create, frames, post, until_turn_end
from tests.test_cli_exec import CLI_DEADLINE, cli_env

#: Bytes written into a workspace, so its measured size is seen to count them.
PAYLOAD_BYTES = 256 * 1024
#: Seconds two reads of one `last_used_at` may differ by (the wall time of a monotonic reading
#: is computed at each read, from two clock reads, then shown to the millisecond).
CLOCK_READ_JITTER = 0.002


@pytest.fixture
async def client(server: Server) -> Any:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        yield c


def fresh_id() -> str:
    return f"life-{uuid.uuid4().hex[:12]}"


async def write(client: httpx.AsyncClient, sid: str, path: str, content: str) -> None:
    r = await client.post(f"/sandboxes/{sid}/v1/file/write", json={"file": path, "content": content})
    assert r.status_code == 200 and r.json()["success"], r.text


async def listed(client: httpx.AsyncClient, limit: int) -> list[dict[str, Any]]:
    """Every sandbox, page by page; each page's bounds checked on the way."""
    items: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
        r = await client.get("/v1/sandboxes", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["items"]) <= limit
        items += page["items"]
        if not page["has_more"]:
            assert page["next_after"] is None
            return items
        after = page["next_after"]
        assert after == page["items"][-1]["session_id"]


def assert_refused(r: httpx.Response, error_type: str, status: int) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and body["data"]["error_type"] == error_type, body


def seconds_of(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def test_a_sandbox_of_the_sandbox_routes_is_listed_and_deleted(
    client: httpx.AsyncClient, server: Server
) -> None:
    sid = fresh_id()
    await write(client, sid, "/workspace/data.txt", "x" * PAYLOAD_BYTES)
    one = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert one["session_id"] == sid and one["session"] is False and one["state"] == "running"
    assert one["machine"] == "sandbox" and one["kind"] == "sandbox"
    assert one["machines"] == [{"name": "sandbox", "kind": "sandbox", "state": "running"}]
    assert one["workspace_bytes"] >= PAYLOAD_BYTES and one["last_used_at"].endswith("Z")
    other = fresh_id()
    await write(client, other, "/workspace/o.txt", "o")
    everything = await listed(client, limit=1)
    ids = [item["session_id"] for item in everything]
    assert ids == sorted(set(ids)) and {sid, other} <= set(ids)
    found = next(i for i in everything if i["session_id"] == sid)
    # the sandbox's own files (a shell's history, an index) may grow its workspace in between
    assert found["workspace_bytes"] >= PAYLOAD_BYTES
    # each read turns the machine's monotonic last use into wall time anew: a millisecond may flip
    assert abs(seconds_of(found["last_used_at"]) - seconds_of(one["last_used_at"])) <= CLOCK_READ_JITTER
    same = {"workspace_bytes": 0, "last_used_at": ""}
    assert found | same == one | same
    assert (await client.get("/v1/sandboxes", params={"limit": SANDBOXES_LIMIT_MAX + 1})).status_code == 400

    r = await client.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200 and r.json() == {"session_id": sid, "deleted": True}
    assert not server.workspace(sid).exists()
    assert_refused(await client.get(f"/v1/sandboxes/{sid}"), "not_found", 404)
    assert_refused(await client.delete(f"/v1/sandboxes/{sid}"), "not_found", 404)
    assert sid not in [item["session_id"] for item in await listed(client, limit=SANDBOXES_LIMIT_MAX)]
    # the id stays usable: the next request starts an empty sandbox under it
    gone = await client.post(f"/sandboxes/{sid}/v1/file/read", json={"file": "/workspace/data.txt"})
    assert gone.json()["success"] is False and gone.json()["data"]["error_type"] == "not_found"
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert_refused(await client.get("/v1/sandboxes/-not-an-id"), "invalid_path", 400)


async def test_a_deleted_sessions_sandbox_refuses_instead_of_coming_back(
    client: httpx.AsyncClient, server: Server
) -> None:
    sid = await create(client, [bash("echo kept > /workspace/kept.txt"), {"text": "done"}])
    await post(client, sid)
    assert (await until_turn_end(client, sid))[-1].event == "turn.completed"
    one = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert one["session"] is True and one["state"] == "running" and one["workspace_bytes"] > 0
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200

    read = {"file": "/workspace/kept.txt"}
    assert_refused(await client.post(f"/sandboxes/{sid}/v1/file/read", json=read), "session_deleted", 410)
    v2 = await client.get(f"/sandboxes/{sid}/v2/fs/read", params={"path": "/workspace/kept.txt"})
    assert_refused(v2, "session_deleted", 410)
    assert_refused(await client.get(f"/v1/sandboxes/{sid}"), "session_deleted", 410)
    assert_refused(await client.delete(f"/v1/sandboxes/{sid}"), "session_deleted", 410)
    assert not server.workspace(sid).parent.exists()  # nothing was made under the old id
    assert sid not in [item["session_id"] for item in await listed(client, limit=SANDBOXES_LIMIT_MAX)]


async def test_a_sessions_sandbox_is_not_deleted_under_an_open_turn(client: httpx.AsyncClient) -> None:
    sid = await create(client, [bash("echo one > /workspace/one.txt"), {"hang": True}])
    await post(client, sid)
    await frames(client, sid, stop=lambda f: f.event == "agent.tool_result")  # the sandbox is open
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert_refused(await client.delete(f"/v1/sandboxes/{sid}"), "conflict", 409)
    assert (await client.post(f"/v1/sessions/{sid}/abort")).status_code == 200
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 200
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 200  # the session stays
    assert_refused(await client.get(f"/v1/sandboxes/{sid}"), "not_found", 404)


async def test_retirement_and_stopped_sandboxes_survive_a_restart(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    home = traversable(tmp_path_factory.mktemp("lifecycle"), tmp_path_factory) / "home"
    home.mkdir()
    kept = fresh_id()
    first = start_server(home)
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=DEADLINE) as client:
            await write(client, kept, "/workspace/k.txt", "k" * PAYLOAD_BYTES)
            sid = await create(client, [bash("true"), {"text": "done"}])
            await post(client, sid)
            await until_turn_end(client, sid)
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
    finally:
        stop_server(first)
    second = start_server(home)
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=DEADLINE) as client:
            page = (await client.get("/v1/sandboxes")).json()
            assert [item["session_id"] for item in page["items"]] == [kept]
            stopped = page["items"][0]
            assert stopped["state"] == "stopped" and stopped["workspace_bytes"] >= PAYLOAD_BYTES
            assert stopped["machines"] == [{"name": "sandbox", "kind": "sandbox", "state": "stopped"}]
            read = {"file": "/workspace/k.txt"}
            assert (await client.post(f"/sandboxes/{kept}/v1/file/read", json=read)).json()["success"]
            assert (await client.get(f"/v1/sandboxes/{kept}")).json()["state"] == "running"
            refused = await client.post(f"/sandboxes/{sid}/v1/file/read", json=read)
            assert_refused(refused, "session_deleted", 410)
    finally:
        stop_server(second)
    # the CLI reaches the same sandbox, and is refused the same way
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", "--session", sid, "--", "true"],
        env=cli_env(home), cwd=home.parent, capture_output=True, timeout=CLI_DEADLINE,
    )  # fmt: skip
    assert done.returncode == 2 and b"was deleted" in done.stderr, done.stderr.decode()[-2000:]
    assert b"Traceback" not in done.stderr and not (home / "sessions" / sid).exists()
