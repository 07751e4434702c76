"""Whole directories as tar archives: seed 002's `GET /v2/fs/tree` and `PUT /v2/fs/tree`.

`tar_stream` lists a directory up front (so a bad path or too many members is an ordinary
error before any byte is sent) and then streams a PAX tar of it chunk by chunk: headers come
from `tarfile`, file bytes are copied straight from disk, so memory stays at one chunk
whatever the tree weighs. Symlinks are stored as symlinks; devices, fifos, sockets and the
server's own `.aiod-*.part` files are left out.

`untar` is the dangerous direction: an archive is input from outside. The body is first
received into an unnamed temporary file on the target's file system (`O_TMPFILE`: nobody
inside the machine can see or change it between the checks and the extraction; under
`MAX_TREE_BYTES`), then
every member is checked before anything is written, and only then extracted:

    refused as invalid_path    absolute names, `..` components, hardlinks, devices, fifos,
                               symlinks whose target leaves the directory (absolute or up),
                               members below a symlink or file of the archive, and on-disk
                               symlinks where the archive needs a directory
    refused as invalid_target  a file member where the disk has a directory, or the reverse
    refused as bad_request     not a tar, more than `MAX_TREE_MEMBERS` members, more than
                               `MAX_TREE_BYTES` of content (so a gzip bomb stops too), a pax
                               or GNU long-name record past `MAX_TAR_HEADER_BYTES` (before it
                               is read), sparse members

Extraction walks directories by file descriptor with `O_NOFOLLOW` at every step, so a
symlink swapped in during extraction is an error, never a way out. Each file is written to a
staged name and renamed into place; modes keep only the permission bits (no setuid);
everything created goes to `user` or the machine's default owner. A failure after the checks
(a full disk) can leave the members extracted so far; nothing is ever written outside.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import lzma
import os
import stat as stat_mod
import tarfile
import tempfile
import uuid
import zlib
from collections.abc import AsyncIterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import IO

from agentbox.machines.hostview import At
from agentbox.workspace.errors import WorkspaceError, bad_request, failed, operation
from agentbox.workspace.files import (
    STAGING_PREFIX,
    STAGING_SUFFIX,
    HostMachine,
    Owner,
    is_staging_name,
    limit_exceeded,
    lstat_or_none,
    new_owner,
    receive,
    require_dir,
    shown_path,
    write_all,
)

#: Largest tar body `untar` accepts, and the most content (sum of file sizes) it extracts.
MAX_TREE_BYTES = 1024 * 1024 * 1024
#: Most members one tree may have, in either direction.
MAX_TREE_MEMBERS = 100_000
#: Largest pax extended header or GNU long name / long link record `untar` reads (tarfile
#: reads such a record whole into memory, so its size is checked before it is read).
MAX_TAR_HEADER_BYTES = 1024 * 1024
#: Tuning, not a limit: the size of the chunks `tar_stream` yields and copies with.
TAR_CHUNK_BYTES = 64 * 1024

_CARRIED = {stat_mod.S_IFREG, stat_mod.S_IFDIR, stat_mod.S_IFLNK}
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)


#: Header members whose data tarfile reads whole into memory before the member they describe.
_RECORD_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)


class _BoundedTarInfo(tarfile.TarInfo):
    """A `TarInfo` that refuses, before tarfile reads it, a pax or GNU long-name record past
    `MAX_TAR_HEADER_BYTES` (tarfile would hold a record of any claimed size in memory, and a
    gzip of zeros makes a 768 MiB record out of a 1 MiB body), and sparse members, whose maps
    tarfile also collects unbounded. Trees never carry sparse files."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.type in _RECORD_TYPES and self.size > MAX_TAR_HEADER_BYTES:
            detail = (
                f"a tar header record of {self.size} bytes is larger than the limit of {MAX_TAR_HEADER_BYTES}"
            )
            raise limit_exceeded("tree", None, detail)
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise bad_request("tree", "the archive has a sparse member, which trees never carry")
        return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]

    def _proc_gnusparse_10(
        self, next: tarfile.TarInfo, pax_headers: dict[str, str], tarfile_: tarfile.TarFile
    ) -> None:
        raise bad_request("tree", "the archive has a sparse member, which trees never carry")


