"""Code in a sandbox races the server's file operations, as an attacker would.

Inside the sandbox a loop swaps a real directory with a symlink to a host directory
(`renameat2(RENAME_EXCHANGE)`, as fast as it can) while requests name a path through that
directory. A server that checks a path and later opens the host path by name follows the
link as root: it reads the host file, lists the host directory or writes into it. The host
directory here is root-only (0700) and holds a token in a file's content and in a file's
name; every route is tried `ATTEMPTS` times and must never show the token or change the
host directory. The same race is run against the model's `read_file` tool in-process.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import SandboxFactory, Server

from agentbox.machines.base import ExecRequest
from agentbox.tools.read import TOOLS as READ_TOOLS
from agentbox.tools.tiers import Tier

#: Requests per route while the swap loop runs (a server that follows the link lost within a few).
ATTEMPTS = 300

RACER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
while True:
    libc.renameat2(-100, b"real", -100, b"link", 2)  # RENAME_EXCHANGE
"""


@dataclass
class Race:
    """A host directory the sandbox must never reach, and the racing directory inside."""

    host_dir: Path
    token: str
    base: str  # inside: holds `real` (a directory) and `link` (to host_dir), swapped all the time

    @property
    def through(self) -> str:
        return f"{self.base}/real"

    def host_untouched(self) -> None:
        names = sorted(p.name for p in self.host_dir.rglob("*"))
        assert names == sorted(["target.txt", f"{self.token}.txt", "sub"]), names


def make_host_dir(token: str) -> Path:
    host_dir = Path("/var/tmp") / f"agentbox-race-{uuid.uuid4().hex[:12]}"
    (host_dir / "sub").mkdir(parents=True)
    (host_dir / "target.txt").write_text(f"host secret {token}\n")
    (host_dir / f"{token}.txt").write_text("named after the token\n")
    host_dir.chmod(0o700)
    return host_dir


def setup_commands(base: str, host_dir: Path) -> str:
    return (
        f"set -e; mkdir -p {base}/real/sub; echo decoy > {base}/real/target.txt; "
        f"ln -sfn {host_dir} {base}/link; "
        f"cat > {base}/racer.py <<'EOF'\n{RACER}\nEOF\n"
        f"nohup python3 {base}/racer.py {base} >/dev/null 2>&1 &"
    )


@pytest.fixture
def race(server: Server) -> Iterator[tuple[httpx.Client, Race]]:
    token = uuid.uuid4().hex
    host_dir = make_host_dir(token)
    sid = f"race-{uuid.uuid4().hex[:10]}"
    client = httpx.Client(base_url=f"{server.url}/sandboxes/{sid}", timeout=30)
    base = "/workspace/r"
    started = client.post("/v2/commands", json={"command": setup_commands(base, host_dir)}).json()
    assert started["success"] and started["data"]["exit_code"] == 0, started
    try:
        yield client, Race(host_dir, token, base)
    finally:
        client.post("/v2/commands", json={"command": "pkill -f racer.py; true"})
        client.close()
        shutil.rmtree(host_dir, ignore_errors=True)


def hammer(race: Race, send: object) -> None:
    for _ in range(ATTEMPTS):
        response: httpx.Response = send()  # type: ignore[operator]
        assert race.token not in response.text, f"{response.request.url}: host data came back"
        assert response.status_code < 500, response.text
    race.host_untouched()


def tar_of(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_reads_never_follow_a_swapped_link_to_the_host(race: tuple[httpx.Client, Race]) -> None:
    client, r = race
    target = f"{r.through}/target.txt"
    hammer(r, lambda: client.get("/v2/fs/read", params={"path": target}))
    hammer(r, lambda: client.post("/v1/file/read", json={"file": target}))
    hammer(r, lambda: client.get("/v2/fs/download", params={"path": target}))
    hammer(r, lambda: client.get("/v1/file/download", params={"path": target}))


def test_listings_and_searches_never_show_a_host_directory(race: tuple[httpx.Client, Race]) -> None:
    client, r = race
    hammer(r, lambda: client.get("/v2/fs/list", params={"path": r.through}))
    hammer(r, lambda: client.post("/v1/file/list", json={"path": r.through}))
    hammer(r, lambda: client.get("/v2/fs/search", params={"path": r.through, "pattern": "*"}))
    hammer(r, lambda: client.post("/v1/file/glob", json={"path": r.through, "pattern": "*"}))
    hammer(r, lambda: client.post("/v2/fs/grep", json={"path": r.through, "pattern": "secret"}))
    hammer(r, lambda: client.get("/v2/fs/tree", params={"path": r.through}))


def test_writes_never_land_in_a_host_directory(race: tuple[httpx.Client, Race]) -> None:
    client, r = race
    sub = f"{r.through}/sub"
    hammer(r, lambda: client.post("/v2/fs/write", json={"path": f"{sub}/w.txt", "content": "x"}))
    hammer(r, lambda: client.post("/v1/file/write", json={"file": f"{sub}/w1.txt", "content": "x"}))
    hammer(r, lambda: client.post("/v2/fs/mkdir", json={"path": f"{sub}/d", "parents": True}))
    hammer(
        r,
        lambda: client.post(
            "/v2/fs/upload", params={"path": f"{sub}/u.txt"}, files={"file": ("u.txt", b"x")}
        ),
    )
    body = tar_of("t.txt", b"x")
    hammer(r, lambda: client.put("/v2/fs/tree", params={"path": sub}, content=body))


async def test_the_read_tool_never_follows_a_swapped_link(make_sandbox: SandboxFactory, db) -> None:  # type: ignore[no-untyped-def]
    from test_tools_governance import tools_for

    m = await make_sandbox()
    token = uuid.uuid4().hex
    host_dir = make_host_dir(token)
    try:
        setup = await m.exec(ExecRequest(command=setup_commands("/workspace/r", host_dir)))
        assert setup.exit_code == 0, setup
        tools = tools_for(m, db, Tier.FULL_AUTO, {"read": READ_TOOLS["read"]})
        for _ in range(ATTEMPTS):
            result = await tools.call("read", {"path": "/workspace/r/real/target.txt"})
            assert token not in result.as_text(), "the read tool returned a host file"
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def test_a_fifo_in_the_workspace_never_freezes_the_server(server: Server) -> None:
    """A FIFO where the runtime reads AGENTS.md, an agent file and a skill: the turn goes on and
    the server keeps answering (a blocking open on the event loop froze it for as long as the
    sandbox liked)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        script = [{"text": "hi"}]
        created = client.post("/v1/sessions", json={"model": "scripted", "script": script})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        fifos = (
            "set -e; mkdir -p .agents/agents .agents/skills/s; "
            "mkfifo AGENTS.md CLAUDE.md .agents/agents/a.md .agents/skills/s/SKILL.md"
        )
        made = client.post(f"/sandboxes/{sid}/v2/commands", json={"command": fifos}).json()
        assert made["data"]["exit_code"] == 0, made
        answered = threading.Event()

        def poll_health() -> None:
            with httpx.Client(base_url=server.url, timeout=2) as probe:
                probe.get("/health").raise_for_status()
                answered.set()

        sent = client.post(f"/v1/sessions/{sid}/messages", json={"content": "go"})
        assert sent.status_code == 202, sent.text
        with client.stream(
            "GET", f"/v1/sessions/{sid}/events/stream", params={"until": "turn_end"}, timeout=20
        ) as events:
            text = "".join(events.iter_text())
        assert "turn.completed" in text, text[-2000:]
        poller = threading.Thread(target=poll_health)
        poller.start()
        poller.join(5)
        assert answered.is_set(), "the server stopped answering"
