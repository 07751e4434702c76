"""`agentbox serve` run by an ordinary host user: its own image, sandboxes without root.

The test (root) makes the user `agentbox-ci` if it is missing, with the subordinate uid
and gid ranges mmdebstrap's unshare mode maps. As that user it builds `base` into the
user's own default home (`~/.local/share/agentbox`, kept between runs: a second build is
a no-op), starts `agentbox serve` on a loopback port, and works through the HTTP API.

The user runs this checkout's code with the test's own dependencies when it can reach
them (a venv's interpreter may live under /root, so a system Python of the same version
with the venv's site-packages on its path will do); failing that, a venv in the user's
home with the checkout's dependencies, made once, and a copy of the package's sources.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import HostUser, Server, start_server, stop_server, traversable
from test_api_v2 import Aio

import agentbox
from agentbox.machines.images import MANIFEST, ROOTFS, SUBORDINATE_ID_FILES, UNSHARE_SCRATCH_PARENT, Manifest
from agentbox.machines.sandbox import KERNEL_OVERLAY

USER = "agentbox-ci"
#: Debian's first subordinate id and range size (login.defs SUB_UID_MIN, SUB_UID_COUNT): given
#: to the user when the one who made it left it without (useradd adds them on Debian).
SUBORDINATE_START, SUBORDINATE_COUNT = 100000, 65536
#: The user's home for images, kept between runs: agentbox's default for a non-root user.
USER_AGENTBOX_HOME = Path(".local/share/agentbox")
#: Where the user's venv lives when it cannot run this checkout's.
USER_VENV_PARENT = Path(".cache/agentbox-tests")
#: PATH for the user's processes (mmdebstrap, newuidmap, tar), after the scripts of its Python.
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
#: Seconds the first build may take (about a minute on a warm mirror), or a venv's install.
BUILD_SECONDS = 1200
#: Seconds a build that is up to date may take.
NO_OP_SECONDS = 10.0

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="makes and becomes an unprivileged user: needs root"),
    pytest.mark.timeout(BUILD_SECONDS),
]


@dataclass(frozen=True)
class Agentbox:
    """How `USER` runs agentbox: a Python command and the environment it needs."""

    user: HostUser
    python: list[str]
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = BUILD_SECONDS, **env: str) -> subprocess.CompletedProcess[str]:
        """`argv` as the user, in its home."""
        return subprocess.run(
            argv, env={**self.env, **env}, capture_output=True, text=True, timeout=timeout,
            cwd=self.user.home, **self.user.popen_args(),
        )  # fmt: skip

    def py(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """The user's Python with `args` (`-m agentbox ...`, `-c ...`)."""
        return self.run(*self.python, *args, **env)

    @property
    def images(self) -> Path:
        return self.user.home / USER_AGENTBOX_HOME / "images"


def ensure_user(name: str) -> HostUser:
    """The user `name`, made if missing, with a subordinate uid and gid range each."""
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    for table, option in zip(SUBORDINATE_ID_FILES, ("--add-subuids", "--add-subgids"), strict=True):
        lines = table.read_text().splitlines() if table.exists() else []
        if not any(line.split(":", 1)[0] == name for line in lines):
            start = max(
                [SUBORDINATE_START, *(int(f[1]) + int(f[2]) for f in (line.split(":") for line in lines))]
            )
            subprocess.run(["usermod", option, f"{start}-{start + SUBORDINATE_COUNT - 1}", name], check=True)
    return HostUser.named(name)


def checkout() -> Path:
    """The source tree of the agentbox this test imports (wherever CI cloned it)."""
    return Path(agentbox.__file__).resolve().parent.parent


