"""File operations on a machine reached only through the `Machine` protocol (ssh, and any kind
without the `HostFiles` capability).

The same operations, limits, results and errors as `files.py`, which serves host-file machines
by descriptor; the validation, sorting, matching and result building are `files.py`'s own
functions, so the two cannot drift. What differs, and why:

- Paths are made absolute lexically (`..` folded against the machine's root) and resolved by
  the machine itself; the machine's own rights apply to them (an ssh login's), as they do to
  its commands.
- Every write is atomic through `Machine.write` / `write_stream` (a temporary file renamed
  over the target), so the target's inode changes even without `?user=`; an append reads the
  file (within `files.MAX_READ_BYTES`) and writes the whole new content.
- A `user` owner is applied with `Machine.chown` after the rename, not before.
- A download reads `files.DOWNLOAD_CHUNK_BYTES` at a time by offset. "The same file" is the
  same size and modification time (SFTP reports no inode).
- Walks (list, search) read one directory at a time with `Machine.list` and never enter a
  symlinked directory.
"""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass

from agentbox.machines.base import TRASH_DIR, FileStat, Machine, inside_path
from agentbox.timestamps import epoch_timestamp
from agentbox.workspace import files
from agentbox.workspace.errors import WorkspaceError, failed, operation


@dataclass(frozen=True)
class RemoteNode:
    """One entry met by `walk`: its path relative to the top, and what `Machine.list` said of it."""

    rel: str
    name: str
    inside: str
    stat: FileStat


@dataclass(frozen=True)
class RemoteDownload:
    """A regular file `download` checked; `iter_download` reads it by offset."""

    machine: Machine
    path: str
    size: int
    mtime: float


def shown_path(machine: Machine, path: str) -> str:
    return inside_path(machine.root, path)


async def stat_or_none(machine: Machine, path: str) -> FileStat | None:
    return await machine.stat(shown_path(machine, path))


async def require_stat(machine: Machine, path: str) -> FileStat:
    st = await stat_or_none(machine, path)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return st


async def require_dir(machine: Machine, path: str) -> None:
    if not (await require_stat(machine, path)).is_dir:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)


async def walk(
    machine: Machine, top: str, *, max_depth: int | None, descend: Callable[[RemoteNode], bool]
) -> AsyncIterator[RemoteNode]:
    """Entries below `top`, depth first in name order, `max_depth` levels deep (None: all).

    A directory is entered when `descend` accepts it and it is not a symlink.
    """
    stack: list[tuple[str, str, int]] = [(top, "", 1)]
    while stack:
        inside, rel, depth = stack.pop()
        try:
            children = await machine.list(inside)
        except (FileNotFoundError, NotADirectoryError):  # gone since its parent was listed
            continue
        below: list[tuple[str, str, int]] = []
        for child in children:
            node = RemoteNode(posixpath.join(rel, child.name), child.name, child.path, child.stat)
            yield node
            deeper = max_depth is None or depth < max_depth
            if child.stat.is_dir and not child.stat.is_symlink and deeper and descend(node):
                below.append((child.path, node.rel, depth + 1))
        stack.extend(reversed(below))


# ---------------------------------------------------------------- read, write, mkdir


async def read_text(
    machine: Machine, path: str, start_line: int | None = None, end_line: int | None = None
) -> files.ReadResult:
    with operation("read", path):
        start = files.check_lines(start_line, end_line, path)
        shown = shown_path(machine, path)
        st = await require_stat(machine, path)
        files.require_regular(st, "read", path)
        if st.size > files.MAX_READ_BYTES:
            raise files.read_too_large(path)
        data = await _read_whole(machine, shown, path)
        return files.text_lines(data, shown, start, end_line)


async def _read_whole(machine: Machine, inside: str, path: str) -> bytes:
    try:
        return await machine.read(inside, limit=files.MAX_READ_BYTES)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise files.read_too_large(path) from exc
        raise


