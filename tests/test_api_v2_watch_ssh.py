"""`/v2/watch` on an ssh machine, over a real server and a real sshd on loopback.

The server routes sessions to two ssh machines on the same sshd: one that watches with the
remote `inotifywait`, one forced to poll (`watch = "polling"`). Changes are made on the
remote through `/v2/commands`, so the events come from the remote host's own watch.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server, Sshd, start_server, stop_server, traversable
from test_api_v2 import Aio
from test_api_v2_watch import DEADLINE, EVENT_FIELDS, SSE, poll, stream, summary

from agentbox.workspace.watch import MAX_EVENTS_PER_WATCHER, MAX_WATCHERS_PER_HUB

#: Seconds between two scans of the polling machine.
FAST_POLL = 0.2
#: The machines of the server, by how they watch.
MACHINES = {"inotifywait": "ssh-inotify", "polling": "ssh-poll"}
#: Files made at a time before the overflow test lets the watch catch up.
BURST = 500
#: Seconds the overflow test's MAX_EVENTS_PER_WATCHER events may take to arrive: with
#: inotifywait each is stat'ed over SFTP (about a thousand a second here).
OVERFLOW_DEADLINE = 60.0


@dataclass
class Remote:
    """One session on an ssh machine: its API and a fresh directory of its own to watch."""

    sb: Aio
    mode: str
    dir: str

    def run(self, command: str) -> None:
        self.sb.run(f"cd {self.dir} && {command}")


@pytest.fixture(scope="module")
def remote_server(sshd: Sshd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    base = traversable(tmp_path_factory.mktemp("watch-ssh"), tmp_path_factory)
    home, root = base / "home", sshd.owned_dir(base / "remote")
    home.mkdir()
    entries = []
    for mode, name in MACHINES.items():
        options = sshd.options(root=str(root), watch=mode, poll_seconds=FAST_POLL)
        lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
        entries.append(f'[machines.{name}]\nkind = "ssh"\n{lines}\n')
    config = base / "agentbox.toml"
    config.write_text(f"delegable = {json.dumps(['sandbox', *MACHINES.values()])}\n" + "".join(entries))
    server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    yield server, root
    stop_server(server)


def session_on(server: Server, machine: str) -> Aio:
    with httpx.Client(base_url=server.url, timeout=DEADLINE) as client:
        made = client.post("/v1/sessions", json={"model": "scripted", "machine": machine})
    assert made.status_code in (200, 201), made.text
    return Aio(server, made.json()["id"])


@pytest.fixture(params=list(MACHINES))
def remote(request: pytest.FixtureRequest, remote_server: tuple[Server, Path]) -> Iterator[Remote]:
    server, root = remote_server
    sb = session_on(server, MACHINES[request.param])
    where = f"{root}/{uuid.uuid4().hex[:8]}"
    sb.run(f"mkdir -p {where}/src")
    yield Remote(sb, request.param, where)
    sb.http.close()


def collect(sb: Aio, watcher: str, done: Any, cursor: int = 0) -> list[dict[str, Any]]:
    """Long-poll with the cursor until `done(events)` holds."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + DEADLINE
    while not done(events):
        assert time.monotonic() < deadline, f"not within {DEADLINE} s: {summary(events)}"
        page = poll(sb, watcher, cursor=cursor, timeout=2)
        events += page["events"]
        cursor = page["cursor"]
    return events


def until(path: str, kind: str) -> Any:
    return lambda events: any((e["type"], e["relative_path"]) == (kind, path) for e in events)


