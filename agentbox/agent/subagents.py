"""Subagents: running one `task` call as a child agent.

The roster (built-ins, configuration, `.agents/agents/*.md`) is `agent/agents.py`.

What a child is (Flue a.12): a fresh agent in the parent's machine with its own, in-memory
transcript that starts with the task's prompt as the user's message. It sees none of the
parent's conversation and the parent sees only its final message. Its tools are the parent's
tools whose canonical name the agent lists, under the tier `intersect(parent, agent)`: the
intersection of its own and the parent's permissions (so `writer` under a `full-auto` parent
still only stages, and under a `read-only` parent cannot write at all). Whatever its agent file
lists, a child never runs commands, MCP tools or the browser's page-changing actions (seed
003): those are dropped, and a listed `browser` is given as `browser_read`. Changes it stages,
approvals it asks for and files it delivers belong to the parent's turn. Images its tools
return are shown to its model as a turn's are (`agent.vision`: fitted, budgeted, or
`visionUnavailable` when its model has no vision); a stored run keeps them in the image store,
named by id in its rows as a turn's are, so a resumed child is shown them again.

Limits: `MAX_DEPTH` (Flue's delegation depth: the root is depth 0 and an agent at depth
`max_depth` cannot delegate; `task` stays offered to agents that list it, with a static schema
as Flue keeps it, and answers with the limit), `MAX_PARALLEL_READ_ONLY` read-only tasks at once
in one session's whole tree (seed 001), one task that may change things at a time, and
`MAX_CHILD_STEPS` model calls per child run. A task nested inside a running task takes no
second slot: it runs inside its ancestor's, which is waiting for it (so chains of delegation
cannot deadlock on the slots their ancestors hold).

Which task call a child belongs to: its tool_use_id, taken from the context variable set by
`calling(tool_use_id)` around the call (the turn's tool host wraps each call; the child loop
does so itself). A context variable, because parallel calls each see their own.

Background tasks (`task` with `background: true`): the call returns at once with the task's
id (its tool_use_id) and the parent goes on; the child runs as an asyncio task of the
session's `BackgroundTasks`, in a read-only slot like any read-only task (the slots are the
session's, so tasks left running by an earlier turn count). Only the session's own agent may
start one, only for an agent that cannot change anything (`read_only`: a writer's change sets
need the turn that reviews them), and at most `MAX_BACKGROUND_TASKS` run at once per session.
An approval it asks for (a researcher's web access under `full-ask`) is the session's, not
the turn's: it may outlive the turn, and a question of its own must not mark the turn that
goes on as waiting. When it finishes, its `subagent.completed` event (`background: true`,
`result`) goes to the session's log and a `Notice` waits in `BackgroundTasks.notices`; the
worker tells it to the model as a `task` signal at the next step boundary of the running
turn, or at the start of the next turn.
A background task runs in the server's memory, but what it owes its parent is kept: its run
records that a notice is pending until the parent is told, and the result the notice carries.
A restart cancels the task (as it cancels a foreground task with its turn); the next start
marks its run `interrupted` and tells the parent, as a `subagent.completed` event at once and a
`task` signal at the next boundary (`INTERRUPTED_NOTICE`: resume it, or start it anew). A notice
of a task that finished but was not told before a restart is told after it. Deleting the
session cancels its tasks with everything else.

Durable runs (`runs`, the store's `SubagentRuns`; the worker always gives it): each child's
transcript is written as it grows, under a run id (`sub_...`) that its `subagent.started` /
`subagent.completed` events carry and its answer ends with (`RUN_TRAILER`), and the sessions
API reads it. `task` with `resume: <run id>` continues that run: the same agent, its own
conversation, the new prompt as its next message. A resume is refused for a run of another
session (it is not found), for another agent's run, for a run still running, and when the
permissions it would run under are narrower than those it ran under (a lower intersected
tier, or plan mode since): what it learned and planned assumed the wider ones. A run cut
short (its turn aborted, a shutdown, a crash: `SubagentRuns.interrupt_running` at start) ends
`interrupted` and can be resumed, as can a `failed` one.

How a child run ends (never an exception out of `__call__`, except cancellation):

    completed   a reply without tool calls: its text is the result (`NO_TEXT` if empty)
    max_steps   `MAX_CHILD_STEPS` model calls without finishing: an error result with the last text
    failed      the model raised: an error result `The <agent> agent failed: ...`
    interrupted cancelled (its turn aborted, the server stopping): the run is marked, the
                cancellation goes on
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from agentbox.agent import prompt as prompt_mod
from agentbox.agent.agents import AgentSpec, canonical_tool, miss, roster
from agentbox.agent.loop import side_events
from agentbox.agent.mcp_tools import PREFIX as MCP_PREFIX
from agentbox.agent.models import ChatMessage, Model, ModelError, ModelRequest, Reply, ToolCall, ToolSpec
from agentbox.agent.providers.arguments import invalid_arguments
from agentbox.agent.vision import Vision, budget, load_parts, newest_only, recorded, shown_parts
from agentbox.store.images import ImageStore
from agentbox.store.sessions import NewEvent
from agentbox.store.subagents import RunMessage, RunStatus, SubagentRun, SubagentRunNotFound, SubagentRuns
from agentbox.tools.base import Action, TextBlock, Tool, ToolResult
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import ORDER, Tier, intersect

log = logging.getLogger(__name__)

#: Flue's delegation depth cap: the root agent is depth 0; an agent at this depth cannot delegate.
MAX_DEPTH = 4
#: The actions no child is given, whatever its agent file lists: commands and MCP tools
#: (an MCP tool is dropped by its name too, even one a trusted server marks read-only).
NEVER_DELEGATED = frozenset({Action.EXEC, Action.MCP})
#: Tools a child gets only the looking part of: the page-changing browser becomes its reads.
DELEGATED_AS = {"browser": "browser_read"}
#: Read-only tasks running at once in one session's tree of agents (seed 001).
MAX_PARALLEL_READ_ONLY = 3
#: Model calls one child run may make before it stops with status `max_steps`.
MAX_CHILD_STEPS = 50
#: Background tasks (`task` with `background: true`) one session may have running at once.
MAX_BACKGROUND_TASKS = 4
NO_TEXT = "(task completed with no text)"
#: What a stored run's answer ends with, so the agent that delegated can resume it.
RUN_TRAILER = "[task id: {id}; to continue this agent's work where it stopped, call task with resume={id}]"

#: What a background task cut short by a restart tells its parent.
INTERRUPTED_NOTICE = (
    "The server stopped while this task ran, so it did not finish. To continue its work where it "
    "stopped, call task with agent {agent!r} and resume={id}; or start it anew."
)

Status = Literal["completed", "failed", "max_steps"]
Emit = Callable[[list[NewEvent]], Awaitable[Any]]
#: Keeps one new message of a child's conversation.
Journal = Callable[[ChatMessage, Sequence[Mapping[str, Any]]], Awaitable[None]]

#: The tool_use_id of the tool call running in this context (see `calling`).
_tool_use_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentbox_tool_use_id", default=None
)
#: Whether this context runs inside a task that holds a slot (a read-only slot or the writer lock).
_inside_task: contextvars.ContextVar[bool] = contextvars.ContextVar("agentbox_inside_task", default=False)


def running_call() -> str | None:
    """The tool_use_id of the tool call running in this context (None outside one)."""
    return _tool_use_id.get()


@contextlib.contextmanager
def calling(tool_use_id: str) -> Iterator[None]:
    """Mark the tool call running in this context, so a `task` call knows its own id."""
    token = _tool_use_id.set(tool_use_id)
    try:
        yield
    finally:
        _tool_use_id.reset(token)


# ---------------------------------------------------------------- background tasks


@dataclass(frozen=True)
class Notice:
    """A background task that finished, for the model to be told at the next step boundary."""

    task_id: str
    agent: str
    status: RunStatus
    result: str
    """The child's final message, or why it failed."""
    run_id: str | None = None
    """Its stored run, marked told once the notice is (None where runs are not kept)."""


