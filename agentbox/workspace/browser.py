"""A Chromium per machine, inside it, and the actions a model or an API caller takes on it.

The browser of a machine starts on its first action: Playwright's driver runs as a command
of the machine (`browser_driver.start`) and launches the machine's own Chromium, so the
browser sees what the sandbox sees (its files, its loopback, its network policy, never the
host's loopback) and lives in its cgroup. It stops when the machine stops, when the services
close, or after `BROWSER_IDLE_SECONDS` without an action (a running Chromium would otherwise
keep the sandbox from ever being idle).

Actions are seed 001's names (`ACTIONS`); each is a read (`browser.get_state`, the snapshots,
`page.wait_for`, `tabs.list`) or a write (everything that changes a page). Elements are
named by the references of the last `page.elements.snapshot` (Playwright's `aria-ref`s: the
same page in the same state gives the same references). Tabs have ids that stay the same
while they are open.

A page dialog (alert, confirm, prompt, beforeunload) stops the page's scripts until it is
handled, so while one is open every action but `browser.get_state`, `tabs.list` and
`page.dialog.accept` / `page.dialog.dismiss` is refused (`conflict`, naming the dialog). An
action during which a dialog opens returns at once, saying so; what it was doing finishes
when the dialog is handled.

URLs are http and https only. Every action has a time limit; a page that never loads is a
`timeout`, a browser that crashed a `browser_unavailable` (the next action starts a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from agentbox.machines.base import Browsing, ExecRequest, Machine
from agentbox.machines.errors import MachineError
from agentbox.workspace import browser_driver
from agentbox.workspace.errors import WorkspaceError

#: Where a machine's Chromium is looked for, in this order (Debian's `chromium` package first).
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-headless-shell", "/usr/lib/chromium/chromium")
#: The port Chromium's DevTools listen on inside the machine (its own network namespace, so
#: every sandbox has its own); agentbox's CDP endpoint reaches it through the machine.
CDP_PORT = 9222
#: Seconds the driver and Chromium get to start.
LAUNCH_TIMEOUT_SECONDS = 30.0
#: Seconds an action on a page element (click, fill, ...) may take by default.
ACTION_TIMEOUT_SECONDS = 10.0
#: Seconds a navigation (navigate, back, forward, reload, tabs.new with a URL) may take by default.
NAVIGATION_TIMEOUT_SECONDS = 30.0
#: Most seconds a caller may give any action (`timeout`).
MAX_TIMEOUT_SECONDS = 120.0
#: Seconds beyond an action's own limit before the server stops waiting on the driver itself.
DRIVER_GRACE_SECONDS = 5.0
#: Seconds without an action after which the browser is stopped (the next action starts it again).
BROWSER_IDLE_SECONDS = 600.0
#: Tabs open at once; a page's popups past it are closed as they open.
MAX_TABS = 20
#: Characters of a page's text or element snapshot returned at most (the rest is cut, and said so).
MAX_SNAPSHOT_CHARS = 100_000
#: Bytes of one screenshot at most (a full-page shot of a very long page can exceed it).
MAX_SCREENSHOT_BYTES = 16 * 1024 * 1024
#: How Playwright's errors name a failure of the network (Chromium then shows its error page).
NETWORK_ERROR = "net::ERR_"
#: Pixels one `page.scroll` moves when the caller names no amount.
DEFAULT_SCROLL_PIXELS = 600
#: The window pages are laid out in.
VIEWPORT = {"width": 1280, "height": 800}
#: Characters of a URL, a typed text or a key accepted.
MAX_URL_CHARS = 8192
MAX_TEXT_CHARS = 100_000
#: A reference from `page.elements.snapshot` (`e12`, or `f1e3` inside a frame).
REF_RULE = re.compile(r"^[a-z0-9]{1,32}$")
ALLOWED_SCHEMES = ("http", "https")
#: Chromium's flags inside a sandbox: the sandbox is the boundary (no setuid or namespace
#: sandbox of Chromium's own nests in it), /dev/shm is small, nothing phones home.
CHROMIUM_ARGS = (
    f"--remote-debugging-port={CDP_PORT}",
    "--remote-debugging-address=127.0.0.1",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--metrics-recording-only",
)

Kind = Literal["read", "write", "dialog"]


@dataclass(frozen=True)
class BrowserArgs:
    """An action's arguments, named as the seed names them."""

    url: str | None = None
    ref: str | None = None
    text: str | None = None
    key: str | None = None
    value: str | list[str] | None = None
    tab: int | None = None
    direction: Literal["up", "down", "left", "right"] = "down"
    amount: int | None = None
    full_page: bool = False
    state: Literal["visible", "hidden"] = "visible"
    timeout: float | None = None


