"""One running system: what one surface does (the turn loop, MCP, the API), the others see."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from test_mcp import http_session, text_of

from agentbox.mcp import DATA_META_KEY
from tests.conftest import Server, Sshd, start_server, stop_server

#: Seconds a turn or a server step may take on a loaded machine.
DEADLINE = 60.0


async def until(check: object, what: str) -> object:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not (found := await check()):  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)
    return found


async def test_an_agents_commands_are_the_machines_commands(server: Server) -> None:
    """The `bash` tool runs on the machine's own command manager: `/v2/commands` lists it."""
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
        script = [
            {"tool_calls": [{"name": "bash", "input": {"command": "echo from-the-agent; sleep 2"}}]},
            {"text": "Done."},
        ]
        created = await client.post("/v1/sessions", json={"model": "scripted", "script": script})
        sid = created.json()["id"]
        assert (await client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})).status_code == 202

        async def listed() -> list[dict[str, object]]:
            r = await client.get(f"/sandboxes/{sid}/v2/commands")
            return [c for c in r.json()["data"]["commands"] if "from-the-agent" in str(c["command"])]

        commands = await until(listed, "the agent's command never showed in /v2/commands")
        assert commands[0]["status"] in ("running", "completed")  # type: ignore[index]
        command_id = commands[0]["command_id"]  # type: ignore[index]
        done = await client.get(f"/sandboxes/{sid}/v2/commands/{command_id}", params={"wait": DEADLINE})
        assert "from-the-agent" in done.json()["data"]["stdout"]


async def test_a_change_set_staged_over_mcp_is_reviewed_through_the_sessions_api(
    sandbox_tmp: Path,
) -> None:
    """Staged by an MCP client on a machine that asks (the host, full-ask), applied over HTTP."""
    home = sandbox_tmp / "home"
    root = sandbox_tmp / "host-root"
    root.mkdir()
    home.mkdir()
    config = sandbox_tmp / "agentbox.toml"
    config.write_text(f'default_machine = "host"\n[machines.host]\nkind = "local"\nroot = "{root}"\n')
    server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    sid = "mcp-review"
    try:
        async with http_session(server.url + "/mcp", {"X-Agentbox-Session": sid}) as session:
            result = await session.call_tool("write_file", {"path": str(root / "new.txt"), "content": "x\n"})
            assert not result.is_error and "Staged" in text_of(result), text_of(result)
            assert result.meta is not None
            change_set_id = result.meta[DATA_META_KEY]["change_set_id"]
        assert not (root / "new.txt").exists()
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            listed = await client.get(f"/v1/sessions/{sid}/changes")
            assert listed.status_code == 200, listed.text
            assert [s["id"] for s in listed.json()["items"]] == [change_set_id]
            shown = await client.get(f"/v1/sessions/{sid}/changes/{change_set_id}")
            assert shown.status_code == 200 and "+x" in shown.text
            applied = await client.post(f"/v1/sessions/{sid}/changes/{change_set_id}/apply", json={})
            assert applied.status_code == 200, applied.text
            assert (root / "new.txt").read_text() == "x\n"
            unknown = await client.get("/v1/sessions/never-used/changes")
            assert unknown.status_code == 404
    finally:
        stop_server(server)


async def test_a_sessions_sandbox_routes_act_on_its_own_machine(sandbox_tmp: Path) -> None:
    home, root = sandbox_tmp / "home", sandbox_tmp / "host-root"
    home.mkdir()
    root.mkdir()
    config = sandbox_tmp / "agentbox.toml"
    config.write_text(f'delegable = ["sandbox", "host"]\n[machines.host]\nkind = "local"\nroot = "{root}"\n')
    server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            on_host = (
                await client.post("/v1/sessions", json={"model": "scripted", "machine": "host"})
            ).json()["id"]
            described = (await client.get(f"/sandboxes/{on_host}/v2/sandbox")).json()["data"]
            assert described["machine"]["kind"] == "local" and described["machine"]["name"] == "host"
            written = await client.post(
                f"/sandboxes/{on_host}/v1/file/write", json={"file": f"{root}/via-api.txt", "content": "hi"}
            )
            assert written.status_code == 200, written.text
            assert (root / "via-api.txt").read_text() == "hi"
            bare = (await client.post("/v1/sessions", json={"model": "scripted", "machine": "none"})).json()[
                "id"
            ]
            refused = await client.get(f"/sandboxes/{bare}/v2/sandbox")
            assert refused.status_code == 404 and "without a machine" in refused.text
            other = (await client.get("/sandboxes/not-a-session/v2/sandbox")).json()["data"]
            assert other["machine"]["kind"] == "sandbox"  # an id with no session: the default machine
    finally:
        stop_server(server)


async def test_a_session_on_an_ssh_machine_runs_its_commands_there(sshd: Sshd, sandbox_tmp: Path) -> None:
    """The ssh kind is one row of the table: a session names it and its commands run remotely."""
    home, root = sandbox_tmp / "home", sshd.owned_dir(sandbox_tmp / "remote-root")
    home.mkdir()
    options = "\n".join(f"{k} = {json.dumps(v)}" for k, v in sshd.options(root=str(root)).items())
    config = sandbox_tmp / "agentbox.toml"
    config.write_text(f'delegable = ["sandbox", "remote"]\n[machines.remote]\nkind = "ssh"\n{options}\n')
    server = start_server(home, {"AGENTBOX_CONFIG": str(config)})
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            sid = (await client.post("/v1/sessions", json={"model": "scripted", "machine": "remote"})).json()[
                "id"
            ]
            done = await client.post(
                f"/sandboxes/{sid}/v1/shell/exec", json={"command": "pwd; echo remote > made.txt"}
            )
            assert done.status_code == 200, done.text
            assert done.json()["data"]["output"].strip() == str(root)
            described = (await client.get(f"/sandboxes/{sid}/v2/sandbox")).json()["data"]
            assert described["machine"] == {
                "name": "remote",
                "kind": "ssh",
                "os": "linux",
                "root": str(root),
                "isolated": False,
            }
        assert (root / "made.txt").read_text() == "remote\n"
    finally:
        stop_server(server)


def test_the_session_route_cache_is_bounded(tmp_path: Path) -> None:
    from agentbox.config import Settings
    from agentbox.machines.registry import Registry
    from agentbox.tools.services import MAX_ROUTES, Services

    services = Services(Registry(Settings(home=tmp_path)))
    for i in range(MAX_ROUTES):
        services.remember(f"s{i}", "")
    assert len(services.routes) == MAX_ROUTES and services.routes["s0"] == ""
    services.remember("one-more", "host")
    assert services.routes == {"one-more": "host"}  # past the cap it starts over
