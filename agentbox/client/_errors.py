"""Every way a call of the SDK fails, as one tree.

    AgentboxError                 the root: catch it to catch everything the SDK raises
    ├── Unreachable               no answer: refused connection, timeout, a connection that broke
    │   └── StreamLost            an event stream that stayed broken after `RECONNECTS` tries
    │                             (`last_seq`: where a new stream would resume)
    ├── ProtocolError             an answer that is not agentbox's (not JSON, a malformed event)
    └── APIError                  the server answered with a failure envelope
        ├── InvalidRequest        400 bad_request, invalid_path, invalid_target, not_supported;
        │   │                     405 method_not_allowed; 415; 416; 422 decode_error and bodies
        │   │                     that do not parse (`errors`: location, message, type)
        │   └── TooLarge          413: a body or file past a limit (EFBIG, too_large)
        ├── Unauthorized          401: the API key is missing or wrong
        ├── PermissionDenied      403 permission_denied, read_only_filesystem, machine_denied,
        │                         and the guard's Host / Origin refusals
        ├── NotFound              404 not_found, machine_not_found
        ├── Conflict              409 conflict, already_exists (an approval answered twice, a
        │                         reused Idempotency-Key with another body, a turn still open)
        ├── Gone                  410 session_deleted: the session's sandbox is gone for good
        ├── Unavailable           503 machine_unavailable (retryable), the server not ready
        │   └── Busy              503 capacity_exceeded: every sandbox slot is taken
        │                         (`retry_after`: the seconds the server suggests waiting)
        ├── InsufficientStorage   507 no_space_left
        └── ServerError           500 io_error, internal_error, and any other 5xx

An `APIError` carries what the envelope said: `status`, `error_type`, `retryable`,
`message`, `request_id` (the `X-Request-ID` the server logged the request under; the body's
`request_id`, else the header) and the whole decoded `body`. The class follows the HTTP
status; `error_type` is the finer reason.
"""

from __future__ import annotations

from typing import Any

import httpx

#: Characters of a body that is not an envelope quoted in an error's message.
ERROR_BODY_CHARS = 200
#: `error_type` given to a failure whose body names none, by status (401's body has no data).
TYPE_BY_STATUS = {400: "bad_request", 401: "unauthorized", 422: "bad_request", 500: "internal_error"}


class AgentboxError(Exception):
    """Anything the SDK raises; `message` is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unreachable(AgentboxError):
    """The server gave no answer: it refused the connection, timed out or hung up."""


class StreamLost(Unreachable):
    """An event stream broke and could not be opened again; `last_seq` is the last event seen."""

    def __init__(self, message: str, last_seq: int) -> None:
        super().__init__(message)
        self.last_seq = last_seq


class ProtocolError(AgentboxError):
    """The answer is not one an agentbox server gives (not JSON, an event without its fields)."""


class APIError(AgentboxError):
    """The server refused the request with a failure envelope."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str,
        retryable: bool = False,
        request_id: str | None = None,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.retryable = retryable
        self.request_id = request_id
        self.retry_after = retry_after
        self.body = body

    @property
    def errors(self) -> list[dict[str, Any]]:
        """A body that did not parse: each problem's `location`, `message` and `type`."""
        errors = self.body.get("errors") if isinstance(self.body, dict) else None
        return list(errors) if isinstance(errors, list) else []

    def __str__(self) -> str:
        shown = f"{self.status} {self.error_type}: {self.message}"
        return f"{shown} (request {self.request_id})" if self.request_id else shown


class InvalidRequest(APIError):
    """The request is malformed or its values unusable (400, 405, 415, 416, 422)."""


class TooLarge(InvalidRequest):
    """A body or file past one of the server's limits (413)."""


class Unauthorized(APIError):
    """The API key is missing or wrong (401)."""


class PermissionDenied(APIError):
    """The server, the machine or the guard refuses (403)."""


class NotFound(APIError):
    """No such session, turn, approval, change set, file, path, command or watcher (404)."""


class Conflict(APIError):
    """The request clashes with the current state (409)."""


class Gone(APIError):
    """The session was deleted: its sandbox is gone for good (410)."""


class Unavailable(APIError):
    """The server or the machine cannot serve it now (503); often worth a retry."""


class Busy(Unavailable):
    """Every sandbox slot is taken (503 capacity_exceeded); `retry_after` says when to try again."""


class InsufficientStorage(APIError):
    """The machine's disk is full (507)."""


class ServerError(APIError):
    """The server failed (500 and other 5xx)."""


#: The class of each failure status; a status not listed falls back by its hundred.
CLASS_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: PermissionDenied,
    404: NotFound,
    405: InvalidRequest,
    409: Conflict,
    410: Gone,
    413: TooLarge,
    415: InvalidRequest,
    416: InvalidRequest,
    422: InvalidRequest,
    503: Unavailable,
    507: InsufficientStorage,
}
#: Finer classes for some `error_type`s, within their status's class.
CLASS_BY_TYPE: dict[str, type[APIError]] = {"capacity_exceeded": Busy}


def error_class(status: int, error_type: str) -> type[APIError]:
    if error_type in CLASS_BY_TYPE and issubclass(
        CLASS_BY_TYPE[error_type], CLASS_BY_STATUS.get(status, APIError)
    ):
        return CLASS_BY_TYPE[error_type]
    if status in CLASS_BY_STATUS:
        return CLASS_BY_STATUS[status]
    return ServerError if status >= 500 else InvalidRequest


def api_error(response: httpx.Response) -> APIError:
    """The typed error a failure response stands for, read from its envelope (or its text)."""
    status = response.status_code
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    envelope: dict[str, Any] = body if isinstance(body, dict) else {}
    data: dict[str, Any] = envelope["data"] if isinstance(envelope.get("data"), dict) else {}
    error_type = str(data.get("error_type") or TYPE_BY_STATUS.get(status) or f"http_{status}")
    retry_after = envelope.get("retry_after")
    return error_class(status, error_type)(
        failure_message(response, envelope),
        status=status,
        error_type=error_type,
        retryable=bool(data.get("retryable", False)),
        request_id=envelope.get("request_id") or response.headers.get("x-request-id"),
        retry_after=float(retry_after) if isinstance(retry_after, int | float) else None,
        body=body if body is not None else response.text,
    )


def failure_message(response: httpx.Response, envelope: dict[str, Any]) -> str:
    """The envelope's message; for a body that did not parse, its first problem with where it is."""
    errors = envelope.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        first = errors[0]
        where = ".".join(str(p) for p in first.get("location", [])[1:])
        text = str(first.get("message", ""))
        return f"{where}: {text}" if where else text
    message = envelope.get("message")
    if isinstance(message, str) and message:
        return message
    return response.text.strip().replace("\n", " ")[:ERROR_BODY_CHARS] or response.reason_phrase
