"""The `browser` tool in real sessions: a server whose machine is a browser-enabled sandbox on
the data image, the scripted model, pages served inside the session's own sandbox."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentbox.agent.loop import NOT_RUN_AFTER_TAKEOVER
from tests.conftest import Server

#: Seconds a test waits for an event or a status before failing.
DEADLINE = 60.0
PORT = 8000
SITE = f"http://127.0.0.1:{PORT}"
FORM = (
    "<title>Form</title><h1>Sign up</h1><form action='result.html'>"
    "<input name='name' aria-label='Name'><button type='submit'>Send</button></form>"
)
RESULT = (
    "<title>Result</title><p id='out'></p><script>document.getElementById('out').textContent = "
    "'Hello ' + new URLSearchParams(location.search).get('name');</script>"
)
DIALOGS = (
    "<title>Dialogs</title><button onclick=\"alert('careful')\">Alert</button>"
    "<button onclick=\"document.getElementById('r').textContent = 'name=' + prompt('Your name?')\">Ask</button>"
    "<p id='r'>none</p>"
)
#: The references page.elements.snapshot gives FORM's and DIALOGS's elements, each the first
#: page of its tab: the same page in the same state gives the same references, so a script can
#: name them (its `expect` checks). A page's later documents number theirs by frame (`f2e3`).
NAME_BOX, SEND = "e4", "e5"
ALERT, ASK = "e2", "e3"


@pytest.fixture
async def client(browser_server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=browser_server.url, timeout=DEADLINE) as c:
        yield c


def browse(action: str, **args: Any) -> dict[str, Any]:
    return {"name": "browser", "input": {"action": action, **args}}


def step(*calls: dict[str, Any], expect: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"tool_calls": list(calls)}
    if expect is not None:
        body["expect"] = {"tool_result_contains": expect}
    return body


async def session(client: httpx.AsyncClient, script: list[Any], **fields: Any) -> str:
    r = await client.post("/v1/sessions", json={"model": "scripted", "script": script, **fields})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    await serve_pages(client, sid)
    return sid


async def serve_pages(client: httpx.AsyncClient, sid: str) -> None:
    """FORM, RESULT and DIALOGS on 127.0.0.1:PORT inside the session's sandbox."""
    base = f"/sandboxes/{sid}"
    r = await client.post(f"{base}/v2/fs/mkdir", json={"path": "/workspace/site", "parents": True})
    assert r.status_code == 200, r.text
    for name, html in (("form.html", FORM), ("result.html", RESULT), ("dialogs.html", DIALOGS)):
        r = await client.post(
            f"{base}/v2/fs/write", json={"path": f"/workspace/site/{name}", "content": html}
        )
        assert r.status_code == 200, r.text
    command = f"cd /workspace/site && exec python3 -m http.server {PORT} --bind 127.0.0.1"
    r = await client.post(f"{base}/v2/commands", json={"command": command, "mode": "async"})
    assert r.status_code == 200, r.text
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {PORT}), 1)\""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        r = await client.post(f"{base}/v2/commands", json={"command": probe})
        if r.json()["data"]["exit_code"] == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the page server did not start")


