"""What drives a turn: the `Model` protocol, and the scripted model for tests and demos.

The loop hands a model the recorded conversation and the offered tools and gets back one
`Reply` (text and/or tool calls). It does not know which model answers: real providers (the
runtime issue) implement the same `query`. How a model call fails:

    ModelError                 (`error_type` is what `turn.failed` / `session.error` carry)
    ├── ModelRateLimited       retryable: `model_rate_limited`
    ├── ModelOverloaded        retryable: `model_unavailable`
    └── ScriptError            not retryable: `script_error`; a bad step or a failed `expect`

The scripted model (`model: "scripted"`, the session's `script`): each call consumes the next
step, counted over the whole session (`ModelRequest.call_index`, from the recorded replies),
so a restart continues the script where the dead process stopped. A step is an object with:

    text        the reply's text
    tool_calls  [{"name", "input"}]: tools to call (the step's reply stops with `tool_use`)
    expect      {"tool_result_contains": s}: checked first, against the latest tool result
                of the conversation; absent → `ScriptError` (the turn fails with that message)
    delay_ms    wait that long before replying
    hang        true: never reply (until the call is cancelled: the turn was aborted)
    error       "rate_limited" | "overloaded": raise that error (the step is consumed)

An exhausted script replies with nothing, which ends the turn (`end_turn`).

A model may report text as it produces it through `ModelRequest.on_text` (the loop passes a
sink; models that cannot stream ignore it). The scripted model hands each step's `text` to it
in `DELTA_CHUNKS` pieces split at word boundaries, before it returns the whole reply.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

#: The model name that selects the scripted model.
SCRIPTED = "scripted"
#: Keys a script step may have; any other key is a mistake worth failing on.
STEP_KEYS = frozenset({"text", "tool_calls", "expect", "delay_ms", "hang", "error"})
#: The errors a step may raise, by its `error` value.
STEP_ERRORS = ("rate_limited", "overloaded")
#: Pieces the scripted model streams a step's text in (fewer when the text has fewer words).
DELTA_CHUNKS = 3

#: Where a model reports text as it is produced; each call gets the next piece.
TextSink = Callable[[str], None]


class ModelError(Exception):
    error_type = "model_error"
    retryable = False


class ModelRateLimited(ModelError):
    error_type = "model_rate_limited"
    retryable = True


class ModelOverloaded(ModelError):
    error_type = "model_unavailable"
    retryable = True


class ScriptError(ModelError):
    error_type = "script_error"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    input: dict[str, Any]


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)

    @property
    def stop_reason(self) -> Literal["end_turn", "tool_use"]:
        return "tool_use" if self.tool_calls else "end_turn"


@dataclass(frozen=True)
class ChatMessage:
    """A provider-neutral message: user text, an assistant reply, or a tool result."""

    role: Literal["user", "assistant", "tool"]
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_use_id: str | None = None
    is_error: bool = False


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    system: str
    messages: list[ChatMessage]
    tools: list[ToolSpec]
    call_index: int = 0
    """How many model calls this session made before this one (recorded replies of any status)."""
    on_text: TextSink | None = field(default=None, compare=False, repr=False)
    """Optional: told each piece of the reply's text as it is produced (not stored anywhere)."""


class Model(Protocol):
    name: str

    async def query(self, request: ModelRequest) -> Reply:
        """One reply; raises `ModelError` (or is cancelled)."""
        ...


class ScriptedModel:
    """Replies from a fixed list of steps (see the module docstring)."""

    name = SCRIPTED

    def __init__(self, script: Sequence[dict[str, Any]]) -> None:
        self.script = list(script)

    async def query(self, request: ModelRequest) -> Reply:
        if request.call_index >= len(self.script):
            return Reply()
        step = self.script[request.call_index]
        check_step(step, request.call_index)
        _expect(step.get("expect"), request.messages, request.call_index)
        if step.get("delay_ms"):
            await asyncio.sleep(step["delay_ms"] / 1000)
        if step.get("hang"):
            await asyncio.Event().wait()
        if step.get("error") == "rate_limited":
            raise ModelRateLimited(f"scripted step {request.call_index}: rate limited")
        if step.get("error") == "overloaded":
            raise ModelOverloaded(f"scripted step {request.call_index}: overloaded")
        text = str(step.get("text", ""))
        if request.on_text is not None:
            for piece in chunks(text, DELTA_CHUNKS):
                request.on_text(piece)
                await asyncio.sleep(0)  # let readers run between pieces, as a real stream would
        calls = [
            ToolCall(f"toolu_{uuid.uuid4().hex}", call["name"], dict(call.get("input") or {}))
            for call in step.get("tool_calls") or []
        ]
        prompt = sum(len(m.text) for m in request.messages)
        return Reply(
            text, calls, Usage(input_tokens=prompt // 4 + 1, output_tokens=len(text) // 4 + len(calls))
        )


def chunks(text: str, count: int) -> list[str]:
    """`text` in at most `count` non-empty pieces that end at word boundaries and join to it."""
    words = re.findall(r"\S+\s*|\s+", text)
    size = -(-len(words) // count) if words else 0
    return ["".join(words[i : i + size]) for i in range(0, len(words), size)] if size else []


def check_step(step: Any, index: int) -> None:
    """Refuse a malformed step with a message that names it (also for validating a script up front)."""
    if not isinstance(step, dict):
        raise ScriptError(f"script step {index} must be an object, not {type(step).__name__}")
    unknown = set(step) - STEP_KEYS
    if unknown:
        raise ScriptError(
            f"script step {index} has unknown keys {sorted(unknown)}; allowed: {sorted(STEP_KEYS)}"
        )
    if "error" in step and step["error"] not in STEP_ERRORS:
        raise ScriptError(f"script step {index}: error must be one of {STEP_ERRORS}, not {step['error']!r}")
    for call in step.get("tool_calls") or []:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ScriptError(f"script step {index}: each tool call needs a string `name`")


def check_script(script: Any) -> list[dict[str, Any]]:
    if not isinstance(script, list):
        raise ScriptError("a scripted session needs `script`: a list of steps")
    for index, step in enumerate(script):
        check_step(step, index)
    return script


def _expect(expect: Any, messages: Sequence[ChatMessage], index: int) -> None:
    if not expect:
        return
    wanted = expect.get("tool_result_contains") if isinstance(expect, dict) else None
    if not isinstance(wanted, str):
        raise ScriptError(f"script step {index}: expect needs a string `tool_result_contains`")
    results = [m for m in messages if m.role == "tool"]
    if not results:
        raise ScriptError(
            f"script step {index} expected a tool result containing {wanted!r}, but there is none"
        )
    if wanted not in results[-1].text:
        shown = results[-1].text[:300]
        raise ScriptError(
            f"script step {index} expected the last tool result to contain {wanted!r}; it was: {shown!r}"
        )
