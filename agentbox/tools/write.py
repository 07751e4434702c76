"""`write`: create a text file with its full content, or a folder (seed 001).

It never overwrites by default, and never creates parent folders: a missing parent is
an error telling the model to create the folder first (a separate, reviewable
operation). `make_write(overwrite_if_read=True)` builds the variant the `default` and
`flue` toolsets offer: it may replace a file the model has read in this session and that
has not changed since (the fingerprint in `ctx.reads` still matches the disk); any other
existing file is refused with what to do instead.

The tool writes nothing itself: it plans one Operation (`write` or `mkdir`) and returns
what `ctx.commit` says. A new file's operation expects `ABSENT`, an overwrite expects the
fingerprint that was read, so applying it later (after review) fails instead of
clobbering a file that appeared or changed in between.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection
from typing import Literal

from pydantic import AliasChoices, Field

from agentbox.machines.base import Machine
from agentbox.tools.base import Action, Operation, Tool, ToolContext, ToolParams, ToolResult
from agentbox.tools.fingerprint import ABSENT, fingerprint
from agentbox.tools.read import FAILURES, escape_message, escapes, located, problem, read_capped, remember
from agentbox.workspace.editor import MAX_EDIT_BYTES
from agentbox.workspace.fileops import Resolved, file_ops

#: Largest content one write plans, in UTF-8 bytes (the editor's limit: edits can follow).
MAX_WRITE_BYTES = MAX_EDIT_BYTES


class WriteParams(ToolParams):
    path: str = Field(
        validation_alias=AliasChoices("path", "targetPath"),
        description="Where to create the file or folder: relative to the workspace root, or absolute "
        "(`targetPath` is taken as this name too).",
    )
    content: str = Field(
        default="", description="kind=file: the file's full text. Not used with kind=folder."
    )
    kind: Literal["file", "folder"] = Field(
        default="file", description="`file` (default) creates a text file; `folder` creates one folder."
    )


async def parent_problem(machine: Machine, target: Resolved, staged: Collection[str] = ()) -> str | None:
    """Why `target` cannot be created in its folder, or None. A folder a staged `mkdir` creates
    (it makes its missing ancestors too) counts as there: the write is reviewed after it."""
    folder = posixpath.dirname(target.inside)
    parent = await file_ops(machine).lstat(folder, follow=True)
    if parent is None and any(s == folder or s.startswith(folder.rstrip("/") + "/") for s in staged):
        return None
    if parent is None:
        return (
            f"The folder {folder} does not exist. Create it first with write kind=folder "
            "(one folder per call, outermost first), then write again."
        )
    if not parent.is_dir:
        return f"{folder} is a file, not a folder; {target.requested} cannot be created inside it."
    return None


def overwrite_problem(
    ctx: ToolContext, target: Resolved, current: str, overwrite_if_read: bool
) -> str | None:
    """Why an existing file may not be replaced, or None when the stale-write check passes."""
    if not overwrite_if_read:
        return (
            f"{target.requested} already exists; write never overwrites a file. "
            "Use edit to change it, or write to a new path."
        )
    seen = ctx.reads.get(target.inside)
    if seen is None:
        return (
            f"{target.requested} already exists and you have not read it in this session. "
            "Read it first, then write again (or use edit for a partial change)."
        )
    if seen != current:
        return f"{target.requested} has changed since you read it. Read it again, then write again."
    return None


def make_write(overwrite_if_read: bool) -> Tool:
    """The `write` tool; with `overwrite_if_read`, a file read in this session and unchanged may be replaced."""

    async def run(ctx: ToolContext, p: WriteParams) -> ToolResult:
        try:
            op = await plan(ctx, p)
        except FAILURES as exc:
            return ToolResult.error(problem(exc, p.path))
        if isinstance(op, str):
            return ToolResult.error(op)
        result = await ctx.commit([op], "write")
        if not result.is_error:
            await remember(ctx, op)
        return result

    async def plan(ctx: ToolContext, p: WriteParams) -> Operation | str:
        target = located(ctx, p.path, write=True)
        if escapes(ctx.machine, target):
            return escape_message(target)
        missing_parent = await parent_problem(ctx.machine, target, await ctx.staged_folders())
        if missing_parent is not None:
            return missing_parent
        existing = await file_ops(ctx.machine).lstat(target.inside)
        if p.kind == "folder":
            if p.content:
                return "content is not used with kind=folder; create the folder, then write files into it."
            if existing is not None:
                what = "folder" if existing.is_dir else "file"
                return f"{target.requested} already exists (a {what})."
            return Operation("mkdir", target.inside, summary=f"create folder {target.inside}")
        size = len(p.content.encode("utf-8"))
        if size > MAX_WRITE_BYTES:
            return f"The content is {size} bytes; one write takes at most {MAX_WRITE_BYTES} bytes."
        if existing is None:
            return Operation(
                "write",
                target.inside,
                after=p.content,
                expect=ABSENT,
                summary=f"create {target.inside} ({len(p.content)} characters)",
            )
        if existing.is_dir:
            return f"{target.requested} is a folder; choose a file path inside it."
        current = await fingerprint(ctx.machine, target.inside)
        refusal = overwrite_problem(ctx, target, current, overwrite_if_read)
        if refusal is not None:
            return refusal
        before = None  # too large to show in a diff; `expect` still guards the overwrite
        if existing.size <= MAX_WRITE_BYTES:
            before = (await read_capped(ctx.machine, target.inside, MAX_WRITE_BYTES)).decode(
                "utf-8", "replace"
            )
        was = f"{len(before)} characters" if before is not None else f"{existing.size} bytes"
        return Operation(
            "write",
            target.inside,
            before=before,
            after=p.content,
            expect=current,
            summary=f"overwrite {target.inside} ({was} -> {len(p.content)} characters)",
        )

    description = (
        "Create a text file with its full `content` (kind=file, the default), or a folder (kind=folder). "
        "The parent folder must exist: create missing folders first with kind=folder, one per call "
        "(where changes are queued for review, a folder queued in this turn counts). "
        + (
            "An existing file is replaced only if you have read it in this session and it has not changed "
            "since; otherwise read it first (or use edit for partial changes)."
            if overwrite_if_read
            else "It never overwrites an existing file: use edit to change one."
        )
        + " Depending on the session's permissions the change is applied at once or queued for review; "
        "the result says which."
    )
    return Tool(
        name="write",
        description=description,
        params=WriteParams,
        action=Action.WRITE,
        run=run,
        read_only=False,
        destructive=overwrite_if_read,
    )


WRITE = make_write(overwrite_if_read=False)

TOOLS: dict[str, Tool] = {"write": WRITE}
