"""Governance on real parts: applying operations on real files, change sets and approvals in a
real SQLite file, and seed 001's tier table cell by cell through the runner with real tools.

Machines are `LocalMachine`s over tmp dirs (and a real bubblewrap sandbox where it matters);
a cross-device move uses a real tmpfs mounted inside the workspace. The tests marked
`ON_EACH_KIND` run on a local machine and on an ssh machine (the real sshd of
tests/conftest.py, on this host, whose files go through the `Machine` protocol only); the
others are about host files by nature (inodes kept in place, links resolved inside the
view, mounts), or about the tier table, which is the same whatever the kind.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import Sshd, host_fingerprint, traversable
from pydantic import BaseModel, Field

from agentbox.machines.base import Machine
from agentbox.machines.local import LocalMachine
from agentbox.machines.ssh import SshMachine, SshOptions
from agentbox.store.approvals import Approval, ApprovalsRepo
from agentbox.store.changes import ChangesRepo, OperationNotPending
from agentbox.store.db import Database
from agentbox.store.todos import TodoRepo
from agentbox.tools import changes as changes_mod
from agentbox.tools.approvals import Approvals, EventKind
from agentbox.tools.base import Action, Operation, Tool, ToolConfig, ToolContext, ToolResult
from agentbox.tools.changes import (
    DIFF_CONTEXT_LINES,
    MAX_COUNTED_FILES,
    STALE,
    TRASH_DIR,
    ChangeSets,
    apply_operations,
    count_files,
    review,
    unified_diff,
)
from agentbox.tools.fingerprint import ABSENT, CHUNK
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import EACH_CALL, Decision, Tier, decide, outside_root_write
from agentbox.tools.toolsets import canonical_tools

#: Seconds a test waits for a condition (an approval requested, a row written) before failing.
DEADLINE = 20.0
SESSION = "ses_test"
TURN = "trn_test"


# ---------------------------------------------------------------- fixtures

#: The kinds `ON_EACH_KIND` tests run on: host files by descriptor, and files through the protocol.
KINDS = ["local", "ssh"]
ON_EACH_KIND = pytest.mark.parametrize("kind", KINDS, indirect=True)


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> str:
    """The machine kind of the test: `local` unless `ON_EACH_KIND` says otherwise."""
    return str(getattr(request, "param", "local"))


@pytest.fixture
def ws(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """An empty workspace folder; on ssh, one of the ssh user's."""
    root = tmp_path / "ws"
    if kind == "ssh":
        sshd: Sshd = request.getfixturevalue("sshd")
        return sshd.owned_dir(traversable(tmp_path, request.getfixturevalue("tmp_path_factory")) / "ws")
    root.mkdir()
    return root


@pytest.fixture
async def machine(kind: str, ws: Path, request: pytest.FixtureRequest) -> AsyncIterator[Machine]:
    """A machine rooted at `ws`: local, or an ssh machine logged in to the test sshd."""
    if kind != "ssh":
        yield LocalMachine("local", ws)
        return
    sshd: Sshd = request.getfixturevalue("sshd")
    ssh = SshMachine("ssh", SshOptions.from_options(sshd.options(root=str(ws))))
    await ssh.start()
    try:
        yield ssh
    finally:
        await ssh.close()


@pytest.fixture
def own(kind: str, ws: Path, request: pytest.FixtureRequest) -> Callable[[], None]:
    """Give what the test made in `ws` to the machine's user (a no-op where that is the test's).

    A folder the test makes as root is not the ssh login's to write into or move."""

    def give() -> None:
        if kind != "ssh":
            return
        entry = pwd.getpwnam(request.getfixturevalue("sshd").user)
        for path in [ws, *ws.rglob("*")]:
            os.lchown(path, entry.pw_uid, entry.pw_gid)

    return give


@pytest.fixture
def other_device(ws: Path) -> Iterator[Path]:
    """A folder on another file system than the workspace: a tmpfs mounted inside it (root),
    else /dev/shm when that is another device."""
    mnt = ws / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode == 0:
        yield mnt
        subprocess.run(["umount", "-l", str(mnt)], check=True)
        return
    mnt.rmdir()
    if Path("/dev/shm").is_dir() and os.stat("/dev/shm").st_dev != os.stat(ws).st_dev:
        folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
        yield folder
        shutil.rmtree(folder, ignore_errors=True)
        return
    pytest.skip("no second file system available (cannot mount a tmpfs, /dev/shm is the same device)")


def tools_for(
    machine: Any,
    db: Database,
    tier: Tier,
    toolset: dict[str, Tool],
    *,
    plan: bool = False,
    approvals: Approvals | None = None,
    config: ToolConfig | None = None,
) -> SessionTools:
    return SessionTools(
        machine=machine,
        session_id=SESSION,
        tier=tier,
        toolset=toolset,
        changes=ChangeSets(ChangesRepo(db)),
        approvals=approvals or Approvals(ApprovalsRepo(db)),
        todos=TodoRepo(db),
        plan=plan,
        turn_id=TURN,
        config=config or ToolConfig(),
    )


