"""Request ids and the access log: what lets an operator follow one request through the server.

Every HTTP request gets an id: the client's `X-Request-ID` when it is a sane one (at most
`MAX_REQUEST_ID` characters of `REQUEST_ID_CHARS`), else a fresh `req_<ulid>`. The response
carries it back in `X-Request-ID`, failure envelopes carry it as `request_id`, and every log
line written while the request runs names it (`RequestIdFilter`). When the response is done,
one access line is logged at info on `agentbox.access`: method, path with secret-looking query
values redacted (`redacted_query`), status, duration in ms and the id. Headers are never
logged (keys travel in them).

A WebSocket gets the same: an id (the client's `X-Request-ID` when sane), sent back as a header
of the accept (or of a refusal's HTTP response), and one access line when the connection ends,
with method `WS`, status 101 for an accepted connection (403 for one closed before it was
accepted, the status uvicorn sends then) and the connection's whole duration.

A pure ASGI middleware, so streamed responses (SSE, downloads) pass through chunk by chunk:
it only looks at `http.response.start` and the last body message. It sits outside the guard,
so refused requests are counted, logged and carry an id too. The per-request state lives in a
context variable holding a mutable `RequestState`: routes and exception handlers run in the
same context (or a copy of it), so what they record (`note_error`) is seen here at the end.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from ulid import ULID

#: Longest client-sent request id kept; a longer one is replaced by a fresh id.
MAX_REQUEST_ID = 128
#: Characters a client-sent request id may use (no spaces, quotes or control characters, so it
#: is safe in a log line and a header).
REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:\-]+")
#: Prefix of the ids the server makes.
REQUEST_ID_PREFIX = "req"
#: Header carrying the id, both ways.
REQUEST_ID_HEADER = "x-request-id"
#: What a redacted query value reads as.
REDACTED = "[redacted]"
#: Query parameter names whose values are never logged: any name containing one of these.
SECRET_PARAMS = ("key", "token", "password", "passwd", "secret", "auth", "credential", "signature")
#: The prefix every sandbox router is also mounted under (one session's sandbox), and its parameter.
SESSION_PREFIX = "/sandboxes/{session_id}"
SESSION_PARAM = "session_id"
SESSION_MOUNT = SESSION_PREFIX.split("{", 1)[0]
#: Route label of requests that matched no route (so unknown paths cannot grow the metrics).
UNMATCHED_ROUTE = "unmatched"

#: The method an access line and the metrics give a WebSocket connection.
WEBSOCKET_METHOD = "WS"
#: The status of an accepted WebSocket (Switching Protocols), and of one closed before accept.
WEBSOCKET_ACCEPTED, WEBSOCKET_REFUSED = 101, 403

#: `error_type` counted for a request the application failed with an exception.
INTERNAL_ERROR = "internal_error"

access_log = logging.getLogger("agentbox.access")
log = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the server knows about the request being served."""

    request_id: str
    error_type: str | None = None
    """The `error_type` of the failure envelope sent, if one was."""


_current: ContextVar[RequestState | None] = ContextVar("agentbox_request", default=None)


def current_request() -> RequestState | None:
    """The request being served in this context, or None (startup, background tasks)."""
    return _current.get()


def note_error(error_type: str) -> None:
    """Record that the response is a failure of `error_type` (the metrics count it)."""
    state = _current.get()
    if state is not None:
        state.error_type = error_type


def new_request_id() -> str:
    """A fresh id: sortable by time like every agentbox id, prefixed so a log grep finds it."""
    return f"{REQUEST_ID_PREFIX}_{str(ULID()).lower()}"


def accepted_request_id(given: str | None) -> str:
    """The client's id when it is sane, else a fresh one."""
    if given and len(given) <= MAX_REQUEST_ID and REQUEST_ID_CHARS.fullmatch(given):
        return given
    return new_request_id()


def is_secret_param(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_PARAMS)


def redacted_query(query: str) -> str:
    """The query string with the values of secret-looking parameters replaced by `REDACTED`."""
    if not query:
        return ""
    pairs = parse_qsl(query, keep_blank_values=True)
    return "&".join(
        f"{quote(name, safe='')}={REDACTED if is_secret_param(name) else quote(value, safe='')}"
        for name, value in pairs
    )


