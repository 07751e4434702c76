"""The `e2b` machine kind against agentbox's own E2B endpoint on loopback.

One real `agentbox serve` (tests/conftest.py `start_server`) serves E2B's control plane and
envd; an `E2BMachine` (the stock `e2b` SDK's async client underneath) is pointed at it, as an
entry with `api_url`, `sandbox_url` and `api_key` would point one at any E2B-compatible
endpoint. Each sandbox it makes is a real bubblewrap sandbox of that server, whose workspace
is a host folder: a test checks the sandbox's side on disk there. At the end, a second
server whose default machine is of kind `e2b` serves a session through it, and a restart of
that server finds the same sandbox again through the session's marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from conftest import Server, e2b_entry, start_e2b_client, stop_server, traversable
from test_api_v2 import Aio

from agentbox.config import home_label
from agentbox.machines.base import ExecRequest, Lifetime, WatchChange, Watching
from agentbox.machines.e2b import EXTRA, REQUEST_TIMEOUT, E2BMachine, E2BOptions, sdk
from agentbox.machines.e2b import sweep as sweeping
from agentbox.machines.e2b.machine import HOME_KEY, INSTANCE_KEY
from agentbox.machines.errors import MachineUnavailable, OwnerUnsupported
from agentbox.machines.kinds import KINDS
from agentbox.store.db import Database
from agentbox.store.markers import MarkersRepo
from agentbox.workspace import files, remote_files
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import RemoteOps, file_ops

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: Seconds a condition (an event arrived, a sandbox gone) may take before a test fails.
DEADLINE = 20.0


@pytest.fixture(scope="module")
def endpoint(e2b_endpoint: Server) -> Server:
    return e2b_endpoint


def entry(endpoint: Server, **overrides: object) -> dict[str, object]:
    return e2b_entry(endpoint, **overrides)


def new_machine(endpoint: Server, env: dict[str, str] | None = None, **overrides: object) -> E2BMachine:
    session = f"ses_{uuid.uuid4().hex[:12]}"
    return E2BMachine("cloud", f"sbx_{uuid.uuid4().hex[:12]}", E2BOptions.from_options(entry(endpoint, **overrides)),
                      env, session_id=session)  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def machine(endpoint: Server) -> AsyncIterator[E2BMachine]:
    """One started machine for the module; each test works in a folder of its own."""
    made = new_machine(endpoint, {"FROM_MACHINE": "m"})
    await made.start()
    yield made
    await made.destroy()


@pytest.fixture
def box(machine: E2BMachine, endpoint: Server) -> tuple[str, Path]:
    """A fresh folder in the sandbox: its inside path and the host folder that holds it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    host = endpoint.home / "sessions" / str(machine.sandbox_id) / "workspace" / name
    return f"/workspace/{name}", host


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


# --- the kind's row and its entry -------------------------------------------------------


async def test_the_kind_is_one_row_and_refuses_bad_entries() -> None:
    assert KINDS["e2b"].make.__name__ == "make_e2b"
    with pytest.raises(ValueError, match="colour"):
        E2BOptions.from_options({"colour": "blue"})
    with pytest.raises(ValueError, match="timeout must be an integer"):
        E2BOptions.from_options({"timeout": "soon"})
    with pytest.raises(ValueError, match="on_stop"):
        E2BOptions.from_options({"on_stop": "freeze"})
    sealed = E2BOptions.from_options({"api_key": "enc:gAAAA"})  # describable, not usable
    with pytest.raises(MachineUnavailable, match="still encrypted"):
        sealed.api_params()
    assert E2BOptions.from_options({}).root == "/home/user"


