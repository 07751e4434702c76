"""Subagents on real parts: `task` through a real `SessionTools` (real tools on a `LocalMachine`
over a tmp dir, change sets and approvals in a real SQLite file), children driven by the
scripted model's nested scripts; the roster loaded from real `.agents/agents/*.md` files.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.agents import (
    AGENTS_DIR,
    BUILTIN_AGENTS,
    EXPLORE_TOOLS,
    MAX_AGENT_FILE_BYTES,
    MAX_AGENT_FILES,
    MAX_DESCRIPTION_CHARS,
    AgentSpec,
    canonical_names,
    canonical_tool,
    load_agents,
    parse_agent,
    roster,
)
from agentbox.agent.models import (
    ModelRequest,
    Reply,
    ScriptedModel,
    ScriptError,
    check_script,
)
from agentbox.agent.prompt import Subagent
from agentbox.agent.subagents import (
    MAX_CHILD_STEPS,
    MAX_DEPTH,
    MAX_PARALLEL_READ_ONLY,
    NO_TEXT,
    BackgroundTasks,
    Subagents,
    calling,
)
from agentbox.machines.local import LocalMachine
from agentbox.machines.ssh import SshMachine
from agentbox.store.approvals import ApprovalsRepo
from agentbox.store.changes import ChangesRepo
from agentbox.store.db import Database
from agentbox.store.sessions import NewEvent
from agentbox.store.todos import TodoRepo
from agentbox.tools.approvals import Approvals
from agentbox.tools.base import Action, ToolResult
from agentbox.tools.changes import ChangeSets
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import Tier
from agentbox.tools.toolsets import toolset

#: Seconds a test waits for a condition before failing.
DEADLINE = 20.0
SESSION = "ses_sub"
TURN = "trn_sub"
#: Latency of a scripted child reply where a test needs children to overlap if nothing stops them.
LATENCY_MS = 50


# ---------------------------------------------------------------- fixtures and helpers


class Events:
    """The `emit` of a test: keeps what subagents append to the parent's turn."""

    def __init__(self) -> None:
        self.events: list[NewEvent] = []

    async def __call__(self, events: list[NewEvent]) -> None:
        self.events.extend(events)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.type == kind]

    def peak(self) -> int:
        """The most top-level child runs that were running at once (started, not yet completed)."""
        running = best = 0
        for event in self.events:
            if len(event.data.get("task_path", ())) != 1:
                continue
            if event.type == "subagent.started":
                running += 1
                best = max(best, running)
            elif event.type == "subagent.completed":
                running -= 1
        return best


