"""The stock `e2b-code-interpreter` SDK (sync and async) against a real `agentbox serve`.

The server (`kernel_server`) has a default machine on the `kernel` test image (a Jupyter
kernel and matplotlib); the SDK is pointed at it as `tests/test_e2b.py` does, and creates its sandboxes
with its own default template, `code-interpreter-v1`.
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import KERNEL_IMAGE, Server, eventually, host_pid_of, point_e2b_sdk
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.constants import DEFAULT_TEMPLATE, JUPYTER_PORT
from test_readme import block, python

from agentbox.e2b.sandboxes import CODE_INTERPRETER_TEMPLATE
from agentbox.machines.images import (
    KERNELSPEC_DIR,
    KERNELSPECS,
    PROFILES,
    PYPI_PACKAGES,
    WHEELS_IN_TREE,
    Image,
)
from agentbox.workspace.kernels import KERNELS, MAX_OUTPUT_BYTES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Seconds of the SDK's execution timeout in the timeout test, and of the cell it stops.
SDK_TIMEOUT = 2
LONG_SLEEP = 60
#: Lines a JavaScript cell prints at full speed in the test of where its output lands: enough
#: that Deno's kernel still has some on its way when it reports the cell done.
JS_FLOOD_LINES = 5000


@pytest.fixture(scope="module")
def code_env(kernel_server: Server) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as mp:
        point_e2b_sdk(mp, kernel_server)
        yield kernel_server


@pytest.fixture(scope="module")
def sbx(code_env: Server) -> Iterator[Sandbox]:
    """One code interpreter sandbox for the module's sync tests (each test uses its own context)."""
    sandbox = Sandbox.create()
    yield sandbox
    sandbox.kill()


def test_the_sdk_default_template_is_served() -> None:
    assert DEFAULT_TEMPLATE == CODE_INTERPRETER_TEMPLATE


def test_the_image_the_tests_use_has_a_kernel_and_setup_builds_it() -> None:
    script = (Path(__file__).parent.parent / "scripts" / "test.sh").read_text()
    assert f"image build {KERNEL_IMAGE} --profile {KERNEL_IMAGE}\n" in script
    assert {"python3-ipykernel", "python3-matplotlib"} <= set(PROFILES[KERNEL_IMAGE])
    assert KERNELS["javascript"] in KERNELSPECS[KERNEL_IMAGE]
    assert any(p.startswith("deno==") for p in PYPI_PACKAGES[KERNEL_IMAGE])


def test_the_kernel_image_has_deno_and_its_kernelspec_and_no_build_leftovers(kernel_image: Image) -> None:
    spec = kernel_image.rootfs / KERNELSPEC_DIR / "deno" / "kernel.json"
    assert json.loads(spec.read_text()) == KERNELSPECS[KERNEL_IMAGE]["deno"]
    deno = kernel_image.rootfs / KERNELSPECS[KERNEL_IMAGE]["deno"]["argv"][0].lstrip("/")  # type: ignore[index]
    assert deno.is_file() and os.access(deno, os.X_OK)
    assert not (kernel_image.rootfs / WHEELS_IN_TREE.lstrip("/")).exists()
    assert not (kernel_image.rootfs / "root" / ".cache").exists()  # pip kept no cache


def test_state_is_kept_between_cells(sbx: Sandbox) -> None:
    context = sbx.create_code_context()
    assert sbx.run_code("x = 21", context=context).error is None
    execution = sbx.run_code("x * 2", context=context)
    assert execution.text == "42" and execution.error is None
    assert execution.execution_count == 2
    # Without a context the cells share the language's default one.
    sbx.run_code("y = 'default'")
    assert sbx.run_code("y", language="python").text == "'default'"


def test_a_figure_comes_back_as_png(sbx: Sandbox) -> None:
    execution = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()")
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1 and base64.b64decode(pngs[0]).startswith(PNG_SIGNATURE)
    html = sbx.run_code("from IPython.display import HTML; HTML('<i>rich</i>')")
    assert html.results[0].html == "<i>rich</i>" and html.results[0].is_main_result


