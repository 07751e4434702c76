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
exec in one process (machine, command manager, the ASGI app without a socket), and exec
and `/health` on both servers back to back and after an idle pause. README.md
in this folder explains each figure and gives the breakdown. `--only` runs some sections
(`SECTIONS`): `--only tool` times the tool layer alone, without a server or the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
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
from bench_images import default_images
from bench_tools import Counts as ToolCounts
from bench_tools import Timed, bash_figures, exited_0, rounds, tool_lab
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
from wire import Wire

from agentbox.api.app import create_app
from agentbox.config import load
from agentbox.machines.base import ExecRequest
from agentbox.machines.binaries import ripgrep_binary
from agentbox.machines.sandbox import process_tree
from agentbox.machines.usage import CLOCK_TICKS
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
SECTIONS = ("stages", "side", "regimes", "load", "grep", "tool")
#: The sections that need agentbox served and the peer beside it.
SERVED_SECTIONS = frozenset({"side", "regimes", "load", "grep"})
#: The pause before each call of the `after idle` regime: long enough for every CPU of the
#: host to go idle, as between an agent's calls, which come between model turns.
IDLE_PAUSE_SECONDS = 0.02
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
    idle_samples: int = 100


QUICK = Counts(
    rounds=10, warmup=3, load_seconds=0.5, grep_files=2000, grep_hits=3, grep_runs=2, tool_samples=10,
    idle_samples=3,
)  # fmt: skip


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


# --- 1. side by side -------------------------------------------------------------------------


#: One request to a server: `ask(method, route, body=None, params=None)`, the reply's data.
Ask = Callable[..., dict[str, Any]]


def wire_call(wire: Wire, method: str, route: str, body: Any = None, params: Any = None) -> dict[str, Any]:
    """One request through the lean client; the envelope's `data` (a peer's reply as it is)."""
    status, reply = wire.request(method, route, body, params)
    if status >= 400 or not isinstance(reply, dict) or reply.get("success") is False:
        raise ApiError(f"{method} {route} answered {status}: {str(reply)[:300]}")
    return dict(reply.get("data", reply) if "success" in reply else reply)


def by_wire(wire: Wire) -> Ask:
    return partial(wire_call, wire)


def by_httpx(client: httpx.Client) -> Ask:
    """Through httpx: `call` reads agentbox's envelope, and a peer's plain reply as it is."""

    def ask(method: str, route: str, body: Any = None, params: Any = None) -> dict[str, Any]:
        return dict(call(client, method, route, json=body, params=params))

    return ask


