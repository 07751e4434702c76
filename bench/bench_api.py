"""HTTP API figures, measured against a real `python -m agentbox serve` on a loopback port.

    python bench/bench_api.py [--quick] [--json out.json]

The server runs with its own temporary AGENTBOX_HOME (removed at the end) and acts on the
default session's sandbox. Latency figures use one keep-alive connection. A route that
the server does not serve yet is reported by name; the other figures are still measured,
and the run exits with MISSING_ROUTES_EXIT. README.md in this folder explains each figure.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from asyncinotify import Inotify, Mask
from figures import (
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

from agentbox.machines.binaries import ripgrep_binary as rg_binary

#: Issue targets this script reports against.
EXEC_TARGET_MS = 2.5
"""POST /v2/commands of `true`, one keep-alive client."""
FS_TARGET_MS = 1.0
"""1 KiB write, and 1 KiB read, through /v2/fs."""
WATCH_TARGET_MS = 10.0
"""From a file's creation to a waiting long-poll returning its event."""
GREP_RATIO_TARGET = 1.3
"""/v2/fs/grep over a 50k-file tree, as a multiple of the same rg run directly."""

#: Exit status when some route is not served (the figures that could run are still printed).
MISSING_ROUTES_EXIT = 3


def exit_status(missing: list[str], what: str) -> int:
    """0, or (after naming them on stderr) MISSING_ROUTES_EXIT when routes were missing."""
    if not missing:
        return 0
    print(f"not measured, the server does not serve {what} yet:", file=sys.stderr)
    for m in missing:
        print(f"  {m}", file=sys.stderr)
    return MISSING_ROUTES_EXIT


#: Seconds the server may take to answer /health.
SERVER_START_TIMEOUT = 30.0
#: Seconds the first command may take (it starts the session's sandbox).
FIRST_COMMAND_TIMEOUT = 60.0
#: Seconds a long-poll waits for the next event (the watch figure's `timeout=`).
POLL_TIMEOUT = 10
#: Seconds between two files written for the watch figure (a poll is parked again well before).
WATCH_SPACING = 0.02
#: The watched directory, inside the sandbox.
WATCH_DIR = "/workspace/bench-watch"
#: The grep tree, inside the sandbox, and the needle a few of its files hold.
GREP_DIR = "/workspace/bench-grep"
NEEDLE = "agentbox-bench-needle-7f3a"
#: Files per directory of the grep tree.
FILES_PER_DIR = 1000
KIB = 1024


@dataclass(frozen=True)
class Counts:
    """How much each figure samples (full run, or `--quick` for the smoke test)."""

    spawn: int = 200
    exec: int = 500
    fs: int = 500
    warmup: int = 20
    watch: int = 50
    grep_files: int = 50_000
    grep_hits: int = 5
    grep_runs: int = 10
    clients: int = 16
    load_seconds: float = 5.0


QUICK = Counts(
    spawn=10, exec=20, fs=20, warmup=3, watch=5, grep_files=2000, grep_hits=3, grep_runs=2, load_seconds=0.5
)


class MissingRoute(Exception):
    """The server answered "no such route": that part of the API is not written yet."""


class ApiError(Exception):
    """A route answered with an error: the benchmark cannot go on with it."""


# --- the server ------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    home: Path
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def session_dir(self) -> Path:
        return self.home / "sessions" / "default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(root: Path, config: str | None = None, images: Path | None = None) -> Iterator[Server]:
    """`python -m agentbox serve` on a free loopback port with AGENTBOX_HOME under `root`; with
    `config`, that text is its agentbox.toml (else the embedded defaults); with `images`, its
    images are there (AGENTBOX_IMAGES), else in that home, where none is built."""
    home, log = root / "home", root / "server.log"
    home.mkdir()
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    if images is not None:
        env["AGENTBOX_IMAGES"] = str(images)
    if config is not None:
        (root / "agentbox.toml").write_text(config)
        env["AGENTBOX_CONFIG"] = str(root / "agentbox.toml")
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=out,
        )
    server = Server(f"http://127.0.0.1:{port}", home, process, log)
    try:
        wait_healthy(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}: see {server.log}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server did not answer /health within {SERVER_START_TIMEOUT:g} s")


def call(client: httpx.Client, method: str, route: str, path: str | None = None, **kwargs: Any) -> Any:
    """One request; returns the envelope's `data`. `route` names the route in error messages."""
    response = client.request(method, path or route, **kwargs)
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code in (404, 405) and isinstance(body, dict) and set(body) == {"detail"}:
        raise MissingRoute(f"{method} {route}")
    if response.status_code >= 400 or not isinstance(body, dict) or body.get("success") is False:
        raise ApiError(f"{method} {route} answered {response.status_code}: {response.text[:500]}")
    return body.get("data", body) if "success" in body else body


