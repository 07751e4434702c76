"""`/cdp`: the Chrome DevTools Protocol endpoint of the sandbox's browser, behind agentbox's auth.

    GET /cdp/json/version   Chromium's answer, `webSocketDebuggerUrl` pointing here
    GET /cdp/json           the targets (pages), each `webSocketDebuggerUrl` pointing here
    GET /cdp/json/list      the same
    WS  /cdp/devtools/...   frames relayed both ways to Chromium's own WebSocket of that path

So `playwright.chromium.connect_over_cdp("http://<server>/cdp")` (or any CDP client given
the `webSocketDebuggerUrl`) drives the browser the `/v1/browser` routes and the agent's
browser tool drive: the same Chromium, inside the sandbox (`agentbox.workspace.browser_cdp`
relays through the machine). Like every route it is also served per session, under
`/sandboxes/{session_id}/cdp`, and it needs the API key when the server has one (a
WebSocket without it is closed before it is accepted). The `/json` paths answer with a
trailing slash too (Playwright asks for `json/version/`). `devtoolsFrontendUrl` is left
out: Chromium's own DevTools pages are not served.

Failures are the envelope with their HTTP status; a WebSocket that cannot be relayed (no
browser, too many connections, an unknown target) is closed with `POLICY_VIOLATION`
before it is accepted, naming why, and with `RELAY_ENDED` when Chromium's side ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import HTTPConnection
from starlette.websockets import WebSocketDisconnect, WebSocketState

from agentbox.api.observe import SESSION_PREFIX
from agentbox.api.sandboxes import CurrentSandbox, current
from agentbox.api.schemas import SANDBOX_FAILURES, failures, plain_reply
from agentbox.machines.errors import MachineError
from agentbox.workspace.browser_cdp import MAX_CDP_MESSAGE_BYTES, Cdp, DevtoolsSocket, Message
from agentbox.workspace.errors import WorkspaceError

router = APIRouter(tags=["cdp"], responses=failures(404, 409, 500, 504, *SANDBOX_FAILURES))

#: The WebSocket close codes: refused before accept, Chromium's side ended, a message too big.
POLICY_VIOLATION, RELAY_ENDED, MESSAGE_TOO_BIG = 1008, 1011, 1009
#: Bytes of a close reason (the protocol allows 123).
MAX_CLOSE_REASON = 120
#: Where Chromium's `/json` answers put the WebSocket of a target.
WS_KEY = "webSocketDebuggerUrl"
#: Keys of Chromium's `/json` answers that point at pages of Chromium's own HTTP server.
FRONTEND_KEYS = ("devtoolsFrontendUrl", "devtoolsFrontendUrlCompat")


class CdpVersion(BaseModel):
    """Chromium's `/json/version`, its WebSocket URL rewritten to this server's."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    browser: str = Field(alias="Browser")
    protocol_version: str = Field(alias="Protocol-Version")
    user_agent: str = Field(alias="User-Agent")
    web_socket_debugger_url: str = Field(alias="webSocketDebuggerUrl")


class CdpTarget(BaseModel):
    """One target of `/json/list` (a page, a worker...)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: str
    title: str
    url: str
    webSocketDebuggerUrl: str | None = None


def ws_origin(request: HTTPConnection) -> str:
    """Where this server serves the CDP endpoint of the request's sandbox, as a WebSocket URL:
    `ws://<host>/cdp`, or `.../sandboxes/<id>/cdp` for a session's."""
    session = request.path_params.get("session_id")
    base = (SESSION_PREFIX.format(session_id=session) if session else "") + "/cdp"
    scheme = "wss" if request.url.scheme in ("https", "wss") else "ws"
    return f"{scheme}://{request.headers.get('host', request.url.netloc)}{base}"


