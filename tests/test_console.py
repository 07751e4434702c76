"""The web console and `/docs` in real headless Chromium (Debian's), driven by Playwright.

One server for the module, with an API key (so the console's login is part of every browser
test), real sandboxes and the scripted model; one browser for the module, a fresh context
(cookies, pages) per test. Every page of every context runs with the outside cut off: a
request to anything but loopback is aborted and recorded, and a test fails if one was made.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, Route, expect, sync_playwright

from agentbox.console.login import COOKIE, LOGIN_SECONDS, token
from tests.conftest import Server, start_server, stop_server, traversable

#: Seconds any condition in the browser or the API may take before a test fails.
DEADLINE = 20.0
KEY = "console-test-key"
#: Debian's chromium (scripts/test.sh installs it); Playwright never downloads a browser here.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}

#: The turn every browser test drives: an exec that asks (full-ask), two staged writes, a delivery.
SCRIPT: list[dict[str, Any]] = [
    {
        "text": "Let me run it.",
        "tool_calls": [
            {"name": "bash", "input": {"command": "echo report > /workspace/report.txt; echo made"}}
        ],
    },
    {
        "tool_calls": [
            {"name": "write_file", "input": {"path": "a.txt", "content": "A\n"}},
            {"name": "write_file", "input": {"path": "b.txt", "content": "B\n"}},
        ]
    },
    {"tool_calls": [{"name": "deliver_file", "input": {"path": "report.txt"}}]},
    {"text": "All done."},
]

expect.set_options(timeout=DEADLINE * 1000)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("console"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(home, {"AGENTBOX_API_KEY": KEY})
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            "Debian's chromium is not installed (scripts/test.sh installs it: apt-get install chromium)"
        )
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    yield b
    b.close()


@dataclass
class Browsing:
    context: BrowserContext
    outside: list[str] = field(default_factory=list)
    """Every request the pages tried to send beyond loopback (each was aborted)."""

    def page(self) -> Page:
        page = self.context.new_page()
        page.set_default_timeout(DEADLINE * 1000)
        return page


def leaves_loopback(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme not in ("data", "blob", "about") and (parts.hostname or "") not in LOOPBACK


@pytest.fixture
def browsing(browser: Browser) -> Iterator[Browsing]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    browsing = Browsing(context)

    def cut_off(route: Route) -> None:
        browsing.outside.append(route.request.url)
        route.abort("internetdisconnected")

    context.route(leaves_loopback, cut_off)
    yield browsing
    context.close()
    assert browsing.outside == [], f"requests left loopback: {browsing.outside}"


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def wait_until(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while not (value := condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return value


def log_in(page: Page, server: Server) -> None:
    page.goto(server.url + "/")
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Sessions")).to_be_visible()


def png(width: int, height: int) -> bytes:
    """A valid RGB PNG of one colour, made here (no image library needed)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + b"\x2f\x6f\xde" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def workspace_names(api: httpx.Client, sid: str) -> set[str]:
    listing = api.get(f"/sandboxes/{sid}/v2/fs/list", params={"path": "/workspace"}).json()["data"]
    return {entry["name"] for entry in listing["files"]}


# ---------------------------------------------------------------- the whole flow in the browser


