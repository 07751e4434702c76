"""E2B's sandbox metrics: samples of what a sandbox uses, kept in a bounded ring.

    GET /sandboxes/{id}/metrics?start=&end=    200 [SandboxMetric]: the samples in [start, end]
    GET /sandboxes/metrics?sandbox_ids=a,b     200 {"sandboxes": {id: SandboxMetric}}: the newest

A sample is taken every METRICS_INTERVAL_SECONDS while a sandbox runs (E2B's own cadence),
and by a request that finds the newest older than FRESH_SECONDS, so an answer always ends at
"now" (a caller that ran a workload sees it at once) while polling adds at most one sample a
second. Each sandbox keeps its last MAX_METRIC_SAMPLES (an hour at the interval); the samples
live with the table, not on disk, so a restarted server starts each ring empty.

The figures are the machine's `Usage` (`agentbox.machines.usage`: its cgroup, or `/proc`
where the host gives it none) in E2B's units: `cpuUsedPct` is the CPU time used since the
previous sample over the wall time between them and `cpuCount` (0..100, the whole sandbox
busy = 100; the first sample of a lifetime counts from its start), `memUsed` excludes the
page cache (`memCache`), `memTotal` is the memory limit, `diskUsed` / `diskTotal` the
workspace's file system. A sandbox that is paused, reclaimed while idle or on a machine the
server cannot measure (not a bubblewrap sandbox) gets no new samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agentbox.machines.base import Usage

#: Seconds between two samples of a running sandbox (E2B samples every 5 s).
METRICS_INTERVAL_SECONDS = 5.0
#: Samples one sandbox keeps at most; the oldest goes first (an hour at the interval). A full
#: ring is about 120 KiB (measured), so MAX_E2B_SANDBOXES full rings stay under 30 MiB.
MAX_METRIC_SAMPLES = 720
#: A request takes a sample first when the newest is older than this, in seconds.
FRESH_SECONDS = 1.0
#: Sandbox ids one `GET /sandboxes/metrics` may name (E2B's `maxItems`).
MAX_METRICS_IDS = 100


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at a sandbox, in E2B's units."""

    at: float
    """Wall-clock seconds."""
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


class Samples:
    """One sandbox's ring of samples and the CPU reading the next one is measured from."""

    def __init__(self, limit: int = MAX_METRIC_SAMPLES) -> None:
        self.ring: deque[Sample] = deque(maxlen=limit)
        self._last: tuple[float, float, float] | None = None
        """(lifetime start, cpu seconds, wall time) of the previous reading."""

    def add(self, usage: Usage, now: float) -> Sample:
        """Record `usage` as read at `now` (wall-clock seconds)."""
        since_cpu, since = 0.0, usage.started_at
        last = self._last
        if last is not None and last[0] == usage.started_at and last[1] <= usage.cpu_seconds:
            since_cpu, since = last[1], last[2]  # the same lifetime: from the previous reading
        self._last = (usage.started_at, usage.cpu_seconds, now)
        elapsed = now - since
        busy = (usage.cpu_seconds - since_cpu) / (elapsed * usage.cpu_count) if elapsed > 0 else 0.0
        sample = Sample(
            now, usage.cpu_count, round(min(max(busy, 0.0), 1.0) * 100, 2),
            usage.memory_used, usage.memory_total, usage.memory_cache, usage.disk_used, usage.disk_total,
        )  # fmt: skip
        self.ring.append(sample)
        return sample

    def newest(self) -> Sample | None:
        return self.ring[-1] if self.ring else None

    def between(self, start: float | None, end: float | None) -> list[Sample]:
        """The samples taken in [start, end] (whole seconds, as E2B's query gives them)."""
        return [
            s
            for s in self.ring
            if (start is None or int(s.at) >= start) and (end is None or int(s.at) <= end)
        ]


def metric_view(sample: Sample) -> dict[str, Any]:
    """The `SandboxMetric` schema of E2B's `spec/openapi.yml`."""
    return {
        "timestamp": datetime.fromtimestamp(sample.at, UTC).isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(sample.at),
        "cpuCount": sample.cpu_count,
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.mem_used,
        "memTotal": sample.mem_total,
        "memCache": sample.mem_cache,
        "diskUsed": sample.disk_used,
        "diskTotal": sample.disk_total,
    }
