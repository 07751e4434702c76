"""The file operations of one machine, whatever its kind: the one place that picks the path.

A machine with the `HostFiles` capability is served by `files.py` on descriptors, with no
process spawn (small files inline on the event loop, anything larger in a worker thread);
every other machine by `remote_files.py` through the `Machine` protocol. The routes, the
editor and the tools call `file_ops(machine)` and never ask which kind they hold.

Two levels: the API's operations (`read_text`, `list_dir`, `upload`, ... with their results
and limits), and the primitives the tools build on (`resolve`, `within_root`, `lstat`,
`read_bytes`, `read_head`, `content_hash`, `write_bytes`, `write_new`, `rename`, `walk`, ...).
On host files the primitives resolve links inside the machine's view, by descriptor; through
the protocol paths are lexical and the machine resolves them itself, so `resolve` there cannot
see where a link leads, mounts are unknown (`is_mount_root` is only `/`, `same_mount` always
true: the machine's rename refuses EXDEV itself), and `rename(replace=False)` is a check then
the rename, racy against a concurrent creator (`write_new` and `create` are exclusive creates
on the machine itself).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import itertools
import os
import posixpath
import stat as stat_mod
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from agentbox.machines.base import FileStat, Machine, inside_path
from agentbox.machines.errors import MachineError
from agentbox.machines.hostfs import HostFiles, to_stat
from agentbox.machines.hostview import HostView, Node
from agentbox.workspace import files, remote_files, remote_tree, tree
from agentbox.workspace.errors import operation

#: Files up to this size are read or written on the event loop: a thread hop costs more.
INLINE_IO_BYTES = 64 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class Download:
    """A checked regular file, how to stream a byte range of it and how to tell it changed."""

    path: str
    size: int
    mtime: float
    inode: int
    """0 where the machine reports none (SFTP)."""
    chunks: Callable[[int, int | None], AsyncIterator[bytes]]
    """(start, end inclusive or None) -> the bytes."""
    unchanged: Callable[[], Awaitable[bool]]
    """Whether the file is still the one that was checked (inode, size, mtime)."""

    @property
    def etag(self) -> str:
        return f'"{self.inode:x}-{self.size:x}-{int(self.mtime * 1e9):x}"'


async def in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterator's items, each fetched in a worker thread; closed when done or dropped."""
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def host_unchanged(target: files.DownloadTarget) -> bool:
    try:
        st = target.machine.view.stat(target.path)
    except (OSError, MachineError):
        return False
    return (st.st_ino, st.st_size, st.st_mtime) == (target.inode, target.size, target.mtime)


@dataclass(frozen=True)
class Resolved:
    """A path as asked (absolute inside path) and where it leads (inside path, links resolved)."""

    requested: str
    inside: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.inside)


@dataclass(frozen=True)
class WalkNode:
    """One entry of a walk: its path relative to the walk's start, its inside path, its lstat."""

    rel: str
    name: str
    inside: str
    stat: FileStat
    """As `lstat` gives it: a symlink is described as itself."""


def within(root: str, inside: str) -> bool:
    base = root.rstrip("/")
    return inside == root or inside.startswith(base + "/") or base == ""


def below(folder: str, inside: str) -> bool:
    """Whether `inside` is strictly below `folder` (not the folder itself)."""
    return inside != folder and within(folder, inside)


def _head(view: HostView, path: str, length: int, follow: bool) -> bytes:
    fd = view.open(path, os.O_RDONLY, follow=follow)
    try:
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        chunks: list[bytes] = []
        left = length
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def host_content_hash(machine: HostFiles, path: str, chunk: int) -> tuple[str, int] | None:
    """sha256 and size of a regular file, read by descriptor `chunk` bytes at a time; None
    when there is no regular file to open there."""
    try:
        fd = machine.view.open(path, os.O_RDONLY)
    except (OSError, MachineError):
        return None
    if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        digest = hashlib.sha256()
        size = 0
        while data := f.read(chunk):
            digest.update(data)
            size += len(data)
    return digest.hexdigest(), size


