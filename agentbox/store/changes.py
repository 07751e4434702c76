"""Change sets (seed 001): the pending workspace changes of a turn, reviewed one operation at a time.

In the tiers that stage writes, every write / edit / mkdir / move / rename / delete a tool
plans lands here instead of on disk: one change set per (session, turn), one row per
operation with its full before / after texts, a unified diff, character counts, the number
of files it touches and warnings. The user applies or rejects each operation on its own;
the set's status follows from its operations' (see `set_status`). Applying is the tool
layer's job (`agentbox.tools.changes`); this module only records, and its transitions are
conditional, so an operation is decided exactly once.

Operation ids are `<change set id>:<seq>` (seq from 1 in planning order): no new id prefix,
and an operation id names its set.

Every way this repository refuses:

    LookupError
    ├── ChangeSetNotFound      no change set has that id
    └── OperationNotFound      no operation has that id
    OperationNotPending        the operation was decided already; decisions are final
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from agentbox import ids
from agentbox.store.db import Database
from agentbox.timestamps import parse_timestamp, timestamp

OperationStatus = Literal["pending", "applied", "rejected", "failed"]
SetStatus = Literal["open", "partially_applied", "applied", "rejected"]
#: How an operation can end: the statuses `finish` accepts.
FINAL_STATUSES: tuple[str, ...] = ("applied", "rejected", "failed")


class ChangeSetNotFound(LookupError):
    pass


class OperationNotFound(LookupError):
    pass


class OperationNotPending(Exception):
    """The operation was applied, rejected or failed already; `operation` is how it stands."""

    def __init__(self, operation: OperationRecord) -> None:
        super().__init__(f"operation {operation.id} is already {operation.status}")
        self.operation = operation


@dataclass(frozen=True)
class PlannedOperation:
    """An operation as the tool layer hands it over: the plan plus what the reviewer is shown."""

    tool: str
    kind: str
    path: str
    dest: str | None = None
    before: str | None = None
    after: str | None = None
    expect: str | None = None
    summary: str = ""
    diff: str = ""
    before_chars: int = 0
    after_chars: int = 0
    files: int = 0
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class OperationRecord:
    id: str
    change_set_id: str
    seq: int
    tool: str
    kind: str
    path: str
    dest: str | None
    before: str | None
    after: str | None
    expect: str | None
    summary: str
    diff: str
    before_chars: int
    after_chars: int
    files: int
    warnings: tuple[str, ...]
    status: OperationStatus
    reason: str | None
    trash_path: str | None
    created_at: datetime
    resolved_at: datetime | None


@dataclass(frozen=True)
class ChangeSet:
    id: str
    session_id: str
    turn_id: str | None
    status: SetStatus
    created_at: datetime
    updated_at: datetime
    operations: tuple[OperationRecord, ...]
    machine: str | None = None
    """The machine it was staged on (None: staged before this was recorded; the session's)."""

    def pending(self) -> list[OperationRecord]:
        return [op for op in self.operations if op.status == "pending"]


def set_status(statuses: Iterable[str]) -> SetStatus:
    """A set is `open` while any operation waits; then `applied` if all were applied,
    `rejected` if none was (rejected or failed), else `partially_applied`."""
    seen = list(statuses)
    if not seen or "pending" in seen:
        return "open"
    applied = seen.count("applied")
    if applied == len(seen):
        return "applied"
    return "rejected" if applied == 0 else "partially_applied"


class ChangesRepo:
    """The `change_sets` and `change_operations` tables."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(
        self,
        session_id: str,
        turn_id: str | None,
        planned: Sequence[PlannedOperation],
        machine: str | None = None,
    ) -> tuple[ChangeSet, list[OperationRecord]]:
        """Append operations to the turn's change set (made on first use; reopened if decided).

        Returns the set as it is now and the new operations, in one transaction.
        """
        if not planned:
            raise ValueError("a change set needs at least one operation")

        def add(conn: sqlite3.Connection) -> tuple[str, list[str]]:
            now = timestamp()
            row = conn.execute(
                "SELECT id FROM change_sets WHERE session_id = ? AND COALESCE(turn_id, '') = COALESCE(?, '')",
                (session_id, turn_id),
            ).fetchone()
            if row is None:
                set_id = ids.new_id(ids.CHANGE_SET)
                conn.execute(
                    "INSERT INTO change_sets (id, session_id, turn_id, machine, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (set_id, session_id, turn_id, machine, now, now),
                )
            else:
                set_id = row["id"]
                conn.execute(
                    "UPDATE change_sets SET status = 'open', updated_at = ? WHERE id = ?", (now, set_id)
                )
            last = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) FROM change_operations WHERE change_set_id = ?", (set_id,)
            ).fetchone()[0]
            new_ids = []
            for seq, op in enumerate(planned, last + 1):
                op_id = f"{set_id}:{seq}"
                conn.execute(
                    "INSERT INTO change_operations (id, change_set_id, seq, tool, kind, path, dest, before_text,"
                    " after_text, expect, summary, diff, before_chars, after_chars, files, warnings, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        op_id, set_id, seq, op.tool, op.kind, op.path, op.dest, op.before, op.after, op.expect,
                        op.summary, op.diff, op.before_chars, op.after_chars, op.files,
                        json.dumps(list(op.warnings), ensure_ascii=False), now,
                    ),
                )  # fmt: skip
                new_ids.append(op_id)
            return set_id, new_ids

        set_id, new_ids = await self.db.transaction(add)
        change_set = await self.get(set_id)
        new = [op for op in change_set.operations if op.id in new_ids]
        return change_set, new

    async def get(self, change_set_id: str) -> ChangeSet:
        row = await self.db.fetchone("SELECT * FROM change_sets WHERE id = ?", (change_set_id,))
        if row is None:
            raise ChangeSetNotFound(f"no change set {change_set_id}")
        return await self._with_operations(row)

    async def for_turn(self, session_id: str, turn_id: str | None) -> ChangeSet | None:
        """The change set of a turn, if it staged anything."""
        row = await self.db.fetchone(
            "SELECT * FROM change_sets WHERE session_id = ? AND COALESCE(turn_id, '') = COALESCE(?, '')",
            (session_id, turn_id),
        )
        return None if row is None else await self._with_operations(row)

    async def of_session(self, session_id: str, status: SetStatus | None = None) -> list[ChangeSet]:
        """The change sets of a session, oldest first, optionally only those in `status`."""
        if status is None:
            rows = await self.db.fetchall(
                "SELECT * FROM change_sets WHERE session_id = ? ORDER BY id", (session_id,)
            )
        else:
            rows = await self.db.fetchall(
                "SELECT * FROM change_sets WHERE session_id = ? AND status = ? ORDER BY id",
                (session_id, status),
            )
        return [await self._with_operations(row) for row in rows]

    async def operation(self, operation_id: str) -> OperationRecord:
        row = await self.db.fetchone("SELECT * FROM change_operations WHERE id = ?", (operation_id,))
        if row is None:
            raise OperationNotFound(f"no operation {operation_id}")
        return _operation(row)

    async def finish(
        self,
        operation_id: str,
        status: OperationStatus,
        *,
        reason: str | None = None,
        trash_path: str | None = None,
    ) -> OperationRecord:
        """Decide a pending operation and update its set's status, in one transaction.

        Raises `OperationNotPending` if it was decided already, `OperationNotFound` if unknown.
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"an operation ends as one of {FINAL_STATUSES}, not {status!r}")

        def finish(conn: sqlite3.Connection) -> bool:
            now = timestamp()
            row = conn.execute(
                "UPDATE change_operations SET status = ?, reason = ?, trash_path = ?, resolved_at = ?"
                " WHERE id = ? AND status = 'pending' RETURNING change_set_id",
                (status, reason, trash_path, now, operation_id),
            ).fetchone()
            if row is None:
                return False
            set_id = row["change_set_id"]
            statuses = [
                r[0]
                for r in conn.execute(
                    "SELECT status FROM change_operations WHERE change_set_id = ?", (set_id,)
                )
            ]
            conn.execute(
                "UPDATE change_sets SET status = ?, updated_at = ? WHERE id = ?",
                (set_status(statuses), now, set_id),
            )
            return True

        done = await self.db.transaction(finish)
        record = await self.operation(operation_id)
        if not done:
            raise OperationNotPending(record)
        return record

    async def _with_operations(self, row: sqlite3.Row) -> ChangeSet:
        ops = await self.db.fetchall(
            "SELECT * FROM change_operations WHERE change_set_id = ? ORDER BY seq", (row["id"],)
        )
        return ChangeSet(
            id=row["id"],
            session_id=row["session_id"],
            turn_id=row["turn_id"],
            status=row["status"],
            created_at=parse_timestamp(row["created_at"]),
            updated_at=parse_timestamp(row["updated_at"]),
            operations=tuple(_operation(op) for op in ops),
            machine=row["machine"],
        )


def _operation(row: sqlite3.Row) -> OperationRecord:
    return OperationRecord(
        id=row["id"],
        change_set_id=row["change_set_id"],
        seq=row["seq"],
        tool=row["tool"],
        kind=row["kind"],
        path=row["path"],
        dest=row["dest"],
        before=row["before_text"],
        after=row["after_text"],
        expect=row["expect"],
        summary=row["summary"],
        diff=row["diff"],
        before_chars=row["before_chars"],
        after_chars=row["after_chars"],
        files=row["files"],
        warnings=tuple(json.loads(row["warnings"])),
        status=row["status"],
        reason=row["reason"],
        trash_path=row["trash_path"],
        created_at=parse_timestamp(row["created_at"]),
        resolved_at=parse_timestamp(row["resolved_at"]) if row["resolved_at"] else None,
    )
