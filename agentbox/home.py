"""The AGENTBOX_HOME an entry point works on: one owner at a time, private to it, its database and registry.

`agentbox serve`, `exec`, `mcp` and `run` each claim the home, then open the same two things
in the same order and close them in reverse; this is that one piece.

One owner per home. A home's sandboxes, system layers and recovery belong to one process:
a second one starting sandboxes for the same sessions binds the first one's directories
from under it (bwrap's "Race condition binding dirfd") and its recovery removes what it
believes a dead server left. So `claim_home` takes an exclusive `flock` on `agentbox.lock`
in the home, held for the life of the process (the kernel drops it when the process dies,
however it dies); a second claimer gets `HomeBusy` at once. `agentbox serve` also writes
`server.json` (`{"url", "pid"}`) beside the lock once it listens, so that the others can say
where to go instead (`exec` goes there by itself).

Private to its owner. Everything under the home is the server's: the database and its WAL,
the blobs, the secret key, the sessions' workspaces and their per-lifetime /tmp and $HOME.
The home is mode 0700, except on a root host that runs sandboxes: there bwrap runs as the
unprivileged sandbox uid and resolves the sources of its binds by path as that uid (even
for `--bind-fd`: it reads the path back from /proc/self/fd/N and mounts that), so the uid
must be able to search the home. The home is then `root:<sandbox gid>` mode 0710: the
sandbox group may pass through, no other host user may even look (the sandbox gid is
a group no host user should be in). AGENTBOX_HOME is agentbox's own directory, so its mode
and group are set at every start; its parents are not, so a parent the sandbox uid cannot
search is refused at start (`HomeUnreachable`) with the `chmod` that fixes it.

Every way claiming a home fails:

    HomeError
    ├── HomeBusy          another agentbox process owns the home (the message names its URL)
    └── HomeUnreachable   the sandbox uid cannot search a parent of the home
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from agentbox.config import Settings
from agentbox.machines.registry import Registry
from agentbox.machines.sandbox import unsearchable_parent
from agentbox.store.db import Database
from agentbox.store.markers import MarkersRepo

#: The file whose `flock` is the home's ownership (it holds the owner's pid, for messages).
LOCK_FILE_NAME = "agentbox.lock"
#: Where `agentbox serve` records its URL and pid once it listens.
SERVER_FILE_NAME = "server.json"
#: The home's mode when no other uid needs to pass through it.
HOME_MODE = 0o700
#: The home's mode on a root host with sandboxes: the sandbox group may search it, nothing else.
SHARED_HOME_MODE = 0o710
#: Mode of the lock and server files: the owner's alone.
OWNER_FILE_MODE = 0o600


class HomeError(Exception):
    """The home cannot be claimed; the message is one line for the terminal."""


class HomeBusy(HomeError):
    def __init__(self, home: Path, server: ServerRecord | None, holder: str) -> None:
        if server is not None:
            where = f"by `agentbox serve` (pid {server.pid}) at {server.url}"
        else:
            where = f"by another agentbox process ({holder or 'pid unknown'})"
        super().__init__(f"AGENTBOX_HOME {home} is owned {where}")
        self.home = home
        self.server = server


class HomeUnreachable(HomeError):
    pass


@dataclass(frozen=True)
class ServerRecord:
    """What a serving owner left beside the lock: where to reach it."""

    url: str
    pid: int


class HomeClaim:
    """The exclusive lock on one home, held until `release` (or the process's end)."""

    def __init__(self, home: Path, fd: int) -> None:
        self.home = home
        self._fd: int | None = fd

    def announce(self, url: str) -> None:
        """Record that this process serves the home at `url` (written whole, then renamed)."""
        record = json.dumps({"url": url, "pid": os.getpid()})
        temp = self.home / f".{SERVER_FILE_NAME}.{os.getpid()}"
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, OWNER_FILE_MODE
        )
        with os.fdopen(fd, "w") as f:
            f.write(record)
        os.replace(temp, self.home / SERVER_FILE_NAME)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.home / SERVER_FILE_NAME).unlink()
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = None

    def __enter__(self) -> HomeClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def claim_home(settings: Settings) -> HomeClaim:
    """Make the home (private, reachable by the sandbox uid where needed) and take its lock."""
    home = settings.home
    prepare_home(settings)
    fd = os.open(
        home / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, OWNER_FILE_MODE
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise HomeBusy(home, server_record(home), holder) from None
    # Ours now: a record left by an owner that died is stale.
    with contextlib.suppress(FileNotFoundError):
        (home / SERVER_FILE_NAME).unlink()
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    return HomeClaim(home, fd)


def server_record(home: Path) -> ServerRecord | None:
    """The URL and pid `agentbox serve` recorded in `home`, if it did (and the file reads)."""
    try:
        data = json.loads((home / SERVER_FILE_NAME).read_text())
        return ServerRecord(str(data["url"]), int(data["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_home(settings: Settings) -> None:
    """Create the home, make it private (see the module docstring), refuse it if unreachable."""
    home = settings.home
    sandbox_gid = _sandbox_gid(settings)
    if sandbox_gid is not None:
        blocking = unsearchable_parent(home.parent.resolve(), settings.sandbox_uid, sandbox_gid)
        if blocking is not None:
            raise HomeUnreachable(
                f"AGENTBOX_HOME {home} is below {blocking}, which the sandbox uid {settings.sandbox_uid} "
                f"cannot search, so no sandbox could start: `chmod o+x {blocking}` or use an AGENTBOX_HOME "
                "whose parents are searchable (e.g. /var/lib/agentbox)"
            )
    home.mkdir(parents=True, exist_ok=True)
    info = home.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise HomeError(f"AGENTBOX_HOME {home} is not a directory")
    if sandbox_gid is None:
        os.chmod(home, HOME_MODE)
    else:
        os.chown(home, 0, sandbox_gid)
        os.chmod(home, SHARED_HOME_MODE)


def _sandbox_gid(settings: Settings) -> int | None:
    """The group that must search the home: the sandbox uid's, when a root server runs sandboxes."""
    if os.geteuid() != 0 or not any(m.kind == "sandbox" for m in settings.machines.values()):
        return None
    return settings.sandbox_uid  # SandboxHost's gid: the same number as the uid


@asynccontextmanager
async def opened_home(
    settings: Settings, claim: HomeClaim | None = None
) -> AsyncIterator[tuple[Database, Registry]]:
    """The home's database (created with its folder if new) and a registry over it; both closed
    after (the registry first: stopping machines writes their markers).

    The home is claimed for the while (`HomeBusy` if another process owns it), unless the
    caller already holds `claim` (`agentbox serve` claims before it starts serving, to refuse
    with one line instead of a failed startup).
    """
    own = claim is None
    claim = claim or claim_home(settings)
    try:
        db = Database.in_home(settings.home)
        await db.connect()
        registry = Registry(settings, MarkersRepo(db))
        try:
            yield db, registry
        finally:
            await registry.shutdown()
            await db.close()
    finally:
        if own:
            claim.release()
