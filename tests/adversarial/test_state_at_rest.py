"""What a real `agentbox serve` leaves on disk, seen as another host user would see it.

The home, the database (with its WAL) and the blobs are the server's alone; session secrets
(a model key, MCP header values, secret-looking MCP env values) are stored encrypted and
never shown back, yet still reach the provider and the MCP server; a setuid or setgid bit
made in a sandbox never lands on the host; a sandbox's /tmp and $HOME are out of reach of
every host user but root, while /tmp inside still behaves as /tmp.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, Server, start_server, stop_server

from agentbox.machines.sandbox import owner_token

#: The uid/gid an ordinary host user has in these checks (nobody).
OTHER_UID = 65534

MODEL_KEY = "sk-model-key-6f1d2a9c"
MCP_TOKEN = "Bearer mcp-token-83be41d0"
MCP_ENV_SECRET = "ghp_env-secret-0c77a1e5"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="checks as another host user need root")


def as_other_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """`argv` run by an ordinary host user (not root, not the sandbox uid)."""
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=SANDBOX_DEADLINE,
    )  # fmt: skip


class Recorder(BaseHTTPRequestHandler):
    """A loopback endpoint that keeps every request's headers and answers like a finished model."""

    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.rfile.read(int(self.headers.get("content-length") or 0))
        chunk = {"choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": "stop"}]}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def recorder() -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []
    handler = type("Handler", (Recorder,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


def open_to(home: Path, url: str) -> dict[str, str]:
    """Server env whose config lets sessions reach the loopback `url` (operator's `model_endpoints`)."""
    config = home.parent / "agentbox.toml"
    config.write_text(f'model_endpoints = ["{url}"]\n')
    return {"AGENTBOX_NETWORK": "off", "AGENTBOX_CONFIG": str(config)}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, recorder: tuple[str, list[dict[str, str]]]
) -> Iterator[Server]:
    from conftest import traversable

    home = traversable(tmp_path_factory.mktemp("at-rest"), tmp_path_factory) / "home"
    home.mkdir()
    s = start_server(home, env=open_to(home, recorder[0]))
    yield s
    stop_server(s)


def until(condition: object, what: str) -> None:
    deadline = time.monotonic() + SANDBOX_DEADLINE
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def run_in(server: Server, session: str, command: str) -> dict[str, object]:
    with server.client() as client:
        response = client.post(f"/sandboxes/{session}/v2/commands", json={"command": command})
    assert response.status_code == 200, response.text
    data: dict[str, object] = response.json()["data"]
    return data


def secret_session(server: Server, base_url: str) -> dict[str, object]:
    body = {
        "model": "openai:test-model",
        "model_options": {"base_url": base_url, "api_key": MODEL_KEY},
        "mcp_servers": [
            {"name": "remote", "url": base_url + "/mcp", "headers": {"Authorization": MCP_TOKEN}},
            {"name": "local", "command": ["true"], "env": {"GITHUB_TOKEN": MCP_ENV_SECRET, "MODE": "plain"}},
        ],
    }
    with server.client() as client:
        response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_home_database_and_blobs_are_the_servers_alone(server: Server) -> None:
    with server.client() as client:
        uploaded = client.post("/v1/files", files={"file": ("note.txt", b"private bytes")})
    assert uploaded.status_code in (200, 201), uploaded.text
    run_in(server, "modes", "true")
    home = server.home
    assert mode(home) & 0o007 == 0, oct(mode(home))
    for name in ("agentbox.db", "agentbox.db-wal", "agentbox.db-shm"):
        assert mode(home / name) == 0o600, (name, oct(mode(home / name)))
    blobs = home / "blobs"
    assert mode(blobs) == 0o700
    files = [p for p in blobs.rglob("*") if p.is_file()]
    assert files
    for p in [*files, *(p for p in blobs.rglob("*") if p.is_dir())]:
        assert mode(p) in (0o600, 0o700), (p, oct(mode(p)))
    for target in (home / "agentbox.db", files[0], home / "sessions"):
        assert as_other_user("stat", str(target)).returncode != 0, target


def test_session_secrets_are_encrypted_at_rest_and_never_shown(
    server: Server, recorder: tuple[str, list[dict[str, str]]]
) -> None:
    base_url, _ = recorder
    created = secret_session(server, base_url)
    shown = json.dumps(created)
    with server.client() as client:
        shown += client.get(f"/v1/sessions/{created['id']}").text
        shown += client.get(f"/v1/sessions/{created['id']}/events").text
        shown += client.get("/v1/sessions").text
    for secret in (MODEL_KEY, MCP_TOKEN, MCP_ENV_SECRET):
        assert secret not in shown, secret
    assert "plain" in shown  # a value that is not a secret is still shown
    stored = b"".join(
        p.read_bytes() for p in server.home.iterdir() if p.name.startswith("agentbox.db") and p.is_file()
    )
    for secret in (MODEL_KEY, MCP_TOKEN, MCP_ENV_SECRET):
        assert secret.encode() not in stored, secret


def test_the_encrypted_secrets_still_reach_the_model_and_the_mcp_server(
    server: Server, recorder: tuple[str, list[dict[str, str]]]
) -> None:
    base_url, seen = recorder
    created = secret_session(server, base_url)
    with server.client() as client:
        posted = client.post(f"/v1/sessions/{created['id']}/messages", json={"content": "hi"})
    assert posted.status_code == 202, posted.text
    until(lambda: any(h.get("authorization") == f"Bearer {MODEL_KEY}" for h in seen), "the model request")
    until(lambda: any(h.get("authorization") == MCP_TOKEN for h in seen), "the MCP request")


def test_a_setuid_or_setgid_bit_made_in_a_sandbox_never_reaches_the_host(server: Server) -> None:
    script = (
        "cd /workspace; touch u g; chmod u+s u; echo chmod=$?; chmod g+s g; echo chgrp=$?; "
        "cp -p /usr/bin/su su 2>/dev/null; "
        "python3 -c \"import os; os.open('o', os.O_CREAT | os.O_WRONLY, 0o4755)\" 2>/dev/null; echo open=$?; "
        "mkdir -m 2755 d; echo mkdir=$?; install -m 4755 /bin/true i; echo install=$?; true"
    )
    result = run_in(server, "setuid", script)
    out = str(result["stdout"])
    assert "chmod=0" not in out and "chgrp=0" not in out and "open=0" not in out, out
    workspace = server.home / "sessions" / "setuid" / "workspace"
    for p in [workspace, *workspace.rglob("*")]:
        assert not p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID), (p, oct(p.lstat().st_mode))
    # And an ordinary host user cannot even reach the files to try them.
    assert as_other_user("stat", str(workspace / "u")).returncode != 0


