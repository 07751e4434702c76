"""Where a provider's requests go and how: one reading of a session's `model_options` for every adapter.

The URL: the session's `base_url`, else the server's environment (`<PREFIX>_BASE_URL`),
else the provider's default URL. The key follows from where the URL came from, because the
server's key is the operator's credential and goes only where the operator pointed it:

    base_url                                   api_key sent
    none, or the operator's (env / default)    the session's `api_key`, else `<PREFIX>_API_KEY`
    any other (the session's own endpoint)     the session's `api_key`, else none

A session's own endpoint is also checked before every request (`Endpoint.reach`, the
session's `agentbox.agent.reach.Reach`: public addresses only unless the operator listed the
endpoint, resolved once and pinned). The options that configure the client (`CLIENT_OPTIONS`,
plus the adapter's own) are kept out of `extra`, which the adapter adds to each request body.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agentbox.agent.limits import LIMIT_OPTIONS
from agentbox.agent.providers.errors import AuthError
from agentbox.agent.reach import Reach

#: Seconds to connect; seconds of silence mid-stream before the call is a `Timeout`.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 300.0
#: `model_options` keys that configure the client rather than the request body.
CLIENT_OPTIONS = frozenset({"base_url", "api_key", "timeout", *LIMIT_OPTIONS})
#: How a refusal names the option it refuses.
BASE_URL_OPTION = "model_options.base_url"


@dataclass(frozen=True)
class Endpoint:
    url: str
    api_key: str
    timeout: httpx.Timeout
    extra: dict[str, Any]
    """The options that go into each request body."""
    reach: Reach | None = None
    """The policy the URL is checked against before each request: set for a session's own
    `base_url` when the caller gave one (the worker always does); None for the operator's."""
    key_variable: str | None = None
    """`<PREFIX>_API_KEY` when the URL is the provider's own API, which answers nothing without
    a key; None for any other endpoint (a local server may need none)."""

    def refuse_without_key(self, provider: str) -> None:
        """Fail at once, and for good, where a call could only be refused: the provider's own
        API with no key (retrying a connection that cannot succeed took ten seconds)."""
        if self.key_variable is not None and not self.api_key:
            raise AuthError(
                f"{provider}: no API key: set {self.key_variable} in the server's environment "
                "or model_options.api_key"
            )


def endpoint(
    options: Mapping[str, Any] | None,
    *,
    env_prefix: str,
    default_base_url: str,
    path: str,
    own_options: frozenset[str] = frozenset(),
    reach: Reach | None = None,
) -> Endpoint:
    """The endpoint `options` describe; a `timeout` that is not a number raises ValueError."""
    options = dict(options or {})
    operators = str(os.environ.get(f"{env_prefix}_BASE_URL") or default_base_url).rstrip("/")
    base = str(options.get("base_url") or operators).rstrip("/")
    own = base != operators
    server_key = "" if own else os.environ.get(f"{env_prefix}_API_KEY", "")
    client = CLIENT_OPTIONS | own_options
    return Endpoint(
        url=base + path,
        api_key=str(options.get("api_key") or server_key or ""),
        timeout=httpx.Timeout(float(options.get("timeout") or READ_TIMEOUT), connect=CONNECT_TIMEOUT),
        extra={k: v for k, v in options.items() if k not in client},
        reach=reach if own else None,
        key_variable=f"{env_prefix}_API_KEY" if base == default_base_url.rstrip("/") else None,
    )
