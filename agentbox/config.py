"""Configuration: one TOML file plus `AGENTBOX_*` environment variables, all with defaults.

`agentbox serve` needs neither. Precedence: environment over file over defaults. The file
is `$AGENTBOX_CONFIG`, else `agentbox.toml` in the working directory, else
`$AGENTBOX_HOME/agentbox.toml`. Example:

    api_key = "..."                 # or AGENTBOX_API_KEY
    default_machine = "sandbox"
    delegable = ["sandbox"]         # machines a model may choose (seed 004 routing)
    max_sandboxes = 64              # live sandboxes at once, server-wide (AGENTBOX_MAX_SANDBOXES)
    max_sandbox_memory_mb = 18000   # their memory limits summed (default 75 % of MemTotal)

    [machines.sandbox]
    kind = "sandbox"
    network = "on"                  # "on" | "off"
    memory_mb = 2048
    pids = 512
    cpus = 1.0
    disk_mb = 10240                 # /workspace's disk budget (agentbox.machines.disk); 0 = none
    idle_minutes = 20               # reclaim after this long idle (seed 000)
    env = { TZ = "UTC" }            # env providers: injected into every command

    [machines.host]
    kind = "local"
    root = "/srv/projects"

    [models."openai:my-local-model"]  # limits compaction uses (agentbox.agent.limits)
    context_window = 32768
    max_output_tokens = 4096

    [[agents]]                      # a subagent for the `task` tool (agentbox.agent.subagents)
    name = "reviewer"
    description = "Reviews a diff and reports problems"
    instructions = "You review code. Report concrete problems with file and line."
    tools = ["read", "grep", "glob"]
    permission = "read-only"

Secret fields (`password`, `private_key`, `token`, `api_key`, `passphrase`) in a machine
entry may be stored encrypted (`enc:...`, see `agentbox.secrets`) and are decrypted only
when the machine is opened.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Reclaim an idle per-session sandbox after this many minutes (seed 000: about 20).
DEFAULT_IDLE_MINUTES = 20.0
#: Purge a session's /workspace after this many days without activity (seed 000).
DEFAULT_PURGE_DAYS = 30.0
#: Permission level a caller needs for a machine, by kind (seed 004: local 2, others 4).
DEFAULT_LEVELS = {"local": 2}
DEFAULT_LEVEL = 4
SECRET_FIELDS = {"password", "private_key", "token", "api_key", "passphrase"}
#: Live sandboxes one server runs at once when the config names no `max_sandboxes`.
DEFAULT_MAX_SANDBOXES = 64
#: Share of the host's MemTotal that live sandboxes' memory limits may sum to by default.
DEFAULT_MEMORY_SHARE = 0.75
#: The memory cap where the host's MemTotal is unknown: none in practice (1 PiB).
UNCAPPED_MEMORY_MB = 2**30


def host_memory_mb() -> int:
    """The host's MemTotal in MiB (from /proc/meminfo; 0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def default_sandbox_memory_mb() -> int:
    """DEFAULT_MEMORY_SHARE of MemTotal; no cap at all where MemTotal cannot be read."""
    total = host_memory_mb()
    return int(total * DEFAULT_MEMORY_SHARE) if total else UNCAPPED_MEMORY_MB


def default_home() -> Path:
    """Root keeps state where sandbox uids can be given their directories; others in ~."""
    if "AGENTBOX_HOME" in os.environ:
        return Path(os.environ["AGENTBOX_HOME"])
    if os.geteuid() == 0:
        return Path("/var/lib/agentbox")
    return Path.home() / ".local" / "share" / "agentbox"


@dataclass
class MachineConfig:
    """One `[machines.<name>]` entry."""

    name: str
    kind: str
    """`sandbox` (per session, isolated) or `local` (shared, the host)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Kind-specific settings (network, memory_mb, root, ...)."""
    level: int | None = None
    """Permission level a caller needs (`machine:<name>`); default by kind."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables injected into every command on this machine."""

    @property
    def required_level(self) -> int:
        return self.level if self.level is not None else DEFAULT_LEVELS.get(self.kind, DEFAULT_LEVEL)

    @property
    def per_session(self) -> bool:
        return self.kind not in ("local", "ssh")


