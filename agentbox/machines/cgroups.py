"""Per-sandbox resource limits through cgroups: v1, v2, or an honest "none".

Each sandbox gets its own group nested under the server's own cgroup (so the server's
own limits still bound everything). A sandbox's processes are moved in as they appear,
before its agent is asked to start anything, so every command is born inside the group
(`SandboxMachine._join_group`). Which version a host offers is detected once; a host
with neither gets sandboxes without limits and says so in `Cgroups.report()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: v1 controllers a sandbox group is created in (freezer: stop everything before killing it).
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
#: Attempts to empty a group before giving up on its rmdir.
TEARDOWN_ATTEMPTS = 50


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. None means unlimited."""

    memory_bytes: int | None = 2 * 1024**3
    pids: int | None = 512
    cpus: float | None = 1.0


def own_cgroups() -> dict[str, str]:
    """Controller → this process's cgroup path, from /proc/self/cgroup ("" = v2 unified)."""
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            groups[c] = path
    return groups


def is_zombie(pid: int) -> bool:
    """A dead process not yet reaped by its parent: still listed, nothing left to kill."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


class SandboxGroup:
    """The cgroup(s) of one sandbox: join at launch, kill everything, remove."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    def join(self) -> None:
        """Called in the launcher between fork and exec: move this very process in."""
        pid = str(os.getpid())
        for d in self.dirs:
            (d / "cgroup.procs").write_text(pid)

    def add(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return found

    def memory_peak(self) -> int | None:
        for d in self.dirs:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError):
                    return int((d / name).read_text())
        return None

    def oom_kills(self) -> int:
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                with contextlib.suppress(OSError):
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
        return 0

    def destroy(self) -> None:
        """Kill every member, then remove the groups."""
        self.kill_all()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()

    def kill_all(self) -> None:
        """Freeze, SIGKILL every member, thaw; repeated until the group is empty."""
        freezer = next((d for d in self.dirs if "freezer" in d.parts or (d / "cgroup.freeze").exists()), None)
        for _ in range(TEARDOWN_ATTEMPTS):
            members = {p for p in self.pids() if not is_zombie(p)}
            if not members:
                break
            self._freeze(freezer, True)
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._freeze(freezer, False)
            time.sleep(0.002)

    @staticmethod
    def _freeze(freezer: Path | None, frozen: bool) -> None:
        if freezer is None:
            return
        if (freezer / "freezer.state").exists():
            (freezer / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (freezer / "cgroup.freeze").write_text("1" if frozen else "0")


class Cgroups:
    """What this host offers; `create` makes one sandbox's group with its limits."""

    def __init__(self, root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.version, self.reason = self._detect()

    def _detect(self) -> tuple[str, str]:
        if os.geteuid() != 0:
            return "none", "the server is not root: its sandboxes get no cgroup limits"
        own = own_cgroups()
        v1 = [c for c in V1_CONTROLLERS if c in own and (self.root / c).is_dir()]
        if {"memory", "pids"} <= set(v1):
            return "v1", "cgroup v1: " + ", ".join(v1)
        unified = self.root / own.get("", "/").lstrip("/")
        controllers = self.root / "cgroup.controllers"
        if controllers.exists() and {"memory", "pids"} <= set(controllers.read_text().split()):
            return "v2", f"cgroup v2 under {unified}"
        return "none", "no usable cgroup controllers (memory and pids needed)"

    def report(self) -> dict[str, object]:
        return {"cgroups": self.version, "detail": self.reason}

    def parents(self) -> list[Path]:
        """The directories sandbox groups are made in, one per controller (v1) or one (v2)."""
        own = own_cgroups()
        if self.version == "v1":
            return [self.root / c / own[c].lstrip("/") / "agentbox" for c in V1_CONTROLLERS if c in own]
        if self.version == "v2":
            return [self.root / own.get("", "/").lstrip("/") / "agentbox"]
        return []

    def groups(self) -> dict[str, SandboxGroup]:
        """Every sandbox group under this server's cgroup, by name (any server's, live or not)."""
        found: dict[str, list[Path]] = {}
        for parent in self.parents():
            with contextlib.suppress(OSError):
                for d in parent.iterdir():
                    if d.is_dir():
                        found.setdefault(d.name, []).append(d)
        return {name: SandboxGroup(dirs) for name, dirs in found.items()}

    def create(self, name: str, limits: Limits) -> SandboxGroup | None:
        if self.version == "v1":
            return self._create_v1(name, limits)
        if self.version == "v2":
            return self._create_v2(name, limits)
        return None

    def _create_v1(self, name: str, limits: Limits) -> SandboxGroup:
        own = own_cgroups()
        dirs = []
        for c in V1_CONTROLLERS:
            if c not in own or not (self.root / c).is_dir():
                continue
            d = self.root / c / own[c].lstrip("/") / "agentbox" / name
            d.mkdir(parents=True, exist_ok=True)
            dirs.append(d)
            if c == "memory" and limits.memory_bytes:
                (d / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                with contextlib.suppress(OSError):
                    (d / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
            if c == "pids" and limits.pids:
                (d / "pids.max").write_text(str(limits.pids))
            if c == "cpu" and limits.cpus:
                (d / "cpu.cfs_period_us").write_text("100000")
                (d / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * 100000)))
        return SandboxGroup(dirs)

    def _create_v2(self, name: str, limits: Limits) -> SandboxGroup:
        own = own_cgroups().get("", "/")
        parent = self.root / own.lstrip("/") / "agentbox"
        parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            (parent.parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        d = parent / name
        d.mkdir(exist_ok=True)
        if limits.memory_bytes:
            (d / "memory.max").write_text(str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.swap.max").write_text("0")
        if limits.pids:
            (d / "pids.max").write_text(str(limits.pids))
        if limits.cpus:
            with contextlib.suppress(OSError):
                (d / "cpu.max").write_text(f"{int(limits.cpus * 100000)} 100000")
        return SandboxGroup([d])
