"""The OpenAPI document tells the truth about every reply: the envelope models and one finishing pass.

Routes answer with a ready `JSONResponse` (`envelope.ok`), so a route's `response_model`
only documents: FastAPI hands a returned `Response` back untouched and never validates or
re-serializes it (nothing is added to a request's path). Each sandbox route declares
`response_model=Envelope[<its data>]`; a v1 route that reports failures as HTTP 200 (AIO's
way) declares `v1_reply(<its data>)`, the success envelope or `Failure` at 200.

The statuses a family of routes can fail with are declared on its router (`failures`), the
410 of a deleted session on every session twin (`routing.add_copy`), and byte and event
streams name their media types (`streamed`, `event_stream`). What holds for every route alike
is added here, by `finish`, from what the operation takes:

    a query parameter      400 text/plain (a malformed query string is not the envelope)
    a JSON body            413 and 415 (`BodyRefused`), and 422 `BodyFailure` (`body_errors`)
    a multipart body       400 (a malformed form), 413, and 422 `BodyFailure` (no `file` part)
    a tar body             413
    any operation          401 (when the server has an API key)

FastAPI's own 422 (`HTTPValidationError`) is dropped everywhere: no route lets FastAPI
validate a body (`envelope.json_body`), and its query errors are the plain-text 400.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, Literal, TypeVar, get_origin

from fastapi import FastAPI
from pydantic import BaseModel, Field, create_model

from agentbox.api.envelope import STATUS_BY_TYPE

T = TypeVar("T")

#: Where FastAPI's generated document keeps its models.
REF_TEMPLATE = "#/components/schemas/{model}"
#: Routers whose malformed bodies are a 400 (`SessionRoute`), not the 422 of every other route.
BODY_ERROR_STATUS_BY_PREFIX = {"/v1/sessions": 400}
#: The status of a malformed body everywhere else.
BODY_ERROR_STATUS = 422
#: FastAPI's own validation models, unused once `finish` has run.
FASTAPI_VALIDATION_MODELS = ("HTTPValidationError", "ValidationError")
#: What a status means when no `error_type` maps to it.
STATUS_REASONS = {
    401: "missing or invalid API key (only when the server has one); `data` is null",
    410: "the session of this sandbox was deleted (`session_deleted`)",
    413: "the body is larger than the route's limit (EFBIG); the connection is closed",
    415: "the body is not sent as application/json (or application/*+json)",
    416: "the Range lies outside the file (`Content-Range: bytes */<size>`)",
}


class ErrorData(BaseModel):
    """`data` of a failure: what failed, as the AIO error object carries it."""

    errno: int | None
    errno_name: str | None
    error_type: str = Field(description="One of the kinds of `envelope.STATUS_BY_TYPE` (not_found, ...).")
    exception_type: str
    message: str
    operation: str
    path: str | None
    retryable: bool


class Envelope(BaseModel, Generic[T]):
    """A success: `data` is the route's result."""

    success: Literal[True]
    message: str
    data: T
    hint: None


class Failure(BaseModel):
    """A failure: `data` says what failed (null for a refused API key)."""

    success: Literal[False]
    message: str
    data: ErrorData | None
    hint: None
    request_id: str | None = Field(None, description="The X-Request-ID of this request, for the logs.")
    retry_after: float | None = Field(
        None, description="Only at the sandbox cap (503 capacity_exceeded): seconds, as Retry-After says."
    )


class BodyErrorItem(BaseModel):
    location: list[str]
    message: str
    type: str


class DetailItem(BaseModel):
    loc: list[str]
    msg: str
    type: str


class BodyFailure(BaseModel):
    """A malformed body: `errors` names each field (and `detail` repeats it for the AIO SDK)."""

    success: Literal[False]
    message: str
    data: None
    hint: None
    errors: list[BodyErrorItem]
    detail: list[DetailItem]
    request_id: str | None = None


def v1_reply(model: Any) -> Any:
    """A v1 route's 200: the success envelope of `model` (or `model`, an envelope already), or a
    failure: AIO answers both with 200."""
    is_envelope = isinstance(model, type) and get_origin(model) is None and issubclass(model, Envelope)
    return (model if is_envelope else Envelope[model]) | Failure


