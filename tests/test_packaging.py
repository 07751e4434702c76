"""Installing agentbox as an operator would: `pip install .` with no flags, and the systemd unit.

The unit's hardening is tested by applying the same restrictions by hand (a private mount
namespace with the directories ProtectSystem / ProtectHome / PrivateTmp cover, and the
no-new-privileges bit) around a real `agentbox exec`: a sandbox must still start, get its
system layer and network. An option the unit gains that is not emulated here fails
the test, so every hardening option is one that was tried.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from agentbox import __version__

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "agentbox.service"
#: Where the unit expects agentbox (the README installs the checkout in /opt/agentbox).
UNIT_AGENTBOX = "/opt/agentbox/.venv/bin/agentbox"
#: Seconds a fresh venv's `pip install .` may take (it downloads every dependency).
INSTALL_TIMEOUT = 900
#: Shell run in a private mount namespace to impose each hardening option the unit sets, then
#: exec its arguments; keyed by (option, value) as the unit spells them.
HARDENING = {
    ("NoNewPrivileges", "yes"): "",  # applied by `setpriv --no-new-privs` below
    (
        "ProtectSystem",
        "full",
    ): "for d in /usr /boot /efi /etc; do [ -d $d ] && mount --bind -o ro $d $d; done",
    (
        "ProtectHome",
        "read-only",
    ): "for d in /home /root /run/user; do [ -d $d ] && mount --bind -o ro $d $d; done",
    (
        "PrivateTmp",
        "yes",
    ): "mount -t tmpfs -o mode=1777 tmpfs /tmp && mount -t tmpfs -o mode=1777 tmpfs /var/tmp",
}
#: Unit options that restrict the service (and so every sandbox it starts).
HARDENING_PREFIXES = ("Protect", "Private", "Restrict", "NoNewPrivileges", "Lock", "SystemCall",
                      "MemoryDeny", "Capability", "AmbientCapabilities", "ReadOnlyPaths", "InaccessiblePaths")  # fmt: skip


def unit_options(text: str) -> dict[str, list[str]]:
    """Key → values of a unit file (a key may repeat), comments and sections dropped."""
    options: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        options.setdefault(key.strip(), []).append(value.strip())
    return options


def unit_hardening() -> set[tuple[str, str]]:
    """The unit's (option, value) pairs that restrict the service and its sandboxes."""
    options = unit_options(UNIT.read_text())
    return {(k, v) for k, values in options.items() if k.startswith(HARDENING_PREFIXES) for v in values}


