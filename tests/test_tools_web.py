"""web_fetch and web_search against real HTTP servers on loopback (never an external address)."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from agentbox.machines.local import LocalMachine
from agentbox.tools import web
from agentbox.tools.base import Action, FileStore, Operation, TodoStore, ToolConfig, ToolResult
from agentbox.tools.web import (
    MAX_FETCH_BYTES,
    MAX_REDIRECTS,
    MAX_SEARCH_RESULTS,
    PAGE_CHARS,
    WEB_FETCH,
    WEB_SEARCH,
    FetchParams,
    SearchParams,
)
from tests.scoped import Scoped

PAGE = b"""<!doctype html><html><head><title>The  Title &amp; more</title>
<style>body { color: red }</style><script>var secret = "script text";</script></head>
<body><h1>Heading</h1><p>Para with a <a href="/next">relative link</a> &amp; <b>bold</b>.</p>
<ul><li>one</li><li>two</li></ul></body></html>"""


class Handler(BaseHTTPRequestHandler):
    """Routes by path; the test server's `release` event unblocks /stall."""

    server: LoopbackServer

    def log_message(self, *args: Any) -> None:
        pass

    def send(self, status: int, body: bytes, content_type: str | None, **headers: str) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        self.server.seen.append(self.path)
        self.server.hosts.append(self.headers.get("Host", ""))
        path = url.path
        if path == "/html":
            self.send(200, PAGE, "text/html; charset=utf-8")
        elif path == "/untyped-html":
            self.send(200, PAGE, None)
        elif path == "/text":
            self.send(200, "plain text, ünïcode\n".encode(), "text/plain; charset=utf-8")
        elif path == "/latin1":
            self.send(200, "café".encode("latin-1"), "text/plain; charset=iso-8859-1")
        elif path == "/json":
            self.send(200, b'{"a": [1, 2]}', "application/json")
        elif path == "/png":
            self.send(200, b"\x89PNG\r\n\x1a\n\0\0\0", "image/png")
        elif path == "/untyped-binary":
            self.send(200, b"\0\1\2\3binary", None)
        elif path.startswith("/size/"):
            self.send(200, b"a" * int(path.rsplit("/", 1)[1]), "text/plain")
        elif path == "/gzip-bomb":
            self.send(200, gzip.compress(b"z" * (MAX_FETCH_BYTES * 2)), "text/plain", Content_Encoding="gzip")
        elif path == "/long":
            self.send(200, "".join(f"{i:05d}\n" for i in range(3000)).encode(), "text/plain")
        elif path == "/empty":
            self.send(200, b"", "text/plain")
        elif path == "/missing":
            self.send(404, b"<html><body><p>No such page</p></body></html>", "text/html")
        elif path == "/stall":
            self.server.release.wait(30)
            self.send(200, b"late", "text/plain")
        elif path == "/to-file":
            self.send(302, b"", "text/plain", Location="file:///etc/passwd")
        elif path == "/to-ftp":
            self.send(301, b"", "text/plain", Location="ftp://127.0.0.1/x")
        elif path == "/to-text":
            self.send(302, b"", "text/plain", Location="/text")
        elif path.startswith("/hops/"):
            n = int(path.rsplit("/", 1)[1])
            if n == 0:
                self.send(200, b"arrived", "text/plain")
            else:
                self.send(307, b"", "text/plain", Location=f"/hops/{n - 1}")
        elif path == "/search":
            n = int(query["n"][0])
            q = query["q"][0]
            results = [
                {
                    "title": f"Result {i} for {q}",
                    "url": f"https://example.org/{i}",
                    "snippet": f"snippet  {i}\n",
                }
                for i in range(1, 30)
            ]
            results.insert(1, {"title": "no url, skipped"})
            self.send(200, json.dumps({"results": results[: n + 1]}).encode(), "application/json")
        elif path == "/search-empty":
            self.send(200, b'{"results": []}', "application/json")
        elif path == "/search-500":
            self.send(500, b"boom", "text/plain")
        elif path == "/search-not-json":
            self.send(200, b"<html>", "text/html")
        elif path == "/search-no-list":
            self.send(200, b'{"items": []}', "application/json")
        else:
            self.send(404, b"not found", "text/plain")


class LoopbackServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.release = threading.Event()
        self.seen: list[str] = []
        self.hosts: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    s = LoopbackServer()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.release.set()
    s.shutdown()
    s.server_close()


class MemoryTodos:
    async def get(self, session_id: str) -> list[dict[str, Any]]:
        return []

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        pass


@dataclass
class Ctx(Scoped):
    machine: Any
    session_id: str = "ses_web"
    turn_id: str | None = "trn_web"
    config: ToolConfig = field(default_factory=lambda: ToolConfig(web_allow_private=True))
    reads: dict[str, str] = field(default_factory=dict)
    todos: TodoStore = field(default_factory=MemoryTodos)
    files: FileStore | None = None
    deliveries: int = 0
    services: Any = None  # no machine services: tools make what they need
    refusal: str | None = None
    asked: list[tuple[Action, str, dict[str, Any]]] = field(default_factory=list)

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        raise AssertionError("web tools never plan workspace operations")

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        self.asked.append((action, tool, detail))
        return self.refusal


