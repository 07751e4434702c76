"""The exec agent: one long-lived process inside each live sandbox that starts commands.

Spawning a fresh bubblewrap per command costs ~5 ms; asking a process that already lives
inside the namespaces costs one `posix_spawn`. The server talks to this agent over a
SOCK_SEQPACKET socket (message boundaries kept, file descriptors passed along). Messages
are NUL-separated fields, so the agent needs no json import (its start-up time is part of
every sandbox's cold start):

    server -> agent   S id cwd argc argv... KEY=VALUE...   + fds: stdout, stderr[, stdin]
                      T id cwd rows cols argc argv... KEY=VALUE...   the same on a new pty
                      Su, Tu: the same, with the account's namespace at the child's fd 3
                      Sg, Sug: as S, Su, and the command's group is killed at its exit
                      A                                    + fd: the account's user namespace
    agent -> server   P id pid        spawned                 + fd, after T: the pty's master
                      E id errno msg  could not spawn
                      X id code       exited (128+N for signal N); after Sg, its group is
                                      already killed (SIGKILL) when this is sent
    server -> agent   K id signal     signal the command's process group
                      G pgid signal   signal a group whose leader has already exited
    agent -> server   R               ready, once at start     + fds: the directories named
                                                                 after the socket on the command
                                                                 line, opened here (O_PATH), then
                                                                 the agent's own user namespace

The server creates each command's pipes and reads them itself, so output never passes
through this process. A `T` command gets a pseudo-terminal instead, opened here, in the
machine's own devpts: its slave becomes the child's controlling terminal (`setsid`, then
`TIOCSCTTY`) and its stdin, stdout and stderr, sized with `TIOCSWINSZ` first; the master goes
to the server with `P`, which reads, writes and resizes it from then on. The child is forked
(posix_spawn cannot make a controlling terminal); its exec failure comes back on a
close-on-exec pipe as `E`. Only this path imports `fcntl` and `termios`. Each command leads
its own session and process group. When the socket closes, the agent kills every command and exits, and the sandbox ends with it.

The agent is the sandbox's pid 1 (bwrap `--as-pid-1`), so it also reaps what commands
leave behind: every child, its own commands and orphans alike, is collected with
`waitpid(-1, WNOHANG)` on SIGCHLD, and only its commands are reported. Before it says
ready it makes itself non-dumpable and closes every descriptor but stdin/out/err and the
socket, so a command can neither reopen nor `pidfd_getfd` what it holds, nor ptrace it.
As pid 1 it gets only the signals it handles: a command cannot kill it.

The first argument is the socket: the number of an inherited descriptor (a sandbox, whose
launcher made a socketpair), or the path of a unix socket the server listens on, which the
agent connects to (a container, which inherits nothing from the server). The rest are
directories that exist only inside the machine (its tmpfs `/tmp` and `$HOME`), which the agent
opens in its own view and hands to the server with `R`, so the server reaches them by
descriptor too. This file runs with the machine's `python3 -I -S`: standard library only,
nothing from agentbox, old Python 3 versions too.

The account (`machines/account.py`): a user namespace nested in the sandbox's, made by the
server, handed over once with `A` and kept here close-on-exec. A `Su` or `Tu` command gets it
as its fd 3, and the server's argv starts with `nsenter --user=/proc/self/fd/3`, which enters
it before running the command. The agent itself never enters it, and holds no capability.
"""

import _ctypes
import _signal
import _socket
import os
import select
import sys

MAX_MESSAGE = 1 << 20
#: Received descriptors arrive close-on-exec: a command gets only its own stdin/out/err.
MSG_CMSG_CLOEXEC = 0x40000000
FD_SIZE = 4
PR_SET_DUMPABLE = 4


class _Int(_ctypes._SimpleCData):
    _type_ = "i"


class _Function(_ctypes.CFuncPtr):
    """A libc function through _ctypes alone: importing ctypes costs milliseconds of start."""

    _flags_ = _ctypes.FUNCFLAG_CDECL
    _restype_ = _Int


class _Libc:
    _handle = _ctypes.dlopen(None, os.RTLD_NOW)  # type: ignore[arg-type]  # None: the process itself


def seal(keep):
    """Non-dumpable (no /proc/self/fd, environ, mem or pidfd_getfd for commands), no stray fds."""
    if _Function(("prctl", _Libc()))(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:  # type: ignore[arg-type]
        raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)


def drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def control(arg):
    """The control socket's descriptor: inherited (a number), or connected to now (a path)."""
    if arg.isdigit():
        return int(arg)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    sock.connect(arg)
    return sock.detach()


