"""workspace.tree: tar out and back in on real directories; every unsafe member refused, nothing written."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Literal

import pytest
from test_files import ALICE, DEFAULT_OWNER, Box, as_root

from agentbox.workspace import tree
from agentbox.workspace.errors import WorkspaceError


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


async def body(data: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def make_tar(*members: tuple[tarfile.TarInfo, bytes | None], mode: Literal["w", "w:gz"] = "w") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode, format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def file_member(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def members_of(chunks: Iterator[bytes]) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        return tar.getmembers()


def scaffold(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "src" / "app.py").write_text("print('hi')\n")
    (root / "src" / "run.sh").write_text("#!/bin/sh\n")
    (root / "src" / "run.sh").chmod(0o755)
    (root / "src" / "pkg" / "mod.py").write_text("X = 1\n")
    (root / ".env").write_text("A=1\n")
    os.symlink("src/app.py", root / "app-link")
    os.symlink("pkg", root / "src" / "pkg-link")


def snapshot(root: Path) -> dict[str, tuple[str, object]]:
    """Everything under root as {relative path: (kind, content or target)}."""
    seen: dict[str, tuple[str, object]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            seen[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            seen[rel] = ("dir", None)
        else:
            seen[rel] = (
                "file",
                (path.read_bytes(), stat.S_IMODE(path.stat().st_mode), int(path.stat().st_mtime)),
            )
    return seen


# ---------------------------------------------------------------- round trip


async def test_round_trip_keeps_files_dirs_modes_and_symlinks(box: Box) -> None:
    demo = box.host["t"] / "demo"
    demo.mkdir()
    scaffold(demo)
    data = b"".join(tree.tar_stream(box, "/tmp/demo"))
    assert len(data) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == [
        ".env", "app-link", "empty", "src", "src/app.py",
        "src/pkg", "src/pkg-link", "src/pkg/mod.py", "src/run.sh",
    ]  # fmt: skip
    assert members["app-link"].issym() and members["app-link"].linkname == "src/app.py"
    assert members["src"].isdir() and members["src/run.sh"].mode == 0o755

    result = await tree.untar(box, "/workspace/copy", body(data))
    assert result == tree.TreeResult("/workspace/copy", files_written=6, dirs_created=4, bytes_written=32)
    assert snapshot(box.host["ws"] / "copy") == snapshot(demo)
    assert os.listdir(box.host["ws"]) == ["copy"]  # the staged archive is gone


def test_tar_stream_streams_in_bounded_chunks(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "TAR_CHUNK_BYTES", 1024)
    payload = os.urandom(10_000)
    (box.host["ws"] / "big").write_bytes(payload)
    chunks = list(tree.tar_stream(box, "/workspace"))
    assert len(chunks) > 5 and max(len(c) for c in chunks[:-1]) < 2 * 1024
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        source = tar.extractfile("big")
        assert source is not None and source.read() == payload


def test_tar_stream_stores_escaping_symlinks_as_links_and_skips_staging_and_fifos(box: Box) -> None:
    ws = box.host["ws"]
    os.symlink("/etc", ws / "out")
    (ws / ".aiod-upload-1234.part").write_text("half")
    os.mkfifo(ws / "pipe")
    members = members_of(tree.tar_stream(box, "."))
    assert [(m.name, m.issym(), m.linkname) for m in members] == [("out", True, "/etc")]


def test_tar_stream_errors(box: Box) -> None:
    (box.host["ws"] / "f").write_text("x")
    cases = {"f": "invalid_target", "missing": "not_found", "/etc": "invalid_path"}
    for path, error_type in cases.items():
        with pytest.raises(WorkspaceError) as info:
            tree.tar_stream(box, path)
        assert (info.value.error_type, info.value.operation, info.value.path) == (error_type, "tree", path)


def test_tar_stream_member_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "MAX_TREE_MEMBERS", 3)
    for name in "abc":
        (box.host["ws"] / name).write_text(name)
    assert len(members_of(tree.tar_stream(box, "."))) == 3
    (box.host["ws"] / "d").write_text("d")
    with pytest.raises(WorkspaceError) as info:
        tree.tar_stream(box, ".")
    assert (info.value.error_type, info.value.errno_name) == ("bad_request", "EFBIG")


# ---------------------------------------------------------------- untar: evil members


EVIL = {
    "absolute": special("/etc/evil", tarfile.REGTYPE),
    "dotdot": file_member("../evil"),
    "dotdot-inside": file_member("a/../../evil"),
    "dotdot-deep": file_member("a/b/../../../evil"),
    "hardlink": special("hard", tarfile.LNKTYPE, "ok.txt"),
    "symlink-absolute": special("link", tarfile.SYMTYPE, "/etc/passwd"),
    "symlink-up": special("link", tarfile.SYMTYPE, "../outside"),
    "symlink-up-nested": special("a/link", tarfile.SYMTYPE, "../../outside"),
    "symlink-up-after-down": special("link", tarfile.SYMTYPE, "a/../../outside"),
    "symlink-empty": special("link", tarfile.SYMTYPE, ""),
    "chardev": special("dev", tarfile.CHRTYPE),
    "blockdev": special("blk", tarfile.BLKTYPE),
    "fifo": special("fifo", tarfile.FIFOTYPE),
    "through-archive-symlink": special("via", tarfile.SYMTYPE, "sub"),
    "below-archive-file": file_member("plain"),
}
#: Members that make a case evil only together with the one above.
AFTER = {
    "through-archive-symlink": [file_member("via/x")],
    "below-archive-file": [file_member("plain/x")],
}


@pytest.mark.parametrize("case", sorted(EVIL))
async def test_each_unsafe_member_is_refused_and_nothing_is_written(box: Box, case: str) -> None:
    data = make_tar(file_member("ok.txt", b"fine"), EVIL[case], *AFTER.get(case, []))
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "/workspace/out", body(data))
    assert (info.value.error_type, info.value.operation, info.value.path) == (
        "invalid_path",
        "tree",
        "/workspace/out",
    )
    assert os.listdir(box.host["ws"]) == []  # no target, no ok.txt, no staged archive
    assert not Path("/etc/evil").exists()


async def test_an_on_disk_symlink_in_the_way_is_refused_before_writing(box: Box) -> None:
    target = box.host["ws"] / "dest"
    target.mkdir()
    os.symlink(str(box.host["t"]), target / "d")
    data = make_tar(file_member("ok.txt"), file_member("d/x"))
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "dest", body(data))
    assert info.value.error_type == "invalid_path"
    assert os.listdir(target) == ["d"] and os.listdir(box.host["t"]) == []


async def test_kind_conflicts_with_the_disk_are_invalid_target(box: Box) -> None:
    target = box.host["ws"] / "dest"
    (target / "adir").mkdir(parents=True)
    (target / "afile").write_text("keep")
    for data in (make_tar(file_member("ok.txt"), file_member("adir")), make_tar(file_member("afile/x"))):
        with pytest.raises(WorkspaceError) as info:
            await tree.untar(box, "dest", body(data))
        assert info.value.error_type == "invalid_target"
    assert sorted(os.listdir(target)) == ["adir", "afile"]


# ---------------------------------------------------------------- untar: behaviour


async def test_untar_merges_replaces_files_and_links_and_strips_special_bits(box: Box) -> None:
    target = box.host["ws"] / "dest"
    target.mkdir()
    (target / "keep").write_text("kept")
    (target / "f").write_text("old")
    os.symlink("keep", target / "was-link")
    data = make_tar(
        file_member("f", b"new"),
        file_member("was-link", b"now a file"),
        file_member("suid", b"#!/bin/sh\n", mode=0o4755),
        special("newlink", tarfile.SYMTYPE, "f"),
    )
    result = await tree.untar(box, "/workspace/dest", body(data))
    assert (result.files_written, result.dirs_created) == (4, 0)
    assert (target / "f").read_text() == "new" and (target / "keep").read_text() == "kept"
    assert not (target / "was-link").is_symlink() and (target / "was-link").read_text() == "now a file"
    assert stat.S_IMODE((target / "suid").stat().st_mode) == 0o755
    assert os.readlink(target / "newlink") == "f"
    assert not [n for n in os.listdir(target) if n.endswith(".part")]


async def test_untar_accepts_gzip(box: Box) -> None:
    data = make_tar(file_member("a/b.txt", b"zipped"), mode="w:gz")
    await tree.untar(box, "z", body(data))
    assert (box.host["ws"] / "z" / "a" / "b.txt").read_bytes() == b"zipped"


@as_root
async def test_untar_gives_everything_created_to_the_owner(box: Box) -> None:
    data = make_tar(file_member("a/f"), special("a/l", tarfile.SYMTYPE, "f"))
    await tree.untar(box, "mine", body(data))
    await tree.untar(box, "hers", body(data), user="alice")
    for name, owner in (("mine", DEFAULT_OWNER), ("hers", ALICE)):
        root = box.host["ws"] / name
        for path in (root, root / "a", root / "a" / "f", root / "a" / "l"):
            st = path.lstat()
            assert (st.st_uid, st.st_gid) == owner, path


async def test_untar_errors(box: Box) -> None:
    (box.host["ws"] / "file").write_text("x")
    tar = make_tar(file_member("a"))
    cases = [
        ("file", tar, "invalid_target"),
        ("/workspace/no/parent", tar, "not_found"),
        ("/etc/x", tar, "invalid_path"),
        ("/ro/x", tar, "read_only_filesystem"),
        ("fresh", b"this is not a tar archive" * 100, "bad_request"),
        ("fresh", b"", "bad_request"),
        ("fresh", make_tar(special(".", tarfile.REGTYPE)), "invalid_path"),
    ]
    for path, data, error_type in cases:
        with pytest.raises(WorkspaceError) as info:
            await tree.untar(box, path, body(data))
        assert (info.value.error_type, info.value.path) == (error_type, path)
    assert os.listdir(box.host["ws"]) == ["file"]
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "fresh", body(tar), user="mallory")
    assert info.value.error_type == "bad_request"


async def test_untar_member_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "MAX_TREE_MEMBERS", 3)
    three = make_tar(*(file_member(n) for n in "abc"))
    assert (await tree.untar(box, "ok", body(three))).files_written == 3
    four = make_tar(*(file_member(n) for n in "abcd"))
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "over", body(four))
    assert (info.value.error_type, info.value.errno_name) == ("bad_request", "EFBIG")
    assert sorted(os.listdir(box.host["ws"])) == ["ok"]


async def test_untar_body_limit_boundary(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_tar(file_member("a", b"abc"))
    monkeypatch.setattr(tree, "MAX_TREE_BYTES", len(data))
    assert (await tree.untar(box, "ok", body(data))).bytes_written == 3
    monkeypatch.setattr(tree, "MAX_TREE_BYTES", len(data) - 1)
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "over", body(data))
    assert info.value.errno_name == "EFBIG"
    assert sorted(os.listdir(box.host["ws"])) == ["ok"]


async def test_untar_content_limit_boundary_stops_a_gzip_bomb(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_tar(file_member("zeros", bytes(200_000)), mode="w:gz")
    assert len(data) < 10_000
    monkeypatch.setattr(tree, "MAX_TREE_BYTES", 200_000)
    assert (await tree.untar(box, "ok", body(data))).bytes_written == 200_000
    monkeypatch.setattr(tree, "MAX_TREE_BYTES", 199_999)
    with pytest.raises(WorkspaceError) as info:
        await tree.untar(box, "over", body(data))
    assert (info.value.error_type, info.value.errno_name) == ("bad_request", "EFBIG")
    assert sorted(os.listdir(box.host["ws"])) == ["ok"]
