"""`SshOptions`: one `[machines.<name>]` entry of kind `ssh`, validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import asyncssh

from agentbox.secrets import is_encrypted

DEFAULT_PORT = 22
#: Channels one connection carries at once: OpenSSH's `MaxSessions` default (Debian's too).
DEFAULT_MAX_SESSIONS = 10
#: Seconds for a TCP connect, the SSH handshake and authentication together.
CONNECT_TIMEOUT = 10.0
#: Seconds between keepalives on a quiet connection; KEEPALIVE_COUNT unanswered ones drop it.
KEEPALIVE_SECONDS = 15.0
KEEPALIVE_COUNT = 3
#: The remote root when the entry names none: this directory under the remote user's home.
DEFAULT_ROOT = "agentbox"
#: Seconds between two scans of a polling watch (its latency).
DEFAULT_POLL_SECONDS = 2.0
WatchMode = Literal["auto", "inotifywait", "polling"]


@dataclass(frozen=True)
class SshOptions:
    """A `[machines.<name>]` entry of kind `ssh`, its secrets already decrypted."""

    host: str
    """Name or address of the sshd."""
    user: str
    """The remote account: commands run as it, files are its files."""
    port: int = DEFAULT_PORT
    """The sshd's port."""
    key_file: str | None = None
    """Path, on the server's host, of the private key to log in with (OpenSSH, PEM or PKCS#8)."""
    private_key: str | None = None
    """The private key itself, as text (a secret field: stored encrypted)."""
    passphrase: str | None = None
    """Passphrase of `key_file` or `private_key`, if it is encrypted (a secret field)."""
    password: str | None = None
    """Password to log in with, tried after the key (a secret field)."""
    known_hosts: str | None = None
    """known_hosts file the host key is checked against; default `~/.ssh/known_hosts` of the
    server's user. It must list the host: an unknown key is refused, never learned."""
    host_key: str | None = None
    """The host's public key (`ssh-ed25519 AAAA...`): when set, the one key accepted, and no
    known_hosts file is read."""
    root: str = DEFAULT_ROOT
    """Remote working directory: absolute, or relative to the remote user's home. Created at
    the first connection."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    """Channels one connection may carry: the sshd's `MaxSessions`. Past it, a new connection."""
    watch: WatchMode = "auto"
    """How `watch` sees changes: `inotifywait` on the host, `polling` with `find`, or `auto`
    (inotifywait where the host has it)."""
    poll_seconds: float = DEFAULT_POLL_SECONDS
    """Seconds between two scans of a polling watch: its latency."""
    connect_timeout: float = CONNECT_TIMEOUT
    """Seconds a connection (TCP, handshake and authentication) may take."""
    keepalive_seconds: float = KEEPALIVE_SECONDS
    """Seconds between keepalives on a quiet connection: one whose peer misses KEEPALIVE_COUNT
    of them in a row is dropped (and what ran on it fails with `MachineUnavailable`)."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SshOptions:
        """Validate an entry's options (unknown keys, types, ranges) into `SshOptions`."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown option(s) for an ssh machine: {', '.join(unknown)}")
        for name in REQUIRED_OPTIONS:
            if not options.get(name):
                raise ValueError(f"an ssh machine needs {name!r}")
        made = cls(**{name: _option(name, value) for name, value in options.items()})
        made.check()
        return made

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        if not (self.key_file or self.private_key or self.password):
            raise ValueError("an ssh machine needs key_file, private_key or password to log in")
        if self.key_file and self.private_key:
            raise ValueError("give key_file or private_key, not both")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.watch not in ("auto", "inotifywait", "polling"):
            raise ValueError(f"watch must be auto, inotifywait or polling, not {self.watch!r}")
        if min(self.poll_seconds, self.connect_timeout, self.keepalive_seconds) <= 0:
            raise ValueError("poll_seconds, connect_timeout and keepalive_seconds must be positive")
        for name in ("private_key", "passphrase", "password"):
            if is_encrypted(getattr(self, name)):
                raise ValueError(f"{name} is still encrypted: decrypt the entry's secrets first")
        if self.host_key:
            try:
                asyncssh.import_public_key(self.host_key)
            except (asyncssh.KeyImportError, ValueError) as exc:
                raise ValueError(f"host_key is not a public key: {exc}") from None

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


#: Options an entry must give; the other strings may be left out (or None: not set).
REQUIRED_OPTIONS = ("host", "user")
#: Options that are numbers; every other one is a string.
INTEGER_OPTIONS = frozenset({"port", "max_sessions"})
NUMBER_OPTIONS = frozenset({"poll_seconds", "connect_timeout", "keepalive_seconds"})


def _option(name: str, value: Any) -> Any:
    """One option's value, of its field's type (TOML gives ints where a float is meant)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if name in INTEGER_OPTIONS:
        if not number or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer")
        return value
    if name in NUMBER_OPTIONS:
        if not number:
            raise ValueError(f"{name} must be a number")
        return float(value)
    if not isinstance(value, str) and not (value is None and name not in REQUIRED_OPTIONS):
        raise ValueError(f"{name} must be a string")
    return value
