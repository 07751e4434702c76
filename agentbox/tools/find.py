"""`list`, `glob` and `grep`: finding files and text, capped, with a visible "narrow your search".

- `list` shows one folder's entries (all of them, hidden ones included, as `ls -A` would),
  or with `query` every file below the folder whose relative path contains the query
  (case-insensitive; ripgrep's walk, so .gitignore'd and hidden files are left out);
  `fileType` keeps one kind (markdown, txt, pdf, docx, image, or any extension).
  At most `MAX_LIST_ENTRIES`.
- `glob` lists files matching a glob with `rg --files` (respects .gitignore, skips hidden
  files unless the pattern names a dot), at most `MAX_GLOB_PATHS`.
- `grep` is the workspace's ripgrep search (agentbox/workspace/grep.py) shaped as Flue's
  tool: `path:line:text` lines, `MAX_GREP_MATCHES` of them, each text cut at
  `MAX_LINE_CHARS` with `...`, "No matches found." when there are none.

Flue's glob cuts silently; here every cap says how much there was (counted up to a
ceiling) and asks to narrow the search. Paths shown are absolute inside paths, which
`read` accepts as they are. Looking outside the workspace root asks first, as `read` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from wcmatch import fnmatch as wc_fnmatch
from wcmatch import glob as wc_glob

from agentbox.machines.base import TRASH_DIR, ExecRequest, Machine
from agentbox.machines.errors import MachineError
from agentbox.tools.base import Action, Tool, ToolContext, ToolParams, ToolResult, shown_file_ids
from agentbox.tools.documents import IMAGE_EXTENSIONS
from agentbox.tools.read import FAILURES, MAX_TEXT_BYTES, external_refusal, located, problem, stat_of
from agentbox.workspace import grep as workspace_grep
from agentbox.workspace.errors import WorkspaceError, bad_request
from agentbox.workspace.fileops import Resolved, below, file_ops, within
from agentbox.workspace.patterns import check_pattern

#: Entries one `list` shows (seed 001: "list 默认最多 120 项").
MAX_LIST_ENTRIES = 120
#: Paths one `glob` shows (Flue's cap, here with a notice).
MAX_GLOB_PATHS = 1000
#: Longest `prefix` a `list` takes, in characters (the schema refuses longer).
MAX_PREFIX_CHARS = 1024
#: Matching lines one `grep` shows (Flue's cap).
MAX_GREP_MATCHES = 100
#: Characters of a matching line's text shown by `grep`; longer ones end in `...` (Flue's cap).
MAX_LINE_CHARS = 500
#: Matches `grep` counts for the "of N" in its notice; past it the notice says "more than".
MAX_GREP_COUNTED = 1000
#: Paths `glob` and `list query=` count for the "of N" in their notices; past it, "more than".
MAX_FILES_COUNTED = 100_000
#: Bytes of rg's error output kept for the message.
MAX_RG_STDERR_BYTES = 16 * 1024

NAME_FLAGS = wc_fnmatch.BRACE | wc_fnmatch.DOTMATCH
PATH_FLAGS = wc_glob.GLOBSTAR | wc_glob.BRACE | wc_glob.DOTGLOB

#: `fileType` names (seed 001's list types) and the extensions each stands for; any other
#: value is taken as an extension (`py`, `.csv`).
FILE_TYPES: dict[str, tuple[str, ...]] = {
    "markdown": (".md", ".markdown"),
    "txt": (".txt",),
    "pdf": (".pdf",),
    "docx": (".docx",),
    "image": tuple(IMAGE_EXTENSIONS),
}
#: What a list line adds after a file of these kinds, so the model knows how to open it.
TYPE_NOTES: dict[str, str] = {
    "markdown": "markdown",
    "txt": "text",
    "pdf": "pdf: read by page or block",
    "docx": "docx: read by block or heading",
    "image": "image: view it with read (needs vision)",
}


def extensions(file_type: str | None) -> tuple[str, ...] | None:
    if file_type is None or not file_type.strip():
        return None
    name = file_type.strip().lower()
    return FILE_TYPES.get(name) or ("." + name.lstrip("."),)


def type_of(name: str) -> str | None:
    ext = posixpath.splitext(name)[1].lower()
    return next((t for t, exts in FILE_TYPES.items() if ext in exts), None)


def narrow(shown: int, total: int, counted_all: bool, what: str, how: str) -> str:
    of = str(total) if counted_all else f"more than {total}"
    return f"\n\n[Showing {shown} of {of} {what}. Narrow your search{how}.]"


async def looked_up(ctx: ToolContext, tool: str, path: str) -> Resolved | ToolResult:
    """The folder or file to search, after asking when it lies outside the workspace root."""
    try:
        target = located(ctx, path)
        refusal = await external_refusal(ctx, tool, target)
    except FAILURES as exc:
        return ToolResult.error(problem(exc, path))
    if refusal is not None:
        return ToolResult.error(refusal)
    if within(trash_root(ctx.machine), target.inside):
        return ToolResult.error(f"{path} is in the trash, which the file tools do not show")
    return target


def trash_root(machine: Machine) -> str:
    return posixpath.join(machine.root, TRASH_DIR)


def walk_excludes(ctx: ToolContext, folder: str) -> list[str]:
    """rg globs (relative to `folder`) that leave out of a walk of `folder` the trash and the
    knowledge bases below it the session did not select (external: listed, not walked)."""
    trash = [f"/{TRASH_DIR}"] if folder.rstrip("/") == ctx.machine.root.rstrip("/") else []
    return trash + ["/" + posixpath.relpath(root, folder) for root in ctx.scope.unselected_below(folder)]


async def walk_again(ctx: ToolContext, folder: str) -> list[str]:
    """The selected knowledge bases a walk of `folder` would miss, each inside an unselected
    one it leaves out: walked as roots of their own (ripgrep cannot re-enter a folder it
    leaves out), so the deepest knowledge base holding a file decides, as everywhere.

    A root rg is handed explicitly is followed even through a link, so one is kept only when
    every folder from `folder` down to it is a real folder, not a link."""
    unselected = ctx.scope.unselected_below(folder)
    nested = [kb.root for kb in ctx.scope.chosen if any(below(u, kb.root) for u in unselected)]
    return [root for root in nested if await plain_folders(ctx.machine, folder, root)]


async def plain_folders(machine: Machine, folder: str, root: str) -> bool:
    """Whether every step from `folder` down to `root` is a folder, none of them a link."""
    step = folder
    for part in posixpath.relpath(root, folder).split("/"):
        step = posixpath.join(step, part)
        try:
            st = await file_ops(machine).lstat(step, follow=False)
        except FAILURES:
            return False
        if st is None or st.is_symlink or not st.is_dir:
            return False
    return True


# --- rg --files -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileScan:
    """The first `kept` of the files a walk accepted, how many it accepted, and if it saw them all."""

    kept: list[str]
    total: int
    complete: bool


def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """rg's glob rule: a pattern without `/` matches a file name at any depth, one with `/` the
    path relative to the searched folder (`**` for any depth, `{a,b}` alternatives).

    Matched here rather than with `rg --glob`, because rg lets an include glob override
    .gitignore (`*.log` would list ignored logs), and the ignore rules must hold.
    A pattern `check_pattern` refuses (a brace bomb) is a `WorkspaceError` here, not later.
    """
    check_pattern("glob", pattern)
    if "/" not in pattern:
        return lambda rel: wc_fnmatch.fnmatch(posixpath.basename(rel), pattern, flags=NAME_FLAGS)
    anchored = pattern.removeprefix("./")
    return lambda rel: wc_glob.globmatch(rel, anchored, flags=PATH_FLAGS)


async def rg_files(
    machine: Machine,
    folder: str,
    *,
    hidden: bool,
    keep: int,
    accept: Callable[[str], bool],
    exclude: list[str],
    also: Sequence[str] = (),
) -> FileScan:
    """Files under a folder as rg lists them (.gitignore respected), as inside paths, sorted.

    rg runs on the machine (as `agentbox.workspace.grep` does), in the folder's resolved
    inside path; `also`: folders below it walked as roots of their own (`walk_again`).
    `accept` sees each path relative to the folder. rg is stopped once MAX_FILES_COUNTED
    files were accepted; it never outlives this call.
    """
    args = ["--files", "--null", "--no-config", "--no-messages", "--no-ignore-global", "--no-require-git"]
    args += ["--sort", "path", "--one-file-system"]
    if hidden:
        args.append("--hidden")
    args += [f"--glob=!{g}" for g in exclude]
    rg = await machine.find_program("rg")
    if rg is None:
        raise bad_request("search", f"machine {machine.name!r} has no ripgrep (rg) to search with", folder)
    roots = [".", *("./" + posixpath.relpath(root, folder) for root in also)]
    request = ExecRequest(argv=(rg, *args, "--", *roots), cwd=folder, env=workspace_grep.RG_ENV)
    proc = await machine.spawn(request)
    done = False
    stderr = asyncio.ensure_future(workspace_grep.read_capped_stream(proc.stderr, MAX_RG_STDERR_BYTES))
    kept: list[str] = []
    total = 0
    try:
        async with asyncio.timeout(workspace_grep.GREP_TIMEOUT_SECONDS):
            buffer = b""
            while chunk := await proc.stdout.read(65536):
                *names, buffer = (buffer + chunk).split(b"\0")
                for raw in names:
                    rel = raw.decode("utf-8", "surrogateescape").removeprefix("./")
                    if not accept(rel):
                        continue
                    total += 1
                    if len(kept) < keep:
                        kept.append(posixpath.join(folder, rel))
                    if total >= MAX_FILES_COUNTED:
                        return FileScan(sorted(kept), total, complete=False)
            code = await proc.wait()
            done = True
        message = (await stderr).decode("utf-8", "replace").strip()
        if code == 2 and message:
            raise WorkspaceError("bad_request", workspace_grep.rg_message(message), "search", folder)
        return FileScan(sorted(kept), total, complete=True)
    finally:
        if not done:
            proc.kill()
            while await proc.stdout.read(workspace_grep.PIPE_DRAIN_CHUNK):
                pass
            await proc.wait()
        stderr.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stderr


async def size_of(machine: Machine, inside: str) -> int | None:
    """The size of what `inside` leads to; None when it cannot be told (a dangling link)."""
    try:
        st = await file_ops(machine).lstat(inside, follow=True)
    except (OSError, MachineError):
        return None
    return None if st is None else st.size


def file_line(name: str, size: int | None) -> str:
    kind = type_of(name)
    note = f", {TYPE_NOTES[kind]}" if kind else ""
    return f"{name}  ({'unreadable' if size is None else f'{size} bytes'}{note})"


# --- list -----------------------------------------------------------------------------------------


class ListParams(ToolParams):
    path: str = Field(
        default=".",
        description=(
            "Folder to list: relative to the first knowledge base's root (default `.`, that root), or absolute."
        ),
    )
    query: str | None = Field(
        default=None,
        description=(
            "Find files below the folder whose path contains this text (case-insensitive), at any depth, "
            "instead of listing the folder itself."
        ),
    )
    prefix: str | None = Field(
        default=None,
        max_length=MAX_PREFIX_CHARS,
        description=(
            "Keep only entries whose path relative to the folder starts with this (e.g. `2024/` or `draft`); "
            "with query, at any depth."
        ),
    )
    fileType: str | None = Field(
        default=None,
        description="Keep only one kind: markdown, txt, pdf, docx, image, or an extension such as py.",
    )


@dataclass(frozen=True)
class Entry:
    """One line of a listing: what it shows, and the file's path when it is a file (for its id)."""

    shown: str
    path: str | None
    size: int | None = None
    link: bool = False

    def line(self, file_id: str | None) -> str:
        if self.path is None:
            return self.shown
        text = file_line(self.shown, self.size) + (" (link)" if self.link else "")
        return text + (f"  fileId={file_id}" if file_id else "")

    def record(self, file_id: str | None) -> dict[str, Any]:
        kind = type_of(self.shown) if self.path is not None else "folder"
        data: dict[str, Any] = {"path": self.path, "fileId": file_id, "fileType": kind, "size": self.size}
        if kind == "image":
            data["requiresVision"] = True
        return data


