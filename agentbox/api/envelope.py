"""The response envelope and error mapping shared by every route (seed 002's table).

    success   {"success": true,  "message": "...", "data": {...}, "hint": null}
    failure   {"success": false, "message": "...", "data": {errno, errno_name, error_type,
               exception_type, message, operation, path, retryable}, "hint": null}
    refused   a failure at the sandbox cap also has "retry_after": <seconds> beside "data",
              status 503 and a Retry-After header

Every failure (and the 422 of a malformed body) also carries "request_id": the id the response's
`X-Request-ID` header names (`agentbox.api.observe`), so a client's report finds the log lines.

v2 sends failures with the HTTP status of their `error_type`; v1 sends them with 200
(upstream AIO), except downloads and unknown watchers. Refusals of the request itself keep
their status on every route: an unknown path (404 `not_found`), a method the path does not
serve (405 `method_not_allowed`, with `Allow`), a deleted session's sandbox (410
`session_deleted`). A malformed JSON body is 422 with a
top-level `errors` list (`location`, `message`, `type`) and, for the AIO SDK, `detail` as a
list (never a string); a malformed query string is 400 plain text.

Bodies are read within bounds, as they arrive: a JSON body must be sent as JSON
(`application/json` or `application/*+json`; a non-empty body in a CORS "simple request"
type such as `text/plain`, or with no type, is 415: a web page could send it without a
preflight), and one past `MAX_JSON_BODY` is refused on its `Content-Length` before a byte is
read and otherwise as soon as the count passes the limit (`BodyTooLarge`: EFBIG, 413 on v1
too, and the connection closed). Multipart uploads are bounded the same way (`read_form`).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from datetime import datetime
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from agentbox.api.observe import current_request, note_error
from agentbox.timestamps import timestamp
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.files import limit_exceeded

STATUS_BY_TYPE = {
    "bad_request": 400,
    "invalid_path": 400,
    "invalid_target": 400,
    "permission_denied": 403,
    "read_only_filesystem": 403,
    "not_found": 404,
    "already_exists": 409,
    "conflict": 409,
    "decode_error": 422,
    "no_space_left": 507,
    "capacity_exceeded": 503,
    "machine_not_found": 404,
    "machine_denied": 403,
    "machine_unavailable": 503,
    "session_deleted": 410,
    "unsupported": 501,
    "method_not_allowed": 405,
    "timeout": 504,
    "browser_unavailable": 503,
    "kernel_unavailable": 503,
    "io_error": 500,
}
#: Error types that refuse the request itself: their status on v1 routes too (not AIO's 200).
REQUEST_REFUSALS = frozenset({"session_deleted"})
#: HTTP statuses of refusals raised by routing or Starlette itself, as envelope `error_type`s.
HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}
#: Bytes of JSON body a route reads before refusing it (uploads and tar bodies stream instead).
MAX_JSON_BODY = 16 * 1024 * 1024
#: Most bytes one non-file field of a multipart form may hold (Starlette's default).
MAX_FORM_FIELD_BYTES = 1024 * 1024

M = TypeVar("M", bound=BaseModel)
#: A `\\uD800`-`\\uDFFF` escape in raw JSON: the cheap test before looking for lone surrogates.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyRefused(Exception):
    """A body refused before it is parsed; `response` gives its envelope."""

    def response(self, request: Request) -> JSONResponse:
        raise NotImplementedError


class UnsupportedBody(BodyRefused):
    """A JSON route's body not sent as JSON: 415 (v1 too; a web page's simple request)."""

    def __init__(self, content_type: str | None) -> None:
        shown = repr(content_type) if content_type is not None else "no content type"
        super().__init__(f"send the body as application/json (or application/*+json), not {shown}")

    def response(self, request: Request) -> JSONResponse:
        return refused(415, "bad_request", str(self), "request", "UnsupportedMediaType")


class BodyTooLarge(BodyRefused):
    """A body past the limit of its route, declared or counted while it arrives.

    The envelope is `limit_exceeded`'s (EFBIG) with 413 on every route (v1 too: the request
    itself is refused), and the connection is closed after it: uvicorn would otherwise read
    and discard the rest of the body, however long the client keeps sending.
    """

    def __init__(self, limit: int, operation: str = "request") -> None:
        super().__init__(f"the request body is larger than the limit of {limit} bytes")
        self.limit, self.operation = limit, operation

    def response(self, request: Request) -> JSONResponse:
        response = failure(limit_exceeded(self.operation, None, str(self)))
        response.status_code = 413
        response.headers["connection"] = "close"
        return response


def ok(data: Any = None, message: str = "Operation successful", **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, "data": data, "hint": None, **extra})


def wire(value: Any) -> Any:
    """`value` (dataclasses, models, datetimes) as JSON data, each datetime in the one format of
    `agentbox.timestamps` (FastAPI's encoder alone would write `.350000+00:00`)."""
    return jsonable_encoder(value, custom_encoder={datetime: timestamp})


def failure(error: WorkspaceError, *, v1: bool = False, also: dict[str, Any] | None = None) -> JSONResponse:
    """The failure envelope; `also` adds keys to its `data` (for an SDK that requires them there)."""
    status = (
        200 if v1 and error.error_type not in REQUEST_REFUSALS else STATUS_BY_TYPE.get(error.error_type, 500)
    )
    data = {**error.to_dict(), **(also or {})}
    body: dict[str, Any] = {"success": False, "message": error.message, "data": data, "hint": None}
    body.update(request_fields())
    note_error(error.error_type)
    if error.retry_after is None:
        return JSONResponse(body, status_code=status)
    body["retry_after"] = error.retry_after
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(error.retry_after)})


