"""The app's sandbox routes: flat, served at `/` and per session, the hot routes first and safely so."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Match

from agentbox.api.app import ROUTERS, create_app
from agentbox.api.observe import SESSION_PREFIX
from agentbox.api.routing import HOT_ROUTES, add_sandbox_routes, hot_first
from agentbox.config import load


def app_routes(tmp_path: Path) -> list[APIRoute]:
    app = create_app(load(env={"AGENTBOX_HOME": str(tmp_path)}))
    return [r for r in app.router.routes if isinstance(r, APIRoute)]


def first_match(routes: list[APIRoute], method: str, path: str) -> APIRoute | None:
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)


def test_every_sandbox_route_is_served_at_the_root_and_per_session(tmp_path: Path) -> None:
    paths = {(m, r.path) for r in app_routes(tmp_path) for m in r.methods}
    for module in ROUTERS:
        for route in module.router.routes:
            assert isinstance(route, APIRoute)
            for method in route.methods:
                assert (method, route.path) in paths
                assert (method, SESSION_PREFIX + route.path) in paths


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
