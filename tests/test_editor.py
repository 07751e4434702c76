"""The editor engine on real files: seed 002's walk-through, the replace rules, insert, undo
and its bounds, bytes kept (CRLF, BOM, inode), view, and every limit at its boundary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import APP, Mounted

from agentbox.machines.local import LocalMachine
from agentbox.workspace import editor as ed
from agentbox.workspace.editor import (
    MAX_EDIT_BYTES,
    MAX_LISTED_OCCURRENCES,
    MAX_OUTPUT_CHARS,
    MAX_UNDO_DEPTH,
    MAX_VIEW_DIR_ENTRIES,
    OLD_STR_NOT_FOUND,
    SNAPSHOT_OVERHEAD_BYTES,
    EditHistory,
    Editor,
)
from agentbox.workspace.errors import WorkspaceError


@pytest.fixture
def machine(tmp_path: Path) -> LocalMachine:
    return LocalMachine("local", tmp_path / "root")


@pytest.fixture
def root(machine: LocalMachine) -> Path:
    return Path(machine.root)


@pytest.fixture
def editor() -> Editor:
    return Editor()


def write(path: Path, data: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


async def failure(coro: object) -> WorkspaceError:
    with pytest.raises(WorkspaceError) as info:
        await coro  # type: ignore[misc]
    return info.value


# --- seed 002 --------------------------------------------------------------------------


async def test_seed_walkthrough_replace_then_read(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "demo/src/app.py", APP)
    result = await editor.str_replace(
        machine,
        target,
        "    # TODO: read the input path from argv\n    print('hello')",
        "    path = sys.argv[1]\n    print(open(path).read())",
    )
    lines = Path(target).read_text().split("\n")
    assert lines[2:5] == ["def main():", "    path = sys.argv[1]", "    print(open(path).read())"]
    assert result.path == target and result.prev_exist
    assert result.old_content == APP
    assert result.new_content == Path(target).read_text()
    header = f"The file {target} has been edited. Here's the result of running `cat -n` on a snippet of"
    assert result.output.startswith(f"{header} {target}:\n")
    assert "     4\t    path = sys.argv[1]\n     5\t    print(open(path).read())\n" in result.output
    assert result.output.endswith(ed.REVIEW_NOTE)


async def test_missing_old_str_is_bad_request_with_exact_message(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "app.py", APP)
    err = await failure(editor.str_replace(machine, target, "print('bye')", "x"))
    assert (err.error_type, err.message, err.operation) == ("bad_request", OLD_STR_NOT_FOUND, "edit")
    assert Path(target).read_text() == APP


async def test_duplicate_old_str_names_lines_and_changes_nothing(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "dup.txt", "x = 1\ny = 2\nx = 1\n")
    err = await failure(editor.str_replace(machine, target, "x = 1", "x = 3"))
    assert err.error_type == "bad_request"
    assert "Multiple occurrences" in err.message and "lines 1, 3" in err.message
    assert Path(target).read_text() == "x = 1\ny = 2\nx = 1\n"
    assert editor.history.depth(("local", target)) == 0


async def test_overlapping_occurrences_are_ambiguous(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "a.txt", "aaa\n")
    err = await failure(editor.str_replace(machine, target, "aa", "b"))
    assert "Multiple occurrences" in err.message


async def test_occurrence_list_is_capped(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "many.txt", "hit\n" * (MAX_LISTED_OCCURRENCES + 5))
    err = await failure(editor.str_replace(machine, target, "hit", "miss"))
    listed = err.message.split("in lines ")[1].split(".")[0].split(", ")
    assert listed == [str(n) for n in range(1, MAX_LISTED_OCCURRENCES + 1)]


async def test_replace_modes(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "m.txt", "a1\nb\na2\nb\na3\n")
    await editor.str_replace(machine, target, "b", "FIRST", replace_mode="FIRST")
    assert Path(target).read_text() == "a1\nFIRST\na2\nb\na3\n"
    await editor.str_replace(machine, target, "a", "z", replace_mode="LAST")
    assert Path(target).read_text() == "a1\nFIRST\na2\nb\nz3\n"
    result = await editor.str_replace(machine, target, "a", "Q", replace_mode="all")
    assert Path(target).read_text() == "Q1\nFIRST\nQ2\nb\nz3\n"
    assert "     1\tQ1" in result.output and "     3\tQ2" in result.output
    err = await failure(editor.str_replace(machine, target, "Q", "R", replace_mode="SOME"))
    assert err.error_type == "bad_request" and "replace_mode" in err.message
    err = await failure(editor.str_replace(machine, target, "nope", "R", replace_mode="ALL"))
    assert err.message == OLD_STR_NOT_FOUND


async def test_empty_and_identical_old_str_are_refused(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "e.txt", "abc\n")
    assert (await failure(editor.str_replace(machine, target, "", "x"))).error_type == "bad_request"
    assert (await failure(editor.str_replace(machine, target, "abc", "abc"))).error_type == "bad_request"


async def test_snippet_shows_four_lines_around_the_edit(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "long.txt", "".join(f"line {n}\n" for n in range(1, 21)))
    result = await editor.str_replace(machine, target, "line 10\n", "ten\n")
    numbers = [int(row.split("\t")[0]) for row in result.output.split("\n") if "\t" in row]
    assert numbers == list(range(6, 15))
    assert "    10\tten" in result.output


# --- insert ----------------------------------------------------------------------------


async def test_insert_at_top_middle_and_end(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "i.txt", "one\ntwo\n")
    await editor.insert(machine, target, 0, "zero")
    assert Path(target).read_text() == "zero\none\ntwo\n"
    await editor.insert(machine, target, 3, "three\nfour\n")
    assert Path(target).read_text() == "zero\none\ntwo\nthree\nfour\n"
    result = await editor.insert(machine, target, 1, "half")
    assert Path(target).read_text() == "zero\nhalf\none\ntwo\nthree\nfour\n"
    assert "     2\thalf" in result.output and result.output.endswith(ed.INSERT_REVIEW_NOTE)


async def test_insert_after_unterminated_last_line(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "u.txt", "one\ntwo")
    await editor.insert(machine, target, 2, "three")
    assert Path(target).read_text() == "one\ntwo\nthree"


async def test_insert_into_empty_file(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "empty.txt", "")
    await editor.insert(machine, target, 0, "first")
    assert Path(target).read_text() == "first\n"


@pytest.mark.parametrize("line", [-1, 3])
async def test_insert_line_out_of_range(machine: LocalMachine, root: Path, editor: Editor, line: int) -> None:
    target = write(root / "r.txt", "one\ntwo\n")
    err = await failure(editor.insert(machine, target, line, "x"))
    assert err.error_type == "bad_request" and "[0, 2]" in err.message
    assert Path(target).read_text() == "one\ntwo\n"


# --- undo ------------------------------------------------------------------------------


async def test_undo_restores_and_then_has_nothing(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "u.py", APP)
    await editor.str_replace(machine, target, "hello", "bye")
    await editor.insert(machine, target, 0, "# header")
    result = await editor.undo_edit(machine, target)
    assert "bye" in Path(target).read_text() and "# header" not in Path(target).read_text()
    assert result.output.startswith(f"Last edit to {target} undone successfully.")
    await editor.undo_edit(machine, target)
    assert Path(target).read_text() == APP
    err = await failure(editor.undo_edit(machine, target))
    assert err.error_type == "bad_request" and "No edit history" in err.message


async def test_undo_after_create_deletes_the_new_file(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = str(root / "new/dir/made.txt")
    result = await editor.create(machine, target, "hello\n")
    assert (result.prev_exist, result.old_content, result.new_content) == (False, None, "hello\n")
    assert result.output == f"File created successfully at: {target}"
    await editor.str_replace(machine, target, "hello", "bye")
    await editor.undo_edit(machine, target)
    assert Path(target).read_text() == "hello\n"
    undone = await editor.undo_edit(machine, target)
    assert not Path(target).exists()
    assert undone.new_content is None and undone.old_content == "hello\n"
    assert (root / "new/dir").is_dir()  # directories made for it stay


async def test_undo_after_create_over_a_file_restores_it(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "c.txt", b"old bytes \xff\n")
    result = await editor.create(machine, target, "new\n")
    assert result.prev_exist and result.output == f"File overwritten successfully at: {target}"
    await editor.undo_edit(machine, target)
    assert Path(target).read_bytes() == b"old bytes \xff\n"


async def test_undo_depth_boundary(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "d.txt", "v0\n")
    for n in range(1, MAX_UNDO_DEPTH + 1):
        await editor.str_replace(machine, target, f"v{n - 1}", f"v{n}")
    for _ in range(MAX_UNDO_DEPTH):
        await editor.undo_edit(machine, target)
    assert Path(target).read_text() == "v0\n"
    assert (await failure(editor.undo_edit(machine, target))).error_type == "bad_request"


async def test_undo_depth_drops_the_oldest(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "d.txt", "v0\n")
    for n in range(1, MAX_UNDO_DEPTH + 2):
        await editor.str_replace(machine, target, f"v{n - 1}", f"v{n}")
    for _ in range(MAX_UNDO_DEPTH):
        await editor.undo_edit(machine, target)
    assert Path(target).read_text() == "v1\n"
    assert (await failure(editor.undo_edit(machine, target))).error_type == "bad_request"


async def test_edit_through_link_undo_through_target(
    machine: LocalMachine, root: Path, editor: Editor
) -> None:
    target = write(root / "real.txt", "one\n")
    (root / "link.txt").symlink_to("real.txt")
    await editor.str_replace(machine, str(root / "link.txt"), "one", "two")
    assert (root / "link.txt").is_symlink() and Path(target).read_text() == "two\n"
    await editor.undo_edit(machine, target)
    assert Path(target).read_text() == "one\n"


async def test_history_is_per_machine(tmp_path: Path, editor: Editor) -> None:
    first = LocalMachine("first", tmp_path)
    second = LocalMachine("second", tmp_path)
    target = write(tmp_path / "f.txt", "one\n")
    await editor.str_replace(first, target, "one", "two")
    assert (await failure(editor.undo_edit(second, target))).error_type == "bad_request"
    editor.history.forget_machine("first")
    assert (await failure(editor.undo_edit(first, target))).error_type == "bad_request"


def test_history_bytes_bound_drops_oldest_anywhere() -> None:
    entry = SNAPSHOT_OVERHEAD_BYTES + 100
    history = EditHistory(max_depth=MAX_UNDO_DEPTH, max_bytes=3 * entry)
    history.push(("m", "/a"), b"a" * 100)
    history.push(("m", "/b"), b"b" * 100)
    history.push(("m", "/a"), b"A" * 100)
    assert history.size == 3 * entry  # exactly at the bound: all kept
    history.push(("m", "/c"), b"c" * 100)
    assert history.size == 3 * entry
    assert history.depth(("m", "/a")) == 1  # its oldest entry went first
    latest = history.latest(("m", "/a"))
    assert latest is not None and latest.content == b"A" * 100
    history.push(("m", "/none"), None)  # a file that did not exist still costs the overhead
    assert history.depth(("m", "/b")) == 0 and history.size == 2 * entry + SNAPSHOT_OVERHEAD_BYTES


def test_history_entry_larger_than_bound_clears_that_file() -> None:
    history = EditHistory(max_depth=MAX_UNDO_DEPTH, max_bytes=SNAPSHOT_OVERHEAD_BYTES + 10)
    history.push(("m", "/a"), b"x" * 10)
    assert history.depth(("m", "/a")) == 1
    history.push(("m", "/a"), b"x" * 11)
    assert history.depth(("m", "/a")) == 0 and history.size == 0


# --- bytes kept ------------------------------------------------------------------------


async def test_crlf_file_keeps_crlf(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "w.txt", b"one\r\ntwo\r\nthree\r\n")
    await editor.str_replace(machine, target, "one\ntwo", "uno\ndos")
    assert Path(target).read_bytes() == b"uno\r\ndos\r\nthree\r\n"
    await editor.str_replace(machine, target, "dos\r\n", "zwei\r\n")  # CRLF given literally works too
    await editor.insert(machine, target, 3, "four\nfive")
    assert Path(target).read_bytes() == b"uno\r\nzwei\r\nthree\r\nfour\r\nfive\r\n"
    view = await editor.view(machine, target)
    assert "\r" not in view.output


async def test_mixed_line_ends_are_literal(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "mixed.txt", b"one\r\ntwo\nthree\n")
    err = await failure(editor.str_replace(machine, target, "one\ntwo", "x"))
    assert err.message == OLD_STR_NOT_FOUND


async def test_bom_is_kept(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "bom.txt", b"\xef\xbb\xbfone\ntwo\n")
    await editor.str_replace(machine, target, "one", "uno")
    await editor.insert(machine, target, 0, "zero")
    assert Path(target).read_bytes() == b"\xef\xbb\xbfzero\nuno\ntwo\n"
    view = await editor.view(machine, target)
    assert "     1\tzero\n" in view.output and "\ufeff" not in view.output
    await editor.undo_edit(machine, target)
    assert Path(target).read_bytes() == b"\xef\xbb\xbfuno\ntwo\n"


async def test_edit_writes_in_place(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "inode.txt", "one\n")
    inode = os.stat(target).st_ino
    await editor.str_replace(machine, target, "one", "two")
    await editor.undo_edit(machine, target)
    assert os.stat(target).st_ino == inode


# --- view ------------------------------------------------------------------------------


async def test_view_file_and_ranges(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "v.txt", "a\nb\nc\nd\n")
    full = await editor.view(machine, target)
    assert (
        full.output
        == f"Here's the result of running `cat -n` on {target}:\n     1\ta\n     2\tb\n     3\tc\n     4\td\n"
    )
    assert (full.old_content, full.new_content) == (None, None)
    assert (await editor.view(machine, target, [2, 3])).output.endswith("     2\tb\n     3\tc\n")
    assert (await editor.view(machine, target, [3, -1])).output.endswith("     3\tc\n     4\td\n")
    assert (await editor.view(machine, target, [4, 99])).output.endswith("     4\td\n")
    for bad in ([0, 2], [5, 5], [3, 2], [1]):
        assert (await failure(editor.view(machine, target, bad))).error_type == "bad_request"


async def test_view_directory_two_levels(machine: LocalMachine, root: Path, editor: Editor) -> None:
    write(root / "p/a.txt", "")
    write(root / "p/sub/b.txt", "")
    write(root / "p/sub/deeper/c.txt", "")
    write(root / "p/.hidden/d.txt", "")
    result = await editor.view(machine, str(root / "p"))
    listed = result.output.split("\n")[1:-1]
    base = str(root / "p")
    assert listed == [base, f"{base}/a.txt", f"{base}/sub", f"{base}/sub/b.txt", f"{base}/sub/deeper"]
    err = await failure(editor.view(machine, base, [1, 2]))
    assert err.error_type == "bad_request"


async def test_view_directory_entry_limit(machine: LocalMachine, root: Path, editor: Editor) -> None:
    for n in range(MAX_VIEW_DIR_ENTRIES - 1):  # with the directory itself: exactly the limit
        write(root / f"full/f{n:04}", "")
    listed = (await editor.view(machine, str(root / "full"))).output.split("\n")[1:-1]
    assert len(listed) == MAX_VIEW_DIR_ENTRIES and "stopped" not in listed[-1]
    write(root / "full/zzzz", "")
    listed = (await editor.view(machine, str(root / "full"))).output.split("\n")[1:-1]
    assert len(listed) == MAX_VIEW_DIR_ENTRIES + 1 and "stopped" in listed[-1]


async def test_output_clip_boundary(machine: LocalMachine, root: Path, editor: Editor) -> None:
    numbered_prefix = len("     1\t")
    target = write(root / "wide.txt", "x" * (MAX_OUTPUT_CHARS - numbered_prefix) + "\n")
    assert ed.CLIPPED_NOTE not in (await editor.view(machine, target)).output
    write(root / "wide.txt", "x" * (MAX_OUTPUT_CHARS - numbered_prefix + 1) + "\n")
    assert ed.CLIPPED_NOTE in (await editor.view(machine, target)).output


# --- limits and failures ---------------------------------------------------------------


async def test_edit_size_boundary(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "big.txt", "a" * (MAX_EDIT_BYTES - 4) + "end\n")
    await editor.str_replace(machine, target, "end", "END")
    assert os.path.getsize(target) == MAX_EDIT_BYTES
    err = await failure(editor.str_replace(machine, target, "END", "ENDS"))  # would grow past the limit
    assert err.error_type == "bad_request" and str(MAX_EDIT_BYTES) in err.message
    assert Path(target).read_bytes().endswith(b"END\n")
    write(root / "big.txt", "a" * MAX_EDIT_BYTES + "\n")
    assert (await failure(editor.str_replace(machine, target, "a", "b", "FIRST"))).error_type == "bad_request"
    err = await failure(editor.create(machine, str(root / "huge.txt"), "a" * (MAX_EDIT_BYTES + 1)))
    assert err.error_type == "bad_request" and not (root / "huge.txt").exists()


async def test_not_utf8_is_decode_error(machine: LocalMachine, root: Path, editor: Editor) -> None:
    target = write(root / "bin.dat", b"\xff\xfe\x00x")
    assert (await failure(editor.str_replace(machine, target, "x", "y"))).error_type == "decode_error"


async def test_missing_file_and_directory(machine: LocalMachine, root: Path, editor: Editor) -> None:
    err = await failure(editor.str_replace(machine, str(root / "nope.txt"), "a", "b"))
    assert (err.error_type, err.errno_name) == ("not_found", "ENOENT")
    (root / "adir").mkdir()
    assert (await failure(editor.insert(machine, str(root / "adir"), 0, "x"))).error_type == "invalid_target"
    assert (await failure(editor.create(machine, str(root / "adir"), "x"))).error_type == "invalid_target"


async def test_paths_are_inside_paths(tmp_path: Path, editor: Editor) -> None:
    workspace = tmp_path / "ws"
    write(workspace / "src/app.py", APP)
    machine = Mounted("sandbox", workspace)
    result = await editor.str_replace(machine, "src/app.py", "hello", "bye")
    assert result.path == "/workspace/src/app.py"
    assert "/workspace/src/app.py" in result.output and str(tmp_path) not in result.output
    await editor.undo_edit(machine, "/workspace/src/app.py")
    assert (workspace / "src/app.py").read_text() == APP
    listing = await editor.view(machine, "/workspace")
    assert "/workspace/src/app.py" in listing.output
    err = await failure(editor.view(machine, "/etc/passwd"))
    assert err.error_type == "invalid_path"


# --- v1 replace ------------------------------------------------------------------------


async def test_replace_in_file(machine: LocalMachine, root: Path) -> None:
    replace_in_file = Editor().replace
    target = write(root / "r.txt", "a.b a.b\nab\n")
    assert await replace_in_file(machine, target, "a.b", "X") == 2
    assert Path(target).read_text() == "X X\nab\n"
    mtime = os.stat(target).st_mtime_ns
    assert await replace_in_file(machine, target, "zzz", "Y") == 0
    assert os.stat(target).st_mtime_ns == mtime
    err = await failure(replace_in_file(machine, target, "", "Y"))
    assert (err.error_type, err.operation) == ("bad_request", "replace")
