"""How a call reaches the server: one `httpx` client, typed errors, retries, resumable streams.

A resource describes a request as a `Call`; `SyncTransport` and `AsyncTransport` send it the
same way: the API key as a bearer token, a failure status turned into its `APIError`
(`_errors.api_error`), a connection failure into `Unreachable`. A call that is safe to repeat
(a GET, or a POST carrying an `Idempotency-Key`, which the server deduplicates) is sent again
after a connection failure, `REQUEST_RETRIES` times with a doubling wait.

`Resume` is the state of a stream that survives its connection: the last seq seen, how many
reconnects in a row have brought nothing new, and how long to wait before the next. The
stream loops of `_streams` keep it, so the rule is written once: a stream that breaks is
opened again after the last event seen (`RECONNECTS` times without progress, then
`StreamLost`), and a connection that delivered a new event resets the count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from agentbox.client._errors import APIError, ProtocolError, StreamLost, Unreachable, api_error

#: Seconds a plain request (and connecting a stream) may take before `Unreachable`.
REQUEST_TIMEOUT_S = 30.0
#: Times a request that is safe to repeat is sent again after a connection failure.
REQUEST_RETRIES = 2
#: Seconds before the first retry of a request; doubled for each further one.
RETRY_DELAY_S = 0.25
#: Seconds between the heartbeats a stream asks of the server (`heartbeat=`).
HEARTBEAT_S = 15.0
#: Seconds a stream may stay silent (no event, no heartbeat) before its connection counts as lost.
STREAM_SILENCE_S = 3 * HEARTBEAT_S
#: Times in a row a broken stream is opened again without receiving anything new, then `StreamLost`:
#: with the waits below, about 15 s, long enough for a server to restart and recover its turns.
RECONNECTS = 7
#: Seconds before the second reconnect in a row (the first is at once); doubled for each further
#: one, up to the most below (0.5 + 1 + 2 + 4 + 4 + 4 = 15.5 s in all).
RECONNECT_DELAY_S = 0.5
RECONNECT_MAX_DELAY_S = 4.0
#: Bytes read per piece of a download that is streamed to a file.
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
#: Methods that are safe to repeat after a connection failure.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Call:
    """One request, as a resource describes it (paths relative to the client's base URL)."""

    method: str
    path: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    headers: Mapping[str, str] | None = None
    files: Any = None
    data: Mapping[str, Any] | None = None
    content: bytes | None = None

    @property
    def repeatable(self) -> bool:
        return self.method in SAFE_METHODS or bool(self.headers and "Idempotency-Key" in self.headers)

    def arguments(self) -> dict[str, Any]:
        args: dict[str, Any] = {"params": self.params, "headers": self.headers}
        if self.json is not None:
            args["json"] = self.json
        if self.files is not None:
            args["files"] = self.files
        if self.data is not None:
            args["data"] = self.data
        if self.content is not None:
            args["content"] = self.content
        return args


def client_headers(api_key: str | None, headers: Mapping[str, str] | None) -> dict[str, str]:
    sent = dict(headers or {})
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    return sent


def unreachable(base_url: str, exc: httpx.HTTPError) -> Unreachable:
    return Unreachable(f"cannot reach {base_url}: {described(exc)}")


def described(exc: Exception) -> str:
    """An exception as text; httpx's have empty messages at times (a bare `ReadError()`)."""
    return str(exc) or type(exc).__name__


def checked(response: httpx.Response) -> httpx.Response:
    """The response, or its typed error when its status is a failure."""
    if response.status_code >= 400:
        raise api_error(response)
    return response


def json_of(response: httpx.Response) -> Any:
    """A success's JSON; a v2 envelope that says `success: false` is still a failure."""
    try:
        body = response.json()
    except ValueError:
        raise ProtocolError(
            f"{response.request.url}: not a JSON answer (is this an agentbox server?)"
        ) from None
    if isinstance(body, dict) and body.get("success") is False:
        raise api_error(response)
    return body


def retry_delay(attempt: int) -> float:
    return float(RETRY_DELAY_S * 2 ** (attempt - 1))


def stream_timeout() -> httpx.Timeout:
    return httpx.Timeout(REQUEST_TIMEOUT_S, read=STREAM_SILENCE_S)


@dataclass
class Resume:
    """A stream's place across connections (see the module docstring)."""

    cursor: int
    what: str
    """What is streamed, for the message of a `StreamLost`."""
    failures: int = 0
    """Connections in a row that ended without a new event."""
    progressed: bool = False

    def seen(self, seq: int) -> bool:
        """Record an event; False if it is one already seen (skip it)."""
        if seq <= self.cursor:
            return False
        self.cursor, self.progressed = seq, True
        return True

    def broke(self, reason: str) -> float:
        """A connection ended: the seconds to wait before the next, or `StreamLost`."""
        self.failures = 0 if self.progressed else self.failures + 1
        self.progressed = False
        if self.failures >= RECONNECTS:
            raise StreamLost(f"{reason}; gave up on {self.what} after {RECONNECTS} reconnects", self.cursor)
        if self.failures == 0:
            return 0.0
        return float(min(RECONNECT_DELAY_S * 2 ** (self.failures - 1), RECONNECT_MAX_DELAY_S))


def stream_broke(exc: Exception) -> str | None:
    """Why a stream's connection ended, if `exc` is one a reconnect can cure; else None."""
    if isinstance(exc, httpx.HTTPError):
        return f"lost the stream ({described(exc)})"
    if isinstance(exc, APIError) and exc.status in (502, 503, 504):
        return f"the server answered {exc.status} ({exc.message})"
    return None


class SyncTransport:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base_url,
            headers=client_headers(api_key, headers),
            timeout=timeout,
            transport=transport,
        )

    def send(self, call: Call) -> httpx.Response:
        attempt = 0
        while True:
            try:
                return checked(self.http.request(call.method, call.path, **call.arguments()))
            except httpx.TransportError as exc:
                attempt += 1
                if not call.repeatable or attempt > REQUEST_RETRIES:
                    raise unreachable(self.base_url, exc) from None
                time.sleep(retry_delay(attempt))
            except httpx.HTTPError as exc:
                raise unreachable(self.base_url, exc) from None

    def json(self, call: Call) -> Any:
        return json_of(self.send(call))

    @contextmanager
    def stream(self, call: Call, timeout: httpx.Timeout | None = None) -> Iterator[httpx.Response]:
        """The open response of `call` (its status checked); httpx errors pass through."""
        with self.http.stream(
            call.method, call.path, timeout=timeout or stream_timeout(), **call.arguments()
        ) as r:
            if r.status_code >= 400:
                r.read()
                checked(r)
            yield r

    def close(self) -> None:
        self.http.close()


class AsyncTransport:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=client_headers(api_key, headers),
            timeout=timeout,
            transport=transport,
        )

    async def send(self, call: Call) -> httpx.Response:
        attempt = 0
        while True:
            try:
                return checked(await self.http.request(call.method, call.path, **call.arguments()))
            except httpx.TransportError as exc:
                attempt += 1
                if not call.repeatable or attempt > REQUEST_RETRIES:
                    raise unreachable(self.base_url, exc) from None
                await asyncio.sleep(retry_delay(attempt))
            except httpx.HTTPError as exc:
                raise unreachable(self.base_url, exc) from None

    async def json(self, call: Call) -> Any:
        return json_of(await self.send(call))

    @asynccontextmanager
    async def stream(self, call: Call, timeout: httpx.Timeout | None = None) -> AsyncIterator[httpx.Response]:
        async with self.http.stream(
            call.method, call.path, timeout=timeout or stream_timeout(), **call.arguments()
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                checked(r)
            yield r

    async def close(self) -> None:
        await self.http.aclose()
