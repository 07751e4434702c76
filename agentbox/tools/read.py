"""`read` and `read_image`: text by character window or line range, PDF pages, DOCX blocks, images.

Text comes in windows of `READ_WINDOW_CHARS` characters from `offset` (seed 001), with
`nextOffset` when there is more; or by line range (`startLine` / `endLine`, 1-based and
inclusive) as `cat -n` numbered lines, within the same character budget. Flue's
`offset`/`limit` in lines is deliberately not offered: `offset` means characters here,
in every toolset, so one name never means two things. PDFs are read by `page` /
`pageEnd` or `block` (pdf.py: reading order, blocks), DOCX files by `block` or `heading`
(documents.py); their text is windowed by `offset` too. `includeImages` adds rendered pages,
DOCX pictures and a note's images (document_images.py); a Markdown note's result lists its
image references (markdown_images.py). Images come back as image blocks. Binary files get a
short descriptor.

Every file tool shares the path rules defined here (`resolve`, `escapes`, `external_refusal`,
`problem`): paths go through the machine's files (`file_ops`: the descriptor view of a machine
with host files, the `Machine` protocol otherwise); a path whose links lead out of the
workspace root is reported as such (host files only: through the protocol paths are lexical);
a read outside the root asks first
(Action.READ_EXTERNAL); failures become messages a model can act on. A successful read
records the file's fingerprint in `ctx.reads` (the stale-write check of `write`), keyed by
the inside path of the file itself (links followed), taken *before* reading so a change in
between makes a later overwrite fail rather than pass.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import os
import posixpath
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from agentbox.machines.base import FileStat, Machine
from agentbox.machines.errors import MachineError, PathEscape
from agentbox.store.file_ids import FILE_ID_CHARS
from agentbox.tools.base import (
    Action,
    ImageBlock,
    Operation,
    TextBlock,
    Tool,
    ToolContext,
    ToolParams,
    ToolResult,
    shown_file_ids,
)
from agentbox.tools.document_images import (
    MAX_ATTACHED_IMAGES,
    Attached,
    IncludeImages,
    attach,
    pages_to_render,
)
from agentbox.tools.documents import (
    DOCUMENT_EXTENSIONS,
    IMAGE_EXTENSIONS,
    MAX_DOCUMENT_BYTES,
    MAX_IMAGE_BYTES,
    PDF_MAGIC,
    DocumentError,
    binary_kind,
    block_at,
    docx_blocks,
    docx_images,
    heading_section,
    image_type,
    is_svg,
    render_blocks,
)
from agentbox.tools.fingerprint import fingerprint
from agentbox.tools.markdown_images import image_refs
from agentbox.tools.pdf import MAX_RENDERED_PAGES, page_range, read_pdf, render_pages, render_text
from agentbox.workspace.editor import display_lines, numbered
from agentbox.workspace.errors import WorkspaceError, translate
from agentbox.workspace.fileops import Resolved, file_ops

#: Characters one read returns (seed 001: 6000 characters by default, continued by nextOffset).
READ_WINDOW_CHARS = 6000
#: Largest text file `read` decodes; past it, grep or `sed -n` in bash reach the part needed.
MAX_TEXT_BYTES = 16 * 1024 * 1024
#: Leading bytes examined to tell text from images, documents and binaries.
SNIFF_BYTES = 8192

FileKind = Literal["text", "pdf", "docx", "image", "svg", "binary"]
#: Text files whose image references (`![alt](src)`) a read reports.
MARKDOWN_EXTENSIONS = (".md", ".markdown")

# --- path rules shared by the file tools -------------------------------------------------


def resolve(machine: Machine, path: str, *, write: bool = False, follow: bool = True) -> Resolved:
    """Resolve `path` the machine's way (`file_ops`); raises what the machine's files raise."""
    return file_ops(machine).resolve(path, write=write, follow=follow)


def located(ctx: ToolContext, path: str, *, write: bool = False, follow: bool = True) -> Resolved:
    """`path` as the model means it: a relative path from the session's first knowledge base
    (the workspace root unless it selected others), resolved the machine's way."""
    return resolve(ctx.machine, ctx.scope.absolute(path), write=write, follow=follow)


