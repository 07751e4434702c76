"""`SshMachine`: the `Machine` protocol over SSH (see the package docstring)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import logging
import posixpath
import secrets
import shlex
import signal
import stat as stat_mod
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncssh

from agentbox.machines.base import (
    MAX_MACHINE_READ_BYTES,
    OS,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileStat,
    collect,
    inside_path,
    pipes_only,
)
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.local import BASE_PATH
from agentbox.machines.ssh.channel import CommandChannel, SshProcess, remote_command
from agentbox.machines.ssh.options import KEEPALIVE_COUNT, SshOptions
from agentbox.machines.ssh.pool import ConnectionPool, Link
from agentbox.machines.ssh.sftp import (
    is_link,
    lstat_or_none,
    posix_rename,
    sftp_os_error,
    stat_or_none,
    to_stat,
)
from agentbox.machines.ssh.watch import RemoteWatch

log = logging.getLogger(__name__)

#: Seconds to open a channel and have its command report its pid.
CHANNEL_TIMEOUT = 15.0
#: Seconds one file operation (a whole read or write included) may take.
FILE_OP_TIMEOUT = 60.0
#: Seconds a kill (over its own channel) may take, and then the killed command to end.
KILL_TIMEOUT = 5.0
#: Tries of a kill whose channel fails or times out (a busy host: the login shell is slow to
#: start); each has KILL_TIMEOUT.
KILL_ATTEMPTS = 3
#: Seconds a helper command of the machine's own (probe, `id`, `rm -rf`, `find`) may take.
HELPER_TIMEOUT = 60.0
#: Between a file's name and the random part of the temp file a write goes through.
TEMP_INFIX = ".agentbox-"
#: Matches `grep` returns at most, and the seconds it may run.
MAX_GREP_RESULTS = 1000
GREP_TIMEOUT = 30.0
#: Characters of one matching line `grep` keeps.
MAX_GREP_LINE = 2000
#: asyncssh's reason for a channel asked of a connection that is already gone.
ASYNCSSH_CLOSED = "SSH connection closed"
#: What asyncssh raises when a connection (or the SFTP channel on it) is gone.
CONNECTION_LOST = (asyncssh.DisconnectError, asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection)

# What the first connection learns about the host (login shell, sshd's environment); $1 = root.
PROBE = r"""cd || exit 1
mkdir -p -- "$1" && cd -- "$1" || exit 1
printf 'root=%s\n' "$PWD"
printf 'home=%s\n' "$HOME"
printf 'uid=%s\n' "$(id -u)"
printf 'os=%s\n' "$(uname -s)"
for t in inotifywait rg grep; do printf '%s=%s\n' "$t" "$(command -v "$t")"; done
find / -maxdepth 0 -printf '' 2>/dev/null && echo 'find=gnu'
exit 0
"""

T = TypeVar("T")


@dataclass
class HostFacts:
    """What the first connection learned about the host."""

    root: str
    home: str
    uid: int
    os: OS
    inotifywait: str | None
    rg: str | None
    grep: str | None
    gnu_find: bool


@dataclass(frozen=True)
class GrepHit:
    """One matching line: its file (absolute remote path), 1-based line number and text."""

    path: str
    line: int
    text: str


class SshMachine:
    """One remote host, shared by every session that names it (see the package docstring)."""

    kind = "ssh"
    isolated = False
    network_on = True

    def __init__(self, name: str, options: SshOptions, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.options = options
        self.env = dict(env or {})
        self.os: OS = "linux"
        root = options.root
        self.root = root if root.startswith("/") else f"~/{root}"
        """The remote root; `~/...` until the first connection says where the home is."""
        self.facts: HostFacts | None = None
        self.state = "stopped"
        self.last_used = time.monotonic()
        self.running = 0
        self.pool = ConnectionPool(self._connect, options.max_sessions, on_lost=self._lost)
        self._keys: list[asyncssh.SSHKey] | None = None
        self._sftp: tuple[Link, asyncssh.SFTPClient] | None = None
        self._sftp_lock = asyncio.Lock()
        self._facts_lock = asyncio.Lock()
        self._owners: dict[str, tuple[int, int]] = {}
        self._processes: set[SshProcess] = set()
        self._kills: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and learn the host (home, root, tools), if that is not done yet."""
        await self.ready()

    async def stop(self) -> None:
        """Close every connection; the next call opens one again."""
        self.state = "stopped"
        if self._sftp is not None:
            self._sftp[1].exit()
            self._sftp = None
        await self.pool.close()

    async def close(self) -> None:
        """Kill what still runs (each group, best effort, bounded), then disconnect for good."""
        if self._closed:
            return
        for process in list(self._processes):
            if not process.channel.exited.done():
                process.kill(signal.SIGKILL)
        if self._kills:
            await asyncio.wait(list(self._kills), timeout=2 * KILL_TIMEOUT)
        self._closed = True
        await self.stop()

    def busy(self) -> bool:
        """A command, or what it left running on its channel, keeps the machine in use."""
        return self.running > 0

    @property
    def connections(self) -> int:
        return len(self.pool.live())

    def capabilities(self) -> dict[str, Any]:
        o, facts = self.options, self.facts
        unknown = "not known until connected"
        watch = unknown if facts is None and o.watch == "auto" else self.watch_kind()
        grep = unknown if facts is None else "rg" if facts.rg else "grep"
        return {
            "transport": "ssh",
            "host": o.where,
            "host_key": "pinned (host_key)" if o.host_key else f"known_hosts {self._known_hosts_path()}",
            "isolation": f"none: commands run as {o.user} on {o.host}, files are that user's",
            "root": self.root,
            "connections": self.connections,
            "channels_per_connection": o.max_sessions,
            "max_connections": self.pool.max_connections,
            "watch": watch,
            "grep": grep,
            "network": "the host's own",
        }

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        user = self.options.user
        home = self.facts.home if self.facts is not None else "/"
        return {
            "PATH": BASE_PATH,
            "HOME": home,
            "USER": user,
            "LOGNAME": user,
            "LANG": "C.UTF-8",
            **self.env,
            **request.env,
        }

    # connecting ---------------------------------------------------------------------------

    async def ready(self) -> HostFacts:
        """The host's facts, connecting first if no call has yet: every operation starts here."""
        if self._closed:
            raise MachineUnavailable(f"machine {self.name!r} is closed")
        self.last_used = time.monotonic()
        if self.facts is None:
            async with self._facts_lock:
                if self.facts is None:
                    self.facts = await self._probe()
                    self.root = self.facts.root
                    self.os = self.facts.os
        self.state = "running"
        return self.facts

    def _known_hosts_path(self) -> Path:
        return Path(self.options.known_hosts or Path.home() / ".ssh" / "known_hosts").expanduser()

    def _trust(self) -> Any:
        """What asyncssh checks the host key against: the pinned key, or the known_hosts file."""
        if self.options.host_key:
            return ([asyncssh.import_public_key(self.options.host_key)], [], [])
        path = self._known_hosts_path()
        if not path.is_file():
            raise MachineUnavailable(
                f"no known_hosts file at {path} and no host_key: the host key of {self.options.host} "
                "cannot be checked (add the host's key there, once its fingerprint is checked, or set host_key)"
            )
        return str(path)

    def _client_keys(self) -> list[asyncssh.SSHKey]:
        o = self.options
        if self._keys is None:
            try:
                if o.key_file:
                    self._keys = [asyncssh.read_private_key(Path(o.key_file).expanduser(), o.passphrase)]
                elif o.private_key:
                    self._keys = [asyncssh.import_private_key(o.private_key, o.passphrase)]
                else:
                    self._keys = []
            except (OSError, asyncssh.KeyImportError, asyncssh.KeyEncryptionError, ValueError) as exc:
                source = o.key_file or "private_key"
                raise MachineUnavailable(
                    f"the private key {source} could not be loaded (wrong passphrase?): {exc}"
                ) from None
        return self._keys

    async def _connect(self) -> asyncssh.SSHClientConnection:
        o = self.options
        trust = self._trust()
        keys = await asyncio.to_thread(self._client_keys)  # a passphrase's KDF takes a while
        try:
            async with asyncio.timeout(o.connect_timeout):
                return await asyncssh.connect(
                    o.host,
                    o.port,
                    username=o.user,
                    known_hosts=trust,
                    client_keys=keys or None,
                    password=o.password,
                    agent_path=None,
                    config=None,
                    keepalive_interval=o.keepalive_seconds,
                    keepalive_count_max=KEEPALIVE_COUNT,
                )
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            raise self.unavailable(exc, o.connect_timeout) from None

    def _lost(self, link: Link) -> None:
        if self._sftp is not None and self._sftp[0] is link:
            self._sftp = None

    def unavailable(self, exc: BaseException, timeout: float | None = None) -> MachineUnavailable:
        """The one wording of every transport failure (see the package docstring's table)."""
        o = self.options
        if isinstance(exc, MachineUnavailable):
            return exc
        if isinstance(exc, asyncssh.HostKeyNotVerifiable):
            source = "the pinned host_key" if o.host_key else f"known_hosts {self._known_hosts_path()}"
            return MachineUnavailable(
                f"the host key of {o.host}:{o.port} is not trusted by {source}: refusing to connect ({exc.reason})"
            )
        if isinstance(exc, asyncssh.PermissionDenied):
            return MachineUnavailable(
                f"authentication as {o.user} on {o.host}:{o.port} failed ({exc.reason})"
            )
        if isinstance(exc, CONNECTION_LOST):
            return self.dropped(exc)
        if isinstance(exc, asyncssh.ChannelOpenError):
            return MachineUnavailable(f"{o.where} refused a channel: {exc.reason}")
        if isinstance(exc, TimeoutError):
            return MachineUnavailable(f"{o.where} did not answer within {timeout or 0:g} s")
        if isinstance(exc, OSError):
            return MachineUnavailable(f"cannot reach sshd at {o.host}:{o.port}: {exc.strerror or exc}")
        return MachineUnavailable(f"{o.where}: {exc}")

    def dropped(self, exc: BaseException) -> MachineUnavailable:
        """A connection that was up and is gone (the sshd, its host or the network went away)."""
        return MachineUnavailable(f"the connection to {self.options.where} dropped: {exc}")

    async def _probe(self) -> HostFacts:
        code, out, err = await self._plain(
            f"sh -c {shlex.quote(PROBE)} agentbox {shlex.quote(self.options.root)}"
        )
        facts = dict(line.partition("=")[::2] for line in out.decode(errors="replace").splitlines())
        if code != 0 or "root" not in facts:
            raise MachineUnavailable(
                f"{self.options.where}: cannot use {self.options.root!r} as the root: "
                f"{err.decode(errors='replace').strip() or f'exit {code}'}"
            )
        system = facts.get("os", "").lower()
        return HostFacts(
            root=facts["root"],
            home=facts.get("home") or "/",
            uid=int(facts.get("uid") or -1),
            os="darwin" if system == "darwin" else "linux",
            inotifywait=facts.get("inotifywait") or None,
            rg=facts.get("rg") or None,
            grep=facts.get("grep") or None,
            gnu_find=facts.get("find") == "gnu",
        )

    async def _plain(self, command: str, timeout: float = HELPER_TIMEOUT) -> tuple[int, bytes, bytes]:
        """Run `command` in the login shell as it is: no marker, cwd or clean environment needed."""
        for attempt in (1, 2):
            link = await self.pool.acquire()
            try:
                async with asyncio.timeout(timeout):
                    result = await link.conn.run(command, check=False, encoding=None)
                code = result.exit_status
                if result.exit_signal:
                    number = getattr(signal, f"SIG{result.exit_signal[0]}", None)
                    code = 128 + int(number) if number is not None else 255
                elif code is None or code < 0:
                    code = 255
                return code, _bytes(result.stdout), _bytes(result.stderr)
            except asyncssh.ChannelOpenError as exc:
                self._refused(link, exc)
                if attempt == 2:
                    raise self.unavailable(exc) from None
            except (asyncssh.Error, OSError, TimeoutError) as exc:
                raise self.unavailable(exc, timeout) from None
            finally:
                self.pool.release(link)
        raise AssertionError("unreachable")

    def _refused(self, link: Link, exc: asyncssh.ChannelOpenError) -> None:
        """A channel that did not open: on a closed connection, or one past the sshd's MaxSessions
        (OpenSSH says "open failed" then, and the connection and its channels live on)."""
        if link.closed or exc.reason == ASYNCSSH_CLOSED:
            self.pool.discard(link)
        else:
            self.pool.refuse(link)

    # commands -----------------------------------------------------------------------------

    async def spawn(self, request: ExecRequest) -> SshProcess:
        """A remote command on its own session channel; a pty is refused (`TerminalUnsupported`):
        the pid marker this kind's kill stands on comes on the channel's stdout, which a
        terminal would echo into and rewrite (CRLF), and stderr would merge into it."""
        pipes_only(request, f"the ssh machine {self.name!r}")
        facts = await self.ready()
        cwd = inside_path(facts.root, request.cwd or facts.root)
        piped = request.stdin is not None or request.interactive
        command = remote_command(cwd, request.args(), self.command_env(request), stdin=piped)
        channel = await self._open_channel(command, {"cwd": cwd, "exec": request.args()[0]})
        try:
            async with asyncio.timeout(CHANNEL_TIMEOUT):
                pid = await asyncio.shield(channel.started)
        except BaseException as exc:
            self._in_background(self._end_unclaimed(channel, request.args()[0]))
            if isinstance(exc, TimeoutError):
                raise self.unavailable(exc, CHANNEL_TIMEOUT) from None
            raise
        process = SshProcess(channel, pid, request.args()[0], self.signal_group)
        self._processes.add(process)
        channel.closed.add_done_callback(lambda _: self._processes.discard(process))
        if request.stdin is not None:
            await process.write_stdin(request.stdin)
            await process.close_stdin()
        return process

    async def _open_channel(self, command: str, subjects: dict[str, str]) -> CommandChannel:
        """A session channel running `command`; retried on another connection while none opened."""
        last: BaseException | None = None
        for _attempt in range(3):
            link = await self.pool.acquire()
            self.running += 1
            channel = CommandChannel(functools.partial(self._channel_closed, link), subjects)
            try:
                async with asyncio.timeout(CHANNEL_TIMEOUT):
                    await link.conn.create_session(channel.factory, command, encoding=None)
                return channel
            except asyncssh.ChannelOpenError as exc:  # nothing ran: safe to try again
                channel.release()
                self._refused(link, exc)
                last = exc
            except BaseException as exc:
                channel.abandon()
                channel.release()
                if isinstance(exc, asyncssh.Error | OSError | TimeoutError):
                    raise self.unavailable(exc, CHANNEL_TIMEOUT) from None
                raise
        assert last is not None
        raise self.unavailable(last)

    def _channel_closed(self, link: Link) -> None:
        self.running -= 1
        self.last_used = time.monotonic()
        self.pool.release(link)

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result

    def signal_group(self, process: SshProcess, sig: int) -> None:
        """Send `sig` to the process group of `process` on the host, in the background."""
        if sig == signal.SIGKILL:
            process.channel.killed = True
        self._in_background(self._signal_group(process, sig))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """A kill's work, which `close` waits for."""
        task = asyncio.ensure_future(work)
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _end_unclaimed(self, channel: CommandChannel, argv0: str) -> None:
        """Kill the command of a spawn given up before its pid came (cancelled, timed out).

        The login shell prints the pid and execs the command at once, so the command may run
        before the marker reaches us; closing the channel then would leave it running unseen.
        Its group is killed once the pid comes; a channel that says nothing in KILL_TIMEOUT, or
        whose start failed, is only closed.
        """
        try:
            pid = await asyncio.wait_for(asyncio.shield(channel.started), KILL_TIMEOUT)
        except asyncio.CancelledError:
            channel.abandon()
            raise
        except Exception:  # nothing named a process to kill
            channel.abandon()
            return
        SshProcess(channel, pid, argv0, self.signal_group).kill(signal.SIGKILL)

    async def _signal_group(self, process: SshProcess, sig: int) -> None:
        name = signal.Signals(sig).name.removeprefix("SIG")
        for attempt in range(1, KILL_ATTEMPTS + 1):  # a lost kill leaves the command running
            try:
                await self._plain(f"kill -s {name} -- -{process.pid}", timeout=KILL_TIMEOUT)
                break
            except (MachineUnavailable, OSError) as exc:
                log.warning("could not signal process group %s on %s (attempt %d of %d): %s",
                            process.pid, self.options.where, attempt, KILL_ATTEMPTS, exc)  # fmt: skip
        if sig != signal.SIGKILL:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(process.channel.exited), KILL_TIMEOUT)
        if not process.channel.exited.done():
            process.channel.abandon()

    async def run(self, argv: tuple[str, ...], timeout: float = HELPER_TIMEOUT) -> ExecResult:
        """A helper command of the machine's own, in `/`."""
        return await self.exec(ExecRequest(argv=argv, cwd="/", timeout=timeout))

    # files --------------------------------------------------------------------------------

    async def sftp_client(self) -> asyncssh.SFTPClient:
        await self.ready()
        held = self._sftp
        if held is not None and not held[0].closed:
            return held[1]
        async with self._sftp_lock:
            if self._sftp is not None and not self._sftp[0].closed:
                return self._sftp[1]
            link = await self.pool.acquire()  # SFTP holds its channel for as long as it is open
            try:
                async with asyncio.timeout(CHANNEL_TIMEOUT):
                    client = await link.conn.start_sftp_client()
            except BaseException as exc:
                self.pool.release(link)
                if isinstance(exc, asyncssh.ChannelOpenError):
                    self._refused(link, exc)
                if isinstance(exc, asyncssh.Error | OSError | TimeoutError):
                    raise self.unavailable(exc, CHANNEL_TIMEOUT) from None
                raise
            self._sftp = (link, client)
            watcher = asyncio.ensure_future(self._sftp_closed(link, client))
            self._tasks.add(watcher)
            watcher.add_done_callback(self._tasks.discard)
            return client

    async def _sftp_closed(self, link: Link, client: asyncssh.SFTPClient) -> None:
        with contextlib.suppress(Exception):
            await client.wait_closed()
        if self._sftp is not None and self._sftp[1] is client:
            self._sftp = None
        self.pool.release(link)

    async def _files(
        self, path: str, op: Callable[[asyncssh.SFTPClient, str], Awaitable[T]], *, idempotent: bool
    ) -> T:
        """Run one SFTP operation on `path` (made absolute), with its errors made ours."""
        facts = await self.ready()
        target = inside_path(facts.root, path)
        for attempt in (1, 2):
            sftp = await self.sftp_client()
            try:
                async with asyncio.timeout(FILE_OP_TIMEOUT):
                    return await op(sftp, target)
            except (*CONNECTION_LOST, ConnectionError) as exc:
                held = self._sftp
                if held is not None and held[1] is sftp:  # it dropped under us: a new connection
                    self.pool.discard(held[0])
                    self._sftp = None
                if attempt == 2 or not idempotent:
                    raise self.dropped(exc) from None
            except asyncssh.SFTPError as exc:
                raise sftp_os_error(exc, path) from None
            except (asyncssh.Error, TimeoutError) as exc:
                raise self.unavailable(exc, FILE_OP_TIMEOUT) from None
        raise AssertionError("unreachable")

    async def read(
        self, path: str, *, offset: int = 0, length: int | None = None, limit: int = MAX_MACHINE_READ_BYTES
    ) -> bytes:
        """`length` bytes from `offset`, or the rest of the file, refused (EFBIG) past `limit`."""

        async def op(sftp: asyncssh.SFTPClient, target: str) -> bytes:
            async with sftp.open(target, "rb") as f:
                attrs = await f.stat()
                if attrs.permissions is not None and stat_mod.S_ISDIR(attrs.permissions):
                    raise OSError(errno.EISDIR, "is a directory", path)
                if length is not None:
                    return await _read_exactly(f, offset, length)
                rest = max((attrs.size or 0) - offset, 0)
                if rest > limit:
                    raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
                data = await _read_exactly(f, offset, limit + 1)
                if len(data) > limit:
                    raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
                return data

        return await self._files(path, op, idempotent=True)

    async def write(self, path: str, data: bytes) -> None:
        """Replace the file atomically: a temp file beside it, renamed over it."""

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            async def put(f: asyncssh.SFTPClientFile) -> None:
                await f.write(data)

            await self._staged(sftp, target, path, put)

        await self._files(path, op, idempotent=True)

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """`write` from chunks as they arrive; nothing replaces the target before the last one."""
        size = 0

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            async def put(f: asyncssh.SFTPClientFile) -> None:
                nonlocal size
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path)
                    await f.write(chunk)

            await self._staged(sftp, target, path, put)

        await self._files(path, op, idempotent=False)  # the chunks cannot be read twice
        return size

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """Open the new file with SFTP's exclusive create (the server's O_CREAT | O_EXCL, which
        follows no final link) and write it in place; on any failure it is removed."""
        size = 0

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            nonlocal size
            try:
                f = await sftp.open(target, "xb")
            except asyncssh.SFTPFailure:  # sftp v3 says "failure" for EEXIST
                if await lstat_or_none(sftp, target) is not None:
                    raise OSError(errno.EEXIST, "file exists", path) from None
                raise
            try:
                async with f:
                    async for chunk in chunks:
                        size += len(chunk)
                        if size > limit:
                            raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path)
                        await f.write(chunk)
            except BaseException:
                with contextlib.suppress(Exception):
                    await sftp.remove(target)
                raise

        await self._files(path, op, idempotent=False)  # the chunks cannot be read twice
        return size

    async def _staged(
        self,
        sftp: asyncssh.SFTPClient,
        target: str,
        path: str,
        put: Callable[[asyncssh.SFTPClientFile], Awaitable[None]],
    ) -> None:
        """Write a temp file beside `target` with `put`, then rename it over `target`."""
        old = await lstat_or_none(sftp, target)
        if old is not None and is_link(old):  # write where the link points, as a local write does
            target = await sftp.realpath(target)
            old = await lstat_or_none(sftp, target)
        if old is not None and stat_mod.S_ISDIR(old.permissions or 0):
            raise OSError(errno.EISDIR, "is a directory", path)
        parent, name = posixpath.split(target)
        temp = posixpath.join(parent, f".{name}{TEMP_INFIX}{secrets.token_hex(6)}.tmp")
        try:
            async with sftp.open(temp, "xb") as f:
                await put(f)
                if old is not None:
                    await f.setstat(self._kept_attrs(old))
            await posix_rename(sftp, temp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                await sftp.remove(temp)
            raise

    def _kept_attrs(self, old: asyncssh.SFTPAttrs) -> asyncssh.SFTPAttrs:
        """The replaced file's mode, and as root its owner, for the file that replaces it."""
        attrs = asyncssh.SFTPAttrs(permissions=stat_mod.S_IMODE(old.permissions or 0o644))
        if self.facts is not None and self.facts.uid == 0 and old.uid is not None:
            attrs.uid, attrs.gid = old.uid, old.gid
        return attrs

    async def stat(self, path: str) -> FileStat | None:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> FileStat | None:
            lst = await lstat_or_none(sftp, target)
            if lst is None:
                return None
            st = await stat_or_none(sftp, target) if is_link(lst) else lst
            return None if st is None else to_stat(target, st, is_link(lst))

        return await self._files(path, op, idempotent=True)

    async def list(self, path: str) -> list[FileEntry]:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> list[FileEntry]:
            try:
                names = [n async for n in sftp.scandir(target) if n.filename not in (".", "..")]
            except asyncssh.SFTPNoSuchFile:  # sftp v3 says "no such file" for ENOTDIR too
                if (await stat_or_none(sftp, target)) is not None:
                    raise OSError(errno.ENOTDIR, "not a directory", path) from None
                raise
            names.sort(key=lambda n: str(n.filename))
            children = [posixpath.join(target, str(n.filename)) for n in names]
            # a link's entry has its target's attributes, as a local listing gives them
            links = [child for n, child in zip(names, children, strict=True) if is_link(n.attrs)]
            followed = dict(
                zip(links, await asyncio.gather(*(stat_or_none(sftp, c) for c in links)), strict=True)
            )
            return [
                FileEntry(
                    str(n.filename), child, to_stat(child, followed.get(child) or n.attrs, child in followed)
                )
                for n, child in zip(names, children, strict=True)
            ]

        return await self._files(path, op, idempotent=True)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            attrs = await sftp.lstat(target)
            if not stat_mod.S_ISDIR(attrs.permissions or 0):
                await sftp.remove(target)
            elif recursive:
                result = await self.run(("rm", "-rf", "--", target))
                if result.exit_code != 0:
                    raise OSError(errno.EIO, result.stderr.decode(errors="replace").strip(), path)
            else:
                try:
                    await sftp.rmdir(target)
                except asyncssh.SFTPFailure:  # sftp v3 says "failure" for ENOTEMPTY
                    if [n async for n in sftp.scandir(target) if n.filename not in (".", "..")]:
                        raise OSError(errno.ENOTEMPTY, "directory not empty", path) from None
                    raise

        await self._files(path, op, idempotent=False)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            if parents:
                existing = await stat_or_none(sftp, target)
                if existing is not None and stat_mod.S_ISDIR(existing.permissions or 0):
                    return
                await sftp.makedirs(target, exist_ok=True)
                return
            try:
                await sftp.mkdir(target)
            except asyncssh.SFTPFailure:  # sftp v3 says "failure" for EEXIST
                if await lstat_or_none(sftp, target) is not None:
                    raise OSError(errno.EEXIST, "file exists", path) from None
                raise

        await self._files(path, op, idempotent=parents)

    async def rename(self, src: str, dst: str) -> None:
        facts = await self.ready()
        destination = inside_path(facts.root, dst)

        async def op(sftp: asyncssh.SFTPClient, source: str) -> None:
            await posix_rename(sftp, source, destination)

        await self._files(src, op, idempotent=False)

    async def chown(self, path: str, user: str) -> None:
        uid, gid = await self.user_ids(user)

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            await sftp.chown(target, uid, gid, follow_symlinks=False)

        await self._files(path, op, idempotent=True)

    async def readlink(self, path: str) -> str:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> str:
            attrs = await sftp.lstat(target)
            if not is_link(attrs):
                raise OSError(errno.EINVAL, "not a symbolic link", path)
            return str(await sftp.readlink(target))

        return await self._files(path, op, idempotent=True)

    async def symlink(self, target: str, path: str) -> None:
        async def op(sftp: asyncssh.SFTPClient, where: str) -> None:
            if await lstat_or_none(sftp, where) is not None:
                raise OSError(errno.EEXIST, "file exists", path)
            await sftp.symlink(target, where)

        await self._files(path, op, idempotent=False)

    async def find_program(self, name: str) -> str | None:
        """Programs the connection probe looks for (`rg`, `grep`, `inotifywait`); others are None."""
        facts = await self.ready()
        return {"rg": facts.rg, "grep": facts.grep, "inotifywait": facts.inotifywait}.get(name)

    async def user_ids(self, user: str) -> tuple[int, int]:
        """The remote uid and gid of `user`, asked of the host once (`id`)."""
        if user not in self._owners:
            code, out, _ = await self._plain(f"id -u -- {shlex.quote(user)} && id -g -- {shlex.quote(user)}")
            numbers = out.split()
            if code != 0 or len(numbers) != 2:
                raise OwnerUnsupported(
                    f"this machine cannot give files to user {user!r}: {self.options.host} has no such user",
                    path=None,
                )
            self._owners[user] = (int(numbers[0]), int(numbers[1]))
        return self._owners[user]

    # watching and search ------------------------------------------------------------------

    def watch_kind(self) -> str:
        """`inotifywait` or `polling (N s)`: how `watch` sees changes on this host."""
        o = self.options
        polling = f"polling ({o.poll_seconds:g} s)"
        if o.watch == "polling":
            return polling
        if o.watch == "inotifywait" or (self.facts is not None and self.facts.inotifywait):
            return "inotifywait"
        return polling

    def watch(self, path: str, *, recursive: bool = True) -> RemoteWatch:
        """Changes under `path` as `WatchChange`s: `async with machine.watch(p) as w: async for ...`
        (the optional `Watching` capability of `agentbox.machines.base`)."""
        return RemoteWatch(self, path, recursive)

    async def grep(
        self,
        pattern: str,
        path: str = ".",
        *,
        fixed_strings: bool = False,
        case_insensitive: bool = False,
        max_results: int = MAX_GREP_RESULTS,
        timeout: float = GREP_TIMEOUT,
    ) -> builtins.list[GrepHit]:
        """Lines matching `pattern` under `path`: the host's rg (a Rust regex), else grep -E (POSIX ERE)."""
        facts = await self.ready()
        target = inside_path(facts.root, path)
        flags = (["-F"] if fixed_strings else []) + (["-i"] if case_insensitive else [])
        if facts.rg:
            argv = [facts.rg, "--no-config", "--null", "--with-filename", "--line-number", "--no-heading"]
            argv += ["--color", "never", *flags, "-e", pattern, "--", target]
        elif facts.grep:
            argv = [facts.grep, "-r", "-n", "-H", "-Z", "-I", "--color=never"]
            argv += [*(flags if fixed_strings else ["-E", *flags]), "-e", pattern, "--", target]
        else:
            raise MachineUnavailable(f"{self.options.host} has neither rg nor grep")
        process = await self.spawn(ExecRequest(argv=tuple(argv), cwd="/"))
        hits: builtins.list[GrepHit] = []
        try:
            async with asyncio.timeout(timeout), contextlib.aclosing(_lines(process.stdout)) as lines:
                async for line in lines:
                    name, sep, rest = line.partition(b"\0")
                    number, _, text = rest.partition(b":")
                    if sep and number.isdigit():
                        hits.append(GrepHit(name.decode(errors="replace"), int(number),
                                            text.decode(errors="replace")[:MAX_GREP_LINE]))  # fmt: skip
                    if len(hits) >= max_results:
                        break
                stderr = await process.stderr.read(4096)
                code = await process.wait() if len(hits) < max_results else 0
        finally:
            if not process.channel.exited.done():
                process.kill()
        if code > 1 and not hits:
            raise OSError(
                errno.EINVAL, stderr.decode(errors="replace").strip() or f"search failed ({code})", path
            )
        return hits


async def _lines(stream: asyncio.StreamReader) -> AsyncGenerator[bytes, None]:
    """`stream` split on newlines, whatever the lines' lengths."""
    pending = b""
    while chunk := await stream.read(65536):
        pending += chunk
        *whole, pending = pending.split(b"\n")
        for line in whole:
            yield line
    if pending:
        yield pending


async def _read_exactly(f: asyncssh.SFTPClientFile, offset: int, length: int) -> bytes:
    """Up to `length` bytes from `offset`: SFTP servers may answer a read with fewer."""
    parts: list[bytes] = []
    got = 0
    while got < length:
        chunk: bytes = await f.read(length - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _bytes(data: bytes | str | None) -> bytes:
    return data.encode() if isinstance(data, str) else data or b""
