"""The server's end of an exec agent's control socket, for every machine that runs one.

A `sandbox` (bwrap) and a `docker` container both start their commands through the exec
agent (`exec_agent.py`, whose docstring has the protocol). How the agent is launched and how
its socket reaches the server differ (an inherited socketpair end, a unix socket in a bound
directory); what happens on the socket does not, and lives here:

- `AgentChannel.spawn` makes a command's pipes, sends `S` with their write ends (and a
  stdin read end), and waits for `P` (its pid) or `E` (an errno); with a terminal size it
  sends `T` instead and `P` brings the master of the pty the agent opened inside: the command's
  output is read from it, its input written to it, its size set on it (`TIOCSWINSZ`);
- `X` ends the command's `AgentProcess` and closes the server's input end (and pty master
  copies) it held; `K` / `G` signal its process group. A command spawned with `end_group`
  (`Sg`) has its group killed by the agent at the exit, before `X`: the kill after the exit
  that the command manager makes then sends nothing, a message and a wake-up of the agent
  fewer per command;
- `R`, once, hands over the directories that exist only inside the machine: they are
  attached to the machine's `HostView`, and `ready` resolves;
- EOF (the agent, or all of the machine, is gone) fails `ready` if it was pending and calls
  the machine's `gone`; `abandon` then fails every command still waiting.

The server reads each command's pipes (or pty master) itself (`Pipe`), so no output passes
through the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import socket
import struct
import termios
from collections.abc import Callable, Sequence

from agentbox.machines.base import STREAM_BUFFER, TerminalSize
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.exec_agent import MAX_MESSAGE
from agentbox.machines.hostview import HostView

#: Bytes read from a command pipe per wakeup.
PIPE_CHUNK = 65536
#: The exit code a command reports when its machine stopped under it (SIGKILL's).
KILLED_EXIT = 137
#: Seconds between two tries to write input the command has not taken yet.
STDIN_RETRY_SECONDS = 0.005


class Pipe:
    """Feed a StreamReader from a pipe with `add_reader`: cheaper than a transport per command.

    The pipe is the reader's transport, so its flow control holds: past 2 x STREAM_BUFFER
    unread the pipe is no longer read (the command blocks writing), and reading resumes once
    the reader is down to STREAM_BUFFER.
    """

    def __init__(
        self, fd: int, loop: asyncio.AbstractEventLoop, reader: asyncio.StreamReader | None = None
    ) -> None:
        self.fd = fd
        self.loop = loop
        self.reader = reader or _reader(loop)
        self.reader.set_transport(self)  # type: ignore[arg-type]
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def pause_reading(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)

    def resume_reading(self) -> None:
        if self.fd >= 0:
            self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, PIPE_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: a pty master whose every slave is closed
            data = b""
        if data:
            self.reader.feed_data(data)
        else:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.reader.feed_eof()


class AgentProcess:
    """A command started by an exec agent: on pipes (`stdin` its write end, or None), or on a
    pty (`terminal`) whose master arrives with its pid (`attach_terminal`)."""

    def __init__(
        self,
        channel: AgentChannel,
        cid: int,
        stdout: Pipe | None,
        stderr: Pipe | None,
        stdin: int | None,
        *,
        terminal: bool = False,
        group_ends_at_exit: bool = False,
    ) -> None:
        self.channel = channel
        self.cid = cid
        self.pid = 0
        self._pipes = [pipe for pipe in (stdout, stderr) if pipe is not None]
        self.stdout = stdout.reader if stdout is not None else _reader(channel.loop)
        self.stderr = stderr.reader if stderr is not None else _reader(channel.loop)
        self._stdin = stdin
        self.terminal = terminal
        self._tty: int | None = None
        """The pty master (a descriptor of its own) that `resize` sets the size on."""
        self.argv0 = ""
        self.group_ends_at_exit = group_ends_at_exit
        """The agent kills the command's group when it exits (`Sg`): nothing is left to signal."""
        self.exited: asyncio.Future[int] = channel.loop.create_future()

    def attach_terminal(self, master: int) -> None:
        """Read the output from the pty's master, write the input to it and resize it; its
        stderr stays empty (everything the command writes comes through the terminal)."""
        self._pipes.append(Pipe(master, self.channel.loop, self.stdout))
        self.stderr.feed_eof()
        self._stdin = os.dup(master)
        self._tty = os.dup(master)

    async def write_stdin(self, data: bytes) -> None:
        """Write all of `data` as the command takes it, never blocking the loop (the input end
        is non-blocking); the command's exit while it waits is a BrokenPipeError."""
        view = memoryview(data)
        while view:
            if self._stdin is None:
                raise BrokenPipeError("stdin is closed")
            try:
                n = os.write(self._stdin, view)
                view = view[n:]
            except BlockingIOError:
                await asyncio.sleep(STDIN_RETRY_SECONDS)

    async def close_stdin(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def resize(self, size: TerminalSize) -> None:
        """Set the pty's window size; the kernel sends SIGWINCH to its foreground group."""
        if self._tty is None:
            raise OSError(errno.ENOTTY, "the command has no terminal (or it has ended)")
        packed = struct.pack("HHHH", size.rows, size.cols, 0, 0)
        fcntl.ioctl(self._tty, termios.TIOCSWINSZ, packed)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group, also after its leader exited (children remain)."""
        with contextlib.suppress(MachineUnavailable):
            if not self.exited.done():
                self.channel.send([b"K", self.cid, int(sig)])
            elif self.pid and not self.group_ends_at_exit:
                self.channel.send([b"G", self.pid, int(sig)])

    def _close_pipes(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        if not self.stderr.at_eof():
            self.stderr.feed_eof()
        self._ended()

    def _ended(self) -> None:
        """At the command's exit: no more input, no more resizes, and no descriptor kept for
        them (its output is still read to its end). A child it left that reads stdin sees EOF."""
        if self._tty is not None:
            os.close(self._tty)
            self._tty = None
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None


def _reader(loop: asyncio.AbstractEventLoop) -> asyncio.StreamReader:
    return asyncio.StreamReader(limit=STREAM_BUFFER, loop=loop)


class AgentChannel:
    """One lifetime's control socket: commands out, their pids and exits back.

    `what` names the machine in errors ("sandbox", "container"); `shared` are the inside
    directories the agent hands over at `R`, in its order; `diagnostics` says why the agent
    ended during its start; `gone` runs once the socket reached EOF; `touch` at each exit.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        *,
        what: str,
        view: HostView,
        shared: Sequence[str],
        diagnostics: Callable[[], str],
        gone: Callable[[], None],
        touch: Callable[[], None],
    ) -> None:
        self.sock: socket.socket | None = sock
        self.loop = loop
        self.what = what
        self.view = view
        self.shared = tuple(shared)
        self.diagnostics = diagnostics
        self.gone = gone
        self.touch = touch
        self.running = 0
        """Commands started and not yet reported ended."""
        self.ready: asyncio.Future[None] = loop.create_future()
        self.namespace: int | None = None
        """The agent's user namespace (from `R`): where a machine nests its account's."""
        self._next = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        """Spawns waiting for their pid, by command id."""
        self._procs: dict[int, AgentProcess] = {}
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._on_control)

    # the socket ------------------------------------------------------------------------

    def send(self, fields: Sequence[bytes | str | int], fds: Sequence[int] | None = None) -> None:
        if self.sock is None:
            raise MachineUnavailable(f"the {self.what} is not running")
        data = b"\0".join(f if isinstance(f, bytes) else str(f).encode() for f in fields)
        if len(data) > MAX_MESSAGE:  # the agent would read it cut short: refuse it here, as the kernel would
            raise OSError(
                errno.E2BIG, f"a command of {len(data)} bytes exceeds the exec agent's {MAX_MESSAGE}"
            )
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # past the socket's buffer: the agent is still there
                raise OSError(
                    errno.E2BIG, f"a message of {len(data)} bytes does not fit the agent's socket"
                ) from exc
            raise MachineUnavailable(f"the {self.what}'s exec agent is gone: {exc}") from exc

    def _on_control(self) -> None:
        if self.sock is None:
            return
        fds: list[int] = []
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, len(self.shared) + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(self.sock.fileno())
            if not self.ready.done():
                self.ready.set_exception(
                    MachineUnavailable(f"the {self.what} exited during start: {self.diagnostics()}")
                )
                self.ready.exception()
            self.gone()
            return
        op, *rest = data.split(b"\0")
        if op == b"P" and fds:
            fds = self._take_terminal(int(rest[0]), fds)
        if op != b"R":
            for fd in fds:  # only `R` and a pty's `P` carry descriptors
                os.close(fd)
        if op == b"R":
            for inside, fd in zip(self.shared, fds, strict=False):
                self.view.attach(inside, fd)
            if len(fds) > len(self.shared) and self.namespace is None:
                self.namespace = fds[len(self.shared)]
            if not self.ready.done():
                self.ready.set_result(None)
        elif op == b"P":
            fut = self._pending.pop(int(rest[0]), None)
            if fut is not None and not fut.done():
                fut.set_result(int(rest[1]))
        elif op == b"E":
            cid = int(rest[0])
            fut = self._pending.pop(cid, None)
            proc = self._procs.get(cid)
            if fut is not None and not fut.done():
                name = proc.argv0 if proc is not None else None
                fut.set_exception(OSError(int(rest[1]), rest[2].decode(errors="replace"), name))
        elif op == b"X":
            proc = self._procs.pop(int(rest[0]), None)
            if proc is not None:
                self.running -= 1
                proc._ended()
                if not proc.exited.done():
                    proc.exited.set_result(int(rest[1]))
            self.touch()

    def _take_terminal(self, cid: int, fds: list[int]) -> list[int]:
        """Give a pty's master to the command that asked for one; the descriptors left over."""
        proc = self._procs.get(cid)
        if proc is None or not proc.terminal or cid not in self._pending:
            return fds
        proc.attach_terminal(fds[0])
        return fds[1:]

    def close(self) -> None:
        """Close the socket: the agent kills every command and exits (and its machine ends)."""
        if self.namespace is not None:
            os.close(self.namespace)
            self.namespace = None
        if self.sock is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def abandon(self) -> None:
        """After `close`, once the machine's processes are gone: fail whatever still waits."""
        error = MachineUnavailable(f"the {self.what} stopped")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        for proc in self._procs.values():
            if not proc.exited.done():
                proc.exited.set_result(KILLED_EXIT)
        self._pending.clear()
        self._procs.clear()
        if not self.ready.done():
            self.ready.set_exception(MachineUnavailable(f"the {self.what} exited during start"))
            self.ready.exception()

    # commands -------------------------------------------------------------------------

    async def spawn(
        self,
        argv: Sequence[str],
        cwd: str,
        env: dict[str, str],
        stdin: bytes | None,
        interactive: bool,
        pty: TerminalSize | None = None,
        account: bool = False,
        end_group: bool = False,
    ) -> AgentProcess:
        """Start `argv` in `cwd` with exactly `env`; `stdin` (or `interactive`) gives it a stdin
        pipe; `pty` runs it on a terminal of that size instead (`stdin` is then typed into it).
        `account`: the child gets the namespace sent with `send_account` as its fd 3.
        `end_group`: the agent kills the command's group at its exit (not on a terminal)."""
        self._next += 1
        cid = self._next
        pairs = [f"{k}={v}" for k, v in env.items()]
        suffix = b"u" if account else b""
        if pty is not None:
            proc = AgentProcess(self, cid, None, None, None, terminal=True)
            message: list[bytes | str | int] = [
                b"T" + suffix, cid, cwd, pty.rows, pty.cols, len(argv), *argv, *pairs,
            ]  # fmt: skip
            return await self._started(proc, argv, message, [], stdin)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        fds = [out_w, err_w]
        stdin_w = None
        if stdin is not None or interactive:
            in_r, stdin_w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(stdin_w, False)  # a command that does not read must not stop the server
            fds.append(in_r)
        proc = AgentProcess(
            self, cid, Pipe(out_r, self.loop), Pipe(err_r, self.loop), stdin_w, group_ends_at_exit=end_group
        )
        op = b"S" + suffix + (b"g" if end_group else b"")
        return await self._started(proc, argv, [op, cid, cwd, len(argv), *argv, *pairs], fds, stdin)

    def send_account(self, namespace: int) -> None:
        """Hand the agent the account's user namespace (`machines/account.py`); it keeps a copy."""
        self.send([b"A"], [namespace])

    async def _started(
        self,
        proc: AgentProcess,
        argv: Sequence[str],
        message: Sequence[bytes | str | int],
        fds: list[int],
        stdin: bytes | None,
    ) -> AgentProcess:
        """Send the spawn (`fds` are the command's ends, closed here) and wait for its pid.

        The agent starts the command as soon as it reads the spawn, so a caller that gives up
        before the pid comes back (cancelled) has the command killed: `K` follows `S` on the one
        socket, and the agent ignores an id it does not know (a spawn that failed).
        """
        fut: asyncio.Future[int] = self.loop.create_future()
        self._pending[proc.cid] = fut
        proc.argv0 = argv[0]
        self._procs[proc.cid] = proc
        self.running += 1
        sent = False
        try:
            try:
                self.send(message, fds)
                sent = True
            finally:
                for fd in fds:
                    os.close(fd)
            proc.pid = await fut
        except BaseException:  # a failed send as much as a failed spawn: nothing stays counted
            self._procs.pop(proc.cid, None)
            self._pending.pop(proc.cid, None)
            self.running -= 1
            proc._close_pipes()
            refused = fut.done() and not fut.cancelled() and fut.exception() is not None  # its `E`
            if sent and not refused:
                with contextlib.suppress(MachineUnavailable, OSError):
                    self.send([b"K", proc.cid, int(signal.SIGKILL)])
            raise
        if stdin is not None:
            await proc.write_stdin(stdin)
            await proc.close_stdin()
        return proc
