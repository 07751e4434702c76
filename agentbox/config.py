"""Configuration: one TOML file plus `AGENTBOX_*` environment variables, all with defaults.

`agentbox serve` needs neither. Precedence: environment over file over defaults. The file
is `$AGENTBOX_CONFIG`, else `agentbox.toml` in the working directory, else
`$AGENTBOX_HOME/agentbox.toml`. Example:

    api_key = "..."                 # or AGENTBOX_API_KEY: callers with it have level 10
    allowed_hosts = ["agentbox.internal"]      # Host names besides loopback (a reverse proxy)
    allowed_origins = ["https://ui.example"]   # web origins besides the server's own
    default_machine = "sandbox"
    delegable = ["sandbox"]         # machines a model may choose (seed 004 routing)
    model_endpoints = ["http://127.0.0.1:11434/v1"]  # a session's base_url may point here
    max_sandboxes = 64              # live sandboxes at once, server-wide (AGENTBOX_MAX_SANDBOXES)
    max_sandbox_memory_mb = 18000   # their memory limits summed (default 75 % of MemTotal)

    [[api_keys]]                    # more keys, each with the caller level it grants
    name = "ci"
    key_env = "CI_AGENTBOX_KEY"     # or key = "..." (at least 16 characters)
    level = 2                       # opens machines whose level is 2 or less (`local`, not `sandbox`)

    [machines.sandbox]
    kind = "sandbox"
    network = "on"                  # "on" | "off"
    memory_mb = 2048
    pids = 512
    cpus = 1.0
    disk_mb = 10240                 # /workspace's disk budget (agentbox.machines.disk); 0 = none
    idle_minutes = 20               # reclaim after this long idle (seed 000)
    env = { TZ = "UTC" }            # env providers: injected into every command

    [machines.cloud]                # one E2B sandbox per session (agentbox.machines.e2b)
    kind = "e2b"
    api_key = "enc:..."             # or api_key_env = "E2B_API_KEY" (the default)
    domain = "e2b.app"              # or api_url + sandbox_url: any E2B-compatible endpoint
    template = "base"
    timeout = 3600                  # seconds the sandbox outlives a silent server
    root = "/home/user"             # the working directory
    user = "user"                   # whom commands run as
    on_stop = "pause"               # an idle sandbox: "pause" or "kill"

    [machines.host]                 # the host itself: only when configured (no built-in one)
    kind = "local"
    root = "/srv/projects"
    allow_full_auto = false         # true: a session may run full-auto here (the default is full-ask)

    [mcp_servers.search]            # an MCP server on the host: only the operator names one
    command = ["/usr/local/bin/search-mcp"]
    env = { INDEX = "/srv/index" }
    trusted = true                  # believe its read-only annotations
    # or: url = "http://10.0.0.5:9000/mcp", headers = { Authorization = "Bearer ..." }

    [models."openai:my-local-model"]  # what the model can take (agentbox.agent.limits)
    context_window = 32768
    max_output_tokens = 4096
    vision = true                   # shown images (default: known vision models, anthropic:)

    [compaction]
    model = "openai:my-local-model" # writes every session's summaries (one of `models`), unless
                                    # the session's own `compaction.model` names another

    [tools]                         # the model-facing tools (ToolConfig)
    web = true                      # false: no tool reaches the web from the server
    web_search_url = "http://127.0.0.1:8888/search"  # GET ?q=&n= answers JSON results
    skill_dirs = ["/srv/skills"]    # skills every session has, besides the workspace's

    [[knowledge_bases]]             # a folder of the workspace every session on a machine has
    id = "handbook"                 # what knowledge_base_ids and the tools name it by
    path = "docs/handbook"          # relative to the machine's workspace root
    name = "Team handbook"
    machines = ["host"]             # the machines it is on (default: every machine)

    [[agents]]                      # a subagent for the `task` tool (agentbox.agent.subagents)
    name = "reviewer"
    description = "Reviews a diff and reports problems"
    instructions = "You review code. Report concrete problems with file and line."
    tools = ["read", "grep", "glob"]
    permission = "read-only"

What a session supplies stays on its side of the boundary. A session's stdio MCP servers run
inside its machine; one names a host-side server only by reference (`{"server": "search"}`).
A session's `model_options.base_url` and its MCP `url`s must be public addresses reached
through a machine with a network, unless the operator lists the endpoint here
(`model_endpoints`: URL prefixes, matched by scheme, host, port and path); the server's
provider keys (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`) go only to the provider's own endpoint
(its `*_BASE_URL`, else the public default), never to a session's `base_url`.

The host is a machine only where an entry says `kind = "local"`; a session there runs
`full-ask` unless it asks otherwise, and `full-auto` needs that entry's `allow_full_auto = true`
(`agentbox.tools.tiers.session_tier` decides for every entry point).

Secret fields (`password`, `private_key`, `token`, `api_key`, `passphrase`) in a machine
entry may be stored encrypted (`enc:...`, see `agentbox.secrets`) and are decrypted only
when the machine is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import posixpath
import re
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
#: Characters an `[[api_keys]]` key has at least (a guessable key is no level at all).
MIN_API_KEY_CHARS = 16
#: The highest permission level: the server's own `api_key` (and a server without keys) has it.
MAX_LEVEL = 10
#: Machine kinds shared by every session and not isolated from the host (or from each other's
#: sessions): the model's commands run with the server's rights there. Every other kind of
#: `agentbox.machines.kinds.KINDS` is one machine per session.
HOST_KINDS = frozenset({"local", "ssh"})
#: Kinds whose network is off unless the entry says `network = "on"`: a docker container's
#: "on" is the engine's bridge, which reaches the host's addresses (a sandbox's slirp4netns does not).
NETWORK_OFF_KINDS = frozenset({"docker"})
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


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name stays on this machine (`localhost`, 127/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listed(value: str | list[str] | None) -> list[str]:
    """A TOML list or a comma-separated env value as a list of non-empty, trimmed names."""
    items = value.split(",") if isinstance(value, str) else value or []
    return [item.strip() for item in items if item.strip()]


def default_home() -> Path:
    """Root keeps state where sandbox uids can be given their directories; others in ~."""
    if "AGENTBOX_HOME" in os.environ:
        return Path(os.environ["AGENTBOX_HOME"])
    if os.geteuid() == 0:
        return Path("/var/lib/agentbox")
    return Path.home() / ".local" / "share" / "agentbox"


def home_label(home: Path) -> str:
    """A short, stable name for a server home (its resolved path, hashed): what the things a
    server makes elsewhere (containers, E2B sandboxes) carry, so its next start sweeps its own
    leftovers and never another home's."""
    return hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]


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
    allow_full_auto: bool = False
    """On a machine that is not isolated: whether a session may ask for `full-auto` (no
    approvals). Without it such a session is refused; the default tier there is `full-ask`."""

    @property
    def isolated(self) -> bool:
        """Whether the machine is a boundary of its own (not the host, not shared)."""
        return self.kind not in HOST_KINDS

    @property
    def network_on(self) -> bool:
        """Whether code on the machine reaches the network (`network = "off"` for a sandbox cuts it)."""
        network = self.options.get("network", "off" if self.kind in NETWORK_OFF_KINDS else "on")
        return network is True or str(network).lower() in ("on", "true", "1")

    @property
    def required_level(self) -> int:
        return self.level if self.level is not None else DEFAULT_LEVELS.get(self.kind, DEFAULT_LEVEL)

    @property
    def per_session(self) -> bool:
        """One machine per session (isolated, suspendable), or one shared by every session."""
        return self.kind not in HOST_KINDS


