"""Isolation of real bubblewrap sandboxes, checked from both sides: inside a command and on the host.

The facts every isolating kind must hold (no host files, no server environment, no host
loopback, unprivileged, limits hold) run on Docker containers too (`make_isolated`, on the
`base` image); the rest are the sandbox's own (bubblewrap's binds, its uid map, its layer).

Every probe pairs what a command inside sees with a host-side fact that makes the check
meaningful (the secret exists on the host, the server's pid is real, the host has a human
account...), so a sandbox that leaked would fail rather than pass vacuously.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, IsolatedFactory, SandboxFactory, Server, sandbox_host_pid

from agentbox.machines import sysroot
from agentbox.machines.base import ExecRequest, ExecResult, Machine
from agentbox.machines.sandbox import AGENT_USR, SandboxConfig, SandboxHost
from agentbox.machines.sysroot import HUMAN_IDS, copy_curated_etc

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as root in production and CI")

#: What `/` inside a sandbox may hold: its system dirs and binds, nothing else of the host.
#: (`bin`, `sbin`, `lib`, `lib64` only where the host has them, as symlinks into /usr.)
#: `.agentbox` holds what the server binds read-only for its own use (ripgrep, and with the
#: system layer the host's /usr for the agent).
EXPECTED_ROOT = {"dev", "etc", "proc", "root", "tmp", "usr", "var", "workspace", AGENT_USR.strip("/")} | {
    d for d in ("bin", "sbin", "lib", "lib64") if os.path.lexists(f"/{d}")
}
LAYER_EXTRA: set[str] = set()
#: Processes a sandbox shows while one probe runs: bwrap's init, the exec agent, the probe's
#: shell and the commands of its pipeline. Anything beyond is a host process.
MAX_INSIDE_PROCESSES = 6
#: A refused connection must fail at once, not after a connect timeout.
FAST_FAILURE_SECONDS = 1.0
SECRET = "sk-test"
#: An address outside any sandbox (Cloudflare DNS), for "no route" checks.
OUTSIDE = ("1.1.1.1", 53)
#: slirp4netns's address for the host; with --disable-host-loopback it must lead nowhere.
SLIRP_HOST = "10.0.2.2"

CONNECT_PROBE = """
import json, socket, sys, time
results = {}
for host, port in json.loads(sys.argv[1]):
    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=5).close()
        outcome = "connected"
    except OSError as exc:
        outcome = type(exc).__name__ + ": " + str(exc)
    results[f"{host}:{port}"] = [outcome, time.monotonic() - started]
print(json.dumps({"interfaces": [name for _, name in socket.if_nameindex()], "results": results}))
"""

HTTPS_PROBE = """
import socket, sys, urllib.request
try:
    socket.getaddrinfo("pypi.org", 443)
except socket.gaierror as exc:
    print("NO-DNS", exc)
    sys.exit(0)
with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20) as response:
    print("STATUS", response.status)
"""


async def sh(m: Machine, command: str, timeout: float = SANDBOX_DEADLINE) -> ExecResult:
    return await m.exec(ExecRequest(command=command, timeout=timeout))


@dataclass(frozen=True)
class NetProbe:
    """What CONNECT_PROBE saw inside: the interfaces, and per `host:port` (outcome, seconds)."""

    interfaces: list[str]
    results: dict[str, tuple[str, float]]


async def probe_connections(m: Machine, targets: list[tuple[str, int]]) -> NetProbe:
    result = await m.exec(
        ExecRequest(argv=("python3", "-c", CONNECT_PROBE, json.dumps(targets)), timeout=SANDBOX_DEADLINE)
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    return NetProbe(
        list(data["interfaces"]), {k: (str(v[0]), float(v[1])) for k, v in data["results"].items()}
    )


@pytest.fixture
def usr_secret() -> Iterator[Path]:
    """A file in the host's /usr, which a machine on an image has its own of."""
    path = Path("/usr/local/share") / f"agentbox-test-secret-{uuid.uuid4().hex}"
    path.write_text(SECRET)
    yield path
    path.unlink()


