"""`anthropic:<model>`: the Anthropic Messages API, streamed, with tool_use and thinking.

Stream events (`message_start`, `content_block_start|delta|stop`, `message_delta`,
`message_stop`, `ping`, `error`) build one `Reply`: text blocks join into its text, tool_use
blocks (their `input_json_delta` pieces joined) become its tool calls. Thinking blocks
(`thinking` with its `signature`, `redacted_thinking`) are passed through: the API wants them
back, unchanged and first, in the assistant message of a tool-use loop, so a reply that calls
tools carries them (`Reply.thinking`), the loop records them with the reply, and they go back
with it, also after a restart.

Images (a tool result's, `agent.vision`): a `tool_result` whose content is its text and
`image` blocks (`{"type": "base64", "media_type", "data"}` sources) in order.

Prompt caching is on: `cache_control` breakpoints at the end of the tools, the system prompt
and the conversation (`mark_cache_breakpoints`), so a turn's later calls and the next turn read
their prefix from Anthropic's cache. `model_options` `prompt_caching: false` turns it off.

Configuration: `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY`, overridden by the session's
`model_options` keys `base_url` / `api_key`; `max_tokens` defaults to `MAX_TOKENS`; other keys
(`thinking`, `temperature`, ...) are added to the request body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from agentbox.agent.models import ChatMessage, ModelRequest, Part, Reply, ToolCall, Usage
from agentbox.agent.providers.arguments import parse_arguments, raw_arguments
from agentbox.agent.providers.endpoint import endpoint
from agentbox.agent.providers.errors import ServerError, classify_stream_error
from agentbox.agent.providers.sse import post_sse
from agentbox.agent.reach import Reach
from agentbox.tools.base import ImageBlock

#: Where requests go without `ANTHROPIC_BASE_URL` or a `base_url` option (`/v1/messages` is added).
DEFAULT_BASE_URL = "https://api.anthropic.com"
#: The API version header every request carries.
API_VERSION = "2023-06-01"
#: `max_tokens` (required by the API) unless the session's options say otherwise.
MAX_TOKENS = 8192
#: `model_options` keys of this adapter's own that configure it rather than the request body.
OWN_OPTIONS = frozenset({"prompt_caching"})
#: Where prompt caching marks a breakpoint: the end of the tools, of the system prompt and of the
#: conversation so far (the API allows 4). The system prompt is frozen per baseline and the
#: conversation only grows, so each call reads the previous call's prefix from the cache.
CACHE_CONTROL = {"type": "ephemeral"}
#: Content block types passed through as they came (the thinking kinds).
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


class AnthropicModel:
    """A `Model` over `POST {base_url}/v1/messages` with `stream: true`."""

    def __init__(
        self, model: str, options: Mapping[str, Any] | None = None, reach: Reach | None = None
    ) -> None:
        self.model = model
        self.name = f"anthropic:{model}"
        self.endpoint = endpoint(
            options, env_prefix="ANTHROPIC", default_base_url=DEFAULT_BASE_URL, path="/v1/messages",
            own_options=OWN_OPTIONS, reach=reach,
        )  # fmt: skip
        self.caching = (options or {}).get("prompt_caching", True) is not False

    async def query(self, request: ModelRequest) -> Reply:
        self.endpoint.refuse_without_key(self.name)
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "anthropic-version": API_VERSION,
        }
        if self.endpoint.api_key:
            headers["x-api-key"] = self.endpoint.api_key
        stream = MessageStream(on_text=getattr(request, "on_text", None))
        url, timeout = self.endpoint.url, self.endpoint.timeout
        events = post_sse(
            url, headers, self.body(request), timeout=timeout, provider=self.name, reach=self.endpoint.reach
        )
        async with aclosing(events):
            async for event in events:
                if stream.feed(event.event, decode_event(event.data)):
                    break
        reply = stream.reply()
        return replace(reply, thinking=stream.thinking_blocks()) if reply.tool_calls else reply

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": MAX_TOKENS,
            "messages": to_messages(request.messages),
            "stream": True,
        }
        if request.system:
            body["system"] = [{"type": "text", "text": request.system}]
        if request.tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.input_schema}
                for t in request.tools
            ]
        if self.caching:
            mark_cache_breakpoints(body)
        body.update(self.endpoint.extra)
        if request.max_tokens is not None:
            body["max_tokens"] = min(request.max_tokens, int(body["max_tokens"]))
        return body


def mark_cache_breakpoints(body: dict[str, Any]) -> None:
    """`cache_control` on the last tool, the system prompt and the last message's last block."""
    if body.get("tools"):
        body["tools"][-1]["cache_control"] = CACHE_CONTROL
    if body.get("system"):
        body["system"][-1]["cache_control"] = CACHE_CONTROL
    if body["messages"] and body["messages"][-1]["content"]:
        body["messages"][-1]["content"][-1]["cache_control"] = CACHE_CONTROL


