"""The runtime's view of a session, end to end on real parts (SQLite file, bubblewrap sandboxes,
the worker): the frozen prompt per baseline, signals at turn boundaries, sessions without a
machine, compaction (threshold and provider overflow), and turn order of queued messages.

The model is the scripted one, wrapped to record every request it is given (what the model
saw is the thing under test); the overflow test wraps it to refuse long requests as a
provider does."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.compaction import SUMMARY_HEAD, CompactionConfigError
from agentbox.agent.context import COMPACTED_EVENT, SIGNAL_EVENT
from agentbox.agent.loop import LoopConfig
from agentbox.agent.models import Model, ModelRateLimited, ModelRequest, Reply, ScriptedModel, ScriptError
from agentbox.agent.prompt import NO_AGENTS
from agentbox.agent.providers.errors import ContextOverflow
from agentbox.agent.providers.retry import RetryPolicy
from agentbox.agent.subagents import MAX_BACKGROUND_TASKS, RUN_TRAILER
from agentbox.agent.worker import NO_MACHINE
from agentbox.config import load
from agentbox.store.baselines import BaselineStore
from agentbox.store.sessions import Session
from tests.test_agent_loop import Kit, bash, make_kit, terminal, turn_events, upload, wait_for


class Recording:
    """The scripted model, keeping each request it answered."""

    def __init__(self, model: Model, requests: list[ModelRequest], refuse_over: int | None = None) -> None:
        self.model, self.requests, self.refuse_over = model, requests, refuse_over
        self.name = model.name

    async def query(self, request: ModelRequest) -> Reply:
        self.requests.append(request)
        size = sum(len(m.text) for m in request.messages)
        if self.refuse_over is not None and request.tools and size > self.refuse_over:
            raise ContextOverflow(f"prompt is too long: {size} characters")
        return await self.model.query(request)


@pytest.fixture
async def recorded(sandbox_tmp: Path) -> AsyncIterator[tuple[Kit, list[ModelRequest]]]:
    requests: list[ModelRequest] = []

    def models(session: Session) -> Model:
        refuse = session.metadata.get("refuse_over")
        return Recording(ScriptedModel(session.script or []), requests, refuse)

    k = await make_kit(sandbox_tmp / "home", models=models)
    yield k, requests
    await k.close()


async def run(kit: Kit, session_id: str, content: str) -> str:
    sub = await kit.worker.submit(session_id, content)
    end = await terminal(kit, session_id, sub.turn.id)
    assert end.type == "turn.completed", end.data
    return sub.turn.id


async def test_the_prompt_is_assembled_once_and_frozen_until_compaction(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    script = [
        bash("printf 'Always run the tests.' > AGENTS.md && mkdir -p src && touch README.md"),
        {"text": "noted"},
        bash("printf 'Changed rules.' > AGENTS.md"),
        {"text": "changed"},
    ]
    session = await kit.worker.create_session("scripted", script=script, instructions="Be terse.")
    await run(kit, session.id, "set up")
    first = requests[0].system
    assert first.startswith("Be terse.") and f"Date: {date.today().isoformat()}" in first
    assert "Machine: sandbox (sandbox, linux), workspace /workspace" in first
    assert "Working directory: /workspace" in first and NO_AGENTS not in first
    assert "## Available Agents" in first and "- explore:" in first
    assert "# AGENTS.md" not in first  # the file did not exist when the baseline was taken
    await run(kit, session.id, "change the rules")
    assert all(r.system == first for r in requests), "the prompt changed without a compaction"
    baselines = BaselineStore(kit.db)
    latest = await baselines.latest(session.id)
    assert latest is not None and latest.system == first and latest.summary is None


async def test_changes_between_turns_are_told_as_signals_not_prompt_edits(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    lines = "'---' 'name: deploy' 'description: Ship the app to staging' '---' 'Run make deploy.'"
    script = [
        bash(f"mkdir -p .agents/skills/deploy && printf '%s\\n' {lines} > .agents/skills/deploy/SKILL.md"),
        {"text": "skill written"},
        {"text": "second turn"},
    ]
    session = await kit.worker.create_session("scripted", script=script)
    first_turn = await run(kit, session.id, "write a skill")
    assert not [e for e in await turn_events(kit, session.id, first_turn) if e.type == SIGNAL_EVENT]
    await kit.worker.update_session(session.id, {"permission_mode": "read-only"})
    second_turn = await run(kit, session.id, "what changed?")
    (signal,) = [e for e in await turn_events(kit, session.id, second_turn) if e.type == SIGNAL_EVENT]
    kinds = {(s["type"], s.get("resource")) for s in signal.data["signals"]}
    assert kinds == {("resources", "tool"), ("resources", "skill"), ("permissions", None)}
    told = requests[-1].messages
    assert told[-2].text == "what changed?" and told[-1].role == "user"
    assert '<signal type="permissions">' in told[-1].text and "from full-auto to read-only" in told[-1].text
    assert '<signal type="resources" resource="skill">' in told[-1].text and "- deploy: Ship" in told[-1].text
    assert 'The tool "bash" is no longer available.' in told[-1].text
    assert requests[-1].system == requests[0].system
    assert "bash" not in [t.name for t in requests[-1].tools]
    third = await kit.worker.submit(session.id, "again")  # nothing changed since: no new signal
    await terminal(kit, session.id, third.turn.id)
    assert not [e for e in await turn_events(kit, session.id, third.turn.id) if e.type == SIGNAL_EVENT]


async def test_a_session_without_a_machine_has_no_workspace_and_still_works(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    script = [{"tool_calls": [{"name": "todo_write", "input": {"todos": [
        {"id": "1", "content": "think", "status": "in_progress"}]}}]}, {"text": "done"}]  # fmt: skip
    session = await kit.worker.create_session("scripted", script=script, machine=NO_MACHINE)
    await run(kit, session.id, "plan it")
    names = {t.name for t in requests[0].tools}
    assert "todo_write" in names and not names & {"bash", "read_file", "write_file", "glob", "task"}
    assert "Machine:" not in requests[0].system and "Working directory" not in requests[0].system
    assert kit.registry.entries() == []  # no sandbox was started for it
    with pytest.raises(ValueError, match="no sandbox"):
        await kit.worker.submit(session.id, "with a file", files=["file_x"])


async def test_compaction_summarises_the_old_part_keeps_the_recent_one_and_rebaselines(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    big = "x" * 2400  # ~600 tokens per exchange
    script = [
        {"text": f"first answer {big}"},
        {"text": f"second answer {big}"},
        {"text": "## Goal\nKeep answering.\n\n## Progress\n- [x] two answers"},  # the summary call
        {"text": "third answer"},
        {"text": "fourth answer"},
    ]
    session = await kit.worker.create_session(
        "scripted", script=script,
        model_options={"context_window": 3000}, compaction={"reserve_tokens": 2000, "keep_recent_tokens": 10},
    )  # fmt: skip
    one, two, three, four = (f"{word} " * 12 for word in ("one", "two", "three", "four"))  # ~15 tokens each
    await run(kit, session.id, one)
    second = await run(kit, session.id, two)  # ~635 tokens in context: under 3000 - 2000
    assert not [e for e in await turn_events(kit, session.id, second) if e.type == COMPACTED_EVENT]
    third = await run(kit, session.id, three)  # ~1250: over
    (event,) = [e for e in await turn_events(kit, session.id, third) if e.type == COMPACTED_EVENT]
    assert event.data["reason"] == "threshold" and event.data["tokens_before"] > 3000 - 2000
    assert event.data["tokens_after"] < event.data["tokens_before"] and not event.data["split_turn"]
    summary_call = requests[2]
    assert summary_call.tools == [] and "first answer" in summary_call.messages[0].text
    assert summary_call.max_tokens == int(0.8 * 2000)
    view = requests[3].messages
    assert view[0].text.startswith(SUMMARY_HEAD) and "Keep answering." in view[0].text
    assert [m.text for m in view[1:]] == [three]  # the recent part, verbatim; the rest summarised
    fourth = await run(kit, session.id, four)
    assert not [e for e in await turn_events(kit, session.id, fourth) if e.type == COMPACTED_EVENT]
    assert requests[4].messages[0].text == view[0].text  # the summary stays the head
    assert [m.text for m in requests[4].messages[1:]] == [three, "third answer", four]


class Summarizer:
    """A second model (as the operator's `[models."openai:summarizer"]`), keeping its requests."""

    name = "openai:summarizer"

    def __init__(self, requests: list[ModelRequest]) -> None:
        self.requests = requests

    async def query(self, request: ModelRequest) -> Reply:
        self.requests.append(request)
        return Reply("## Goal\nSummarised by the small model.")


@pytest.mark.parametrize("named_by", ["session", "config"])
async def test_the_summary_goes_to_the_configured_compaction_model(sandbox_tmp: Path, named_by: str) -> None:
    """Named by the session's `compaction.model`, or by the config's `[compaction] model`."""
    asked: list[ModelRequest] = []
    summaries: list[ModelRequest] = []

    def models(session: Session) -> Model:
        if session.model == Summarizer.name:
            return Summarizer(summaries)
        return Recording(ScriptedModel(session.script or []), asked)

    kit = await make_kit(sandbox_tmp / "home", models=models)
    kit.registry.settings.models[Summarizer.name] = {"context_window": 200_000}
    try:
        big = "x" * 2400
        script = [
            {"text": f"first answer {big}"},
            {"text": f"second answer {big}"},
            {"text": "(the position of the summary call, which another model answers)"},
            {"text": "third answer"},
        ]
        compaction: dict[str, Any] = {"reserve_tokens": 2000, "keep_recent_tokens": 10}
        if named_by == "session":
            compaction["model"] = Summarizer.name
        else:
            kit.registry.settings.compaction_model = Summarizer.name
        session = await kit.worker.create_session(
            "scripted", script=script, model_options={"context_window": 3000}, compaction=compaction
        )
        for content in ("one " * 12, "two " * 12):
            await run(kit, session.id, content)
        assert not summaries
        third = await run(kit, session.id, "three " * 12)
        (summary,) = summaries  # the summary request went to the compaction model, not the session's
        assert summary.tools == [] and "first answer" in summary.messages[0].text
        assert all(r.tools for r in asked)  # every request the session's model saw was a turn's
        assert "Summarised by the small model." in asked[-1].messages[0].text
        events = await turn_events(kit, session.id, third)
        usage = next(e for e in events if e.type == "model.usage" and e.data.get("purpose") == "compaction")
        assert usage.data["model"] == Summarizer.name
        assert [e.data["content"][0]["text"] for e in events if e.type == "agent.message"] == ["third answer"]
    finally:
        await kit.close()


def test_the_configs_compaction_model_must_be_a_configured_model(tmp_path: Path) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(
        '[models."openai:small"]\ncontext_window = 8192\n\n[compaction]\nmodel = "openai:small"\n'
    )
    assert load(path, env={"AGENTBOX_HOME": str(tmp_path)}).compaction_model == "openai:small"
    path.write_text('[compaction]\nmodel = "openai:small"\n')
    with pytest.raises(ValueError, match=r"\[compaction\] model 'openai:small' is not one of the configured"):
        load(path, env={"AGENTBOX_HOME": str(tmp_path)})


async def test_a_compaction_model_that_is_not_configured_is_refused(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, _ = recorded
    with pytest.raises(CompactionConfigError, match="'openai:anything' is not a configured model"):
        await kit.worker.create_session("scripted", script=[], compaction={"model": "openai:anything"})
    with pytest.raises(CompactionConfigError, match=r"compaction\.model must be a model name"):
        await kit.worker.create_session("scripted", script=[], compaction={"model": ""})
    kit.registry.settings.models["openai:small"] = {}
    session = await kit.worker.create_session("scripted", script=[], compaction={"model": "openai:small"})
    assert session.compaction == {"model": "openai:small"}


async def test_compaction_false_never_compacts_on_the_threshold(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    script = [{"text": "a" * 4000}, {"text": "b"}, {"text": "c"}]
    session = await kit.worker.create_session(
        "scripted", script=script, model_options={"context_window": 1000}, compaction=False
    )
    for content in ("one", "two", "three"):
        turn = await run(kit, session.id, content)
        assert not [e for e in await turn_events(kit, session.id, turn) if e.type == COMPACTED_EVENT]
    assert [r.messages[-1].text for r in requests] == ["one", "two", "three"]


async def test_a_context_overflow_compacts_and_retries_the_call(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, _ = recorded
    script = [
        {"text": "y" * 3000},
        {"text": "the overflowing call's step is consumed by the refused request"},
        {"text": "## Goal\nsummary after overflow"},
        {"text": "recovered"},
    ]
    session = await kit.worker.create_session(
        "scripted", script=script, metadata={"refuse_over": 2000},
        compaction={"keep_recent_tokens": 5},
    )  # fmt: skip
    await run(kit, session.id, "one")
    second = await run(kit, session.id, "two " * 10)  # the kept part: over 5 tokens on its own
    events = await turn_events(kit, session.id, second)
    types = [e.type for e in events]
    assert types.index("session.error") < types.index(COMPACTED_EVENT) < types.index("agent.message")
    error = next(e for e in events if e.type == "session.error")
    assert error.data["error"]["type"] == "context_window_exceeded"
    assert next(e for e in events if e.type == COMPACTED_EVENT).data["reason"] == "overflow"
    assert next(e for e in events if e.type == "agent.message").data["content"][0]["text"] == "recovered"


#: A command that holds its tool call open until the test creates /workspace/go.
HOLD = "while [ ! -e /workspace/go ]; do sleep 0.05; done; echo released"


async def release(kit: Kit, session_id: str) -> None:
    """Let a `HOLD` command finish."""
    machine = await kit.registry.open(session_id)
    await machine.write("/workspace/go", b"")


async def tool_running(kit: Kit, session_id: str, turn_id: str) -> None:
    """Wait until the turn's first tool call is recorded (it runs next, before any result)."""
    await wait_for(kit, session_id, lambda e: e.turn_id == turn_id and e.type == "agent.tool_use")


async def test_a_message_sent_mid_turn_joins_it_at_the_next_step_boundary(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    script = [bash(HOLD), {"expect": {"user_message_contains": "also this"}, "text": "both answered"}]
    session = await kit.worker.create_session("scripted", script=script)
    first = await kit.worker.submit(session.id, "first")
    await tool_running(kit, session.id, first.turn.id)
    second = await kit.worker.submit(session.id, "also this")  # while the first turn's tool runs
    assert second.turn.status == "queued"
    await release(kit, session.id)
    end = await terminal(kit, session.id, first.turn.id)
    assert end.type == "turn.completed", end.data
    joined_end = await terminal(kit, session.id, second.turn.id)
    assert joined_end.type == "turn.completed" and joined_end.data["joined_into"] == first.turn.id
    # the second model call saw it after the tool result, in the same turn; no third call was made
    assert [m.role for m in requests[1].messages] == ["user", "assistant", "tool", "user"]
    assert requests[1].messages[-1].text == "also this" and len(requests) == 2
    events = await turn_events(kit, session.id, first.turn.id)
    types = [e.type for e in events]
    assert types.index("agent.tool_result") < types.index("user.message", 1) < types.index("agent.message")
    joined = [e for e in events if e.type == "user.message" and e.data.get("joined_from")]
    assert [(e.data["content"], e.data["joined_from"]) for e in joined] == [("also this", second.turn.id)]
    second_events = [e.type for e in await turn_events(kit, session.id, second.turn.id)]
    assert second_events == ["user.message", "turn.queued", "turn.joined", "turn.completed"]
    turn = await kit.store.get_turn(second.turn.id)
    assert turn.joined_into == first.turn.id and turn.status == "completed"
    rows = [(m.turn_id, m.role) for m in await kit.store.transcript(session.id) if m.role == "user"]
    assert rows == [(first.turn.id, "user"), (first.turn.id, "user")]


async def test_a_message_sent_during_the_last_model_call_keeps_the_turn_going(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    """Where the turn would end (a reply without tool calls) is a boundary too."""
    kit, requests = recorded
    script = [
        {"delay_ms": 400, "text": "first answer"},
        {"expect": {"user_message_contains": "one more"}, "text": "second answer"},
    ]
    session = await kit.worker.create_session("scripted", script=script)
    first = await kit.worker.submit(session.id, "first")
    while not requests:
        await asyncio.sleep(0.01)
    second = await kit.worker.submit(session.id, "one more")
    end = await terminal(kit, session.id, first.turn.id)
    assert end.type == "turn.completed", end.data
    texts = [e.data["content"][0]["text"] for e in await turn_events(kit, session.id, first.turn.id)
             if e.type == "agent.message"]  # fmt: skip
    assert texts == ["first answer", "second answer"]
    assert (await kit.store.get_turn(second.turn.id)).joined_into == first.turn.id


async def test_a_message_with_files_runs_as_its_own_turn_and_so_do_those_behind_it(
    recorded: tuple[Kit, list[ModelRequest]], sandbox_tmp: Path
) -> None:
    """Placing files can fail, which fails the turn that owns them: such a message never joins,
    and neither do the messages behind it (FIFO); those were accepted before the turn of the
    message with files started, so they do not join that one either."""
    kit, requests = recorded
    script = [bash(HOLD), {"text": "first done"}, {"text": "second done"}]
    session = await kit.worker.create_session("scripted", script=script)
    first = await kit.worker.submit(session.id, "first")
    await tool_running(kit, session.id, first.turn.id)
    file_id = await upload(kit, sandbox_tmp, "notes.txt", b"n", session.id)
    with_file = await kit.worker.submit(session.id, "read this", files=[file_id])
    behind = await kit.worker.submit(session.id, "and this")
    await release(kit, session.id)
    for sub in (first, with_file, behind):
        assert (await terminal(kit, session.id, sub.turn.id)).type == "turn.completed"
    assert [(await kit.store.get_turn(s.turn.id)).joined_into for s in (with_file, behind)] == [None, None]
    log = await kit.store.list_events(session.id, limit=1000)
    assert [e.turn_id for e in log if e.type == "turn.started"] == [
        s.turn.id for s in (first, with_file, behind)
    ]
    assert [m.text for m in requests[1].messages if m.role == "user"] == ["first"]


def answer(result: str) -> str:
    """A stored task's answer without the line that gives its run id (`RUN_TRAILER`)."""
    return result.split("\n[task id: sub_")[0]


def task_call_of(agent: str, prompt: str, script: list[Any]) -> dict[str, Any]:
    return {"name": "task", "input": {"agent": agent, "prompt": prompt}, "script": script}


def background_task(agent: str, script: list[Any], n: int = 0) -> dict[str, Any]:
    return {"name": "task", "input": {"agent": agent, "prompt": f"look ({n})", "background": True},
            "script": script}  # fmt: skip


async def test_a_background_task_finishes_while_its_turn_goes_on_and_the_model_is_told(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    script = [
        {"tool_calls": [background_task("explore", [{"text": "The value is 42."}])]},
        {"expect": {"tool_result_contains": "Started background task toolu_s0_0"}, **bash(HOLD)},
        {"expect": {"user_message_contains": "The value is 42."}, "text": "The explorer found 42."},
    ]
    session = await kit.worker.create_session("scripted", script=script)
    sub = await kit.worker.submit(session.id, "explore in the background")
    done = await wait_for(kit, session.id, lambda e: e.type == "subagent.completed")
    assert done.turn_id == sub.turn.id and done.data["background"] is True  # while the turn runs
    assert done.data["result"] == "The value is 42." and done.data["status"] == "completed"
    assert (await kit.store.get_turn(sub.turn.id)).status == "running"
    await release(kit, session.id)
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed", end.data
    told = requests[-1].messages[-1]
    assert told.role == "user" and told.text.startswith('<signal type="task" task_id="toolu_s0_0"')
    events = await turn_events(kit, session.id, sub.turn.id)
    signal = next(e for e in events if e.type == SIGNAL_EVENT)
    run_id = done.data["subagent_id"]
    assert signal.data["signals"] == [{
        "type": "task", "task_id": "toolu_s0_0", "agent": "explore", "status": "completed",
        "body": "The background task toolu_s0_0 (explore) finished with status completed. Its final "
                f"message:\n\nThe value is 42.\n{RUN_TRAILER.format(id=run_id)}",
    }]  # fmt: skip
    types = [e.type for e in events]
    assert types.index("subagent.completed") < types.index(
        "agent.tool_result", types.index("subagent.completed")
    )


async def test_background_is_refused_for_writers_and_past_the_session_limit(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, _ = recorded
    hanging = [{"hang": True}]
    calls = [background_task("writer", hanging)]
    calls += [background_task("explore", hanging, n) for n in range(MAX_BACKGROUND_TASKS + 1)]
    script = [{"tool_calls": calls}, {"text": "done"}]
    session = await kit.worker.create_session("scripted", script=script, permission_mode="full-auto")
    sub = await kit.worker.submit(session.id, "start too many")
    assert (await terminal(kit, session.id, sub.turn.id)).type == "turn.completed"
    results = [
        e.data for e in await turn_events(kit, session.id, sub.turn.id) if e.type == "agent.tool_result"
    ]
    texts = [(r["is_error"], r["content"][0]["text"]) for r in results]
    assert texts[0][0] and "can change files, so it cannot run in the background" in texts[0][1]
    assert [error for error, _ in texts[1:]] == [False] * MAX_BACKGROUND_TASKS + [True]  # the limit, exactly
    assert f"{MAX_BACKGROUND_TASKS} background tasks are already running" in texts[-1][1]


async def test_task_delegates_to_read_only_agents_in_parallel_and_returns_only_their_answer(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    kit, requests = recorded
    child = [
        {"delay_ms": 300, "tool_calls": [{"name": "read_file", "input": {"path": "notes.txt"}}]},
        {"expect": {"tool_result_contains": "secret=42"}, "text": "The value is 42."},
    ]
    calls = [
        {"name": "task", "input": {"agent": "explore", "prompt": f"find the value ({n})"}, "script": child}
        for n in range(4)
    ]
    script = [bash("echo secret=42 > notes.txt"), {"tool_calls": calls}, {"text": "All four agree."}]
    session = await kit.worker.create_session("scripted", script=script)
    turn = await run(kit, session.id, "ask four explorers")
    events = await turn_events(kit, session.id, turn)
    order = [(e.type, e.data["tool_use_id"]) for e in events if e.type.startswith("subagent.")]
    started_before_first_end = [t for t, _ in order[: [t for t, _ in order].index("subagent.completed")]]
    assert started_before_first_end == ["subagent.started"] * 3  # three at once, the fourth waits
    results = [
        e for e in events if e.type == "agent.tool_result" and e.data["tool_use_id"].startswith("toolu_s1")
    ]
    assert len(results) == 4 and all(
        r.data["content"][0]["text"].startswith("The value is 42.\n[task id: sub_") for r in results
    )
    child_requests = [r for r in requests if r.task_path]
    assert {r.tools and tuple(sorted(t.name for t in r.tools)) for r in child_requests} == {
        ("glob", "grep", "list", "read_file", "read_image", "search", "web_fetch")
    }  # explore's own tools and its web research: no bash, no write, whatever the parent may do
    assert "secret=42" not in requests[-1].messages[-1].text  # the parent sees only the final text


async def test_the_frozen_prompt_outlives_a_restart(sandbox_tmp: Path) -> None:
    requests: list[ModelRequest] = []

    def models(session: Session) -> Model:
        return Recording(ScriptedModel(session.script or []), requests)

    script = [
        bash("printf 'Rules v1' > AGENTS.md && seq 1 600"),
        {"text": "ran it"},
        bash("printf 'Rules v2' > AGENTS.md"),  # the next baseline would read v2: there must be none
        {"text": "after the restart"},
    ]
    home = sandbox_tmp / "home"
    first = await make_kit(home, models=models)
    try:
        session = await first.worker.create_session("scripted", script=script, instructions="Stay.")
        await run(first, session.id, "one")
    finally:
        await first.close()
    second = await make_kit(home, models=models)
    try:
        turn = await run(second, session.id, "two")
        assert not [e for e in await turn_events(second, session.id, turn) if e.type == SIGNAL_EVENT]
    finally:
        await second.close()
    assert len(requests) == 4 and len({r.system for r in requests}) == 1
    assert requests[-1].messages[0].text == "one" and requests[-1].call_index == 3


async def test_a_subagents_model_call_is_retried_like_the_turns_own(sandbox_tmp: Path) -> None:
    failures = [ModelRateLimited("child: slow down")]  # the first child call fails, once

    class FlakyChildren:
        def __init__(self, model: Model) -> None:
            self.model, self.name = model, model.name

        async def query(self, request: ModelRequest) -> Reply:
            if request.task_path and failures:
                raise failures.pop()
            return await self.model.query(request)

    def models(session: Session) -> Model:
        return FlakyChildren(ScriptedModel(session.script or []))

    task = {"name": "task", "input": {"agent": "explore", "prompt": "look"}, "script": [{"text": "fine"}]}
    kit = await make_kit(
        sandbox_tmp / "home", LoopConfig(retry=RetryPolicy(base_delay=0.01, jitter=0.0)), models=models
    )
    try:
        session = await kit.worker.create_session("scripted", script=[{"tool_calls": [task]}, {"text": "ok"}])
        turn = await run(kit, session.id, "delegate")
        events = await turn_events(kit, session.id, turn)
        (error,) = [e for e in events if e.type == "session.error"]
        assert error.data["purpose"] == "subagent" and error.data["retry"] == {
            "attempt": 1,
            "max": 3,
            "delay_ms": 10,
        }
        (result,) = [e for e in events if e.type == "agent.tool_result"]
        assert answer(result.data["content"][0]["text"]) == "fine" and not result.data["is_error"]
    finally:
        await kit.close()


async def test_the_reported_usage_triggers_compaction_at_the_threshold(
    recorded: tuple[Kit, list[ModelRequest]],
) -> None:
    """Window 10 000, reserve 2 000: a reply reporting 7 990 tokens leaves the next call under the
    threshold (7 990 + the next message's estimate <= 8 000); one reporting 8 001 does not."""
    kit, requests = recorded
    script = [
        {"text": "a", "usage": {"input_tokens": 7980, "output_tokens": 10}},
        {"text": "b", "usage": {"input_tokens": 7991, "output_tokens": 10}},
        {"text": "## Goal\nsummarised"},
        {"text": "c"},
    ]
    session = await kit.worker.create_session(
        "scripted", script=script, model_options={"context_window": 10_000},
        compaction={"reserve_tokens": 2000, "keep_recent_tokens": 1},
    )  # fmt: skip
    await run(kit, session.id, "one")
    second = await run(kit, session.id, "xy")  # 7 990 + 1 (estimate of "xy") = 7 991: no compaction
    assert not [e for e in await turn_events(kit, session.id, second) if e.type == COMPACTED_EVENT]
    third = await run(kit, session.id, "z")  # 8 001 + 1 > 8 000
    (event,) = [e for e in await turn_events(kit, session.id, third) if e.type == COMPACTED_EVENT]
    assert event.data["tokens_before"] == 8002 and requests[2].tools == []
    with pytest.raises(ScriptError, match="usage"):
        await kit.worker.create_session("scripted", script=[{"usage": {"input_tokens": -1}}])


async def test_an_agent_with_its_own_model_gets_the_sessions_options_only_from_the_same_provider(
    sandbox_tmp: Path,
) -> None:
    built: list[tuple[str, dict[str, Any]]] = []

    def models(session: Session) -> Model:
        built.append((session.model, dict(session.model_options)))
        return ScriptedModel(session.script or [])

    kit = await make_kit(sandbox_tmp / "home", models=models)
    kit.registry.settings.agents = [
        {"name": "other", "description": "another provider's model", "model": "anthropic:claude-x"},
        {"name": "same", "description": "this provider's model", "model": "scripted"},
    ]
    try:
        calls = [
            {"name": "task", "input": {"agent": name, "prompt": "p"}, "script": [{"text": f"from {name}"}]}
            for name in ("other", "same")
        ]
        session = await kit.worker.create_session(
            "scripted", script=[{"tool_calls": calls}, {"text": "done"}], model_options={"temperature": 0.5}
        )
        turn = await run(kit, session.id, "delegate")
        results = [answer(e.data["content"][0]["text"]) for e in await turn_events(kit, session.id, turn)
                   if e.type == "agent.tool_result"]  # fmt: skip
        assert sorted(results) == ["from other", "from same"]
        assert ("anthropic:claude-x", {}) in built  # no scripted options sent to another provider
        assert built.count(("scripted", {"temperature": 0.5})) == len(built) - 1
    finally:
        await kit.close()


async def test_describing_the_machine_starts_no_sandbox(recorded: tuple[Kit, list[ModelRequest]]) -> None:
    """The prompt describes the sandbox through an unstarted view of it (its workspace is a host
    folder): a turn that only talks starts nothing; the first tool call does."""
    kit, requests = recorded
    session = await kit.worker.create_session("scripted", script=[{"text": "just talk"}, bash("true"), {}])
    workspace = kit.registry.session_dir(session.id) / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "AGENTS.md").write_text("Seen without a sandbox.")
    (workspace / "AGENTS.md").chmod(0o644)
    (workspace / "CLAUDE.md").symlink_to("/etc/shadow")  # the sandbox's /etc, not the host's
    await run(kit, session.id, "hello")
    assert kit.registry.entries() == []
    system = requests[0].system
    assert "# CLAUDE.md" not in system and "root:" not in system
    assert "Seen without a sandbox." in system and "- AGENTS.md" in system
    assert "Machine: sandbox (sandbox, linux), workspace /workspace" in system
    turn = await run(kit, session.id, "now run something")
    assert [e.type for e in await turn_events(kit, session.id, turn)].count("sandbox.ready") == 1
    assert [e.machine.name for e in kit.registry.entries()] == ["sandbox"]


class Resuming:
    """The scripted model, with `resume: "$RUN"` in a task call replaced by `run[0]` (a run id the
    script cannot know in advance), keeping every request."""

    def __init__(self, model: Model, requests: list[ModelRequest], run: list[str]) -> None:
        self.model, self.requests, self.run, self.name = model, requests, run, model.name

    async def query(self, request: ModelRequest) -> Reply:
        self.requests.append(request)
        reply = await self.model.query(request)
        calls = [
            dataclasses.replace(c, input={**c.input, "resume": self.run[0]})
            if c.input.get("resume") == "$RUN"
            else c
            for c in reply.tool_calls
        ]
        return dataclasses.replace(reply, tool_calls=calls)


def resume_call(agent: str, prompt: str, script: list[Any]) -> dict[str, Any]:
    return {"name": "task", "input": {"agent": agent, "prompt": prompt, "resume": "$RUN"}, "script": script}


async def test_a_stored_subagent_run_is_resumed_with_its_own_history_and_refused_when_it_may_not_be(
    sandbox_tmp: Path,
) -> None:
    requests: list[ModelRequest] = []
    run_id: list[str] = []
    kit = await make_kit(
        sandbox_tmp / "home", models=lambda s: Resuming(ScriptedModel(s.script or []), requests, run_id)
    )
    try:
        first_child = [{"text": "I found A."}]
        resumed_child = [{"expect": {"user_message_contains": "and B?"}, "text": "A and B."}]
        script = [
            {"tool_calls": [task_call_of("researcher", "find A", first_child)]},
            {"text": "ok"},
            {"tool_calls": [resume_call("researcher", "and B?", resumed_child)]},
            {"text": "ok"},
            {"tool_calls": [resume_call("explore", "again", []), resume_call("researcher", "again", [])]},
            {"text": "ok"},
        ]
        session = await kit.worker.create_session("scripted", script=script, permission_mode="full-auto")
        await run(kit, session.id, "find A")
        (stored,) = await kit.worker.runs.of_session(session.id)
        assert (stored.agent, stored.tier, stored.status) == ("researcher", "full-auto", "completed")
        rows = await kit.worker.runs.messages(stored.id)
        assert [(m.role, m.content["text"]) for m in rows] == [
            ("user", "find A"),
            ("assistant", "I found A."),
        ]
        run_id.append(stored.id)

        second = await run(kit, session.id, "resume it")
        child = [r for r in requests if r.task_path == ("toolu_s2_0",)]
        assert [(m.role, m.text) for m in child[0].messages] == [
            ("user", "find A"), ("assistant", "I found A."), ("user", "and B?"),
        ]  # fmt: skip
        rows = await kit.worker.runs.messages(stored.id)
        assert [m.content["text"] for m in rows] == ["find A", "I found A.", "and B?", "A and B."]
        resumed = next(e for e in await turn_events(kit, session.id, second) if e.type == "subagent.started")
        assert resumed.data["subagent_id"] == stored.id and resumed.data["resumed"] is True
        assert (await kit.worker.runs.get(session.id, stored.id)).turn_id == second

        await kit.worker.update_session(session.id, {"permission_mode": "full-ask"})  # permissions shrink
        third = await run(kit, session.id, "resume again")
        results = [e.data for e in await turn_events(kit, session.id, third) if e.type == "agent.tool_result"]
        by_call = {r["tool_use_id"]: r for r in results}  # the two ran in parallel: any order
        assert all(r["is_error"] for r in results) and len(by_call) == 2
        assert "was the researcher agent's" in by_call["toolu_s4_0"]["content"][0]["text"]
        shrank = by_call["toolu_s4_1"]["content"][0]["text"]
        assert "ran under full-auto" in shrank and "narrower now (full-ask)" in shrank

        other = await kit.worker.create_session(
            "scripted", script=[{"tool_calls": [resume_call("researcher", "steal", [])]}, {"text": "ok"}],
            permission_mode="full-auto",
        )  # fmt: skip
        turn = await run(kit, other.id, "resume the other session's task")
        (refused,) = [e.data for e in await turn_events(kit, other.id, turn) if e.type == "agent.tool_result"]
        assert (
            refused["is_error"]
            and refused["content"][0]["text"] == f"No task {stored.id} in this session to resume."
        )
    finally:
        await kit.close()