def run_command(client: httpx.Client, command: str, timeout: float | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command}
    if timeout is not None:
        body["timeout"] = timeout
    data = call(client, "POST", "/v2/commands", json=body, timeout=(timeout or 60) + 30)
    if data.get("exit_code") != 0:
        raise ApiError(f"command {command[:80]!r} exited {data.get('exit_code')}: {data}")
    return dict(data)


# --- raw references ----------------------------------------------------------------------


def bare_spawn() -> None:
    subprocess.run(["sh", "-c", "true"], check=True)


def spawn_seconds(counts: Counts) -> list[float]:
    return time_calls(bare_spawn, counts.spawn, counts.warmup)


# --- 1. exec -------------------------------------------------------------------------------


def first_command_figures(client: httpx.Client) -> list[Figure]:
    """The first request starts the session's sandbox: measured once, and out of the way."""
    start = time.perf_counter()
    run_command(client, "true", timeout=FIRST_COMMAND_TIMEOUT)
    return [
        latency_figure(
            "api_first_command", "first POST /v2/commands (starts the sandbox)", [time.perf_counter() - start]
        )
    ]


def exec_figures(client: httpx.Client, counts: Counts, spawn: float) -> list[Figure]:
    samples = time_calls(lambda: run_command(client, "true"), counts.exec, counts.warmup)
    return [
        latency_figure(
            "api_exec_true",
            "POST /v2/commands true",
            samples,
            raw_label="bare spawn",
            raw_seconds=spawn,
            target=Target(EXEC_TARGET_MS),
        )
    ]


# --- 2. files ------------------------------------------------------------------------------