class Recording:
    """A model that records the requests it answers (the inner model answers them)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        self.requests: list[ModelRequest] = []

    async def query(self, request: ModelRequest) -> Reply:
        self.requests.append(request)
        reply: Reply = await self.inner.query(request)
        return reply

    def offered(self, task_path: tuple[str, ...]) -> set[str]:
        return {t.name for r in self.requests if r.task_path == task_path for t in r.tools}


class Gate:
    """A model that counts the queries in flight and holds each until `width` are in flight (or
    fewer remain of `total`): a limit below `width` times out, one above it shows in `peak`."""

    def __init__(self, inner: Any, width: int, total: int) -> None:
        self.inner, self.name = inner, inner.name
        self.width, self.total = width, total
        self.now = self.done = self.peak = 0
        self.changed = asyncio.Condition()

    async def query(self, request: ModelRequest) -> Reply:
        async with self.changed:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.changed.notify_all()
            await asyncio.wait_for(
                self.changed.wait_for(lambda: self.now >= min(self.width, self.total - self.done)), DEADLINE
            )
        try:
            reply: Reply = await self.inner.query(request)
            return reply
        finally:
            async with self.changed:
                self.now -= 1
                self.done += 1
                self.changed.notify_all()


def session_tools(machine: Any, db: Database, tier: Tier, *, plan: bool = False) -> SessionTools:
    return SessionTools(
        machine=machine,
        session_id=SESSION,
        tier=tier,
        toolset=toolset("default"),
        changes=ChangeSets(ChangesRepo(db)),
        approvals=Approvals(ApprovalsRepo(db)),
        todos=TodoRepo(db),
        plan=plan,
        turn_id=TURN,
    )


def delegate(
    tools: SessionTools, model: Any, events: Events, agents: dict[str, AgentSpec] | None = None, **kwargs: Any
) -> Subagents:
    subagents = Subagents(
        agents=BUILTIN_AGENTS if agents is None else agents,
        parent=tools,
        canonical=canonical_names("default"),
        models=lambda spec: model,
        emit=events,
        system_facts="Date: 2025-01-01",
        **kwargs,
    )
    tools.delegate = subagents
    return subagents


async def task(tools: SessionTools, call_id: str, agent: str, prompt: str = "go") -> ToolResult:
    """The parent's `task` call `call_id`, through its real tool (as the parent's loop makes it)."""
    with calling(call_id):
        return await tools.call("task", {"agent": agent, "prompt": prompt, "description": f"{agent} job"})


def task_call(agent: str, script: Sequence[Any]) -> dict[str, Any]:
    return {"name": "task", "input": {"agent": agent, "prompt": "go"}, "script": list(script)}


def root(*calls: dict[str, Any]) -> ScriptedModel:
    """A session script whose first reply makes `calls` (ids toolu_s0_0, toolu_s0_1, ...)."""
    return ScriptedModel([{"tool_calls": list(calls)}])


def write_agent(ws: Path, name: str, text: str) -> Path:
    folder = ws / AGENTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


DEEP = "---\ndescription: Delegates to itself.\ntools: [read, task]\n---\nKeep delegating.\n"


# ---------------------------------------------------------------- the task tool and misses


async def test_task_without_subagents_says_so(machine: LocalMachine, db: Database) -> None:
    tools = session_tools(machine, db, Tier.FULL_AUTO)
    result = await task(tools, "toolu_s0_0", "explore")
    assert result.is_error and result.as_text() == "Subagents are not available in this session."


async def test_unknown_agent_is_a_factual_miss_listing_the_roster(
    machine: LocalMachine, db: Database
) -> None:
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(), events)
    result = await task(tools, "toolu_s0_0", "nobody")
    assert result.is_error
    assert (
        result.as_text()
        == 'Subagent "nobody" is not declared. Available subagents: explore, researcher, writer.'
    )
    assert events.events == []


async def test_only_the_final_text_returns_and_each_child_call_reports_usage(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    (ws / "a.txt").write_text("alpha\n")
    child = [
        {
            "text": "Let me look around first.",
            "tool_calls": [{"name": "glob", "input": {"pattern": "*.txt"}}],
        },
        {"expect": {"tool_result_contains": "a.txt"}, "text": "Found a.txt."},
    ]
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    model = Recording(root(task_call("explore", child)))
    delegate(tools, model, events)
    result = await task(tools, "toolu_s0_0", "explore", "Which text files are there?")
    assert not result.is_error and result.as_text() == "Found a.txt."
    # the child started fresh: the task's prompt is its only user message, its own system prompt
    first = model.requests[0]
    assert [(m.role, m.text) for m in first.messages] == [("user", "Which text files are there?")]
    assert first.system.startswith("You are explore") and first.system.endswith("Date: 2025-01-01")
    assert [r.call_index for r in model.requests] == [0, 1]
    assert events.of("subagent.started") == [{
        "tool_use_id": "toolu_s0_0", "agent": "explore", "description": "explore job", "depth": 1,
        "task_path": ["toolu_s0_0"],
    }]  # fmt: skip
    assert events.of("subagent.completed") == [{
        "tool_use_id": "toolu_s0_0", "agent": "explore", "status": "completed", "steps": 2,
        "output_chars": len("Found a.txt."), "task_path": ["toolu_s0_0"],
    }]  # fmt: skip
    usage = events.of("model.usage")
    assert len(usage) == 2 and all(u["agent"] == "explore" and u["model"] == "scripted" for u in usage)
    assert all(u["input_tokens"] > 0 for u in usage)


async def test_an_empty_final_reply_says_so(machine: LocalMachine, db: Database) -> None:
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(task_call("explore", [{"text": ""}])), events)
    result = await task(tools, "toolu_s0_0", "explore")
    assert not result.is_error and result.as_text() == NO_TEXT


async def test_a_model_error_in_the_child_is_an_error_result(machine: LocalMachine, db: Database) -> None:
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(task_call("explore", [{"error": "overloaded"}]), {"name": "task"}), events)
    result = await task(tools, "toolu_s0_0", "explore")
    assert result.is_error and result.as_text().startswith(
        "The explore agent failed: scripted step 0: overloaded"
    )
    # the second call of the script has no `script`: the scripted model says which call lacks one
    missing = await task(tools, "toolu_s0_1", "explore")
    assert missing.is_error and "no script for the subagent of call toolu_s0_1" in missing.as_text()
    assert [e["status"] for e in events.of("subagent.completed")] == ["failed", "failed"]


@pytest.mark.parametrize("tool_steps", [MAX_CHILD_STEPS - 1, MAX_CHILD_STEPS])
async def test_a_child_stops_after_max_child_steps(
    machine: LocalMachine, db: Database, tool_steps: int
) -> None:
    looking = {"text": "still looking", "tool_calls": [{"name": "glob", "input": {"pattern": "*"}}]}
    child = [looking] * tool_steps + [{"text": "done"}]
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(task_call("explore", child)), events)
    result = await task(tools, "toolu_s0_0", "explore")
    (completed,) = events.of("subagent.completed")
    assert completed["steps"] == MAX_CHILD_STEPS
    if tool_steps < MAX_CHILD_STEPS:
        assert not result.is_error and result.as_text() == "done" and completed["status"] == "completed"
    else:
        assert result.is_error and completed["status"] == "max_steps"
        assert result.as_text() == (
            f"The explore agent stopped after {MAX_CHILD_STEPS} model calls without finishing. "
            "Its last message:\nstill looking"
        )


async def test_the_call_id_comes_from_the_running_call(machine: LocalMachine, db: Database) -> None:
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(task_call("explore", [{"text": "ok"}])), events)
    with calling("toolu_s0_0"):
        result = await tools.call("task", {"agent": "explore", "prompt": "go"})
    assert result.as_text() == "ok" and events.of("subagent.started")[0]["tool_use_id"] == "toolu_s0_0"


# ---------------------------------------------------------------- depth


def chain(level: int, limit: int) -> list[dict[str, Any]]:
    """The script of the self-delegating `deep` agent at depth `level`."""
    if level == limit:
        return [
            {"tool_calls": [task_call("deep", [])]},
            {
                "expect": {"tool_result_contains": f"delegation depth limit {limit} was reached"},
                "text": "refused",
            },
        ]
    return [
        {"tool_calls": [task_call("deep", chain(level + 1, limit))]},
        {
            "expect": {"tool_result_contains": "refused" if level + 1 == limit else "done"},
            "text": f"done {level}",
        },
    ]


@pytest.mark.parametrize("limit", [MAX_DEPTH, 2])
async def test_delegation_stops_at_the_depth_limit(
    machine: LocalMachine, db: Database, ws: Path, limit: int
) -> None:
    write_agent(ws, "deep.md", DEEP)
    agents = (await load_agents(machine)).agents
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    kwargs = {} if limit == MAX_DEPTH else {"max_depth": limit}
    delegate(tools, Recording(root(task_call("deep", chain(1, limit)))), events, agents, **kwargs)
    result = await asyncio.wait_for(task(tools, "toolu_s0_0", "deep"), DEADLINE)
    assert not result.is_error and result.as_text() == "done 1"
    started = events.of("subagent.started")
    assert [s["depth"] for s in started] == list(range(1, limit + 1))
    assert [len(s["task_path"]) for s in started] == list(range(1, limit + 1))
    assert all(c["status"] == "completed" for c in events.of("subagent.completed"))


async def test_an_agent_at_the_depth_limit_cannot_delegate_at_all(
    machine: LocalMachine, db: Database
) -> None:
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, root(), events, max_depth=0)
    result = await task(tools, "toolu_s0_0", "explore")
    assert result.is_error and "delegation depth limit 0 was reached" in result.as_text()
    assert events.events == []


async def test_children_that_may_delegate_see_the_roster(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    write_agent(ws, "deep.md", DEEP)
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    model = Recording(root(task_call("deep", [{"text": "fine"}]), task_call("explore", [{"text": "fine"}])))
    delegate(tools, model, events, (await load_agents(machine)).agents)
    await task(tools, "toolu_s0_0", "deep")
    await task(tools, "toolu_s0_1", "explore")
    deep, explore = model.requests
    assert "## Available Agents" in deep.system and "- deep: Delegates to itself." in deep.system
    assert "## Available Agents" not in explore.system
    assert model.offered(("toolu_s0_0",)) == {"read_file", "task"}


# ---------------------------------------------------------------- parallelism


async def test_at_most_three_read_only_tasks_run_at_once(machine: LocalMachine, db: Database) -> None:
    count = 2 * MAX_PARALLEL_READ_ONLY
    calls = [task_call("explore", [{"text": f"answer {i}"}]) for i in range(count)]
    gate = Gate(root(*calls), MAX_PARALLEL_READ_ONLY, count)
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(tools, gate, events)
    results = await asyncio.gather(*(task(tools, f"toolu_s0_{i}", "explore") for i in range(count)))
    assert [r.as_text() for r in results] == [f"answer {i}" for i in range(count)]
    assert gate.peak == MAX_PARALLEL_READ_ONLY
    assert events.peak() == MAX_PARALLEL_READ_ONLY


async def test_nested_read_only_tasks_take_no_second_slot(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    """Each of the parallel tasks delegates again while holding its slot: no deadlock."""
    write_agent(ws, "deep.md", DEEP)
    count = MAX_PARALLEL_READ_ONLY + 1
    nested = [
        {"delay_ms": LATENCY_MS, "tool_calls": [task_call("deep", [{"text": "inner"}])]},
        {"text": "outer"},
    ]
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(
        tools,
        root(*[task_call("deep", nested) for _ in range(count)]),
        events,
        (await load_agents(machine)).agents,
    )
    results = await asyncio.wait_for(
        asyncio.gather(*(task(tools, f"toolu_s0_{i}", "deep") for i in range(count))), DEADLINE
    )
    assert [r.as_text() for r in results] == ["outer"] * count
    assert len(events.of("subagent.started")) == 2 * count
    assert events.peak() == MAX_PARALLEL_READ_ONLY  # they did overlap, up to the limit


async def test_tasks_that_may_change_things_run_one_at_a_time(machine: LocalMachine, db: Database) -> None:
    def writes(name: str) -> list[dict[str, Any]]:
        call = {"name": "write_file", "input": {"path": name, "content": "x\n"}}
        return [
            {"delay_ms": LATENCY_MS, "tool_calls": [call]},
            {"delay_ms": LATENCY_MS, "text": f"wrote {name}"},
        ]

    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    subagents = delegate(
        tools, root(task_call("writer", writes("a.txt")), task_call("writer", writes("b.txt"))), events
    )
    assert not subagents.read_only("writer")
    results = await asyncio.gather(task(tools, "toolu_s0_0", "writer"), task(tools, "toolu_s0_1", "writer"))
    assert [r.as_text() for r in results] == ["wrote a.txt", "wrote b.txt"]
    assert events.peak() == 1


# ---------------------------------------------------------------- permissions


async def test_explore_cannot_write_even_under_a_full_auto_parent(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    child = [
        {"tool_calls": [{"name": "write_file", "input": {"path": "x.txt", "content": "no"}}]},
        {
            "expect": {"tool_result_contains": "There is no tool named 'write_file'"},
            "text": "could not write",
        },
    ]
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    model = Recording(root(task_call("explore", child)))
    delegate(tools, model, events)
    result = await task(tools, "toolu_s0_0", "explore")
    assert result.as_text() == "could not write"
    assert model.offered(("toolu_s0_0",)) == {
        "read_file", "glob", "grep", "list", "search", "read_image", "web_fetch",
    }  # fmt: skip
    assert not (ws / "x.txt").exists()


async def test_writer_under_a_full_auto_parent_stages_a_change_set(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    (ws / "keep.txt").write_text("old\n")
    child = [
        {"tool_calls": [{"name": "write_file", "input": {"path": "new.txt", "content": "fresh\n"}}]},
        {"expect": {"tool_result_contains": "Staged for the user's review"}, "text": "staged new.txt"},
    ]
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    model = Recording(root(task_call("writer", child)))
    delegate(tools, model, events)
    result = await task(tools, "toolu_s0_0", "writer")
    assert not result.is_error and result.as_text() == "staged new.txt"
    assert "bash" not in model.offered(("toolu_s0_0",)) and "write_file" in model.offered(("toolu_s0_0",))
    (change_set,) = await ChangesRepo(db).of_session(SESSION)
    assert change_set.turn_id == TURN and [op.path for op in change_set.pending()] == [
        f"{machine.root}/new.txt"
    ]
    assert not (ws / "new.txt").exists()
    assert [e["change_set_id"] for e in events.of("change_set.updated")] == [change_set.id]


async def test_writer_under_a_read_only_parent_cannot_write(
    machine: LocalMachine, db: Database, ws: Path
) -> None:
    child = [
        {"tool_calls": [{"name": "write_file", "input": {"path": "new.txt", "content": "fresh\n"}}]},
        {"expect": {"tool_result_contains": "write_file is not permitted in read-only"}, "text": "forbidden"},
    ]
    tools, events = session_tools(machine, db, Tier.READ_ONLY), Events()
    model = Recording(root(task_call("writer", child)))
    subagents = delegate(tools, model, events)
    assert subagents.read_only("writer")
    result = await task(tools, "toolu_s0_0", "writer")
    assert result.as_text() == "forbidden"
    assert "write_file" not in model.offered(("toolu_s0_0",))
    assert await ChangesRepo(db).of_session(SESSION) == [] and not (ws / "new.txt").exists()


@pytest.mark.parametrize("parent", [Tier.WORKSPACE_WRITE, Tier.FULL_AUTO])
async def test_researcher_gets_the_web_only_where_the_parent_has_it(
    machine: LocalMachine, db: Database, parent: Tier
) -> None:
    fetch = {"name": "web_fetch", "input": {"url": "http://127.0.0.1:9/"}}
    forbidden = {
        "expect": {"tool_result_contains": "web_fetch is not permitted in workspace-write"},
        "text": "no web",
    }
    child = [{"tool_calls": [fetch]}, forbidden] if parent == Tier.WORKSPACE_WRITE else [{"text": "no need"}]
    tools, events = session_tools(machine, db, parent), Events()
    tools.config = replace(tools.config, web_search_url="http://127.0.0.1:9/search")  # web_search exists
    model = Recording(root(task_call("researcher", child)))
    delegate(tools, model, events)
    result = await task(tools, "toolu_s0_0", "researcher")
    offered = model.offered(("toolu_s0_0",))
    if parent == Tier.WORKSPACE_WRITE:
        assert result.as_text() == "no web" and not offered & {"web_fetch", "web_search"}
    else:
        assert result.as_text() == "no need" and {"web_fetch", "web_search"} <= offered


async def test_a_child_never_gets_commands_mcp_tools_or_browser_changes(
    machine: LocalMachine, db: Database
) -> None:
    """Whatever an agent file lists: exec and MCP tools are dropped, the browser comes as its reads."""
    tools = session_tools(machine, db, Tier.FULL_AUTO)
    mcp_tool = replace(tools.toolset["read_file"], name="mcp__gh__search", action=Action.READ)
    tools.toolset = {**tools.toolset, "mcp__gh__search": mcp_tool}
    spec = AgentSpec(
        "ops", "Does everything.", "Do it.", tools=("read", "exec", "browser", "mcp__gh__search"),
        tier=Tier.FULL_AUTO, source="ops.md",
    )  # fmt: skip
    subagents = delegate(tools, ScriptedModel([]), Events(), {"ops": spec})
    child = subagents.child_tools(spec, ("toolu_s0_0",))
    assert set(child.toolset) == {"read_file", "browser"}
    assert child.toolset["browser"].params is canonical_tool("browser_read").params  # type: ignore[union-attr]


async def test_which_agents_are_read_only(machine: LocalMachine, db: Database) -> None:
    assert BUILTIN_AGENTS["explore"].read_only and BUILTIN_AGENTS["researcher"].read_only
    assert not BUILTIN_AGENTS["writer"].read_only
    delegating = AgentSpec("d", "d", "", ("read", "task"), Tier.WORKSPACE_WRITE)
    assert not delegating.read_only
    assert AgentSpec("d", "d", "", ("read", "task"), Tier.READ_ONLY).read_only
    events = Events()
    full = delegate(session_tools(machine, db, Tier.FULL_AUTO), root(), events)
    assert full.read_only("explore") and full.read_only("nobody") and not full.read_only("writer")
    planning = delegate(session_tools(machine, db, Tier.FULL_AUTO, plan=True), root(), events)
    assert planning.read_only("writer")


# ---------------------------------------------------------------- the roster


async def test_without_a_machine_or_configuration_the_roster_is_the_builtins() -> None:
    loaded = await load_agents(None)
    assert loaded.agents == BUILTIN_AGENTS and loaded.problems == []
    assert roster(loaded.agents) == [
        Subagent("explore", BUILTIN_AGENTS["explore"].description),
        Subagent("researcher", BUILTIN_AGENTS["researcher"].description),
        Subagent("writer", BUILTIN_AGENTS["writer"].description),
    ]


async def test_workspace_agent_files_load_and_bad_ones_are_reported(
    machine: LocalMachine, ws: Path, tmp_path: Path
) -> None:
    write_agent(
        ws, "reviewer.md",
        "---\ndescription: Reviews a diff.\ntools: [read, grep, write]\npermission: workspace-write\n"
        "model: other-model\n---\nReview carefully.\n",
    )  # fmt: skip
    write_agent(ws, "plain.md", "---\nname: Plain_1\ndescription: Defaults.\n---\n")
    write_agent(ws, "bad.md", "no frontmatter here\n")
    write_agent(ws, "notes.txt", "---\ndescription: not an agent file\n---\n")
    outside = tmp_path / "outside.md"
    outside.write_text("---\ndescription: From outside the workspace.\n---\nBody.\n")
    (ws / AGENTS_DIR / "escape.md").symlink_to(outside)
    (ws / "inside.md").write_text("---\ndescription: Linked from inside.\n---\nBody.\n")
    (ws / AGENTS_DIR / "linked.md").symlink_to(ws / "inside.md")

    loaded = await load_agents(machine)
    reviewer = loaded.agents["reviewer"]
    assert reviewer == AgentSpec(
        "reviewer", "Reviews a diff.", "Review carefully.", ("read", "grep", "write"), Tier.WORKSPACE_WRITE,
        "other-model", f"{machine.root}/{AGENTS_DIR}/reviewer.md",
    )  # fmt: skip
    plain = loaded.agents["Plain_1"]
    assert plain.tools == EXPLORE_TOOLS and plain.tier == Tier.READ_ONLY and plain.model is None
    assert "final message" in plain.instructions  # no body: the default instructions
    assert loaded.agents["linked"].description == "Linked from inside."
    assert "escape" not in loaded.agents and "bad" not in loaded.agents
    assert sorted(loaded.agents) == ["Plain_1", "explore", "linked", "researcher", "reviewer", "writer"]
    assert loaded.problems == [
        f"skipped agent file {machine.root}/{AGENTS_DIR}/bad.md: bad.md does not start with a --- frontmatter block",
        f"skipped agent file {machine.root}/{AGENTS_DIR}/escape.md: it links out of the working directory",
    ]


async def test_later_sources_override_earlier_ones(machine: LocalMachine, ws: Path) -> None:
    configured = [{"name": "explore", "description": "Configured explore.", "instructions": "Mine."}]
    assert (await load_agents(None, configured)).agents["explore"].description == "Configured explore."
    write_agent(ws, "explore.md", "---\ndescription: Workspace explore.\n---\nOurs.\n")
    loaded = await load_agents(machine, configured)
    assert loaded.agents["explore"].description == "Workspace explore."
    assert loaded.agents["explore"].instructions == "Ours."


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"name": "bad name"}, "invalid name 'bad name'"),
        ({"name": "x" * 65}, "invalid name"),
        ({"description": ""}, "it has no description"),
        (
            {"description": "d" * (MAX_DESCRIPTION_CHARS + 1)},
            f"longer than {MAX_DESCRIPTION_CHARS} characters",
        ),
        ({"tools": ["read", "teleport"]}, "unknown tools ['teleport']"),
        ({"tools": "read"}, None),
        ({"permission": "root"}, "permission 'root' is not one of read-only, workspace-write"),
        ({"name": "x" * 64}, None),
        ({"description": "d" * MAX_DESCRIPTION_CHARS}, None),
        ({"tools": "read, mcp__docs__search"}, None),
    ],
)
async def test_configured_agents_are_checked(fields: dict[str, Any], problem: str | None) -> None:
    entry = {"name": "custom", "description": "A custom agent.", **fields}
    loaded = await load_agents(None, [entry])
    if problem is None:
        assert loaded.problems == [] and entry["name"] in loaded.agents
    else:
        assert len(loaded.problems) == 1 and problem in loaded.problems[0]
        assert sorted(loaded.agents) == sorted(BUILTIN_AGENTS)


@pytest.mark.parametrize("size", [MAX_AGENT_FILE_BYTES, MAX_AGENT_FILE_BYTES + 1])
async def test_agent_files_up_to_the_size_limit_load(machine: LocalMachine, ws: Path, size: int) -> None:
    head = "---\ndescription: Big.\n---\n"
    write_agent(ws, "big.md", head + "x" * (size - len(head)))
    assert (ws / AGENTS_DIR / "big.md").stat().st_size == size
    loaded = await load_agents(machine)
    if size <= MAX_AGENT_FILE_BYTES:
        assert "big" in loaded.agents and loaded.problems == []
    else:
        assert "big" not in loaded.agents
        assert loaded.problems == [
            f"skipped agent file {machine.root}/{AGENTS_DIR}/big.md: it is larger than {MAX_AGENT_FILE_BYTES} bytes"
        ]


@pytest.mark.parametrize("count", [MAX_AGENT_FILES, MAX_AGENT_FILES + 1])
async def test_at_most_max_agent_files_are_read(machine: LocalMachine, ws: Path, count: int) -> None:
    for i in range(count):
        write_agent(ws, f"a{i:04d}.md", f"---\ndescription: Agent {i}.\n---\n")
    loaded = await load_agents(machine)
    declared = sorted(name for name in loaded.agents if name not in BUILTIN_AGENTS)
    assert declared == [f"a{i:04d}" for i in range(min(count, MAX_AGENT_FILES))]
    if count > MAX_AGENT_FILES:
        assert loaded.problems == [
            f"{machine.root}/{AGENTS_DIR} holds {count} agent files; only the first {MAX_AGENT_FILES} by name are read"
        ]
    else:
        assert loaded.problems == []


# ---------------------------------------------------------------- the scripted model's nested scripts


def request(call_index: int, task_path: tuple[str, ...] = ()) -> ModelRequest:
    return ModelRequest("", [], [], call_index=call_index, task_path=task_path)


NESTED: list[dict[str, Any]] = [
    {"text": "first"},
    {
        "tool_calls": [
            {"name": "read", "input": {"path": "a"}},
            task_call(
                "explore",
                [{"text": "child 0"}, {"tool_calls": [task_call("explore", [{"text": "grandchild"}])]}],
            ),
        ]
    },
]


async def test_scripted_ids_are_deterministic_and_nested_scripts_are_found() -> None:
    model = ScriptedModel(check_script(NESTED))
    reply = await model.query(request(1))
    assert [(c.id, c.name) for c in reply.tool_calls] == [("toolu_s1_0", "read"), ("toolu_s1_1", "task")]
    assert reply.tool_calls[1].input == {"agent": "explore", "prompt": "go"}  # `script` is not input
    assert (await model.query(request(0, ("toolu_s1_1",)))).text == "child 0"
    child = await model.query(request(1, ("toolu_s1_1",)))
    assert [c.id for c in child.tool_calls] == ["toolu_s1_0"]
    assert (await model.query(request(0, ("toolu_s1_1", "toolu_s1_0")))).text == "grandchild"
    assert await model.query(request(1, ("toolu_s1_1", "toolu_s1_0"))) == Reply()  # exhausted: ends


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (("toolu_s1_0",), "no script for the subagent of call toolu_s1_0 (task path level 1)"),
        (("toolu_s7_0",), "no script for the subagent of call toolu_s7_0"),
        (("toolu_s1_1", "toolu_s0_0"), "no script for the subagent of call toolu_s0_0 (task path level 2)"),
        (("call_abc",), "'call_abc' is not a scripted tool call id"),
    ],
)
async def test_a_missing_nested_script_is_named(path: tuple[str, ...], message: str) -> None:
    with pytest.raises(ScriptError, match=message.replace("(", r"\(").replace(")", r"\)")):
        await ScriptedModel(NESTED).query(request(0, path))


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ([{"tool_calls": [{"name": "task", "script": [{"bogus": 1}]}]}],
         "script step 0 call 0 > script step 0 has unknown keys ['bogus']"),
        ([{"tool_calls": [{"name": "task", "script": {"text": "x"}}]}],
         "script step 0 call 0: `script` must be a list of steps"),
        ([{"text": "a"}, {"script": []}], "script step 1 has unknown keys ['script']"),
    ],
)  # fmt: skip
def test_nested_scripts_are_checked_up_front(script: list[Any], message: str) -> None:
    with pytest.raises(ScriptError) as caught:
        check_script(script)
    assert message in str(caught.value)


async def test_workspace_agent_files_load_on_an_ssh_machine(ssh: SshMachine, remote_root: Path) -> None:
    """Through the protocol the same files load, a FIFO is refused unopened, and a link is
    skipped wherever it leads (its target cannot be checked)."""
    write_agent(
        remote_root, "reviewer.md", "---\ndescription: Reviews a diff.\ntools: [read]\n---\nReview.\n"
    )
    write_agent(remote_root, "bad.md", "no frontmatter here\n")
    head = "---\ndescription: Big.\n---\n"
    write_agent(remote_root, "big.md", head + "x" * (MAX_AGENT_FILE_BYTES + 1 - len(head)))
    os.mkfifo(remote_root / AGENTS_DIR / "fifo.md")
    (remote_root / "inside.md").write_text("---\ndescription: Linked from inside.\n---\nBody.\n")
    (remote_root / AGENTS_DIR / "linked.md").symlink_to(remote_root / "inside.md")

    loaded = await load_agents(ssh)
    folder = f"{ssh.root}/{AGENTS_DIR}"
    assert sorted(set(loaded.agents) - set(BUILTIN_AGENTS)) == ["reviewer"]
    assert loaded.agents["reviewer"] == AgentSpec(
        "reviewer", "Reviews a diff.", "Review.", ("read",), Tier.READ_ONLY, None, f"{folder}/reviewer.md"
    )
    assert loaded.problems == [
        f"skipped agent file {folder}/bad.md: bad.md does not start with a --- frontmatter block",
        f"skipped agent file {folder}/big.md: it is larger than {MAX_AGENT_FILE_BYTES} bytes",
        f"skipped agent file {folder}/fifo.md: it is not a regular file",
        f"skipped agent file {folder}/linked.md: it links out of the working directory",
    ]


# ---------------------------------------------------------------- background tasks


async def test_a_background_tasks_question_is_the_sessions_and_closing_cancels_it(
    machine: LocalMachine, db: Database
) -> None:
    """A background task may outlive its turn: an approval it asks for names no turn (so the
    turn that goes on is not marked waiting), and a shutdown cancels it without a notice."""
    tools, events = session_tools(machine, db, Tier.FULL_ASK), Events()
    background = BackgroundTasks()
    fetch = [
        {"tool_calls": [{"name": "web_fetch", "input": {"url": "https://example.com/"}}]},
        {"text": "read"},
    ]
    delegate(tools, root(task_call("researcher", fetch)), events, background=background)
    with calling("toolu_s0_0"):
        started = await tools.call("task", {"agent": "researcher", "prompt": "go", "background": True})
    assert not started.is_error and started.data == {
        "task_id": "toolu_s0_0",
        "agent": "researcher",
        "status": "running",
    }
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not (pending := await tools.approvals.repo.pending(SESSION)):
        assert asyncio.get_running_loop().time() < deadline, "the background task never asked"
        await asyncio.sleep(0.01)
    assert [(a.action, a.turn_id) for a in pending] == [("web", None)]
    assert list(background.running) == ["toolu_s0_0"]
    await background.close()
    assert background.running == {} and background.take() == []
    assert events.of("subagent.started")[0]["background"] is True and not events.of("subagent.completed")


async def test_background_is_refused_below_the_sessions_own_agent_and_without_a_registry(
    machine: LocalMachine, db: Database
) -> None:
    refusal = "Only the session's own agent can start background tasks."
    tools, events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    spec = parse_agent({"description": "Delegates.", "tools": ["read", "task"]}, "", "deep", "test")
    nested = {
        "tool_calls": [{"name": "task", "input": {"agent": "explore", "prompt": "go", "background": True}}]
    }
    model = Recording(root(task_call("deep", [nested, {"text": "done"}])))
    delegate(tools, model, events, {**BUILTIN_AGENTS, "deep": spec}, background=BackgroundTasks())
    assert (await task(tools, "toolu_s0_0", "deep")).as_text() == "done"
    told = [r.messages[-1] for r in model.requests if r.task_path == ("toolu_s0_0",)][-1]
    assert told.role == "tool" and told.is_error and told.text == refusal  # a child cannot start one
    bare, bare_events = session_tools(machine, db, Tier.FULL_AUTO), Events()
    delegate(bare, root(), bare_events)  # a runner without the session's background registry
    with calling("toolu_s0_0"):
        refused = await bare.call("task", {"agent": "explore", "prompt": "go", "background": True})
    assert refused.is_error and refused.as_text() == refusal
