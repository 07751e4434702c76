"""Bodies are bounded while they arrive, not after: a real server's memory and disk stay put.

Measured on the server process itself (`VmHWM`, its peak resident set, from /proc): a tiny
gzip tar whose pax record claims 768 MiB, a JSON body far past `MAX_JSON_BODY`, and chunked
multipart uploads past the upload limit are each refused, and the peak grows by less than
`RSS_SLACK_BYTES`; the uploads are refused before the client has finished sending.
"""

from __future__ import annotations

import http.client as http_client
import json
import struct
import tarfile
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import Server, start_server, stop_server, traversable

from agentbox.api.envelope import MAX_JSON_BODY
from agentbox.api.files import MAX_UPLOAD_BODY_BYTES
from agentbox.api.v1_file import MULTIPART_SLACK_BYTES
from agentbox.workspace.files import MAX_UPLOAD_BYTES
from agentbox.workspace.tree import MAX_TAR_HEADER_BYTES, MAX_TREE_BYTES

#: Growth of the server's peak RSS a refused body may cause (the bombs below claim GiBs).
RSS_SLACK_BYTES = 100 * 1024 * 1024
#: What the pax record of the tar bomb claims (and, gzipped, really holds).
BOMB_RECORD_BYTES = 768 * 1024 * 1024
#: How far past its limit a refused body is offered; a server that reads it all is caught.
OVERSHOOT_BYTES = 256 * 1024 * 1024
#: Bytes a server may take past a limit before refusing (socket buffers, one chunk in flight).
READ_AHEAD_BYTES = 32 * 1024 * 1024
CHUNK = bytes(1024 * 1024)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of this module's own, so that another module's load does not move its peak."""
    home = traversable(tmp_path_factory.mktemp("bounds"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(home)
    yield s
    stop_server(s)


@pytest.fixture
def sandbox_url(server: Server) -> str:
    return f"{server.url}/sandboxes/b-{uuid.uuid4().hex[:10]}"


def peak_rss(server: Server) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def warm(sandbox_url: str) -> None:
    """Open the sandbox first, so its start-up does not count as the body's growth."""
    reply = httpx.post(f"{sandbox_url}/v2/fs/mkdir", json={"path": "/tmp/in", "parents": True}, timeout=60)
    assert reply.status_code == 200, reply.text


# ---------------------------------------------------------------- tar headers


