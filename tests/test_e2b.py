"""The stock `e2b` SDK (sync client) against a real `agentbox serve` on loopback.

The SDK is pointed at the server the way a user would: `E2B_API_URL` and `E2B_SANDBOX_URL`
at the one port, `E2B_API_KEY` the server's key. Every sandbox it creates is a real
bubblewrap sandbox of the server's default machine.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox, SandboxQuery, SandboxState
from e2b.api.client.api.sandboxes import get_sandboxes, post_sandboxes, post_sandboxes_sandbox_id_connect
from e2b.api.client.models import ConnectSandbox, NewSandbox
from e2b.api.client.models import Sandbox as SandboxModel
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry

from agentbox.api.app import create_app
from agentbox.config import Settings
from agentbox.e2b import CONTROL_PATH
from tests.conftest import (
    POLL_SECONDS,
    Server,
    eventually,
    point_e2b_sdk,
    start_server,
    stop_server,
    traversable,
)

API_KEY = "e2b-test-key"
#: Seconds a condition (a sandbox ending at its timeout) may take before a test fails.
DEADLINE_SECONDS = 20.0


@pytest.fixture(scope="module")
def e2b_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = traversable(tmp_path_factory.mktemp("e2b"), tmp_path_factory) / "home"
    home.mkdir()
    server = start_server(home, env={"AGENTBOX_API_KEY": API_KEY})
    assert server.api_key == API_KEY
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def e2b_env(e2b_server: Server) -> Iterator[Server]:
    """The SDK's environment pointed at the server, for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        point_e2b_sdk(mp, e2b_server)
        yield e2b_server


@pytest.fixture
def sbx(e2b_env: Server) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(metadata={"suite": "e2b"}, envs={"GREETING": "hello from e2b"})
    yield sandbox
    sandbox.kill()


