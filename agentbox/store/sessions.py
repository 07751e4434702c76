"""Sessions, turns, the session event log and the model transcript (issue 5).

A message becomes a turn row (`queued`), a `user.message` event and a `turn.queued` event in
ONE transaction before anyone is told it was accepted. Every later write for a turn runs in
a transaction that first checks the turn is still open (a fence: a turn that was aborted
meanwhile gets no more events), and returns the events it inserted so that the caller
publishes them only after the commit.

Exactly one terminal state per turn: `finish` is a conditional UPDATE (`WHERE status IN
(open)`) and appends the terminal event only when it changed the row; the schema refuses a
second terminal event and any change out of a terminal status even if code got it wrong.
The same transaction settles what the turn left dangling: a model reply still `streaming`
becomes `aborted`, a tool call without a result gets an "interrupted" error result.

Event `seq` is per session and gap-free: MAX(seq)+1 under the write lock of the same
transaction (BEGIN IMMEDIATE), unique per session.

Session secrets are encrypted at rest: a `model_options` value whose key looks secret
(`SECRET_OPTION_WORDS`: `api_key`, ...), every value of a `headers` table (model options, or
an MCP server's), and an MCP server's `env` value whose name looks secret (`GITHUB_TOKEN`)
are stored as `enc:` tokens under the home's machine-secret key (`agentbox.secrets`). A
`Session` read back carries the tokens; `SessionStore.reveal` gives the plaintext to the one
place that uses it (the worker, when it builds the provider and the MCP clients), and
`Session.to_dict` (the API, `session.created`) shows `REDACTED` instead.

Records are frozen dataclasses; timestamps stay the store's UTC ISO strings (the wire form).
A session's `updated_at` is the time of its last event: every event is inserted by
`insert_event`, which moves it in the same transaction (a message, a tool result, a turn's end,
an update), so a client sorting sessions by activity needs no second source.

Every way this repository refuses:

    SessionStoreError
    ├── SessionNotFound      no (live) session has that id
    ├── TurnNotFound         no turn has that id (in that session)
    ├── UnknownFiles         a message names files that do not exist (or are another session's)
    ├── IdempotencyConflict  a key reused with a different message
    ├── UnsupportedUpdate    a change to what is fixed at creation (model, instructions, ...)
    └── TurnClosed           a write for a turn that already reached its terminal state
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbox import ids
from agentbox.secrets import SecretBox, is_encrypted
from agentbox.store.db import Database
from agentbox.timestamps import timestamp

TurnStatus = Literal["queued", "running", "awaiting_approval", "completed", "failed", "aborted"]
Outcome = Literal["completed", "failed", "aborted"]
Activity = Literal["idle", "running", "awaiting_approval"]
ReplyStatus = Literal["complete", "aborted", "error"]

#: Statuses a turn can leave; every other status is terminal and final.
OPEN: tuple[str, ...] = ("queued", "running", "awaiting_approval")
TERMINAL: tuple[str, ...] = ("completed", "failed", "aborted")
TERMINAL_EVENTS: tuple[str, ...] = tuple(f"turn.{outcome}" for outcome in TERMINAL)

#: Largest event seq (SQLite's INTEGER): a cursor past it names no event and is refused.
MAX_SEQ = 2**63 - 1
#: What a session may change after creation; the rest is fixed (seed 000: "not supported").
UPDATABLE: frozenset[str] = frozenset(
    {"permission_mode", "metadata", "knowledge_bases", "knowledge_base_ids"}
)
#: Updatable fields stored as JSON.
JSON_FIELDS: frozenset[str] = frozenset({"metadata", "knowledge_bases", "knowledge_base_ids"})
FIXED: frozenset[str] = frozenset(
    {"model", "instructions", "mcp_servers", "toolset", "machine", "script", "model_options", "compaction"}
)

#: Most events one `list_events` call returns (the HTTP page limit).
MAX_EVENTS_PAGE = 1000

#: The result a tool call gets when its outcome is unknown (Flue's wording): it is never re-run.
INTERRUPTED = "Tool execution was interrupted before completion. The outcome is unknown."
#: The result of a call the turn ended under while it waited for its approval: it never ran.
NOT_RUN = "Tool call was not run: the turn ended while it waited for approval."

_OPEN_SQL = "('queued', 'running', 'awaiting_approval')"


class SessionStoreError(Exception):
    pass


class SessionNotFound(SessionStoreError, LookupError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r}")
        self.session_id = session_id


class TurnNotFound(SessionStoreError, LookupError):
    def __init__(self, turn_id: str) -> None:
        super().__init__(f"no turn {turn_id!r}")
        self.turn_id = turn_id


class UnknownFiles(SessionStoreError):
    def __init__(self, file_ids: Sequence[str]) -> None:
        super().__init__(f"unknown file ids: {', '.join(file_ids)}")
        self.file_ids = list(file_ids)


class IdempotencyConflict(SessionStoreError):
    def __init__(self, key: str, turn_id: str) -> None:
        super().__init__(f"idempotency key {key!r} was used for turn {turn_id} with a different message")
        self.key = key
        self.turn_id = turn_id


class UnsupportedUpdate(SessionStoreError):
    def __init__(self, fields: Sequence[str]) -> None:
        names = ", ".join(sorted(fields))
        super().__init__(
            f"changing {names} of a session is not supported; only {', '.join(sorted(UPDATABLE))} may change"
        )
        self.fields = sorted(fields)


class TurnClosed(SessionStoreError):
    def __init__(self, turn_id: str, status: str) -> None:
        super().__init__(f"turn {turn_id} is already {status}")
        self.turn_id = turn_id
        self.status = status


@dataclass(frozen=True)
class Session:
    id: str
    model: str
    instructions: str
    mcp_servers: list[Any]
    toolset: str
    permission_mode: str
    machine: str | None
    metadata: dict[str, Any]
    script: list[Any] | None
    status: str
    created_at: str
    updated_at: str
    model_options: dict[str, Any] = field(default_factory=dict)
    compaction: Any = None
    """None (the defaults), False (off) or {reserve_tokens, keep_recent_tokens}."""
    knowledge_bases: list[dict[str, Any]] = field(default_factory=list)
    """The knowledge bases it registered: [{id, path, name}], paths relative to the workspace root."""
    knowledge_base_ids: list[str] | None = None
    """The knowledge bases it selected, first the one relative paths start from; None: all."""

    def to_dict(self) -> dict[str, Any]:
        """The record as shown (API, events): every session secret redacted."""
        data = dict(self.__dict__)
        data["model_options"], data["mcp_servers"] = map_secrets(
            self.model_options, self.mcp_servers, lambda _: REDACTED
        )
        return data


#: What a redacted option shows instead of its value.
REDACTED = "***"
#: Fragments of option names whose values are secrets (matched case-insensitively).
SECRET_OPTION_WORDS = ("key", "token", "secret", "password", "authorization")


def secret_name(name: str) -> bool:
    """Whether an option, header or variable called `name` holds a secret by its name."""
    return any(word in name.lower() for word in SECRET_OPTION_WORDS)


def map_secrets(
    options: Mapping[str, Any], servers: Sequence[Any], change: Callable[[Any], Any]
) -> tuple[dict[str, Any], list[Any]]:
    """Copies of a session's `model_options` and `mcp_servers` with `change` applied to each
    secret (see the module docstring); the one definition of what a session secret is."""

    def table(values: Mapping[str, Any], every: bool) -> dict[str, Any]:
        return {k: change(v) if every or secret_name(k) else v for k, v in values.items()}

    shown: dict[str, Any] = {}
    for name, value in options.items():
        if name == "headers" and isinstance(value, dict):
            shown[name] = table(value, every=True)
        else:
            shown[name] = change(value) if secret_name(name) else value
    servers_shown: list[Any] = []
    for server in servers:
        if isinstance(server, dict):
            server = dict(server)
            for key, every in (("headers", True), ("env", False)):
                if isinstance(server.get(key), dict):
                    server[key] = table(server[key], every)
        servers_shown.append(server)
    return shown, servers_shown


@dataclass(frozen=True)
class Turn:
    id: str
    session_id: str
    seq: int
    status: TurnStatus
    idempotency_key: str | None
    content: str
    files: list[dict[str, Any]]
    stop_reason: str | None
    error: dict[str, Any] | None
    attempt: int
    created_at: str
    started_at: str | None
    ended_at: str | None
    joined_into: str | None = None
    """The turn this message joined at a step boundary (`join_queued`); it ends with that turn."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Event:
    id: str
    session_id: str
    seq: int
    type: str
    turn_id: str | None
    data: dict[str, Any]
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        """The wire shape: the envelope keys, then the payload, flat."""
        envelope = {
            "id": self.id,
            "seq": self.seq,
            "type": self.type,
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "created_at": self.created_at,
        }
        return {**self.data, **envelope}


