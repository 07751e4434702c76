"""The model's view of a session during a turn: baseline, signals and compaction, on the store.

`agent/prompt.py`, `agent/signals.py` and `agent/compaction.py` are pure; this module runs
them against the session's rows (`store/baselines.py`) so that every model call, also after
a restart, sees exactly what the rows say:

    begin()         at the turn boundary: the first baseline (the frozen system prompt), or
                    one signal message for whatever changed since the model was last told
    request(tools)  system = the newest baseline's prompt; messages = its summary (if any),
                    then the transcript from its first kept message, up to this turn, each
                    result's images read back from the image store (`agent.vision`); first
                    compacts when the context exceeds window - reserve (Flue's trigger)
    compact(why)    summarise the older part with the summary model (`summarizer`: the
                    session's, or `compaction.model`'s), keep the recent part,
                    rebaseline the prompt against the current surroundings; records
                    `agent.context_compacted` (and the summary call's `model.usage`)

The session's `model.usage` reports are the token count where they are current (the newest
complete reply after the baseline: its input + output tokens), plus a chars/4 estimate for
what came after; without one, everything is estimated.

`call_index` (the scripted model's position) counts the session's recorded replies plus its
compactions: a summary call consumes a step like any other model call, so a scripted
session's script names the summary's text where it expects one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from agentbox.agent.compaction import (
    CompactionConfig,
    context_tokens,
    cut_point,
    estimate_tokens,
    finish_summary,
    reserve_tokens,
    should_compact,
    summary_message,
    summary_request,
)
from agentbox.agent.events import EventBus
from agentbox.agent.limits import ModelLimits
from agentbox.agent.loop import conversation_rows, model_error_event
from agentbox.agent.models import ChatMessage, Model, ModelError, ModelRequest, ToolSpec
from agentbox.agent.prompt import Subagent, assemble
from agentbox.agent.providers.retry import RetryPolicy, with_retries
from agentbox.agent.signals import Environment, Resource, Signal, diff, text_digest, tool_resources
from agentbox.agent.vision import Vision, budget, load_parts, newest_only
from agentbox.machines.base import Machine, environment_line
from agentbox.store.baselines import Baseline, BaselineStore, SignalRow
from agentbox.store.images import ImageStore
from agentbox.store.sessions import Message, NewEvent, SessionStore, Turn
from agentbox.tools.knowledge_bases import Scope, Selection
from agentbox.tools.skills import Skill

#: The event a compaction records.
COMPACTED_EVENT = "agent.context_compacted"
#: The event a turn boundary's signals record (their types and bodies, as the model read them).
SIGNAL_EVENT = "agent.signal"


@dataclass(frozen=True)
class Surroundings:
    """What the prompt describes, as it is now (the worker gathers it at each boundary)."""

    instructions: str
    permission_mode: str
    machine: Machine | None
    tools: list[ToolSpec] = field(default_factory=list)
    skills: list[Skill] = field(default_factory=list)
    subagents: list[Subagent] = field(default_factory=list)
    toolset: str = "default"
    """The session's toolset: the prompt says how it loads a skill (`prompt.SKILL_CALLS`)."""
    knowledge: Selection = field(default_factory=Selection)
    """The session's knowledge bases: the working directory is the first one's root."""

    def scope(self) -> Scope | None:
        return self.knowledge.scope(self.machine.root) if self.machine is not None else None

    def environment(self) -> Environment:
        scope = self.scope()
        return Environment(
            machine=environment_line(self.machine) if self.machine is not None else None,
            cwd=scope.base.root if scope is not None else None,
            knowledge_bases=tuple(scope.describe())
            if scope is not None and len(scope.registered) > 1
            else (),
            tools=tool_resources(self.tools),
            skills=tuple(Resource(s.name, s.description) for s in self.skills),
            subagents=tuple(Resource(a.name, a.description) for a in self.subagents),
            permission_mode=self.permission_mode,
            instructions_digest=text_digest(self.instructions),
        )

    async def prompt(self, today: date | None = None) -> str:
        return await assemble(
            self.instructions, self.machine, skills=self.skills, subagents=self.subagents, today=today,
            toolset=self.toolset, scope=self.scope(),
        )  # fmt: skip


def environment_data(env: Environment) -> dict[str, Any]:
    return dataclasses.asdict(env)


def environment_from(data: dict[str, Any]) -> Environment:
    def resources(key: str) -> tuple[Resource, ...]:
        return tuple(Resource(**r) for r in data.get(key) or [])

    return Environment(
        machine=data.get("machine"),
        cwd=data.get("cwd"),
        tools=resources("tools"),
        skills=resources("skills"),
        subagents=resources("subagents"),
        permission_mode=data.get("permission_mode", ""),
        instructions_digest=data.get("instructions_digest", ""),
        knowledge_bases=tuple(data.get("knowledge_bases") or ()),
    )


