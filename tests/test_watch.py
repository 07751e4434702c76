"""Watchers on real files with real inotify: event mapping, paging, long-poll, limits, SSE resume, wait."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agentbox.machines.base import ExecRequest
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import HostView, Mount
from agentbox.machines.local import LocalMachine
from agentbox.workspace import watch
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.watch import (
    DEFAULT_EXCLUDES,
    Event,
    Overflow,
    TooManyWatchers,
    Watcher,
    WatcherNotFound,
    WatchHub,
    is_excluded,
    wait_for,
)

#: How long a test waits for something that should happen at once.
DEADLINE = 5.0
#: How long a test waits to be sure that nothing more arrives.
QUIET = 0.3


class DemoMachine(HostFiles):
    """A host-mapped machine that shows a tmp dir as `/tmp/demo`, like the seed's examples."""

    def __init__(self, host: Path) -> None:
        host.mkdir(parents=True, exist_ok=True)
        self.view = HostView([Mount("/tmp/demo", host)], "/tmp/demo")
        self.owner = None
        self.users = {}


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    return root


@pytest.fixture
async def hub(demo: Path) -> AsyncIterator[WatchHub]:
    hub = WatchHub(DemoMachine(demo))
    yield hub
    await hub.close()


async def shell(command: str, cwd: Path) -> None:
    proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", command, cwd=cwd)
    assert await proc.wait() == 0


async def take(watcher: Watcher, count: int, cursor: int = 0) -> list[Event]:
    """Poll until `count` events arrived, then make sure no more follow."""
    events: list[Event] = []
    deadline = time.monotonic() + DEADLINE
    while len(events) < count and time.monotonic() < deadline:
        page = await watcher.poll(cursor, timeout=deadline - time.monotonic())
        events += page.events
        cursor = page.cursor
    extra = await watcher.poll(cursor, timeout=QUIET)
    return events + extra.events


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def summary(events: list[Event]) -> list[tuple[int, str, str]]:
    return [(e.seq, e.type, e.relative_path) for e in events]


# -- the seed's examples -------------------------------------------------------------------


