"""E2B's sandbox metrics through the stock `e2b` SDK, against a real `agentbox serve`.

The server's default machine has known limits (MEMORY_MB, DISK_MB, one CPU), so the totals
a sample reports are checked against them, and the figures against what a command really
does in the sandbox: memory held by a process, a busy loop, a file written.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox
from e2b.api.client.api.sandboxes import get_sandboxes_metrics
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import SandboxException

from agentbox.e2b.metrics import (
    FRESH_SECONDS,
    MAX_METRIC_SAMPLES,
    MAX_METRICS_IDS,
    METRICS_INTERVAL_SECONDS,
    Samples,
)
from agentbox.machines.base import Usage
from agentbox.machines.cgroups import Cgroups, Limits
from agentbox.machines.sandbox import owner_token
from agentbox.machines.usage import host_memory, measure
from tests.conftest import Server, eventually, point_e2b_sdk, start_server, stop_server, traversable

API_KEY = "e2b-metrics-key"
MIB = 1024 * 1024
#: The default machine's limits on this server.
MEMORY_MB = 512
DISK_MB = 64
#: Bytes a process of a test holds, far above what an idle sandbox moves by.
HELD_MB = 150
#: Seconds a condition may take before a test fails.
DEADLINE_SECONDS = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("e2b-metrics"), tmp_path_factory) / "home"
    home.mkdir()
    config = home.parent / "agentbox.toml"
    config.write_text(f"[machines.sandbox]\nmemory_mb = {MEMORY_MB}\ndisk_mb = {DISK_MB}\n")
    server = start_server(home, env={"AGENTBOX_API_KEY": API_KEY, "AGENTBOX_CONFIG": str(config)})
    with pytest.MonkeyPatch.context() as mp:
        point_e2b_sdk(mp, server)
        yield server
    stop_server(server)


@pytest.fixture
def sbx(server: Server) -> Iterator[Sandbox]:
    sandbox = Sandbox.create()
    yield sandbox
    sandbox.kill()


def test_totals_are_the_configured_limits(sbx: Sandbox) -> None:
    [first] = sbx.get_metrics()  # a request takes the first sample: nothing to wait for
    info = sbx.get_info()
    assert first.mem_total == MEMORY_MB * MIB == info.memory_mb * MIB
    assert first.cpu_count == 1 == info.cpu_count  # a sandbox's default CPU limit
    # The workspace's own file system: its budget, less what ext4 keeps for itself.
    assert 0.8 * DISK_MB * MIB < first.disk_total <= DISK_MB * MIB
    assert 0 < first.disk_used < first.disk_total and 0 < first.mem_used < first.mem_total
    assert abs(first.timestamp.timestamp() - time.time()) < DEADLINE_SECONDS


def test_memory_follows_a_process_that_holds_it(sbx: Sandbox) -> None:
    before = sbx.get_metrics()[-1].mem_used
    holder = sbx.commands.run(
        f"python3 -c 'import time; b = bytearray({HELD_MB} * 2**20); print(1, flush=True); time.sleep(600)'",
        background=True,
    )
    held = before + (HELD_MB - 20) * MIB

    def newest() -> int:
        time.sleep(FRESH_SECONDS)  # so the next call samples afresh
        return sbx.get_metrics()[-1].mem_used

    eventually(lambda: newest() >= held, f"memory used to rise by about {HELD_MB} MiB", DEADLINE_SECONDS)
    sbx.commands.kill(holder.pid)
    eventually(lambda: newest() < held, "the memory to be given back", DEADLINE_SECONDS)


def test_cpu_is_the_share_used_since_the_previous_sample(sbx: Sandbox) -> None:
    """Each sample's share of its window, summed over the windows, is the CPU time spent.

    A loaded machine gives the spinner less than a whole CPU, so the spinner counts its own
    CPU seconds, and the samples must account for them, not for wall time.
    """
    sbx.get_metrics()
    time.sleep(FRESH_SECONDS + 0.5)
    idle = sbx.get_metrics()[-1]
    assert idle.cpu_used_pct < 20
    spin = "import time\nwhile time.process_time() < 1.5: pass\nprint(time.process_time())"
    spent = float(sbx.commands.run(f"python3 -c '{spin}'").stdout)
    time.sleep(FRESH_SECONDS)
    after = [s for s in sbx.get_metrics() if s.timestamp > idle.timestamp]
    used = sum(
        b.cpu_used_pct / 100 * b.cpu_count * (b.timestamp - a.timestamp).total_seconds()
        for a, b in itertools.pairwise([idle, *after])
    )
    assert spent <= used <= spent + 0.5, (spent, used, after)


def test_disk_used_grows_with_a_file(sbx: Sandbox) -> None:
    before = sbx.get_metrics()[-1].disk_used
    sbx.commands.run("head -c 8M /dev/urandom > /workspace/big && sync")
    time.sleep(FRESH_SECONDS)
    assert sbx.get_metrics()[-1].disk_used >= before + 7 * MIB


def test_start_and_end_choose_the_samples(sbx: Sandbox) -> None:
    """The timer may add samples at any moment, so only what a window must hold is checked."""
    first = sbx.get_metrics()
    time.sleep(FRESH_SECONDS + 1)
    every = sbx.get_metrics()
    assert every[: len(first)] == first and len(every) > len(first)  # the request took a new one
    assert all(a.timestamp < b.timestamp for a, b in itertools.pairwise(every))
    newest = every[-1]
    later = newest.timestamp.replace(microsecond=0)
    chosen = sbx.get_metrics(start=later)
    assert newest in chosen and all(s.timestamp >= later for s in chosen)
    before = sbx.get_metrics(end=later - timedelta(seconds=1))
    assert before and before == [s for s in every if s.timestamp < later]
    assert sbx.get_metrics(start=datetime.now(UTC) + timedelta(hours=1)) == []


def test_a_running_sandbox_is_sampled_on_a_timer(sbx: Sandbox) -> None:
    created = time.time()
    time.sleep(METRICS_INTERVAL_SECONDS + 1)  # the timer's own cadence: nothing else to wait on
    asked = time.time()
    samples = sbx.get_metrics()
    timed = [s for s in samples if created < s.timestamp.timestamp() < asked - FRESH_SECONDS]
    assert timed, [s.timestamp for s in samples]


def test_a_paused_sandbox_gets_no_new_samples(sbx: Sandbox) -> None:
    sbx.get_metrics()
    sbx.pause()
    kept = sbx.get_metrics()  # after the pause: the timer adds none from here on
    time.sleep(FRESH_SECONDS + 0.5)
    assert sbx.get_metrics() == kept


async def test_the_async_client(server: Server) -> None:
    sandbox = await AsyncSandbox.create()
    try:
        [sample] = await sandbox.get_metrics()
        assert sample.mem_total == MEMORY_MB * MIB
        again = await AsyncSandbox.get_metrics(sandbox.sandbox_id, end=datetime.now(UTC))
        assert again[0] == sample  # the timer may have added one since
    finally:
        await sandbox.kill()


def test_many_sandboxes_newest_sample_each(server: Server, sbx: Sandbox) -> None:
    other = Sandbox.create()
    try:
        client = get_api_client(ConnectionConfig())
        unknown = "ses_00000000000000000000000000"
        ids = [sbx.sandbox_id, other.sandbox_id, unknown]
        got = get_sandboxes_metrics.sync_detailed(client=client, sandbox_ids=ids)
        assert got.status_code == 200, got.content
        found = got.parsed.sandboxes  # type: ignore[union-attr]
        assert set(found) == {sbx.sandbox_id, other.sandbox_id}  # an unknown id is left out
        assert found[other.sandbox_id]["memTotal"] == MEMORY_MB * MIB
        too_many = [f"ses_{i:026d}" for i in range(MAX_METRICS_IDS + 1)]
        refused = get_sandboxes_metrics.sync_detailed(client=client, sandbox_ids=too_many)
        assert refused.status_code == 400 and f"at most {MAX_METRICS_IDS}" in refused.content.decode()
        at_most = get_sandboxes_metrics.sync_detailed(client=client, sandbox_ids=too_many[:-1])
        assert at_most.status_code == 200 and at_most.parsed.sandboxes == {}  # type: ignore[union-attr]
    finally:
        other.kill()


def test_bad_queries_are_400_and_an_unknown_sandbox_404(server: Server, sbx: Sandbox) -> None:
    with httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY}) as http:
        for query in ("start=soon", "end=-1", "start=²", "start=20&end=10"):
            answer = http.get(f"/sandboxes/{sbx.sandbox_id}/metrics?{query}")
            assert answer.status_code == 400 and answer.json()["code"] == 400, (query, answer.text)
        assert http.get("/sandboxes/metrics").status_code == 400
        assert http.get("/sandboxes?limit=²").status_code == 400
        missing = http.get("/sandboxes/ses_00000000000000000000000000/metrics")
        assert missing.status_code == 404 and "was not found" in missing.json()["message"]
    with pytest.raises(SandboxException):
        Sandbox.get_metrics("ses_00000000000000000000000000")


# --- the ring and the CPU share, on their own ---------------------------------------------


def usage(cpu_seconds: float, started_at: float = 1000.0, cpus: int = 1) -> Usage:
    return Usage(cpus, cpu_seconds, started_at, 1, 0, 2, 1, 2)


def test_the_ring_keeps_the_newest_max_samples() -> None:
    samples = Samples()
    for i in range(MAX_METRIC_SAMPLES):
        samples.add(usage(0.0), 1001.0 + i)
    assert len(samples.ring) == MAX_METRIC_SAMPLES and samples.ring[0].at == 1001.0
    samples.add(usage(0.0), 1001.0 + MAX_METRIC_SAMPLES)
    assert len(samples.ring) == MAX_METRIC_SAMPLES and samples.ring[0].at == 1002.0


def test_the_cpu_share_counts_from_the_previous_reading_of_the_same_lifetime() -> None:
    samples = Samples()
    assert samples.add(usage(1.0, cpus=2), 1002.0).cpu_used_pct == 25.0  # from the lifetime's start
    assert samples.add(usage(2.5, cpus=2), 1003.0).cpu_used_pct == 75.0  # 1.5 s of 2 CPUs in 1 s
    assert samples.add(usage(0.5, started_at=1010.0), 1011.0).cpu_used_pct == 50.0  # a new lifetime
    assert samples.add(usage(9.0, started_at=1010.0), 1012.0).cpu_used_pct == 100.0  # at most all of it


# --- what a sandbox's usage is read from ----------------------------------------------------

#: A host process that, once told to go, holds BUSY_MB and spins until it has used BUSY_CPU
#: seconds of CPU (not of wall time: on a loaded machine a second of spinning gets less), then
#: says so.
BUSY_MB = 64
BUSY_CPU = 0.6
BUSY = f"""import sys, time
sys.stdin.readline()
held = bytearray({BUSY_MB} * 2**20)
start = time.process_time()
while time.process_time() - start < {BUSY_CPU}:
    pass
