"""Running a session's tools under its permission tier (seed 001's table, `tiers.py`).

`SessionTools` is what the turn loop (and the MCP server) talks to: `offered()` lists the
tools the tier lets the model see, `call(name, args)` validates the arguments with the
tool's pydantic model, gates the call, runs it and turns every failure into an error
result (a forbidden or unknown tool, bad arguments, a crash: never an exception out of
here, except cancellation). It is also the `ToolContext` the tools receive, so it holds the
per-session state they use: the machine, the reads map, this turn's delivery count.

The gate, per call, by `decide(tier, tool.action, plan)`:

    ALLOW   run
    ASK     a pending approval (remembered for the session if the user says so); run if
            allowed, else the refusal with the user's message is the result
    FORBID  not offered; called anyway, an error result that says it cannot be approved
    STAGE   (writes) run: the tool plans operations and `commit` stages them

A call that passed the gate is pre-authorized for its own action (a context variable, so
concurrent calls don't share it): a tool that also calls `ctx.authorize` for that action
is not asked twice. Other actions a tool discovers while running (a read that turns out to
be outside the workspace) go through `authorize` on their own. `call(..., preapproved=action)`
runs a call whose question the user already answered (a turn resumed after a restart): a
question about that action is not asked again, within that call only. Approvals and change sets
name the tool as the model called it (`read_file`, `bash`), not by its canonical name.

`commit(ops, tool)` by `decide(tier, WRITE, plan)`: ALLOW applies now (`ChangeSets.apply_now`),
STAGE records the turn's change set and tells the model only ids, summaries and character
counts, FORBID refuses. Seed 004 on top: an operation outside the machine's root asks first
in `full-ask` (then is staged like any other), is refused in `workspace-write` (whose scope
is the workspace; seed 001: what the first two tiers forbid no approval allows) and applies
in `full-auto`.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError
from agentbox.store.changes import OperationRecord
from agentbox.tools.approvals import Approvals
from agentbox.tools.base import (
    Action,
    FileIds,
    FileStore,
    Operation,
    TodoStore,
    Tool,
    ToolConfig,
    ToolResult,
)
from agentbox.tools.changes import Applied, ChangeSets, Refused, describe
from agentbox.tools.fingerprint import fingerprint
from agentbox.tools.knowledge_bases import Scope, Selection
from agentbox.tools.services import MachineServices
from agentbox.tools.tiers import Decision, Tier, decide, outside_root_write
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import file_ops

log = logging.getLogger(__name__)

#: Actions the running call was already authorized for (by the gate in `call`).
_authorized: contextvars.ContextVar[frozenset[Action]] = contextvars.ContextVar(
    "agentbox_tools_authorized", default=frozenset()
)
#: The name the model called the running tool by (`bash`, not the canonical `exec`): what
#: approvals and change sets record, since it is what the user sees in the tool-use events.
_calling: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentbox_tools_calling", default=None)
#: The id the model gave the running call (`toolu_…`): what a delivered file's record names.
_tool_use: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentbox_tools_tool_use", default=None
)
#: Actions the user already allowed for the running call (an approval answered before a restart).
_preapproved: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "agentbox_tools_preapproved", default=frozenset()
)


class Delegate(Protocol):
    """What the `task` tool calls: the child's final text as a result (or, `background`, the
    id of the task it started; `resume`: an earlier run of the session continued). The agent layer implements it (`agent/subagents.py`); tools
    only hold it."""

    def __call__(
        self,
        agent: str,
        prompt: str,
        description: str = "",
        *,
        background: bool = False,
        resume: str | None = None,
    ) -> Awaitable[ToolResult]: ...


def not_permitted(tool: str, action: Action, tier: Tier, plan: bool) -> str:
    """The refusal for what a tier forbids: final, no approval changes it."""
    where = f"{tier} plan mode" if plan else str(tier)
    return (
        f"{tool} is not permitted in {where} ({action} actions are forbidden there); "
        "this cannot be approved. Continue without it or tell the user what you need."
    )


def denied(tool: str, message: str | None) -> str:
    text = f"The user denied this {tool} call."
    return f"{text} Their message: {message}" if message else text


def validation_problems(exc: ValidationError, params: type[BaseModel]) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(arguments)"
        if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
            takes = ", ".join(params.model_fields)
            lines.append(f"- {where}: no such parameter (the parameters are: {takes})")
        else:
            lines.append(f"- {where}: {error['msg']}")
    return "\n".join(lines)


@dataclass
class SessionTools:
    """One session's tools: its `ToolContext` and the dispatcher over its toolset."""

    machine: Machine | None
    """Where the tools run; None in a session without one (no file tool is offered there)."""
    session_id: str
    tier: Tier
    toolset: dict[str, Tool]
    changes: ChangeSets
    approvals: Approvals
    todos: TodoStore
    files: FileStore | None = None
    config: ToolConfig = field(default_factory=ToolConfig)
    plan: bool = False
    turn_id: str | None = None
    reads: dict[str, str] = field(default_factory=dict)
    deliveries: int = 0
    delegate: Delegate | None = None
    """Runs a subagent for the `task` tool; None = no subagents in this session."""
    services: MachineServices | None = None
    """The machine's services (the system's, set with the machine); made here when not given."""
    absent: frozenset[str] = frozenset()
    """Tools (by the names offered) with nothing to work on this turn, so not offered: the
    skill tools where there are no skills (`unused_skill_tools`)."""
    knowledge: Selection = field(default_factory=Selection)
    """The session's knowledge bases (`knowledge_bases.py`); by default the whole workspace."""
    file_ids: FileIds | None = None

    def __post_init__(self) -> None:
        if self.services is None and self.machine is not None:
            self.services = MachineServices.of(self.machine, self.session_id)

    # ------------------------------------------------------------ the turn loop's side

    def begin_turn(self, turn_id: str | None) -> None:
        """A new turn: its own change set, its own delivery count."""
        self.turn_id = turn_id
        self.deliveries = 0

    def offered(self) -> list[Tool]:
        """The tools the model may see: those that exist here and whose action this tier (and
        plan) does not forbid."""
        return [
            tool
            for name, tool in self.toolset.items()
            if self._decision(tool.action) != Decision.FORBID and self._exists(name, tool)
        ]

    def _exists(self, name: str, tool: Tool) -> bool:
        if name in self.absent:
            return False
        return tool.available is None or tool.available(self.machine, self.config)

    async def call(
        self, name: str, args: Any, *, preapproved: str | None = None, tool_use_id: str | None = None
    ) -> ToolResult:
        """Run one tool call; every outcome but cancellation is a `ToolResult`.

        `preapproved`: the action of an approval the user allowed for this very call; a
        question about it is not asked again. What the tier forbids stays refused.
        `tool_use_id`: the call's id, which the tool sees as `tool_use_id`.
        """
        token = _preapproved.set(frozenset({preapproved}) if preapproved else frozenset())
        use = _tool_use.set(tool_use_id)
        try:
            return await self._call(name, args)
        finally:
            _tool_use.reset(use)
            _preapproved.reset(token)

    @property
    def tool_use_id(self) -> str | None:
        """The running call's id (parallel calls each see their own: a context variable)."""
        return _tool_use.get()

    async def _call(self, name: str, args: Any) -> ToolResult:
        tool = self.toolset.get(name)
        if tool is None or not self._exists(name, tool):
            names = ", ".join(t.name for t in self.offered())
            return ToolResult.error(f"There is no tool named {name!r}. Available tools: {names}.")
        decision = self._decision(tool.action)
        if decision == Decision.FORBID:
            return ToolResult.error(not_permitted(name, tool.action, self.tier, self.plan))
        try:
            params = tool.params.model_validate(args)
        except ValidationError as exc:
            return ToolResult.error(f"Invalid arguments for {name}:\n{validation_problems(exc, tool.params)}")
        if decision == Decision.ASK and not tool.gates_itself:
            refusal = await self.authorize(tool.action, name, {"arguments": args})
            if refusal is not None:
                return ToolResult.error(refusal)
        token = _authorized.set(_authorized.get() | (set() if tool.gates_itself else {tool.action}))
        calling = _calling.set(name)
        try:
            return await tool.run(self, params)
        except WorkspaceError as exc:
            return ToolResult.error(exc.message)
        except Exception as exc:
            log.exception("tool %s failed in session %s", name, self.session_id)
            return ToolResult.error(f"{name} failed unexpectedly: {type(exc).__name__}: {exc}")
        finally:
            _calling.reset(calling)
            _authorized.reset(token)

    # ------------------------------------------------------------ the ToolContext side

    @property
    def scope(self) -> Scope:
        if self.machine is None:
            raise MachineError("this session has no machine")
        return self.knowledge.scope(self.machine.root)

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        if action in _authorized.get():
            return None
        tool = _calling.get() or tool
        decision = self._decision(action)
        if decision == Decision.ALLOW:
            return None
        if decision == Decision.ASK:
            return await self._ask(tool, str(action), detail)
        if decision == Decision.STAGE:
            return (
                f"In {self.tier} changes are staged for the user's review; {tool} cannot {action} directly."
            )
        return not_permitted(tool, action, self.tier, self.plan)

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        tool = _calling.get() or tool
        decision = self._decision(Action.WRITE)
        if decision == Decision.FORBID:
            return ToolResult.error(not_permitted(tool, Action.WRITE, self.tier, self.plan))
        if not operations:
            return ToolResult.error("Nothing to change.")
        machine = self.machine
        if machine is None:
            return ToolResult.error(f"{tool} needs a machine, and this session has none.")
        try:
            outside = self._outside_scope(machine, operations)
        except MachineError as exc:
            return ToolResult.error(exc.message)
        if outside:
            refusal = await self._outside_root_gate(machine, tool, operations, outside)
            if refusal is not None:
                return ToolResult.error(refusal)
        if decision == Decision.ALLOW:
            return await self._applied(machine, await self.changes.apply_now(machine, operations))
        try:
            change_set, staged = await self.changes.stage(
                machine, self.session_id, self.turn_id, tool, operations
            )
        except Refused as exc:
            return ToolResult.error(str(exc))
        return staged_result(change_set.id, staged)

    async def staged_folders(self) -> set[str]:
        if self._decision(Action.WRITE) != Decision.STAGE:
            return set()
        current = await self.changes.repo.for_turn(self.session_id, self.turn_id)
        if current is None:
            return set()
        return {op.path for op in current.pending() if op.kind == "mkdir"}

    # ------------------------------------------------------------ internals

    def _decision(self, action: Action) -> Decision:
        return decide(self.tier, action, plan=self.plan)

    async def _ask(self, tool: str, action: str, detail: dict[str, Any]) -> str | None:
        if action in _preapproved.get():
            return None
        allowed, message = await self.approvals.request_and_wait(
            self.session_id, self.turn_id, tool, action, detail
        )
        return None if allowed else denied(tool, message)

    def _outside_scope(self, machine: Machine, operations: Sequence[Operation]) -> list[str]:
        """The paths the operations touch outside the session's knowledge bases (the workspace
        root, unless the session selected others)."""
        ops, scope = file_ops(machine), self.scope
        paths = [p for op in operations for p in (op.path, op.dest) if p is not None]
        return [
            ops.absolute(p) for p in paths if not (ops.within_root(p) and scope.contains(ops.absolute(p)))
        ]

    async def _outside_root_gate(
        self, machine: Machine, tool: str, operations: Sequence[Operation], outside: list[str]
    ) -> str | None:
        decision = outside_root_write(self.tier, machine.isolated)
        if decision == Decision.ALLOW:
            return None
        where, whole = ", ".join(outside), self.whole_workspace(machine)
        own = f"the workspace root {machine.root}" if whole else self.scope_name()
        if decision == Decision.FORBID:
            return f"{where} is outside {own}; {self.tier} only changes those and this cannot be approved."
        detail = {
            "reason": "write outside the " + ("workspace root" if whole else "session's knowledge bases"),
            "root": machine.root,
            "knowledge_bases": [kb.root for kb in self.scope.chosen],
            "paths": outside,
            "operations": [
                {"kind": op.kind, "path": op.path, "dest": op.dest, "summary": describe(op),
                 "before_chars": len(op.before or ""), "after_chars": len(op.after or "")}
                for op in operations
            ],
        }  # fmt: skip
        return await self._ask(tool, str(Action.WRITE), detail)

    def whole_workspace(self, machine: Machine) -> bool:
        """Whether the session's own files are the workspace root, every knowledge base in it."""
        scope = self.scope
        return (
            scope.base.root == machine.root
            and scope.contains(machine.root)
            and all(kb.id in scope.selected for kb in scope.registered)
        )

    def scope_name(self) -> str:
        return (
            "the session's knowledge bases ("
            + ", ".join(f"{kb.id}: {kb.root}" for kb in self.scope.chosen)
            + ")"
        )

    async def _applied(self, machine: Machine, results: list[Applied]) -> ToolResult:
        for result in results:
            if result.ok:
                await self._remember(machine, result.operation)
        return applied_result(results)

    async def _remember(self, machine: Machine, op: Operation) -> None:
        """Keep the reads map (keyed like `read` does: the file's inside path, links followed)
        true after our own change: the model knows what it wrote, and what it moved is gone."""
        ops = file_ops(machine)
        if op.kind in ("write", "edit"):
            inside = ops.resolve(op.path).inside
            self.reads[inside] = await fingerprint(machine, inside)
        elif op.kind in ("move", "rename", "delete"):
            gone = ops.absolute(op.path)
            for key in [k for k in self.reads if k == gone or k.startswith(gone.rstrip("/") + "/")]:
                del self.reads[key]


