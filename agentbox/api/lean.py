"""Hot routes served without FastAPI's per-request machinery, answering exactly as before.

FastAPI serves a route through two exit stacks, its telemetry hooks and dependency solving:
a walk of the dependant tree in which every query parameter is validated by its own pydantic
field. The hot routes use none of what that buys. Their endpoints take the request, the
current sandbox (a dependency that takes only the connection) and at most a few scalar query
parameters. They parse their JSON bodies themselves (`envelope.parse_body`) and return a
`JSONResponse`, which FastAPI passes through without a response model. In one process that
machinery was about a third of a 1 KiB read's time in the app.

A `LeanRoute` stands in front of such an `APIRoute` and calls its endpoint directly:

- it matches with the APIRoute's own `matches` and only on a full match (a wrong method falls
  through to the APIRoute, whose 405 and `Allow` are unchanged), and keeps the APIRoute's child
  scope, so `scope["route"]` (the metrics' route label) is the APIRoute;
- the endpoint runs inside the same exception handlers (Starlette's, from the scope, as any
  route's do), so a `WorkspaceError`, `MachineError`, `BodyRefused` or `BodyError` gets the
  envelope it got before;
- a query it cannot read plainly goes to the APIRoute, so every such error reads as FastAPI
  writes it: a required parameter that is missing, an integer that is not written as
  `0` or `-?[1-9][0-9]*` (FastAPI takes `" 7"`, `"+7"`, `"07"`, `"7.0"`; rather than copy its
  rules, those go to it);
- `/openapi.json` lists APIRoutes only, so it does not change.

A route with any other kind of parameter (a header, a body field, a dependency that needs
more than the connection, a constrained query) is refused when the app is built
(`TypeError`), so a hot route cannot quietly change what it accepts.

A request for a lean route also skips the framework's layers around the router: `HotLane`,
in front of the app's middleware stack, sends it through the app's own middleware straight
to its lean route (see its docstring).

`wrap_app_handling_exceptions` is Starlette's private helper, which FastAPI's own routes also
use. If it moves, the import fails when the server starts, not on a request.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette._exception_handler import wrap_app_handling_exceptions
from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

#: The integers a lean route reads itself; any other spelling goes to FastAPI.
PLAIN_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,17}")
#: The query parameter types a lean route reads: their annotation, and whether it is an int.
QUERY_TYPES: dict[object, bool] = {str: False, str | None: False, int: True, int | None: True}


@dataclass(frozen=True)
class QueryParam:
    """One query parameter of the endpoint, as FastAPI declared it."""

    name: str
    alias: str
    integer: bool
    required: bool
    default: Any


@dataclass(frozen=True)
class Dependency:
    """A dependency that takes only the connection (`sandboxes.current`)."""

    name: str
    """The endpoint's parameter that receives its value."""
    connection: str
    """Its own parameter that receives the request."""
    call: Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Plan:
    """What a lean call passes to the endpoint: the request, the dependencies, the query."""

    request_name: str | None
    dependencies: tuple[Dependency, ...]
    query: tuple[QueryParam, ...]

    def query_values(self, params: QueryParams) -> dict[str, Any] | None:
        """The query parameters by endpoint name; None when one needs FastAPI's reading."""
        values: dict[str, Any] = {}
        for param in self.query:
            raw = params.get(param.alias)
            if raw is None:
                if param.required:
                    return None
                values[param.name] = param.default
            elif param.integer:
                if not PLAIN_INTEGER.fullmatch(raw):
                    return None
                values[param.name] = int(raw)
            else:
                values[param.name] = raw
        return values


def plan_of(route: APIRoute) -> Plan:
    """The lean call of `route`; TypeError if it declares what a lean route does not read."""
    d = route.dependant
    unread = {
        "path parameters": d.path_params, "headers": d.header_params, "cookies": d.cookie_params,
        "body fields": d.body_params, "a websocket": d.websocket_param_name,
        "a connection": d.http_connection_param_name, "a response": d.response_param_name,
        "background tasks": d.background_tasks_param_name, "security scopes": d.security_scopes_param_name,
    }  # fmt: skip
    declared = [what for what, value in unread.items() if value]
    if declared:
        raise TypeError(f"{route.path}: a lean route does not read {', '.join(declared)}")
    if not inspect.iscoroutinefunction(route.endpoint):
        raise TypeError(f"{route.path}: a lean route calls only async endpoints")
    return Plan(d.request_param_name, tuple(_dependency(route, sub) for sub in d.dependencies), _query(route))


def _dependency(route: APIRoute, sub: Dependant) -> Dependency:
    connection = sub.request_param_name or sub.http_connection_param_name
    others = [
        sub.path_params, sub.query_params, sub.header_params, sub.cookie_params, sub.body_params,
        sub.dependencies, sub.websocket_param_name, sub.response_param_name,
        sub.background_tasks_param_name, sub.security_scopes_param_name,
    ]  # fmt: skip
    if sub.name is None or sub.call is None or connection is None or any(others):
        raise TypeError(f"{route.path}: a lean route calls only dependencies of the connection alone")
    if not inspect.iscoroutinefunction(sub.call):
        raise TypeError(f"{route.path}: dependency {sub.name} is not async")
    return Dependency(sub.name, connection, sub.call)


def _query(route: APIRoute) -> tuple[QueryParam, ...]:
    params = []
    for field in route.dependant.query_params:
        info = field.field_info
        integer = QUERY_TYPES.get(info.annotation)
        if integer is None or info.metadata or field.validation_alias:
            raise TypeError(f"{route.path}: query {field.name} is not a plain str or int")
        params.append(QueryParam(field.name, field.alias, integer, info.is_required(), info.get_default()))
    return tuple(params)


