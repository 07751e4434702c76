"""File operations on a machine whose files are host files (seed 002 `/v2/fs/*`, AIO `/v1/file/*`).

read, write, mkdir, list, search / glob, upload, download, remove and stat. Every inside path
goes through the machine's `view` (`machines.hostview.HostView`), which reaches each file
relative to a descriptor of its mount, one component at a time and never through a link
followed on the host; the work then happens on descriptors with no process spawn. No host
path name is ever built or opened here.

These are plain blocking functions: async callers run them with `asyncio.to_thread` (FastAPI
does so for `def` routes). `upload` is async because it consumes a request body as it arrives.

Every failure is a `WorkspaceError` (the tree is in `errors.py`) naming the operation and the
caller's path as given; `RangeNotSatisfiable` is its one subclass, for HTTP 416. Results carry
the caller's path made absolute, with a final symlink named rather than followed.

Staging (seed 002): `upload`, and `write_file` with a `user`, write `.aiod-upload-<uuid4>.part`
or `.aiod-write-<uuid4>.part` beside the target and rename it over the target, so nobody sees a
partial file and a watcher sees one rename. A plain `write_file` writes in place and keeps the
inode, so open handles (`tail -f`, editors) keep seeing the file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import os
import posixpath
import re
import stat as stat_mod
import uuid
from collections.abc import AsyncIterable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import BinaryIO, Literal

from wcmatch import fnmatch as wc_fnmatch
from wcmatch import glob as wc_glob

from agentbox.machines.base import TRASH_DIR, FileStat
from agentbox.machines.errors import MachineError
from agentbox.machines.hostfs import HostFiles, to_stat
from agentbox.machines.hostview import Node
from agentbox.timestamps import epoch_timestamp
from agentbox.workspace.errors import WorkspaceError, bad_request, failed, operation
from agentbox.workspace.patterns import check_patterns

#: Largest file `read_text` returns (it decodes the whole file in memory); use download beyond.
MAX_READ_BYTES = 64 * 1024 * 1024
#: Largest upload body; the staged part is removed and the target untouched past it.
MAX_UPLOAD_BYTES = 1024 * 1024 * 1024
#: Entries one `list_dir` returns; past it the result says `truncated`.
MAX_LIST_ENTRIES = 10_000
#: Matches `search` / `glob_files` return when the caller names no `max_results` (AIO's default).
DEFAULT_SEARCH_RESULTS = 5_000
#: The most `max_results` a caller may ask for.
MAX_SEARCH_RESULTS = 100_000
#: Entries one search walks before it stops and says `truncated` (a `**` over a huge tree).
MAX_SEARCH_SCANNED = 500_000
#: Tuning, not a limit: received body bytes are written to disk in batches of this size.
WRITE_BATCH_BYTES = 1024 * 1024
#: Tuning, not a limit: the size of the chunks `iter_download` yields.
DOWNLOAD_CHUNK_BYTES = 64 * 1024

Encoding = Literal["utf-8", "base64", "raw"]
ListSort = Literal["name", "size", "modified", "type"]
GlobSort = Literal["path", "name", "size", "modified"]
Owner = tuple[int, int]

STAGING_PREFIX = ".aiod-"
STAGING_SUFFIX = ".part"


#: What these operations work on: a machine with the `HostFiles` capability (local, sandbox).
HostMachine = HostFiles

#: Flags of every file the server creates beside a target (a staged part).
_PART_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class ReadResult:
    content: str
    path: str
    line_count: int
    """Lines in the whole file, so a caller can page through it."""
    start_line: int
    end_line: int
    """Exclusive, after clamping to `line_count`."""
    size: int


@dataclass(frozen=True)
class WriteResult:
    path: str
    bytes_written: int


@dataclass(frozen=True)
class MkdirResult:
    path: str
    created: bool


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    is_directory: bool
    size: int | None
    modified_time: str | None
    """RFC 3339 in UTC (`agentbox.timestamps`)."""
    permissions: str | None
    """`ls -l` style without the type letter: `rw-r--r--`."""
    extension: str | None
    """With its dot (`.py`), as the `file_types` filter takes it; None for directories."""
    is_symlink: bool = False


@dataclass(frozen=True)
class ListResult:
    path: str
    files: list[Entry]
    total_count: int
    directory_count: int
    file_count: int
    truncated: bool = False


@dataclass(frozen=True)
class SearchResult:
    path: str
    pattern: str
    files: list[str]
    truncated: bool = False


@dataclass(frozen=True)
class GlobEntry:
    path: str
    name: str
    is_directory: bool
    size: int | None
    modified_time: str | None


@dataclass(frozen=True)
class GlobResult:
    path: str
    pattern: str
    files: list[GlobEntry]
    total_count: int
    truncated: bool = False


@dataclass(frozen=True)
class UploadResult:
    file_path: str
    file_size: int


@dataclass(frozen=True)
class DownloadTarget:
    machine: HostMachine
    path: str
    """The resolved inside path (what `iter_download` opens again, by descriptor)."""
    size: int
    mtime: float
    inode: int


@dataclass
class RangeNotSatisfiable(WorkspaceError):
    """A Range header none of whose bytes exist: HTTP 416 with `Content-Range: bytes */size`."""

    size: int = 0


# ---------------------------------------------------------------- shared pieces


def shown_path(machine: HostMachine, path: str) -> str:
    """The caller's path as an absolute inside path; a final symlink is named, not followed."""
    return machine.view.resolve(path, follow=False)


