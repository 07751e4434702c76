"""The SDK (`agentbox.client`) against a real `agentbox serve`: uvicorn on loopback, real
sandboxes, the scripted model and a loopback OpenAI-compatible model; streams cut by a
loopback TCP proxy and by a server killed and started again on the same home.

Most tests share the session-wide server, each in its own sessions; one module server needs
an API key, holds one sandbox at most and lists the loopback model as an endpoint.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentbox
from agentbox import client as sdk
from agentbox.api.envelope import MAX_JSON_BODY
from agentbox.client import (
    AgentMessage,
    ApprovalRequested,
    AsyncClient,
    Busy,
    ChangeSetUpdated,
    Client,
    Conflict,
    FileDelivered,
    FilesPlaced,
    Gone,
    InvalidRequest,
    MessageDelta,
    NotFound,
    PermissionDenied,
    ProtocolError,
    StreamLost,
    TooLarge,
    ToolResult,
    ToolUse,
    TurnCompleted,
    Unauthorized,
    Unreachable,
    _transport,
)
from agentbox.client._errors import api_error
from tests.conftest import Server, free_port, start_server, stop_server, traversable
from tests.test_providers import delta, finish, openai_sse

#: The key of the module's keyed server.
KEY = "sdk-test-key"
#: What the loopback model answers every request with.
LOOPBACK_REPLY = "Hello from the loopback model."


def bash(command: str, text: str = "") -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": "bash", "input": {"command": command}}]}


def write(path: str, content: str) -> dict[str, Any]:
    return {"name": "write_file", "input": {"path": path, "content": content}}


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


# ---------------------------------------------------------------- loopback helpers


class Proxy:
    """A loopback TCP proxy to `port`; `drop()` cuts every connection open through it (it
    keeps listening, so a client can connect again)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            with self._lock:
                self._open += [downstream, upstream]
                self.connections += 1
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop(self) -> None:
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._open.clear()

    def close(self) -> None:
        self.listener.close()
        self.drop()


class LoopbackModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible Chat Completions endpoint that streams `LOOPBACK_REPLY`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        half = len(LOOPBACK_REPLY) // 2
        body = openai_sse(
            delta(role="assistant", content=LOOPBACK_REPLY[:half]), delta(content=LOOPBACK_REPLY[half:]),
            finish("stop"), {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}},
        )  # fmt: skip
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def llm() -> Iterator[str]:
    """The loopback model's base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), LoopbackModel)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, llm: str) -> Iterator[Server]:
    """A server with an API key, room for one live sandbox, and the loopback model listed."""
    base = traversable(tmp_path_factory.mktemp("sdk-keyed"), tmp_path_factory)
    home = base / "home"
    home.mkdir()
    config = base / "agentbox.toml"
    config.write_text(f'model_endpoints = ["{llm}"]\n')
    env = {"AGENTBOX_API_KEY": KEY, "AGENTBOX_MAX_SANDBOXES": "1", "AGENTBOX_CONFIG": str(config)}
    s = start_server(home, env)
    yield s
    stop_server(s)


# ---------------------------------------------------------------- the surface


def test_the_package_exports_the_sdk_lazily() -> None:
    assert agentbox.Client is Client and agentbox.NotFound is NotFound
    assert set(sdk.__all__) <= set(dir(agentbox))
    with pytest.raises(AttributeError):
        agentbox.NoSuchName  # noqa: B018


# ---------------------------------------------------------------- sessions and turns, sync


def test_a_turn_runs_to_its_end_with_typed_events(client: Client) -> None:
    session = client.sessions.create(
        "scripted", script=[bash("echo from-the-sandbox", "Looking."), {"text": "Done."}],
        instructions="Be brief.", metadata={"owner": "sdk"}, toolset="default", mcp_servers=[],
        model_options={"temperature": 0}, compaction=False, permission_mode="full-auto",
    )  # fmt: skip
    assert (session.model, session.status, session.metadata) == ("scripted", "idle", {"owner": "sdk"})
    assert session.instructions == "Be brief." and session.permission_mode == "full-auto"
    result = client.messages.run(session.id, "what is there?")
    assert result.status == "completed" and result.text == "Done."
    assert isinstance(result.ended, TurnCompleted) and result.events[-1] is result.ended
    [use] = [e for e in result.events if isinstance(e, ToolUse)]
    [output] = [e for e in result.events if isinstance(e, ToolResult)]
    assert use.name == "bash" and use.input == {"command": "echo from-the-sandbox"}
    assert output.tool_use_id == use.tool_use_id and "from-the-sandbox" in output.text and not output.is_error
    assert [e.text for e in result.events if isinstance(e, AgentMessage)] == ["Looking.", "Done."]
    logged = [e for e in client.events.list(session.id) if e.turn_id == result.turn_id]
    assert [(e.seq, e.type) for e in logged] == [(e.seq, e.type) for e in result.events]
    seqs = [e.seq for e in result.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the turn's events, none missed
    after = client.sessions.get(session.id)
    assert after.last_seq == seqs[-1] and after.usage["model_calls"] == 2
    assert session.id in [s.id for s in client.sessions.list()]
    updated = client.sessions.update(session.id, permission_mode="read-only", metadata={"owner": "me"})
    assert (updated.permission_mode, updated.metadata) == ("read-only", {"owner": "me"})
    client.sessions.delete(session.id)
    with pytest.raises(NotFound):
        client.sessions.get(session.id)
    with pytest.raises(Gone) as gone:
        client.sandbox(session.id).exec("true")
    assert gone.value.status == 410 and gone.value.error_type == "session_deleted"


def test_a_key_reused_returns_the_first_turn_and_deltas_stream(client: Client) -> None:
    text = "one two three four five six"
    # The reply waits 3 s, so the stream below is open before its deltas (never stored) go out.
    session = client.sessions.create("scripted", script=[{"text": text, "delay_ms": 3000}])
    first = client.messages.send(session.id, "go", idempotency_key="sdk-key-1")
    again = client.messages.send(session.id, "go", idempotency_key="sdk-key-1")
    assert first.created and not again.created and again.turn_id == first.turn_id
    with pytest.raises(Conflict) as clash:
        client.messages.send(session.id, "something else", idempotency_key="sdk-key-1")
    assert clash.value.status == 409 and clash.value.request_id
    items = list(client.events.stream(session.id, until_turn=first.turn_id, deltas=True))
    deltas = [i for i in items if isinstance(i, MessageDelta)]
    assert "".join(d.text for d in deltas) == text and len(deltas) > 1
    assert isinstance(items[-1], TurnCompleted) and items[-1].turn_id == first.turn_id
    # `until_turn_end`: the server follows the last turn; its end is behind no cursor yet
    replayed = list(client.events.stream(session.id, until_turn_end=True))
    assert [e.seq for e in replayed] == [e.seq for e in items if not isinstance(e, MessageDelta)][
        -len(replayed) :
    ]
    assert replayed[0].seq == 1 and isinstance(replayed[-1], TurnCompleted)


# ---------------------------------------------------------------- errors


def test_real_refusals_are_typed_with_their_request_id(client: Client, server: Server) -> None:
    with pytest.raises(NotFound) as missing:
        client.sessions.get("ses_nope")
    assert (missing.value.status, missing.value.error_type, missing.value.retryable) == (
        404,
        "not_found",
        False,
    )
    assert missing.value.request_id and missing.value.request_id.startswith("req_")
    assert missing.value.request_id in str(missing.value)
    with pytest.raises(InvalidRequest) as bad:
        client.sessions.create("nope")
    assert bad.value.status == 400 and "model must be" in bad.value.message
    sandbox = client.sandbox(client.sessions.create("scripted", script=[]).id)
    sandbox.write("binary.dat", b"\xff\xfe\x00")
    with pytest.raises(InvalidRequest) as undecodable:
        sandbox.read("binary.dat")
    assert (undecodable.value.status, undecodable.value.error_type) == (422, "decode_error")
    with pytest.raises(TooLarge) as large:
        sandbox.write("big.txt", "x" * (MAX_JSON_BODY + 1))
    assert large.value.status == 413
    with pytest.raises(NotFound):
        sandbox.read("no-such-file.txt")
    foreign = Client(server.url, headers={"Origin": "http://evil.example"})
    with foreign, pytest.raises(PermissionDenied) as refused:
        foreign.sessions.get("ses_nope")
    assert (refused.value.status, refused.value.error_type) == (403, "permission_denied")
    with (
        Client(f"http://127.0.0.1:{free_port()}") as nowhere,
        pytest.raises(Unreachable, match="cannot reach"),
    ):
        nowhere.sessions.get("ses_nope")


def test_a_keyed_server_needs_its_key_and_a_full_one_is_busy(keyed: Server) -> None:
    with Client(keyed.url) as anonymous, pytest.raises(Unauthorized) as no_key:
        anonymous.sessions.get("ses_x")
    assert (no_key.value.status, no_key.value.error_type) == (401, "unauthorized") and no_key.value.request_id
    with Client(keyed.url, api_key="wrong") as wrong, pytest.raises(Unauthorized):
        wrong.sessions.get("ses_x")
    with Client(keyed.url, api_key=KEY) as c:
        assert c.sandbox("sdk-first").exec("echo hi").stdout == "hi\n"
        with pytest.raises(Busy) as busy:
            c.sandbox("sdk-second").exec("true")
        assert busy.value.status == 503 and busy.value.error_type == "capacity_exceeded"
        assert busy.value.retryable and busy.value.retry_after is not None and busy.value.retry_after >= 1


@pytest.mark.parametrize(
    ("status", "body", "cls", "error_type"),
    [
        (500, {"success": False, "message": "internal server error", "data": None}, sdk.ServerError, "internal_error"),
        (507, {"success": False, "message": "full", "data": {"error_type": "no_space_left"}},
         sdk.InsufficientStorage, "no_space_left"),
        (503, {"success": False, "message": "down", "data": {"error_type": "machine_unavailable", "retryable": True}},
         sdk.Unavailable, "machine_unavailable"),
        (405, {"success": False, "message": "no", "data": {"error_type": "method_not_allowed"}},
         InvalidRequest, "method_not_allowed"),
        (502, None, sdk.ServerError, "http_502"),
    ],
)  # fmt: skip
def test_every_status_of_the_catalogue_has_its_class(
    status: int, body: dict[str, Any] | None, cls: type[sdk.APIError], error_type: str
) -> None:
    """Statuses a healthy server does not give on demand, read through a `MockTransport`."""
    headers = {"x-request-id": "req_from_header"}
    answer = (
        httpx.Response(status, json=body, headers=headers)
        if body
        else httpx.Response(status, text="bad gateway", headers=headers)
    )
    c = Client("http://agentbox.test", transport=httpx.MockTransport(lambda _: answer))
    with c, pytest.raises(cls) as raised:
        c.sessions.get("ses_x")
    assert type(raised.value) is cls and raised.value.error_type == error_type
    assert raised.value.request_id == "req_from_header" and raised.value.status == status


def test_a_body_that_did_not_parse_names_the_field() -> None:
    errors = {"errors": [{"location": ["body", "script", "0"], "message": "bad step", "type": "value_error"}]}
    error = api_error(httpx.Response(400, json={"success": False, "message": "x", "data": None, **errors}))
    assert isinstance(error, InvalidRequest) and error.message == "script.0: bad step"
    assert error.errors[0]["type"] == "value_error"


def test_an_answer_that_is_not_agentboxs_is_a_protocol_error() -> None:
    page = httpx.Response(200, text="<html>a proxy's page</html>")
    c = Client("http://agentbox.test", transport=httpx.MockTransport(lambda _: page))
    with c, pytest.raises(ProtocolError, match="not a JSON answer"):
        c.sessions.get("ses_x")


# ---------------------------------------------------------------- streams that break


async def test_a_dropped_stream_resumes_from_the_last_seq_async(server: Server) -> None:
    """The async client follows a turn through a proxy that cuts the connection while the
    turn waits for an approval: it reconnects after the last seq and misses nothing."""
    proxy = Proxy(int(server.url.rsplit(":", 1)[1]))
    try:
        async with AsyncClient(server.url) as direct, AsyncClient(proxy.url) as proxied:
            script = [
                bash("echo approved-run"),
                {"expect": {"tool_result_contains": "approved-run"}, "text": "ok"},
            ]
            session = await direct.sessions.create("scripted", script=script, permission_mode="full-ask")
            turn = await direct.messages.send(session.id, "go")
            seen = []
            async for event in proxied.events.stream(session.id, until_turn=turn.turn_id):
                seen.append(event)
                if isinstance(event, ApprovalRequested):
                    proxy.drop()  # the stream is cut while nothing more can come
                    [pending] = await direct.approvals.list(session.id, pending=True)
                    assert pending.id == event.approval_id and pending.tool == "bash"
                    assert (await direct.approvals.allow(session.id, event.approval_id)).status == "allowed"
            logged = [e async for e in direct.events.list(session.id)]
    finally:
        proxy.close()
    assert proxy.connections >= 2  # it did connect again
    assert [(e.seq, e.type) for e in seen] == [(e.seq, e.type) for e in logged]
    assert isinstance(seen[-1], TurnCompleted) and "approval.resolved" in [e.type for e in seen]


def test_a_stream_follows_its_turn_across_a_server_restart(sandbox_tmp: Path) -> None:
    """Killed while the turn's command runs, started again on the same home and port: the
    sync client's stream resumes after the last seq it saw and reaches the turn's end."""
    home = sandbox_tmp / "home"
    home.mkdir()
    first = start_server(home, {"AGENTBOX_NETWORK": "off"})
    port = int(first.url.rsplit(":", 1)[1])
    second = None
    try:
        with Client(first.url) as c:
            session = c.sessions.create("scripted", script=[bash("sleep 600"), {"text": "after the restart"}])
            turn = c.messages.send(session.id, "wait")
            seen = []
            for event in c.events.stream(session.id, until_turn=turn.turn_id):
                seen.append(event)
                if isinstance(event, ToolUse) and second is None:
                    first.process.kill()
                    first.process.wait()
                    second = start_server(home, {"AGENTBOX_NETWORK": "off"}, port=port)
            logged = list(c.events.list(session.id))
    finally:
        stop_server(second or first)
    assert second is not None and isinstance(seen[-1], TurnCompleted)
    assert [(e.seq, e.type) for e in seen] == [(e.seq, e.type) for e in logged]
    result = next(e for e in seen if isinstance(e, ToolResult))
    assert result.is_error and "interrupted" in result.text


def test_a_stream_that_stays_broken_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers each stream request with one event and hangs up: the client
    opens it 1 + RECONNECTS times, always after the last seq seen, then raises StreamLost."""
    monkeypatch.setattr(_transport, "RECONNECT_DELAY_S", 0.001)
    opened: list[str] = []
    event = {"id": "evt_x", "seq": 7, "type": "user.message", "session_id": "ses_x", "turn_id": "trn_x",
             "created_at": "t", "content": "hi"}  # fmt: skip

    def hang_up(request: httpx.Request) -> httpx.Response:
        opened.append(str(request.url))
        return httpx.Response(200, text=f"id: 7\nevent: user.message\ndata: {json.dumps(event)}\n\n")

    c = Client("http://agentbox.test", transport=httpx.MockTransport(hang_up))
    with c, pytest.raises(StreamLost, match="gave up") as lost:
        list(c.events.stream("ses_x", until_turn="trn_x"))
    assert lost.value.last_seq == 7 and len(opened) == 1 + _transport.RECONNECTS
    assert "after=0" in opened[0] and all("after=7" in url for url in opened[1:])