def refused(status: int, error_type: str, message: str, operation: str, exception_type: str) -> JSONResponse:
    """The failure envelope with an explicit `status`: a refusal of the request itself."""
    error = WorkspaceError(error_type, message, operation, exception_type=exception_type)
    response = failure(error)
    response.status_code = status
    return response


def http_refusal(request: Request, exc: HTTPException) -> JSONResponse:
    """An `HTTPException` (routing's 404 and 405, a malformed multipart form's 400) as the envelope.

    Routing raises them with the bare status phrase as detail; the message then names what was
    asked, and a 405 keeps its `Allow` header.
    """
    status = exc.status_code
    error_type = HTTP_ERROR_TYPES.get(status, "bad_request")
    asked = f"{request.method} {request.url.path}"
    message = str(exc.detail)
    if status == 404 and message == HTTPStatus.NOT_FOUND.phrase:
        message, exception_type = f"no route matches {asked}", "RouteNotFound"
    elif status == 405 and message == HTTPStatus.METHOD_NOT_ALLOWED.phrase:
        allowed = (exc.headers or {}).get("Allow", "")
        message, exception_type = (
            f"{asked}: the method is not allowed here (allowed: {allowed})",
            "MethodNotAllowed",
        )
    else:
        exception_type = "HTTPException"
    response = refused(status, error_type, message, "request", exception_type)
    response.headers.update(exc.headers or {})
    return response


def body_errors(errors: Sequence[Any], location_prefix: str = "body") -> JSONResponse:
    items = [
        {
            "location": [location_prefix, *[str(p) for p in e.get("loc", ())]],
            "message": e.get("msg", "invalid"),
            "type": e.get("type", "value_error"),
        }
        for e in errors
    ]
    detail = [{"loc": i["location"], "msg": i["message"], "type": i["type"]} for i in items]
    message = "; ".join(f"{'.'.join(i['location'])}: {i['message']}" for i in items) or "invalid request body"
    note_error("bad_request")
    return JSONResponse(
        {"success": False, "message": message, "data": None, "hint": None, "errors": items, "detail": detail,
         **request_fields()},
        status_code=422,
    )  # fmt: skip


