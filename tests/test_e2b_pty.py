"""PTYs through the stock `e2b` SDK (sync and async clients) against a real `agentbox serve`.

The SDK is pointed at the session's E2B endpoint (tests/conftest.py `e2b_endpoint`); each
sandbox is a real bubblewrap sandbox, and `sandbox.pty.create` runs the SDK's own
`/bin/bash -i -l` on a terminal its exec agent opened inside. What a terminal shows is
checked as whole lines (its control sequences, the shell's bracketed-paste switches, taken
out), so the echo of a typed line, which holds the same words before they ran, never passes
for the output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox
from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException
from e2b.sandbox.commands.stream_input import stream_input_data

from agentbox.machines.base import MAX_TERMINAL_SIDE
from tests.conftest import (
    POLL_SECONDS,
    SANDBOX_DEADLINE,
    Server,
    eventually,
    point_e2b_sdk,
    start_e2b_client,
    stop_server,
    traversable,
)

SIZE = PtySize(rows=24, cols=80)
#: A pid no sandbox hands out (they count up from the table's first, 1000).
NO_SUCH_PID = 999_999
#: A terminal's control sequences (CSI ... final byte), as bash's readline writes them.
CONTROL_SEQUENCE = re.compile(r"\x1b\[[0-9;?]*[@-~]")


class Screen:
    """Everything a terminal showed, fed by the SDK's pty callback (from any thread)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._lock = threading.Lock()

    def feed(self, chunk: bytes) -> None:
        with self._lock:
            self.data += chunk

    def lines(self) -> list[str]:
        with self._lock:
            text = CONTROL_SEQUENCE.sub("", self.data.decode(errors="replace"))
        return [line.strip("\r") for line in text.split("\r\n")]

    def shows(self, *lines: str) -> bool:
        """Whether these lines appeared, one after the other."""
        shown = self.lines()
        return any(shown[i : i + len(lines)] == list(lines) for i in range(len(shown)))

    def wait_for(self, *lines: str) -> None:
        try:
            eventually(lambda: self.shows(*lines), f"{lines} on the terminal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it shows {self.lines()}") from None

    async def until(self, *lines: str) -> None:
        async with asyncio.timeout(SANDBOX_DEADLINE):
            while not self.shows(*lines):
                await asyncio.sleep(POLL_SECONDS)


@pytest.fixture(scope="module")
def sdk_env(e2b_endpoint: Server) -> Iterator[Server]:
    """The SDK's environment pointed at the E2B endpoint, for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        point_e2b_sdk(mp, e2b_endpoint)
        yield e2b_endpoint


@pytest.fixture
def sbx(sdk_env: Server) -> Iterator[Sandbox]:
    sandbox = Sandbox.create()
    yield sandbox
    sandbox.kill()


@pytest.fixture
def reader() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """Threads that follow a terminal (`handle.wait`) while the test types into it."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield pool


def test_a_pty_runs_bash_on_a_terminal_of_its_size(
    sbx: Sandbox, reader: concurrent.futures.ThreadPoolExecutor
) -> None:
    handle = sbx.pty.create(SIZE)
    screen = Screen()
    ended = reader.submit(handle.wait, on_pty=screen.feed)
    sbx.pty.send_stdin(handle.pid, b"echo $((6*7))\n")
    screen.wait_for("42")
    sbx.pty.send_stdin(handle.pid, b"stty size; test -t 0 && test -t 1 && echo tty-$((1+1))\n")
    screen.wait_for("24 80", "tty-2")
    sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(handle.pid, b"stty size\n")
    screen.wait_for("30 100")
    listed = {p.pid: p for p in sbx.commands.list()}
    assert (listed[handle.pid].cmd, listed[handle.pid].args) == ("/bin/bash", ["-i", "-l"])
    assert listed[handle.pid].envs["TERM"] == "xterm-256color"
    assert sbx.pty.kill(handle.pid)
    with pytest.raises(CommandExitException) as killed:
        ended.result(SANDBOX_DEADLINE)
    assert killed.value.exit_code == 137
    assert handle.pid not in [p.pid for p in sbx.commands.list()]
    # The terminal has ended with its process: envd has forgotten it.
    with pytest.raises(NotFoundException):
        sbx.pty.resize(handle.pid, SIZE)
    with pytest.raises(NotFoundException):
        sbx.pty.send_stdin(handle.pid, b"exit\n")


