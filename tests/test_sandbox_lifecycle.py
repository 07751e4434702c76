"""Lifecycle of per-session sandboxes: lazy creation, rebuilds, markers, idle reclaim, purge, commands.

Through the Registry where the lifecycle is the registry's (open, suspend, sweep, recover,
purge) and on a bare SandboxMachine where it is the machine's (busy, exec, cancel).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, RegistryFactory, SandboxFactory, sandbox_host_pid

from agentbox.machines.agent_channel import PIPE_CHUNK, AgentChannel
from agentbox.machines.base import STREAM_BUFFER, ExecRequest, ExecResult, collect
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.registry import ACTIVITY_FILE
from agentbox.machines.sandbox import (
    LAYER_MAKING_SECONDS,
    OWNER_FILE,
    SandboxConfig,
    SandboxHost,
    SandboxMachine,
    owner_token,
    release_orphaned_layers,
)

#: "Promptly": how long a killed command's processes may take to disappear.
KILL_SECONDS = 2.0
#: Bytes past 2 x STREAM_BUFFER a command writes to be left waiting: a read of PIPE_CHUNK
#: over the bound, the pipe's 64 KiB, and as much again that has nowhere to go.
PAST_THE_BOUND = 4 * PIPE_CHUNK
#: Seconds such a command is left unread (ample for its output to pass through a pipe read).
UNREAD_SECONDS = 1.0
#: How much longer than its timeout an exec may take to return.
TIMEOUT_SLACK = 3.0
#: "Fails fast": a sandbox that cannot start must say so well before START_TIMEOUT.
FAIL_FAST_SECONDS = 5.0
DAY = 86400.0
#: Shell redirections closing every descriptor a POSIX sh can name.
CLOSE_ALL_FDS = " ".join(f"{fd}>&-" for fd in range(10))
FD_PROBE = """
import os
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
print([fd for fd in range(3, 1024) if is_open(fd)])
"""


async def sh(m: SandboxMachine, command: str) -> ExecResult:
    return await m.exec(ExecRequest(command=command, timeout=SANDBOX_DEADLINE))


def sandbox(m: object) -> SandboxMachine:
    assert isinstance(m, SandboxMachine)
    return m


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


async def wait_gone(pid: int, seconds: float) -> float:
    """Seconds until `pid` is gone; fails after `seconds`."""
    started = time.monotonic()
    while alive(pid):
        assert time.monotonic() - started < seconds, f"pid {pid} still alive after {seconds} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def wait_for_file(m: SandboxMachine, path: str) -> str:
    """The content of a file a command inside writes, once it is there."""
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while True:
        if m.view.exists(path) and (text := m.view.read_bytes(path, 1 << 20).decode().strip()):
            return text
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.01)


async def marker_rows(db: object, session_id: str) -> int:
    from agentbox.store.db import Database

    assert isinstance(db, Database)
    rows = await db.fetchall("SELECT id FROM machine_markers WHERE session_id = ?", (session_id,))
    return len(rows)


# ---------------------------------------------------------------- the registry's lifecycle


async def test_open_creates_and_starts_lazily(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    registry = kit.registry
    assert not registry.session_dir("s1").exists()
    assert registry.entry("s1") is None
    await registry.open(None, "local")  # a shared machine makes no session directory
    assert not registry.session_dir("s1").exists()
    m = sandbox(await registry.open("s1"))
    assert m.state == "running"
    assert (registry.session_dir("s1") / "workspace").is_dir()
    entry = registry.entry("s1")
    assert entry is not None and entry.machine is m and entry.generation == 1
    assert not registry.session_dir("s2").exists()


async def test_tmp_home_and_installs_reset_on_rebuild_while_workspace_persists(
    make_registry: RegistryFactory,
) -> None:
    kit = await make_registry()
    entry = await kit.registry.open_entry("s1")
    m = sandbox(entry.machine)
    tag = uuid.uuid4().hex[:8]
    user_site = (
        (await sh(m, "python3 -c 'import site; print(site.getusersitepackages())'")).stdout.decode().strip()
    )
    system_site = (
        (await sh(m, "python3 -c 'import site; print(site.getsitepackages()[0])'")).stdout.decode().strip()
    )
    modules = [f"usermod_{tag}"] + ([f"sysmod_{tag}"] if m.layer_on else [])
    install = f"mkdir -p {user_site} && echo 'VALUE = 1' > {user_site}/usermod_{tag}.py"
    if m.layer_on:  # a system-level install: only where the discardable layer exists
        install += f" && echo 'VALUE = 2' > {system_site}/sysmod_{tag}.py"
    result = await sh(m, f"{install} && echo kept > /workspace/kept.txt && echo lost > /tmp/lost.txt")
    assert result.exit_code == 0, result.stderr
    imports = "python3 -c '" + "; ".join(f"import {name}" for name in modules) + "'"
    assert (await sh(m, imports)).exit_code == 0
    assert (await sh(m, "cat /tmp/lost.txt")).stdout == b"lost\n"  # within a lifetime it stays

    await kit.registry.suspend(entry)
    assert entry.state == "suspended" and m.state == "stopped"
    again = await kit.registry.open_entry("s1")
    assert again is entry and again.machine is m and entry.generation == 2
    assert m.state == "running"
    assert (await sh(m, "cat /workspace/kept.txt")).stdout == b"kept\n"
    assert (await sh(m, "test -e /tmp/lost.txt")).exit_code != 0
    for name in modules:
        assert (await sh(m, f"python3 -c 'import {name}'")).exit_code != 0, f"{name} survived the rebuild"
    assert not Path(f"{system_site}/sysmod_{tag}.py").exists()  # never on the host


async def test_concurrent_opens_share_one_open(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    machines = await asyncio.gather(*(kit.registry.open("s1") for _ in range(10)))
    assert all(m is machines[0] for m in machines)
    assert len(kit.registry.entries()) == 1
    assert await marker_rows(kit.db, "s1") == 1


async def test_open_racing_a_suspend_gets_a_working_sandbox(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    entry = await kit.registry.open_entry("s1")
    _, m = await asyncio.gather(kit.registry.suspend(entry), kit.registry.open("s1"))
    m = sandbox(m)
    assert entry.state == "running" and m.state == "running"
    result = await sh(m, "echo fresh > /tmp/probe && cat /tmp/probe")
    assert result.stdout == b"fresh\n", result
    assert m.view.read_bytes("/tmp/probe", 100) == b"fresh\n"


async def test_markers_survive_a_restart(make_registry: RegistryFactory) -> None:
    first = await make_registry()
    m = sandbox(await first.registry.open("s1"))
    sandbox_id = m.sandbox_id
    await sh(m, "echo before > /workspace/note.txt")
    run_dir = m.run
    await first.close()  # the server stops; markers stay live

    second = await make_registry(first.settings)
    assert await second.registry.recover() == ["s1"]
    assert not run_dir.exists()  # what the dead sandbox left is cleaned up
    again = sandbox(await second.registry.open("s1"))
    assert again.sandbox_id == sandbox_id
    assert (await sh(again, "cat /workspace/note.txt")).stdout == b"before\n"

    await second.registry.close_session("s1")  # closed for good: nothing to reconnect to
    assert await second.registry.recover() == []
    assert sandbox(await second.registry.open("s1")).sandbox_id != sandbox_id


async def test_idle_sweep_spares_a_sandbox_running_a_command(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    idle = await kit.registry.open_entry("idle")
    busy = await kit.registry.open_entry("busy")
    process = await busy.machine.spawn(ExecRequest(argv=("sleep", "30")))
    idle_seconds = kit.settings.idle_minutes * 60
    assert sandbox(busy.machine).busy() and not sandbox(idle.machine).busy()

    # Just inside the limit: not yet ((a + b) - a can exceed b in floating point, hence the margin).
    await kit.registry.sweep(now=sandbox(idle.machine).last_used + idle_seconds - 1e-3)
    assert idle.state == "running"
    await kit.registry.sweep(now=time.monotonic() + idle_seconds + 1)
    assert idle.state == "suspended" and sandbox(idle.machine).state == "stopped"
    assert busy.state == "running" and sandbox(busy.machine).state == "running"

    process.kill()
    assert await process.wait() == 137
    await kit.registry.sweep(now=time.monotonic() + idle_seconds + 1)
    assert busy.state == "suspended"


async def test_purge_inactive_removes_old_workspaces_only(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    registry = kit.registry
    live = sandbox(await registry.open("live"))
    now = time.time()
    limit = kit.settings.purge_days * DAY
    ages = {"old": limit + 1, "edge": limit, "recent": DAY, "live": limit + 1}
    for name, age in ages.items():
        workspace = registry.session_dir(name) / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "file.txt").write_text(name)
        activity = registry.session_dir(name) / ACTIVITY_FILE
        activity.touch()
        os.utime(activity, (now - age, now - age))
    assert registry.purge_inactive(wall_now=now) == ["old"]
    assert not (registry.session_dir("old") / "workspace").exists()
    for name in ("edge", "recent", "live"):
        assert (registry.session_dir(name) / "workspace" / "file.txt").read_text() == name
    assert (await sh(live, "cat /workspace/file.txt")).stdout == b"live"


# ---------------------------------------------------------------- the machine's lifecycle


@pytest.mark.parametrize(
    ("network", "layer"), [(False, False), (False, True), (True, False), (True, True)],
    ids=["plain", "layer", "network", "network+layer"],
)  # fmt: skip
async def test_a_process_left_behind_keeps_the_sandbox_busy(
    make_sandbox: SandboxFactory, network: bool, layer: bool
) -> None:
    m = await make_sandbox(SandboxConfig(network=network, system_layer=layer))
    assert not m.busy()
    # All of the child's descriptors closed, so exec returns whatever a command inherits
    # (that is test_commands_inherit_only_their_standard_streams's business).
    result = await sh(m, f"(exec sleep 30 {CLOSE_ALL_FDS}) & echo $! > /tmp/bg.pid")
    assert result.exit_code == 0 and m.running == 0
    assert m.busy(), "a background process left by a command must keep the sandbox alive"
    await sh(m, "kill $(cat /tmp/bg.pid)")
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while m.busy():
        assert time.monotonic() < deadline, "still busy after the background process ended"
        await asyncio.sleep(0.01)


#: Prints `gone`, or the State letter and the shared pending signals (hex) of the pid in /tmp/bg.pid.
PROCESS_STATE = (
    "p=$(cat /tmp/bg.pid); [ -e /proc/$p ] || { echo gone; exit; }; "
    "while read k v rest; do case $k in State:) s=$v;; ShdPnd:) d=$v;; esac; done < /proc/$p/status; "
    'echo "$s $d"'
)


def being_killed(state: str) -> bool:
    """Gone, a zombie, or SIGKILL on its way: what a process is just after its group was killed."""
    if state == "gone":
        return True
    letter, pending = state.split()
    return letter == "Z" or bool(int(pending, 16) & 1 << (signal.SIGKILL - 1))


async def test_a_command_that_ends_its_group_leaves_nothing_at_its_exit(make_sandbox: SandboxFactory) -> None:
    """`end_group`: the exec agent kills what the command left in its group before it reports
    the exit, so the leftover is already on its way out when `wait` returns (no `G` after
    it); without it, the leftover lives on until someone kills the group."""
    m = await make_sandbox()
    for end_group in (False, True):
        request = ExecRequest(
            command=f"(exec sleep 30 {CLOSE_ALL_FDS}) & echo $! > /tmp/bg.pid", end_group=end_group
        )
        process = await m.spawn(request)
        result = await collect(process, 1024, SANDBOX_DEADLINE)
        assert result.exit_code == 0
        state = (await sh(m, PROCESS_STATE)).stdout.decode().strip()
        assert being_killed(state) is end_group, f"end_group={end_group}: the leftover is {state!r}"
        process.kill()  # what the command manager does after the exit: ends it when the agent has not
        deadline = time.monotonic() + KILL_SECONDS
        while not being_killed((await sh(m, PROCESS_STATE)).stdout.decode().strip()):
            assert time.monotonic() < deadline, "the group kill after the exit did not end the leftover"
            await asyncio.sleep(0.01)


async def test_cancelled_exec_kills_its_process_group(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    task = asyncio.ensure_future(sh(m, "sleep 1000 & echo $! > /tmp/bg.pid; wait"))
    child = await sandbox_host_pid(m, int(await wait_for_file(m, "/tmp/bg.pid")))
    assert alive(child)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_gone(child, KILL_SECONDS)
    deadline = time.monotonic() + KILL_SECONDS
    while m.running:  # the agent reports the shell's end a moment later
        assert time.monotonic() < deadline, "the cancelled command is still counted as running"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("total", "finishes_unread"),
    [(2 * STREAM_BUFFER, True), (2 * STREAM_BUFFER + PAST_THE_BOUND, False)],
    ids=["at-the-bound", "past-it"],
)
async def test_output_nobody_reads_waits_in_the_pipe_instead_of_the_server(
    make_sandbox: SandboxFactory, total: int, finishes_unread: bool
) -> None:
    """The server takes up to 2 x STREAM_BUFFER of a stream nobody reads, then stops reading
    it: a command writing more blocks on its pipe, and nothing is lost once it is read."""
    m = await make_sandbox()
    process = await m.spawn(ExecRequest(command=f"head -c {total} /dev/zero; echo > /tmp/flooded"))
    if finishes_unread:
        deadline = time.monotonic() + SANDBOX_DEADLINE
        while not m.view.exists("/tmp/flooded"):
            assert time.monotonic() < deadline, "a command within the bound waited for its reader"
            await asyncio.sleep(0.01)
    else:
        await asyncio.sleep(UNREAD_SECONDS)
        assert not m.view.exists("/tmp/flooded"), "the server took the whole flood into memory"
    read = 0
    while chunk := await process.stdout.read(65536):
        read += len(chunk)
    assert read == total and await process.wait() == 0
    assert m.view.exists("/tmp/flooded")


async def test_an_exec_cancelled_before_its_pid_comes_still_kills_its_command(
    make_sandbox: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent starts a command as soon as it reads the spawn; a caller that gives up before
    the pid comes back must not leave that command running, counted nowhere."""
    m = await make_sandbox()
    send = AgentChannel.send

    def send_then_give_up(
        channel: AgentChannel, fields: Sequence[bytes | str | int], fds: Sequence[int] | None = None
    ) -> None:
        send(channel, fields, fds)
        if isinstance(fields[0], bytes) and fields[0].startswith(b"S"):
            task.cancel()  # lands at the wait for the pid: the spawn is already on its way

    monkeypatch.setattr(AgentChannel, "send", send_then_give_up)
    task = asyncio.ensure_future(m.exec(ExecRequest(argv=("sleep", "1000"), timeout=SANDBOX_DEADLINE)))
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.undo()
    assert m.running == 0
    deadline = time.monotonic() + KILL_SECONDS
    # The agent spawns in the order it reads, so `sleep` is born before this listing runs.
    while (await sh(m, "cat /proc/[0-9]*/comm")).stdout.split().count(b"sleep"):
        assert time.monotonic() < deadline, "the command given up on still runs"
        await asyncio.sleep(0.05)


