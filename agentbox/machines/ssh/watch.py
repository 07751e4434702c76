"""`RemoteWatch`: a remote tree's changes, from `inotifywait -m` on the host or by polling.

How the host's changes become `WatchChange`s (the events of `agentbox.workspace.watch`):

    inotifywait                    polling (GNU find every poll_seconds)
    CREATE           create        a new path: create (and write, for a non-empty file)
    CLOSE_WRITE      write, only   a file whose size or mtime changed: write
                     after MODIFY  (several writes within one interval are one)
    ATTRIB           chmod, not    a mode that changed: chmod
                     before a new
                     file's close
    DELETE           remove        a path gone: remove (children before their directory)
    MOVED_FROM then  rename        a move is a remove of the old path and a create of the
    MOVED_TO                       new one: polling cannot see moves
    MOVED_TO alone   create
    MOVED_FROM alone remove
    DELETE_SELF or   remove of the
    MOVE_SELF (root) root

inotifywait prints no cookies, so a MOVED_FROM is paired with the MOVED_TO that follows it
at once (the kernel queues the two of one rename together); one that nothing follows within
MOVE_PAIR_SECONDS is a move out. A file kept open for writing reports its write when it is
closed. A directory made under a recursive watch is scanned when it appears, so what was
put in it before its watch was added is reported (create, and write for a non-empty file).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentbox.machines.base import ExecRequest, WatchChange, inside_path
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.watch_queue import MAX_QUEUED_CHANGES, ChangeQueue

if TYPE_CHECKING:
    from agentbox.machines.ssh.channel import SshProcess
    from agentbox.machines.ssh.machine import SshMachine

#: Entries a polling watch keeps track of; deeper ones go unwatched.
MAX_POLL_ENTRIES = 100_000
#: Seconds `inotifywait -r` may take to set up its watches.
WATCH_SETUP_TIMEOUT = 60.0
#: Seconds a MOVED_FROM waits for the MOVED_TO of the same rename before it is a move out.
MOVE_PAIR_SECONDS = 0.05
#: Seconds a path reported by the scan of a new directory stays remembered, so that
#: inotify's own create of it (when its watch came in time) is not reported twice.
SCAN_ECHO_SECONDS = 5.0
#: Files created and not yet closed, or written and not yet closed, a watch remembers.
MAX_OPEN_FILES = 4096
#: The inotify events `watch` asks inotifywait for.
INOTIFY_EVENTS = (
    "attrib",
    "close_write",
    "create",
    "delete",
    "delete_self",
    "modify",
    "move_self",
    "moved_from",
    "moved_to",
)


@dataclass(frozen=True)
class _Seen:
    kind: str
    size: int
    mtime: str
    mode: str

    def change(self, event: str, path: str) -> WatchChange:
        """A change of this entry, with what the scan knows of it (no stat needed)."""
        return WatchChange(event, path, self.kind == "d", None, self.size, float(self.mtime))


class RemoteWatch(ChangeQueue):
    """Changes under one remote path, as `WatchChange`s (the mapping is the module's docstring).

    An `overflow` change (with the watched path) says changes were dropped for a slow
    reader: rescan. A dropped connection ends the iteration with `MachineUnavailable`.
    """

    def __init__(self, machine: SshMachine, path: str, recursive: bool) -> None:
        super().__init__()
        self.machine = machine
        self.path = path
        self.recursive = recursive
        self.kind = ""
        self._task: asyncio.Task[None] | None = None
        self._process: SshProcess | None = None
        self._scanned: dict[str, float] = {}
        self._fresh: dict[str, None] = {}
        self._modified: dict[str, None] = {}
        self._moved_from: tuple[str, bool] | None = None
        self._move_timer: asyncio.TimerHandle | None = None

    @property
    def pid(self) -> int | None:
        """The remote inotifywait's pid (None while polling)."""
        return self._process.pid if self._process is not None else None

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
        if self._move_timer is not None:
            self._move_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._process is not None and not self._process.channel.exited.done():
            self._process.kill()

    def _emit(self, event: str, path: str, is_dir: bool = False, old_path: str | None = None) -> None:
        self._put(WatchChange(event, path, is_dir, old_path))

    # inotifywait

    async def _start_inotify(self, binary: str) -> None:
        argv = [binary, "-m", *(["-r"] if self.recursive else []), "-e", ",".join(INOTIFY_EVENTS)]
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
                    await self._inotify_event(set(flags.split(",")), path.rstrip("/") or path)
                if self._moved_from is not None and self._move_timer is None:
                    loop = asyncio.get_running_loop()
                    self._move_timer = loop.call_later(MOVE_PAIR_SECONDS, self._moved_out)
            await process.wait()
            self._moved_out()
            self._fail(MachineUnavailable(f"the watch on {self.target} ended"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _inotify_event(self, flags: set[str], path: str) -> None:
        is_dir = "ISDIR" in flags
        if "MOVED_TO" in flags and self._moved_from is not None:
            old, _ = self._moved_from
            self._moved_from = None
            self._cancel_move_timer()
            self._carry(old, path)
            self._emit("rename", path, is_dir, old)
            return
        self._moved_out()
        if "CREATE" in flags or "MOVED_TO" in flags:
            await self._created(path, is_dir, moved="MOVED_TO" in flags)
        elif "MODIFY" in flags:
            _remember(self._modified, path)
        elif "CLOSE_WRITE" in flags:
            self._fresh.pop(path, None)
            if self._modified.pop(path, 0) is None:
                self._emit("write", path)
        elif "ATTRIB" in flags:
            if path not in self._fresh:
                self._emit("chmod", path, is_dir)
        elif "DELETE" in flags:
            self._forget(path)
            self._emit("remove", path, is_dir)
        elif "MOVED_FROM" in flags:
            self._moved_from = (path, is_dir)
        elif flags & {"DELETE_SELF", "MOVE_SELF"} and path == self.target:
            self._emit("remove", path, True)

    async def _created(self, path: str, is_dir: bool, *, moved: bool) -> None:
        now = time.monotonic()
        if self._scanned.pop(path, 0) > now - SCAN_ECHO_SECONDS:
            return  # the scan of its new parent reported it already
        self._emit("create", path, is_dir)
        if not is_dir and not moved:
            _remember(self._fresh, path)
        if is_dir and self.recursive:
            if len(self._scanned) > MAX_QUEUED_CHANGES:
                self._scanned.clear()
            for child, child_is_dir, size in await self._scan(path):
                self._scanned[child] = now
                self._emit("create", child, child_is_dir)
                if size > 0 and not child_is_dir:
                    self._emit("write", child)

    def _moved_out(self) -> None:
        """A MOVED_FROM that no MOVED_TO followed: the path left the watched tree."""
        self._cancel_move_timer()
        if self._moved_from is not None:
            path, is_dir = self._moved_from
            self._moved_from = None
            self._forget(path)
            self._emit("remove", path, is_dir)

    def _cancel_move_timer(self) -> None:
        if self._move_timer is not None:
            self._move_timer.cancel()
            self._move_timer = None

    def _carry(self, old: str, new: str) -> None:
        """A file renamed while open keeps its state under its new name."""
        if self._fresh.pop(old, 0) is None:
            _remember(self._fresh, new)
        if self._modified.pop(old, 0) is None:
            _remember(self._modified, new)

    def _forget(self, path: str) -> None:
        self._fresh.pop(path, None)
        self._modified.pop(path, None)

    async def _scan(self, path: str) -> list[tuple[str, bool, int]]:
        """What is already in a directory that just appeared (its watch came after):
        (path, is_dir, size) each."""
        try:
            found = await self.machine.run(("find", path, "-mindepth", "1", "-printf", "%y %s %p\\0"))
        except (MachineUnavailable, OSError):
            return []
        entries = []
        for record in found.stdout.decode(errors="surrogateescape").split("\0"):
            kind, size, child = [*record.split(" ", 2), "", ""][:3]
            if child:
                entries.append((child, kind == "d", int(size) if size.isdigit() else 0))
        return entries

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
                for change in changes(old, new):
                    self._put(change)
                old = new
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)


def _remember(paths: dict[str, None], path: str) -> None:
    paths[path] = None
    if len(paths) > MAX_OPEN_FILES:
        del paths[next(iter(paths))]


def changes(old: dict[str, _Seen], new: dict[str, _Seen]) -> list[WatchChange]:
    """The events between two scans. A directory's own times move with its entries: not reported."""
    out = [
        WatchChange("remove", p, old[p].kind == "d") for p in sorted(old.keys() - new.keys(), reverse=True)
    ]
    for p in sorted(new.keys() - old.keys()):
        seen = new[p]
        out.append(seen.change("create", p))
        if seen.kind == "f" and seen.size > 0:
            out.append(seen.change("write", p))
    for p in sorted(old.keys() & new.keys()):
        a, b = old[p], new[p]
        if a.kind == b.kind == "d":
            if a.mode != b.mode:
                out.append(b.change("chmod", p))
        elif (a.kind, a.size, a.mtime) != (b.kind, b.size, b.mtime):
            out.append(b.change("write", p))
        elif a.mode != b.mode:
            out.append(b.change("chmod", p))
    return out


def inotify_error(said: str, path: str) -> OSError:
    if "No such file" in said:
        return FileNotFoundError(errno.ENOENT, "no such file or directory", path)
    if "upper limit" in said:
        return OSError(errno.ENOSPC, "the host's inotify watch limit is reached", path)
    return OSError(errno.EIO, said.strip() or "inotifywait failed", path)
