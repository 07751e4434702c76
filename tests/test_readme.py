"""The README's code blocks, run as a reader would run them, against a live server.

Every fenced block is either run here (`RUNS`), run elsewhere (`ELSEWHERE`: `.ci/run` or a
named test), or cannot run on this machine (`CANNOT_RUN`, with the reason). A block in none
of them fails the test, so a new example cannot go unrun without saying why. Blocks are run
verbatim except for the server's port: `8091` becomes the test server's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentbox import config
from tests.conftest import Server, start_server, stop_server, traversable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The port the README's examples name.
README_PORT = "8091"
#: Seconds one example may take (a sandbox starts, a scripted turn runs).
EXAMPLE_TIMEOUT = 120


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    text: str


def readme_blocks() -> list[Block]:
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if match:
            end = lines.index("```", i + 1)
            blocks.append(Block(i + 1, match.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def block(marker: str) -> Block:
    found = [b for b in readme_blocks() if marker in b.text]
    assert len(found) == 1, f"{len(found)} README blocks contain {marker!r}"
    return found[0]


def on_port(text: str, server: Server) -> str:
    port = httpx.URL(server.url).port
    return text.replace(f":{README_PORT}", f":{port}")


def run(argv: list[str], server: Server, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, f"{argv[:2]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def bash(text: str, server: Server, env: dict[str, str] | None = None) -> str:
    return run(["bash", "-euo", "pipefail", "-c", on_port(text, server)], server, env)


def python(text: str, server: Server, env: dict[str, str] | None = None) -> str:
    return run([sys.executable, "-c", on_port(text, server)], server, env)


# ---------------------------------------------------------------- the blocks run here


def aio_sdk(server: Server) -> None:
    out = python(block("from agent_sandbox import Sandbox").text, server)
    assert [line for line in out.splitlines() if line] == ["hi", "print('hi')"], out


def agentbox_sdk(server: Server) -> None:
    printed = python(block("from agentbox import Client").text, server).splitlines()
    assert printed[-1] == "completed Done." and printed[0].split() == ["2", "user.message"], printed
    assert printed[-2].split()[1] == "turn.completed", printed


def e2b_sdk(server: Server) -> None:
    env = {
        name: on_port(value, server)
        for line in block("export E2B_API_URL").text.splitlines()
        if line.startswith("export ")
        for name, value in re.findall(r"(\w+)=(<[^>]*>|[^\s#]+)", line.split(" #", 1)[0])
    }
    assert env.pop("E2B_API_KEY") == "<the server's API key>"  # a server without a key takes any
    out = python(block("from e2b import Sandbox").text, server, {**env, "E2B_API_KEY": "e2b_" + "0" * 40})
    assert [line for line in out.splitlines() if line] == ["hi"], out


def sessions_and_sandboxes(server: Server) -> None:
    """The session walkthrough, then the sandbox lifecycle calls on the session it made."""
    script = block('"model": "scripted"').text + block("/v1/sandboxes?limit=100").text
    out = bash(script, server)
    assert '"type":"turn.completed"' in out.replace(" ", ""), out
    assert '"state":"running"' in out.replace(" ", ""), out


def provider_session(server: Server) -> None:
    """Made on a server whose config lists the endpoint, as the README says it must."""
    out = bash(block('"model": "openai:qwen2.5-coder"').text, server)
    assert '"id":"ses_' in out.replace(" ", ""), out


def remote_cli(server: Server) -> None:
    """The lines of the remote CLI block that need no hosted model: sessions and events."""
    text = block("agentbox sessions --url").text
    lines = [line for line in text.splitlines() if line.startswith(("agentbox sessions", "agentbox events"))]
    assert len(lines) == 2, text
    with httpx.Client(base_url=server.url) as http:
        session = http.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "hi"}]}).json()[
            "id"
        ]
    out = bash("\n".join(line.replace("ses_...", session) for line in lines), server)
    assert session in out, out


def config_tables(server: Server) -> None:
    """Each TOML block is a config this version loads, with the machine kinds and the tool
    settings it names."""
    for b in (b for b in readme_blocks() if b.lang == "toml"):
        table = tomllib.loads(b.text)
        path = server.home.parent / f"readme-{b.line}.toml"
        path.write_text(b.text)
        settings = config.load(path, env={"AGENTBOX_HOME": str(server.home)})
        for name, entry in table.get("machines", {}).items():
            machine = settings.machine(name)
            assert machine is not None and machine.kind == entry["kind"], (b.line, name)
        for name, value in table.get("tools", {}).items():
            assert getattr(settings.tools, name) == value, (b.line, name)


RUNS: dict[str, Callable[[Server], None]] = {
    "from agent_sandbox import Sandbox": aio_sdk,
    "from agentbox import Client": agentbox_sdk,
    "export E2B_API_URL": e2b_sdk,
    "from e2b import Sandbox": e2b_sdk,
    '"model": "scripted"': sessions_and_sandboxes,
    "/v1/sandboxes?limit=100": sessions_and_sandboxes,
    '"model": "openai:qwen2.5-coder"': provider_session,
    "agentbox sessions --url": remote_cli,
    "[machines.": config_tables,
    "[tools]": config_tables,
}

#: Blocks another test or `.ci/run` itself runs: marker -> where.
ELSEWHERE: dict[str, str] = {
    "bash scripts/test.sh": ".ci/run (scripts/test.sh runs scripts/setup.sh first)",
    "pip install --no-deps agent-sandbox": "tests/test_packaging.py::test_readmes_sdk_install_line_gives_an_importable_sdk",
    "agentbox image build data": ".ci/run builds the data image; list and rm: tests/test_images.py::test_list_and_rm",
    "from e2b_code_interpreter import Sandbox": "tests/test_e2b_code.py::test_the_readmes_code_interpreter_example",
}

#: Blocks this machine cannot run: marker -> why.
CANNOT_RUN: dict[str, str] = {
    "systemctl daemon-reload": "systemd is not PID 1 in CI; the unit is verified by tests/test_packaging.py",
    "OPENAI_API_KEY=sk-": "hosted models; the provider protocols are run against loopback servers in tests/test_providers.py",
    "agentbox mcp --session": "an interactive stdio server and a placeholder (`...`); both are tests/test_mcp.py",
}


def classified(b: Block) -> list[str]:
    return [m for m in (*RUNS, *ELSEWHERE, *CANNOT_RUN) if m in b.text]


def test_every_block_is_run_or_says_why_not() -> None:
    unclassified = [b.line for b in readme_blocks() if not classified(b)]
    assert not unclassified, f"README blocks at lines {unclassified} are neither run nor explained"
    for where in ELSEWHERE.values():
        for ref in re.findall(r"tests/\S+?::\w+", where):
            path, name = ref.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), ref


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with the README's one config line for session endpoints (`model_endpoints`)."""
    endpoints = re.findall(r"`(model_endpoints = [^`]+)`", README.read_text())
    assert len(endpoints) == 1, endpoints
    home = traversable(tmp_path_factory.mktemp("readme"), tmp_path_factory) / "home"
    home.mkdir()
    (home.parent / "agentbox.toml").write_text(endpoints[0] + "\n")
    server = start_server(home, env={"AGENTBOX_CONFIG": str(home.parent / "agentbox.toml")})
    yield server
    stop_server(server)


@pytest.mark.parametrize(
    "runner", sorted(set(RUNS.values()), key=lambda f: f.__name__), ids=lambda f: f.__name__
)
def test_readme_example(runner: Callable[[Server], None], readme_server: Server) -> None:
    runner(readme_server)
