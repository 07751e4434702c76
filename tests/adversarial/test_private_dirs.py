"""A sandbox's /tmp and $HOME are size-limited tmpfs that never touch the host disk."""

from __future__ import annotations

from pathlib import Path

from conftest import SandboxFactory

from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import SandboxConfig
from agentbox.workspace import files

#: The sizes the test gives /tmp and $HOME, in MiB, and what it tries to write into each.
SMALL_MB = 8
WRITTEN_MB = 32


def host_bytes_under(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


async def test_tmp_and_home_are_bounded_and_off_the_host_disk(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox(SandboxConfig(network=False, tmp_mb=SMALL_MB, home_mb=SMALL_MB))
    for directory in ("/tmp", "/root"):
        fill = await m.exec(
            ExecRequest(
                command=f"dd if=/dev/zero of={directory}/fill bs=1M count={WRITTEN_MB} 2>&1; echo rc=$?"
            )
        )
        out = fill.stdout.decode()
        assert "No space left on device" in out and "rc=1" in out, out
        size = m.view.stat(f"{directory}/fill").st_size  # the server sees the same file
        assert size <= SMALL_MB * 1024 * 1024
    assert host_bytes_under(m.run) < 1024 * 1024, "the sandbox's /tmp or $HOME landed on the host disk"
    assert host_bytes_under(m.workspace) == 0


async def test_what_the_server_writes_into_tmp_is_the_sandboxs_own(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox()
    files.write_file(m, "/tmp/from-server.txt", b"hello")
    files.mkdir(m, "/root/made/by/server", parents=True)
    seen = await m.exec(
        ExecRequest(command="cat /tmp/from-server.txt; echo; stat -c %u /root/made /tmp/from-server.txt")
    )
    assert seen.stdout.decode().split("\n") == ["hello", "0", "0", ""], seen.stdout
    mounted = await m.exec(ExecRequest(command="grep ' /tmp ' /proc/mounts"))
    assert "nosuid" in mounted.stdout.decode(), mounted
