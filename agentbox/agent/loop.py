"""The turn loop: ask the model, run the tools it asks for, show it the results, until it stops.

Shaped like mini-swe-agent's `DefaultAgent`: `run` → `step` → `query` → `execute_actions` →
`observe`, each a few lines. Durability is explicit, named steps around the two things that
can be lost in a crash (C6.5 of the session API notes, Flue's write-ahead discipline):

    open_reply      before the model call: an assistant row `streaming` (a crash leaves it;
                    recovery closes it as aborted, Flue's "ghost stream")
    record_reply    after it: the reply, `agent.message`, every `agent.tool_use` and
                    `model.usage`, in one transaction, BEFORE any tool runs
    record_result   after each tool: the result row and `agent.tool_result` (first write
                    wins: a recorded result is never replaced, its call never re-run); its
                    images stored first and named by id (`agent.vision`)

Every write is fenced by the turn being open, so an aborted turn gets no more events.
The one thing not written: text the model reports while it produces it (`on_text`), which
goes to the bus as ephemeral `agent.message.delta` events (`EventBus.publish_delta`).

Control flow by exception type (mini-swe-agent): tool errors are results the model reads;
what ends the turn is a `TurnEnded`:

    TurnEnded
    ├── Completed   stop_reason `end_turn` (a reply without tool calls) or `max_steps`
    └── Failed      error {type, message, retryable}: a model error after its retries, a
                    failed script expectation, an input placement failure (`internal_error`)

Abort is cancellation: the worker cancels the task running `run`; the store settles what
the turn left open. Model errors that may pass (rate limits, overload, timeouts) are retried
by `LoopConfig.retry` (3 attempts, 2 s doubling with jitter, a provider's `retry-after`
wins), each retry visible as `session.error` with its attempt and delay; each retry is a
new model call (so a scripted retry consumes the next step). A context-overflow error
compacts (`Context.after_overflow`) and retries once; the context may compact on its own
threshold while it builds a request (`Context.request`).

Step boundaries: after a reply's tool calls have their results, and where a reply without
tool calls would end the turn, the loop asks its `boundary` (the worker's: messages that arrived
meanwhile join the turn, background tasks' notices are told) what arrived; whatever did is in
the transcript before the next model call, and a turn that would have ended goes on to answer
it. The last allowed step takes nothing in: what arrives then waits for its own turn.

Parallel calls: a run of consecutive calls the host marks `parallel` (`task` calls to
read-only subagents) runs concurrently; the subagents bound how many at once. Everything
else runs one at a time, in order.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agentbox.agent.events import EventBus
from agentbox.agent.models import (
    ChatMessage,
    Model,
    ModelError,
    ModelRequest,
    Reply,
    TextSink,
    ToolCall,
    ToolSpec,
)
from agentbox.agent.providers.errors import ContextOverflow
from agentbox.agent.providers.retry import RetryPolicy
from agentbox.agent.vision import Vision, recorded
from agentbox.store.images import ImageStore
from agentbox.store.sessions import Event, Message, NewEvent, SessionStore, Turn
from agentbox.tools.base import ToolResult

#: Model calls one turn may make before it ends with stop_reason `max_steps` (work is kept).
MAX_STEPS = 50
#: The result of a call the turn did not run because the user took the browser over.
NOT_RUN_AFTER_TAKEOVER = "Not run: the user took over the browser, which ended this turn."


#: Takes in what arrived since the last model call (see "Step boundaries"); whether anything did.
Boundary = Callable[[], Awaitable[bool]]


class TurnEnded(Exception):
    pass


class Completed(TurnEnded):
    def __init__(self, stop_reason: str) -> None:
        super().__init__(stop_reason)
        self.stop_reason = stop_reason


class Failed(TurnEnded):
    def __init__(self, error_type: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.error = {"type": error_type, "message": message, "retryable": retryable}


@dataclass(frozen=True)
class LoopConfig:
    max_steps: int = MAX_STEPS
    """Model calls per turn (`MAX_STEPS`)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Attempts and backoff for retryable model errors (`providers.retry`)."""


class ToolHost(Protocol):
    """The session's tools as the loop needs them (the worker adapts `SessionTools`)."""

    def specs(self) -> list[ToolSpec]: ...

    def permission(self, name: str) -> str:
        """How the tier treats a call: allow | ask | stage | forbid | unknown."""
        ...

    def read_only(self, name: str) -> bool:
        """Whether re-running the tool is harmless (recovery may re-run it)."""
        ...

    def parallel(self, call: ToolCall) -> bool:
        """Whether the call may run beside other such calls (a `task` for a read-only subagent)."""
        ...

    async def call(self, call: ToolCall) -> ToolResult: ...


class Context(Protocol):
    """What the model is shown, and compaction (`agent.context.TurnContext`)."""

    async def request(self, tools: list[ToolSpec]) -> ModelRequest:
        """The next call's request (compacting first when the context is over its threshold)."""
        ...

    async def after_overflow(self) -> bool:
        """Compact after a context-overflow error; whether anything was compacted."""
        ...


