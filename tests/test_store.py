"""The SQLite store on real files: pragmas, migrations, the writer thread, session markers."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import agentbox
from agentbox.store.db import (
    BUSY_TIMEOUT_MS,
    DB_FILE_NAME,
    Database,
    DatabaseBusy,
    DatabaseClosed,
    Migration,
    MigrationError,
    SchemaTooNew,
    load_migrations,
    split_statements,
)
from agentbox.store.markers import Marker, MarkersRepo
from agentbox.timestamps import epoch_timestamp, parse_timestamp, timestamp


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    async with Database.in_home(tmp_path) as database:
        yield database


def db_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("agentbox-db")]


# ---------------------------------------------------------------- database


async def test_file_is_created_in_home_with_the_pragmas(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with Database.in_home(home) as database:
        assert database.path == home / DB_FILE_NAME and database.path.is_file()
        assert (await database.fetchone("PRAGMA journal_mode"))[0] == "wal"  # type: ignore[index]
        assert (await database.fetchone("PRAGMA synchronous"))[0] == 1  # type: ignore[index]  # NORMAL
        assert (await database.fetchone("PRAGMA foreign_keys"))[0] == 1  # type: ignore[index]
        assert (await database.fetchone("PRAGMA busy_timeout"))[0] == BUSY_TIMEOUT_MS  # type: ignore[index]
    # WAL is a property of the file: a separate plain connection sees it too.
    with sqlite3.connect(home / DB_FILE_NAME) as plain:
        assert plain.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_migrations_run_once_and_are_recorded(tmp_path: Path) -> None:
    shipped = load_migrations()
    assert [m.version for m in shipped] == list(range(1, len(shipped) + 1))
    assert shipped[0].name == "machine_markers"
    for _ in range(3):
        async with Database.in_home(tmp_path) as database:
            rows = await database.fetchall("SELECT version, name FROM schema_migrations ORDER BY version")
            assert [tuple(row) for row in rows] == [(m.version, m.name) for m in shipped]
            tables = await database.fetchall("SELECT name FROM sqlite_master WHERE type = 'table'")
            assert "machine_markers" in {row["name"] for row in tables}


async def test_a_new_migration_file_is_applied_to_an_existing_database(tmp_path: Path) -> None:
    folder = tmp_path / "migrations"
    folder.mkdir()
    (folder / "001_first.sql").write_text("CREATE TABLE a (x INTEGER);")
    async with Database(tmp_path / "x.db", migrations=load_migrations(folder)) as database:
        await database.execute("INSERT INTO a VALUES (1)")
    (folder / "002_second.sql").write_text(
        "-- a comment; with a semicolon\nCREATE TABLE b (y TEXT DEFAULT 'p;q');\n"
        "CREATE TRIGGER a_to_b AFTER INSERT ON a BEGIN INSERT INTO b (y) VALUES ('t;'); END;\n"
    )
    async with Database(tmp_path / "x.db", migrations=load_migrations(folder)) as database:
        await database.execute("INSERT INTO a VALUES (2)")
        assert [row["y"] for row in await database.fetchall("SELECT y FROM b")] == ["t;"]
        assert len(await database.fetchall("SELECT * FROM a")) == 2


async def test_a_failing_migration_is_rolled_back_whole(tmp_path: Path) -> None:
    migrations = [
        Migration(1, "ok", "CREATE TABLE a (x INTEGER);"),
        Migration(2, "broken", "CREATE TABLE half (x INTEGER); INSERT INTO nowhere VALUES (1);"),
    ]
    before = len(db_threads())
    with pytest.raises(MigrationError, match="002_broken"):
        await Database(tmp_path / "x.db", migrations=migrations).connect()
    assert len(db_threads()) == before  # the failed connect stopped its thread
    with sqlite3.connect(tmp_path / "x.db") as plain:
        tables = {row[0] for row in plain.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        versions = [row[0] for row in plain.execute("SELECT version FROM schema_migrations")]
    assert "a" in tables and "half" not in tables
    assert versions == [1]


async def test_databases_from_a_newer_agentbox_are_refused(tmp_path: Path) -> None:
    two = [Migration(1, "a", "CREATE TABLE a (x);"), Migration(2, "b", "CREATE TABLE b (x);")]
    async with Database(tmp_path / "x.db", migrations=two):
        pass
    with pytest.raises(SchemaTooNew, match="version 2"):
        await Database(tmp_path / "x.db", migrations=two[:1]).connect()


async def test_two_databases_migrating_the_same_file_at_once_apply_each_migration_once(
    tmp_path: Path,
) -> None:
    databases = [Database.in_home(tmp_path) for _ in range(4)]
    await asyncio.gather(*(database.connect() for database in databases))
    try:
        rows = await databases[0].fetchall("SELECT version FROM schema_migrations")
        assert sorted(row[0] for row in rows) == [m.version for m in load_migrations()]
    finally:
        await asyncio.gather(*(database.close() for database in databases))


@pytest.mark.parametrize(
    "names, problem",
    [
        (["001_a.sql", "003_c.sql"], "without gaps"),
        (["002_b.sql"], "without gaps"),
        (["001_a.sql", "001_b.sql"], "without gaps"),
        (["1_a.sql"], "NNN_name"),
        (["001_Bad-Name.sql"], "NNN_name"),
    ],
)
def test_misnumbered_migration_files_are_refused(tmp_path: Path, names: list[str], problem: str) -> None:
    for name in names:
        (tmp_path / name).write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=problem):
        load_migrations(tmp_path)


def test_split_statements_respects_strings_comments_and_triggers() -> None:
    script = (
        "CREATE TABLE t (x TEXT DEFAULT ';');\n-- note; here\n"
        "CREATE TRIGGER g AFTER INSERT ON t BEGIN SELECT 1; SELECT 2; END;\nSELECT 3"
    )
    parts = split_statements(script)
    assert len(parts) == 3
    assert parts[0] == "CREATE TABLE t (x TEXT DEFAULT ';');"
    assert parts[1].endswith("SELECT 2; END;")
    assert parts[2] == "SELECT 3"


async def test_execute_fetch_and_rowcount(db: Database) -> None:
    await db.execute("CREATE TABLE kv (k TEXT PRIMARY KEY, v INTEGER)")
    assert await db.execute("INSERT INTO kv VALUES (?, ?), (?, ?)", ("a", 1, "b", 2)) == 2
    assert await db.execute("UPDATE kv SET v = v + 1 WHERE k = :k", {"k": "a"}) == 1
    assert await db.execute("UPDATE kv SET v = 0 WHERE k = 'zzz'") == 0
    row = await db.fetchone("INSERT INTO kv VALUES ('c', 3) RETURNING k, v")
    assert row is not None and (row["k"], row["v"]) == ("c", 3)
    assert await db.fetchone("SELECT * FROM kv WHERE k = 'none'") is None
    assert [tuple(r) for r in await db.fetchall("SELECT k, v FROM kv ORDER BY k")] == [
        ("a", 2),
        ("b", 2),
        ("c", 3),
    ]


async def test_transaction_commits_or_rolls_back_whole(db: Database) -> None:
    await db.execute("CREATE TABLE n (x INTEGER)")

    def two_inserts(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO n VALUES (1)")
        conn.execute("INSERT INTO n VALUES (2)")
        return int(conn.execute("SELECT COUNT(*) FROM n").fetchone()[0])

    assert await db.transaction(two_inserts) == 2

    def fails_half_way(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO n VALUES (3)")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await db.transaction(fails_half_way)
    assert [row[0] for row in await db.fetchall("SELECT x FROM n ORDER BY x")] == [1, 2]


async def test_transaction_refuses_a_coroutine_function(db: Database) -> None:
    async def wrong(conn: sqlite3.Connection) -> None:
        return None

    not_plain: Any = wrong
    with pytest.raises(TypeError, match="plain function"):
        await db.transaction(not_plain)


async def test_concurrent_read_modify_write_transactions_lose_no_update(db: Database) -> None:
    await db.execute("CREATE TABLE counter (n INTEGER)")
    await db.execute("INSERT INTO counter VALUES (0)")

    def bump(conn: sqlite3.Connection) -> None:
        (n,) = conn.execute("SELECT n FROM counter").fetchone()
        conn.execute("UPDATE counter SET n = ?", (n + 1,))

    await asyncio.gather(*(db.transaction(bump) for _ in range(200)))
    assert (await db.fetchone("SELECT n FROM counter"))[0] == 200  # type: ignore[index]


async def test_statements_run_on_one_dedicated_thread(db: Database) -> None:
    seen = await asyncio.gather(
        *(db.transaction(lambda conn: threading.current_thread().name) for _ in range(20))
    )
    assert len(set(seen)) == 1 and seen[0].startswith("agentbox-db")
    assert seen[0] != threading.current_thread().name


async def test_a_write_waiting_for_another_process_lock_does_not_block_the_loop(tmp_path: Path) -> None:
    async with Database.in_home(tmp_path) as database:
        await database.execute("CREATE TABLE w (x INTEGER)")
        other = sqlite3.connect(database.path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            write = asyncio.create_task(database.execute("INSERT INTO w VALUES (1)"))
            # The loop keeps running (this timeout fires) while the write waits for the lock.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(write), 0.05)
            other.execute("COMMIT")
            assert await write == 1
        finally:
            other.close()


async def test_busy_timeout_boundary_gives_a_typed_retryable_error(tmp_path: Path) -> None:
    async with Database.in_home(tmp_path, busy_timeout_ms=20) as database:
        assert (await database.fetchone("PRAGMA busy_timeout"))[0] == 20  # type: ignore[index]
        await database.execute("CREATE TABLE w (x INTEGER)")
        other = sqlite3.connect(database.path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseBusy) as caught:
                await database.execute("INSERT INTO w VALUES (1)")
            assert caught.value.retryable
            # reads are not blocked by a writer in WAL mode
            assert await database.fetchall("SELECT * FROM w") == []
            other.execute("ROLLBACK")
            assert await database.execute("INSERT INTO w VALUES (1)") == 1
        finally:
            other.close()


async def test_a_lock_held_past_the_busy_timeout_while_opening_is_database_busy(tmp_path: Path) -> None:
    path = tmp_path / DB_FILE_NAME
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("PRAGMA journal_mode = WAL")
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(DatabaseBusy, match="while opening"):
            await Database(path, busy_timeout_ms=20).connect()
        other.execute("ROLLBACK")
        async with Database(path, busy_timeout_ms=20) as database:
            assert await database.fetchall("SELECT * FROM machine_markers") == []
    finally:
        other.close()


async def test_a_rollback_journal_file_locked_by_another_process_is_database_busy(tmp_path: Path) -> None:
    path = tmp_path / DB_FILE_NAME
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(DatabaseBusy):
            await Database(path, busy_timeout_ms=20).connect()
        other.execute("COMMIT")
    finally:
        other.close()
    async with Database(path) as database:  # once released, the file is switched to WAL
        assert (await database.fetchone("PRAGMA journal_mode"))[0] == "wal"  # type: ignore[index]


_OPEN_IN_CHILD = """
import asyncio, sys
from pathlib import Path
from agentbox.store.db import Database

