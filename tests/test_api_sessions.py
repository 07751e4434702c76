"""The sessions API against a real server: uvicorn on loopback, a SQLite file, real sandboxes,
the scripted model. Every wait is for a condition (an event, a status) with a deadline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentbox.agent.models import DELTA_CHUNKS
from agentbox.api.sessions import HEARTBEAT_MIN_S, MAX_IDEMPOTENCY_KEY_CHARS
from agentbox.store.sessions import MAX_EVENTS_PAGE, TERMINAL_EVENTS
from tests.conftest import Server, start_server, stop_server, traversable

#: Seconds a test waits for an event or a status before failing.
DEADLINE = 20.0


@dataclass
class Frame:
    id: int | None
    event: str | None
    data: dict[str, Any] | None
    comment: str | None = None


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        yield c


def bash(command: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "bash", "input": {"command": command}}]}


def write(path: str, content: str) -> dict[str, Any]:
    return {"name": "write_file", "input": {"path": path, "content": content}}


async def create(client: httpx.AsyncClient, script: list[Any], **fields: Any) -> str:
    r = await client.post("/v1/sessions", json={"model": "scripted", "script": script, **fields})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def post(client: httpx.AsyncClient, sid: str, content: str = "go", **kw: Any) -> httpx.Response:
    return await client.post(
        f"/v1/sessions/{sid}/messages", json={"content": content, **kw.pop("body", {})}, **kw
    )


async def frames(
    client: httpx.AsyncClient,
    sid: str,
    *,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    stop: Callable[[Frame], bool] | None = None,
) -> list[Frame]:
    """Read the SSE stream until it closes (or `stop` says so), within DEADLINE."""

    async def read() -> list[Frame]:
        got: list[Frame] = []
        async with client.stream(
            "GET", f"/v1/sessions/{sid}/events/stream", params=params, headers=headers
        ) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("text/event-stream")
            fields: dict[str, str] = {}
            async for line in r.aiter_lines():
                if line.startswith(":"):
                    got.append(Frame(None, None, None, comment=line[1:].strip()))
                elif line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                elif fields:
                    seq = int(fields["id"]) if "id" in fields else None
                    got.append(Frame(seq, fields["event"], json.loads(fields["data"])))
                    fields = {}
                else:
                    continue
                if stop is not None and stop(got[-1]):
                    break
        return got

    return await asyncio.wait_for(read(), DEADLINE)


async def until_turn_end(client: httpx.AsyncClient, sid: str, after: int = 0) -> list[Frame]:
    got = await frames(client, sid, params={"after": after, "until": "turn_end"})
    return [f for f in got if f.comment is None]


async def events(client: httpx.AsyncClient, sid: str, after: int = 0) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/events", params={"after": after, "limit": MAX_EVENTS_PAGE})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def wait_status(client: httpx.AsyncClient, sid: str, turn_id: str, status: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while (await client.get(f"/v1/sessions/{sid}/turns/{turn_id}")).json()["status"] != status:
        assert asyncio.get_running_loop().time() < deadline, f"turn never became {status}"
        await asyncio.sleep(0.02)


def in_order(types: list[str], expected: list[str]) -> bool:
    """`expected` is a subsequence of `types`."""
    rest = iter(types)
    return all(t in rest for t in expected)


async def test_a_scripted_turn_streams_in_order_and_the_views_agree(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "Let me look.", **bash("echo hi")}, {"text": "Done."}])
    r = await post(client, sid)
    assert r.status_code == 202 and r.json()["created"] is True
    turn_id = r.json()["turn_id"]
    streamed = await until_turn_end(client, sid)
    types = [f.event for f in streamed]
    assert in_order(
        [t for t in types if t],
        ["user.message", "turn.queued", "turn.started", "agent.tool_use", "sandbox.ready",
         "agent.tool_result", "agent.message", "turn.completed"],
    )  # fmt: skip
    # sandbox.ready comes when the first tool call starts the machine, after its agent.tool_use
    assert types[0] == "session.created" and types[-1] == "turn.completed"
    assert [f.id for f in streamed] == list(range(1, len(streamed) + 1))
    assert all(f.data is not None and f.data["seq"] == f.id and f.data["type"] == f.event for f in streamed)
    assert streamed[-1].data is not None and streamed[-1].data["turn_id"] == turn_id
    # the JSON page is the same log as the stream's replay, for any cursor
    assert await events(client, sid) == [f.data for f in streamed]
    assert await events(client, sid, after=3) == [f.data for f in streamed[3:]]
    # Last-Event-ID resumes after that seq: no gap, no duplicate (and wins over ?after)
    last = streamed[-1].id
    resumed = await frames(
        client, sid, params={"after": 0}, headers={"Last-Event-ID": "4"}, stop=lambda f: f.id == last
    )
    assert [f.id for f in resumed] == list(range(5, (last or 0) + 1))
    session = (await client.get(f"/v1/sessions/{sid}")).json()
    assert session["status"] == "idle" and session["usage"]["model_calls"] == 2
    assert session["sandbox"]["state"] == "running"
    turn = (await client.get(f"/v1/sessions/{sid}/turns/{turn_id}")).json()
    assert turn["status"] == "completed" and turn["stop_reason"] == "end_turn"
    listed = (await client.get(f"/v1/sessions/{sid}/turns")).json()["items"]
    assert [t["id"] for t in listed] == [turn_id]


async def test_text_deltas_are_opt_in_unstored_and_carry_no_id(client: httpx.AsyncClient) -> None:
    texts = ["Let me look around first.", "All done, the answer is here now."]
    sid = await create(client, [{"text": texts[0], **bash("true")}, {"text": texts[1]}])

    async def watch(params: dict[str, Any], subscribed: asyncio.Event) -> list[Frame]:
        def stop(f: Frame) -> bool:
            subscribed.set()  # a replayed frame: the stream's subscription is registered
            return f.event in TERMINAL_EVENTS

        return await frames(client, sid, params=params, stop=stop)

    # both streams are open before the message, so the live deltas reach the opted-in one
    ready = [asyncio.Event(), asyncio.Event()]
    opted = asyncio.create_task(watch({"deltas": "true"}, ready[0]))
    plain = asyncio.create_task(watch({}, ready[1]))
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), DEADLINE)
    assert (await post(client, sid)).status_code == 202
    with_deltas, without = [[f for f in await t if f.comment is None] for t in (opted, plain)]

    deltas = [f for f in with_deltas if f.event == "agent.message.delta"]
    assert deltas and all(f.id is None for f in deltas)
    assert all(f.id is not None for f in with_deltas if f.event != "agent.message.delta")
    # each reply's deltas come before its agent.message, in index order, and join to its text
    pending: list[dict[str, Any]] = []
    messages = []
    for f in with_deltas:
        assert f.data is not None
        if f.event == "agent.message.delta":
            pending.append(f.data)
        elif f.event == "agent.message":
            text = f.data["content"][0]["text"]
            assert [d["index"] for d in pending] == list(range(DELTA_CHUNKS))
            assert "".join(d["text"] for d in pending) == text
            assert {d["turn_id"] for d in pending} == {f.data["turn_id"]}
            messages.append(text)
            pending = []
    assert messages == texts and not pending
    # the stored views never have them: the plain stream and the JSON page are the same log
    assert [f for f in with_deltas if f.event != "agent.message.delta"] == without
    assert not any(f.event == "agent.message.delta" for f in without)
    assert await events(client, sid) == [f.data for f in without]


async def test_until_turn_end_follows_the_turn_posted_after_the_clients_cursor(
    client: httpx.AsyncClient,
) -> None:
    sid = await create(client, [{"text": "one"}, {"text": "two"}])
    await post(client, sid, "1")
    first = await until_turn_end(client, sid)
    # posted, then the stream opened with the cursor the client had: it follows that turn,
    # open or already ended (either way, the client has not seen its end)
    second = (await post(client, sid, "2")).json()["turn_id"]
    got = await until_turn_end(client, sid, after=first[-1].id or 0)
    assert got[0].event == "user.message"
    assert got[-1].event == "turn.completed" and got[-1].data is not None
    assert got[-1].data["turn_id"] == second


async def test_until_turn_end_past_the_last_turns_end_closes_at_once(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "one"}])
    await post(client, sid)
    ended = await until_turn_end(client, sid)
    # a later session-level event is replayed, then the stream closes: no turn is left to wait for
    assert (await client.patch(f"/v1/sessions/{sid}", json={"metadata": {"k": "v"}})).status_code == 200
    got = await until_turn_end(client, sid, after=ended[-1].id or 0)
    assert [f.event for f in got] == ["session.updated"]
    assert await until_turn_end(client, sid, after=got[-1].id or 0) == []


async def test_until_turn_end_before_any_turn_waits_for_the_first(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "one"}])
    watcher = asyncio.create_task(until_turn_end(client, sid))
    turn_id = (await post(client, sid)).json()["turn_id"]
    got = await watcher
    assert got[-1].event == "turn.completed" and got[-1].data is not None
    assert got[-1].data["turn_id"] == turn_id


async def test_idempotent_post_returns_the_same_turn_and_writes_nothing(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "once"}])
    key = "k" * MAX_IDEMPOTENCY_KEY_CHARS
    first = await post(client, sid, "hello", headers={"Idempotency-Key": key})
    await until_turn_end(client, sid)
    before = await events(client, sid)
    again = await post(client, sid, "hello", headers={"Idempotency-Key": key})
    assert again.status_code == 202 and again.json()["created"] is False
    assert again.json()["turn_id"] == first.json()["turn_id"]
    assert await events(client, sid) == before
    conflict = await post(client, sid, "other", headers={"Idempotency-Key": key})
    assert conflict.status_code == 409 and conflict.json()["success"] is False
    too_long = await post(
        client, sid, "x", headers={"Idempotency-Key": "k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1)}
    )
    assert too_long.status_code == 400
    assert len((await client.get(f"/v1/sessions/{sid}/turns")).json()["items"]) == 1


async def test_unknown_file_ids_are_refused_before_anything_is_queued(client: httpx.AsyncClient) -> None:
    sid = await create(client, [])
    before = await events(client, sid)
    r = await post(client, sid, body={"files": ["file_01NOSUCHFILE0000000000000"]})
    assert r.status_code == 400 and "file_01NOSUCHFILE" in r.json()["message"]
    assert (await client.get(f"/v1/sessions/{sid}/turns")).json()["items"] == []
    assert await events(client, sid) == before


async def test_bad_input_is_400_and_unknown_ids_404(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/sessions", json={"model": "nobody:x"})).status_code == 400
    assert (
        await client.post("/v1/sessions", json={"model": "scripted", "script": [{"nope": 1}]})
    ).status_code == 400
    assert (
        await client.post("/v1/sessions", json={"model": "scripted", "permission_mode": "god"})
    ).status_code == 400
    assert (
        await client.post("/v1/sessions", json={"model": "scripted", "machine": "nowhere"})
    ).status_code == 400
    malformed = await client.post(
        "/v1/sessions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    provider = await client.post("/v1/sessions", json={"model": "anthropic:claude-x"})
    assert provider.status_code == 201
    assert (await client.get("/v1/sessions/sess_missing")).status_code == 404
    assert (await post(client, "sess_missing")).status_code == 404
    sid = provider.json()["id"]
    assert (await client.get(f"/v1/sessions/{sid}/turns/turn_missing")).status_code == 404
    assert (await client.get(f"/v1/sessions/{sid}/changes/cs_missing")).status_code == 404
    assert (
        await client.post(f"/v1/sessions/{sid}/approvals/appr_missing", json={"decision": "allow"})
    ).status_code == 404
    page = f"/v1/sessions/{sid}/events"
    assert (await client.get(page, params={"limit": MAX_EVENTS_PAGE})).status_code == 200
    assert (await client.get(page, params={"limit": MAX_EVENTS_PAGE + 1})).status_code == 400
    assert (await client.get(page, params={"after": -1})).status_code == 400
    listed = (await client.get("/v1/sessions", params={"limit": 1000})).json()["items"]
    assert sid in [s["id"] for s in listed]


async def test_patch_changes_mode_and_metadata_and_refuses_the_rest(client: httpx.AsyncClient) -> None:
    sid = await create(client, [])
    r = await client.patch(f"/v1/sessions/{sid}", json={"permission_mode": "full-ask", "metadata": {"a": 1}})
    assert (
        r.status_code == 200
        and r.json()["permission_mode"] == "full-ask"
        and r.json()["metadata"] == {"a": 1}
    )
    for field, value in [("model", "openai:gpt"), ("instructions", "x"), ("mcp_servers", [])]:
        refused = await client.patch(f"/v1/sessions/{sid}", json={field: value})
        assert refused.status_code == 400 and "not supported" in refused.json()["message"]
    assert (await client.patch(f"/v1/sessions/{sid}", json={"permission_mode": "god"})).status_code == 400
    assert (await client.patch(f"/v1/sessions/{sid}", json={"permission_mode": None})).status_code == 400
    assert (await client.get(f"/v1/sessions/{sid}")).json()["permission_mode"] == "full-ask"
    assert [e["type"] for e in await events(client, sid)] == ["session.created", "session.updated"]


async def test_abort_of_a_hanging_turn_ends_it_once(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"hang": True}])
    turn_id = (await post(client, sid)).json()["turn_id"]
    await wait_status(client, sid, turn_id, "running")
    aborted = await client.post(f"/v1/sessions/{sid}/turns/{turn_id}/abort")
    assert aborted.status_code == 200 and aborted.json()["status"] == "aborted"
    again = await client.post(f"/v1/sessions/{sid}/turns/{turn_id}/abort")
    assert again.status_code == 200 and again.json()["status"] == "aborted"
    assert (await client.post(f"/v1/sessions/{sid}/abort")).json() == {"turn": None}
    terminal = [e["type"] for e in await events(client, sid) if e["type"] in TERMINAL_EVENTS]
    assert terminal == ["turn.aborted"]
    # the session-level abort finds the active turn itself
    sid2 = await create(client, [{"hang": True}])
    turn2 = (await post(client, sid2)).json()["turn_id"]
    await wait_status(client, sid2, turn2, "running")
    r = await client.post(f"/v1/sessions/{sid2}/abort")
    assert r.json()["turn"]["id"] == turn2 and r.json()["turn"]["status"] == "aborted"


async def test_approval_allow_runs_the_call(client: httpx.AsyncClient) -> None:
    script = [bash("echo approved"), {"expect": {"tool_result_contains": "approved"}, "text": "done"}]
    sid = await create(client, script, permission_mode="full-ask")
    await post(client, sid)
    asked = await frames(client, sid, stop=lambda f: f.event == "approval.requested")
    approval_id = asked[-1].data["approval_id"] if asked[-1].data else None
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "awaiting_approval"
    pending = (await client.get(f"/v1/sessions/{sid}/approvals", params={"status": "pending"})).json()[
        "items"
    ]
    assert [a["id"] for a in pending] == [approval_id] and pending[0]["tool"] == "bash"
    r = await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json={"decision": "allow"})
    assert r.status_code == 200 and r.json()["status"] == "allowed"
    twice = await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json={"decision": "deny"})
    assert twice.status_code == 409
    assert (await until_turn_end(client, sid))[-1].event == "turn.completed"
    assert (await client.get(f"/v1/sessions/{sid}/approvals", params={"status": "pending"})).json()[
        "items"
    ] == []


async def test_approval_deny_tells_the_model_the_message(client: httpx.AsyncClient) -> None:
    script = [bash("echo never"), {"expect": {"tool_result_contains": "not today"}, "text": "ok"}]
    sid = await create(client, script, permission_mode="full-ask")
    await post(client, sid)
    asked = await frames(client, sid, stop=lambda f: f.event == "approval.requested")
    approval_id = asked[-1].data["approval_id"] if asked[-1].data else None
    bad = await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json={"decision": "maybe"})
    assert bad.status_code == 400
    body = {"decision": "deny", "message": "not today"}
    assert (await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json=body)).status_code == 200
    streamed = await until_turn_end(client, sid)
    assert streamed[-1].event == "turn.completed"  # the expectation saw the message
    result = next(f.data for f in streamed if f.event == "agent.tool_result")
    assert result is not None and result["is_error"] and "not today" in result["content"][0]["text"]


async def test_an_approval_answered_after_a_server_restart_resumes_the_turn(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SIGTERM (a graceful shutdown) while a turn waits for the user, start again on the same home,
    answer: the call runs once and the turn completes."""
    home = traversable(tmp_path_factory.mktemp("restart"), tmp_path_factory) / "home"
    home.mkdir()
    script = [
        bash("echo ran >> /workspace/side.txt; echo wrote"),
        {"expect": {"tool_result_contains": "wrote"}},
    ]
    first = start_server(home)
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=DEADLINE) as client:
            sid = await create(client, script, permission_mode="full-ask")
            turn_id = (await post(client, sid)).json()["turn_id"]
            asked = await frames(client, sid, stop=lambda f: f.event == "approval.requested")
            approval_id = asked[-1].data["approval_id"] if asked[-1].data else None
    finally:
        stop_server(first)
    second = start_server(home)
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=DEADLINE) as client:
            assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "awaiting_approval"
            r = await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json={"decision": "allow"})
            assert r.status_code == 200, r.text
            await wait_status(client, sid, turn_id, "completed")
            results = [e for e in await events(client, sid) if e["type"] == "agent.tool_result"]
            assert len(results) == 1 and "wrote" in results[0]["content"][0]["text"]
            cat = await client.post(f"/sandboxes/{sid}/v1/file/read", json={"file": "/workspace/side.txt"})
            assert cat.json()["data"]["content"] == "ran\n"
    finally:
        stop_server(second)


