"""A file's identity for stale checks: what the model read vs. what is on disk now.

Reads record `ctx.reads[inside_path] = fingerprint(machine, inside_path)`; planned operations
carry it as `Operation.expect`; applying compares it with the file as it is then, so a change
made in between (by the user, a command, another agent) makes the operation fail instead of
clobbering newer content. sha256 of the bytes plus the size: cheap enough for the files a
model edits, and unlike mtime it does not lie after a same-second rewrite. The file is read
through the machine's descriptor view, as every file the tools touch.
"""

from __future__ import annotations

import hashlib
import os
import stat as stat_mod
from typing import Any

from agentbox.machines.errors import MachineError

#: Marker for "there is no regular file here" (missing, or a directory): a file appearing
#: where none was planned is a change too.
ABSENT = "absent"
#: Bytes read per chunk while hashing; keeps memory flat for large files.
CHUNK = 1 << 20


def fingerprint(machine: Any, path: str) -> str:
    """`sha256:<hex>:<size>` of the file's content, or `ABSENT` if it is not a regular file."""
    try:
        fd = machine.view.open(path, os.O_RDONLY)
    except (OSError, MachineError):
        return ABSENT
    if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return ABSENT
    with os.fdopen(fd, "rb") as f:
        digest = hashlib.sha256()
        size = 0
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return f"sha256:{digest.hexdigest()}:{size}"
