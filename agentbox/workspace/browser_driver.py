"""Playwright's client, talking to a driver that runs inside a machine.

Playwright's Python package drives browsers through its Node.js driver, which it normally
starts on the host and talks to over the driver's stdin and stdout (4-byte little-endian
length, then JSON). Here the driver is a command of the machine (`Browsing.browser_driver`),
so the driver and the Chromium it launches live in the sandbox's namespaces and cgroup,
and the server reaches them over the same pipe, through the machine's exec channel: no
port is opened anywhere. `ProcessTransport` is that pipe; `start` mirrors what
`playwright.async_api.async_playwright()` does with its own transport.

This leans on Playwright's internal client classes (`Transport`, `Connection`), which is why
pyproject.toml pins playwright to one minor release.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from playwright._impl.connection import Connection
from playwright._impl.transport import Transport
from playwright.async_api import Playwright

from agentbox.machines.base import ExecRequest, Machine, Process

#: Bytes of one message from the driver read at most (a full-page screenshot is the largest
#: message, base64 in JSON); a longer one ends the connection.
MAX_DRIVER_MESSAGE_BYTES = 64 * 1024 * 1024
#: Seconds the driver gets to exit after its stdin closes before it is killed.
DRIVER_EXIT_SECONDS = 5.0
#: Bytes of the driver's (and its browser's) stderr kept for error messages; the rest is drained.
STDERR_TAIL_BYTES = 4096


class DriverGone(Exception):
    """The driver's pipe closed or broke: the browser behind it is gone."""


class ProcessTransport(Transport):
    """Playwright's message pipe over a machine's `Process` (the driver's stdin and stdout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, process: Process) -> None:
        super().__init__(loop)
        self._process = process
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._stopped = False
        self._stopped_future: asyncio.Future[None] = loop.create_future()

    async def connect(self) -> None:
        self._writer = asyncio.ensure_future(self._write_all())

    async def _write_all(self) -> None:
        while (frame := await self._outbox.get()) is not None:
            try:
                await self._process.write_stdin(frame)
            except Exception as exc:  # the machine's channel broke: the reader sees EOF next
                self._fail(DriverGone(f"writing to the browser driver failed: {exc}"))
                return
        with contextlib.suppress(Exception):
            await self._process.close_stdin()

    def send(self, message: dict[str, Any]) -> None:
        data = self.serialize_message(message)
        self._outbox.put_nowait(len(data).to_bytes(4, "little") + data)

    async def run(self) -> None:
        stdout = self._process.stdout
        try:
            while not self._stopped:
                header = await stdout.readexactly(4)
                length = int.from_bytes(header, "little")
                if length > MAX_DRIVER_MESSAGE_BYTES:
                    raise DriverGone(f"the browser driver sent a message of {length} bytes")
                body = await stdout.readexactly(length)
                self.on_message(self.deserialize_message(body))
                await asyncio.sleep(0)  # one message per task, as the driver dispatches them
        except (asyncio.IncompleteReadError, ConnectionError, DriverGone) as exc:
            if not self._stopped:
                self._fail(exc if isinstance(exc, DriverGone) else DriverGone("the browser driver exited"))
        finally:
            self._outbox.put_nowait(None)
            if not self._stopped_future.done():
                self._stopped_future.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if not self.on_error_future.done():
            self.on_error_future.set_exception(exc)

    def request_stop(self) -> None:
        self._stopped = True
        self._outbox.put_nowait(None)

    async def wait_until_stopped(self) -> None:
        await self._stopped_future


class Driver:
    """One running driver and the Playwright client on it."""

    def __init__(self, process: Process, transport: ProcessTransport, connection: Connection) -> None:
        self.process = process
        self.transport = transport
        self.connection = connection
        self.playwright: Playwright | None = None
        self._reader: asyncio.Future[None] | None = None
        self.stderr_tail = b""
        self._drain = asyncio.ensure_future(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        """Read the driver's stderr as it comes (a full pipe would stop the driver), keeping its end."""
        with contextlib.suppress(Exception):
            while chunk := await self.process.stderr.read(65536):
                self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL_BYTES:]

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def close(self) -> None:
        """Close the pipe, give the driver a moment to take its browser down, then kill it."""
        self.transport.request_stop()
        try:
            await asyncio.wait_for(self.process.wait(), DRIVER_EXIT_SECONDS)
        except TimeoutError:
            self.process.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.process.wait(), DRIVER_EXIT_SECONDS)
        except Exception:
            self.process.kill()
        for task in (self._reader, self._drain):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self.connection.close()


async def start(machine: Machine, argv: tuple[str, ...], env: Mapping[str, str]) -> Driver:
    """Run the driver as a command of `machine` and open a Playwright client on its pipe."""
    loop = asyncio.get_running_loop()
    process = await machine.spawn(ExecRequest(argv=(*argv, "run-driver"), env=dict(env), interactive=True))
    connection = Connection(loop)
    transport = ProcessTransport(loop, process)
    driver = Driver(process, transport, connection)
    connection.onmessage = transport.send

    def on_message(message: Any) -> None:
        try:
            connection.dispatch(message)
        except Exception as error:
            connection._on_event_listener_error(error)

    transport.on_message = on_message
    await transport.connect()
    driver._reader = reader = asyncio.ensure_future(transport.run())
    reader.add_done_callback(lambda _: connection.close())
    initialize = asyncio.ensure_future(connection.initialize_playwright())
    done, _ = await asyncio.wait({initialize, transport.on_error_future}, return_when=asyncio.FIRST_COMPLETED)
    if initialize not in done:
        initialize.cancel()
        await driver.close()
        why = driver.stderr_tail.decode(errors="replace").strip() or str(
            transport.on_error_future.exception()
        )
        raise DriverGone(f"the browser driver did not start: {why}")
    from playwright.async_api._generated import Playwright as AsyncPlaywright

    driver.playwright = AsyncPlaywright(initialize.result())
    return driver
