"""Real model providers behind the `Model` protocol: `openai:<model>` and `anthropic:<model>`.

Both are thin adapters on httpx and one SSE parser (no SDKs: the official ones depend on
httpx2). Failures are typed (`errors`), retries are `retry.with_retries` / `RetryingModel`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agentbox.agent.models import Model
from agentbox.agent.providers.anthropic import AnthropicModel
from agentbox.agent.providers.endpoint import BASE_URL_OPTION
from agentbox.agent.providers.openai import OpenAIModel
from agentbox.agent.reach import Reach

__all__ = ["PROVIDERS", "AnthropicModel", "OpenAIModel", "check_endpoint", "provider_model"]

#: Model name prefixes and the adapters they select.
PROVIDERS: dict[str, Callable[[str, Mapping[str, Any] | None, Reach | None], Model]] = {
    "openai": OpenAIModel,
    "anthropic": AnthropicModel,
}


def provider_model(
    name: str, options: Mapping[str, Any] | None = None, reach: Reach | None = None
) -> Model | None:
    """The adapter for `<provider>:<model>`; None if the name names no provider here.

    `reach`: the session's policy for its own `base_url` (None: the options are trusted)."""
    provider, sep, model = name.partition(":")
    adapter = PROVIDERS.get(provider)
    if not sep or not model or adapter is None:
        return None
    return adapter(model, options, reach)


async def check_endpoint(provider: Model) -> None:
    """A provider's own endpoint (a session's `base_url`), refused now (`Unreachable`, a
    ValueError) if its reach refuses it; every request checks again."""
    endpoint = getattr(provider, "endpoint", None)
    if endpoint is not None and endpoint.reach is not None:
        await endpoint.reach.pin(endpoint.url, BASE_URL_OPTION)
