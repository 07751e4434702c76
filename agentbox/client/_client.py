"""`Client` and `AsyncClient`: one server, its API key, and the resource groups over them."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import httpx

from agentbox.client._resources import (
    Approvals,
    AsyncApprovals,
    AsyncChanges,
    AsyncEvents,
    AsyncFiles,
    AsyncMessages,
    AsyncSessions,
    Changes,
    Events,
    Files,
    Messages,
    Sessions,
)
from agentbox.client._sandbox import AsyncSandbox, Sandbox
from agentbox.client._transport import REQUEST_TIMEOUT_S, AsyncTransport, SyncTransport


class Client:
    """A running `agentbox serve`, e.g. `Client("http://127.0.0.1:8091", api_key=...)`.

    `transport` is httpx's: `httpx.MockTransport` for tests, or one with custom TLS or proxies.
    Close it (or use it as a context manager) to release its connections.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._t = SyncTransport(base_url, api_key, timeout=timeout, headers=headers, transport=transport)
        self.base_url = self._t.base_url
        self.sessions = Sessions(self._t)
        self.events = Events(self._t)
        self.messages = Messages(self._t, self.sessions, self.events)
        self.approvals = Approvals(self._t)
        self.changes = Changes(self._t)
        self.files = Files(self._t)

    def sandbox(self, session_id: str) -> Sandbox:
        """The sandbox of `session_id` (a session's, or one of its own for any other id)."""
        return Sandbox(self._t, session_id)

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio: the same groups, each method awaited (streams with `async for`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._t = AsyncTransport(base_url, api_key, timeout=timeout, headers=headers, transport=transport)
        self.base_url = self._t.base_url
        self.sessions = AsyncSessions(self._t)
        self.events = AsyncEvents(self._t)
        self.messages = AsyncMessages(self._t, self.sessions, self.events)
        self.approvals = AsyncApprovals(self._t)
        self.changes = AsyncChanges(self._t)
        self.files = AsyncFiles(self._t)

    def sandbox(self, session_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._t, session_id)

    async def aclose(self) -> None:
        await self._t.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