def copy_tree(dest: Path) -> Path:
    """The checkout's files without its venv, caches or build output: what a fresh clone holds."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def test_version_option_prints_the_package_version() -> None:
    run = subprocess.run([sys.executable, "-m", "agentbox", "--version"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"agentbox {__version__}"


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_pip_install_without_flags_in_a_fresh_venv(tmp_path: Path) -> None:
    src = copy_tree(tmp_path / "src")
    env_dir = tmp_path / "x"
    venv.create(env_dir, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [str(env_dir / "bin" / "pip"), "install", "."],
        cwd=src, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "Building wheel for ripgrep" not in install.stdout
    version = subprocess.run(
        [str(env_dir / "bin" / "agentbox"), "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"agentbox {__version__}"
    # the console's page and modules are package data: a plain install delivers them
    listed = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c",
         "from agentbox.console.pages import STATIC; print(*sorted(p.name for p in STATIC.iterdir()))"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert {"index.html", "app.js", "session.js", "style.css"} <= set(listed.stdout.split())


def readme_sdk_install() -> str:
    """The README's shell line that installs the AIO SDK (in a code block or inline)."""
    found = re.findall(r"pip install [^`\n]*agent-sandbox==[^`\n]*", (ROOT / "README.md").read_text())
    assert len(found) == 1, found
    return str(found[0])


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_readmes_sdk_install_line_gives_an_importable_sdk(tmp_path: Path) -> None:
    env_dir = tmp_path / "x"
    venv.create(env_dir, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    line = readme_sdk_install()
    install = subprocess.run(
        ["sh", "-c", line], env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT
    )
    assert install.returncode == 0, line + "\n" + install.stderr[-3000:]
    check = [str(env_dir / "bin" / "python"), "-c", "from agent_sandbox import Sandbox; Sandbox"]
    imported = subprocess.run(check, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert imported.returncode == 0, line + "\n" + imported.stderr


def test_systemd_unit_runs_agentbox_serve_as_root_with_a_state_dir() -> None:
    options = unit_options(UNIT.read_text())
    assert options["ExecStart"] == [f"{UNIT_AGENTBOX} serve --host 127.0.0.1 --port 8091"]
    assert options["User"] == ["root"]
    assert "AGENTBOX_HOME=/var/lib/agentbox" in options["Environment"]
    assert options["Restart"] == ["on-failure"]
    assert options["KillMode"] == ["mixed"]
    assert options["Delegate"] == ["yes"]
    timeout = options["TimeoutStopSec"][0]
    assert timeout.endswith("s") and int(timeout[:-1]) >= 30
    assert options["WantedBy"] == ["multi-user.target"]


def test_systemd_unit_verifies() -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (scripts/test.sh installs the systemd package)")
    # verify also checks that ExecStart exists: point it at the agentbox this test runs.
    here = Path(sys.executable).parent / "agentbox"
    assert here.exists(), f"{here}: the test venv has no agentbox entry point"
    text = UNIT.read_text()
    assert UNIT_AGENTBOX in text
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentbox-verify-{os.getpid()}"
    probe.mkdir()
    try:
        (probe / "agentbox.service").write_text(text.replace(UNIT_AGENTBOX, str(here)))
        run = subprocess.run(
            [analyze, "verify", str(probe / "agentbox.service")], capture_output=True, text=True
        )
    finally:
        shutil.rmtree(probe)
    assert run.returncode == 0 and run.stdout + run.stderr == "", run.stdout + run.stderr


def test_systemd_unit_hardening_is_each_emulated() -> None:
    hardening = unit_hardening()
    assert hardening <= set(HARDENING), f"no emulation here for {hardening - set(HARDENING)}: add and try it"
    assert ("NoNewPrivileges", "yes") in hardening and ("ProtectSystem", "full") in hardening


def kept_through_private_tmp(paths: list[Path], hold: Path) -> tuple[str, str]:
    """Shell to keep `paths` (this checkout, its venv) that lie in /tmp or /var/tmp reachable
    under a private /tmp, as they are for a service, whose code never lives there: bound to
    `hold` before the tmpfs goes on, and back after."""
    before, after = [], []
    for i, path in enumerate(p for p in paths if p.is_relative_to("/tmp") or p.is_relative_to("/var/tmp")):
        kept, dest = shlex.quote(str(hold / str(i))), shlex.quote(str(path))
        before.append(f"mkdir -p {kept} && mount --bind {dest} {kept}")
        after.append(f"mkdir -p {dest} && mount --bind {kept} {dest}")
    return " && ".join(before) or "true", " && ".join(after) or "true"


@pytest.mark.skipif(os.geteuid() != 0, reason="the unit runs as root; emulating it needs root")
def test_sandboxes_start_under_the_units_hardening() -> None:
    hardening = unit_hardening()
    setup = " && ".join(HARDENING[h] for h in sorted(hardening) if HARDENING[h]) or "true"
    hold = Path(tempfile.mkdtemp(prefix="agentbox-hold-", dir="/run"))
    keep, restore = kept_through_private_tmp([ROOT, Path(sys.prefix).resolve()], hold)
    no_new_privs = ("NoNewPrivileges", "yes") in hardening
    probe = (
        "grep NoNewPrivs /proc/self/status; touch /usr/local/agentbox-probe && echo layer-writable; "
        "grep -c tap0 /proc/net/dev; cat /proc/self/uid_map"
    )
    launch = "setpriv --no-new-privs" if no_new_privs else ""
    home = 'AGENTBOX_HOME=$(mktemp -d) && chmod 755 "$AGENTBOX_HOME" && export AGENTBOX_HOME'
    script = f'set -e; {keep}; {setup}; {restore}; {home}; exec {launch} "$@"'
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        run = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
             sys.executable, "-m", "agentbox", "exec", "--", "sh", "-c", probe],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        for point in [*hold.iterdir(), hold]:  # empty here: the binds were in the namespace only
            point.rmdir()
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.split("\n")
    assert lines[0].split() == ["NoNewPrivs:", "1" if no_new_privs else "0"]
    assert lines[1] == "layer-writable"
    assert lines[2] == "1", "no slirp4netns tap0 in the sandbox"
    assert lines[3].split()[:2] == ["0", "64999"], "sandbox root is not the unprivileged sandbox uid"
