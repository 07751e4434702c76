"""`agentbox run / sessions / events --url` against a real `agentbox serve` (uvicorn on loopback,
its own home, real sandboxes, the scripted model), driven as a user runs them: subprocesses, and a
pseudo-terminal where an approval is answered at the prompt. The client's own home stays empty:
nothing runs in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentbox.cli_run import EXIT_CODES, EXIT_REFUSED, RESULT_LINES
from agentbox.store.sessions import MAX_EVENTS_PAGE
from tests.conftest import Server, free_port, start_server, stop_server, traversable
from tests.test_cli_run import (
    _ANSI,
    CLI_DEADLINE,
    answer_approval_with_y,
    bash,
    cli_env,
    drain,
    read_until,
    script_file,
    spawn_in_pty,
)

#: What the server runs with (no network for its sandboxes, like the in-process tests).
SERVER_ENV = {"AGENTBOX_NETWORK": "off"}
#: The key of the server that requires one.
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module; each test runs in its own sessions."""
    home = traversable(tmp_path_factory.mktemp("remote"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(home, SERVER_ENV)
    yield s
    stop_server(s)


@pytest.fixture
def client_home(tmp_path: Path) -> Iterator[Path]:
    """The CLI's own AGENTBOX_HOME: with --url nothing may be created there."""
    home = tmp_path / "client-home"
    yield home
    assert not home.exists()


def agentbox(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", *args], env={**cli_env(home), **(env or {})}, cwd=home.parent,
        capture_output=True, text=True, timeout=CLI_DEADLINE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def session_of(output: str) -> str:
    """The session id from the line `run` announces the turn with."""
    return next(w for w in output.split() if w.startswith("ses_"))


def test_a_completed_turn_renders_and_sessions_and_events_show_it(server: Server, client_home: Path) -> None:
    steps = [
        bash("seq 1 10", "Let me count."),
        {"expect": {"tool_result_contains": "10"}, "text": "Counted to ten."},
    ]
    script = script_file(client_home.parent, steps)
    done = agentbox(client_home, "run", "--url", server.url, "--script", str(script), "count to ten")
    assert done.returncode == EXIT_CODES["turn.completed"] == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Let me count." in out and "Counted to ten." in out
    assert '→ bash {"command": "seq 1 10"}' in out
    assert f"… {10 + 1 - RESULT_LINES} more lines" in out and "\n10\n" not in out  # folded, no tags
    assert out.rstrip().endswith("completed")
    sid = session_of(out)
    # `sessions --url` lists what the server has; `events --url` prints its log, from a cursor
    listed = agentbox(client_home, "sessions", "--url", server.url)
    assert listed.returncode == 0
    [line] = [line for line in listed.stdout.splitlines() if line.startswith(sid)]
    assert line.split()[:3] == [sid, "scripted", "idle"]
    log = agentbox(client_home, "events", sid, "--url", server.url)
    assert log.returncode == 0
    lines = log.stdout.splitlines()
    wire = httpx.get(f"{server.url}/v1/sessions/{sid}/events", params={"limit": MAX_EVENTS_PAGE}).json()
    assert [line.split()[:2] for line in lines] == [[str(e["seq"]), e["type"]] for e in wire["items"]]
    assert lines[-1].split()[1] == "turn.completed" and "agent.tool_result" in log.stdout
    after = agentbox(client_home, "events", sid, "--after", "2", "--url", server.url).stdout.splitlines()
    assert after == lines[2:]


def test_an_approval_answered_y_at_the_prompt_runs_the_command(server: Server, client_home: Path) -> None:
    steps = [bash("echo approved-run"), {"expect": {"tool_result_contains": "approved-run"}, "text": "Done."}]
    script = script_file(client_home.parent, steps)
    args = ("run", "--url", server.url, "--mode", "full-ask", "--script", str(script), "go")
    process, primary = spawn_in_pty(client_home, *args)
    text = answer_approval_with_y(process, primary)
    sid = session_of(text)
    approvals = httpx.get(f"{server.url}/v1/sessions/{sid}/approvals").json()["items"]
    assert [(a["status"], a["scope"]) for a in approvals] == [("allowed", "once")]


def test_ctrl_c_at_the_prompt_aborts_the_turn_on_the_server_and_exits_2(
    server: Server, client_home: Path
) -> None:
    script = script_file(client_home.parent, [bash("echo never"), {"text": "never"}])
    args = ("run", "--url", server.url, "--mode", "full-ask", "--script", str(script), "go")
    process, primary = spawn_in_pty(client_home, *args)
    seen = b""
    try:
        seen = read_until(primary, b"[a]lways", seen)
        process.send_signal(signal.SIGINT)  # nothing typed: the prompt gives up, the API aborts
        assert process.wait(timeout=CLI_DEADLINE) == EXIT_CODES["turn.aborted"] == 2
        seen += drain(primary)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(primary)
    text = _ANSI.sub(b"", seen).decode()
    assert text.rstrip().endswith("aborted") and "Traceback" not in text
    sid = session_of(text)
    [turn] = httpx.get(f"{server.url}/v1/sessions/{sid}/turns").json()["items"]
    assert turn["status"] == "aborted"


def test_a_failed_turn_exits_1_and_the_session_runs_again_with_a_new_mode(
    server: Server, client_home: Path
) -> None:
    steps = [
        bash("echo hi"),
        {"expect": {"tool_result_contains": "nope"}, "text": "never"},
        {"text": "again"},
    ]
    script = script_file(client_home.parent, steps)
    done = agentbox(client_home, "run", "--url", server.url, "--script", str(script), "go")
    assert done.returncode == EXIT_CODES["turn.failed"] == 1, done.stdout + done.stderr
    assert "turn.failed" in done.stdout and "expected the last tool result to contain 'nope'" in done.stdout
    sid = session_of(done.stdout)
    again = agentbox(
        client_home, "run", "--url", server.url, "--session", sid, "--mode", "read-only", "once more"
    )
    assert again.returncode == 0 and "again" in again.stdout, again.stdout + again.stderr
    assert "never" not in again.stdout  # only the new turn's events are shown
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["permission_mode"] == "read-only"


def test_refusals_exit_3_with_one_line(server: Server, client_home: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    script = str(script_file(client_home.parent, [{"text": "hi"}]))
    unreachable = agentbox(client_home, "run", "--url", nowhere, "--script", script, "task")
    assert unreachable.returncode == EXIT_REFUSED
    assert unreachable.stdout.strip().startswith(f"agentbox run: cannot reach {nowhere}")
    assert len(unreachable.stdout.strip().splitlines()) == 1
    unknown = agentbox(client_home, "run", "--url", server.url, "--session", "ses_nope", "task")
    assert unknown.returncode == EXIT_REFUSED and "404 no session 'ses_nope'" in unknown.stdout
    bad = str(script_file(client_home.parent, [{"nope": 1}]))
    refused = agentbox(client_home, "run", "--url", server.url, "--script", bad, "task")
    assert refused.returncode == EXIT_REFUSED and "agentbox run: 400 " in refused.stdout
    no_script = agentbox(client_home, "run", "--url", server.url, "task")
    assert no_script.returncode == EXIT_REFUSED and "--script" in no_script.stdout
    both = agentbox(client_home, "run", "--url", server.url, "--session", "ses_x", "--script", script, "t")
    assert both.returncode == EXIT_REFUSED and "--script: fixed at creation" in both.stdout
    events = agentbox(client_home, "events", "ses_nope", "--url", server.url)
    assert events.returncode == EXIT_REFUSED and "404" in events.stdout
    sessions = agentbox(client_home, "sessions", "--url", nowhere)
    assert sessions.returncode == EXIT_REFUSED and "cannot reach" in sessions.stdout


def test_a_server_with_a_key_needs_it(sandbox_tmp: Path, client_home: Path) -> None:
    home = sandbox_tmp / "keyed-home"
    keyed = start_server(home, {**SERVER_ENV, "AGENTBOX_API_KEY": KEY})
    try:
        script = str(script_file(client_home.parent, [{"text": "with a key"}]))
        refused = agentbox(client_home, "run", "--url", keyed.url, "--script", script, "go")
        assert refused.returncode == EXIT_REFUSED and "401 missing or invalid API key" in refused.stdout
        wrong = agentbox(client_home, "sessions", "--url", keyed.url, "--api-key", "nope")
        assert wrong.returncode == EXIT_REFUSED and "401" in wrong.stdout
        done = agentbox(client_home, "run", "--url", keyed.url, "--api-key", KEY, "--script", script, "go")
        assert done.returncode == 0 and "with a key" in done.stdout, done.stdout
        listed = agentbox(client_home, "sessions", "--url", keyed.url, env={"AGENTBOX_API_KEY": KEY})
        assert listed.returncode == 0 and session_of(done.stdout) in listed.stdout
    finally:
        stop_server(keyed)


def test_a_server_lost_mid_turn_exits_3_without_a_traceback(sandbox_tmp: Path, client_home: Path) -> None:
    lost = start_server(sandbox_tmp / "lost-home", SERVER_ENV)
    script = script_file(client_home.parent, [{"hang": True}])
    process = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "run", "--url", lost.url, "--script", str(script), "wait"],
        env=cli_env(client_home), cwd=sandbox_tmp, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert b"turn trn_" in process.stdout.readline()
        lost.process.kill()  # a crash: the stream breaks
        lost.process.wait()
        assert process.wait(timeout=CLI_DEADLINE) == EXIT_REFUSED
        out = process.stdout.read().decode()
        assert "the event stream" in out and "before turn trn_" in out and "agentbox events ses_" in out
        assert "Traceback" not in out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stop_server(lost)


def test_a_server_restarted_mid_turn_is_followed_to_the_end(sandbox_tmp: Path, client_home: Path) -> None:
    """Killed while a command runs, started again on the same home and port: the new server
    recovers the turn (the command's outcome is unknown, so it says so and goes on), and the
    client, reconnecting from the last event it saw, shows its end."""
    home = sandbox_tmp / "restart-home"
    first = start_server(home, SERVER_ENV)
    port = int(first.url.rsplit(":", 1)[1])
    steps = [bash("sleep 600"), {"text": "finished after the restart"}]
    script = script_file(client_home.parent, steps)
    process = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "run", "--url", first.url, "--script", str(script), "wait"],
        env=cli_env(client_home), cwd=sandbox_tmp, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    second = None
    try:
        assert process.stdout is not None
        while b"bash" not in (line := process.stdout.readline()):  # the call is recorded: kill now
            assert line, "the client ended before the command started"
        first.process.kill()
        first.process.wait()
        second = start_server(home, SERVER_ENV, port=port)
        assert process.wait(timeout=CLI_DEADLINE) == EXIT_CODES["turn.completed"]
        out = process.stdout.read().decode()
        assert "finished after the restart" in out and "interrupted before completion" in out
        assert "Traceback" not in out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if second is not None:
            stop_server(second)
