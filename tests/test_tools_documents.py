"""PDF reading order, PDF blocks, `includeImages` and a note's `imageRefs`, through `read`.

PDFs are generated here with fpdf2 at known positions: the two-column page is drawn row by row
across both columns (as many producers do), so its content-stream order interleaves them and
only the rebuilt order reads the left column first. Reads go through the real `read` tool on a
local machine and a bubblewrap sandbox (`host_box` of test_tools_read).
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import docx
import pypdf
import pytest
from fpdf import FPDF
from PIL import Image
from test_tools_read import Box, host_box, local, local_box, make_box, make_png, read, sandbox, text_of

from agentbox.tools.base import ImageBlock
from agentbox.tools.documents import MAX_IMAGE_BYTES, block_at
from agentbox.tools.pdf import (
    LAYOUT_MAX_PAGES,
    MAX_RENDERED_PAGES,
    MIN_GLYPH_COVERAGE,
    RENDER_MAX_SIDE,
    read_pdf,
)
from agentbox.tools.read import ReadParams
from agentbox.tools.reading_order import Char, Layout, layout
from agentbox.tools.runner import validation_problems
from agentbox.tools.toolsets import TOOLSETS, toolset

pytestmark = pytest.mark.asyncio(loop_scope="module")

__all__ = ["host_box", "local", "local_box", "make_box", "sandbox"]  # fixtures used through pytest

LEFT = ["Left one alpha", "left two bravo", "left three charlie"]
RIGHT = ["Right one delta", "right two echo", "right three foxtrot"]


def two_columns() -> bytes:
    """A centred title, two columns drawn row by row (left line, right line, ...), a footer."""
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=18)
    pdf.set_xy(10, 10)
    pdf.cell(190, 10, "A Title Across Both Columns", align="C")
    pdf.set_font("helvetica", size=12)
    for row, (left, right) in enumerate(zip(LEFT, RIGHT, strict=True)):
        pdf.text(10, 30 + row * 6, left)
        pdf.text(110, 30 + row * 6, right)
    pdf.text(10, 80, "Footer spanning the whole page width from the left edge to the right edge")
    return bytes(pdf.output())


def paged(count: int, *, text: bool = True) -> bytes:
    """`count` pages, each saying its number (or, without `text`, only a drawn rectangle)."""
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for n in range(1, count + 1):
        pdf.add_page()
        if text:
            pdf.text(20, 20, f"Page number {n} here.")
        else:
            pdf.rect(20, 20, 100, 60, style="F")
    return bytes(pdf.output())


def images_of(result: object) -> list[ImageBlock]:
    return [b for b in result.content if isinstance(b, ImageBlock)]  # type: ignore[attr-defined]


# --- reading order ------------------------------------------------------------------------------


async def test_stream_order_of_the_fixture_interleaves_the_columns() -> None:
    """The fixture is honest: without the rebuilt order the columns come interleaved."""
    stream = pypdf.PdfReader(io.BytesIO(two_columns())).pages[0].extract_text()
    assert stream.index("Right one delta") < stream.index("left two bravo")


async def test_two_columns_read_left_column_then_right(host_box: Box) -> None:
    host_box.write("cols.pdf", two_columns())
    result = await read(host_box.ctx(), host_box.p("cols.pdf"), includeImages="none")
    body = text_of(result)
    order = ["A Title Across Both Columns", *LEFT, *RIGHT, "Footer spanning"]
    positions = [body.index(text) for text in order]
    assert positions == sorted(positions), body
    assert result.data["warnings"] == [] and "Warning" not in body


async def test_paragraphs_from_character_boxes_at_known_positions() -> None:
    """The order from boxes alone: two columns of two lines each, drawn right column first."""

    def word(text: str, x: float, y: float) -> list[Char]:
        return [(c, x + 6 * i, y, x + 6 * (i + 1), y + 12) for i, c in enumerate(text)]

    chars = word("right", 300, 700) + word("column", 300, 686) + word("left", 50, 700) + word("side", 50, 686)
    assert layout(chars, 595, 842, MIN_GLYPH_COVERAGE).paragraphs == ["left\nside", "right\ncolumn"]
    spaced = [*word("two", 50, 700), *word("words", 50 + 6 * 3 + 3, 700)]  # a gap of a quarter line
    assert layout(spaced, 595, 842, MIN_GLYPH_COVERAGE).paragraphs == ["two words"]


async def test_poor_coverage_is_under_ninety_percent_of_visible_characters_placed() -> None:
    good: list[Char] = [("a", 10.0 + 6 * i, 10.0, 16.0 + 6 * i, 22.0) for i in range(9)]
    flat: Char = ("b", 10, 10, 10, 10)  # no size: cannot be placed
    off: Char = ("c", 900, 10, 906, 22)  # off the page
    at = layout([*good, flat, (" ", 0, 0, 0, 0)], 595, 842, MIN_GLYPH_COVERAGE)  # whitespace does not count
    assert at.coverage == MIN_GLYPH_COVERAGE == 0.9 and at.paragraphs == [
        "aaaaaaaaa"
    ]  # at the floor: rebuilt
    under = layout([*good, flat, off], 595, 842, MIN_GLYPH_COVERAGE)
    assert under.coverage < MIN_GLYPH_COVERAGE and under.paragraphs is None  # stream order instead
    assert layout([], 595, 842, MIN_GLYPH_COVERAGE) == Layout([], 1.0)


async def test_past_the_page_budget_falls_back_to_stream_order_with_a_warning(local: Box) -> None:
    local.write("at.pdf", paged(LAYOUT_MAX_PAGES))
    local.write("over.pdf", paged(LAYOUT_MAX_PAGES + 1))
    at = await read(local.ctx(), local.p("at.pdf"), page=1, includeImages="none")
    assert at.data["warnings"] == [] and "Warning" not in text_of(at)
    over = await read(local.ctx(), local.p("over.pdf"), page=201, includeImages="none")
    [warning] = over.data["warnings"]
    assert f"{LAYOUT_MAX_PAGES + 1} pages" in warning and "order the file draws it" in warning
    assert f"[Warning: {warning}]" in text_of(over)  # the model sees it
    assert "[block 201] Page number 201 here." in text_of(over)  # blocks still numbered


async def test_a_page_with_poor_coverage_keeps_stream_order_with_a_warning(local: Box) -> None:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    pdf.add_page()
    pdf.text(20, 20, "Laid out fine.")
    pdf.add_page()
    pdf.text(20, 20, "On the page.")
    pdf.text(-150, 40, "Drawn off the page, left of its edge.")  # most characters have no place
    local.write("off.pdf", bytes(pdf.output()))
    result = await read(local.ctx(), local.p("off.pdf"), includeImages="none")
    [warning] = result.data["warnings"]
    assert "page(s) 2:" in warning and "under 90%" in warning and f"[Warning: {warning}]" in text_of(result)
    assert "[block 2] On the page.\nDrawn off the page" in text_of(result)  # pypdf's text, kept


# --- blocks ---------------------------------------------------------------------------------------


async def test_block_n_reads_one_pdf_block_with_its_page(host_box: Box) -> None:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for page in (["First para on one.", "Second para on one."], ["Only para on two."]):
        pdf.add_page()
        for y, text in zip((20, 40), page, strict=False):
            pdf.text(20, y, text)
    host_box.write("b.pdf", bytes(pdf.output()))
    whole = await read(host_box.ctx(), host_box.p("b.pdf"))
    assert "[page 2]\n[block 3] Only para on two." in text_of(whole)
    result = await read(host_box.ctx(), host_box.p("b.pdf"), block=2, includeImages="none")
    body = text_of(result)
    assert "[page 1]\n[block 2] Second para on one." in body and "First" not in body and "two." not in body
    assert (result.data["blocks"], result.data["pages"], result.data["blockCount"]) == ([2, 2], [1, 1], 3)
    assert block_at(read_pdf(host_box.h("b.pdf").read_bytes()).blocks, 2).text == "Second para on one."


# --- includeImages ---------------------------------------------------------------------------------


async def test_always_renders_exactly_four_pages_of_six(local: Box) -> None:
    local.write("six.pdf", paged(6))
    result = await read(local.ctx(), local.p("six.pdf"), includeImages="always")
    images = images_of(result)
    assert len(images) == MAX_RENDERED_PAGES == 4
    listed = result.data["documentImages"]
    assert [e["page"] for e in listed] == [1, 2, 3, 4]
    assert [e["id"] for e in listed] == ["image-1", "image-2", "image-3", "image-4"]
    for entry, image in zip(listed, images, strict=True):
        png = base64.b64decode(image.data)
        assert image.media_type == entry["mediaType"] == "image/png" and entry["bytes"] == len(png)
        with Image.open(io.BytesIO(png)) as decoded:
            assert (decoded.width, decoded.height) == (entry["width"], entry["height"])
            assert max(decoded.size) <= RENDER_MAX_SIDE
        assert entry["caption"] == f"page {entry['page']} of {local.p('six.pdf')}"
        assert set(entry) == {"id", "page", "caption", "mediaType", "width", "height", "bytes"}  # no base64
    assert "6 images qualify; the first 4 are attached" in text_of(result)
    ranged = await read(local.ctx(), local.p("six.pdf"), page=5, pageEnd=6, includeImages="always")
    assert [e["page"] for e in ranged.data["documentImages"]] == [5, 6]


async def test_auto_renders_a_page_without_text_layer_only(local: Box) -> None:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    pdf.add_page()
    pdf.text(20, 20, "A page with text.")
    pdf.add_page()
    pdf.rect(20, 20, 100, 60, style="F")  # a picture, no text
    local.write("scan.pdf", bytes(pdf.output()))
    result = await read(local.ctx(), local.p("scan.pdf"))
    assert [e["page"] for e in result.data["documentImages"]] == [2] and len(images_of(result)) == 1
    assert "[page 2]\n[no text layer on this page" in text_of(result)
    texty = await read(local.ctx(), local.p("scan.pdf"), pageEnd=1)
    assert images_of(texty) == [] and "documentImages" not in texty.data  # text layer, no page chosen


async def test_auto_renders_the_chosen_page_and_none_renders_nothing(local: Box) -> None:
    local.write("p.pdf", paged(3))
    chosen = await read(local.ctx(), local.p("p.pdf"), page=2)
    assert [e["page"] for e in chosen.data["documentImages"]] == [2]
    for params in ({"page": 2}, {}, {"block": 1}):
        none = await read(local.ctx(), local.p("p.pdf"), includeImages="none", **params)
        assert images_of(none) == [] and "documentImages" not in none.data
    local.write("blank.pdf", paged(1, text=False))
    blank = await read(local.ctx(), local.p("blank.pdf"), includeImages="none")
    assert images_of(blank) == []


async def test_always_attaches_docx_pictures(local: Box, tmp_path: Path) -> None:
    picture = tmp_path / "pic.png"
    picture.write_bytes(make_png(4, 3))
    d = docx.Document()
    d.add_paragraph("Text before the picture.")
    d.add_picture(str(picture))
    out = io.BytesIO()
    d.save(out)
    local.write("pic.docx", out.getvalue())
    plain = await read(local.ctx(), local.p("pic.docx"))
    assert images_of(plain) == []  # it has text: auto attaches nothing
    result = await read(local.ctx(), local.p("pic.docx"), includeImages="always")
    [image] = images_of(result)
    assert base64.b64decode(image.data) == picture.read_bytes()
    [entry] = result.data["documentImages"]
    assert (entry["width"], entry["height"], entry["page"]) == (4, 3, None)
    only = docx.Document()
    only.add_picture(str(picture))  # no text at all: auto attaches its picture
    out = io.BytesIO()
    only.save(out)
    local.write("only.docx", out.getvalue())
    auto = await read(local.ctx(), local.p("only.docx"))
    assert len(images_of(auto)) == 1 and "[the document has no text]" in text_of(auto)
    assert images_of(await read(local.ctx(), local.p("only.docx"), includeImages="none")) == []


# --- a note's images ---------------------------------------------------------------------------------


NOTE = """# Figures

