"""The table of machine kinds: what `kind = "..."` in a `[machines.<name>]` entry builds.

A kind is one module plus one row here. The registry knows nothing of any kind: it calls the
row's `make` to build one. A kind is shared by every session when `config.HOST_KINDS` names
it; otherwise each session gets its own machine, counted against the server's caps,
suspended when idle and recorded in the session's marker through the `Lifetime` protocol.
A kind that needs something shared by all its machines (the sandbox kind's `SandboxHost`:
bwrap, the sandbox uid, cgroups) names a `shared` factory, made once per registry.

A kind whose module pulls in a heavy client (docker's, asyncssh, E2B's: most of a second) is
imported by its row's functions when a machine of it is first made, so a CLI call or a
server that never uses the kind does not pay for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.config import MachineConfig, Settings, home_label
from agentbox.machines.base import Machine
from agentbox.machines.cgroups import Limits
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.images import DEFAULT_IMAGE
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import (
    DEFAULT_HOME_MB,
    DEFAULT_TMP_MB,
    SandboxConfig,
    SandboxHost,
    SandboxMachine,
)

if TYPE_CHECKING:
    from agentbox.machines.docker import DockerHost, DockerMachine
    from agentbox.machines.e2b import E2BMachine
    from agentbox.machines.ssh import SshMachine

#: A sandbox's memory limit when its entry names none, in MiB.
DEFAULT_MEMORY_MB = 2048


@dataclass(frozen=True)
class Build:
    """What the registry hands a kind to make one machine."""

    config: MachineConfig
    """The entry, its secrets decrypted."""
    settings: Settings
    env: dict[str, str]
    """The entry's `env` and what the env providers add for this session."""
    shared: Any
    """The kind's shared object (`Kind.shared`), or None."""
    session_id: str | None = None
    """The session a per-session machine is for; None for a shared machine."""
    instance_id: str = ""
    """The id this lifetime keeps (a recovered one after a restart)."""
    session_dir: Path | None = None
    """The session's directory: `workspace/` (persistent) and `run/<machine>/` (per lifetime)."""
    recovered: dict[str, Any] = field(default_factory=dict)
    """What the session's marker recorded of the last lifetime (`Lifetime.marker`), after a restart."""


@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[Build], Machine]
    shared: Callable[[Settings], Any] | None = None
    """Made once per registry and handed to every `make` of the kind."""
    workspace_disk: bool = False
    """The session's workspace is an ext4 image of `disk_mb` (mounted before each start)."""
    sweep: Callable[[Any, list[MachineConfig], set[str]], Awaitable[list[str]]] | None = None
    """After a restart: remove what machines of these entries (secrets decrypted) left that no
    live session's instance id (the set) names, such as a dead server's containers or E2B
    sandboxes. Only this home's: each kind tells its own by a label. Returns what it removed."""


def memory_mb(config: MachineConfig) -> int:
    """The memory limit of this entry's machines, in MiB (0: none)."""
    return int(config.options.get("memory_mb", DEFAULT_MEMORY_MB) or 0)


def sandbox_config(config: MachineConfig, env: dict[str, str]) -> SandboxConfig:
    o = config.options
    memory = memory_mb(config)
    return SandboxConfig(
        network=config.network_on,
        limits=Limits(
            memory_bytes=memory * 1024 * 1024 if memory else None,
            pids=int(o["pids"]) if o.get("pids") else Limits().pids,
            cpus=float(o["cpus"]) if o.get("cpus") else Limits().cpus,
        ),
        system_layer=bool(o.get("system_layer", True)),
        env=env,
        tmp_mb=int(o.get("tmp_mb", DEFAULT_TMP_MB)),
        home_mb=int(o.get("home_mb", DEFAULT_HOME_MB)),
        # Named: it must be there. Unnamed: `base` when built, else the host's /usr. "": the host's.
        image=str(o["image"]) or None if "image" in o else DEFAULT_IMAGE,
        image_required="image" in o and bool(o["image"]),
        browser=bool(o.get("browser", False)),
    )


def make_sandbox(build: Build) -> SandboxMachine:
    assert build.session_dir is not None
    return SandboxMachine(
        build.config.name,
        build.instance_id,
        build.shared,
        sandbox_config(build.config, build.env),
        build.session_dir / "workspace",
        build.session_dir / "run" / build.config.name,
    )


def make_local(build: Build) -> LocalMachine:
    root = Path(build.config.options.get("root") or build.settings.home / "local")
    return LocalMachine(build.config.name, root, build.env)


def sandbox_host(settings: Settings) -> SandboxHost:
    return SandboxHost(settings.home, uid=settings.sandbox_uid, images=settings.images)


def make_docker(build: Build) -> DockerMachine:
    from agentbox.machines.docker import DockerMachine, DockerOptions

    assert build.session_dir is not None
    try:
        options = DockerOptions.from_options(build.config.options)
    except ValueError as exc:
        raise MachineUnavailable(f"machine {build.config.name!r}: {exc}") from None
    return DockerMachine(
        build.config.name, build.instance_id, build.shared, options, build.session_dir / "workspace",
        build.session_dir / "run" / build.config.name, env=build.env,
        container_id=build.recovered.get("container_id"),
    )  # fmt: skip


def docker_host(settings: Settings) -> DockerHost:
    from agentbox.machines.docker import DockerHost

    return DockerHost(settings.home, images=settings.images)


async def sweep_docker(host: DockerHost, configs: list[MachineConfig], keep: set[str]) -> list[str]:
    from agentbox.machines.docker import DockerOptions

    hosts = []
    for config in configs:
        try:
            hosts.append(DockerOptions.from_options(config.options).docker_host)
        except ValueError:  # its machines fail to start with that error; nothing of it to sweep
            continue
    return await host.sweep(hosts, keep)


def make_ssh(build: Build) -> SshMachine:
    from agentbox.machines.ssh import SshMachine, SshOptions

    try:
        options = SshOptions.from_options(build.config.options)
    except ValueError as exc:
        raise MachineUnavailable(f"machine {build.config.name!r}: {exc}") from None
    return SshMachine(build.config.name, options, build.env)


def make_e2b(build: Build) -> E2BMachine:
    from agentbox.machines.e2b import E2BMachine, E2BOptions

    try:
        options = E2BOptions.from_options(build.config.options)
    except ValueError as exc:
        raise MachineUnavailable(f"machine {build.config.name!r}: {exc}") from None
    return E2BMachine(
        build.config.name, build.instance_id, options, build.env,
        session_id=build.session_id, sandbox_id=build.recovered.get("e2b_sandbox_id"), home=build.shared,
    )  # fmt: skip


def e2b_owner(settings: Settings) -> str:
    """The label every e2b machine of this home puts on its sandboxes (`HOME_KEY`)."""
    return home_label(settings.home)


async def sweep_e2b(label: str, configs: list[MachineConfig], keep: set[str]) -> list[str]:
    from agentbox.machines.e2b import E2BOptions
    from agentbox.machines.e2b.sweep import sweep

    entries = []
    for config in configs:
        try:
            entries.append(E2BOptions.from_options(config.options))
        except ValueError:  # its machines fail to start with that error; nothing of it to sweep
            continue
    return await sweep(label, entries, keep)


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("sandbox", make_sandbox, shared=sandbox_host, workspace_disk=True),
        Kind("docker", make_docker, shared=docker_host, sweep=sweep_docker),
        Kind("local", make_local),
        Kind("ssh", make_ssh),
        Kind("e2b", make_e2b, shared=e2b_owner, sweep=sweep_e2b),
    )
}
