"""Sandbox figures on an image: cold start per kind of root, exec, idle memory, image builds.

    python bench/bench_images.py [--quick] [--json out.json] [--images DIR] [--cold 30]
                                 [--exec 300] [--idle 8] [--build PROFILE]...

The sandboxes run on the `base` image already built in DIR (the server's images by
default). The script never builds, rebuilds or removes it: build times are read from the
manifests, and `--build PROFILE` times a fresh build into a scratch images directory.
Each figure is printed beside the raw operation it wraps; README.md in this folder says
what each one is. The AGENTBOX homes are temporary, and every sandbox is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from bench_sandbox import (
    EXEC_RATIO_TARGET,
    MIB,
    Lab,
    Population,
    agent_alone_memory,
    asyncio_spawn_samples,
    bare_spawn,
    idle_population,
    seconds,
)
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

from agentbox.config import default_home
from agentbox.machines import bwrap as bwrap_mod
from agentbox.machines.base import ExecRequest
from agentbox.machines.images import PROFILES, Image, ImageStore
from agentbox.machines.sandbox import (
    DEFAULT_SANDBOX_UID,
    FUSE_OVERLAY,
    KERNEL_OVERLAY,
    LAUNCH_ENV,
    NO_LAYER,
    RootPlan,
    SandboxConfig,
    SandboxHost,
    SandboxMachine,
)

#: The image every sandbox here runs on.
IMAGE = "base"
COLD_START_TARGET_MS = 30.0
"""Constructing a sandbox on the image, starting it and finishing its first `true`."""
IDLE_PSS_TARGET_MIB = 4.0
"""Proportional memory of one idle sandbox on the image, all its processes together (median)."""


@dataclass(frozen=True)
class Counts:
    """How many times each figure is sampled (full run, or `--quick` for the smoke test)."""

    spawn: int = 200
    spawn_warmup: int = 20
    probe: int = 5
    cold: int = 30
    exec: int = 300
    exec_warmup: int = 30
    idle: int = 8


QUICK = Counts(spawn=10, spawn_warmup=2, probe=1, cold=2, exec=10, exec_warmup=2, idle=1)


# --- the roots compared ------------------------------------------------------------------


@dataclass
class Root:
    """One kind of sandbox root, on the lab (home and host) that gives it."""

    key: str
    label: str
    lab: Lab
    layer: bool
    """`SandboxConfig.system_layer`."""
    expect: tuple[bool, str]
    """(on the image, layer kind) the host must plan for this row to mean what it says."""
    network: bool = False

    def plan(self) -> RootPlan:
        return self.lab.host.plan(SandboxConfig(network=self.network, system_layer=self.layer))

    def mismatch(self) -> str | None:
        """Why this host cannot give this root (then the row is left out), or None."""
        plan = self.plan()
        got = (plan.image is not None, plan.layer)
        if got == self.expect:
            return None
        return f"{self.key}: this host gives image={plan.image_detail!r}, layer={plan.layer} ({plan.layer_detail})"


@dataclass
class Labs:
    """The three homes: sandboxes on the image (kernel overlay), on it with fuse forced, on the host."""

    kernel: Lab
    fuse: Lab
    host: Lab

    def all(self) -> list[Lab]:
        return [self.kernel, self.fuse, self.host]

    def roots(self) -> list[Root]:
        return [
            Root("kernel_overlay", "image, kernel overlay", self.kernel, True, (True, KERNEL_OVERLAY)),
            Root("fuse_overlay", "image, fuse-overlayfs", self.fuse, True, (True, FUSE_OVERLAY)),
            Root("no_layer", "image, no layer", self.kernel, False, (True, NO_LAYER)),
            Root("host_fuse", "host /usr, fuse-overlayfs", self.host, True, (False, FUSE_OVERLAY)),
            Root(
                "kernel_overlay_net_on", "image, kernel overlay, net on", self.kernel, True,
                (True, KERNEL_OVERLAY), network=True,
            ),
        ]  # fmt: skip


def make_labs(root: Path, images: Path, image: Image) -> Labs:
    """Each lab its own home and host, so forcing fuse on one leaves the others' probe alone."""
    for d in ("kernel", "fuse", "host", "no-images"):
        (root / d).mkdir(parents=True)
    fuse = SandboxHost(root / "fuse", images=images)
    fuse._kernel_overlay[image.rootfs] = False  # as if the kernel refused: the fuse-overlayfs layer
    return Labs(
        Lab(root / "kernel", SandboxHost(root / "kernel", images=images)),
        Lab(root / "fuse", fuse),
        Lab(root / "host", SandboxHost(root / "host", images=root / "no-images")),
    )


