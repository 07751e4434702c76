"""CommandManager over a real LocalMachine: real processes, real pipes, real process groups."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from agentbox.machines.base import Machine
from agentbox.machines.local import LocalMachine
from agentbox.workspace import commands
from agentbox.workspace.commands import (
    BASH_STATUS,
    DEFAULT_TIMEOUT_SECONDS,
    KEPT_HEAD_BYTES,
    MAX_BUFFERED_OUTPUT,
    MAX_COMMAND_BYTES,
    MAX_TIMEOUT_SECONDS,
    SHELL_STATUS,
    Command,
    CommandManager,
    OutputBuffer,
    TooManyCommands,
)
from agentbox.workspace.errors import WorkspaceError

#: Generous upper bound for anything that should happen "at once"; tests wait for
#: conditions and only fail when this passes.
DEADLINE = 20.0


def local_machine(root: Path) -> Machine:
    # The cast only narrows `LocalMachine.os` (inferred `str`) to the protocol's `OS` literal.
    return cast(Machine, LocalMachine("test", root))


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[CommandManager]:
    m = CommandManager(local_machine(tmp_path / "root"))
    yield m
    await m.close()


def root(m: CommandManager) -> Path:
    return Path(m.machine.root)


async def output_until(m: CommandManager, cmd: Command, predicate: Callable[[bytes], bool]) -> bytes:
    """Wait (on output events, not sleeps) until stdout satisfies `predicate`."""
    end = time.monotonic() + DEADLINE
    while not predicate(cmd.stdout.getvalue()):
        assert time.monotonic() < end, f"stdout never matched: {cmd.stdout.getvalue()!r}"
        await m.wait_output(cmd.id, cmd.stdout.total, cmd.stderr.total, timeout=DEADLINE)
    return cmd.stdout.getvalue()


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until_dead(pid: int) -> None:
    end = time.monotonic() + DEADLINE
    while pid_alive(pid):
        assert time.monotonic() < end, f"pid {pid} still alive"
        await asyncio.sleep(0.01)


# -- sync runs ---------------------------------------------------------------------------


async def test_run_echo(manager: CommandManager) -> None:
    cmd = await manager.run("echo hello")
    assert (cmd.status, cmd.exit_code, cmd.stdout.getvalue(), cmd.stderr.getvalue()) == (
        "completed",
        0,
        b"hello\n",
        b"",
    )
    assert (
        cmd.id.startswith("cmd_") and cmd.finished_at is not None and cmd.timeout == DEFAULT_TIMEOUT_SECONDS
    )
    assert manager.get(cmd.id) is cmd and manager.list() == [cmd]


async def test_nonzero_exit_is_completed(manager: CommandManager) -> None:
    cmd = await manager.run("exit 3")
    assert (cmd.status, cmd.exit_code) == ("completed", 3)
    assert BASH_STATUS[cmd.status] == "completed" and SHELL_STATUS["timed_out"] == "hard_timeout"


async def test_stderr_is_separate(manager: CommandManager) -> None:
    cmd = await manager.run("echo out; echo err >&2")
    assert cmd.stdout.getvalue() == b"out\n" and cmd.stderr.getvalue() == b"err\n"


async def test_an_argv_runs_as_given_with_no_shell_in_front(manager: CommandManager) -> None:
    """No `sh` parses it: quotes, spaces and `$` reach the program as they were given."""
    cmd = await manager.run("printf ...", argv=["/usr/bin/printf", "%s|", "a b", "it's", "$HOME"])
    assert (cmd.status, cmd.exit_code, cmd.stdout.getvalue()) == ("completed", 0, b"a b|it's|$HOME|")
    assert cmd.command == "printf ..."  # what the record shows
    timed = await manager.run("sleep", argv=["/bin/sleep", "30"], timeout=1)
    assert timed.status == "timed_out"


async def test_an_argv_argument_is_held_to_the_kernel_limit(manager: CommandManager) -> None:
    """Each argument is one argv string: the same limit and the same NUL check as a command."""
    filler = "x" * (MAX_COMMAND_BYTES - 2)
    at_limit = await manager.run("sh", argv=["/bin/sh", "-c", f": {filler}"])
    assert (at_limit.status, at_limit.exit_code) == ("completed", 0)
    for bad in (f": {filler}x", "echo a\0b"):
        with pytest.raises(WorkspaceError) as err:
            await manager.run("sh", argv=["/bin/sh", "-c", bad])
        assert err.value.error_type == "bad_request"
    assert manager.list() == [at_limit]  # a refused argv leaves no record


async def test_env_passed_and_server_env_not_leaked(
    manager: CommandManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_TEST_SECRET", "hunter2")
    cmd = await manager.run("env", env={"GREETING": "hi there", "UNSET_ME": None})
    out = cmd.stdout.getvalue().decode()
    assert "GREETING=hi there" in out.splitlines()
    assert "AGENTBOX_TEST_SECRET" not in out and "hunter2" not in out and "UNSET_ME" not in out
    assert cmd.env == {"GREETING": "hi there"}


async def test_cwd_and_missing_cwd(manager: CommandManager) -> None:
    (root(manager) / "sub").mkdir()
    assert (await manager.run("pwd", cwd="sub")).stdout.getvalue().decode().strip() == str(
        root(manager) / "sub"
    )
    with pytest.raises(WorkspaceError) as err:
        await manager.run("pwd", cwd="missing")
    assert err.value.error_type == "not_found" and manager.list()[-1].cwd == "sub"


@pytest.mark.parametrize(
    ("command", "env"),
    [("", None), ("   ", None), ("echo \0", None), ("true", {"A=B": "x"}), ("true", {"": "x"})],
)
async def test_bad_input_is_bad_request(
    manager: CommandManager, command: str, env: dict[str, str | None] | None
) -> None:
    with pytest.raises(WorkspaceError) as err:
        await manager.run(command, env=env)
    assert err.value.error_type == "bad_request" and manager.list() == []


async def test_timeout_bounds(manager: CommandManager) -> None:
    for bad in (0, -1, MAX_TIMEOUT_SECONDS + 0.001, float("nan")):
        with pytest.raises(WorkspaceError) as err:
            await manager.run("true", timeout=bad)
        assert err.value.error_type == "bad_request"
        with pytest.raises(WorkspaceError):
            await manager.start("true", timeout=bad)
    cmd = await manager.run("true", timeout=MAX_TIMEOUT_SECONDS)
    assert cmd.timeout == MAX_TIMEOUT_SECONDS and cmd.status == "completed"
    assert (await manager.start("true")).timeout is None


async def test_timeout_kills_quickly(manager: CommandManager) -> None:
    started = time.monotonic()
    cmd = await manager.run("echo before; sleep 5", timeout=1)
    elapsed = time.monotonic() - started
    assert cmd.status == "timed_out" and cmd.exit_code == 128 + signal.SIGKILL
    assert 1 <= elapsed < 4 and cmd.stdout.getvalue() == b"before\n"


async def test_cancelled_run_kills_the_command(manager: CommandManager, tmp_path: Path) -> None:
    task = asyncio.create_task(manager.run("echo $$ > pid; sleep 1000"))
    pid_file = root(manager) / "pid"
    end = time.monotonic() + DEADLINE
    # The shell can write its pid before the launch has recorded the command: wait for both.
    while not pid_file.exists() or not pid_file.read_text().strip() or not manager.list():
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cmd = manager.list()[0]
    assert (await manager.wait(cmd.id, timeout=DEADLINE)).status == "killed"
    await until_dead(int(pid_file.read_text()))


# -- output cap --------------------------------------------------------------------------


def pattern(n: int) -> bytes:
    return bytes(97 + i % 26 for i in range(n))


async def test_output_cap_boundary(manager: CommandManager) -> None:
    script = (
        "import sys; sys.stdout.buffer.write(bytes(97 + i % 26 for i in range({n})));"
        " print('done', file=sys.stderr)"
    )
    room = MAX_BUFFERED_OUTPUT - len(b"done\n")  # stderr's 5 bytes count against the same budget
    exact = await manager.run(f'python3 -c "{script.format(n=room)}"')
    assert exact.stdout.total == room and not exact.stdout.truncated and not exact.stderr.truncated
    assert exact.stdout.getvalue() == pattern(room)

    over = await manager.run(f'python3 -c "{script.format(n=room + 1)}"')
    assert (over.status, over.exit_code, over.stderr.getvalue()) == ("completed", 0, b"done\n")
    assert over.stdout.truncated and over.stdout.total == room + 1 and over.stdout.dropped == 1
    whole = pattern(room + 1)
    kept = over.stdout.getvalue()
    assert len(kept) == room
    assert kept == whole[:KEPT_HEAD_BYTES] + whole[KEPT_HEAD_BYTES + 1 :]
    assert "[... 1 bytes of output omitted ...]" in over.stdout.text()


async def test_pipe_drains_far_past_the_cap(manager: CommandManager) -> None:
    cmd = await manager.run("head -c 20000000 /dev/zero; echo end >&2")
    assert (cmd.status, cmd.exit_code, cmd.stderr.getvalue()) == ("completed", 0, b"end\n")
    assert cmd.stdout.total == 20_000_000 and len(cmd.stdout.getvalue()) == MAX_BUFFERED_OUTPUT - len(
        b"end\n"
    )


async def test_both_streams_share_one_capture_budget(manager: CommandManager) -> None:
    """1 MiB over stdout and stderr together: two floods end with half each, heads kept."""
    flood = MAX_BUFFERED_OUTPUT
    cmd = await manager.run(f"head -c {flood} /dev/zero; head -c {flood} /dev/zero >&2")
    out, err = cmd.stdout, cmd.stderr
    assert (out.total, err.total) == (flood, flood)
    assert out.kept + err.kept == MAX_BUFFERED_OUTPUT and abs(out.kept - err.kept) <= 1
    assert out.truncated and err.truncated
    assert out.getvalue()[:KEPT_HEAD_BYTES] == err.getvalue()[:KEPT_HEAD_BYTES] == bytes(KEPT_HEAD_BYTES)


def test_the_longer_tail_gives_way_first() -> None:
    out, err = OutputBuffer.pair(cap=12)
    out.head_cap = err.head_cap = 2
    out.append(b"aaaaaaaa")  # head aa, tail aaaaaa
    err.append(b"bbbb")  # head bb, tail bb: 12 kept, at the budget
    assert (out.kept, err.kept, out.truncated, err.truncated) == (8, 4, False, False)
    err.append(b"cc")  # 14: stdout's longer tail drops its 2 oldest
    assert (out.getvalue(), err.getvalue()) == (b"aaaaaa", b"bbbbcc") and out.dropped == 2


def test_buffer_reads_by_absolute_offset() -> None:
    buf = OutputBuffer(cap=10, head=4)
    buf.append(b"0123")
    buf.append(b"45")
    assert buf.read(0) == commands.OutputSlice(b"012345", 0, 6)
    assert buf.read(4) == commands.OutputSlice(b"45", 4, 6)
    assert buf.read(6) == commands.OutputSlice(b"", 6, 6)
    assert buf.read(9) == commands.OutputSlice(b"", 9, 9)
    buf.append(b"6789abcdef")  # 16 bytes written: the head 0123, then the last 6
    assert buf.getvalue() == b"0123abcdef" and buf.truncated and buf.dropped == 6
    assert buf.read(2) == commands.OutputSlice(b"23", 2, 4)
    assert buf.read(4) == commands.OutputSlice(b"abcdef", 10, 16, skipped=6)
    assert buf.read(12) == commands.OutputSlice(b"cdef", 12, 16)
    with pytest.raises(WorkspaceError) as err:
        buf.read(-1)
    assert err.value.error_type == "bad_request"


def test_buffer_holds_back_a_split_character_while_open() -> None:
    buf = OutputBuffer()
    euro = "€".encode()
    buf.append(b"a" + euro[:2])
    assert buf.read(0) == commands.OutputSlice(b"a", 0, 1)
    assert buf.read(1) == commands.OutputSlice(euro[:2], 1, 3)  # never held back to nothing
    buf.append(euro[2:])
    assert buf.read(1) == commands.OutputSlice(euro, 1, 4)
    buf.append(euro[:1])
    buf.close()
    assert buf.read(4) == commands.OutputSlice(euro[:1], 4, 5)


# -- async runs --------------------------------------------------------------------------


async def test_async_output_while_running(manager: CommandManager) -> None:
    started = time.monotonic()
    cmd = await manager.start("echo first; while [ ! -e go ]; do sleep 0.01; done; echo second")
    assert cmd.status == "running" and time.monotonic() - started < 5
    assert await output_until(manager, cmd, lambda out: out == b"first\n") == b"first\n"
    assert manager.get(cmd.id).status == "running"
    (root(manager) / "go").touch()
    done = await manager.wait(cmd.id, timeout=DEADLINE)
    assert (done.status, done.exit_code, done.stdout.getvalue()) == ("completed", 0, b"first\nsecond\n")


async def test_wait_returns_running_on_timeout(manager: CommandManager) -> None:
    cmd = await manager.start("cat")
    assert (await manager.wait(cmd.id, timeout=0)).status == "running"
    assert (await manager.wait_output(cmd.id, timeout=0.05)).stdout.total == 0
    with pytest.raises(WorkspaceError):
        await manager.wait(cmd.id, timeout=-1)


async def test_wait_output_wakes_on_new_output(manager: CommandManager) -> None:
    cmd = await manager.start("cat")
    waiter = asyncio.create_task(manager.wait_output(cmd.id, 0, timeout=DEADLINE))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiter.done()
    started = time.monotonic()
    await manager.write_stdin(cmd.id, b"ping\n")
    await waiter
    assert time.monotonic() - started < DEADLINE / 2 and cmd.stdout.read(0).data == b"ping\n"


async def test_write_stdin_to_cat(manager: CommandManager) -> None:
    cmd = await manager.start("cat; echo eof >&2")
    await manager.write_stdin(cmd.id, b"hello\n")
    assert await output_until(manager, cmd, lambda out: out == b"hello\n") == b"hello\n"
    await manager.write_stdin(cmd.id, b"bye\n", close=True)
    done = await manager.wait(cmd.id, timeout=DEADLINE)
    assert (done.status, done.exit_code, done.stdout.getvalue(), done.stderr.getvalue()) == (
        "completed",
        0,
        b"hello\nbye\n",
        b"eof\n",
    )
    with pytest.raises(WorkspaceError) as err:
        await manager.write_stdin(cmd.id, b"late")
    assert err.value.error_type == "bad_request"


async def test_sync_runs_have_no_stdin(manager: CommandManager) -> None:
    cmd = await manager.run("cat; echo after")
    assert cmd.stdout.getvalue() == b"after\n" and not cmd.stdin_open
    nostdin = await manager.start("cat", stdin=False)
    assert (await manager.wait(nostdin.id, timeout=DEADLINE)).status == "completed"


async def test_stdin_write_timeout(manager: CommandManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "STDIN_WRITE_TIMEOUT_SECONDS", 0.2)
    cmd = await manager.start("sleep 1000")
    await manager.write_stdin(cmd.id, b"fits in the pipe\n")
    with pytest.raises(WorkspaceError) as err:
        await manager.write_stdin(cmd.id, b"x" * (8 * 1024 * 1024))
    assert err.value.error_type == "io_error" and err.value.retryable


# -- kill and process groups --------------------------------------------------------------


async def test_kill_takes_the_whole_process_group(manager: CommandManager) -> None:
    cmd = await manager.start("sleep 1000 & echo $!; wait")
    grandchild = int(await output_until(manager, cmd, lambda out: out.endswith(b"\n")))
    assert pid_alive(grandchild)
    assert manager.kill(cmd.id).kill_signal == signal.SIGKILL
    done = await manager.wait(cmd.id, timeout=DEADLINE)
    assert done.status == "killed" and done.exit_code == 128 + signal.SIGKILL
    await until_dead(grandchild)
    assert manager.kill(cmd.id) is done  # a finished command is left as it is


async def test_sigterm_is_a_request(manager: CommandManager) -> None:
    cmd = await manager.start("trap 'echo bye; exit 5' TERM; echo ready; while :; do sleep 0.01; done")
    await output_until(manager, cmd, lambda out: out == b"ready\n")
    manager.kill(cmd.id, signal.SIGTERM)
    done = await manager.wait(cmd.id, timeout=DEADLINE)
    assert (done.status, done.exit_code, done.stdout.getvalue()) == ("killed", 5, b"ready\nbye\n")
    with pytest.raises(WorkspaceError) as err:
        manager.kill(cmd.id, signal.SIGHUP)
    assert err.value.error_type == "bad_request"


async def test_background_left_at_the_end_is_reaped(manager: CommandManager) -> None:
    cmd = await manager.run("sleep 1000 >/dev/null 2>&1 & echo $!")
    orphan = int(cmd.stdout.getvalue())
    await until_dead(orphan)


async def test_keep_background(manager: CommandManager) -> None:
    cmd = await manager.run("sleep 1000 >/dev/null 2>&1 & echo $!", keep_background=True)
    survivor = int(cmd.stdout.getvalue())
    try:
        assert cmd.status == "completed" and pid_alive(survivor)
    finally:
        os.kill(survivor, signal.SIGKILL)
    await until_dead(survivor)


async def test_escaped_pipe_holder_does_not_hang_a_timeout(
    manager: CommandManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "KILL_GRACE_SECONDS", 0.3)
    monkeypatch.setattr(commands, "DRAIN_GRACE_SECONDS", 0.3)
    task = asyncio.create_task(manager.run("setsid sleep 1000 & echo $!; wait", timeout=1))
    escapee = 0
    try:
        cmd = await task
        escapee = int(cmd.stdout.getvalue())
        assert (cmd.status, cmd.exit_code) == ("timed_out", None)
        assert pid_alive(escapee)  # outside the group: not ours to kill, and we did not hang
    finally:
        if escapee:
            os.kill(escapee, signal.SIGKILL)
    await until_dead(escapee)


# -- limits ------------------------------------------------------------------------------


async def test_max_running_commands(manager: CommandManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "MAX_RUNNING_COMMANDS", 2)
    first = await manager.start("cat")
    await manager.start("cat")
    with pytest.raises(TooManyCommands) as err:
        await manager.start("cat")
    assert err.value.error_type == "bad_request" and err.value.retryable
    with pytest.raises(TooManyCommands):
        await manager.run("true")
    await manager.close_stdin(first.id)
    assert (await manager.wait(first.id, timeout=DEADLINE)).status == "completed"
    assert (await manager.start("cat")).status == "running"


async def test_max_commands_kept(manager: CommandManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "MAX_COMMANDS_KEPT", 3)
    runner = await manager.start("cat")  # running records are never evicted
    ran = [await manager.run(f"echo {i}") for i in range(3)]
    assert manager.list() == [runner, *ran]
    fourth = await manager.run("echo 3")
    assert manager.list() == [runner, *ran[1:], fourth]
    with pytest.raises(WorkspaceError) as err:
        manager.get(ran[0].id)
    assert err.value.error_type == "not_found"
    manager.remove(ran[1].id)
    with pytest.raises(WorkspaceError):
        manager.remove(runner.id)  # still running
    await manager.close_stdin(runner.id)
    await manager.wait(runner.id, timeout=DEADLINE)
    assert manager.list() == [runner, ran[2], fourth]


async def test_unknown_command(manager: CommandManager) -> None:
    for call in (manager.get, manager.kill, manager.remove):
        with pytest.raises(WorkspaceError) as err:
            call("cmd_nope")
        assert err.value.error_type == "not_found"


# -- sessions ----------------------------------------------------------------------------


async def test_session_working_dir_and_bookkeeping(manager: CommandManager) -> None:
    (root(manager) / "proj").mkdir()
    session = await manager.open_session("s1", "proj")
    assert (session.working_dir, session.status, session.command_count) == (
        str(root(manager) / "proj"),
        "ready",
        0,
    )
    cmd = await manager.start("pwd; cd /; export X=1; cat", session_id="s1")
    assert session.current_command == cmd.command and manager.session_command("s1") is cmd
    await output_until(manager, cmd, lambda out: out.endswith(b"\n"))
    assert cmd.stdout.getvalue().decode().strip() == session.working_dir
    await manager.close_stdin(cmd.id)
    await manager.wait(cmd.id, timeout=DEADLINE)
    assert session.current_command is None and session.command_count == 1
    again = await manager.run('pwd; echo "x=$X"', session_id="s1")  # no shell state carries over
    assert again.stdout.getvalue().decode() == f"{session.working_dir}\nx=\n"
    assert manager.session_command("s1") is again and manager.session_command("s1", cmd.id) is cmd
    assert manager.sessions() == [session] and session.command_count == 2


async def test_session_errors_and_auto_create(manager: CommandManager) -> None:
    (root(manager) / "file").write_text("x")
    with pytest.raises(WorkspaceError) as err:
        await manager.open_session(working_dir="missing")
    assert err.value.error_type == "not_found"
    with pytest.raises(WorkspaceError) as err:
        await manager.open_session(working_dir="file")
    assert err.value.error_type == "invalid_target"
    with pytest.raises(WorkspaceError) as err:
        await manager.open_session("bad id!")
    assert err.value.error_type == "bad_request"
    cmd = await manager.run("pwd", session_id="auto")
    assert manager.session("auto").working_dir == manager.machine.root
    assert cmd.stdout.getvalue().decode().strip() == manager.machine.root
    with pytest.raises(WorkspaceError) as err:
        await manager.open_session("auto")
    assert err.value.error_type == "already_exists"
    other = await manager.run("true")
    with pytest.raises(WorkspaceError):
        manager.session_command("auto", other.id)  # not this session's command
    fresh = await manager.open_session()
    assert fresh.session_id.startswith("sh_")
    with pytest.raises(WorkspaceError):
        manager.session_command(fresh.session_id)  # no command yet


async def test_close_session_kills_its_commands(manager: CommandManager) -> None:
    await manager.open_session("s")
    cmd = await manager.start("sleep 1000", session_id="s")
    closed = manager.close_session("s")
    assert closed.status == "closed" and manager.sessions() == []
    assert (await manager.wait(cmd.id, timeout=DEADLINE)).status == "killed"
    with pytest.raises(WorkspaceError):
        manager.session("s")


async def test_max_sessions(manager: CommandManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "MAX_SESSIONS", 2)
    await manager.open_session("a")
    await manager.run("true", session_id="b")
    with pytest.raises(TooManyCommands):
        await manager.open_session("c")
    with pytest.raises(TooManyCommands):
        await manager.run("true", session_id="c")
    manager.close_session("a")
    await manager.open_session("c")


# -- closing -----------------------------------------------------------------------------


async def test_close_kills_everything(tmp_path: Path) -> None:
    manager = CommandManager(local_machine(tmp_path))
    cmd = await manager.start("sleep 1000 & echo $!; wait")
    grandchild = int(await output_until(manager, cmd, lambda out: out.endswith(b"\n")))
    await manager.open_session("s")
    await manager.close()
    assert cmd.status == "killed" and manager.sessions() == []
    await until_dead(grandchild)
    with pytest.raises(WorkspaceError) as err:
        await manager.start("true")
    assert err.value.error_type == "io_error"


async def test_a_run_cancelled_while_its_process_is_being_made_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller goes away after the machine started the process but before spawn returned
    (a loaded host): nobody is left to stop it, so it must be killed, not left running."""
    machine = local_machine(tmp_path / "root")
    real_spawn = machine.spawn
    spawned = asyncio.Event()

    async def slow_spawn(request: Any) -> Any:
        process = await real_spawn(request)
        spawned.set()
        await asyncio.sleep(0.5)  # the window a loaded event loop leaves
        return process

    monkeypatch.setattr(machine, "spawn", slow_spawn)
    manager = CommandManager(machine)
    task = asyncio.create_task(manager.run("echo $$ > pid; exec sleep 1000"))
    await asyncio.wait_for(spawned.wait(), DEADLINE)
    pid_file = root(manager) / "pid"
    end = time.monotonic() + DEADLINE
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until_dead(int(pid_file.read_text()))
    await manager.close()
