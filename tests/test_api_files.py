"""The files API (`/v1/files`, seed 000) against a real `agentbox serve`.

Every upload goes over loopback HTTP into the server's SQLite file and blobs folder; the
100 MiB cases stream their bodies from generators, so this process holds one chunk at a time.
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from conftest import Server, start_server, stop_server, traversable

from agentbox.api.files import LIST_LIMIT_MAX, MAX_FORM_FIELDS, MAX_UPLOAD_BODY_BYTES, MULTIPART_SLACK_BYTES
from agentbox.api.v2_fs import attachment
from agentbox.store.files import BLOBS_DIR_NAME, MAX_FILE_BYTES

#: Bytes per chunk of a generated body.
CHUNK = 1024 * 1024
#: Multipart boundary of the hand-built bodies.
BOUNDARY = "agentbox-test-boundary"
#: Seconds a raw-socket exchange may take.
SOCKET_TIMEOUT = 60.0


def new_session() -> str:
    return f"files-{uuid.uuid4().hex[:12]}"


def upload(client: httpx.Client, name: str, data: bytes, session_id: str | None = None) -> httpx.Response:
    form = {"session_id": session_id} if session_id else None
    return client.post("/v1/files", files={"file": (name, data)}, data=form)


def listed(client: httpx.Client, **params: Any) -> dict[str, Any]:
    response = client.get("/v1/files", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def blob_entries(server: Server) -> set[str]:
    """Every file below the blobs folder (blobs and any `.part-*` leftovers), relative."""
    root = server.home / BLOBS_DIR_NAME
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


def deleted_open_files(server: Server) -> set[str]:
    """Files the server process holds open that are unlinked (a spooled upload is one)."""
    fds = Path(f"/proc/{server.process.pid}/fd")
    held = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.endswith("(deleted)"):
            held.add(target)
    return held


# ---------------------------------------------------------------- hand-built multipart bodies


def part_head(name: str, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()


def body_head(filename: str, fields: dict[str, str]) -> bytes:
    """Everything of a body before the file's bytes: the fields, then the file part's header."""
    parts = [part_head(k) + v.encode() + b"\r\n" for k, v in fields.items()]
    return b"".join(parts) + part_head("file", filename)


BODY_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


def filler(size: int, fill: int) -> Iterator[bytes]:
    chunk = bytes([fill]) * CHUNK
    while size > 0:
        yield chunk[: min(size, CHUNK)]
        size -= CHUNK


def sha256_of(chunks: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def multipart_headers(length: int | None = None) -> dict[str, str]:
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    if length is not None:
        headers["Content-Length"] = str(length)
    return headers


def raw_exchange(server: Server, head: bytes, body: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """Send bytes as they are, then read the response to the end: (status, body)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT) as sock:
        sock.sendall(head)
        for chunk in body:
            sock.sendall(chunk)
        received = b""
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            assert data, f"connection closed before a response: {received!r}"
            received += data
        header_block, rest = received.split(b"\r\n\r\n", 1)
        lines = header_block.decode("latin-1").split("\r\n")
        length = next(
            int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"
        )
        while len(rest) < length:
            data = sock.recv(65536)
            assert data, "connection closed in the middle of the response body"
            rest += data
        return int(lines[0].split()[1]), rest[:length]