# --- raw references ----------------------------------------------------------------------


def overlay_bwrap_argv(host: SandboxHost, rootfs: Path, command: list[str]) -> list[str]:
    """One bwrap on the image under a tmpfs overlay, with the sandbox's namespaces, as its uid."""
    args = [
        str(host.bwrap),
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--unshare-cgroup-try", "--uid", "0", "--gid", "0", "--die-with-parent",
        "--overlay-src", str(rootfs), "--tmp-overlay", "/",
        "--proc", "/proc", "--dev", "/dev", *command,
    ]  # fmt: skip
    return host.as_sandbox_uid(args)


def run_quiet(argv: list[str]) -> None:
    subprocess.run(argv, check=True, cwd="/", env=LAUNCH_ENV, stdin=subprocess.DEVNULL)


def probe_samples(host: SandboxHost, image: Image, count: int) -> list[float]:
    """The overlay probe a host runs once per image (its first sandbox on it pays for it)."""
    samples = []
    for _ in range(count):
        host._kernel_overlay.pop(image.rootfs, None)
        start = time.perf_counter()
        ok = host.kernel_overlay(image)
        samples.append(time.perf_counter() - start)
        if not ok:
            raise RuntimeError("the kernel refused the overlay probe on this host")
    return samples


async def spawn_figures(counts: Counts) -> list[Figure]:
    spawn = time_calls(bare_spawn, counts.spawn, counts.spawn_warmup)
    aspawn = await asyncio_spawn_samples(counts.spawn, counts.spawn_warmup)
    return [
        latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", spawn),
        latency_figure("asyncio_spawn", "bare spawn sh -c true (asyncio)", aspawn),
    ]


@dataclass
class OneShot:
    """A raw one-shot bwrap on the image, sampled in the same rounds as the cold starts."""

    key: str
    label: str
    argv: list[str]
    samples: list[float] = field(default_factory=list)

    async def sample(self) -> None:
        start = time.perf_counter()
        run_quiet(self.argv)  # blocking the loop on purpose: nothing else is running
        self.samples.append(time.perf_counter() - start)

    def reset(self) -> None:
        self.samples.clear()

    def figure(self, raw: OneShot | None = None) -> Figure:
        return latency_figure(
            self.key,
            self.label,
            self.samples,
            raw_label=None if raw is None else "bwrap /bin/true",
            raw_seconds=None if raw is None else statistics.median(raw.samples),
            extra={"argv": self.argv},
        )


def one_shots(host: SandboxHost, image: Image) -> tuple[OneShot, OneShot]:
    """bwrap running /bin/true, and the image's python started the way the exec agent is."""
    python = ["/usr/bin/python3", "-I", "-S", "-c", "pass"]
    return (
        OneShot("bwrap_overlay_true", "one-shot bwrap on the image, /bin/true",
                overlay_bwrap_argv(host, image.rootfs, ["/bin/true"])),
        OneShot("bwrap_overlay_python", "one-shot bwrap on the image, python3 -I -S -c pass",
                overlay_bwrap_argv(host, image.rootfs, python)),
    )  # fmt: skip


# --- cold start, with where its time goes -------------------------------------------------


