"""The file store on a real SQLite file and real blobs: content addressing, the 100 MiB limit, delete."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentbox.ids import FILE, is_id
from agentbox.store.db import Database
from agentbox.store.files import (
    BLOBS_DIR_NAME,
    MAX_FILE_BYTES,
    MAX_FILENAME_BYTES,
    PARTIAL_PREFIX,
    FileNotFound,
    FileStore,
    FileTooLarge,
    InvalidFile,
)

MIB = 1024 * 1024


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileStore]:
    async with Database.in_home(tmp_path / "home") as db:
        yield FileStore(db, tmp_path / "home")


def blob_files(store: FileStore) -> list[Path]:
    """Every file under blobs/, partials included."""
    if not store.blobs.exists():
        return []
    return sorted(p for p in store.blobs.rglob("*") if p.is_file())


async def zeros(total: int, chunk: int = 4 * MIB) -> AsyncIterator[bytes]:
    """A generated stream of `total` zero bytes (nothing of it held in memory at once)."""
    block = bytes(chunk)
    left = total
    while left > 0:
        n = min(chunk, left)
        yield block if n == chunk else bytes(n)
        left -= n


def sha_of_zeros(total: int) -> str:
    digest = hashlib.sha256()
    block = bytes(4 * MIB)
    left = total
    while left > 0:
        n = min(len(block), left)
        digest.update(block[:n])
        left -= n
    return digest.hexdigest()


async def test_put_path_stores_a_copy_under_its_sha256(store: FileStore, tmp_path: Path) -> None:
    src = tmp_path / "report.csv"
    src.write_bytes(b"a,b\n1,2\n")
    record = await store.put_path(src, "report.csv", session_id="ses_x", source="delivery", turn_id="trn_1")
    sha = hashlib.sha256(b"a,b\n1,2\n").hexdigest()
    assert is_id(record["id"], FILE)
    assert (record["filename"], record["bytes"], record["sha256"]) == ("report.csv", 8, sha)
    assert (record["session_id"], record["source"], record["turn_id"], record["tool_use_id"]) == (
        "ses_x",
        "delivery",
        "trn_1",
        None,
    )
    blob = await store.open(record["id"])
    assert blob == tmp_path / "home" / BLOBS_DIR_NAME / sha[:2] / sha
    assert blob.read_bytes() == b"a,b\n1,2\n"
    assert await store.get(record["id"]) == record
    src.write_bytes(b"changed")  # a copy, not a reference
    assert blob.read_bytes() == b"a,b\n1,2\n"


async def test_same_bytes_twice_is_two_files_and_one_blob(store: FileStore, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"same")
    first = await store.put_path(tmp_path / "a.txt", "a.txt", session_id=None, source="upload")

    async def body() -> AsyncIterator[bytes]:
        yield b"sa"
        yield b"me"

    second = await store.put_stream(body(), "b.txt", session_id="ses_y", source="upload")
    assert first["id"] != second["id"] and first["sha256"] == second["sha256"]
    assert [p.name for p in blob_files(store)] == [first["sha256"]]


async def test_the_100_mib_boundary(store: FileStore, tmp_path: Path) -> None:
    # Exactly the limit is stored (generated stream, never held in memory) ...
    record = await store.put_stream(zeros(MAX_FILE_BYTES), "big.bin", session_id="s", source="upload")
    assert record["bytes"] == MAX_FILE_BYTES == 100 * MIB
    assert record["sha256"] == sha_of_zeros(MAX_FILE_BYTES)
    assert (await store.open(record["id"])).stat().st_size == MAX_FILE_BYTES
    # ... one byte more is refused with nothing stored: no row, no new blob, no partial left.
    with pytest.raises(FileTooLarge) as err:
        await store.put_stream(zeros(MAX_FILE_BYTES + 1), "bigger.bin", session_id="s", source="upload")
    assert err.value.limit == MAX_FILE_BYTES
    assert [r["id"] for r in await store.list()] == [record["id"]]
    assert [p.name for p in blob_files(store)] == [record["sha256"]]
    # From a path (sparse files, so the test writes no more): the size is checked before any copy.
    sparse = tmp_path / "sparse.bin"
    with sparse.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(FileTooLarge) as err:
        await store.put_path(sparse, "sparse.bin", session_id="s", source="delivery")
    assert err.value.size == MAX_FILE_BYTES + 1
    os.truncate(sparse, MAX_FILE_BYTES)
    same = await store.put_path(sparse, "sparse.bin", session_id="s", source="delivery")
    assert same["sha256"] == record["sha256"]  # 100 MiB of zeros again: the existing blob
    assert [p.name for p in blob_files(store)] == [record["sha256"]]


async def test_a_smaller_limit_is_honoured_at_its_boundary(store: FileStore, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"12345")
    assert (await store.put_path(src, "f", session_id=None, source="upload", max_bytes=5))["bytes"] == 5
    with pytest.raises(FileTooLarge):
        await store.put_path(src, "f", session_id=None, source="upload", max_bytes=4)


async def test_delete_keeps_a_shared_blob_until_the_last_live_file_goes(
    store: FileStore, tmp_path: Path
) -> None:
    (tmp_path / "x").write_bytes(b"shared bytes")
    one = await store.put_path(tmp_path / "x", "one", session_id="s", source="delivery")
    two = await store.put_path(tmp_path / "x", "two", session_id="s", source="delivery")
    blob = await store.open(one["id"])
    await store.delete(one["id"])
    assert blob.exists()
    with pytest.raises(FileNotFound):
        await store.get(one["id"])
    with pytest.raises(FileNotFound):
        await store.open(one["id"])
    with pytest.raises(FileNotFound):
        await store.delete(one["id"])  # already deleted
    assert [r["id"] for r in await store.list("s")] == [two["id"]]
    await store.delete(two["id"])
    assert not blob.exists() and blob_files(store) == []
    # The rows stay, marked, for history.
    rows = await store.db.fetchall("SELECT id, deleted_at FROM files ORDER BY id")
    assert [r["id"] for r in rows] == [one["id"], two["id"]] and all(r["deleted_at"] for r in rows)
    # Storing the same bytes again brings the blob back.
    three = await store.put_path(tmp_path / "x", "three", session_id="s", source="delivery")
    assert (await store.open(three["id"])).read_bytes() == b"shared bytes"


async def test_list_is_newest_first_and_filters_by_session(store: FileStore, tmp_path: Path) -> None:
    made = []
    for i, session in enumerate(["s1", "s2", "s1", None]):
        (tmp_path / str(i)).write_bytes(str(i).encode())
        made.append(await store.put_path(tmp_path / str(i), f"f{i}", session_id=session, source="upload"))
    assert [r["id"] for r in await store.list()] == [r["id"] for r in reversed(made)]
    assert [r["filename"] for r in await store.list("s1")] == ["f2", "f0"]
    assert await store.list("nobody") == []
    with pytest.raises(FileNotFound):
        await store.get("file_01jzzzzzzzzzzzzzzzzzzzzzzz")


async def test_only_regular_files_are_taken(store: FileStore, tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "dir", "fifo", "missing"):
        with pytest.raises(InvalidFile):
            await store.put_path(tmp_path / name, name, session_id=None, source="upload")
    assert blob_files(store) == []


@pytest.mark.parametrize(
    "filename",
    ["", ".", "..", "a/b", "nul\0", "x" * (MAX_FILENAME_BYTES + 1), "é" * (MAX_FILENAME_BYTES // 2 + 1)],
)
async def test_bad_file_names_are_refused(store: FileStore, tmp_path: Path, filename: str) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(InvalidFile):
        await store.put_path(tmp_path / "f", filename, session_id=None, source="upload")


async def test_longest_name_and_unknown_source(store: FileStore, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    name = "x" * MAX_FILENAME_BYTES
    assert (await store.put_path(tmp_path / "f", name, session_id=None, source="upload"))["filename"] == name
    with pytest.raises(InvalidFile, match="source"):
        await store.put_path(tmp_path / "f", "f", session_id=None, source="stolen")


async def test_a_broken_or_cancelled_stream_leaves_nothing(store: FileStore) -> None:
    async def breaks() -> AsyncIterator[bytes]:
        yield b"partial data"
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        await store.put_stream(breaks(), "f", session_id=None, source="upload")

    started = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield b"some"
        started.set()
        await asyncio.Event().wait()
        yield b"never"

    task = asyncio.create_task(store.put_stream(stalls(), "f", session_id=None, source="upload"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(p.name.startswith(PARTIAL_PREFIX) for p in blob_files(store))
    assert await store.list() == []


async def test_migrations_002_and_003_are_applied(store: FileStore) -> None:
    rows = await store.db.fetchall("SELECT version, name FROM schema_migrations ORDER BY version")
    names = {row["version"]: row["name"] for row in rows}
    assert names[2] == "files" and names[3] == "todos"
