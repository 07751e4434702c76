"""The `docker` machine on a real dockerd (the test session's own) with real containers.

Each isolation probe pairs what a command inside sees with a host-side fact that makes it
meaningful (the marker exists on the host, the variable is set in this process, the limit is
what the container's cgroup says), so a container that leaked would fail, not pass vacuously.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, Dockerd

from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest, ExecResult, Machine
from agentbox.machines.docker import (
    AGENT_SOCKET,
    CONTAINER_HOME,
    CONTAINER_USER,
    IMAGE_REPO,
    DockerHost,
    DockerMachine,
    DockerOptions,
)
from agentbox.machines.errors import ContainerGone, MachineUnavailable
from agentbox.machines.images import Image

#: Small limits, so that the hog and the bomb meet them quickly.
SMALL_MEMORY_MB = 64
SMALL_PIDS = 32
#: Bytes the hog asks for: far past SMALL_MEMORY_MB.
HOG_BYTES = 512 * 1024 * 1024
#: Forks the bomb tries: far past SMALL_PIDS.
BOMB_FORKS = 500
#: A call on a machine whose container is gone must fail within this, never hang.
PROMPT_FAILURE_SECONDS = 10.0

DockerFactory = Callable[..., Awaitable[DockerMachine]]


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory: pytest.TempPathFactory, base_image: Image) -> DockerHost:
    return DockerHost(tmp_path_factory.mktemp("docker-home"), images=base_image.path.parent)


@pytest.fixture
async def make_docker(
    docker_host: DockerHost, dockerd: Dockerd, tmp_path: Path
) -> AsyncIterator[DockerFactory]:
    """`await make(**options)`: a started docker machine; every container is removed after the test."""
    made: list[DockerMachine] = []

    async def make(start: bool = True, machine_id: str | None = None, **options: object) -> DockerMachine:
        machine_id = machine_id or new_id(SANDBOX)
        opts = DockerOptions.from_options({"docker_host": dockerd.host, **options})
        d = tmp_path / machine_id
        m = DockerMachine("docker", machine_id, docker_host, opts, d / "workspace", d / "run")
        made.append(m)
        if start:
            await m.start()
        return m

    yield make
    for m in made:
        with_id = m.container_id
        await m.destroy()
        if with_id is not None:
            assert dockerd.cli("inspect", with_id).returncode != 0  # removed


async def sh(m: Machine, command: str, **kwargs: object) -> ExecResult:
    return await m.exec(ExecRequest(command=command, timeout=SANDBOX_DEADLINE, **kwargs))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ commands


async def test_exec_output_exit_codes_and_stdin(make_docker: DockerFactory) -> None:
    m = await make_docker()
    assert (await m.exec(ExecRequest(argv=("true",)))).exit_code == 0
    echo = await sh(m, "echo out; echo err >&2")
    assert (echo.exit_code, echo.stdout, echo.stderr) == (0, b"out\n", b"err\n")
    assert (await sh(m, "exit 7")).exit_code == 7
    assert (await sh(m, "kill -TERM $$")).exit_code == 128 + signal.SIGTERM
    piped = await sh(m, "tr a-z A-Z", stdin=b"through stdin")
    assert piped.stdout == b"THROUGH STDIN"
    where = await sh(m, "pwd; echo $HOME", cwd="/tmp")
    assert where.stdout.decode().split() == ["/tmp", CONTAINER_HOME]
    with pytest.raises(FileNotFoundError):
        await m.exec(ExecRequest(argv=("no-such-program",)))


async def test_timeout_kills_the_command_and_its_children(make_docker: DockerFactory) -> None:
    m = await make_docker()
    started = time.monotonic()
    result = await m.exec(ExecRequest(command="sleep 300 & sleep 300; echo never", timeout=1))
    assert result.timed_out and result.exit_code == 128 + signal.SIGKILL
    assert time.monotonic() - started < PROMPT_FAILURE_SECONDS
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while b"sleep" in (await sh(m, "ps -e -o comm=")).stdout:  # the background child too
        assert time.monotonic() < deadline, "the timed-out command's child survived"
        await asyncio.sleep(0.05)
    assert not m.busy()


async def test_the_agent_is_pid_1_and_commands_do_not_use_docker_exec(
    make_docker: DockerFactory, dockerd: Dockerd
) -> None:
    m = await make_docker()
    cmdline = (await sh(m, "tr '\\0' ' ' < /proc/1/cmdline")).stdout.decode()
    assert "exec_agent.py" in cmdline
    await sh(m, "true")
    info = dockerd.cli("inspect", "-f", "{{len .ExecIDs}}", m.container_id or "")
    assert info.stdout.strip() in ("0", "<no value>"), info  # not one `docker exec` was made


async def test_the_agent_socket_is_gone_once_the_agent_holds_it(make_docker: DockerFactory) -> None:
    m = await make_docker()
    assert not (m.run / AGENT_SOCKET).exists()
    probe = (
        "import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"try:\n    s.connect('/.agentbox/run/{AGENT_SOCKET}')\n    print('connected')\n"
        "except OSError as e:\n    print(type(e).__name__)\n"
    )
    result = await m.exec(ExecRequest(argv=("python3", "-c", probe), timeout=SANDBOX_DEADLINE))
    assert result.stdout == b"FileNotFoundError\n", result


async def test_a_process_left_behind_keeps_the_machine_busy(make_docker: DockerFactory) -> None:
    m = await make_docker()
    assert not m.busy()
    await sh(m, "(setsid sleep 300 >/dev/null 2>&1 &)")  # the command ends, its orphan stays
    assert m.running == 0 and m.busy()
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while m.busy():  # once killed, the agent, as pid 1, reaps the orphan
        assert time.monotonic() < deadline, "the orphan still counts after it was killed"
        await sh(m, "pkill -x sleep")  # again: the first may come before setsid has exec'd sleep
        await asyncio.sleep(0.05)


async def test_the_machine_protocol_and_what_it_reports(make_docker: DockerFactory) -> None:
    m = await make_docker(memory_mb=256, pids=100)
    assert isinstance(m, Machine)
    assert (m.kind, m.isolated, m.root, m.state, m.network_on) == (
        "docker",
        True,
        "/workspace",
        "running",
        False,
    )
    report = m.capabilities()
    assert report["container_id"] == m.container_id and report["network"] == "off"
    assert str(m.image_reference) in report["image_detail"]
    assert report["resource_limits"] == {"memory_mb": 256, "pids": 100, "cpus": 1.0}
    assert {"image", "image_detail", "system_layer", "system_layer_kind", "privileges"} <= set(report)
    assert m.command_env(ExecRequest(env={"X": "1"}))["X"] == "1"
    rg = await m.exec(ExecRequest(argv=(m.ripgrep, "--version")))
    assert rg.exit_code == 0 and rg.stdout.startswith(b"ripgrep")  # searches run it inside


# ------------------------------------------------------------------------ files


async def test_files_through_the_machine_and_through_commands(make_docker: DockerFactory) -> None:
    m = await make_docker()
    await m.write("/workspace/from-server.txt", b"written by the server")
    assert (await sh(m, "cat /workspace/from-server.txt")).stdout == b"written by the server"
    assert (m.workspace / "from-server.txt").stat().st_uid == m.uid_gid[0]  # usable inside
    await sh(m, "mkdir -p /workspace/sub && echo inside > /workspace/sub/in.txt && echo t > /tmp/t.txt")
    assert await m.read("sub/in.txt") == b"inside\n"
    assert await m.read("/tmp/t.txt") == b"t\n"  # the container's own tmpfs, handed over by the agent
    names = sorted(e.name for e in await m.list("/workspace"))
    assert names == ["from-server.txt", "sub"]
    await m.write(f"{CONTAINER_HOME}/.profile", b"export X=1\n")
    assert (await sh(m, "cat ~/.profile")).stdout == b"export X=1\n"
    assert b"Debian" in await m.read("/etc/os-release")  # the image's, as the container sees it
    with pytest.raises(OSError):
        await m.write("/usr/new-file", b"x")  # the system is read-only through the API


async def test_the_container_user_has_a_name(make_docker: DockerFactory) -> None:
    """The uid the container runs as is CONTAINER_USER, the user the machine reports."""
    m = await make_docker()
    who = await sh(m, "id -un; id -gn; whoami; echo ~agent; stat -c %U:%G /workspace")
    assert who.exit_code == 0, who
    name = CONTAINER_USER
    assert who.stdout.decode().split() == [name, name, name, CONTAINER_HOME, f"{name}:{name}"]
    passwd = (await sh(m, "cat /etc/passwd")).stdout.decode()
    assert passwd.startswith("root:x:0:0:") and passwd.count(f":{m.uid_gid[0]}:") == 1  # the rest kept
    assert (await sh(m, "echo x >> /etc/passwd")).exit_code != 0  # bound read-only


async def test_workspace_lasts_across_stop_and_start_and_tmp_does_not(make_docker: DockerFactory) -> None:
    m = await make_docker()
    container = m.container_id
    await sh(m, "echo kept > /workspace/kept.txt; echo lost > /tmp/lost.txt")
    await m.stop()
    assert m.state == "stopped"
    with pytest.raises(MachineUnavailable):
        await sh(m, "true")
    await m.start()
    assert m.container_id == container  # the same container, started again
    assert (await sh(m, "cat /workspace/kept.txt")).stdout == b"kept\n"
    assert (await sh(m, "test -e /tmp/lost.txt")).exit_code == 1


async def test_stop_ends_running_commands(make_docker: DockerFactory) -> None:
    m = await make_docker()
    process = await m.spawn(ExecRequest(argv=("sleep", "300")))
    started = time.monotonic()
    await m.stop()
    assert await asyncio.wait_for(process.wait(), PROMPT_FAILURE_SECONDS) == 128 + signal.SIGKILL
    assert time.monotonic() - started < PROMPT_FAILURE_SECONDS


async def test_writable_root_keeps_system_changes_until_the_container_goes(
    make_docker: DockerFactory,
) -> None:
    m = await make_docker(writable_root=True)
    await sh(m, "echo installed > /usr/local/bin/tool-marker")
    await m.stop()
    await m.start()
    assert (await sh(m, "cat /usr/local/bin/tool-marker")).stdout == b"installed\n"
    read_only = await make_docker()
    assert (await sh(read_only, "echo x > /usr/local/bin/tool-marker")).exit_code != 0


# ------------------------------------------------------------------------ isolation


async def test_no_host_files(make_docker: DockerFactory) -> None:
    marker = Path("/usr/local/share") / f"agentbox-host-marker-{uuid.uuid4().hex}"
    marker.write_text("host only")
    try:
        m = await make_docker()
        assert marker.read_text() == "host only"  # the host has it, so absence inside means something
        result = await sh(m, f"cat {marker}")
        assert result.exit_code != 0 and b"host only" not in result.stdout
        assert (await sh(m, f"test -e {m.workspace} || test -e /work || test -e /var/lib/agentbox")).exit_code
    finally:
        marker.unlink()


async def test_no_server_environment(make_docker: DockerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGENTBOX_TEST_SECRET", secret)
    m = await make_docker()
    assert os.environ["AGENTBOX_TEST_SECRET"] == secret
    every = await sh(m, "env; for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; done")
    assert every.exit_code == 0 and b"PATH=" in every.stdout
    assert secret.encode() not in every.stdout and b"AGENTBOX_TEST_SECRET" not in every.stdout
    agent_environ = Path(f"/proc/{m._pid}/environ").read_bytes()  # pid 1, which commands cannot read
    assert agent_environ.startswith(b"PATH=") and secret.encode() not in agent_environ


async def test_unprivileged(make_docker: DockerFactory) -> None:
    m = await make_docker()
    uid = int((await sh(m, "id -u")).stdout)
    assert uid != 0 and uid == m.uid_gid[0]
    status = dict(
        line.split(":\t", 1) for line in (await sh(m, "cat /proc/self/status")).stdout.decode().splitlines()
    )
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, (cap, status[cap])
    assert status["NoNewPrivs"].strip() == "1"
    host_status = Path(f"/proc/{m._pid}/status").read_text()  # the agent, seen from the host
    assert f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}" in host_status
    assert (await sh(m, "touch /usr/x")).exit_code != 0  # a read-only root


async def test_no_docker_socket_inside(make_docker: DockerFactory, dockerd: Dockerd) -> None:
    m = await make_docker()
    assert Path(dockerd.host.removeprefix("unix://")).is_socket()
    every_socket = "find / \\( -path /proc -o -path /sys \\) -prune -o -type s -print 2>/dev/null"
    sockets = await sh(m, f"{every_socket}; ls /var/run/docker.sock /run/docker.sock")
    assert sockets.stdout == b"" and b"No such file" in sockets.stderr
    mounts = (await sh(m, "cat /proc/self/mountinfo")).stdout
    assert b"docker.sock" not in mounts


async def test_memory_limit_kills_a_hog(make_docker: DockerFactory) -> None:
    m = await make_docker(memory_mb=SMALL_MEMORY_MB)
    limit = memory_limit_of(m)
    assert limit == SMALL_MEMORY_MB * 1024 * 1024
    hog = f"b = bytearray({HOG_BYTES}); print('allocated everything')"
    result = await m.exec(ExecRequest(argv=("python3", "-c", hog), timeout=SANDBOX_DEADLINE))
    assert b"allocated everything" not in result.stdout
    assert result.exit_code == 128 + signal.SIGKILL or b"MemoryError" in result.stderr, result
    assert (await sh(m, "echo alive")).stdout == b"alive\n"  # the agent (pid 1) survives its command


async def test_pids_limit_stops_a_fork_bomb(make_docker: DockerFactory) -> None:
    m = await make_docker(pids=SMALL_PIDS)
    bomb = (
        "import os, sys, time\nn = 0\n"
        f"for _ in range({BOMB_FORKS}):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(300)\n        os._exit(0)\n    n += 1\n"
        "print(n, flush=True)\n"
    )
    result = await m.exec(ExecRequest(argv=("python3", "-c", bomb), timeout=SANDBOX_DEADLINE))
    forks = int(result.stdout)
    assert 0 < forks < SMALL_PIDS, result
    await m.stop()  # the forks outlive their parent: the stop ends them with the container
    await m.start()
    assert (await sh(m, "echo alive")).stdout == b"alive\n"


def memory_limit_of(m: DockerMachine) -> int:
    """The memory limit of the container's cgroup, read on the host (cgroup v1 or v2)."""
    for line in Path(f"/proc/{m._pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            return int(Path(f"/sys/fs/cgroup{path}/memory.max").read_text())
        if "memory" in controllers.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text())
    raise AssertionError("the container has no memory cgroup")