def request_head(server: Server, extra: dict[str, str]) -> bytes:
    lines = ["POST /v1/files HTTP/1.1", f"Host: {server.url.removeprefix('http://')}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ---------------------------------------------------------------- the life of a file


def test_upload_get_download_list_delete(server: Server) -> None:
    session = new_session()
    binary = bytes(range(256)) * 17 + b"\x00\xff\r\n"
    names_and_bodies = [("résumé 数据.bin", binary), ("notes.txt", b"hello\n"), ("empty.csv", b"")]
    with server.client() as client:
        records = []
        for name, data in names_and_bodies:
            response = upload(client, name, data, session)
            assert response.status_code == 201, response.text
            records.append(response.json())

        first = records[0]
        assert first["id"].startswith("file_")
        assert first["filename"] == "résumé 数据.bin"
        assert first["bytes"] == len(binary)
        assert first["sha256"] == hashlib.sha256(binary).hexdigest()
        assert first["session_id"] == session and first["source"] == "upload" and first["created_at"]
        assert client.get(f"/v1/files/{first['id']}").json() == first

        for record, (name, data) in zip(records, names_and_bodies, strict=True):
            got = client.get(f"/v1/files/{record['id']}/content")
            assert got.status_code == 200
            assert got.content == data
            assert got.headers["content-length"] == str(len(data))
            assert got.headers["content-disposition"].endswith(f"filename*=UTF-8''{quote(name, safe='')}")
        headers = client.get(f"/v1/files/{first['id']}/content").headers
        assert "filename*=UTF-8''r%C3%A9sum%C3%A9%20%E6%95%B0%E6%8D%AE.bin" in headers["content-disposition"]
        assert headers["content-type"] == "application/octet-stream"
        assert client.get(f"/v1/files/{records[1]['id']}/content").headers["content-type"] == "text/plain"

        page = listed(client, session_id=session)
        assert [r["id"] for r in page["items"]] == [r["id"] for r in reversed(records)]
        assert page["items"][0] == records[-1] and page["has_more"] is False
        assert {r["id"] for r in records} <= {r["id"] for r in listed(client, limit=LIST_LIMIT_MAX)["items"]}

        gone = client.delete(f"/v1/files/{first['id']}")
        assert gone.status_code == 200 and gone.json() == {"id": first["id"], "deleted": True}
        for path in (f"/v1/files/{first['id']}", f"/v1/files/{first['id']}/content"):
            missing = client.get(path)
            assert missing.status_code == 404
            assert missing.json()["success"] is False
            assert missing.json()["data"]["error_type"] == "not_found"
        assert client.delete(f"/v1/files/{first['id']}").status_code == 404
        assert [r["id"] for r in listed(client, session_id=session)["items"]] == [
            records[2]["id"],
            records[1]["id"],
        ]
        assert not (server.home / BLOBS_DIR_NAME / first["sha256"][:2] / first["sha256"]).exists()


def test_ranges_of_the_content(server: Server) -> None:
    data = bytes(range(100))
    with server.client() as client:
        file_id = upload(client, "r.bin", data).json()["id"]
        part = client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=10-19"})
        assert part.status_code == 206 and part.content == data[10:20]
        assert part.headers["content-range"] == "bytes 10-19/100"
        assert client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=-5"}).content == data[-5:]
        outside = client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=100-"})
        assert outside.status_code == 416 and outside.headers["content-range"] == "bytes */100"
        assert client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=99-"}).content == data[99:]


def test_same_bytes_twice_share_one_blob(server: Server) -> None:
    data = uuid.uuid4().bytes * 100
    with server.client() as client:
        one, two = (upload(client, name, data).json() for name in ("a.bin", "b.bin"))
        assert one["id"] != two["id"] and one["sha256"] == two["sha256"]
        blob = server.home / BLOBS_DIR_NAME / one["sha256"][:2] / one["sha256"]
        assert [p for p in blob_entries(server) if one["sha256"] in p] == [
            f"{one['sha256'][:2]}/{one['sha256']}"
        ]
        assert client.delete(f"/v1/files/{one['id']}").status_code == 200
        assert blob.exists() and client.get(f"/v1/files/{two['id']}/content").content == data
        assert client.delete(f"/v1/files/{two['id']}").status_code == 200
        assert not blob.exists()


def test_list_pages_newest_first(server: Server) -> None:
    session = new_session()
    with server.client() as client:
        ids = [upload(client, f"{i}.txt", b"x", session).json()["id"] for i in range(3)]
        first = listed(client, session_id=session, limit=2)
        assert [r["id"] for r in first["items"]] == [ids[2], ids[1]]
        assert first["has_more"] is True and first["next_after"] == ids[1]
        second = listed(client, session_id=session, limit=2, after=first["next_after"])
        assert [r["id"] for r in second["items"]] == [ids[0]]
        assert second["has_more"] is False and second["next_after"] is None
        assert listed(client, session_id=session, limit=LIST_LIMIT_MAX)["has_more"] is False
        assert listed(client, session_id="files-never-used") == {
            "items": [],
            "has_more": False,
            "next_after": None,
        }
        for params in ({"limit": LIST_LIMIT_MAX + 1}, {"limit": 0}, {"after": "not-a-file-id"}):
            assert client.get("/v1/files", params=params).status_code == 400, params


def test_bad_forms_are_422_in_the_envelope(server: Server) -> None:
    with server.client() as client:
        missing = client.post("/v1/files", files={"other": ("a.txt", b"x")})
        assert missing.status_code == 422
        assert missing.json()["errors"][0]["location"] == ["body", "file"]
        assert missing.json()["success"] is False
        assert client.post("/v1/files", json={"file": "x"}).status_code == 422
        assert client.post("/v1/files", data={"file": "not a file part"}).status_code == 422
        two = [("file", ("a.txt", b"a")), ("file", ("b.txt", b"b"))]
        assert client.post("/v1/files", files=two).status_code == 422
        bad_session = client.post("/v1/files", files={"file": ("a.txt", b"x")}, data={"session_id": "../x"})
        assert bad_session.status_code == 422
        assert bad_session.json()["errors"][0]["location"] == ["body", "session_id"]
        assert upload(client, "..", b"x").status_code == 422
        assert upload(client, "é" * 128, b"x").status_code == 422  # 256 bytes of UTF-8
        assert upload(client, "é" * 127 + "a", b"x").status_code == 201  # 255: the longest name
        nested = upload(client, "some/dir/kept-name.txt", b"x")
        assert nested.status_code == 201 and nested.json()["filename"] == "kept-name.txt"


def test_form_field_limits(server: Server) -> None:
    """Unknown fields are ignored, up to MAX_FORM_FIELDS of them, each up to MULTIPART_SLACK_BYTES."""
    one_file = {"file": ("a.txt", b"x")}
    with server.client() as client:
        fields = {f"f{i}": "v" for i in range(MAX_FORM_FIELDS)}
        assert client.post("/v1/files", files=one_file, data=fields).status_code == 201
        fields["one-more"] = "v"
        assert client.post("/v1/files", files=one_file, data=fields).status_code == 422
        big = {"note": "n" * MULTIPART_SLACK_BYTES}
        assert client.post("/v1/files", files=one_file, data=big).status_code == 201
        big["note"] += "n"
        assert client.post("/v1/files", files=one_file, data=big).status_code == 422


def test_content_disposition_survives_control_characters() -> None:
    """Deliveries may carry any name a file system allows, a newline included."""
    header = attachment('line\nbreak "q" é.txt')
    assert all(" " <= c < "\x7f" for c in header)
    assert header.endswith("filename*=UTF-8''line%0Abreak%20%22q%22%20%C3%A9.txt")


# ---------------------------------------------------------------- the 100 MiB boundary


def test_a_body_of_exactly_the_limit_with_a_max_size_file_is_stored(server: Server) -> None:
    session = new_session()
    head = body_head("max.bin", {"session_id": session})
    pad = MAX_UPLOAD_BODY_BYTES - MAX_FILE_BYTES - len(head) - len(BODY_TAIL) - len(part_head("pad")) - 2
    assert 0 < pad < MULTIPART_SLACK_BYTES
    head = body_head("max.bin", {"session_id": session, "pad": "p" * pad})
    assert len(head) + MAX_FILE_BYTES + len(BODY_TAIL) == MAX_UPLOAD_BODY_BYTES

    def body() -> Iterator[bytes]:
        yield head
        yield from filler(MAX_FILE_BYTES, 0x5A)
        yield BODY_TAIL

    with server.client() as client:
        response = client.post("/v1/files", content=body(), headers=multipart_headers(MAX_UPLOAD_BODY_BYTES))
        assert response.status_code == 201, response.text
        record = response.json()
        assert record["bytes"] == MAX_FILE_BYTES and record["session_id"] == session
        assert record["sha256"] == sha256_of(filler(MAX_FILE_BYTES, 0x5A))
        with client.stream("GET", f"/v1/files/{record['id']}/content") as download:
            assert download.headers["content-length"] == str(MAX_FILE_BYTES)
            assert sha256_of(download.iter_bytes(CHUNK)) == record["sha256"]
        assert client.delete(f"/v1/files/{record['id']}").status_code == 200


def test_one_byte_over_the_file_limit_is_413_and_nothing_is_stored(server: Server) -> None:
    session = new_session()
    head = body_head("over.bin", {"session_id": session})
    blobs_before, held_before = blob_entries(server), deleted_open_files(server)

    def body() -> Iterator[bytes]:
        yield head
        yield from filler(MAX_FILE_BYTES + 1, 0xA5)
        yield BODY_TAIL

    length = len(head) + MAX_FILE_BYTES + 1 + len(BODY_TAIL)
    assert length <= MAX_UPLOAD_BODY_BYTES  # so the store, not the body limit, refuses it
    with server.client() as client:
        response = client.post("/v1/files", content=body(), headers=multipart_headers(length))
        assert response.status_code == 413, response.text
        assert response.json()["data"]["error_type"] == "too_large"
        assert listed(client, session_id=session)["items"] == []
    assert blob_entries(server) == blobs_before  # no blob, no `.part-*`
    assert deleted_open_files(server) <= held_before  # the spooled upload is closed too


def test_a_declared_length_over_the_body_limit_is_refused_before_the_body(server: Server) -> None:
    """curl sends `Expect: 100-continue` for large bodies: it gets the 413 and sends nothing."""
    headers = multipart_headers(MAX_UPLOAD_BODY_BYTES + 1) | {"Expect": "100-continue"}
    status, body = raw_exchange(server, request_head(server, headers))
    assert status == 413 and b"too_large" in body


def test_a_body_without_a_length_is_cut_off_past_the_body_limit(server: Server) -> None:
    session = new_session()
    head = body_head("endless.bin", {"session_id": session})
    blobs_before, held_before = blob_entries(server), deleted_open_files(server)

    def chunked() -> Iterator[bytes]:
        """MAX_UPLOAD_BODY_BYTES + 1 bytes of body, chunked, the last one the byte too many.

        Nothing follows it (no closing boundary, no last chunk): the server has read every
        byte sent when it answers, so it closes the connection cleanly.
        """
        for piece in (head, *filler(MAX_UPLOAD_BODY_BYTES + 1 - len(head), 0x3C)):
            yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"

    headers = multipart_headers() | {"Transfer-Encoding": "chunked"}
    status, body = raw_exchange(server, request_head(server, headers), chunked())
    assert status == 413 and b"too_large" in body
    with server.client() as client:
        assert listed(client, session_id=session)["items"] == []
    assert blob_entries(server) == blobs_before
    assert deleted_open_files(server) <= held_before


# ---------------------------------------------------------------- auth


def test_the_api_key_applies(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    home = traversable(tmp_path, tmp_path_factory) / "home"
    home.mkdir()
    keyed = start_server(home, {"AGENTBOX_API_KEY": "files-secret"})
    try:
        with httpx.Client(base_url=keyed.url, timeout=30) as anonymous:
            assert anonymous.post("/v1/files", files={"file": ("a.txt", b"x")}).status_code == 401
            assert anonymous.get("/v1/files").status_code == 401
        with keyed.client() as client:
            record = upload(client, "a.txt", b"x").json()
            assert client.get(f"/v1/files/{record['id']}/content").content == b"x"
        with httpx.Client(base_url=keyed.url, timeout=30) as anonymous:
            assert anonymous.get(f"/v1/files/{record['id']}").status_code == 401
            assert anonymous.get(f"/v1/files/{record['id']}/content").status_code == 401
            assert anonymous.delete(f"/v1/files/{record['id']}").status_code == 401
    finally:
        stop_server(keyed)
