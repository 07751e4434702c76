"""envd's `filesystem.Filesystem` over `file_ops(machine)` and the machine's watch hub.

Relative paths are taken from the machine's root (`/workspace`); file metadata (xattrs) is
not served yet.
"""

from __future__ import annotations

import contextlib
import posixpath
import stat as stat_mod
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from agentbox.e2b.envd_gen.filesystem import filesystem_pb as fs
from agentbox.e2b.envd_gen.filesystem.filesystem_connect import Filesystem
from agentbox.e2b.rpc import inside_path, keepalive_of, oneof, rpc_errors, sandbox_id_of
from agentbox.e2b.sandboxes import SandboxTable
from agentbox.machines.base import TRASH_DIR, FileStat
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import file_ops
from agentbox.workspace.files import STAGING_PREFIX, STAGING_SUFFIX, is_staging_name
from agentbox.workspace.watch import Event as WatchEvent
from agentbox.workspace.watch import Watcher

#: Depth `ListDir` lists at most (1 = the directory's own entries).
MAX_LIST_DEPTH = 16


#: What envd's watchers leave out: the server's own staging files (uploads land through them).
STAGING_EXCLUDE = (f"{STAGING_PREFIX}*{STAGING_SUFFIX}",)


def entry_info(path: str, st: FileStat) -> fs.EntryInfo:
    """A file as envd describes it: a link is of type SYMLINK (as envd's Lstat says it), and
    `permissions` is Go's `FileMode.String()` of the entry (`-rw-r--r--`, `drwx...`, `L...`)."""
    kind = (
        fs.FileType.SYMLINK if st.is_symlink
        else fs.FileType.DIRECTORY if st.is_dir
        else fs.FileType.FILE
    )  # fmt: skip
    type_letter = "L" if st.is_symlink else "d" if st.is_dir else "-" if st.is_file else "?"
    seconds = int(st.mtime)
    return fs.EntryInfo(
        name=posixpath.basename(path.rstrip("/")) or "/",
        type=kind,
        path=path,
        size=st.size,
        mode=stat_mod.S_IMODE(st.mode),
        permissions=type_letter + stat_mod.filemode(stat_mod.S_IMODE(st.mode))[1:],
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
            trash = posixpath.join(root, TRASH_DIR)  # the edit tool's trash: not the sandbox's own files
            nodes = await ops.walk(path, max_depth=depth, descend=lambda n: n.inside != trash)
        kept = [n for n in nodes if n.inside != trash]
        return fs.ListDirResponse(entries=[entry_info(posixpath.join(path, n.rel), n.stat) for n in kept])

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