# ------------------------------------------------------------------------ the container's life


async def test_a_second_machine_attaches_to_the_container_by_id(
    make_docker: DockerFactory, docker_host: DockerHost
) -> None:
    first = await make_docker()
    await sh(first, "echo before > /workspace/note.txt")
    container = first.container_id
    assert container is not None
    await first.close()  # what a server's shutdown does: the container stays
    second = DockerMachine(
        "docker", first.machine_id, docker_host, first.options, first.workspace, first.run,
        container_id=container,
    )  # fmt: skip
    await second.start()
    try:
        assert second.container_id == container
        assert (await sh(second, "cat /workspace/note.txt")).stdout == b"before\n"
        assert (await sh(second, "hostname")).stdout.decode().strip() == first.hostname
    finally:
        await second.stop()


async def test_attach_to_a_running_container_restarts_its_agent(
    make_docker: DockerFactory, docker_host: DockerHost
) -> None:
    """A server killed before it stopped its container: the next one takes the container over."""
    first = await make_docker()
    container = first.container_id
    second = DockerMachine(
        "docker", first.machine_id, docker_host, first.options, first.workspace, first.run,
        container_id=container,
    )  # fmt: skip
    await second.start()
    try:
        assert (await sh(second, "echo taken over")).stdout == b"taken over\n"
        deadline = time.monotonic() + SANDBOX_DEADLINE
        while first.state == "running":  # the old agent's socket ended with its container's restart
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await second.stop()


