"""`browser`: seed 001's browser tool, one tool whose `action` names what to do.

The browser is the machine's own Chromium (`agentbox.workspace.browser`), so it is offered
only on a machine whose entry enabled it (`browser = true`), and in the tiers that allow it.
Each call is authorized by what it does, not by the tool: the looking actions (state, the
two snapshots, waiting) are `Action.BROWSER_READ`, everything that changes a page or a tab is
`Action.BROWSER_WRITE`. So `plan` in the full tiers keeps only the looking ones, and in
`full-ask` every call is asked for with what the user needs to judge it: the arguments, the
URL it goes to (or the page it acts on), the tab, and the element a reference names.

A screenshot goes to the user, not to the model: the PNG is stored in the session's files (a
delivery: the agent hands it to the user),
the result tells the model only that it was taken and its file id, and the turn emits a
`browser.screenshot` event naming the file for a console or client to show.

When the user takes the browser over (`POST /v1/sessions/{id}/browser/takeover`), the call
under way is cancelled and the result says so with `data["takeover"]`, on which the turn
loop stops the turn's remaining tool calls.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from agentbox.machines.base import Browsing, Machine
from agentbox.workspace.browser import (
    ACTION_TIMEOUT_SECONDS,
    ACTIONS,
    MAX_TIMEOUT_SECONDS,
    NAVIGATION_TIMEOUT_SECONDS,
    Browser,
    BrowserArgs,
    BrowserReply,
)
from agentbox.workspace.errors import WorkspaceError

from .base import Action, Tool, ToolConfig, ToolContext, ToolParams, ToolResult

ActionName = Literal[
    "browser.get_state", "page.text.snapshot", "page.elements.snapshot", "page.wait_for",
    "page.navigate", "page.back", "page.forward", "page.reload", "page.click", "page.fill",
    "page.type", "page.press", "page.select", "page.hover", "page.scroll", "page.screenshot",
    "tabs.list", "tabs.new", "tabs.switch", "tabs.close", "page.dialog.accept", "page.dialog.dismiss",
]  # fmt: skip

DESCRIPTION = (
    "Drive a Chromium browser that runs inside your machine: it reaches what the machine reaches "
    "(servers you started there on 127.0.0.1, and the network if the machine has it), http and https "
    "URLs only. Pick `action`:\n"
    "- look: browser.get_state (tabs, URLs, titles, pending dialogs), page.text.snapshot (the page's "
    "text), page.elements.snapshot (the page's elements, each with a [ref=eN] to act on), page.wait_for "
    "(`text` to appear, or `state`: hidden to disappear; or `url`);\n"
    "- act: page.navigate (`url`), page.back, page.forward, page.reload, page.click / page.hover (`ref`), "
    "page.fill (`ref`, `text`: replaces the field's value), page.type (`text`, into `ref` or the focused "
    "element), page.press (`key` such as Enter, Tab, ArrowDown, Control+A; on `ref` or the page), "
    "page.select (`ref`, `value`), page.scroll (`direction`, `amount` px; or `ref` into view), "
    "page.screenshot (shown to the user, not to you), tabs.list, tabs.new (`url` optional), "
    "tabs.switch / tabs.close (`tab`), page.dialog.accept (`text` answers a prompt), page.dialog.dismiss.\n"
    "References come from the latest page.elements.snapshot: take a new one after the page changes. "
    "While a page dialog (alert, confirm, prompt) is open, only browser.get_state and the dialog actions "
    f"work. Actions time out after {ACTION_TIMEOUT_SECONDS:g} s, navigations after "
    f"{NAVIGATION_TIMEOUT_SECONDS:g} s (`timeout` changes it, at most {MAX_TIMEOUT_SECONDS:g})."
)


class BrowserParams(ToolParams):
    action: ActionName = Field(description="What to do (see the tool's description).")
    url: str | None = Field(default=None, description="An http:// or https:// URL (page.navigate, tabs.new).")
    ref: str | None = Field(
        default=None, description="An element's reference from page.elements.snapshot, like e12."
    )
    text: str | None = Field(
        default=None, description="Text to fill, type, wait for, or answer a prompt with."
    )
    key: str | None = Field(
        default=None, description="A key for page.press: Enter, Tab, ArrowDown, Control+A, ..."
    )
    value: str | list[str] | None = Field(
        default=None, description="The option(s) page.select picks, by value or label."
    )
    tab: int | None = Field(default=None, description="A tab id from tabs.list (default: the current tab).")
    direction: Literal["up", "down", "left", "right"] = Field(
        default="down", description="page.scroll's direction."
    )
    amount: int | None = Field(default=None, description="Pixels page.scroll moves (default 600).")
    full_page: bool = Field(
        default=False, description="page.screenshot: the whole page, not only the window."
    )
    state: Literal["visible", "hidden"] = Field(
        default="visible", description="page.wait_for: appear or disappear."
    )
    timeout: float | None = Field(default=None, description="Seconds this action may take.")  # fmt: skip


def has_browser(machine: Machine | None, config: ToolConfig | None = None) -> bool:
    """Whether the tool is offered on `machine`: its entry enabled the browser."""
    return isinstance(machine, Browsing) and machine.browser_driver() is not None


def action_of(action: str) -> Action:
    """The permission action of a browser action: reads look, everything else acts."""
    return Action.BROWSER_READ if ACTIONS[action].kind == "read" else Action.BROWSER_WRITE


def browser_args(params: BrowserParams) -> BrowserArgs:
    return BrowserArgs(
        url=params.url, ref=params.ref, text=params.text, key=params.key, value=params.value,
        tab=params.tab, direction=params.direction, amount=params.amount, full_page=params.full_page,
        state=params.state, timeout=params.timeout,
    )  # fmt: skip


async def approval_detail(browser: Browser, params: BrowserParams) -> dict[str, Any]:
    """What the user sees when asked: the input, the target URL, the tab, the element."""
    arguments = params.model_dump(exclude_defaults=True)
    tab = browser.tabs.get(params.tab if params.tab is not None else browser.current or -1)
    detail: dict[str, Any] = {"arguments": arguments, "action": params.action}
    if tab is not None:
        detail["tab"] = tab.id
        detail["page"] = tab.page.url
    if params.url:
        detail["url"] = params.url
    elif tab is not None:
        detail["url"] = tab.page.url
    if params.ref and tab is not None and browser.running:
        try:
            detail["element"] = await browser.describe(tab, params.ref)
        except WorkspaceError:
            detail["element"] = f"{params.ref} (not on the page)"
    return detail


async def run_browser(ctx: ToolContext, params: BrowserParams) -> ToolResult:
    if ctx.services is None or not has_browser(ctx.machine):
        return ToolResult.error("This machine has no browser (its entry does not set `browser = true`).")
    browser = ctx.services.browser()
    refusal = await ctx.authorize(action_of(params.action), "browser", await approval_detail(browser, params))
    if refusal is not None:
        return ToolResult.error(refusal)
    try:
        reply = await browser.act(params.action, browser_args(params))
    except WorkspaceError as exc:
        if browser.taken_over:
            return ToolResult.error(exc.message, takeover=True)
        return ToolResult.error(exc.message)
    if reply.png is None:
        return ToolResult.text(reply.text, browser=reply.data)
    return await deliver_screenshot(ctx, params, reply)


async def deliver_screenshot(ctx: ToolContext, params: BrowserParams, reply: BrowserReply) -> ToolResult:
    """Store the PNG in the session's files and tell the model only that it is there."""
    assert reply.png is not None
    if ctx.files is None:
        return ToolResult.text(f"{reply.text}; not kept: this session has no file store", browser=reply.data)
    name = f"screenshot-tab{reply.data.get('tab', 0)}.png"
    record = await ctx.files.put_stream(
        chunks(reply.png), name, session_id=ctx.session_id, source="delivery",
        turn_id=ctx.turn_id, tool_use_id=ctx.tool_use_id,
    )  # fmt: skip
    screenshot = {"file_id": record["id"], "filename": record["filename"], "bytes": record["bytes"],
                  "tool_use_id": ctx.tool_use_id,
                  "tab": reply.data.get("tab"), "url": reply.data.get("url")}  # fmt: skip
    return ToolResult.text(
        f"Took a {'full-page ' if params.full_page else ''}screenshot of {reply.data.get('url')}: file "
        f"{record['id']} ({record['bytes']} bytes). The user sees it; you do not: read the page with "
        "page.text.snapshot or page.elements.snapshot.",
        browser=reply.data, screenshot=screenshot,
    )  # fmt: skip


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    stream = io.BytesIO(data)
    while chunk := stream.read(1 << 20):
        yield chunk