def served_root(server: Server) -> dict[str, Any]:
    """What the served sandbox's root is made of (`GET /v2/sandbox`): image and layer."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        isolation = call(client, "GET", "/v2/sandbox").get("isolation", {})
    return {k: isolation.get(k) for k in ("image", "image_detail", "system_layer_kind")}


def side_by_side(server: Server, peer: Peer, counts: Counts, scratch: Path) -> list[Figure]:
    """Both servers, through the lean client (`wire.py`) and through httpx, in one set of rounds."""
    auth = {"X-API-Key": peer.token}
    ours, theirs = Wire(server.url), Wire(peer.url, auth)
    ours_httpx = httpx.Client(base_url=server.url, timeout=60)
    theirs_httpx = httpx.Client(base_url=peer.url, headers=auth, timeout=60)
    local, peer_file = scratch / "raw-1k.txt", str(scratch / "peer-1k.txt")
    inside = "/workspace/bench-1k.txt"

    def read_back(data: dict[str, Any]) -> None:
        if data.get("content") != CONTENT:
            raise ApiError(f"a read returned other content than was written: {str(data)[:200]}")

    def none(_: object) -> None:
        return None

    def served(ask: Ask, peer_ask: Ask) -> dict[str, Timed]:
        """The rows of one client: `ask(method, route, body, params)` for agentbox, `peer_ask` for SWE-ReX."""
        return {
            "api_exec": Timed(lambda: ask("POST", "/v2/commands", {"command": "true"}), api_exit_0),
            "api_shell": Timed(
                lambda: ask("POST", "/v1/shell/exec", {"command": "true", "id": SHELL_SESSION}), api_exit_0
            ),
            "peer_exec": Timed(
                lambda: peer_ask("POST", "/execute", {"command": "true", "shell": True}), api_exit_0
            ),
            "api_write": Timed(
                lambda: ask("POST", "/v2/fs/write", {"path": inside, "content": CONTENT}), none
            ),
            "peer_write": Timed(
                lambda: peer_ask("POST", "/write_file", {"path": peer_file, "content": CONTENT}), none
            ),
            "api_read": Timed(lambda: ask("GET", "/v2/fs/read", None, {"path": inside}), read_back),
            "peer_read": Timed(lambda: peer_ask("POST", "/read_file", {"path": peer_file}), read_back),
            "api_health": Timed(lambda: ask("GET", "/health"), none),
            "peer_alive": Timed(lambda: peer_ask("GET", "/is_alive"), none),
        }

    ops = {
        "bare_spawn": Timed(bare_spawn, none),
        "raw_write": Timed(lambda: local.write_text(CONTENT), none),
        "raw_read": Timed(local.read_text, lambda text: None if text == CONTENT else exited_0(None)),
        **served(by_wire(ours), by_wire(theirs)),
        **{f"httpx_{k}": op for k, op in served(by_httpx(ours_httpx), by_httpx(theirs_httpx)).items()},
    }
    try:
        run_command(ours_httpx, "true", timeout=60)  # starts the sandbox
        for write in ("raw_write", "api_write", "peer_write"):  # each read, in any order, finds its file
            ops[write].call()
        asyncio.run(rounds(list(ops.values()), counts.rounds, counts.warmup))
    finally:
        for client in (ours, theirs, ours_httpx, theirs_httpx):
            client.close()
    return side_by_side_figures({k: op.samples for k, op in ops.items()})


def side_by_side_figures(s: dict[str, list[float]]) -> list[Figure]:
    spawn, write, read = (statistics.median(s[k]) for k in ("bare_spawn", "raw_write", "raw_read"))

    def versus(key: str, label: str, ours: str, peer: str, target: float | None, raw: float) -> list[Figure]:
        """The row through the lean client (held to `target`) and its httpx twin (`<key>_httpx`)."""
        rows = []
        for name, prefix, suffix, aim in (
            (key, "", "", target),
            (f"{key}_httpx", "httpx_", " (httpx)", None),
        ):
            figure = latency_figure(
                name,
                label + suffix,
                s[prefix + ours],
                raw_label="SWE-ReX" + suffix,
                raw_seconds=statistics.median(s[prefix + peer]),
                target=None if aim is None else Target(aim, "ratio"),
            )
            figure.extra["ratio_to_raw_operation"] = statistics.median(s[prefix + ours]) / raw
            rows.append(figure)
        return rows

    def peer_row(key: str, label: str, samples: str, raw_label: str, raw: float) -> list[Figure]:
        return [
            latency_figure(key, label, s[samples], raw_label=raw_label, raw_seconds=raw),
            latency_figure(f"{key}_httpx", f"{label} (httpx)", s["httpx_" + samples], raw_label=raw_label, raw_seconds=raw),
        ]  # fmt: skip

    return [
        latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", s["bare_spawn"]),
        latency_figure("raw_write_1k", "local 1 KiB write (Python)", s["raw_write"]),
        latency_figure("raw_read_1k", "local 1 KiB read (Python)", s["raw_read"]),
        *versus("api_exec_true", "POST /v2/commands true", "api_exec", "peer_exec", EXEC_RATIO_TARGET, spawn),
        *versus(
            "api_v1_shell_exec_true", "POST /v1/shell/exec true", "api_shell", "peer_exec", EXEC_RATIO_TARGET, spawn
        ),
        *peer_row("peer_exec_true", "SWE-ReX POST /execute true", "peer_exec", "bare spawn", spawn),
        *versus("api_fs_write_1k", "POST /v2/fs/write 1 KiB", "api_write", "peer_write", FS_RATIO_TARGET, write),
        *peer_row("peer_fs_write_1k", "SWE-ReX /write_file 1 KiB", "peer_write", "local", write),
        *versus("api_fs_read_1k", "GET /v2/fs/read 1 KiB", "api_read", "peer_read", FS_RATIO_TARGET, read),
        *peer_row("peer_fs_read_1k", "SWE-ReX /read_file 1 KiB", "peer_read", "local", read),
        *versus("api_health", "GET /health (the HTTP floor)", "api_health", "peer_alive", None, spawn),
    ]  # fmt: skip


# --- 1b. regimes -----------------------------------------------------------------------------


def regime_figures(server: Server, peer: Peer, counts: Counts) -> list[Figure]:
    """Exec `true` and the HTTP floor on both servers, in two regimes besides the rounds' turns.

    Back to back: each call `rounds` times in a row, so caches stay warm and CPUs awake. After
    idle: IDLE_PAUSE_SECONDS of sleep before each call, so every call wakes idle CPUs and
    starts on cold caches. The rounds fall in between (another server's call came just
    before). No target here: the rows show how much of a figure is the host's, not the server's.
    """
    ours, theirs = Wire(server.url), Wire(peer.url, {"X-API-Key": peer.token})
    ask, peer_ask = by_wire(ours), by_wire(theirs)
    calls: dict[str, Callable[[], object]] = {
        "api_exec": lambda: api_exit_0(ask("POST", "/v2/commands", {"command": "true"})),
        "peer_exec": lambda: api_exit_0(peer_ask("POST", "/execute", {"command": "true", "shell": True})),
        "api_health": lambda: ask("GET", "/health"),
        "peer_alive": lambda: peer_ask("GET", "/is_alive"),
    }
    back: dict[str, list[float]] = {}
    idle: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for name, call_once in calls.items():
            back[name] = time_calls(call_once, counts.rounds, counts.warmup)
        for _ in range(counts.idle_samples):
            for name, call_once in calls.items():
                time.sleep(IDLE_PAUSE_SECONDS)
                idle[name] += time_calls(call_once, 1, 0)
    finally:
        ours.close()
        theirs.close()
    rows = []
    for regime, s in (("back_to_back", back), ("after_idle", idle)):
        words = regime.replace("_", " ")
        for ours_key, peer_key, key, label, peer_label in (
            ("api_exec", "peer_exec", "api_exec_true", "POST /v2/commands true", "SWE-ReX"),
            ("api_health", "peer_alive", "api_health", "GET /health", "SWE-ReX /is_alive"),
        ):
            peer_median = statistics.median(s[peer_key])
            name, shown, raw_label = f"{key}_{regime}", f"{label}, {words}", f"{peer_label}, {words}"
            rows.append(
                latency_figure(name, shown, s[ours_key], raw_label=raw_label, raw_seconds=peer_median)
            )
    return rows


# --- 2. concurrency --------------------------------------------------------------------------


#: Where a load client sends its command: base URL, headers, route, body.
Endpoint = tuple[str, dict[str, str], str, dict[str, Any]]


def proc_cpu(pid: int) -> tuple[float, float]:
    """A process's own CPU seconds (user + system) and those of the children it has reaped."""
    ticks = [int(f) for f in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]
    return (ticks[0] + ticks[1]) / CLOCK_TICKS, (ticks[2] + ticks[3]) / CLOCK_TICKS