async def test_a_machine_without_its_recorded_id_finds_its_container_by_name(
    make_docker: DockerFactory, docker_host: DockerHost
) -> None:
    """A server that died between creating the container and recording its id."""
    first = await make_docker()
    await first.close()
    again = DockerMachine("docker", first.machine_id, docker_host, first.options, first.workspace, first.run)
    await again.start()
    try:
        assert again.container_id == first.container_id
    finally:
        await again.stop()


async def test_attach_refuses_another_machines_container(
    make_docker: DockerFactory, docker_host: DockerHost
) -> None:
    first = await make_docker()
    other = DockerMachine(
        "docker", new_id(SANDBOX), docker_host, first.options, first.workspace.parent / "other",
        first.run.parent / "other-run", container_id=first.container_id,
    )  # fmt: skip
    with pytest.raises(MachineUnavailable, match="is not machine"):
        await other.start()
    assert (await sh(first, "echo still mine")).stdout == b"still mine\n"


async def test_a_container_removed_behind_agentbox_fails_clearly(
    make_docker: DockerFactory, dockerd: Dockerd
) -> None:
    m = await make_docker()
    running = await m.spawn(ExecRequest(argv=("sleep", "300")))
    assert dockerd.cli("rm", "-f", m.container_id or "").returncode == 0
    assert await asyncio.wait_for(running.wait(), PROMPT_FAILURE_SECONDS) == 128 + signal.SIGKILL
    started = time.monotonic()
    with pytest.raises(MachineUnavailable):
        deadline = time.monotonic() + PROMPT_FAILURE_SECONDS
        while time.monotonic() < deadline:  # until the machine has noticed, commands may still be sent
            await sh(m, "true")
            await asyncio.sleep(0.05)
    with pytest.raises(ContainerGone, match="no longer exists"):
        await m.start()
    assert time.monotonic() - started < PROMPT_FAILURE_SECONDS
    m.container_id = None  # what the registry does to make a new one: the workspace is kept
    await m.start()
    assert (await sh(m, "echo new")).stdout == b"new\n"


