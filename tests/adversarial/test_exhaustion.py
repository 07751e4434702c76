"""Exhausting the host from inside a sandbox or through the API, against a real `agentbox serve`.

Each test starts its own server with small limits (a config file through AGENTBOX_CONFIG,
or env vars), so nothing takes long: a workspace budget of a few MiB, a cap of two live
sandboxes, a tree with more directories than one machine may watch.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.machines.base import ExecRequest
from agentbox.machines.disk import MIN_DISK_MB, image_of
from agentbox.machines.errors import CapacityExceeded, MachineUnavailable
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import SandboxMachine
from agentbox.workspace.watch import MAX_WATCHES_PER_MACHINE, WatchHub
from tests.conftest import RegistryFactory, Server, sandbox_settings, start_server, stop_server, traversable

#: Seconds any condition (a turn ending, a sandbox becoming idle) may take before a test fails.
DEADLINE = 30.0
#: The workspace budget the disk tests configure, in MiB.
BUDGET_MB = 64
#: What the host may hold for a session beyond its budget: the image's own metadata.
HOST_MARGIN = 4 * 1024 * 1024


def eventually(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while not (result := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return result


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = traversable(tmp_path_factory.mktemp("exhaust"), tmp_path_factory) / "home"
    home.mkdir()
    return home


def serve(home: Path, toml: str = "", **env: str) -> Server:
    config = home.parent / "agentbox.toml"
    config.write_text(toml)
    return start_server(home, {"AGENTBOX_CONFIG": str(config), "AGENTBOX_NETWORK": "off", **env})


@pytest.fixture
def running(home: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(toml: str = "", **env: str) -> Server:
        servers.append(serve(home, toml, **env))
        return servers[-1]

    yield start
    for s in servers:
        stop_server(s)


def run(client: httpx.Client, sid: str, command: str) -> httpx.Response:
    return client.post(f"/sandboxes/{sid}/v2/commands", json={"command": command, "timeout": 60})


def ok(response: httpx.Response) -> Any:
    reply = response.json()
    assert response.status_code == 200 and reply["success"], response.text
    return reply["data"]


def host_bytes(path: Path) -> int:
    """Bytes `path` takes on the host's file system, not counting other file systems below it."""
    out = subprocess.run(
        ["du", "-sx", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


# ---------------------------------------------------------------- the workspace's disk budget

DISK_TOML = f'[machines.sandbox]\nkind = "sandbox"\nnetwork = "off"\ndisk_mb = {BUDGET_MB}\n'


def test_writing_past_the_workspace_budget_fails_inside_and_stays_off_the_host(
    running: Callable[..., Server], home: Path
) -> None:
    server = running(DISK_TOML)
    sid = f"d-{uuid.uuid4().hex[:8]}"
    with server.client() as c:
        big = ok(run(c, sid, f"head -c {2 * BUDGET_MB}M /dev/zero > /workspace/big; echo rc=$?"))
        assert "rc=0" not in big["stdout"], big
        assert "No space left on device" in big["stderr"], big
        # the server's own writes into the workspace meet the same limit: a clear 507, not a 500
        full = c.post(
            f"/sandboxes/{sid}/v2/fs/write", json={"path": "/workspace/more", "content": "x" * 2**20}
        )
        assert full.status_code == 507 and full.json()["data"]["error_type"] == "no_space_left", full.text
        # /tmp and $HOME are not this budget's business; the workspace still answers
        assert (
            ok(run(c, sid, "rm /workspace/big && echo small > /workspace/ok && cat /workspace/ok"))["stdout"]
            == "small\n"
        )
    assert host_bytes(home / "sessions" / sid) <= BUDGET_MB * 2**20 + HOST_MARGIN


def test_the_workspace_survives_a_restart_and_nothing_stays_mounted(
    running: Callable[..., Server], home: Path
) -> None:
    sid = f"d-{uuid.uuid4().hex[:8]}"
    first = running(DISK_TOML)
    with first.client() as c:
        ok(run(c, sid, "echo kept > /workspace/note"))
        assert mounts_under(home), "the workspace is a mounted image while the server runs"
    stop_server(first)
    assert mounts_under(home) == []
    again = running(DISK_TOML)
    with again.client() as c:
        listed = ok(c.get(f"/sandboxes/{sid}/v2/fs/list", params={"path": "/workspace"}))
        assert [f["path"] for f in listed["files"]] == ["/workspace/note"], listed  # no lost+found
        assert ok(run(c, sid, "cat /workspace/note && df -m /workspace | tail -1"))["stdout"].startswith(
            "kept\n"
        )


# ---------------------------------------------------------------- live sandboxes, server-wide


def test_a_third_live_sandbox_is_refused_with_503_until_one_is_closed(running: Callable[..., Server]) -> None:
    server = running(AGENTBOX_MAX_SANDBOXES="2")
    with server.client() as c:
        sessions = []
        for _ in range(3):
            r = c.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "hi"}]})
            assert r.status_code == 201, r.text
            sessions.append(r.json()["id"])
        for sid in sessions[:2]:
            ok(run(c, sid, "true"))
        refused = run(c, sessions[2], "true")
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        reply = refused.json()
        assert reply["success"] is False and reply["data"]["error_type"] == "capacity_exceeded"
        assert reply["data"]["retryable"] is True and "sandbox" in reply["message"]
        assert reply["retry_after"] == int(refused.headers["Retry-After"])
        # the live ones keep working; closing one makes room
        ok(run(c, sessions[0], "true"))
        assert c.delete(f"/v1/sessions/{sessions[1]}").status_code == 200
        ok(run(c, sessions[2], "true"))


