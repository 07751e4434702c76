"""Sandbox figures, measured in one process on the machines layer (no HTTP).

    python bench/bench_sandbox.py [--quick] [--json out.json] [--sandboxes 200]

Each figure is printed beside the raw operation it wraps (README.md in this folder
explains each one). The sandboxes live under a temporary AGENTBOX home that is removed
at the end; every sandbox started here is stopped, also when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from figures import (
    P95,
    Figure,
    Target,
    arg_parser,
    footer,
    latency_figure,
    percentile,
    scratch_dir,
    table,
    time_calls,
    write_json,
)

from agentbox.machines import bwrap as bwrap_mod
from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import AGENT_SOURCE, SandboxConfig, SandboxHost, SandboxMachine

#: Issue targets this script reports against.
EXEC_RATIO_TARGET = 1.6
"""exec of `true` in a live sandbox, as a multiple of a bare `sh -c true` spawn."""
COLD_START_TARGET_MS = 30.0
"""Constructing a sandbox, starting it and finishing its first `true`."""
IDLE_RSS_TARGET_MIB = 15.0
"""Resident memory of one idle sandbox, all its processes together (mean)."""
#: Sandboxes started at once while filling the idle-memory population.
START_CONCURRENCY = 4
MIB = 1024 * 1024


@dataclass(frozen=True)
class Counts:
    """How many times each figure is sampled (full run, or `--quick` for the smoke test)."""

    spawn: int = 200
    spawn_warmup: int = 20
    exec: int = 500
    exec_warmup: int = 50
    cold: int = 20
    oneshot: int = 50
    idle_off: int = 200
    idle_on: int = 20


QUICK = Counts(spawn=10, spawn_warmup=2, exec=20, exec_warmup=5, cold=2, oneshot=3, idle_off=3, idle_on=2)


# --- raw references ---------------------------------------------------------------------


def bare_spawn() -> None:
    subprocess.run(["sh", "-c", "true"], check=True)


async def asyncio_spawn_samples(count: int, warmup: int) -> list[float]:
    samples = []
    for i in range(warmup + count):
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("sh", "-c", "true")
        await proc.wait()
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return samples


def oneshot_bwrap_argv(host: SandboxHost) -> list[str]:
    """The namespaces a sandbox gets, with the fewest mounts that can run `sh -c true`."""
    args = [
        str(host.bwrap),
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    for d in ("bin", "sbin", "lib", "lib64"):
        if Path(f"/{d}").is_symlink():
            args += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
        elif Path(f"/{d}").is_dir():
            args += ["--ro-bind", f"/{d}", f"/{d}"]
    return [*args, "sh", "-c", "true"]


def oneshot_bwrap(host: SandboxHost, argv: list[str]) -> None:
    """As the sandbox uid, like a real sandbox (a root bwrap skips the user-namespace set-up)."""
    ids = {"user": host.uid, "group": host.gid, "extra_groups": []} if host.root else {}
    subprocess.run(argv, check=True, cwd="/", **ids)  # type: ignore[call-overload]


def agent_alone_memory(host: SandboxHost) -> tuple[int, int]:
    """RSS and PSS (bytes) of the exec agent's interpreter started without any sandbox, once ready."""
    assert host.python is not None
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [host.python, "-I", "-S", "-c", AGENT_SOURCE, str(child.fileno())], pass_fds=[child.fileno()]
    )
    child.close()
    try:
        if parent.recv(16) != b"R":
            raise RuntimeError("the exec agent did not report ready")
        return process_memory(proc.pid)
    finally:
        parent.close()
        proc.wait(10)


# --- the sandbox -------------------------------------------------------------------------