@pytest.fixture
def root_secret() -> Iterator[Path]:
    """A secret in the host's /root, which inside is the sandbox's own (empty) $HOME."""
    path = Path("/root") / f"agentbox-test-secret-{uuid.uuid4().hex}"
    path.write_text(SECRET)
    yield path
    path.unlink()


# ---------------------------------------------------------------- files


@pytest.mark.parametrize("layer", [True, False], ids=["system-layer", "read-only-usr"])
async def test_root_lists_only_the_sandbox_entries(make_sandbox: SandboxFactory, layer: bool) -> None:
    m = await make_sandbox(SandboxConfig(network=False, system_layer=layer))
    result = await sh(m, "ls -A /")
    allowed = EXPECTED_ROOT | (LAYER_EXTRA if m.layer_on else set())
    assert set(result.stdout.decode().split()) <= allowed
    assert set(result.stdout.decode().split()) >= EXPECTED_ROOT


async def test_host_files_outside_the_binds_are_invisible(
    make_isolated: IsolatedFactory, tmp_path: Path, root_secret: Path, usr_secret: Path
) -> None:
    tmp_secret = tmp_path / "host-secret.txt"
    tmp_secret.write_text(SECRET)
    m = await make_isolated()
    for path in (tmp_secret, root_secret, usr_secret):
        assert path.read_text() == SECRET  # the host can read it, so a failure inside means something
        result = await sh(m, f"cat {path}")
        assert result.exit_code != 0
        assert SECRET.encode() not in result.stdout
        assert b"No such file" in result.stderr
    listing = await sh(m, "ls -A /root; ls -A /tmp")
    assert root_secret.name.encode() not in listing.stdout
    # The machine's workspace and run directories are below tmp_path on the host.
    assert (await sh(m, f"test -e {tmp_path} || test -e /work || test -e /var/lib/agentbox")).exit_code != 0


async def test_host_processes_are_invisible(make_isolated: IsolatedFactory) -> None:
    m = await make_isolated()
    server_pid = os.getpid()
    result = await sh(m, "for p in /proc/[0-9]*; do echo ${p#/proc/} $(tr '\\0' ' ' < $p/cmdline); done")
    lines = result.stdout.decode().splitlines()
    pids = {int(line.split()[0]) for line in lines}
    assert 0 < len(pids) <= MAX_INSIDE_PROCESSES, lines
    assert not any("pytest" in line for line in lines), lines
    if server_pid in pids:  # only a coincidence of numbers may put it there, never the server itself
        assert "pytest" not in (await sh(m, f"tr '\\0' ' ' < /proc/{server_pid}/cmdline")).stdout.decode()
    ps = await sh(m, "ps -e -o pid=,args=")
    assert b"pytest" not in ps.stdout
    assert len(ps.stdout.decode().splitlines()) <= MAX_INSIDE_PROCESSES


