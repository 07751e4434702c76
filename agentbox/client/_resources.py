"""The resource groups of a client: sessions, messages, events, approvals, changes, files.

Each group exists twice, sync and async, with the same methods; both send the calls of
`_calls` and read the answers into the records of `_models`, so the two differ only in
`await`. The event stream's rules (`EventFeed`: which frames to yield, when the stream is
over) are shared the same way, and its connections are `_streams.follow`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, overload

from typing_extensions import Unpack

from agentbox.client import _calls as calls
from agentbox.client._calls import SessionFields
from agentbox.client._events import Event, MessageDelta, TurnEnded, event_of, frame_item
from agentbox.client._models import (
    Approval,
    ChangeSet,
    FileInfo,
    Session,
    Submission,
    Turn,
    TurnResult,
)
from agentbox.client._streams import afollow, follow
from agentbox.client._transport import AsyncTransport, Resume, SyncTransport
from agentbox.sse import ServerSentEvent

#: What an upload takes: bytes, a path on this machine, or an open binary file.
Uploadable = bytes | str | Path | IO[bytes]


def upload_bytes(source: Uploadable, filename: str | None) -> tuple[bytes, str]:
    """The bytes to upload and the name to give them."""
    if isinstance(source, bytes):
        return source, filename or "upload"
    if isinstance(source, str | Path):
        path = Path(source)
        return path.read_bytes(), filename or path.name
    name = getattr(source, "name", None)
    return source.read(), filename or (Path(name).name if isinstance(name, str) else "upload")


@dataclass
class EventFeed:
    """What one session's event stream yields, across its connections (a `_streams.Feed`).

    `until_turn`: stop after that turn's terminal event (decided here, whatever the server
    follows). `server_until`: the server closes the stream after the turn that was open
    when it was asked (`until=turn_end`); a clean close then ends the stream.
    """

    session_id: str
    resume: Resume
    deltas: bool = False
    until_turn: str | None = None
    server_until: bool = False
    done: bool = False

    @classmethod
    def of(
        cls, session_id: str, after: int, until_turn: str | None, until_turn_end: bool, deltas: bool
    ) -> EventFeed:
        resume = Resume(after, f"the event stream of session {session_id}")
        return cls(session_id, resume, deltas, until_turn, server_until=until_turn_end and until_turn is None)

    def call(self) -> calls.Call:
        return calls.event_stream(
            self.session_id, self.resume.cursor, deltas=self.deltas, until_turn_end=self.server_until
        )

    def accept(self, frame: ServerSentEvent) -> Event | MessageDelta | None:
        """The item a frame stands for, None for one already seen; sets `done` at the end."""
        item = frame_item(frame.event, frame.data)
        if isinstance(item, MessageDelta):
            return item
        if not self.resume.seen(item.seq):
            return None
        if self.until_turn is not None and item.turn_id == self.until_turn and isinstance(item, TurnEnded):
            self.done = True
        return item

    def closed(self) -> float:
        """The server ended a connection cleanly: the wait before the next (done if none is needed)."""
        if self.server_until:
            self.done = True
            return 0.0
        return self.resume.broke("the server closed the stream")


def turn_events(events: Sequence[Event], turn_id: str) -> TurnResult:
    """The turn's events; for a message that joined a running turn (`turn.joined`), also what
    that turn did after the join (its answer), though not its end: the last is this turn's own."""
    join = next((e for e in events if e.turn_id == turn_id and e.type == "turn.joined"), None)
    host = join.data.get("joined_into") if join is not None else None
    return TurnResult(turn_id, [
        e for e in events
        if e.turn_id == turn_id
        or (join is not None and e.turn_id == host and e.seq > join.seq and not isinstance(e, TurnEnded))
    ])  # fmt: skip


# ================================================================ sync