@dataclass
class BrowserReply:
    """What an action gives back: text for a model, data for an API, a PNG for a screenshot."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)
    png: bytes | None = None


@dataclass
class Tab:
    id: int
    page: Any  # playwright.async_api.Page
    dialog: Any = None  # the pending playwright Dialog
    dialog_opened: asyncio.Event = field(default_factory=asyncio.Event)

    def dialog_info(self) -> dict[str, Any] | None:
        if self.dialog is None:
            return None
        return {"tab": self.id, "type": self.dialog.type, "message": self.dialog.message,
                "default_value": self.dialog.default_value}  # fmt: skip


def error(error_type: str, message: str, **extra: Any) -> WorkspaceError:
    return WorkspaceError(error_type, message, "browser", exception_type="BrowserError", **extra)


def check_url(url: str | None) -> str:
    """`url` if it is an http or https URL; a `bad_request` naming the rule otherwise."""
    if not url:
        raise error("bad_request", "this action needs a `url`")
    if len(url) > MAX_URL_CHARS:
        raise error("bad_request", f"the URL is {len(url)} characters long: at most {MAX_URL_CHARS}")
    scheme = urlsplit(url.strip()).scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        shown = f"{scheme}:" if scheme else "a URL without a scheme"
        raise error("bad_request", f"the browser opens http and https URLs only, not {shown} ({url[:100]})")
    return url.strip()


def clamp_timeout(timeout: float | None, default: float) -> float:
    if timeout is None:
        return default
    if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise error("bad_request", f"timeout must be more than 0 and at most {MAX_TIMEOUT_SECONDS:g} seconds")
    return float(timeout)


def cut(text: str, limit: int = MAX_SNAPSHOT_CHARS) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n[... {len(text) - limit} more characters not shown]", True


#: An action: the browser, the tab it acts on (None for the tab actions when no tab is open), its args.
Run = Callable[["Browser", Any, BrowserArgs], Awaitable[BrowserReply]]


@dataclass(frozen=True)
class ActionSpec:
    kind: Kind
    run: Run
    navigates: bool = False


class Browser:
    """The browser of one machine: started on first use, one action at a time."""

    def __init__(self, machine: Machine, idle_seconds: float = BROWSER_IDLE_SECONDS) -> None:
        self.machine = machine
        self.idle_seconds = idle_seconds
        self.tabs: dict[int, Tab] = {}
        self.current: int | None = None
        self.taken_over = False
        self.last_used = time.monotonic()
        self.started_at: float | None = None
        self._driver: browser_driver.Driver | None = None
        self._browser: Any = None
        self._context: Any = None
        self._next_tab = 1
        self._renewing: Tab | None = None
        self._starting = asyncio.Lock()
        self._acting = asyncio.Lock()
        self._running: set[asyncio.Task[Any]] = set()
        self._chores: set[asyncio.Future[Any]] = set()
        self._idle: asyncio.Task[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return (
            self._driver is not None
            and self._driver.alive
            and self._browser is not None
            and self._browser.is_connected()
        )

    async def ensure(self) -> None:
        """Start the driver and Chromium if they are not running."""
        async with self._starting:
            if self.running:
                return
            died = self._browser is not None  # every stop of ours forgets it first (`_reset`)
            await self._reset()
            if died:  # a fresh browser would answer with a blank page as if it were the old one
                raise error("browser_unavailable", "the browser stopped (it crashed or was killed) and its tabs "
                            "are gone; the next action starts a new one", retryable=True)  # fmt: skip
            if self._closed:
                raise error("browser_unavailable", "the browser of this machine was closed")
            argv = self.machine.browser_driver() if isinstance(self.machine, Browsing) else None
            if argv is None:
                raise error("browser_unavailable", f"machine {self.machine.name!r} has no browser: "
                            "only sandbox machines with `browser = true` in their entry have one")  # fmt: skip
            try:
                chromium = await self._find_chromium()
                self._driver = await asyncio.wait_for(
                    browser_driver.start(self.machine, argv, driver_env()), LAUNCH_TIMEOUT_SECONDS
                )
                assert self._driver.playwright is not None
                self._browser = await self._driver.playwright.chromium.launch(
                    executable_path=chromium, chromium_sandbox=False, args=list(CHROMIUM_ARGS),
                    timeout=LAUNCH_TIMEOUT_SECONDS * 1000, handle_sigint=False, handle_sigterm=False,
                    handle_sighup=False,
                )  # fmt: skip
                self._context = await self._browser.new_context(viewport=VIEWPORT, accept_downloads=False)
                self._context.on("page", self._adopt)
                page = await self._context.new_page()
                self.current = self._adopt(page).id
            except WorkspaceError:
                await self._reset()
                raise
            except (MachineError, browser_driver.DriverGone, TimeoutError) as exc:
                detail = self._driver.stderr_tail.decode(errors="replace")[-500:] if self._driver else ""
                await self._reset()
                raise error("browser_unavailable", f"the browser did not start: {exc or 'timed out'} {detail}".strip(),
                            retryable=True) from None  # fmt: skip
            except Exception as exc:  # playwright's own errors: a launch that failed
                await self._reset()
                raise error("browser_unavailable", f"the browser did not start: {first_line(exc)}",
                            retryable=True) from None  # fmt: skip
            self.started_at = time.monotonic()
            if self._idle is None or self._idle.done():
                self._idle = asyncio.ensure_future(self._stop_when_idle())

    async def _find_chromium(self) -> str:
        test = " || ".join(f"{{ test -x {p} && echo {p}; }}" for p in CHROMIUM_PATHS)
        result = await self.machine.exec(ExecRequest(command=test, timeout=10))
        found = result.stdout.decode().strip().splitlines()
        if not found:
            raise error("browser_unavailable", f"no Chromium on machine {self.machine.name!r} (looked for "
                        f"{', '.join(CHROMIUM_PATHS)}): run it on an image with Chromium, such as the "
                        "`data` profile, or build one with `--include chromium`")  # fmt: skip
        return found[0]

    def _adopt(self, page: Any) -> Tab:
        for tab in self.tabs.values():
            if tab.page is page:
                return tab
        if self._renewing is not None:  # the fresh page of a tab being renewed, not a new tab
            return self._renewing
        tab = Tab(self._next_tab, page)
        self._next_tab += 1
        if len(self.tabs) >= MAX_TABS:
            self._background(page.close())
            return tab
        self.tabs[tab.id] = tab
        self._watch(tab, page)
        return tab

    def _watch(self, tab: Tab, page: Any) -> None:
        """Follow `page`'s dialogs and its closing, for as long as it is `tab`'s page."""

        def on_dialog(dialog: Any) -> None:
            if tab.page is page:
                tab.dialog = dialog
                tab.dialog_opened.set()

        def on_close(_: Any) -> None:
            if tab.page is page and self.tabs.get(tab.id) is tab:
                del self.tabs[tab.id]
                if self.current == tab.id:
                    self.current = max(self.tabs) if self.tabs else None

        page.on("dialog", on_dialog)
        page.on("close", on_close)

    async def renew(self, tab: Tab) -> None:
        """Give `tab` a fresh page in place of one that showed Chromium's error page.

        After a failed navigation, this Playwright and Chromium lose track of the page's later
        navigations (each one reads as interrupted, history steps fail as detached), so the
        tab keeps its id and starts again blank; its history is lost."""
        old = tab.page
        self._renewing = tab
        try:
            page = await self._context.new_page()
        finally:
            self._renewing = None
        tab.page, tab.dialog = page, None
        self._watch(tab, page)
        self._background(old.close())

    async def _stop_when_idle(self) -> None:
        while not self._closed:
            await asyncio.sleep(max(1.0, min(self.idle_seconds, 30.0)))
            if (
                self.running
                and not self._acting.locked()
                and time.monotonic() - self.last_used > self.idle_seconds
            ):
                async with self._starting:
                    await self._reset()
                return

    async def _reset(self) -> None:
        """Forget the browser and take its driver down (the driver takes Chromium with it)."""
        driver, self._driver, self._browser, self._context = self._driver, None, None, None
        self.tabs.clear()
        self.current = None
        if driver is not None:
            await driver.close()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._running):
            task.cancel()
        if self._idle is not None:
            self._idle.cancel()
        async with self._starting:
            await self._reset()

    # ---------------------------------------------------------------- takeover

    async def take_over(self) -> int:
        """The user drives now: cancel what is running and refuse actions until `release`.
        Returns how many actions were cancelled."""
        self.taken_over = True
        running = [t for t in self._running if not t.done()]
        for task in running:
            task.cancel()
        return len(running)

    def release(self) -> None:
        self.taken_over = False

    # ---------------------------------------------------------------- actions

    def state(self) -> dict[str, Any]:
        """Tabs (id, URL, title is filled by `get_state`), the current tab, pending dialogs."""
        return {
            "running": self.running,
            "current_tab": self.current,
            "tabs": [
                {"tab": t.id, "url": t.page.url, "active": t.id == self.current} for t in self.tabs.values()
            ],
            "dialogs": [d for t in self.tabs.values() if (d := t.dialog_info())],
            "taken_over": self.taken_over,
        }

    async def act(self, action: str, args: BrowserArgs) -> BrowserReply:
        """Run one action; a `WorkspaceError` for anything the caller can act on."""
        spec = ACTIONS.get(action)
        if spec is None:
            raise error("bad_request", f"unknown browser action {action!r}: one of {', '.join(ACTIONS)}")
        return await self.perform(action, spec, args)

    async def perform(self, action: str, spec: ActionSpec, args: BrowserArgs) -> BrowserReply:
        """Run `spec` under every rule an action of `ACTIONS` runs under (one at a time, the
        dialog and takeover checks, its time limit): how a caller runs an operation of its own
        (AIO's selector-based routes) on the current tab."""
        if self.taken_over:
            raise error(
                "conflict", "the user has taken over the browser: no action runs until they hand it back"
            )
        task = asyncio.ensure_future(self._act(action, spec, args))
        self._running.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if self.taken_over and not _cancelling():
                raise error("conflict", f"{action} was cancelled: the user took over the browser") from None
            raise
        finally:
            self._running.discard(task)
            self.last_used = time.monotonic()

    async def _act(self, action: str, spec: ActionSpec, args: BrowserArgs) -> BrowserReply:
        if action in STATE_ACTIONS:  # never starts the browser
            return await spec.run(self, self._tab(None), args)
        if spec.kind == "dialog":
            return await spec.run(self, self._tab(args.tab) if args.tab is not None else None, args)
        await self.ensure()
        tab = self._tab(None if action in TAB_ACTIONS else args.tab)
        pending = next((t for t in self.tabs.values() if t.dialog is not None), None)
        if pending is not None:
            d = pending.dialog
            raise error("conflict", f"{article(d.type)} dialog is open on tab {pending.id} ({d.message[:200]!r}): "
                        "handle it with page.dialog.accept or page.dialog.dismiss first")  # fmt: skip
        if tab is None and action not in TAB_ACTIONS:  # every tab was closed: a page action opens one
            tab = await self.new_tab(None, NAVIGATION_TIMEOUT_SECONDS)
        limit = clamp_timeout(
            args.timeout, NAVIGATION_TIMEOUT_SECONDS if spec.navigates else ACTION_TIMEOUT_SECONDS
        )
        async with self._acting:
            signal = tab.dialog_opened if tab is not None else asyncio.Event()  # tab actions: no page
            signal.clear()
            work = asyncio.ensure_future(spec.run(self, tab, args))
            opened = asyncio.ensure_future(signal.wait())
            try:
                done, _ = await asyncio.wait({work, opened}, timeout=limit + DRIVER_GRACE_SECONDS,
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            except asyncio.CancelledError:
                work.cancel()
                raise
            finally:
                opened.cancel()
            if work in done:
                return self._result(work, action, limit)
            if tab is not None and tab.dialog is not None:
                work.add_done_callback(_ignore)  # finishes once the dialog is handled
                info = tab.dialog_info() or {}
                return BrowserReply(
                    f"{action} opened {article(info.get('type', ''))} dialog on tab {tab.id}: {info.get('message')!r}. "
                    "Handle it with page.dialog.accept (with `text` for a prompt) or page.dialog.dismiss.",
                    {"dialog": info},
                )
            work.cancel()
            await self._reset()
            raise error("browser_unavailable", f"the browser did not answer {action} within {limit:g} s and was "
                        "stopped; the next action starts a new one", retryable=True)  # fmt: skip

    def _result(self, work: asyncio.Future[BrowserReply], action: str, limit: float) -> BrowserReply:
        exc = work.exception()
        if exc is None:
            return work.result()
        if isinstance(exc, WorkspaceError):
            raise exc
        name = type(exc).__name__
        if name == "TimeoutError":
            raise error("timeout", f"{action} did not finish within {limit:g} s: {first_line(exc)}")
        if not self.running or name == "TargetClosedError":
            self._background(self._reset_quietly())
            raise error("browser_unavailable", f"the browser stopped during {action} ({first_line(exc)}); "
                        "the next action starts a new one", retryable=True)  # fmt: skip
        raise error("bad_request", f"{action} failed: {first_line(exc)}")

    def _background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)
        task.add_done_callback(_ignore)

    async def _reset_quietly(self) -> None:
        async with self._starting:
            if not self.running:
                await self._reset()

    def _tab(self, tab_id: int | None) -> Tab | None:
        if tab_id is not None:
            tab = self.tabs.get(tab_id)
            if tab is None:
                raise error(
                    "not_found", f"there is no tab {tab_id}: open tabs are {sorted(self.tabs) or 'none'}"
                )
            return tab
        return self.tabs.get(self.current) if self.current is not None else None

    async def element(self, tab: Tab, ref: str | None) -> Any:
        """The locator of a snapshot reference, checked to be on the page now."""
        if not ref:
            raise error("bad_request", "this action needs `ref`, a reference from page.elements.snapshot")
        ref = ref.removeprefix("ref=").strip("[]")
        if not REF_RULE.match(ref):
            raise error(
                "bad_request", f"{ref[:40]!r} is not a reference from page.elements.snapshot (like e12)"
            )
        locator = tab.page.locator(f"aria-ref={ref}")
        try:
            count = await locator.count()
        except Exception:
            count = 0
        if count == 0:
            raise error(
                "not_found", f"element {ref} is not on the page any more: take a new page.elements.snapshot"
            )
        return locator

    async def describe(self, tab: Tab, ref: str) -> str:
        """A short description of the element a reference names, for approvals: `button "Send"`."""
        locator = await self.element(tab, ref)
        try:
            return str(await locator.evaluate(DESCRIBE_ELEMENT, timeout=2000))
        except Exception:
            return ref

    async def new_tab(self, url: str | None, timeout: float) -> Tab:
        if len(self.tabs) >= MAX_TABS:
            raise error("bad_request", f"{MAX_TABS} tabs are open, the most there may be: close one first")
        page = await self._context.new_page()
        tab = self._adopt(page)
        self.current = tab.id
        if url:
            await goto(self, tab, url, timeout * 1000)
        return tab


DESCRIBE_ELEMENT = """el => {
  const tag = el.tagName.toLowerCase();
  const role = el.getAttribute('role') || (tag === 'a' ? 'link' : tag === 'input' ? (el.type || 'text') + ' input' : tag);
  const name = el.getAttribute('aria-label') || el.getAttribute('name') || el.getAttribute('placeholder')
    || (el.innerText || el.value || '').trim().slice(0, 80);
  return name ? `${role} "${name}"` : role;
}"""


def driver_env() -> dict[str, str]:
    """What Playwright's driver needs to know of its client; nothing of the server's environment."""
    import sys

    from playwright._repo_version import version

    return {
        "PW_LANG_NAME": "python",
        "PW_LANG_NAME_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}",
        "PW_CLI_DISPLAY_VERSION": version,
    }


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__


def _ignore(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -------------------------------------------------------------------- the actions


def ms(args: BrowserArgs, default: float) -> float:
    return clamp_timeout(args.timeout, default) * 1000


async def where(tab: Tab) -> dict[str, Any]:
    title = ""
    with contextlib.suppress(Exception):
        title = await tab.page.title()
    return {"tab": tab.id, "url": tab.page.url, "title": title}


def where_text(info: dict[str, Any]) -> str:
    return f"tab {info['tab']}: {info['title'] or '(no title)'} - {info['url']}"


async def get_state(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
    state = b.state()
    tabs = []
    for t in list(b.tabs.values()):
        info = await where(t)
        tabs.append({**info, "active": t.id == b.current})
    state["tabs"] = tabs
    lines = [f"{'*' if t['active'] else ' '} {where_text(t)}" for t in tabs] or [
        "no tabs open (the browser starts on the next page action)"
    ]
    lines += [f"pending {d['type']} dialog on tab {d['tab']}: {d['message']!r}" for d in state["dialogs"]]
    if b.taken_over:
        lines.append("the user has taken over the browser")
    return BrowserReply("\n".join(lines), state)


async def text_snapshot(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    text = await tab.page.evaluate("() => document.body ? document.body.innerText : ''")
    shown, truncated = cut(str(text))
    info = await where(tab)
    return BrowserReply(f"{where_text(info)}\n\n{shown}", {**info, "text": shown, "truncated": truncated})


async def elements_snapshot(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    snapshot = await tab.page.aria_snapshot(mode="ai", timeout=ms(args, ACTION_TIMEOUT_SECONDS))
    shown, truncated = cut(str(snapshot))
    info = await where(tab)
    return BrowserReply(f"{where_text(info)}\n\n{shown}", {**info, "snapshot": shown, "truncated": truncated})


async def wait_for(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    timeout = ms(args, ACTION_TIMEOUT_SECONDS)
    if args.text:
        await tab.page.get_by_text(args.text).first.wait_for(state=args.state, timeout=timeout)
        what = f"text {args.text!r} is {args.state}"
    elif args.url:
        await tab.page.wait_for_url(args.url, timeout=timeout)
        what = f"the page is at {args.url}"
    else:
        await tab.page.wait_for_load_state("load", timeout=timeout)
        what = "the page has loaded"
    info = await where(tab)
    return BrowserReply(f"{what}; {where_text(info)}", info)


async def navigate(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    url = check_url(args.url)
    response = await goto(b, tab, url, ms(args, NAVIGATION_TIMEOUT_SECONDS))
    info = await where(tab)
    status = response.status if response is not None else None
    return BrowserReply(f"navigated to {where_text(info)} (status {status})", {**info, "status": status})


async def goto(b: Browser, tab: Tab, url: str, timeout_ms: float) -> Any:
    """`page.goto` on `tab`; a navigation that fails on the network leaves the tab on a fresh
    blank page (`Browser.renew`) and raises."""
    try:
        return await tab.page.goto(url, timeout=timeout_ms)
    except Exception as exc:
        if NETWORK_ERROR not in str(exc):
            raise
        await b.renew(tab)
        raise error("bad_request", f"{first_line(exc)} (the tab is on a blank page now)") from None


def history(step: str) -> Run:
    async def run(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
        page = tab.page
        timeout = ms(args, NAVIGATION_TIMEOUT_SECONDS)
        method = {"back": page.go_back, "forward": page.go_forward, "reload": page.reload}[step]
        response = await method(timeout=timeout)
        info = await where(tab)
        if response is None and step != "reload":
            return BrowserReply(f"no page to go {step} to; {where_text(info)}", info)
        return BrowserReply(f"{step}: {where_text(info)}", info)

    return run


def on_element(verb: str, needs: str | None = None) -> Run:
    async def run(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
        locator = await b.element(tab, args.ref)
        timeout = ms(args, ACTION_TIMEOUT_SECONDS)
        if verb == "click":
            await locator.click(timeout=timeout)
        elif verb == "hover":
            await locator.hover(timeout=timeout)
        elif verb == "fill":
            await locator.fill(text_arg(args), timeout=timeout)
        elif verb == "select":
            if args.value is None:
                raise error(
                    "bad_request", "page.select needs `value`: an option's value or label (or a list)"
                )
            chosen = await locator.select_option(args.value, timeout=timeout)
            info = await where(tab)
            return BrowserReply(
                f"selected {chosen} in {args.ref}; {where_text(info)}", {**info, "selected": chosen}
            )
        info = await where(tab)
        return BrowserReply(f"{verb} {args.ref} done; {where_text(info)}", info)

    return run


def text_arg(args: BrowserArgs) -> str:
    if args.text is None:
        raise error("bad_request", "this action needs `text`")
    if len(args.text) > MAX_TEXT_CHARS:
        raise error("bad_request", f"`text` is {len(args.text)} characters: at most {MAX_TEXT_CHARS}")
    return args.text


async def type_text(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    text = text_arg(args)
    if args.ref:
        await (await b.element(tab, args.ref)).press_sequentially(
            text, timeout=ms(args, ACTION_TIMEOUT_SECONDS)
        )
    else:
        await tab.page.keyboard.type(text)
    info = await where(tab)
    return BrowserReply(f"typed {len(text)} characters; {where_text(info)}", info)


async def press(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    if not args.key or len(args.key) > 64:
        raise error("bad_request", "page.press needs `key`, such as Enter, Tab, ArrowDown or Control+A")
    try:
        if args.ref:
            await (await b.element(tab, args.ref)).press(args.key, timeout=ms(args, ACTION_TIMEOUT_SECONDS))
        else:
            await tab.page.keyboard.press(args.key)
    except Exception as exc:
        if "Unknown key" in str(exc):
            raise error("bad_request", f"unknown key {args.key!r}: {first_line(exc)}") from None
        raise
    info = await where(tab)
    return BrowserReply(f"pressed {args.key}; {where_text(info)}", info)


async def scroll(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    if args.ref:
        await (await b.element(tab, args.ref)).scroll_into_view_if_needed(
            timeout=ms(args, ACTION_TIMEOUT_SECONDS)
        )
        what = f"scrolled {args.ref} into view"
    else:
        amount = args.amount if args.amount is not None else DEFAULT_SCROLL_PIXELS
        if not 0 < amount <= 100_000:
            raise error("bad_request", "amount must be 1 to 100000 pixels")
        dx, dy = {"up": (0, -amount), "down": (0, amount), "left": (-amount, 0), "right": (amount, 0)}[
            args.direction
        ]
        await tab.page.mouse.wheel(dx, dy)
        what = f"scrolled {args.direction} {amount} px"
    position = await tab.page.evaluate("() => [window.scrollX, window.scrollY]")
    info = await where(tab)
    return BrowserReply(f"{what} (now at x={position[0]}, y={position[1]}); {where_text(info)}",
                        {**info, "scroll": {"x": position[0], "y": position[1]}})  # fmt: skip


async def screenshot(b: Browser, tab: Tab, args: BrowserArgs) -> BrowserReply:
    png = await tab.page.screenshot(
        type="png", full_page=args.full_page, timeout=ms(args, ACTION_TIMEOUT_SECONDS)
    )
    if len(png) > MAX_SCREENSHOT_BYTES:
        raise error("bad_request", f"the screenshot is {len(png)} bytes, more than {MAX_SCREENSHOT_BYTES}: "
                    "take it without full_page")  # fmt: skip
    info = await where(tab)
    return BrowserReply(
        f"screenshot of {where_text(info)} ({len(png)} bytes PNG)", {**info, "bytes": len(png)}, png
    )


async def tabs_list(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
    return await get_state(b, tab, args)


async def tabs_new(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
    url = check_url(args.url) if args.url else None
    new = await b.new_tab(url, clamp_timeout(args.timeout, NAVIGATION_TIMEOUT_SECONDS))
    info = await where(new)
    return BrowserReply(f"opened {where_text(info)}", info)


async def tabs_switch(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
    if args.tab is None:
        raise error("bad_request", "tabs.switch needs `tab`, a tab id from tabs.list")
    target = b._tab(args.tab)
    assert target is not None
    await target.page.bring_to_front()
    b.current = target.id
    info = await where(target)
    return BrowserReply(f"switched to {where_text(info)}", info)


async def tabs_close(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
    target = b._tab(args.tab) if args.tab is not None else tab
    if target is None:
        raise error("not_found", "no tab is open")
    closing = target.id
    await target.page.close()
    b.tabs.pop(closing, None)
    if b.current == closing:
        b.current = max(b.tabs) if b.tabs else None
    rest = f"current tab {b.current}" if b.current is not None else "no tab is open now"
    return BrowserReply(f"closed tab {closing}; {rest}", {"closed": closing, "current_tab": b.current})


def dialog(accept: bool) -> Run:
    async def run(b: Browser, tab: Tab | None, args: BrowserArgs) -> BrowserReply:
        target = tab if tab is not None and tab.dialog is not None else None
        if args.tab is None and target is None:
            target = next((t for t in b.tabs.values() if t.dialog is not None), None)
        if target is None or target.dialog is None:
            raise error("not_found", "no dialog is open" + (f" on tab {args.tab}" if args.tab else ""))
        d, target.dialog = target.dialog, None
        if accept:
            await d.accept(args.text) if args.text is not None else await d.accept()
        else:
            await d.dismiss()
        verb = "accepted" if accept else "dismissed"
        with_text = f" with {args.text!r}" if accept and args.text is not None else ""
        return BrowserReply(f"{verb} the {d.type} dialog {d.message[:200]!r}{with_text} on tab {target.id}",
                            {"tab": target.id, "type": d.type, "message": d.message, "accepted": accept})  # fmt: skip

    return run


ACTIONS: dict[str, ActionSpec] = {
    "browser.get_state": ActionSpec("read", get_state),
    "page.text.snapshot": ActionSpec("read", text_snapshot),
    "page.elements.snapshot": ActionSpec("read", elements_snapshot),
    "page.wait_for": ActionSpec("read", wait_for),
    "page.navigate": ActionSpec("write", navigate, navigates=True),
    "page.back": ActionSpec("write", history("back"), navigates=True),
    "page.forward": ActionSpec("write", history("forward"), navigates=True),
    "page.reload": ActionSpec("write", history("reload"), navigates=True),
    "page.click": ActionSpec("write", on_element("click")),
    "page.fill": ActionSpec("write", on_element("fill")),
    "page.type": ActionSpec("write", type_text),
    "page.press": ActionSpec("write", press),
    "page.select": ActionSpec("write", on_element("select")),
    "page.hover": ActionSpec("write", on_element("hover")),
    "page.scroll": ActionSpec("write", scroll),
    "page.screenshot": ActionSpec("write", screenshot),
    "tabs.list": ActionSpec("read", tabs_list),
    "tabs.new": ActionSpec("write", tabs_new, navigates=True),
    "tabs.switch": ActionSpec("write", tabs_switch),
    "tabs.close": ActionSpec("write", tabs_close),
    "page.dialog.accept": ActionSpec("dialog", dialog(True)),
    "page.dialog.dismiss": ActionSpec("dialog", dialog(False)),
}
#: Actions that only report state: they never start the browser.
STATE_ACTIONS = frozenset({"browser.get_state", "tabs.list"})
#: Actions on the tabs themselves rather than on the current page.
TAB_ACTIONS = frozenset({"tabs.new", "tabs.switch", "tabs.close"})
#: What plan mode allows (seed 001): looking, never acting.
READ_ACTIONS = frozenset(name for name, spec in ACTIONS.items() if spec.kind == "read")


def article(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"
