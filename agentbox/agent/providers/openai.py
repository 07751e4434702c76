"""`openai:<model>`: OpenAI-compatible Chat Completions, streamed, with tool calls.

Tolerant of the servers users point it at (vLLM, llama.cpp, Ollama, LM Studio, gateways):
tool-call fragments are joined by `index` (or by id when a server leaves the index out), a
missing id is made up, arguments may come whole in one chunk (even as an object), and tool
calls count whatever the `finish_reason` says. Arguments that are not a JSON object do not
fail the turn: the call is marked (`arguments.py`) for an error result the model reads.

Images (a tool result's, `agent.vision`): Chat Completions tool messages carry text only, so a
step's images follow its tool messages as a `user` message of `image_url` parts with data URLs
(`to_messages`).

Configuration: `OPENAI_BASE_URL` / `OPENAI_API_KEY`, overridden by the session's
`model_options` keys `base_url` / `api_key`; its other keys (temperature, max_tokens, ...)
are added to the request body.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from agentbox.agent.models import ChatMessage, ModelRequest, Reply, ToolCall, Usage
from agentbox.agent.providers.arguments import parse_arguments, raw_arguments
from agentbox.agent.providers.endpoint import endpoint
from agentbox.agent.providers.errors import ServerError, classify_stream_error
from agentbox.agent.providers.sse import post_sse
from agentbox.agent.reach import Reach
from agentbox.tools.base import ImageBlock

#: Where requests go without `OPENAI_BASE_URL` or a `base_url` option.
DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAIModel:
    """A `Model` over `POST {base_url}/chat/completions` with `stream: true`."""

    def __init__(
        self, model: str, options: Mapping[str, Any] | None = None, reach: Reach | None = None
    ) -> None:
        self.model = model
        self.name = f"openai:{model}"
        self.endpoint = endpoint(
            options, env_prefix="OPENAI", default_base_url=DEFAULT_BASE_URL, path="/chat/completions",
            reach=reach,
        )  # fmt: skip

    async def query(self, request: ModelRequest) -> Reply:
        self.endpoint.refuse_without_key(self.name)
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if self.endpoint.api_key:
            headers["authorization"] = f"Bearer {self.endpoint.api_key}"
        stream = ChatStream(on_text=getattr(request, "on_text", None))
        url, timeout = self.endpoint.url, self.endpoint.timeout
        events = post_sse(
            url, headers, self.body(request), timeout=timeout, provider=self.name, reach=self.endpoint.reach
        )
        async with aclosing(events):
            async for event in events:
                if event.data.strip() == "[DONE]":
                    break
                stream.feed(decode_chunk(event.data))
        return stream.reply()

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": to_messages(request),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in request.tools
            ]
        body.update(self.endpoint.extra)
        if request.max_tokens is not None:
            body["max_tokens"] = min(request.max_tokens, int(body.get("max_tokens") or request.max_tokens))
        return body


def decode_chunk(data: str) -> dict[str, Any]:
    """One streamed chunk; a chunk that is not a JSON object is a broken stream (retryable)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise ServerError(f"openai: the stream sent an unreadable chunk: {data[:200]!r}")
    return chunk


def to_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """System text first, then user / assistant (with `tool_calls`) / tool messages.

    A tool message carries text only (Chat Completions has no images in tool results), so the
    images of a step's results follow its tool messages as one `user` message of `image_url`
    parts (data URLs), each result's images after a text part naming its call.
    """
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    shown: list[ChatMessage] = []  # this step's results that have images
    for m in request.messages:
        if m.role != "tool" and shown:
            messages.append(images_message(shown))
            shown = []
        if m.role == "user":
            messages.append({"role": "user", "content": user_content(m)})
        elif m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": m.text or None}
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                    for c in m.tool_calls
                ]
            messages.append(message)
        else:
            messages.append({"role": "tool", "tool_call_id": m.tool_use_id or "", "content": m.text})
            if any(isinstance(p, ImageBlock) for p in m.parts):
                shown.append(m)
    if shown:
        messages.append(images_message(shown))
    return messages


def image_part(image: ImageBlock) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{image.media_type};base64,{image.data}"}}


def user_content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """A user message's text, or its text and image parts in order."""
    if not message.parts:
        return message.text
    return [
        image_part(p) if isinstance(p, ImageBlock) else {"type": "text", "text": p.text}
        for p in message.parts
    ]


def images_message(results: list[ChatMessage]) -> dict[str, Any]:
    """The `user` message that shows the images of tool results (see `to_messages`)."""
    content: list[dict[str, Any]] = []
    for result in results:
        content.append(
            {"type": "text", "text": f"The images of the result of tool call {result.tool_use_id}:"}
        )
        content += [image_part(p) for p in result.parts if isinstance(p, ImageBlock)]
    return {"role": "user", "content": content}


def _arguments(call: ToolCall) -> str:
    """The call's arguments as sent back: the raw text of unparsable ones, as the model wrote them."""
    raw = raw_arguments(call)
    return json.dumps(call.input) if raw is None else raw


@dataclass
class _Fragments:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class ChatStream:
    """Accumulates `chat.completion.chunk` objects into a `Reply`."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, _Fragments] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    on_text: Callable[[str], None] | None = None
    """Told each piece of text as it arrives (`ModelRequest.on_text`)."""

    def feed(self, chunk: dict[str, Any]) -> None:
        if chunk.get("error"):
            raise classify_stream_error(chunk["error"], provider="openai")
        if isinstance(chunk.get("usage"), dict):
            u = chunk["usage"]
            self.usage = Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            if delta.get("content"):
                self.text.append(str(delta["content"]))
                if self.on_text is not None:
                    self.on_text(self.text[-1])
            for fragment in delta.get("tool_calls") or []:
                self._fragment(fragment)

    def _fragment(self, fragment: dict[str, Any]) -> None:
        index = self._index(fragment)
        call = self.calls.setdefault(index, _Fragments())
        if fragment.get("id") and not call.id:
            call.id = str(fragment["id"])
        function = fragment.get("function") or {}
        if function.get("name") and not call.name:
            call.name = str(function["name"])
        arguments = function.get("arguments")
        if isinstance(arguments, (dict, list)):
            call.arguments = json.dumps(arguments)
        elif arguments:
            call.arguments += str(arguments)

    def _index(self, fragment: dict[str, Any]) -> int:
        """The call a fragment belongs to: its `index`, else the call with its id, else a new/last one."""
        if isinstance(fragment.get("index"), int):
            return int(fragment["index"])
        fragment_id = fragment.get("id")
        for index, call in self.calls.items():
            if fragment_id and call.id == fragment_id:
                return index
        if fragment_id or not self.calls:
            return len(self.calls)
        return max(self.calls)

    def reply(self) -> Reply:
        calls = [
            ToolCall(c.id or f"call_{uuid.uuid4().hex[:24]}", c.name, parse_arguments(c.arguments))
            for _, c in sorted(self.calls.items())
            if c.name
        ]
        return Reply("".join(self.text), calls, self.usage)
