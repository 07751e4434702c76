"""envd, E2B's in-sandbox daemon, served by agentbox for its sandboxes: Connect RPC and `/files`.

The `e2b` SDK sends every envd request to one URL (`E2B_SANDBOX_URL`) with the sandbox in
`E2b-Sandbox-Id` and the sandbox's `envdAccessToken` in `X-Access-Token`; `Envd` checks
both, then hands the request to one of:

    /process.Process/{Start,Connect,List,SendSignal,SendInput,CloseStdin}   Connect RPC
    /filesystem.Filesystem/{Stat,ListDir,MakeDir,Move,Remove}               Connect RPC
    /filesystem.Filesystem/{WatchDir,CreateWatcher,GetWatcherEvents,RemoveWatcher}
    GET  /files?path=        the file's bytes
    POST /files?path=        multipart (a part per file, named by its path) or octet-stream (gzip too)
    /files?...&signature=    a signed URL (`download_url`, `upload_url`): no headers, the sandbox
                             is the one whose token made the signature
    GET  /health             204

A process is a command of the machine's `CommandManager` (so `/v2/commands` lists it too);
its pid is a number this sandbox's table hands out, not the kernel's. Files go through
`file_ops(machine)`; relative paths are taken from the machine's root (`/workspace`). Not
served yet: PTYs, `StreamInput`, `Update`, file metadata, and running as a named user
(`username` / `user` is accepted and ignored: commands run as the sandbox's own root).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shlex
import signal
import stat as stat_mod
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.api.envelope import BodyTooLarge, read_form
from agentbox.api.v1_file import MAX_UPLOAD_FORM_BYTES, spooled
from agentbox.e2b.envd_gen.filesystem import filesystem_pb as fs
from agentbox.e2b.envd_gen.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from agentbox.e2b.envd_gen.process import process_pb as pr
from agentbox.e2b.envd_gen.process.process_connect import Process, ProcessASGIApplication
from agentbox.e2b.sandboxes import E2BError, E2BSandbox, Launched, SandboxTable, SignedUrl
from agentbox.machines.base import FileStat
from agentbox.machines.errors import MachineError
from agentbox.tools.services import MachineServices
from agentbox.workspace.commands import MAX_TIMEOUT_SECONDS, Command
from agentbox.workspace.errors import WorkspaceError, translate
from agentbox.workspace.fileops import file_ops
from agentbox.workspace.files import STAGING_PREFIX, STAGING_SUFFIX, is_staging_name
from agentbox.workspace.watch import Event as WatchEvent
from agentbox.workspace.watch import Watcher

log = logging.getLogger(__name__)

#: Seconds a process stream may go without output before a keepalive event is sent, at most;
#: a client asks for its own interval in `Keepalive-Ping-Interval` (the SDK: 50), and at least
#: MIN_KEEPALIVE_SECONDS.
KEEPALIVE_SECONDS = 30.0
MIN_KEEPALIVE_SECONDS = 1.0
#: The shortest deadline put on a process (a call whose timeout has all but run out), and the
#: longest (the command manager's cap).
MIN_PROCESS_SECONDS = 0.001
MAX_PROCESS_SECONDS = MAX_TIMEOUT_SECONDS
#: Depth `ListDir` lists at most (1 = the directory's own entries).
MAX_LIST_DEPTH = 16
#: A process ended by signal N exits 128+N (the command manager's convention).
SIGNAL_EXIT_BASE = 128
#: E2B's signals and the ones they send.
SIGNALS = {pr.Signal.SIGKILL: signal.SIGKILL, pr.Signal.SIGTERM: signal.SIGTERM}

#: The header naming the sandbox of an envd request, and envd's file route.
SANDBOX_HEADER = b"e2b-sandbox-id"
FILES_PATH = "/files"

#: What envd's watchers leave out: the server's own staging files (uploads land through them).
STAGING_EXCLUDE = (f"{STAGING_PREFIX}*{STAGING_SUFFIX}",)
#: Files one multipart upload may carry (`files.write_files`); the whole form is within the upload limit.
MAX_UPLOAD_FILES = 100

#: WorkspaceError types as Connect codes and as envd's HTTP statuses.
ERROR_CODES: dict[str, tuple[Code, int]] = {
    "not_found": (Code.NOT_FOUND, 404),
    "machine_not_found": (Code.NOT_FOUND, 404),
    "permission_denied": (Code.PERMISSION_DENIED, 403),
    "machine_denied": (Code.PERMISSION_DENIED, 403),
    "read_only_filesystem": (Code.PERMISSION_DENIED, 403),
    "already_exists": (Code.ALREADY_EXISTS, 409),
    "invalid_path": (Code.INVALID_ARGUMENT, 400),
    "invalid_target": (Code.INVALID_ARGUMENT, 400),
    "decode_error": (Code.INVALID_ARGUMENT, 400),
    "bad_request": (Code.INVALID_ARGUMENT, 400),
    "no_space_left": (Code.RESOURCE_EXHAUSTED, 507),
    "capacity_exceeded": (Code.RESOURCE_EXHAUSTED, 429),
    "machine_unavailable": (Code.UNAVAILABLE, 503),
}
DEFAULT_ERROR = (Code.INTERNAL, 500)


def workspace_error(exc: Exception, op: str, path: str | None) -> WorkspaceError:
    return exc if isinstance(exc, WorkspaceError) else translate(exc, op, path)


@contextlib.contextmanager
def rpc_errors(op: str, path: str | None = None) -> Iterator[None]:
    """Machine and workspace failures as the Connect errors envd answers with."""
    try:
        yield
    except (WorkspaceError, MachineError, OSError) as exc:
        err = workspace_error(exc, op, path)
        raise ConnectError(ERROR_CODES.get(err.error_type, DEFAULT_ERROR)[0], err.message) from None
    except E2BError as exc:
        raise ConnectError(Code.UNAVAILABLE, exc.message) from None  # gone: as the proxy says it


def sandbox_id_of(ctx: RequestContext[Any, Any]) -> str:
    return ctx.request_headers.get("e2b-sandbox-id", "")


def process_deadline(ctx: RequestContext[Any, Any]) -> float | None:
    """The process's deadline as envd sets it: the call's timeout (`Connect-Timeout-Ms`; the SDK
    sends its command `timeout`), none without one. The stream ending sooner (the client went
    away) does not kill the process. A deadline past the command manager's cap is not put on
    the process (it is still bounded by the sandbox's lifetime)."""
    remaining = ctx.timeout_ms
    if remaining is None:
        return None
    seconds = max(remaining / 1000, MIN_PROCESS_SECONDS)
    return seconds if seconds <= MAX_PROCESS_SECONDS else None


def keepalive_of(ctx: RequestContext[Any, Any]) -> float:
    """The keepalive interval the client asked for, within our bounds."""
    try:
        asked = float(ctx.request_headers.get("keepalive-ping-interval", KEEPALIVE_SECONDS))
    except ValueError:
        asked = KEEPALIVE_SECONDS
    return min(max(asked, MIN_KEEPALIVE_SECONDS), KEEPALIVE_SECONDS)


def inside_path(machine_root: str, path: str) -> str:
    """E2B's path as the machine's: relative ones from the machine's root."""
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, "path is empty")
    return path if path.startswith("/") else posixpath.join(machine_root, path)


