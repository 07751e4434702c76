"""`edit`: change text files and move, rename or delete files and folders (seed 001).

Modes:
- `replace`: `oldText` → `newText`. The text must occur once, or `occurrence` picks the
  N-th (1-based, non-overlapping), or `replaceAll` takes every one. Flue's messages for
  0 and for several matches. Replacement is literal.
- `append`: `text` added verbatim at the end.
- `multi_replace`: `edits`, applied in order to the result of the previous one; if any
  fails, nothing is planned (all or nothing).
- `move` (`destination` is the new path, or an existing folder to move into) and
  `rename` (`destination` is the new name, same folder). Never onto an existing path.
- `delete`: the file or folder goes to the trash (the governance module moves it there;
  it never deletes permanently).

Text is handled by the editor engine's `TextFile`: a UTF-8 BOM stays in front, and in a
file whose line ends are all CRLF a bare LF in `oldText`/`newText`/`text` stands for CRLF,
so the file stays CRLF. Refused: the workspace root and mount points, paths whose links
lead out of the workspace, overlapping paths (a folder into itself), moves across
filesystems, `oldText == newText`.

Nothing is written here: each call plans one Operation (`edit` with the full before and
after texts and the fingerprint it was planned against; `move`/`rename` with `dest`;
`delete`) and returns what `ctx.commit` says.
"""

from __future__ import annotations

import errno
import posixpath
from typing import Literal

from pydantic import Field

from agentbox.config import MAX_KNOWLEDGE_BASE_ID_CHARS
from agentbox.machines.base import FileStat, Machine
from agentbox.tools.base import Action, Operation, Tool, ToolContext, ToolParams, ToolResult
from agentbox.tools.fingerprint import fingerprint
from agentbox.tools.knowledge_bases import ScopeError
from agentbox.tools.read import FAILURES, escape_message, escapes, is_dir, problem, remember, resolve
from agentbox.workspace.editor import MAX_EDIT_BYTES, TextFile, checked_encode, occurrence_lines, too_large
from agentbox.workspace.fileops import Resolved, file_ops, within

Mode = Literal["replace", "append", "multi_replace", "move", "rename", "delete"]


class Refused(Exception):
    """An edit that cannot be planned; the message is for the model."""


class EditSpec(ToolParams):
    oldText: str = Field(description="Exact text to find (whitespace and indentation included).")
    newText: str = Field(description="Text to put in its place.")
    occurrence: int | None = Field(
        default=None, ge=1, description="Which occurrence to replace (1-based) when oldText is not unique."
    )


class EditParams(ToolParams):
    path: str = Field(description="The file (or, for move/rename/delete, file or folder) to change.")
    mode: Mode = Field(
        default="replace",
        description="replace (default), append, multi_replace, move, rename or delete.",
    )
    oldText: str | None = Field(default=None, description="replace: the exact text to find.")
    newText: str | None = Field(default=None, description="replace: the replacement text.")
    occurrence: int | None = Field(
        default=None,
        ge=1,
        description="replace: which occurrence (1-based) when oldText occurs more than once.",
    )
    replaceAll: bool = Field(default=False, description="replace: replace every occurrence.")
    text: str | None = Field(default=None, description="append: text added verbatim at the end of the file.")
    edits: list[EditSpec] | None = Field(
        default=None, description="multi_replace: replacements applied in order; all succeed or none is made."
    )
    destination: str | None = Field(
        default=None,
        description="move: the new path, or an existing folder to move into. rename: the new name.",
    )
    destinationKnowledgeBaseId: str | None = Field(
        default=None,
        max_length=MAX_KNOWLEDGE_BASE_ID_CHARS,
        description=(
            "move: the knowledge base (by id, one the session selected) whose root a relative destination "
            "starts from; by default the first one's."
        ),
    )


# --- text ----------------------------------------------------------------------------------