async def stat_of(machine: Machine, inside: str) -> FileStat:
    """What `inside` leads to (links followed); FileNotFoundError when nothing is there."""
    st = await file_ops(machine).lstat(inside, follow=True)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), inside)
    return st


async def is_dir(machine: Machine, inside: str) -> bool:
    st = await file_ops(machine).lstat(inside, follow=True)
    return st is not None and st.is_dir


def within_root(machine: Machine, inside: str) -> bool:
    return file_ops(machine).within_root(inside)


def escapes(machine: Machine, target: Resolved) -> bool:
    """True when a path asked inside the workspace root leads out of it through a link.

    Only host files can tell: through the protocol a path is lexical and `inside` is what was
    asked (the machine follows links itself, with its own rights)."""
    return within_root(machine, target.requested) and not within_root(machine, target.inside)


def escape_message(target: Resolved) -> str:
    return (
        f"{target.requested} leads outside the workspace through a symbolic link (to {target.inside}); "
        "links that escape the workspace are refused"
    )


async def external_refusal(ctx: ToolContext, tool: str, target: Resolved) -> str | None:
    """None when `target` is inside the root or a read outside it is allowed; else why not.

    The resolved path decides, so a link inside the workspace that leads out asks too. Inside
    means inside a knowledge base the session selected (`knowledge_bases.py`): by default the
    workspace root.
    """
    if own(ctx, target):
        return None
    return await ctx.authorize(Action.READ_EXTERNAL, tool, {"path": target.inside})


def own(ctx: ToolContext, target: Resolved) -> bool:
    """Whether `target` leads to the session's own files (a selected knowledge base)."""
    return within_root(ctx.machine, target.inside) and ctx.scope.contains(target.inside)


def problem(exc: BaseException, path: str) -> str:
    """A failure of a file tool as a sentence naming the path, for the model."""
    if isinstance(exc, FileNotFoundError):
        return f"{path} does not exist (or one of its parent folders does not)."
    if isinstance(exc, IsADirectoryError):
        return f"{path} is a folder, not a file."
    if isinstance(exc, NotADirectoryError):
        return f"A parent of {path} is a file, not a folder."
    if isinstance(exc, PermissionError):
        return f"Permission denied: {path}."
    if isinstance(exc, PathEscape):
        return f"{path} is outside what this machine exposes: {exc.message}."
    if isinstance(exc, DocumentError):
        return f"Cannot read {path}: {exc}."
    if isinstance(exc, WorkspaceError) and exc.error_type == "not_found":
        return f"{path} does not exist (or one of its parent folders does not)."
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"{path} is on a read-only part of the machine."
    error = translate(exc, "read", path)
    return f"{path}: {error.message}"


#: What a file tool catches and reports with `problem`; anything else is a bug and propagates.
FAILURES = (OSError, MachineError, WorkspaceError, DocumentError, UnicodeError)


async def remember(ctx: ToolContext, op: Operation) -> None:
    """After a commit: a file that now holds exactly the text the model wrote counts as read.

    True when the change was applied (not when it waits in a change set), so writing a file
    again after writing or editing it passes the stale-write check without another read.
    """
    if op.after is None:
        return
    data = op.after.encode("utf-8")
    try:
        st = await stat_of(ctx.machine, op.path)
        if st.is_file and st.size == len(data) and await read_capped(ctx.machine, op.path, len(data)) == data:
            ctx.reads[op.path] = await fingerprint(ctx.machine, op.path)
    except FAILURES:
        return


async def read_capped(machine: Machine, inside: str, limit: int) -> bytes:
    """All bytes of a regular file, at most `limit` (EFBIG past it); on host files opened by
    descriptor, never through a swapped-in link."""
    return bytes(await file_ops(machine).read_bytes(inside, limit))


async def sniff(machine: Machine, inside: str) -> bytes:
    return await file_ops(machine).read_head(inside, SNIFF_BYTES)


# --- parameters ----------------------------------------------------------------------------