class Sessions:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(self, model: str, **fields: Unpack[SessionFields]) -> Session:
        """A new session: `scripted` (with `script=`), `openai:<name>` or `anthropic:<name>`."""
        return Session.of(self._t.json(calls.create_session(model, fields)))

    def get(self, session_id: str) -> Session:
        return Session.of(self._t.json(calls.get_session(session_id)))

    def list(self) -> Iterator[Session]:
        """Every session, oldest first, fetched a page at a time as the iteration goes."""
        after: str | None = None
        while True:
            page = self._t.json(calls.list_sessions(after))
            yield from (Session.of(s) for s in page["items"])
            if not page["has_more"]:
                return
            after = page["next_after"]

    def update(
        self, session_id: str, *, permission_mode: str | None = None, metadata: dict[str, Any] | None = None
    ) -> Session:
        """Change the permission mode or the metadata (the rest is fixed at creation)."""
        return Session.of(self._t.json(calls.update_session(session_id, permission_mode, metadata)))

    def delete(self, session_id: str) -> None:
        """Abort its turn, remove its events and sandbox; its files stay, its id is retired."""
        self._t.json(calls.delete_session(session_id))

    def abort(self, session_id: str, turn_id: str | None = None) -> Turn | None:
        """Abort `turn_id` (or the active turn); the turn as it stands after, None if none was open."""
        answer = self._t.json(calls.abort(session_id, turn_id))
        turn = answer if turn_id is not None else answer.get("turn")
        return Turn.of(turn) if turn else None

    def turn(self, session_id: str, turn_id: str) -> Turn:
        return Turn.of(self._t.json(calls.get_turn(session_id, turn_id)))


class Events:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def list(self, session_id: str, after: int = 0) -> Iterator[Event]:
        """The stored events after `after`, a page at a time (no waiting for new ones)."""
        while True:
            page = self._t.json(calls.list_events(session_id, after))
            yield from (event_of(e) for e in page["items"])
            if not page["has_more"]:
                return
            after = int(page["next_after"])

    @overload
    def stream(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        until_turn_end: bool = False,
        deltas: Literal[False] = False,
    ) -> Iterator[Event]: ...
    @overload
    def stream(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        until_turn_end: bool = False,
        deltas: Literal[True],
    ) -> Iterator[Event | MessageDelta]: ...
    def stream(
        self, session_id: str, after: int = 0, *, until_turn: str | None = None, until_turn_end: bool = False,
        deltas: bool = False,
    ) -> Iterator[Event] | Iterator[Event | MessageDelta]:  # fmt: skip
        """The session's events after `after` as they happen, resumed after the last one seen
        when the connection drops (`_transport.Resume`).

        `until_turn`: stop after that turn's terminal event. `until_turn_end`: stop after the
        turn open now (else the last one) ends, as the server follows it. Neither: until the
        caller stops or the session is deleted. `deltas`: also the reply's text as it comes.
        """
        return follow(self._t, EventFeed.of(session_id, after, until_turn, until_turn_end, deltas))


class Messages:
    def __init__(self, transport: SyncTransport, sessions: Sessions, events: Events) -> None:
        self._t = transport
        self._sessions, self._events = sessions, events

    def send(
        self, session_id: str, content: str, *, files: Sequence[str] = (), idempotency_key: str | None = None
    ) -> Submission:
        """Queue a message as a turn (`files`: ids from `files.upload`). The same key again
        returns the first turn (`created` False) and queues nothing."""
        return Submission.of(self._t.json(calls.send_message(session_id, content, files, idempotency_key)))

    def run(
        self, session_id: str, content: str, *, files: Sequence[str] = (), idempotency_key: str | None = None
    ) -> TurnResult:
        """Send a message and follow its turn to its end (an approval it asks for waits for an
        answer from elsewhere: `approvals`, another client, the console)."""
        after = self._sessions.get(session_id).last_seq  # before posting: the turn's events come after
        submitted = self.send(session_id, content, files=files, idempotency_key=idempotency_key)
        start = after if submitted.created else 0
        events = list(self._events.stream(session_id, start, until_turn=submitted.turn_id))
        return turn_events(events, submitted.turn_id)


class Approvals:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def list(self, session_id: str, *, pending: bool = False) -> list[Approval]:
        return [Approval.of(a) for a in self._t.json(calls.list_approvals(session_id, pending))["items"]]

    def allow(self, session_id: str, approval_id: str, *, for_session: bool = False) -> Approval:
        """Allow the call; `for_session`: and every later call like it in this session."""
        scope: Literal["once", "session"] = "session" if for_session else "once"
        return Approval.of(self._t.json(calls.answer_approval(session_id, approval_id, "allow", scope)))

    def deny(self, session_id: str, approval_id: str, message: str | None = None) -> Approval:
        """Refuse the call; `message` is what the model is told."""
        return Approval.of(
            self._t.json(calls.answer_approval(session_id, approval_id, "deny", message=message))
        )


