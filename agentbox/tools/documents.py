"""What `read` makes of files that are not plain text: DOCX blocks, images, binaries (PDFs: pdf.py).

Pure functions over bytes, so the knowledge search can cite the same block numbers `read`
accepts: `docx_blocks` (and `pdf.read_pdf` for PDFs) is the one definition of them.

- DOCX (python-docx): the body's paragraphs and tables in document order, numbered from 1
  as structural blocks. Empty paragraphs and tables are not blocks (they carry no content and
  would shift numbers whenever someone adds a blank line or an empty grid). A heading's section runs from the
  heading to the next heading of the same or a higher level (seed 001).
- Images: recognised by their bytes, not their name (a `.png` that is not a PNG is refused).
  SVG is refused: it is a vector format that cannot be handed to a vision model as pixels.
- Anything else that is not text gets a short descriptor instead of its bytes.

Every failure a model can act on is a `DocumentError` whose message says what to do.
"""

from __future__ import annotations

import io
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Literal

import docx
from docx.table import Table
from docx.text.paragraph import Paragraph

#: Largest PDF or DOCX `read` parses; every read parses the whole file again.
MAX_DOCUMENT_BYTES = 32 * 1024 * 1024
#: Largest image `read` / `read_image` hands to the model (seed 001: "over 20 MB refused").
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Headings named in the error for a `heading` that matches none.
MAX_LISTED_HEADINGS = 30
#: Style inheritance steps followed to find a heading level (custom styles based on "Heading 2").
MAX_STYLE_DEPTH = 8

#: Media types by file extension, for the names seed 001 lists.
#: Documents read by page or block (`read`), whose path must be a knowledge base's (else a file id).
DOCUMENT_EXTENSIONS = (".pdf", ".docx")
IMAGE_EXTENSIONS: dict[str, str] = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
}
PDF_MAGIC = b"%PDF-"
#: Leading bytes of common binary formats, for the descriptor of a refused binary file.
BINARY_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x7fELF", "ELF executable or library"),
    (b"PK\x03\x04", "zip archive (also docx/xlsx/pptx/jar)"),
    (b"\x1f\x8b", "gzip archive"),
    (b"BZh", "bzip2 archive"),
    (b"\xfd7zXZ\x00", "xz archive"),
    (b"7z\xbc\xaf\x27\x1c", "7z archive"),
    (b"SQLite format 3\x00", "SQLite database"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "legacy Office document (doc/xls/ppt)"),
    (b"\x00asm", "WebAssembly module"),
    (b"\xca\xfe\xba\xbe", "Java class or Mach-O fat binary"),
    (b"MZ", "Windows executable"),
    (b"ID3", "MP3 audio"),
    (b"OggS", "Ogg media"),
    (b"fLaC", "FLAC audio"),
    (b"\x1aE\xdf\xa3", "Matroska/WebM video"),
    (b"BM", "BMP image"),
    (b"II*\x00", "TIFF image"),
    (b"MM\x00*", "TIFF image"),
    (b"\x00\x00\x01\x00", "ICO image"),
)
SVG_START = re.compile(
    rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*(<!DOCTYPE svg[^>]*>\s*)?<svg[\s>]", re.S | re.I
)


class DocumentError(Exception):
    """A document or image that cannot be read as asked; the message is for the model."""


# --- images and binaries ---------------------------------------------------------------


def image_type(head: bytes) -> str | None:
    """The media type of a png / jpeg / gif / webp by its leading bytes, else None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def is_svg(name: str, head: bytes) -> bool:
    return posixpath.splitext(name)[1].lower() in (".svg", ".svgz") or bool(SVG_START.match(head))


def binary_kind(head: bytes) -> str | None:
    """What a binary file looks like (for the refusal), or None when it looks like text."""
    for magic, kind in BINARY_MAGIC:
        if head.startswith(magic):
            return kind
    if b"\x00" in head:
        return "binary data"
    return None


# --- DOCX ------------------------------------------------------------------------------

BlockKind = Literal["heading", "paragraph", "table"]


@dataclass(frozen=True)
class Block:
    """One structural block of a DOCX body or a PDF. `level` is set for headings (0 = Title);
    `page` for a PDF's blocks."""

    number: int
    kind: BlockKind
    text: str
    level: int | None = None
    page: int | None = None


@dataclass(frozen=True)
class DocxBody:
    """A DOCX file's blocks and its core properties' keywords (the knowledge index's tags)."""

    blocks: list[Block]
    keywords: str | None


def read_docx(data: bytes) -> DocxBody:
    """The body's non-empty paragraphs and tables, numbered from 1 in document order."""
    try:
        document = docx.Document(io.BytesIO(data))
        items = list(document.iter_inner_content())
        keywords = document.core_properties.keywords or None
    except Exception as exc:  # untrusted bytes: BadZipFile, KeyError, ValueError, lxml errors, ...
        raise DocumentError(f"the file is not a readable DOCX ({type(exc).__name__}: {exc})") from exc
    blocks: list[Block] = []
    for item in items:
        block = to_block(item, len(blocks) + 1)
        if block is not None:
            blocks.append(block)
    return DocxBody(blocks, keywords)


