"""Watchers: a machine's file changes as numbered events (seed 002, "监听文件变化").

A `WatchHub` belongs to one machine. On a machine with host files (local, sandbox, docker)
it owns one inotify instance and one reader task; each `Watcher` it creates subscribes to the inotify watches
of the directories under its root and keeps its own numbered events (`seq` from 1) in a
ring that `poll` (cursor + long-poll), `stream` (SSE with resume) and `wait_for` (v1
`watch/wait`) read. Processes inside a bubblewrap sandbox write to the same host
directories, so watching them sees their changes. Every path here is an *inside* path:
directories are found through the machine's descriptor view and watched through the
descriptor (`/proc/self/fd/N`), files are stat'ed through the view, so no host path is
ever resolved by name (a directory swapped for a link cannot redirect a watch).

How inotify becomes events, one to one:

    IN_CREATE                 create
    IN_CLOSE_WRITE            write, only if an IN_MODIFY came since the last write event
                              (`touch new` opens for writing and closes without writing:
                              it is a lone create). A file kept open reports at most one
                              write per OPEN_WRITE_FLUSH_SECONDS while it is being written.
    IN_ATTRIB                 chmod, except between a file's IN_CREATE and its first
                              close (touch sets the times of the file it just created);
                              so `touch existing` is a chmod (its times changed)
    IN_DELETE                 remove; IN_DELETE_SELF / IN_MOVE_SELF of the watched root:
                              remove with relative_path "." and the watcher goes quiet
    IN_MOVED_FROM + _TO       paired by cookie: rename at the new path, old_path set
    IN_MOVED_TO alone         create (moved in from outside the watched tree; a
                              directory's contents are reported as for a new directory)
    IN_MOVED_FROM alone       remove (moved out; decided after MOVE_PAIR_SECONDS)

A rename whose old path is excluded but whose new path is not is still a `rename`: an
upload staged through `.aiod-upload-<id>.part` shows as exactly `rename data.csv` to a
watcher with `exclude=["*.part"]`; a plain watcher sees `create X.part`, `write X.part`,
`rename data.csv` (old_path X.part). A rename into an excluded name is a `remove`.

Excludes are fnmatch globs matched against each segment of the path relative to the
root (a glob containing "/" is matched against the leading parts of that path); no watch
is added under an excluded directory. A list replaces DEFAULT_EXCLUDES; it does not add.
Symlinked directories are never followed.

Recursive watches race with the writers: a directory created under the tree is watched
when its IN_CREATE is read, and what was already in it by then is reported from a scan
(create, plus write for a non-empty file), so `mkdir -p a/b && echo x > a/b/f` gives
create a, create a/b, create a/b/f, write a/b/f. Events that the scan already reported
and that inotify reports again are dropped.

Watching a file (not a directory) watches its parent for that one name, so the file
being replaced by a rename is seen; excludes do not apply to it and relative_path is its
name. The same mechanism serves `wait_for`, which may wait for a path whose directories do
not exist yet. A missing path is `not_found`.

`create` walks the existing tree (adding watches) on the event loop; a tree near
MAX_WATCHED_DIRS directories takes a noticeable moment.

Losses are reported, never hidden: when the ring drops events nobody consumed, when the
kernel queue overflows, or when a watcher would need more than MAX_WATCHED_DIRS watches,
the next poll says `overflow=True` once and a stream yields an `Overflow` marker: rescan.

The host's inotify watches are one pool for the server's uid (`max_user_watches`), so one
machine may hold at most MAX_WATCHES_PER_MACHINE of them, over all its watchers (a
directory two watchers share counts once). A watcher whose tree needs more is created
anyway and truncated: the directories past the bound are not watched, and it reports
overflow as above, so a client knows to rescan (or to watch a smaller tree, or to exclude
more). Deleting watchers gives their watches back.

A machine without host files that has the `Watching` capability (ssh) is the second source
of events: each watcher runs one watch stream on the machine (`inotifywait -m` on the remote
host, or polling with `find`; the mapping from the host's changes is `machines/ssh/watch.py`'s
docstring) and records its changes in the same ring, with the same cursor, limits, excludes
and shapes. Its watchers are made with `start` (the machine is asked first, so a missing
path is `not_found` and a remote failure is `machine_unavailable`). What differs:

    mtime, size    polling: from the scan; inotifywait: from an SFTP stat of the path when
                   its change is recorded (whole seconds for mtime; null when the path is gone
                   by then). The stats are pipelined, MAX_STATS_AHEAD at once: about a
                   thousand events a second over loopback; a burst past that waits in the
                   remote queue (and overflows past its bound). Null for a remove.
    inode          null (SFTP v3 has none)
    rename         with inotifywait, a MOVED_FROM paired with the MOVED_TO that follows it;
                   polling cannot see moves: a remove of the old path, a create of the new
    write          polling: once per scan however many writes came (latency poll_seconds);
                   inotifywait: when the file is closed (no OPEN_WRITE_FLUSH_SECONDS)
    excludes       applied here: the remote host still watches (or scans) excluded directories
    limits         MAX_WATCHED_DIRS and MAX_WATCHES_PER_MACHINE count this server's inotify
                   watches: not applied; the remote host's own inotify limit fails the
                   `start` (`no_space_left`)
    overflow       a remote queue past its bound, and a stream that ended (connection dropped):
                   the watcher watches again after REWATCH_SECONDS and reports overflow
    wait_for       watches the nearest existing directory (recursively if the path is deeper)

Deleting a watcher ends its stream (the remote inotifywait is killed).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import errno
import fnmatch
import itertools
import logging
import os
import secrets
import stat as stat_mod
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from asyncinotify import Event as RawEvent
from asyncinotify import Inotify, Mask, Watch

from agentbox.machines.base import Machine, WatchChange, Watching, WatchStream, inside_path
from agentbox.machines.errors import MachineError
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import HostView
from agentbox.workspace.errors import WorkspaceError, bad_request, operation
from agentbox.workspace.patterns import check_patterns

#: What a hub watches through inotify: a machine with the `HostFiles` capability.
HostMachine = HostFiles
#: What a hub can watch: host files, or a machine that watches itself (any other machine
#: gets a hub whose watchers fail to start).
WatchedMachine = HostFiles | Watching | Machine

log = logging.getLogger(__name__)

#: Watchers one hub (one machine) may hold at once; the next `create` is refused.
MAX_WATCHERS_PER_HUB = 64
#: Events a watcher keeps; older ones are dropped (and reported as overflow if unread).
MAX_EVENTS_PER_WATCHER = 10_000
#: Directories one watcher may put an inotify watch on; past it, changes there are lost
#: and reported as overflow.
MAX_WATCHED_DIRS = 20_000
#: inotify watches one machine's watchers may hold together (of the host's max_user_watches,
#: shared by the whole server); past it a watcher is truncated and reports overflow.
MAX_WATCHES_PER_MACHINE = 8192
#: Events one poll returns when the client does not say.
DEFAULT_POLL_LIMIT = 100
#: Most events one poll returns; a larger `limit` is clamped to this.
MAX_POLL_LIMIT = 1000
#: Longest a poll blocks waiting for an event, in seconds; a larger `timeout` is clamped.
MAX_POLL_TIMEOUT = 300.0
#: How long an IN_MOVED_FROM waits for its IN_MOVED_TO before it counts as a move out of
#: every watched tree. The kernel queues both in one rename, so this only covers a reader
#: that woke between the two.
MOVE_PAIR_SECONDS = 0.02
#: A file written but not closed reports a write after this many seconds (then again after
#: the next write), so a log that a process keeps open still shows changes.
OPEN_WRITE_FLUSH_SECONDS = 1.0
#: How long a file reported by a directory scan waits for inotify's own create / write of
#: it, to drop those duplicates.
SCAN_ECHO_SECONDS = 5.0
#: Files created and not yet closed that the hub remembers (their IN_ATTRIB is not chmod).
MAX_FRESH_FILES = 4096
#: Bytes of events read from inotify at once, in full-size (NAME_MAX) events.
READ_BATCH_EVENTS = 256
#: Changes of a remote watcher whose metadata (one SFTP stat each) is fetched at once, ahead
#: of the change being recorded; past it the watcher reads its stream no further until one is.
MAX_STATS_AHEAD = 64
#: Seconds a remote watcher waits to watch again after its stream ended (a dropped connection).
REWATCH_SECONDS = 1.0

#: The upstream AIO defaults; an explicit `exclude` list replaces them.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git",
    "node_modules",
    "__pycache__",
    ".venv",
    "*.pyc",
    "*.pyo",
    ".DS_Store",
    "*.swp",
    "*.swo",
)

EventType = Literal["create", "write", "remove", "rename", "chmod"]
EVENT_TYPES: tuple[EventType, ...] = ("create", "write", "remove", "rename", "chmod")

#: What each watched directory listens for. The watch is added through the directory's
#: descriptor (`/proc/self/fd/N`), so DONT_FOLLOW must stay off (it would watch that link);
#: ONLYDIR refuses anything but a directory.
DIR_MASK = (
    Mask.CREATE
    | Mask.MODIFY
    | Mask.CLOSE_WRITE
    | Mask.ATTRIB
    | Mask.DELETE
    | Mask.DELETE_SELF
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
    | Mask.EXCL_UNLINK
)

Rel = tuple[str, ...]
#: A file as inotify names it: (watch descriptor of its directory, name). Survives renames
#: of the directories above it.
FileKey = tuple[int, str]
ChangeKind = Literal["create", "write", "remove", "chmod", "rename", "moved_in", "moved_out"]


class WatcherNotFound(WorkspaceError):
    """No watcher with that id on this machine (deleted, or never created)."""

    def __init__(self, watcher_id: str) -> None:
        super().__init__(
            "not_found",
            f"Failed to watch path: no watcher {watcher_id}",
            "watch",
            exception_type="WatcherNotFound",
        )
        self.watcher_id = watcher_id


class TooManyWatchers(WorkspaceError):
    """The machine already has MAX_WATCHERS_PER_HUB watchers; delete one first."""

    def __init__(self, limit: int, path: str | None) -> None:
        super().__init__(
            "bad_request",
            f"Failed to watch path: at most {limit} watchers per sandbox; delete one first",
            "watch",
            path,
            exception_type="TooManyWatchers",
        )
        self.limit = limit


class TooManyWatches(WorkspaceError):
    """The machine's watchers hold MAX_WATCHES_PER_MACHINE watches: no room for a new root."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            "bad_request",
            f"Failed to watch path: this sandbox already holds {limit} directory watches; delete a watcher first",
            "watch",
            exception_type="TooManyWatches",
        )
        self.limit = limit