def host_write_new(machine: HostFiles, path: str, data: bytes) -> None:
    """Create the file exclusively (`O_EXCL` in its resolved parent) for the default owner."""
    fd = machine.view.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        owner = files.new_owner(machine, None)
        if owner is not None:
            os.fchown(fd, *owner)
        files.write_all(fd, data)
    finally:
        os.close(fd)


class HostOps:
    """`files.py` on a host-file machine, off the event loop when the work may be large."""

    def __init__(self, machine: HostFiles) -> None:
        self.machine = machine

    async def _offload(self, size: int | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if size is not None and size <= INLINE_IO_BYTES:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    def _size(self, path: str) -> int | None:
        """The file's size if it is cheap to tell; None sends the real operation (and its errors) to a thread."""
        try:
            return int(self.machine.view.stat(path).st_size)
        except Exception:
            return None

    def shown_path(self, path: str) -> str:
        return files.shown_path(self.machine, path)

    async def check_user(self, user: str) -> None:
        self.machine.owner_of(user)

    async def exists(self, path: str) -> bool:
        return files.lstat_or_none(self.machine, path, follow=True) is not None

    async def read_text(self, path: str, start_line: int | None, end_line: int | None) -> files.ReadResult:
        """Opened on the loop (one resolution of the path), read there or in a thread by its size."""
        opened = files.open_text(self.machine, path, start_line, end_line)
        return await self._offload(opened.size, opened.read)

    async def write_file(
        self, path: str, data: bytes, *, append: bool = False, user: str | None = None
    ) -> files.WriteResult:
        return await self._offload(
            len(data), files.write_file, self.machine, path, data, append=append, user=user
        )

    async def mkdir(self, path: str, *, parents: bool = False, user: str | None = None) -> files.MkdirResult:
        return await self._offload(0, files.mkdir, self.machine, path, parents=parents, user=user)

    async def list_dir(self, path: str, **options: Any) -> files.ListResult:
        return await asyncio.to_thread(files.list_dir, self.machine, path, **options)

    async def search(self, path: str, pattern: str, **options: Any) -> files.SearchResult:
        return await asyncio.to_thread(files.search, self.machine, path, pattern, **options)

    async def glob_files(self, path: str, pattern: str, **options: Any) -> files.GlobResult:
        return await asyncio.to_thread(files.glob_files, self.machine, path, pattern, **options)

    async def upload(
        self, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
    ) -> files.UploadResult:
        return await files.upload(self.machine, path, chunks, user=user)

    async def download(self, path: str) -> Download:
        target = await asyncio.to_thread(files.download, self.machine, path)
        return Download(
            target.path, target.size, target.mtime, target.inode,
            lambda start, end: in_thread(files.iter_download(target, start, end)),
            lambda: asyncio.to_thread(host_unchanged, target),
        )  # fmt: skip

    async def remove(self, path: str, *, recursive: bool = False) -> str:
        return await asyncio.to_thread(files.remove, self.machine, path, recursive=recursive)

    async def stat(self, path: str) -> FileStat:
        return files.stat(self.machine, path)

    async def tar_stream(self, path: str) -> AsyncIterator[bytes]:
        return in_thread(await asyncio.to_thread(tree.tar_stream, self.machine, path))

    async def untar(
        self, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
    ) -> tree.TreeResult:
        return await tree.untar(self.machine, path, chunks, user=user)

    # primitives ------------------------------------------------------------------------

    def absolute(self, path: str) -> str:
        """`path` as an absolute inside path, lexically (nothing resolved)."""
        return self.machine.view.absolute(path)

    def resolve(self, path: str, *, write: bool = False, follow: bool = True) -> Resolved:
        view = self.machine.view
        return Resolved(view.absolute(path), view.resolve(path, follow=follow, missing_ok=True, write=write))

    def is_mount_root(self, inside: str) -> bool:
        """`/` or where the machine mounts a folder: never moved or deleted."""
        return bool(self.machine.view.is_mount_root(inside))

    def same_mount(self, a: str, b: str) -> bool:
        """Whether a rename from `a` to `b` stays on one mount (else it would be EXDEV)."""
        view = self.machine.view
        return view.mount_for(a) == view.mount_for(b)

    def within_root(self, inside: str) -> bool:
        return bool(self.machine.view.within_root(inside))

    async def lstat(self, path: str, *, follow: bool = False) -> FileStat | None:
        """`path` as itself (with `follow`, what a final link leads to), or None when missing."""
        st = files.lstat_or_none(self.machine, path, follow=follow)
        if st is None:
            return None
        return to_stat(self.machine.view.absolute(path), st, stat_mod.S_ISLNK(st.st_mode))

    async def read_bytes(self, path: str, limit: int) -> bytes:
        """A regular file's bytes (by descriptor, never through a swapped-in link); EFBIG past `limit`."""
        size = self._size(path)
        return await self._offload(size, self.machine.view.read_bytes, path, limit)

    async def content_hash(self, path: str, chunk: int) -> tuple[str, int] | None:
        """sha256 (hex) and size of the regular file `path` leads to; None when there is none."""
        return await self._offload(self._size(path), host_content_hash, self.machine, path, chunk)

    async def write_bytes(self, path: str, data: bytes) -> None:
        """Write in place (the inode is kept), created for the machine's default owner if missing."""
        owner = files.new_owner(self.machine, None)
        await self._offload(len(data), files.write_in_place, self.machine, path, data, owner=owner)

    async def read_head(self, path: str, length: int, *, follow: bool = True) -> bytes:
        """At most `length` bytes from the start of a regular file, by descriptor (a final link
        followed inside the view only, or with `follow` False refused; a FIFO or device is
        refused, never opened)."""
        return await self._offload(length, _head, self.machine.view, path, length, follow)

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """A new file, created exclusively (O_EXCL, no final link followed): `Machine.create`."""
        return await self.machine.create(path, chunks, limit=limit)

    async def contained(self, top: str, path: str) -> str | None:
        """Where `path` leads when that is strictly below the folder `top` (both resolved
        through the view, links followed inside the machine), else None. Missing: ENOENT."""
        view = self.machine.view
        real_top = top if top == "/" else view.resolve(top)  # the top of the view is its own resolution
        real = view.resolve(path)
        if not below(real_top, real):
            return None
        if not view.exists(real):  # a missing last name resolves as written
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return real

    async def write_new(self, path: str, data: bytes) -> None:
        """Create the file, atomically refused (FileExistsError) when anything is there; a
        missing parent is FileNotFoundError. New files get the machine's default owner."""
        await self._offload(len(data), host_write_new, self.machine, path, data)

    async def makedirs(self, path: str) -> None:
        self.machine.view.makedirs(path, owner=files.new_owner(self.machine, None))

    async def unlink(self, path: str) -> None:
        self.machine.view.unlink(path)

    async def rmdir(self, path: str) -> None:
        """Remove an empty directory (never a file, never through a link)."""
        self.machine.view.rmdir(path)

    async def rename(self, src: str, dst: str, *, replace: bool = True) -> None:
        """Without `replace`, an existing `dst` is FileExistsError, atomically (RENAME_NOREPLACE)."""
        self.machine.view.rename(src, dst, replace=replace)

    async def listdir(self, path: str) -> list[WalkNode]:
        inside = self.machine.view.absolute(path)
        return [
            WalkNode(
                name,
                name,
                posixpath.join(inside, name),
                to_stat(posixpath.join(inside, name), st, stat_mod.S_ISLNK(st.st_mode)),
            )
            for name, st in await asyncio.to_thread(self.machine.view.listdir, path)
        ]

    async def walk(
        self,
        path: str,
        *,
        max_depth: int | None = None,
        descend: Callable[[WalkNode], bool] | None = None,
        limit: int = files.MAX_SEARCH_SCANNED,
    ) -> list[WalkNode]:
        """Entries below the directory `path`, depth first in name order, never through a link:
        at most `limit` of them (a caller that gets `limit` knows it may have been cut)."""

        def node(n: Node) -> WalkNode:
            return WalkNode(n.rel, n.name, n.inside, to_stat(n.inside, n.st, n.is_symlink))

        def run() -> list[WalkNode]:
            keep = None if descend is None else (lambda n: descend(node(n)))
            walk = self.machine.view.walk(path, max_depth=max_depth, descend=keep)
            return [node(n) for n in itertools.islice(walk, limit)]

        return await asyncio.to_thread(run)


class RemoteOps:
    """`remote_files.py` on any machine, through the `Machine` protocol only."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    def shown_path(self, path: str) -> str:
        return remote_files.shown_path(self.machine, path)

    async def check_user(self, user: str) -> None:
        await self.machine.user_ids(user)

    async def exists(self, path: str) -> bool:
        return await remote_files.stat_or_none(self.machine, path) is not None

    async def read_text(self, path: str, start_line: int | None, end_line: int | None) -> files.ReadResult:
        return await remote_files.read_text(self.machine, path, start_line, end_line)

    async def write_file(
        self, path: str, data: bytes, *, append: bool = False, user: str | None = None
    ) -> files.WriteResult:
        return await remote_files.write_file(self.machine, path, data, append=append, user=user)

    async def mkdir(self, path: str, *, parents: bool = False, user: str | None = None) -> files.MkdirResult:
        return await remote_files.mkdir(self.machine, path, parents=parents, user=user)

    async def list_dir(self, path: str, **options: Any) -> files.ListResult:
        return await remote_files.list_dir(self.machine, path, **options)

    async def search(self, path: str, pattern: str, **options: Any) -> files.SearchResult:
        return await remote_files.search(self.machine, path, pattern, **options)

    async def glob_files(self, path: str, pattern: str, **options: Any) -> files.GlobResult:
        return await remote_files.glob_files(self.machine, path, pattern, **options)

    async def upload(
        self, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
    ) -> files.UploadResult:
        return await remote_files.upload(self.machine, path, chunks, user=user)

    async def download(self, path: str) -> Download:
        target = await remote_files.download(self.machine, path)
        return Download(
            target.path, target.size, target.mtime, 0,
            lambda start, end: remote_files.iter_download(target, start, end),
            lambda: remote_files.unchanged(target),
        )  # fmt: skip

    async def remove(self, path: str, *, recursive: bool = False) -> str:
        return await remote_files.remove(self.machine, path, recursive=recursive)

    async def stat(self, path: str) -> FileStat:
        return await remote_files.stat(self.machine, path)

    async def tar_stream(self, path: str) -> AsyncIterator[bytes]:
        return await remote_tree.tar_stream(self.machine, path)

    async def untar(
        self, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
    ) -> tree.TreeResult:
        return await remote_tree.untar(self.machine, path, chunks, user=user)

    # primitives ------------------------------------------------------------------------

    def absolute(self, path: str) -> str:
        return inside_path(self.machine.root, path)

    def resolve(self, path: str, *, write: bool = False, follow: bool = True) -> Resolved:
        inside = remote_files.shown_path(self.machine, path)
        return Resolved(inside, inside)

    def is_mount_root(self, inside: str) -> bool:
        """Only `/`: the machine's mounts are not known from here (it refuses to move them itself)."""
        return self.absolute(inside) == "/"

    def same_mount(self, a: str, b: str) -> bool:
        """Not known from here: the machine's own rename fails across devices."""
        return True

    def within_root(self, inside: str) -> bool:
        return within(self.machine.root, remote_files.shown_path(self.machine, inside))

    async def lstat(self, path: str, *, follow: bool = False) -> FileStat | None:
        """What `Machine.stat` says (a link is described by its target either way)."""
        return await remote_files.stat_or_none(self.machine, path)

    async def read_bytes(self, path: str, limit: int) -> bytes:
        return await self.machine.read(self.shown_path(path), limit=limit)

    async def content_hash(self, path: str, chunk: int) -> tuple[str, int] | None:
        """sha256 and size, read by offset `chunk` bytes at a time; None when `path` leads to
        no regular file. A file that grows meanwhile is hashed to the size `stat` saw."""
        shown = self.shown_path(path)
        try:
            st = await self.machine.stat(shown)
            if st is None or not st.is_file:
                return None
            digest = hashlib.sha256()
            size = 0
            while size < st.size:
                data = await self.machine.read(shown, offset=size, length=min(chunk, st.size - size))
                if not data:
                    break
                digest.update(data)
                size += len(data)
        except (OSError, MachineError):
            return None
        return digest.hexdigest(), size

    async def write_bytes(self, path: str, data: bytes) -> None:
        await self.machine.write(self.shown_path(path), data)

    async def read_head(self, path: str, length: int, *, follow: bool = True) -> bytes:
        """At most `length` bytes from the start of a regular file (anything else is refused
        before it is opened: a FIFO would block the machine's file channel). The machine
        follows links itself, whatever `follow` says: check the path with `contained` first."""
        files.require_regular(await remote_files.require_stat(self.machine, path), "read", path)
        return await self.machine.read(self.shown_path(path), length=length)

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        return await self.machine.create(self.shown_path(path), chunks, limit=limit)

    async def contained(self, top: str, path: str) -> str | None:
        """`path` when it is strictly below the folder `top` with no link on the way, else None.

        A link's target cannot be seen through the protocol, so any link is refused wherever
        it leads; only the part below the machine's root is checked (what is above it is the
        machine's own layout, not the workspace's content). Missing: ENOENT. The machine
        follows paths itself, so this holds at the time of the check only."""
        inside, top_inside = self.shown_path(path), self.shown_path(top)
        if not below(top_inside, inside):
            return None
        base = self.machine.root if within(self.machine.root, inside) else top_inside
        steps = [step for step in inside[len(base.rstrip("/")) + 1 :].split("/") if step]
        paths = [posixpath.join(base, *steps[: n + 1]) for n in range(len(steps))]
        stats = await asyncio.gather(*(self.machine.stat(p) for p in paths))
        if any(st is None for st in stats):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return None if any(st is not None and st.is_symlink for st in stats) else inside

    async def write_new(self, path: str, data: bytes) -> None:
        """Create the file, refused (FileExistsError) when anything is there: `Machine.create`,
        an exclusive create on the machine itself; a missing parent is FileNotFoundError."""

        async def body() -> AsyncIterator[bytes]:
            yield data

        await self.machine.create(self.shown_path(path), body(), limit=len(data))

    async def makedirs(self, path: str) -> None:
        await self.machine.mkdir(self.shown_path(path), parents=True)

    async def unlink(self, path: str) -> None:
        await self.machine.remove(self.shown_path(path))

    async def rmdir(self, path: str) -> None:
        shown = self.shown_path(path)
        st = await self.machine.stat(shown)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if not st.is_dir or st.is_symlink:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        await self.machine.remove(shown)

    async def rename(self, src: str, dst: str, *, replace: bool = True) -> None:
        """Without `replace`, an existing `dst` is FileExistsError: a check, then the machine's
        rename (racy against a concurrent creator, unlike the host's RENAME_NOREPLACE)."""
        target = self.shown_path(dst)
        if not replace and await self.machine.stat(target) is not None:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        await self.machine.rename(self.shown_path(src), target)

    async def listdir(self, path: str) -> list[WalkNode]:
        return [
            WalkNode(e.name, e.name, e.path, e.stat) for e in await self.machine.list(self.shown_path(path))
        ]

    async def walk(
        self,
        path: str,
        *,
        max_depth: int | None = None,
        descend: Callable[[WalkNode], bool] | None = None,
        limit: int = files.MAX_SEARCH_SCANNED,
    ) -> list[WalkNode]:
        def keep(n: remote_files.RemoteNode) -> bool:
            return descend is None or descend(WalkNode(n.rel, n.name, n.inside, n.stat))

        return [
            WalkNode(n.rel, n.name, n.inside, n.stat)
            async for n in remote_files.walk(
                self.machine, self.shown_path(path), max_depth=max_depth, descend=keep
            )
        ]


FileOps = HostOps | RemoteOps


def file_ops(machine: Machine) -> FileOps:
    """The file operations for `machine`: by descriptor when it has host files, else by protocol."""
    return HostOps(machine) if isinstance(machine, HostFiles) else RemoteOps(machine)


async def check_user(machine: Machine, user: str | None, op: str, path: str) -> None:
    """Refuse an owner the machine cannot give files to, on routes that create nothing."""
    if user is not None:
        with operation(op, path):
            await file_ops(machine).check_user(user)
