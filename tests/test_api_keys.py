"""API keys that carry a caller level: a real server with its own key (level 10) and a `ci`
key at level 2, which opens the host machine (`local`, level 2) and never the sandbox (4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server, start_server, stop_server, traversable

from agentbox import config as config_mod
from agentbox.config import MAX_LEVEL, MIN_API_KEY_CHARS

OWN_KEY = "own-key-of-the-operator-0123456789"
CI_KEY = "ci-key-at-level-two-0123456789"
CONFIG = """
api_key = "{own}"

[[api_keys]]
name = "ci"
key = "{ci}"
level = 2

[machines.host]
kind = "local"
root = "{root}"
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = traversable(tmp_path_factory.mktemp("keys"), tmp_path_factory)
    (base / "home").mkdir()
    (base / "host-root").mkdir()
    (base / "agentbox.toml").write_text(CONFIG.format(own=OWN_KEY, ci=CI_KEY, root=base / "host-root"))
    server = start_server(base / "home", env={"AGENTBOX_CONFIG": str(base / "agentbox.toml")})
    yield server
    stop_server(server)


def client(server: Server, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def denied(response: httpx.Response) -> bool:
    return response.status_code == 403 and response.json()["data"]["error_type"] == "machine_denied"


def test_a_low_key_opens_what_its_level_admits_and_nothing_above(keyed: Server) -> None:
    with client(keyed, CI_KEY) as ci:
        sandbox = ci.post("/v2/commands", json={"command": "echo hi"})  # the default machine: level 4
        assert denied(sandbox), sandbox.text
        assert "needs permission level 4, caller has 2" in sandbox.json()["message"]
        made = ci.post("/v1/sessions", json={"model": "scripted", "machine": "host", "script": []})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        ran = ci.post(f"/sandboxes/{sid}/v2/commands", json={"command": "echo on-the-host"})
        assert ran.status_code == 200 and "on-the-host" in ran.text, ran.text
        refused = ci.post("/v1/sessions", json={"model": "scripted", "machine": "sandbox", "script": []})
        assert denied(refused), refused.text


def test_a_session_on_a_machine_above_the_key_is_out_of_its_reach(keyed: Server) -> None:
    with client(keyed, OWN_KEY) as own, client(keyed, CI_KEY) as ci:
        made = own.post("/v1/sessions", json={"model": "scripted", "script": []})  # on the sandbox
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        for method, path in (
            ("GET", f"/v1/sessions/{sid}"),
            ("GET", f"/v1/sessions/{sid}/events?follow=false"),
            ("POST", f"/v1/sessions/{sid}/messages"),
            ("DELETE", f"/v1/sessions/{sid}"),
        ):
            r = ci.request(method, path, json={"content": "hi"} if method == "POST" else None)
            assert denied(r), (method, path, r.status_code, r.text)
        assert own.get(f"/v1/sessions/{sid}").status_code == 200  # the operator's key still reaches it
        assert own.delete(f"/v1/sessions/{sid}").status_code == 200


def test_a_low_key_lists_only_the_sessions_it_may_reach(keyed: Server) -> None:
    """The listing leaked every session's id and metadata to any key; now it is filtered in the
    query, so pages and cursors count only what the key may see."""
    with client(keyed, OWN_KEY) as own, client(keyed, CI_KEY) as ci:
        made = [
            own.post("/v1/sessions", json={"model": "scripted", "script": [], **where}).json()["id"]
            for where in ({}, {"machine": "host"}, {"machine": "sandbox"}, {"machine": "host"}, {"machine": "none"})
        ]  # fmt: skip
        reachable = {made[1], made[3], made[4]}
        seen, after = [], None
        while True:
            page = ci.get("/v1/sessions", params={"limit": 1, **({"after": after} if after else {})}).json()
            seen += [item["id"] for item in page["items"]]
            if not page["has_more"]:
                break
            after = page["next_after"]
        assert set(seen) & set(made) == reachable and len(seen) == len(set(seen))
        everything = {item["id"] for item in own.get("/v1/sessions", params={"limit": 100}).json()["items"]}
        assert set(made) <= everything
        for sid in made:
            own.delete(f"/v1/sessions/{sid}")


def test_keys_are_required_and_mcp_takes_only_the_servers_own(keyed: Server) -> None:
    with client(keyed, None) as none, client(keyed, "wrong-" + CI_KEY) as wrong, client(keyed, CI_KEY) as ci:
        assert none.get("/v1/sessions").status_code == 401
        assert wrong.get("/v1/sessions").status_code == 401
        assert none.get("/health").status_code == 200
        mcp = ci.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert mcp.status_code == 403 and "server's own api_key" in mcp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            f'name = "a"\nkey = "{"k" * (MIN_API_KEY_CHARS - 1)}"\nlevel = 1',
            f"at least {MIN_API_KEY_CHARS} characters",
        ),
        (f'name = "a"\nkey = "{CI_KEY}"\nlevel = {MAX_LEVEL + 1}', f"level must be 0 to {MAX_LEVEL}"),
        (f'name = "a"\nkey = "{OWN_KEY}"\nlevel = 1', "its key is another key's"),
        (f'name = "a"\nkey = "{CI_KEY}"\nlevel = true', "level must be"),
        (f'name = "a"\nkey = "{CI_KEY}"\nlevel = 1\nrole = "x"', "takes name, key (or key_env) and level"),
        ('name = "a"\nkey_env = "NO_SUCH_VARIABLE"\nlevel = 1', "at least"),
    ],
)
def test_an_api_key_entry_it_cannot_take_is_refused(tmp_path: Path, entry: str, message: str) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(f'api_key = "{OWN_KEY}"\n\n[[api_keys]]\n{entry}\n')
    with pytest.raises(config_mod.ConfigError) as caught:
        config_mod.load(path, env={})
    assert message in str(caught.value)


def test_keys_from_the_environment_and_their_levels(tmp_path: Path) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text('[[api_keys]]\nname = "ci"\nkey_env = "CI_KEY"\nlevel = 0\n')
    settings = config_mod.load(path, env={"CI_KEY": CI_KEY})
    assert settings.keyed and settings.levels() == [(CI_KEY, 0)]
    shortest = "k" * MIN_API_KEY_CHARS  # the boundary: one character fewer is refused above
    assert config_mod.load(path, env={"CI_KEY": shortest}).levels() == [(shortest, 0)]
    duplicate = '[[api_keys]]\nname = "a"\nkey_env = "K"\nlevel = 1\n[[api_keys]]\nname = "a"\nkey_env = "L"\nlevel = 1\n'
    path.write_text(duplicate)
    with pytest.raises(config_mod.ConfigError, match="a name of its own"):
        config_mod.load(path, env={"K": CI_KEY, "L": OWN_KEY})
