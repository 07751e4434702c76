"""Knowledge search: a real FTS5 index over real files on LocalMachine tmp roots (and one sandbox).

PDF and DOCX fixtures are generated here with fpdf2 and python-docx; freshness goes through a
real inotify watch hub; waits poll a condition up to a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import docx
import pytest
from fpdf import FPDF
from pydantic import ValidationError

from agentbox.machines.base import TRASH_DIR, ExecRequest, Machine
from agentbox.machines.local import LocalMachine
from agentbox.tools import knowledge as kn
from agentbox.tools.base import Action, FileStore, Operation, TodoStore, ToolConfig, ToolResult
from agentbox.tools.documents import docx_blocks
from agentbox.tools.knowledge import (
    CHUNK_CHARS,
    CHUNK_OVERLAP_CHARS,
    DEFAULT_RESULTS,
    MAX_INDEXED_FILE_BYTES,
    MAX_INDEXED_FILES,
    MAX_QUERY_TERMS,
    MAX_RESULTS,
    OVER_CAP,
    TOOLS,
    Filters,
    KnowledgeIndex,
    SearchInputError,
    SearchParams,
    index_path,
)
from agentbox.tools.pdf import read_pdf
from agentbox.tools.read import READ, ReadParams
from agentbox.tools.services import MachineServices
from agentbox.workspace.watch import WatchHub
from tests.scoped import Scoped

#: Seconds a change may take to show up in search results before a test fails.
DEADLINE = 10.0


# ---------------------------------------------------------------- fixtures and helpers


@dataclass
class MemoryTodos:
    items: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    async def get(self, session_id: str) -> list[dict[str, Any]]:
        return self.items.get(session_id, [])

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        self.items[session_id] = items


#: Each test's machines' services (closed after the test).
OPEN: dict[int, MachineServices] = {}


@dataclass
class Ctx(Scoped):
    """A real (minimal) ToolContext: search never commits, and every read is allowed."""

    machine: Any
    session_id: str = "ses_test"
    turn_id: str | None = None
    config: ToolConfig = field(default_factory=ToolConfig)
    reads: dict[str, str] = field(default_factory=dict)
    todos: TodoStore = field(default_factory=MemoryTodos)
    files: FileStore | None = None
    deliveries: int = 0
    services: MachineServices | None = None

    def __post_init__(self) -> None:
        if self.services is None:  # one per machine for the test, as the system keeps them
            self.services = OPEN.setdefault(id(self.machine), MachineServices.of(self.machine))

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        return ToolResult.error(f"{tool} planned {len(operations)} operations; search must plan none")

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        return None


@pytest.fixture(autouse=True)
async def _indexes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Shared-machine indexes go under this test's AGENTBOX_HOME; every index is closed after."""
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    yield
    for services in OPEN.values():
        await services.close()
    OPEN.clear()


#: The kinds the index is tested on: host files by descriptor, and an ssh host through the
#: `Machine` protocol (its files written from here: the loopback sshd's root is a host folder).
INDEX_KINDS = ("local", "ssh")


