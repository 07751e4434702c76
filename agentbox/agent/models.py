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
    tool_calls  [{"name", "input", "script"?}]: tools to call (the step's reply stops with
                `tool_use`); call i of step n gets the id `toolu_s{n}_{i}`. `script` (a `task`
                call's): the steps of the subagent that call starts (see below)
    expect      {"tool_result_contains": s}: checked first, against the latest tool result
                of the conversation; absent → `ScriptError` (the turn fails with that message);
                {"user_message_contains": s}: the same against the latest user-role message
                (a message that joined the turn, a signal)
    delay_ms    wait that long before replying
    hang        true: never reply (until the call is cancelled: the turn was aborted)
    error       "rate_limited" | "overloaded": raise that error (the step is consumed)
    usage       {"input_tokens", "output_tokens"}: the usage the reply reports (default: the
                conversation's characters / 4, and the reply's); compaction counts from it

An exhausted script replies with nothing, which ends the turn (`end_turn`).

Subagents: a request with a `task_path` is a child's. Its script is found by walking from the
session's script along the path: for each id `toolu_s{n}_{i}`, the steps become
`steps[n]["tool_calls"][i]["script"]` (missing → `ScriptError` naming the id); the child's own
`call_index` (its model calls so far) then picks the step. Ids are deterministic so that the
path can be walked; they stay unique per session because `call_index` counts every recorded
reply of the session. A child's ids are unique only within its run (its transcript is not
stored; events about it carry the whole `task_path`).

A model may report text as it produces it through `ModelRequest.on_text` (the loop passes a
sink; models that cannot stream ignore it). The scripted model hands each step's `text` to it
in `DELTA_CHUNKS` pieces split at word boundaries, before it returns the whole reply.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agentbox.tools.base import ImageBlock, TextBlock

#: The model name that selects the scripted model.
SCRIPTED = "scripted"
#: The providers a model name may name (`<provider>:<name>`), beside `SCRIPTED`.
PROVIDER_NAMES: tuple[str, ...] = ("openai", "anthropic")
PROVIDER_MODEL = re.compile(rf"^(?:{'|'.join(PROVIDER_NAMES)}):\S+$")


def model_name_problem(model: str) -> str | None:
    """Why `model` names no model a session can have, or None."""
    if model == SCRIPTED or PROVIDER_MODEL.fullmatch(model):
        return None
    return f"must be {SCRIPTED!r} or '<provider>:<name>' with a provider of {', '.join(PROVIDER_NAMES)}"


#: Keys a script step may have; any other key is a mistake worth failing on.
STEP_KEYS = frozenset({"text", "tool_calls", "expect", "delay_ms", "hang", "error", "usage"})
#: The keys of a step's `usage`.
USAGE_KEYS = frozenset({"input_tokens", "output_tokens"})
#: The errors a step may raise, by its `error` value.
STEP_ERRORS = ("rate_limited", "overloaded")
#: Pieces the scripted model streams a step's text in (fewer when the text has fewer words).
DELTA_CHUNKS = 3

#: A piece of a message that shows images (`ChatMessage.parts`).
Part = TextBlock | ImageBlock
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
    thinking: list[dict[str, Any]] = field(default_factory=list)
    """Provider reasoning blocks to send back with this reply (Anthropic `thinking` with its
    signature, `redacted_thinking`): opaque, recorded with the reply so a restart keeps them."""

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
    thinking: list[dict[str, Any]] = field(default_factory=list)
    """An assistant reply's `Reply.thinking`, as recorded."""
    parts: tuple[Part, ...] = ()
    """A user or tool message that shows images: its text and images in order (`text` is its
    text alone, with each image named). Empty for text only; `agent.vision` fills it."""


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
    max_tokens: int | None = None
    """Cap on the reply's tokens for this call (a compaction summary); None = the provider's setting."""
    task_path: tuple[str, ...] = ()
    """For a subagent's call: the tool_use_ids of the `task` calls that led to it, outermost first."""


class Model(Protocol):
    name: str

    async def query(self, request: ModelRequest) -> Reply:
        """One reply; raises `ModelError` (or is cancelled)."""
        ...


#: `ModelCall.outcome` of a call that returned a reply; a failed one has its `error_type`.
CALL_OK = "ok"
#: `ModelCall.outcome` of a call cancelled before it answered (an aborted turn).
CALL_CANCELLED = "cancelled"
#: `ModelCall.outcome` of a call that raised something other than a `ModelError` (a bug).
CALL_CRASHED = "internal_error"


@dataclass(frozen=True)
class ModelCall:
    """One model call as it ended, for the metrics (`agentbox_model_calls_total` and tokens)."""

    provider: str
    """The model name's provider part: `anthropic` of `anthropic:claude-x`; `scripted`."""
    outcome: str
    """`CALL_OK`, `CALL_CANCELLED`, `CALL_CRASHED`, or the `ModelError`'s `error_type`."""
    usage: Usage = field(default_factory=Usage)
    """What the reply reports (zero for a call without a reply)."""


class ReportingModel:
    """A `Model` that tells `report` how each of its calls ended; every model a turn, its
    compaction or a subagent calls is wrapped in one (`Worker`), so each attempt is seen once."""

    def __init__(self, model: Model, provider: str, report: Callable[[ModelCall], None]) -> None:
        self.model, self.provider, self.report = model, provider, report
        self.name = model.name

    async def query(self, request: ModelRequest) -> Reply:
        provider = self.provider
        try:
            reply = await self.model.query(request)
        except ModelError as exc:
            self.report(ModelCall(provider, exc.error_type))
            raise
        except asyncio.CancelledError:
            self.report(ModelCall(provider, CALL_CANCELLED))
            raise
        except Exception:
            self.report(ModelCall(provider, CALL_CRASHED))
            raise
        self.report(ModelCall(provider, CALL_OK, reply.usage))
        return reply


