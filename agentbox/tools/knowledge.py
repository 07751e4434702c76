"""Knowledge search (seed 001 `search`): an SQLite FTS5 index over a workspace's notes and documents.

What is indexed: markdown (`.md`, `.markdown`), txt (`.txt`), docx and pdf files under the
machine's root, skipping DEFAULT_EXCLUDES (`.git`, `node_modules`, ...) and symlinks. Each
file becomes chunks of about CHUNK_CHARS characters, and each chunk knows where it came from,
so a hit can be cited:

    markdown / txt   paragraphs (blank-line separated) packed up to CHUNK_CHARS; a markdown
                     heading starts a new chunk; cited by line range and heading
    pdf              the blocks of `pdf.read_pdf` (paragraphs in reading order, numbered through
                     the document), packed page by page; cited by page and block range
    docx             structural blocks (non-empty paragraphs and tables, numbered from 1 in
                     body order), grouped under their heading; cited by block range and heading

Chunks that are split for size overlap a little (CHUNK_OVERLAP_CHARS), so a sentence cut at a
boundary is still found whole in one of them.

Tags (the `tags` filter) come from a markdown note's frontmatter `tags:` (inline list, block
list or comma/space separated string) and from `#tag` words in markdown and txt outside code
fences; a docx's Keywords property and a pdf's /Keywords metadata count too. Tags compare
case-insensitively without the `#`; a filter tag also matches its nested tags (`project`
matches `project/alpha`). A file passes the filter when it has any of the tags given.

Queries are never FTS5 syntax from the model: every word or "quoted phrase" becomes a quoted
FTS5 string (a trailing `*` keeps a prefix search), so quotes, parentheses, `NEAR`, `col:` or
`-` in a query cannot be a syntax error. All terms must match; when no chunk has them all the
search falls back to any term and says so. Ranking is bm25. CJK text has no spaces between
words, so each CJK character is indexed as its own token and a CJK query word becomes a phrase
of its characters; snippets put the text back together.

Where the index lives and how it stays fresh: `KnowledgeIndex(db_path, machine)` keeps its own
SQLite file (WAL; a cache, rebuilt when its schema version changes or it is unreadable).
`refresh()` is a full incremental rescan by (mtime, size); `attach(hub)` adds a recursive
watcher on the root and a background task that re-indexes changed files and drops removed ones
as events arrive (a watcher overflow triggers a refresh), and every search first applies the
events recorded so far. The `search` tool asks the machine's services for the index
(`ctx.services.knowledge()`): one per machine, opened on first use on the machine's own watch
hub and refreshed before the first search, closed with the services. Its file is
`index_path(machine)`: beside the workspace directory for an isolated (per-session) machine,
`<session dir>/knowledge.sqlite`, never inside `/workspace`; under `$AGENTBOX_HOME/knowledge/`
for a shared machine, whose root's parent is not ours to write.

Every machine has an index. The scan runs in worker threads and reads notes through
`agentbox.tools.note_files`: by descriptor on a machine with host files, through the
`Machine` protocol on any other (ssh, e2b), where the watch hub follows the machine's own
watch stream (or its polling, whose latency the hub states).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import posixpath
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from agentbox.config import default_home
from agentbox.machines.base import TRASH_DIR, Machine
from agentbox.machines.errors import MachineError
from agentbox.tools.base import Action, Tool, ToolContext, ToolParams, ToolResult, shown_file_ids
from agentbox.tools.documents import read_docx
from agentbox.tools.knowledge_bases import Scope, ScopeError
from agentbox.tools.note_files import NoteFiles, NoteStat, note_files
from agentbox.tools.pdf import read_pdf
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import below
from agentbox.workspace.watch import (
    DEFAULT_EXCLUDES,
    MAX_POLL_LIMIT,
    MAX_POLL_TIMEOUT,
    Event,
    PollResult,
    Watcher,
    WatchHub,
    is_excluded,
)

log = logging.getLogger(__name__)

#: Target size of a chunk in characters: big enough to hold a paragraph or two with context,
#: small enough that a snippet and its citation point somewhere precise.
CHUNK_CHARS = 1200
#: Characters two neighbouring chunks of one section share when a section is split for size.
CHUNK_OVERLAP_CHARS = 150
#: Citations a search returns when the model does not say (seed 001: 4).
DEFAULT_RESULTS = 4
#: Most citations one search returns (seed 001: 16); a larger `limit` is clamped with a note.
MAX_RESULTS = 16
#: Files larger than this are not indexed (with a warning in search results): extraction
#: reads the whole file, and bigger files are better read by page or grepped.
MAX_INDEXED_FILE_BYTES = 20 * 1024 * 1024
#: Files one index holds; past it new files are not indexed (with a warning) until a refresh
#: finds room, so a huge tree cannot make the index unbounded.
MAX_INDEXED_FILES = 10_000
#: Query terms used; the rest of a longer query is ignored with a note.
MAX_QUERY_TERMS = 32
#: Longest query accepted, in characters (the schema says so; pydantic refuses longer).
MAX_QUERY_CHARS = 1000
#: Knowledge base ids one search names (`knowledgeBaseIds`); more is refused by the schema.
MAX_KNOWLEDGE_BASE_IDS = 64
#: Tokens of context in a snippet (FTS5 `snippet()` caps this at 64).
SNIPPET_TOKENS = 24
#: Not-indexed files named in a search's warning; the rest are counted.
MAX_SKIPPED_NAMED = 3
#: Tuning, not limits: a refresh writes this many files, or this much extracted text, per
#: transaction (FTS5 is about ten times faster in batches than file by file).
BATCH_FILES = 256
BATCH_CHARS = 16 * 1024 * 1024
#: How long a write waits for another process holding the index file (milliseconds).
BUSY_TIMEOUT_MS = 5000
#: Bumped when the tables change; an index file with another version is rebuilt (it is a cache).
SCHEMA_VERSION = 2
#: The index file of an isolated machine, beside its workspace directory.
INDEX_FILENAME = "knowledge.sqlite"

FileType = Literal["markdown", "txt", "docx", "pdf"]
FILE_TYPES: tuple[FileType, ...] = ("markdown", "txt", "docx", "pdf")
EXTENSIONS: dict[str, FileType] = {
    ".md": "markdown",
    ".markdown": "markdown",
    ".txt": "txt",
    ".docx": "docx",
    ".pdf": "pdf",
}
#: Why a file in the index has no chunks, when it is because of MAX_INDEXED_FILES (retried on refresh).
OVER_CAP = f"over the {MAX_INDEXED_FILES}-file index limit"

IMAGE_NOTE = (
    "fileTypes 'image' was ignored: images have no searchable text (no OCR). "
    "Find images by name with list, then look at one with read."
)

# CJK ideographs and kana: scripts written without spaces between words.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_SPLIT = re.compile(rf"(?<=\S)(?=[{_CJK}])|(?<=[{_CJK}])(?=\S)")
_CJK_JOIN = re.compile(rf"(?<=[{_CJK}]) |(?<=[{_CJK}][\x02\x03]) | (?=[\x02\x03]?[{_CJK}])")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HASHTAG = re.compile(r"(?:^|(?<=[\s(\[]))#([^\W\d][\w/-]*)")
_QUERY_TOKEN = re.compile(r'"([^"]*)"?|(\S+)')
_OPERATORS = {"AND", "OR", "NOT"}
# Snippet markers: control characters that never occur in indexed text (they are stripped).
_MARK_START, _MARK_END = "\x02", "\x03"


class SearchInputError(ValueError):
    """A query or filter the model can fix; its message goes back as the tool's error."""


