"""The `e2b` kind: one E2B sandbox per session, through the `e2b` SDK's async client.

The sandbox is E2B's (its cloud, with an API key) or any E2B-compatible endpoint's (an
agentbox server's own, `agentbox.e2b`): its files are not host files, so every operation
goes through envd, the daemon in the sandbox, and everything above `machines/` reaches them
through `file_ops(machine)` -> `RemoteOps`, as for the ssh kind.

    [machines.cloud]
    kind = "e2b"
    api_key = "e2b_..."          # stored encrypted; or api_key_env = "E2B_API_KEY" (the default)
    domain = "e2b.app"           # E2B's cloud; or, for a self-hosted endpoint:
    # api_url = "http://10.0.0.5:8080"       # its control plane
    # sandbox_url = "http://10.0.0.5:8080"   # its envd (one URL for every sandbox)
    template = "base"
    timeout = 3600               # seconds the sandbox outlives a silent agentbox
    root = "/home/user"          # the working directory (created at start)
    user = "user"                # whom envd runs commands as ("root" for helpers)
    on_stop = "pause"            # idle: "pause" (files kept) or "kill" (a new sandbox next time)

Lifetime. `start` creates the sandbox with the session, machine and instance ids in its
metadata, or, when it had one, connects to it again (resuming a paused one); after a
restart the session's marker names the sandbox (`marker()`), and if it does not, the
sandbox is found by its metadata. While running, the sandbox's E2B timeout is pushed back
every REFRESH_FRACTION of `timeout`, so it ends by itself only when agentbox stops caring.
`stop` (the registry's idle reclaim) pauses it (or kills it, `on_stop = "kill"`), `destroy`
(the session closed) kills it, `close` (the server stopping) leaves it running until its
timeout, for the next server to connect to.

Commands. Each is one envd process running `/bin/sh -c` the same command line as the ssh
kind's (`ssh.channel.remote_command`): it checks the cwd and argv[0] (a failure is the
OSError a local spawn would raise), prints a pid marker, and execs `env -i VAR=VALUE...
ARGV...`, so the environment is exactly `command_env`. Output arrives as envd's data events,
byte for byte. A signal is `kill` run in the sandbox against the marked pid's group (what
the command started goes with it), and SIGKILL and SIGTERM go through envd's SendSignal too.

Files. envd's filesystem API where it has the operation (Stat, ListDir, MakeDir, Move,
Remove, WatchDir) and its `/files` for bytes; a write uploads a temp file beside the target
and moves it over it (the old file's mode kept); `create` uploads a temp file and hard-links
it to the name (`ln`, which refuses an existing name, a dangling link too); chown, readlink,
symlink, ranged reads and user ids are commands in the sandbox (helpers run as root). envd
reports owners by name and no inode: `FileStat.inode` is 0, and `uid`/`gid` of a name other
than root or a number are looked up in the sandbox once.

Every way a call fails: `MachineUnavailable` when the endpoint cannot be reached, refuses
the key, has no such sandbox any more, or the SDK is not installed (`agentbox[e2b]`);
`OwnerUnsupported` for a chown to a user the sandbox does not have; a file operation's own
failure is the OSError of its errno (ENOENT, EEXIST, ENOTDIR, EISDIR, ENOTEMPTY, EFBIG).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import dataclasses
import errno
import logging
import os
import posixpath
import secrets
import signal
import stat as stat_mod
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from agentbox.machines.base import (
    DEFAULT_OUTPUT_LIMIT,
    MAX_MACHINE_READ_BYTES,
    OS,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileStat,
    WatchChange,
    collect,
    inside_path,
)
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.local import BASE_PATH
from agentbox.machines.ssh.channel import MARKER, remote_command
from agentbox.secrets import is_encrypted

if TYPE_CHECKING:
    from e2b import AsyncSandbox

log = logging.getLogger(__name__)

#: The extra that installs the SDK, named in the refusal when it is missing.
EXTRA = "agentbox[e2b]"
#: The sandbox's lifetime on its endpoint without agentbox's refreshes, in seconds.
DEFAULT_TIMEOUT_SECONDS = 3600
#: The refreshes push the end back every this share of `timeout`.
REFRESH_FRACTION = 0.5
#: The working directory when the entry names none: the home of E2B's default user.
DEFAULT_ROOT = "/home/user"
DEFAULT_USER = "user"
DEFAULT_TEMPLATE = "base"
#: Where the API key is read from when the entry gives none.
DEFAULT_API_KEY_ENV = "E2B_API_KEY"
#: Seconds one request to the control plane or to envd may take.
REQUEST_TIMEOUT = 60.0
#: Seconds a command's process may take to report its pid.
START_TIMEOUT = 30.0
#: Seconds a helper command of the machine's own (probe, chown, ln, kill) may take.
HELPER_TIMEOUT = 60.0
#: Bytes one SendInput carries at most.
STDIN_CHUNK = 64 * 1024
#: The line limit of a command's output streams (envd sends output as it comes: there is no
#: back-pressure to the sandbox, so a reader must keep reading, as `collect` does).
STREAM_BUFFER = 1 << 20
#: Bytes of output kept while looking for the pid marker.
MAX_PREAMBLE_BYTES = 64 * 1024
#: Between a file's name and the random part of the temp file a write goes through.
TEMP_INFIX = ".agentbox-"
#: Seconds envd's RENAME of an old name waits for the CREATE of the new one (one rename).
MOVE_PAIR_SECONDS = 0.05
#: Changes a watch queues for a slow reader before it reports `overflow` and drops.
MAX_QUEUED_CHANGES = 10_000
#: What envd answers for the stdin of a process that has ended (or has none): not found, or
#: an invalid argument.
STDIN_GONE = frozenset({errno.ENOENT, errno.EINVAL})
#: The user helpers run as: chown and a look at any file need it.
HELPER_USER = "root"
#: Exit codes of the helper scripts that name an errno (127 is taken by remote_command).
ERRNO_EXIT = {errno.ENOENT: 2, errno.EEXIST: 17, errno.EINVAL: 22, errno.ENOTDIR: 20}
#: What a signal is called in Go's `ProcessState.String()` (envd's end status), by number.
SIGNAL_WORDS = {(signal.strsignal(s) or "").lower(): int(s) for s in signal.Signals if signal.strsignal(s)}

# What the first start learns about the sandbox, as root; $1 = the root, $2 = the user. A root
# that is not there is made, and given to the user.
PROBE = r"""[ -d "$1" ] || { mkdir -p -- "$1" && chown -- "$2" "$1"; } || exit 1
printf 'home=%s\n' "$(getent passwd "$2" | cut -d: -f6)"
printf 'uid=%s\n' "$(id -u -- "$2")"
printf 'gid=%s\n' "$(id -g -- "$2")"
printf 'os=%s\n' "$(uname -s)"
for t in rg grep inotifywait; do printf '%s=%s\n' "$t" "$(command -v "$t")"; done
exit 0
"""


def sdk() -> Any:
    """The `e2b` package, or a refusal that names the extra to install."""
    try:
        import e2b
    except ImportError:
        raise MachineUnavailable(
            f"the e2b machine kind needs the e2b SDK: install {EXTRA} (pip install '{EXTRA}')"
        ) from None
    return e2b


@dataclass(frozen=True)
class E2BOptions:
    """A `[machines.<name>]` entry of kind `e2b` (see the module docstring)."""

    api_key: str | None = None
    """The endpoint's API key (a secret field: stored encrypted)."""
    api_key_env: str = DEFAULT_API_KEY_ENV
    """The server's environment variable the key is read from when `api_key` is not set."""
    domain: str | None = None
    """E2B's domain (`e2b.app`): the SDK's default endpoints under it."""
    api_url: str | None = None
    """The control plane's URL (an E2B-compatible endpoint); default: E2B's under `domain`."""
    sandbox_url: str | None = None
    """envd's URL for every sandbox (an E2B-compatible endpoint routing by `E2b-Sandbox-Id`)."""
    template: str = DEFAULT_TEMPLATE
    """The template (an agentbox endpoint: its image) the sandbox is made from."""
    timeout: int = DEFAULT_TIMEOUT_SECONDS
    """Seconds the sandbox lives past agentbox's last refresh (agentbox refreshes it while running)."""
    root: str = DEFAULT_ROOT
    """The working directory: absolute, made at start."""
    user: str = DEFAULT_USER
    """The sandbox user commands run as and files are written as."""
    on_stop: Literal["pause", "kill"] = "pause"
    """What an idle stop does: pause (the sandbox's files kept) or kill (a new one next start)."""
    network: str = "on"
    """"off": the sandbox is created without internet access."""
    memory_mb: int = 0
    """What the sandbox counts against the server's `max_sandbox_memory_mb`, as a sandbox's
    limit does (unset: the registry's default; 0: not counted, the memory being E2B's)."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> E2BOptions:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) for an e2b machine: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for key, value in options.items():
            if key in ("timeout", "memory_mb"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{key} must be an integer")
            elif key == "network":
                value = "on" if value is True or str(value).lower() in ("on", "true", "1") else "off"
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{key} must be a string")
            values[key] = value
        made = cls(**values)
        if made.timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if not made.root.startswith("/"):
            raise ValueError("root must be an absolute path")
        if made.on_stop not in ("pause", "kill"):
            raise ValueError(f"on_stop must be pause or kill, not {made.on_stop!r}")
        return made

    def api_params(self) -> dict[str, Any]:
        """The SDK's connection parameters (`ApiParams`) of this entry. A key still encrypted
        (an entry described, not opened, keeps its secrets sealed) cannot be used."""
        if is_encrypted(self.api_key):
            raise MachineUnavailable("api_key is still encrypted: decrypt the entry's secrets first")
        key = self.api_key or os.environ.get(self.api_key_env) or None
        given = {"api_key": key, "domain": self.domain, "api_url": self.api_url,
                 "sandbox_url": self.sandbox_url}  # fmt: skip
        return {"request_timeout": REQUEST_TIMEOUT, **{k: v for k, v in given.items() if v}}

    @property
    def where(self) -> str:
        return self.api_url or self.domain or "E2B's cloud"


@dataclass
class SandboxFacts:
    """What the first command in the sandbox learned."""

    home: str
    uid: int
    gid: int
    os: OS
    programs: dict[str, str | None]


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


class E2BMachine:
    """One E2B sandbox of one session (see the module docstring)."""

    kind = "e2b"
    isolated = True

    def __init__(
        self,
        name: str,
        instance_id: str,
        options: E2BOptions,
        env: dict[str, str] | None = None,
        *,
        session_id: str | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        self.name = name
        self.instance_id = instance_id
        self.options = options
        self.env = dict(env or {})
        self.session_id = session_id
        self.sandbox_id = sandbox_id
        """The E2B sandbox's id: known once created, recorded in the session's marker."""
        self.os: OS = "linux"
        self.root = options.root
        self.network_on = options.network == "on"
        self.state = "stopped"
        self.last_used = time.monotonic()
        self.facts: SandboxFacts | None = None
        self.sandbox: AsyncSandbox | None = None
        self._process_rpc: Any = None
        self._files_rpc: Any = None
        self._processes: set[E2BProcess] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._owners: dict[str, tuple[int, int]] = {"root": (0, 0)}
        self._lock = asyncio.Lock()
        self._closed = False

    # lifecycle --------------------------------------------------------------------------

    def metadata(self) -> dict[str, str]:
        """What the sandbox carries on its endpoint, so a restarted server can find it."""
        return {
            "agentbox_machine": self.name,
            "agentbox_instance": self.instance_id,
            "agentbox_session": self.session_id or "",
        }

    async def start(self) -> None:
        """Connect to this machine's sandbox (resuming it), or create it; then learn it."""
        async with self._lock:
            if self._closed:
                raise MachineUnavailable(f"machine {self.name!r} is closed")
            if self.state == "running" and self.sandbox is not None:
                return
            e2b = sdk()
            try:
                sandbox = await self._reconnect(e2b) or await self._create(e2b)
            except MachineUnavailable:
                raise
            except Exception as exc:
                raise self.unavailable(exc, e2b.exceptions) from None
            self._attach(sandbox)
            self.state = "running"
            try:
                self.facts = await self._probe()
            except BaseException:
                self._detach()
                raise
            self.os = self.facts.os
            self.last_used = time.monotonic()
            self._refresher = asyncio.ensure_future(self._refresh())

    async def _reconnect(self, e2b: Any) -> AsyncSandbox | None:
        """The sandbox this machine had (the marker's, else the one its metadata names), running
        again; None when there is none any more."""
        params = self.options.api_params()
        sandbox_id = self.sandbox_id
        if sandbox_id is None:
            query = e2b.SandboxQuery(metadata={"agentbox_instance": self.instance_id})
            found = await e2b.AsyncSandbox.list(query=query, **params).next_items()
            sandbox_id = found[0].sandbox_id if found else None
        if sandbox_id is None:
            return None
        try:
            sandbox: AsyncSandbox = await e2b.AsyncSandbox.connect(
                sandbox_id, timeout=self.options.timeout, **params
            )
        except e2b.exceptions.NotFoundException:
            log.info("e2b sandbox %s of machine %s is gone: a new one is made", sandbox_id, self.name)
            self.sandbox_id = None
            return None
        return sandbox

    async def _create(self, e2b: Any) -> AsyncSandbox:
        sandbox: AsyncSandbox = await e2b.AsyncSandbox.create(
            template=self.options.template,
            timeout=self.options.timeout,
            metadata=self.metadata(),
            allow_internet_access=self.network_on,
            **self.options.api_params(),
        )
        return sandbox

    def _attach(self, sandbox: AsyncSandbox) -> None:
        from e2b.envd.client_async import create_rpc_client
        from e2b.envd.filesystem import filesystem_connect
        from e2b.envd.process import process_connect

        self.sandbox = sandbox
        self.sandbox_id = sandbox.sandbox_id
        url, config = sandbox.envd_api_url, sandbox.connection_config
        self._process_rpc = create_rpc_client(process_connect.ProcessClient, url, config)
        self._files_rpc = create_rpc_client(filesystem_connect.FilesystemClient, url, config)

    async def _probe(self) -> SandboxFacts:
        result = await self.run(("/bin/sh", "-c", PROBE, "sh", self.root, self.options.user), cwd="/")
        if result.exit_code != 0:
            said = result.stderr.decode(errors="replace").strip()
            raise MachineUnavailable(f"the sandbox could not make its root {self.root}: {said}")
        facts = dict(
            line.split("=", 1) for line in result.stdout.decode(errors="replace").splitlines() if "=" in line
        )
        os_name = facts.get("os", "Linux").lower()
        return SandboxFacts(
            home=facts.get("home") or "/",
            uid=int(facts.get("uid") or 0),
            gid=int(facts.get("gid") or 0),
            os="darwin" if os_name == "darwin" else "linux",
            programs={t: facts.get(t) or None for t in ("rg", "grep", "inotifywait")},
        )

    async def _refresh(self) -> None:
        """Push the sandbox's end back while it runs: it ends by itself only without agentbox."""
        period = max(self.options.timeout * REFRESH_FRACTION, 1.0)
        while True:
            await asyncio.sleep(period)
            sandbox = self.sandbox
            if sandbox is None:
                return
            try:
                await sandbox.set_timeout(self.options.timeout)
            except Exception as exc:
                log.warning("could not refresh e2b sandbox %s: %s", self.sandbox_id, exc)

    async def stop(self) -> None:
        """Idle: pause the sandbox (or kill it, `on_stop = "kill"`); the next start resumes it."""
        async with self._lock:
            sandbox = self._detach()
            if sandbox is None:
                return
            try:
                if self.options.on_stop == "kill":
                    await sandbox.kill()
                    self.sandbox_id = None
                else:
                    await sandbox.pause()
            except Exception as exc:
                log.warning("could not %s e2b sandbox %s: %s", self.options.on_stop, self.sandbox_id, exc)

    async def destroy(self) -> None:
        """The session is closed: kill the sandbox (a paused one too, without resuming it)."""
        async with self._lock:
            sandbox = self._detach()
            try:
                if sandbox is not None:
                    await sandbox.kill()
                elif self.sandbox_id is not None:
                    await sdk().AsyncSandbox.kill(self.sandbox_id, **self.options.api_params())
            except Exception as exc:
                log.warning("could not kill e2b sandbox %s: %s", self.sandbox_id, exc)
            self.sandbox_id = None
            self._closed = True

    async def close(self) -> None:
        """The server stops: let go of the sandbox, which runs on until its timeout (the next
        server connects to it through the session's marker)."""
        async with self._lock:
            self._detach()
            self._closed = True

    def _detach(self) -> AsyncSandbox | None:
        """Stop the refreshes and what was pumping; the sandbox this machine held."""
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        for process in list(self._processes):
            process.abandon()
        sandbox, self.sandbox = self.sandbox, None
        self.state = "stopped"
        return sandbox

    def busy(self) -> bool:
        return bool(self._processes)

    def marker(self) -> dict[str, Any]:
        """The E2B sandbox's id, so a restarted server connects to it instead of making another."""
        return {"e2b_sandbox_id": self.sandbox_id, "endpoint": self.options.where}

    def capabilities(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "isolation": "e2b",
            "transport": "e2b envd (Connect RPC and /files)",
            "endpoint": self.options.where,
            "sandbox_id": self.sandbox_id,
            "template": self.options.template,
            "root": self.root,
            "user": self.options.user,
            "on_stop": self.options.on_stop,
            "timeout_seconds": self.options.timeout,
            "watch": self.watch_kind(),
            "grep": "not known until started" if facts is None else "rg" if facts.programs["rg"] else "grep",
            "network": self.options.network,
        }

    def unavailable(self, exc: BaseException, errors: Any = None) -> MachineUnavailable:
        """A failure of the endpoint (or of the way to it) as the machine's own."""
        if errors is not None and isinstance(exc, errors.AuthenticationException):
            return MachineUnavailable(f"{self.options.where} refused the API key: {exc}")
        return MachineUnavailable(
            f"the e2b sandbox {self.sandbox_id or ''} at {self.options.where} failed: {exc}"
        )

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        user = self.options.user
        home = self.facts.home if self.facts is not None else DEFAULT_ROOT
        return {
            "PATH": BASE_PATH,
            "HOME": home,
            "USER": user,
            "LOGNAME": user,
            "LANG": "C.UTF-8",
            **self.env,
            **request.env,
        }

    # commands -----------------------------------------------------------------------------

    def _running(self) -> AsyncSandbox:
        if self._closed:
            raise MachineUnavailable(f"machine {self.name!r} is closed")
        if self.sandbox is None or self.state != "running":
            raise MachineUnavailable(f"the e2b sandbox of machine {self.name!r} is not running")
        self.last_used = time.monotonic()
        return self.sandbox

    def _headers(self, user: str | None = None) -> dict[str, str]:
        from e2b.connection_config import KEEPALIVE_PING_HEADER, KEEPALIVE_PING_INTERVAL_SEC

        basic = base64.b64encode(f"{user or self.options.user}:".encode()).decode()
        return {"Authorization": f"Basic {basic}", KEEPALIVE_PING_HEADER: str(KEEPALIVE_PING_INTERVAL_SEC)}

    async def spawn(self, request: ExecRequest, *, user: str | None = None) -> E2BProcess:
        from e2b.envd.process import process_pb

        self._running()
        cwd = inside_path(self.root, request.cwd or self.root)
        piped = request.stdin is not None or request.interactive
        line = remote_command(cwd, request.args(), self.command_env(request), stdin=piped)
        start = process_pb.StartRequest(
            process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", line], envs={}, cwd="/"),
            stdin=piped,
        )
        events = self._process_rpc.start(start, headers=self._headers(user))
        process = E2BProcess(self, events, request.args()[0], {"cwd": cwd, "exec": request.args()[0]})
        self._processes.add(process)
        process.begin()
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await asyncio.shield(process.started)
        except BaseException as exc:
            process.abandon()
            if isinstance(exc, TimeoutError):
                raise MachineUnavailable(f"the command did not start within {START_TIMEOUT:g} s") from None
            raise
        if request.stdin is not None:
            await process.write_stdin(request.stdin)
            await process.close_stdin()
        return process

    def ended(self, process: E2BProcess) -> None:
        self._processes.discard(process)
        self.last_used = time.monotonic()

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result

    async def run(
        self,
        argv: tuple[str, ...],
        *,
        cwd: str = "/",
        stdin: bytes | None = None,
        limit: int | None = None,
        user: str = HELPER_USER,
    ) -> ExecResult:
        """A helper command of the machine's own (as root unless `user` says otherwise)."""
        request = ExecRequest(
            argv=argv,
            cwd=cwd,
            stdin=stdin,
            timeout=HELPER_TIMEOUT,
            output_limit=limit or DEFAULT_OUTPUT_LIMIT,
        )
        process = await self.spawn(request, user=user)
        return await collect(process, request.output_limit, request.timeout)

    async def send_input(self, pid: int, data: bytes) -> None:
        from e2b.envd.process import process_pb

        await self._rpc_call(
            self._process_rpc.send_input,
            process_pb.SendInputRequest(
                process=process_pb.ProcessSelector(selector=oneof("pid", pid)),
                input=process_pb.ProcessInput(input=oneof("stdin", data)),
            ),
        )

    async def close_input(self, pid: int) -> None:
        from e2b.envd.process import process_pb

        await self._rpc_call(
            self._process_rpc.close_stdin,
            process_pb.CloseStdinRequest(process=process_pb.ProcessSelector(selector=oneof("pid", pid))),
        )

    def signal(self, process: E2BProcess, sig: int) -> None:
        task = asyncio.ensure_future(self._signal(process, sig))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signal(self, process: E2BProcess, sig: int) -> None:
        from e2b.envd.process import process_pb

        envd = {
            int(signal.SIGKILL): process_pb.Signal.SIGKILL,
            int(signal.SIGTERM): process_pb.Signal.SIGTERM,
        }
        name = signal.Signals(sig).name.removeprefix("SIG")
        script = 'kill -s "$1" -- "-$2" 2>/dev/null || kill -s "$1" -- "$2"'
        try:
            # The command's group (what it started too), whatever envd's own signal reaches.
            await self.run(("/bin/sh", "-c", script, "sh", name, str(process.pid)))
            if sig in envd and not process.exited.done():
                request = process_pb.SendSignalRequest(
                    process=process_pb.ProcessSelector(selector=oneof("pid", process.envd_pid)),
                    signal=envd[sig],
                )
                with contextlib.suppress(FileNotFoundError):  # it ended meanwhile
                    await self._rpc_call(self._process_rpc.send_signal, request)
        except (MachineUnavailable, OSError) as exc:
            log.warning(
                "could not signal process %s in e2b sandbox %s: %s", process.pid, self.sandbox_id, exc
            )

    async def _rpc_call(self, method: Any, request: Any, path: str | None = None) -> Any:
        """One unary envd call, its failure as an OSError of its errno or MachineUnavailable."""
        from connectrpc.errors import ConnectError

        self._running()
        try:
            return await method(request, timeout_ms=int(REQUEST_TIMEOUT * 1000))
        except ConnectError as exc:
            raise connect_error(exc, path, self) from None

    # files --------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return inside_path(self.root, path)

    async def stat(self, path: str) -> FileStat | None:
        """What `path` leads to (a link: its target's attributes, `is_symlink` set); None when
        nothing is there or the link leads nowhere."""
        target = self._path(path)
        entry = await self._entry(target)
        if entry is None:
            return None
        return await self._link_stat(target) if old_style_link(entry) else await self._to_stat(entry)

    async def _entry(self, target: str) -> Any | None:
        from e2b.envd.filesystem import filesystem_pb

        try:
            response = await self._rpc_call(
                self._files_rpc.stat, filesystem_pb.StatRequest(path=target), target
            )
        except FileNotFoundError:
            return None
        return response.entry

    async def _to_stat(self, entry: Any) -> FileStat:
        from e2b.envd.filesystem import filesystem_pb

        kind = entry.type
        letter = (entry.permissions or "-")[:1]
        is_dir = kind == filesystem_pb.FileType.DIRECTORY
        is_file = kind == filesystem_pb.FileType.FILE and letter == "-"
        uid = await self._owner_id(entry.owner, 0)
        gid = await self._owner_id(entry.group, 1)
        mtime = entry.modified_time
        return FileStat(
            path=entry.path,
            is_dir=is_dir,
            is_file=is_file,
            is_symlink=bool(entry.is_symlink) or kind == filesystem_pb.FileType.SYMLINK,
            size=int(entry.size),
            mtime=(mtime.seconds + mtime.nanos / 1e9) if mtime is not None else 0.0,
            mode=stat_mod.S_IMODE(int(entry.mode)),
            uid=uid,
            gid=gid,
            inode=0,
        )

    async def _owner_id(self, name: str, which: int) -> int:
        """A uid (which=0) or gid (1) from envd's owner name."""
        if not name or name.isdigit():
            return int(name or 0)
        if name not in self._owners:
            try:
                self._owners[name] = await self.user_ids(name)
            except (OwnerUnsupported, MachineUnavailable, OSError):
                return 0
        return self._owners[name][which]

    async def list(self, path: str) -> builtins.list[FileEntry]:
        from e2b.envd.filesystem import filesystem_pb

        target = self._path(path)
        await self._require_dir(target, path)
        response = await self._rpc_call(
            self._files_rpc.list_dir, filesystem_pb.ListDirRequest(path=target, depth=1), path
        )
        entries = sorted(response.entries, key=lambda e: e.name)
        stats = await asyncio.gather(*(self._listed(target, e) for e in entries))
        return [
            FileEntry(e.name, posixpath.join(target, e.name), st)
            for e, st in zip(entries, stats, strict=True)
        ]

    async def _listed(self, parent: str, entry: Any) -> FileStat:
        """A listed entry's stat; a link's is its target's, as a local listing gives it."""
        path = posixpath.join(parent, entry.name)
        if old_style_link(entry):
            followed = await self._link_stat(path)
            if followed is not None:
                return followed
        return dataclasses.replace(await self._to_stat(entry), path=path)

    async def _link_stat(self, path: str) -> FileStat | None:
        """What a link leads to, asked of the sandbox (envd that says SYMLINK for a link's type
        tells nothing of its target); None when it leads nowhere."""
        result = await self.run(("stat", "-L", "-c", "%f %s %Y %u %g", "--", path))
        parts = result.stdout.split()
        if result.exit_code != 0 or len(parts) != 5:
            return None
        mode = int(parts[0], 16)
        return FileStat(
            path=path, is_dir=stat_mod.S_ISDIR(mode), is_file=stat_mod.S_ISREG(mode), is_symlink=True,
            size=int(parts[1]), mtime=float(parts[2]), mode=stat_mod.S_IMODE(mode),
            uid=int(parts[3]), gid=int(parts[4]), inode=0,
        )  # fmt: skip

    async def _require_dir(self, target: str, path: str) -> FileStat:
        st = await self.stat(target)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if not st.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return st

    async def read(
        self, path: str, *, offset: int = 0, length: int | None = None, limit: int = MAX_MACHINE_READ_BYTES
    ) -> bytes:
        """`length` bytes from `offset`, or the rest of the file, refused (EFBIG) past `limit`."""
        target = self._path(path)
        st = await self.stat(target)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if st.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if length is None and max(st.size - offset, 0) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        want = limit + 1 if length is None else length
        if offset > 0:
            data = await self._read_range(target, path, offset, want)
        else:
            data = await self._download(target, path, want)
        if length is None and len(data) > limit:  # it grew since the stat
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        return data

    async def _download(self, target: str, path: str, want: int) -> bytes:
        """The file's first `want` bytes through envd's `/files`, the rest left unread."""
        e2b = sdk()
        sandbox = self._running()
        parts: builtins.list[bytes] = []
        got = 0
        try:
            reader = await sandbox.files.read(target, format="stream", user=HELPER_USER)
            try:
                async for chunk in reader:
                    parts.append(bytes(chunk[: want - got]))
                    got += len(parts[-1])
                    if got >= want:
                        break
            finally:
                await reader.aclose()
        except e2b.exceptions.NotFoundException:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        except Exception as exc:
            raise self._files_error(exc, path) from None
        return b"".join(parts)

    async def _read_range(self, target: str, path: str, offset: int, length: int) -> bytes:
        """Bytes from `offset` by a command in the sandbox (envd's `/files` reads from the start)."""
        script = 'tail -c "+$(($2 + 1))" -- "$1" | head -c "$3"'
        result = await self.run(("/bin/sh", "-c", script, "sh", target, str(offset), str(length)),
                                limit=length)  # fmt: skip
        if result.exit_code != 0:
            raise OSError(errno.EIO, result.stderr.decode(errors="replace").strip(), path)
        return result.stdout

    def _files_error(self, exc: BaseException, path: str) -> BaseException:
        if isinstance(exc, OSError | MachineUnavailable):
            return exc
        e2b = sdk()
        if isinstance(exc, e2b.exceptions.NotFoundException):
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if isinstance(exc, e2b.exceptions.NotEnoughSpaceException):
            return OSError(errno.ENOSPC, str(exc), path)
        return self.unavailable(exc, e2b.exceptions)

    async def write(self, path: str, data: bytes) -> None:
        """Replace the file atomically: a temp file beside it, moved over it."""

        async def body() -> AsyncIterator[bytes]:
            yield data

        await self.write_stream(path, body(), limit=len(data))

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """`write` from chunks as they arrive; nothing replaces the target before the last one."""
        target = self._path(path)
        old = await self.stat(target)
        if old is not None and old.is_symlink:  # write where the link points, as a local write does
            target = await self._realpath(target, path)
            old = await self.stat(target)
        if old is not None and old.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        temp = await self._upload_temp(target, path, chunks, limit)
        try:
            if old is not None:
                await self._keep_mode(temp, old)
            await self._move(temp.path, target, path)
        except BaseException:
            await self._discard(temp)
            raise
        return temp.size

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """Upload a temp file, then hard-link it to the name: `ln` refuses a name that is taken
        (by a dangling link too), so a concurrent writer is never overwritten."""
        target = self._path(path)
        temp = await self._upload_temp(target, path, chunks, limit)
        try:
            script = f'ln -- "$1" "$2" 2>/dev/null && exit 0; [ -e "$2" ] || [ -L "$2" ] && exit {ERRNO_EXIT[errno.EEXIST]}; exit 1'
            result = await self.run(
                ("/bin/sh", "-c", script, "sh", temp.path, target), user=self.options.user
            )
            if result.exit_code == ERRNO_EXIT[errno.EEXIST]:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            if result.exit_code != 0:
                raise OSError(errno.EIO, f"could not create {path}", path)
        finally:
            await self._discard(temp)
        return temp.size

    async def _upload_temp(self, target: str, path: str, chunks: AsyncIterable[bytes], limit: int) -> Staged:
        """The chunks in a new temp file beside `target`; EFBIG past `limit` (nothing left)."""
        parent, name = posixpath.split(target)
        await self._require_dir(parent, posixpath.dirname(path) or parent)
        staged = Staged(posixpath.join(parent, f".{name}{TEMP_INFIX}{secrets.token_hex(6)}.tmp"))

        async def counted() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                staged.size += len(chunk)
                if staged.size > limit:
                    staged.too_big = True
                    raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path)
                yield bytes(chunk)

        sandbox = self._running()
        try:
            await sandbox.files.write(staged.path, counted(), user=self.options.user, use_octet_stream=True)
        except BaseException as exc:
            await self._discard(staged)
            if staged.too_big:
                raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path) from None
            if isinstance(exc, Exception):
                raise self._files_error(exc, path) from None
            raise
        return staged

    async def _discard(self, staged: Staged) -> None:
        with contextlib.suppress(OSError, MachineUnavailable):
            if await self._entry(staged.path) is not None:
                await self._remove_rpc(staged.path, staged.path)

    async def _keep_mode(self, staged: Staged, old: FileStat) -> None:
        """The replaced file's mode for the file that replaces it (a chmod only when it differs)."""
        new = await self.stat(staged.path)
        if new is not None and stat_mod.S_IMODE(new.mode) != stat_mod.S_IMODE(old.mode):
            await self.run(("chmod", f"{stat_mod.S_IMODE(old.mode):o}", "--", staged.path))

    async def _realpath(self, target: str, path: str) -> str:
        result = await self.run(("readlink", "-f", "--", target))
        resolved = result.stdout.decode(errors="surrogateescape").strip()
        if result.exit_code != 0 or not resolved:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return resolved

    async def _move(self, source: str, destination: str, path: str) -> None:
        from e2b.envd.filesystem import filesystem_pb

        request = filesystem_pb.MoveRequest(source=source, destination=destination)
        await self._rpc_call(self._files_rpc.move, request, path)

    async def _remove_rpc(self, target: str, path: str) -> None:
        from e2b.envd.filesystem import filesystem_pb

        await self._rpc_call(self._files_rpc.remove, filesystem_pb.RemoveRequest(path=target), path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        target = self._path(path)
        entry = await self._entry(target)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        st = await self._to_stat(entry)
        if st.is_dir and not st.is_symlink and not recursive and await self.list(target):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        await self._remove_rpc(target, path)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        from e2b.envd.filesystem import filesystem_pb

        target = self._path(path)
        existing = await self._entry(target)
        if existing is not None:
            if parents and (await self._to_stat(existing)).is_dir:
                return
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        if not parents:
            await self._require_dir(posixpath.dirname(target), path)
        await self._rpc_call(self._files_rpc.make_dir, filesystem_pb.MakeDirRequest(path=target), path)

    async def rename(self, src: str, dst: str) -> None:
        source, destination = self._path(src), self._path(dst)
        if await self._entry(source) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), src)
        await self._require_dir(posixpath.dirname(destination), dst)
        await self._move(source, destination, src)

    async def chown(self, path: str, user: str) -> None:
        uid, gid = await self.user_ids(user)
        target = self._path(path)
        result = await self.run(("chown", "-h", f"{uid}:{gid}", "--", target))
        if result.exit_code != 0:
            if await self._entry(target) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            raise PermissionError(errno.EPERM, result.stderr.decode(errors="replace").strip(), path)

    async def readlink(self, path: str) -> str:
        target = self._path(path)
        script = (
            f'[ -L "$1" ] || {{ [ -e "$1" ] && exit {ERRNO_EXIT[errno.EINVAL]}; exit {ERRNO_EXIT[errno.ENOENT]}; }}; '
            'readlink -- "$1"'
        )
        result = await self.run(("/bin/sh", "-c", script, "sh", target))
        failed = helper_errno(result.exit_code)
        if failed is not None:
            raise OSError(failed, os.strerror(failed), path)
        return result.stdout.decode(errors="surrogateescape").removesuffix("\n")

    async def symlink(self, target: str, path: str) -> None:
        where = self._path(path)
        script = (
            f'{{ [ -e "$2" ] || [ -L "$2" ]; }} && exit {ERRNO_EXIT[errno.EEXIST]}; '
            f'[ -d "$(dirname -- "$2")" ] || exit {ERRNO_EXIT[errno.ENOENT]}; ln -s -- "$1" "$2"'
        )
        result = await self.run(("/bin/sh", "-c", script, "sh", target, where), user=self.options.user)
        failed = helper_errno(result.exit_code)
        if failed is not None:
            raise OSError(failed, os.strerror(failed), path)

    async def find_program(self, name: str) -> str | None:
        """Programs the start probe looks for (`rg`, `grep`, `inotifywait`); others by `command -v`."""
        if self.facts is not None and name in self.facts.programs:
            return self.facts.programs[name]
        result = await self.run(("/bin/sh", "-c", 'command -v -- "$1"', "sh", name))
        found = result.stdout.decode(errors="replace").strip()
        return found if result.exit_code == 0 and found.startswith("/") else None

    async def user_ids(self, user: str) -> tuple[int, int]:
        """The sandbox's uid and gid of `user`, asked once (`id`)."""
        if user not in self._owners:
            result = await self.run(("/bin/sh", "-c", 'id -u -- "$1" && id -g -- "$1"', "sh", user))
            numbers = result.stdout.split()
            if result.exit_code != 0 or len(numbers) != 2:
                raise OwnerUnsupported(
                    f"this machine cannot give files to user {user!r}: the sandbox has no such user"
                )
            self._owners[user] = (int(numbers[0]), int(numbers[1]))
        return self._owners[user]

    # watching -----------------------------------------------------------------------------

    def watch_kind(self) -> str:
        return "envd WatchDir (inotify in the sandbox)"

    def watch(self, path: str, *, recursive: bool = True) -> E2BWatch:
        """Changes under `path` as `WatchChange`s (the optional `Watching` capability)."""
        return E2BWatch(self, path, recursive)


