"""A sandbox's `user` account (`machines/account.py`), on real sandboxes of both roots.

A command as `user` runs in a user namespace nested in the sandbox's: uid and gid 1000,
home /home/user, the same host owner as the sandbox's root. The attacks: a command as
the account tries to become root again (entering the sandbox's own namespace, `setuid(0)`),
and a name the sandbox has no account for is refused, not run as root.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from pathlib import Path

import pytest
from conftest import SandboxFactory

from agentbox.machines.account import ACCOUNT_HOME, ACCOUNT_ID, SUDO_SOCKET
from agentbox.machines.base import ExecRequest, TerminalSize, collect
from agentbox.machines.errors import OwnerUnsupported
from agentbox.machines.sandbox import SandboxMachine
from agentbox.machines.sudo_broker import MAX_REQUEST

FACTORIES = ["make_sandbox", "make_image_sandbox"]


@pytest.fixture(params=FACTORIES)
def make_box(request: pytest.FixtureRequest) -> SandboxFactory:
    """A sandbox on the host's /usr, and one on the `base` image."""
    factory: SandboxFactory = request.getfixturevalue(request.param)
    return factory


@pytest.fixture
async def box(make_box: SandboxFactory) -> SandboxMachine:
    return await make_box()


async def run(box: SandboxMachine, command: str, user: str | None = "user") -> tuple[int, str, str]:
    result = await box.exec(ExecRequest(command=command, user=user, timeout=20))
    return result.exit_code, result.stdout.decode(), result.stderr.decode()


async def test_a_command_as_user_is_uid_1000_with_its_home(box: SandboxMachine) -> None:
    code, out, err = await run(box, 'id -u; id -g; id -un; echo "$HOME $USER $LOGNAME"; cd ~ && pwd')
    assert code == 0, err
    assert out.split("\n")[:5] == [
        str(ACCOUNT_ID),
        str(ACCOUNT_ID),
        "user",
        f"{ACCOUNT_HOME} user user",
        ACCOUNT_HOME,
    ]


async def test_root_stays_root_and_none_means_root(box: SandboxMachine) -> None:
    for user in ("root", None):
        code, out, _ = await run(box, "id -u; id -un; echo $HOME", user=user)
        assert code == 0
        assert out.split("\n")[:2] == ["0", "root"]


async def test_each_sees_the_others_files_as_its_own(box: SandboxMachine) -> None:
    code, _, err = await run(box, "echo mine > /workspace/by-user && mkdir -p ~/proj && echo x > ~/proj/f")
    assert code == 0, err
    code, out, _ = await run(box, "stat -c %u /workspace/by-user; cat /workspace/by-user", user="root")
    assert (code, out) == (0, "0\nmine\n")
    await run(box, "echo rooted > /workspace/by-root", user="root")
    code, out, _ = await run(
        box, "stat -c %u /workspace/by-root; echo more >> /workspace/by-root; cat /workspace/by-root"
    )
    assert (code, out) == (0, f"{ACCOUNT_ID}\nrooted\nmore\n")
    # one owner on the host: the sandbox uid, whoever made the file inside
    host = os.stat(box.workspace / "by-user")
    assert (host.st_uid, host.st_gid) == box.owner


async def test_the_account_stays_in_its_namespace(box: SandboxMachine) -> None:
    """Entering the sandbox's namespace through a root process's /proc entry fails: the account
    holds no capability over its parent, so it cannot reach root's processes. (Its files are
    another matter: both are the same host uid, see `machines/account.py`.)"""
    root = await box.spawn(ExecRequest(command="exec sleep 30", user="root"))
    try:
        pid = (await run(box, "pgrep -x sleep", user="root"))[1].split()[0]
        code, out, err = await run(box, f"nsenter --user=/proc/{pid}/ns/user --preserve-credentials id -u")
        assert code != 0 and out == "", (out, err)
        assert "Permission denied" in err or "Operation not permitted" in err
        code, out, _ = await run(box, "python3 -c 'import os; os.setuid(0)' 2>&1 | tail -1; id -u")
        assert "Invalid argument" in out and out.endswith(f"{ACCOUNT_ID}\n")  # uid 0 has no mapping here
    finally:
        root.kill()


async def test_the_helper_leaves_nothing_on_the_host(box: SandboxMachine) -> None:
    """The account's namespace is nested by host programs run as the sandbox uid: once made,
    none of them is left running outside the sandbox."""
    assert (await run(box, "id -u"))[0] == 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            assert b"echo ready; read _" not in cmdline


async def test_an_unknown_account_is_refused_not_run_as_root(box: SandboxMachine) -> None:
    with pytest.raises(OwnerUnsupported, match="no user 'postgres'"):
        await box.exec(ExecRequest(command="touch /workspace/ran", user="postgres"))
    assert not (box.workspace / "ran").exists()


