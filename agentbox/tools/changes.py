"""Applying planned workspace changes, and the change sets that hold them for review.

File-changing tools never write: they plan `Operation`s. `apply_operations` is the one place
that puts them on disk, for `full-auto` (at once) and for an approved change set operation
(later) alike. Its rules are seed 001's, where the safer reading wins:

- write: creates a new file and never replaces one, unless the operation was planned as an
  overwrite (`before` is not None, or `expect` fingerprints an existing file), which then
  must still match the file (below). The
  parent must exist (a folder is its own `mkdir` operation).
- edit: rewrites the file in place on host files (same inode, so links, watchers and owners
  stay); through the `Machine` protocol (ssh) the machine's atomic write replaces it.
- mkdir: creates the folder and missing ancestors; an existing folder is fine.
- move / rename: never onto an existing target (`renameat2(RENAME_NOREPLACE)` on host files,
  a check then the rename through the protocol); across devices it fails and the source
  stays (no copy-then-delete).
- delete: moves the path into the trash, never removes it. The trash is a folder inside
  the machine, `<root>/.agentbox-trash/<UTC time>-<random>/<path relative to root>`
  (`TRASH_DIR`): on the workspace's own file system, so the rename is cheap and lasts as long
  as the workspace. It is out of the agent's reach: a sandbox or container mounts an empty
  read-only folder over it for its processes, and the file tools do not list it; the one
  operation on what is in it is a move back out (a restore, with the path the delete gave).
  A delete whose move into the trash fails is a failed delete: it never falls back to
  removing for good.
- Refused for every kind: the machine's root (and `/`), a path inside the workspace that
  reaches outside it through a link, overlapping source and target (a folder into itself),
  moving or deleting a mount point (a sandbox's `/tmp`) or the trash folder itself, any
  operation inside the trash but a move out of it, a move into it, and any
  operation that is stale: `expect` (the fingerprint the
  file had when planned) differs from the file now, or, without one, its text differs from
  `before`. A refused or failed operation changes nothing.

Text is what the file's bytes decode to as UTF-8, a BOM included as the first character and
CRLF kept, so `after.encode("utf-8")` is exactly the bytes written.

Every file is reached through `file_ops(machine)`, so any `Machine` can be governed: the
descriptor view where it has host files (links resolved inside the view, so escapes and
mount points are seen), the protocol elsewhere (paths lexical, the machine's own rights).

`ChangeSets` records staged operations (`agentbox.store.changes`) with what a reviewer needs
(unified diff, character counts, affected files, warnings) and applies or rejects them one
by one.
"""

from __future__ import annotations

import asyncio
import difflib
import errno
import os
import posixpath
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from agentbox.machines.base import TRASH_DIR, Machine
from agentbox.machines.errors import MachineError
from agentbox.store.changes import (
    ChangeSet,
    ChangesRepo,
    OperationNotPending,
    OperationRecord,
    PlannedOperation,
)
from agentbox.tools.base import Operation
from agentbox.tools.fingerprint import ABSENT, fingerprint
from agentbox.workspace.editor import MAX_EDIT_BYTES
from agentbox.workspace.errors import WorkspaceError, translate
from agentbox.workspace.fileops import below, file_ops, within

#: Files counted inside a folder that is moved or deleted; past it the count says "more than".
MAX_COUNTED_FILES = 10_000
#: Entries (files and folders) walked to count them; a folder with more is counted in part.
MAX_COUNTED_ENTRIES = 4 * MAX_COUNTED_FILES
#: Unchanged lines shown around each change in a unified diff.
DIFF_CONTEXT_LINES = 3

STALE = "file changed since planned"
NO_NEWLINE = "\\ No newline at end of file\n"
SKIPPED = "not applied: an earlier operation of the same call failed"

KINDS = ("write", "edit", "mkdir", "move", "rename", "delete")
AppliedStatus = Literal["applied", "failed", "skipped"]

#: What applying needs of a machine: any `Machine`; its files are reached through `file_ops`
#: (by descriptor where it has host files).
GovernedMachine = Machine


class Refused(Exception):
    """An operation that cannot be applied as planned; the message is for the model and reviewer."""


@dataclass(frozen=True)
class Applied:
    """How one operation went: `applied`, `failed` (with the reason) or `skipped`."""

    operation: Operation
    status: AppliedStatus
    reason: str | None = None
    trash_path: str | None = None
    """The inside path an applied delete moved the path to."""

    @property
    def ok(self) -> bool:
        return self.status == "applied"