async def test_server_env_secret_is_not_in_command_env(
    make_isolated: IsolatedFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    m = await make_isolated()
    result = await sh(m, "env")
    assert result.exit_code == 0
    assert b"OPENAI_API_KEY" not in result.stdout
    assert SECRET.encode() not in result.stdout


async def test_server_env_secret_is_in_no_sandbox_process(
    make_isolated: IsolatedFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not even in pid 1's environment (bwrap's, or a container's agent): a process inside may
    read it from /proc/1/environ, and the host reads it whether or not commands can."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    m = await make_isolated()
    result = await sh(m, "for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' '\\n' < $p/environ; done")
    leaked = [
        line for line in result.stdout.decode().splitlines() if SECRET in line or line.startswith("== ")
    ]
    assert b"PATH=" in result.stdout  # the probe read some environment
    assert SECRET not in result.stdout.decode(), f"server environment visible inside: {leaked}"
    init = Path(f"/proc/{await sandbox_host_pid(m, 1)}/environ").read_bytes()
    assert b"PATH=" in init and SECRET.encode() not in init


# ---------------------------------------------------------------- identity and privileges


@ROOT_ONLY
async def test_root_inside_is_an_unprivileged_host_uid(make_sandbox: SandboxFactory) -> None:
    """The sandbox's own way (a container runs as a non-root uid: tests/test_docker_machine.py)."""
    m = await make_sandbox()
    host: SandboxHost = m.host
    assert host.uid != 0
    assert (await sh(m, "id -u")).stdout == b"0\n"
    uid_map = (await sh(m, "cat /proc/self/uid_map")).stdout.split()
    assert uid_map == [b"0", str(host.uid).encode(), b"1"]


async def test_unprivileged(make_isolated: IsolatedFactory) -> None:
    """No capabilities, no new privileges, and on the host a command is the machine's own uid."""
    m = await make_isolated()
    status = (await sh(m, "cat /proc/self/status")).stdout.decode().splitlines()
    caps = {line.split(":")[0]: int(line.split()[1], 16) for line in status if line.startswith("Cap")}
    assert set(caps) >= {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"}
    assert all(value == 0 for value in caps.values()), caps
    assert "NoNewPrivs:\t1" in status
    host_uid = m.capabilities()["host_uid"]
    assert isinstance(host_uid, int) and host_uid != 0
    process = await m.spawn(ExecRequest(argv=("sleep", "1000")))
    try:
        host_status = Path(f"/proc/{await sandbox_host_pid(m, process.pid)}/status").read_text().splitlines()
        uids = next(line for line in host_status if line.startswith("Uid:")).split()[1:]
        assert uids == [str(host_uid)] * 4
    finally:
        process.kill()
        await process.wait()


async def test_workspace_files_are_shared_with_the_server(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    assert (await sh(m, "echo from-inside > /workspace/inside.txt")).exit_code == 0
    host_file = m.workspace / "inside.txt"
    assert host_file.read_text() == "from-inside\n"
    host_file.write_text("edited by the server\n")
    assert (await sh(m, "cat /workspace/inside.txt")).stdout == b"edited by the server\n"
    # What the server creates belongs to the sandbox's user, so commands inside may change it.
    await m.write("/workspace/from-server.txt", b"one\n")
    await m.mkdir("/workspace/server-dir")
    result = await sh(m, "echo two >> /workspace/from-server.txt && touch /workspace/server-dir/new")
    assert result.exit_code == 0, result.stderr
    assert (m.workspace / "from-server.txt").read_text() == "one\ntwo\n"
    if os.geteuid() == 0:
        owner = m.host.uid, m.host.gid
        for p in (host_file, m.workspace / "from-server.txt", m.workspace / "server-dir"):
            assert (p.stat().st_uid, p.stat().st_gid) == owner


@ROOT_ONLY
async def test_system_writes_land_in_a_discardable_layer(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox(SandboxConfig(network=False, system_layer=True))
    if not m.layer_on:
        pytest.skip(m.host.system_layer()[1])
    name = f"agentbox-probe-{uuid.uuid4().hex}"
    result = await sh(
        m, f"touch /usr/local/{name} && echo x > /etc/{name} && ls /usr/local/{name} /etc/{name}"
    )
    assert result.exit_code == 0, result.stderr
    assert not Path(f"/usr/local/{name}").exists()
    assert not Path(f"/etc/{name}").exists()
    assert not (m.host.base.etc / name).exists()
    await m.stop()
    await m.start()
    assert (await sh(m, f"test -e /usr/local/{name} || test -e /etc/{name}")).exit_code != 0


async def test_system_dirs_are_read_only_without_the_layer(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox(SandboxConfig(network=False, system_layer=False))
    name = f"agentbox-probe-{uuid.uuid4().hex}"
    for path in (f"/usr/local/{name}", f"/etc/{name}"):
        result = await sh(m, f"touch {path}")
        assert result.exit_code != 0
        assert b"Read-only file system" in result.stderr
        assert not Path(path).exists()


async def test_etc_has_no_shadow_and_no_human_accounts(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    assert (await sh(m, "test -e /etc/shadow || test -e /etc/gshadow")).exit_code != 0
    for table in ("passwd", "group"):
        inside = (await sh(m, f"cat /etc/{table}")).stdout.decode()
        assert "root" in inside  # the file is there, just curated
        ids = {int(f[2]) for f in (line.split(":") for line in inside.splitlines()) if len(f) > 2}
        assert not ids & set(HUMAN_IDS)
        host_humans = [
            fields[0]
            for fields in (line.split(":") for line in Path(f"/etc/{table}").read_text().splitlines())
            if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in HUMAN_IDS
        ]
        names = {line.split(":")[0] for line in inside.splitlines()}
        assert not names & set(host_humans)


def test_curated_etc_leaves_out_secrets_identity_and_people(tmp_path: Path) -> None:
    """The same filter on a made-up /etc, so it is tested even on hosts without human accounts."""
    src, dst = tmp_path / "etc", tmp_path / "curated"
    (src / "private").mkdir(parents=True)
    (src / "private" / "key").write_text("k")
    os.chmod(src / "private", 0o700)
    (src / "shadow").write_text("root:$6$hash:1::::::\n")
    os.chmod(src / "shadow", 0o640)
    (src / "machine-id").write_text("0123456789abcdef\n")
    (src / "os-release").write_text("ID=debian\n")
    (src / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n"
        "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
    )
    (src / "group").write_text("root:x:0:\nalice:x:1000:\n")
    for p in (src / "machine-id", src / "os-release", src / "passwd", src / "group"):
        os.chmod(p, 0o644)
    copy_curated_etc(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["os-release", "passwd", "group", "hostname", "hosts", "resolv.conf", "mtab"]
    )
    assert "alice" not in (dst / "passwd").read_text()
    assert "nobody" in (dst / "passwd").read_text()
    assert "alice" not in (dst / "group").read_text()



def test_an_etc_entry_gone_since_the_listing_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """useradd's lock files come and go in the host's /etc while a server builds its base."""
    src, dst = tmp_path / "etc", tmp_path / "curated"
    src.mkdir()
    (src / "os-release").write_text("ID=debian\n")
    real_walk = os.walk

    def walk_listing_ghosts(top: Path) -> Iterator[tuple[str, list[str], list[str]]]:
        for dirpath, dirnames, filenames in real_walk(top):
            yield dirpath, [*dirnames, "gone.d"], [*filenames, "subgid.lock"]

    monkeypatch.setattr(sysroot.os, "walk", walk_listing_ghosts)
    copy_curated_etc(src, dst)
    assert (dst / "os-release").read_text() == "ID=debian\n"
    assert not (dst / "subgid.lock").exists() and not (dst / "gone.d").exists()


# ---------------------------------------------------------------- network


async def test_network_off_is_loopback_only(make_isolated: IsolatedFactory) -> None:
    """Nothing outside, and not the host's loopback: a listener there is never reached."""
    accepted: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        m = await make_isolated(network=False)
        probe = await probe_connections(m, [OUTSIDE, ("127.0.0.1", port)])
    finally:
        listener.close()
        await listener.wait_closed()
    assert probe.interfaces == ["lo"]
    outcome, seconds = probe.results[f"{OUTSIDE[0]}:{OUTSIDE[1]}"]
    assert outcome != "connected"
    assert seconds < FAST_FAILURE_SECONDS
    assert probe.results[f"127.0.0.1:{port}"][0] != "connected" and accepted == []


# Sandbox only: network on in a container needs the engine's bridge, and the test dockerd has
# none (tests/test_docker_machine.py shows that refused plainly).
async def test_network_on_never_reaches_the_host_loopback(
    make_sandbox: SandboxFactory, server: Server
) -> None:
    accepted: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    api_port = int(server.url.rsplit(":", 1)[1])
    try:
        m = await make_sandbox(SandboxConfig(network=True))
        if not m.network_on:
            pytest.skip("slirp4netns is missing: sandboxes have no outbound network here")
        targets = [(SLIRP_HOST, port), ("127.0.0.1", port), (SLIRP_HOST, api_port), ("127.0.0.1", api_port)]
        probe = await probe_connections(m, targets)
        assert set(probe.interfaces) - {"lo"}, probe
        for host, p in targets:
            assert probe.results[f"{host}:{p}"][0] != "connected", probe
    finally:
        listener.close()
        await listener.wait_closed()
    assert accepted == []


async def test_network_on_reaches_a_package_registry(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox(SandboxConfig(network=True))
    if not m.network_on:
        pytest.skip("slirp4netns is missing: sandboxes have no outbound network here")
    result = await m.exec(ExecRequest(argv=("python3", "-c", HTTPS_PROBE), timeout=SANDBOX_DEADLINE))
    out = result.stdout.decode()
    if out.startswith("NO-DNS"):
        pytest.skip(
            f"name resolution fails inside the sandbox on this host ({out.strip()}); HTTPS not checked"
        )
    assert result.exit_code == 0, result.stderr.decode()[-2000:]
    assert out.strip() == "STATUS 200"


async def test_each_sandbox_has_its_own_hostname(make_sandbox: SandboxFactory) -> None:
    a = await make_sandbox()
    b = await make_sandbox()
    names = []
    for m in (a, b):
        result = await sh(m, "hostname; cat /etc/hostname")
        name, file_name = result.stdout.decode().split()
        assert name == file_name == m.hostname
        names.append(name)
    assert names[0] != names[1]
    assert socket.gethostname() not in names


# ---------------------------------------------------------------- limits

#: Small limits, so that the hog and the bomb meet them quickly.
SMALL_MEMORY_MB = 64
SMALL_PIDS = 32
#: Bytes the hog asks for: far past SMALL_MEMORY_MB.
HOG_BYTES = 512 * 1024 * 1024
#: Forks the bomb tries: far past SMALL_PIDS.
BOMB_FORKS = 500


def memory_limit_of(host_pid: int) -> int:
    """The memory limit of a host process's cgroup, read on the host (cgroup v1 or v2)."""
    for line in Path(f"/proc/{host_pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            return int(Path(f"/sys/fs/cgroup{path}/memory.max").read_text())
        if "memory" in controllers.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text())
    raise AssertionError(f"process {host_pid} has no memory cgroup")


@ROOT_ONLY
async def test_memory_limit_kills_a_hog(make_isolated: IsolatedFactory) -> None:
    """(tests/test_sandbox_limits.py has the sandbox's cgroup in detail.)"""
    m = await make_isolated(memory_mb=SMALL_MEMORY_MB)
    process = await m.spawn(ExecRequest(argv=("sleep", "1000")))
    try:
        assert memory_limit_of(await sandbox_host_pid(m, process.pid)) == SMALL_MEMORY_MB * 1024 * 1024
    finally:
        process.kill()
        await process.wait()
    hog = f"b = bytearray({HOG_BYTES}); print('allocated everything')"
    result = await m.exec(ExecRequest(argv=("python3", "-c", hog), timeout=SANDBOX_DEADLINE))
    assert b"allocated everything" not in result.stdout
    assert result.exit_code == 128 + signal.SIGKILL or b"MemoryError" in result.stderr, result
    assert (await sh(m, "echo alive")).stdout == b"alive\n"  # the machine survives its command


@ROOT_ONLY
async def test_pids_limit_stops_a_fork_bomb(make_isolated: IsolatedFactory) -> None:
    m = await make_isolated(pids=SMALL_PIDS)
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
    await m.stop()  # the forks outlive their parent: the stop ends them with the machine
    await m.start()
    assert (await sh(m, "echo alive")).stdout == b"alive\n"
