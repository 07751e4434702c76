"""The `sandbox` kind: one bubblewrap sandbox per session, isolated, root `/workspace`.

A sandbox is a fresh tmpfs root with the host's `/usr` (read-only, or under a discardable
overlay), a curated `/etc` and a small `/var` (see `sysroot.py`), `/workspace` bound from
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

Teardown kills every process of the sandbox (cgroup, or the launcher's mount namespace
when there are no cgroups) and removes this lifetime's directories; `/workspace` stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import stat as stat_mod
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.machines import bwrap as bwrap_mod
from agentbox.machines import seccomp
from agentbox.machines.base import OS, ExecRequest, ExecResult, collect
from agentbox.machines.cgroups import Cgroups, Limits, SandboxGroup
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.pathmap import Alias, Mount, PathMap
from agentbox.machines.sysroot import Base, ensure_base, hosts_file, resolv_conf

#: Where a root host keeps the curated base system (rebuilt when the host's /etc or dpkg changes).
SHARED_BASE_DIR = Path("/var/cache/agentbox")
#: Seconds a sandbox may take from launch to its agent saying "ready".
START_TIMEOUT = 20.0
#: Host uid/gid sandbox processes run as when the server is root.
DEFAULT_SANDBOX_UID = 64999
SANDBOX_HOME = "/root"
#: Where the exec agent sees the host's /usr read-only when /usr itself is the fuse layer.
AGENT_USR = "/.agentbox"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The whole environment of every process the server starts for a sandbox.
LAUNCH_ENV = {"PATH": SANDBOX_PATH}
AGENT_SOURCE = (Path(__file__).parent / "exec_agent.py").read_text()
#: Bytes read from a command pipe per wakeup.
PIPE_CHUNK = 65536

#: Mode of a sandbox's per-lifetime directory (`run/`, owned by the sandbox uid).
RUN_DIR_MODE = 0o700
#: Mode of a system layer's mount directory (`root:<sandbox gid>`): only the sandbox group passes.
LAYER_DIR_MODE = 0o710

MNT_DETACH = 2
#: File in a system layer's mount directory naming the server pid that owns it.
OWNER_FILE = "owner"


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


class SandboxHost:
    """What one server shares among its sandboxes: binaries, uid, cgroups, the base system."""

    def __init__(self, home: Path, uid: int = DEFAULT_SANDBOX_UID, gid: int | None = None) -> None:
        self.home = home
        self.root = os.geteuid() == 0
        self.uid = uid if self.root else os.geteuid()
        self.gid = (gid if gid is not None else uid) if self.root else os.getegid()
        self.bwrap = bwrap_mod.usable_binary(bwrap_mod.runtime_dir() if self.root else None)
        self.cgroups = Cgroups()
        # A cache keyed by host state: shared by every server on a root host.
        self.base: Base = ensure_base(SHARED_BASE_DIR if self.root else home)
        self.fuse = shutil.which("fuse-overlayfs")
        self.slirp = shutil.which("slirp4netns")
        self.python = next(
            (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists()), None
        )
        self.libc = ctypes.CDLL(None, use_errno=True)
        self._seccomp: bytes | None = None
        self.merged_root = bwrap_mod.runtime_dir() / "mnt" if self.root else None
        if self.merged_root is not None:
            # Searchable, not listable: bwrap (as the sandbox uid) resolves the mounts by path.
            self.merged_root.mkdir(exist_ok=True)
            os.chmod(self.merged_root, 0o711)
            release_orphaned_layers(self.merged_root, self.libc)

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

    def capabilities(self, config: SandboxConfig) -> dict[str, Any]:
        layer, layer_detail = self.system_layer()
        return {
            "isolation": "bubblewrap",
            "bwrap": str(self.bwrap),
            "host_uid": self.uid,
            "system_layer": layer and config.system_layer,
            "system_layer_detail": layer_detail if config.system_layer else "disabled by configuration",
            "network": "on" if config.network and self.slirp else "off",
            "network_detail": (
                "slirp4netns, host loopback unreachable"
                if config.network and self.slirp
                else ("slirp4netns missing" if config.network else "loopback only")
            ),
            "resource_limits": self.cgroups.report(),
        }


class _Pipe:
    """Feed a StreamReader from a pipe with `add_reader`: cheaper than a transport per command."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.reader = asyncio.StreamReader(limit=2**31, loop=loop)
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, PIPE_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.reader.feed_data(data)
        else:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.reader.feed_eof()


