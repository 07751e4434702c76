"""The exec agent: one long-lived process inside each live sandbox that starts commands.

Spawning a fresh bubblewrap per command costs ~5 ms; asking a process that already lives
inside the namespaces costs one `posix_spawn`. The server talks to this agent over a
SOCK_SEQPACKET socket (message boundaries kept, file descriptors passed along). Messages
are NUL-separated fields, so the agent needs no json import (its start-up time is part of
every sandbox's cold start):

    server -> agent   S id cwd argc argv... KEY=VALUE...   + fds: stdout, stderr[, stdin]
    agent -> server   P id pid        spawned
                      E id errno msg  could not spawn
                      X id code       exited (128+N for signal N)
    server -> agent   K id signal     signal the command's process group
                      G pgid signal   signal a group whose leader has already exited
    agent -> server   R               ready, once at start

The server creates each command's pipes and reads them itself, so output never passes
through this process. Each command leads its own session and process group. When the
socket closes, the agent kills every command and exits, and the sandbox ends with it.

The socket's descriptor number is the first argument. This file runs with the sandbox's
`python3 -I -S`: standard library only, nothing from agentbox, old Python 3 versions too.
"""

import _socket
import os
import select
import sys

MAX_MESSAGE = 1 << 20
#: Received descriptors arrive close-on-exec: a command gets only its own stdin/out/err.
MSG_CMSG_CLOEXEC = 0x40000000
FD_SIZE = 4


def main():
    ctl = _socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(ctl.fileno(), False)  # commands must never reach the control channel
    poller = select.epoll()
    poller.register(ctl.fileno(), select.EPOLLIN)
    devnull = os.open("/dev/null", os.O_RDWR)
    children = {}  # pidfd -> (command id, pid)
    by_id = {}  # command id -> pid

    def send(*fields):
        ctl.send(b"\0".join(f if isinstance(f, bytes) else str(f).encode() for f in fields))

    def spawn(fields, fds):
        cid, cwd, argc = fields[1], fields[2], int(fields[3])
        argv = fields[4 : 4 + argc]
        env = dict(kv.split(b"=", 1) for kv in fields[4 + argc :] if b"=" in kv)
        stdin = fds[2] if len(fds) > 2 else devnull
        try:
            os.chdir(cwd)
            actions = [
                (os.POSIX_SPAWN_DUP2, stdin, 0),
                (os.POSIX_SPAWN_DUP2, fds[0], 1),
                (os.POSIX_SPAWN_DUP2, fds[1], 2),
            ]
            pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
        except OSError as exc:
            send(b"E", cid, exc.errno or 0, exc.strerror or str(exc))
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        children[pidfd] = (cid, pid)
        by_id[cid] = pid
        poller.register(pidfd, select.EPOLLIN)
        send(b"P", cid, pid)

    def reap(pidfd):
        cid, pid = children.pop(pidfd)
        poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        by_id.pop(cid, None)
        send(b"X", cid, 128 - code if code < 0 else code)

    def receive():
        data, ancdata, _flags, _addr = ctl.recvmsg(MAX_MESSAGE, 64, MSG_CMSG_CLOEXEC)
        fds = []
        for level, kind, payload in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % FD_SIZE
                fds += [
                    int.from_bytes(payload[i : i + FD_SIZE], sys.byteorder) for i in range(0, usable, FD_SIZE)
                ]
        return data, fds

    send(b"R")
    while True:
        for fd, _ in poller.poll():
            if fd in children:
                reap(fd)
                continue
            data, fds = receive()
            if not data:
                for _cid, pid in children.values():
                    try:
                        os.killpg(pid, 9)
                    except OSError:
                        pass
                return
            fields = data.split(b"\0")
            if fields[0] == b"S":
                spawn(fields, fds)
            elif fields[0] == b"G":  # a group whose leader already exited (children remain)
                try:
                    os.killpg(int(fields[1]), int(fields[2]))
                except OSError:
                    pass
            elif fields[0] == b"K":
                target = by_id.get(fields[1])
                if target is not None:
                    try:
                        os.killpg(target, int(fields[2]))
                    except OSError:
                        pass


if __name__ == "__main__":
    main()