async def events(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def wait_event(client: httpx.AsyncClient, sid: str, kind: str, count: int = 1) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        found = [e for e in await events(client, sid) if e["type"] == kind]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {kind} event in {[e['type'] for e in await events(client, sid)]}")


async def run_turn(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
    assert r.status_code == 202, r.text
    ended = await wait_end(client, sid)
    return ended


async def wait_end(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        got = await events(client, sid)
        if any(e["type"] in ("turn.completed", "turn.failed", "turn.aborted") for e in got):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"the turn did not end: {[e['type'] for e in await events(client, sid)]}")


def results(got: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in got if e["type"] == "agent.tool_result"]


def text_of(result: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in result["content"])


def ended(got: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in got if e["type"] in ("turn.completed", "turn.failed", "turn.aborted"))


async def test_a_session_fills_a_form_handles_dialogs_and_takes_a_screenshot(
    client: httpx.AsyncClient,
) -> None:
    script = [
        step(browse("page.navigate", url=f"{SITE}/form.html")),
        step(browse("page.elements.snapshot"), expect="navigated"),
        step(browse("page.fill", ref=NAME_BOX, text="Ada"), expect=f'textbox "Name" [ref={NAME_BOX}]'),
        step(browse("page.click", ref=SEND), expect="fill"),
        step(browse("page.wait_for", text="Hello Ada")),
        step(browse("page.text.snapshot")),
        step(browse("tabs.new", url=f"{SITE}/dialogs.html"), expect="Hello Ada"),
        step(browse("page.elements.snapshot"), expect="opened tab 2"),
        step(browse("page.click", ref=ALERT), expect=f'button "Alert" [ref={ALERT}]'),
        step(browse("page.text.snapshot"), expect="alert dialog"),
        step(browse("browser.get_state"), expect="dialog is open"),
        step(browse("page.dialog.accept"), expect="pending alert dialog"),
        step(browse("page.click", ref=ASK), expect="accepted the alert"),
        step(browse("page.dialog.accept", text="Bob"), expect="prompt dialog"),
        step(browse("page.wait_for", text="name=Bob"), expect="with 'Bob'"),
        step(browse("page.click", ref=ASK), expect="name=Bob"),
        step(browse("page.dialog.dismiss"), expect="prompt dialog"),
        step(browse("page.wait_for", text="name=null"), expect="dismissed"),
        step(browse("page.screenshot"), expect="name=null"),
        {"text": "done", "expect": {"tool_result_contains": "The user sees it"}},
    ]
    sid = await session(client, script)
    got = await run_turn(client, sid)
    assert ended(got)["type"] == "turn.completed", [text_of(r) for r in results(got)][-3:]
    assert all(not r["is_error"] for r in results(got) if "dialog is open" not in text_of(r))
    blocked = [r for r in results(got) if "dialog is open" in text_of(r)]
    assert len(blocked) == 1 and blocked[0]["is_error"]

    shots = [e for e in got if e["type"] == "browser.screenshot"]
    assert len(shots) == 1 and shots[0]["url"] == f"{SITE}/dialogs.html"
    png = await client.get(f"/v1/files/{shots[0]['file_id']}/content")
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG\r\n\x1a\n")
    assert shots[0]["bytes"] == len(png.content)
    # the picture reaches the user, never the model's context
    shot_result = results(got)[-1]
    assert shot_result["tool_use_id"] == shots[0]["tool_use_id"]
    encoded = base64.b64encode(png.content[:48]).decode()[:40]
    transcript = str(await events(client, sid))
    assert encoded not in transcript and len(text_of(shot_result)) < 400


async def test_full_ask_asks_for_each_call_with_its_url_tab_and_element(client: httpx.AsyncClient) -> None:
    script = [
        step(browse("page.navigate", url=f"{SITE}/form.html")),
        step(browse("page.elements.snapshot")),
        step(browse("page.click", ref=SEND)),
        {"text": "done"},
    ]
    sid = await session(client, script, permission_mode="full-ask")
    await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
    asked = []
    for n in range(1, 4):
        approval = (await wait_event(client, sid, "approval.requested", n))[-1]
        asked.append(approval)
        r = await client.post(
            f"/v1/sessions/{sid}/approvals/{approval['approval_id']}", json={"decision": "allow"}
        )
        assert r.status_code == 200, r.text
    got = await wait_end(client, sid)
    assert ended(got)["type"] == "turn.completed"
    pending = (await client.get(f"/v1/sessions/{sid}/approvals")).json()["items"]
    by_id = {a["id"]: a for a in pending}
    details = [by_id[a["approval_id"]]["detail"] for a in asked]
    assert [by_id[a["approval_id"]]["action"] for a in asked] == [
        "browser_write",
        "browser_read",
        "browser_write",
    ]
    assert details[0]["url"] == f"{SITE}/form.html" and details[0]["arguments"]["action"] == "page.navigate"
    assert details[1]["tab"] == details[2]["tab"] and details[1]["url"] == f"{SITE}/form.html"
    assert details[2]["element"] == 'button "Send"' and details[2]["arguments"]["ref"] == SEND


async def test_plan_asks_to_read_a_page_and_refuses_a_click_without_asking(client: httpx.AsyncClient) -> None:
    script = [
        step(browse("page.elements.snapshot")),
        step(browse("page.click", ref="e1"), expect="tab 1"),
        {"text": "done", "expect": {"tool_result_contains": "not permitted"}},
    ]
    sid = await session(client, script, permission_mode="plan")  # plan is full-ask's, looking only
    await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
    asked = (await wait_event(client, sid, "approval.requested"))[0]
    r = await client.post(f"/v1/sessions/{sid}/approvals/{asked['approval_id']}", json={"decision": "allow"})
    assert r.status_code == 200, r.text
    got = await wait_end(client, sid)
    assert ended(got)["type"] == "turn.completed", [text_of(r) for r in results(got)]
    first, second = results(got)
    assert not first["is_error"] and second["is_error"]
    assert len([e for e in got if e["type"] == "approval.requested"]) == 1


async def test_workspace_write_refuses_the_browser_and_mcp_lists_it_where_allowed(
    client: httpx.AsyncClient,
) -> None:
    script = [
        step(browse("browser.get_state")),
        {"text": "done", "expect": {"tool_result_contains": "not permitted"}},
    ]
    sid = await session(client, script, permission_mode="workspace-write")
    got = await run_turn(client, sid)
    assert ended(got)["type"] == "turn.completed" and results(got)[0]["is_error"]
    # over MCP the machine's own tier (full-auto in a sandbox) offers it, with its schema
    listed = await client.post(
        "/mcp", headers=MCP_HEADERS | {"X-Agentbox-Session": sid},
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
    )  # fmt: skip
    tools = {tool["name"]: tool for tool in mcp_result(listed)["tools"]}
    assert "page.elements.snapshot" in str(tools["browser"]["inputSchema"])


async def test_takeover_cancels_the_call_under_way_and_ends_the_turn(client: httpx.AsyncClient) -> None:
    script = [
        step(browse("page.navigate", url=f"{SITE}/form.html")),
        step(browse("page.wait_for", text="never there", timeout=60), browse("page.reload")),
        {"text": "should not come"},
    ]
    sid = await session(client, script)
    await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
    await wait_event(client, sid, "agent.tool_use", 2)
    await asyncio.sleep(0.5)
    r = await client.post(f"/v1/sessions/{sid}/browser/takeover")
    assert r.status_code == 200 and r.json() == {"taken_over": True, "cancelled": 1}, r.text
    got = await wait_end(client, sid)
    assert ended(got)["type"] == "turn.completed" and ended(got)["stop_reason"] == "user_takeover"
    waited, reload = results(got)[1:]
    assert waited["is_error"] and "took over" in text_of(waited)
    assert reload["is_error"] and text_of(reload) == NOT_RUN_AFTER_TAKEOVER
    assert [e["cancelled"] for e in got if e["type"] == "browser.takeover"] == [1]
    assert not any(e["type"] == "agent.message" and "should not" in str(e) for e in got)

    released = await client.post(f"/v1/sessions/{sid}/browser/release")
    assert released.status_code == 200 and released.json()["taken_over"] is False
    assert "browser.released" in [e["type"] for e in await events(client, sid)]


async def test_takeover_of_a_session_without_a_browser_is_refused(
    client: httpx.AsyncClient, browser_server: Server
) -> None:
    r = await client.post("/v1/sessions", json={"model": "scripted", "script": [], "machine": "none"})
    sid = r.json()["id"]
    refused = await client.post(f"/v1/sessions/{sid}/browser/takeover")
    assert refused.status_code == 400 and refused.json()["data"]["error_type"] == "bad_request", refused.text
    assert "no machine" in refused.json()["message"]
    missing = await client.post("/v1/sessions/ses_nothing/browser/takeover")
    assert missing.status_code == 404


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def mcp_result(response: httpx.Response) -> dict[str, Any]:
    import json

    assert response.status_code == 200, response.text
    body = response.text
    if body.startswith("event:") or "data:" in body.split("\n", 1)[0]:
        body = next(line[5:] for line in body.splitlines() if line.startswith("data:"))
    return dict(json.loads(body)["result"])


async def test_the_researcher_reads_the_browsers_pages_and_cannot_act(client: httpx.AsyncClient) -> None:
    child = [
        step(browse("page.text.snapshot")),
        step(browse("page.click", ref=SEND), expect="Sign up"),
        {"text": "the page says Sign up", "expect": {"tool_result_contains": "Invalid arguments"}},
    ]
    script = [
        step(browse("page.navigate", url=f"{SITE}/form.html")),
        {"tool_calls": [{"name": "task", "input": {"agent": "researcher", "prompt": "read the page"},
                         "script": child}]},
        {"text": "done", "expect": {"tool_result_contains": "the page says Sign up"}},
    ]  # fmt: skip
    sid = await session(client, script)
    got = await run_turn(client, sid)
    assert ended(got)["type"] == "turn.completed", [text_of(r) for r in results(got)]
    assert not results(got)[-1]["is_error"]
