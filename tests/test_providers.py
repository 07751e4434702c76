"""The provider adapters end to end against loopback servers that speak each wire protocol.

The servers (a raw asyncio HTTP/1.1 server on 127.0.0.1) answer each request with the next
canned response: a status, headers and a body written in deliberately awkward chunks (split
mid-line, mid-JSON, mid-character; several events in one chunk), or no answer at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

import pytest

from agentbox.agent.models import ChatMessage, ModelError, ModelRequest, ToolCall, ToolSpec
from agentbox.agent.providers import AnthropicModel, OpenAIModel, provider_model
from agentbox.agent.providers import anthropic as anthropic_adapter
from agentbox.agent.providers.arguments import (
    INVALID_ARGUMENTS,
    QUOTED_ARGUMENTS,
    invalid_arguments,
    parse_arguments,
)
from agentbox.agent.providers.errors import (
    BODY_EXCERPT,
    AuthError,
    ContextOverflow,
    InvalidRequest,
    Overloaded,
    RateLimited,
    ServerError,
    Timeout,
    classify,
    parse_retry_after,
)
from agentbox.agent.providers.openai import to_messages as openai_messages
from agentbox.agent.providers.retry import MAX_DELAY, RetryingModel, RetryPolicy, with_retries
from agentbox.agent.providers.sse import ServerSentEvent, SSEParser
from agentbox.agent.worker import UnknownModel, scripted_or_refuse
from agentbox.store.sessions import Session

# ------------------------------------------------------------------ the loopback server


@dataclass
class Canned:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False
    """Read the request, then never answer (until the server stops)."""


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    json: dict[str, Any]


#: Sizes the body is cut into, in turn: single bytes (mid-line, mid-character) to several events.
AWKWARD_SIZES = (1, 7, 3, 64, 2, 13, 200, 5)


def awkward(body: bytes) -> list[bytes]:
    pieces, at, turn = [], 0, 0
    while at < len(body):
        size = AWKWARD_SIZES[turn % len(AWKWARD_SIZES)]
        pieces.append(body[at : at + size])
        at, turn = at + size, turn + 1
    return pieces


class Loopback:
    """Answers each request with the next canned response, or, when none is left, `respond(request)`."""

    def __init__(self, respond: Callable[[Received], Canned] | None = None) -> None:
        self.respond = respond
        self.responses: list[Canned] = []
        self.requests: list[Received] = []
        self.stop = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def answer(self, *responses: Canned) -> None:
        self.responses.extend(responses)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            request_line, *lines = head.strip().split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            received = Received(request_line.split()[1], headers, json.loads(body or b"{}"))
            self.requests.append(received)
            canned = (
                self.responses.pop(0) if self.responses or self.respond is None else self.respond(received)
            )
            if canned.hang:
                await self.stop.wait()
                return
            head_out = f"HTTP/1.1 {canned.status} X\r\ntransfer-encoding: chunked\r\nconnection: close\r\n"
            head_out += "".join(f"{k}: {v}\r\n" for k, v in canned.headers.items())
            writer.write(head_out.encode() + b"\r\n")
            for piece in awkward(canned.body):
                writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[Loopback]:
    loopback = Loopback()
    loopback.server = await asyncio.start_server(loopback.handle, "127.0.0.1", 0)
    yield loopback
    loopback.stop.set()
    loopback.server.close()
    await loopback.server.wait_closed()


def openai_sse(*chunks: dict[str, Any], newline: str = "\n") -> bytes:
    lines = [f"data: {json.dumps(c)}{newline}{newline}" for c in chunks]
    return ("".join(lines) + f"data: [DONE]{newline}{newline}").encode()


def anthropic_sse(*events: dict[str, Any]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def delta(**fields: Any) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": fields, "finish_reason": None}],
    }


def finish(reason: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


TOOLS = [ToolSpec("read", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})]


def request(*messages: ChatMessage, on_text: Any = None) -> ModelRequest:
    return ModelRequest("Be brief.", list(messages) or [ChatMessage("user", "hi")], TOOLS, on_text=on_text)


def openai(server: Loopback, **options: Any) -> OpenAIModel:
    return OpenAIModel("gpt-test", {"base_url": server.url + "/v1", "api_key": "sk-test", **options})


def anthropic(server: Loopback, **options: Any) -> AnthropicModel:
    return AnthropicModel("claude-test", {"base_url": server.url, "api_key": "ak-test", **options})


# ------------------------------------------------------------------ SSE


def test_sse_parser_gives_the_same_events_whatever_the_chunk_boundaries() -> None:
    stream = (
        ': a comment\r\nevent: first\r\ndata: {"a": "caf\xe9 \U0001f642"}\r\n\r\n'
        "data: line one\rdata: line two\r\r"
        "id: 7\nevent: third\ndata:no space\nretry: 10\n\n"
        "data: [DONE]"
    ).encode()
    expected = [
        ServerSentEvent("first", '{"a": "caf\xe9 \U0001f642"}'),
        ServerSentEvent("message", "line one\nline two"),
        ServerSentEvent("third", "no space", "7"),
        ServerSentEvent("message", "[DONE]", "7"),
    ]
    for pieces in ([stream], [stream[i : i + 1] for i in range(len(stream))], awkward(stream)):
        parser = SSEParser()
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.close()
        assert events == expected


def test_sse_parser_waits_for_the_newline_after_a_trailing_carriage_return() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    assert parser.feed(b"\n") == []
    assert parser.feed(b"\r\n") == [ServerSentEvent("message", "x")]


# ------------------------------------------------------------------ OpenAI


async def test_openai_streams_text_and_usage_and_sends_the_conversation(server: Loopback) -> None:
    server.answer(
        Canned(
            body=openai_sse(
                delta(role="assistant", content=""),
                delta(content="Hel"),
                delta(content="lo, caf\xe9 \U0001f642"),
                finish("stop"),
                {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}},
                newline="\r\n",
            )
        )
    )
    pieces: list[str] = []
    conversation = [
        ChatMessage("user", "read a"),
        ChatMessage("assistant", "", [ToolCall("c1", "read", {"path": "a"})]),
        ChatMessage("tool", "contents", tool_use_id="c1", is_error=True),
    ]
    reply = await openai(server, temperature=0.2).query(request(*conversation, on_text=pieces.append))
    assert reply.text == "Hello, caf\xe9 \U0001f642"
    assert "".join(pieces) == reply.text
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (12, 3)
    assert reply.tool_calls == [] and reply.stop_reason == "end_turn"
    sent = server.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert sent.json["model"] == "gpt-test" and sent.json["stream"] is True
    assert sent.json["stream_options"] == {"include_usage": True}
    assert sent.json["temperature"] == 0.2 and "base_url" not in sent.json and "api_key" not in sent.json
    assert sent.json["tools"][0]["function"]["name"] == "read"
    assert sent.json["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read a"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "contents"},
    ]


async def test_openai_configuration_comes_from_the_environment(
    server: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    server.answer(Canned(body=openai_sse(delta(content="ok"))))
    model = provider_model("openai:local-model")
    assert model is not None and model.name == "openai:local-model"
    assert (await model.query(request())).text == "ok"
    assert server.requests[0].path == "/v1/chat/completions"
    assert server.requests[0].headers["authorization"] == "Bearer sk-env"


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_the_providers_own_api_without_a_key_fails_at_once_for_good(
    server: Loopback, monkeypatch: pytest.MonkeyPatch, provider: str
) -> None:
    """Nothing answers the hosted API without a key: no connection, no retries, one clear error."""
    prefix = provider.upper()
    for name in (f"{prefix}_API_KEY", f"{prefix}_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    model = provider_model(f"{provider}:some-model")
    assert model is not None
    began = time.monotonic()
    with pytest.raises(AuthError, match=f"no API key: set {prefix}_API_KEY") as refused:
        await RetryingModel(model, RetryPolicy()).query(request())
    assert not refused.value.retryable and time.monotonic() - began < 1.0
    # Any other endpoint may need no key (Ollama, llama.cpp): it is asked.
    monkeypatch.setenv(f"{prefix}_BASE_URL", server.url + ("/v1" if provider == "openai" else ""))
    server.answer(Canned(body=openai_sse(delta(content="ok")) if provider == "openai" else anthropic_turn()))
    local = provider_model(f"{provider}:some-model")
    assert local is not None
    await local.query(request())
    assert len(server.requests) == 1


async def test_openai_joins_tool_call_fragments_by_index_and_makes_up_missing_ids(server: Loopback) -> None:
    def call(index: int, **function: Any) -> dict[str, Any]:
        return delta(tool_calls=[{"index": index, "function": function}])

    server.answer(
        Canned(
            body=openai_sse(
                delta(
                    tool_calls=[
                        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "read"}}
                    ]
                ),
                call(1, name="read", arguments=""),  # no id at all
                call(0, arguments='{"pa'),
                call(1, arguments='{"path":'),
                call(0, arguments='th": "a.txt"}'),
                call(1, arguments=' "b.txt"}'),
                finish("stop"),  # some servers say stop even with tool calls
            )
        )
    )
    reply = await openai(server).query(request())
    assert [(c.name, c.input) for c in reply.tool_calls] == [
        ("read", {"path": "a.txt"}),
        ("read", {"path": "b.txt"}),
    ]
    assert reply.tool_calls[0].id == "call_a"
    assert reply.tool_calls[1].id.startswith("call_") and reply.tool_calls[1].id != "call_a"
    assert reply.stop_reason == "tool_use"


async def test_openai_takes_whole_arguments_in_one_chunk_even_without_index_or_as_an_object(
    server: Loopback,
) -> None:
    server.answer(
        Canned(
            body=openai_sse(
                delta(tool_calls=[{"id": "x1", "function": {"name": "read", "arguments": '{"path": "a"}'}}]),
                delta(tool_calls=[{"id": "x2", "function": {"name": "read", "arguments": {"path": "b"}}}]),
                delta(tool_calls=[{"id": "x3", "function": {"name": "list"}}]),
                finish("tool_calls"),
            )
        )
    )
    reply = await openai(server).query(request())
    assert [(c.id, c.input) for c in reply.tool_calls] == [
        ("x1", {"path": "a"}),
        ("x2", {"path": "b"}),
        ("x3", {}),
    ]


async def test_openai_unparsable_arguments_become_an_error_result_not_a_failed_turn(server: Loopback) -> None:
    broken = '{"path": "a", oops'
    server.answer(
        Canned(
            body=openai_sse(
                delta(tool_calls=[{"index": 0, "function": {"name": "read", "arguments": broken}}])
            )
        )
    )
    reply = await openai(server).query(request())
    (call,) = reply.tool_calls
    assert call.input == {INVALID_ARGUMENTS: broken}
    message = invalid_arguments(call)
    assert message is not None and "not a valid JSON object" in message and "oops" in message
    assert invalid_arguments(ToolCall("c", "read", {"path": "a"})) is None
    # Sent back as the model wrote it, so the conversation stays what the model saw.
    sent = openai_messages(ModelRequest("", [ChatMessage("assistant", "", [call])], []))
    assert sent[0]["tool_calls"][0]["function"]["arguments"] == broken


def test_arguments_that_are_not_an_object_are_marked_and_quoted_up_to_the_limit() -> None:
    assert parse_arguments("") == {} and parse_arguments(" ") == {}
    assert parse_arguments("[1, 2]") == {INVALID_ARGUMENTS: "[1, 2]"}
    long = "x" * (QUOTED_ARGUMENTS + 50)
    message = invalid_arguments(ToolCall("c", "read", parse_arguments(long)))
    assert message is not None
    assert repr("x" * QUOTED_ARGUMENTS) in message and repr("x" * (QUOTED_ARGUMENTS + 1)) not in message


async def test_openai_unreadable_chunk_and_in_stream_error_are_typed(server: Loopback) -> None:
    server.answer(
        Canned(body=b"data: {not json\n\n"),
        Canned(
            body=openai_sse({"error": {"message": "maximum context length is 8192 tokens", "code": None}})
        ),
    )
    with pytest.raises(ServerError):
        await openai(server).query(request())
    with pytest.raises(ContextOverflow):
        await openai(server).query(request())


# ------------------------------------------------------------------ Anthropic


def anthropic_turn(tool_id: str = "toolu_1") -> bytes:
    return anthropic_sse(
        {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": 1}}},
        {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "look."}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig=="}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "redacted_thinking", "data": "opaque"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "Reading "}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "it \U0001f642"}},
        {"type": "content_block_stop", "index": 2},
        {"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use", "id": tool_id, "name": "read", "input": {}}},
        {"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": '{"path": "a'}},
        {"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": '.txt"}'}},
        {"type": "content_block_stop", "index": 3},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 42}},
        {"type": "message_stop"},
    )  # fmt: skip


async def test_anthropic_streams_text_tool_use_and_passes_thinking_back(server: Loopback) -> None:
    done = anthropic_sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 30, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Done."}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    )
    server.answer(Canned(body=anthropic_turn()), Canned(body=done))
    model = anthropic(server, max_tokens=1000)
    pieces: list[str] = []
    reply = await model.query(request(ChatMessage("user", "read a.txt"), on_text=pieces.append))
    assert reply.text == "Reading it \U0001f642" and "".join(pieces) == reply.text
    assert reply.tool_calls == [ToolCall("toolu_1", "read", {"path": "a.txt"})]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (25, 42)
    assert [b["type"] for b in reply.thinking] == ["thinking", "redacted_thinking"]  # kept with the reply
    sent = server.requests[0]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "ak-test" and sent.headers["anthropic-version"] == "2023-06-01"
    cached = {"type": "ephemeral"}
    assert sent.json["max_tokens"] == 1000 and sent.json["stream"] is True
    assert sent.json["system"] == [{"type": "text", "text": "Be brief.", "cache_control": cached}]
    assert sent.json["tools"] == [
        {
            "name": "read",
            "description": "Read a file",
            "input_schema": TOOLS[0].input_schema,
            "cache_control": cached,
        }
    ]
    assert sent.json["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "read a.txt", "cache_control": cached}]}
    ]

    follow_up = [
        ChatMessage("user", "read a.txt"),
        ChatMessage("assistant", reply.text, reply.tool_calls, thinking=reply.thinking),
        ChatMessage("tool", "hello", tool_use_id="toolu_1", is_error=False),
        ChatMessage("user", "and then?"),
    ]
    second = await model.query(request(*follow_up))
    assert second.text == "Done." and second.tool_calls == []
    assert server.requests[1].json["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "read a.txt"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Let me look.", "signature": "sig=="},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Reading it \U0001f642"},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"},
                {"type": "text", "text": "and then?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    uncached = anthropic(server, prompt_caching=False)
    server.answer(Canned(body=done))
    await uncached.query(request(ChatMessage("user", "hi")))
    assert "cache_control" not in json.dumps(server.requests[2].json)
    assert "prompt_caching" not in server.requests[2].json  # a client option, never sent


async def test_anthropic_configuration_from_the_environment_and_default_max_tokens(
    server: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "ak-env")
    server.answer(Canned(body=anthropic_turn()))
    model = provider_model("anthropic:claude-x")
    assert model is not None and model.name == "anthropic:claude-x"
    await model.query(request())
    assert server.requests[0].headers["x-api-key"] == "ak-env"
    assert server.requests[0].json["max_tokens"] == anthropic_adapter.MAX_TOKENS


async def test_anthropic_error_event_mid_stream_is_typed(server: Loopback) -> None:
    broken = anthropic_sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 1}}},
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    )
    server.answer(Canned(body=broken))
    with pytest.raises(Overloaded):
        await anthropic(server).query(request())


def test_provider_names() -> None:
    assert isinstance(provider_model("openai:gpt-4o"), OpenAIModel)
    assert isinstance(provider_model("anthropic:claude-sonnet-4-5"), AnthropicModel)
    assert provider_model("scripted") is None and provider_model("mystery:x") is None
    assert provider_model("openai:") is None


# ------------------------------------------------------------------ errors


OPENAI_CONTEXT = {
    "error": {
        "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
ANTHROPIC_CONTEXT = {
    "type": "error",
    "error": {
        "type": "invalid_request_error",
        "message": "prompt is too long: 210000 tokens > 200000 maximum",
    },
}
OTHER_400 = {"type": "error", "error": {"type": "invalid_request_error", "message": "tools.0.name: bad"}}


def error_cases(context_body: dict[str, Any]) -> list[tuple[Canned, type[ModelError]]]:
    def body(data: dict[str, Any]) -> bytes:
        return json.dumps(data).encode()

    return [
        (Canned(429, body({"error": {"message": "slow down"}}), {"retry-after": "7"}), RateLimited),
        (Canned(500, body({"error": {"message": "boom"}})), ServerError),
        (Canned(502, b"<html>bad gateway</html>"), ServerError),
        (Canned(503, b"unavailable"), Overloaded),
        (
            Canned(
                529, body({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
            ),
            Overloaded,
        ),
        (Canned(401, body({"error": {"message": "bad key", "type": "authentication_error"}})), AuthError),
        (Canned(403, body({"error": "forbidden"})), AuthError),
        (Canned(400, body(context_body)), ContextOverflow),
        (Canned(400, body(OTHER_400)), InvalidRequest),
        (Canned(404, body({"error": {"message": "no such model"}})), InvalidRequest),
    ]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_each_error_response_becomes_its_kind(server: Loopback, provider: str) -> None:
    cases = error_cases(OPENAI_CONTEXT if provider == "openai" else ANTHROPIC_CONTEXT)
    model = openai(server) if provider == "openai" else anthropic(server)
    for canned, kind in cases:
        server.answer(canned)
        with pytest.raises(kind) as caught:
            await model.query(request())
        assert type(caught.value) is kind, (canned.status, caught.value)
        assert str(canned.status) in str(caught.value)
    assert len(server.requests) == len(cases)


async def test_rate_limit_carries_retry_after_and_kinds_map_to_loop_error_types(server: Loopback) -> None:
    server.answer(Canned(429, b"{}", {"retry-after": "7"}))
    with pytest.raises(RateLimited) as caught:
        await openai(server).query(request())
    assert caught.value.retry_after == 7.0
    assert caught.value.retryable and caught.value.error_type == "model_rate_limited"
    assert [k.error_type for k in (Overloaded, ServerError, Timeout)] == ["model_unavailable"] * 3
    assert all(k.retryable for k in (Overloaded, ServerError, Timeout))
    assert not any(k.retryable for k in (AuthError, ContextOverflow, InvalidRequest))
    assert ContextOverflow.error_type == "context_window_exceeded"


def test_error_messages_quote_the_body_up_to_the_limit() -> None:
    error = classify(418, "y" * (BODY_EXCERPT + 100))
    assert "y" * BODY_EXCERPT in str(error) and "y" * (BODY_EXCERPT + 1) not in str(error)


def test_retry_after_is_seconds_or_an_http_date() -> None:
    assert parse_retry_after("7") == 7.0 and parse_retry_after("0.5") == 0.5
    now = time.time()
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_server_that_does_not_answer_is_a_timeout(server: Loopback, provider: str) -> None:
    server.answer(Canned(hang=True))
    model = openai(server, timeout=0.2) if provider == "openai" else anthropic(server, timeout=0.2)
    with pytest.raises(Timeout):
        await model.query(request())


async def test_a_refused_connection_is_a_server_error(server: Loopback) -> None:
    model = openai(server)
    assert server.server is not None
    server.server.close()
    await server.server.wait_closed()
    with pytest.raises(ServerError):
        await model.query(request())


# ------------------------------------------------------------------ retries


async def test_retries_honour_retry_after_then_back_off_and_report_each_retry(server: Loopback) -> None:
    server.answer(
        Canned(429, b"{}", {"retry-after": "0"}),
        Canned(529, b"{}"),
        Canned(body=openai_sse(delta(content="finally"))),
    )
    reported: list[tuple[str, int, float]] = []

    async def on_retry(error: ModelError, attempt: int, delay: float) -> None:
        reported.append((type(error).__name__, attempt, delay))

    policy = RetryPolicy(base_delay=0.01)
    reply = await RetryingModel(openai(server), policy, on_retry).query(request())
    assert reply.text == "finally" and len(server.requests) == 3
    assert [(name, attempt) for name, attempt, _ in reported] == [("RateLimited", 1), ("Overloaded", 2)]
    assert reported[0][2] == 0.0
    assert 0.02 <= reported[1][2] <= 0.02 * (1 + policy.jitter)


async def test_retries_stop_after_three_attempts_and_never_retry_what_cannot_pass(server: Loopback) -> None:
    server.answer(*[Canned(500, b"{}") for _ in range(3)], Canned(401, b"{}"))
    reported: list[int] = []

    async def on_retry(error: ModelError, attempt: int, delay: float) -> None:
        reported.append(attempt)

    model = openai(server)
    with pytest.raises(ServerError):
        await with_retries(lambda: model.query(request()), RetryPolicy(base_delay=0.001), on_retry)
    assert len(server.requests) == 3 and reported == [1, 2]
    with pytest.raises(AuthError):
        await with_retries(lambda: model.query(request()), RetryPolicy(base_delay=0.001), on_retry)
    assert len(server.requests) == 4 and reported == [1, 2]


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    policy = RetryPolicy()
    assert policy.attempts == 3 and policy.base_delay == 2.0
    assert policy.delay(1, ServerError("x"), rand=lambda: 0.0) == 2.0
    assert policy.delay(2, ServerError("x"), rand=lambda: 0.0) == 4.0
    assert policy.delay(2, ServerError("x"), rand=lambda: 1.0) == 4.0 * (1 + policy.jitter)
    assert policy.delay(10, ServerError("x"), rand=lambda: 0.0) == MAX_DELAY
    assert policy.delay(1, RateLimited("x", retry_after=MAX_DELAY), rand=lambda: 1.0) == MAX_DELAY
    assert policy.delay(1, RateLimited("x", retry_after=MAX_DELAY + 1)) == MAX_DELAY
    assert policy.delay(1, RateLimited("x"), rand=lambda: 0.0) == 2.0


def test_the_worker_default_factory_gives_provider_sessions_their_adapter() -> None:
    def session(model: str) -> Session:
        return Session("sess_1", model, "", [], "default", "full-auto", None, {}, None, "idle", "t", "t")

    assert isinstance(scripted_or_refuse(session("openai:gpt-test")), OpenAIModel)
    assert isinstance(scripted_or_refuse(session("anthropic:claude-test")), AnthropicModel)
    with pytest.raises(UnknownModel):
        scripted_or_refuse(session("mystery:model"))
