"""The API's smaller promises, over a real server, real sandboxes and the scripted model: one
timestamp format, a session's `updated_at`, the ids on file records and tool results, diffs
that `git apply` takes in the workspace, a trash the agent cannot see, the ids in a tar."""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.machines.base import TRASH_DIR
from agentbox.timestamps import parse_timestamp
from agentbox.tools.changes import diff_name, unified_diff
from tests.conftest import Server
from tests.test_api_sessions import DEADLINE, bash, create, events, frames, post, until_turn_end, write

#: The one format of every time the API writes: RFC 3339, UTC, milliseconds, `Z`.
RFC3339_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture
async def client(server: Server) -> Any:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        yield c


def times(value: Any, found: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """Every (key, text) under `value` whose key names a time (`…_at`, `modified_time`)."""
    found = [] if found is None else found
    if isinstance(value, dict):
        for key, item in value.items():
            if (key.endswith("_at") or key == "modified_time") and isinstance(item, str):
                found.append((key, item))
            else:
                times(item, found)
    elif isinstance(value, list):
        for item in value:
            times(item, found)
    return found


async def test_every_time_the_api_writes_has_one_format(client: httpx.AsyncClient) -> None:
    script = [bash("echo ok"), {"tool_calls": [write("t.txt", "T\n")]}, {"text": "done"}]
    sid = await create(client, script, permission_mode="full-ask")
    await post(client, sid)
    asked = await frames(client, sid, stop=lambda f: f.event == "approval.requested")
    approval_id = asked[-1].data["approval_id"] if asked[-1].data else None
    answer = await client.post(f"/v1/sessions/{sid}/approvals/{approval_id}", json={"decision": "allow"})
    await until_turn_end(client, sid)
    [change] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    command = await client.post(f"/sandboxes/{sid}/v2/commands", json={"command": "echo > /workspace/f"})
    bash_session = await client.post(f"/sandboxes/{sid}/v1/bash/sessions/create", json={})
    listing = await client.post(f"/sandboxes/{sid}/v1/file/list", json={"path": "/workspace"})
    bodies = [
        (await client.get(f"/v1/sessions/{sid}")).json(),
        (await client.get(f"/v1/sessions/{sid}/approvals")).json(),
        answer.json(),
        (await client.get(f"/v1/sessions/{sid}/changes/{change['id']}")).json(),
        await events(client, sid),
        command.json(),
        bash_session.json(),
        listing.json(),
    ]
    found = times(bodies)
    keys = {key for key, _ in found}
    assert {"created_at", "updated_at", "resolved_at", "started_at", "last_used_at", "modified_time"} <= keys
    assert [(k, t) for k, t in found if not RFC3339_MS.fullmatch(t)] == []
    assert all(parse_timestamp(t).utcoffset() is not None for _, t in found)


async def test_a_sessions_updated_at_follows_its_last_event(client: httpx.AsyncClient) -> None:
    sid = await create(client, [{"text": "hello"}])
    created = (await client.get(f"/v1/sessions/{sid}")).json()
    await post(client, sid)
    await until_turn_end(client, sid)
    after_turn = (await client.get(f"/v1/sessions/{sid}")).json()
    logged = await events(client, sid)
    assert logged[-1]["type"] == "turn.completed"
    assert after_turn["updated_at"] == logged[-1]["created_at"] > created["updated_at"]
    patched = await client.patch(f"/v1/sessions/{sid}", json={"metadata": {"k": 1}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["updated_at"] == (await events(client, sid))[-1]["created_at"]
    assert patched.json()["updated_at"] > after_turn["updated_at"]


async def test_files_name_their_session_turn_and_call(client: httpx.AsyncClient) -> None:
    up = await client.post("/v1/files", files={"file": ("in.txt", b"three\nlines\nhere\n")})
    assert up.status_code == 201 and up.json()["session_id"] is None, up.text
    upload = up.json()["id"]
    script = [
        bash("wc -l < /workspace/inputs/in.txt > /workspace/count.txt"),
        {"tool_calls": [{"name": "deliver_file", "input": {"path": "count.txt"}}]},
        {"text": "delivered"},
    ]
    sid = await create(client, script)
    await post(client, sid, body={"files": [upload]})
    streamed = await until_turn_end(client, sid)
    assert streamed[-1].event == "turn.completed", streamed[-1]
    uses = [f.data for f in streamed if f.event == "agent.tool_use" and f.data]
    results = [f.data for f in streamed if f.event == "agent.tool_result" and f.data]
    deliver = next(u["tool_use_id"] for u in uses if u["name"] == "deliver_file")
    by_call = {r["tool_use_id"]: r for r in results}
    assert by_call[uses[0]["tool_use_id"]]["files"] == []
    [delivered] = by_call[deliver]["files"]
    assert delivered["filename"] == "count.txt" and delivered["bytes"] == len(b"3\n")
    record = (await client.get(f"/v1/files/{delivered['id']}")).json()
    assert record["tool_use_id"] == deliver and record["session_id"] == sid and record["source"] == "delivery"
    assert streamed[-1].data is not None and record["turn_id"] == streamed[-1].data["turn_id"]
    assert (await client.get(f"/v1/files/{upload}")).json()["session_id"] == sid
    listed = (await client.get("/v1/files", params={"session_id": sid})).json()["items"]
    assert {f["id"] for f in listed} == {upload, delivered["id"]}
    other = await create(client, [{"text": "never"}])
    refused = await post(client, other, body={"files": [upload]})
    assert refused.status_code == 400, refused.text  # the upload is the first session's now


async def test_a_change_sets_diffs_apply_with_git_in_a_copy_of_the_workspace(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    edit = {"path": "notes.md", "mode": "replace", "oldText": "two", "newText": "TWO"}
    script = [
        {"tool_calls": [{"name": "read_file", "input": {"path": "notes.md"}}]},
        {"tool_calls": [{"name": "edit_file", "input": edit}, write("docs/new.md", "fresh\n")]},
        {"text": "ok"},
    ]
    sid = await create(client, script, permission_mode="workspace-write")
    files = f"/sandboxes/{sid}/v1/file"
    for path, content in (("/workspace/notes.md", "one\ntwo\nthree\n"), ("/workspace/docs/keep", "")):
        assert (await client.post(f"{files}/write", json={"file": path, "content": content})).json()[
            "success"
        ]
    await post(client, sid)
    await until_turn_end(client, sid)
    [listed] = (await client.get(f"/v1/sessions/{sid}/changes")).json()["items"]
    detail = (await client.get(f"/v1/sessions/{sid}/changes/{listed['id']}")).json()
    diffs = [op["diff"] for op in detail["operations"]]
    assert [d.splitlines()[1] for d in diffs] == ["+++ b/notes.md", "+++ b/docs/new.md"]
    tree = await client.get(f"/sandboxes/{sid}/v2/fs/tree", params={"path": "/workspace"})
    assert tree.status_code == 200, tree.text
    copy = tmp_path / "copy"
    with tarfile.open(fileobj=io.BytesIO(tree.content)) as tar:
        tar.extractall(copy, filter="data")
    patch = tmp_path / "changes.diff"
    patch.write_text("".join(diffs))
    for check in (["--check"], []):
        done = subprocess.run(["git", "apply", *check, str(patch)], cwd=copy, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert (copy / "notes.md").read_text() == "one\nTWO\nthree\n"
    assert (copy / "docs" / "new.md").read_text() == "fresh\n" and not (copy / "workspace").exists()


def test_a_diff_names_files_outside_the_root_absolutely() -> None:
    assert diff_name("/workspace", "/workspace/a/b.md") == "a/b.md"
    assert diff_name("/workspace", "/etc/hosts") == "/etc/hosts"
    assert diff_name("/workspace", "/workspace2/x") == "/workspace2/x"
    assert diff_name("/", "/srv/x") == "/srv/x"
    lines = unified_diff(diff_name("/workspace", "/etc/hosts"), "a\n", "b\n").splitlines()
    assert lines[:2] == ["--- a/etc/hosts", "+++ b/etc/hosts"]


async def test_a_trees_owners_are_the_ids_seen_inside_the_machine(client: httpx.AsyncClient) -> None:
    sid = "edges-tree-owners"
    made = "mkdir -p /workspace/t/sub && echo x > /workspace/t/sub/f && ln -s sub/f /workspace/t/link"
    run = await client.post(f"/sandboxes/{sid}/v2/commands", json={"command": made})
    assert run.status_code == 200 and run.json()["data"]["exit_code"] == 0, run.text
    seen = await client.post(
        f"/sandboxes/{sid}/v2/commands",
        json={"command": "cd /workspace/t && stat -c '%n %u %g' sub sub/f link"},
    )
    inside = {
        name: (int(uid), int(gid))
        for name, uid, gid in (line.split() for line in seen.json()["data"]["stdout"].splitlines())
    }
    tree = await client.get(f"/sandboxes/{sid}/v2/fs/tree", params={"path": "/workspace/t"})
    assert tree.status_code == 200, tree.text
    with tarfile.open(fileobj=io.BytesIO(tree.content)) as tar:
        owners = {m.name: (m.uid, m.gid) for m in tar.getmembers()}
    assert owners == inside and set(inside.values()) == {(0, 0)}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "input": arguments}]}


async def test_the_trash_is_out_of_the_agents_reach(client: httpx.AsyncClient) -> None:
    """On a sandbox (full-auto by default) the agent deletes a file; nothing it has then finds
    the trash or changes what is in it (the move back out, a restore, is in
    tests/test_tools_governance.py's sandbox test)."""
    trash = f"/workspace/{TRASH_DIR}"
    script = [
        call("edit_file", path="gone.txt", mode="delete"),
        call("list", path="."),
        call("glob", pattern=f"{TRASH_DIR}/**"),
        call("grep", pattern="precious", path="."),
        call("list", path=TRASH_DIR),
        call("edit_file", path=TRASH_DIR, mode="delete"),
        call("write_file", path=f"{TRASH_DIR}/planted.txt", content="x"),
        call("bash", command=f"ls -A {trash} | wc -l; rm -rf {trash}; ls -d {trash}"),
        {"text": "done"},
    ]
    sid = await create(client, script)
    write = await client.post(
        f"/sandboxes/{sid}/v1/file/write", json={"file": "/workspace/gone.txt", "content": "precious\n"}
    )
    assert write.json()["success"], write.text
    await post(client, sid)
    streamed = await until_turn_end(client, sid)
    assert streamed[-1].event == "turn.completed", streamed[-1]
    texts = [f.data["content"][0]["text"] for f in streamed if f.event == "agent.tool_result" and f.data]
    deleted, listed, globbed, grepped, looked, removed, planted, shell = texts
    trashed = re.search(rf"{re.escape(trash)}/\S+/gone\.txt", deleted)
    assert trashed is not None, deleted
    assert TRASH_DIR not in listed and "gone.txt" not in listed, listed
    assert "gone.txt" not in globbed and "precious" not in grepped, (globbed, grepped)
    assert "in the trash" in looked and "trash" in removed and "in the trash" in planted, (looked, removed)
    assert "<stdout>\n0\n" in shell and f"\n{trash}\n" in shell, shell  # empty, and not removable
