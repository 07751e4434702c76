"""How a provider call fails, as types the turn loop already understands.

Every kind is a `ModelError` (agentbox.agent.models), so the loop records it as
`session.error` / `turn.failed` with its `error_type` and retries what is `retryable`:

    RateLimited        429                                   model_rate_limited   retry (retry-after)
    Overloaded         529 / 503 / an `overloaded` error      model_unavailable    retry
    ServerError        other 5xx, a broken stream             model_unavailable    retry
    Timeout            connect / read / write timeouts        model_unavailable    retry
    AuthError          401 / 403                              model_auth_error
    ContextOverflow    a 400 (or 413) about context length    context_window_exceeded
    InvalidRequest     any other 4xx                          model_request_invalid
    EndpointRefused    a session's base_url the policy refuses model_endpoint_refused (nothing sent)

`classify` is the one place that maps an HTTP status and error body to a kind; both adapters
use it, for error responses and for errors that arrive inside a stream.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

from agentbox.agent.models import ModelError, ModelOverloaded, ModelRateLimited

#: Lower-cased fragments of error messages/codes that mean "the prompt is too long for the model".
#: OpenAI `context_length_exceeded` / "maximum context length", Anthropic "prompt is too long",
#: vLLM "maximum context length", llama.cpp "exceeds the available context size".
CONTEXT_WORDING = (
    "context_length_exceeded",
    "context length",
    "context window",
    "context size",
    "prompt is too long",
    "too many tokens",
)
#: How much of an error body a message quotes.
BODY_EXCERPT = 500


class RateLimited(ModelRateLimited):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        """Seconds the provider asked us to wait (`retry-after`), if it said."""


class Overloaded(ModelOverloaded):
    pass


class ServerError(ModelOverloaded):
    pass


class Timeout(ModelOverloaded):
    pass


class AuthError(ModelError):
    error_type = "model_auth_error"


class ContextOverflow(ModelError):
    error_type = "context_window_exceeded"


class EndpointRefused(ModelError):
    """A session's own `base_url` that its network policy does not reach (`agentbox.agent.reach`)."""

    error_type = "model_endpoint_refused"


class InvalidRequest(ModelError):
    error_type = "model_request_invalid"


def classify(status: int, body: str, retry_after: str | None = None, *, provider: str = "") -> ModelError:
    """The error kind of an HTTP error response (`body` as text, JSON or not)."""
    kind, detail = error_detail(body)
    message = f"{provider} HTTP {status}: {detail}".strip()
    if status == 429:
        return RateLimited(message, parse_retry_after(retry_after))
    if status in (503, 529) or "overloaded" in kind:
        return Overloaded(message)
    if status >= 500:
        return ServerError(message)
    if status in (401, 403):
        return AuthError(message)
    if status in (400, 413) and is_context_overflow(kind, detail):
        return ContextOverflow(message)
    return InvalidRequest(message)


def classify_stream_error(error: Any, *, provider: str = "") -> ModelError:
    """The error kind of an error delivered inside a stream (`{"type", "message"}` or a string)."""
    body = json.dumps({"error": error}) if not isinstance(error, str) else error
    kind, detail = error_detail(body)
    message = f"{provider} stream error: {detail}".strip()
    if "overloaded" in kind:
        return Overloaded(message)
    if "rate_limit" in kind:
        return RateLimited(message)
    if is_context_overflow(kind, detail):
        return ContextOverflow(message)
    if "authentication" in kind or "permission" in kind:
        return AuthError(message)
    if "invalid_request" in kind:
        return InvalidRequest(message)
    return ServerError(message)


def error_detail(body: str) -> tuple[str, str]:
    """(kind, message) from the error shapes both providers use; the raw excerpt otherwise.

    OpenAI: `{"error": {"message", "type", "code"}}`; Anthropic: `{"type": "error",
    "error": {"type", "message"}}`; gateways sometimes send `{"error": "text"}`.
    """
    try:
        data = json.loads(body)
    except ValueError:
        return "", body[:BODY_EXCERPT]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, str):
        return "", error[:BODY_EXCERPT]
    if not isinstance(error, dict):
        return "", body[:BODY_EXCERPT]
    kind = " ".join(str(error.get(k) or "") for k in ("type", "code")).lower()
    return kind, str(error.get("message") or body)[:BODY_EXCERPT]


def is_context_overflow(kind: str, message: str) -> bool:
    text = f"{kind} {message}".lower()
    return any(word in text for word in CONTEXT_WORDING)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a `retry-after` header: a number of seconds or an HTTP date; None if absent/bad."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds)
