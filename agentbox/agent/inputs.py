"""Placing a message's files where the model finds them: `<workspace>/inputs/{filename}` (seed 000).

A name already taken (by an earlier turn's input, a file the agent made, or another file of
the same message) becomes `name (2).ext`, then `name (3).ext`, ...; the extension is the last
suffix (`a.tar (2).gz`), a dotfile has none (`.env (2)`). Each file is created exclusively
(O_EXCL, no symlink followed), so a concurrent writer can never be overwritten: the loser of
a race just takes the next number.

Any failure is one `PlacementError` with a readable message; the turn then fails
(`internal_error`, seed 000).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: The folder under the machine's workspace root that receives inputs.
INPUTS_DIR = "inputs"
#: Most numbered variants tried for one name before giving up (`name (2)` .. `name (N)`).
MAX_NAME_VARIANTS = 1000


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


async def place_inputs(machine: Any, blobs: BlobSource, files: Sequence[dict[str, Any]]) -> list[Placed]:
    """Copy each `{file_id, filename}` into the inputs folder of `machine` (one with the HostFiles capability)."""
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
            path = await asyncio.to_thread(_copy_in, machine, blob, folder, filename)
        except PlacementError:
            raise
        except Exception as exc:
            raise PlacementError(f"could not place input file {filename} ({file_id}): {exc}") from exc
        placed.append(Placed(file_id, filename, path))
    return placed


def _copy_in(machine: Any, blob: Path, folder: str, filename: str) -> str:
    if not filename or "/" in filename or filename in (".", ".."):
        raise PlacementError(f"could not place input file {filename!r}: not a plain file name")
    for n in range(1, MAX_NAME_VARIANTS + 1):
        inside = posixpath.join(folder, variant(filename, n))
        try:
            fd = machine.view.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, follow=False)
        except FileExistsError:
            continue
        try:
            with open(blob, "rb") as source, os.fdopen(fd, "wb") as target:
                owner = machine.default_owner()
                if owner is not None:
                    os.fchown(target.fileno(), *owner)
                shutil.copyfileobj(source, target)
        except BaseException:
            machine.view.unlink(inside)
            raise
        return inside
    raise PlacementError(f"could not place input file {filename}: {MAX_NAME_VARIANTS} names are taken")
