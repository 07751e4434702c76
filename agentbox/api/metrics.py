"""`/metrics`: the server's counters in the Prometheus text format.

Each app has its own `CollectorRegistry` (never prometheus_client's module-global one: a test
process runs several apps). What is counted, and where:

    agentbox_http_requests_total{method,route,status}   every request (`observe.Finished`);
    agentbox_http_request_duration_seconds{method,route} route = the matched path template,
                                                         `unmatched` otherwise (bounded labels)
    agentbox_http_stream_duration_seconds{method,route}  event streams and WebSockets, kept out
                                                         of the latency above (open for hours)
    agentbox_errors_total{error_type}                    failure envelopes sent (`note_error`)
    agentbox_commands_started_total                      commands a machine's CommandManager
                                                         launched (HTTP, MCP, agent tools alike)
    agentbox_command_duration_seconds{status}            launch to end: completed, timed_out,
                                                         killed, failed
    agentbox_events_published_total{type}                session events the event bus published
    agentbox_turns_total{outcome}                        turns ended: completed, failed, aborted
    agentbox_turn_duration_seconds{outcome}              first `turn.started` to its end, for
                                                         turns this process saw start
    agentbox_model_calls_total{provider,outcome}         model calls ended (each retry is one):
                                                         outcome `ok`, `cancelled` or the error's
                                                         `error_type` (`Worker.on_model_call`)
    agentbox_model_tokens_total{direction}               tokens the replies report, `input` and
                                                         `output`
    agentbox_live_machines{machine}                      machines running now, read at scrape
                                                         time from the registry
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentbox.agent.events import Event
from agentbox.agent.models import ModelCall
from agentbox.api.observe import Finished
from agentbox.system import System
from agentbox.workspace.commands import Command

#: The event that starts (or restarts) a turn.
TURN_STARTED = "turn.started"
#: Event types that end a turn, and the outcome label each counts under.
TURN_OUTCOMES = {"turn.completed": "completed", "turn.failed": "failed", "turn.aborted": "aborted"}
#: Latency buckets (seconds): most routes answer in milliseconds, commands in sync mode may take long.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How long event streams and WebSockets stay open (seconds): a client listens for minutes or hours.
STREAM_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
#: Command and turn durations (seconds): from a `true` to a build or a long agent turn.
RUN_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)
#: Turns whose start was seen and whose end was not yet, remembered for their duration; past
#: it the oldest is forgotten (a turn ended by a crash never publishes its end).
MAX_OPEN_TURNS = 10_000


class LiveMachines(Collector):
    """The running machines by name, counted from the registry when scraped."""

    def __init__(self, system: Callable[[], System | None]) -> None:
        self.system = system

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("agentbox_live_machines", "Machines running now.", labels=["machine"])
        system = self.system()
        counts: dict[str, int] = {}
        if system is not None:
            for entry in system.registry.entries():
                if entry.state == "running":
                    counts[entry.config.name] = counts.get(entry.config.name, 0) + 1
        for name, count in sorted(counts.items()):
            gauge.add_metric([name], count)
        yield gauge


class Metrics:
    """The app's metrics and the hooks that move them."""

    def __init__(self, system: Callable[[], System | None]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "agentbox_http_requests",
            "HTTP requests served.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agentbox_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response.",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.streams = Histogram(
            "agentbox_http_stream_duration_seconds",
            "How long event streams and WebSockets stayed open (not in the request latency).",
            ["method", "route"],
            buckets=STREAM_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "agentbox_errors", "Failure envelopes sent.", ["error_type"], registry=self.registry
        )
        self.commands = Counter("agentbox_commands_started", "Commands launched.", registry=self.registry)
        self.command_seconds = Histogram(
            "agentbox_command_duration_seconds", "Commands from launch to end, by final status.",
            ["status"], buckets=RUN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.events = Counter(
            "agentbox_events_published", "Session events published.", ["type"], registry=self.registry
        )
        self.turns = Counter(
            "agentbox_turns", "Turns ended, by outcome.", ["outcome"], registry=self.registry
        )
        self.turn_seconds = Histogram(
            "agentbox_turn_duration_seconds", "Turns from start to end, by outcome.",
            ["outcome"], buckets=RUN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._turn_starts: dict[str, float] = {}
        self.model_calls = Counter(
            "agentbox_model_calls", "Model calls ended, by outcome.", ["provider", "outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.model_tokens = Counter(
            "agentbox_model_tokens", "Tokens model replies reported.", ["direction"], registry=self.registry
        )
        self.registry.register(LiveMachines(system))

    def finished(self, request: Finished) -> None:
        self.requests.labels(request.method, request.route, str(request.status)).inc()
        durations = self.streams if request.streamed else self.latency
        durations.labels(request.method, request.route).observe(request.seconds)
        if request.error_type is not None:
            self.errors.labels(request.error_type).inc()

    def command_started(self) -> None:
        self.commands.inc()

    def command_ended(self, command: Command) -> None:
        self.command_seconds.labels(command.status).observe(command.duration)

    def published(self, events: Sequence[Event]) -> None:
        for event in events:
            self.events.labels(event.type).inc()
            if event.type == TURN_STARTED and event.turn_id is not None:
                self._turn_started(event.turn_id)
            outcome = TURN_OUTCOMES.get(event.type)
            if outcome is not None:
                self.turns.labels(outcome).inc()
                began = self._turn_starts.pop(event.turn_id or "", None)
                if began is not None:
                    self.turn_seconds.labels(outcome).observe(time.monotonic() - began)

    def _turn_started(self, turn_id: str) -> None:
        """A retried turn starts again: its duration counts from its first start."""
        self._turn_starts.setdefault(turn_id, time.monotonic())
        while len(self._turn_starts) > MAX_OPEN_TURNS:
            del self._turn_starts[next(iter(self._turn_starts))]

    def model_called(self, call: ModelCall) -> None:
        self.model_calls.labels(call.provider, call.outcome).inc()
        self.model_tokens.labels("input").inc(call.usage.input_tokens)
        self.model_tokens.labels("output").inc(call.usage.output_tokens)

    def wire(self, system: System) -> None:
        """Hook the counters into a system that just opened."""
        system.services.on_command.append(self.command_started)
        system.services.on_command_end.append(self.command_ended)
        system.bus.listeners.append(self.published)
        system.worker.on_model_call.append(self.model_called)
