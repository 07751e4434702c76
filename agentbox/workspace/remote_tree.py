"""`GET` / `PUT /v2/fs/tree` on a machine reached only through the `Machine` protocol.

The same archives, checks and limits as `tree.py` (which works by descriptor on host files):
the archive is validated by `tree.py`'s own `check_archive` before anything is written, so an
escaping name, an absolute or upward symlink, a hardlink or a device is refused the same way.
What differs, and why:

- The body is received into a temporary file on the server (under `tree.MAX_TREE_BYTES`), since
  the machine's file system is not the server's.
- Paths are the machine's own: it resolves them with its login's rights. What is on the
  machine is checked (a symlink or file where the archive needs a directory) before the
  extraction, not at every step of it: a machine reached this way is not a boundary of its own.
- Files are written atomically (`Machine.write_stream`); permission bits and modification times
  are not carried onto the machine (the protocol has no chmod or utime), owners go to `user`.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import tarfile
import tempfile
from collections.abc import AsyncIterable, AsyncIterator
from typing import IO

from agentbox.machines.base import FileStat, Machine
from agentbox.workspace import remote_files
from agentbox.workspace.errors import bad_request, operation
from agentbox.workspace.files import is_staging_name, limit_exceeded
from agentbox.workspace.tree import (
    ARCHIVE_ERRORS,
    MAX_TREE_BYTES,
    MAX_TREE_MEMBERS,
    TAR_CHUNK_BYTES,
    TreeResult,
    check_archive,
    header,
    member_parts,
    open_tar,
    refuse,
)

# ---------------------------------------------------------------- tar out


async def tar_stream(machine: Machine, path: str) -> AsyncIterator[bytes]:
    """A PAX tar of the directory's contents, listed up front (errors before any byte)."""
    with operation("tree", path):
        await remote_files.require_dir(machine, path)
        top = remote_files.shown_path(machine, path)
        members: list[remote_files.RemoteNode] = []
        async for node in remote_files.walk(machine, top, max_depth=None, descend=lambda n: True):
            if is_staging_name(node.name) or not (
                node.stat.is_dir or node.stat.is_file or node.stat.is_symlink
            ):
                continue
            if len(members) == MAX_TREE_MEMBERS:
                raise limit_exceeded("tree", path, f"the tree has more than {MAX_TREE_MEMBERS} members")
            members.append(node)
    return _chunks(machine, members, path)


async def _chunks(
    machine: Machine, members: list[remote_files.RemoteNode], path: str
) -> AsyncIterator[bytes]:
    out = bytearray()
    offset = 0
    for member in members:
        async for piece in _member_bytes(machine, member, path):
            out += piece
            offset += len(piece)
            if len(out) >= TAR_CHUNK_BYTES:
                yield bytes(out)
                out.clear()
    end = bytes(tarfile.BLOCKSIZE * 2)
    offset += len(end)
    out += end + bytes(-offset % tarfile.RECORDSIZE)
    yield bytes(out)


async def _member_bytes(machine: Machine, member: remote_files.RemoteNode, path: str) -> AsyncIterator[bytes]:
    info = tarfile.TarInfo(member.rel)
    st = member.stat
    info.mode, info.uid, info.gid, info.mtime = st.mode & 0o7777, st.uid, st.gid, int(st.mtime)
    with operation("tree", path):
        try:
            if st.is_symlink:
                info.type, info.linkname = tarfile.SYMTYPE, await machine.readlink(member.inside)
            elif st.is_dir:
                info.type = tarfile.DIRTYPE
            else:
                info.size = st.size
        except (FileNotFoundError, NotADirectoryError):  # gone since the listing
            return
    yield header(info)
    if info.type != tarfile.REGTYPE:
        return
    at = 0
    while at < info.size:
        with operation("tree", path):
            want = min(TAR_CHUNK_BYTES, info.size - at)
            try:
                chunk = await machine.read(member.inside, offset=at, length=want)
            except FileNotFoundError:
                chunk = b""
        chunk = chunk or bytes(want)  # shrank or went since the listing: keep the header's promise
        at += len(chunk)
        yield chunk
    yield bytes(-info.size % tarfile.BLOCKSIZE)


# ---------------------------------------------------------------- tar in


