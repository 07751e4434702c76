"""The AIO v1 routes driven by the real `agent-sandbox==0.0.30` SDK against a real `agentbox serve`,
on each kind of machine (`kind_server`).

Most tests use one sandbox of their own (`Sandbox(base_url=".../sandboxes/<unique id>")`), so
their paths (seed 002's `/tmp/demo`) cannot meet other test files' on the shared server; a
few use the root URL (the default session) with paths unique to this module.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pydantic
import pytest
from agent_sandbox import Sandbox
from agent_sandbox.core.api_error import ApiError
from conftest import Server, clear_scratch, on_kinds
from test_api_v2 import SCRATCH

from agentbox.api.v1_bash import DEFAULT_MAX_OUTPUT_LENGTH
from agentbox.api.v1_shell import MAX_OUTPUT_CHARS

#: Upper bound for anything that should happen promptly; tests poll and fail only past it.
DEADLINE = 20.0

APP_PY = (
    "import sys\n\n"
    "def main():\n"
    "    # TODO: read the input path from argv\n"
    "    print('hello')\n\n"
    "if __name__ == '__main__':\n"
    "    main()\n"
)


@pytest.fixture(scope="module")
def session_url(kind_server: Server) -> str:
    clear_scratch(kind_server, SCRATCH)
    return f"{kind_server.url}/sandboxes/v1sdk-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def client(session_url: str) -> Sandbox:
    """The SDK bound to this module's own sandbox."""
    return Sandbox(base_url=session_url)


