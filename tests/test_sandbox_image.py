"""Sandboxes on an image: the root is the image's, not the host's, under a discardable layer."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.machines.base import ExecRequest
from agentbox.machines.errors import ImageInUse, MachineUnavailable
from agentbox.machines.images import ImageStore
from agentbox.machines.sandbox import (
    FUSE_OVERLAY,
    KERNEL_OVERLAY,
    NO_LAYER,
    SandboxConfig,
    SandboxHost,
    SandboxMachine,
)
from tests.conftest import SandboxFactory, sandbox_factory, start_server, stop_server, traversable


async def sh(machine: SandboxMachine, command: str) -> tuple[int, str, str]:
    r = await machine.exec(ExecRequest(command=command, timeout=60))
    return r.exit_code, r.stdout.decode(), r.stderr.decode()


@pytest.fixture
def host_marker() -> Iterator[Path]:
    """A file in the host's /usr/local/share that no image has."""
    path = Path("/usr/local/share") / f"agentbox-host-marker-{uuid.uuid4().hex[:8]}"
    path.write_text("the host's\n")
    yield path
    path.unlink()


async def test_the_root_is_the_image_not_the_host(
    make_image_sandbox: SandboxFactory, host_marker: Path
) -> None:
    m = await make_image_sandbox()
    assert m.plan is not None and m.plan.image is not None and m.plan.image.name == "base"
    code, out, _ = await sh(
        m, f"ls /usr/local/share; test -e {host_marker} && echo VISIBLE; cat /etc/os-release"
    )
    assert code == 0
    assert host_marker.name not in out and "VISIBLE" not in out
    assert "VERSION_CODENAME=bookworm" in out
    # The image's packages, not the host's: the image has no gcc, the host does.
    assert Path("/usr/bin/gcc").exists()
    code, _, _ = await sh(m, "command -v gcc")
    assert code != 0


async def test_the_exec_agent_runs_on_the_images_python(make_image_sandbox: SandboxFactory) -> None:
    m = await make_image_sandbox()
    agent = os.stat(f"/proc/{m._child_pid}/exe")  # the sandbox's pid 1, seen from the host
    image_python = os.stat(
        m.plan.image.rootfs / "usr/bin" / os.readlink(m.plan.image.rootfs / "usr/bin/python3")
    )  # type: ignore[union-attr]
    host_python = os.stat(os.path.realpath("/usr/bin/python3"))
    assert agent.st_ino == image_python.st_ino
    assert (agent.st_dev, agent.st_ino) != (host_python.st_dev, host_python.st_ino)
    assert os.readlink(f"/proc/{m._child_pid}/exe").startswith("/usr/bin/python3")


async def test_system_installs_vanish_on_rebuild_while_the_workspace_stays(
    make_image_sandbox: SandboxFactory,
) -> None:
    m = await make_image_sandbox()
    assert m.plan is not None and m.plan.layer == KERNEL_OVERLAY
    code, _, err = await sh(
        m,
        "printf '#!/bin/sh\\necho installed\\n' > /usr/local/bin/tool && chmod +x /usr/local/bin/tool"
        " && echo 'deb http://example.invalid/ x main' > /etc/apt/sources.list.d/extra.list"
        " && python3 -m venv /opt/env && echo kept > /workspace/kept.txt",
    )
    assert code == 0, err
    assert (await sh(m, "tool"))[1] == "installed\n"
    assert not (m.plan.image.rootfs / "usr/local/bin/tool").exists()  # type: ignore[union-attr]  # the image is untouched
    # The file API reads the system directories as the sandbox sees them (its layer included).
    assert m.view.read_bytes("/usr/local/bin/tool", 100) == b"#!/bin/sh\necho installed\n"
    await m.stop()
    await m.start()
    code, out, _ = await sh(m, "ls /usr/local/bin /etc/apt/sources.list.d /opt; cat /workspace/kept.txt")
    assert "tool" not in out and "extra.list" not in out and "env" not in out
    assert out.endswith("kept\n")


async def test_the_image_is_shared_not_copied(make_image_sandbox: SandboxFactory) -> None:
    first, second = await make_image_sandbox(), await make_image_sandbox()
    await sh(first, "echo one > /usr/local/one")
    _, out, _ = await sh(second, "ls /usr/local; cat /proc/self/mountinfo | grep ' / / '")
    assert "one" not in out  # each lifetime has its own upper layer
    assert "overlay" in out
    assert first.plan is not None and second.plan is not None
    assert first.plan.image.rootfs == second.plan.image.rootfs  # type: ignore[union-attr]
    assert sum(1 for _ in first.run.rglob("*")) < 100  # the run dir holds a layer, never a copy


