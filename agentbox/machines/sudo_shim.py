#!/usr/bin/python3 -IS
"""sudo for a sandbox's `user` account: asks the root broker (`sudo_broker.py`) to run it.

Installed as /usr/local/bin/sudo in sandboxes whose /usr can be written (an image's layer).
Passwordless, as E2B's `user` has it. Options: `-u root|user`, `-i` (a login shell, or the
command through one), `-s`, and `-E`, `-H`, `-n`, `-S`, `-k`, `-v`, `-l`, which change
nothing here; the command gets the caller's environment with root's HOME, USER and LOGNAME
(`-E` keeps HOME). Run as root, or with `-u user`, it simply runs the command.
"""

import os
import shlex
import socket
import sys
import time

SOCKET = "/run/agentbox-sudo"
IGNORED = set("EHnSkv")
#: Seconds to wait for the broker's socket (it starts with the account, beside the first command).
CONNECT_SECONDS = 5.0
#: The broker's MAX_REQUEST (`sudo_broker.py`): a longer command and environment are refused here.
MAX_REQUEST = 128 * 1024
USAGE = "usage: sudo [-EHnSikslv] [-u root|user] [--] command [args...]"


def parse(args):
    """(user, login, shell, keep_home, argv) from sudo's command line."""
    user, login, shell, keep_home, listing = "root", False, False, False, False
    while args and args[0].startswith("-") and args[0] != "-":
        arg = args.pop(0)
        if arg == "--":
            break
        if arg.startswith("--"):
            raise SystemExit(f"sudo: unknown option {arg}\n{USAGE}")
        flags = arg[1:]
        while flags:
            flag, flags = flags[0], flags[1:]
            if flag == "u":
                if not flags and not args:
                    raise SystemExit(f"sudo: -u needs a user\n{USAGE}")
                user, flags = (flags, "") if flags else (args.pop(0), "")
            elif flag == "i":
                login = True
            elif flag == "s":
                shell = True
            elif flag == "l":
                listing = True
            elif flag in IGNORED:
                keep_home = keep_home or flag == "E"
            else:
                raise SystemExit(f"sudo: unknown option -{flag}\n{USAGE}")
    if listing:
        print("User may run the following commands on this sandbox:\n    (ALL) NOPASSWD: ALL")
        raise SystemExit(0)
    if user not in ("root", "0", "user", "1000"):
        raise SystemExit(f"sudo: unknown user {user}")
    return user in ("root", "0"), login, shell, keep_home, args


def command_of(login, shell, args):
    if login:
        return ["/bin/bash", "-l", "-c", shlex.join(args)] if args else ["/bin/bash", "-l"]
    if shell:
        return ["/bin/bash", "-c", shlex.join(args)] if args else ["/bin/bash"]
    if not args:
        raise SystemExit(USAGE)
    return args


def connect():
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(SOCKET)
            return conn
        except OSError as exc:
            conn.close()
            if time.monotonic() > deadline:
                raise SystemExit(f"sudo: the sandbox's sudo broker is not running ({exc.strerror})") from None
            time.sleep(0.02)


def main():
    as_root, login, shell, keep_home, args = parse(sys.argv[1:])
    argv = command_of(login, shell, args)
    if not as_root or os.getuid() == 0:
        os.execvp(argv[0], argv)
    env = dict(os.environ, USER="root", LOGNAME="root")
    if not keep_home or login:
        env["HOME"] = "/root"
    cwd = "/root" if login else os.getcwd()
    fields = [cwd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]
    request = "\0".join(fields).encode("utf-8", "surrogateescape")
    if len(request) > MAX_REQUEST:
        raise SystemExit(
            f"sudo: argument list too long: {len(request)} bytes with the environment, over {MAX_REQUEST}"
        )
    conn = connect()
    socket.send_fds(conn, [request], [0, 1, 2])
    reply = conn.recv(4096).split(b"\0")
    if reply[0] == b"X":
        raise SystemExit(int(reply[1]))
    if reply[0] == b"E":
        message = reply[2].decode(errors="replace")
        print(f"sudo: {argv[0]}: {message}", file=sys.stderr)
        raise SystemExit(127 if int(reply[1]) == 2 else 126)
    raise SystemExit("sudo: the broker gave no answer")


if __name__ == "__main__":
    main()