def describe(op: Operation) -> str:
    """The operation's summary, or a plain one when the tool gave none."""
    if op.summary:
        return op.summary
    return f"{op.kind} {op.path} → {op.dest}" if op.dest is not None else f"{op.kind} {op.path}"


# ---------------------------------------------------------------- apply


async def apply_operations(machine: GovernedMachine, ops: Sequence[Operation]) -> list[Applied]:
    """Apply `ops` in order; after the first failure the rest are `skipped` (they may depend on it).

    Not serialized here: `ChangeSets.apply` and `ChangeSets.apply_now` hold the server's lock.
    """
    results: list[Applied] = []
    for op in ops:
        if results and not results[-1].ok:
            results.append(Applied(op, "skipped", SKIPPED))
            continue
        try:
            trash = await _apply_one(machine, op)
        except Refused as exc:
            results.append(Applied(op, "failed", str(exc)))
        except (OSError, MachineError, WorkspaceError, UnicodeError) as exc:
            results.append(Applied(op, "failed", translate(exc, _noun(op.kind), op.path).message))
        else:
            results.append(Applied(op, "applied", trash_path=trash))
    return results


def _noun(kind: str) -> str:
    return {"move": "rename", "delete": "remove"}.get(kind, kind if kind in ("write", "mkdir") else "edit")


async def _apply_one(machine: GovernedMachine, op: Operation) -> str | None:
    check(machine, op)
    if op.kind == "write":
        await _write(machine, op)
    elif op.kind == "edit":
        await _edit(machine, op)
    elif op.kind == "mkdir":
        await file_ops(machine).mkdir(op.path, parents=True)
    elif op.kind in ("move", "rename"):
        await _move(machine, op)
    else:
        return await _delete(machine, op)
    return None


def check(machine: GovernedMachine, op: Operation) -> None:
    """Raise `Refused` for what is never applied, whatever the file's state: the root, an
    escaping link, overlapping paths, the trash itself. Run again at apply time.

    Links are resolved where the machine's files allow it (host files); through the protocol
    paths are lexical, so an escaping link is the machine's own business there."""
    if op.kind not in KINDS:
        raise Refused(f"unknown operation kind {op.kind!r}")
    ops = file_ops(machine)
    source = _inside(machine, op.path)
    _not_root(machine, source, op.kind)
    follow = op.kind in ("write", "edit")
    real = _real(machine, source, follow=follow)
    if ops.within_root(source) and not ops.within_root(real):
        raise Refused(f"refused: {source} leads outside the workspace through a link ({real})")
    if op.kind in ("move", "rename", "delete") and ops.is_mount_root(real):
        raise Refused(
            f"refused: {source} is where the machine mounts a folder; it cannot be {_past(op.kind)}"
        )
    if op.kind in ("move", "rename", "delete") and real == _trash_root(machine):
        raise Refused(f"refused: {source} is the trash; what is in it can only be moved back out")
    if within(_trash_root(machine), real) and op.kind not in ("move", "rename"):
        raise Refused(f"refused: {source} is in the trash; what is in it can only be moved back out")
    if op.kind in ("move", "rename"):
        if op.dest is None:
            raise Refused(f"refused: {op.kind} of {source} names no destination")
        dest = _inside(machine, op.dest)
        _not_root(machine, dest, op.kind)
        real_dest = _real(machine, dest, follow=False)
        if ops.within_root(dest) and not ops.within_root(real_dest):
            raise Refused(f"refused: {dest} leads outside the workspace through a link ({real_dest})")
        if within(_trash_root(machine), real_dest):
            raise Refused(f"refused: {dest} is in the trash; only a delete puts things there")
        if _overlaps(real, real_dest):
            raise Refused(
                f"refused: {source} and {dest} overlap (a folder cannot move into itself or onto its parent)"
            )


def _inside(machine: GovernedMachine, path: str) -> str:
    try:
        return file_ops(machine).absolute(path)
    except MachineError as exc:
        raise Refused(f"refused: {exc.message}") from exc


def _real(machine: GovernedMachine, inside: str, *, follow: bool) -> str:
    """The inside path `inside` really names once links are followed (all but a final one
    when not `follow`)."""
    try:
        return file_ops(machine).resolve(inside, follow=follow).inside
    except MachineError as exc:
        raise Refused(f"refused: {exc.message}") from exc


def _past(kind: str) -> str:
    return {"move": "moved", "rename": "renamed", "delete": "deleted"}.get(kind, kind)


def _not_root(machine: GovernedMachine, inside: str, kind: str) -> None:
    if inside in ("/", machine.root.rstrip("/") or "/"):
        raise Refused(f"refused: {kind} of {inside}, the root of the machine or workspace")


