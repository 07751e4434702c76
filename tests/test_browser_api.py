"""AIO's `/v1/browser` routes and the `/cdp` endpoint, on a real server whose sandbox has Chromium.

The client is the real `agent-sandbox==0.0.30` SDK (and, for `/cdp`, Playwright on the host
connecting over CDP: no browser runs on the host). The pages are served inside the sandbox
(`python3 -m http.server` on its loopback, network off), beside a server that accepts
connections and never answers, for the page that never loads. The module uses a sandbox of
its own (`/sandboxes/<id>`), so its browser is its own.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets.sync.client as ws_client
from agent_sandbox import Sandbox
from agent_sandbox.browser.types.action import Action_MoveRel, Action_Press, Action_Typing
from conftest import Server, start_server, stop_server, traversable
from playwright.sync_api import sync_playwright
from test_openapi_types import SESSION_PREFIX, conforms
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agentbox.api.cdp import RELAY_ENDED
from agentbox.api.v1_browser import MAX_TYPE_DELAY_MS
from agentbox.workspace.browser_cdp import MAX_CDP_CONNECTIONS

#: Where the pages are served inside the sandbox, and the server that never answers.
SITE_PORT, HANG_PORT = 8000, 8001
SITE = f"http://127.0.0.1:{SITE_PORT}"
#: Seconds the sandbox's two servers get to listen.
LISTEN_SECONDS = 20
#: Seconds the server may take to free a closed DevTools connection's slot.
SLOT_FREED_SECONDS = 10
#: The PNG and JPEG signatures.
PNG_MAGIC, JPEG_MAGIC = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"

INDEX = """<!doctype html><html><head><title>Agentbox Test</title></head><body>
<h1>Browser page</h1><p>hello from the sandbox</p>
<label>Name <input id="name" name="name"></label>
<select id="color"><option value="r">Red</option><option value="g">Green</option></select>
<button id="send" onclick="document.getElementById('out').textContent =
  'sent: ' + document.getElementById('name').value + ' ' + document.getElementById('color').value">Send</button>
<div id="out"></div>
<a href="/page2.html">Second page</a>
<button id="warn" onclick="document.getElementById('out').textContent = 'confirmed: ' + confirm('sure?')">Warn</button>
</body></html>"""
PAGE2 = "<!doctype html><html><head><title>Second</title></head><body><p>the second page</p></body></html>"
HANG = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {HANG_PORT}))
s.listen(16)
held = []
while True:
    held.append(s.accept()[0])
"""
LISTENING = f"""
import socket, sys, time
deadline = time.monotonic() + {LISTEN_SECONDS}
for port in ({SITE_PORT}, {HANG_PORT}):
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"nothing listens on {{port}}")
            time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def session_url(browser_server: Server) -> str:
    return f"{browser_server.url}/sandboxes/browser-api-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def raw(session_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=session_url, timeout=90) as client:
        yield client


@pytest.fixture(scope="module")
def client(session_url: str, raw: httpx.Client) -> Sandbox:
    """The SDK on this module's sandbox, whose loopback serves the test pages."""
    for name, content in (("index.html", INDEX), ("page2.html", PAGE2), ("hang.py", HANG)):
        written = raw.post("/v1/file/write", json={"file": f"/workspace/site/{name}", "content": content})
        assert written.json()["success"], written.text
    for command in (f"python3 -m http.server {SITE_PORT} --bind 127.0.0.1", "python3 hang.py"):
        started = raw.post(
            "/v2/commands", json={"command": command, "cwd": "/workspace/site", "mode": "async"}
        )
        assert started.status_code == 200, started.text
    ready = raw.post(
        "/v2/commands", json={"command": f"python3 -c '{LISTENING}'", "timeout": LISTEN_SECONDS + 5}
    )
    assert ready.json()["data"]["exit_code"] == 0, ready.text
    return Sandbox(base_url=session_url, timeout=90)


def error_type(reply: Any) -> str:
    """The `error_type` of a v1 failure (`success: false`, `data` the error object)."""
    assert reply.success is False, reply
    return str(reply.data["error_type"])


def page_text(client: Sandbox) -> str:
    reply = client.browser_page.get_text()
    assert reply.success, reply
    return str(reply.data)


# ---------------------------------------------------------------- the SDK