def open_tar(source: IO[bytes]) -> tarfile.TarFile:
    """A streaming reader of an archive from outside, with its header records bounded."""
    return tarfile.open(fileobj=source, mode="r|*", tarinfo=_BoundedTarInfo)


@dataclass
class TreeResult:
    path: str
    files_written: int = 0
    """Regular files and symlinks."""
    dirs_created: int = 0
    bytes_written: int = 0


# ---------------------------------------------------------------- tar out


@dataclass(frozen=True)
class _Member:
    rel: str
    st: os.stat_result
    uid: int
    """The owner as the machine's processes see it (`HostFiles.inside_ids`), not the host's."""
    gid: int


def tar_stream(machine: HostMachine, path: str) -> Iterator[bytes]:
    """A PAX tar of the directory's contents (names relative to it), produced as it is read."""
    with operation("tree", path):
        require_dir(machine, path)
        members: list[_Member] = []
        for node in machine.view.walk(path):
            if is_staging_name(node.name) or stat_mod.S_IFMT(node.st.st_mode) not in _CARRIED:
                continue
            if len(members) == MAX_TREE_MEMBERS:
                raise limit_exceeded("tree", path, f"the tree has more than {MAX_TREE_MEMBERS} members")
            members.append(_Member(node.rel, node.st, *machine.inside_ids(node.st.st_uid, node.st.st_gid)))
        root_fd = machine.view.open(path, os.O_RDONLY | os.O_DIRECTORY)
    return _tar_chunks(root_fd, members, path)


def _tar_chunks(root_fd: int, members: list[_Member], path: str) -> Iterator[bytes]:
    """The archive's bytes; owns `root_fd` (the directory, opened by descriptor) and closes it."""
    out = bytearray()
    offset = 0
    try:
        for member in members:
            for piece in _member_bytes(root_fd, member, path):
                out += piece
                offset += len(piece)
                if len(out) >= TAR_CHUNK_BYTES:
                    yield bytes(out)
                    out.clear()
        end = bytes(tarfile.BLOCKSIZE * 2)
        offset += len(end)
        out += end + bytes(-offset % tarfile.RECORDSIZE)
        yield bytes(out)
    finally:
        os.close(root_fd)


def _member_bytes(root_fd: int, member: _Member, path: str) -> Iterator[bytes]:
    """The header and padded content of one member; nothing for an entry gone since the listing."""
    info = tarfile.TarInfo(member.rel)
    st = member.st
    info.mode = stat_mod.S_IMODE(st.st_mode)
    info.uid, info.gid, info.mtime = member.uid, member.gid, int(st.st_mtime)
    parts = member.rel.split("/")
    fd = None
    with operation("tree", path):
        try:
            if stat_mod.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
            elif stat_mod.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, _readlink_beneath(root_fd, parts)
            else:
                fd = _open_beneath(root_fd, parts, os.O_RDONLY | os.O_NONBLOCK)
                info.size = os.fstat(fd).st_size
        except (FileNotFoundError, NotADirectoryError):
            return
    if fd is None:
        yield header(info)
        return
    try:
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since the listing
            return
        yield header(info)
        left = info.size
        while left > 0:
            with operation("tree", path):
                chunk = os.read(fd, min(TAR_CHUNK_BYTES, left))
            if not chunk:  # shrank since the fstat: keep the header's promise with zeros
                chunk = bytes(min(TAR_CHUNK_BYTES, left))
            left -= len(chunk)
            yield chunk
        yield bytes(-info.size % tarfile.BLOCKSIZE)
    finally:
        os.close(fd)


def header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _open_dirs(root_fd: int, parts: list[str]) -> int:
    """An fd on root/parts..., every step opened with O_NOFOLLOW."""
    fd = os.dup(root_fd)
    for part in parts:
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _readlink_beneath(root_fd: int, parts: list[str]) -> str:
    parent = _open_dirs(root_fd, parts[:-1])
    try:
        return os.readlink(parts[-1], dir_fd=parent)
    finally:
        os.close(parent)


def _open_beneath(root_fd: int, parts: list[str], flags: int, mode: int = 0o644) -> int:
    parent = _open_dirs(root_fd, parts[:-1])
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    finally:
        os.close(parent)


# ---------------------------------------------------------------- tar in


