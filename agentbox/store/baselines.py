"""Baselines (the frozen system prompt and the compaction head) and signal messages.

The model's view of a session is rebuilt from rows on every call (also after a restart):
the newest baseline's `system` prompt, its `summary` if it came from a compaction, then the
transcript from `first_kept` on. Signals (`agent.signals`) are user-role message rows whose
content also holds the environment snapshot they told, so "what the model was last told"
is durable too: the newest signal row after the baseline, else the baseline's `environment`.

Writes are fenced like every turn write (`open_turn`): an aborted turn records nothing more.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentbox.store.db import Database
from agentbox.store.sessions import Event, NewEvent, insert_event, insert_message, open_turn
from agentbox.timestamps import timestamp


@dataclass(frozen=True)
class Baseline:
    id: int
    session_id: str
    turn_id: str | None
    system: str
    environment: dict[str, Any]
    summary: str | None
    first_kept: int | None
    """The id of the first message kept verbatim after `summary`; None: the whole transcript."""
    last_message: int
    """The newest message id when this baseline was written."""
    created_at: str


@dataclass(frozen=True)
class SignalRow:
    text: str
    """The rendered `<signal>` elements the model reads."""
    types: list[str]
    environment: dict[str, Any] | None
    """The environment snapshot after these signals; None when they told no change of it."""


class BaselineStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def latest(self, session_id: str) -> Baseline | None:
        row = await self.db.fetchone(
            "SELECT * FROM baselines WHERE session_id = ? ORDER BY id DESC LIMIT 1", (session_id,)
        )
        return _baseline(row) if row is not None else None

    async def last_signal(self, session_id: str, after: int) -> dict[str, Any] | None:
        """The environment the newest signal row after message `after` told (None: no such row;
        rows that told no environment, such as a finished task's notice, are passed over)."""
        row = await self.db.fetchone(
            "SELECT json_extract(content, '$.environment') FROM messages WHERE session_id = ?"
            " AND role = 'user' AND id > ? AND json_extract(content, '$.signal') IS NOT NULL"
            " AND json_extract(content, '$.environment') IS NOT NULL"
            " ORDER BY id DESC LIMIT 1",
            (session_id, after),
        )
        return json.loads(row[0]) if row is not None else None

    async def compactions(self, session_id: str) -> int:
        """How many baselines came from a compaction (each cost one model call)."""
        row = await self.db.fetchone(
            "SELECT COUNT(*) FROM baselines WHERE session_id = ? AND summary IS NOT NULL", (session_id,)
        )
        return int(row[0]) if row is not None else 0

    async def add(
        self,
        turn_id: str,
        system: str,
        environment: Mapping[str, Any],
        *,
        summary: str | None = None,
        first_kept: int | None = None,
        events: Sequence[NewEvent] = (),
    ) -> tuple[Baseline, list[Event]]:
        """A new baseline for the turn's session, with `events`, in one fenced transaction."""

        def write(conn: sqlite3.Connection) -> tuple[Baseline, list[Event]]:
            turn = open_turn(conn, turn_id)
            last = conn.execute(
                "SELECT COALESCE(MAX(id), 0) FROM messages WHERE session_id = ?", (turn.session_id,)
            ).fetchone()[0]
            cursor = conn.execute(
                "INSERT INTO baselines (session_id, turn_id, system, environment, summary, first_kept,"
                " last_message, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (turn.session_id, turn_id, system, json.dumps(dict(environment)), summary, first_kept,
                 last, timestamp()),
            )  # fmt: skip
            row = conn.execute("SELECT * FROM baselines WHERE id = ?", (cursor.lastrowid,)).fetchone()
            written = [insert_event(conn, turn.session_id, turn_id, e.type, e.data) for e in events]
            return _baseline(row), written

        return await self.db.transaction(write)

    async def add_signals(
        self, turn_id: str, signal: SignalRow, events: Sequence[NewEvent] = ()
    ) -> list[Event]:
        """One user-role message holding the signals told at this turn boundary, with `events`."""

        def write(conn: sqlite3.Connection) -> list[Event]:
            turn = open_turn(conn, turn_id)
            content = {"text": signal.text, "signal": signal.types, "environment": signal.environment}
            insert_message(conn, turn.session_id, turn_id, "user", content)
            return [insert_event(conn, turn.session_id, turn_id, e.type, e.data) for e in events]

        return await self.db.transaction(write)


def _baseline(row: sqlite3.Row) -> Baseline:
    return Baseline(
        id=row["id"],
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        system=row["system"],
        environment=json.loads(row["environment"]),
        summary=row["summary"],
        first_kept=row["first_kept"],
        last_message=row["last_message"],
        created_at=row["created_at"],
    )