def test_navigate_read_and_screenshot(client: Sandbox) -> None:
    navigated = client.browser_page.navigate(url=f"{SITE}/index.html")
    assert navigated.success, navigated
    assert navigated.data is not None
    assert navigated.data["title"] == "Agentbox Test" and navigated.data["status"] == 200
    assert "hello from the sandbox" in page_text(client)
    assert b"".join(client.browser.screenshot()).startswith(PNG_MAGIC)
    jpeg = b"".join(client.browser_page.screenshot(format="jpeg", quality=50))
    assert jpeg.startswith(JPEG_MAGIC)
    html = client.browser_page.get_html()
    assert html.success and "<h1>Browser page</h1>" in str(html.data)
    markdown = client.browser_page.get_markdown()
    assert markdown.success and markdown.data is not None
    assert "# Browser page" in markdown.data["markdown"]
    title = client.browser_page.evaluate(expression="document.title + ' ' + (6 * 7)")
    assert title.success and title.data == "Agentbox Test 42"
    odd = client.browser_page.evaluate(expression="[0 / 0, -1 / 0, new Date(0), /a+/, {n: null}]")
    assert odd.success and odd.data[:2] == ["NaN", "-Infinity"] and odd.data[4] == {"n": None}
    assert odd.data[2].startswith("1970-01-01")


def test_fill_select_and_click_by_selector(client: Sandbox) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    assert client.browser_page.fill(selector="#name", text="Ada").success
    assert client.browser_page.select_option(selector="#color", label="Green").success
    assert client.browser_page.click(selector="#send").success
    assert "sent: Ada g" in page_text(client)


def test_elements_are_named_by_index(client: Sandbox) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    listed = client.browser_page.get_elements()
    assert listed.success and listed.data is not None
    by_name = {(e["role"], e["name"]): e for e in listed.data}
    textbox, button = by_name[("textbox", "Name")], by_name[("button", "Send")]
    link = by_name[("link", "Second page")]
    assert link["url"] == "/page2.html"
    assert client.browser_page.fill(index=textbox["index"], text="Grace").success
    assert client.browser_page.click(index=button["index"]).success
    assert "sent: Grace r" in page_text(client)
    assert client.browser_page.click(index=link["index"]).success
    assert client.browser_page.wait(type="url", url=f"{SITE}/page2.html", timeout=5000).success
    assert "the second page" in page_text(client)
    back = client.browser_page.back()
    assert back.success and back.data["title"] == "Agentbox Test"


def test_keyboard_actions(client: Sandbox) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    assert client.browser_page.click(selector="#name").success
    typed = client.browser.execute_action(request=Action_Typing(text="xy"))
    assert typed.success and typed.action_performed == "TYPING"
    assert client.browser.execute_action(request=Action_Press(key="backspace")).success
    assert client.browser_page.type_text(text="z", delay=10).success
    value = client.browser_page.evaluate(expression="document.getElementById('name').value")
    assert value.data == "xz"
    refused = client.browser.execute_action(request=Action_MoveRel(x_offset=1, y_offset=1))
    assert refused.success is False and "MOVE_REL" in str(refused.message)


def test_a_dialog_stops_the_page_until_it_is_handled(client: Sandbox, raw: httpx.Client) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    clicked = client.browser_page.click(selector="#warn")
    assert clicked.success and "confirm" in str(clicked.hint), clicked
    assert error_type(client.browser_page.navigate(url=f"{SITE}/page2.html")) == "conflict"
    handled = raw.post("/v1/browser/page/dialog", json={"accept": True}).json()
    assert handled["success"] and handled["data"]["message"] == "sure?", handled
    assert "confirmed: true" in page_text(client)
    nothing = raw.post("/v1/browser/page/dialog", json={"accept": False}).json()
    assert nothing["data"]["error_type"] == "not_found"


def test_tabs(client: Sandbox) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success  # the browser is running
    before = client.browser_tabs.list()
    assert before.success and before.data
    opened = client.browser_tabs.create(url=f"{SITE}/page2.html")
    assert opened.success and opened.data["title"] == "Second" and opened.data["active"]
    listed = client.browser_tabs.list().data
    assert listed is not None and len(listed) == len(before.data) + 1
    new_index = opened.data["index"]
    assert [t["index"] for t in listed if t["active"]] == [new_index]
    assert client.browser_tabs.activate(0).success
    assert client.browser_tabs.list().data[0]["active"]
    assert client.browser_tabs.close(new_index).success
    after = client.browser_tabs.list().data
    assert after is not None and len(after) == len(before.data)
    assert error_type(client.browser_tabs.close(len(after) + 5)) == "not_found"


