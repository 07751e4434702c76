"""Where a provider's requests go and how: one reading of a session's `model_options` for every adapter.

Precedence for the URL and the key: the session's `base_url` / `api_key`, then the server's
environment (`<PREFIX>_BASE_URL`, `<PREFIX>_API_KEY`), then the provider's default URL. The
options that configure the client (`CLIENT_OPTIONS`, plus the adapter's own) are kept out of
`extra`, which the adapter adds to each request body.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agentbox.agent.limits import LIMIT_OPTIONS

#: Seconds to connect; seconds of silence mid-stream before the call is a `Timeout`.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 300.0
#: `model_options` keys that configure the client rather than the request body.
CLIENT_OPTIONS = frozenset({"base_url", "api_key", "timeout", *LIMIT_OPTIONS})


@dataclass(frozen=True)
class Endpoint:
    url: str
    api_key: str
    timeout: httpx.Timeout
    extra: dict[str, Any]
    """The options that go into each request body."""


def endpoint(
    options: Mapping[str, Any] | None,
    *,
    env_prefix: str,
    default_base_url: str,
    path: str,
    own_options: frozenset[str] = frozenset(),
) -> Endpoint:
    """The endpoint `options` describe; a `timeout` that is not a number raises ValueError."""
    options = dict(options or {})
    base = options.get("base_url") or os.environ.get(f"{env_prefix}_BASE_URL") or default_base_url
    client = CLIENT_OPTIONS | own_options
    return Endpoint(
        url=str(base).rstrip("/") + path,
        api_key=str(options.get("api_key") or os.environ.get(f"{env_prefix}_API_KEY") or ""),
        timeout=httpx.Timeout(float(options.get("timeout") or READ_TIMEOUT), connect=CONNECT_TIMEOUT),
        extra={k: v for k, v in options.items() if k not in client},
    )