def test_commands_run_in_an_isolated_sandbox(sbx: Sandbox, e2b_env: Server) -> None:
    result = sbx.commands.run("echo hi; echo oops >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "oops\n", 0)
    # The sandbox is the session's bubblewrap sandbox: its own pid namespace, /workspace as cwd.
    inside = sbx.commands.run("echo $$; pwd; echo $GREETING")
    pid, cwd, greeting = inside.stdout.split("\n")[:3]
    assert int(pid) < 100 and cwd == "/workspace" and greeting == "hello from e2b"
    # The server's home on the host (where this sandbox's workspace lives) is not visible in it.
    assert sbx.commands.run(f"test -e {e2b_env.home} || echo hidden").stdout == "hidden\n"


def test_a_failing_command_raises_with_its_exit_code(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo bad >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stderr == "bad\n"


def test_commands_run_as_user_unless_root_is_asked_for(sbx: Sandbox) -> None:
    """envd's default user, as the SDK assumes: `user` (uid 1000, home /home/user); `root` on request."""
    mine = sbx.commands.run('whoami; id -u; echo "$HOME"; cd ~ && pwd; echo made > ~/note')
    assert mine.stdout.split("\n")[:4] == ["user", "1000", "/home/user", "/home/user"]
    assert sbx.commands.run("whoami; id -u", user="root").stdout == "root\n0\n"
    # each sees the other's files as its own: one owner, seen as 1000 or 0
    assert (
        sbx.commands.run("stat -c %U /home/user/note; cat /home/user/note", user="root").stdout
        == "root\nmade\n"
    )
    assert sbx.commands.run("whoami", user="user").stdout == "user\n"
    assert sbx.commands.run("sudo whoami; sudo -u user whoami").stdout == "root\nuser\n"  # passwordless, as in E2B
    handle = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.run("ps -o user= -p $(pgrep -x sleep)").stdout == "user\n"
    handle.kill()


def test_an_account_the_sandbox_lacks_is_invalid_argument(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="no user 'postgres'"):
        sbx.commands.run("touch /workspace/ran", user="postgres")
    assert not sbx.files.exists("/workspace/ran")


def test_background_command_is_listed_and_killed(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 600", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(handle.pid)
    with pytest.raises(CommandExitException) as ended:
        handle.wait()
    assert ended.value.exit_code == 137
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_output_streams_while_the_command_runs(sbx: Sandbox) -> None:
    seen: list[tuple[str, float]] = []
    started = time.monotonic()
    sbx.commands.run(
        "echo first; sleep 1; echo second", on_stdout=lambda line: seen.append((line, time.monotonic()))
    )
    assert [line for line, _ in seen] == ["first\n", "second\n"]
    assert seen[0][1] - started < seen[1][1] - started - 0.5  # the first arrived before the sleep ended


def test_a_command_is_killed_at_its_timeout(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    # As envd does it: the call's timeout is the process's deadline, not only the stream's.
    eventually(lambda: not sbx.commands.list(), "the timed-out process to be gone")
    assert sbx.commands.run("grep -lx sleep /proc/[0-9]*/comm | wc -l").stdout == "0\n"


def test_commands_take_cwd_envs_and_stdin(sbx: Sandbox) -> None:
    sbx.files.make_dir("/workspace/here")
    result = sbx.commands.run("pwd; echo $ONE", cwd="/workspace/here", envs={"ONE": "1"})
    assert result.stdout == "/workspace/here\n1\n"
    reader = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(reader.pid, "typed in\n")
    sbx.commands.close_stdin(reader.pid)
    assert reader.wait().stdout == "typed in\n"


def test_connect_to_a_running_command(sbx: Sandbox) -> None:
    ticker = sbx.commands.run("read _; echo after connect", background=True, stdin=True)
    again = sbx.commands.connect(ticker.pid)
    sbx.commands.send_stdin(ticker.pid, "go\n")
    assert again.wait().stdout == "after connect\n"
    assert sbx.commands.kill(ticker.pid) is False  # it has ended: nothing to kill
    assert sbx.commands.kill(999_999) is False


def test_files_write_read_list_make_dir_remove_exists(sbx: Sandbox) -> None:
    info = sbx.files.write("/workspace/notes/a.txt", "alpha\n")
    assert info.path == "/workspace/notes/a.txt"
    assert sbx.files.read("/workspace/notes/a.txt") == "alpha\n"
    assert sbx.files.read("notes/a.txt", format="bytes") == b"alpha\n"
    assert sbx.commands.run("cat /workspace/notes/a.txt").stdout == "alpha\n"
    assert sbx.files.make_dir("/workspace/notes/sub") is True
    assert sbx.files.make_dir("/workspace/notes/sub") is False
    names = sorted((e.name, e.type.value if e.type else None) for e in sbx.files.list("/workspace/notes"))
    assert names == [("a.txt", "file"), ("sub", "dir")]
    assert sbx.files.exists("/workspace/notes/a.txt")
    written = sbx.files.write_files(
        [
            WriteEntry(path="/workspace/notes/sub/x.txt", data="x"),
            WriteEntry(path="notes/sub/y.txt", data=b"y"),
        ]
    )
    assert [w.path for w in written] == ["/workspace/notes/sub/x.txt", "/workspace/notes/sub/y.txt"]
    deep = sorted(e.path for e in sbx.files.list("/workspace/notes", depth=2))
    assert deep == [f"/workspace/notes/{n}" for n in ("a.txt", "sub", "sub/x.txt", "sub/y.txt")]
    moved = sbx.files.rename("/workspace/notes/a.txt", "/workspace/notes/b.txt")
    assert (moved.name, moved.path) == ("b.txt", "/workspace/notes/b.txt")
    assert sbx.files.read("/workspace/notes/b.txt") == "alpha\n"
    assert not sbx.files.exists("/workspace/notes/a.txt")
    sbx.files.remove("/workspace/notes")
    assert not sbx.files.exists("/workspace/notes/a.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/workspace/notes/b.txt")


def test_watch_dir_reports_changes(sbx: Sandbox) -> None:
    sbx.files.make_dir("/workspace/w")
    handle = sbx.files.watch_dir("/workspace/w", recursive=True)
    try:
        sbx.files.write("/workspace/w/new.txt", "x")
        sbx.commands.run("mv /workspace/w/new.txt /workspace/w/moved.txt && rm /workspace/w/moved.txt")
        seen: list[tuple[str, str]] = []

        def arrived() -> bool:
            seen.extend((e.name, e.type.name) for e in handle.get_new_events())
            return ("moved.txt", "REMOVE") in seen

        eventually(arrived, "the watcher's events")
        assert ("new.txt", "CREATE") in seen and ("new.txt", "WRITE") in seen
        assert ("new.txt", "RENAME") in seen and ("moved.txt", "CREATE") in seen
        assert {name for name, _ in seen} == {"new.txt", "moved.txt"}  # no staging files
    finally:
        handle.stop()


def test_signed_file_urls_work_without_headers(sbx: Sandbox) -> None:
    upload = sbx.upload_url("/workspace/signed.txt")
    assert httpx.post(upload, files={"file": ("signed.txt", b"by url")}).status_code == 200
    assert httpx.get(sbx.download_url("/workspace/signed.txt")).content == b"by url"
    assert (
        httpx.get(sbx.download_url("/workspace/signed.txt", use_signature_expiration=60)).content == b"by url"
    )
    expired = httpx.get(sbx.download_url("/workspace/signed.txt", use_signature_expiration=-1))
    assert expired.status_code == 401 and set(expired.json()) == {"code", "message"}
    other_path = sbx.download_url("/workspace/signed.txt").replace("signed.txt", "other.txt", 1)
    assert httpx.get(other_path).status_code == 401  # the signature covers the path


def test_agentbox_api_reaches_the_same_sandbox(sbx: Sandbox, e2b_env: Server) -> None:
    sbx.files.write("/workspace/shared.txt", "one sandbox")
    with e2b_env.client() as client:  # agentbox's own key and routes, under the session's prefix
        read = client.get(f"/sandboxes/{sbx.sandbox_id}/v2/fs/read", params={"path": "/workspace/shared.txt"})
        assert read.status_code == 200, read.text
        assert "one sandbox" in read.text


def test_connect_list_and_kill(e2b_env: Server) -> None:
    first = Sandbox.create(metadata={"owner": "connect-test"})
    try:
        first.files.write("/workspace/kept.txt", "still here")
        again = Sandbox.connect(first.sandbox_id)
        assert again.files.read("/workspace/kept.txt") == "still here"
        listed = Sandbox.list(query=SandboxQuery(metadata={"owner": "connect-test"})).next_items()
        assert [s.sandbox_id for s in listed] == [first.sandbox_id]
        assert listed[0].metadata == {"owner": "connect-test"}
        assert Sandbox.get_info(first.sandbox_id).state.value == "running"
    finally:
        assert first.kill() is True
    assert not (e2b_env.home / "sessions" / first.sandbox_id / "workspace" / "kept.txt").exists()
    assert Sandbox.kill(first.sandbox_id) is False  # gone: E2B's 404, read as "nothing to kill"
    with pytest.raises(NotFoundException):
        Sandbox.connect(first.sandbox_id)


def test_pause_keeps_the_workspace_and_connect_resumes(e2b_env: Server) -> None:
    sandbox = Sandbox.create(metadata={"owner": "pause-test"})
    try:
        sandbox.files.write("/workspace/kept.txt", "across the pause")
        sandbox.commands.run("echo gone > /tmp/scratch.txt")
        assert sandbox.files.exists("/tmp/scratch.txt")
        assert sandbox.pause() is True
        assert sandbox.pause() is False  # already paused: E2B's 409
        assert not sandbox.is_running()
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
        paused = Sandbox.list(
            query=SandboxQuery(metadata={"owner": "pause-test"}, state=[SandboxState.PAUSED])
        )
        assert [s.sandbox_id for s in paused.next_items()] == [sandbox.sandbox_id]
        resumed = Sandbox.connect(sandbox.sandbox_id)
        assert resumed.is_running()
        assert resumed.files.read("/workspace/kept.txt") == "across the pause"
        assert not resumed.files.exists("/tmp/scratch.txt")  # a filesystem-only pause: /tmp is new
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "running"
    finally:
        Sandbox.kill(sandbox.sandbox_id)


def test_an_idempotency_key_makes_one_sandbox(e2b_env: Server) -> None:
    first = Sandbox.create(idempotency_key="make-once-1")
    try:
        again = Sandbox.create(idempotency_key="make-once-1")
        assert again.sandbox_id == first.sandbox_id
        other = Sandbox.create(idempotency_key="make-once-2")
        assert other.sandbox_id != first.sandbox_id
        other.kill()
    finally:
        first.kill()
    anew = Sandbox.create(idempotency_key="make-once-1")  # the key's sandbox is gone: a new one
    assert anew.sandbox_id != first.sandbox_id
    anew.kill()
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": API_KEY}) as client:
        bad = client.post("/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": "Not OK"})
        assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["message"]


def test_the_v1_routes_of_older_sdks(e2b_env: Server) -> None:
    """`e2b` up to 2.45 creates with `POST /sandboxes` and connects with `/sandboxes/{id}/connect`
    (measured: 2.45.1 against this server does the whole create/run/files/kill round); here
    through those routes' client code as the current SDK still ships it."""
    client = get_api_client(ConnectionConfig())
    body = NewSandbox(template_id="base", timeout=60, metadata={"route": "v1"}, env_vars={"V": "1"})
    created = post_sandboxes.sync_detailed(client=client, body=body)
    assert created.status_code == 201, created.content
    sandbox = created.parsed
    assert isinstance(sandbox, SandboxModel) and sandbox.envd_access_token
    try:
        joined = post_sandboxes_sandbox_id_connect.sync_detailed(
            sandbox.sandbox_id, client=client, body=ConnectSandbox(timeout=120)
        )
        assert joined.status_code == 200 and joined.parsed.sandbox_id == sandbox.sandbox_id  # type: ignore[union-attr]
        listed = get_sandboxes.sync_detailed(client=client, metadata="route=v1")
        assert [s.sandbox_id for s in listed.parsed] == [sandbox.sandbox_id]  # type: ignore[union-attr]
        assert Sandbox.connect(sandbox.sandbox_id).commands.run("echo $V").stdout == "1\n"
    finally:
        Sandbox.kill(sandbox.sandbox_id)


def test_a_sandbox_outlives_a_server_restart(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = traversable(tmp_path_factory.mktemp("e2b-restart"), tmp_path_factory) / "home"
    home.mkdir()
    first = start_server(home, env={"AGENTBOX_API_KEY": API_KEY})
    try:
        point_e2b_sdk(monkeypatch, first)
        kept = Sandbox.create(metadata={"owner": "restart"}, envs={"KEPT": "env too"}, timeout=600)
        kept.files.write("/workspace/kept.txt", "across a restart")
        ended = Sandbox.create(timeout=60)
        ended.set_timeout(2)  # its end passes while the server is down
    finally:
        stop_server(first)
    record = (home / "sessions" / kept.sandbox_id / "e2b.json").read_text()
    assert "env too" not in record and kept._envd_access_token not in record  # sealed at rest
    time.sleep(2)  # past `ended`'s end: a fixed wait, since no server runs to be asked
    second = start_server(home, env={"AGENTBOX_API_KEY": API_KEY})
    try:
        point_e2b_sdk(monkeypatch, second)
        again = Sandbox.connect(kept.sandbox_id)
        assert again.files.read("/workspace/kept.txt") == "across a restart"
        assert again.commands.run("echo $KEPT").stdout == "env too\n"
        assert Sandbox.get_info(kept.sandbox_id).metadata == {"owner": "restart"}
        with pytest.raises(NotFoundException):
            Sandbox.get_info(ended.sandbox_id)
        assert not (home / "sessions" / ended.sandbox_id).exists()
        again.kill()
    finally:
        stop_server(second)


def test_no_agentbox_route_is_shadowed(tmp_path: Path) -> None:
    """E2B's dispatch takes every path CONTROL_PATH matches: none may be one of agentbox's."""
    app = create_app(Settings(home=tmp_path))
    paths = [re.sub(r"\{[^}]+\}", "x", getattr(r, "path", "")) for r in app.router.routes]
    assert len(paths) > 100  # the sandbox routers, twice
    assert [p for p in paths if CONTROL_PATH.fullmatch(p)] == []


def test_a_wrong_api_key_is_refused(e2b_env: Server) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-the-key")


def test_errors_are_code_and_message(e2b_env: Server) -> None:
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": API_KEY}) as client:
        bad = client.post("/v2/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and set(bad.json()) == {"code", "message"}
        assert bad.json()["code"] == 400
        wrong = client.post("/sandboxes", json={"templateID": "base", "timeout": "soon"})
        assert wrong.status_code == 400 and "timeout" in wrong.json()["message"]
        missing = client.get("/sandboxes/ses_nothere")
        assert missing.status_code == 404 and missing.json()["code"] == 404
        unserved = client.post("/sandboxes/ses_nothere/snapshots")
        assert unserved.status_code == 404 and set(unserved.json()) == {"code", "message"}
        refused = client.get("/v2/sandboxes", headers={"X-API-Key": "wrong"})
        assert refused.status_code == 401 and set(refused.json()) == {"code", "message"}


def test_envd_checks_the_access_token(sbx: Sandbox, e2b_env: Server) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"}
    with httpx.Client(base_url=e2b_env.url, headers=headers) as client:
        assert client.get("/files", params={"path": "/workspace"}).status_code == 401
        refused = client.post("/filesystem.Filesystem/Stat", json={"path": "/workspace"})
        assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated"
        assert client.get("/health").status_code == 204


def test_malformed_connect_messages_are_invalid_argument(sbx: Sandbox, e2b_env: Server) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
    with httpx.Client(base_url=e2b_env.url, headers=headers) as client:
        for body in (b"{not json", b'{"path": 7}'):
            bad = client.post(
                "/filesystem.Filesystem/Stat", content=body, headers={"Content-Type": "application/json"}
            )
            assert bad.status_code == 400 and bad.json()["code"] == "invalid_argument", bad.text
        empty = client.post("/filesystem.Filesystem/Stat", json={"path": ""})
        assert empty.status_code == 400 and empty.json()["code"] == "invalid_argument"
        upload = client.post("/files", content=b"data", headers={"Content-Type": "application/octet-stream"})
        assert upload.status_code == 400 and set(upload.json()) == {"code", "message"}


def test_the_sandbox_ends_at_its_timeout(e2b_env: Server) -> None:
    short = Sandbox.create(timeout=60)
    assert short.is_running()
    short.set_timeout(1)
    eventually(lambda: not short.is_running(), "the sandbox to end at its timeout")
    with pytest.raises(NotFoundException):
        Sandbox.get_info(short.sandbox_id)
    assert not (e2b_env.home / "sessions" / short.sandbox_id).exists()


async def test_the_async_client(e2b_env: Server) -> None:
    sandbox = await AsyncSandbox.create(envs={"WHO": "async"})
    try:
        result = await sandbox.commands.run("echo $WHO")
        assert result.stdout == "async\n"
        await sandbox.files.write("/workspace/a.bin", b"\x00\x01")
        assert await sandbox.files.read("/workspace/a.bin", format="bytes") == b"\x00\x01"
        assert [e.name for e in await sandbox.files.list("/workspace")] == ["a.bin"]
        events: list[str] = []
        handle = await sandbox.files.watch_dir("/workspace", on_event=lambda e: events.append(e.name))
        await sandbox.files.write("/workspace/watched.txt", "w")
        deadline = time.monotonic() + DEADLINE_SECONDS
        while "watched.txt" not in events and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        await handle.stop()
        assert "watched.txt" in events
    finally:
        await sandbox.kill()
    assert not await sandbox.is_running()


async def test_a_gzip_upload_is_inflated_a_bounded_piece_at_a_time() -> None:
    """One small compressed chunk that stands for 16 MiB never becomes one 16 MiB buffer."""
    import gzip

    from agentbox.e2b.files import GUNZIP_PIECE_BYTES, gunzipped

    whole = 16 * GUNZIP_PIECE_BYTES
    body = gzip.compress(bytes(whole))
    assert len(body) < GUNZIP_PIECE_BYTES

    async def one_chunk() -> AsyncIterator[bytes]:
        yield body

    pieces = [piece async for piece in gunzipped(one_chunk())]
    assert max(map(len, pieces)) == GUNZIP_PIECE_BYTES and sum(map(len, pieces)) == whole