@dataclass(frozen=True)
class EmbeddedImage:
    """A picture in a DOCX body: its bytes, media type and caption (alt text, else part name)."""

    caption: str
    media_type: str
    data: bytes


def docx_images(data: bytes) -> list[EmbeddedImage]:
    """The body's pictures in the order they first appear; formats a vision model cannot take
    (EMF, WMF, TIFF, ...) are left out."""
    try:
        document = docx.Document(io.BytesIO(data))
        parts = document.part.related_parts
        images: list[EmbeddedImage] = []
        seen: set[str] = set()
        for drawing in document.element.body.xpath(".//w:drawing"):
            alt = " ".join(str(d) for d in drawing.xpath(".//wp:docPr/@descr")).strip()
            for rid in drawing.xpath(".//a:blip/@r:embed"):
                part = parts.get(str(rid))
                if part is None or str(rid) in seen:
                    continue
                seen.add(str(rid))
                blob = bytes(part.blob)
                media = image_type(blob[:16])
                if media is not None:
                    images.append(EmbeddedImage(alt or posixpath.basename(str(part.partname)), media, blob))
    except Exception as exc:  # untrusted bytes
        raise DocumentError(f"the file is not a readable DOCX ({type(exc).__name__}: {exc})") from exc
    return images


def docx_blocks(data: bytes) -> list[Block]:
    """`read_docx`'s blocks: the numbers `read block=N` takes and the knowledge index cites."""
    return read_docx(data).blocks


def table_text(table: Table) -> str:
    """A row per line, its cells joined by ` | ` (a merged cell once, empty cells kept so the
    columns line up); empty rows left out."""
    rows = []
    for row in table.rows:
        cells = list({id(cell._tc): cell for cell in row.cells}.values())  # a merged cell repeats
        texts = [cell.text.strip() for cell in cells]
        if any(texts):
            rows.append(" | ".join(texts))
    return "\n".join(rows)


def to_block(item: Paragraph | Table, number: int) -> Block | None:
    if isinstance(item, Table):
        text = table_text(item)
        return Block(number, "table", text) if text else None
    text = item.text.strip()
    if not text:
        return None
    level = heading_level(item)
    return Block(number, "heading" if level is not None else "paragraph", text, level)


def heading_level(paragraph: Paragraph) -> int | None:
    """0 for "Title", N for "Heading N" (or a style based on it), None for body text."""
    style: Any = paragraph.style
    for _ in range(MAX_STYLE_DEPTH):
        if style is None:
            return None
        name = str(style.name or "")
        if name == "Title":
            return 0
        match = re.fullmatch(r"Heading (\d)", name)
        if match:
            return int(match.group(1))
        style = style.base_style
    return None


def block_at(blocks: list[Block], number: int) -> Block:
    if not blocks:
        raise DocumentError("the document has no text blocks")
    if not 1 <= number <= len(blocks):
        raise DocumentError(
            f"block {number} is out of range: the document has {len(blocks)} block(s), 1-{len(blocks)}"
        )
    return blocks[number - 1]


def normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def heading_section(blocks: list[Block], heading: str) -> list[Block]:
    """The heading whose text is `heading` (else the one containing it) and its body.

    The section ends before the next heading of the same or a higher level.
    """
    headings = [b for b in blocks if b.kind == "heading"]
    wanted = normal(heading)
    found = [b for b in headings if normal(b.text) == wanted] or [
        b for b in headings if wanted in normal(b.text)
    ]
    if not headings:
        raise DocumentError("the document has no headings; read it by block instead")
    if not found:
        names = "; ".join(f"{b.text!r} (block {b.number})" for b in headings[:MAX_LISTED_HEADINGS])
        more = (
            f" and {len(headings) - MAX_LISTED_HEADINGS} more" if len(headings) > MAX_LISTED_HEADINGS else ""
        )
        raise DocumentError(f"no heading matches {heading!r}. Headings: {names}{more}")
    if len({normal(b.text) for b in found}) > 1:
        names = "; ".join(f"{b.text!r} (block {b.number})" for b in found[:MAX_LISTED_HEADINGS])
        raise DocumentError(f"{heading!r} matches several headings: {names}. Give the full heading text.")
    start = found[0]
    assert start.level is not None
    end = next(
        (b.number for b in blocks[start.number :] if b.kind == "heading" and (b.level or 0) <= start.level),
        len(blocks) + 1,
    )
    return blocks[start.number - 1 : end - 1]


def render_blocks(blocks: list[Block]) -> str:
    parts = []
    for b in blocks:
        if b.kind == "heading":
            label = "title" if b.level == 0 else f"heading {b.level}"
            parts.append(f"[block {b.number}, {label}] {b.text}")
        elif b.kind == "table":
            parts.append(f"[block {b.number}, table]\n{b.text}")
        else:
            parts.append(f"[block {b.number}] {b.text}")
    return "\n\n".join(parts)