def positions(text: str, old: str) -> list[int]:
    """Where `old` starts in `text`, non-overlapping, in order."""
    found: list[int] = []
    at = text.find(old)
    while at != -1:
        found.append(at)
        at = text.find(old, at + len(old))
    return found


def replaced(text: str, old: str, new: str, occurrence: int | None, replace_all: bool, path: str) -> str:
    """`text` with the chosen occurrence(s) of `old` replaced, or Refused with Flue's wording."""
    if not old:
        raise Refused("oldText must not be empty.")
    if old == new:
        raise Refused("oldText and newText are identical; there is nothing to change.")
    if occurrence is not None and replace_all:
        raise Refused("Use either occurrence or replaceAll, not both.")
    found = positions(text, old)
    if not found:
        raise Refused(
            f"Could not find the exact text in {path}. "
            "Make sure your oldText matches exactly, including whitespace and indentation."
        )
    if replace_all:
        return text.replace(old, new)
    if occurrence is None and len(found) > 1:
        lines = ", ".join(str(n) for n in occurrence_lines(text, old))
        raise Refused(
            f"Found {len(found)} occurrences of the text in {path}. Provide more surrounding context to make "
            f"the match unique, or use replaceAll, or pick one with occurrence=N (they start on lines {lines})."
        )
    if occurrence is not None and occurrence > len(found):
        raise Refused(
            f"occurrence {occurrence} is out of range: the text occurs {len(found)} time(s) in {path}."
        )
    at = found[(occurrence or 1) - 1]
    return text[:at] + new + text[at + len(old) :]


def missing_params(p: EditParams) -> str | None:
    """What the mode needs and did not get, checked before the file is touched."""
    if p.mode == "append" and not p.text:
        return "append needs a non-empty `text`."
    if p.mode == "multi_replace" and not p.edits:
        return "multi_replace needs a non-empty `edits` list."
    if p.mode == "replace" and (p.oldText is None or p.newText is None):
        return "replace needs `oldText` and `newText`."
    return None


def new_text(file: TextFile, p: EditParams, path: str) -> str:
    """The file's text (without BOM) after the edit `p` asks for (`missing_params` passed)."""
    if p.mode == "append":
        return file.text + file.adapt(p.text or "")
    if p.mode == "multi_replace":
        edits = p.edits or []
        text = file.text
        for n, e in enumerate(edits, 1):
            try:
                text = replaced(text, file.adapt(e.oldText), file.adapt(e.newText), e.occurrence, False, path)
            except Refused as exc:
                raise Refused(f"Edit {n} of {len(edits)} failed, so no edit was made: {exc}") from None
        return text
    old, new = file.adapt(p.oldText or ""), file.adapt(p.newText or "")
    return replaced(file.text, old, new, p.occurrence, p.replaceAll, path)