@dataclass(frozen=True)
class Event:
    """One change, as the wire carries it (the field order is the seed's JSON)."""

    seq: int
    type: EventType
    path: str
    relative_path: str
    is_dir: bool
    timestamp: float
    old_path: str | None
    mtime: float | None
    size: int | None
    inode: int | None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Overflow:
    """A stream marker: events after `after_seq` were lost; the client should rescan."""

    after_seq: int

    def to_dict(self) -> dict[str, object]:
        return {"overflow": True, "after_seq": self.after_seq}


@dataclass(frozen=True)
class PollResult:
    events: list[Event]
    #: The seq of the last event returned, or the cursor given when none were.
    cursor: int
    #: History was lost since the cursor (or since the last poll): rescan.
    overflow: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "events": [e.to_dict() for e in self.events],
            "cursor": self.cursor,
            "overflow": self.overflow,
        }


def is_excluded(rel: Rel, patterns: Iterable[str]) -> bool:
    """Whether a glob hides `rel`: one without "/" matches any segment, one with "/" a leading part."""
    for pattern in patterns:
        if "/" in pattern:
            glob = pattern.strip("/")
            if any(fnmatch.fnmatchcase("/".join(rel[:n]), glob) for n in range(1, len(rel) + 1)):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in rel):
            return True
    return False