print("done", flush=True)
time.sleep(60)
"""


def spinner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def run_to_done(busy: subprocess.Popen[bytes]) -> None:
    assert busy.stdin is not None and busy.stdout is not None
    busy.stdin.write(b"go\n")
    busy.stdin.flush()
    assert busy.stdout.readline() == b"done\n"


def test_without_a_cgroup_the_processes_are_read_from_proc(tmp_path: Path) -> None:
    busy = spinner()
    try:
        run_to_done(busy)
        got = measure(None, [busy.pid], Limits(), tmp_path, time.time())
        assert got.cpu_seconds >= 0.5 and got.memory_used >= BUSY_MB * MIB and got.memory_cache == 0
        # Nothing limits such a sandbox: the totals are the host's.
        assert (got.cpu_count, got.memory_total) == (os.cpu_count(), host_memory())
        assert got.disk_total > got.disk_used >= 0
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(Cgroups().version == "none", reason="no cgroups on this host")
def test_a_cgroup_counts_cpu_and_memory_against_its_limits(tmp_path: Path) -> None:
    # Named as a sandbox's group (`<id>-<owner token>`) of this live process: a server starting
    # meanwhile sweeps any group whose owner is gone, and would kill the spinner.
    name = f"metricstest{uuid.uuid4().hex[:8]}-{owner_token()}"
    group = Cgroups().create(name, Limits(memory_bytes=256 * MIB, cpus=2))
    assert group is not None
    busy = spinner()
    try:
        group.add(busy.pid)  # before it spins and allocates: all of that is charged to the group
        run_to_done(busy)
        got = measure(group, [], Limits(memory_bytes=256 * MIB, cpus=2), tmp_path, time.time())
        assert got.cpu_seconds >= 0.5 and BUSY_MB * MIB <= got.memory_used < 256 * MIB
        assert (got.cpu_count, got.memory_total) == (2, 256 * MIB)
    finally:
        busy.kill()
        busy.wait()
        group.destroy()