async def folder_entries(
    ctx: ToolContext, target: Resolved, exts: tuple[str, ...] | None, prefix: str
) -> tuple[list[Entry], int, bool]:
    """The folder's entries; a link's size is what it leads to (`unreadable` when it dangles)."""
    listing = await file_ops(ctx.machine).list_dir(target.requested, show_hidden=True)
    trash = trash_root(ctx.machine)
    entries = [
        e
        for e in listing.files
        if (exts is None or (not e.is_directory and (e.extension or "").lower() in exts))
        and e.name.startswith(prefix)
        and posixpath.join(target.inside, e.name) != trash
    ]
    entries.sort(key=lambda e: (not e.is_directory, e.name))
    shown = []
    for e in entries[:MAX_LIST_ENTRIES]:
        if e.is_directory:
            shown.append(Entry(f"{e.name}/" + (" (link)" if e.is_symlink else ""), None))
        else:
            size = await size_of(ctx.machine, e.path) if e.is_symlink else e.size
            shown.append(Entry(e.name, posixpath.join(target.inside, e.name), size, e.is_symlink))
    return shown, len(entries), not listing.truncated


async def run_list(ctx: ToolContext, p: ListParams) -> ToolResult:
    found = await looked_up(ctx, "list", p.path)
    if isinstance(found, ToolResult):
        return found
    target = found
    exts = extensions(p.fileType)
    prefix = (p.prefix or "").removeprefix("./")
    try:
        if not (await stat_of(ctx.machine, target.inside)).is_dir:  # a missing folder says so
            return ToolResult.error(f"{target.requested} is not a folder; use read to open a file.")
        if p.query:
            query = p.query.casefold()

            def accept(rel: str) -> bool:
                return (
                    query in rel.casefold()
                    and rel.startswith(prefix)
                    and (exts is None or posixpath.splitext(rel)[1].lower() in exts)
                )

            scan = await rg_files(
                ctx.machine,
                target.inside,
                hidden=p.query.startswith("."),
                keep=MAX_LIST_ENTRIES,
                accept=accept,
                exclude=walk_excludes(ctx, target.inside),
                also=await walk_again(ctx, target.inside),
            )
            sizes = await asyncio.gather(*(size_of(ctx.machine, path) for path in scan.kept))
            entries = [Entry(path, path, size) for path, size in zip(scan.kept, sizes, strict=True)]
            total, complete = scan.total, scan.complete
        else:
            entries, total, complete = await folder_entries(ctx, target, exts, prefix)
    except FAILURES as exc:
        return ToolResult.error(problem(exc, p.path))
    if not entries:
        what = f"matching {p.query!r}" if p.query else "to show"
        kind = f" of type {p.fileType}" if exts else ""
        starting = f" starting with {prefix!r}" if prefix else ""
        return ToolResult.text(
            f"{target.inside}: no entries{kind}{starting} {what}.", path=target.inside, total=0, entries=[]
        )
    ids = await shown_file_ids(ctx, [e.path for e in entries if e.path is not None])
    body = f"{target.inside}:\n" + "\n".join(e.line(ids.get(e.path or "")) for e in entries)
    if len(entries) < total or not complete:
        body += narrow(
            len(entries), total, complete, "entries", " with query, prefix or fileType, or list a subfolder"
        )
    return ToolResult.text(
        body,
        path=target.inside,
        shown=len(entries),
        total=total,
        truncated=len(entries) < total,
        entries=[e.record(ids.get(e.path or "")) for e in entries],
    )