async def write_file(
    machine: Machine, path: str, data: bytes, *, append: bool = False, user: str | None = None
) -> files.WriteResult:
    with operation("write", path):
        shown = shown_path(machine, path)
        ids = None if user is None else await machine.user_ids(user)
        existing = await stat_or_none(machine, shown)
        if existing is not None:
            files.require_regular(existing, "write", path)
        whole = data
        if append and existing is not None:
            whole = await _read_whole(machine, shown, path) + data
            if len(whole) > files.MAX_READ_BYTES:
                raise files.read_too_large(path)
        await machine.write(shown, whole)
        if ids is not None and user is not None:
            await machine.chown(shown, user)
        return files.WriteResult(shown, len(data))


async def mkdir(
    machine: Machine, path: str, *, parents: bool = False, user: str | None = None
) -> files.MkdirResult:
    with operation("mkdir", path):
        shown = shown_path(machine, path)
        if user is not None:
            await machine.user_ids(user)
        existing = await stat_or_none(machine, shown)
        if existing is not None:
            if parents and existing.is_dir:
                return files.MkdirResult(shown, created=False)
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        await machine.mkdir(shown, parents=parents)
        if user is not None:
            await machine.chown(shown, user)
        return files.MkdirResult(shown, created=True)


# ---------------------------------------------------------------- list, search, glob


async def list_dir(
    machine: Machine,
    path: str,
    *,
    recursive: bool = False,
    max_depth: int | None = None,
    show_hidden: bool = True,
    file_types: list[str] | None = None,
    sort_by: files.ListSort = "name",
    sort_desc: bool = False,
    include_size: bool = True,
    include_permissions: bool = False,
) -> files.ListResult:
    with operation("list", path):
        files.check_listing(sort_by, max_depth, path)
        await require_dir(machine, path)
        base = shown_path(machine, path)
        wanted = files.type_filter(file_types)

        trash = posixpath.join(machine.root, TRASH_DIR)

        def visible(node: RemoteNode) -> bool:
            return (show_hidden or not node.name.startswith(".")) and node.inside != trash

        entries: list[files.Entry] = []
        truncated = False
        async for node in walk(machine, base, max_depth=max_depth if recursive else 1, descend=visible):
            if not visible(node):
                continue
            item = files.entry_of(
                node.name,
                posixpath.join(base, node.rel),
                node.stat,
                size=include_size,
                permissions=include_permissions,
            )
            if not wanted(item):
                continue
            if len(entries) == files.MAX_LIST_ENTRIES:
                truncated = True
                break
            entries.append(item)
        return files.listed(base, entries, sort_by, sort_desc, truncated)


async def _glob(
    machine: Machine,
    op: str,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None,
    include_hidden: bool,
    files_only: bool,
    max_results: int | None,
) -> tuple[str, list[RemoteNode], bool]:
    plan = files.glob_plan(op, path, pattern, exclude, include_hidden, max_results)
    await require_dir(machine, path)
    base = shown_path(machine, path)
    hits: list[RemoteNode] = []
    truncated = False
    scanned = 0
    async for node in walk(
        machine, base, max_depth=plan.depth, descend=lambda n: plan.descends(n.rel, n.name)
    ):
        scanned += 1
        if scanned > files.MAX_SEARCH_SCANNED:
            truncated = True
            break
        if not plan.matches(node.rel, node.name) or (files_only and node.stat.is_dir):
            continue
        if len(hits) == plan.limit:
            truncated = True
            break
        hits.append(RemoteNode(node.rel, node.name, posixpath.join(base, node.rel), node.stat))
    return base, hits, truncated


async def search(
    machine: Machine,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None = None,
    include_hidden: bool = False,
    files_only: bool = True,
    max_results: int | None = None,
) -> files.SearchResult:
    with operation("search", path):
        base, hits, truncated = await _glob(
            machine, "search", path, pattern, exclude=exclude, include_hidden=include_hidden,
            files_only=files_only, max_results=max_results,
        )  # fmt: skip
        return files.SearchResult(base, pattern, sorted(h.inside for h in hits), truncated)


