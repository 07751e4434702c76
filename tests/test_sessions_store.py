"""The sessions store on a real SQLite file: atomic, idempotent submission; gap-free seq; exactly
one terminal state enforced by the schema itself; the event bus's replay-then-tail."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from agentbox.agent.events import MAX_PENDING_DELTAS, Delta, EventBus
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.store.sessions import (
    MAX_EVENTS_PAGE,
    IdempotencyConflict,
    NewEvent,
    SessionNotFound,
    SessionStore,
    TurnClosed,
    UnknownFiles,
    UnsupportedUpdate,
)
from agentbox.timestamps import timestamp

DEADLINE = 20.0


@pytest.fixture
def store(db: Database) -> SessionStore:
    return SessionStore(db)


async def new_session(store: SessionStore) -> str:
    session, events = await store.create_session("scripted", permission_mode="full-auto", script=[])
    assert [e.type for e in events] == ["session.created"]
    return session.id


async def counts(db: Database) -> tuple[int, int, int]:
    row = await db.fetchone(
        "SELECT (SELECT COUNT(*) FROM turns), (SELECT COUNT(*) FROM events), (SELECT COUNT(*) FROM messages)"
    )
    assert row is not None
    return row[0], row[1], row[2]


async def test_submit_writes_turn_message_and_events_together(store: SessionStore) -> None:
    sid = await new_session(store)
    sub = await store.submit(sid, "hello")
    assert sub.created and sub.turn.status == "queued" and sub.turn.seq == 1
    assert [(e.type, e.seq) for e in sub.events] == [("user.message", 2), ("turn.queued", 3)]
    second = await store.submit(sid, "again")
    assert second.events[-1].data == {"queue_position": 1}
    assert await store.activity(sid) == "running"


async def test_the_same_idempotency_key_returns_the_same_turn_without_new_rows(
    store: SessionStore, db: Database
) -> None:
    sid = await new_session(store)
    first = await store.submit(sid, "hi", idempotency_key="k1")
    before = await counts(db)
    again = await store.submit(sid, "hi", idempotency_key="k1")
    assert again.turn.id == first.turn.id and not again.created
    assert await counts(db) == before
    with pytest.raises(IdempotencyConflict):
        await store.submit(sid, "something else", idempotency_key="k1")
    other = await new_session(store)
    assert (await store.submit(other, "hi", idempotency_key="k1")).turn.id != first.turn.id


async def test_unknown_files_are_refused_before_anything_is_written(
    store: SessionStore, db: Database, tmp_path: Path
) -> None:
    sid = await new_session(store)
    other = await new_session(store)
    files = FileStore(db, tmp_path / "home")
    (tmp_path / "f").write_bytes(b"x")
    mine = await files.put_path(tmp_path / "f", "f.txt", session_id=sid, source="upload")
    theirs = await files.put_path(tmp_path / "f", "g.txt", session_id=other, source="upload")
    before = await counts(db)
    with pytest.raises(UnknownFiles) as caught:
        await store.submit(sid, "see", [mine["id"], "file_nope", theirs["id"]])
    assert caught.value.file_ids == ["file_nope", theirs["id"]]
    assert await counts(db) == before
    sub = await store.submit(sid, "see", [mine["id"]])
    assert sub.turn.files == [{"file_id": mine["id"], "filename": "f.txt"}]
    with pytest.raises(SessionNotFound):
        await store.submit("ses_missing", "x")


async def test_the_schema_refuses_a_second_terminal_state(store: SessionStore, db: Database) -> None:
    sid = await new_session(store)
    turn = (await store.submit(sid, "x")).turn
    ended = await store.finish(turn.id, "completed", {"stop_reason": "end_turn"})
    assert [e.type for e in ended] == ["turn.completed"]
    assert await store.finish(turn.id, "aborted") == []
    with pytest.raises(sqlite3.IntegrityError, match="already terminal"):
        await db.execute("UPDATE turns SET status = 'running' WHERE id = ?", (turn.id,))
    with pytest.raises(sqlite3.IntegrityError):
        await db.execute(
            "INSERT INTO events (id, session_id, seq, type, turn_id, created_at)"
            " VALUES ('evt_x', ?, 99, 'turn.completed', ?, ?)",
            (sid, turn.id, timestamp()),
        )
    with pytest.raises(sqlite3.IntegrityError, match="does not match"):
        await db.execute(
            "INSERT INTO events (id, session_id, seq, type, turn_id, created_at)"
            " VALUES ('evt_y', ?, 98, 'turn.aborted', ?, ?)",
            (sid, turn.id, timestamp()),
        )
    with pytest.raises(TurnClosed):
        await store.append(sid, turn.id, [NewEvent("agent.message", {})])


async def test_racing_finishes_from_two_connections_leave_one_terminal_event(
    store: SessionStore, tmp_path: Path
) -> None:
    sid = await new_session(store)
    async with Database.in_home(tmp_path / "home") as second_db:
        other = SessionStore(second_db)
        for i in range(30):
            turn = (await store.submit(sid, f"m{i}")).turn
            results = await asyncio.gather(
                store.finish(turn.id, "completed", {"stop_reason": "end_turn"}),
                other.finish(turn.id, "aborted", {"reason": "user_abort"}),
            )
            written = [events for events in results if events]
            assert len(written) == 1
            status = (await store.get_turn(turn.id)).status
            assert written[0][-1].type == f"turn.{status}"
    seqs = [e.seq for e in await store.list_events(sid, limit=MAX_EVENTS_PAGE)]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_finish_settles_what_the_turn_left_dangling(store: SessionStore, db: Database) -> None:
    sid = await new_session(store)
    turn = (await store.submit(sid, "x")).turn
    await store.start_turn(turn.id)
    reply = await store.open_reply(turn.id)
    await store.close_reply(
        reply, "complete", {"text": "", "tool_calls": [{"id": "t1", "name": "bash", "input": {}}]}, []
    )
    await store.open_reply(turn.id)
    events = await store.finish(turn.id, "aborted", {"reason": "user_abort"})
    assert [e.type for e in events] == ["agent.tool_result", "turn.aborted"]
    rows = await store.transcript(sid)
    assert [m.status for m in rows if m.role == "assistant"] == ["complete", "aborted"]
    with pytest.raises(TurnClosed):
        await store.add_tool_result(turn.id, "t1", "bash", "late", False)


async def test_deleting_a_session_names_the_images_only_it_showed(store: SessionStore) -> None:
    def image(image_id: str) -> dict[str, object]:
        return {
            "type": "image",
            "image_id": image_id,
            "media_type": "image/png",
            "bytes": 1,
            "width": 1,
            "height": 1,
        }

    shown: dict[str, list[str]] = {
        "mine": ["img_" + "a" * 64, "img_" + "b" * 64],
        "theirs": ["img_" + "b" * 64],
    }
    sessions = {}
    for who, ids in shown.items():
        sid = sessions[who] = await new_session(store)
        turn = (await store.submit(sid, "look")).turn
        await store.start_turn(turn.id)
        blocks = [{"type": "text", "text": "seen"}, *map(image, ids)]
        await store.add_tool_result(turn.id, f"t_{who}", "read_file", "seen", False, blocks=blocks)
    assert await store.delete_session(sessions["mine"]) == {"img_" + "a" * 64}
    assert await store.delete_session(sessions["theirs"]) == {"img_" + "b" * 64}


async def test_a_recorded_tool_result_is_never_replaced(store: SessionStore) -> None:
    sid = await new_session(store)
    turn = (await store.submit(sid, "x")).turn
    await store.start_turn(turn.id)
    first = await store.add_tool_result(turn.id, "t1", "bash", "first", False)
    assert [e.type for e in first] == ["agent.tool_result"]
    assert await store.add_tool_result(turn.id, "t1", "bash", "second", True) == []
    [row] = [m for m in await store.transcript(sid) if m.role == "tool"]
    assert row.content["content"] == "first"


async def test_fixed_fields_cannot_change(store: SessionStore) -> None:
    sid = await new_session(store)
    with pytest.raises(UnsupportedUpdate, match="model"):
        await store.update_session(sid, {"model": "openai:x"})
    session, events = await store.update_session(sid, {"permission_mode": "full-ask", "metadata": {"a": 1}})
    assert session.permission_mode == "full-ask" and session.metadata == {"a": 1}
    assert events[0].type == "session.updated"


async def test_list_events_pages_are_capped_at_the_limit(store: SessionStore) -> None:
    sid = await new_session(store)
    await store.append(sid, None, [NewEvent("session.updated", {"i": i}) for i in range(MAX_EVENTS_PAGE + 1)])
    page = await store.list_events(sid, limit=MAX_EVENTS_PAGE + 50)
    assert len(page) == MAX_EVENTS_PAGE
    rest = await store.list_events(sid, after=page[-1].seq, limit=MAX_EVENTS_PAGE)
    assert len(rest) == 2  # session.created + 1001 appended = 1002 events


async def test_subscribe_replays_then_tails_without_gaps_or_duplicates(store: SessionStore) -> None:
    sid = await new_session(store)
    bus = EventBus(store)
    for i in range(5):
        bus.publish(await store.append(sid, None, [NewEvent("session.updated", {"i": i})]))
    listed = await store.list_events(sid)
    replayed = []
    subscription = bus.subscribe(sid, 0)
    async for event in subscription:
        assert event is not None
        replayed.append(event)
        if len(replayed) == len(listed):
            break
    await subscription.aclose()
    assert replayed == listed

    cursor = 3
    seen: list[int] = []

    async def read() -> None:
        async for event in bus.subscribe(sid, cursor):
            assert event is not None
            seen.append(event.seq)
            if event.seq == 6 + 40:
                return

    reader = asyncio.create_task(read())
    for i in range(40):  # live appends race the reader's replay
        bus.publish(await store.append(sid, None, [NewEvent("session.updated", {"n": i})]))
    await asyncio.wait_for(reader, DEADLINE)
    assert seen == list(range(cursor + 1, 47))
    assert bus.subscribers(sid) == 0


async def test_subscribe_heartbeats_when_idle_and_stops_at_the_turn_end(store: SessionStore) -> None:
    sid = await new_session(store)
    bus = EventBus(store)
    turn = (await store.submit(sid, "x")).turn
    got = []
    async for event in bus.subscribe(sid, 0, until_turn=turn.id, idle_timeout=0.01):
        got.append(event)
        if event is None and len(got) < 10:
            bus.publish(await store.finish(turn.id, "aborted", {"reason": "user_abort"}))
    assert got[-1] is not None and got[-1].type == "turn.aborted"
    assert None in got


async def test_a_slow_readers_deltas_keep_the_newest_up_to_the_limit(store: SessionStore) -> None:
    sid = await new_session(store)
    bus = EventBus(store)
    subscription = bus.subscribe(sid, 0, deltas=True)
    assert (await anext(subscription)) is not None  # session.created; now it is subscribed
    for index in range(MAX_PENDING_DELTAS + 1):  # the reader does not run in between
        bus.publish_delta(sid, "trn_x", f"piece {index} ", index)
    got = [await asyncio.wait_for(anext(subscription), DEADLINE) for _ in range(MAX_PENDING_DELTAS)]
    assert all(isinstance(d, Delta) for d in got)
    assert [d.index for d in got if isinstance(d, Delta)] == list(range(1, MAX_PENDING_DELTAS + 1))
    await subscription.aclose()


async def test_deleting_a_session_removes_its_rows(store: SessionStore, db: Database) -> None:
    sid = await new_session(store)
    await store.submit(sid, "x")
    await store.delete_session(sid)
    assert await counts(db) == (0, 0, 0)
    with pytest.raises(SessionNotFound):
        await store.get_session(sid)
