"""The HTTP application: sandbox API v2 and v1, mounted at the root and per session.

Every request first passes `guard` (the `Host` and `Origin` checks that keep web pages
out). Every router is included twice: at `/` (acting on the default session's sandbox) and
under `/sandboxes/{session_id}` (that session's, created lazily), so the AIO SDK's
`Sandbox(base_url=".../sandboxes/<id>")` works against one session. Auth, error mapping
and the envelope are here; routes only call layer-2 operations.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.middleware.base import RequestResponseEndpoint
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from agentbox import __version__
from agentbox.api import files as files_api
from agentbox.api import sessions as sessions_api
from agentbox.api import v1_bash, v1_file, v1_sandbox, v1_shell, v2_commands, v2_fs, v2_sandbox, v2_watch
from agentbox.api.envelope import BodyError, BodyRefused, body_errors, error_response, query_error
from agentbox.api.guard import Guard, GuardMiddleware
from agentbox.config import Settings
from agentbox.home import HomeClaim
from agentbox.machines.errors import MachineError
from agentbox.mcp import McpHttp
from agentbox.system import opened_system
from agentbox.workspace.errors import WorkspaceError, translate

ROUTERS = [v2_fs, v2_watch, v2_commands, v2_sandbox, v1_file, v1_shell, v1_bash, v1_sandbox]
#: Paths served without an API key.
OPEN_PATHS = {"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect"}


def presented_key(request: Request) -> str | None:
    header = request.headers.get("x-aio-api-key")
    if header:
        return header
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.query_params.get("api_key")


def unauthorized() -> JSONResponse:
    return JSONResponse(
        {"success": False, "message": "missing or invalid API key", "data": None, "hint": None},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def create_app(settings: Settings, claim: HomeClaim | None = None) -> FastAPI:
    mcp_http = McpHttp()  # `/mcp`: the tools over MCP (streamable HTTP), see agentbox/mcp.py

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with opened_system(settings, claim) as system:  # the one composition root
            app.state.system = system
            async with mcp_http.running():
                yield

    app = FastAPI(title="agentbox", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    if settings.api_key:
        key = settings.api_key.encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next: RequestResponseEndpoint) -> Response:
            given = presented_key(request)
            if request.url.path not in OPEN_PATHS and (
                given is None or not hmac.compare_digest(given.encode(), key)
            ):
                return unauthorized()
            return await call_next(request)

    @app.exception_handler(WorkspaceError)
    async def workspace_error(request: Request, exc: WorkspaceError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(MachineError)
    async def machine_error(request: Request, exc: MachineError) -> Response:
        return error_response(request, translate(exc, "open", exc.path))

    if settings.allowed_origins:  # inside the guard, outside the key check: a preflight has no key
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(GuardMiddleware, guard=Guard.of(settings))  # outermost: before anything runs

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
        return {"status": "ok", "version": __version__}

    for module in ROUTERS:
        app.include_router(module.router)
        app.include_router(module.router, prefix="/sandboxes/{session_id}")
    # `/v1/files`: once, at the root; files belong to no sandbox and outlive their session.
    app.include_router(files_api.router)
    # `/v1/sessions`: once, at the root; a session is not a sandbox route.
    app.include_router(sessions_api.router)

    # MCP over streamable HTTP: an ASGI app on the exact path `/mcp` (as the SDK routes it).
    app.router.routes.append(Route("/mcp", endpoint=mcp_http, include_in_schema=False))
    return app
