"""Pseudo-terminals through the `Machine` protocol (`ExecRequest.pty`), on real machines.

A sandbox's pty is opened by its exec agent inside the sandbox (its own devpts), made the
command's controlling terminal and sized there; the server holds only the master. The docker
kind shares the agent, so the same checks run in a container of the session's dockerd. Kinds
that run commands on pipes only (local, and ssh on the loopback sshd) refuse with
`TerminalUnsupported`. The last tests go through the `CommandManager`, as envd does.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from conftest import SandboxFactory

from agentbox.machines.agent_channel import AgentProcess
from agentbox.machines.base import (
    MAX_TERMINAL_SIDE,
    ExecRequest,
    Machine,
    Process,
    Terminal,
    TerminalSize,
    collect,
)
from agentbox.machines.errors import TerminalUnsupported
from agentbox.machines.local import LocalMachine
from agentbox.workspace.commands import MAX_BUFFERED_OUTPUT, CommandManager
from agentbox.workspace.errors import WorkspaceError

#: Seconds a terminal's output may take to show what a test waits for.
DEADLINE = 20.0
SIZE = TerminalSize(rows=24, cols=80)

MachineFactory = Callable[[], Awaitable[Machine]]


@pytest.fixture(params=["sandbox", "docker"])
def make_agent_machine(request: pytest.FixtureRequest) -> MachineFactory:
    """Starts a machine of each kind that runs its commands through the exec agent."""
    fixture = "make_image_sandbox" if request.param == "sandbox" else "make_docker"
    factory: MachineFactory = request.getfixturevalue(fixture)
    return factory


@pytest.fixture
async def agent_machine(make_agent_machine: MachineFactory) -> Machine:
    return await make_agent_machine()


async def read_until(process: Process, needle: bytes, seen: bytearray) -> bytes:
    """The terminal's output (kept in `seen`) once it holds `needle`."""
    async with asyncio.timeout(DEADLINE):
        while needle not in seen:
            chunk = await process.stdout.read(4096)
            assert chunk, f"the terminal ended before {needle!r}; it showed {bytes(seen)!r}"
            seen += chunk
    return bytes(seen)


async def test_a_command_runs_on_a_terminal_of_the_asked_size(agent_machine: Machine) -> None:
    script = "test -t 0 && test -t 1 && test -t 2 && echo on-a-tty; stty size; tty; echo oops >&2"
    process = await agent_machine.spawn(ExecRequest(command=script, pty=SIZE))
    result = await collect(process, 1 << 16, DEADLINE)
    lines = result.stdout.decode().splitlines()
    assert result.exit_code == 0, result
    assert lines[:2] == ["on-a-tty", "24 80"]
    assert lines[2].startswith("/dev/pts/")  # the machine's own devpts, not the host's
    assert lines[3] == "oops"  # stderr is the terminal too: everything comes on stdout
    assert result.stderr == b""


async def test_the_terminal_is_the_commands_controlling_terminal(agent_machine: Machine) -> None:
    # A session leader with a controlling tty: /dev/tty opens, and its session is its own pid.
    script = "exec 3</dev/tty && echo ctty; ps -o sid= -p $$ | tr -d ' '; echo $$"
    process = await agent_machine.spawn(ExecRequest(argv=("/bin/bash", "-c", script), pty=SIZE))
    result = await collect(process, 1 << 16, DEADLINE)
    ctty, sid, pid = result.stdout.decode().split()
    assert (ctty, sid) == ("ctty", pid)


async def test_the_pty_is_of_the_machines_own_devpts(agent_machine: Machine) -> None:
    """The server holds a master of a devpts that is not the host's: the agent opened it inside."""
    process = await agent_machine.spawn(ExecRequest(command="read x", pty=SIZE))
    assert isinstance(process, AgentProcess) and process._tty is not None  # what resize sets the size on
    hosts = {os.stat(path).st_dev for path in ("/dev/ptmx", "/dev/pts/ptmx")}
    assert os.fstat(process._tty).st_dev not in hosts
    process.kill()
    await asyncio.wait_for(process.wait(), DEADLINE)


async def test_input_is_typed_into_the_terminal_and_resize_sends_sigwinch(agent_machine: Machine) -> None:
    # bash runs a trap between commands: the loop of short sleeps lets it run soon after a signal.
    script = "trap 'echo winch; stty size' WINCH; echo ready; read line; echo got-$line; while :; do sleep 0.05; done"
    process = await agent_machine.spawn(ExecRequest(argv=("/bin/bash", "-c", script), pty=SIZE))
    assert isinstance(process, Terminal)
    seen = bytearray()
    await read_until(process, b"ready", seen)
    await process.write_stdin(b"hello\n")
    await read_until(process, b"got-hello", seen)
    assert b"hello\r\n" in seen  # the terminal echoed the typing, with its own line ending
    process.resize(TerminalSize(rows=30, cols=100))
    await read_until(process, b"winch\r\n30 100", seen)
    process.kill(signal.SIGKILL)
    assert await asyncio.wait_for(process.wait(), DEADLINE) == 128 + signal.SIGKILL
    with pytest.raises(OSError) as ended:  # the terminal is gone with its command
        process.resize(SIZE)
    assert ended.value.errno == errno.ENOTTY