@pytest.fixture(scope="module")
def raw(session_url: str) -> Iterator[httpx.Client]:
    """Plain HTTP to the same sandbox, for what the SDK has no method for (mkdir) or hides."""
    with httpx.Client(base_url=session_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def root(kind_server: Server) -> str:
    """The machine's root, where a command starts and an unnamed upload lands (/workspace in a
    sandbox or a container, the configured directory of an ssh host)."""
    return kind_server.root


@pytest.fixture(scope="module")
def root_client(kind_server: Server) -> Sandbox:
    """The SDK at the server's root URL: the default session's sandbox."""
    return Sandbox(base_url=kind_server.url)


def events_until(client: Sandbox, watcher_id: str, count: int) -> list[dict[str, Any]]:
    """Poll (passing `since` back) until `count` events have arrived."""
    events: list[dict[str, Any]] = []
    cursor = 0
    end = time.monotonic() + DEADLINE
    while len(events) < count:
        assert time.monotonic() < end, f"only {events} arrived"
        page = client.file.watch_poll(watcher_id, since=cursor, timeout=2)["data"]
        events += page["events"]
        cursor = page["cursor"]
    return events


# ---------------------------------------------------------------- seed 002, v1 walk-through


def test_seed_002_create_search_edit_read(client: Sandbox, raw: httpx.Client) -> None:
    made = raw.post("/v1/file/mkdir", json={"path": "/tmp/demo/src", "parents": True}).json()
    assert made["success"] is True and made["data"]["path"] == "/tmp/demo/src"
    written = client.file.write_file(file="/tmp/demo/src/app.py", content=APP_PY)
    assert written.success and written.data.file == "/tmp/demo/src/app.py"
    assert written.data.bytes_written == len(APP_PY)
    client.file.write_file(file="/tmp/demo/README.md", content="# demo\n")

    listed = client.file.list_path(path="/tmp/demo", recursive=True).data
    assert sorted(f.path for f in listed.files) == [
        "/tmp/demo/README.md",
        "/tmp/demo/src",
        "/tmp/demo/src/app.py",
    ]
    assert {f.path: f.is_directory for f in listed.files}["/tmp/demo/src"] is True

    found = client.file.glob_files(path="/tmp/demo", pattern="**/*.py").data
    target = found.files[0].path
    assert target == "/tmp/demo/src/app.py" and found.files[0].name == "app.py"
    hit = client.file.grep_files(path=target, pattern="TODO.*").data
    assert [(m.line_number, m.line_content) for m in hit.matches] == [
        (4, "    # TODO: read the input path from argv")
    ]

    edited = client.file.str_replace_editor(
        command="str_replace",
        path=target,
        old_str="    # TODO: read the input path from argv\n    print('hello')",
        new_str="    path = sys.argv[1]\n    print(open(path).read())",
    ).data
    assert edited.prev_exist is True and edited.path == target
    assert "path = sys.argv[1]" in edited.output and edited.old_content == APP_PY

    result = client.file.read_file(file=target, start_line=2, end_line=5).data
    assert result.content == "def main():\n    path = sys.argv[1]\n    print(open(path).read())\n"
    assert result.file == target


def test_seed_002_watch_poll_with_since(client: Sandbox, raw: httpx.Client) -> None:
    raw.post("/v1/file/mkdir", json={"path": "/tmp/watch-demo/src", "parents": True})
    created = client.file.watch_create(path="/tmp/watch-demo", recursive=True)
    watcher = created["data"]["watcher_id"]
    assert created["watcher_id"] == watcher and created["success"] is True
    assert watcher in [w["watcher_id"] for w in client.file.watch_list()["data"]["watchers"]]

    client.bash.exec(command="echo 'X = 1' > /tmp/watch-demo/src/util.py")
    events = events_until(client, watcher, 2)
    assert [(e["seq"], e["type"], e["relative_path"]) for e in events] == [
        (1, "create", "src/util.py"),
        (2, "write", "src/util.py"),
    ]
    assert events[1]["path"] == "/tmp/watch-demo/src/util.py" and events[1]["size"] == 6

    # `since` is the last consumed seq: nothing after 2 yet.
    page = client.file.watch_poll(watcher, since=2)["data"]
    assert page["events"] == [] and page["cursor"] == 2 and page["overflow"] is False
    # An empty body (the SDK sends none when every argument is left out) replays from 0.
    assert [e["seq"] for e in client.file.watch_poll(watcher)["data"]["events"]] == [1, 2]

    stopped = client.file.watch_stop(watcher)
    assert stopped["data"] == {"watcher_id": watcher, "deleted": True}
    with pytest.raises(ApiError) as gone:
        client.file.watch_poll(watcher)
    assert gone.value.status_code == 404
    assert gone.value.body["data"]["error_type"] == "not_found"


def test_watch_wait_create_and_timeout(client: Sandbox) -> None:
    path = f"/tmp/wait-{uuid.uuid4().hex[:8]}.txt"
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.file.watch_wait, path=path, timeout=DEADLINE, event_types=["create"])
        client.bash.exec(command=f"echo ready > {path}")
        reply = waiting.result(timeout=DEADLINE + 10)
    assert reply["success"] is True
    assert reply["data"]["event"]["type"] == "create" and reply["event"]["path"] == path

    with pytest.raises(ApiError) as timed_out:
        client.file.watch_wait(path=path, timeout=1, event_types=["remove"])
    assert timed_out.value.status_code == 503
    assert timed_out.value.body["message"] == "timed out waiting for file event"


# ---------------------------------------------------------------- other file methods


def test_find_search_replace(client: Sandbox, root: str) -> None:
    base = f"{root}/fsr"
    client.file.write_file(file=f"{base}/a.py", content="one\ntwo\nthree two\n")
    client.file.write_file(file=f"{base}/sub/b.py", content="x\n")
    client.file.write_file(file=f"{base}/c.txt", content="y\n")

    found = client.file.find_files(path=base, glob="**/*.py").data
    assert found.path == base and found.files == [f"{base}/a.py", f"{base}/sub/b.py"]

    searched = client.file.search_in_file(file=f"{base}/a.py", regex="two").data
    assert searched.file == f"{base}/a.py"
    assert searched.matches == ["two", "three two"] and searched.line_numbers == [1, 2]  # 0-based

    replaced = client.file.replace_in_file(file=f"{base}/a.py", old_str="two", new_str="2").data
    assert replaced.replaced_count == 2
    assert client.file.read_file(file=f"{base}/a.py").data.content == "one\n2\nthree 2\n"
    assert (
        client.file.replace_in_file(file=f"{base}/a.py", old_str="absent", new_str="x").data.replaced_count
        == 0
    )


