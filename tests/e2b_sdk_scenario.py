"""One user's session with the stock `e2b` SDK, run as a script by any interpreter that has it.

`tests/test_e2b_sdk_releases.py` runs this under each pinned SDK release (the test venv's, and
an older one in its own venv that still speaks the v1 routes) against a real `agentbox serve`,
with `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY` set as a user sets them. It imports
nothing of agentbox or of the tests, so an old SDK's dependencies never meet the suite's.

It prints one JSON object: what each step observed. Raising ends it with a traceback, which
the test shows.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import sys
import time
from typing import Any

import httpx
from e2b import AsyncSandbox, CommandExitException, Sandbox, SandboxQuery
from e2b_code_interpreter import Sandbox as CodeSandbox

#: Seconds the watch and listing steps wait for what they expect.
DEADLINE_SECONDS = 20.0


def eventually(check: Any, what: str) -> Any:
    end = time.monotonic() + DEADLINE_SECONDS
    while not (value := check()):
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE_SECONDS}s: {what}")
        time.sleep(0.1)
    return value


def commands(sbx: Sandbox) -> dict[str, Any]:
    run = sbx.commands.run("echo $GREETING; echo oops >&2")
    try:
        sbx.commands.run("echo bad >&2; exit 3")
        failed: dict[str, Any] = {}
    except CommandExitException as exc:
        failed = {"exit_code": exc.exit_code, "stderr": exc.stderr}
    sleeper = sbx.commands.run("sleep 600", background=True)
    listed = sleeper.pid in [p.pid for p in sbx.commands.list()]
    killed = sbx.commands.kill(sleeper.pid)
    try:
        sleeper.wait()
        ended = None
    except CommandExitException as exc:
        ended = exc.exit_code
    reader = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
    again = sbx.commands.connect(reader.pid)
    sbx.commands.send_stdin(reader.pid, "ping\n")
    return {
        "run": [run.stdout, run.stderr, run.exit_code],
        "failed": failed,
        "background": {"listed": listed, "killed": killed, "exit_code": ended},
        "stdin_via_connect": again.wait().stdout,
        "metrics": [m.mem_total > m.mem_used > 0 and m.cpu_count > 0 for m in sbx.get_metrics()[-1:]],
    }


def files(sbx: Sandbox) -> dict[str, Any]:
    fs = sbx.files
    fs.make_dir("/workspace/docs")
    fs.write("/workspace/docs/a.txt", "alpha")
    fs.rename("/workspace/docs/a.txt", "/workspace/docs/b.txt")
    listing = sorted(e.name for e in fs.list("/workspace/docs"))
    read = fs.read("/workspace/docs/b.txt")
    gone_before = fs.exists("/workspace/docs/a.txt")
    fs.remove("/workspace/docs/b.txt")
    watch = fs.watch_dir("/workspace/docs")
    fs.write("/workspace/docs/seen.txt", "x")
    events = eventually(
        lambda: [e.name for e in watch.get_new_events() if e.name == "seen.txt"], "a watch event for seen.txt"
    )
    watch.stop()
    upload = httpx.post(sbx.upload_url("/workspace/docs/up.txt"), files={"file": ("up.txt", b"uploaded")})
    download = httpx.get(sbx.download_url("/workspace/docs/up.txt"))
    return {
        "listing": listing,
        "read": read,
        "exists_after_rename": gone_before,
        "exists_after_remove": fs.exists("/workspace/docs/b.txt"),
        "watched": events[:1],
        "signed_upload": upload.status_code,
        "signed_download": [download.status_code, download.text],
    }


def lifecycle(tag: str) -> dict[str, Any]:
    sbx = Sandbox.create(metadata={"suite": tag}, envs={"GREETING": "hi"})
    try:
        observed = {"commands": commands(sbx), "files": files(sbx)}
        sbx.set_timeout(300)
        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        observed["listed"] = [s.sandbox_id == sbx.sandbox_id for s in found]
        sbx.files.write("/workspace/kept.txt", "kept")
        observed["paused"] = sbx.pause()
        back = Sandbox.connect(sbx.sandbox_id)
        observed["after_resume"] = back.files.read("/workspace/kept.txt")
    finally:
        observed["killed"] = sbx.kill()
    observed["listed_after_kill"] = len(
        Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
    )
    return observed


def code_interpreter() -> dict[str, Any]:
    """`e2b-code-interpreter`'s own `Sandbox` (template `code-interpreter-v1`): state kept
    between cells, an exception as an error with its traceback."""
    sbx = CodeSandbox.create()
    try:
        sbx.run_code("x = 21")
        answer = sbx.run_code("x * 2").text
        failed = sbx.run_code("1 / 0").error
    finally:
        sbx.kill()
    return {
        "answer": answer,
        "error": None if failed is None else [failed.name, "ZeroDivisionError" in failed.traceback],
    }


async def async_client() -> dict[str, Any]:
    sbx = await AsyncSandbox.create(envs={"GREETING": "async hi"})
    try:
        run = await sbx.commands.run("echo $GREETING")
        await sbx.files.write("/workspace/async.txt", "from async")
        read = await sbx.files.read("/workspace/async.txt")
    finally:
        killed = await sbx.kill()
    return {"run": run.stdout, "read": read, "killed": killed}


def main() -> None:
    tag = sys.argv[1]
    report = {
        "version": importlib.metadata.version("e2b"),
        "code_version": importlib.metadata.version("e2b-code-interpreter"),
        "sync": lifecycle(tag),
        "code": code_interpreter(),
        "async": asyncio.run(async_client()),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
    # The report is out. Skip interpreter finalization: the SDK's transport threads can still
    # be running then, and on a loaded host CPython aborts on them (PyGILState_Release).
    os._exit(0)
