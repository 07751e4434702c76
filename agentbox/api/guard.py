"""Who may talk to the server at all: the `Host` and `Origin` checks that keep web pages out.

A page the operator opens in a browser can send requests to a server on loopback: a form
post or a `fetch` needs no preflight, and a name the page controls can be made to resolve
to 127.0.0.1 (DNS rebinding), after which the browser treats the server as the page's own.
Every request (HTTP and websocket, `/health` and `/mcp` included) passes two checks first:

    Host     on a loopback bind, and on any bind once `allowed_hosts` is set, the `Host`
             must be a loopback name (`localhost`, `127.0.0.1`, `[::1]`, any port) or one
             of `allowed_hosts` (`name` for any port, `name:port`, `*` for any); a request
             without a Host is refused too.
    Origin   a request that carries an `Origin` must come from the server's own origin
             (the Origin's host:port is the request's accepted `Host`, default ports
             implied) or from one of `allowed_origins`; anything else, `null` included.

A refusal is the failure envelope with 403 (`permission_denied`, v1 too); a refused
websocket is closed before it is accepted. Requests without an `Origin` (curl, the SDKs,
MCP clients) are not browser pages and pass the Origin check. That a JSON body must be
sent as JSON is `envelope.parse_body`'s rule (415).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.api.envelope import refused
from agentbox.config import Settings, is_loopback

#: Port a scheme implies when the Origin or Host names none.
DEFAULT_PORTS = {"http": "80", "https": "443"}


@dataclass(frozen=True)
class Guard:
    """The two rules, read once from the settings."""

    check_hosts: bool
    """Whether `Host` is checked: a loopback bind, or any bind with `allowed_hosts`."""
    hosts: frozenset[str]
    """`allowed_hosts`, lowercased."""
    origins: frozenset[str]
    """`allowed_origins`, lowercased, without a trailing `/`."""

    @classmethod
    def of(cls, settings: Settings) -> Guard:
        loopback_bind = settings.bind_host is not None and is_loopback(settings.bind_host)
        return cls(
            check_hosts=loopback_bind or bool(settings.allowed_hosts),
            hosts=frozenset(h.lower() for h in settings.allowed_hosts),
            origins=frozenset(o.lower().rstrip("/") for o in settings.allowed_origins),
        )

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these headers is refused, or None."""
        if self.check_hosts and not self.host_allowed(host or ""):
            return f"Host {host!r} is not a name this server answers to (set allowed_hosts to add one)"
        if origin is not None and not self.origin_allowed(origin, host or ""):
            return f"Origin {origin!r} may not call this server (set allowed_origins to add one)"
        return None

    def host_allowed(self, host: str) -> bool:
        host = host.strip().lower()
        name, _port = split_host(host)
        return is_loopback(name) or bool({"*", host, name} & self.hosts)

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if origin in self.origins:
            return True
        scheme, sep, netloc = origin.partition("://")
        if not sep or scheme not in DEFAULT_PORTS or not netloc or not host:
            return False
        return with_port(netloc, scheme) == with_port(host.strip().lower(), scheme)


def split_host(host: str) -> tuple[str, str]:
    """`name:port` → (name, port); `[::1]:8091` → (`::1`, `8091`); no port → ''."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest.removeprefix(":")
    name, _, port = host.partition(":")
    return name, port


def with_port(netloc: str, scheme: str) -> tuple[str, str]:
    name, port = split_host(netloc)
    return name, port or DEFAULT_PORTS[scheme]


class GuardMiddleware:
    """ASGI middleware applying `Guard` before the application sees the request."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        why = self.guard.refusal(headers.get("host"), headers.get("origin"))
        if why is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
        else:
            await refused(403, "permission_denied", why, "request", "Forbidden")(scope, receive, send)
