"""Host programs the server runs on a machine's behalf, placed where the machine can run them.

A search runs `rg` as a command of the machine itself (see `agentbox.workspace.grep`), so
that it sees the machine's files with the machine's rights. The ripgrep wheel puts `rg`
beside the server's interpreter, which a sandbox uid may not be able to reach (a venv under
`/root`), so a root server copies it once into its world-readable runtime directory, from
where each sandbox binds it read-only.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from functools import cache
from pathlib import Path

from agentbox.machines.errors import MachineUnavailable


@cache
def ripgrep_binary() -> str:
    """The `rg` the ripgrep wheel put beside this interpreter, else one on PATH."""
    found = shutil.which("rg", path=sysconfig.get_path("scripts")) or shutil.which("rg")
    if found is None:
        raise MachineUnavailable("ripgrep (rg) is not installed; `pip install ripgrep` provides it")
    return found


def reachable_copy(source: str, directory: Path) -> Path:
    """A world-readable copy of `source` in `directory`, made once per content (size and mtime)."""
    st = os.stat(source)
    target = directory / f"{Path(source).name}-{st.st_size}-{int(st.st_mtime)}"
    if not target.exists():
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copy2(source, staging)
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    return target