# --- glob -----------------------------------------------------------------------------------------


class GlobParams(ToolParams):
    pattern: str = Field(
        description="Glob such as `*.py` (any depth), `src/**/*.ts` or `docs/*.md`, relative to path."
    )
    path: str = Field(default=".", description="Folder to search (default: the workspace root).")


async def run_glob(ctx: ToolContext, p: GlobParams) -> ToolResult:
    if not p.pattern.strip():
        return ToolResult.error("pattern must not be empty.")
    if p.pattern.startswith("/"):
        return ToolResult.error(
            "pattern is relative to path: pass the folder as `path` and a relative pattern."
        )
    found = await looked_up(ctx, "glob", p.path)
    if isinstance(found, ToolResult):
        return found
    target = found
    hidden = any(part.startswith(".") for part in p.pattern.split("/"))
    try:
        if not (await stat_of(ctx.machine, target.inside)).is_dir:  # a missing folder says so
            return ToolResult.error(f"{target.requested} is not a folder.")
        scan = await rg_files(
            ctx.machine,
            target.inside,
            hidden=hidden,
            keep=MAX_GLOB_PATHS,
            accept=glob_matcher(p.pattern),
            exclude=walk_excludes(ctx, target.inside),
            also=await walk_again(ctx, target.inside),
        )
    except FAILURES as exc:
        return ToolResult.error(problem(exc, p.path))
    if not scan.kept:
        return ToolResult.text("No files found matching pattern.", path=target.inside, total=0)
    body = "\n".join(scan.kept)
    cut = len(scan.kept) < scan.total or not scan.complete
    if cut:
        body += narrow(
            len(scan.kept), scan.total, scan.complete, "paths", " with a more specific pattern or path"
        )
    return ToolResult.text(body, path=target.inside, shown=len(scan.kept), total=scan.total, truncated=cut)