# ------------------------------------------------------------------ process.Process


class ProcessService(Process):
    """`process.Process` over the machine's command manager."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _opened(self, ctx: RequestContext[Any, Any]) -> tuple[E2BSandbox, MachineServices]:
        sandbox_id = sandbox_id_of(ctx)
        with rpc_errors("exec"):
            return self.table.get(sandbox_id), await self.table.services(sandbox_id)

    def _launched(self, sandbox: E2BSandbox, selector: pr.ProcessSelector | None) -> Launched:
        which = selector.selector if selector is not None else None
        pid = None
        if which is not None and which.field == "pid":
            pid = int(which.value)
        elif which is not None and which.field == "tag":
            pid = sandbox.tags.get(str(which.value))
        launched = sandbox.pids.get(pid) if pid is not None else None
        if launched is None:
            raise ConnectError(Code.NOT_FOUND, f"process {which.value if which else None!r} not found")
        return launched

    async def list(self, request: pr.ListRequest, ctx: RequestContext[Any, Any]) -> pr.ListResponse:
        sandbox, services = await self._opened(ctx)
        running = {c.id for c in services.commands.list() if not c.finished}
        return pr.ListResponse(
            processes=[
                pr.ProcessInfo(config=p.config, pid=pid, tag=p.tag)
                for pid, p in sandbox.pids.items()
                if p.command_id in running
            ]
        )

    async def start(
        self, request: pr.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.StartResponse]:
        sandbox, services = await self._opened(ctx)
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "PTY processes are not served yet")
        root = services.machine.root
        cwd = inside_path(root, config.cwd) if config.cwd else None
        stdin = True if request.stdin is None else request.stdin
        with rpc_errors("exec", cwd):
            cmd = await services.commands.start(
                shlex.join([config.cmd, *config.args]),
                cwd=cwd,
                env=dict(config.envs),
                stdin=stdin,
                timeout=process_deadline(ctx),
            )
        pid = sandbox.new_pid(Launched(cmd.id, config, request.tag))
        yield pr.StartResponse(event=started(pid))
        async for event in follow(services, cmd, 0, 0, keepalive_of(ctx)):
            yield pr.StartResponse(event=event)

    async def connect(
        self, request: pr.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.ConnectResponse]:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        with rpc_errors("exec"):
            cmd = services.commands.get(launched.command_id)
        pid = next(p for p, v in sandbox.pids.items() if v is launched)
        yield pr.ConnectResponse(event=started(pid))
        async for event in follow(services, cmd, cmd.stdout.total, cmd.stderr.total, keepalive_of(ctx)):
            yield pr.ConnectResponse(event=event)

    async def send_signal(
        self, request: pr.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendSignalResponse:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        sig = SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"signal {request.signal!r} is not one envd sends")
        with rpc_errors("kill"):
            cmd = services.commands.get(launched.command_id)
            if cmd.finished:
                raise ConnectError(Code.NOT_FOUND, "the process has ended")
            services.commands.kill(cmd.id, sig)
        return pr.SendSignalResponse()

    async def send_input(
        self, request: pr.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendInputResponse:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        given = request.input.input if request.input is not None else None
        if given is None or given.field != "stdin":
            raise ConnectError(Code.UNIMPLEMENTED, "only stdin input is served (no PTYs yet)")
        with rpc_errors("stdin"):
            await services.commands.write_stdin(launched.command_id, bytes(given.value))
        return pr.SendInputResponse()

    async def close_stdin(
        self, request: pr.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pr.CloseStdinResponse:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        with rpc_errors("stdin"):
            await services.commands.close_stdin(launched.command_id)
        return pr.CloseStdinResponse()

    def stream_input(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "StreamInput is not served yet")

    async def update(self, request: pr.UpdateRequest, ctx: RequestContext[Any, Any]) -> pr.UpdateResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "PTY processes are not served yet")


def started(pid: int) -> pr.ProcessEvent:
    return pr.ProcessEvent(event=oneof("start", pr.ProcessEvent.StartEvent(pid=pid)))


async def follow(
    services: MachineServices, cmd: Command, out: int, err: int, keepalive: float
) -> AsyncIterator[pr.ProcessEvent]:
    """The command's output from these offsets as data events, keepalives while it is quiet, then its end."""
    while True:
        with rpc_errors("exec"):
            cmd = await services.commands.wait_output(cmd.id, out, err, timeout=keepalive)
        stdout, stderr = cmd.stdout.read(out), cmd.stderr.read(err)
        out, err = stdout.next_offset, stderr.next_offset
        if stdout.data:
            yield data_event(oneof("stdout", stdout.data))
        if stderr.data:
            yield data_event(oneof("stderr", stderr.data))
        if stdout.data or stderr.data:
            continue
        if cmd.finished:
            yield pr.ProcessEvent(event=oneof("end", ended(cmd)))
            return
        yield pr.ProcessEvent(event=oneof("keepalive", pr.ProcessEvent.KeepAlive()))


