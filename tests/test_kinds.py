"""The table of kinds: every row builds a machine of the one `Machine` interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.config import MachineConfig, Settings
from agentbox.machines.base import ExecRequest, Lifetime, Machine
from agentbox.machines.errors import MachineNotFound
from agentbox.machines.kinds import KINDS
from agentbox.machines.registry import Registry

#: What each kind needs in its entry to be built (not started: nothing is reached).
OPTIONS: dict[str, dict[str, object]] = {
    "ssh": {"host": "127.0.0.1", "user": "nobody", "password": "unused"},
    "docker": {"docker_host": "unix:///nonexistent/docker.sock"},
}


def settings_with(home: Path, **machines: MachineConfig) -> Settings:
    return Settings(home=home, machines={"sandbox": MachineConfig("sandbox", "sandbox"), **machines})


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_every_kind_builds_a_machine_of_the_interface(kind: str, sandbox_tmp: Path) -> None:
    options = OPTIONS.get(kind, {}) | ({"root": str(sandbox_tmp / "root")} if kind == "local" else {})
    config = MachineConfig("m", kind, options, env={"FROM_CONFIG": "1"})
    registry = Registry(settings_with(sandbox_tmp / "home", m=config))
    machine = registry.view("ses_kinds", "m")  # built, not started
    assert isinstance(machine, Machine)
    assert machine.kind == kind and machine.name == "m"
    assert machine.isolated == config.isolated
    assert isinstance(machine, Lifetime) == config.per_session
    env = machine.command_env(ExecRequest(env={"FROM_REQUEST": "2"}))
    assert env["FROM_CONFIG"] == "1" and env["FROM_REQUEST"] == "2"
    assert isinstance(machine.network_on, bool)


async def test_a_kind_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    registry = Registry(settings_with(tmp_path, odd=MachineConfig("odd", "nosuchkind")))
    with pytest.raises(MachineNotFound, match=r"kind 'nosuchkind'.*kinds: sandbox, docker, local, ssh"):
        registry.view("ses_kinds", "odd")