@dataclass
class Lab:
    """One temporary AGENTBOX home and every sandbox started in it (so all can be stopped)."""

    root: Path
    host: SandboxHost
    live: list[SandboxMachine] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    made: int = 0

    def machine(
        self, network: bool, layer: bool, kind: type[SandboxMachine] = SandboxMachine
    ) -> SandboxMachine:
        """A new (not started) sandbox of this home's host; `kind` lets a caller time its phases."""
        self.made += 1
        sid = f"sbx_bench{self.token}{self.made:05d}"
        m = kind(
            "sandbox",
            sid,
            self.host,
            SandboxConfig(network=network, system_layer=layer),
            self.root / "sessions" / sid / "workspace",
            self.root / "sessions" / sid / "run",
        )
        self.live.append(m)
        return m

    async def stop(self, m: SandboxMachine) -> None:
        await m.stop()
        with contextlib.suppress(ValueError):
            self.live.remove(m)

    async def stop_all(self) -> None:
        machines, self.live = self.live, []
        await asyncio.gather(*(m.stop() for m in machines), return_exceptions=True)


async def exec_samples(lab: Lab, layer: bool, count: int, warmup: int) -> list[float]:
    m = lab.machine(network=False, layer=layer)
    await m.start()
    try:
        samples = []
        for i in range(warmup + count):
            start = time.perf_counter()
            result = await m.exec(ExecRequest("true"))
            elapsed = time.perf_counter() - start
            if result.exit_code != 0:
                raise RuntimeError(f"`true` exited {result.exit_code} in the sandbox: {result.stderr!r}")
            if i >= warmup:
                samples.append(elapsed)
        return samples
    finally:
        await lab.stop(m)


async def cold_samples(lab: Lab, network: bool, layer: bool, count: int) -> list[float]:
    """Construct + start + first `true` finished; the stop after each one is not timed."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        m = lab.machine(network, layer)
        await m.start()
        result = await m.exec(ExecRequest("true"))
        samples.append(time.perf_counter() - start)
        await lab.stop(m)
        if result.exit_code != 0:
            raise RuntimeError(f"`true` exited {result.exit_code} in a cold sandbox")
    return samples


# --- memory ------------------------------------------------------------------------------


def _status_kib(pid: int, name: str, file: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def process_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes; PSS splits each shared page among the processes mapping it."""
    return _status_kib(pid, "VmRSS", "status") * 1024, _status_kib(pid, "Pss", "smaps_rollup") * 1024


def _children(pid: int) -> Iterator[int]:
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                yield from (int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())


def sandbox_pids(m: SandboxMachine) -> set[int]:
    """Every process of a sandbox: its cgroup's members, plus its process tree, its
    fuse-overlayfs daemons and its slirp4netns (a process can miss the cgroup: see README)."""
    found: set[int] = m._group.pids() if m._group is not None else set()
    todo = [m._proc.pid] if m._proc is not None else []
    todo += [p.pid for p in getattr(m, "_fuse", [])]
    if m._slirp is not None:
        todo.append(m._slirp.pid)
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(_children(pid))
    return found | seen


def outside_group(m: SandboxMachine) -> int:
    """Processes of the sandbox that its cgroup does not hold (so its limits do not bind them)."""
    if m._group is None:
        return 0
    return len(sandbox_pids(m) - m._group.pids())


def _kind(pid: int) -> str:
    """What a sandbox process is, for the per-process breakdown (the agent may run via ld.so)."""
    with contextlib.suppress(OSError):
        names = [
            os.path.basename(a) for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:4]
        ]
        return "exec agent" if any(n.startswith("python") for n in names) else names[0]
    return "?"


@dataclass
class Population:
    """Memory of a set of idle sandboxes, per sandbox and per kind of process."""

    network: bool
    rss: list[int] = field(default_factory=list)
    pss: list[int] = field(default_factory=list)
    pss_anon: list[int] = field(default_factory=list)
    """The anonymous part of `pss`: what does not shrink as more sandboxes share the files."""
    processes: list[int] = field(default_factory=list)
    escaped: int = 0
    """Sandboxes with a process outside their cgroup."""
    by_process: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """RSS summed per kind of process (`_kind`)."""
    pss_by_process: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    start_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.rss))
        return {
            "network": self.network,
            "system_layer": True,
            "start_all_seconds": self.start_seconds,
            "processes_per_sandbox": statistics.fmean(self.processes) if self.processes else 0,
            "sandboxes_with_processes_outside_their_cgroup": self.escaped,
            "rss_mib_per_sandbox_by_process": {k: v / MIB / n for k, v in sorted(self.by_process.items())},
        }

    def measure(self, m: SandboxMachine) -> None:
        rss = pss = anon = 0
        pids = sandbox_pids(m)
        for pid in pids:
            r, p = process_memory(pid)
            rss, pss = rss + r, pss + p
            anon += _status_kib(pid, "Pss_Anon", "smaps_rollup") * 1024
            self.by_process[_kind(pid)] += r
            self.pss_by_process[_kind(pid)] += p
        self.rss.append(rss)
        self.pss.append(pss)
        self.pss_anon.append(anon)
        self.processes.append(len(pids))
        self.escaped += outside_group(m) > 0


