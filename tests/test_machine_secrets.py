"""Secret fields of machine config: encrypted at rest, decrypted only on open, redacted in queries."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.config import MachineConfig, Settings, load
from agentbox.machines.registry import Registry
from agentbox.secrets import REDACTED, SecretBox


def settings_with_secret(home: Path, token: str) -> Settings:
    settings = Settings(home=home)
    settings.machines["vault"] = MachineConfig("vault", "local", {"root": str(home / "v"), "password": token})
    return settings


def test_describe_never_shows_plaintext(tmp_path: Path) -> None:
    token = SecretBox(tmp_path).encrypt("hunter2")
    described = {m["name"]: m for m in Registry(settings_with_secret(tmp_path, token)).describe()}
    assert described["vault"]["options"]["password"] == REDACTED
    assert "hunter2" not in repr(described)


def test_secrets_decrypted_when_opening(tmp_path: Path) -> None:
    token = SecretBox(tmp_path).encrypt("hunter2")
    registry = Registry(settings_with_secret(tmp_path, token))
    config = registry.config("vault")
    assert config.options["password"].startswith("enc:")
    assert registry.secrets(config)["password"] == "hunter2"


async def test_open_uses_decrypted_options(tmp_path: Path) -> None:
    token = SecretBox(tmp_path).encrypt("hunter2")
    registry = Registry(settings_with_secret(tmp_path, token))
    machine = await registry.open(None, "vault")
    assert machine.root == str((tmp_path / "v").resolve())
    await registry.shutdown()


def test_wrong_key_is_refused(tmp_path: Path) -> None:
    token = SecretBox(tmp_path / "other").encrypt("hunter2")
    registry = Registry(settings_with_secret(tmp_path, token))
    with pytest.raises(Exception, match="key"):
        registry.secrets(registry.config("vault"))


def test_toml_and_env(tmp_path: Path) -> None:
    cfg = tmp_path / "agentbox.toml"
    cfg.write_text(
        'api_key = "k1"\n[machines.box]\nkind = "sandbox"\nnetwork = "off"\nmemory_mb = 256\nenv = { TZ = "UTC" }\n'
    )
    s = load(cfg, env={"AGENTBOX_HOME": str(tmp_path / "h"), "AGENTBOX_API_KEY": "k2"})
    assert s.api_key == "k2"  # environment wins over the file
    assert s.home == tmp_path / "h"
    box = s.machines["box"]
    assert box.options == {"network": "off", "memory_mb": 256} and box.env == {"TZ": "UTC"}
    assert box.required_level == 4
    assert sorted(s.machines) == ["box", "sandbox"]  # the host is never a built-in machine


def test_the_host_is_a_machine_only_when_configured(tmp_path: Path) -> None:
    cfg = tmp_path / "agentbox.toml"
    cfg.write_text(
        '[machines.host]\nkind = "local"\nroot = "/srv"\n[machines.ops]\nkind = "local"\nallow_full_auto = true\n'
    )
    s = load(cfg, env={"AGENTBOX_HOME": str(tmp_path / "h")})
    host, ops = s.machines["host"], s.machines["ops"]
    assert host.required_level == 2 and not host.isolated and not host.allow_full_auto
    assert host.options == {"root": "/srv"}  # the operator's consent is not a machine option
    assert ops.allow_full_auto and not s.machines["sandbox"].allow_full_auto
