"""How much a model can take and give: its context window, max output tokens, and images.

Compaction needs both (Flue a.10: the reserve is min(20 000, max output); the trigger is the
window minus the reserve). Where they come from, first match wins:

1. the session's `model_options` keys `context_window` / `max_output_tokens` / `vision`;
2. the server config, `[models."<provider>:<model>"]` with the same keys;
3. `KNOWN_LIMITS`: the longest matching model-name prefix of well-known models;
4. `DEFAULT_LIMITS`: a window most current models (local ones included) have at least.

`vision` (whether the model is shown images, `agent.vision`) defaults to what the model is
known for: true for the families in `KNOWN_LIMITS` that take images, for every `anthropic:`
model (all current Claude models do) and for the scripted model; false for any other model
(an OpenAI-compatible server's local model, most of which take text only). A wrong "false"
costs the model the picture but it is told why (`visionUnavailable`); a wrong "true" would
have the provider refuse every request that carries an image, failing the turn.

A model whose real window is smaller than what this says still works: its provider's
context-overflow error triggers compaction too, and the turn retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: `model_options` keys read here; adapters keep them out of request bodies.
LIMIT_OPTIONS = frozenset({"context_window", "max_output_tokens", "vision"})
#: Providers whose every model takes images (`vision` true unless configured otherwise).
VISION_PROVIDERS = frozenset({"anthropic", "scripted"})


@dataclass(frozen=True)
class ModelLimits:
    context_window: int
    max_output_tokens: int | None = None
    vision: bool = False
    """Whether the model is shown images (see the module docstring for the default)."""


#: For a model no option, config or known prefix names.
DEFAULT_LIMITS = ModelLimits(128_000, None)

#: Model name (without the provider) prefix -> limits, for models people commonly run.
KNOWN_LIMITS: dict[str, ModelLimits] = {
    "gpt-4.1": ModelLimits(1_047_576, 32_768, vision=True),
    "gpt-4o": ModelLimits(128_000, 16_384, vision=True),
    "gpt-5": ModelLimits(400_000, 128_000, vision=True),
    "o3": ModelLimits(200_000, 100_000, vision=True),
    "o4-mini": ModelLimits(200_000, 100_000, vision=True),
    "claude-": ModelLimits(200_000, 64_000, vision=True),
    "claude-3-5": ModelLimits(200_000, 8192, vision=True),
    "claude-opus-4": ModelLimits(200_000, 32_000, vision=True),
    "qwen2.5-coder": ModelLimits(32_768, 8192),
    "llama3": ModelLimits(8192, 4096),
    "llama3.1": ModelLimits(128_000, 4096),
}


class LimitsError(ValueError):
    """A limit option of the wrong kind: a count that is not a positive integer, a flag not a bool."""


def model_limits(
    model: str, options: Mapping[str, Any] | None = None, configured: Mapping[str, Any] | None = None
) -> ModelLimits:
    """The limits of `model` (`provider:name`), by the precedence in the module docstring."""
    provider, _, name = model.partition(":")
    base = known_limits(name or model)
    if provider in VISION_PROVIDERS:
        base = ModelLimits(base.context_window, base.max_output_tokens, vision=True)
    for source in (configured or {}, options or {}):
        base = ModelLimits(
            _positive(source, "context_window", base.context_window),
            _positive(source, "max_output_tokens", base.max_output_tokens),
            _flag(source, "vision", base.vision),
        )
    return base


def known_limits(name: str) -> ModelLimits:
    matches = [prefix for prefix in KNOWN_LIMITS if name.startswith(prefix)]
    return KNOWN_LIMITS[max(matches, key=len)] if matches else DEFAULT_LIMITS


def check_limit_options(options: Mapping[str, Any]) -> None:
    """Refuse limit options that are not positive integers (at session creation)."""
    for key in LIMIT_OPTIONS & set(options):
        if key == "vision":
            _flag(options, key, False)
        else:
            _positive(options, key, None)


def _positive(source: Mapping[str, Any], key: str, default: Any) -> Any:
    if key not in source:
        return default
    value = source[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LimitsError(f"{key} must be a positive integer, not {value!r}")
    return value


def _flag(source: Mapping[str, Any], key: str, default: bool) -> bool:
    if key not in source:
        return default
    value = source[key]
    if not isinstance(value, bool):
        raise LimitsError(f"{key} must be true or false, not {value!r}")
    return value
