"""Issue 6's "done when": a session driven by an OpenAI-compatible model edits files in its
sandbox, runs commands, delivers a file and survives a compaction, all in the event stream.

Real parts: `agentbox serve` (uvicorn on loopback, a SQLite file, bubblewrap sandboxes) and
the `openai:` adapter over HTTP. The model is a small loopback server speaking Chat
Completions (streamed, tool-call fragments split across chunks, usage in the last chunk)
whose replies follow the conversation it is sent, as a model's would: it decides from the
last message what to do next, and answers the compaction's summary request with a summary.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.agent.compaction import SUMMARIZER_SYSTEM, SUMMARY_HEAD
from agentbox.agent.context import COMPACTED_EVENT
from tests.conftest import Server, start_server, stop_server
from tests.test_api_sessions import DEADLINE, frames
from tests.test_providers import (
    Canned,
    Loopback,
    Received,
    anthropic_sse,
    anthropic_turn,
    delta,
    finish,
    openai_sse,
)

#: Lines of output the command prints: enough to push the context over the session's threshold.
OUTPUT_LINES = 1500
#: The session's context window and reserve: compaction triggers above 3000 - 1500 tokens.
WINDOW, RESERVE = 3000, 1500
SUMMARY = "## Goal\nBuild hello.py and deliver its output.\n\n## Progress\n### Done\n- [x] wrote hello.py"


def usage_chunk(body: dict[str, Any]) -> dict[str, Any]:
    """What the server counts: the conversation's characters / 4 (system and tools left out)."""
    prompt = len(json.dumps(body["messages"])) // 4
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 12}}


def text_reply(body: dict[str, Any], text: str) -> Canned:
    half = len(text) // 2
    return Canned(body=openai_sse(
        delta(role="assistant", content=text[:half]), delta(content=text[half:]),
        finish("stop"), usage_chunk(body),
    ))  # fmt: skip


def tool_reply(body: dict[str, Any], name: str, arguments: dict[str, Any]) -> Canned:
    """A tool call in fragments: the id and name first, the arguments split in three pieces.

    Ids are numbered by the conversation's length, so after a compaction one repeats an older
    call's id, as servers that number calls per response do (the loop makes them unique)."""
    raw = json.dumps(arguments)
    cut = len(raw) // 3
    call_id = f"call_{len(body['messages'])}"
    first = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    pieces = [raw[:cut], raw[cut : 2 * cut], raw[2 * cut :]]
    chunks = [delta(role="assistant", tool_calls=[first])]
    chunks += [delta(tool_calls=[{"index": 0, "function": {"arguments": p}}]) for p in pieces]
    return Canned(body=openai_sse(*chunks, finish("tool_calls"), usage_chunk(body)))


def last_call(messages: list[dict[str, Any]]) -> str:
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    return str(calls[-1]["tool_calls"][0]["function"]["name"]) if calls else ""


def agent(request: Received) -> Canned:
    """The model: write, edit, run, deliver, report; a summary when asked for one."""
    body = request.json
    messages = body["messages"]
    if messages[0]["role"] == "system" and messages[0]["content"] == SUMMARIZER_SYSTEM:
        return text_reply(body, SUMMARY)
    last = messages[-1]
    if last["role"] == "user" and "Build" in str(last["content"]):
        return tool_reply(body, "write_file", {"path": "hello.py", "content": "print('hello')\n"})
    if last["role"] == "tool":
        step = last_call(messages)
        if step == "write_file":
            return tool_reply(body, "edit_file", {
                "path": "hello.py", "oldText": "'hello'", "newText": "'hello from agentbox'",
            })  # fmt: skip
        if step == "edit_file":
            command = f"python3 hello.py > out.txt && cat out.txt && seq 1 {OUTPUT_LINES}"
            return tool_reply(body, "bash", {"command": command})
        if step == "bash":
            return tool_reply(body, "deliver_file", {"path": "out.txt"})
        return text_reply(body, "Built hello.py, ran it and delivered out.txt.")
    remembered = messages[1]["content"].startswith(SUMMARY_HEAD) if len(messages) > 1 else False
    return text_reply(body, f"Summary in context: {remembered}.")


def claude(request: Received) -> Canned:
    """An Anthropic model that thinks before it reads a file, then says whether its thinking
    (with the signature) came back with its tool_use, as the API requires."""
    messages = request.json["messages"]
    if len(messages) == 1:
        return Canned(body=anthropic_turn("toolu_e2e"))
    blocks = messages[1]["content"]
    kept = blocks[0] == {"type": "thinking", "thinking": "Let me look.", "signature": "sig=="}
    text = "thinking came back" if kept else f"thinking lost: {blocks}"
    return Canned(body=anthropic_sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 40, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
        {"type": "message_stop"},
    ))  # fmt: skip


async def loopback_model(respond: Callable[[Received], Canned]) -> AsyncIterator[Loopback]:
    loopback = Loopback(respond=respond)
    loopback.server = await asyncio.start_server(loopback.handle, "127.0.0.1", 0)
    yield loopback
    loopback.stop.set()
    loopback.server.close()
    await loopback.server.wait_closed()


