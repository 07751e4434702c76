"""What a sandbox command can reach of the processes that run its sandbox.

pid 1 and the exec agent live inside the sandbox's pid namespace, so a command sees them
in /proc. Nothing of the server may be reachable through them: not their descriptors
(the server's log, the launcher log, the control socket) by /proc/<pid>/fd or by
`pidfd_getfd`, and not their memory or environment. A command's own descriptors are its
pipes and nothing else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.machines.base import ExecRequest
from tests.conftest import SandboxFactory, Server

#: Runs inside the sandbox with its python3: every process not of this command's own
#: session, what of it can be listed, opened, written or taken by pidfd_getfd.
PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438
mine = os.getsid(0)
report = {"own": {}, "foreign": {}}
for fd in os.listdir("/proc/self/fd"):
    try:
        report["own"][fd] = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        pass
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    pid = int(name)
    try:
        if os.getsid(pid) == mine:
            continue
    except OSError:
        continue
    entry = {"listed": [], "opened": [], "written": [], "taken": [], "environ": None}
    try:
        entry["listed"] = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError as exc:
        entry["list_errno"] = exc.errno
    for fd in range(64):
        for flags, key in ((os.O_RDONLY, "opened"), (os.O_WRONLY | os.O_APPEND, "written")):
            try:
                os.close(os.open(f"/proc/{pid}/fd/{fd}", flags))
                entry[key].append(fd)
            except OSError:
                pass
    try:
        entry["environ"] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        pass
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    entry["pidfd_open_errno"] = ctypes.get_errno() if pidfd < 0 else 0
    if pidfd >= 0:
        for fd in range(64):
            got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if got >= 0:
                entry["taken"].append([fd, os.readlink(f"/proc/self/fd/{got}")])
                os.close(got)
            else:
                entry.setdefault("getfd_errnos", []).append(ctypes.get_errno())
        os.close(pidfd)
    try:
        entry["cmdline"] = open(f"/proc/{pid}/cmdline", "rb").read()[:80].decode(errors="replace")
    except OSError:
        pass
    report["foreign"][pid] = entry
print(json.dumps(report))
"""


@pytest.fixture
def sandbox(server: Server) -> Iterator[httpx.Client]:
    import uuid

    with server.client() as http:
        http.base_url = httpx.URL(f"{server.url}/sandboxes/t-{uuid.uuid4().hex[:12]}")
        yield http


def run(http: httpx.Client, command: str) -> dict[str, Any]:
    reply = http.post("/v2/commands", json={"command": command, "timeout": 60}).json()
    assert reply["success"], reply
    data: dict[str, Any] = reply["data"]
    assert data["exit_code"] == 0, data
    return data


def probe(http: httpx.Client) -> dict[str, Any]:
    write = http.post("/v2/fs/write", json={"path": "/tmp/probe.py", "content": PROBE}).json()
    assert write["success"], write
    return dict(json.loads(run(http, "python3 /tmp/probe.py")["stdout"]))


def test_pid_1_and_the_agent_hold_nothing_a_command_can_reach(server: Server, sandbox: httpx.Client) -> None:
    report = probe(sandbox)
    foreign = report["foreign"]
    assert "1" in foreign, f"pid 1 is not visible to the probe: {report}"
    for pid, entry in foreign.items():
        assert entry["listed"] == [], f"pid {pid} lists its descriptors: {entry}"
        assert entry["opened"] == [] and entry["written"] == [], f"pid {pid} reopens: {entry}"
        assert entry["taken"] == [], f"pidfd_getfd took descriptors of pid {pid}: {entry}"
        assert entry["environ"] is None, f"pid {pid} shows its environment: {entry}"
        assert set(entry.get("getfd_errnos", [1])) == {1}, entry  # EPERM, not EBADF: nothing to probe


def test_a_command_holds_only_its_own_pipes(server: Server, sandbox: httpx.Client) -> None:
    report = probe(sandbox)
    for fd, target in report["own"].items():
        assert target.startswith(("pipe:", "/dev/null", "/proc/")), f"fd {fd} is {target}: {report['own']}"
    text = json.dumps(report)
    assert str(server.home) not in text and "server-" not in text and "launcher.log" not in text


async def test_a_failed_start_still_reports_bwraps_own_diagnostics(sandbox_tmp: Path) -> None:
    """bwrap's stderr is a pipe the server reads, no longer a file: its words still reach the error."""
    from agentbox.ids import SANDBOX, new_id
    from agentbox.machines.errors import MachineUnavailable
    from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine

    host = SandboxHost(sandbox_tmp / "home")
    host.python = "/nonexistent/python3"  # bwrap itself fails to exec the agent, and says why
    sandbox_id = new_id(SANDBOX)
    d = sandbox_tmp / sandbox_id
    m = SandboxMachine("sandbox", sandbox_id, host, SandboxConfig(network=False), d / "workspace", d / "run")
    with pytest.raises(MachineUnavailable, match=r"exited during start: .*/nonexistent/python3"):
        await m.start()
    assert m.state == "stopped"


#: Lists the zombies of the sandbox: what pid 1 (the agent) has not reaped.
ZOMBIES = (
    "for s in /proc/[0-9]*/stat; do read -r l < $s 2>/dev/null && case ${l##*) } in Z*) echo $s;; esac; done"
)


def test_the_agent_as_pid_1_reaps_orphans_and_shrugs_off_signals(sandbox: httpx.Client) -> None:
    import time

    from tests.conftest import SANDBOX_DEADLINE

    run(sandbox, "for i in 1 2 3 4 5; do sleep 0.01 & done; exit 0")  # orphans: their parent exits first
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while zombies := run(sandbox, ZOMBIES)["stdout"]:
        assert time.monotonic() < deadline, f"unreaped orphans: {zombies}"
        time.sleep(0.05)
    run(sandbox, "kill -INT 1; kill -TERM 1; kill -HUP 1; kill -KILL 1; true")
    assert run(sandbox, "echo alive")["stdout"] == "alive\n"


async def test_seen_from_the_host_the_agent_holds_only_null_its_pipe_and_its_socket(
    make_sandbox: SandboxFactory,
) -> None:
    """The same from outside (as root): what the agent, the sandbox's pid 1, has open."""
    m = await make_sandbox()
    # One command first: the agent closes what it handed over at `R` just after sending it,
    # and it serves a command only after that, so the listing below is never mid-close.
    assert (await m.exec(ExecRequest(argv=("true",)))).exit_code == 0
    agent = m._child_pid
    assert agent and f"NSpid:\t{agent}\t1" in Path(f"/proc/{agent}/status").read_text()  # it is pid 1
    held = {int(fd): os.readlink(f"/proc/{agent}/fd/{fd}") for fd in os.listdir(f"/proc/{agent}/fd")}
    assert held[0] == held[1] == "/dev/null" and held[2].startswith("pipe:"), held
    others = {fd: target for fd, target in held.items() if fd > 2}
    kinds = sorted(target.split(":")[0] for target in others.values())
    # the control socket, /dev/null for commands' stdin, epoll, the SIGCHLD wake-up pipe
    assert kinds == ["/dev/null", "anon_inode", "pipe", "pipe", "socket"], held