async def test_the_cloud_is_a_domain_and_a_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_E2B_KEY", "e2b_from_env")
    cloud = E2BOptions.from_options({"domain": "e2b.app", "api_key_env": "TEAM_E2B_KEY"})
    assert cloud.api_params() == {
        "request_timeout": REQUEST_TIMEOUT,
        "domain": "e2b.app",
        "api_key": "e2b_from_env",
    }
    given = E2BOptions.from_options({"domain": "e2b.app", "api_key": "e2b_given"})
    assert given.api_params()["api_key"] == "e2b_given" and given.where == "e2b.app"


async def test_without_the_sdk_the_kind_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, endpoint: Server
) -> None:
    monkeypatch.setitem(sys.modules, "e2b", None)  # what an install without the extra has
    with pytest.raises(MachineUnavailable, match=r"agentbox\[e2b\]"):
        sdk()
    with pytest.raises(MachineUnavailable, match=r"install agentbox\[e2b\]"):
        await new_machine(endpoint).start()
    assert EXTRA == "agentbox[e2b]"


async def test_a_wrong_key_is_machine_unavailable(endpoint: Server) -> None:
    refused = new_machine(endpoint, api_key="not-the-key")
    with pytest.raises(MachineUnavailable, match="refused the API key"):
        await refused.start()


# --- commands ---------------------------------------------------------------------------


async def test_it_is_an_isolated_lifetime_with_a_watch(machine: E2BMachine) -> None:
    assert isinstance(machine, Lifetime) and isinstance(machine, Watching)
    assert machine.isolated and machine.kind == "e2b" and machine.root == "/workspace"
    assert isinstance(file_ops(machine), RemoteOps)
    assert machine.marker() == {"e2b_sandbox_id": machine.sandbox_id, "endpoint": machine.options.where}


async def test_exec_output_exit_codes_signals_and_limits(machine: E2BMachine) -> None:
    r = await machine.exec(ExecRequest(command="echo hi; echo oops >&2; exit 3"))
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"hi\n", b"oops\n", False)
    assert (await machine.exec(ExecRequest(argv=("printf", "%s|", "a b", "c")))).stdout == b"a b|c|"
    assert (await machine.exec(ExecRequest(command="kill -TERM $$"))).exit_code == 128 + signal.SIGTERM
    big = await machine.exec(ExecRequest(command="head -c 3000000 /dev/zero", output_limit=1000))
    assert (len(big.stdout), big.stdout_truncated, big.exit_code) == (1000, True, 0)
    binary = await machine.exec(ExecRequest(command="printf '\\377\\000\\376'"))
    assert binary.stdout == b"\xff\x00\xfe"  # bytes as they are, not decoded text


async def test_cwd_env_and_stdin(machine: E2BMachine) -> None:
    assert (await machine.exec(ExecRequest(command="pwd"))).stdout == b"/workspace\n"
    assert (await machine.exec(ExecRequest(command="pwd", cwd="/tmp"))).stdout == b"/tmp\n"
    r = await machine.exec(ExecRequest(argv=("env",), env={"FROM_REQUEST": "r"}))
    seen = dict(line.split("=", 1) for line in r.stdout.decode().splitlines() if "=" in line)
    assert seen["FROM_MACHINE"] == "m" and seen["FROM_REQUEST"] == "r"
    assert set(seen) - {"PWD", "OLDPWD"} == set(machine.command_env(ExecRequest(env={"FROM_REQUEST": "r"})))
    assert (await machine.exec(ExecRequest(command="tr a-z A-Z", stdin=b"hello\n"))).stdout == b"HELLO\n"
    assert (await machine.exec(ExecRequest(command="cat"))).stdout == b""  # no stdin: EOF at once
    process = await machine.spawn(ExecRequest(command="read line; echo got $line", interactive=True))
    await process.write_stdin(b"ping\n")
    await process.close_stdin()
    assert await process.stdout.read() == b"got ping\n" and await process.wait() == 0