def test_stream_input_and_a_second_reader_by_connect(
    sbx: Sandbox, reader: concurrent.futures.ThreadPoolExecutor
) -> None:
    handle = sbx.pty.create(SIZE)
    first, second = Screen(), Screen()
    ended = reader.submit(handle.wait, on_pty=first.feed)
    sbx.pty.send_stdin(handle.pid, b"echo up-$((1+2))\n")
    first.wait_for("up-3")
    joined = sbx.pty.connect(handle.pid)
    reader.submit(joined.wait, on_pty=second.feed)
    sbx.pty.stream_input(handle.pid, ["echo str", "eam-$((2+3))", "\n"])
    for screen in (first, second):
        screen.wait_for("stream-5")
    assert not second.shows("up-3")  # connect follows from now on
    sbx.pty.send_stdin(handle.pid, b"exit 4\n")
    with pytest.raises(CommandExitException) as exited:
        ended.result(SANDBOX_DEADLINE)
    assert exited.value.exit_code == 4


def test_stream_input_reaches_a_pipe_process_too(sbx: Sandbox) -> None:
    piped = sbx.commands.run("read a; read b; echo $a-$b", background=True, stdin=True)
    sbx.commands.stream_input(piped.pid, ["one\n", "tw", "o\n"])
    assert piped.wait().stdout == "one-two\n"


def test_what_a_pty_refuses(sbx: Sandbox) -> None:
    for resize_or_type in (
        lambda: sbx.pty.resize(NO_SUCH_PID, SIZE),
        lambda: sbx.pty.send_stdin(NO_SUCH_PID, b"x"),
        lambda: sbx.pty.stream_input(NO_SUCH_PID, ["x"]),
    ):
        with pytest.raises(NotFoundException):
            resize_or_type()
    with pytest.raises(InvalidArgumentException, match=str(MAX_TERMINAL_SIDE)):
        sbx.pty.create(PtySize(rows=MAX_TERMINAL_SIDE + 1, cols=80))
    piped = sbx.commands.run("sleep 600", background=True)
    with pytest.raises(SandboxException, match="not run on a pty"):
        sbx.pty.send_stdin(piped.pid, b"x")
    with pytest.raises(SandboxException, match="no pty"):
        sbx.pty.resize(piped.pid, SIZE)
    terminal = sbx.pty.create(PtySize(rows=MAX_TERMINAL_SIDE, cols=MAX_TERMINAL_SIDE))
    with pytest.raises(InvalidArgumentException, match=str(MAX_TERMINAL_SIDE)):
        sbx.pty.resize(terminal.pid, PtySize(rows=0, cols=80))
    with pytest.raises(SandboxException, match="runs on a pty"):
        sbx.commands.send_stdin(terminal.pid, "x")
    # Input before the stream names its process is refused, and nothing is written.
    with pytest.raises(ConnectError, match="before the start") as unnamed:
        sbx.pty._rpc.stream_input(iter([stream_input_data("pty", b"x")]))
    assert unnamed.value.code == Code.INVALID_ARGUMENT
    assert sbx.pty.kill(terminal.pid) and sbx.commands.kill(piped.pid)


async def test_a_pty_through_the_async_sdk(sdk_env: Server) -> None:
    sandbox = await AsyncSandbox.create()
    try:
        screen = Screen()
        handle = await sandbox.pty.create(SIZE, on_data=screen.feed)
        await sandbox.pty.send_stdin(handle.pid, b"echo $((6*7)); stty size\n")
        await screen.until("42", "24 80")
        await sandbox.pty.resize(handle.pid, PtySize(rows=50, cols=132))
        await sandbox.pty.send_stdin(handle.pid, b"stty size\n")
        await screen.until("50 132")
        assert handle.pid in [p.pid for p in await sandbox.commands.list()]
        assert await sandbox.pty.kill(handle.pid)
        with pytest.raises(CommandExitException) as killed:
            await handle.wait()
        assert killed.value.exit_code == 137
    finally:
        await sandbox.kill()


def test_a_kind_without_terminals_refuses_a_pty(
    e2b_endpoint: Server, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose sandboxes are e2b machines (on the endpoint) runs commands, not PTYs."""
    home = traversable(tmp_path_factory.mktemp("e2b-client"), tmp_path_factory) / "home"
    home.mkdir()
    client = start_e2b_client(Path(home), e2b_endpoint)
    try:
        point_e2b_sdk(monkeypatch, client)
        sandbox = Sandbox.create()
        try:
            assert sandbox.commands.run("echo $((6*7))").stdout == "42\n"
            with pytest.raises(SandboxException, match=r"UNIMPLEMENTED.*pipes only"):
                sandbox.pty.create(SIZE)
        finally:
            sandbox.kill()
    finally:
        stop_server(client)
