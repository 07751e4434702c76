"""The `ssh` kind: one remote host over SSH, shared by every session that names it, not isolated.

Commands run on the host as the configured user, files are that user's files, and nothing
stands between a session and the host but the tool layer's approvals (seed 004): never
offer this kind to untrusted users. `root` is a remote directory, by default `agentbox`
under the remote user's home, created at the first connection; relative paths resolve
under it.

Connections. One machine keeps a small pool of connections to its sshd (`ConnectionPool`),
opened when first needed and reused by every command and file operation. An sshd allows a
few channels per connection (OpenSSH's `MaxSessions`, 10 on Debian), so a connection
carries at most `max_sessions` channels at once (SFTP holds one for as long as it is open)
and the pool opens another one past that, up to MAX_CONNECTIONS, rather than failing the
eleventh concurrent command. Keepalives find a silent peer within KEEPALIVE_SECONDS *
KEEPALIVE_COUNT; a connection that drops leaves the pool and the next call opens a new one.

Trust. The host key is checked against the server user's `~/.ssh/known_hosts` (or the
`known_hosts` file named), or against the one `host_key` configured; an unknown or changed
key refuses the connection. The operator's ssh config, agent and default keys are never
read: authentication is by the configured private key (a file or the key itself, with an
optional passphrase) or password. Secret fields arrive decrypted (`Registry.secrets`);
`SshOptions` refuses one still `enc:`.

Commands. Each command is one session channel whose command line (`remote_command`) the
remote user's login shell runs (it must be a POSIX shell: sh, dash, bash, zsh, ksh): with
builtins only, it sets PATH, changes to the cwd, checks that argv[0] can be run (else the
spawn fails with the errno a local spawn would give), writes a marker with its pid to
stdout (`\\0agentbox:pid:N\\n`; whatever its startup files printed before is dropped), and

    exec env -i VAR=VALUE... ARGV...

so the environment is exactly `command_env`: neither sshd's variables (SSH_CONNECTION,
MAIL, ...) nor what the login shell's startup files export reach the command. OpenSSH
starts each session's process in a session of its own, and the login shell, env and the
command are one process exec'ing in turn, so the marked pid leads the command's process
group: a kill, on timeout, cancellation or `Process.kill`, is `kill -s SIG -- -PID` over
another channel, which ends the command and everything it started. A command that outlives a SIGKILL by
KILL_TIMEOUT (its kill could not be delivered) has its channel closed.

Files go over one SFTP channel (asyncssh pipelines its requests). A write goes to a temp
file in the same directory (`.NAME.agentbox-RANDOM.tmp`, created exclusively), takes the
old file's mode (and, as root, its owner) and is renamed over the target
(`posix-rename@openssh.com`), so readers see the old content or the new, never a part.
SFTP v3 has no inode numbers: `FileStat.inode` is 0, and `mtime` is whole seconds.

Watching and search (methods of their own, beside the `Machine` protocol): `watch` runs
`inotifywait -m` on the host when it has it, else polls with GNU `find` every
`poll_seconds`; `grep` runs the host's `rg`, else its `grep -r`. `capabilities()` says
which (known after the first connection).

Every way a call fails here, all bounded in time (the constants below):

    sshd unreachable, refused, silent          MachineUnavailable "cannot reach sshd at ..."
    host key unknown or changed                MachineUnavailable "the host key of ... is not trusted"
    no known_hosts file and no host_key        MachineUnavailable "no known_hosts file at ..."
    key unreadable or wrong passphrase         MachineUnavailable "the private key ... could not be loaded"
    authentication refused                     MachineUnavailable "authentication as USER ... failed"
    connection dropped (mid-command too)       MachineUnavailable "the connection to ... dropped"
    every channel busy for CHANNEL_WAIT_SECONDS  MachineUnavailable "all N channels ... are busy"
    a file operation's own failure             OSError with its errno (FileNotFoundError, ...)
    a user `chown` cannot resolve              OwnerUnsupported

Idempotent calls (a spawn whose channel never opened, read, stat, list, write) that meet a
connection dropped under them are retried once on a new connection; the others raise.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import logging
import posixpath
import re
import secrets
import shlex
import signal
import stat as stat_mod
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

import asyncssh

from agentbox.machines.base import OS, ExecRequest, ExecResult, FileEntry, FileStat, collect, inside_path
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.hostfs import MAX_MACHINE_READ_BYTES
from agentbox.machines.local import BASE_PATH
from agentbox.secrets import is_encrypted

log = logging.getLogger(__name__)

DEFAULT_PORT = 22
#: Channels one connection carries at once: OpenSSH's `MaxSessions` default (Debian's too).
DEFAULT_MAX_SESSIONS = 10
#: Connections one machine holds at most, so commands beyond MAX_CONNECTIONS * max_sessions wait.
MAX_CONNECTIONS = 8
#: Seconds for a TCP connect, the SSH handshake and authentication together.
CONNECT_TIMEOUT = 10.0
#: Seconds to open a channel and have its command report its pid.
CHANNEL_TIMEOUT = 15.0
#: Seconds a command waits for a free channel while every connection is full.
CHANNEL_WAIT_SECONDS = 30.0
#: Seconds one file operation (a whole read or write included) may take.
FILE_OP_TIMEOUT = 60.0
#: Seconds between keepalives on a quiet connection; KEEPALIVE_COUNT unanswered ones drop it.
KEEPALIVE_SECONDS = 15.0
KEEPALIVE_COUNT = 3
#: Seconds a kill (over its own channel) may take, and then the killed command to end.
KILL_TIMEOUT = 5.0
#: Seconds a helper command of the machine's own (probe, `id`, `rm -rf`, `find`) may take.
HELPER_TIMEOUT = 60.0
#: Seconds a connection beyond the first stays open with no channel in use.
SPARE_IDLE_SECONDS = 30.0
#: Bytes one output stream buffers before the channel stops reading (back-pressure to the host).
STREAM_BUFFER = 1 << 20
#: Bytes of login-shell output kept while looking for the wrapper's marker.
MAX_PREAMBLE_BYTES = 64 * 1024
#: Bytes of a command line (environment included) sent in one exec request: sshd's packets
#: are at most 256 KiB.
MAX_COMMAND_BYTES = 200 * 1024
#: Between a file's name and the random part of the temp file a write goes through.
TEMP_INFIX = ".agentbox-"
#: The remote root when the entry names none: this directory under the remote user's home.
DEFAULT_ROOT = "agentbox"
#: Seconds between two scans of a polling watch (its latency).
DEFAULT_POLL_SECONDS = 2.0
#: Entries a polling watch keeps track of; deeper ones go unwatched.
MAX_POLL_ENTRIES = 100_000
#: Changes a watch queues for a slow reader before it reports `overflow` and drops.
MAX_QUEUED_CHANGES = 10_000
#: Seconds `inotifywait -r` may take to set up its watches.
WATCH_SETUP_TIMEOUT = 60.0
#: Matches `grep` returns at most, and the seconds it may run.
MAX_GREP_RESULTS = 1000
GREP_TIMEOUT = 30.0
#: Characters of one matching line `grep` keeps.
MAX_GREP_LINE = 2000

MARKER = b"\0agentbox:"
#: asyncssh's reason for a channel asked of a connection that is already gone.
ASYNCSSH_CLOSED = "SSH connection closed"
#: What asyncssh raises when a connection (or the SFTP channel on it) is gone.
CONNECTION_LOST = (asyncssh.DisconnectError, asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WatchMode = Literal["auto", "inotifywait", "polling"]
#: inotify events `watch` asks for, and the event each becomes.
INOTIFY_EVENTS = {
    "CREATE": "create",
    "MOVED_TO": "create",
    "CLOSE_WRITE": "write",
    "DELETE": "remove",
    "MOVED_FROM": "remove",
    "DELETE_SELF": "remove",
    "ATTRIB": "chmod",
}


def remote_command(cwd: str, argv: list[str], env: Mapping[str, str], *, stdin: bool = False) -> str:
    """The command line of an exec request: the login shell checks, marks and execs (see the
    module docstring). Its builtins alone run before `env`, so a command costs the host two
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