class ConfigError(ValueError):
    """The config file says something this server cannot take; the message names the setting."""


@dataclass
class ToolConfig:
    """The `[tools]` table: settings the model-facing tools read; every field has a default so a
    bare session works."""

    web: bool = True
    """The networking setting of the tools that reach the web from the server (`web_fetch`,
    `web_search`, the workbench's `search target=web` and `read url`): false, none is offered.
    A sandbox's own network is its machine entry's `network`."""
    web_search_url: str | None = None
    """An HTTP endpoint answering `GET ?q=...&n=...` with JSON results; None = web_search unavailable."""
    skill_dirs: list[str] = field(default_factory=list)
    """Extra host directories holding skills (besides the workspace's .agents/skills)."""
    exec_env_allow: list[str] = field(default_factory=list)
    """Variable names kept even though they look secret (KEY, TOKEN, SECRET, PASSWORD, ...)."""
    web_allow_private: bool = False
    """Let web_fetch reach loopback, private and link-local addresses. web_fetch runs in the server,
    not in the sandbox: off, a model cannot use it to reach the server's own network or host services."""


def tool_config(table: dict[str, Any]) -> ToolConfig:
    """The `[tools]` table; a name it does not have or a value of the wrong type is an error
    (a misspelt `web_search_url` must not leave search silently off)."""
    known = [f.name for f in dataclasses.fields(ToolConfig)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"[tools] has no setting {unknown[0]!r}; it has {', '.join(known)}")

    def flag(name: str, default: bool) -> bool:
        value = table.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"[tools] {name} must be true or false, not {value!r}")
        return value

    def names(name: str) -> list[str]:
        value = table.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"[tools] {name} must be a list of strings, not {value!r}")
        return list(value)

    url = table.get("web_search_url")
    if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ConfigError(f"[tools] web_search_url must be an http(s) URL, not {url!r}")
    return ToolConfig(
        web=flag("web", True),
        web_search_url=url,
        skill_dirs=names("skill_dirs"),
        exec_env_allow=names("exec_env_allow"),
        web_allow_private=flag("web_allow_private", False),
    )


