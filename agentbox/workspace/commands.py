"""Commands on a machine: sync and async runs, live output, stdin, kill, timeouts, sessions.

One `CommandManager` per machine (per sandbox) is the engine behind `/v2/commands`,
`/v1/bash/*`, `/v1/shell/*` and the exec tools. It only uses `Machine.spawn` and the
`Process` it returns, so it works the same for every machine kind.

Every command is a fresh `/bin/sh -c <command>` (or the argv its caller names) in its own
process group. Each stream is drained into an `OutputBuffer` for as long as the pipe is
open, whatever was kept, so a chatty command never blocks on a full pipe. Waiting (for the end, for new output) wakes on
an event set by the pumps, never on a polling sleep.

Lifecycle of a `Command` and how its status reads in the v1 APIs:

    status      meaning                                                v1 bash    v1 shell
    running     spawned, not ended yet                                 running    running
    completed   ended by itself, whatever its exit code                completed  completed
    timed_out   our deadline passed; we SIGKILLed its process group    timed_out  hard_timeout
    killed      it ended after `kill` (or close) was asked for         killed     terminated
    failed      the machine broke while it ran (`error` says how)      killed     terminated

v1 bash's `pending` is never reported: the record exists only once the process does. A
command that could not be spawned (missing cwd, machine down) raises `WorkspaceError` and
leaves no record; neither does one refused before any spawn, `bad_request`, for a command
line past `MAX_COMMAND_BYTES` (one argv string, as the kernel caps it) or an environment
past `MAX_ENV_BYTES`. `exit_code` is what the process reported: 128+N when signal N ended it
(137 after our SIGKILL), None when it never came back (see `KILL_GRACE_SECONDS`).

When a command's main process ends, what is left of its process group is SIGKILLed (seed
001: descendants are cleaned up after the end, not only on stop and timeout), unless the
caller passes `keep_background=True`. Work meant to outlive its command should be started
in async mode, or detach with `setsid`. A background child that keeps the output pipes
open keeps the command `running` on machines whose `Process.wait` waits for the pipes
(the local kind); where `wait` returns at exit, output is read for `DRAIN_GRACE_SECONDS`
more and then the record is closed.

Sessions (v1 bash/shell) are light: a working directory that is the default cwd of the
commands run "in" it, and some bookkeeping (last used, current command, count). There is
no persistent shell behind them: `cd` or `export` in one command does not carry over to
the next. That is deliberate and honest, not an emulation that works most of the time.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import re
import secrets
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Literal

from agentbox.ids import COMMAND, new_id
from agentbox.machines.base import ExecRequest, Machine, Process, Terminal, TerminalSize
from agentbox.workspace.errors import WorkspaceError, bad_request, operation
from agentbox.workspace.files import limit_exceeded

Status = Literal["running", "completed", "timed_out", "killed", "failed"]
SessionStatus = Literal["ready", "closed"]

#: Bytes of output one command keeps, over stdout and stderr together (seed 001's 1 MiB).
#: The pipes keep draining past it; the middle of the output is what gets dropped, first
#: from whichever stream keeps more.
MAX_BUFFERED_OUTPUT = 1024 * 1024
#: Longest command line, in UTF-8 bytes: it is one argv string (`sh -c <command>`), and the
#: kernel caps one at MAX_ARG_STRLEN (128 KiB with its NUL; longer is E2BIG at spawn).
MAX_COMMAND_BYTES = 128 * 1024 - 1
#: Most bytes of environment a command may add, each variable counted as `KEY=VALUE` plus
#: its NUL: with a MAX_COMMAND_BYTES command it still fits one control message to a
#: sandbox's exec agent, which a default socket buffer caps near 208 KiB.
MAX_ENV_BYTES = 32 * 1024
#: Bytes kept from the start of a stream once it overflows; the rest of the budget keeps
#: the latest output. The start shows what ran and its first errors, the end shows how it
#: finished; the middle (progress bars, long logs) is what an agent needs least.
KEPT_HEAD_BYTES = 64 * 1024
#: Bytes asked of a pipe per read.
READ_CHUNK_BYTES = 64 * 1024

#: Deadline of a sync `run` when the caller gives none (seed 001: 120 s).
DEFAULT_TIMEOUT_SECONDS = 120.0
#: Longest deadline a command may ask for, and longest single wait (seed 001: 1800 s).
MAX_TIMEOUT_SECONDS = 1800.0
#: How long to wait for a process to come back after SIGKILL before closing its record
#: with exit_code None: only a process outside the group (`setsid`) holding the pipes does that.
KILL_GRACE_SECONDS = 5.0
#: How long to keep reading output after the process has ended (a background child that
#: escaped the cleanup may still hold the pipes).
DRAIN_GRACE_SECONDS = 5.0
#: How long one `write_stdin` may wait for the command to read its input.
STDIN_WRITE_TIMEOUT_SECONDS = 30.0
#: Largest input a command may be started with (`run` / `start` with `input`).
MAX_INPUT_BYTES = 1024 * 1024

#: Commands running at once per manager; one more raises `TooManyCommands`.
MAX_RUNNING_COMMANDS = 32
#: Finished command records kept per manager; the oldest finished is forgotten first.
MAX_COMMANDS_KEPT = 200
#: Open sessions per manager; one more raises `TooManyCommands`.
MAX_SESSIONS = 64

#: Signals `kill` accepts, by the names the v1 API uses.
KILL_SIGNALS: dict[str, int] = {
    "SIGTERM": signal.SIGTERM,
    "SIGINT": signal.SIGINT,
    "SIGKILL": signal.SIGKILL,
}

#: How each status reads in `/v1/bash/*` (`pending` is never produced).
BASH_STATUS: dict[Status, str] = {
    "running": "running",
    "completed": "completed",
    "timed_out": "timed_out",
    "killed": "killed",
    "failed": "killed",
}
#: How each status reads in `/v1/shell/*` (the OpenHands set).
SHELL_STATUS: dict[Status, str] = {
    "running": "running",
    "completed": "completed",
    "timed_out": "hard_timeout",
    "killed": "terminated",
    "failed": "terminated",
}

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def _now() -> datetime:
    return datetime.now(UTC)


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


class TooManyCommands(WorkspaceError):
    """A count limit of the manager (running commands, sessions) is reached; retry later."""


def _not_found(kind: str, ident: str, op: str) -> WorkspaceError:
    return WorkspaceError("not_found", f"No {kind} with id {ident!r}", op, exception_type="KeyError")


def _too_many(what: str, limit: int, op: str) -> TooManyCommands:
    return TooManyCommands(
        "bad_request",
        f"Too many {what}: at most {limit} at once; wait for one to end or stop one",
        op,
        exception_type="TooManyCommands",
        retryable=True,
    )


@dataclass(frozen=True)
class OutputSlice:
    """Bytes of a stream from absolute offset `start`; the next read starts at `next_offset`.

    `skipped` > 0 says that many bytes after the requested offset were dropped by the
    output cap and are gone; `data` then starts past them.
    """

    data: bytes
    start: int
    next_offset: int
    skipped: int = 0


class CaptureBudget:
    """The bytes the output streams of one command keep together, at most `cap`. When they
    would keep more, the stream whose tail is longer drops its oldest tail bytes first."""

    def __init__(self, cap: int = MAX_BUFFERED_OUTPUT) -> None:
        self.cap = cap
        self.buffers: list[OutputBuffer] = []

    def fit(self) -> None:
        over = sum(b.kept for b in self.buffers) - self.cap
        while over > 0:
            longest, *rest = sorted(self.buffers, key=lambda b: b.tail_kept, reverse=True)
            if longest.tail_kept == 0:
                return  # only heads are left, and they fit (each head is at most a share)
            gap = longest.tail_kept - max((b.tail_kept for b in rest), default=0)
            cut = min(over, gap) if gap > 0 else max(1, over // 2)  # down to the next, then by turns
            longest.drop_oldest(cut)
            over -= cut


class OutputBuffer:
    """One output stream: the first `KEPT_HEAD_BYTES` and the latest bytes, within a budget.

    The budget is the buffer's own `cap`, or a `CaptureBudget` it shares with the command's
    other stream. Offsets are absolute positions in the whole stream as the command wrote it,
    so a reader's offset stays valid however much is dropped in between.
    """

    def __init__(
        self, cap: int | None = None, head: int | None = None, budget: CaptureBudget | None = None
    ) -> None:
        self.cap = (budget.cap if budget is not None else MAX_BUFFERED_OUTPUT) if cap is None else cap
        self.head_cap = min(KEPT_HEAD_BYTES if head is None else head, self.cap)
        self.budget = budget if budget is not None else CaptureBudget(self.cap)
        self.budget.buffers.append(self)
        self.total = 0
        self.closed = False
        self._head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_len = 0

    @classmethod
    def pair(cls, cap: int = MAX_BUFFERED_OUTPUT) -> tuple[OutputBuffer, OutputBuffer]:
        """stdout and stderr of one command, keeping at most `cap` bytes between them."""
        budget = CaptureBudget(cap)
        return cls(budget=budget), cls(budget=budget)

    @property
    def kept(self) -> int:
        return len(self._head) + self._tail_len

    @property
    def tail_kept(self) -> int:
        return self._tail_len

    @property
    def truncated(self) -> bool:
        """Whether bytes were dropped (the stream wrote more than it keeps)."""
        return self.total > self.kept

    @property
    def tail_start(self) -> int:
        """Absolute offset of the first byte kept after the head."""
        return self.total - self._tail_len

    @property
    def dropped(self) -> int:
        """Bytes lost between the head and the tail."""
        return self.tail_start - len(self._head)

    def append(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail.append(chunk)
            self._tail_len += len(chunk)
        self.budget.fit()

    def drop_oldest(self, count: int) -> None:
        """Drop the `count` oldest bytes of the tail (the middle of the stream grows)."""
        keep = self._tail_len - count
        while self._tail_len > keep:
            excess = self._tail_len - keep
            first = self._tail[0]
            if len(first) <= excess:
                self._tail.popleft()
                self._tail_len -= len(first)
            else:
                self._tail[0] = first[excess:]
                self._tail_len -= excess

    def close(self) -> None:
        self.closed = True

    def getvalue(self) -> bytes:
        """Everything kept: the head, then the tail (with the dropped middle missing)."""
        return bytes(self._head) + b"".join(self._tail)

    def text(self) -> str:
        """What was kept as text, with a marker where the middle was dropped."""
        head = bytes(self._head).decode("utf-8", "replace")
        tail = b"".join(self._tail).decode("utf-8", "replace")
        if not self.truncated:
            return head + tail
        return f"{head}\n[... {self.dropped} bytes of output omitted ...]\n{tail}"

    def read(self, offset: int) -> OutputSlice:
        """The kept bytes from `offset` on, never spanning the dropped middle.

        An offset inside the dropped middle reads from the tail and reports the skip. An
        offset past the end reads nothing (more may come). While the stream is open, an
        incomplete UTF-8 character at the very end is held back for the next read, unless
        that would leave nothing to return.
        """
        if offset < 0:
            raise bad_request("read", f"offset must be >= 0, got {offset}")
        head_len = len(self._head)
        if offset < head_len:
            data = bytes(self._head[offset:]) if self.truncated else self.getvalue()[offset:]
            start = offset
        else:
            start = max(offset, self.tail_start)
            data = b"".join(self._tail)[start - self.tail_start :]
        if not self.closed and start + len(data) == self.total:
            data = data[: _complete_utf8(data) or len(data)]
        return OutputSlice(data, start, start + len(data), start - offset)


def _complete_utf8(data: bytes) -> int:
    """Length of `data` without a trailing, incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)