def fs_figures(client: httpx.Client, counts: Counts, scratch: Path) -> list[Figure]:
    content = ("0123456789abcde\n" * (KIB // 16))[:KIB]
    path = "/workspace/bench-1k.txt"
    local = scratch / "raw-1k.txt"

    def api_write() -> None:
        call(client, "POST", "/v2/fs/write", json={"path": path, "content": content})

    def api_read() -> None:
        data = call(client, "GET", "/v2/fs/read", params={"path": path})
        if data.get("content") != content:
            raise ApiError(f"GET /v2/fs/read returned other content than was written: {str(data)[:200]}")

    def raw_write() -> None:
        local.write_text(content)

    def raw_read() -> None:
        local.read_text()

    figures = []
    for key, label, api, raw in (
        ("api_fs_write_1k", "POST /v2/fs/write 1 KiB", api_write, raw_write),
        ("api_fs_read_1k", "GET /v2/fs/read 1 KiB", api_read, raw_read),
    ):
        samples = time_calls(api, counts.fs, counts.warmup)
        raw_median = statistics.median(time_calls(raw, counts.fs, counts.warmup))
        figures.append(
            latency_figure(
                key,
                label,
                samples,
                raw_label="local file, Python",
                raw_seconds=raw_median,
                target=Target(FS_TARGET_MS),
            )
        )
    return figures


# --- 3. watch ------------------------------------------------------------------------------


class Poller(threading.Thread):
    """Long-polls a watcher on its own keep-alive connection; notes when each file's create arrives."""

    def __init__(self, url: str, watcher_id: str, names: set[str], deadline: float) -> None:
        super().__init__(daemon=True)
        self.url, self.watcher_id, self.names, self.deadline = url, watcher_id, names, deadline
        self.arrived: dict[str, float] = {}
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=POLL_TIMEOUT + 30) as client:
                self._loop(client)
        except BaseException as exc:  # handed to the main thread
            self.error = exc
        finally:
            self.first.set()

    def _loop(self, client: httpx.Client) -> None:
        cursor = 0
        route = "/v2/watch/{id}/poll"
        while not self.names <= self.arrived.keys() and time.monotonic() < self.deadline:
            params = {"cursor": cursor, "timeout": POLL_TIMEOUT}
            page = call(client, "GET", route, f"/v2/watch/{self.watcher_id}/poll", params=params)
            now = time.time()
            for event in page["events"]:
                name = os.path.basename(event["path"])
                if event["type"] == "create" and name not in self.arrived:
                    self.arrived[name] = now
            cursor = page["cursor"]
            self.first.set()


def watch_latencies(
    server: Server, client: httpx.Client, tag: str, count: int, write: Callable[[], dict[str, float]]
) -> list[float]:
    """Seconds from each file's creation (times from `write`) to its event reaching a parked poll.

    A priming file is written first and its event awaited, so the poller is connected and
    parked before the measured files come, WATCH_SPACING apart.
    """
    watcher = call(client, "POST", "/v2/watch", json={"path": WATCH_DIR, "recursive": True})
    watcher_id = watcher.get("watcher_id") or watcher.get("id")
    names = {f"{tag}{i}" for i in range(1, count + 1)} | {f"{tag}prime"}
    poller = Poller(server.url, str(watcher_id), names, time.monotonic() + 60 + count * WATCH_SPACING)
    poller.start()
    try:
        watch_host_dir(server).joinpath(f"{tag}prime").write_text("prime\n")
        poller.first.wait(POLL_TIMEOUT + 30)
        created = write()
        poller.join(POLL_TIMEOUT + 30)
    finally:
        call(client, "DELETE", "/v2/watch/{id}", f"/v2/watch/{watcher_id}")
    if poller.error is not None:
        raise poller.error
    missing = sorted(set(created) - poller.arrived.keys())
    if missing:
        raise ApiError(f"the watcher never reported the creation of {missing[:5]}")
    return [poller.arrived[name] - t for name, t in created.items()]


def watch_host_dir(server: Server) -> Path:
    """The sandbox's /workspace is the session directory's workspace folder on the host."""
    found = server.session_dir / "workspace" / WATCH_DIR.removeprefix("/workspace/")
    if not found.is_dir():
        raise ApiError(f"no host directory for the sandbox's {WATCH_DIR} under {server.session_dir}")
    return found


def inotify_latencies(directory: Path, count: int) -> list[float]:
    """The raw operation under a watcher: seconds from a file's creation to inotify reporting it
    to a thread of this process blocked on the inotify descriptor."""
    directory.mkdir()
    arrived: dict[str, float] = {}
    with Inotify() as inotify:
        inotify.add_watch(directory, Mask.CREATE)

        def reader() -> None:
            while len(arrived) < count:
                event = inotify.sync_get()
                if event is not None and event.name is not None:
                    arrived.setdefault(str(event.name), time.time())

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        created = {}
        for i in range(count):
            created[f"r{i}"] = time.time()
            (directory / f"r{i}").write_text("x\n")
            time.sleep(WATCH_SPACING)
        thread.join(POLL_TIMEOUT)
    if set(created) - arrived.keys():
        raise RuntimeError("inotify did not report every file created for the raw watch reference")
    return [arrived[name] - t for name, t in created.items()]


def watch_figures(server: Server, client: httpx.Client, counts: Counts, scratch: Path) -> list[Figure]:
    raw = statistics.median(inotify_latencies(scratch / "raw-inotify", counts.watch))
    run_command(client, f"mkdir -p {WATCH_DIR}")
    host_dir = watch_host_dir(server)

    def host_writes() -> dict[str, float]:
        created = {}
        for i in range(1, counts.watch + 1):
            created[f"h{i}"] = time.time()
            (host_dir / f"h{i}").write_text("x\n")
            time.sleep(WATCH_SPACING)
        return created

    def sandbox_writes() -> dict[str, float]:
        script = (
            f"i=1; while [ $i -le {counts.watch} ]; do t=$(date +%s.%N); echo $t > {WATCH_DIR}/s$i; "
            f"sleep {WATCH_SPACING}; i=$((i+1)); done"
        )
        run_command(client, script, timeout=60 + counts.watch * WATCH_SPACING * 10)
        return {f"s{i}": float((host_dir / f"s{i}").read_text()) for i in range(1, counts.watch + 1)}

    host = watch_latencies(server, client, "h", counts.watch, host_writes)
    inside = watch_latencies(server, client, "s", counts.watch, sandbox_writes)
    return [
        latency_figure(
            "api_watch_host_write",
            "watch long-poll <- file created on host",
            host,
            raw_label="inotify, in process",
            raw_seconds=raw,
            target=Target(WATCH_TARGET_MS),
        ),
        latency_figure(
            "api_watch_sandbox_write",
            "watch long-poll <- file created in sandbox",
            inside,
            raw_label="inotify, in process",
            raw_seconds=raw,
            target=Target(WATCH_TARGET_MS),
            extra={"clock": "date +%s.%N in the sandbox, just before the write"},
        ),
    ]


# --- 4. grep -------------------------------------------------------------------------------


def make_tree(root: Path, files: int, hits: int) -> None:
    """`files` small files, FILES_PER_DIR per directory; `hits` of them, spread out, hold NEEDLE."""
    every = max(1, files // hits)
    for i in range(files):
        d = root / f"d{i // FILES_PER_DIR:03d}"
        if i % FILES_PER_DIR == 0:
            d.mkdir(parents=True, exist_ok=True)
        text = f"file {i}\nlorem ipsum dolor sit amet {i * 7919}\n"
        if i % every == every // 2 and i // every < hits:
            text += f"here is the {NEEDLE}\n"
        (d / f"f{i:05d}.txt").write_text(text)


def grep_figures(server: Server, client: httpx.Client, counts: Counts) -> list[Figure]:
    host_root = server.session_dir / "workspace" / GREP_DIR.removeprefix("/workspace/")
    make_tree(host_root, counts.grep_files, counts.grep_hits)
    rg = rg_binary()
    # The flags the API's grep applies by default (upstream's max_file_size=1M included).
    same = [rg, "--json", "--sort", "path", "--max-filesize=1M", "--regexp", NEEDLE, "--", str(host_root)]
    plain = [rg, NEEDLE, str(host_root)]

    def api() -> None:
        data = call(client, "POST", "/v2/fs/grep", json={"path": GREP_DIR, "pattern": NEEDLE})
        if len(data["matches"]) != counts.grep_hits:
            raise ApiError(f"/v2/fs/grep found {len(data['matches'])} matches, expected {counts.grep_hits}")

    def direct(argv: list[str]) -> Callable[[], None]:
        def once() -> None:
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)

        return once

    samples = time_calls(api, counts.grep_runs, 1)
    raw_same = statistics.median(time_calls(direct(same), counts.grep_runs, 1))
    raw_plain = statistics.median(time_calls(direct(plain), counts.grep_runs, 1))
    tag = f"{counts.grep_files // 1000}k files" if counts.grep_files >= 1000 else f"{counts.grep_files} files"
    return [
        latency_figure(
            "api_grep_tree",
            f"POST /v2/fs/grep, {tag}",
            samples,
            raw_label="rg --json --sort path --max-filesize=1M",
            raw_seconds=raw_same,
            target=Target(GREP_RATIO_TARGET, "ratio"),
            extra={
                "files": counts.grep_files,
                "hits": counts.grep_hits,
                "raw_argv": same,
                "raw_plain_rg_ms": raw_plain * 1000,
                "ratio_to_plain_rg": statistics.median(samples) / raw_plain,
            },
        ),
        Figure(
            "rg_plain_tree",
            f"rg (parallel, unsorted), {tag}",
            "ms",
            raw_plain * 1000,
            samples=counts.grep_runs,
            extra={"argv": plain},
        ),
    ]


# --- 5. concurrency ------------------------------------------------------------------------


def hammer(work: Callable[[], Callable[[], None]], clients: int, seconds: float) -> tuple[list[float], float]:
    """`clients` threads each calling their own `work()` callable until `seconds` pass.
    Returns every call's seconds and the wall time from the common start to the last finish."""
    barrier = threading.Barrier(clients + 1)
    results: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def worker(out: list[float]) -> None:
        try:
            once = work()
            barrier.wait()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                start = time.perf_counter()
                once()
                out.append(time.perf_counter() - start)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    started = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [s for r in results for s in r], time.perf_counter() - started


def load_figures(server: Server, counts: Counts) -> list[Figure]:
    clients: list[httpx.Client] = []

    def api_worker() -> Callable[[], None]:
        client = httpx.Client(base_url=server.url, timeout=60)
        clients.append(client)

        def once() -> None:
            run_command(client, "true")

        return once

    try:
        api, api_wall = hammer(api_worker, counts.clients, counts.load_seconds)
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
            extra={"seconds": api_wall},
        ),
        latency_figure(
            f"api_exec_{n}_clients_latency",
            f"{n} clients POST /v2/commands true, latency",
            api,
            raw_label=f"{n} threads bare spawn",
            raw_seconds=statistics.median(raw),
            extra={"raw_p99_ms": percentile(raw, 0.99) * 1000},
        ),
    ]


