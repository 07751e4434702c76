"""The file API and the editor on a machine without host files: the ssh kind, over SFTP.

A real `agentbox serve` routes a session to an ssh machine on a real Debian sshd on loopback
(tests/conftest.py `sshd`); the remote host is this host, so each test checks the remote side
on disk. The same routes serve host-file machines by descriptor (tests/test_api_v2.py); here
every operation goes through the `Machine` protocol only (`agentbox/workspace/remote_files.py`).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server, Sshd, start_server, stop_server, traversable
from test_api_v2 import evil_tar

from agentbox.machines.ssh import SshMachine, SshOptions
from agentbox.workspace import files, remote_files
from agentbox.workspace.editor import Editor
from agentbox.workspace.errors import WorkspaceError

DEADLINE = 30.0


@pytest.fixture(scope="module")
def remote(sshd: Sshd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server whose default machine is an ssh machine rooted at a directory of the ssh user."""
    base = traversable(tmp_path_factory.mktemp("remote-files"), tmp_path_factory)
    home, root = base / "home", sshd.owned_dir(base / "remote-root")
    home.mkdir()
    options = "\n".join(f"{k} = {json.dumps(v)}" for k, v in sshd.options(root=str(root)).items())
    config = base / "agentbox.toml"
    config.write_text(
        f'default_machine = "remote"\ndelegable = ["remote"]\n[machines.remote]\nkind = "ssh"\n{options}\n'
    )
    server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    try:
        yield server, root
    finally:
        stop_server(server)


@pytest.fixture
async def api(remote: tuple[Server, Path]) -> AsyncIterator[httpx.AsyncClient]:
    server, _ = remote
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
        sid = (await client.post("/v1/sessions", json={"model": "scripted", "machine": "remote"})).json()[
            "id"
        ]
        client.base_url = httpx.URL(f"{server.url}/sandboxes/{sid}")
        yield client


@pytest.fixture
def root(remote: tuple[Server, Path]) -> Path:
    return remote[1]


