"""The editor engine behind `str_replace_editor` (v1) and `/v2/fs/edit`: literal edits with undo.

It follows the Anthropic / OpenHands text-editor tool (commands `view`, `create`,
`str_replace`, `insert`, `undo_edit`; `cat -n` snippets shown to the model), with these
differences, each because the original loses data or surprises users:

- The file's bytes are kept: no tab expansion, no newline rewriting. A UTF-8 BOM stays in
  front of the text (and out of the way of `insert_line=0` and of matching).
- In a file whose line ends are all CRLF, a bare LF in `old_str` / `new_str` stands for
  CRLF, so text copied from a view matches and the file stays CRLF. Other files are literal.
- `undo_edit` of a `create` that made a new file deletes that file (upstream kept it).
- History is bounded: `MAX_UNDO_DEPTH` entries per file and `MAX_HISTORY_BYTES` in all.
- Files are written in place (same inode), as `/v2/fs/write` does without `?user=`.

Every command runs its read-modify-write without awaiting in between, so two edits sent
to one event loop never interleave. History is keyed by (machine name, inside path of the
file after following symlinks), so an edit through a link and an undo through the target
meet. `Editor.replace` (v1 `/v1/file/replace`) lives here too: it is the same literal
edit, without history.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import stat as stat_mod
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Literal, Protocol

from agentbox.machines.base import Machine
from agentbox.machines.hostfs import HostFiles
from agentbox.workspace import files, remote_files
from agentbox.workspace.errors import WorkspaceError, bad_request, operation

#: Previous versions kept per file; the oldest is dropped past this.
MAX_UNDO_DEPTH = 10
#: Bytes of previous versions kept over all files; the oldest entries anywhere go first.
MAX_HISTORY_BYTES = 64 * 1024 * 1024
#: What one history entry costs besides its content, so that entries of files that did not
#: exist (no content) still count against MAX_HISTORY_BYTES.
SNAPSHOT_OVERHEAD_BYTES = 256
#: Largest file (before and after the edit) the editor reads or writes.
MAX_EDIT_BYTES = 10 * 1024 * 1024
#: Lines shown above and below an edited region in the `cat -n` snippet.
SNIPPET_CONTEXT_LINES = 4
#: Characters of numbered text in one `output`; the rest is clipped with CLIPPED_NOTE.
MAX_OUTPUT_CHARS = 16_000
#: Depth of a directory `view` (as `find -maxdepth 2`).
VIEW_DIR_DEPTH = 2
#: Entries listed by a directory `view` before it stops.
MAX_VIEW_DIR_ENTRIES = 1_000
#: Line numbers named in the "multiple occurrences" error.
MAX_LISTED_OCCURRENCES = 20

OLD_STR_NOT_FOUND = "old_str not found in file"
CLIPPED_NOTE = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to you. "
    "Use view_range to see the rest, or grep to find the line numbers you need.</NOTE>"
)
REVIEW_NOTE = "Review the changes and make sure they are as expected. Edit the file again if necessary."
INSERT_REVIEW_NOTE = (
    "Review the changes and make sure they are as expected (correct indentation, no duplicate lines, etc). "
    "Edit the file again if necessary."
)
BOM = "\ufeff"

ReplaceMode = Literal["ALL", "FIRST", "LAST"]
REPLACE_MODES: tuple[str, ...] = ("ALL", "FIRST", "LAST")


#: What the editor works on: a machine with the `HostFiles` capability (and a name, for history).
HostMachine = HostFiles


@dataclass(frozen=True)
class EditResult:
    """One editor command's outcome; the fields of v1 `StrReplaceEditorResult`.

    `output` is what the tool shows the model; `old_content` / `new_content` are the whole
    file before and after (None where there is no file, and for `view`).
    """

    path: str
    output: str
    old_content: str | None
    new_content: str | None
    prev_exist: bool


# --- history ---------------------------------------------------------------------------

Key = tuple[str, str]


@dataclass(frozen=True)
class Snapshot:
    """A file as it was before one edit; `content=None` means it did not exist."""

    id: int
    content: bytes | None

    @property
    def cost(self) -> int:
        return SNAPSHOT_OVERHEAD_BYTES + len(self.content or b"")


class EditHistory:
    """Previous versions per (machine, file), newest last, bounded in depth and in bytes."""

    def __init__(self, max_depth: int = MAX_UNDO_DEPTH, max_bytes: int = MAX_HISTORY_BYTES) -> None:
        self.max_depth = max_depth
        self.max_bytes = max_bytes
        self.size = 0
        self._stacks: dict[Key, deque[Snapshot]] = {}
        self._age: OrderedDict[int, Key] = OrderedDict()  # snapshot id -> key, oldest first
        self._next_id = 0

    def depth(self, key: Key) -> int:
        return len(self._stacks.get(key, ()))

    def push(self, key: Key, content: bytes | None) -> None:
        snap = Snapshot(self._next_id, content)
        self._next_id += 1
        if snap.cost > self.max_bytes:
            self._drop_all(key)  # cannot keep it; an undo must not skip back past it
            return
        stack = self._stacks.setdefault(key, deque())
        stack.append(snap)
        self._age[snap.id] = key
        self.size += snap.cost
        while len(stack) > self.max_depth:
            self._drop_oldest(key)
        while self.size > self.max_bytes:
            self._drop_oldest(next(iter(self._age.values())))

    def latest(self, key: Key) -> Snapshot | None:
        stack = self._stacks.get(key)
        return stack[-1] if stack else None

    def drop_latest(self, key: Key) -> None:
        stack = self._stacks[key]
        snap = stack.pop()
        self._forget(key, snap)

    def forget_machine(self, machine_name: str) -> None:
        """Drop a machine's history (when it is closed or rebuilt)."""
        for key in [k for k in self._stacks if k[0] == machine_name]:
            self._drop_all(key)

    def _drop_oldest(self, key: Key) -> None:
        snap = self._stacks[key].popleft()
        self._forget(key, snap)

    def _drop_all(self, key: Key) -> None:
        while self.depth(key):
            self._drop_oldest(key)

    def _forget(self, key: Key, snap: Snapshot) -> None:
        del self._age[snap.id]
        self.size -= snap.cost
        if not self._stacks[key]:
            del self._stacks[key]