async def idle_population(lab: Lab, count: int, network: bool) -> Population:
    """Start `count` sandboxes (each runs one `true` to prove it is live), measure, stop them."""
    population = Population(network)
    gate = asyncio.Semaphore(START_CONCURRENCY)

    async def start_one() -> SandboxMachine:
        async with gate:
            m = lab.machine(network, layer=True)
            await m.start()
            if (await m.exec(ExecRequest("true"))).exit_code != 0:
                raise RuntimeError("`true` failed in an idle-population sandbox")
            return m

    started = time.perf_counter()
    machines = await asyncio.gather(*(start_one() for _ in range(count)))
    population.start_seconds = time.perf_counter() - started
    try:
        for m in machines:
            population.measure(m)
    finally:
        await asyncio.gather(*(lab.stop(m) for m in machines), return_exceptions=True)
    return population


def memory_figures(p: Population, agent: tuple[int, int]) -> list[Figure]:
    """Per-sandbox RSS and PSS beside the exec agent alone, and the population's total."""
    n, net = len(p.rss), "on" if p.network else "off"
    tag = f"net {net}, n={n}"
    rows = []
    for kind, values, raw in (("RSS", p.rss, agent[0]), ("PSS", p.pss, agent[1])):
        mib = [v / MIB for v in values]
        rows.append(
            Figure(
                f"idle_{kind.lower()}_net_{net}",
                f"idle sandbox {kind} per sandbox ({tag})",
                "MiB",
                median=statistics.median(mib),
                p95=percentile(mib, P95),
                samples=n,
                raw_label=f"exec agent alone, {kind}",
                raw=raw / MIB,
                target=Target(IDLE_RSS_TARGET_MIB) if kind == "RSS" else None,
                judged="mean",
                mean=statistics.fmean(mib),
                extra={"total_mib": sum(mib)},
            )
        )
    rows.append(
        Figure(
            f"idle_total_net_{net}",
            f"idle sandboxes, total RSS ({tag})",
            "MiB",
            median=sum(p.rss) / MIB,
            samples=n,
            extra={"total_pss_mib": sum(p.pss) / MIB, **p.summary()},
        )
    )
    return rows


def memory_note(p: Population) -> str:
    n = len(p.rss)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in p.summary()["rss_mib_per_sandbox_by_process"].items())
    return (
        f"idle, net {'on' if p.network else 'off'}: {n} sandboxes started in {p.start_seconds:.1f} s; "
        f"RSS total {sum(p.rss) / MIB:,.0f} MiB, mean {sum(p.rss) / MIB / n:.2f} MiB/sandbox; "
        f"PSS total {sum(p.pss) / MIB:,.0f} MiB, mean {sum(p.pss) / MIB / n:.2f} MiB/sandbox; "
        f"{statistics.fmean(p.processes):.1f} processes/sandbox; RSS MiB/sandbox by process: {parts}; "
        f"{p.escaped} of {n} had a process outside their cgroup"
    )


# --- the run -----------------------------------------------------------------------------


def seconds(figure: Figure) -> float:
    """A latency figure's median back in seconds."""
    assert figure.median is not None and figure.unit == "ms"
    return figure.median / 1000


