"""The app's sandbox routes: flat, served at `/` and per session, the hot routes first and safely so."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute, APIWebSocketRoute
from starlette.routing import Match

from agentbox.api.app import ROUTERS, create_app
from agentbox.api.observe import SESSION_PREFIX
from agentbox.api.routing import HOT_ROUTES, add_sandbox_routes, hot_first
from agentbox.config import load
from tests.conftest import Server

#: Seconds one request to the test server may take.
REQUEST_TIMEOUT = 10.0


def app_routes(tmp_path: Path) -> list[APIRoute]:
    app = create_app(load(env={"AGENTBOX_HOME": str(tmp_path)}))
    return [r for r in app.router.routes if isinstance(r, APIRoute)]


def first_match(routes: list[APIRoute], method: str, path: str) -> APIRoute | None:
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)


def test_every_sandbox_route_is_served_at_the_root_and_per_session(tmp_path: Path) -> None:
    app = create_app(load(env={"AGENTBOX_HOME": str(tmp_path)}))
    paths = {(m, r.path) for r in app.router.routes if isinstance(r, APIRoute) for m in r.methods}
    sockets = {r.path for r in app.router.routes if isinstance(r, APIWebSocketRoute)}
    for module in ROUTERS:
        for route in module.router.routes:
            if isinstance(route, APIWebSocketRoute):  # the CDP endpoint's relay
                assert {route.path, SESSION_PREFIX + route.path} <= sockets
                continue
            assert isinstance(route, APIRoute)
            for method in route.methods:
                assert (method, route.path) in paths
                assert (method, SESSION_PREFIX + route.path) in paths
    assert sockets


def test_hot_routes_come_before_every_other_sandbox_route(tmp_path: Path) -> None:
    routes = app_routes(tmp_path)
    hot = {(m, prefix + p) for prefix in ("", SESSION_PREFIX) for m, p in HOT_ROUTES}
    positions = [i for i, r in enumerate(routes) if any((m, r.path) in hot for m in r.methods)]
    assert len(positions) == len(hot)
    first_cold = next(
        i for i, r in enumerate(routes) if r.path.startswith(("/v1/", "/v2/")) and i not in positions
    )
    assert max(positions) < first_cold
    served = first_match(routes, "POST", "/sandboxes/ses_x/v1/shell/exec")
    assert served is not None and served.path == SESSION_PREFIX + "/v1/shell/exec"


def test_a_hot_route_that_another_route_would_serve_first_is_refused() -> None:
    router = APIRouter()

    @router.get("/v2/fs/{anything}")
    async def anything() -> None: ...

    @router.get("/v2/fs/read")
    async def read() -> None: ...

    with pytest.raises(ValueError, match="would pass"):
        hot_first(list(router.routes), [], hot_routes=[("GET", "/v2/fs/read")])
    with pytest.raises(ValueError, match="is not served"):
        add_sandbox_routes(FastAPI(), [router])  # the real hot routes are not in this router


@pytest.mark.parametrize(
    "method, path, status, error_type",
    [
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/v1/nope", 404, "not_found"),  # a v1 path too: the request, not an operation, fails
        ("POST", "/v2/fs/nope", 404, "not_found"),
        # `/sandboxes/{id}/{action}` is E2B's control plane (agentbox.e2b): agentbox's own are deeper
        ("GET", f"{SESSION_PREFIX.format(session_id='ses_x')}/v2/nope", 404, "not_found"),
        ("DELETE", "/v2/fs/read", 405, "method_not_allowed"),
        ("PUT", "/v1/sessions", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_answer_in_the_envelope(
    server: Server, method: str, path: str, status: int, error_type: str
) -> None:
    r = httpx.request(method, server.url + path, timeout=REQUEST_TIMEOUT)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and body["data"]["error_type"] == error_type
    assert path in body["message"] and r.headers["x-request-id"] == body["request_id"]
    if status == 405:
        assert r.headers["allow"] and r.headers["allow"] in body["message"]


def test_query_errors_on_sandbox_routes_stay_plain_text(server: Server) -> None:
    """Seed 002's exception: a malformed query string on a sandbox route is a plain-text 400."""
    r = httpx.get(
        server.url + "/v2/fs/read",
        params={"path": "/workspace/x", "start_line": "many"},
        timeout=REQUEST_TIMEOUT,
    )
    assert r.status_code == 400 and r.headers["content-type"].startswith("text/plain"), r.text