# --- the run -------------------------------------------------------------------------------


def run(counts: Counts, root: Path) -> tuple[list[Figure], list[str], dict[str, Any]]:
    figures: list[Figure] = []
    missing: list[str] = []
    spawn_samples = spawn_seconds(counts)
    spawn = statistics.median(spawn_samples)
    figures.append(latency_figure("bare_spawn", "bare spawn sh -c true (subprocess.run)", spawn_samples))
    with serving(root) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        sections: list[tuple[str, Callable[[], list[Figure]]]] = [
            ("first command", lambda: first_command_figures(client)),
            ("exec", lambda: exec_figures(client, counts, spawn)),
            ("fs", lambda: fs_figures(client, counts, root)),
            ("watch", lambda: watch_figures(server, client, counts, root)),
            ("grep", lambda: grep_figures(server, client, counts)),
            ("load", lambda: load_figures(server, counts)),
        ]
        for name, section in sections:
            try:
                figures += section()
            except MissingRoute as exc:
                missing.append(f"{name}: {exc}")
    return figures, missing, {"counts": counts.__dict__}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("api") as tmp:
        figures, missing, details = run(counts, tmp)
    print(table(figures))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_api", args.quick, figures, missing_routes=missing, **details)
    return exit_status(missing, "these routes")


if __name__ == "__main__":
    sys.exit(main())
