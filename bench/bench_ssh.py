"""The ssh machine kind beside raw asyncssh on the same connection, against a real sshd on loopback.

    python bench/bench_ssh.py [--quick] [--json out.json]

The sshd is the tests' (tests/conftest.py `start_sshd`: its own host and user keys in a
scratch directory, a free loopback port), logging in as the tests' user (SSH_USER, login
shell /bin/sh) when run as root. Every raw reference runs on the machine's own pooled
connection and its own SFTP channel, so the ratio is what the machine adds: the checks in
the login shell, `env -i` and the pid marker, the pool, the temp-and-rename of a write. A
machine and its references are timed in interleaved rounds, so a burst of load weighs on both.
README.md in this folder explains each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from figures import Figure, Target, arg_parser, footer, latency_figure, scratch_dir, table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import start_sshd, stop_sshd

from agentbox.machines.base import ExecRequest
from agentbox.machines.ssh import SshMachine, SshOptions

#: What an exec through the machine may cost against a raw channel exec on the same connection.
EXEC_TARGET = Target(1.3, "ratio")
#: Bytes of the file read and written.
FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Counts:
    """How many rounds each pair of figures is sampled (full run, or `--quick` for the smoke test)."""

    exec_samples: int = 200
    exec_warmup: int = 20
    file_samples: int = 50
    file_warmup: int = 5


QUICK = Counts(exec_samples=5, exec_warmup=1, file_samples=3, file_warmup=1)

Call = Callable[[], Awaitable[object]]


async def rounds(calls: dict[str, Call], samples: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each call per round, the calls taking turns within every round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for n in range(warmup + samples):
        for name, call in calls.items():
            started = time.perf_counter()
            await call()
            if n >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


async def exec_figures(machine: SshMachine, counts: Counts) -> list[Figure]:
    conn = machine.pool.live()[0].conn

    async def ssh_true() -> None:
        assert (await machine.exec(ExecRequest(command="true"))).exit_code == 0

    async def ssh_argv_true() -> None:
        assert (await machine.exec(ExecRequest(argv=("true",)))).exit_code == 0

    def raw(command: str) -> Call:
        async def call() -> None:
            assert (await conn.run(command)).exit_status == 0

        return call

    calls = {
        "ssh": ssh_true, "argv": ssh_argv_true, "raw_sh": raw("/bin/sh -c true"),
        "raw_bin": raw("exec /bin/true"), "raw_builtin": raw("true"),
    }  # fmt: skip
    times = await rounds(calls, counts.exec_samples, counts.exec_warmup)
    median = {name: statistics.median(samples) for name, samples in times.items()}

    def beside_builtin(name: str) -> dict[str, float]:
        return {"ratio_to_builtin_true": median[name] / median["raw_builtin"]}

    return [
        latency_figure("raw_channel_builtin_true", "raw channel: true (a shell builtin)", times["raw_builtin"]),
        latency_figure("raw_channel_sh_true", "raw channel: /bin/sh -c true", times["raw_sh"]),
        latency_figure(
            "ssh_exec_true", "ssh machine exec: command true", times["ssh"], raw_label="raw sh -c true",
            raw_seconds=median["raw_sh"], target=EXEC_TARGET, extra=beside_builtin("ssh"),
        ),
        latency_figure("raw_channel_bin_true", "raw channel: exec /bin/true", times["raw_bin"]),
        latency_figure(
            "ssh_exec_argv_true", "ssh machine exec: argv true", times["argv"], raw_label="raw /bin/true",
            raw_seconds=median["raw_bin"], target=EXEC_TARGET, extra=beside_builtin("argv"),
        ),
    ]  # fmt: skip


async def file_figures(machine: SshMachine, remote: Path, counts: Counts) -> list[Figure]:
    sftp = await machine.sftp_client()
    data = os.urandom(FILE_BYTES)
    path = str(remote / "bench-1m.bin")
    raw_path = str(remote / "bench-1m-raw.bin")
    await machine.write(path, data)
    await machine.write(raw_path, data)

    async def ssh_read() -> None:
        assert len(await machine.read(path)) == FILE_BYTES

    async def raw_read() -> None:
        async with sftp.open(raw_path, "rb") as f:
            assert len(await f.read()) == FILE_BYTES

    async def ssh_write() -> None:
        await machine.write(path, data)

    async def raw_write() -> None:
        async with sftp.open(raw_path, "wb") as f:
            await f.write(data)

    async def ssh_stat() -> None:
        assert await machine.stat(path) is not None

    async def raw_stat() -> None:
        await sftp.stat(raw_path)

    calls = {"read": ssh_read, "raw_read": raw_read, "write": ssh_write, "raw_write": raw_write}
    times = await rounds(
        {**calls, "stat": ssh_stat, "raw_stat": raw_stat}, counts.file_samples, counts.file_warmup
    )
    assert Path(path).read_bytes() == data

    figures = []
    for name, label in (("read", "read 1 MiB"), ("write", "write 1 MiB (atomic)"), ("stat", "stat")):
        raw_key = f"raw_sftp_{name}" + ("_1m" if name != "stat" else "")
        figures.append(latency_figure(raw_key, f"raw SFTP: {label.split(' (')[0]}", times[f"raw_{name}"]))
        figures.append(
            latency_figure(
                f"ssh_{name}" + ("_1m" if name != "stat" else ""), f"ssh machine {label}", times[name],
                raw_label="raw SFTP", raw_seconds=statistics.median(times[f"raw_{name}"]),
            )
        )  # fmt: skip
    return figures


async def run(counts: Counts, scratch: Path) -> tuple[list[Figure], dict[str, object]]:
    sshd = start_sshd(scratch / "sshd")
    root = sshd.owned_dir(scratch / "remote")
    machine = SshMachine("bench", SshOptions.from_options(sshd.options(root=str(root))))
    try:
        await machine.start()
        figures = await exec_figures(machine, counts)
        figures += await file_figures(machine, root, counts)
        details = {"user": sshd.user, "counts": counts.__dict__, "connections": machine.connections}
    finally:
        await machine.close()
        stop_sshd(sshd)
    return figures, details


def parse(argv: list[str]) -> argparse.Namespace:
    return arg_parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    started = time.perf_counter()
    with scratch_dir("ssh") as tmp:
        figures, details = asyncio.run(run(counts, tmp))
    print(table(figures))
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_ssh", args.quick, figures, **details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
