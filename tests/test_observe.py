"""Request ids, the access log and `/metrics` over a real server with real sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets.sync.client as ws_client
from conftest import Server, start_server, stop_server, traversable
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket
from websockets.exceptions import InvalidStatus

from agentbox.api.metrics import MAX_OPEN_TURNS, Metrics
from agentbox.api.observe import MAX_REQUEST_ID, WEBSOCKET_ACCEPTED, Finished, RequestIdMiddleware
from agentbox.store.sessions import Event

KEY = "observe-test-key"
SECRET = "s3cr3t-never-logged"
#: Seconds to wait for a turn to end or a log line to be written.
DEADLINE = 20.0
#: How `agentbox serve` announces itself on stderr (not a log line).
BANNER = "agentbox serving on "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("observe"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(
        home, env={"AGENTBOX_API_KEY": KEY}, args=["--log-format", "json", "--log-level", "info"]
    )
    yield s
    stop_server(s)


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def samples(client: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return got.get((name, frozenset(labels.items())), 0.0)


def log_lines(path: Path) -> list[dict[str, object]]:
    """The server log's JSON lines (uvicorn and agentbox alike); any other line fails the test,
    except the banner `serve` prints before logging starts."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines if not line.startswith(BANNER)]


def wait_for_line(path: Path, request_id: str) -> dict[str, object]:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        for line in log_lines(path):
            if line.get("logger") == "agentbox.access" and line.get("request_id") == request_id:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


def test_every_response_has_a_request_id_and_a_sane_one_is_echoed(client: httpx.Client) -> None:
    fresh = {client.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(fresh) == 3 and all(i.startswith("req_") for i in fresh)
    assert (
        client.get("/health", headers={"X-Request-ID": "trace-1.a:b"}).headers["x-request-id"]
        == "trace-1.a:b"
    )
    for bad in ("x" * (MAX_REQUEST_ID + 1), "has space", 'quote"d', ""):
        got = client.get("/health", headers={"X-Request-ID": bad}).headers["x-request-id"]
        assert got != bad and got.startswith("req_")
    unauthorized = httpx.get(f"{client.base_url}/v2/sandbox")  # no key
    assert unauthorized.status_code == 401
    assert unauthorized.json()["request_id"] == unauthorized.headers["x-request-id"]
    missing = client.get("/v2/fs/download", params={"path": "/tmp/nowhere/at/all"})
    assert missing.status_code == 404 and missing.json()["success"] is False
    assert missing.json()["request_id"] == missing.headers["x-request-id"]
    bad_body = client.post(
        "/v2/commands", json={"command": "true", "mode": "later"}, headers={"X-Request-ID": "mine"}
    )
    assert bad_body.status_code == 422 and bad_body.json()["request_id"] == "mine"
    refused = client.get("/health", headers={"Host": "evil.example"})  # the guard's 403 has one too
    assert refused.status_code == 403 and refused.json()["request_id"] == refused.headers["x-request-id"]


def test_the_access_line_redacts_secrets_and_the_log_is_json(server: Server, client: httpx.Client) -> None:
    assert server.log is not None
    r = httpx.get(f"{server.url}/health", params={"api_key": SECRET, "token": SECRET, "n": "1"})
    line = wait_for_line(server.log, r.headers["x-request-id"])
    assert line["level"] == "info" and line["method"] == "GET" and line["status"] == 200
    assert line["path"] == "/health?api_key=[redacted]&token=[redacted]&n=1"
    assert isinstance(line["duration_ms"], float) and "ts" in line
    keyed = client.get("/v2/sandbox", headers={"X-Request-ID": "keyed"})
    assert keyed.status_code == 200
    wait_for_line(server.log, "keyed")
    text = server.log.read_text()
    assert SECRET not in text and KEY not in text  # neither query values nor headers


def test_metrics_count_requests_commands_machines_and_turns(client: httpx.Client) -> None:
    before = samples(client)
    sid = "observe-cmd"
    run = client.post(f"/sandboxes/{sid}/v2/commands", json={"command": "echo hi"})
    assert run.status_code == 200 and run.json()["data"]["stdout"] == "hi\n", run.text
    client.get("/v2/fs/download", params={"path": "/tmp/nowhere/at/all"})
    after = samples(client)
    route = "/sandboxes/{session_id}/v2/commands"
    assert value(after, "agentbox_http_requests_total", method="POST", route=route, status="200") == (
        value(before, "agentbox_http_requests_total", method="POST", route=route, status="200") + 1
    )
    assert value(after, "agentbox_http_request_duration_seconds_count", method="POST", route=route) >= 1
    assert (
        value(after, "agentbox_commands_started_total")
        >= value(before, "agentbox_commands_started_total") + 1
    )
    assert value(after, "agentbox_live_machines", machine="sandbox") >= 1
    assert value(after, "agentbox_errors_total", error_type="not_found") == (
        value(before, "agentbox_errors_total", error_type="not_found") + 1
    )

    turns = value(after, "agentbox_turns_total", outcome="completed")
    created = client.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "Done."}]})
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    posted = client.post(f"/v1/sessions/{session}/messages", json={"content": "go"})
    assert posted.status_code == 202, posted.text
    deadline = time.monotonic() + DEADLINE
    while value(samples(client), "agentbox_turns_total", outcome="completed") < turns + 1:
        assert time.monotonic() < deadline, "the turn was never counted"
        time.sleep(0.05)
    final = samples(client)
    assert value(final, "agentbox_events_published_total", type="turn.completed") >= 1
    assert value(final, "agentbox_turn_duration_seconds_count", outcome="completed") >= (
        value(before, "agentbox_turn_duration_seconds_count", outcome="completed") + 1
    )
    assert value(after, "agentbox_command_duration_seconds_count", status="completed") >= (
        value(before, "agentbox_command_duration_seconds_count", status="completed") + 1
    )
    assert value(after, "agentbox_command_duration_seconds_sum", status="completed") > value(
        before, "agentbox_command_duration_seconds_sum", status="completed"
    )
    messages = "/v1/sessions/{session_id}/messages"  # a root route with the same parameter name
    assert value(final, "agentbox_http_requests_total", method="POST", route=messages, status="202") >= 1


