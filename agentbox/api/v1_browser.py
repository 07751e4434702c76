"""AIO `/v1/browser/*`: the sandbox's browser, wire-compatible with the AIO SDK 0.0.30.

    GET    /v1/browser/info                 user agent, CDP URL, viewport
    GET    /v1/browser/screenshot           PNG of the current tab
    POST   /v1/browser/actions              one pointer or keyboard action (`action_type`)
    POST   /v1/browser/page/{navigate, back, forward, reload, click, fill, type, press_key,
                             hover, select_option, scroll, evaluate, wait, dialog}
    GET    /v1/browser/page/{screenshot, text, markdown, html, elements}
    GET    /v1/browser/tabs                 the open tabs, by index
    POST   /v1/browser/tabs                 open one ({url})
    DELETE /v1/browser/tabs/{index}         close one
    PUT    /v1/browser/tabs/{index}/activate

Everything runs on the machine's one `Browser` (`agentbox.workspace.browser`), the one the
agent's browser tool and the CDP endpoint (`agentbox.api.cdp`) drive: an operation with an
action of its own goes through `Browser.act`; the others (selectors, coordinates, evaluate,
html, markdown) through `Browser.perform`, under the same rules (one at a time, the dialog
and takeover checks, a time limit). URLs are http and https only.

Choices where upstream is silent or this server differs:

- `timeout` (navigate, wait) is in milliseconds, as in Playwright, at most
  `MAX_TIMEOUT_SECONDS`; `delay` (type) and `polling` (wait) too.
- An element is named by `selector` (a Playwright selector: CSS, `text=...`; the first match
  is used) or by `index`, its position (from 0) in `GET /page/elements`: the interactive
  elements of the page's accessibility snapshot, frames included, in page order, each with
  the snapshot's `ref` (what the agent's browser tool names it by). An action by `index`
  looks the list up again, so an index holds while the page shows the same elements.
- Tabs are named by `index`, their position in `GET /tabs` (0 first, in the order opened).
- `vnc_url` is "": the browser is headless, there is no display.
- `/actions` maps what a headless page can do: MOVE_TO, CLICK, RIGHT_CLICK, DOUBLE_CLICK,
  MOUSE_DOWN, MOUSE_UP, DRAG_TO, SCROLL, TYPING, PRESS, KEY_DOWN, KEY_UP, HOTKEY, WAIT.
  MOVE_REL and DRAG_REL are refused (`bad_request`): the pointer's position is not known.
  Key names may be xdotool's (`enter`, `ctrl`, `pagedown`) or Playwright's (`Enter`).
  TYPING with `use_clipboard` types the text (there is no clipboard).
- A page dialog (alert, confirm, prompt) stops the page until it is handled: the operation
  that opened it answers at once with `hint` naming it, every other one is `conflict` until
  `POST /page/dialog` (not upstream: `{accept, prompt_text}`) accepts or dismisses it.
- `/page/wait` supports `selector`, `load`, `url`, `network_idle`, `function` and
  `timeout`; `download`, `response` and `request` are refused.

Failures are AIO's: HTTP 200, `success: false`, `data` the error object (a page that never
loads is `timeout`, an unknown element `not_found`, a file: URL `bad_request`). The
screenshot routes answer failures with their HTTP status instead, as downloads do: the SDK
hands a 200 body to its caller as the image.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from agentbox.api.cdp import WS_KEY, relayed, ws_origin
from agentbox.api.envelope import failure, json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox, Sandbox
from agentbox.api.schemas import Failure, failures, streamed, v1_reply, v1_stream
from agentbox.tools.web import html_markdown
from agentbox.workspace.browser import (
    ACTION_TIMEOUT_SECONDS,
    MAX_SCREENSHOT_BYTES,
    MAX_SNAPSHOT_CHARS,
    MAX_TEXT_CHARS,
    MAX_TIMEOUT_SECONDS,
    NAVIGATION_TIMEOUT_SECONDS,
    VIEWPORT,
    ActionSpec,
    Browser,
    BrowserArgs,
    BrowserReply,
    Tab,
    check_url,
    cut,
    error,
    where,
)
from agentbox.workspace.errors import WorkspaceError

router = APIRouter(prefix="/v1/browser", tags=["browser"])

#: Characters of a selector or a script expression accepted.
MAX_SELECTOR_CHARS = 2048
MAX_EXPRESSION_CHARS = 100_000
#: Bytes of an `evaluate` result (as JSON) returned at most.
MAX_EVALUATE_RESULT_BYTES = 1024 * 1024
#: Interactive elements `page/elements` lists at most.
MAX_ELEMENTS = 500
#: Milliseconds between two typed keys at most (`type`'s `delay`), and the share of the
#: action's time limit a delayed typing may take (past it the browser would be reset).
MAX_TYPE_DELAY_MS = 1000.0
TYPING_SHARE = 0.5
#: Seconds one WAIT action of `/actions` may sleep.
MAX_WAIT_ACTION_SECONDS = 60.0
#: Characters of a key name (`Control+Shift+ArrowDown` is 23).
MAX_KEY_CHARS = 64
#: Pointer moves a DRAG_TO makes on its way (pages see a drag, not a jump).
DRAG_STEPS = 10
#: Most clicks of one CLICK (`num_clicks`) and the pixels of one SCROLL either way.
MAX_CLICKS = 3
MAX_SCROLL_PIXELS = 100_000
#: JPEG quality when the caller names none.
DEFAULT_JPEG_QUALITY = 80
#: Accessibility roles `page/elements` counts as interactive.
INTERACTIVE_ROLES = frozenset(
    {"button", "link", "textbox", "searchbox", "checkbox", "radio", "combobox", "listbox", "menuitem",
     "menuitemcheckbox", "menuitemradio", "option", "tab", "switch", "slider", "spinbutton", "treeitem"}
)  # fmt: skip
#: One element line of an accessibility snapshot in Playwright's `ai` mode.
SNAPSHOT_LINE = re.compile(r'^\s*- (?P<role>[a-z]+)(?: "(?P<name>(?:[^"\\]|\\.)*)")?(?P<rest>.*)$')
SNAPSHOT_REF = re.compile(r"\[ref=(?P<ref>(?:f\d+)?e\d+)\]")
SNAPSHOT_URL = re.compile(r"^\s*- /url: (?P<url>.*)$")
#: xdotool's key names (AIO's display actions) as Playwright's.
KEY_NAMES = {
    "enter": "Enter", "return": "Enter", "tab": "Tab", "esc": "Escape", "escape": "Escape",
    "backspace": "Backspace", "delete": "Delete", "del": "Delete", "space": "Space", "insert": "Insert",
    "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight",
    "home": "Home", "end": "End", "pageup": "PageUp", "page_up": "PageUp", "pagedown": "PageDown",
    "page_down": "PageDown", "ctrl": "Control", "control": "Control", "alt": "Alt", "shift": "Shift",
    "meta": "Meta", "cmd": "Meta", "command": "Meta", "super": "Meta", "win": "Meta",
    **{f"f{n}": f"F{n}" for n in range(1, 13)},
}  # fmt: skip
Button = Literal["left", "right", "middle"]
Direction = Literal["up", "down", "left", "right"]
ActionType = Literal[
    "MOVE_TO", "MOVE_REL", "CLICK", "MOUSE_DOWN", "MOUSE_UP", "RIGHT_CLICK", "DOUBLE_CLICK", "DRAG_TO",
    "DRAG_REL", "SCROLL", "TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY", "WAIT",
]  # fmt: skip
WaitType = Literal[
    "selector", "load", "url", "network_idle", "download", "function", "response", "request", "timeout"
]
LoadState = Literal["load", "domcontentloaded", "networkidle", "commit"]

#: What the browser routes can fail with besides AIO's 200: the screenshots' HTTP statuses.
SCREENSHOT_RESPONSES = {
    **v1_stream(streamed("image/png", "The image (PNG, or JPEG when `format` asks)")),
    **failures(400, 404, 409, 500, 503, 504),
}


# ---------------------------------------------------------------- bodies


class NavigateBody(BaseModel):
    url: str
    wait_until: LoadState | None = None
    timeout: float | None = Field(None, description="Milliseconds (default 30000).")


class ClickBody(BaseModel):
    selector: str | None = None
    index: int | None = None
    x: float | None = None
    y: float | None = None
    button: Button | None = None
    click_count: int | None = None


class FillBody(BaseModel):
    text: str
    selector: str | None = None
    index: int | None = None


class TypeBody(BaseModel):
    text: str
    delay: float | None = Field(None, description="Milliseconds between keys.")


class KeyBody(BaseModel):
    key: str


class HoverBody(BaseModel):
    selector: str | None = None
    x: float | None = None
    y: float | None = None


class SelectBody(BaseModel):
    selector: str
    value: str | None = None
    label: str | None = None
    index: int | None = None


class ScrollBody(BaseModel):
    direction: Direction | None = None
    amount: int | None = None


class EvaluateBody(BaseModel):
    expression: str


class WaitBody(BaseModel):
    type: WaitType
    selector: str | None = None
    state: str | None = None
    url: str | None = None
    save_path: str | None = None
    timeout: float | None = Field(None, description="Milliseconds (default 10000).")
    expression: str | None = None
    polling: float | None = None
    url_pattern: str | None = None


class DialogBody(BaseModel):
    accept: bool = True
    prompt_text: str | None = None


class TabBody(BaseModel):
    url: str | None = None


class ActionBody(BaseModel):
    """One action of AIO's display API, by `action_type`; each reads the fields it names."""

    action_type: ActionType
    x: float | None = None
    y: float | None = None
    x_offset: float | None = None
    y_offset: float | None = None
    button: Button | None = None
    num_clicks: int | None = None
    dx: int | None = None
    dy: int | None = None
    text: str | None = None
    use_clipboard: bool | None = None
    key: str | None = None
    keys: list[str] | None = None
    duration: float | None = None


