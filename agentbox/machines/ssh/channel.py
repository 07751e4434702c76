"""One command on the host: its command line, its session channel, its `Process`."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shlex
import signal
from collections.abc import Callable, Mapping
from typing import Any

import asyncssh

from agentbox.machines.base import STREAM_BUFFER
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.local import BASE_PATH

#: Bytes of login-shell output kept while looking for the marker.
MAX_PREAMBLE_BYTES = 64 * 1024
#: Bytes of a command line (environment included) sent in one exec request: sshd's packets
#: are at most 256 KiB.
MAX_COMMAND_BYTES = 200 * 1024
#: What starts the line the command line writes before the command (`\0agentbox:pid:N`).
MARKER = b"\0agentbox:"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def remote_command(cwd: str, argv: list[str], env: Mapping[str, str], *, stdin: bool = False) -> str:
    """The command line of an exec request: the login shell checks, marks and execs (see the
    package docstring). Its builtins alone run before `env`, so a command costs the host two
    execs (env, then argv) beyond the login shell's. Without `stdin` the command reads
    /dev/null, so no EOF needs to cross the connection."""
    bad = [k for k in env if not ENV_NAME.fullmatch(k)]
    if bad:
        raise ValueError(f"not environment variable names: {', '.join(map(repr, bad))}")
    d, program = shlex.quote(cwd), shlex.quote(argv[0])

    def fail(code: str, what: str) -> str:
        return f"{{ printf '\\000agentbox:error:{code}:{what}\\n'; exit 127; }}"

    steps = [
        f"PATH={shlex.quote(env.get('PATH', BASE_PATH))}",  # the one argv[0] is looked up in
        f"cd -- {d} 2>/dev/null || {{ [ -e {d} ] || {fail('ENOENT', 'cwd')}; "
        f"[ -d {d} ] || {fail('ENOTDIR', 'cwd')}; {fail('EACCES', 'cwd')}; }}",
        f"[ -e {program} ] || {fail('ENOENT', 'exec')}; "
        f"{{ [ -f {program} ] && [ -x {program} ]; }} || {fail('EACCES', 'exec')}"
        if "/" in argv[0]
        else f"command -v -- {program} >/dev/null 2>&1 || {fail('ENOENT', 'exec')}",
        "printf '\\000agentbox:pid:%s\\n' \"$$\"",
        "exec "
        + " ".join(shlex.quote(w) for w in ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv])
        + ("" if stdin else " </dev/null"),
    ]
    line = "; ".join(steps)
    if len(line.encode()) > MAX_COMMAND_BYTES:
        raise OSError(errno.E2BIG, f"a command line of {len(line)} bytes exceeds {MAX_COMMAND_BYTES}")
    return line


class _Valve:
    """The transport a stream reader pauses: the channel stops reading while either stream is full."""

    def __init__(self, channel: CommandChannel, name: str) -> None:
        self.channel = channel
        self.name = name

    def pause_reading(self) -> None:
        self.channel.pause(self.name)

    def resume_reading(self) -> None:
        self.channel.resume(self.name)


class CommandChannel(asyncssh.SSHClientSession[bytes]):
    """One command's session channel: its pid marker, the two streams, the exit status."""

    def __init__(self, on_close: Callable[[], None], subjects: Mapping[str, str] | None = None) -> None:
        """`subjects` name what a failed check was about (`cwd`, `exec`), for its OSError."""
        loop = asyncio.get_running_loop()
        self.subjects = dict(subjects or {})
        self.stdout = asyncio.StreamReader(STREAM_BUFFER)
        self.stderr = asyncio.StreamReader(STREAM_BUFFER)
        self.started: asyncio.Future[int] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        for fut in (self.started, self.exited):
            fut.add_done_callback(_retrieved)
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None
        self.killed = False
        self.lost: str | None = None
        self._on_close: Callable[[], None] | None = on_close
        self._preamble = b""
        self._early_stderr = b""
        self._paused: set[str] = set()
        self._writable = asyncio.Event()
        self._writable.set()

    # asyncssh's callbacks

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:  # type: ignore[override]
        self.chan = chan
        self.stdout.set_transport(_Valve(self, "stdout"))  # type: ignore[arg-type]
        self.stderr.set_transport(_Valve(self, "stderr"))  # type: ignore[arg-type]

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            if not self.started.done():
                self._early_stderr = (self._early_stderr + data)[-4096:]
            self.stderr.feed_data(data)
        elif self.started.done():
            self.stdout.feed_data(data)
        else:
            self._read_marker(data)

    def eof_received(self) -> bool:
        """Stay half-open: the sshd closes the channel when the command ends, and an EOF of ours
        would be one more packet each way for nothing."""
        return True

    def exit_status_received(self, status: int) -> None:
        if not self.exited.done():
            self.exited.set_result(status)

    def exit_signal_received(self, signal_name: str, core_dumped: bool, msg: str, lang: str) -> None:
        number = getattr(signal, f"SIG{signal_name}", None)
        if not self.exited.done():
            self.exited.set_result(128 + int(number) if number is not None else 255)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stdout.feed_eof()
        self.stderr.feed_eof()
        self._writable.set()
        if exc is not None:
            self.lost = str(exc) or type(exc).__name__
        if not self.started.done():
            shell = self._early_stderr.decode(errors="replace").strip()
            reason = f"the connection dropped ({self.lost})" if self.lost else "the login shell ended"
            self.started.set_exception(
                MachineUnavailable(f"the command did not start: {reason}" + (f": {shell}" if shell else ""))
            )
        if not self.exited.done():
            if self.killed:
                self.exited.set_result(128 + signal.SIGKILL)
            elif self.lost is not None:
                self.exited.set_exception(
                    MachineUnavailable(f"the connection dropped while the command ran: {self.lost}")
                )
            else:
                self.exited.set_result(255)  # closed with no exit status, as ssh(1) reports it
        if not self.closed.done():
            self.closed.set_result(None)
        self.release()

    # ours

    def factory(self) -> CommandChannel:
        """The session factory asyncssh calls: this channel, made beforehand."""
        return self

    def release(self) -> None:
        """Give the channel's room back to the pool, once."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def _read_marker(self, data: bytes) -> None:
        self._preamble += data
        at = self._preamble.find(MARKER)
        end = self._preamble.find(b"\n", at) if at >= 0 else -1
        if end < 0:
            if at < 0 and len(self._preamble) > MAX_PREAMBLE_BYTES:  # login-shell noise
                self._preamble = self._preamble[-len(MARKER) :]
            return
        fields = self._preamble[at + len(MARKER) : end].decode(errors="replace").split(":")
        rest, self._preamble = self._preamble[end + 1 :], b""
        if fields[0] == "pid":
            self.started.set_result(int(fields[1]))
            if rest:
                self.stdout.feed_data(rest)
        else:
            code = getattr(errno, fields[1], errno.EIO)
            self.started.set_exception(OSError(code, os.strerror(code), self.subjects.get(fields[2])))

    def pause(self, name: str) -> None:
        self._paused.add(name)
        if self.chan is not None:
            self.chan.pause_reading()

    def resume(self, name: str) -> None:
        self._paused.discard(name)
        if not self._paused and self.chan is not None:
            self.chan.resume_reading()

    async def write(self, data: bytes) -> None:
        if self.chan is None or self.closed.done():
            raise BrokenPipeError(errno.EPIPE, "the command's stdin is closed")
        self.chan.write(data)
        await self._writable.wait()

    def abandon(self) -> None:
        """Stop waiting for a command that did not end: close its channel."""
        if self.chan is not None:
            self.chan.close()


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: callers that stopped waiting must not get warnings."""
    if not fut.cancelled():
        fut.exception()


class SshProcess:
    """A `Process` on the remote host: its pid leads the command's process group there."""

    def __init__(
        self, channel: CommandChannel, pid: int, argv0: str, signal_group: Callable[[SshProcess, int], None]
    ) -> None:
        self.channel = channel
        self._signal_group = signal_group
        self.pid = pid
        self.argv0 = argv0
        self.stdout: asyncio.StreamReader = channel.stdout
        self.stderr: asyncio.StreamReader = channel.stderr

    async def write_stdin(self, data: bytes) -> None:
        await self.channel.write(data)

    async def close_stdin(self) -> None:
        if self.channel.chan is not None and not self.channel.closed.done():
            self.channel.chan.write_eof()

    async def wait(self) -> int:
        return await asyncio.shield(self.channel.exited)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group on the host (over another channel)."""
        self._signal_group(self, sig)