#: `ToolContextImpl` is the name the tools layer's docs use for the runner's context.
ToolContextImpl = SessionTools
Runner = SessionTools


def staged_result(change_set_id: str, staged: Sequence[OperationRecord]) -> ToolResult:
    """What the model is told about staged operations: ids, summaries and character counts only."""
    lines = [f"Staged for the user's review in change set {change_set_id} (not applied yet):"]
    for op in staged:
        lines.append(f"- {op.id}: {op.summary} ({op.before_chars} → {op.after_chars} chars)")
    lines.append("The user applies or rejects each operation; refer to one by its id.")
    return ToolResult.text(
        "\n".join(lines),
        status="staged",
        change_set_id=change_set_id,
        operations=[
            {
                "id": op.id,
                "summary": op.summary,
                "before_chars": op.before_chars,
                "after_chars": op.after_chars,
            }
            for op in staged
        ],
    )


def applied_result(results: Sequence[Applied]) -> ToolResult:
    """What the model is told about operations applied at once: per operation, what happened."""
    lines = []
    for result in results:
        summary = describe(result.operation)
        if result.ok:
            lines.append(
                f"Applied: {summary}"
                + (f" (moved to the trash at {result.trash_path})" if result.trash_path else "")
            )
        else:
            lines.append(
                f"{'Failed' if result.status == 'failed' else 'Skipped'}: {summary}: {result.reason}"
            )
    data = {
        "status": "applied" if all(r.ok for r in results) else "failed",
        "operations": [
            {
                "summary": describe(r.operation),
                "status": r.status,
                "reason": r.reason,
                "trash_path": r.trash_path,
            }
            for r in results
        ],
    }
    text = "\n".join(lines)
    return ToolResult.text(text, **data) if all(r.ok for r in results) else ToolResult.error(text, **data)
