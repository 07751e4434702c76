"""`E2BWatch`: a directory's changes in the sandbox, from envd's WatchDir stream."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from typing import TYPE_CHECKING, Any

from agentbox.machines.base import (
    WatchChange,
)
from agentbox.machines.e2b.options import HELPER_USER, REQUEST_TIMEOUT
from agentbox.machines.e2b.process import connect_error
from agentbox.machines.errors import MachineUnavailable
from agentbox.machines.watch_queue import ChangeQueue

if TYPE_CHECKING:
    from agentbox.machines.e2b.machine import E2BMachine


#: Seconds envd's RENAME of an old name waits for the CREATE of the new one (one rename).
MOVE_PAIR_SECONDS = 0.05


class E2BWatch(ChangeQueue):
    """Changes under one path in the sandbox, from envd's WatchDir stream.

    envd reports create, write, remove, chmod and rename (the old name renamed away; the new
    name is a create right after it): a rename followed within MOVE_PAIR_SECONDS by a create
    is one `rename`, a lone one a `remove`. A stream that ends or drops ends the iteration
    with `MachineUnavailable`.
    """

    def __init__(self, machine: E2BMachine, path: str, recursive: bool) -> None:
        super().__init__()
        self.machine = machine
        self.path = path
        self.recursive = recursive
        self._task: asyncio.Task[None] | None = None
        self._events: Any = None

    async def start(self) -> None:
        from connectrpc.errors import ConnectError
        from e2b.envd.filesystem import filesystem_pb

        self.target = self.machine._path(self.path)
        await self.machine._require_dir(self.target, self.path)
        request = filesystem_pb.WatchDirRequest(path=self.target, recursive=self.recursive)
        events = self.machine._files_rpc.watch_dir(request, headers=self.machine._headers(HELPER_USER))
        self._events = events
        try:
            first = await asyncio.wait_for(events.__anext__(), REQUEST_TIMEOUT)
        except ConnectError as exc:
            raise connect_error(exc, self.path, self.machine) from None
        except (TimeoutError, StopAsyncIteration) as exc:
            raise MachineUnavailable(f"the watch on {self.target} did not start: {exc!r}") from None
        if first.event is None or first.event.field != "start":
            raise MachineUnavailable(f"the watch on {self.target} did not start")
        self._task = asyncio.ensure_future(self._pump(events))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._events is not None:
            with contextlib.suppress(BaseException):
                await self._events.aclose()

    async def _pump(self, events: Any) -> None:
        renamed: str | None = None
        try:
            while True:
                try:
                    timeout = MOVE_PAIR_SECONDS if renamed is not None else None
                    response = await asyncio.wait_for(events.__anext__(), timeout)
                except TimeoutError:
                    assert renamed is not None
                    self._put(WatchChange("remove", renamed))
                    renamed = None
                    continue
                which = response.event
                if which is None or which.field != "filesystem":
                    continue
                renamed = self._change(which.value, renamed)
        except StopAsyncIteration:
            self._fail(MachineUnavailable(f"the watch on {self.target} ended"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(MachineUnavailable(f"the watch on {self.target} dropped: {exc}"))

    def _change(self, event: Any, renamed: str | None) -> str | None:
        """Queue one envd event; the old name of a rename still waiting for its new one."""
        from e2b.envd.filesystem import filesystem_pb

        kinds = {
            filesystem_pb.EventType.CREATE: "create", filesystem_pb.EventType.WRITE: "write",
            filesystem_pb.EventType.REMOVE: "remove", filesystem_pb.EventType.CHMOD: "chmod",
            filesystem_pb.EventType.RENAME: "rename",
        }  # fmt: skip
        kind = kinds.get(event.type)
        if kind is None:
            return renamed
        path = posixpath.join(self.target, event.name)
        if renamed is not None:
            if kind == "create":
                self._put(WatchChange("rename", path, False, renamed))
                return None
            self._put(WatchChange("remove", renamed))
        if kind == "rename":
            return path
        self._put(WatchChange(kind, path))
        return None
