"""A session's `/workspace` as a file system of its own: a disk budget the kernel enforces.

Why an image. The host's root file system (ext4) has no project quotas, and every sandbox
writes as the same host uid, so neither user nor project quotas can tell sessions apart.
A checked budget (measure usage, then refuse) is always late: `dd` writes gigabytes
between two measurements, and the server's own writes would need the same check. A file
system per workspace is exact and covers both: past the budget every write fails with
`ENOSPC`, inside the sandbox and through the API alike (the API answers 507
`no_space_left`).

    sessions/<id>/workspace.img    sparse ext4 image, root-only (0600), made on first use
    sessions/<id>/workspace/       its mount point: the host path the server works through

The image is made with `truncate -s` and `mkfs.ext4 -E root_owner=<sandbox uid>` (no
`lost+found` left in it), then loop-mounted `nosuid,nodev` (a setuid file made inside is
inert on the host), `discard` (deleting inside gives the host its blocks back) and
`noinit_itable` (no background zeroing of inode tables, which would fill a sparse image).
The host never holds more than the image's size for a workspace, whatever happens inside.

Lifetime: the image persists with the session (a reclaim, a rebuild and a server restart
keep the workspace); it is deleted with the session's directory on purge. The mount lives
from the first start of a sandbox on the session (or a `view` of a session whose image
exists, so its AGENTS.md is readable without a start) until the session is closed or
purged or the server shuts down; an idle reclaim keeps it mounted. A server that died
leaves its mounts behind: the next one detaches every mount under `sessions/` at startup.

Size: `disk_mb` of the machine entry (default DEFAULT_DISK_MB; 0 = no budget, a plain
directory). An image is made with the budget of the first machine that opens the
workspace; a larger `disk_mb` later grows it (online `resize2fs`), a smaller one never
shrinks it. A workspace directory that already holds files and has no image (made before
budgets) is copied into the new image once; if it does not fit, the sandbox does not
start (`MachineUnavailable` naming the budget) and the directory is left as it was.
Callers serialize `attach` for one workspace (the registry holds a lock around it).

A server that is not root, or has no `/dev/loop-control` or `mkfs.ext4`, cannot make
images: its workspaces are plain directories without a budget, and it logs a warning once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from agentbox.machines.errors import MachineUnavailable

#: A workspace's disk budget when its machine entry names none, in MiB (10 GiB).
DEFAULT_DISK_MB = 10 * 1024
#: The smallest budget an image may have, in MiB: ext4 with a journal needs a few MiB itself.
MIN_DISK_MB = 8
IMAGE_NAME = "workspace.img"
#: Mount options of every workspace image (see the module docstring for why each).
MOUNT_OPTIONS = "loop,nosuid,nodev,discard,noinit_itable"
#: Where a legacy workspace's files are copied into a new image before it replaces them.
STAGING_NAME = ".workspace-staging"
#: The environment of mkfs, mount and friends: nothing of the server's.
TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
MNT_DETACH = 2
LOOP_CONTROL = "/dev/loop-control"
_libc = ctypes.CDLL(None, use_errno=True)


def image_of(workspace: Path) -> Path:
    return workspace.parent / IMAGE_NAME


def available() -> bool:
    """Only root with loop devices and mkfs.ext4 can make images; others keep plain directories."""
    return (
        os.geteuid() == 0
        and Path(LOOP_CONTROL).exists()
        and shutil.which("mkfs.ext4", path=TOOL_ENV["PATH"]) is not None
    )


def attach(workspace: Path, size_mb: int, uid: int, gid: int) -> None:
    """Mount the workspace's image on `workspace` (making it first): idempotent."""
    image = image_of(workspace)
    size = max(size_mb, MIN_DISK_MB) * 1024 * 1024
    if os.path.ismount(workspace):
        _grow(workspace, image, size)
        return
    workspace.mkdir(parents=True, exist_ok=True)
    fresh = not image.exists()
    if fresh:
        _make(image, size, uid, gid)
        if any(workspace.iterdir()):
            _adopt(workspace, image)
            fresh = False
    elif image.stat().st_size < size:
        _run(["truncate", "-s", str(size), str(image)])
        _run(["e2fsck", "-f", "-p", str(image)], ok=(0, 1))
        _run(["resize2fs", str(image)])
    _mount(image, workspace)
    if fresh:  # mkfs leaves lost+found in the root; a workspace starts empty (e2fsck remakes it)
        (workspace / "lost+found").rmdir()


