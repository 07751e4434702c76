"""Seed 002's watch routes, `/v2/watch`: watchers as resources, read by poll or by SSE.

    POST   /v2/watch                  {path, recursive, exclude} -> {watcher_id}
    GET    /v2/watch                  the watchers of this sandbox
    GET    /v2/watch/{id}             one watcher
    GET    /v2/watch/{id}/poll        ?cursor (or since)&timeout&limit -> {events, cursor, overflow}
    GET    /v2/watch/{id}/events      SSE: watch_started, file_change (id <watcher_id>:<seq>), overflow
    DELETE /v2/watch/{id}

Replies use the envelope; `watcher_id` is in `data` and also at the top level, which serves
both readings of the upstream docs (aio-api.md §6). An unknown id is a 404 envelope.

The SSE stream resumes after `Last-Event-ID` (`<watcher_id>:<seq>`, as a browser's
EventSource sends it on reconnect) or `?cursor=`; it sends a comment line every
`heartbeat` seconds while nothing happens, so proxies and clients keep the stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from agentbox.api.envelope import json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import SANDBOX_FAILURES, V2_FAILURES, Envelope, event_stream, failures
from agentbox.workspace.errors import bad_request
from agentbox.workspace.watch import DEFAULT_POLL_LIMIT, MAX_POLL_TIMEOUT, Event, Overflow, Watcher

router = APIRouter(tags=["v2 watch"], responses=failures(*V2_FAILURES, *SANDBOX_FAILURES))

#: Seconds of silence after which an SSE stream sends a heartbeat comment, by default.
HEARTBEAT_SECONDS = 15.0
#: The shortest and longest heartbeat interval a client may ask for with `?heartbeat=`.
MIN_HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 300.0

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Most digits the seq of a `Last-Event-ID` may have (a 64-bit count); a longer one is refused
#: before `int()`, which raises past 4300 digits.
MAX_SEQ_DIGITS = 19


class WatchBody(BaseModel):
    path: str = Field(description="A directory (or a single file) inside the sandbox.")
    recursive: bool = Field(True, description="Watch subdirectories too.")
    exclude: list[str] | None = Field(
        None,
        description="fnmatch globs matched against each path segment below the root; "
        "a list replaces the defaults (.git, node_modules, __pycache__, ...).",
    )


class WatcherInfo(BaseModel):
    """A watcher as `Watcher.to_dict` gives it."""

    watcher_id: str
    path: str
    recursive: bool
    exclude: list[str]
    created_at: float = Field(description="Unix time the watcher started.")
    last_seq: int = Field(description="The seq of its newest event (0: none yet).")


class WatcherReply(Envelope[WatcherInfo]):
    """The envelope with `watcher_id` at the top level too."""

    watcher_id: str


class WatcherList(BaseModel):
    watchers: list[WatcherInfo]


class WatcherDeleted(BaseModel):
    watcher_id: str
    deleted: bool


class WatcherDeletedReply(Envelope[WatcherDeleted]):
    watcher_id: str


class PollPage(BaseModel):
    """Events after the cursor, the cursor for the next poll, and whether history was lost."""

    events: list[Event]
    cursor: int
    overflow: bool


#: How the SSE routes answer (v1 and v2): frames, not JSON.
SSE_RESPONSE = event_stream(
    "watch_started, then file_change (id `<watcher_id>:<seq>`) and overflow events",
    ("watch_started", "file_change", "overflow"),
)


@router.post("/v2/watch", openapi_extra=json_body(WatchBody), response_model=WatcherReply)
async def create(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, WatchBody)
    watcher = await sandbox.watches.start(body.path, recursive=body.recursive, exclude=body.exclude)
    return ok(watcher.to_dict(), watcher_id=watcher.id)


@router.get("/v2/watch", response_model=Envelope[WatcherList])
async def list_watchers(sandbox: CurrentSandbox) -> JSONResponse:
    return ok({"watchers": [w.to_dict() for w in sandbox.watches.list()]})


@router.get("/v2/watch/{watcher_id}", response_model=WatcherReply)
async def get_watcher(watcher_id: str, sandbox: CurrentSandbox) -> JSONResponse:
    watcher = sandbox.watches.get(watcher_id)
    return ok(watcher.to_dict(), watcher_id=watcher.id)


@router.delete("/v2/watch/{watcher_id}", response_model=WatcherDeletedReply)
async def delete_watcher(watcher_id: str, sandbox: CurrentSandbox) -> JSONResponse:
    sandbox.watches.delete(watcher_id)
    return ok({"watcher_id": watcher_id, "deleted": True}, watcher_id=watcher_id)


@router.get("/v2/watch/{watcher_id}/poll", response_model=Envelope[PollPage])
async def poll(
    watcher_id: str,
    sandbox: CurrentSandbox,
    cursor: Annotated[
        int | None, Query(description="The last seq consumed; events after it are returned.")
    ] = None,
    since: Annotated[int | None, Query(description="Alias of cursor (the AIO SDK's name).")] = None,
    timeout: Annotated[
        float,
        Query(
            allow_inf_nan=False, description=f"Seconds to wait for an event (at most {MAX_POLL_TIMEOUT:g})."
        ),
    ] = 0.0,
    limit: Annotated[int, Query(description="Events returned at most.")] = DEFAULT_POLL_LIMIT,
) -> JSONResponse:
    watcher = sandbox.watches.get(watcher_id)
    position = cursor if cursor is not None else since if since is not None else 0
    page = await watcher.poll(position, timeout, limit)
    return ok(page.to_dict())


@router.get("/v2/watch/{watcher_id}/events", response_class=StreamingResponse, responses=SSE_RESPONSE)
async def events(
    watcher_id: str,
    sandbox: CurrentSandbox,
    cursor: Annotated[int | None, Query(description="Resume after this seq (Last-Event-ID wins).")] = None,
    heartbeat: Annotated[
        float,
        Query(
            allow_inf_nan=False,
            description=f"Seconds between heartbeat comments ({MIN_HEARTBEAT_SECONDS:g}-{MAX_HEARTBEAT_SECONDS:g}).",
        ),
    ] = HEARTBEAT_SECONDS,
    last_event_id: Annotated[str | None, Header(description="`<watcher_id>:<seq>` to resume after.")] = None,
) -> StreamingResponse:
    watcher = sandbox.watches.get(watcher_id)
    if not MIN_HEARTBEAT_SECONDS <= heartbeat <= MAX_HEARTBEAT_SECONDS:
        raise bad_request(
            "watch",
            f"heartbeat must be between {MIN_HEARTBEAT_SECONDS:g} and {MAX_HEARTBEAT_SECONDS:g} seconds",
        )
    after = resume_position(watcher, last_event_id, cursor)
    return StreamingResponse(
        sse(watcher, after, heartbeat), media_type="text/event-stream", headers=SSE_HEADERS
    )


def resume_position(watcher: Watcher, last_event_id: str | None, cursor: int | None) -> int:
    """The seq to stream after: from `Last-Event-ID`, else `cursor`, else 0.

    Checked here, before the response starts, so a bad position is an ordinary 400 rather
    than a stream that breaks after its headers were sent.
    """
    after = cursor or 0
    if last_event_id:
        owner, _, seq = last_event_id.strip().rpartition(":")
        # isascii: str.isdigit() also accepts digits int() does not read, such as "²".
        if owner != watcher.id or not (seq.isascii() and seq.isdigit()) or len(seq) > MAX_SEQ_DIGITS:
            raise bad_request(
                "watch", f"Last-Event-ID must be '{watcher.id}:<seq>', got {last_event_id!r}", watcher.path
            )
        after = int(seq)
    if not 0 <= after <= watcher.last_seq:
        raise bad_request(
            "watch",
            f"cursor must be between 0 and {watcher.last_seq} (the last event), got {after}",
            watcher.path,
        )
    return after


def frame(event: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    lines = [f"id: {event_id}"] if event_id is not None else []
    lines += [f"event: {event}", f"data: {json.dumps(data, separators=(',', ':'))}"]
    return ("\n".join(lines) + "\n\n").encode()


def change_frame(watcher: Watcher, item: Event | Overflow) -> bytes:
    if isinstance(item, Overflow):
        return frame("overflow", item.to_dict())
    return frame("file_change", item.to_dict(), f"{watcher.id}:{item.seq}")


async def sse(watcher: Watcher, after: int, heartbeat: float) -> AsyncIterator[bytes]:
    """The stream's frames; a heartbeat comment whenever `heartbeat` seconds pass quietly.

    The pending read of the watcher's stream is kept across heartbeats (never cancelled
    mid-wait), and is cancelled with the stream itself when the client goes away.
    """
    yield frame("watch_started", {"watcher_id": watcher.id})
    stream = watcher.stream(after)
    pending: asyncio.Future[Event | Overflow] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(stream))
            done, _ = await asyncio.wait({pending}, timeout=heartbeat)
            if not done:
                yield b": heartbeat\n\n"
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:  # the watcher was deleted
                return
            finally:
                pending = None
            yield change_frame(watcher, item)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await stream.aclose()  # type: ignore[attr-defined]