def own_cpu() -> tuple[float, float]:
    """This process's CPU seconds (its client threads) and its reaped children's (bare spawns)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def exec_agent_pid(server_pid: int) -> int:
    """The served sandbox's exec agent: the server's descendant that is pid 1 of its own pid
    namespace. It reaps every command, so their CPU time is its children's."""
    for pid in process_tree(server_pid)[1:]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
    raise ApiError("no exec agent runs under the server")


def served_cpu(server_pid: int, agent_pid: int) -> dict[str, float]:
    """CPU seconds so far of agentbox's server, its sandbox's exec agent, the commands that
    agent reaped, and this process's client threads."""
    (server, _), (agent, commands), (clients, _) = proc_cpu(server_pid), proc_cpu(agent_pid), own_cpu()
    return {"server": server, "exec agent": agent, "commands": commands, "clients": clients}


def peer_cpu(server_pid: int) -> dict[str, float]:
    """The same for SWE-ReX, whose server spawns and reaps its commands itself."""
    (server, commands), (clients, _) = proc_cpu(server_pid), own_cpu()
    return {"server": server, "commands": commands, "clients": clients}


def bare_cpu() -> dict[str, float]:
    """The same for the bare spawns: the threads that spawn, and the commands they reaped."""
    threads, commands = own_cpu()
    return {"threads": threads, "commands": commands}