async def test_echo_into_a_file_is_create_then_write(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo", recursive=True)
    assert len(watcher.id) == 12 and int(watcher.id, 16) >= 0
    await shell("echo 'X = 1' > src/util.py", demo)
    events = await take(watcher, 2)
    assert summary(events) == [(1, "create", "src/util.py"), (2, "write", "src/util.py")]
    data = events[1].to_dict()
    assert list(data) == [
        "seq",
        "type",
        "path",
        "relative_path",
        "is_dir",
        "timestamp",
        "old_path",
        "mtime",
        "size",
        "inode",
    ]
    st = (demo / "src" / "util.py").stat()
    assert data["path"] == "/tmp/demo/src/util.py"
    assert data["is_dir"] is False and data["old_path"] is None
    assert data["size"] == 6 and data["inode"] == st.st_ino and data["mtime"] == st.st_mtime
    assert abs(events[1].timestamp - time.time()) < DEADLINE


async def test_echo_through_a_machine_shell(tmp_path: Path) -> None:
    machine = LocalMachine("local", tmp_path / "ws")
    hub = WatchHub(machine)
    try:
        watcher = hub.create(machine.root)
        await machine.exec(ExecRequest(command="echo 'X = 1' > util.py"))
        events = await take(watcher, 2)
        assert summary(events) == [(1, "create", "util.py"), (2, "write", "util.py")]
        assert events[0].path == str(Path(machine.root) / "util.py")
    finally:
        await hub.close()


async def test_touch_of_a_new_file_is_only_create(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo")
    await shell("touch build.done", demo)
    assert summary(await take(watcher, 1)) == [(1, "create", "build.done")]


async def test_touch_of_an_existing_file_is_chmod(hub: WatchHub, demo: Path) -> None:
    (demo / "old").write_text("x")
    watcher = hub.create("/tmp/demo")
    await shell("touch old", demo)
    assert summary(await take(watcher, 1)) == [(1, "chmod", "old")]


async def test_report_then_marker_loop_of_the_seed(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo", recursive=True, exclude=["*.part"])
    await shell("echo report > report.txt; touch build.done", demo)
    assert summary(await take(watcher, 3)) == [
        (1, "create", "report.txt"),
        (2, "write", "report.txt"),
        (3, "create", "build.done"),
    ]


def staged_upload(target: Path, data: bytes) -> None:
    """What an upload does: write next to the target, then rename over it."""
    part = target.parent / ".aiod-upload-da85dbba-34b4-45cb-8364-0a72009b9cb3.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    os.rename(part, target)


async def test_staged_upload_filtered_sees_only_the_rename(hub: WatchHub, demo: Path) -> None:
    plain = hub.create("/tmp/demo", recursive=True)
    filtered = hub.create("/tmp/demo", recursive=True, exclude=["*.part"])
    staged_upload(demo / "data.csv", b"a,b\n1,2\n")
    part = ".aiod-upload-da85dbba-34b4-45cb-8364-0a72009b9cb3.part"
    plain_events = await take(plain, 3)
    assert summary(plain_events) == [(1, "create", part), (2, "write", part), (3, "rename", "data.csv")]
    filtered_events = await take(filtered, 1)
    assert summary(filtered_events) == [(1, "rename", "data.csv")]
    renamed = filtered_events[0]
    assert renamed.path == "/tmp/demo/data.csv" and renamed.old_path == f"/tmp/demo/{part}"
    assert renamed.size == 8


# -- mapping of each kind ------------------------------------------------------------------


async def test_rename_reports_old_path(hub: WatchHub, demo: Path) -> None:
    (demo / "src" / "a.txt").write_text("a")
    watcher = hub.create("/tmp/demo")
    os.rename(demo / "src" / "a.txt", demo / "src" / "b.txt")
    [event] = await take(watcher, 1)
    assert (event.type, event.relative_path, event.old_path) == ("rename", "src/b.txt", "/tmp/demo/src/a.txt")


async def test_renamed_directory_keeps_reporting_under_its_new_name(hub: WatchHub, demo: Path) -> None:
    (demo / "src" / "pkg").mkdir()
    watcher = hub.create("/tmp/demo")
    os.rename(demo / "src" / "pkg", demo / "lib")
    (demo / "lib" / "new.py").touch()
    assert summary(await take(watcher, 2)) == [(1, "rename", "lib"), (2, "create", "lib/new.py")]


async def test_chmod_and_remove(hub: WatchHub, demo: Path) -> None:
    (demo / "f").write_text("x")
    (demo / "d").mkdir()
    watcher = hub.create("/tmp/demo")
    os.chmod(demo / "f", 0o600)
    os.unlink(demo / "f")
    os.rmdir(demo / "d")
    events = await take(watcher, 3)
    assert summary(events) == [(1, "chmod", "f"), (2, "remove", "f"), (3, "remove", "d")]
    assert events[1].inode is None and events[1].size is None and events[1].mtime is None
    assert [e.is_dir for e in events] == [False, False, True]


async def test_new_directories_are_watched_and_their_early_contents_reported(
    hub: WatchHub, demo: Path
) -> None:
    watcher = hub.create("/tmp/demo")
    await shell("mkdir -p a/b && echo x > a/b/f", demo)
    events = await take(watcher, 4)
    assert summary(events) == [
        (1, "create", "a"),
        (2, "create", "a/b"),
        (3, "create", "a/b/f"),
        (4, "write", "a/b/f"),
    ]
    assert [e.is_dir for e in events] == [True, True, False, False]
    (demo / "a" / "b" / "g").touch()
    assert summary(await take(watcher, 1, cursor=4)) == [(5, "create", "a/b/g")]


async def test_move_out_is_remove_and_move_in_is_create(hub: WatchHub, demo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "tree").mkdir(parents=True)
    (outside / "tree" / "inner.txt").write_text("in")
    (demo / "leaving.txt").write_text("bye")
    watcher = hub.create("/tmp/demo")
    os.rename(demo / "leaving.txt", outside / "leaving.txt")
    os.rename(outside / "tree", demo / "tree")
    events = await take(watcher, 4)
    # the move in is known at once; the move out only when no IN_MOVED_TO pairs with it
    assert summary(events) == [
        (1, "create", "tree"),
        (2, "create", "tree/inner.txt"),
        (3, "write", "tree/inner.txt"),
        (4, "remove", "leaving.txt"),
    ]
    (demo / "tree" / "later.txt").touch()
    assert [e.relative_path for e in await take(watcher, 1, cursor=4)] == ["tree/later.txt"]


async def test_rename_into_an_excluded_name_is_remove(hub: WatchHub, demo: Path) -> None:
    (demo / "data.csv").write_text("x")
    watcher = hub.create("/tmp/demo", exclude=["*.bak"])
    os.rename(demo / "data.csv", demo / "data.csv.bak")
    assert summary(await take(watcher, 1)) == [(1, "remove", "data.csv")]


async def test_file_written_while_open_reports_before_close(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "OPEN_WRITE_FLUSH_SECONDS", 0.05)
    watcher = hub.create("/tmp/demo")
    with open(demo / "log.txt", "w") as log:
        log.write("line\n")
        log.flush()
        assert summary(await take(watcher, 2)) == [(1, "create", "log.txt"), (2, "write", "log.txt")]
    assert (await watcher.poll(2, timeout=QUIET)).events == []


async def test_symlinked_directories_are_not_followed(hub: WatchHub, demo: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (demo / "link").symlink_to(elsewhere, target_is_directory=True)
    watcher = hub.create("/tmp/demo")
    (elsewhere / "x").write_text("x")
    assert (await watcher.poll(0, timeout=QUIET)).events == []


async def test_watched_root_removed(hub: WatchHub, demo: Path) -> None:
    (demo / "sub").mkdir()
    watcher = hub.create("/tmp/demo/sub")
    os.rmdir(demo / "sub")
    [event] = await take(watcher, 1)
    assert (event.type, event.relative_path, event.path, event.is_dir) == (
        "remove",
        ".",
        "/tmp/demo/sub",
        True,
    )


# -- scope: excludes, single files, missing paths ------------------------------------------


def test_exclude_matches_single_segments() -> None:
    assert is_excluded(("a", "node_modules", "x.js"), DEFAULT_EXCLUDES)
    assert is_excluded((".aiod-upload-1.part",), ["*.part"])
    assert not is_excluded(("src", "main.py"), DEFAULT_EXCLUDES)
    assert not is_excluded(("partial",), ["*.part"])
    assert is_excluded(("build", "out", "x"), ["build/out"])
    assert not is_excluded(("src", "build", "out"), ["build/out"])


async def test_default_excludes_hide_and_do_not_watch(hub: WatchHub, demo: Path) -> None:
    (demo / "node_modules" / "pkg").mkdir(parents=True)
    watcher = hub.create("/tmp/demo")
    assert watcher.scope.exclude == DEFAULT_EXCLUDES
    watched = {d.host for d in hub._dirs.values()}  # inside paths: watches never name host paths
    assert watched == {Path("/tmp/demo"), Path("/tmp/demo/src")}
    (demo / "node_modules" / "x.js").touch()
    (demo / "mod.pyc").touch()
    (demo / "ok.py").touch()
    assert summary(await take(watcher, 1)) == [(1, "create", "ok.py")]


async def test_an_exclude_list_replaces_the_defaults(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo", exclude=["*.log"])
    (demo / "node_modules").mkdir()
    (demo / "node_modules" / "x.js").touch()
    (demo / "app.log").touch()
    assert summary(await take(watcher, 2)) == [
        (1, "create", "node_modules"),
        (2, "create", "node_modules/x.js"),
    ]


async def test_non_recursive_watch_sees_only_the_top(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo", recursive=False)
    (demo / "src" / "deep.py").touch()
    (demo / "top.py").touch()
    assert summary(await take(watcher, 1)) == [(1, "create", "top.py")]


async def test_watching_a_file_sees_it_replaced(hub: WatchHub, demo: Path) -> None:
    (demo / "data.csv").write_text("old")
    (demo / "other.csv").write_text("x")
    watcher = hub.create("/tmp/demo/data.csv")
    assert watcher.path == "/tmp/demo/data.csv"
    (demo / "other.csv").write_text("y")
    staged_upload(demo / "data.csv", b"new")
    [event] = await take(watcher, 1)
    assert (event.type, event.relative_path, event.path) == ("rename", "data.csv", "/tmp/demo/data.csv")


async def test_missing_path_is_not_found(hub: WatchHub) -> None:
    with pytest.raises(WorkspaceError) as info:
        hub.create("/tmp/demo/nope")
    assert info.value.error_type == "not_found" and info.value.operation == "watch"


async def test_path_outside_the_machine_is_invalid(hub: WatchHub) -> None:
    with pytest.raises(WorkspaceError) as info:
        hub.create("/etc")
    assert info.value.error_type == "invalid_path"


# -- consuming: cursor, long-poll, limits ----------------------------------------------------


async def test_cursor_pages_through_events(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo")
    for name in "abcde":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 5)
    first = await watcher.poll(0, timeout=0, limit=2)
    assert [e.seq for e in first.events] == [1, 2] and first.cursor == 2 and not first.overflow
    second = await watcher.poll(first.cursor, timeout=0, limit=2)
    assert [e.seq for e in second.events] == [3, 4] and second.cursor == 4
    third = await watcher.poll(second.cursor, timeout=0, limit=2)
    assert [e.seq for e in third.events] == [5] and third.cursor == 5
    empty = await watcher.poll(third.cursor, timeout=0)
    assert empty.events == [] and empty.cursor == 5
    again = await watcher.poll(2, timeout=0)
    assert [e.seq for e in again.events] == [3, 4, 5]
    assert again.to_dict()["cursor"] == 5 and again.to_dict()["overflow"] is False


async def test_long_poll_wakes_as_soon_as_a_file_is_written(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo")
    started = time.monotonic()
    waiting = asyncio.ensure_future(watcher.poll(0, timeout=5))
    await asyncio.sleep(0)  # let the poll start waiting
    assert not waiting.done()
    (demo / "src" / "now.py").write_text("x")
    page = await waiting
    assert time.monotonic() - started < 1
    assert page.events[0].relative_path == "src/now.py"


async def test_timeout_zero_returns_at_once(hub: WatchHub) -> None:
    watcher = hub.create("/tmp/demo")
    started = time.monotonic()
    page = await watcher.poll(0, timeout=0)
    assert page.events == [] and page.cursor == 0 and not page.overflow
    assert time.monotonic() - started < 0.1


async def test_poll_timeout_is_clamped(hub: WatchHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "MAX_POLL_TIMEOUT", 0.2)
    watcher = hub.create("/tmp/demo")
    started = time.monotonic()
    assert (await watcher.poll(0, timeout=60)).events == []
    assert 0.15 < time.monotonic() - started < 2


async def test_poll_limit_is_clamped_and_checked(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_POLL_LIMIT", 3)
    watcher = hub.create("/tmp/demo")
    for name in "abcd":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 4)
    assert len((await watcher.poll(0, limit=3)).events) == 3
    assert len((await watcher.poll(0, limit=4)).events) == 3
    with pytest.raises(WorkspaceError) as info:
        await watcher.poll(0, limit=0)
    assert info.value.error_type == "bad_request"


async def test_cursor_must_be_a_seen_position(hub: WatchHub) -> None:
    watcher = hub.create("/tmp/demo")
    for bad in (-1, 1):
        with pytest.raises(WorkspaceError) as info:
            await watcher.poll(bad)
        assert info.value.error_type == "bad_request"


async def test_overflow_when_the_ring_drops_unread_events(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_EVENTS_PER_WATCHER", 4)
    watcher = hub.create("/tmp/demo")
    for name in "abcd":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 4)
    full = await watcher.poll(0)
    assert [e.seq for e in full.events] == [1, 2, 3, 4] and not full.overflow  # exactly at the limit
    for name in "efghi":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 9)
    lost = await watcher.poll(full.cursor)
    assert lost.overflow and [e.seq for e in lost.events] == [6, 7, 8, 9]
    (demo / "j").touch()
    after = await watcher.poll(lost.cursor, timeout=DEADLINE)
    assert not after.overflow and [e.seq for e in after.events] == [10]


async def test_ring_dropping_read_events_is_not_overflow(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_EVENTS_PER_WATCHER", 2)
    watcher = hub.create("/tmp/demo")
    cursor = 0
    for name in "abcd":
        (demo / name).touch()
        page = await watcher.poll(cursor, timeout=DEADLINE)
        assert not page.overflow
        cursor = page.cursor
    assert cursor == 4


async def test_too_many_watched_directories_is_overflow(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_WATCHED_DIRS", 3)
    (demo / "two").mkdir()
    watcher = hub.create("/tmp/demo")  # demo, src, two: exactly the limit
    assert len(watcher._wds) == 3
    assert not (await watcher.poll(0)).overflow
    (demo / "three").mkdir()
    page = await watcher.poll(0, timeout=DEADLINE)
    assert summary(page.events) == [(1, "create", "three")] and page.overflow
    assert not (await watcher.poll(1, timeout=QUIET)).overflow


async def test_watcher_limit_per_hub(hub: WatchHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "MAX_WATCHERS_PER_HUB", 3)
    watchers = [hub.create("/tmp/demo") for _ in range(3)]
    with pytest.raises(TooManyWatchers) as info:
        hub.create("/tmp/demo")
    assert info.value.error_type == "bad_request" and info.value.limit == 3
    hub.delete(watchers[0].id)
    hub.create("/tmp/demo")
    assert len(hub.list()) == 3


# -- lifecycle -------------------------------------------------------------------------------


async def test_get_list_and_delete(hub: WatchHub, demo: Path) -> None:
    first = hub.create("/tmp/demo")
    second = hub.create("/tmp/demo/src")
    assert hub.get(first.id) is first
    assert {w.id for w in hub.list()} == {first.id, second.id}
    assert first.to_dict()["path"] == "/tmp/demo" and first.to_dict()["exclude"] == list(DEFAULT_EXCLUDES)
    waiting = asyncio.ensure_future(first.poll(0, timeout=DEADLINE))
    await asyncio.sleep(0)
    hub.delete(first.id)
    assert (await waiting).events == []
    with pytest.raises(WatcherNotFound) as info:
        hub.get(first.id)
    assert info.value.error_type == "not_found"
    with pytest.raises(WatcherNotFound):
        hub.delete(first.id)
    assert {d.host for d in hub._dirs.values()} == {Path("/tmp/demo/src")}  # the shared watch stayed
    (demo / "src" / "x").touch()
    assert summary(await take(second, 1)) == [(1, "create", "x")]
    assert first.last_seq == 0
    hub.delete(second.id)
    assert hub._dirs == {}


async def test_close_stops_the_reader(demo: Path) -> None:
    hub = WatchHub(DemoMachine(demo))
    watcher = hub.create("/tmp/demo")
    reader = hub._reader
    assert reader is not None and not reader.done()
    await hub.close()
    assert reader.done() and watcher.closed and hub.list() == []
    with pytest.raises(WorkspaceError):
        hub.create("/tmp/demo")


# -- SSE stream ------------------------------------------------------------------------------


async def test_stream_resumes_without_gaps_or_duplicates(hub: WatchHub, demo: Path) -> None:
    watcher = hub.create("/tmp/demo")
    for name in "abc":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 3)
    seen: list[int] = []

    async def read(after: int, count: int) -> None:
        async for item in watcher.stream(after):
            assert isinstance(item, Event)
            seen.append(item.seq)
            if len(seen) == count:
                return

    first = asyncio.ensure_future(read(0, 2))
    await asyncio.wait_for(first, DEADLINE)
    resumed = asyncio.ensure_future(read(seen[-1], 4))
    (demo / "d").touch()
    await asyncio.wait_for(resumed, DEADLINE)
    assert seen == [1, 2, 3, 4]


async def test_stream_marks_lost_events(hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "MAX_EVENTS_PER_WATCHER", 2)
    watcher = hub.create("/tmp/demo")
    for name in "abcd":
        (demo / name).touch()
    await until(lambda: watcher.last_seq == 4)
    items: list[Event | Overflow] = []
    async for item in watcher.stream(0):
        items.append(item)
        if len(items) == 3:
            break
    assert items[0] == Overflow(0)
    assert [e.seq for e in items[1:] if isinstance(e, Event)] == [3, 4]
    assert Overflow(0).to_dict() == {"overflow": True, "after_seq": 0}


async def test_stream_ends_when_the_watcher_is_deleted(hub: WatchHub) -> None:
    watcher = hub.create("/tmp/demo")

    async def drain() -> list[Event | Overflow]:
        return [item async for item in watcher.stream(0)]

    task = asyncio.ensure_future(drain())
    await asyncio.sleep(0)
    hub.delete(watcher.id)
    assert await asyncio.wait_for(task, DEADLINE) == []


# -- wait_for --------------------------------------------------------------------------------


async def test_wait_for_an_existing_file_is_an_immediate_create(hub: WatchHub, demo: Path) -> None:
    (demo / "ready").write_text("x")
    event = await wait_for(hub, "/tmp/demo/ready", timeout=DEADLINE, event_types=["create"])
    assert event is not None and (event.type, event.path, event.size) == ("create", "/tmp/demo/ready", 1)
    assert hub._watchers == {} and hub._dirs == {}


async def test_wait_for_a_write(hub: WatchHub, demo: Path) -> None:
    (demo / "report.txt").write_text("")
    waiting = asyncio.ensure_future(
        wait_for(hub, "/tmp/demo/report.txt", timeout=DEADLINE, event_types=["write"])
    )
    await asyncio.sleep(0)
    assert hub.list() == [] and len(hub._watchers) == 1  # wait's watcher is not listed
    (demo / "other.txt").write_text("x")
    (demo / "report.txt").write_text("done")
    event = await waiting
    assert event is not None and (event.type, event.path) == ("write", "/tmp/demo/report.txt")


async def test_wait_for_a_path_whose_directories_do_not_exist_yet(hub: WatchHub, demo: Path) -> None:
    waiting = asyncio.ensure_future(
        wait_for(hub, "/tmp/demo/out/x/done", timeout=DEADLINE, event_types=["create"])
    )
    await asyncio.sleep(0)
    await shell("mkdir -p out/x && touch out/x/nope out/x/done", demo)
    event = await waiting
    assert event is not None and event.path == "/tmp/demo/out/x/done"


async def test_wait_for_create_is_answered_by_a_rename_onto_the_path(hub: WatchHub, demo: Path) -> None:
    waiting = asyncio.ensure_future(
        wait_for(hub, "/tmp/demo/data.csv", timeout=DEADLINE, event_types=["create"])
    )
    await asyncio.sleep(0)
    staged_upload(demo / "data.csv", b"a,b\n")
    event = await waiting
    assert event is not None and (event.type, event.path) == ("rename", "/tmp/demo/data.csv")


async def test_wait_for_a_removal(demo: Path) -> None:
    (demo / "lock").touch()
    waiting = asyncio.ensure_future(
        wait_for(DemoMachine(demo), "/tmp/demo/lock", timeout=DEADLINE, event_types=["remove"])
    )
    await asyncio.sleep(0)  # one step: the short-lived hub is watching before the file goes
    (demo / "lock").unlink()
    event = await waiting
    assert event is not None and (event.type, event.path) == ("remove", "/tmp/demo/lock")


async def test_wait_for_times_out(demo: Path) -> None:
    started = time.monotonic()
    assert await wait_for(DemoMachine(demo), "/tmp/demo/never", timeout=0.2) is None
    assert time.monotonic() - started < 2


async def test_wait_for_checks_event_types(hub: WatchHub) -> None:
    with pytest.raises(WorkspaceError) as info:
        await wait_for(hub, "/tmp/demo/x", timeout=0, event_types=["modify"])
    assert info.value.error_type == "bad_request"


async def test_files_created_while_a_new_directory_is_being_watched_are_reported_once(
    hub: WatchHub, demo: Path
) -> None:
    count = 300
    watcher = hub.create("/tmp/demo")

    def writer() -> None:
        (demo / "burst").mkdir()
        for i in range(count):
            (demo / "burst" / f"f{i}").write_text("x")

    thread = asyncio.ensure_future(asyncio.to_thread(writer))
    events = await take(watcher, 1 + 2 * count)
    await thread
    per_file: dict[str, list[str]] = {}
    for e in events:
        per_file.setdefault(e.relative_path, []).append(e.type)
    assert per_file.pop("burst") == ["create"]
    assert per_file == {f"burst/f{i}": ["create", "write"] for i in range(count)}


@pytest.mark.slow
async def test_kernel_queue_overflow_is_reported(
    hub: WatchHub, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "MAX_EVENTS_PER_WATCHER", 10**6)  # so only the kernel can lose events
    queue = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    watcher = hub.create("/tmp/demo")
    for i in range(queue + 10):  # no await: the reader cannot drain the kernel queue meanwhile
        os.close(os.open(demo / f"f{i}", os.O_CREAT | os.O_WRONLY))
    page = await watcher.poll(0, timeout=DEADLINE)
    while not page.overflow and page.events:
        page = await watcher.poll(page.cursor, timeout=DEADLINE, limit=1000)
    assert page.overflow