def reachable_agentbox(user: HostUser) -> Agentbox | None:
    """This test's own interpreter, or a system one of its version, with its site-packages."""
    paths = dict.fromkeys([str(checkout()), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    env = {
        **user.env(),
        "PYTHONPATH": ":".join(paths),
        "PATH": f"{sysconfig.get_path('scripts')}:{SYSTEM_PATH}",
    }
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in dict.fromkeys([sys.executable, shutil.which(version, path=SYSTEM_PATH)]):
        if python is not None and imports_this_checkout(candidate := Agentbox(user, [python], env)):
            return candidate
    return None


def imports_this_checkout(candidate: Agentbox) -> bool:
    try:
        probe = candidate.py("-c", "import agentbox, fastapi, uvicorn; print(agentbox.__file__)")
    except OSError:  # the interpreter itself is out of the user's reach
        return False
    expected = checkout() / "agentbox" / "__init__.py"
    return probe.returncode == 0 and Path(probe.stdout.strip()) == expected


def own_agentbox(user: HostUser, sources: Path) -> Agentbox:
    """A venv in the user's home with the checkout's dependencies (kept per dependency list),
    running a copy of the package's sources in `sources` (a directory the user can read)."""
    dependencies = tomllib.loads((checkout() / "pyproject.toml").read_text())["project"]["dependencies"]
    key = hashlib.sha256(json.dumps(dependencies).encode()).hexdigest()[:12]
    venv = user.home / USER_VENV_PARENT / f"venv-{key}"
    shutil.copytree(
        checkout() / "agentbox", sources / "agentbox", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**user.env(), "PYTHONPATH": str(sources), "PATH": f"{venv / 'bin'}:{SYSTEM_PATH}"}
    made = Agentbox(user, [str(venv / "bin" / "python")], env)
    if not (venv / "bin" / "python").exists():
        steps = [
            ["python3", "-m", "venv", str(venv)],
            [*made.python, "-m", "pip", "install", "-q", *dependencies],
        ]
        for step in steps:
            done = made.run(*step)
            assert done.returncode == 0, done.stderr
    return made


@pytest.fixture(scope="module")
def ci(tmp_path_factory: pytest.TempPathFactory) -> Agentbox:
    user = ensure_user(USER)
    found = reachable_agentbox(user)
    if found is None:
        found = own_agentbox(user, traversable(tmp_path_factory.mktemp("nonroot-src"), tmp_path_factory))
    return found


def scratch_dirs(user: HostUser) -> set[Path]:
    """The user's unshare-mode build directories below /var/tmp."""
    return {p for p in UNSHARE_SCRATCH_PARENT.glob("agentbox-image-*") if p.lstat().st_uid == user.uid}


@dataclass(frozen=True)
class Built:
    manifest: Manifest
    left: set[Path]
    """Scratch directories the build left below /var/tmp."""


@pytest.fixture(scope="module")
def built(ci: Agentbox) -> Built:
    """`agentbox image build base` as the user: built once per machine, then up to date."""
    before = scratch_dirs(ci.user)
    started = time.monotonic()
    done = ci.py("-m", "agentbox", "image", "build", "base", AGENTBOX_HOME=str(ci.images.parent))
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"\nbuild as {USER}: {time.monotonic() - started:.1f} s")
    return Built(Manifest.load(ci.images / "base" / MANIFEST), scratch_dirs(ci.user) - before)


def test_the_user_builds_its_own_base_image(ci: Agentbox, built: Built) -> None:
    manifest = built.manifest
    assert (manifest.name, manifest.profile, manifest.uid, manifest.gid) == (
        "base",
        "base",
        ci.user.uid,
        ci.user.gid,
    )
    rootfs = ci.images / "base" / ROOTFS
    for path in ("usr/bin/python3", "etc/os-release", "var/lib/dpkg/status"):
        assert (rootfs / path).lstat().st_uid == ci.user.uid, path
    # The tree has the modes a root build gives it (a non-root tar would apply its umask).
    assert oct((rootfs / "var/tmp").stat().st_mode & 0o7777) == oct(0o1777)
    assert "python3" in manifest.packages and manifest.build_seconds > 0
    assert built.left == set()
    started = time.monotonic()
    again = ci.py("-m", "agentbox", "image", "build", "base", AGENTBOX_HOME=str(ci.images.parent))
    no_op = time.monotonic() - started
    print(f"\nsecond build: {no_op:.1f} s (the first took {manifest.build_seconds:.0f} s)")
    assert again.returncode == 0 and "is up to date" in again.stderr, again.stderr
    assert no_op < NO_OP_SECONDS
    assert Manifest.load(ci.images / "base" / MANIFEST) == manifest


def test_doctor_as_the_user_says_what_a_non_root_server_has(ci: Agentbox, built: Built) -> None:
    done = ci.py("-m", "agentbox", "doctor", "--json", AGENTBOX_HOME=str(ci.images.parent))
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert done.returncode == 0, done.stdout
    assert checks["mmdebstrap"]["ok"] and "unshare mode" in checks["mmdebstrap"]["detail"]
    assert checks["image"]["ok"] and KERNEL_OVERLAY in checks["image"]["detail"]
    assert not checks["cgroups"]["ok"] and not checks["system_layer"]["ok"]


def test_what_a_killed_unshare_build_leaves_is_removed(ci: Agentbox) -> None:
    """A chroot of the subordinate uids, and directories with no write bit for their owner."""
    leftover = Path(ci.run("mktemp", "-d", f"{UNSHARE_SCRATCH_PARENT}/agentbox-left-XXXXXXXX").stdout.strip())
    shape = (
        "chmod 0711 . && mkdir -p locked/deeper chroot && touch locked/deeper/f"
        " && chmod 0555 locked/deeper && chmod 0 locked && chmod 0777 chroot"
        # What a killed build leaves: a tree the subordinate uids own, made in their namespace.
        " && mmdebstrap --unshare-helper sh -c"
        " 'mkdir -p chroot/var/lib && touch chroot/var/lib/f && chown 7:7 chroot/var/lib/f'"
    )
    made = ci.run("sh", "-c", f"cd {leftover} && {shape}")
    assert made.returncode == 0, made.stderr
    owners = {p.lstat().st_uid for p in (leftover / "chroot").rglob("*")}
    assert ci.user.uid not in owners  # the user alone could not remove them
    code = "import sys, pathlib; from agentbox.machines.images import remove_tree as rm; rm(pathlib.Path(sys.argv[1]))"
    removed = ci.py("-c", code, str(leftover))
    assert removed.returncode == 0, removed.stderr
    assert not leftover.exists()


@contextlib.contextmanager
def user_server(ci: Agentbox, request: pytest.FixtureRequest, config: str = "") -> Iterator[Server]:
    """`agentbox serve` as the user, on a fresh home of its own, with the user's images and
    `config` as its agentbox.toml. Its log is shown when a test using it fails."""
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    run = traversable(factory.mktemp("nonroot-server"), factory)
    (run / "home").mkdir()
    os.chown(run / "home", ci.user.uid, ci.user.gid)
    (run / "agentbox.toml").write_text(config)
    env = {**ci.env, "AGENTBOX_IMAGES": str(ci.images), "AGENTBOX_CONFIG": str(run / "agentbox.toml")}
    failed = request.session.testsfailed
    started = time.monotonic()
    s = start_server(run / "home", env, user=ci.user, python=ci.python)
    print(f"\nserver as {USER} answering: {time.monotonic() - started:.2f} s")
    try:
        yield s
    except BaseException:
        failed = -1
        raise
    finally:
        stop_server(s)
        if request.session.testsfailed != failed:
            terminal = request.config.pluginmanager.get_plugin("terminalreporter")
            terminal.write_line(f"\n--- the end of {s.log} ---\n{s.log_tail()}")


@pytest.fixture(scope="module")
def server(ci: Agentbox, built: Built, request: pytest.FixtureRequest) -> Iterator[Server]:
    with user_server(ci, request) as s:
        yield s


def test_the_server_runs_as_the_user(ci: Agentbox, server: Server) -> None:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {str(ci.user.uid)}


def test_a_command_runs_on_the_image_as_root_of_the_users_namespace(ci: Agentbox, server: Server) -> None:
    sb = Aio.fresh(server)
    started = time.monotonic()
    first = sb.run("id -u; cat /proc/self/uid_map; . /etc/os-release; echo $VERSION_CODENAME")
    print(f"\nfirst command (sandbox start included): {time.monotonic() - started:.2f} s")
    uid, mapping, codename = first["stdout"].split("\n")[:3]
    assert uid == "0" and codename == "bookworm", server.log_tail()
    assert mapping.split() == ["0", str(ci.user.uid), "1"]  # root inside is the user outside


def test_the_sandbox_reports_an_unprivileged_image_sandbox(ci: Agentbox, server: Server) -> None:
    isolation = Aio.fresh(server).get("/v2/sandbox")["isolation"]
    assert isolation["image"] == "base"
    assert isolation["system_layer_kind"] == KERNEL_OVERLAY and isolation["system_layer"] is True
    assert isolation["privileges"] == "unprivileged" and isolation["host_uid"] == ci.user.uid
    report = ci.py(
        "-c",
        "import json; from agentbox.machines.cgroups import Cgroups; print(json.dumps(Cgroups().report()))",
    )
    assert isolation["resource_limits"] == json.loads(report.stdout)
    assert isolation["resource_limits"]["cgroups"] == "none"


def test_a_system_install_lands_in_the_overlay_not_the_image(ci: Agentbox, server: Server) -> None:
    sb = Aio.fresh(server)
    installed = sb.run(
        "printf '#!/bin/sh\\necho installed by $(id -un)\\n' > /usr/local/bin/nonroot-tool"
        " && chmod 755 /usr/local/bin/nonroot-tool && nonroot-tool"
    )
    assert installed["stdout"] == "installed by root\n"
    assert not (ci.images / "base" / ROOTFS / "usr/local/bin/nonroot-tool").exists()
    other = Aio.fresh(server).post("/v2/commands", command="test -e /usr/local/bin/nonroot-tool")
    assert other["exit_code"] == 1  # another session's sandbox has its own layer


def test_the_host_based_root_works_for_the_user_too(ci: Agentbox, request: pytest.FixtureRequest) -> None:
    """Without an image: the host's /usr read-only and a curated /etc, from a base whose /var
    copies what of the package databases the user may read (dpkg's lock is root's alone)."""
    with user_server(ci, request, '[machines.sandbox]\nkind = "sandbox"\nimage = ""\n') as s:
        sb = Aio.fresh(s)
        isolation = sb.get("/v2/sandbox")["isolation"]
        release = sb.run("cat /etc/debian_version; test -e /etc/shadow || echo no shadow")
        install = sb.post("/v2/commands", command="touch /usr/local/bin/nonroot-tool")
        bases = list((s.home / "base").iterdir())
    assert (isolation["image"], isolation["system_layer_kind"]) == (None, "none")
    assert release["stdout"] == Path("/etc/debian_version").read_text() + "no shadow\n"
    assert install["exit_code"] != 0 and "Read-only file system" in install["stderr"]
    assert len(bases) == 1 and (bases[0] / "var/lib/dpkg/status").exists()
    assert Path("/var/lib/dpkg/lock").exists() and not (bases[0] / "var/lib/dpkg/lock").exists()


ACCOUNT_SCRIPT = """
import asyncio, tempfile
from pathlib import Path
from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine

async def main():
    root = Path(tempfile.mkdtemp())
    machine = SandboxMachine("sandbox", "sbx_nonrootaccount", SandboxHost(root), SandboxConfig(network=False),
                             root / "workspace", root / "run")
    await machine.start()
    try:
        for user in ("user", "root"):
            done = await machine.exec(ExecRequest(command="id -un; id -u; cat /proc/self/uid_map", user=user, timeout=30))
            print(done.exit_code, done.stdout.decode().split(), done.stderr.decode().strip())
    finally:
        await machine.stop()

asyncio.run(main())
"""


def test_the_user_account_needs_no_root_server(ci: Agentbox) -> None:
    """The account's namespace is nested by host programs run as the server's own user: a
    server that is not root makes it the same way (machines/account.py). On the host-based
    root, whose /etc is read-only here, it has no name: uid 1000 all the same."""
    ran = ci.py("-c", ACCOUNT_SCRIPT)
    assert ran.returncode == 0, ran.stderr
    as_user, as_root = ran.stdout.strip().split("\n")[-2:]
    assert as_user.startswith("0 ['1000', '1000', '1000', '0', '1'] id: cannot find name"), ran.stdout
    assert as_root.startswith(f"0 ['root', '0', '0', '{ci.user.uid}', '1']"), ran.stdout