async def test_a_change_set_is_applied_in_part(client: httpx.AsyncClient) -> None:
    script = [{"tool_calls": [write("a.txt", "A\n"), write("b.txt", "B\n")]}, {"text": "staged"}]
    sid = await create(client, script, permission_mode="workspace-write")
    await post(client, sid)
    assert any(f.event == "change_set.updated" for f in await until_turn_end(client, sid))
    [listed] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    cid = listed["id"]
    detail = (await client.get(f"/v1/sessions/{sid}/changes/{cid}")).json()
    op_a, op_b = (op["id"] for op in detail["operations"])
    assert "+A" in detail["operations"][0]["diff"] and "after" not in detail["operations"][0]
    applied = await client.post(f"/v1/sessions/{sid}/changes/{cid}/apply", json={"operations": [op_a]})
    assert applied.status_code == 200, applied.text
    assert [op["status"] for op in applied.json()["operations"]] == ["applied", "pending"]
    assert applied.json()["status"] == "open"
    rejected = await client.post(f"/v1/sessions/{sid}/changes/{cid}/reject", json={"operations": [op_b]})
    assert [op["status"] for op in rejected.json()["operations"]] == ["applied", "rejected"]
    assert rejected.json()["status"] == "partially_applied"
    again = await client.post(f"/v1/sessions/{sid}/changes/{cid}/apply", json={"operations": [op_a]})
    assert again.status_code == 409
    foreign = await client.post(f"/v1/sessions/{sid}/changes/{cid}/apply", json={"operations": ["cs_x:1"]})
    assert foreign.status_code == 400
    read = f"/sandboxes/{sid}/v1/file/read"
    assert (await client.post(read, json={"file": "/workspace/a.txt"})).json()["data"]["content"] == "A\n"
    assert (await client.post(read, json={"file": "/workspace/b.txt"})).json()["success"] is False


