"""`write` and `edit` against a real sandbox, a local machine and an ssh machine.

The tools only plan Operations; the test context (from test_tools_read) applies them the
way the full-auto tier does, so each test checks both the planned operation and the disk
afterwards. A sandbox test also checks what a command inside the sandbox sees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import host_fingerprint
from pydantic import ValidationError
from test_tools_read import (
    Box,
    Ctx,
    box,
    docker,
    e2b,
    host_box,
    local,
    read,
    sandbox,
    sandbox_box,
    ssh,
    text_of,
)

from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import SandboxMachine
from agentbox.tools.base import Operation, ToolResult
from agentbox.tools.edit import EDIT, EditParams
from agentbox.tools.fingerprint import ABSENT
from agentbox.tools.write import MAX_WRITE_BYTES, WRITE, WriteParams, make_write

pytestmark = pytest.mark.asyncio(loop_scope="module")
__all__ = [
    "box",
    "docker",
    "e2b",
    "host_box",
    "local",
    "sandbox",
    "ssh",
]  # fixtures shared with test_tools_read

OVERWRITING = make_write(overwrite_if_read=True)


async def write(
    ctx: Ctx, path: str, content: str = "", *, overwrite: bool = False, **params: Any
) -> ToolResult:
    tool = OVERWRITING if overwrite else WRITE
    return await tool.run(ctx, WriteParams(path=path, content=content, **params))


async def edit(ctx: Ctx, path: str, **params: Any) -> ToolResult:
    return await EDIT.run(ctx, EditParams(path=path, **params))


# --- write ----------------------------------------------------------------------------------------------


async def test_write_creates_a_file_expecting_nothing_there(box: Box) -> None:
    ctx = box.ctx()
    result = await write(ctx, box.p("hello.md"), "# Hello\n")
    assert not result.is_error
    [op] = ctx.committed
    assert (op.kind, op.path, op.before, op.after, op.expect) == (
        "write",
        box.p("hello.md"),
        None,
        "# Hello\n",
        ABSENT,
    )
    assert box.h("hello.md").read_text() == "# Hello\n"


async def test_write_takes_the_target_path_by_its_seed_name(local: Box) -> None:
    """`targetPath` is the path's other name; giving both is refused, not one silently picked."""
    ctx = local.ctx()
    params = WRITE.params.model_validate({"targetPath": local.p("named.md"), "content": "by targetPath\n"})
    assert not (await WRITE.run(ctx, params)).is_error
    assert local.h("named.md").read_text() == "by targetPath\n"
    with pytest.raises(ValidationError, match="targetPath"):
        WRITE.params.model_validate({"targetPath": local.p("a.md"), "path": local.p("b.md"), "content": ""})


async def test_write_is_visible_inside_the_sandbox(sandbox: SandboxMachine, tmp_path: Path) -> None:
    b = sandbox_box(sandbox, tmp_path)
    await write(b.ctx(), b.p("note.txt"), "from the tool\n")
    seen = await sandbox.exec(ExecRequest(command=f"cat {b.p('note.txt')}"))
    assert seen.stdout == b"from the tool\n"


async def test_write_never_overwrites_even_after_a_read(box: Box) -> None:
    box.write("keep.txt", "original")
    ctx = box.ctx()
    await read(ctx, box.p("keep.txt"))
    result = await write(ctx, box.p("keep.txt"), "replaced")
    assert result.is_error and "already exists; write never overwrites" in text_of(result)
    assert ctx.committed == [] and box.h("keep.txt").read_text() == "original"


async def test_overwriting_write_needs_a_read_first(box: Box) -> None:
    box.write("doc.txt", "original")
    ctx = box.ctx()
    unread = await write(ctx, box.p("doc.txt"), "replaced", overwrite=True)
    assert unread.is_error and "Read it first" in text_of(unread)
    await read(ctx, box.p("doc.txt"))
    seen = ctx.reads[box.p("doc.txt")]
    allowed = await write(ctx, box.p("doc.txt"), "replaced", overwrite=True)
    assert not allowed.is_error
    [op] = ctx.committed
    assert (op.before, op.after, op.expect) == ("original", "replaced", seen)
    assert box.h("doc.txt").read_text() == "replaced"