def test_a_session_from_login_to_review_in_the_browser(
    server: Server, browsing: Browsing, api: httpx.Client, tmp_path: Path
) -> None:
    page = browsing.page()
    page.goto(server.url + "/")
    expect(page).to_have_url(server.url + "/console/")
    expect(page.get_by_role("button", name="Log out")).to_be_hidden()
    # a wrong key is refused, the right one signs in
    page.get_by_label("API key").fill("not-the-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_text("That is not the key.")).to_be_visible()
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Sessions")).to_be_visible()
    [cookie] = [c for c in browsing.context.cookies() if c["name"] == COOKIE]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and KEY not in cookie["value"]

    # create a session with the form
    form = page.locator("#create-session")
    form.get_by_label("Permission mode").select_option("full-ask")
    form.get_by_label("Script").fill(json.dumps(SCRIPT))
    form.get_by_role("button", name="Create session").click()
    expect(page).to_have_url(re.compile(r"#/sessions/ses_\w+$"))
    sid = page.url.rsplit("/", 1)[-1]
    assert api.get(f"/v1/sessions/{sid}").json()["permission_mode"] == "full-ask"

    # send a message with an attachment
    page.locator("#composer textarea").fill("Write the report.")
    page.locator("#composer input[type=file]").set_input_files(
        {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"some notes\n"}
    )
    page.get_by_role("button", name="Send").click()
    conversation = page.locator("#conversation")
    expect(conversation.locator(".message.user")).to_contain_text("Write the report.")
    expect(conversation.locator(".message.user")).to_contain_text("attached: notes.txt")

    # the tool call appears while the turn still runs: it waits for the approval
    bash = conversation.locator('[data-tool-use="toolu_s0_0"]')
    expect(bash.locator(".tool-name")).to_have_text("→ bash")
    expect(bash.locator(".tool-input")).to_contain_text("echo report > /workspace/report.txt")
    approval = bash.locator(".approval.pending")
    expect(approval).to_contain_text("bash wants to exec")
    assert api.get(f"/v1/sessions/{sid}").json()["status"] == "awaiting_approval"
    expect(conversation.locator(".turn-end")).to_have_count(0)
    expect(page.locator("#abort")).to_be_enabled()
    approval.get_by_role("button", name="Allow", exact=True).click()
    expect(bash.locator(".approval.allowed")).to_contain_text("Allowed")
    expect(bash.locator(".result summary")).to_have_text("result: Exit code: 0")
    bash.locator(".result summary").click()
    expect(bash.locator(".result pre")).to_contain_text("made")
    expect(conversation.locator(".turn-end.completed")).to_be_visible()
    expect(conversation.locator(".message.agent .text")).to_have_text(["Let me run it.", "All done."])
    expect(conversation.locator('[data-type="files.placed"]')).to_contain_text("/workspace/inputs/notes.txt")
    [pending] = api.get(f"/v1/sessions/{sid}/approvals").json()["items"]
    assert pending["status"] == "allowed" and pending["scope"] == "once"

    # review the change set: apply the first operation, reject the second
    change_set = page.locator("#changes .change-set")
    op_a, op_b = change_set.locator(".operation").all()
    expect(op_a.locator("pre.diff .add")).to_have_text("+A")
    expect(op_b.locator("pre.diff .add")).to_have_text("+B")
    op_a.get_by_role("button", name="Apply").click()
    expect(change_set.locator(".operation").first.locator(".op-head .badge")).to_have_text("applied")
    change_set.locator(".operation").last.get_by_role("button", name="Reject").click()
    expect(change_set.locator(".operation").last.locator(".op-head .badge")).to_have_text("rejected")
    expect(change_set.locator(".change-head .badge")).to_have_text("partially_applied")
    assert workspace_names(api, sid) == {"inputs", "report.txt", "a.txt"}
    read = api.get(f"/sandboxes/{sid}/v2/fs/read", params={"path": "/workspace/a.txt"}).json()
    assert read["data"]["content"] == "A\n"

    # download the delivered file
    with page.expect_download() as download:
        page.locator("#delivered a", has_text="report.txt").click()
    assert download.value.suggested_filename == "report.txt"
    assert Path(download.value.path()).read_bytes() == b"report\n"

    # the sandbox: the tree shows exactly what was applied; view, upload, download; watch live
    page.locator("#open-sandbox").click()
    tree = page.locator("#tree")
    expect(tree.locator(":scope > li > button")).to_have_text(["inputs/", "a.txt", "report.txt"])
    expect(page.locator("#watch-state")).to_have_text("● live")
    tree.get_by_role("button", name="report.txt").click()
    expect(page.locator("#viewer .file-text")).to_have_text("report\n")
    with page.expect_download() as download:
        page.locator("#viewer").get_by_role("link", name="Download").click()
    assert Path(download.value.path()).read_bytes() == b"report\n"
    tree.get_by_role("button", name="inputs/").click()
    expect(tree.locator('[data-path="/workspace/inputs/notes.txt"]')).to_be_visible()
    tree.get_by_role("button", name="inputs/").click()  # folded again: uploads go to /workspace
    page.locator("#tree-root").click()
    expect(page.locator("#upload-target")).to_have_text("/workspace")
    page.locator("#upload input[type=file]").set_input_files(
        {"name": "dot.png", "mimeType": "image/png", "buffer": png(8, 6)}
    )
    page.locator("#upload").get_by_role("button", name="Upload").click()
    expect(page.locator("#watch li", has_text="/workspace/dot.png").first).to_be_visible()
    tree.get_by_role("button", name="dot.png").click()
    image = page.locator("#viewer img.preview")
    expect(image).to_be_visible()
    # visible is not loaded: wait for the decode before reading its size
    assert image.evaluate("img => img.decode().then(() => [img.naturalWidth, img.naturalHeight])") == [8, 6]
    assert "dot.png" in workspace_names(api, sid)
    # a change made by someone else shows up live, and the tree follows
    api.post(f"/sandboxes/{sid}/v2/fs/write", json={"path": "/workspace/later.txt", "content": "x"})
    expect(page.locator("#watch li", has_text="/workspace/later.txt").first).to_be_visible()
    expect(tree.get_by_role("button", name="later.txt")).to_be_visible()

    # log out: the API refuses the page again, and the login form is back
    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_label("API key")).to_be_visible()
    status = page.evaluate("async () => (await fetch('/v1/sessions')).status")
    assert status == 401