@pytest.fixture
def ctx(tmp_path: Path) -> Ctx:
    return Ctx(LocalMachine("local", tmp_path / "root"))


async def fetch(ctx: Ctx, url: str, offset: int = 0) -> ToolResult:
    return await WEB_FETCH.run(ctx, FetchParams(url=url, offset=offset))


# -- web_fetch ---------------------------------------------------------------------------


async def test_html_becomes_readable_text(ctx: Ctx, server: LoopbackServer) -> None:
    result = await fetch(ctx, server.url + "/html")
    body = result.as_text()
    assert not result.is_error
    assert body.startswith(f"URL: {server.url}/html\nStatus: 200 OK\nContent-Type: text/html\n")
    assert "# The Title & more" in body and "# Heading" in body
    assert f"[relative link]({server.url}/next)" in body  # links made absolute
    assert "**bold**" in body and "* one" in body
    assert "<p>" not in body and "color: red" not in body and "script text" not in body
    assert ctx.asked == [(Action.WEB, "web_fetch", {"url": server.url + "/html"})]
    assert result.data["status"] == 200 and result.data["nextOffset"] is None


async def test_untyped_bodies_are_sniffed(ctx: Ctx, server: LoopbackServer) -> None:
    assert "# Heading" in (await fetch(ctx, server.url + "/untyped-html")).as_text()
    binary = await fetch(ctx, server.url + "/untyped-binary")
    assert binary.is_error and "binary content" in binary.as_text()


async def test_text_and_json_pass_through(ctx: Ctx, server: LoopbackServer) -> None:
    assert (await fetch(ctx, server.url + "/text")).as_text().endswith("\n\nplain text, ünïcode\n")
    assert (await fetch(ctx, server.url + "/latin1")).as_text().endswith("\n\ncafé")
    assert (await fetch(ctx, server.url + "/json")).as_text().endswith('\n\n{"a": [1, 2]}')
    assert (await fetch(ctx, server.url + "/empty")).as_text().endswith("\n\n(empty page)")


async def test_binary_is_refused(ctx: Ctx, server: LoopbackServer) -> None:
    result = await fetch(ctx, server.url + "/png")
    assert result.is_error and "binary content (image/png)" in result.as_text()


async def test_http_errors_are_error_results_with_the_page(ctx: Ctx, server: LoopbackServer) -> None:
    result = await fetch(ctx, server.url + "/missing")
    assert result.is_error and result.as_text().startswith("HTTP 404 Not Found")
    assert "No such page" in result.as_text()


async def test_paging_by_offset(ctx: Ctx, server: LoopbackServer) -> None:
    whole = "".join(f"{i:05d}\n" for i in range(3000))
    first = await fetch(ctx, server.url + "/long")
    assert first.data["nextOffset"] == PAGE_CHARS and first.data["total_chars"] == len(whole)
    assert (
        f"\n\n{whole[:PAGE_CHARS]}\n\n[Showing characters 0-{PAGE_CHARS} of {len(whole)}." in first.as_text()
    )
    assert f"Use offset={PAGE_CHARS} to continue.]" in first.as_text()
    collected, offset = "", 0
    while offset is not None:
        page = await fetch(ctx, server.url + "/long", offset)
        collected += page.as_text().split("\n\n", 1)[1].split("\n\n[Showing")[0]
        offset = page.data["nextOffset"]
    assert collected == whole
    past = await fetch(ctx, server.url + "/long", len(whole))
    assert past.is_error and f"past the end of the text ({len(whole)} characters)" in past.as_text()


async def test_size_limit_boundary(ctx: Ctx, server: LoopbackServer) -> None:
    exact = await fetch(ctx, f"{server.url}/size/{MAX_FETCH_BYTES}")
    assert not exact.data["truncated"] and exact.data["total_chars"] == MAX_FETCH_BYTES
    assert "larger than" not in exact.as_text()
    over = await fetch(ctx, f"{server.url}/size/{MAX_FETCH_BYTES + 1}")
    assert over.data["truncated"] and over.data["total_chars"] == MAX_FETCH_BYTES
    assert f"[The page is larger than {MAX_FETCH_BYTES} bytes" in over.as_text()


async def test_the_limit_counts_decoded_bytes(ctx: Ctx, server: LoopbackServer) -> None:
    bomb = await fetch(ctx, server.url + "/gzip-bomb")
    assert bomb.data["truncated"] and bomb.data["total_chars"] == MAX_FETCH_BYTES


async def test_time_limit(ctx: Ctx, server: LoopbackServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "FETCH_TIMEOUT_SECONDS", 0.5)
    result = await fetch(ctx, server.url + "/stall")
    assert result.is_error and "timed out after 0.5 seconds" in result.as_text()


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "javascript:alert(1)", "/relative/path", "http://"]
)
async def test_non_http_urls_are_refused_without_asking(ctx: Ctx, url: str) -> None:
    result = await fetch(ctx, url)
    assert result.is_error and ctx.asked == []