async def test_spawn_errors_are_oserrors(machine: E2BMachine) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        await machine.exec(ExecRequest(command="true", cwd="missing"))
    assert missing.value.filename == "/workspace/missing"
    with pytest.raises(NotADirectoryError):
        await machine.exec(ExecRequest(command="true", cwd="/etc/passwd"))
    with pytest.raises(FileNotFoundError) as unknown:
        await machine.exec(ExecRequest(argv=("no-such-program-here",)))
    assert unknown.value.filename == "no-such-program-here"


async def test_a_timeout_and_a_kill_end_the_command(machine: E2BMachine) -> None:
    started = time.monotonic()
    r = await machine.exec(ExecRequest(command="sleep 300", timeout=1))
    assert r.timed_out and r.exit_code == 128 + signal.SIGKILL and time.monotonic() - started < 10
    left = await machine.exec(
        ExecRequest(command="sleep 300 & echo $! > /tmp/bg.pid; exec sleep 301", timeout=1)
    )
    assert left.timed_out
    gone = "for i in $(seq 100); do kill -0 $(cat /tmp/bg.pid) 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
    assert (await machine.exec(ExecRequest(command=gone))).exit_code == 0  # its whole group was killed
    process = await machine.spawn(ExecRequest(command="sleep 300"))
    assert machine.busy()
    process.kill(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), DEADLINE) == 128 + signal.SIGTERM
    interrupted = await machine.spawn(ExecRequest(command="trap 'exit 42' INT; sleep 300 & wait"))
    interrupted.kill(signal.SIGINT)  # not one of envd's signals: `kill` in the sandbox
    assert await asyncio.wait_for(interrupted.wait(), DEADLINE) == 42
    assert await machine.find_program("sh") == "/usr/bin/sh" or await machine.find_program("sh") == "/bin/sh"


# --- files --------------------------------------------------------------------------------


