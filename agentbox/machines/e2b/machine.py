"""`E2BMachine`: the `Machine` protocol over an E2B sandbox (see the package docstring)."""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import dataclasses
import errno
import logging
import os
import posixpath
import secrets
import signal
import stat as stat_mod
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbox.machines.base import (
    DEFAULT_OUTPUT_LIMIT,
    MAX_MACHINE_READ_BYTES,
    OS,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileStat,
    collect,
    inside_path,
    pipes_only,
)
from agentbox.machines.e2b.options import DEFAULT_ROOT, HELPER_USER, REQUEST_TIMEOUT, E2BOptions, sdk
from agentbox.machines.e2b.process import E2BProcess, connect_error, oneof
from agentbox.machines.e2b.watch import E2BWatch
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.local import BASE_PATH
from agentbox.machines.ssh.channel import remote_command

if TYPE_CHECKING:
    from e2b import AsyncSandbox


log = logging.getLogger(__name__)

#: The metadata keys every sandbox of an e2b machine carries: its owner (the server home's
#: `home_label`), and the machine, instance and session it is for.
HOME_KEY, MACHINE_KEY, INSTANCE_KEY, SESSION_KEY = (
    "agentbox_home", "agentbox_machine", "agentbox_instance", "agentbox_session",
)  # fmt: skip
#: The refreshes push the end back every this share of `timeout`.
REFRESH_FRACTION = 0.5
#: Seconds a command's process may take to report its pid.
START_TIMEOUT = 30.0
#: Seconds a helper command of the machine's own (probe, chown, ln, kill) may take.
HELPER_TIMEOUT = 60.0
#: Between a file's name and the random part of the temp file a write goes through.
TEMP_INFIX = ".agentbox-"
#: Exit codes of the helper scripts that name an errno (127 is taken by remote_command).
ERRNO_EXIT = {errno.ENOENT: 2, errno.EEXIST: 17, errno.EINVAL: 22, errno.ENOTDIR: 20}

# What the first start learns about the sandbox, as root; $1 = the root, $2 = the user. A root
# that is not there is made, and given to the user.
PROBE = r"""[ -d "$1" ] || { mkdir -p -- "$1" && chown -- "$2" "$1"; } || exit 1
printf 'home=%s\n' "$(getent passwd "$2" | cut -d: -f6)"
printf 'uid=%s\n' "$(id -u -- "$2")"
printf 'gid=%s\n' "$(id -g -- "$2")"
printf 'os=%s\n' "$(uname -s)"
for t in rg grep inotifywait; do printf '%s=%s\n' "$t" "$(command -v "$t")"; done
exit 0
"""


@dataclass
class SandboxFacts:
    """What the first command in the sandbox learned."""

    home: str
    uid: int
    gid: int
    os: OS
    programs: dict[str, str | None]


