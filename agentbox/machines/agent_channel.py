"""The server's end of an exec agent's control socket, for every machine that runs one.

A `sandbox` (bwrap) and a `docker` container both start their commands through the exec
agent (`exec_agent.py`, whose docstring has the protocol). How the agent is launched and how
its socket reaches the server differ (an inherited socketpair end, a unix socket in a bound
directory); what happens on the socket does not, and lives here:

- `AgentChannel.spawn` makes a command's pipes, sends `S` with their write ends (and a
  stdin read end), and waits for `P` (its pid) or `E` (an errno);
- `X` ends the command's `AgentProcess`; `K` / `G` signal its process group;
- `R`, once, hands over the directories that exist only inside the machine: they are
  attached to the machine's `HostView`, and `ready` resolves;
- EOF (the agent, or all of the machine, is gone) fails `ready` if it was pending and calls
  the machine's `gone`; `abandon` then fails every command still waiting.

The server reads each command's pipes itself (`Pipe`), so no output passes through the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
from collections.abc import Callable, Sequence

from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.exec_agent import MAX_MESSAGE
from agentbox.machines.hostview import HostView

#: Bytes read from a command pipe per wakeup.
PIPE_CHUNK = 65536
#: The exit code a command reports when its machine stopped under it (SIGKILL's).
KILLED_EXIT = 137


class Pipe:
    """Feed a StreamReader from a pipe with `add_reader`: cheaper than a transport per command."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.reader = asyncio.StreamReader(limit=2**31, loop=loop)
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, PIPE_CHUNK)
        except BlockingIOError:
            return
        except OSError:
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
    """A command started by an exec agent."""

    def __init__(
        self, channel: AgentChannel, cid: int, stdout: Pipe, stderr: Pipe, stdin: int | None
    ) -> None:
        self.channel = channel
        self.cid = cid
        self.pid = 0
        self._out, self._err = stdout, stderr
        self.stdout = stdout.reader
        self.stderr = stderr.reader
        self._stdin = stdin
        self.argv0 = ""
        self.exited: asyncio.Future[int] = channel.loop.create_future()

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin is None:
            raise BrokenPipeError("stdin is closed")
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._stdin, view)
                view = view[n:]
            except BlockingIOError:
                await asyncio.sleep(0.005)

    async def close_stdin(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group, also after its leader exited (children remain)."""
        with contextlib.suppress(MachineUnavailable):
            if not self.exited.done():
                self.channel.send([b"K", self.cid, int(sig)])
            elif self.pid:
                self.channel.send([b"G", self.pid, int(sig)])

    def _close_pipes(self) -> None:
        self._out.close()
        self._err.close()
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None


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
        self._next = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
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
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, len(self.shared))
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
        if op != b"R":
            for fd in fds:  # only `R` carries descriptors
                os.close(fd)
        if op == b"R":
            for inside, fd in zip(self.shared, fds, strict=False):
                self.view.attach(inside, fd)
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
                if not proc.exited.done():
                    proc.exited.set_result(int(rest[1]))
            self.touch()

    def close(self) -> None:
        """Close the socket: the agent kills every command and exits (and its machine ends)."""
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
        self, argv: Sequence[str], cwd: str, env: dict[str, str], stdin: bytes | None, interactive: bool
    ) -> AgentProcess:
        """Start `argv` in `cwd` with exactly `env`; `stdin` (or `interactive`) gives it a stdin pipe."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        fds = [out_w, err_w]
        stdin_w = None
        if stdin is not None or interactive:
            in_r, stdin_w = os.pipe2(os.O_CLOEXEC)
            fds.append(in_r)
        self._next += 1
        cid = self._next
        fut: asyncio.Future[int] = self.loop.create_future()
        self._pending[cid] = fut
        proc = AgentProcess(self, cid, Pipe(out_r, self.loop), Pipe(err_r, self.loop), stdin_w)
        proc.argv0 = argv[0]
        self._procs[cid] = proc
        self.running += 1
        try:
            try:
                pairs = [f"{k}={v}" for k, v in env.items()]
                self.send([b"S", cid, cwd, len(argv), *argv, *pairs], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            proc.pid = await fut
        except BaseException:  # a failed send as much as a failed spawn: nothing stays counted
            self._procs.pop(cid, None)
            self._pending.pop(cid, None)
            self.running -= 1
            proc._close_pipes()
            raise
        if stdin is not None:
            await proc.write_stdin(stdin)
            await proc.close_stdin()
        return proc