# --- files, by inside path through the machine's descriptor view ------------------------


@dataclass(frozen=True)
class TextFile:
    """A decoded file: its text without the BOM, and how to write text back the same way."""

    raw: bytes
    text: str
    bom: bool

    @classmethod
    def decode(cls, raw: bytes) -> TextFile:
        text = raw.decode("utf-8")
        bom = text.startswith(BOM)
        return cls(raw, text[1:] if bom else text, bom)

    @property
    def content(self) -> str:
        return self.whole(self.text)

    def whole(self, text: str) -> str:
        """`text` as the whole file reads, BOM included."""
        return BOM + text if self.bom else text

    @property
    def crlf(self) -> bool:
        """All line ends are CRLF (and there is at least one)."""
        crlfs = self.text.count("\r\n")
        return crlfs > 0 and crlfs == self.text.count("\n")

    @property
    def newline(self) -> str:
        return "\r\n" if self.crlf else "\n"

    def adapt(self, s: str) -> str:
        """`s` with bare LFs turned into CRLFs when this file is all CRLF; else unchanged."""
        return s.replace("\r\n", "\n").replace("\n", "\r\n") if self.crlf else s

    def encode(self, text: str) -> bytes:
        return self.whole(text).encode("utf-8")


def too_large(op: str, path: str, size: int) -> WorkspaceError:
    return bad_request(op, f"{path} would be {size} bytes; the limit is {MAX_EDIT_BYTES} bytes", path)