class LeanRoute(BaseRoute):
    """`route` (an APIRoute) called directly, in front of it; see the module docstring."""

    def __init__(self, route: APIRoute) -> None:
        self.route = route
        self.plan = plan_of(route)

    @property
    def path(self) -> str:
        return self.route.path

    @property
    def path_format(self) -> str:
        return self.route.path_format

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = self.route.matches(scope)
        return (Match.FULL, child_scope) if match == Match.FULL else (Match.NONE, {})

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        return self.route.url_path_for(name, **path_params)

    def values(self, scope: Scope) -> dict[str, Any] | None:
        """The query as the endpoint takes it; None when FastAPI has to read it."""
        return self.plan.query_values(QueryParams(scope["query_string"])) if self.plan.query else {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        values = self.values(scope)
        if values is None:
            await self.route.handle(scope, receive, send)
            return
        await self.handle_read(scope, receive, send, values)

    async def handle_read(self, scope: Scope, receive: Receive, send: Send, values: dict[str, Any]) -> None:
        """Serve the request whose query `values` are read already."""
        request = Request(scope, receive, send)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            response = await self.respond(request, values)
            await response(scope, receive, send)

        await wrap_app_handling_exceptions(app, request)(scope, receive, send)

    async def respond(self, request: Request, values: dict[str, Any]) -> Response:
        for dependency in self.plan.dependencies:
            values[dependency.name] = await dependency.call(**{dependency.connection: request})
        if self.plan.request_name is not None:
            values[self.plan.request_name] = request
        response = await self.route.endpoint(**values)
        if not isinstance(response, Response):
            raise TypeError(f"{self.route.path}: a lean route's endpoint must return a Response")
        return response

    def __repr__(self) -> str:
        return f"LeanRoute({self.route.path!r}, methods={sorted(self.route.methods or ())})"


#: Where the hot lane leaves a request's route, child scope and query for its dispatch.
LANE_SCOPE_KEY = "agentbox.lean_route"


class HotLane:
    """The lean routes' requests through the app's own middleware and nothing of the framework's.

    Starlette and FastAPI wrap every request in layers that pass a hot request through
    unchanged: the server-error catcher (the request id middleware already answers an
    unhandled error), FastAPI's telemetry and body-limit hooks (not configured here), two
    exit stacks (for forms' files; no hot route reads a form) and the router's walk. The lane
    serves a request that a lean route would serve without them: the app's `user_middleware`
    (the same classes with the same arguments, so the guard, the key check and the request id
    keep their shared state), then Starlette's `ExceptionMiddleware` with the app's handlers,
    then the lean route. Every other request goes to `full`, the app's usual stack.

    A request is in the lane when a lean route matches it fully and reads its query plainly.
    The lean routes are the router's, indexed by how their paths end and indexed again
    whenever the router's list changes length (a route taken out of it is out of the lane).
    `hot_first` checked, when the app was built, that no route before them serves a hot path.
    """

    def __init__(self, app: Starlette, full: ASGIApp) -> None:
        self.app = app
        self.full = full
        handlers = {k: v for k, v in app.exception_handlers.items() if k not in (500, Exception)}
        lane: ASGIApp = ExceptionMiddleware(self._dispatch, handlers=handlers, debug=app.debug)
        for cls, args, kwargs in reversed(app.user_middleware):
            lane = cls(lane, *args, **kwargs)
        self.lane = lane
        self._indexed = -1
        self._tails: tuple[str, ...] = ()
        self._by_tail: dict[str, list[tuple[int, LeanRoute]]] = {}

    def _index(self) -> None:
        """The lean routes by how their path ends (after its last parameter), in list order."""
        routes = self.app.router.routes
        self._by_tail = {}
        for i, route in enumerate(routes):
            if type(route) is LeanRoute:
                self._by_tail.setdefault(route.path.rsplit("}", 1)[-1], []).append((i, route))
        self._tails = tuple(self._by_tail)
        self._indexed = len(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.match(scope):
            await self.lane(scope, receive, send)
        else:
            await self.full(scope, receive, send)

    def match(self, scope: Scope) -> bool:
        """Whether `scope` is a lean route's; if so, what its dispatch needs goes in the scope."""
        if len(self.app.router.routes) != self._indexed:  # routes were added or taken out
            self._index()
        path = scope["path"]
        if not path.endswith(self._tails):
            return False
        for _, route in self._candidates(path):
            match, child = route.matches(scope)
            if match == Match.FULL:
                values = route.values(scope)
                if values is None:
                    return False
                scope[LANE_SCOPE_KEY] = (route, child, values)
                return True
        return False

    def _candidates(self, path: str) -> list[tuple[int, LeanRoute]]:
        """The lean routes whose path ends as `path` does, in the router's order."""
        found = [self._by_tail[tail] for tail in self._tails if path.endswith(tail)]
        return found[0] if len(found) == 1 else sorted(pair for group in found for pair in group)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, child, values = scope.pop(LANE_SCOPE_KEY)
        scope.update(child)
        scope.setdefault("router", self.app.router)
        await route.handle_read(scope, receive, send, values)


def add_hot_lane(app: Starlette) -> None:
    """Put a `HotLane` in front of `app`'s stack when Starlette builds it (at the first request,
    once every middleware and handler is in). Not when the app has a handler for unhandled
    errors: only `ServerErrorMiddleware`, which the lane skips, would call it."""
    build = app.build_middleware_stack

    def build_with_lane() -> ASGIApp:
        full = build()
        return full if any(key in (500, Exception) for key in app.exception_handlers) else HotLane(app, full)

    app.build_middleware_stack = build_with_lane  # type: ignore[method-assign]