@dataclass
class Settings:
    home: Path = field(default_factory=default_home)
    """AGENTBOX_HOME: the database, blobs, sessions' workspaces."""
    api_key: str | None = None
    """Required on every request when set (AGENTBOX_API_KEY)."""
    default_machine: str = "sandbox"
    delegable: list[str] = field(default_factory=lambda: ["sandbox"])
    """Machines a model may choose; the caller's level must admit them too."""
    machines: dict[str, MachineConfig] = field(default_factory=dict)
    idle_minutes: float = DEFAULT_IDLE_MINUTES
    purge_days: float = DEFAULT_PURGE_DAYS
    sandbox_uid: int = 64999
    """Host uid (and gid) sandbox processes run as when the server is root."""
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    """Live (running) sandboxes at once, over all sessions and machines; past it, idle ones are
    reclaimed and then a new one is refused (503, `capacity_exceeded`, Retry-After)."""
    max_sandbox_memory_mb: int = field(default_factory=default_sandbox_memory_mb)
    """What the memory limits (`memory_mb`) of live sandboxes may sum to, in MiB; by default
    75 % of the host's MemTotal, so limits cannot promise more memory than the host has."""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per model (`provider:name`): `context_window`, `max_output_tokens`."""
    agents: list[dict[str, Any]] = field(default_factory=list)
    """Subagents besides the built-in ones (name, description, instructions, tools, permission, model)."""

    def machine(self, name: str) -> MachineConfig | None:
        return self.machines.get(name)


def builtin_machines(home: Path) -> dict[str, MachineConfig]:
    return {
        "sandbox": MachineConfig("sandbox", "sandbox", {"network": "on"}),
        "local": MachineConfig("local", "local", {"root": str(home / "local")}),
    }


def config_path() -> Path | None:
    if "AGENTBOX_CONFIG" in os.environ:
        return Path(os.environ["AGENTBOX_CONFIG"])
    for candidate in (Path("agentbox.toml"), default_home() / "agentbox.toml"):
        if candidate.exists():
            return candidate
    return None


def load(path: Path | None = None, env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    path = path or config_path()
    data: dict[str, Any] = tomllib.loads(path.read_text()) if path and path.exists() else {}
    home = Path(env.get("AGENTBOX_HOME") or data.get("home") or default_home())
    machines = builtin_machines(home)
    for name, entry in (data.get("machines") or {}).items():
        entry = dict(entry)
        kind = entry.pop("kind", "sandbox")
        level = entry.pop("level", None)
        menv = {str(k): str(v) for k, v in (entry.pop("env", {}) or {}).items()}
        machines[name] = MachineConfig(name, kind, entry, level, menv)
    settings = Settings(
        home=home,
        api_key=env.get("AGENTBOX_API_KEY") or data.get("api_key"),
        default_machine=env.get("AGENTBOX_DEFAULT_MACHINE") or data.get("default_machine", "sandbox"),
        delegable=list(data.get("delegable", ["sandbox"])),
        machines=machines,
        idle_minutes=float(
            env.get("AGENTBOX_IDLE_MINUTES") or data.get("idle_minutes", DEFAULT_IDLE_MINUTES)
        ),
        purge_days=float(env.get("AGENTBOX_PURGE_DAYS") or data.get("purge_days", DEFAULT_PURGE_DAYS)),
        sandbox_uid=int(env.get("AGENTBOX_SANDBOX_UID") or data.get("sandbox_uid", 64999)),
        max_sandboxes=int(
            env.get("AGENTBOX_MAX_SANDBOXES") or data.get("max_sandboxes", DEFAULT_MAX_SANDBOXES)
        ),
        max_sandbox_memory_mb=int(
            env.get("AGENTBOX_MAX_SANDBOX_MEMORY_MB")
            or data.get("max_sandbox_memory_mb")
            or default_sandbox_memory_mb()
        ),
        models={str(k): dict(v) for k, v in (data.get("models") or {}).items()},
        agents=[dict(a) for a in data.get("agents") or []],
    )
    if "AGENTBOX_NETWORK" in env and "sandbox" in machines:
        machines["sandbox"].options["network"] = env["AGENTBOX_NETWORK"]
    return settings