# -- options ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SshOptions:
    """A `[machines.<name>]` entry of kind `ssh`, its secrets already decrypted."""

    host: str
    """Name or address of the sshd."""
    user: str
    """The remote account: commands run as it, files are its files."""
    port: int = DEFAULT_PORT
    """The sshd's port."""
    key_file: str | None = None
    """Path, on the server's host, of the private key to log in with (OpenSSH, PEM or PKCS#8)."""
    private_key: str | None = None
    """The private key itself, as text (a secret field: stored encrypted)."""
    passphrase: str | None = None
    """Passphrase of `key_file` or `private_key`, if it is encrypted (a secret field)."""
    password: str | None = None
    """Password to log in with, tried after the key (a secret field)."""
    known_hosts: str | None = None
    """known_hosts file the host key is checked against; default `~/.ssh/known_hosts` of the
    server's user. It must list the host: an unknown key is refused, never learned."""
    host_key: str | None = None
    """The host's public key (`ssh-ed25519 AAAA...`): when set, the one key accepted, and no
    known_hosts file is read."""
    root: str = DEFAULT_ROOT
    """Remote working directory: absolute, or relative to the remote user's home. Created at
    the first connection."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    """Channels one connection may carry: the sshd's `MaxSessions`. Past it, a new connection."""
    watch: WatchMode = "auto"
    """How `watch` sees changes: `inotifywait` on the host, `polling` with `find`, or `auto`
    (inotifywait where the host has it)."""
    poll_seconds: float = DEFAULT_POLL_SECONDS
    """Seconds between two scans of a polling watch: its latency."""
    connect_timeout: float = CONNECT_TIMEOUT
    """Seconds a connection (TCP, handshake and authentication) may take."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SshOptions:
        """Validate an entry's options (unknown keys, types, ranges) into `SshOptions`."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown option(s) for an ssh machine: {', '.join(unknown)}")
        for name in REQUIRED_OPTIONS:
            if not options.get(name):
                raise ValueError(f"an ssh machine needs {name!r}")
        made = cls(**{name: _option(name, value) for name, value in options.items()})
        made.check()
        return made

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        if not (self.key_file or self.private_key or self.password):
            raise ValueError("an ssh machine needs key_file, private_key or password to log in")
        if self.key_file and self.private_key:
            raise ValueError("give key_file or private_key, not both")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.watch not in ("auto", "inotifywait", "polling"):
            raise ValueError(f"watch must be auto, inotifywait or polling, not {self.watch!r}")
        if self.poll_seconds <= 0 or self.connect_timeout <= 0:
            raise ValueError("poll_seconds and connect_timeout must be positive")
        for name in ("private_key", "passphrase", "password"):
            if is_encrypted(getattr(self, name)):
                raise ValueError(f"{name} is still encrypted: decrypt the entry's secrets first")
        if self.host_key:
            try:
                asyncssh.import_public_key(self.host_key)
            except (asyncssh.KeyImportError, ValueError) as exc:
                raise ValueError(f"host_key is not a public key: {exc}") from None

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


