"""The hot routes' lean twins: they serve every hot request and answer as FastAPI's routes do.

One app under real uvicorn on loopback, with a real sandbox. Each request is sent twice, with
the same request id: once as served (the `LeanRoute`s in front) and once with the lean routes
taken out of the app's route list, so that FastAPI's own APIRoutes answer. Status, body and
the headers that matter must be the same.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Header
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Match

from agentbox.api.app import create_app
from agentbox.api.envelope import MAX_JSON_BODY
from agentbox.api.lean import HotLane, LeanRoute, plan_of
from agentbox.api.observe import SESSION_PREFIX
from agentbox.api.routing import HOT_ROUTES
from agentbox.config import load
from tests.conftest import ROOMY, free_port, traversable

#: Seconds the in-process server may take to start, and one request to answer.
START_TIMEOUT = 30.0
REQUEST_TIMEOUT = 30.0
#: The headers compared besides status and body.
COMPARED_HEADERS = (
    "content-type",
    "content-length",
    "allow",
    "retry-after",
    "connection",
    "www-authenticate",
)
SESSION = SESSION_PREFIX.format(session_id="ses_leanprobe")


@dataclass
class Served:
    app: FastAPI
    url: str
    workspace: Path
    routes: list[BaseRoute]

    def lean(self, on: bool) -> None:
        """Serve with the lean routes (as the server does) or with FastAPI's routes alone."""
        self.app.router.routes[:] = (
            self.routes if on else [r for r in self.routes if not isinstance(r, LeanRoute)]
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = traversable(tmp_path_factory.mktemp("lean"), tmp_path_factory)
    app = create_app(load(env={"AGENTBOX_HOME": str(home), **ROOMY}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    with httpx.Client(base_url=url, timeout=START_TIMEOUT) as client:
        assert (
            client.post("/v2/commands", json={"command": "true"}).status_code == 200
        )  # server up, sandbox made
    try:
        yield Served(app, url, home / "sessions" / "default" / "workspace", list(app.router.routes))
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT)


def answer(
    served: Served, on: bool, method: str, path: str, request_id: str, **kwargs: Any
) -> dict[str, Any]:
    served.lean(on)
    try:
        with httpx.Client(base_url=served.url, timeout=REQUEST_TIMEOUT) as client:
            r = client.request(
                method, path, headers={"x-request-id": request_id, **kwargs.pop("headers", {})}, **kwargs
            )
    finally:
        served.lean(True)
    headers = {k: r.headers.get(k) for k in COMPARED_HEADERS}
    return {"status": r.status_code, "headers": headers, "body": r.content}


def j(body: object) -> dict[str, Any]:
    return {"json": body}


def raw(content: bytes, content_type: str | None = "application/json") -> dict[str, Any]:
    return {"content": content, "headers": {} if content_type is None else {"content-type": content_type}}


READ = "/v2/fs/read"
#: (method, path, request options): bad input of every kind, and a few good reads, on every hot route.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    # POST /v2/commands: bodies the model refuses, bodies that are not JSON, bodies not sent as JSON
    ("POST", "/v2/commands", j({})),
    ("POST", "/v2/commands", j({"command": 1})),
    ("POST", "/v2/commands", j({"command": "true", "mode": "later"})),
    ("POST", "/v2/commands", j({"command": "true", "timeout": "soon"})),
    ("POST", "/v2/commands", j({"command": "true", "env": {"A": 1}})),
    ("POST", "/v2/commands", j([1, 2])),
    ("POST", "/v2/commands", raw(b"{")),
    ("POST", "/v2/commands", raw(b'{"command": "\\ud800"}')),
    ("POST", "/v2/commands", raw(b'{"command": "true"}', "text/plain")),
    ("POST", "/v2/commands", raw(b'{"command": "true"}', None)),
    ("POST", "/v2/commands", raw(b" " * (MAX_JSON_BODY + 1))),
    ("POST", "/v2/commands", j({"command": "true", "cwd": "/no/such/dir"})),
    ("DELETE", "/v2/commands", {}),
    # GET /v2/fs/read: queries FastAPI reads (missing, not plain integers) and ones the route refuses
    ("GET", READ, {}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "many"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "1.5"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": ""}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": " 1"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "+1"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "01"}}),
    ("GET", READ, {"params": {"path": "f.txt", "end_line": "99999999999999999999"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "-1"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "2", "end_line": "1"}}),
    ("GET", READ, {"params": {"path": "f.txt", "start_line": "1", "end_line": "2"}}),
    ("GET", READ, {"params": [("path", "nope.txt"), ("path", "f.txt")]}),
    ("GET", READ, {"params": {"path": "f.txt", "user": "no-such-user"}}),
    ("GET", READ, {"params": {"path": "f.txt", "unknown": "1"}}),
    ("GET", READ, {"params": {"path": "/no/such/file"}}),
    ("GET", READ, {"params": {"path": "/workspace"}}),
    ("GET", READ, {"params": {"path": "escape"}}),
    ("GET", READ, {"params": {"path": "../../../../etc/passwd"}}),
    ("POST", READ, {}),
    # POST /v2/fs/write
    ("POST", "/v2/fs/write", j({"path": "w.txt"})),
    ("POST", "/v2/fs/write", j({"path": "w.txt", "content": "x", "encoding": "latin-1"})),
    ("POST", "/v2/fs/write", j({"path": "w.txt", "content": "@@", "encoding": "base64"})),
    ("POST", "/v2/fs/write", j({"path": "/workspace", "content": "x"})),
    ("POST", "/v2/fs/write", j({"path": "no/dir/w.txt", "content": "x"})),
    ("POST", "/v2/fs/write", {**j({"path": "w.txt", "content": "x"}), "params": {"user": "no-such-user"}}),
    # v1: failures of the operation are 200 with the envelope; of the request, their status
    ("POST", "/v1/shell/exec", j({})),
    ("POST", "/v1/shell/exec", j({"command": 5})),
    ("POST", "/v1/shell/exec", raw(b"[")),
    ("POST", "/v1/bash/exec", j({})),
    ("POST", "/v1/bash/exec", j({"command": ["true"]})),
    ("POST", "/v1/file/read", j({})),
    ("POST", "/v1/file/read", j({"file": "/no/such/file"})),
    ("POST", "/v1/file/read", j({"file": "/workspace/f.txt", "start_line": "x"})),
    ("POST", "/v1/file/read", j({"file": "/workspace/f.txt", "start_line": 1})),
    ("POST", "/v1/file/write", j({"file": "/workspace/w1.txt", "content": 1})),
    ("POST", "/v1/file/write", j({"file": "/workspace", "content": "x"})),
    # the session twins: a sandbox of its own, and the same refusals
    ("GET", SESSION + READ, {"params": {"path": "/no/such/file"}}),
    ("GET", SESSION + READ, {"params": {"start_line": "x"}}),
    ("POST", SESSION + "/v2/commands", j({"command": 2})),
    ("POST", SESSION + "/v1/file/read", j({"file": "/no/such/file"})),
]


