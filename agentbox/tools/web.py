"""`web_fetch` and `web_search`: external research, seed 001's `read url` and `search target=web`.

Both run in the server, not in the sandbox, so they are `Action.WEB` (forbidden in the
read-only and workspace-write tiers, asked for each time in full-ask) and they guard what a
sandbox's network namespace would otherwise guard:

- only http and https, on the first request and on every redirect (`MAX_REDIRECTS`), which
  are followed by hand so a `Location: file:///...` is refused rather than obeyed;
- the host name is resolved once and every address must be public unless the session's
  `ToolConfig.web_allow_private` says otherwise; the request then goes to that address
  (Host header and TLS SNI keep the name), so a DNS answer cannot change between the check
  and the connection;
- the body is streamed and reading stops at `MAX_FETCH_BYTES` (counted after content
  decoding, so a gzip bomb stops too); the whole fetch, redirects included, ends at
  `FETCH_TIMEOUT_SECONDS`; no proxy from the server's environment is used.

HTML becomes readable text (html2text, links made absolute); text and JSON pass through;
anything else is refused. The text is paged like `read`: `PAGE_CHARS` characters from
`offset`, and a `nextOffset` to continue. Every page re-fetches the URL (nothing is cached:
pages change).

`web_search` asks a configured provider (`ToolConfig.web_search_url`): `GET <url>?q=&n=`
answering `{"results": [{"title", "url", "snippet"}]}`. A SearXNG or any search API fits
behind a ten-line adapter; none configured is a clear error result, not a missing tool.
"""

from __future__ import annotations

import asyncio
import codecs
import html
import ipaddress
import json
import re
import socket
from dataclasses import dataclass
from typing import Any

import html2text
import httpx
from pydantic import Field

from agentbox.machines.base import Machine

from .base import Action, Tool, ToolConfig, ToolContext, ToolParams, ToolResult

#: Body bytes read from one page (after content decoding); reading stops there and the result says so.
MAX_FETCH_BYTES = 5 * 1024 * 1024
#: Seconds one fetch may take, redirects and body included.
FETCH_TIMEOUT_SECONDS = 30.0
#: Redirects followed before giving up.
MAX_REDIRECTS = 5
#: Characters of text one result shows (seed 001's read window); `nextOffset` continues.
PAGE_CHARS = 6000
#: Seconds a search provider may take to answer.
SEARCH_TIMEOUT_SECONDS = 20.0
#: Bytes of a search provider's answer read at most.
MAX_SEARCH_RESPONSE_BYTES = 1024 * 1024
#: Results asked for when the model does not say.
DEFAULT_SEARCH_RESULTS = 5
#: Most results one search may ask for.
MAX_SEARCH_RESULTS = 10
#: Characters of a result's snippet shown.
MAX_SNIPPET_CHARS = 500
USER_AGENT = "agentbox-web-fetch/0.1"

ALLOWED_SCHEMES = ("http", "https")
HTML_TYPES = ("text/html", "application/xhtml+xml")
TEXT_TYPES = (
    "application/json",
    "application/xml",
    "application/javascript",
    "application/x-javascript",
    "application/x-yaml",
    "application/yaml",
    "application/toml",
    "application/x-ndjson",
)
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title", re.I | re.S)

FETCH_DESCRIPTION = (
    "Fetch a web page by URL (http or https only) and return its text: HTML is converted to readable "
    "markdown-like text with absolute links, plain text and JSON are returned as they are, binary content "
    f"(images, PDFs, archives) is refused. At most {MAX_FETCH_BYTES // (1024 * 1024)} MiB of a page is "
    f"read and a fetch times out after {FETCH_TIMEOUT_SECONDS:g} s. The result shows {PAGE_CHARS} "
    "characters from `offset`; when there is more it ends with a marker giving the nextOffset to pass "
    "as `offset` to read on (each call fetches the page again)."
)
SEARCH_DESCRIPTION = (
    "Search the web and get a numbered list of results (title, URL, snippet). Use web_fetch on a "
    f"result's URL to read it. `n` is how many results to return (1-{MAX_SEARCH_RESULTS}, default "
    f"{DEFAULT_SEARCH_RESULTS})."
)


class FetchParams(ToolParams):
    url: str = Field(description="The http:// or https:// URL to fetch.")
    offset: int = Field(
        default=0,
        description="Character offset into the page's text to start from: 0, or the nextOffset of the last result.",
        json_schema_extra={"minimum": 0},
    )


