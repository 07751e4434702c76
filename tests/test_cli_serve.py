"""`agentbox serve` refuses to expose an unauthenticated API beyond loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentbox.cli import SHUTDOWN_GRACE_SECONDS, bind_refusal, is_loopback
from tests.conftest import start_server, stop_server

#: Seconds a stopping server may take past the grace: closing the sandboxes it ran.
STOP_SLACK_SECONDS = 8


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.1.2.3", True), ("0.0.0.0", False),
     ("192.0.2.10", False), ("example.org", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def serve(tmp_path: Path, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AGENTBOX_API_KEY"}
    env["AGENTBOX_HOME"] = str(tmp_path / "home")
    if key:
        env["AGENTBOX_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "agentbox", "serve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_non_loopback_without_key_is_refused(tmp_path: Path) -> None:
    result = serve(tmp_path, "--host", "0.0.0.0", "--port", "1")
    assert result.returncode == 2
    assert "refusing to bind 0.0.0.0 without an API key" in result.stderr


@pytest.mark.parametrize(
    ("host", "keyed", "insecure", "refused"),
    [("0.0.0.0", False, False, True), ("0.0.0.0", True, False, False), ("0.0.0.0", False, True, False),
     ("127.0.0.1", False, False, False)],
)  # fmt: skip
def test_a_key_or_insecure_lifts_the_refusal(host: str, keyed: bool, insecure: bool, refused: bool) -> None:
    assert (bind_refusal(host, keyed, insecure) is not None) is refused


def test_sigterm_with_an_open_event_stream_stops_the_server_within_the_grace(sandbox_tmp: Path) -> None:
    """An event stream never ends by itself: the graceful stop must not wait on it forever, or
    a supervisor's SIGKILL comes first and the sandboxes are left to the next start."""
    home = sandbox_tmp / "home"
    home.mkdir()
    server = start_server(home)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            script = [{"tool_calls": [{"name": "bash", "input": {"command": "true"}}]}, {"text": "done"}]
            body = {"model": "scripted", "script": script, "permission_mode": "full-ask"}
            sid = http.post("/v1/sessions", json=body).json()["id"]
            assert http.post(f"/v1/sessions/{sid}/messages", json={"content": "go"}).status_code == 202
            with http.stream("GET", f"/v1/sessions/{sid}/events/stream") as stream:
                lines = stream.iter_lines()
                while "approval.requested" not in next(lines):
                    pass  # the turn waits on its approval: the stream stays open
                began = time.monotonic()
                server.process.send_signal(signal.SIGTERM)
                code = server.process.wait(SHUTDOWN_GRACE_SECONDS + STOP_SLACK_SECONDS)
        took = time.monotonic() - began
        assert code == -signal.SIGTERM, code  # uvicorn re-raises the signal once it has stopped
        assert took < SHUTDOWN_GRACE_SECONDS, took  # the stream was ended, not waited out
        assert server.log is not None
        log = server.log.read_text()
        assert "Traceback" not in log and "graceful shutdown exceeded" not in log, log
    finally:
        if server.process.poll() is None:
            stop_server(server)


def test_a_busy_port_is_one_clear_failure_and_no_serving_banner(sandbox_tmp: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(sandbox_tmp, "--port", str(port))
    assert result.returncode == 3, result.stderr
    assert "serving on" not in result.stderr  # it never served
    assert (
        "address already in use" in result.stderr and f"could not start on 127.0.0.1:{port}" in result.stderr
    )