def test_an_error_has_its_name_value_and_traceback(sbx: Sandbox) -> None:
    seen = []
    execution = sbx.run_code("1/0", on_error=seen.append)
    assert execution.error is not None
    assert (execution.error.name, execution.error.value) == ("ZeroDivisionError", "division by zero")
    assert "ZeroDivisionError" in execution.error.traceback and seen == [execution.error]


def test_stdout_and_stderr_reach_the_callbacks(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    code = "import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')"
    execution = sbx.run_code(
        code, on_stdout=lambda m: out.append(m.line), on_stderr=lambda m: err.append(m.line)
    )
    assert "".join(out) == "one\nthree\n" and "".join(err) == "two\n"
    assert "".join(execution.logs.stdout) == "one\nthree\n"


def test_cells_run_inside_the_sandbox_with_envs(sbx: Sandbox, code_env: Server) -> None:
    code = "import os, socket; (os.getuid(), socket.gethostname(), os.getcwd(), os.path.exists(%r))"
    inside = sbx.run_code(code % str(code_env.home)).text
    shell = sbx.commands.run("id -u; hostname", user="root").stdout.split()  # kernels run as root
    assert inside == f"({shell[0]}, '{shell[1]}', '/workspace', False)"  # the server's home is not there
    env = sbx.run_code("import os; os.environ.get('ONLY_HERE')", envs={"ONLY_HERE": "yes"})
    assert env.text == "'yes'"
    assert sbx.run_code("'ONLY_HERE' in os.environ").text == "False"  # for that cell only


def test_contexts_are_created_listed_restarted_and_removed(sbx: Sandbox) -> None:
    context = sbx.create_code_context(cwd="/tmp", language="python")
    assert (context.language, context.cwd) == ("python", "/tmp")
    assert context.id in [c.id for c in sbx.list_code_contexts()]
    sbx.run_code("kept = 1", context=context)
    assert sbx.run_code("import os; os.getcwd()", context=context).text == "'/tmp'"
    sbx.restart_code_context(context)
    assert sbx.run_code("kept", context=context).error.name == "NameError"
    sbx.remove_code_context(context.id)
    assert context.id not in [c.id for c in sbx.list_code_contexts()]


def test_an_unknown_context_is_not_found(sbx: Sandbox) -> None:
    gone = sbx.create_code_context()
    sbx.remove_code_context(gone)
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=gone)
    with pytest.raises(NotFoundException):
        sbx.restart_code_context(gone)
    with pytest.raises(NotFoundException):
        sbx.remove_code_context(gone)


def test_the_sdk_timeout_ends_the_request_and_interrupts_the_cell(sbx: Sandbox) -> None:
    context = sbx.create_code_context()
    sbx.run_code("import time; kept = 5", context=context)
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code(f"time.sleep({LONG_SLEEP})", context=context, timeout=SDK_TIMEOUT)
    assert time.monotonic() - started < SDK_TIMEOUT + 5
    started = time.monotonic()
    assert sbx.run_code("kept", context=context).text == "5"  # interrupted, its state kept
    assert time.monotonic() - started < LONG_SLEEP / 4


def test_refusals_are_e2b_errors_not_500s(sbx: Sandbox, code_env: Server) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(JUPYTER_PORT)}
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    with httpx.Client(base_url=code_env.url, headers=headers) as client:
        assert client.get("/contexts").status_code == 401  # neither token
        assert client.post("/execute", json={"code": "1"}).status_code == 401
        bad = client.post("/execute", json={"code": 1}, headers=token)
        assert bad.status_code == 400 and bad.json()["code"] == 400
        both = client.post(
            "/execute", json={"code": "1", "language": "python", "context_id": "x"}, headers=token
        )
        assert both.status_code == 400
        cobol = client.post("/contexts", json={"language": "cobol"}, headers=token)
        assert cobol.status_code == 400 and "cobol" in cobol.json()["message"]
        missing = client.post("/execute", json={"code": "1", "context_id": "nope"}, headers=token)
        assert missing.status_code == 404 and "nope" in missing.json()["message"]
        assert client.get("/nowhere", headers=token).status_code == 404
    other = {"E2b-Sandbox-Id": "ses_" + uuid.uuid4().hex, "E2b-Sandbox-Port": str(JUPYTER_PORT)}
    assert httpx.get(code_env.url + "/contexts", headers=other).status_code == 502  # as for envd