async def read_editable(machine: Machine, inside: str, path: str) -> bytes | None:
    """The file's bytes, None when it does not exist; past the editor's limit a `too_large` error."""
    ops = file_ops(machine)
    try:
        return await ops.read_bytes(inside, MAX_EDIT_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        st = await ops.lstat(inside, follow=True)
        raise too_large("edit", path, st.size if st is not None else MAX_EDIT_BYTES + 1) from exc


async def plan_text_edit(machine: Machine, p: EditParams) -> Operation:
    missing = missing_params(p)
    if missing is not None:
        raise Refused(missing)
    target = resolve(machine, p.path, write=True)
    if escapes(machine, target):
        raise Refused(escape_message(target))
    if await is_dir(machine, target.inside):
        raise Refused(f"{target.requested} is a folder; {p.mode} works on text files.")
    expect = await fingerprint(machine, target.inside)  # before reading: a change in between fails the apply
    raw = await read_editable(machine, target.inside, target.requested)
    if raw is None:
        raise Refused(f"{target.requested} does not exist; use write to create it.")
    try:
        file = TextFile.decode(raw)
    except UnicodeDecodeError:
        raise Refused(f"{target.requested} is not UTF-8 text; edit changes text files only.") from None
    text = new_text(file, p, target.requested)
    checked_encode(file, text, "edit", target.requested)
    after = file.whole(text)
    return Operation(
        "edit",
        target.inside,
        before=file.content,
        after=after,
        expect=expect,
        summary=f"{p.mode} in {target.inside} ({len(file.content)} -> {len(after)} characters)",
    )


# --- files and folders ------------------------------------------------------------------------


async def source(machine: Machine, path: str, mode: str) -> Resolved:
    """The file or folder to move or delete: a final symlink is the link itself."""
    ops = file_ops(machine)
    src = ops.resolve(path, write=True, follow=False)
    if escapes(machine, src):
        raise Refused(escape_message(src))
    if src.inside == machine.root or ops.is_mount_root(src.inside):
        raise Refused(f"{src.inside} is the workspace root or a mount point; it cannot be {mode}d.")
    if await ops.lstat(src.inside) is None:
        raise Refused(f"{src.requested} does not exist.")
    return src


async def destination_of(machine: Machine, src: Resolved, p: EditParams) -> Resolved:
    if not p.destination or not p.destination.strip():
        raise Refused(f"{p.mode} needs a `destination`.")
    if p.mode == "rename":
        name = p.destination.strip()
        if "/" in name.rstrip("/"):
            dest = resolve(machine, name, write=True, follow=False)
            if posixpath.dirname(dest.inside) != posixpath.dirname(src.inside):
                raise Refused(
                    "rename changes only the name, in the same folder; use mode=move to change folders."
                )
            return dest
        if name.rstrip("/") in ("", ".", ".."):
            raise Refused(f"{name!r} is not a file name.")
        return resolve(
            machine, posixpath.join(posixpath.dirname(src.inside), name.rstrip("/")), write=True, follow=False
        )
    into = resolve(machine, p.destination, write=True)
    if p.destination.endswith("/") or await is_dir(machine, into.inside):
        return resolve(
            machine, posixpath.join(into.inside, posixpath.basename(src.inside)), write=True, follow=False
        )
    return resolve(machine, p.destination, write=True, follow=False)


async def check_destination(machine: Machine, src: Resolved, dest: Resolved) -> None:
    if escapes(machine, dest):
        raise Refused(escape_message(dest))
    if dest.inside == src.inside:
        raise Refused(f"{src.inside} is already there.")
    if dest.inside.startswith(src.inside.rstrip("/") + "/"):
        raise Refused(f"{src.inside} cannot be moved into itself ({dest.inside}).")
    ops = file_ops(machine)
    if await ops.lstat(dest.inside) is not None:
        raise Refused(f"{dest.inside} already exists; move and rename never replace anything.")
    parent = posixpath.dirname(dest.inside)
    if not await is_dir(machine, parent):
        raise Refused(
            f"The folder {posixpath.dirname(dest.inside)} does not exist. Create it first with write kind=folder."
        )
    if not ops.same_mount(parent, src.inside):
        raise Refused(
            f"{src.inside} and {posixpath.dirname(dest.inside)} are on different filesystems; a move between "
            "them is refused and the source is kept. Copy it with bash instead."
        )


def real_dir(st: FileStat | None) -> bool:
    """A directory itself, not a link to one (`lstat`'s view: a link is moved as a link)."""
    return st is not None and st.is_dir and not st.is_symlink


async def file_expect(machine: Machine, inside: str) -> str | None:
    """The fingerprint a move/delete of a regular file is planned against; None for folders and links."""
    st = await file_ops(machine).lstat(inside)
    return await fingerprint(machine, inside) if st is not None and st.is_file and not st.is_symlink else None


async def describe(machine: Machine, inside: str) -> str:
    ops = file_ops(machine)
    if not real_dir(await ops.lstat(inside)):
        return inside
    files = sum(not real_dir(node.stat) for node in await ops.walk(inside))
    return f"folder {inside} ({files} file(s))"


async def plan_path_change(machine: Machine, p: EditParams) -> Operation:
    verb = "delete" if p.mode == "delete" else "move"
    src = await source(machine, p.path, verb)
    expect = await file_expect(machine, src.inside)
    what = await describe(machine, src.inside)
    if p.mode == "delete":
        return Operation("delete", src.inside, expect=expect, summary=f"delete {what} (to the trash)")
    dest = await destination_of(machine, src, p)
    await check_destination(machine, src, dest)
    kind: Literal["move", "rename"] = "rename" if p.mode == "rename" else "move"
    return Operation(
        kind, src.inside, dest=dest.inside, expect=expect, summary=f"{kind} {what} -> {dest.inside}"
    )


def in_scope(ctx: ToolContext, p: EditParams) -> EditParams:
    """`p` with its paths made absolute the session's way: `path` from the first knowledge base's
    root, a move's `destination` from `destinationKnowledgeBaseId`'s (else the first's). A
    knowledge base's root is never moved, renamed or deleted."""
    scope = ctx.scope
    if p.destinationKnowledgeBaseId is not None and p.mode != "move":
        raise Refused("destinationKnowledgeBaseId is for mode=move.")
    path = scope.absolute(p.path)
    if p.mode in ("move", "rename", "delete"):
        lexical = posixpath.normpath(path)
        root = next(
            (
                kb
                for kb in scope.registered
                if kb.source != "workspace" and kb.root.rstrip("/") == lexical.rstrip("/")
            ),
            None,
        )
        if root is not None:
            raise Refused(f"{lexical} is the root of the knowledge base {root.id!r}; it cannot be {p.mode}d.")
    destination = p.destination
    if p.mode == "move" and destination and destination.strip():
        if p.destinationKnowledgeBaseId is None:
            destination = scope.absolute(destination)
        else:
            try:
                (kb,) = scope.narrowed([p.destinationKnowledgeBaseId])
            except ScopeError as exc:
                raise Refused(str(exc)) from None
            joined = posixpath.normpath(posixpath.join(kb.root, destination))
            if not within(kb.root, joined):
                raise Refused(f"destination {destination!r} leaves the knowledge base {kb.id!r} ({kb.root}).")
            destination = joined + ("/" if destination.endswith("/") else "")
    return p.model_copy(update={"path": path, "destination": destination})


async def run_edit(ctx: ToolContext, p: EditParams) -> ToolResult:
    try:
        p = in_scope(ctx, p)
        if p.mode in ("move", "rename", "delete"):
            op = await plan_path_change(ctx.machine, p)
        else:
            op = await plan_text_edit(ctx.machine, p)
    except Refused as exc:
        return ToolResult.error(str(exc))
    except FAILURES as exc:
        return ToolResult.error(problem(exc, p.path))
    result = await ctx.commit([op], "edit")
    if not result.is_error:
        await remember(ctx, op)
    return result


EDIT = Tool(
    name="edit",
    description=(
        "Change a text file, or move, rename or delete a file or folder. mode=replace (default): replace "
        "`oldText` with `newText`; oldText must match exactly (whitespace included) and occur once, unless "
        "you pass `occurrence` (1-based) to pick one or `replaceAll`. mode=append: add `text` at the end "
        "verbatim (start it with a newline if needed). mode=multi_replace: `edits` [{oldText, newText, "
        "occurrence?}] applied in order, all or nothing. mode=move: `destination` is the new path or an "
        "existing folder; mode=rename: `destination` is the new name; neither replaces an existing path. "
        "`destinationKnowledgeBaseId` moves into another of the session's knowledge bases. "
        "mode=delete moves the file or folder to the trash. Line endings (CRLF) and a BOM are kept. "
        "Depending on the session's permissions the change is applied at once or queued for review."
    ),
    params=EditParams,
    action=Action.WRITE,
    run=run_edit,
    read_only=False,
    destructive=True,
)

TOOLS: dict[str, Tool] = {"edit": EDIT}
