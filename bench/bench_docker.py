"""Docker machine figures: exec through the agent against docker exec, cold start, resume.

    python bench/bench_docker.py [--quick] [--json out.json] [--images DIR] [--docker-host URL]
                                 [--exec 300] [--cold 10]

The machines run on the `base` image already built in DIR (the server's images by default),
imported once into the engine. Without `--docker-host` the script starts a private dockerd
the way the tests do (tests/conftest.py: its own socket, no bridge, no iptables, the images
cached in /var/tmp/agentbox-test-dockerd), and stops it at the end. Every container it makes
is removed. README.md in this folder says what each figure is.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from bench_sandbox import asyncio_spawn_samples, bare_spawn, seconds
from figures import (
    Figure,
    Target,
    arg_parser,
    footer,
    latency_figure,
    scratch_dir,
    table,
    time_calls,
    write_json,
)

from agentbox.config import default_home
from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.docker import IMAGE_REPO, DockerHost, DockerMachine, DockerOptions, image_tag
from agentbox.machines.images import Image, ImageStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import DOCKERD_CACHE, Dockerd, start_dockerd, stop_dockerd

IMAGE = "base"
EXEC_RATIO_TARGET = 2.0
"""exec of `true` on a live docker machine, as a multiple of a bare `sh -c true` spawn."""


@dataclass(frozen=True)
class Counts:
    """How many times each figure is sampled (full run, or `--quick` for the smoke test)."""

    exec: int = 300
    exec_warmup: int = 30
    docker_exec: int = 30
    """`docker exec` rounds: one per this many agent execs is too few, so they get their own."""
    cold: int = 10


QUICK = Counts(exec=10, exec_warmup=2, docker_exec=3, cold=2)


class Lab:
    """Docker machines on one engine, each with its own workspace under `root`; all removed at the end."""

    def __init__(self, root: Path, images: Path, docker_host: str) -> None:
        self.root = root
        self.host = DockerHost(root / "home", images=images)
        self.options = DockerOptions(docker_host=docker_host)
        self.made: list[DockerMachine] = []

    def machine(self, cls: type[DockerMachine] = DockerMachine) -> DockerMachine:
        machine_id = new_id(SANDBOX)
        d = self.root / machine_id
        m = cls("docker", machine_id, self.host, self.options, d / "workspace", d / "run")
        self.made.append(m)
        return m

    async def remove_all(self) -> None:
        for m in self.made:
            await m.destroy()
        self.made.clear()


class Timed(DockerMachine):
    """A machine that notes when each step of its start returns (`marks`, perf_counter)."""

    marks: dict[str, float]

    async def _create(self, image: Image) -> None:
        self.marks = {}
        await super()._create(image)
        self.marks["create (ping, image check, create)"] = time.perf_counter()

    async def _connect(self, container_id: str) -> None:
        if not hasattr(self, "marks"):
            self.marks = {}
        self.marks["engine start"] = time.perf_counter()
        await super()._connect(container_id)
        self.marks["agent connected, ready"] = time.perf_counter()


def docker_cli(daemon_host: str, *args: str) -> None:
    subprocess.run(["docker", "-H", daemon_host, *args], check=True, capture_output=True)


async def api_exec(client: httpx.AsyncClient, container: str) -> None:
    """`docker exec` without the CLI: create an exec, start it attached, read its exit code."""
    made = await client.post(
        f"/containers/{container}/exec", json={"Cmd": ["true"], "AttachStdout": True, "AttachStderr": True}
    )
    exec_id = made.json()["Id"]
    await client.post(f"/exec/{exec_id}/start", json={"Detach": False, "Tty": False})
    code = (await client.get(f"/exec/{exec_id}/json")).json()["ExitCode"]
    if code != 0:
        raise RuntimeError(f"docker exec true exited {code}")


def engine_client(docker_host: str) -> httpx.AsyncClient:
    uds = docker_host.removeprefix("unix://") if docker_host.startswith("unix://") else None
    base = "http://docker" if uds else "http://" + docker_host.removeprefix("tcp://")
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds), base_url=base, timeout=60)


async def exec_figures(lab: Lab, counts: Counts, docker_host: str) -> list[Figure]:
    """`exec true` through the agent, with a bare spawn in every round; `docker exec` beside it."""
    m = lab.machine()
    await m.start()
    execs: list[float] = []
    spawns: list[float] = []
    aspawns: list[float] = []
    for i in range(counts.exec_warmup + counts.exec):
        start = time.perf_counter()
        result = await m.exec(ExecRequest(argv=("true",)))
        elapsed = time.perf_counter() - start
        if result.exit_code != 0:
            raise RuntimeError(f"`true` exited {result.exit_code} in the container: {result.stderr!r}")
        spawn = time_calls(bare_spawn, 1, 0)
        aspawn = await asyncio_spawn_samples(1, 0)
        if i >= counts.exec_warmup:
            execs.append(elapsed)
            spawns += spawn
            aspawns += aspawn
    container = m.container_id or ""
    cli = time_calls(lambda: docker_cli(docker_host, "exec", container, "true"), counts.docker_exec, 1)
    api: list[float] = []
    async with engine_client(docker_host) as client:
        await api_exec(client, container)
        for _ in range(counts.docker_exec):
            start = time.perf_counter()
            await api_exec(client, container)
            api.append(time.perf_counter() - start)
    spawn_median = statistics.median(spawns)
    agent = latency_figure(
        "exec_true_docker",
        "exec true, live docker machine (exec agent)",
        execs,
        raw_label="subprocess.run, same rounds",
        raw_seconds=spawn_median,
        target=Target(EXEC_RATIO_TARGET, "ratio"),
        extra={"ratio_to_asyncio_spawn": statistics.median(execs) / statistics.median(aspawns)},
    )
    return [
        latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", spawns),
        latency_figure("asyncio_spawn", "bare spawn sh -c true (asyncio)", aspawns),
        agent,
        latency_figure(
            "docker_exec_cli", "docker exec CONTAINER true (the CLI)", cli,
            raw_label="exec agent", raw_seconds=seconds(agent),
        ),
        latency_figure(
            "docker_exec_api", "docker exec through the Engine API (create, start, inspect)", api,
            raw_label="exec agent", raw_seconds=seconds(agent),
        ),
    ]  # fmt: skip


async def cold_figures(lab: Lab, counts: Counts, docker_host: str, reference: str) -> list[Figure]:
    """A new machine to its first `true`; a stopped one back to its first `true`; `docker run`."""
    colds: list[float] = []
    resumes: list[float] = []
    runs: list[float] = []
    steps: dict[str, list[float]] = defaultdict(list)
    resumed = lab.machine()
    await resumed.start()
    for _ in range(counts.cold):
        m = lab.machine(Timed)
        start = time.perf_counter()
        await m.start()
        await m.exec(ExecRequest(argv=("true",)))
        done = time.perf_counter()
        colds.append(done - start)
        previous = start
        assert isinstance(m, Timed)
        for step, at in [*m.marks.items(), ("first exec true", done)]:
            steps[step].append(at - previous)
            previous = at
        await m.destroy()
        await resumed.stop()
        start = time.perf_counter()
        await resumed.start()
        await resumed.exec(ExecRequest(argv=("true",)))
        resumes.append(time.perf_counter() - start)
        run = ["run", "--rm", "--network", "none", "--read-only", reference, "true"]
        runs += time_calls(lambda argv=run: docker_cli(docker_host, *argv), 1, 0)  # type: ignore[misc]
    docker_run = latency_figure("docker_run_true", "docker run --rm IMAGE true (the CLI)", runs)
    breakdown = {step: statistics.median(v) * 1000 for step, v in steps.items()}
    return [
        docker_run,
        latency_figure(
            "cold_docker", "cold: new container -> first true done", colds,
            raw_label="docker run true", raw_seconds=seconds(docker_run), extra={"steps_ms": breakdown},
        ),
        latency_figure(
            "resume_docker", "resume: stopped container -> first true done", resumes,
            raw_label="docker run true", raw_seconds=seconds(docker_run),
        ),
    ]  # fmt: skip


async def run(
    counts: Counts, tmp: Path, image: Image, docker_host: str
) -> tuple[list[Figure], list[str], dict[str, Any]]:
    lab = Lab(tmp, image.path.parent, docker_host)
    notes: list[str] = []
    try:
        first = lab.machine()
        started = time.perf_counter()
        await first.start()  # imports the image if the engine lacks it; not a figure
        notes.append(
            f"first machine (image import included if needed): {time.perf_counter() - started:.2f} s"
        )
        reference = f"{IMAGE_REPO}/{image.name}:{image_tag(image)}"  # what the machine started from
        await lab.remove_all()
        figures = await exec_figures(lab, counts, docker_host)
        await lab.remove_all()
        figures += await cold_figures(lab, counts, docker_host, reference)
        steps = figures[-2].extra["steps_ms"]
        notes.append("cold, median ms per step: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    finally:
        await lab.remove_all()
    version = await lab.host.engine(docker_host).ping()
    details = {"counts": counts.__dict__, "engine_api": version, "image": image.manifest.digest}
    return figures, notes, details


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=Path, help="the images directory (default: the server's)")
    parser.add_argument("--docker-host", help="an engine to use instead of a private dockerd")
    parser.add_argument("--exec", type=int, help="agent exec samples")
    parser.add_argument("--cold", type=int, help="cold start and resume samples")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    chosen = {"exec": args.exec, "cold": args.cold}
    counts = replace(counts, **{k: v for k, v in chosen.items() if v is not None})
    store = ImageStore(args.images or Path(os.environ.get("AGENTBOX_IMAGES") or default_home() / "images"))
    image = store.find(IMAGE)
    if image is None:
        print(
            f"no {IMAGE!r} image in {store.root}: build it with `agentbox image build {IMAGE}`",
            file=sys.stderr,
        )
        return 2
    load_before = os.getloadavg()
    started = time.perf_counter()
    daemon: Dockerd | None = None
    with scratch_dir("docker") as tmp:
        try:
            if args.docker_host is None:
                (tmp / "dockerd").mkdir()
                daemon = start_dockerd(tmp / "dockerd", DOCKERD_CACHE / "data")
            docker_host = args.docker_host or (daemon.host if daemon else "")
            figures, notes, details = asyncio.run(run(counts, tmp / "lab", image, docker_host))
        finally:
            if daemon is not None:
                stop_dockerd(daemon)
    print(table(figures))
    for note in notes:
        print(note)
    print(f"load average before: {load_before[0]:.2f} (1 min), {load_before[1]:.2f} (5 min)")
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(
            args.json, "bench_docker", args.quick, figures, notes=notes, loadavg_before=load_before, **details
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
