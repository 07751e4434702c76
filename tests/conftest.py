"""Shared fixtures: a real `agentbox serve` on a loopback port, with its own home."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

#: Seconds a freshly started server may take to answer /health.
SERVER_START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    home: Path
    process: subprocess.Popen[bytes]
    api_key: str | None = None

    def client(self, **kwargs: object) -> httpx.Client:
        headers = {"X-AIO-API-Key": self.api_key} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]


def start_server(home: Path, env: dict[str, str] | None = None, port: int | None = None) -> Server:
    port = port or free_port()
    full_env = {**os.environ, "AGENTBOX_HOME": str(home), **(env or {})}
    log = open(home.parent / f"server-{port}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "serve", "--port", str(port)],
        env=full_env,
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Server(url, home, proc, (env or {}).get("AGENTBOX_API_KEY"))
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the whole test session (sandboxes are per test via session ids)."""
    home = tmp_path_factory.mktemp("srv") / "home"
    home.mkdir()
    s = start_server(home)
    yield s
    stop_server(s)