def test_idle_sandboxes_are_reclaimed_to_make_room(running: Callable[..., Server]) -> None:
    server = running(AGENTBOX_MAX_SANDBOXES="1", AGENTBOX_IDLE_MINUTES="0.01")
    with server.client() as c:
        ok(run(c, "idle-a", "echo x > /tmp/gone; echo y > /workspace/kept"))
        # as soon as the first one is idle (0.6 s), the second is served by reclaiming it
        eventually(lambda: run(c, "idle-b", "true").status_code == 200, "the idle sandbox was reclaimed")
        # and the reclaimed one comes back when asked, as a rebuild (its /workspace kept)
        back = eventually(
            lambda: (r := run(c, "idle-a", "cat /workspace/kept; ls /tmp")).status_code == 200 and r,
            "rebuilt",
        )
        assert ok(back)["stdout"] == "y\n"


def test_the_sum_of_memory_limits_is_capped(running: Callable[..., Server]) -> None:
    toml = '[machines.sandbox]\nkind = "sandbox"\nnetwork = "off"\nmemory_mb = 512\n'
    server = running(toml, AGENTBOX_MAX_SANDBOX_MEMORY_MB="1000")
    with server.client() as c:
        ok(run(c, "mem-a", "true"))
        refused = run(c, "mem-b", "true")
        assert refused.status_code == 503, refused.text
        assert "memory" in refused.json()["message"]


