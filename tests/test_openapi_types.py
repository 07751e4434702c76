"""The OpenAPI document types every reply, and real replies fit what it says.

The document is read twice: built from the app (every operation, session twins included)
for its shape, and served by a real `agentbox serve` (the session's `server` fixture, real
bubblewrap sandboxes) for the replies, each validated with `jsonschema` against the schema
the document gives for its status and media type. The fuzz test
(tests/test_openapi_fuzz.py) does the same for every generated case.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import Server

from agentbox.api.app import create_app
from agentbox.config import Settings

Operation = tuple[str, str, dict[str, Any]]
#: Keys a schema may have that say nothing about the value (FastAPI gives `Any` a title).
UNTYPED_KEYS = {"title", "description"}
#: Body media types whose content a route validates (and answers 422 or 400 with `errors` for).
VALIDATED_BODIES = {"application/json", "multipart/form-data"}
#: The v1 routes of AIO's sandbox API, which answer failures with HTTP 200 (`success: false`).
V1_SANDBOX_PREFIXES = (
    "/v1/file/", "/v1/shell/", "/v1/bash/", "/v1/sandbox/", "/v1/browser/", "/v1/jupyter/", "/v1/code/",
)  # fmt: skip
#: What a v1 route's 200 names for a failure: the envelope, or (the terminal URL, which always
#: fails) its own model.
FAILURES_AT_200 = ("Failure", "NoTerminal")
#: The prefix of every session twin of a sandbox route.
SESSION_PREFIX = "/sandboxes/{session_id}"


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """The document as the app builds it (no server: nothing of the system is opened)."""
    document: dict[str, Any] = create_app(
        Settings(home=Path("/nonexistent/agentbox-openapi-types"))
    ).openapi()
    return document


def operations(document: dict[str, Any]) -> Iterator[Operation]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method.upper(), path, operation


def is_typed(schema: dict[str, Any] | None) -> bool:
    return bool(set(schema or {}) - UNTYPED_KEYS)


def schema_of(document: dict[str, Any], path: str, method: str, status: int, media: str) -> dict[str, Any]:
    """The documented schema of a reply, standalone (its `$ref`s resolve inside it)."""
    responses = document["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} does not document {status}: {sorted(responses)}"
    content = responses[str(status)].get("content", {})
    assert media in content, f"{method} {path} {status} has no {media}: {sorted(content)}"
    schema = content[media]["schema"]
    assert is_typed(schema), f"{method} {path} {status} {media} is untyped: {schema}"
    return {**schema, "components": document["components"]}


def conforms(document: dict[str, Any], path: str, response: httpx.Response) -> None:
    """`response` fits what the document says of its status and media type (path as documented)."""
    media = response.headers["content-type"].split(";", 1)[0]
    schema = schema_of(document, path, response.request.method, response.status_code, media)
    body = response.json() if media == "application/json" else response.text
    jsonschema.Draft202012Validator(schema).validate(body)


def violations(document: dict[str, Any], path: str, method: str, status: int, body: Any) -> list[str]:
    schema = schema_of(document, path, method, status, "application/json")
    return [error.message for error in jsonschema.Draft202012Validator(schema).iter_errors(body)]


# ---------------------------------------------------------------- the document's shape


def test_every_operation_types_its_success(built: dict[str, Any]) -> None:
    untyped = []
    for method, path, operation in operations(built):
        successes = {code: r for code, r in operation["responses"].items() if code.startswith("2")}
        schemas = [c.get("schema") for r in successes.values() for c in r.get("content", {}).values()]
        if not schemas or not all(is_typed(s) for s in schemas):
            untyped.append(f"{method} {path}")
    assert untyped == []
    assert sum(1 for _ in operations(built)) > 100


def test_no_fastapi_validation_errors(built: dict[str, Any]) -> None:
    """No route lets FastAPI answer its own 422: its models are not in the document at all."""
    assert "HTTPValidationError" not in str(built["paths"])
    assert "HTTPValidationError" not in built["components"]["schemas"]


def test_a_422_is_a_validated_body_or_a_decode_error(built: dict[str, Any]) -> None:
    for method, path, operation in operations(built):
        declared = operation["responses"].get("422")
        if declared is None:
            continue
        schema = str(declared["content"]["application/json"]["schema"])
        media = set(operation.get("requestBody", {}).get("content", {}))
        if "BodyFailure" in schema:
            assert media & VALIDATED_BODIES, f"{method} {path}: a body 422 without a validated body"
        else:
            assert "decode_error" in declared["description"], f"{method} {path}: 422 {declared}"


def test_query_operations_declare_the_plain_text_400(built: dict[str, Any]) -> None:
    for method, path, operation in operations(built):
        if any(p["in"] == "query" for p in operation.get("parameters", ())):
            content = operation["responses"]["400"]["content"]
            assert content["text/plain"]["schema"] == {"type": "string"}, f"{method} {path}"


def test_json_bodies_declare_their_refusals(built: dict[str, Any]) -> None:
    for method, path, operation in operations(built):
        if "application/json" in operation.get("requestBody", {}).get("content", {}):
            assert {"413", "415"} <= set(operation["responses"]), f"{method} {path}"
            status = "400" if path.startswith("/v1/sessions") else "422"
            assert "BodyFailure" in str(operation["responses"][status]), f"{method} {path}"


def test_v1_sandbox_routes_document_failures_at_200(built: dict[str, Any]) -> None:
    """AIO's v1 answers a failed operation with 200 and `success: false`: the 200 says so."""
    seen = 0
    for method, path, operation in operations(built):
        if not (path + "/").startswith(V1_SANDBOX_PREFIXES):  # `/v1/sandbox` itself too
            continue
        seen += 1
        json_reply = str(operation["responses"]["200"]["content"].get("application/json", {}))
        assert any(name in json_reply for name in FAILURES_AT_200), f"{method} {path}"
    assert seen > 30


