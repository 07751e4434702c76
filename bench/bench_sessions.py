"""Sessions API figures (issue 5), measured against a real `python -m agentbox serve`.

    python bench/bench_sessions.py [--quick] [--json out.json]

Two parts. Turn start: one scripted session without a machine (`machine: none`, so no
sandbox is ever created), text-only turns, the SSE stream open before each message is posted; the time from the 202's
arrival to the `turn.started` frame's arrival, beside a bare GET /health round trip on the
same keep-alive connection. Load: many sessions at once, each running 5-step scripted turns
with `bash true` tool calls: throughput, event latency (the server's `created_at` to the
client's receipt), and the server's memory. If the server does not serve the sessions API,
the run says so and exits with MISSING_ROUTES_EXIT. README.md in this folder explains each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from bench_api import ApiError, MissingRoute, Server, call, exit_status, serving
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

#: Issue 5's target: message accepted (202) -> `turn.started` received over SSE, median.
TURN_START_TARGET_MS = 15.0
#: Event types that end a turn (exactly one per turn).
TERMINAL = frozenset({"turn.completed", "turn.failed", "turn.aborted"})
#: Seconds one turn (or one SSE frame) may take before the run gives up on it.
TURN_TIMEOUT = 60.0
#: Seconds the load part may take as a whole (it includes the sandboxes' first start).
LOAD_TIMEOUT = 180.0
#: Seconds between two samples of the server's memory during the load part.
RSS_INTERVAL = 0.1
#: The tool call of the load script: the cheapest command that still goes through the sandbox.
BASH_TRUE = {"name": "bash", "input": {"command": "true"}}
#: One load turn: five model calls (each consumes a step), four of them with a tool call.
LOAD_TURN: list[dict[str, Any]] = [
    {"text": "step 1", "tool_calls": [BASH_TRUE]},
    {"tool_calls": [BASH_TRUE]},
    {"text": "step 3", "tool_calls": [BASH_TRUE]},
    {"tool_calls": [BASH_TRUE]},
    {"text": "done"},
]
#: The warm-up turn of each load session: its first tool call creates the session's sandbox.
WARM_TURN: list[dict[str, Any]] = [{"tool_calls": [BASH_TRUE]}, {"text": "sandbox ready"}]
#: Tier the sessions run in: `bash` is allowed without an approval.
PERMISSION_MODE = "full-auto"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Counts:
    """How much each part samples (full run, or `--quick` for the smoke test)."""

    health: int = 200
    turns: int = 50
    warmup: int = 5
    sessions: int = 50
    load_turns: int = 3
    """Measured turns per load session, one after the other (after its warm-up turn)."""


QUICK = Counts(health=10, turns=5, warmup=1, sessions=3, load_turns=1)


# --- SSE -----------------------------------------------------------------------------------


@dataclass
class Frame:
    """One SSE event as the client received it."""

    type: str
    data: dict[str, Any]
    arrived: float
    """`time.perf_counter()` when its last line was read."""
    arrived_wall: float
    """`time.time()` at the same moment, to compare with the server's `created_at`."""

    @property
    def turn_id(self) -> str | None:
        value = self.data.get("turn_id")
        return value if isinstance(value, str) else None


class FrameParser:
    """Lines of a `text/event-stream` in, complete frames out (comments and heartbeats dropped)."""

    def __init__(self) -> None:
        self.type = ""
        self.data: list[str] = []

    def feed(self, line: str) -> Frame | None:
        if line == "":
            if not self.data:
                self.type = ""
                return None
            frame = self._frame()
            self.type, self.data = "", []
            return frame
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.type = value
        elif name == "data":
            self.data.append(value)
        return None

    def _frame(self) -> Frame:
        try:
            data = json.loads("\n".join(self.data))
        except ValueError as exc:
            raise ApiError(f"an SSE frame's data is not JSON: {self.data!r}") from exc
        if not isinstance(data, dict):
            raise ApiError(f"an SSE frame's data is not an object: {self.data!r}")
        kind = self.type or str(data.get("type", "message"))
        return Frame(kind, data, time.perf_counter(), time.time())


def created_at(data: dict[str, Any]) -> float:
    """The event's `created_at` (ISO 8601, the server's clock) as epoch seconds."""
    text = str(data["created_at"]).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


def stream_path(session_id: str) -> str:
    return f"/v1/sessions/{session_id}/events/stream"