@dataclass(frozen=True)
class Scope:
    """Which host paths a watcher reports, and which directories it puts watches on."""

    root: Path
    recursive: bool = True
    exclude: tuple[str, ...] = DEFAULT_EXCLUDES
    #: Report only this path below the root (a watched file, or `wait_for`'s path).
    target: Rel | None = None

    def relative(self, host: Path) -> Rel | None:
        """`host` as parts below the root, or None when it is not under it."""
        if not host.is_relative_to(self.root):
            return None
        return host.relative_to(self.root).parts

    def visible(self, rel: Rel) -> bool:
        if self.target is not None:
            return rel == self.target
        if not self.recursive and len(rel) > 1:
            return False
        return not is_excluded(rel, self.exclude)

    def descends(self, rel: Rel) -> bool:
        """Whether the directory at `rel` gets its own watch."""
        if not rel:
            return True
        if self.target is not None:
            return len(rel) < len(self.target) and self.target[: len(rel)] == rel
        return self.recursive and not is_excluded(rel, self.exclude)


@dataclass(frozen=True)
class _Meta:
    """What an event says about its path's file, when the path is there."""

    is_dir: bool
    mtime: float
    size: int
    inode: int | None


@dataclass(frozen=True)
class _Change:
    """What happened to one host path, before any watcher's scope or numbering."""

    kind: ChangeKind
    host: Path
    is_dir: bool
    old_host: Path | None = None
    meta: _Meta | None = None
    """The path's file as the source saw it (a remote stat); None: lstat it when recorded."""


@dataclass
class _Scanned:
    """A file a directory scan reported; inotify may still report its create / write."""

    inode: int
    size: int
    mtime_ns: int
    create: bool
    write: bool
    at: float


@dataclass
class _Dir:
    host: Path
    watch: Watch
    watchers: set[Watcher]


@dataclass
class _Move:
    key: FileKey
    host: Path
    is_dir: bool
    timer: asyncio.TimerHandle


def _lstat(hub: WatchHub, inside: Path) -> os.stat_result | None:
    """The host file at `inside` (None when it is gone, or the hub's machine has no host files)."""
    if hub.files is None:
        return None
    try:
        return hub.files.view.lstat(str(inside))
    except (OSError, MachineError):
        return None


def _host_meta(st: os.stat_result | None) -> _Meta | None:
    if st is None:
        return None
    return _Meta(stat_mod.S_ISDIR(st.st_mode), st.st_mtime, st.st_size, st.st_ino)


