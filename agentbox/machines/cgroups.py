"""Per-sandbox resource limits through cgroups: v1, v2, or an honest "none".

Each sandbox gets its own group nested under the server's own cgroup (so the server's
own limits still bound everything). A sandbox's processes are moved in as they appear,
before its agent is asked to start anything, so every command is born inside the group
(`SandboxMachine._join_group`). Which version a host offers is detected once; a host
with neither gets sandboxes without limits and says so in `Cgroups.report()`.

A group is also where a sandbox's usage is read (`SandboxGroup.cpu_seconds`, `memory`): the
CPU time and memory of every process it ever held, the ended ones included, which no sum
over `/proc` gives. On v1 the CPU time is in the `cpuacct` controller, so groups are made
there too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: v1 controllers a sandbox group is created in (freezer: stop everything before killing it;
#: cpuacct: the CPU time its processes used, which v1's `cpu` does not count).
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
#: A v1 memory limit at or above this is the kernel's "unlimited" (it writes 2**63 rounded
#: down to a page).
V1_UNLIMITED = 1 << 62
#: Attempts to empty a group before giving up on its rmdir.
TEARDOWN_ATTEMPTS = 50


@dataclass(frozen=True)
class MemoryUse:
    """A group's memory as the kernel charges it, in bytes."""

    used: int
    """Charged and not page cache: what its processes hold (anonymous memory, kernel objects)."""
    cache: int
    """Page cache charged to it (files read and written; tmpfs such as its /tmp counts here)."""
    limit: int | None
    """Its limit, None when it has none."""


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

    def cpu_seconds(self) -> float | None:
        """CPU time its processes used since the group was made (v2 `cpu.stat` usage_usec, v1
        `cpuacct.usage`); None where no controller counts it."""
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                return int((d / "cpuacct.usage").read_text()) / 1e9
            with contextlib.suppress(OSError, KeyError, ValueError):
                return int(_keyed(d / "cpu.stat")["usage_usec"]) / 1e6
        return None

    def memory(self) -> MemoryUse | None:
        """What the memory controller charges it now (v2 `memory.current`, v1
        `memory.usage_in_bytes`, less the page cache of `memory.stat`); None without one."""
        for d in self.dirs:
            for current, limit, cache_key in (
                ("memory.current", "memory.max", "file"),
                ("memory.usage_in_bytes", "memory.limit_in_bytes", "total_cache"),
            ):
                with contextlib.suppress(OSError, KeyError, ValueError):
                    charged = int((d / current).read_text())
                    cache = int(_keyed(d / "memory.stat")[cache_key])
                    raw = (d / limit).read_text().strip()
                    bound = None if raw == "max" or int(raw) >= V1_UNLIMITED else int(raw)
                    return MemoryUse(max(charged - cache, 0), cache, bound)
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


def _keyed(path: Path) -> dict[str, str]:
    """A `key value` per line file (`cpu.stat`, `memory.stat`) as a dict."""
    return dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)


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
        dirs: list[Path] = []
        for c in V1_CONTROLLERS:
            if c not in own or not (self.root / c).is_dir():
                continue
            d = self.root / c / own[c].lstrip("/") / "agentbox" / name
            d.mkdir(parents=True, exist_ok=True)
            if any(os.path.samefile(d, other) for other in dirs):
                continue  # controllers mounted together (`cpu,cpuacct`): one directory
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
