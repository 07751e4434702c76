"""`RemoteWatch`: a remote tree's changes, from `inotifywait -m` on the host or by polling."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentbox.machines.base import ExecRequest, inside_path
from agentbox.machines.errors import MachineUnavailable

if TYPE_CHECKING:
    from agentbox.machines.ssh.channel import SshProcess
    from agentbox.machines.ssh.machine import SshMachine

#: Entries a polling watch keeps track of; deeper ones go unwatched.
MAX_POLL_ENTRIES = 100_000
#: Changes a watch queues for a slow reader before it reports `overflow` and drops.
MAX_QUEUED_CHANGES = 10_000
#: Seconds `inotifywait -r` may take to set up its watches.
WATCH_SETUP_TIMEOUT = 60.0
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
        facts = await self.machine.ready()
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
