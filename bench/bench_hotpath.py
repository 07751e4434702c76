"""The hot path, side by side with a peer: agentbox and SWE-ReX's server in one run.

    python bench/bench_hotpath.py [--quick] [--json out.json] [--peer-venv DIR] [--only SECTION ...]

agentbox runs as `python -m agentbox serve` (isolated sandbox, system layer, as served by
default; see bench_api.py). The peer is SWE-ReX's `swerex-remote` (no isolation) on
loopback, installed on first use into its own virtualenv (`--peer-venv`, kept and reused).
Exec `true` and 1 KiB read / write are timed in interleaved rounds on both servers, beside
the raw operations (a bare `sh -c true` spawn, a local 1 KiB read / write), so a burst of
load on the shared host weighs on both alike. Then: 16 concurrent clients against 16
threads of bare spawns, grep over a 50,000-file tree against parallel rg with the same
flags, the tool layer's `bash true` against the machine's own exec, and the stages of one
exec in one process (machine, command manager, the ASGI app without a socket). README.md
in this folder explains each figure and gives the breakdown. `--only` runs some sections
(`SECTIONS`): `--only tool` times the tool layer alone, without a server or the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_api import (
    GREP_DIR,
    NEEDLE,
    ApiError,
    Server,
    bare_spawn,
    call,
    free_port,
    hammer,
    make_tree,
    run_command,
    serving,
)
from bench_tools import Counts as ToolCounts
from bench_tools import Timed, bash_figures, exited_0, rounds, tool_lab
from figures import Figure, Target, arg_parser, footer, latency_figure, scratch_dir, table, write_json

from agentbox.api.app import create_app
from agentbox.config import load
from agentbox.machines.base import ExecRequest
from agentbox.machines.binaries import ripgrep_binary
from agentbox.workspace.grep import GrepOptions

#: Targets, as multiples of the peer or raw reference beside them.
EXEC_RATIO_TARGET = 0.6
"""exec `true` through the API, against SWE-ReX's `/execute`."""
FS_RATIO_TARGET = 0.45
"""1 KiB read and write through the API, against SWE-ReX's `/read_file`, `/write_file`."""
LOAD_RATIO_TARGET = 0.6
"""Throughput of 16 clients, at least this share of 16 threads of bare spawns."""
GREP_RATIO_TARGET = 1.15
"""/v2/fs/grep over the 50k-file tree, against parallel rg with the same flags."""
TOOL_RATIO_TARGET = 1.2
"""The tool layer's `bash true`, against the machine's own exec."""

