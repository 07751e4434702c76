"""Telling live readers that a session's log grew, and reading it as one ordered stream.

The log in SQLite is the only truth. `publish` is called after the commit that inserted the
events and carries no data a reader relies on: it only wakes that session's subscribers,
who then read `seq > cursor` from the database. So a reader sees every event exactly once,
in seq order, whether it came from the replay or from live appends, and a publish that is
lost or reordered cannot make a gap (C6.2 of the session API notes: replay, then tail).

The no-lost-wakeup rule in `subscribe`: clear the wake flag, then read; a commit after the
read publishes after its commit and so sets the flag again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from agentbox.store.sessions import TERMINAL_EVENTS, Event, SessionStore

#: Events read from the database per round trip while catching up.
SUBSCRIBE_PAGE = 500


#: The type of the ephemeral text-delta event.
DELTA_EVENT = "agent.message.delta"
#: Deltas held for one subscriber that reads slower than the model writes; past it the oldest
#: go (their `index` shows the gap, and the stored `agent.message` has the whole text anyway).
MAX_PENDING_DELTAS = 1000


@dataclass(frozen=True)
class Delta:
    """A piece of a reply's text as the model produced it; never stored, no seq."""

    session_id: str
    turn_id: str
    text: str
    index: int
    """The piece's place in its reply (0, 1, ...)."""
    after: int
    """The highest seq published for the session when this was: send it before any greater seq."""

    type = DELTA_EVENT

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type, "session_id": self.session_id, "turn_id": self.turn_id,
            "text": self.text, "index": self.index,
        }  # fmt: skip


class EventBus:
    """Wakes subscribers of a session after its events are committed. One per server."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._flags: dict[str, set[asyncio.Event]] = {}
        self._deltas: dict[asyncio.Event, deque[Delta]] = {}
        """The delta queue of each subscriber that asked for deltas, by its wake flag."""
        self._published: dict[str, int] = {}
        """The highest seq published per session (one int per session this process published)."""
        self.listeners: list[Callable[[Sequence[Event]], None]] = []
        """Called with every batch published (the server's metrics count events and turns)."""

    def publish(self, events: Sequence[Event]) -> None:
        """Call after the transaction that inserted `events` committed (never before)."""
        for event in events:
            self._published[event.session_id] = max(self._published.get(event.session_id, 0), event.seq)
        for listener in self.listeners:
            listener(events)
        for session_id in {event.session_id for event in events}:
            for flag in self._flags.get(session_id, ()):
                flag.set()

    def publish_delta(self, session_id: str, turn_id: str, text: str, index: int) -> None:
        """Hand a text delta to the session's subscribers that asked for deltas (nothing is stored)."""
        delta = Delta(session_id, turn_id, text, index, self._published.get(session_id, 0))
        for flag in self._flags.get(session_id, ()):
            queue = self._deltas.get(flag)
            if queue is not None:
                queue.append(delta)
                flag.set()

    def subscribers(self, session_id: str) -> int:
        return len(self._flags.get(session_id, ()))

    @overload
    def subscribe(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        idle_timeout: float | None = None,
        deltas: Literal[False] = False,
    ) -> AsyncGenerator[Event | None, None]: ...

    @overload
    def subscribe(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        idle_timeout: float | None = None,
        deltas: bool,
    ) -> AsyncGenerator[Event | Delta | None, None]: ...

    async def subscribe(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        idle_timeout: float | None = None,
        deltas: bool = False,
    ) -> AsyncGenerator[Event | Delta | None, None]:
        """The session's events with seq > `after`: stored ones first, then live ones, forever.

        With `until_turn`, ends after that turn's terminal event. With `idle_timeout`, yields
        None whenever that many seconds pass without an event (the SSE heartbeat's moment).
        With `deltas`, also the text deltas published from now on, each before the stored
        events with a greater seq than its `after`.
        """
        flag = asyncio.Event()
        self._flags.setdefault(session_id, set()).add(flag)
        queue = self._deltas.setdefault(flag, deque(maxlen=MAX_PENDING_DELTAS)) if deltas else None
        cursor = after
        try:
            while True:
                flag.clear()
                page = await self.store.list_events(session_id, after=cursor, limit=SUBSCRIBE_PAGE)
                for event in page:
                    while queue and queue[0].after < event.seq:
                        yield queue.popleft()
                    cursor = event.seq
                    yield event
                    if event.turn_id == until_turn and event.type in TERMINAL_EVENTS:
                        return
                if page:
                    continue
                while queue and queue[0].after <= cursor:
                    yield queue.popleft()
                if idle_timeout is None:
                    await flag.wait()
                elif not await _wait(flag, idle_timeout):
                    yield None
        finally:
            self._deltas.pop(flag, None)
            flags = self._flags.get(session_id)
            if flags is not None:
                flags.discard(flag)
                if not flags:
                    del self._flags[session_id]


async def _wait(flag: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(flag.wait(), timeout)
    except TimeoutError:
        return False
    return True
