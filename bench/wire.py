"""A lean HTTP/1.1 client for timing servers: one keep-alive socket, JSON in, JSON out.

httpx spends about 0.6 ms of the client's own CPU on each request on the 2-core bench host
(`GET /health` against `agentbox serve`: 0.91 to 1.03 ms through httpx, 0.47 ms through
`http.client`, 0.25 ms through this). Beside servers that answer in well under a millisecond,
that is most of every figure, and the same on both sides of a comparison, so it squeezes
every ratio toward 1. The side-by-side rows use this client for both servers; their httpx
twins are kept beside them.

It speaks only what both servers answer with: a status line, headers, and a body of
`Content-Length` bytes. A chunked or unsized reply, or a closed connection, is an error.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlencode, urlsplit

#: Bytes asked of `recv` at a time; a reply up to this size takes one system call.
RECV_BYTES = 1 << 16
#: The longest head (status line and headers) read before giving up on a reply.
MAX_HEAD = 1 << 16


class WireError(Exception):
    """A reply this client does not read (no length, chunked, cut short)."""


class Wire:
    """One keep-alive connection to `url` (http only), with `headers` on every request."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"not an http:// URL: {url}")
        self.host = f"{parts.hostname}:{parts.port or 80}"
        self.sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.pending = b""

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """Send one request; the reply's status and its body parsed as JSON."""
        if params:
            path = f"{path}?{urlencode(params)}"
        body = b"" if json_body is None else json.dumps(json_body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.fixed}"
        if json_body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)
        status, payload = self._reply()
        return status, json.loads(payload) if payload else None

    def _reply(self) -> tuple[int, bytes]:
        data = self.pending
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > MAX_HEAD:
                raise WireError("the reply's head is too long")
            data += self._recv()
        lines = data[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        if "content-length" not in fields:
            raise WireError(f"a reply without Content-Length: {lines}")
        stop = end + 4 + int(fields["content-length"])
        while len(data) < stop:
            data += self._recv()
        self.pending = data[stop:]
        return status, data[end + 4 : stop]

    def _recv(self) -> bytes:
        chunk = self.sock.recv(RECV_BYTES)
        if not chunk:
            raise WireError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()