def decode_event(data: str) -> dict[str, Any]:
    """One event's data; data that is not a JSON object is a broken stream (retryable)."""
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ServerError(f"anthropic: the stream sent unreadable event data: {data[:200]!r}")
    return value


def to_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Alternating user / assistant messages of content blocks; tool results open the next user one."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant":
            reply = assistant_blocks(m)
            if reply:
                out.append({"role": "assistant", "content": reply})
            continue
        blocks: list[dict[str, Any]]
        if m.role == "tool":
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": m.tool_use_id or "",
                "content": m.text,
            }
            if m.parts:
                block["content"] = content_blocks(m.parts)
            if m.is_error:
                block["is_error"] = True
            blocks = [block]
        else:
            blocks = content_blocks(m.parts) if m.parts else [{"type": "text", "text": m.text}]
        if out and out[-1]["role"] == "user":
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": "user", "content": blocks})
    return out


def content_blocks(parts: Sequence[Part]) -> list[dict[str, Any]]:
    """Text and `image` blocks (base64 sources) in order; empty texts left out (the API refuses them)."""
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, ImageBlock):
            source = {"type": "base64", "media_type": part.media_type, "data": part.data}
            blocks.append({"type": "image", "source": source})
        elif part.text:
            blocks.append({"type": "text", "text": part.text})
    return blocks


def assistant_blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """Thinking first (the API checks them only on a reply that called tools), text, tool_use."""
    blocks = list(message.thinking) if message.tool_calls else []
    if message.text:
        blocks.append({"type": "text", "text": message.text})
    for call in message.tool_calls:
        raw = raw_arguments(call)
        # The API takes only an object as input; unparsable arguments go back as the text they were.
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": call.input if raw is None else {"arguments": raw},
            }
        )
    return blocks


@dataclass
class _Block:
    type: str
    start: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    signature: str = ""


@dataclass
class MessageStream:
    """Accumulates Messages stream events into a `Reply` (and the thinking blocks)."""

    blocks: dict[int, _Block] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    stop_reason: str | None = None
    on_text: Callable[[str], None] | None = None
    """Told each piece of text as it arrives (`ModelRequest.on_text`)."""

    def feed(self, name: str, data: dict[str, Any]) -> bool:
        """Take one event; True once the message is complete (`message_stop`)."""
        kind = data.get("type") or name
        if kind == "error":
            raise classify_stream_error(data.get("error") or data, provider="anthropic")
        if kind == "message_start":
            self._usage((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            self.blocks[int(data.get("index", len(self.blocks)))] = _Block(str(block.get("type")), block)
        elif kind == "content_block_delta":
            self._delta(int(data.get("index", 0)), data.get("delta") or {})
        elif kind == "message_delta":
            self.stop_reason = (data.get("delta") or {}).get("stop_reason") or self.stop_reason
            self._usage(data.get("usage") or {})
        return kind == "message_stop"

    def _usage(self, usage: dict[str, Any]) -> None:
        """Input counts cached tokens too (they fill the context); output is the running total."""
        if "input_tokens" in usage:
            self.input_tokens = sum(
                int(usage.get(k) or 0)
                for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
            )
        if "output_tokens" in usage:
            self.output_tokens = int(usage.get("output_tokens") or 0)

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.blocks.get(index)
        if block is None:
            return
        kind = delta.get("type")
        if kind == "text_delta":
            block.parts.append(str(delta.get("text", "")))
            if self.on_text is not None and block.parts[-1]:
                self.on_text(block.parts[-1])
        elif kind == "input_json_delta":
            block.parts.append(str(delta.get("partial_json", "")))
        elif kind == "thinking_delta":
            block.parts.append(str(delta.get("thinking", "")))
        elif kind == "signature_delta":
            block.signature += str(delta.get("signature", ""))

    def reply(self) -> Reply:
        ordered = [b for _, b in sorted(self.blocks.items())]
        text = "".join(str(b.start.get("text", "")) + "".join(b.parts) for b in ordered if b.type == "text")
        calls = [self._call(b) for b in ordered if b.type == "tool_use"]
        return Reply(text, calls, Usage(self.input_tokens, self.output_tokens))

    @staticmethod
    def _call(block: _Block) -> ToolCall:
        raw = "".join(block.parts)
        start_input = block.start.get("input")
        if not raw.strip() and isinstance(start_input, dict):
            return ToolCall(str(block.start.get("id")), str(block.start.get("name")), start_input)
        return ToolCall(str(block.start.get("id")), str(block.start.get("name")), parse_arguments(raw))

    def thinking_blocks(self) -> list[dict[str, Any]]:
        """The thinking blocks as the API wants them back (thinking text and signature joined)."""
        blocks = []
        for _, block in sorted(self.blocks.items()):
            if block.type == "thinking":
                thinking = str(block.start.get("thinking", "")) + "".join(block.parts)
                signature = str(block.start.get("signature", "")) + block.signature
                blocks.append({"type": "thinking", "thinking": thinking, "signature": signature})
            elif block.type == "redacted_thinking":
                blocks.append(dict(block.start))
        return blocks