# ---------------------------------------------------------------- replies (`data` of each route)


class Viewport(BaseModel):
    width: int
    height: int


class BrowserInfo(BaseModel):
    user_agent: str
    cdp_url: str = Field(description="The WebSocket URL of the browser on this server's CDP endpoint.")
    vnc_url: str = Field(description='Always "": the browser is headless.')
    cdp_ui_url: str | None = None
    viewport: Viewport
    page_viewport: Viewport | None


class PageInfo(BaseModel):
    """Where the current tab is after the operation."""

    tab: int = Field(description="The tab's id (its `index` is its position in GET /v1/browser/tabs).")
    url: str
    title: str


class Navigated(PageInfo):
    status: int | None = Field(description="The HTTP status of the page's main response.")


class Markdown(PageInfo):
    markdown: str
    truncated: bool


class Element(BaseModel):
    index: int
    ref: str = Field(
        description="The accessibility snapshot's reference (what the browser tool names it by)."
    )
    role: str
    name: str
    url: str | None = None


class TabInfo(BaseModel):
    index: int
    tab: int
    url: str
    title: str
    active: bool


class ActionData(BaseModel):
    status: Literal["success"]
    action_performed: str


class ActionReply(BaseModel):
    """AIO's `ActionResponse`: the envelope, with `status` and `action_performed` at the top too."""

    success: Literal[True]
    message: str
    data: ActionData
    hint: None
    status: Literal["success"]
    action_performed: str