async def test_cancelled_exec_kills_a_child_its_shell_left_holding_the_output(
    make_sandbox: SandboxFactory,
) -> None:
    """The shell exits at once; the background child keeps stdout open, so exec is still waiting."""
    m = await make_sandbox()
    task = asyncio.ensure_future(sh(m, "sleep 1000 & echo $! > /tmp/bg.pid"))
    child = await sandbox_host_pid(m, int(await wait_for_file(m, "/tmp/bg.pid")))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_gone(child, KILL_SECONDS)


async def test_timeout_bounds_exec_even_when_a_child_holds_the_output(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    timeout = 1.0
    request = ExecRequest(command="sleep 1000 & echo $! > /tmp/bg.pid; echo started", timeout=timeout)
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(m.exec(request), timeout + TIMEOUT_SLACK)
    except TimeoutError:
        pytest.fail(f"exec with timeout={timeout} still running after {timeout + TIMEOUT_SLACK} s")
    assert time.monotonic() - started < timeout + TIMEOUT_SLACK
    assert b"started" in result.stdout
    inside = int(await wait_for_file(m, "/tmp/bg.pid"))
    try:
        child = await sandbox_host_pid(m, inside)
    except AssertionError:
        return  # no process has that pid any more: it was killed with its group already
    await wait_gone(child, KILL_SECONDS)


async def test_commands_inherit_only_their_standard_streams(make_sandbox: SandboxFactory) -> None:
    """No copy of the output pipes (a background child would hold exec open) and no control socket."""
    m = await make_sandbox()
    result = await m.exec(ExecRequest(argv=("python3", "-I", "-c", FD_PROBE), timeout=SANDBOX_DEADLINE))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"[]\n", "descriptors beyond 0-2 leak into commands: " + result.stdout.decode()


async def test_input_a_command_does_not_read_never_stops_the_server(make_sandbox: SandboxFactory) -> None:
    """A full stdin pipe makes the write wait, not the event loop (the command sleeps 2 s: a
    blocked loop would come back only then); the command's exit ends the wait as a broken pipe."""
    machine = await make_sandbox()
    process = await machine.spawn(ExecRequest(command="sleep 2", interactive=True))
    loop = asyncio.get_running_loop()
    writing = asyncio.ensure_future(process.write_stdin(bytes(1 << 20)))  # far past a pipe's 64 KiB
    started = loop.time()
    await asyncio.sleep(0.1)
    assert loop.time() - started < 1.0 and not writing.done()
    process.kill()
    with pytest.raises(BrokenPipeError):
        await asyncio.wait_for(writing, SANDBOX_DEADLINE)


async def test_failures_of_the_command_are_ordinary_results(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    result = await sh(m, "echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert (await sh(m, "kill -9 $$")).exit_code == 137
    assert (await sh(m, "kill -TERM $$")).exit_code == 143
    missing = await sh(m, "agentbox-no-such-command")
    assert missing.exit_code == 127 and b"not found" in missing.stderr
    assert m.running == 0


async def test_a_missing_binary_raises_a_clear_error(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    with pytest.raises(FileNotFoundError) as raised:
        await m.exec(ExecRequest(argv=("agentbox-no-such-binary", "--flag")))
    assert "agentbox-no-such-binary" in str(raised.value)
    assert m.running == 0 and not m.busy()
    assert (await sh(m, "echo still-fine")).stdout == b"still-fine\n"


async def test_a_sandbox_that_cannot_start_fails_fast(sandbox_host: SandboxHost, sandbox_tmp: Path) -> None:
    """Here: a workspace below a directory the sandbox uid may not search (0700, root's)."""
    if os.geteuid() != 0:
        pytest.skip("only a root server switches to a sandbox uid that can be locked out")
    closed = sandbox_tmp / "closed"
    closed.mkdir(mode=0o700)
    m = SandboxMachine("sandbox", "sbx_cannot_start", sandbox_host, SandboxConfig(network=False),
                       closed / "workspace", closed / "run")  # fmt: skip
    started = time.monotonic()
    try:
        await asyncio.wait_for(m.start(), FAIL_FAST_SECONDS)
    except MachineUnavailable as exc:
        assert str(exc), "the error must say why"
    except TimeoutError:
        pytest.fail(f"start neither worked nor failed within {FAIL_FAST_SECONDS} s")
    else:
        assert (await sh(m, "echo ok")).stdout == b"ok\n"  # working is fine too
    finally:
        await m.stop()
    assert time.monotonic() - started < FAIL_FAST_SECONDS + 1


def test_a_sweep_leaves_a_layer_directory_another_server_is_making(tmp_path: Path) -> None:
    """Two root servers share the runtime dir: one's start-up sweep must not take the other's
    directory in the moment between its mkdir and its owner file (that start then fails)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    making, stale, dead, live = (tmp_path / n for n in (".sbx_a.new", ".sbx_b.new", "sbx_c", "sbx_d"))
    for d in (making, stale, dead, live):
        d.mkdir()
    (dead / OWNER_FILE).write_text("1-gone")
    (live / OWNER_FILE).write_text(owner_token())
    old = time.time() - LAYER_MAKING_SECONDS - 1
    os.utime(stale, (old, old))
    release_orphaned_layers(tmp_path, libc)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sbx_a.new", "sbx_d"]