def test_the_kernel_dies_with_its_sandbox(code_env: Server) -> None:
    sandbox = Sandbox.create()
    code = "import os; (os.getpid(), os.stat('/proc/self/ns/pid').st_ino)"
    pid, namespace = (int(n) for n in (sandbox.run_code(code).text or "").strip("()").split(","))
    on_host = host_pid_of(pid, namespace)
    assert on_host is not None
    sandbox.kill()
    eventually(lambda: not Path(f"/proc/{on_host}").exists(), "the kernel to be gone with its sandbox")


async def test_the_async_sdk(code_env: Server) -> None:
    sandbox = await AsyncSandbox.create()
    try:
        out: list[str] = []
        await sandbox.run_code("x = 21")
        execution = await sandbox.run_code("print('async'); x * 2", on_stdout=lambda m: out.append(m.line))
        assert execution.text == "42" and out == ["async\n"]
        failed = await sandbox.run_code("1/0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        figure = await sandbox.run_code(
            "import matplotlib.pyplot as plt\nplt.bar([1, 2], [3, 4])\nplt.show()"
        )
        pngs = [r.png for r in figure.results if r.png]
        assert pngs, (figure.results, figure.logs, figure.error)  # what came instead, if it fails
        assert base64.b64decode(pngs[0]).startswith(PNG_SIGNATURE)
        context = await sandbox.create_code_context()
        assert context.id in [c.id for c in await sandbox.list_code_contexts()]
        await sandbox.run_code("kept = 1", context=context)
        await sandbox.restart_code_context(context)
        gone = await sandbox.run_code("kept", context=context)
        assert gone.error is not None and gone.error.name == "NameError"
        await sandbox.remove_code_context(context)
        with pytest.raises(NotFoundException):
            await sandbox.run_code("1", context=context)
    finally:
        await sandbox.kill()


def test_an_output_flood_ends_with_the_limit_error(sbx: Sandbox) -> None:
    context = sbx.create_code_context()
    sbx.run_code("kept = 7", context=context)
    flood = sbx.run_code("while True: print('z' * 65536)", context=context)
    assert flood.error is not None and flood.error.name == "OutputLimitExceeded"
    assert str(MAX_OUTPUT_BYTES) in flood.error.value and "state is gone" not in flood.error.value
    assert sum(map(len, flood.logs.stdout)) <= MAX_OUTPUT_BYTES
    kept = sbx.run_code("kept", context=context)
    assert kept.text == "7", kept.logs.stderr


def test_the_readmes_code_interpreter_example(code_env: Server) -> None:
    out = python(block("from e2b_code_interpreter import Sandbox").text, code_env)
    assert out.splitlines() == ["42", "['text', 'png']", "'/tmp'", "[ 21, 42 ]"], out


# ------------------------------------------------------------------ JavaScript, on Deno's kernel


def test_javascript_contexts_keep_state_and_js_names_javascript(sbx: Sandbox) -> None:
    context = sbx.create_code_context(language="js")
    assert context.language == "javascript"  # as E2B's server names it
    assert context.id in [c.id for c in sbx.list_code_contexts()]
    assert sbx.run_code("let x = 21", context=context).error is None
    execution = sbx.run_code("x * 2", context=context)
    assert (execution.text, execution.error) == ("42", None)
    assert execution.execution_count == 2
    # Without a context, `js` and `javascript` share the language's default context.
    sbx.run_code("const shared = 'default'", language="js")
    assert sbx.run_code("shared", language="javascript").text == '"default"'
    assert sbx.run_code("await new Promise((r) => setTimeout(() => r(7), 50))", language="js").text == "7"
    sbx.remove_code_context(context)


