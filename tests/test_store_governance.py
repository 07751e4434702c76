"""The durable records of governance on real SQLite files: approvals and change sets (migration 004)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentbox import ids
from agentbox.store.approvals import ApprovalNotFound, ApprovalNotPending, ApprovalsRepo
from agentbox.store.changes import (
    ChangeSetNotFound,
    ChangesRepo,
    OperationNotFound,
    OperationNotPending,
    PlannedOperation,
    set_status,
)
from agentbox.store.db import Database, load_migrations


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    async with Database.in_home(tmp_path) as database:
        yield database


def planned(path: str, kind: str = "edit", **fields: object) -> PlannedOperation:
    return PlannedOperation(tool="edit", kind=kind, path=path, **fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------- migration


async def test_migration_004_follows_the_others_without_gaps(db: Database) -> None:
    shipped = load_migrations()
    names = {m.version: m.name for m in shipped}
    assert names[4] == "governance"
    assert [m.version for m in shipped] == list(range(1, len(shipped) + 1))
    tables = {row[0] for row in await db.fetchall("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"approvals", "change_sets", "change_operations"} <= tables


async def test_the_schema_refuses_inconsistent_rows(db: Database) -> None:
    now = "2024-01-01T00:00:00.000Z"
    bad_approvals = [
        # resolved without a time
        ("apr_a", "allowed", "once", None),
        # pending with a scope
        ("apr_b", "pending", "once", None),
        # a deny for the whole session
        ("apr_c", "denied", "session", now),
    ]
    for approval_id, status, scope, resolved in bad_approvals:
        with pytest.raises(sqlite3.IntegrityError):
            await db.execute(
                "INSERT INTO approvals (id, session_id, tool, action, status, scope, created_at, resolved_at)"
                " VALUES (?, 's', 't', 'exec', ?, ?, ?, ?)",
                (approval_id, status, scope, now, resolved),
            )
    with pytest.raises(sqlite3.IntegrityError):  # detail must be a JSON object
        await db.execute(
            "INSERT INTO approvals (id, session_id, tool, action, detail, created_at) VALUES ('x', 's', 't', 'a', '[]', ?)",
            (now,),
        )
    await db.execute(
        "INSERT INTO change_sets (id, session_id, turn_id, created_at, updated_at) VALUES ('chg_1', 's', 't', ?, ?)",
        (now, now),
    )
    with pytest.raises(sqlite3.IntegrityError):  # a second set for the same turn
        await db.execute(
            "INSERT INTO change_sets (id, session_id, turn_id, created_at, updated_at) VALUES ('chg_2', 's', 't', ?, ?)",
            (now, now),
        )
    with pytest.raises(sqlite3.IntegrityError):  # a move needs a destination
        await db.execute(
            "INSERT INTO change_operations (id, change_set_id, seq, tool, kind, path, created_at)"
            " VALUES ('chg_1:1', 'chg_1', 1, 'edit', 'move', '/w/a', ?)",
            (now,),
        )


# ---------------------------------------------------------------- approvals


async def test_approval_lifecycle_allow_once(db: Database) -> None:
    repo = ApprovalsRepo(db)
    approval = await repo.request("ses_1", "trn_1", "bash", "exec", {"command": "ls"})
    assert ids.is_id(approval.id, ids.APPROVAL)
    assert approval.status == "pending" and approval.scope is None and approval.resolved_at is None
    assert [a.id for a in await repo.pending("ses_1")] == [approval.id]
    allowed = await repo.resolve(approval.id, "allow")
    assert allowed.status == "allowed" and allowed.scope == "once" and allowed.resolved_at is not None
    assert allowed.detail == {"command": "ls"}
    assert await repo.pending("ses_1") == []
    assert not await repo.granted("ses_1", "bash", "exec")  # once is not for the session


async def test_session_scope_grants_the_same_tool_and_action_only_in_that_session(db: Database) -> None:
    repo = ApprovalsRepo(db)
    approval = await repo.request("ses_1", "trn_1", "bash", "exec", {})
    await repo.resolve(approval.id, "allow", "session")
    assert await repo.granted("ses_1", "bash", "exec")
    assert not await repo.granted("ses_1", "bash", "web")
    assert not await repo.granted("ses_1", "exec", "exec")
    assert not await repo.granted("ses_2", "bash", "exec")


async def test_deny_keeps_the_message_and_answers_are_final(db: Database) -> None:
    repo = ApprovalsRepo(db)
    approval = await repo.request("ses_1", None, "bash", "exec", {})
    denied = await repo.resolve(approval.id, "deny", message="use the test script instead")
    assert denied.status == "denied" and denied.message == "use the test script instead"
    with pytest.raises(ApprovalNotPending) as caught:
        await repo.resolve(approval.id, "allow")
    assert caught.value.approval.status == "denied"
    with pytest.raises(ApprovalNotPending):
        await repo.cancel(approval.id)
    with pytest.raises(ApprovalNotFound):
        await repo.resolve("apr_missing", "allow")


async def test_bad_answers_are_refused_before_touching_the_row(db: Database) -> None:
    repo = ApprovalsRepo(db)
    approval = await repo.request("ses_1", None, "bash", "exec", {})
    with pytest.raises(ValueError, match="scope"):
        await repo.resolve(approval.id, "deny", "session")
    with pytest.raises(ValueError, match="decision"):
        await repo.resolve(approval.id, "maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scope"):
        await repo.resolve(approval.id, "allow", "forever")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await repo.request("ses_1", None, "bash", "exec", ["not", "a", "dict"])  # type: ignore[arg-type]
    assert (await repo.get(approval.id)).status == "pending"


async def test_cancel_marks_a_pending_approval(db: Database) -> None:
    repo = ApprovalsRepo(db)
    approval = await repo.request("ses_1", None, "bash", "exec", {})
    cancelled = await repo.cancel(approval.id)
    assert cancelled.status == "cancelled" and cancelled.scope is None
    assert [a.status for a in await repo.of_session("ses_1")] == ["cancelled"]


async def test_pending_approvals_survive_a_restart(tmp_path: Path) -> None:
    async with Database.in_home(tmp_path) as first:
        approval = await ApprovalsRepo(first).request("ses_1", "trn_1", "bash", "exec", {"command": "make"})
    async with Database.in_home(tmp_path) as second:
        repo = ApprovalsRepo(second)
        again = await repo.get(approval.id)
        assert again == approval
        assert [a.id for a in await repo.pending()] == [approval.id]
        await repo.resolve(approval.id, "allow", "session")
    async with Database.in_home(tmp_path) as third:
        assert await ApprovalsRepo(third).granted("ses_1", "bash", "exec")


# ---------------------------------------------------------------- change sets


def test_set_status_follows_the_operations() -> None:
    assert set_status([]) == "open"
    assert set_status(["pending"]) == "open"
    assert set_status(["applied", "pending"]) == "open"
    assert set_status(["applied", "applied"]) == "applied"
    assert set_status(["rejected", "failed"]) == "rejected"
    assert set_status(["applied", "rejected"]) == "partially_applied"
    assert set_status(["applied", "failed"]) == "partially_applied"


async def test_one_change_set_per_turn_with_numbered_operations(db: Database) -> None:
    repo = ChangesRepo(db)
    first, new1 = await repo.add("ses_1", "trn_1", [planned("/w/a", before="a", after="b", before_chars=1)])
    again, new2 = await repo.add("ses_1", "trn_1", [planned("/w/b"), planned("/w/c", kind="mkdir")])
    other, _ = await repo.add("ses_1", "trn_2", [planned("/w/a")])
    assert ids.is_id(first.id, ids.CHANGE_SET)
    assert again.id == first.id and other.id != first.id
    assert [op.id for op in new1] == [f"{first.id}:1"]
    assert [op.id for op in new2] == [f"{first.id}:2", f"{first.id}:3"]
    assert [op.seq for op in again.operations] == [1, 2, 3]
    assert new1[0].before == "a" and new1[0].after == "b" and new1[0].before_chars == 1
    assert (await repo.for_turn("ses_1", "trn_1")) == again
    assert (await repo.for_turn("ses_1", "trn_9")) is None
    assert [s.id for s in await repo.of_session("ses_1")] == [first.id, other.id]


async def test_operations_outside_a_turn_share_one_set(db: Database) -> None:
    repo = ChangesRepo(db)
    a, _ = await repo.add("ses_1", None, [planned("/w/a")])
    b, _ = await repo.add("ses_1", None, [planned("/w/b")])
    assert a.id == b.id and len(b.operations) == 2


async def test_finish_decides_each_operation_once_and_moves_the_set(db: Database) -> None:
    repo = ChangesRepo(db)
    change_set, ops = await repo.add(
        "ses_1", "trn_1", [planned("/w/a"), planned("/w/b"), planned("/w/c", warnings=("careful",))]
    )
    assert change_set.status == "open" and ops[2].warnings == ("careful",)
    await repo.finish(ops[0].id, "applied")
    assert (await repo.get(change_set.id)).status == "open"
    await repo.finish(ops[1].id, "rejected", reason="not this one")
    done = await repo.finish(ops[2].id, "failed", reason="stale", trash_path=None)
    assert done.status == "failed" and done.reason == "stale" and done.resolved_at is not None
    final = await repo.get(change_set.id)
    assert final.status == "partially_applied"
    assert [op.status for op in final.operations] == ["applied", "rejected", "failed"]
    assert final.operations[1].reason == "not this one"
    with pytest.raises(OperationNotPending) as caught:
        await repo.finish(ops[0].id, "rejected")
    assert caught.value.operation.status == "applied"
    with pytest.raises(ValueError):
        await repo.finish(ops[0].id, "pending")  # type: ignore[arg-type]
    with pytest.raises(OperationNotFound):
        await repo.finish("chg_missing:1", "applied")
    with pytest.raises(ChangeSetNotFound):
        await repo.get("chg_missing")
    with pytest.raises(ValueError):
        await repo.add("ses_1", "trn_1", [])


async def test_a_decided_set_reopens_when_its_turn_stages_more(db: Database) -> None:
    repo = ChangesRepo(db)
    change_set, ops = await repo.add("ses_1", "trn_1", [planned("/w/a")])
    await repo.finish(ops[0].id, "rejected")
    assert (await repo.get(change_set.id)).status == "rejected"
    reopened, _ = await repo.add("ses_1", "trn_1", [planned("/w/b")])
    assert reopened.id == change_set.id and reopened.status == "open"
    assert [s.id for s in await repo.of_session("ses_1", "open")] == [change_set.id]


async def test_change_sets_survive_a_restart(tmp_path: Path) -> None:
    async with Database.in_home(tmp_path) as first:
        change_set, ops = await ChangesRepo(first).add(
            "ses_1", "trn_1", [planned("/w/a", before="x\n", after="y\n", diff="-x\n+y\n", files=1)]
        )
    async with Database.in_home(tmp_path) as second:
        repo = ChangesRepo(second)
        again = await repo.get(change_set.id)
        assert again == change_set
        assert again.pending()[0].diff == "-x\n+y\n"
        await repo.finish(ops[0].id, "applied")
        assert (await repo.get(change_set.id)).status == "applied"
