"""`agentbox doctor`: every check on this host, and what a missing piece is shown to cost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from agentbox import doctor
from agentbox.machines.images import Image

#: Every check `agentbox doctor` reports, in its order.
CHECK_NAMES = [
    "bubblewrap", "user_namespaces", "exec_agent_python", "home", "cgroup_delegation", "cgroups",
    "image", "mmdebstrap", "system_layer", "network", "kernel_overlay_userns", "disk_space", "ripgrep",
    "browser",
]  # fmt: skip


def run_doctor(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTBOX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "agentbox", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def rendered(checks: list[doctor.Check]) -> str:
    console = Console(record=True, width=240, color_system=None)
    doctor.render(checks, console)
    return console.export_text()


def fake_binary(path: Path, script: str) -> Path:
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return path


def test_doctor_on_this_host_passes_and_lists_every_check(sandbox_tmp: Path) -> None:
    run = run_doctor(sandbox_tmp / "home", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert [c["name"] for c in report["checks"]] == CHECK_NAMES
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["bubblewrap"]["ok"] is True and by_name["bubblewrap"]["essential"] is True
    assert by_name["user_namespaces"]["ok"] is True and by_name["user_namespaces"]["essential"] is True
    assert report["ok"] is True
    assert all(set(c) == {"name", "ok", "detail", "cost", "essential"} for c in report["checks"])


def test_doctor_table_says_every_essential_check_passed(sandbox_tmp: Path) -> None:
    run = run_doctor(sandbox_tmp / "home")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every essential (*) check passed" in run.stdout
    for name in CHECK_NAMES:
        assert name in run.stdout


def test_world_writable_home_fails_the_doctor_with_its_cost(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    home.mkdir()
    home.chmod(0o777)
    run = run_doctor(home)
    assert run.returncode == 1, run.stdout
    assert "writable by group or others" in run.stdout
    assert "others can rewrite sessions and workspaces" in run.stdout
    assert "essential (*) checks failed: home" in run.stdout


def test_home_the_sandbox_uid_cannot_reach_fails(sandbox_tmp: Path) -> None:
    closed = sandbox_tmp / "closed"
    closed.mkdir(mode=0o700)
    (closed / "home").mkdir(mode=0o755)
    report = json.loads(run_doctor(closed / "home", "--json").stdout)
    home = next(c for c in report["checks"] if c["name"] == "home")
    assert home["ok"] is False and "not searchable by the sandbox uid" in home["detail"]
    assert report["ok"] is False


def test_missing_bwrap_is_essential_and_shown_with_its_cost(tmp_path: Path) -> None:
    check = doctor.check_bubblewrap(tmp_path / "no-such-bwrap")
    assert check.ok is False and check.essential is True
    text = rendered([check])
    assert "MISSING" in text and "no sandboxes" in text
    assert "essential (*) checks failed: bubblewrap" in text
    assert doctor.essential_ok([check]) is False


def test_bwrap_version_at_the_minimum_passes_below_fails(tmp_path: Path) -> None:
    wanted = ".".join(map(str, doctor.MIN_BWRAP_VERSION))
    at = fake_binary(tmp_path / "bwrap-at", f"echo bubblewrap {wanted}")
    major, minor, _ = doctor.MIN_BWRAP_VERSION
    below = fake_binary(tmp_path / "bwrap-below", f"echo bubblewrap {major}.{minor - 1}.99")
    assert doctor.check_bubblewrap(at).ok is True
    old = doctor.check_bubblewrap(below)
    assert old.ok is False and f"{wanted} or newer needed" in old.detail


def test_user_namespaces_refused_is_shown_with_bwraps_error(tmp_path: Path) -> None:
    refusing = fake_binary(
        tmp_path / "bwrap", "echo 'bwrap: No permissions to create new namespace' >&2; exit 1"
    )
    check = doctor.check_user_namespaces(refusing)
    assert check.ok is False and check.essential is True
    assert "No permissions to create new namespace" in check.detail


def test_optional_pieces_missing_are_shown_with_their_cost_and_do_not_fail(tmp_path: Path) -> None:
    checks = [
        doctor.check_network(str(tmp_path / "no-slirp4netns")),
        doctor.check_ripgrep(None),
        doctor.check_system_layer(
            (False, "fuse-overlayfs or /dev/fuse missing: /usr, /etc, /var are read-only")
        ),
    ]
    assert [c.ok for c in checks] == [False, False, False]
    text = rendered(checks)
    assert "loopback only" in text
    assert "no content search" in text
    assert "no apt-get or pip install as root inside" in text
    assert doctor.essential_ok(checks) is True


def test_a_hanging_namespace_probe_fails_after_its_timeout(tmp_path: Path) -> None:
    hanging = fake_binary(tmp_path / "bwrap", "exec sleep 30")
    started = time.monotonic()
    check = doctor.check_user_namespaces(hanging, timeout=0.5)
    assert check.ok is False and "timed out" in check.detail
    assert time.monotonic() - started < 10


def test_default_disk_minimum_is_two_gib() -> None:
    assert doctor.MIN_FREE_BYTES == 2 * 1024**3


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of a known size")
def test_disk_space_at_the_minimum_passes_one_byte_short_fails(tmp_path: Path) -> None:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        free = shutil.disk_usage(mnt).free
        assert doctor.check_disk_space(mnt / "home", minimum=free).ok is True
        short = doctor.check_disk_space(mnt / "home", minimum=free + 1)
        assert short.ok is False and "no space left on device" in short.cost
        assert str(mnt) in short.detail
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_doctor_names_the_image_sandboxes_start_on(tmp_path: Path, base_image: Image) -> None:
    home = tmp_path / "home"
    without = {c.name: c for c in doctor.run_checks(home)}
    assert not without["image"].ok and "not built" in without["image"].detail
    assert "host's /usr" in without["image"].cost
    with_image = {c.name: c for c in doctor.run_checks(home, images=base_image.path.parent)}
    assert with_image["image"].ok and with_image["image"].detail.startswith("base (base, sha256:")
    assert "layer kernel-overlay" in with_image["image"].detail
    assert with_image["exec_agent_python"].ok and "image 'base'" in with_image["exec_agent_python"].detail


def test_doctor_names_the_images_the_browser_can_run_on(tmp_path: Path, data_image: Image) -> None:
    without = {c.name: c for c in doctor.run_checks(tmp_path / "home")}
    assert not without["browser"].ok and "no image has Chromium" in without["browser"].detail
    assert not without["browser"].essential
    with_data = {c.name: c for c in doctor.run_checks(tmp_path / "home", images=data_image.path.parent)}
    assert with_data["browser"].ok and "data" in with_data["browser"].detail
