"""Chromium's DevTools protocol, reached through the machine the browser runs in.

Chromium listens for DevTools clients on 127.0.0.1:`CDP_PORT` inside the sandbox's own
network namespace, which the server cannot reach. Each connection to it is a relay: a
small python3 program (`RELAY`) run as a command of the machine, joining its stdin and
stdout to one TCP connection to that port. Over that byte pipe the server speaks HTTP (the
`/json` endpoints: `fetch_json`) or the WebSocket client protocol (`websockets`' sans-I/O
`ClientProtocol`: `DevtoolsSocket`), so no port is opened anywhere and the browser's own
network policy is untouched.

Bounds: a `/json` answer of at most `MAX_JSON_REPLY_BYTES` (`MAX_JSON_EXCHANGES` at once per
browser, the rest wait), a WebSocket message of at most `MAX_CDP_MESSAGE_BYTES` either way,
and `MAX_CDP_CONNECTIONS` WebSockets at once per browser (`Cdp.socket` refuses the next
with `conflict`). A relay that cannot connect (no
Chromium listening) is `browser_unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from agentbox.machines.base import ExecRequest, Machine, Process
from agentbox.machines.errors import MachineError
from agentbox.workspace.browser import CDP_PORT, Browser, error

#: WebSocket connections to one browser's DevTools at once.
MAX_CDP_CONNECTIONS = 8
#: Bytes of one DevTools message either way (a full-page screenshot, base64, is the largest).
MAX_CDP_MESSAGE_BYTES = 32 * 1024 * 1024
#: Bytes of an answer of Chromium's `/json` endpoints read at most.
MAX_JSON_REPLY_BYTES = 1024 * 1024
#: Seconds a relay gets to connect and an HTTP exchange or WebSocket handshake to finish.
EXCHANGE_TIMEOUT_SECONDS = 10.0
#: Bytes of a relay's stderr quoted when it could not connect.
STDERR_BYTES = 4096
#: Bytes read from a relay's stdout at a time.
READ_CHUNK_BYTES = 64 * 1024
#: `/json` exchanges with one browser at once (each is a relay of its own); more wait their turn.
MAX_JSON_EXCHANGES = 4
#: The exit code of a relay that could not connect, and of a machine without python3.
RELAY_REFUSED = 3
NOT_FOUND_EXIT = 127
#: The `/json` paths Chromium serves that the endpoint passes on.
JSON_PATHS = ("/json/version", "/json/list")

#: The relay: argv[1] is the port. Connects, then copies stdin to the socket (half-closing it
#: at EOF) and the socket to stdout until Chromium closes; exits RELAY_REFUSED if it cannot connect.
RELAY = f"""
import os, socket, sys, threading
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout={EXCHANGE_TIMEOUT_SECONDS})
except OSError as e:
    sys.stderr.write(f"cannot connect to 127.0.0.1:{{sys.argv[1]}}: {{e}}\\n")
    sys.exit({RELAY_REFUSED})
s.settimeout(None)
def up():
    while True:
        b = os.read(0, {READ_CHUNK_BYTES})
        if not b:
            break
        s.sendall(b)
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
out = sys.stdout.buffer
while True:
    try:
        b = s.recv({READ_CHUNK_BYTES})
    except OSError:
        break
    if not b:
        break
    out.write(b)
    out.flush()
