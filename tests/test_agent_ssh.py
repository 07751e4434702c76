"""Skills, deliver_file, input placement and knowledge search on an ssh machine, whose files are no host files.

The machine is a real `SshMachine` on the real sshd of tests/conftest.py, rooted at a directory
of the login user's; the remote host is this host, so each test checks the remote side on
disk. The same tools on host files are tests/test_tools_skills_todo.py, test_tools_deliver.py
and test_agent_loop.py; here every file goes through the `Machine` protocol (SFTP).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from conftest import Sshd, start_server, stop_server
from test_api_sessions import DEADLINE, frames
from test_providers import Canned, Received
from test_runtime_e2e import last_call, loopback_model, text_reply, tool_reply
from test_tools_deliver import Ctx as DeliverCtx
from test_tools_deliver import run as deliver
from test_tools_skills_todo import ctx_for, make_skill, read, skill_md, use

from agentbox.agent.inputs import place_inputs
from agentbox.machines.ssh import SshMachine
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.tools.base import Action
from agentbox.tools.knowledge import SEARCH, SearchParams
from agentbox.tools.services import MachineServices
from agentbox.tools.skills import WORKSPACE_SKILLS_DIR


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileStore]:
    async with Database.in_home(tmp_path / "home") as db:
        yield FileStore(db, tmp_path / "home")


@pytest.fixture
def skills_dir(remote_root: Path) -> Path:
    return remote_root / WORKSPACE_SKILLS_DIR


# -- skills ------------------------------------------------------------------------------


async def test_a_workspace_skill_is_found_used_and_read_over_ssh(ssh: SshMachine, skills_dir: Path) -> None:
    make_skill(
        skills_dir, "pdf-tools", skill_md("pdf-tools", body="Run scripts/fill.py."),
        {"scripts/fill.py": b"print('fill')\n", "node_modules/x.js": b"skipped"},
    )  # fmt: skip
    make_skill(skills_dir, "broken", "no frontmatter\n")
    result = await use(ctx_for(ssh), "pdf-tools")
    assert result.as_text() == (
        'Run the skill named "pdf-tools".\n'
        "<skill_instructions>\nRun scripts/fill.py.\n</skill_instructions>\n"
        f"Base directory: {ssh.root}/{WORKSPACE_SKILLS_DIR}/pdf-tools (resolve relative paths in the "
        "instructions from it).\n<skill_resources>\n- scripts/fill.py\n</skill_resources>\n"
        'Read a file with read_skill_resource {"name": "pdf-tools", "path": "<path>"}.'
    )
    assert (await read(ctx_for(ssh), "pdf-tools", "scripts/fill.py")).as_text() == "print('fill')\n"
    missed = await use(ctx_for(ssh), "broken")
    assert missed.as_text() == 'Skill "broken" is not available. Available skills: pdf-tools.'


async def test_no_link_is_followed_in_an_ssh_skill(
    ssh: SshMachine, skills_dir: Path, remote_root: Path
) -> None:
    """Where a link leads cannot be seen through the protocol: a linked skill folder, SKILL.md
    or resource is left out, even one that stays inside the workspace; a FIFO is never opened."""
    docs = make_skill(skills_dir, "docs", skill_md("docs"), {"own.txt": b"mine\n"})
    (remote_root / "secret.txt").write_text("not the skill's\n")
    (docs / "link-out").symlink_to(remote_root / "secret.txt")
    (docs / "link-in").symlink_to(docs / "own.txt")
    os.mkfifo(docs / "pipe")
    make_skill(remote_root / "shared", "linked", skill_md("linked"))
    (skills_dir / "linked").symlink_to(remote_root / "shared" / "linked")
    (remote_root / "shared" / "real.md").write_text(skill_md("md-link"))
    make_skill(skills_dir, "md-link", None)
    (skills_dir / "md-link" / "SKILL.md").symlink_to(remote_root / "shared" / "real.md")

    ctx = ctx_for(ssh)
    used = await use(ctx, "docs")
    assert used.data["resources"] == ["own.txt", "pipe"]
    assert (await use(ctx, "linked")).as_text().endswith("Available skills: docs.")
    assert (await use(ctx, "md-link")).as_text().endswith("Available skills: docs.")
    for path in ("link-out", "link-in"):
        refused = await read(ctx, "docs", path)
        assert refused.is_error and "leads out of the skill" in refused.as_text(), path
    pipe = await read(ctx, "docs", "pipe")
    assert pipe.is_error and "is not a regular file" in pipe.as_text()


async def test_a_configured_skill_serves_an_ssh_session(ssh: SshMachine, tmp_path: Path) -> None:
    configured = tmp_path / "skills"
    make_skill(configured, "house", skill_md("house"), {"template.md": b"Dear {name},\n"})
    ctx = ctx_for(ssh, configured)
    assert "- template.md" in (await use(ctx, "house")).as_text()
    assert (await read(ctx, "house", "template.md")).as_text() == "Dear {name},\n"


# -- deliver_file ------------------------------------------------------------------------


async def test_a_remote_file_is_delivered_into_the_store(
    ssh: SshMachine, store: FileStore, remote_root: Path
) -> None:
    (remote_root / "out").mkdir()
    (remote_root / "out" / "report.csv").write_bytes(b"a,b\n1,2\n")
    ctx = DeliverCtx(ssh, store)
    result = await deliver(ctx, "out/report.csv", "missing.txt", "out")
    assert result.is_error is False
    [record] = result.data["files"]
    assert (record["filename"], record["bytes"]) == ("report.csv", 8)
    assert (await store.open(record["id"])).read_bytes() == b"a,b\n1,2\n"
    assert result.data["failed"] == [
        {"path": "missing.txt", "reason": "no such file"},
        {
            "path": "out",
            "reason": "it is a folder or not a regular file (archive a folder first, e.g. with tar or zip)",
        },
    ]
    assert ctx.deliveries == 1 and ctx.asked == []


async def test_a_remote_file_outside_the_root_is_an_external_read(
    ssh: SshMachine, store: FileStore, remote_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("host notes\n")
    ctx = DeliverCtx(ssh, store, refusal="not outside the workspace")
    refused = await deliver(ctx, str(outside))
    assert refused.is_error and refused.data["failed"] == [
        {"path": str(outside), "reason": "not outside the workspace"}
    ]
    assert ctx.asked == [(Action.READ_EXTERNAL, "deliver_file", {"path": str(outside)})]
    ctx.refusal = None
    [record] = (await deliver(ctx, str(outside))).data["files"]
    assert (await store.open(record["id"])).read_bytes() == b"host notes\n"


# -- inputs ------------------------------------------------------------------------------


async def test_inputs_are_placed_on_an_ssh_machine_with_numbered_names(
    ssh: SshMachine, sshd: Sshd, store: FileStore, remote_root: Path
) -> None:
    inputs = sshd.owned_dir(remote_root / "inputs")
    (inputs / "data.csv").write_text("already here")
    (inputs / "data (2).csv").symlink_to(remote_root / "nowhere.csv")  # a dangling link takes its name
    first = await store.put_stream(_one(b"first"), "data.csv", session_id=None, source="upload")
    second = await store.put_stream(_one(b"second"), "data.csv", session_id=None, source="upload")
    placed = await place_inputs(
        ssh, store, [{"file_id": r["id"], "filename": r["filename"]} for r in (first, second)]
    )
    assert [p.path for p in placed] == [f"{ssh.root}/inputs/data (3).csv", f"{ssh.root}/inputs/data (4).csv"]
    assert (inputs / "data (3).csv").read_bytes() == b"first"
    assert (inputs / "data (4).csv").read_bytes() == b"second"
    assert (inputs / "data.csv").read_text() == "already here" and not (remote_root / "nowhere.csv").exists()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


# -- knowledge search --------------------------------------------------------------------


async def test_knowledge_search_reads_the_notes_of_an_ssh_host(ssh: SshMachine, remote_root: Path) -> None:
    """The index reads an ssh host's notes through the protocol and follows its changes."""
    (remote_root / "notes.md").write_text("# Plan\n\nShip the release.\n")
    services = MachineServices.of(ssh)
    try:
        ctx = DeliverCtx(ssh, None, services=services)
        found = await SEARCH.run(ctx, SearchParams(query="release"))
        assert not found.is_error, found.as_text()
        assert [r["path"] for r in found.data["results"]] == [f"{remote_root}/notes.md"]
        (remote_root / "later.md").write_text("The release ships on Friday.\n")
        deadline = time.monotonic() + 10
        while len((await SEARCH.run(ctx, SearchParams(query="release"))).data["results"]) < 2:
            assert time.monotonic() < deadline, "the new note never showed up in the index"
            await asyncio.sleep(0.05)
    finally:
        await services.close()


