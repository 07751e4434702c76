"""`/metrics`: the server's counters in the Prometheus text format.

Each app has its own `CollectorRegistry` (never prometheus_client's module-global one: a test
process runs several apps). What is counted, and where:

    agentbox_http_requests_total{method,route,status}   every request (`observe.Finished`);
    agentbox_http_request_duration_seconds{method,route} route = the matched path template,
                                                         `unmatched` otherwise (bounded labels)
    agentbox_errors_total{error_type}                    failure envelopes sent (`note_error`)
    agentbox_commands_started_total                      commands a machine's CommandManager
                                                         launched (HTTP, MCP, agent tools alike)
    agentbox_events_published_total{type}                session events the event bus published
    agentbox_turns_total{outcome}                        turns ended: completed, failed, aborted
    agentbox_model_calls_total{provider,outcome}         model calls ended (each retry is one):
                                                         outcome `ok`, `cancelled` or the error's
                                                         `error_type` (`Worker.on_model_call`)
    agentbox_model_tokens_total{direction}               tokens the replies report, `input` and
                                                         `output`
    agentbox_live_machines{machine}                      machines running now, read at scrape
                                                         time from the registry
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentbox.agent.events import Event
from agentbox.agent.models import ModelCall
from agentbox.api.observe import Finished
from agentbox.system import System

#: Event types that end a turn, and the outcome label each counts under.
TURN_OUTCOMES = {"turn.completed": "completed", "turn.failed": "failed", "turn.aborted": "aborted"}
#: Latency buckets (seconds): most routes answer in milliseconds, commands in sync mode may take long.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self.errors = Counter(
            "agentbox_errors", "Failure envelopes sent.", ["error_type"], registry=self.registry
        )
        self.commands = Counter("agentbox_commands_started", "Commands launched.", registry=self.registry)
        self.events = Counter(
            "agentbox_events_published", "Session events published.", ["type"], registry=self.registry
        )
        self.turns = Counter(
            "agentbox_turns", "Turns ended, by outcome.", ["outcome"], registry=self.registry
        )
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
        self.latency.labels(request.method, request.route).observe(request.seconds)
        if request.error_type is not None:
            self.errors.labels(request.error_type).inc()

    def command_started(self) -> None:
        self.commands.inc()

    def published(self, events: Sequence[Event]) -> None:
        for event in events:
            self.events.labels(event.type).inc()
            outcome = TURN_OUTCOMES.get(event.type)
            if outcome is not None:
                self.turns.labels(outcome).inc()

    def model_called(self, call: ModelCall) -> None:
        self.model_calls.labels(call.provider, call.outcome).inc()
        self.model_tokens.labels("input").inc(call.usage.input_tokens)
        self.model_tokens.labels("output").inc(call.usage.output_tokens)

    def wire(self, system: System) -> None:
        """Hook the counters into a system that just opened."""
        system.services.on_command.append(self.command_started)
        system.bus.listeners.append(self.published)
        system.worker.on_model_call.append(self.model_called)