def relayed(answer: Any, origin: str) -> Any:
    """`answer` with each `webSocketDebuggerUrl` made `origin`'s `/devtools/...`."""

    def rewrite(item: Any) -> Any:
        if not isinstance(item, dict):
            return item
        item = {k: v for k, v in item.items() if k not in FRONTEND_KEYS}
        url = item.get(WS_KEY)
        if isinstance(url, str) and "/devtools/" in url:
            item[WS_KEY] = origin + url[url.index("/devtools/") :]
        return item

    return [rewrite(i) for i in answer] if isinstance(answer, list) else rewrite(answer)


async def json_answer(request: Request, cdp: Cdp, path: str) -> JSONResponse:
    return JSONResponse(relayed(await cdp.json(path), ws_origin(request)))


@router.get("/cdp/json/version", responses=plain_reply(CdpVersion))
async def version(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    """The browser's version and the WebSocket URL a CDP client connects to (starts the browser)."""
    return await json_answer(request, sandbox.cdp(), "/json/version")


@router.get("/cdp/json/version/", include_in_schema=False)
async def version_slash(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    return await json_answer(request, sandbox.cdp(), "/json/version")


@router.get("/cdp/json/list", responses=plain_reply(list[CdpTarget]))
async def targets(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    """The browser's targets (its tabs among them), each with its WebSocket URL here."""
    return await json_answer(request, sandbox.cdp(), "/json/list")


@router.get("/cdp/json", responses=plain_reply(list[CdpTarget]))
async def targets_short(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    """The same as `/cdp/json/list`, as Chromium serves both."""
    return await json_answer(request, sandbox.cdp(), "/json/list")


@router.get("/cdp/json/list/", include_in_schema=False)
async def targets_slash(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    return await json_answer(request, sandbox.cdp(), "/json/list")


@router.websocket("/cdp/devtools/{path:path}")
async def devtools(websocket: WebSocket, path: str) -> None:
    """Relay one DevTools WebSocket (`/devtools/browser/<id>` or `/devtools/page/<id>`)."""
    try:
        sandbox = await current(websocket)
        async with sandbox.cdp().socket(f"/devtools/{path}") as upstream:
            await websocket.accept()
            await relay(websocket, upstream, sandbox.cdp())
    except (WorkspaceError, MachineError) as exc:
        await close(websocket, POLICY_VIOLATION, str(exc))
        return
    await close(websocket, RELAY_ENDED, "the browser closed the DevTools connection")


async def relay(websocket: WebSocket, upstream: DevtoolsSocket, cdp: Cdp) -> None:
    """Copy messages both ways until either side ends."""
    down = asyncio.ensure_future(to_client(websocket, upstream, cdp))
    up = asyncio.ensure_future(to_browser(websocket, upstream, cdp))
    try:
        await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (down, up):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def to_client(websocket: WebSocket, upstream: DevtoolsSocket, cdp: Cdp) -> None:
    async for message in upstream.messages():
        cdp.touch()
        if message.text:
            await websocket.send_text(message.data.decode("utf-8", errors="replace"))
        else:
            await websocket.send_bytes(message.data)


async def to_browser(websocket: WebSocket, upstream: DevtoolsSocket, cdp: Cdp) -> None:
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            received = await websocket.receive()
            if received["type"] == "websocket.disconnect":
                return
            text, data = received.get("text"), received.get("bytes")
            message = Message(True, text.encode()) if text is not None else Message(False, data or b"")
            if len(message.data) > MAX_CDP_MESSAGE_BYTES:
                await close(websocket, MESSAGE_TOO_BIG, f"messages are at most {MAX_CDP_MESSAGE_BYTES} bytes")
                return
            cdp.touch()
            await upstream.send(message)


async def close(websocket: WebSocket, code: int, reason: str) -> None:
    """Close the client's WebSocket (before accept, that refuses it) unless it is closed already."""
    if websocket.application_state == WebSocketState.DISCONNECTED:
        return
    if websocket.client_state == WebSocketState.DISCONNECTED:
        return
    with contextlib.suppress(Exception):
        await websocket.close(code, reason.encode()[:MAX_CLOSE_REASON].decode(errors="ignore"))
