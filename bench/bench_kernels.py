"""Code contexts in a sandbox: a kernel's start, a cell's round trip and a kernel's memory, per language.

    python bench/bench_kernels.py [--quick] [--json out.json] [--images DIR] [--starts 5] [--cells 50]

Each language's contexts run on the `data` image already built in DIR (the server's images
by default; the script never builds it), in a sandbox with the default limits (2 GiB of
memory, 512 pids, one CPU) and network off, through `CodeInterpreter` as the E2B and AIO
routes use it. A start is `create(language)` (the runner, then the kernel, ready) and its
first cell `1` done, in a fresh sandbox each time; its raw reference is `bash -c true` in
the same sandbox. A cell is `1 + 1` in a warm context. Memory is what the sandbox's memory
cgroup charges (less page cache) once the kernel is ready, less what it charged before.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from bench_sandbox import MIB
from figures import Figure, arg_parser, footer, latency_figure, scratch_dir, table, write_json

from agentbox.config import default_home
from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import DEFAULT_SANDBOX_UID, SandboxConfig, SandboxHost, SandboxMachine
from agentbox.workspace.kernels import KERNELS, CodeInterpreter

IMAGE = "data"
LANGUAGES = ("python", "javascript")


async def sandbox(host: SandboxHost, root: Path) -> SandboxMachine:
    sandbox_id = new_id(SANDBOX)
    machine = SandboxMachine(
        "bench", sandbox_id, host, SandboxConfig(network=False, image=IMAGE, image_required=True),
        root / sandbox_id / "workspace", root / sandbox_id / "run",
    )  # fmt: skip
    await machine.start()
    return machine


def charged(machine: SandboxMachine) -> int:
    group = machine._group
    use = group.memory() if group is not None else None
    return use.used if use is not None else 0


async def start_once(host: SandboxHost, root: Path, language: str) -> tuple[float, float, int, int]:
    """Seconds of one start with its first cell, of `bash -c true` there, and the kernel's bytes
    (charged now, and the group's peak)."""
    machine = await sandbox(host, root)
    interpreter = CodeInterpreter(machine)
    try:
        began = time.perf_counter()
        await machine.exec(ExecRequest(argv=("bash", "-c", "true"), timeout=30))
        bare = time.perf_counter() - began
        before = charged(machine)
        began = time.perf_counter()
        context = await interpreter.create(language)
        outputs = [o async for o in interpreter.run(context, "1")]
        took = time.perf_counter() - began
        if not any(o.kind == "result" for o in outputs):
            raise RuntimeError(f"{language}: the first cell gave {outputs}")
        group = machine._group
        peak = (group.memory_peak() if group is not None else None) or 0
        return took, bare, charged(machine) - before, peak
    finally:
        await interpreter.close()
        await machine.stop()


async def cell_samples(host: SandboxHost, root: Path, language: str, count: int) -> list[float]:
    machine = await sandbox(host, root)
    interpreter = CodeInterpreter(machine)
    try:
        context = await interpreter.create(language)
        samples = []
        for _ in range(count + 2):
            began = time.perf_counter()
            _ = [o async for o in interpreter.run(context, "1 + 1")]
            samples.append(time.perf_counter() - began)
        return samples[2:]
    finally:
        await interpreter.close()
        await machine.stop()


async def run(images: Path, root: Path, starts: int, cells: int) -> list[Figure]:
    home = root / "home"
    home.mkdir()
    host = SandboxHost(home, uid=DEFAULT_SANDBOX_UID, images=images)
    figures: list[Figure] = []
    for language in LANGUAGES:
        runs = [await start_once(host, root, language) for _ in range(starts)]
        kernel = KERNELS[language]
        figures.append(latency_figure(
            f"start_{language}", f"{language} ({kernel}): context start + first cell", [r[0] for r in runs],
            raw_label="bash -c true", raw_seconds=statistics.median(r[1] for r in runs),
        ))  # fmt: skip
        memory = [r[2] / MIB for r in runs]
        peaks = [r[3] / MIB for r in runs]
        figures.append(Figure(
            f"memory_{language}", f"{language}: kernel + runner, charged once ready", "MiB",
            median=statistics.median(memory), samples=len(memory),
            extra={"sandbox_peak_mib": statistics.median(peaks)},
        ))  # fmt: skip
        figures.append(latency_figure(
            f"cell_{language}", f"{language}: `1 + 1` in a warm context", await cell_samples(host, root, language, cells),
        ))  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=Path, default=default_home() / "images")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--cells", type=int, default=50)
    args = parser.parse_args(argv)
    starts, cells = (1, 3) if args.quick else (args.starts, args.cells)
    began = time.monotonic()
    with scratch_dir("kernels") as root:
        figures = asyncio.run(run(args.images, root, starts, cells))
    print(table(figures))
    print(footer(time.monotonic() - began))
    if args.json:
        write_json(args.json, "bench_kernels", args.quick, figures, images=str(args.images))
    return 0


if __name__ == "__main__":
    sys.exit(main())