def test_info_names_the_cdp_endpoint_of_this_sandbox(client: Sandbox, session_url: str) -> None:
    info = client.browser.get_info()
    assert info.success and info.data is not None
    ws_base = session_url.replace("http://", "ws://") + "/cdp/devtools/browser/"
    assert info.data.cdp_url.startswith(ws_base), info.data.cdp_url
    assert "Chrome" in info.data.user_agent
    assert (info.data.viewport.width, info.data.viewport.height) == (1280, 800)


# ---------------------------------------------------------------- bad input


def test_only_http_urls_are_opened(client: Sandbox) -> None:
    refused = client.browser_page.navigate(url="file:///etc/passwd")
    assert error_type(refused) == "bad_request"
    assert "http and https" in refused.data["message"]
    assert error_type(client.browser_tabs.create(url="javascript:alert(1)")) == "bad_request"


def test_unknown_elements_are_not_found(client: Sandbox) -> None:
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    assert error_type(client.browser_page.click(selector="#nope")) == "not_found"
    assert error_type(client.browser_page.click(index=9999)) == "not_found"
    assert error_type(client.browser_page.fill(selector="#nope", text="x")) == "not_found"
    assert error_type(client.browser_page.click(selector="#send", index=1)) == "bad_request"
    assert error_type(client.browser_page.type_text(text="x" * 100, delay=MAX_TYPE_DELAY_MS)) == "bad_request"
    broken = client.browser_page.evaluate(expression="no_such_name.x")
    assert error_type(broken) == "bad_request" and "no_such_name" in broken.message


def test_a_page_that_never_answers_times_out(client: Sandbox) -> None:
    hung = client.browser_page.navigate(url=f"http://127.0.0.1:{HANG_PORT}/", timeout=2000)
    assert error_type(hung) == "timeout"
    assert client.browser_page.navigate(url=f"{SITE}/page2.html").success  # the browser still works


def test_screenshot_failures_keep_their_status(raw: httpx.Client) -> None:
    response = raw.get("/v1/browser/page/screenshot", params={"format": "gif"})
    assert response.status_code == 400


# ---------------------------------------------------------------- CDP


def test_playwright_connects_over_cdp(client: Sandbox, session_url: str) -> None:
    """A CDP client on the host drives the sandbox's Chromium: it opens a page the sandbox serves."""
    assert client.browser_page.navigate(url=f"{SITE}/index.html").success
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(f"{session_url}/cdp", timeout=30_000)
        try:
            shared = next(pg for c in browser.contexts for pg in c.pages if pg.url == f"{SITE}/index.html")
            shared.evaluate("document.title = 'changed over CDP'")  # the API's page, changed here
            title = client.browser_page.evaluate(expression="document.title")
            assert title.data == "changed over CDP"
            page = shared.context.new_page()
            page.goto(f"{SITE}/page2.html")
            assert page.title() == "Second"
            assert "the second page" in page.inner_text("body")
            page.close()
        finally:
            browser.close()


def test_json_list_points_at_this_server(raw: httpx.Client, session_url: str) -> None:
    targets = raw.get("/cdp/json/list")
    assert targets.status_code == 200, targets.text
    pages = [t for t in targets.json() if t["type"] == "page"]
    assert pages
    ws_base = session_url.replace("http://", "ws://") + "/cdp/devtools/page/"
    assert all(t["webSocketDebuggerUrl"].startswith(ws_base) for t in pages)
    assert all("devtoolsFrontendUrl" not in t for t in pages)
    short = raw.get("/cdp/json")
    assert {t["id"] for t in short.json() if t["type"] == "page"} == {t["id"] for t in pages}


def test_the_root_endpoint_is_the_default_sessions(browser_server: Server) -> None:
    with browser_server.client() as http:
        version = http.get("/cdp/json/version")
    assert version.status_code == 200, version.text
    ws_base = browser_server.url.replace("http://", "ws://") + "/cdp/devtools/browser/"
    assert version.json()["webSocketDebuggerUrl"].startswith(ws_base)
    assert "Chrome" in version.json()["Browser"]