class BackgroundTasks:
    """One session's background tasks: those running, and the notices not yet told.

    Kept by the worker per session, across that session's turns: a task outlives the turn
    that started it. `semaphore` holds the session's read-only task slots
    (`MAX_PARALLEL_READ_ONLY`), shared by every turn's `Subagents`, so that tasks still
    running from an earlier turn count.
    """

    def __init__(self, limit: int = MAX_BACKGROUND_TASKS) -> None:
        self.limit = limit
        self.running: dict[str, asyncio.Task[None]] = {}
        self.notices: list[Notice] = []
        self.semaphore = asyncio.Semaphore(MAX_PARALLEL_READ_ONLY)

    def full(self) -> bool:
        return len(self.running) >= self.limit

    def start(self, task_id: str, work: Awaitable[Notice]) -> None:
        async def run() -> None:
            try:
                notice = await work
            finally:
                self.running.pop(task_id, None)
            self.notices.append(notice)

        self.running[task_id] = asyncio.get_running_loop().create_task(run(), name=f"background-{task_id}")

    def take(self) -> list[Notice]:
        """The notices not yet told, oldest first; they are the caller's now."""
        taken, self.notices = self.notices, []
        return taken

    def give_back(self, notices: Sequence[Notice]) -> None:
        """Notices taken but not told (the turn ended first): told at the next boundary."""
        self.notices[:0] = notices

    async def close(self) -> None:
        """Cancel what still runs (a restart or the session's end); wait for it to stop."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------- running a task


class Subagents:
    """The `delegate` of one agent's `SessionTools`: runs `task` calls as child agents.

    Built once per parent turn (depth 0) by the worker; each child that may delegate gets its
    own, one level deeper, sharing the roster, the slots and the lock of the whole tree.
    """

    def __init__(
        self,
        *,
        agents: Mapping[str, AgentSpec],
        parent: SessionTools,
        canonical: Mapping[str, str],
        models: Callable[[AgentSpec], Model],
        emit: Emit,
        system_facts: str = "",
        depth: int = 0,
        max_depth: int = MAX_DEPTH,
        task_path: tuple[str, ...] = (),
        semaphore: asyncio.Semaphore | None = None,
        writer_lock: asyncio.Lock | None = None,
        max_steps: int = MAX_CHILD_STEPS,
        vision: Callable[[AgentSpec], Vision] | None = None,
        background: BackgroundTasks | None = None,
        runs: SubagentRuns | None = None,
        images: ImageStore | None = None,
    ) -> None:
        self.agents, self.parent, self.canonical = agents, parent, canonical
        self.models, self.emit, self.system_facts = models, emit, system_facts
        self.vision = vision
        """Whether an agent's model is shown images (None: every model is)."""
        self.depth, self.max_depth, self.task_path = depth, max_depth, task_path
        self.semaphore = semaphore or asyncio.Semaphore(MAX_PARALLEL_READ_ONLY)
        """Read-only task slots, shared by the whole tree."""
        self.writer_lock = writer_lock or asyncio.Lock()
        """Held by a task that may change things, shared by the whole tree."""
        self.max_steps = max_steps
        self.background = background
        """The session's background tasks; None: `background: true` is refused."""
        self.runs = runs
        """Where children's transcripts are kept; None: kept in memory only, never resumable."""
        self.images = images
        """Where a kept transcript's images go, so a resumed child sees them again (None: only
        their labels are kept)."""
        self._unnamed = itertools.count(1)

    def read_only(self, agent: str) -> bool:
        """Whether a task for `agent` cannot change anything, so it may run beside others.

        Unknown names are (their call returns a miss at once); so is any agent under a
        read-only or plan-mode parent, whose tier forbids writes and commands to all below it.
        """
        spec = self.agents.get(agent.strip())
        if spec is None or spec.read_only or self.parent.plan:
            return True
        return intersect(self.parent.tier, spec.tier) == Tier.READ_ONLY

    async def __call__(
        self,
        agent: str,
        prompt: str,
        description: str = "",
        *,
        background: bool = False,
        resume: str | None = None,
    ) -> ToolResult:
        spec = self.agents.get(agent.strip())
        if spec is None:
            return ToolResult.error(miss(agent, self.agents))
        if self.depth >= self.max_depth:
            return ToolResult.error(
                f"The delegation depth limit {self.max_depth} was reached: this agent runs at depth "
                f"{self.depth} and cannot delegate further. Do the task yourself."
            )
        resumed = None
        if resume is not None:
            if background:
                return ToolResult.error(
                    "A resumed task runs in the foreground: call it without `background`."
                )
            found = await self.resumable(spec, resume)
            if isinstance(found, str):
                return ToolResult.error(found)
            resumed = found
        if background:
            return self.start_background(spec, prompt, description)
        call_id = self._call_id()
        if _inside_task.get():  # nested: runs in the slot its ancestor holds and waits with
            return await self._run(spec, call_id, prompt, description, resumed=resumed)
        guard: contextlib.AbstractAsyncContextManager[Any] = (
            self.semaphore if self.read_only(spec.name) else self.writer_lock
        )
        async with guard:
            token = _inside_task.set(True)
            try:
                return await self._run(spec, call_id, prompt, description, resumed=resumed)
            finally:
                _inside_task.reset(token)

    async def resumable(self, spec: AgentSpec, run_id: str) -> SubagentRun | str:
        """The stored run `run_id` if `spec` may continue it here, else why not (see the module docstring)."""
        if self.runs is None:
            return "Tasks are not kept in this session, so none can be resumed."
        try:
            run = await self.runs.get(self.parent.session_id, run_id.strip())
        except SubagentRunNotFound:
            return f"No task {run_id} in this session to resume."
        if run.agent != spec.name:
            return f"Task {run.id} was the {run.agent} agent's; resume it with agent {run.agent!r}."
        if run.status == "running":
            return f"Task {run.id} is still running; wait for it to finish before resuming it."
        now = intersect(self.parent.tier, spec.tier)
        if ORDER.index(now) < ORDER.index(Tier(run.tier)) or (self.parent.plan and not run.plan):
            was = f"{run.tier}{' plan' if run.plan else ''}"
            return (
                f"Task {run.id} ran under {was}, and this session's permissions are narrower now "
                f"({now}{' plan' if self.parent.plan else ''}): start a new task instead of resuming it."
            )
        return run

    def start_background(self, spec: AgentSpec, prompt: str, description: str) -> ToolResult:
        """Start `spec` as a background task and answer at once with its id (see the module
        docstring); an error result when it may not run in the background."""
        if self.background is None or self.depth > 0 or _inside_task.get():
            return ToolResult.error("Only the session's own agent can start background tasks.")
        if not self.read_only(spec.name):
            return ToolResult.error(
                f"The {spec.name} agent can change files, so it cannot run in the background: "
                "call it without `background`."
            )
        if self.background.full():
            return ToolResult.error(
                f"{self.background.limit} background tasks are already running in this session, the most "
                "at once: wait for one to finish, or call this one without `background`."
            )
        task_id = self._call_id()

        async def work() -> Notice:
            async with self.semaphore:
                token = _inside_task.set(True)
                try:
                    result = await self._run(spec, task_id, prompt, description, background=True)
                finally:
                    _inside_task.reset(token)
            return Notice(
                task_id, spec.name, result.data.get("status", "failed"), result.as_text(),
                result.data.get("subagent_id"),
            )  # fmt: skip

        self.background.start(task_id, work())
        return ToolResult.text(
            f"Started background task {task_id} ({spec.name}). Go on with your work: its final message "
            "will arrive as a task signal when it finishes.",
            task_id=task_id, agent=spec.name, status="running",
        )  # fmt: skip

    def _call_id(self) -> str:
        """The tool_use_id of the running `task` call (see the module docstring)."""
        return _tool_use_id.get() or f"task_{self.depth}_{next(self._unnamed)}"

    async def _run(
        self,
        spec: AgentSpec,
        call_id: str,
        prompt: str,
        description: str,
        *,
        background: bool = False,
        resumed: SubagentRun | None = None,
    ) -> ToolResult:
        path = (*self.task_path, call_id)
        tools = self.child_tools(spec, path)
        model = self.models(spec)
        vision = self.vision(spec) if self.vision is not None else Vision(model.name)
        stored, history = await self.open_run(spec, call_id, tools, resumed, background, vision)
        if (
            background
        ):  # it outlives the turn: what it asks is the session's, and leaves the turn's status alone
            tools.turn_id = None
        started = {
            "tool_use_id": call_id, "agent": spec.name, "description": description,
            "depth": self.depth + 1, "task_path": list(path),
        }  # fmt: skip
        if stored is not None:
            started.update(subagent_id=stored, **({"resumed": True} if resumed is not None else {}))
        await self.emit(
            [NewEvent("subagent.started", {**started, **({"background": True} if background else {})})]
        )
        delivered = tools.deliveries
        run = ChildRun(
            spec=spec,
            tools=tools,
            model=model,
            vision=vision,
            system=self.child_system(spec, tools),
            task_path=path,
            emit=self.emit,
            max_steps=self.max_steps,
            journal=self.journal(stored) if stored is not None else None,
            images=self.images if stored is not None else None,
        )
        try:
            result = await run.run(prompt, history)
        except asyncio.CancelledError:  # aborted with its turn, or shut down: it ended, unfinished
            # A background run stays `running`: the next start interrupts it and tells its parent.
            if stored is not None and self.runs is not None and not background:
                with contextlib.suppress(Exception):  # the database is closing: the next start settles it
                    await asyncio.shield(self.runs.set_status(stored, "interrupted"))
            raise
        self.parent.deliveries += tools.deliveries - delivered
        completed = {
            "tool_use_id": call_id, "agent": spec.name, "status": run.status, "steps": run.steps,
            "output_chars": len(result.as_text()), "task_path": list(path),
        }  # fmt: skip
        answer = result.as_text()
        if stored is not None and self.runs is not None:
            completed["subagent_id"] = stored
            result = ToolResult(
                [*result.content, TextBlock(RUN_TRAILER.format(id=stored))],
                result.is_error,
                {**result.data, "subagent_id": stored},
            )
            await self.runs.set_status(stored, run.status, result=result.as_text() if background else None)
        if background:  # no tool result carries its answer: the client reads it here
            completed.update(background=True, result=answer)
        await self.emit([NewEvent("subagent.completed", completed)])
        return result

    async def open_run(
        self,
        spec: AgentSpec,
        call_id: str,
        tools: SessionTools,
        resumed: SubagentRun | None,
        background: bool,
        vision: Vision,
    ) -> tuple[str | None, list[ChatMessage]]:
        """(the stored run's id, the conversation it continues): a new run, or the resumed one
        moved to this turn; (None, []) where runs are not kept."""
        if self.runs is None:
            return None, []
        if resumed is not None:
            await self.runs.set_status(resumed.id, "running", tools.turn_id)
            return resumed.id, await self.history(await self.runs.messages(resumed.id), vision)
        run = await self.runs.create(
            tools.session_id, tools.turn_id, call_id, spec.name, tools.tier.value, tools.plan, background
        )
        return run.id, []

    async def history(self, rows: Sequence[RunMessage], vision: Vision) -> list[ChatMessage]:
        """A stored conversation as the resumed child's model is shown it: its results' images
        read back from the store, the newest `MAX_IMAGES_PER_REQUEST` only, as a turn's are."""
        kept = newest_only([row.content.get("blocks") for row in rows])
        messages = []
        for row, blocks in zip(rows, kept, strict=True):
            message = message_of(row.role, row.content)
            if blocks and self.images is not None:
                message = replace(message, parts=await load_parts(blocks, vision, self.images))
            messages.append(message)
        return messages

    def journal(self, run_id: str) -> Journal:
        runs = self.runs
        assert runs is not None

        async def record(message: ChatMessage, blocks: Sequence[Mapping[str, Any]]) -> None:
            await runs.append(run_id, message.role, message_content(message, blocks))

        return record

    def child_tools(self, spec: AgentSpec, path: tuple[str, ...]) -> SessionTools:
        """The child's `SessionTools`: the parent's tools it lists and may be given (never
        `NEVER_DELEGATED`), under the intersected tier."""
        listed = {DELEGATED_AS.get(name, name) for name in spec.tools}
        toolset = {
            shown: tool
            for shown, tool in self.parent.toolset.items()
            if self.canonical.get(shown, shown) in listed
            and delegable(self.canonical.get(shown, shown), tool)
        }
        toolset.update(self.narrowed(listed))
        child = replace(
            self.parent,
            tier=intersect(self.parent.tier, spec.tier),
            toolset=toolset,
            reads={},
            delegate=None,
        )
        if any(self.canonical.get(shown, shown) == "task" for shown in toolset):
            child.delegate = Subagents(
                agents=self.agents, parent=child, canonical=self.canonical, models=self.models,
                emit=self.emit, system_facts=self.system_facts, depth=self.depth + 1,
                max_depth=self.max_depth, task_path=path, semaphore=self.semaphore,
                writer_lock=self.writer_lock, max_steps=self.max_steps, vision=self.vision, runs=self.runs,
                images=self.images,
            )  # fmt: skip
        return child

    def narrowed(self, listed: Iterable[str]) -> dict[str, Tool]:
        """The parts of the parent's tools the child lists (`Tool.narrows`), under the parent's names."""
        parts: dict[str, Tool] = {}
        by_canonical = {self.canonical.get(shown, shown): shown for shown in self.parent.toolset}
        for canonical in listed:
            part = canonical_tool(canonical)
            if part is not None and part.narrows in by_canonical:
                shown = by_canonical[part.narrows]
                parts[shown] = part.renamed(shown)
        return parts

    def child_system(self, spec: AgentSpec, tools: SessionTools) -> str:
        """The child's system prompt: its instructions, the roster if it may delegate, the facts."""
        roster_part = prompt_mod.agents_section(roster(self.agents)) if tools.delegate is not None else ""
        return "\n\n".join(part for part in (spec.instructions, roster_part, self.system_facts) if part)