async def test_the_fuse_layer_is_the_fallback_where_the_kernel_refuses(
    image_host: SandboxHost, sandbox_tmp: Path, base_image: object
) -> None:
    host = SandboxHost(image_host.home, images=image_host.images.root)
    host._kernel_overlay[host.images.get("base").rootfs] = False  # as on a kernel that refuses
    make, made = sandbox_factory(host, sandbox_tmp)
    try:
        m = await make()
        assert m.plan is not None and m.plan.layer == FUSE_OVERLAY
        assert m.capabilities()["system_layer_kind"] == FUSE_OVERLAY
        code, _, err = await sh(m, "echo x > /usr/local/bin/fused && python3 -c 'print(1)'")
        assert code == 0, err
        await m.stop()
        await m.start()
        assert (await sh(m, "ls /usr/local/bin"))[1] == ""
    finally:
        for machine in made:
            await machine.stop()


async def test_without_a_layer_the_image_is_read_only(make_image_sandbox: SandboxFactory) -> None:
    m = await make_image_sandbox(SandboxConfig(network=False, system_layer=False))
    assert m.plan is not None and m.plan.layer == NO_LAYER
    code, _, err = await sh(m, "echo x > /usr/local/bin/nope")
    assert code != 0 and "Read-only file system" in err
    assert (await sh(m, "echo ok > /workspace/ok && echo ok > /tmp/ok && cat /workspace/ok"))[1] == "ok\n"


async def test_a_named_image_that_is_not_built_is_an_error(make_image_sandbox: SandboxFactory) -> None:
    with pytest.raises(MachineUnavailable, match="image 'nosuchimage' is not built"):
        await make_image_sandbox(SandboxConfig(network=False, image="nosuchimage", image_required=True))


async def test_an_unnamed_image_that_is_not_built_falls_back_to_the_host(
    make_image_sandbox: SandboxFactory,
) -> None:
    m = await make_image_sandbox(SandboxConfig(network=False, image="notbuilt"))
    assert m.plan is not None and m.plan.image is None
    caps = m.capabilities()
    assert caps["image"] is None and "not built" in caps["image_detail"]
    assert (await sh(m, "command -v gcc"))[0] == 0  # the host's /usr


async def test_an_image_in_use_cannot_be_removed(
    make_image_sandbox: SandboxFactory, image_host: SandboxHost
) -> None:
    m = await make_image_sandbox()
    with pytest.raises(ImageInUse, match="in use by a running sandbox"):
        image_host.images.remove("base")
    assert image_host.images.get("base").rootfs.is_dir()
    lock = image_host.images.root / ".locks" / "base"
    assert lock_holders(lock) == 1
    await m.stop()
    # Released with the sandbox. Other test workers may run sandboxes on the shared image,
    # so the check is this process's descriptors, not an exclusive lock.
    assert lock_holders(lock) == 0


def lock_holders(lock: Path) -> int:
    """How many of this process's descriptors are open on `lock`."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if _target(fd) == str(lock))


def _target(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed since the listing
        return ""


def test_the_api_says_which_image_and_layer_a_sandbox_got(
    base_image: object, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = traversable(tmp_path, tmp_path_factory) / "home"
    home.mkdir()
    images = ImageStore(Path(base_image.path).parent)  # type: ignore[attr-defined]
    server = start_server(home, env={"AGENTBOX_IMAGES": str(images.root)})
    try:
        with server.client() as client:
            info = client.get("/v2/sandbox", headers={"X-Session-ID": "ses_imagereport"}).json()["data"]
            executed = client.post(
                "/v1/shell/exec", json={"command": "cat /etc/debian_version"},
                headers={"X-Session-ID": "ses_imagereport"},
            ).json()  # fmt: skip
    finally:
        stop_server(server)
    isolation = info["isolation"]
    assert isolation["image"] == "base"
    assert isolation["system_layer_kind"] == KERNEL_OVERLAY and isolation["system_layer"] is True
    assert isolation["privileges"] == "root"
    assert executed["data"]["output"].strip().startswith("12.")


def test_the_host_fallbacks_base_lives_in_the_home_and_old_ones_go(tmp_path: Path) -> None:
    from agentbox.machines import sysroot

    legacy = sysroot.LEGACY_BASE_DIR / "0123456789abcdef"
    legacy.mkdir(parents=True, exist_ok=True)
    (legacy / ".complete").touch()
    stale = tmp_path / "base" / "fedcba9876543210"
    stale.mkdir(parents=True)
    (stale / ".complete").touch()
    base = sysroot.ensure_base(tmp_path)
    assert base.root.parent == tmp_path / "base" and (base.etc / "passwd").exists()
    assert not stale.exists() and not legacy.exists()
    assert [p.name for p in (tmp_path / "base").iterdir()] == [base.root.name]
