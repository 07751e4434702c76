"""The `e2b` kind: one E2B sandbox per session, through the `e2b` SDK's async client.

The sandbox is E2B's (its cloud, with an API key) or any E2B-compatible endpoint's (an
agentbox server's own, `agentbox.e2b`): its files are not host files, so every operation
goes through envd, the daemon in the sandbox, and everything above `machines/` reaches them
through `file_ops(machine)` -> `RemoteOps`, as for the ssh kind.

    [machines.cloud]
    kind = "e2b"
    api_key = "e2b_..."          # stored encrypted; or api_key_env = "E2B_API_KEY" (the default)
    domain = "e2b.app"           # E2B's cloud; or, for a self-hosted endpoint:
    # api_url = "http://10.0.0.5:8080"       # its control plane
    # sandbox_url = "http://10.0.0.5:8080"   # its envd (one URL for every sandbox)
    template = "base"
    timeout = 3600               # seconds the sandbox outlives a silent agentbox
    root = "/home/user"          # the working directory (created at start)
    user = "user"                # whom envd runs commands as ("root" for helpers)
    on_stop = "pause"            # idle: "pause" (files kept) or "kill" (a new sandbox next time)

Lifetime. `start` creates the sandbox with the server home's label and the session, machine
and instance ids in its metadata, or, when it had one, connects to it again (resuming a paused one); after a
restart the session's marker names the sandbox (`marker()`), and if it does not, the
sandbox is found by its metadata. While running, the sandbox's E2B timeout is pushed back
every REFRESH_FRACTION of `timeout`, so it ends by itself only when agentbox stops caring.
`stop` (the registry's idle reclaim) pauses it (or kills it, `on_stop = "kill"`), `destroy`
(the session closed) kills it, `close` (the server stopping) leaves it running until its
timeout, for the next server to connect to. What a server that died left is killed when the
next one starts: its home's sandboxes that no live session names (`sweep`), never another's.

Commands. Each is one envd process running `/bin/sh -c` the same command line as the ssh
kind's (`ssh.channel.remote_command`): it checks the cwd and argv[0] (a failure is the
OSError a local spawn would raise), prints a pid marker, and execs `env -i VAR=VALUE...
ARGV...`, so the environment is exactly `command_env`. Output arrives as envd's data events,
byte for byte. A signal is `kill` run in the sandbox against the marked pid's group (what
the command started goes with it), and SIGKILL and SIGTERM go through envd's SendSignal too.

Files. envd's filesystem API where it has the operation (Stat, ListDir, MakeDir, Move,
Remove, WatchDir) and its `/files` for bytes; a write uploads a temp file beside the target
and moves it over it (the old file's mode kept); `create` uploads a temp file and hard-links
it to the name (`ln`, which refuses an existing name, a dangling link too); chown, readlink,
symlink, ranged reads and user ids are commands in the sandbox (as root; links and the `ln`
of a create as the machine's user). envd reports owners by name and no inode:
`FileStat.inode` is 0, and `uid`/`gid` of a name other than root or a number are looked up
in the sandbox once.

Every way a call fails: `MachineUnavailable` when the endpoint cannot be reached, refuses
the key, has no such sandbox any more, or the SDK is not installed (`agentbox[e2b]`);
`OwnerUnsupported` for a chown to a user the sandbox does not have; a file operation's own
failure is the OSError of its errno (ENOENT, EEXIST, ENOTDIR, EISDIR, ENOTEMPTY, EFBIG).

The modules: `options` (the entry, and the SDK or the refusal that names its extra),
`process` (a command's envd events as a `Process`, envd's errors as errnos), `watch` (envd's
WatchDir as `WatchChange`s), `machine` (`E2BMachine`), `sweep` (a dead server's sandboxes).
"""

from agentbox.machines.e2b.machine import E2BMachine, SandboxFacts
from agentbox.machines.e2b.options import EXTRA, REQUEST_TIMEOUT, E2BOptions, sdk
from agentbox.machines.e2b.process import E2BProcess
from agentbox.machines.e2b.watch import E2BWatch

__all__ = [
    "EXTRA",
    "REQUEST_TIMEOUT",
    "E2BMachine",
    "E2BOptions",
    "E2BProcess",
    "E2BWatch",
    "SandboxFacts",
    "sdk",
]