def read_capped(machine: HostMachine, inside: str, path: str, op: str) -> bytes | None:
    """The bytes of a regular file, None if it does not exist; refuses dirs and big files."""
    try:
        fd = machine.view.open(inside, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat_mod.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        data = files.read_up_to(f, st.st_size, MAX_EDIT_BYTES)
    if len(data) > MAX_EDIT_BYTES:
        raise too_large(op, path, st.st_size)
    return data


def load_text(machine: HostMachine, inside: str, path: str, op: str) -> TextFile:
    raw = read_capped(machine, inside, path, op)
    if raw is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return TextFile.decode(raw)


def readable_or_none(machine: HostMachine, inside: str, path: str) -> bytes | None:
    """The current bytes for `old_content` where they can be had; a file grown past the
    limit must not stop an undo from putting back the smaller version."""
    try:
        return read_capped(machine, inside, path, "edit")
    except WorkspaceError:
        return None


def write_in_place(machine: HostMachine, inside: str, data: bytes) -> None:
    """Write through the existing inode (links, watchers and owners stay); create if absent."""
    files.write_in_place(machine, inside, data, owner=files.new_owner(machine, None))


def make_parents(machine: HostMachine, inside: str) -> None:
    parent = posixpath.dirname(inside)
    if not machine.view.exists(parent):
        machine.view.makedirs(parent, owner=files.new_owner(machine, None))


def checked_encode(file: TextFile, text: str, op: str, path: str) -> bytes:
    data = file.encode(text)
    if len(data) > MAX_EDIT_BYTES:
        raise too_large(op, path, len(data))
    return data


# --- what the model sees ---------------------------------------------------------------


def display_lines(text: str) -> list[str]:
    """Lines as `cat -n` numbers them: split on LF, a final LF ends the last line."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def line_count(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def clip(body: str) -> str:
    return body if len(body) <= MAX_OUTPUT_CHARS else body[:MAX_OUTPUT_CHARS] + "\n" + CLIPPED_NOTE


def numbered(lines: Sequence[str], first: int) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, first))


def cat_n(lines: Sequence[str], first: int, what: str) -> str:
    return f"Here's the result of running `cat -n` on {what}:\n{clip(numbered(lines, first))}\n"


def snippet(text: str, start_line: int, end_line: int, what: str) -> str:
    """`cat -n` of lines start..end of `text` with SNIPPET_CONTEXT_LINES around them."""
    lines = display_lines(text)
    lo = max(1, start_line - SNIPPET_CONTEXT_LINES)
    hi = min(len(lines), end_line + SNIPPET_CONTEXT_LINES)
    return cat_n(lines[lo - 1 : hi], lo, what)


def line_at(text: str, index: int) -> int:
    """1-based line number of the character at `index`."""
    return text.count("\n", 0, index) + 1


# --- the replace rules -----------------------------------------------------------------


@dataclass(frozen=True)
class Replaced:
    """The text after a replace, and where the replaced region lies in it (end exclusive)."""

    text: str
    start: int
    end: int
    count: int


def replace_once(text: str, at: int, old: str, new: str) -> Replaced:
    return Replaced(text[:at] + new + text[at + len(old) :], at, at + len(new), 1)


def replace_all(text: str, old: str, new: str) -> Replaced:
    after = text.replace(old, new)
    # Text after the last occurrence is unchanged, so its end in `after` is found from the tail.
    tail = len(text) - (text.rfind(old) + len(old))
    return Replaced(after, text.find(old), len(after) - tail, text.count(old))


def occurrence_lines(text: str, old: str) -> list[int]:
    lines: list[int] = []
    at = text.find(old)
    while at != -1 and len(lines) < MAX_LISTED_OCCURRENCES:
        line = line_at(text, at)
        if line not in lines:
            lines.append(line)
        at = text.find(old, at + 1)
    return lines


def apply_replace(text: str, old: str, new: str, mode: str | None, path: str) -> Replaced:
    """The replace rule: unique by default (overlaps count as ambiguous), or ALL/FIRST/LAST."""
    first = text.find(old)
    if first == -1:
        raise bad_request("edit", OLD_STR_NOT_FOUND, path)
    if mode is None:
        if text.find(old, first + 1) != -1:
            lines = ", ".join(str(n) for n in occurrence_lines(text, old))
            raise bad_request(
                "edit",
                f"No replacement was performed. Multiple occurrences of old_str in lines {lines}. "
                "Please ensure it is unique.",
                path,
            )
        return replace_once(text, first, old, new)
    if mode == "FIRST":
        return replace_once(text, first, old, new)
    if mode == "LAST":
        return replace_once(text, text.rfind(old), old, new)
    return replace_all(text, old, new)


def checked_mode(mode: str | None, path: str) -> str | None:
    if mode is None:
        return None
    upper = mode.upper()
    if upper not in REPLACE_MODES:
        raise bad_request(
            "edit", f"replace_mode must be one of {', '.join(REPLACE_MODES)}, not {mode!r}", path
        )
    return upper


def insert_offset(text: str, insert_line: int) -> int:
    """Index where line `insert_line + 1` starts (the end of the text after the last line)."""
    at = 0
    for _ in range(insert_line):
        nl = text.find("\n", at)
        if nl == -1:
            return len(text)
        at = nl + 1
    return at


def checked_range(view_range: Sequence[int], n_lines: int, path: str) -> tuple[int, int]:
    """`[start, end]`, 1-based and inclusive; `end=-1` means the last line; end is clamped."""
    if len(view_range) != 2:
        raise bad_request("edit", "view_range must be two integers: [start_line, end_line]", path)
    start, end = view_range
    if not 1 <= start <= n_lines:
        raise bad_request(
            "edit", f"Invalid view_range {list(view_range)}: start must be within [1, {n_lines}]", path
        )
    if end == -1:
        return start, n_lines
    if end < start:
        raise bad_request(
            "edit", f"Invalid view_range {list(view_range)}: end must be -1 or not less than start", path
        )
    return start, min(end, n_lines)


def dir_listing(machine: HostMachine, inside: str) -> list[str]:
    """Inside paths up to VIEW_DIR_DEPTH below `inside`, hidden names skipped, links not entered."""
    entries = [inside]
    for node in machine.view.walk(
        inside, max_depth=VIEW_DIR_DEPTH, descend=lambda n: not n.name.startswith(".")
    ):
        if node.name.startswith("."):
            continue
        if len(entries) > MAX_VIEW_DIR_ENTRIES:
            break
        entries.append(node.inside)
    return capped_listing(entries)


def capped_listing(entries: list[str]) -> list[str]:
    if len(entries) > MAX_VIEW_DIR_ENTRIES:
        del entries[MAX_VIEW_DIR_ENTRIES:]
        entries.append(f"[listing stopped after {MAX_VIEW_DIR_ENTRIES} entries]")
    return entries


# --- the editor ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    inside: str  # the file's inside path, symlinks followed
    key: Key  # history key: machine name and the file's inside path
    shown: str  # the requested path, absolute, as messages name it


def target(machine: HostMachine, path: str, *, write: bool) -> Target:
    view = machine.view
    inside = view.resolve(path, missing_ok=True, write=write)  # `create` makes the missing parents
    shown = view.resolve(path, follow=False, missing_ok=True)
    return Target(inside, (machine.name, inside), shown)


class TextFiles(Protocol):
    """What an editor command needs of a machine's files."""

    async def target(self, path: str, *, write: bool) -> Target: ...

    async def is_dir(self, inside: str) -> bool: ...

    async def read_capped(self, inside: str, path: str, op: str) -> bytes | None: ...

    async def write(self, inside: str, data: bytes) -> None: ...

    async def make_parents(self, inside: str) -> None: ...

    async def unlink(self, inside: str) -> None: ...

    async def dir_listing(self, inside: str) -> list[str]: ...

    async def load_text(self, inside: str, path: str, op: str) -> TextFile: ...

    async def readable_or_none(self, inside: str, path: str) -> bytes | None: ...


class _Text:
    """`load_text` and `readable_or_none` from `read_capped`, for both kinds."""

    async def read_capped(self, inside: str, path: str, op: str) -> bytes | None:
        raise NotImplementedError

    async def load_text(self, inside: str, path: str, op: str) -> TextFile:
        raw = await self.read_capped(inside, path, op)
        if raw is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return TextFile.decode(raw)

    async def readable_or_none(self, inside: str, path: str) -> bytes | None:
        """The current bytes for `old_content` where they can be had; a file grown past the
        limit must not stop an undo from putting back the smaller version."""
        try:
            return await self.read_capped(inside, path, "edit")
        except WorkspaceError:
            return None


class HostText(_Text):
    """Host files by descriptor; nothing here awaits, so a command runs without a break."""

    def __init__(self, machine: HostMachine) -> None:
        self.machine = machine

    async def target(self, path: str, *, write: bool) -> Target:
        return target(self.machine, path, write=write)

    async def is_dir(self, inside: str) -> bool:
        return stat_mod.S_ISDIR(self.machine.view.stat(inside).st_mode)

    async def read_capped(self, inside: str, path: str, op: str) -> bytes | None:
        return read_capped(self.machine, inside, path, op)

    async def write(self, inside: str, data: bytes) -> None:
        write_in_place(self.machine, inside, data)

    async def make_parents(self, inside: str) -> None:
        make_parents(self.machine, inside)

    async def unlink(self, inside: str) -> None:
        self.machine.view.unlink(inside)

    async def dir_listing(self, inside: str) -> list[str]:
        return dir_listing(self.machine, inside)


class RemoteText(_Text):
    """Files through the `Machine` protocol. Paths are taken lexically (the machine resolves
    links), so an edit through a link and an undo through its target keep separate histories;
    writes are atomic renames, so the inode changes."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    async def target(self, path: str, *, write: bool) -> Target:
        inside = remote_files.shown_path(self.machine, path)
        return Target(inside, (self.machine.name, inside), inside)

    async def is_dir(self, inside: str) -> bool:
        return (await remote_files.require_stat(self.machine, inside)).is_dir

    async def read_capped(self, inside: str, path: str, op: str) -> bytes | None:
        st = await self.machine.stat(inside)
        if st is None:
            return None
        if st.is_dir:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if st.size > MAX_EDIT_BYTES:
            raise too_large(op, path, st.size)
        try:
            return await self.machine.read(inside, limit=MAX_EDIT_BYTES)
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise too_large(op, path, st.size) from exc
            raise

    async def write(self, inside: str, data: bytes) -> None:
        await self.machine.write(inside, data)

    async def make_parents(self, inside: str) -> None:
        await self.machine.mkdir(posixpath.dirname(inside), parents=True)

    async def unlink(self, inside: str) -> None:
        await self.machine.remove(inside)

    async def dir_listing(self, inside: str) -> list[str]:
        entries = [inside]
        async for node in remote_files.walk(
            self.machine, inside, max_depth=VIEW_DIR_DEPTH, descend=lambda n: not n.name.startswith(".")
        ):
            if node.name.startswith("."):
                continue
            if len(entries) > MAX_VIEW_DIR_ENTRIES:
                break
            entries.append(node.inside)
        return capped_listing(entries)


class Editor:
    """The five editor commands over one shared `EditHistory` (one per server)."""

    def __init__(self, history: EditHistory | None = None) -> None:
        self.history = history if history is not None else EditHistory()
        self._remote = asyncio.Lock()

    @asynccontextmanager
    async def _command(self, machine: Machine, path: str, op: str = "edit") -> AsyncIterator[TextFiles]:
        """The machine's files for one command, its failures made WorkspaceErrors.

        Host files are worked on without awaiting anything in between, so commands never
        interleave; a machine reached through the protocol awaits at every step, so its
        commands take turns under one lock.
        """
        with operation(op, path):
            if isinstance(machine, HostFiles):
                yield HostText(machine)
            else:
                async with self._remote:
                    yield RemoteText(machine)

    async def view(self, machine: Machine, path: str, view_range: Sequence[int] | None = None) -> EditResult:
        """A file as `cat -n` (optionally lines `view_range`), or a directory two levels deep."""
        async with self._command(machine, path) as fs:
            t = await fs.target(path, write=False)
            if await fs.is_dir(t.inside):
                if view_range:
                    raise bad_request("edit", "view_range is not allowed when path is a directory", path)
                listing = "\n".join(await fs.dir_listing(t.inside))
                output = (
                    f"Here's the files and directories up to {VIEW_DIR_DEPTH} levels deep in {t.shown}, "
                    f"excluding hidden items:\n{listing}\n"
                )
                return EditResult(t.shown, output, None, None, True)
            lines = display_lines((await fs.load_text(t.inside, path, "edit")).text)
            start, end = checked_range(view_range, len(lines), path) if view_range else (1, len(lines))
            return EditResult(t.shown, cat_n(lines[start - 1 : end], start, t.shown), None, None, True)

    async def create(self, machine: Machine, path: str, file_text: str) -> EditResult:
        """Write `file_text` (over any existing file, as upstream does), making parent dirs."""
        async with self._command(machine, path) as fs:
            t = await fs.target(path, write=True)
            data = file_text.encode("utf-8")
            if len(data) > MAX_EDIT_BYTES:
                raise too_large("edit", path, len(data))
            previous = await fs.read_capped(t.inside, path, "edit")
            await fs.make_parents(t.inside)
            await fs.write(t.inside, data)
            self.history.push(t.key, previous)
            verb = "overwritten" if previous is not None else "created"
            return EditResult(
                t.shown,
                f"File {verb} successfully at: {t.shown}",
                previous.decode("utf-8", "replace") if previous is not None else None,
                file_text,
                previous is not None,
            )

    async def str_replace(
        self,
        machine: Machine,
        path: str,
        old_str: str,
        new_str: str,
        replace_mode: str | None = None,
    ) -> EditResult:
        """Replace `old_str`, which must occur exactly once unless `replace_mode` says which."""
        async with self._command(machine, path) as fs:
            mode = checked_mode(replace_mode, path)
            t = await fs.target(path, write=True)
            before = await fs.load_text(t.inside, path, "edit")
            old, new = before.adapt(old_str), before.adapt(new_str)
            if not old:
                raise bad_request("edit", "old_str must not be empty", path)
            if old == new:
                raise bad_request(
                    "edit", "No replacement was performed: old_str and new_str are identical", path
                )
            done = apply_replace(before.text, old, new, mode, path)
            await self._commit(fs, t, before, checked_encode(before, done.text, "edit", path))
            start, end = line_at(done.text, done.start), line_at(done.text, max(done.end - 1, done.start))
            output = (
                f"The file {t.shown} has been edited. "
                + snippet(done.text, start, end, f"a snippet of {t.shown}")
                + REVIEW_NOTE
            )
            return EditResult(t.shown, output, before.content, before.whole(done.text), True)

    async def insert(self, machine: Machine, path: str, insert_line: int, new_str: str) -> EditResult:
        """Insert `new_str` as whole lines after line `insert_line` (0 = at the top)."""
        async with self._command(machine, path) as fs:
            t = await fs.target(path, write=True)
            before = await fs.load_text(t.inside, path, "edit")
            text = before.text
            n_lines = line_count(text)
            if not 0 <= insert_line <= n_lines:
                raise bad_request(
                    "edit",
                    f"Invalid `insert_line` parameter: {insert_line}. "
                    f"It should be within the range of lines of the file: [0, {n_lines}]",
                    path,
                )
            body = before.adapt(new_str)
            at = insert_offset(text, insert_line)
            if at == len(text) and text and not text.endswith("\n"):
                piece = before.newline + body  # after an unterminated last line; keep it unterminated
            else:
                piece = body if body.endswith("\n") else body + before.newline
            after = text[:at] + piece + text[at:]
            await self._commit(fs, t, before, checked_encode(before, after, "edit", path))
            inserted = max(1, len(display_lines(body)))
            output = (
                f"The file {t.shown} has been edited. "
                + snippet(after, insert_line + 1, insert_line + inserted, "a snippet of the edited file")
                + INSERT_REVIEW_NOTE
            )
            return EditResult(t.shown, output, before.content, before.whole(after), True)

    async def undo_edit(self, machine: Machine, path: str) -> EditResult:
        """Put back the file as it was before its last edit; delete it if that edit created it."""
        async with self._command(machine, path) as fs:
            t = await fs.target(path, write=True)
            snap = self.history.latest(t.key)
            if snap is None:
                raise bad_request("edit", f"No edit history found for {t.shown}.", path)
            current = await fs.readable_or_none(t.inside, path)
            current_text = current.decode("utf-8", "replace") if current is not None else None
            if snap.content is None:
                with suppress(FileNotFoundError):
                    await fs.unlink(t.inside)
                self.history.drop_latest(t.key)
                output = (
                    f"Last edit to {t.shown} undone successfully. "
                    f"The file did not exist before that edit, so it has been removed."
                )
                return EditResult(t.shown, output, current_text, None, current is not None)
            await fs.write(t.inside, snap.content)
            self.history.drop_latest(t.key)
            restored = snap.content.decode("utf-8", "replace")
            output = f"Last edit to {t.shown} undone successfully. " + cat_n(
                display_lines(restored.removeprefix(BOM)), 1, t.shown
            )
            return EditResult(t.shown, output, current_text, restored, current is not None)

    async def _commit(self, fs: TextFiles, t: Target, before: TextFile, data: bytes) -> None:
        await fs.write(t.inside, data)
        self.history.push(t.key, before.raw)

    async def replace(self, machine: Machine, path: str, old_str: str, new_str: str) -> int:
        """v1 `/v1/file/replace`: replace every occurrence of `old_str`, literally; no history.

        Zero occurrences is a success that returns 0 and leaves the file untouched (upstream's
        `replaced_count` defaults to 0); `str_replace` is the strict one.
        """
        if not old_str:
            raise bad_request("replace", "old_str must not be empty", path)
        async with self._command(machine, path, "replace") as fs:
            inside = (await fs.target(path, write=True)).inside
            file = await fs.load_text(inside, path, "replace")
            count = file.text.count(old_str)
            if count and old_str != new_str:
                await fs.write(
                    inside, checked_encode(file, file.text.replace(old_str, new_str), "replace", path)
                )
            return count