class ReadParams(ToolParams):
    path: str | None = Field(
        default=None,
        description=(
            "File to read: relative to the first knowledge base's root (the workspace root by default), "
            "or absolute. Or give fileId instead."
        ),
    )
    fileId: str | None = Field(
        default=None,
        max_length=FILE_ID_CHARS,
        description="A file id that list or search gave (file_...), instead of path.",
    )
    offset: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Character offset to start at (0 = start). A read returns at most 6000 characters; "
            "when there is more, pass the `nextOffset` it gives (with the same page/block/heading)."
        ),
    )
    startLine: int | None = Field(
        default=None,
        ge=1,
        description="Text files: first line to show (1-based), with line numbers. Not with offset.",
    )
    endLine: int | None = Field(
        default=None,
        ge=1,
        description="Text files: last line to show (inclusive); defaults to as many as fit.",
    )
    page: int | None = Field(
        default=None, ge=1, description="PDF: the page to read (1-based), or the first of a range."
    )
    pageEnd: int | None = Field(default=None, ge=1, description="PDF: the last page of a range (inclusive).")
    block: int | None = Field(
        default=None,
        ge=1,
        description="DOCX or PDF: one block (a paragraph, heading or table) by the number a read shows (1-based).",
    )
    heading: str | None = Field(
        default=None,
        description="DOCX: read the section under this heading, up to the next heading of its level.",
    )
    includeImages: IncludeImages = Field(
        default="auto",
        description=(
            "Images to attach: 'auto' renders PDF pages without a text layer, or the pages chosen by "
            "page/block; 'always' renders the PDF pages read (at most 4) and attaches a DOCX's pictures or a "
            "Markdown note's local images (at most 4), even with text; 'none' attaches nothing."
        ),
    )


class ReadImageParams(ToolParams):
    path: str | None = Field(
        default=None, description="Image to view (png, jpg, jpeg, webp or gif), inside the workspace."
    )
    fileId: str | None = Field(
        default=None, max_length=FILE_ID_CHARS, description="Or the image's file id, as list gave it (file_...)."
    )


# --- what kind of file -----------------------------------------------------------------------


def classify(name: str, head: bytes) -> FileKind:
    ext = posixpath.splitext(name)[1].lower()
    if image_type(head) is not None:
        return "image"
    if is_svg(name, head):
        return "svg"
    if ext in IMAGE_EXTENSIONS:
        return "image"  # a name that promises an image; read_image_file says the bytes are not one
    if head.startswith(PDF_MAGIC) or ext == ".pdf":
        return "pdf"
    if ext == ".docx":
        return "docx"
    if binary_kind(head) is not None:
        return "binary"
    return "text"


SIZE_LIMITS: dict[FileKind, int] = {
    "text": MAX_TEXT_BYTES,
    "pdf": MAX_DOCUMENT_BYTES,
    "docx": MAX_DOCUMENT_BYTES,
    "image": MAX_IMAGE_BYTES,
}
KIND_NAMES: dict[FileKind, str] = {"text": "text file", "pdf": "PDF", "docx": "DOCX file", "image": "image"}
TOO_LARGE_HINTS: dict[FileKind, str] = {
    "text": "use grep to find what you need, or bash (`sed -n '100,200p' FILE`, `head -c`) to read a part",
    "pdf": "split it with bash (e.g. `pdfseparate` or `qpdf --pages`) and read the parts",
    "docx": "convert it with bash (e.g. `pandoc FILE -t plain`) and read the text in parts",
    "image": "make a smaller copy with bash (e.g. ImageMagick `convert -resize`) and read that",
}


# --- windows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Characters `start`..`end` of a text of `total` characters."""

    text: str
    start: int
    end: int
    total: int

    @property
    def next_offset(self) -> int | None:
        return self.end if self.end < self.total else None

    def trailer(self, again: str = "") -> str:
        if self.next_offset is None:
            return f"\n\n[Showing characters {self.start}-{self.end} of {self.total}.]" if self.start else ""
        return (
            f"\n\n[Showing characters {self.start}-{self.end} of {self.total}. "
            f"Use offset={self.end}{again} to continue.]"
        )


def window(text: str, offset: int | None) -> Window:
    start = offset or 0
    if start > len(text) or (start == len(text) and start > 0):
        raise DocumentError(f"offset {start} is past the end: the text has {len(text)} characters")
    end = min(start + READ_WINDOW_CHARS, len(text))
    return Window(text[start:end], start, end, len(text))