def route_template(scope: Scope) -> str:
    """The matched route's path template (`/sandboxes/{session_id}/v2/commands`), bounded.

    FastAPI reports a route included under a prefix as the router's own route (its path
    without the prefix); the session prefix is put back from the path parameters it bound.
    """
    path = getattr(scope.get("route"), "path", None)
    if not isinstance(path, str):
        return UNMATCHED_ROUTE
    mounted = scope.get("path", "").startswith(SESSION_MOUNT) and SESSION_PARAM in scope.get(
        "path_params", {}
    )
    if mounted and not path.startswith(SESSION_PREFIX):
        return SESSION_PREFIX + path
    return path


def given_request_id(scope: Scope) -> str | None:
    """The `X-Request-ID` the client sent, if any."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)


@dataclass(frozen=True)
class Finished:
    """One served request, as the access log and the metrics see it."""

    method: str
    route: str
    status: int
    seconds: float
    error_type: str | None
    streamed: bool = False
    """An event stream or a WebSocket: open for as long as the client listens, so its
    duration is no latency."""


#: Response media types that stream for as long as the client listens.
STREAM_MEDIA_TYPES = (b"text/event-stream", b"application/x-ndjson")


def is_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.lower().startswith(STREAM_MEDIA_TYPES) for k, v in headers)


class RequestIdMiddleware:
    """Assigns the request id, adds the header, logs the access line, reports `Finished`."""

    def __init__(self, app: ASGIApp, on_finished: Callable[[Finished], None] | None = None) -> None:
        self.app = app
        self.on_finished = on_finished

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        state = RequestState(accepted_request_id(given_request_id(scope)))
        token = _current.set(state)
        status = 500  # what the client sees if the app fails before starting a response
        started = reported = streamed = False

        def report() -> None:
            nonlocal reported
            if not reported:
                reported = True
                self._finished(scope, state, status, time.perf_counter() - began, streamed)

        async def send_with_id(message: Message) -> None:
            nonlocal status, started, streamed
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                streamed = is_stream(message.get("headers", []))
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = state.request_id
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                report()  # before the client can see the end: its next request sees this counted
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Logged here, inside the request's context, so the traceback names its id; the
            # client gets a 500 with the id unless the response had already started.
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            state.error_type = state.error_type or INTERNAL_ERROR
            if status == 500 and not started:
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                body = {
                    "success": False,
                    "message": "internal server error",
                    "data": None,
                    "hint": None,
                    "request_id": state.request_id,
                }
                await send_with_id({"type": "http.response.body", "body": json.dumps(body).encode()})
        finally:
            _current.reset(token)
            report()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket connection: its id in the accept's (or refusal's) headers, and one access
        line when it ends, however it ends."""
        began = time.perf_counter()
        state = RequestState(accepted_request_id(given_request_id(scope)))
        token = _current.set(state)
        status = WEBSOCKET_REFUSED

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] in ("websocket.accept", "websocket.http.response.start"):
                status = message.get("status", WEBSOCKET_ACCEPTED)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", state.request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error serving websocket %s", scope.get("path"))
            state.error_type = state.error_type or INTERNAL_ERROR
            raise
        finally:
            _current.reset(token)
            self._finished(scope, state, status, time.perf_counter() - began, streamed=True)

    def _finished(
        self, scope: Scope, state: RequestState, status: int, seconds: float, streamed: bool
    ) -> None:
        method = scope.get("method", WEBSOCKET_METHOD if scope["type"] == "websocket" else "")
        if access_log.isEnabledFor(logging.INFO):  # off by default: no redaction nobody reads
            query = redacted_query(scope.get("query_string", b"").decode("latin-1"))
            path = scope.get("path", "") + (f"?{query}" if query else "")
            ms = round(seconds * 1000, 2)
            access_log.info(
                "%s %s %d %.2fms",
                method,
                path,
                status,
                ms,
                extra={"request_id": state.request_id, "method": method, "path": path, "status": status,
                       "duration_ms": ms},
            )  # fmt: skip
        if self.on_finished is not None:
            self.on_finished(
                Finished(method, route_template(scope), status, seconds, state.error_type, streamed)
            )
