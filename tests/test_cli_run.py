"""`agentbox run` / `sessions` / `events` as a user runs them: real subprocesses on a real home,
the scripted model, and an approval answered at the prompt of a pseudo-terminal."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentbox.agent.worker import PERMISSION_MODES
from agentbox.cli_run import EXIT_CODES, EXIT_REFUSED, RESULT_LINES, Elapsed, fold, resolution

#: Seconds one CLI run may take end to end (python start, imports, a sandbox start).
CLI_DEADLINE = 30.0
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    return {**env, "AGENTBOX_HOME": str(home), "AGENTBOX_NETWORK": "off", "COLUMNS": "200"}


def agentbox(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args], env=cli_env(home), cwd=home.parent,
        capture_output=True, text=True, timeout=CLI_DEADLINE, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def script_file(tmp: Path, steps: list[Any]) -> Path:
    path = tmp / "s.json"
    path.write_text(json.dumps(steps))
    return path


def bash(command: str, text: str = "") -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": "bash", "input": {"command": command}}]}


def session_ids(home: Path) -> list[str]:
    listed = agentbox(home, "sessions")
    assert listed.returncode == 0, listed.stderr
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def test_a_completed_turn_renders_and_exits_0(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    explore = {"agent": "explore", "prompt": "what is here?", "description": "look around"}
    steps = [
        bash("seq 1 10 | tee count.txt", "Let me count."),
        {"expect": {"tool_result_contains": "10"}, "tool_calls": [
            {"name": "deliver_file", "input": {"path": "count.txt"}},
            {"name": "task", "input": explore, "script": [{"text": "A count.txt."}]},
        ]},
        {"text": "Counted."},
    ]  # fmt: skip
    done = agentbox(home, "run", "--script", str(script_file(sandbox_tmp, steps)), "count to ten")
    assert done.returncode == EXIT_CODES["turn.completed"] == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Let me count." in out and "Counted." in out
    assert "delivered count.txt (21 bytes, file_" in out
    assert "↳ explore started: look around" in out and "↳ explore completed after 1 model calls" in out
    assert '→ bash {"command": "seq 1 10 | tee count.txt"}' in out
    assert f"… {10 + 1 - RESULT_LINES} more lines" in out  # "Exit code", 1..10: no stream tags
    assert "\n10\n" not in out and "<stdout>" not in out  # folded
    assert out.rstrip().endswith("completed")
    # sessions lists it; events prints its log one line each, from a cursor
    [sid] = session_ids(home)
    listed = agentbox(home, "sessions").stdout.split()
    assert listed[:3] == [sid, "scripted", "idle"]
    log = agentbox(home, "events", sid)
    assert log.returncode == 0
    lines = log.stdout.splitlines()
    assert [line.split()[1] for line in lines][:2] == ["session.created", "user.message"]
    assert lines[-1].split()[1] == "turn.completed" and "agent.tool_result" in log.stdout
    after = agentbox(home, "events", sid, "--after", "2").stdout.splitlines()
    assert after == lines[2:]
    assert agentbox(home, "events", "ses_nope").returncode == EXIT_REFUSED


def test_a_failed_expect_exits_1_and_a_reused_session_runs_again(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    steps = [
        bash("echo hi"),
        {"expect": {"tool_result_contains": "nope"}, "text": "never"},
        {"text": "again"},
    ]
    done = agentbox(home, "run", "--script", str(script_file(sandbox_tmp, steps)), "go")
    assert done.returncode == EXIT_CODES["turn.failed"] == 1, done.stdout + done.stderr
    assert "turn.failed" in done.stdout and "expected the last tool result to contain 'nope'" in done.stdout
    [sid] = session_ids(home)
    assert agentbox(home, "sessions").stdout.split()[2] == "idle"
    again = agentbox(home, "run", "--session", sid, "once more")
    assert again.returncode == 0 and "again" in again.stdout, again.stdout + again.stderr
    assert session_ids(home) == [sid]


def test_refusals_before_a_turn_exit_3(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    no_script = agentbox(home, "run", "task")
    assert no_script.returncode == EXIT_REFUSED and "--script" in no_script.stdout
    bad = agentbox(home, "run", "--script", str(script_file(sandbox_tmp, [{"nope": 1}])), "task")
    assert bad.returncode == EXIT_REFUSED
    assert agentbox(home, "run", "--session", "ses_nope", "task").returncode == EXIT_REFUSED
    mode = agentbox(
        home, "run", "--mode", "bogus", "--script", str(script_file(sandbox_tmp, [{"text": "x"}])), "t"
    )
    said = " ".join(mode.stdout.split())
    assert mode.returncode == EXIT_REFUSED and f"one of {', '.join(PERMISSION_MODES)}, not 'bogus'" in said, (
        said
    )
    assert session_ids(home) == []
    helped = " ".join(agentbox(home, "run", "--help").stdout.replace("│", " ").split())
    assert all(tier in helped for tier in PERMISSION_MODES), helped


def test_an_approval_answered_y_at_the_prompt_runs_the_command(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    steps = [bash("echo approved-run"), {"expect": {"tool_result_contains": "approved-run"}, "text": "Done."}]
    script = script_file(sandbox_tmp, steps)
    process, primary = spawn_in_pty(home, "run", "--mode", "full-ask", "--script", str(script), "go")
    answer_approval_with_y(process, primary)


def spawn_in_pty(home: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """`agentbox *args` with a pseudo-terminal for stdin/stdout/stderr; its primary side."""
    primary, secondary = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "agentbox", *args], env=cli_env(home), cwd=home.parent,
        stdin=secondary, stdout=secondary, stderr=secondary,
    )  # fmt: skip
    os.close(secondary)
    return process, primary


def answer_approval_with_y(process: subprocess.Popen[bytes], primary: int) -> str:
    """At the approval prompt for `echo approved-run`: a non-answer (asked again), then `y`;
    the run must complete and exit 0. What the terminal showed, without colour codes."""
    seen = b""
    try:
        seen = read_until(primary, b"[a]lways", seen)
        text = _ANSI.sub(b"", seen).decode()
        assert "? allow bash (exec)" in text and "approved-run" in text
        assert "Done." not in text
        os.write(primary, b"maybe\n")  # not an answer: asked again
        seen = read_until(primary, b"[a]lways", seen, start=len(seen))
        os.write(primary, b"y\n")
        assert process.wait(timeout=CLI_DEADLINE) == 0
        seen += drain(primary)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(primary)
    text = _ANSI.sub(b"", seen).decode()
    assert "bash allowed once" in text and "Done." in text and "completed" in text
    assert "Exit code: 0" in text
    return text


def test_ctrl_c_aborts_the_turn_and_exits_2(sandbox_tmp: Path) -> None:
    """SIGINT once the turn is announced (the handler is in place by then) aborts the hanging turn."""
    home = sandbox_tmp / "home"
    script = script_file(sandbox_tmp, [{"hang": True}])
    process = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "run", "--script", str(script), "wait"],
        env=cli_env(home), cwd=sandbox_tmp, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        announced = process.stdout.readline()
        assert b"turn trn_" in announced
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=CLI_DEADLINE) == EXIT_CODES["turn.aborted"] == 2
        assert b"aborted" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_until(fd: int, marker: bytes, seen: bytes, start: int = 0) -> bytes:
    deadline = time.monotonic() + CLI_DEADLINE
    while marker not in _ANSI.sub(b"", seen[start:]):
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        if select.select([fd], [], [], 0.5)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
    return seen


def drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_the_spinner_shows_how_long_the_tool_has_run() -> None:
    shown = Elapsed("running bash", began=time.monotonic() - 42.2)
    assert shown.__rich__().plain == "running bash… 42s"


def test_fold_keeps_its_boundary() -> None:
    lines = [str(i) for i in range(RESULT_LINES)]
    assert fold("\n".join(lines)) == "\n".join(lines)
    assert fold("\n".join([*lines, "x"])) == "\n".join([*lines, "… 1 more lines"])
    tagged = "\n".join(["Exit code: 1", "<stdout>", "out", "</stdout>", "<stderr>", "err", "</stderr>"])
    assert fold(tagged) == "Exit code: 1\nout\nstderr:\nerr"  # the tags were the hidden lines


def test_an_answered_approval_reads_as_said() -> None:
    base = {"tool": "bash", "message": None}
    assert resolution({**base, "decision": "allow", "scope": "once"}) == "bash allowed once"
    assert (
        resolution({**base, "decision": "allow", "scope": "session"})
        == "bash allowed for the rest of the session"
    )
    assert resolution({**base, "decision": "deny", "message": "not now"}) == "bash denied: not now"
    assert "before an answer" in resolution({**base, "decision": "cancelled"})


async def test_run_creates_a_provider_session_from_its_options(sandbox_tmp: Path) -> None:
    """--option, --instructions and --machine reach the new session; the OpenAI-compatible
    model (a loopback server) is called with them; the option that sizes compaction is not sent."""
    from tests.test_runtime_e2e import loopback_model, text_reply

    home = sandbox_tmp / "home"
    async for llm in loopback_model(lambda request: text_reply(request.json, "Hello from the model.")):
        home.mkdir(parents=True, exist_ok=True)  # a loopback endpoint is reachable once the operator lists it
        (home / "agentbox.toml").write_text(f'model_endpoints = ["{llm.url}/v1"]\n')
        args = [
            "run", "--model", "openai:local-coder", "--instructions", "Be brief.", "--machine", "none",
            "--option", f"base_url={llm.url}/v1", "--option", "api_key=sk-cli",
            "--option", "temperature=0.2", "--option", "context_window=4096", "say hi",
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentbox", *args, env=cli_env(home), cwd=sandbox_tmp,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), CLI_DEADLINE)
        assert process.returncode == 0, out.decode() + err.decode()
        assert "Hello from the model." in out.decode()
        (sent,) = llm.requests
        assert sent.headers["authorization"] == "Bearer sk-cli"
        assert sent.json["temperature"] == 0.2 and "context_window" not in sent.json
        system = sent.json["messages"][0]["content"]
        assert system.startswith("Be brief.") and "Machine:" not in system
        assert not (home / "sessions").exists() or not any((home / "sessions").iterdir())  # no sandbox
    [sid] = session_ids(home)
    refused = agentbox(home, "run", "--session", sid, "--option", "temperature=1", "again")
    assert refused.returncode == EXIT_REFUSED and "--option: fixed at creation" in refused.stdout
    bad = agentbox(home, "run", "--model", "openai:x", "--option", "no-equals-sign", "task")
    assert bad.returncode == EXIT_REFUSED and "KEY=VALUE" in bad.stdout


def test_sessions_and_events_on_a_home_never_used_make_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    listed = agentbox(home, "sessions")
    assert listed.returncode == 0 and listed.stdout == "" and "has no database" in listed.stderr, listed
    shown = agentbox(home, "events", "ses_x")
    assert shown.returncode == EXIT_REFUSED and "has no database" in shown.stderr, shown
    assert not home.exists()  # a read made no home, database or lock