# ---------------------------------------------------------------- approvals, changes, files


def test_approvals_allow_and_deny_with_a_message(client: Client) -> None:
    steps = [bash("echo one"), bash("echo two"), {"expect": {"tool_result_contains": "two"}, "text": "both"}]
    session = client.sessions.create("scripted", script=steps, permission_mode="full-ask")
    turn = client.messages.send(session.id, "go")
    for event in client.events.stream(session.id, until_turn=turn.turn_id):
        if isinstance(event, ApprovalRequested):
            answered = client.approvals.allow(session.id, event.approval_id, for_session=True)
            assert (answered.status, answered.scope) == ("allowed", "once")  # exec asks every time
            with pytest.raises(Conflict):
                client.approvals.deny(session.id, event.approval_id)
    assert client.sessions.turn(session.id, turn.turn_id).status == "completed"
    assert [a.scope for a in client.approvals.list(session.id)] == ["once", "once"]  # both calls asked
    denied = client.sessions.create(
        "scripted", script=[bash("echo never"), {"text": "told"}], permission_mode="full-ask"
    )
    turn = client.messages.send(denied.id, "go")
    for event in client.events.stream(denied.id, until_turn=turn.turn_id):
        if isinstance(event, ApprovalRequested):
            assert client.approvals.deny(denied.id, event.approval_id, "not today").status == "denied"
        if isinstance(event, ToolResult):
            assert event.is_error and "not today" in event.text
    assert client.approvals.list(denied.id, pending=True) == []
    with pytest.raises(NotFound):
        client.approvals.allow(denied.id, "apr_nope")


