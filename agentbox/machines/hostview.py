"""A machine's files as the machine sees them, reached by the server through directory descriptors.

A machine that keeps its files on the host (local, sandbox) describes what it exposes as
mounts: `/workspace` → the session's directory, `/tmp` → this lifetime's tmp, `/usr` → a
read-only system tree, and so on. The server opens each mount's directory once and from then
on reaches every file *relative to that descriptor*, one component at a time, never by a host
path name:

- every intermediate directory is opened with `O_NOFOLLOW` relative to its parent's
  descriptor (one `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` call when the kernel has
  it and no link is on the way, else a walk of `openat` calls);
- a symlink met on the way is read (`readlinkat`) and its target resolved again *inside the
  machine's view*: an absolute target is an inside path, a relative one is joined to the
  link's inside directory, so a link can only lead to another place the machine exposes;
- the final component is acted on relative to its parent's descriptor with `*at` calls and
  `O_NOFOLLOW`; an operation that follows a final link resolves the link itself as above.

So a process inside the machine that swaps a directory for a symlink (`renameat2` exchange)
between two steps changes nothing: each step is on a descriptor of a real directory below a
mount root, and a directory cannot leave its mount (renames across mounts fail with `EXDEV`).
This is the whole reason the module exists: resolving a path by name first and opening the
resulting host path later (what this replaced) let code in a sandbox send the server, as root,
to any host file.

Files that are not regular files or directories are never opened for data (`PathEscape`):
a FIFO would block the server, a socket or device has no business in a file API; every open
adds `O_NONBLOCK | O_NOCTTY` so that even the open itself cannot block. A mount marked
`foreign` holds files that belong to the host (its `/usr`), which the machine may read only as
any other user may: such a file not readable by "other" is `EACCES` here as it is inside.

Why descriptors on the host rather than asking the machine (its exec agent) to open files:
the host path is the fast path (no process, no round trip: a read of 1 KiB stays a few
syscalls), the machine's own view and rights are reproduced exactly, and machines whose
files are not host files implement the same operations over their own transport instead
(`agentbox.machines.base.Files`). Descriptors are shared between threads; a `_Root` closes its
descriptor only when nothing references it any more, so a descriptor number is never reused
under an operation that is still running.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import shutil
import stat as stat_mod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agentbox.machines.base import inside_path
from agentbox.machines.errors import PathEscape, PermissionRequired

#: Symlinks followed while resolving one path before giving up (as the kernel's ELOOP).
MAX_SYMLINK_HOPS = 40

_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_STEP = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: Added to every open for data: never follow a final link, never block, never a controlling tty.
_SAFE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64 (the unified syscall table)
_RENAME_NOREPLACE = 1


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_available = True


def _openat2_beneath(dirfd: int, rel: str, flags: int) -> int | None:
    """`rel` below `dirfd` with no symlink or `..` on the way; None when the kernel lacks
    openat2 or the walk met a link (the caller then walks by hand)."""
    global _openat2_available
    if not _openat2_available:
        return None
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter that refuses it
        _openat2_available = False
        return None
    if err in (errno.ELOOP, errno.EXDEV, errno.EAGAIN):
        return None
    raise OSError(err, os.strerror(err), rel)


@dataclass(frozen=True)
class Mount:
    """An inside directory and the host directory behind it.

    `host` is None for a directory that exists only inside the machine (a sandbox's tmpfs):
    the machine hands its descriptor over (`HostView.attach`) while it runs.
    """

    inside: str
    host: Path | None
    writable: bool = True
    foreign: bool = False
    """Its files belong to the host: readable only where "other" may read them."""


@dataclass(frozen=True)
class Alias:
    """An inside path that is itself a symlink to another inside path (`/bin` → `/usr/bin`)."""

    inside: str
    target: str


class _Root:
    """An open mount directory; the descriptor lives as long as any operation holds this."""

    def __init__(self, mount: Mount, fd: int | None = None) -> None:
        self.mount = mount
        self.fd = -1
        if fd is None:
            if mount.host is None:
                raise FileNotFoundError(errno.ENOENT, f"{mount.inside} exists only while the machine runs")
            fd = os.open(mount.host, _DIR)
        self.fd = fd

    def __del__(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


@dataclass
class At:
    """A resolved inside path: its parent directory's descriptor and its final name.

    `name` is "" for a mount root (then `fd` is the root itself). `inside` is the canonical
    inside path (links on the way, and a final link when followed, resolved). The descriptor
    is an `O_PATH` one, closed when the `with` block that produced it ends.
    """

    fd: int
    name: str
    inside: str
    mount: Mount
    root: _Root
    named: str | None = None
    """Where a lookup that does not follow a final link ends (`resolve(follow=False)`), when
    this one passed it on its way; None when it cannot tell (the path was an alias itself)."""

    @property
    def target(self) -> str:
        """What `*at` calls take as the name: the final component, or "" + AT_EMPTY_PATH for a root."""
        return self.name or "."


@dataclass(frozen=True)
class Node:
    """One entry of a walk: its path relative to the walk's start, its inside path, its lstat."""

    rel: str
    inside: str
    name: str
    depth: int
    st: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.st.st_mode)

    @property
    def is_symlink(self) -> bool:
        return stat_mod.S_ISLNK(self.st.st_mode)


