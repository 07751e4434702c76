"""The `docker` kind: one container per session on the operator's dockerd, root `/workspace`.

A container's root is an agentbox image (`images.py`), imported into the engine once per
image content (`docker import` of its tree, tagged `agentbox/<name>:<12 hex of its digest>`)
and reused by every container of it. The container gets:

- `/workspace` bound from the session's workspace directory (the only thing that lasts);
- a read-only root with size-limited tmpfs `/tmp` and `$HOME` (CONTAINER_HOME), emptied at
  every stop as a sandbox's are; with `writable_root`, the container's own writable layer
  instead, which lasts as long as the container (stops and starts included) and is
  discarded with it. Read-only is the default: a suspended session comes back to its
  workspace alone, the same on a sandbox and here, and nothing piles up in the engine's
  storage. (The image's files belong to the container's uid, so a writable root would let
  it change its system as a sandbox's mapped root can, `apt` aside: dpkg wants uid 0);
- the image owner's uid (64999 for a root server; `user` to choose another, never 0), no
  capabilities, `no-new-privileges`, a private IPC namespace, memory (swap included),
  pids and CPU limits, and no network (`--network none`) unless `network` is on (the
  engine's default bridge: unlike a sandbox's slirp4netns, that reaches the host's and other
  containers' addresses on the bridge);
- never the Docker socket; of the host only `/workspace`, the lifetime's `run/` (below)
  and the server's ripgrep, both read-only.

Commands do not go through `docker exec` (tens of milliseconds each): the exec agent
(`exec_agent.py`) is the container's pid 1, and the server talks to it as to a sandbox's
(`agent_channel.py`). Its socket crosses into the container as a path: each lifetime the
server makes its `run/` directory (bound read-only at CONTAINER_RUN) with the agent's source
and a listening SOCK_SEQPACKET socket, starts the container, and accepts one connection,
from the container's pid 1 only (SO_PEERCRED against the engine's pid), before it closes
the listener. Files go through the host as for a sandbox (`HostFiles`): `/workspace` is a
host directory, and the agent hands over its `/tmp`, `$HOME`, `/usr` and `/etc` at `R`.

Lifecycle:

    (none) ──start: import once, create, start──▶ running ──stop──▶ stopped (container kept)
                                                     ▲                   │
                                                     └──────start────────┘   destroy: removed

The container's id is `container_id`; a machine built with that id (after the server
restarted) checks that the container is this machine's (its labels) and starts it again
instead of making a new one. When the agent's socket ends (the agent died, or someone
removed or stopped the container) the machine stops itself, and the next call says why:
`ContainerGone` once the engine no longer knows the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from agentbox.config import home_label
from agentbox.machines import exec_agent
from agentbox.machines.agent_channel import AgentChannel, AgentProcess
from agentbox.machines.base import OS, TRASH_COVER_BYTES, TRASH_DIR, ExecRequest, ExecResult, collect
from agentbox.machines.binaries import reachable_copy, ripgrep_binary
from agentbox.machines.docker_engine import DEFAULT_DOCKER_HOST, Engine
from agentbox.machines.errors import ContainerGone, ImageError, MachineError, MachineUnavailable
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import Alias, HostView, Mount
from agentbox.machines.images import DEFAULT_IMAGE, Image, ImageStore
from agentbox.machines.shared_run import SharedRun

#: Seconds from the container's start to its agent saying "ready".
START_TIMEOUT = 30.0
#: Starts tried when the engine's runtime fails to create the container's process, and the
#: pause before the next one (times the attempt's number), on one container; then a container
#: with nothing to keep is replaced once (see `DockerMachine._boot`).
START_ATTEMPTS = 3
START_RETRY_PAUSE = 0.2
RUNTIME_FAILURE = "OCI runtime create failed"
#: Seconds `docker stop` waits after SIGTERM before SIGKILL (the agent leaves at once on EOF).
STOP_GRACE = 2
#: Where the lifetime's `run/` directory (the agent's source and socket) is bound, read-only.
CONTAINER_RUN = "/.agentbox/run"
#: Where the server's ripgrep is bound read-only (searches run it in the container).
CONTAINER_RG = "/.agentbox/bin/rg"
AGENT_SOCKET = "agent.sock"
AGENT_FILE = "exec_agent.py"
AGENT_SOURCE = Path(exec_agent.__file__).read_text()
CONTAINER_HOME = "/home/agent"
CONTAINER_USER = "agent"
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The account files made for each lifetime in `run/` and bound over the image's, so that
#: the container's uid is CONTAINER_USER (`account_files`).
ACCOUNT_FILES = ("passwd", "group")
#: The login shell of CONTAINER_USER's entry.
CONTAINER_SHELL = "/bin/sh"
#: Directories the agent hands over at `R`, in this order: the tmpfs, then the system.
SHARED_DIRS = ("/tmp", CONTAINER_HOME, "/usr", "/etc")
#: Mode of `run/`, owned by the container's uid: only it (and root) passes.
RUN_DIR_MODE = 0o700
#: Repository of the imported images: `agentbox/<image name>:<tag>` (`image_tag`).
IMAGE_REPO = "agentbox"
DIGEST_TAG_HEX = 12
#: Labels every container carries: what made it and for which machine.
LABEL_ID, LABEL_MACHINE, LABEL_IMAGE = "agentbox.id", "agentbox.machine", "agentbox.image"
#: The label naming the server home a container belongs to (`home_label`): a sweep removes only
#: its own home's leftovers, never another server's on the same engine.
LABEL_HOME = "agentbox.home"
#: Bytes read from the image's tar stream at a time while importing it.
TAR_CHUNK = 1 << 20
#: Log of a container's pid 1 (the agent says nothing unless it fails): json-file, capped.
LOG_CONFIG = {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}}
ROOT_UID = 0
#: The engine's default network, which `network = "on"` joins.
BRIDGE = "bridge"

DEFAULT_MEMORY_MB = 2048
DEFAULT_PIDS = 512
DEFAULT_CPUS = 1.0
DEFAULT_TMP_MB = 1024
DEFAULT_HOME_MB = 512
DEFAULT_DISK_MB = 0


@dataclass(frozen=True)
class DockerOptions:
    """A `[machines.<name>]` entry of kind `docker`."""

    image: str = DEFAULT_IMAGE
    """The agentbox image the containers run on (`agentbox image build NAME`); it must be built."""
    docker_host: str = DEFAULT_DOCKER_HOST
    """The engine: `unix:///path/to/docker.sock` or `tcp://host:port` (no TLS)."""
    network: bool = False
    """On: the engine's default bridge (reaches other bridge addresses, the host's too); off: none."""
    memory_mb: int = DEFAULT_MEMORY_MB
    """Memory of a container, swap included, in MiB; 0: no limit. Its tmpfs count in it."""
    pids: int = DEFAULT_PIDS
    """Processes and threads a container may have at once; 0: no limit."""
    cpus: float = DEFAULT_CPUS
    """CPUs' worth of time a container may use; 0: no limit."""
    tmp_mb: int = DEFAULT_TMP_MB
    """Size of the container's `/tmp` (tmpfs)."""
    home_mb: int = DEFAULT_HOME_MB
    """Size of the container's `$HOME` (tmpfs, `/home/agent`)."""
    user: str = ""
    """`uid` or `uid:gid` the container runs as; "": the image's owner. Never root."""
    writable_root: bool = False
    """The container's own writable layer instead of a read-only root: kept across stop and
    start, discarded when the container is removed."""
    disk_mb: int = DEFAULT_DISK_MB
    """Size of the session's workspace image (applied by the registry, as for sandboxes)."""

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> DockerOptions:
        """Validate a TOML entry's options (kind, level, env and allow_full_auto already taken out)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) for a docker machine: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for key, value in options.items():
            values[key] = _option(key, value, known[key].default)
        made = cls(**values)
        made.uid_gid(None)  # a user that names root is refused here, not at the first start
        Engine(made.docker_host)  # so is a docker_host that names no engine
        return made

    def uid_gid(self, image: Image | None) -> tuple[int, int]:
        """The container's uid and gid: `user`, else the image's owner."""
        if not self.user:
            if image is None:
                return (-1, -1)
            return image.manifest.uid, image.manifest.gid
        uid_text, _, gid_text = self.user.partition(":")
        if not uid_text.isdigit() or (gid_text and not gid_text.isdigit()):
            raise ValueError(f"user {self.user!r}: a numeric uid or uid:gid")
        uid = int(uid_text)
        if uid == ROOT_UID:
            raise ValueError("user: a docker machine never runs as root (uid 0)")
        return uid, int(gid_text) if gid_text else uid


def account_files(etc: Path, uid: int, gid: int) -> dict[str, str]:
    """The image's `passwd` and `group` (from its `etc`) with `uid` named CONTAINER_USER.

    The image's accounts are a sandbox's (root inside); a container runs as the image's owner
    uid, which no entry names. Without one, `whoami` fails, `stat` says UNKNOWN and the user
    the machine reports (`USER`, `?user=`) is not one the container knows. Any entry that
    already has the name or the id gives way to the container's.
    """

    def kept(name: str, key: int) -> list[str]:
        path = etc / name
        lines = path.read_text().splitlines() if path.is_file() and not path.is_symlink() else []
        return [line for line in lines if not _names(line, CONTAINER_USER, key)]

    user = f"{CONTAINER_USER}:x:{uid}:{gid}::{CONTAINER_HOME}:{CONTAINER_SHELL}"
    group = f"{CONTAINER_USER}:x:{gid}:"
    return {
        "passwd": "\n".join([*kept("passwd", uid), user]) + "\n",
        "group": "\n".join([*kept("group", gid), group]) + "\n",
    }


def _names(entry: str, name: str, key: int) -> bool:
    """Whether an account file's line has this name or this id (its third field)."""
    parts = entry.split(":")
    return parts[0] == name or (len(parts) > 2 and parts[2] == str(key))


