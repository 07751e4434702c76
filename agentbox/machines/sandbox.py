"""The `sandbox` kind: one bubblewrap sandbox per session, isolated, root `/workspace`.

A sandbox's root is an image (`images.py`: a Debian tree built by mmdebstrap, the same
for every sandbox of the machine entry) under a discardable writable layer: the kernel's
overlayfs, mounted by bwrap inside the sandbox's user namespace (the image's files belong
to the sandbox uid, so copy-up works there), or fuse-overlayfs where the kernel refuses
(root servers only), or none (read-only). The layer's upper directory lives in the
lifetime's `run/`, so system installs vanish when the sandbox is reclaimed.

Where the machine's image is not built, the fallback is today's host-based root: a fresh
tmpfs with the host's `/usr` (read-only, or under fuse-overlayfs), a curated `/etc` and a
small `/var` (see `sysroot.py`). `GET /v2/sandbox` says which a sandbox got.

Either way there is `/workspace` bound from
the session's persistent directory, `/tmp` and `/root` (`$HOME`) from directories that live
as long as this sandbox, its own `/proc` and `/dev`, and new user, pid, ipc, uts, cgroup
and network namespaces. Inside, processes appear as root but are an unprivileged host uid
with no capabilities; nothing of the server's environment reaches them. A seccomp filter
refuses every setuid or setgid mode (`seccomp.py`), and a lifetime's `run/` (its /tmp and
$HOME) is the sandbox uid's alone, so what a sandbox makes is no way into the host.

Commands are started by the exec agent (`exec_agent.py`), a long-lived process inside the
sandbox, so a command costs one `posix_spawn`, not a new bwrap. The server creates each
command's pipes and passes them in, then reads them itself.

Launch, as root (a non-root server skips the uid switch and the system layer):

    fork ─ join the sandbox's cgroups ─ [system layer: new mount namespace, bind the base,
    fuse-overlayfs (squash to the sandbox uid) over it] ─ drop to the sandbox uid ─ bwrap
    ─ python3 exec_agent.py          + slirp4netns on the sandbox's netns when network is on

Nothing of the server crosses into the sandbox: bwrap and the agent get /dev/null for
stdin and stdout and a pipe of their own for stderr (the server keeps its last
DIAGNOSTICS_TAIL bytes for the "exited during start" error), no other descriptor, and
the agent is the sandbox's pid 1 (`--as-pid-1`), non-dumpable, so a command cannot
reopen, `pidfd_getfd` or ptrace what it holds. Host-side helpers (fuse-overlayfs,
slirp4netns) write to the lifetime's `launcher.log`, out of the sandbox's reach.

Teardown kills every process of the sandbox (cgroup, or the launcher's mount namespace
when there are no cgroups) and removes this lifetime's directories; `/workspace` stays.
A server that dies without a teardown (SIGKILL) takes bwrap and slirp4netns with it
(`--die-with-parent`, the exit fd); its DEATH_WATCH, a shell waiting for the server's
end of a pipe to close, then kills and thaws its cgroups and detaches its fuse mounts
(the daemons exit). What a crash still leaves is released when any root server starts
(`release_orphans`): a layer or cgroup belongs to a server named by pid and start time
(`owner_token`), so a reused pid does not keep it alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import marshal
import os
import posixpath
import shutil
import socket
import stat as stat_mod
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.machines import bwrap as bwrap_mod
from agentbox.machines import seccomp
from agentbox.machines.account import (
    ACCOUNT_ENV,
    ACCOUNT_ID,
    ACCOUNT_NAME,
    ACCOUNT_SETUP_SECONDS,
    BROKER_ARGV,
    ENTER_ACCOUNT,
    NO_SUDO_EXIT,
    ROOT_NAME,
    SETUP_INPUT,
    SETUP_SCRIPT,
    nest_argv,
    nested_namespace,
)
from agentbox.machines.agent_channel import PIPE_CHUNK, AgentChannel, AgentProcess
from agentbox.machines.base import OS, TRASH_COVER_BYTES, TRASH_DIR, ExecRequest, ExecResult, Usage, collect
from agentbox.machines.binaries import playwright_driver_dir, reachable_copy, ripgrep_binary
from agentbox.machines.cgroups import Cgroups, Limits, SandboxGroup
from agentbox.machines.errors import ImageError, MachineUnavailable, OwnerUnsupported
from agentbox.machines.hostfs import HostFiles, Owner
from agentbox.machines.hostview import Alias, HostView, Mount
from agentbox.machines.images import DEFAULT_IMAGE, Image, ImageStore
from agentbox.machines.shared_run import SharedRun
from agentbox.machines.sysroot import Base, ensure_base, hosts_file, login_shell, resolv_conf
from agentbox.machines.usage import measure

#: Seconds a sandbox may take from launch to its agent saying "ready".
START_TIMEOUT = 20.0
#: Host uid/gid sandbox processes run as when the server is root.
DEFAULT_SANDBOX_UID = 64999
SANDBOX_HOME = "/root"
#: The id a sandbox's processes see for any host id its user namespace does not map (the
#: kernel's overflow uid and gid): every owner but the sandbox's own host uid and gid.
OVERFLOW_ID = 65534
#: Directories that live only as long as a sandbox, as size-limited tmpfs (charged to the memory
#: cgroup of whoever writes): never on the host disk, never reachable by another host user. A
#: root server mounts them itself under its root-only runtime directory (in the host's user
#: namespace, so it can create files there for the sandbox) and binds them in; an ordinary
#: server lets bwrap mount them inside. Either way the agent hands their descriptors to the
#: server (`HostView.attach`), which reaches them like every other mount.
PRIVATE_DIRS = ("/tmp", SANDBOX_HOME)
#: On an image, the system directories the agent also hands over, so the file API reads them
#: as the sandbox sees them (its own installs included); read-only through the API.
IMAGE_SYSTEM_DIRS = ("/usr", "/etc")
#: The writable system layer a sandbox can get, best first (`GET /v2/sandbox` names it).
KERNEL_OVERLAY, FUSE_OVERLAY, NO_LAYER = "kernel-overlay", "fuse-overlayfs", "none"
MS_NOSUID, MS_NODEV = 2, 4
#: Default size limits of those tmpfs, in MiB (`tmp_mb` / `home_mb` in a machine's config).
DEFAULT_TMP_MB = 1024
DEFAULT_HOME_MB = 512
#: Where the exec agent sees the host's /usr read-only when /usr itself is the fuse layer.
AGENT_USR = "/.agentbox"
#: Where the server's ripgrep is bound read-only inside every sandbox (searches run it there).
SANDBOX_RG = "/.agentbox/bin/rg"
#: Where a browser-enabled sandbox sees Playwright's driver (its node and package), read-only.
SANDBOX_PLAYWRIGHT = "/.agentbox/playwright"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The whole environment of every process the server starts for a sandbox.
LAUNCH_ENV = {"PATH": SANDBOX_PATH}
AGENT_SOURCE = (Path(__file__).parent / "exec_agent.py").read_text()
#: The agent compiled once by the server: an agent whose python is the server's version loads
#: it instead of compiling its source at every start (milliseconds, and ~0.8 MiB of memory
#: the compiler leaves behind in each sandbox).
AGENT_CODE = marshal.dumps(compile(AGENT_SOURCE, "exec_agent.py", "exec"))
#: What such an agent runs: load the code from the descriptor named first, close it, run it.
AGENT_LOADER = (
    "import marshal,sys;f=open(int(sys.argv.pop(1)),'rb');c=marshal.loads(f.read());f.close();del f;exec(c)"
)
#: The python a marshalled code object is valid for: the same major.minor as the server's.
SERVER_PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
#: The device slirp4netns opens, as the server's user, to give a sandbox its tap0.
TUN_DEVICE = Path("/dev/net/tun")

#: Mode of a sandbox's per-lifetime directory (`run/`, owned by the sandbox uid).
RUN_DIR_MODE = 0o700
#: Mode of a system layer's mount directory (`root:<sandbox gid>`): only the sandbox group passes.
LAYER_DIR_MODE = 0o710

MNT_DETACH = 2
#: File in a system layer's mount directory naming the server that owns it (`owner_token`).
OWNER_FILE = "owner"
#: Seconds a layer directory may be under its dot name without an owner file before a sweep
#: takes it for a leftover: its maker writes the owner and renames it within microseconds, and
#: nothing is mounted in it before then, so an older one is only an empty directory.
LAYER_MAKING_SECONDS = 60.0
#: Mount points a layer directory may hold (the death watch's list is the same).
LAYER_POINTS = ("usr", "sys", "root", "tmp", "home")
#: Bytes of bwrap's and the agent's own stderr kept for the "exited during start" error.
DIAGNOSTICS_TAIL = 4096
#: Reads of the diagnostics pipe when a start error is reported (each up to PIPE_CHUNK).
DIAGNOSTICS_DRAIN_READS = 16
#: Runs once its stdin reaches EOF, i.e. once the server is gone however it died: kills and
#: thaws (a teardown cut short leaves a group frozen) every sandbox cgroup named with the
#: owner token $2 under the cgroup parents $3..., lazily unmounts every system layer whose
#: owner file holds $2 under the mount root $1 (a fuse daemon whose mount is detached and
#: unused exits by itself), then removes the emptied groups.
DEATH_WATCH = """read -r _
root=$1 token=$2
shift 2
for parent in "$@"; do
  for g in "$parent"/*-"$token"; do
    [ -d "$g" ] || continue
    kill -9 $(cat "$g/cgroup.procs" 2>/dev/null) 2>/dev/null
    echo THAWED > "$g/freezer.state" 2>/dev/null; echo 0 > "$g/cgroup.freeze" 2>/dev/null
  done
done
for d in "$root"/*/; do
  [ "$(cat "$d/owner" 2>/dev/null)" = "$token" ] || continue
  for m in usr sys root tmp home; do umount -l "$d/$m" 2>/dev/null; rmdir "$d/$m" 2>/dev/null; done
  rm -f "$d/owner"; rmdir "$d" 2>/dev/null