def connect_when_free(url: str) -> ws_client.ClientConnection:
    """A DevTools WebSocket, retried while it is refused: the server counts a connection until
    its relay is cleaned up, a moment after the client's close completes."""
    deadline = time.monotonic() + SLOT_FREED_SECONDS
    while True:
        try:
            return ws_client.connect(url, max_size=None)
        except InvalidStatus:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_devtools_connections_are_bounded(raw: httpx.Client) -> None:
    url = raw.get("/cdp/json/version").json()["webSocketDebuggerUrl"]
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(connect_when_free(url)) for _ in range(MAX_CDP_CONNECTIONS)]
        opened[0].send('{"id": 1, "method": "Browser.getVersion"}')
        assert '"product"' in str(opened[0].recv(timeout=20))
        with pytest.raises(InvalidStatus) as refused, ws_client.connect(url):
            pass
        assert refused.value.response.status_code == 403
    with connect_when_free(url) as again:  # closed ones no longer count
        again.send('{"id": 2, "method": "Browser.getVersion"}')
        assert '"id":2' in str(again.recv(timeout=20)).replace(" ", "")


def test_a_closed_page_ends_its_devtools_connection(client: Sandbox, raw: httpx.Client) -> None:
    opened = client.browser_tabs.create(url=f"{SITE}/page2.html")
    assert opened.success and opened.data is not None
    target = next(t for t in raw.get("/cdp/json/list").json() if t["url"] == f"{SITE}/page2.html")
    with ws_client.connect(target["webSocketDebuggerUrl"]) as page:
        page.send('{"id": 1, "method": "Runtime.evaluate", "params": {"expression": "document.title"}}')
        assert "Second" in str(page.recv(timeout=20))
        assert client.browser_tabs.close(opened.data["index"]).success
        with pytest.raises(ConnectionClosed) as ended:
            while True:  # events Chromium sends as the page goes, then the end
                page.recv(timeout=20)
        assert ended.value.rcvd is not None and ended.value.rcvd.code == RELAY_ENDED


def test_unknown_devtools_target_is_refused(raw: httpx.Client, session_url: str) -> None:
    url = session_url.replace("http://", "ws://") + "/cdp/devtools/page/NO-SUCH-TARGET"
    with pytest.raises(InvalidStatus), ws_client.connect(url):
        pass


# ---------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("browser-keyed"), tmp_path_factory) / "home"
    home.mkdir()
    server = start_server(home, {"AGENTBOX_API_KEY": "cdp-secret"})
    yield server
    stop_server(server)


def test_cdp_needs_the_api_key(keyed: Server) -> None:
    refused = httpx.get(f"{keyed.url}/cdp/json/version", timeout=30)
    assert refused.status_code == 401
    with (
        pytest.raises(InvalidStatus) as closed,
        ws_client.connect(keyed.url.replace("http://", "ws://") + "/cdp/devtools/browser/x"),
    ):
        pass
    assert closed.value.response.status_code == 403
    with keyed.client() as http:  # with the key it passes (this server's sandbox has no browser)
        assert http.get("/cdp/json/version").status_code == 503


# ---------------------------------------------------------------- the document


def test_replies_fit_the_document(raw: httpx.Client, browser_server: Server, client: Sandbox) -> None:
    """Successes and failures of the browser routes and the CDP endpoint are what /openapi.json says."""
    with browser_server.client() as http:
        served = http.get("/openapi.json").json()
    twin = SESSION_PREFIX
    replies = {
        "/v1/browser/page/navigate": raw.post(
            "/v1/browser/page/navigate", json={"url": f"{SITE}/index.html"}
        ),
        "/v1/browser/page/click": raw.post("/v1/browser/page/click", json={"selector": "#nope"}),
        "/v1/browser/page/elements": raw.get("/v1/browser/page/elements"),
        "/v1/browser/page/text": raw.get("/v1/browser/page/text"),
        "/v1/browser/tabs": raw.get("/v1/browser/tabs"),
        "/v1/browser/info": raw.get("/v1/browser/info"),
        "/v1/browser/actions": raw.post(
            "/v1/browser/actions", json={"action_type": "MOVE_REL", "x_offset": 1, "y_offset": 1}
        ),
        "/cdp/json/version": raw.get("/cdp/json/version"),
        "/cdp/json/list": raw.get("/cdp/json/list"),
    }
    assert replies["/v1/browser/page/click"].json()["data"]["error_type"] == "not_found"
    for path, response in replies.items():
        assert response.status_code == 200, (path, response.text)
        conforms(served, twin + path, response)