#: The peer: its package, pinned, and where its virtualenv lives between runs.
PEER_PACKAGE = "swe-rex==1.4.0"
PEER_VENV = Path("/var/tmp/agentbox-bench/swerex-venv")
#: Seconds the peer may take to answer `/is_alive`; seconds its install may take.
PEER_START_TIMEOUT = 30.0
PEER_INSTALL_TIMEOUT = 600.0
#: The session of `/v1/shell/exec` (one session, or each call would open a new one).
SHELL_SESSION = "bench"
KIB = 1024
#: The sections of a run, in the order they run; `--only` picks some of them.
SECTIONS = ("stages", "side", "load", "grep", "tool")
#: The sections that need agentbox served and the peer beside it.
SERVED_SECTIONS = frozenset({"side", "load", "grep"})
CONTENT = ("0123456789abcde\n" * (KIB // 16))[:KIB]
#: The served sandbox's machine entry: the embedded default but for its CPU limit, which the
#: bench sets to the host's cores (`--sandbox-cpus`), as the references (16 threads of bare
#: spawns, parallel rg) use them all; the embedded default gives a sandbox one CPU.
SANDBOX_CONFIG = '[machines.sandbox]\nkind = "sandbox"\nnetwork = "on"\ncpus = {cpus}\n'
#: The prefix of a sandbox of its own (an id with no session), for the session twin's stage.
STAGE_SANDBOX = "/sandboxes/ses_benchstage"


@dataclass(frozen=True)
class Counts:
    """How much each figure samples (full run, or `--quick` for the smoke test)."""

    rounds: int = 200
    warmup: int = 20
    clients: int = 16
    load_seconds: float = 5.0
    grep_files: int = 50_000
    grep_hits: int = 5
    grep_runs: int = 10
    tool_samples: int = 200


QUICK = Counts(
    rounds=10, warmup=3, load_seconds=0.5, grep_files=2000, grep_hits=3, grep_runs=2, tool_samples=10
)


# --- the peer --------------------------------------------------------------------------------


@dataclass
class Peer:
    url: str
    token: str
    process: subprocess.Popen[bytes]


def peer_binary(venv: Path) -> Path:
    """`swerex-remote` in `venv`, which is made and filled with PEER_PACKAGE on first use."""
    binary = venv / "bin" / "swerex-remote"
    if not binary.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", PEER_PACKAGE]
        subprocess.run(pip, check=True, timeout=PEER_INSTALL_TIMEOUT)
    return binary


@contextmanager
def peer_serving(venv: Path, log: Path) -> Iterator[Peer]:
    """`swerex-remote` on a free loopback port with a fresh token; stopped afterwards."""
    port, token = free_port(), secrets.token_hex(16)
    argv = [str(peer_binary(venv)), "--host", "127.0.0.1", "--port", str(port), "--auth-token", token]
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out)
    peer = Peer(f"http://127.0.0.1:{port}", token, process)
    try:
        deadline = time.monotonic() + PEER_START_TIMEOUT
        while not peer_alive(peer):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swerex-remote did not start: see {log}")
            time.sleep(0.05)
        yield peer
    finally:
        process.terminate()
        process.wait(15)


def peer_alive(peer: Peer) -> bool:
    try:
        return httpx.get(peer.url + "/is_alive", headers={"X-API-Key": peer.token}, timeout=1).is_success
    except httpx.HTTPError:
        return False


def peer_call(client: httpx.Client, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(route, json=body)
    if not response.is_success:
        raise ApiError(f"swerex-remote {route} answered {response.status_code}: {response.text[:300]}")
    return dict(response.json())


# --- 1. side by side -------------------------------------------------------------------------


def side_by_side(server: Server, peer: Peer, counts: Counts, scratch: Path) -> list[Figure]:
    ours = httpx.Client(base_url=server.url, timeout=60)
    theirs = httpx.Client(base_url=peer.url, headers={"X-API-Key": peer.token}, timeout=60)
    local, peer_file = scratch / "raw-1k.txt", str(scratch / "peer-1k.txt")
    inside = "/workspace/bench-1k.txt"

    def read_back(data: dict[str, Any]) -> None:
        if data.get("content") != CONTENT:
            raise ApiError(f"a read returned other content than was written: {str(data)[:200]}")

    def api_exit_0(data: dict[str, Any]) -> None:
        if data.get("exit_code") != 0:
            raise ApiError(f"`true` answered {data}")

    ops = {
        "bare_spawn": Timed(bare_spawn, lambda _: None),
        "raw_write": Timed(lambda: local.write_text(CONTENT), lambda _: None),
        "raw_read": Timed(local.read_text, lambda text: None if text == CONTENT else exited_0(None)),
        "api_exec": Timed(lambda: call(ours, "POST", "/v2/commands", json={"command": "true"}), api_exit_0),
        "api_shell": Timed(
            lambda: call(ours, "POST", "/v1/shell/exec", json={"command": "true", "id": SHELL_SESSION}),
            api_exit_0,
        ),
        "peer_exec": Timed(
            lambda: peer_call(theirs, "/execute", {"command": "true", "shell": True}), api_exit_0
        ),
        "api_write": Timed(
            lambda: call(ours, "POST", "/v2/fs/write", json={"path": inside, "content": CONTENT}),
            lambda _: None,
        ),
        "peer_write": Timed(
            lambda: peer_call(theirs, "/write_file", {"path": peer_file, "content": CONTENT}),
            lambda _: None,
        ),
        "api_read": Timed(lambda: call(ours, "GET", "/v2/fs/read", params={"path": inside}), read_back),
        "peer_read": Timed(lambda: peer_call(theirs, "/read_file", {"path": peer_file}), read_back),
        "api_health": Timed(lambda: ours.get("/health").raise_for_status(), lambda _: None),
        "peer_alive": Timed(lambda: theirs.get("/is_alive").raise_for_status(), lambda _: None),
    }
    try:
        run_command(ours, "true", timeout=60)  # starts the sandbox
        asyncio.run(rounds(list(ops.values()), counts.rounds, counts.warmup))
    finally:
        ours.close()
        theirs.close()
    return side_by_side_figures({k: op.samples for k, op in ops.items()})


def side_by_side_figures(s: dict[str, list[float]]) -> list[Figure]:
    spawn, write, read = (statistics.median(s[k]) for k in ("bare_spawn", "raw_write", "raw_read"))

    def versus(key: str, label: str, ours: str, peer: str, target: float | None, raw: float) -> Figure:
        figure = latency_figure(
            key,
            label,
            s[ours],
            raw_label="SWE-ReX",
            raw_seconds=statistics.median(s[peer]),
            target=None if target is None else Target(target, "ratio"),
        )
        figure.extra["ratio_to_raw_operation"] = statistics.median(s[ours]) / raw
        return figure

    return [
        latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", s["bare_spawn"]),
        latency_figure("raw_write_1k", "local 1 KiB write (Python)", s["raw_write"]),
        latency_figure("raw_read_1k", "local 1 KiB read (Python)", s["raw_read"]),
        versus("api_exec_true", "POST /v2/commands true", "api_exec", "peer_exec", EXEC_RATIO_TARGET, spawn),
        versus(
            "api_v1_shell_exec_true",
            "POST /v1/shell/exec true",
            "api_shell",
            "peer_exec",
            EXEC_RATIO_TARGET,
            spawn,
        ),
        latency_figure(
            "peer_exec_true",
            "SWE-ReX POST /execute true",
            s["peer_exec"],
            raw_label="bare spawn",
            raw_seconds=spawn,
        ),
        versus(
            "api_fs_write_1k", "POST /v2/fs/write 1 KiB", "api_write", "peer_write", FS_RATIO_TARGET, write
        ),
        latency_figure(
            "peer_fs_write_1k",
            "SWE-ReX /write_file 1 KiB",
            s["peer_write"],
            raw_label="local",
            raw_seconds=write,
        ),
        versus("api_fs_read_1k", "GET /v2/fs/read 1 KiB", "api_read", "peer_read", FS_RATIO_TARGET, read),
        latency_figure(
            "peer_fs_read_1k", "SWE-ReX /read_file 1 KiB", s["peer_read"], raw_label="local", raw_seconds=read
        ),
        versus("api_health", "GET /health (the HTTP floor)", "api_health", "peer_alive", None, spawn),
    ]


# --- 2. concurrency --------------------------------------------------------------------------


def load_figures(server: Server, peer: Peer, counts: Counts) -> list[Figure]:
    clients: list[httpx.Client] = []

    def worker(
        make: Callable[[], httpx.Client], once: Callable[[httpx.Client], object]
    ) -> Callable[[], None]:
        client = make()
        clients.append(client)

        def call_once() -> None:
            once(client)

        return call_once

    def ours() -> Callable[[], None]:
        return worker(lambda: httpx.Client(base_url=server.url, timeout=60), lambda c: run_command(c, "true"))

    def theirs() -> Callable[[], None]:
        return worker(
            lambda: httpx.Client(base_url=peer.url, headers={"X-API-Key": peer.token}, timeout=60),
            lambda c: peer_call(c, "/execute", {"command": "true", "shell": True}),
        )

    try:
        api, api_wall = hammer(ours, counts.clients, counts.load_seconds)
        peer_samples, peer_wall = hammer(theirs, counts.clients, counts.load_seconds)
    finally:
        for c in clients:
            c.close()
    raw, raw_wall = hammer(lambda: bare_spawn, counts.clients, counts.load_seconds)
    n = counts.clients
    return [
        Figure(
            f"api_exec_{n}_clients_throughput",
            f"{n} clients POST /v2/commands true",
            "req/s",
            len(api) / api_wall,
            samples=len(api),
            raw_label=f"{n} threads bare spawn",
            raw=len(raw) / raw_wall,
            target=Target(LOAD_RATIO_TARGET, "at_least"),
            extra={"p50_ms": statistics.median(api) * 1000, "peer_req_per_s": len(peer_samples) / peer_wall},
        ),
        Figure(
            f"peer_exec_{n}_clients_throughput",
            f"{n} clients SWE-ReX /execute true",
            "req/s",
            len(peer_samples) / peer_wall,
            samples=len(peer_samples),
            raw_label=f"{n} threads bare spawn",
            raw=len(raw) / raw_wall,
            extra={"p50_ms": statistics.median(peer_samples) * 1000},
        ),
    ]


# --- 3. grep ---------------------------------------------------------------------------------


def grep_figures(server: Server, counts: Counts) -> list[Figure]:
    host_root = server.session_dir / "workspace" / GREP_DIR.removeprefix("/workspace/")
    make_tree(host_root, counts.grep_files, counts.grep_hits)
    argv = [ripgrep_binary(), *GrepOptions(pattern=NEEDLE).rg_args(str(host_root), sort=False)]
    with httpx.Client(base_url=server.url, timeout=120) as client:

        def api() -> int:
            return len(
                call(client, "POST", "/v2/fs/grep", json={"path": GREP_DIR, "pattern": NEEDLE})["matches"]
            )

        def direct() -> int:
            return subprocess.run(argv, check=True, stdout=subprocess.DEVNULL).returncode

        def found(n: int) -> None:
            if n != counts.grep_hits:
                raise ApiError(f"/v2/fs/grep found {n} matches, expected {counts.grep_hits}")

        ops = [Timed(api, found), Timed(direct, lambda _: None)]
        asyncio.run(rounds(ops, counts.grep_runs, 1))
    tag = f"{counts.grep_files // 1000}k files" if counts.grep_files >= 1000 else f"{counts.grep_files} files"
    return [
        latency_figure(
            "api_grep_tree",
            f"POST /v2/fs/grep, {tag}",
            ops[0].samples,
            raw_label="rg, same flags, parallel",
            raw_seconds=statistics.median(ops[1].samples),
            target=Target(GREP_RATIO_TARGET, "ratio"),
            extra={"files": counts.grep_files, "hits": counts.grep_hits, "raw_argv": argv},
        )
    ]


# --- 4. the tool layer -----------------------------------------------------------------------


def tool_figures(root: Path, counts: Counts) -> list[Figure]:
    async def measured() -> list[Figure]:
        async with tool_lab(root) as tools:
            return await bash_figures(tools, ToolCounts(samples=counts.tool_samples, warmup=counts.warmup))

    rows = {f.key: f for f in asyncio.run(measured())}
    tool, machine = rows["tool_bash_true"], rows["machine_exec_true"]
    tool.raw_label, tool.raw = "machine.exec", machine.median
    tool.target = Target(TOOL_RATIO_TARGET, "ratio")
    return [machine, rows["machine_exec_bash_true"], rows["commands_run_true"], tool]


# --- 5. the stages of one exec, in one process -----------------------------------------------


async def asgi_call(app: Any, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    """One request through the ASGI app with no socket and no HTTP parser; its status."""
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1")]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "root_path": "",
    }  # fmt: skip
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    status = 0

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    if status != 200:
        raise ApiError(f"{method} {path} answered {status} in process")
    return status


def stage_figures(root: Path, counts: Counts) -> list[Figure]:
    """machine.exec, CommandManager.run and the whole app (no socket), interleaved, one process."""
    home = root / "stages-home"
    home.mkdir()
    app = create_app(load(env={"AGENTBOX_HOME": str(home)}))

    async def measured() -> dict[str, list[float]]:
        async with app.router.lifespan_context(app):
            await asgi_call(app, "POST", "/v2/commands", {"command": "true", "timeout": 60})
            sandbox = await app.state.system.services.get(None, None)
            await asgi_call(app, "POST", "/v2/fs/write", {"path": "/workspace/s.txt", "content": CONTENT})
            await asgi_call(
                app, "POST", f"{STAGE_SANDBOX}/v2/fs/write", {"path": "/workspace/s.txt", "content": CONTENT}
            )
            ops = {
                "bare": Timed(bare_spawn, lambda _: None),
                "machine": Timed(lambda: sandbox.machine.exec(ExecRequest("true")), exited_0, awaited=True),
                "manager": Timed(lambda: sandbox.commands.run("true"), exited_0, awaited=True),
                "health": Timed(lambda: asgi_call(app, "GET", "/health"), lambda _: None, awaited=True),
                "exec": Timed(
                    lambda: asgi_call(app, "POST", "/v2/commands", {"command": "true"}),
                    lambda _: None,
                    awaited=True,
                ),
                "read": Timed(
                    lambda: asgi_call(app, "GET", "/v2/fs/read?path=/workspace/s.txt"),
                    lambda _: None,
                    awaited=True,
                ),
                "session_read": Timed(
                    lambda: asgi_call(app, "GET", f"{STAGE_SANDBOX}/v2/fs/read?path=/workspace/s.txt"),
                    lambda _: None,
                    awaited=True,
                ),
            }
            await rounds(list(ops.values()), counts.rounds, counts.warmup)
            return {k: op.samples for k, op in ops.items()}

    s = asyncio.run(measured())
    spawn = statistics.median(s["bare"])

    def row(key: str, label: str, samples: str, raw_label: str, raw: str) -> Figure:
        return latency_figure(
            key, label, s[samples], raw_label=raw_label, raw_seconds=statistics.median(s[raw])
        )

    return [
        latency_figure("stage_machine_exec", "stage: machine.exec true (agent + spawn)", s["machine"], raw_label="bare spawn", raw_seconds=spawn),
        row("stage_commands_run", "stage: CommandManager.run true", "manager", "machine.exec", "machine"),
        row("stage_asgi_exec", "stage: app, POST /v2/commands, no socket", "exec", "CommandManager.run", "manager"),
        latency_figure("stage_asgi_health", "stage: app, GET /health, no socket", s["health"]),
        latency_figure("stage_asgi_read", "stage: app, GET /v2/fs/read 1 KiB, no socket", s["read"]),
        latency_figure("stage_asgi_session_read", "stage: app, the same under /sandboxes/<id>", s["session_read"]),
    ]  # fmt: skip


# --- the run ---------------------------------------------------------------------------------


def run(
    counts: Counts,
    root: Path,
    venv: Path,
    sections: frozenset[str] = frozenset(SECTIONS),
    sandbox_cpus: float = float(os.cpu_count() or 1),
) -> tuple[list[Figure], dict[str, Any]]:
    figures = stage_figures(root, counts) if "stages" in sections else []
    if sections & SERVED_SECTIONS:
        config = SANDBOX_CONFIG.format(cpus=sandbox_cpus)
        with serving(root, config) as server, peer_serving(venv, root / "peer.log") as peer:
            if "side" in sections:
                figures += side_by_side(server, peer, counts, root)
            if "load" in sections:
                figures += load_figures(server, peer, counts)
            if "grep" in sections:
                figures += grep_figures(server, counts)
    if "tool" in sections:
        tools_root = root / "tools"
        tools_root.mkdir()
        figures += tool_figures(tools_root, counts)
    details = {
        "counts": counts.__dict__, "peer": PEER_PACKAGE, "peer_venv": str(venv), "sandbox_cpus": sandbox_cpus,
    }  # fmt: skip
    return figures, {**details, "sections": [s for s in SECTIONS if s in sections]}


def breakdown(figures: list[Figure]) -> list[str]:
    """Where one exec's time goes: each stage's median minus the one below it."""
    f = {x.key: x.median or 0.0 for x in figures}
    if not {"stage_machine_exec", "api_exec_true", "bare_spawn"} <= f.keys():
        return []
    return [
        "one exec `true`, by stage (medians, ms):",
        f"  spawn on the host (reference)             {f['bare_spawn']:.3f}",
        f"  machine.exec (agent trip + spawn inside)  {f['stage_machine_exec']:.3f}",
        f"  + command manager                         {f['stage_commands_run'] - f['stage_machine_exec']:+.3f}",
        f"  + app: middleware, routing, body, reply   {f['stage_asgi_exec'] - f['stage_commands_run']:+.3f}",
        f"  + socket, HTTP parse, client              {f['api_exec_true'] - f['stage_asgi_exec']:+.3f}",
        f"  = POST /v2/commands                       {f['api_exec_true']:.3f}",
    ]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument(
        "--peer-venv", type=Path, default=PEER_VENV, help="SWE-ReX's virtualenv (made if missing)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(SECTIONS)}; default: all)",
    )
    parser.add_argument(
        "--sandbox-cpus",
        type=float,
        default=float(os.cpu_count() or 1),
        help="the served sandbox's CPU limit (default: the host's cores; agentbox's own default is 1)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("hotpath") as tmp:
        figures, details = run(
            counts, tmp, args.peer_venv, frozenset(args.only or SECTIONS), args.sandbox_cpus
        )
    print(table(figures))
    print("\n".join(breakdown(figures)))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_hotpath", args.quick, figures, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
