"""The machine's browser (`agentbox.workspace.browser`): real Chromium inside a real sandbox on
the data image, driven over the exec channel, against pages served inside that sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from agentbox.machines.base import ExecRequest
from agentbox.machines.cgroups import Limits
from agentbox.machines.sandbox import SandboxConfig, SandboxMachine
from agentbox.workspace.browser import MAX_TABS, Browser, BrowserArgs
from agentbox.workspace.errors import WorkspaceError
from tests.conftest import built_image, image_sandbox_host, sandbox_factory, sandbox_host_pid, traversable

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: Memory for the sandbox: Chromium's processes share it.
BROWSER_MEMORY_BYTES = 2 * 1024**3
PORT = 8000
SITE = f"http://127.0.0.1:{PORT}"
#: A port inside the sandbox that accepts connections and never answers.
SILENT_PORT = 8001

PAGES = {
    "form.html": (
        "<title>Form</title><h1>Sign up</h1><form action='result.html'>"
        "<input name='name' aria-label='Name'><select name='color' aria-label='Color'>"
        "<option value='r'>Red</option><option value='b'>Blue</option></select>"
        "<button type='submit'>Send</button></form>"
    ),
    "result.html": (
        "<title>Result</title><p id='out'></p><script>const q = new URLSearchParams(location.search);"
        "document.getElementById('out').textContent = 'Hello ' + q.get('name') + ' in ' + q.get('color');</script>"
    ),
    "dialogs.html": (
        "<title>Dialogs</title><button onclick=\"alert('careful')\">Alert</button>"
        "<button onclick=\"document.getElementById('r').textContent = 'name=' + prompt('Your name?', 'x')\">Ask</button>"
        "<button onclick=\"document.getElementById('r').textContent = 'sure=' + confirm('Sure?')\">Confirm</button>"
        "<p id='r'>none</p>"
    ),
    "popup.html": "<title>Popups</title><script>for (let i = 0; i < 40; i++) window.open('form.html');</script>",
}
SILENT_SERVER = (
    "import socket,time\n"
    f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('127.0.0.1',{SILENT_PORT}));s.listen(8)\n"
    "conns=[]\nwhile True: conns.append(s.accept()[0])\n"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def box(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxMachine]:
    """A browser-enabled sandbox on the data image serving `PAGES` on 127.0.0.1 inside it."""
    host = image_sandbox_host(built_image("data", "data"), tmp_path_factory)
    make, made = sandbox_factory(host, traversable(tmp_path_factory.mktemp("browser-box"), tmp_path_factory))
    config = SandboxConfig(
        network=False, image="data", image_required=True, browser=True,
        limits=Limits(memory_bytes=BROWSER_MEMORY_BYTES),
    )  # fmt: skip
    try:
        m = await make(config)
        await m.mkdir("/workspace/site")
        for name, html in PAGES.items():
            await m.write(f"/workspace/site/{name}", html.encode())
        await m.write("/workspace/silent.py", SILENT_SERVER.encode())
        await m.spawn(
            ExecRequest(command=f"cd /workspace/site && exec python3 -m http.server {PORT} --bind 127.0.0.1")
        )
        await m.spawn(ExecRequest(command="exec python3 /workspace/silent.py"))
        await wait_for_port(m, PORT)
        yield m
    finally:
        for started in made:
            await started.stop()


async def wait_for_port(m: SandboxMachine, port: int) -> None:
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\""
    for _ in range(100):
        if (await m.exec(ExecRequest(command=probe, timeout=5))).exit_code == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"nothing listens on {port} in the sandbox")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(box: SandboxMachine) -> AsyncIterator[Browser]:
    b = Browser(box)
    yield b
    await b.close()


def ref_of(snapshot: str, element: str) -> str:
    """The reference the snapshot gives `element` (`textbox "Name"`)."""
    found = re.search(re.escape(element) + r"[^\n]*\[ref=(\w+)\]", snapshot)
    assert found, f"{element} is not in the snapshot:\n{snapshot}"
    return found.group(1)


async def act(b: Browser, action: str, **args: object) -> str:
    return (await b.act(action, BrowserArgs(**args))).text  # type: ignore[arg-type]


async def refused(b: Browser, action: str, **args: object) -> WorkspaceError:
    with pytest.raises(WorkspaceError) as caught:
        await b.act(action, BrowserArgs(**args))  # type: ignore[arg-type]
    return caught.value


async def test_a_form_filled_by_its_references_and_submitted(browser: Browser) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/form.html")
    snapshot = await act(browser, "page.elements.snapshot")
    assert snapshot == await act(browser, "page.elements.snapshot"), "same page, same references"
    await act(browser, "page.fill", ref=ref_of(snapshot, 'textbox "Name"'), text="Ada")
    assert "['b']" in await act(
        browser, "page.select", ref=ref_of(snapshot, 'combobox "Color"'), value="Blue"
    )
    await act(browser, "page.click", ref=ref_of(snapshot, 'button "Send"'))
    await act(browser, "page.wait_for", text="Hello Ada")
    text = await act(browser, "page.text.snapshot")
    assert "Hello Ada in b" in text and "Result" in text
    assert "Form - " in await act(browser, "page.back")
    assert "Result - " in await act(browser, "page.forward")


async def test_dialogs_block_other_actions_until_handled(browser: Browser) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/dialogs.html")
    snapshot = await act(browser, "page.elements.snapshot")
    said = await act(browser, "page.click", ref=ref_of(snapshot, 'button "Alert"'))
    assert "alert dialog" in said and "careful" in said
    blocked = await refused(browser, "page.text.snapshot")
    assert blocked.error_type == "conflict" and "careful" in blocked.message
    state = (await browser.act("browser.get_state", BrowserArgs())).data
    assert [(d["type"], d["message"]) for d in state["dialogs"]] == [("alert", "careful")]
    await act(browser, "page.dialog.accept")

    assert "prompt dialog" in await act(browser, "page.click", ref=ref_of(snapshot, 'button "Ask"'))
    assert "'Bob'" in await act(browser, "page.dialog.accept", text="Bob")
    await act(browser, "page.wait_for", text="name=Bob")
    await act(browser, "page.click", ref=ref_of(snapshot, 'button "Ask"'))
    await act(browser, "page.dialog.dismiss")
    await act(browser, "page.wait_for", text="name=null")
    await act(browser, "page.click", ref=ref_of(snapshot, 'button "Confirm"'))
    await act(browser, "page.dialog.dismiss")
    await act(browser, "page.wait_for", text="sure=false")
    assert (await refused(browser, "page.dialog.accept")).error_type == "not_found"


async def test_tabs_open_switch_and_close_with_stable_ids(browser: Browser) -> None:
    first = browser.current
    opened = await browser.act("tabs.new", BrowserArgs(url=f"{SITE}/form.html"))
    tab = opened.data["tab"]
    assert tab != first and browser.current == tab
    await act(browser, "tabs.switch", tab=first)
    listed = (await browser.act("tabs.list", BrowserArgs())).data["tabs"]
    assert {t["tab"]: t["active"] for t in listed} == {first: True, tab: False}
    assert [t["title"] for t in listed if t["tab"] == tab] == ["Form"]
    await act(browser, "tabs.close", tab=tab)
    assert (await refused(browser, "tabs.switch", tab=tab)).error_type == "not_found"
    assert browser.current == first


async def test_a_page_cannot_open_more_than_the_tab_limit(browser: Browser) -> None:
    await act(browser, "tabs.new", url=f"{SITE}/popup.html")
    await asyncio.sleep(1.0)
    assert len(browser.tabs) <= MAX_TABS
    for tab in [t for t in list(browser.tabs) if t != min(browser.tabs)]:
        await act(browser, "tabs.close", tab=tab)


async def test_screenshots_are_png(browser: Browser) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/form.html")
    shot = await browser.act("page.screenshot", BrowserArgs())
    assert shot.png is not None and shot.png.startswith(b"\x89PNG\r\n\x1a\n")
    assert shot.data["bytes"] == len(shot.png) and "PNG" in shot.text


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "javascript:alert(1)", "chrome://settings", "example.com"]
)
async def test_only_http_and_https_urls_open(browser: Browser, url: str) -> None:
    error = await refused(browser, "page.navigate", url=url)
    assert error.error_type == "bad_request" and "http and https" in error.message
    assert (await refused(browser, "tabs.new", url=url)).error_type == "bad_request"


async def test_a_reference_from_another_page_is_refused(browser: Browser) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/form.html")
    ref = ref_of(await act(browser, "page.elements.snapshot"), 'button "Send"')
    await act(browser, "page.navigate", url=f"{SITE}/dialogs.html")
    await act(browser, "page.elements.snapshot")
    stale = await refused(browser, "page.click", ref="e999")
    assert stale.error_type == "not_found" and "snapshot" in stale.message
    assert (await refused(browser, "page.click", ref="../x")).error_type == "bad_request"
    assert ref  # the old page's reference was real


async def test_a_page_that_never_answers_times_out(browser: Browser) -> None:
    error = await refused(browser, "page.navigate", url=f"http://127.0.0.1:{SILENT_PORT}/", timeout=2)
    assert error.error_type == "timeout" and "2 s" in error.message
    assert "Form" in await act(browser, "page.navigate", url=f"{SITE}/form.html"), "the browser still works"


async def test_the_browser_cannot_reach_the_hosts_loopback(browser: Browser, box: SandboxMachine) -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        error = await refused(browser, "page.navigate", url=f"http://127.0.0.1:{port}/", timeout=5)
        assert "ERR_CONNECTION_REFUSED" in error.message
    finally:
        listener.close()


async def test_the_browsers_processes_live_in_the_sandboxs_cgroup(
    browser: Browser, box: SandboxMachine
) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/form.html")
    listed = await box.exec(ExecRequest(command="pgrep chromium", timeout=10))
    pids = [int(p) for p in listed.stdout.split()]
    assert len(pids) >= 2, listed
    group = box._group
    assert group is not None
    host_pids = set()
    for pid in pids:  # a helper process chromium ended since pgrep listed it proves nothing
        with contextlib.suppress(AssertionError):
            host_pids.add(await sandbox_host_pid(box, pid))
    assert len(host_pids) >= 2 and host_pids <= group.pids()
    for pid in host_pids:
        assert group.dirs[0].name in Path(f"/proc/{pid}/cgroup").read_text()


async def test_a_crashed_browser_is_an_error_then_starts_again(browser: Browser, box: SandboxMachine) -> None:
    await act(browser, "page.navigate", url=f"{SITE}/form.html")
    await box.exec(ExecRequest(command="pkill -KILL -f chromium", timeout=10))
    deadline = time.monotonic() + 10  # the kill is sent, not done: on a loaded host it lags
    while await chromium_processes(box) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    error = await refused(browser, "page.text.snapshot")
    assert error.error_type == "browser_unavailable" and error.retryable
    assert "Form" in await act(browser, "page.navigate", url=f"{SITE}/form.html")


async def test_a_machine_without_the_browser_says_so(box: SandboxMachine, tmp_path: Path) -> None:
    from agentbox.machines.local import LocalMachine

    local = LocalMachine("local", tmp_path)
    error = await refused(Browser(local), "page.navigate", url=f"{SITE}/form.html")
    assert error.error_type == "browser_unavailable" and "browser = true" in error.message
    assert os.path.isdir(tmp_path)


async def chromium_processes(box: SandboxMachine) -> int:
    listed = await box.exec(ExecRequest(command="pgrep chromium || true", timeout=10))
    return len(listed.stdout.split())


async def test_an_idle_browser_stops_its_processes_and_starts_again(box: SandboxMachine) -> None:
    before = await chromium_processes(box)  # the module's own browser may be running
    idle = Browser(box, idle_seconds=1.0)
    try:
        await act(idle, "page.navigate", url=f"{SITE}/form.html")
        assert idle.running and await chromium_processes(box) > before
        for _ in range(50):
            if not idle.running:
                break
            await asyncio.sleep(0.1)
        assert not idle.running and idle.tabs == {}
        for _ in range(50):  # the driver takes its Chromium down as it exits
            if await chromium_processes(box) <= before:
                break
            await asyncio.sleep(0.1)
        assert await chromium_processes(box) <= before
        assert "Form" in await act(idle, "page.navigate", url=f"{SITE}/form.html"), "it starts again"
    finally:
        await idle.close()


async def test_the_url_timeout_and_snapshot_limits_hold_at_their_boundaries() -> None:
    from agentbox.workspace.browser import (
        MAX_SNAPSHOT_CHARS,
        MAX_TIMEOUT_SECONDS,
        MAX_URL_CHARS,
        check_url,
        clamp_timeout,
        cut,
    )

    longest = "http://a/" + "x" * (MAX_URL_CHARS - len("http://a/"))
    assert check_url(longest) == longest
    with pytest.raises(WorkspaceError, match=f"at most {MAX_URL_CHARS}"):
        check_url(longest + "x")
    assert clamp_timeout(MAX_TIMEOUT_SECONDS, 1.0) == MAX_TIMEOUT_SECONDS
    for bad in (0.0, MAX_TIMEOUT_SECONDS + 0.001):
        with pytest.raises(WorkspaceError, match="timeout must be"):
            clamp_timeout(bad, 1.0)
    assert cut("x" * MAX_SNAPSHOT_CHARS) == ("x" * MAX_SNAPSHOT_CHARS, False)
    shown, truncated = cut("x" * (MAX_SNAPSHOT_CHARS + 1))
    assert truncated and shown.startswith("x" * MAX_SNAPSHOT_CHARS) and "1 more characters" in shown
