"""The `Machine` protocol (seed 004): where tools run code and touch files.

Every kind (local, sandbox, ssh, ...) implements the same small surface, and everything
above this layer composes from it, the way everything in starlette composes from an ASGI
callable. Paths given to a machine are paths as seen from *inside* it; relative paths
resolve against `root`.

A command's own failure (non-zero exit, killed by a signal) is a normal `ExecResult`;
`exec` raises only when the machine itself fails (transport) or the caller cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import signal
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from agentbox.machines.errors import PathEscape, TerminalUnsupported

OS = Literal["linux", "darwin", "windows"]

#: Bytes of stdout (and separately of stderr) that `exec` keeps; the pipes keep draining past it.
DEFAULT_OUTPUT_LIMIT = 1024 * 1024
#: Seconds a finished (or killed) command's pipes may stay open before they are abandoned.
DRAIN_GRACE_SECONDS = 2.0
#: Bytes of one output stream of a command the server buffers unread; past twice this it
#: stops reading, so a command that floods a slow reader blocks on its pipe instead of
#: growing the server's memory (StreamReader's flow control: paused above 2x, resumed at 1x).
STREAM_BUFFER = 1 << 20
#: The folder, directly under a machine's root, that a governed delete moves files into
#: (`agentbox.tools.changes`). It must be on the root's own file system (a delete is a rename),
#: so it is inside the workspace; isolating kinds hide it from their processes (an empty,
#: read-only folder mounted over it), and the file tools neither list nor change what is in it.
TRASH_DIR = ".agentbox-trash"
#: Size of the empty tmpfs that covers the trash for a machine's processes (read-only: nothing
#: is ever written to it).
TRASH_COVER_BYTES = 4096
#: Largest rest of a file `Machine.read` returns when the caller names no `length`.
MAX_MACHINE_READ_BYTES = 64 * 1024 * 1024
#: Most rows (and, separately, columns) a terminal may have: the kernel's `struct winsize`
#: holds each in an unsigned short.
MAX_TERMINAL_SIDE = 65535


@dataclass(frozen=True)
class TerminalSize:
    """A pseudo-terminal's window, in character cells; each side 1..MAX_TERMINAL_SIDE."""

    rows: int
    cols: int

    def __post_init__(self) -> None:
        for side in (self.rows, self.cols):
            if not 1 <= side <= MAX_TERMINAL_SIDE:
                raise ValueError(f"a terminal's rows and cols must be 1..{MAX_TERMINAL_SIDE}, got {side}")


@dataclass(frozen=True)
class ExecRequest:
    """One command. `command` is a shell string (run by `sh -c`) unless `argv` is given."""

    command: str = ""
    argv: tuple[str, ...] = ()
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: bytes | None = None
    timeout: float | None = None
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    interactive: bool = False
    """Keep a stdin pipe open for `Process.write_stdin` (otherwise stdin is /dev/null)."""
    pty: TerminalSize | None = None
    """Run on a pseudo-terminal of this size, allocated inside the machine, as the command's
    controlling terminal and its stdin, stdout and stderr: everything it writes arrives on
    `stdout` (`stderr` ends at once), `write_stdin` types into it, and the process is a
    `Terminal` (`resize`). A kind that cannot raises `TerminalUnsupported`."""
    user: str | None = None
    """The account to run as: None is the machine's own identity. A sandbox also has `root`
    (its own) and `user` (`machines/account.py`); other names are `OwnerUnsupported`. Kinds
    without accounts of their own run every command as their identity and ignore it."""
    end_group: bool = False
    """Kill what is left of the command's process group as soon as it exits. A kind whose
    machine can do it at the exit does (an exec agent, before it reports the exit; no message
    more); the caller still kills the group after the exit, which costs nothing more there and
    does the job on kinds that ignore this."""

    def args(self) -> list[str]:
        return list(self.argv) if self.argv else ["/bin/sh", "-c", self.command]


@dataclass(frozen=True)
class ExecResult:
    """How a finished command ended. `exit_code` is 128+N when killed by signal N."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration: float = 0.0


@dataclass(frozen=True)
class FileStat:
    path: str
    is_dir: bool
    is_file: bool
    is_symlink: bool
    size: int
    mtime: float
    mode: int
    uid: int
    gid: int
    inode: int


@dataclass(frozen=True)
class FileEntry:
    name: str
    path: str
    stat: FileStat


class Process(Protocol):
    """A running command. Its output arrives on `stdout` / `stderr` until EOF."""

    pid: int
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def wait(self) -> int:
        """The exit code (128+N for signal N) once the process has ended."""
        ...

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's whole process group."""
        ...


@runtime_checkable
class Terminal(Process, Protocol):
    """A process spawned with `ExecRequest.pty`."""

    def resize(self, size: TerminalSize) -> None:
        """Set the terminal's window size: the command's foreground group gets SIGWINCH."""
        ...


