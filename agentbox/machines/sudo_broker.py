"""`sudo` for a sandbox's `user` account: the broker, a root process inside the sandbox.

The account (`machines/account.py`) lives in a user namespace nested in the sandbox's and
cannot leave it, so no setuid program could take it back to root (and none exists: the
sandbox's seccomp filter refuses setuid bits). This broker runs as the sandbox's root, started
with the account, and listens on a unix socket; the `sudo` program (`sudo_shim.py`) connects,
sends the command and its stdin, stdout and stderr as descriptors, and gets the exit code
back. Anyone inside may connect, as E2B's `user` has passwordless sudo; it gives nothing the
sandbox's root does not have, and root holds no capability.

A request is one SEQPACKET message, NUL-separated: `cwd argc argv... KEY=VALUE...` with three
descriptors. The reply: `X code` (128+N for signal N) or `E errno message`. Each request is
served by a forked child of the broker; when the client goes away (the `sudo` process was
killed) the command's process group is killed. Standard library only; runs as
`python3 -I -S sudo_broker.py SOCKET`.
"""

import errno
import os
import select
import signal
import socket
import sys

#: Bytes of one request (argv and environment); a longer one is refused with E2BIG, never cut.
#: Within what one SEQPACKET message may carry on a socket of the default send buffer (208 KiB).
MAX_REQUEST = 128 * 1024
STDIO = 3


def serve(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers reap themselves
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                handle(conn)
            finally:
                os._exit(0)
        conn.close()


def handle(conn):
    data, fds, flags, _addr = socket.recv_fds(conn, MAX_REQUEST, STDIO)
    if len(fds) != STDIO or not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        conn.send(b"E\0%d\0a request of over %d bytes, or without its stdio" % (errno.E2BIG, MAX_REQUEST))
        return
    fields = data.split(b"\0")
    cwd, argc = fields[0], int(fields[1])
    argv = fields[2 : 2 + argc]
    env = dict(kv.split(b"=", 1) for kv in fields[2 + argc :] if b"=" in kv)
    try:
        try:
            os.chdir(cwd)
        except OSError:
            os.chdir("/")
        actions = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds)]
        pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setpgroup=0)
    except OSError as exc:
        conn.send(b"E\0%d\0%s" % (exc.errno or 0, (exc.strerror or str(exc)).encode()))
        return
    finally:
        for fd in fds:
            os.close(fd)
    ended = os.pidfd_open(pid)
    readable, _, _ = select.select([conn, ended], [], [])
    if ended not in readable:  # the client went away first
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        conn.send(b"X\0%d" % (128 - code if code < 0 else code))
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])
