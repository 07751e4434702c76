"""The system a sandbox sees: the host's `/usr`, a curated `/etc`, a small `/var`.

The curated `/etc` holds only what any unprivileged host user could read anyway (world
readable files, symlinks), minus host identity (`machine-id`, `hostname`) and accounts of
real people (uids 1000-65533 in `passwd` / `group`). It is built once per host state into
`base/<key>/` under the agentbox home and reused by every sandbox (an older key is removed);
`/var` starts from the host's package databases (`/var/lib/dpkg`, `/var/lib/apt`, what of
them the server may read) so that `apt-get` inside works.

This is the fallback for a machine whose image (`images.py`) is not built.

With a system layer (see `sandbox.py`) the sandbox writes over these through an overlay
whose upper directory lives only as long as the sandbox.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

HOST_ETC = Path("/etc")
#: Host package databases copied into the base /var, so `apt-get` inside knows what is installed.
VAR_COPIES = ("lib/dpkg", "lib/apt")
#: Directories apt and friends expect under /var.
VAR_DIRS = (
    "cache/apt/archives/partial",
    "log/apt",
    "tmp",
    "lib/dpkg",
    "lib/apt",
    "lib/misc",
    "spool",
    "mail",
)
#: Names never copied into the curated /etc even when world readable.
ETC_DENY = {"machine-id", "hostname", "hosts", "resolv.conf", "mtab", "subuid", "subgid", "agentbox"}
#: Account ids of real people, left out of the sandbox's passwd / group.
HUMAN_IDS = range(1000, 65534)
SANDBOX_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


@dataclass(frozen=True)
class Base:
    """The per-host base a sandbox's system layer starts from."""

    root: Path  # contains etc/, var/ and an empty usr/ mount point

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def var(self) -> Path:
        return self.root / "var"


def host_key() -> str:
    """Changes whenever the host's /etc or package database changes."""
    h = hashlib.sha256()
    for p in (HOST_ETC, Path("/var/lib/dpkg/status"), HOST_ETC / "passwd", HOST_ETC / "group"):
        try:
            st = p.stat()
            h.update(f"{p}:{st.st_mtime_ns}:{st.st_size}".encode())
        except OSError:
            pass
    return h.hexdigest()[:16]


#: Where servers before images kept the base on a root host; removed when found.
LEGACY_BASE_DIR = Path("/var/cache/agentbox/base")


def ensure_base(home: Path) -> Base:
    """Build (once) and return the base for the current host state; drop bases of older states."""
    root = home / "base" / host_key()
    if not (root / ".complete").exists():
        _build_base(root)
    for old in [*root.parent.iterdir(), *_legacy_bases()]:
        if old != root and (old / ".complete").exists():
            shutil.rmtree(old, ignore_errors=True)
    for legacy in (LEGACY_BASE_DIR, LEGACY_BASE_DIR.parent):
        with contextlib.suppress(OSError):
            legacy.rmdir()  # only once empty
    return Base(root)


def _legacy_bases() -> list[Path]:
    if os.geteuid() != 0 or not LEGACY_BASE_DIR.is_dir():
        return []
    return list(LEGACY_BASE_DIR.iterdir())


def _build_base(root: Path) -> None:
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "usr").mkdir(parents=True)
    copy_curated_etc(HOST_ETC, tmp / "etc")
    for d in VAR_DIRS:
        (tmp / "var" / d).mkdir(parents=True, exist_ok=True)
    for d in VAR_COPIES:
        if (Path("/var") / d).is_dir():
            shutil.copytree(
                Path("/var") / d, tmp / "var" / d, symlinks=True, dirs_exist_ok=True, ignore=_unreadable
            )
    (tmp / ".complete").touch()
    for p in [tmp, *tmp.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, os.lstat(p).st_mode | 0o444 | (0o111 if p.is_dir() else 0))
    try:
        tmp.rename(root)
    except OSError:  # another server built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def _unreadable(directory: str, names: list[str]) -> set[str]:
    """What this server may not read (dpkg's lock, for a non-root one): left out, not fatal."""
    return {n for n in names if not os.access(os.path.join(directory, n), os.R_OK)}


def copy_etc_entry(p: Path, target: Path) -> None:
    """One /etc entry: a symlink as itself, a world-readable file copied, anything else left out."""
    st = p.lstat()
    if stat_mod.S_ISLNK(st.st_mode):
        target.symlink_to(os.readlink(p))
    elif stat_mod.S_ISREG(st.st_mode) and st.st_mode & 0o004:
        shutil.copy2(p, target)


def copy_curated_etc(src: Path, dst: Path) -> None:
    """The host's /etc, world-readable entries only, without ETC_DENY and human accounts.

    The host's /etc changes under a running server (useradd's lock files, a package upgrade):
    an entry that vanishes between the listing and its copy is left out, never fatal.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        keep = []
        for d in dirnames:
            p = Path(dirpath) / d
            if (rel / d).as_posix() in ETC_DENY or d in ETC_DENY:
                continue
            if p.is_symlink():
                filenames.append(d)
                continue
            try:
                mode = p.stat().st_mode
            except FileNotFoundError:
                continue
            if mode & 0o005 == 0o005:
                (dst / rel / d).mkdir(exist_ok=True)
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            p = Path(dirpath) / f
            if f in ETC_DENY and rel == Path("."):
                continue
            with contextlib.suppress(FileNotFoundError):  # gone since the listing: skipped
                copy_etc_entry(p, dst / rel / f)
    for name in ("passwd", "group"):
        if (src / name).exists():
            (dst / name).write_text(without_humans((src / name).read_text()))
    (dst / "hostname").write_text("sandbox\n")
    (dst / "hosts").write_text(SANDBOX_HOSTS)
    (dst / "resolv.conf").write_text("")
    (dst / "mtab").symlink_to("../proc/self/mounts")


def without_humans(table: str) -> str:
    lines = []
    for line in table.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in HUMAN_IDS:
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def resolv_conf(network: bool) -> str:
    """slirp4netns serves DNS at 10.0.2.3; with the network off there is no resolver."""
    return "nameserver 10.0.2.3\n" if network else ""


def hosts_file(hostname: str) -> str:
    return SANDBOX_HOSTS + f"127.0.1.1\t{hostname}\n"
