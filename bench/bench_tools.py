"""Tool-layer figures: `read_file`, `grep` and `bash` through `SessionTools.call`, in one process.

    python bench/bench_tools.py [--quick] [--json out.json]

The tools are the `default` toolset in the full-auto tier, over a live `SandboxMachine`
(network off) with the stores a session has (a real SQLite file under a temporary AGENTBOX
home, removed at the end). Each figure is printed beside the raw operation it wraps, and the
layer in between (workspace, machine) is measured too, so the tool layer's own share shows.
README.md in this folder explains each figure. Nothing here has a target yet: the issue asks
for these latencies to be reported, not held to a number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import posixpath
import random
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from figures import Figure, arg_parser, footer, latency_figure, scratch_dir, table, write_json

from agentbox.machines.base import ExecRequest
from agentbox.machines.binaries import ripgrep_binary
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.store.approvals import ApprovalsRepo
from agentbox.store.changes import ChangesRepo
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.store.todos import TodoRepo
from agentbox.tools.approvals import Approvals
from agentbox.tools.base import ToolResult
from agentbox.tools.changes import ChangeSets
from agentbox.tools.find import MAX_GREP_COUNTED
from agentbox.tools.read import MAX_TEXT_BYTES
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import Tier
from agentbox.tools.toolsets import toolset
from agentbox.workspace import files
from agentbox.workspace import grep as workspace_grep
from agentbox.workspace.commands import CommandManager

#: Size of the text file `read_file` reads (it fits one read window, so one call reads it all).
READ_FILE_BYTES = 4096
READ_FILE = "/workspace/bench-4k.txt"
#: The grep tree, inside the sandbox: TREE_FILES small text files in TREE_DIRS folders.
TREE_DIR = "/workspace/bench-tree"
TREE_FILES = 1000
TREE_DIRS = 10
#: Lines of filler text per tree file (about 1 KiB).
TREE_FILE_LINES = 16
#: Files of the tree that hold the needle (one line each), so every grep finds this many matches.
NEEDLE_FILES = 5
NEEDLE = "agentbox-bench-needle-7f3a"
SESSION_ID = "ses_benchtools"


@dataclass(frozen=True)
class Counts:
    """How many times each figure is sampled (full run, or `--quick` for the smoke test)."""

    samples: int = 200
    warmup: int = 20


QUICK = Counts(samples=10, warmup=2)


# --- fixtures in the workspace -------------------------------------------------------------------


def filler_line(i: int) -> str:
    return f"line {i:04d}: the quick brown fox jumps over the lazy dog {i * 7919 % 10007:05d}\n"


def make_read_file(host: Path) -> None:
    """READ_FILE_BYTES of plain text lines."""
    text, i = "", 0
    while len(text) < READ_FILE_BYTES:
        text += filler_line(i)
        i += 1
    host.write_text(text[:READ_FILE_BYTES])


def make_tree(root: Path) -> None:
    """TREE_FILES files of filler in TREE_DIRS folders; NEEDLE_FILES of them spread over the tree
    hold one needle line."""
    holders = {i * TREE_FILES // NEEDLE_FILES for i in range(NEEDLE_FILES)}
    body = "".join(filler_line(i) for i in range(TREE_FILE_LINES))
    per_dir = TREE_FILES // TREE_DIRS
    for d in range(TREE_DIRS):
        (root / f"d{d:02d}").mkdir(parents=True)
    for i in range(TREE_FILES):
        text = body + (f"here is the {NEEDLE} in file {i}\n" if i in holders else "")
        (root / f"d{i // per_dir:02d}" / f"f{i:04d}.txt").write_text(text)


def give_tree(host: Path, owner: tuple[int, int] | None) -> None:
    """Hand what the bench made in the workspace to the sandbox's user, as the server does."""
    if owner is None or os.geteuid() != 0:
        return
    for folder, dirs, names in os.walk(host):
        for name in [*dirs, *names]:
            os.chown(os.path.join(folder, name), *owner)


