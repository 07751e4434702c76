"""One owner per AGENTBOX_HOME, against a real `agentbox serve` and the real CLI.

A second server on a home is refused with one line; `agentbox exec` on a home a server owns
runs through that server (its URL is recorded beside the lock); `mcp` and in-process `run`
refuse, naming the URL; session ids are checked once, at the registry, with a full match;
a home the sandbox uid cannot reach is refused at start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Server, free_port, start_server, stop_server

#: Seconds one CLI run may take end to end (python start, imports, a request or a sandbox).
CLI_DEADLINE = 60.0


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    return {**env, "AGENTBOX_HOME": str(home), "AGENTBOX_NETWORK": "off"}


def agentbox(home: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox", *args], env=cli_env(home), cwd=home.parent,
        input=stdin, capture_output=True, timeout=CLI_DEADLINE,
    )  # fmt: skip


def one_line_refusal(done: subprocess.CompletedProcess[bytes]) -> str:
    """The refusal's text, after checking it is a refusal: non-zero, one line, no traceback."""
    err = done.stderr.decode()
    assert done.returncode != 0, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def run_in(server: Server, session: str, command: str) -> dict[str, object]:
    with server.client() as client:
        response = client.post(f"/sandboxes/{session}/v2/commands", json={"command": command})
    assert response.status_code == 200, response.text
    data: dict[str, object] = response.json()["data"]
    return data


@pytest.fixture
def owned(sandbox_tmp: Path) -> Iterator[Server]:
    """A server on its own home (a fresh one per test: tests here stop and start servers)."""
    home = sandbox_tmp / "home"
    home.mkdir()
    server = start_server(home, env={"AGENTBOX_NETWORK": "off"})
    yield server
    stop_server(server)


def test_a_second_server_on_the_same_home_is_refused_and_the_first_keeps_its_sandboxes(owned: Server) -> None:
    assert run_in(owned, "s1", "echo before > /tmp/mark; echo ok")["stdout"] == "ok\n"
    second = agentbox(owned.home, "serve", "--port", str(free_port()))
    reason = one_line_refusal(second)
    assert owned.url in reason
    # The first server's sandbox lived through it: its /tmp is still there (no recovery wiped it).
    assert run_in(owned, "s1", "cat /tmp/mark")["stdout"] == "before\n"


def test_exec_on_a_home_a_server_owns_runs_through_that_server(owned: Server) -> None:
    assert run_in(owned, "s1", "echo live > /tmp/mark")["exit_code"] == 0
    for _ in range(4):
        done = agentbox(
            owned.home, "exec", "--session", "s1", "--", "sh", "-c", "cat /tmp/mark; echo oops >&2; exit 3"
        )
        assert done.stdout == b"live\n", done.stderr.decode()[-2000:]
        assert b"oops" in done.stderr
        assert done.returncode == 3
    # The server's sandbox is the one that ran them, and it still works.
    with owned.client() as client:
        commands = client.get("/sandboxes/s1/v2/commands").json()["data"]["commands"]
    assert sum("cat /tmp/mark" in c["command"] for c in commands) == 4
    assert run_in(owned, "s1", "cat /tmp/mark")["stdout"] == "live\n"


def test_exec_argv_keeps_its_words_through_the_server(owned: Server) -> None:
    done = agentbox(owned.home, "exec", "--session", "s2", "--", "printf", "[%s]\n", "a b", "$HOME", "it's")
    assert done.stdout == b"[a b]\n[$HOME]\n[it's]\n", done.stderr.decode()[-2000:]
    assert done.returncode == 0


def test_mcp_and_in_process_run_refuse_naming_the_server(owned: Server) -> None:
    mcp = agentbox(owned.home, "mcp", "--session", "s1")
    assert owned.url in one_line_refusal(mcp)
    run = agentbox(owned.home, "run", "hello", "--model", "scripted")
    assert run.returncode != 0
    assert owned.url in run.stderr.decode() + run.stdout.decode()
    assert "Traceback" not in run.stderr.decode()


