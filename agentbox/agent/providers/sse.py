"""The providers' streams: `post_sse` is the HTTP side both adapters share.

Providers stream SSE over HTTP; the parser (`agentbox.sse`, whatever the chunk boundaries)
is shared with the SDK and re-exported here.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx

from agentbox.agent.providers.endpoint import BASE_URL_OPTION
from agentbox.agent.providers.errors import EndpointRefused, ServerError, Timeout, classify
from agentbox.agent.reach import Reach, Unreachable
from agentbox.sse import ServerSentEvent, SSEParser, sse_events

__all__ = ["SSEParser", "ServerSentEvent", "client_for", "post_sse", "sse_events"]


async def post_sse(
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    *,
    timeout: httpx.Timeout,
    provider: str,
    reach: Reach | None = None,
) -> AsyncGenerator[ServerSentEvent, None]:
    """POST `body` as JSON and yield the response's events; HTTP and transport failures as typed errors.

    An error status is read in full and classified (`errors.classify`); a timeout at any
    point is `Timeout`, a connection that breaks is `ServerError`. With `reach` (a session's
    own endpoint) the URL is checked and its address pinned first; a refusal is `EndpointRefused`.
    """
    client = await client_for(url, timeout, reach, provider)
    try:
        async with (
            client,
            client.stream("POST", url, headers=headers, json=body) as response,
        ):
            if response.status_code >= 400:
                text = (await response.aread()).decode("utf-8", "replace")
                raise classify(
                    response.status_code, text, response.headers.get("retry-after"), provider=provider
                )
            async for event in sse_events(response.aiter_bytes()):
                yield event
    except httpx.TimeoutException as exc:
        raise Timeout(f"{provider}: timed out ({type(exc).__name__}) talking to {url}") from exc
    except httpx.TransportError as exc:
        raise ServerError(f"{provider}: connection to {url} failed: {type(exc).__name__}: {exc}") from exc


async def client_for(
    url: str, timeout: httpx.Timeout, reach: Reach | None, provider: str
) -> httpx.AsyncClient:
    """A client for the operator's endpoint, or one pinned to the checked address of a session's."""
    if reach is None:
        return httpx.AsyncClient(timeout=timeout)
    try:
        pin = await reach.pin(url, BASE_URL_OPTION)
    except Unreachable as exc:
        raise EndpointRefused(f"{provider}: {exc}") from exc
    transport = pin.transport(httpx.AsyncHTTPTransport())
    return httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)  # type: ignore[arg-type]
