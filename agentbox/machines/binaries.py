"""Host programs the server runs on a machine's behalf, placed where the machine can run them.

A search runs `rg` as a command of the machine itself (see `agentbox.workspace.grep`), so
that it sees the machine's files with the machine's rights. The ripgrep wheel puts `rg`
beside the server's interpreter, which a sandbox uid may not be able to reach (a venv under
`/root`), so a root server copies it once into its world-readable runtime directory, from
where each sandbox binds it read-only.

The browser runs Playwright's driver (the node binary and package the playwright wheel
ships) inside the machine too; a sandbox binds the driver's directory read-only by a
descriptor the server opened, so the same reach problem does not arise.
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


@cache
def playwright_driver_dir() -> Path:
    """The directory of the playwright wheel's driver: `node` and `package/cli.js`."""
    try:
        from playwright._impl._driver import compute_driver_executable
    except ImportError:
        raise MachineUnavailable("the browser needs the playwright package, which is not installed") from None
    node, cli = compute_driver_executable()
    if not Path(node).is_file() or not Path(cli).is_file():
        raise MachineUnavailable(f"playwright's driver is incomplete: {node} or {cli} is missing")
    return Path(node).parent


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
