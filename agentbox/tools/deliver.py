"""`deliver_file`: hand files from the machine to the user, through the durable file store (seed 000).

Each file is copied out of the machine into `ctx.files` (content-addressed blobs; the file
outlives the session and its sandbox) and listed in the result, in text for the model and
in `ToolResult.data["files"]` (`id`, `filename`, `bytes`) for the `agent.tool_result` event.

Seed 000's limits: a file is at most `MAX_DELIVERY_BYTES` (100 MiB), and a turn delivers at
most `MAX_DELIVERIES_PER_TURN` files (`ctx.deliveries` counts them; every delivered file is
one delivery, a call with three paths uses three). A file that fails (missing, a folder,
too big, the limit reached, the store failing) is reported and not listed; the call is
`is_error` only when nothing at all was delivered.

Delivering is the model's bookkeeping (`Action.META`), except that a file whose real
location is outside the machine's workspace root is an external read: it is authorized as
`Action.READ_EXTERNAL` first (on a `local` machine that is the host's own files).

The bytes are streamed into the store through the machine's file operations
(`workspace/fileops.py`): on host files by descriptor, never through a link swapped in and
never from another inode than the one checked; through the protocol (ssh) by offset, and
never from a file whose size or modification time changed since it was checked. Through the
protocol a path's real location is its lexical one (where a link leads cannot be seen).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from agentbox.machines.base import Machine
from agentbox.store.files import MAX_FILE_BYTES, FileStoreError
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import file_ops, within

from .base import Action, Tool, ToolContext, ToolParams, ToolResult

#: Files delivered per turn (seed 000: at most 10 deliveries a turn).
MAX_DELIVERIES_PER_TURN = 10
#: Largest file delivered (seed 000: 100 MiB a file), the file store's own limit.
MAX_DELIVERY_BYTES = MAX_FILE_BYTES

DESCRIPTION = (
    "Deliver result files to the user: copies files from the machine into the user's file store, where "
    "they stay after this session. Deliver only final results the user asked for or will want (reports, "
    "data, archives), not intermediate files. Give `paths` (or `path` for one file); folders are not "
    f"delivered (archive them first, e.g. with tar or zip). At most {MAX_DELIVERY_BYTES // (1024 * 1024)} "
    f"MiB a file and {MAX_DELIVERIES_PER_TURN} files per turn. The result lists each delivered file with "
    "its id and each file that failed with the reason."
)


class DeliverParams(ToolParams):
    paths: list[str] | None = Field(
        default=None,
        description="Files to deliver: absolute paths in the machine, or relative to the first knowledge base's root.",
    )
    path: str | None = Field(
        default=None, description="One file to deliver (the same as `paths` with one entry)."
    )


class DeliveryFailed(Exception):
    """Why one file was not delivered; the message is for the model."""


@dataclass(frozen=True)
class Delivered:
    path: str
    record: dict[str, Any]


async def run_deliver(ctx: ToolContext, params: DeliverParams) -> ToolResult:
    wanted = list(dict.fromkeys([*(params.paths or []), *([params.path] if params.path else [])]))
    if not wanted:
        return ToolResult.error("Nothing to deliver: give `paths` (a list of files) or `path`.")
    if ctx.files is None:
        return ToolResult.error("File delivery is not available in this session (no file store).")
    delivered: list[Delivered] = []
    failed: list[tuple[str, str]] = []
    for path in wanted:
        if ctx.deliveries >= MAX_DELIVERIES_PER_TURN:
            failed.append((path, f"the limit of {MAX_DELIVERIES_PER_TURN} deliveries per turn is reached"))
            continue
        ctx.deliveries += 1  # reserved before any await, so parallel calls cannot pass the limit together
        try:
            delivered.append(Delivered(path, await deliver_one(ctx, path)))
        except DeliveryFailed as exc:
            ctx.deliveries -= 1
            failed.append((path, str(exc)))
        except BaseException:
            ctx.deliveries -= 1
            raise
    return _result(delivered, failed)


async def deliver_one(ctx: ToolContext, path: str) -> dict[str, Any]:
    """Copy one file of the machine into the file store; its record."""
    machine: Machine = ctx.machine
    assert ctx.files is not None
    try:
        target = await file_ops(machine).download(ctx.scope.absolute(path))
    except WorkspaceError as exc:
        raise DeliveryFailed(_reason(exc)) from exc
    if not (within(machine.root, target.path) and ctx.scope.contains(target.path)):
        refusal = await ctx.authorize(Action.READ_EXTERNAL, "deliver_file", {"path": target.path})
        if refusal is not None:
            raise DeliveryFailed(refusal)
    if target.size > MAX_DELIVERY_BYTES:
        raise DeliveryFailed(
            f"it is {target.size} bytes, more than the {MAX_DELIVERY_BYTES // (1024 * 1024)} MiB a file may be"
        )
    try:
        return await ctx.files.put_stream(
            target.chunks(0, None),
            posixpath.basename(target.path),
            session_id=ctx.session_id,
            source="delivery",
            turn_id=ctx.turn_id,
            tool_use_id=ctx.tool_use_id,
            max_bytes=MAX_DELIVERY_BYTES,
        )
    except WorkspaceError as exc:  # the machine's side: replaced, gone or unreadable while copied
        raise DeliveryFailed(_reason(exc)) from exc
    except (FileStoreError, OSError) as exc:
        raise DeliveryFailed(f"the file store refused it: {exc}") from exc


def _reason(exc: WorkspaceError) -> str:
    if exc.error_type == "not_found":
        return "no such file"
    if exc.error_type == "invalid_target":
        return "it is a folder or not a regular file (archive a folder first, e.g. with tar or zip)"
    return exc.message


def _result(delivered: list[Delivered], failed: list[tuple[str, str]]) -> ToolResult:
    lines: list[str] = []
    if delivered:
        lines.append(f"Delivered {len(delivered)} file{'s' if len(delivered) != 1 else ''}:")
        lines += [
            f"- {d.record['filename']} ({d.record['bytes']} bytes, id {d.record['id']}) from {d.path}"
            for d in delivered
        ]
    else:
        lines.append("No file was delivered.")
    if failed:
        lines.append("Not delivered:")
        lines += [f"- {path}: {reason}" for path, reason in failed]
    data = {
        "files": [
            {"id": d.record["id"], "filename": d.record["filename"], "bytes": d.record["bytes"]}
            for d in delivered
        ],
        "failed": [{"path": path, "reason": reason} for path, reason in failed],
    }
    text = "\n".join(lines)
    return ToolResult.text(text, **data) if delivered else ToolResult.error(text, **data)


DELIVER_FILE = Tool(
    name="deliver_file",
    description=DESCRIPTION,
    params=DeliverParams,
    action=Action.META,
    run=run_deliver,
    read_only=False,
)

TOOLS: dict[str, Tool] = {DELIVER_FILE.name: DELIVER_FILE}