def test_a_javascript_error_has_its_name_value_and_stack(sbx: Sandbox) -> None:
    seen = []
    execution = sbx.run_code("null.boom", language="javascript", on_error=seen.append)
    assert execution.error is not None and execution.error.name == "TypeError"
    assert "null" in execution.error.value and "TypeError" in execution.error.traceback
    assert seen == [execution.error]
    thrown = sbx.run_code("throw new RangeError('too far')", language="js").error
    assert thrown is not None and (thrown.name, thrown.value) == ("RangeError", "too far")


def test_javascript_console_streams_and_rich_results(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    execution = sbx.run_code(
        "console.log('one'); console.error('two'); console.log('three'); ({a: 1})",
        language="js",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert ("".join(out), "".join(err)) == ("one\nthree\n", "two\n")
    assert execution.text == "{ a: 1 }" and execution.results[0].is_main_result
    html = sbx.run_code("Deno.jupyter.html`<i>rich</i>`", language="js")
    assert html.results[0].html == "<i>rich</i>"


def test_a_fast_printing_javascript_cell_keeps_all_its_output(sbx: Sandbox) -> None:
    context = sbx.create_code_context(language="js")
    flood = sbx.run_code(f"for (let i = 0; i < {JS_FLOOD_LINES}; i++) console.log(i)", context=context)
    lines = "".join(flood.logs.stdout).splitlines()
    assert lines == [str(i) for i in range(JS_FLOOD_LINES)]
    after = sbx.run_code("'after'", context=context)
    assert (after.logs.stdout, after.text) == ([], '"after"')  # none of the flood's lines came late
    # A cell that silences the console (a test's mock) leaves the fence that marks the end of
    # each cell's output working: the next cells still end at once, with their output.
    sbx.run_code("console.log = () => {}; console.error = () => {}", context=context)
    started = time.monotonic()
    quiet = sbx.run_code("3", context=context)
    assert (quiet.logs.stdout, quiet.logs.stderr, quiet.text) == ([], [], "3")
    assert time.monotonic() - started < SDK_TIMEOUT
    sbx.remove_code_context(context)


def test_javascript_runs_inside_the_sandbox_with_envs(sbx: Sandbox, code_env: Server) -> None:
    code = "[Deno.hostname(), Deno.cwd(), (() => { try { Deno.statSync(%r); return true } catch { return false } })()]"
    inside = sbx.run_code(code % str(code_env.home), language="js").text
    hostname = sbx.commands.run("hostname").stdout.strip()
    assert inside == f'[ "{hostname}", "/workspace", false ]'  # the server's home is not there
    env = sbx.run_code("Deno.env.get('ONLY_HERE')", language="js", envs={"ONLY_HERE": "yes"})
    assert env.text == '"yes"'
    assert sbx.run_code("Deno.env.get('ONLY_HERE') === undefined", language="js").text == "true"


def test_a_javascript_cell_past_its_timeout_ends_its_context_state(sbx: Sandbox) -> None:
    context = sbx.create_code_context(language="js")
    sbx.run_code("var kept = 5", context=context)
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", context=context, timeout=SDK_TIMEOUT)
    assert time.monotonic() - started < SDK_TIMEOUT + 5
    # Deno's kernel exits on the interrupt: the context goes on with a fresh kernel, and says so.
    after = sbx.run_code("typeof kept", context=context)
    assert after.text == '"undefined"' and "state is gone" in "".join(after.logs.stderr)
    sbx.remove_code_context(context)


def test_a_language_without_a_kernel_in_the_image_is_an_e2b_error(sbx: Sandbox, code_env: Server) -> None:
    with pytest.raises(SandboxException, match="400") as refused:
        sbx.create_code_context(language="r")
    assert "no Jupyter kernel 'ir' for r" in str(refused.value)
    with pytest.raises(SandboxException, match="no Jupyter kernel 'ir' for r"):
        sbx.run_code("1", language="r")
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(JUPYTER_PORT),
               "X-Access-Token": sbx._envd_access_token or ""}  # fmt: skip
    reply = httpx.post(code_env.url + "/contexts", json={"language": "r"}, headers=headers)
    assert reply.status_code == 400 and set(reply.json()) == {"code", "message"}
