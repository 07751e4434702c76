"""The HTTP application: sandbox API v2 and v1, mounted at the root and per session.

Every request first passes `guard` (the `Host` and `Origin` checks that keep web pages
out). Every sandbox router is served twice (`agentbox.api.routing`): at `/` (acting on the
default session's sandbox) and under `/sandboxes/{session_id}` (that session's, created
lazily), so the AIO SDK's `Sandbox(base_url=".../sandboxes/<id>")` works against one
session. Auth, error mapping and the envelope are here; routes only call layer-2 operations.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import HTTPConnection
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox import __version__, console
from agentbox.api import (
    cdp,
    v1_bash,
    v1_browser,
    v1_code,
    v1_file,
    v1_jupyter,
    v1_sandbox,
    v1_shell,
    v2_commands,
    v2_fs,
    v2_sandbox,
    v2_watch,
)
from agentbox.api import files as files_api
from agentbox.api import sandboxes as sandboxes_api
from agentbox.api import sessions as sessions_api
from agentbox.api.callers import CALLER_LEVEL
from agentbox.api.envelope import (
    BodyError,
    BodyRefused,
    body_errors,
    error_response,
    http_refusal,
    query_error,
    refused,
    unauthorized,
)
from agentbox.api.guard import Guard, GuardMiddleware
from agentbox.api.lean import add_hot_lane
from agentbox.api.metrics import Metrics
from agentbox.api.observe import RequestIdMiddleware
from agentbox.api.routing import add_sandbox_routes
from agentbox.api.schemas import install_document
from agentbox.config import MAX_LEVEL, Settings
from agentbox.e2b import E2B, E2BDispatch, SandboxTable
from agentbox.home import HomeClaim
from agentbox.machines.errors import MachineError
from agentbox.mcp import McpHttp
from agentbox.system import opened_system
from agentbox.workspace.errors import WorkspaceError, translate

ROUTERS = [
    v2_fs, v2_watch, v2_commands, v2_sandbox, v1_file, v1_shell, v1_bash, v1_sandbox, v1_browser, v1_jupyter,
    v1_code, cdp,
]  # fmt: skip
#: Paths served without an API key. `/metrics` is not one: it needs the key when one is set
#: (route and machine names, counts). `/ready` is, like `/health`: probes carry no key.
#: The console's page, assets and login routes are open too (they carry no data, see
#: `agentbox.console`), and so are the docs page's assets.
OPEN_PATHS = {"/health", "/ready", "/docs", "/openapi.json", "/docs/oauth2-redirect", *console.OPEN_PATHS}
#: Where the docs page's Swagger UI assets are served (from the `fastapi-offline` package, no CDN).
DOCS_ASSETS = "/docs/assets"
OPEN_PREFIXES = (DOCS_ASSETS + "/", *console.OPEN_PREFIXES)
#: The close code of a WebSocket refused for want of the API key (policy violation).
KEY_REFUSED_CLOSE = 1008


def presented_key(request: HTTPConnection) -> str | None:
    header = request.headers.get("x-aio-api-key")
    if header:
        return header
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.query_params.get("api_key")


def open_path(path: str) -> bool:
    """Whether `path` is served without an API key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class ApiKeyMiddleware:
    """A configured key on every request but those of `OPEN_PATHS`, HTTP and WebSocket alike;
    the key's caller level goes in the scope's state (`caller_level`), for every machine open.

    An HTTP request without a key is answered 401 (`unauthorized`), unless the console's login
    cookie signs it in (with the server's own `api_key`: the operator's level); a WebSocket (the
    CDP endpoint's) is closed before it is accepted, and only a key counts for it: no page of
    the console opens one.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.secret = settings.api_key
        self.keys = [(key.encode(), level) for key, level in settings.levels()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        connection = HTTPConnection(scope)
        level = self.level(connection)
        if level is None and scope["type"] == "http" and self.secret is not None:
            level = MAX_LEVEL if console.signed_in(Request(scope), self.secret) else None
        if level is not None:
            scope.setdefault("state", {})[CALLER_LEVEL] = level
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await unauthorized()(scope, receive, send)
        else:
            await receive()  # websocket.connect
            await send(
                {"type": "websocket.close", "code": KEY_REFUSED_CLOSE, "reason": "missing or invalid API key"}
            )

    def level(self, connection: HTTPConnection) -> int | None:
        """The caller level of the key presented (every key compared, in constant time each);
        `MAX_LEVEL` on an open path, None without a valid key."""
        if open_path(connection.url.path):
            return MAX_LEVEL
        given = presented_key(connection)
        if given is None:
            return None
        matched = [level for key, level in self.keys if hmac.compare_digest(given.encode(), key)]
        return matched[0] if matched else None


def create_app(settings: Settings, claim: HomeClaim | None = None) -> FastAPI:
    mcp_http = McpHttp()  # `/mcp`: the tools over MCP (streamable HTTP), see agentbox/mcp.py
    metrics = Metrics(lambda: getattr(app.state, "system", None))
    e2b = E2B(SandboxTable(lambda: getattr(app.state, "system", None)))  # E2B's SDK: agentbox.e2b

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with opened_system(settings, claim) as system:  # the one composition root
            metrics.wire(system)
            app.state.system = system
            try:
                await e2b.open()  # the E2B sandboxes an earlier server left
                async with mcp_http.running():
                    yield
            finally:
                await e2b.close()
                app.state.system = None  # `/ready` answers 503 from here on

    # Swagger UI and ReDoc from the package's own copies: `/docs` works without internet.
    app = FastAPIOffline(title="agentbox", version=__version__, lifespan=lifespan, static_url=DOCS_ASSETS)
    app.state.settings = settings
    install_document(app)  # every reply and failure in /openapi.json: agentbox.api.schemas
    if settings.keyed:
        app.add_middleware(ApiKeyMiddleware, settings=settings)

    @app.exception_handler(WorkspaceError)
    async def workspace_error(request: Request, exc: WorkspaceError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(MachineError)
    async def machine_error(request: Request, exc: MachineError) -> Response:
        return error_response(request, translate(exc, "open", exc.path))

    # E2B's control plane and envd answer for themselves (their own key and error shape).
    app.add_middleware(E2BDispatch, e2b=e2b)
    if settings.allowed_origins:  # inside the guard, outside the key check: a preflight has no key
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(GuardMiddleware, guard=Guard.of(settings))  # before anything of the app runs
    # Outside the guard: a refused request gets an id, an access line and a count too.
    app.add_middleware(RequestIdMiddleware, on_finished=metrics.finished)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return http_refusal(request, exc)  # an unknown route, a wrong method: the envelope too

    @app.exception_handler(BodyRefused)
    async def refused_body(request: Request, exc: BodyRefused) -> Response:
        return exc.response(request)

    @app.exception_handler(BodyError)
    async def bad_body(request: Request, exc: BodyError) -> Response:
        return body_errors(exc.errors)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        body = [e for e in errors if e.get("loc", ("",))[0] == "body"]
        if body:
            return body_errors([{**e, "loc": list(e["loc"])[1:]} for e in body])
        text = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
        return query_error(f"Invalid request parameters: {text}")

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        """Liveness: the process answers (nothing else is checked)."""
        return {"status": "ok", "version": __version__}

    @app.get("/ready", include_in_schema=False)
    async def ready() -> Response:
        """Readiness: the system is open and its database answers a trivial query; else 503."""
        system = getattr(app.state, "system", None)
        why = "the server is not open (starting or shutting down)"
        if system is not None:
            try:
                await system.db.fetchone("SELECT 1")
                return JSONResponse({"status": "ready", "version": __version__})
            except Exception as exc:  # any failure of the database is "not ready"
                why = f"the database does not answer: {type(exc).__name__}: {exc}"
        return refused(503, "machine_unavailable", why, "ready", "NotReady")

    @app.get("/metrics", include_in_schema=False)
    async def metrics_text() -> Response:
        """The Prometheus text format of this app's registry (`agentbox.api.metrics`)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_sandbox_routes(app, [module.router for module in ROUTERS])  # at `/` and per session
    # `/v1/files`: once, at the root; files belong to no sandbox and outlive their session.
    app.include_router(files_api.router)
    # `/v1/sessions`: once, at the root; a session is not a sandbox route.
    app.include_router(sessions_api.router)
    # `/v1/sandboxes`: once, at the root; the lifecycle of the sandboxes the routes above reach.
    app.include_router(sandboxes_api.router)

    console.add_console(app)  # `/console` and `/` (see agentbox.console)
    add_hot_lane(app)  # the hot routes' requests skip the framework's own layers

    # MCP over streamable HTTP: an ASGI app on the exact path `/mcp` (as the SDK routes it).
    app.router.routes.append(Route("/mcp", endpoint=mcp_http, include_in_schema=False))
    return app