class PhasedMachine(SandboxMachine):
    """A sandbox that notes when each step of its start ends (`perf_counter`), for the breakdown."""

    marks: dict[str, float]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.marks = {"construct": time.perf_counter()}

    def _mark(self, step: str) -> None:
        self.marks[step] = time.perf_counter()

    def _prepare_dirs(self) -> None:
        super()._prepare_dirs()
        self._mark("plan + dirs")

    def _mount_private(self) -> dict[str, Path]:
        points = super()._mount_private()
        self._mark("tmpfs /tmp, $HOME")
        return points

    async def _mount_layer(self, lowers: tuple[tuple[str, tuple[Path, ...]], ...]) -> Path:
        merged = await super()._mount_layer(lowers)
        self._mark("fuse-overlayfs mounted")
        return merged

    async def _launch(self) -> None:
        await super()._launch()
        # bwrap writes --info-fd right after it clones the sandbox, before the child mounts anything.
        self._mark("setpriv + bwrap to clone")
        self._ready_future().add_done_callback(lambda _: self._mark("mounts + agent to ready"))

    async def _start_network(self, child_pid: int) -> None:
        await super()._start_network(child_pid)
        self._mark("slirp4netns up")

    async def _join_group(self) -> None:
        await super()._join_group()
        self._mark("join cgroup")


@dataclass
class Cold:
    """Cold-start samples of one root, and the time of each step of its start."""

    root: Root
    samples: list[float] = field(default_factory=list)
    steps: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    async def sample(self) -> None:
        start = time.perf_counter()
        m = cast(PhasedMachine, self.root.lab.machine(self.root.network, self.root.layer, PhasedMachine))
        try:
            await m.start()
            m._mark("start() returns")
            result = await m.exec(ExecRequest("true"))
            m._mark("first exec true")
        finally:
            await self.root.lab.stop(m)
        if result.exit_code != 0:
            raise RuntimeError(f"`true` exited {result.exit_code} in a cold sandbox ({self.root.key})")
        self.samples.append(m.marks["first exec true"] - start)
        previous = start
        for step, at in m.marks.items():
            self.steps[step].append(at - previous)
            previous = at

    def reset(self) -> None:
        self.samples.clear()
        self.steps.clear()

    def breakdown(self) -> dict[str, float]:
        """Median milliseconds of each step, in the order they happen."""
        return {step: statistics.median(v) * 1000 for step, v in self.steps.items()}


async def cold_figures(roots: list[Root], counts: Counts, image: Image) -> tuple[list[Figure], list[str]]:
    """The raw one-shots and every root's cold start in interleaved rounds (one sample of each
    per round), so a burst of load on the shared host weighs on a row and its reference alike."""
    host = roots[0].lab.host
    probe = probe_samples(host, image, counts.probe)
    true, python = one_shots(host, image)
    colds = [Cold(r) for r in roots]
    samplers: list[OneShot | Cold] = [true, python, *colds]
    for sampler in samplers:  # warm-up: the first sandbox of a host builds the seccomp filter, etc.
        await sampler.sample()
        sampler.reset()
    for _ in range(counts.cold):
        for sampler in samplers:
            await sampler.sample()
    oneshot = true.figure()
    figures = [oneshot, python.figure(true)]
    figures.append(
        latency_figure(
            "overlay_probe",
            "kernel overlay probe (once per host and image)",
            probe,
            raw_label="bwrap /bin/true",
            raw_seconds=seconds(oneshot),
        )
    )
    notes = []
    for c in colds:
        steps = c.breakdown()
        figures.append(
            latency_figure(
                f"cold_{c.root.key}",
                f"cold start -> first true done ({c.root.label})",
                c.samples,
                raw_label="bwrap /bin/true",
                raw_seconds=seconds(oneshot),
                target=Target(COLD_START_TARGET_MS),
                extra={"steps_ms": steps, "plan": plan_summary(c.root.plan())},
            )
        )
        notes.append(
            f"cold {c.root.key}, median ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items())
        )
    return figures, notes


def plan_summary(plan: RootPlan) -> dict[str, Any]:
    return {"image": plan.image_detail, "layer": plan.layer}


# --- exec and idle memory ------------------------------------------------------------------


async def exec_rounds(root: Root, counts: Counts) -> tuple[list[float], list[float], list[float]]:
    """`exec true` in one live sandbox, a bare spawn and an asyncio spawn, in turn, round after
    round: the same load weighs on a figure and its references."""
    m = root.lab.machine(False, root.layer)
    await m.start()
    execs: list[float] = []
    spawns: list[float] = []
    aspawns: list[float] = []
    try:
        for i in range(counts.exec_warmup + counts.exec):
            start = time.perf_counter()
            result = await m.exec(ExecRequest("true"))
            elapsed = time.perf_counter() - start
            if result.exit_code != 0:
                raise RuntimeError(f"`true` exited {result.exit_code} in the sandbox: {result.stderr!r}")
            spawn = time_calls(bare_spawn, 1, 0)
            aspawn = await asyncio_spawn_samples(1, 0)
            if i >= counts.exec_warmup:
                execs.append(elapsed)
                spawns += spawn
                aspawns += aspawn
    finally:
        await root.lab.stop(m)
    return execs, spawns, aspawns