def main():
    ctl_fd = control(sys.argv[1])
    seal(ctl_fd)
    ctl = _socket.socket(fileno=ctl_fd)
    os.set_inheritable(ctl.fileno(), False)  # commands must never reach the control channel
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # as pid 1: ignored, not a KeyboardInterrupt
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the poll below
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    poller = select.epoll()
    poller.register(ctl.fileno(), select.EPOLLIN)
    poller.register(wake_r, select.EPOLLIN)
    devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    by_pid = {}  # pid -> command id
    by_id = {}  # command id -> pid
    ending = set()  # pids whose group is killed at their exit (Sg)
    account: list[int] = []  # the account's user namespace, once the server has sent it

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
            if b"u" in fields[0]:
                actions.append((os.POSIX_SPAWN_DUP2, the_account(), 3))
            pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
        except OSError as exc:
            send(b"E", cid, exc.errno or 0, exc.strerror or str(exc))
            return
        finally:
            for fd in fds:
                os.close(fd)
        by_pid[pid] = cid
        by_id[cid] = pid
        if b"g" in fields[0]:
            ending.add(pid)
        send(b"P", cid, pid)

    def spawn_terminal(fields):
        """Fork the command onto a new pty of the asked size; hand its master to the server."""
        import fcntl
        import termios

        cid, cwd, rows, cols, argc = fields[1], fields[2], int(fields[3]), int(fields[4]), int(fields[5])
        argv = fields[6 : 6 + argc]
        env = dict(kv.split(b"=", 1) for kv in fields[6 + argc :] if b"=" in kv)
        size = b"".join(n.to_bytes(2, sys.byteorder) for n in (rows, cols, 0, 0))
        opened = []
        try:
            namespace = the_account() if fields[0] == b"Tu" else None
            master, slave = os.openpty()
            opened += [master, slave]
            fcntl.ioctl(master, termios.TIOCSWINSZ, size)
            failed_r, failed_w = os.pipe2(os.O_CLOEXEC)
            opened += [failed_r, failed_w]
            pid = os.fork()
        except OSError as exc:  # no pty left, no process left: the command's failure, not ours
            for fd in opened:
                os.close(fd)
            send(b"E", cid, exc.errno or 0, exc.strerror or str(exc))
            return
        if pid == 0:  # the child: nothing but system calls until exec
            try:
                os.setsid()
                fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
                for fd in (0, 1, 2):
                    os.dup2(slave, fd)
                if namespace is not None:
                    os.dup2(namespace, 3)
                _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except OSError as exc:
                os.write(failed_w, b"%d\0%s" % (exc.errno or 0, (exc.strerror or str(exc)).encode()))
            finally:
                os._exit(127)
        os.close(slave)
        os.close(failed_w)
        failure = os.read(failed_r, 4096)  # EOF at the child's exec
        os.close(failed_r)
        if failure:
            os.close(master)
            number, _, message = failure.partition(b"\0")
            send(b"E", cid, number, message)  # the child is reaped as an orphan
            return
        by_pid[pid] = cid
        by_id[cid] = pid
        rights = master.to_bytes(FD_SIZE, sys.byteorder)
        ctl.sendmsg([b"P\0%s\0%d" % (cid, pid)], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        os.close(master)

    def the_account():
        if not account:
            raise OSError(2, "no account namespace was sent")
        return account[0]

    def reap():
        """Collect every exited child; report the commands, drop the orphans."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            cid = by_pid.pop(pid, None)
            if pid in ending:  # what the command left in its group goes with it
                ending.discard(pid)
                try:
                    os.killpg(pid, 9)
                except OSError:
                    pass
            if cid is not None:
                by_id.pop(cid, None)
                code = os.waitstatus_to_exitcode(status)
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

    shared = [
        os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) for path in sys.argv[2:]
    ]
    try:
        shared.append(os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:  # no /proc: the machine has no account
        pass
    rights = b"".join(fd.to_bytes(FD_SIZE, sys.byteorder) for fd in shared)
    ctl.sendmsg([b"R"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)] if shared else [])
    for fd in shared:
        os.close(fd)
    while True:
        for fd, _ in poller.poll():
            if fd == wake_r:
                drain(wake_r)
                reap()
                continue
            data, fds = receive()
            if not data:
                for pid in by_pid:
                    try:
                        os.killpg(pid, 9)
                    except OSError:
                        pass
                return
            fields = data.split(b"\0")
            if fields[0] in (b"S", b"Su", b"Sg", b"Sug"):
                spawn(fields, fds)
            elif fields[0] in (b"T", b"Tu"):
                for fd in fds:
                    os.close(fd)
                spawn_terminal(fields)
            elif fields[0] == b"A":
                for fd in account + fds[1:]:
                    os.close(fd)
                account[:] = fds[:1]
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
