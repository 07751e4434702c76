"""Running sessions' turns: per session one at a time in FIFO order, abortable, recovered on start.

The `Worker` is what the sessions HTTP API calls: it accepts messages (a committed turn
before it returns), wakes the session's drain task, aborts, and after a restart converges
and classifies every open turn (Flue's recovery, a.9) before acting on it.

What a turn is given (`_work`): the session's model (`models(session)`: the scripted model or
a provider with the session's `model_options`), its tools (the toolset, its MCP servers' tools,
`task` with a `Subagents` delegate over the session's `BackgroundTasks` and the stored
subagent runs; a session whose machine is `NO_MACHINE` keeps only the tools that need no
machine) and a `TurnContext` over the session's baselines, with the summary model that
`compaction.model` names (else the config's `[compaction] model`, else the session's). The system prompt and the signals describe the machine (seed 004's
machine line, the workspace listing, AGENTS.md) through `Registry.view`, which starts nothing:
a sandbox starts at the first tool call that needs it, so a turn that only talks costs no
sandbox.

FIFO: each session has at most one drain task, which takes the first open turn, runs it to
its end, and takes the next. A message is always accepted as a queued turn first (a row before
anything else); one that arrives while a turn runs joins that turn at its next step boundary
(`SessionStore.join_queued`, Flue's turn-boundary join): after the current model call and its
tool calls, before the next model call, or where the turn would have ended. It is answered in
that turn and its own turn ends with it. A message joins no turn, and runs as its own, when
the turn has already ended (or takes its last step), or when it brings files. A turn waiting
for an approval has no boundary until the approval is answered (the call that asked is still
running): a message sent meanwhile joins after the answer, read together with the call's
result, since the user's answer to a question comes before what they said next. Aborting a
joined turn aborts the turn it joined.

Abort: a queued turn (or one with no live task, e.g. awaiting approval after a restart) is
finished `aborted` at once. A running turn's task is cancelled (a hanging model call, a
waiting approval and a running command all unblock), then the turn is finished `aborted`;
if it completed first, that stands: `finish` is conditional, so abort and completion racing
leave exactly one terminal event. A task that ignores cancellation for `ABORT_GRACE_S` is
finished anyway; the store's fence keeps it from writing after that.

Recovery on start, per open turn, in FIFO order: converge, classify and act by
`agent.recovery.RECOVERY` (the table and what repair does are there).

Resume: answering the approval of a turn that waits with no live task (after a restart)
moves it to running and wakes the session; its drain repairs it as above and continues.
A shutdown (`close`) cancels tasks without finishing their turns or cancelling their
approvals: the next start recovers them, and a turn waiting for the user still waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import date
from typing import Any

from agentbox.agent.agents import AgentSpec, canonical_names, load_agents, roster
from agentbox.agent.compaction import check_model, parse_config
from agentbox.agent.context import Surroundings, TurnContext
from agentbox.agent.events import EventBus
from agentbox.agent.inputs import PlacementError, place_inputs
from agentbox.agent.limits import ModelLimits, check_limit_options, model_limits
from agentbox.agent.loop import Completed, Failed, LoopConfig, TurnEnded, TurnLoop, model_error_event
from agentbox.agent.mcp_tools import McpTools, check_servers
from agentbox.agent.models import (
    SCRIPTED,
    Model,
    ModelCall,
    ModelError,
    ReportingModel,
    ScriptedModel,
    ToolCall,
    check_script,
)
from agentbox.agent.prompt import facts
from agentbox.agent.providers import check_endpoint, provider_model
from agentbox.agent.providers.retry import RetryingModel
from agentbox.agent.reach import Reach
from agentbox.agent.recovery import RECOVERY, Act, classify
from agentbox.agent.signals import task_signal
from agentbox.agent.subagents import INTERRUPTED_NOTICE, BackgroundTasks, Notice, Subagents, running_call
from agentbox.agent.tool_host import SessionToolHost
from agentbox.agent.vision import Vision
from agentbox.config import MachineConfig
from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError, MachineNotFound
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.registry import Entry, Registry
from agentbox.store.approvals import Approval
from agentbox.store.baselines import BaselineStore
from agentbox.store.file_ids import FileIdRepo
from agentbox.store.files import FileStore
from agentbox.store.images import ImageStore
from agentbox.store.sessions import (
    INTERRUPTED,
    MAX_EVENTS_PAGE,
    Event,
    Message,
    NewEvent,
    Session,
    SessionNotFound,
    SessionStore,
    Submission,
    Turn,
    TurnClosed,
)
from agentbox.store.subagents import SubagentRun, SubagentRuns
from agentbox.store.todos import TodoRepo
from agentbox.tools.approvals import Approvals, EventKind
from agentbox.tools.base import Action, Tool, ToolResult
from agentbox.tools.changes import ChangeSets
from agentbox.tools.knowledge_bases import ScopeError, Selection, session_selection
from agentbox.tools.runner import SessionTools, denied
from agentbox.tools.services import MachineServices, Services
from agentbox.tools.skills import catalog, unused_skill_tools
from agentbox.tools.tiers import FullAutoRefused, Tier, session_tier
from agentbox.tools.toolsets import TOOLSETS, toolset

log = logging.getLogger(__name__)

#: Seconds an aborted turn's task may take to stop before the turn is finished without it.
ABORT_GRACE_S = 5.0
#: The permission mode beside the tiers: plan (seed 001), on top of `PLAN_TIER`.
PLAN = "plan"
#: The tier plan mode runs over: research outside the workspace asks, nothing changes.
PLAN_TIER = Tier.FULL_ASK
PERMISSION_MODES: tuple[str, ...] = (*(t.value for t in Tier), PLAN)
#: The `machine` of a session without a sandbox: no file or shell tools, no workspace context.
NO_MACHINE = "none"


class UnknownModel(ValueError):
    pass


def scripted_or_refuse(session: Session, reach: Reach | None = None) -> Model:
    """The default model factory: the scripted model, or a provider (`openai:<m>`, `anthropic:<m>`)
    configured by the session's `model_options`, its own `base_url` held to `reach`."""
    if session.model == SCRIPTED:
        return ScriptedModel(session.script or [])
    provider = provider_model(session.model, session.model_options, reach)
    if provider is not None:
        return provider
    raise UnknownModel(f"model {session.model!r} is not available in this build (only {SCRIPTED!r})")