# --- timing --------------------------------------------------------------------------------------


@dataclass
class Timed:
    """One operation timed in rounds: how to call it, how to check what it returned, its samples."""

    call: Callable[[], Any]
    check: Callable[[Any], None]
    awaited: bool = False
    """`call` returns an awaitable; the await is part of the timed call."""
    samples: list[float] = field(default_factory=list)


#: The seed of the rounds' order: runs shuffle alike, and differ only by what they measure.
ROUNDS_SEED = 20261204


async def rounds(ops: Sequence[Timed], count: int, warmup: int) -> None:
    """Call each op once per round, for `warmup` untimed and `count` timed rounds.

    Interleaved rather than one op after the other, so a burst of load on the shared host
    weighs on a tool and its references alike and the ratios stay fair. Each round runs the
    ops in a fresh order (seeded, `ROUNDS_SEED`): an op's time depends on what ran just
    before it (an op after a bare spawn starts on caches the fork left cold), and a fixed
    order gave each op the same neighbour every round, by 0.1 to 0.3 ms. Every result is
    checked, outside the timed part.
    """
    order = random.Random(ROUNDS_SEED)
    for i in range(warmup + count):
        for op in order.sample(list(ops), len(ops)):
            start = time.perf_counter()
            result = op.call()
            if op.awaited:
                result = await result
            elapsed = time.perf_counter() - start
            op.check(result)
            if i >= warmup:
                op.samples.append(elapsed)


def ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def layered(figure: Figure, **layers: list[float]) -> Figure:
    """Add the figure's ratio to each layer in between (`extra.ratio_to_<name>`) and their medians."""
    assert figure.median is not None
    for name, samples in layers.items():
        figure.extra[f"ratio_to_{name}"] = figure.median / ms(samples)
        figure.extra[f"{name}_median_ms"] = ms(samples)
    return figure


def tool_check(expect: str) -> Callable[[ToolResult], None]:
    def check(result: ToolResult) -> None:
        if result.is_error or expect not in result.as_text():
            raise RuntimeError(f"unexpected tool result: {result.as_text()[:500]!r}")

    return check


# --- the three tools -----------------------------------------------------------------------------


async def read_figures(tools: SessionTools, host: Path, counts: Counts) -> list[Figure]:
    machine = sandbox_of(tools)
    expected = host.read_text()
    first_line = expected.splitlines()[0]

    def same_text(text: str) -> None:
        if text != expected:
            raise RuntimeError("the read returned other text than the file holds")

    def host_read() -> str:
        with open(host) as f:
            return f.read()

    raw = Timed(host_read, same_text)
    layer = Timed(lambda: files.read_text(machine, READ_FILE).content, same_text)
    tool = Timed(lambda: tools.call("read_file", {"path": READ_FILE}), tool_check(first_line), awaited=True)
    await rounds((raw, layer, tool), counts.samples, counts.warmup)
    raw_seconds = statistics.median(raw.samples)
    return [
        latency_figure("host_read_4k", "open().read() 4 KiB host file", raw.samples),
        latency_figure(
            "files_read_text_4k",
            "files.read_text 4 KiB (workspace layer)",
            layer.samples,
            raw_label="open().read()",
            raw_seconds=raw_seconds,
        ),
        layered(
            latency_figure(
                "tool_read_file_4k",
                "tool read_file 4 KiB",
                tool.samples,
                raw_label="open().read()",
                raw_seconds=raw_seconds,
            ),
            files_read_text=layer.samples,
        ),
    ]


def rg_argv(host: Path) -> list[str]:
    """The rg command line the grep tool runs for NEEDLE in `host` (same options, same flags)."""
    options = workspace_grep.GrepOptions(
        pattern=NEEDLE, max_results=MAX_GREP_COUNTED, max_file_size=str(MAX_TEXT_BYTES)
    )
    return [ripgrep_binary(), *options.rg_args(str(host))]