#: What a knowledge base's id may be: what sessions select it by and the tools name it by.
MAX_KNOWLEDGE_BASE_ID_CHARS = 64
KNOWLEDGE_BASE_ID = re.compile(rf"[a-z0-9][a-z0-9_-]{{0,{MAX_KNOWLEDGE_BASE_ID_CHARS - 1}}}")
#: The knowledge base every machine has: its whole workspace root (the default selection).
WORKSPACE_KNOWLEDGE_BASE = "workspace"
#: Longest knowledge base path (relative to the workspace root), in characters.
MAX_KNOWLEDGE_BASE_PATH_CHARS = 1024
#: Characters a knowledge base path may not hold: walks leave unselected ones out by rg glob.
GLOB_CHARS = "*?[]{}!\\"
#: Longest knowledge base name, in characters.
MAX_KNOWLEDGE_BASE_NAME_CHARS = 200


@dataclass(frozen=True)
class KnowledgeBaseSpec:
    """A knowledge base as configured or registered: a folder of a machine's workspace.

    `path` is relative to the machine's workspace root and stays inside it (no `..`, never
    absolute): a knowledge base widens what the tools treat as the session's own files, so
    neither a session nor the operator can make one of a folder outside the workspace. The
    knowledge index, which covers the workspace root, covers every knowledge base by that rule.
    """

    id: str
    path: str
    name: str = ""
    machines: tuple[str, ...] = ()
    """Configured ones: the machines whose sessions have it; empty, every machine."""

    def on(self, machine: str | None) -> bool:
        return not self.machines or machine in self.machines


