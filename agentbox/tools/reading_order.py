"""A PDF page's text in reading order, rebuilt from where its glyphs are drawn.

A PDF's content stream draws text in whatever order its producer chose: a two-column page
is often drawn row by row across both columns, so the text in stream order interleaves
them. This module works from the glyph boxes alone (PDF user space, y growing upwards):

1. Glyphs drawn one after another along a line are joined into runs; runs whose vertical
   centres are close form a row; a row is cut into *segments* where
   the horizontal gap between two glyphs is wider than SEGMENT_GAP_RATIO line heights (a
   column gutter, a table's cell gap). A gap wider than WORD_GAP_RATIO is a space.
2. Segments stacked directly under one another (a gap under PARAGRAPH_GAP_RATIO line heights,
   the same size of type, and the same left edge or mostly the same width) form a *paragraph*.
3. Paragraphs are put in reading order by Breuel's rule (High Performance Document Layout
   Analysis, 2003): a comes before b when their x ranges overlap and a is above b, or when a is
   wholly left of b and no paragraph lying between them vertically overlaps both in x. One
   amendment: when b stands wholly above a and nothing in a's column is level with b (a centred
   title over a left column), the second rule does not put a first. A title spanning both
   columns therefore comes first, then the left column, then the right one, then a footer
   spanning both.

Pure functions over characters and their boxes, so a layout can be tested without a PDF.
`Layout.coverage` says how much of a page could be placed at all: glyphs without a usable box (zero size, or outside the
page) cannot be, and a page with too few placed glyphs is read in stream order instead.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

#: A horizontal gap wider than this many line heights between two glyphs is a space.
WORD_GAP_RATIO = 0.15
#: A horizontal gap wider than this many line heights ends a segment (a gutter, a cell gap).
SEGMENT_GAP_RATIO = 1.0
#: Vertical gap between two stacked segments, in line heights, past which a paragraph ends.
PARAGRAPH_GAP_RATIO = 0.8
#: Two rows' glyphs belong to one row when their centres are within this share of a line height.
ROW_TOLERANCE_RATIO = 0.5
#: Segments whose line heights differ by more than this factor are not one paragraph (a heading).
SAME_SIZE_FACTOR = 1.25
#: Segments with mostly the same width continue a paragraph even when their left edges differ.
SAME_WIDTH_SHARE = 0.6
#: x overlap below this many points does not count (italic or kerned glyphs bleed over edges).
OVERLAP_TOLERANCE = 1.0
#: Paragraphs one page may have for its order to be rebuilt: the sort compares every pair with
#: every other paragraph (cubic), so a page past it (a big table's cells) keeps stream order.
MAX_PAGE_PARAGRAPHS = 120


Char = tuple[str, float, float, float, float]
"""A character and its box on the page: x0, y0, x1, y1 (points, y upwards)."""


@dataclass(frozen=True)
class Glyph:
    """One character (or a run of them, `runs`) and its box on the page (points, y upwards)."""

    char: str
    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def height(self) -> float:
        return self.y1 - self.y0

    @property
    def middle(self) -> float:
        return (self.y0 + self.y1) / 2


@dataclass(frozen=True)
class Box:
    """A run of text and the rectangle around it."""

    text: str
    x0: float
    y0: float
    x1: float
    y1: float
    height: float  # the line height of its type

    @property
    def width(self) -> float:
        return self.x1 - self.x0

    @property
    def middle(self) -> float:
        return (self.y0 + self.y1) / 2


def runs(chars: Iterable[Char], width: float, height: float) -> tuple[list[Glyph], int, int]:
    """Characters that follow one another in drawing order along one line joined into one glyph
    (with a space at a word gap): what the rest of the layout sorts, a few per line instead of
    one per character. A jump back, to another line or over a gutter starts a new run.

    Also counts the visible characters (not whitespace) and those placed (a box of positive
    size on the page); the others are left out. One tight loop: it runs once per character."""
    joined: list[Glyph] = []
    visible = placed = 0
    parts: list[str] = []
    rx0 = ry0 = rx1 = ry1 = rh = 0.0
    low, right, top = -OVERLAP_TOLERANCE, width + OVERLAP_TOLERANCE, height + OVERLAP_TOLERANCE
    for char, x0, y0, x1, y1 in chars:
        if char.isspace():
            continue
        visible += 1
        if not (x1 > x0 and y1 > y0 and x0 >= low and y0 >= low and x1 <= right and y1 <= top):
            continue
        placed += 1
        h = y1 - y0
        if parts:
            tall = max(rh, h)
            gap = x0 - rx1
            if (
                abs(ry0 + ry1 - y0 - y1) <= 2 * ROW_TOLERANCE_RATIO * tall
                and tall <= SAME_SIZE_FACTOR * min(rh, h)
                and -ROW_TOLERANCE_RATIO * tall <= gap <= SEGMENT_GAP_RATIO * tall
            ):
                if gap > WORD_GAP_RATIO * tall:
                    parts.append(" ")
                parts.append(char)
                ry0, rx1, ry1 = min(ry0, y0), max(rx1, x1), max(ry1, y1)
                continue
            joined.append(Glyph("".join(parts), rx0, ry0, rx1, ry1))
        parts = [char]
        rx0, ry0, rx1, ry1, rh = x0, y0, x1, y1, h
    if parts:
        joined.append(Glyph("".join(parts), rx0, ry0, rx1, ry1))
    return joined, visible, placed


def rows(glyphs: list[Glyph]) -> list[list[Glyph]]:
    """Glyphs grouped by their vertical centre, top row first."""
    grouped: list[list[Glyph]] = []
    for glyph in sorted(glyphs, key=lambda g: -g.middle):
        if grouped:
            anchor = grouped[-1][0]
            if abs(anchor.middle - glyph.middle) <= ROW_TOLERANCE_RATIO * max(anchor.height, glyph.height):
                grouped[-1].append(glyph)
                continue
        grouped.append([glyph])
    return grouped


def segments(row: list[Glyph]) -> list[Box]:
    """One row cut at its wide gaps, with spaces where words are apart."""
    ordered = sorted(row, key=lambda g: g.x0)
    height = statistics.median(g.height for g in ordered)
    runs: list[list[Glyph]] = [[ordered[0]]]
    for glyph in ordered[1:]:
        if glyph.x0 - runs[-1][-1].x1 > SEGMENT_GAP_RATIO * height:
            runs.append([glyph])
        else:
            runs[-1].append(glyph)
    return [segment(run, height) for run in runs]


def segment(run: list[Glyph], height: float) -> Box:
    text = run[0].char
    for left, glyph in itertools.pairwise(run):
        text += (" " if glyph.x0 - left.x1 > WORD_GAP_RATIO * height else "") + glyph.char
    return Box(
        text,
        min(g.x0 for g in run),
        min(g.y0 for g in run),
        max(g.x1 for g in run),
        max(g.y1 for g in run),
        height,
    )


def x_overlap(a: Box, b: Box) -> float:
    return min(a.x1, b.x1) - max(a.x0, b.x0)


def y_overlap(a: Box, b: Box) -> float:
    return min(a.y1, b.y1) - max(a.y0, b.y0)


def continues(above: Box, below: Box) -> bool:
    """Whether `below` is the next line of the paragraph whose last line is `above`."""
    height = max(above.height, below.height)
    gap = above.y0 - below.y1
    if not -ROW_TOLERANCE_RATIO * height <= gap <= PARAGRAPH_GAP_RATIO * height:
        return False
    if max(above.height, below.height) > SAME_SIZE_FACTOR * min(above.height, below.height):
        return False
    aligned = abs(above.x0 - below.x0) <= height
    similar = x_overlap(above, below) >= SAME_WIDTH_SHARE * max(above.width, below.width)
    return aligned or similar


def paragraphs(lines: list[Box]) -> list[Box]:
    """Segments (top first) joined into paragraphs; a paragraph's text keeps its line breaks."""
    open_: list[list[Box]] = []
    for line in lines:
        home = next((p for p in open_ if continues(p[-1], line)), None)
        if home is None:
            open_.append([line])
        else:
            home.append(line)
    return [merged(p) for p in open_]