def test_a_turn_at_capacity_fails_naming_the_machine(running: Callable[..., Server]) -> None:
    server = running(AGENTBOX_MAX_SANDBOXES="1")
    with server.client() as c:
        ok(run(c, "holder", "true"))
        script = [{"tool_calls": [{"name": "bash", "input": {"command": "true"}}]}, {"text": "done"}]
        sid = c.post("/v1/sessions", json={"model": "scripted", "script": script}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/messages", json={"content": "go"}).status_code == 202

        def ended() -> dict[str, Any] | None:
            items = c.get(f"/v1/sessions/{sid}/events").json()["items"]
            return next((e for e in items if e["type"] in ("turn.failed", "turn.completed")), None)

        end = eventually(ended, "the turn ended")
        assert end["type"] == "turn.failed", end
        error = end["error"]
        assert error["type"] == "machine_unavailable" and error["retryable"] is True, error
        assert "machine 'sandbox'" in error["message"], error


# ---------------------------------------------------------------- inotify watches per machine


def inotify_watches(pid: int) -> int:
    """inotify watches process `pid` holds, from its descriptors' fdinfo."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                total += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return total


def test_a_watch_on_a_huge_tree_is_truncated_and_reports_overflow(running: Callable[..., Server]) -> None:
    server = running()
    sid = "watch-many"
    dirs = MAX_WATCHES_PER_MACHINE + 500
    with server.client() as c:
        ok(run(c, sid, f"mkdir -p /workspace/t && cd /workspace/t && seq 1 {dirs} | xargs mkdir"))
        before = inotify_watches(server.process.pid)
        made = ok(c.post(f"/sandboxes/{sid}/v2/watch", json={"path": "/workspace/t"}))
        held = inotify_watches(server.process.pid) - before
        assert 0 < held <= MAX_WATCHES_PER_MACHINE, held
        poll = ok(c.get(f"/sandboxes/{sid}/v2/watch/{made['watcher_id']}/poll", params={"timeout": 0}))
        assert poll["overflow"] is True, poll
        # a second watcher with no room left for its own root is refused, one sharing the
        # watched tree is truncated the same way; neither takes a watch more
        refused = c.post(f"/sandboxes/{sid}/v2/watch", json={"path": "/workspace"})
        assert refused.status_code == 400 and "directory watches" in refused.json()["message"], refused.text
        other = ok(c.post(f"/sandboxes/{sid}/v2/watch", json={"path": "/workspace/t"}))
        assert inotify_watches(server.process.pid) - before == held
        poll = ok(c.get(f"/sandboxes/{sid}/v2/watch/{other['watcher_id']}/poll", params={"timeout": 0}))
        assert poll["overflow"] is True, poll
        # deleting the watchers gives the watches back
        for w in (made, other):
            ok(c.delete(f"/sandboxes/{sid}/v2/watch/{w['watcher_id']}"))
        assert inotify_watches(server.process.pid) == before


def test_a_killed_server_leaves_mounts_that_the_next_one_detaches(home: Path) -> None:
    sid = f"d-{uuid.uuid4().hex[:8]}"
    first = serve(home, DISK_TOML)
    try:
        with first.client() as c:
            ok(run(c, sid, "echo kept > /workspace/note"))
    finally:
        first.process.kill()
        first.process.wait()
    assert mounts_under(home), "a SIGKILLed server cannot unmount"
    again = serve(home, DISK_TOML)
    try:
        assert mounts_under(home) == []  # detached at startup, before any request
        with again.client() as c:
            assert ok(run(c, sid, "cat /workspace/note"))["stdout"] == "kept\n"
    finally:
        stop_server(again)
    assert mounts_under(home) == []


# ---------------------------------------------------------------- the image, through the registry


async def test_an_unstarted_session_reads_its_image_and_a_legacy_workspace_is_adopted(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    settings = sandbox_settings(sandbox_tmp / "home", disk_mb=BUDGET_MB)
    legacy = settings.home / "sessions" / "legacy" / "workspace"
    (legacy / "src").mkdir(parents=True)
    (legacy / "AGENTS.md").write_text("be brief\n")
    (legacy / "src" / "link").symlink_to("/etc/shadow")
    kit = await make_registry(settings)
    machine = await kit.registry.open("legacy")
    assert isinstance(machine, SandboxMachine) and os.path.ismount(legacy)
    listing = await machine.exec(ExecRequest(command="ls -A /workspace; readlink /workspace/src/link"))
    assert listing.stdout == b".agentbox-trash\nAGENTS.md\nsrc\n/etc/shadow\n", listing  # the trash's cover
    await kit.close()
    assert not os.path.ismount(legacy) and list(legacy.iterdir()) == []  # the files are in the image
    # a new server's view of the unstarted session reads its AGENTS.md without starting it
    again = await make_registry(settings)
    view = again.registry.view("legacy")
    assert isinstance(view, SandboxMachine) and view.state == "stopped"
    assert (view.workspace / "AGENTS.md").read_text() == "be brief\n"
    await again.close()
    assert not os.path.ismount(legacy)


async def test_a_legacy_workspace_past_its_budget_does_not_start_and_is_left_alone(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    settings = sandbox_settings(sandbox_tmp / "home", disk_mb=MIN_DISK_MB)
    legacy = settings.home / "sessions" / "big" / "workspace"
    legacy.mkdir(parents=True)
    (legacy / "blob").write_bytes(os.urandom((MIN_DISK_MB + 1) * 2**20))
    kit = await make_registry(settings)
    with pytest.raises(MachineUnavailable, match=f"budget {MIN_DISK_MB} MiB"):
        await kit.registry.open("big")
    assert [p.name for p in legacy.iterdir()] == ["blob"] and not os.path.ismount(legacy)
    assert not image_of(legacy).exists()


@pytest.mark.parametrize("extra", [0, 1])
async def test_watches_per_machine_at_the_boundary(tmp_path: Path, extra: int) -> None:
    """The root and MAX_WATCHES_PER_MACHINE - 1 directories fit exactly; one more overflows."""
    for i in range(MAX_WATCHES_PER_MACHINE - 1 + extra):
        (tmp_path / "tree" / str(i)).mkdir(parents=True)
    hub = WatchHub(LocalMachine("local", tmp_path))
    try:
        watcher = hub.create(str(tmp_path / "tree"))
        assert len(watcher._wds) == MAX_WATCHES_PER_MACHINE
        assert (await watcher.poll(0, timeout=0)).overflow is bool(extra)
        if not extra:  # full now: a directory made later is past the bound, and says so
            (tmp_path / "tree" / "late").mkdir()
            deadline = time.monotonic() + DEADLINE
            while not (page := await watcher.poll(0, timeout=1)).overflow:
                assert time.monotonic() < deadline, page
            assert len(watcher._wds) == MAX_WATCHES_PER_MACHINE
    finally:
        await hub.close()


async def test_the_caps_at_their_boundary(make_registry: RegistryFactory, sandbox_tmp: Path) -> None:
    """Two sandboxes of 512 MiB fit max_sandbox_memory_mb = 1024 exactly; a third is refused,
    and so is a third under max_sandboxes = 2."""
    settings = sandbox_settings(sandbox_tmp / "home", memory_mb=512, disk_mb=0)
    settings.max_sandbox_memory_mb = 1024
    kit = await make_registry(settings)
    await kit.registry.open("a")
    await kit.registry.open("b")
    with pytest.raises(CapacityExceeded, match="max_sandbox_memory_mb = 1024") as refused:
        await kit.registry.open("c")
    assert refused.value.retry_after >= 1
    settings.max_sandbox_memory_mb, settings.max_sandboxes = 10**6, 2
    with pytest.raises(CapacityExceeded, match="max_sandboxes = 2"):
        await kit.registry.open("c")
    await kit.registry.close_session("a")
    assert isinstance(await kit.registry.open("c"), SandboxMachine)


async def test_a_larger_budget_grows_the_image_and_keeps_its_files(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    home = sandbox_tmp / "home"
    small = await make_registry(sandbox_settings(home, disk_mb=16))
    machine = await small.registry.open("grow")
    await machine.exec(ExecRequest(command="echo kept > /workspace/note"))
    await small.close()
    large = await make_registry(sandbox_settings(home, disk_mb=48))
    machine = await large.registry.open("grow")
    df = await machine.exec(
        ExecRequest(command="cat /workspace/note; df -k --output=size /workspace | tail -1")
    )
    note, size_kb = df.stdout.decode().split()
    assert note == "kept" and 40 * 1024 < int(size_kb) <= 48 * 1024, df
    assert image_of(home / "sessions" / "grow" / "workspace").stat().st_size == 48 * 2**20
