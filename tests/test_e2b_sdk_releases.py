"""Each pinned release of the stock `e2b` SDK drives a real `agentbox serve` through one session.

The suite's own venv has the current release (`tests/test_e2b.py` drives it in process). An
older release that still uses the v1 control-plane routes (`POST /sandboxes`, `/connect`)
lives in a venv of its own that `scripts/test.sh` makes (`OLD_SDK_VENV`), since two releases
of one package cannot share an interpreter. Both run `tests/e2b_sdk_scenario.py`, a user's
session as a script, and report what each step saw.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.machines.images import Image
from tests.conftest import Server, kernel_machine_env, start_server, stop_server, traversable

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "tests" / "e2b_sdk_scenario.py"
#: The older release, with the code interpreter SDK release of its line, and where
#: `scripts/test.sh` installs them (AGENTBOX_E2B_OLD_SDK_PYTHON names another interpreter).
OLD_SDK_VERSION = "2.45.1"
OLD_CODE_SDK_VERSION = "2.10.0"
OLD_SDK_VENV = REPO / ".venv-e2b-old"
#: Releases before 2.63 check the key's shape before sending it: `e2b_` and 40 hex digits.
API_KEY = "e2b_" + "0123456789abcdef" * 2 + "01234567"
#: Seconds one scenario may take (two sandboxes, a pause and a resume).
SCENARIO_TIMEOUT = 240


def old_sdk_python() -> str:
    named = os.environ.get("AGENTBOX_E2B_OLD_SDK_PYTHON")
    path = Path(named) if named else OLD_SDK_VENV / "bin" / "python"
    if not path.exists():
        raise AssertionError(
            f"no interpreter with e2b {OLD_SDK_VERSION} at {path}: scripts/test.sh makes it (python -m "
            f"venv {OLD_SDK_VENV} && {OLD_SDK_VENV}/bin/pip install e2b=={OLD_SDK_VERSION} "
            f"e2b-code-interpreter=={OLD_CODE_SDK_VERSION})"
        )
    return str(path)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, kernel_image: Image) -> Iterator[Server]:
    """A server with an API key whose default machine's image has a Jupyter kernel."""
    home = traversable(tmp_path_factory.mktemp("e2b-releases"), tmp_path_factory) / "home"
    home.mkdir()
    env = {"AGENTBOX_API_KEY": API_KEY, **kernel_machine_env(home, kernel_image)}
    server = start_server(home, env=env, args=["--log-level", "info"])
    yield server
    stop_server(server)


def run_scenario(python: str, server: Server, tag: str) -> dict[str, object]:
    env = {
        **os.environ,
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_API_KEY": API_KEY,
        "PYTHONPATH": "",
    }
    env.pop("E2B_DEBUG", None)
    done = subprocess.run(
        [python, str(SCENARIO), tag], env=env, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT
    )
    assert done.returncode == 0, f"the scenario failed:\n{done.stderr[-4000:]}"
    report: dict[str, object] = json.loads(done.stdout)
    return report


def control_routes(server: Server, since: int) -> set[str]:
    """The control-plane routes in the server's access log (at info) after byte `since` (method and path,
    ids as `{id}`)."""
    assert server.log is not None
    with server.log.open("rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    routes = set()
    for line in text.splitlines():
        for method in ("POST", "GET", "DELETE"):
            marker = f"{method} /"
            if marker in line and "sandboxes" in line:
                path = line.split(marker, 1)[1].split()[0].split("?")[0]
                routes.add(f"{method} /" + "/".join("{id}" if len(p) > 20 else p for p in path.split("/")))
    return routes


def log_size(server: Server) -> int:
    assert server.log is not None
    return server.log.stat().st_size


@pytest.mark.parametrize("release", ["current", "old"])
def test_a_whole_session_with_each_pinned_release(release: str, keyed_server: Server) -> None:
    current = (importlib.metadata.version("e2b"), importlib.metadata.version("e2b-code-interpreter"))
    old = (OLD_SDK_VERSION, OLD_CODE_SDK_VERSION)
    python, expected = (sys.executable, current) if release == "current" else (old_sdk_python(), old)
    tag = f"{release}-{uuid.uuid4().hex[:8]}"
    report = run_scenario(python, keyed_server, tag)
    assert (report["version"], report["code_version"]) == expected
    assert report["code"] == {"answer": "42", "error": ["ZeroDivisionError", True]}
    sync = report["sync"]
    assert isinstance(sync, dict)
    assert sync["commands"] == {
        "run": ["hi\n", "oops\n", 0],
        "failed": {"exit_code": 3, "stderr": "bad\n"},
        "background": {"listed": True, "killed": True, "exit_code": 137},
        "stdin_via_connect": "got:ping\n",
        "metrics": [True],  # the newest sample, in the shape this release's model reads
    }
    assert sync["files"] == {
        "listing": ["b.txt"],
        "read": "alpha",
        "exists_after_rename": False,
        "exists_after_remove": False,
        "watched": ["seen.txt"],
        "signed_upload": 200,
        "signed_download": [200, "uploaded"],
    }
    assert sync["listed"] == [True]
    assert (sync["paused"], sync["after_resume"], sync["killed"], sync["listed_after_kill"]) == (
        True,
        "kept",
        True,
        0,
    )
    assert report["async"] == {"run": "async hi\n", "read": "from async", "killed": True}


def test_the_old_release_speaks_the_v1_routes(keyed_server: Server) -> None:
    """What makes the old release worth its venv: it creates and connects on the v1 paths."""
    since = log_size(keyed_server)
    run_scenario(old_sdk_python(), keyed_server, f"routes-{uuid.uuid4().hex[:8]}")
    routes = control_routes(keyed_server, since)
    assert {"POST /sandboxes", "POST /sandboxes/{id}/connect"} <= routes, sorted(routes)
    assert "POST /v2/sandboxes" not in routes, sorted(routes)
