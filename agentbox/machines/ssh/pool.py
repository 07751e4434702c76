"""`ConnectionPool`: the connections to one sshd, each carrying a bounded number of channels."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import asyncssh

from agentbox.machines.errors import MachineUnavailable

#: Connections one machine holds at most, so commands beyond MAX_CONNECTIONS * max_sessions wait.
MAX_CONNECTIONS = 8
#: Seconds a command waits for a free channel while every connection is full.
CHANNEL_WAIT_SECONDS = 30.0
#: Seconds a connection beyond the first stays open with no channel in use.
SPARE_IDLE_SECONDS = 30.0
#: Seconds `close` waits for each connection to end.
CLOSE_TIMEOUT = 5.0


class Link:
    """One SSH connection and how many of its channels are in use."""

    def __init__(self, conn: asyncssh.SSHClientConnection, capacity: int) -> None:
        self.conn = conn
        self.capacity = capacity
        self.in_use = 0
        self.spare_timer: asyncio.TimerHandle | None = None

    @property
    def closed(self) -> bool:
        return self.conn.is_closed()

    def has_room(self) -> bool:
        return not self.closed and self.in_use < self.capacity


class ConnectionPool:
    """Connections to one sshd, opened as channels need them; each carries `capacity` channels.

    A caller leases one channel's room (`acquire`) and gives it back (`release`) when its
    channel has closed. Connections are opened one at a time; a failed connect is the answer
    for every caller that was waiting on it, so a dead host costs one connect timeout, not
    one per waiting command.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncssh.SSHClientConnection]],
        capacity: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        wait_seconds: float = CHANNEL_WAIT_SECONDS,
        spare_idle: float = SPARE_IDLE_SECONDS,
        on_lost: Callable[[Link], None] | None = None,
    ) -> None:
        self._connect = connect
        self.capacity = capacity
        self.max_connections = max_connections
        self.wait_seconds = wait_seconds
        """Seconds `acquire` waits for room while every connection is full."""
        self.spare_idle = spare_idle
        """Seconds a connection other than the first stays open with no channel in use."""
        self.links: list[Link] = []
        self._on_lost = on_lost
        self._lock = asyncio.Lock()
        self._freed = asyncio.Event()
        self._failure: tuple[float, BaseException] | None = None
        self._watchers: set[asyncio.Task[None]] = set()

    def live(self) -> list[Link]:
        return [link for link in self.links if not link.closed]

    def _with_room(self) -> Link | None:
        return next((link for link in self.links if link.has_room()), None)

    async def acquire(self) -> Link:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_seconds
        while True:
            link = self._with_room()
            if link is None and len(self.live()) < self.max_connections:
                link = await self._open(loop.time())
            if link is not None:
                self._take(link)
                return link
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MachineUnavailable(
                    f"all {self.max_connections * self.capacity} channels to the host are busy "
                    f"(waited {self.wait_seconds:g} s)"
                )
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)

    async def _open(self, asked: float) -> Link | None:
        async with self._lock:
            link = self._with_room()
            if link is not None or len(self.live()) >= self.max_connections:
                return link
            if self._failure is not None and self._failure[0] >= asked:
                # the connect this caller waited for failed: the same answer, no second wait
                raise MachineUnavailable(str(self._failure[1]))
            try:
                conn = await self._connect()
            except BaseException as exc:
                self._failure = (asyncio.get_running_loop().time(), exc)
                raise
            link = Link(conn, self.capacity)
            self.links.append(link)
            watcher = asyncio.ensure_future(self._watch(link))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            return link

    async def _watch(self, link: Link) -> None:
        await link.conn.wait_closed()
        self.discard(link)

    def _take(self, link: Link) -> None:
        link.in_use += 1
        if link.spare_timer is not None:
            link.spare_timer.cancel()
            link.spare_timer = None

    def release(self, link: Link) -> None:
        link.in_use -= 1
        self._freed.set()
        live = self.live()
        if link.in_use == 0 and live and link is not live[0] and not link.closed:
            loop = asyncio.get_running_loop()
            link.spare_timer = loop.call_later(self.spare_idle, self._close_spare, link)

    def refuse(self, link: Link) -> None:
        """The sshd refused a channel below our count: its MaxSessions is lower; believe it."""
        link.capacity = self.capacity = max(1, link.in_use - 1)

    def _close_spare(self, link: Link) -> None:
        if link.in_use == 0:
            link.conn.close()

    def discard(self, link: Link) -> None:
        """Forget a connection that dropped (or is being dropped)."""
        if link in self.links:
            self.links.remove(link)
            link.conn.close()
            if self._on_lost is not None:
                self._on_lost(link)
        self._freed.set()

    async def close(self) -> None:
        links, self.links = self.links, []
        for link in links:
            link.conn.close()
        for link in links:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.conn.wait_closed(), CLOSE_TIMEOUT)
        for watcher in list(self._watchers):
            watcher.cancel()
        self._failure = None