def test_session_twins_declare_410(built: dict[str, Any]) -> None:
    twins = [(m, p, op) for m, p, op in operations(built) if p.startswith(SESSION_PREFIX)]
    assert len(twins) > 50
    for method, path, operation in twins:
        assert "410" in operation["responses"], f"{method} {path}"
    roots = {(m, p) for m, p, _ in operations(built)}
    assert all((m, p.removeprefix(SESSION_PREFIX)) in roots for m, p, _ in twins)


def test_mirrored_v1_replies_document_the_top_level_keys(built: dict[str, Any]) -> None:
    schema = schema_of(built, "/v1/file/watch", "POST", 200, "application/json")
    created = schema["components"]["schemas"]["WatchCreatedMirrored"]
    assert {"data", "watcher_id", "initial_cursor"} <= set(created["required"])


# ---------------------------------------------------------------- real replies


@pytest.fixture(scope="module")
def served(server: Server) -> dict[str, Any]:
    with server.client() as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture
def folder(http: httpx.Client) -> str:
    """A fresh folder with one text file, `notes.txt`, in the default sandbox."""
    path = f"/workspace/openapi-types-{uuid.uuid4().hex[:8]}"
    assert http.post("/v2/fs/mkdir", json={"path": path}).status_code == 200
    written = http.post("/v2/fs/write", json={"path": f"{path}/notes.txt", "content": "one\ntwo\n"})
    assert written.status_code == 200, written.text
    return path


def test_v2_file_replies_conform(served: dict[str, Any], http: httpx.Client, folder: str) -> None:
    listed = http.get("/v2/fs/list", params={"path": folder})
    assert listed.status_code == 200 and listed.json()["data"]["files"], listed.text
    conforms(served, "/v2/fs/list", listed)
    read = http.get("/v2/fs/read", params={"path": f"{folder}/notes.txt"})
    assert read.json()["data"]["content"] == "one\ntwo\n"
    conforms(served, "/v2/fs/read", read)
    missing = http.get("/v2/fs/read", params={"path": f"{folder}/missing"})
    assert missing.status_code == 404
    conforms(served, "/v2/fs/read", missing)


def test_v1_replies_conform(served: dict[str, Any], http: httpx.Client, folder: str) -> None:
    read = http.post("/v1/file/read", json={"file": f"{folder}/notes.txt"})
    assert read.json()["data"]["line_count"] == 2
    conforms(served, "/v1/file/read", read)
    failed = http.post("/v1/file/read", json={"file": f"{folder}/missing"})
    assert failed.status_code == 200 and failed.json()["success"] is False
    conforms(served, "/v1/file/read", failed)
    ran = http.post("/v1/shell/exec", json={"command": "echo typed"})
    assert ran.json()["data"]["output"].strip() == "typed", ran.text
    conforms(served, "/v1/shell/exec", ran)
    watched = http.post("/v1/file/watch", json={"path": folder})
    conforms(served, "/v1/file/watch", watched)
    watcher = watched.json()["watcher_id"]
    conforms(served, "/v1/file/watch/{watcher_id}", http.delete(f"/v1/file/watch/{watcher}"))


def test_refusals_conform(served: dict[str, Any], http: httpx.Client) -> None:
    """The plain-text 400 of a malformed query and the 422 of a malformed body, as documented."""
    no_path = http.get("/v2/fs/read")
    assert no_path.status_code == 400 and no_path.headers["content-type"].startswith("text/plain")
    conforms(served, "/v2/fs/read", no_path)
    bad_body = http.post("/v2/fs/write", json={"path": 3})
    assert bad_body.status_code == 422 and bad_body.json()["errors"]
    conforms(served, "/v2/fs/write", bad_body)


def test_unknown_routes_answer_the_envelope(served: dict[str, Any], http: httpx.Client) -> None:
    """No route, or a method the path does not serve: the failure envelope, not `{"detail": ...}`."""
    failure = {"$ref": "#/components/schemas/Failure", "components": served["components"]}
    for response, status in ((http.get("/v2/no-such-route"), 404), (http.put("/v2/fs/read"), 405)):
        assert response.status_code == status, response.text
        jsonschema.Draft202012Validator(failure).validate(response.json())
        assert "detail" not in response.json()


def test_lifecycle_replies_conform(served: dict[str, Any], http: httpx.Client) -> None:
    conforms(served, "/v1/sessions", http.get("/v1/sessions"))
    conforms(served, "/v1/sandboxes", http.get("/v1/sandboxes"))


def test_the_schemas_refuse_what_they_do_not_describe(
    served: dict[str, Any], http: httpx.Client, folder: str
) -> None:
    """The check above could fail: a reply missing a field, or a success with failure data, does not fit."""
    body = http.post("/v1/file/read", json={"file": f"{folder}/notes.txt"}).json()
    assert violations(served, "/v1/file/read", "POST", 200, body) == []
    del body["data"]["line_count"]
    assert violations(served, "/v1/file/read", "POST", 200, body)
    failure = http.get("/v2/fs/read", params={"path": f"{folder}/missing"}).json()
    assert violations(served, "/v2/fs/read", "GET", 404, failure) == []
    assert violations(served, "/v2/fs/read", "GET", 200, failure)