@pytest.fixture(scope="module")
def files(served: Served) -> Served:
    (served.workspace / "f.txt").write_text("one\ntwo\nthree\n")
    (served.workspace / "escape").symlink_to("/etc/hostname")  # inside the sandbox's view: its own /etc
    return served


@pytest.mark.parametrize("method, path, options", CASES)
def test_the_lean_route_answers_as_fastapi_does(
    files: Served, method: str, path: str, options: dict[str, Any]
) -> None:
    request_id = "req_lean_compare"
    fast = answer(files, True, method, path, request_id, **dict(options))
    slow = answer(files, False, method, path, request_id, **dict(options))
    assert fast == slow


def session_with_machine(served: Served, machine: str) -> str:
    r = httpx.post(
        served.url + "/v1/sessions", json={"model": "scripted", "machine": machine}, timeout=REQUEST_TIMEOUT
    )
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def test_a_dependency_failure_answers_the_same(files: Served) -> None:
    """The sandbox dependency's own errors: a session made without a machine, a deleted session."""
    no_machine = session_with_machine(files, "none")
    deleted = session_with_machine(files, "none")
    assert httpx.delete(f"{files.url}/v1/sessions/{deleted}", timeout=REQUEST_TIMEOUT).status_code in (
        200,
        204,
    )
    for session in (no_machine, deleted):
        for method, path, options in [
            ("POST", "/v2/commands", j({"command": "true"})),
            ("GET", READ, {"params": {"path": "f.txt"}}),
            ("POST", "/v1/file/read", j({"file": "f.txt"})),
        ]:
            full = SESSION_PREFIX.format(session_id=session) + path
            fast = answer(files, True, method, full, "req_lean_dep", **dict(options))
            assert b'"success":false' in fast["body"], fast
            assert fast == answer(files, False, method, full, "req_lean_dep", **dict(options))


