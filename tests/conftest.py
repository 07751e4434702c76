"""Shared fixtures: a real `agentbox serve` on a loopback port, with its own home."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import HostView, Mount
from agentbox.machines.local import LocalMachine
from agentbox.store.db import Database

#: Where a root test run keeps its temp dirs: below /var/tmp (sticky, world-searchable), so
#: the sandbox uid can reach session homes. pytest's own /tmp/pytest-of-root is 0700 and
#: pytest resets it to 0700 whenever any other pytest session starts on the machine.
ROOT_TEMP_PARENT = Path("/var/tmp")


def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp is None and os.geteuid() == 0 and ROOT_TEMP_PARENT.is_dir():
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="agentbox-tests-", dir=ROOT_TEMP_PARENT))
        base.chmod(0o755)
        config.option.basetemp = str(base / "t")
        config.stash[_OWN_BASE] = base


def pytest_unconfigure(config: pytest.Config) -> None:
    base = config.stash.get(_OWN_BASE, None)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


_OWN_BASE = pytest.StashKey[Path]()

if TYPE_CHECKING:
    from agentbox.config import Settings
    from agentbox.machines.base import Machine
    from agentbox.machines.docker import DockerHost, DockerMachine
    from agentbox.machines.images import Image
    from agentbox.machines.registry import Registry
    from agentbox.machines.sandbox import SandboxHost, SandboxMachine
    from agentbox.machines.ssh import SshMachine

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
    log: Path | None = None
    """The server's stdout and stderr."""
    kind: str = "sandbox"
    """The kind of the server's default machine (`kind_server`)."""
    user: str = "root"
    """The user the default machine's commands run as: the one `?user=` can give files to."""
    user_home: str = "/root"
    """That user's $HOME on the default machine."""
    shared_root: Path | None = None
    """The host directory that is the default machine's root when every session shares it
    (ssh on loopback); None when each session has its own workspace."""

    def client(self, **kwargs: object) -> httpx.Client:
        headers = {"X-AIO-API-Key": self.api_key} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]

    def log_tail(self) -> str:
        """The end of the server's log, for a failing assertion's message."""
        return log_tail(self.log) if self.log else ""

    @property
    def root(self) -> str:
        """The default machine's root (its working directory) as its commands see it."""
        return str(self.shared_root) if self.shared_root else "/workspace"

    def workspace(self, session_id: str) -> Path:
        """The host directory that holds the files of session `session_id`'s default machine."""
        return self.shared_root or self.home / "sessions" / session_id / "workspace"


#: Characters of a server's log that a failure message quotes.
LOG_TAIL = 4000


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL:]