class Answerer:
    """Answers each approval as it is requested, from its own task (as the sessions API would)."""

    def __init__(
        self, approvals: Approvals, decision: str = "allow", scope: str = "once", message: str | None = None
    ) -> None:
        self.approvals = approvals
        self.answer = (decision, scope, message)
        self.requested: list[Approval] = []
        self._tasks: set[asyncio.Task[Approval]] = set()
        approvals.listeners.append(self)

    def __call__(self, kind: EventKind, approval: Approval) -> None:
        if kind != "approval.requested":
            return
        self.requested.append(approval)
        decision, scope, message = self.answer
        task = asyncio.get_running_loop().create_task(
            self.approvals.resolve(approval.id, decision, scope, message)  # type: ignore[arg-type]
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class Requests:
    """Records requested approvals and lets a test wait for the next one, without answering."""

    def __init__(self, approvals: Approvals) -> None:
        self.seen: list[Approval] = []
        self.event = asyncio.Event()
        approvals.listeners.append(self)

    def __call__(self, kind: EventKind, approval: Approval) -> None:
        if kind == "approval.requested":
            self.seen.append(approval)
            self.event.set()

    async def next(self) -> Approval:
        await asyncio.wait_for(self.event.wait(), DEADLINE)
        self.event.clear()
        return self.seen[-1]


def real(*names: str, overwrite_if_read: bool = False) -> dict[str, Tool]:
    tools = canonical_tools(overwrite_if_read=overwrite_if_read)
    return {name: tools[name] for name in names}


def inode(path: Path) -> int:
    return path.stat().st_ino


# ---------------------------------------------------------------- fingerprint


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7])
def test_fingerprint_is_sha256_and_size_across_chunk_boundaries(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert host_fingerprint(path) == f"sha256:{hashlib.sha256(data).hexdigest()}:{size}"


def test_fingerprint_of_missing_or_folder_is_absent(tmp_path: Path) -> None:
    assert host_fingerprint(tmp_path / "missing") == ABSENT
    assert host_fingerprint(tmp_path) == ABSENT
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("same")
    b.write_text("same")
    assert host_fingerprint(a) == host_fingerprint(b)
    b.write_text("Same")
    assert host_fingerprint(a) != host_fingerprint(b)


# ---------------------------------------------------------------- apply_operations


@ON_EACH_KIND
async def test_write_creates_a_new_file_and_never_replaces_one(machine: Machine, ws: Path) -> None:
    [made] = await apply_operations(machine, [Operation("write", "new.txt", after="héllo\n", expect=ABSENT)])
    assert made.ok and (ws / "new.txt").read_bytes() == "héllo\n".encode()
    (ws / "taken.txt").write_text("keep me")
    [refused] = await apply_operations(machine, [Operation("write", "taken.txt", after="clobber")])
    assert refused.status == "failed" and "already exists" in (refused.reason or "")
    assert (ws / "taken.txt").read_text() == "keep me"
    [orphan] = await apply_operations(machine, [Operation("write", "no/such/dir/x.txt", after="x")])
    assert orphan.status == "failed" and "does not exist" in (orphan.reason or "")
    assert not (ws / "no").exists()


# Host files only: the inode is kept by an in-place write; the protocol writes by atomic rename.
async def test_planned_overwrite_keeps_the_inode_and_refuses_when_stale(
    machine: LocalMachine, ws: Path
) -> None:
    target = ws / "a.txt"
    target.write_text("old\n")
    before_inode = inode(target)
    op = Operation("write", "a.txt", before="old\n", after="new\n", expect=host_fingerprint(target))
    [done] = await apply_operations(machine, [op])
    assert done.ok and target.read_text() == "new\n" and inode(target) == before_inode
    # The same plan again is stale now: the file is no longer "old\n".
    [stale] = await apply_operations(machine, [op])
    assert stale.status == "failed" and STALE in (stale.reason or "")
    assert target.read_text() == "new\n"
    # Planned with the old text only (no fingerprint): the text decides.
    [by_text] = await apply_operations(machine, [Operation("write", "a.txt", before="old\n", after="x")])
    assert by_text.status == "failed" and STALE in (by_text.reason or "")
    # Planned with a fingerprint only (a file too big to diff) is an overwrite too.
    [by_print] = await apply_operations(
        machine, [Operation("write", "a.txt", after="y", expect=host_fingerprint(target))]
    )
    assert by_print.ok and target.read_text() == "y"


# Host files only: the inode is kept by an in-place write; the protocol writes by atomic rename.
async def test_edit_writes_in_place_and_keeps_bom_and_crlf(machine: LocalMachine, ws: Path) -> None:
    target = ws / "win.txt"
    raw = "\ufeffone\r\ntwo\r\n".encode()
    target.write_bytes(raw)
    before = raw.decode("utf-8")
    after = before.replace("two", "TWO")
    before_inode = inode(target)
    [done] = await apply_operations(
        machine, [Operation("edit", "win.txt", before=before, after=after, expect=host_fingerprint(target))]
    )
    assert done.ok
    assert target.read_bytes() == b"\xef\xbb\xbfone\r\nTWO\r\n"
    assert inode(target) == before_inode


@ON_EACH_KIND
async def test_stale_edit_fails_and_clobbers_nothing(machine: Machine, ws: Path) -> None:
    target = ws / "a.txt"
    target.write_text("planned against this\n")
    op = Operation(
        "edit", "a.txt", before="planned against this\n", after="edited\n", expect=host_fingerprint(target)
    )
    target.write_text("someone else's newer text\n")
    [stale] = await apply_operations(machine, [op])
    assert stale.status == "failed"
    assert (
        stale.reason is not None and stale.reason.startswith(STALE) and "nothing was changed" in stale.reason
    )
    assert target.read_text() == "someone else's newer text\n"
    target.unlink()
    [gone] = await apply_operations(machine, [op])
    assert gone.status == "failed" and "no longer exists" in (gone.reason or "")
    assert not target.exists()


@ON_EACH_KIND
async def test_mkdir_creates_ancestors_accepts_an_existing_folder_refuses_a_file(
    machine: Machine, ws: Path
) -> None:
    [made] = await apply_operations(machine, [Operation("mkdir", "a/b/c")])
    assert made.ok and (ws / "a/b/c").is_dir()
    [again] = await apply_operations(machine, [Operation("mkdir", "a/b/c")])
    assert again.ok
    (ws / "file").write_text("x")
    [blocked] = await apply_operations(machine, [Operation("mkdir", "file")])
    assert blocked.status == "failed" and (ws / "file").read_text() == "x"


@ON_EACH_KIND
async def test_move_and_rename_never_replace_a_target(
    machine: Machine, ws: Path, own: Callable[[], None]
) -> None:
    (ws / "a.txt").write_text("a")
    (ws / "b.txt").write_text("b")
    [refused] = await apply_operations(machine, [Operation("move", "a.txt", dest="b.txt")])
    assert refused.status == "failed" and "already exists" in (refused.reason or "")
    assert (ws / "a.txt").read_text() == "a" and (ws / "b.txt").read_text() == "b"
    [no_folder] = await apply_operations(machine, [Operation("move", "a.txt", dest="missing/a.txt")])
    assert no_folder.status == "failed" and (ws / "a.txt").exists()
    (ws / "d").mkdir()
    own()
    [moved] = await apply_operations(machine, [Operation("move", "a.txt", dest="d/a.txt")])
    assert moved.ok and (ws / "d/a.txt").read_text() == "a" and not (ws / "a.txt").exists()
    [renamed] = await apply_operations(machine, [Operation("rename", "d", dest="e")])
    assert renamed.ok and (ws / "e/a.txt").read_text() == "a"


# Host files only: mounts are facts of the descriptor view; through the protocol they are unknown.
async def test_cross_device_move_fails_and_keeps_the_source(
    machine: LocalMachine, ws: Path, other_device: Path
) -> None:
    assert os.stat(other_device).st_dev != os.stat(ws).st_dev
    (ws / "a.txt").write_text("stay")
    [refused] = await apply_operations(
        machine, [Operation("move", "a.txt", dest=str(other_device / "a.txt"))]
    )
    assert refused.status == "failed" and "different devices" in (refused.reason or "")
    assert (ws / "a.txt").read_text() == "stay"
    assert not (other_device / "a.txt").exists()


@ON_EACH_KIND
async def test_delete_moves_to_the_trash_and_can_be_restored(
    machine: Machine, ws: Path, own: Callable[[], None]
) -> None:
    (ws / "docs").mkdir()
    (ws / "docs/a.md").write_text("keep this")
    own()
    [done] = await apply_operations(machine, [Operation("delete", "docs/a.md")])
    assert done.ok and done.trash_path is not None
    assert not (ws / "docs/a.md").exists()
    root = machine.root
    assert done.trash_path.startswith(f"{root}/{TRASH_DIR}/") and done.trash_path.endswith("/docs/a.md")
    trashed = Path(done.trash_path)
    assert trashed.read_text() == "keep this"
    # Recoverable: moving it back is an ordinary move.
    [restored] = await apply_operations(machine, [Operation("move", done.trash_path, dest="docs/a.md")])
    assert restored.ok and (ws / "docs/a.md").read_text() == "keep this"


@ON_EACH_KIND
async def test_deleting_a_folder_keeps_hidden_contents_in_the_trash(
    machine: Machine, ws: Path, own: Callable[[], None]
) -> None:
    (ws / "proj/.git").mkdir(parents=True)
    (ws / "proj/.git/HEAD").write_text("ref")
    (ws / "proj/.env").write_text("A=1")
    (ws / "proj/main.py").write_text("print()")
    own()
    [one, two] = await apply_operations(machine, [Operation("delete", "proj"), Operation("delete", "other")])
    assert one.ok and two.status == "failed"  # nothing at "other": a failed delete, not an error
    assert not (ws / "proj").exists()
    trashed = Path(one.trash_path or "")
    assert sorted(p.relative_to(trashed).as_posix() for p in trashed.rglob("*")) == [
        ".env", ".git", ".git/HEAD", "main.py"
    ]  # fmt: skip
    # Two deletes of the same path never collide in the trash.
    (ws / "proj").mkdir()
    own()
    [again] = await apply_operations(machine, [Operation("delete", "proj")])
    assert again.ok and again.trash_path != one.trash_path


# Host files only: mounts are facts of the descriptor view; through the protocol they are unknown.
async def test_a_delete_that_cannot_reach_the_trash_deletes_nothing(
    machine: LocalMachine, ws: Path, other_device: Path
) -> None:
    victim = other_device / "precious.txt"
    victim.write_text("still here")
    [failed] = await apply_operations(machine, [Operation("delete", str(victim))])
    assert failed.status == "failed" and "was not deleted" in (failed.reason or "")
    assert victim.read_text() == "still here"
    trash = ws / TRASH_DIR
    assert not trash.exists() or list(trash.iterdir()) == []  # its own empty folders are undone


# Host files only: an escaping link is seen by resolving it inside the view; the protocol is lexical.
async def test_the_root_escaping_links_overlaps_and_the_trash_are_refused(
    machine: LocalMachine, ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside")
    (ws / "link").symlink_to(outside)
    (ws / "filelink").symlink_to(outside / "secret.txt")
    (ws / "d/sub").mkdir(parents=True)
    (ws / TRASH_DIR).mkdir()
    cases = [
        (Operation("delete", "."), "root"),
        (Operation("delete", machine.root), "root"),
        (Operation("delete", "/"), "root"),
        (Operation("move", ".", dest="elsewhere"), "root"),
        (Operation("move", "d", dest="."), "root"),
        (Operation("mkdir", "."), "root"),
        (Operation("edit", "filelink", before="outside", after="pwned"), "through a link"),
        (Operation("write", "link/new.txt", after="pwned"), "through a link"),
        (Operation("delete", "link/secret.txt"), "through a link"),
        (Operation("move", "d", dest="d/sub/d"), "overlap"),
        (Operation("move", "d/sub", dest="d"), "overlap"),
        (Operation("rename", "d", dest="d"), "overlap"),
        (Operation("delete", TRASH_DIR), "trash"),
        (Operation("move", "d", dest=None), "destination"),
    ]
    for op, why in cases:
        [result] = await apply_operations(machine, [op])
        assert result.status == "failed", op
        assert why in (result.reason or ""), (op, result.reason)
    assert (outside / "secret.txt").read_text() == "outside"
    assert not (outside / "new.txt").exists()
    assert (ws / "d/sub").is_dir()
    # Acting on a link itself is fine: deleting it moves the link, not what it points at.
    [unlinked] = await apply_operations(machine, [Operation("delete", "filelink")])
    assert unlinked.ok and Path(unlinked.trash_path or "").is_symlink()
    assert (outside / "secret.txt").read_text() == "outside"


@ON_EACH_KIND
async def test_after_a_failure_the_rest_of_the_batch_is_skipped(machine: Machine, ws: Path) -> None:
    (ws / "taken").write_text("x")
    results = await apply_operations(
        machine,
        [
            Operation("mkdir", "first"),
            Operation("write", "taken", after="y"),
            Operation("write", "first/later.txt", after="z"),
        ],
    )
    assert [r.status for r in results] == ["applied", "failed", "skipped"]
    assert not (ws / "first/later.txt").exists()


# ---------------------------------------------------------------- review records


def test_diff_shows_exactly_the_context_lines() -> None:
    before = "".join(f"line{i}\n" for i in range(1, 21))
    after = before.replace("line10\n", "LINE10\n")
    diff = unified_diff("/w/f.txt", before, after)
    assert "-line10\n+LINE10\n" in diff
    shown = [f"line{10 - k}" for k in range(1, DIFF_CONTEXT_LINES + 1)]
    shown += [f"line{10 + k}" for k in range(1, DIFF_CONTEXT_LINES + 1)]
    for line in shown:
        assert f" {line}\n" in diff
    assert f"line{10 - DIFF_CONTEXT_LINES - 1}\n" not in diff
    assert f"line{10 + DIFF_CONTEXT_LINES + 1}\n" not in diff
    assert diff.startswith("--- a/w/f.txt\n+++ b/w/f.txt\n")


def test_diff_of_a_new_file_and_a_missing_final_newline() -> None:
    diff = unified_diff("/w/n.txt", None, "a\nb")
    assert diff.startswith("--- /dev/null\n+++ b/w/n.txt\n")
    assert diff.endswith("+b\n\\ No newline at end of file\n")


async def test_folder_file_counts_stop_at_the_limit(tmp_path: Path) -> None:
    folder = tmp_path / "many"
    (folder / ".hidden").mkdir(parents=True)
    for i in range(MAX_COUNTED_FILES - 2):
        (folder / f"f{i}").touch()
    (folder / ".hidden/a").touch()
    (folder / ".dot").touch()
    local = LocalMachine("count", folder)
    assert await count_files(local, str(folder)) == (MAX_COUNTED_FILES, 2, False)
    (folder / "one-more").touch()
    files, _, capped = await count_files(local, str(folder))
    assert (files, capped) == (MAX_COUNTED_FILES, True)


@ON_EACH_KIND
async def test_review_records_counts_and_warnings(machine: Machine, ws: Path) -> None:
    (ws / "proj").mkdir()
    (ws / "proj/.env").write_text("x")
    (ws / "proj/a.py").write_text("y")
    (ws / "f.txt").write_text("old")
    folder = await review(machine, Operation("delete", "proj"), "edit")
    assert folder.files == 2 and folder.path == f"{machine.root}/proj"
    assert any("2 file(s), 1 of them hidden" in w for w in folder.warnings)
    stale = await review(
        machine, Operation("edit", "f.txt", before="old", after="new", expect="sha256:x:1"), "edit"
    )
    assert any(w.startswith(STALE) for w in stale.warnings)
    assert (stale.before_chars, stale.after_chars, stale.files) == (3, 3, 1)
    over = await review(machine, Operation("write", "f.txt", before="old", after="newer"), "write")
    assert any("overwrites" in w for w in over.warnings)
    outside = await review(machine, Operation("write", "/tmp/agentbox-never-applied.txt", after="x"), "write")
    assert any("outside the workspace root" in w for w in outside.warnings)


# ---------------------------------------------------------------- change sets


@ON_EACH_KIND
async def test_partial_apply_of_a_change_set(machine: Machine, ws: Path, db: Database) -> None:
    sets = ChangeSets(ChangesRepo(db))
    (ws / "a.txt").write_text("alpha\n")
    (ws / "c.txt").write_text("gamma\n")
    ops = [
        Operation("edit", "a.txt", before="alpha\n", after="ALPHA\n", expect=host_fingerprint(ws / "a.txt")),
        Operation("write", "b.txt", after="beta\n", expect=ABSENT),
        Operation("delete", "c.txt", expect=host_fingerprint(ws / "c.txt")),
    ]
    change_set, staged = await sets.stage(machine, SESSION, TURN, "edit", ops)
    assert [op.status for op in staged] == ["pending"] * 3
    assert staged[0].diff.count("-alpha") == 1 and staged[0].diff.count("+ALPHA") == 1
    # Nothing is on disk yet.
    assert (ws / "a.txt").read_text() == "alpha\n" and not (ws / "b.txt").exists() and (ws / "c.txt").exists()
    first, third = await sets.apply(machine, [staged[0].id, staged[2].id])
    [second] = await sets.reject([staged[1].id], "not now")
    assert (first.status, second.status, third.status) == ("applied", "rejected", "applied")
    assert second.reason == "not now" and third.trash_path is not None
    assert (ws / "a.txt").read_text() == "ALPHA\n"
    assert not (ws / "b.txt").exists()
    assert not (ws / "c.txt").exists() and Path(third.trash_path).read_text() == "gamma\n"
    assert (await sets.repo.get(change_set.id)).status == "partially_applied"
    with pytest.raises(OperationNotPending):
        await sets.apply(machine, [staged[0].id])
    with pytest.raises(OperationNotPending):
        await sets.reject([staged[2].id])


@ON_EACH_KIND
async def test_stale_operation_is_refused_at_apply(machine: Machine, ws: Path, db: Database) -> None:
    sets = ChangeSets(ChangesRepo(db))
    (ws / "a.txt").write_text("v1\n")
    change_set, [op] = await sets.stage(
        machine, SESSION, TURN, "edit",
        [Operation("edit", "a.txt", before="v1\n", after="v2\n", expect=host_fingerprint(ws / "a.txt"))],
    )  # fmt: skip
    (ws / "a.txt").write_text("changed by the user\n")
    [failed] = await sets.apply(machine, [op.id])
    assert failed.status == "failed" and (failed.reason or "").startswith(STALE)
    assert (ws / "a.txt").read_text() == "changed by the user\n"
    assert (await sets.repo.get(change_set.id)).status == "rejected"


@ON_EACH_KIND
async def test_apply_set_and_reject_set(machine: Machine, ws: Path, db: Database) -> None:
    sets = ChangeSets(ChangesRepo(db))
    applied_set, _ = await sets.stage(
        machine, SESSION, "trn_1", "write", [Operation("mkdir", "d"), Operation("write", "d/x", after="x")]
    )
    done = await sets.apply_set(machine, applied_set.id)
    assert [r.status for r in done] == ["applied", "applied"] and (ws / "d/x").read_text() == "x"
    assert (await sets.repo.get(applied_set.id)).status == "applied"
    rejected_set, _ = await sets.stage(
        machine, SESSION, "trn_2", "write", [Operation("write", "y", after="y")]
    )
    await sets.reject_set(rejected_set.id, "no")
    assert (await sets.repo.get(rejected_set.id)).status == "rejected" and not (ws / "y").exists()


@ON_EACH_KIND
async def test_staging_refuses_what_could_never_apply(machine: Machine, ws: Path, db: Database) -> None:
    sets = ChangeSets(ChangesRepo(db))
    with pytest.raises(changes_mod.Refused, match="root"):
        await sets.stage(machine, SESSION, TURN, "edit", [Operation("delete", ".")])
    assert await sets.repo.for_turn(SESSION, TURN) is None


@ON_EACH_KIND
async def test_two_pending_changes_of_one_path_warn(machine: Machine, ws: Path, db: Database) -> None:
    sets = ChangeSets(ChangesRepo(db))
    (ws / "a.txt").write_text("x")
    _, [first] = await sets.stage(
        machine, SESSION, TURN, "edit", [Operation("edit", "a.txt", before="x", after="y")]
    )
    _, [second] = await sets.stage(
        machine, SESSION, TURN, "edit", [Operation("edit", "a.txt", before="x", after="z")]
    )
    assert first.warnings == ()
    assert any(first.id in w for w in second.warnings)


# ---------------------------------------------------------------- approvals


async def test_request_and_wait_allows_after_a_resolve_from_another_task(db: Database) -> None:
    approvals = Approvals(ApprovalsRepo(db))
    events: list[tuple[str, str]] = []

    async def listen(kind: EventKind, approval: Approval) -> None:
        events.append((kind, approval.status))

    approvals.listeners.append(listen)
    requests = Requests(approvals)
    waiter = asyncio.create_task(approvals.request_and_wait(SESSION, TURN, "bash", "exec", {"command": "ls"}))
    approval = await requests.next()
    assert approval.status == "pending" and approval.detail == {"command": "ls"}
    assert not waiter.done()
    await approvals.resolve(approval.id, "allow")
    assert await asyncio.wait_for(waiter, DEADLINE) == (True, None)
    assert events == [("approval.requested", "pending"), ("approval.resolved", "allowed")]


async def test_deny_returns_the_message_and_session_scope_stops_asking(db: Database) -> None:
    approvals = Approvals(ApprovalsRepo(db))
    Answerer(approvals, "deny", message="run the tests instead")
    assert await approvals.request_and_wait(SESSION, TURN, "bash", "exec", {}) == (
        False,
        "run the tests instead",
    )
    approvals.listeners.clear()
    session = Answerer(approvals, "allow", "session")
    assert await approvals.request_and_wait(SESSION, TURN, "github__search", "mcp", {}) == (True, None)
    assert await approvals.request_and_wait(SESSION, TURN, "github__search", "mcp", {}) == (True, None)
    assert len(session.requested) == 1  # the second call did not ask
    await approvals.request_and_wait(SESSION, TURN, "browser", "browser_read", {})
    assert len(session.requested) == 2  # another (tool, action) still asks


@pytest.mark.parametrize("action", sorted(EACH_CALL))
async def test_exec_web_and_external_reads_ask_on_every_call_whatever_the_scope(
    db: Database, action: str
) -> None:
    """Seed 001's "each time": an answer for the session lets one call through, recorded `once`."""
    approvals = Approvals(ApprovalsRepo(db))
    answerer = Answerer(approvals, "allow", "session")
    for _ in range(2):
        assert await approvals.request_and_wait(SESSION, TURN, "tool", action, {}) == (True, None)
    assert len(answerer.requested) == 2
    assert [a.scope for a in await approvals.repo.of_session(SESSION)] == ["once", "once"]


async def test_a_cancelled_wait_cancels_its_approval(db: Database) -> None:
    approvals = Approvals(ApprovalsRepo(db))
    requests = Requests(approvals)
    waiter = asyncio.create_task(approvals.request_and_wait(SESSION, TURN, "bash", "exec", {}))
    approval = await requests.next()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (await approvals.repo.get(approval.id)).status == "cancelled"


async def test_a_listener_that_fails_does_not_stop_the_request(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    approvals = Approvals(ApprovalsRepo(db))

    def broken(kind: EventKind, approval: Approval) -> None:
        raise RuntimeError("listener bug")

    approvals.listeners.append(broken)
    Answerer(approvals)
    with caplog.at_level(logging.ERROR):
        assert await approvals.request_and_wait(SESSION, TURN, "bash", "exec", {}) == (True, None)
    assert "listener failed" in caplog.text


RESTART_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from agentbox.machines.local import LocalMachine
    from agentbox.store.approvals import ApprovalsRepo
    from agentbox.store.changes import ChangesRepo
    from agentbox.store.db import Database
    from agentbox.store.todos import TodoRepo
    from agentbox.tools.approvals import Approvals
    from agentbox.tools.changes import ChangeSets
    from agentbox.tools.runner import SessionTools
    from agentbox.tools.shell import TOOLS
    from agentbox.tools.tiers import Tier

    async def main():
        async with Database.in_home(Path(sys.argv[1])) as db:
            tools = SessionTools(
                machine=LocalMachine("local", Path(sys.argv[2])), session_id="ses_test", tier=Tier.FULL_ASK,
                toolset={"bash": TOOLS["exec"].renamed("bash")}, changes=ChangeSets(ChangesRepo(db)),
                approvals=Approvals(ApprovalsRepo(db)), todos=TodoRepo(db), turn_id="trn_test",
            )
            await tools.call("bash", {"command": "echo never > ran.txt"})

    asyncio.run(main())
    """
)


async def test_a_pending_approval_survives_a_restart(tmp_path: Path, ws: Path) -> None:
    """A server that dies while a call waits leaves the approval pending; after a restart it can be
    listed, waited for and answered."""
    home = tmp_path / "home"
    first = subprocess.Popen([sys.executable, "-c", RESTART_SCRIPT, str(home), str(ws)])
    try:
        pending: list[Approval] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while not pending:
            assert first.poll() is None, "the first server ended before asking"
            assert loop.time() < deadline, "no approval was requested"
            if (home / "agentbox.db").exists():
                async with Database.in_home(home) as peek:
                    pending = await ApprovalsRepo(peek).pending(SESSION)
            await asyncio.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert not (ws / "ran.txt").exists()
    async with Database.in_home(home) as db:
        approvals = Approvals(ApprovalsRepo(db))
        [approval] = await approvals.repo.pending(SESSION)
        assert approval.tool == "bash" and approval.action == "exec"
        assert approval.detail == {"arguments": {"command": "echo never > ran.txt"}}
        waiter = asyncio.create_task(approvals.wait(approval.id))
        await approvals.resolve(approval.id, "deny", message="not after a crash")
        assert await asyncio.wait_for(waiter, DEADLINE) == (False, "not after a crash")


# ---------------------------------------------------------------- the tier table


# Seed 001's table typed out again (not read from tiers.py): A allow, S stage, Q ask, F forbid,
# in the order read-only, workspace-write, full-ask, full-auto.
SEED_TABLE = {
    Action.READ: "AAAA",
    Action.READ_EXTERNAL: "FFQA",
    Action.WRITE: "FSSA",
    Action.EXEC: "FFQA",
    Action.WEB: "FFQA",
    Action.BROWSER_READ: "FFQA",
    Action.BROWSER_WRITE: "FFQA",
    Action.MCP: "FFQA",
    Action.TASK: "AAAA",
    Action.META: "AAAA",
}
# Plan: workspace read-only, no exec / browser changes / MCP / applying changes; in the full
# tiers read-only external research (web, external reads, browser snapshots) as the tier says.
SEED_PLAN_TABLE = {
    Action.READ: "AAAA",
    Action.READ_EXTERNAL: "FFQA",
    Action.WRITE: "FFFF",
    Action.EXEC: "FFFF",
    Action.WEB: "FFQA",
    Action.BROWSER_READ: "FFQA",
    Action.BROWSER_WRITE: "FFFF",
    Action.MCP: "FFFF",
    Action.TASK: "AAAA",
    Action.META: "AAAA",
}
TIERS = (Tier.READ_ONLY, Tier.WORKSPACE_WRITE, Tier.FULL_ASK, Tier.FULL_AUTO)
LETTERS = {"A": Decision.ALLOW, "S": Decision.STAGE, "Q": Decision.ASK, "F": Decision.FORBID}
CELLS = [(tier, action, plan) for plan in (False, True) for action in SEED_TABLE for tier in TIERS]


def expected(tier: Tier, action: Action, plan: bool) -> Decision:
    table = SEED_PLAN_TABLE if plan else SEED_TABLE
    return LETTERS[table[action][TIERS.index(tier)]]


@pytest.mark.parametrize(("tier", "action", "plan"), CELLS)
def test_decide_matches_the_seed_table(tier: Tier, action: Action, plan: bool) -> None:
    assert decide(tier, action, plan=plan) == expected(tier, action, plan)


def test_the_table_covers_every_action() -> None:
    assert set(SEED_TABLE) == set(Action) == set(SEED_PLAN_TABLE)


class ProbeParams(BaseModel):
    note: str = Field(default="", description="Anything.")


def probe(name: str, action: Action, ran: list[str]) -> Tool:
    """A small real tool for an action no real tool has yet (browser, MCP, task, ...)."""

    async def run(ctx: ToolContext, params: ProbeParams) -> ToolResult:
        ran.append(name)
        return ToolResult.text(f"{name} ran {params.note}")

    return Tool(name, f"probe for {action}", ProbeParams, action, run)


class Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"web page text"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web_url() -> Iterator[str]:
    """A loopback HTTP server for the real web_fetch (the sessions here allow private addresses)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/page"
    server.shutdown()
    thread.join()


#: Per action: (tool name, arguments). Real tools for read, external read, write, exec, web and meta;
#: small probe tools for the actions no real tool has yet.
PROBES: dict[Action, tuple[str, dict[str, Any]]] = {
    Action.READ: ("read", {"path": "notes.txt"}),
    Action.READ_EXTERNAL: ("read", {"path": "OUTSIDE"}),
    Action.WRITE: ("edit", {"path": "notes.txt", "oldText": "hello", "newText": "bye"}),
    Action.EXEC: ("exec", {"command": "echo ran > ran.txt"}),
    Action.WEB: ("web_fetch", {"url": "WEB"}),
    Action.BROWSER_READ: ("browser_read_probe", {}),
    Action.BROWSER_WRITE: ("browser_write_probe", {}),
    Action.MCP: ("mcp__srv__probe", {}),
    Action.TASK: ("task_probe", {}),
    Action.META: ("todo_write", {"todos": [{"content": "check the table", "status": "pending"}]}),
}


@pytest.mark.parametrize(("tier", "action", "plan"), CELLS)
async def test_every_cell_through_the_runner(
    tier: Tier,
    action: Action,
    plan: bool,
    machine: LocalMachine,
    ws: Path,
    tmp_path: Path,
    db: Database,
    web_url: str,
) -> None:
    (ws / "notes.txt").write_text("hello\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("external text\n")
    ran: list[str] = []
    toolset = real("read", "edit", "exec", "web_fetch", "todo_write")
    for probe_action in (Action.BROWSER_READ, Action.BROWSER_WRITE, Action.MCP, Action.TASK):
        name = PROBES[probe_action][0]
        toolset[name] = probe(name, probe_action, ran)
    tools = tools_for(machine, db, tier, toolset, plan=plan, config=ToolConfig(web_allow_private=True))
    answerer = Answerer(tools.approvals)
    name, args = PROBES[action]
    placeholders = {"OUTSIDE": str(outside), "WEB": web_url}
    args = {k: placeholders.get(v, v) if isinstance(v, str) else v for k, v in args.items()}
    want = expected(tier, action, plan)

    if action != Action.READ_EXTERNAL:  # external reads go through `read`, which every tier offers
        assert (name in [t.name for t in tools.offered()]) == (want != Decision.FORBID)
    result = await asyncio.wait_for(tools.call(name, args), DEADLINE)

    approvals = await tools.approvals.repo.of_session(SESSION)
    if want == Decision.ASK:
        assert [(a.tool, a.action, a.status) for a in approvals] == [(name, str(action), "allowed")]
        assert len(answerer.requested) == 1
    else:
        assert approvals == []
    if want == Decision.FORBID:
        assert (
            result.is_error
            and "not permitted" in result.as_text()
            and "cannot be approved" in result.as_text()
        )
    else:
        assert not result.is_error, result.as_text()

    ran_it = want in (Decision.ALLOW, Decision.ASK, Decision.STAGE)
    if action == Action.READ:
        assert "hello" in result.as_text()
    elif action == Action.READ_EXTERNAL:
        assert ("external text" in result.as_text()) == ran_it
    elif action == Action.WRITE:
        on_disk = (ws / "notes.txt").read_text()
        assert on_disk == ("bye\n" if want == Decision.ALLOW else "hello\n")
        change_set = await tools.changes.repo.for_turn(SESSION, TURN)
        if want == Decision.STAGE:
            assert result.data["status"] == "staged" and change_set is not None
            assert [op.status for op in change_set.operations] == ["pending"]
        else:
            assert change_set is None
    elif action == Action.EXEC:
        assert (ws / "ran.txt").exists() == ran_it
    elif action == Action.WEB:
        assert ("web page text" in result.as_text()) == ran_it
    elif action == Action.META:
        assert [item["content"] for item in await tools.todos.get(SESSION)] == ["check the table"]
    else:
        assert ran == ([name] if ran_it else [])


# ---------------------------------------------------------------- the runner, scenario by scenario


async def test_exec_in_read_only_is_not_offered_and_refused(
    machine: LocalMachine, ws: Path, db: Database
) -> None:
    tools = tools_for(machine, db, Tier.READ_ONLY, real("read", "exec"))
    assert [t.name for t in tools.offered()] == ["read"]
    result = await tools.call("exec", {"command": "touch ran"})
    assert result.is_error and "not permitted in read-only" in result.as_text()
    assert not (ws / "ran").exists()


@ON_EACH_KIND
async def test_workspace_write_edit_is_staged_and_the_result_carries_no_text(
    machine: Machine, ws: Path, db: Database
) -> None:
    old = "the original sentence that must not come back in the result\n"
    (ws / "a.md").write_text(old)
    tools = tools_for(machine, db, Tier.WORKSPACE_WRITE, real("edit"))
    result = await tools.call(
        "edit", {"path": "a.md", "oldText": "original", "newText": "REPLACEMENT-MARKER"}
    )
    assert not result.is_error
    text = result.as_text()
    assert "original sentence" not in text and "REPLACEMENT-MARKER" not in text
    assert (ws / "a.md").read_text() == old
    change_set_id = result.data["change_set_id"]
    [op] = result.data["operations"]
    assert op["id"] == f"{change_set_id}:1" and op["id"] in text and change_set_id in text
    assert (op["before_chars"], op["after_chars"]) == (
        len(old),
        len(old.replace("original", "REPLACEMENT-MARKER")),
    )
    assert set(op) == {"id", "summary", "before_chars", "after_chars"}
    # The user applies it later; then it is on disk.
    [applied] = await tools.changes.apply(machine, [op["id"]])
    assert applied.status == "applied" and "REPLACEMENT-MARKER" in (ws / "a.md").read_text()


async def test_full_ask_exec_waits_for_approval_once_each_time(
    machine: LocalMachine, ws: Path, db: Database
) -> None:
    tools = tools_for(machine, db, Tier.FULL_ASK, real("exec"))
    requests = Requests(tools.approvals)
    call = asyncio.create_task(tools.call("exec", {"command": "echo hi >> ran.txt"}))
    approval = await requests.next()
    assert approval.status == "pending" and approval.detail["arguments"]["command"] == "echo hi >> ran.txt"
    assert not call.done() and not (ws / "ran.txt").exists()
    assert [a.id for a in await tools.approvals.repo.pending(SESSION)] == [approval.id]
    await tools.approvals.resolve(approval.id, "allow", "once")
    result = await asyncio.wait_for(call, DEADLINE)
    assert not result.is_error and (ws / "ran.txt").read_text() == "hi\n"
    # Once means once: the next call asks again (and exactly once, though exec authorizes itself too).
    again = asyncio.create_task(tools.call("exec", {"command": "echo again >> ran.txt"}))
    second = await requests.next()
    await tools.approvals.resolve(second.id, "allow")
    assert not (await asyncio.wait_for(again, DEADLINE)).is_error
    assert len(await tools.approvals.repo.of_session(SESSION)) == 2


async def test_deny_with_a_message_reaches_the_model(machine: LocalMachine, ws: Path, db: Database) -> None:
    tools = tools_for(machine, db, Tier.FULL_ASK, real("exec"))
    Answerer(tools.approvals, "deny", message="please use make test instead")
    result = await tools.call("exec", {"command": "touch ran"})
    assert result.is_error and "please use make test instead" in result.as_text()
    assert not (ws / "ran").exists()


async def test_full_ask_asks_for_every_exec_even_after_an_answer_for_the_session(
    machine: LocalMachine, ws: Path, db: Database
) -> None:
    tools = tools_for(machine, db, Tier.FULL_ASK, real("exec"))
    answerer = Answerer(tools.approvals, "allow", "session")
    for _ in range(3):
        assert not (await tools.call("exec", {"command": "echo x >> ran.txt"})).is_error
    assert len(answerer.requested) == 3
    assert (ws / "ran.txt").read_text() == "x\nx\nx\n"


@ON_EACH_KIND
async def test_full_auto_edit_is_applied_on_disk(machine: Machine, ws: Path, db: Database) -> None:
    (ws / "a.txt").write_text("one two\n")
    tools = tools_for(machine, db, Tier.FULL_AUTO, real("edit"))
    result = await tools.call("edit", {"path": "a.txt", "oldText": "two", "newText": "three"})
    assert not result.is_error and result.data["status"] == "applied"
    assert (ws / "a.txt").read_text() == "one three\n"
    assert await tools.changes.repo.for_turn(SESSION, TURN) is None


@ON_EACH_KIND
async def test_full_auto_keeps_the_reads_map_true_after_its_own_writes(
    machine: Machine, ws: Path, db: Database
) -> None:
    tools = tools_for(machine, db, Tier.FULL_AUTO, real("write", "read", overwrite_if_read=True))
    assert not (await tools.call("write", {"path": "n.txt", "content": "first"})).is_error
    # The model wrote it, so it may overwrite it without reading it again.
    assert not (await tools.call("write", {"path": "n.txt", "content": "second"})).is_error
    assert (ws / "n.txt").read_text() == "second"
    (ws / "n.txt").write_text("changed by someone else")
    refused = await tools.call("write", {"path": "n.txt", "content": "third"})
    assert refused.is_error and (ws / "n.txt").read_text() == "changed by someone else"


async def test_writes_outside_the_root(machine: LocalMachine, ws: Path, tmp_path: Path, db: Database) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = str(outside / "new.txt")
    args = {"path": target, "content": "out"}

    # The host is not isolated: full-auto asks too, then writes at once.
    full_auto = tools_for(machine, db, Tier.FULL_AUTO, real("write"))
    Answerer(full_auto.approvals, "allow")
    assert not (await full_auto.call("write", args)).is_error
    assert (outside / "new.txt").read_text() == "out"
    [asked_auto] = await full_auto.approvals.repo.of_session(SESSION)
    assert asked_auto.detail["paths"] == [target] and asked_auto.status == "allowed"
    (outside / "new.txt").unlink()

    workspace_write = tools_for(machine, db, Tier.WORKSPACE_WRITE, real("write"))
    refused = await workspace_write.call("write", args)
    assert refused.is_error and "cannot be approved" in refused.as_text()

    full_ask = tools_for(machine, db, Tier.FULL_ASK, real("write"))
    Answerer(full_ask.approvals, "deny", message="keep it in the workspace")
    denied = await full_ask.call("write", args)
    assert denied.is_error and "keep it in the workspace" in denied.as_text()
    [_, asked] = await full_ask.approvals.repo.of_session(SESSION)
    assert asked.action == "write" and asked.detail["paths"] == [target]

    full_ask.approvals.listeners.clear()
    Answerer(full_ask.approvals, "allow")
    staged = await full_ask.call("write", args)
    assert not staged.is_error and staged.data["status"] == "staged"
    assert not (outside / "new.txt").exists()  # approved, then staged for review like any change
    [op] = staged.data["operations"]
    [done] = await full_ask.changes.apply(machine, [op["id"]])
    assert done.status == "applied" and (outside / "new.txt").read_text() == "out"
    assert any("outside the workspace root" in w for w in done.warnings)


@pytest.mark.parametrize(
    ("tier", "isolated", "decision"),
    [(Tier.FULL_AUTO, True, Decision.ALLOW), (Tier.FULL_AUTO, False, Decision.ASK),
     (Tier.FULL_ASK, True, Decision.ASK), (Tier.FULL_ASK, False, Decision.ASK),
     (Tier.WORKSPACE_WRITE, True, Decision.FORBID), (Tier.READ_ONLY, False, Decision.FORBID)],
)  # fmt: skip
def test_a_write_outside_the_root_is_free_only_in_an_isolated_full_auto_machine(
    tier: Tier, isolated: bool, decision: Decision
) -> None:
    assert outside_root_write(tier, isolated) == decision


async def test_bad_arguments_unknown_tools_and_crashes_become_error_results(
    machine: LocalMachine, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    async def crash(ctx: ToolContext, params: ProbeParams) -> ToolResult:
        raise RuntimeError("tool bug")

    toolset = real("exec")
    toolset["crash"] = Tool("crash", "crashes", ProbeParams, Action.READ, crash)
    tools = tools_for(machine, db, Tier.FULL_ASK, toolset)
    requests = Requests(tools.approvals)
    bad = await tools.call("exec", {"command": 5, "timeoutSeconds": "soon"})
    assert bad.is_error
    assert "command" in bad.as_text() and "timeoutSeconds" in bad.as_text()
    assert requests.seen == []  # invalid arguments never reach the user
    not_a_dict = await tools.call("exec", "ls")
    assert not_a_dict.is_error and "Invalid arguments" in not_a_dict.as_text()
    unknown = await tools.call("nope", {})
    assert unknown.is_error and "nope" in unknown.as_text() and "exec" in unknown.as_text()
    with caplog.at_level(logging.ERROR):
        crashed = await tools.call("crash", {})
    assert crashed.is_error and "RuntimeError: tool bug" in crashed.as_text()
    assert "tool crash failed" in caplog.text


async def test_an_argument_no_tool_takes_is_refused_naming_the_real_ones(
    machine: LocalMachine, db: Database
) -> None:
    """Dropped silently, `target: "web"` would run another search than the model asked for."""
    tools = tools_for(machine, db, Tier.FULL_AUTO, real("exec", "todo_write"))
    requests = Requests(tools.approvals)
    wrong = await tools.call("exec", {"command": "touch ran", "target": "web"})
    assert wrong.is_error, wrong.as_text()
    assert "target: no such parameter" in wrong.as_text() and "command" in wrong.as_text()
    assert requests.seen == [] and not (Path(machine.root) / "ran").exists()  # nothing ran
    nested = await tools.call(
        "todo_write", {"todos": [{"content": "a", "status": "pending", "colour": "red"}]}
    )
    assert nested.is_error and "colour" in nested.as_text(), nested.as_text()
    for tool in real("exec", "todo_write").values():
        assert tool.schema()["additionalProperties"] is False  # and the model is told so


async def test_a_tool_asking_for_another_action_is_asked_separately(
    machine: LocalMachine, db: Database, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("far away")
    tools = tools_for(machine, db, Tier.FULL_ASK, real("read"))
    answerer = Answerer(tools.approvals)
    result = await tools.call("read", {"path": str(outside)})
    assert not result.is_error and "far away" in result.as_text()
    assert [(a.tool, a.action) for a in answerer.requested] == [("read", "read_external")]


async def test_records_name_tools_as_the_model_called_them(
    machine: LocalMachine, ws: Path, db: Database, tmp_path: Path
) -> None:
    (tmp_path / "outside.txt").write_text("far")
    (ws / "a.txt").write_text("one")
    canonical = real("read", "edit")
    renamed = {
        "read_file": canonical["read"].renamed("read_file"),
        "edit_file": canonical["edit"].renamed("edit_file"),
    }
    tools = tools_for(machine, db, Tier.FULL_ASK, renamed)
    answerer = Answerer(tools.approvals)
    assert not (await tools.call("read_file", {"path": str(tmp_path / "outside.txt")})).is_error
    staged = await tools.call("edit_file", {"path": "a.txt", "oldText": "one", "newText": "two"})
    assert [(a.tool, a.action) for a in answerer.requested] == [("read_file", "read_external")]
    change_set = await tools.changes.repo.get(staged.data["change_set_id"])
    assert [op.tool for op in change_set.operations] == ["edit_file"]


async def test_plan_mode_changes_what_is_offered(machine: LocalMachine, db: Database) -> None:
    tools = tools_for(machine, db, Tier.FULL_AUTO, real("read", "edit", "exec"))
    assert [t.name for t in tools.offered()] == ["read", "edit", "exec"]
    tools.plan = True
    assert [t.name for t in tools.offered()] == ["read"]
    refused = await tools.call("edit", {"path": "x", "oldText": "a", "newText": "b"})
    assert refused.is_error and "plan mode" in refused.as_text()


async def test_turns_have_their_own_change_sets_and_delivery_counts(
    machine: LocalMachine, ws: Path, db: Database
) -> None:
    tools = tools_for(machine, db, Tier.WORKSPACE_WRITE, real("write"))
    first = await tools.call("write", {"path": "a.txt", "content": "a"})
    tools.deliveries = 3
    tools.begin_turn("trn_next")
    assert tools.deliveries == 0
    second = await tools.call("write", {"path": "b.txt", "content": "b"})
    assert first.data["change_set_id"] != second.data["change_set_id"]
    assert second.data["operations"][0]["id"].endswith(":1")


# ---------------------------------------------------------------- a real sandbox


async def test_governance_in_a_real_sandbox(make_sandbox: Any, db: Database) -> None:
    m = await make_sandbox()
    workspace = m.workspace
    (workspace / "a.txt").write_text("alpha\n")
    tools = tools_for(m, db, Tier.FULL_ASK, real("exec", "edit"))
    answerer = Answerer(tools.approvals)
    staged = await tools.call("edit", {"path": "a.txt", "mode": "delete"})
    assert staged.data["status"] == "staged" and (workspace / "a.txt").exists()
    [op] = await tools.changes.apply(m, [staged.data["operations"][0]["id"]])
    assert op.status == "applied" and op.trash_path is not None
    assert op.trash_path.startswith(f"/workspace/{TRASH_DIR}/") and not (workspace / "a.txt").exists()
    # The trash is out of the shell's reach: an empty read-only cover it cannot remove.
    trash = f"/workspace/{TRASH_DIR}"
    probe = f"ls -A {trash} | wc -l; cat '{op.trash_path}'; rm -rf {trash}; touch {trash}/x; ls -d {trash}"
    seen = await tools.call("exec", {"command": probe})
    text = seen.as_text()
    assert "alpha" not in text and "<stdout>\n0\n" in text and f"\n{trash}\n" in text, text
    assert "Device or resource busy" in text and "Read-only file system" in text, text
    assert (workspace / op.trash_path.removeprefix("/workspace/")).read_text() == "alpha\n"
    assert len(answerer.requested) == 1
    # A mount point of the sandbox is never moved into the trash (it would take the host folder along).
    for path in ("/tmp", "/workspace", "/root"):
        [refused] = await apply_operations(m, [Operation("delete", path)])
        assert refused.status == "failed" and (
            "mount" in (refused.reason or "") or "root" in (refused.reason or "")
        )
    assert stat.S_ISDIR(m.view.stat("/tmp").st_mode)
    # Files the server creates in the workspace belong to the sandbox's user.
    tools.tier = Tier.FULL_AUTO
    written = await tools.call(
        "edit", {"path": op.trash_path, "mode": "move", "destination": "/workspace/a.txt"}
    )
    assert not written.is_error and (workspace / "a.txt").read_text() == "alpha\n"
    trash_folder = workspace / TRASH_DIR
    owner = m.default_owner()
    if owner is not None and os.geteuid() == 0:
        assert (trash_folder.stat().st_uid, trash_folder.stat().st_gid) == owner
