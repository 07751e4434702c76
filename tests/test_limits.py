"""Model limits: where a model's context window, max output and vision come from, first match wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.agent.limits import (
    DEFAULT_LIMITS,
    KNOWN_LIMITS,
    LimitsError,
    ModelLimits,
    check_limit_options,
    model_limits,
)
from agentbox.config import load


def test_known_prefixes_with_the_longest_match_and_the_default_for_the_rest() -> None:
    assert model_limits("openai:gpt-4.1-mini") == KNOWN_LIMITS["gpt-4.1"]
    assert model_limits("anthropic:claude-3-5-haiku") == KNOWN_LIMITS["claude-3-5"]  # not "claude-"
    assert model_limits("anthropic:claude-sonnet-4-5") == KNOWN_LIMITS["claude-"]
    assert model_limits("openai:some-local-model") == DEFAULT_LIMITS
    assert model_limits("scripted") == ModelLimits(DEFAULT_LIMITS.context_window, vision=True)
    assert not DEFAULT_LIMITS.vision and model_limits("anthropic:claude-next").vision


def test_session_options_beat_the_config_which_beats_known_names() -> None:
    configured = {"context_window": 32_768, "max_output_tokens": 4096}
    assert model_limits("openai:gpt-4o", None, configured) == ModelLimits(32_768, 4096, vision=True)
    options = {"context_window": 8192, "vision": False}
    assert model_limits("openai:gpt-4o", options, configured) == ModelLimits(8192, 4096, vision=False)
    assert model_limits("openai:gpt-4o", {"max_output_tokens": 100}) == ModelLimits(128_000, 100, True)
    assert model_limits("openai:x", {"vision": True}, {"vision": False}).vision


@pytest.mark.parametrize("value", [0, -1, 1.5, "8k", True, None])
def test_a_limit_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(LimitsError, match="context_window"):
        check_limit_options({"context_window": value})
    with pytest.raises(LimitsError, match="max_output_tokens"):
        model_limits("openai:x", None, {"max_output_tokens": value})
    check_limit_options({"context_window": 1, "temperature": 0.2})  # 1 is the smallest; others pass


def test_the_config_file_names_limits_per_model(tmp_path: Path) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(
        '[models."openai:tiny"]\ncontext_window = 4096\nvision = true\n\n'
        '[[agents]]\nname = "r"\ndescription = "d"\n'
    )
    settings = load(path, env={"AGENTBOX_HOME": str(tmp_path)})
    tiny = model_limits("openai:tiny", None, settings.models.get("openai:tiny"))
    assert tiny.context_window == 4096 and tiny.vision
    assert settings.agents == [{"name": "r", "description": "d"}]
