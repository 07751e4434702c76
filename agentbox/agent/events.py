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
from collections.abc import AsyncGenerator, Sequence

from agentbox.store.sessions import TERMINAL_EVENTS, Event, SessionStore

#: Events read from the database per round trip while catching up.
SUBSCRIBE_PAGE = 500


class EventBus:
    """Wakes subscribers of a session after its events are committed. One per server."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._flags: dict[str, set[asyncio.Event]] = {}

    def publish(self, events: Sequence[Event]) -> None:
        """Call after the transaction that inserted `events` committed (never before)."""
        for session_id in {event.session_id for event in events}:
            for flag in self._flags.get(session_id, ()):
                flag.set()

    def subscribers(self, session_id: str) -> int:
        return len(self._flags.get(session_id, ()))

    async def subscribe(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncGenerator[Event | None, None]:
        """The session's events with seq > `after`: stored ones first, then live ones, forever.

        With `until_turn`, ends after that turn's terminal event. With `idle_timeout`, yields
        None whenever that many seconds pass without an event (the SSE heartbeat's moment).
        """
        flag = asyncio.Event()
        self._flags.setdefault(session_id, set()).add(flag)
        cursor = after
        try:
            while True:
                flag.clear()
                page = await self.store.list_events(session_id, after=cursor, limit=SUBSCRIBE_PAGE)
                for event in page:
                    cursor = event.seq
                    yield event
                    if event.turn_id == until_turn and event.type in TERMINAL_EVENTS:
                        return
                if page:
                    continue
                if idle_timeout is None:
                    await flag.wait()
                elif not await _wait(flag, idle_timeout):
                    yield None
        finally:
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