class ScriptedModel:
    """Replies from a fixed list of steps (see the module docstring)."""

    name = SCRIPTED

    def __init__(self, script: Sequence[dict[str, Any]]) -> None:
        self.script = list(script)

    async def query(self, request: ModelRequest) -> Reply:
        steps = self.steps_for(request.task_path)
        if request.call_index >= len(steps):
            return Reply()
        step = steps[request.call_index]
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
            ToolCall(call_id(request.call_index, i), call["name"], dict(call.get("input") or {}))
            for i, call in enumerate(step.get("tool_calls") or [])
        ]
        prompt = sum(len(m.text) for m in request.messages)
        usage = {"input_tokens": prompt // 4 + 1, "output_tokens": len(text) // 4 + len(calls)}
        return Reply(text, calls, Usage(**{**usage, **(step.get("usage") or {})}))

    def steps_for(self, task_path: Sequence[str]) -> list[Any]:
        """The steps answering a request with this `task_path`: the session's script, or a child's."""
        steps: list[Any] = self.script
        for depth, tool_use_id in enumerate(task_path):
            index, position = parse_call_id(tool_use_id)
            try:
                script = steps[index]["tool_calls"][position]["script"]
            except (IndexError, KeyError, TypeError):
                raise ScriptError(
                    f"no script for the subagent of call {tool_use_id} (task path level {depth + 1}): "
                    "give that tool call a `script`"
                ) from None
            if not isinstance(script, list):
                raise ScriptError(f"the script of call {tool_use_id} must be a list of steps")
            steps = script
        return steps


def call_id(call_index: int, position: int) -> str:
    """The scripted model's id of tool call `position` of the reply to call `call_index`."""
    return f"toolu_s{call_index}_{position}"


CALL_ID = re.compile(r"toolu_s(\d+)_(\d+)")


def parse_call_id(tool_use_id: str) -> tuple[int, int]:
    """(call_index, position) of an id made by `call_id`; `ScriptError` for any other id."""
    match = CALL_ID.fullmatch(tool_use_id)
    if match is None:
        raise ScriptError(f"{tool_use_id!r} is not a scripted tool call id (toolu_s<step>_<call>)")
    return int(match[1]), int(match[2])


def chunks(text: str, count: int) -> list[str]:
    """`text` in at most `count` non-empty pieces that end at word boundaries and join to it."""
    words = re.findall(r"\S+\s*|\s+", text)
    size = -(-len(words) // count) if words else 0
    return ["".join(words[i : i + size]) for i in range(0, len(words), size)] if size else []


def check_step(step: Any, index: int, path: str = "") -> None:
    """Refuse a malformed step with a message that names it (also for validating a script up front).

    A `script` of a tool call (a subagent's steps) is checked the same way, recursively; `path`
    prefixes the messages with where the nested step sits.
    """
    where = f"{path}script step {index}"
    if not isinstance(step, dict):
        raise ScriptError(f"{where} must be an object, not {type(step).__name__}")
    unknown = set(step) - STEP_KEYS
    if unknown:
        raise ScriptError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(STEP_KEYS)}")
    if "error" in step and step["error"] not in STEP_ERRORS:
        raise ScriptError(f"{where}: error must be one of {STEP_ERRORS}, not {step['error']!r}")
    usage = step.get("usage", {})
    if (
        not isinstance(usage, dict)
        or set(usage) - USAGE_KEYS
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in usage.values())
    ):
        raise ScriptError(f"{where}: usage must map {sorted(USAGE_KEYS)} to counts, not {usage!r}")
    for position, call in enumerate(step.get("tool_calls") or []):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ScriptError(f"{where}: each tool call needs a string `name`")
        if "script" in call:
            nested = f"{where} call {position}"
            if not isinstance(call["script"], list):
                raise ScriptError(f"{nested}: `script` must be a list of steps")
            for child_index, child in enumerate(call["script"]):
                check_step(child, child_index, f"{nested} > ")


def check_script(script: Any) -> list[dict[str, Any]]:
    if not isinstance(script, list):
        raise ScriptError("a scripted session needs `script`: a list of steps")
    for index, step in enumerate(script):
        check_step(step, index)
    return script


def _expect(expect: Any, messages: Sequence[ChatMessage], index: int) -> None:
    if not expect:
        return
    kinds = {
        "tool_result_contains": ("tool", "tool result"),
        "user_message_contains": ("user", "user message"),
    }
    key = next((k for k in kinds if isinstance(expect, dict) and k in expect), None)
    wanted = expect.get(key) if key is not None else None
    if key is None or not isinstance(wanted, str):
        raise ScriptError(f"script step {index}: expect needs a string `{'` or `'.join(kinds)}`")
    role, what = kinds[key]
    found = [m for m in messages if m.role == role]
    if not found:
        raise ScriptError(f"script step {index} expected a {what} containing {wanted!r}, but there is none")
    if wanted not in found[-1].text:
        shown = found[-1].text[:300]
        raise ScriptError(
            f"script step {index} expected the last {what} to contain {wanted!r}; it was: {shown!r}"
        )
