"""A PDF's text by page and block, in reading order, and its pages rendered as images.

`read_pdf` is the one definition of a PDF's pages and blocks: `read` shows them (and takes
`page` / `block=N`) and the knowledge index cites them, so a citation always leads back to
what `read` shows.

Reading order: the text of each page is rebuilt from PDFium's character boxes
(`reading_order`), so a two-column page reads the left column, then the right one, whatever
order the file draws them in. PDFium rather than pypdf's `extract_text` visitor: the visitor
reports where each text-showing operator starts, not how wide its glyphs are, and producers
draw anything from a glyph to a whole line per operator, so column edges cannot be told from
it; PDFium gives every character's box, and it is also what renders pages. Rebuilding costs a
call per character, so it is done within a budget (LAYOUT_MAX_BYTES, LAYOUT_MAX_PAGES); past
it, and for a page whose characters mostly have no usable box (under MIN_GLYPH_COVERAGE), the
text is pypdf's, in content-stream order, and the result carries a warning saying so.

Blocks: the paragraphs of every page in reading order, numbered from 1 through the document;
a page read in stream order gives its blank-line separated paragraphs (usually the whole page).
A page without a text layer has no blocks.

PDFium is not thread-safe (not even across documents), and `read` and the knowledge index
parse in worker threads: every PDFium call holds `_PDFIUM`.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pypdf
import pypdfium2
import pypdfium2.raw as pdfium_c

from agentbox.tools.documents import Block, DocumentError
from agentbox.tools.reading_order import Char
from agentbox.tools.reading_order import layout as page_order

#: Largest PDF whose reading order is rebuilt from glyph positions (a call per character).
LAYOUT_MAX_BYTES = 4 * 1024 * 1024
#: Most pages a PDF may have for its reading order to be rebuilt.
LAYOUT_MAX_PAGES = 200
#: "Poor coverage": under this share of a page's visible characters with a usable box (a font
#: without positions PDFium can measure, text drawn off the page), the page keeps stream order.
MIN_GLYPH_COVERAGE = 0.9
#: Pages one read renders as images.
MAX_RENDERED_PAGES = 4
#: Longest side of a rendered page, in pixels: what vision models take without scaling down.
RENDER_MAX_SIDE = 1568
#: Largest rendering scale (2 = 144 dpi): a small page is not blown up past legibility's need.
RENDER_MAX_SCALE = 2.0

_PDFIUM = threading.Lock()
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class PdfPage:
    number: int
    blocks: list[Block]

    @property
    def has_text(self) -> bool:
        return bool(self.blocks)


@dataclass(frozen=True)
class PdfText:
    """A PDF's pages and blocks; `warnings` say where the reading order was not rebuilt."""

    pages: list[PdfPage]
    warnings: list[str]
    keywords: str | None

    @property
    def blocks(self) -> list[Block]:
        return [b for page in self.pages for b in page.blocks]


@dataclass(frozen=True)
class RenderedPage:
    page: int
    png: bytes
    width: int
    height: int


@contextmanager
def pdfium_document(data: bytes) -> Iterator[Any]:
    """A PDFium document over `data`, used and closed under the PDFium lock."""
    with _PDFIUM:
        pdf = pypdfium2.PdfDocument(data)
        try:
            yield pdf
        finally:
            pdf.close()


def open_reader(data: bytes) -> pypdf.PdfReader:
    """pypdf's reader, or a DocumentError a model can act on."""
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError("the PDF is encrypted with a password; it cannot be read")
        len(reader.pages)
    except DocumentError:
        raise
    except Exception as exc:  # untrusted bytes: pypdf fails in many ways (PyPdfError, ValueError, ...)
        raise DocumentError(f"the file is not a readable PDF ({type(exc).__name__}: {exc})") from exc
    return reader


def read_pdf(data: bytes) -> PdfText:
    """Every page's blocks, numbered through the document; an unreadable file is a DocumentError."""
    reader = open_reader(data)
    count = len(reader.pages)
    warnings: list[str] = []
    laid: list[list[str] | None] = [None] * count
    if len(data) > LAYOUT_MAX_BYTES or count > LAYOUT_MAX_PAGES:
        warnings.append(
            f"Reading order not rebuilt: the PDF is {len(data)} bytes with {count} pages, and it is rebuilt "
            f"for files up to {LAYOUT_MAX_BYTES} bytes and {LAYOUT_MAX_PAGES} pages. The text is in the "
            "order the file draws it, which can interleave columns; read a page's image "
            "(includeImages='always') to check."
        )
    else:
        laid = layout(data, count, warnings)
    pages: list[PdfPage] = []
    number = 0
    for index, paragraphs in enumerate(laid):
        texts = paragraphs if paragraphs is not None else stream_paragraphs(reader.pages[index])
        blocks = [Block(number + i, "paragraph", t, page=index + 1) for i, t in enumerate(texts, start=1)]
        number += len(blocks)
        pages.append(PdfPage(index + 1, blocks))
    keywords = reader.metadata.get("/Keywords") if reader.metadata is not None else None
    return PdfText(pages, warnings, str(keywords) if keywords else None)


