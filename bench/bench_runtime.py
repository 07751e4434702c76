"""Runtime figures: what building the model's view costs per model call, as a session grows.

    python bench/bench_runtime.py [--quick] [--json out.json]

In one process, on a real SQLite file under a temporary AGENTBOX home, sessions without a
machine whose transcripts hold N messages (user message and reply per turn, written through
the store as turns would write them). For each N: `TurnContext.request()` (newest baseline,
the transcript through the turn, the token count for the threshold check, the call index)
beside the raw operation it wraps, `SessionStore.transcript()` of the same session. From
`COMPACT_FROM` messages on, also one compaction (`TurnContext.compact`: cut, summary request
to the scripted model, rebaseline; one sample, since it changes the session) and
`request()` again after it, which reads only what the compaction kept. README.md in this folder explains each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import Figure, arg_parser, footer, latency_figure, scratch_dir, table, write_json

from agentbox.agent.compaction import CompactionConfig
from agentbox.agent.context import Surroundings, TurnContext
from agentbox.agent.events import EventBus
from agentbox.agent.limits import ModelLimits
from agentbox.agent.models import ScriptedModel, ToolSpec
from agentbox.store.baselines import BaselineStore
from agentbox.store.db import Database
from agentbox.store.sessions import SessionStore, Turn
from agentbox.tools.toolsets import toolset

#: Characters of each user message and reply written (a short exchange).
MESSAGE_CHARS = 400
#: Sessions at least this long are also compacted (keeping ~2 000 tokens), then timed again.
COMPACT_FROM = 200


@dataclass(frozen=True)
class Counts:
    sizes: tuple[int, ...] = (20, 200, 2000)
    """Messages in each session's transcript before the timed turn."""
    calls: int = 50
    warmup: int = 5


QUICK = Counts(sizes=(10, COMPACT_FROM), calls=3, warmup=1)


async def grow(store: SessionStore, messages: int) -> str:
    """A machine-less scripted session with `messages` recorded messages (half user, half replies)."""
    session, _ = await store.create_session("scripted", permission_mode="full-auto", machine="none")
    for i in range(messages // 2):
        turn = (await store.submit(session.id, f"question {i} " + "q" * MESSAGE_CHARS)).turn
        await store.start_turn(turn.id)
        reply = await store.open_reply(turn.id)
        content = {"text": f"answer {i} " + "a" * MESSAGE_CHARS, "tool_calls": [],
                   "usage": {"input_tokens": 100 * i, "output_tokens": 100}}  # fmt: skip
        await store.close_reply(reply, "complete", content, [])
        await store.finish(turn.id, "completed", {"stop_reason": "end_turn"})
    return session.id


async def timed(call: Any, count: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


def context(store: SessionStore, turn: Turn, specs: list[ToolSpec], script: list[Any]) -> TurnContext:
    async def surroundings() -> Surroundings:
        return Surroundings("Be brief.", "full-auto", None, tools=specs)

    return TurnContext(
        store, BaselineStore(store.db), EventBus(store), turn, ScriptedModel(script), surroundings,
        limits=ModelLimits(10_000_000), compaction=CompactionConfig(keep_recent_tokens=2000),
    )  # fmt: skip


async def measure(store: SessionStore, size: int, counts: Counts, specs: list[ToolSpec]) -> list[Figure]:
    session_id = await grow(store, size)
    turn = (await store.submit(session_id, "the timed turn")).turn
    turn, _ = await store.start_turn(turn.id)
    summaries = [{"text": "## Goal\nKeep going."}] * (size + 1)  # the scripted model answers by call index
    view = context(store, turn, specs, summaries)
    await view.begin()  # the first baseline
    raw = await timed(lambda: store.transcript(session_id, through=turn), counts.calls, counts.warmup)
    request = await timed(lambda: view.request(specs), counts.calls, counts.warmup)

    raw_median = statistics.median(raw)
    figures = [
        latency_figure(f"transcript_{size}", f"store.transcript(), {size} messages (raw)", raw),
        latency_figure(
            f"context_request_{size}", f"TurnContext.request(), {size} messages", request,
            raw_label="store.transcript()", raw_seconds=raw_median,
        ),
    ]  # fmt: skip
    if size < COMPACT_FROM:
        return figures
    compacted: list[bool] = []

    async def compact() -> None:
        compacted.append(await view.compact("bench", await view.view()))

    compaction = await timed(compact, 1, 0)
    after = await timed(lambda: view.request(specs), counts.calls, counts.warmup)
    return [
        *figures,
        latency_figure(
            f"compaction_{size}", f"one compaction of {size} messages (scripted summary)", compaction,
            raw_label="store.transcript()", raw_seconds=raw_median, extra={"compacted": compacted == [True]},
        ),
        latency_figure(
            f"context_request_{size}_compacted", f"TurnContext.request() after it ({size} recorded)", after,
            raw_label="store.transcript()", raw_seconds=raw_median,
        ),
    ]  # fmt: skip


async def run(counts: Counts, home: Path) -> tuple[list[Figure], dict[str, Any]]:
    specs = [ToolSpec(t.name, t.description, t.schema()) for t in toolset("default").values()]
    figures: list[Figure] = []
    async with Database.in_home(home) as db:
        store = SessionStore(db)
        for size in counts.sizes:
            figures += await measure(store, size, counts, specs)
    return figures, {"counts": {"sizes": list(counts.sizes), "calls": counts.calls}}


def parse(argv: list[str]) -> argparse.Namespace:
    return arg_parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("runtime") as tmp:
        figures, details = asyncio.run(run(counts, tmp / "home"))
    print(table(figures))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_runtime", args.quick, figures, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