@pytest.fixture(params=INDEX_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def root(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    if kind == "ssh":
        return Path(request.getfixturevalue("remote_root"))
    path = tmp_path / "ws"
    path.mkdir()
    return path


@pytest.fixture
def machine(kind: str, root: Path, request: pytest.FixtureRequest) -> Machine:
    if kind == "ssh":
        return cast(Machine, request.getfixturevalue("ssh"))
    return LocalMachine("local", root)


@pytest.fixture
async def index(tmp_path: Path, machine: Machine) -> AsyncIterator[KnowledgeIndex]:
    idx = KnowledgeIndex(tmp_path / "k.sqlite", machine)
    yield idx
    await idx.close()


def write(path: Path, text: str, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def make_pdf(path: Path, pages: list[str], keywords: str | None = None, size: int = 11) -> Path:
    """One PDF page per text (`size` small enough that each text fits its page)."""
    pdf = FPDF()
    pdf.set_font("helvetica", size=size)
    pdf.set_auto_page_break(False)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, size / 2, text)
    if keywords:
        pdf.set_keywords(keywords)
    path.parent.mkdir(parents=True, exist_ok=True)
    pdf.output(str(path))
    return path


def make_docx(path: Path, body: list[tuple[str, Any]], keywords: str | None = None) -> Path:
    """body items: ("title", text), ("h1"/"h2", text), ("p", text), ("table", [[cells]])."""
    document = docx.Document()
    for kind, value in body:
        if kind == "title":
            document.add_heading(value, level=0)
        elif kind in ("h1", "h2"):
            document.add_heading(value, level=int(kind[1]))
        elif kind == "p":
            document.add_paragraph(value)
        elif kind == "table":
            table = document.add_table(rows=len(value), cols=len(value[0]))
            for r, row in enumerate(value):
                for c, cell in enumerate(row):
                    table.cell(r, c).text = cell
    if keywords:
        document.core_properties.keywords = keywords
    path.parent.mkdir(parents=True, exist_ok=True)
    document.save(str(path))
    return path


async def search_tool(machine: Any, **params: Any) -> ToolResult:
    return await TOOLS["search"].run(Ctx(machine), SearchParams(**params))


async def eventually(check: Callable[[], Awaitable[bool]], what: str, deadline: float = DEADLINE) -> None:
    """Poll `check` until it holds or the deadline passes."""
    end = time.monotonic() + deadline
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline}s: {what}")
        await asyncio.sleep(0.02)


def paths(outcome: kn.SearchOutcome) -> list[str]:
    return [h.path for h in outcome.hits]


# ---------------------------------------------------------------- formats and citations


async def test_markdown_cited_by_line_range_and_heading(index: KnowledgeIndex, root: Path) -> None:
    write(
        root / "notes" / "deploy.md",
        "---\ntitle: Deploy\ntags: [ops]\n---\n# Deploy guide\n\nIntro words.\n\n## Pipeline\n\n"
        "The blue-green pipeline swaps traffic\nafter the health check passes.\n",
    )
    await index.refresh()
    outcome = await index.search("health check")
    assert len(outcome.hits) == 1
    hit = outcome.hits[0]
    assert hit.path == f"{root}/notes/deploy.md"
    # lines 9..12: the "## Pipeline" heading starts the chunk, the paragraph is lines 11-12
    assert (hit.first, hit.last, hit.heading) == (9, 12, "Pipeline")
    assert hit.citation == "lines 9-12, § Pipeline"
    assert "**health** **check**" in hit.snippet

    result = await search_tool(index.machine, query="health check")
    assert not result.is_error
    assert f"[1] {root}/notes/deploy.md (lines 9-12, § Pipeline) — " in result.as_text()
    assert result.data["results"][0]["unit"] == "line"


async def test_txt_cited_by_lines(index: KnowledgeIndex, root: Path) -> None:
    write(root / "log.txt", "first paragraph\n\nsecond paragraph mentions kumquat\nand continues\n")
    await index.refresh()
    [hit] = (await index.search("kumquat")).hits
    assert (hit.file_type, hit.citation) == ("txt", "lines 1-4")  # both paragraphs fit one chunk


async def test_pdf_cited_by_page(index: KnowledgeIndex, root: Path) -> None:
    make_pdf(
        root / "docs" / "report.pdf", ["Cover page text", "Revenue grew in the second quarter", "Appendix"]
    )
    await index.refresh()
    [hit] = (await index.search("revenue quarter")).hits
    assert (hit.path, hit.citation, hit.to_dict()["page"]) == (
        f"{root}/docs/report.pdf",
        "page 2, block 2",
        2,
    )
    assert (hit.to_dict()["unit"], hit.first, hit.last) == ("block", 2, 2)
    # the block numbers `read block=N` takes: one extractor for both
    [cited] = [
        b for b in read_pdf((root / "docs" / "report.pdf").read_bytes()).blocks if b.number == hit.first
    ]
    assert "Revenue grew" in cited.text and cited.page == 2
    result = await search_tool(index.machine, query="appendix", fileTypes=["pdf"])
    assert f"[1] {root}/docs/report.pdf (page 3, block 3) — **Appendix**" in result.as_text()


async def test_long_pdf_page_is_split_and_every_part_cites_the_page(
    index: KnowledgeIndex, root: Path
) -> None:
    paragraphs = [f"Paragraph {n} talks about topic{n} " + "filler words " * 30 for n in range(12)]
    make_pdf(root / "long.pdf", ["short first page", "\n\n".join(paragraphs), "last page"], size=4)
    await index.refresh()
    assert index.counts()["chunks"] > 3  # page 2 alone holds several chunks
    for n in (0, 6, 11):
        [hit] = (await index.search(f"topic{n}")).hits
        assert hit.citation.startswith("page 2, block")


async def test_docx_cited_by_block_and_heading(index: KnowledgeIndex, root: Path) -> None:
    make_docx(
        root / "spec.docx",
        [
            ("title", "Product spec"),  # block 1
            ("p", ""),  # empty paragraphs are not blocks
            ("h1", "Scope"),  # block 2
            ("p", "The service handles invoices."),  # block 3
            ("table", [["Region", "Owner"], ["EMEA", "Marguerite"]]),  # block 4
            ("h1", "Risks"),  # block 5
            ("p", "Latency under load is the main risk."),  # block 6
        ],
    )
    await index.refresh()
    blocks = docx_blocks((root / "spec.docx").read_bytes())
    assert [(b.number, b.level) for b in blocks] == [
        (1, 0),
        (2, 1),
        (3, None),
        (4, None),
        (5, 1),
        (6, None),
    ]
    [hit] = (await index.search("Marguerite")).hits  # table text is searchable
    assert hit.citation == 'blocks 2-4, heading "Scope"'
    [hit] = (await index.search("latency")).hits
    assert hit.citation == 'blocks 5-6, heading "Risks"'
    result = await search_tool(index.machine, query="latency")
    assert (
        f'[1] {root}/spec.docx (blocks 5-6, heading "Risks") — Risks **Latency** under load'
        in result.as_text()
    )
    assert result.data["results"][0]["unit"] == "block"


async def test_a_search_hit_names_the_block_read_returns_after_an_empty_table(
    index: KnowledgeIndex, root: Path
) -> None:
    """One extractor for both: an empty table (no block) and a merged cell do not shift numbers."""
    document = docx.Document()
    document.add_heading("Alpha", level=1)  # block 1
    document.add_paragraph("Before the grid.")  # block 2
    document.add_table(rows=2, cols=2)  # empty: no block
    document.add_heading("Beta", level=1)  # block 3
    document.add_paragraph("After the empty grid: zeppelin.")  # block 4
    merged = document.add_table(rows=1, cols=2)  # block 5, its one cell once
    merged.cell(0, 0).merge(merged.cell(0, 1)).text = "Spanning"
    document.add_heading("Gamma", level=1)  # block 6
    document.add_paragraph("Past the merged row: dirigible.")  # block 7
    path = root / "grid.docx"
    document.save(str(path))
    await index.refresh()
    for word, span, block in (("zeppelin", (3, 5), 4), ("dirigible", (6, 7), 7)):
        [hit] = (await index.search(word)).hits
        assert (hit.first, hit.last) == span
        result = await READ.run(Ctx(index.machine), ReadParams(path=str(path), block=block))
        assert not result.is_error and word in result.as_text(), result.as_text()
    spanning = await READ.run(Ctx(index.machine), ReadParams(path=str(path), block=5))
    assert "Spanning" in spanning.as_text() and "Spanning | Spanning" not in spanning.as_text()


async def test_cjk_text_is_found_by_word_and_snippet_reads_naturally(
    index: KnowledgeIndex, root: Path
) -> None:
    write(root / "笔记.md", "# 说明\n\n会话选中的知识库支持全文检索，也支持Python脚本。\n")  # noqa: RUF001
    await index.refresh()
    [hit] = (await index.search("知识库")).hits
    assert hit.heading == "说明"
    assert "**知识库**" in hit.snippet and "支持Python脚本" in hit.snippet
    assert (await index.search("检索 python")).hits


# ---------------------------------------------------------------- chunking


def test_pack_boundary_at_chunk_chars() -> None:
    half = CHUNK_CHARS // 2 - 1
    fits = [kn.Piece("a" * half, 1, 1, None), kn.Piece("b" * (CHUNK_CHARS - half - 2), 3, 3, None)]
    [chunk] = kn.pack(fits)
    assert len(chunk.text) == CHUNK_CHARS and (chunk.first, chunk.last) == (1, 3)
    over = [fits[0], kn.Piece("b" * (CHUNK_CHARS - half - 1), 3, 3, None)]
    assert [(c.first, c.last) for c in kn.pack(over)] == [(1, 1), (3, 3)]


def test_split_chunks_overlap_by_a_short_paragraph() -> None:
    lines: list[str] = []
    for n in range(8):
        lines += [f"para{n} " + "x" * 400, "", "short tail line" if n % 2 else "y" * 300, ""]
    pieces = kn.text_pieces(lines, markdown=False)
    chunks = kn.pack(pieces)
    assert len(chunks) > 2
    assert all(len(c.text) <= CHUNK_CHARS for c in chunks)
    # a chunk cut for size repeats its last short piece at the start of the next one
    repeated = [a for a, b in itertools.pairwise(chunks) if a.last == b.first]
    assert repeated and all(a.text.endswith("short tail line") for a in repeated)


def test_a_huge_line_is_cut_into_overlapping_windows() -> None:
    text = "".join(f"w{n:05d} " for n in range(1000))  # 7000 chars, one line
    chunks = kn.pack(kn.text_pieces([text], markdown=False))
    assert all(len(c.text) <= CHUNK_CHARS and (c.first, c.last) == (1, 1) for c in chunks)
    for a, b in itertools.pairwise(chunks):
        assert a.text[-CHUNK_OVERLAP_CHARS:] == b.text[:CHUNK_OVERLAP_CHARS]
    assert "".join(c.text[: CHUNK_CHARS - CHUNK_OVERLAP_CHARS] for c in chunks).startswith(text[:6000])


def test_markdown_headings_start_chunks_but_not_inside_code_fences() -> None:
    lines = [
        "# One",
        "",
        "alpha",
        "",
        "```",
        "# not a heading",
        "",
        "still code",
        "```",
        "",
        "## Two",
        "beta",
    ]
    chunks = kn.pack(kn.text_pieces(lines, markdown=True))
    assert [(c.first, c.last, c.heading) for c in chunks] == [(1, 9, "One"), (11, 12, "Two")]


# ---------------------------------------------------------------- filters


@pytest.fixture
async def corpus(index: KnowledgeIndex, root: Path) -> KnowledgeIndex:
    """One word, `zephyr`, in files that differ by path, tags, type and mtime."""
    day = 86400.0
    write(root / "notes" / "a.md", "---\ntags: [Travel, project/alpha]\n---\nzephyr notes\n", mtime=10 * day)
    write(root / "notes" / "b.md", "---\ntags:\n  - cooking\n---\nzephyr recipe #Quick\n", mtime=20 * day)
    write(root / "notes2" / "c.txt", "zephyr plain text #travel\n", mtime=30 * day)
    make_pdf(root / "docs" / "d.pdf", ["zephyr in a pdf"], keywords="finance, travel")
    os.utime(root / "docs" / "d.pdf", (40 * day, 40 * day))
    make_docx(root / "docs" / "e.docx", [("p", "zephyr in a docx")], keywords="legal; drafts")
    os.utime(root / "docs" / "e.docx", (50 * day, 50 * day))
    await index.refresh()
    return index


async def found(index: KnowledgeIndex, **filters: Any) -> list[str]:
    outcome = await index.search("zephyr", Filters(**filters), MAX_RESULTS)
    return sorted(p.rsplit("/", 1)[1] for p in paths(outcome))


async def test_every_filter_narrows(corpus: KnowledgeIndex, root: Path) -> None:
    assert await found(corpus) == ["a.md", "b.md", "c.txt", "d.pdf", "e.docx"]
    assert await found(corpus, path_prefix=f"{root}/notes") == ["a.md", "b.md", "c.txt"]  # a string prefix
    assert await found(corpus, path_prefix=f"{root}/notes/") == ["a.md", "b.md"]
    assert await found(corpus, tags=("travel",)) == [
        "a.md",
        "c.txt",
        "d.pdf",
    ]  # frontmatter, #tag, pdf keywords
    assert await found(corpus, tags=("quick", "legal")) == ["b.md", "e.docx"]  # any of them
    assert await found(corpus, tags=("project",)) == ["a.md"]  # nested tag project/alpha
    assert await found(corpus, tags=("proj",)) == []
    assert await found(corpus, file_types=("markdown",)) == ["a.md", "b.md"]
    assert await found(corpus, file_types=("txt", "docx")) == ["c.txt", "e.docx"]
    day = 86400.0
    assert await found(corpus, updated_after=30 * day) == ["c.txt", "d.pdf", "e.docx"]  # inclusive
    assert await found(corpus, updated_before=30 * day) == ["a.md", "b.md"]  # exclusive
    assert await found(corpus, updated_after=20 * day, updated_before=40 * day, tags=("travel",)) == ["c.txt"]


async def test_tool_filters_take_relative_paths_iso_dates_and_refuse_what_widens(
    corpus: KnowledgeIndex, machine: Machine, root: Path
) -> None:
    async def names(**params: Any) -> list[str]:
        result = await search_tool(machine, query="zephyr", limit=MAX_RESULTS, **params)
        assert not result.is_error, result.as_text()
        return sorted(r["path"].rsplit("/", 1)[1] for r in result.data["results"])

    await Ctx(machine).services.knowledge()  # type: ignore[union-attr]  # the tool's own index (its own sqlite file)
    assert await names(pathPrefix="docs") == ["d.pdf", "e.docx"]
    assert await names(pathPrefix="./notes/../docs/") == ["d.pdf", "e.docx"]
    assert await names(pathPrefix=".") == ["a.md", "b.md", "c.txt", "d.pdf", "e.docx"]
    assert await names(tags=["#TRAVEL"], fileTypes=["markdown", "pdf"]) == ["a.md", "d.pdf"]
    assert await names(updatedAfter="1970-01-31", updatedBefore="1970-02-10T00:00:01+00:00") == [
        "c.txt",
        "d.pdf",
    ]
    for params, message in [
        ({"pathPrefix": "/etc"}, "outside the workspace root"),
        ({"pathPrefix": "../elsewhere"}, "outside the workspace root"),
        ({"updatedAfter": "last tuesday"}, "updatedAfter must be an ISO date"),
        ({"updatedAfter": "2024-02-01", "updatedBefore": "2024-01-01"}, "earlier than updatedBefore"),
    ]:
        result = await search_tool(machine, query="zephyr", **params)
        assert result.is_error and message in result.as_text()
    with pytest.raises(ValidationError):
        SearchParams.model_validate({"query": "zephyr", "fileTypes": ["spreadsheet"]})


async def test_images_are_ignored_with_a_note(corpus: KnowledgeIndex, machine: Machine) -> None:
    (Path(corpus.machine.root) / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    only_images = await search_tool(machine, query="zephyr", fileTypes=["image"], limit=MAX_RESULTS)
    assert not only_images.is_error
    assert len(only_images.data["results"]) == 5  # ignored: as if no fileTypes were given
    assert (
        "Note: fileTypes 'image' was ignored: images have no searchable text (no OCR)"
        in only_images.as_text()
    )
    assert "Find images by name with list, then look at one with read." in only_images.as_text()
    with_pdf = await search_tool(machine, query="zephyr", fileTypes=["image", "pdf"])
    assert [r["fileType"] for r in with_pdf.data["results"]] == ["pdf"]
    assert "no OCR" in with_pdf.as_text()


# ---------------------------------------------------------------- result counts


async def test_default_and_maximum_number_of_results(machine: Machine, root: Path) -> None:
    for n in range(20):
        write(root / f"n{n:02d}.md", f"shared keyword in note {n}\n")
    default = await search_tool(machine, query="keyword")
    assert len(default.data["results"]) == DEFAULT_RESULTS == 4
    assert default.as_text().startswith("4 of 20 chunks matching 'keyword', best first:")
    assert [line[:4] for line in default.as_text().splitlines()[1:5]] == ["[1] ", "[2] ", "[3] ", "[4] "]
    assert "16 more: raise limit (up to 16)" in default.as_text()

    at_max = await search_tool(machine, query="keyword", limit=MAX_RESULTS)
    assert len(at_max.data["results"]) == MAX_RESULTS == 16 and "clamped" not in at_max.as_text()
    over = await search_tool(machine, query="keyword", limit=MAX_RESULTS + 1)
    assert len(over.data["results"]) == 16
    assert "Note: limit 17 was clamped to the maximum of 16." in over.as_text()
    with pytest.raises(ValidationError):
        SearchParams(query="keyword", limit=0)


async def test_no_match_is_a_plain_answer_not_an_error(machine: Machine, root: Path) -> None:
    write(root / "a.md", "nothing relevant\n")
    result = await search_tool(machine, query="unobtainium")
    assert not result.is_error and result.data["results"] == []
    assert "No indexed markdown, txt, docx or pdf text matches 'unobtainium'" in result.as_text()


async def test_all_terms_first_then_any_term(index: KnowledgeIndex, root: Path) -> None:
    write(root / "a.md", "apples and pears\n")
    write(root / "b.md", "apples only\n")
    await index.refresh()
    both = await index.search("apples pears")
    assert paths(both) == [f"{root}/a.md"] and not both.any_term
    either = await index.search("pears zebra")
    assert paths(either) == [f"{root}/a.md"] and either.any_term
    result = await search_tool(index.machine, query="pears zebra")
    assert "matching any of the words (no chunk has them all)" in result.as_text()


# ---------------------------------------------------------------- queries from the model


@pytest.mark.parametrize(
    "query",
    [
        '"unbalanced quote',
        'he said "deploy" and left',
        "deploy AND",
        "OR",
        "NEAR(deploy pipeline, 2)",
        "text:deploy",
        "^deploy -pipeline +x",
        "deploy*",
        "(deploy OR",
        "' ; DROP TABLE files; --",
        "deploy\x00pipeline",
        "\x02deploy\x03",
        "🚀 deploy",
        "*",
        '""',
        "-",
    ],
)
async def test_query_syntax_from_the_model_never_crashes(
    index: KnowledgeIndex, root: Path, query: str
) -> None:
    write(root / "a.md", "the deploy pipeline runs nightly\n")
    await index.refresh()
    result = await search_tool(index.machine, query=query)
    text = result.as_text()
    if result.is_error:
        assert "has no words to search for" in text
    else:
        assert text.startswith(("1 of 1 chunks", "No indexed"))
    assert index.counts()["files"] == 1  # nothing was dropped by the "injection"


async def test_phrases_prefixes_and_operators(index: KnowledgeIndex, root: Path) -> None:
    write(root / "a.md", "the deploy pipeline runs nightly\n")
    write(root / "b.md", "pipeline for the deploy\n")
    await index.refresh()
    assert paths(await index.search('"deploy pipeline"')) == [f"{root}/a.md"]
    assert len((await index.search("deplo* pipe*")).hits) == 2
    assert len((await index.search("deploy OR pipeline")).hits) == 2  # OR is not an operator: dropped
    with pytest.raises(SearchInputError):
        await index.search("*** ()")


async def test_query_terms_boundary(index: KnowledgeIndex, root: Path, machine: Machine) -> None:
    words = [f"t{n}" for n in range(MAX_QUERY_TERMS + 1)]
    write(root / "a.md", " ".join(words) + "\n")
    exactly = await search_tool(machine, query=" ".join(words[:MAX_QUERY_TERMS]))
    assert len(exactly.data["results"]) == 1 and "query terms" not in exactly.as_text()
    over = await search_tool(machine, query=" ".join(words))
    assert f"Note: only the first {MAX_QUERY_TERMS} query terms were used (1 ignored)." in over.as_text()
    assert kn.fts_query(" ".join(words)).dropped == 1


# ---------------------------------------------------------------- freshness


async def test_watcher_keeps_the_index_fresh(index: KnowledgeIndex, root: Path) -> None:
    hub = WatchHub(index.machine)
    try:
        await index.attach(hub)
        await index.refresh()

        async def hits(query: str) -> list[str]:
            return paths(await index.search(query, limit=MAX_RESULTS))

        note = root / "fresh" / "new.md"
        write(note, "a brand new quasar note\n")
        await eventually(lambda: _eq(hits("quasar"), [str(note)]), "new file indexed")

        note.write_text("now it speaks of a nebula\n")
        await eventually(lambda: _eq(hits("nebula"), [str(note)]), "modified file re-indexed")
        assert await hits("quasar") == []

        moved = root / "fresh" / "moved.md"
        note.rename(moved)
        await eventually(lambda: _eq(hits("nebula"), [str(moved)]), "renamed file follows")

        moved.unlink()
        await eventually(lambda: _eq(hits("nebula"), []), "deleted file dropped")

        tree = root / "project"
        write(tree / "deep" / "one.md", "pulsar one\n")
        write(tree / "two.txt", "pulsar two\n")
        await eventually(lambda: _len(hits("pulsar"), 2), "new directory indexed")
        tree.rename(root / "renamed")
        await eventually(
            lambda: _eq(
                hits("pulsar"), sorted([f"{root}/renamed/deep/one.md", f"{root}/renamed/two.txt"]), sort=True
            ),
            "renamed directory re-pathed",
        )
        for p in sorted((root / "renamed").rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        (root / "renamed").rmdir()
        await eventually(lambda: _eq(hits("pulsar"), []), "removed directory dropped")

        write(root / "node_modules" / "pkg" / "readme.md", "pulsar in a dependency\n")
        write(root / "marker.md", "pulsar marker\n")
        await eventually(lambda: _len(hits("pulsar"), 1), "marker indexed")
        assert await hits("dependency") == []  # excluded directories are not indexed
    finally:
        await index.close()
        await hub.close()


async def _eq(value: Awaitable[list[str]], expected: list[str], *, sort: bool = False) -> bool:
    got = await value
    return (sorted(got) if sort else got) == expected


async def _len(value: Awaitable[list[str]], n: int) -> bool:
    return len(await value) == n


async def test_the_tool_index_follows_changes(machine: Machine, root: Path) -> None:
    write(root / "a.md", "first comet\n")
    assert len((await search_tool(machine, query="comet")).data["results"]) == 1
    write(root / "b.md", "second comet\n")

    async def two() -> bool:
        return len((await search_tool(machine, query="comet")).data["results"]) == 2

    await eventually(two, "the tool's index saw b.md")


# ---------------------------------------------------------------- refresh and limits


async def test_refresh_is_incremental(
    tmp_path: Path, index: KnowledgeIndex, root: Path, machine: Machine
) -> None:
    for n in range(5):
        write(root / f"n{n}.md", f"note {n}\n")
    make_pdf(root / "p.pdf", ["pdf page"])
    first = await index.refresh()
    assert (first.indexed, first.unchanged, first.removed) == (6, 0, 0)
    again = await index.refresh()
    assert (again.indexed, again.unchanged) == (0, 6)

    write(root / "n1.md", "note one, rewritten\n")
    (root / "n2.md").unlink()
    changed = await index.refresh()
    assert (changed.indexed_paths, changed.unchanged, changed.removed) == ([f"{root}/n1.md"], 4, 1)

    await index.close()  # the index file persists: a new index over it re-indexes nothing
    reopened = KnowledgeIndex(tmp_path / "k.sqlite", machine)
    try:
        stats = await reopened.refresh()
        assert (stats.indexed, stats.unchanged) == (0, 5)
        assert paths(await reopened.search("rewritten")) == [f"{root}/n1.md"]
    finally:
        await reopened.close()


async def test_file_size_boundary(index: KnowledgeIndex, root: Path, machine: Machine) -> None:
    for name, size in (("exact", MAX_INDEXED_FILE_BYTES), ("over", MAX_INDEXED_FILE_BYTES + 1)):
        head = f"{name}size marker\n".encode()
        (root / f"{name}.txt").write_bytes(head + b" " * (size - len(head)))
    assert (root / "exact.txt").stat().st_size == MAX_INDEXED_FILE_BYTES
    stats = await index.refresh()
    assert (stats.indexed, stats.skipped) == (1, 1)
    assert paths(await index.search("exactsize")) == [f"{root}/exact.txt"]
    outcome = await index.search("oversize")
    assert outcome.hits == [] and outcome.skipped_total == 1
    assert outcome.skipped[0] == (
        f"{root}/over.txt",
        f"larger than {MAX_INDEXED_FILE_BYTES} bytes ({MAX_INDEXED_FILE_BYTES + 1} bytes)",
    )
    result = await search_tool(machine, query="oversize")
    assert f"Not indexed: {root}/over.txt (larger than {MAX_INDEXED_FILE_BYTES} bytes" in result.as_text()
    assert (await index.refresh()).skipped == 0  # not retried until it changes


@pytest.mark.parametrize("kind", ["local"])  # 10,000 files: the cap is the index's, whatever the kind
async def test_file_count_boundary(index: KnowledgeIndex, root: Path) -> None:
    """MAX_INDEXED_FILES are indexed; the next one is not, and gets in once another leaves."""
    source = write(root / "src" / "a0000.txt", "common word\n")
    for n in range(1, MAX_INDEXED_FILES):
        os.link(
            source, root / "src" / f"a{n:04d}.txt"
        )  # hard links: distinct files to the index, cheap to make
    first = await index.refresh()
    assert (first.indexed, first.skipped) == (MAX_INDEXED_FILES, 0)
    write(root / "zz-last.txt", "the straw\n")  # walked last (name order)
    second = await index.refresh()
    assert (second.indexed, second.skipped, second.unchanged) == (0, 1, MAX_INDEXED_FILES)
    outcome = await index.search("straw")
    assert outcome.hits == [] and outcome.skipped == [(f"{root}/zz-last.txt", OVER_CAP)]
    (root / "src" / "a0000.txt").unlink()
    third = await index.refresh()
    assert (third.removed, third.indexed_paths) == (1, [f"{root}/zz-last.txt"])
    assert index.counts()["files"] == MAX_INDEXED_FILES


async def test_unreadable_documents_are_skipped_with_a_reason(index: KnowledgeIndex, root: Path) -> None:
    (root / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (root / "broken.docx").write_bytes(b"PK not a zip")
    (root / "binary.txt").write_bytes(b"\x00\x01\x02 binary")
    write(root / "fine.md", "fine content\n")
    os.symlink(root / "fine.md", root / "link.md")  # symlinks are not indexed (their target is)
    stats = await index.refresh()
    assert (stats.indexed, stats.skipped) == (1, 3)
    outcome = await index.search("fine")
    assert paths(outcome) == [f"{root}/fine.md"]
    reasons = dict(outcome.skipped)
    assert outcome.skipped_total == 3
    assert reasons[f"{root}/binary.txt"].startswith("unreadable txt")
    assert reasons[f"{root}/broken.docx"].startswith("unreadable docx")


async def test_a_stale_or_corrupt_index_file_is_rebuilt(tmp_path: Path, machine: Machine, root: Path) -> None:
    write(root / "a.md", "rebuild me\n")
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE files (whatever TEXT)")
        conn.execute("PRAGMA user_version = 99")
    idx = KnowledgeIndex(db, machine)
    assert (await idx.refresh()).indexed == 1
    await idx.close()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not an sqlite file at all" * 100)
    idx = KnowledgeIndex(garbage, machine)
    try:
        assert (await idx.refresh()).indexed == 1
        assert paths(await idx.search("rebuild")) == [f"{root}/a.md"]
    finally:
        await idx.close()


# ---------------------------------------------------------------- the registry and the tool


def test_tool_schema_and_action() -> None:
    tool = TOOLS["search"]
    assert (tool.name, tool.action, tool.read_only, tool.destructive) == ("search", Action.READ, True, False)
    props = tool.schema()["properties"]
    assert set(props) == {
        "query",
        "knowledgeBaseIds",
        "pathPrefix",
        "tags",
        "fileTypes",
        "updatedAfter",
        "updatedBefore",
        "limit",
    }
    assert all(p.get("description") for p in props.values())
    assert tool.schema()["required"] == ["query"]
    assert "image" in str(props["fileTypes"])


async def test_a_machine_has_one_index_kept_outside_the_workspace(
    tmp_path: Path, machine: Machine, root: Path
) -> None:
    write(root / "a.md", "alpha\n")
    services = MachineServices.of(machine)
    first, second = await asyncio.gather(services.knowledge(), services.knowledge())
    assert first is second and await services.knowledge() is first
    path = index_path(machine)
    assert first.db_path == path and path.is_file()
    assert path.is_relative_to(tmp_path / "home" / "knowledge") and not path.is_relative_to(root)
    assert first.counts()["files"] == 1  # refreshed on first use
    await services.close()
    assert first.closed
    reopened = MachineServices.of(machine)
    again = await reopened.knowledge()
    assert again is not first and again.db_path == path and again.counts()["files"] == 1
    await reopened.close()


async def test_search_in_a_real_sandbox(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    made = await sandbox.exec(
        ExecRequest(
            command="mkdir -p /workspace/notes && printf '# Plan\\n\\nlaunch the rocket\\n' > /workspace/notes/plan.md"
        )
    )
    assert made.exit_code == 0, made.stderr
    result = await search_tool(sandbox, query="rocket")
    assert (
        "[1] /workspace/notes/plan.md (lines 1-3, § Plan) — # Plan launch the **rocket**" in result.as_text()
    )
    db = index_path(sandbox)
    assert db == sandbox.workspace.parent / "knowledge.sqlite" and db.is_file()
    listing = await sandbox.exec(ExecRequest(command="ls -A /workspace"))
    # the index is not in the model's files (the trash's empty cover is all it sees of the server's)
    assert listing.stdout.decode().split() == [TRASH_DIR, "notes"]

    await sandbox.exec(ExecRequest(command="printf 'rocket fuel\\n' > /workspace/notes/fuel.txt"))

    async def both() -> bool:
        return len((await search_tool(sandbox, query="rocket")).data["results"]) == 2

    await eventually(both, "a file written inside the sandbox is found")