def decode(data: bytes) -> tuple[str, str]:
    """The text (without a BOM) and a note when bytes were not UTF-8."""
    try:
        text, note = data.decode("utf-8"), ""
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        note = "[Note: the file is not valid UTF-8; undecodable bytes are shown as \ufffd.]\n"
    return text.removeprefix("\ufeff"), note


def line_starts(text: str) -> list[int]:
    starts, at = [0], 0
    while (nl := text.find("\n", at)) != -1:
        at = nl + 1
        starts.append(at)
    return starts


def lines_view(text: str, start_line: int, end_line: int | None, shown: str) -> ToolResult:
    """`cat -n` lines from `start_line`, as many as fit READ_WINDOW_CHARS (at least one)."""
    lines = display_lines(text)
    total = len(lines)
    if total == 0:
        return ToolResult.text(f"{shown} is empty.", path=shown, totalLines=0)
    if start_line > total:
        return ToolResult.error(f"startLine {start_line} is past the end of {shown}: it has {total} lines.")
    if end_line is not None and end_line < start_line:
        return ToolResult.error(f"endLine {end_line} is before startLine {start_line}.")
    last = min(end_line or total, total)
    picked: list[str] = []
    used = 0
    for line in lines[start_line - 1 : last]:
        if picked and used + len(line) + 1 > READ_WINDOW_CHARS:
            break
        picked.append(line)
        used += len(line) + 1
    note = ""
    if len(picked[0]) > READ_WINDOW_CHARS:
        offset = line_starts(text)[start_line - 1] + READ_WINDOW_CHARS
        picked[0] = picked[0][:READ_WINDOW_CHARS]
        note = (
            f"\n[Line {start_line} is longer than {READ_WINDOW_CHARS} characters; only its start is shown. "
            f"Read the rest by characters with offset={offset}.]"
        )
    shown_last = start_line + len(picked) - 1
    more = f" Use startLine={shown_last + 1} to continue." if shown_last < total else ""
    body = (
        numbered(picked, start_line)
        + note
        + f"\n\n[Showing lines {start_line}-{shown_last} of {total}.{more}]"
    )
    next_line = shown_last + 1 if shown_last < total else None
    return ToolResult.text(
        body, path=shown, startLine=start_line, endLine=shown_last, totalLines=total, nextStartLine=next_line
    )


# --- the readers -------------------------------------------------------------------------------


def read_text(data: bytes, p: ReadParams, shown: str) -> ToolResult:
    if p.page is not None or p.pageEnd is not None or p.block is not None or p.heading is not None:
        return ToolResult.error(
            f"page/pageEnd are for PDF files, block for PDF and DOCX files, heading for DOCX files; {shown} is text."
        )
    text, note = decode(data)
    if p.startLine is not None or p.endLine is not None:
        if p.offset is not None:
            return ToolResult.error("Use either offset (characters) or startLine/endLine (lines), not both.")
        result = lines_view(text, p.startLine or 1, p.endLine, shown)
        if note and not result.is_error:
            result.content.insert(0, TextBlock(note.rstrip("\n")))
        return result
    if not text:
        return ToolResult.text(f"{shown} is empty.", path=shown, totalChars=0)
    w = window(text, p.offset)
    return ToolResult.text(
        note + w.text + w.trailer(), path=shown, offset=w.start, nextOffset=w.next_offset, totalChars=w.total
    )


