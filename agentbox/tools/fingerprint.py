"""A file's identity for stale checks: what the model read vs. what is on disk now.

Reads record `ctx.reads[inside_path] = await fingerprint(machine, inside_path)`; planned
operations carry it as `Operation.expect`; applying compares it with the file as it is then,
so a change made in between (by the user, a command, another agent) makes the operation fail
instead of clobbering newer content. sha256 of the bytes plus the size: cheap enough for the
files a model edits, and unlike mtime it does not lie after a same-second rewrite. The bytes
come through `file_ops`: by descriptor on host files, by offset through the protocol elsewhere,
so the same file has the same fingerprint whichever way it is reached.
"""

from __future__ import annotations

from agentbox.machines.base import Machine
from agentbox.workspace.fileops import file_ops

#: Marker for "there is no regular file here" (missing, or a directory): a file appearing
#: where none was planned is a change too.
ABSENT = "absent"
#: Bytes read per chunk while hashing; keeps memory flat for large files.
CHUNK = 1 << 20


async def fingerprint(machine: Machine, path: str) -> str:
    """`sha256:<hex>:<size>` of the file's content, or `ABSENT` if it is not a regular file."""
    found = await file_ops(machine).content_hash(path, CHUNK)
    if found is None:
        return ABSENT
    digest, size = found
    return f"sha256:{digest}:{size}"