async def grep_figures(tools: SessionTools, host: Path, counts: Counts) -> list[Figure]:
    machine = sandbox_of(tools)
    argv = rg_argv(host)

    def rg() -> bytes:
        env = workspace_grep.RG_ENV
        return subprocess.run(argv, cwd=host, env=env, capture_output=True, check=True).stdout

    def all_found(out: bytes) -> None:
        if out.count(b'{"type":"match"') != NEEDLE_FILES:
            raise RuntimeError(f"rg did not find the needle in {NEEDLE_FILES} files")

    def layer_found(result: workspace_grep.GrepResult) -> None:
        if result.match_count != NEEDLE_FILES:
            raise RuntimeError(f"workspace grep found {result.match_count} matches, not {NEEDLE_FILES}")

    def tool_found(result: ToolResult) -> None:
        tool_check(NEEDLE)(result)
        if result.data.get("total") != NEEDLE_FILES:
            raise RuntimeError(f"the grep tool found {result.data.get('total')} matches, not {NEEDLE_FILES}")

    raw = Timed(rg, all_found)
    layer = Timed(
        lambda: workspace_grep.grep(
            machine, TREE_DIR, NEEDLE, max_results=MAX_GREP_COUNTED, max_file_size=MAX_TEXT_BYTES
        ),
        layer_found,
        awaited=True,
    )
    tool = Timed(lambda: tools.call("grep", {"pattern": NEEDLE, "path": TREE_DIR}), tool_found, awaited=True)
    await rounds((raw, layer, tool), counts.samples, counts.warmup)
    raw_seconds = statistics.median(raw.samples)
    label = f"rg, {TREE_FILES} files"
    return [
        latency_figure(
            "rg_tree", f"rg --json --sort path, {TREE_FILES}-file tree", raw.samples, extra={"argv": argv}
        ),
        latency_figure(
            "grep_tree",
            f"workspace grep, {TREE_FILES}-file tree",
            layer.samples,
            raw_label=label,
            raw_seconds=raw_seconds,
        ),
        layered(
            latency_figure(
                "tool_grep_tree",
                f"tool grep, {TREE_FILES}-file tree",
                tool.samples,
                raw_label=label,
                raw_seconds=raw_seconds,
            ),
            workspace_grep=layer.samples,
        ),
    ]


def bare_spawn() -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["sh", "-c", "true"])


def exited_0(result: Any) -> None:
    code = getattr(result, "exit_code", getattr(result, "returncode", None))
    if code != 0:
        raise RuntimeError(f"`true` exited {code}")


async def bash_figures(tools: SessionTools, counts: Counts) -> list[Figure]:
    machine = sandbox_of(tools)
    manager = CommandManager(machine)
    raw = Timed(bare_spawn, exited_0)
    layer = Timed(lambda: machine.exec(ExecRequest("true")), exited_0, awaited=True)
    bash = await machine.find_program("bash") or "/bin/bash"
    same_argv = Timed(lambda: machine.exec(ExecRequest(argv=(bash, "-c", "true"))), exited_0, awaited=True)
    commands = Timed(lambda: manager.run("true"), exited_0, awaited=True)
    tool = Timed(lambda: tools.call("bash", {"command": "true"}), tool_check("(no output)"), awaited=True)
    try:
        await rounds((raw, layer, same_argv, commands, tool), counts.samples, counts.warmup)
    finally:
        await manager.close()
    raw_seconds = statistics.median(raw.samples)
    spawn = "sh -c true (subprocess.run)"
    return [
        latency_figure("bare_spawn", f"bare spawn {spawn}", raw.samples),
        latency_figure(
            "machine_exec_true",
            "machine.exec(ExecRequest('true')) (machine layer)",
            layer.samples,
            raw_label="bare spawn",
            raw_seconds=raw_seconds,
        ),
        latency_figure(
            "machine_exec_bash_true",
            "machine.exec(argv=(bash, '-c', 'true')) (what the tool runs)",
            same_argv.samples,
            raw_label="machine.exec('true')",
            raw_seconds=statistics.median(layer.samples),
        ),
        latency_figure(
            "commands_run_true",
            "CommandManager.run('true') (workspace layer)",
            commands.samples,
            raw_label="bare spawn",
            raw_seconds=raw_seconds,
        ),
        layered(
            latency_figure(
                "tool_bash_true",
                "tool bash true",
                tool.samples,
                raw_label="bare spawn",
                raw_seconds=raw_seconds,
            ),
            machine_exec=layer.samples,
            machine_exec_bash=same_argv.samples,
            commands_run=commands.samples,
        ),
    ]