# --- grep -----------------------------------------------------------------------------------------


class GrepParams(ToolParams):
    pattern: str = Field(
        description="Regular expression (Rust/ripgrep syntax), or exact text with literal=true."
    )
    path: str = Field(default=".", description="File or folder to search (default: the workspace root).")
    include: str | None = Field(default=None, description="Only files matching this glob, e.g. `*.py`.")
    literal: bool = Field(default=False, description="Match pattern as exact text, not a regex.")
    caseInsensitive: bool = Field(default=False, description="Ignore case.")


def clip(text: str) -> str:
    return text if len(text) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS] + "..."


async def run_grep(ctx: ToolContext, p: GrepParams) -> ToolResult:
    found = await looked_up(ctx, "grep", p.path)
    if isinstance(found, ToolResult):
        return found
    try:
        result = await workspace_grep.grep(
            ctx.machine,
            found.requested,
            p.pattern,
            include=p.include or None,
            exclude=walk_excludes(ctx, found.inside) or None,
            also=await walk_again(ctx, found.inside),
            case_insensitive=p.caseInsensitive,
            fixed_strings=p.literal,
            max_results=MAX_GREP_COUNTED,
            max_file_size=MAX_TEXT_BYTES,
        )
    except WorkspaceError as exc:
        if exc.error_type == "bad_request":
            return ToolResult.error(f"grep failed: {exc.message}")
        return ToolResult.error(problem(exc, p.path))
    except FAILURES as exc:
        return ToolResult.error(problem(exc, p.path))
    if not result.matches:
        return ToolResult.text("No matches found.", path=found.inside, total=0)
    shown = result.matches[:MAX_GREP_MATCHES]
    body = "\n".join(f"{m.file}:{m.line_number}:{clip(m.line_content)}" for m in shown)
    total = len(result.matches)
    cut = total > len(shown) or result.truncated
    if cut:
        body += narrow(len(shown), total, not result.truncated, "matches", "")
    return ToolResult.text(body, path=found.inside, shown=len(shown), total=total, truncated=cut)