async def test_the_largest_terminal_the_kernel_holds(agent_machine: Machine) -> None:
    biggest = TerminalSize(rows=MAX_TERMINAL_SIDE, cols=MAX_TERMINAL_SIDE)
    process = await agent_machine.spawn(ExecRequest(command="stty size", pty=biggest))
    result = await collect(process, 1 << 16, DEADLINE)
    assert result.stdout.split() == [str(MAX_TERMINAL_SIDE).encode()] * 2


@pytest.mark.parametrize(("rows", "cols"), [(0, 80), (24, 0), (MAX_TERMINAL_SIDE + 1, 80), (24, -1)])
def test_a_size_the_kernel_cannot_hold_is_refused(rows: int, cols: int) -> None:
    with pytest.raises(ValueError, match=str(MAX_TERMINAL_SIDE)):
        TerminalSize(rows=rows, cols=cols)


async def test_a_program_that_does_not_exist_fails_as_on_pipes(agent_machine: Machine) -> None:
    with pytest.raises(FileNotFoundError):
        await agent_machine.spawn(ExecRequest(argv=("/no/such/program",), pty=SIZE))
    # The machine's agent is still there and serves the next one.
    result = await agent_machine.exec(ExecRequest(command="echo alive"))
    assert result.stdout == b"alive\n"


@pytest.mark.parametrize("pty", [SIZE, None], ids=["pty", "pipes"])
async def test_a_finished_command_leaves_no_descriptor_on_the_server(
    make_image_sandbox: SandboxFactory, pty: TerminalSize | None
) -> None:
    """Its input end (and a terminal's master) is closed at its exit, though nobody closed stdin."""
    machine = await make_image_sandbox()
    request = ExecRequest(command="read x; echo $x", interactive=True, pty=pty)
    await collect(await machine.spawn(ExecRequest(command="true", pty=SIZE)), 1, DEADLINE)  # fcntl loaded
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        process = await machine.spawn(request)
        await process.write_stdin(b"typed\n")
        result = await collect(process, 1 << 16, DEADLINE)
        assert result.stdout.splitlines()[-1].rstrip(b"\r") == b"typed"
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.fixture(params=["local", "ssh"])
def make_pipes_machine(request: pytest.FixtureRequest, tmp_path: Path) -> MachineFactory:
    """Starts a machine of each kind that runs its commands on pipes only."""
    if request.param == "ssh":
        factory: MachineFactory = request.getfixturevalue("make_ssh")
        return factory

    async def local() -> Machine:
        return LocalMachine("here", tmp_path)

    return local


async def test_a_kind_on_pipes_refuses_a_terminal(make_pipes_machine: MachineFactory) -> None:
    machine = await make_pipes_machine()
    with pytest.raises(TerminalUnsupported, match="pipes only"):
        await machine.spawn(ExecRequest(command="true", pty=SIZE))
    assert (await machine.exec(ExecRequest(command="test -t 0 || echo pipes"))).stdout == b"pipes\n"


# -- through the command manager (what envd and /v2/commands stand on) -------------------------


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_terminals_output_has_the_commands_cap(
    make_image_sandbox: SandboxFactory, extra: int
) -> None:
    manager = CommandManager(await make_image_sandbox())
    try:
        written = MAX_BUFFERED_OUTPUT + extra
        cmd = await manager.start(f"head -c {written} /dev/zero", pty=SIZE)  # NULs pass a tty as they are
        await manager.wait(cmd.id, timeout=DEADLINE)
        assert (cmd.status, cmd.exit_code, cmd.stdout.total, cmd.stderr.total) == ("completed", 0, written, 0)
        assert cmd.stdout.truncated is bool(extra)
        assert len(cmd.stdout.getvalue()) == MAX_BUFFERED_OUTPUT
    finally:
        await manager.close()


async def test_the_manager_resizes_only_a_running_terminal(make_image_sandbox: SandboxFactory) -> None:
    manager = CommandManager(await make_image_sandbox())
    try:
        piped = await manager.start("sleep 600")
        with pytest.raises(WorkspaceError, match="does not run on a terminal"):
            manager.resize(piped.id, SIZE)
        cmd = await manager.start("read x; stty size", pty=SIZE)
        bigger = TerminalSize(rows=40, cols=120)
        assert manager.resize(cmd.id, bigger).pty == bigger
        await manager.write_stdin(cmd.id, b"\n")
        await manager.wait(cmd.id, timeout=DEADLINE)
        assert cmd.stdout.getvalue().splitlines()[-1] == b"40 120"
        with pytest.raises(WorkspaceError, match="has ended") as ended:
            manager.resize(cmd.id, SIZE)
        assert ended.value.error_type == "bad_request"
    finally:
        await manager.close()