def test_sandbox_tmp_and_home_are_out_of_reach_on_the_host_but_tmp_behaves_inside(server: Server) -> None:
    result = run_in(
        server, "private", "echo t > /tmp/t; echo h > /root/h; stat -c %a /tmp; mkdir /tmp/d && echo ok"
    )
    assert result["stdout"] == "1777\nok\n", result
    run = server.home / "sessions" / "private" / "run"
    assert not list(run.rglob("t")) and not list(run.rglob("h")), (
        "a sandbox's /tmp or $HOME is on the host disk"
    )
    assert mode(run / "sandbox") & 0o077 == 0, oct(mode(run / "sandbox"))
    mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    private = [m[4] for m in mounts if m[4].endswith(("/tmp", "/home")) and "/mnt/sbx_" in m[4]]
    assert private, "a root server mounts the sandboxes' /tmp and $HOME under its runtime directory"
    for point in private:
        assert as_other_user("stat", point).returncode != 0, point


def test_the_system_layer_with_the_hosts_setuid_programs_is_out_of_reach_and_nosuid(server: Server) -> None:
    """The system layer's fuse mounts hold /usr's setuid programs, squashed to the sandbox uid:
    a host user who could run one there would become that uid."""
    run_in(server, "layer", "touch /usr/bin/su")  # a copy-up too: the upper dir holds one now
    layers = [
        d for d in Path("/run/agentbox/mnt").glob("sbx_*")
        if (d / "owner").exists() and (d / "owner").read_text() == owner_token(server.process.pid)
    ]  # fmt: skip
    if not layers:
        pytest.skip("this host gives sandboxes no system layer")
    mounts = {
        line.split()[4]: line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
    }
    for layer in layers:
        assert "nosuid" in mounts[str(layer / "usr")].split(","), mounts[str(layer / "usr")]
        assert as_other_user("stat", str(layer / "usr" / "bin" / "su")).returncode != 0, layer


def test_secrets_stored_before_sealing_are_sealed_and_wiped_at_start(
    tmp_path_factory: pytest.TempPathFactory, recorder: tuple[str, list[dict[str, str]]]
) -> None:
    """A home written by an agentbox that kept session secrets in plaintext (here: put back
    into the row and its `session.created` event by hand) holds none after the next start."""
    import sqlite3

    from conftest import traversable

    home = traversable(tmp_path_factory.mktemp("legacy"), tmp_path_factory) / "home"
    home.mkdir()
    first = start_server(home, env=open_to(home, recorder[0]))
    try:
        created = secret_session(first, recorder[0])
    finally:
        stop_server(first)
    plain_servers = [{"name": "remote", "url": "http://x/mcp", "headers": {"Authorization": MCP_TOKEN}}]
    with sqlite3.connect(home / "agentbox.db") as conn:
        conn.execute(
            "UPDATE sessions SET model_options = ?, mcp_servers = ? WHERE id = ?",
            (json.dumps({"api_key": MODEL_KEY}), json.dumps(plain_servers), created["id"]),
        )
        conn.execute(
            "UPDATE events SET data = ? WHERE session_id = ? AND type = 'session.created'",
            (json.dumps({"mcp_servers": plain_servers}), created["id"]),
        )
    second = start_server(home, env=open_to(home, recorder[0]))
    try:
        with second.client() as client:
            shown = client.get(f"/v1/sessions/{created['id']}/events").text
        assert MCP_TOKEN not in shown
        stored = b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("agentbox.db"))
        for secret in (MODEL_KEY, MCP_TOKEN):
            assert secret.encode() not in stored, secret
    finally:
        stop_server(second)