ReadActionName = Literal[
    "browser.get_state", "page.text.snapshot", "page.elements.snapshot", "page.wait_for", "tabs.list"
]


class BrowserReadParams(BrowserParams):
    action: ReadActionName = Field(description="What to look at: the browser's state, the page's text or elements, or wait.")  # type: ignore[assignment]  # fmt: skip


READ_DESCRIPTION = (
    "Look at the pages of the Chromium that runs inside your machine, without changing them: "
    "browser.get_state (tabs, URLs, titles, pending dialogs), page.text.snapshot (the current tab's text, "
    "or `tab`'s), page.elements.snapshot (its elements with references), page.wait_for (`text` to appear, "
    "or `state`: hidden), tabs.list."
)
BROWSER = Tool(
    "browser", DESCRIPTION, BrowserParams, Action.BROWSER_READ, run_browser,
    read_only=False, gates_itself=True, available=has_browser,
)  # fmt: skip
#: The looking half, for agents that change nothing (the `researcher` subagent): a child whose
#: parent has `browser` gets this in its place, under the parent's name for it (`narrows`).
BROWSER_READS = Tool(
    "browser_read", READ_DESCRIPTION, BrowserReadParams, Action.BROWSER_READ, run_browser,
    gates_itself=True, available=has_browser, narrows="browser",
)  # fmt: skip
TOOLS = {"browser": BROWSER, "browser_read": BROWSER_READS}