class Watcher:
    """One client's view of changes under a path: numbered events in a ring."""

    def __init__(self, hub: WatchHub, watcher_id: str, scope: Scope, path: str, *, listed: bool) -> None:
        self.hub = hub
        self.id = watcher_id
        self.scope = scope
        #: The watched path, inside the machine.
        self.path = path
        self.listed = listed
        self.created_at = time.time()
        self.closed = False
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS_PER_WATCHER)
        self._next_seq = 1
        self._delivered = 0  # highest seq any poll or stream has handed out
        self._overflow = False  # a loss the next poll must report
        self._gaps = 0  # losses that left no trace in the ring (kernel queue, watch limit)
        self._changed = asyncio.Event()
        self._wds: set[int] = set()
        self._root_wd: int | None = None
        self._scanned: dict[Path, _Scanned] = {}
        self._feed: _Feed | None = None
        """The remote stream this watcher's events come from (None: the hub's inotify)."""

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def to_dict(self) -> dict[str, object]:
        return {
            "watcher_id": self.id,
            "path": self.path,
            "recursive": self.scope.recursive,
            "exclude": list(self.scope.exclude),
            "created_at": self.created_at,
            "last_seq": self.last_seq,
        }

    # -- consuming -------------------------------------------------------------------------

    async def poll(
        self, cursor: int = 0, timeout: float = 0.0, limit: int = DEFAULT_POLL_LIMIT
    ) -> PollResult:
        """Events with seq > cursor, waiting up to `timeout` seconds for the first one."""
        self._check_position(cursor)
        if limit < 1:
            raise bad_request("watch", f"limit must be at least 1, got {limit}", self.path)
        limit = min(limit, MAX_POLL_LIMIT)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(timeout, 0.0), MAX_POLL_TIMEOUT)
        while True:
            changed = self._changed
            events, missed = self._after(cursor, limit)
            overflow = missed or self._overflow
            remaining = deadline - loop.time()
            if events or overflow or self.closed or remaining <= 0:
                self._overflow = False
                return PollResult(events, self._handed_out(events, cursor), overflow)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()

    async def stream(self, after_seq: int = 0) -> AsyncIterator[Event | Overflow]:
        """Events after `after_seq` as they come (for SSE), with a marker where some were lost."""
        self._check_position(after_seq)
        position = after_seq
        gaps = self._gaps
        while True:
            changed = self._changed
            events, missed = self._after(position, MAX_POLL_LIMIT)
            if missed or gaps != self._gaps:
                gaps = self._gaps
                yield Overflow(position)
            for event in events:
                position = self._handed_out([event], position)
                yield event
            if events:
                continue
            if self.closed:
                return
            await changed.wait()

    def _check_position(self, cursor: int) -> None:
        if cursor < 0 or cursor > self.last_seq:
            raise bad_request(
                "watch",
                f"cursor must be between 0 and {self.last_seq} (the last event), got {cursor}",
                self.path,
            )

    def _after(self, cursor: int, limit: int) -> tuple[list[Event], bool]:
        """Up to `limit` events with seq > cursor, and whether some after it were dropped."""
        oldest = self._events[0].seq if self._events else self._next_seq
        start = max(0, cursor + 1 - oldest)
        return list(itertools.islice(self._events, start, start + limit)), cursor < oldest - 1

    def _handed_out(self, events: list[Event], cursor: int) -> int:
        last = events[-1].seq if events else cursor
        self._delivered = max(self._delivered, last)
        return last

    # -- recording -------------------------------------------------------------------------

    def _emit(
        self,
        kind: EventType,
        host: Path,
        is_dir: bool,
        old_host: Path | None = None,
        meta: _Meta | None = None,
    ) -> Event:
        rel = self.scope.relative(host)
        inside = str(host)
        old_inside = str(old_host) if old_host is not None else None
        st = meta or _host_meta(_lstat(self.hub, host))
        event = Event(
            seq=self._next_seq,
            type=kind,
            path=inside,
            relative_path="/".join(rel) if rel else ".",
            is_dir=is_dir,
            timestamp=time.time(),
            old_path=old_inside,
            mtime=st.mtime if st else None,
            size=st.size if st else None,
            inode=st.inode if st else None,
        )
        self._next_seq += 1
        if len(self._events) == self._events.maxlen and self._events[0].seq > self._delivered:
            self._overflow = True
        self._events.append(event)
        self._wake()
        return event

    def _lost(self) -> None:
        """Changes happened that no event will describe."""
        self._overflow = True
        self._gaps += 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _close(self) -> None:
        self.closed = True
        self._wake()

    # -- applying changes ------------------------------------------------------------------

    def _apply(self, change: _Change) -> None:
        rel = self.scope.relative(change.host)
        if change.kind in ("rename", "moved_in"):
            self._forget_scanned(change.old_host)
            self._arrived(change, rel)
            return
        if rel is None:
            return
        visible = self.scope.visible(rel)
        if change.kind == "moved_out":
            self._forget_scanned(change.host)
            if visible:
                self._emit("remove", change.host, change.is_dir)
            return
        if self._is_echo(change):
            return  # a scan reported it already (and watched it, if it is a directory)
        if visible:
            self._emit(cast(EventType, change.kind), change.host, change.is_dir, meta=change.meta)
        if change.kind == "create" and change.is_dir and self.scope.descends(rel):
            self._enter(change.host, rel, synthesize=True)

    def _arrived(self, change: _Change, rel: Rel | None) -> None:
        """A path renamed or moved to `change.host`, from inside this tree or not."""
        old_rel = self.scope.relative(change.old_host) if change.old_host is not None else None
        if rel is not None and self.scope.visible(rel):
            if old_rel is not None:
                self._emit("rename", change.host, change.is_dir, change.old_host, change.meta)
            else:
                self._emit("create", change.host, change.is_dir, meta=change.meta)
        elif old_rel is not None and change.old_host is not None and self.scope.visible(old_rel):
            self._emit("remove", change.old_host, change.is_dir)
        if change.is_dir:
            self._resubscribe(change.host, rel)

    def _resubscribe(self, host: Path, rel: Rel | None) -> None:
        """After a directory moved to `host`: keep, drop or add the watches below it."""
        if self._feed is not None:
            return  # a remote stream follows its directories itself
        mine = [wd for wd in self._wds if self.hub._dir_is_under(wd, host)]
        if rel is None or not self.scope.descends(rel):
            for wd in mine:
                self.hub._unsubscribe(self, wd)
        elif not mine:
            self._enter(host, rel, synthesize=True)

    def _enter(self, host: Path, rel: Rel, *, synthesize: bool) -> None:
        """Watch `host` and the directories below it this watcher descends into.

        With `synthesize`, whatever is already there is reported as created: it appeared
        before the watch did, so inotify will not say so.
        """
        if self._feed is not None:
            return  # a remote stream watches (and scans) new directories itself
        pending = deque([(host, rel)])
        while pending:
            directory, dir_rel = pending.popleft()
            if self.hub._subscribe(self, directory) is None:
                continue
            try:
                entries = self.hub.view.listdir(str(directory))
            except (OSError, MachineError):
                continue
            for name, st in entries:
                entry_rel = (*dir_rel, name)
                is_dir = stat_mod.S_ISDIR(st.st_mode)
                if synthesize and self.scope.visible(entry_rel):
                    self._synthesize(directory / name, is_dir)
                if is_dir and self.scope.descends(entry_rel):
                    pending.append((directory / name, entry_rel))

    def _synthesize(self, host: Path, is_dir: bool) -> None:
        st = _lstat(self.hub, host)
        if st is None:
            return
        seen = self._scanned.get(host)
        if seen is not None and seen.inode == st.st_ino:
            return  # an earlier scan reported it
        self._emit("create", host, is_dir)
        wrote = not is_dir and stat_mod.S_ISREG(st.st_mode) and st.st_size > 0
        if wrote:
            self._emit("write", host, False)
        now = time.monotonic()
        while self._scanned and next(iter(self._scanned.values())).at < now - SCAN_ECHO_SECONDS:
            del self._scanned[next(iter(self._scanned))]
        self._scanned.pop(host, None)
        self._scanned[host] = _Scanned(st.st_ino, st.st_size, st.st_mtime_ns, True, wrote, now)

    def _is_echo(self, change: _Change) -> bool:
        """Whether inotify is repeating what a scan already reported for this file."""
        seen = self._scanned.get(change.host)
        if seen is None:
            return False
        if change.kind not in ("create", "write"):
            del self._scanned[change.host]
            return False
        st = _lstat(self.hub, change.host)
        echo = False
        if change.kind == "create" and seen.create:
            seen.create = False
            echo = st is not None and st.st_ino == seen.inode
        elif change.kind == "write" and seen.write:
            seen.write = False
            echo = st is not None and (st.st_size, st.st_mtime_ns) == (seen.size, seen.mtime_ns)
        if not (seen.create or seen.write):
            del self._scanned[change.host]
        return echo

    def _forget_scanned(self, host: Path | None) -> None:
        if host is not None:
            self._scanned.pop(host, None)

    def _root_gone(self) -> None:
        """The watched directory was deleted or moved away: say so and stop watching."""
        if self.scope.target is None:
            self._emit("remove", self.scope.root, True)
        for wd in list(self._wds):
            self.hub._unsubscribe(self, wd)

    # -- remote changes --------------------------------------------------------------------

    def _wants(self, change: WatchChange) -> bool:
        """Whether a remote change can make an event here (excluded ones are not stat'ed)."""
        if change.event == "overflow":
            return True
        for path in (change.path, change.old_path):
            rel = self.scope.relative(Path(path)) if path is not None else None
            if (rel == () and change.event == "remove") or (rel and self.scope.visible(rel)):
                return True
        return False

    def _record(self, change: WatchChange, meta: _Meta | None) -> bool:
        """A remote change, as this watcher's events; False once the watched root is gone."""
        host = Path(change.path)
        if change.event == "overflow":
            self._lost()
        elif change.event == "remove" and host == self.scope.root:
            self._root_gone()
            return False
        elif change.event in ("create", "write", "remove", "chmod", "rename"):
            old = Path(change.old_path) if change.old_path is not None else None
            kind = cast(ChangeKind, change.event)
            self._apply(_Change(kind, host, meta.is_dir if meta else change.is_dir, old, meta))
        return True