def test_a_change_set_is_applied_in_part_and_the_workspace_shows_it(client: Client) -> None:
    script = [{"tool_calls": [write("a.txt", "A\n"), write("b.txt", "B\n")]}, {"text": "staged"}]
    session = client.sessions.create("scripted", script=script, permission_mode="workspace-write")
    result = client.messages.run(session.id, "stage two files")
    staged = {e.change_set_id for e in result.events if isinstance(e, ChangeSetUpdated)}
    [listed] = client.changes.list(session.id)
    assert staged == {listed.id} and listed.status == "open"
    detail = client.changes.get(session.id, listed.id)
    op_a, op_b = detail.operations
    assert (
        "+A" in op_a.diff and "+B" in op_b.diff and client.changes.diff(session.id, listed.id) == detail.diff
    )
    applied = client.changes.apply(session.id, listed.id, [op_a.id])
    assert [op.status for op in applied.operations] == ["applied", "pending"] and applied.status == "open"
    rejected = client.changes.reject(session.id, listed.id, [op_b.id], message="not b")
    assert [op.status for op in rejected.operations] == ["applied", "rejected"]
    assert rejected.status == "partially_applied" and rejected.operations[1].reason == "not b"
    with pytest.raises(Conflict):
        client.changes.apply(session.id, listed.id, [op_a.id])
    sandbox = client.sandbox(session.id)
    assert sandbox.read("a.txt") == "A\n"
    with pytest.raises(NotFound):
        sandbox.read("b.txt")
    decided = [
        e for e in client.events.list(session.id, result.events[-1].seq) if isinstance(e, ChangeSetUpdated)
    ]
    assert [e.status for e in decided] == ["open", "partially_applied"]