def merged(lines: list[Box]) -> Box:
    return Box(
        "\n".join(line.text for line in lines),
        min(b.x0 for b in lines),
        min(b.y0 for b in lines),
        max(b.x1 for b in lines),
        max(b.y1 for b in lines),
        lines[0].height,
    )


def before(a: Box, b: Box, others: list[Box]) -> bool:
    """Breuel's order: `a` is read before `b`."""
    if x_overlap(a, b) > OVERLAP_TOLERANCE:
        return a.middle > b.middle
    if a.x1 <= b.x0 + OVERLAP_TOLERANCE:
        if b.y0 > a.y1 and not any(
            x_overlap(c, a) > OVERLAP_TOLERANCE and y_overlap(c, b) > 0 for c in others
        ):
            return False  # b stands above a's whole column (a centred title): nothing puts a first
        low, high = sorted((a.middle, b.middle))
        return not any(
            low < c.middle < high
            and x_overlap(c, a) > OVERLAP_TOLERANCE
            and x_overlap(c, b) > OVERLAP_TOLERANCE
            for c in others
        )
    return False


def reading_order(boxes: list[Box]) -> list[Box]:
    """A topological sort of `before`; among paragraphs free to come next, the highest (then the
    leftmost) goes first, which also breaks the cycles a degenerate layout can make."""
    follows = {
        i: {j for j, a in enumerate(boxes) if j != i and before(a, b, boxes)} for i, b in enumerate(boxes)
    }
    done: list[int] = []
    left = set(range(len(boxes)))
    while left:
        free = [i for i in left if not (follows[i] & left)] or list(left)
        pick = min(free, key=lambda i: (-boxes[i].y1, boxes[i].x0))
        done.append(pick)
        left.remove(pick)
    return [boxes[i] for i in done]


@dataclass(frozen=True)
class Layout:
    """A page's paragraphs in reading order, or None when not rebuilt: under `min_coverage` of
    its visible characters placed, or more than MAX_PAGE_PARAGRAPHS paragraphs."""

    paragraphs: list[str] | None
    coverage: float  # placed / visible characters; 1.0 for a page without any


def layout(chars: Iterable[Char], width: float, height: float, min_coverage: float) -> Layout:
    glyphs, visible, placed = runs(chars, width, height)
    share = placed / visible if visible else 1.0
    if share < min_coverage:
        return Layout(None, share)
    lines = [s for row in rows(glyphs) for s in segments(row)]
    found = paragraphs(lines)
    if len(found) > MAX_PAGE_PARAGRAPHS:
        return Layout(None, share)
    return Layout([p.text for p in reading_order(found)], share)
