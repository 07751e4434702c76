"""The primitives the agent layer reads and places files with (`workspace/fileops.py`), on both paths.

Each test runs on host files (a `local` machine, by descriptor) and through the protocol (an
ssh machine on the real sshd of tests/conftest.py, over SFTP), both rooted at the same
directory, so the one tree on disk is checked from either side.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import SshFactory

from agentbox.machines.base import Machine
from agentbox.machines.errors import PathEscape
from agentbox.machines.local import LocalMachine
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import FileOps, HostOps, RemoteOps, file_ops


@pytest.fixture(params=["host", "ssh"])
async def machine(request: pytest.FixtureRequest, remote_root: Path, make_ssh: SshFactory) -> Machine:
    if request.param == "host":
        return LocalMachine("local", remote_root)
    return await make_ssh()


@pytest.fixture
def ops(machine: Machine) -> FileOps:
    return file_ops(machine)


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_each_machine_gets_its_own_path(machine: Machine, ops: FileOps) -> None:
    assert isinstance(ops, HostOps if isinstance(machine, LocalMachine) else RemoteOps)


async def test_create_is_exclusive_and_never_follows_a_link(ops: FileOps, remote_root: Path) -> None:
    target = remote_root / "new.txt"
    assert await ops.create(str(target), chunks(b"one ", b"two"), limit=7) == 7
    assert target.read_bytes() == b"one two"
    with pytest.raises(FileExistsError):
        await ops.create(str(target), chunks(b"other"), limit=100)
    assert target.read_bytes() == b"one two"
    (remote_root / "dangling").symlink_to(remote_root / "nowhere")
    with pytest.raises(FileExistsError):
        await ops.create(str(remote_root / "dangling"), chunks(b"x"), limit=100)
    assert not (remote_root / "nowhere").exists()


async def test_create_past_its_limit_leaves_nothing(ops: FileOps, remote_root: Path) -> None:
    with pytest.raises(OSError) as caught:
        await ops.create(str(remote_root / "big.bin"), chunks(b"12345", b"6"), limit=5)
    assert caught.value.errno == errno.EFBIG
    assert not (remote_root / "big.bin").exists()
    assert await ops.create(str(remote_root / "big.bin"), chunks(b"12345"), limit=5) == 5


async def test_contained_refuses_links_it_cannot_check(
    ops: FileOps, machine: Machine, remote_root: Path
) -> None:
    folder = remote_root / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "file.txt").write_text("x")
    (remote_root / "outside.txt").write_text("out")
    (folder / "out-link").symlink_to(remote_root / "outside.txt")
    (folder / "in-link").symlink_to(folder / "sub" / "file.txt")
    top = str(folder)
    assert await ops.contained(top, f"{top}/sub/file.txt") == f"{top}/sub/file.txt"
    assert await ops.contained(top, f"{top}/out-link") is None  # out of the folder, on either path
    assert await ops.contained(top, top) is None  # the folder itself is not below it
    assert await ops.contained(top, str(remote_root / "outside.txt")) is None
    with pytest.raises(FileNotFoundError):
        await ops.contained(top, f"{top}/missing.txt")
    inside = await ops.contained(top, f"{top}/in-link")
    if isinstance(machine, LocalMachine):  # followed by descriptor, where it really is
        assert inside == f"{top}/sub/file.txt"
    else:  # where a link leads cannot be seen through the protocol: refused
        assert inside is None


async def test_read_head_reads_a_prefix_of_regular_files_only(ops: FileOps, remote_root: Path) -> None:
    (remote_root / "text.txt").write_bytes(b"0123456789")
    assert await ops.read_head(str(remote_root / "text.txt"), 4) == b"0123"
    assert await ops.read_head(str(remote_root / "text.txt"), 100) == b"0123456789"
    os.mkfifo(remote_root / "fifo")  # opening it would block: refused before it is opened
    with pytest.raises((PathEscape, WorkspaceError), match=r"fifo|not a regular file"):
        await ops.read_head(str(remote_root / "fifo"), 4)
    (remote_root / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        await ops.read_head(str(remote_root / "dir"), 4)


async def test_write_stream_replaces_whole_or_not_at_all(machine: Machine, remote_root: Path) -> None:
    """Both kinds' atomic streamed write, at its limit and one byte past it (target kept)."""
    target = str(remote_root / "streamed.bin")
    assert await machine.write_stream(target, chunks(b"12345"), limit=5) == 5
    with pytest.raises(OSError) as err:
        await machine.write_stream(target, chunks(b"abc", b"def"), limit=5)
    assert err.value.errno == errno.EFBIG
    assert Path(target).read_bytes() == b"12345"
    assert sorted(p.name for p in remote_root.iterdir()) == ["streamed.bin"]  # no part left behind