def inotifywaits(path: str) -> list[int]:
    """Pids of the inotifywait processes watching `path` (the remote host is this host)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"inotifywait") and path.encode() in argv:
            found.append(int(pid))
    return found


def eventually(check: Any, what: str, within: float = DEADLINE) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------- poll


def test_poll_sees_the_remote_changes(remote: Remote) -> None:
    sb = remote.sb
    made = sb.http.post("/v2/watch", json={"path": remote.dir, "recursive": True}).json()
    watcher = made["watcher_id"]
    assert made["data"]["path"] == remote.dir and sb.get(f"/v2/watch/{watcher}")["last_seq"] == 0
    assert watcher in [w["watcher_id"] for w in sb.get("/v2/watch")["watchers"]]

    remote.run("echo 'X = 1' > src/util.py")
    first = collect(sb, watcher, until("src/util.py", "write"))
    assert summary(first) == [(1, "create", "src/util.py"), (2, "write", "src/util.py")]
    event = first[1]
    assert list(event) == EVENT_FIELDS
    assert event["path"] == f"{remote.dir}/src/util.py" and event["is_dir"] is False
    assert event["size"] == 6 and event["inode"] is None and event["old_path"] is None

    remote.run("mv src/util.py src/lib.py && mkdir src/pkg && rm src/lib.py && touch zz.done")
    rest = collect(sb, watcher, until("zz.done", "create"), cursor=2)
    if remote.mode == "inotifywait":  # moves are paired; a directory is said to be one
        assert summary(rest) == [
            (3, "rename", "src/lib.py"),
            (4, "create", "src/pkg"),
            (5, "remove", "src/lib.py"),
            (6, "create", "zz.done"),
        ]
        assert rest[0]["old_path"] == f"{remote.dir}/src/util.py" and rest[1]["is_dir"] is True
    else:  # one scan saw util.py gone, pkg and zz.done made; lib.py came and went between scans
        assert summary(rest) == [
            (3, "remove", "src/util.py"),
            (4, "create", "src/pkg"),
            (5, "create", "zz.done"),
        ]
        assert rest[1]["is_dir"] is True
    sb.delete(f"/v2/watch/{watcher}")


def test_excludes_apply_to_remote_events(remote: Remote) -> None:
    sb = remote.sb
    watcher = sb.post("/v2/watch", path=remote.dir, exclude=["*.tmp", "build"])["watcher_id"]
    remote.run("mkdir build && echo x > build/out && echo a > .data.tmp && mv .data.tmp data.csv")
    events = collect(sb, watcher, until("data.csv", "rename" if remote.mode == "inotifywait" else "write"))
    if remote.mode == "inotifywait":  # the staged file's own events are hidden; its rename is not
        assert summary(events) == [(1, "rename", "data.csv")]
    else:
        assert summary(events) == [(1, "create", "data.csv"), (2, "write", "data.csv")]
    sb.delete(f"/v2/watch/{watcher}")


def test_a_watched_file_and_a_missing_path(remote: Remote) -> None:
    sb = remote.sb
    remote.run("echo old > notes.txt")
    watcher = sb.post("/v2/watch", path=f"{remote.dir}/notes.txt")["watcher_id"]
    remote.run("echo other > other.txt && echo new >> notes.txt")
    events = collect(sb, watcher, until("notes.txt", "write"))
    assert summary(events) == [(1, "write", "notes.txt")]  # other.txt, beside it, is not watched
    sb.delete(f"/v2/watch/{watcher}")

    missing = sb.http.post("/v2/watch", json={"path": f"{remote.dir}/nowhere"})
    assert missing.status_code == 404, missing.text
    assert missing.json()["data"]["error_type"] == "not_found"
    assert missing.json()["data"]["errno_name"] == "ENOENT"
    assert inotifywaits(f"{remote.dir}/nowhere") == []


def test_wait_for_a_path_whose_directories_do_not_exist_yet(remote: Remote) -> None:
    sb = remote.sb
    sb.post(
        "/v2/commands",
        mode="async",
        command=f"sleep 0.5; mkdir -p {remote.dir}/a/b; echo x > {remote.dir}/a/b/f",
    )
    waited = sb.http.post("/v1/file/watch/wait", json={"path": f"{remote.dir}/a/b/f", "timeout": DEADLINE})
    assert waited.status_code == 200, waited.text
    event = waited.json()["data"]["event"]
    assert (event["type"], event["path"]) == ("create", f"{remote.dir}/a/b/f")
    present = sb.http.post(
        "/v1/file/watch/wait", json={"path": f"{remote.dir}/a/b/f", "event_types": ["create"]}
    )
    assert present.json()["data"]["event"]["size"] == 2  # there already: answered at once
    quiet = sb.http.post(
        "/v1/file/watch/wait",
        json={"path": f"{remote.dir}/a/b/f", "timeout": 0.5, "event_types": ["write", "remove"]},
    )
    assert quiet.status_code == 503
    eventually(lambda: inotifywaits(f"{remote.dir}/a/b") == [], "the waits' watches ended")


# ---------------------------------------------------------------- SSE


def test_sse_streams_and_resumes(remote: Remote) -> None:
    sb = remote.sb
    watcher = sb.post("/v2/watch", path=remote.dir)["watcher_id"]
    with stream(sb, watcher) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        remote.run("echo 'X = 1' > src/util.py")
        first = sse.changes(2)
    assert [f.id for f in first] == [f"{watcher}:1", f"{watcher}:2"]
    assert [f.json() for f in first] == poll(sb, watcher)["events"]

    remote.run("echo more >> src/util.py")  # while nobody listens
    with stream(sb, watcher, headers={"Last-Event-ID": first[-1].id}) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        (resumed,) = sse.changes(1)
        assert (resumed.id, resumed.json()["type"]) == (f"{watcher}:3", "write")
        remote.run("touch new")
        (later,) = sse.changes(1)
        assert (later.id, later.json()["type"], later.json()["relative_path"]) == (
            f"{watcher}:4",
            "create",
            "new",
        )
        sb.delete(f"/v2/watch/{watcher}")
        assert list(sse.lines) == []  # the stream ends with the watcher


def test_sse_reports_overflow(remote: Remote) -> None:
    sb = remote.sb
    watcher = sb.post("/v2/watch", path=remote.dir, exclude=[])["watcher_id"]
    files = MAX_EVENTS_PER_WATCHER + 100  # one create each: more than the ring keeps
    remote.run(
        f"i=0; while [ $i -lt {files} ]; do : > f$i; i=$((i+1)); "
        f"[ $((i % {BURST})) -eq 0 ] && sleep 0.05; done; true"
    )
    eventually(lambda: poll(sb, watcher, cursor=0)["overflow"], "overflow was reported", OVERFLOW_DEADLINE)
    with stream(sb, watcher) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        overflow = sse.next()
        assert overflow.event == "overflow" and overflow.json() == {"overflow": True, "after_seq": 0}
    sb.delete(f"/v2/watch/{watcher}")


# ---------------------------------------------------------------- the remote process and the limits


@pytest.mark.parametrize("remote", ["inotifywait"], indirect=True)
def test_deleting_a_watcher_ends_its_remote_inotifywait(remote: Remote) -> None:
    sb = remote.sb
    watcher = sb.post("/v2/watch", path=remote.dir)["watcher_id"]
    (pid,) = inotifywaits(remote.dir)
    sb.delete(f"/v2/watch/{watcher}")
    eventually(lambda: not Path(f"/proc/{pid}").exists(), f"inotifywait {pid} ended")


@pytest.mark.parametrize("remote", ["inotifywait"], indirect=True)
def test_watchers_at_their_limit(remote: Remote) -> None:
    sb = remote.sb
    made = [sb.post("/v2/watch", path=remote.dir)["watcher_id"] for _ in range(MAX_WATCHERS_PER_HUB)]
    assert len(inotifywaits(remote.dir)) == MAX_WATCHERS_PER_HUB
    refused = sb.http.post("/v2/watch", json={"path": remote.dir})
    assert refused.status_code == 400 and refused.json()["data"]["exception_type"] == "TooManyWatchers"
    sb.delete(f"/v2/watch/{made.pop()}")
    made.append(sb.post("/v2/watch", path=remote.dir)["watcher_id"])  # the freed slot is usable

    remote.run("touch a b c")
    last = made[-1]
    collect(sb, last, until("c", "create"))
    assert summary(poll(sb, last, limit=1)["events"]) == [(1, "create", "a")]
    assert poll(sb, last, cursor=3)["events"] == []
    assert sb.http.get(f"/v2/watch/{last}/poll", params={"cursor": 4}).status_code == 400
    for watcher in made:
        sb.delete(f"/v2/watch/{watcher}")
    eventually(lambda: inotifywaits(remote.dir) == [], "every inotifywait ended")