async def test_overwriting_write_refuses_a_file_changed_since_it_was_read(box: Box) -> None:
    path = box.write("doc.txt", "original")
    ctx = box.ctx()
    await read(ctx, box.p("doc.txt"))
    path.write_text("changed by someone else")
    stale = await write(ctx, box.p("doc.txt"), "mine", overwrite=True)
    assert stale.is_error and "has changed since you read it" in text_of(stale)
    assert path.read_text() == "changed by someone else" and ctx.committed == []


async def test_what_the_model_wrote_counts_as_read(box: Box) -> None:
    ctx = box.ctx()
    await write(ctx, box.p("notes.md"), "v1", overwrite=True)
    assert not (await write(ctx, box.p("notes.md"), "v2", overwrite=True)).is_error
    await edit(ctx, box.p("notes.md"), oldText="v2", newText="v3")
    assert not (await write(ctx, box.p("notes.md"), "v4", overwrite=True)).is_error
    assert box.h("notes.md").read_text() == "v4"
    box.h("notes.md").write_text("someone else")
    stale = await write(ctx, box.p("notes.md"), "v5", overwrite=True)
    assert stale.is_error and "changed since you read it" in text_of(stale)


async def test_a_staged_change_does_not_count_as_read(box: Box) -> None:
    class Staging(Ctx):
        async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
            self.committed.extend(operations)
            return ToolResult.text("staged for review")

    box.write("doc.txt", "original")
    ctx = Staging(box.machine)
    await read(ctx, box.p("doc.txt"))
    seen = dict(ctx.reads)
    await write(ctx, box.p("doc.txt"), "proposed", overwrite=True)
    assert ctx.reads == seen and box.h("doc.txt").read_text() == "original"


async def test_write_needs_the_parent_folder(box: Box) -> None:
    ctx = box.ctx()
    missing = await write(ctx, box.p("reports/q1.md"), "# Q1")
    assert missing.is_error and f"The folder {box.p('reports')} does not exist. Create it first" in text_of(
        missing
    )
    folder = await write(ctx, box.p("reports"), kind="folder")
    assert not folder.is_error and ctx.committed[-1].kind == "mkdir" and box.h("reports").is_dir()
    again = await write(ctx, box.p("reports"), kind="folder")
    assert again.is_error and "already exists (a folder)" in text_of(again)
    assert not (await write(ctx, box.p("reports/q1.md"), "# Q1")).is_error
    assert box.h("reports/q1.md").read_text() == "# Q1"
    content = await write(ctx, box.p("other"), "text", kind="folder")
    assert content.is_error and "not used with kind=folder" in text_of(content)
    onto_file = await write(ctx, box.p("reports/q1.md/x.md"), "x")
    assert onto_file.is_error


async def test_write_size_boundary(local: Box) -> None:
    ctx = local.ctx()
    at = await write(ctx, local.p("at.txt"), "a" * MAX_WRITE_BYTES)
    assert not at.is_error and local.h("at.txt").stat().st_size == MAX_WRITE_BYTES
    over = await write(ctx, local.p("over.txt"), "a" * (MAX_WRITE_BYTES + 1))
    assert over.is_error and f"at most {MAX_WRITE_BYTES} bytes" in text_of(over)
    assert not local.h("over.txt").exists()