def message_content(message: ChatMessage, blocks: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A child's message as its stored row's content (`store/subagents.py`); `blocks`: a result
    that showed images, its texts and images by id (`agent.vision.stored_blocks`)."""
    return {
        "text": message.text,
        "tool_calls": [{"id": c.id, "name": c.name, "input": c.input} for c in message.tool_calls],
        "tool_use_id": message.tool_use_id,
        "is_error": message.is_error,
        **({"blocks": [dict(b) for b in blocks]} if blocks else {}),
    }


def message_of(role: Literal["user", "assistant", "tool"], content: Mapping[str, Any]) -> ChatMessage:
    calls = [ToolCall(c["id"], c["name"], c["input"]) for c in content.get("tool_calls") or []]
    return ChatMessage(
        role, str(content.get("text", "")), calls, content.get("tool_use_id"), bool(content.get("is_error"))
    )


def delegable(canonical: str, tool: Tool) -> bool:
    """Whether a child may be given `tool` at all (see `NEVER_DELEGATED`)."""
    return tool.action not in NEVER_DELEGATED and not canonical.startswith(f"{MCP_PREFIX}__")


@dataclass
class ChildRun:
    """One child's loop, in memory: query, run the tools it asks for (in order), until it answers."""

    spec: AgentSpec
    tools: SessionTools
    model: Model
    system: str
    task_path: tuple[str, ...]
    emit: Emit
    max_steps: int = MAX_CHILD_STEPS
    vision: Vision = field(default_factory=lambda: Vision(""))
    """Whether its model is shown its results' images (kept in memory, fitted as a turn's are)."""
    journal: Journal | None = None
    """Where each new message is kept as it is made (a stored run); None: memory only."""
    images: ImageStore | None = None
    """Where a kept run's result images go (with the journal); None: they stay in memory."""
    messages: list[ChatMessage] = field(default_factory=list)
    steps: int = 0
    """Model calls made (also the `call_index` of the next one)."""
    status: Status = "completed"

    async def run(self, prompt: str, history: Sequence[ChatMessage] = ()) -> ToolResult:
        """The child's final text as the result; failures are error results (cancellation raises).
        `history`: the conversation a resumed run continues."""
        self.messages = list(history)
        last = ""
        try:
            await self.add(ChatMessage("user", prompt))
            while self.steps < self.max_steps:
                reply = await self.query()
                if not reply.tool_calls:
                    return ToolResult.text(reply.text or NO_TEXT, agent=self.spec.name, status="completed")
                last = reply.text or last
                await self.execute(reply.tool_calls)
        except ModelError as exc:
            return self.failed(str(exc))
        except Exception as exc:  # a provider bug must not fail the parent's turn
            log.exception("subagent %s crashed", self.spec.name)
            return self.failed(f"{type(exc).__name__}: {exc}")
        self.status = "max_steps"
        text = f"The {self.spec.name} agent stopped after {self.steps} model calls without finishing."
        if last:
            text += f" Its last message:\n{last}"
        return ToolResult.error(text, agent=self.spec.name, status="max_steps")

    def failed(self, why: str) -> ToolResult:
        self.status = "failed"
        return ToolResult.error(
            f"The {self.spec.name} agent failed: {why}", agent=self.spec.name, status="failed"
        )

    async def query(self) -> Reply:
        request = ModelRequest(
            self.system,
            budget(self.messages),
            [ToolSpec(t.name, t.description, t.schema()) for t in self.tools.offered()],
            call_index=self.steps,
            task_path=self.task_path,
        )
        self.steps += 1
        started = time.monotonic()
        reply = await self.model.query(request)
        await self.emit([NewEvent("model.usage", {
            "model": self.model.name, "input_tokens": reply.usage.input_tokens,
            "output_tokens": reply.usage.output_tokens,
            "latency_ms": round((time.monotonic() - started) * 1000),
            "agent": self.spec.name, "task_path": list(self.task_path),
        })])  # fmt: skip
        await self.add(ChatMessage("assistant", reply.text, list(reply.tool_calls)))
        return reply

    async def add(self, message: ChatMessage, blocks: Sequence[Mapping[str, Any]] = ()) -> None:
        self.messages.append(message)
        if self.journal is not None:
            await self.journal(message, blocks)

    async def execute(self, calls: Sequence[ToolCall]) -> None:
        for call in calls:
            result = await self.call(call)
            events = side_events(result)
            if events:
                await self.emit(events)
            blocks: list[dict[str, Any]] = []
            if self.images is not None:  # kept: its images go to the store, so a resume shows them
                text, blocks = await recorded(result, self.vision, self.images)
                parts = await load_parts(blocks, self.vision, self.images) if blocks else ()
            else:
                text, parts = await shown_parts(result.content, self.vision)
            await self.add(
                ChatMessage("tool", text, tool_use_id=call.id, is_error=result.is_error, parts=parts),
                blocks,
            )

    async def call(self, call: ToolCall) -> ToolResult:
        problem = invalid_arguments(call)
        if problem is not None:
            return ToolResult.error(problem)
        with calling(call.id):
            return await self.tools.call(call.name, call.input, tool_use_id=call.id)
