"""AIO's `/v1/jupyter` and `/v1/code` through the real `agent-sandbox` SDK, on kernels in a sandbox.

The server is `kernel_server` (its default machine on the `kernel` test image); the module
works in a sandbox of its own (`/sandboxes/<id>`), so its sessions are its own.
"""

from __future__ import annotations

import time
import uuid

import pytest
from agent_sandbox import Sandbox
from conftest import Server

from agentbox.api.v1_jupyter import DEFAULT_KERNEL

#: Seconds of the `timeout` the timeout tests give, and of the cell it stops.
TIMEOUT = 2
LONG_SLEEP = 60


@pytest.fixture(scope="module")
def client(kernel_server: Server) -> Sandbox:
    return Sandbox(base_url=f"{kernel_server.url}/sandboxes/aio-code-{uuid.uuid4().hex[:10]}", timeout=90)


def test_jupyter_sessions_keep_state(client: Sandbox) -> None:
    created = client.jupyter.create_session(kernel_name="python3", session_id="kept-state").data
    assert created is not None and (created.session_id, created.kernel_name) == ("kept-state", DEFAULT_KERNEL)
    client.jupyter.execute_code(code="x = 21", session_id="kept-state")
    reply = client.jupyter.execute_code(code="print('hi'); x * 2", session_id="kept-state").data
    assert reply is not None and reply.status == "ok" and reply.session_id == "kept-state"
    kinds = [(o.output_type, o.text or (o.data or {}).get("text/plain")) for o in reply.outputs]
    assert kinds == [("stream", "hi\n"), ("execute_result", "42")]
    assert reply.execution_count == 2
    listed = client.jupyter.list_sessions().data
    assert listed is not None and listed.sessions["kept-state"].kernel_name == DEFAULT_KERNEL
    client.jupyter.delete_session("kept-state")
    listed = client.jupyter.list_sessions().data
    assert listed is not None and "kept-state" not in listed.sessions


def test_jupyter_errors_figures_and_timeouts(client: Sandbox) -> None:
    failed = client.jupyter.execute_code(code="1/0").data
    assert failed is not None and failed.status == "error"
    assert [(o.ename, o.evalue) for o in failed.outputs] == [("ZeroDivisionError", "division by zero")]
    figure = client.jupyter.execute_code(
        code="import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()"
    ).data
    assert figure is not None and any("image/png" in (o.data or {}) for o in figure.outputs)
    started = time.monotonic()
    slow = client.jupyter.execute_code(code=f"import time; time.sleep({LONG_SLEEP})", timeout=TIMEOUT).data
    assert slow is not None and slow.status == "timeout" and time.monotonic() - started < TIMEOUT + 10
    info = client.jupyter.get_info().data
    assert info is not None and info.default_kernel == DEFAULT_KERNEL and info.max_sessions > 0


def test_jupyter_refusals(client: Sandbox) -> None:
    unknown = client.jupyter.create_session(kernel_name="ruby")
    assert unknown.success is False and "ruby" in (unknown.message or "")
    gone = client.jupyter.delete_session("never-made")
    assert gone.success is False


def test_code_execute_stateless_and_stateful(client: Sandbox) -> None:
    once = client.code.execute_code(language="python", code="import os; print(os.getcwd()); y = 1").data
    assert once is not None and (once.status, once.stdout, once.exit_code) == ("ok", "/workspace\n", 0)
    assert once.session_id is None
    again = client.code.execute_code(language="python", code="y").data
    assert again is not None and again.status == "error" and again.exit_code == 1  # nothing kept
    assert again.traceback and any("NameError" in line for line in again.traceback)
    first = client.code.execute_code(
        language="python", code="z = 5", stateful=True, session_id="code-kept"
    ).data
    assert first is not None and first.session_id == "code-kept"
    kept = client.code.execute_code(language="python", code="print(z + 1)", session_id="code-kept").data
    assert kept is not None and kept.stdout == "6\n"
    refused = client.code.execute_code(language="ruby", code="1")
    assert refused.success is False and "ruby" in (refused.message or "")
    info = client.code.get_info().data
    assert info is not None and [lang.language for lang in info.languages] == ["python", "javascript"]


def test_code_execute_javascript_on_deno(client: Sandbox) -> None:
    once = client.code.execute_code(language="javascript", code="const y = 6; console.log(y * 7)").data
    assert once is not None and (once.language, once.status, once.stdout, once.exit_code) == (
        "javascript", "ok", "42\n", 0,
    )  # fmt: skip
    again = client.code.execute_code(language="javascript", code="y").data
    assert again is not None and again.status == "error" and again.traceback  # a fresh context each call
    assert any("ReferenceError" in line for line in again.traceback)
    first = client.code.execute_code(language="javascript", code="let z = 5", session_id="js-kept").data
    assert first is not None and first.session_id == "js-kept"
    kept = client.code.execute_code(
        language="javascript", code="console.log(z + 1)", session_id="js-kept"
    ).data
    assert kept is not None and kept.stdout == "6\n"
    sessions = client.jupyter.list_sessions().data
    assert sessions is not None and sessions.sessions["js-kept"].kernel_name == "deno"
    jupyter = client.jupyter.execute_code(code="[1, 2].length", kernel_name="deno").data
    assert jupyter is not None and jupyter.kernel_name == "deno" and jupyter.status == "ok"
    assert [(o.data or {}).get("text/plain") for o in jupyter.outputs] == ["2"]