async def main() -> None:
    async with Database.in_home(Path(sys.argv[1])) as db:
        print(sorted(row[0] for row in await db.fetchall("SELECT version FROM schema_migrations")))

print("ready", flush=True)
sys.stdin.readline()
asyncio.run(main())
"""


@pytest.mark.parametrize("trial", range(5))
def test_processes_opening_a_new_home_at_once_all_succeed(tmp_path: Path, trial: int) -> None:
    """Several processes (a server, CLI calls) may create and migrate the same file at once."""
    env = {**os.environ, "PYTHONPATH": str(Path(agentbox.__file__).parents[1])}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_IN_CHILD, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(6)
    ]
    for child in children:  # a barrier: every child is started before any opens the file
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    expected = str([m.version for m in load_migrations()])
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert out.strip() == expected


async def test_foreign_keys_are_enforced(db: Database) -> None:
    await db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    await db.execute("CREATE TABLE child (parent_id INTEGER REFERENCES parent (id))")
    with pytest.raises(sqlite3.IntegrityError):
        await db.execute("INSERT INTO child VALUES (42)")


async def test_closed_database_refuses_calls_and_stops_its_thread(tmp_path: Path) -> None:
    before = len(db_threads())
    database = Database.in_home(tmp_path)
    with pytest.raises(DatabaseClosed):
        await database.fetchall("SELECT 1")
    await database.connect()
    assert await database.connect() is database  # idempotent
    pending = [asyncio.create_task(database.execute("SELECT 1")) for _ in range(10)]
    await asyncio.sleep(0)  # let the tasks submit their calls before close
    await database.close()
    assert [await task for task in pending] == [-1] * 10  # calls made before close finish
    await database.close()  # idempotent
    with pytest.raises(DatabaseClosed):
        await database.execute("SELECT 1")
    assert len(db_threads()) == before


def test_timestamps_are_utc_text_that_sorts() -> None:
    moment = datetime(2024, 5, 1, 12, 30, 45, 123456, tzinfo=UTC)
    text = timestamp(moment)
    assert text == "2024-05-01T12:30:45.123Z"
    assert parse_timestamp(text) == moment.replace(microsecond=123000)
    assert timestamp(datetime(2024, 5, 1, 9, 0, tzinfo=UTC)) < text
    assert epoch_timestamp(moment.timestamp()) == text


# ---------------------------------------------------------------- markers


async def test_append_then_latest(db: Database) -> None:
    markers = MarkersRepo(db)
    assert await markers.latest("ses_a", "box") is None
    await markers.append("ses_a", "box", "sandbox", "sbx_1", {"pid": 10, "nested": {"k": [1, "x"]}})
    marker = await markers.latest("ses_a", "box")
    assert isinstance(marker, Marker)
    assert (marker.session_id, marker.machine, marker.kind, marker.sandbox_id) == (
        "ses_a",
        "box",
        "sandbox",
        "sbx_1",
    )
    assert marker.data == {"pid": 10, "nested": {"k": [1, "x"]}}
    assert marker.created_at.tzinfo is not None
    assert abs((datetime.now(UTC) - marker.created_at).total_seconds()) < 60


async def test_latest_wins_and_clear_hides(db: Database) -> None:
    markers = MarkersRepo(db)
    await markers.append("ses_a", "box", "docker", "c1", {})
    await markers.append("ses_a", "box", "docker", "c2", {"gen": 2})
    latest = await markers.latest("ses_a", "box")
    assert latest is not None and latest.sandbox_id == "c2" and latest.data == {"gen": 2}
    await markers.clear("ses_a", "box")
    assert await markers.latest("ses_a", "box") is None
    await markers.append("ses_a", "box", "docker", "c3", {})
    latest = await markers.latest("ses_a", "box")
    assert latest is not None and latest.sandbox_id == "c3"
    # append-only: all four rows (three opens and a clear) are still there
    assert (await db.fetchone("SELECT COUNT(*) FROM machine_markers"))[0] == 4  # type: ignore[index]


async def test_live_lists_latest_uncleared_per_session_and_machine(db: Database) -> None:
    markers = MarkersRepo(db)
    await markers.append("ses_a", "box", "sandbox", "a1", {})
    await markers.append("ses_a", "gpu", "e2b", "g1", {})
    await markers.append("ses_b", "box", "sandbox", "b1", {})
    await markers.append("ses_a", "box", "sandbox", "a2", {})
    await markers.clear("ses_a", "gpu")
    await markers.clear("ses_c", "box")  # clearing what was never opened is harmless
    live = await markers.live()
    assert [(m.session_id, m.machine, m.sandbox_id) for m in live] == [
        ("ses_b", "box", "b1"),
        ("ses_a", "box", "a2"),
    ]
    assert await markers.live() == live


async def test_markers_survive_a_restart(tmp_path: Path) -> None:
    async with Database.in_home(tmp_path) as database:
        await MarkersRepo(database).append("ses_a", "box", "sandbox", "sbx_1", {"root": "/x"})
        await MarkersRepo(database).append("ses_b", "box", "sandbox", "sbx_2", {})
        await MarkersRepo(database).clear("ses_b", "box")
    async with Database.in_home(tmp_path) as reopened:
        live = await MarkersRepo(reopened).live()
    assert [(m.session_id, m.sandbox_id, m.data) for m in live] == [("ses_a", "sbx_1", {"root": "/x"})]


async def test_concurrent_appends_from_many_tasks_are_all_stored(db: Database) -> None:
    markers = MarkersRepo(db)
    await asyncio.gather(
        *(markers.append(f"ses_{i % 50}", f"m{i % 4}", "sandbox", f"sbx_{i}", {"i": i}) for i in range(400))
    )
    assert (await db.fetchone("SELECT COUNT(*) FROM machine_markers"))[0] == 400  # type: ignore[index]
    live = await markers.live()
    assert len(live) == len({(i % 50, i % 4) for i in range(400)})
    for marker in live:
        latest = await markers.latest(marker.session_id, marker.machine)
        assert latest == marker


async def test_marker_data_must_be_a_json_object(db: Database) -> None:
    markers = MarkersRepo(db)
    with pytest.raises(TypeError):
        await markers.append("ses_a", "box", "sandbox", "sbx", ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await markers.append("ses_a", "box", "sandbox", "sbx", {"x": object()})
    assert await markers.latest("ses_a", "box") is None
    with pytest.raises(sqlite3.IntegrityError):  # the schema refuses a marker without a sandbox too
        await db.execute(
            "INSERT INTO machine_markers (session_id, machine, kind, created_at)"
            " VALUES ('s', 'm', 'k', 'now')"
        )


async def test_closing_while_another_process_writes_does_not_fail(tmp_path: Path) -> None:
    """The `PRAGMA optimize` a close runs needs the write lock; another process holding it
    (a second server on the home, a restarted one) must not turn the close into an error."""
    from agentbox.store.approvals import ApprovalsRepo

    async with Database.in_home(tmp_path):
        pass
    db = Database.in_home(tmp_path, busy_timeout_ms=50)
    await db.__aenter__()
    for _ in range(3):  # queries through an index: what the optimize would analyze
        await ApprovalsRepo(db).pending("ses_x")
    other = sqlite3.connect(tmp_path / "agentbox.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        await db.__aexit__(None, None, None)
    finally:
        other.rollback()
        other.close()
    async with Database.in_home(tmp_path) as again:  # closed, and the home opens again
        assert await ApprovalsRepo(again).pending("ses_x") == []