def oneof(name: str, value: Any) -> Any:
    """A oneof member; its field name is checked by the message at run time, not by mypy."""
    return Oneof(name, value)


def data_event(output: Any) -> pr.ProcessEvent:
    return pr.ProcessEvent(event=oneof("data", pr.ProcessEvent.DataEvent(output=output)))


def ended(cmd: Command) -> pr.ProcessEvent.EndEvent:
    """The end as envd reports it: Go's `ProcessState.String()` in `status`."""
    code = -1 if cmd.exit_code is None else cmd.exit_code
    signalled = cmd.status in ("killed", "timed_out") and code > SIGNAL_EXIT_BASE
    status = f"signal: {signal_name(code - SIGNAL_EXIT_BASE)}" if signalled else f"exit status {code}"
    return pr.ProcessEvent.EndEvent(exit_code=code, exited=not signalled, status=status, error=cmd.error)


def signal_name(number: int) -> str:
    """The signal as Go's `ProcessState.String()` words it (`killed`, `terminated`), or its
    number for one the C library does not name."""
    described = signal.strsignal(number) if 0 < number < signal.NSIG else None
    return described.lower() if described else str(number)


# ------------------------------------------------------------------ filesystem.Filesystem


def entry_info(path: str, st: FileStat) -> fs.EntryInfo:
    kind = (
        fs.FileType.SYMLINK if st.is_symlink
        else fs.FileType.DIRECTORY if st.is_dir
        else fs.FileType.FILE
    )  # fmt: skip
    seconds = int(st.mtime)
    return fs.EntryInfo(
        name=posixpath.basename(path.rstrip("/")) or "/",
        type=kind,
        path=path,
        size=st.size,
        mode=stat_mod.S_IMODE(st.mode),
        permissions=stat_mod.filemode(st.mode),
        owner=owner_name(st.uid),
        group=owner_name(st.gid),
        modified_time=Timestamp(seconds=seconds, nanos=int((st.mtime - seconds) * 1e9)),
    )