@dataclass
class Staged:
    """A temp file an upload went to."""

    path: str
    size: int = 0
    too_big: bool = False


def old_style_link(entry: Any) -> bool:
    """A link whose type envd gives as SYMLINK (its own, not its target's: envd before
    `is_symlink`, or a link that leads nowhere)."""
    from e2b.envd.filesystem import filesystem_pb

    return entry.type == filesystem_pb.FileType.SYMLINK


def helper_errno(code: int) -> int | None:
    """The errno a helper script's exit code names (0: none; others: EIO)."""
    if code == 0:
        return None
    return next((e for e, c in ERRNO_EXIT.items() if c == code), errno.EIO)


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


class E2BWatch:
    """Changes under one path in the sandbox, from envd's WatchDir stream.

    envd reports create, write, remove, chmod and rename (the old name renamed away; the new
    name is a create right after it): a rename followed within MOVE_PAIR_SECONDS by a create
    is one `rename`, a lone one a `remove`. A stream that ends or drops ends the iteration
    with `MachineUnavailable`.
    """

    def __init__(self, machine: E2BMachine, path: str, recursive: bool) -> None:
        self.machine = machine
        self.path = path
        self.recursive = recursive
        self.target = ""
        self._queue: asyncio.Queue[WatchChange | BaseException] = asyncio.Queue()
        self._overflowed = False
        self._task: asyncio.Task[None] | None = None
        self._events: Any = None

    async def __aenter__(self) -> E2BWatch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> E2BWatch:
        return self

    async def __anext__(self) -> WatchChange:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        if self._queue.empty():
            self._overflowed = False
        return item

    async def start(self) -> None:
        from connectrpc.errors import ConnectError
        from e2b.envd.filesystem import filesystem_pb

        self.target = self.machine._path(self.path)
        await self.machine._require_dir(self.target, self.path)
        request = filesystem_pb.WatchDirRequest(path=self.target, recursive=self.recursive)
        events = self.machine._files_rpc.watch_dir(request, headers=self.machine._headers(HELPER_USER))
        self._events = events
        try:
            first = await asyncio.wait_for(events.__anext__(), REQUEST_TIMEOUT)
        except ConnectError as exc:
            raise connect_error(exc, self.path, self.machine) from None
        except (TimeoutError, StopAsyncIteration) as exc:
            raise MachineUnavailable(f"the watch on {self.target} did not start: {exc!r}") from None
        if first.event is None or first.event.field != "start":
            raise MachineUnavailable(f"the watch on {self.target} did not start")
        self._task = asyncio.ensure_future(self._pump(events))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._events is not None:
            with contextlib.suppress(BaseException):
                await self._events.aclose()

    def _put(self, change: WatchChange) -> None:
        if self._queue.qsize() >= MAX_QUEUED_CHANGES:
            if not self._overflowed:
                self._overflowed = True
                self._queue.put_nowait(WatchChange("overflow", self.target, True))
            return
        self._queue.put_nowait(change)

    async def _pump(self, events: Any) -> None:
        renamed: str | None = None
        try:
            while True:
                try:
                    timeout = MOVE_PAIR_SECONDS if renamed is not None else None
                    response = await asyncio.wait_for(events.__anext__(), timeout)
                except TimeoutError:
                    assert renamed is not None
                    self._put(WatchChange("remove", renamed))
                    renamed = None
                    continue
                which = response.event
                if which is None or which.field != "filesystem":
                    continue
                renamed = self._change(which.value, renamed)
        except StopAsyncIteration:
            self._queue.put_nowait(MachineUnavailable(f"the watch on {self.target} ended"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(MachineUnavailable(f"the watch on {self.target} dropped: {exc}"))

    def _change(self, event: Any, renamed: str | None) -> str | None:
        """Queue one envd event; the old name of a rename still waiting for its new one."""
        from e2b.envd.filesystem import filesystem_pb

        kinds = {
            filesystem_pb.EventType.CREATE: "create", filesystem_pb.EventType.WRITE: "write",
            filesystem_pb.EventType.REMOVE: "remove", filesystem_pb.EventType.CHMOD: "chmod",
            filesystem_pb.EventType.RENAME: "rename",
        }  # fmt: skip
        kind = kinds.get(event.type)
        if kind is None:
            return renamed
        path = posixpath.join(self.target, event.name)
        if renamed is not None:
            if kind == "create":
                self._put(WatchChange("rename", path, False, renamed))
                return None
            self._put(WatchChange("remove", renamed))
        if kind == "rename":
            return path
        self._put(WatchChange(kind, path))
        return None
