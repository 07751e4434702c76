"""Content search: `grep` (v1 `/v1/file/grep`, `/v2/fs/grep`) and `search_in_file` (v1 `/v1/file/search`).

Both run ripgrep (`rg --json`) *on the machine* (`machine.spawn`), with the machine's own
view of its files and its own rights: in a sandbox, the server's `rg` is bound read-only at
`SANDBOX_RG` and runs as one more command of the sandbox (its cgroup, its namespaces), so
no path the sandbox controls is ever walked by the server. rg walks the tree without
following symlinks and reports inside paths. Its JSON messages arrive per file as
`begin`, then `context` / `match` lines in file order, then `end`; a final `summary` ends the run.

Choices where the upstream API is silent:

- Results come in path order, so `offset` pages are stable. rg's `--sort path` would walk
  the tree on one thread; a directory is searched in parallel instead, each file's records
  kept as rg writes them (a file's records arrive together) and replayed sorted by path,
  component by component as `--sort path` walks. Up to MAX_UNSORTED_BYTES of records are
  kept; past that, rg is stopped and the search runs again with `--sort path`, which can
  stop as soon as the page is full. Either way the result is the same.
- A match's `context_before` / `context_after` are the lines around it whatever they are,
  other matching lines included, exactly as if it had been searched alone.
- `.gitignore` files are honoured wherever they are (not only inside a git checkout); the
  server's own global gitignore and rg config are never read.
- `truncated` is true when more matches exist past `offset + max_results` (records are read
  until the next one shows up) or when a record longer than MAX_RECORD_BYTES was skipped.
- `match_count` counts the matches returned. `files_matched` counts files with a match up to
  where rg stopped. `files_searched` is None: rg's JSON summary counts only files with a match.
- Search starts at `path` as the machine sees it; other mounts nested below it in the
  machine's view are not entered (`--one-file-system`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import json
import os
import posixpath
import re
import stat as stat_mod
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from agentbox.machines.base import ExecRequest, Machine, Process
from agentbox.machines.errors import PathEscape
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import data_kind_ok
from agentbox.workspace import remote_files
from agentbox.workspace.editor import MAX_EDIT_BYTES
from agentbox.workspace.errors import WorkspaceError, bad_request, failed, operation
from agentbox.workspace.patterns import check_patterns

#: Matches returned by default.
MAX_GREP_RESULTS = 500
#: The most matches one request may ask for.
GREP_RESULTS_CEILING = 10_000
#: Context lines one request may ask for on each side of a match.
MAX_GREP_CONTEXT_LINES = 100
#: Characters kept of one line (match or context); longer lines end with LINE_TRUNCATED_MARKER.
MAX_LINE_CHARS = 2_000
LINE_TRUNCATED_MARKER = " [... line truncated]"
#: Seconds one search may take before rg is killed.
GREP_TIMEOUT_SECONDS = 30.0
#: Longest rg JSON record read; a longer one (a huge line) is skipped and the result truncated.
MAX_RECORD_BYTES = 8 * 1024 * 1024
#: Bytes of rg records (plus RECORD_OVERHEAD_BYTES each) a parallel search keeps to sort;
#: past it the search is run again in rg's own path order.
MAX_UNSORTED_BYTES = 16 * 1024 * 1024
#: What one kept record costs beyond its bytes (the bytes object and its list slot).
RECORD_OVERHEAD_BYTES = 64
#: Bytes of rg's stderr kept for the error message.
MAX_STDERR_BYTES = 16 * 1024
#: Default of `max_file_size`: larger files are skipped (rg `--max-filesize`).
DEFAULT_MAX_FILE_SIZE = "1M"

SIZE_FORMAT = re.compile(r"^[0-9]+[KMG]?$")
#: rg reads no environment we want: no config file, no global gitignore, no colors.
RG_ENV: dict[str, str] = {}


@dataclass
class GrepMatch:
    file: str
    line_number: int
    line_content: str
    context_before: list[str] = field(default_factory=list)
    context_after: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GrepResult:
    path: str
    pattern: str
    matches: list[GrepMatch]
    match_count: int
    files_searched: int | None
    files_matched: int
    truncated: bool


@dataclass(frozen=True)
class GrepOptions:
    """Everything `grep` accepts besides the path, as upstream names it."""

    pattern: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    case_insensitive: bool = False
    fixed_strings: bool = False
    context_before: int = 0
    context_after: int = 0
    max_results: int = MAX_GREP_RESULTS
    max_file_size: str = DEFAULT_MAX_FILE_SIZE
    multiline: bool = False
    offset: int = 0
    file_type: str | None = None
    recursive: bool = True
    hidden: bool = False
    respect_gitignore: bool = True
    also: tuple[str, ...] = ()
    """Folders below the path searched as roots of their own (ones `exclude` leaves out around them)."""

    def check(self, op: str, path: str) -> None:
        def refuse(message: str) -> None:
            raise bad_request(op, message, path)

        if not 1 <= self.max_results <= GREP_RESULTS_CEILING:
            refuse(f"max_results must be within [1, {GREP_RESULTS_CEILING}]")
        if self.offset < 0:
            refuse("offset must not be negative")
        for name, value in (("context_before", self.context_before), ("context_after", self.context_after)):
            if not 0 <= value <= MAX_GREP_CONTEXT_LINES:
                refuse(f"{name} must be within [0, {MAX_GREP_CONTEXT_LINES}]")
        if not SIZE_FORMAT.match(self.max_file_size):
            refuse(f"max_file_size must be a byte count, optionally with K, M or G: {self.max_file_size!r}")
        if any(not g for g in self.include + self.exclude):
            refuse("include and exclude globs must not be empty")
        check_patterns(op, self.include + self.exclude, path)
        if self.file_type is not None and not self.file_type:
            refuse("type must not be empty")

    def rg_args(self, target: str, *, sort: bool = True) -> list[str]:
        """rg's arguments; `sort=False` leaves out `--sort path`, so rg searches in parallel."""
        args = ["--json", "--no-config", "--no-messages", "--crlf", "--one-file-system"]
        if sort:
            args += ["--sort", "path"]
        args += ["--no-ignore-global", "--no-require-git", f"--max-filesize={self.max_file_size}"]
        args.append("--ignore-case" if self.case_insensitive else "--case-sensitive")
        if self.fixed_strings:
            args.append("--fixed-strings")
        if self.multiline:
            args.append("--multiline")
        if self.context_before:
            args.append(f"--before-context={self.context_before}")
        if self.context_after:
            args.append(f"--after-context={self.context_after}")
        if not self.recursive:
            args.append("--max-depth=1")
        if self.hidden:
            args.append("--hidden")
        if not self.respect_gitignore:
            args.append("--no-ignore")
        if self.file_type:
            args.append(f"--type={self.file_type}")
        args += [f"--glob={g}" for g in self.include]
        args += [f"--glob=!{g}" for g in self.exclude]
        return [*args, "--regexp", self.pattern, "--", target, *self.also]


