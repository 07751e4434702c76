"""The turn loop and the worker on real parts: a SQLite file, real bubblewrap sandboxes, the real
tools, the scripted model. Every wait is for a condition (an event in the log), with a deadline."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.events import EventBus
from agentbox.agent.inputs import variant
from agentbox.agent.loop import MAX_STEPS, LoopConfig
from agentbox.agent.models import ScriptError
from agentbox.agent.providers.arguments import INVALID_ARGUMENTS
from agentbox.agent.providers.retry import RetryPolicy
from agentbox.agent.worker import ModelFactory, Worker
from agentbox.machines.registry import Registry
from agentbox.store.approvals import ApprovalsRepo
from agentbox.store.changes import ChangesRepo
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.store.markers import MarkersRepo
from agentbox.store.sessions import NOT_RUN, TERMINAL_EVENTS, Event, SessionStore
from agentbox.store.todos import TodoRepo
from agentbox.tools.approvals import Approvals
from agentbox.tools.changes import ChangeSets
from tests.conftest import sandbox_settings

#: Seconds a test waits for an event before failing.
DEADLINE = 20.0


@dataclass
class Kit:
    db: Database
    store: SessionStore
    bus: EventBus
    registry: Registry
    files: FileStore
    approvals: Approvals
    worker: Worker
    home: Path

    async def close(self) -> None:
        await self.worker.close()
        await self.registry.shutdown()
        await self.db.close()


async def make_kit(home: Path, config: LoopConfig | None = None, models: ModelFactory | None = None) -> Kit:
    db = await Database.in_home(home).connect()
    store = SessionStore(db)
    bus = EventBus(store)
    registry = Registry(sandbox_settings(home), MarkersRepo(db))
    files = FileStore(db, home)
    approvals = Approvals(ApprovalsRepo(db))
    worker = Worker(
        store,
        bus,
        registry,
        files,
        approvals,
        ChangeSets(ChangesRepo(db)),
        TodoRepo(db),
        config=config,
        **({"models": models} if models is not None else {}),
    )
    await registry.recover()  # what a server does at start: dead sandboxes' leftovers go
    await worker.start()
    return Kit(db, store, bus, registry, files, approvals, worker, home)


@pytest.fixture
async def kit(sandbox_tmp: Path) -> AsyncIterator[Kit]:
    k = await make_kit(sandbox_tmp / "home")
    yield k
    await k.close()


async def wait_for(kit: Kit, session_id: str, predicate: Any, after: int = 0) -> Event:
    """The first event (seq > after) that satisfies `predicate`, read through the subscription."""

    async def find() -> Event:
        async for event in kit.bus.subscribe(session_id, after):
            assert event is not None
            if predicate(event):
                return event
        raise AssertionError("subscription ended")

    return await asyncio.wait_for(find(), DEADLINE)


async def terminal(kit: Kit, session_id: str, turn_id: str) -> Event:
    return await wait_for(kit, session_id, lambda e: e.turn_id == turn_id and e.type in TERMINAL_EVENTS)


async def model_call_in_flight(kit: Kit, session_id: str, turn_id: str) -> None:
    """Poll (with a deadline) until the turn's model call has started: its reply row is streaming."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not any(
        m.turn_id == turn_id and m.status == "streaming" for m in await kit.store.transcript(session_id)
    ):
        assert asyncio.get_running_loop().time() < deadline, "the model call never started"
        await asyncio.sleep(0.01)


async def turn_events(kit: Kit, session_id: str, turn_id: str) -> list[Event]:
    return await kit.store.list_events(session_id, turn_id=turn_id, limit=1000)


def bash(command: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "bash", "input": {"command": command}}]}


