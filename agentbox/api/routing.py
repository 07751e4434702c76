"""How the sandbox routers become the app's routes: flat, mounted twice, the hot routes first.

Every sandbox router is served at `/` and again under `SESSION_PREFIX`. FastAPI's
`include_router` keeps an included router as one nested route that re-derives its routes'
context on every match, and routing walks the list in order: reaching `/v1/shell/exec`
that way cost about half a millisecond per request. Here each route is copied into the
app as a plain `APIRoute` with its full path (the way FastAPI used to include routers),
and the routes in `HOT_ROUTES` (the ones an agent calls in a loop), root and session twins,
go to the front of the list.

Moving a route forward changes nothing only if no route it passes could serve the same
request; `hot_first` checks that for every hot route when the app is built and refuses to
build otherwise. A 405 for a hot path with the wrong method may name a different route's
methods in `Allow` than before (the first route whose path matches answers it).

Each hot route is then served by a `LeanRoute` (`agentbox.api.lean`) put in front of it,
which calls its endpoint without FastAPI's per-request machinery and answers the same; the
APIRoute behind it stays for `/openapi.json` and for what the lean route hands over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute, APIWebSocketRoute
from starlette.routing import BaseRoute, Match

from agentbox.api.lean import LeanRoute
from agentbox.api.observe import SESSION_PREFIX
from agentbox.api.schemas import failures

#: The routes an agent calls in a loop (method, path at the root); each goes first, with its
#: session twin under `SESSION_PREFIX`.
HOT_ROUTES = (
    ("POST", "/v2/commands"),
    ("GET", "/v2/fs/read"),
    ("POST", "/v2/fs/write"),
    ("POST", "/v1/shell/exec"),
    ("POST", "/v1/bash/exec"),
    ("POST", "/v1/file/read"),
    ("POST", "/v1/file/write"),
)
#: What a session twin can answer besides its root route's replies: the session was deleted.
SESSION_FAILURES = failures(410)
#: A session id used to check that nothing before a session route could answer its requests.
PROBE_SESSION = "ses_probe"


def add_sandbox_routes(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """Add every route of `routers` at the root and under `SESSION_PREFIX`, hot routes first,
    each hot one behind its `LeanRoute`."""
    start = len(app.router.routes)
    for prefix in ("", SESSION_PREFIX):
        for router in routers:
            for route in router.routes:
                add_copy(app, route, prefix)
    ordered = hot_first(app.router.routes[start:], app.router.routes[:start])
    lean = [LeanRoute(route) for route in ordered[: 2 * len(HOT_ROUTES)] if isinstance(route, APIRoute)]
    app.router.routes[start:] = [*lean, *ordered]


def add_copy(app: FastAPI, route: BaseRoute, prefix: str) -> None:
    """`route` as an app route at `prefix + route.path`, with everything else it declares."""
    if isinstance(route, APIWebSocketRoute):
        app.router.add_api_websocket_route(
            prefix + route.path, route.endpoint, name=route.name, dependencies=list(route.dependencies)
        )
        return
    if not isinstance(route, APIRoute):
        raise TypeError(f"only APIRoutes can be added flat, not {type(route).__name__} {route!r}")
    app.router.add_api_route(
        prefix + route.path,
        route.endpoint,
        response_model=route.response_model,
        status_code=route.status_code,
        tags=list(route.tags),
        dependencies=list(route.dependencies),
        summary=route.summary,
        description=route.description,
        response_description=route.response_description,
        responses={**route.responses, **(SESSION_FAILURES if prefix else {})},
        deprecated=route.deprecated,
        methods=set(route.methods or ()),
        operation_id=route.operation_id,
        response_model_include=route.response_model_include,
        response_model_exclude=route.response_model_exclude,
        response_model_by_alias=route.response_model_by_alias,
        response_model_exclude_unset=route.response_model_exclude_unset,
        response_model_exclude_defaults=route.response_model_exclude_defaults,
        response_model_exclude_none=route.response_model_exclude_none,
        include_in_schema=route.include_in_schema,
        response_class=route.response_class,
        name=route.name,
        callbacks=route.callbacks,
        openapi_extra=route.openapi_extra,
        generate_unique_id_function=route.generate_unique_id_function,
    )


def hot_first(
    routes: list[BaseRoute], before: Iterable[BaseRoute], hot_routes: Sequence[tuple[str, str]] = HOT_ROUTES
) -> list[BaseRoute]:
    """`routes` with the `hot_routes` moved to the front; ValueError if a move could change routing.

    `before` are the app's routes ahead of these (`/health`...), which stay ahead.
    """
    wanted = [(method, prefix + path) for prefix in ("", SESSION_PREFIX) for method, path in hot_routes]
    hot: list[BaseRoute] = []
    for method, path in wanted:
        index = next((i for i, r in enumerate(routes) if _serves(r, method, path)), None)
        if index is None:
            raise ValueError(f"hot route {method} {path} is not served")
        probe = _probe_scope(method, path)
        for earlier in [*before, *routes[:index]]:
            if earlier not in hot and earlier.matches(probe)[0] == Match.FULL:
                raise ValueError(f"{method} {path} would pass {earlier!r}, which serves it too")
        hot.append(routes[index])
    return hot + [r for r in routes if r not in hot]


def _serves(route: BaseRoute, method: str, path: str) -> bool:
    return isinstance(route, APIRoute) and route.path == path and method in (route.methods or ())


def _probe_scope(method: str, path: str) -> dict[str, object]:
    concrete = path.replace("{session_id}", PROBE_SESSION)
    return {"type": "http", "method": method, "path": concrete, "root_path": "", "headers": []}
