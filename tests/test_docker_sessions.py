"""Docker sessions through the registry and a real server: suspended when idle, found again
after a restart (the session marker holds the container's id), /workspace kept throughout."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from agentbox.config import MachineConfig, Settings
from agentbox.machines.base import ExecRequest, Lifetime
from agentbox.machines.docker import DockerMachine
from agentbox.machines.images import Image
from agentbox.machines.registry import Registry
from agentbox.store.db import Database
from agentbox.store.markers import MarkersRepo
from tests.conftest import Dockerd, start_server, stop_server

#: Seconds a container start or a command may take on a loaded machine.
DEADLINE = 120.0


def docker_entry(dockerd: Dockerd) -> str:
    return (
        f'delegable = ["sandbox", "box"]\n[machines.box]\nkind = "docker"\ndocker_host = "{dockerd.host}"\n'
    )


async def test_an_idle_docker_session_is_stopped_and_resumed_on_the_next_request(
    dockerd: Dockerd, base_image: Image, sandbox_tmp: Path
) -> None:
    home = sandbox_tmp / "home"
    settings = Settings(
        home=home, images_dir=base_image.path.parent,
        machines={"box": MachineConfig("box", "docker", {"docker_host": dockerd.host})},
    )  # fmt: skip
    db = Database.in_home(home)
    await db.connect()
    registry = Registry(settings, MarkersRepo(db))
    try:
        machine = await registry.open("ses_idle", "box")
        assert isinstance(machine, DockerMachine) and isinstance(machine, Lifetime)
        await machine.exec(ExecRequest(command="echo kept > /workspace/kept.txt"))
        container = machine.container_id
        await registry.sweep(now=time.monotonic() + settings.idle_minutes * 60 + 1)
        assert machine.state == "stopped"
        assert dockerd.cli("inspect", "-f", "{{.State.Running}}", str(container)).stdout.strip() == "false"
        again = await registry.open("ses_idle", "box")
        assert again is machine and machine.container_id == container
        result = await again.exec(ExecRequest(command="cat /workspace/kept.txt"))
        assert result.stdout == b"kept\n"
        await registry.close_session("ses_idle")
        assert dockerd.cli("inspect", str(container)).returncode != 0  # a closed session's container goes
    finally:
        await registry.shutdown()
        await db.close()


def test_a_restarted_server_finds_the_sessions_container_again(
    dockerd: Dockerd, base_image: Image, sandbox_tmp: Path
) -> None:
    home = sandbox_tmp / "home"
    home.mkdir()
    config = sandbox_tmp / "agentbox.toml"
    config.write_text(docker_entry(dockerd))
    env = {"AGENTBOX_CONFIG": str(config), "AGENTBOX_IMAGES": str(base_image.path.parent)}

    def run(server_url: str, sid: str, command: str) -> dict[str, object]:
        with httpx.Client(base_url=server_url, timeout=DEADLINE) as client:
            done = client.post(f"/sandboxes/{sid}/v1/shell/exec", json={"command": command})
            assert done.status_code == 200, done.text
            described = client.get(f"/sandboxes/{sid}/v2/sandbox").json()["data"]
            return {"output": done.json()["data"]["output"], "isolation": described["isolation"]}

    server = start_server(home, env)
    try:
        with httpx.Client(base_url=server.url, timeout=DEADLINE) as client:
            created = client.post("/v1/sessions", json={"model": "scripted", "machine": "box"})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
        first = run(server.url, sid, "echo intact > /workspace/file.txt; hostname")
    finally:
        stop_server(server)
    isolation = first["isolation"]
    assert isinstance(isolation, dict) and isolation["isolation"] == "docker"
    container = isolation["container_id"]
    assert container and dockerd.cli("inspect", str(container)).returncode == 0  # kept across the stop
    server = start_server(home, env)
    try:
        second = run(server.url, sid, "cat /workspace/file.txt")
    finally:
        stop_server(server)
    assert str(second["output"]).strip() == "intact"
    assert second["isolation"]["container_id"] == container  # type: ignore[index]


async def test_a_restart_removes_only_its_own_homes_leftover_containers(
    dockerd: Dockerd, base_image: Image, sandbox_tmp: Path
) -> None:
    """A container no live session names (its session closed while the engine was away) goes at
    the next start; a live session's stays for reattaching, and another home's is never touched."""

    async def opened(home: Path, sessions: list[str], forget: str | None = None) -> dict[str, str]:
        settings = Settings(
            home=home, images_dir=base_image.path.parent,
            machines={"box": MachineConfig("box", "docker", {"docker_host": dockerd.host})},
        )  # fmt: skip
        db = Database.in_home(home)
        await db.connect()
        markers = MarkersRepo(db)
        registry = Registry(settings, markers)
        try:
            await registry.recover()
            containers = {}
            for sid in sessions:
                machine = await registry.open(sid, "box")
                assert isinstance(machine, DockerMachine) and machine.container_id
                containers[sid] = machine.container_id
            if forget is not None:
                await markers.clear(forget, "box")
            return containers
        finally:
            await registry.shutdown()  # containers are kept for the next server
            await db.close()

    home, other = sandbox_tmp / "home", sandbox_tmp / "other-home"
    mine = await opened(home, ["ses_live", "ses_gone"], forget="ses_gone")
    theirs = await opened(other, ["ses_theirs"])
    assert all(dockerd.cli("inspect", c).returncode == 0 for c in [*mine.values(), *theirs.values()])
    await opened(home, [])  # the restart: its recovery sweeps
    assert dockerd.cli("inspect", mine["ses_gone"]).returncode != 0
    assert dockerd.cli("inspect", mine["ses_live"]).returncode == 0
    assert dockerd.cli("inspect", theirs["ses_theirs"]).returncode == 0