async def test_write_read_and_their_errors(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, host = box
    await machine.mkdir(inside)
    await machine.write(f"{inside}/a.txt", b"alpha")
    assert (host / "a.txt").read_bytes() == b"alpha"
    assert await machine.read(f"{inside}/a.txt") == b"alpha"
    assert await machine.read(f"{inside}/a.txt", offset=1, length=3) == b"lph"
    assert await machine.read(f"{inside}/a.txt", length=2) == b"al"
    assert await machine.read(f"{inside}/a.txt", offset=3) == b"ha"
    with pytest.raises(OSError) as big:
        await machine.read(f"{inside}/a.txt", limit=4)
    assert big.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        await machine.read(f"{inside}/missing")
    with pytest.raises(IsADirectoryError):
        await machine.read(inside)
    with pytest.raises(NotADirectoryError):
        await machine.list(f"{inside}/a.txt")
    with pytest.raises(FileNotFoundError):
        await machine.list(f"{inside}/missing")
    with pytest.raises(FileNotFoundError):
        await machine.write(f"{inside}/no/such/dir.txt", b"x")
    with pytest.raises(IsADirectoryError):
        await machine.write(inside, b"x")
    st = await machine.stat(f"{inside}/a.txt")
    assert st is not None and (st.is_file, st.is_dir, st.size) == (True, False, 5)
    assert await machine.stat(f"{inside}/missing") is None


async def test_a_write_is_atomic_and_keeps_the_mode(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, host = box
    await machine.mkdir(inside)
    target = f"{inside}/streamed.bin"
    assert await machine.write_stream(target, chunks(b"123", b"45"), limit=5) == 5
    with pytest.raises(OSError) as err:
        await machine.write_stream(target, chunks(b"abc", b"def"), limit=5)
    assert err.value.errno == errno.EFBIG
    assert (host / "streamed.bin").read_bytes() == b"12345"
    assert sorted(p.name for p in host.iterdir()) == ["streamed.bin"]  # no part left behind
    await machine.exec(ExecRequest(argv=("chmod", "755", target)))
    await machine.write(target, b"new")
    assert (host / "streamed.bin").stat().st_mode & 0o777 == 0o755
    await machine.symlink("streamed.bin", f"{inside}/link")
    await machine.write(f"{inside}/link", b"through the link")
    assert (host / "streamed.bin").read_bytes() == b"through the link" and (host / "link").is_symlink()


async def test_create_is_exclusive(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, host = box
    await machine.mkdir(inside)
    assert await machine.create(f"{inside}/new.txt", chunks(b"one ", b"two"), limit=7) == 7
    with pytest.raises(FileExistsError):
        await machine.create(f"{inside}/new.txt", chunks(b"other"), limit=100)
    assert (host / "new.txt").read_bytes() == b"one two"
    await machine.symlink(f"{inside}/nowhere", f"{inside}/dangling")
    with pytest.raises(FileExistsError):
        await machine.create(f"{inside}/dangling", chunks(b"x"), limit=100)
    assert not (host / "nowhere").exists()
    with pytest.raises(OSError) as big:
        await machine.create(f"{inside}/big.bin", chunks(b"12345", b"6"), limit=5)
    assert big.value.errno == errno.EFBIG
    assert sorted(p.name for p in host.iterdir()) == ["dangling", "new.txt"]


async def test_dirs_links_renames_and_removes(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, host = box
    await machine.mkdir(f"{inside}/a/b", parents=True)
    await machine.mkdir(f"{inside}/a/b", parents=True)  # already there: fine with parents
    with pytest.raises(FileExistsError):
        await machine.mkdir(f"{inside}/a")
    with pytest.raises(FileNotFoundError):
        await machine.mkdir(f"{inside}/x/y")
    await machine.write(f"{inside}/a/b/f.txt", b"f")
    with pytest.raises(OSError) as not_empty:
        await machine.remove(f"{inside}/a")
    assert not_empty.value.errno == errno.ENOTEMPTY
    await machine.symlink("a/b", f"{inside}/to-b")
    assert await machine.readlink(f"{inside}/to-b") == "a/b"
    linked = await machine.stat(f"{inside}/to-b")
    assert linked is not None and linked.is_symlink and linked.is_dir
    listed = {e.name: e.stat for e in await machine.list(inside)}
    assert sorted(listed) == ["a", "to-b"] and listed["to-b"].is_dir and listed["to-b"].is_symlink
    with pytest.raises(OSError) as not_link:
        await machine.readlink(f"{inside}/a")
    assert not_link.value.errno == errno.EINVAL
    with pytest.raises(FileExistsError):
        await machine.symlink("elsewhere", f"{inside}/to-b")
    await machine.rename(f"{inside}/a/b/f.txt", f"{inside}/g.txt")
    assert (host / "g.txt").read_bytes() == b"f" and not (host / "a/b/f.txt").exists()
    with pytest.raises(FileNotFoundError):
        await machine.rename(f"{inside}/gone.txt", f"{inside}/h.txt")
    await machine.remove(f"{inside}/to-b")  # the link, not what it leads to
    assert (host / "a/b").is_dir()
    await machine.remove(f"{inside}/a", recursive=True)
    assert sorted(p.name for p in host.iterdir()) == ["g.txt"]
    with pytest.raises(FileNotFoundError):
        await machine.remove(f"{inside}/a")


async def test_owners(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, _ = box
    await machine.mkdir(inside)
    assert await machine.user_ids("root") == (0, 0)
    assert await machine.user_ids("nobody") != (0, 0)  # the sandbox's own accounts, asked of it
    await machine.write(f"{inside}/o.txt", b"o")
    await machine.chown(f"{inside}/o.txt", "root")
    owned = await machine.exec(ExecRequest(argv=("stat", "-c", "%u:%g", f"{inside}/o.txt")))
    assert owned.stdout.decode().strip() == "0:0"
    with pytest.raises(FileNotFoundError):
        await machine.chown(f"{inside}/missing.txt", "root")
    with pytest.raises(OwnerUnsupported):
        await machine.chown(f"{inside}/o.txt", "no-such-user-here")


async def test_the_workspace_layer_maps_its_errors(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, _ = box
    await machine.mkdir(inside)
    await machine.write(f"{inside}/eleven.txt", b"x" * 11)
    saved = files.MAX_READ_BYTES
    files.MAX_READ_BYTES = 10
    try:
        with pytest.raises(WorkspaceError) as err:
            await remote_files.read_text(machine, f"{inside}/eleven.txt")
    finally:
        files.MAX_READ_BYTES = saved
    assert (err.value.error_type, err.value.errno) == ("bad_request", errno.EFBIG)
    with pytest.raises(WorkspaceError) as missing:
        await remote_files.read_text(machine, f"{inside}/missing.txt")
    assert missing.value.error_type == "not_found"
    listing = await remote_files.list_dir(machine, inside)
    assert [e.name for e in listing.files] == ["eleven.txt"]


# --- watching ---------------------------------------------------------------------------


async def test_the_watch_reports_changes(machine: E2BMachine, box: tuple[str, Path]) -> None:
    inside, _ = box
    await machine.mkdir(inside)
    with pytest.raises(FileNotFoundError):
        await machine.watch(f"{inside}/missing").start()
    seen: list[WatchChange] = []
    async with machine.watch(inside) as watch:
        await machine.exec(
            ExecRequest(command=f"cd {inside} && echo x > new.txt && mv new.txt moved.txt && rm moved.txt")
        )

        async def until_removed() -> None:
            async for change in watch:
                seen.append(change)
                if change.event == "remove" and change.path.endswith("moved.txt"):
                    return

        await asyncio.wait_for(until_removed(), DEADLINE)
    kinds = [(c.event, c.path.rsplit("/", 1)[1]) for c in seen]
    assert ("create", "new.txt") in kinds and ("write", "new.txt") in kinds
    renamed = [c for c in seen if c.event == "rename"]
    assert [(c.old_path, c.path) for c in renamed] == [(f"{inside}/new.txt", f"{inside}/moved.txt")]


# --- lifecycle ----------------------------------------------------------------------------


async def test_pause_on_stop_reconnect_after_a_restart_and_kill_on_destroy(endpoint: Server) -> None:
    first = new_machine(endpoint)
    await first.start()
    sandbox_id = first.sandbox_id
    info = await sdk().AsyncSandbox.get_info(sandbox_id, **first.options.api_params())
    assert info.metadata == first.metadata() and first.metadata()["agentbox_instance"] == first.instance_id
    await first.write("kept.txt", b"across stops")
    await first.stop()  # idle: paused, its files kept
    info = await sdk().AsyncSandbox.get_info(sandbox_id, **first.options.api_params())
    assert info.state.value == "paused" and first.state == "stopped"
    with pytest.raises(MachineUnavailable):
        await first.exec(ExecRequest(command="true"))
    await first.start()
    assert first.sandbox_id == sandbox_id and await first.read("kept.txt") == b"across stops"
    await first.close()  # the server stops: the sandbox runs on
    # A restarted server: a new machine object with what the session's marker recorded.
    again = E2BMachine(first.name, first.instance_id, first.options, session_id=first.session_id,
                       sandbox_id=first.marker()["e2b_sandbox_id"])  # fmt: skip
    await again.start()
    assert again.sandbox_id == sandbox_id and await again.read("kept.txt") == b"across stops"
    await again.close()
    # A marker without the sandbox's id: found by its metadata.
    found = E2BMachine(first.name, first.instance_id, first.options, session_id=first.session_id)
    await found.start()
    assert found.sandbox_id == sandbox_id
    await found.destroy()
    with pytest.raises(sdk().exceptions.NotFoundException):
        await sdk().AsyncSandbox.get_info(sandbox_id, **first.options.api_params())


async def test_kill_on_stop_makes_a_new_sandbox(endpoint: Server) -> None:
    machine = new_machine(endpoint, on_stop="kill")
    await machine.start()
    before = machine.sandbox_id
    await machine.write("lost.txt", b"x")
    await machine.stop()
    await machine.start()
    try:
        assert machine.sandbox_id != before and await machine.stat("lost.txt") is None
    finally:
        await machine.destroy()


async def test_a_paused_sandbox_is_killed_when_its_session_closes(endpoint: Server) -> None:
    machine = new_machine(endpoint, root="/workspace/made/at/start")
    await machine.start()
    made = await machine.stat(machine.root)  # a root that was not there is made at start
    assert made is not None and made.is_dir
    assert (await machine.exec(ExecRequest(command="pwd"))).stdout == b"/workspace/made/at/start\n"
    sandbox_id = machine.sandbox_id
    await machine.stop()
    await machine.destroy()  # without resuming it first
    with pytest.raises(sdk().exceptions.NotFoundException):
        await sdk().AsyncSandbox.get_info(sandbox_id, **machine.options.api_params())
    with pytest.raises(MachineUnavailable, match="closed"):
        await machine.start()


# --- a server whose sessions run on e2b -----------------------------------------------------


async def test_a_session_on_an_e2b_machine_survives_a_server_restart(
    endpoint: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = traversable(tmp_path_factory.mktemp("e2b-client"), tmp_path_factory) / "home"
    home.mkdir()
    client = start_e2b_client(home, endpoint)
    session = f"ses_{uuid.uuid4().hex[:12]}"
    try:
        sb = Aio(client, session)
        ran = sb.post("/v2/commands", command="echo $((6 * 7)) > answer.txt; cat answer.txt; pwd")
        assert (ran["exit_code"], ran["stdout"]) == (0, "42\n/workspace\n"), ran
        sb.post("/v2/fs/mkdir", path="notes", parents=True)
        sb.post("/v2/fs/write", path="notes/a.md", content="# kept\n")
        assert sb.get("/v2/fs/read", path="notes/a.md")["content"] == "# kept\n"
        watcher = sb.post("/v2/watch", path="/workspace/notes", recursive=True)["watcher_id"]
        sb.post("/v2/commands", command="echo b > notes/b.md")
        events: list[str] = []
        deadline = time.monotonic() + DEADLINE
        while "b.md" not in events:
            assert time.monotonic() < deadline, f"no event for b.md: {events}"
            page = sb.get(f"/v2/watch/{watcher}/poll", cursor=0, timeout=2)
            events = [e["relative_path"] for e in page["events"]]
        sandbox = sb.get("/v2/sandbox")
        assert "e2b" in json.dumps(sandbox)
        e2b_ids = {s.sandbox_id for s in await _listed(endpoint, session)}
        assert len(e2b_ids) == 1
    finally:
        stop_server(client)
    client = start_e2b_client(home, endpoint)
    try:
        sb = Aio(client, session)
        assert sb.get("/v2/fs/read", path="notes/a.md")["content"] == "# kept\n"
        assert sb.post("/v2/commands", command="cat answer.txt")["stdout"] == "42\n"
        assert {s.sandbox_id for s in await _listed(endpoint, session)} == e2b_ids  # the same one
        with httpx.Client(base_url=client.url, timeout=60) as http:
            deleted = http.delete(f"/v1/sandboxes/{session}")
            assert deleted.status_code == 200, deleted.text
        assert await _listed(endpoint, session) == []  # the session's sandbox is killed with it
    finally:
        stop_server(client)


async def test_a_restarted_server_kills_what_a_dead_one_left_and_nothing_else(
    endpoint: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = traversable(tmp_path_factory.mktemp("e2b-sweep"), tmp_path_factory) / "home"
    home.mkdir()
    live, deleted = f"ses_{uuid.uuid4().hex[:12]}", f"ses_{uuid.uuid4().hex[:12]}"
    client = start_e2b_client(home, endpoint)
    try:
        assert Aio(client, live).post("/v2/commands", command="echo kept > kept.txt")["exit_code"] == 0
        assert Aio(client, deleted).post("/v2/commands", command="true")["exit_code"] == 0
    finally:
        client.process.kill()  # it dies: no machine is closed, every sandbox runs on
        client.process.wait()
    [live_box], [deleted_box] = await _listed(endpoint, live), await _listed(endpoint, deleted)
    async with Database.in_home(home) as db:  # deleted as the server died: its marker is still live
        await MarkersRepo(db).retire(deleted)
    options = E2BOptions.from_options(entry(endpoint))
    params = options.api_params()

    def made_by(owner: Path) -> E2BMachine:
        return E2BMachine("cloud", f"sbx_{uuid.uuid4().hex[:12]}", options,
                          session_id=f"ses_{uuid.uuid4().hex[:12]}", home=home_label(owner))  # fmt: skip

    unrecorded = made_by(home)  # made by this home, which died before its marker was written
    foreign = made_by(home.parent / "another-home")  # another server's, on the same endpoint and key
    for machine in (unrecorded, foreign):
        await machine.start()
    await unrecorded.stop()  # paused: swept all the same
    for machine in (unrecorded, foreign):
        await machine.close()
    stranger = await sdk().AsyncSandbox.create(metadata={"owner": "someone else"}, **params)
    client = start_e2b_client(home, endpoint)  # the sweep runs before it serves
    try:
        for gone in (deleted_box.sandbox_id, unrecorded.sandbox_id):
            with pytest.raises(sdk().exceptions.NotFoundException):
                await sdk().AsyncSandbox.get_info(gone, **params)
        for kept in (live_box.sandbox_id, foreign.sandbox_id, stranger.sandbox_id):
            assert (await sdk().AsyncSandbox.get_info(kept, **params)).state.value == "running"
        assert Aio(client, live).post("/v2/commands", command="cat kept.txt")["stdout"] == "kept\n"
        assert [s.sandbox_id for s in await _listed(endpoint, live)] == [live_box.sandbox_id]  # reconnected
    finally:
        stop_server(client)
        for left in (live_box.sandbox_id, foreign.sandbox_id, stranger.sandbox_id):
            with contextlib.suppress(Exception):
                await sdk().AsyncSandbox.kill(left, **params)


async def test_a_sweep_reads_at_most_its_pages_and_leaves_the_rest_to_a_later_start(
    endpoint: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five dead sandboxes, pages of two, at most two pages a start: four go, then the fifth."""
    monkeypatch.setattr(sweeping, "SWEEP_PAGE_SIZE", 2)
    monkeypatch.setattr(sweeping, "MAX_SWEEP_PAGES", 2)
    options = E2BOptions.from_options(entry(endpoint))
    params, e2b = options.api_params(), sdk()
    label = f"home-{uuid.uuid4().hex[:12]}"
    made = {
        (await e2b.AsyncSandbox.create(metadata={HOME_KEY: label, INSTANCE_KEY: f"sbx_{i}"}, **params)).sandbox_id
        for i in range(5)
    }
    try:
        first = await sweeping.sweep(label, [options], keep=set())
        assert len(first) == 4 and set(first) <= made
        second = await sweeping.sweep(label, [options], keep=set())
        assert second == list(made - set(first))
        assert await sweeping.sweep(label, [options], keep=set()) == []
    finally:
        for left in made:
            with contextlib.suppress(Exception):
                await e2b.AsyncSandbox.kill(left, **params)


async def _listed(endpoint: Server, session: str) -> list:
    e2b = sdk()
    params = E2BOptions.from_options(entry(endpoint)).api_params()
    query = e2b.SandboxQuery(metadata={"agentbox_session": session})
    return list(await e2b.AsyncSandbox.list(query=query, **params).next_items())