def globs(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# --- reading rg's output ---------------------------------------------------------------


def clip_line(text: str) -> str:
    return text if len(text) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS] + LINE_TRUNCATED_MARKER


def data_text(value: dict[str, str]) -> str:
    """rg gives text as {"text": ...}, or {"bytes": base64} when it is not UTF-8."""
    if "text" in value:
        return value["text"]
    return base64.b64decode(value.get("bytes", "")).decode("utf-8", "replace")


def data_path(value: dict[str, str]) -> str:
    if "text" in value:
        return value["text"]
    return os.fsdecode(base64.b64decode(value.get("bytes", "")))


def split_lines(text: str) -> list[str]:
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]


class MatchCollector:
    """Turns rg's JSON messages into GrepMatches, one page (`skip`, `limit`) of them.

    Context lines are kept by line number: the last `before` lines seen give a new match
    its `context_before`; matches still short of `after` lines take each later line, so
    overlapping contexts land in every match they surround.
    """

    def __init__(self, before: int, after: int, skip: int, limit: int) -> None:
        self.before, self.after, self.skip, self.limit = before, after, skip, limit
        self.matches: list[GrepMatch] = []
        self.seen = 0
        self.files_matched = 0
        self.truncated = False
        self.done = False
        self.saw_output = False
        self._file = ""
        self._recent: deque[tuple[int, str]] = deque(maxlen=before)
        self._open: list[tuple[GrepMatch, int]] = []  # matches awaiting context_after, and their last line

    @property
    def full(self) -> bool:
        return self.seen >= self.skip + self.limit

    def feed(self, message: dict) -> None:
        self.saw_output = True
        kind, data = message.get("type"), message.get("data", {})
        if kind == "begin":
            self._begin(data)
        elif kind in ("match", "context"):
            self._lines(kind == "match", data)
        elif kind == "end":
            self._open.clear()
        self._settle()

    def skipped_oversized(self) -> None:
        self.saw_output = True
        self.truncated = True

    def _begin(self, data: dict) -> None:
        if self.full:
            self.truncated = True
            return
        self.files_matched += 1
        self._file = data_path(data["path"])
        self._recent.clear()
        self._open.clear()

    def _lines(self, is_match: bool, data: dict) -> None:
        first = int(data["line_number"])
        lines = [clip_line(line) for line in split_lines(data_text(data["lines"]))]
        for n, text in enumerate(lines, first):
            self._give_after(n, text)
        if is_match:
            if self.full:
                self.truncated = True
            else:
                self._add(first, lines)
        self._recent.extend(enumerate(lines, first))

    def _add(self, first: int, lines: list[str]) -> None:
        self.seen += 1
        if self.seen <= self.skip:
            return
        before = [text for n, text in self._recent if n >= first - self.before]
        match = GrepMatch(self._file, first, clip_line("\n".join(lines)), before)
        self.matches.append(match)
        if self.after:
            self._open.append((match, first + len(lines) - 1))

    def _give_after(self, n: int, text: str) -> None:
        still_open = []
        for match, last in self._open:
            if last < n <= last + self.after:
                match.context_after.append(text)
            if n < last + self.after:
                still_open.append((match, last))
        self._open = still_open

    def _settle(self) -> None:
        self.done = self.full and self.truncated and not self._open


