"""`HostFiles`: the declared capability of machines whose files the server reaches directly.

`local` and `sandbox` have it: their `view` (`hostview.HostView`) opens every file relative to
a descriptor of the mount it lives on, with no process spawn and no path ever resolved by name
on the host. The workspace layer works through `view`; the `Machine` file methods here are the
same operations for callers that only know the protocol. New files and directories get the
machine's default owner so that its processes can use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import stat as stat_mod
import uuid
from collections.abc import AsyncIterable

from agentbox.machines.base import MAX_MACHINE_READ_BYTES, ExecRequest, FileEntry, FileStat, Process
from agentbox.machines.errors import MachineError, OwnerUnsupported
from agentbox.machines.hostview import HostView

Owner = tuple[int, int]
#: Flags of the part `write_stream` stages beside its target.
_PART_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Where `find_program` looks, in order: the directories of a machine's default PATH.
PROGRAM_DIRS = ("/usr/local/bin", "/usr/bin", "/bin")
#: Flags of a file `create` makes (the view adds no-follow and close-on-exec).
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def to_stat(inside: str, st: os.stat_result, is_symlink: bool = False) -> FileStat:
    return FileStat(
        path=inside,
        is_dir=stat_mod.S_ISDIR(st.st_mode),
        is_file=stat_mod.S_ISREG(st.st_mode),
        is_symlink=is_symlink,
        size=st.st_size,
        mtime=st.st_mtime,
        mode=stat_mod.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        inode=st.st_ino,
    )


class HostFiles:
    """Machine file methods over a `HostView`; `view`, `owner` and `users` come from the kind."""

    name: str
    view: HostView
    root: str
    ripgrep: str
    """Where `rg` is inside this machine (a search runs as one of its commands)."""
    owner: Owner | None = None
    #: Inside user names this machine can give files to, mapped to host (uid, gid).
    users: dict[str, Owner] = {}

    async def spawn(self, request: ExecRequest) -> Process:
        raise NotImplementedError

    def default_owner(self) -> Owner | None:
        """The host uid/gid new files get so the machine's processes can use them (root only)."""
        return self.owner if os.geteuid() == 0 else None

    def owner_of(self, user: str) -> Owner:
        if user in self.users:
            return self.users[user]
        raise OwnerUnsupported(f"this machine cannot give files to user {user!r}", path=None)

    def inside_ids(self, uid: int, gid: int) -> Owner:
        """The (uid, gid) the machine's processes see for a file the host sees owned by (uid, gid):
        the same where the machine shares the host's ids (local, docker); kinds with their own
        user namespace map them."""
        return uid, gid

    async def find_program(self, name: str) -> str | None:
        """`rg` is the one the kind names; anything else is looked up in `PROGRAM_DIRS` as the
        machine sees them (a directory outside the view finds nothing)."""
        if name == "rg":
            return self.ripgrep
        if not name or "/" in name or "\0" in name:
            return None
        for directory in PROGRAM_DIRS:
            path = f"{directory}/{name}"
            try:
                found = await self.stat(path)
            except (MachineError, OSError):
                continue
            if found is not None and found.is_file and found.mode & 0o111:
                return path
        return None

    async def user_ids(self, user: str) -> Owner:
        return self.owner_of(user)

    async def read(
        self, path: str, *, offset: int = 0, length: int | None = None, limit: int = MAX_MACHINE_READ_BYTES
    ) -> bytes:
        if offset == 0 and length is None:
            return await asyncio.to_thread(self.view.read_bytes, path, limit)
        return await asyncio.to_thread(self._read_range, path, offset, length, limit)

    def _read_range(self, path: str, offset: int, length: int | None, limit: int) -> bytes:
        fd = self.view.open(path, os.O_RDONLY)
        try:
            if stat_mod.S_ISDIR(os.fstat(fd).st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            want = limit + 1 if length is None else length
            data = os.pread(fd, want, offset)
        finally:
            os.close(fd)
        if length is None and len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        return data

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        target = self.view.resolve(path, missing_ok=True, write=True)
        part = posixpath.join(posixpath.dirname(target), f".agentbox-{uuid.uuid4().hex}.part")
        fd = self.view.open(part, _PART_FLAGS, follow=False)
        try:
            size = await self._fill(fd, chunks, limit, path)
            await asyncio.to_thread(os.fsync, fd)
            os.close(fd)
            fd = -1
            self.view.rename(part, target)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                self.view.unlink(part)
            except OSError:
                pass
            raise
        return size

    async def _fill(self, fd: int, chunks: AsyncIterable[bytes], limit: int, path: str) -> int:
        """Give the new file `fd` to the default owner and write `chunks` to it; EFBIG past `limit`."""
        owner = self.default_owner()
        if owner is not None:
            os.fchown(fd, *owner)
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path)
            await asyncio.to_thread(_write_all, fd, chunk)
        return size

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        fd = self.view.open(path, _NEW_FLAGS, 0o644, follow=False)
        try:
            size = await self._fill(fd, chunks, limit, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError, MachineError):
                self.view.unlink(path)
            raise
        os.close(fd)
        return size

    async def write(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, path, data)

    def _write(self, path: str, data: bytes) -> None:
        fd = self.view.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            owner = self.default_owner()
            if owner is not None and os.fstat(fd).st_uid != owner[0]:
                os.fchown(fd, *owner)
            _write_all(fd, data)
        finally:
            os.close(fd)

    async def stat(self, path: str) -> FileStat | None:
        try:
            lst = self.view.lstat(path)
            st = self.view.stat(path) if stat_mod.S_ISLNK(lst.st_mode) else lst
        except FileNotFoundError:
            return None
        return to_stat(self.view.absolute(path), st, stat_mod.S_ISLNK(lst.st_mode))

    async def list(self, path: str) -> list[FileEntry]:
        inside = self.view.resolve(path)
        entries = []
        for name, st in self.view.listdir(path):
            child = inside.rstrip("/") + "/" + name
            link = stat_mod.S_ISLNK(st.st_mode)
            if link:  # the target as the machine sees it, never the host's
                try:
                    st = self.view.stat(child)
                except (OSError, MachineError):
                    pass
            entries.append(FileEntry(name, child, to_stat(child, st, link)))
        return entries

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        self.view.remove(path, recursive=recursive)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        if not parents:
            self.view.mkdir(path, owner=self.default_owner())
        elif not self.view.exists(path) or not stat_mod.S_ISDIR(self.view.stat(path).st_mode):
            self.view.makedirs(path, owner=self.default_owner())

    async def rename(self, src: str, dst: str) -> None:
        self.view.rename(src, dst)

    async def chown(self, path: str, user: str) -> None:
        self.view.chown(path, *self.owner_of(user))

    async def readlink(self, path: str) -> str:
        with self.view.at(path, follow=False) as at:
            return os.readlink(at.name, dir_fd=at.fd)

    async def symlink(self, target: str, path: str) -> None:
        with self.view.at(path, follow=False, write=True) as at:
            os.symlink(target, at.name, dir_fd=at.fd)
            owner = self.default_owner()
            if owner is not None:
                os.chown(at.name, *owner, dir_fd=at.fd, follow_symlinks=False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