class TurnLoop:
    def __init__(
        self,
        store: SessionStore,
        bus: EventBus,
        model: Model,
        tools: ToolHost,
        turn: Turn,
        context: Context,
        *,
        config: LoopConfig | None = None,
        vision: Vision | None = None,
        images: ImageStore | None = None,
        boundary: Boundary | None = None,
    ) -> None:
        self.store, self.bus, self.model, self.tools, self.turn = store, bus, model, tools, turn
        self.context = context
        self.config = config or LoopConfig()
        self.vision = vision or Vision(model.name)
        """Whether results' images are shown to the model (`agent.vision`)."""
        self.images = images
        """Where they are kept for later requests (None: they are only named in the text)."""
        self.boundary = boundary
        self.steps = 0
        self._call_ids: set[str] | None = None  # the session's tool call ids, read once per turn

    async def run(self) -> TurnEnded:
        """Steps until the turn ends; how it ended (cancellation, i.e. abort, propagates)."""
        try:
            while True:
                await self.step()
        except TurnEnded as end:
            return end

    async def step(self) -> None:
        if self.steps >= self.config.max_steps:
            raise Completed("max_steps")
        self.steps += 1
        reply = await self.query()
        if reply.tool_calls:
            await self.execute_actions(reply.tool_calls)
            await self.take_in()
        elif not await self.take_in():
            raise Completed("end_turn")

    async def take_in(self) -> bool:
        """At a step boundary: what arrived meanwhile (see "Step boundaries"); whether anything did."""
        if self.boundary is None or self.steps >= self.config.max_steps:
            return False
        return await self.boundary()

    async def query(self) -> Reply:
        """One model reply, retried on retryable errors; recorded before it is returned."""
        attempt, compacted = 1, False
        while True:
            request = replace(await self.observe(), on_text=self.deltas())
            message_id = await self.store.open_reply(self.turn.id)
            started = time.monotonic()
            try:
                reply = await self.model.query(request)
            except ContextOverflow as exc:
                await self.record_model_error(message_id, exc, attempt)
                if compacted or not await self.context.after_overflow():
                    raise Failed(exc.error_type, str(exc), False) from exc
                compacted = True
                continue
            except ModelError as exc:
                retry = exc.retryable and attempt < self.config.retry.attempts
                delay = self.config.retry.delay(attempt, exc) if retry else None
                await self.record_model_error(message_id, exc, attempt, delay)
                if delay is None:
                    raise Failed(exc.error_type, str(exc), exc.retryable) from exc
                await asyncio.sleep(delay)
                attempt += 1
                continue
            reply = replace(reply, tool_calls=await self.unique_ids(reply.tool_calls))
            await self.record_reply(message_id, reply, time.monotonic() - started)
            return reply

    async def unique_ids(self, calls: Sequence[ToolCall]) -> list[ToolCall]:
        """The calls with ids unique in the session: servers that number calls per response
        (`call_0` every time) would otherwise have a result recorded for an older call."""
        if self._call_ids is None:
            self._call_ids = {
                c["id"]
                for m in await self.store.transcript(self.turn.session_id)
                if m.role == "assistant"
                for c in m.content.get("tool_calls", [])
            }
        unique = []
        for call in calls:
            if call.id in self._call_ids:
                call = replace(call, id=f"{call.id}_{uuid.uuid4().hex[:12]}")
            self._call_ids.add(call.id)
            unique.append(call)
        return unique

    def deltas(self) -> TextSink:
        """Where one model call's text goes as it is produced: the bus, numbered from 0, unstored."""
        count = 0

        def sink(text: str) -> None:
            nonlocal count
            self.bus.publish_delta(self.turn.session_id, self.turn.id, text, count)
            count += 1

        return sink

    async def observe(self) -> ModelRequest:
        """The model's view, from the recorded rows (the only source, also after a restart)."""
        return await self.context.request(self.tools.specs())

    async def execute_actions(self, calls: Sequence[ToolCall]) -> None:
        """Run the calls not answered yet: in order, runs of `parallel` calls concurrently.

        A call the user's browser takeover cut short ends the turn: the calls after it are
        answered as not run, and the turn stops with `user_takeover`, so the model does not go
        on acting while the user drives."""
        answered = await self.store.answered(self.turn.session_id, [call.id for call in calls])
        pending = [call for call in calls if call.id not in answered]
        while pending:
            group = [pending.pop(0)]
            while self.tools.parallel(group[0]) and pending and self.tools.parallel(pending[0]):
                group.append(pending.pop(0))
            results = await asyncio.gather(*(self.execute_action(call) for call in group))
            if any(result.data.get("takeover") for result in results):
                for call in pending:
                    await self.record_result(call, ToolResult.error(NOT_RUN_AFTER_TAKEOVER))
                raise Completed("user_takeover")

    async def execute_action(self, call: ToolCall) -> ToolResult:
        result = await self.tools.call(call)
        await self.record_result(call, result)
        return result

    # ---------------------------------------------------------------- durable steps

    async def record_reply(self, message_id: int, reply: Reply, seconds: float) -> None:
        events = []
        if reply.text:
            events.append(NewEvent("agent.message", {"content": [{"type": "text", "text": reply.text}]}))
        for call in reply.tool_calls:
            events.append(NewEvent("agent.tool_use", {
                "tool_use_id": call.id, "name": call.name, "input": call.input,
                "permission": self.tools.permission(call.name),
            }))  # fmt: skip
        events.append(NewEvent("model.usage", {
            "model": self.model.name, "input_tokens": reply.usage.input_tokens,
            "output_tokens": reply.usage.output_tokens, "latency_ms": round(seconds * 1000),
        }))  # fmt: skip
        content = {
            "text": reply.text,
            "tool_calls": [{"id": c.id, "name": c.name, "input": c.input} for c in reply.tool_calls],
            "usage": {"input_tokens": reply.usage.input_tokens, "output_tokens": reply.usage.output_tokens},
        }
        if reply.thinking:
            content["thinking"] = reply.thinking
        await self.publish(self.store.close_reply(message_id, "complete", content, events))

    async def record_model_error(
        self, message_id: int, exc: ModelError, attempt: int, delay: float | None = None
    ) -> None:
        """The failed call's row and a `session.error`; `retry` says when the next attempt comes."""
        event = model_error_event(exc, attempt, self.config.retry.attempts, delay)
        await self.publish(
            self.store.close_reply(message_id, "error", {"error": event.data["error"]}, [event])
        )

    async def record_result(self, call: ToolCall, result: ToolResult) -> None:
        text, blocks = await recorded(result, self.vision, self.images)
        await self.publish(self.store.add_tool_result(
            self.turn.id, call.id, call.name, text, result.is_error, side_events(result),
            delivered_files(result), blocks,
        ))  # fmt: skip

    async def publish(self, write: Awaitable[list[Event]]) -> list[Event]:
        """Await a store write, then publish what it committed."""
        events = await write
        self.bus.publish(events)
        return events