@pytest.fixture
async def llm() -> AsyncIterator[Loopback]:
    async for loopback in loopback_model(agent):
        yield loopback


@pytest.fixture
async def anthropic_llm() -> AsyncIterator[Loopback]:
    async for loopback in loopback_model(claude):
        yield loopback


def serving(sandbox_tmp: Path, endpoints: list[str]) -> Iterator[Server]:
    """A server whose operator lists `endpoints` as model endpoints sessions may use."""
    home = sandbox_tmp / "home"
    home.mkdir()
    config = sandbox_tmp / "agentbox.toml"
    config.write_text(f"model_endpoints = {json.dumps(endpoints)}\n")
    started = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    yield started
    stop_server(started)


@pytest.fixture
def listed(sandbox_tmp: Path, llm: Loopback, anthropic_llm: Loopback) -> Iterator[Server]:
    """A server whose operator lists the two loopback models as endpoints sessions may use."""
    yield from serving(sandbox_tmp, [f"{llm.url}/v1", anthropic_llm.url])


async def test_an_openai_compatible_model_edits_runs_delivers_and_survives_compaction(
    listed: Server, llm: Loopback
) -> None:
    async with httpx.AsyncClient(base_url=listed.url, timeout=DEADLINE) as client:
        r = await client.post("/v1/sessions", json={
            "model": "openai:local-coder",
            "model_options": {"base_url": llm.url + "/v1", "api_key": "sk-local", "context_window": WINDOW},
            "compaction": {"reserve_tokens": RESERVE, "keep_recent_tokens": 200},
        })  # fmt: skip
        assert r.status_code == 201, r.text
        session = r.json()
        assert session["model_options"]["api_key"] == "***"  # never shown back
        sid = session["id"]

        r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Build hello.py and run it."})
        assert r.status_code == 202, r.text
        turn = r.json()["turn_id"]
        streamed = await frames(client, sid, params={"until": "turn_end"})
        log = [f.data for f in streamed if f.data is not None and f.data.get("turn_id") == turn]
        types = [e["type"] for e in log]
        assert types[-1] == "turn.completed", log[-1]
        calls = [e["name"] for e in log if e["type"] == "agent.tool_use"]
        assert calls == ["write_file", "edit_file", "bash", "deliver_file"]
        ids = [e["tool_use_id"] for e in log if e["type"] == "agent.tool_use"]
        assert len(set(ids)) == 4 and ids[3].startswith("call_4_")  # the repeated id was made unique
        results = [e for e in log if e["type"] == "agent.tool_result"]
        assert [e["tool_use_id"] for e in results] == ids
        assert not any(e["is_error"] for e in results), results
        assert "hello from agentbox" in results[2]["content"][0]["text"]
        (delivered,) = [e for e in log if e["type"] == "file.delivered"]
        compactions = [e for e in log if e["type"] == COMPACTED_EVENT]
        assert compactions and compactions[0]["reason"] == "threshold"
        assert compactions[0]["tokens_before"] > WINDOW - RESERVE
        assert "hello.py" in compactions[0]["modified_files"]
        assert types.index(COMPACTED_EVENT) < types.index("file.delivered")  # it went on after compacting
        final = [e for e in log if e["type"] == "agent.message"][-1]
        assert final["content"][0]["text"] == "Built hello.py, ran it and delivered out.txt."

        r = await client.get(f"/v1/files/{delivered['file_id']}/content")
        assert r.status_code == 200 and r.text == "hello from agentbox\n"
        summary_requests = [q for q in llm.requests if not q.json.get("tools")]
        assert len(summary_requests) == len(compactions) == 2  # after the long output, and again
        assert "[Assistant tool calls]: write_file(" in summary_requests[0].json["messages"][1]["content"]
        merged = summary_requests[1].json["messages"][1]["content"]
        assert "<previous-summary>" in merged and "Build hello.py and deliver its output." in merged
        assert all(q.headers["authorization"] == "Bearer sk-local" for q in llm.requests)

        r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "What do you remember?"})
        streamed = await frames(client, sid, params={"until": "turn_end", "after": streamed[-1].id})
        answer = [f.data for f in streamed if f.data is not None and f.data["type"] == "agent.message"]
        assert answer[-1]["content"][0]["text"] == "Summary in context: True."
        r = await client.get(f"/v1/sessions/{sid}")
        assert r.json()["usage"]["model_calls"] == sum(1 for _ in llm.requests)
        await client.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"compaction": {"reserve": 1}}, "unknown keys"),
        ({"compaction": {"keep_recent_tokens": 0}}, "keep_recent_tokens"),
        ({"compaction": {"reserve_tokens": True}}, "reserve_tokens"),
        ({"model_options": {"context_window": -1}}, "context_window"),
        ({"model_options": {"max_output_tokens": "many"}}, "max_output_tokens"),
        ({"model_options": {"vision": "yes"}}, "vision must be true or false"),
        ({"model_options": {"timeout": "soon"}}, "model_options cannot configure"),
    ],
)
async def test_runtime_settings_are_checked_at_creation(
    server: Server, extra: dict[str, Any], named: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
        before = (await client.get("/v1/sessions", params={"limit": 500})).json()["items"]
        r = await client.post("/v1/sessions", json={"model": "openai:gpt-4.1", **extra})
        assert r.status_code == 400 and named in r.json()["message"], r.text
        assert (await client.get("/v1/sessions", params={"limit": 500})).json()["items"] == before


async def test_a_session_without_a_machine_over_http(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
        r = await client.post("/v1/sessions", json={
            "model": "scripted", "machine": "none", "script": [{"text": "no sandbox needed"}],
        })  # fmt: skip
        assert r.status_code == 201 and r.json()["machine"] == "none" and r.json()["sandbox"] is None
        sid = r.json()["id"]
        await client.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})
        streamed = await frames(client, sid, params={"until": "turn_end"})
        types = [f.event for f in streamed]
        assert types[-1] == "turn.completed" and "sandbox.ready" not in types
        assert (await client.get(f"/v1/sessions/{sid}")).json()["sandbox"] is None
        await client.delete(f"/v1/sessions/{sid}")


