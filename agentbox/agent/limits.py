"""How much a model can take and give: its context window and max output tokens.

Compaction needs both (Flue a.10: the reserve is min(20 000, max output); the trigger is the
window minus the reserve). Where they come from, first match wins:

1. the session's `model_options` keys `context_window` / `max_output_tokens`;
2. the server config, `[models."<provider>:<model>"]` with the same keys;
3. `KNOWN_LIMITS`: the longest matching model-name prefix of well-known models;
4. `DEFAULT_LIMITS`: a window most current models (local ones included) have at least.

A model whose real window is smaller than what this says still works: its provider's
context-overflow error triggers compaction too, and the turn retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: `model_options` keys read here; adapters keep them out of request bodies.
LIMIT_OPTIONS = frozenset({"context_window", "max_output_tokens"})


@dataclass(frozen=True)
class ModelLimits:
    context_window: int
    max_output_tokens: int | None = None


#: For a model no option, config or known prefix names.
DEFAULT_LIMITS = ModelLimits(128_000, None)

#: Model name (without the provider) prefix -> limits, for models people commonly run.
KNOWN_LIMITS: dict[str, ModelLimits] = {
    "gpt-4.1": ModelLimits(1_047_576, 32_768),
    "gpt-4o": ModelLimits(128_000, 16_384),
    "gpt-5": ModelLimits(400_000, 128_000),
    "o3": ModelLimits(200_000, 100_000),
    "o4-mini": ModelLimits(200_000, 100_000),
    "claude-": ModelLimits(200_000, 64_000),
    "claude-3-5": ModelLimits(200_000, 8192),
    "claude-opus-4": ModelLimits(200_000, 32_000),
    "qwen2.5-coder": ModelLimits(32_768, 8192),
    "llama3": ModelLimits(8192, 4096),
    "llama3.1": ModelLimits(128_000, 4096),
}


class LimitsError(ValueError):
    """A limit option that is not a positive integer."""


def model_limits(
    model: str, options: Mapping[str, Any] | None = None, configured: Mapping[str, Any] | None = None
) -> ModelLimits:
    """The limits of `model` (`provider:name`), by the precedence in the module docstring."""
    base = known_limits(model.partition(":")[2] or model)
    for source in (configured or {}, options or {}):
        base = ModelLimits(
            _positive(source, "context_window", base.context_window),
            _positive(source, "max_output_tokens", base.max_output_tokens),
        )
    return base


def known_limits(name: str) -> ModelLimits:
    matches = [prefix for prefix in KNOWN_LIMITS if name.startswith(prefix)]
    return KNOWN_LIMITS[max(matches, key=len)] if matches else DEFAULT_LIMITS


def check_limit_options(options: Mapping[str, Any]) -> None:
    """Refuse limit options that are not positive integers (at session creation)."""
    for key in LIMIT_OPTIONS & set(options):
        _positive(options, key, None)


def _positive(source: Mapping[str, Any], key: str, default: Any) -> Any:
    if key not in source:
        return default
    value = source[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LimitsError(f"{key} must be a positive integer, not {value!r}")
    return value