#: Options an entry must give; the other strings may be left out (or None: not set).
REQUIRED_OPTIONS = ("host", "user")
#: Options that are numbers; every other one is a string.
INTEGER_OPTIONS = frozenset({"port", "max_sessions"})
NUMBER_OPTIONS = frozenset({"poll_seconds", "connect_timeout"})


def _option(name: str, value: Any) -> Any:
    """One option's value, of its field's type (TOML gives ints where a float is meant)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if name in INTEGER_OPTIONS:
        if not number or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer")
        return value
    if name in NUMBER_OPTIONS:
        if not number:
            raise ValueError(f"{name} must be a number")
        return float(value)
    if not isinstance(value, str) and not (value is None and name not in REQUIRED_OPTIONS):
        raise ValueError(f"{name} must be a string")
    return value


# -- the connection pool ----------------------------------------------------------------


class Link:
    """One SSH connection and how many of its channels are in use."""

    def __init__(self, conn: asyncssh.SSHClientConnection, capacity: int) -> None:
        self.conn = conn
        self.capacity = capacity
        self.in_use = 0
        self.spare_timer: asyncio.TimerHandle | None = None

    @property
    def closed(self) -> bool:
        return self.conn.is_closed()

    def has_room(self) -> bool:
        return not self.closed and self.in_use < self.capacity


class ConnectionPool:
    """Connections to one sshd, opened as channels need them; each carries `capacity` channels.

    A caller leases one channel's room (`acquire`) and gives it back (`release`) when its
    channel has closed. Connections are opened one at a time; a failed connect is the answer
    for every caller that was waiting on it, so a dead host costs one CONNECT_TIMEOUT, not
    one per waiting command.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncssh.SSHClientConnection]],
        capacity: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        on_lost: Callable[[Link], None] | None = None,
    ) -> None:
        self._connect = connect
        self.capacity = capacity
        self.max_connections = max_connections
        self.links: list[Link] = []
        self._on_lost = on_lost
        self._lock = asyncio.Lock()
        self._freed = asyncio.Event()
        self._failure: tuple[float, BaseException] | None = None
        self._watchers: set[asyncio.Task[None]] = set()

    def live(self) -> list[Link]:
        return [link for link in self.links if not link.closed]

    def _with_room(self) -> Link | None:
        return next((link for link in self.links if link.has_room()), None)

    async def acquire(self) -> Link:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHANNEL_WAIT_SECONDS
        while True:
            link = self._with_room()
            if link is None and len(self.live()) < self.max_connections:
                link = await self._open(loop.time())
            if link is not None:
                self._take(link)
                return link
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MachineUnavailable(
                    f"all {self.max_connections * self.capacity} channels to the host are busy "
                    f"(waited {CHANNEL_WAIT_SECONDS:g} s)"
                )
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)

    async def _open(self, asked: float) -> Link | None:
        async with self._lock:
            link = self._with_room()
            if link is not None or len(self.live()) >= self.max_connections:
                return link
            if self._failure is not None and self._failure[0] >= asked:
                # the connect this caller waited for failed: the same answer, no second wait
                raise MachineUnavailable(str(self._failure[1]))
            try:
                conn = await self._connect()
            except BaseException as exc:
                self._failure = (asyncio.get_running_loop().time(), exc)
                raise
            link = Link(conn, self.capacity)
            self.links.append(link)
            watcher = asyncio.ensure_future(self._watch(link))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            return link

    async def _watch(self, link: Link) -> None:
        await link.conn.wait_closed()
        self.discard(link)

    def _take(self, link: Link) -> None:
        link.in_use += 1
        if link.spare_timer is not None:
            link.spare_timer.cancel()
            link.spare_timer = None

    def release(self, link: Link) -> None:
        link.in_use -= 1
        self._freed.set()
        live = self.live()
        if link.in_use == 0 and live and link is not live[0] and not link.closed:
            loop = asyncio.get_running_loop()
            link.spare_timer = loop.call_later(SPARE_IDLE_SECONDS, self._close_spare, link)

    def refuse(self, link: Link) -> None:
        """The sshd refused a channel below our count: its MaxSessions is lower; believe it."""
        link.capacity = self.capacity = max(1, link.in_use - 1)

    def _close_spare(self, link: Link) -> None:
        if link.in_use == 0:
            link.conn.close()

    def discard(self, link: Link) -> None:
        """Forget a connection that dropped (or is being dropped)."""
        if link in self.links:
            self.links.remove(link)
            link.conn.close()
            if self._on_lost is not None:
                self._on_lost(link)
        self._freed.set()

    async def close(self) -> None:
        links, self.links = self.links, []
        for link in links:
            link.conn.close()
        for link in links:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.conn.wait_closed(), KILL_TIMEOUT)
        for watcher in list(self._watchers):
            watcher.cancel()
        self._failure = None