class _Feed:
    """A remote watcher's source: its machine's watch stream, each change with its metadata.

    Metadata is fetched (a stat each) up to MAX_STATS_AHEAD changes ahead of the one being
    recorded, in order, so a burst costs round trips side by side rather than one after
    another. A stream that ends (the connection dropped, the remote watch died) is a loss:
    the watcher reports overflow and the feed watches again every REWATCH_SECONDS, until it
    can, or the watched root is gone, or the watcher is deleted.
    """

    def __init__(self, machine: Watching, watcher: Watcher) -> None:
        self.machine = machine
        self.watcher = watcher
        self._stream: WatchStream | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def recursive(self) -> bool:
        """Whether the stream watches below its root (a watched file's parent needs not)."""
        scope = self.watcher.scope
        return scope.recursive if scope.target is None else len(scope.target) > 1

    async def open(self) -> None:
        """Start the machine's stream; its failure is the caller's (`not_found`, ...)."""
        stream = self.machine.watch(str(self.watcher.scope.root), recursive=self.recursive)
        try:
            await stream.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await stream.aclose()
            raise
        self._stream = stream

    def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"watch-{self.watcher.id}")

    async def stop(self) -> None:
        """End the stream (and what the machine runs for it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._close_stream()

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _run(self) -> None:
        try:
            while self._stream is not None:
                try:
                    if not await self._relay(self._stream):
                        return  # the watched root is gone
                except Exception as exc:
                    log.info("watch %s on %s ended: %s", self.watcher.id, self.watcher.path, exc)
                await self._close_stream()
                self.watcher._lost()
                await self._reopen()
        finally:
            await self._close_stream()

    async def _reopen(self) -> None:
        while self._stream is None:
            await asyncio.sleep(REWATCH_SECONDS)
            try:
                await self.open()
            except FileNotFoundError:
                self.watcher._root_gone()
                return
            except (MachineError, OSError) as exc:
                log.info("watch %s: cannot watch %s again yet: %s", self.watcher.id, self.watcher.path, exc)

    async def _relay(self, stream: WatchStream) -> bool:
        """Record the stream's changes until it fails; False once the watched root went."""
        ahead: asyncio.Queue[tuple[WatchChange, asyncio.Future[_Meta | None]] | Exception]
        ahead = asyncio.Queue(MAX_STATS_AHEAD)
        reader = asyncio.ensure_future(self._read(stream, ahead))
        try:
            while True:
                item = await ahead.get()
                if isinstance(item, Exception):
                    raise item
                change, meta = item
                if not self.watcher._record(change, await meta):
                    return False
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            while not ahead.empty():
                if not isinstance(item := ahead.get_nowait(), Exception):
                    item[1].cancel()

    async def _read(
        self,
        stream: WatchStream,
        ahead: asyncio.Queue[tuple[WatchChange, asyncio.Future[_Meta | None]] | Exception],
    ) -> None:
        try:
            async for change in stream:
                if self.watcher._wants(change):
                    await ahead.put((change, asyncio.ensure_future(self._meta(change))))
        except Exception as exc:
            await ahead.put(exc)
        else:
            await ahead.put(OSError(errno.EIO, "the watch stream ended"))

    async def _meta(self, change: WatchChange) -> _Meta | None:
        if change.event in ("remove", "overflow"):
            return None
        if change.size is not None and change.mtime is not None:
            return _Meta(change.is_dir, change.mtime, change.size, None)  # the source's scan knew
        return await _remote_meta(self.machine, change.path)