def detach(workspace: Path) -> None:
    """Unmount the image from `workspace` if it is mounted (lazily: open files keep it alive)."""
    if os.path.ismount(workspace):
        _umount(workspace)


def detach_all(under: Path) -> list[Path]:
    """Unmount every mount below `under` (what a dead server left); the ones detached."""
    prefix = str(under.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [_unescape(line.split()[4]) for line in f]
    gone = [Path(p) for p in points if p.startswith(prefix)]
    for point in sorted(gone, key=lambda p: len(p.parts), reverse=True):
        _umount(point)
    return gone


def usage(workspace: Path) -> int:
    """Bytes the workspace takes on the host disk: its image's allocated blocks (sparse, and
    `discard` returns what is deleted inside), or without one the blocks of its files."""
    image = image_of(workspace)
    with contextlib.suppress(FileNotFoundError):
        return image.stat().st_blocks * 512
    total = 0
    for root, dirs, files in os.walk(workspace):
        for name in [*dirs, *files]:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def space(workspace: Path) -> tuple[int, int]:
    """(used, total) bytes of the workspace as its processes see them: its image's file system
    when it has one (what `df /workspace` says inside, the budget less ext4's own blocks), else
    its files' blocks (`usage`) on the host file system that holds it."""
    fs = os.statvfs(workspace)
    total = fs.f_blocks * fs.f_frsize
    if os.path.ismount(workspace):
        return (fs.f_blocks - fs.f_bfree) * fs.f_frsize, total
    return usage(workspace), total


def remove(workspace: Path) -> None:
    """Delete the workspace and its image (purge): unmounted first, so nothing else is touched."""
    detach(workspace)
    shutil.rmtree(workspace, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        image_of(workspace).unlink()


# -- the steps ---------------------------------------------------------------------------


def _make(image: Path, size: int, uid: int, gid: int) -> None:
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    try:
        _run([
            "mkfs.ext4", "-q", "-F", "-m", "0", "-E",
            f"root_owner={uid}:{gid},lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(image),
        ])  # fmt: skip
    except BaseException:
        image.unlink()
        raise


def _adopt(workspace: Path, image: Path) -> None:
    """Copy a legacy workspace's files into its new image, then empty the directory."""
    image_mb = image.stat().st_size // (1024 * 1024)
    staging = image.parent / STAGING_NAME
    staging.mkdir(mode=0o700, exist_ok=True)
    _mount(image, staging)
    try:
        (staging / "lost+found").rmdir()
        copied = subprocess.run(
            ["cp", "-a", "--no-dereference", "--", f"{workspace}/.", f"{staging}/"],
            env=TOOL_ENV, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        _umount(staging)
        staging.rmdir()
    if copied.returncode != 0:
        image.unlink()
        raise MachineUnavailable(
            f"the workspace's files could not be moved into its disk image (budget {image_mb} MiB; "
            f"raise disk_mb if they do not fit): {copied.stderr.strip()[-200:]}"
        )
    for entry in os.scandir(workspace):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def _grow(workspace: Path, image: Path, size: int) -> None:
    """A larger budget for a mounted image: extend the file, the loop device and the fs."""
    if image.stat().st_size >= size:
        return
    device = _device_of(workspace)
    if device is None:
        return
    _run(["truncate", "-s", str(size), str(image)])
    _run(["losetup", "-c", device])
    _run(["resize2fs", device])


def _device_of(point: Path) -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == str(point):
                return fields[fields.index("-") + 2]
    return None


def _mount(image: Path, point: Path) -> None:
    _run(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(point)])


def _umount(point: Path) -> None:
    _libc.umount2(bytes(point), MNT_DETACH)


def _run(argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
    done = subprocess.run(argv, env=TOOL_ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode not in ok:
        raise MachineUnavailable(f"{argv[0]} failed for the workspace image: {done.stderr.strip()[-300:]}")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field