def test_every_hot_request_is_served_by_a_lean_route(served: Served) -> None:
    for prefix in ("", SESSION):
        for method, path in HOT_ROUTES:
            scope = {"type": "http", "method": method, "path": prefix + path, "root_path": "", "headers": []}
            first = next(r for r in served.routes if r.matches(scope)[0] == Match.FULL)
            assert isinstance(first, LeanRoute), (method, path, first)
            _, child = first.matches(scope)
            assert child["route"] is first.route  # the metrics' route label: the APIRoute's template


def test_hot_requests_take_the_lane_and_the_rest_the_whole_stack(files: Served) -> None:
    """The hot lane (`HotLane`) serves what a lean route reads plainly; the app's own stack the rest."""
    lane = files.app.middleware_stack
    assert isinstance(lane, HotLane)
    whole, seen = lane.full, []

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await whole(scope, receive, send)

    lane.full = counted
    try:
        with httpx.Client(base_url=files.url, timeout=REQUEST_TIMEOUT) as client:
            assert client.get(READ, params={"path": "f.txt"}).json()["data"]["content"].startswith("one")
            assert client.get(SESSION + READ, params={"path": "/no/such/file"}).json()["success"] is False
            assert client.post("/v2/commands", json={"command": "true"}).json()["data"]["exit_code"] == 0
            assert seen == []
            client.get(READ, params={"path": "f.txt", "start_line": "+1"})  # FastAPI reads this query
            client.get("/health")
            client.post(READ)  # a wrong method: the router's 405
    finally:
        lane.full = whole
    assert seen == [READ, "/health", READ]


def test_the_route_label_of_a_lean_request_is_its_template(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=REQUEST_TIMEOUT) as client:
        status = client.get(SESSION + READ, params={"path": "/workspace/nope"}).status_code
        text = client.get("/metrics").text
    assert status == 404
    assert f'route="{SESSION_PREFIX + READ}",status="404"' in text


def test_openapi_lists_the_hot_routes_once(served: Served) -> None:
    document = httpx.get(served.url + "/openapi.json", timeout=REQUEST_TIMEOUT).json()
    for prefix in ("", SESSION_PREFIX):
        for method, path in HOT_ROUTES:
            assert method.lower() in document["paths"][prefix + path]


def test_a_route_with_parameters_a_lean_route_does_not_read_is_refused() -> None:
    app = FastAPI()

    @app.get("/h")
    async def with_header(x_token: str = Header()) -> None: ...

    @app.get("/i")
    async def with_bool(flag: bool = False) -> None: ...

    @app.get("/s")
    def sync_route() -> None: ...

    routes = {r.path: r for r in app.router.routes if isinstance(r, APIRoute)}
    with pytest.raises(TypeError, match="does not read headers"):
        plan_of(routes["/h"])
    with pytest.raises(TypeError, match="not a plain str or int"):
        plan_of(routes["/i"])
    with pytest.raises(TypeError, match="only async endpoints"):
        plan_of(routes["/s"])