async def records(stream: asyncio.StreamReader) -> AsyncGenerator[tuple[bytes, bool], None]:
    """rg's output split into lines: (record, True), or (its first bytes, False) when too long."""
    buffer = bytearray()
    oversized = False
    while chunk := await stream.read(65536):
        start = 0
        while (nl := chunk.find(b"\n", start)) != -1:
            if not oversized:
                buffer += chunk[start:nl]
                oversized = len(buffer) > MAX_RECORD_BYTES  # the last piece may be what tips it over
            yield bytes(buffer[:64]) if oversized else bytes(buffer), not oversized
            buffer.clear()
            oversized = False
            start = nl + 1
        if not oversized:
            buffer += chunk[start:]
            if len(buffer) > MAX_RECORD_BYTES:
                del buffer[64:]
                oversized = True
    if buffer and not oversized:
        yield bytes(buffer), True


async def read_capped_stream(stream: asyncio.StreamReader, limit: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, limit - len(kept))]
    return bytes(kept)


class FileBlocks:
    """rg's records of an unsorted run, grouped per file, replayed in `--sort path` order.

    `add` is False once more than `limit` bytes are kept: the caller then gives up the run.
    """

    def __init__(self, limit: int = MAX_UNSORTED_BYTES) -> None:
        self.limit = limit
        self.kept = 0
        self._blocks: list[tuple[tuple[bytes, ...], list[tuple[bytes, bool]]]] = []
        self._current: list[tuple[bytes, bool]] | None = None
        self._rest: list[tuple[bytes, bool]] = []  # outside any file: the summary

    def add(self, record: bytes, whole: bool) -> bool:
        self.kept += len(record) + RECORD_OVERHEAD_BYTES
        if whole and record.startswith(b'{"type":"begin"'):
            self._current = []
            self._blocks.append((path_key(json.loads(record)), self._current))
        target = self._current if self._current is not None else self._rest
        target.append((record, whole))
        if whole and record.startswith(b'{"type":"end"'):
            self._current = None
        return self.kept <= self.limit

    def in_path_order(self) -> list[tuple[bytes, bool]]:
        ordered = [r for _, block in sorted(self._blocks, key=lambda b: b[0]) for r in block]
        return ordered + self._rest


def path_key(begin: dict) -> tuple[bytes, ...]:
    """A `begin` record's path as rg's `--sort path` orders it: by component, as bytes."""
    return tuple(os.fsencode(data_path(begin["data"]["path"])).split(b"/"))