@dataclass(frozen=True)
class View:
    """What one model call is given, with the rows behind the messages (for placing a cut)."""

    system: str
    messages: list[ChatMessage]
    rows: list[Message | None]
    """`rows[i]` is the row `messages[i]` came from; None for the summary head."""
    baseline: Baseline | None
    reported: int | None
    """Provider-reported tokens as of `messages[reported_at]` (None: estimate everything)."""
    reported_at: int


class CompactionFailed(Exception):
    """The summary call failed; the turn goes on uncompacted (or fails, on an overflow)."""


class TurnContext:
    """One turn's view of its session (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        baselines: BaselineStore,
        bus: EventBus,
        turn: Turn,
        model: Model,
        surroundings: Callable[[], Awaitable[Surroundings]],
        *,
        limits: ModelLimits,
        compaction: CompactionConfig,
        retry: RetryPolicy | None = None,
        vision: Vision | None = None,
        images: ImageStore | None = None,
        summarizer: Model | None = None,
    ) -> None:
        self.store, self.baselines, self.bus, self.turn = store, baselines, bus, turn
        self.model, self.surroundings = model, surroundings
        self.summarizer = summarizer or model
        """The model that writes compaction summaries (`CompactionConfig.model`; default the session's)."""
        self.limits, self.compaction, self.retry = limits, compaction, retry or RetryPolicy()
        self.vision, self.images = vision or Vision(model.name), images
        """Results' images are read back from `images` for each request (`agent.vision`)."""

    @property
    def reserve(self) -> int:
        if self.compaction.reserve_tokens is not None:
            return self.compaction.reserve_tokens
        return reserve_tokens(self.limits.context_window, self.limits.max_output_tokens)

    # ------------------------------------------------------------------ the turn boundary

    async def begin(self, boundary: bool = True) -> None:
        """The first baseline, or the signals for what changed since the model was last told.

        `boundary` False (a turn resumed mid-way after a restart): no signals, since a message
        between a reply's tool calls and their results breaks every provider's pairing rule;
        they are told at the next turn's start.
        """
        now = await self.surroundings()
        env = now.environment()
        baseline = await self.baselines.latest(self.turn.session_id)
        if baseline is None:
            _, events = await self.baselines.add(self.turn.id, await now.prompt(), environment_data(env))
            self.bus.publish(events)
            return
        if not boundary:
            return
        latest = await self.baselines.last_signal(self.turn.session_id, after=baseline.last_message)
        told = environment_from(latest if latest is not None else baseline.environment)
        signals = diff(told, env)
        if signals:
            await self.record_signals(signals, env)

    async def record_signals(self, signals: Sequence[Signal], env: Environment | None = None) -> None:
        """One signal message and its `agent.signal` event; `env`: the environment they told
        (None for notices that change nothing the prompt describes, e.g. a finished task)."""
        text = "\n\n".join(s.render() for s in signals)
        row = SignalRow(text, [s.type for s in signals], environment_data(env) if env is not None else None)
        data = {"signals": [{"type": s.type, "body": s.body, **dict(s.attributes)} for s in signals]}
        self.bus.publish(await self.baselines.add_signals(self.turn.id, row, [NewEvent(SIGNAL_EVENT, data)]))

    # ------------------------------------------------------------------ each model call

    async def view(self) -> View:
        baseline = await self.baselines.latest(self.turn.session_id)
        since = baseline.first_kept if baseline is not None else None
        transcript = await self.store.transcript(self.turn.session_id, through=self.turn, since=since)
        pairs = conversation_rows(transcript)
        rows: list[Message | None] = [row for row, _ in pairs]
        shown = newest_only([self.blocks(row) for row, _ in pairs])
        messages = budget(
            [await self.shown(blocks, message) for blocks, (_, message) in zip(shown, pairs, strict=True)]
        )
        if baseline is not None and baseline.summary is not None:
            rows.insert(0, None)
            messages.insert(0, summary_message(baseline.summary))
        reported, reported_at = None, -1
        after = baseline.last_message if baseline is not None else 0
        for index, row in enumerate(rows):
            usage = row.content.get("usage") if row is not None and row.role == "assistant" else None
            if usage and row is not None and row.id > after:
                reported = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
                reported_at = index
        system = baseline.system if baseline is not None else ""
        return View(system, messages, rows, baseline, reported, reported_at)

    @staticmethod
    def blocks(row: Message) -> list[dict[str, Any]] | None:
        """The text and image blocks a stored result shows (None: its text alone)."""
        return row.content.get("blocks") if row.role == "tool" else None

    async def shown(self, blocks: list[dict[str, Any]] | None, message: ChatMessage) -> ChatMessage:
        """The message with the images its row names, read back from the store."""
        if not blocks or self.images is None:
            return message
        return dataclasses.replace(message, parts=await load_parts(blocks, self.vision, self.images))

    async def call_index(self) -> int:
        """The session's model calls so far: recorded replies (any status) and compactions."""
        replies = await self.store.model_calls(self.turn.session_id)
        return replies + await self.baselines.compactions(self.turn.session_id)

    async def request(self, tools: list[ToolSpec]) -> ModelRequest:
        """The next call's request; compacts first when the context is over the threshold
        (a failed summary is reported as `session.error`, and the call goes ahead uncompacted)."""
        view = await self.view()
        if self.compaction.enabled and should_compact(
            self.tokens(view, tools), self.limits.context_window, self.reserve
        ):
            try:
                if await self.compact("threshold", view):
                    view = await self.view()
            except CompactionFailed as exc:
                await self.append([NewEvent("session.error", {"error": {
                    "type": "compaction_failed", "message": str(exc), "retryable": True,
                }})])  # fmt: skip
        return ModelRequest(view.system, view.messages, tools, call_index=await self.call_index())

    def tokens(self, view: View, tools: Sequence[ToolSpec] = ()) -> int:
        if view.reported is not None:
            return context_tokens(view.messages, view.reported, view.reported_at)
        fixed = len(view.system) + sum(len(json.dumps(t.input_schema)) + len(t.description) for t in tools)
        return context_tokens(view.messages) + fixed // 4

    async def after_overflow(self) -> bool:
        """The provider said the context is too long: compact (even if configured off); whether it did."""
        try:
            return await self.compact("overflow", await self.view())
        except CompactionFailed:
            return False

    # ------------------------------------------------------------------ compaction

    async def compact(self, reason: str, view: View) -> bool:
        """Summarise the older part, keep the recent part, rebaseline; False if nothing can be cut."""
        start = 1 if view.rows and view.rows[0] is None else 0
        cut = cut_point(view.messages, self.compaction.keep_recent_tokens, start)
        if cut is None:
            return False
        first_kept = view.rows[cut.index]
        assert first_kept is not None  # cut_point never returns the head
        old = view.messages[start : cut.turn_start if cut.split_turn else cut.index]
        prefix = view.messages[cut.turn_start : cut.index] if cut.split_turn else []
        previous = view.baseline.summary if view.baseline is not None else None
        ask = summary_request(old, previous, turn_prefix=prefix, reserve=self.reserve)
        request = dataclasses.replace(
            ask.request, max_tokens=ask.max_tokens, call_index=await self.call_index()
        )
        started = time.monotonic()

        async def retrying(exc: ModelError, attempt: int, delay: float) -> None:
            await self.append([model_error_event(exc, attempt, self.retry.attempts, delay, "compaction")])

        try:
            reply = await with_retries(lambda: self.summarizer.query(request), self.retry, retrying)
        except ModelError as exc:
            raise CompactionFailed(f"the summary call failed: {exc}") from exc
        if not reply.text.strip():
            raise CompactionFailed("the summary call returned no text")
        summary = finish_summary(reply.text, ask.read_files, ask.modified_files)
        now = await self.surroundings()
        before = self.tokens(view)
        kept = view.messages[cut.index :]
        after = sum(estimate_tokens(m) for m in [summary_message(summary), *kept])
        events = [
            NewEvent("model.usage", {
                "model": self.summarizer.name, "input_tokens": reply.usage.input_tokens,
                "output_tokens": reply.usage.output_tokens,
                "latency_ms": round((time.monotonic() - started) * 1000), "purpose": "compaction",
            }),
            NewEvent(COMPACTED_EVENT, {
                "reason": reason, "tokens_before": before, "tokens_after": after,
                "summarized_messages": cut.index - start, "kept_messages": len(kept),
                "split_turn": cut.split_turn, "first_kept_message_id": first_kept.id,
                "read_files": list(ask.read_files), "modified_files": list(ask.modified_files),
                "summary": summary,
            }),
        ]  # fmt: skip
        _, written = await self.baselines.add(
            self.turn.id, await now.prompt(), environment_data(now.environment()),
            summary=summary, first_kept=first_kept.id, events=events,
        )  # fmt: skip
        self.bus.publish(written)
        return True

    async def append(self, events: list[NewEvent]) -> None:
        self.bus.publish(await self.store.append(self.turn.session_id, self.turn.id, events))