async def spawn_figures(counts: Counts) -> list[Figure]:
    samples = time_calls(bare_spawn, counts.spawn, counts.spawn_warmup)
    asamples = await asyncio_spawn_samples(counts.spawn, counts.spawn_warmup)
    return [
        latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", samples),
        latency_figure("asyncio_spawn", "bare spawn sh -c true (asyncio)", asamples),
    ]


async def exec_figures(lab: Lab, counts: Counts, spawn: Figure, aspawn: Figure) -> list[Figure]:
    figures = []
    for layer in ("on", "off"):
        samples = await exec_samples(lab, layer == "on", counts.exec, counts.exec_warmup)
        figure = latency_figure(
            f"exec_true_layer_{layer}",
            f"exec true, live sandbox, layer {layer}",
            samples,
            raw_label="subprocess.run",
            raw_seconds=seconds(spawn),
            target=Target(EXEC_RATIO_TARGET, "ratio"),
        )
        figure.extra["ratio_to_asyncio_spawn"] = statistics.median(samples) / seconds(aspawn)
        figures.append(figure)
    return figures


async def cold_figures(lab: Lab, counts: Counts) -> list[Figure]:
    argv = oneshot_bwrap_argv(lab.host)
    samples = time_calls(lambda: oneshot_bwrap(lab.host, argv), counts.oneshot, 3)
    oneshot = latency_figure("bwrap_oneshot", "one-shot bwrap sh -c true", samples, extra={"argv": argv})
    figures = [oneshot]
    for network in ("off", "on"):
        for layer in ("on", "off"):
            samples = await cold_samples(lab, network == "on", layer == "on", counts.cold)
            figures.append(
                latency_figure(
                    f"cold_start_net_{network}_layer_{layer}",
                    f"cold start -> first true done (net {network}, layer {layer})",
                    samples,
                    raw_label="one-shot bwrap",
                    raw_seconds=seconds(oneshot),
                    target=Target(COLD_START_TARGET_MS),
                )
            )
    return figures


async def idle_figures(lab: Lab, counts: Counts, notes: list[str]) -> list[Figure]:
    agent = agent_alone_memory(lab.host)
    figures = [
        Figure(
            "agent_alone_rss",
            "exec agent alone, no sandbox (RSS)",
            "MiB",
            agent[0] / MIB,
            samples=1,
            extra={"pss_mib": agent[1] / MIB},
        )
    ]
    for network, count in ((False, counts.idle_off), (True, counts.idle_on)):
        if count > 0:
            population = await idle_population(lab, count, network)
            figures += memory_figures(population, agent)
            notes.append(memory_note(population))
    return figures


async def run(counts: Counts, root: Path) -> tuple[list[Figure], list[str], dict[str, object]]:
    host = SandboxHost(root)
    lab = Lab(root, host)
    notes: list[str] = []
    details: dict[str, object] = {
        "counts": counts.__dict__,
        "bwrap": str(host.bwrap),
        "bwrap_version": bwrap_mod.version(host.bwrap),
        "cgroups": host.cgroups.report(),
        "system_layer": host.system_layer()[1],
        "slirp4netns": host.slirp,
    }
    try:
        figures = await spawn_figures(counts)
        figures += await exec_figures(lab, counts, *figures[:2])
        figures += await cold_figures(lab, counts)
        figures += await idle_figures(lab, counts, notes)
    finally:
        await lab.stop_all()
    return figures, notes, details


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument(
        "--sandboxes", type=int, help="idle sandboxes for the memory figure, network off (200)"
    )
    parser.add_argument("--sandboxes-net", type=int, help="idle sandboxes with network on (20)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    if args.sandboxes is not None:
        counts = Counts(**{**counts.__dict__, "idle_off": args.sandboxes})
    if args.sandboxes_net is not None:
        counts = Counts(**{**counts.__dict__, "idle_on": args.sandboxes_net})
    started = time.perf_counter()
    with scratch_dir("sandbox") as tmp:
        figures, notes, details = asyncio.run(run(counts, tmp / "home"))
    print(table(figures))
    for note in notes:
        print(note)
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_sandbox", args.quick, figures, notes=notes, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
