"""A server stopped the way a supervisor stops it leaves nothing running or mounted.

SIGTERM then SIGKILL shortly after gives the server no time to tear its sandboxes down.
Everything a sandbox runs (bwrap, the exec agent, fuse-overlayfs, slirp4netns) must die
with the server, its fuse mounts must go with their daemons, and what a crash still
leaves (empty mount directories, cgroups, run directories, a stale mount whose owner
pid was reused) is cleaned when a server next starts, on this home or another.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agentbox.machines.sandbox import OWNER_FILE, process_tree
from tests.conftest import SANDBOX_DEADLINE, Server, start_server, stop_server

#: Seconds between the supervisor's SIGTERM and its SIGKILL.
KILL_AFTER_SECONDS = 0.2


def gone(leftovers: Callable[[], list[str]], what: str) -> None:
    """Poll until `leftovers` is empty; fail with what is left after SANDBOX_DEADLINE."""
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while left := leftovers():
        if time.monotonic() > deadline:
            raise AssertionError(f"still there after {SANDBOX_DEADLINE} s: {what}: {left}")
        time.sleep(0.05)


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def mounts_under(root: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


def open_session(server: Server) -> str:
    session = f"t-{uuid.uuid4().hex[:12]}"
    with server.client() as http:
        reply = http.post(f"/sandboxes/{session}/v2/commands", json={"command": "true"}).json()
    assert reply["success"] and reply["data"]["exit_code"] == 0, reply
    return session


@pytest.fixture
def runtime(sandbox_tmp: Path) -> Path:
    """A runtime directory of this test alone, so other servers' sandboxes do not count."""
    d = sandbox_tmp / "runtime"
    d.mkdir()
    return d


@pytest.fixture
def serve(runtime: Path) -> Iterator[Callable[[Path], Server]]:
    started: list[Server] = []

    def serve(home: Path) -> Server:
        home.mkdir(exist_ok=True)
        s = start_server(home, env={"AGENTBOX_RUNTIME_DIR": str(runtime)})
        started.append(s)
        return s

    yield serve
    for s in started:
        if s.process.poll() is None:
            stop_server(s)


def supervisor_stop(server: Server, term: bool) -> None:
    """SIGTERM, then SIGKILL after KILL_AFTER_SECONDS; or SIGKILL alone (a crash, the OOM killer)."""
    if term:
        server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(KILL_AFTER_SECONDS if term else 0)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def cgroups_of(pid: int) -> set[Path]:
    found = set()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "/agentbox/" in path:
            sub = controllers.split(",")[0] if controllers else ""
            found.add(Path("/sys/fs/cgroup", sub.removeprefix("name="), path.lstrip("/")))
    return found


if os.geteuid() != 0:  # the system layer and cgroups need a root server
    pytestmark = pytest.mark.skip(reason="a root server is needed for fuse-overlayfs and cgroups")


@pytest.mark.parametrize("term", [True, False], ids=["term-then-kill", "kill"])
def test_a_killed_server_leaves_no_process_or_mount(
    serve: Callable[[Path], Server], sandbox_tmp: Path, runtime: Path, term: bool
) -> None:
    home = sandbox_tmp / "home"
    server = serve(home)
    sessions = [open_session(server), open_session(server)]
    tree = [p for p in process_tree(server.process.pid) if p != server.process.pid]
    kinds = {comm(p) for p in tree}
    assert {"fuse-overlayfs", "slirp4netns", "bwrap"} <= kinds, kinds  # the system layer and network are on
    alive = {p: start_time(p) for p in tree}
    groups = set().union(*(cgroups_of(p) for p in tree if comm(p) == "bwrap"))
    assert groups, "sandboxes run in cgroups on this host"
    assert len(mounts_under(runtime)) == 8  # /usr, the base, /tmp and $HOME, for each sandbox

    supervisor_stop(server, term)

    def survivors() -> list[str]:
        return [f"{p} {comm(p)}" for p, t in alive.items() if start_time(p) == t]

    gone(survivors, "processes of the killed server")
    gone(lambda: mounts_under(runtime), "mounts of the killed server")

    again = serve(home)
    open_session(again)  # the first sandbox of the new server is up: any clean-up has run
    for session in sessions:
        assert not (home / "sessions" / session / "run").exists() or not any(
            (home / "sessions" / session / "run").iterdir()
        ), f"run dir of {session} left"
    assert [d.name for d in (runtime / "mnt").iterdir() if any(s in d.name for s in sessions)] == []
    assert not [g for g in groups if g.exists()], "cgroups of the killed server left"
    stop_server(again)
    gone(lambda: mounts_under(runtime), "mounts of the stopped server")
    gone(lambda: list((runtime / "mnt").iterdir()), "layer directories of the stopped server")


def test_a_stale_layer_is_released_by_a_server_of_another_home(
    serve: Callable[[Path], Server], sandbox_tmp: Path, runtime: Path
) -> None:
    """A fuse mount whose owner is gone or whose owner pid now names another process; an
    emptied directory without its owner file; one of a start cut short."""
    (runtime / "mnt").mkdir(mode=0o711)
    stale = []
    for name, owner in (("gone", "999999999"), ("reused", f"{os.getpid()}-1")):
        d = runtime / "mnt" / f"sbx_{name}"
        (d / "usr").mkdir(parents=True)
        (d / OWNER_FILE).write_text(owner)
        layer = sandbox_tmp / f"layer-{name}"
        for sub in ("upper", "work"):
            (layer / sub).mkdir(parents=True)
        subprocess.run(
            [
                "fuse-overlayfs",
                "-o",
                f"lowerdir=/usr,upperdir={layer}/upper,workdir={layer}/work",
                str(d / "usr"),
            ],
            check=True,
        )
        stale.append(d)
    # A teardown cut short between removing the owner file and the directory.
    ownerless = runtime / "mnt" / "sbx_ownerless"
    (ownerless / "tmp").mkdir(parents=True)
    stale.append(ownerless)
    # A start cut short before its directory was renamed into place.
    unborn = runtime / "mnt" / ".sbx_unborn.new"
    (unborn / "home").mkdir(parents=True)
    (unborn / OWNER_FILE).write_text("999999999")
    stale.append(unborn)
    assert len(mounts_under(runtime)) == 2
    try:
        server = serve(sandbox_tmp / "other-home")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
        gone(lambda: mounts_under(runtime), "stale layers after a new server started")
        assert not [d for d in stale if d.exists()]
    finally:
        for point in mounts_under(runtime):
            subprocess.run(["umount", "-l", point], check=False)