![spaced](<my pic.png>) and ![paren](fig(1).png) and ![escaped](a\\(b\\).png)
![remote](https://example.com/x.png) ![abs](/etc/x.png) ![up](../../../../../../../../outside.png)
![missing](gone.png) ![link](sub/leak.png)

`![code](not-an-image.png)`
"""


async def test_image_refs_of_tricky_markdown(host_box: Box, tmp_path: Path) -> None:
    local = host_box
    outside = tmp_path / "secret.png"
    outside.write_bytes(make_png())
    for name in ("notes/my pic.png", "notes/fig(1).png", "notes/a(b).png"):
        local.write(name, make_png())
    local.mkdir("notes/sub")
    os.symlink(outside, local.h("notes/sub/leak.png"))
    local.write("notes/n.md", NOTE)
    result = await read(local.ctx(), local.p("notes/n.md"))
    root = local.machine.root
    prefix = os.path.relpath(local.p("notes"), root)
    refs = {r["alt"]: r for r in result.data["imageRefs"]}
    assert list(refs) == ["spaced", "paren", "escaped", "remote", "abs", "up", "missing", "link"]  # no code
    assert refs["spaced"] == {
        "src": "my pic.png",
        "alt": "spaced",
        "path": f"{prefix}/my pic.png",
        "fileId": None,
        "exists": True,
        "skipped": None,
    }
    assert (refs["paren"]["path"], refs["paren"]["exists"]) == (f"{prefix}/fig(1).png", True)
    assert (refs["escaped"]["path"], refs["escaped"]["exists"]) == (f"{prefix}/a(b).png", True)
    assert [refs[k]["skipped"] for k in ("remote", "abs", "up", "link")] == [
        "remote",
        "absolute",
        "escapes-knowledge-base",
        "escapes-knowledge-base",
    ]
    assert (refs["missing"]["exists"], refs["missing"]["skipped"]) == (False, None)
    assert "fig(1).png (exists)" in text_of(result) and images_of(result) == []
    always = await read(local.ctx(), local.p("notes/n.md"), includeImages="always")
    assert [e["caption"] for e in always.data["documentImages"]] == ["spaced", "paren", "escaped"]
    assert len(images_of(always)) == 3  # the escaping link's target is never sent
    local.write("notes/big.png", b"\x89PNG\r\n\x1a\n" + b"0" * MAX_IMAGE_BYTES)  # past the image limit
    local.write("notes/big.md", "![big](big.png) ![small](my%20pic.png)")
    big = await read(local.ctx(), local.p("notes/big.md"), includeImages="always")
    assert not big.is_error and [e["caption"] for e in big.data["documentImages"]] == ["small"]


# --- parameters ------------------------------------------------------------------------------------------


async def test_an_unknown_parameter_is_refused_naming_the_real_ones() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        ReadParams.model_validate({"path": "a.pdf", "images": "all"})
    message = validation_problems(caught.value, ReadParams)
    assert "images: no such parameter" in message and "includeImages" in message
    with pytest.raises(ValidationError):
        ReadParams.model_validate({"path": "a.pdf", "includeImages": "some"})


async def test_every_tool_of_every_toolset_refuses_unknown_parameters() -> None:
    """The models are told (`additionalProperties: false`) and pydantic refuses, for all tools."""
    from pydantic import ValidationError

    for name in TOOLSETS:
        for tool in toolset(name).values():
            assert tool.schema().get("additionalProperties") is False, (name, tool.name)
            with pytest.raises(ValidationError) as caught:
                tool.params.model_validate({"no_such_parameter": "web"})
            assert any(e["type"] == "extra_forbidden" for e in caught.value.errors()), tool.name