@dataclass(frozen=True)
class HostUser:
    """An ordinary host user that a root test runs agentbox as (tests/test_nonroot.py)."""

    name: str
    uid: int
    gid: int
    home: Path

    @classmethod
    def named(cls, name: str) -> HostUser:
        entry = pwd.getpwnam(name)
        return cls(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))

    def popen_args(self) -> dict[str, Any]:
        """subprocess arguments that make the child this user: its uid, its gid, no other group."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name}


#: Server-wide sandbox caps for test servers: a shared server opens a sandbox per test, more
#: than the host-derived defaults admit at once; tests/adversarial/test_exhaustion.py tests the caps.
ROOMY = {"AGENTBOX_MAX_SANDBOXES": "100000", "AGENTBOX_MAX_SANDBOX_MEMORY_MB": "100000000"}


def start_server(
    home: Path,
    env: dict[str, str] | None = None,
    port: int | None = None,
    user: HostUser | None = None,
    python: Sequence[str] = (),
    args: Sequence[str] = (),
) -> Server:
    """`agentbox serve` on `home`, logging beside it; as `user` when given (the test is root),
    with `python` (default: this interpreter) as the command that runs Python with agentbox,
    and `args` added to `serve`'s (`--log-format json`)."""
    port = port or free_port()
    full_env = {
        **os.environ,
        **(user.env() if user else {}),
        "AGENTBOX_HOME": str(home),
        **ROOMY,
        **(env or {}),
    }
    log = open(home.parent / f"server-{port}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [*(python or [sys.executable]), "-m", "agentbox", "serve", "--port", str(port), *args],
        env=full_env,
        stdout=log,
        stderr=log,
        **(user.popen_args() if user else {}),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(
                f"server exited with {proc.returncode}; its log ends:\n{log_tail(Path(log.name))}"
            )
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Server(url, home, proc, (env or {}).get("AGENTBOX_API_KEY"), Path(log.name))
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    log.close()
    raise RuntimeError(f"server did not start; its log ends:\n{log_tail(Path(log.name))}")


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
    home = (
        traversable(tmp_path_factory.mktemp("srv"), tmp_path_factory) / "home"
    )  # sandbox uids bind below it
    home.mkdir()
    s = start_server(home)
    yield s
    stop_server(s)


# --- real bubblewrap sandboxes (test_sandbox_*.py, test_pathmap.py, test_registry.py) -------------

#: Seconds any sandbox condition (a process gone, a file written) may take before a test fails;
#: tests poll for the condition and only fail when this passes.
SANDBOX_DEADLINE = 20.0


def traversable(path: Path, factory: pytest.TempPathFactory) -> Path:
    """Let every uid search (not list) `path` and its ancestors up to pytest-of-<user>.

    pytest makes its temp dirs 0700; a root server's sandboxes run as an unprivileged uid,
    and bwrap resolves the sources of its binds by path as that uid, so a home below a
    0700 directory cannot be bound (see test_sandbox_lifecycle's test on that).
    """
    top = factory.getbasetemp().resolve().parent  # /tmp/pytest-of-<user> is 0700 too
    for p in [path.resolve(), *path.resolve().parents]:
        p.chmod(p.stat().st_mode | 0o011)
        if p == top:
            break
    return path


@pytest.fixture
def sandbox_tmp(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's tmp_path, reachable by the sandbox uid: the place for a test's AGENTBOX home."""
    return traversable(tmp_path, tmp_path_factory)


@pytest.fixture(scope="module")
def sandbox_host(tmp_path_factory: pytest.TempPathFactory) -> SandboxHost:
    """One SandboxHost per module: building its base /etc costs ~0.2 s; sandboxes stay per test."""
    from agentbox.machines.sandbox import SandboxHost

    return SandboxHost(traversable(tmp_path_factory.mktemp("sandbox-home"), tmp_path_factory))


SandboxFactory = Callable[..., Awaitable["SandboxMachine"]]


def images_dir() -> Path:
    """The images setup builds (`scripts/setup.sh`: base; `scripts/test.sh`: data), reused by
    every run: AGENTBOX_TEST_IMAGES, else the default home's (what `agentbox serve` uses)."""
    from agentbox.config import default_home

    return Path(os.environ.get("AGENTBOX_TEST_IMAGES") or default_home() / "images")


def built_image(name: str, profile: str, include: tuple[str, ...] = ()) -> Image:
    """The image `name` of `profile` (with the Debian packages `include` added), built if setup
    did not (a no-op when it is up to date)."""
    from agentbox.machines.images import ImageStore
    from agentbox.machines.sandbox import DEFAULT_SANDBOX_UID

    uid, gid = (
        (DEFAULT_SANDBOX_UID, DEFAULT_SANDBOX_UID) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    )
    store = ImageStore(images_dir(), uid, gid)
    return store.build(store.request(name, profile, include))


@pytest.fixture(scope="session")
def base_image() -> Image:
    return built_image("base", "base")


def image_sandbox_host(image: Image, factory: pytest.TempPathFactory) -> SandboxHost:
    """A SandboxHost with its own home whose sandboxes run on the shared images `image` is among."""
    from agentbox.machines.sandbox import SandboxHost

    home = traversable(factory.mktemp(f"image-home-{image.name}"), factory)
    return SandboxHost(home, images=image.path.parent)


@pytest.fixture(scope="module")
def image_host(tmp_path_factory: pytest.TempPathFactory, base_image: Image) -> SandboxHost:
    """A SandboxHost whose sandboxes run on the shared images (`base` by default)."""
    return image_sandbox_host(base_image, tmp_path_factory)


def sandbox_factory(host: SandboxHost, tmp: Path) -> tuple[SandboxFactory, list[SandboxMachine]]:
    """`make(config)` starts a sandbox of `host` with its own workspace and run dir under `tmp`."""
    from agentbox.ids import SANDBOX, new_id
    from agentbox.machines.sandbox import SandboxConfig, SandboxMachine

    made: list[SandboxMachine] = []

    async def make(config: SandboxConfig | None = None) -> SandboxMachine:
        sandbox_id = new_id(SANDBOX)
        d = tmp / sandbox_id
        m = SandboxMachine(
            "sandbox", sandbox_id, host, config or SandboxConfig(network=False), d / "workspace", d / "run"
        )
        made.append(m)
        await m.start()
        return m

    return make, made


@pytest.fixture
async def make_image_sandbox(image_host: SandboxHost, sandbox_tmp: Path) -> AsyncIterator[SandboxFactory]:
    """Like `make_sandbox`, on the `base` image."""
    make, made = sandbox_factory(image_host, sandbox_tmp)
    yield make
    for m in made:
        await m.stop()


@pytest.fixture
async def make_sandbox(sandbox_host: SandboxHost, sandbox_tmp: Path) -> AsyncIterator[SandboxFactory]:
    """Start sandboxes (network off unless a config says otherwise); all are stopped after the test.

    Each gets its own workspace and run directory under the test's (traversable) tmp_path.
    These run on the host-based fallback root (no image in their home).
    """
    make, made = sandbox_factory(sandbox_host, sandbox_tmp)
    yield make
    for m in made:
        await m.stop()


def host_pid_of(inside_pid: int, pid_namespace: int) -> int | None:
    """The host pid of the process that is `inside_pid` in the pid namespace with inode `pid_namespace`.

    Both numbers come from inside (`$$`, `readlink /proc/self/ns/pid`); the match uses the
    NSpid line of /proc/<pid>/status, whose last field is the pid in the innermost namespace.
    """
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/pid").st_ino != pid_namespace:
                continue
            status = Path(f"/proc/{entry.name}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and int(line.split()[-1]) == inside_pid:
                return int(entry.name)
    return None


def sandbox_settings(home: Path, **sandbox_options: object) -> Settings:
    """Settings with a per-session `sandbox` (network off unless given) and a shared `local`."""
    from agentbox.config import MachineConfig, Settings

    return Settings(
        home=home,
        machines={
            "sandbox": MachineConfig("sandbox", "sandbox", {"network": "off", **sandbox_options}),
            "local": MachineConfig("local", "local", {"root": str(home / "local")}),
        },
    )


@dataclass
class RegistryKit:
    """A registry over a real SQLite file in its home, as a server holds it."""

    registry: Registry
    db: Database
    settings: Settings

    @property
    def home(self) -> Path:
        return self.settings.home

    async def close(self) -> None:
        """What a server's shutdown does: machines closed, markers left as they are."""
        await self.registry.shutdown()
        await self.db.close()


RegistryFactory = Callable[..., Awaitable[RegistryKit]]


@pytest.fixture
async def make_registry(sandbox_tmp: Path) -> AsyncIterator[RegistryFactory]:
    """Registries (one home per test: `sandbox_tmp/home`), all closed after the test."""
    from agentbox.machines.registry import Registry
    from agentbox.store.markers import MarkersRepo

    kits: list[RegistryKit] = []

    async def make(settings: Settings | None = None) -> RegistryKit:
        settings = settings or sandbox_settings(sandbox_tmp / "home")
        db = await Database.in_home(settings.home).connect()
        registry = Registry(settings, MarkersRepo(db))
        kits.append(RegistryKit(registry, db, settings))
        return kits[-1]

    yield make
    for kit in reversed(kits):
        await kit.close()


async def sandbox_host_pid(m: Machine, inside_pid: int) -> int:
    """The host pid of the machine's process `inside_pid` (a pid as its own pid namespace
    numbers it: a sandbox's or a container's)."""
    from agentbox.machines.base import ExecRequest

    probe = await m.exec(ExecRequest(command="readlink /proc/self/ns/pid", timeout=SANDBOX_DEADLINE))
    namespace = int(probe.stdout.decode().strip().removeprefix("pid:[").rstrip("]"))
    found = host_pid_of(inside_pid, namespace)
    assert found is not None, f"no host process is pid {inside_pid} of the sandbox"
    return found


# --- seed 002's demo file and a sandbox-like view of a host directory ---------------------

APP = (
    "import sys\n\n"
    "def main():\n"
    "    # TODO: read the input path from argv\n"
    "    print('hello')\n\n"
    "if __name__ == '__main__':\n"
    "    main()\n"
)


class Mounted(HostFiles):
    """A machine view like a sandbox's: `/workspace` is a host directory somewhere else."""

    def __init__(self, name: str, workspace: Path) -> None:
        self.name = name
        self.root = "/workspace"
        self.view = HostView([Mount("/workspace", workspace)], "/workspace")


# --- a SQLite file and a local machine on a plain folder (store and tools tests) -------------


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    """The test's own database file, under tmp_path/home."""
    async with Database.in_home(tmp_path / "home") as database:
        yield database


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """An empty workspace folder."""
    root = tmp_path / "ws"
    root.mkdir()
    return root


def host_fingerprint(path: Path | str) -> str:
    """`tools.fingerprint` of a host file the test made (through a local machine's view of /).

    Callable from sync tests and from inside a running event loop alike: the coroutine runs on
    a loop of its own in a worker thread."""
    from agentbox.tools.fingerprint import fingerprint

    machine = LocalMachine("fingerprint", Path(path).parent)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fingerprint(machine, str(path))).result()


@pytest.fixture
def machine(ws: Path) -> LocalMachine:
    """A local machine rooted at `ws`."""
    return LocalMachine("local", ws)


# --- a private dockerd (test_docker_machine.py, bench/bench_docker.py) -------------------------

#: Where the test dockerd keeps its images between runs: an image is imported once per digest
#: (`agentbox/<name>:<digest>`), about 12 s for `base`, and a rerun finds it there.
DOCKERD_CACHE = Path("/var/tmp/agentbox-test-dockerd")
#: Seconds a private dockerd may take to answer on its socket.
DOCKERD_START_TIMEOUT = 60.0
#: Seconds it gets to stop (it stops its containers and its containerd) before it is killed.
DOCKERD_STOP_TIMEOUT = 30.0


@dataclass
class Dockerd:
    """A dockerd of the test run's own, on its own socket, with no bridge and no iptables."""

    host: str
    """`unix://...`: the `docker_host` of the machines that use it."""
    process: subprocess.Popen[bytes]
    data_root: Path
    log: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The docker CLI against this daemon: what an operator would do behind agentbox's back."""
        docker = shutil.which("docker") or "docker"
        return subprocess.run(
            [docker, "-H", self.host, *args], capture_output=True, text=True, timeout=DOCKERD_START_TIMEOUT
        )


def start_dockerd(run: Path, data_root: Path) -> Dockerd:
    """`dockerd` from Debian's docker.io, its sockets and state under `run`, images in `data_root`."""
    import fcntl

    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise RuntimeError("dockerd is missing: apt-get install docker.io (scripts/test.sh does)")
    data_root.mkdir(parents=True, exist_ok=True)
    lock = os.open(data_root.parent / f"{data_root.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:  # another run holds the cache: this one imports into a data root of its own
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        data_root = run / "data"
    (run / "daemon.json").write_text("{}")  # never the host's /etc/docker/daemon.json
    log = run / "dockerd.log"
    sock = run / "docker.sock"
    proc = subprocess.Popen(
        [dockerd, "--config-file", str(run / "daemon.json"), "--data-root", str(data_root),
         "--exec-root", str(run / "exec"), "-H", f"unix://{sock}", "--bridge=none", "--iptables=false",
         "--pidfile", str(run / "pid"), "--log-level=warn"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    daemon = Dockerd(f"unix://{sock}", proc, data_root, log)
    deadline = time.monotonic() + DOCKERD_START_TIMEOUT
    while daemon.cli("version").returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_dockerd(daemon)
            raise RuntimeError(f"dockerd did not start; its log ends:\n{log_tail(log)}")
        time.sleep(0.2)
    return daemon


def remove_agentbox_containers(daemon: Dockerd) -> None:
    """Every container a machine made on this daemon (a killed run leaves some in the cache)."""
    ids = daemon.cli("ps", "-aq", "--filter", "label=agentbox.id").stdout.split()
    if ids:
        daemon.cli("rm", "-f", *ids)


def stop_dockerd(daemon: Dockerd) -> None:
    daemon.process.terminate()
    try:
        daemon.process.wait(DOCKERD_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        daemon.process.kill()
        daemon.process.wait()


@pytest.fixture(scope="session")
def dockerd() -> Iterator[Dockerd]:
    """One private dockerd for the test session, stopped at its end; its images stay cached."""
    import tempfile

    run = Path(tempfile.mkdtemp(prefix="agentbox-dockerd-"))  # short: socket paths hold 108 bytes
    daemon = start_dockerd(run, DOCKERD_CACHE / "data")
    remove_agentbox_containers(daemon)
    yield daemon
    remove_agentbox_containers(daemon)
    stop_dockerd(daemon)
    shutil.rmtree(run, ignore_errors=True)


DockerFactory = Callable[..., Awaitable["DockerMachine"]]


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory: pytest.TempPathFactory, base_image: Image) -> DockerHost:
    from agentbox.machines.docker import DockerHost

    return DockerHost(tmp_path_factory.mktemp("docker-home"), images=base_image.path.parent)


@pytest.fixture
async def make_docker(
    docker_host: DockerHost, dockerd: Dockerd, tmp_path: Path
) -> AsyncIterator[DockerFactory]:
    """`await make(**options)`: a started docker machine; every container is removed after the test."""
    from agentbox.ids import SANDBOX, new_id
    from agentbox.machines.docker import DockerMachine, DockerOptions

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


# --- a machine of each kind that isolates (tests/test_sandbox_isolation.py) -----------------

#: The kinds whose machines are isolated from the host, each on the `base` image.
ISOLATING_KINDS = ("sandbox", "docker")
MIB = 1024 * 1024
IsolatedFactory = Callable[..., Awaitable["SandboxMachine | DockerMachine"]]


@pytest.fixture(params=ISOLATING_KINDS)
def make_isolated(request: pytest.FixtureRequest) -> IsolatedFactory:
    """`await make(network=False, memory_mb=0, pids=0)`: a started machine of each isolating kind
    (0: the kind's default limit); every one is stopped (a container removed) after the test."""
    from agentbox.machines.cgroups import Limits
    from agentbox.machines.sandbox import SandboxConfig

    if request.param == "docker":
        make_docker: DockerFactory = request.getfixturevalue("make_docker")

        async def docker(network: bool = False, memory_mb: int = 0, pids: int = 0) -> DockerMachine:
            limits = {k: v for k, v in (("memory_mb", memory_mb), ("pids", pids)) if v}
            return await make_docker(network="on" if network else "off", **limits)

        return docker
    make_sandbox: SandboxFactory = request.getfixturevalue("make_image_sandbox")

    async def sandbox(network: bool = False, memory_mb: int = 0, pids: int = 0) -> SandboxMachine:
        limits = Limits(memory_bytes=memory_mb * MIB or Limits().memory_bytes, pids=pids or Limits().pids)
        return await make_sandbox(SandboxConfig(network=network, limits=limits))

    return sandbox


# --- a real sshd on loopback (the ssh machine kind) ------------------------------------------

#: Debian's sshd and its SFTP server (openssh-server, installed by scripts/test.sh).
SSHD = Path("/usr/sbin/sshd")
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
#: The directory a root sshd needs for privilege separation (made at boot on a full system).
SSHD_PRIVSEP_DIR = Path("/run/sshd")
#: Seconds sshd may take to listen.
SSHD_START_TIMEOUT = 10.0
#: The account a root test run logs in as: kept between runs (like test_nonroot's), with /bin/sh
#: as its login shell, so no rc file of root's (a pyenv init costs 300 ms a command) is timed.
SSH_USER = "agentbox-ssh"


@dataclass
class Sshd:
    """An sshd on 127.0.0.1:`port` with its own host key, trusting `user_key` (tests/test_ssh_machine.py)."""

    port: int
    dir: Path
    user: str
    """Whom `options` logs in as."""
    password: str | None
    """That user's password, when the test run could set one (as root)."""
    host_key: str
    """The host's public key line (`ssh-ed25519 AAAA...`)."""
    user_key: Path
    known_hosts: Path
    process: subprocess.Popen[bytes]
    log: Path

    def options(self, **overrides: object) -> dict[str, object]:
        """`[machines.<name>]` options of an ssh machine logging in as this process's user."""
        base: dict[str, object] = {
            "host": "127.0.0.1", "port": self.port, "user": self.user,
            "key_file": str(self.user_key), "known_hosts": str(self.known_hosts),
        }  # fmt: skip
        return {**base, **overrides}

    def owned_dir(self, path: Path) -> Path:
        """Make `path` a directory of the login user's (a machine's root, say)."""
        path.mkdir(parents=True, exist_ok=True)
        entry = pwd.getpwnam(self.user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        return path

    def sessions(self) -> list[int]:
        """Pids of the sshd processes that serve connections (every descendant named sshd)."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                comm_end = stat.rfind(")")
                if stat[stat.find("(") + 1 : comm_end] == "sshd":
                    parents[int(entry)] = int(stat[comm_end + 2 :].split()[1])
        found, frontier = [], {self.process.pid}
        while frontier:
            frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
            found += sorted(frontier)
        return found

    def drop_connections(self) -> int:
        """SIGKILL every connection's sshd (the commands they ran keep running); how many."""
        pids = self.sessions()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def log_tail(self) -> str:
        return log_tail(self.log)


#: Where SSH_USER's password is kept (root only, 0600), so that every process of a run (the
#: tests, and the bench scripts the smoke tests start) sets and expects the same one.
SSH_PASSWORD_FILE = Path("/var/tmp/agentbox-test-ssh-password")


@functools.cache
def ssh_user() -> tuple[str, str | None]:
    """The login user and its password: SSH_USER with a password of its own as root (the same
    for every process and sshd: a second process setting a new one would lock the first one's
    logins out), else oneself."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name, None
    if subprocess.run(["id", SSH_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", SSH_USER], check=True)
    try:
        fd = os.open(SSH_PASSWORD_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        password = SSH_PASSWORD_FILE.read_text().strip()
    else:
        password = secrets.token_urlsafe(16)
        with os.fdopen(fd, "w") as f:
            f.write(password)
    subprocess.run(["chpasswd"], input=f"{SSH_USER}:{password}\n", text=True, check=True)
    return SSH_USER, password


def start_sshd(where: Path, config: str = "") -> Sshd:
    """sshd -D on a free loopback port, keys and config in `where`; `config` is added to sshd_config.

    `where` must be searchable by the login user: sshd reads authorized_keys as that user.
    """
    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o755)
    user, password = ssh_user()
    for name in ("host_ed25519", "user_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(where / name)], check=True)
    host_key = " ".join((where / "host_ed25519.pub").read_text().split()[:2])
    (where / "authorized_keys").write_text((where / "user_ed25519.pub").read_text())
    (where / "authorized_keys").chmod(0o644)
    port = free_port()
    known_hosts = where / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_key}\n")
    (where / "sshd_config").write_text(
        "ListenAddress 127.0.0.1\n"
        f"AuthorizedKeysFile {where / 'authorized_keys'}\n"
        f"PidFile {where / 'sshd.pid'}\n"
        "UsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
        f"Subsystem sftp {SFTP_SERVER}\n{config}"
    )
    if os.geteuid() == 0:
        SSHD_PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    log = where / "sshd.log"
    config_file, key = where / "sshd_config", where / "host_ed25519"
    argv = [str(SSHD), "-D", "-e", "-f", str(config_file), "-p", str(port), "-h", str(key)]
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out)
    deadline = time.monotonic() + SSHD_START_TIMEOUT
    while b"Server listening" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"sshd did not start; its log ends:\n{log_tail(log)}")
        time.sleep(0.02)
    return Sshd(port, where, user, password, host_key, where / "user_ed25519", known_hosts, process, log)


def stop_sshd(sshd: Sshd) -> None:
    sshd.process.terminate()
    sshd.process.wait(10)
    for pid in sshd.sessions():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """One sshd for the test session (it serves many machines and connections)."""
    server = start_sshd(
        traversable(tmp_path_factory.mktemp("sshd"), tmp_path_factory), "PasswordAuthentication yes\n"
    )
    yield server
    stop_sshd(server)


SshFactory = Callable[..., Awaitable["SshMachine"]]


@pytest.fixture
def remote_root(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, sshd: Sshd) -> Path:
    """A directory of the login user's own, reachable by it: the machine's root."""
    return sshd.owned_dir(traversable(tmp_path, tmp_path_factory) / "remote")


@pytest.fixture
async def make_ssh(sshd: Sshd, remote_root: Path) -> AsyncIterator[SshFactory]:
    """`await make(**options)`: a started machine on `sshd` rooted at `remote_root`, closed after."""
    from agentbox.machines.ssh import SshMachine, SshOptions

    made: list[SshMachine] = []

    async def make(server: Sshd = sshd, env: dict[str, str] | None = None, **overrides: object) -> SshMachine:
        options = SshOptions.from_options(server.options(**{"root": str(remote_root), **overrides}))
        machine = SshMachine("remote", options, env)
        made.append(machine)
        await machine.start()
        return machine

    yield make
    for machine in made:
        await machine.close()


@pytest.fixture
async def ssh(make_ssh: SshFactory) -> SshMachine:
    """A started ssh machine rooted at `remote_root`."""
    return await make_ssh()


# --- one server per machine kind: the same tests on every engine ----------------------------

#: The kinds a server's default machine is in `kind_server`, each on a real engine:
#: bubblewrap, the test run's private dockerd, the loopback sshd.
SERVER_KINDS = ("sandbox", "docker", "ssh")
#: The name of the default machine of a `kind_server` that is not the plain sandbox server.
KIND_MACHINE = "box"


def toml_entry(options: dict[str, object]) -> str:
    """`key = value` lines of a `[machines.<name>]` entry (JSON strings and numbers are TOML's)."""
    import json

    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in options.items())


def start_kind_server(
    home: Path,
    kind: str,
    user: tuple[str, str],
    options: dict[str, object],
    env: dict[str, str] | None = None,
) -> Server:
    """`agentbox serve` on `home` whose default machine is a `kind` machine with `options`,
    whose commands run as `user` (its name and $HOME)."""
    config = home.parent / "agentbox.toml"
    config.write_text(
        f'default_machine = "{KIND_MACHINE}"\n[machines.{KIND_MACHINE}]\nkind = "{kind}"\n'
        + toml_entry(options)
    )
    server = start_server(home, {"AGENTBOX_CONFIG": str(config), **(env or {})})
    server.kind, (server.user, server.user_home) = kind, user
    return server


@pytest.fixture(scope="session", params=SERVER_KINDS)
def kind_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real server whose default machine (what `/sandboxes/<id>` reaches) is of each kind in
    turn. "sandbox" is the session's `server`; the others start their engine only when used, and
    live for the test session (pytest groups the tests by kind), so each kind costs one start."""
    kind: str = request.param
    if kind == "sandbox":
        yield request.getfixturevalue("server")
        return
    home = traversable(tmp_path_factory.mktemp(f"srv-{kind}"), tmp_path_factory) / "home"
    home.mkdir()
    if kind == "docker":
        daemon: Dockerd = request.getfixturevalue("dockerd")
        image: Image = request.getfixturevalue("base_image")
        from agentbox.machines.docker import CONTAINER_HOME, CONTAINER_USER

        server = start_kind_server(
            home, kind, (CONTAINER_USER, CONTAINER_HOME), {"docker_host": daemon.host},
            {"AGENTBOX_IMAGES": str(image.path.parent)},
        )  # fmt: skip
    else:
        sshd: Sshd = request.getfixturevalue("sshd")
        root = sshd.owned_dir(home.parent / "remote-root")
        account = (sshd.user, pwd.getpwnam(sshd.user).pw_dir)
        server = start_kind_server(home, kind, account, sshd.options(root=str(root)))
        server.shared_root = root
    yield server
    stop_server(server)


def clear_scratch(server: Server, paths: Iterable[str]) -> None:
    """Remove what earlier tests left at these absolute paths of a machine every session shares.

    A sandbox or a container has a /tmp of its own per session; an ssh machine on loopback has
    this host's, so tests that expect a fresh `/tmp/demo` start by clearing it there.
    """
    if server.shared_root is None:
        return
    for path in paths:
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def on_kinds(*kinds: str) -> pytest.MarkDecorator:
    """Run a test that takes `kind_server` on these kinds only (the reason in a comment beside it)."""
    return pytest.mark.parametrize("kind_server", kinds, indirect=True)


# --- agentbox's own E2B endpoint on loopback (the e2b machine kind) --------------------------

#: The API key of the E2B endpoint server.
E2B_API_KEY = "e2b-machine-key"
#: The E2B sandbox lifetime the e2b machines of the tests ask for (refreshed while they run).
E2B_TIMEOUT_SECONDS = 600


@pytest.fixture(scope="session")
def e2b_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """agentbox serving E2B on a loopback port: the endpoint every e2b machine of the tests
    points at (tests/test_e2b_machine.py, the file tools' `box`)."""
    home = traversable(tmp_path_factory.mktemp("e2b-endpoint"), tmp_path_factory) / "home"
    home.mkdir()
    server = start_server(home, env={"AGENTBOX_API_KEY": E2B_API_KEY})
    yield server
    stop_server(server)


def e2b_entry(endpoint: Server, **overrides: object) -> dict[str, object]:
    """The `[machines.<name>]` options of an e2b machine on `endpoint`, rooted at /workspace."""
    base: dict[str, object] = {
        "api_url": endpoint.url, "sandbox_url": endpoint.url, "api_key": E2B_API_KEY,
        "root": "/workspace", "user": "root", "timeout": E2B_TIMEOUT_SECONDS,
    }  # fmt: skip
    return {**base, **overrides}


def start_e2b_client(home: Path, endpoint: Server) -> Server:
    """A server whose default machine is an e2b machine on `endpoint`, its key stored sealed."""
    import json

    from agentbox.secrets import SecretBox

    sealed = e2b_entry(endpoint, api_key=SecretBox(home).encrypt(E2B_API_KEY))
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in sealed.items())
    config = home.parent / "agentbox.toml"
    config.write_text(f'default_machine = "cloud"\n[machines.cloud]\nkind = "e2b"\nmemory_mb = 0\n{lines}')
    return start_server(home, {"AGENTBOX_CONFIG": str(config)})


def point_e2b_sdk(mp: pytest.MonkeyPatch, server: Server) -> None:
    """The stock `e2b` SDK's environment as a user sets it for a self-hosted server."""
    mp.setenv("E2B_API_URL", server.url)
    mp.setenv("E2B_SANDBOX_URL", server.url)
    mp.setenv("E2B_API_KEY", server.api_key or "unchecked")  # the SDK wants one; a keyless server ignores it
    mp.delenv("E2B_DEBUG", raising=False)


#: Seconds between two looks of `eventually`.
POLL_SECONDS = 0.1


def eventually(check: Callable[[], bool], what: str, within: float = SANDBOX_DEADLINE) -> None:
    """Wait (blocking) until `check()` holds; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {within}s for {what}")
        time.sleep(POLL_SECONDS)


# -------------------------------------------------------------------- the browser

#: The machine of `browser_server`: a sandbox on the data image (which has Chromium) with the
#: browser enabled; network off, so its pages are those served inside the sandbox.
BROWSER_MACHINE = "web"


@pytest.fixture(scope="session")
def data_image() -> Image:
    """The `data` image (`scripts/test.sh` builds it): its tools, and Chromium for the browser."""
    return built_image("data", "data")


@pytest.fixture(scope="session")
def browser_server(tmp_path_factory: pytest.TempPathFactory, data_image: Image) -> Iterator[Server]:
    """A real server whose default machine is a browser-enabled sandbox on the data image."""
    home = traversable(tmp_path_factory.mktemp("srv-browser"), tmp_path_factory) / "home"
    home.mkdir()
    config = home.parent / "agentbox.toml"
    config.write_text(
        f'default_machine = "{BROWSER_MACHINE}"\ndelegable = ["{BROWSER_MACHINE}"]\n'
        f'[machines.{BROWSER_MACHINE}]\nkind = "sandbox"\nimage = "data"\nbrowser = true\nnetwork = "off"\n'
    )
    server = start_server(
        home, {"AGENTBOX_CONFIG": str(config), "AGENTBOX_IMAGES": str(data_image.path.parent)}
    )
    yield server
    stop_server(server)


# -------------------------------------------------------------------- the code interpreter

#: The image code contexts run on in the tests: the `data` profile, which has a Jupyter kernel
#: and matplotlib (what a user of the code interpreter runs it on). scripts/test.sh builds it,
#: so no test's time limit waits on the build.
KERNEL_IMAGE = "data"


@pytest.fixture(scope="session")
def kernel_image(data_image: Image) -> Image:
    """The image whose sandboxes run code contexts (`agentbox.workspace.kernels`)."""
    return data_image


#: The machine of `kernel_server`: a sandbox on the kernel image, network off.
KERNEL_MACHINE = "kernels"


def kernel_machine_env(home: Path, kernel_image: Image) -> dict[str, str]:
    """A server's environment (for `start_server` on `home`) whose default machine's sandboxes
    run on the kernel image, network off."""
    config = home.parent / "agentbox.toml"
    config.write_text(
        f'default_machine = "{KERNEL_MACHINE}"\n'
        f'[machines.{KERNEL_MACHINE}]\nkind = "sandbox"\nimage = "{KERNEL_IMAGE}"\nnetwork = "off"\n'
    )
    return {"AGENTBOX_CONFIG": str(config), "AGENTBOX_IMAGES": str(kernel_image.path.parent)}


@pytest.fixture(scope="session")
def kernel_server(tmp_path_factory: pytest.TempPathFactory, kernel_image: Image) -> Iterator[Server]:
    """A real server whose default machine's sandboxes can run code contexts."""
    home = traversable(tmp_path_factory.mktemp("srv-kernel"), tmp_path_factory) / "home"
    home.mkdir()
    server = start_server(home, kernel_machine_env(home, kernel_image))
    yield server
    stop_server(server)