def owner_name(uid: int) -> str:
    return "root" if uid == 0 else str(uid)


class FilesystemService(Filesystem):
    """`filesystem.Filesystem` over `file_ops(machine)`."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _ops(self, ctx: RequestContext[Any, Any]) -> tuple[str, Any]:
        with rpc_errors("open"):
            services = await self.table.services(sandbox_id_of(ctx))
        return services.machine.root, file_ops(services.machine)

    async def _entry(self, ops: Any, path: str, op: str) -> fs.EntryInfo:
        with rpc_errors(op, path):
            return entry_info(path, await ops.stat(path))

    async def stat(self, request: fs.StatRequest, ctx: RequestContext[Any, Any]) -> fs.StatResponse:
        root, ops = await self._ops(ctx)
        return fs.StatResponse(entry=await self._entry(ops, inside_path(root, request.path), "stat"))

    async def make_dir(self, request: fs.MakeDirRequest, ctx: RequestContext[Any, Any]) -> fs.MakeDirResponse:
        root, ops = await self._ops(ctx)
        path = inside_path(root, request.path)
        with rpc_errors("mkdir", path):
            if await ops.exists(path):
                raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
            await ops.makedirs(path)
        return fs.MakeDirResponse(entry=await self._entry(ops, path, "mkdir"))

    async def move(self, request: fs.MoveRequest, ctx: RequestContext[Any, Any]) -> fs.MoveResponse:
        root, ops = await self._ops(ctx)
        source, target = inside_path(root, request.source), inside_path(root, request.destination)
        with rpc_errors("move", source):
            await ops.rename(source, target)
        return fs.MoveResponse(entry=await self._entry(ops, target, "move"))

    async def list_dir(self, request: fs.ListDirRequest, ctx: RequestContext[Any, Any]) -> fs.ListDirResponse:
        root, ops = await self._ops(ctx)
        path = inside_path(root, request.path)
        depth = request.depth or 1
        if not 0 < depth <= MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth must be from 1 to {MAX_LIST_DEPTH}")
        with rpc_errors("list", path):
            if not (await ops.stat(path)).is_dir:
                raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
            nodes = await ops.walk(path, max_depth=depth)
        return fs.ListDirResponse(entries=[entry_info(posixpath.join(path, n.rel), n.stat) for n in nodes])

    async def remove(self, request: fs.RemoveRequest, ctx: RequestContext[Any, Any]) -> fs.RemoveResponse:
        root, ops = await self._ops(ctx)
        path = inside_path(root, request.path)
        with rpc_errors("remove", path):
            await ops.remove(path, recursive=True)
        return fs.RemoveResponse()

    # Watching: a watcher of the machine's watch hub, excluding only the server's own staging
    # files (envd has no excludes; a staged upload then reads as the file written). The
    # sync SDK polls one (CreateWatcher, GetWatcherEvents, RemoveWatcher); the async SDK
    # streams (WatchDir), and its watcher goes when the stream ends.

    async def _watcher(self, ctx: RequestContext[Any, Any], path: str, recursive: bool) -> Watcher:
        with rpc_errors("watch"):
            services = await self.table.services(sandbox_id_of(ctx))
        path = inside_path(services.machine.root, path)
        with rpc_errors("watch", path):
            if not (await file_ops(services.machine).stat(path)).is_dir:
                raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
            return await services.watches.start(path, recursive=recursive, exclude=STAGING_EXCLUDE)

    async def create_watcher(
        self, request: fs.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> fs.CreateWatcherResponse:
        watcher = await self._watcher(ctx, request.path, request.recursive)
        self.table.get(sandbox_id_of(ctx)).watch_cursors[watcher.id] = 0
        return fs.CreateWatcherResponse(watcher_id=watcher.id)

    async def get_watcher_events(
        self, request: fs.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> fs.GetWatcherEventsResponse:
        sandbox = self.table.get(sandbox_id_of(ctx))
        cursor = sandbox.watch_cursors.get(request.watcher_id)
        if cursor is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        with rpc_errors("watch"):
            services = await self.table.services(sandbox.id)
            result = await services.watches.get(request.watcher_id).poll(cursor)
        sandbox.watch_cursors[request.watcher_id] = result.cursor
        return fs.GetWatcherEventsResponse(events=[e for event in result.events for e in fs_events(event)])

    async def remove_watcher(
        self, request: fs.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> fs.RemoveWatcherResponse:
        sandbox = self.table.get(sandbox_id_of(ctx))
        if sandbox.watch_cursors.pop(request.watcher_id, None) is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        with rpc_errors("watch"):
            (await self.table.services(sandbox.id)).watches.delete(request.watcher_id)
        return fs.RemoveWatcherResponse()

    async def watch_dir(
        self, request: fs.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[fs.WatchDirResponse]:
        watcher = await self._watcher(ctx, request.path, request.recursive)
        keepalive = keepalive_of(ctx)
        try:
            yield fs.WatchDirResponse(event=oneof("start", fs.WatchDirResponse.StartEvent()))
            cursor = 0
            while not watcher.closed:
                with rpc_errors("watch", watcher.path):
                    result = await watcher.poll(cursor, timeout=keepalive)
                cursor = result.cursor
                for event in result.events:
                    for change in fs_events(event):
                        yield fs.WatchDirResponse(event=oneof("filesystem", change))
                if not result.events:
                    yield fs.WatchDirResponse(event=oneof("keepalive", fs.WatchDirResponse.KeepAlive()))
        finally:
            with contextlib.suppress(WorkspaceError):
                watcher.hub.delete(watcher.id)


#: The watch hub's event types as envd's.
EVENT_TYPES = {
    "create": fs.EventType.CREATE,
    "write": fs.EventType.WRITE,
    "remove": fs.EventType.REMOVE,
    "rename": fs.EventType.RENAME,
    "chmod": fs.EventType.CHMOD,
}


def fs_events(event: WatchEvent) -> list[fs.FilesystemEvent]:
    """One hub event as envd reports it (inotify's way): a rename is the old name renamed
    away, then the new name created; names are relative to the watched directory. A staged
    upload landing (renamed from the server's `.aiod-*.part`) is the file created and written,
    as envd's own write of a new file reads."""
    if (
        event.type == "rename"
        and event.old_path is not None
        and is_staging_name(posixpath.basename(event.old_path))
    ):
        return [
            fs.FilesystemEvent(name=event.relative_path, type=fs.EventType.CREATE),
            fs.FilesystemEvent(name=event.relative_path, type=fs.EventType.WRITE),
        ]
    if event.type == "rename" and event.old_path is not None:
        root = event.path[: len(event.path) - len(event.relative_path)].rstrip("/")
        old = posixpath.relpath(event.old_path, root) if root else event.old_path
        return [
            fs.FilesystemEvent(name=old, type=fs.EventType.RENAME),
            fs.FilesystemEvent(name=event.relative_path, type=fs.EventType.CREATE),
        ]
    return [fs.FilesystemEvent(name=event.relative_path, type=EVENT_TYPES[event.type])]


# ------------------------------------------------------------------ plain HTTP: /files, /health


def http_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def failure(exc: Exception, op: str, path: str | None) -> JSONResponse:
    if isinstance(exc, E2BError):  # the sandbox went away meanwhile: as the proxy says it
        return http_error(502 if exc.status == 404 else exc.status, exc.message)
    err = workspace_error(exc, op, path)
    return http_error(ERROR_CODES.get(err.error_type, DEFAULT_ERROR)[1], err.message)


async def gunzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    async for chunk in chunks:
        if out := inflate.decompress(chunk):
            yield out
    if tail := inflate.flush():
        yield tail


def written(path: str) -> dict[str, str]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


class FilesHttp:
    """envd's `/files` and `/health`."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _ops(self, request: Request) -> tuple[str, Any]:
        services = await self.table.services(request.headers.get("e2b-sandbox-id", ""))
        return services.machine.root, file_ops(services.machine)

    async def download(self, request: Request) -> Response:
        path = request.query_params.get("path", "")
        try:
            root, ops = await self._ops(request)
            path = inside_path(root, path)
            target = await ops.download(path)
        except ConnectError as exc:
            return http_error(400, exc.message)
        except (WorkspaceError, MachineError, OSError, E2BError) as exc:
            return failure(exc, "download", path)
        headers = {"Content-Length": str(target.size)}
        return StreamingResponse(
            target.chunks(0, None), media_type="application/octet-stream", headers=headers
        )

    async def upload(self, request: Request) -> Response:
        path = request.query_params.get("path")
        try:
            root, ops = await self._ops(request)
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                return JSONResponse(await self._multipart(request, root, ops, path))
            if not path:
                return http_error(400, "path is required for an octet-stream upload")
            target = inside_path(root, path)
            chunks: AsyncIterator[bytes] = request.stream()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                chunks = gunzipped(chunks)
            await self._store(ops, target, chunks)
            return JSONResponse([written(target)])
        except ConnectError as exc:
            return http_error(400, exc.message)
        except BodyTooLarge as exc:
            return http_error(413, str(exc))
        except HTTPException as exc:  # a malformed form, or one with too many parts
            return http_error(exc.status_code, exc.detail)
        except zlib.error as exc:
            return http_error(400, f"the body is not gzip: {exc}")
        except (WorkspaceError, MachineError, OSError, E2BError) as exc:
            return failure(exc, "upload", path)

    async def _multipart(
        self, request: Request, root: str, ops: Any, path: str | None
    ) -> list[dict[str, str]]:
        """Every file part, to `path` when there is one part, else to the part's own name (the
        SDK names each part by its path)."""
        out = []
        form = await read_form(
            request, MAX_UPLOAD_FORM_BYTES, max_files=MAX_UPLOAD_FILES, max_fields=0, operation="upload"
        )
        try:
            parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not parts:
                raise ConnectError(Code.INVALID_ARGUMENT, "the form has no file part")
            for part in parts:
                name = path if path and len(parts) == 1 else part.filename
                target = inside_path(root, name or "")
                await self._store(ops, target, spooled(part))
                out.append(written(target))
        finally:
            await form.close()
        return out

    @staticmethod
    async def _store(ops: Any, target: str, chunks: AsyncIterator[bytes]) -> None:
        """Write the file, making its parent directories first (as envd does)."""
        parent = posixpath.dirname(target)
        if parent and not await ops.exists(parent):
            await ops.makedirs(parent)
        await ops.upload(target, chunks)

    async def health(self, request: Request) -> Response:
        return Response(status_code=204)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(FILES_PATH, self.download, methods=["GET"]),
                Route(FILES_PATH, self.upload, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )


# ------------------------------------------------------------------ one envd for every sandbox


class CheckedDecoding:
    """A Connect codec whose undecodable message is the client's error (`invalid_argument`),
    not an `unknown` 500 as the library answers it."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec

    def name(self) -> str:
        return str(self._codec.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._codec.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._codec.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:
            name = self.name()
            raise ConnectError(Code.INVALID_ARGUMENT, f"malformed {name} message: {exc}") from None


CODECS = [CheckedDecoding(proto_binary_codec()), CheckedDecoding(proto_json_codec())]


class Envd:
    """The envd of every E2B sandbox: the sandbox by header, its token checked, then the service."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table
        self.process: ASGIApp = ProcessASGIApplication(ProcessService(table), codecs=CODECS)
        self.filesystem: ASGIApp = FilesystemASGIApplication(FilesystemService(table), codecs=CODECS)
        self.http: ASGIApp = FilesHttp(table).app()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == FILES_PATH and not has_header(scope, SANDBOX_HEADER):
            signed = self._signed(scope)
            if isinstance(signed, Response):
                await signed(scope, receive, send)
                return
            await self.http(signed, receive, send)
            return
        refused = self._refused(scope, path)
        if refused is not None:
            await refused(scope, receive, send)
            return
        if path.startswith("/process.Process/"):
            await self.process(scope, receive, send)
        elif path.startswith("/filesystem.Filesystem/"):
            await self.filesystem(scope, receive, send)
        else:
            await self.http(scope, receive, send)

    def _refused(self, scope: Scope, path: str) -> Response | None:
        """What E2B's proxy and envd answer before any service: a 502 "was not found" for a
        sandbox that is not (or no longer) there, which the SDK reads as "not running", a 502
        for a paused one (not running either, until `connect`), and a 401 without the
        sandbox's token (`/health` needs none)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rpc = path.startswith(("/process.Process/", "/filesystem.Filesystem/"))
        sandbox_id = headers.get("e2b-sandbox-id", "")
        try:
            sandbox = self.table.get(sandbox_id)
        except E2BError as exc:
            return rpc_error(Code.UNAVAILABLE, 502, exc.message) if rpc else http_error(502, exc.message)
        if sandbox.state == "paused":
            message = f"sandbox {sandbox_id!r} is paused; connect to it to resume it"
            return rpc_error(Code.UNAVAILABLE, 502, message) if rpc else http_error(502, message)
        if path != "/health" and not sandbox.token_ok(headers.get("x-access-token")):
            message = "missing or invalid X-Access-Token"
            return rpc_error(Code.UNAUTHENTICATED, 401, message) if rpc else http_error(401, message)
        return None

    def _signed(self, scope: Scope) -> Scope | Response:
        """A signed file URL's request, as if it carried its sandbox's header; else 401."""
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1")))
        expiration = query.get("signature_expiration")
        if "signature" not in query or (expiration is not None and not expiration.isdigit()):
            return http_error(401, "a file URL needs a signature (or the sandbox's headers)")
        url = SignedUrl(
            query.get("path", ""),
            "write" if scope["method"] == "POST" else "read",
            query.get("username", ""),
            query["signature"],
            int(expiration) if expiration is not None else None,
        )
        sandbox = self.table.signed(url)
        if sandbox is None or sandbox.state != "running":
            return http_error(401, "the signature is invalid or expired")
        return {**scope, "headers": [*scope["headers"], (SANDBOX_HEADER, sandbox.id.encode())]}


def has_header(scope: Scope, name: bytes) -> bool:
    return any(k.lower() == name for k, _ in scope["headers"])


def rpc_error(code: Code, status: int, message: str) -> JSONResponse:
    """A Connect unary error body; the SDK reads the same shape from a streaming call's status."""
    return JSONResponse({"code": code.value, "message": message}, status_code=status)
