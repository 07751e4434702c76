"""The machine registry's routing (seed 004): levels, the delegable allow-list, names, env providers."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, RegistryFactory, sandbox_settings

from agentbox.config import DEFAULT_LEVEL, DEFAULT_LEVELS, MachineConfig, Settings
from agentbox.machines.base import ExecRequest, Machine, environment_line
from agentbox.machines.errors import MachineDenied, MachineNotFound
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import SandboxMachine


async def env_of(m: Machine, **request_env: str) -> dict[str, str]:
    result = await m.exec(ExecRequest(argv=("env",), env=request_env, timeout=SANDBOX_DEADLINE))
    assert result.exit_code == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line)


def test_default_levels_are_seed_004s() -> None:
    assert MachineConfig("l", "local").required_level == DEFAULT_LEVELS["local"] == 2
    assert MachineConfig("s", "sandbox").required_level == DEFAULT_LEVEL == 4
    assert MachineConfig("s", "sandbox", level=7).required_level == 7


async def test_levels_gate_each_machine_at_its_boundary(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    registry = kit.registry
    with pytest.raises(MachineDenied):
        await registry.open("s1", "local", level=1)
    assert isinstance(await registry.open("s1", "local", level=2), LocalMachine)
    with pytest.raises(MachineDenied):
        await registry.open("s1", "sandbox", level=3)
    assert not registry.session_dir("s1").exists()  # refused before anything was made
    assert isinstance(await registry.open("s1", "sandbox", level=4), SandboxMachine)


async def test_a_configured_level_overrides_the_kind_default(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    settings = sandbox_settings(sandbox_tmp / "home")
    settings.machines["ops"] = MachineConfig("ops", "local", {"root": str(settings.home / "ops")}, level=7)
    registry = (await make_registry(settings)).registry
    with pytest.raises(MachineDenied):
        await registry.open(None, "ops", level=6)
    assert (await registry.open(None, "ops", level=7)).name == "ops"


async def test_delegable_is_the_allow_list_within_the_callers_level(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    settings = sandbox_settings(sandbox_tmp / "home")
    settings.delegable = ["sandbox", "local", "ghost"]  # ghost: on the list, not configured
    settings.machines["ops"] = MachineConfig("ops", "local")  # configured, not on the list
    registry = (await make_registry(settings)).registry
    assert registry.delegable(10) == ["sandbox", "local"]
    assert registry.delegable(4) == ["sandbox", "local"]
    assert registry.delegable(3) == ["local"]
    assert registry.delegable(2) == ["local"]
    assert registry.delegable(1) == []
    assert registry.choose("local", 2).name == "local"
    for name, level in (("local", 1), ("sandbox", 3), ("ops", 10), ("ghost", 10)):
        with pytest.raises(MachineDenied):
            registry.choose(name, level)


async def test_unknown_names_and_kinds_are_not_found(
    make_registry: RegistryFactory, sandbox_tmp: Path
) -> None:
    settings = sandbox_settings(sandbox_tmp / "home")
    settings.machines["weird"] = MachineConfig("weird", "teleporter")
    registry = (await make_registry(settings)).registry
    with pytest.raises(MachineNotFound):
        await registry.open("s1", "nope")
    with pytest.raises(MachineNotFound):
        registry.config("nope")
    with pytest.raises(MachineNotFound):
        await registry.open("s1", "weird")
    assert registry.entries() == []


async def test_default_machine_and_scopes(make_registry: RegistryFactory) -> None:
    kit = await make_registry()
    registry = kit.registry
    s1 = await registry.open("s1")
    assert isinstance(s1, SandboxMachine)  # the default machine
    assert await registry.open("s1", "sandbox") is s1
    assert await registry.open("s2") is not s1  # per session
    assert await registry.open("s1", "local") is await registry.open("s2", "local")  # shared
    settings = Settings(home=kit.home, default_machine="local", machines=kit.settings.machines)
    assert isinstance(await (await make_registry(settings)).registry.open("s1"), LocalMachine)


async def test_environment_line(make_registry: RegistryFactory) -> None:
    registry = (await make_registry()).registry
    assert (
        environment_line(await registry.open("s1"))
        == "Machine: sandbox (sandbox, linux), workspace /workspace"
    )
    local = await registry.open("s1", "local")
    assert environment_line(local) == f"Machine: local (local, linux), workspace {local.root}"


async def test_env_providers_reach_every_command(make_registry: RegistryFactory, sandbox_tmp: Path) -> None:
    settings = sandbox_settings(sandbox_tmp / "home")
    settings.machines["sandbox"].env = {"TZ": "UTC", "SHARED": "config"}
    kit = await make_registry(settings)
    calls: list[tuple[str, str | None]] = []

    def provider(machine: str, session_id: str | None) -> dict[str, str]:
        calls.append((machine, session_id))
        return {"SESSION_TAG": f"tag-{session_id}", "SHARED": "provider"}

    kit.registry.providers.append(provider)
    entry = await kit.registry.open_entry("s1")
    env = await env_of(entry.machine, REQUEST="yes")
    assert {k: env.get(k) for k in ("TZ", "SESSION_TAG", "SHARED", "REQUEST")} == {
        "TZ": "UTC", "SESSION_TAG": "tag-s1", "SHARED": "provider", "REQUEST": "yes",
    }  # fmt: skip
    assert (await env_of(entry.machine, SHARED="request"))["SHARED"] == "request"  # the request wins
    process = await entry.machine.spawn(ExecRequest(command="echo $SESSION_TAG"))
    assert await process.stdout.read() == b"tag-s1\n"
    await process.wait()
    assert (await env_of(await kit.registry.open("s2")))["SESSION_TAG"] == "tag-s2"
    local_env = await env_of(await kit.registry.open("s1", "local"))
    assert local_env["SESSION_TAG"] == "tag-None"  # a shared machine has no session
    await kit.registry.suspend(entry)
    assert (await env_of(await kit.registry.open("s1")))["SESSION_TAG"] == "tag-s1"  # and after a rebuild
    assert ("sandbox", "s1") in calls and ("local", None) in calls