@runtime_checkable
class Machine(Protocol):
    """What every layer above `machines/` stands on: commands, files, and the facts the prompt
    and the tools need. A kind whose files the server reaches directly also has the
    `HostFiles` capability (`hostfs.py`); one that lives per session has a `Lifetime`."""

    name: str
    kind: str
    isolated: bool
    """A boundary of its own (a sandbox, a container), not the host or a shared machine."""
    os: OS
    root: str
    network_on: bool
    """Whether commands on it reach the network (the tools' open-world hint, `web_fetch`'s reach)."""

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        """The environment a command of `request` gets: the machine's own, then the request's."""
        ...

    async def exec(self, request: ExecRequest) -> ExecResult: ...

    async def spawn(self, request: ExecRequest) -> Process: ...

    async def read(
        self, path: str, *, offset: int = 0, length: int | None = None, limit: int = MAX_MACHINE_READ_BYTES
    ) -> bytes:
        """Bytes of a regular file from `offset`: `length` of them (fewer at its end), or all the
        rest, refused (EFBIG) when that is more than `limit`. A directory is EISDIR."""
        ...

    async def write(self, path: str, data: bytes) -> None:
        """Replace (or create) the file with `data`, following a final symlink."""
        ...

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """Write the file from `chunks` atomically: the old content or the whole new one, never a
        part. More than `limit` bytes is EFBIG and leaves the target as it was. Returns the size."""
        ...

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """Create a new file from `chunks`, exclusively: EEXIST when the name is taken (by a
        dangling link too; a final link is never followed), so a concurrent writer is never
        overwritten. More than `limit` bytes is EFBIG and the new file is removed. The size."""
        ...

    async def list(self, path: str) -> list[FileEntry]: ...

    async def stat(self, path: str) -> FileStat | None: ...

    async def remove(self, path: str, *, recursive: bool = False) -> None: ...

    async def mkdir(self, path: str, *, parents: bool = False) -> None: ...

    async def rename(self, src: str, dst: str) -> None: ...

    async def chown(self, path: str, user: str) -> None: ...

    async def readlink(self, path: str) -> str:
        """The target a symlink holds, as written (EINVAL when `path` is not a symlink)."""
        ...

    async def symlink(self, target: str, path: str) -> None:
        """Make `path` a new symlink to `target` (EEXIST when something is there)."""
        ...

    async def find_program(self, name: str) -> str | None:
        """Where the machine's own `name` program is (`rg` for searches), or None."""
        ...

    async def user_ids(self, user: str) -> tuple[int, int]:
        """The (uid, gid) a file given to inside `user` gets; `OwnerUnsupported` when there is none."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Lifetime(Protocol):
    """A machine that lives per session and can be suspended when idle and started again.

    The registry counts the running ones against the server's caps, stops idle ones
    (`stop`: a sandbox's processes and layer go, its workspace stays) and records each
    lifetime in the session's marker (`instance_id`, `marker()`), so a restarted server
    finds it again.
    """

    state: str
    """"running" or "stopped"."""
    last_used: float
    """When it last ran or finished a command (monotonic seconds)."""
    instance_id: str
    """What names this machine's instance for good (a sandbox id, a container id)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def busy(self) -> bool:
        """A command (or a process it left) is running: not idle, whatever `last_used` says."""
        ...

    def marker(self) -> dict[str, Any]:
        """What the session's marker records about this lifetime (handed back after a restart)."""
        ...

    async def destroy(self) -> None:
        """The session is closed: stop, and remove what would outlive a stop (a container)."""
        ...

    def capabilities(self) -> dict[str, Any]:
        """How it is isolated and what it can do (`GET /v2/sandbox`'s `isolation`)."""
        ...


@dataclass(frozen=True)
class Usage:
    """What a running machine uses right now, as the host measures it (`Metered.usage`)."""

    cpu_count: int
    """CPUs it may use: its CPU limit rounded up, or the host's CPUs without one."""
    cpu_seconds: float
    """CPU time its processes used in this lifetime, the ended ones included where the host
    counts them (a cgroup), so the difference of two readings is the time used between them."""
    started_at: float
    """When this lifetime began (wall-clock seconds): `cpu_seconds` counts from there."""
    memory_used: int
    """Bytes its processes hold, page cache not included."""
    memory_cache: int
    """Bytes of page cache charged to it (0 where that is not measured)."""
    memory_total: int
    """Its memory limit in bytes, or the host's memory without one."""
    disk_used: int
    """Bytes used of its workspace's file system."""
    disk_total: int
    """Bytes of that file system (its disk budget when it has one)."""


@runtime_checkable
class Metered(Protocol):
    """A machine whose CPU, memory and disk the server can measure (the bubblewrap sandbox):
    E2B's metrics of a sandbox are read from it."""

    def usage(self) -> Usage | None:
        """What it uses now; None when it is not running. Reads files (cgroup, /proc, statvfs):
        call it off the event loop."""
        ...


Listener = Callable[[str, str], None]


def inside_path(root: str, path: str) -> str:
    """`path` as an absolute, normalised path inside a machine: relative paths are taken from `root`.

    Lexical only: nothing is resolved, so `..` is folded here and symlinks are the machine's
    business. An empty path or one with a NUL byte can name nothing and is a `PathEscape`.
    """
    if not path:
        raise PathEscape("empty path", path=path)
    if "\x00" in path:
        raise PathEscape("path contains a NUL byte", path=path)
    joined = path if path.startswith("/") else posixpath.join(root, path)
    normal = posixpath.normpath(joined)
    return "/" + normal.lstrip("/") if normal != "/" else "/"


def pipes_only(request: ExecRequest, machine: str) -> None:
    """Refuse a pseudo-terminal on a kind whose commands run on pipes only (local, ssh, e2b)."""
    if request.pty is not None:
        raise TerminalUnsupported(
            f"{machine} runs commands on pipes only, not on a pseudo-terminal: use a sandbox or docker machine"
        )


async def collect(process: Process, limit: int, timeout: float | None) -> ExecResult:
    """Run a process to its end, keeping the first `limit` bytes of each stream.

    Output past the limit is read and dropped so the command never blocks on a full pipe.
    The timeout bounds the whole command, output included; on timeout or cancellation the
    whole process group is killed. A command that ends while a background child still
    holds its pipes returns after DRAIN_GRACE_SECONDS with the output so far, and the child
    keeps running (it keeps its sandbox busy); the tool layer, which must clean up
    descendants (seed 001), kills the group itself.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    cut = {"stdout": False, "stderr": False}

    async def drain(name: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = limit - len(kept[name])
            if room > 0:
                kept[name] += chunk[:room]
            if len(chunk) > max(room, 0):
                cut[name] = True

    drains = asyncio.gather(drain("stdout", process.stdout), drain("stderr", process.stderr))

    async def run() -> int:
        code = await process.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(drains), DRAIN_GRACE_SECONDS)
        return code

    timed_out = False
    try:
        try:
            code = await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            timed_out = True
            process.kill(signal.SIGKILL)
            code = await process.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(drains), DRAIN_GRACE_SECONDS)
    except BaseException:
        process.kill(signal.SIGKILL)
        drains.cancel()
        raise
    drains.cancel()
    return ExecResult(
        exit_code=code,
        stdout=bytes(kept["stdout"]),
        stderr=bytes(kept["stderr"]),
        timed_out=timed_out,
        stdout_truncated=cut["stdout"],
        stderr_truncated=cut["stderr"],
        duration=loop.time() - started,
    )


async def iter_output(process: Process) -> AsyncIterator[tuple[str, bytes]]:
    """Yield ("stdout"|"stderr", chunk) as output arrives, until both streams end."""
    queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()

    async def pump(name: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            await queue.put((name, chunk))
        await queue.put(None)

    tasks = [
        asyncio.ensure_future(pump("stdout", process.stdout)),
        asyncio.ensure_future(pump("stderr", process.stderr)),
    ]
    done = 0
    try:
        while done < 2:
            item = await queue.get()
            if item is None:
                done += 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def environment_line(machine: Machine) -> str:
    """The line seed 004 puts in every system prompt."""
    return f"Machine: {machine.name} ({machine.kind}, {machine.os}), workspace {machine.root}"


# -- the optional watch capability -----------------------------------------------------------


class WatchChange(NamedTuple):
    """One change a machine's watch stream reports; paths are inside paths.

    `event` is create, write, remove, chmod, rename (`old_path` set) or overflow (with the
    watched path: changes were dropped, rescan).
    """

    event: str
    path: str
    is_dir: bool = False
    old_path: str | None = None
    size: int | None = None
    """The file's size and mtime when the source knows them (a scan); else they are looked up."""
    mtime: float | None = None


class WatchStream(Protocol):
    """Changes under one path, from `start` (or `async with`) until `aclose`; a dropped
    connection ends the iteration with `MachineUnavailable`."""

    async def start(self) -> None:
        """Begin watching (the path must exist: `FileNotFoundError` otherwise)."""
        ...

    async def aclose(self) -> None:
        """Stop watching: whatever the machine runs to watch ends."""
        ...

    def __aiter__(self) -> AsyncIterator[WatchChange]: ...


@runtime_checkable
class Watching(Machine, Protocol):
    """A machine that reports its own file changes (one without `HostFiles`, whose files the
    server cannot watch itself). `agentbox.workspace.watch.WatchHub` stands on it."""

    def watch(self, path: str, *, recursive: bool = True) -> WatchStream: ...

    def watch_kind(self) -> str:
        """How changes are seen (`inotifywait`, `polling (2 s)`): stated in capabilities."""
        ...


@runtime_checkable
class Browsing(Machine, Protocol):
    """A machine that can carry a browser; when its entry enables it (`browser = true`), it carries Playwright's
    driver, so a Chromium it has runs inside it, driven over the driver's stdin and stdout
    (`agentbox.workspace.browser`) and never through a port the host can reach."""

    def browser_driver(self) -> tuple[str, ...] | None:
        """The argv, as seen inside, that runs Playwright's driver (`run-driver` is added);
        None when the machine's entry did not enable the browser."""
        ...
