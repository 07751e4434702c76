"""Streams that outlive their connections: one loop, sync and async, for events and watches.

A `Feed` knows what it streams: the request for the next connection (from where it left
off), what each frame stands for, and when it is over. `follow` and `afollow` connect,
hand every frame to the feed, and when a connection breaks ask its `Resume` how long to
wait before the next (`_transport.Resume`: `StreamLost` once reconnects stop bringing
anything new). A 404 after the stream was open means what it followed is gone (a deleted
session, a deleted watcher): the stream ends. Any other refusal is raised as it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol, TypeVar

import httpx

from agentbox.client._errors import APIError, NotFound
from agentbox.client._transport import AsyncTransport, Call, Resume, SyncTransport, stream_broke
from agentbox.sse import ServerSentEvent, iter_sse, sse_events

T_co = TypeVar("T_co", covariant=True)


class Feed(Protocol[T_co]):
    resume: Resume
    done: bool

    def call(self) -> Call:
        """The request of the next connection, resuming after `resume.cursor`."""
        ...

    def accept(self, frame: ServerSentEvent) -> T_co | None:
        """What a frame stands for (None: nothing to yield); may set `done`."""
        ...

    def closed(self) -> float:
        """The server ended a connection cleanly: the wait before the next (or set `done`)."""
        ...


def follow(transport: SyncTransport, feed: Feed[T_co]) -> Iterator[T_co]:
    connected = False
    while not feed.done:
        try:
            with transport.stream(feed.call()) as response:
                connected = True
                for frame in iter_sse(response.iter_bytes()):
                    item = feed.accept(frame)
                    if item is not None:
                        yield item
                    if feed.done:
                        return
            delay = feed.closed()
        except NotFound:
            if connected:
                return
            raise
        except (httpx.HTTPError, APIError) as exc:
            delay = broke(feed.resume, exc)
        time.sleep(delay)


async def afollow(transport: AsyncTransport, feed: Feed[T_co]) -> AsyncIterator[T_co]:
    connected = False
    while not feed.done:
        try:
            async with transport.stream(feed.call()) as response:
                connected = True
                async for frame in sse_events(response.aiter_bytes()):
                    item = feed.accept(frame)
                    if item is not None:
                        yield item
                    if feed.done:
                        return
            delay = feed.closed()
        except NotFound:
            if connected:
                return
            raise
        except (httpx.HTTPError, APIError) as exc:
            delay = broke(feed.resume, exc)
        await asyncio.sleep(delay)


def broke(resume: Resume, exc: httpx.HTTPError | APIError) -> float:
    """The wait before reconnecting after `exc`; `exc` itself when no reconnect can cure it."""
    reason = stream_broke(exc)
    if reason is None:
        raise exc
    return resume.broke(reason)