# ---------------------------------------------------------------- extraction


@dataclass(frozen=True)
class Piece:
    """A unit chunks are packed from: a paragraph, a heading, a docx block, or a window of one."""

    text: str
    first: int  # line (text) or block (docx) number
    last: int
    heading: str | None
    starts_section: bool = False


@dataclass(frozen=True)
class Chunk:
    text: str
    first: int
    last: int
    heading: str | None
    page: int | None = None  # a PDF's chunk: the page its blocks are on


@dataclass(frozen=True)
class Extracted:
    chunks: list[Chunk]
    tags: set[str]


def file_type(name: str) -> FileType | None:
    return EXTENSIONS.get(posixpath.splitext(name)[1].lower())


def windows(text: str) -> list[str]:
    """`text` cut into CHUNK_CHARS pieces that overlap by CHUNK_OVERLAP_CHARS (blank ones dropped)."""
    step = CHUNK_CHARS - CHUNK_OVERLAP_CHARS
    cuts = (text[i : i + CHUNK_CHARS] for i in range(0, max(len(text) - CHUNK_OVERLAP_CHARS, 1), step))
    return [w for w in cuts if w.strip()]


def _block_pieces(lines: list[str], start: int, heading: str | None, starts: bool) -> list[Piece]:
    """A block of consecutive lines as pieces no longer than CHUNK_CHARS."""
    text = "\n".join(lines)
    if len(text) <= CHUNK_CHARS:
        return [Piece(text, start, start + len(lines) - 1, heading, starts)]
    pieces: list[Piece] = []
    group: list[str] = []
    group_start = start

    def close_group() -> None:
        if group:
            pieces.append(Piece("\n".join(group), group_start, group_start + len(group) - 1, heading))

    for n, line in enumerate(lines, start=start):
        if len(line) > CHUNK_CHARS:
            close_group()
            group, group_start = [], n + 1
            pieces.extend(Piece(w, n, n, heading) for w in windows(line))
            continue
        if group and sum(len(g) + 1 for g in group) + len(line) > CHUNK_CHARS:
            close_group()
            group, group_start = [], n
        group.append(line)
    close_group()
    if pieces and starts:
        pieces[0] = Piece(pieces[0].text, pieces[0].first, pieces[0].last, heading, True)
    return pieces


def text_pieces(lines: list[str], first_line: int = 1, *, markdown: bool) -> list[Piece]:
    """Paragraphs (blank-line separated) as pieces; in markdown a heading is a piece of its own
    that starts a section, and blank lines inside a code fence do not end a paragraph."""
    pieces: list[Piece] = []
    heading: str | None = None
    block: list[str] = []
    start = first_line
    starts = False
    in_fence = False

    def flush() -> None:
        nonlocal block, starts
        if block:
            pieces.extend(_block_pieces(block, start, heading, starts))
            starts = False
        block = []

    for n, raw in enumerate(lines, start=first_line):
        line = raw.rstrip("\r")
        is_fence = markdown and _FENCE.match(line) is not None
        match = _HEADING.match(line) if markdown and not in_fence and not is_fence else None
        if match:
            flush()
            heading, starts = match.group(2).strip() or None, True
            block, start = [line], n
            flush()
            continue
        if not line.strip() and not in_fence:
            flush()
            continue
        if not block:
            start = n
        block.append(line)
        if is_fence:
            in_fence = not in_fence
    flush()
    return pieces


def pack(pieces: Iterable[Piece]) -> list[Chunk]:
    """Consecutive pieces joined into chunks of up to CHUNK_CHARS; a section start begins a new
    chunk, and a chunk cut for size repeats its last piece (if short) at the start of the next."""
    chunks: list[Chunk] = []
    current: list[Piece] = []
    carried = 0  # how many of `current` were carried over from the previous chunk

    def size() -> int:
        return sum(len(p.text) + 2 for p in current)

    def flush(overlap: bool) -> None:
        nonlocal current, carried
        if len(current) > carried:
            texts = "\n\n".join(p.text for p in current)
            chunks.append(Chunk(texts, current[0].first, current[-1].last, current[-1].heading))
        last = current[-1] if current else None
        keep = overlap and last is not None and len(current) > 1 and len(last.text) <= CHUNK_OVERLAP_CHARS
        current = [last] if keep and last is not None else []
        carried = len(current)

    for piece in pieces:
        if piece.starts_section:
            flush(False)
        elif current and size() + len(piece.text) > CHUNK_CHARS:
            if len(current) == carried:
                current, carried = [], 0  # the carried piece alone would overflow: drop it
            else:
                flush(True)
                if current and size() + len(piece.text) > CHUNK_CHARS:
                    current, carried = [], 0
        current.append(piece)
    flush(False)
    return chunks


def _clean(text: str) -> str:
    """Text as indexed: no NULs or our snippet markers."""
    return text.replace("\x00", "").replace(_MARK_START, "").replace(_MARK_END, "")


