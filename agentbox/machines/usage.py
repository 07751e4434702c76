"""What a bubblewrap sandbox uses now: CPU time, memory and disk, as a `Usage`.

From its cgroup where it has one (`cgroups.SandboxGroup`): the CPU time of every process it
ever held and the memory the kernel charges it, against the limits the group enforces. A
server without cgroups (not root, or a host without the controllers) has only `/proc`: the
CPU time of the processes alive now plus what their ended children reported to them when
reaped (the exec agent reaps every command, so finished commands count), and the sum of
their resident sets (shared pages counted once per process: an overestimate), against the
host's CPUs and memory, since nothing limits the sandbox there. The disk is its workspace's
file system either way (`disk.space`).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from agentbox.machines import disk
from agentbox.machines.base import Usage
from agentbox.machines.cgroups import Limits, SandboxGroup

#: Clock ticks per second, the unit of the CPU times in `/proc/<pid>/stat`.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def measure(
    group: SandboxGroup | None, pids: list[int], limits: Limits, workspace: Path, started_at: float
) -> Usage:
    """The usage of a sandbox whose cgroup is `group` (None: none) and whose processes are
    `pids` now (read only without a group)."""
    used, total = disk.space(workspace)
    memory = group.memory() if group is not None else None
    cpu = group.cpu_seconds() if group is not None else None
    if group is None or memory is None or cpu is None:
        cpu_seconds, resident = _from_proc(pids)
        return Usage(os.cpu_count() or 1, cpu_seconds, started_at, resident, 0, host_memory(), used, total)
    cpus = math.ceil(limits.cpus) if limits.cpus else (os.cpu_count() or 1)
    return Usage(cpus, cpu, started_at, memory.used, memory.cache, memory.limit or host_memory(), used, total)


def host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * PAGE_BYTES


def _from_proc(pids: list[int]) -> tuple[float, int]:
    """CPU seconds (own and reaped children's) and resident bytes of `pids`, from /proc."""
    ticks = pages = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            pages += int(fields[21])  # rss
    return ticks / CLOCK_TICKS, pages * PAGE_BYTES