def test_files_go_in_with_a_message_and_come_out_delivered(client: Client, tmp_path: Path) -> None:
    script = [
        bash("cat /workspace/inputs/notes.txt > report.txt; echo made"),
        {"tool_calls": [{"name": "deliver_file", "input": {"path": "report.txt"}}]},
        {"text": "delivered"},
    ]
    session = client.sessions.create("scripted", script=script)
    local = tmp_path / "notes.txt"
    local.write_bytes(b"notes for the agent\n")
    uploaded = client.files.upload(local, session_id=session.id)
    assert (uploaded.filename, uploaded.bytes, uploaded.source) == ("notes.txt", 20, "upload")
    assert client.files.download(uploaded.id) == b"notes for the agent\n"
    result = client.messages.run(session.id, "report on the notes", files=[uploaded.id])
    assert result.status == "completed", result.events[-1].data
    [placed] = [e for e in result.events if isinstance(e, FilesPlaced)]
    assert placed.files == [
        {"file_id": uploaded.id, "filename": "notes.txt", "path": "/workspace/inputs/notes.txt"}
    ]
    [delivered] = [e for e in result.events if isinstance(e, FileDelivered)]
    assert client.files.download(delivered.file_id) == b"notes for the agent\n"
    mine = {f.id: f.source for f in client.files.list(session.id)}
    assert mine == {uploaded.id: "upload", delivered.file_id: "delivery"}
    assert client.files.get(delivered.file_id).turn_id == result.turn_id
    client.files.delete(uploaded.id)
    with pytest.raises(NotFound):
        client.files.get(uploaded.id)
    assert [f.id for f in client.files.list(session.id)] == [delivered.file_id]


# ---------------------------------------------------------------- the sandbox


def test_the_sandbox_runs_commands_and_moves_files(client: Client, tmp_path: Path) -> None:
    sandbox = client.sandbox(client.sessions.create("scripted", script=[]).id)
    assert sandbox.info()["machine"]["kind"] == "sandbox"
    done = sandbox.exec(
        "read line; echo got:$line $GREETING; pwd; exit 3", stdin="typed\n", env={"GREETING": "hi"}
    )
    assert (done.status, done.exit_code, done.stdout) == ("completed", 3, "got:typed hi\n/workspace\n")
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    running = sandbox.start("sleep 30")
    assert running.status == "running"
    assert sandbox.command(running.command_id).status == "running"
    assert sandbox.kill(running.command_id).status == "killed"
    quick = sandbox.start("echo later")
    assert sandbox.command(quick.command_id, wait=10).stdout == "later\n"
    with pytest.raises(NotFound):
        sandbox.command("cmd_nope")
    assert sandbox.write("lines.txt", "a\nb\nc\n") == 6
    assert sandbox.write("lines.txt", "d\n", append=True) == 2
    assert sandbox.read("lines.txt", start_line=1, end_line=3) == "b\nc\n"
    payload = bytes(range(256)) * 64
    local = tmp_path / "blob.bin"
    local.write_bytes(payload)
    assert sandbox.mkdir("dir") is True
    with pytest.raises(Conflict):
        sandbox.mkdir("dir")  # it is there: without parents that is an error
    assert sandbox.mkdir("deep/er", parents=True) is True and sandbox.mkdir("deep/er", parents=True) is False
    assert sandbox.upload("/workspace/dir/blob.bin", local) == len(payload)
    assert sandbox.download("dir/blob.bin") == payload
    assert sandbox.download_to("dir/blob.bin", tmp_path / "back.bin") == len(payload)
    assert (tmp_path / "back.bin").read_bytes() == payload
    names = {e.name: e.is_directory for e in sandbox.list("/workspace")}
    assert names == {"lines.txt": False, "dir": True, "deep": True}
    assert [e.path for e in sandbox.list(".", recursive=True) if not e.is_directory] == [
        "/workspace/dir/blob.bin", "/workspace/lines.txt",
    ]  # fmt: skip