class SearchParams(ToolParams):
    query: str = Field(description="What to search for.")
    n: int = Field(
        default=DEFAULT_SEARCH_RESULTS,
        description=f"Number of results, 1 to {MAX_SEARCH_RESULTS}.",
        json_schema_extra={"minimum": 1, "maximum": MAX_SEARCH_RESULTS},
    )


class FetchRefused(Exception):
    """A URL, redirect or address the fetcher will not follow; the message is for the model."""


@dataclass(frozen=True)
class Page:
    url: str
    """The URL that answered (after redirects)."""
    status: int
    reason: str
    content_type: str
    charset: str | None
    body: bytes
    truncated: bool
    """The body was longer than `MAX_FETCH_BYTES`; `body` is its start."""


# -- web_fetch ---------------------------------------------------------------------------


async def run_fetch(ctx: ToolContext, params: FetchParams) -> ToolResult:
    if params.offset < 0:
        return ToolResult.error(f"offset must be 0 or more, got {params.offset}.")
    try:
        url = check_url(params.url)
    except FetchRefused as exc:
        return ToolResult.error(str(exc))
    refusal = await ctx.authorize(Action.WEB, "web_fetch", {"url": str(url)})
    if refusal is not None:
        return ToolResult.error(refusal)
    try:
        page = await fetch(url, allow_private=ctx.config.web_allow_private)
    except FetchRefused as exc:
        return ToolResult.error(str(exc))
    except TimeoutError:
        return ToolResult.error(f"Fetching {url} timed out after {FETCH_TIMEOUT_SECONDS:g} seconds.")
    except httpx.HTTPError as exc:
        return ToolResult.error(f"Fetching {url} failed: {type(exc).__name__}: {exc}")
    kind = content_kind(page.content_type, page.body)
    if kind == "binary":
        return ToolResult.error(
            f"{page.url} returned binary content ({page.content_type or 'unknown type'}); web_fetch only "
            "returns text (HTML, plain text, JSON)."
        )
    text = await asyncio.to_thread(page_text, page, kind)
    return paged(page, text, params.offset)