def new_owner(machine: HostMachine, user: str | None) -> Owner | None:
    """Who gets what the server creates: the `?user=` owner, else the machine's default.

    The default applies only when running as root (nobody else can give files away, and
    then they are the server user's already). An explicit `user` is always applied, so a
    server that cannot set it fails with EPERM instead of quietly ignoring it.
    """
    if user is not None:
        return machine.owner_of(user)
    return machine.default_owner() if os.geteuid() == 0 else None


def limit_exceeded(operation_name: str, path: str | None, detail: str) -> WorkspaceError:
    """A request over one of the named limits (EFBIG; the HTTP layer may send 413)."""
    return WorkspaceError(
        "bad_request", failed(operation_name, detail), operation_name, path,
        errno.EFBIG, "EFBIG", "LimitExceeded",
    )  # fmt: skip


def wrong_kind(operation_name: str, path: str, detail: str) -> WorkspaceError:
    return WorkspaceError(
        "invalid_target", failed(operation_name, detail), operation_name, path, exception_type="InvalidTarget"
    )


def is_staging_name(name: str) -> bool:
    """True for the server's own `.aiod-*.part` files (hidden from trees and worth excluding)."""
    return name.startswith(STAGING_PREFIX) and name.endswith(STAGING_SUFFIX)


def lstat_or_none(machine: HostMachine, path: str, *, follow: bool = False) -> os.stat_result | None:
    """The file at `path` (with `follow`, what a final link leads to), or None when missing."""
    try:
        return machine.view.stat(path) if follow else machine.view.lstat(path)
    except FileNotFoundError:
        return None