async def test_a_scripted_turn_runs_tools_and_records_every_event(kit: Kit) -> None:
    script = [
        {"text": "Let me look.", **bash("echo hello > note.txt && cat note.txt")},
        {"expect": {"tool_result_contains": "hello"}, "text": "Done."},
    ]
    session = await kit.worker.create_session("scripted", script=script)
    sub = await kit.worker.submit(session.id, "write a note")
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed" and end.data["stop_reason"] == "end_turn"
    types = [e.type for e in await turn_events(kit, session.id, sub.turn.id)]
    assert types == [
        "user.message", "turn.queued", "turn.started",
        "agent.message", "agent.tool_use", "model.usage",
        "sandbox.ready",  # started by the first tool call: describing it in the prompt starts nothing
        "agent.tool_result",
        "agent.message", "model.usage", "turn.completed",
    ]  # fmt: skip
    events = await turn_events(kit, session.id, sub.turn.id)
    use = next(e for e in events if e.type == "agent.tool_use")
    result = next(e for e in events if e.type == "agent.tool_result")
    assert use.data["permission"] == "allow" and use.data["name"] == "bash"
    assert result.data["tool_use_id"] == use.data["tool_use_id"] and not result.data["is_error"]
    assert result.data["name"] == "bash"  # a reader of results alone knows which tool spoke
    assert "hello" in result.data["content"][0]["text"]
    ready = next(e for e in events if e.type == "sandbox.ready")
    assert ready.data["state"] == "created"
    all_seqs = [e.seq for e in await kit.store.list_events(session.id, limit=1000)]
    assert all_seqs == list(range(1, len(all_seqs) + 1))
    assert (await kit.store.get_turn(sub.turn.id)).status == "completed"


async def test_a_failed_expectation_fails_the_turn_with_a_clear_error(kit: Kit) -> None:
    script = [bash("echo one"), {"expect": {"tool_result_contains": "two"}, "text": "never"}]
    session = await kit.worker.create_session("scripted", script=script)
    sub = await kit.worker.submit(session.id, "go")
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.failed"
    assert end.data["error"]["type"] == "script_error"
    assert "'two'" in end.data["error"]["message"] and "one" in end.data["error"]["message"]


async def test_a_malformed_script_is_refused_at_creation(kit: Kit) -> None:
    with pytest.raises(ScriptError, match="unknown keys"):
        await kit.worker.create_session("scripted", script=[{"txt": "typo"}])


async def test_retryable_model_errors_back_off_then_fail_after_the_last_attempt(sandbox_tmp: Path) -> None:
    policy = RetryPolicy(base_delay=0.05, jitter=0.0)
    k = await make_kit(sandbox_tmp / "home", LoopConfig(retry=policy))
    try:
        script = [
            {"error": "rate_limited"}, {"error": "overloaded"}, {"text": "ok"},
            {"error": "overloaded"}, {"error": "overloaded"}, {"error": "overloaded"},
        ]  # fmt: skip
        session = await k.worker.create_session("scripted", script=script)
        first = await k.worker.submit(session.id, "one")
        end = await terminal(k, session.id, first.turn.id)
        assert end.type == "turn.completed"
        errors = [e for e in await turn_events(k, session.id, first.turn.id) if e.type == "session.error"]
        assert [e.data["error"]["type"] for e in errors] == ["model_rate_limited", "model_unavailable"]
        assert [e.data["retry"] for e in errors] == [
            {"attempt": 1, "max": 3, "delay_ms": 50},
            {"attempt": 2, "max": 3, "delay_ms": 100},  # doubled
        ]
        second = await k.worker.submit(session.id, "two")
        end = await terminal(k, session.id, second.turn.id)
        assert end.type == "turn.failed" and end.data["error"]["type"] == "model_unavailable"
        errors = [e for e in await turn_events(k, session.id, second.turn.id) if e.type == "session.error"]
        assert len(errors) == policy.attempts and "retry" not in errors[-1].data
    finally:
        await k.close()


async def test_the_step_cap_completes_with_max_steps(sandbox_tmp: Path) -> None:
    k = await make_kit(sandbox_tmp / "home", LoopConfig(max_steps=2))
    try:
        session = await k.worker.create_session("scripted", script=[bash("true")] * 3)
        sub = await k.worker.submit(session.id, "loop")
        end = await terminal(k, session.id, sub.turn.id)
        assert end.type == "turn.completed" and end.data["stop_reason"] == "max_steps"
        usages = [e for e in await turn_events(k, session.id, sub.turn.id) if e.type == "model.usage"]
        assert len(usages) == 2
    finally:
        await k.close()
    assert MAX_STEPS >= 2


