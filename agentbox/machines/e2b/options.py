"""`E2BOptions`: one `[machines.<name>]` entry of kind `e2b`, validated; the SDK, or why not."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from agentbox.machines.errors import MachineUnavailable
from agentbox.secrets import is_encrypted

#: The extra that installs the SDK, named in the refusal when it is missing.
EXTRA = "agentbox[e2b]"
#: The sandbox's lifetime on its endpoint without agentbox's refreshes, in seconds.
DEFAULT_TIMEOUT_SECONDS = 3600
#: The working directory when the entry names none: the home of E2B's default user.
DEFAULT_ROOT = "/home/user"
DEFAULT_USER = "user"
DEFAULT_TEMPLATE = "base"
#: Where the API key is read from when the entry gives none.
DEFAULT_API_KEY_ENV = "E2B_API_KEY"
#: Seconds one request to the control plane or to envd may take.
REQUEST_TIMEOUT = 60.0
#: The user helpers run as: chown and a look at any file need it.
HELPER_USER = "root"


def sdk() -> Any:
    """The `e2b` package, or a refusal that names the extra to install."""
    try:
        import e2b
    except ImportError:
        raise MachineUnavailable(
            f"the e2b machine kind needs the e2b SDK: install {EXTRA} (pip install '{EXTRA}')"
        ) from None
    return e2b


@dataclass(frozen=True)
class E2BOptions:
    """A `[machines.<name>]` entry of kind `e2b` (see the module docstring)."""

    api_key: str | None = None
    """The endpoint's API key (a secret field: stored encrypted)."""
    api_key_env: str = DEFAULT_API_KEY_ENV
    """The server's environment variable the key is read from when `api_key` is not set."""
    domain: str | None = None
    """E2B's domain (`e2b.app`): the SDK's default endpoints under it."""
    api_url: str | None = None
    """The control plane's URL (an E2B-compatible endpoint); default: E2B's under `domain`."""
    sandbox_url: str | None = None
    """envd's URL for every sandbox (an E2B-compatible endpoint routing by `E2b-Sandbox-Id`)."""
    template: str = DEFAULT_TEMPLATE
    """The template (an agentbox endpoint: its image) the sandbox is made from."""
    timeout: int = DEFAULT_TIMEOUT_SECONDS
    """Seconds the sandbox lives past agentbox's last refresh (agentbox refreshes it while running)."""
    root: str = DEFAULT_ROOT
    """The working directory: absolute, made at start."""
    user: str = DEFAULT_USER
    """The sandbox user commands run as and files are written as."""
    on_stop: Literal["pause", "kill"] = "pause"
    """What an idle stop does: pause (the sandbox's files kept) or kill (a new one next start)."""
    network: str = "on"
    """"off": the sandbox is created without internet access."""
    memory_mb: int = 0
    """What the sandbox counts against the server's `max_sandbox_memory_mb`, as a sandbox's
    limit does (unset: the registry's default; 0: not counted, the memory being E2B's)."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> E2BOptions:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) for an e2b machine: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for key, value in options.items():
            if key in ("timeout", "memory_mb"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{key} must be an integer")
            elif key == "network":
                value = "on" if value is True or str(value).lower() in ("on", "true", "1") else "off"
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{key} must be a string")
            values[key] = value
        made = cls(**values)
        if made.timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if not made.root.startswith("/"):
            raise ValueError("root must be an absolute path")
        if made.on_stop not in ("pause", "kill"):
            raise ValueError(f"on_stop must be pause or kill, not {made.on_stop!r}")
        return made

    def api_params(self) -> dict[str, Any]:
        """The SDK's connection parameters (`ApiParams`) of this entry. A key still encrypted
        (an entry described, not opened, keeps its secrets sealed) cannot be used."""
        if is_encrypted(self.api_key):
            raise MachineUnavailable("api_key is still encrypted: decrypt the entry's secrets first")
        key = self.api_key or os.environ.get(self.api_key_env) or None
        given = {"api_key": key, "domain": self.domain, "api_url": self.api_url,
                 "sandbox_url": self.sandbox_url}  # fmt: skip
        return {"request_timeout": REQUEST_TIMEOUT, **{k: v for k, v in given.items() if v}}

    @property
    def where(self) -> str:
        return self.api_url or self.domain or "E2B's cloud"
