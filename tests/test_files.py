"""workspace.files on real directories: every operation, every error type, every limit at its edge.

Most tests use `Box`, a LocalMachine whose view is PathMap-restricted like a sandbox's
(`/workspace` the root, `/tmp` writable, `/ro` read-only), so escapes are really refused and
inside paths read like the seeds'. Ownership tests need root (only root gives files away).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest

from agentbox.machines.hostview import HostView, Mount
from agentbox.machines.local import LocalMachine
from agentbox.timestamps import epoch_timestamp
from agentbox.workspace import files
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.files import RangeNotSatisfiable

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give files to another owner")

DEFAULT_OWNER = (4242, 4243)
ALICE = (4343, 4344)


class Box(LocalMachine):
    """A LocalMachine that exposes only three mounts, with default and named owners."""

    def __init__(self, base: Path) -> None:
        self.host = {name: base / name for name in ("ws", "t", "ro")}
        for directory in self.host.values():
            directory.mkdir(parents=True, exist_ok=True)
        super().__init__("box", self.host["ws"])
        self.root = "/workspace"
        self.view = HostView(
            [
                Mount("/workspace", self.host["ws"]),
                Mount("/tmp", self.host["t"]),
                Mount("/ro", self.host["ro"], writable=False),
            ],
            "/workspace",
        )
        self.owner = DEFAULT_OWNER
        self.users = {"alice": ALICE}


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def ws(box: Box, rel: str = "") -> Path:
    return box.host["ws"] / rel if rel else box.host["ws"]


def fail(fn, *args, **kwargs) -> WorkspaceError:  # type: ignore[no-untyped-def]
    with pytest.raises(WorkspaceError) as info:
        fn(*args, **kwargs)
    return info.value


async def afail(coro) -> WorkspaceError:  # type: ignore[no-untyped-def]
    with pytest.raises(WorkspaceError) as info:
        await coro
    return info.value


async def body(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def parts_beside(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(".part")]


APP = "import sys\n\ndef main():\n    # TODO\n    print('hello')\n\nif __name__ == '__main__':\n    main()\n"


# ---------------------------------------------------------------- read


def test_read_whole_file_and_line_range(box: Box) -> None:
    ws(box, "app.py").write_text(APP)
    whole = files.read_text(box, "/workspace/app.py")
    assert whole.content == APP and whole.line_count == 8 and whole.path == "/workspace/app.py"
    part = files.read_text(box, "app.py", start_line=2, end_line=5)  # relative to the root
    assert part.content == "def main():\n    # TODO\n    print('hello')\n"
    assert (part.start_line, part.end_line, part.path) == (2, 5, "/workspace/app.py")


def test_read_range_past_the_end_is_clamped_and_only_newline_splits(box: Box) -> None:
    ws(box, "a.txt").write_text("one\ftwo\nthree")
    assert files.read_text(box, "a.txt").line_count == 2
    tail = files.read_text(box, "a.txt", start_line=1, end_line=99)
    assert (tail.content, tail.end_line) == ("three", 2)
    empty = files.read_text(box, "a.txt", start_line=5)
    assert (empty.content, empty.start_line, empty.end_line) == ("", 2, 2)


def test_read_missing_file_is_the_seed_error(box: Box) -> None:
    err = fail(files.read_text, box, "/tmp/demo/missing.txt")
    assert err.to_dict() == {
        "errno": 2,
        "errno_name": "ENOENT",
        "error_type": "not_found",
        "exception_type": "FileNotFoundError",
        "message": "Failed to read file: No such file or directory (os error 2)",
        "operation": "read",
        "path": "/tmp/demo/missing.txt",
        "retryable": False,
    }


def test_read_directory_is_invalid_target(box: Box) -> None:
    err = fail(files.read_text, box, "/workspace")
    assert (err.error_type, err.errno, err.operation) == ("invalid_target", errno.EISDIR, "read")


@pytest.mark.parametrize(("start", "end"), [(-1, None), (0, -1), (3, 2)])
def test_read_bad_range_is_bad_request(box: Box, start: int, end: int | None) -> None:
    ws(box, "a.txt").write_text("x\n")
    assert fail(files.read_text, box, "a.txt", start, end).error_type == "bad_request"


def test_read_empty_range_at_the_same_line_is_fine(box: Box) -> None:
    ws(box, "a.txt").write_text("x\ny\n")
    assert files.read_text(box, "a.txt", 1, 1).content == ""


def test_read_binary_is_decode_error(box: Box) -> None:
    ws(box, "b.bin").write_bytes(b"\xff\xfe\x00")
    err = fail(files.read_text, box, "b.bin")
    assert (err.error_type, err.operation, err.path) == ("decode_error", "read", "b.bin")


def test_read_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_READ_BYTES", 10)
    ws(box, "ten").write_text("0123456789")
    ws(box, "eleven").write_text("0123456789a")
    assert files.read_text(box, "ten").size == 10
    err = fail(files.read_text, box, "eleven")
    assert (err.error_type, err.errno_name, err.exception_type) == ("bad_request", "EFBIG", "LimitExceeded")


def test_escape_by_dotdot_is_invalid_path(box: Box) -> None:
    err = fail(files.read_text, box, "/workspace/../../etc/passwd")
    assert (err.error_type, err.path, err.exception_type) == (
        "invalid_path",
        "/workspace/../../etc/passwd",
        "PathEscape",
    )
    assert fail(files.read_text, box, "../../../etc/passwd").error_type == "invalid_path"


def test_escape_by_symlink_is_invalid_path(box: Box) -> None:
    os.symlink("/etc", ws(box, "out"))
    os.symlink("../../../../../../etc/hostname", ws(box, "up"))
    assert fail(files.read_text, box, "/workspace/out/hostname").error_type == "invalid_path"
    assert fail(files.read_text, box, "/workspace/up").error_type == "invalid_path"
    assert fail(files.write_file, box, "/workspace/out/x", b"x").error_type == "invalid_path"
    assert not Path("/etc/x").exists()


def test_symlink_into_another_mount_is_followed_in_the_machine_view(box: Box) -> None:
    (box.host["t"] / "note").write_text("via tmp")
    os.symlink("/tmp/note", ws(box, "link"))
    assert files.read_text(box, "link").content == "via tmp"


def test_read_only_mount_refuses_writes(box: Box) -> None:
    (box.host["ro"] / "f").write_text("keep")
    assert files.read_text(box, "/ro/f").content == "keep"
    for err in (
        fail(files.write_file, box, "/ro/f", b"x"),
        fail(files.mkdir, box, "/ro/d"),
        fail(files.remove, box, "/ro/f"),
    ):
        assert (err.error_type, err.errno_name) == ("read_only_filesystem", "EROFS")
    assert (box.host["ro"] / "f").read_text() == "keep"


# ---------------------------------------------------------------- write


def test_write_creates_then_writes_in_place_keeping_the_inode(box: Box) -> None:
    result = files.write_file(box, "/tmp/notes.txt", b"first\n")
    host = box.host["t"] / "notes.txt"
    assert (result.path, result.bytes_written, host.read_bytes()) == ("/tmp/notes.txt", 6, b"first\n")
    inode = host.stat().st_ino
    with open(host, "rb") as held:
        files.write_file(box, "/tmp/notes.txt", b"second")
        assert held.read() == b"second"  # the same file, seen through an open handle
    assert host.stat().st_ino == inode
    files.write_file(box, "/tmp/notes.txt", b"+more", append=True)
    assert host.read_bytes() == b"second+more" and host.stat().st_ino == inode
    assert parts_beside(box.host["t"]) == []


@pytest.mark.parametrize("before", [b"a much longer first content\n", b"ab", b""])
@pytest.mark.parametrize("after", [b"short", b"", b"x" * 70_000])
def test_a_replacement_leaves_exactly_the_new_bytes_whatever_was_there(
    box: Box, before: bytes, after: bytes
) -> None:
    host = ws(box, "r.txt")
    host.write_bytes(before)
    inode = host.stat().st_ino
    assert files.write_file(box, "r.txt", after).bytes_written == len(after)
    assert host.read_bytes() == after and host.stat().st_ino == inode


def test_a_read_takes_what_a_file_grew_by_after_its_size_was_taken(tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_bytes(b"0123456789")
    with path.open("rb") as f:
        assert files.read_up_to(f, 4, 100) == b"0123456789"  # the size was taken at 4 bytes
    with path.open("rb") as f:
        assert files.read_up_to(f, 4, 6) == b"0123456"  # one past the limit: it is over
    with path.open("rb") as f:
        assert files.read_up_to(f, 10, 10) == b"0123456789"  # at the limit: not over


@as_root
def test_write_gives_new_files_to_the_default_owner_only(box: Box) -> None:
    existing = ws(box, "mine")
    existing.write_text("x")
    files.write_file(box, "mine", b"y")
    assert (existing.stat().st_uid, existing.stat().st_gid) == (0, 0)
    files.write_file(box, "new", b"y")
    assert (ws(box, "new").stat().st_uid, ws(box, "new").stat().st_gid) == DEFAULT_OWNER


@as_root
def test_write_with_user_stages_renames_and_changes_owner(box: Box) -> None:
    target = ws(box, "data.txt")
    target.write_text("old\n")
    target.chmod(0o640)
    inode = target.stat().st_ino
    files.write_file(box, "data.txt", b"more\n", append=True, user="alice")
    st = target.stat()
    assert target.read_text() == "old\nmore\n"
    assert st.st_ino != inode and (st.st_uid, st.st_gid) == ALICE and stat.S_IMODE(st.st_mode) == 0o640
    assert parts_beside(ws(box)) == []


def test_write_with_unknown_user_is_bad_request_and_writes_nothing(box: Box) -> None:
    err = fail(files.write_file, box, "x", b"x", user="mallory")
    assert (err.error_type, err.exception_type) == ("bad_request", "OwnerUnsupported")
    assert not ws(box, "x").exists()


def test_write_errors(box: Box) -> None:
    err = fail(files.write_file, box, "/workspace/no/such/dir/f", b"x")
    assert (err.error_type, err.operation) == ("not_found", "write")
    (ws(box, "d")).mkdir()
    assert fail(files.write_file, box, "d", b"x").error_type == "invalid_target"
    assert fail(files.write_file, box, "d", b"x", user="alice").error_type == "invalid_target"
    assert fail(files.write_file, box, "nodir/f", b"x", user="alice").error_type == "not_found"
    assert parts_beside(ws(box)) == []


def test_decode_content() -> None:
    assert files.decode_content("héllo") == "héllo".encode()
    assert files.decode_content("héllo", "raw") == "héllo".encode()
    assert files.decode_content("AAE=", "base64") == b"\x00\x01"
    assert files.decode_content("x", leading_newline=True, trailing_newline=True) == b"\nx\n"
    err = fail(files.decode_content, "not base64!", "base64", path="/tmp/f")
    assert (err.error_type, err.operation, err.path) == ("decode_error", "write", "/tmp/f")
    assert fail(files.decode_content, "\ud800").error_type == "decode_error"
    assert fail(files.decode_content, "x", "latin-9").error_type == "bad_request"  # type: ignore[arg-type]


# ---------------------------------------------------------------- mkdir


def test_mkdir_with_and_without_parents(box: Box) -> None:
    assert files.mkdir(box, "/tmp/demo/src", parents=True) == files.MkdirResult("/tmp/demo/src", True)
    assert (box.host["t"] / "demo" / "src").is_dir()
    assert files.mkdir(box, "/tmp/demo/src", parents=True).created is False
    assert files.mkdir(box, "/tmp/demo/other").created is True


def test_mkdir_errors(box: Box) -> None:
    files.mkdir(box, "d")
    assert fail(files.mkdir, box, "d").error_type == "already_exists"
    ws(box, "f").write_text("x")
    assert fail(files.mkdir, box, "f", parents=True).error_type == "already_exists"
    err = fail(files.mkdir, box, "a/b/c")
    assert (err.error_type, err.operation, err.path) == ("not_found", "mkdir", "a/b/c")
    assert fail(files.mkdir, box, "f/sub", parents=True).error_type == "invalid_target"


@as_root
def test_mkdir_gives_every_created_directory_to_its_owner(box: Box) -> None:
    ws(box, "kept").mkdir()
    files.mkdir(box, "kept/a/b", parents=True, user="alice")
    assert ws(box, "kept").stat().st_uid == 0
    assert (ws(box, "kept/a").stat().st_uid, ws(box, "kept/a/b").stat().st_gid) == (ALICE[0], ALICE[1])
    files.mkdir(box, "plain")
    assert ws(box, "plain").stat().st_uid == DEFAULT_OWNER[0]


# ---------------------------------------------------------------- list


def scaffold(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "app.py").write_text(APP)
    (root / "src" / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "README.md").write_text("# demo\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.py").write_text("s\n")
    (root / "big.bin").write_bytes(b"\0" * 10_000)


def test_list_flat_and_recursive(box: Box) -> None:
    scaffold(box.host["t"])
    flat = files.list_dir(box, "/tmp")
    assert [e.name for e in flat.files] == [".hidden", "README.md", "big.bin", "src"]
    assert (flat.total_count, flat.directory_count, flat.file_count, flat.truncated) == (4, 2, 2, False)
    deep = files.list_dir(box, "/tmp", recursive=True)
    assert sorted(e.path for e in deep.files) == [
        "/tmp/.hidden", "/tmp/.hidden/secret.py", "/tmp/README.md", "/tmp/big.bin",
        "/tmp/src", "/tmp/src/app.py", "/tmp/src/pkg", "/tmp/src/pkg/mod.py",
    ]  # fmt: skip
    two = files.list_dir(box, "/tmp", recursive=True, max_depth=2)
    assert "/tmp/src/pkg" in {e.path for e in two.files} and "/tmp/src/pkg/mod.py" not in {
        e.path for e in two.files
    }


def test_list_entry_fields(box: Box) -> None:
    scaffold(box.host["t"])
    (box.host["t"] / "README.md").chmod(0o640)
    listed = files.list_dir(box, "/tmp", include_permissions=True)
    by_name = {e.name: e for e in listed.files}
    readme = by_name["README.md"]
    assert (readme.size, readme.extension, readme.permissions, readme.is_directory) == (
        7,
        ".md",
        "rw-r-----",
        False,
    )
    assert datetime.fromisoformat(readme.modified_time or "").timestamp() == pytest.approx(
        (box.host["t"] / "README.md").stat().st_mtime
    )
    assert by_name["src"].extension is None and by_name["src"].is_directory
    bare = files.list_dir(box, "/tmp", include_size=False)
    assert all(e.size is None and e.permissions is None for e in bare.files)


def test_list_filters_and_sorts(box: Box) -> None:
    scaffold(box.host["t"])
    visible = files.list_dir(box, "/tmp", recursive=True, show_hidden=False)
    assert not any("hidden" in e.path for e in visible.files)
    py = files.list_dir(box, "/tmp", recursive=True, file_types=["PY", ".md"])
    assert sorted(e.name for e in py.files) == ["README.md", "app.py", "mod.py", "secret.py"]
    assert py.directory_count == 0
    by_size = files.list_dir(box, "/tmp", sort_by="size", sort_desc=True)
    assert by_size.files[0].name == "big.bin"
    by_type = files.list_dir(box, "/tmp", sort_by="type")
    assert [e.name for e in by_type.files] == [".hidden", "src", "big.bin", "README.md"]


def test_list_does_not_enter_symlinked_directories(box: Box) -> None:
    scaffold(box.host["t"])
    os.symlink("/tmp/src", ws(box, "inner"))
    os.symlink("/etc", ws(box, "outer"))
    os.symlink("/workspace/gone", ws(box, "dangling"))
    listed = files.list_dir(box, "/workspace", recursive=True)
    by_name = {e.name: e for e in listed.files}
    assert set(by_name) == {"inner", "outer", "dangling"}  # nothing below the links
    assert by_name["inner"].is_directory and by_name["inner"].is_symlink
    assert not by_name["outer"].is_directory  # escapes: described as the link itself
    assert not by_name["dangling"].is_directory and by_name["dangling"].is_symlink


def test_list_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_LIST_ENTRIES", 3)
    for name in "abc":
        ws(box, name).write_text(name)
    assert files.list_dir(box, "/workspace").truncated is False
    ws(box, "d").write_text("d")
    over = files.list_dir(box, "/workspace")
    assert (over.truncated, over.total_count) == (True, 3)


def test_list_errors(box: Box) -> None:
    ws(box, "f").write_text("x")
    assert fail(files.list_dir, box, "f").error_type == "invalid_target"
    err = fail(files.list_dir, box, "nope")
    assert (err.error_type, err.operation) == ("not_found", "list")
    assert fail(files.list_dir, box, "/etc").error_type == "invalid_path"
    assert fail(files.list_dir, box, ".", sort_by="colour").error_type == "bad_request"  # type: ignore[arg-type]
    assert fail(files.list_dir, box, ".", recursive=True, max_depth=0).error_type == "bad_request"


# ---------------------------------------------------------------- search, glob


def test_search_the_seed_way(box: Box) -> None:
    scaffold(box.host["t"])
    found = files.search(box, "/tmp", "**/*.py")
    assert found.files == ["/tmp/src/app.py", "/tmp/src/pkg/mod.py"] and not found.truncated
    assert files.search(box, "/tmp", "*.md").files == ["/tmp/README.md"]
    assert files.search(box, "/tmp", "**/*.{md,bin}").files == ["/tmp/README.md", "/tmp/big.bin"]


def test_search_hidden_exclude_and_directories(box: Box) -> None:
    scaffold(box.host["t"])
    assert "/tmp/.hidden/secret.py" in files.search(box, "/tmp", "**/*.py", include_hidden=True).files
    assert files.search(box, "/tmp", ".hidden/*.py").files == ["/tmp/.hidden/secret.py"]
    assert files.search(box, "/tmp", "**/*.py", exclude=["pkg"]).files == ["/tmp/src/app.py"]
    assert files.search(box, "/tmp", "**/*.py", exclude=["src/*.py"]).files == ["/tmp/src/pkg/mod.py"]
    dirs = files.search(box, "/tmp", "**", files_only=False).files
    assert "/tmp/src/pkg" in dirs and "/tmp/.hidden" not in dirs


def test_search_never_follows_a_symlink_out(box: Box) -> None:
    scaffold(box.host["t"])
    os.symlink("/etc", ws(box, "out"))
    os.symlink("/tmp/src", ws(box, "inner"))
    assert files.search(box, "/workspace", "**", files_only=False).files == [
        "/workspace/inner",
        "/workspace/out",
    ]
    assert files.search(box, "/workspace", "out/*").files == []
    assert files.search(box, "/workspace", "inner/*.py").files == []  # links are reported, never entered


def test_search_limits(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in "abc":
        ws(box, name).write_text(name)
    assert files.search(box, ".", "*", max_results=3).truncated is False
    two = files.search(box, ".", "*", max_results=2)
    assert (two.files, two.truncated) == (["/workspace/a", "/workspace/b"], True)
    assert files.search(box, ".", "*", max_results=files.MAX_SEARCH_RESULTS).truncated is False
    for bad in (0, files.MAX_SEARCH_RESULTS + 1):
        assert fail(files.search, box, ".", "*", max_results=bad).error_type == "bad_request"
    monkeypatch.setattr(files, "DEFAULT_SEARCH_RESULTS", 3)
    assert files.search(box, ".", "*").truncated is False
    monkeypatch.setattr(files, "DEFAULT_SEARCH_RESULTS", 2)
    assert files.search(box, ".", "*").truncated is True


def test_search_scan_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in "abc":
        ws(box, name).write_text(name)
    monkeypatch.setattr(files, "MAX_SEARCH_SCANNED", 3)
    full = files.search(box, ".", "c")
    assert (full.files, full.truncated) == (["/workspace/c"], False)
    monkeypatch.setattr(files, "MAX_SEARCH_SCANNED", 2)
    cut = files.search(box, ".", "c")
    assert (cut.files, cut.truncated) == ([], True)


def test_search_errors(box: Box) -> None:
    assert fail(files.search, box, ".", "/abs/*").error_type == "bad_request"
    assert fail(files.search, box, ".", "").error_type == "bad_request"
    err = fail(files.search, box, "missing", "*")
    assert (err.error_type, err.operation, err.path) == ("not_found", "search", "missing")
    ws(box, "f").write_text("x")
    assert fail(files.search, box, "f", "*").error_type == "invalid_target"


def test_glob_files_records_and_sorting(box: Box) -> None:
    scaffold(box.host["t"])
    result = files.glob_files(box, "/tmp", "**/*", sort_by="size", sort_desc=True)
    mtime = (box.host["t"] / "big.bin").stat().st_mtime
    assert result.files[0] == files.GlobEntry(
        "/tmp/big.bin", "big.bin", False, 10_000, epoch_timestamp(mtime)
    )
    assert result.total_count == 4 and not any(f.is_directory for f in result.files)
    names = files.glob_files(box, "/tmp", "**/*", sort_by="name", include_metadata=False)
    assert [f.name for f in names.files] == ["README.md", "app.py", "big.bin", "mod.py"]
    assert all(f.size is None and f.modified_time is None for f in names.files)
    assert fail(files.glob_files, box, "/tmp", "*", sort_by="colour").error_type == "bad_request"  # type: ignore[arg-type]


# ---------------------------------------------------------------- upload


async def test_upload_stages_and_renames_over_the_target(box: Box) -> None:
    target = box.host["t"] / "data.csv"
    target.write_text("old")
    inode = target.stat().st_ino
    result = await files.upload(box, "/tmp/data.csv", body(b"a,b\n1,2\n"))
    assert result == files.UploadResult("/tmp/data.csv", 8)
    assert target.read_bytes() == b"a,b\n1,2\n" and target.stat().st_ino != inode
    assert parts_beside(box.host["t"]) == []


async def test_upload_writes_in_batches(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "WRITE_BATCH_BYTES", 10)
    data = bytes(range(256)) * 3
    await files.upload(box, "blob", body(data, 13))
    assert ws(box, "blob").read_bytes() == data


@as_root
async def test_upload_owner(box: Box) -> None:
    await files.upload(box, "a", body(b"x"))
    await files.upload(box, "b", body(b"x"), user="alice")
    assert (ws(box, "a").stat().st_uid, ws(box, "b").stat().st_uid) == (DEFAULT_OWNER[0], ALICE[0])


async def test_upload_limit_boundary_leaves_no_part(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_UPLOAD_BYTES", 10)
    assert (await files.upload(box, "ten", body(b"0123456789"))).file_size == 10
    ws(box, "eleven").write_text("previous")
    err = await afail(files.upload(box, "eleven", body(b"0123456789a")))
    assert (err.error_type, err.operation, err.errno_name) == ("bad_request", "upload", "EFBIG")
    assert ws(box, "eleven").read_text() == "previous"
    assert parts_beside(ws(box)) == []


async def test_upload_body_breaking_off_leaves_no_partial_target(box: Box) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"half of it"
        raise ConnectionResetError(errno.ECONNRESET, "peer went away")

    err = await afail(files.upload(box, "f", broken()))
    assert err.error_type == "io_error"
    assert not ws(box, "f").exists() and parts_beside(ws(box)) == []


async def test_upload_cancelled_leaves_no_part(box: Box) -> None:
    release = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b"first"
        await release.wait()
        yield b"never"

    task = asyncio.create_task(files.upload(box, "f", stalled()))
    deadline = asyncio.get_running_loop().time() + 5
    while not parts_beside(ws(box)):
        assert asyncio.get_running_loop().time() < deadline, "the part never appeared"
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert parts_beside(ws(box)) == [] and not ws(box, "f").exists()


async def test_upload_errors(box: Box) -> None:
    err = await afail(files.upload(box, "/tmp/no/dir/f", body(b"x")))
    assert (err.error_type, err.operation, err.path) == ("not_found", "upload", "/tmp/no/dir/f")
    assert (await afail(files.upload(box, "/tmp", body(b"x")))).error_type == "invalid_target"
    assert (await afail(files.upload(box, "/etc/x", body(b"x")))).error_type == "invalid_path"
    assert (await afail(files.upload(box, "/ro/x", body(b"x")))).error_type == "read_only_filesystem"
    assert (await afail(files.upload(box, "x", body(b"x"), user="mallory"))).error_type == "bad_request"
    assert parts_beside(box.host["t"]) == [] and parts_beside(ws(box)) == []


# ---------------------------------------------------------------- download, Range


def test_download_target_and_ranges(box: Box) -> None:
    host = ws(box, "app.py")
    host.write_text(APP)
    target = files.download(box, "app.py")
    assert (target.path, target.machine, target.size, target.inode) == (
        "/workspace/app.py",
        box,
        len(APP),
        host.stat().st_ino,
    )
    assert b"".join(files.iter_download(target)) == APP.encode()
    assert b"".join(files.iter_download(target, 0, 9)) == APP.encode()[:10]
    assert b"".join(files.iter_download(target, len(APP) - 4, len(APP) - 1)) == APP.encode()[-4:]


def test_download_streams_in_chunks(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "DOWNLOAD_CHUNK_BYTES", 4)
    ws(box, "f").write_bytes(b"0123456789")
    assert list(files.iter_download(files.download(box, "f"))) == [b"0123", b"4567", b"89"]


def test_download_of_a_replaced_file_is_refused(box: Box) -> None:
    ws(box, "f").write_text("one")
    target = files.download(box, "f")
    ws(box, "g").write_text("two")
    os.replace(ws(box, "g"), ws(box, "f"))
    with pytest.raises(WorkspaceError) as info:
        b"".join(files.iter_download(target))
    assert (info.value.error_type, info.value.exception_type) == ("io_error", "FileChanged")


def test_download_errors(box: Box) -> None:
    assert fail(files.download, box, "/workspace").error_type == "invalid_target"
    err = fail(files.download, box, "missing")
    assert (err.error_type, err.operation) == ("not_found", "download")
    assert fail(files.download, box, "/etc/passwd").error_type == "invalid_path"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("bytes=0-9", (0, 9)),
        ("bytes=0-0", (0, 0)),
        ("bytes=9-9", (9, 9)),
        ("bytes=0-10", (0, 9)),
        ("bytes=5-", (5, 9)),
        ("bytes=9-", (9, 9)),
        ("bytes=-4", (6, 9)),
        ("bytes=-10", (0, 9)),
        ("bytes=-11", (0, 9)),
        (" bytes=2-3 ", (2, 3)),
        ("bytes=5-4", None),  # invalid: ignored, whole file
        ("bytes=0-1,3-4", None),  # several ranges: whole file
        ("items=0-1", None),
        ("bytes=-", None),
        ("bytes=a-b", None),
    ],
)
def test_parse_range(header: str | None, expected: tuple[int, int] | None) -> None:
    assert files.parse_range(header, 10) == expected


@pytest.mark.parametrize(
    ("header", "size"), [("bytes=10-", 10), ("bytes=10-20", 10), ("bytes=-0", 10), ("bytes=0-", 0)]
)
def test_parse_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable) as info:
        files.parse_range(header, size, "/tmp/f")
    assert (info.value.size, info.value.operation, info.value.path) == (size, "download", "/tmp/f")


def test_parse_range_of_an_empty_file_serves_it_whole() -> None:
    assert files.parse_range("bytes=-5", 0) is None


# ---------------------------------------------------------------- remove, stat


def test_remove(box: Box) -> None:
    scaffold(box.host["t"])
    os.symlink("/tmp/src", ws(box, "link"))
    assert files.remove(box, "link") == "/workspace/link"
    assert (box.host["t"] / "src").is_dir()  # the link went, not its target
    files.remove(box, "/tmp/README.md")
    err = fail(files.remove, box, "/tmp/src")
    assert (err.error_type, err.errno_name) == ("already_exists", "ENOTEMPTY")
    files.remove(box, "/tmp/src", recursive=True)
    assert sorted(os.listdir(box.host["t"])) == [".hidden", "big.bin"]
    assert fail(files.remove, box, "/tmp/src").error_type == "not_found"


def test_remove_refuses_roots_and_mount_points(box: Box) -> None:
    for path in ("/workspace", ".", "/tmp"):
        assert fail(files.remove, box, path, recursive=True).error_type == "invalid_target"
    local = LocalMachine("l", box.host["ws"])
    assert fail(files.remove, local, "/", recursive=True).error_type == "invalid_target"
    assert fail(files.remove, local, local.root, recursive=True).error_type == "invalid_target"


def test_stat(box: Box) -> None:
    ws(box, "f").write_text("hello")
    os.symlink("f", ws(box, "l"))
    plain = files.stat(box, "f")
    assert (plain.path, plain.size, plain.is_file, plain.is_symlink) == ("/workspace/f", 5, True, False)
    link = files.stat(box, "l")
    assert (link.path, link.size, link.is_symlink) == ("/workspace/l", 5, True)
    assert fail(files.stat, box, "nope").error_type == "not_found"
