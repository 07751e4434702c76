"""`agentbox exec`: one command in a session's sandbox, output streamed, the command's exit code."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, start_server, stop_server

#: Seconds the CLI may take end to end (python start, imports, a sandbox start).
CLI_DEADLINE = 60.0


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    return {**env, "AGENTBOX_HOME": str(home), "AGENTBOX_NETWORK": "off"}


def agentbox_exec(home: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbox", "exec", *args],
        env=cli_env(home),
        cwd=home.parent,  # no agentbox.toml of the repo's working directory
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_exec_prints_the_output_and_exits_with_the_command_code(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", "--session", "s1", "--", "sh", "-c", "echo hi; exit 3"],
        env=cli_env(home), cwd=sandbox_tmp, capture_output=True, timeout=CLI_DEADLINE,
    )  # fmt: skip
    assert done.stdout == b"hi\n", done.stderr.decode()[-2000:]
    assert done.returncode == 3
    assert (home / "sessions" / "s1" / "workspace").is_dir()


def test_exec_streams_before_the_command_ends(sandbox_tmp: Path) -> None:
    """`hi` arrives while the command still waits for a file only the test creates after reading it."""
    home = sandbox_tmp / "home"
    script = "echo hi; echo oops >&2; while [ ! -e /workspace/go ]; do sleep 0.01; done; echo bye; exit 3"
    process = agentbox_exec(home, "--session", "s1", "--", "sh", "-c", script)
    try:
        assert process.stdout is not None and process.stderr is not None
        ready, _, _ = select.select([process.stdout], [], [], CLI_DEADLINE)
        assert ready, "no output streamed"
        assert process.stdout.readline() == b"hi\n"
        assert process.poll() is None  # still running: the line was streamed, not printed at the end
        (home / "sessions" / "s1" / "workspace" / "go").touch()
        started = time.monotonic()
        assert process.wait(SANDBOX_DEADLINE) == 3
        assert time.monotonic() - started < SANDBOX_DEADLINE
        assert process.stdout.read() == b"bye\n"
        assert b"oops\n" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_exec_hands_piped_stdin_to_the_command(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", "--session", "s1", "--", "tr", "a-z", "A-Z"],
        input=b"piped in\n", env=cli_env(home), cwd=sandbox_tmp, capture_output=True, timeout=CLI_DEADLINE,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, b"PIPED IN\n"), done.stderr.decode()[-2000:]


def test_exec_through_a_server_hands_it_stdin_too(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    server = start_server(home, {"AGENTBOX_NETWORK": "off"})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agentbox", "exec", "--session", "s1", "--", "wc", "-c"],
            input=b"12345", env=cli_env(home), cwd=sandbox_tmp, capture_output=True, timeout=CLI_DEADLINE,
        )  # fmt: skip
    finally:
        stop_server(server)
    assert (done.returncode, done.stdout.strip()) == (0, b"5"), done.stderr.decode()[-2000:]


def test_a_machine_that_cannot_start_is_a_message_not_a_traceback(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    config = sandbox_tmp / "agentbox.toml"
    config.write_text('[machines.sandbox]\nkind = "sandbox"\nimage = "no-such-image"\n')
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", "--", "true"],
        env={**cli_env(home), "AGENTBOX_CONFIG": str(config)}, cwd=sandbox_tmp, capture_output=True,
        timeout=CLI_DEADLINE,
    )  # fmt: skip
    assert done.returncode == 2
    assert b"no-such-image" in done.stderr and b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [(["--cwd", "/workspace/missing", "--", "true"], 2, b"does not exist"),
     (["--cwd", "/etc/passwd", "--", "true"], 2, b"is not a directory"),
     (["--", "/workspace/no-such-program", "a"], 127, b"No such file or directory")],
    ids=["missing-cwd", "cwd-not-a-directory", "missing-program"],
)  # fmt: skip
def test_a_bad_cwd_or_program_is_one_line_not_a_traceback(
    sandbox_tmp: Path, args: list[str], code: int, said: bytes
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "exec", *args], env=cli_env(sandbox_tmp / "home"), cwd=sandbox_tmp,
        capture_output=True, timeout=CLI_DEADLINE,
    )  # fmt: skip
    assert done.returncode == code, done.stderr.decode()[-2000:]
    assert said in done.stderr and b"Traceback" not in done.stderr and b"/bin/sh" not in done.stderr
    assert len(done.stderr.decode().strip().splitlines()) == 1, done.stderr.decode()
