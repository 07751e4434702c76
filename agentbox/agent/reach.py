"""Where the server connects on a session's behalf: a session's model `base_url` and MCP `url`s.

These requests leave from the server, not from the sandbox, so they get the guards a
sandbox's network namespace would otherwise give (the same address check as `web_fetch`):

- only http and https, with a host;
- nothing when the session's machine has no network (`network = "off"`); a session without
  a machine counts as networked, as its `web_fetch` is;
- the host name is resolved once; every address must be public (not loopback, private,
  link-local, nor one of this host's own addresses), and the connection goes to that checked
  address (`Pin`: Host header and TLS SNI keep the name), so a second DNS answer cannot
  switch it;
- unless the operator lists the endpoint in `model_endpoints` (`agentbox.config`): a URL
  under a listed prefix (same scheme, host, port, and a path below the prefix's) may be on
  loopback or a private network, and is reached even from a machine without a network.

What the server's credentials may reach is decided elsewhere (`providers.endpoint`): a
session-supplied URL never gets them, listed or not.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agentbox.config import MachineConfig
from agentbox.tools.web import ALLOWED_SCHEMES, FetchRefused, resolve


class Unreachable(ValueError):
    """A session-supplied URL the server will not connect to; the message says why."""


@dataclass(frozen=True)
class Reach:
    """A session's policy for URLs the server reaches for it."""

    network: bool = True
    """The session's machine has a network."""
    allowed: tuple[str, ...] = ()
    """The operator's `model_endpoints`: URL prefixes reachable although not public."""

    @classmethod
    def on(cls, machine: MachineConfig | None, endpoints: Sequence[str]) -> Reach:
        """The reach of a session on `machine` (None: no machine, which counts as networked)."""
        return cls(machine is None or machine.network_on, tuple(endpoints))

    def check(self, raw: str, what: str) -> httpx.URL:
        """The URL if its form and the network policy allow it (no DNS yet); else `Unreachable`."""
        try:
            url = httpx.URL(str(raw).strip())
        except (httpx.InvalidURL, TypeError) as exc:
            raise Unreachable(f"{what} {raw!r} is not a valid URL ({exc})") from exc
        if url.scheme not in ALLOWED_SCHEMES or not url.host:
            raise Unreachable(f"{what} must be an http or https URL with a host, not {raw!r}")
        if not self.network and not self.listed(url):
            raise Unreachable(f"{what} {raw} is refused: the session's machine has no network (network off)")
        return url

    def listed(self, url: httpx.URL) -> bool:
        return any(under(url, prefix) for prefix in self.allowed)

    async def pin(self, raw: str, what: str) -> Pin:
        """Check `raw`, resolve its host once and check the address: where to connect."""
        url = self.check(raw, what)
        listed = self.listed(url)
        try:
            address = await resolve(url, allow_private=listed, purpose=what)
        except FetchRefused as exc:
            raise Unreachable(f"{what} {raw} is refused: {exc}") from exc
        if not listed and own_address(address):
            raise Unreachable(f"{what} {raw} is refused: {address} is an address of this host")
        return Pin(url.host, address)


def under(url: httpx.URL, prefix: str) -> bool:
    """Whether `url` is the endpoint `prefix` or below it (scheme, host and port equal, path under)."""
    try:
        base = httpx.URL(prefix.strip())
    except (httpx.InvalidURL, TypeError):
        return False
    if (url.scheme, url.host.lower(), port_of(url)) != (base.scheme, base.host.lower(), port_of(base)):
        return False
    root = base.path.rstrip("/")
    return url.path == root or url.path.startswith(root + "/")


def port_of(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def own_address(address: str) -> bool:
    """Whether `address` belongs to this host (binding to it succeeds only if it does)."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Pin:
    """A host name and the one checked address requests for it go to."""

    host: str
    address: str

    def transport(self, inner: Any) -> PinnedTransport:
        """`inner` (an httpx or httpx2 async transport) made to connect only to the checked address."""
        return PinnedTransport(inner, self)


class PinnedTransport:
    """Sends each request to the pinned address, keeping the name for Host and TLS (SNI,
    certificate check); a request for any other host is refused. Works for httpx and httpx2,
    which share the transport interface; give the client `trust_env=False` so no proxy mount
    from the environment bypasses it."""

    def __init__(self, inner: Any, pin: Pin) -> None:
        self.inner = inner
        self.pin = pin

    async def handle_async_request(self, request: Any) -> Any:
        if request.url.host != self.pin.host:
            raise Unreachable(f"a request to {request.url.host} is refused: only {self.pin.host} was checked")
        request.url = request.url.copy_with(host=self.pin.address)
        if request.url.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": self.pin.host}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> PinnedTransport:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.inner.__aexit__(*exc)