@dataclass(frozen=True)
class Message:
    """One row of the model conversation (see the `messages` table for `content` shapes)."""

    id: int
    session_id: str
    turn_id: str
    role: Literal["user", "assistant", "tool"]
    status: Literal["streaming", "complete", "aborted", "error"]
    tool_use_id: str | None
    content: dict[str, Any]
    created_at: str


@dataclass(frozen=True)
class NewEvent:
    """An event to append inside a write (its seq, id and time are assigned there)."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Submission:
    turn: Turn
    events: list[Event]
    """What this call appended: empty when an idempotent retry returned the original turn."""

    @property
    def created(self) -> bool:
        return bool(self.events)


class SessionStore:
    """The `sessions`, `turns`, `events` and `messages` tables of one database."""

    def __init__(self, db: Database, secrets: SecretBox | None = None) -> None:
        self.db = db
        #: The key of session secrets: the home's (the database's folder) unless given.
        self.secrets = secrets or SecretBox(db.path.parent)

    def seal(self, options: Mapping[str, Any], servers: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
        """`model_options` and `mcp_servers` as stored: every secret string encrypted."""

        def encrypt(value: Any) -> Any:
            plain = isinstance(value, str) and not is_encrypted(value)
            return self.secrets.encrypt(value) if plain else value

        return map_secrets(options, servers, encrypt)

    async def seal_stored(self) -> int:
        """Seal the secrets of sessions stored before secrets were sealed; how many changed.

        Their `session.created` events are redacted too, and the old bytes are wiped from the
        file (`secure_delete`, then a WAL checkpoint), so no plaintext stays on disk. Idempotent.
        """

        def work(conn: sqlite3.Connection) -> int:
            changed = 0
            rows = conn.execute("SELECT id, model_options, mcp_servers FROM sessions").fetchall()
            for row in rows:
                options, servers = json.loads(row["model_options"]), json.loads(row["mcp_servers"])
                sealed = self.seal(options, servers)
                if sealed == (options, servers):
                    continue
                conn.execute(
                    "UPDATE sessions SET model_options = ?, mcp_servers = ? WHERE id = ?",
                    (_json(sealed[0]), _json(sealed[1]), row["id"]),
                )
                _redact_created_event(conn, row["id"])
                changed += 1
            return changed

        await self.db.execute("PRAGMA secure_delete = ON")
        changed = await self.db.transaction(work)
        if changed:
            await self.db.fetchone("PRAGMA wal_checkpoint(TRUNCATE)")
        return changed

    def reveal(self, session: Session) -> Session:
        """`session` with its secrets in plaintext: only for building its provider and MCP clients."""

        def decrypt(value: Any) -> Any:
            return self.secrets.decrypt(value) if is_encrypted(value) else value

        options, servers = map_secrets(session.model_options, session.mcp_servers, decrypt)
        return dataclasses.replace(session, model_options=options, mcp_servers=servers)

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        model: str,
        *,
        permission_mode: str,
        instructions: str = "",
        mcp_servers: Sequence[Any] = (),
        toolset: str = "default",
        machine: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        script: Sequence[Any] | None = None,
        model_options: Mapping[str, Any] | None = None,
        compaction: Any = None,
        knowledge_bases: Sequence[Mapping[str, Any]] = (),
        knowledge_base_ids: Sequence[str] | None = None,
    ) -> tuple[Session, list[Event]]:
        """A new session and its `session.created` event (validation of values is the caller's)."""
        session_id, now = ids.new_id(ids.SESSION), timestamp()
        model_options, mcp_servers = self.seal(model_options or {}, mcp_servers)

        def write(conn: sqlite3.Connection) -> tuple[Session, list[Event]]:
            conn.execute(
                "INSERT INTO sessions (id, model, instructions, mcp_servers, toolset, permission_mode,"
                " machine, metadata, script, model_options, compaction, knowledge_bases, knowledge_base_ids,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, model, instructions, _json(list(mcp_servers)), toolset, permission_mode,
                 machine, _json(dict(metadata or {})), None if script is None else _json(list(script)),
                 _json(dict(model_options or {})), None if compaction is None else _json(compaction),
                 _json([dict(kb) for kb in knowledge_bases]),
                 None if knowledge_base_ids is None else _json(list(knowledge_base_ids)), now, now),
            )  # fmt: skip
            session = _session_row(conn, session_id)
            shown = {k: v for k, v in session.to_dict().items() if k not in ("id", "created_at", "script")}
            return session, [insert_event(conn, session_id, None, "session.created", shown)]

        return await self.db.transaction(write)

    async def get_session(self, session_id: str) -> Session:
        def read(conn: sqlite3.Connection) -> Session:
            return _session_row(conn, session_id)

        return await self.db.transaction(read)

    async def list_sessions(
        self,
        *,
        after: str | None = None,
        limit: int = 100,
        machines: Sequence[str] | None = None,
        default_machine: bool = True,
    ) -> list[Session]:
        """Live sessions in creation order, after the id `after` (a cursor). `machines`: only
        sessions on these (by name), and with `default_machine` those on the server's default;
        None: every session. Filtered in the query, so a page and its cursor stay right."""
        where, args = "", []
        if machines is not None:
            marks = ", ".join("?" * len(machines)) or "NULL"
            where = f" AND (machine IN ({marks}) OR (machine IS NULL AND ?))"
            args = [*machines, int(default_machine)]
        rows = await self.db.fetchall(
            f"SELECT * FROM sessions WHERE status = 'active' AND id > ?{where} ORDER BY id LIMIT ?",
            (after or "", *args, limit),
        )
        return [_session(row) for row in rows]

    async def update_session(
        self, session_id: str, changes: Mapping[str, Any]
    ) -> tuple[Session, list[Event]]:
        """Change `permission_mode`, `metadata`, `knowledge_bases` and/or `knowledge_base_ids` (each
        replaced whole); anything fixed → UnsupportedUpdate."""
        refused = [name for name in changes if name not in UPDATABLE]
        if refused:
            raise UnsupportedUpdate(refused)

        def write(conn: sqlite3.Connection) -> tuple[Session, list[Event]]:
            _session_row(conn, session_id)
            values = {k: _json(v) if k in JSON_FIELDS and v is not None else v for k, v in changes.items()}
            if values:
                assignments = ", ".join(f"{name} = ?" for name in values)
                conn.execute(
                    f"UPDATE sessions SET {assignments} WHERE id = ?", (*values.values(), session_id)
                )
            event = insert_event(conn, session_id, None, "session.updated", dict(changes))
            return _session_row(conn, session_id), [event]

        return await self.db.transaction(write)

    async def delete_session(self, session_id: str) -> set[str]:
        """Remove the session with its turns, events and transcript (files are not touched).

        Returns the ids of the images its transcript showed that no other session's does: the
        caller removes them from the image store (`store/images.py`)."""

        def write(conn: sqlite3.Connection) -> set[str]:
            shown = _image_ids(conn, "m.session_id = ?", (session_id,))
            conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            if not shown:
                return set()
            marks = ", ".join("?" * len(shown))
            return shown - _image_ids(conn, f"image_id IN ({marks})", tuple(shown))

        return await self.db.transaction(write)

    async def shown_image(self, session_id: str, image_id: str) -> str | None:
        """The media type of an image the session's transcript shows, or None when it shows none
        by that id (an image is served only to a caller of a session that saw it)."""

        row = await self.db.fetchone(
            f"SELECT media_type FROM ({_SHOWN_IMAGES}) WHERE session_id = ? AND image_id = ? LIMIT 1",
            (session_id, image_id),
        )
        return None if row is None else str(row[0])

    async def activity(self, session_id: str) -> Activity:
        """idle (nothing open), running (a turn queued or running) or awaiting_approval."""
        rows = await self.db.fetchall(
            f"SELECT DISTINCT status FROM turns WHERE session_id = ? AND status IN {_OPEN_SQL}",
            (session_id,),
        )
        statuses = {row[0] for row in rows}
        if "awaiting_approval" in statuses:
            return "awaiting_approval"
        return "running" if statuses else "idle"

    # ------------------------------------------------------------------ turns

    async def submit(
        self,
        session_id: str,
        content: str,
        files: Sequence[str] = (),
        idempotency_key: str | None = None,
    ) -> Submission:
        """Accept a message: turn `queued` + `user.message` + `turn.queued`, in one transaction.

        The same `idempotency_key` again returns the first turn and writes nothing; with a
        different message it raises `IdempotencyConflict`. Unknown file ids raise
        `UnknownFiles` before anything is written.
        """
        file_ids = list(files)

        def write(conn: sqlite3.Connection) -> Submission:
            _session_row(conn, session_id)
            if idempotency_key is not None:
                row = conn.execute(
                    "SELECT * FROM turns WHERE session_id = ? AND idempotency_key = ?",
                    (session_id, idempotency_key),
                ).fetchone()
                if row is not None:
                    turn = _turn(row)
                    if turn.content != content or [f["file_id"] for f in turn.files] != file_ids:
                        raise IdempotencyConflict(idempotency_key, turn.id)
                    return Submission(turn, [])
            named = _resolve_files(conn, session_id, file_ids)
            _claim_files(conn, session_id, file_ids)
            turn_id, now = ids.new_id(ids.TURN), timestamp()
            seq = _next(conn, "turns", session_id)
            conn.execute(
                "INSERT INTO turns (id, session_id, seq, idempotency_key, content, files, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (turn_id, session_id, seq, idempotency_key, content, _json(named), now),
            )
            insert_message(conn, session_id, turn_id, "user", {"text": content, "files": named})
            ahead = conn.execute(
                f"SELECT COUNT(*) FROM turns WHERE session_id = ? AND status IN {_OPEN_SQL} AND seq < ?",
                (session_id, seq),
            ).fetchone()[0]
            events = [
                insert_event(conn, session_id, turn_id, "user.message", {"content": content, "files": named}),
                insert_event(conn, session_id, turn_id, "turn.queued", {"queue_position": ahead}),
            ]
            return Submission(_turn_row(conn, turn_id), events)

        return await self.db.transaction(write)

    async def get_turn(self, turn_id: str, session_id: str | None = None) -> Turn:
        row = await self.db.fetchone("SELECT * FROM turns WHERE id = ?", (turn_id,))
        if row is None or (session_id is not None and row["session_id"] != session_id):
            raise TurnNotFound(turn_id)
        return _turn(row)

    async def list_turns(self, session_id: str, *, status: str | None = None) -> list[Turn]:
        """A session's turns in FIFO order (optionally of one status)."""
        rows = await self.db.fetchall(
            "SELECT * FROM turns WHERE session_id = ? AND (? IS NULL OR status = ?) ORDER BY seq",
            (session_id, status, status),
        )
        return [_turn(row) for row in rows]

    async def open_turns(self) -> list[Turn]:
        """Every turn not yet terminal, of every session, in FIFO order per session."""
        rows = await self.db.fetchall(
            f"SELECT * FROM turns WHERE status IN {_OPEN_SQL} ORDER BY session_id, seq"
        )
        return [_turn(row) for row in rows]

    async def active_turn(self, session_id: str) -> Turn | None:
        """The open turn that runs now, or runs next: the first open one in FIFO order."""
        row = await self.db.fetchone(
            f"SELECT * FROM turns WHERE session_id = ? AND status IN {_OPEN_SQL} ORDER BY seq LIMIT 1",
            (session_id,),
        )
        return _turn(row) if row is not None else None

    async def start_turn(self, turn_id: str) -> tuple[Turn, list[Event]]:
        """queued (or running, after a restart) → running, attempt + 1, `turn.started`."""

        def write(conn: sqlite3.Connection) -> tuple[Turn, list[Event]]:
            turn = open_turn(conn, turn_id)
            conn.execute(
                "UPDATE turns SET status = 'running', attempt = attempt + 1,"
                " started_at = COALESCE(started_at, ?) WHERE id = ?",
                (timestamp(), turn_id),
            )
            event = insert_event(
                conn, turn.session_id, turn_id, "turn.started", {"attempt": turn.attempt + 1}
            )
            return _turn_row(conn, turn_id), [event]

        return await self.db.transaction(write)

    async def set_waiting(self, turn_id: str, waiting: bool, events: Sequence[NewEvent] = ()) -> list[Event]:
        """running ⇄ awaiting_approval, with `events` (e.g. `approval.requested`), fenced."""

        def write(conn: sqlite3.Connection) -> list[Event]:
            turn = open_turn(conn, turn_id)
            status = "awaiting_approval" if waiting else "running"
            conn.execute("UPDATE turns SET status = ? WHERE id = ?", (status, turn_id))
            return [insert_event(conn, turn.session_id, turn_id, e.type, e.data) for e in events]

        return await self.db.transaction(write)

    async def finish(
        self, turn_id: str, outcome: Outcome, data: Mapping[str, Any] | None = None
    ) -> list[Event]:
        """Move an open turn to `outcome` and append its terminal event; [] if it was already terminal.

        `data` is the terminal event's payload: `stop_reason` (completed), `error` (failed),
        `reason` (aborted). Dangling state is settled first, in the same transaction, and the
        turns joined into this one end with it (the same outcome, `joined_into` in the payload).
        """
        payload = dict(data or {})

        def write(conn: sqlite3.Connection) -> list[Event]:
            row = conn.execute("SELECT session_id, status FROM turns WHERE id = ?", (turn_id,)).fetchone()
            if row is None:
                raise TurnNotFound(turn_id)
            if row["status"] not in OPEN:
                return []
            settled = _settle(conn, row["session_id"], turn_id)
            changed = conn.execute(
                f"UPDATE turns SET status = ?, stop_reason = ?, error = ?, ended_at = ?"
                f" WHERE id = ? AND status IN {_OPEN_SQL}",
                (outcome, payload.get("stop_reason"),
                 _json(payload["error"]) if "error" in payload else None, timestamp(), turn_id),
            ).rowcount  # fmt: skip
            if changed != 1:
                return []
            ended = [*settled, insert_event(conn, row["session_id"], turn_id, f"turn.{outcome}", payload)]
            for (joined,) in conn.execute(
                f"SELECT id FROM turns WHERE joined_into = ? AND status IN {_OPEN_SQL} ORDER BY seq",
                (turn_id,),
            ).fetchall():
                conn.execute(
                    "UPDATE turns SET status = ?, stop_reason = ?, error = ?, ended_at = ? WHERE id = ?",
                    (outcome, payload.get("stop_reason"),
                     _json(payload["error"]) if "error" in payload else None, timestamp(), joined),
                )  # fmt: skip
                data = {**payload, "joined_into": turn_id}
                ended.append(insert_event(conn, row["session_id"], joined, f"turn.{outcome}", data))
            return ended

        return await self.db.transaction(write)

    async def join_queued(self, turn_id: str) -> list[Event]:
        """Take the messages queued behind a running turn into it, at one of its step boundaries.

        Flue's turn-boundary join: the contiguous run of queued turns right after this one, in
        FIFO order, that were accepted while this one ran (after its latest `turn.started`), up
        to the first that brings files. One accepted before was already waiting as a turn of its
        own (behind a turn that waited for the user, or across a restart) and stays one; one
        with files too, since placing them could fail, which fails the turn that owns them. The
        turns behind either run as their own as well.

        Each joined message becomes a user row of this turn, after everything it recorded so far
        (a new row: the transcript is ordered by turn, then row), with a `user.message` event of
        this turn (`joined_from`: the message's own turn); its own turn moves to `running` with
        `joined_into` and a `turn.joined` event, and ends when this one does (`finish`). [] when
        nothing is queued, or this turn is not running (fenced).
        """

        def write(conn: sqlite3.Connection) -> list[Event]:
            host = open_turn(conn, turn_id)
            if host.status != "running":
                return []
            started = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) FROM events WHERE turn_id = ? AND type = 'turn.started'",
                (turn_id,),
            ).fetchone()[0]
            events: list[Event] = []
            for row in conn.execute(
                f"SELECT t.*, (SELECT MIN(e.seq) FROM events e WHERE e.turn_id = t.id) AS accepted FROM turns t"
                f" WHERE t.session_id = ? AND t.seq > ? AND t.status IN {_OPEN_SQL} ORDER BY t.seq",
                (host.session_id, host.seq),
            ).fetchall():
                queued = _turn(row)
                if queued.status != "queued" or queued.files or (row["accepted"] or 0) < started:
                    break
                conn.execute("DELETE FROM messages WHERE turn_id = ? AND role = 'user'", (queued.id,))
                content = {"text": queued.content, "files": [], "joined_from": queued.id}
                insert_message(conn, host.session_id, turn_id, "user", content)
                conn.execute(
                    "UPDATE turns SET status = 'running', joined_into = ?, started_at = ? WHERE id = ?",
                    (turn_id, timestamp(), queued.id),
                )
                events += [
                    insert_event(conn, host.session_id, turn_id, "user.message",
                                 {"content": queued.content, "files": [], "joined_from": queued.id}),
                    insert_event(conn, host.session_id, queued.id, "turn.joined", {"joined_into": turn_id}),
                ]  # fmt: skip
            return events

        return await self.db.transaction(write)

    # ------------------------------------------------------------------ the turn's record

    async def append(self, session_id: str, turn_id: str | None, events: Sequence[NewEvent]) -> list[Event]:
        """Append events; for a turn, only while it is open (else `TurnClosed`)."""

        def write(conn: sqlite3.Connection) -> list[Event]:
            if turn_id is not None:
                open_turn(conn, turn_id)
            else:
                _session_row(conn, session_id)
            return [insert_event(conn, session_id, turn_id, e.type, e.data) for e in events]

        return await self.db.transaction(write)

    async def record_placement(self, turn_id: str, placed: Sequence[Mapping[str, Any]]) -> list[Event]:
        """Where the message's files went: on its user row (the model reads it) and `files.placed`."""

        def write(conn: sqlite3.Connection) -> list[Event]:
            turn = open_turn(conn, turn_id)
            row = conn.execute(
                "SELECT id, content FROM messages WHERE turn_id = ? AND role = 'user' ORDER BY id LIMIT 1",
                (turn_id,),
            ).fetchone()
            content = {**json.loads(row["content"]), "placed": [dict(p) for p in placed]}
            conn.execute("UPDATE messages SET content = ? WHERE id = ?", (_json(content), row["id"]))
            return [
                insert_event(conn, turn.session_id, turn_id, "files.placed", {"files": content["placed"]})
            ]

        return await self.db.transaction(write)

    async def open_reply(self, turn_id: str) -> int:
        """Record that a model call starts (an assistant row `streaming`); its message id."""

        def write(conn: sqlite3.Connection) -> int:
            turn = open_turn(conn, turn_id)
            return insert_message(conn, turn.session_id, turn_id, "assistant", {}, status="streaming")

        return await self.db.transaction(write)

    async def close_reply(
        self, message_id: int, status: ReplyStatus, content: Mapping[str, Any], events: Sequence[NewEvent]
    ) -> list[Event]:
        """Record how a model call ended (its text and tool calls) with its events, atomically.

        The tool calls are committed here, before any of them runs (write-ahead).
        """

        def write(conn: sqlite3.Connection) -> list[Event]:
            row = conn.execute(
                "SELECT session_id, turn_id FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            open_turn(conn, row["turn_id"])
            conn.execute(
                "UPDATE messages SET status = ?, content = ? WHERE id = ? AND status = 'streaming'",
                (status, _json(dict(content)), message_id),
            )
            return [insert_event(conn, row["session_id"], row["turn_id"], e.type, e.data) for e in events]

        return await self.db.transaction(write)

    async def add_tool_result(
        self,
        turn_id: str,
        tool_use_id: str,
        name: str,
        text: str,
        is_error: bool,
        events: Sequence[NewEvent] = (),
        files: Sequence[Mapping[str, Any]] = (),
        blocks: Sequence[Mapping[str, Any]] = (),
    ) -> list[Event]:
        """Record a tool call's result with `agent.tool_result` (and `events` after it).

        `files`: what the call delivered (`id`, `filename`, `bytes` each), the event's `files`.
        `blocks`: a result that shows images, as its text and image blocks in order (images
        named by id, `agent.vision.stored_blocks`): the row keeps them beside `text` (the whole
        text) and they are the event's `content`. First write wins: if the call already has a
        result, nothing is written and [] returned.
        """

        def write(conn: sqlite3.Connection) -> list[Event]:
            turn = open_turn(conn, turn_id)
            return _record_result(
                conn, turn.session_id, turn_id, tool_use_id, name, text, is_error, events, files, blocks
            )

        return await self.db.transaction(write)

    async def close_streaming(self, turn_id: str) -> int:
        """Recovery's first phase: a reply left `streaming` by a dead process becomes `aborted`."""
        return await self.db.execute(
            "UPDATE messages SET status = 'aborted' WHERE turn_id = ? AND status = 'streaming'", (turn_id,)
        )

    async def transcript(
        self, session_id: str, through: Turn | None = None, since: int | None = None
    ) -> list[Message]:
        """The session's conversation as recorded, turn by turn (then oldest first within a turn).

        Ordered by turn, not by row id: a message queued while a turn runs is written at once,
        but belongs after that turn's replies. `through`: only turns up to that one. `since`:
        only from that message on, in this order (what a compaction kept; the rest is never read).
        """
        sql = (
            "SELECT m.* FROM messages m JOIN turns t ON t.id = m.turn_id"
            " WHERE m.session_id = ? AND t.seq <= ?"
        )
        params: list[Any] = [session_id, through.seq if through is not None else 2**62]
        if since is not None:
            sql += (
                " AND (t.seq, m.id) >= ((SELECT t2.seq FROM messages m2 JOIN turns t2 ON t2.id = m2.turn_id"
                " WHERE m2.id = ?), ?)"
            )
            params += [since, since]
        rows = await self.db.fetchall(sql + " ORDER BY t.seq, m.id", tuple(params))
        return [_message(row) for row in rows]

    async def answered(self, session_id: str, tool_use_ids: Sequence[str]) -> set[str]:
        """Those of `tool_use_ids` that have a recorded result."""
        if not tool_use_ids:
            return set()
        marks = ", ".join("?" for _ in tool_use_ids)
        rows = await self.db.fetchall(
            f"SELECT tool_use_id FROM messages WHERE session_id = ? AND role = 'tool' AND tool_use_id IN ({marks})",
            (session_id, *tool_use_ids),
        )
        return {row[0] for row in rows}

    async def model_calls(self, session_id: str) -> int:
        """Recorded model replies of any status: the scripted model's position in its script."""
        row = await self.db.fetchone(
            "SELECT COUNT(*) FROM messages WHERE session_id = ? AND role = 'assistant'", (session_id,)
        )
        return int(row[0]) if row is not None else 0

    async def list_events(
        self,
        session_id: str,
        *,
        after: int = 0,
        limit: int = 100,
        turn_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[Event]:
        """Events with seq > `after`, ascending; at most `limit` (capped at MAX_EVENTS_PAGE)."""
        limit = max(1, min(limit, MAX_EVENTS_PAGE))
        sql = "SELECT * FROM events WHERE session_id = ? AND seq > ?"
        params: list[Any] = [session_id, after]
        if turn_id is not None:
            sql += " AND turn_id = ?"
            params.append(turn_id)
        if types:
            sql += f" AND type IN ({', '.join('?' for _ in types)})"
            params.extend(types)
        rows = await self.db.fetchall(sql + " ORDER BY seq LIMIT ?", (*params, limit))
        return [_event(row) for row in rows]

    async def last_seq(self, session_id: str) -> int:
        row = await self.db.fetchone(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE session_id = ?", (session_id,)
        )
        return int(row[0]) if row is not None else 0


# ---------------------------------------------------------------------- in-transaction helpers


def _redact_created_event(conn: sqlite3.Connection, session_id: str) -> None:
    """Redact the secrets a `session.created` event recorded before they were redacted there."""
    row = conn.execute(
        "SELECT id, data FROM events WHERE session_id = ? AND type = 'session.created'", (session_id,)
    ).fetchone()
    if row is None:
        return
    data = json.loads(row["data"])
    data["model_options"], data["mcp_servers"] = map_secrets(
        data.get("model_options") or {}, data.get("mcp_servers") or [], lambda _: REDACTED
    )
    conn.execute("UPDATE events SET data = ? WHERE id = ?", (_json(data), row["id"]))


def insert_event(
    conn: sqlite3.Connection, session_id: str, turn_id: str | None, type_: str, data: Mapping[str, Any]
) -> Event:
    """Append one event with the session's next seq and move the session's `updated_at` to its
    time (call inside a write transaction)."""
    seq = _next(conn, "events", session_id)
    event = Event(ids.new_id(ids.EVENT), session_id, seq, type_, turn_id, dict(data), timestamp())
    conn.execute(
        "INSERT INTO events (id, session_id, seq, type, turn_id, data, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (event.id, session_id, seq, type_, turn_id, _json(event.data), event.created_at),
    )
    conn.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (event.created_at, session_id))
    return event


#: Every image a session's transcripts show, as (session_id, image_id, media_type): the blocks of
#: its tool rows (`agent.vision`) and of its subagents' tool rows (`store.subagents`).
_SHOWN_IMAGES = (
    "SELECT m.session_id, json_extract(b.value, '$.image_id') AS image_id,"
    " json_extract(b.value, '$.media_type') AS media_type"
    " FROM messages m, json_each(m.content, '$.blocks') b WHERE m.role = 'tool'"
    " UNION ALL"
    " SELECT r.session_id, json_extract(b.value, '$.image_id'), json_extract(b.value, '$.media_type')"
    " FROM subagent_messages s JOIN subagent_runs r ON r.id = s.run_id, json_each(s.content, '$.blocks') b"
    " WHERE s.role = 'tool'"
)


def _image_ids(conn: sqlite3.Connection, where: str, args: tuple[str, ...]) -> set[str]:
    """Image ids the session transcripts' `_SHOWN_IMAGES` name that match `where`."""
    rows = conn.execute(
        f"SELECT DISTINCT image_id FROM ({_SHOWN_IMAGES}) m WHERE image_id IS NOT NULL AND {where}",
        args,
    ).fetchall()
    return {str(r[0]) for r in rows}


def insert_message(
    conn: sqlite3.Connection,
    session_id: str,
    turn_id: str,
    role: str,
    content: Mapping[str, Any],
    *,
    status: str = "complete",
    tool_use_id: str | None = None,
) -> int:
    cursor = conn.execute(
        "INSERT INTO messages (session_id, turn_id, role, status, tool_use_id, content, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (session_id, turn_id, role, status, tool_use_id, _json(dict(content)), timestamp()),
    )
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def unresolved_calls(conn: sqlite3.Connection, turn_id: str) -> list[dict[str, Any]]:
    """The turn's recorded tool calls that have no result yet, in call order."""
    calls: list[dict[str, Any]] = []
    for row in conn.execute(
        "SELECT content FROM messages WHERE turn_id = ? AND role = 'assistant' AND status = 'complete' ORDER BY id",
        (turn_id,),
    ):
        calls.extend(json.loads(row[0]).get("tool_calls", []))
    done = {
        row[0]
        for row in conn.execute(
            "SELECT tool_use_id FROM messages WHERE turn_id = ? AND role = 'tool'", (turn_id,)
        )
    }
    return [call for call in calls if call["id"] not in done]


def _record_result(
    conn: sqlite3.Connection,
    session_id: str,
    turn_id: str,
    tool_use_id: str,
    name: str,
    text: str,
    is_error: bool,
    events: Sequence[NewEvent] = (),
    files: Sequence[Mapping[str, Any]] = (),
    blocks: Sequence[Mapping[str, Any]] = (),
) -> list[Event]:
    exists = conn.execute(
        "SELECT 1 FROM messages WHERE session_id = ? AND tool_use_id = ? AND role = 'tool'",
        (session_id, tool_use_id),
    ).fetchone()
    if exists is not None:
        return []
    content: dict[str, Any] = {
        "tool_use_id": tool_use_id,
        "name": name,
        "content": text,
        "is_error": is_error,
    }
    if blocks:
        content["blocks"] = [dict(b) for b in blocks]
    insert_message(conn, session_id, turn_id, "tool", content, tool_use_id=tool_use_id)
    result = insert_event(
        conn, session_id, turn_id, "agent.tool_result",
        {"tool_use_id": tool_use_id, "name": name,
         "content": [dict(b) for b in blocks] or [{"type": "text", "text": text}],
         "is_error": is_error, "files": [dict(f) for f in files]},
    )  # fmt: skip
    return [result, *(insert_event(conn, session_id, turn_id, e.type, e.data) for e in events)]


def _settle(conn: sqlite3.Connection, session_id: str, turn_id: str) -> list[Event]:
    """Leave the transcript at rest: no reply streaming, every tool call with a result."""
    conn.execute(
        "UPDATE messages SET status = 'aborted' WHERE turn_id = ? AND status = 'streaming'", (turn_id,)
    )
    events: list[Event] = []
    waiting = calls_never_allowed(conn, turn_id)
    for call in unresolved_calls(conn, turn_id):
        text = NOT_RUN if call["id"] in waiting else INTERRUPTED
        events += _record_result(conn, session_id, turn_id, call["id"], call["name"], text, True)
    return events


def calls_never_allowed(conn: sqlite3.Connection, turn_id: str) -> set[str]:
    """The turn's tool calls that asked for approval and were never allowed: they never ran."""
    asked: set[str] = set()
    for kind, tool_use_id, decision in conn.execute(
        "SELECT type, json_extract(data, '$.tool_use_id'), json_extract(data, '$.decision') FROM events"
        " WHERE turn_id = ? AND type IN ('approval.requested', 'approval.resolved') ORDER BY seq",
        (turn_id,),
    ):
        if kind == "approval.requested":
            asked.add(tool_use_id)
        elif decision == "allow":
            asked.discard(tool_use_id)
    return asked


def _next(conn: sqlite3.Connection, table: str, session_id: str) -> int:
    row = conn.execute(f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {table} WHERE session_id = ?", (session_id,))
    return int(row.fetchone()[0])


def _resolve_files(
    conn: sqlite3.Connection, session_id: str, file_ids: Sequence[str]
) -> list[dict[str, Any]]:
    """[{file_id, filename}] for live files that are this session's or no session's."""
    named: list[dict[str, Any]] = []
    unknown: list[str] = []
    for file_id in file_ids:
        row = conn.execute(
            "SELECT filename FROM files WHERE id = ? AND deleted_at IS NULL"
            " AND (session_id IS NULL OR session_id = ?)",
            (file_id, session_id),
        ).fetchone()
        if row is None:
            unknown.append(file_id)
        else:
            named.append({"file_id": file_id, "filename": row[0]})
    if unknown:
        raise UnknownFiles(unknown)
    return named


def _claim_files(conn: sqlite3.Connection, session_id: str, file_ids: Sequence[str]) -> None:
    """Make the uploads a message names (those of no session yet) the session's: they are listed
    under it (`GET /v1/files?session_id=`), and another session can no longer name them."""
    conn.executemany(
        "UPDATE files SET session_id = ? WHERE id = ? AND session_id IS NULL",
        [(session_id, file_id) for file_id in file_ids],
    )


def open_turn(conn: sqlite3.Connection, turn_id: str) -> Turn:
    turn = _turn_row(conn, turn_id)
    if turn.terminal:
        raise TurnClosed(turn_id, turn.status)
    return turn


def _session_row(conn: sqlite3.Connection, session_id: str) -> Session:
    row = conn.execute("SELECT * FROM sessions WHERE id = ? AND status = 'active'", (session_id,)).fetchone()
    if row is None:
        raise SessionNotFound(session_id)
    return _session(row)


def _turn_row(conn: sqlite3.Connection, turn_id: str) -> Turn:
    row = conn.execute("SELECT * FROM turns WHERE id = ?", (turn_id,)).fetchone()
    if row is None:
        raise TurnNotFound(turn_id)
    return _turn(row)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _session(row: sqlite3.Row) -> Session:
    return Session(
        id=row["id"],
        model=row["model"],
        instructions=row["instructions"],
        mcp_servers=json.loads(row["mcp_servers"]),
        toolset=row["toolset"],
        permission_mode=row["permission_mode"],
        machine=row["machine"],
        metadata=json.loads(row["metadata"]),
        script=json.loads(row["script"]) if row["script"] is not None else None,
        model_options=json.loads(row["model_options"]),
        compaction=json.loads(row["compaction"]) if row["compaction"] is not None else None,
        knowledge_bases=json.loads(row["knowledge_bases"]),
        knowledge_base_ids=json.loads(row["knowledge_base_ids"])
        if row["knowledge_base_ids"] is not None
        else None,
        status=row["status"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _turn(row: sqlite3.Row) -> Turn:
    return Turn(
        id=row["id"],
        session_id=row["session_id"],
        seq=row["seq"],
        status=row["status"],
        idempotency_key=row["idempotency_key"],
        content=row["content"],
        files=json.loads(row["files"]),
        stop_reason=row["stop_reason"],
        error=json.loads(row["error"]) if row["error"] is not None else None,
        attempt=row["attempt"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        joined_into=row["joined_into"],
    )


def _event(row: sqlite3.Row) -> Event:
    return Event(
        id=row["id"],
        session_id=row["session_id"],
        seq=row["seq"],
        type=row["type"],
        turn_id=row["turn_id"],
        data=json.loads(row["data"]),
        created_at=row["created_at"],
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=row["id"],
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        role=row["role"],
        status=row["status"],
        tool_use_id=row["tool_use_id"],
        content=json.loads(row["content"]),
        created_at=row["created_at"],
    )
