"""Path mapping of a real sandbox: no inside path, `..` or symlink leads the server to a host file.

The symlinks are made by a command INSIDE the sandbox (as an agent would), pointing at host
paths: a secret under /var/tmp (outside everything the sandbox exposes) and one in the test's
tmp dir (inside, /tmp is the sandbox's own). Every file operation of the machine (HostFiles)
and every workspace function must refuse the escapes (PathEscape / `invalid_path`) or land in
the sandbox's own files, and after each one the host secrets must be exactly as they were.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from conftest import SANDBOX_DEADLINE, traversable

from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.errors import MachineError, PathEscape
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.workspace import files, grep, tree
from agentbox.workspace.errors import WorkspaceError

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: A host directory outside every mount of a sandbox (its /var is its own), with a secret.
VAR_SECRET_DIR = Path("/var/tmp") / f"agentbox-pathmap-{uuid.uuid4().hex[:12]}"
SECRET = b"s3cr3t-token " * 333  # a distinctive size: 4329 bytes
SECRET_TOKEN = "s3cr3t-token"
SECRET_NAME = "secret.txt"
#: An escaping path can still hang a server that opens it: fail such a test instead.
OPERATION_TIMEOUT = 10

#: Inside paths of a directory that escapes to VAR_SECRET_DIR, one per route out.
ESCAPING_DIRS = {
    "dotdot-absolute": f"/workspace/../..{VAR_SECRET_DIR}",
    "dotdot-relative": f"../../..{VAR_SECRET_DIR}",
    "absolute-symlink": "/workspace/abs_var",
    "relative-symlink": "/workspace/rel_var",
    "symlink-via-proc": f"/workspace/proc_root{VAR_SECRET_DIR}",
    "nested-symlink": "/workspace/real/deeper/up_var",
}

#: The symlinks a command inside makes: workspace path -> target (HOST_TMP: the test's host tmp dir).
LINKS = {
    "/workspace/abs_var": str(VAR_SECRET_DIR),
    "/workspace/rel_var": f"../../../../../../..{VAR_SECRET_DIR}",
    "/workspace/real/deeper/up_var": f"../../../../../../../..{VAR_SECRET_DIR}",
    "/workspace/abs_var_file": f"{VAR_SECRET_DIR}/{SECRET_NAME}",
    "/workspace/proc_root": "/proc/1/root",
    "/workspace/abs_tmp": "HOST_TMP",
    "/workspace/rel_shadow": "../../../../etc/shadow",
    "/workspace/abs_shadow": "/etc/shadow",
    "/workspace/devnull": "/dev/null",
}
#: Routes whose last component is the link itself: removing that path removes the link only.
ENDING_IN_A_LINK = {"absolute-symlink", "relative-symlink", "nested-symlink"}

SETUP = (
    "set -e; mkdir -p /workspace/real/deeper; echo inside > /workspace/real/file.txt; "
    + "; ".join(f"ln -sfn {target} {link}" for link, target in LINKS.items())
    + "; rm -f /workspace/fifo /workspace/sock; mkfifo /workspace/fifo"
    + "; python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('/workspace/sock')\""
)


@dataclass
class Box:
    """A running sandbox with escape routes in its workspace, and the host secrets they aim at."""

    m: SandboxMachine
    tmp_secret_dir: Path

    @property
    def setup(self) -> str:
        return SETUP.replace("HOST_TMP", str(self.tmp_secret_dir))

    def host_state(self) -> list[tuple[str, bytes, int, int, int]]:
        """Everything an escape could change on the host side."""
        state = []
        for d in (VAR_SECRET_DIR, self.tmp_secret_dir):
            for p in sorted(d.iterdir()):
                st = p.lstat()
                state.append((str(p), p.read_bytes(), st.st_uid, st.st_gid, st.st_mode))
        return state


@pytest.fixture(scope="module")
def var_secret() -> Iterator[Path]:
    VAR_SECRET_DIR.mkdir(parents=True)
    (VAR_SECRET_DIR / SECRET_NAME).write_bytes(SECRET)
    yield VAR_SECRET_DIR / SECRET_NAME
    shutil.rmtree(VAR_SECRET_DIR)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def box(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory, var_secret: Path
) -> AsyncIterator[Box]:
    tmp_secret_dir = tmp_path_factory.mktemp("hostdir")
    (tmp_secret_dir / SECRET_NAME).write_bytes(SECRET)
    d = traversable(tmp_path_factory.mktemp("pathmap"), tmp_path_factory)
    m = SandboxMachine("sandbox", new_id(SANDBOX), sandbox_host, SandboxConfig(network=False),
                       d / "workspace", d / "run")  # fmt: skip
    await m.start()
    try:
        b = Box(m, tmp_secret_dir)
        await relink(b)
        yield b
    finally:
        await m.stop()


async def relink(box: Box) -> None:
    """Put the links back (a test removed one, as it may)."""
    result = await box.m.exec(ExecRequest(command=box.setup, timeout=SANDBOX_DEADLINE))
    assert result.exit_code == 0, result.stderr


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def tar_of(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def outcome(action: Awaitable[object] | Callable[[], object]) -> object:
    """What an operation returned, or the exception it raised."""
    try:
        if callable(action):
            return await asyncio.wait_for(asyncio.to_thread(action), OPERATION_TIMEOUT)
        return await asyncio.wait_for(action, OPERATION_TIMEOUT)
    except (MachineError, OSError, WorkspaceError) as exc:
        return exc


# ---------------------------------------------------------------- HostFiles, every operation

MachineOp = Callable[[SandboxMachine, str], Awaitable[object]]
MACHINE_OPS: dict[str, MachineOp] = {
    "read": lambda m, d: m.read(f"{d}/{SECRET_NAME}"),
    "write": lambda m, d: m.write(f"{d}/{SECRET_NAME}", b"pwned"),
    "write-new": lambda m, d: m.write(f"{d}/planted.txt", b"pwned"),
    "list": lambda m, d: m.list(d),
    "stat": lambda m, d: m.stat(f"{d}/{SECRET_NAME}"),
    "remove": lambda m, d: m.remove(f"{d}/{SECRET_NAME}"),
    "remove-dir": lambda m, d: m.remove(d, recursive=True),
    "mkdir": lambda m, d: m.mkdir(f"{d}/newdir"),
    "mkdir-parents": lambda m, d: m.mkdir(f"{d}/a/b", parents=True),
    "rename-out": lambda m, d: m.rename(f"{d}/{SECRET_NAME}", "/workspace/stolen.txt"),
    "rename-in": lambda m, d: m.rename("/workspace/real/file.txt", f"{d}/planted.txt"),
    "chown": lambda m, d: m.chown(f"{d}/{SECRET_NAME}", "root"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", list(ESCAPING_DIRS))
@pytest.mark.parametrize("op", list(MACHINE_OPS))
async def test_machine_operations_refuse_every_escape(box: Box, op: str, route: str) -> None:
    before = box.host_state()
    result = await outcome(MACHINE_OPS[op](box.m, ESCAPING_DIRS[route]))
    assert box.host_state() == before, "the host's files changed"
    if op == "remove-dir" and route in ENDING_IN_A_LINK:
        # Removing the link itself is removing a file of the workspace: allowed, never followed.
        assert result is None, result
        await relink(box)
        return
    assert isinstance(result, PathEscape), f"{op} via {route} gave {result!r}"


@pytest.mark.parametrize("op", list(MACHINE_OPS))
async def test_a_link_to_a_host_tmp_path_stays_in_the_sandbox_tmp(box: Box, op: str) -> None:
    """An absolute link is an inside path: /tmp/<host path> is the sandbox's own (empty) /tmp.

    Whatever the operation does there (fail, or work on the sandbox's own files), the host's
    file behind the same path is neither read nor changed.
    """
    before = box.host_state()
    try:
        result = await outcome(MACHINE_OPS[op](box.m, "/workspace/abs_tmp"))
        assert box.host_state() == before, "the host's files changed"
        assert not (isinstance(result, bytes) and SECRET in result)
        assert not (isinstance(result, list) and any(e.name == SECRET_NAME for e in result))
        assert result is None or isinstance(result, (OSError, MachineError)), f"{op} gave {result!r}"
    finally:
        await box.m.exec(ExecRequest(command="rm -rf /tmp/* /tmp/.[!.]*", timeout=SANDBOX_DEADLINE))
        await relink(box)


async def test_listing_the_workspace_reveals_nothing_of_link_targets(box: Box, var_secret: Path) -> None:
    host = var_secret.stat()
    for entry in await box.m.list("/workspace"):
        assert (entry.stat.inode, entry.stat.size) != (host.st_ino, host.st_size), (
            f"{entry.name} shows the host file's metadata: {entry.stat}"
        )


@pytest.mark.parametrize(
    "link", ["/workspace/rel_shadow", "/workspace/abs_shadow", "/workspace/../../etc/shadow"]
)
async def test_shadow_links_reach_the_sandbox_etc_never_the_host(box: Box, link: str) -> None:
    host_shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else None
    read = await outcome(box.m.read(link))
    assert not isinstance(read, bytes) or read != host_shadow
    assert isinstance(read, FileNotFoundError | PathEscape), read  # the curated /etc has no shadow
    write = await outcome(box.m.write(link, b"root::0:0:::::\n"))
    assert isinstance(write, OSError | MachineError), write  # /etc is read-only from the server's side
    assert host_shadow is None or Path("/etc/shadow").read_bytes() == host_shadow


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/workspace/devnull", "/dev/null", "/workspace/fifo", "/workspace/sock"])
async def test_devices_fifos_and_sockets_are_refused(box: Box, path: str) -> None:
    for action in (box.m.read(path), box.m.write(path, b"x")):
        result = await outcome(action)
        assert isinstance(result, PathEscape), f"{path}: {result!r}"


# ---------------------------------------------------------------- workspace functions

WorkspaceOp = Callable[[SandboxMachine, str], Awaitable[object] | Callable[[], object]]
WORKSPACE_OPS: dict[str, WorkspaceOp] = {
    "read_text": lambda m, d: lambda: files.read_text(m, f"{d}/{SECRET_NAME}"),
    "write_file": lambda m, d: lambda: files.write_file(m, f"{d}/{SECRET_NAME}", b"pwned"),
    "write_file-user": lambda m, d: lambda: files.write_file(m, f"{d}/{SECRET_NAME}", b"pwned", user="root"),
    "upload": lambda m, d: files.upload(m, f"{d}/planted.txt", chunks(b"pwned")),
    "download": lambda m, d: lambda: files.download(m, f"{d}/{SECRET_NAME}"),
    "list_dir": lambda m, d: lambda: files.list_dir(m, d),
    "grep": lambda m, d: grep.grep(m, d, SECRET_TOKEN),
    "tree-out": lambda m, d: lambda: tree.tar_stream(m, d),
    "tree-in": lambda m, d: tree.untar(m, f"{d}/unpacked", chunks(tar_of("planted.txt", b"pwned"))),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", list(ESCAPING_DIRS))
@pytest.mark.parametrize("op", list(WORKSPACE_OPS))
async def test_workspace_functions_refuse_every_escape(box: Box, op: str, route: str) -> None:
    before = box.host_state()
    result = await outcome(WORKSPACE_OPS[op](box.m, ESCAPING_DIRS[route]))
    assert box.host_state() == before, "the host's files changed"
    assert isinstance(result, WorkspaceError), f"{op} via {route} gave {result!r}"
    assert result.error_type == "invalid_path", result.to_dict()


async def test_walking_the_workspace_never_follows_links_out(box: Box) -> None:
    found = await grep.grep(box.m, "/workspace", SECRET_TOKEN)
    assert found.matches == []
    archive = b"".join(tree.tar_stream(box.m, "/workspace"))
    assert SECRET_TOKEN.encode() not in archive
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        links = {m.name: m.linkname for m in t.getmembers() if m.issym()}
    assert links["abs_var"] == str(VAR_SECRET_DIR)  # stored as the link it is, not its target
    listing = files.list_dir(box.m, "/workspace")
    by_name = {e.name: e for e in listing.files}
    assert by_name["abs_var_file"].size != len(SECRET)
    assert os.path.exists(VAR_SECRET_DIR / SECRET_NAME)