async def _remote_meta(machine: Watching, inside: str) -> _Meta | None:
    """What a remote stat says of `inside`; None when it is gone (or the stat failed)."""
    try:
        st = await machine.stat(inside)
    except (MachineError, OSError):
        return None
    return None if st is None else _Meta(st.is_dir, st.mtime, st.size, st.inode or None)


class WatchHub:
    """The watchers of one machine: over one inotify instance and one reader task when it has
    host files, else over one watch stream of the machine's per watcher."""

    def __init__(self, machine: WatchedMachine) -> None:
        self.machine = machine
        self.files: HostMachine | None = machine if isinstance(machine, HostFiles) else None
        """The machine's host files: inotify's source (None: the machine watches itself)."""
        self.watching: Watching | None = None
        if self.files is None and isinstance(machine, Watching):
            self.watching = machine
        self._starting = 0
        self._stopping: set[asyncio.Task[None]] = set()
        self._watchers: dict[str, Watcher] = {}
        self._inotify: Inotify | None = None
        self._reader: asyncio.Task[None] | None = None
        self._dirs: dict[int, _Dir] = {}
        self._modified: dict[FileKey, asyncio.TimerHandle] = {}
        self._fresh: dict[FileKey, None] = {}
        self._moves: dict[int, _Move] = {}
        self._closed = False

    # -- public surface --------------------------------------------------------------------

    @property
    def view(self) -> HostView:
        """The host files' view (what inotify watches through)."""
        if self.files is None:
            raise RuntimeError("a machine without host files has no view")
        return self.files.view

    async def start(
        self, path: str, *, recursive: bool = True, exclude: Iterable[str] | None = None
    ) -> Watcher:
        """Start recording changes under `path` (a directory, or a single file), on any machine."""
        if self.files is not None:
            return self.create(path, recursive=recursive, exclude=exclude)
        machine = self._remote(path)
        with operation("watch", path):
            st = await machine.stat(path)
            if st is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        inside = Path(st.path)
        if st.is_dir:
            excludes = DEFAULT_EXCLUDES if exclude is None else tuple(exclude)
            check_patterns("watch", excludes, path)
            scope = Scope(inside, recursive, excludes)
        else:
            scope = Scope(inside.parent, recursive, (), target=(inside.name,))
        return await self._open_remote(machine, scope, path, str(inside), listed=True)

    def create(self, path: str, *, recursive: bool = True, exclude: Iterable[str] | None = None) -> Watcher:
        """`start`, at once, on a machine with host files."""
        if self.files is None:
            raise WorkspaceError(
                "io_error",
                "Failed to watch path: a remote machine's watchers are started with start()",
                "watch",
                path,
            )
        with operation("watch", path):
            host = Path(self.view.resolve(path))
            st = self.view.stat(str(host))
        if stat_mod.S_ISDIR(st.st_mode):
            excludes = DEFAULT_EXCLUDES if exclude is None else tuple(exclude)
            check_patterns("watch", excludes, path)
            scope = Scope(host, recursive, excludes)
        else:
            scope = Scope(host.parent, recursive, (), target=(host.name,))
        return self._open(scope, path, str(host), listed=True)

    def get(self, watcher_id: str) -> Watcher:
        try:
            return self._watchers[watcher_id]
        except KeyError:
            raise WatcherNotFound(watcher_id) from None

    def delete(self, watcher_id: str) -> None:
        """Stop a watcher: its inotify watches go (unless shared) and its waiters return."""
        watcher = self.get(watcher_id)
        del self._watchers[watcher_id]
        for wd in list(watcher._wds):
            self._unsubscribe(watcher, wd)
        if watcher._feed is not None:
            stopping = asyncio.ensure_future(watcher._feed.stop())
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
        watcher._close()

    def list(self) -> builtins.list[Watcher]:
        return [w for w in self._watchers.values() if w.listed]

    async def close(self) -> None:
        """Delete every watcher, stop the reader and close the inotify instance."""
        self._closed = True
        for watcher_id in builtins.list(self._watchers):
            self.delete(watcher_id)
        for timer in [*self._modified.values(), *(m.timer for m in self._moves.values())]:
            timer.cancel()
        self._modified.clear()
        self._moves.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    # -- creating watchers -----------------------------------------------------------------

    async def _exact(self, path: str) -> Watcher:
        """An unlisted watcher for exactly `path`, which may not exist yet (for `wait_for`)."""
        if self.files is None:
            return await self._exact_remote(path)
        view = self.view
        with operation("watch", path):
            wanted = Path(view.absolute(path))
            root = wanted.parent
            while not self._is_dir(str(root)) and root != root.parent:
                root = root.parent
            real_root = Path(view.resolve(str(root)))  # the nearest existing directory, links resolved
        scope = Scope(real_root, True, (), target=wanted.relative_to(root).parts)
        return self._open(scope, path, str(wanted), listed=False)

    async def _exact_remote(self, path: str) -> Watcher:
        """`_exact` on a remote machine: its stream watches the nearest existing directory."""
        machine = self._remote(path)
        with operation("watch", path):
            here = await machine.stat(".")  # connected from here on: the root is known
            wanted = Path(inside_path(here.path if here is not None else machine.root, path))
            root = wanted.parent
            while root != root.parent and not (
                (meta := await _remote_meta(machine, str(root))) and meta.is_dir
            ):
                root = root.parent
        scope = Scope(root, True, (), target=wanted.relative_to(root).parts)
        return await self._open_remote(machine, scope, path, str(wanted), listed=False)

    def _remote(self, path: str) -> Watching:
        if self.watching is None:
            raise WorkspaceError(
                "io_error", "Failed to watch path: this machine cannot be watched", "watch", path
            )
        return self.watching

    async def _open_remote(
        self, machine: Watching, scope: Scope, path: str, inside: str, *, listed: bool
    ) -> Watcher:
        self._check_room(path)
        watcher = Watcher(self, self._new_id(), scope, inside, listed=listed)
        feed = watcher._feed = _Feed(machine, watcher)
        self._starting += 1  # a slot, held while the machine starts the stream
        try:
            with operation("watch", path):
                await feed.open()
        finally:
            self._starting -= 1
        if self._closed:
            await feed.stop()
            self._check_room(path)
        self._watchers[watcher.id] = watcher
        feed.run()
        return watcher

    async def _stat(self, inside: Path) -> _Meta | None:
        """The file at `inside` now, on either kind of machine."""
        if self.watching is not None:
            return await _remote_meta(self.watching, str(inside))
        return _host_meta(_lstat(self, inside))

    def _is_dir(self, inside: str) -> bool:
        try:
            return stat_mod.S_ISDIR(self.view.stat(inside).st_mode)
        except (OSError, MachineError):
            return False

    def _check_room(self, path: str) -> None:
        if self._closed:
            raise WorkspaceError("io_error", "Failed to watch path: the machine is closing", "watch", path)
        if len(self._watchers) + self._starting >= MAX_WATCHERS_PER_HUB:
            raise TooManyWatchers(MAX_WATCHERS_PER_HUB, path)

    def _open(self, scope: Scope, path: str, inside: str, *, listed: bool) -> Watcher:
        self._check_room(path)
        self._start()
        watcher = Watcher(self, self._new_id(), scope, inside, listed=listed)
        with operation("watch", path):
            watcher._root_wd = self._subscribe(watcher, scope.root, strict=True)
        self._watchers[watcher.id] = watcher
        watcher._enter(scope.root, (), synthesize=False)
        return watcher

    def _new_id(self) -> str:
        while (watcher_id := secrets.token_hex(6)) in self._watchers:
            pass
        return watcher_id

    def _start(self) -> None:
        if self._inotify is None:
            self._inotify = Inotify(cache_size=READ_BATCH_EVENTS)
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="watch-reader")

    # -- directory watches -----------------------------------------------------------------

    def _subscribe(self, watcher: Watcher, host: Path, *, strict: bool = False) -> int | None:
        """Put `watcher` on the inotify watch of directory `host`; its wd, or None if not possible."""
        assert self._inotify is not None
        if len(watcher._wds) >= MAX_WATCHED_DIRS:
            watcher._lost()
            return None
        try:
            with self.view.opendir(str(host), follow=False) as fd:
                watch = self._inotify.add_watch(f"/proc/self/fd/{fd}", DIR_MASK)
        except MachineError:
            if strict:
                raise
            return None
        except OSError as exc:
            if strict:
                raise
            if exc.errno == errno.ENOSPC:  # the kernel's max_user_watches
                watcher._lost()
            return None
        entry = self._dirs.get(watch.wd)
        if entry is None and len(self._dirs) >= MAX_WATCHES_PER_MACHINE:
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(watch)  # a new watch past this machine's bound
            if strict:
                raise TooManyWatches(MAX_WATCHES_PER_MACHINE)
            watcher._lost()
            return None
        if entry is None:
            entry = self._dirs[watch.wd] = _Dir(host, watch, set())
        entry.host = host
        entry.watchers.add(watcher)
        watcher._wds.add(watch.wd)
        return watch.wd

    def _unsubscribe(self, watcher: Watcher, wd: int) -> None:
        watcher._wds.discard(wd)
        entry = self._dirs.get(wd)
        if entry is None:
            return
        entry.watchers.discard(watcher)
        if not entry.watchers:
            del self._dirs[wd]
            if self._inotify is not None:
                with contextlib.suppress(OSError):
                    self._inotify.rm_watch(entry.watch)

    def _dir_is_under(self, wd: int, host: Path) -> bool:
        entry = self._dirs.get(wd)
        return entry is not None and entry.host.is_relative_to(host)

    def _drop_tree(self, host: Path) -> None:
        """Every watch at or below `host` (moved out of every tree): its paths are unknown now."""
        for wd, entry in builtins.list(self._dirs.items()):
            if entry.host.is_relative_to(host):
                for watcher in builtins.list(entry.watchers):
                    self._unsubscribe(watcher, wd)

    def _moved_dir(self, old: Path, new: Path) -> None:
        for entry in self._dirs.values():
            if entry.host.is_relative_to(old):
                entry.host = new / entry.host.relative_to(old)

    def _forget(self, wd: int) -> None:
        """The kernel dropped watch `wd` (its directory is gone)."""
        entry = self._dirs.pop(wd, None)
        if entry is not None:
            for watcher in entry.watchers:
                watcher._wds.discard(wd)
        for key in [k for k in [*self._modified, *self._fresh] if k[0] == wd]:
            self._forget_file(key)

    # -- reading inotify -------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._inotify is not None
        async for raw in self._inotify:
            try:
                self._handle(raw)
            except Exception:
                log.exception("watch: failed to handle %r", raw)
                for watcher in self._watchers.values():
                    watcher._lost()

    def _handle(self, raw: RawEvent) -> None:
        mask = raw.mask
        if Mask.Q_OVERFLOW in mask:
            for watcher in self._watchers.values():
                watcher._lost()
            return
        watch = raw.watch
        if watch is None:
            return
        if Mask.IGNORED in mask:
            self._forget(watch.wd)
            return
        entry = self._dirs.get(watch.wd)
        if entry is None:
            return  # a watch being removed
        if raw.name is None:
            if mask & (Mask.DELETE_SELF | Mask.MOVE_SELF):
                for watcher in builtins.list(entry.watchers):
                    if watcher._root_wd == watch.wd:
                        watcher._root_gone()
            return
        key = (watch.wd, str(raw.name))
        host = entry.host / raw.name
        is_dir = Mask.ISDIR in mask
        if Mask.CREATE in mask:
            self._created(key, host, is_dir)
        elif Mask.MODIFY in mask:
            self._written(key)
        elif Mask.CLOSE_WRITE in mask:
            self._closed_write(key, host)
        elif Mask.ATTRIB in mask:
            if key not in self._fresh:
                self._dispatch(_Change("chmod", host, is_dir), key[0])
        elif Mask.DELETE in mask:
            self._forget_file(key)
            self._dispatch(_Change("remove", host, is_dir), key[0])
        elif Mask.MOVED_FROM in mask:
            self._moved_from(raw.cookie, key, host, is_dir)
        elif Mask.MOVED_TO in mask:
            self._moved_to(raw.cookie, key, host, is_dir)

    def _created(self, key: FileKey, host: Path, is_dir: bool) -> None:
        if not is_dir:
            self._fresh[key] = None
            if len(self._fresh) > MAX_FRESH_FILES:
                del self._fresh[next(iter(self._fresh))]
        self._dispatch(_Change("create", host, is_dir), key[0])

    def _written(self, key: FileKey) -> None:
        if key not in self._modified:
            loop = asyncio.get_running_loop()
            self._modified[key] = loop.call_later(OPEN_WRITE_FLUSH_SECONDS, self._flush_write, key)

    def _closed_write(self, key: FileKey, host: Path) -> None:
        self._fresh.pop(key, None)
        timer = self._modified.pop(key, None)
        if timer is not None:
            timer.cancel()
            self._dispatch(_Change("write", host, False), key[0])

    def _flush_write(self, key: FileKey) -> None:
        """A file still open for writing has been written: report it without waiting for close."""
        entry = self._dirs.get(key[0])
        if self._modified.pop(key, None) is not None and entry is not None:
            self._dispatch(_Change("write", entry.host / key[1], False), key[0])

    def _forget_file(self, key: FileKey) -> None:
        self._fresh.pop(key, None)
        timer = self._modified.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _moved_from(self, cookie: int, key: FileKey, host: Path, is_dir: bool) -> None:
        timer = asyncio.get_running_loop().call_later(MOVE_PAIR_SECONDS, self._moved_out, cookie)
        self._moves[cookie] = _Move(key, host, is_dir, timer)

    def _moved_to(self, cookie: int, key: FileKey, host: Path, is_dir: bool) -> None:
        move = self._moves.pop(cookie, None)
        if move is None:
            self._dispatch(_Change("moved_in", host, is_dir), key[0])
            return
        move.timer.cancel()
        self._carry_file_state(move.key, key)
        if is_dir:
            self._moved_dir(move.host, host)
        self._dispatch(_Change("rename", host, is_dir, move.host), move.key[0], key[0])

    def _moved_out(self, cookie: int) -> None:
        move = self._moves.pop(cookie, None)
        if move is None:
            return
        self._forget_file(move.key)
        self._dispatch(_Change("moved_out", move.host, move.is_dir), move.key[0])
        if move.is_dir:
            self._drop_tree(move.host)

    def _carry_file_state(self, old: FileKey, new: FileKey) -> None:
        if self._fresh.pop(old, 0) is None:
            self._fresh[new] = None
        timer = self._modified.pop(old, None)
        if timer is not None:
            timer.cancel()
            self._written(new)

    def _dispatch(self, change: _Change, *wds: int) -> None:
        """Hand a change to every watcher subscribed to the directories it happened in."""
        watchers: dict[Watcher, None] = {}
        for wd in wds:
            entry = self._dirs.get(wd)
            if entry is not None:
                watchers.update(dict.fromkeys(entry.watchers))
        for watcher in watchers:
            if not watcher.closed:
                watcher._apply(change)