# --- the run -------------------------------------------------------------------------------------


def layer_notes(figures: list[Figure]) -> list[str]:
    """One line per tool: its median as a multiple of each layer below it."""
    notes = []
    for f in figures:
        ratios = {k.removeprefix("ratio_to_"): v for k, v in f.extra.items() if k.startswith("ratio_to_")}
        if ratios:
            parts = ", ".join(f"{v:.2f}x {k}" for k, v in ratios.items())
            notes.append(f"{f.key}: {parts}")
    return notes


def sandbox_of(tools: SessionTools) -> SandboxMachine:
    """The live sandbox `tool_lab` put under the tools."""
    assert isinstance(tools.machine, SandboxMachine)
    return tools.machine


@asynccontextmanager
async def tool_lab(root: Path, images: Path | None = None) -> AsyncIterator[SessionTools]:
    """The default toolset (full-auto) over a live sandbox (network off) and a session's stores;
    with `images`, the sandbox runs on the `base` image there when it is built."""
    host = SandboxHost(root, images=images)
    sid = f"sbx_benchtools{secrets.token_hex(3)}"
    machine = SandboxMachine(
        "sandbox",
        sid,
        host,
        SandboxConfig(network=False),
        root / "sessions" / sid / "workspace",
        root / "sessions" / sid / "run",
    )
    try:
        await machine.start()
        async with Database.in_home(root) as db:
            yield SessionTools(
                machine=machine,
                session_id=SESSION_ID,
                tier=Tier.FULL_AUTO,
                toolset=toolset("default"),
                changes=ChangeSets(ChangesRepo(db)),
                approvals=Approvals(ApprovalsRepo(db)),
                todos=TodoRepo(db),
                files=FileStore(db, root),
            )
    finally:
        await machine.stop()


async def run(counts: Counts, root: Path) -> tuple[list[Figure], dict[str, object]]:
    details: dict[str, object] = {
        "counts": counts.__dict__,
        "tier": str(Tier.FULL_AUTO),
        "toolset": "default",
        "tree_files": TREE_FILES,
        "needle_files": NEEDLE_FILES,
        "read_file_bytes": READ_FILE_BYTES,
    }
    async with tool_lab(root) as tools:
        machine = sandbox_of(tools)
        workspace = machine.workspace  # the host folder behind /workspace: the bench's own setup
        make_read_file(workspace / posixpath.relpath(READ_FILE, "/workspace"))
        make_tree(workspace / posixpath.relpath(TREE_DIR, "/workspace"))
        give_tree(workspace, machine.default_owner())
        figures = await read_figures(tools, workspace / posixpath.relpath(READ_FILE, "/workspace"), counts)
        figures += await grep_figures(tools, workspace / posixpath.relpath(TREE_DIR, "/workspace"), counts)
        figures += await bash_figures(tools, counts)
    return figures, details


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("tools") as tmp:
        figures, details = asyncio.run(run(counts, tmp / "home"))
    notes = layer_notes(figures)
    print(table(figures))
    for note in notes:
        print(note)
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_tools", args.quick, figures, notes=notes, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
