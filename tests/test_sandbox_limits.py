"""Resource limits of real sandboxes (cgroups): a memory hog and a fork bomb stay contained.

While they run, the test's own event loop (standing in for the server's) must keep ticking
and another sandbox must keep answering. The fork bomb only runs after a host-side check
that commands really are born inside the sandbox's cgroup: without that, it would be a fork
bomb on the host.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, SandboxFactory, sandbox_host_pid

from agentbox.machines.base import ExecRequest, ExecResult
from agentbox.machines.cgroups import Cgroups, Limits, SandboxGroup
from agentbox.machines.sandbox import SandboxConfig, SandboxMachine

REPORT = Cgroups().report()
pytestmark = pytest.mark.skipif(
    REPORT["cgroups"] == "none", reason=f"no cgroups on this host: {REPORT['detail']}"
)

MIB = 1024 * 1024
#: Small limits for the sandbox under attack.
SMALL = Limits(memory_bytes=64 * MIB, pids=64, cpus=0.5)
#: What the hog tries to allocate in total: far past SMALL, small enough to be harmless if uncontained.
HOG_TOTAL_BYTES = 256 * MIB
HOG = f"""
chunks = []
for _ in range({HOG_TOTAL_BYTES // (8 * MIB)}):
    chunks.append(bytearray({8 * MIB}))
print("allocated everything")
"""
#: A second sandbox (default limits) must be able to use this much while the first is capped.
OTHER_ALLOCATION_BYTES = 128 * MIB
#: The longest pause the event loop may show while a sandbox misbehaves.
MAX_LOOP_HICCUP = 0.5
#: Tick of the loop probe.
TICK = 0.01
#: How fast `true` must still complete in an unaffected sandbox...
OTHER_SANDBOX_SECONDS = 1.0
#: ...measured at least this many times while the bomb runs.
OTHER_SAMPLES = 3
#: Seatbelt under the cgroup: an RLIMIT_NPROC well above SMALL.pids, so a broken cgroup still
#: cannot fork-bomb the host (pids.max is what must stop it first). The count is per host uid,
#: which every sandbox on the host shares, hence the headroom.
BOMB_NPROC_SEATBELT = 2000
FORK_BOMB = f"ulimit -u {BOMB_NPROC_SEATBELT}; f(){{ f|f & }}; f >/dev/null 2>/tmp/bomb.err"


@dataclass
class LoopProbe:
    """Measures the worst gap between ticks of an `asyncio.sleep(TICK)` loop."""

    worst: float = 0.0
    ticks: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - TICK)
            self.ticks += 1
            last = now


@pytest.fixture
async def loop_probe() -> AsyncIterator[LoopProbe]:
    probe = LoopProbe()
    probe.task = asyncio.ensure_future(probe.run())
    yield probe
    probe.task.cancel()


def group_of(m: SandboxMachine) -> SandboxGroup:
    """The sandbox's cgroup (private to SandboxMachine; the tests read its files from the host)."""
    group = m._group
    assert group is not None, "the sandbox has no cgroup although the host offers them"
    return group


def controller_dir(group: SandboxGroup, controller: str) -> Path:
    """The group's directory for a v1 controller, or its one v2 directory."""
    for d in group.dirs:
        if controller in d.parts or REPORT["cgroups"] == "v2":
            return d
    raise AssertionError(f"no {controller} directory in {group.dirs}")


def pids_max_events(group: SandboxGroup) -> int:
    """How often a fork was refused by pids.max (`max N` in pids.events)."""
    for line in (controller_dir(group, "pids") / "pids.events").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "max":
            return int(value)
    return 0


async def sh(m: SandboxMachine, command: str) -> ExecResult:
    return await m.exec(ExecRequest(command=command, timeout=SANDBOX_DEADLINE))


async def require_commands_inside_group(m: SandboxMachine) -> None:
    """Fail (never skip) unless a command's host process sits in the sandbox's own cgroups."""
    process = await m.spawn(ExecRequest(argv=("sleep", "1000")))
    try:
        host_pid = await sandbox_host_pid(m, process.pid)
        members = group_of(m).pids()
        assert host_pid in members, (
            f"a command (host pid {host_pid}) is outside the sandbox's cgroup {group_of(m).dirs}; "
            f"members: {sorted(members)}; its cgroups: {Path(f'/proc/{host_pid}/cgroup').read_text()}"
        )
    finally:
        process.kill()
        await process.wait()


def test_report_names_the_cgroup_version() -> None:
    assert REPORT["cgroups"] in ("v1", "v2")
    assert REPORT["detail"]
    v1_mounted = Path("/sys/fs/cgroup/memory").is_dir() and Path("/sys/fs/cgroup/pids").is_dir()
    assert (REPORT["cgroups"] == "v1") == v1_mounted


async def test_limits_are_written_to_the_sandbox_group(make_sandbox: SandboxFactory) -> None:
    m = await make_sandbox(SandboxConfig(network=False, limits=SMALL))
    group = group_of(m)
    if REPORT["cgroups"] == "v1":
        assert (
            int((controller_dir(group, "memory") / "memory.limit_in_bytes").read_text()) == SMALL.memory_bytes
        )
        assert int((controller_dir(group, "cpu") / "cpu.cfs_quota_us").read_text()) == 50_000
        assert int((controller_dir(group, "cpu") / "cpu.cfs_period_us").read_text()) == 100_000
    else:
        assert int((group.dirs[0] / "memory.max").read_text()) == SMALL.memory_bytes
    assert int((controller_dir(group, "pids") / "pids.max").read_text()) == SMALL.pids


#: Sandboxes started per configuration when checking cgroup membership: joining the group
#: at launch can race the agent's start, so one lucky start proves little.
MEMBERSHIP_STARTS = 4


@pytest.mark.parametrize("layer", [False, True], ids=["read-only-usr", "system-layer"])
async def test_every_command_is_born_inside_the_sandbox_group(
    make_sandbox: SandboxFactory, layer: bool
) -> None:
    for _ in range(MEMBERSHIP_STARTS):
        m = await make_sandbox(SandboxConfig(network=False, limits=SMALL, system_layer=layer))
        await require_commands_inside_group(m)
        await m.stop()


async def test_memory_hog_is_killed_and_others_are_unaffected(
    make_sandbox: SandboxFactory, loop_probe: LoopProbe
) -> None:
    capped = await make_sandbox(SandboxConfig(network=False, limits=SMALL))
    other = await make_sandbox()
    await require_commands_inside_group(capped)
    result = await capped.exec(ExecRequest(argv=("python3", "-c", HOG), timeout=SANDBOX_DEADLINE))
    assert not result.timed_out
    assert b"allocated everything" not in result.stdout
    assert result.exit_code == 137 or b"MemoryError" in result.stderr, result
    if result.exit_code == 137:
        assert group_of(capped).oom_kills() >= 1
    peak = group_of(capped).memory_peak()
    assert peak is not None and peak <= SMALL.memory_bytes  # type: ignore[operator]
    # The capped sandbox itself survives its command's death...
    assert (await sh(capped, "echo alive")).stdout == b"alive\n"
    # ...and the limit is per sandbox: the other one may use twice the capped one's limit.
    grow = f"x = bytearray({OTHER_ALLOCATION_BYTES}); print(len(x))"
    big = await other.exec(ExecRequest(argv=("python3", "-c", grow), timeout=SANDBOX_DEADLINE))
    assert big.exit_code == 0, big
    assert loop_probe.ticks > 0
    assert loop_probe.worst < MAX_LOOP_HICCUP


async def test_fork_bomb_hits_pids_max_and_the_server_stays_responsive(
    make_sandbox: SandboxFactory, loop_probe: LoopProbe
) -> None:
    bombed = await make_sandbox(SandboxConfig(network=False, limits=SMALL))
    other = await make_sandbox()
    await require_commands_inside_group(bombed)
    group = group_of(bombed)
    pids_current = controller_dir(group, "pids") / "pids.current"
    before = pids_max_events(group)
    bomb = await bombed.spawn(ExecRequest(command=FORK_BOMB))
    samples: list[int] = []
    other_seconds: list[float] = []
    deadline = time.monotonic() + SANDBOX_DEADLINE
    try:
        while pids_max_events(group) == before or len(other_seconds) < OTHER_SAMPLES:
            assert time.monotonic() < deadline, (
                f"the bomb never hit pids.max: pids.current {samples[-20:]}; "
                f"its stderr: {bombed.view.read_bytes('/tmp/bomb.err', 1 << 20)[:500]!r}"
            )
            samples.append(int(pids_current.read_text()))
            started = time.monotonic()
            assert (await other.exec(ExecRequest(argv=("true",), timeout=SANDBOX_DEADLINE))).exit_code == 0
            other_seconds.append(time.monotonic() - started)
            await asyncio.sleep(TICK)
    finally:
        started = time.monotonic()
        await bombed.stop()  # the only sure end of a fork bomb: kill the whole group
        teardown = time.monotonic() - started
        bomb.kill()
    assert max(samples) <= SMALL.pids  # type: ignore[operator]
    assert max(other_seconds) < OTHER_SANDBOX_SECONDS, other_seconds
    assert teardown < OTHER_SANDBOX_SECONDS * 5
    assert not group.pids()
    assert loop_probe.ticks > 0
    assert loop_probe.worst < MAX_LOOP_HICCUP, loop_probe
    assert not any(Path(d).exists() for d in group.dirs)