# -- one command's channel --------------------------------------------------------------


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
    """One command's session channel: the wrapper's marker, the two streams, the exit status."""

    def __init__(self, on_close: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
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
            self.started.set_exception(OSError(code, f"{errno.errorcode.get(code, 'EIO')} ({fields[2]})"))

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


def _bytes(data: bytes | str | None) -> bytes:
    return data.encode() if isinstance(data, str) else data or b""


def _same(channel: CommandChannel) -> CommandChannel:
    """The session factory asyncssh calls: the channel object made beforehand."""
    return channel


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: callers that stopped waiting must not get warnings."""
    if not fut.cancelled():
        fut.exception()


class SshProcess:
    """A `Process` on the remote host: its pid leads the command's process group there."""

    def __init__(self, machine: SshMachine, channel: CommandChannel, pid: int, argv0: str) -> None:
        self.machine = machine
        self.channel = channel
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
        self.machine.signal_group(self, sig)


# -- the machine ------------------------------------------------------------------------


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
        await self._ready()

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

    async def _ready(self) -> HostFacts:
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
        trust, keys = self._trust(), self._client_keys()
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
                    keepalive_interval=KEEPALIVE_SECONDS,
                    keepalive_count_max=KEEPALIVE_COUNT,
                )
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            raise self.unavailable(exc, o.connect_timeout) from None

    def _lost(self, link: Link) -> None:
        if self._sftp is not None and self._sftp[0] is link:
            self._sftp = None

    def unavailable(self, exc: BaseException, timeout: float | None = None) -> MachineUnavailable:
        """The one wording of every transport failure (see the module docstring's table)."""
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
        """Run `command` in the login shell, without the wrapper (it needs nothing of ours)."""
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
        facts = await self._ready()
        cwd = inside_path(facts.root, request.cwd or facts.root)
        piped = request.stdin is not None or request.interactive
        command = remote_command(cwd, request.args(), self.command_env(request), stdin=piped)
        channel = await self._open_channel(command)
        try:
            async with asyncio.timeout(CHANNEL_TIMEOUT):
                pid = await asyncio.shield(channel.started)
        except BaseException as exc:
            channel.abandon()
            if isinstance(exc, TimeoutError):
                raise self.unavailable(exc, CHANNEL_TIMEOUT) from None
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = cwd if "cwd" in str(exc) else request.args()[0]
            raise
        process = SshProcess(self, channel, pid, request.args()[0])
        self._processes.add(process)
        channel.closed.add_done_callback(lambda _: self._processes.discard(process))
        if request.stdin is not None:
            await process.write_stdin(request.stdin)
            await process.close_stdin()
        return process

    async def _open_channel(self, command: str) -> CommandChannel:
        """A session channel running `command`; retried on another connection while none opened."""
        last: BaseException | None = None
        for _attempt in range(3):
            link = await self.pool.acquire()
            self.running += 1
            channel = CommandChannel(functools.partial(self._channel_closed, link))
            try:
                async with asyncio.timeout(CHANNEL_TIMEOUT):
                    await link.conn.create_session(functools.partial(_same, channel), command, encoding=None)
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
        task = asyncio.ensure_future(self._signal_group(process, sig))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _signal_group(self, process: SshProcess, sig: int) -> None:
        name = signal.Signals(sig).name.removeprefix("SIG")
        try:
            await self._plain(f"kill -s {name} -- -{process.pid}", timeout=KILL_TIMEOUT)
        except (MachineUnavailable, OSError) as exc:
            log.warning("could not signal process group %s on %s: %s", process.pid, self.options.where, exc)
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

    async def _sftp_client(self) -> asyncssh.SFTPClient:
        await self._ready()
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
        facts = await self._ready()
        target = inside_path(facts.root, path)
        for attempt in (1, 2):
            sftp = await self._sftp_client()
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

    async def read(self, path: str, limit: int = MAX_MACHINE_READ_BYTES) -> bytes:
        """The whole file, refused (EFBIG) past `limit` bytes."""

        async def op(sftp: asyncssh.SFTPClient, target: str) -> bytes:
            async with sftp.open(target, "rb") as f:
                attrs = await f.stat()
                if attrs.permissions is not None and stat_mod.S_ISDIR(attrs.permissions):
                    raise OSError(errno.EISDIR, "is a directory", path)
                size = attrs.size or 0
                if size > limit:
                    raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
                data: bytes = await f.read(size) if size else await f.read(limit + 1)
                if len(data) > limit:
                    raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
                return data

        return await self._files(path, op, idempotent=True)

    async def write(self, path: str, data: bytes) -> None:
        """Replace the file atomically: a temp file beside it, renamed over it."""

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            old = await _lstat_or_none(sftp, target)
            if old is not None and _is_link(old):  # write where the link points, as a local write does
                target = await sftp.realpath(target)
                old = await _lstat_or_none(sftp, target)
            if old is not None and stat_mod.S_ISDIR(old.permissions or 0):
                raise OSError(errno.EISDIR, "is a directory", path)
            parent, name = posixpath.split(target)
            temp = posixpath.join(parent, f".{name}{TEMP_INFIX}{secrets.token_hex(6)}.tmp")
            try:
                async with sftp.open(temp, "xb") as f:
                    await f.write(data)
                    if old is not None:
                        await f.setstat(self._kept_attrs(old))
                await _rename(sftp, temp, target)
            except BaseException:
                with contextlib.suppress(Exception):
                    await sftp.remove(temp)
                raise

        await self._files(path, op, idempotent=True)

    def _kept_attrs(self, old: asyncssh.SFTPAttrs) -> asyncssh.SFTPAttrs:
        """The replaced file's mode, and as root its owner, for the file that replaces it."""
        attrs = asyncssh.SFTPAttrs(permissions=stat_mod.S_IMODE(old.permissions or 0o644))
        if self.facts is not None and self.facts.uid == 0 and old.uid is not None:
            attrs.uid, attrs.gid = old.uid, old.gid
        return attrs

    async def stat(self, path: str) -> FileStat | None:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> FileStat | None:
            lst = await _lstat_or_none(sftp, target)
            if lst is None:
                return None
            st = await _stat_or_none(sftp, target) if _is_link(lst) else lst
            return None if st is None else to_stat(target, st, _is_link(lst))

        return await self._files(path, op, idempotent=True)

    async def list(self, path: str) -> list[FileEntry]:
        async def op(sftp: asyncssh.SFTPClient, target: str) -> list[FileEntry]:
            names = [n async for n in sftp.scandir(target) if n.filename not in (".", "..")]
            entries = []
            for n in sorted(names, key=lambda n: str(n.filename)):
                child = posixpath.join(target, str(n.filename))
                attrs = n.attrs
                link = _is_link(attrs)
                if link:  # the target's attributes, as a local listing gives them
                    attrs = await _stat_or_none(sftp, child) or attrs
                entries.append(FileEntry(str(n.filename), child, to_stat(child, attrs, link)))
            return entries

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
                existing = await _stat_or_none(sftp, target)
                if existing is not None and stat_mod.S_ISDIR(existing.permissions or 0):
                    return
                await sftp.makedirs(target, exist_ok=True)
                return
            try:
                await sftp.mkdir(target)
            except asyncssh.SFTPFailure:  # sftp v3 says "failure" for EEXIST
                if await _lstat_or_none(sftp, target) is not None:
                    raise OSError(errno.EEXIST, "file exists", path) from None
                raise

        await self._files(path, op, idempotent=parents)

    async def rename(self, src: str, dst: str) -> None:
        facts = await self._ready()
        destination = inside_path(facts.root, dst)

        async def op(sftp: asyncssh.SFTPClient, source: str) -> None:
            await _rename(sftp, source, destination)

        await self._files(src, op, idempotent=False)

    async def chown(self, path: str, user: str) -> None:
        uid, gid = await self.owner_of(user)

        async def op(sftp: asyncssh.SFTPClient, target: str) -> None:
            await sftp.chown(target, uid, gid, follow_symlinks=False)

        await self._files(path, op, idempotent=True)

    async def owner_of(self, user: str) -> tuple[int, int]:
        """The remote uid and gid of `user`, asked of the host once (`id`)."""
        if user not in self._owners:
            code, out, _ = await self._plain(f"id -u -- {shlex.quote(user)} && id -g -- {shlex.quote(user)}")
            numbers = out.split()
            if code != 0 or len(numbers) != 2:
                raise OwnerUnsupported(f"{self.options.host} has no user {user!r}", path=None)
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
        """Changes under `path` as (event, path) pairs: `async with machine.watch(p) as w: async for ...`."""
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
        facts = await self._ready()
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