def test_the_sessions_list_is_live(server: Server, browsing: Browsing, api: httpx.Client) -> None:
    page = browsing.page()
    log_in(page, server)
    created = api.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "hi"}]}).json()
    row = page.locator(f'#sessions tr[data-session="{created["id"]}"]')
    expect(row).to_contain_text("scripted")
    expect(row.locator(".badge")).to_have_text("idle")


def test_abort_and_deny_from_the_page(server: Server, browsing: Browsing, api: httpx.Client) -> None:
    """Deny with a message (the model is told), then a hanging turn aborted with the button."""
    script = [
        {"tool_calls": [{"name": "bash", "input": {"command": "echo never"}}]},
        {"expect": {"tool_result_contains": "not today"}, "text": "Understood."},
        {"hang": True},
    ]
    sid = api.post(
        "/v1/sessions", json={"model": "scripted", "script": script, "permission_mode": "full-ask"}
    ).json()["id"]
    page = browsing.page()
    log_in(page, server)
    page.goto(f"{server.url}/console/#/sessions/{sid}")
    page.locator("#composer textarea").fill("try")
    page.get_by_role("button", name="Send").click()
    approval = page.locator(".approval.pending")
    approval.get_by_label("Deny message").fill("not today")
    approval.get_by_role("button", name="Deny").click()
    expect(page.locator(".approval.denied")).to_contain_text("Denied: not today")
    expect(page.locator(".message.agent .text")).to_have_text("Understood.")
    page.locator("#composer textarea").fill("and now hang")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#abort")).to_be_enabled()
    page.locator("#abort").click()
    expect(page.locator("#conversation .turn-end.aborted")).to_be_visible()
    turns = api.get(f"/v1/sessions/{sid}/turns").json()["items"]
    assert [t["status"] for t in turns] == ["completed", "aborted"]