def feed(collector: MatchCollector, record: bytes, whole: bool) -> bool:
    """Give one record to `collector`; whether it is done (the page is full and settled)."""
    if not whole:
        if record.startswith(b'{"type":"match"'):
            collector.skipped_oversized()
        return False
    collector.feed(json.loads(record))
    return collector.done


class Rg:
    """One rg run on the machine: its records, then its exit code and stderr."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.stderr = asyncio.ensure_future(read_capped_stream(proc.stderr, MAX_STDERR_BYTES))
        self.finished = False

    async def finish(self) -> tuple[int, str]:
        code = await self.proc.wait()
        self.finished = True
        return code, (await self.stderr).decode("utf-8", "replace")

    async def stop(self) -> None:
        """Unless it finished: kill it and drain its stdout (a full pipe would never see EOF)."""
        if not self.finished:
            self.proc.kill()
            while await self.proc.stdout.read(PIPE_DRAIN_CHUNK):
                pass
            await self.proc.wait()
        self.stderr.cancel()


@contextlib.asynccontextmanager
async def spawned_rg(machine: Machine, binary: str, args: list[str], cwd: str) -> AsyncIterator[Rg]:
    """rg (the machine's `binary`) started on the machine; it never outlives the block."""
    rg = Rg(await machine.spawn(ExecRequest(argv=(binary, *args), cwd=cwd, env=RG_ENV)))
    try:
        yield rg
    finally:
        await rg.stop()


async def run_rg(
    machine: Machine, rg: str, args: list[str], cwd: str, collector: MatchCollector, timeout: float
) -> tuple[int | None, str]:
    """Feed rg's records to `collector` until it is done (None) or rg ends (its code, stderr)."""
    async with asyncio.timeout(timeout), spawned_rg(machine, rg, args, cwd) as run:
        async with contextlib.aclosing(records(run.proc.stdout)) as lines:
            async for record, whole in lines:
                if feed(collector, record, whole):
                    return None, ""
        return await run.finish()


async def run_rg_parallel(
    machine: Machine,
    binary: str,
    args: list[str],
    cwd: str,
    collector: MatchCollector,
    timeout: float,
    limit: int = MAX_UNSORTED_BYTES,
) -> tuple[int | None, str] | None:
    """`run_rg` for an unsorted (parallel) rg: every record kept, then fed in path order.

    None, with `collector` untouched, when the records passed `limit` bytes.
    """
    blocks = FileBlocks(limit)
    async with asyncio.timeout(timeout), spawned_rg(machine, binary, args, cwd) as rg:
        async with contextlib.aclosing(records(rg.proc.stdout)) as lines:
            async for record, whole in lines:
                if not blocks.add(record, whole):
                    return None
        code, stderr = await rg.finish()
    for record, whole in blocks.in_path_order():
        if feed(collector, record, whole):
            return None, ""
    return code, stderr


#: Bytes read at a time while draining a killed rg's stdout.
PIPE_DRAIN_CHUNK = 1 << 16


def rg_message(stderr: str) -> str:
    lines = [line.removeprefix("rg: ") for line in stderr.strip().splitlines()]
    return "\n".join(lines) or "ripgrep failed"


# --- the operations --------------------------------------------------------------------


@dataclass(frozen=True)
class _Where:
    target: str
    """What rg searches: the inside path with links resolved where the server can tell."""
    shown: str
    is_dir: bool
    rg: str


async def _where(machine: Machine, path: str, op: str) -> _Where:
    """Where the search runs, refusing what rg cannot search without hanging (a FIFO, a device)."""
    if isinstance(machine, HostFiles):
        target = machine.view.resolve(path)
        st = machine.view.stat(target)  # ENOENT when missing
        if not data_kind_ok(st):  # rg would block on a FIFO until the timeout
            raise PathEscape(f"{path} is a device, fifo or socket", path=path)
        return _Where(
            target, machine.view.resolve(path, follow=False), stat_mod.S_ISDIR(st.st_mode), machine.ripgrep
        )
    fst = await remote_files.require_stat(machine, path)
    if not (fst.is_dir or fst.is_file):
        raise PathEscape(f"{path} is a device, fifo or socket", path=path)
    rg = await machine.find_program("rg")
    if rg is None:
        raise bad_request(op, f"machine {machine.name!r} has no ripgrep (rg) to search with", path)
    shown = remote_files.shown_path(machine, path)
    return _Where(shown, shown, fst.is_dir, rg)


async def run_search(
    machine: Machine,
    path: str,
    options: GrepOptions,
    op: str,
    timeout: float,
    *,
    file_only: bool = False,
    unsorted_limit: int = MAX_UNSORTED_BYTES,
) -> GrepResult:
    with operation(op, path):
        options.check(op, path)
        where = await _where(machine, path, op)
        target, shown, is_dir = where.target, where.shown, where.is_dir
        if file_only and is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        collector = MatchCollector(
            options.context_before, options.context_after, options.offset, options.max_results
        )
        cwd = target if is_dir else posixpath.dirname(target)
        try:
            async with asyncio.timeout(timeout):  # both runs, when the parallel one gives up
                ran = None
                if is_dir:
                    ran = await run_rg_parallel(
                        machine, where.rg, options.rg_args(target, sort=False), cwd, collector, timeout,
                        unsorted_limit,
                    )  # fmt: skip
                if ran is None:
                    ran = await run_rg(machine, where.rg, options.rg_args(target), cwd, collector, timeout)
                code, stderr = ran
        except TimeoutError:
            raise WorkspaceError(
                "io_error",
                failed(op, f"search took longer than {timeout:g} s"),
                op,
                path,
                errno.ETIMEDOUT,
                "ETIMEDOUT",
                "TimeoutError",
                retryable=True,
            ) from None
        if code == 2 and not collector.saw_output and stderr.strip():
            raise bad_request(op, rg_message(stderr), path)
        return GrepResult(
            path=shown,
            pattern=options.pattern,
            matches=collector.matches,
            match_count=len(collector.matches),
            files_searched=None,
            files_matched=collector.files_matched,
            truncated=collector.truncated,
        )


async def grep(
    machine: Machine,
    path: str,
    pattern: str,
    *,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    case_insensitive: bool = False,
    fixed_strings: bool = False,
    context_before: int = 0,
    context_after: int = 0,
    max_results: int = MAX_GREP_RESULTS,
    max_file_size: str | int = DEFAULT_MAX_FILE_SIZE,
    multiline: bool = False,
    offset: int = 0,
    file_type: str | None = None,
    recursive: bool = True,
    hidden: bool = False,
    respect_gitignore: bool = True,
    timeout: float = GREP_TIMEOUT_SECONDS,
    unsorted_limit: int = MAX_UNSORTED_BYTES,
    also: Sequence[str] = (),
) -> GrepResult:
    """Lines matching `pattern` (a Rust regex, or literal with `fixed_strings`) in a file or tree.

    `include` / `exclude` are rg globs relative to `path` (`*.py`, `src/**`); `file_type` is an
    rg type name (`py`, `rust`); `offset` skips that many matches before `max_results` are kept.
    `unsorted_limit`: bytes of records sorted here before the search falls back to `--sort path`.
    """
    options = GrepOptions(
        pattern=pattern,
        include=globs(include),
        exclude=globs(exclude),
        case_insensitive=case_insensitive,
        fixed_strings=fixed_strings,
        context_before=context_before,
        context_after=context_after,
        max_results=max_results,
        max_file_size=str(max_file_size).upper(),
        multiline=multiline,
        offset=offset,
        file_type=file_type,
        recursive=recursive,
        hidden=hidden,
        respect_gitignore=respect_gitignore,
        also=tuple(also),
    )
    return await run_search(machine, path, options, "grep", timeout, unsorted_limit=unsorted_limit)


async def search_in_file(
    machine: Machine, path: str, regex: str, *, timeout: float = GREP_TIMEOUT_SECONDS
) -> tuple[list[str], list[int]]:
    """v1 `/v1/file/search`: the lines of one file matching `regex`, with 0-BASED line numbers.

    Runs rg like `grep` (linear-time regexes, a timeout, one dialect for both routes) rather
    than Python `re`, whose backtracking could stall the server on a hostile pattern. Up to
    GREP_RESULTS_CEILING lines; files up to MAX_EDIT_BYTES.
    """
    options = GrepOptions(pattern=regex, max_results=GREP_RESULTS_CEILING, max_file_size=str(MAX_EDIT_BYTES))
    result = await run_search(machine, path, options, "search", timeout, file_only=True)
    return [m.line_content for m in result.matches], [m.line_number - 1 for m in result.matches]