async def glob_files(
    machine: Machine,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None = None,
    include_hidden: bool = False,
    files_only: bool = True,
    include_metadata: bool = True,
    max_results: int | None = None,
    sort_by: files.GlobSort = "path",
    sort_desc: bool = False,
) -> files.GlobResult:
    with operation("search", path):
        if sort_by not in files.GLOB_SORT_KEYS:
            raise files.bad_request("search", f"sort_by must be one of {sorted(files.GLOB_SORT_KEYS)}", path)
        base, hits, truncated = await _glob(
            machine, "search", path, pattern, exclude=exclude, include_hidden=include_hidden,
            files_only=files_only, max_results=max_results,
        )  # fmt: skip
        found = [
            files.GlobEntry(
                path=hit.inside,
                name=hit.name,
                is_directory=hit.stat.is_dir,
                size=hit.stat.size if include_metadata else None,
                modified_time=epoch_timestamp(hit.stat.mtime) if include_metadata else None,
            )
            for hit in hits
        ]
        found.sort(key=files.GLOB_SORT_KEYS[sort_by], reverse=sort_desc)
        return files.GlobResult(base, pattern, found, len(found), truncated)


# ---------------------------------------------------------------- upload, download


async def upload(
    machine: Machine, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
) -> files.UploadResult:
    """Stream a body into the file atomically; past `files.MAX_UPLOAD_BYTES` the target is untouched."""
    with operation("upload", path):
        shown = shown_path(machine, path)
        if user is not None:
            await machine.user_ids(user)
        existing = await stat_or_none(machine, shown)
        if existing is not None and existing.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        try:
            size = await machine.write_stream(shown, chunks, limit=files.MAX_UPLOAD_BYTES)
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise files.limit_exceeded(
                    "upload", path, f"body is larger than the limit of {files.MAX_UPLOAD_BYTES} bytes"
                ) from exc
            raise
        if user is not None:
            await machine.chown(shown, user)
        return files.UploadResult(shown, size)


async def download(machine: Machine, path: str) -> RemoteDownload:
    with operation("download", path):
        st = await require_stat(machine, path)
        files.require_regular(st, "download", path)
        return RemoteDownload(machine, shown_path(machine, path), st.size, st.mtime)


async def unchanged(target: RemoteDownload) -> bool:
    """The file still has the size and modification time `download` saw."""
    try:
        now = await target.machine.stat(target.path)
    except OSError:
        return False
    return now is not None and (now.size, now.mtime) == (target.size, target.mtime)


async def iter_download(
    target: RemoteDownload, start: int = 0, end: int | None = None
) -> AsyncIterator[bytes]:
    """Bytes `start..end` (inclusive) of the file, read by offset. A file that is no longer the
    one `download` checked is an error before the first byte, as a replaced inode is for host files."""
    with operation("download", target.path):
        if not await unchanged(target):
            raise WorkspaceError(
                "io_error", failed("download", "the file was replaced during the download"), "download",
                target.path, exception_type="FileChanged", retryable=True,
            )  # fmt: skip
    stop = target.size if end is None else end + 1
    at = start
    while at < stop:
        with operation("download", target.path):
            want = min(files.DOWNLOAD_CHUNK_BYTES, stop - at)
            chunk = await target.machine.read(target.path, offset=at, length=want)
        if not chunk:
            return
        at += len(chunk)
        yield chunk


# ---------------------------------------------------------------- remove, stat


async def remove(machine: Machine, path: str, *, recursive: bool = False) -> str:
    with operation("remove", path):
        shown = shown_path(machine, path)
        if shown in (machine.root, "/"):
            raise files.root_refused(path, shown)
        if await machine.stat(shown) is None and not await _is_dangling_link(machine, shown):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        await machine.remove(shown, recursive=recursive)
        return shown


async def _is_dangling_link(machine: Machine, inside: str) -> bool:
    parent, name = posixpath.split(inside)
    try:
        return any(e.name == name for e in await machine.list(parent))
    except OSError:
        return False


async def stat(machine: Machine, path: str) -> FileStat:
    with operation("stat", path):
        return await require_stat(machine, path)