async def untar(
    machine: HostMachine, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
) -> TreeResult:
    """Extract a tar body into the directory `path` (created if missing; its parent must exist)."""
    with operation("tree", path):
        owner = new_owner(machine, user)
        existing = lstat_or_none(machine, path, follow=True)
        if existing is not None and not stat_mod.S_ISDIR(existing.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        with machine.view.at(path, write=True) as at:
            fd = _unnamed_file(at)
            with os.fdopen(fd, "w+b") as archive:
                await receive(chunks, fd, limit=MAX_TREE_BYTES, operation_name="tree", path=path)
                result = await asyncio.to_thread(_unpack, archive, at, owner, path)
        result.path = shown_path(machine, path)
        return result


def _unnamed_file(at: At) -> int:
    """A file on the target's file system with no name (gone when closed), else a host temp file."""
    try:
        return os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=at.fd)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    return os.dup(tempfile.TemporaryFile().fileno())


def _unpack(source: IO[bytes], at: At, owner: Owner | None, path: str) -> TreeResult:
    """Check, then extract, reading the archive twice from one open file (two streaming passes)."""
    try:
        source.seek(0)
        kinds = check_archive(source, path)
        result = TreeResult(path)
        if at.name and _lstat_at(at.fd, at.name) is None:
            os.mkdir(at.name, 0o755, dir_fd=at.fd)
            if owner is not None:
                os.chown(at.name, *owner, dir_fd=at.fd, follow_symlinks=False)
            result.dirs_created += 1
        root_fd = os.open(at.target, _DIR_FLAGS, dir_fd=at.fd)
        try:
            _check_disk(root_fd, kinds, path)  # a directory just created passes trivially
            source.seek(0)
            _extract(source, root_fd, owner, result, path)
        finally:
            os.close(root_fd)
        return result
    except ARCHIVE_ERRORS as exc:
        raise bad_request("tree", f"the body is not a readable tar archive: {exc}", path) from exc


