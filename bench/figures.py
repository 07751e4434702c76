"""Figures of a benchmark run: statistics, the printed table and the JSON file.

Both bench scripts report the same way (see DESIGN.md, "Performance is measured by
`bench/`"): every figure sits beside the raw operation it wraps, as a ratio, with the
target it is held to. A figure that misses its target is printed as MISS but never fails
the run: these numbers depend on the machine, so nothing asserts them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Share of samples below the p95 / p99 cut.
P95 = 0.95
P99 = 0.99


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least `q` of them at or below it."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def time_calls(call: Callable[[], object], count: int, warmup: int) -> list[float]:
    """Seconds each of `count` calls took, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


@dataclass(frozen=True)
class Target:
    """What a figure is held to: its value (`≤ limit unit`) or its ratio to the raw reference
    (`≤ limit`, or `≥ limit` for `at_least`: a throughput, where more is better)."""

    limit: float
    kind: Literal["value", "ratio", "at_least"] = "value"

    def text(self, unit: str) -> str:
        if self.kind == "ratio":
            return f"<= {self.limit:g}x raw"
        if self.kind == "at_least":
            return f">= {self.limit:g}x raw"
        return f"<= {self.limit:g} {unit}"


@dataclass
class Figure:
    """One row of the table: a measured operation beside the raw operation it wraps."""

    key: str
    """Stable name in the JSON file (`figures.<key>`)."""
    label: str
    unit: str
    """`ms`, `MiB`, `req/s`...: every number of the row is in it."""
    median: float | None
    p95: float | None = None
    p99: float | None = None
    samples: int = 0
    raw_label: str | None = None
    raw: float | None = None
    """The raw operation's median, in `unit`."""
    target: Target | None = None
    judged: Literal["median", "mean"] = "median"
    """Which statistic the target is checked against."""
    mean: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.median is None or not self.raw:
            return None
        return self.median / self.raw

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        if self.target.kind == "ratio":
            return None if self.ratio is None else self.ratio <= self.target.limit
        if self.target.kind == "at_least":
            return None if self.ratio is None else self.ratio >= self.target.limit
        value = self.mean if self.judged == "mean" else self.median
        if value is None:
            return None
        return value <= self.target.limit

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["target"] = (
            None if self.target is None else {**asdict(self.target), "text": self.target.text(self.unit)}
        )
        data["ratio"] = self.ratio
        data["met"] = self.met
        return data


def latency_figure(
    key: str,
    label: str,
    seconds: Sequence[float],
    *,
    raw_label: str | None = None,
    raw_seconds: float | None = None,
    target: Target | None = None,
    extra: dict[str, Any] | None = None,
) -> Figure:
    """A latency row in milliseconds from samples in seconds."""
    ms = [s * 1000 for s in seconds]
    return Figure(
        key,
        label,
        "ms",
        median=statistics.median(ms),
        p95=percentile(ms, P95),
        p99=percentile(ms, P99),
        samples=len(ms),
        raw_label=raw_label,
        raw=None if raw_seconds is None else raw_seconds * 1000,
        target=target,
        mean=statistics.fmean(ms),
        extra=extra or {},
    )


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _row(f: Figure) -> list[str]:
    raw = "-" if f.raw is None else f"{_num(f.raw)} {f.unit} ({f.raw_label})"
    ratio = "-" if f.ratio is None else f"{f.ratio:.2f}x"
    target = "-"
    if f.target is not None:
        target = f.target.text(f.unit) + ("" if f.met is None else (" ok" if f.met else " MISS"))
    p = (_num(f.p95), _num(f.p99))
    return [f.label, f"{_num(f.median)} {f.unit}", *p, raw, ratio, target]


def table(figures: Sequence[Figure]) -> str:
    """The figures as a plain-text table (operation | median | p95 | p99 | raw reference | ratio | target)."""
    head = ["operation", "median", "p95", "p99", "raw reference", "ratio", "target"]
    rows = [head, *(_row(f) for f in figures)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def footer(elapsed: float) -> str:
    """The run's wall time and the host's load: figures from a busy host read high."""
    one, five, _ = os.getloadavg()
    return f"({elapsed:.1f} s; load average {one:.1f} (1 min), {five:.1f} (5 min), {os.cpu_count()} cpus)"


def host_info() -> dict[str, Any]:
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "euid": os.geteuid(),
        "loadavg": os.getloadavg(),
    }


def write_json(path: Path, script: str, quick: bool, figures: Sequence[Figure], **details: Any) -> None:
    """Everything the run measured: `figures` keyed by `Figure.key`, plus host and run details."""
    document = {
        "script": script,
        "quick": quick,
        "time": time.time(),
        "host": host_info(),
        **details,
        "figures": {f.key: f.to_dict() for f in figures},
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


#: Where scratch homes go: sticky and world-searchable, so the sandbox uid reaches below it.
SCRATCH_PARENT = Path("/var/tmp")


def arg_parser(description: str | None) -> argparse.ArgumentParser:
    """The options every bench script takes; scripts add their own."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny counts: checks the script runs, measures little"
    )
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    return parser


@contextmanager
def scratch_dir(name: str) -> Iterator[Path]:
    """A temporary directory the sandbox uid can reach (0755), removed afterwards."""
    parent = SCRATCH_PARENT if SCRATCH_PARENT.is_dir() else None
    tmp = Path(tempfile.mkdtemp(prefix=f"agentbox-bench-{name}-", dir=parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
