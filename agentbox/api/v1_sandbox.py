"""AIO `/v1/sandbox`: what the sandbox is, as seen from inside it, and its installed packages.

Everything is measured inside the machine by running commands there (never the server's
own view): the system facts once per machine (`probe`, cached for the machine's life),
the listening ports on every call (they change). `GET /v1/sandbox` answers upstream's
`SandboxResponse`: the usual wrapper with `data` a human-readable text, plus the required
top-level `home_dir`, `version` and `detail {system, runtime, utils}`.

Hooks (`/v1/sandbox/hooks`) are not offered: a sandbox here has no shutdown to hook into
that the API could honour (its processes die with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox import __version__
from agentbox.api.envelope import ok
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import Envelope, v1_reply
from agentbox.machines.base import ExecRequest, Machine

router = APIRouter(prefix="/v1/sandbox", tags=["sandbox"])

#: Seconds a probe command (facts, ports, package lists) may run inside the sandbox.
PROBE_TIMEOUT_SECONDS = 60.0
#: Bytes of a probe's output kept (a `pip list` of a big environment is well under this).
PROBE_OUTPUT_BYTES = 4 * 1024 * 1024
#: /proc/net/tcp state of a listening socket.
TCP_LISTEN = "0A"

#: Interpreters looked for, by runtime; names that resolve to one binary become aliases.
RUNTIME_NAMES: dict[str, tuple[str, ...]] = {
    "python": ("python3", "python"),
    "nodejs": ("node", "nodejs"),
}
#: Command-line tools reported under `detail.utils` when present, by category.
UTILS: dict[str, dict[str, str]] = {
    "Package managers": {"pip3": "Python package installer", "uv": "Python package manager", "npm": "Node.js package manager", "apt-get": "Debian package manager"},
    "Version control": {"git": "Distributed version control"},
    "Network": {"curl": "Transfer data from or to a URL", "wget": "Download files over HTTP(S)/FTP", "ssh": "OpenSSH client"},
    "Search and text": {"rg": "ripgrep: fast recursive search", "grep": "Search text with patterns", "sed": "Stream editor", "awk": "Pattern scanning and processing", "jq": "JSON processor", "find": "Search for files"},
    "Archives": {"tar": "Tape archiver", "gzip": "gzip compression", "zip": "Create zip archives", "unzip": "Extract zip archives", "xz": "xz compression"},
    "Build": {"make": "Build automation", "gcc": "GNU C compiler", "cc": "C compiler"},
}  # fmt: skip

PROBE_SCRIPT = r"""
echo "os=$(uname -s)"
echo "kernel=$(uname -r)"
echo "arch=$(uname -m)"
echo "user=$(id -un 2>/dev/null || id -u)"
echo "home=$HOME"
if [ -r /etc/os-release ]; then . /etc/os-release; echo "distro=$PRETTY_NAME"; fi
tz="$TZ"
[ -z "$tz" ] && [ -r /etc/timezone ] && tz=$(cat /etc/timezone)
[ -z "$tz" ] && [ -L /etc/localtime ] && tz=$(readlink /etc/localtime | sed 's|.*/zoneinfo/||')
echo "timezone=${tz:-UTC}"
for name in $RUNTIMES; do
  bin=$(command -v "$name" 2>/dev/null) || continue
  real=$(readlink -f "$bin" 2>/dev/null || echo "$bin")
  ver=$("$bin" --version 2>&1 | head -n 1)
  echo "runtime=$name|$bin|$real|$ver"
done
for name in $UTILS; do
  command -v "$name" >/dev/null 2>&1 && echo "util=$name"
done
exit 0
"""

PORTS_SCRIPT = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; exit 0"
PIP_LIST = "python3 -m pip list --format=json --disable-pip-version-check 2>/dev/null"
#: Exit status of NPM_LIST when there is no npm at all.
NO_NPM_EXIT = 3
NPM_LIST = f"command -v npm >/dev/null 2>&1 || exit {NO_NPM_EXIT}; npm ls -g --depth=0 --json 2>/dev/null"


@dataclass(frozen=True)
class ToolSpec:
    ver: str | None
    bin: str
    alias: list[str]


@dataclass(frozen=True)
class Facts:
    """What a probe found; stable for the machine's life."""

    os: str
    os_version: str
    arch: str
    user: str
    home_dir: str
    timezone: str
    runtimes: dict[str, list[ToolSpec]]
    utils: set[str] = field(default_factory=set)


class SystemInfo(BaseModel):
    os: str
    os_version: str
    arch: str
    user: str
    home_dir: str
    workspace: str
    timezone: str
    occupied_ports: list[str]


class RuntimeInfo(BaseModel):
    ver: str | None
    bin: str
    alias: list[str]


class ToolInfo(BaseModel):
    name: str
    description: str


class UtilCategory(BaseModel):
    category: str
    tools: list[ToolInfo]


class ContextDetail(BaseModel):
    system: SystemInfo
    runtime: dict[str, list[RuntimeInfo]]
    utils: list[UtilCategory]


class SandboxContext(Envelope[str]):
    """`data` is the summary text; the facts are beside it (upstream's `SandboxResponse`)."""

    home_dir: str
    workspace: str
    version: str
    detail: ContextDetail


class Package(BaseModel):
    name: str | None
    version: str | None


#: Probe results per machine object (a machine is rebuilt in place, so it keeps its entry).
_facts: WeakKeyDictionary[Machine, Facts] = WeakKeyDictionary()