# ---------------------------------------------------------------- running an operation

#: An operation of a route on the current tab.
Operation = Callable[[Tab], Awaitable[BrowserReply]]


async def perform(
    sb: Sandbox, name: str, operation: Operation, timeout: float | None = None, navigates: bool = False
) -> BrowserReply:
    """Run `operation` on the current tab under the browser's rules; `timeout` in seconds."""

    async def run(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
        return await operation(tab)

    spec = ActionSpec("write", run, navigates=navigates)
    return await sb.browser().perform(name, spec, BrowserArgs(timeout=timeout))


async def on_page(tab: Tab) -> BrowserReply:
    return BrowserReply("", await where(tab))


def seconds(ms: float | None) -> float | None:
    """A caller's milliseconds as the browser's seconds (it checks the bounds)."""
    if ms is None:
        return None
    if not 0 < ms <= MAX_TIMEOUT_SECONDS * 1000:
        raise error(
            "bad_request", f"timeout must be more than 0 and at most {MAX_TIMEOUT_SECONDS * 1000:g} ms"
        )
    return ms / 1000


def limit_ms(ms: float | None, default: float) -> float:
    checked = seconds(ms)
    return (checked if checked is not None else default) * 1000


async def locate(tab: Tab, selector: str) -> Any:
    """The first element `selector` matches now; `not_found` when none does."""
    if not selector or len(selector) > MAX_SELECTOR_CHARS:
        raise error("bad_request", f"a selector must be 1 to {MAX_SELECTOR_CHARS} characters")
    locator = tab.page.locator(selector).first
    if await locator.count() == 0:
        raise error("not_found", f"no element on the page matches the selector {selector[:200]!r}")
    return locator


async def ref_at(sb: Sandbox, index: int) -> str:
    """The snapshot reference of the element at `index` of the page's elements now."""
    reply = await sb.browser().act("page.elements.snapshot", BrowserArgs())
    found = interactive(reply.data.get("snapshot", ""))
    if not 0 <= index < len(found):
        raise error("not_found", f"no element has index {index}: the page has {len(found)} interactive "
                    "elements now (GET /v1/browser/page/elements lists them, from 0)")  # fmt: skip
    return str(found[index]["ref"])


async def act_on_index(sb: Sandbox, action: str, index: int, args: BrowserArgs) -> BrowserReply:
    """`action` on the element at `index` of the page's elements (looked up again now)."""
    return await sb.browser().act(action, replace(args, ref=await ref_at(sb, index)))


def answer(reply: BrowserReply, data: Any, message: str = "Operation successful") -> JSONResponse:
    """The success envelope; when the operation opened a page dialog, `hint` says so (the
    operation finishes once the dialog is handled, see `agentbox.workspace.browser`)."""
    hint = reply.text if "dialog" in reply.data else None
    return ok(data, message, hint=hint)


def page_reply(reply: BrowserReply, message: str = "Operation successful") -> JSONResponse:
    return answer(reply, {k: reply.data[k] for k in ("tab", "url", "title") if k in reply.data}, message)


def one_way(selector: str | None, index: int | None, x: float | None = None, y: float | None = None) -> str:
    """Which way the body names its element: `selector`, `index` or `x`/`y` (exactly one)."""
    given = [n for n, v in (("selector", selector), ("index", index)) if v is not None]
    if x is not None or y is not None:
        if x is None or y is None:
            raise error("bad_request", "give both `x` and `y`")
        given.append("xy")
    if len(given) != 1:
        raise error("bad_request", "name the element one way: `selector`, `index` or `x` and `y`")
    return given[0]


# ---------------------------------------------------------------- info, screenshot, actions


@router.get("/info", response_model=v1_reply(BrowserInfo))
async def info(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """The browser's user agent, its CDP WebSocket URL on this server, the viewport (starts it)."""
    version = await sb.cdp().json("/json/version")

    async def viewport(tab: Tab) -> BrowserReply:
        size = await tab.page.evaluate("() => [window.innerWidth, window.innerHeight]")
        return BrowserReply("", {"width": size[0], "height": size[1]})

    inner = await perform(sb, "browser/info", viewport)
    data = {
        "user_agent": version.get("User-Agent", ""),
        "cdp_url": relayed(version, ws_origin(request)).get(WS_KEY, ""),
        "vnc_url": "",
        "cdp_ui_url": None,
        "viewport": dict(VIEWPORT),
        "page_viewport": inner.data if "width" in inner.data else None,
    }
    return answer(inner, data)


@router.get("/screenshot", response_class=Response, responses=SCREENSHOT_RESPONSES)
async def screenshot(sb: CurrentSandbox) -> Response:
    """A PNG of the current tab's viewport."""
    return await shot(sb, False, "png", None)


@router.post("/actions", openapi_extra=json_body(ActionBody), response_model=ActionReply | Failure)
async def actions(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """One pointer or keyboard action on the current tab (see the module docstring for which)."""
    body = await parse_body(request, ActionBody)
    performed = body.action_type
    try:
        run = action_of(body)
        wait = body.duration if performed == "WAIT" else None
        await perform(sb, f"browser/actions {performed}", run, timeout=wait_limit(wait))
    except WorkspaceError as exc:  # SDK 0.0.30 reads any `data` here as ActionData: name the action
        return failure(exc, v1=True, also={"action_performed": performed})
    return ok({"status": "success", "action_performed": performed}, f"{performed} performed",
              status="success", action_performed=performed)  # fmt: skip


def wait_limit(duration: float | None) -> float | None:
    if duration is None:
        return None
    if not 0 <= duration <= MAX_WAIT_ACTION_SECONDS:
        raise error("bad_request", f"WAIT duration must be 0 to {MAX_WAIT_ACTION_SECONDS:g} seconds")
    return duration + ACTION_TIMEOUT_SECONDS


def key_name(key: str | None) -> str:
    if not key or len(key) > MAX_KEY_CHARS:
        raise error("bad_request", "this action needs `key`, such as enter, ctrl or a")
    return KEY_NAMES.get(key.lower(), key) if len(key) > 1 else key


def need(value: Any, name: str, action: str) -> Any:
    if value is None:
        raise error("bad_request", f"{action} needs `{name}`")
    return value


def action_of(body: ActionBody) -> Operation:
    """The operation of one action (its arguments checked before anything runs)."""
    kind = body.action_type
    button = body.button or "left"
    if kind in ("MOVE_REL", "DRAG_REL"):
        raise error("bad_request", f"{kind} is not supported: the pointer's position is not known here; "
                    "use MOVE_TO or DRAG_TO with absolute x and y")  # fmt: skip
    if kind in ("MOVE_TO", "DRAG_TO"):
        x, y = need(body.x, "x", kind), need(body.y, "y", kind)
    clicks = body.num_clicks or 1
    if not 1 <= clicks <= MAX_CLICKS:
        raise error("bad_request", f"num_clicks must be 1 to {MAX_CLICKS}")
    if kind == "TYPING" and len(need(body.text, "text", kind)) > MAX_TEXT_CHARS:
        raise error("bad_request", f"`text` is more than {MAX_TEXT_CHARS} characters")
    keys = [key_name(k) for k in need(body.keys, "keys", kind)] if kind == "HOTKEY" else []
    key = key_name(body.key) if kind in ("PRESS", "KEY_DOWN", "KEY_UP") else ""
    dx, dy = body.dx or 0, body.dy or 0
    if max(abs(dx), abs(dy)) > MAX_SCROLL_PIXELS:
        raise error("bad_request", f"dx and dy are at most {MAX_SCROLL_PIXELS} pixels")
    wait_limit(body.duration if kind == "WAIT" else None)

    async def run(tab: Tab) -> BrowserReply:
        mouse, keyboard = tab.page.mouse, tab.page.keyboard
        if kind == "MOVE_TO":
            await mouse.move(x, y)
        elif kind in ("CLICK", "RIGHT_CLICK", "DOUBLE_CLICK"):
            which = "right" if kind == "RIGHT_CLICK" else button
            count = 2 if kind == "DOUBLE_CLICK" else clicks
            if body.x is not None and body.y is not None:
                await mouse.click(body.x, body.y, button=which, click_count=count)
            else:
                for n in range(1, count + 1):
                    await mouse.down(button=which, click_count=n)
                    await mouse.up(button=which, click_count=n)
        elif kind == "MOUSE_DOWN":
            await mouse.down(button=button)
        elif kind == "MOUSE_UP":
            await mouse.up(button=button)
        elif kind == "DRAG_TO":
            await mouse.down(button=button)
            await mouse.move(x, y, steps=DRAG_STEPS)
            await mouse.up(button=button)
        elif kind == "SCROLL":
            await mouse.wheel(dx, dy)
        elif kind == "TYPING":
            await keyboard.type(body.text or "")
        elif kind == "PRESS":
            await keyboard.press(key)
        elif kind == "KEY_DOWN":
            await keyboard.down(key)
        elif kind == "KEY_UP":
            await keyboard.up(key)
        elif kind == "HOTKEY":
            await keyboard.press("+".join(keys))
        elif kind == "WAIT":
            await asyncio.sleep(body.duration or 0)
        return await on_page(tab)

    return run


# ---------------------------------------------------------------- page: navigation


@router.post("/page/navigate", openapi_extra=json_body(NavigateBody), response_model=v1_reply(Navigated))
async def navigate(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, NavigateBody)
    timeout = seconds(body.timeout)
    if body.wait_until in (None, "load"):
        reply = await sb.browser().act("page.navigate", BrowserArgs(url=body.url, timeout=timeout))
    else:
        url, until = check_url(body.url), body.wait_until

        async def go(tab: Tab) -> BrowserReply:
            response = await tab.page.goto(
                url, wait_until=until, timeout=limit_ms(body.timeout, NAVIGATION_TIMEOUT_SECONDS)
            )
            return BrowserReply("", {**await where(tab), "status": response.status if response else None})

        reply = await perform(sb, "browser/page/navigate", go, timeout, navigates=True)
    data = {k: reply.data.get(k) for k in ("tab", "url", "title", "status")}
    return answer(reply, data, f"navigated to {data['url']}")


def history_route(step: str) -> Callable[[CurrentSandbox], Awaitable[JSONResponse]]:
    async def route(sb: CurrentSandbox) -> JSONResponse:
        return page_reply(await sb.browser().act(f"page.{step}", BrowserArgs()))

    route.__name__ = step
    route.__doc__ = f"{step.capitalize()} the current tab."
    return route


for _step in ("back", "forward", "reload"):
    router.add_api_route(f"/page/{_step}", history_route(_step), methods=["POST"],
                         response_model=v1_reply(PageInfo))  # fmt: skip


# ---------------------------------------------------------------- page: elements


@router.post("/page/click", openapi_extra=json_body(ClickBody), response_model=v1_reply(PageInfo))
async def click(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Click an element (`selector` or `index`) or a point (`x`, `y`)."""
    body = await parse_body(request, ClickBody)
    way = one_way(body.selector, body.index, body.x, body.y)
    button, count = body.button or "left", body.click_count or 1
    if not 1 <= count <= MAX_CLICKS:
        raise error("bad_request", f"click_count must be 1 to {MAX_CLICKS}")
    if way == "index" and button == "left" and count == 1:
        return page_reply(await act_on_index(sb, "page.click", body.index or 0, BrowserArgs()))
    if way == "index":
        raise error(
            "bad_request", "an element by `index` takes a single left click; use `selector` or x and y"
        )

    async def run(tab: Tab) -> BrowserReply:
        if way == "xy":
            await tab.page.mouse.click(body.x, body.y, button=button, click_count=count)
        else:
            target = await locate(tab, body.selector or "")
            await target.click(button=button, click_count=count, timeout=ACTION_TIMEOUT_SECONDS * 1000)
        return await on_page(tab)

    return page_reply(await perform(sb, "browser/page/click", run))


@router.post("/page/fill", openapi_extra=json_body(FillBody), response_model=v1_reply(PageInfo))
async def fill(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Replace an input's value (`selector` or `index`) with `text`."""
    body = await parse_body(request, FillBody)
    if len(body.text) > MAX_TEXT_CHARS:
        raise error("bad_request", f"`text` is more than {MAX_TEXT_CHARS} characters")
    if one_way(body.selector, body.index) == "index":
        return page_reply(await act_on_index(sb, "page.fill", body.index or 0, BrowserArgs(text=body.text)))

    async def run(tab: Tab) -> BrowserReply:
        await (await locate(tab, body.selector or "")).fill(body.text, timeout=ACTION_TIMEOUT_SECONDS * 1000)
        return await on_page(tab)

    return page_reply(await perform(sb, "browser/page/fill", run))


@router.post("/page/type", openapi_extra=json_body(TypeBody), response_model=v1_reply(PageInfo))
async def type_text(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Type `text` into the focused element, `delay` ms between keys."""
    body = await parse_body(request, TypeBody)
    if not body.delay:
        return page_reply(await sb.browser().act("page.type", BrowserArgs(text=body.text)))
    delay = body.delay
    if not 0 < delay <= MAX_TYPE_DELAY_MS:
        raise error("bad_request", f"delay must be 0 to {MAX_TYPE_DELAY_MS:g} ms")
    if len(body.text) * delay > ACTION_TIMEOUT_SECONDS * 1000 * TYPING_SHARE:
        raise error("bad_request", f"typing {len(body.text)} characters {delay:g} ms apart takes longer than "
                    f"{ACTION_TIMEOUT_SECONDS * TYPING_SHARE:g} s: shorten the text or the delay")  # fmt: skip

    async def run(tab: Tab) -> BrowserReply:
        await tab.page.keyboard.type(body.text, delay=delay)
        return await on_page(tab)

    return page_reply(await perform(sb, "browser/page/type", run))


@router.post("/page/press_key", openapi_extra=json_body(KeyBody), response_model=v1_reply(PageInfo))
async def press_key(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Press one key (Playwright's names: Enter, ArrowDown, Control+A)."""
    body = await parse_body(request, KeyBody)
    return page_reply(await sb.browser().act("page.press", BrowserArgs(key=body.key)))


@router.post("/page/hover", openapi_extra=json_body(HoverBody), response_model=v1_reply(PageInfo))
async def hover(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, HoverBody)
    way = one_way(body.selector, None, body.x, body.y)

    async def run(tab: Tab) -> BrowserReply:
        if way == "xy":
            await tab.page.mouse.move(body.x, body.y)
        else:
            await (await locate(tab, body.selector or "")).hover(timeout=ACTION_TIMEOUT_SECONDS * 1000)
        return await on_page(tab)

    return page_reply(await perform(sb, "browser/page/hover", run))


@router.post("/page/select_option", openapi_extra=json_body(SelectBody), response_model=v1_reply(PageInfo))
async def select_option(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Choose an option of a `<select>` by `value`, `label` or `index` (exactly one)."""
    body = await parse_body(request, SelectBody)
    chosen = {
        k: v
        for k, v in (("value", body.value), ("label", body.label), ("index", body.index))
        if v is not None
    }
    if len(chosen) != 1:
        raise error("bad_request", "choose the option one way: `value`, `label` or `index`")

    async def run(tab: Tab) -> BrowserReply:
        target = await locate(tab, body.selector)
        selected = await target.select_option(**chosen, timeout=ACTION_TIMEOUT_SECONDS * 1000)
        return BrowserReply("", {**await where(tab), "selected": selected})

    return page_reply(await perform(sb, "browser/page/select_option", run))


@router.post("/page/scroll", openapi_extra=json_body(ScrollBody), response_model=v1_reply(PageInfo))
async def scroll(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Scroll the page `amount` pixels `direction` (default: down, the browser's default amount)."""
    body = await parse_body(request, ScrollBody)
    args = BrowserArgs(direction=body.direction or "down", amount=body.amount)
    return page_reply(await sb.browser().act("page.scroll", args))


@router.post("/page/evaluate", openapi_extra=json_body(EvaluateBody), response_model=v1_reply(Any))
async def evaluate(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Run a JavaScript expression (or function) in the page; `data` is its result as JSON."""
    body = await parse_body(request, EvaluateBody)
    if not body.expression or len(body.expression) > MAX_EXPRESSION_CHARS:
        raise error("bad_request", f"expression must be 1 to {MAX_EXPRESSION_CHARS} characters")

    async def run(tab: Tab) -> BrowserReply:
        try:
            result = as_json(await tab.page.evaluate(body.expression))
        except RecursionError:
            raise error("bad_request", "the result nests too deeply to return") from None
        size = len(json.dumps(result))
        if size > MAX_EVALUATE_RESULT_BYTES:
            raise error(
                "bad_request", f"the result is {size} bytes of JSON, more than {MAX_EVALUATE_RESULT_BYTES}"
            )
        return BrowserReply("", {"result": result})

    reply = await perform(sb, "browser/page/evaluate", run)
    return answer(reply, reply.data.get("result"))


def as_json(value: Any) -> Any:
    """A value from the page as JSON data: NaN and the infinities as JavaScript spells them, a
    date in ISO 8601, anything else JSON has no type for (a RegExp...) as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


@router.post("/page/wait", openapi_extra=json_body(WaitBody), response_model=v1_reply(PageInfo))
async def wait(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Wait for a selector's state, a load state, a URL, a function to be truthy, or a time."""
    body = await parse_body(request, WaitBody)
    timeout = limit_ms(body.timeout, ACTION_TIMEOUT_SECONDS)
    run = waiter(body, timeout)
    return page_reply(await perform(sb, f"browser/page/wait {body.type}", run, timeout / 1000))


def waiter(body: WaitBody, timeout: float) -> Operation:
    kind = body.type
    if kind in ("download", "response", "request"):
        raise error("bad_request", f"wait type {kind!r} is not supported: use selector, load, url, "
                    "network_idle, function or timeout")  # fmt: skip
    states = {
        "selector": ("attached", "detached", "visible", "hidden"),
        "load": ("load", "domcontentloaded", "networkidle"),
    }
    if body.state is not None and kind in states and body.state not in states[kind]:
        raise error("bad_request", f"state for {kind} is one of {', '.join(states[kind])}")
    if kind == "selector":
        need(body.selector, "selector", "wait selector")
    if kind == "url":
        need(body.url or body.url_pattern, "url", "wait url")
    if kind == "function" and not body.expression:
        raise error("bad_request", "wait function needs `expression`")

    async def run(tab: Tab) -> BrowserReply:
        page = tab.page
        if kind == "selector":
            locator = page.locator(body.selector or "").first
            await locator.wait_for(state=body.state or "visible", timeout=timeout)
        elif kind in ("load", "network_idle"):
            state = "networkidle" if kind == "network_idle" else body.state or "load"
            await page.wait_for_load_state(state, timeout=timeout)
        elif kind == "url":
            await page.wait_for_url(body.url or body.url_pattern or "", timeout=timeout)
        elif kind == "function":
            polling: Any = body.polling if body.polling else "raf"
            await page.wait_for_function(body.expression or "", polling=polling, timeout=timeout)
        else:
            await page.wait_for_timeout(timeout)
        return await on_page(tab)

    return run


@router.post("/page/dialog", openapi_extra=json_body(DialogBody), response_model=v1_reply(Any))
async def dialog(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Not upstream: accept (with `prompt_text` for a prompt) or dismiss the open page dialog,
    which stops every other operation until it is handled."""
    body = await parse_body(request, DialogBody)
    action = "page.dialog.accept" if body.accept else "page.dialog.dismiss"
    reply = await sb.browser().act(action, BrowserArgs(text=body.prompt_text))
    return ok(reply.data, reply.text)


# ---------------------------------------------------------------- page: reading


@router.get("/page/screenshot", response_class=Response, responses=SCREENSHOT_RESPONSES)
async def page_screenshot(
    sb: CurrentSandbox,
    full_page: Annotated[bool, Query()] = False,
    format: Annotated[Literal["png", "jpeg", "jpg"], Query()] = "png",
    quality: Annotated[int | None, Query(ge=0, le=100)] = None,
) -> Response:
    """The current tab as PNG (or JPEG), the viewport or the `full_page`."""
    return await shot(sb, full_page, "png" if format == "png" else "jpeg", quality)


async def shot(sb: Sandbox, full_page: bool, kind: str, quality: int | None) -> Response:
    """The screenshot bytes, or the failure envelope with its HTTP status."""
    try:
        if kind == "png":
            image = (await sb.browser().act("page.screenshot", BrowserArgs(full_page=full_page))).png or b""
        else:

            async def run(tab: Tab) -> BrowserReply:
                jpeg = await tab.page.screenshot(type="jpeg", quality=quality or DEFAULT_JPEG_QUALITY,
                                                 full_page=full_page, timeout=ACTION_TIMEOUT_SECONDS * 1000)  # fmt: skip
                if len(jpeg) > MAX_SCREENSHOT_BYTES:
                    raise error("bad_request", f"the screenshot is over {MAX_SCREENSHOT_BYTES} bytes")
                return BrowserReply("", {}, jpeg)

            image = (await perform(sb, "browser/page/screenshot", run)).png or b""
    except WorkspaceError as exc:
        return failure(exc)
    return Response(image, media_type=f"image/{kind}")


@router.get("/page/text", response_model=v1_reply(str))
async def text(sb: CurrentSandbox) -> JSONResponse:
    """The page's visible text (`innerText`), cut at the browser's snapshot limit."""
    reply = await sb.browser().act("page.text.snapshot", BrowserArgs())
    return ok(reply.data["text"])


@router.get("/page/markdown", response_model=v1_reply(Markdown))
async def markdown(sb: CurrentSandbox) -> JSONResponse:
    """The page as Markdown (html2text), cut at the browser's snapshot limit."""

    async def run(tab: Tab) -> BrowserReply:
        place = await where(tab)
        shown, truncated = cut(html_markdown(await tab.page.content(), place["url"]))
        return BrowserReply("", {**place, "markdown": shown, "truncated": truncated})

    reply = await perform(sb, "browser/page/markdown", run)
    return answer(reply, reply.data if "markdown" in reply.data else None)


@router.get("/page/html", response_model=v1_reply(str))
async def html(sb: CurrentSandbox, outer: Annotated[bool, Query()] = True) -> JSONResponse:
    """The page's HTML: the whole document (`outer`, the default) or the body's inner HTML."""

    async def run(tab: Tab) -> BrowserReply:
        if outer:
            content = await tab.page.content()
        else:
            content = await tab.page.evaluate("() => document.body ? document.body.innerHTML : ''")
        return BrowserReply("", {"html": str(content)[:MAX_SNAPSHOT_CHARS]})

    reply = await perform(sb, "browser/page/html", run)
    return answer(reply, reply.data.get("html"))


@router.get("/page/elements", response_model=v1_reply(list[Element]))
async def elements(sb: CurrentSandbox) -> JSONResponse:
    """The page's interactive elements; `index` names one to click or fill."""
    reply = await sb.browser().act("page.elements.snapshot", BrowserArgs())
    return ok(interactive(reply.data.get("snapshot", "")))


def interactive(snapshot: str) -> list[dict[str, Any]]:
    """The interactive elements of an `ai`-mode accessibility snapshot, in page order."""
    found: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    for line in snapshot.splitlines():
        url = SNAPSHOT_URL.match(line)
        if url and last is not None and last["role"] == "link":
            last["url"] = url.group("url").strip()
            continue
        match = SNAPSHOT_LINE.match(line)
        ref = SNAPSHOT_REF.search(match.group("rest")) if match else None
        if match is None or ref is None or match.group("role") not in INTERACTIVE_ROLES:
            continue
        name = match.group("name") or ""
        last = {"index": len(found), "ref": ref.group("ref"), "role": match.group("role"),
                "name": name.replace('\\"', '"')}  # fmt: skip
        found.append(last)
        if len(found) >= MAX_ELEMENTS:
            break
    return found


# ---------------------------------------------------------------- tabs


async def tab_list(b: Browser) -> list[dict[str, Any]]:
    state = await b.act("tabs.list", BrowserArgs())
    return [{"index": i, "tab": t["tab"], "url": t["url"], "title": t["title"], "active": t["active"]}
            for i, t in enumerate(state.data["tabs"])]  # fmt: skip


async def tab_at(b: Browser, index: int) -> int:
    tabs = await tab_list(b)
    if not 0 <= index < len(tabs):
        raise error("not_found", f"there is no tab {index}: {len(tabs)} tabs are open (indexes from 0)")
    return int(tabs[index]["tab"])


@router.get("/tabs", response_model=v1_reply(list[TabInfo]))
async def tabs(sb: CurrentSandbox) -> JSONResponse:
    """The open tabs in the order they were opened; `index` names one."""
    return ok(await tab_list(sb.browser()))


@router.post("/tabs", openapi_extra=json_body(TabBody), response_model=v1_reply(TabInfo))
async def new_tab(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Open a tab (at `url`, if given) and make it the current one."""
    body = await parse_body(request, TabBody)
    b = sb.browser()
    opened = await b.act("tabs.new", BrowserArgs(url=body.url))
    listed = await tab_list(b)
    return ok(next(t for t in listed if t["tab"] == opened.data["tab"]), "tab opened")


@router.delete("/tabs/{index}", response_model=v1_reply(TabInfo | None))
async def close_tab(index: int, sb: CurrentSandbox) -> JSONResponse:
    """Close the tab at `index`; the data is the tab now current (null when none is open)."""
    b = sb.browser()
    await b.act("tabs.close", BrowserArgs(tab=await tab_at(b, index)))
    current = next((t for t in await tab_list(b) if t["active"]), None)
    return ok(current, f"tab {index} closed")


@router.put("/tabs/{index}/activate", response_model=v1_reply(TabInfo))
async def activate_tab(index: int, sb: CurrentSandbox) -> JSONResponse:
    """Make the tab at `index` the current one."""
    b = sb.browser()
    await b.act("tabs.switch", BrowserArgs(tab=await tab_at(b, index)))
    return ok((await tab_list(b))[index], f"tab {index} activated")