class SandboxProcess:
    """A command started by the exec agent."""

    def __init__(
        self, sandbox: SandboxMachine, cid: int, stdout: _Pipe, stderr: _Pipe, stdin: int | None
    ) -> None:
        self.sandbox = sandbox
        self.cid = cid
        self.pid = 0
        self._out, self._err = stdout, stderr
        self.stdout = stdout.reader
        self.stderr = stderr.reader
        self._stdin = stdin
        self.argv0 = ""
        self.exited: asyncio.Future[int] = sandbox.loop.create_future()

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin is None:
            raise BrokenPipeError("stdin is closed")
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._stdin, view)
                view = view[n:]
            except BlockingIOError:
                await asyncio.sleep(0.005)

    async def close_stdin(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group, also after its leader exited (children remain)."""
        with contextlib.suppress(MachineUnavailable):
            if not self.exited.done():
                self.sandbox._send([b"K", self.cid, int(sig)])
            elif self.pid:
                self.sandbox._send([b"G", self.pid, int(sig)])


class SandboxMachine(HostFiles):
    kind = "sandbox"
    isolated = True
    os: OS = "linux"
    root = "/workspace"

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
        self.users = {"root": self.owner, str(0): self.owner}
        self.paths = self._pathmap()
        self.loop: asyncio.AbstractEventLoop = asyncio.get_event_loop()
        self.state = "stopped"
        self.started_at = 0.0
        self.last_used = time.monotonic()
        self.running = 0
        self.network_on = False
        self.layer_on = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._slirp: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        self._group: SandboxGroup | None = None
        self._fuse: list[subprocess.Popen[bytes]] = []
        self._mounts: list[Path] = []
        self._log_fds: list[int] = []
        self._next = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._procs: dict[int, SandboxProcess] = {}
        self._ready: asyncio.Future[None] | None = None
        self._child_pid = 0
        self._slirp_exit: int | None = None
        self._baseline = 0
        self._stopping: asyncio.Task[None] | None = None
        self._buffer = b""

    def _pathmap(self) -> PathMap:
        base = self.host.base
        mounts = [
            Mount("/workspace", self.workspace),
            Mount("/tmp", self.run / "tmp"),
            Mount(SANDBOX_HOME, self.run / "home"),
            Mount("/usr", Path("/usr"), writable=False),
            Mount("/etc", base.etc, writable=False),
        ]
        aliases = [
            Alias(f"/{d}", f"/usr/{d}") for d in ("bin", "sbin", "lib", "lib64") if Path(f"/{d}").is_symlink()
        ]
        return PathMap(mounts, self.root, aliases)

    # lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        if self.state == "running":
            return
        if self._stopping is not None:  # a stop in progress must finish before a new lifetime
            await asyncio.shield(self._stopping)
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
            self._join_group()
        except BaseException:
            await self.stop()
            raise
        self.state = "running"
        self.started_at = time.time()
        self.last_used = time.monotonic()
        self.start_seconds = time.monotonic() - started

    def _join_group(self) -> None:
        """Move every process of this sandbox into its cgroup.

        Done once the agent has said ready and before it is asked to start anything, so the
        whole tree is present and every command is born inside the group.
        """
        if self._group is None or self._proc is None:
            return
        pids = [*process_tree(self._proc.pid), *(p.pid for p in self._fuse)]
        if self._slirp is not None:
            pids.append(self._slirp.pid)
        for pid in pids:
            with contextlib.suppress(OSError):
                self._group.add(pid)
        self._baseline = len(self._group.pids())

    def _ready_future(self) -> asyncio.Future[None]:
        assert self._ready is not None
        return self._ready

    def _prepare_dirs(self) -> None:
        """The session's workspace and this lifetime's /tmp, $HOME and /var, given to the sandbox uid.

        `run/` is the sandbox uid's alone (0700): bwrap, as that uid, passes through it to bind
        them, and no other host user can reach what a sandbox leaves in /tmp or $HOME. /tmp
        itself stays 1777, as programs inside expect of /tmp.
        """
        for d in (self.workspace, self.run / "tmp", self.run / "home", self.run / "var"):
            d.mkdir(parents=True, exist_ok=True)
            self.give(d)
        os.chmod(self.run / "tmp", 0o1777)
        self.give(self.run)
        os.chmod(self.run, RUN_DIR_MODE)

    async def _launch(self) -> None:
        host, config = self.host, self.config
        if host.python is None:
            raise MachineUnavailable("no python3 under the host's /usr for the exec agent")
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        opened: list[int] = [child.fileno(), info_w]
        layer, _ = host.system_layer()
        self.layer_on = layer and config.system_layer
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
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--clearenv", "--setenv", "PATH", SANDBOX_PATH,
            "--proc", "/proc", "--dev", "/dev",
            "--seccomp", str(data_fd(host.no_setid_filter())),  # see machines/seccomp.py
        ]  # fmt: skip
        if self.layer_on:
            merged = await self._mount_layer()
            args += ["--bind-fd", str(fd_of(merged / "usr")), "/usr"]
            args += ["--bind-fd", str(fd_of(merged / "sys" / "etc")), "/etc"]
            args += ["--bind-fd", str(fd_of(merged / "sys" / "var")), "/var"]
            args += ["--ro-bind", "/usr", AGENT_USR + "/usr"]
        else:
            args += ["--ro-bind", "/usr", "/usr", "--ro-bind-fd", str(fd_of(host.base.etc)), "/etc"]
            args += ["--bind-fd", str(fd_of(self.run / "var")), "/var"]
        for d in ("bin", "sbin", "lib", "lib64"):
            if Path(f"/{d}").is_symlink():
                args += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
            elif Path(f"/{d}").is_dir():
                args += ["--ro-bind", f"/{d}", f"/{d}"]
        args += [
            "--ro-bind-data", str(data_fd(resolv_conf(self.network_on))), "/etc/resolv.conf",
            "--ro-bind-data", str(data_fd(hosts_file(self.hostname))), "/etc/hosts",
            "--ro-bind-data", str(data_fd(self.hostname + "\n")), "/etc/hostname",
            "--bind-fd", str(fd_of(self.workspace)), "/workspace",
            "--bind-fd", str(fd_of(self.run / "tmp")), "/tmp",
            "--bind-fd", str(fd_of(self.run / "home")), SANDBOX_HOME,
            "--chdir", "/workspace",
            "--info-fd", str(info_w),
            *self._agent_command(), "-I", "-S", "-c", AGENT_SOURCE, str(child.fileno()),
        ]  # fmt: skip
        if host.root:  # drop to the sandbox uid by exec, so Popen can vfork (no preexec_fn)
            args = [
                "setpriv",
                f"--reuid={host.uid}",
                f"--regid={host.gid}",
                "--clear-groups",
                "--inh-caps=-all",
                *args,
            ]
        self._group = host.cgroups.create(f"{self.sandbox_id}-{os.getpid()}", config.limits)
        try:
            self._proc = subprocess.Popen(
                args,
                pass_fds=opened,
                stdin=subprocess.DEVNULL,
                stderr=self._log(),
                close_fds=True,
                env=LAUNCH_ENV,  # bwrap is pid 1 inside: its environ is readable there
            )
        finally:
            for fd in opened[1:]:
                os.close(fd)
            child.close()
        self._ctl = parent
        parent.setblocking(False)
        self._ready = self.loop.create_future()
        self.loop.add_reader(parent.fileno(), self._on_control)
        info = await self.loop.run_in_executor(None, _read_info, info_r)
        self._child_pid = int(info.get("child-pid") or 0)

    def _agent_command(self) -> list[str]:
        """How to start the agent's python: past the fuse layer when there is one.

        Loading python and its stdlib through a fresh fuse-overlayfs costs tens of
        milliseconds of cold lookups, so with the system layer the agent runs from a
        read-only bind of the host's /usr at AGENT_USR, through the host's own loader.
        """
        assert self.host.python is not None
        direct = agent_loader(self.host.python)
        if not self.layer_on or direct is None:
            return [self.host.python]
        loader, libdir, python = direct
        return [f"{AGENT_USR}{loader}", "--library-path", f"{AGENT_USR}{libdir}", f"{AGENT_USR}{python}"]

    def _log_tail(self, limit: int = 500) -> str:
        try:
            return (self.run / "launcher.log").read_text(errors="replace").strip()[
                -limit:
            ] or "no diagnostics"
        except OSError:
            return "no diagnostics"

    def _log(self) -> int:
        """The launcher's stderr (bwrap and fuse diagnostics) goes to run/launcher.log."""
        fd = os.open(self.run / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._log_fds.append(fd)
        return fd

    async def _mount_layer(self) -> Path:
        """Mount the discardable system layer: fuse-overlayfs over /usr and over the base.

        The mounts live in the host's mount namespace under a root-only directory and are
        handed to bwrap as descriptors; nothing is bind-mounted under AGENTBOX_HOME, so no
        recursive delete there can ever reach the host's /usr.
        """
        host = self.host
        assert host.merged_root is not None and host.fuse is not None
        merged = host.merged_root / self.sandbox_id
        merged.mkdir(parents=True, exist_ok=True)
        # The layer holds the host's setuid programs (squashed to the sandbox uid): only the
        # sandbox group may pass (bwrap binds by path as that uid), and the mounts are nosuid.
        os.chown(merged, 0, host.gid)
        os.chmod(merged, LAYER_DIR_MODE)
        (merged / OWNER_FILE).write_text(str(os.getpid()))
        for name, lower in (("usr", Path("/usr")), ("sys", host.base.root)):
            upper, work, point = self.run / "upper" / name, self.run / "work" / name, merged / name
            for d in (upper, work, point):
                d.mkdir(parents=True, exist_ok=True)
            opts = (
                f"lowerdir={lower},upperdir={upper},workdir={work},"
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
        ok = await self.loop.run_in_executor(None, os.read, ready_r, 1)
        os.close(ready_r)
        if ok != b"1":
            raise MachineUnavailable(f"slirp4netns failed to start: see {self.run / 'launcher.log'}")

    async def stop(self) -> None:
        """Kill everything this lifetime started and forget /tmp, $HOME and the system layer.

        Concurrent calls share one teardown, and `start` waits for it to finish.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        task = self._stopping
        try:
            await asyncio.shield(task)
        finally:
            if self._stopping is task and task.done():
                self._stopping = None

    async def _stop(self) -> None:
        self.state = "stopped"
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self._ctl.fileno())
            self._ctl.close()
            self._ctl = None
        await asyncio.get_running_loop().run_in_executor(None, self._kill_all)
        error = MachineUnavailable("the sandbox stopped")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        for proc in self._procs.values():
            if not proc.exited.done():
                proc.exited.set_result(137)
        self._pending.clear()
        self._procs.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(MachineUnavailable("the sandbox exited during start"))
            self._ready.exception()
        shutil.rmtree(self.run, ignore_errors=True)

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
            with contextlib.suppress(OSError):
                (self._mounts[0].parent / OWNER_FILE).unlink()
                self._mounts[0].parent.rmdir()
        self._mounts.clear()
        self._fuse.clear()
        if self._group is not None:  # after reaping: a zombie still holds its cgroup
            self._group.destroy()
            self._group = None
        for fd in self._log_fds:
            os.close(fd)
        self._log_fds.clear()

    async def close(self) -> None:
        await self.stop()

    # control channel -------------------------------------------------------------

    def _send(self, fields: list[bytes | str | int], fds: list[int] | None = None) -> None:
        if self._ctl is None:
            raise MachineUnavailable("the sandbox is not running")
        data = b"\0".join(f if isinstance(f, bytes) else str(f).encode() for f in fields)
        try:
            if fds:
                socket.send_fds(self._ctl, [data], fds)
            else:
                self._ctl.send(data)
        except OSError as exc:
            raise MachineUnavailable(f"the sandbox's exec agent is gone: {exc}") from exc

    def _on_control(self) -> None:
        assert self._ctl is not None
        try:
            data = self._ctl.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(self._ctl.fileno())
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(
                    MachineUnavailable(f"the sandbox exited during start: {self._log_tail()}")
                )
                self._ready.exception()
            self.loop.create_task(self._agent_gone())
            return
        op, *rest = data.split(b"\0")
        if op == b"R":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif op == b"P":
            fut = self._pending.pop(int(rest[0]), None)
            if fut is not None and not fut.done():
                fut.set_result(int(rest[1]))
        elif op == b"E":
            cid = int(rest[0])
            fut = self._pending.pop(cid, None)
            proc = self._procs.get(cid)
            if fut is not None and not fut.done():
                name = proc.argv0 if proc is not None else None
                fut.set_exception(OSError(int(rest[1]), rest[2].decode(errors="replace"), name))
        elif op == b"X":
            proc = self._procs.pop(int(rest[0]), None)
            if proc is not None:
                self.running -= 1
                if not proc.exited.done():
                    proc.exited.set_result(int(rest[1]))
            self.last_used = time.monotonic()

    async def _agent_gone(self) -> None:
        if self.state == "running":
            await self.stop()

    # commands ---------------------------------------------------------------------

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        return {
            "PATH": SANDBOX_PATH,
            "HOME": SANDBOX_HOME,
            "USER": "root",
            "LOGNAME": "root",
            "LANG": "C.UTF-8",
            "HOSTNAME": self.hostname,
            "TERM": "xterm-256color",
            **self.config.env,
            **request.env,
        }

    async def spawn(self, request: ExecRequest) -> SandboxProcess:
        if self.state != "running":
            raise MachineUnavailable("the sandbox is not running")
        self.last_used = time.monotonic()
        cwd = self.paths.absolute(request.cwd or self.root)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        fds = [out_w, err_w]
        stdin_w = None
        if request.stdin is not None or request.interactive:
            in_r, stdin_w = os.pipe2(os.O_CLOEXEC)
            fds.append(in_r)
        self._next += 1
        cid = self._next
        fut: asyncio.Future[int] = self.loop.create_future()
        self._pending[cid] = fut
        proc = SandboxProcess(self, cid, _Pipe(out_r, self.loop), _Pipe(err_r, self.loop), stdin_w)
        proc.argv0 = request.args()[0]
        self._procs[cid] = proc
        self.running += 1
        try:
            argv = request.args()
            env = [f"{k}={v}" for k, v in self.command_env(request).items()]
            self._send([b"S", cid, cwd, len(argv), *argv, *env], fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            proc.pid = await fut
        except BaseException:
            self._procs.pop(cid, None)
            self.running -= 1
            proc._out.close()
            proc._err.close()
            if stdin_w is not None:
                os.close(stdin_w)
            raise
        if request.stdin is not None:
            await proc.write_stdin(request.stdin)
            await proc.close_stdin()
        return proc

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result

    def busy(self) -> bool:
        """A running command (or a process it left behind) keeps the sandbox alive."""
        if self.running > 0:
            return True
        if self._group is not None:
            return len(self._group.pids()) > self._baseline
        return False


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


def release_orphaned_layers(root: Path, libc: Any) -> None:
    """Unmount system layers left by a server that died (its pid in OWNER_FILE is gone)."""
    for d in root.iterdir():
        try:
            owner = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{owner}").exists():
            continue
        for point in (d / "usr", d / "sys"):
            libc.umount2(bytes(point), MNT_DETACH)
            with contextlib.suppress(OSError):
                point.rmdir()
        with contextlib.suppress(OSError):
            (d / OWNER_FILE).unlink()
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