def test_write_encodings_append_and_newlines(client: Sandbox, root: str) -> None:
    path = f"{root}/enc/deep/out.txt"  # missing parents are created
    assert client.file.write_file(file=path, content="aGk=", encoding="base64").data.file == path
    client.file.write_file(
        file=path, content="there", append=True, leading_newline=True, trailing_newline=True
    )
    assert b"".join(client.file.download_file(path=path)) == b"hi\nthere\n"


def test_upload_and_download(client: Sandbox, root: str) -> None:
    payload = bytes(range(256)) * 1000
    raw_upload = client.file.upload_file(file=payload).data
    assert raw_upload.success is True and raw_upload.file_size == len(payload)
    assert raw_upload.file_path == f"{root}/upload"  # raw bytes arrive named `upload`
    assert b"".join(client.file.download_file(path=f"{root}/upload")) == payload

    named = client.file.upload_file(file=("data.csv", b"a,b\n1,2\n"), path="/tmp/up/data.csv").data
    assert (named.file_path, named.file_size) == ("/tmp/up/data.csv", 8)
    into_dir = client.file.upload_file(file=("notes.md", b"# n\n"), path="/tmp/up/").data
    assert into_dir.file_path == "/tmp/up/notes.md"
    assert b"".join(client.file.download_file(path="/tmp/up/data.csv")) == b"a,b\n1,2\n"

    with pytest.raises(ApiError) as missing:
        b"".join(client.file.download_file(path="/tmp/up/missing.csv"))
    assert missing.value.status_code == 404


def test_str_replace_editor_commands(client: Sandbox, root: str) -> None:
    path = f"{root}/editor/notes.txt"
    created = client.file.str_replace_editor(command="create", path=path, file_text="alpha\nbeta\n").data
    assert created.prev_exist is False and created.new_content == "alpha\nbeta\n"

    viewed = client.file.str_replace_editor(command="view", path=path, view_range=[2, 2]).data
    assert viewed.output.endswith("     2\tbeta\n") and viewed.prev_exist is True

    inserted = client.file.str_replace_editor(
        command="insert", path=path, insert_line=1, new_str="between"
    ).data
    assert inserted.new_content == "alpha\nbetween\nbeta\n"
    undone = client.file.str_replace_editor(command="undo_edit", path=path).data
    assert undone.new_content == "alpha\nbeta\n"
    # The undo of a create that made the file removes it.
    client.file.str_replace_editor(command="undo_edit", path=path)
    assert client.file.list_path(path=f"{root}/editor").data.files == []


def test_missing_file_errors_as_sdk_0030_sees_them(client: Sandbox, raw: httpx.Client) -> None:
    """aio-api.md §4.2: 0.0.30 types `data` as the success model, so the error object fails it."""
    with pytest.raises(pydantic.ValidationError):
        client.file.read_file(file="/tmp/demo/missing.txt")
    reply = raw.post("/v1/file/read", json={"file": "/tmp/demo/missing.txt"})
    assert reply.status_code == 200
    body = reply.json()
    assert body["success"] is False
    assert (body["data"]["error_type"], body["data"]["errno_name"]) == ("not_found", "ENOENT")

    listed = client.file.list_path(path="/tmp/demo/missing-dir")  # FileListResult needs only `path`
    assert listed.success is False and listed.data.files is None
    assert listed.data.model_extra["error_type"] == "not_found"


@on_kinds("sandbox", "docker")  # an ssh host is one machine every session shares
def test_sessions_are_isolated(root_client: Sandbox, raw: httpx.Client) -> None:
    path = f"/workspace/v1sdk-{uuid.uuid4().hex[:8]}.txt"
    root_client.file.write_file(file=path, content="root\n")
    assert root_client.file.read_file(file=path).data.content == "root\n"
    assert raw.post("/v1/file/read", json={"file": path}).json()["data"]["error_type"] == "not_found"


# ---------------------------------------------------------------- /v1/shell


