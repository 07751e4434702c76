"""The stock `e2b` SDK against agentbox: a real `python -m agentbox serve` on a loopback port.

    python bench/bench_e2b.py [--quick] [--json out.json]

The SDK is pointed at the server as a user would (`E2B_API_URL`, `E2B_SANDBOX_URL`) and
times `Sandbox.create()` up to its first `commands.run("true")` done, then the round trip
of `commands.run("true")` in a live sandbox (as `user`, the SDK's default, and as `root`: the
account's namespace costs one `nsenter` exec), beside agentbox's own `POST /v2/commands` on
the same server and a bare spawn. The targets are E2B's cloud for scale (its published
median create to first command, and about 50 ms per command from a client), not a limit.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_api import bare_spawn, run_command, serving
from e2b import Sandbox
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

#: E2B's cloud, for scale: median create -> first command (computesdk.com, 100 runs), per command.
E2B_CREATE_TO_FIRST_MS = 440.0
E2B_COMMAND_MS = 50.0
#: The key the SDK sends; the bench server has none, so any non-empty key is taken.
BENCH_KEY = "bench"


@dataclass(frozen=True)
class Counts:
    spawn: int = 200
    creates: int = 30
    runs: int = 300
    warmup: int = 10


QUICK = Counts(spawn=10, creates=2, runs=10, warmup=2)


def create_to_first_run() -> float:
    """Seconds from `Sandbox.create()` to its first `commands.run("true")` done (the kill is untimed)."""
    start = time.perf_counter()
    sandbox = Sandbox.create()
    sandbox.commands.run("true")
    elapsed = time.perf_counter() - start
    sandbox.kill()
    return elapsed


def e2b_figures(url: str, counts: Counts, spawn: float) -> list[Figure]:
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": BENCH_KEY})
    create_to_first_run()  # the server's first sandbox also sets up what later ones share
    creates = [create_to_first_run() for _ in range(counts.creates)]
    sandbox = Sandbox.create()
    try:
        runs = time_calls(lambda: sandbox.commands.run("true"), counts.runs, counts.warmup)
        as_root = time_calls(lambda: sandbox.commands.run("true", user="root"), counts.runs, counts.warmup)
    finally:
        sandbox.kill()
    with httpx.Client(base_url=url, timeout=60) as client:
        own = time_calls(lambda: run_command(client, "true"), counts.runs, counts.warmup)
    own_median = statistics.median(own)
    return [
        latency_figure(
            "e2b_create_to_first_run",
            'Sandbox.create() -> first commands.run("true")',
            creates,
            target=Target(E2B_CREATE_TO_FIRST_MS),
        ),
        latency_figure(
            "e2b_run_true",
            'sbx.commands.run("true") (bash -l -c)',
            runs,
            raw_label="POST /v2/commands true",
            raw_seconds=own_median,
            target=Target(E2B_COMMAND_MS),
            extra={"ratio_to_bare_spawn": statistics.median(runs) / spawn},
        ),
        latency_figure(
            "e2b_run_true_as_root",
            'sbx.commands.run("true", user="root")',
            as_root,
            raw_label='commands.run("true") as user',
            raw_seconds=statistics.median(runs),
        ),
        latency_figure(
            "api_exec_true",
            "POST /v2/commands true (same server)",
            own,
            raw_label="bare spawn",
            raw_seconds=spawn,
        ),
    ]


def run(counts: Counts, root: Path) -> tuple[list[Figure], dict[str, Any]]:
    spawn_samples = time_calls(bare_spawn, counts.spawn, counts.warmup)
    spawn = statistics.median(spawn_samples)
    figures = [latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", spawn_samples)]
    with serving(root) as server:
        figures += e2b_figures(server.url, counts, spawn)
    return figures, {"counts": counts.__dict__}


def main(argv: list[str] | None = None) -> int:
    args = arg_parser(__doc__).parse_args(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("e2b") as tmp:
        figures, details = run(counts, tmp)
    print(table(figures))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_e2b", args.quick, figures, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