def model_error_event(
    exc: ModelError, attempt: int, attempts: int, delay: float | None = None, purpose: str | None = None
) -> NewEvent:
    """The `session.error` of a failed model call: `retry` (attempt n of `attempts`, the wait
    before the next) when there is a next one; `purpose` for calls that are not the turn's own
    (`compaction`, `subagent`)."""
    data: dict[str, Any] = {
        "error": {"type": exc.error_type, "message": str(exc), "retryable": exc.retryable}
    }
    if delay is not None:
        data["retry"] = {"attempt": attempt, "max": attempts, "delay_ms": round(delay * 1000)}
    if purpose is not None:
        data["purpose"] = purpose
    return NewEvent("session.error", data)


def side_events(result: ToolResult) -> list[NewEvent]:
    """Events a tool result implies: a staged change set, delivered files, a screenshot."""
    events = []
    if isinstance(result.data.get("screenshot"), dict):
        events.append(NewEvent("browser.screenshot", result.data["screenshot"]))
    if result.data.get("change_set_id"):
        events.append(NewEvent("change_set.updated", {
            "change_set_id": result.data["change_set_id"],
            "operations": result.data.get("operations", []),
        }))  # fmt: skip
    for record in delivered_files(result):
        events.append(NewEvent("file.delivered", {
            "file_id": record["id"], "filename": record["filename"], "bytes": record["bytes"],
        }))  # fmt: skip
    return events


def delivered_files(result: ToolResult) -> list[dict[str, Any]]:
    """The files a call delivered (`id`, `filename`, `bytes`), as `deliver_file` lists them in
    its data: the `files` of its `agent.tool_result` (seed 000); [] for every other tool."""
    return [
        {"id": r["id"], "filename": r["filename"], "bytes": r["bytes"]}
        for r in result.data.get("files") or []
        if isinstance(r, dict) and {"id", "filename", "bytes"} <= r.keys()
    ]


def conversation_rows(transcript: Sequence[Message]) -> list[tuple[Message, ChatMessage]]:
    """Each row the model sees, with its model message (compaction cuts by row)."""
    messages = []
    for m in transcript:
        if m.role == "user":
            messages.append((m, ChatMessage("user", user_text(m.content))))
        elif m.role == "assistant" and m.status == "complete":
            calls = [ToolCall(c["id"], c["name"], c["input"]) for c in m.content.get("tool_calls", [])]
            reply = ChatMessage(
                "assistant", m.content.get("text", ""), calls, thinking=m.content.get("thinking", [])
            )
            messages.append((m, reply))
        elif m.role == "tool":
            c = m.content
            result = ChatMessage("tool", c["content"], tool_use_id=c["tool_use_id"], is_error=c["is_error"])
            messages.append((m, result))
    return messages


def user_text(content: dict[str, Any]) -> str:
    """The user's words, with where their files were placed (seed 000: /workspace/inputs)."""
    text = str(content.get("text", ""))
    placed = content.get("placed") or []
    if placed:
        text += "\n\nAttached files:\n" + "\n".join(f"- {p['path']}" for p in placed)
    return text