def test_the_home_is_free_again_once_the_server_stops(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    home.mkdir()
    server = start_server(home, env={"AGENTBOX_NETWORK": "off"})
    stop_server(server)
    done = agentbox(home, "exec", "--session", "s1", "--", "sh", "-c", "echo alone")
    assert done.stdout == b"alone\n", done.stderr.decode()[-2000:]


@pytest.mark.parametrize("session", ["../../x", "../x", "s1\n", "..", "a/b"])
def test_exec_refuses_a_session_id_that_is_not_one_and_creates_nothing(
    sandbox_tmp: Path, session: str
) -> None:
    home = sandbox_tmp / "home"
    before = sorted(p.name for p in sandbox_tmp.iterdir())
    done = agentbox(home, "exec", "--session", session, "--", "true")
    assert "invalid session id" in one_line_refusal(done)
    assert sorted(p.name for p in sandbox_tmp.iterdir() if p.name != "home") == [
        n for n in before if n != "home"
    ]
    assert not (home / "x").exists() and not (home / "sessions" / "x").exists()
    assert not any((home / "sessions").glob("*")) if (home / "sessions").exists() else True


def test_the_api_refuses_a_session_id_with_a_trailing_newline(owned: Server) -> None:
    with owned.client() as client:
        response = client.post("/sandboxes/s1%0A/v2/commands", json={"command": "true"})
        files = client.post("/v1/files", files={"file": ("a.txt", b"a")}, data={"session_id": "s1\n"})
    assert response.status_code == 400, response.text
    assert files.status_code in (400, 422), files.text
    assert not (owned.home / "sessions" / "s1\n").exists()


def test_registry_checks_every_session_id_with_a_full_match(tmp_path: Path) -> None:
    from conftest import sandbox_settings

    from agentbox.machines.errors import PathEscape
    from agentbox.machines.registry import Registry

    registry = Registry(sandbox_settings(tmp_path))
    for bad in ("s1\n", "../x", ".hidden", "a" * 129):
        with pytest.raises(PathEscape):
            registry.session_dir(bad)
        with pytest.raises(PathEscape):
            registry.view(bad)
    assert registry.session_dir("a" * 128).name == "a" * 128


def test_a_home_the_sandbox_uid_cannot_reach_is_refused_at_start() -> None:
    if os.geteuid() != 0:
        pytest.skip("only a root server runs sandboxes as another uid")
    parent = Path(tempfile.mkdtemp())  # 0700: not agentbox's to change
    try:
        home = parent / "home"
        done = agentbox(home, "serve", "--port", str(free_port()))
        reason = one_line_refusal(done)
        assert str(parent) in reason and "chmod" in reason
        assert oct(parent.stat().st_mode & 0o777) == oct(0o700)  # left as it was
    finally:
        shutil.rmtree(parent)


def test_a_private_home_of_its_own_is_made_reachable_for_the_sandbox_uid_only(sandbox_tmp: Path) -> None:
    home = Path(tempfile.mkdtemp(dir=sandbox_tmp))  # 0700, the home itself: agentbox's own
    server = start_server(home, env={"AGENTBOX_NETWORK": "off"})
    try:
        assert run_in(server, "s1", "echo hi")["stdout"] == "hi\n"
        assert home.stat().st_mode & 0o007 == 0  # still nothing for other users
    finally:
        stop_server(server)


def test_a_home_owned_by_a_process_that_does_not_serve_is_refused_with_its_pid(sandbox_tmp: Path) -> None:
    """Another exec, mcp or run owns the home: there is no server to go through, so exec refuses."""
    from agentbox.config import load
    from agentbox.home import claim_home

    home = sandbox_tmp / "home"
    with claim_home(load(env=cli_env(home))):
        done = agentbox(home, "exec", "--session", "s1", "--", "true")
        assert f"pid {os.getpid()}" in one_line_refusal(done)
        assert not (home / "sessions").exists()
    done = agentbox(home, "exec", "--session", "s1", "--", "sh", "-c", "echo free")
    assert done.stdout == b"free\n", done.stderr.decode()[-2000:]