def knowledge_base_spec(entry: Any, where: str, *, configured: bool = False) -> KnowledgeBaseSpec:
    """One knowledge base (`id`, `path`, optional `name`, and where configured `machines`),
    checked; a `ConfigError` names what is wrong and `where` it was given."""
    allowed = {"id", "path", "name", *({"machines"} if configured else set())}
    if not isinstance(entry, dict) or not set(entry) <= allowed or not {"id", "path"} <= set(entry):
        raise ConfigError(
            f"{where}: a knowledge base takes {', '.join(sorted(allowed))} (id and path needed), not {entry!r}"
        )
    kb_id, path, name = entry["id"], entry["path"], entry.get("name", "")
    if not isinstance(kb_id, str) or not KNOWLEDGE_BASE_ID.fullmatch(kb_id):
        raise ConfigError(f"{where}: knowledge base id {kb_id!r} must match {KNOWLEDGE_BASE_ID.pattern}")
    if kb_id == WORKSPACE_KNOWLEDGE_BASE:
        raise ConfigError(f"{where}: {WORKSPACE_KNOWLEDGE_BASE!r} is the workspace's own knowledge base")
    if not isinstance(name, str) or len(name) > MAX_KNOWLEDGE_BASE_NAME_CHARS:
        raise ConfigError(
            f"{where}: knowledge base {kb_id!r}: name must be text of at most {MAX_KNOWLEDGE_BASE_NAME_CHARS} characters"
        )
    machines = entry.get("machines", [])
    if not isinstance(machines, list) or not all(isinstance(m, str) for m in machines):
        raise ConfigError(f"{where}: knowledge base {kb_id!r}: machines must be a list of machine names")
    return KnowledgeBaseSpec(
        kb_id, knowledge_base_path(path, f"{where}: knowledge base {kb_id!r}"), name, tuple(machines)
    )


def knowledge_base_path(path: Any, where: str) -> str:
    """`path` normalized, relative to the workspace root and inside it, or a `ConfigError`."""
    if (
        not isinstance(path, str)
        or not path.strip()
        or "\0" in path
        or len(path) > MAX_KNOWLEDGE_BASE_PATH_CHARS
    ):
        raise ConfigError(
            f"{where}: path must be a folder of the workspace, at most {MAX_KNOWLEDGE_BASE_PATH_CHARS} characters"
        )
    normal = posixpath.normpath(path.strip())
    if set(normal) & set(GLOB_CHARS):
        raise ConfigError(f"{where}: path {path!r} must not hold any of {GLOB_CHARS} (they are glob syntax)")
    if path.startswith("/") or normal == "." or normal == ".." or normal.startswith("../"):
        raise ConfigError(
            f"{where}: path {path!r} must be a folder inside the workspace, relative to its root "
            "(the whole workspace is the 'workspace' knowledge base)"
        )
    return normal


def knowledge_bases(entries: Any) -> list[KnowledgeBaseSpec]:
    """The `[[knowledge_bases]]` table; ids are unique."""
    if not isinstance(entries, list):
        raise ConfigError("[[knowledge_bases]] must be a list of tables")
    specs = [knowledge_base_spec(e, "[[knowledge_bases]]", configured=True) for e in entries]
    unique_ids(specs, "[[knowledge_bases]]")
    return specs


def unique_ids(specs: list[KnowledgeBaseSpec], where: str) -> None:
    seen: set[str] = set()
    for spec in specs:
        if spec.id in seen:
            raise ConfigError(f"{where}: knowledge base id {spec.id!r} is given twice")
        seen.add(spec.id)


@dataclass(frozen=True)
class ApiKey:
    """One `[[api_keys]]` entry: a key that admits its callers at `level` (seed 004's caller
    level: a machine needs `level` or more, checked on every open)."""

    name: str
    key: str = field(repr=False)
    level: int


def api_keys(entries: list[Any], env: dict[str, str], server_key: str | None) -> list[ApiKey]:
    """The `[[api_keys]]` table: `name`, `key` (or `key_env`, a variable holding it), `level`.
    A duplicate name or key, a key shorter than `MIN_API_KEY_CHARS` or a level outside
    0..MAX_LEVEL is an error: a caller must never get another's level by accident."""
    keys: list[ApiKey] = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"name", "key", "key_env", "level"}:
            raise ConfigError(f"an [[api_keys]] entry takes name, key (or key_env) and level, not {entry!r}")
        name, level = entry.get("name"), entry.get("level")
        key = entry.get("key") if "key" in entry else env.get(str(entry.get("key_env")))
        if not isinstance(name, str) or not name or any(k.name == name for k in keys):
            raise ConfigError(f"[[api_keys]] needs a name of its own, not {name!r}")
        if not isinstance(key, str) or len(key) < MIN_API_KEY_CHARS:
            raise ConfigError(
                f"[[api_keys]] {name!r}: its key must be at least {MIN_API_KEY_CHARS} characters"
            )
        if key == server_key or any(k.key == key for k in keys):
            raise ConfigError(f"[[api_keys]] {name!r}: its key is another key's")
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= MAX_LEVEL:
            raise ConfigError(f"[[api_keys]] {name!r}: level must be 0 to {MAX_LEVEL}, not {level!r}")
        keys.append(ApiKey(name, key, level))
    return keys