async def untar(
    machine: Machine, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
) -> TreeResult:
    """Extract a tar body into the directory `path` (created if missing; its parent must exist)."""
    with operation("tree", path):
        target = remote_files.shown_path(machine, path)
        if user is not None:
            await machine.user_ids(user)
        existing = await machine.stat(target)
        if existing is not None and not existing.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        with tempfile.TemporaryFile() as archive:
            await _receive(chunks, archive, path)
            try:
                kinds = await asyncio.to_thread(_checked, archive, path)
                result = TreeResult(target)
                if existing is None:
                    await _made(machine, target, user, result)
                await _check_machine(machine, target, kinds, path)
                archive.seek(0)
                await _extract(machine, archive, target, user, result, path)
            except ARCHIVE_ERRORS as exc:
                raise bad_request("tree", f"the body is not a readable tar archive: {exc}", path) from exc
        return result


async def _receive(chunks: AsyncIterable[bytes], archive: IO[bytes], path: str) -> None:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > MAX_TREE_BYTES:
            raise limit_exceeded("tree", path, f"body is larger than the limit of {MAX_TREE_BYTES} bytes")
        await asyncio.to_thread(archive.write, chunk)


def _checked(archive: IO[bytes], path: str) -> dict[tuple[str, ...], str]:
    archive.seek(0)
    return check_archive(archive, path)


async def _made(machine: Machine, inside: str, user: str | None, result: TreeResult) -> None:
    await machine.mkdir(inside)
    if user is not None:
        await machine.chown(inside, user)
    result.dirs_created += 1


async def _check_machine(machine: Machine, top: str, kinds: dict[tuple[str, ...], str], path: str) -> None:
    """Refuse before writing when what is on the machine would stop a member from landing."""
    needed_dirs = {key[:i] for key in kinds for i in range(1, len(key))}
    needed_dirs |= {key for key, kind in kinds.items() if kind == "dir" and key}
    for key in sorted(needed_dirs | kinds.keys(), key=len):
        if not key:
            continue
        st = await _probe(machine, posixpath.join(top, *key))
        name = "/".join(key)
        if st is None:
            continue
        if key in needed_dirs:
            if st.is_symlink:
                raise refuse(path, name, "needs a directory where the disk has a symlink")
            if not st.is_dir:
                raise refuse(path, name, "needs a directory where the disk has a file", "invalid_target")
        elif st.is_dir and not st.is_symlink:
            raise refuse(path, name, "is not a directory but the disk has one there", "invalid_target")


async def _probe(machine: Machine, inside: str) -> FileStat | None:
    """What is at `inside`, a dangling symlink included; None when it or a parent is missing."""
    try:
        st = await machine.stat(inside)
        if st is not None:
            return st
        await machine.readlink(inside)  # stat follows links: a dangling one reads as missing
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    return FileStat(inside, False, False, True, 0, 0.0, 0, 0, 0, 0)


async def _extract(
    machine: Machine, archive: IO[bytes], top: str, user: str | None, result: TreeResult, path: str
) -> None:
    made: set[str] = set()

    async def make_dirs(inside: str) -> None:
        missing: list[str] = []
        here = inside
        while here != top and here not in made and await machine.stat(here) is None:
            missing.append(here)
            here = posixpath.dirname(here)
        for directory in reversed(missing):
            await _made(machine, directory, user, result)
        made.add(inside)

    with open_tar(archive) as tar:
        for member in tar:
            parts = member_parts(member, path)
            if not parts:
                continue
            inside = posixpath.join(top, *parts)
            if member.isdir():
                await make_dirs(inside)
                continue
            await make_dirs(posixpath.dirname(inside))
            if member.isreg():
                data = tar.extractfile(member)
                assert data is not None
                result.bytes_written += await machine.write_stream(inside, _read(data), limit=member.size)
            else:
                if await _probe(machine, inside) is not None:
                    await machine.remove(inside)
                await machine.symlink(member.linkname, inside)
            if user is not None:
                await machine.chown(inside, user)
            result.files_written += 1


async def _read(data: IO[bytes]) -> AsyncIterator[bytes]:
    while chunk := data.read(TAR_CHUNK_BYTES):
        yield chunk
