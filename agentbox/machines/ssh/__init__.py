"""The `ssh` kind: one remote host over SSH, shared by every session that names it, not isolated.

Commands run on the host as the configured user, files are that user's files, and nothing
stands between a session and the host but the tool layer's approvals (seed 004): never
offer this kind to untrusted users. `root` is a remote directory, by default `agentbox`
under the remote user's home, created at the first connection; relative paths resolve
under it.

Connections. One machine keeps a small pool of connections to its sshd (`ConnectionPool`),
opened when first needed and reused by every command and file operation. An sshd allows a
few channels per connection (OpenSSH's `MaxSessions`, 10 on Debian), so a connection
carries at most `max_sessions` channels at once (SFTP holds one for as long as it is open)
and the pool opens another one past that, up to MAX_CONNECTIONS, rather than failing the
eleventh concurrent command. Keepalives find a silent peer within `keepalive_seconds` *
KEEPALIVE_COUNT (45 s by default); a connection that drops leaves the pool and the next
call opens a new one.

Trust. The host key is checked against the server user's `~/.ssh/known_hosts` (or the
`known_hosts` file named), or against the one `host_key` configured; an unknown or changed
key refuses the connection. The operator's ssh config, agent and default keys are never
read: authentication is by the configured private key (a file or the key itself, with an
optional passphrase) or password. Secret fields arrive decrypted (`Registry.secrets`);
`SshOptions` refuses one still `enc:`.

Commands. Each command is one session channel whose command line (`remote_command`) the
remote user's login shell runs (it must be a POSIX shell: sh, dash, bash, zsh, ksh): with
builtins only, it sets PATH, changes to the cwd, checks that argv[0] can be run (else the
spawn fails with the errno a local spawn would give), writes a marker with its pid to
stdout (`\\0agentbox:pid:N\\n`; whatever its startup files printed before is dropped), and

    exec env -i VAR=VALUE... ARGV...

so the environment is exactly `command_env`: neither sshd's variables (SSH_CONNECTION,
MAIL, ...) nor what the login shell's startup files export reach the command. OpenSSH
starts each session's process in a session of its own, and the login shell, env and the
command are one process exec'ing in turn, so the marked pid leads the command's process
group: a kill, on timeout, cancellation or `Process.kill`, is `kill -s SIG -- -PID` over
another channel, which ends the command and everything it started. A command that outlives
a SIGKILL by KILL_TIMEOUT (its kill could not be delivered) has its channel closed.

Files go over one SFTP channel (asyncssh pipelines its requests). A write goes to a temp
file in the same directory (`.NAME.agentbox-RANDOM.tmp`, created exclusively), takes the
old file's mode (and, as root, its owner) and is renamed over the target
(`posix-rename@openssh.com`), so readers see the old content or the new, never a part.
SFTP v3 has no inode numbers: `FileStat.inode` is 0, and `mtime` is whole seconds.

Watching and search: `watch` (the optional `Watching` capability of `machines.base`, which
the server's watch API stands on) runs `inotifywait -m` on the host when it has it, else
polls with GNU `find` every `poll_seconds` (the option `watch = "polling"` forces polling,
`"inotifywait"` requires it); `grep` runs the host's `rg`, else its `grep -r`.
`capabilities()` says which (known after the first connection).

Every way a call fails here, each bounded in time (`connect_timeout`, `keepalive_seconds`
and the named constants of `machine.py` and `pool.py`):

    MachineError
    ├── MachineUnavailable
    │   ├── sshd unreachable or refusing       "cannot reach sshd at HOST:PORT: ..."
    │   ├── sshd silent past connect_timeout   "USER@HOST:PORT did not answer within N s"
    │   ├── host key unknown or changed        "the host key of HOST:PORT is not trusted by ..."
    │   ├── no known_hosts file, no host_key   "no known_hosts file at PATH and no host_key ..."
    │   ├── key unreadable, wrong passphrase   "the private key ... could not be loaded ..."
    │   ├── authentication refused             "authentication as USER on HOST:PORT failed ..."
    │   ├── connection dropped or silent       "the connection to ... dropped: ..."
    │   ├── ... while a command ran            "the connection dropped while the command ran: ..."
    │   ├── every channel busy too long        "all N channels to the host are busy ..."
    │   └── the machine closed                 "machine NAME is closed"
    └── OwnerUnsupported                       `chown` to a user the host does not have
    OSError (its errno: FileNotFoundError...)  a file operation's or a spawn's own failure

Idempotent calls (a spawn whose channel never opened, read, stat, list, write) that meet a
connection dropped under them are retried once on a new connection; the others raise.

The modules: `options` (the entry), `pool` (connections and their channel counts),
`channel` (a command's command line, session channel and `Process`), `sftp` (SFTP answers
as errnos and `FileStat`s), `watch` (inotifywait or polling), `machine` (`SshMachine`).
"""

from agentbox.machines.ssh.channel import SshProcess, remote_command
from agentbox.machines.ssh.machine import GrepHit, SshMachine
from agentbox.machines.ssh.options import DEFAULT_MAX_SESSIONS, SshOptions
from agentbox.machines.ssh.pool import ConnectionPool
from agentbox.machines.ssh.watch import RemoteWatch

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "ConnectionPool",
    "GrepHit",
    "RemoteWatch",
    "SshMachine",
    "SshOptions",
    "SshProcess",
    "remote_command",
]
