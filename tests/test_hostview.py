"""HostView on real directories: links resolve inside the view, swaps during an operation never
lead out, special files are never opened for data, foreign mounts keep the host's rights."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from agentbox.machines.errors import PathEscape
from agentbox.machines.hostview import Alias, HostView, Mount

#: Opens tried while another thread swaps a directory with a link to the host.
SWAP_ATTEMPTS = 3000
_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2


def view_of(tmp_path: Path) -> tuple[HostView, Path, Path]:
    ws, other = tmp_path / "ws", tmp_path / "other"
    ws.mkdir()
    other.mkdir()
    view = HostView([Mount("/workspace", ws), Mount("/data", other, writable=False)], "/workspace")
    return view, ws, other


def test_links_resolve_inside_the_view(tmp_path: Path) -> None:
    view, ws, other = view_of(tmp_path)
    (other / "f.txt").write_text("data")
    (ws / "abs").symlink_to("/data")
    (ws / "rel").symlink_to("../data/f.txt")
    (ws / "host").symlink_to(tmp_path)  # a host path: inside, it names nothing exposed
    assert view.read_bytes("abs/f.txt", 10) == b"data"
    assert view.read_bytes("/workspace/rel", 10) == b"data"
    assert view.resolve("abs/f.txt") == "/data/f.txt"
    assert view.resolve("rel", follow=False) == "/workspace/rel"
    with pytest.raises(PathEscape):
        view.read_bytes("host/ws/abs/f.txt", 10)
    with pytest.raises(OSError) as info:
        view.open("/data/new", os.O_WRONLY | os.O_CREAT)
    assert info.value.errno == errno.EROFS


@pytest.mark.parametrize(
    "path",
    [
        "f.txt",  # a plain file
        "/workspace/./sub/../f.txt",  # spelled the long way
        "to-f",  # a final link, relative
        "to-data-f",  # a final link, absolute, into another mount
        "chain",  # a link to a link
        "dir-link/g.txt",  # a link on the way
        "dir-link/to-g",  # a link on the way, then a final link
        "/bin/g.txt",  # below an alias
        "/bin-file",  # an alias of a file as a whole: named by a second resolution
        "/data",  # a mount root
    ],
)
def test_open_named_names_the_path_as_resolve_without_following_does(tmp_path: Path, path: str) -> None:
    """One resolution opens a file and names it: the name is what `resolve(follow=False)` says."""
    ws, other, root = tmp_path / "ws", tmp_path / "other", tmp_path / "root"
    (ws / "sub").mkdir(parents=True)
    other.mkdir()
    root.mkdir()
    (ws / "f.txt").write_text("f")
    (other / "f.txt").write_text("data f")
    (ws / "sub" / "g.txt").write_text("g")
    (ws / "to-f").symlink_to("f.txt")
    (ws / "to-data-f").symlink_to("/data/f.txt")
    (ws / "chain").symlink_to("to-f")
    (ws / "dir-link").symlink_to("sub")
    (ws / "sub" / "to-g").symlink_to("g.txt")
    aliases = [Alias("/bin", "/workspace/sub"), Alias("/bin-file", "/workspace/f.txt")]
    view = HostView([Mount("/", root), Mount("/workspace", ws), Mount("/data", other)], "/workspace", aliases)
    flags = os.O_RDONLY | (os.O_DIRECTORY if path == "/data" else 0)
    fd, named = view.open_named(path, flags)
    try:
        assert named == view.resolve(path, follow=False)
        assert os.fstat(fd).st_ino == view.stat(path).st_ino  # and it opened what the path leads to
    finally:
        os.close(fd)


def test_a_swapped_directory_never_leads_to_the_host(tmp_path: Path) -> None:
    view, ws, _ = view_of(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "t.txt").write_text("host secret")
    (ws / "real").mkdir()
    (ws / "real" / "t.txt").write_text("decoy")
    (ws / "link").symlink_to(secret)  # absolute host path: resolved inside, it is not exposed
    stop = threading.Event()

    def swap() -> None:
        real, link = os.fsencode(ws / "real"), os.fsencode(ws / "link")
        while not stop.is_set():
            _libc.renameat2(-100, real, -100, link, _RENAME_EXCHANGE)

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: set[bytes] = set()
    try:
        for _ in range(SWAP_ATTEMPTS):
            try:
                seen.add(view.read_bytes("real/t.txt", 100))
            except (OSError, PathEscape):
                seen.add(b"refused")
            try:
                fd = view.open("real/w.txt", os.O_WRONLY | os.O_CREAT)
                os.close(fd)
            except (OSError, PathEscape):
                pass
    finally:
        stop.set()
        swapper.join()
    assert b"host secret" not in seen
    assert sorted(p.name for p in secret.iterdir()) == ["t.txt"]
    assert seen & {b"decoy", b"refused"}, seen


def test_fifos_are_refused_without_blocking(tmp_path: Path) -> None:
    view, ws, _ = view_of(tmp_path)
    os.mkfifo(ws / "fifo")
    started = time.monotonic()
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
        with pytest.raises(PathEscape):
            view.open("fifo", flags)
    assert time.monotonic() - started < 1


def test_foreign_mounts_keep_the_hosts_rights(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("root reads any file; the check is what stops it")
    system = tmp_path / "usr"
    system.mkdir()
    (system / "open.txt").write_text("anyone")
    (system / "closed.txt").write_text("root only")
    (system / "closed.txt").chmod(0o600)
    view = HostView([Mount("/usr", system, writable=False, foreign=True)], "/usr", owner_uid=64999)
    assert view.read_bytes("/usr/open.txt", 10) == b"anyone"
    with pytest.raises(PermissionError):
        view.read_bytes("/usr/closed.txt", 10)


def test_mount_roots_cannot_be_removed_or_renamed(tmp_path: Path) -> None:
    view, _, _ = view_of(tmp_path)
    for op in (lambda: view.rmdir("/workspace"), lambda: view.rename("/workspace", "/workspace/x")):
        with pytest.raises(OSError) as info:
            op()
        assert info.value.errno == errno.EBUSY


def test_rename_without_replace_keeps_the_target(tmp_path: Path) -> None:
    view, ws, _ = view_of(tmp_path)
    (ws / "a").write_text("a")
    (ws / "b").write_text("b")
    with pytest.raises(FileExistsError):
        view.rename("a", "b", replace=False)
    assert (ws / "b").read_text() == "b"
    view.rename("a", "c", replace=False)
    assert (ws / "c").read_text() == "a"


def test_a_link_loop_is_eloop(tmp_path: Path) -> None:
    view, ws, _ = view_of(tmp_path)
    (ws / "x").symlink_to("y")
    (ws / "y").symlink_to("x")
    with pytest.raises(OSError) as info:
        view.stat("x")
    assert info.value.errno == errno.ELOOP


def test_walk_never_enters_a_link_and_names_inside_paths(tmp_path: Path) -> None:
    view, ws, other = view_of(tmp_path)
    (ws / "d/e").mkdir(parents=True)
    (ws / "d/e/f.txt").write_text("x")
    (ws / "d/out").symlink_to("/data")
    (other / "g.txt").write_text("y")
    nodes = {n.inside: n.is_symlink for n in view.walk("/workspace")}
    assert nodes == {
        "/workspace/d": False,
        "/workspace/d/e": False,
        "/workspace/d/e/f.txt": False,
        "/workspace/d/out": True,
    }


async def test_machine_read_is_bounded_at_its_limit(tmp_path: Path) -> None:
    from agentbox.machines.base import MAX_MACHINE_READ_BYTES
    from agentbox.machines.local import LocalMachine

    machine = LocalMachine("local", tmp_path)
    for size, fits in ((MAX_MACHINE_READ_BYTES, True), (MAX_MACHINE_READ_BYTES + 1, False)):
        with open(tmp_path / "sparse", "wb") as f:
            f.truncate(size)
        if fits:
            assert len(await machine.read(str(tmp_path / "sparse"))) == size
        else:
            with pytest.raises(OSError) as info:
                await machine.read(str(tmp_path / "sparse"))
            assert info.value.errno == errno.EFBIG