def v1_stream(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """A v1 stream route's `responses=` with the failure at 200 too, in JSON: a sandbox that
    cannot be had is AIO's 200 there as everywhere on v1 (`envelope.failure(v1=True)`)."""
    ok = responses[200]
    content = {**ok["content"], "application/json": {"schema": ref(Failure)}}
    return {**responses, 200: {**ok, "content": content}}


def mirrored(model: type[BaseModel]) -> type[BaseModel]:
    """`Envelope[model]` with `model`'s fields again at the top level (`v1_file.mirrored`)."""
    fields: dict[str, Any] = {name: (info.annotation, info) for name, info in model.model_fields.items()}
    base: Any = Envelope.__class_getitem__(model)  # type: ignore[operator]
    reply: type[BaseModel] = create_model(f"{model.__name__}Mirrored", __base__=base, **fields)
    return reply


def plain_reply(model: Any, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that returns a plain dict (not the envelope): `model` at `status`.

    Not `response_model`, which would make FastAPI validate and filter the returned dict.
    """
    return {status: {"model": model, "description": "The reply (plain JSON, not the envelope)"}}


def failures(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a router: the failure envelope at each of `statuses`, each described.

    A `$ref` (`finish` adds the model), not `"model": Failure`: FastAPI would build a
    pydantic field per status of every route when the app is built, a third of a second in all.
    """
    content = {"application/json": {"schema": ref(Failure)}}
    return {status: {"description": describe(status), "content": content} for status in statuses}


def describe(status: int) -> str:
    kinds = sorted(kind for kind, code in STATUS_BY_TYPE.items() if code == status)
    if status in STATUS_REASONS:
        return f"Failure: {STATUS_REASONS[status]}"
    return "Failure; `data.error_type`: " + ", ".join(kinds) if kinds else "Failure"


#: Failure statuses of v2 routes, by what they do (the HTTP status of each `error_type`).
V2_FILE_FAILURES = (400, 403, 404, 409, 500, 503, 507)
V2_FAILURES = (400, 404, 500, 503)
#: Failures every sandbox route shares: the machine behind the sandbox (`CurrentSandbox`).
SANDBOX_FAILURES = (403, 503)


# ---------------------------------------------------------------- finishing the document


def install_document(app: FastAPI) -> None:
    """Make `app.openapi()` the finished document (built once on first use, as FastAPI does)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = finish(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def finish(document: dict[str, Any]) -> dict[str, Any]:
    """Add the failures every operation shares (see the module docstring) and drop FastAPI's 422."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (Failure, BodyFailure):
        add_model(schemas, model)
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            finish_operation(path, operation)
    used = str(document["paths"])
    for name in FASTAPI_VALIDATION_MODELS:
        if f"/{name}'" not in used:
            schemas.pop(name, None)
    return document


def add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template=REF_TEMPLATE, mode="serialization")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema


def finish_operation(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    if is_fastapi_validation(responses.get("422")):
        del responses["422"]
    media = set(operation.get("requestBody", {}).get("content", {}))
    if any(p.get("in") == "query" for p in operation.get("parameters", ())):
        add_content(responses, 400, "text/plain", {"type": "string"}, "a malformed query string (plain text)")
    body_status = next(
        (s for prefix, s in BODY_ERROR_STATUS_BY_PREFIX.items() if path.startswith(prefix)), BODY_ERROR_STATUS
    )
    if "application/json" in media:
        add_failures(responses, (413, 415))
        add_content(responses, body_status, "application/json", ref(BodyFailure), "a malformed JSON body")
    if "multipart/form-data" in media:
        add_failures(responses, (400, 413))
        add_content(responses, body_status, "application/json", ref(BodyFailure), "a form without its file")
    if media & {"application/x-tar", "application/octet-stream"}:
        add_failures(responses, (413,))
    add_failures(responses, (401,))


def is_fastapi_validation(response: dict[str, Any] | None) -> bool:
    return response is not None and "HTTPValidationError" in str(response.get("content", {}))


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def add_failures(responses: dict[str, Any], statuses: Iterable[int]) -> None:
    for status in statuses:
        add_content(responses, status, "application/json", ref(Failure), describe(status))


def add_content(responses: dict[str, Any], status: int, media: str, schema: dict[str, Any], why: str) -> None:
    """`schema` as `status`'s reply in `media`, beside what the status already documents.

    Two schemas for the same status and media (a failure and a malformed body at 400) become
    one `anyOf`.
    """
    response = responses.setdefault(str(status), {"description": why})
    if why not in response["description"]:
        response["description"] = f"{response['description']}; {why}"
    content = response.setdefault("content", {})
    present = content.get(media, {}).get("schema")
    if present is None:
        content[media] = {"schema": schema}
    elif schema != present and schema not in present.get("anyOf", ()):
        content[media] = {"schema": {"anyOf": [*present.get("anyOf", [present]), schema]}}


def event_stream(description: str, events: Iterable[str] = ()) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a Server-Sent Events route: each event (`event`, `data` as JSON text, `id`).

    `events` lists the event names when they are a closed set.
    """
    name: dict[str, Any] = {"type": "string"}
    if events:
        name["enum"] = list(events)
    frame = {
        "type": "object",
        "properties": {
            "event": name,
            "data": {"type": "string", "contentMediaType": "application/json"},
            "id": {"type": "string"},
        },
        "required": ["event", "data"],
    }
    return {200: {"description": description, "content": {"text/event-stream": {"schema": frame}}}}


def streamed(media: str, description: str, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that streams bytes in `media` (at 200 and each of `statuses`)."""
    content = {media: {"schema": {"type": "string", "format": "binary"}}}
    return {status: {"description": description, "content": content} for status in (200, *statuses)}