def data(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["data"]


def refused(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["data"]["error_type"] == error_type, body
    return body


async def test_the_seed_walkthrough_on_ssh(api: httpx.AsyncClient, root: Path) -> None:
    """mkdir, write, search, edit, read: seed 002's walkthrough, every step on the remote host."""
    assert data(await api.post("/v2/fs/mkdir", json={"path": "walk/src", "parents": True}))["created"]
    written = data(
        await api.post("/v2/fs/write", json={"path": "walk/src/app.py", "content": "a = 1\nb = 2\n"})
    )
    assert written == {"path": f"{root}/walk/src/app.py", "bytes_written": 12}
    assert (root / "walk/src/app.py").read_text() == "a = 1\nb = 2\n"
    assert (root / "walk/src/app.py").stat().st_uid == (root).stat().st_uid  # the login's own file
    found = data(await api.get("/v2/fs/search", params={"path": "walk", "pattern": "**/*.py"}))
    assert found["files"] == [f"{root}/walk/src/app.py"]
    edited = data(
        await api.post(
            "/v2/fs/edit",
            json={
                "command": "str_replace",
                "path": "walk/src/app.py",
                "old_str": "b = 2",
                "new_str": "b = 3",
            },
        )
    )
    assert "b = 3" in edited["new_content"]
    assert data(
        await api.post(
            "/v2/fs/edit",
            json={"command": "insert", "path": "walk/src/app.py", "insert_line": 0, "new_str": "# top"},
        )
    )
    assert (root / "walk/src/app.py").read_text() == "# top\na = 1\nb = 3\n"
    data(await api.post("/v2/fs/edit", json={"command": "undo_edit", "path": "walk/src/app.py"}))
    assert (root / "walk/src/app.py").read_text() == "a = 1\nb = 3\n"
    lines = data(
        await api.get("/v2/fs/read", params={"path": "walk/src/app.py", "start_line": 1, "end_line": 2})
    )
    assert (lines["content"], lines["line_count"], lines["start_line"], lines["end_line"]) == (
        "b = 3\n",
        2,
        1,
        2,
    )
    appended = await api.post(
        "/v2/fs/write", json={"path": "walk/src/app.py", "content": "c\n", "append": True}
    )
    assert data(appended)["bytes_written"] == 2 and (root / "walk/src/app.py").read_text().endswith(
        "b = 3\nc\n"
    )


async def test_listing_and_globs_do_not_enter_links(api: httpx.AsyncClient, root: Path) -> None:
    (root / "tree/a/b").mkdir(parents=True)
    (root / "tree/a/b/deep.txt").write_text("d")
    (root / "tree/.hidden").write_text("h")
    (root / "tree/top.md").write_text("t" * 5)
    (root / "tree/out").symlink_to("/etc")
    listing = data(await api.get("/v2/fs/list", params={"path": "tree", "recursive": "true"}))
    paths = {e["path"]: e for e in listing["files"]}
    assert f"{root}/tree/a/b/deep.txt" in paths and paths[f"{root}/tree/top.md"]["size"] == 5
    assert paths[f"{root}/tree/out"]["is_symlink"] and not any("/tree/out/" in p for p in paths)
    shallow = data(await api.get("/v2/fs/list", params={"path": "tree", "show_hidden": "false"}))
    assert sorted(e["name"] for e in shallow["files"]) == ["a", "out", "top.md"]
    deep = data(await api.get("/v2/fs/search", params={"path": "tree", "pattern": "**/*"}))
    assert f"{root}/tree/a/b/deep.txt" in deep["files"] and not any("passwd" in p for p in deep["files"])
    glob = data(await api.post("/v1/file/glob", json={"path": f"{root}/tree", "pattern": "*.md"}))
    assert [(f["name"], f["size"]) for f in glob["files"]] == [("top.md", 5)]


async def test_grep_runs_the_remote_ripgrep(api: httpx.AsyncClient, root: Path) -> None:
    (root / "g").mkdir()
    (root / "g/one.txt").write_text("alpha\nneedle here\nomega\n")
    result = data(await api.post("/v2/fs/grep", json={"path": "g", "pattern": "needle", "context_before": 1}))
    assert [(m["file"], m["line_number"]) for m in result["matches"]] == [(f"{root}/g/one.txt", 2)]
    assert result["matches"][0]["context_before"] == ["alpha"]
    v1 = data(await api.post("/v1/file/search", json={"file": f"{root}/g/one.txt", "regex": "a$"}))
    assert v1["line_numbers"] == [0, 2]


async def test_download_ranges_and_upload(api: httpx.AsyncClient, root: Path) -> None:
    blob = os.urandom(files.DOWNLOAD_CHUNK_BYTES * 2 + 7)
    (root / "blob.bin").write_bytes(blob)
    whole = await api.get("/v2/fs/download", params={"path": "blob.bin"})
    assert whole.status_code == 200 and whole.content == blob
    part = await api.get("/v2/fs/download", params={"path": "blob.bin"}, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == blob[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(blob)}"
    beyond = await api.get(
        "/v2/fs/download", params={"path": "blob.bin"}, headers={"Range": f"bytes={len(blob)}-"}
    )
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(blob)}"
    v1 = await api.get("/v1/file/download", params={"path": f"{root}/blob.bin"})
    assert v1.content == blob and v1.headers["etag"]
    sent = await api.post("/v2/fs/upload", files={"file": ("up.bin", blob)}, data={"path": "up/there.bin"})
    refused(sent, 404, "not_found")  # v2 does not make parents
    v1_up = data(
        await api.post(
            "/v1/file/upload", files={"file": ("up.bin", blob)}, data={"path": f"{root}/up/there.bin"}
        )
    )
    assert v1_up["file_size"] == len(blob) and (root / "up/there.bin").read_bytes() == blob
    assert not [p for p in (root / "up").iterdir() if p.name != "there.bin"]  # no temp left


async def test_v1_routes_through_the_sdk_shapes(api: httpx.AsyncClient, root: Path) -> None:
    made = data(
        await api.post("/v1/file/write", json={"file": f"{root}/v1/deep/n.txt", "content": "one two two"})
    )
    assert made["bytes_written"] == 11  # v1 makes the missing parents
    replaced = data(
        await api.post(
            "/v1/file/replace", json={"file": f"{root}/v1/deep/n.txt", "old_str": "two", "new_str": "2"}
        )
    )
    assert replaced["replaced_count"] == 2 and (root / "v1/deep/n.txt").read_text() == "one 2 2"
    read = data(await api.post("/v1/file/read", json={"file": f"{root}/v1/deep/n.txt"}))
    assert read["content"] == "one 2 2"
    view = data(await api.post("/v1/file/str_replace_editor", json={"command": "view", "path": f"{root}/v1"}))
    assert f"{root}/v1/deep/n.txt" in view["output"]
    found = data(await api.post("/v1/file/find", json={"path": f"{root}/v1", "glob": "**/*.txt"}))
    assert found["files"] == [f"{root}/v1/deep/n.txt"]


async def test_errors_keep_the_envelope(api: httpx.AsyncClient, root: Path) -> None:
    refused(await api.get("/v2/fs/read", params={"path": "missing.txt"}), 404, "not_found")
    (root / "adir").mkdir()
    refused(await api.get("/v2/fs/read", params={"path": "adir"}), 400, "invalid_target")
    refused(await api.post("/v2/fs/mkdir", json={"path": "adir"}), 409, "already_exists")
    refused(await api.get("/v2/fs/list", params={"path": "missing"}), 404, "not_found")
    (root / "bin.dat").write_bytes(b"\xff\xfe\x00")
    refused(await api.get("/v2/fs/read", params={"path": "bin.dat"}), 422, "decode_error")
    refused(
        await api.post(
            "/v2/fs/write", json={"path": "x.txt", "content": "a"}, params={"user": "nobody-here"}
        ),
        400,
        "bad_request",
    )


async def test_tree_round_trip_and_evil_archives_on_ssh(api: httpx.AsyncClient, root: Path) -> None:
    (root / "t/src").mkdir(parents=True)
    (root / "t/src/app.py").write_text("print(1)\n")
    (root / "t/README.md").write_text("# t\n")
    (root / "t/link").symlink_to("src/app.py")
    got = await api.get("/v2/fs/tree", params={"path": "t"})
    assert got.status_code == 200, got.text
    with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["README.md", "link", "src", "src/app.py"]
        assert members["link"].issym() and members["link"].linkname == "src/app.py"
    put = data(await api.put("/v2/fs/tree", params={"path": "copy"}, content=got.content))
    assert (put["path"], put["files_written"]) == (f"{root}/copy", 3)
    assert (root / "copy/src/app.py").read_text() == "print(1)\n"
    assert os.readlink(root / "copy/link") == "src/app.py"
    for name, member in (("escape", "../escaped.txt"), ("absolute", "/tmp/absolute.txt")):
        reply = refused(
            await api.put("/v2/fs/tree", params={"path": name}, content=evil_tar(member)), 400, "invalid_path"
        )
        assert member in reply["message"]
    linked = await api.put("/v2/fs/tree", params={"path": "linked"}, content=evil_tar("ok.txt", link="/etc"))
    refused(linked, 400, "invalid_path")
    assert not {"escape", "absolute", "linked", "escaped.txt"} & {p.name for p in root.iterdir()}
    refused(await api.put("/v2/fs/tree", params={"path": "junk"}, content=b"not a tar"), 400, "bad_request")
    (root / "copy/blocker").write_text("a file where the archive needs a directory")
    needs_dir = io.BytesIO()
    with tarfile.open(fileobj=needs_dir, mode="w") as tar:
        info = tarfile.TarInfo("blocker/inner.txt")
        tar.addfile(info, io.BytesIO(b""))
    refused(
        await api.put("/v2/fs/tree", params={"path": "copy"}, content=needs_dir.getvalue()),
        400,
        "invalid_target",
    )


# ---------------------------------------------------------------- the operations themselves


@pytest.fixture
async def ssh(
    sshd: Sshd, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SshMachine]:
    root = sshd.owned_dir(traversable(tmp_path, tmp_path_factory) / "ops")
    machine = SshMachine("ops", SshOptions.from_options(sshd.options(root=str(root))))
    await machine.start()
    try:
        yield machine
    finally:
        await machine.close()


async def test_read_limit_at_its_boundary(ssh: SshMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_READ_BYTES", 10)
    await ssh.write("ten.txt", b"x" * 10)
    await ssh.write("eleven.txt", b"x" * 11)
    assert (await remote_files.read_text(ssh, "ten.txt")).size == 10
    with pytest.raises(WorkspaceError) as err:
        await remote_files.read_text(ssh, "eleven.txt")
    assert (err.value.error_type, err.value.errno) == ("bad_request", 27)  # EFBIG


async def test_an_upload_past_its_limit_leaves_the_target(
    ssh: SshMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "MAX_UPLOAD_BYTES", 8)

    async def body(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"ab"

    await ssh.write("kept.bin", b"old")
    assert (await remote_files.upload(ssh, "kept.bin", body(4))).file_size == 8
    assert await ssh.read("kept.bin") == b"abababab"
    with pytest.raises(WorkspaceError) as err:
        await remote_files.upload(ssh, "kept.bin", body(5))
    assert err.value.error_type == "bad_request"
    assert await ssh.read("kept.bin") == b"abababab"
    assert [e.name for e in await ssh.list(".")] == ["kept.bin"]  # the temporary part is gone


async def test_a_download_of_a_file_replaced_meanwhile_fails(ssh: SshMachine) -> None:
    await ssh.write("moving.txt", b"first")
    target = await remote_files.download(ssh, "moving.txt")
    await asyncio.sleep(0.01)
    await ssh.write("moving.txt", b"second, longer")
    with pytest.raises(WorkspaceError) as err:
        [chunk async for chunk in remote_files.iter_download(target)]
    assert err.value.exception_type == "FileChanged"


async def test_concurrent_edits_of_one_remote_file_both_land(ssh: SshMachine) -> None:
    """Remote edits await between read and write: the editor's lock keeps them from losing one."""
    await ssh.write("both.txt", b"a\nb\n")
    editor = Editor()
    await asyncio.gather(
        editor.str_replace(ssh, "both.txt", "a", "A"), editor.str_replace(ssh, "both.txt", "b", "B")
    )
    assert await ssh.read("both.txt") == b"A\nB\n"
    await editor.undo_edit(ssh, "both.txt")
    assert (await ssh.read("both.txt")).count(b"A") + (await ssh.read("both.txt")).count(b"B") == 1


async def test_list_truncates_at_its_limit(ssh: SshMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_LIST_ENTRIES", 3)
    for name in "abc":
        await ssh.write(f"{name}.txt", b"")
    full = await remote_files.list_dir(ssh, ".")
    assert (full.total_count, full.truncated) == (3, False)
    await ssh.write("d.txt", b"")
    cut = await remote_files.list_dir(ssh, ".")
    assert (cut.total_count, cut.truncated) == (3, True)


async def test_a_v1_watcher_on_ssh_sees_a_write(api: httpx.AsyncClient, root: Path) -> None:
    """v1's watch route starts the machine's own watch stream (it was host-only)."""
    data(await api.post("/v2/fs/mkdir", json={"path": "watched"}))
    made = await api.post("/v1/file/watch", json={"path": f"{root}/watched"})
    assert made.status_code == 200, made.text
    watcher, cursor = made.json()["watcher_id"], made.json()["data"]["initial_cursor"]
    data(await api.post("/v1/file/write", json={"file": f"{root}/watched/new.txt", "content": "hi"}))
    seen: set[str] = set()
    while f"{root}/watched/new.txt" not in seen:  # the staged write arrives as create, write, rename
        page = data(await api.post(f"/v1/file/watch/{watcher}/poll", json={"cursor": cursor, "timeout": 10}))
        assert page["events"], f"no more events; saw {seen}"
        seen |= {e["path"] for e in page["events"]}
        cursor = page["cursor"]
    assert (await api.delete(f"/v1/file/watch/{watcher}")).status_code == 200