# -- a whole turn ------------------------------------------------------------------------


def remote_agent(request: Received) -> Canned:
    """The model: load the workspace's skill, deliver the report it names, then say so."""
    body = request.json
    last = body["messages"][-1]
    if last["role"] == "user":
        return tool_reply(body, "use_skill", {"name": "report"})
    if last_call(body["messages"]) == "use_skill":
        return tool_reply(body, "deliver_file", {"path": "report.txt"})
    return text_reply(body, "Delivered the report.")


async def test_a_turn_on_an_ssh_machine_sees_its_workspace_uses_a_skill_and_delivers(
    sshd: Sshd, sandbox_tmp: Path
) -> None:
    """A real server routes the session to the ssh machine: the frozen prompt lists the remote
    workspace and its AGENTS.md and skill, and the tools read and deliver the remote files."""
    root = sshd.owned_dir(sandbox_tmp / "remote-root")
    (root / "AGENTS.md").write_text("Remote rules.\n")
    (root / "report.txt").write_text("remote report\n")
    make_skill(
        root / WORKSPACE_SKILLS_DIR, "report", skill_md("report", "Writes reports.", body="Deliver it.")
    )
    home = sandbox_tmp / "home"
    home.mkdir()
    options = "\n".join(f"{k} = {json.dumps(v)}" for k, v in sshd.options(root=str(root)).items())
    async for llm in loopback_model(remote_agent):
        config = sandbox_tmp / "agentbox.toml"
        config.write_text(
            f'model_endpoints = ["{llm.url}/v1"]\ndefault_machine = "remote"\ndelegable = ["remote"]\n'
            f'[machines.remote]\nkind = "ssh"\n{options}\n'
        )
        server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
                created = await client.post("/v1/sessions", json={
                    "model": "openai:remote-coder", "machine": "remote",
                    "model_options": {"base_url": llm.url + "/v1", "api_key": "sk-local"},
                })  # fmt: skip
                assert created.status_code == 201, created.text
                sid = created.json()["id"]
                sent = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "Send the report."})
                assert sent.status_code == 202, sent.text
                log = [f.data for f in await frames(client, sid, params={"until": "turn_end"}) if f.data]
                assert log[-1]["type"] == "turn.completed", log[-1]
                results = [e for e in log if e["type"] == "agent.tool_result"]
                assert [e["is_error"] for e in results] == [False, False], results
                assert (
                    "<skill_instructions>\nDeliver it.\n</skill_instructions>"
                    in results[0]["content"][0]["text"]
                )
                (delivered,) = [e for e in log if e["type"] == "file.delivered"]
                content = await client.get(f"/v1/files/{delivered['file_id']}/content")
                assert content.status_code == 200 and content.text == "remote report\n"
        finally:
            stop_server(server)
        system = llm.requests[0].json["messages"][0]["content"]
        assert "# AGENTS.md\n\nRemote rules." in system
        assert "- report: Writes reports." in system
        assert f"Machine: remote (ssh, linux), workspace {root}" in system
        assert "Directory structure:\n- .agents/\n- AGENTS.md\n- report.txt" in system