def test_a_watch_sees_a_change_and_is_deleted_when_left(client: Client) -> None:
    sandbox = client.sandbox(client.sessions.create("scripted", script=[]).id)
    with sandbox.watch("/workspace") as watch:
        sandbox.write("seen.txt", "hello")
        change = next(c for c in watch if c.path.endswith("seen.txt"))
        assert (change.type, change.relative_path, change.is_dir) == ("create", "seen.txt", False)
    with pytest.raises(NotFound):
        next(iter(watch))  # the watcher is gone


# ---------------------------------------------------------------- async, and a real model over HTTP


async def test_the_async_client_drives_a_loopback_openai_model(keyed: Server, llm: str) -> None:
    async with AsyncClient(keyed.url, api_key=KEY) as c:
        session = await c.sessions.create(
            "openai:loopback", machine="none", model_options={"base_url": llm, "api_key": "sk-loopback"}
        )
        result = await c.messages.run(session.id, "say hello")
        assert result.status == "completed" and result.text == LOOPBACK_REPLY
        usage = [e for e in result.events if e.type == "model.usage"]
        assert [(u.data["input_tokens"], u.data["output_tokens"]) for u in usage] == [(11, 7)]
        assert (await c.sessions.get(session.id)).usage["input_tokens"] == 11
        assert session.id in [s.id async for s in c.sessions.list()]
        uploaded = await c.files.upload(b"async bytes", filename="a.txt", session_id=session.id)
        assert await c.files.download(uploaded.id) == b"async bytes"
        assert [f.id async for f in c.files.list(session.id)] == [uploaded.id]
        await c.sessions.delete(session.id)
        with pytest.raises(NotFound):
            await c.sessions.get(session.id)
        sandbox = c.sandbox("sdk-first")
        assert (await sandbox.exec("echo async")).stdout == "async\n"
        await sandbox.write("x.txt", "x")
        assert await sandbox.read("x.txt") == "x"
        assert await sandbox.mkdir("made/here", parents=True) is True
        [made] = await sandbox.list("made")
        assert (made.name, made.is_directory, made.extension) == ("here", True, None)
        async with await sandbox.watch("/workspace") as watch:
            await sandbox.write("y.txt", "y")
            async for change in watch:
                if change.path.endswith("y.txt"):
                    break
        assert change.path == "/workspace/y.txt"


def test_run_of_a_message_that_joins_a_running_turn_returns_the_answer_it_got_there(client: Client) -> None:
    hold = "while [ ! -e /workspace/go ]; do sleep 0.05; done"
    session = client.sessions.create(
        "scripted", permission_mode="full-auto",
        script=[bash(hold), {"expect": {"user_message_contains": "also"}, "text": "Both answered."}],
    )  # fmt: skip
    first = client.messages.send(session.id, "first")
    deadline = time.monotonic() + 20
    while not any(e.type == "agent.tool_use" for e in client.events.list(session.id)):
        assert time.monotonic() < deadline, "the first turn never called its tool"
        time.sleep(0.02)
    results: list[Any] = []
    joiner = threading.Thread(target=lambda: results.append(client.messages.run(session.id, "also")))
    joiner.start()
    while not any(
        e.type == "user.message" and e.data["content"] == "also" for e in client.events.list(session.id)
    ):
        assert time.monotonic() < deadline, "the second message never arrived"
        time.sleep(0.02)
    client.sandbox(session.id).exec("touch /workspace/go")
    joiner.join(20)
    (result,) = results
    assert result.status == "completed" and result.text == "Both answered."
    assert result.events[-1].turn_id == result.turn_id != first.turn_id
    assert result.ended.data["joined_into"] == first.turn_id