async def wait_for(
    source: WatchHub | WatchedMachine,
    path: str,
    timeout: float,
    event_types: Iterable[str] = EVENT_TYPES,
) -> Event | None:
    """The next change of exactly `path` whose type is in `event_types`, or None on timeout.

    When `create` is asked for and the path already exists, an immediate `create` event is
    returned. A rename onto the path (how uploads and careful writers replace a file)
    answers a wait for `create` or `write` too; the event keeps its type `rename`. The
    directories leading to `path` need not exist yet. Given a machine rather than its hub,
    a short-lived hub is opened for the wait.
    """
    types = set(event_types)
    unknown = types - set(EVENT_TYPES)
    if unknown or not types:
        raise bad_request("watch", f"event_types must be among {', '.join(EVENT_TYPES)}", path)
    if isinstance(source, WatchHub):
        return await _wait(source, path, timeout, types)
    hub = WatchHub(source)
    try:
        return await _wait(hub, path, timeout, types)
    finally:
        await hub.close()


async def _wait(hub: WatchHub, path: str, timeout: float, types: set[str]) -> Event | None:
    watcher = await hub._exact(path)
    try:
        assert watcher.scope.target is not None
        host = watcher.scope.root.joinpath(*watcher.scope.target)
        if "create" in types and (meta := await hub._stat(host)) is not None:
            return watcher._emit("create", host, meta.is_dir, meta=meta)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        cursor = 0
        while not watcher.closed and (remaining := deadline - loop.time()) > 0:
            page = await watcher.poll(cursor, remaining, MAX_POLL_LIMIT)
            for event in page.events:
                if event.type in types or (event.type == "rename" and types & {"create", "write"}):
                    return event
            cursor = page.cursor
        return None
    finally:
        if watcher.id in hub._watchers:
            hub.delete(watcher.id)
