"""`ChangeQueue`: the bounded queue behind a machine's own watch stream (ssh, e2b).

A watch kind fills it from its source (`_put` a change, `_fail` with the error that ends the
stream) and its reader iterates it. A reader slower than the source does not make it grow
without bound: past `MAX_QUEUED_CHANGES` one `overflow` change (with the watched path) says
changes were dropped, and the next ones are dropped until the reader has caught up.
"""

from __future__ import annotations

import asyncio
from typing import Self

from agentbox.machines.base import WatchChange

#: Changes a watch queues for a slow reader before it reports `overflow` and drops.
MAX_QUEUED_CHANGES = 10_000


class ChangeQueue:
    """Async iteration over queued `WatchChange`s; subclasses give `start` and `aclose`."""

    def __init__(self) -> None:
        self.target = ""
        """The watched path inside the machine (what an `overflow` names)."""
        self._queue: asyncio.Queue[WatchChange | BaseException] = asyncio.Queue()
        self._overflowed = False

    async def start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> WatchChange:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later call ends the same way
            raise item
        if self._queue.empty():
            self._overflowed = False
        return item

    def _put(self, change: WatchChange) -> None:
        if self._queue.qsize() >= MAX_QUEUED_CHANGES:
            if not self._overflowed:
                self._overflowed = True
                self._queue.put_nowait(WatchChange("overflow", self.target, True))
            return
        self._queue.put_nowait(change)

    def _fail(self, error: BaseException) -> None:
        """End the iteration with `error` once the changes before it are read."""
        self._queue.put_nowait(error)
