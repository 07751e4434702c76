"""`HostFiles`: the declared capability of machines whose files the server reaches directly.

`local` and `sandbox` have it: their `view` (`hostview.HostView`) opens every file relative to
a descriptor of the mount it lives on, with no process spawn and no path ever resolved by name
on the host. The workspace layer works through `view`; the `Machine` file methods here are the
same operations for callers that only know the protocol. New files and directories get the
machine's default owner so that its processes can use them.
"""

from __future__ import annotations

import asyncio
import os
import stat as stat_mod

from agentbox.machines.base import ExecRequest, FileEntry, FileStat, Process
from agentbox.machines.errors import MachineError, OwnerUnsupported
from agentbox.machines.hostview import HostView

Owner = tuple[int, int]
#: Largest file `HostFiles.read` returns whole.
MAX_MACHINE_READ_BYTES = 64 * 1024 * 1024


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

    async def read(self, path: str) -> bytes:
        return await asyncio.to_thread(self.view.read_bytes, path, MAX_MACHINE_READ_BYTES)

    async def write(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, path, data)

    def _write(self, path: str, data: bytes) -> None:
        fd = self.view.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            owner = self.default_owner()
            if owner is not None and os.fstat(fd).st_uid != owner[0]:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
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
