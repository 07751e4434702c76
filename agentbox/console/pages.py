"""The console's page and assets: one HTML page, its ES modules and stylesheet.

    GET /                    307 to `console/` (relative, so a proxy's path prefix is kept)
    GET /console             307 to `console/`
    GET /console/            the page (`static/index.html`)
    GET /console/static/*    the modules, the stylesheet

The page forbids being framed (its buttons allow tool calls and apply changes, so another
page must not overlay them) and loads nothing but its own origin's scripts and styles; it
never builds markup from data (every text goes in through `textContent`).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from agentbox.console.login import router as login_router

#: The page and its assets, installed as package data.
STATIC = Path(__file__).parent / "static"
#: Where the assets are served.
ASSETS_PATH = "/console/static"
#: Paths served without an API key: the page and the login routes carry no data.
OPEN_PATHS = frozenset({"/", "/console", "/console/", "/console/login", "/console/logout"})
#: Path prefixes served without an API key (the assets).
OPEN_PREFIXES = (ASSETS_PATH + "/",)

#: Only this origin's scripts, styles and connections; images also from `blob:` (previews).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
#: Assets are revalidated (ETag) on every load, so an upgraded server's page is the one shown.
ASSET_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


class Assets(StaticFiles):
    """The assets, with `ASSET_HEADERS` on every response."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(ASSET_HEADERS)
        return response


@router.get("/")
@router.get("/console")
async def to_console() -> RedirectResponse:
    return RedirectResponse("console/", status_code=307)


@router.get("/console/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


def add_console(app: FastAPI) -> None:
    """Serve the console from `app`: its page, its assets and its login routes."""
    app.include_router(router)
    app.include_router(login_router)
    app.mount(ASSETS_PATH, Assets(directory=STATIC), name="console-assets")