async def test_an_anthropic_model_gets_its_thinking_back_with_its_tool_use(
    listed: Server, anthropic_llm: Loopback
) -> None:
    async with httpx.AsyncClient(base_url=listed.url, timeout=DEADLINE) as client:
        r = await client.post("/v1/sessions", json={
            "model": "anthropic:claude-test", "toolset": "flue",
            "model_options": {"base_url": anthropic_llm.url, "api_key": "ak-e2e", "max_tokens": 2000},
        })  # fmt: skip
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        await client.post(f"/v1/sessions/{sid}/messages", json={"content": "read a.txt"})
        streamed = await frames(client, sid, params={"until": "turn_end"})
        log = [f.data for f in streamed if f.data is not None]
        assert log[-1]["type"] == "turn.completed", log[-1]
        assert [e["name"] for e in log if e["type"] == "agent.tool_use"] == ["read"]
        final = [e for e in log if e["type"] == "agent.message"][-1]
        assert final["content"][0]["text"] == "thinking came back"
        sent = anthropic_llm.requests[0]
        assert sent.headers["x-api-key"] == "ak-e2e" and sent.json["max_tokens"] == 2000
        assert "Machine: sandbox" in sent.json["system"][0]["text"]
        await client.delete(f"/v1/sessions/{sid}")


@pytest.fixture
async def quiet_llm() -> AsyncIterator[Loopback]:
    """A model that answers every request with a line of text (its requests are the record)."""
    async for loopback in loopback_model(lambda request: text_reply(request.json, "Noted.")):
        yield loopback


@pytest.fixture
def quiet_server(sandbox_tmp: Path, quiet_llm: Loopback) -> Iterator[Server]:
    yield from serving(sandbox_tmp, [f"{quiet_llm.url}/v1"])


async def test_the_skill_tools_are_offered_once_there_is_something_for_them(
    quiet_server: Server, quiet_llm: Loopback
) -> None:
    """No skills: neither skill tool. A skill: `activate_skill`. A skill with a file: both."""
    async with httpx.AsyncClient(base_url=quiet_server.url, timeout=DEADLINE) as client:
        r = await client.post("/v1/sessions", json={
            "model": "openai:local", "toolset": "flue",
            "model_options": {"base_url": quiet_llm.url + "/v1", "api_key": "sk-local"},
        })  # fmt: skip
        assert r.status_code == 201, r.text
        sid = r.json()["id"]

        seen = [0]  # the last event read: each wait starts after the turn before

        async def offered_after_a_turn() -> set[str]:
            before = len(quiet_llm.requests)
            await client.post(f"/v1/sessions/{sid}/messages", json={"content": "hello"})
            streamed = await frames(client, sid, params={"until": "turn_end", "after": seen[0]})
            seen[0] = int(streamed[-1].id)
            assert streamed[-1].event == "turn.completed"
            [request] = quiet_llm.requests[before:]
            return {tool["function"]["name"] for tool in request.json["tools"]}

        async def put(path: str, content: str) -> None:
            body = {"file": f"/workspace/.agents/skills/{path}", "content": content}
            assert (await client.post(f"/sandboxes/{sid}/v1/file/write", json=body)).status_code == 200

        skill_tools = {"activate_skill", "read_skill_resource"}
        assert not (await offered_after_a_turn()) & skill_tools
        await put("notes/SKILL.md", "---\nname: notes\ndescription: Takes notes.\n---\nWrite them down.\n")
        assert (await offered_after_a_turn()) & skill_tools == {"activate_skill"}
        await put("notes/template.md", "# Notes\n")
        assert (await offered_after_a_turn()) & skill_tools == skill_tools
        await client.delete(f"/v1/sessions/{sid}")