# -- SFTP helpers -----------------------------------------------------------------------

#: The errno of each SFTP status (OpenSSH's sftp-server, v3, sends the first three only).
SFTP_ERRNO: dict[type[asyncssh.SFTPError], int] = {
    asyncssh.SFTPNoSuchFile: errno.ENOENT,
    asyncssh.SFTPPermissionDenied: errno.EACCES,
    asyncssh.SFTPFailure: errno.EIO,
    asyncssh.SFTPNoSuchPath: errno.ENOENT,
    asyncssh.SFTPFileAlreadyExists: errno.EEXIST,
    asyncssh.SFTPWriteProtect: errno.EROFS,
    asyncssh.SFTPNoSpaceOnFilesystem: errno.ENOSPC,
    asyncssh.SFTPQuotaExceeded: errno.EDQUOT,
    asyncssh.SFTPDirNotEmpty: errno.ENOTEMPTY,
    asyncssh.SFTPNotADirectory: errno.ENOTDIR,
    asyncssh.SFTPInvalidFilename: errno.EINVAL,
    asyncssh.SFTPLinkLoop: errno.ELOOP,
    asyncssh.SFTPFileIsADirectory: errno.EISDIR,
    asyncssh.SFTPOpUnsupported: errno.EOPNOTSUPP,
}