async def exec_figures(roots: list[Root], counts: Counts) -> list[Figure]:
    figures = []
    for root in roots:
        execs, spawns, aspawns = await exec_rounds(root, counts)
        figure = latency_figure(
            f"exec_true_{root.key}",
            f"exec true, live sandbox ({root.label})",
            execs,
            raw_label="subprocess.run, same rounds",
            raw_seconds=statistics.median(spawns),
            target=Target(EXEC_RATIO_TARGET, "ratio"),
        )
        figure.extra["ratio_to_asyncio_spawn"] = statistics.median(execs) / statistics.median(aspawns)
        figures.append(figure)
    return figures


def idle_figure(root: Root, p: Population, agent_pss: int) -> Figure:
    n = len(p.pss)
    mib = [v / MIB for v in p.pss]
    return Figure(
        f"idle_pss_{root.key}",
        f"idle sandbox PSS ({root.label}, {n} alive)",
        "MiB",
        median=statistics.median(mib),
        p95=percentile(mib, P95),
        samples=n,
        raw_label="exec agent alone, PSS",
        raw=agent_pss / MIB,
        target=Target(IDLE_PSS_TARGET_MIB),
        mean=statistics.fmean(mib),
        extra={
            "rss_mib_median": statistics.median(v / MIB for v in p.rss),
            "pss_anon_mib_median": statistics.median(v / MIB for v in p.pss_anon),
            "processes_per_sandbox": statistics.fmean(p.processes),
            "pss_mib_per_sandbox_by_process": {k: v / MIB / n for k, v in sorted(p.pss_by_process.items())},
            "sandboxes_with_processes_outside_their_cgroup": p.escaped,
            "plan": plan_summary(root.plan()),
        },
    )


async def idle_figures(roots: list[Root], counts: Counts, notes: list[str]) -> list[Figure]:
    """`counts.idle` idle sandboxes of each root alive at once (each has run one `true`)."""
    agent = agent_alone_memory(roots[0].lab.host)
    figures = [
        Figure(
            "agent_alone_pss",
            "exec agent alone, host python, no sandbox (PSS)",
            "MiB",
            agent[1] / MIB,
            samples=1,
            extra={"rss_mib": agent[0] / MIB},
        )
    ]
    for root in roots:
        if root.layer:  # the idle figure is held to its target with the layer on
            population = await idle_population(root.lab, counts.idle, root.network)
            figure = idle_figure(root, population, agent[1])
            figures.append(figure)
            parts = ", ".join(
                f"{k} {v:.2f}" for k, v in figure.extra["pss_mib_per_sandbox_by_process"].items()
            )
            anon = figure.extra["pss_anon_mib_median"]
            notes.append(f"idle {root.key}: PSS MiB per sandbox by process: {parts}; anonymous {anon:.2f}")
    return figures


# --- image builds --------------------------------------------------------------------------


def build_figure(key: str, label: str, image: Image, wall: float | None = None) -> Figure:
    """A build's seconds: the manifest's record, or `wall` (timed here) beside that record."""
    m = image.manifest
    extra = {
        "source": "manifest" if wall is None else "timed here",
        "size_mib": m.size / MIB,
        "packages": len(m.packages),
        "digest": m.digest,
        "created": m.created,
    }
    if wall is None:
        return Figure(key, label, "s", m.build_seconds, samples=1, extra=extra)
    return Figure(key, label, "s", wall, samples=1, extra=extra)