async def test_applying_and_rejecting_a_change_set_appear_in_the_event_log(client: httpx.AsyncClient) -> None:
    script = [{"tool_calls": [write("a.txt", "A\n"), write("b.txt", "B\n")]}, {"text": "staged"}]
    sid = await create(client, script, permission_mode="workspace-write")
    await post(client, sid)
    cursor = (await until_turn_end(client, sid))[-1].id or 0
    [listed] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    cid = listed["id"]
    op_a, op_b = (op["id"] for op in listed["operations"])
    tail = asyncio.create_task(
        frames(client, sid, params={"after": cursor}, stop=lambda f: f.event == "change_set.updated"
               and f.data is not None and f.data["status"] != "open")
    )  # fmt: skip
    assert (
        await client.post(f"/v1/sessions/{sid}/changes/{cid}/apply", json={"operations": [op_a]})
    ).is_success
    assert (
        await client.post(f"/v1/sessions/{sid}/changes/{cid}/reject", json={"operations": [op_b]})
    ).is_success
    streamed = [f for f in await tail if f.comment is None]
    logged = await events(client, sid, after=cursor)
    assert [(f.id, f.event) for f in streamed] == [(e["seq"], e["type"]) for e in logged]
    assert [e["type"] for e in logged] == ["change_set.updated", "change_set.updated"]
    applied, rejected = logged
    assert all(e["turn_id"] is None for e in logged)
    assert applied["change_set_id"] == cid and applied["status"] == "open"
    assert [(op["id"], op["status"]) for op in applied["operations"]] == [
        (op_a, "applied"),
        (op_b, "pending"),
    ]
    assert rejected["status"] == "partially_applied"
    assert [op["status"] for op in rejected["operations"]] == ["applied", "rejected"]
    refused = await client.post(f"/v1/sessions/{sid}/changes/{cid}/apply", json={"operations": [op_a]})
    assert refused.status_code == 409 and len(await events(client, sid, after=cursor)) == 2