async def test_write_through_a_link_that_escapes_is_refused(local: Box, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", local.h("escape"))
    result = await write(local.ctx(), local.p("escape/planted.txt"), "x")
    assert result.is_error and "leads outside the workspace through a symbolic link" in text_of(result)
    assert not (tmp_path / "elsewhere" / "planted.txt").exists()


async def test_sandbox_link_out_of_the_workspace_is_refused(sandbox: SandboxMachine, tmp_path: Path) -> None:
    b = sandbox_box(sandbox, tmp_path)
    os.symlink("/tmp", b.h("tmp-link"))
    ctx = b.ctx()
    made = await write(ctx, b.p("tmp-link/x.txt"), "x")
    assert made.is_error and "leads outside the workspace" in text_of(made)
    changed = await edit(ctx, b.p("tmp-link"), mode="move", destination=b.p("elsewhere"))
    assert not changed.is_error  # the link itself moves; nothing is followed out
    read_only = await write(ctx, "/usr/agentbox-test.txt", "x")
    assert read_only.is_error and "read-only" in text_of(read_only)


# --- edit: replace ----------------------------------------------------------------------------------------


async def test_replace_a_unique_snippet(box: Box) -> None:
    path = box.write("app.py", "import os\n\nprint('hi')\n")
    ctx = box.ctx()
    result = await edit(ctx, box.p("app.py"), oldText="print('hi')", newText="print('hello')")
    assert not result.is_error
    [op] = ctx.committed
    assert op.kind == "edit" and op.before == "import os\n\nprint('hi')\n"
    assert op.after == "import os\n\nprint('hello')\n"
    assert path.read_text() == op.after


async def test_replace_errors_use_flues_wording(box: Box) -> None:
    box.write("dup.txt", "x = 1\nx = 1\nx = 1\n")
    ctx = box.ctx()
    missing = await edit(ctx, box.p("dup.txt"), oldText="y = 2", newText="y = 3")
    assert text_of(missing) == (
        f"Could not find the exact text in {box.p('dup.txt')}. "
        "Make sure your oldText matches exactly, including whitespace and indentation."
    )
    several = await edit(ctx, box.p("dup.txt"), oldText="x = 1", newText="x = 2")
    assert several.is_error and text_of(several).startswith(
        f"Found 3 occurrences of the text in {box.p('dup.txt')}. Provide more surrounding context"
    )
    assert "lines 1, 2, 3" in text_of(several)
    same = await edit(ctx, box.p("dup.txt"), oldText="x = 1", newText="x = 1", occurrence=1)
    assert same.is_error and "identical" in text_of(same)
    empty = await edit(ctx, box.p("dup.txt"), oldText="", newText="z")
    assert empty.is_error and "must not be empty" in text_of(empty)
    assert ctx.committed == []


async def test_replace_the_nth_occurrence_or_all(box: Box) -> None:
    path = box.write("dup.txt", "x = 1\nx = 1\nx = 1\n")
    ctx = box.ctx()
    assert not (await edit(ctx, box.p("dup.txt"), oldText="x = 1", newText="x = 2", occurrence=2)).is_error
    assert path.read_text() == "x = 1\nx = 2\nx = 1\n"
    far = await edit(ctx, box.p("dup.txt"), oldText="x = 1", newText="x = 9", occurrence=3)
    assert far.is_error and "occurrence 3 is out of range: the text occurs 2 time(s)" in text_of(far)
    assert not (await edit(ctx, box.p("dup.txt"), oldText="x = 1", newText="x = 0", replaceAll=True)).is_error
    assert path.read_text() == "x = 0\nx = 2\nx = 0\n"


async def test_occurrences_do_not_overlap(local: Box) -> None:
    path = local.write("aaa.txt", "aaaa")
    assert not (await edit(local.ctx(), local.p("aaa.txt"), oldText="aa", newText="b", occurrence=2)).is_error
    assert path.read_text() == "aab"  # occurrences at 0 and 2, not 0, 1, 2


async def test_crlf_and_bom_are_kept(box: Box) -> None:
    path = box.write("win.txt", b"\xef\xbb\xbfone\r\ntwo\r\nthree\r\n")
    ctx = box.ctx()
    result = await edit(ctx, box.p("win.txt"), oldText="one\ntwo", newText="1\n2")
    assert not result.is_error
    assert path.read_bytes() == b"\xef\xbb\xbf1\r\n2\r\nthree\r\n"
    assert ctx.committed[0].expect is not None
    await edit(ctx, box.p("win.txt"), mode="append", text="four\n")
    assert path.read_bytes() == b"\xef\xbb\xbf1\r\n2\r\nthree\r\nfour\r\n"


async def test_the_planned_edit_expects_the_file_as_it_was(box: Box) -> None:
    path = box.write("f.txt", "alpha")
    before = host_fingerprint(path)
    ctx = box.ctx()
    await edit(ctx, box.p("f.txt"), oldText="alpha", newText="beta")
    assert ctx.committed[0].expect == before


async def test_edit_refuses_what_is_not_a_text_file(box: Box) -> None:
    box.write("bin.dat", b"\xff\xfe\x00\x01")
    box.mkdir("dir")
    ctx = box.ctx()
    binary = await edit(ctx, box.p("bin.dat"), oldText="a", newText="b")
    assert binary.is_error and "not UTF-8 text" in text_of(binary)
    folder = await edit(ctx, box.p("dir"), oldText="a", newText="b")
    assert folder.is_error and "is a folder" in text_of(folder)
    missing = await edit(ctx, box.p("none.txt"), oldText="a", newText="b")
    assert missing.is_error and "use write to create it" in text_of(missing)
    no_text = await edit(ctx, box.p("none.txt"))
    assert no_text.is_error and "needs `oldText` and `newText`" in text_of(no_text)


async def test_edit_through_a_link_that_escapes_is_refused(local: Box, tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    target.write_text("keep me")
    os.symlink(target, local.h("link.txt"))
    result = await edit(local.ctx(), local.p("link.txt"), oldText="keep", newText="lose")
    assert result.is_error and "leads outside the workspace" in text_of(result)
    assert target.read_text() == "keep me"


# --- edit: append, multi_replace ------------------------------------------------------------------------------


async def test_append(box: Box) -> None:
    path = box.write("log.md", "- one\n")
    ctx = box.ctx()
    assert not (await edit(ctx, box.p("log.md"), mode="append", text="- two\n")).is_error
    assert path.read_text() == "- one\n- two\n"
    empty = await edit(ctx, box.p("log.md"), mode="append", text="")
    assert empty.is_error


async def test_multi_replace_applies_all_in_order(box: Box) -> None:
    path = box.write("cfg.ini", "host=a\nport=1\nmode=x\n")
    ctx = box.ctx()
    result = await edit(
        ctx,
        box.p("cfg.ini"),
        mode="multi_replace",
        edits=[
            {"oldText": "host=a", "newText": "host=b"},
            {"oldText": "port=1", "newText": "port=2"},
            {"oldText": "host=b", "newText": "host=c"},  # sees the result of the first edit
        ],
    )
    assert not result.is_error and len(ctx.committed) == 1
    assert path.read_text() == "host=c\nport=2\nmode=x\n"


async def test_multi_replace_is_all_or_nothing(box: Box) -> None:
    path = box.write("cfg.ini", "host=a\nport=1\n")
    ctx = box.ctx()
    result = await edit(
        ctx,
        box.p("cfg.ini"),
        mode="multi_replace",
        edits=[{"oldText": "host=a", "newText": "host=b"}, {"oldText": "port=9", "newText": "port=2"}],
    )
    assert result.is_error and text_of(result).startswith("Edit 2 of 2 failed, so no edit was made:")
    assert ctx.committed == [] and path.read_text() == "host=a\nport=1\n"
    dup = await edit(
        ctx, box.p("cfg.ini"), mode="multi_replace", edits=[{"oldText": "=", "newText": ":", "occurrence": 2}]
    )
    assert not dup.is_error and path.read_text() == "host=a\nport:1\n"


# --- edit: move, rename, delete --------------------------------------------------------------------------------


async def test_move_a_file(box: Box) -> None:
    path = box.write("draft.md", "text")
    box.mkdir("archive")
    ctx = box.ctx()
    result = await edit(ctx, box.p("draft.md"), mode="move", destination=box.p("archive/2024.md"))
    assert not result.is_error
    [op] = ctx.committed
    assert (op.kind, op.path, op.dest, op.expect) == (
        "move",
        box.p("draft.md"),
        box.p("archive/2024.md"),
        host_fingerprint(box.h("archive/2024.md")),
    )
    assert not path.exists() and box.h("archive/2024.md").read_text() == "text"


async def test_move_into_an_existing_folder(box: Box) -> None:
    box.write("a.txt", "a")
    box.mkdir("into")
    ctx = box.ctx()
    assert not (await edit(ctx, box.p("a.txt"), mode="move", destination=box.p("into"))).is_error
    assert ctx.committed[0].dest == box.p("into/a.txt") and box.h("into/a.txt").exists()


async def test_move_refusals(box: Box) -> None:
    box.write("a.txt", "a")
    box.write("b.txt", "b")
    box.write("tree/leaf.txt", "leaf")
    ctx = box.ctx()
    onto = await edit(ctx, box.p("a.txt"), mode="move", destination=box.p("b.txt"))
    assert onto.is_error and "already exists" in text_of(onto)
    into_itself = await edit(ctx, box.p("tree"), mode="move", destination=box.p("tree/sub/tree"))
    assert into_itself.is_error and "cannot be moved into itself" in text_of(into_itself)
    no_parent = await edit(ctx, box.p("a.txt"), mode="move", destination=box.p("missing/a.txt"))
    assert no_parent.is_error and "Create it first" in text_of(no_parent)
    no_dest = await edit(ctx, box.p("a.txt"), mode="move")
    assert no_dest.is_error and "needs a `destination`" in text_of(no_dest)
    gone = await edit(ctx, box.p("nothing"), mode="move", destination=box.p("x"))
    assert gone.is_error and "does not exist" in text_of(gone)
    assert ctx.committed == [] and box.h("a.txt").read_text() == "a"


async def test_move_a_folder_with_its_contents(box: Box) -> None:
    box.write("tree/leaf.txt", "leaf")
    box.write("tree/.hidden", "h")
    ctx = box.ctx()
    result = await edit(ctx, box.p("tree"), mode="move", destination=box.p("forest"))
    assert not result.is_error
    [op] = ctx.committed
    assert op.expect is None and "folder" in op.summary and "2 file(s)" in op.summary
    assert box.h("forest/leaf.txt").read_text() == "leaf" and box.h("forest/.hidden").exists()


async def test_rename_keeps_the_folder(box: Box) -> None:
    box.write("sub/old.txt", "x")
    box.mkdir("other")
    ctx = box.ctx()
    assert not (await edit(ctx, box.p("sub/old.txt"), mode="rename", destination="new.txt")).is_error
    [op] = ctx.committed
    assert (op.kind, op.path, op.dest) == ("rename", box.p("sub/old.txt"), box.p("sub/new.txt"))
    assert box.h("sub/new.txt").exists() and not box.h("sub/old.txt").exists()
    elsewhere = await edit(ctx, box.p("sub/new.txt"), mode="rename", destination=box.p("other/new.txt"))
    assert elsewhere.is_error and "use mode=move" in text_of(elsewhere)
    dots = await edit(ctx, box.p("sub/new.txt"), mode="rename", destination="..")
    assert dots.is_error


async def test_delete_goes_to_the_trash(box: Box) -> None:
    path = box.write("junk.txt", "junk")
    planned_against = host_fingerprint(path)
    box.write("old/a.txt", "a")
    ctx = box.ctx()
    assert not (await edit(ctx, box.p("junk.txt"), mode="delete")).is_error
    [op] = ctx.committed
    assert (op.kind, op.path, op.expect) == ("delete", box.p("junk.txt"), planned_against)
    trashed = ctx.applied[0].trash_path
    assert trashed is not None and not path.exists()
    assert await box.read_inside(trashed, 100) == b"junk"
    assert not (await edit(ctx, box.p("old"), mode="delete")).is_error
    assert ctx.committed[1].expect is None and "folder" in ctx.committed[1].summary
    folder = ctx.applied[1].trash_path
    assert folder is not None and not box.h("old").exists()
    assert await box.read_inside(folder + "/a.txt", 100) == b"a"


async def test_the_root_and_mounts_cannot_be_moved_or_deleted(box: Box) -> None:
    ctx = box.ctx()
    root = box.machine.root
    for params in (
        {"mode": "delete"},
        {"mode": "move", "destination": box.p("x")},
        {"mode": "rename", "destination": "y"},
    ):
        result = await edit(ctx, root, **params)
        assert result.is_error and "workspace root or a mount point" in text_of(result)
    assert ctx.committed == []


async def test_sandbox_mount_points_are_refused(sandbox: SandboxMachine, tmp_path: Path) -> None:
    ctx = sandbox_box(sandbox, tmp_path).ctx()
    for path in ("/tmp", "/workspace", "/"):
        result = await edit(ctx, path, mode="delete")
        assert result.is_error, path
    assert ctx.committed == []


async def test_delete_of_a_link_removes_only_the_link(local: Box, tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    os.symlink(target, local.h("link.txt"))
    ctx = local.ctx()
    assert not (await edit(ctx, local.p("link.txt"), mode="delete")).is_error
    assert ctx.committed[0].expect is None and target.read_text() == "precious"
    assert not os.path.lexists(local.h("link.txt"))