@dataclass
class Settings:
    home: Path = field(default_factory=default_home)
    """AGENTBOX_HOME: the database, blobs, sessions' workspaces."""
    api_key: str | None = None
    """Required on every request when set (AGENTBOX_API_KEY); its callers have `MAX_LEVEL`."""
    api_keys: list[ApiKey] = field(default_factory=list)
    """More keys, each admitting its callers at its own level (`[[api_keys]]`)."""
    default_machine: str = "sandbox"
    delegable: list[str] = field(default_factory=lambda: ["sandbox"])
    """Machines a model may choose; the caller's level must admit them too."""
    machines: dict[str, MachineConfig] = field(default_factory=dict)
    idle_minutes: float = DEFAULT_IDLE_MINUTES
    purge_days: float = DEFAULT_PURGE_DAYS
    sandbox_uid: int = 64999
    """Host uid (and gid) sandbox processes run as when the server is root."""
    images_dir: Path | None = None
    """Where images are kept (AGENTBOX_IMAGES); by default `images/` in the home."""
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    """Live (running) sandboxes at once, over all sessions and machines; past it, idle ones are
    reclaimed and then a new one is refused (503, `capacity_exceeded`, Retry-After)."""
    max_sandbox_memory_mb: int = field(default_factory=default_sandbox_memory_mb)
    """What the memory limits (`memory_mb`) of live sandboxes may sum to, in MiB; by default
    75 % of the host's MemTotal, so limits cannot promise more memory than the host has."""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per model (`provider:name`): `context_window`, `max_output_tokens`, `vision` (whether
    tool results' images are shown to it; `agentbox.agent.limits` says the default)."""
    compaction_model: str | None = None
    """`[compaction] model`: the model that writes compaction summaries for sessions that name
    none (`compaction.model`); one of `models`. None: each session's own model."""
    agents: list[dict[str, Any]] = field(default_factory=list)
    """Subagents besides the built-in ones (name, description, instructions, tools, permission, model)."""
    bind_host: str | None = None
    """The address `agentbox serve` binds (set by the CLI, not configured); on a loopback bind
    only loopback `Host` names and `allowed_hosts` are answered (DNS rebinding)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """`Host` names accepted besides loopback ones (AGENTBOX_ALLOWED_HOSTS, comma-separated):
    `name` (any port) or `name:port`, e.g. a reverse proxy's; `*` accepts any. When set, the
    rule holds on any bind."""
    allowed_origins: list[str] = field(default_factory=list)
    """Web origins (`https://ui.example`) that may call besides the server's own
    (AGENTBOX_ALLOWED_ORIGINS, comma-separated); they also get CORS headers."""
    mcp_servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Host-side MCP servers by name (`command`/`env` or `url`/`headers`, `trusted`); a session
    uses one by naming it (`{"server": "<name>"}`), never by giving a command of its own."""
    model_endpoints: list[str] = field(default_factory=list)
    """URL prefixes a session's `base_url` (and MCP `url`) may reach although they are not
    public addresses (a local Ollama on loopback); the server's keys still do not go there."""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """The `[tools]` table (`ToolConfig`)."""
    knowledge_bases: list[KnowledgeBaseSpec] = field(default_factory=list)
    """`[[knowledge_bases]]`: folders of a machine's workspace its sessions have as knowledge
    bases besides the whole workspace (`agentbox.tools.knowledge_bases`)."""

    def machine(self, name: str) -> MachineConfig | None:
        return self.machines.get(name)

    @property
    def keyed(self) -> bool:
        """Whether requests need a key (`api_key` or any of `api_keys`)."""
        return bool(self.api_key or self.api_keys)

    def levels(self) -> list[tuple[str, int]]:
        """Every key with the level it admits at: `api_key` at `MAX_LEVEL`, then `api_keys`."""
        own = [(self.api_key, MAX_LEVEL)] if self.api_key else []
        return own + [(k.key, k.level) for k in self.api_keys]

    @property
    def images(self) -> Path:
        return self.images_dir or self.home / "images"


def builtin_machines() -> dict[str, MachineConfig]:
    """The machines every server has: an isolated sandbox. The host (`local`) is never built in."""
    return {"sandbox": MachineConfig("sandbox", "sandbox", {"network": "on"})}


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
    machines = builtin_machines()
    for name, entry in (data.get("machines") or {}).items():
        entry = dict(entry)
        kind = entry.pop("kind", "sandbox")
        level = entry.pop("level", None)
        menv = {str(k): str(v) for k, v in (entry.pop("env", {}) or {}).items()}
        full_auto = entry.pop("allow_full_auto", False) is True
        machines[name] = MachineConfig(name, kind, entry, level, menv, full_auto)
    server_key = env.get("AGENTBOX_API_KEY") or data.get("api_key")
    settings = Settings(
        home=home,
        api_key=server_key,
        api_keys=api_keys(list(data.get("api_keys") or []), env, server_key),
        default_machine=env.get("AGENTBOX_DEFAULT_MACHINE") or data.get("default_machine", "sandbox"),
        delegable=list(data.get("delegable", ["sandbox"])),
        machines=machines,
        idle_minutes=float(
            env.get("AGENTBOX_IDLE_MINUTES") or data.get("idle_minutes", DEFAULT_IDLE_MINUTES)
        ),
        purge_days=float(env.get("AGENTBOX_PURGE_DAYS") or data.get("purge_days", DEFAULT_PURGE_DAYS)),
        sandbox_uid=int(env.get("AGENTBOX_SANDBOX_UID") or data.get("sandbox_uid", 64999)),
        images_dir=Path(d) if (d := env.get("AGENTBOX_IMAGES") or data.get("images_dir")) else None,
        max_sandboxes=int(
            env.get("AGENTBOX_MAX_SANDBOXES") or data.get("max_sandboxes", DEFAULT_MAX_SANDBOXES)
        ),
        max_sandbox_memory_mb=int(
            env.get("AGENTBOX_MAX_SANDBOX_MEMORY_MB")
            or data.get("max_sandbox_memory_mb")
            or default_sandbox_memory_mb()
        ),
        models={str(k): dict(v) for k, v in (data.get("models") or {}).items()},
        compaction_model=(data.get("compaction") or {}).get("model"),
        agents=[dict(a) for a in data.get("agents") or []],
        allowed_hosts=listed(env.get("AGENTBOX_ALLOWED_HOSTS") or data.get("allowed_hosts")),
        allowed_origins=listed(env.get("AGENTBOX_ALLOWED_ORIGINS") or data.get("allowed_origins")),
        mcp_servers={str(k): dict(v) for k, v in (data.get("mcp_servers") or {}).items()},
        model_endpoints=[str(u) for u in data.get("model_endpoints") or []],
        tools=tool_config(dict(data.get("tools") or {})),
        knowledge_bases=knowledge_bases(data.get("knowledge_bases") or []),
    )
    if settings.compaction_model is not None and settings.compaction_model not in settings.models:
        raise ValueError(
            f"[compaction] model {settings.compaction_model!r} is not one of the configured [models]: "
            f"{sorted(settings.models)}"
        )
    if "AGENTBOX_NETWORK" in env and "sandbox" in machines:
        machines["sandbox"].options["network"] = env["AGENTBOX_NETWORK"]
    return settings