def _escape(path: str, why: str) -> PathEscape:
    return PathEscape(f"{path} {why}", path=path)


def data_kind_ok(st: os.stat_result) -> bool:
    """Whether a file operation may touch this for its data: a regular file or a directory."""
    return stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode)


class HostView:
    """Descriptor-relative access to the files a machine exposes (see the module docstring).

    Paths are inside paths; relative ones resolve against `root`. Errors are `OSError`s with
    the errno the machine itself would see, or a `PathEscape` for what lies outside every
    mount (and for devices, FIFOs and sockets).
    """

    def __init__(
        self, mounts: list[Mount], root: str, aliases: list[Alias] | None = None, owner_uid: int | None = None
    ) -> None:
        self.root = root
        self.mounts = sorted(mounts, key=lambda m: len(m.inside), reverse=True)
        self.aliases = {a.inside: a.target for a in aliases or []}
        self.owner_uid = os.geteuid() if owner_uid is None else owner_uid
        self._roots: dict[str, _Root] = {}

    # -- lexical ---------------------------------------------------------------------------

    def absolute(self, path: str) -> str:
        """Normalise an inside path; relative paths are taken from the root."""
        return inside_path(self.root, path)

    def mount_for(self, inside: str) -> Mount | None:
        for m in self.mounts:
            if inside == m.inside or inside.startswith(m.inside.rstrip("/") + "/") or m.inside == "/":
                return m
        return None

    def within_root(self, path: str) -> bool:
        inside = self.absolute(path)
        root = self.root.rstrip("/")
        return inside == self.root or inside.startswith(root + "/") or root == ""

    def require_within_root(self, path: str, action: str = "write") -> None:
        """A write outside the root is not an error but a question for the user."""
        if not self.within_root(path):
            raise PermissionRequired(
                f"{action} outside the workspace root {self.root}: {path}", path=path, action=action
            )

    def _alias(self, inside: str, follow: bool) -> str:
        for alias, target in self.aliases.items():
            if inside == alias and not follow:
                return inside
            if inside == alias or inside.startswith(alias + "/"):
                return target + inside[len(alias) :]
        return inside

    # -- resolution --------------------------------------------------------------------------

    def _root(self, mount: Mount) -> _Root:
        root = self._roots.get(mount.inside)
        if root is None:
            root = _Root(mount)  # FileNotFoundError while the mount's directory does not exist
            self._roots[mount.inside] = root
        return root

    def attach(self, inside: str, fd: int) -> None:
        """Serve the mount at `inside` from `fd`, a directory descriptor the view now owns.

        For a directory that exists only inside the machine, opened there by the machine
        itself and passed over (so it is the machine's own view of it, by construction).
        """
        mount = next((m for m in self.mounts if m.inside == inside), None)
        if mount is None:
            os.close(fd)
            raise ValueError(f"no mount at {inside}")
        self._roots[inside] = _Root(mount, fd)

    def forget(self) -> None:
        """Drop the open mount directories (a lifetime of the machine began or ended).

        They are reopened on next use; operations still running keep theirs until they end.
        """
        self._roots = {}

    @contextmanager
    def at(self, path: str, *, follow: bool = True, write: bool = False) -> Iterator[At]:
        """Resolve `path` to its parent's descriptor and final name, for the `with` block.

        With `follow`, a final symlink is resolved too (inside the view). `write` refuses a
        read-only mount with EROFS. A missing parent is ENOENT; a file where a directory is
        needed ENOTDIR.
        """
        resolved = self._resolve(path, follow)
        try:
            if write and not resolved.mount.writable:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            yield resolved
        finally:
            if resolved.fd != resolved.root.fd:
                os.close(resolved.fd)

    def _resolve(self, path: str, follow: bool) -> At:
        inside = self.absolute(path)
        # Until a final link is followed or an alias is taken as a whole, a lookup that does
        # not follow final links takes the very same steps: `named` is then where it stops.
        named: str | None = None
        diverged = False
        for _ in range(MAX_SYMLINK_HOPS):
            if follow and not diverged and inside in self.aliases:
                diverged = True
            inside = self._alias(inside, follow)
            mount = self.mount_for(inside)
            if mount is None:
                raise _escape(path, "is outside what this machine exposes")
            rest = inside[len(mount.inside) :] if mount.inside != "/" else inside
            parts = [p for p in rest.split("/") if p]
            root = self._root(mount)
            if not parts:
                return At(root.fd, "", inside, mount, root, named if diverged else inside)
            walked = self._walk_dirs(root, mount, parts[:-1], path)
            if isinstance(walked, str):  # a link on the way: resolve its target instead
                inside = posixpath.normpath(posixpath.join(walked, parts[-1]))
                continue
            dirfd, here = walked, posixpath.join(mount.inside, *parts[:-1])
            name = parts[-1]
            found = posixpath.join(here, name)
            if follow:
                target = _link_target(dirfd, name)
                if target is not None:
                    if dirfd != root.fd:
                        os.close(dirfd)
                    if not diverged:
                        named, diverged = found, True
                    inside = self._joined(here, target)
                    continue
            return At(dirfd, name, found, mount, root, named if diverged else found)
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)

    def _walk_dirs(self, root: _Root, mount: Mount, parts: list[str], path: str) -> int | str:
        """A descriptor of the directory `parts` below the mount root, or the inside path a
        symlink on the way redirects to (the rest of the path still to be appended)."""
        if not parts:
            return root.fd
        fast = _openat2_beneath(root.fd, "/".join(parts), _DIR)
        if fast is not None:
            if mount.foreign:
                self._check_search(fast, path)
            return fast
        fd = root.fd
        here = mount.inside
        try:
            for i, part in enumerate(parts):
                nxt = os.open(part, _STEP, dir_fd=fd)
                st = os.fstat(nxt)
                if stat_mod.S_ISLNK(st.st_mode):
                    target = os.readlink("", dir_fd=nxt)
                    os.close(nxt)
                    if fd != root.fd:
                        os.close(fd)
                        fd = root.fd
                    return posixpath.join(self._joined(here, target), *parts[i + 1 :])
                if not stat_mod.S_ISDIR(st.st_mode):
                    os.close(nxt)
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
                if mount.foreign:
                    self._check_search(nxt, path)
                if fd != root.fd:
                    os.close(fd)
                fd = nxt
                here = posixpath.join(here, part)
            return fd
        except BaseException:
            if fd != root.fd:
                os.close(fd)
            raise

    @staticmethod
    def _joined(here: str, target: str) -> str:
        base = target if target.startswith("/") else posixpath.join(here, target)
        return "/" + posixpath.normpath(base).lstrip("/")

    def _check_search(self, fd: int, path: str) -> None:
        st = os.fstat(fd)
        if st.st_uid != self.owner_uid and not st.st_mode & stat_mod.S_IXOTH:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    def _check_read(self, st: os.stat_result, mount: Mount, path: str) -> None:
        if mount.foreign and st.st_uid != self.owner_uid and not st.st_mode & stat_mod.S_IROTH:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    # -- reading ------------------------------------------------------------------------------

    def resolve(
        self, path: str, *, follow: bool = True, missing_ok: bool = False, write: bool = False
    ) -> str:
        """The canonical inside path: links on the way (and with `follow` a final one) resolved.

        With `missing_ok`, a directory on the way that does not exist (yet) ends the
        resolution: it and the rest are taken as written, since nothing below a missing
        directory can be a link. `write` refuses a path on a read-only mount with EROFS.
        """
        try:
            with self.at(path, follow=follow) as at:
                inside = at.inside
        except (FileNotFoundError, NotADirectoryError):
            asked = self.absolute(path)
            parent = posixpath.dirname(asked)
            if not missing_ok or parent == asked:
                raise
            inside = posixpath.join(self.resolve(parent, missing_ok=True), posixpath.basename(asked))
        mount = self.mount_for(inside)
        if write and mount is not None and not mount.writable:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return inside

    def is_mount_root(self, inside: str) -> bool:
        """Whether `inside` is `/` or where the machine mounts a folder (never moved or removed)."""
        return inside == "/" or any(inside == m.inside for m in self.mounts)

    def lstat(self, path: str) -> os.stat_result:
        with self.at(path, follow=False) as at:
            return _lstat_at(at)

    def stat(self, path: str) -> os.stat_result:
        """What `path` leads to in the machine's view (a dangling or escaping link raises)."""
        with self.at(path, follow=True) as at:
            return _lstat_at(at)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except (OSError, PathEscape):
            return False
        return True

    def open(self, path: str, flags: int = os.O_RDONLY, mode: int = 0o644, *, follow: bool = True) -> int:
        """A descriptor for the regular file (or directory, with O_DIRECTORY) at `path`.

        Creation (`O_CREAT`) happens in the resolved parent. Devices, FIFOs and sockets are a
        `PathEscape`; they are opened non-blocking first so that even finding out cannot hang.
        The descriptor is the caller's to close; it keeps `O_NONBLOCK` off for regular files.
        """
        return self._open(path, flags, mode, follow=follow)[0]

    def open_named(self, path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> tuple[int, str]:
        """`open` (following a final link), and the path that names what it opened as
        `resolve(path, follow=False)` does: from the same resolution, unless `path` was an
        alias as a whole (then resolved again for the name)."""
        fd, named = self._open(path, flags, mode, follow=True)
        if named is not None:
            return fd, named
        try:
            return fd, self.resolve(path, follow=False)
        except BaseException:
            os.close(fd)
            raise

    def _open(
        self, path: str, flags: int, mode: int, *, follow: bool, again: bool = True
    ) -> tuple[int, str | None]:
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        with self.at(path, follow=follow, write=writing) as at:
            if not at.name:
                if flags & (os.O_CREAT | os.O_EXCL) == os.O_CREAT | os.O_EXCL:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
                fd = os.open(".", (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | _SAFE, dir_fd=at.fd)
            else:
                try:
                    fd = os.open(at.name, flags | _SAFE, mode, dir_fd=at.fd)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # a FIFO without a reader, or a device node
                        raise _escape(path, "is a device, fifo or socket") from None
                    if exc.errno == errno.ELOOP and follow and again:  # became a link since
                        return self._open(at.inside, flags, mode, follow=True, again=False)[0], at.named
                    if exc.errno == errno.ELOOP:
                        raise _escape(path, "is a symlink") from None
                    raise
            try:
                st = os.fstat(fd)
                if not data_kind_ok(st):
                    raise _escape(path, "is a device, fifo or socket")
                self._check_read(st, at.mount, path)
                if stat_mod.S_ISREG(st.st_mode) and not flags & os.O_NONBLOCK:
                    os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            return fd, at.named

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The whole file, refused (EFBIG) past `limit` bytes."""
        fd = self.open(path)
        try:
            data = _read_up_to(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        return data

    @contextmanager
    def opendir(self, path: str, *, follow: bool = True) -> Iterator[int]:
        """A readable descriptor of the directory at `path` (for `os.scandir(fd)`), for the block."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY, follow=follow)
        try:
            yield fd
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of each entry of the directory at `path`, in name order."""
        with self.opendir(path) as fd:
            return _children(fd)

    def walk(
        self,
        path: str,
        *,
        max_depth: int | None = None,
        descend: Callable[[Node], bool] | None = None,
    ) -> Iterator[Node]:
        """Every entry under the directory at `path`, depth first in name order, never through a link.

        `depth` is 1 for a direct child. A real directory is entered while within `max_depth`
        and when `descend(node)` agrees. Subdirectories that vanish or cannot be read are
        skipped; the start's own errors propagate. Each level holds one descriptor.
        """
        with self.opendir(path) as top:
            base = self.resolve(path)
            yield from _walk_fd(top, "", base, 1, max_depth, descend)

    # -- changing ------------------------------------------------------------------------------

    def mkdir(self, path: str, mode: int = 0o755, owner: tuple[int, int] | None = None) -> None:
        with self.at(path, follow=False, write=True) as at:
            if not at.name:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            os.mkdir(at.name, mode, dir_fd=at.fd)
            if owner is not None:
                os.chown(at.name, *owner, dir_fd=at.fd, follow_symlinks=False)

    def makedirs(self, path: str, mode: int = 0o755, owner: tuple[int, int] | None = None) -> None:
        """Create `path` and its missing ancestors; an existing `path` is EEXIST, an ancestor a
        concurrent creator made first is fine (unless it is not a directory)."""
        missing = [self.absolute(path)]
        while missing[-1] != "/" and not self.exists(posixpath.dirname(missing[-1])):
            missing.append(posixpath.dirname(missing[-1]))
        for directory in reversed(missing):
            try:
                self.mkdir(directory, mode, owner)
            except FileExistsError:
                if directory == missing[0] or not stat_mod.S_ISDIR(self.stat(directory).st_mode):
                    raise

    def unlink(self, path: str) -> None:
        with self.at(path, follow=False, write=True) as at:
            self._not_root(at, path)
            os.unlink(at.name, dir_fd=at.fd)

    def rmdir(self, path: str) -> None:
        with self.at(path, follow=False, write=True) as at:
            self._not_root(at, path)
            os.rmdir(at.name, dir_fd=at.fd)

    def rmtree(self, path: str) -> None:
        """Remove a directory and everything below it, by descriptor (never through a link)."""
        with self.at(path, follow=False, write=True) as at:
            self._not_root(at, path)
            shutil.rmtree(at.name, dir_fd=at.fd)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """A file, a link (not its target) or a directory (`recursive` when not empty)."""
        st = self.lstat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            self.unlink(path)
        elif recursive:
            self.rmtree(path)
        else:
            self.rmdir(path)

    def rename(self, src: str, dst: str, *, replace: bool = True) -> None:
        """Rename within one mount (across mounts is EXDEV, as inside).

        Without `replace`, an existing `dst` is EEXIST, atomically (`renameat2(RENAME_NOREPLACE)`;
        where the file system lacks the flag, a check then a rename, racy only against a
        concurrent creator).
        """
        with self.at(src, follow=False, write=True) as a, self.at(dst, follow=False, write=True) as b:
            self._not_root(a, src)
            self._not_root(b, dst)
            if a.mount != b.mount:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), dst)
            if replace:
                os.rename(a.name, b.name, src_dir_fd=a.fd, dst_dir_fd=b.fd)
                return
            code = _libc.renameat2(a.fd, os.fsencode(a.name), b.fd, os.fsencode(b.name), _RENAME_NOREPLACE)
            if code == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS):
                raise OSError(err, os.strerror(err), src, None, dst)
            try:
                os.stat(b.name, dir_fd=b.fd, follow_symlinks=False)
            except FileNotFoundError:
                os.rename(a.name, b.name, src_dir_fd=a.fd, dst_dir_fd=b.fd)
                return
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)

    def chown(self, path: str, uid: int, gid: int) -> None:
        with self.at(path, follow=False, write=True) as at:
            os.chown(at.target, uid, gid, dir_fd=at.fd, follow_symlinks=False)

    @staticmethod
    def _not_root(at: At, path: str) -> None:
        if not at.name:
            raise OSError(errno.EBUSY, f"{path} is the root of a mount", path)


def _lstat_at(at: At) -> os.stat_result:
    if not at.name:
        return os.fstat(at.fd)
    return os.stat(at.name, dir_fd=at.fd, follow_symlinks=False)


def _link_target(dirfd: int, name: str) -> str | None:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat_mod.S_ISLNK(st.st_mode):
        return None
    try:
        return os.readlink(name, dir_fd=dirfd)
    except OSError:  # replaced since: the open that follows sees what is there now
        return None


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _children(fd: int) -> list[tuple[str, os.stat_result]]:
    found = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                found.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    return sorted(found)


def _walk_fd(
    fd: int,
    rel: str,
    inside: str,
    depth: int,
    max_depth: int | None,
    descend: Callable[[Node], bool] | None,
) -> Iterator[Node]:
    try:
        kids = _children(fd)
    except OSError:
        if depth == 1:
            raise
        return
    for name, st in kids:
        node = Node(f"{rel}/{name}" if rel else name, posixpath.join(inside, name), name, depth, st)
        yield node
        if not node.is_dir or (max_depth is not None and depth >= max_depth):
            continue
        if descend is not None and not descend(node):
            continue
        try:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _SAFE, dir_fd=fd)
        except OSError:
            continue
        try:
            if not os.path.samestat(os.fstat(sub), st):  # replaced since the listing
                continue
            yield from _walk_fd(sub, node.rel, node.inside, depth + 1, max_depth, descend)
        finally:
            os.close(sub)