def repeated_gzip(head: bytes, chunk: bytes, times: int, tail: bytes) -> bytes:
    """gzip of head + chunk * times + tail, built from one compressed chunk (a full flush
    resets the compressor, so every chunk compresses to the same bytes)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH) == block
    last = c.compress(tail) + c.flush(zlib.Z_FINISH)
    crc = zlib.crc32(head)
    for _ in range(times):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(tail, crc)
    size = len(head) + len(chunk) * times + len(tail)
    trailer = struct.pack("<II", crc & 0xFFFFFFFF, size & 0xFFFFFFFF)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + first + block * times + last + trailer


def header_block(kind: bytes, size: int, name: str = "././@PaxHeader") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(tarfile.USTAR_FORMAT)


@pytest.mark.parametrize(
    "kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK]
)
def test_tar_header_record_bomb_is_400_and_memory_stays(
    server: Server, sandbox_url: str, kind: bytes
) -> None:
    warm(sandbox_url)
    body = repeated_gzip(
        header_block(kind, BOMB_RECORD_BYTES), CHUNK, BOMB_RECORD_BYTES // len(CHUNK), bytes(1024)
    )
    assert len(body) < 1024 * 1024
    before = peak_rss(server)
    reply = httpx.put(f"{sandbox_url}/v2/fs/tree", params={"path": "/tmp/in/bomb"}, content=body, timeout=60)
    grown = peak_rss(server) - before
    assert grown < RSS_SLACK_BYTES, f"peak RSS grew by {grown >> 20} MiB"
    assert reply.status_code == 400, reply.text
    assert reply.json()["data"]["error_type"] == "bad_request"
    assert str(MAX_TAR_HEADER_BYTES) in reply.json()["message"]


def pax_record(size: int) -> bytes:
    """A valid pax extended header of exactly `size` bytes (one `comment` record)."""
    for digits in range(1, 10):
        text = b" comment=" + b"x" * (size - digits - len(b" comment=") - 1) + b"\n"
        record = str(size).encode() + text
        if len(record) == size:
            return record
    raise AssertionError(size)


@pytest.mark.parametrize("size, accepted", [(MAX_TAR_HEADER_BYTES, True), (MAX_TAR_HEADER_BYTES + 1, False)])
def test_tar_header_record_at_the_limit(sandbox_url: str, size: int, accepted: bool) -> None:
    record = pax_record(size)
    data = b"hello\n"
    body = (
        header_block(tarfile.XHDTYPE, len(record))
        + record
        + bytes(-len(record) % 512)
        + header_block(tarfile.REGTYPE, len(data), "note.txt")
        + data
        + bytes(-len(data) % 512)
        + bytes(1024)
    )
    path = f"/tmp/at-{size}"
    reply = httpx.put(f"{sandbox_url}/v2/fs/tree", params={"path": path}, content=body, timeout=60)
    if accepted:
        assert reply.status_code == 200, reply.text
        read = httpx.get(f"{sandbox_url}/v2/fs/read", params={"path": f"{path}/note.txt"}, timeout=60)
        assert read.json()["data"]["content"] == "hello\n"
    else:
        assert reply.status_code == 400, reply.text
        assert reply.json()["data"]["error_type"] == "bad_request"


# ---------------------------------------------------------------- JSON bodies


class Offered:
    """A chunked body generator that records how much of it the server took."""

    def __init__(self, head: bytes, total: int, tail: bytes = b"") -> None:
        self.head, self.total, self.tail = head, total, tail
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        self.sent += len(self.head)
        while self.sent < self.total:
            yield CHUNK
            self.sent += len(CHUNK)
        yield self.tail


def send(url: str, body: Offered, content_type: str) -> httpx.Response:
    with httpx.Client(timeout=60) as client:
        return client.post(url, content=iter(body), headers={"content-type": content_type})


def test_chunked_json_body_is_refused_while_reading(server: Server, sandbox_url: str) -> None:
    warm(sandbox_url)
    body = Offered(b'{"path": "/tmp/in/big", "content": "', MAX_JSON_BODY + OVERSHOOT_BYTES, b'"}')
    before = peak_rss(server)
    reply = send(f"{sandbox_url}/v2/fs/write", body, "application/json")
    grown = peak_rss(server) - before
    assert reply.status_code == 413, reply.text
    assert reply.json()["data"]["errno_name"] == "EFBIG"
    assert body.sent < MAX_JSON_BODY + READ_AHEAD_BYTES, f"the server read {body.sent >> 20} MiB"
    assert grown < RSS_SLACK_BYTES, f"peak RSS grew by {grown >> 20} MiB"


def declared(
    url: str, path: str, length: int, content_type: str, method: str = "POST"
) -> tuple[int, dict[str, Any]]:
    """Send only headers declaring `length` bytes; the answer must come without any body."""
    parts = urlsplit(url)
    conn = http_client.HTTPConnection(parts.hostname or "", parts.port, timeout=20)
    try:
        conn.putrequest(method, parts.path + path)
        conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("length", [MAX_JSON_BODY + 1, 1024**3])
def test_declared_json_length_past_the_limit_is_413_at_once(sandbox_url: str, length: int) -> None:
    status, reply = declared(sandbox_url, "/v2/fs/write", length, "application/json")
    assert status == 413 and reply["success"] is False, reply


def test_declared_tar_length_past_the_limit_is_413_at_once(sandbox_url: str) -> None:
    status, reply = declared(
        sandbox_url, "/v2/fs/tree?path=/tmp/in/t", MAX_TREE_BYTES + 1, "application/x-tar", "PUT"
    )
    assert status == 413 and reply["data"]["errno_name"] == "EFBIG", reply


def test_json_body_at_the_limit_is_read(sandbox_url: str) -> None:
    warm(sandbox_url)
    head, tail = b'{"path": "/tmp/in/edge", "content": "', b'"}'
    body = head + b"a" * (MAX_JSON_BODY - len(head) - len(tail)) + tail
    assert len(body) == MAX_JSON_BODY
    reply = httpx.post(
        f"{sandbox_url}/v2/fs/write", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    over = httpx.post(
        f"{sandbox_url}/v2/fs/write",
        content=body + b" ",
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert over.status_code == 413, over.text


# ---------------------------------------------------------------- multipart uploads

BOUNDARY = "agentboxbound"


def multipart(total: int) -> Offered:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="path"\r\n\r\n/tmp/in/up.bin\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="up.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    return Offered(head, total, f"\r\n--{BOUNDARY}--\r\n".encode())


@pytest.mark.parametrize(
    "route, limit",
    [
        ("/v2/fs/upload", MAX_UPLOAD_BYTES + MULTIPART_SLACK_BYTES),
        ("/v1/file/upload", MAX_UPLOAD_BYTES + MULTIPART_SLACK_BYTES),
        ("/v1/files", MAX_UPLOAD_BODY_BYTES),
    ],
)
def test_chunked_multipart_upload_is_refused_while_receiving(
    server: Server, sandbox_url: str, route: str, limit: int
) -> None:
    warm(sandbox_url)
    url = server.url + route if route == "/v1/files" else sandbox_url + route
    body = multipart(limit + OVERSHOOT_BYTES)
    reply = send(url, body, f"multipart/form-data; boundary={BOUNDARY}")
    assert body.sent < limit + READ_AHEAD_BYTES, (
        f"the server took {body.sent >> 20} MiB (limit {limit >> 20} MiB)"
    )
    assert reply.json()["success"] is False, reply.text
    assert reply.status_code == 413, reply.text
    listing = httpx.get(f"{sandbox_url}/v2/fs/list", params={"path": "/tmp/in"}, timeout=60).json()["data"]
    assert all(".part" not in e["name"] and e["name"] != "up.bin" for e in listing["files"]), listing
