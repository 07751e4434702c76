"""The SQLite database under AGENTBOX_HOME: one connection, one thread, numbered migrations.

Why one thread: sqlite3 calls block, and the server is asyncio. Every statement runs in a
single dedicated thread that owns the only connection, so the event loop never waits on
disk, writes are serialized without any lock of ours, and a `transaction(fn)` runs `fn`
whole in that thread, atomic against every other call. Reads share the thread; WAL mode
lets other processes (the CLI, a second server) read while we write.

Why autocommit (`isolation_level=None`): the sqlite3 module's implicit BEGINs are hard to
see in code. Here a lone `execute` commits by itself, and a transaction is always explicit:
`BEGIN IMMEDIATE`, which takes the write lock up front, so a transaction that reads then
writes never fails half-way on a lock upgrade.

The file and its `-wal` / `-shm` are the owner's alone (`DB_FILE_MODE`): SQLite gives the
WAL and shared-memory files the database file's permissions, so the file is made (or
narrowed, for a home from before) with that mode before SQLite opens it.

Migrations are the files `migrations/NNN_name.sql`, applied in order, each in its own
transaction together with its row in `schema_migrations`. Adding one is adding one file.
A migration must not contain BEGIN / COMMIT (it already runs inside a transaction).

Every way the store itself fails (SQL errors stay `sqlite3.Error`):

    StoreError
    ├── DatabaseClosed    a call before `connect()` or after `close()`
    ├── DatabaseBusy      another process held the write lock past the busy timeout (retryable)
    ├── WalUnavailable    the file system refused WAL mode (e.g. no shared memory)
    └── MigrationError    a migration failed (and was rolled back), or the files are misnumbered
        └── SchemaTooNew  the file was migrated by a newer agentbox than this one
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

from agentbox.timestamps import timestamp

T = TypeVar("T")

Params = Sequence[Any] | Mapping[str, Any]

#: Name of the database file under AGENTBOX_HOME.
DB_FILE_NAME = "agentbox.db"

#: Permission bits of the database file and its -wal / -shm: owner read/write only.
DB_FILE_MODE = 0o600
#: The files SQLite keeps beside the database in WAL mode.
DB_SIDE_SUFFIXES = ("-wal", "-shm")

#: Milliseconds a statement waits for another connection's write lock before `DatabaseBusy`.
BUSY_TIMEOUT_MS = 5_000

#: Seconds between tries to switch a file that another connection is switching to WAL.
WAL_SWITCH_RETRY_S = 0.005

#: A migration file name: a version of at least three digits, `_`, a lowercase name, `.sql`.
_MIGRATION_FILE = re.compile(r"(\d{3,})_([a-z0-9_]+)\.sql")


class StoreError(Exception):
    pass


class DatabaseClosed(StoreError):
    pass


class DatabaseBusy(StoreError):
    retryable = True


class WalUnavailable(StoreError):
    pass


class MigrationError(StoreError):
    pass


class SchemaTooNew(MigrationError):
    pass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations(directory: Traversable | None = None) -> list[Migration]:
    """The migrations in `directory` (default: this package's `migrations/`), by version.

    Versions must run 1, 2, 3, ... without gaps or repeats: a gap is almost always a file lost
    in a merge, and applying around it would leave a schema no release ever had.
    """
    folder = directory if directory is not None else resources.files("agentbox.store") / "migrations"
    found: list[Migration] = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _MIGRATION_FILE.fullmatch(entry.name)
        if match is None:
            raise MigrationError(f"migration file {entry.name!r} is not named NNN_name.sql")
        found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda migration: migration.version)
    versions = [migration.version for migration in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must be 1..{len(found)} without gaps, found {versions}")
    return found


class Database:
    """The store's SQLite file. `await connect()` (or `async with`) before use, `close()` after."""

    def __init__(
        self,
        path: Path,
        *,
        migrations: Sequence[Migration] | None = None,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        self._migrations = migrations
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # touched only in the executor's thread

    @classmethod
    def in_home(cls, home: Path, **options: Any) -> Database:
        """The database of the AGENTBOX_HOME `home`."""
        return cls(Path(home) / DB_FILE_NAME, **options)

    async def connect(self) -> Database:
        """Open the file (creating it and its folder), set the pragmas, apply pending migrations."""
        if self._executor is not None:
            return self
        migrations = self._migrations if self._migrations is not None else load_migrations()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentbox-db")
        try:
            await asyncio.wrap_future(executor.submit(self._open, migrations))
        except BaseException:
            await asyncio.to_thread(executor.shutdown)
            raise
        self._executor = executor
        return self

    async def close(self) -> None:
        """Finish the calls already made, close the connection and stop the thread."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.wrap_future(executor.submit(self._close))
        finally:
            await asyncio.to_thread(executor.shutdown)

    async def __aenter__(self) -> Database:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def execute(self, sql: str, params: Params = ()) -> int:
        """Run one statement (committed on its own); the number of rows it changed."""
        return await self._run(lambda conn: conn.execute(sql, params).rowcount)

    async def fetchone(self, sql: str, params: Params = ()) -> sqlite3.Row | None:
        """The first row of one statement (which may write, e.g. `INSERT ... RETURNING`)."""
        return await self._run(lambda conn: _first_row(conn, sql, params))

    async def fetchall(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        return await self._run(lambda conn: conn.execute(sql, params).fetchall())

    async def transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(connection)` inside BEGIN IMMEDIATE ... COMMIT, in the database thread.

        Rolled back if `fn` raises. `fn` must be a plain function: it blocks that thread, so
        keep it to SQL and small computation. Once started it runs to the end even if the
        awaiting task is cancelled.
        """
        if inspect.iscoroutinefunction(fn):
            raise TypeError("transaction() runs fn in the database thread: pass a plain function")
        return await self._run(lambda conn: _in_transaction(conn, fn))

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None:
            raise DatabaseClosed(f"database {self.path} is not open")
        return await asyncio.wrap_future(self._executor.submit(self._call, fn))

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            raise DatabaseClosed(f"database {self.path} is not open")
        try:
            return fn(self._conn)
        except sqlite3.OperationalError as exc:
            if _is_busy(exc):
                raise DatabaseBusy(f"database {self.path} is locked by another connection: {exc}") from exc
            raise

    def _open(self, migrations: Sequence[Migration]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _make_private(self.path)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_timeout_ms / 1000)
        try:
            conn.row_factory = sqlite3.Row
            _apply_pragmas(conn, self.path, self.busy_timeout_ms)
            migrate(conn, migrations)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                raise DatabaseBusy(f"database {self.path} stayed locked while opening: {exc}") from exc
            raise
        self._conn = conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.execute("PRAGMA optimize")
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):  # another process holds the lock: the next close optimizes
                    raise
            finally:
                conn.close()


def _make_private(path: Path) -> None:
    """Create `path` mode `DB_FILE_MODE` if missing; narrow it and its side files if they are wider."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, DB_FILE_MODE))
    for p in (path, *(path.with_name(path.name + suffix) for suffix in DB_SIDE_SUFFIXES)):
        with contextlib.suppress(FileNotFoundError):
            if p.stat().st_mode & 0o777 != DB_FILE_MODE:
                os.chmod(p, DB_FILE_MODE)


def migrate(conn: sqlite3.Connection, migrations: Sequence[Migration]) -> list[int]:
    """Apply the migrations `conn`'s file lacks; the versions applied now.

    Safe when several processes start at once: each migration re-checks, under the write
    lock, whether someone else applied it meanwhile.
    """
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    done = _applied_versions(conn)
    known = max((migration.version for migration in migrations), default=0)
    if done and max(done) > known:
        raise SchemaTooNew(f"database schema is version {max(done)}, this agentbox knows up to {known}")
    applied: list[int] = []
    for migration in migrations:
        if migration.version not in done and _apply(conn, migration):
            applied.append(migration.version)
    return applied


def split_statements(script: str) -> list[str]:
    """The statements of an SQL script, split where SQLite itself sees a statement end.

    `sqlite3.complete_statement` knows about strings, comments and trigger bodies, so a `;`
    inside any of them does not split.
    """
    statements: list[str] = []
    start = 0
    for index, char in enumerate(script):
        if char == ";" and sqlite3.complete_statement(script[start : index + 1]):
            statements.append(script[start : index + 1].strip())
            start = index + 1
    rest = script[start:].strip()
    if rest:
        statements.append(rest)
    return statements


def _apply(conn: sqlite3.Connection, migration: Migration) -> bool:
    """Apply one migration atomically; False if another process applied it first."""
    label = f"{migration.version:03d}_{migration.name}"
    conn.execute("BEGIN IMMEDIATE")
    try:
        if migration.version in _applied_versions(conn):
            conn.execute("COMMIT")
            return False
        for statement in split_statements(migration.sql):
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
            (migration.version, migration.name, timestamp()),
        )
        conn.execute("COMMIT")
    except BaseException as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error) and not _is_busy(exc):
            raise MigrationError(f"migration {label} failed and was rolled back: {exc}") from exc
        raise
    return True


def _is_busy(exc: sqlite3.Error) -> bool:
    """Whether `exc` means another connection held a lock past the busy timeout."""
    code = getattr(exc, "sqlite_errorcode", None) or 0  # absent on errors raised by the module itself
    return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _applied_versions(conn: sqlite3.Connection) -> set[int]:
    return {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}


def _apply_pragmas(conn: sqlite3.Connection, path: Path, busy_timeout_ms: int) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    mode = _switch_to_wal(conn, busy_timeout_ms)
    if str(mode).lower() != "wal":
        raise WalUnavailable(f"SQLite could not put {path} in WAL mode (journal_mode is {mode!r})")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")


def _switch_to_wal(conn: sqlite3.Connection, busy_timeout_ms: int) -> str:
    """Set WAL mode, retrying until the busy timeout while another connection is switching too.

    SQLite does not call the busy handler for this pragma, so processes that open a new file
    at the same moment would otherwise fail at once with "database is locked".
    """
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(WAL_SWITCH_RETRY_S)


def _first_row(conn: sqlite3.Connection, sql: str, params: Params) -> sqlite3.Row | None:
    cursor = conn.execute(sql, params)
    try:
        row: sqlite3.Row | None = cursor.fetchone()
        return row
    finally:
        cursor.close()


def _in_transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result