class E2BMachine:
    """One E2B sandbox of one session (see the module docstring)."""

    kind = "e2b"
    isolated = True

    def __init__(
        self,
        name: str,
        instance_id: str,
        options: E2BOptions,
        env: dict[str, str] | None = None,
        *,
        session_id: str | None = None,
        sandbox_id: str | None = None,
        home: str = "",
    ) -> None:
        self.name = name
        self.home = home
        """The server home's label (`config.home_label`): whose sandbox it is, for the sweep."""
        self.instance_id = instance_id
        self.options = options
        self.env = dict(env or {})
        self.session_id = session_id
        self.sandbox_id = sandbox_id
        """The E2B sandbox's id: known once created, recorded in the session's marker."""
        self.os: OS = "linux"
        self.root = options.root
        self.network_on = options.network == "on"
        self.state = "stopped"
        self.last_used = time.monotonic()
        self.facts: SandboxFacts | None = None
        self.sandbox: AsyncSandbox | None = None
        self._process_rpc: Any = None
        self._files_rpc: Any = None
        self._processes: set[E2BProcess] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._owners: dict[str, tuple[int, int]] = {"root": (0, 0)}
        self._lock = asyncio.Lock()
        self._closed = False

    # lifecycle --------------------------------------------------------------------------

    def metadata(self) -> dict[str, str]:
        """What the sandbox carries on its endpoint, so a restarted server can find it (and
        sweep it when no live session names it: `sweep.py`)."""
        return {
            HOME_KEY: self.home,
            MACHINE_KEY: self.name,
            INSTANCE_KEY: self.instance_id,
            SESSION_KEY: self.session_id or "",
        }

    async def start(self) -> None:
        """Connect to this machine's sandbox (resuming it), or create it; then learn it."""
        async with self._lock:
            if self._closed:
                raise MachineUnavailable(f"machine {self.name!r} is closed")
            if self.state == "running" and self.sandbox is not None:
                return
            e2b = sdk()
            try:
                sandbox = await self._reconnect(e2b) or await self._create(e2b)
            except MachineUnavailable:
                raise
            except Exception as exc:
                raise self.unavailable(exc, e2b.exceptions) from None
            self._attach(sandbox)
            self.state = "running"
            try:
                self.facts = await self._probe()
            except BaseException:
                self._detach()
                raise
            self.os = self.facts.os
            self.last_used = time.monotonic()
            self._refresher = asyncio.ensure_future(self._refresh())

    async def _reconnect(self, e2b: Any) -> AsyncSandbox | None:
        """The sandbox this machine had (the marker's, else the one its metadata names), running
        again; None when there is none any more."""
        params = self.options.api_params()
        sandbox_id = self.sandbox_id
        if sandbox_id is None:
            query = e2b.SandboxQuery(metadata={INSTANCE_KEY: self.instance_id})
            found = await e2b.AsyncSandbox.list(query=query, **params).next_items()
            sandbox_id = found[0].sandbox_id if found else None
        if sandbox_id is None:
            return None
        try:
            sandbox: AsyncSandbox = await e2b.AsyncSandbox.connect(
                sandbox_id, timeout=self.options.timeout, **params
            )
        except e2b.exceptions.NotFoundException:
            log.info("e2b sandbox %s of machine %s is gone: a new one is made", sandbox_id, self.name)
            self.sandbox_id = None
            return None
        return sandbox

    async def _create(self, e2b: Any) -> AsyncSandbox:
        sandbox: AsyncSandbox = await e2b.AsyncSandbox.create(
            template=self.options.template,
            timeout=self.options.timeout,
            metadata=self.metadata(),
            allow_internet_access=self.network_on,
            **self.options.api_params(),
        )
        return sandbox

    def _attach(self, sandbox: AsyncSandbox) -> None:
        from e2b.envd.client_async import create_rpc_client
        from e2b.envd.filesystem import filesystem_connect
        from e2b.envd.process import process_connect

        self.sandbox = sandbox
        self.sandbox_id = sandbox.sandbox_id
        url, config = sandbox.envd_api_url, sandbox.connection_config
        self._process_rpc = create_rpc_client(process_connect.ProcessClient, url, config)
        self._files_rpc = create_rpc_client(filesystem_connect.FilesystemClient, url, config)

    async def _probe(self) -> SandboxFacts:
        result = await self.run(("/bin/sh", "-c", PROBE, "sh", self.root, self.options.user), cwd="/")
        if result.exit_code != 0:
            said = result.stderr.decode(errors="replace").strip()
            raise MachineUnavailable(f"the sandbox could not make its root {self.root}: {said}")
        facts = dict(
            line.split("=", 1) for line in result.stdout.decode(errors="replace").splitlines() if "=" in line
        )
        os_name = facts.get("os", "Linux").lower()
        return SandboxFacts(
            home=facts.get("home") or "/",
            uid=int(facts.get("uid") or 0),
            gid=int(facts.get("gid") or 0),
            os="darwin" if os_name == "darwin" else "linux",
            programs={t: facts.get(t) or None for t in ("rg", "grep", "inotifywait")},
        )

    async def _refresh(self) -> None:
        """Push the sandbox's end back while it runs: it ends by itself only without agentbox."""
        period = max(self.options.timeout * REFRESH_FRACTION, 1.0)
        while True:
            await asyncio.sleep(period)
            sandbox = self.sandbox
            if sandbox is None:
                return
            try:
                await sandbox.set_timeout(self.options.timeout)
            except Exception as exc:
                log.warning("could not refresh e2b sandbox %s: %s", self.sandbox_id, exc)

    async def stop(self) -> None:
        """Idle: pause the sandbox (or kill it, `on_stop = "kill"`); the next start resumes it."""
        async with self._lock:
            sandbox = self._detach()
            if sandbox is None:
                return
            try:
                if self.options.on_stop == "kill":
                    await sandbox.kill()
                    self.sandbox_id = None
                else:
                    await sandbox.pause()
            except Exception as exc:
                log.warning("could not %s e2b sandbox %s: %s", self.options.on_stop, self.sandbox_id, exc)

    async def destroy(self) -> None:
        """The session is closed: kill the sandbox (a paused one too, without resuming it)."""
        async with self._lock:
            sandbox = self._detach()
            try:
                if sandbox is not None:
                    await sandbox.kill()
                elif self.sandbox_id is not None:
                    await sdk().AsyncSandbox.kill(self.sandbox_id, **self.options.api_params())
            except Exception as exc:
                log.warning("could not kill e2b sandbox %s: %s", self.sandbox_id, exc)
            self.sandbox_id = None
            self._closed = True

    async def close(self) -> None:
        """The server stops: let go of the sandbox, which runs on until its timeout (the next
        server connects to it through the session's marker)."""
        async with self._lock:
            self._detach()
            self._closed = True

    def _detach(self) -> AsyncSandbox | None:
        """Stop the refreshes and what was pumping; the sandbox this machine held."""
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        for process in list(self._processes):
            process.abandon()
        sandbox, self.sandbox = self.sandbox, None
        self.state = "stopped"
        return sandbox

    def busy(self) -> bool:
        return bool(self._processes)

    def marker(self) -> dict[str, Any]:
        """The E2B sandbox's id, so a restarted server connects to it instead of making another."""
        return {"e2b_sandbox_id": self.sandbox_id, "endpoint": self.options.where}

    def capabilities(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "isolation": "e2b",
            "transport": "e2b envd (Connect RPC and /files)",
            "endpoint": self.options.where,
            "sandbox_id": self.sandbox_id,
            "template": self.options.template,
            "root": self.root,
            "user": self.options.user,
            "on_stop": self.options.on_stop,
            "timeout_seconds": self.options.timeout,
            "watch": self.watch_kind(),
            "grep": "not known until started" if facts is None else "rg" if facts.programs["rg"] else "grep",
            "network": self.options.network,
        }

    def unavailable(self, exc: BaseException, errors: Any = None) -> MachineUnavailable:
        """A failure of the endpoint (or of the way to it) as the machine's own."""
        if errors is not None and isinstance(exc, errors.AuthenticationException):
            return MachineUnavailable(f"{self.options.where} refused the API key: {exc}")
        return MachineUnavailable(
            f"the e2b sandbox {self.sandbox_id or ''} at {self.options.where} failed: {exc}"
        )

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        user = self.options.user
        home = self.facts.home if self.facts is not None else DEFAULT_ROOT
        return {
            "PATH": BASE_PATH,
            "HOME": home,
            "USER": user,
            "LOGNAME": user,
            "LANG": "C.UTF-8",
            **self.env,
            **request.env,
        }

    # commands -----------------------------------------------------------------------------

    def _running(self) -> AsyncSandbox:
        if self._closed:
            raise MachineUnavailable(f"machine {self.name!r} is closed")
        if self.sandbox is None or self.state != "running":
            raise MachineUnavailable(f"the e2b sandbox of machine {self.name!r} is not running")
        self.last_used = time.monotonic()
        return self.sandbox

    def _headers(self, user: str | None = None) -> dict[str, str]:
        from e2b.connection_config import KEEPALIVE_PING_HEADER, KEEPALIVE_PING_INTERVAL_SEC

        basic = base64.b64encode(f"{user or self.options.user}:".encode()).decode()
        return {"Authorization": f"Basic {basic}", KEEPALIVE_PING_HEADER: str(KEEPALIVE_PING_INTERVAL_SEC)}

    async def spawn(self, request: ExecRequest, *, user: str | None = None) -> E2BProcess:
        from e2b.envd.process import process_pb

        pipes_only(request, f"the e2b machine {self.name!r}")  # its `sandbox.pty` is not used yet
        self._running()
        cwd = inside_path(self.root, request.cwd or self.root)
        piped = request.stdin is not None or request.interactive
        line = remote_command(cwd, request.args(), self.command_env(request), stdin=piped)
        start = process_pb.StartRequest(
            process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", line], envs={}, cwd="/"),
            stdin=piped,
        )
        events = self._process_rpc.start(start, headers=self._headers(user or request.user))
        process = E2BProcess(self, events, request.args()[0], {"cwd": cwd, "exec": request.args()[0]})
        self._processes.add(process)
        process.begin()
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await asyncio.shield(process.started)
        except BaseException as exc:
            process.abandon()
            if isinstance(exc, TimeoutError):
                raise MachineUnavailable(f"the command did not start within {START_TIMEOUT:g} s") from None
            raise
        if request.stdin is not None:
            await process.write_stdin(request.stdin)
            await process.close_stdin()
        return process

    def ended(self, process: E2BProcess) -> None:
        self._processes.discard(process)
        self.last_used = time.monotonic()

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        result = await collect(process, request.output_limit, request.timeout)
        self.last_used = time.monotonic()
        return result

    async def run(
        self,
        argv: tuple[str, ...],
        *,
        cwd: str = "/",
        stdin: bytes | None = None,
        limit: int | None = None,
        user: str = HELPER_USER,
    ) -> ExecResult:
        """A helper command of the machine's own (as root unless `user` says otherwise)."""
        request = ExecRequest(
            argv=argv,
            cwd=cwd,
            stdin=stdin,
            timeout=HELPER_TIMEOUT,
            output_limit=limit or DEFAULT_OUTPUT_LIMIT,
        )
        process = await self.spawn(request, user=user)
        return await collect(process, request.output_limit, request.timeout)

    async def send_input(self, pid: int, data: bytes) -> None:
        from e2b.envd.process import process_pb

        await self._rpc_call(
            self._process_rpc.send_input,
            process_pb.SendInputRequest(
                process=process_pb.ProcessSelector(selector=oneof("pid", pid)),
                input=process_pb.ProcessInput(input=oneof("stdin", data)),
            ),
        )

    async def close_input(self, pid: int) -> None:
        from e2b.envd.process import process_pb

        await self._rpc_call(
            self._process_rpc.close_stdin,
            process_pb.CloseStdinRequest(process=process_pb.ProcessSelector(selector=oneof("pid", pid))),
        )

    def signal(self, process: E2BProcess, sig: int) -> None:
        task = asyncio.ensure_future(self._signal(process, sig))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signal(self, process: E2BProcess, sig: int) -> None:
        from e2b.envd.process import process_pb

        envd = {
            int(signal.SIGKILL): process_pb.Signal.SIGKILL,
            int(signal.SIGTERM): process_pb.Signal.SIGTERM,
        }
        name = signal.Signals(sig).name.removeprefix("SIG")
        script = 'kill -s "$1" -- "-$2" 2>/dev/null || kill -s "$1" -- "$2"'
        try:
            # The command's group (what it started too), whatever envd's own signal reaches.
            await self.run(("/bin/sh", "-c", script, "sh", name, str(process.pid)))
            if sig in envd and not process.exited.done():
                request = process_pb.SendSignalRequest(
                    process=process_pb.ProcessSelector(selector=oneof("pid", process.envd_pid)),
                    signal=envd[sig],
                )
                with contextlib.suppress(FileNotFoundError):  # it ended meanwhile
                    await self._rpc_call(self._process_rpc.send_signal, request)
        except (MachineUnavailable, OSError) as exc:
            log.warning(
                "could not signal process %s in e2b sandbox %s: %s", process.pid, self.sandbox_id, exc
            )

    async def _rpc_call(self, method: Any, request: Any, path: str | None = None) -> Any:
        """One unary envd call, its failure as an OSError of its errno or MachineUnavailable."""
        from connectrpc.errors import ConnectError

        self._running()
        try:
            return await method(request, timeout_ms=int(REQUEST_TIMEOUT * 1000))
        except ConnectError as exc:
            raise connect_error(exc, path, self) from None

    # files --------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return inside_path(self.root, path)

    async def stat(self, path: str) -> FileStat | None:
        """What `path` leads to (a link: its target's attributes, `is_symlink` set); None when
        nothing is there or the link leads nowhere."""
        target = self._path(path)
        entry = await self._entry(target)
        if entry is None:
            return None
        return await self._link_stat(target) if old_style_link(entry) else await self._to_stat(entry)

    async def _entry(self, target: str) -> Any | None:
        from e2b.envd.filesystem import filesystem_pb

        try:
            response = await self._rpc_call(
                self._files_rpc.stat, filesystem_pb.StatRequest(path=target), target
            )
        except FileNotFoundError:
            return None
        return response.entry

    async def _to_stat(self, entry: Any) -> FileStat:
        from e2b.envd.filesystem import filesystem_pb

        kind = entry.type
        letter = (entry.permissions or "-")[:1]
        is_dir = kind == filesystem_pb.FileType.DIRECTORY
        is_file = kind == filesystem_pb.FileType.FILE and letter == "-"
        uid = await self._owner_id(entry.owner, 0)
        gid = await self._owner_id(entry.group, 1)
        mtime = entry.modified_time
        return FileStat(
            path=entry.path,
            is_dir=is_dir,
            is_file=is_file,
            is_symlink=bool(entry.is_symlink) or kind == filesystem_pb.FileType.SYMLINK,
            size=int(entry.size),
            mtime=(mtime.seconds + mtime.nanos / 1e9) if mtime is not None else 0.0,
            mode=stat_mod.S_IMODE(int(entry.mode)),
            uid=uid,
            gid=gid,
            inode=0,
        )

    async def _owner_id(self, name: str, which: int) -> int:
        """A uid (which=0) or gid (1) from envd's owner name."""
        if not name or name.isdigit():
            return int(name or 0)
        if name not in self._owners:
            try:
                self._owners[name] = await self.user_ids(name)
            except (OwnerUnsupported, MachineUnavailable, OSError):
                return 0
        return self._owners[name][which]

    async def list(self, path: str) -> builtins.list[FileEntry]:
        from e2b.envd.filesystem import filesystem_pb

        target = self._path(path)
        await self._require_dir(target, path)
        response = await self._rpc_call(
            self._files_rpc.list_dir, filesystem_pb.ListDirRequest(path=target, depth=1), path
        )
        entries = sorted(response.entries, key=lambda e: e.name)
        stats = await asyncio.gather(*(self._listed(target, e) for e in entries))
        return [
            FileEntry(e.name, posixpath.join(target, e.name), st)
            for e, st in zip(entries, stats, strict=True)
        ]

    async def _listed(self, parent: str, entry: Any) -> FileStat:
        """A listed entry's stat; a link's is its target's, as a local listing gives it."""
        path = posixpath.join(parent, entry.name)
        if old_style_link(entry):
            followed = await self._link_stat(path)
            if followed is not None:
                return followed
        return dataclasses.replace(await self._to_stat(entry), path=path)

    async def _link_stat(self, path: str) -> FileStat | None:
        """What a link leads to, asked of the sandbox (envd that says SYMLINK for a link's type
        tells nothing of its target); None when it leads nowhere."""
        result = await self.run(("stat", "-L", "-c", "%f %s %Y %u %g", "--", path))
        parts = result.stdout.split()
        if result.exit_code != 0 or len(parts) != 5:
            return None
        mode = int(parts[0], 16)
        return FileStat(
            path=path, is_dir=stat_mod.S_ISDIR(mode), is_file=stat_mod.S_ISREG(mode), is_symlink=True,
            size=int(parts[1]), mtime=float(parts[2]), mode=stat_mod.S_IMODE(mode),
            uid=int(parts[3]), gid=int(parts[4]), inode=0,
        )  # fmt: skip

    async def _require_dir(self, target: str, path: str) -> FileStat:
        st = await self.stat(target)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if not st.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return st

    async def read(
        self, path: str, *, offset: int = 0, length: int | None = None, limit: int = MAX_MACHINE_READ_BYTES
    ) -> bytes:
        """`length` bytes from `offset`, or the rest of the file, refused (EFBIG) past `limit`."""
        target = self._path(path)
        st = await self.stat(target)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if st.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if length is None and max(st.size - offset, 0) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        want = limit + 1 if length is None else length
        if offset > 0:
            data = await self._read_range(target, path, offset, want)
        else:
            data = await self._download(target, path, want)
        if length is None and len(data) > limit:  # it grew since the stat
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes", path)
        return data

    async def _download(self, target: str, path: str, want: int) -> bytes:
        """The file's first `want` bytes through envd's `/files`, the rest left unread."""
        e2b = sdk()
        sandbox = self._running()
        parts: builtins.list[bytes] = []
        got = 0
        try:
            reader = await sandbox.files.read(target, format="stream", user=HELPER_USER)
            try:
                async for chunk in reader:
                    parts.append(bytes(chunk[: want - got]))
                    got += len(parts[-1])
                    if got >= want:
                        break
            finally:
                await reader.aclose()
        except e2b.exceptions.NotFoundException:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        except Exception as exc:
            raise self._files_error(exc, path) from None
        return b"".join(parts)

    async def _read_range(self, target: str, path: str, offset: int, length: int) -> bytes:
        """Bytes from `offset` by a command in the sandbox (envd's `/files` reads from the start)."""
        script = 'tail -c "+$(($2 + 1))" -- "$1" | head -c "$3"'
        result = await self.run(("/bin/sh", "-c", script, "sh", target, str(offset), str(length)),
                                limit=length)  # fmt: skip
        if result.exit_code != 0:
            raise OSError(errno.EIO, result.stderr.decode(errors="replace").strip(), path)
        return result.stdout

    def _files_error(self, exc: BaseException, path: str) -> BaseException:
        if isinstance(exc, OSError | MachineUnavailable):
            return exc
        e2b = sdk()
        if isinstance(exc, e2b.exceptions.NotFoundException):
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if isinstance(exc, e2b.exceptions.NotEnoughSpaceException):
            return OSError(errno.ENOSPC, str(exc), path)
        return self.unavailable(exc, e2b.exceptions)

    async def write(self, path: str, data: bytes) -> None:
        """Replace the file atomically: a temp file beside it, moved over it."""

        async def body() -> AsyncIterator[bytes]:
            yield data

        await self.write_stream(path, body(), limit=len(data))

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """`write` from chunks as they arrive; nothing replaces the target before the last one."""
        target = self._path(path)
        old = await self.stat(target)
        if old is not None and old.is_symlink:  # write where the link points, as a local write does
            target = await self._realpath(target, path)
            old = await self.stat(target)
        if old is not None and old.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        temp = await self._upload_temp(target, path, chunks, limit)
        try:
            if old is not None:
                await self._keep_mode(temp, old)
            await self._move(temp.path, target, path)
        except BaseException:
            await self._discard(temp)
            raise
        return temp.size

    async def create(self, path: str, chunks: AsyncIterable[bytes], *, limit: int) -> int:
        """Upload a temp file, then hard-link it to the name: `ln` refuses a name that is taken
        (by a dangling link too), so a concurrent writer is never overwritten."""
        target = self._path(path)
        temp = await self._upload_temp(target, path, chunks, limit)
        try:
            script = f'ln -- "$1" "$2" 2>/dev/null && exit 0; [ -e "$2" ] || [ -L "$2" ] && exit {ERRNO_EXIT[errno.EEXIST]}; exit 1'
            result = await self.run(
                ("/bin/sh", "-c", script, "sh", temp.path, target), user=self.options.user
            )
            if result.exit_code == ERRNO_EXIT[errno.EEXIST]:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            if result.exit_code != 0:
                raise OSError(errno.EIO, f"could not create {path}", path)
        finally:
            await self._discard(temp)
        return temp.size

    async def _upload_temp(self, target: str, path: str, chunks: AsyncIterable[bytes], limit: int) -> Staged:
        """The chunks in a new temp file beside `target`; EFBIG past `limit` (nothing left)."""
        parent, name = posixpath.split(target)
        await self._require_dir(parent, posixpath.dirname(path) or parent)
        staged = Staged(posixpath.join(parent, f".{name}{TEMP_INFIX}{secrets.token_hex(6)}.tmp"))

        async def counted() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                staged.size += len(chunk)
                if staged.size > limit:
                    staged.too_big = True
                    raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path)
                yield bytes(chunk)

        sandbox = self._running()
        try:
            await sandbox.files.write(staged.path, counted(), user=self.options.user, use_octet_stream=True)
        except BaseException as exc:
            await self._discard(staged)
            if staged.too_big:
                raise OSError(errno.EFBIG, f"{path} would be larger than {limit} bytes", path) from None
            if isinstance(exc, Exception):
                raise self._files_error(exc, path) from None
            raise
        return staged

    async def _discard(self, staged: Staged) -> None:
        with contextlib.suppress(OSError, MachineUnavailable):
            if await self._entry(staged.path) is not None:
                await self._remove_rpc(staged.path, staged.path)

    async def _keep_mode(self, staged: Staged, old: FileStat) -> None:
        """The replaced file's mode for the file that replaces it (a chmod only when it differs)."""
        new = await self.stat(staged.path)
        if new is not None and stat_mod.S_IMODE(new.mode) != stat_mod.S_IMODE(old.mode):
            await self.run(("chmod", f"{stat_mod.S_IMODE(old.mode):o}", "--", staged.path))

    async def _realpath(self, target: str, path: str) -> str:
        result = await self.run(("readlink", "-f", "--", target))
        resolved = result.stdout.decode(errors="surrogateescape").strip()
        if result.exit_code != 0 or not resolved:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return resolved

    async def _move(self, source: str, destination: str, path: str) -> None:
        from e2b.envd.filesystem import filesystem_pb

        request = filesystem_pb.MoveRequest(source=source, destination=destination)
        await self._rpc_call(self._files_rpc.move, request, path)

    async def _remove_rpc(self, target: str, path: str) -> None:
        from e2b.envd.filesystem import filesystem_pb

        await self._rpc_call(self._files_rpc.remove, filesystem_pb.RemoveRequest(path=target), path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        target = self._path(path)
        entry = await self._entry(target)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        st = await self._to_stat(entry)
        if st.is_dir and not st.is_symlink and not recursive and await self.list(target):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        await self._remove_rpc(target, path)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        from e2b.envd.filesystem import filesystem_pb

        target = self._path(path)
        existing = await self._entry(target)
        if existing is not None:
            if parents and (await self._to_stat(existing)).is_dir:
                return
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        if not parents:
            await self._require_dir(posixpath.dirname(target), path)
        await self._rpc_call(self._files_rpc.make_dir, filesystem_pb.MakeDirRequest(path=target), path)

    async def rename(self, src: str, dst: str) -> None:
        source, destination = self._path(src), self._path(dst)
        if await self._entry(source) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), src)
        await self._require_dir(posixpath.dirname(destination), dst)
        await self._move(source, destination, src)

    async def chown(self, path: str, user: str) -> None:
        uid, gid = await self.user_ids(user)
        target = self._path(path)
        result = await self.run(("chown", "-h", f"{uid}:{gid}", "--", target))
        if result.exit_code != 0:
            if await self._entry(target) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            raise PermissionError(errno.EPERM, result.stderr.decode(errors="replace").strip(), path)

    async def readlink(self, path: str) -> str:
        target = self._path(path)
        script = (
            f'[ -L "$1" ] || {{ [ -e "$1" ] && exit {ERRNO_EXIT[errno.EINVAL]}; exit {ERRNO_EXIT[errno.ENOENT]}; }}; '
            'readlink -- "$1"'
        )
        result = await self.run(("/bin/sh", "-c", script, "sh", target))
        failed = helper_errno(result.exit_code)
        if failed is not None:
            raise OSError(failed, os.strerror(failed), path)
        return result.stdout.decode(errors="surrogateescape").removesuffix("\n")

    async def symlink(self, target: str, path: str) -> None:
        where = self._path(path)
        script = (
            f'{{ [ -e "$2" ] || [ -L "$2" ]; }} && exit {ERRNO_EXIT[errno.EEXIST]}; '
            f'[ -d "$(dirname -- "$2")" ] || exit {ERRNO_EXIT[errno.ENOENT]}; ln -s -- "$1" "$2"'
        )
        result = await self.run(("/bin/sh", "-c", script, "sh", target, where), user=self.options.user)
        failed = helper_errno(result.exit_code)
        if failed is not None:
            raise OSError(failed, os.strerror(failed), path)

    async def find_program(self, name: str) -> str | None:
        """Programs the start probe looks for (`rg`, `grep`, `inotifywait`); others by `command -v`."""
        if self.facts is not None and name in self.facts.programs:
            return self.facts.programs[name]
        result = await self.run(("/bin/sh", "-c", 'command -v -- "$1"', "sh", name))
        found = result.stdout.decode(errors="replace").strip()
        return found if result.exit_code == 0 and found.startswith("/") else None

    async def user_ids(self, user: str) -> tuple[int, int]:
        """The sandbox's uid and gid of `user`, asked once (`id`)."""
        if user not in self._owners:
            result = await self.run(("/bin/sh", "-c", 'id -u -- "$1" && id -g -- "$1"', "sh", user))
            numbers = result.stdout.split()
            if result.exit_code != 0 or len(numbers) != 2:
                raise OwnerUnsupported(
                    f"this machine cannot give files to user {user!r}: the sandbox has no such user"
                )
            self._owners[user] = (int(numbers[0]), int(numbers[1]))
        return self._owners[user]

    # watching -----------------------------------------------------------------------------

    def watch_kind(self) -> str:
        return "envd WatchDir (inotify in the sandbox)"

    def watch(self, path: str, *, recursive: bool = True) -> E2BWatch:
        """Changes under `path` as `WatchChange`s (the optional `Watching` capability)."""
        return E2BWatch(self, path, recursive)


@dataclass
class Staged:
    """A temp file an upload went to."""

    path: str
    size: int = 0
    too_big: bool = False


def old_style_link(entry: Any) -> bool:
    """A link whose type envd gives as SYMLINK (its own, not its target's: envd before
    `is_symlink`, or a link that leads nowhere)."""
    from e2b.envd.filesystem import filesystem_pb

    return entry.type == filesystem_pb.FileType.SYMLINK


def helper_errno(code: int) -> int | None:
    """The errno a helper script's exit code names (0: none; others: EIO)."""
    if code == 0:
        return None
    return next((e for e, c in ERRNO_EXIT.items() if c == code), errno.EIO)