def test_shell_exec_combined_output_and_sessions(client: Sandbox, root: str) -> None:
    made = client.shell.create_session(id="sh-one", exec_dir="/tmp").data
    assert (made.session_id, made.working_dir) == ("sh-one", "/tmp")
    done = client.shell.exec_command(id="sh-one", command="echo out; echo err >&2; pwd; exit 3").data
    assert (done.status, done.exit_code) == ("completed", 3)
    assert done.output == "out\nerr\n/tmp\n"
    assert done.console[0].ps_1 == "/tmp $" and done.console[0].command.startswith("echo out")

    moved = client.shell.exec_command(id="sh-one", command="pwd", exec_dir=root).data
    assert moved.output == f"{root}\n"
    listed = client.shell.list_sessions().data.sessions
    assert listed["sh-one"].working_dir == root and listed["sh-one"].age_seconds >= 0
    stats = client.shell.get_session_stats().data
    assert stats.total_sessions >= 1 and stats.active_sessions >= 1 and 0 < stats.usage_ratio <= 1
    assert client.shell.update_session(id="sh-one", no_change_timeout=5).data["no_change_timeout"] == 5
    url = client.shell.get_terminal_url()
    assert url.success is False and url.data == ""

    assert client.shell.cleanup_session("sh-one").success is True
    assert "sh-one" not in client.shell.list_sessions().data.sessions


def test_shell_async_view_write_wait_kill(client: Sandbox) -> None:
    started = client.shell.exec_command(command="read line; echo got:$line", async_mode=True).data
    assert started.status == "running"
    sid = started.session_id
    assert client.shell.view(id=sid).data.status == "running"
    assert client.shell.write_to_process(id=sid, input="hello", press_enter=True).data.status in (
        "running",
        "completed",
    )
    assert client.shell.wait_for_process(id=sid, seconds=DEADLINE).data.status == "completed"
    view = client.shell.view(id=sid).data
    assert (view.output, view.exit_code, view.command) == ("got:hello\n", 0, "read line; echo got:$line")

    client.shell.exec_command(id=sid, command="sleep 60", async_mode=True)
    killed = client.shell.kill_process(id=sid).data
    assert killed.status == "terminated" and killed.exit_code == 137
    again = client.shell.kill_process(id=sid)  # nothing runs: the answer says so, no error
    assert again.success is True and again.data.status == "terminated"


def test_shell_timeouts(client: Sandbox) -> None:
    started = time.monotonic()
    quiet = client.shell.exec_command(command="echo start; sleep 60", no_change_timeout=1).data
    assert quiet.status == "no_change_timeout" and quiet.output == "start\n"
    assert time.monotonic() - started < DEADLINE
    client.shell.kill_process(id=quiet.session_id)

    hard = client.shell.exec_command(command="sleep 60", hard_timeout=1).data
    assert hard.status == "hard_timeout"
    waited = client.shell.exec_command(command="sleep 60", timeout=0.5).data
    assert waited.status == "running"
    client.shell.kill_process(id=waited.session_id)


def test_shell_truncates_output_at_the_limit(client: Sandbox) -> None:
    exact = client.shell.exec_command(command=f"head -c {MAX_OUTPUT_CHARS} /dev/zero | tr '\\0' a").data
    assert exact.output == "a" * MAX_OUTPUT_CHARS
    over = client.shell.exec_command(command=f"head -c {MAX_OUTPUT_CHARS + 1} /dev/zero | tr '\\0' a").data
    assert "[... 1 characters truncated ...]" in over.output
    whole = client.shell.exec_command(
        command=f"head -c {MAX_OUTPUT_CHARS + 1} /dev/zero | tr '\\0' a", truncate=False
    )
    assert whole.data.output == "a" * (MAX_OUTPUT_CHARS + 1)


# ---------------------------------------------------------------- /v1/bash