async def test_turns_of_a_session_run_one_at_a_time_in_fifo_order(sandbox_tmp: Path) -> None:
    """Messages that do not join the running turn (here: its one step is its last, which takes
    nothing in) run as their own turns, one at a time, in the order they were sent."""
    kit = await make_kit(sandbox_tmp / "home", LoopConfig(max_steps=1))
    try:
        session = await kit.worker.create_session(
            "scripted", script=[{"delay_ms": 50, "text": "a"}, {"text": "b"}, {"text": "c"}]
        )
        subs = [await kit.worker.submit(session.id, f"m{i}") for i in range(3)]
        await terminal(kit, session.id, subs[-1].turn.id)
        log = await kit.store.list_events(session.id, limit=1000)
        lifecycle = [(e.type, e.turn_id) for e in log if e.type in ("turn.started", "turn.completed")]
        ids = [s.turn.id for s in subs]
        assert lifecycle == [(kind, t) for t in ids for kind in ("turn.started", "turn.completed")]
        texts = [e.data["content"][0]["text"] for e in log if e.type == "agent.message"]
        assert texts == ["a", "b", "c"]
    finally:
        await kit.close()


async def test_abort_unblocks_a_hanging_model_and_the_next_turn_runs(kit: Kit) -> None:
    session = await kit.worker.create_session("scripted", script=[{"hang": True}, {"text": "next"}])
    hung = await kit.worker.submit(session.id, "hang")
    queued = await kit.worker.submit(session.id, "after")
    await model_call_in_flight(kit, session.id, hung.turn.id)
    turn = await kit.worker.abort(hung.turn.id)
    assert turn.status == "aborted"
    end = await terminal(kit, session.id, queued.turn.id)
    assert end.type == "turn.completed"
    aborted = await turn_events(kit, session.id, hung.turn.id)
    assert [e.type for e in aborted if e.type in TERMINAL_EVENTS] == ["turn.aborted"]
    assert aborted[-1].data["reason"] == "user_abort"
    rows = [m for m in await kit.store.transcript(session.id) if m.turn_id == hung.turn.id]
    assert [m.status for m in rows if m.role == "assistant"] == ["aborted"]


async def test_a_call_aborted_while_it_waits_for_approval_reads_as_never_run(kit: Kit) -> None:
    """It never started, so "interrupted, outcome unknown" would be untrue."""
    session = await kit.worker.create_session(
        "scripted", permission_mode="full-ask", script=[bash("touch ran")]
    )
    sub = await kit.worker.submit(session.id, "run it")
    await wait_for(kit, session.id, lambda e: e.type == "approval.requested")
    assert (await kit.worker.abort(sub.turn.id)).status == "aborted"
    events = await turn_events(kit, session.id, sub.turn.id)
    [result] = [e for e in events if e.type == "agent.tool_result"]
    assert result.data["is_error"] and result.data["content"][0]["text"] == NOT_RUN
    assert [e.data["decision"] for e in events if e.type == "approval.resolved"] == ["cancelled"]


async def test_abort_of_a_queued_turn_is_immediate_and_final(kit: Kit) -> None:
    session = await kit.worker.create_session("scripted", script=[{"hang": True}])
    first = await kit.worker.submit(session.id, "hang")
    second = await kit.worker.submit(session.id, "queued")
    await model_call_in_flight(kit, session.id, first.turn.id)
    assert (await kit.worker.abort(second.turn.id)).status == "aborted"
    assert (await kit.worker.abort(second.turn.id)).status == "aborted"  # idempotent
    await kit.worker.abort(first.turn.id)
    for sub in (first, second):
        ends = [e for e in await turn_events(kit, session.id, sub.turn.id) if e.type in TERMINAL_EVENTS]
        assert [e.type for e in ends] == ["turn.aborted"]


