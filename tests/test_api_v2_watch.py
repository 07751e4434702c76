"""`/v2/watch` over a real server: the seed's poll outputs, staging filters, SSE with resume.

Changes are made the seed's way, through `/v2/commands` inside the real sandbox and through
the file routes, so the events come from real inotify on the sandbox's directories. SSE is
read incrementally from the real uvicorn stream.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import Server, on_kinds
from test_api_v2 import Aio

from agentbox.api.v2_watch import MAX_HEARTBEAT_SECONDS, MIN_HEARTBEAT_SECONDS
from agentbox.workspace.watch import MAX_EVENTS_PER_WATCHER

#: How long a test waits for something that should happen at once.
DEADLINE = 10.0
EVENT_FIELDS = [
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


#: Host-file kinds watch with the server's own inotify; ssh's watch stream has its own tests
#: (test_api_v2_watch_ssh.py), since its events are coarser where the remote host cannot say more.
pytestmark = on_kinds("sandbox", "docker")


@pytest.fixture
def sb(kind_server: Server) -> Iterator[Aio]:
    aio = Aio.fresh(kind_server)
    aio.post("/v2/fs/mkdir", path="/tmp/demo/src", parents=True)
    yield aio
    aio.http.close()


def poll(sb: Aio, watcher_id: str, **params: Any) -> dict[str, Any]:
    return sb.get(f"/v2/watch/{watcher_id}/poll", **params)  # type: ignore[no-any-return]


def summary(events: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    return [(e["seq"], e["type"], e["relative_path"]) for e in events]


def collect(sb: Aio, watcher_id: str, until: str) -> list[dict[str, Any]]:
    """Poll with the cursor until an event for `until` arrives (the seed's waiting loop)."""
    events: list[dict[str, Any]] = []
    cursor = 0
    deadline = time.monotonic() + DEADLINE
    while not any(e["relative_path"] == until for e in events):
        assert time.monotonic() < deadline, f"no event for {until}: {summary(events)}"
        page = poll(sb, watcher_id, cursor=cursor, timeout=2)
        events += page["events"]
        cursor = page["cursor"]
    return events


# ---------------------------------------------------------------- the seed's outputs


def test_seed_poll_create_then_write(sb: Aio) -> None:
    watcher = sb.post("/v2/watch", path="/tmp/demo", recursive=True)
    watcher = watcher["watcher_id"]
    sb.post("/v2/commands", command="echo 'X = 1' > /tmp/demo/src/util.py")
    page = poll(sb, watcher, timeout=2)
    assert summary(page["events"]) == [(1, "create", "src/util.py"), (2, "write", "src/util.py")]
    assert page["cursor"] == 2 and page["overflow"] is False
    event = page["events"][1]
    assert list(event) == EVENT_FIELDS
    assert event["path"] == "/tmp/demo/src/util.py" and event["size"] == 6 and event["old_path"] is None
    assert sb.delete(f"/v2/watch/{watcher}")["deleted"] is True


def test_seed_staged_upload_seen_through_a_part_filter(sb: Aio) -> None:
    plain = sb.post("/v2/watch", path="/tmp/demo", recursive=True)
    plain = plain["watcher_id"]
    filtered = sb.post("/v2/watch", path="/tmp/demo", recursive=True, exclude=["*.part"])["watcher_id"]
    sb.http.post(
        "/v2/fs/upload", files={"file": ("data.csv", b"a,b\n1,2\n")}, data={"path": "/tmp/demo/data.csv"}
    )

    assert summary(poll(sb, filtered, timeout=2)["events"]) == [(1, "rename", "data.csv")]
    seen = collect(sb, plain, until="data.csv")
    part = re.compile(r"\.aiod-upload-[0-9a-f-]{36}\.part")
    assert all(part.fullmatch(e["relative_path"]) for e in seen[:-1]) and seen[0]["type"] == "create"
    assert (seen[-1]["type"], seen[-1]["relative_path"]) == ("rename", "data.csv")
    assert part.fullmatch(seen[-1]["old_path"].rsplit("/", 1)[1])
    sb.delete(f"/v2/watch/{plain}")
    sb.delete(f"/v2/watch/{filtered}")


def test_seed_wait_for_the_next_change(sb: Aio) -> None:
    watcher = sb.post("/v2/watch", path="/tmp/demo", recursive=True, exclude=["*.part"])["watcher_id"]
    sb.post(
        "/v2/commands",
        mode="async",
        command="sleep 1; echo report > /tmp/demo/report.txt; touch /tmp/demo/build.done",
    )
    printed = []
    cursor = 0
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        page = poll(sb, watcher, cursor=cursor, timeout=30)
        printed += summary(page["events"])
        cursor = page["cursor"]
        if any(e["relative_path"] == "build.done" for e in page["events"]):
            break
    assert printed == [(1, "create", "report.txt"), (2, "write", "report.txt"), (3, "create", "build.done")]
    sb.delete(f"/v2/watch/{watcher}")


# ---------------------------------------------------------------- the resource


def test_watcher_resource_and_poll_parameters(sb: Aio) -> None:
    created = sb.http.post("/v2/watch", json={"path": "/tmp/demo"}).json()
    watcher = created["watcher_id"]
    assert created["data"]["watcher_id"] == watcher and created["data"]["path"] == "/tmp/demo"
    assert watcher in [w["watcher_id"] for w in sb.get("/v2/watch")["watchers"]]
    assert sb.get(f"/v2/watch/{watcher}")["last_seq"] == 0

    started = time.monotonic()
    assert poll(sb, watcher)["events"] == []  # timeout defaults to 0: no wait
    assert time.monotonic() - started < 1
    sb.run("touch /tmp/demo/a /tmp/demo/b /tmp/demo/c")
    first = collect(sb, watcher, until="c")
    assert summary(first) == [(1, "create", "a"), (2, "create", "b"), (3, "create", "c")]
    assert summary(poll(sb, watcher, since=1, limit=1)["events"]) == [(2, "create", "b")]
    assert poll(sb, watcher, cursor=3)["cursor"] == 3

    too_far = sb.http.get(f"/v2/watch/{watcher}/poll", params={"cursor": 4})
    assert too_far.status_code == 400 and too_far.json()["data"]["error_type"] == "bad_request"
    assert sb.http.get(f"/v2/watch/{watcher}/poll", params={"limit": 0}).status_code == 400
    nan = sb.http.get(f"/v2/watch/{watcher}/poll", params={"timeout": "nan"})
    assert nan.status_code == 400 and nan.headers["content-type"].startswith("text/plain")

    sb.delete(f"/v2/watch/{watcher}")
    for method, route in (
        ("GET", f"/v2/watch/{watcher}/poll"),
        ("GET", f"/v2/watch/{watcher}/events"),
        ("GET", f"/v2/watch/{watcher}"),
        ("DELETE", f"/v2/watch/{watcher}"),
    ):
        gone = sb.http.request(method, route)
        assert gone.status_code == 404 and gone.json()["data"]["error_type"] == "not_found", route
    missing = sb.http.post("/v2/watch", json={"path": "/tmp/nowhere"})
    assert missing.status_code == 404 and missing.json()["data"]["errno_name"] == "ENOENT"
    assert sb.http.post("/v2/watch", json={"recursive": True}).json()["errors"][0]["location"] == [
        "body",
        "path",
    ]


# ---------------------------------------------------------------- SSE


@dataclass
class Frame:
    event: str | None = None
    id: str | None = None
    data: str | None = None
    comments: list[str] = field(default_factory=list)

    def json(self) -> Any:
        assert self.data is not None
        return json.loads(self.data)


class SSE:
    """Reads a `text/event-stream` frame by frame, as it arrives."""

    def __init__(self, response: httpx.Response) -> None:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        self.lines = response.iter_lines()

    def next(self) -> Frame:
        frame = Frame()
        for line in self.lines:
            if not line:
                return frame
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if not name:
                frame.comments.append(value)
            else:
                setattr(frame, name, value)
        raise AssertionError("the stream ended")

    def changes(self, count: int) -> list[Frame]:
        """The next `count` file_change frames (heartbeats skipped)."""
        frames: list[Frame] = []
        while len(frames) < count:
            frame = self.next()
            if frame.event is not None:
                assert frame.event == "file_change", frame
                frames.append(frame)
        return frames


def stream(sb: Aio, watcher: str, **kwargs: Any) -> Any:
    return sb.http.stream("GET", f"/v2/watch/{watcher}/events", timeout=httpx.Timeout(DEADLINE), **kwargs)


def test_sse_frames_and_resume_with_last_event_id(sb: Aio) -> None:
    watcher = sb.post("/v2/watch", path="/tmp/demo", recursive=True)["watcher_id"]
    with stream(sb, watcher) as response:
        sse = SSE(response)
        started = sse.next()
        assert (started.event, started.data) == ("watch_started", f'{{"watcher_id":"{watcher}"}}')
        assert started.id is None
        sb.post("/v2/commands", command="echo 'X = 1' > /tmp/demo/src/util.py")
        first = sse.changes(2)
    assert [f.id for f in first] == [f"{watcher}:1", f"{watcher}:2"]
    assert [f.json() for f in first] == poll(sb, watcher)["events"]  # the same events as poll
    assert first[0].data is not None and first[0].data.startswith(
        '{"seq":1,"type":"create","path":"/tmp/demo/src/util.py"'
    )

    sb.run("echo more >> /tmp/demo/src/util.py; touch /tmp/demo/new")  # while nobody listens
    with stream(sb, watcher, headers={"Last-Event-ID": first[-1].id}) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        resumed = sse.changes(2)
        sb.post("/v2/fs/write", path="/tmp/demo/later.txt", content="x")
        resumed += sse.changes(2)
    assert [f.id for f in resumed] == [f"{watcher}:{n}" for n in (3, 4, 5, 6)]
    assert [(f.json()["type"], f.json()["relative_path"]) for f in resumed] == [
        ("write", "src/util.py"),
        ("create", "new"),
        ("create", "later.txt"),
        ("write", "later.txt"),
    ]
    with stream(sb, watcher, params={"cursor": 5}) as response:
        sse = SSE(response)
        sse.next()
        assert [f.id for f in sse.changes(1)] == [f"{watcher}:6"]

    for header in (f"{watcher}:7", "other:1", f"{watcher}:x", "garbage"):
        refused = sb.http.get(f"/v2/watch/{watcher}/events", headers={"Last-Event-ID": header})
        assert refused.status_code == 400 and refused.json()["data"]["error_type"] == "bad_request", header


def test_sse_heartbeat_and_its_bounds(sb: Aio) -> None:
    watcher = sb.post("/v2/watch", path="/tmp/demo")["watcher_id"]
    with stream(sb, watcher, params={"heartbeat": MIN_HEARTBEAT_SECONDS}) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        started = time.monotonic()
        beat = sse.next()
        assert beat.event is None and beat.comments == ["heartbeat"]
        assert MIN_HEARTBEAT_SECONDS * 0.9 <= time.monotonic() - started < MIN_HEARTBEAT_SECONDS + 2
    for value in (MIN_HEARTBEAT_SECONDS - 0.01, MAX_HEARTBEAT_SECONDS + 0.01):
        refused = sb.http.get(f"/v2/watch/{watcher}/events", params={"heartbeat": value})
        assert refused.status_code == 400, value
    with stream(sb, watcher, params={"heartbeat": MAX_HEARTBEAT_SECONDS}) as response:
        assert SSE(response).next().event == "watch_started"


def test_sse_ends_when_the_watcher_is_deleted(sb: Aio) -> None:
    watcher = sb.post("/v2/watch", path="/tmp/demo")["watcher_id"]
    with stream(sb, watcher) as response:
        sse = SSE(response)
        sse.next()
        sb.delete(f"/v2/watch/{watcher}")
        assert list(sse.lines) == []


#: Files made at a time before the ring-overflow test lets the watcher catch up.
WATCH_BURST = 500


def test_sse_reports_overflow_when_the_ring_dropped_events(sb: Aio) -> None:
    # Paced, so that the kernel's inotify queue (16384 events by default) never overflows: that
    # is an overflow of its own (reported too, but not the one this test is about).
    sb.run("mkdir -p /workspace/ring")
    watcher = sb.post("/v2/watch", path="/workspace/ring", exclude=[])["watcher_id"]
    files = MAX_EVENTS_PER_WATCHER + 100  # one create each; the ring keeps MAX_EVENTS_PER_WATCHER
    sb.run(
        f"cd /workspace/ring && i=0; while [ $i -lt {files} ]; do : > f$i; i=$((i+1)); "
        f"[ $((i % {WATCH_BURST})) -eq 0 ] && sleep 0.05; done; true"
    )
    deadline = time.monotonic() + DEADLINE
    while sb.get(f"/v2/watch/{watcher}")["last_seq"] <= MAX_EVENTS_PER_WATCHER:
        assert time.monotonic() < deadline, "events did not arrive"
    with stream(sb, watcher) as response:
        sse = SSE(response)
        assert sse.next().event == "watch_started"
        overflow = sse.next()
        assert overflow.event == "overflow" and overflow.json() == {"overflow": True, "after_seq": 0}
        (first,) = sse.changes(1)
        assert first.json()["seq"] > 1  # seq 1 fell out of the ring