def require_dir(machine: HostMachine, path: str) -> None:
    """Raise ENOTDIR (invalid_target) unless `path` leads to a directory; ENOENT if it is missing."""
    if not stat_mod.S_ISDIR(machine.view.stat(path).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def unlink_quietly(dirfd: int, name: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dirfd)


async def off_loop(fd: int, work: Callable[[int], None]) -> None:
    """Run blocking `work` in a thread on a duplicate of `fd` that the thread closes itself.

    A caller cancelled meanwhile may close and unlink at once: the thread never touches an
    fd number that could have been reused, only its own duplicate of the same open file.
    """
    dup = os.dup(fd)

    def run() -> None:
        try:
            work(dup)
        finally:
            os.close(dup)

    await asyncio.to_thread(run)


async def receive(
    chunks: AsyncIterable[bytes], fd: int, *, limit: int, operation_name: str, path: str
) -> int:
    """Write a request body to `fd` as it arrives; refuse it once it passes `limit` bytes."""
    total = 0
    pending = bytearray()
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise limit_exceeded(operation_name, path, f"body is larger than the limit of {limit} bytes")
        pending += chunk
        if len(pending) >= WRITE_BATCH_BYTES:
            await off_loop(fd, partial(write_all, data=bytes(pending)))
            pending.clear()
    if pending:
        await off_loop(fd, partial(write_all, data=bytes(pending)))
    return total


def part_name(kind: str) -> str:
    return f"{STAGING_PREFIX}{kind}-{uuid.uuid4()}{STAGING_SUFFIX}"


@contextmanager
def staged(
    machine: HostMachine, path: str, kind: str, *, owner: Owner | None, like: os.stat_result | None
) -> Iterator[int]:
    """Yield an fd on `.aiod-<kind>-<uuid4>.part` beside `path`; rename it over `path` on success.

    `path` is resolved once (a final link followed, inside the machine); the part is created
    and renamed in that same parent directory, by descriptor. The part gets `owner` and, when
    replacing a file, that file's rwx bits. On any failure, cancellation included, the part is
    removed and the target is left as it was. Callers fsync before leaving the block.
    """
    with machine.view.at(path, write=True) as at:
        if not at.name:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        part = part_name(kind)
        fd = os.open(part, _PART_FLAGS, 0o644, dir_fd=at.fd)
        try:
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
                if like is not None:  # after chown, which may reset bits; never setuid/setgid/sticky
                    os.fchmod(fd, stat_mod.S_IMODE(like.st_mode) & 0o777)
                yield fd
            finally:
                os.close(fd)
            os.rename(part, at.name, src_dir_fd=at.fd, dst_dir_fd=at.fd)
        except BaseException:
            unlink_quietly(at.fd, part)
            raise


def _existing_file(machine: HostMachine, path: str) -> os.stat_result | None:
    """What the target leads to, if anything; a directory there is EISDIR (invalid_target)."""
    existing = lstat_or_none(machine, path, follow=True)
    if existing is not None and stat_mod.S_ISDIR(existing.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    return existing


def _require_regular(fd: int, operation_name: str, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if stat_mod.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat_mod.S_ISREG(st.st_mode):
        raise wrong_kind(operation_name, path, f"{path} is not a regular file")
    return st


# ---------------------------------------------------------------- read


def split_lines(text: str) -> list[str]:
    """Lines with their `\\n` kept; only `\\n` ends a line (not `\\f` or `\\x1c`, unlike splitlines)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def read_text(
    machine: HostMachine, path: str, start_line: int | None = None, end_line: int | None = None
) -> ReadResult:
    """UTF-8 text of a file, or lines [start_line, end_line) of it (0-based, end exclusive)."""
    return open_text(machine, path, start_line, end_line).read()


@dataclass
class TextFile:
    """A file opened for `read_text`: a regular file within `MAX_READ_BYTES` when opened.

    Opened, checked and named from one resolution of its path (`HostView.open_named`), so
    that a caller can choose by its size where to read it (`fileops.HostOps.read_text`).
    """

    file: BinaryIO
    """Closed by `read`, or when dropped unread (a read in a thread cancelled before it began)."""
    size: int
    shown: str
    path: str
    start: int
    end_line: int | None

    def read(self) -> ReadResult:
        """Its lines, decoded; the file is closed, whatever happens."""
        with operation("read", self.path), self.file as f:
            data = read_up_to(f, self.size, MAX_READ_BYTES)
            if len(data) > MAX_READ_BYTES:  # it grew since it was opened
                raise read_too_large(self.path)
            return text_lines(data, self.shown, self.start, self.end_line)


def read_up_to(file: BinaryIO, expected: int, limit: int) -> bytes:
    """All of `file` up to `limit` + 1 bytes (one more tells it is over), asking first for the
    `expected` size it had: a buffered `read(n)` allocates n bytes before it reads, and a
    64 MiB allocation (and its release) per small read cost more than the read."""
    data = file.read(min(expected, limit) + 1)
    if len(data) > expected:  # it grew since its size was taken
        data += file.read(limit + 1 - len(data))
    return data


def open_text(machine: HostMachine, path: str, start_line: int | None, end_line: int | None) -> TextFile:
    """The file `read_text` reads, open; its lines are read by `TextFile.read`."""
    with operation("read", path):
        start = check_lines(start_line, end_line, path)
        fd, shown = machine.view.open_named(path, os.O_RDONLY)
        file = os.fdopen(fd, "rb")
        try:
            size = _require_regular(fd, "read", path).st_size
            if size > MAX_READ_BYTES:
                raise read_too_large(path)
        except BaseException:
            file.close()
            raise
        return TextFile(file, size, shown, path, start, end_line)


def check_lines(start_line: int | None, end_line: int | None, path: str) -> int:
    """The first line a read asks for, after refusing a range that can name no lines."""
    start = 0 if start_line is None else start_line
    if start < 0 or (end_line is not None and end_line < 0):
        raise bad_request("read", "start_line and end_line must not be negative", path)
    if end_line is not None and end_line < start:
        raise bad_request("read", f"end_line {end_line} is before start_line {start}", path)
    return start


def read_too_large(path: str) -> WorkspaceError:
    return limit_exceeded(
        "read", path, f"file is larger than the {MAX_READ_BYTES} bytes a read returns; download it"
    )


def text_lines(data: bytes, shown: str, start: int, end_line: int | None) -> ReadResult:
    """Lines [start, end_line) of a file's bytes, decoded as UTF-8 (a `decode_error` otherwise)."""
    lines = split_lines(data.decode("utf-8"))
    stop = len(lines) if end_line is None else min(end_line, len(lines))
    first = min(start, stop)
    return ReadResult("".join(lines[first:stop]), shown, len(lines), first, stop, len(data))


# ---------------------------------------------------------------- write


def decode_content(
    content: str,
    encoding: Encoding = "utf-8",
    *,
    leading_newline: bool = False,
    trailing_newline: bool = False,
    path: str | None = None,
) -> bytes:
    """The bytes a v1/v2 write body stands for.

    `utf-8` and `raw` both write the text as UTF-8 exactly as given (`raw` is kept for AIO
    clients; nothing is normalised either way); `base64` decodes strictly. The newline flags
    are AIO v1's `leading_newline` / `trailing_newline`.
    """
    try:
        if encoding == "base64":
            data = base64.b64decode(content, validate=True)
        elif encoding in ("utf-8", "raw"):
            data = content.encode("utf-8")
        else:
            raise bad_request("write", f"unknown encoding {encoding!r}", path)
    except (binascii.Error, UnicodeError, ValueError) as exc:  # ValueError: non-ASCII base64
        raise WorkspaceError(
            "decode_error", failed("write", f"content is not valid {encoding}: {exc}"), "write", path,
            exception_type=type(exc).__name__,
        ) from exc  # fmt: skip
    return (b"\n" if leading_newline else b"") + data + (b"\n" if trailing_newline else b"")


def write_file(
    machine: HostMachine, path: str, data: bytes, *, append: bool = False, user: str | None = None
) -> WriteResult:
    """Write `data` to a file whose parent exists.

    Without `user` the file is written in place (the inode is kept) and created, for the
    machine's default owner, if missing. With `user` the new content is staged beside the
    target, given to that user and renamed over it (seed 002), so the inode changes.
    """
    with operation("write", path):
        if user is None:
            shown = write_in_place(machine, path, data, append=append, owner=new_owner(machine, None))
            return WriteResult(shown, len(data))
        owner = machine.owner_of(user)
        existing = _existing_file(machine, path)
        with staged(machine, path, "write", owner=owner, like=existing) as fd:
            if append and existing is not None:
                _copy_into(machine, path, fd)
            write_all(fd, data)
            os.fsync(fd)
        return WriteResult(shown_path(machine, path), len(data))


def write_in_place(
    machine: HostMachine, path: str, data: bytes, *, append: bool = False, owner: Owner | None = None
) -> str:
    """Write through the existing inode (links, watchers and owners stay); create it for
    `owner` if absent. A file is cut only once it is known to be a regular file.

    A replacement writes over the old bytes from the start and then cuts what is left past
    the new end, rather than truncating to zero first: on ext4, a file truncated to zero and
    written again is flushed to disk at its close (`auto_da_alloc`), which cost more than the
    rest of a small write. A reader meanwhile sees a mix of new and old bytes where it saw
    an empty or short file before; neither order is atomic (`user=` writes are, by rename).

    Returns the path as `shown_path` names it, from the resolution that opened the file."""
    flags = os.O_WRONLY | (os.O_APPEND if append else 0)
    try:
        fd, shown = machine.view.open_named(path, flags)
        created = False
    except FileNotFoundError:  # a missing parent raises again below: not_found
        fd, shown = machine.view.open_named(path, flags | os.O_CREAT | os.O_EXCL)
        created = True
    try:
        size = _require_regular(fd, "write", path).st_size
        if created and owner is not None:
            os.fchown(fd, *owner)
        write_all(fd, data)
        if not append and size > len(data):
            os.ftruncate(fd, len(data))  # only once it is known to be a regular file
    finally:
        os.close(fd)
    return shown


def _copy_into(machine: HostMachine, path: str, fd: int) -> None:
    src = machine.view.open(path, os.O_RDONLY)
    try:
        _require_regular(src, "write", path)
        while chunk := os.read(src, WRITE_BATCH_BYTES):
            write_all(fd, chunk)
    finally:
        os.close(src)


def mkdir(machine: HostMachine, path: str, *, parents: bool = False, user: str | None = None) -> MkdirResult:
    """Create a directory (and with `parents` its missing ancestors) for `user` or the default owner.

    An existing directory is fine with `parents` (like `mkdir -p`); anything else already
    there is `already_exists`.
    """
    with operation("mkdir", path):
        view = machine.view
        owner = new_owner(machine, user)
        target = view.absolute(path)
        existing = lstat_or_none(machine, target, follow=True)
        if existing is not None:
            if parents and stat_mod.S_ISDIR(existing.st_mode):
                return MkdirResult(shown_path(machine, path), created=False)
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        if parents:
            view.makedirs(target, 0o755, owner=owner)
        else:
            view.mkdir(target, 0o755, owner=owner)
        return MkdirResult(shown_path(machine, path), created=True)


# ---------------------------------------------------------------- walk, list


def _target_stat(machine: HostMachine, inside: str) -> os.stat_result | None:
    """What a symlink leads to *in the machine's view*, or None when it dangles or escapes."""
    try:
        return machine.view.stat(inside)
    except (OSError, MachineError):
        return None


def _node_stat(machine: HostMachine, node: Node) -> tuple[os.stat_result, bool]:
    if node.is_symlink:
        return _target_stat(machine, node.inside) or node.st, True
    return node.st, False


def _to_entry(machine: HostMachine, inside: str, node: Node, *, size: bool, permissions: bool) -> Entry:
    st, link = _node_stat(machine, node)
    return entry_of(node.name, inside, to_stat(inside, st, link), size=size, permissions=permissions)


def entry_of(name: str, inside: str, st: FileStat, *, size: bool, permissions: bool) -> Entry:
    """A listing entry for `st` (for a symlink: what it leads to, with `is_symlink` set)."""
    return Entry(
        name=name,
        path=inside,
        is_directory=st.is_dir,
        size=st.size if size else None,
        modified_time=epoch_timestamp(st.mtime),
        permissions=stat_mod.filemode(st.mode)[1:] if permissions else None,
        extension=None if st.is_dir else (posixpath.splitext(name)[1] or None),
        is_symlink=st.is_symlink,
    )


def check_listing(sort_by: str, max_depth: int | None, path: str) -> None:
    if sort_by not in LIST_SORT_KEYS:
        raise bad_request("list", f"sort_by must be one of {sorted(LIST_SORT_KEYS)}", path)
    if max_depth is not None and max_depth < 1:
        raise bad_request("list", "max_depth must be at least 1", path)


def type_filter(file_types: list[str] | None) -> Callable[[Entry], bool]:
    """Whether an entry passes `file_types` (`[".py"]`, dot optional, any case: files only)."""
    if file_types is None:
        return lambda entry: True
    suffixes = {"." + t.lstrip(".").lower() for t in file_types}
    return lambda e: not e.is_directory and (e.extension or "").lower() in suffixes


def listed(
    base: str, entries: list[Entry], sort_by: ListSort, sort_desc: bool, truncated: bool
) -> ListResult:
    entries.sort(key=LIST_SORT_KEYS[sort_by], reverse=sort_desc)
    dirs = sum(e.is_directory for e in entries)
    return ListResult(base, entries, len(entries), dirs, len(entries) - dirs, truncated)


LIST_SORT_KEYS: dict[str, Callable[[Entry], tuple[object, ...]]] = {
    "name": lambda e: (e.name, e.path),
    "size": lambda e: (e.size or 0, e.path),
    "modified": lambda e: (e.modified_time or "", e.path),
    "type": lambda e: (not e.is_directory, e.extension or "", e.name, e.path),
}


def list_dir(
    machine: HostMachine,
    path: str,
    *,
    recursive: bool = False,
    max_depth: int | None = None,
    show_hidden: bool = True,
    file_types: list[str] | None = None,
    sort_by: ListSort = "name",
    sort_desc: bool = False,
    include_size: bool = True,
    include_permissions: bool = False,
) -> ListResult:
    """The entries of a directory (AIO `/v1/file/list`), recursively without entering symlinks.

    `max_depth` counts direct children as 1 and applies only when `recursive`. `file_types`
    (`[".py"]`, dot optional, any case) keeps only files with those extensions. Symlinks are
    described by what they lead to inside the machine, or as themselves when that fails.
    """
    with operation("list", path):
        check_listing(sort_by, max_depth, path)
        require_dir(machine, path)
        base = shown_path(machine, path)
        wanted = type_filter(file_types)

        trash = posixpath.join(machine.root, TRASH_DIR)

        def visible(node: Node) -> bool:
            return (show_hidden or not node.name.startswith(".")) and node.inside != trash

        entries: list[Entry] = []
        truncated = False
        for node in machine.view.walk(path, max_depth=max_depth if recursive else 1, descend=visible):
            if not visible(node):
                continue
            try:
                item = _to_entry(
                    machine,
                    posixpath.join(base, node.rel),
                    node,
                    size=include_size,
                    permissions=include_permissions,
                )
            except FileNotFoundError:  # gone since the scan
                continue
            if not wanted(item):
                continue
            if len(entries) == MAX_LIST_ENTRIES:
                truncated = True
                break
            entries.append(item)
        return listed(base, entries, sort_by, sort_desc, truncated)


# ---------------------------------------------------------------- search, glob


@dataclass(frozen=True)
class _Hit:
    path: str
    node: Node
    is_directory: bool


def _excluded(rel: str, name: str, exclude: list[str]) -> bool:
    """A pattern without `/` matches any one name (like .gitignore); with `/`, the relative path."""
    for pattern in exclude:
        if "/" in pattern:
            if wc_glob.globmatch(rel, pattern, flags=wc_glob.GLOBSTAR | wc_glob.DOTGLOB | wc_glob.BRACE):
                return True
        elif wc_fnmatch.fnmatch(name, pattern, flags=wc_fnmatch.DOTMATCH | wc_fnmatch.BRACE):
            return True
    return False


@dataclass(frozen=True)
class GlobPlan:
    """What a search walks and keeps, checked once for both kinds of machine."""

    pattern: str
    limit: int
    flags: int
    depth: int | None
    """None for a `**` pattern; otherwise the walk stops at the pattern's depth."""
    skip_hidden: bool
    excludes: list[str]

    def descends(self, rel: str, name: str) -> bool:
        return not (self.skip_hidden and name.startswith(".")) and not _excluded(rel, name, self.excludes)

    def matches(self, rel: str, name: str) -> bool:
        return wc_glob.globmatch(rel, self.pattern, flags=self.flags) and not _excluded(
            rel, name, self.excludes
        )


def glob_plan(
    op: str, path: str, pattern: str, exclude: list[str] | None, include_hidden: bool, max_results: int | None
) -> GlobPlan:
    limit = DEFAULT_SEARCH_RESULTS if max_results is None else max_results
    if not 1 <= limit <= MAX_SEARCH_RESULTS:
        raise bad_request(op, f"max_results must be between 1 and {MAX_SEARCH_RESULTS}", path)
    if not pattern or pattern.startswith("/"):
        raise bad_request(op, "pattern must be a non-empty glob relative to path", path)
    check_patterns(op, [pattern, *(exclude or [])], path)
    return GlobPlan(
        pattern=pattern,
        limit=limit,
        flags=wc_glob.GLOBSTAR | wc_glob.BRACE | (wc_glob.DOTGLOB if include_hidden else 0),
        depth=None if "**" in pattern else pattern.count("/") + 1,
        skip_hidden=not include_hidden and not any(s.startswith(".") for s in pattern.split("/")),
        excludes=exclude or [],
    )


def _glob(
    machine: HostMachine,
    op: str,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None,
    include_hidden: bool,
    files_only: bool,
    max_results: int | None,
) -> tuple[str, list[_Hit], bool]:
    """The shared walk of `search` and `glob_files`: (base inside path, hits, truncated)."""
    plan = glob_plan(op, path, pattern, exclude, include_hidden, max_results)
    require_dir(machine, path)
    base = shown_path(machine, path)
    hits: list[_Hit] = []
    truncated = False
    walk = machine.view.walk(path, max_depth=plan.depth, descend=lambda n: plan.descends(n.rel, n.name))
    for scanned, node in enumerate(walk, 1):
        if scanned > MAX_SEARCH_SCANNED:
            truncated = True
            break
        if not plan.matches(node.rel, node.name):
            continue
        inside = posixpath.join(base, node.rel)
        st, _ = _node_stat(machine, node)
        is_dir = stat_mod.S_ISDIR(st.st_mode)
        if files_only and is_dir:
            continue
        if len(hits) == plan.limit:
            truncated = True
            break
        hits.append(_Hit(inside, node, is_dir))
    return base, hits, truncated


def search(
    machine: HostMachine,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None = None,
    include_hidden: bool = False,
    files_only: bool = True,
    max_results: int | None = None,
) -> SearchResult:
    """Inside paths under `path` matching a glob (`**`, `*`, `?`, `[...]`, `{a,b}`), sorted.

    Seed 002's `/v2/fs/search` (v1 glob and find in one). Hidden names match only with
    `include_hidden` or when the pattern spells the dot. Symlinked directories are reported
    but never entered, so a search cannot wander out through a link.
    """
    with operation("search", path):
        base, hits, truncated = _glob(
            machine, "search", path, pattern, exclude=exclude, include_hidden=include_hidden,
            files_only=files_only, max_results=max_results,
        )  # fmt: skip
        return SearchResult(base, pattern, sorted(h.path for h in hits), truncated)


GLOB_SORT_KEYS: dict[str, Callable[[GlobEntry], tuple[object, ...]]] = {
    "path": lambda e: (e.path,),
    "name": lambda e: (e.name, e.path),
    "size": lambda e: (e.size or 0, e.path),
    "modified": lambda e: (e.modified_time or "", e.path),
}


def glob_files(
    machine: HostMachine,
    path: str,
    pattern: str,
    *,
    exclude: list[str] | None = None,
    include_hidden: bool = False,
    files_only: bool = True,
    include_metadata: bool = True,
    max_results: int | None = None,
    sort_by: GlobSort = "path",
    sort_desc: bool = False,
) -> GlobResult:
    """`search` with a record per match (AIO `/v1/file/glob`)."""
    with operation("search", path):
        if sort_by not in GLOB_SORT_KEYS:
            raise bad_request("search", f"sort_by must be one of {sorted(GLOB_SORT_KEYS)}", path)
        base, hits, truncated = _glob(
            machine, "search", path, pattern, exclude=exclude, include_hidden=include_hidden,
            files_only=files_only, max_results=max_results,
        )  # fmt: skip
        files = []
        for hit in hits:
            st = _node_stat(machine, hit.node)[0] if include_metadata else None
            files.append(
                GlobEntry(
                    path=hit.path,
                    name=hit.node.name,
                    is_directory=hit.is_directory,
                    size=st.st_size if st is not None else None,
                    modified_time=epoch_timestamp(st.st_mtime) if st is not None else None,
                )
            )
        files.sort(key=GLOB_SORT_KEYS[sort_by], reverse=sort_desc)
        return GlobResult(base, pattern, files, len(files), truncated)


# ---------------------------------------------------------------- upload, download


async def upload(
    machine: HostMachine, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
) -> UploadResult:
    """Receive a file into `.aiod-upload-<uuid4>.part` beside `path`, then rename it over `path`.

    The part belongs to `user` (or the default owner) before any byte lands, is fsynced, and
    is removed on any failure (the body breaking off, `MAX_UPLOAD_BYTES`, cancellation): the
    target is either the old file or the whole new one.
    """
    with operation("upload", path):
        owner = new_owner(machine, user)
        existing = _existing_file(machine, path)
        with staged(machine, path, "upload", owner=owner, like=existing) as fd:
            size = await receive(chunks, fd, limit=MAX_UPLOAD_BYTES, operation_name="upload", path=path)
            await off_loop(fd, os.fsync)
        return UploadResult(shown_path(machine, path), size)


def download(machine: HostMachine, path: str) -> DownloadTarget:
    """Check that `path` is a regular file and describe it; `iter_download` streams it."""
    with operation("download", path):
        resolved = machine.view.resolve(path)
        st = to_stat(resolved, machine.view.stat(resolved))
        require_regular(st, "download", path)
        return DownloadTarget(machine, resolved, st.size, st.mtime, st.inode)


def require_regular(st: FileStat, operation_name: str, path: str) -> None:
    if st.is_dir:
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not st.is_file:
        raise wrong_kind(operation_name, path, f"{path} is not a regular file")


def iter_download(target: DownloadTarget, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Bytes `start..end` (inclusive, as `parse_range` gives them) of the file `download` checked.

    The file is opened again by descriptor, without following a final link, and must still be
    the same inode; one that was replaced in between is an error rather than someone else's bytes.
    """
    with operation("download", target.path):
        fd = target.machine.view.open(target.path, os.O_RDONLY, follow=False)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_ino != target.inode:
            raise WorkspaceError(
                "io_error", failed("download", "the file was replaced during the download"), "download",
                target.path, exception_type="FileChanged", retryable=True,
            )  # fmt: skip
        f.seek(start)
        left = (target.size if end is None else end + 1) - start
        while left > 0:
            with operation("download", target.path):
                chunk = f.read(min(DOWNLOAD_CHUNK_BYTES, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
#: Digits of a `Range` byte position read as written; more is past the end of any file.
MAX_RANGE_DIGITS = 19


def parse_range(header: str | None, size: int, path: str | None = None) -> tuple[int, int] | None:
    """The inclusive byte range a single-range `Range` header asks of `size` bytes (RFC 7233).

    None means "send the whole file" (no header, another unit, several ranges, or a header
    that is not valid: §3.1 lets a server ignore those). A valid range with no byte inside
    the file raises `RangeNotSatisfiable`. An empty file has no satisfiable range except
    a suffix, which is served as the whole (empty) file.
    """
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:
        suffix = _position(last)
        if suffix == 0:
            raise _unsatisfiable(header, size, path)
        return None if size == 0 else (max(size - suffix, 0), size - 1)
    start = _position(first)
    if last and _position(last) < start:
        return None
    if start >= size:
        raise _unsatisfiable(header, size, path)
    return start, size - 1 if not last else min(_position(last), size - 1)


def _position(digits: str) -> int:
    """A byte position of a `Range` header; one longer than MAX_RANGE_DIGITS reads as 10**that.

    Such a position is past the end of any file, which is all the caller needs to know, and
    `int()` raises on text of more than 4300 digits. (Two of them compare equal, so
    `bytes=<huge>-<smaller huge>` is a 416 rather than an ignored header.)
    """
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= MAX_RANGE_DIGITS else 10**MAX_RANGE_DIGITS


def _unsatisfiable(header: str, size: int, path: str | None) -> RangeNotSatisfiable:
    return RangeNotSatisfiable(
        "bad_request", failed("download", f"range {header!r} is outside the file's {size} bytes"), "download",
        path, exception_type="RangeNotSatisfiable", size=size,
    )  # fmt: skip


# ---------------------------------------------------------------- remove, stat


def remove(machine: HostMachine, path: str, *, recursive: bool = False) -> str:
    """Remove a file, a symlink (not its target) or a directory (`recursive` when not empty).

    The machine's root, `/` and mount points (a host directory whose parent the machine does
    not expose) are refused: removing them would break the machine, not tidy it.
    """
    with operation("remove", path):
        shown = shown_path(machine, path)
        if shown == machine.root or machine.view.is_mount_root(shown):
            raise root_refused(path, shown)
        machine.view.remove(shown, recursive=recursive)  # by descriptor; never follows a link
        return shown


def root_refused(path: str, shown: str) -> WorkspaceError:
    return wrong_kind("remove", path, f"{shown} is the root of the machine or of a mount")


def stat(machine: HostMachine, path: str) -> FileStat:
    """What `path` is; a symlink is described by what it leads to inside the machine."""
    with operation("stat", path):
        lst = machine.view.lstat(path)
        is_link = stat_mod.S_ISLNK(lst.st_mode)
        st = (_target_stat(machine, path) or lst) if is_link else lst
        return to_stat(shown_path(machine, path), st, is_link)