async def test_abort_racing_completion_leaves_exactly_one_terminal_event(kit: Kit) -> None:
    """Property: whatever the interleaving, one terminal event per turn, matching its status."""
    rng = random.Random(5)
    session = await kit.worker.create_session("scripted", script=[{"text": "x"}] * 200)
    turns = []
    for _ in range(40):
        sub = await kit.worker.submit(session.id, "race")
        turns.append(sub.turn.id)
        for _ in range(rng.randrange(0, 12)):
            await asyncio.sleep(0)  # a yield, not a wait: it moves the race point
        if rng.random() < 0.8:
            await kit.worker.abort(sub.turn.id)
    for turn_id in turns:
        await terminal(kit, session.id, turn_id)
    await kit.worker.idle(session.id)
    outcomes = set()
    for turn_id in turns:
        ends = [e for e in await turn_events(kit, session.id, turn_id) if e.type in TERMINAL_EVENTS]
        status = (await kit.store.get_turn(turn_id)).status
        assert len(ends) == 1 and ends[0].type == f"turn.{status}"
        outcomes.add(status)
    assert outcomes == {"completed", "aborted"}, "the race should go both ways in 40 tries"
    seqs = [e.seq for e in await kit.store.list_events(session.id, limit=1000)]
    assert seqs == list(range(1, len(seqs) + 1))


async def upload(kit: Kit, tmp: Path, name: str, data: bytes, session_id: str) -> str:
    source = tmp / f"src-{random.random()}"
    source.write_bytes(data)
    record = await kit.files.put_path(source, name, session_id=session_id, source="upload")
    return str(record["id"])


def test_collision_names() -> None:
    assert [variant("data.csv", n) for n in (1, 2, 3)] == ["data.csv", "data (2).csv", "data (3).csv"]
    assert variant("a.tar.gz", 2) == "a.tar (2).gz"
    assert variant(".env", 2) == ".env (2)"
    assert variant("README", 3) == "README (3)"


async def test_inputs_are_placed_before_the_first_model_call_with_numbered_collisions(
    kit: Kit, sandbox_tmp: Path
) -> None:
    session = await kit.worker.create_session(
        "scripted", script=[bash("cat '/workspace/inputs/data (2).csv'"), {"text": "ok"}]
    )
    inputs = kit.registry.session_dir(session.id) / "workspace" / "inputs"
    inputs.mkdir(parents=True)
    (inputs / "data.csv").write_text("already here")
    a = await upload(kit, sandbox_tmp, "data.csv", b"first", session.id)
    b = await upload(kit, sandbox_tmp, "data.csv", b"second", session.id)
    sub = await kit.worker.submit(session.id, "read them", [a, b])
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed"
    events = await turn_events(kit, session.id, sub.turn.id)
    types = [e.type for e in events]
    assert types.index("sandbox.ready") < types.index("files.placed") < types.index("model.usage")
    placed = next(e for e in events if e.type == "files.placed").data["files"]
    assert [p["path"] for p in placed] == ["/workspace/inputs/data (2).csv", "/workspace/inputs/data (3).csv"]
    assert (inputs / "data (2).csv").read_bytes() == b"first"
    assert (inputs / "data (3).csv").read_bytes() == b"second"
    result = next(e for e in events if e.type == "agent.tool_result")
    assert "first" in result.data["content"][0]["text"]


async def test_a_placement_failure_fails_the_turn_with_internal_error(kit: Kit, sandbox_tmp: Path) -> None:
    session = await kit.worker.create_session("scripted", script=[{"text": "never"}])
    workspace = kit.registry.session_dir(session.id) / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "inputs").write_text("a file where the inputs folder should be")
    file_id = await upload(kit, sandbox_tmp, "data.csv", b"x", session.id)
    sub = await kit.worker.submit(session.id, "go", [file_id])
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.failed"
    assert end.data["error"]["type"] == "internal_error"
    assert "/workspace/inputs" in end.data["error"]["message"]
    assert not [e for e in await turn_events(kit, session.id, sub.turn.id) if e.type == "model.usage"]


