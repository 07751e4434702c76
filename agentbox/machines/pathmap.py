"""The one code path that maps a path inside a machine to the host path behind it.

A machine that keeps its files on the host (local, sandbox) describes what it exposes as
mounts: `/workspace` → the session's directory, `/tmp` → this lifetime's tmp, `/usr` →
the host's `/usr` read-only, and so on. `PathMap.resolve` normalises the inside path,
walks it one component at a time on the host and follows symlinks *inside the machine's
view*: an absolute link target is an inside path, a relative one is joined to the link's
inside directory. So a link can never lead to a host path that is not behind a mount,
whatever it points at; a path that lands outside every mount is a `PathEscape`, as are
device files, fifos and sockets (file operations never open them).

Known limit: a process inside the machine that swaps a checked directory for a symlink
between this walk and the open can race it; the final component is opened without
following links (see `open_nofollow`).
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

from agentbox.machines.errors import PathEscape, PermissionRequired

#: Symlinks followed while resolving one path before giving up (as the kernel's ELOOP).
MAX_SYMLINK_HOPS = 40


@dataclass(frozen=True)
class Mount:
    inside: str
    host: Path
    writable: bool = True


@dataclass(frozen=True)
class Alias:
    """An inside path that is itself a symlink to another inside path (`/bin` → `/usr/bin`)."""

    inside: str
    target: str


class PathMap:
    def __init__(self, mounts: list[Mount], root: str, aliases: list[Alias] | None = None) -> None:
        self.root = root
        self.mounts = sorted(mounts, key=lambda m: len(m.inside), reverse=True)
        self.aliases = {a.inside: a.target for a in aliases or []}

    def absolute(self, path: str) -> str:
        """Normalise an inside path; relative paths are taken from the root."""
        if not path:
            raise PathEscape("empty path", path=path)
        if "\x00" in path:
            raise PathEscape("path contains a NUL byte", path=path)
        joined = path if path.startswith("/") else posixpath.join(self.root, path)
        normal = posixpath.normpath(joined)
        return "/" + normal.lstrip("/") if normal != "/" else "/"

    def mount_for(self, inside: str) -> Mount | None:
        for m in self.mounts:
            if inside == m.inside or inside.startswith(m.inside.rstrip("/") + "/") or m.inside == "/":
                return m
        return None

    def resolve(self, path: str, *, write: bool = False, follow: bool = True) -> Path:
        """The host path behind `path`; `follow=False` leaves a final symlink unresolved."""
        inside = self.absolute(path)
        for _ in range(MAX_SYMLINK_HOPS):
            inside = self._alias(inside, follow)
            mount = self.mount_for(inside)
            if mount is None:
                raise PathEscape(f"{path} is outside what this machine exposes", path=path)
            rest = inside[len(mount.inside) :].strip("/") if mount.inside != "/" else inside.strip("/")
            parts = [p for p in rest.split("/") if p]
            host = mount.host
            here = mount.inside
            redirected = None
            for i, part in enumerate(parts):
                host = host / part
                here = posixpath.join(here, part)
                last = i == len(parts) - 1
                try:
                    st = host.lstat()
                except FileNotFoundError:
                    host = host.joinpath(*parts[i + 1 :])
                    break  # the rest does not exist yet; nothing below can be a link
                if stat_mod.S_ISLNK(st.st_mode) and (follow or not last):
                    target = os.readlink(host)
                    base = (
                        target if target.startswith("/") else posixpath.join(posixpath.dirname(here), target)
                    )
                    redirected = posixpath.normpath(posixpath.join(base, *parts[i + 1 :]))
                    redirected = "/" + redirected.lstrip("/")
                    break
                if not last and not stat_mod.S_ISDIR(st.st_mode) and not stat_mod.S_ISLNK(st.st_mode):
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), posixpath.join(here))
            if redirected is None:
                self._check_kind(host, path)
                if write and not mount.writable:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
                return host
            inside = redirected
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)

    def _alias(self, inside: str, follow: bool) -> str:
        for alias, target in self.aliases.items():
            if inside == alias and not follow:
                return inside
            if inside == alias or inside.startswith(alias + "/"):
                return target + inside[len(alias) :]
        return inside

    @staticmethod
    def _check_kind(host: Path, path: str) -> None:
        try:
            st = host.lstat()
        except FileNotFoundError:
            return
        mode = st.st_mode
        if not (stat_mod.S_ISREG(mode) or stat_mod.S_ISDIR(mode) or stat_mod.S_ISLNK(mode)):
            raise PathEscape(f"{path} is a device, fifo or socket", path=path)

    def to_inside(self, host: Path) -> str:
        """The inside path of a host path behind one of the mounts (for events and listings)."""
        host_s = str(host)
        for m in self.mounts:
            base = str(m.host).rstrip("/")
            if host_s == base:
                return m.inside
            if host_s.startswith(base + "/"):
                return posixpath.join(m.inside, host_s[len(base) + 1 :])
        raise PathEscape(f"{host} is not behind any mount", path=host_s)

    def within_root(self, path: str) -> bool:
        inside = self.absolute(path)
        root = self.root.rstrip("/")
        return inside == self.root or inside.startswith(root + "/") or root == ""

    def require_within_root(self, path: str, action: str = "write") -> None:
        """Seed 004: a write outside the root is not an error but a question for the user."""
        if not self.within_root(path):
            raise PermissionRequired(
                f"{action} outside the workspace root {self.root}: {path}", path=path, action=action
            )


def open_nofollow(host: Path, flags: int, mode: int = 0o644) -> int:
    """Open the final component without following a symlink swapped in after resolution."""
    return os.open(host, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