"""


class Relay:
    """One TCP connection to Chromium's DevTools port, as a command of the machine."""

    def __init__(self, process: Process) -> None:
        self.process = process

    @classmethod
    async def open(cls, machine: Machine, port: int = CDP_PORT) -> Relay:
        argv = ("python3", "-c", RELAY, str(port))
        try:
            process = await machine.spawn(ExecRequest(argv=argv, interactive=True))
        except MachineError as exc:
            raise error("browser_unavailable", f"cannot reach the browser's DevTools: {exc}") from None
        return cls(process)

    async def write(self, data: bytes) -> None:
        await self.process.write_stdin(data)

    async def read(self) -> bytes:
        """The next bytes from Chromium; b"" once the connection is closed."""
        return await self.process.stdout.read(READ_CHUNK_BYTES)

    async def refused(self) -> str:
        """Why the connection ended before any byte came: the relay's own message."""
        with contextlib.suppress(Exception):
            code = await asyncio.wait_for(self.process.wait(), EXCHANGE_TIMEOUT_SECONDS)
            why = (await self.process.stderr.read(STDERR_BYTES)).decode(errors="replace").strip()
            if code == RELAY_REFUSED:
                return why or "the DevTools port refused the connection"
            if code == NOT_FOUND_EXIT:
                return "the machine has no python3, which the DevTools relay runs on"
            return why or f"the relay exited with {code}"
        return "the DevTools connection closed"

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.process.close_stdin()
        self.process.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.process.wait(), EXCHANGE_TIMEOUT_SECONDS)


async def fetch_json(machine: Machine, path: str) -> Any:
    """GET `path` of Chromium's DevTools HTTP server inside `machine`, parsed as JSON."""
    relay = await Relay.open(machine)
    try:
        return await asyncio.wait_for(_exchange(relay, path), EXCHANGE_TIMEOUT_SECONDS)
    except TimeoutError:
        raise error("timeout", f"the browser's DevTools did not answer {path} in time") from None
    finally:
        await relay.close()


async def _exchange(relay: Relay, path: str) -> Any:
    # Chromium answers only a Host that is an IP address or localhost.
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{CDP_PORT}\r\nConnection: close\r\n\r\n"
    await relay.write(request.encode())
    raw = b""
    while (chunk := await relay.read()) and len(raw) <= MAX_JSON_REPLY_BYTES:
        raw += chunk
        head, sep, body = raw.partition(b"\r\n\r\n")
        length = content_length(head) if sep else None
        if length is not None and len(body) >= length:
            break
    if not raw:
        raise error(
            "browser_unavailable", f"the browser's DevTools are not reachable: {await relay.refused()}"
        )
    if len(raw) > MAX_JSON_REPLY_BYTES:
        raise error(
            "browser_unavailable", f"the browser's answer to {path} is over {MAX_JSON_REPLY_BYTES} bytes"
        )
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode(errors="replace")
    if " 200 " not in f"{status} ":
        raise error("browser_unavailable", f"the browser answered {path} with {status!r}")
    try:
        return json.loads(body)
    except ValueError:
        raise error("browser_unavailable", f"the browser's answer to {path} is not JSON") from None


def content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return None


@dataclass
class Message:
    """One whole WebSocket message (fragments joined): text or binary."""

    text: bool
    data: bytes


