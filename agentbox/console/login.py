"""The console's login: the API key traded for an HttpOnly cookie, and when the cookie counts.

    GET  /console/login    {key_required, signed_in}   (open: says whether to show the form)
    POST /console/login    {"api_key": "..."}          204 + Set-Cookie, or 401
    POST /console/logout                               204, the cookie cleared

An `EventSource` cannot send a header, and a key in a URL ends up in logs and history, so a
browser signs in once and then carries a cookie. The cookie never holds the key: it holds
`<expiry>.<HMAC-SHA256 of the expiry under the key>`, valid until it expires or the key
changes. Browsers send cookies for a host to every port of it, so another local server could
see the cookie; it would still not learn the key the SDKs and curl use.

The cookie is `HttpOnly` (no script reads it) and `SameSite=Strict`, and `signed_in` accepts
it only from the console's own pages (the Guard has already refused a foreign `Origin`):

- a request whose `Sec-Fetch-Site` names another site or origin (`same-site`, `cross-site`)
  is not signed in by the cookie: `SameSite` treats every port of 127.0.0.1 as one site, so
  a page of another local server would otherwise carry it;
- an unsafe method (POST, PUT, PATCH, DELETE) signed in by the cookie must say
  `Sec-Fetch-Site: same-origin` or carry an `Origin` (which the Guard checked), so a
  cross-site form post, or a client that says nothing of where it comes from, cannot ride it.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from agentbox.api.envelope import parse_body, unauthorized

#: The cookie's name.
COOKIE = "agentbox_console"
#: Seconds a login lasts before the console asks for the key again.
LOGIN_SECONDS = 12 * 3600
#: Methods that change nothing: the cookie signs them in without an `Origin`.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: `Sec-Fetch-Site` values of a request the console's own page (or the user, typing the URL) made.
OWN_SITES = frozenset({"same-origin", "none"})
#: What the MAC is computed over besides the expiry, so no other HMAC of the key can serve as one.
PURPOSE = b"agentbox-console-login:"

router = APIRouter(include_in_schema=False)


class LoginBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: str


def token(key: str, expires: int) -> str:
    mac = hmac.new(key.encode(), PURPOSE + str(expires).encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def valid(key: str, value: str, now: float) -> bool:
    expires, _, _mac = value.partition(".")
    if not (expires.isascii() and expires.isdigit()) or len(expires) > len(str(2**63)):
        return False
    return int(expires) > now and hmac.compare_digest(value.encode(), token(key, int(expires)).encode())


def from_own_page(request: Request) -> bool:
    """Whether the request comes from a page of this server (see the module docstring)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site.lower() not in OWN_SITES:
        return False
    if request.method in SAFE_METHODS:
        return True
    return (site or "").lower() == "same-origin" or "origin" in request.headers


def signed_in(request: Request, key: str) -> bool:
    """Whether the login cookie signs this request in for the server whose key is `key`."""
    value = request.cookies.get(COOKIE)
    return value is not None and from_own_page(request) and valid(key, value, time.time())


def api_key(request: Request) -> str | None:
    key: str | None = request.app.state.settings.api_key
    return key


@router.get("/console/login")
async def login_state(request: Request) -> JSONResponse:
    key = api_key(request)
    return JSONResponse(
        {"key_required": key is not None, "signed_in": key is None or signed_in(request, key)}
    )


@router.post("/console/login")
async def login(request: Request) -> Response:
    body = await parse_body(request, LoginBody)
    key = api_key(request)
    if key is None:
        return Response(status_code=204)
    if not hmac.compare_digest(body.api_key.encode(), key.encode()):
        return unauthorized()
    response = Response(status_code=204)
    response.set_cookie(
        COOKIE,
        token(key, int(time.time()) + LOGIN_SECONDS),
        max_age=LOGIN_SECONDS,
        path="/",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/console/logout")
async def logout(request: Request) -> Response:
    response = Response(status_code=204)
    response.delete_cookie(
        COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict"
    )
    return response