def split_frontmatter(lines: list[str]) -> tuple[list[str], int]:
    """The frontmatter lines of a markdown note (between leading `---` lines) and where its body starts."""
    if not lines or lines[0].rstrip("\r").strip() != "---":
        return [], 0
    for n in range(1, len(lines)):
        if lines[n].rstrip("\r").strip() in ("---", "..."):
            return lines[1:n], n + 1
    return [], 0


def normalize_tag(tag: str) -> str:
    return tag.strip().strip("'\"").lstrip("#").strip().lower()


def frontmatter_tags(meta: list[str]) -> set[str]:
    """`tags:` of a frontmatter block: `[a, b]`, `a, b`, `a b`, or a `- a` list below it."""
    tags: set[str] = set()
    for n, raw in enumerate(meta):
        key, sep, value = raw.partition(":")
        if not sep or key.strip().lower() != "tags" or raw[:1].isspace():
            continue
        value = value.strip()
        if value:
            tags.update(re.split(r"[,\s]+", value.strip("[]")))
        else:
            for item in meta[n + 1 :]:
                stripped = item.strip()
                if not stripped.startswith("-"):
                    break
                tags.add(stripped[1:])
    return {t for t in map(normalize_tag, tags) if t}


def hashtags(lines: list[str]) -> set[str]:
    """`#tag` words outside code fences (a `# heading` has a space, so it is not one)."""
    tags: set[str] = set()
    in_fence = False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            tags.update(m.group(1).rstrip("/-").lower() for m in _HASHTAG.finditer(line))
    return tags


def keyword_tags(keywords: str | None) -> set[str]:
    return {t for t in map(normalize_tag, re.split(r"[,;]", keywords or "")) if t}


def extract_text(data: bytes, *, markdown: bool) -> Extracted:
    if b"\x00" in data[:8192]:
        raise ValueError("binary content")
    lines = _clean(data.decode("utf-8-sig", errors="replace")).split("\n")
    meta, body = split_frontmatter(lines) if markdown else ([], 0)
    tags = frontmatter_tags(meta) | hashtags(lines[body:])
    return Extracted(pack(text_pieces(lines[body:], body + 1, markdown=markdown)), tags)


def extract_pdf(data: bytes) -> Extracted:
    """Blocks packed page by page (a chunk never spans pages); a chunk's first/last are block
    numbers, the ones `read block=N` takes (`pdf.read_pdf` is the one extractor of both)."""
    doc = read_pdf(data)
    chunks: list[Chunk] = []
    for page in doc.pages:
        pieces: list[Piece] = []
        for block in page.blocks:
            text = _clean(block.text)
            parts = [text] if len(text) <= CHUNK_CHARS else windows(text)
            pieces.extend(Piece(p, block.number, block.number, None) for p in parts)
        chunks.extend(Chunk(c.text, c.first, c.last, None, page.number) for c in pack(pieces))
    return Extracted(chunks, keyword_tags(doc.keywords))


def extract_docx(data: bytes) -> Extracted:
    """Blocks grouped under their heading; a chunk's first/last are block numbers, the ones
    `read block=N` takes (`documents.read_docx` is the one extractor of both)."""
    body = read_docx(data)
    pieces: list[Piece] = []
    heading: str | None = None
    for block in body.blocks:
        text = _clean(block.text)
        if block.level is not None:
            heading = text
        starts = block.level is not None
        parts = [text] if len(text) <= CHUNK_CHARS else windows(text)
        pieces.extend(
            Piece(p, block.number, block.number, heading, starts and i == 0) for i, p in enumerate(parts)
        )
    return Extracted(pack(pieces), keyword_tags(body.keywords))


def extract(data: bytes, kind: FileType) -> Extracted:
    if kind == "pdf":
        return extract_pdf(data)
    if kind == "docx":
        return extract_docx(data)
    return extract_text(data, markdown=kind == "markdown")


def cjk_spaced(text: str) -> str:
    """CJK characters as separate tokens for FTS5's unicode61 tokenizer."""
    return _CJK_SPLIT.sub(" ", text)


def cjk_joined(text: str) -> str:
    """Undo `cjk_spaced` in a snippet (a space the author put next to a CJK character goes too)."""
    return _CJK_JOIN.sub("", text)


def citation(kind: str, first: int, last: int, heading: str | None, page: int | None = None) -> str:
    """Where a chunk is, as the model should quote it: page, block range or line range, and heading."""
    unit = "block" if kind in ("docx", "pdf") else "line"
    where = f"{unit} {first}" if first == last else f"{unit}s {first}-{last}"
    if kind == "pdf":
        return f"page {page}, {where}"
    if heading:
        where += f', heading "{heading}"' if kind == "docx" else f", § {heading}"
    return where


# ---------------------------------------------------------------- queries


@dataclass(frozen=True)
class FtsQuery:
    all_terms: str
    any_term: str
    terms: int
    dropped: int


def fts_query(query: str) -> FtsQuery:
    """The model's query as safe FTS5: each word or "phrase" a quoted string, `word*` a prefix.

    Raises SearchInputError when nothing searchable is left.
    """
    terms: list[str] = []
    for match in _QUERY_TOKEN.finditer(_clean(query)):
        phrase, word = match.group(1), match.group(2)
        text = phrase if phrase is not None else word
        if word is not None and word in _OPERATORS:
            continue
        prefix = word is not None and word.endswith("*")
        text = cjk_spaced(text.replace('"', " ").rstrip("*" if prefix else ""))
        if not re.search(r"\w", text):
            continue
        terms.append(f'"{" ".join(text.split())}"' + ("*" if prefix else ""))
    if not terms:
        raise SearchInputError(f"query {query!r} has no words to search for")
    kept = list(dict.fromkeys(terms))[:MAX_QUERY_TERMS]
    return FtsQuery(" AND ".join(kept), " OR ".join(kept), len(kept), len(dict.fromkeys(terms)) - len(kept))