def _overlaps(a: str, b: str) -> bool:
    return a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")


async def _stale_check(machine: GovernedMachine, inside: str, op: Operation) -> None:
    """Refuse when the file is no longer what the operation was planned against."""
    if op.expect is not None:
        if await fingerprint(machine, inside) != op.expect:
            raise Refused(f"{STALE}: {op.path} is not what it was when this {op.kind} was planned; "
                          "read it again and plan the change anew (nothing was changed)")  # fmt: skip
    elif op.before is not None and op.kind in ("write", "edit"):
        current = await _current_text(machine, inside)
        if current != op.before:
            raise Refused(f"{STALE}: {op.path} no longer has the text this {op.kind} was planned against; "
                          "read it again and plan the change anew (nothing was changed)")  # fmt: skip


async def _current_text(machine: GovernedMachine, inside: str) -> str | None:
    """The regular file's text, None when there is none, it is not UTF-8, or it is larger than
    any text a write or edit plans (so it cannot be the planned `before`)."""
    ops = file_ops(machine)
    try:
        st = await ops.lstat(inside, follow=True)
        if st is None or not st.is_file:
            return None
        return (await ops.read_bytes(inside, MAX_EDIT_BYTES)).decode("utf-8")
    except (OSError, MachineError, UnicodeDecodeError):
        return None


def _encoded(op: Operation) -> bytes:
    if op.after is None:
        raise Refused(f"refused: {op.kind} of {op.path} has no new text")
    try:
        return op.after.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Refused(f"refused: the new text of {op.path} is not valid Unicode: {exc}") from exc


async def _write(machine: GovernedMachine, op: Operation) -> None:
    ops = file_ops(machine)
    inside = _inside(machine, op.path)
    data = _encoded(op)
    if is_overwrite(op):
        if await ops.lstat(inside) is None:
            raise Refused(
                f"{STALE}: {op.path} was to be overwritten but no longer exists (nothing was written)"
            )
        await _stale_check(machine, inside, op)
        await _require_file(machine, inside, op.path)
        await ops.write_bytes(inside, data)
        return
    try:
        await ops.write_new(inside, data)
    except FileExistsError as exc:
        raise Refused(f"refused: {op.path} already exists and write never replaces a file; "
                      "edit it, or read it and plan an overwrite") from exc  # fmt: skip
    except FileNotFoundError as exc:
        raise Refused(f"refused: the folder of {op.path} does not exist; create it first") from exc


def is_overwrite(op: Operation) -> bool:
    """A write planned against an existing file: it has the old text, or that file's fingerprint
    (a file too large to diff is planned with `expect` only)."""
    return op.kind == "write" and (op.before is not None or op.expect not in (None, ABSENT))


async def _edit(machine: GovernedMachine, op: Operation) -> None:
    ops = file_ops(machine)
    inside = _inside(machine, op.path)
    data = _encoded(op)
    if await ops.lstat(inside) is None:
        raise Refused(f"{STALE}: {op.path} no longer exists (nothing was changed)")
    await _require_file(machine, inside, op.path)
    await _stale_check(machine, inside, op)
    await ops.write_bytes(inside, data)


async def _require_file(machine: GovernedMachine, inside: str, path: str) -> None:
    st = await file_ops(machine).lstat(inside, follow=True)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    if not st.is_file:
        raise Refused(f"refused: {path} is not a regular file")


async def _move(machine: GovernedMachine, op: Operation) -> None:
    assert op.dest is not None
    ops = file_ops(machine)
    src = _inside(machine, op.path)
    dst = _inside(machine, op.dest)
    if await ops.lstat(src) is None:
        raise Refused(f"{STALE}: {op.path} no longer exists (nothing was moved)")
    if op.expect is not None:
        await _stale_check(machine, src, op)
    try:
        await ops.rename(src, dst, replace=False)
    except FileExistsError as exc:
        raise Refused(f"refused: {op.dest} already exists and a {op.kind} never replaces anything") from exc
    except FileNotFoundError as exc:
        raise Refused(f"refused: the folder of {op.dest} does not exist; create it first") from exc
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise Refused(f"refused: {op.path} and {op.dest} are on different devices; "
                          f"a {op.kind} never copies, so {op.path} stays where it is") from exc  # fmt: skip
        raise


def _trash_root(machine: GovernedMachine) -> str:
    return posixpath.join(machine.root, TRASH_DIR)


