"""The file operations of one machine, whatever its kind: the one place that picks the path.

A machine with the `HostFiles` capability is served by `files.py` on descriptors, with no
process spawn (small files inline on the event loop, anything larger in a worker thread);
every other machine by `remote_files.py` through the `Machine` protocol. The routes, the
editor and the tools call `file_ops(machine)` and never ask which kind they hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from agentbox.machines.base import FileStat, Machine
from agentbox.machines.errors import MachineError
from agentbox.machines.hostfs import HostFiles
from agentbox.workspace import files, remote_files
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
        return await self._offload(
            self._size(path), files.read_text, self.machine, path, start_line, end_line
        )

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


FileOps = HostOps | RemoteOps


def file_ops(machine: Machine) -> FileOps:
    """The file operations for `machine`: by descriptor when it has host files, else by protocol."""
    return HostOps(machine) if isinstance(machine, HostFiles) else RemoteOps(machine)


async def check_user(machine: Machine, user: str | None, op: str, path: str) -> None:
    """Refuse an owner the machine cannot give files to, on routes that create nothing."""
    if user is not None:
        with operation(op, path):
            await file_ops(machine).check_user(user)
