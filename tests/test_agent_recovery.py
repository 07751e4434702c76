"""Recovery after a crash: a subprocess runs turns on a home and is killed with SIGKILL mid-turn;
a worker started again in-process on the same home must lose nothing, end every turn exactly
once and never re-run a recorded tool call (counted by a side-effect file the bash calls append to).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.recovery import RECOVERY, Act, State
from agentbox.agent.subagents import INTERRUPTED_NOTICE
from agentbox.store.approvals import ApprovalsRepo, Decision
from agentbox.store.db import Database, load_migrations
from agentbox.store.sessions import INTERRUPTED, TERMINAL_EVENTS, Event, Message, SessionStore, insert_message
from agentbox.store.subagents import SubagentRuns
from tests.test_agent_loop import DEADLINE, Kit, bash, make_kit, terminal, wait_for

#: The server stand-in: opens the home, recovers, runs turns until killed.
CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.test_agent_loop import make_kit

    async def main() -> None:
        kit = await make_kit(Path({home!r}))
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


def spawn(home: Path) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parent.parent)
    code = CHILD.format(root=root, home=str(home))
    return subprocess.Popen([sys.executable, "-c", code], cwd=root)


async def until(store: SessionStore, session_id: str, check: Callable[[list[Message]], bool]) -> None:
    """Poll the transcript (with a deadline) until `check` holds."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not check(await store.transcript(session_id)):
        assert asyncio.get_running_loop().time() < deadline, "the child never reached the state"
        await asyncio.sleep(0.02)


async def prepare(home: Path, script: list[dict[str, Any]], messages: int) -> tuple[str, list[str]]:
    """A session with `messages` accepted turns, written by the store alone (no worker runs them)."""
    async with Database.in_home(home) as db:
        store = SessionStore(db)
        session, _ = await store.create_session("scripted", permission_mode="full-auto", script=script)
        turns = [(await store.submit(session.id, f"message {i}")).turn.id for i in range(messages)]
    return session.id, turns


def kill(child: subprocess.Popen[bytes]) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(DEADLINE)


