"""The bounded change queue the ssh and e2b watches share, at its limit."""

from __future__ import annotations

import pytest

from agentbox.machines.base import WatchChange
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.watch_queue import MAX_QUEUED_CHANGES, ChangeQueue


async def drain(queue: ChangeQueue, count: int) -> list[WatchChange]:
    return [await queue.__anext__() for _ in range(count)]


async def test_a_slow_reader_gets_every_change_up_to_the_limit_then_one_overflow() -> None:
    queue = ChangeQueue()
    queue.target = "/workspace"
    for i in range(MAX_QUEUED_CHANGES):
        queue._put(WatchChange("create", f"/workspace/{i}"))
    queue._put(WatchChange("create", "/workspace/over"))  # the first past the limit: overflow
    queue._put(WatchChange("create", "/workspace/dropped"))  # and the next are dropped
    changes = await drain(queue, MAX_QUEUED_CHANGES + 1)
    assert [c.path for c in changes[:MAX_QUEUED_CHANGES]] == [
        f"/workspace/{i}" for i in range(MAX_QUEUED_CHANGES)
    ]
    assert changes[-1] == WatchChange("overflow", "/workspace", True)
    queue._put(WatchChange("write", "/workspace/after"))  # caught up: changes flow again
    assert (await queue.__anext__()).path == "/workspace/after"


async def test_an_error_ends_the_iteration_after_the_changes_before_it_and_stays() -> None:
    queue = ChangeQueue()
    queue._put(WatchChange("remove", "/workspace/a"))
    queue._fail(MachineUnavailable("the watch ended"))
    assert (await queue.__anext__()).path == "/workspace/a"
    for _ in range(2):
        with pytest.raises(MachineUnavailable, match="ended"):
            await queue.__anext__()