def _option(key: str, value: Any, default: Any) -> Any:
    """One option, as the type of its default; numbers never negative."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text not in ("on", "off", "true", "false", "1", "0"):
            raise ValueError(f"{key} = {value!r}: on or off")
        return text in ("on", "true", "1")
    if isinstance(default, int | float):
        try:
            number = type(default)(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} = {value!r}: a number") from None
        if number < 0:
            raise ValueError(f"{key} = {value!r}: not negative")
        return number
    if not isinstance(value, str):
        raise ValueError(f"{key} = {value!r}: a string")
    return value


class DockerHost:
    """What one server shares among its docker machines: engines, images, the imports done."""

    def __init__(self, home: Path, images: Path | None = None) -> None:
        self.home = home
        self.images = ImageStore(images or home / "images")
        self._engines: dict[str, Engine] = {}
        self._imports: dict[str, asyncio.Lock] = {}
        self._imported: set[str] = set()
        self._rg: str | None = None

    @property
    def label(self) -> str:
        """This server home's `LABEL_HOME` value."""
        return home_label(self.home)

    async def sweep(self, docker_hosts: Iterable[str], keep: set[str]) -> list[str]:
        """Remove this home's containers whose machine id is not in `keep` (live sessions' ones).

        They are left by a server that died before closing its sessions, or by sessions closed
        while the engine was away. Returns the ids removed.
        """
        removed: list[str] = []
        for docker_host in sorted(set(docker_hosts)):
            engine = self.engine(docker_host)
            for container in await engine.containers(f"{LABEL_HOME}={self.label}"):
                if (container.get("Labels") or {}).get(LABEL_ID) not in keep:
                    await engine.remove(str(container["Id"]))
                    removed.append(str(container["Id"]))
        return removed

    def engine(self, docker_host: str) -> Engine:
        if docker_host not in self._engines:
            self._engines[docker_host] = Engine(docker_host)
        return self._engines[docker_host]

    def ripgrep(self) -> str:
        """A copy of the server's rg that outlives upgrades (a container's binds are fixed)."""
        if self._rg is None:
            tools = self.home / "docker" / "bin"
            tools.mkdir(parents=True, exist_ok=True)
            self._rg = str(reachable_copy(ripgrep_binary(), tools))
        return self._rg

    def image(self, name: str) -> Image:
        try:
            return self.images.get(name)
        except ImageError as exc:
            raise MachineUnavailable(exc.message) from exc

    async def ensure_imported(self, engine: Engine, image: Image) -> str:
        """The engine's tag for `image`, imported first if the engine does not have it yet."""
        digest = image_tag(image)
        reference = f"{IMAGE_REPO}/{image.name}:{digest}"
        key = f"{engine.docker_host} {reference}"
        lock = self._imports.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._imported or await engine.image_exists(reference):
                self._imported.add(key)
                return reference
            try:
                lease = self.images.lease(image.name)  # no rebuild or rm while its tree is read
            except ImageError as exc:
                raise MachineUnavailable(exc.message) from exc
            try:
                await engine.import_image(f"{IMAGE_REPO}/{image.name}", digest, tar_stream(image.rootfs))
            finally:
                os.close(lease)
            self._imported.add(key)
        return reference


