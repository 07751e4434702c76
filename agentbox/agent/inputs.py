"""Placing a message's files where the model finds them: `<workspace>/inputs/{filename}` (seed 000).

A name already taken (by an earlier turn's input, a file the agent made, or another file of
the same message) becomes `name (2).ext`, then `name (3).ext`, ...; the extension is the last
suffix (`a.tar (2).gz`), a dotfile has none (`.env (2)`). Each file is created exclusively
(`Machine.create`: O_EXCL, no symlink followed, on host files by descriptor and over SFTP by
its exclusive open), so a concurrent writer can never be overwritten: the loser of a race
just takes the next number. A file is copied in `COPY_CHUNK_BYTES` pieces, never whole.

Any failure is one `PlacementError` with a readable message; the turn then fails
(`internal_error`, seed 000).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentbox.machines.base import Machine
from agentbox.store.files import MAX_FILE_BYTES
from agentbox.workspace.fileops import FileOps, file_ops

#: The folder under the machine's workspace root that receives inputs.
INPUTS_DIR = "inputs"
#: Most numbered variants tried for one name before giving up (`name (2)` .. `name (N)`).
MAX_NAME_VARIANTS = 1000
#: Tuning, not a limit: bytes of a stored file read and written per step while placing it.
COPY_CHUNK_BYTES = 1024 * 1024
#: Largest input placed: what the file store keeps (an input is one of its files).
MAX_INPUT_BYTES = MAX_FILE_BYTES


class PlacementError(Exception):
    pass


class BlobSource(Protocol):
    """Where a file id's bytes are (agentbox.store.files.FileStore)."""

    async def open(self, file_id: str) -> Path: ...


@dataclass(frozen=True)
class Placed:
    file_id: str
    filename: str
    path: str
    """The inside path, e.g. `/workspace/inputs/data (2).csv`."""

    def to_dict(self) -> dict[str, Any]:
        return {"file_id": self.file_id, "filename": self.filename, "path": self.path}


def variant(filename: str, n: int) -> str:
    """`filename` for the n-th use: n = 1 is the name itself, then `stem (n).ext`."""
    if n == 1:
        return filename
    stem, ext = posixpath.splitext(filename)
    return f"{stem} ({n}){ext}"


async def place_inputs(machine: Machine, blobs: BlobSource, files: Sequence[dict[str, Any]]) -> list[Placed]:
    """Copy each `{file_id, filename}` into the inputs folder of `machine`."""
    ops = file_ops(machine)
    folder = posixpath.join(machine.root, INPUTS_DIR)
    try:
        await machine.mkdir(folder, parents=True)
    except Exception as exc:
        raise PlacementError(f"could not create {folder}: {exc}") from exc
    placed = []
    for entry in files:
        file_id, filename = entry["file_id"], entry["filename"]
        try:
            blob = await blobs.open(file_id)
            path = await _copy_in(ops, blob, folder, filename)
        except PlacementError:
            raise
        except Exception as exc:
            raise PlacementError(f"could not place input file {filename} ({file_id}): {exc}") from exc
        placed.append(Placed(file_id, filename, path))
    return placed


async def _copy_in(ops: FileOps, blob: Path, folder: str, filename: str) -> str:
    if not filename or "/" in filename or filename in (".", ".."):
        raise PlacementError(f"could not place input file {filename!r}: not a plain file name")
    for n in range(1, MAX_NAME_VARIANTS + 1):
        inside = posixpath.join(folder, variant(filename, n))
        try:
            async with contextlib.aclosing(_chunks(blob)) as chunks:
                await ops.create(inside, chunks, limit=MAX_INPUT_BYTES)
        except FileExistsError:
            continue
        return inside
    raise PlacementError(f"could not place input file {filename}: {MAX_NAME_VARIANTS} names are taken")


async def _chunks(blob: Path) -> AsyncGenerator[bytes, None]:
    """The stored file's bytes, read in a worker thread a piece at a time."""
    with await asyncio.to_thread(open, blob, "rb") as source:
        while chunk := await asyncio.to_thread(source.read, COPY_CHUNK_BYTES):
            yield chunk