def read_pdf_file(data: bytes, p: ReadParams, shown: str) -> ToolResult:
    if p.heading is not None or p.startLine is not None or p.endLine is not None:
        return ToolResult.error(
            f"{shown} is a PDF: read it by page (page, or page and pageEnd) or block, with offset."
        )
    if p.block is not None and (p.page is not None or p.pageEnd is not None):
        return ToolResult.error("Use either page/pageEnd or block, not both.")
    doc = read_pdf(data)
    count = len(doc.pages)
    if p.block is not None:
        block = block_at(doc.blocks, p.block)
        first = last = block.page or 1
        body = f"[page {first}]\n[block {block.number}] {block.text}"
        chosen = [block]
        which, again = f"block {block.number} (page {first})", f", block={block.number}"
    else:
        first, last = page_range(count, p.page, p.pageEnd)
        body = render_text(doc.pages[first - 1 : last])
        chosen = [b for page in doc.pages[first - 1 : last] for b in page.blocks]
        which = f"page {first}" if first == last else f"pages {first}-{last}"
        again = "".join(f", {k}={v}" for k, v in (("page", p.page), ("pageEnd", p.pageEnd)) if v is not None)
    w = window(body, p.offset)
    warned = "".join(f"[Warning: {warning}]\n" for warning in doc.warnings)
    header = f"{shown}: PDF with {count} page(s) and {len(doc.blocks)} block(s); {which}.\n{warned}\n"
    result = ToolResult.text(
        header + w.text + w.trailer(again),
        path=shown,
        pageCount=count,
        pages=[first, last],
        blockCount=len(doc.blocks),
        blocks=[chosen[0].number, chosen[-1].number] if chosen else [],
        offset=w.start,
        nextOffset=w.next_offset,
        totalChars=w.total,
        warnings=doc.warnings,
    )
    numbers = pages_to_render(
        p.includeImages,
        doc.pages[first - 1 : last],
        chosen=p.page is not None or p.block is not None,
        first_window=not p.offset,
    )
    if not numbers:
        return result
    try:
        rendered = render_pages(data, numbers[:MAX_RENDERED_PAGES])
    except DocumentError as exc:  # the text stands without its images
        result.data["warnings"] = [*doc.warnings, str(exc)]
        result.content.append(TextBlock(f"[Warning: {exc}.]"))
        return result
    images = [Attached(f"page {r.page} of {shown}", "image/png", r.png, r.page) for r in rendered]
    return attach(result, images, len(numbers), MAX_RENDERED_PAGES)


def read_docx(data: bytes, p: ReadParams, shown: str) -> ToolResult:
    if p.page is not None or p.pageEnd is not None or p.startLine is not None or p.endLine is not None:
        return ToolResult.error(f"{shown} is a DOCX file: read it by block or heading, with offset.")
    if p.block is not None and p.heading is not None:
        return ToolResult.error("Use either block or heading, not both.")
    blocks = docx_blocks(data)
    if p.block is not None:
        chosen = [block_at(blocks, p.block)]
        which, again = f"block {p.block}", f", block={p.block}"
    elif p.heading is not None:
        chosen = heading_section(blocks, p.heading)
        which = f"section {chosen[0].text!r}, blocks {chosen[0].number}-{chosen[-1].number}"
        again = f", heading={p.heading!r}"
    else:
        chosen, which, again = blocks, "all blocks", ""
    body = render_blocks(chosen) or "[the document has no text]"
    w = window(body, p.offset)
    header = f"{shown}: DOCX with {len(blocks)} block(s); {which}.\n\n"
    result = ToolResult.text(
        header + w.text + w.trailer(again),
        path=shown,
        blockCount=len(blocks),
        blocks=[chosen[0].number, chosen[-1].number] if chosen else [],
        offset=w.start,
        nextOffset=w.next_offset,
        totalChars=w.total,
    )
    if p.includeImages == "always" or (p.includeImages == "auto" and not blocks and not p.offset):
        pictures = docx_images(data)
        images = [Attached(pic.caption, pic.media_type, pic.data) for pic in pictures[:MAX_ATTACHED_IMAGES]]
        return attach(result, images, len(pictures), MAX_ATTACHED_IMAGES)
    return result


def read_image_file(data: bytes, shown: str) -> ToolResult:
    media = image_type(data[:SNIFF_BYTES])
    if media is None:
        return ToolResult.error(
            f"{shown} is named like an image but its bytes are not a PNG, JPEG, GIF or WebP image."
        )
    return ToolResult(
        [
            TextBlock(f"Image {shown} ({media}, {len(data)} bytes)."),
            ImageBlock(media, base64.b64encode(data).decode()),
        ],
        data={"path": shown, "mediaType": media, "bytes": len(data)},
    )