done
for attempt in $(seq 100); do
  left=0
  for parent in "$@"; do
    for g in "$parent"/*-"$token"; do
      [ -d "$g" ] && ! rmdir "$g" 2>/dev/null && left=1
    done
  done
  [ "$left" = 0 ] && break
  sleep 0.05
done
"""


@dataclass(frozen=True)
class SandboxConfig:
    """How sandboxes of one machine entry are built."""

    network: bool = True
    """"on": outbound through slirp4netns (never the host's loopback); "off": loopback only."""
    limits: Limits = field(default_factory=Limits)
    """Memory, pids and CPU per sandbox (cgroups, where the host offers them)."""
    system_layer: bool = True
    """Give a discardable overlay over /usr, /etc, /var when the host can (root + fuse-overlayfs)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables injected into every command (env providers)."""
    tmp_mb: int = DEFAULT_TMP_MB
    """Size of the sandbox's `/tmp` (a tmpfs inside it, counted in its memory limit)."""
    home_mb: int = DEFAULT_HOME_MB
    """Size of the sandbox's `$HOME` (`/root`, a tmpfs like `/tmp`)."""
    image: str | None = DEFAULT_IMAGE
    """The image the root is made of; None: the host's /usr (the fallback)."""
    image_required: bool = False
    """Whether the image was named in the config: then a missing image is an error, not a fallback."""
    browser: bool = False
    """Carry Playwright's driver (`SANDBOX_PLAYWRIGHT`) so the `browser` tool can run the image's
    Chromium inside the sandbox."""


@dataclass(frozen=True)
class RootPlan:
    """What one lifetime's root is made of, decided at its start."""

    image: Image | None
    image_detail: str
    layer: str
    """KERNEL_OVERLAY, FUSE_OVERLAY or NO_LAYER."""
    layer_detail: str


class SandboxHost:
    """What one server shares among its sandboxes: binaries, uid, cgroups, the base system."""

    def __init__(
        self, home: Path, uid: int = DEFAULT_SANDBOX_UID, gid: int | None = None, images: Path | None = None
    ) -> None:
        self.home = home
        self.root = os.geteuid() == 0
        self.uid = uid if self.root else os.geteuid()
        self.gid = (gid if gid is not None else uid) if self.root else os.getegid()
        self.bwrap = bwrap_mod.usable_binary(bwrap_mod.runtime_dir() if self.root else None)
        self.cgroups = Cgroups()
        self.images = ImageStore(images or home / "images", self.uid, self.gid)
        self._base: Base | None = None
        self._kernel_overlay: dict[Path, bool] = {}
        self.fuse = shutil.which("fuse-overlayfs")
        self.slirp, self.network_detail = network_helper()
        self.python = next(
            (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists()), None
        )
        self.libc = ctypes.CDLL(None, use_errno=True)
        rg = ripgrep_binary()
        self.rg = str(reachable_copy(rg, bwrap_mod.runtime_dir())) if self.root else rg
        self._seccomp: bytes | None = None
        self.merged_root = bwrap_mod.runtime_dir() / "mnt" if self.root else None
        if self.merged_root is not None:
            # Searchable, not listable: bwrap (as the sandbox uid) resolves the mounts by path.
            self.merged_root.mkdir(exist_ok=True)
            os.chmod(self.merged_root, 0o711)
            release_orphaned_layers(self.merged_root, self.libc)
            release_orphaned_groups(self.cgroups)
            self._death_watch = watch_death(self.merged_root, self.cgroups.parents())

    @property
    def base(self) -> Base:
        """The host-based fallback's curated /etc and /var, built at first use."""
        if self._base is None:
            self._base = ensure_base(self.home)
        return self._base

    def plan(self, config: SandboxConfig) -> RootPlan:
        """The image and layer a sandbox of `config` starts on now."""
        image, image_detail = self._image(config)
        if not config.system_layer:
            return RootPlan(
                image, image_detail, NO_LAYER, "disabled by configuration: the system is read-only"
            )
        if image is not None and self.kernel_overlay(image):
            return RootPlan(image, image_detail, KERNEL_OVERLAY, "the kernel's overlayfs over the image, "
                            "in the sandbox's user namespace; discarded when the sandbox is reclaimed")  # fmt: skip
        fuse, fuse_detail = self.system_layer()
        if fuse:
            return RootPlan(image, image_detail, FUSE_OVERLAY, fuse_detail)
        return RootPlan(image, image_detail, NO_LAYER, fuse_detail)

    def _image(self, config: SandboxConfig) -> tuple[Image | None, str]:
        if not config.image:
            return None, "no image configured: the host's /usr, read-only or under a layer"
        try:
            image = self.images.get(config.image)
        except ImageError as exc:
            if config.image_required:
                raise MachineUnavailable(exc.message) from exc
            return None, f"{exc.message}; until then: the host's /usr"
        if (image.manifest.uid, image.manifest.gid) != (self.uid, self.gid):
            raise MachineUnavailable(
                f"image {image.name!r} belongs to uid {image.manifest.uid}, but sandboxes here run as "
                f"uid {self.uid}: rebuild it with `agentbox image build {image.name} --rebuild`"
            )
        self.check_reachable(image.rootfs)
        return image, f"{image.name} ({image.manifest.profile}, {image.manifest.digest[:19]})"

    def kernel_overlay(self, image: Image) -> bool:
        """Whether bwrap may mount the kernel's overlayfs over `image` here (probed once)."""
        if image.rootfs not in self._kernel_overlay:
            self._kernel_overlay[image.rootfs] = self._probe_overlay(image.rootfs)
        return self._kernel_overlay[image.rootfs]

    def _probe_overlay(self, rootfs: Path) -> bool:
        probe = self.images.root / f".probe-{os.getpid()}"
        shutil.rmtree(probe, ignore_errors=True)
        try:
            for d in (probe, probe / "upper", probe / "work"):
                d.mkdir(parents=True)
                if self.root:
                    os.lchown(d, self.uid, self.gid)
            args = [
                str(self.bwrap), "--unshare-user", "--unshare-pid", "--uid", "0", "--gid", "0",
                "--overlay-src", str(rootfs), "--overlay", str(probe / "upper"), str(probe / "work"), "/",
                "--proc", "/proc", "--dev", "/dev", "/bin/sh", "-c", ": > /usr/.agentbox-probe",
            ]  # fmt: skip
            done = subprocess.run(
                self.as_sandbox_uid(args),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=LAUNCH_ENV,
                timeout=30,
            )
            return done.returncode == 0 and (probe / "upper" / "usr" / ".agentbox-probe").exists()
        except (OSError, subprocess.SubprocessError):
            return False
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def as_sandbox_uid(self, args: list[str]) -> list[str]:
        """`args` run as the sandbox uid: through setpriv when the server is root (Popen can vfork)."""
        if not self.root:
            return args
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            *args,
        ]

    def check_reachable(self, path: Path) -> None:
        """bwrap resolves bind sources by path as the sandbox uid, even for --bind-fd.

        (It reads the path back from /proc/self/fd/N and mounts that.) So every directory
        above a session's files must be searchable by that uid, or its group (a home that
        agentbox prepared is `root:<sandbox gid>` 0710); say so plainly instead of failing later.
        """
        if not self.root:
            return
        blocking = unsearchable_parent(path, self.uid, self.gid)
        if blocking is not None:
            raise MachineUnavailable(
                f"{blocking} is not searchable by the sandbox uid {self.uid}; sandboxes under it cannot "
                f"start. Use an AGENTBOX_HOME whose parents are (e.g. /var/lib/agentbox), or `chmod o+x {blocking}`"
            )

    def no_setid_filter(self) -> bytes:
        """The seccomp program of `seccomp.py`, built once; a sandbox never starts without it."""
        if self._seccomp is None:
            try:
                self._seccomp = seccomp.no_setid_filter()
            except seccomp.SeccompUnavailable as exc:
                raise MachineUnavailable(f"cannot build the sandbox's seccomp filter: {exc}") from exc
        return self._seccomp

    def system_layer(self) -> tuple[bool, str]:
        if not self.root:
            return False, "the server is not root: no overlay over root-owned system dirs; /usr is read-only"
        if not self.fuse or not Path("/dev/fuse").exists():
            return False, "fuse-overlayfs or /dev/fuse missing: /usr, /etc, /var are read-only"
        return True, "fuse-overlayfs over /usr, /etc, /var; discarded when the sandbox is reclaimed"

    def capabilities(self, config: SandboxConfig, plan: RootPlan | None = None) -> dict[str, Any]:
        """What a sandbox of `config` is and can do; `plan` is a running one's, else what it would get."""
        if plan is None:
            try:
                plan = self.plan(config)
            except MachineUnavailable as exc:
                plan = RootPlan(None, exc.message, NO_LAYER, "the sandbox cannot start")
        return {
            "isolation": "bubblewrap",
            "bwrap": str(self.bwrap),
            "host_uid": self.uid,
            "privileges": "root" if self.root else "unprivileged",
            "privileges_detail": (
                "a root server: sandboxes run as their own uid, with cgroup limits where the host has them"
                if self.root
                else "an unprivileged server: sandboxes run as the server's own uid; no uid of their own, "
                "no fuse-overlayfs, no cgroup limits"
            ),
            "image": plan.image.name if plan.image is not None else None,
            "image_detail": plan.image_detail,
            "system_layer": plan.layer != NO_LAYER,
            "system_layer_kind": plan.layer,
            "system_layer_detail": plan.layer_detail,
            "network": "on" if config.network and self.slirp else "off",
            "network_detail": self.network_detail if config.network else "loopback only",
            "resource_limits": self.cgroups.report(),
        }


class _Tail:
    """The last DIAGNOSTICS_TAIL bytes written to a pipe: bwrap's and the agent's stderr.

    bwrap and the agent get this pipe, never a file of the server's, so nothing in the
    sandbox holds the server's log or a path of its home.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.data = b""
        os.set_blocking(fd, False)
        loop.add_reader(fd, self.read)

    def read(self, reads: int = 1) -> None:
        for _ in range(reads):
            if self.fd < 0:
                return
            try:
                chunk = os.read(self.fd, PIPE_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return
            self.data = (self.data + chunk)[-DIAGNOSTICS_TAIL:]

    def text(self) -> str:
        """What was written so far, including what is still in the pipe."""
        self.read(DIAGNOSTICS_DRAIN_READS)
        return self.data.decode(errors="replace")

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


class SandboxMachine(HostFiles):
    kind = "sandbox"
    isolated = True
    os: OS = "linux"
    root = "/workspace"
    ripgrep = SANDBOX_RG

    def __init__(
        self, name: str, sandbox_id: str, host: SandboxHost, config: SandboxConfig, workspace: Path, run: Path
    ) -> None:
        self.name = name
        self.sandbox_id = sandbox_id
        self.host = host
        self.config = config
        self.workspace = workspace
        self.run = run
        self.hostname = f"sbx-{sandbox_id[-12:]}".lower()
        self.owner = (host.uid, host.gid)
        self.users = {
            ROOT_NAME: self.owner,
            "0": self.owner,
            ACCOUNT_NAME: self.owner,
            str(ACCOUNT_ID): self.owner,
        }
        self.plan: RootPlan | None = None
        """This lifetime's image and layer, decided at each start."""
        self.shell: str | None = None
        """root's login shell in this lifetime's /etc/passwd: every command's `SHELL`."""
        self.view = self._view()
        self.loop: asyncio.AbstractEventLoop = asyncio.get_event_loop()
        self.state = "stopped"
        self.started_at = 0.0
        self.last_used = time.monotonic()
        self.network_on = False
        self.layer_on = False
        self._lease: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._slirp: subprocess.Popen[bytes] | None = None
        self._channel: AgentChannel | None = None
        self._account: tuple[AgentChannel, asyncio.Future[None]] | None = None
        """The lifetime whose agent holds the account's namespace, and its making."""
        self._sudo: AgentProcess | None = None
        """This lifetime's sudo broker (`sudo_broker.py`), when its /usr could take one."""
        self._group: SandboxGroup | None = None
        self._fuse: list[subprocess.Popen[bytes]] = []
        self._mounts: list[Path] = []
        self._log_fds: list[int] = []
        self._diagnostics: _Tail | None = None
        self._child_pid = 0
        self._slirp_exit: int | None = None
        self._baseline = 0
        self._joins: list[asyncio.Future[None]] = []
        self._stops = SharedRun(self._stop)
        self._buffer = b""

    def inside_ids(self, uid: int, gid: int) -> Owner:
        """The namespace maps the sandbox's host uid and gid to root (0) and nothing else."""
        return (0 if uid == self.host.uid else OVERFLOW_ID), (0 if gid == self.host.gid else OVERFLOW_ID)

    def _view(self) -> HostView:
        """The server's view of this sandbox's files.

        On an image, /usr and /etc are the sandbox's own (handed over by its agent, layer
        included); on the host fallback they are the host's /usr and the curated /etc,
        read with the rights any host user has there (`foreign`).
        """
        mounts = [Mount("/workspace", self.workspace), Mount("/tmp", None), Mount(SANDBOX_HOME, None)]
        if self.plan is None:  # not started yet: the system directories come with a plan
            return HostView(mounts, self.root, [], owner_uid=self.host.uid)
        image = self.plan.image
        if image is not None:
            mounts += [Mount(d, None, writable=False) for d in IMAGE_SYSTEM_DIRS]
            links = {d: os.readlink(image.rootfs / d) for d in ("bin", "sbin", "lib", "lib64")
                     if (image.rootfs / d).is_symlink()}  # fmt: skip
        else:
            mounts += [
                Mount("/usr", Path("/usr"), writable=False, foreign=True),
                Mount("/etc", self.host.base.etc, writable=False, foreign=True),
            ]
            links = {
                d: os.readlink(f"/{d}") for d in ("bin", "sbin", "lib", "lib64") if Path(f"/{d}").is_symlink()
            }
        aliases = [
            Alias(f"/{d}", f"/usr/{d}") for d, target in links.items() if target.lstrip("/") == f"usr/{d}"
        ]
        return HostView(mounts, self.root, aliases, owner_uid=self.host.uid)

    def _shared_dirs(self) -> tuple[str, ...]:
        """What the agent opens inside and hands to the server at `R`, in this order."""
        image = self.plan is not None and self.plan.image is not None
        return PRIVATE_DIRS + (IMAGE_SYSTEM_DIRS if image else ())

    def capabilities(self) -> dict[str, Any]:
        """`SandboxHost.capabilities`, with the image and layer this lifetime got when it runs."""
        return self.host.capabilities(self.config, self.plan if self.state == "running" else None)

    # lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        if self.state == "running":
            return
        await self._stops.settled()  # a stop in progress must finish before a new lifetime
        self.loop = asyncio.get_running_loop()
        self.host.check_reachable(self.workspace)
        self._prepare_dirs()
        started = time.monotonic()
        try:
            await self._launch()
            await asyncio.wait_for(asyncio.shield(self._ready_future()), START_TIMEOUT)
            # Only now: bwrap configures the sandbox's loopback over netlink until the agent
            # runs, and slirp4netns configuring tap0 at the same time makes one of them fail.
            if self.network_on and self._child_pid:
                await self._start_network(self._child_pid)
            await self._join_group()
        except BaseException:
            await self.stop()
            raise
        self.state = "running"
        self.started_at = time.time()
        self.last_used = time.monotonic()
        self.start_seconds = time.monotonic() - started

    async def _join_group(self) -> None:
        """Have every process of this sandbox in its cgroup before the agent starts anything.

        The moves began as the processes appeared (`_start_joining`); this waits for them,
        then moves what they missed, so every command is born inside the group.
        """
        joins, self._joins = self._joins, []
        await asyncio.gather(*joins)
        if self._group is not None and self._proc is not None:
            join_group(self._group, self._own_pids())
            self._baseline = len(self._group.pids())

    def _own_pids(self) -> list[int]:
        """The launcher's tree (bwrap, the agent), the fuse-overlayfs daemons, slirp4netns."""
        assert self._proc is not None
        pids = [*process_tree(self._proc.pid), *(p.pid for p in self._fuse)]
        return pids + ([self._slirp.pid] if self._slirp is not None else [])

    def _start_joining(self) -> None:
        """Start moving the processes there are into the cgroup, in a thread.

        A host's first cgroup move in a while waits for an RCU grace period (the kernel's
        threadgroup lock: about 10 ms here), so it runs while the agent starts, not after.
        """
        if self._group is not None and self._proc is not None:
            self._joins.append(self.loop.run_in_executor(None, join_group, self._group, self._own_pids()))

    def _ready_future(self) -> asyncio.Future[None]:
        assert self._channel is not None
        return self._channel.ready

    @property
    def running(self) -> int:
        """Commands of this lifetime that the agent has not reported ended."""
        return self._channel.running if self._channel is not None else 0

    def _prepare_dirs(self) -> None:
        """The session's workspace and this lifetime's /var, given to the sandbox uid.

        `run/` is the sandbox uid's alone (0700): bwrap, as that uid, passes through it to bind
        what is in it, and no other host user can reach it. /tmp and $HOME are not here at all
        (PRIVATE_DIRS).
        """
        self.plan = self.host.plan(self.config)
        self.shell = self._login_shell(self.plan)
        dirs = [self.workspace, self.run / "var"]
        if self.plan.layer == KERNEL_OVERLAY:
            dirs += [
                self.run / "upper",
                self.run / "upper" / "root",
                self.run / "work",
                self.run / "work" / "root",
            ]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            if self.host.root:
                os.lchown(d, self.host.uid, self.host.gid)
        if self.host.root:
            os.lchown(self.run, self.host.uid, self.host.gid)
        os.chmod(self.run, RUN_DIR_MODE)
        self.view.forget()
        self.view = self._view()

    async def _launch(self) -> None:
        host, config, plan = self.host, self.config, self.plan
        assert plan is not None
        if plan.image is None and host.python is None:
            raise MachineUnavailable("no python3 under the host's /usr for the exec agent")
        if plan.image is not None:
            try:
                self._lease = host.images.lease(plan.image.name)
            except ImageError as exc:
                raise MachineUnavailable(exc.message) from exc
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        opened: list[int] = [child.fileno(), info_w]
        self.layer_on = plan.layer != NO_LAYER
        self.network_on = config.network and host.slirp is not None

        def fd_of(path: Path) -> int:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            opened.append(fd)
            return fd

        def data_fd(text: str | bytes) -> int:
            fd = os.memfd_create("agentbox", 0)
            os.write(fd, text.encode() if isinstance(text, str) else text)
            os.lseek(fd, 0, os.SEEK_SET)
            opened.append(fd)
            return fd

        args = [
            str(host.bwrap),
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
            "--unshare-cgroup-try",
            "--uid", "0", "--gid", "0",
            "--hostname", self.hostname,
            "--as-pid-1",  # the agent is pid 1: no bwrap init inside holding bwrap's descriptors
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--clearenv", "--setenv", "PATH", SANDBOX_PATH,
            "--seccomp", str(data_fd(host.no_setid_filter())),  # see machines/seccomp.py
        ]  # fmt: skip
        private = self._mount_private() if host.root else None
        if plan.image is not None:
            args += await self._image_root(plan, fd_of)
        else:
            args += await self._host_root(fd_of)
        args += [
            "--proc", "/proc", "--dev", "/dev",
            "--ro-bind-data", str(data_fd(resolv_conf(self.network_on))), "/etc/resolv.conf",
            "--ro-bind-data", str(data_fd(hosts_file(self.hostname))), "/etc/hosts",
            "--ro-bind-data", str(data_fd(self.hostname + "\n")), "/etc/hostname",
            "--bind-fd", str(fd_of(self.workspace)), "/workspace",
            *self._trash_cover(),
            *self._private_args(private, fd_of),
            "--ro-bind", host.rg, SANDBOX_RG,
            *self._browser_args(fd_of),
            "--chdir", "/workspace",
            "--info-fd", str(info_w),
            *self._agent_command(), "-I", "-S", "-c", *self._agent_program(data_fd), str(child.fileno()),
            *self._shared_dirs(),
        ]  # fmt: skip
        args = host.as_sandbox_uid(args)  # by exec, so Popen can vfork (no preexec_fn)
        self._group = host.cgroups.create(f"{self.sandbox_id}-{owner_token()}", config.limits)
        diag_r, diag_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = subprocess.Popen(
                args,
                pass_fds=opened,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=diag_w,  # a pipe of its own: never the server's log or a file of its home
                close_fds=True,
                env=LAUNCH_ENV,
            )
        except BaseException:
            os.close(diag_r)
            raise
        finally:
            os.close(diag_w)
            for fd in opened[1:]:
                os.close(fd)
            child.close()
        self._diagnostics = _Tail(diag_r, self.loop)
        self._channel = AgentChannel(
            parent, self.loop, what="sandbox", view=self.view, shared=self._shared_dirs(),
            diagnostics=self._log_tail, gone=self._agent_gone, touch=self._touch,
        )  # fmt: skip
        info = await self.loop.run_in_executor(None, _read_info, info_r)
        self._child_pid = int(info.get("child-pid") or 0)
        self._start_joining()  # bwrap has cloned the agent's process: the whole tree is there

    def _browser_args(self, fd_of: Any) -> list[str]:
        """The driver's directory, bound by a descriptor the server opened (its venv may sit in a
        directory the sandbox uid cannot search)."""
        if not self.config.browser:
            return []
        return ["--ro-bind-fd", str(fd_of(playwright_driver_dir())), SANDBOX_PLAYWRIGHT]

    def browser_driver(self) -> tuple[str, ...] | None:
        if not self.config.browser:
            return None
        return (f"{SANDBOX_PLAYWRIGHT}/node", f"{SANDBOX_PLAYWRIGHT}/package/cli.js")

    async def _image_root(self, plan: RootPlan, fd_of: Any) -> list[str]:
        """bwrap arguments that make the image the root, under the planned layer."""
        assert plan.image is not None
        rootfs = str(plan.image.rootfs)
        if plan.layer == KERNEL_OVERLAY:
            upper, work = self.run / "upper" / "root", self.run / "work" / "root"
            return ["--overlay-src", rootfs, "--overlay", str(upper), str(work), "/"]
        if plan.layer == FUSE_OVERLAY:
            merged = await self._mount_layer((("root", (plan.image.rootfs,)),))
            return ["--bind-fd", str(fd_of(merged / "root")), "/"]
        return ["--ro-bind", rootfs, "/"]

    async def _host_root(self, fd_of: Any) -> list[str]:
        """bwrap arguments for the fallback root: the host's /usr, the curated /etc, a /var."""
        host = self.host
        if self.layer_on:
            base = host.base
            merged = await self._mount_layer((("usr", base.usr_layers()), ("sys", (base.root,))))
            args = ["--bind-fd", str(fd_of(merged / "usr")), "/usr"]
            args += ["--bind-fd", str(fd_of(merged / "sys" / "etc")), "/etc"]
            args += ["--bind-fd", str(fd_of(merged / "sys" / "var")), "/var"]
            args += ["--ro-bind", "/usr", AGENT_USR + "/usr"]
        else:
            args = ["--ro-bind", "/usr", "/usr", "--ro-bind-fd", str(fd_of(host.base.etc)), "/etc"]
            args += ["--bind-fd", str(fd_of(self.run / "var")), "/var"]
        return args + host_program_dirs()

    def _agent_program(self, data_fd: Any) -> list[str]:
        """`-c` arguments: the compiled agent when its python is the server's version, else the source."""
        if self.plan is not None and self.plan.image is not None:
            rootfs = self.plan.image.rootfs
            python = (
                os.path.basename(os.readlink(rootfs / "usr/bin/python3"))
                if (rootfs / "usr/bin/python3").is_symlink()
                else ""
            )
        else:
            python = os.path.basename(os.path.realpath(self.host.python or ""))
        if python != SERVER_PYTHON:
            return [AGENT_SOURCE]
        return [AGENT_LOADER, str(data_fd(AGENT_CODE))]

    def _agent_command(self) -> list[str]:
        """How to start the agent's python: the image's own, or the host's past the fuse layer.

        Loading python and its stdlib through a fresh fuse-overlayfs costs tens of
        milliseconds of cold lookups, so with the system layer the agent runs from a
        read-only bind of the host's /usr at AGENT_USR, through the host's own loader.
        """
        if self.plan is not None and self.plan.image is not None:
            return ["/usr/bin/python3"]
        assert self.host.python is not None
        direct = agent_loader(self.host.python)
        if not self.layer_on or direct is None:
            return [self.host.python]
        loader, libdir, python = direct
        return [f"{AGENT_USR}{loader}", "--library-path", f"{AGENT_USR}{libdir}", f"{AGENT_USR}{python}"]

    def _log_tail(self, limit: int = 500) -> str:
        """bwrap's and the agent's stderr, then the host helpers' launcher.log, last `limit` chars."""
        parts = [self._diagnostics.text() if self._diagnostics is not None else ""]
        with contextlib.suppress(OSError):
            parts.append((self.run / "launcher.log").read_text(errors="replace"))
        return "\n".join(p.strip() for p in parts if p.strip())[-limit:] or "no diagnostics"

    def _log(self) -> int:
        """The host helpers' stderr (fuse-overlayfs, slirp4netns) goes to run/launcher.log.

        They run outside the sandbox's pid namespace, so nothing inside can reach it.
        """
        fd = os.open(self.run / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._log_fds.append(fd)
        return fd

    def _trash_cover(self) -> list[str]:
        """bwrap arguments that hide the trash from the sandbox's processes: an empty read-only
        tmpfs over it, which they can neither read through nor remove (the server reaches the
        trash through the host's workspace folder, below the cover)."""
        trash = posixpath.join(self.root, TRASH_DIR)
        return ["--size", str(TRASH_COVER_BYTES), "--perms", "0555", "--tmpfs", trash, "--remount-ro", trash]

    def _private_args(self, private: dict[str, Path] | None, fd_of: Any) -> list[str]:
        """bwrap arguments for /tmp and $HOME: bind the host tmpfs (root) or mount one inside."""
        if private is not None:
            return [a for inside, point in private.items() for a in ("--bind-fd", str(fd_of(point)), inside)]
        sizes = {"/tmp": (self.config.tmp_mb, "1777"), SANDBOX_HOME: (self.config.home_mb, "0700")}
        return [
            a
            for inside, (mb, mode) in sizes.items()
            for a in ("--size", str(mb * 1024 * 1024), "--perms", mode, "--tmpfs", inside)
        ]

    def _layer_dir(self) -> Path:
        """This lifetime's directory under the root-only mount root, named with its owner."""
        assert self.host.merged_root is not None
        merged = self.host.merged_root / self.sandbox_id
        if merged.is_dir():  # this lifetime's first mount made it
            (merged / OWNER_FILE).write_text(owner_token())
            return merged
        # Made under a dot name and renamed into place with its owner file inside, so a sweep
        # of another server never sees the directory without an owner (and may take any
        # ownerless one for a leftover).
        fresh = self.host.merged_root / f".{self.sandbox_id}.new"
        release_layer(fresh, self.host.libc)  # one a start cut short left
        fresh.mkdir(parents=True)
        # The layer holds the host's setuid programs (squashed to the sandbox uid): only the
        # sandbox group may pass (bwrap binds by path as that uid), and the mounts are nosuid.
        os.chown(fresh, 0, self.host.gid)
        os.chmod(fresh, LAYER_DIR_MODE)
        (fresh / OWNER_FILE).write_text(owner_token())
        fresh.rename(merged)
        return merged

    def _mount_private(self) -> dict[str, Path]:
        """Mount the size-limited tmpfs of /tmp and $HOME on the host (root only), nosuid, nodev."""
        merged, host = self._layer_dir(), self.host
        points: dict[str, Path] = {}
        for inside, name, mb, mode in (
            ("/tmp", "tmp", self.config.tmp_mb, 0o1777),
            (SANDBOX_HOME, "home", self.config.home_mb, 0o700),
        ):
            point = merged / name
            point.mkdir(exist_ok=True)
            options = f"size={mb}m,mode={mode:o},uid={host.uid},gid={host.gid}".encode()
            if host.libc.mount(b"tmpfs", bytes(point), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
                err = ctypes.get_errno()
                raise MachineUnavailable(f"cannot mount the sandbox's {inside}: {os.strerror(err)}")
            self._mounts.append(point)
            points[inside] = point
        return points

    async def _mount_layer(self, lowers: tuple[tuple[str, tuple[Path, ...]], ...]) -> Path:
        """Mount the discardable system layer with fuse-overlayfs: one mount per (name, lower
        layers, top first).

        The mounts live in the host's mount namespace under a root-only directory and are
        handed to bwrap as descriptors; nothing is bind-mounted under AGENTBOX_HOME, so no
        recursive delete there can ever reach the host's /usr.
        """
        host = self.host
        assert host.merged_root is not None and host.fuse is not None
        merged = self._layer_dir()
        for name, lower in lowers:
            upper, work, point = self.run / "upper" / name, self.run / "work" / name, merged / name
            for d in (upper, work, point):
                d.mkdir(parents=True, exist_ok=True)
            opts = (
                f"lowerdir={':'.join(map(str, lower))},upperdir={upper},workdir={work},"
                f"squash_to_uid={host.uid},squash_to_gid={host.gid},allow_other,nosuid,nodev"
            )
            proc = subprocess.Popen(
                [host.fuse, "-f", "-o", opts, str(point)], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._log(), env=LAUNCH_ENV,
            )  # fmt: skip
            self._fuse.append(proc)
            deadline = time.monotonic() + START_TIMEOUT
            while not os.path.ismount(point):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise MachineUnavailable(
                        f"fuse-overlayfs failed for {name}: see {self.run / 'launcher.log'}"
                    )
                await asyncio.sleep(0.0005)
            self._mounts.append(point)
        return merged

    async def _start_network(self, child_pid: int) -> None:
        """slirp4netns on the sandbox's netns: outbound only, never the host's loopback.

        Its exit fd's write end stays in this process, so slirp4netns dies with the server.
        """
        assert self.host.slirp is not None
        ready_r, ready_w = os.pipe()
        exit_r, self._slirp_exit = os.pipe2(os.O_CLOEXEC)
        try:
            self._slirp = subprocess.Popen(
                [
                    self.host.slirp, "--configure", "--mtu=65520", "--disable-host-loopback",
                    "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
                    str(child_pid), "tap0",
                ],
                pass_fds=[ready_w, exit_r], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._log(), env=LAUNCH_ENV,
            )  # fmt: skip
        finally:
            os.close(ready_w)
            os.close(exit_r)
        self._start_joining()  # while slirp4netns configures the sandbox's tap0
        ok = await self.loop.run_in_executor(None, os.read, ready_r, 1)
        os.close(ready_r)
        if ok != b"1":
            raise MachineUnavailable(f"slirp4netns failed to start: {self._log_tail()}")

    async def stop(self) -> None:
        """Kill everything this lifetime started and forget /tmp, $HOME and the system layer.

        Concurrent calls share one teardown, and `start` waits for it to finish.
        """
        await self._stops()

    async def _stop(self) -> None:
        self.state = "stopped"
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        await asyncio.get_running_loop().run_in_executor(None, self._kill_all)
        if channel is not None:
            channel.abandon()
        self._joins.clear()
        shutil.rmtree(self.run, ignore_errors=True)
        self.view.forget()

    def _kill_all(self) -> None:
        if self._slirp is not None:
            self._slirp.kill()
            self._slirp.wait()
            self._slirp = None
        if self._slirp_exit is not None:
            os.close(self._slirp_exit)
            self._slirp_exit = None
        if self._group is not None:
            self._group.kill_all()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        for point in self._mounts:
            if self.host.libc.umount2(bytes(point), MNT_DETACH) != 0:
                pass  # already gone (the daemon died): the rmdir below tells
        for proc in self._fuse:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for point in self._mounts:  # rmdir, never rmtree: a mount point may still be live
            with contextlib.suppress(OSError):
                point.rmdir()
        if self._mounts:
            remove_layer_dir(self._mounts[0].parent)
        self._mounts.clear()
        self._fuse.clear()
        if self._group is not None:  # after reaping: a zombie still holds its cgroup
            self._group.destroy()
            self._group = None
        for fd in self._log_fds:
            os.close(fd)
        self._log_fds.clear()
        if self._lease is not None:
            os.close(self._lease)
            self._lease = None
        if self._diagnostics is not None:
            self.loop.call_soon_threadsafe(self._diagnostics.close)
            self._diagnostics = None

    async def close(self) -> None:
        await self.stop()

    def _agent_gone(self) -> None:
        if self.state == "running":
            self.loop.create_task(self.stop())

    def _touch(self) -> None:
        self.last_used = time.monotonic()

    # commands ---------------------------------------------------------------------

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        """What login(1) sets (PATH, HOME, SHELL, USER, LOGNAME), a UTF-8 locale, the machine's
        variables, the request's. With SHELL given, bash does not look root up in /etc/passwd
        at every start (it does, through nss, only to fill in `$SHELL`)."""
        shell = {"SHELL": self.shell} if self.shell is not None else {}
        account = ACCOUNT_ENV if self._as_account(request.user) else {}
        return {
            "PATH": SANDBOX_PATH,
            "HOME": SANDBOX_HOME,
            **shell,
            "USER": ROOT_NAME,
            "LOGNAME": ROOT_NAME,
            "LANG": "C.UTF-8",
            "HOSTNAME": self.hostname,
            "TERM": "xterm-256color",
            **account,
            **self.config.env,
            **request.env,
        }

    @staticmethod
    def _as_account(user: str | None) -> bool:
        """Whether `user` names the account (`machines/account.py`) rather than root."""
        if user is None or user in (ROOT_NAME, "0"):
            return False
        if user in (ACCOUNT_NAME, str(ACCOUNT_ID)):
            return True
        raise OwnerUnsupported(f"a sandbox has no user {user!r}: only {ROOT_NAME!r} and {ACCOUNT_NAME!r}")

    async def _account_ready(self, channel: AgentChannel) -> None:
        """Make the account once per lifetime (concurrent first uses share the work)."""
        if self._account is None or self._account[0] is not channel:
            self._account = (channel, asyncio.ensure_future(self._make_account(channel)))
        making = self._account[1]
        try:
            await asyncio.shield(making)
        except Exception:
            if self._account is not None and self._account[1] is making:
                self._account = None  # the next use tries again
            raise

    async def _make_account(self, channel: AgentChannel) -> None:
        """The account's files inside and its namespace outside, at once, then `sudo`'s broker."""
        if channel.namespace is None:
            raise OwnerUnsupported(f"this sandbox's agent gave no user namespace: it has no {ACCOUNT_NAME!r}")
        setup = ExecRequest(command=SETUP_SCRIPT, stdin=SETUP_INPUT, timeout=ACCOUNT_SETUP_SECONDS)
        launch = self.host.as_sandbox_uid(nest_argv(channel.namespace))
        nesting = self.loop.run_in_executor(None, nested_namespace, launch, channel.namespace, LAUNCH_ENV)
        done, namespace = await asyncio.gather(self.exec(setup), nesting, return_exceptions=True)
        if isinstance(namespace, BaseException):
            raise namespace
        try:
            if isinstance(done, BaseException):
                raise done
            if done.exit_code not in (0, NO_SUDO_EXIT):
                detail = done.stderr.decode(errors="replace").strip()[-500:]
                raise OwnerUnsupported(f"this sandbox could not make its {ACCOUNT_NAME!r} account: {detail}")
            channel.send_account(namespace)
        finally:
            os.close(namespace)
        if done.exit_code == 0:  # the shim waits for the broker's socket a moment
            self._sudo = await self.spawn(ExecRequest(argv=BROKER_ARGV, cwd="/"))

    def _login_shell(self, plan: RootPlan) -> str | None:
        """root's shell in the passwd the sandbox will see: the image's, or the curated base's."""
        etc = plan.image.rootfs / "etc" if plan.image is not None else self.host.base.etc
        try:
            return login_shell((etc / "passwd").read_text(errors="replace"))
        except OSError:
            return None

    async def spawn(self, request: ExecRequest) -> AgentProcess:
        if self.state != "running" or self._channel is None:
            raise MachineUnavailable("the sandbox is not running")
        self.last_used = time.monotonic()
        cwd = self.view.absolute(request.cwd or self.root)
        channel, argv = self._channel, request.args()
        as_account = self._as_account(request.user)
        if as_account:
            await self._account_ready(channel)
            argv = [*ENTER_ACCOUNT, *argv]
        return await channel.spawn(
            argv,
            cwd,
            self.command_env(request),
            request.stdin,
            request.interactive,
            request.pty,
            account=as_account,
            end_group=request.end_group,
        )

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result

    @property
    def instance_id(self) -> str:
        return self.sandbox_id

    def marker(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "started_at": self.started_at}

    async def destroy(self) -> None:
        await self.stop()  # nothing of a sandbox outlives its stop but /workspace

    def usage(self) -> Usage | None:
        """What this lifetime uses now (`Metered`; `machines/usage.py` says what is measured
        with a cgroup and without one); None when it is not running."""
        if self.state != "running" or self._proc is None:
            return None
        pids = process_tree(self._proc.pid) if self._group is None else []
        return measure(self._group, pids, self.config.limits, self.workspace, self.started_at)

    def busy(self) -> bool:
        """A running command (or a process it left behind) keeps the sandbox alive."""
        if self.running > 0:
            return True
        if self._group is not None:
            return len(self._group.pids()) > self._baseline
        return False


def join_group(group: SandboxGroup, pids: list[int]) -> None:
    """Move each of `pids` that is not in `group` yet: even a move that changes nothing waits."""
    for pid in set(pids) - group.pids():
        with contextlib.suppress(OSError):  # gone already
            group.add(pid)


def network_helper() -> tuple[str | None, str]:
    """slirp4netns when it can give sandboxes a network here (else None), and what they get.

    Stock Debian leaves /dev/net/tun open to every user; a host that keeps it root's alone
    leaves a non-root server without one, and its sandboxes with loopback only.
    """
    slirp = shutil.which("slirp4netns")
    if slirp is None:
        return None, "slirp4netns missing: loopback only"
    if not os.access(TUN_DEVICE, os.R_OK | os.W_OK):
        return None, f"{TUN_DEVICE} is not open to uid {os.geteuid()}: no slirp4netns, loopback only"
    return slirp, "slirp4netns, host loopback unreachable"


def unsearchable_parent(path: Path, uid: int, gid: int) -> Path | None:
    """The first existing directory of `path` and its parents that `uid`/`gid` cannot search."""
    for p in [path, *path.parents]:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid:
            bit = stat_mod.S_IXUSR
        elif st.st_gid == gid:
            bit = stat_mod.S_IXGRP
        else:
            bit = stat_mod.S_IXOTH
        if not st.st_mode & bit:
            return p
    return None


def _read_info(fd: int) -> dict[str, Any]:
    """bwrap writes one JSON object (with the sandbox's host pid) to --info-fd.

    The descriptor may stay open in the sandbox, so read until the object is complete
    rather than until EOF.
    """
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as f:
        while chunk := f.read(4096):
            data += chunk
            try:
                return dict(json.loads(data))
            except ValueError:
                continue
    return {}


def host_program_dirs() -> list[str]:
    """bwrap arguments for the host's /bin, /sbin, /lib, /lib64 beside its /usr: the merged-/usr
    symlinks as symlinks, real directories bound read-only."""
    args: list[str] = []
    for d in ("bin", "sbin", "lib", "lib64"):
        if Path(f"/{d}").is_symlink():
            args += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
        elif Path(f"/{d}").is_dir():
            args += ["--ro-bind", f"/{d}", f"/{d}"]
    return args


def owner_token(pid: int | None = None) -> str:
    """`<pid>-<start time>`: names a process for good, also once its pid is reused."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "gone"


def owner_alive(token: str) -> bool:
    """Whether the server a token names still runs (a bare pid, as older servers wrote: it exists)."""
    pid, _, start = token.strip().partition("-")
    if not pid.isdigit():
        return False
    return Path(f"/proc/{pid}").exists() if not start else owner_token(int(pid)) == token.strip()


def watch_death(root: Path, cgroup_parents: list[Path]) -> int:
    """Start this server's DEATH_WATCH; it acts when the returned fd closes (at our exit)."""
    read_end, write_end = os.pipe()  # both close-on-exec: no other child inherits the write end
    try:
        subprocess.Popen(
            ["/bin/sh", "-c", DEATH_WATCH, "agentbox-death-watch", str(root), owner_token(),
             *map(str, cgroup_parents)],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=LAUNCH_ENV, start_new_session=True,  # a ^C to the server's group must not stop it
        )  # fmt: skip
    finally:
        os.close(read_end)
    return write_end


def release_orphans() -> None:
    """At a root server's start: what dead servers (of any home) left in the runtime dir and cgroups."""
    if os.geteuid() != 0:
        return
    root = bwrap_mod.runtime_dir() / "mnt"
    if root.is_dir():
        release_orphaned_layers(root, ctypes.CDLL(None, use_errno=True))
    release_orphaned_groups(Cgroups())


def release_orphaned_groups(cgroups: Cgroups) -> None:
    """Kill and remove sandbox cgroups (`<sandbox id>-<owner token>`) whose server is gone."""
    for name, group in cgroups.groups().items():
        _, sep, token = name.partition("-")
        if sep and not owner_alive(token):
            group.destroy()


def release_orphaned_layers(root: Path, libc: Any) -> None:
    """Unmount system layers left by a server that died (the owner in OWNER_FILE is gone).

    An owner whose pid now names another process is gone too (`owner_token`). A fuse
    daemon still serving such a mount exits once it is detached.
    """
    for d in root.iterdir():
        try:
            owner = (d / OWNER_FILE).read_text()
        except FileNotFoundError:
            if d.name.startswith(".") and being_made(d):
                continue  # another server's `_layer_dir`, between its mkdir and its owner file
            owner = ""  # a teardown cut short after its owner file went: nobody's
        except OSError:
            continue
        if not owner_alive(owner):
            release_layer(d, libc)


def being_made(d: Path) -> bool:
    try:
        return time.time() - d.lstat().st_mtime < LAYER_MAKING_SECONDS
    except FileNotFoundError:
        return False


def release_layer(d: Path, libc: Any) -> None:
    """Detach and remove one layer directory's mounts, then the directory if it is empty."""
    for point in (d / name for name in LAYER_POINTS):
        libc.umount2(bytes(point), MNT_DETACH)
        with contextlib.suppress(OSError):
            point.rmdir()
    remove_layer_dir(d)


def remove_layer_dir(d: Path) -> None:
    """The owner file, then the directory; never recursive (a mount point may still be live).

    Another cleaner (the death watch, a sweep) may be removing the same directory at once:
    either one's removal counts.
    """
    with contextlib.suppress(FileNotFoundError):
        (d / OWNER_FILE).unlink()
    with contextlib.suppress(OSError):
        d.rmdir()


def agent_loader(python: str) -> tuple[str, str, str] | None:
    """(loader, library dir, python) as /usr paths, from the interpreter's PT_INTERP."""
    real = os.path.realpath(python)
    try:
        with open(real, "rb") as f:
            elf = f.read(1 << 16)
        if elf[:4] != b"\x7fELF" or elf[4] != 2:
            return None
        (phoff,) = struct.unpack_from("<Q", elf, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
        for i in range(phnum):
            off = phoff + i * phentsize
            p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", elf, off)
            if p_type == 3:  # PT_INTERP
                interp = os.path.realpath(elf[p_offset : p_offset + p_filesz].rstrip(b"\0").decode())
                if real.startswith("/usr/") and interp.startswith("/usr/"):
                    return interp, os.path.dirname(interp), real
    except (OSError, struct.error, UnicodeError, IndexError):
        return None
    return None


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc/<pid>/task/*/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{p}/task"):
                with open(f"{task.path}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return found