async def test_an_approval_parks_the_turn_until_the_user_answers(kit: Kit) -> None:
    session = await kit.worker.create_session(
        "scripted", permission_mode="full-ask", script=[bash("echo approved"), {"text": "done"}]
    )
    sub = await kit.worker.submit(session.id, "run it")
    asked = await wait_for(kit, session.id, lambda e: e.type == "approval.requested")
    assert (await kit.store.get_turn(sub.turn.id)).status == "awaiting_approval"
    assert await kit.store.activity(session.id) == "awaiting_approval"
    use = next(e for e in await turn_events(kit, session.id, sub.turn.id) if e.type == "agent.tool_use")
    assert use.data["permission"] == "ask" and asked.data["tool_use_id"] == use.data["tool_use_id"]
    await kit.approvals.resolve(asked.data["approval_id"], "allow")
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed"
    events = await turn_events(kit, session.id, sub.turn.id)
    resolved = next(e for e in events if e.type == "approval.resolved")
    assert resolved.data["decision"] == "allow"
    result = next(e for e in events if e.type == "agent.tool_result")
    assert "approved" in result.data["content"][0]["text"]
    assert await kit.store.activity(session.id) == "idle"


async def test_unparsable_tool_arguments_become_an_error_result_not_a_failed_turn(kit: Kit) -> None:
    """A provider's tool call whose arguments were not JSON (marked by the adapter) is never run."""
    broken = {"tool_calls": [{"name": "bash", "input": {INVALID_ARGUMENTS: '{"command": "touch ran'}}]}
    script = [broken, {"expect": {"tool_result_contains": "not a valid JSON object"}, "text": "ok"}]
    session = await kit.worker.create_session("scripted", script=script)
    sub = await kit.worker.submit(session.id, "go")
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed"
    result = next(e for e in await turn_events(kit, session.id, sub.turn.id) if e.type == "agent.tool_result")
    assert result.data["is_error"]


async def test_mcp_servers_tools_join_the_toolset_and_failures_are_session_errors(
    kit: Kit, tmp_path: Path
) -> None:
    from tests.test_mcp_tools import SERVER_SCRIPT

    server = tmp_path / "server.py"
    server.write_text(SERVER_SCRIPT)
    kit.registry.settings.mcp_servers.update(  # the operator's servers (they run on the host)
        srv={"command": [sys.executable, str(server)]},
        gone={"command": [sys.executable, "-c", "raise SystemExit(3)"]},
    )
    servers = [{"server": "srv"}, {"server": "gone"}]
    call = {"tool_calls": [{"name": "mcp__srv__echo_v1", "input": {"text": "hi"}}]}
    script = [call, {"expect": {"tool_result_contains": "echo: hi"}, "text": "done"}]
    session = await kit.worker.create_session("scripted", script=script, mcp_servers=servers)
    sub = await kit.worker.submit(session.id, "go")
    end = await terminal(kit, session.id, sub.turn.id)
    assert end.type == "turn.completed", end.data
    errors = [e for e in await kit.store.list_events(session.id, limit=1000) if e.type == "session.error"]
    assert [e.data["server"] for e in errors] == ["gone"]


async def test_a_sessions_stdio_server_runs_in_its_sandbox_and_stops_when_the_session_is_idle(
    kit: Kit,
) -> None:
    """While the server runs the sandbox is busy; once the session has nothing left to run the
    server is stopped (the sandbox can be reclaimed), and the next turn starts it again."""
    from tests.adversarial.test_session_supplied import SANDBOX_MCP_SERVER

    call = {"tool_calls": [{"name": "mcp__box__where", "input": {}}]}
    done = {"expect": {"tool_result_contains": "cwd=/workspace"}, "text": "done"}
    servers = [{"name": "box", "command": ["python3", "/workspace/box_server.py"]}]
    session = await kit.worker.create_session(
        "scripted", script=[call, done, call, done], mcp_servers=servers
    )
    machine = await kit.registry.open(session.id)
    await machine.write("/workspace/box_server.py", SANDBOX_MCP_SERVER.encode())
    for _ in range(2):
        sub = await kit.worker.submit(session.id, "go")
        end = await terminal(kit, session.id, sub.turn.id)
        assert end.type == "turn.completed", end.data
        await kit.worker.idle(session.id)
        assert not machine.busy()  # type: ignore[attr-defined]