def unwrap(response: httpx.Response, route: str) -> Any:
    """A JSON answer's data (enveloped or not), as `bench_api.call` reads it, for the async client."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code in (404, 405) and isinstance(body, dict) and set(body) == {"detail"}:
        raise MissingRoute(route)
    if response.status_code >= 400 or not isinstance(body, dict) or body.get("success") is False:
        raise ApiError(f"{route} answered {response.status_code}: {response.text[:500]}")
    return body.get("data", body) if "success" in body else body


def check_stream(response: httpx.Response, route: str) -> None:
    if response.status_code in (404, 405):
        response.read()
        with contextlib.suppress(ValueError):
            if set(response.json()) == {"detail"}:
                raise MissingRoute(route)
    if response.status_code != 200:
        response.read()
        raise ApiError(f"{route} answered {response.status_code}: {response.text[:500]}")


# --- the sessions API ----------------------------------------------------------------------


def create_session(client: httpx.Client, script: list[dict[str, Any]], machine: str | None = None) -> str:
    body: dict[str, Any] = {"model": "scripted", "script": script, "permission_mode": PERMISSION_MODE}
    if machine is not None:
        body["machine"] = machine
    data = call(client, "POST", "/v1/sessions", json=body)
    return str(data["id"])


def post_message(client: httpx.Client, session_id: str, content: str) -> str:
    route = "/v1/sessions/{id}/messages"
    data = call(client, "POST", route, f"/v1/sessions/{session_id}/messages", json={"content": content})
    return str(data["turn_id"])


async def apost_message(client: httpx.AsyncClient, session_id: str, content: str) -> str:
    response = await client.post(f"/v1/sessions/{session_id}/messages", json={"content": content})
    return str(unwrap(response, "POST /v1/sessions/{id}/messages")["turn_id"])


# --- 1. turn start -------------------------------------------------------------------------


class Listener:
    """A background thread reading one session's SSE stream (no `until`) for the whole part.

    Frames are kept by turn and type with their arrival time; the main thread waits on them.
    """

    def __init__(self, server: Server, session_id: str) -> None:
        self.url = server.url + stream_path(session_id)
        self.frames: dict[tuple[str | None, str], Frame] = {}
        self.condition = threading.Condition()
        self.error: BaseException | None = None
        self.client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.stop = False

    def start(self) -> None:
        self.thread.start()

    def _read(self) -> None:
        try:
            with self.client.stream("GET", self.url, params={"after": 0}) as response:
                check_stream(response, "GET /v1/sessions/{id}/events/stream")
                parser = FrameParser()
                for line in response.iter_lines():
                    frame = parser.feed(line)
                    if frame is not None:
                        with self.condition:
                            self.frames.setdefault((frame.turn_id, frame.type), frame)
                            self.condition.notify_all()
                    if self.stop:
                        return
        except BaseException as exc:  # handed to the waiting thread
            if not self.stop:
                with self.condition:
                    self.error = exc
                    self.condition.notify_all()

    def wait(self, turn_id: str | None, kinds: frozenset[str]) -> Frame:
        deadline = time.monotonic() + TURN_TIMEOUT
        with self.condition:
            while True:
                if self.error is not None:
                    raise self.error
                for kind in kinds:
                    if (turn_id, kind) in self.frames:
                        return self.frames[(turn_id, kind)]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(f"no {sorted(kinds)} event for turn {turn_id} within {TURN_TIMEOUT:g} s")
                self.condition.wait(left)

    def close(self) -> None:
        self.stop = True
        self.client.close()
        self.thread.join(5)


def turn_start_figures(server: Server, client: httpx.Client, counts: Counts) -> list[Figure]:
    total = counts.warmup + counts.turns
    session_id = create_session(client, [{"text": f"reply {i}"} for i in range(total)], machine="none")
    health = time_calls(lambda: call(client, "GET", "/health"), counts.health, counts.warmup)
    listener = Listener(server, session_id)
    listener.start()
    try:
        # The stream is live once it has replayed the session's first event.
        listener.wait(None, frozenset({"session.created"}))
        accepted, posted = [], []
        for i in range(total):
            sent = time.perf_counter()
            turn_id = post_message(client, session_id, f"message {i}")
            answered = time.perf_counter()
            started = listener.wait(turn_id, frozenset({"turn.started"}))
            ended = listener.wait(turn_id, TERMINAL)
            if ended.type != "turn.completed":
                raise ApiError(f"turn {turn_id} ended {ended.type}: {ended.data}")
            if i >= counts.warmup:
                accepted.append(started.arrived - answered)
                posted.append(started.arrived - sent)
    finally:
        listener.close()
    raw = statistics.median(health)
    how = "text-only turns of a session with machine none: no sandbox is created"
    return [
        latency_figure("health_rtt", "GET /health, keep-alive (raw)", health),
        latency_figure(
            "session_turn_started",
            "202 received -> turn.started over SSE",
            accepted,
            raw_label="GET /health",
            raw_seconds=raw,
            target=Target(TURN_START_TARGET_MS),
            extra={"script": how, "warmup_turns": counts.warmup, "negative": sum(a < 0 for a in accepted)},
        ),
        latency_figure(
            "session_post_to_started",
            "POST sent -> turn.started over SSE",
            posted,
            raw_label="GET /health",
            raw_seconds=raw,
            extra={"script": how},
        ),
    ]


# --- 2. load -------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """The process tree below `pid` (its sandboxes' launchers, bwrap, agents, helpers...)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    for child in Path(f"/proc/{current}/task/{task}/children").read_text().split():
                        if int(child) not in found:
                            found.add(int(child))
                            todo.append(int(child))
    return found


def kib(pid: int, file: str, name: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


@dataclass
class MemorySample:
    server_rss: int
    tree_rss: int
    """RSS summed over the server's descendants (shared pages counted once per process)."""
    processes: int


def memory(pid: int) -> MemorySample:
    tree = descendants(pid)
    return MemorySample(
        kib(pid, "status", "VmRSS") * 1024, sum(kib(p, "status", "VmRSS") for p in tree) * 1024, len(tree)
    )


@dataclass
class Sampler:
    """Samples the server's memory every RSS_INTERVAL in a thread; keeps the peak."""

    pid: int
    peak: MemorySample = field(default_factory=lambda: MemorySample(0, 0, 0))
    running: bool = True

    @contextlib.contextmanager
    def sampling(self) -> Iterator[Sampler]:
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.running = False
            thread.join(5)

    def _loop(self) -> None:
        while self.running:
            sample = memory(self.pid)
            if sample.server_rss > self.peak.server_rss:
                self.peak = MemorySample(sample.server_rss, self.peak.tree_rss, self.peak.processes)
            if sample.tree_rss > self.peak.tree_rss:
                self.peak = MemorySample(self.peak.server_rss, sample.tree_rss, sample.processes)
            time.sleep(RSS_INTERVAL)


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    """Seconds from each event's `created_at` to its receipt."""
    events: int = 0
    turns: int = 0
    failed: list[str] = field(default_factory=list)


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    parser = FrameParser()
    async for line in response.aiter_lines():
        frame = parser.feed(line)
        if frame is not None:
            yield frame


async def drive(
    client: httpx.AsyncClient,
    session_id: str,
    after: int,
    turns: int,
    go: asyncio.Event,
    ready: asyncio.Queue[None],
    out: LoadResult,
) -> None:
    """One session: stream open, wait for the common start, then `turns` messages one after another."""
    route = "GET /v1/sessions/{id}/events/stream"
    async with client.stream("GET", stream_path(session_id), params={"after": after}) as response:
        check_stream(response, route)
        ready.put_nowait(None)
        await go.wait()
        stream = frames(response)
        for i in range(turns):
            turn_id = await apost_message(client, session_id, f"load {i}")
            async for frame in stream:
                out.events += 1
                if "created_at" in frame.data:
                    out.latencies.append(frame.arrived_wall - created_at(frame.data))
                if frame.type == "agent.tool_result" and frame.data.get("is_error"):
                    out.failed.append(f"{turn_id}: tool error {frame.data}")
                if frame.turn_id == turn_id and frame.type in TERMINAL:
                    out.turns += 1
                    if frame.type != "turn.completed":
                        out.failed.append(f"{turn_id}: {frame.type} {frame.data}")
                    break


async def last_seq(client: httpx.AsyncClient, session_id: str, turn_id: str) -> int:
    """Wait for `turn_id` to end (over SSE from the start) and return the seq of its terminal event."""
    async with client.stream("GET", stream_path(session_id), params={"after": 0}) as response:
        check_stream(response, "GET /v1/sessions/{id}/events/stream")
        async for frame in frames(response):
            if frame.type == "agent.tool_result" and frame.data.get("is_error"):
                raise ApiError(f"warm-up turn {turn_id}: the tool call failed: {frame.data}")
            if frame.turn_id == turn_id and frame.type in TERMINAL:
                if frame.type != "turn.completed":
                    raise ApiError(f"warm-up turn {turn_id} ended {frame.type}: {frame.data}")
                return int(frame.data["seq"])
    raise ApiError(f"the stream of session {session_id} closed before its warm-up turn ended")


async def load(server: Server, counts: Counts) -> tuple[LoadResult, float, float, MemorySample, Sampler]:
    """Create the sessions, warm their sandboxes (timed apart), then run every session at once."""
    n = counts.sessions
    limits = httpx.Limits(max_connections=3 * n + 10, max_keepalive_connections=3 * n + 10)
    timeout = httpx.Timeout(TURN_TIMEOUT, read=TURN_TIMEOUT)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout) as client:
        script = WARM_TURN + LOAD_TURN * counts.load_turns
        with httpx.Client(base_url=server.url, timeout=TURN_TIMEOUT) as sync:
            ids = [create_session(sync, script) for _ in range(n)]
        warm_start = time.perf_counter()
        warm_turns = await asyncio.gather(*(apost_message(client, s, "warm up") for s in ids))
        seqs = await asyncio.gather(*(last_seq(client, s, t) for s, t in zip(ids, warm_turns, strict=True)))
        warm_wall = time.perf_counter() - warm_start
        idle = memory(server.process.pid)
        go: asyncio.Event = asyncio.Event()
        ready: asyncio.Queue[None] = asyncio.Queue()
        result = LoadResult()
        with Sampler(server.process.pid).sampling() as sampler:
            tasks = [
                asyncio.create_task(drive(client, s, seq, counts.load_turns, go, ready, result))
                for s, seq in zip(ids, seqs, strict=True)
            ]
            for _ in range(n):
                await ready.get()
            started = time.perf_counter()
            go.set()
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - started
    return result, wall, warm_wall, idle, sampler


def load_figures(server: Server, counts: Counts) -> list[Figure]:
    result, wall, warm_wall, idle, sampler = asyncio.run(asyncio.wait_for(load(server, counts), LOAD_TIMEOUT))
    if result.failed:
        raise ApiError(f"{len(result.failed)} load turns did not complete, e.g. {result.failed[0]}")
    n, peak = counts.sessions, sampler.peak
    tag = f"{n} sessions x {counts.load_turns} turns of {len(LOAD_TURN)} steps"
    load_extra = {"sessions": n, "turns_per_session": counts.load_turns, "steps": LOAD_TURN, "seconds": wall}
    ms = [s * 1000 for s in result.latencies]
    return [
        Figure(
            "sessions_sandbox_warmup",
            f"{n} sessions' first turn at once (starts {n} sandboxes)",
            "s",
            warm_wall,
            samples=n,
            extra={"steps": WARM_TURN},
        ),
        Figure(
            "sessions_load_turns",
            f"{tag}: turns",
            "turns/s",
            result.turns / wall,
            samples=result.turns,
            extra=load_extra,
        ),
        Figure(
            "sessions_load_events",
            f"{tag}: events",
            "events/s",
            result.events / wall,
            samples=result.events,
            extra=load_extra,
        ),
        Figure(
            "sessions_load_event_latency",
            f"{tag}: created_at -> received",
            "ms",
            statistics.median(ms),
            p95=percentile(ms, 0.95),
            p99=percentile(ms, 0.99),
            samples=len(ms),
            mean=statistics.fmean(ms),
            extra={"clock": "server created_at (millisecond resolution) vs client time.time(), one host"},
        ),
        Figure(
            "server_rss_idle",
            f"server RSS, {n} idle sessions with sandboxes",
            "MiB",
            idle.server_rss / MIB,
            samples=1,
            extra={"sandbox_tree_rss_mib": idle.tree_rss / MIB, "sandbox_tree_processes": idle.processes},
        ),
        Figure(
            "server_rss_peak",
            f"server RSS, peak under load ({tag})",
            "MiB",
            peak.server_rss / MIB,
            samples=1,
            raw_label="idle",
            raw=idle.server_rss / MIB,
            extra={"interval_s": RSS_INTERVAL},
        ),
        Figure(
            "sandboxes_rss_peak",
            f"server's child processes' RSS, peak ({n} sandboxes)",
            "MiB",
            peak.tree_rss / MIB,
            samples=1,
            raw_label="idle",
            raw=idle.tree_rss / MIB,
            extra={
                "processes": peak.processes,
                "note": "RSS summed per process: shared pages count repeatedly",
            },
        ),
    ]


# --- the run -------------------------------------------------------------------------------


def run(counts: Counts, root: Path) -> tuple[list[Figure], list[str], dict[str, Any]]:
    figures: list[Figure] = []
    missing: list[str] = []
    with serving(root) as server, httpx.Client(base_url=server.url, timeout=TURN_TIMEOUT) as client:
        try:
            figures += turn_start_figures(server, client, counts)
            figures += load_figures(server, counts)
        except MissingRoute as exc:
            missing.append(str(exc))
    return figures, missing, {"counts": counts.__dict__, "permission_mode": PERMISSION_MODE}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("sessions") as tmp:
        figures, missing, details = run(counts, tmp)
    if figures:
        print(table(figures))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_sessions", args.quick, figures, missing_routes=missing, **details)
    return exit_status(missing, "the sessions API")


if __name__ == "__main__":
    sys.exit(main())