def test_a_subagent_shows_in_the_call_that_started_it(
    server: Server, browsing: Browsing, api: httpx.Client
) -> None:
    task = {"name": "task", "input": {"agent": "explore", "prompt": "look", "description": "a look"}}
    script = [{"tool_calls": [{**task, "script": [{"text": "found it"}]}]}, {"text": "Thanks."}]
    sid = api.post("/v1/sessions", json={"model": "scripted", "script": script}).json()["id"]
    api.post(f"/v1/sessions/{sid}/messages", json={"content": "delegate"})
    page = browsing.page()
    log_in(page, server)
    page.goto(f"{server.url}/console/#/sessions/{sid}")
    card = page.locator('[data-tool-use="toolu_s0_0"]')
    expect(card.locator(".subagent")).to_have_text(
        ["↳ explore started: a look", "↳ explore completed after 1 model calls"]
    )
    expect(card.locator(".result summary")).to_contain_text("found it")
    expect(page.locator(".message.agent .text")).to_have_text("Thanks.")


def test_a_message_that_joined_the_running_turn_shows_once_and_where_it_was_taken_in(
    server: Server, browsing: Browsing, api: httpx.Client
) -> None:
    hold = {
        "tool_calls": [
            {"name": "bash", "input": {"command": "while [ ! -e /workspace/go ]; do sleep 0.05; done"}}
        ]
    }
    script = [hold, {"text": "Both answered."}]
    sid = api.post("/v1/sessions", json={"model": "scripted", "script": script}).json()["id"]
    api.post(f"/v1/sessions/{sid}/messages", json={"content": "first"})
    wait_until(lambda: any(e["type"] == "agent.tool_use" for e in api.get(f"/v1/sessions/{sid}/events").json()["items"]),
               "the tool call")  # fmt: skip
    api.post(f"/v1/sessions/{sid}/messages", json={"content": "also this"})
    done = api.post(f"/sandboxes/{sid}/v2/commands", json={"command": "touch /workspace/go", "mode": "sync"})
    assert done.status_code == 200, done.text
    page = browsing.page()
    log_in(page, server)
    page.goto(f"{server.url}/console/#/sessions/{sid}")
    expect(page.locator(".message.agent .text")).to_have_text("Both answered.")
    expect(page.locator(".message.user .text")).to_have_text(["first", "also this"])  # each once
    expect(page.locator('#conversation [data-type="user.message"].note')).to_have_text(
        'Your message "also this" joined the running turn.'
    )


def test_the_knowledge_bases_are_shown_and_selected_from_the_page(
    server: Server, browsing: Browsing, api: httpx.Client
) -> None:
    registered = [{"id": "notes", "path": "notes", "name": "Notes"}]
    created = api.post("/v1/sessions", json={"model": "scripted", "script": [], "knowledge_bases": registered})
    sid = created.json()["id"]
    page = browsing.page()
    log_in(page, server)
    page.goto(f"{server.url}/console/#/sessions/{sid}")
    panel = page.locator("#knowledge-bases")
    notes, workspace = panel.locator('li[data-id="notes"]'), panel.locator('li[data-id="workspace"]')
    expect(notes).to_contain_text("Notes")
    expect(notes).to_contain_text("notes")
    expect(workspace.locator(".badge")).to_have_text("base")  # every one selected, the workspace first
    workspace.locator("input").uncheck()
    expect(notes.locator(".badge")).to_have_text("base")
    expect(workspace.locator("input")).not_to_be_checked()
    listed = api.get(f"/v1/sessions/{sid}/knowledge-bases").json()["items"]
    assert [(kb["id"], kb["selected"], kb["base"]) for kb in listed] == [
        ("workspace", False, False), ("notes", True, True),
    ]  # fmt: skip
    notes.locator("input").uncheck()  # nothing selected: the API refuses, the page says why
    expect(page.locator(".side-column .error")).to_be_visible()
    expect(notes.locator("input")).to_be_checked()
    assert api.get(f"/v1/sessions/{sid}").json()["knowledge_base_ids"] == ["notes"]