@dataclass(eq=False)
class Command:
    """One command run by a `CommandManager`; read its fields, change it through the manager."""

    id: str
    command: str
    cwd: str | None
    env: dict[str, str]
    timeout: float | None
    session_id: str | None = None
    status: Status = "running"
    exit_code: int | None = None
    started_at: datetime = field(default_factory=_now)
    finished_at: datetime | None = None
    stdout: OutputBuffer = field(init=False)
    stderr: OutputBuffer = field(init=False)
    #: Whether `write_stdin` can still reach the process.
    stdin_open: bool = False
    #: The last signal `kill` sent, if any.
    kill_signal: int | None = None
    #: Why the record is `failed`.
    error: str | None = None
    #: The size of the pseudo-terminal it runs on (its output is all on `stdout`), or None.
    pty: TerminalSize | None = None
    _process: Process | None = field(default=None, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, repr=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _ended: asyncio.Future[None] = field(default_factory=_future, repr=False)
    """Resolved when the record is closed: what a sync run waits on, woken once."""
    _sigkilled: bool = field(default=False, repr=False)
    _on_sigkill: Callable[[], None] | None = field(default=None, repr=False)
    """Set while the exit is awaited: tells the waiting that a SIGKILL was asked for."""
    _stdin_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def __post_init__(self) -> None:
        self.stdout, self.stderr = OutputBuffer.pair()

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def duration(self) -> float:
        return ((self.finished_at or _now()) - self.started_at).total_seconds()

    def _notify(self) -> None:
        """Wake everyone waiting for a change (output, end) and arm a fresh event."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        """Return once `predicate()` holds or `timeout` passes, re-checking on every change."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    await self._changed.wait()
        except TimeoutError:
            pass


@dataclass(eq=False)
class ShellSession:
    """A v1 bash/shell session: a default working directory and bookkeeping, no live shell."""

    session_id: str
    working_dir: str
    created_at: datetime = field(default_factory=_now)
    last_used_at: datetime = field(default_factory=_now)
    status: SessionStatus = "ready"
    #: The command string of the session's newest command that is still running.
    current_command: str | None = None
    current_command_id: str | None = None
    #: The session's newest command, running or not (v1 `bash/output` without `command_id`).
    last_command_id: str | None = None
    command_count: int = 0

    @property
    def age_seconds(self) -> int:
        return int((_now() - self.created_at).total_seconds())


class CommandManager:
    """Runs and remembers the commands of one machine; bounded in every count."""

    def __init__(
        self,
        machine: Machine,
        on_start: Callable[[], None] | None = None,
        on_end: Callable[[Command], None] | None = None,
    ) -> None:
        self.machine = machine
        self.on_start = on_start
        """Called once per command launched (the server counts them for its metrics)."""
        self.on_end = on_end
        """Called once per command with its final record (status, start and end times)."""
        self._commands: dict[str, Command] = {}
        self._finished: deque[str] = deque()
        self._sessions: dict[str, ShellSession] = {}
        self._starting = 0
        self._running = 0
        """Records not finished yet: counted, not looked for among up to MAX_COMMANDS_KEPT."""
        self._feeding: set[asyncio.Task[None]] = set()
        """Inputs being written to commands started with one (`_feed`)."""
        self._closed = False

    # -- starting --------------------------------------------------------------------

    async def run(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
        session_id: str | None = None,
        keep_background: bool = False,
        input: bytes | None = None,
        argv: Sequence[str] = (),
    ) -> Command:
        """Run to the end (sync mode) with a deadline, stdin fed `input` then closed (else /dev/null).

        `timeout` defaults to `DEFAULT_TIMEOUT_SECONDS`. If the caller goes away (the task
        is cancelled), the command is killed: nobody is left to read its result. `argv`, when
        given, is run instead of `/bin/sh -c command` (one exec fewer for a caller that names
        its own program, such as the exec tool's `bash -c`); `command` is then what the
        record shows.
        """
        deadline = _check_timeout(DEFAULT_TIMEOUT_SECONDS if timeout is None else timeout)
        _check_input(input)
        cmd = await self._launch(
            command, cwd, env, deadline, session_id, input is not None, keep_background, argv=tuple(argv)
        )
        self._feed(cmd, input)
        try:
            await cmd._ended
        except asyncio.CancelledError:
            self.kill(cmd.id, signal.SIGKILL)
            raise
        return cmd

    async def start(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
        session_id: str | None = None,
        stdin: bool = True,
        keep_background: bool = False,
        input: bytes | None = None,
        pty: TerminalSize | None = None,
        user: str | None = None,
    ) -> Command:
        """Start and return at once (async mode), status `running`.

        No deadline unless `timeout` is given: a server started this way runs until it is
        killed or the manager closes. `stdin=True` keeps a pipe open for `write_stdin`
        (a command that reads stdin then waits for input or `close_stdin`); `input` is
        written to it first and then it is closed. `pty` runs it on a pseudo-terminal of
        that size instead (the machine's kind may refuse): `write_stdin` types into it,
        `resize` changes it, and all its output is `stdout`, under the same caps. `user` is
        the machine's account to run as (`ExecRequest.user`).
        """
        deadline = None if timeout is None else _check_timeout(timeout)
        _check_input(input)
        cmd = await self._launch(
            command, cwd, env, deadline, session_id, stdin or input is not None or pty is not None,
            keep_background, pty, user=user,
        )  # fmt: skip
        self._feed(cmd, input)
        return cmd

    def _feed(self, cmd: Command, data: bytes | None) -> None:
        """Write `data` to the command's stdin and close it, in the background: a command that
        ends without reading its input is not an error, and nobody waits on the writing."""
        if data is None:
            return

        async def feed() -> None:
            with contextlib.suppress(WorkspaceError):
                await self.write_stdin(cmd.id, data, close=True)

        task = asyncio.ensure_future(feed())
        self._feeding.add(task)
        task.add_done_callback(self._feeding.discard)

    async def _launch(
        self,
        command: str,
        cwd: str | None,
        env: Mapping[str, str | None] | None,
        timeout: float | None,
        session_id: str | None,
        stdin: bool,
        keep_background: bool,
        pty: TerminalSize | None = None,
        argv: tuple[str, ...] = (),
        user: str | None = None,
    ) -> Command:
        self._check_open("exec")
        _check_command(command, cwd)
        _check_argv(argv)
        clean_env = _check_env(env)
        if self._running + self._starting >= MAX_RUNNING_COMMANDS:
            raise _too_many("running commands", MAX_RUNNING_COMMANDS, "exec")
        session = self._session_for(session_id) if session_id is not None else None
        cwd = cwd or (session.working_dir if session else None)
        request = ExecRequest(
            command=command, argv=argv, cwd=cwd, env=clean_env, interactive=stdin, pty=pty, user=user,
            end_group=not keep_background,
        )  # fmt: skip
        self._starting += 1
        spawning = asyncio.ensure_future(self.machine.spawn(request))
        try:
            with operation("exec", cwd):
                process = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            # The caller went away while the machine was making the process, which may already
            # run: nobody is left to stop it, so it is stopped here once it exists.
            spawning.add_done_callback(_kill_spawned)
            raise
        finally:
            self._starting -= 1
        cmd = Command(
            new_id(COMMAND), command, cwd, clean_env, timeout, session_id, stdin_open=stdin, pty=pty
        )
        cmd._process = process
        self._commands[cmd.id] = cmd
        self._running += 1
        if self.on_start is not None:
            self.on_start()
        if session is not None:
            _session_started(session, cmd)
        cmd._task = asyncio.create_task(self._supervise(cmd, process, keep_background))
        if self._closed:
            self.kill(cmd.id, signal.SIGKILL)
        return cmd

    # -- the life of one command -----------------------------------------------------

    async def _supervise(self, cmd: Command, process: Process, keep_background: bool) -> None:
        """Pump output, enforce the deadline, reap the group, then close the record."""
        pumps = [
            asyncio.ensure_future(_pump(cmd, process.stdout, cmd.stdout)),
            asyncio.ensure_future(_pump(cmd, process.stderr, cmd.stderr)),
        ]
        waiter = asyncio.ensure_future(process.wait())
        status: Status = "failed"
        code: int | None = None
        try:
            status = await _await_exit(cmd, waiter)
            if status != "completed":
                process.kill(signal.SIGKILL)
                await asyncio.wait({waiter}, timeout=KILL_GRACE_SECONDS)
            if waiter.done():
                code = waiter.result()
            if not keep_background:
                process.kill(signal.SIGKILL)
            if not all(pump.done() for pump in pumps):  # usually read to EOF by the exit already
                await asyncio.wait(pumps, timeout=DRAIN_GRACE_SECONDS)
            if status == "completed" and cmd.kill_signal is not None:
                status = "killed"
        except asyncio.CancelledError:
            process.kill(signal.SIGKILL)
            status = "killed"
            raise
        except Exception as exc:
            process.kill(signal.SIGKILL)
            status, cmd.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            for task in (*pumps, waiter):
                task.cancel()
            self._finish(cmd, status, code)

    def _finish(self, cmd: Command, status: Status, code: int | None) -> None:
        cmd.status, cmd.exit_code, cmd.finished_at = status, code, _now()
        self._running -= 1
        cmd.stdin_open = False
        cmd._process = None
        session = self._sessions.get(cmd.session_id or "")
        if session is not None and session.current_command_id == cmd.id:
            session.current_command = session.current_command_id = None
        self._finished.append(cmd.id)
        while len(self._finished) > MAX_COMMANDS_KEPT:
            del self._commands[self._finished.popleft()]
        cmd._notify()
        if not cmd._ended.done():  # a sync run cancelled its wait
            cmd._ended.set_result(None)
        if self.on_end is not None:
            self.on_end(cmd)

    # -- looking and waiting ---------------------------------------------------------

    def get(self, command_id: str) -> Command:
        cmd = self._commands.get(command_id)
        if cmd is None:
            raise _not_found("command", command_id, "command")
        return cmd

    async def wait(self, command_id: str, timeout: float | None = None) -> Command:
        """The command once it has ended, or as it is after `timeout` seconds."""
        cmd = self.get(command_id)
        await cmd._until(lambda: cmd.finished, _check_wait(timeout))
        return cmd

    async def wait_output(
        self, command_id: str, offset: int = 0, stderr_offset: int = 0, timeout: float | None = None
    ) -> Command:
        """Return once either stream has bytes past its offset, the command ended, or `timeout`."""
        cmd = self.get(command_id)

        def ready() -> bool:
            return cmd.stdout.total > offset or cmd.stderr.total > stderr_offset or cmd.finished

        await cmd._until(ready, _check_wait(timeout))
        return cmd

    # -- acting on a running command -------------------------------------------------

    def kill(self, command_id: str, sig: int = signal.SIGKILL) -> Command:
        """Send `sig` to the command's whole process group; a finished command is left as is."""
        if sig not in KILL_SIGNALS.values():
            raise bad_request("kill", f"signal must be one of {', '.join(KILL_SIGNALS)}, got {sig}")
        cmd = self.get(command_id)
        if cmd.finished or cmd._process is None:
            return cmd
        cmd.kill_signal = sig
        cmd._process.kill(sig)
        if sig == signal.SIGKILL:
            cmd._sigkilled = True
            if cmd._on_sigkill is not None:
                cmd._on_sigkill()
        return cmd

    def resize(self, command_id: str, size: TerminalSize) -> Command:
        """Set the window size of a running command's pseudo-terminal (it gets SIGWINCH)."""
        cmd = self.get(command_id)
        process = cmd._process
        if cmd.finished or process is None:
            raise bad_request("resize", f"Command {cmd.id} has ended")
        if cmd.pty is None or not isinstance(process, Terminal):
            raise bad_request("resize", f"Command {cmd.id} does not run on a terminal")
        try:
            process.resize(size)
        except OSError as exc:  # it ended a moment ago: its terminal is closed
            raise bad_request("resize", f"Command {cmd.id} has no terminal any more ({exc})") from exc
        cmd.pty = size
        return cmd

    async def write_stdin(self, command_id: str, data: bytes, *, close: bool = False) -> Command:
        """Write to the command's stdin (then close it if asked), in call order."""
        cmd = self.get(command_id)
        async with cmd._stdin_lock:
            process = self._stdin_of(cmd)
            try:
                async with asyncio.timeout(STDIN_WRITE_TIMEOUT_SECONDS):
                    await process.write_stdin(data)
            except TimeoutError:
                raise WorkspaceError(
                    "io_error",
                    f"Command {cmd.id} did not read its input within {STDIN_WRITE_TIMEOUT_SECONDS:g} s",
                    "write",
                    exception_type="TimeoutError",
                    retryable=True,
                ) from None
            except OSError as exc:
                cmd.stdin_open = False
                raise bad_request("write", f"Command {cmd.id} closed its input ({exc})") from exc
            if close:
                await self._close_stdin(cmd, process)
        return cmd

    async def close_stdin(self, command_id: str) -> Command:
        """Send end-of-file to the command's stdin."""
        cmd = self.get(command_id)
        async with cmd._stdin_lock:
            await self._close_stdin(cmd, self._stdin_of(cmd))
        return cmd

    def _stdin_of(self, cmd: Command) -> Process:
        if cmd.finished or not cmd.stdin_open or cmd._process is None:
            raise bad_request(
                "write", f"Command {cmd.id} has no open stdin (it ended, or was not started with one)"
            )
        return cmd._process

    async def _close_stdin(self, cmd: Command, process: Process) -> None:
        cmd.stdin_open = False
        try:
            await process.close_stdin()
        except OSError:
            pass

    def remove(self, command_id: str) -> None:
        """Forget a finished command; a running one must be killed first."""
        cmd = self.get(command_id)
        if not cmd.finished:
            raise bad_request("command", f"Command {command_id} is still running; kill it first")
        del self._commands[command_id]
        self._finished.remove(command_id)

    # -- sessions --------------------------------------------------------------------

    async def open_session(
        self, session_id: str | None = None, working_dir: str | None = None
    ) -> ShellSession:
        """A new session whose commands default to `working_dir` (the machine root by default)."""
        self._check_open("session")
        if session_id is not None and session_id in self._sessions:
            raise WorkspaceError(
                "already_exists",
                f"Session {session_id!r} already exists",
                "session",
                exception_type="KeyError",
            )
        directory = working_dir or self.machine.root
        with operation("session", directory):
            info = await self.machine.stat(directory)
        if info is None:
            raise _not_found("directory", directory, "session")
        if not info.is_dir:
            raise WorkspaceError("invalid_target", f"Not a directory: {directory}", "session", directory)
        return self._new_session(session_id, info.path)

    def _session_for(self, session_id: str) -> ShellSession:
        """The session a command names, created on first use as v1 does."""
        session = self._sessions.get(session_id)
        return session if session is not None else self._new_session(session_id, self.machine.root)

    def _new_session(self, session_id: str | None, working_dir: str) -> ShellSession:
        if session_id is None:
            session_id = f"sh_{secrets.token_hex(8)}"
        elif not _SESSION_ID.fullmatch(session_id):
            raise bad_request(
                "session", f"Invalid session id {session_id!r}: use up to 128 of [A-Za-z0-9._:-]"
            )
        if len(self._sessions) >= MAX_SESSIONS:
            raise _too_many("sessions", MAX_SESSIONS, "session")
        session = ShellSession(session_id, working_dir)
        self._sessions[session_id] = session
        return session

    def session(self, session_id: str) -> ShellSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise _not_found("session", session_id, "session")
        return session

    def sessions(self) -> builtins.list[ShellSession]:
        return builtins.list(self._sessions.values())

    def session_command(self, session_id: str, command_id: str | None = None) -> Command:
        """The command a v1 call means: `command_id` if given (it must be the session's), else the newest."""
        session = self.session(session_id)
        ident = command_id or session.last_command_id
        if ident is None:
            raise _not_found("command in session", session_id, "command")
        cmd = self.get(ident)
        if cmd.session_id != session_id:
            raise _not_found("command", ident, "command")
        session.last_used_at = _now()
        return cmd

    def close_session(self, session_id: str) -> ShellSession:
        """Kill the session's running commands and forget the session (its commands stay readable)."""
        session = self.session(session_id)
        for cmd in self._commands.values():
            if cmd.session_id == session_id and not cmd.finished:
                self.kill(cmd.id, signal.SIGKILL)
        session.status = "closed"
        del self._sessions[session_id]
        return session

    # -- the whole manager -----------------------------------------------------------

    def list(self) -> builtins.list[Command]:
        """Every command kept, oldest first."""
        return builtins.list(self._commands.values())

    async def close(self) -> None:
        """Kill every running command, wait for their records to close, refuse new ones."""
        self._closed = True
        for task in list(self._feeding):
            task.cancel()
        tasks = [cmd._task for cmd in self._commands.values() if cmd._task is not None and not cmd.finished]
        for cmd in builtins.list(self._commands.values()):
            self.kill(cmd.id, signal.SIGKILL)
        if tasks:
            await asyncio.wait(tasks, timeout=KILL_GRACE_SECONDS + DRAIN_GRACE_SECONDS + 1)
        for session in self._sessions.values():
            session.status = "closed"
        self._sessions.clear()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise WorkspaceError("io_error", "The machine's command manager is closed", op, retryable=True)


def _kill_spawned(spawning: asyncio.Future[Process]) -> None:
    """Kill the process group a cancelled launch made (if it made one)."""
    if not spawning.cancelled() and spawning.exception() is None:
        spawning.result().kill(signal.SIGKILL)


async def _pump(cmd: Command, stream: asyncio.StreamReader, buffer: OutputBuffer) -> None:
    """Move a pipe into its buffer until EOF, waking readers on every chunk."""
    try:
        while chunk := await stream.read(READ_CHUNK_BYTES):
            buffer.append(chunk)
            cmd._notify()
    finally:
        buffer.close()
        cmd._notify()


async def _await_exit(cmd: Command, waiter: asyncio.Future[int]) -> Status:
    """Wait for the process to end, its deadline, or a SIGKILL request; say which came first.

    A SIGTERM or SIGINT the command survives does not stop the wait. The three settle one
    future from callbacks (the exit's, a timer, `kill`), with no task of their own: this
    runs once per command, on the path of every exec.
    """
    if cmd._sigkilled:
        return "killed"
    loop = asyncio.get_running_loop()
    first: asyncio.Future[Status] = loop.create_future()

    def settle(status: Status) -> None:
        if not first.done():
            first.set_result(status)

    def exited(_: object) -> None:
        settle("completed")

    waiter.add_done_callback(exited)
    timer = None if cmd.timeout is None else loop.call_later(cmd.timeout, settle, "timed_out")
    cmd._on_sigkill = partial(settle, "killed")
    try:
        return await first
    finally:
        cmd._on_sigkill = None
        waiter.remove_done_callback(exited)
        if timer is not None:
            timer.cancel()


def _session_started(session: ShellSession, cmd: Command) -> None:
    session.last_used_at = cmd.started_at
    session.current_command, session.current_command_id = cmd.command, cmd.id
    session.last_command_id = cmd.id
    session.command_count += 1


def _check_input(data: bytes | None) -> None:
    if data is not None and len(data) > MAX_INPUT_BYTES:
        raise limit_exceeded("exec", None, f"input is {len(data)} bytes; the limit is {MAX_INPUT_BYTES}")


def _check_timeout(timeout: float) -> float:
    if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise bad_request(
            "exec", f"timeout must be > 0 and <= {MAX_TIMEOUT_SECONDS:g} seconds, got {timeout}"
        )
    return float(timeout)


def _check_wait(timeout: float | None) -> float | None:
    if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_SECONDS:
        raise bad_request(
            "wait", f"wait timeout must be >= 0 and <= {MAX_TIMEOUT_SECONDS:g} seconds, got {timeout}"
        )
    return timeout


def _check_command(command: str, cwd: str | None) -> None:
    if not command.strip():
        raise bad_request("exec", "command is empty")
    if "\0" in command or (cwd is not None and "\0" in cwd):
        raise bad_request("exec", "command and cwd may not contain NUL bytes")
    if utf8_size(command) > MAX_COMMAND_BYTES:
        raise bad_request(
            "exec",
            f"command is longer than {MAX_COMMAND_BYTES} bytes (the kernel's limit for one argument): "
            "write it to a script file and run that",
        )


def _check_argv(argv: Sequence[str]) -> None:
    """An argument vector the kernel takes: no NUL in an argument, none past its limit."""
    for arg in argv:
        if "\0" in arg:
            raise bad_request("exec", "arguments may not contain NUL bytes")
        if utf8_size(arg) > MAX_COMMAND_BYTES:
            raise bad_request(
                "exec", f"an argument is longer than {MAX_COMMAND_BYTES} bytes (the kernel's limit for one)"
            )


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """The variables to set; a None value (v1 allows it) sets nothing."""
    clean: dict[str, str] = {}
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key:
            raise bad_request("exec", f"invalid environment variable name {key!r}")
        if value is None:
            continue
        if "\0" in value:
            raise bad_request("exec", f"environment variable {key} contains a NUL byte")
        clean[key] = value
    if sum(utf8_size(k) + utf8_size(v) + 2 for k, v in clean.items()) > MAX_ENV_BYTES:
        raise bad_request("exec", f"the environment given is larger than {MAX_ENV_BYTES} bytes")
    return clean