async def check_log(kit: Kit, session_id: str, turns: list[str]) -> None:
    events = await kit.store.list_events(session_id, limit=1000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    for turn_id in turns:
        ends = [e for e in events if e.turn_id == turn_id and e.type in TERMINAL_EVENTS]
        status = (await kit.store.get_turn(turn_id)).status
        assert [e.type for e in ends] == [f"turn.{status}"]
    assert [e.data["content"] for e in events if e.type == "user.message"] == [
        f"message {i}" for i in range(len(turns))
    ]


def side_lines(kit: Kit, session_id: str) -> list[str]:
    return (kit.registry.session_dir(session_id) / "workspace" / "side.txt").read_text().splitlines()


def in_second_model_call(rows: list[Message]) -> bool:
    return any(m.role == "tool" for m in rows) and any(m.status == "streaming" for m in rows)


async def test_kill_during_a_model_call_then_restart(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    script = [
        bash("echo ran >> /workspace/side.txt"),
        {"hang": True},
        {"expect": {"tool_result_contains": ""}, "text": "recovered"},
        {"text": "second turn"},
    ]
    session_id, turns = await prepare(home, script, 2)
    child = spawn(home)
    try:
        async with Database.in_home(home) as db:
            # the hanging call: the bash call's own reply was streaming for a moment too, so wait
            # for its result first, or the kill may land during the bash call instead
            await until(SessionStore(db), session_id, in_second_model_call)
    finally:
        kill(child)
    kit = await make_kit(home)
    try:
        for turn_id in turns:
            assert (await terminal(kit, session_id, turn_id)).type == "turn.completed"
        await check_log(kit, session_id, turns)
        assert side_lines(kit, session_id) == ["ran"]
        replies = [m.status for m in await kit.store.transcript(session_id) if m.role == "assistant"]
        assert replies == ["complete", "aborted", "complete", "complete"]
        assert (await kit.store.get_turn(turns[0])).attempt == 2
        texts = [
            e.data["content"][0]["text"]
            for e in await kit.store.list_events(session_id, limit=1000)
            if e.type == "agent.message"
        ]
        assert texts == ["recovered", "second turn"]
    finally:
        await kit.close()


async def test_kill_during_a_tool_call_reports_it_interrupted_and_never_reruns_it(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    script = [
        bash("echo ran >> /workspace/side.txt; sleep 600"),
        {"expect": {"tool_result_contains": "interrupted"}, "text": "the model saw it"},
    ]
    session_id, turns = await prepare(home, script, 1)
    side = home / "sessions" / session_id / "workspace" / "side.txt"
    child = spawn(home)
    try:
        deadline = asyncio.get_running_loop().time() + DEADLINE
        while not (side.exists() and side.read_text()):
            assert asyncio.get_running_loop().time() < deadline, "the tool never ran"
            await asyncio.sleep(0.02)
    finally:
        kill(child)
    kit = await make_kit(home)
    try:
        assert (await terminal(kit, session_id, turns[0])).type == "turn.completed"
        await check_log(kit, session_id, turns)
        assert side_lines(kit, session_id) == ["ran"]
        results = [
            e for e in await kit.store.list_events(session_id, limit=1000) if e.type == "agent.tool_result"
        ]
        assert len(results) == 1 and results[0].data["is_error"]
        assert results[0].data["content"][0]["text"] == INTERRUPTED
    finally:
        await kit.close()


async def test_repair_reruns_read_only_tools_and_interrupts_the_rest(sandbox_tmp: Path) -> None:
    """The table's tools_unresolved row, set up by writing the crashed state directly."""
    home = sandbox_tmp / "home"
    session_id, turns = await prepare(home, [{"text": "after repair"}], 1)
    workspace = home / "sessions" / session_id / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "a.txt").write_text("alpha")
    calls = [
        {"id": "toolu_read", "name": "read_file", "input": {"path": "/workspace/a.txt"}},
        {"id": "toolu_bash", "name": "bash", "input": {"command": "echo ran >> /workspace/side.txt"}},
    ]
    async with Database.in_home(home) as db:
        store = SessionStore(db)
        await store.start_turn(turns[0])

        def crashed(conn: Any) -> None:
            insert_message(conn, session_id, turns[0], "assistant", {"text": "", "tool_calls": calls})

        await db.transaction(crashed)
    kit = await make_kit(home)
    try:
        assert (await terminal(kit, session_id, turns[0])).type == "turn.completed"
        results = {
            m.tool_use_id: m.content for m in await kit.store.transcript(session_id) if m.role == "tool"
        }
        assert "alpha" in results["toolu_read"]["content"] and not results["toolu_read"]["is_error"]
        assert results["toolu_bash"] == {
            "tool_use_id": "toolu_bash", "name": "bash", "content": INTERRUPTED, "is_error": True,
        }  # fmt: skip
        assert not (workspace / "side.txt").exists()
        await check_log(kit, session_id, turns)
    finally:
        await kit.close()


async def test_a_turn_awaiting_approval_stays_waiting_after_a_restart(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    async with Database.in_home(home) as db:
        store = SessionStore(db)
        session, _ = await store.create_session("scripted", permission_mode="full-ask", script=[])
        first = (await store.submit(session.id, "message 0")).turn.id
        second = (await store.submit(session.id, "message 1")).turn.id
        await store.start_turn(first)
        await store.set_waiting(first, True)
    kit = await make_kit(home)
    try:
        await kit.worker.idle(session.id)
        assert (await kit.store.get_turn(first)).status == "awaiting_approval"
        assert (await kit.store.get_turn(second)).status == "queued"
        assert (await kit.worker.abort(first)).status == "aborted"
        assert (await terminal(kit, session.id, second)).type == "turn.completed"
    finally:
        await kit.close()


async def two_turns_left_asking(home: Path, script: list[Any]) -> tuple[str, list[str], Event]:
    """A full-ask session with two turns, the first waiting for its approval; then a graceful
    shutdown (the question survives it). (session id, turn ids, the approval.requested event)."""
    kit = await make_kit(home)
    try:
        session = await kit.worker.create_session("scripted", permission_mode="full-ask", script=script)
        turns = [(await kit.worker.submit(session.id, f"message {i}")).turn.id for i in range(2)]
        asked = await wait_for(kit, session.id, lambda e: e.type == "approval.requested")
    finally:
        await kit.close()
    return session.id, turns, asked


@pytest.mark.parametrize("decision", ["allow", "deny"])
async def test_answering_an_approval_after_a_restart_resumes_the_turn(
    sandbox_tmp: Path, decision: Decision
) -> None:
    """Graceful restart (close, then a new worker on the same home): the question survives, and
    answering it through the new worker runs the call once (allow) or tells the model (deny)."""
    home = sandbox_tmp / "home"
    seen = "wrote" if decision == "allow" else "not now"
    script = [
        bash("echo ran >> /workspace/side.txt; echo wrote"),
        {"expect": {"tool_result_contains": seen}, "text": "resumed"},
        {"text": "second turn"},
    ]
    session_id, turns, asked = await two_turns_left_asking(home, script)
    kit = await make_kit(home)
    try:
        await kit.worker.idle(session_id)
        assert (await kit.store.get_turn(turns[0])).status == "awaiting_approval"
        assert [a.id for a in await kit.approvals.repo.pending(session_id)] == [asked.data["approval_id"]]
        side = kit.registry.session_dir(session_id) / "workspace" / "side.txt"
        assert not side.exists()
        await kit.approvals.resolve(asked.data["approval_id"], decision, message="not now")
        for turn_id in turns:
            assert (await terminal(kit, session_id, turn_id)).type == "turn.completed"
        await check_log(kit, session_id, turns)
        if decision == "allow":
            assert side_lines(kit, session_id) == ["ran"]
        else:
            assert not side.exists()
        results = [
            e for e in await kit.store.list_events(session_id, limit=1000) if e.type == "agent.tool_result"
        ]
        assert len(results) == 1 and results[0].data["is_error"] == (decision == "deny")
        assert seen in results[0].data["content"][0]["text"]
        assert await kit.approvals.repo.pending(session_id) == []
        (resolved,) = [e for e in await kit.store.list_events(session_id) if e.type == "approval.resolved"]
        assert resolved.data["tool_use_id"] == asked.data["tool_use_id"] == results[0].data["tool_use_id"]
    finally:
        await kit.close()


async def test_a_tool_allowed_before_a_crash_but_not_recorded_is_interrupted_not_rerun(
    sandbox_tmp: Path,
) -> None:
    """An approval answered `allow` by an earlier process: the call may have run, so it is not run
    again (only an answer this process saw arrive resumes a call)."""
    home = sandbox_tmp / "home"
    script = [
        bash("echo ran >> /workspace/side.txt"),
        {"expect": {"tool_result_contains": "interrupted"}, "text": "the model saw it"},
    ]
    kit = await make_kit(home)
    try:
        session = await kit.worker.create_session("scripted", permission_mode="full-ask", script=script)
        turn_id = (await kit.worker.submit(session.id, "message 0")).turn.id
        asked = await wait_for(kit, session.id, lambda e: e.type == "approval.requested")
    finally:
        await kit.close()
    async with Database.in_home(home) as db:  # the crashed state: answered, turn back to running
        await ApprovalsRepo(db).resolve(asked.data["approval_id"], "allow")
        await SessionStore(db).set_waiting(turn_id, False)
    kit = await make_kit(home)
    try:
        assert (await terminal(kit, session.id, turn_id)).type == "turn.completed"
        assert not (kit.registry.session_dir(session.id) / "workspace" / "side.txt").exists()
    finally:
        await kit.close()


def test_the_recovery_table_covers_every_state() -> None:
    assert set(RECOVERY) == set(State)
    assert RECOVERY[State.AWAITING_APPROVAL] == Act.WAIT
    assert RECOVERY[State.TOOLS_UNRESOLVED] == Act.REPAIR


async def test_a_turn_resumed_mid_way_tells_its_signals_only_at_the_next_turn(sandbox_tmp: Path) -> None:
    """The mode changes while a turn waits across a restart: no signal may land between the
    waiting call and its result (providers refuse that); the next turn is told."""
    home = sandbox_tmp / "home"
    script = [
        bash("echo ran"),
        {"expect": {"tool_result_contains": "ran"}, "text": "resumed"},
        {"text": "next"},
    ]
    session_id, turns, asked = await two_turns_left_asking(home, script)
    kit = await make_kit(home)
    try:
        await kit.worker.update_session(session_id, {"permission_mode": "full-auto"})
        await kit.approvals.resolve(asked.data["approval_id"], "allow")
        for turn_id in turns:
            assert (await terminal(kit, session_id, turn_id)).type == "turn.completed"
        rows = await kit.store.transcript(session_id)
        first = [(m.role, "signal" in m.content) for m in rows if m.turn_id == turns[0]]
        assert first == [("user", False), ("assistant", False), ("tool", False), ("assistant", False)]
        second = [(m.role, "signal" in m.content) for m in rows if m.turn_id == turns[1]]
        assert second == [("user", False), ("user", True), ("assistant", False)]
    finally:
        await kit.close()


async def test_a_message_joined_after_the_last_reply_is_answered_after_a_restart(sandbox_tmp: Path) -> None:
    """The process died after a message joined at the would-stop boundary, before the model
    call that answers it: the turn is not complete, it goes on and answers it."""
    home = sandbox_tmp / "home"
    script = [{"text": "first"}, {"expect": {"user_message_contains": "message 1"}, "text": "second"}]
    async with Database.in_home(home) as db:
        store = SessionStore(db)
        session, _ = await store.create_session("scripted", permission_mode="full-auto", script=script)
        first = (await store.submit(session.id, "message 0")).turn.id
        await store.start_turn(first)
        reply = await store.open_reply(first)
        await store.close_reply(reply, "complete", {"text": "first", "tool_calls": []}, [])
        second = (await store.submit(session.id, "message 1")).turn.id
        assert [e.type for e in await store.join_queued(first)] == ["user.message", "turn.joined"]
    kit = await make_kit(home)
    try:
        for turn_id in (first, second):
            assert (await terminal(kit, session.id, turn_id)).type == "turn.completed"
        replies = [m.content["text"] for m in await kit.store.transcript(session.id) if m.role == "assistant"]
        assert replies == ["first", "second"]
    finally:
        await kit.close()


async def test_subagent_runs_written_before_interrupted_existed_survive_its_migration(tmp_path: Path) -> None:
    """The tables are rebuilt to widen a CHECK: rows, transcripts and the cascade all stay."""
    shipped = load_migrations()
    before = [m for m in shipped if m.version < 12]
    async with Database(tmp_path / "x.db", migrations=before) as db:
        session, _ = await SessionStore(db).create_session("scripted", permission_mode="full-auto", script=[])
        await db.execute(
            "INSERT INTO subagent_runs (id, session_id, tool_use_id, agent, tier, status, created_at, updated_at)"
            " VALUES ('sub_1', ?, 'toolu_1', 'explore', 'read-only', 'completed', 't', 't')",
            (session.id,),
        )
        await db.execute(
            "INSERT INTO subagent_messages (run_id, role, content, created_at) VALUES ('sub_1', 'user', '{\"text\": \"hi\"}', 't')"
        )
    async with Database(tmp_path / "x.db", migrations=shipped) as db:
        runs = SubagentRuns(db)
        run = await runs.get(session.id, "sub_1")
        assert (run.status, run.background) == ("completed", False)
        assert [m.content["text"] for m in await runs.messages("sub_1")] == ["hi"]
        refs = await db.fetchall("PRAGMA foreign_key_list(subagent_messages)")
        assert [r["table"] for r in refs] == ["subagent_runs"]
        await runs.set_status("sub_1", "interrupted")  # the widened CHECK takes it
        await SessionStore(db).delete_session(session.id)
        assert await db.fetchall("SELECT * FROM subagent_messages") == []


async def test_a_subagent_run_a_dead_process_left_running_ends_interrupted_at_start(sandbox_tmp: Path) -> None:
    """It can be resumed then (a run still `running` cannot); a background one's parent is told."""
    home = sandbox_tmp / "home"
    async with Database.in_home(home) as db:
        session, _ = await SessionStore(db).create_session("scripted", permission_mode="full-auto", script=[])
        runs = SubagentRuns(db)
        run = await runs.create(session.id, None, "toolu_s0_0", "explore", "read-only", False)
        loose = await runs.create(session.id, None, "toolu_s0_1", "explore", "read-only", False, True)
        assert (run.status, run.background, loose.background) == ("running", False, True)
    kit = await make_kit(home)
    try:
        assert (await kit.worker.runs.get(session.id, run.id)).status == "interrupted"
        assert (await kit.worker.runs.get(session.id, loose.id)).status == "interrupted"
        told = await wait_for(kit, session.id, lambda e: e.type == "subagent.completed")
        assert told.turn_id is None  # no open turn: the session's
        assert (told.data["subagent_id"], told.data["status"], told.data["background"]) == (
            loose.id, "interrupted", True,
        )  # fmt: skip
        assert INTERRUPTED_NOTICE.format(agent="explore", id=loose.id) == told.data["result"]
        (owed,) = await kit.worker.runs.pending_notices()  # only the background one owes a notice
        assert owed[0].id == loose.id and owed[1] is None
    finally:
        await kit.close()


async def test_a_background_task_cut_short_by_a_restart_is_told_to_its_parent_once(sandbox_tmp: Path) -> None:
    """The server stops while a background task runs: after the next start the parent's next
    turn is told it was interrupted (with how to resume it), and no turn after that again."""
    home = sandbox_tmp / "home"
    task = {"name": "task", "input": {"agent": "explore", "prompt": "look", "background": True},
            "script": [{"hang": True}]}  # fmt: skip
    script = [
        {"tool_calls": [task]},
        {"text": "started"},
        {"expect": {"user_message_contains": "The server stopped while this task ran"}, "text": "noted"},
        {"text": "nothing new"},
    ]
    kit = await make_kit(home)
    try:
        session = await kit.worker.create_session("scripted", script=script, permission_mode="full-auto")
        first = (await kit.worker.submit(session.id, "start it")).turn.id
        assert (await terminal(kit, session.id, first)).type == "turn.completed"
        await wait_for(kit, session.id, lambda e: e.type == "subagent.started")
        (run,) = await kit.worker.runs.of_session(session.id)
        assert run.status == "running" and run.background
    finally:
        await kit.close()  # a graceful stop: the task is cancelled
    kit = await make_kit(home)
    try:
        told = await wait_for(kit, session.id, lambda e: e.type == "subagent.completed")
        assert told.data["status"] == "interrupted" and told.data["subagent_id"] == run.id
        second = (await kit.worker.submit(session.id, "what happened?")).turn.id
        end = await terminal(kit, session.id, second)
        assert end.type == "turn.completed", end.data  # the script's expectation held
        signals = [m for m in await kit.store.transcript(session.id) if m.turn_id == second and m.role == "user"]
        assert 'task_id="toolu_s0_0" agent="explore" status="interrupted"' in signals[-1].content["text"]
        assert f"resume={run.id}" in signals[-1].content["text"]
    finally:
        await kit.close()
    kit = await make_kit(home)
    try:
        assert await kit.worker.runs.pending_notices() == []
        third = (await kit.worker.submit(session.id, "anything?")).turn.id
        assert (await terminal(kit, session.id, third)).type == "turn.completed"
        rows = [m for m in await kit.store.transcript(session.id) if m.turn_id == third and m.role == "user"]
        assert len(rows) == 1  # the message alone: the notice was told once
        assert (await kit.worker.runs.get(session.id, run.id)).status == "interrupted"
    finally:
        await kit.close()


async def test_a_background_tasks_notice_not_told_before_a_restart_is_told_after_it(sandbox_tmp: Path) -> None:
    """It finished after its turn ended and the server stopped before the next turn: its final
    message still reaches the parent."""
    home = sandbox_tmp / "home"
    task = {"name": "task", "input": {"agent": "explore", "prompt": "look", "background": True},
            "script": [{"delay_ms": 200, "text": "The value is 42."}]}  # fmt: skip
    script = [
        {"tool_calls": [task]},
        {"text": "started"},
        {"expect": {"user_message_contains": "The value is 42."}, "text": "it is 42"},
    ]
    kit = await make_kit(home)
    try:
        session = await kit.worker.create_session("scripted", script=script, permission_mode="full-auto")
        first = (await kit.worker.submit(session.id, "start it")).turn.id
        assert (await terminal(kit, session.id, first)).type == "turn.completed"
        done = await wait_for(kit, session.id, lambda e: e.type == "subagent.completed")
        assert done.data["status"] == "completed"
    finally:
        await kit.close()
    kit = await make_kit(home)
    try:
        second = (await kit.worker.submit(session.id, "and?")).turn.id
        end = await terminal(kit, session.id, second)
        assert end.type == "turn.completed", end.data
        assert await kit.worker.runs.pending_notices() == []
    finally:
        await kit.close()
