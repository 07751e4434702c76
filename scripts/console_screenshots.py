"""Screenshots of the web console's main pages, for a reviewer to look at.

    .venv/bin/python scripts/console_screenshots.py [OUT_DIR]

Starts its own `agentbox serve` (a fresh home, an API key, loopback, a free port), drives one
session of the scripted model (an exec that waits for approval, two staged writes, a delivered
file), and writes PNGs of the login form, the sessions list, the session waiting for an
approval, the session with its change set, the sandbox's files and watch stream, and `/docs`,
taken in Debian's headless chromium through Playwright. Prints the directory it wrote to.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page, expect, sync_playwright

#: Seconds the server may take to start, and any page or turn to reach the state shown.
DEADLINE = 30.0
KEY = "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
VIEWPORT = {"width": 1400, "height": 900}
SCRIPT: list[dict[str, Any]] = [
    {
        "text": "I'll write the report first, then stage the two files for your review.",
        "tool_calls": [
            {
                "name": "bash",
                "input": {
                    "command": "printf 'revenue,42\\ncost,17\\n' > /workspace/report.csv; wc -l report.csv"
                },
            }
        ],
    },
    {
        "tool_calls": [
            {
                "name": "write_file",
                "input": {"path": "notes.md", "content": "# Notes\n\n- revenue up\n- cost down\n"},
            },
            {"name": "write_file", "input": {"path": "todo.txt", "content": "ship it\n"}},
        ]
    },
    {"tool_calls": [{"name": "deliver_file", "input": {"path": "report.csv"}}]},
    {"text": "Done: the report is delivered and two files wait for your review."},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"never: {what}")
        time.sleep(0.1)
    return value


@contextmanager
def server() -> Iterator[str]:
    """A server of its own; the home is below /var/tmp, where the sandbox uid can reach it."""
    base = Path(tempfile.mkdtemp(prefix="agentbox-shots-", dir="/var/tmp"))
    base.chmod(0o711)
    home = base / "home"
    home.mkdir()
    port = free_port()
    env = {**os.environ, "AGENTBOX_HOME": str(home), "AGENTBOX_API_KEY": KEY}
    with open(base / "server.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agentbox", "serve", "--port", str(port)], env=env, stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(url), "the server answers /health")
        yield url
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def shoot(page: Page, out: Path, name: str, full_page: bool = True) -> None:
    page.wait_for_timeout(300)  # let the last frame paint
    page.screenshot(path=out / name, full_page=full_page)
    print(f"  {name}")


def take(url: str, out: Path) -> None:
    api = httpx.Client(base_url=url, headers={"X-AIO-API-Key": KEY}, timeout=DEADLINE)
    body = {"model": "scripted", "script": SCRIPT, "permission_mode": "full-ask", "metadata": {"demo": True}}
    sid = api.post("/v1/sessions", json=body).json()["id"]
    api.post("/v1/sessions", json={"model": "scripted", "script": [{"text": "Hello."}]})
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(DEADLINE * 1000)
        expect.set_options(timeout=DEADLINE * 1000)
        page.goto(url + "/")
        expect(page.get_by_label("API key")).to_be_visible()
        shoot(page, out, "01-login.png")
        page.get_by_label("API key").fill(KEY)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#sessions tbody tr")).to_have_count(2)
        shoot(page, out, "02-sessions.png")

        page.goto(f"{url}/console/#/sessions/{sid}")
        page.locator("#composer textarea").fill("Summarise the numbers in a report and tidy up the notes.")
        page.get_by_role("button", name="Send").click()
        expect(page.locator(".approval.pending")).to_be_visible()
        shoot(page, out, "03-session-approval.png")
        page.locator(".approval.pending").get_by_role("button", name="Allow", exact=True).click()
        expect(page.locator("#conversation .turn-end.completed")).to_be_visible()
        page.locator("#changes .operation").first.get_by_role("button", name="Apply").click()
        expect(page.locator("#changes .operation").first.locator(".op-head .badge")).to_have_text("applied")
        page.locator('[data-tool-use="toolu_s0_0"] .result summary').click()
        shoot(page, out, "04-session-review.png")

        page.locator("#open-sandbox").click()
        expect(page.locator("#watch-state")).to_have_text("● live")
        page.locator("#tree").get_by_role("button", name="report.csv").click()
        expect(page.locator("#viewer .file-text")).to_contain_text("revenue")
        api.post(f"/sandboxes/{sid}/v2/fs/write", json={"path": "/workspace/scratch.txt", "content": "x\n"})
        expect(page.locator("#watch li").first).to_be_visible()
        shoot(page, out, "05-sandbox.png")

        page.goto(url + "/docs")
        expect(page.locator(".swagger-ui .opblock-tag").first).to_be_visible()
        shoot(page, out, "06-docs.png", full_page=False)  # the whole API is a very long page
        browser.close()
    print(json.dumps({"session": sid}))


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="agentbox-console-"))
    out.mkdir(parents=True, exist_ok=True)
    with server() as url:
        print(f"server {url}; screenshots:")
        take(url, out)
    print(out.resolve())


if __name__ == "__main__":
    main()