def image_tag(image: Image) -> str:
    """The engine's tag of an image: DIGEST_TAG_HEX hex of its digest, then its owner. The
    digest is of the debootstrap stream, the same whoever built it; the tree is owned by the
    builder's sandbox uid. Two trees of one digest and two owners (a root and a non-root
    server on one engine, a changed `sandbox_uid`) must not share an import: a container runs
    as the owner and could not enter the other's 0700 directories."""
    digest = image.manifest.digest.removeprefix("sha256:")[:DIGEST_TAG_HEX]
    return f"{digest}-{image.manifest.uid}-{image.manifest.gid}"


async def tar_stream(rootfs: Path) -> AsyncIterator[bytes]:
    """The tree as a tar stream, owners as numbers (the image's files belong to its uid)."""
    proc = await asyncio.create_subprocess_exec(
        "tar", "--numeric-owner", "--one-file-system", "-C", str(rootfs), "-cf", "-", ".",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        while chunk := await proc.stdout.read(TAR_CHUNK):
            yield chunk
        error = await proc.stderr.read()
        if await proc.wait() != 0:
            raise MachineUnavailable(f"tar of {rootfs} failed: {error.decode(errors='replace')[-500:]}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


class DockerMachine(HostFiles):
    kind = "docker"
    isolated = True
    os: OS = "linux"
    root = "/workspace"
    ripgrep = CONTAINER_RG

    def __init__(
        self,
        name: str,
        machine_id: str,
        host: DockerHost,
        options: DockerOptions,
        workspace: Path,
        run: Path,
        *,
        env: dict[str, str] | None = None,
        container_id: str | None = None,
    ) -> None:
        self.name = name
        self.machine_id = machine_id
        self.host = host
        self.options = options
        self.workspace = workspace
        self.run = run
        self.env = env or {}
        self._verified = False
        """Whether `container_id` is known to be this machine's: only then may a stop touch it."""
        self._disposable = False
        """Whether the container holds nothing a new one would lack: made by this start, or a
        read-only root (its tmpfs are emptied at every stop anyway)."""
        self._container_id = container_id
        self.engine = host.engine(options.docker_host)
        self.hostname = f"dkr-{machine_id[-12:]}".lower()
        self.network_on = options.network
        self.state = "stopped"
        self.started_at = 0.0
        self.start_seconds = 0.0
        self.last_used = time.monotonic()
        self.problem = ""
        """Why the last lifetime ended by itself (the container removed, the agent gone)."""
        self.loop: asyncio.AbstractEventLoop = asyncio.get_event_loop()
        self._pid = 0
        self.image_reference: str | None = None
        """The engine's tag of the image this machine's container runs (known once started)."""
        self._listener: socket.socket | None = None
        self._channel: AgentChannel | None = None
        self._stops = SharedRun(self._halt)
        self._ended = False
        self.owner = None
        self.users = {}
        self.view = HostView([Mount("/workspace", workspace)], self.root)
        with contextlib.suppress(MachineUnavailable):  # unbuilt: known at the start, which fails
            self._own(host.image(options.image))

    @property
    def instance_id(self) -> str:
        return self.machine_id

    def marker(self) -> dict[str, Any]:
        """The container's id, so a restarted server attaches to it instead of making another."""
        return {"container_id": self.container_id, "hostname": self.hostname, "started_at": self.started_at}

    @property
    def container_id(self) -> str | None:
        """The engine's id of this machine's container: record it to attach after a restart.

        None before the first start; set it to None to have the next start make a new one
        (after `ContainerGone`); a machine built with an id checks it at its start.
        """
        return self._container_id

    @container_id.setter
    def container_id(self, value: str | None) -> None:
        if value != self._container_id:
            self._verified = False
        self._container_id = value

    @property
    def container_name(self) -> str:
        return f"agentbox-{self.machine_id}".lower()

    @property
    def uid_gid(self) -> tuple[int, int]:
        """The container's uid and gid (known once the image is)."""
        if self.owner is None:
            raise MachineUnavailable(f"image {self.options.image!r} is not built: no owner for the container")
        return self.owner

    @property
    def running(self) -> int:
        """Commands of this lifetime that the agent has not reported ended."""
        return self._channel.running if self._channel is not None else 0

    def busy(self) -> bool:
        """A running command, or a process one left behind (a child of the agent), keeps it alive."""
        if self.running > 0:
            return True
        return self._pid > 0 and _has_children(self._pid)

    def _view(self, image: Image) -> HostView:
        """`/workspace` from the host; the rest as the container sees it, handed over at `R`."""
        mounts = [Mount("/workspace", self.workspace)]
        mounts += [Mount(d, None, writable=d in ("/tmp", CONTAINER_HOME)) for d in SHARED_DIRS]
        links = {d: os.readlink(image.rootfs / d) for d in ("bin", "sbin", "lib", "lib64")
                 if (image.rootfs / d).is_symlink()}  # fmt: skip
        aliases = [Alias(f"/{d}", f"/usr/{d}") for d, t in links.items() if t.lstrip("/") == f"usr/{d}"]
        return HostView(mounts, self.root, aliases, owner_uid=self.uid_gid[0])

    def capabilities(self) -> dict[str, Any]:
        """What GET /v2/sandbox shows under "isolation" for this machine."""
        o = self.options
        writable = "the container's own layer, kept until the container is removed"
        return {
            "isolation": "docker",
            "docker_host": o.docker_host,
            "container_id": self.container_id,
            "image": o.image,
            "image_detail": f"{o.image}, imported into the engine as "
            + (self.image_reference or f"{IMAGE_REPO}/{o.image}:<digest>"),
            "system_layer": o.writable_root,
            "system_layer_kind": "container-layer" if o.writable_root else "none",
            "system_layer_detail": writable
            if o.writable_root
            else "read-only root; /tmp and $HOME are tmpfs",
            "host_uid": self.owner[0] if self.owner is not None else None,
            "privileges": "unprivileged",
            "privileges_detail": "a non-root uid, no capabilities, no-new-privileges; no Docker socket inside",
            "network": "on" if o.network else "off",
            "network_detail": "the engine's default bridge" if o.network else "none (loopback only)",
            "resource_limits": {
                "memory_mb": o.memory_mb or None,
                "pids": o.pids or None,
                "cpus": o.cpus or None,
            },
        }

    # lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.state == "running":
            return
        await self._stops.settled()  # a stop in progress must finish before a new lifetime
        self.loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            image = self.host.image(self.options.image)  # read again: a rebuild changes its digest
            self._own(image)
            self._prepare_run(image)
            if self.container_id is None:
                await self._create(image)
            else:
                await self._adopt(self.container_id)
            await self._boot(image)
        except BaseException:
            await self._halt()
            raise
        self.state = "running"
        self.problem = ""
        self.started_at = time.time()
        self.last_used = time.monotonic()
        self.start_seconds = time.monotonic() - started

    def _own(self, image: Image) -> None:
        """The container's uid and gid, which own its new files, and the view for this image."""
        try:
            self.owner = self.options.uid_gid(image)
        except ValueError as exc:
            raise MachineUnavailable(str(exc)) from exc
        self.users = {CONTAINER_USER: self.owner, str(self.owner[0]): self.owner}
        self.view.forget()
        self.view = self._view(image)

    def _prepare_run(self, image: Image) -> None:
        """This lifetime's `run/`: the agent's source, the socket it connects to and the account
        files; the workspace."""
        uid, gid = self.uid_gid
        as_root = os.geteuid() == 0
        self.workspace.mkdir(parents=True, exist_ok=True)
        if as_root:
            os.lchown(self.workspace, uid, gid)
        shutil.rmtree(self.run, ignore_errors=True)
        self.run.mkdir(parents=True)
        made = {AGENT_FILE: AGENT_SOURCE, **account_files(image.rootfs / "etc", uid, gid)}
        for name, text in made.items():
            (self.run / name).write_text(text)
            os.chmod(self.run / name, 0o644)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        run_fd = os.open(self.run, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # by descriptor: a home's path can pass the 108 bytes a socket address holds
            listener.bind(f"/proc/self/fd/{run_fd}/{AGENT_SOCKET}")
            if as_root:
                os.chown(f"/proc/self/fd/{run_fd}/{AGENT_SOCKET}", uid, gid)
                os.chown(f"/proc/self/fd/{run_fd}", uid, gid)
        finally:
            os.close(run_fd)
        os.chmod(self.run, RUN_DIR_MODE)
        listener.listen(1)
        listener.setblocking(False)
        self._listener = listener

    def _agent_args(self) -> list[str]:
        return [f"{CONTAINER_RUN}/{AGENT_SOCKET}", *SHARED_DIRS]

    def _config(self, reference: str) -> dict[str, Any]:
        """The container, as the Engine API's create call takes it."""
        o, (uid, gid) = self.options, self.uid_gid
        tmpfs = {
            "/tmp": f"size={o.tmp_mb}m,mode=1777,nosuid,nodev",
            CONTAINER_HOME: f"size={o.home_mb}m,mode=0700,uid={uid},gid={gid},nosuid,nodev",
            # an empty read-only cover: the trash (in the workspace) is out of the container's reach
            f"/workspace/{TRASH_DIR}": f"ro,size={TRASH_COVER_BYTES},mode=0555,nosuid,nodev,noexec",
        }
        binds = [
            {"Type": "bind", "Source": str(self.workspace), "Target": "/workspace"},
            {"Type": "bind", "Source": str(self.run), "Target": CONTAINER_RUN, "ReadOnly": True},
            {"Type": "bind", "Source": self.host.ripgrep(), "Target": CONTAINER_RG, "ReadOnly": True},
        ]
        binds += [
            {"Type": "bind", "Source": str(self.run / name), "Target": f"/etc/{name}", "ReadOnly": True}
            for name in ACCOUNT_FILES
        ]
        memory = o.memory_mb * 1024 * 1024
        return {
            "Image": reference,
            "Cmd": ["/usr/bin/python3", "-I", "-S", f"{CONTAINER_RUN}/{AGENT_FILE}", *self._agent_args()],
            "User": f"{uid}:{gid}",
            "Env": [f"PATH={CONTAINER_PATH}"],
            "WorkingDir": "/workspace",
            "Hostname": self.hostname,
            "Labels": {
                LABEL_ID: self.machine_id,
                LABEL_MACHINE: self.name,
                LABEL_IMAGE: reference,
                LABEL_HOME: self.host.label,
            },
            "HostConfig": {
                "Mounts": binds,
                "Tmpfs": tmpfs,
                "ReadonlyRootfs": not o.writable_root,
                "NetworkMode": BRIDGE if o.network else "none",
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "IpcMode": "private",
                "Privileged": False,
                "Init": False,  # the agent is pid 1 and reaps
                "RestartPolicy": {"Name": "no"},
                "Memory": memory,
                "MemorySwap": memory,  # no swap beyond the memory limit
                "PidsLimit": o.pids or -1,
                "NanoCpus": int(o.cpus * 1e9),
                "LogConfig": LOG_CONFIG,
            },
        }

    async def _create(self, image: Image) -> None:
        await self.engine.ping()
        if self.options.network and not await self.engine.network_exists(BRIDGE):
            raise MachineUnavailable(
                f"network is on, but the Docker engine at {self.options.docker_host} has no {BRIDGE!r} "
                'network (dockerd --bridge=none gives containers loopback only): set network = "off"'
            )
        reference = await self.host.ensure_imported(self.engine, image)
        self.image_reference = reference
        created = await self.engine.create(self.container_name, self._config(reference))
        if created is None:  # made by a server that died before it could record the id
            await self._adopt(self.container_name)
        else:
            self.container_id = created
            self._verified = True
            self._disposable = True

    async def _adopt(self, container_id: str) -> None:
        """Check that an existing container is this machine's, and have it stopped to restart it."""
        try:
            info = await self.engine.inspect(container_id)
        except ContainerGone as exc:
            raise ContainerGone(
                f"container {container_id[:12]} of machine {self.name} no longer exists "
                f"(removed behind agentbox's back); set container_id to None to make a new one"
            ) from exc
        labels = (info.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_ID) != self.machine_id:
            raise MachineUnavailable(
                f"container {container_id[:12]} is not machine {self.machine_id}'s (its label says "
                f"{labels.get(LABEL_ID)!r})"
            )
        self.container_id = str(info["Id"])
        self._verified = True
        self._disposable = bool((info.get("HostConfig") or {}).get("ReadonlyRootfs"))
        self.image_reference = labels.get(LABEL_IMAGE)
        if (info.get("State") or {}).get("Running"):  # an agent of a server that is gone
            await self.engine.kill(self.container_id)
            await self.engine.wait_exit(self.container_id)

    async def _boot(self, image: Image) -> None:
        """Start the container; if the engine's runtime keeps failing to, start a new one in its
        place when it holds nothing to keep.

        Docker 20.10 can hand runc a container root that is not mounted (the bare mount point,
        root's, 0700), and the start fails at once with "stat /usr/bin/python3: permission
        denied". Right after a stop it may still be unmounting the last run's root, and the same
        start a moment later succeeds (seen once in about 100 stop/start cycles). Once, on a
        container just made, under a whole test run's load, every start of it failed for 0.6 s;
        a new container is mounted afresh. One with a writable root that a start did not make
        keeps its layer (the system changes of its past runs): that start fails instead.
        """
        assert self.container_id is not None
        try:
            await self._start_retrying(self.container_id)
        except MachineUnavailable as exc:
            if RUNTIME_FAILURE not in exc.message or not self._disposable:
                raise
            await self.engine.remove(self.container_id)
            self.container_id = None
            await self._create(image)
            assert self.container_id is not None
            await self._start_retrying(self.container_id)
        await self._connect(self.container_id)

    async def _start_retrying(self, container_id: str) -> None:
        """The engine's start, tried START_ATTEMPTS times while its runtime fails."""
        for attempt in range(START_ATTEMPTS):
            try:
                await self.engine.start(container_id)
                return
            except ContainerGone:
                raise
            except MachineUnavailable as exc:
                if RUNTIME_FAILURE not in exc.message or attempt == START_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(START_RETRY_PAUSE * (attempt + 1))

    async def _connect(self, container_id: str) -> None:
        """Take the started container's agent's connection (or its early end), then its `R`."""
        assert self._listener is not None
        accept = asyncio.ensure_future(self.loop.sock_accept(self._listener))
        exited = asyncio.ensure_future(self.engine.wait_exit(container_id))
        try:
            done, _ = await asyncio.wait(
                {accept, exited}, timeout=START_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
            if accept not in done:
                why = f"exited with {exited.result()}" if exited in done else "did not connect in time"
                raise MachineUnavailable(
                    f"container {container_id[:12]}'s exec agent {why}: {await self._diagnostics()}"
                )
        finally:
            for task in (accept, exited):
                task.cancel()
            with contextlib.suppress(BaseException):
                await exited
        conn, _ = accept.result()
        self._close_listener()  # one connection per lifetime: nothing else may reach it
        info = await self.engine.inspect(container_id)
        self._pid = int((info.get("State") or {}).get("Pid") or 0)
        if _peer_pid(conn) != self._pid:
            conn.close()
            raise MachineUnavailable(
                f"container {container_id[:12]}: the agent's socket was taken by another process"
            )
        self._channel = AgentChannel(
            conn, self.loop, what="container", view=self.view, shared=SHARED_DIRS,
            diagnostics=lambda: "see `docker logs`", gone=self._agent_gone, touch=self._touch,
        )  # fmt: skip
        await asyncio.wait_for(asyncio.shield(self._channel.ready), START_TIMEOUT)

    async def _diagnostics(self) -> str:
        try:
            return (await self.engine.logs(self.container_id or "")).strip() or "no output"
        except MachineError as exc:
            return exc.message

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                (self.run / AGENT_SOCKET).unlink()

    def _agent_gone(self) -> None:
        if self.state == "running":
            self._ended = True  # its pid 1 has gone, so the container has ended (or is another's now)
            self.loop.create_task(self._lost())

    async def _lost(self) -> None:
        """The agent's socket ended by itself: stop, and find out why for the next call."""
        await self.stop()
        try:
            info = await self.engine.inspect(self.container_id or "")
            code = (info.get("State") or {}).get("ExitCode")
            self.problem = f"container {(self.container_id or '')[:12]} ended (exit code {code})"
        except ContainerGone:
            self.problem = f"container {(self.container_id or '')[:12]} was removed behind agentbox's back"
        except MachineError as exc:
            self.problem = exc.message

    def _touch(self) -> None:
        self.last_used = time.monotonic()

    async def stop(self) -> None:
        """Stop the container (its tmpfs are emptied, `/workspace` stays); it stays for `start`.

        Concurrent calls share one stop, and `start` waits for it to finish.
        """
        await self._stops()

    async def _halt(self) -> None:
        self.state = "stopped"
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()  # the agent kills every command and exits: the container ends
        self._close_listener()
        ended, self._ended = self._ended, False
        if self.container_id is not None and self._verified and not ended:
            try:
                await self.engine.stop(self.container_id, STOP_GRACE)
            except ContainerGone:
                self.problem = f"container {self.container_id[:12]} was removed behind agentbox's back"
            except MachineError as exc:  # the engine is away: the agent has gone by itself anyway
                self.problem = exc.message
        self._pid = 0
        if channel is not None:
            channel.abandon()
        self.view.forget()

    async def destroy(self) -> None:
        """Stop and remove the container (a closed session): its layer goes with it."""
        await self.stop()
        if self.container_id is not None:
            if self._verified:
                await self.engine.remove(self.container_id)
            self.container_id = None

    async def close(self) -> None:
        """The server's shutdown: stop, and keep the container for the next server to attach."""
        await self.stop()

    # commands ----------------------------------------------------------------------------

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        return {
            "PATH": CONTAINER_PATH,
            "HOME": CONTAINER_HOME,
            "USER": CONTAINER_USER,
            "LOGNAME": CONTAINER_USER,
            "LANG": "C.UTF-8",
            "HOSTNAME": self.hostname,
            "TERM": "xterm-256color",
            **self.env,
            **request.env,
        }

    async def spawn(self, request: ExecRequest) -> AgentProcess:
        if self.state != "running" or self._channel is None:
            raise MachineUnavailable(
                f"the docker machine {self.name} is not running"
                + (f": {self.problem}" if self.problem else "")
            )
        self.last_used = time.monotonic()
        cwd = self.view.absolute(request.cwd or self.root)
        return await self._channel.spawn(
            request.args(), cwd, self.command_env(request), request.stdin, request.interactive, request.pty
        )

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result


def _peer_pid(conn: socket.socket) -> int:
    """The pid (in the server's namespace) of the process at the other end of a unix socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def _has_children(pid: int) -> bool:
    """Whether `pid` has a child: the agent's are commands and what they left behind."""
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/children") as f:
                if f.read().strip():
                    return True
    return False
