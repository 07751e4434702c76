"""A sandbox's `user` account: uid 1000, home /home/user, beside the sandbox's root.

E2B's SDK and the programs people run take an ordinary account for granted: commands run as
`user` unless `root` is asked for, `~` is /home/user, and some programs refuse to run as root
at all (PostgreSQL's `initdb`, Chromium's own sandbox). A sandbox's processes are root of
their own user namespace, which maps that root to one host uid. A second account cannot get a
host uid of its own without a privileged helper (newuidmap) and a second owner of every file,
so it is a user namespace nested in the sandbox's, mapping uid and gid 1000 to the sandbox's
root: the same host uid, seen as 1000 from inside it.

What that gives, and what it does not:

- `id`, `whoami`, `$HOME`, `$USER` say `user`, 1000, /home/user; files the account makes are
  the sandbox root's files (and the other way round: each sees the other's files as its own).
  The host, the hostview checks and the disk quota see one owner, as before.
- Little privilege between the two. Root of a sandbox holds no capability (bwrap drops them
  all), and the account's processes are the same host uid, so either reads and writes every
  file the other can. The account cannot reach root's processes (no ptrace, no /proc/<pid>/ns
  of theirs: the kernel asks for a capability over their namespace, which it lacks), nor enter
  the sandbox's namespace again (tested). The boundary is the sandbox, as in E2B, whose `user`
  has passwordless `sudo`.
- The namespace is made once per sandbox lifetime, on first use, by host programs
  (`nsenter`, `unshare`) run as the sandbox uid, never root: they join the sandbox's user
  namespace only (not its mounts), nest the account's in it and hand it to the exec agent.
  The kernel lets a namespace map its parent's root only if its creator could set file
  capabilities there (`CAP_SETFCAP`, since Linux 5.12); the sandbox's processes cannot, so the
  server's helper does it, holding that capability in the sandbox's namespace only, in a
  process of its own outside the sandbox's mounts and pids, for the moment it takes.
- A command as the account starts as `nsenter --user=/proc/self/fd/3 --preserve-credentials`
  (the agent puts the namespace at fd 3), so it costs one exec more than a root command.
- The account's entry in /etc/passwd and /etc/group and its home are made inside, by a root
  command. Where /etc is read-only (the host-based root without a system layer) the account
  still runs as 1000 with its home, but has no name there (`id -un` fails), and no `sudo`.
"""

from __future__ import annotations

import os
import posixpath
import select
import shlex
import subprocess
from pathlib import Path

from agentbox.machines.errors import MachineUnavailable

#: The account's name (E2B's default user), its uid and gid inside, and its home.
ACCOUNT_NAME = "user"
ACCOUNT_ID = 1000
ACCOUNT_HOME = "/home/user"
#: The name of the sandbox's own identity, which a command may also ask for.
ROOT_NAME = "root"
#: How long making the namespace and the account's files may take before it counts as failed.
ACCOUNT_SETUP_SECONDS = 20.0
#: The descriptor a command as the account finds its namespace at.
NAMESPACE_FD = 3
#: Inside the sandbox: what runs a command as the account (util-linux, in every image).
ENTER_ACCOUNT = ("/usr/bin/nsenter", f"--user=/proc/self/fd/{NAMESPACE_FD}", "--preserve-credentials", "--")

_PASSWD = f"{ACCOUNT_NAME}:x:{ACCOUNT_ID}:{ACCOUNT_ID}:{ACCOUNT_NAME}:{ACCOUNT_HOME}:/bin/bash"
_GROUP = f"{ACCOUNT_NAME}:x:{ACCOUNT_ID}:"
#: `sudo` (`sudo_shim.py`) and its root broker (`sudo_broker.py`), installed where /usr can be
#: written (an image's layer); the broker listens on the shim's socket.
SUDO_PATH = "/usr/local/bin/sudo"
BROKER_PATH = "/usr/local/lib/agentbox/sudo-broker.py"
SUDO_SOCKET = "/run/agentbox-sudo"
SUDO_SOURCE = (Path(__file__).parent / "sudo_shim.py").read_bytes()
BROKER_SOURCE = (Path(__file__).parent / "sudo_broker.py").read_bytes()
#: The exit of SETUP_SCRIPT when /usr/local cannot be written: an account, but no sudo.
NO_SUDO_EXIT = 3
#: One command as the sandbox's root: the account's entries (once), its home, then the broker
#: and `sudo`, read from stdin (SETUP_INPUT), each replaced whole.
SETUP_SCRIPT = (
    f"grep -q '^{ACCOUNT_NAME}:' /etc/passwd || echo {shlex.quote(_PASSWD)} >> /etc/passwd\n"
    f"grep -q '^{ACCOUNT_NAME}:' /etc/group || echo {shlex.quote(_GROUP)} >> /etc/group\n"
    f"mkdir -p {ACCOUNT_HOME} || exit 1\n"
    "mkdir -p /run 2>/dev/null\n"
    f"mkdir -p {posixpath.dirname(BROKER_PATH)} 2>/dev/null && [ -w {posixpath.dirname(SUDO_PATH)} ] || exit {NO_SUDO_EXIT}\n"
    f"head -c {len(BROKER_SOURCE)} > {BROKER_PATH}.new && cat > {SUDO_PATH}.new || exit 1\n"
    f"chmod 755 {BROKER_PATH}.new {SUDO_PATH}.new && mv -f {BROKER_PATH}.new {BROKER_PATH} && mv -f {SUDO_PATH}.new {SUDO_PATH}\n"
)
SETUP_INPUT = BROKER_SOURCE + SUDO_SOURCE
#: What starts the broker (as root): the image's python, as the shim's `#!` line says.
BROKER_ARGV = ("/usr/bin/python3", "-I", "-S", BROKER_PATH, SUDO_SOCKET)


def nest_argv(sandbox_namespace_fd: int) -> list[str]:
    """Host argv (before dropping to the sandbox uid): nest the account's namespace in the
    sandbox's (passed at `sandbox_namespace_fd`), say `ready` and wait on stdin, so the server
    can open `/proc/<pid>/ns/user` before the process goes."""
    return [
        "nsenter", f"--user=/proc/self/fd/{sandbox_namespace_fd}", "--preserve-credentials", "--",
        "unshare", "--user", f"--map-user={ACCOUNT_ID}", f"--map-group={ACCOUNT_ID}", "--",
        "/bin/sh", "-c", "echo ready; read _",
    ]  # fmt: skip


#: What login(1) sets for the account, in place of root's.
ACCOUNT_ENV = {"HOME": ACCOUNT_HOME, "USER": ACCOUNT_NAME, "LOGNAME": ACCOUNT_NAME}


def nested_namespace(launch: list[str], parent: int, env: dict[str, str]) -> int:
    """Run `launch` (`nest_argv`, as the sandbox uid) and open the namespace it made; blocking."""
    proc = subprocess.Popen(
        launch,
        pass_fds=[parent],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        readable, _, _ = select.select([proc.stdout], [], [], ACCOUNT_SETUP_SECONDS)
        if not readable or proc.stdout.readline() != b"ready\n":
            proc.kill()
            detail = proc.stderr.read().decode(errors="replace").strip()[-500:]
            raise MachineUnavailable(f"could not nest the {ACCOUNT_NAME!r} account's namespace: {detail}")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)  # alive: waits on stdin
    finally:
        proc.stdin.close()
        proc.wait(ACCOUNT_SETUP_SECONDS)
        proc.stdout.close()
        proc.stderr.close()