def test_a_failed_turn_shows_its_error(server: Server, browsing: Browsing, api: httpx.Client) -> None:
    script = [{"expect": {"tool_result_contains": "nope"}}]  # the model's first call fails
    sid = api.post("/v1/sessions", json={"model": "scripted", "script": script}).json()["id"]
    api.post(f"/v1/sessions/{sid}/messages", json={"content": "x"})
    page = browsing.page()
    log_in(page, server)
    page.goto(f"{server.url}/console/#/sessions/{sid}")
    why = "expected a tool result containing 'nope', but there is none"
    expect(page.locator('#conversation [data-type="session.error"]')).to_contain_text("Error (script_error)")
    expect(page.locator("#conversation .turn-end.failed")).to_contain_text(why)
    expect(page.locator("#abort")).to_be_disabled()


# ---------------------------------------------------------------- /docs without a network


def test_docs_render_with_no_network(server: Server, browsing: Browsing) -> None:
    page = browsing.page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(server.url + "/docs")
    expect(page.locator(".swagger-ui .information-container .title")).to_contain_text("agentbox")
    expect(page.locator(".swagger-ui .opblock-tag", has_text="sessions")).to_be_visible()
    assert any(url.endswith("/docs/assets/swagger-ui-bundle.js") for url in requested)
    assert [url for url in requested if leaves_loopback(url)] == []
    assert browsing.outside == []


# ---------------------------------------------------------------- the cookie's rules


def test_a_cross_site_page_cannot_ride_the_login_cookie(
    server: Server, browsing: Browsing, api: httpx.Client
) -> None:
    """A page on another port of the same host is the same site to a browser, so the Strict
    cookie goes along: its form post is refused by the Origin check, a link it has followed by
    the cookie's `Sec-Fetch-Site` rule, and the approval it aimed at stays pending."""
    script = [{"tool_calls": [{"name": "bash", "input": {"command": "echo pwned"}}]}]
    sid = api.post(
        "/v1/sessions", json={"model": "scripted", "script": script, "permission_mode": "full-ask"}
    ).json()["id"]
    api.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
    pending = wait_until(
        lambda: api.get(f"/v1/sessions/{sid}/approvals", params={"status": "pending"}).json()["items"],
        "the approval is asked",
    )
    target = f"{server.url}/v1/sessions/{sid}/approvals/{pending[0]['id']}"
    page = browsing.page()
    log_in(page, server)
    evil = f"""<!doctype html><html><body>
      <a id="look" href="{server.url}/v1/sessions">sessions</a>
      <form id="f" method="POST" action="{target}" enctype="text/plain">
        <input name='{{"decision":"allow","x":"' value='"}}'>
      </form></body></html>"""
    with serving(evil.encode()) as attacker:
        page.goto(attacker)
        with page.expect_navigation() as posted:
            page.evaluate("document.getElementById('f').submit()")
        response = posted.value
        assert response is not None and response.url == target
        assert response.request.header_value("cookie") is not None  # the browser did send it
        assert response.status == 403
        page.goto(attacker)
        with page.expect_response(f"{server.url}/v1/sessions") as looked:
            page.locator("#look").click()
    assert looked.value.request.header_value("cookie") is not None  # sent with `Sec-Fetch-Site: same-site`
    assert looked.value.status == 401
    [still] = api.get(f"/v1/sessions/{sid}/approvals").json()["items"]
    assert still["status"] == "pending"
    api.post(f"/v1/sessions/{sid}/abort")


