"""E2B compatibility: the stock `e2b` SDK creating and driving agentbox sandboxes.

One `agentbox serve` port serves both sides of E2B: the control plane (`control.py`,
`/sandboxes`, `/v2/sandboxes`) and envd (`envd.py`, every request carrying an
`E2b-Sandbox-Id` header, and signed file URLs), with the code interpreter (`code.py`, the
requests for port 49999) beside envd. `E2BDispatch` sits in front of agentbox's own routes and sends
those requests here; everything else goes on to agentbox. Point the SDK at it with

    E2B_API_URL=http://127.0.0.1:8080      # the control plane
    E2B_SANDBOX_URL=http://127.0.0.1:8080  # envd (the SDK adds E2b-Sandbox-Id itself)
    E2B_API_KEY=<agentbox's API key>       # any non-empty value when the server has none

An E2B sandbox is an agentbox session's sandbox on the default machine (`sandboxes.py`).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.e2b.control import control_app
from agentbox.e2b.envd import SANDBOX_HEADER, Envd
from agentbox.e2b.files import FILES_PATH
from agentbox.e2b.sandboxes import SandboxTable

#: The control-plane paths: `/sandboxes`, `/sandboxes/{id}`, `/sandboxes/{id}/{action}` (and under
#: `/v2`). agentbox's own `/sandboxes/{session}/v1/...` routes are all deeper, so E2B answers
#: every path of this shape, an action it does not serve with its own 404.
CONTROL_PATH = re.compile(r"/(v2/)?sandboxes(/[^/]+(/[^/]+)?)?")


class E2B:
    """The E2B side of one server: its sandboxes, control plane and envd."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table
        self.control = control_app(table)
        self.envd = Envd(table)

    def app_for(self, scope: Scope) -> ASGIApp | None:
        """The E2B app that serves this request, or None for agentbox's own routes."""
        if scope["type"] != "http":
            return None
        if any(k.lower() == SANDBOX_HEADER for k, _ in scope["headers"]):
            return self.envd
        if scope["path"] == FILES_PATH and b"signature=" in scope["query_string"]:
            return self.envd  # a signed file URL: it names no sandbox
        if CONTROL_PATH.fullmatch(scope["path"]):
            return self.control
        return None

    async def open(self) -> None:
        """Take back the sandboxes an earlier server left (once the system is open)."""
        await self.table.restore()

    async def close(self) -> None:
        await self.table.close()


class E2BDispatch:
    """ASGI middleware: E2B's requests to `E2B`, the rest to the app behind."""

    def __init__(self, app: ASGIApp, e2b: E2B) -> None:
        self.app = app
        self.e2b = e2b

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await (self.e2b.app_for(scope) or self.app)(scope, receive, send)


__all__ = ["E2B", "E2BDispatch", "SandboxTable"]