def test_live_machines_gauge_is_one_for_a_fresh_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    home = traversable(tmp_path_factory.mktemp("gauge"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(home)
    try:
        with s.client() as c:
            assert value(samples(c), "agentbox_live_machines", machine="sandbox") == 0
            assert c.post("/sandboxes/one/v2/commands", json={"command": "true"}).status_code == 200
            assert value(samples(c), "agentbox_live_machines", machine="sandbox") == 1
    finally:
        stop_server(s)


def test_metrics_need_the_key_and_ready_does_not(server: Server) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_a_sandbox_that_fails_to_start_is_logged_with_its_request(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    home = traversable(tmp_path_factory.mktemp("broken"), tmp_path_factory) / "home"
    home.mkdir()
    config = home.parent / "agentbox.toml"
    config.write_text('[machines.sandbox]\nkind = "sandbox"\nimage = "nosuchimage"\n')
    s = start_server(home, env={"AGENTBOX_CONFIG": str(config)})  # text lines, warning level
    try:
        with s.client() as c:
            r = c.post("/sandboxes/broken/v2/commands", json={"command": "true"})
        assert r.status_code == 503 and r.json()["data"]["error_type"] == "machine_unavailable"
        assert s.log is not None
        deadline = time.monotonic() + DEADLINE
        wanted = "machine sandbox of session broken failed to start"
        while not [line for line in s.log.read_text().splitlines() if wanted in line]:
            assert time.monotonic() < deadline, s.log.read_text()
            time.sleep(0.05)
        (line,) = [line for line in s.log.read_text().splitlines() if wanted in line]
        assert " WARNING agentbox.machines.registry " in line and f"[{r.headers['x-request-id']}]" in line
        assert "nosuchimage" in line
        assert "agentbox.access" not in s.log.read_text()  # access lines are info, below warning
    finally:
        stop_server(s)


def test_serve_refuses_an_unknown_log_format(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agentbox", "serve", "--log-format", "xml"],
        env={**os.environ, "AGENTBOX_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 2 and "log format must be one of text, json" in done.stderr


def wait_turns(client: httpx.Client, outcome: str, count: float) -> None:
    deadline = time.monotonic() + DEADLINE
    while value(samples(client), "agentbox_turns_total", outcome=outcome) < count:
        assert time.monotonic() < deadline, f"no {outcome} turn was counted"
        time.sleep(0.05)


def test_model_calls_and_tokens_are_counted_by_provider_and_outcome(client: httpx.Client) -> None:
    before = samples(client)
    script = [{"error": "overloaded"}, {"text": "Done.", "usage": {"input_tokens": 7, "output_tokens": 5}}]
    created = client.post("/v1/sessions", json={"model": "scripted", "script": script})
    assert created.status_code == 201, created.text
    posted = client.post(f"/v1/sessions/{created.json()['id']}/messages", json={"content": "go"})
    assert posted.status_code == 202, posted.text
    wait_turns(client, "completed", value(before, "agentbox_turns_total", outcome="completed") + 1)
    after = samples(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("agentbox_model_calls_total", provider="scripted", outcome="ok") == 1
    assert moved("agentbox_model_calls_total", provider="scripted", outcome="model_unavailable") == 1
    assert moved("agentbox_model_tokens_total", direction="input") == 7
    assert moved("agentbox_model_tokens_total", direction="output") == 5


def test_a_websocket_gets_a_request_id_and_an_access_line(server: Server, client: httpx.Client) -> None:
    assert server.log is not None and server.api_key is not None
    url = server.url.replace("http://", "ws://") + "/v1/nowhere?token=" + SECRET
    headers = {"X-Request-ID": "ws-refused", "X-AIO-API-Key": server.api_key}
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(url, additional_headers=headers, open_timeout=DEADLINE).close()
    assert refused.value.response.status_code == 403
    line = wait_for_line(server.log, "ws-refused")
    assert (line["method"], line["status"]) == ("WS", 403)
    assert line["path"] == "/v1/nowhere?token=[redacted]"
    assert (
        value(samples(client), "agentbox_http_requests_total", method="WS", route="unmatched", status="403")
        >= 1
    )


def test_an_accepted_websocket_carries_its_id_and_is_reported_when_it_ends() -> None:
    """The middleware over a real Starlette app with a WebSocket route (agentbox serves none yet)."""

    async def echo(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text(await socket.receive_text())
        await socket.close()

    finished: list[Finished] = []
    app = RequestIdMiddleware(Starlette(routes=[WebSocketRoute("/echo", echo)]), on_finished=finished.append)
    with TestClient(app) as test, test.websocket_connect("/echo", headers={"X-Request-ID": "ws-1"}) as socket:
        socket.send_text("hi")
        assert socket.receive_text() == "hi"
        assert (b"x-request-id", b"ws-1") in (socket.extra_headers or [])
    assert [(f.method, f.route, f.status) for f in finished] == [("WS", "/echo", WEBSOCKET_ACCEPTED)]


def test_event_streams_are_timed_apart_from_request_latency(client: httpx.Client) -> None:
    """A stream is open for as long as its client listens: its duration is no latency."""
    session = client.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "Done."}]}).json()[
        "id"
    ]
    before = samples(client)
    with client.stream("GET", f"/v1/sessions/{session}/events/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
    client.get(f"/v1/sessions/{session}/events")
    route = "/v1/sessions/{session_id}/events/stream"
    deadline = time.monotonic() + DEADLINE
    while value(samples(client), "agentbox_http_stream_duration_seconds_count", method="GET", route=route) < (
        value(before, "agentbox_http_stream_duration_seconds_count", method="GET", route=route) + 1
    ):
        assert time.monotonic() < deadline, "the stream was never timed"
        time.sleep(0.05)
    after = samples(client)
    latency = "agentbox_http_request_duration_seconds_count"
    assert value(after, latency, method="GET", route=route) == value(
        before, latency, method="GET", route=route
    )
    listed = "/v1/sessions/{session_id}/events"
    assert (
        value(after, latency, method="GET", route=listed)
        == value(before, latency, method="GET", route=listed) + 1
    )


def test_open_turns_are_remembered_up_to_the_limit_and_a_retry_keeps_its_first_start() -> None:
    metrics = Metrics(lambda: None)

    def event(kind: str, turn: str) -> Event:
        return Event(f"evt_{turn}_{kind}", "ses_m", 1, kind, turn, {}, "2026-12-01T00:00:00.000Z")

    metrics.published([event("turn.started", f"trn_{i}") for i in range(MAX_OPEN_TURNS + 1)])
    metrics.published([event("turn.started", "trn_1")])  # a retry: not a new start, not a new entry
    metrics.published([event("turn.completed", "trn_0"), event("turn.completed", "trn_1")])
    got = {
        (s.name, s.labels.get("outcome")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert got[("agentbox_turns_total", "completed")] == 2
    # trn_0 was the one past the limit: forgotten, so only trn_1's duration is observed
    assert got[("agentbox_turn_duration_seconds_count", "completed")] == 1
