"""`agentbox serve` refuses to expose an unauthenticated API beyond loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.cli import bind_refusal, is_loopback


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
    ("host", "key", "insecure", "refused"),
    [("0.0.0.0", None, False, True), ("0.0.0.0", "k", False, False), ("0.0.0.0", None, True, False),
     ("127.0.0.1", None, False, False)],
)  # fmt: skip
def test_a_key_or_insecure_lifts_the_refusal(
    host: str, key: str | None, insecure: bool, refused: bool
) -> None:
    assert (bind_refusal(host, key, insecure) is not None) is refused
