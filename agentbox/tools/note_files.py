"""Where the knowledge index reads its notes: by descriptor on host files, else through the protocol.

The index scans and extracts in worker threads, because a tree walk and a PDF parse must not
hold the event loop. On a machine with the `HostFiles` capability those threads open files
through the machine's descriptor view and never follow a final link (a FIFO or device is
refused before it is opened). On any other machine (ssh, e2b) the same threads hand each call
to the event loop the machine lives on and wait for it. A call that does not answer within
`REMOTE_CALL_SECONDS` fails the file it was for, so a dropped connection or a loop that is
shutting down never leaves a scan hanging. Through the protocol, paths are lexical and the
machine resolves them with its login's rights, as every other tool there does.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import stat as stat_mod
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from agentbox.machines.base import FileStat, Machine
from agentbox.machines.hostfs import HostFiles
from agentbox.workspace import files, remote_files

#: Seconds a worker thread waits for one file call on a machine reached through the protocol.
REMOTE_CALL_SECONDS = 60.0

T = TypeVar("T")


@dataclass(frozen=True)
class NoteStat:
    """What tells a note changed: its modification time and size."""

    mtime_ns: int
    size: int


@dataclass(frozen=True)
class Located:
    """Where a scan of `top` walks, and `top`'s path parts below the index's root."""

    start: str
    base: tuple[str, ...]
    under_root: bool


@dataclass(frozen=True)
class Found:
    """One entry of a walk: its path relative to the walk's start, its inside path, and its stat
    when it is a regular file (None for anything else)."""

    rel: str
    inside: str
    note: NoteStat | None


class NoteFiles(Protocol):
    """The index's reads. Called from worker threads only; missing files raise OSError or MachineError."""

    def locate(self, top: str, root: str) -> Located: ...

    def walk(self, start: str, descend: Callable[[str], bool]) -> Iterator[Found]:
        """Entries below `start` in name order; a directory is entered when `descend(rel)` accepts
        it, never through a link."""
        ...

    def stat(self, inside: str) -> NoteStat | None:
        """The file's stat when it is a regular file (not through a final link), else None."""
        ...

    def read(self, inside: str, limit: int, seen: NoteStat | None = None) -> tuple[NoteStat, bytes | None]:
        """A regular file's stat and bytes, None for the bytes when it is over `limit`. `seen`:
        its stat from a walk or a `stat` just made, which a protocol read need not ask again."""
        ...


def _parts(top: str, root: str) -> Located:
    base_root = root.rstrip("/")
    inner = top.startswith(base_root + "/")
    base = tuple(top[len(base_root) + 1 :].split("/")) if inner else ()
    return Located(top, base, inner or top == root)


class HostNotes:
    """Notes read by descriptor through the machine's view."""

    def __init__(self, machine: HostFiles) -> None:
        self.view = machine.view

    def locate(self, top: str, root: str) -> Located:
        return _parts(self.view.resolve(top), self.view.resolve(root))

    def walk(self, start: str, descend: Callable[[str], bool]) -> Iterator[Found]:
        for node in self.view.walk(start, descend=lambda n: descend(n.rel)):
            regular = stat_mod.S_ISREG(node.st.st_mode)
            yield Found(
                node.rel, node.inside, NoteStat(node.st.st_mtime_ns, node.st.st_size) if regular else None
            )

    def stat(self, inside: str) -> NoteStat | None:
        st = self.view.lstat(inside)
        return NoteStat(st.st_mtime_ns, st.st_size) if stat_mod.S_ISREG(st.st_mode) else None

    def read(self, inside: str, limit: int, seen: NoteStat | None = None) -> tuple[NoteStat, bytes | None]:
        fd = self.view.open(inside, os.O_RDONLY, follow=False)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat_mod.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, f"{inside} is not a regular file")
            note = NoteStat(st.st_mtime_ns, st.st_size)
            if st.st_size > limit:
                return note, None
            data = files.read_up_to(f, st.st_size, limit)
        return note, None if len(data) > limit else data


def _note(st: FileStat) -> NoteStat | None:
    regular = st.is_file and not st.is_symlink
    return NoteStat(round(st.mtime * 1_000_000_000), st.size) if regular else None


class ProtocolNotes:
    """Notes read through the `Machine` protocol, each call run on the machine's event loop."""

    def __init__(self, machine: Machine, loop: asyncio.AbstractEventLoop) -> None:
        self.machine = machine
        self.loop = loop

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        try:
            return future.result(REMOTE_CALL_SECONDS)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                errno.ETIMEDOUT, f"no answer from the machine in {REMOTE_CALL_SECONDS:g} s"
            ) from None

    def locate(self, top: str, root: str) -> Located:
        shown = remote_files.shown_path
        return _parts(shown(self.machine, top), shown(self.machine, root))

    def walk(self, start: str, descend: Callable[[str], bool]) -> Iterator[Found]:
        """Depth first, one `Machine.list` (one bounded call) per directory."""
        stack: list[tuple[str, str]] = [(start, "")]
        while stack:
            inside, rel = stack.pop()
            try:
                children = self._run(self.machine.list(inside))
            except (FileNotFoundError, NotADirectoryError):  # gone since its parent was listed
                continue
            below: list[tuple[str, str]] = []
            for child in sorted(children, key=lambda c: c.name):
                found = Found(posixpath.join(rel, child.name), child.path, _note(child.stat))
                yield found
                if child.stat.is_dir and not child.stat.is_symlink and descend(found.rel):
                    below.append((child.path, found.rel))
            stack.extend(reversed(below))

    def stat(self, inside: str) -> NoteStat | None:
        st = self._run(self.machine.stat(inside))
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), inside)
        return _note(st)

    def read(self, inside: str, limit: int, seen: NoteStat | None = None) -> tuple[NoteStat, bytes | None]:
        note = seen or self.stat(inside)
        if note is None:
            raise IsADirectoryError(errno.EISDIR, f"{inside} is not a regular file")
        if note.size > limit:
            return note, None
        data = self._run(self.machine.read(inside, length=note.size + 1))  # one more: it grew
        if len(data) > note.size:  # written to since it was seen: all of it, up to the limit
            data = self._run(self.machine.read(inside, length=limit + 1))
            note = NoteStat(note.mtime_ns, len(data))
        return note, None if len(data) > limit else data


def note_files(machine: Machine, loop: asyncio.AbstractEventLoop | None = None) -> NoteFiles:
    """How the index reads `machine`: its descriptor view, or its protocol on `loop` (by default
    the running one, so call this on the loop)."""
    if isinstance(machine, HostFiles):
        return HostNotes(machine)
    return ProtocolNotes(machine, loop or asyncio.get_running_loop())