class Changes:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def list(self, session_id: str) -> list[ChangeSet]:
        """The session's change sets, without diffs."""
        return [ChangeSet.of(c) for c in self._t.json(calls.list_changes(session_id))["items"]]

    def get(self, session_id: str, change_set_id: str) -> ChangeSet:
        """One change set with each operation's diff."""
        return ChangeSet.of(self._t.json(calls.get_changes(session_id, change_set_id)))

    def diff(self, session_id: str, change_set_id: str) -> str:
        """The change set's whole diff."""
        return self.get(session_id, change_set_id).diff

    def apply(
        self, session_id: str, change_set_id: str, operations: Sequence[str] | None = None
    ) -> ChangeSet:
        """Apply the named operations (every pending one when None); each ends applied or failed."""
        return ChangeSet.of(
            self._t.json(calls.decide_changes(session_id, change_set_id, "apply", operations))
        )

    def reject(
        self,
        session_id: str,
        change_set_id: str,
        operations: Sequence[str] | None = None,
        message: str | None = None,
    ) -> ChangeSet:
        """Reject the named operations (every pending one when None); nothing touches the disk."""
        call = calls.decide_changes(session_id, change_set_id, "reject", operations, message)
        return ChangeSet.of(self._t.json(call))


class Files:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def upload(
        self, source: Uploadable, *, filename: str | None = None, session_id: str | None = None
    ) -> FileInfo:
        """Store a file to give an agent (`messages.send(files=[info.id])`)."""
        content, name = upload_bytes(source, filename)
        return FileInfo.of(self._t.json(calls.upload_file(content, name, session_id)))

    def get(self, file_id: str) -> FileInfo:
        return FileInfo.of(self._t.json(calls.get_file(file_id)))

    def list(self, session_id: str | None = None) -> Iterator[FileInfo]:
        """Every file (or a session's uploads and deliveries), newest first, a page at a time."""
        after: str | None = None
        while True:
            page = self._t.json(calls.list_files(session_id, after))
            yield from (FileInfo.of(f) for f in page["items"])
            if not page["has_more"]:
                return
            after = page["next_after"]

    def download(self, file_id: str) -> bytes:
        return self._t.send(calls.file_content(file_id)).content

    def delete(self, file_id: str) -> None:
        self._t.json(calls.delete_file(file_id))


# ================================================================ async


class AsyncSessions:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(self, model: str, **fields: Unpack[SessionFields]) -> Session:
        """A new session: `scripted` (with `script=`), `openai:<name>` or `anthropic:<name>`."""
        return Session.of(await self._t.json(calls.create_session(model, fields)))

    async def get(self, session_id: str) -> Session:
        return Session.of(await self._t.json(calls.get_session(session_id)))

    async def list(self) -> AsyncIterator[Session]:
        """Every session, oldest first, fetched a page at a time as the iteration goes."""
        after: str | None = None
        while True:
            page = await self._t.json(calls.list_sessions(after))
            for s in page["items"]:
                yield Session.of(s)
            if not page["has_more"]:
                return
            after = page["next_after"]

    async def update(
        self, session_id: str, *, permission_mode: str | None = None, metadata: dict[str, Any] | None = None
    ) -> Session:
        return Session.of(await self._t.json(calls.update_session(session_id, permission_mode, metadata)))

    async def delete(self, session_id: str) -> None:
        await self._t.json(calls.delete_session(session_id))

    async def abort(self, session_id: str, turn_id: str | None = None) -> Turn | None:
        answer = await self._t.json(calls.abort(session_id, turn_id))
        turn = answer if turn_id is not None else answer.get("turn")
        return Turn.of(turn) if turn else None

    async def turn(self, session_id: str, turn_id: str) -> Turn:
        return Turn.of(await self._t.json(calls.get_turn(session_id, turn_id)))