@contextmanager
def serving(page: bytes) -> Iterator[str]:
    """A real HTTP server on another loopback port that answers every GET with `page`: to a
    browser it is the same site as agentbox (ports do not count) but another origin."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def login_cookie(server: Server) -> str:
    r = httpx.post(server.url + "/console/login", json={"api_key": KEY})
    assert r.status_code == 204, r.text
    return r.cookies[COOKIE]


def test_the_cookie_counts_only_for_the_consoles_own_requests(server: Server) -> None:
    cookie = {"Cookie": f"{COOKIE}={login_cookie(server)}"}
    own = f"http://127.0.0.1:{urlsplit(server.url).port}"
    session = {"model": "scripted"}

    def status(method: str, path: str, **headers: str) -> int:
        return httpx.request(method, server.url + path, headers=headers, json=session).status_code

    assert status("GET", "/v1/sessions", **cookie) == 200  # a read, even from a client saying nothing
    assert status("GET", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "same-origin"}) == 200
    assert status("GET", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "none"}) == 200
    assert status("GET", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "same-site"}) == 401
    assert status("GET", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "cross-site"}) == 401
    # a write needs the page's word for it: same-origin, or an Origin the Guard has checked
    assert status("POST", "/v1/sessions", **cookie) == 401
    assert status("POST", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "none"}) == 401
    assert status("POST", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "same-site"}) == 401
    assert status("POST", "/v1/sessions", **cookie, **{"Sec-Fetch-Site": "same-origin"}) == 201
    assert status("POST", "/v1/sessions", **cookie, Origin=own) == 201
    assert status("POST", "/v1/sessions", **cookie, Origin="http://127.0.0.1:9") == 403  # the Guard
    assert status("POST", "/v1/sessions", Origin=own) == 401  # no cookie, no key


def test_only_a_cookie_made_with_the_key_and_not_expired_counts(server: Server) -> None:
    now = int(time.time())

    def status(value: str) -> int:
        return httpx.get(server.url + "/v1/sessions", headers={"Cookie": f"{COOKIE}={value}"}).status_code

    assert status(token(KEY, now + LOGIN_SECONDS)) == 200
    assert status(token(KEY, now - 1)) == 401  # expired
    assert status(token("another-key", now + LOGIN_SECONDS)) == 401  # a forged MAC
    assert status(f"{now + LOGIN_SECONDS}.{'0' * 64}") == 401
    assert status(KEY) == 401  # the key itself is not a login
    assert status(f"{'9' * 30}.x") == 401


def test_login_sets_a_strict_httponly_cookie_and_logout_clears_it(server: Server) -> None:
    wrong = httpx.post(server.url + "/console/login", json={"api_key": "nope"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert (
        httpx.post(server.url + "/console/login", data={"api_key": KEY}).status_code == 415
    )  # no form posts
    r = httpx.post(server.url + "/console/login", json={"api_key": KEY})
    set_cookie = r.headers["set-cookie"]
    assert r.status_code == 204 and set_cookie.startswith(f"{COOKIE}=")
    assert {"httponly", "samesite=strict", "path=/", f"max-age={LOGIN_SECONDS}"} <= {
        part.strip().lower() for part in set_cookie.split(";")
    }
    assert KEY not in set_cookie
    state = httpx.get(server.url + "/console/login", cookies={COOKIE: r.cookies[COOKIE]}).json()
    assert state == {"key_required": True, "signed_in": True}
    assert httpx.get(server.url + "/console/login").json() == {"key_required": True, "signed_in": False}
    out = httpx.post(server.url + "/console/logout", headers={"Origin": server.url})
    assert out.status_code == 204 and "max-age=0" in out.headers["set-cookie"].lower()


def test_the_page_and_assets_are_open_and_the_data_is_not(server: Server) -> None:
    root = httpx.get(server.url + "/")
    assert root.status_code == 307 and root.headers["location"] == "console/"
    page = httpx.get(server.url + "/console/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    script = httpx.get(server.url + "/console/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert script.headers["x-content-type-options"] == "nosniff"
    for escape in ("%2e%2e/login.py", "%2e%2e/%2e%2e/v1/sessions"):  # sent as is, decoded by the server
        assert httpx.get(f"{server.url}/console/static/{escape}").status_code == 404
    assert httpx.get(server.url + "/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert httpx.get(server.url + "/docs").status_code == 200
    assert httpx.get(server.url + "/v1/sessions").status_code == 401
    assert httpx.get(server.url + "/v1/sessions", headers={"X-AIO-API-Key": KEY}).status_code == 200
