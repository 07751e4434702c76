"""File methods of the `Machine` protocol for machines whose files are host files.

`local` and `sandbox` share this: every method resolves through the machine's `PathMap`
and then works on the host path directly, with no process spawn. New files and
directories get the machine's default owner so that its processes can use them.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat as stat_mod
from pathlib import Path

from agentbox.machines.base import FileEntry, FileStat
from agentbox.machines.errors import MachineError, OwnerUnsupported
from agentbox.machines.pathmap import PathMap, open_nofollow


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
    """Host-path implementations of read/write/list/stat/remove/mkdir/rename/chown."""

    paths: PathMap
    owner: tuple[int, int] | None = None
    #: Inside user names this machine can give files to, mapped to host (uid, gid).
    users: dict[str, tuple[int, int]] = {}

    def host_path(self, path: str, *, write: bool = False, follow: bool = True) -> Path:
        return self.paths.resolve(path, write=write, follow=follow)

    def inside_path(self, host: Path) -> str:
        return self.paths.to_inside(host)

    def default_owner(self) -> tuple[int, int] | None:
        return self.owner

    def give(self, host: Path, owner: tuple[int, int] | None = None) -> None:
        """Hand a file the server created to the machine's user (no-op when not root)."""
        uid_gid = owner or self.owner
        if uid_gid is not None and os.geteuid() == 0:
            os.lchown(host, *uid_gid)

    def owner_of(self, user: str) -> tuple[int, int]:
        if user in self.users:
            return self.users[user]
        raise OwnerUnsupported(f"this machine cannot give files to user {user!r}", path=None)

    async def read(self, path: str) -> bytes:
        host = self.host_path(path)
        fd = open_nofollow(host, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            if stat_mod.S_ISDIR(os.fstat(f.fileno()).st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            return f.read()

    async def write(self, path: str, data: bytes) -> None:
        host = self.host_path(path, write=True)
        existed = host.exists()
        fd = open_nofollow(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if not existed:
            self.give(host)

    async def stat(self, path: str) -> FileStat | None:
        inside = self.paths.absolute(path)
        try:
            link = self.host_path(path, follow=False)
            is_link = link.is_symlink()
            host = self.host_path(path)
            return to_stat(inside, host.stat(), is_link)
        except FileNotFoundError:
            return None

    async def list(self, path: str) -> list[FileEntry]:
        host = self.host_path(path)
        inside = self.paths.absolute(path)
        entries = []
        with os.scandir(host) as it:
            for e in it:
                child = inside.rstrip("/") + "/" + e.name
                st = e.stat(follow_symlinks=False)
                if e.is_symlink():  # the target as the machine sees it, never the host's
                    try:
                        st = self.host_path(child).stat()
                    except (OSError, MachineError):
                        pass
                entries.append(FileEntry(e.name, child, to_stat(child, st, e.is_symlink())))
        return sorted(entries, key=lambda e: e.name)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        host = self.host_path(path, write=True, follow=False)
        if host.is_dir() and not host.is_symlink():
            if recursive:
                shutil.rmtree(host)
            else:
                host.rmdir()
        else:
            host.unlink()

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        host = self.host_path(path, write=True)
        if parents:
            missing = []
            p = host
            while not p.exists():
                missing.append(p)
                p = p.parent
            host.mkdir(parents=True, exist_ok=True)
            for m in missing:
                self.give(m)
        else:
            host.mkdir()
            self.give(host)

    async def rename(self, src: str, dst: str) -> None:
        os.rename(
            self.host_path(src, write=True, follow=False), self.host_path(dst, write=True, follow=False)
        )

    async def chown(self, path: str, user: str) -> None:
        host = self.host_path(path, write=True, follow=False)
        uid, gid = self.owner_of(user)
        os.lchown(host, uid, gid)