def test_bash_exec_env_streams_and_exit(client: Sandbox) -> None:
    done = client.bash.exec(
        command='echo "$GREETING"; echo oops >&2; exit 2', env={"GREETING": "hi", "UNSET": None}
    ).data
    assert (done.status, done.exit_code, done.stdout, done.stderr) == ("completed", 2, "hi\n", "oops\n")
    assert (done.offset, done.stderr_offset) == (3, 5)
    assert done.command_id.startswith("cmd_") and done.session_id

    again = client.bash.exec(command="echo $GREETING", session_id=done.session_id).data
    assert again.stdout == "\n"  # env was for that command only
    moved = client.bash.exec(command="pwd", session_id=done.session_id, exec_dir="/tmp").data
    assert moved.stdout == "/tmp\n"
    assert client.bash.exec(command="pwd", session_id=done.session_id).data.stdout == "/tmp\n"


def test_bash_async_output_write_kill(client: Sandbox, root: str) -> None:
    session = client.bash.create_session(session_id="bash-one", exec_dir=root).data
    assert (session.session_id, session.status, session.working_dir) == ("bash-one", "ready", root)

    started = client.bash.exec(
        session_id="bash-one", command="echo first; read x; echo second:$x; read y", async_mode=True
    ).data
    assert started.status == "running"
    first = client.bash.output(session_id="bash-one", wait=True, wait_timeout=DEADLINE).data
    assert first.stdout == "first\n" and first.offset == 6 and first.command.status == "running"
    client.bash.write(session_id="bash-one", input="abc\n")
    second = client.bash.output(
        session_id="bash-one", offset=first.offset, wait=True, wait_timeout=DEADLINE
    ).data
    assert second.stdout == "second:abc\n" and second.offset == 17

    killed = client.bash.kill(session_id="bash-one", signal="SIGINT").data
    assert killed["killed"] is True and killed["command"]["status"] == "killed"
    listed = {s.session_id: s for s in client.bash.sessions().data}
    assert listed["bash-one"].command_count == 1 and listed["bash-one"].current_command is None
    assert client.bash.close_session("bash-one").data["status"] == "closed"
    assert "bash-one" not in {s.session_id for s in client.bash.sessions().data}


def test_bash_timeouts_and_truncation(client: Sandbox) -> None:
    running = client.bash.exec(command="sleep 60", timeout=0.5).data
    assert running.status == "running"
    client.bash.kill(session_id=running.session_id, signal="SIGKILL")
    timed_out = client.bash.exec(command="sleep 60", hard_timeout=1).data
    assert timed_out.status == "timed_out"

    limit = DEFAULT_MAX_OUTPUT_LENGTH
    exact = client.bash.exec(command=f"head -c {limit} /dev/zero | tr '\\0' b").data
    assert exact.stdout == "b" * limit and exact.offset == limit
    over = client.bash.exec(command=f"head -c {limit + 1} /dev/zero | tr '\\0' b").data
    assert "[... 1 characters truncated ...]" in over.stdout and over.offset == limit + 1
    small = client.bash.exec(command="echo 0123456789", max_output_length=4).data
    assert small.stdout == "01\n[... 7 characters truncated ...]\n9\n"
    assert client.bash.exec(command="echo 0123456789", max_output_length=0).data.stdout == "0123456789\n"


# ---------------------------------------------------------------- /v1/sandbox


def test_sandbox_context_and_packages(client: Sandbox, kind_server: Server) -> None:
    context = client.sandbox.get_context()
    home, root = kind_server.user_home, kind_server.root
    assert context.home_dir == home and context.workspace == root and context.version
    system = context.detail.system
    assert (system.user, system.home_dir, system.workspace, system.os) == (
        kind_server.user,
        home,
        root,
        "Linux",
    )
    assert isinstance(system.occupied_ports, list)
    assert context.detail.runtime.python and context.detail.runtime.python[0].bin
    assert isinstance(context.data, str) and context.data.startswith("System Environment:")

    packages = client.sandbox.get_python_packages()
    assert packages.success is True and isinstance(packages.data, list)
    assert all({"name", "version"} <= set(p) for p in packages.data)
    node = client.sandbox.get_nodejs_packages()
    assert node.success is True and isinstance(node.data, list)