def parse_time(value: str, name: str) -> float:
    """An ISO date or date-time as a timestamp; one without a zone is UTC."""
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise SearchInputError(
            f"{name} must be an ISO date or date-time such as 2024-05-01 or 2024-05-01T12:00:00Z, got {value!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


@dataclass(frozen=True)
class Filters:
    """What a search may look at; every field only narrows (None / empty = no restriction)."""

    path_prefix: str | None = None  # an absolute inside path, compared as a string prefix
    tags: tuple[str, ...] = ()
    file_types: tuple[FileType, ...] = ()
    updated_after: float | None = None  # mtime >= this (timestamp)
    updated_before: float | None = None  # mtime < this
    within: tuple[str, ...] = ()  # folders (knowledge base roots) a file must be in, any of them
    without: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Folders (unselected knowledge bases) a file must not be in, each with the chosen folders
    inside it that are in again: the deepest knowledge base holding a file decides."""

    def where(self) -> tuple[str, list[object]]:
        """SQL conditions on `f` (files) and their parameters."""
        clauses: list[str] = []
        args: list[object] = []
        if self.within:
            clauses.append(_inside_any(self.within, args))
        for folder, again in self.without:
            inside = _inside_any((folder,), args)
            clauses.append(f"(NOT {inside} OR {_inside_any(again, args)})" if again else f"NOT {inside}")
        if self.path_prefix:
            clauses.append("substr(f.path, 1, ?) = ?")
            args += [len(self.path_prefix), self.path_prefix]
        if self.file_types:
            clauses.append(f"f.file_type IN ({', '.join('?' * len(self.file_types))})")
            args += list(self.file_types)
        if self.updated_after is not None:
            clauses.append("f.mtime_ns >= ?")
            args.append(int(self.updated_after * 1e9))
        if self.updated_before is not None:
            clauses.append("f.mtime_ns < ?")
            args.append(int(self.updated_before * 1e9))
        if self.tags:
            tag_match = " OR ".join("t.tag = ? OR substr(t.tag, 1, ?) = ?" for _ in self.tags)
            clauses.append(f"EXISTS (SELECT 1 FROM tags t WHERE t.path = f.path AND ({tag_match}))")
            for tag in self.tags:
                args += [tag, len(tag) + 1, tag + "/"]
        return " AND ".join(clauses) or "1", args


def _inside_any(folders: Sequence[str], args: list[object]) -> str:
    """An SQL condition: `f.path` lies inside one of `folders` (their parameters go to `args`)."""
    for folder in folders:
        top = folder.rstrip("/") + "/"
        args += [len(top), top]
    return "(" + " OR ".join("substr(f.path, 1, ?) = ?" for _ in folders) + ")"


@dataclass(frozen=True)
class Hit:
    path: str
    file_type: str
    first: int
    last: int
    heading: str | None
    snippet: str
    score: float
    page: int | None = None

    @property
    def citation(self) -> str:
        return citation(self.file_type, self.first, self.last, self.heading, self.page)

    def to_dict(self) -> dict[str, object]:
        unit = "block" if self.file_type in ("docx", "pdf") else "line"
        return {
            "path": self.path,
            "fileType": self.file_type,
            "citation": self.citation,
            "page": self.page,
            "unit": unit,
            "first": self.first,
            "last": self.last,
            "heading": self.heading,
            "snippet": self.snippet,
            "score": self.score,
        }


@dataclass(frozen=True)
class SearchOutcome:
    hits: list[Hit]
    total: int  # matching chunks in scope
    any_term: bool  # no chunk had every term; these match some
    skipped: list[tuple[str, str]]  # (path, reason) of not-indexed files in scope, first few
    skipped_total: int
    dropped_terms: int = 0  # query terms past MAX_QUERY_TERMS, ignored


@dataclass(frozen=True)
class _Prepared:
    """One file's new rows, extracted outside the lock, stored by `_store`."""

    inside: str
    kind: FileType
    st: NoteStat
    skipped: str | None  # why it gets no chunks; None when it is indexed
    extracted: Extracted = Extracted([], set())

    @property
    def chars(self) -> int:
        return sum(len(c.text) for c in self.extracted.chunks)


@dataclass
class RefreshStats:
    indexed: int = 0  # files (re)extracted
    unchanged: int = 0  # same (mtime, size) as indexed: left alone
    removed: int = 0
    skipped: int = 0  # too large, unreadable or over the file cap
    indexed_paths: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the index

_SCHEMA = (
    """CREATE TABLE files (
        path TEXT PRIMARY KEY,          -- inside path
        file_type TEXT NOT NULL,
        mtime_ns INTEGER NOT NULL,
        size INTEGER NOT NULL,
        skipped TEXT                    -- why it has no chunks, NULL when indexed
    )""",
    "CREATE TABLE tags (path TEXT NOT NULL, tag TEXT NOT NULL, PRIMARY KEY (path, tag)) WITHOUT ROWID",
    """CREATE TABLE chunks (
        id INTEGER PRIMARY KEY,         -- = chunks_fts.rowid
        path TEXT NOT NULL,
        ord INTEGER NOT NULL,
        first INTEGER NOT NULL,         -- line or block
        last INTEGER NOT NULL,
        heading TEXT,
        page INTEGER                    -- a pdf's chunk: its page
    )""",
    "CREATE INDEX chunks_by_path ON chunks (path)",
    "CREATE VIRTUAL TABLE chunks_fts USING fts5 (text, heading, tokenize = 'unicode61 remove_diacritics 2')",
)


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN ... COMMIT, or ROLLBACK on error (the connection is in autocommit mode otherwise)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _connect(db_path: Path) -> sqlite3.Connection:
    """Open the index file, rebuilding it when it is unreadable or of another schema version."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
                with _transaction(conn):
                    for table in tables:
                        if not table.startswith("chunks_fts_"):
                            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return conn
        except sqlite3.DatabaseError as exc:
            conn.close()
            if attempt or isinstance(exc, sqlite3.OperationalError):
                raise  # locked, read-only, ...: not ours to delete
            log.warning("knowledge index %s is unreadable; rebuilding it", db_path)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{db_path}{suffix}")
    raise AssertionError("unreachable")


def _too_large(size: int) -> str:
    return f"larger than {MAX_INDEXED_FILE_BYTES} bytes ({size} bytes)"


class KnowledgeIndex:
    """The FTS5 index of one machine's root. Blocking work runs in threads under one lock."""

    def __init__(
        self, db_path: Path, machine: Machine, root: str | None = None, *, files: NoteFiles | None = None
    ) -> None:
        """`files` is how notes are read (`note_files(machine)` by default: construct the index on
        the event loop, or pass it, when the machine is reached through the protocol)."""
        self.db_path = db_path
        self.machine = machine
        self.files = files or note_files(machine)
        self.root = root if root is not None else str(machine.root)
        self.closed = False
        self._conn = _connect(db_path)
        self._lock = threading.Lock()
        #: Files with chunks (skipped IS NULL), kept in step with the table for the MAX_INDEXED_FILES check.
        self._indexed = 0
        self._recount()
        self._hub: WatchHub | None = None
        self._own_hub = False
        self._watcher: Watcher | None = None
        self._follower: asyncio.Task[None] | None = None
        self._settling: asyncio.Lock | None = None
        self._cursor = 0

    # -- public surface ------------------------------------------------------------------

    async def refresh(self) -> RefreshStats:
        """Rescan the root: re-index files whose (mtime, size) changed, drop the ones gone."""
        return await asyncio.to_thread(self._refresh)

    async def attach(self, hub: WatchHub, *, own: bool = False) -> None:
        """Follow changes under the root through a recursive watcher on `hub` (closed with us if `own`)."""
        if self._watcher is not None:
            raise RuntimeError("the index already follows a watcher")
        self._hub, self._own_hub = hub, own
        self._settling = asyncio.Lock()
        self._watcher = await hub.start(self.root, recursive=True)
        self._follower = asyncio.get_running_loop().create_task(self._follow(), name="knowledge-follow")

    async def settle(self) -> None:
        """Apply every change the watcher has recorded so far (searches do this first)."""
        if self._watcher is None or self._settling is None or self.closed:
            return
        async with self._settling:
            while not self.closed:
                page = await self._watcher.poll(self._cursor, 0.0, MAX_POLL_LIMIT)
                await self._apply(page)
                if not page.events:
                    return

    async def search(
        self, query: str, filters: Filters | None = None, limit: int = DEFAULT_RESULTS
    ) -> SearchOutcome:
        """The best `limit` chunks for `query` in scope, by bm25. Raises SearchInputError for a bad query."""
        fts = fts_query(query)
        await self.settle()
        return await asyncio.to_thread(self._search, fts, filters or Filters(), limit)

    async def close(self) -> None:
        self.closed = True
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._follower
        if self._hub is not None and self._watcher is not None:
            with contextlib.suppress(WorkspaceError):
                self._hub.delete(self._watcher.id)
            if self._own_hub:
                await self._hub.close()
        await asyncio.to_thread(self._close_db)

    def counts(self) -> dict[str, int]:
        """Indexed files, skipped files and chunks (for status lines and tests)."""
        with self._lock:
            files = self._conn.execute("SELECT count(*) FROM files WHERE skipped IS NULL").fetchone()[0]
            skipped = self._conn.execute("SELECT count(*) FROM files WHERE skipped IS NOT NULL").fetchone()[0]
            chunks = self._conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
        return {"files": files, "skipped": skipped, "chunks": chunks}

    # -- following the watcher ------------------------------------------------------------

    async def _follow(self) -> None:
        watcher = self._watcher
        assert watcher is not None and self._settling is not None
        while not self.closed:
            page = await watcher.poll(self._cursor, MAX_POLL_TIMEOUT, MAX_POLL_LIMIT)
            if watcher.closed and not page.events:
                log.warning(
                    "knowledge index: the watcher on %s stopped; the index is no longer followed", self.root
                )
                return
            async with self._settling:
                try:
                    await self._apply(page)
                except Exception:
                    log.exception("knowledge index: failed to apply changes under %s", self.root)

    async def _apply(self, page: PollResult) -> None:
        """Events after our cursor (another caller may have applied part of `page` already)."""
        if page.overflow:
            await asyncio.to_thread(self._refresh)
        fresh = [e for e in page.events if e.seq > self._cursor]
        self._cursor = max(self._cursor, page.cursor)
        if fresh:
            await asyncio.to_thread(self._apply_events, fresh)

    def _apply_events(self, events: list[Event]) -> None:
        for event in events:
            if self.closed:
                return
            try:
                if event.old_path is not None:
                    self._drop_tree(event.old_path)
                if event.type == "remove":
                    self._drop_tree(event.path)
                elif event.is_dir:
                    if event.type in ("create", "rename"):
                        self._sync_dir(event.path)
                else:
                    self._sync_file(event.path)
            except Exception:
                if self.closed:
                    return
                log.exception("knowledge index: could not apply %s %s", event.type, event.path)
        self._fill_room(RefreshStats())

    # -- scanning -------------------------------------------------------------------------

    def _refresh(self, under: str | None = None) -> RefreshStats:
        """Rescan the root (or the inside directory `under`), writing in batches of one transaction each."""
        stats = RefreshStats()
        top = under or self.root
        known = {
            row[0]: (row[1], row[2], row[3])
            for row in self._rows("SELECT path, mtime_ns, size, skipped FROM files")
            if under is None or row[0].startswith(top.rstrip("/") + "/")
        }
        seen: set[str] = set()
        batch: list[_Prepared] = []
        chars = 0
        for inside, st, kind in self._candidates(top):
            if self.closed:
                return stats
            row = known.get(inside)
            if row is not None and row[:2] == (st.mtime_ns, st.size) and row[2] != OVER_CAP:
                seen.add(inside)
                stats.unchanged += 1
                continue
            prepared = self._prepare(inside, kind, indexed=row is not None and row[2] is None, seen=st)
            if prepared is None:
                continue  # gone meanwhile: dropped below if it was indexed
            seen.add(inside)
            batch.append(prepared)
            chars += prepared.chars
            if len(batch) >= BATCH_FILES or chars >= BATCH_CHARS:
                self._store(batch, stats)
                batch, chars = [], 0
        self._store(batch, stats)
        gone = sorted(known.keys() - seen)
        self._drop(gone)
        stats.removed += len(gone)
        self._fill_room(stats)
        return stats

    def _fill_room(self, stats: RefreshStats) -> None:
        """Index files that were over MAX_INDEXED_FILES, in path order, while there is room for them."""
        room = MAX_INDEXED_FILES - self._indexed
        if room <= 0 or self.closed:
            return
        waiting = self._rows(
            "SELECT path, file_type FROM files WHERE skipped = ? ORDER BY path LIMIT ?", (OVER_CAP, room)
        )
        batch: list[_Prepared] = []
        for inside, kind in waiting:
            prepared = self._prepare(inside, kind, indexed=False)
            if prepared is not None:
                batch.append(prepared)
        self._store(batch, stats)

    def _candidates(self, top: str) -> Iterator[tuple[str, NoteStat, FileType]]:
        """Indexable regular files under inside directory `top` (inside path, stat, type), in name
        order, outside the excludes; never through a link."""
        try:
            where = self.files.locate(top, self.root)
        except (OSError, MachineError):
            return

        def parts(rel: str) -> tuple[str, ...]:
            return (*where.base, *rel.split("/"))

        def descend(rel: str) -> bool:
            path = parts(rel)
            in_trash = where.under_root and path[0] == TRASH_DIR  # what a delete moved away is not indexed
            return not in_trash and not is_excluded(path, DEFAULT_EXCLUDES)

        try:
            for found in self.files.walk(where.start, descend):
                kind = file_type(posixpath.basename(found.inside))
                if kind is None or found.note is None or is_excluded(parts(found.rel), DEFAULT_EXCLUDES):
                    continue
                yield found.inside, found.note, kind
        except (OSError, MachineError):
            return  # the directory itself went away or cannot be read

    def _sync_dir(self, inside: str) -> None:
        self._refresh(under=inside)

    def _sync_file(self, inside: str) -> None:
        """Bring one path up to date: index it if it is a changed indexable file, else drop it."""
        kind = file_type(inside)
        if kind is None or not self._in_scope(inside):
            return
        try:
            st = self.files.stat(inside)
        except (OSError, MachineError):
            st = None
        if st is None:
            self._drop([inside])
            return
        rows = self._rows("SELECT mtime_ns, size, skipped FROM files WHERE path = ?", (inside,))
        row = rows[0] if rows else None
        if row is not None and tuple(row[:2]) == (st.mtime_ns, st.size) and row[2] != OVER_CAP:
            return
        prepared = self._prepare(inside, kind, indexed=row is not None and row[2] is None, seen=st)
        if prepared is None:
            self._drop([inside])
        else:
            self._store([prepared], RefreshStats())

    def _in_scope(self, inside: str) -> bool:
        root = self.root.rstrip("/")
        if not inside.startswith(root + "/"):
            return False
        return not is_excluded(tuple(inside[len(root) + 1 :].split("/")), DEFAULT_EXCLUDES)

    # -- writing the index ---------------------------------------------------------------

    def _prepare(
        self, inside: str, kind: FileType, *, indexed: bool, seen: NoteStat | None = None
    ) -> _Prepared | None:
        """Read and extract one file, no database work; None when it is gone. A file that cannot be
        indexed gets the reason, so it is not retried until it changes. `seen` is its stat from
        the walk: a file over the cap is then recorded without being read."""
        if seen is not None and not indexed and self._indexed >= MAX_INDEXED_FILES:
            return _Prepared(inside, kind, seen, OVER_CAP)  # checked again, exactly, when stored
        try:
            st, data = self.files.read(inside, MAX_INDEXED_FILE_BYTES, seen)
        except (OSError, MachineError):
            return None
        if data is None:
            return _Prepared(inside, kind, st, _too_large(st.size))
        if not indexed and self._indexed >= MAX_INDEXED_FILES:
            return _Prepared(inside, kind, st, OVER_CAP)
        try:
            return _Prepared(inside, kind, st, None, extract(data, kind))
        except Exception as exc:  # pypdf / python-docx raise many types on malformed files
            return _Prepared(inside, kind, st, f"unreadable {kind}: {exc}"[:300])

    def _store(self, batch: list[_Prepared], stats: RefreshStats) -> None:
        """Replace the rows of each prepared file, in one transaction."""
        if not batch:
            return
        with self._lock:
            if self.closed:
                return
            try:
                with _transaction(self._conn):
                    for prepared in batch:
                        self._delete_rows(prepared.inside)
                        if prepared.skipped is None and self._indexed >= MAX_INDEXED_FILES:
                            prepared = _Prepared(prepared.inside, prepared.kind, prepared.st, OVER_CAP)
                        self._insert_rows(prepared)
                        if prepared.skipped is None:
                            stats.indexed += 1
                            stats.indexed_paths.append(prepared.inside)
                        else:
                            stats.skipped += 1
                            log.warning(
                                "knowledge index: not indexing %s: %s", prepared.inside, prepared.skipped
                            )
            except sqlite3.Error:
                self._recount()
                raise

    def _insert_rows(self, prepared: _Prepared) -> None:
        inside, st = prepared.inside, prepared.st
        self._conn.execute(
            "INSERT INTO files (path, file_type, mtime_ns, size, skipped) VALUES (?, ?, ?, ?, ?)",
            (inside, prepared.kind, st.mtime_ns, st.size, prepared.skipped),
        )
        self._indexed += prepared.skipped is None
        self._conn.executemany(
            "INSERT INTO tags VALUES (?, ?)", [(inside, t) for t in sorted(prepared.extracted.tags)]
        )
        for ord_, chunk in enumerate(prepared.extracted.chunks):
            cur = self._conn.execute(
                "INSERT INTO chunks (path, ord, first, last, heading, page) VALUES (?, ?, ?, ?, ?, ?)",
                (inside, ord_, chunk.first, chunk.last, chunk.heading, chunk.page),
            )
            self._conn.execute(
                "INSERT INTO chunks_fts (rowid, text, heading) VALUES (?, ?, ?)",
                (cur.lastrowid, cjk_spaced(chunk.text), cjk_spaced(chunk.heading or "")),
            )

    def _delete_rows(self, inside: str) -> None:
        row = self._conn.execute("SELECT skipped FROM files WHERE path = ?", (inside,)).fetchone()
        if row is None:
            return
        self._indexed -= row[0] is None
        self._conn.execute(
            "DELETE FROM chunks_fts WHERE rowid IN (SELECT id FROM chunks WHERE path = ?)", (inside,)
        )
        self._conn.execute("DELETE FROM chunks WHERE path = ?", (inside,))
        self._conn.execute("DELETE FROM tags WHERE path = ?", (inside,))
        self._conn.execute("DELETE FROM files WHERE path = ?", (inside,))

    def _recount(self) -> None:
        self._indexed = self._conn.execute("SELECT count(*) FROM files WHERE skipped IS NULL").fetchone()[0]

    def _drop(self, paths: list[str]) -> None:
        if not paths:
            return
        with self._lock:
            if self.closed:
                return
            try:
                with _transaction(self._conn):
                    for inside in paths:
                        self._delete_rows(inside)
            except sqlite3.Error:
                self._recount()
                raise

    def _drop_tree(self, inside: str) -> None:
        """A path and everything indexed below it (a removed or renamed directory)."""
        below = inside.rstrip("/") + "/"
        rows = self._rows(
            "SELECT path FROM files WHERE path = ? OR substr(path, 1, ?) = ?", (inside, len(below), below)
        )
        self._drop([r[0] for r in rows])

    def _rows(self, sql: str, args: tuple[object, ...] = ()) -> list[Any]:
        """A read under the lock; nothing once closed (a thread may outlive the task that started it)."""
        with self._lock:
            return [] if self.closed else self._conn.execute(sql, args).fetchall()

    def _close_db(self) -> None:
        with self._lock:
            self._conn.close()

    # -- querying --------------------------------------------------------------------------

    def _search(self, fts: FtsQuery, filters: Filters, limit: int) -> SearchOutcome:
        where, args = filters.where()
        base = (
            "FROM chunks_fts JOIN chunks c ON c.id = chunks_fts.rowid JOIN files f ON f.path = c.path "
            f"WHERE chunks_fts MATCH ? AND {where}"
        )
        select = (
            "SELECT c.path, f.file_type, c.first, c.last, c.heading, "
            f"snippet(chunks_fts, 0, char(2), char(3), '…', {SNIPPET_TOKENS}), bm25(chunks_fts, 1.0, 0.5) AS score, "
            "c.page "
            f"{base} ORDER BY score, c.path, c.ord LIMIT ?"
        )
        with self._lock:
            any_term = False
            total = self._conn.execute(f"SELECT count(*) {base}", [fts.all_terms, *args]).fetchone()[0]
            match = fts.all_terms
            if total == 0 and fts.terms > 1:
                total = self._conn.execute(f"SELECT count(*) {base}", [fts.any_term, *args]).fetchone()[0]
                match, any_term = fts.any_term, total > 0
            rows = self._conn.execute(select, [match, *args, limit]).fetchall() if total else []
            skipped_rows = self._conn.execute(
                f"SELECT path, skipped FROM files f WHERE skipped IS NOT NULL AND {where} ORDER BY path",
                args,
            ).fetchall()
        hits = [Hit(r[0], r[1], r[2], r[3], r[4], _snippet_text(r[5]), r[6], r[7]) for r in rows]
        named = [(r[0], r[1]) for r in skipped_rows[:MAX_SKIPPED_NAMED]]
        return SearchOutcome(hits, total, any_term, named, len(skipped_rows), fts.dropped)


def _snippet_text(raw: str) -> str:
    """One line of snippet: whitespace collapsed, CJK rejoined, neighbouring highlights merged."""
    text = cjk_joined(" ".join(raw.split())).replace(_MARK_END + _MARK_START, "")
    return text.replace(_MARK_START, "**").replace(_MARK_END, "**")


# ---------------------------------------------------------------- one index per machine


def index_path(machine: Machine) -> Path:
    """Where a machine's index lives: beside an isolated machine's workspace directory (its
    session directory), else under `$AGENTBOX_HOME/knowledge/` by machine and root."""
    workspace = getattr(machine, "workspace", None)  # the host folder of an isolated machine's root
    if machine.isolated and workspace is not None:
        return Path(workspace).parent / INDEX_FILENAME
    digest = hashlib.sha256(str(machine.root).encode()).hexdigest()[:16]
    return default_home() / "knowledge" / f"{machine.name}-{digest}.sqlite"


async def open_index(machine: Machine, hub: WatchHub, db_path: Path | None = None) -> KnowledgeIndex:
    """A machine's index, following its changes through `hub`, refreshed; the caller closes it.

    One per machine: `agentbox.tools.services.MachineServices.knowledge` keeps it. A machine
    with host files is read by descriptor, any other through the `Machine` protocol.
    """
    files = note_files(machine)
    index = await asyncio.to_thread(KnowledgeIndex, db_path or index_path(machine), machine, files=files)
    try:
        await index.attach(hub)
        await index.refresh()
    except BaseException:
        await index.close()
        raise
    return index


# ---------------------------------------------------------------- the tool

SearchFileType = Literal["markdown", "txt", "docx", "pdf", "image"]


class SearchParams(ToolParams):
    query: str = Field(
        min_length=1,
        max_length=MAX_QUERY_CHARS,
        description=(
            'Words to find; all must appear in a chunk (falls back to any when none has them all). "Quote" a '
            "phrase; end a word with * to match it as a prefix. Plain text, not a query language."
        ),
    )
    knowledgeBaseIds: list[str] | None = Field(
        default=None,
        max_length=MAX_KNOWLEDGE_BASE_IDS,
        description=(
            "Only these of the session's knowledge bases (by id); by default every one it selected. "
            "It can only narrow the search."
        ),
    )
    pathPrefix: str | None = Field(
        default=None,
        description=(
            "Only files whose path starts with this (relative to the first knowledge base's root, or "
            "absolute inside one)."
        ),
    )
    tags: list[str] | None = Field(
        default=None,
        description=(
            "Only files carrying any of these tags: markdown frontmatter `tags:`, #tag words in notes, "
            "docx/pdf keywords. Case-insensitive; `project` also matches `project/alpha`."
        ),
    )
    fileTypes: list[SearchFileType] | None = Field(
        default=None,
        description="Only these kinds of file. `image` is not searchable (no OCR): use list, then read.",
    )
    updatedAfter: str | None = Field(
        default=None,
        description="Only files modified at or after this ISO date/date-time (UTC unless a zone is given).",
    )
    updatedBefore: str | None = Field(
        default=None,
        description="Only files modified before this ISO date/date-time (UTC unless a zone is given).",
    )
    limit: int | None = Field(
        default=None,
        ge=1,
        description=f"Citations to return: default {DEFAULT_RESULTS}, at most {MAX_RESULTS}.",
    )


def _path_prefix(value: str | None, scope: Scope) -> str | None:
    """The prefix as an absolute inside path; relative ones are taken from the first knowledge
    base's root (`.` is that root). It must lie in a selected knowledge base."""
    if value is None or not value.strip():
        return None
    raw = value.strip()
    normal = posixpath.normpath(scope.absolute(raw))
    if raw.endswith("/") and not normal.endswith("/"):
        normal += "/"
    holder = scope.holder(normal.rstrip("/") or "/")
    if holder is None or holder.id not in scope.selected:
        where = (
            f"the workspace root {scope.base.root}"
            if len(scope.registered) == 1
            else "the session's knowledge bases (" + ", ".join(kb.root for kb in scope.chosen) + ")"
        )
        raise SearchInputError(f"pathPrefix {value!r} is outside {where}; search covers only that")
    return (
        None if normal.rstrip("/") == scope.base.root.rstrip("/") and len(scope.registered) == 1 else normal
    )


def _filters(params: SearchParams, scope: Scope) -> tuple[Filters, list[str]]:
    notes: list[str] = []
    kinds = list(dict.fromkeys(params.fileTypes or []))
    if "image" in kinds:
        kinds.remove("image")
        notes.append(IMAGE_NOTE)
    after = parse_time(params.updatedAfter, "updatedAfter") if params.updatedAfter else None
    before = parse_time(params.updatedBefore, "updatedBefore") if params.updatedBefore else None
    if after is not None and before is not None and after >= before:
        raise SearchInputError("updatedAfter must be earlier than updatedBefore")
    tags = tuple(dict.fromkeys(t for t in map(normalize_tag, params.tags or []) if t))
    file_types: tuple[FileType, ...] = tuple(k for k in FILE_TYPES if k in kinds)
    try:
        chosen = scope.narrowed(params.knowledgeBaseIds)
    except ScopeError as exc:
        raise SearchInputError(str(exc)) from exc
    roots = tuple(kb.root for kb in chosen)
    unselected = tuple(  # an unselected knowledge base inside a chosen one is not the session's,
        (kb.root, tuple(root for root in roots if below(kb.root, root)))  # but chosen ones in it are
        for kb in scope.registered
        if kb.id not in scope.selected and any(below(root, kb.root) for root in roots)
    )
    prefix = _path_prefix(params.pathPrefix, scope)
    whole = len(scope.registered) == 1  # nothing but the workspace: no folder to narrow to
    return Filters(prefix, tags, file_types, after, before, () if whole else roots, unselected), notes


def render(query: str, outcome: SearchOutcome, limit: int, notes: list[str]) -> str:
    """Numbered citations `[n] path (where) — snippet`, then what the model should know."""
    lines: list[str] = []
    if outcome.hits:
        how = "matching any of the words (no chunk has them all)" if outcome.any_term else "matching"
        lines.append(f"{len(outcome.hits)} of {outcome.total} chunks {how} {query!r}, best first:")
        for n, hit in enumerate(outcome.hits, start=1):
            lines.append(f"[{n}] {hit.path} ({hit.citation}) — {hit.snippet}")
        rest = outcome.total - len(outcome.hits)
        if rest > 0 and limit < MAX_RESULTS:
            lines.append(f"{rest} more: raise limit (up to {MAX_RESULTS}) or narrow the search.")
        elif rest > 0:
            lines.append(
                f"{rest} more: narrow the search (pathPrefix, tags, fileTypes, dates) or use other words."
            )
    else:
        lines.append(
            f"No indexed markdown, txt, docx or pdf text matches {query!r} with these filters. "
            "Try other words or fewer filters, or grep for exact text."
        )
    if outcome.skipped_total:
        named = "; ".join(f"{path} ({why})" for path, why in outcome.skipped)
        rest = outcome.skipped_total - len(outcome.skipped)
        lines.append(
            f"Not indexed: {named}"
            + (f"; and {rest} more" if rest else "")
            + ". Use read (by page or block) or grep for them."
        )
    lines.extend(f"Note: {n}" for n in notes)
    return "\n".join(lines)


async def run_search(ctx: ToolContext, params: SearchParams) -> ToolResult:
    notes: list[str] = []
    limit = params.limit or DEFAULT_RESULTS
    if limit > MAX_RESULTS:
        notes.append(f"limit {limit} was clamped to the maximum of {MAX_RESULTS}.")
        limit = MAX_RESULTS
    try:
        filters, filter_notes = _filters(params, ctx.scope)
        fts_query(params.query)  # a query with nothing to search fails before the index is opened
        if ctx.services is None:
            return ToolResult.error("Knowledge search needs a machine.")
        index = await ctx.services.knowledge()
        outcome = await index.search(params.query, filters, limit)
    except SearchInputError as exc:
        return ToolResult.error(str(exc))
    except (WorkspaceError, MachineError, OSError, sqlite3.Error) as exc:
        return ToolResult.error(f"Knowledge search is unavailable: {exc}")
    notes = filter_notes + notes
    if outcome.dropped_terms:
        notes.append(
            f"only the first {MAX_QUERY_TERMS} query terms were used ({outcome.dropped_terms} ignored)."
        )
    text = render(params.query, outcome, limit, notes)
    results = [h.to_dict() for h in outcome.hits]
    ids = await shown_file_ids(ctx, [h.path for h in outcome.hits])
    if ids:
        scope = ctx.scope
        for result, hit in zip(results, outcome.hits, strict=True):
            holder = scope.holder(hit.path)
            result["fileId"] = ids[hit.path]
            result["knowledgeBaseId"] = holder.id if holder else None
        text += "\nFile ids: " + ", ".join(f"[{n}] {r['fileId']}" for n, r in enumerate(results, start=1))
    return ToolResult.text(text, results=results, total=outcome.total)


SEARCH_DESCRIPTION = (
    "Full-text search of the workspace's notes and documents (markdown, txt, docx, pdf), ranked by relevance. "
    f"Returns numbered citations (default {DEFAULT_RESULTS}, at most {MAX_RESULTS}) as `[n] path (where) — snippet`, "
    "where `where` is a line range for notes, a page for PDFs and a block number/heading for DOCX; read that "
    "place (by path or its fileId) to see the full text. It searches the session's knowledge bases; narrow with "
    "knowledgeBaseIds, pathPrefix, tags, fileTypes, updatedAfter/updatedBefore (file modification time); "
    "filters only narrow. Images are not searchable (no OCR): use list, "
    "then read. The index follows file changes; for exact strings or code use grep."
)

SEARCH = Tool("search", SEARCH_DESCRIPTION, SearchParams, Action.READ, run_search)

TOOLS: dict[str, Tool] = {"search": SEARCH}
