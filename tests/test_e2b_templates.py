"""E2B templates as agentbox machines, through the stock `e2b` SDK against a real `agentbox serve`.

The server has two per-session sandbox machines with different memory limits, so which one a
template picked is seen in what the sandbox really gets (its cgroup's limit in a metrics
sample), not only in what the control plane says. The template a sandbox was made from
survives a restart; one this server does not have is a 404 that lists those it has.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException, ServiceBusyException

from agentbox.config import load
from agentbox.e2b.sandboxes import E2BError, template_machine, templates
from tests.conftest import Server, point_e2b_sdk, start_server, stop_server, traversable

API_KEY = "e2b-templates-key"
MIB = 1024 * 1024
#: The default machine's memory, and the `small` machine's. `tiny` names an image that is not
#: built: picked by that name, it fails to start.
DEFAULT_MB, SMALL_MB = 512, 256
CONFIG = f"""
[machines.sandbox]
memory_mb = {DEFAULT_MB}

[machines.small]
kind = "sandbox"
memory_mb = {SMALL_MB}

[machines.tiny]
kind = "sandbox"
image = "tiny"

[machines.host]
kind = "local"
"""


def serve(home: Path) -> Server:
    config = home.parent / "agentbox.toml"
    config.write_text(CONFIG)
    return start_server(home, env={"AGENTBOX_API_KEY": API_KEY, "AGENTBOX_CONFIG": str(config)})


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = traversable(tmp_path_factory.mktemp("e2b-templates"), tmp_path_factory) / "home"
    made.mkdir()
    return made


def memory_total(sandbox: Sandbox) -> int:
    """The memory limit of the sandbox's cgroup, as its newest metrics sample reads it."""
    sandbox.commands.run("true")
    return sandbox.get_metrics()[-1].mem_total


def test_a_template_picks_the_machine_and_outlives_a_restart(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = serve(home)
    try:
        point_e2b_sdk(monkeypatch, first)
        plain = Sandbox.create(timeout=600)
        small = Sandbox.create(template="small", timeout=600)
        info = Sandbox.get_info(small.sandbox_id)
        assert (info.template_id, info.memory_mb) == ("small", SMALL_MB)
        assert Sandbox.get_info(plain.sandbox_id).memory_mb == DEFAULT_MB
        assert memory_total(small) == SMALL_MB * MIB
        assert memory_total(plain) == DEFAULT_MB * MIB
        listed = {s.sandbox_id: s.template_id for s in Sandbox.list().next_items()}
        assert listed[small.sandbox_id] == "small" and listed[plain.sandbox_id] == "base"
        small.files.write("/workspace/kept.txt", "on the small machine")
        with pytest.raises(SandboxException) as refused:
            Sandbox.create(template="nope")
        assert "'nope' not found" in str(refused.value) and "'small'" in str(refused.value)
        with pytest.raises(SandboxException) as host:
            Sandbox.create(template="host")  # the host is no per-session sandbox: no template
        assert "'host' not found" in str(host.value)
        with pytest.raises(
            SandboxException
        ) as unbuilt:  # its machine's image: picked, and it says what is missing
            Sandbox.create(template="tiny")
        assert not isinstance(unbuilt.value, ServiceBusyException)  # not "busy, retry": a retry cannot help
        assert str(unbuilt.value).startswith("404: template 'tiny' is not ready") and "is not built" in str(
            unbuilt.value
        )
        plain.kill()
    finally:
        stop_server(first)
    second = serve(home)
    try:
        point_e2b_sdk(monkeypatch, second)
        again = Sandbox.connect(small.sandbox_id)
        assert again.files.read("/workspace/kept.txt") == "on the small machine"
        assert memory_total(again) == SMALL_MB * MIB  # started again on the machine it was made on
        assert Sandbox.get_info(small.sandbox_id).template_id == "small"
        again.kill()
    finally:
        stop_server(second)


def test_the_template_list_names_only_per_session_machines(tmp_path: Path) -> None:
    config = tmp_path / "agentbox.toml"
    config.write_text(CONFIG)
    settings = load(config, {"AGENTBOX_HOME": str(tmp_path / "home")})
    assert templates(settings) == ["base", "code-interpreter-v1", "sandbox", "small", "tiny"]
    assert template_machine(settings, "code-interpreter-v1").name == "sandbox"
    assert template_machine(settings, "small").name == "small"
    config.write_text(CONFIG.replace("[machines.tiny]", "[machines.other]"))  # by its image's name
    assert template_machine(load(config, {"AGENTBOX_HOME": str(tmp_path / "home")}), "tiny").name == "other"
    with pytest.raises(E2BError) as host:
        template_machine(settings, "host")
    assert host.value.status == 404