def layout(data: bytes, count: int, warnings: list[str]) -> list[list[str] | None]:
    """Each page's paragraphs in reading order, None for a page left in stream order (said in
    `warnings`)."""
    try:
        with pdfium_document(data) as pdf:
            if len(pdf) != count:
                raise ValueError(f"PDFium sees {len(pdf)} pages, pypdf {count}")
            laid = [page_layout(pdf[i]) for i in range(count)]
    except Exception as exc:  # untrusted bytes: PDFium refuses what pypdf tolerates, and the reverse
        warnings.append(
            f"Reading order not rebuilt ({type(exc).__name__}: {exc}); the text is in the order the file "
            "draws it, which can interleave columns."
        )
        return [None] * count
    poor = [str(i + 1) for i, p in enumerate(laid) if p is None]
    if poor:
        warnings.append(
            f"Reading order not rebuilt on page(s) {', '.join(poor)}: under {MIN_GLYPH_COVERAGE:.0%} of "
            "their characters have a position, or they hold too many separate pieces of text; "
            "their text is in the order the file draws it."
        )
    return laid


def page_layout(page: Any) -> list[str] | None:
    width, height = page.get_size()
    return page_order(page_chars(page), width, height, MIN_GLYPH_COVERAGE).paragraphs


def page_chars(page: Any) -> Iterator[Char]:
    """The characters PDFium read from the page, in drawing order, with their loose boxes (a
    box per font size, so a line's characters line up; a character without one gets an empty
    box: counted, never placed). Raw calls with one reused rectangle: this runs per character."""
    text = page.get_textpage()
    try:
        raw = text.raw
        rect = pdfium_c.FS_RECTF()
        for i in range(pdfium_c.FPDFText_CountChars(raw)):
            code = pdfium_c.FPDFText_GetUnicode(raw, i)
            if not 0 < code <= 0x10FFFF:
                continue
            if pdfium_c.FPDFText_GetLooseCharBox(raw, i, rect):
                yield chr(code), rect.left, rect.bottom, rect.right, rect.top
            else:
                yield chr(code), 0.0, 0.0, 0.0, 0.0
    finally:
        text.close()


def stream_paragraphs(page: Any) -> list[str]:
    """A page's text in content-stream order (pypdf), cut at blank lines."""
    try:
        text = str(page.extract_text() or "")
    except Exception as exc:  # one broken page must not hide the others
        return [f"[the text of this page could not be extracted: {type(exc).__name__}]"]
    return [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def page_range(count: int, page: int | None, page_end: int | None) -> tuple[int, int]:
    """The pages (first, last; 1-based, inclusive) `page` / `pageEnd` select, or a clear refusal."""
    first = page if page is not None else 1
    last = page_end if page_end is not None else (first if page is not None else count)
    if count == 0:
        raise DocumentError("the PDF has no pages")
    if not 1 <= first <= count:
        raise DocumentError(f"page {first} is out of range: the PDF has {count} page(s), 1-{count}")
    if last < first:
        raise DocumentError(f"pageEnd {last} is before page {first}")
    if last > count:
        raise DocumentError(f"pageEnd {last} is out of range: the PDF has {count} page(s), 1-{count}")
    return first, last


def render_text(pages: list[PdfPage]) -> str:
    """Pages as `[page N]` sections of `[block M]` paragraphs (the numbers `block=M` takes)."""
    parts = []
    for page in pages:
        body = "\n\n".join(f"[block {b.number}] {b.text}" for b in page.blocks)
        parts.append(
            f"[page {page.number}]\n{body or '[no text layer on this page; it may be a scan or a picture]'}"
        )
    return "\n\n".join(parts)


def render_pages(data: bytes, numbers: list[int]) -> list[RenderedPage]:
    """The pages `numbers` (1-based) as PNG images, longest side at most RENDER_MAX_SIDE."""
    rendered = []
    try:
        with pdfium_document(data) as pdf:
            for number in numbers:
                page = pdf[number - 1]
                width, height = page.get_size()
                scale = min(RENDER_MAX_SCALE, RENDER_MAX_SIDE / max(width, height, 1.0))
                image = page.render(scale=scale).to_pil()
                out = io.BytesIO()
                image.save(out, format="PNG")
                rendered.append(RenderedPage(number, out.getvalue(), image.width, image.height))
    except Exception as exc:  # untrusted bytes
        raise DocumentError(f"the PDF's pages could not be rendered ({type(exc).__name__}: {exc})") from exc
    return rendered
