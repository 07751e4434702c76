"""The durable file store of seed 000: uploads and `deliver_file` deliveries.

Bytes live once, as content-addressed blobs `AGENTBOX_HOME/blobs/<sha256[:2]>/<sha256>`; a
row of `files` is one file as a user sees it (id, name, size, session, how it came). Storing
the same bytes twice adds a row, not a blob. A blob is written to a `.part-*` file beside the
others, hashed on the way, fsynced, and renamed into place, so a blob path either holds the
whole content or does not exist. Files outlive their session (seed 000); deleting one marks
its row and removes the blob once no live row names it.

Every way the store refuses a file:

    FileStoreError
    ├── FileTooLarge    more than the limit (MAX_FILE_BYTES): nothing is stored, no row, no blob
    ├── FileNotFound    no live file with that id (never stored, or deleted)
    └── InvalidFile     not a regular file, an unusable file name, an unknown source

Blobs are the server's alone: the folder and its subfolders are `BLOBS_DIR_MODE`, each blob
is `BLOB_FILE_MODE` (set on the partial, kept by the rename).

Concurrency: blob moves, row inserts and deletes of one `FileStore` are serialized by one
lock, so a delete can never remove a blob that a concurrent store of the same bytes is about
to reference. Two server processes sharing a home do not share that lock (not supported).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import os
import stat as stat_mod
import tempfile
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from agentbox.ids import FILE, new_id
from agentbox.store.db import Database
from agentbox.timestamps import timestamp

#: Largest file the store keeps (seed 000: 100 MiB a file); one byte more is `FileTooLarge`.
MAX_FILE_BYTES = 100 * 1024 * 1024
#: Longest file name, in UTF-8 bytes (what most file systems allow for one name).
MAX_FILENAME_BYTES = 255
#: Folder of the blobs under AGENTBOX_HOME.
BLOBS_DIR_NAME = "blobs"
#: Permission bits of the blobs folder and of its two-character subfolders.
BLOBS_DIR_MODE = 0o700
#: Permission bits of a blob (what `mkstemp` gives the partial it is renamed from).
BLOB_FILE_MODE = 0o600
#: Prefix of a blob being written; it never matches a sha256 name.
PARTIAL_PREFIX = ".part-"
#: Tuning, not a limit: bytes read or written per step while copying.
COPY_CHUNK_BYTES = 1024 * 1024

#: Where a file came from: given to an agent (`upload`) or handed back by it (`delivery`).
Source = Literal["upload", "delivery"]
SOURCES: tuple[str, ...] = get_args(Source)

_COLUMNS = "id, filename, bytes, sha256, session_id, source, turn_id, tool_use_id, created_at"


class FileStoreError(Exception):
    pass


class FileTooLarge(FileStoreError):
    def __init__(self, limit: int, size: int | None = None) -> None:
        shown = f"{size} bytes" if size is not None else "more bytes"
        super().__init__(
            f"file is too large: {shown}, the limit is {limit} bytes ({limit // (1024 * 1024)} MiB)"
        )
        self.limit = limit
        self.size = size


class FileNotFound(FileStoreError):
    def __init__(self, file_id: str) -> None:
        super().__init__(f"no file with id {file_id!r}")
        self.file_id = file_id


class InvalidFile(FileStoreError):
    pass


@dataclass(frozen=True)
class _Blob:
    """A finished `.part-*` file waiting to be moved to its content address."""

    partial: Path
    sha256: str
    size: int


class FileStore:
    """The `files` table and the blobs folder of one AGENTBOX_HOME.

    Records are plain dicts (`id, filename, bytes, sha256, session_id, source, turn_id,
    tool_use_id, created_at`), the shape the HTTP API and events send as they are.
    """

    def __init__(self, db: Database, home: Path) -> None:
        self.db = db
        self.blobs = Path(home) / BLOBS_DIR_NAME
        self._lock = asyncio.Lock()

    def blob_path(self, sha256: str) -> Path:
        return blob_address(self.blobs, sha256)

    # -- storing -----------------------------------------------------------------------

    async def put_path(
        self,
        host_path: str | os.PathLike[str],
        filename: str,
        *,
        session_id: str | None,
        source: str,
        turn_id: str | None = None,
        tool_use_id: str | None = None,
        max_bytes: int = MAX_FILE_BYTES,
    ) -> dict[str, Any]:
        """Store a copy of the regular file at `host_path` (a final symlink is refused, not followed).

        For files the server itself trusts the path of; a machine's files go through `put_stream`.
        """
        _check_name(filename, source)
        blob = await asyncio.to_thread(self._copy_file, Path(host_path), max_bytes)
        return await self._commit(blob, filename, session_id, source, turn_id, tool_use_id)

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        filename: str,
        *,
        session_id: str | None,
        source: str,
        turn_id: str | None = None,
        tool_use_id: str | None = None,
        max_bytes: int = MAX_FILE_BYTES,
    ) -> dict[str, Any]:
        """Store bytes as they arrive (an upload body); past `max_bytes` nothing is kept."""
        _check_name(filename, source)
        fd, partial = self._new_partial()
        digest, size, pending = hashlib.sha256(), 0, bytearray()
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge(max_bytes)
                digest.update(chunk)
                pending += chunk
                if len(pending) >= COPY_CHUNK_BYTES:
                    await asyncio.to_thread(_write_all, fd, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(_finish, fd, bytes(pending))
        except BaseException:
            _close_quietly(fd)
            _unlink_quietly(partial)
            raise
        os.close(fd)
        return await self._commit(
            _Blob(partial, digest.hexdigest(), size), filename, session_id, source, turn_id, tool_use_id
        )

    def _new_partial(self) -> tuple[int, Path]:
        return new_partial(self.blobs)

    def _copy_file(self, source: Path, max_bytes: int) -> _Blob:
        """Copy and hash `source` into a partial blob (runs in a worker thread)."""
        try:
            src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidFile(f"cannot open {source.name!r}: {exc.strerror}") from exc
        try:
            return self._copy_fd(src, source.name, max_bytes)
        finally:
            os.close(src)

    def _copy_fd(self, src: int, name: str, max_bytes: int) -> _Blob:
        """Copy and hash the file open as `src` into a partial blob (runs in a worker thread)."""
        info = os.fstat(src)
        if not stat_mod.S_ISREG(info.st_mode):
            raise InvalidFile(f"{name!r} is not a regular file")
        if info.st_size > max_bytes:
            raise FileTooLarge(max_bytes, info.st_size)
        fd, partial = self._new_partial()
        try:
            digest, size = hashlib.sha256(), 0
            while chunk := os.read(src, COPY_CHUNK_BYTES):
                size += len(chunk)
                if size > max_bytes:  # it grew while we copied
                    raise FileTooLarge(max_bytes)
                digest.update(chunk)
                _write_all(fd, chunk)
            _finish(fd, b"")
        except BaseException:
            _unlink_quietly(partial)
            raise
        finally:
            os.close(fd)
        return _Blob(partial, digest.hexdigest(), size)

    async def _commit(
        self,
        blob: _Blob,
        filename: str,
        session_id: str | None,
        source: str,
        turn_id: str | None,
        tool_use_id: str | None,
    ) -> dict[str, Any]:
        """Move the blob to its address (or drop it if that content is there) and add the row."""
        record = {
            "id": new_id(FILE),
            "filename": filename,
            "bytes": blob.size,
            "sha256": blob.sha256,
            "session_id": session_id,
            "source": source,
            "turn_id": turn_id,
            "tool_use_id": tool_use_id,
            "created_at": timestamp(),
        }
        try:
            async with self._lock:
                created = await asyncio.to_thread(self._place, blob)
                try:
                    await self.db.execute(
                        f"INSERT INTO files ({_COLUMNS}) VALUES ({', '.join('?' * len(record))})",
                        tuple(record.values()),
                    )
                except BaseException:
                    if created:
                        await self._drop_blob_if_unused(blob.sha256)
                    raise
        finally:
            _unlink_quietly(blob.partial)
        return record

    def _place(self, blob: _Blob) -> bool:
        return place_blob(self.blobs, blob.partial, blob.sha256)

    # -- reading -----------------------------------------------------------------------

    async def get(self, file_id: str) -> dict[str, Any]:
        """The record of a live file; `FileNotFound` if it never existed or was deleted."""
        row = await self.db.fetchone(
            f"SELECT {_COLUMNS} FROM files WHERE id = ? AND deleted_at IS NULL", (file_id,)
        )
        if row is None:
            raise FileNotFound(file_id)
        return dict(row)

    async def list(
        self, session_id: str | None = None, *, before: str | None = None, limit: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """Live files, newest first; only those of `session_id` when given.

        `before` (an id) and `limit` page the list: ids sort by creation, so the next page of
        a newest-first list is the files whose id is below the last one seen.
        """
        where: builtins.list[str] = ["deleted_at IS NULL"]
        params: builtins.list[Any] = []
        if session_id is not None:
            where.append("session_id = ?")
            params.append(session_id)
        if before is not None:
            where.append("id < ?")
            params.append(before)
        page = ""
        if limit is not None:
            page = " LIMIT ?"
            params.append(limit)
        rows = await self.db.fetchall(
            f"SELECT {_COLUMNS} FROM files WHERE {' AND '.join(where)} ORDER BY id DESC{page}", params
        )
        return [dict(row) for row in rows]

    async def open(self, file_id: str) -> Path:
        """The blob holding a live file's bytes (read it, never write it: others may share it)."""
        record = await self.get(file_id)
        return self.blob_path(record["sha256"])

    # -- deleting ----------------------------------------------------------------------

    async def delete(self, file_id: str) -> None:
        """Mark the file deleted; its blob goes too once no live file has the same bytes."""
        async with self._lock:
            row = await self.db.fetchone(
                "UPDATE files SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL RETURNING sha256",
                (timestamp(), file_id),
            )
            if row is None:
                raise FileNotFound(file_id)
            await self._drop_blob_if_unused(row["sha256"])

    async def _drop_blob_if_unused(self, sha256: str) -> None:
        """Remove a blob no live row names (caller holds the lock)."""
        live = await self.db.fetchone(
            "SELECT 1 FROM files WHERE sha256 = ? AND deleted_at IS NULL LIMIT 1", (sha256,)
        )
        if live is None:
            _unlink_quietly(self.blob_path(sha256))


