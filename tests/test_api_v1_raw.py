"""The AIO v1 routes over plain HTTP, for what the SDK cannot show: bodies it never sends,
status codes and headers, the SSE stream, and the exact error envelopes. Real server, one
sandbox of this module's own (`/sandboxes/<unique id>`)."""

from __future__ import annotations

import http.client as http_client
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import Server

from agentbox.api.v1_file import MULTIPART_SLACK_BYTES
from agentbox.api.v1_shell import CONSOLE_RECORDS
from agentbox.api.v2_watch import HEARTBEAT_SECONDS as SSE_HEARTBEAT_SECONDS
from agentbox.workspace.files import MAX_UPLOAD_BYTES

#: Upper bound for anything that should happen promptly; tests poll and fail only past it.
DEADLINE = 20.0
ERROR_FIELDS = {
    "errno",
    "errno_name",
    "error_type",
    "exception_type",
    "message",
    "operation",
    "path",
    "retryable",
}


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"/sandboxes/v1raw-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def api(server: Server, prefix: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url + prefix, timeout=60) as c:
        yield c


def post(api: httpx.Client, route: str, /, **body: Any) -> dict[str, Any]:
    reply = api.post(route, json=body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def run(api: httpx.Client, command: str) -> dict[str, Any]:
    data = post(api, "/v1/bash/exec", command=command)["data"]
    assert data["exit_code"] == 0, data
    return dict(data)


def new_watcher(api: httpx.Client, directory: str) -> str:
    post(api, "/v1/file/mkdir", path=directory, parents=True)
    return str(post(api, "/v1/file/watch", path=directory)["watcher_id"])


def poll_until(api: httpx.Client, watcher: str, count: int) -> None:
    end = time.monotonic() + DEADLINE
    while post(api, f"/v1/file/watch/{watcher}/poll", cursor=0, timeout=1)["data"]["cursor"] < count:
        assert time.monotonic() < end, "events never arrived"


# ---------------------------------------------------------------- bodies the SDK sends


def test_poll_accepts_an_empty_body_and_both_cursor_names(api: httpx.Client) -> None:
    watcher = new_watcher(api, "/tmp/poll-demo")
    run(api, "echo x > /tmp/poll-demo/f.txt")
    poll_until(api, watcher, 2)

    empty = api.post(
        f"/v1/file/watch/{watcher}/poll", content=b"", headers={"content-type": "application/json"}
    )
    assert empty.status_code == 200
    page = empty.json()
    assert [e["seq"] for e in page["data"]["events"]] == [1, 2]
    assert page["cursor"] == page["data"]["cursor"] == 2 and page["overflow"] is False

    assert [e["seq"] for e in post(api, f"/v1/file/watch/{watcher}/poll", since=1)["events"]] == [2]
    both = post(api, f"/v1/file/watch/{watcher}/poll", since=0, cursor=2)  # cursor wins
    assert both["events"] == [] and both["cursor"] == 2
    assert [e["seq"] for e in post(api, f"/v1/file/watch/{watcher}/poll", limit=1)["events"]] == [1]


def test_explicit_nulls_are_accepted(api: httpx.Client) -> None:
    post(
        api, "/v1/file/write", file="/tmp/nulls.txt", content="a\nb\n", encoding=None, append=None, sudo=None
    )
    read = post(api, "/v1/file/read", file="/tmp/nulls.txt", start_line=None, end_line=None, sudo=None)
    assert read["data"]["content"] == "a\nb\n" and read["data"]["line_count"] == 2
    listed = post(api, "/v1/file/list", path="/tmp", recursive=None, show_hidden=None, file_types=None, max_depth=None,
                  include_size=None, include_permissions=None, sort_by=None, sort_desc=None)  # fmt: skip
    assert "/tmp/nulls.txt" in [f["path"] for f in listed["data"]["files"]]
    grep = post(api, "/v1/file/grep", path="/tmp/nulls.txt", pattern="b", include=None, exclude=None,
                case_insensitive=None, max_results=None, max_file_size=None, type=None, recursive=None)  # fmt: skip
    assert [m["line_number"] for m in grep["data"]["matches"]] == [2]
    bash = post(api, "/v1/bash/exec", command="echo ok", session_id=None, exec_dir=None, env=None, async_mode=None,
                timeout=None, hard_timeout=None, max_output_length=None)  # fmt: skip
    assert bash["data"]["stdout"] == "ok\n"
    shell = post(api, "/v1/shell/exec", command="echo ok", id=None, exec_dir=None, async_mode=None, timeout=None,
                 strict=None, no_change_timeout=None, hard_timeout=None, preserve_symlinks=None, truncate=None)  # fmt: skip
    assert shell["data"]["output"] == "ok\n"
    watcher = new_watcher(api, "/tmp/null-watch")
    page = post(api, f"/v1/file/watch/{watcher}/poll", cursor=None, since=None, limit=None, timeout=None)
    assert page["success"] is True


@pytest.mark.parametrize(
    ("route", "content"),
    [
        ("/v1/file/read", b"{}"),
        ("/v1/file/read", b'{"file": 5}'),
        ("/v1/file/write", b"{not json"),
        ("/v1/bash/exec", b"[1, 2]"),
        ("/v1/shell/write", b'{"id": "x", "input": "y"}'),
    ],
)
def test_malformed_bodies_are_422_with_a_detail_list(api: httpx.Client, route: str, content: bytes) -> None:
    reply = api.post(route, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 422
    body = reply.json()
    assert isinstance(body["detail"], list) and body["detail"]
    assert all(set(d) == {"loc", "msg", "type"} and isinstance(d["loc"], list) for d in body["detail"])
    assert all({"location", "message", "type"} <= set(e) for e in body["errors"])
    assert body["success"] is False


# ---------------------------------------------------------------- the v1 failure envelope


def test_file_failures_are_200_with_the_error_object(api: httpx.Client) -> None:
    reply = api.post("/v1/file/read", json={"file": "/tmp/demo/missing.txt"})
    assert reply.status_code == 200
    body = reply.json()
    assert set(body) == {"success", "message", "data", "hint", "request_id"} and body["success"] is False
    assert body["request_id"] == reply.headers["x-request-id"]
    assert set(body["data"]) == ERROR_FIELDS
    error = body["data"]
    assert (error["error_type"], error["errno"], error["errno_name"]) == ("not_found", 2, "ENOENT")
    assert (error["operation"], error["path"], error["exception_type"]) == (
        "read",
        "/tmp/demo/missing.txt",
        "FileNotFoundError",
    )
    assert error["retryable"] is False and body["message"] == error["message"]

    post(api, "/v1/file/mkdir", path="/tmp/a-dir", parents=True)
    as_dir = post(api, "/v1/file/write", file="/tmp/a-dir", content="x")
    assert as_dir["success"] is False and as_dir["data"]["error_type"] == "invalid_target"
    post(api, "/v1/file/write", file="/tmp/edit.txt", content="abc\n")
    absent = post(
        api,
        "/v1/file/str_replace_editor",
        command="str_replace",
        path="/tmp/edit.txt",
        old_str="zzz",
        new_str="y",
    )
    assert absent["success"] is False and absent["message"] == "old_str not found in file"
    bad_b64 = post(api, "/v1/file/write", file="/tmp/b.bin", content="not base64!", encoding="base64")
    assert bad_b64["data"]["error_type"] == "decode_error"
    unknown = post(api, "/v1/bash/output", session_id="no-such-session")
    assert unknown["success"] is False and unknown["data"]["error_type"] == "not_found"


# ---------------------------------------------------------------- upload and download


def test_upload_targets_and_refusals(api: httpx.Client, server: Server, prefix: str) -> None:
    placed = api.post("/v1/file/upload", files={"file": ("report.txt", b"r\n")}).json()
    assert placed["data"] == {"file_path": "/workspace/report.txt", "file_size": 2, "success": True}
    nested = api.post(
        "/v1/file/upload", files={"file": ("x.bin", b"\0\1")}, data={"path": "/tmp/new/dir/x.bin"}
    )
    assert nested.json()["data"]["file_path"] == "/tmp/new/dir/x.bin"  # parents are created

    one_stray = api.post(
        "/v1/file/upload", files={"file": ("s.txt", b"s")}, data={"path": "/tmp/s.txt", "x": "1"}
    )
    assert one_stray.json()["success"] is True  # MAX_FORM_FIELDS: `path` and one more
    fields = {"path": "/tmp/s.txt", "x": "1", "y": "2"}
    assert api.post("/v1/file/upload", files={"file": ("s.txt", b"s")}, data=fields).status_code == 400
    two_files = [("file", ("a.txt", b"a")), ("file", ("b.txt", b"b"))]
    assert api.post("/v1/file/upload", files=two_files).status_code == 400  # MAX_FORM_FILES

    no_file = api.post("/v1/file/upload", data={"path": "/tmp/x"})
    assert no_file.status_code == 422 and no_file.json()["detail"][0]["loc"] == ["body", "file"]
    nameless = api.post("/v1/file/upload", files={"file": ("..", b"x")}).json()
    assert nameless["success"] is False and nameless["data"]["error_type"] == "bad_request"

    # A body declared larger than the limit allows is refused before it is read.
    url = urlsplit(server.url)
    conn = http_client.HTTPConnection(url.hostname or "", url.port, timeout=DEADLINE)
    try:
        conn.putrequest("POST", f"{prefix}/v1/file/upload")
        conn.putheader("Content-Type", "multipart/form-data; boundary=x")
        conn.putheader("Content-Length", str(MAX_UPLOAD_BYTES + MULTIPART_SLACK_BYTES + 1))
        conn.endheaders()
        refused = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    assert refused["success"] is False and refused["data"]["errno_name"] == "EFBIG"


def test_download_ranges_and_http_errors(api: httpx.Client) -> None:
    content = bytes(range(100))
    assert api.post(
        "/v1/file/upload", files={"file": ("d.bin", content)}, data={"path": "/tmp/d.bin"}
    ).json()["success"]

    whole = api.get("/v1/file/download", params={"path": "/tmp/d.bin"})
    assert whole.status_code == 200 and whole.content == content
    assert whole.headers["content-length"] == "100" and whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-type"] == "application/octet-stream" and whole.headers["etag"]
    part = api.get("/v1/file/download", params={"path": "/tmp/d.bin"}, headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == content[:10]
    assert part.headers["content-range"] == "bytes 0-9/100"
    tail = api.get("/v1/file/download", params={"path": "/tmp/d.bin"}, headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == content[-5:]
    past = api.get("/v1/file/download", params={"path": "/tmp/d.bin"}, headers={"Range": "bytes=100-"})
    assert past.status_code == 416 and past.headers["content-range"] == "bytes */100"

    missing = api.get("/v1/file/download", params={"path": "/tmp/nope.bin"})
    assert missing.status_code == 404 and missing.json()["data"]["error_type"] == "not_found"
    directory = api.get("/v1/file/download", params={"path": "/tmp"})
    assert directory.status_code == 400 and directory.json()["data"]["error_type"] == "invalid_target"
    assert api.get("/v1/file/download").status_code == 400  # no `path`: a query error, plain text
    stable = api.get("/v1/file/download", params={"path": "/tmp/d.bin", "change_policy": "abort"})
    assert stable.status_code == 200 and stable.content == content
    assert (
        api.get("/v1/file/download", params={"path": "/tmp/d.bin", "change_policy": "later"}).status_code
        == 400
    )


def test_download_abort_is_409_when_the_file_changes(api: httpx.Client) -> None:
    writer = post(api, "/v1/bash/exec", async_mode=True,
                  command="while :; do echo a > /tmp/churn.txt; echo bbbb > /tmp/churn.txt; done")["data"]  # fmt: skip
    try:
        end = time.monotonic() + DEADLINE
        while True:
            assert time.monotonic() < end, "the rewritten file never answered 409"
            try:
                reply = api.get(
                    "/v1/file/download", params={"path": "/tmp/churn.txt", "change_policy": "abort"}
                )
            except httpx.RemoteProtocolError:
                continue  # changed after the first chunk was sent: the transfer is cut
            if reply.status_code == 409:
                break
        error = reply.json()["data"]
        assert error["exception_type"] == "FileChanged" and error["retryable"] is True
    finally:
        post(api, "/v1/bash/kill", session_id=writer["session_id"], signal="SIGKILL")


# ---------------------------------------------------------------- watchers


def sse_frames(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """SSE frames as {field: value}; a comment line comes as {"comment": text}."""
    frame: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif line == "":
            if frame:
                yield frame
            frame = {}
        else:
            name, _, value = line.partition(":")
            frame[name] = value.removeprefix(" ")


def test_watch_events_stream_resume_heartbeat_and_end(api: httpx.Client) -> None:
    watcher = new_watcher(api, "/tmp/sse-demo")
    run(api, "echo 'X = 1' > /tmp/sse-demo/util.py")
    url = f"/v1/file/watch/{watcher}/events"

    with api.stream("GET", url) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        frames = sse_frames(reply.iter_lines())
        assert next(frames) == {
            "event": "watch_started",
            "data": json.dumps({"watcher_id": watcher}, separators=(",", ":")),
        }
        changes = [next(frames), next(frames)]
    assert [(f["id"], f["event"]) for f in changes] == [
        (f"{watcher}:1", "file_change"),
        (f"{watcher}:2", "file_change"),
    ]
    first = json.loads(changes[0]["data"])
    assert (first["seq"], first["type"], first["relative_path"], first["path"]) == (
        1,
        "create",
        "util.py",
        "/tmp/sse-demo/util.py",
    )

    with api.stream("GET", url, headers={"Last-Event-ID": f"{watcher}:1"}) as resumed:
        frames = sse_frames(resumed.iter_lines())
        assert next(frames)["event"] == "watch_started"
        assert next(frames)["id"] == f"{watcher}:2"

    past = api.get(url, headers={"Last-Event-ID": f"{watcher}:99"})
    assert past.status_code == 400

    # The module's client reads with a 60 s timeout, well past one heartbeat interval.
    with api.stream("GET", url, headers={"Last-Event-ID": f"{watcher}:2"}) as idle:
        frames = sse_frames(idle.iter_lines())
        assert next(frames)["event"] == "watch_started"
        started = time.monotonic()
        assert next(frames) == {"comment": "heartbeat"}
        assert time.monotonic() - started >= SSE_HEARTBEAT_SECONDS - 1
        assert api.delete(f"/v1/file/watch/{watcher}").status_code == 200
        assert list(frames) == []  # deleting the watcher ends the stream


def test_unknown_watchers_are_404_and_watch_errors_use_http_status(api: httpx.Client) -> None:
    for reply in (
        api.post("/v1/file/watch/nope/poll", json={}),
        api.delete("/v1/file/watch/nope"),
        api.get("/v1/file/watch/nope/events"),
    ):
        assert reply.status_code == 404
        body = reply.json()
        assert body["success"] is False
        assert (body["data"]["error_type"], body["data"]["exception_type"]) == (
            "not_found",
            "WatcherNotFound",
        )

    assert api.post("/v1/file/watch", json={"path": "/tmp/never-there"}).status_code == 404
    picky = api.post("/v1/file/watch", json={"path": "/tmp", "include_patterns": ["*.py"]})
    assert picky.status_code == 400 and "include_patterns" in picky.json()["message"]
    waited = api.post("/v1/file/watch/wait", json={"path": "/tmp/never-there", "timeout": 0})
    assert waited.status_code == 503 and waited.json()["data"]["errno_name"] == "ETIMEDOUT"


# ---------------------------------------------------------------- shell, bash, sandbox


def test_shell_and_bash_failures(api: httpx.Client) -> None:
    session = post(api, "/v1/shell/sessions/create", id="raw-shell")["data"]
    assert session == {"session_id": "raw-shell", "working_dir": "/workspace"}
    idle = post(api, "/v1/shell/write", id="raw-shell", input="ls", press_enter=True)
    assert idle["success"] is False and "No running process" in idle["message"]
    strict = post(api, "/v1/shell/exec", id="raw-shell", command="pwd", exec_dir="/tmp/nowhere", strict=True)
    assert strict["success"] is False and strict["data"]["error_type"] == "not_found"
    lenient = post(api, "/v1/shell/exec", id="raw-shell", command="pwd", exec_dir="/tmp/nowhere")
    assert lenient["data"]["output"] == "/workspace\n"

    for n in range(CONSOLE_RECORDS + 1):
        post(api, "/v1/shell/exec", id="raw-shell", command=f"echo {n}")
    console = post(api, "/v1/shell/view", id="raw-shell")["data"]["console"]
    assert [c["command"] for c in console] == [f"echo {n}" for n in range(1, CONSOLE_RECORDS + 1)]

    snapshot = post(api, "/v1/bash/sessions/create", snapshot_path="/tmp/snap")
    assert snapshot["success"] is False
    signal = post(api, "/v1/bash/kill", session_id="raw-shell", signal="SIGHUP")
    assert signal["success"] is False and signal["data"]["error_type"] == "bad_request"
    assert "raw-shell" in api.delete("/v1/shell/sessions").json()["data"]["closed"]
    assert api.get("/v1/shell/sessions").json()["data"]["sessions"] == {}


def test_sandbox_context_wire_shape(api: httpx.Client) -> None:
    body = api.get("/v1/sandbox").json()
    assert body["success"] is True and isinstance(body["data"], str)
    assert body["home_dir"] == "/root" and body["workspace"] == "/workspace" and body["version"]
    assert set(body["detail"]) == {"system", "runtime", "utils"}
    assert {"os", "os_version", "arch", "user", "home_dir", "timezone", "occupied_ports"} <= set(
        body["detail"]["system"]
    )
    run_server = post(
        api, "/v1/bash/exec", async_mode=True, command="exec python3 -m http.server 8765 --bind 127.0.0.1"
    )
    try:
        end = time.monotonic() + DEADLINE
        while "8765" not in api.get("/v1/sandbox").json()["detail"]["system"]["occupied_ports"]:
            assert time.monotonic() < end, "the listening port never showed up"
    finally:
        post(api, "/v1/bash/kill", session_id=run_server["data"]["session_id"], signal="SIGKILL")
