"""The system a sandbox sees: the host's `/usr`, a curated `/etc`, a small `/var`.

The curated `/etc` holds only what any unprivileged host user could read anyway (world
readable files, symlinks), minus host identity (`machine-id`, `hostname`) and accounts of
real people (uids 1000-65533 in `passwd` / `group`). It is built once per host state into
`base/<key>/` under the agentbox home and reused by every sandbox (an older key is removed);
`/var` starts from the host's package databases (`/var/lib/dpkg`, `/var/lib/apt`, what of
them the server may read) so that `apt-get` inside works.

This is the fallback for a machine whose image (`images.py`) is not built.

The base also carries a `usr/` of what it adds over the host's `/usr`: a glibc locale archive
holding the host's archive (if any) plus `C.utf8`, the locale every sandbox command runs in.
Without it, each program that calls `setlocale` (bash does, at every start) opens and maps
about 25 files under `/usr/lib/locale`, each a round trip to fuse-overlayfs when `/usr` is
the system layer; with it, one file. The locale itself is the same compiled `C.utf8`.

With a system layer (see `sandbox.py`) the sandbox writes over these through an overlay
whose upper directory lives only as long as the sandbox.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat as stat_mod
import subprocess
from dataclasses import dataclass
from pathlib import Path

HOST_ETC = Path("/etc")
HOST_USR = Path("/usr")
#: What the base is made of; a change builds a new base on every host (it is in `host_key`).
BASE_FORMAT = 2
#: Where glibc looks for its locale archive (fixed when glibc is built), relative to `/`.
LOCALE_ARCHIVE = "usr/lib/locale/locale-archive"
#: The compiled locale of every sandbox command (`LANG=C.UTF-8`), as glibc names its directory.
SANDBOX_LOCALE = Path("/usr/lib/locale/C.utf8")
#: Seconds `localedef` may take to write the archive (it takes milliseconds).
LOCALEDEF_TIMEOUT = 60
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

    root: Path  # contains etc/, var/ and usr/ (what the base adds over the host's /usr)

    @property
    def usr(self) -> Path:
        return self.root / "usr"

    def usr_layers(self) -> tuple[Path, ...]:
        """A layered /usr, top first: what the base adds (when it adds anything), the host's /usr."""
        adds = (self.root / LOCALE_ARCHIVE).is_file()
        return (self.usr, HOST_USR) if adds else (HOST_USR,)

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def var(self) -> Path:
        return self.root / "var"


def host_key(base_format: int = BASE_FORMAT) -> str:
    """Changes whenever the base's format, the host's /etc, locales or package database change."""
    h = hashlib.sha256(f"format {base_format}\n".encode())
    watched = (HOST_ETC, Path("/var/lib/dpkg/status"), HOST_ETC / "passwd", HOST_ETC / "group",
               Path("/") / LOCALE_ARCHIVE, SANDBOX_LOCALE / "LC_CTYPE")  # fmt: skip
    for p in watched:
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
    write_locale_archive(tmp)
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


def write_locale_archive(
    root: Path, host_archive: Path = Path("/") / LOCALE_ARCHIVE, locale: Path = SANDBOX_LOCALE
) -> bool:
    """`root/LOCALE_ARCHIVE`: `host_archive` (so the host's own locales stay) plus `locale`.

    Written by the host's `localedef`, the tool of the glibc whose files the sandbox runs;
    the same inputs give the same bytes. A host without `localedef` or `locale` gets no
    archive (False): glibc then reads the locale's files, as before.
    """
    localedef = shutil.which("localedef")
    if localedef is None or not locale.is_dir():
        return False
    target = root / LOCALE_ARCHIVE
    target.parent.mkdir(parents=True, exist_ok=True)
    if host_archive.is_file() and os.access(host_archive, os.R_OK):
        shutil.copyfile(host_archive, target)
    try:
        done = subprocess.run(
            [localedef, f"--prefix={root}", "--add-to-archive", "--replace", str(locale)],
            stdin=subprocess.DEVNULL, capture_output=True, env={"PATH": os.defpath, "LC_ALL": "C"},
            timeout=LOCALEDEF_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is None or done.returncode != 0:
        target.unlink(missing_ok=True)
        return False
    return True


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


def login_shell(passwd: str, uid: int = 0) -> str | None:
    """`uid`'s login shell in a passwd table, or None when it has no entry or no shell."""
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[2] == str(uid) and fields[6].startswith("/"):
            return fields[6]
    return None


def resolv_conf(network: bool) -> str:
    """slirp4netns serves DNS at 10.0.2.3; with the network off there is no resolver."""
    return "nameserver 10.0.2.3\n" if network else ""


def hosts_file(hostname: str) -> str:
    return SANDBOX_HOSTS + f"127.0.1.1\t{hostname}\n"