def blob_address(folder: Path, sha256: str) -> Path:
    """Where the blob with this digest lives in a folder of content-addressed blobs."""
    return folder / sha256[:2] / sha256


def new_partial(folder: Path) -> tuple[int, Path]:
    """A fresh `.part-*` file (open for writing) in a blob folder made `BLOBS_DIR_MODE`."""
    folder.mkdir(BLOBS_DIR_MODE, parents=True, exist_ok=True)
    if folder.stat().st_mode & 0o777 != BLOBS_DIR_MODE:  # a home from before
        os.chmod(folder, BLOBS_DIR_MODE)
    fd, name = tempfile.mkstemp(prefix=PARTIAL_PREFIX, dir=folder)
    os.fchmod(fd, BLOB_FILE_MODE)  # what mkstemp gives already; said here, not assumed
    return fd, Path(name)


def place_blob(folder: Path, partial: Path, sha256: str) -> bool:
    """Rename a finished partial to its content address; False when that blob already existed."""
    final = blob_address(folder, sha256)
    if final.exists():
        return False
    final.parent.mkdir(BLOBS_DIR_MODE, exist_ok=True)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    return True


def write_blob(folder: Path, data: bytes) -> str:
    """Store `data` as a blob of `folder` (whole or not at all, as above); its sha256."""
    sha256 = hashlib.sha256(data).hexdigest()
    if blob_address(folder, sha256).exists():
        return sha256
    fd, partial = new_partial(folder)
    try:
        _finish(fd, data)
    finally:
        os.close(fd)
    try:
        place_blob(folder, partial, sha256)
    finally:
        _unlink_quietly(partial)
    return sha256


def _check_name(filename: str, source: str) -> None:
    """A file name is one path component a download can carry: no folders, no NUL, not `.`/`..`."""
    if source not in SOURCES:
        raise InvalidFile(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")
    if not filename or filename in (".", "..") or "/" in filename or "\0" in filename:
        raise InvalidFile(f"invalid file name {filename!r}: give a plain name without folders")
    if len(filename.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        raise InvalidFile(f"file name is longer than {MAX_FILENAME_BYTES} bytes")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _finish(fd: int, data: bytes) -> None:
    _write_all(fd, data)
    os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
