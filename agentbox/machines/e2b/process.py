"""`E2BProcess`: one command in the sandbox, envd's process events pumped into two streams;
envd's errors as the machine's."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentbox.machines.e2b.options import sdk
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.ssh.channel import MARKER

if TYPE_CHECKING:
    from agentbox.machines.e2b.machine import E2BMachine


#: Bytes one SendInput carries at most.
STDIN_CHUNK = 64 * 1024
#: The line limit of a command's output streams (envd sends output as it comes: there is no
#: back-pressure to the sandbox, so a reader must keep reading, as `collect` does).
STREAM_BUFFER = 1 << 20
#: Bytes of output kept while looking for the pid marker.
MAX_PREAMBLE_BYTES = 64 * 1024
#: What envd answers for the stdin of a process that has ended (or has none): not found, or
#: an invalid argument.
STDIN_GONE = frozenset({errno.ENOENT, errno.EINVAL})
#: What a signal is called in Go's `ProcessState.String()` (envd's end status), by number.
SIGNAL_WORDS = {(signal.strsignal(s) or "").lower(): int(s) for s in signal.Signals if signal.strsignal(s)}


class E2BProcess:
    """A `Process` in the sandbox: one envd process, its events pumped into two streams."""

    def __init__(
        self, machine: E2BMachine, events: AsyncIterator[Any], argv0: str, subjects: dict[str, str]
    ) -> None:
        self.machine = machine
        self.events = events
        self.argv0 = argv0
        self.subjects = subjects
        """What a failed check was about (`cwd`, `exec`), for its OSError."""
        self.pid = 0
        """The pid in the sandbox (the marker's): what a signal other than envd's goes to."""
        self.envd_pid = 0
        self.stdout = asyncio.StreamReader(STREAM_BUFFER)
        self.stderr = asyncio.StreamReader(STREAM_BUFFER)
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future[int] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        for fut in (self.started, self.exited):
            fut.add_done_callback(_retrieved)
        self._preamble = b""
        self._pump: asyncio.Task[None] | None = None

    def begin(self) -> None:
        self._pump = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        errors = sdk().exceptions
        try:
            async for response in self.events:
                self._event(response.event)
            if not self.exited.done():
                raise MachineUnavailable("the command's stream ended without its end")
        except asyncio.CancelledError:
            self._lost(MachineUnavailable("the machine closed while the command ran"))
            raise
        except MachineUnavailable as exc:
            self._lost(exc)
        except Exception as exc:
            self._lost(self.machine.unavailable(exc, errors))
        finally:
            self.stdout.feed_eof()
            self.stderr.feed_eof()
            self.machine.ended(self)

    def _lost(self, exc: BaseException) -> None:
        for fut in (self.started, self.exited):
            if not fut.done():
                fut.set_exception(exc)

    def _event(self, event: Any) -> None:
        which = event.event if event is not None else None
        if which is None:
            return
        if which.field == "start":
            self.envd_pid = int(which.value.pid)
        elif which.field == "data":
            output = which.value.output
            if output is not None and output.field == "stdout":
                self._stdout(bytes(output.value))
            elif output is not None and output.field == "stderr":
                self.stderr.feed_data(bytes(output.value))
        elif which.field == "end":
            code = end_code(which.value)
            if not self.started.done():  # ended before its marker: the shell itself failed
                said = self._preamble.decode(errors="replace").strip()
                self.started.set_exception(MachineUnavailable(f"the command did not start: {said or code}"))
            if not self.exited.done():
                self.exited.set_result(code)

    def _stdout(self, data: bytes) -> None:
        if self.started.done():
            self.stdout.feed_data(data)
            return
        self._preamble += data
        at = self._preamble.find(MARKER)
        end = self._preamble.find(b"\n", at) if at >= 0 else -1
        if end < 0:
            if at < 0 and len(self._preamble) > MAX_PREAMBLE_BYTES:
                self._preamble = self._preamble[-len(MARKER) :]
            return
        fields_ = self._preamble[at + len(MARKER) : end].decode(errors="replace").split(":")
        rest, self._preamble = self._preamble[end + 1 :], b""
        if fields_[0] == "pid":
            self.pid = int(fields_[1])
            self.started.set_result(self.pid)
            if rest:
                self.stdout.feed_data(rest)
        else:
            code = getattr(errno, fields_[1], errno.EIO)
            subject = self.subjects.get(fields_[2] if len(fields_) > 2 else "")
            self.started.set_exception(OSError(code, os.strerror(code), subject))

    async def write_stdin(self, data: bytes) -> None:
        """Send to the command's stdin; one that has ended (or closed it) is EPIPE, as a pipe's."""
        try:
            for at in range(0, len(data), STDIN_CHUNK):
                await self.machine.send_input(self.envd_pid, data[at : at + STDIN_CHUNK])
        except OSError as exc:
            if exc.errno not in STDIN_GONE:
                raise
            raise BrokenPipeError(errno.EPIPE, "the command's stdin is closed") from None

    async def close_stdin(self) -> None:
        """End the command's stdin; nothing to do when the command has ended already (envd
        refuses then: the command read what it needed and exited first)."""
        try:
            await self.machine.close_input(self.envd_pid)
        except OSError as exc:
            if exc.errno not in STDIN_GONE:
                raise

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group in the sandbox, in the background."""
        if not self.exited.done():
            self.machine.signal(self, sig)

    def abandon(self) -> None:
        if self._pump is not None:
            self._pump.cancel()


def end_code(end: Any) -> int:
    """envd's end event as an exit code: 128+N for a process ended by signal N."""
    status = str(getattr(end, "status", "") or "")
    if not getattr(end, "exited", True) and status.startswith("signal: "):
        word = status.removeprefix("signal: ").strip()
        number = SIGNAL_WORDS.get(word) or (int(word) if word.isdigit() else None)
        if number is not None:
            return 128 + number
    code = int(end.exit_code)
    return code if code >= 0 else 128 + signal.SIGKILL


def oneof(name: str, value: Any) -> Any:
    """A oneof member; its field name is checked by the message at run time, not by mypy."""
    from protobuf import Oneof

    return Oneof(name, value)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def connect_error(exc: Any, path: str | None, machine: E2BMachine) -> BaseException:
    """envd's Connect error as the OSError of its errno, or MachineUnavailable for the transport."""
    from connectrpc.code import Code

    codes = {
        Code.NOT_FOUND: errno.ENOENT, Code.ALREADY_EXISTS: errno.EEXIST,
        Code.PERMISSION_DENIED: errno.EACCES, Code.RESOURCE_EXHAUSTED: errno.ENOSPC,
        Code.INVALID_ARGUMENT: errno.EINVAL, Code.FAILED_PRECONDITION: errno.EINVAL,
    }  # fmt: skip
    number = codes.get(exc.code)
    if number is None:
        return machine.unavailable(exc)
    return OSError(number, exc.message or os.strerror(number), path)