class AsyncEvents:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def list(self, session_id: str, after: int = 0) -> AsyncIterator[Event]:
        while True:
            page = await self._t.json(calls.list_events(session_id, after))
            for e in page["items"]:
                yield event_of(e)
            if not page["has_more"]:
                return
            after = int(page["next_after"])

    @overload
    def stream(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        until_turn_end: bool = False,
        deltas: Literal[False] = False,
    ) -> AsyncIterator[Event]: ...
    @overload
    def stream(
        self,
        session_id: str,
        after: int = 0,
        *,
        until_turn: str | None = None,
        until_turn_end: bool = False,
        deltas: Literal[True],
    ) -> AsyncIterator[Event | MessageDelta]: ...
    def stream(
        self, session_id: str, after: int = 0, *, until_turn: str | None = None, until_turn_end: bool = False,
        deltas: bool = False,
    ) -> AsyncIterator[Event] | AsyncIterator[Event | MessageDelta]:  # fmt: skip
        """`Events.stream`, async."""
        return afollow(self._t, EventFeed.of(session_id, after, until_turn, until_turn_end, deltas))


class AsyncMessages:
    def __init__(self, transport: AsyncTransport, sessions: AsyncSessions, events: AsyncEvents) -> None:
        self._t = transport
        self._sessions, self._events = sessions, events

    async def send(
        self, session_id: str, content: str, *, files: Sequence[str] = (), idempotency_key: str | None = None
    ) -> Submission:
        return Submission.of(
            await self._t.json(calls.send_message(session_id, content, files, idempotency_key))
        )

    async def run(
        self, session_id: str, content: str, *, files: Sequence[str] = (), idempotency_key: str | None = None
    ) -> TurnResult:
        after = (await self._sessions.get(session_id)).last_seq
        submitted = await self.send(session_id, content, files=files, idempotency_key=idempotency_key)
        start = after if submitted.created else 0
        events = [e async for e in self._events.stream(session_id, start, until_turn=submitted.turn_id)]
        return turn_events(events, submitted.turn_id)


class AsyncApprovals:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def list(self, session_id: str, *, pending: bool = False) -> list[Approval]:
        return [
            Approval.of(a) for a in (await self._t.json(calls.list_approvals(session_id, pending)))["items"]
        ]

    async def allow(self, session_id: str, approval_id: str, *, for_session: bool = False) -> Approval:
        scope: Literal["once", "session"] = "session" if for_session else "once"
        return Approval.of(await self._t.json(calls.answer_approval(session_id, approval_id, "allow", scope)))

    async def deny(self, session_id: str, approval_id: str, message: str | None = None) -> Approval:
        call = calls.answer_approval(session_id, approval_id, "deny", message=message)
        return Approval.of(await self._t.json(call))


class AsyncChanges:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def list(self, session_id: str) -> list[ChangeSet]:
        return [ChangeSet.of(c) for c in (await self._t.json(calls.list_changes(session_id)))["items"]]

    async def get(self, session_id: str, change_set_id: str) -> ChangeSet:
        return ChangeSet.of(await self._t.json(calls.get_changes(session_id, change_set_id)))

    async def diff(self, session_id: str, change_set_id: str) -> str:
        return (await self.get(session_id, change_set_id)).diff

    async def apply(
        self, session_id: str, change_set_id: str, operations: Sequence[str] | None = None
    ) -> ChangeSet:
        call = calls.decide_changes(session_id, change_set_id, "apply", operations)
        return ChangeSet.of(await self._t.json(call))

    async def reject(
        self,
        session_id: str,
        change_set_id: str,
        operations: Sequence[str] | None = None,
        message: str | None = None,
    ) -> ChangeSet:
        call = calls.decide_changes(session_id, change_set_id, "reject", operations, message)
        return ChangeSet.of(await self._t.json(call))


class AsyncFiles:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def upload(
        self, source: Uploadable, *, filename: str | None = None, session_id: str | None = None
    ) -> FileInfo:
        content, name = upload_bytes(source, filename)
        return FileInfo.of(await self._t.json(calls.upload_file(content, name, session_id)))

    async def get(self, file_id: str) -> FileInfo:
        return FileInfo.of(await self._t.json(calls.get_file(file_id)))

    async def list(self, session_id: str | None = None) -> AsyncIterator[FileInfo]:
        after: str | None = None
        while True:
            page = await self._t.json(calls.list_files(session_id, after))
            for f in page["items"]:
                yield FileInfo.of(f)
            if not page["has_more"]:
                return
            after = page["next_after"]

    async def download(self, file_id: str) -> bytes:
        return (await self._t.send(calls.file_content(file_id))).content

    async def delete(self, file_id: str) -> None:
        await self._t.json(calls.delete_file(file_id))