def cpu_per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds of CPU each party spent per request between two readings."""
    return {party: (after[party] - before[party]) * 1000 / max(requests, 1) for party in before}


def load_figures(server: Server, peer: Peer, counts: Counts) -> list[Figure]:
    """16 clients on each server, through the lean client and through httpx, against 16 threads
    of bare spawns; with the CPU time each party spent per request in the lean runs."""
    closing: list[Wire | httpx.Client] = []

    def lean(url: str, headers: dict[str, str]) -> Ask:
        wire = Wire(url, headers)
        closing.append(wire)
        return by_wire(wire)

    def heavy(url: str, headers: dict[str, str]) -> Ask:
        client = httpx.Client(base_url=url, headers=headers, timeout=60)
        closing.append(client)
        return by_httpx(client)

    def worker(make: Callable[[str, dict[str, str]], Ask], to: Endpoint) -> Callable[[], None]:
        url, headers, route, body = to
        ask = make(url, headers)
        return lambda: api_exit_0(ask("POST", route, body))

    ours: Endpoint = (server.url, {}, "/v2/commands", {"command": "true"})
    theirs: Endpoint = (peer.url, {"X-API-Key": peer.token}, "/execute", {"command": "true", "shell": True})
    runs = {
        "api": (lean, ours),
        "peer": (lean, theirs),
        "api_httpx": (heavy, ours),
        "peer_httpx": (heavy, theirs),
    }
    counters: dict[str, Callable[[], dict[str, float]]] = {
        "api": partial(served_cpu, server.process.pid, exec_agent_pid(server.process.pid)),
        "peer": partial(peer_cpu, peer.process.pid),
    }
    measured: dict[str, tuple[list[float], float]] = {}
    cpu: dict[str, dict[str, float]] = {}
    references = [bare_load(counts)]
    try:
        for name, (make, target) in runs.items():
            counter = counters.get(name)
            before = counter() if counter else {}
            measured[name] = hammer(partial(worker, make, target), counts.clients, counts.load_seconds)
            if counter:
                cpu[name] = cpu_per_request(before, counter(), len(measured[name][0]))
    finally:
        for c in closing:
            c.close()
    references.append(bare_load(counts))
    raw, raw_wall, cpu["bare"] = max(references, key=lambda r: len(r[0]) / r[1])
    n = counts.clients

    def row(name: str, label: str, target: Target | None) -> Figure:
        samples, wall = measured[name]
        extra: dict[str, Any] = {"p50_ms": statistics.median(samples) * 1000}
        if name in cpu:
            extra["cpu_ms_per_request"] = cpu[name]
            extra["raw_cpu_ms_per_spawn"] = cpu["bare"]
        return Figure(
            f"{name}_exec_{n}_clients_throughput",
            f"{n} clients {label}",
            "req/s",
            len(samples) / wall,
            samples=len(samples),
            raw_label=f"{n} threads bare spawn",
            raw=len(raw) / raw_wall,
            target=target,
            extra=extra,
        )

    rows = [
        row("api", "POST /v2/commands true", Target(LOAD_RATIO_TARGET, "at_least")),
        row("peer", "SWE-ReX /execute true", None),
        row("api_httpx", "POST /v2/commands true (httpx)", None),
        row("peer_httpx", "SWE-ReX /execute true (httpx)", None),
    ]
    rows[0].extra["peer_req_per_s"] = rows[1].median
    rows[0].extra["raw_req_per_s_before_after"] = [len(r[0]) / r[1] for r in references]
    return rows


def bare_load(counts: Counts) -> tuple[list[float], float, dict[str, float]]:
    """16 threads of bare spawns: their samples, wall time and CPU per spawn.

    Run before the servers' loads and after them; the faster run is the reference. A burst of
    load on the host during one run would otherwise read as a gain of every ratio against it.
    """
    before = bare_cpu()
    samples, wall = hammer(lambda: bare_spawn, counts.clients, counts.load_seconds)
    return samples, wall, cpu_per_request(before, bare_cpu(), len(samples))


def cpu_lines(figures: list[Figure]) -> list[str]:
    """Where the CPU of one loaded request goes: a CPU-bound load's throughput is the cores
    divided by the sum of these, so the parts show what a ratio of throughputs is made of."""
    rows = {f.key.split("_exec_")[0]: f.extra for f in figures if "cpu_ms_per_request" in f.extra}
    if "api" not in rows:
        return []
    named = [
        ("agentbox", rows["api"]["cpu_ms_per_request"]),
        ("bare spawn", rows["api"]["raw_cpu_ms_per_spawn"]),
    ]
    if "peer" in rows:
        named.insert(1, ("SWE-ReX", rows["peer"]["cpu_ms_per_request"]))
    lines = ["CPU per request under the load (ms; the host's cores divided by the total bound the rate):"]
    for who, parts in named:
        split = ", ".join(f"{party} {ms:.3f}" for party, ms in parts.items())
        lines.append(f"  {who:<11} {sum(parts.values()):.3f} = {split}")
    return lines


def api_exit_0(data: dict[str, Any]) -> None:
    if data.get("exit_code") != 0:
        raise ApiError(f"`true` answered {data}")


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


def tool_figures(root: Path, counts: Counts, images: Path) -> list[Figure]:
    async def measured() -> list[Figure]:
        async with tool_lab(root, images) as tools:
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


def stage_figures(root: Path, counts: Counts, images: Path) -> list[Figure]:
    """machine.exec, CommandManager.run and the whole app (no socket), interleaved, one process."""
    home = root / "stages-home"
    home.mkdir()
    app = create_app(load(env={"AGENTBOX_HOME": str(home), "AGENTBOX_IMAGES": str(images)}))

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
    images: Path | None = None,
) -> tuple[list[Figure], dict[str, Any]]:
    images = images or default_images()
    figures = stage_figures(root, counts, images) if "stages" in sections else []
    served: dict[str, Any] = {}
    if sections & SERVED_SECTIONS:
        config = SANDBOX_CONFIG.format(cpus=sandbox_cpus)
        with serving(root, config, images) as server, peer_serving(venv, root / "peer.log") as peer:
            served = served_root(server)
            if "side" in sections:
                figures += side_by_side(server, peer, counts, root)
            if "regimes" in sections:
                figures += regime_figures(server, peer, counts)
            if "load" in sections:
                figures += load_figures(server, peer, counts)
            if "grep" in sections:
                figures += grep_figures(server, counts)
    if "tool" in sections:
        tools_root = root / "tools"
        tools_root.mkdir()
        figures += tool_figures(tools_root, counts, images)
    details = {
        "counts": counts.__dict__, "peer": PEER_PACKAGE, "peer_venv": str(venv), "sandbox_cpus": sandbox_cpus,
        "images": str(images), "served_root": served,
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
        "--images",
        type=Path,
        default=None,
        help="the images the sandboxes run on (default: the server's, AGENTBOX_IMAGES or the default "
        "home's; where `base` is not built, the host-based fallback)",
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
            counts, tmp, args.peer_venv, frozenset(args.only or SECTIONS), args.sandbox_cpus, args.images
        )
    print(table(figures))
    if details["served_root"]:
        print(
            "served sandbox: {image_detail}, system layer {system_layer_kind}".format(
                **details["served_root"]
            )
        )
    print("\n".join(breakdown(figures) + cpu_lines(figures)))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_hotpath", args.quick, figures, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