async def run(machine: Machine, command: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = await machine.exec(
        ExecRequest(
            command=command, env=env or {}, timeout=PROBE_TIMEOUT_SECONDS, output_limit=PROBE_OUTPUT_BYTES
        )
    )
    return result.exit_code, result.stdout.decode("utf-8", "replace")


def version_of(banner: str) -> str | None:
    """`Python 3.11.2` -> `3.11.2`, `v20.11.1` -> `20.11.1`."""
    words = banner.split()
    return words[-1].lstrip("v") if words else None


def parse_facts(text: str) -> Facts:
    values: dict[str, str] = {}
    runtimes: dict[str, dict[str, ToolSpec]] = {kind: {} for kind in RUNTIME_NAMES}
    utils: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "runtime":
            name, bin_path, real, banner = [*value.split("|", 3), "", "", ""][:4]
            kind = next(k for k, names in RUNTIME_NAMES.items() if name in names)
            known = runtimes[kind].get(real)
            if known is None:
                runtimes[kind][real] = ToolSpec(version_of(banner), bin_path, [name])
            else:
                known.alias.append(name)
        elif key == "util":
            utils.add(value)
        else:
            values[key] = value
    return Facts(
        os=values.get("os", "Linux"),
        os_version=values.get("distro") or values.get("kernel", ""),
        arch=values.get("arch", ""),
        user=values.get("user", ""),
        home_dir=values.get("home", ""),
        timezone=values.get("timezone", "UTC"),
        runtimes={kind: list(specs.values()) for kind, specs in runtimes.items()},
        utils=utils,
    )


async def probe(machine: Machine) -> Facts:
    """The machine's system facts, measured inside it once."""
    facts = _facts.get(machine)
    if facts is None:
        env = {
            "RUNTIMES": " ".join(n for names in RUNTIME_NAMES.values() for n in names),
            "UTILS": " ".join(name for tools in UTILS.values() for name in tools),
        }
        _, text = await run(machine, PROBE_SCRIPT, env)
        facts = _facts[machine] = parse_facts(text)
    return facts


def listening_ports(proc_net_tcp: str) -> list[str]:
    """Local ports in LISTEN state from the text of /proc/net/tcp and tcp6, sorted."""
    ports: set[int] = set()
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] == TCP_LISTEN and ":" in fields[1]:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return [str(p) for p in sorted(ports)]


def summary(facts: Facts, workspace: str, ports: list[str]) -> str:
    def runtime(kind: str) -> str:
        specs = facts.runtimes.get(kind, [])
        return ", ".join(f"{s.ver} ({s.bin})" for s in specs) or "not installed"

    return "\n".join(
        [
            "System Environment:",
            f"- OS: {facts.os} ({facts.os_version}), {facts.arch}",
            f"- User: {facts.user}, home {facts.home_dir}",
            f"- Workspace: {workspace} (kept across sandbox rebuilds)",
            f"- Timezone: {facts.timezone}",
            f"- Python: {runtime('python')}",
            f"- Node.js: {runtime('nodejs')}",
            f"- Listening ports: {', '.join(ports) or 'none'}",
            f"- Tools: {', '.join(sorted(facts.utils)) or 'none'}",
        ]
    )


def detail(facts: Facts, workspace: str, ports: list[str]) -> dict[str, Any]:
    return {
        "system": {
            "os": facts.os,
            "os_version": facts.os_version,
            "arch": facts.arch,
            "user": facts.user,
            "home_dir": facts.home_dir,
            "workspace": workspace,
            "timezone": facts.timezone,
            "occupied_ports": ports,
        },
        "runtime": {
            kind: [{"ver": s.ver, "bin": s.bin, "alias": s.alias} for s in facts.runtimes.get(kind, [])]
            for kind in RUNTIME_NAMES
        },
        "utils": [
            {
                "category": category,
                "tools": [{"name": n, "description": d} for n, d in tools.items() if n in facts.utils],
            }
            for category, tools in UTILS.items()
            if any(n in facts.utils for n in tools)
        ],
    }


@router.get("", response_model=v1_reply(SandboxContext))
async def get_context(sb: CurrentSandbox) -> JSONResponse:
    facts = await probe(sb.machine)
    _, tcp = await run(sb.machine, PORTS_SCRIPT)
    ports = listening_ports(tcp)
    workspace = sb.machine.root
    return ok(
        summary(facts, workspace, ports),
        home_dir=facts.home_dir,
        workspace=workspace,
        version=__version__,
        detail=detail(facts, workspace, ports),
    )


@router.get("/packages/python", response_model=v1_reply(list[Package]))
async def python_packages(sb: CurrentSandbox) -> JSONResponse:
    """`pip list` of the sandbox's `python3`: `[{name, version}]`, empty when there is no pip."""
    code, text = await run(sb.machine, PIP_LIST)
    packages = parsed(text, list) if code == 0 else None
    if packages is None:
        return ok([], message="No pip for python3 in this sandbox")
    return ok([{"name": p.get("name"), "version": p.get("version")} for p in packages if isinstance(p, dict)])


@router.get("/packages/nodejs", response_model=v1_reply(list[Package]))
async def nodejs_packages(sb: CurrentSandbox) -> JSONResponse:
    """Global npm packages: `[{name, version}]`, empty when there is no Node.js."""
    code, text = await run(sb.machine, NPM_LIST)
    tree = parsed(text, dict) if code != NO_NPM_EXIT else None
    if tree is None:
        return ok([], message="No Node.js (npm) in this sandbox")
    deps = tree.get("dependencies") or {}
    return ok([{"name": name, "version": (info or {}).get("version")} for name, info in sorted(deps.items())])


def parsed(text: str, kind: type[Any]) -> Any:
    """`text` as JSON of type `kind`, or None when it is not (a tool that failed half-way)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, kind) else None