def permission_mode_on(machine: MachineConfig | None, mode: str | None) -> str:
    """The mode a session on `machine` (None: no machine) gets: plan, or `session_tier`'s tier
    (the machine's default when `mode` is None; `FullAutoRefused` for full-auto on the host)."""
    if mode is not None and mode not in PERMISSION_MODES:
        raise ValueError(f"permission_mode must be one of {', '.join(PERMISSION_MODES)}, not {mode!r}")
    if mode == PLAN:
        return PLAN
    return session_tier(machine, Tier(mode) if mode is not None else None).value


def tier_of(permission_mode: str) -> tuple[Tier, bool]:
    """(tier, plan) of a session's permission mode."""
    if permission_mode == PLAN:
        return PLAN_TIER, True
    return Tier(permission_mode), False


ModelFactory = Callable[[Session], Model]


class Worker:
    def __init__(
        self,
        store: SessionStore,
        bus: EventBus,
        registry: Registry,
        files: FileStore,
        approvals: Approvals,
        changes: ChangeSets,
        todos: TodoRepo,
        *,
        models: ModelFactory | None = None,
        config: LoopConfig | None = None,
        services: Services | None = None,
    ) -> None:
        self.store, self.bus, self.registry, self.files = store, bus, registry, files
        self.services = services or Services(registry)
        """The machines' services, shared with the HTTP API and MCP (`agentbox.system`)."""
        self._own_services = services is None
        self.approvals, self.changes, self.todos = approvals, changes, todos
        self._models = models or self._model
        self.on_model_call: list[Callable[[ModelCall], None]] = []
        """Told of every model call as it ends: the turn's, its compaction's, subagents' (metrics)."""
        self.config = config or LoopConfig()
        self.baselines = BaselineStore(store.db)
        self.images = ImageStore(registry.settings.home)
        """The images tool results showed the model, for every later request (`agent.vision`)."""
        self.file_ids = FileIdRepo(store.db)
        """The file ids sessions' tools showed (`read` takes them)."""
        self.runs = SubagentRuns(store.db)
        """Subagents' transcripts (read by the sessions API, continued by `task` with `resume`)."""
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._turns: dict[str, asyncio.Task[None]] = {}
        self._active: dict[str, str] = {}  # session id -> the turn it runs now
        self._hosts: dict[str, SessionToolHost] = {}  # turn id -> its tools
        self._aborting: dict[str, str] = {}  # turn id -> why it is being aborted
        self._resumes: dict[str, str] = {}  # turn id -> approval answered while no task waited for it
        self._mcp: dict[str, McpTools] = {}  # session id -> its connected MCP servers
        self._asking: dict[str, str | None] = {}  # approval id -> the tool_use_id that asked
        self._background: dict[str, BackgroundTasks] = {}  # session id -> its background tasks
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Hook into sandboxes and approvals, then recover every open turn (in FIFO order)."""
        if self._started:
            return
        self._started = True
        self.approvals.shutting_down = False
        self.registry.on_ready.append(self._sandbox_ready)
        self.approvals.listeners.append(self._approval_event)
        await self._owed_notices(await self.runs.interrupt_running())
        for session_id in dict.fromkeys(turn.session_id for turn in await self.store.open_turns()):
            self.wake(session_id)

    async def _owed_notices(self, interrupted: Sequence[SubagentRun]) -> None:
        """After a restart: each background task it cut short is told to its session as a
        `subagent.completed` event now, and every notice not yet told waits for the session's
        next boundary (`agent/subagents.py`)."""
        for run in interrupted:
            if run.background:
                await self._append(run.session_id, run.turn_id, [NewEvent("subagent.completed", {
                    "tool_use_id": run.tool_use_id, "agent": run.agent, "status": run.status,
                    "task_path": [run.tool_use_id], "subagent_id": run.id, "background": True,
                    "result": INTERRUPTED_NOTICE.format(agent=run.agent, id=run.id),
                })])  # fmt: skip
        for run, result in await self.runs.pending_notices():
            text = result if result is not None else INTERRUPTED_NOTICE.format(agent=run.agent, id=run.id)
            background = self._background.setdefault(run.session_id, BackgroundTasks())
            background.notices.append(Notice(run.tool_use_id, run.agent, run.status, text, run.id))

    async def close(self) -> None:
        """Stop working (turns stay as they are in the database; the next start recovers them)."""
        tasks = [*self._drains.values(), *self._turns.values()]
        self.approvals.shutting_down = True  # questions stay pending for the next start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ValueError):
            self.registry.on_ready.remove(self._sandbox_ready)
        with contextlib.suppress(ValueError):
            self.approvals.listeners.remove(self._approval_event)
        for mcp in self._mcp.values():
            await mcp.close()
        self._mcp.clear()
        for background in self._background.values():
            await background.close()
        self._background.clear()
        if self._own_services:
            await self.services.close()
        self._started = False

    # ------------------------------------------------------------------ the API's side

    async def create_session(
        self,
        model: str,
        *,
        permission_mode: str | None = None,
        instructions: str = "",
        mcp_servers: Sequence[Any] = (),
        toolset: str = "default",
        machine: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        script: Sequence[Any] | None = None,
        model_options: Mapping[str, Any] | None = None,
        compaction: Any = None,
        knowledge_bases: Sequence[Any] = (),
        knowledge_base_ids: Sequence[str] | None = None,
    ) -> Session:
        """Validate and create a session (`ValueError` subclasses name what is wrong).

        `machine`: a configured machine, None for the server's default, or `NO_MACHINE`.
        `permission_mode`: None for the machine's default (`permission_mode_on`).
        """
        config = self._machine_config(machine)
        permission_mode = permission_mode_on(config, permission_mode)
        if toolset not in TOOLSETS:
            raise ValueError(f"toolset must be one of {', '.join(sorted(TOOLSETS))}, not {toolset!r}")
        if model == SCRIPTED:
            check_script(script if script is not None else [])
        elif script is not None:
            raise ValueError("`script` is only for the scripted model")
        settings, reach = self.registry.settings, self._reach(config)
        await check_servers(mcp_servers, settings.mcp_servers, config, reach)
        check_model(parse_config(compaction), model, settings.models)
        check_limit_options(model_options or {})
        self._knowledge_of(machine, list(knowledge_bases), knowledge_base_ids)
        if model != SCRIPTED:
            try:  # an option the adapter cannot take (a `timeout` that is not a number) fails here, not in a turn
                provider = provider_model(model, model_options, reach)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"model_options cannot configure {model}: {exc}") from exc
            if provider is not None:
                await check_endpoint(provider)
        session, events = await self.store.create_session(
            model, permission_mode=permission_mode, instructions=instructions, mcp_servers=mcp_servers,
            toolset=toolset, machine=machine, metadata=metadata,
            script=list(script) if script is not None else ([] if model == SCRIPTED else None),
            model_options=model_options, compaction=compaction, knowledge_bases=knowledge_bases,
            knowledge_base_ids=knowledge_base_ids,
        )  # fmt: skip
        self.bus.publish(events)
        return session

    async def update_session(self, session_id: str, changes: Mapping[str, Any]) -> Session:
        """permission_mode, metadata and the knowledge bases only (`UnsupportedUpdate` for the rest)."""
        mode = changes.get("permission_mode")
        if mode is not None:
            session = await self.store.get_session(session_id)
            permission_mode_on(self._machine_config(session.machine), mode)
        if "knowledge_bases" in changes or "knowledge_base_ids" in changes:
            session = await self.store.get_session(session_id)
            self._knowledge_of(
                session.machine,
                changes.get("knowledge_bases", session.knowledge_bases),
                changes.get("knowledge_base_ids", session.knowledge_base_ids),
            )
        session, events = await self.store.update_session(session_id, changes)
        self.bus.publish(events)
        return session

    async def delete_session(self, session_id: str) -> None:
        """Abort the active turn, close the session's machines and purge its workspace and rows."""
        await self.store.get_session(session_id)
        for turn in await self.store.list_turns(session_id):
            if not turn.terminal:
                await self.abort(turn.id, reason="session_deleted")
        drain = self._drains.get(session_id)
        if drain is not None:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
        await self._release_mcp(session_id)
        background = self._background.pop(session_id, None)
        if background is not None:
            await background.close()
        await self.registry.close_session(session_id, purge=True)
        await self.images.discard(await self.store.delete_session(session_id))
        await self.file_ids.forget(session_id)

    async def submit(
        self, session_id: str, content: str, files: Sequence[str] = (), idempotency_key: str | None = None
    ) -> Submission:
        """Accept a message (committed before this returns), then wake the session."""
        if files and (await self.store.get_session(session_id)).machine == NO_MACHINE:
            raise ValueError("this session has no sandbox (machine: none) to place attached files in")
        submission = await self.store.submit(session_id, content, files, idempotency_key)
        self.bus.publish(submission.events)
        self.wake(session_id)
        return submission

    async def abort(self, turn_id: str, reason: str = "user_abort") -> Turn:
        """End a turn `aborted` unless it already ended; the turn as it stands after."""
        turn = await self.store.get_turn(turn_id)
        if turn.terminal:
            return turn
        if turn.joined_into is not None:  # answered inside that turn: only stopping it stops this
            await self.abort(turn.joined_into, reason)
            return await self.store.get_turn(turn_id)
        task = self._turns.get(turn_id)
        if task is not None:
            self._aborting[turn_id] = reason
            task.cancel()
            await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        self.bus.publish(await self.store.finish(turn_id, "aborted", {"reason": reason}))
        self.wake(turn.session_id)
        return await self.store.get_turn(turn_id)

    async def abort_active(self, session_id: str, reason: str = "user_abort") -> Turn | None:
        turn = await self.store.active_turn(session_id)
        return await self.abort(turn.id, reason) if turn is not None else None

    def wake(self, session_id: str) -> None:
        """Make sure the session's drain task runs (it exits when no turn is left)."""
        task = self._drains.get(session_id)
        if task is None or task.done():
            self._drains[session_id] = asyncio.get_running_loop().create_task(
                self._drain(session_id), name=f"drain-{session_id}"
            )

    async def idle(self, session_id: str) -> None:
        """Wait until the session's drain task has nothing left to run (tests, shutdown)."""
        while (task := self._drains.get(session_id)) is not None and not task.done():
            await asyncio.wait({task})

    # ------------------------------------------------------------------ running turns

    async def _drain(self, session_id: str) -> None:
        while True:
            turn = await self.store.active_turn(session_id)
            if turn is None or RECOVERY[classify(turn, [])] == Act.WAIT:
                await self._release_mcp(session_id)
                return  # nothing left, or a turn waiting for an approval asked before a restart
            task = asyncio.get_running_loop().create_task(self._run_turn(turn), name=f"turn-{turn.id}")
            self._turns[turn.id] = task
            try:
                await asyncio.wait({task})
            finally:
                if task.done():
                    self._turns.pop(turn.id, None)
            reason = self._aborting.pop(turn.id, None)
            if task.cancelled() and reason is not None:
                self.bus.publish(await self.store.finish(turn.id, "aborted", {"reason": reason}))
            elif not task.cancelled() and task.exception() is not None:
                log.error("turn %s crashed", turn.id, exc_info=task.exception())
                self.bus.publish(await self.store.finish(turn.id, "failed", _internal(task.exception())))

    async def _run_turn(self, queued: Turn) -> None:
        try:
            turn, events = await self.store.start_turn(queued.id)
        except TurnClosed:
            return  # aborted before it started
        self.bus.publish(events)
        session = await self.store.get_session(turn.session_id)
        self._active[turn.session_id] = turn.id
        started = time.monotonic()
        try:
            end = await self._work(session, turn, queued)
            data: dict[str, Any]
            if isinstance(end, Completed):
                data = {
                    "stop_reason": end.stop_reason,
                    "duration_ms": round((time.monotonic() - started) * 1000),
                }
                self.bus.publish(await self.store.finish(turn.id, "completed", data))
            elif isinstance(end, Failed):
                self.bus.publish(await self.store.finish(turn.id, "failed", {"error": end.error}))
        except TurnClosed:
            pass  # aborted (or deleted) while working: its terminal event is written
        finally:
            self._active.pop(turn.session_id, None)
            self._hosts.pop(turn.id, None)

    async def _work(self, session: Session, turn: Turn, before: Turn) -> TurnEnded:
        try:
            model = self.models(self.store.reveal(session))
        except (UnknownModel, ModelError) as exc:
            return Failed("model_unavailable", str(exc))
        host = self._tool_host(session, turn, await self._mcp_tools(session, turn))
        limits = self._limits(session)
        vision = Vision(session.model, limits.vision)
        compaction = parse_config(session.compaction)
        summary_model = compaction.model or self.registry.settings.compaction_model
        try:
            summarizer = self._named_model(session, summary_model) if summary_model else model
        except (UnknownModel, ModelError, TypeError, ValueError) as exc:
            return Failed("model_unavailable", f"the compaction model is not available: {exc}")
        context = TurnContext(
            self.store, self.baselines, self.bus, turn, model, lambda: self._surroundings(session, host),
            limits=limits, compaction=compaction, retry=self.config.retry, summarizer=summarizer,
            vision=vision, images=self.images,
        )  # fmt: skip
        loop = TurnLoop(
            self.store, self.bus, model, host, turn, context=context, config=self.config,
            vision=vision, images=self.images, boundary=lambda: self._boundary(turn, context),
        )  # fmt: skip
        try:
            await self._place(session, turn)
            await context.begin(boundary=before.status == "queued")
            if before.status == "queued":
                await self._tell_notices(turn, context)
                return await loop.run()
            return await self._recover(loop, before)
        except PlacementError as exc:
            return Failed("internal_error", str(exc))
        except MachineError as exc:  # the sandbox cannot start (also at a tool call): nothing could use it
            return Failed("machine_unavailable", f"the session's machine is not available: {exc}", True)

    async def _boundary(self, turn: Turn, context: TurnContext) -> bool:
        """At a step boundary of `turn`: the messages queued behind it join it, and the notices
        of background tasks that finished are told; whether anything arrived."""
        joined = await self.store.join_queued(turn.id)
        self.bus.publish(joined)
        told = await self._tell_notices(turn, context)
        return bool(joined) or told

    async def _tell_notices(self, turn: Turn, context: TurnContext) -> bool:
        """The session's finished background tasks, told as `task` signals; whether any were."""
        background = self._background.get(turn.session_id)
        notices = background.take() if background is not None else []
        if background is None or not notices:
            return False
        try:
            await context.record_signals(
                [task_signal(n.task_id, n.agent, n.status, n.result) for n in notices]
            )
        except BaseException:
            background.give_back(notices)
            raise
        await self.runs.told([n.run_id for n in notices if n.run_id is not None])
        return True

    async def _place(self, session: Session, turn: Turn) -> None:
        """Put the message's files in the workspace, once (seed 000: /workspace/inputs)."""
        if not turn.files or _placed(await self.store.transcript(session.id), turn.id):
            return
        machine = await self._machine(session)
        if machine is None:
            raise PlacementError("input files need a machine to be placed in; this session has none")
        placed = await place_inputs(machine, self.files, turn.files)
        self.bus.publish(await self.store.record_placement(turn.id, [p.to_dict() for p in placed]))

    async def _recover(self, loop: TurnLoop, turn: Turn) -> TurnEnded:
        """Converge, classify, act (`RECOVERY`)."""
        await self.store.close_streaming(turn.id)
        transcript = await self.store.transcript(turn.session_id)
        act = RECOVERY[classify(turn, transcript)]
        loop.steps = sum(1 for m in transcript if m.turn_id == turn.id and m.role == "assistant")
        if act == Act.COMPLETE:
            return Completed("end_turn")
        if act == Act.REPAIR:
            await self._repair(loop, turn, transcript)
        return await loop.run()

    async def _repair(self, loop: TurnLoop, turn: Turn, transcript: Sequence[Message]) -> None:
        answered = {m.tool_use_id for m in transcript if m.role == "tool"}
        replies = [
            m for m in transcript if m.turn_id == turn.id and m.role == "assistant" and m.status == "complete"
        ]
        resumed = self._resumes.pop(turn.id, None)
        asked = await self._asked(turn)
        host = self._hosts[turn.id]
        waited = False  # a call that waited for the user was found: the calls after it never started
        for raw in replies[-1].content.get("tool_calls", []):
            call = ToolCall(raw["id"], raw["name"], raw["input"])
            if call.id in answered:
                continue
            approval = await self.approvals.repo.get(asked[call.id]) if call.id in asked else None
            if approval is not None and approval.status == "denied":
                await loop.record_result(call, ToolResult.error(denied(approval.tool, approval.message)))
                waited = True
            elif (
                approval is not None
                and approval.allowed
                and (approval.id == resumed or host.read_only(call.name))
            ):
                await loop.record_result(call, await host.call(call, preapproved=approval.action))
                waited = True
            elif waited or host.read_only(call.name):
                await loop.execute_action(call)
            else:
                await loop.record_result(call, ToolResult.error(INTERRUPTED))

    async def _asker(self, approval: Approval) -> str | None:
        """The tool_use_id whose call asked `approval`: remembered, or (asked before a restart)
        read from its `approval.requested` event."""
        if approval.id in self._asking:
            return self._asking.pop(approval.id)
        if approval.turn_id is None:
            return None
        turn = await self.store.get_turn(approval.turn_id)
        return next((call for call, asked in (await self._asked(turn)).items() if asked == approval.id), None)

    async def _asked(self, turn: Turn) -> dict[str, str]:
        """tool_use_id -> approval id, for the turn's calls that asked the user (from its events)."""
        asked: dict[str, str] = {}
        cursor = 0
        while page := await self.store.list_events(
            turn.session_id,
            after=cursor,
            limit=MAX_EVENTS_PAGE,
            turn_id=turn.id,
            types=["approval.requested"],
        ):
            asked.update(
                {e.data["tool_use_id"]: e.data["approval_id"] for e in page if e.data.get("tool_use_id")}
            )
            cursor = page[-1].seq
        return asked

    def _knowledge_of(
        self, machine: str | None, registered: Sequence[Any], selected: Sequence[str] | None
    ) -> Selection:
        """A session's knowledge bases on its machine, checked (`ScopeError` names what is wrong)."""
        config = self._machine_config(machine)
        if config is None:
            if registered or selected is not None:
                raise ScopeError("a session without a machine has no knowledge bases")
            return Selection()
        return session_selection(self.registry.settings.knowledge_bases, config.name, registered, selected)

    def knowledge(self, session: Session) -> Selection:
        """The session's knowledge bases as its tools see them; a configured one the operator has
        since removed leaves the selection (the rest stands), the workspace when nothing is left."""
        config = self._machine_config(session.machine)
        if config is None:
            return Selection()
        try:
            return self._knowledge_of(session.machine, session.knowledge_bases, session.knowledge_base_ids)
        except ValueError as exc:
            log.warning("session %s: its knowledge bases no longer fit the config (%s)", session.id, exc)
        try:
            chosen = self._knowledge_of(session.machine, session.knowledge_bases, None)
        except ValueError:  # one of its own now has a configured one's id: the configured one wins
            chosen = self._knowledge_of(session.machine, [], None)
        kept = [kb_id for kb_id in session.knowledge_base_ids or [] if kb_id in chosen.ids()]
        return dataclasses.replace(chosen, selected=tuple(kept) or None)

    def _machine_config(self, machine: str | None) -> MachineConfig | None:
        """The configuration of a session's machine (the default for None); None for `NO_MACHINE`."""
        return None if machine == NO_MACHINE else self.registry.config(machine)

    def _reach(self, machine: MachineConfig | None) -> Reach:
        return Reach.on(machine, self.registry.settings.model_endpoints)

    def _still_allowed(self, session: Session, tier: Tier) -> Tier:
        """The stored tier, unless the operator has since withdrawn full-auto on the session's
        machine: then full-ask (the calls ask; nothing runs unasked)."""
        try:
            return session_tier(self._machine_config(session.machine), tier)
        except FullAutoRefused:
            return Tier.FULL_ASK
        except MachineNotFound:
            return tier  # nothing can open the machine: its tools fail on their own

    def _session_reach(self, session: Session) -> Reach:
        """A stored session's reach; no network if its machine is no longer configured."""
        try:
            return self._reach(self._machine_config(session.machine))
        except MachineNotFound:
            return Reach(network=False, allowed=tuple(self.registry.settings.model_endpoints))

    def models(self, session: Session) -> Model:
        """The session's model, reporting each call to `on_model_call`."""
        return ReportingModel(self._models(session), session.model.partition(":")[0], self._model_called)

    def _named_model(self, session: Session, name: str) -> Model:
        """Another model for work of the session (a subagent's, the compaction summary's): the
        session's options (endpoint, key) go with it only when it is the same provider's;
        another provider's is configured by the server's environment."""
        same = name.partition(":")[0] == session.model.partition(":")[0]
        chosen = dataclasses.replace(session, model=name, model_options=session.model_options if same else {})
        return self.models(self.store.reveal(chosen))

    def _model_called(self, call: ModelCall) -> None:
        for listener in self.on_model_call:
            listener(call)

    def _model(self, session: Session) -> Model:
        """The default model factory, with the session's reach for its own `base_url`."""
        return scripted_or_refuse(session, self._session_reach(session))

    async def _release_mcp(self, session_id: str) -> None:
        """Stop the session's MCP servers when it has nothing left to run: a server running in
        its sandbox keeps the sandbox busy, which would never be reclaimed when idle."""
        mcp = self._mcp.pop(session_id, None)
        if mcp is not None:
            await mcp.close()

    async def _mcp_tools(self, session: Session, turn: Turn) -> dict[str, Tool]:
        """The session's MCP servers' tools, connected at the first turn after the session wakes
        and kept until it has nothing left to run (`_release_mcp`); failures become `session.error`.

        Its own stdio servers run in its machine (opened here if need be), the operator's on the host."""
        if not session.mcp_servers:
            return {}
        mcp = self._mcp.get(session.id)
        if mcp is None:
            try:
                where = self._machine_config(session.machine)
            except MachineNotFound:
                where = None  # no longer configured: its own stdio servers have nowhere to run
            operator = self.registry.settings.mcp_servers
            mcp = self._mcp[session.id] = McpTools(
                list(self.store.reveal(session).mcp_servers),
                operator,
                lambda: self._machine(session),
                self._session_reach(session),
                where,
            )
            await mcp.connect()
            errors = [NewEvent("session.error", {"type": "mcp_unavailable", "server": e.server, "message": e.message})
                      for e in mcp.errors]  # fmt: skip
            if errors:
                await self._append(session.id, turn.id, errors)
        return mcp.tools

    def _tool_host(
        self, session: Session, turn: Turn, extra: Mapping[str, Tool] | None = None
    ) -> SessionToolHost:
        tier, plan = tier_of(session.permission_mode)
        tier = self._still_allowed(session, tier)
        tools = {**toolset(session.toolset), **(extra or {})}
        if session.machine == NO_MACHINE:
            tools = {name: tool for name, tool in tools.items() if not tool.machine}
        session_tools = SessionTools(
            machine=None, session_id=session.id, tier=tier, toolset=tools,
            changes=self.changes, approvals=self.approvals, todos=self.todos, files=self.files, plan=plan,
            config=self.registry.settings.tools, knowledge=self.knowledge(session), file_ids=self.file_ids,
        )  # fmt: skip
        session_tools.begin_turn(turn.id)
        host = SessionToolHost(session_tools, lambda: self._services(session))
        if any(tool.action == Action.TASK for tool in tools.values()):
            host.subagents = self._subagents(session, turn, host)
            session_tools.delegate = host.subagents
        self._hosts[turn.id] = host
        return host

    def _subagents(self, session: Session, turn: Turn, host: SessionToolHost) -> Subagents:
        """The `task` tool's delegate: the agents known when the turn starts, run on this turn's tools."""

        async def emit(events: list[NewEvent]) -> None:
            await self._append(session.id, turn.id, events)

        async def retrying(exc: ModelError, attempt: int, delay: float) -> None:
            await emit([model_error_event(exc, attempt, self.config.retry.attempts, delay, "subagent")])

        def child_model(spec: AgentSpec) -> Model:
            """The agent's own model if it names one, else the session's."""
            chosen = (
                self._named_model(session, spec.model)
                if spec.model
                else self.models(self.store.reveal(session))
            )
            return RetryingModel(chosen, self.config.retry, retrying)

        def child_vision(spec: AgentSpec) -> Vision:
            name = spec.model or session.model
            options = (
                session.model_options if name.partition(":")[0] == session.model.partition(":")[0] else {}
            )
            configured = self.registry.settings.models.get(name)
            return Vision(name, model_limits(name, options, configured).vision)

        canonical = canonical_names(session.toolset)
        background = self._background.setdefault(session.id, BackgroundTasks())
        return Subagents(
            agents={}, parent=host.tools, canonical=canonical, models=child_model,
            system_facts="", emit=emit, vision=child_vision, semaphore=background.semaphore,
            background=background, runs=self.runs, images=self.images,
        )  # fmt: skip

    def _limits(self, session: Session) -> ModelLimits:
        return model_limits(
            session.model, session.model_options, self.registry.settings.models.get(session.model)
        )

    async def _surroundings(self, session: Session, host: SessionToolHost) -> Surroundings:
        """What the prompt describes now; also refreshes the subagents' roster and facts."""
        session = await self.store.get_session(session.id)
        machine = await self._described(session)
        knowledge = host.tools.knowledge = self.knowledge(session)  # a PATCH since holds from this boundary
        skills = await catalog(machine, host.tools.config) if machine is not None else []
        unused = await unused_skill_tools(skills)
        if not self._limits(session).vision:
            unused |= {"read_image"}  # only a model that sees images is offered a tool to look
        host.tools.absent = frozenset(
            shown for shown, canonical in canonical_names(session.toolset).items() if canonical in unused
        )
        agents: list[Any] = []
        if host.subagents is not None:
            found = await load_agents(machine, self.registry.settings.agents)
            host.subagents.agents = found.agents
            scope = knowledge.scope(machine.root) if machine is not None else None
            host.subagents.system_facts = await facts(machine, date.today(), scope)
            agents = roster(found.agents)
        return Surroundings(
            instructions=session.instructions, permission_mode=session.permission_mode, machine=machine,
            tools=host.specs(), skills=skills, subagents=agents, toolset=session.toolset, knowledge=knowledge,
        )  # fmt: skip

    async def _described(self, session: Session) -> Machine | None:
        """The machine the prompt describes. One with host files as the registry shows it without
        starting it; any other is opened, since its files are read through it (and a copy that
        is not the registry's would hold a connection of its own)."""
        if session.machine == NO_MACHINE:
            return None
        shown = self.registry.view(session.id, session.machine)
        return shown if isinstance(shown, HostFiles) else await self._machine(session)

    async def _services(self, session: Session) -> MachineServices | None:
        """The session's machine, opened (or resumed), with its services; None for a session without one."""
        if session.machine == NO_MACHINE:
            return None
        return await self.services.get(session.id, session.machine)

    async def _machine(self, session: Session) -> Machine | None:
        services = await self._services(session)
        return services.machine if services is not None else None

    # ------------------------------------------------------------------ events from other parts

    async def _sandbox_ready(self, entry: Entry, rebuilt: bool) -> None:
        if entry.session_id is None:
            return
        data = {"state": "rebuilt" if rebuilt else "created", "machine": entry.config.name}
        turn_id = self._active.get(entry.session_id)
        await self._append(entry.session_id, turn_id, [NewEvent("sandbox.ready", data)])

    async def _approval_event(self, kind: EventKind, approval: Approval) -> None:
        if kind == "approval.requested":
            self._asking[approval.id] = running_call()
        data: dict[str, Any] = {
            "approval_id": approval.id, "tool": approval.tool, "action": approval.action,
            "tool_use_id": self._asking.get(approval.id) if kind == "approval.requested"
            else await self._asker(approval),
        }  # fmt: skip
        if kind == "approval.requested":
            data["detail"] = approval.detail
        else:
            decision = {"allowed": "allow", "denied": "deny"}.get(approval.status, approval.status)
            data.update(decision=decision, scope=approval.scope, message=approval.message)
        event = NewEvent(kind, data)
        if approval.turn_id is None:
            await self._append(approval.session_id, None, [event])
            return
        try:
            self.bus.publish(
                await self.store.set_waiting(approval.turn_id, kind == "approval.requested", [event])
            )
        except TurnClosed:
            await self._append(approval.session_id, None, [event])
            return
        if approval.status in ("allowed", "denied") and approval.turn_id not in self._turns:
            self._resumes[approval.turn_id] = approval.id  # answered after a restart: resume the turn
            self.wake(approval.session_id)

    async def _append(self, session_id: str, turn_id: str | None, events: list[NewEvent]) -> list[Event]:
        """Append, falling back to a session-level event when the turn has ended; [] without a session."""
        try:
            written = await self.store.append(session_id, turn_id, events)
        except TurnClosed:
            return await self._append(session_id, None, events)
        except SessionNotFound:
            return []
        self.bus.publish(written)
        return written


def _placed(transcript: Sequence[Message], turn_id: str) -> bool:
    return any(m.turn_id == turn_id and m.role == "user" and "placed" in m.content for m in transcript)


def _internal(exc: BaseException | None) -> dict[str, Any]:
    message = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    return {"error": {"type": "internal_error", "message": message, "retryable": False}}