def recorded_builds(store: ImageStore, notes: list[str]) -> list[Figure]:
    """Each profile's image of the same name, as its manifest recorded the build (not rebuilt)."""
    figures = []
    for profile in PROFILES:
        image = store.find(profile)
        if image is None or image.manifest.profile != profile:
            notes.append(f"build {profile}: no image {profile!r} of that profile in {store.root}; no figure")
            continue
        figures.append(
            build_figure(f"build_{profile}", f"image build, {profile} profile (from its manifest)", image)
        )
    return figures


def fresh_builds(profiles: list[str], store: ImageStore, scratch: Path) -> list[Figure]:
    """Time a fresh build of each profile into a scratch images directory (removed afterwards)."""
    figures = []
    fresh = ImageStore(scratch, store.uid, store.gid)
    for profile in profiles:
        start = time.perf_counter()
        image = fresh.build(fresh.request(profile, profile))
        figure = build_figure(
            f"build_fresh_{profile}", f"image build, {profile} profile (timed here)", image,
            wall=time.perf_counter() - start,
        )  # fmt: skip
        recorded = store.find(profile)
        if recorded is not None:
            figure.raw, figure.raw_label = recorded.manifest.build_seconds, "recorded build"
        figures.append(figure)
    return figures


# --- the run -------------------------------------------------------------------------------


async def run(
    counts: Counts, root: Path, store: ImageStore, build: list[str]
) -> tuple[list[Figure], list[str], dict[str, Any]]:
    image = store.get(IMAGE)
    labs = make_labs(root / "homes", store.root, image)
    notes: list[str] = []
    roots = []
    for r in labs.roots():
        reason = r.mismatch()
        if reason is None:
            roots.append(r)
        else:
            notes.append(f"left out: {reason}")
    details: dict[str, Any] = {
        "counts": counts.__dict__,
        "image": {"name": image.name, "digest": image.manifest.digest, "path": str(image.path)},
        "bwrap_version": bwrap_mod.version(labs.kernel.host.bwrap),
        "cgroups": labs.kernel.host.cgroups.report(),
        "roots": {r.key: plan_summary(r.plan()) for r in roots},
    }
    try:
        figures = await spawn_figures(counts)
        cold, steps = await cold_figures(roots, counts, image)
        figures += cold
        notes += steps
        figures += await exec_figures([r for r in roots if r.layer and not r.network], counts)
        figures += await idle_figures([r for r in roots if r.layer], counts, notes)
    finally:
        for lab in labs.all():
            await lab.stop_all()
    figures += recorded_builds(store, notes)
    if build:
        figures += fresh_builds(build, store, root / "fresh-images")
    return figures, notes, details


def default_images() -> Path:
    """The server's images: AGENTBOX_IMAGES, else `images/` in the default home."""
    return Path(os.environ.get("AGENTBOX_IMAGES") or default_home() / "images")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=Path, default=None, help="where the base image is built")
    parser.add_argument("--cold", type=int, help="cold starts per root (30)")
    parser.add_argument("--exec", type=int, help="timed execs per live sandbox (300)")
    parser.add_argument("--idle", type=int, help="idle sandboxes alive at once per root (8)")
    parser.add_argument(
        "--build", action="append", default=[], choices=sorted(PROFILES),
        help="also time a fresh build of this profile into a scratch images dir (repeatable)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    chosen = {"cold": args.cold, "exec": args.exec, "idle": args.idle}
    counts = replace(counts, **{k: v for k, v in chosen.items() if v is not None})
    root = os.geteuid() == 0
    uid, gid = (DEFAULT_SANDBOX_UID, DEFAULT_SANDBOX_UID) if root else (os.geteuid(), os.getegid())
    store = ImageStore(args.images or default_images(), uid, gid)
    if store.find(IMAGE) is None:
        print(
            f"no {IMAGE!r} image in {store.root}: build it with `agentbox image build {IMAGE}`",
            file=sys.stderr,
        )
        return 2
    load_before = os.getloadavg()
    started = time.perf_counter()
    with scratch_dir("images") as tmp:
        figures, notes, details = asyncio.run(run(counts, tmp, store, args.build))
    print(table(figures))
    for note in notes:
        print(note)
    print(f"load average before: {load_before[0]:.2f} (1 min), {load_before[1]:.2f} (5 min)")
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(
            args.json, "bench_images", args.quick, figures, notes=notes, loadavg_before=load_before, **details
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