async def test_the_account_on_a_terminal(box: SandboxMachine) -> None:
    process = await box.spawn(
        ExecRequest(
            command="id -un; tty >/dev/null && echo tty", user="user", pty=TerminalSize(rows=24, cols=80)
        )
    )
    result = await collect(process, 1 << 16, 20)
    assert result.exit_code == 0
    assert result.stdout.replace(b"\r", b"").split(b"\n")[:2] == [b"user", b"tty"]


async def test_first_uses_at_once_share_one_account(box: SandboxMachine) -> None:
    results = await asyncio.gather(*(run(box, "id -u") for _ in range(6)))
    assert {(code, out) for code, out, _ in results} == {(0, f"{ACCOUNT_ID}\n")}
    code, out, _ = await run(box, "grep -c '^user:' /etc/passwd", user="root")
    assert (code, out) == (0, "1\n")


async def test_a_new_lifetime_makes_the_account_again(box: SandboxMachine) -> None:
    assert (await run(box, "id -u"))[1] == f"{ACCOUNT_ID}\n"
    await box.stop()
    await box.start()
    code, out, err = await run(box, "id -un")
    assert (code, out) == (0, "user\n"), err


async def test_sudo_runs_a_command_as_root_and_returns_its_exit_code(
    make_image_sandbox: SandboxFactory,
) -> None:
    """On an image (its /usr is the sandbox's layer) the account gets a passwordless `sudo`."""
    box = await make_image_sandbox()
    code, out, err = await run(
        box, "sudo id -u; sudo -u user id -u; sudo sh -c 'echo $HOME; exit 7'; echo rc=$?"
    )
    assert (code, out) == (0, f"0\n{ACCOUNT_ID}\n/root\nrc=7\n"), err
    code, out, _ = await run(box, "echo typed | sudo cat; sudo -i pwd; sudo -n true && sudo -l | tail -1")
    assert out == "typed\n/root\n    (ALL) NOPASSWD: ALL\n"
    code, _, err = await run(box, "sudo /no/such/program")
    assert code == 127 and "No such file" in err
    code, _, err = await run(box, "sudo --bogus true")
    assert code == 1 and "unknown option" in err


async def test_a_killed_sudo_kills_its_root_command(make_image_sandbox: SandboxFactory) -> None:
    box = await make_image_sandbox()
    process = await box.spawn(ExecRequest(command="exec sudo sleep 300", user="user"))
    async with asyncio.timeout(20):
        while (await run(box, "pgrep -x sleep", user="root"))[0] != 0:
            await asyncio.sleep(0.05)
    process.kill()
    async with asyncio.timeout(20):
        while (await run(box, "pgrep -x sleep", user="root"))[0] == 0:
            await asyncio.sleep(0.05)


async def test_sudo_on_the_hosts_usr_under_the_system_layer(make_sandbox: SandboxFactory) -> None:
    box = await make_sandbox()
    code, out, err = await run(box, "id -un; sudo id -un")
    assert (code, out) == (0, "user\nroot\n"), err


async def test_sudo_i_keeps_its_arguments_apart(make_image_sandbox: SandboxFactory) -> None:
    """`sudo -i cmd args` runs through a login shell with each argument quoted, as sudo does."""
    box = await make_image_sandbox()
    code, out, err = await run(box, "sudo -i echo 'a;b' 'c  d'; sudo -s printf '%s|' 'x y' '$HOME'")
    assert (code, out) == (0, "a;b c  d\nx y|$HOME|"), err


async def test_sudo_requests_are_bounded_at_the_brokers_limit(make_image_sandbox: SandboxFactory) -> None:
    """Up to MAX_REQUEST bytes (argv and environment) a command runs; past it the shim refuses
    clearly, and the broker refuses a longer message itself rather than run a cut one."""
    box = await make_image_sandbox()
    under = MAX_REQUEST - 16 * 1024  # room for the environment
    code, out, err = await run(box, f"sudo printf %s $(head -c {under} /dev/zero | tr '\\0' a) | wc -c")
    assert (code, out.strip()) == (0, str(under)), err
    half = f"$(head -c {MAX_REQUEST // 2 + 1} /dev/zero | tr '\\0' a)"  # two: one argument has its own cap
    code, _, err = await run(box, f"sudo true {half} {half}")
    assert code == 1 and "sudo: argument list too long" in err, err
    raw = (
        f"import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect({SUDO_SOCKET!r}); "
        f"socket.send_fds(s, [b'/' + b'x' * {MAX_REQUEST}], [0, 1, 2]); "
        "print(s.recv(4096).split(b'\\0')[0].decode())"
    )
    code, out, err = await run(box, f"python3 -c {shlex.quote(raw)}")
    assert (code, out) == (0, "E\n"), err