def sftp_os_error(exc: asyncssh.SFTPError, path: str) -> OSError:
    code = next((n for kind, n in SFTP_ERRNO.items() if isinstance(exc, kind)), errno.EIO)
    return OSError(code, exc.reason or errno.errorcode.get(code, "EIO"), path)


def _is_link(attrs: asyncssh.SFTPAttrs) -> bool:
    return attrs.permissions is not None and stat_mod.S_ISLNK(attrs.permissions)


async def _lstat_or_none(sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs | None:
    try:
        return await sftp.lstat(path)
    except asyncssh.SFTPNoSuchFile:
        return None


async def _stat_or_none(sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs | None:
    try:
        return await sftp.stat(path)
    except asyncssh.SFTPNoSuchFile:
        return None


async def _rename(sftp: asyncssh.SFTPClient, src: str, dst: str) -> None:
    """Rename over `dst` atomically (OpenSSH's posix-rename), else a plain SFTP rename."""
    try:
        await sftp.posix_rename(src, dst)
    except asyncssh.SFTPOpUnsupported:
        await sftp.rename(src, dst)


def to_stat(path: str, attrs: asyncssh.SFTPAttrs, is_symlink: bool = False) -> FileStat:
    mode = attrs.permissions or 0
    return FileStat(
        path=path,
        is_dir=stat_mod.S_ISDIR(mode),
        is_file=stat_mod.S_ISREG(mode),
        is_symlink=is_symlink,
        size=attrs.size or 0,
        mtime=float(attrs.mtime or 0),
        mode=stat_mod.S_IMODE(mode),
        uid=attrs.uid if attrs.uid is not None else -1,
        gid=attrs.gid if attrs.gid is not None else -1,
        inode=0,
    )


# -- watching ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Seen:
    kind: str
    size: int
    mtime: str
    mode: str


class RemoteWatch:
    """Changes under one remote path, as (event, path): create, write, remove, chmod.

    A move shows as `remove` of the old path and `create` of the new. `overflow` (with the
    watched path) says changes were dropped for a slow reader: rescan. With inotifywait,
    a directory made under a recursive watch is scanned when it appears, so what was put
    in it before its watch was added is reported as `create` too. A dropped connection
    ends the iteration with `MachineUnavailable`.
    """

    def __init__(self, machine: SshMachine, path: str, recursive: bool) -> None:
        self.machine = machine
        self.path = path
        self.recursive = recursive
        self.kind = ""
        self.target = ""
        self._queue: asyncio.Queue[tuple[str, str] | BaseException] = asyncio.Queue()
        self._overflowed = False
        self._task: asyncio.Task[None] | None = None
        self._process: SshProcess | None = None
        self._scanned: dict[str, float] = {}

    async def __aenter__(self) -> RemoteWatch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> RemoteWatch:
        return self

    async def __anext__(self) -> tuple[str, str]:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later call ends the same way
            raise item
        if self._queue.empty():
            self._overflowed = False
        return item

    async def start(self) -> None:
        """Begin watching: changes from here on are reported."""
        facts = await self.machine._ready()
        self.target = inside_path(facts.root, self.path)
        if await self.machine.stat(self.target) is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", self.path)
        self.kind = self.machine.watch_kind()
        if self.kind == "inotifywait":
            if facts.inotifywait is None:
                raise MachineUnavailable(f"{self.machine.options.host} has no inotifywait (inotify-tools)")
            await self._start_inotify(facts.inotifywait)
        else:
            if not facts.gnu_find:
                raise MachineUnavailable(f"{self.machine.options.host} has no GNU find to poll with")
            self._task = asyncio.ensure_future(self._poll(await self._snapshot()))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._process is not None and not self._process.channel.exited.done():
            self._process.kill()

    def _emit(self, event: str, path: str) -> None:
        if self._queue.qsize() >= MAX_QUEUED_CHANGES:
            if not self._overflowed:
                self._overflowed = True
                self._queue.put_nowait(("overflow", self.target))
            return
        self._queue.put_nowait((event, path))

    # inotifywait

    async def _start_inotify(self, binary: str) -> None:
        events = ",".join(sorted({e.lower() for e in INOTIFY_EVENTS}))
        argv = [binary, "-m", *(["-r"] if self.recursive else []), "-e", events]
        argv += ["--format", "%e %w%f%0", "--no-newline", "--", self.target]
        process = await self.machine.spawn(ExecRequest(argv=tuple(argv), cwd="/"))
        self._process = process
        said = b""
        try:
            async with asyncio.timeout(WATCH_SETUP_TIMEOUT):
                while b"Watches established" not in said:
                    chunk = await process.stderr.read(4096)
                    if not chunk:
                        await process.wait()
                        raise inotify_error(said.decode(errors="replace"), self.path)
                    said += chunk
        except BaseException:
            process.kill()
            raise
        self._task = asyncio.ensure_future(self._read_inotify(process))

    async def _read_inotify(self, process: SshProcess) -> None:
        pending = b""
        try:
            while chunk := await process.stdout.read(65536):
                pending += chunk
                *records, pending = pending.split(b"\0")
                for record in records:
                    flags, _, path = record.decode(errors="surrogateescape").partition(" ")
                    await self._inotify_event(flags.split(","), path.rstrip("/") or path)
            await process.wait()
            self._queue.put_nowait(MachineUnavailable(f"the watch on {self.target} ended"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait(exc)

    async def _inotify_event(self, flags: list[str], path: str) -> None:
        event = next((INOTIFY_EVENTS[f] for f in flags if f in INOTIFY_EVENTS), None)
        if event is None:
            return
        now = time.monotonic()
        if event == "create" and self._scanned.pop(path, 0) > now - 5:
            return  # the scan of its new parent reported it already
        self._emit(event, path)
        if event == "create" and "ISDIR" in flags and self.recursive:
            if len(self._scanned) > MAX_QUEUED_CHANGES:
                self._scanned.clear()
            for child in await self._scan(path):
                self._scanned[child] = now
                self._emit("create", child)

    async def _scan(self, path: str) -> list[str]:
        """What is already in a directory that just appeared (its watch came after)."""
        try:
            found = await self.machine.run(("find", path, "-mindepth", "1", "-print0"))
        except (MachineUnavailable, OSError):
            return []
        return [p for p in found.stdout.decode(errors="surrogateescape").split("\0") if p]

    # polling

    async def _snapshot(self) -> dict[str, _Seen]:
        depth = [] if self.recursive else ["-maxdepth", "1"]
        argv = ("find", self.target, *depth, "-printf", "%y %s %T@ %m %p\\0")
        process = await self.machine.spawn(ExecRequest(argv=argv, cwd="/"))
        seen: dict[str, _Seen] = {}
        pending = b""
        try:
            while chunk := await process.stdout.read(65536):
                pending += chunk
                *records, pending = pending.split(b"\0")
                for record in records:
                    kind, size, mtime, mode, path = record.decode(errors="surrogateescape").split(" ", 4)
                    if len(seen) < MAX_POLL_ENTRIES:
                        seen[path] = _Seen(kind, int(size), mtime, mode)
            await process.wait()
        finally:
            if not process.channel.exited.done():
                process.kill()
        return seen

    async def _poll(self, old: dict[str, _Seen]) -> None:
        try:
            while True:
                await asyncio.sleep(self.machine.options.poll_seconds)
                new = await self._snapshot()
                for event, path in changes(old, new):
                    self._emit(event, path)
                old = new
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait(exc)


def changes(old: dict[str, _Seen], new: dict[str, _Seen]) -> list[tuple[str, str]]:
    """The events between two scans. A directory's own times move with its entries: not reported."""
    out = [("remove", p) for p in sorted(old.keys() - new.keys(), reverse=True)]
    out += [("create", p) for p in sorted(new.keys() - old.keys())]
    for p in sorted(old.keys() & new.keys()):
        a, b = old[p], new[p]
        if a.kind == b.kind == "d":
            if a.mode != b.mode:
                out.append(("chmod", p))
        elif (a.kind, a.size, a.mtime) != (b.kind, b.size, b.mtime):
            out.append(("write", p))
        elif a.mode != b.mode:
            out.append(("chmod", p))
    return out


def inotify_error(said: str, path: str) -> OSError:
    if "No such file" in said:
        return FileNotFoundError(errno.ENOENT, "no such file or directory", path)
    if "upper limit" in said:
        return OSError(errno.ENOSPC, "the host's inotify watch limit is reached", path)
    return OSError(errno.EIO, said.strip() or "inotifywait failed", path)