async def test_delete_removes_the_session_and_keeps_its_files(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "got it"}])
    up = await client.post("/v1/files", files={"file": ("notes.txt", b"hello")}, data={"session_id": sid})
    assert up.status_code == 201, up.text
    file_id = up.json()["id"]
    await post(client, sid, body={"files": [file_id]})
    streamed = await until_turn_end(client, sid)
    assert "files.placed" in [f.event for f in streamed] and streamed[-1].event == "turn.completed"
    r = await client.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200 and r.json() == {"id": sid, "deleted": True}
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
    assert (await client.get(f"/v1/sessions/{sid}/events")).status_code == 404
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 404
    assert (await client.get(f"/v1/files/{file_id}")).status_code == 200


async def test_an_idle_stream_sends_heartbeats(client: httpx.AsyncClient) -> None:
    sid = await create(client, [])
    got = await frames(
        client, sid, params={"after": 1, "heartbeat": HEARTBEAT_MIN_S}, stop=lambda f: f.comment is not None
    )
    assert got[-1].comment == "heartbeat"
    low = await client.get(f"/v1/sessions/{sid}/events/stream", params={"heartbeat": HEARTBEAT_MIN_S - 0.01})
    assert low.status_code == 400
    bad = await client.get(f"/v1/sessions/{sid}/events/stream", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400


async def test_a_turn_that_only_plans_never_starts_the_sandbox(client: httpx.AsyncClient) -> None:
    """todo_write works on the session, not the machine: no sandbox starts for it."""
    todo = {"name": "todo_write", "input": {"todos": [{"content": "look around", "status": "pending"}]}}
    sid = await create(client, [{"tool_calls": [todo]}, {"text": "planned"}])
    await post(client, sid)
    streamed = await until_turn_end(client, sid)
    types = [f.event for f in streamed]
    assert types[-1] == "turn.completed" and "agent.tool_result" in types
    results = [f.data for f in streamed if f.event == "agent.tool_result" and f.data]
    assert [r["is_error"] for r in results] == [False], results
    assert "sandbox.ready" not in types
    assert (await client.get(f"/v1/sessions/{sid}")).json()["sandbox"] is None


async def test_a_session_in_plan_mode_cannot_apply_its_change_sets(client: httpx.AsyncClient) -> None:
    script = [{"tool_calls": [write("plan.md", "# Plan\n")]}, {"text": "proposed"}]
    sid = await create(client, script, permission_mode="workspace-write")
    await post(client, sid)
    assert (await until_turn_end(client, sid))[-1].event == "turn.completed"
    [change_set] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    apply = f"/v1/sessions/{sid}/changes/{change_set['id']}/apply"
    assert (await client.patch(f"/v1/sessions/{sid}", json={"permission_mode": "plan"})).status_code == 200
    refused = await client.post(apply, json={})
    assert refused.status_code == 409, refused.text
    assert refused.json()["data"]["error_type"] == "conflict" and "plan mode" in refused.json()["message"]
    read = await client.get(f"/sandboxes/{sid}/v2/fs/read", params={"path": "/workspace/plan.md"})
    assert read.status_code == 404, read.text  # nothing was written
    still = (await client.get(f"/v1/sessions/{sid}/changes/{change_set['id']}")).json()
    assert [op["status"] for op in still["operations"]] == ["pending"]
    await client.patch(f"/v1/sessions/{sid}", json={"permission_mode": "workspace-write"})
    applied = await client.post(apply, json={})
    assert [op["status"] for op in applied.json()["operations"]] == ["applied"], applied.text


async def test_a_file_in_new_folders_is_proposed_in_one_change_set_and_applied(
    client: httpx.AsyncClient,
) -> None:
    folder = {"name": "write_file", "input": {"path": "reports", "kind": "folder"}}
    sub = {"name": "write_file", "input": {"path": "reports/q1", "kind": "folder"}}
    report = write("reports/q1/summary.md", "# Q1\n")
    script = [
        {"tool_calls": [folder]},
        {"tool_calls": [sub]},
        {"tool_calls": [report]},
        {"text": "proposed", "expect": {"tool_result_contains": "reports/q1/summary.md"}},
    ]
    sid = await create(client, script, permission_mode="workspace-write")
    await post(client, sid)
    streamed = await until_turn_end(client, sid)
    assert streamed[-1].event == "turn.completed"
    results = [f.data for f in streamed if f.event == "agent.tool_result" and f.data]
    assert [r["is_error"] for r in results] == [False, False, False], results
    [change_set] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    ops = (await client.get(f"/v1/sessions/{sid}/changes/{change_set['id']}")).json()["operations"]
    assert [op["kind"] for op in ops] == ["mkdir", "mkdir", "write"]
    # the write alone, before its folder: refused clearly, nothing written
    alone = await client.post(
        f"/v1/sessions/{sid}/changes/{change_set['id']}/apply", json={"operations": [ops[2]["id"]]}
    )
    failed = next(op for op in alone.json()["operations"] if op["id"] == ops[2]["id"])
    assert failed["status"] == "failed" and "does not exist" in failed["reason"]
    listed = await client.get(f"/sandboxes/{sid}/v2/fs/list", params={"path": "/workspace"})
    assert "reports" not in {entry["name"] for entry in listed.json()["data"]["files"]}
    # a fresh proposal of the same file, applied whole in planning order
    sid2 = await create(client, script, permission_mode="workspace-write")
    await post(client, sid2)
    assert (await until_turn_end(client, sid2))[-1].event == "turn.completed"
    [second] = (await client.get(f"/v1/sessions/{sid2}/changes")).json()["items"]
    applied = await client.post(f"/v1/sessions/{sid2}/changes/{second['id']}/apply", json={})
    assert [op["status"] for op in applied.json()["operations"]] == ["applied"] * 3, applied.text
    read = await client.get(
        f"/sandboxes/{sid2}/v2/fs/read", params={"path": "/workspace/reports/q1/summary.md"}
    )
    assert read.json()["data"]["content"] == "# Q1\n", read.text


async def test_a_subagents_transcript_is_read_through_the_api_and_only_in_its_session(
    client: httpx.AsyncClient,
) -> None:
    child = [
        {"tool_calls": [{"name": "glob", "input": {"pattern": "*.md"}}]},
        {"text": "No markdown here."},
    ]
    task = {"name": "task", "input": {"agent": "explore", "prompt": "find docs"}, "script": child}
    sid = await create(client, [{"tool_calls": [task]}, {"text": "done"}])
    assert (await post(client, sid)).status_code == 202
    assert (await until_turn_end(client, sid))[-1].event == "turn.completed"
    listed = (await client.get(f"/v1/sessions/{sid}/subagents")).json()["items"]
    assert [(r["agent"], r["status"], r["tool_use_id"]) for r in listed] == [
        ("explore", "completed", "toolu_s0_0")
    ]
    run_id = listed[0]["id"]
    r = await client.get(f"/v1/sessions/{sid}/subagents/{run_id}")
    assert r.status_code == 200, r.text
    body = r.json()
    # The parent's tier, intersected with explore's: explore only looks, and may use the web.
    assert body["run"]["id"] == run_id and body["run"]["tier"] == "full-auto"
    assert (body["messages"][0]["role"], body["messages"][0]["text"]) == ("user", "find docs")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"][0]["name"] == "glob"
    assert body["messages"][-1]["text"] == "No markdown here."
    completed = next(e for e in await events(client, sid) if e["type"] == "subagent.completed")
    assert completed["subagent_id"] == run_id
    other = await create(client, [])
    missing = await client.get(f"/v1/sessions/{other}/subagents/{run_id}")
    assert missing.status_code == 404 and missing.json()["data"]["error_type"] == "not_found"


async def test_a_session_works_in_the_knowledge_bases_it_selected(client: httpx.AsyncClient) -> None:
    """Registered and selected over the API: commands start in the first one, its view and the
    listing say so, and a folder outside the workspace or an unknown id is refused (400)."""
    for bad in ({"knowledge_bases": [{"id": "etc", "path": "/etc"}]},
                {"knowledge_bases": [{"id": "up", "path": "../x"}]},
                {"knowledge_base_ids": ["missing"]}):  # fmt: skip
        r = await client.post("/v1/sessions", json={"model": "scripted", "script": [], **bad})
        assert r.status_code == 400, r.text
    prepare = {"tool_calls": [{"name": "bash", "input": {"command": "mkdir -p notes", "cwd": "/workspace"}}]}
    sid = await create(
        client, [prepare, bash("pwd"), {"text": "Done."}],
        knowledge_bases=[{"id": "notes", "path": "notes", "name": "Notes"}], knowledge_base_ids=["notes"],
    )  # fmt: skip
    shown = (await client.get(f"/v1/sessions/{sid}")).json()
    assert shown["knowledge_base_ids"] == ["notes"] and shown["knowledge_bases"][0]["path"] == "notes"
    listed = (await client.get(f"/v1/sessions/{sid}/knowledge-bases")).json()["items"]
    assert [(k["id"], k["path"], k["selected"], k["base"]) for k in listed] == [
        ("workspace", ".", False, False), ("notes", "notes", True, True)
    ]  # fmt: skip
    assert (await post(client, sid)).status_code == 202
    streamed = await until_turn_end(client, sid)
    results = [f.data for f in streamed if f.event == "agent.tool_result" and f.data]
    assert "/workspace/notes" in results[-1]["content"][0]["text"]
    patched = await client.patch(f"/v1/sessions/{sid}", json={"knowledge_base_ids": None})
    assert patched.status_code == 200 and patched.json()["knowledge_base_ids"] is None
    wrong = await client.patch(f"/v1/sessions/{sid}", json={"knowledge_base_ids": ["nope"]})
    assert wrong.status_code == 400