async def test_redirects_to_non_http_are_not_followed(ctx: Ctx, server: LoopbackServer) -> None:
    for path, target in (("/to-file", "file:///etc/passwd"), ("/to-ftp", "ftp://127.0.0.1/x")):
        result = await fetch(ctx, server.url + path)
        assert result.is_error and f"redirected to {target}" in result.as_text()
        assert "root:" not in result.as_text()


async def test_redirects_are_followed_up_to_the_limit(ctx: Ctx, server: LoopbackServer) -> None:
    moved = await fetch(ctx, server.url + "/to-text")
    assert moved.as_text().startswith(f"URL: {server.url}/text\n") and "plain text" in moved.as_text()
    assert (await fetch(ctx, f"{server.url}/hops/{MAX_REDIRECTS}")).as_text().endswith("arrived")
    too_many = await fetch(ctx, f"{server.url}/hops/{MAX_REDIRECTS + 1}")
    assert too_many.is_error and "Too many redirects" in too_many.as_text()


async def test_private_addresses_are_refused_unless_allowed(tmp_path: Path, server: LoopbackServer) -> None:
    ctx = Ctx(LocalMachine("local", tmp_path / "root"), config=ToolConfig())
    seen = len(server.seen)
    for url in (server.url + "/text", f"http://localhost:{server.server_address[1]}/text"):
        result = await fetch(ctx, url)
        assert result.is_error and "non-public address" in result.as_text()
    assert len(server.seen) == seen  # nothing reached the server
    allowed = Ctx(LocalMachine("local", tmp_path / "root"))
    assert not (await fetch(allowed, f"http://localhost:{server.server_address[1]}/text")).is_error
    assert server.hosts[-1] == f"localhost:{server.server_address[1]}"  # Host keeps the name


async def test_a_refusal_fetches_nothing(ctx: Ctx, server: LoopbackServer) -> None:
    ctx.refusal = "denied by user"
    seen = len(server.seen)
    result = await fetch(ctx, server.url + "/text")
    assert result.is_error and result.as_text() == "denied by user"
    assert len(server.seen) == seen


# -- web_search --------------------------------------------------------------------------


async def search(ctx: Ctx, query: str, n: int = 5) -> ToolResult:
    return await WEB_SEARCH.run(ctx, SearchParams(query=query, n=n))


async def test_search_lists_results(ctx: Ctx, server: LoopbackServer) -> None:
    ctx.config.web_search_url = server.url + "/search"
    result = await search(ctx, "rust & go", n=2)
    assert not result.is_error
    assert result.as_text() == (
        "1. Result 1 for rust & go\n   https://example.org/1\n   snippet 1\n"
        "2. Result 2 for rust & go\n   https://example.org/2\n   snippet 2"
    )
    assert [r["url"] for r in result.data["results"]] == ["https://example.org/1", "https://example.org/2"]
    assert ctx.asked == [(Action.WEB, "web_search", {"query": "rust & go"})]
    assert server.seen[-1] == "/search?q=rust+%26+go&n=2"


async def test_search_result_count_boundary(ctx: Ctx, server: LoopbackServer) -> None:
    ctx.config.web_search_url = server.url + "/search"
    assert len((await search(ctx, "x", n=MAX_SEARCH_RESULTS)).data["results"]) == MAX_SEARCH_RESULTS
    for n in (0, MAX_SEARCH_RESULTS + 1):
        result = await search(ctx, "x", n=n)
        assert result.is_error and f"between 1 and {MAX_SEARCH_RESULTS}" in result.as_text()


async def test_search_without_a_provider_is_a_clear_error(ctx: Ctx) -> None:
    result = await search(ctx, "anything")
    assert result.is_error and "no search provider is configured" in result.as_text()
    assert ctx.asked == []


async def test_search_provider_failures(ctx: Ctx, server: LoopbackServer) -> None:
    ctx.config.web_search_url = server.url + "/search-empty"
    empty = await search(ctx, "nothing")
    assert not empty.is_error and empty.as_text() == "No results for 'nothing'."
    for path, why in (
        ("/search-500", "HTTP 500"),
        ("/search-not-json", "not JSON"),
        ("/search-no-list", 'no "results" list'),
    ):
        ctx.config.web_search_url = server.url + path
        result = await search(ctx, "q")
        assert result.is_error and why in result.as_text()


async def test_search_refusal(ctx: Ctx, server: LoopbackServer) -> None:
    ctx.config.web_search_url = server.url + "/search"
    ctx.refusal = "web research is not allowed in this tier"
    seen = len(server.seen)
    result = await search(ctx, "q")
    assert result.is_error and result.as_text() == "web research is not allowed in this tier"
    assert len(server.seen) == seen


def test_tool_metadata() -> None:
    for tool in (WEB_FETCH, WEB_SEARCH):
        assert tool.action == Action.WEB and tool.read_only
        assert all(p.get("description") for p in tool.schema()["properties"].values())
    assert set(web.TOOLS) == {"web_fetch", "web_search"}