def trash_path_for(machine: GovernedMachine, inside: str, moment: datetime | None = None) -> str:
    """Where a delete of `inside` goes: a fresh folder per delete, the path kept below it."""
    stamp = (moment or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
    root = machine.root.rstrip("/")
    relative = inside[len(root) + 1 :] if inside.startswith(root + "/") else inside.lstrip("/")
    return posixpath.join(_trash_root(machine), f"{stamp}-{uuid.uuid4().hex[:8]}", relative)


async def _delete(machine: GovernedMachine, op: Operation) -> str:
    ops = file_ops(machine)
    inside = _inside(machine, op.path)
    src = inside
    if await ops.lstat(src) is None:
        raise Refused(f"{STALE}: {op.path} no longer exists (nothing was deleted)")
    if op.expect is not None:
        await _stale_check(machine, src, op)
    target = trash_path_for(machine, inside)
    folder = posixpath.dirname(target)
    await ops.mkdir(folder, parents=True)
    try:
        await ops.rename(src, target, replace=False)
    except OSError as exc:
        await _remove_empty_dirs(machine, folder)
        if exc.errno == errno.EXDEV:
            raise Refused(f"refused: {op.path} is on another device than the trash; it was not deleted "
                          "(a delete only ever moves to the trash)") from exc  # fmt: skip
        raise Refused(f"refused: {op.path} could not be moved to the trash ({os.strerror(exc.errno or 0)}); "
                      "it was not deleted") from exc  # fmt: skip
    return target


async def _remove_empty_dirs(machine: GovernedMachine, folder: str) -> None:
    """Undo the trash folders a failed delete made (only while empty; never anything else)."""
    ops = file_ops(machine)
    stop = _trash_root(machine)
    while folder.startswith(stop + "/"):
        try:
            await ops.rmdir(folder)
        except (OSError, MachineError):
            return
        folder = posixpath.dirname(folder)


# ---------------------------------------------------------------- review records


def diff_name(root: str, inside: str) -> str:
    """How a diff names `inside`: relative to the machine's root when within it (`notes.md`, so
    `git apply` run in the workspace changes that file), else absolute (`/etc/hosts`)."""
    if below(root, inside) and root.rstrip("/"):
        return inside[len(root.rstrip("/")) + 1 :]
    return inside


def unified_diff(name: str, before: str | None, after: str | None) -> str:
    """A unified diff of the file `name` (`diff_name`) from `before` (None: no file) to `after`,
    with git's `a/` and `b/` prefixes, marking a missing final newline."""
    old = (before or "").splitlines(keepends=True)
    new = (after or "").splitlines(keepends=True)
    name = name.lstrip("/")  # an absolute name keeps its one slash after the prefix: `a/etc/hosts`
    lines = difflib.unified_diff(
        old,
        new,
        fromfile="/dev/null" if before is None else f"a/{name}",
        tofile=f"b/{name}",
        n=DIFF_CONTEXT_LINES,
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n" + NO_NEWLINE)
    return "".join(out)


async def count_files(
    machine: GovernedMachine, inside: str, limit: int = MAX_COUNTED_FILES
) -> tuple[int, int, bool]:
    """(files, hidden files, capped) under a folder, links not followed; stops past `limit`
    files, or after `MAX_COUNTED_ENTRIES` entries (then the count is what was seen: capped)."""
    files = hidden = 0
    nodes = await file_ops(machine).walk(inside, limit=MAX_COUNTED_ENTRIES)
    for node in nodes:
        if node.stat.is_dir and not node.stat.is_symlink:
            continue
        if files == limit:
            return files, hidden, True
        files += 1
        hidden += any(part.startswith(".") for part in node.rel.split("/"))
    return files, hidden, len(nodes) == MAX_COUNTED_ENTRIES


async def review(
    machine: GovernedMachine, op: Operation, tool: str, pending: Sequence[OperationRecord] = ()
) -> PlannedOperation:
    """The record a reviewer sees for `op`: diff, counts, affected files and warnings.

    `pending` are the operations already waiting in the same change set (an operation on the
    same path makes one of the two stale once the other is applied).
    """
    ops = file_ops(machine)
    warnings: list[str] = []
    inside = _inside(machine, op.path)
    files = 0
    if op.kind in ("write", "edit"):
        files = 1
        if op.expect is not None and await fingerprint(machine, inside) != op.expect:
            warnings.append(f"{STALE}: {inside} differs from the version this change was planned against")
        if is_overwrite(op):
            warnings.append(f"overwrites the existing file {inside}")
    elif op.kind in ("move", "rename", "delete"):
        st = await ops.lstat(inside)
        files = 1
        if st is not None and st.is_dir and not st.is_symlink:
            files, hidden, capped = await count_files(machine, inside)
            warnings.append(
                f"folder {inside} holds {'more than ' if capped else ''}{files} file(s)"
                + (f", {hidden} of them hidden" if hidden else "")
            )
        if op.expect is not None and await fingerprint(machine, inside) != op.expect:
            warnings.append(f"{STALE}: {inside} differs from the version this change was planned against")
    for other in (op.path, op.dest):
        if other is not None and not ops.within_root(other):
            warnings.append(f"{_inside(machine, other)} is outside the workspace root {machine.root}")
    for earlier in pending:
        if earlier.status == "pending" and inside in (earlier.path, earlier.dest):
            warnings.append(
                f"operation {earlier.id} also changes {inside}: applying one may make the other stale"
            )
    diff = (
        unified_diff(diff_name(machine.root, inside), op.before, op.after)
        if op.kind in ("write", "edit")
        else ""
    )
    return PlannedOperation(
        tool=tool,
        kind=op.kind,
        path=inside,
        dest=_inside(machine, op.dest) if op.dest is not None else None,
        before=op.before,
        after=op.after,
        expect=op.expect,
        summary=describe(op),
        diff=diff,
        before_chars=len(op.before or ""),
        after_chars=len(op.after or ""),
        files=files,
        warnings=tuple(warnings),
    )


def to_operation(record: OperationRecord) -> Operation:
    """The plan a recorded operation stands for, to apply it."""
    return Operation(
        kind=record.kind,  # type: ignore[arg-type]
        path=record.path,
        dest=record.dest,
        before=record.before,
        after=record.after,
        expect=record.expect,
        summary=record.summary,
    )


class ChangeSets:
    """Staging operations into the turn's change set, and applying or rejecting them one by one.

    One per server: it serializes applies (staged ones and `apply_now`'s alike), so an operation
    is never applied twice at once and no stale check interleaves with another apply's write.
    """

    def __init__(self, repo: ChangesRepo) -> None:
        self.repo = repo
        self._lock = asyncio.Lock()

    async def apply_now(self, machine: GovernedMachine, ops: Sequence[Operation]) -> list[Applied]:
        """`apply_operations` under the lock every apply takes (the full-auto tier's writes), so a
        stale check and the write after it never interleave with another apply."""
        async with self._lock:
            return await apply_operations(machine, ops)

    async def stage(
        self,
        machine: GovernedMachine,
        session_id: str,
        turn_id: str | None,
        tool: str,
        ops: Sequence[Operation],
    ) -> tuple[ChangeSet, list[OperationRecord]]:
        """Record `ops` in the change set of (session, turn); refuses (`Refused`) what could never apply."""
        for op in ops:
            check(machine, op)
        current = await self.repo.for_turn(session_id, turn_id)
        pending = list(current.operations) if current is not None else []
        planned = [await review(machine, op, tool, pending) for op in ops]
        return await self.repo.add(session_id, turn_id, planned, machine.name)

    async def apply(self, machine: GovernedMachine, operation_ids: Sequence[str]) -> list[OperationRecord]:
        """Apply each operation on its own, in the order given; each ends `applied` or `failed`.

        Raises `OperationNotPending` (before doing anything) if one was decided already.
        """
        async with self._lock:
            records = [await self.repo.operation(op_id) for op_id in operation_ids]
            for record in records:
                if record.status != "pending":
                    raise OperationNotPending(record)
            done = []
            for record in records:
                [result] = await apply_operations(machine, [to_operation(record)])
                status: Literal["applied", "failed"] = "applied" if result.ok else "failed"
                done.append(
                    await self.repo.finish(
                        record.id, status, reason=result.reason, trash_path=result.trash_path
                    )
                )
            return done

    async def apply_set(self, machine: GovernedMachine, change_set_id: str) -> list[OperationRecord]:
        """Apply every pending operation of a change set, in planning order."""
        change_set = await self.repo.get(change_set_id)
        return await self.apply(machine, [op.id for op in change_set.pending()])

    async def reject(self, operation_ids: Sequence[str], message: str | None = None) -> list[OperationRecord]:
        """Reject operations (nothing touches the disk); `message` is kept as the reason."""
        async with self._lock:
            records = [await self.repo.operation(op_id) for op_id in operation_ids]
            for record in records:
                if record.status != "pending":
                    raise OperationNotPending(record)
            return [await self.repo.finish(r.id, "rejected", reason=message) for r in records]

    async def reject_set(self, change_set_id: str, message: str | None = None) -> list[OperationRecord]:
        change_set = await self.repo.get(change_set_id)
        return await self.reject([op.id for op in change_set.pending()], message)
