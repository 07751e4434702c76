"""The response envelope and error mapping shared by every route (seed 002's table).

    success   {"success": true,  "message": "...", "data": {...}, "hint": null}
    failure   {"success": false, "message": "...", "data": {errno, errno_name, error_type,
               exception_type, message, operation, path, retryable}, "hint": null}
    refused   a failure at the sandbox cap also has "retry_after": <seconds> beside "data",
              status 503 and a Retry-After header

v2 sends failures with the HTTP status of their `error_type`; v1 sends them with 200
(upstream AIO), except downloads and unknown watchers. A malformed JSON body is 422 with a
top-level `errors` list (`location`, `message`, `type`) and, for the AIO SDK, `detail` as a
list (never a string); a malformed query string is 400 plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from agentbox.workspace.errors import WorkspaceError

STATUS_BY_TYPE = {
    "bad_request": 400,
    "invalid_path": 400,
    "invalid_target": 400,
    "permission_denied": 403,
    "read_only_filesystem": 403,
    "not_found": 404,
    "already_exists": 409,
    "decode_error": 422,
    "no_space_left": 507,
    "capacity_exceeded": 503,
    "io_error": 500,
}
#: Bytes of JSON body a route reads before refusing it (uploads and tar bodies stream instead).
MAX_JSON_BODY = 16 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)
#: A `\\uD800`-`\\uDFFF` escape in raw JSON: the cheap test before looking for lone surrogates.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def ok(data: Any = None, message: str = "Operation successful", **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, "data": data, "hint": None, **extra})


def failure(error: WorkspaceError, *, v1: bool = False) -> JSONResponse:
    status = 200 if v1 else STATUS_BY_TYPE.get(error.error_type, 500)
    body: dict[str, Any] = {"success": False, "message": error.message, "data": error.to_dict(), "hint": None}
    if error.retry_after is None:
        return JSONResponse(body, status_code=status)
    body["retry_after"] = error.retry_after
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(error.retry_after)})


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
    return JSONResponse(
        {"success": False, "message": message, "data": None, "hint": None, "errors": items, "detail": detail},
        status_code=422,
    )


def query_error(message: str) -> PlainTextResponse:
    return PlainTextResponse(message, status_code=400)


class BodyError(Exception):
    """A JSON body that is not JSON or does not fit the route's model."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid body")
        self.errors = errors


async def parse_body(request: Request, model: type[M]) -> M:
    """Parse a JSON body into `model`; an empty body is `{}` (the AIO SDK sends none)."""
    raw = await request.body()
    if len(raw) > MAX_JSON_BODY:
        raise BodyError([{"loc": [], "msg": f"body larger than {MAX_JSON_BODY} bytes", "type": "too_large"}])
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