LIST = Tool(
    name="list",
    description=(
        "List a folder: sub-folders (ending in /) and files with their sizes and kinds, at most 120; hidden "
        "entries included. With `query`, find files at any depth below the folder whose path contains that "
        "text (ignoring .gitignore'd and hidden files). `prefix` keeps paths that start with it, `fileType` "
        "one kind (markdown, txt, pdf, docx, image, or an extension). Each file has a fileId that read "
        "takes instead of its path. When the list is cut it says so: narrow it with query, prefix, "
        "fileType or a subfolder."
    ),
    params=ListParams,
    action=Action.READ,
    run=run_list,
)

GLOB = Tool(
    name="glob",
    description=(
        "Find files by glob pattern below `path` (default: the workspace root): `*.py` matches at any depth, "
        "`src/**/*.ts` and `docs/*.md` are relative to path. Respects .gitignore and skips hidden files "
        "unless the pattern names them (`.github/**`). Returns at most 1000 paths, sorted; when cut, the "
        "result says how many there were: use a more specific pattern or path."
    ),
    params=GlobParams,
    action=Action.READ,
    run=run_glob,
)

GREP = Tool(
    name="grep",
    description=(
        "Search file contents with ripgrep: `pattern` is a regex (set literal=true for exact text such as "
        "code with ( ) [ ] . * ?), `path` a file or folder (default: the workspace root), `include` a file "
        "glob such as `*.py`, `caseInsensitive` to ignore case. Respects .gitignore and skips hidden and "
        "binary files. Returns `path:line:text` lines, at most 100, each cut at 500 characters; when there "
        "are more, the result says how many: narrow the pattern, path or include."
    ),
    params=GrepParams,
    action=Action.READ,
    run=run_grep,
)

TOOLS: dict[str, Tool] = {"list": LIST, "glob": GLOB, "grep": GREP}