def check_url(raw: str) -> httpx.URL:
    """The URL if it is http(s) with a host; `FetchRefused` otherwise."""
    try:
        url = httpx.URL(raw.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise FetchRefused(f"Not a valid URL: {raw!r} ({exc}).") from exc
    if url.scheme not in ALLOWED_SCHEMES:
        raise FetchRefused(
            f"Only http and https URLs can be fetched, not {url.scheme or 'a relative URL'}: {raw}"
        )
    if not url.host:
        raise FetchRefused(f"The URL has no host: {raw}")
    return url


async def fetch(url: httpx.URL, *, allow_private: bool) -> Page:
    """GET `url`, following redirects by hand, within the size and time limits."""
    async with asyncio.timeout(FETCH_TIMEOUT_SECONDS):
        async with httpx.AsyncClient(
            trust_env=False, follow_redirects=False, timeout=FETCH_TIMEOUT_SECONDS
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                response = await _send(client, url, allow_private)
                try:
                    location = response.headers.get("location")
                    if response.is_redirect and location:
                        url = _redirect_target(url, location)
                        continue
                    return await _read(url, response)
                finally:
                    await response.aclose()
    raise FetchRefused(f"Too many redirects (more than {MAX_REDIRECTS}) starting from the URL.")


async def _send(client: httpx.AsyncClient, url: httpx.URL, allow_private: bool) -> httpx.Response:
    """Send the request to the one address we checked, keeping the name for Host and TLS."""
    address = await resolve(url, allow_private)
    host_header = url.netloc.decode("ascii")
    request = client.build_request(
        "GET",
        url.copy_with(host=address),
        headers={
            "Host": host_header,
            "User-Agent": USER_AGENT,
            "Accept": "text/html, text/*, application/json, */*;q=0.5",
        },
        extensions={"sni_hostname": url.host} if url.scheme == "https" else {},
    )
    return await client.send(request, stream=True)


async def resolve(url: httpx.URL, allow_private: bool, purpose: str = "web_fetch") -> str:
    """One address of the URL's host; every address must be public unless private ones are allowed.

    Also the check for what a session points the server at (`agentbox.agent.reach`); `purpose`
    names it in the refusal."""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FetchRefused(f"Cannot resolve {url.host}: {exc.strerror}.") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise FetchRefused(f"Cannot resolve {url.host}.")
    if not allow_private:
        private = [a for a in addresses if not a.is_global]
        if private:
            raise FetchRefused(
                f"{url.host} resolves to a non-public address ({private[0]}); {purpose} only reaches the public "
                "internet."
            )
    return str(addresses[0])


def _redirect_target(url: httpx.URL, location: str) -> httpx.URL:
    try:
        target = url.join(location)
    except httpx.InvalidURL as exc:
        raise FetchRefused(f"{url} redirected to an invalid URL: {location!r}.") from exc
    if target.scheme not in ALLOWED_SCHEMES:
        raise FetchRefused(
            f"{url} redirected to {location}, which is not an http or https URL; not followed."
        )
    return target


async def _read(url: httpx.URL, response: httpx.Response) -> Page:
    """The body up to `MAX_FETCH_BYTES` (binary types are not read at all)."""
    header = response.headers.get("content-type", "")
    content_type = header.split(";")[0].strip().lower()
    charset = response.charset_encoding
    body = bytearray()
    truncated = False
    if content_kind(content_type, None) != "binary":
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_FETCH_BYTES:
                del body[MAX_FETCH_BYTES:]
                truncated = True
                break
    return Page(
        str(url), response.status_code, response.reason_phrase, content_type, charset, bytes(body), truncated
    )


def content_kind(content_type: str, body: bytes | None) -> str:
    """Whether a body is "html", "text" or "binary", from its type; an untyped body is sniffed (None: not read yet)."""
    if content_type in HTML_TYPES:
        return "html"
    if content_type.startswith("text/") or content_type in TEXT_TYPES:
        return "text"
    if content_type.endswith(("+json", "+xml")):
        return "text"
    if content_type:
        return "binary"
    if body is None:
        return "text"  # unknown until read
    start = body[:1024]
    if b"\0" in start:
        return "binary"
    return "html" if re.search(rb"<(!doctype html|html|head|body)\b", start, re.I) else "text"


def page_text(page: Page, kind: str) -> str:
    """The page as text a model reads: HTML converted, the rest decoded."""
    text = page.body.decode(_codec(page.charset), "replace")
    if kind != "html":
        return text
    converted = html_markdown(text, page.url)
    match = _TITLE.search(page.body[:65536])
    title = (
        " ".join(html.unescape(match.group(1).decode(_codec(page.charset), "replace")).split())
        if match
        else ""
    )
    return f"# {title}\n\n{converted}" if title and not converted.startswith(f"# {title}") else converted


def html_markdown(text: str, base_url: str) -> str:
    """HTML as Markdown (html2text, links made absolute against `base_url`, lines unwrapped);
    the `/v1/browser/page/markdown` route shares it."""
    converter = html2text.HTML2Text(baseurl=base_url)
    converter.body_width = 0
    converter.ignore_images = False
    converter.ignore_emphasis = False
    return str(converter.handle(text)).strip()


def _codec(charset: str | None) -> str:
    """A Python codec for the page's charset; unknown charsets read as UTF-8 (with replacements)."""
    try:
        return codecs.lookup(charset or "utf-8").name
    except LookupError:
        return "utf-8"


def paged(page: Page, text: str, offset: int) -> ToolResult:
    """`PAGE_CHARS` of `text` from `offset`, with the continuation marker read uses."""
    total = len(text)
    if offset > total or (offset == total and total > 0):
        return ToolResult.error(f"offset {offset} is past the end of the text ({total} characters).")
    end = min(offset + PAGE_CHARS, total)
    next_offset = end if end < total else None
    lines = [
        f"URL: {page.url}",
        f"Status: {page.status} {page.reason}".rstrip(),
        f"Content-Type: {page.content_type or 'unknown'}",
    ]
    if page.truncated:
        lines.append(
            f"[The page is larger than {MAX_FETCH_BYTES} bytes; only its first {MAX_FETCH_BYTES} bytes were read.]"
        )
    body = text[offset:end] if total else "(empty page)"
    lines += ["", body]
    if next_offset is not None:
        lines += [
            "",
            f"[Showing characters {offset}-{end} of {total}. Use offset={next_offset} to continue.]",
        ]
    elif offset:
        lines += ["", f"[Showing characters {offset}-{end} of {total}; end of page.]"]
    data = {
        "url": page.url,
        "status": page.status,
        "content_type": page.content_type,
        "total_chars": total,
        "nextOffset": next_offset,
        "truncated": page.truncated,
    }
    if page.status >= 400:
        return ToolResult.error(f"HTTP {page.status} {page.reason}\n" + "\n".join(lines), **data)
    return ToolResult.text("\n".join(lines), **data)


# -- web_search --------------------------------------------------------------------------


async def run_search(ctx: ToolContext, params: SearchParams) -> ToolResult:
    endpoint = ctx.config.web_search_url
    if not endpoint:
        return ToolResult.error(
            "Web search is not available: no search provider is configured on this server (web_search_url)."
        )
    if not 1 <= params.n <= MAX_SEARCH_RESULTS:
        return ToolResult.error(f"n must be between 1 and {MAX_SEARCH_RESULTS}, got {params.n}.")
    if not params.query.strip():
        return ToolResult.error("query is empty.")
    refusal = await ctx.authorize(Action.WEB, "web_search", {"query": params.query})
    if refusal is not None:
        return ToolResult.error(refusal)
    try:
        results = await search(endpoint, params.query, params.n)
    except TimeoutError:
        return ToolResult.error(
            f"The search provider did not answer within {SEARCH_TIMEOUT_SECONDS:g} seconds."
        )
    except (httpx.HTTPError, SearchFailed) as exc:
        return ToolResult.error(f"Web search failed: {exc}")
    if not results:
        return ToolResult.text(f"No results for {params.query!r}.", results=[])
    lines = []
    for i, r in enumerate(results, 1):
        lines.append(
            f"{i}. {r['title'] or r['url']}\n   {r['url']}" + (f"\n   {r['snippet']}" if r["snippet"] else "")
        )
    return ToolResult.text("\n".join(lines), results=results)


class SearchFailed(Exception):
    pass


async def search(endpoint: str, query: str, n: int) -> list[dict[str, str]]:
    """Ask the provider; its results, cleaned, at most `n`."""
    body = bytearray()
    async with (
        asyncio.timeout(SEARCH_TIMEOUT_SECONDS),
        httpx.AsyncClient(trust_env=False, timeout=SEARCH_TIMEOUT_SECONDS) as client,
        client.stream("GET", endpoint, params={"q": query, "n": n}) as response,
    ):
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_SEARCH_RESPONSE_BYTES:
                raise SearchFailed(f"the provider's answer is larger than {MAX_SEARCH_RESPONSE_BYTES} bytes")
    if response.status_code != 200:
        raise SearchFailed(f"the provider answered HTTP {response.status_code} {response.reason_phrase}")
    try:
        answer = json.loads(bytes(body))
    except ValueError as exc:
        raise SearchFailed(f"the provider's answer is not JSON ({exc})") from exc
    raw = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(raw, list):
        raise SearchFailed('the provider\'s answer has no "results" list')
    return [_result(item) for item in raw if isinstance(item, dict) and isinstance(item.get("url"), str)][:n]


def _result(item: dict[str, Any]) -> dict[str, str]:
    def field(name: str, limit: int | None = None) -> str:
        value = item.get(name)
        text = " ".join(value.split()) if isinstance(value, str) else ""
        return text[:limit] + "…" if limit is not None and len(text) > limit else text

    return {
        "title": field("title"),
        "url": item["url"].strip(),
        "snippet": field("snippet", MAX_SNIPPET_CHARS),
    }


def web_on(machine: Machine | None, config: ToolConfig) -> bool:
    """The tools' networking setting (`[tools] web`): off, nothing reaches the web from the server."""
    return config.web


def has_search_provider(machine: Machine | None, config: ToolConfig) -> bool:
    """`web_search` is offered only where the web is on and the server has a provider to ask."""
    return config.web and config.web_search_url is not None


WEB_FETCH = Tool(
    name="web_fetch",
    description=FETCH_DESCRIPTION,
    params=FetchParams,
    action=Action.WEB,
    run=run_fetch,
    machine=False,
    available=web_on,
)


WEB_SEARCH = Tool(
    name="web_search",
    description=SEARCH_DESCRIPTION,
    params=SearchParams,
    action=Action.WEB,
    run=run_search,
    machine=False,
    available=has_search_provider,
)

TOOLS: dict[str, Tool] = {t.name: t for t in (WEB_FETCH, WEB_SEARCH)}