def unauthorized() -> JSONResponse:
    """401: no API key, a wrong one, or no login cookie that counts (see `agentbox.console.login`)."""
    note_error("unauthorized")
    return JSONResponse(
        {
            "success": False,
            "message": "missing or invalid API key",
            "data": None,
            "hint": None,
            **request_fields(),
        },
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def request_fields() -> dict[str, str]:
    """`{"request_id": ...}` while serving a request (what every failure body carries), else {}."""
    state = current_request()
    return {} if state is None else {"request_id": state.request_id}


def query_error(message: str) -> PlainTextResponse:
    return PlainTextResponse(message, status_code=400)


class BodyError(Exception):
    """A JSON body that is not JSON or does not fit the route's model."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid body")
        self.errors = errors


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def refuse_declared(request: Request, limit: int, operation: str = "request") -> None:
    """`BodyTooLarge` at once for a `Content-Length` past `limit` (nothing of it is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, operation)


async def capped(
    chunks: AsyncIterator[bytes], limit: int, operation: str = "request"
) -> AsyncGenerator[bytes, None]:
    """The body as it arrives; `BodyTooLarge` as soon as it passes `limit` bytes."""
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise BodyTooLarge(limit, operation)
        yield chunk


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, never holding more than `limit` bytes of it."""
    refuse_declared(request, limit)
    return b"".join([chunk async for chunk in capped(request.stream(), limit)])


async def read_form(
    request: Request, limit: int, *, max_files: int, max_fields: int, operation: str
) -> FormData:
    """A multipart form (file parts spooled by Starlette to temp files), within `limit` bytes.

    `BodyTooLarge` on a `Content-Length` past the limit before anything is read, and as soon
    as the count passes it otherwise, so a chunked body is never spooled beyond it. A body
    that is not multipart is an empty form (the route then reports its missing `file`).
    """
    refuse_declared(request, limit, operation)
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "multipart/form-data":
        return FormData()
    parser = MultiPartParser(
        request.headers,
        capped(request.stream(), limit, operation),
        max_files=max_files,
        max_fields=max_fields,
        max_part_size=MAX_FORM_FIELD_BYTES,
    )
    try:
        return await parser.parse()
    except MultiPartException as exc:  # too many parts, a malformed one: 400, as `Request.form` does
        raise HTTPException(400, exc.message) from exc


async def parse_body(request: Request, model: type[M]) -> M:
    """Parse a JSON body into `model`; an empty body is `{}` (the AIO SDK sends none)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json_type(content_type):
        raise UnsupportedBody(content_type)
    raw = await read_body(request, MAX_JSON_BODY)
    if content_type is None and raw.strip():
        raise UnsupportedBody(None)
    try:
        payload = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise BodyError(
            [{"loc": [], "msg": f"body is not valid JSON: {exc}", "type": "json_invalid"}]
        ) from exc
    if not isinstance(payload, dict):
        raise BodyError([{"loc": [], "msg": "body must be a JSON object", "type": "dict_type"}])
    if _SURROGATE_ESCAPE.search(raw) and has_lone_surrogate(payload):
        raise BodyError([{"loc": [], "msg": "body has a lone UTF-16 surrogate", "type": "string_unicode"}])
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise BodyError([dict(e) for e in exc.errors(include_url=False, include_input=False)]) from exc


def has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a string no UTF-8 can carry (`"\\ud800"` alone).

    JSON allows such escapes and Python keeps them; paths, file content and even the error
    message echoing them would then fail far from here, so bodies with them are refused.
    Iterative, since a body may nest as deep as the JSON parser allows.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` that documents a JSON body the route parses itself with `parse_body`.

    A declared FastAPI body parameter would be parsed before the route runs (an empty body
    becomes a 422 without the envelope); this puts the same model in the OpenAPI document
    without that. Models must be flat: nested models' `$defs` would not reach the document.
    """
    schema = model.model_json_schema()
    if "$defs" in schema:
        raise TypeError(f"{model.__name__}: a documented body model must not nest other models")
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": bool(schema.get("required")), "content": content}}


def is_v1(request: Request) -> bool:
    return "/v1/" in request.url.path


def error_response(request: Request, error: WorkspaceError) -> Response:
    return failure(error, v1=is_v1(request))