def refusal_for(kind: FileKind, shown: str, size: int, head: bytes) -> str | None:
    """Why a file of `kind` cannot be read at all (before its bytes are loaded), else None."""
    if kind == "svg":
        return (
            f"{shown} is an SVG: a vector image cannot be rasterized for viewing here, so it is refused. "
            "To see it, convert it to PNG with bash (e.g. `rsvg-convert` or ImageMagick) and read the PNG."
        )
    if kind == "binary":
        return (
            f"{shown} is a binary file ({binary_kind(head)}, {size} bytes); read returns text, PDF, DOCX "
            "and images only. Inspect it with bash (e.g. `file`, `xxd | head`, `unzip -l`)."
        )
    limit = SIZE_LIMITS[kind]
    if size > limit:
        return (
            f"{shown} is {size} bytes; the largest {KIND_NAMES[kind]} read accepts is {limit} bytes: "
            f"{TOO_LARGE_HINTS[kind]}."
        )
    return None


async def load(
    ctx: ToolContext, target: Resolved, kind: FileKind, p: ReadParams, *, note_refs: bool
) -> ToolResult:
    """Read one file and render it (parsing runs in a thread). A Markdown note of a knowledge
    base (`note_refs`) also lists its images; one outside them is text only."""
    data = await read_capped(ctx.machine, target.inside, SIZE_LIMITS[kind])
    result = await asyncio.to_thread(render, data, kind, p, target.requested)
    if (
        note_refs
        and kind == "text"
        and not result.is_error
        and posixpath.splitext(target.inside)[1].lower() in MARKDOWN_EXTENSIONS
    ):
        await with_image_refs(ctx, target.inside, decode(data)[0], p.includeImages, result)
    return result


async def with_image_refs(
    ctx: ToolContext, note: str, text: str, mode: IncludeImages, result: ToolResult
) -> ToolResult:
    """A note's read with its `imageRefs` (and, for `always`, its local images attached), each
    relative to the note's knowledge base and with its file id when it exists."""
    machine = ctx.machine
    holder = ctx.scope.holder(note)
    refs, total = await image_refs(machine, note, text, holder.root if holder else machine.root)
    if not refs:
        return result
    ids = await shown_file_ids(ctx, [r.inside for r in refs if r.exists and r.inside])
    refs = [dataclasses.replace(r, file_id=ids.get(r.inside or "")) for r in refs]
    result.data["imageRefs"] = [r.to_dict() for r in refs]
    result.data["imageRefsTotal"] = total
    listed = "; ".join(f"{r.src} ({r.skipped or ('exists' if r.exists else 'missing')})" for r in refs)
    more = f" and {total - len(refs)} more" if total > len(refs) else ""
    result.content.append(TextBlock(f"[Images referenced: {listed}{more}.]"))
    if mode != "always":
        return result
    local = [r for r in refs if r.exists and r.inside is not None]
    images = []
    for ref in local[:MAX_ATTACHED_IMAGES]:
        assert ref.inside is not None
        try:
            data = await read_capped(machine, ref.inside, MAX_IMAGE_BYTES)
        except FAILURES:  # too large, gone since, unreadable: the note's text stands without it
            continue
        media = image_type(data[:SNIFF_BYTES])
        if media is not None:
            images.append(Attached(ref.alt or str(ref.path), media, data))
    return attach(result, images, len(local), MAX_ATTACHED_IMAGES)


def render(data: bytes, kind: FileKind, p: ReadParams, shown: str) -> ToolResult:
    if kind == "image":
        return read_image_file(data, shown)
    if kind == "pdf":
        return read_pdf_file(data, p, shown)
    if kind == "docx":
        return read_docx(data, p, shown)
    return read_text(data, p, shown)


async def named(ctx: ToolContext, p: ReadParams) -> str | ToolResult:
    """The path a read means: `path`, or the one `fileId` names (exactly one of them)."""
    if (p.path is None) == (p.fileId is None):
        return ToolResult.error("read takes a path or a fileId (one of them).")
    if p.path is not None:
        return p.path
    assert p.fileId is not None
    path = await ctx.file_ids.path_of(ctx.session_id, p.fileId) if ctx.file_ids is not None else None
    if path is None:
        return ToolResult.error(
            f"fileId {p.fileId!r} names no file this session was shown; use list or search to get one."
        )
    return path