async def test_an_unreachable_engine_is_a_clear_error(docker_host: DockerHost, tmp_path: Path) -> None:
    options = DockerOptions(docker_host=f"unix://{tmp_path}/no-dockerd.sock")
    m = DockerMachine("docker", new_id(SANDBOX), docker_host, options, tmp_path / "ws", tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(MachineUnavailable, match="cannot reach the Docker engine"):
        await m.start()
    assert time.monotonic() - started < PROMPT_FAILURE_SECONDS
    assert m.state == "stopped"


async def test_network_on_without_a_bridge_is_a_clear_error(make_docker: DockerFactory) -> None:
    """The test engine runs with --bridge=none, so "on" can only be shown to fail plainly here."""
    m = await make_docker(start=False, network="on")
    assert m.network_on
    with pytest.raises(MachineUnavailable, match="bridge"):
        await m.start()


async def test_network_off_is_loopback_only(make_docker: DockerFactory) -> None:
    m = await make_docker()
    interfaces = await m.exec(
        ExecRequest(argv=("python3", "-c", "import socket; print([n for _, n in socket.if_nameindex()])"))
    )
    assert interfaces.stdout == b"['lo']\n"


async def test_the_image_is_imported_once_per_digest(
    make_docker: DockerFactory, dockerd: Dockerd, base_image: Image
) -> None:
    await make_docker()
    tag = f"{IMAGE_REPO}/{base_image.name}:{base_image.manifest.digest.removeprefix('sha256:')[:12]}"
    listed = dockerd.cli("images", "-q", tag).stdout.split()
    assert len(listed) == 1
    started = time.monotonic()
    await make_docker()  # the tag is there: no import (which takes seconds)
    assert dockerd.cli("images", "-q", f"{IMAGE_REPO}/{base_image.name}").stdout.split() == listed
    assert time.monotonic() - started < PROMPT_FAILURE_SECONDS


# ------------------------------------------------------------------------ options


def test_options_refuse_unknown_keys_and_root() -> None:
    with pytest.raises(ValueError, match="bogus, colour"):
        DockerOptions.from_options({"colour": "blue", "bogus": 1})
    with pytest.raises(ValueError, match="never runs as root"):
        DockerOptions.from_options({"user": "0:0"})
    with pytest.raises(ValueError, match="memory_mb"):
        DockerOptions.from_options({"memory_mb": -1})
    with pytest.raises(ValueError, match="docker_host"):
        DockerOptions.from_options({"docker_host": "/var/run/docker.sock"})
    options = DockerOptions.from_options({"network": "on", "memory_mb": "512", "user": "1234", "disk_mb": 10})
    assert (options.network, options.memory_mb, options.uid_gid(None)) == (True, 512, (1234, 1234))
    assert replace(options, network=False).network is False