class DevtoolsSocket:
    """A WebSocket client to one DevTools path (`/devtools/browser/<id>`, `/devtools/page/<id>`)."""

    def __init__(self, relay: Relay, protocol: ClientProtocol) -> None:
        self.relay = relay
        self.protocol = protocol
        self._writing = asyncio.Lock()
        self._pending: list[Message] = []
        self._fragments: list[Frame] = []

    @classmethod
    async def connect(cls, machine: Machine, path: str) -> DevtoolsSocket:
        relay = await Relay.open(machine)
        protocol = ClientProtocol(
            parse_uri(f"ws://127.0.0.1:{CDP_PORT}{path}"), max_size=MAX_CDP_MESSAGE_BYTES
        )
        socket = cls(relay, protocol)
        try:
            await asyncio.wait_for(socket._handshake(), EXCHANGE_TIMEOUT_SECONDS)
        except TimeoutError:
            await relay.close()
            raise error("timeout", f"the browser's DevTools did not accept {path} in time") from None
        except BaseException:
            await relay.close()
            raise
        return socket

    async def _handshake(self) -> None:
        self.protocol.send_request(self.protocol.connect())
        await self._flush()
        while True:
            chunk = await self.relay.read()
            if not chunk:
                why = await self.relay.refused()
                raise error("browser_unavailable", f"the browser's DevTools closed the connection: {why}")
            self.protocol.receive_data(chunk)
            for event in self.protocol.events_received():
                if isinstance(event, Response):
                    if self.protocol.handshake_exc is not None:
                        raise error("not_found", f"the browser refused the DevTools connection "
                                    f"({event.status_code}): no such target?")  # fmt: skip
                    continue
                self._take(event)
            if self.protocol.handshake_exc is None and self.protocol.state is State.OPEN:
                return

    def _take(self, frame: object) -> None:
        """Collect data frames into whole messages (control frames are the protocol's)."""
        if isinstance(frame, Frame) and frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
            self._fragments.append(frame)
            if frame.fin:
                first = self._fragments[0]
                data = b"".join(f.data for f in self._fragments)
                self._fragments.clear()
                self._pending.append(Message(first.opcode == Opcode.TEXT, data))

    async def _flush(self) -> None:
        async with self._writing:
            for data in self.protocol.data_to_send():
                if data:
                    await self.relay.write(data)
                else:  # the protocol is done sending: half-close toward Chromium
                    with contextlib.suppress(Exception):
                        await self.relay.process.close_stdin()

    async def send(self, message: Message) -> None:
        if len(message.data) > MAX_CDP_MESSAGE_BYTES:
            raise error("bad_request", f"a DevTools message of {len(message.data)} bytes is over "
                        f"{MAX_CDP_MESSAGE_BYTES}")  # fmt: skip
        if message.text:
            self.protocol.send_text(message.data)
        else:
            self.protocol.send_binary(message.data)
        await self._flush()

    async def messages(self) -> AsyncIterator[Message]:
        """Chromium's messages until it closes the connection (or breaks the protocol)."""
        while True:
            while self._pending:
                yield self._pending.pop(0)
            chunk = await self.relay.read()
            if not chunk:
                self.protocol.receive_eof()
            else:
                self.protocol.receive_data(chunk)
            for event in self.protocol.events_received():
                self._take(event)
            await self._flush()
            if not chunk or self.protocol.close_expected() or self.protocol.state is State.CLOSED:
                while self._pending:
                    yield self._pending.pop(0)
                return

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.protocol.state is State.OPEN:
                self.protocol.send_close()
                await self._flush()
        await self.relay.close()


class Cdp:
    """One browser's DevTools endpoint: its `/json` answers and at most `MAX_CDP_CONNECTIONS`
    WebSockets at once. Each use starts the browser if it is not running, and traffic counts
    as use, so the browser is not stopped as idle under a DevTools client."""

    def __init__(self, browser: Browser, limit: int = MAX_CDP_CONNECTIONS) -> None:
        self.browser = browser
        self.limit = limit
        self.open = 0
        self._exchanges = asyncio.Semaphore(MAX_JSON_EXCHANGES)

    async def json(self, path: str) -> Any:
        """Chromium's answer to one of `JSON_PATHS`."""
        if path not in JSON_PATHS:
            raise error("not_found", f"the DevTools endpoint serves {', '.join(JSON_PATHS)}, not {path}")
        await self.browser.ensure()
        self.touch()
        async with self._exchanges:
            return await fetch_json(self.browser.machine, path)

    @contextlib.asynccontextmanager
    async def socket(self, path: str) -> AsyncIterator[DevtoolsSocket]:
        """A WebSocket to `path` (`/devtools/...`), counted against the limit while it is open."""
        if not path.startswith("/devtools/") or any(c in path for c in "\r\n ?#"):
            raise error("not_found", f"{path[:100]!r} is not a DevTools WebSocket path (/devtools/...)")
        if self.open >= self.limit:
            raise error("conflict", f"{self.limit} DevTools connections are open to this browser, "
                        "the most there may be: close one first")  # fmt: skip
        self.open += 1
        try:
            await self.browser.ensure()
            socket = await DevtoolsSocket.connect(self.browser.machine, path)
            try:
                yield socket
            finally:
                await socket.close()
        finally:
            self.open -= 1

    def touch(self) -> None:
        self.browser.last_used = time.monotonic()