async def read_any(ctx: ToolContext, p: ReadParams, tool: str, *, images_only: bool) -> ToolResult:
    path = await named(ctx, p)
    if isinstance(path, ToolResult):
        return path
    try:
        target = located(ctx, path)
        outside = not own(ctx, target)
        ext = posixpath.splitext(target.name)[1].lower()
        if outside and (images_only or ext in IMAGE_EXTENSIONS):
            return ToolResult.error(images_outside(target))
        if outside and p.fileId is None and ext in DOCUMENT_EXTENSIONS:
            return ToolResult.error(documents_outside(target))
        refusal = await external_refusal(ctx, tool, target)  # before anything about the file is told
        if refusal is not None:
            return ToolResult.error(refusal)
        st = await stat_of(ctx.machine, target.inside)
        if st.is_dir:
            return ToolResult.error(f"{target.requested} is a folder; use list to see what it holds.")
        head = await sniff(ctx.machine, target.inside)
        kind = classify(target.name, head)
        if outside and kind == "image":
            return ToolResult.error(images_outside(target))
        if outside and p.fileId is None and kind in ("pdf", "docx"):
            return ToolResult.error(documents_outside(target))
        if images_only and kind not in ("image", "svg"):
            return ToolResult.error(
                f"{target.requested} is not an image (png, jpg, jpeg, webp or gif); use read for text, PDF and DOCX."
            )
        reason = refusal_for(kind, target.requested, st.size, head)
        if reason is not None:
            return ToolResult.error(reason)
        seen = await fingerprint(ctx.machine, target.inside)
        result = await load(ctx, target, kind, p, note_refs=not outside)
    except FAILURES as exc:
        return ToolResult.error(problem(exc, path))
    if not result.is_error:
        ctx.reads[target.inside] = seen
    return result


def images_outside(target: Resolved) -> str:
    return (
        f"{target.requested} is outside the session's knowledge bases; images are read only from inside them, "
        "because their pixels leave this machine for the model service. Copy it into the workspace first if "
        "the user agrees."
    )


def documents_outside(target: Resolved) -> str:
    return (
        f"{target.requested} is a document outside the session's knowledge bases, which are the only ones "
        "read by path; list its folder and read it by the fileId list gives."
    )


async def run_read(ctx: ToolContext, params: ReadParams) -> ToolResult:
    return await read_any(ctx, params, "read", images_only=False)


async def run_read_image(ctx: ToolContext, params: ReadImageParams) -> ToolResult:
    return await read_any(
        ctx, ReadParams(path=params.path, fileId=params.fileId), "read_image", images_only=True
    )


READ = Tool(
    name="read",
    description=(
        "Read a file. Text comes in windows of 6000 characters from `offset` (default 0); when there is "
        "more, the result ends with a note and gives `nextOffset`: call read again with offset=nextOffset. "
        "Or read lines `startLine`..`endLine` (1-based, inclusive), shown with line numbers; the note then "
        "says which startLine continues. PDFs: `page`, or `page` and `pageEnd` for a range, or `block` "
        "(a numbered paragraph); the text is in reading order (two columns: left, then right), with "
        "page and block numbers, and a warning when the order could not be rebuilt. DOCX: `block` (a "
        "numbered paragraph, heading or table) or `heading` (that heading's section); without them the "
        "whole document, with block numbers. `includeImages`: 'auto' (default) also returns PDF pages "
        "without a text layer, or the pages chosen by page/block, as images; 'always' returns the PDF "
        "pages read (at most 4), a DOCX's pictures or a Markdown note's local images (at most 4); "
        "'none' returns no images. A Markdown note's result lists its image references (imageRefs). "
        "Images (png, jpg, jpeg, webp, gif; up to 20 MB, inside the workspace) are returned as images. "
        "SVG and other binary files are refused with a short description. Relative paths start at the "
        "workspace root; reading outside it may need the user's approval."
    ),
    params=ReadParams,
    action=Action.READ,
    run=run_read,
)

READ_IMAGE = Tool(
    name="read_image",
    description=(
        "View an image file from the workspace (png, jpg, jpeg, webp or gif, up to 20 MB): it is returned as "
        "an image for you to look at (no OCR). SVG is refused (convert it to PNG with bash first); other "
        "files are refused: use read for text, PDF and DOCX."
    ),
    params=ReadImageParams,
    action=Action.READ,
    run=run_read_image,
)

TOOLS: dict[str, Tool] = {"read": READ, "read_image": READ_IMAGE}
