"""`SharedRun`: one run of a coroutine at a time, shared by everyone who asks meanwhile.

A machine's teardown is asked for by the idle reaper, a closing session and the server's
shutdown, sometimes at once; each must wait for the same teardown rather than start another
over a half-stopped machine, and a start must wait for a teardown still under way. The run
is shielded: a caller cancelled while waiting does not cancel the teardown others rely on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class SharedRun:
    def __init__(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._work = work
        self._task: asyncio.Task[None] | None = None

    async def __call__(self) -> None:
        """Run the work, or join the run under way; its outcome is every caller's."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._work())
        task = self._task
        try:
            await asyncio.shield(task)
        finally:
            if self._task is task and task.done():
                self._task = None

    async def settled(self) -> None:
        """Return once no run is under way (at once when none is)."""
        if self._task is not None:
            await asyncio.shield(self._task)
