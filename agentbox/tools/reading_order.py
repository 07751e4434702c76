"""A PDF page's text in reading order, rebuilt from where its glyphs are drawn.

A PDF's content stream draws text in whatever order its producer chose: a two-column page
is often drawn row by row across both columns, so the text in stream order interleaves
them. This module works from the glyph boxes alone (PDF user space, y growing upwards):

1. Glyphs whose vertical centres are close form a row; a row is cut into *segments* where
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

Pure functions over `Glyph`s, so a layout can be tested without a PDF. `coverage` says how
much of a page could be placed at all: glyphs without a usable box (zero size, or outside the
page) cannot be, and a page with too few placed glyphs is read in stream order instead.
"""

from __future__ import annotations

import itertools
import statistics
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


@dataclass(frozen=True)
class Glyph:
    """One character and its box on the page (points, y upwards)."""

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


def placeable(glyph: Glyph, width: float, height: float) -> bool:
    """Whether a glyph has a box layout can use: positive size, inside the page."""
    return (
        glyph.x1 > glyph.x0
        and glyph.y1 > glyph.y0
        and glyph.x0 >= -OVERLAP_TOLERANCE
        and glyph.y0 >= -OVERLAP_TOLERANCE
        and glyph.x1 <= width + OVERLAP_TOLERANCE
        and glyph.y1 <= height + OVERLAP_TOLERANCE
    )


def coverage(glyphs: list[Glyph], width: float, height: float) -> float:
    """The share of a page's visible characters (not whitespace) that have a usable box; 1.0
    for a page without any."""
    visible = [g for g in glyphs if not g.char.isspace()]
    if not visible:
        return 1.0
    return sum(placeable(g, width, height) for g in visible) / len(visible)


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
        if b.y0 > a.y1 and not any(x_overlap(c, a) > OVERLAP_TOLERANCE and y_overlap(c, b) > 0 for c in others):
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


def page_paragraphs(glyphs: list[Glyph], width: float, height: float) -> list[str] | None:
    """The paragraphs of a page in reading order (the glyphs without a usable box left out);
    None when the page has more than MAX_PAGE_PARAGRAPHS of them."""
    placed = [g for g in glyphs if not g.char.isspace() and placeable(g, width, height)]
    if not placed:
        return []
    lines = [s for row in rows(placed) for s in segments(row)]
    found = paragraphs(lines)
    if len(found) > MAX_PAGE_PARAGRAPHS:
        return None
    return [p.text for p in reading_order(found)]