def _lstat_at(dirfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def refuse(path: str, name: str, why: str, error_type: str = "invalid_path") -> WorkspaceError:
    return WorkspaceError(
        error_type,
        failed("tree", f"archive member {name!r} {why}"),
        "tree",
        path,
        exception_type="UnsafeArchive",
    )


def member_parts(member: tarfile.TarInfo, path: str) -> list[str]:
    """The member's name as components below the target; [] for the target itself."""
    name = member.name
    if not name or name.startswith("/"):
        raise refuse(path, name, "has an absolute or empty name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise refuse(path, name, "has a '..' component")
    return parts


def _check_link(member: tarfile.TarInfo, parts: list[str], path: str) -> None:
    """A symlink must resolve, lexically from where it sits, to a place inside the target."""
    target = member.linkname
    if not target or target.startswith("/"):
        raise refuse(path, member.name, f"is a symlink to an absolute or empty target {target!r}")
    where = parts[:-1]
    for piece in target.split("/"):
        if piece == "..":
            if not where:
                raise refuse(path, member.name, f"is a symlink leaving the directory ({target!r})")
            where.pop()
        elif piece not in ("", "."):
            where.append(piece)


def _kind(member: tarfile.TarInfo, path: str) -> str:
    if member.isdir():
        return "dir"
    if member.isreg():
        return "file"
    if member.issym():
        return "symlink"
    what = "a hardlink" if member.islnk() else "a device, fifo or other special member"
    raise refuse(path, member.name, f"is {what}, which trees never carry")


def check_archive(source: IO[bytes], path: str) -> dict[tuple[str, ...], str]:
    """Validate every member without writing; return {components: kind}."""
    kinds: dict[tuple[str, ...], str] = {}
    names: dict[tuple[str, ...], str] = {}
    count = content = 0
    with open_tar(source) as tar:
        for member in tar:
            count += 1
            if count > MAX_TREE_MEMBERS:
                raise limit_exceeded("tree", path, f"the archive has more than {MAX_TREE_MEMBERS} members")
            parts = member_parts(member, path)
            kind = _kind(member, path)
            if kind == "file":
                content += member.size
                if content > MAX_TREE_BYTES:
                    raise limit_exceeded("tree", path, f"the archive holds more than {MAX_TREE_BYTES} bytes")
            elif kind == "symlink":
                _check_link(member, parts, path)
            if not parts and kind != "dir":
                raise refuse(path, member.name, "would replace the target directory itself")
            if (kind == "dir") != (kinds.get(tuple(parts), kind) == "dir"):
                raise refuse(path, member.name, "appears both as a directory and as something else")
            kinds[tuple(parts)] = kind
            names[tuple(parts)] = member.name
    for key in kinds:
        for i in range(1, len(key)):
            if kinds.get(key[:i], "dir") != "dir":
                raise refuse(path, names[key], f"lies below {names[key[:i]]!r}, which is not a directory")
    return kinds


def _check_disk(root_fd: int, kinds: dict[tuple[str, ...], str], path: str) -> None:
    """Refuse before writing when what is on disk would stop a member from landing."""
    needed_dirs = {key[:i] for key in kinds for i in range(1, len(key))}
    needed_dirs |= {key for key, kind in kinds.items() if kind == "dir" and key}
    for key in sorted(needed_dirs | kinds.keys(), key=len):
        if not key:
            continue
        st = _probe(root_fd, key)
        name = "/".join(key)
        if st is None:
            continue
        if key in needed_dirs:
            if stat_mod.S_ISLNK(st.st_mode):
                raise refuse(path, name, "needs a directory where the disk has a symlink")
            if not stat_mod.S_ISDIR(st.st_mode):
                raise refuse(path, name, "needs a directory where the disk has a file", "invalid_target")
        elif stat_mod.S_ISDIR(st.st_mode):
            raise refuse(path, name, "is not a directory but the disk has one there", "invalid_target")


def _probe(root_fd: int, key: tuple[str, ...]) -> os.stat_result | None:
    """lstat of root/key, or None when it or a parent is missing (parents were checked first)."""
    try:
        parent = _open_dirs(root_fd, list(key[:-1]))
    except FileNotFoundError:
        return None
    try:
        return _lstat_at(parent, key[-1])
    finally:
        os.close(parent)


def _extract(source: IO[bytes], root_fd: int, owner: Owner | None, result: TreeResult, path: str) -> None:
    dir_modes: list[tuple[list[str], int]] = []
    with open_tar(source) as tar:
        for member in tar:
            parts = member_parts(member, path)
            if not parts:
                continue
            if member.isdir():
                os.close(_make_dirs(root_fd, parts, owner, result))
                dir_modes.append((parts, member.mode))
                continue
            parent = _make_dirs(root_fd, parts[:-1], owner, result)
            try:
                if member.isreg():
                    data = tar.extractfile(member)
                    assert data is not None
                    _put_file(parent, parts[-1], data, member, owner)
                    result.bytes_written += member.size
                else:
                    _put_symlink(parent, parts[-1], member.linkname, owner)
                result.files_written += 1
            finally:
                os.close(parent)
    for parts, mode in dir_modes:  # last, so a read-only directory does not stop its own contents
        fd = _open_dirs(root_fd, parts)
        try:
            os.fchmod(fd, stat_mod.S_IMODE(mode) & 0o777)
        finally:
            os.close(fd)


def _make_dirs(root_fd: int, parts: list[str], owner: Owner | None, result: TreeResult) -> int:
    """An fd on root/parts..., creating missing directories for `owner`; never through a symlink."""
    fd = os.dup(root_fd)
    for part in parts:
        try:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                result.dirs_created += 1
            except FileExistsError:
                pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _stage_name() -> str:
    return f"{STAGING_PREFIX}tree-{uuid.uuid4()}{STAGING_SUFFIX}"


def _put_file(
    parent: int, name: str, source: IO[bytes], member: tarfile.TarInfo, owner: Owner | None
) -> None:
    part = _stage_name()
    fd = os.open(part, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
    try:
        try:
            while chunk := source.read(TAR_CHUNK_BYTES):
                write_all(fd, chunk)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, stat_mod.S_IMODE(member.mode) & 0o777)  # after chown, which may reset bits
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)
        os.rename(part, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        _unlink_at(parent, part)
        raise


def _put_symlink(parent: int, name: str, target: str, owner: Owner | None) -> None:
    part = _stage_name()
    os.symlink(target, part, dir_fd=parent)
    try:
        if owner is not None:
            os.chown(part, *owner, dir_fd=parent, follow_symlinks=False)
        os.rename(part, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        _unlink_at(parent, part)
        raise


def _unlink_at(parent: int, name: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=parent)
