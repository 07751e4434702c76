"""The code interpreter (`agentbox.workspace.kernels`) on a real sandbox with a Jupyter kernel.

Every context is a real ipykernel inside a bubblewrap sandbox on the `kernel` test image;
each limit is given small to the interpreter and tested on both sides of its boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from conftest import (
    KERNEL_IMAGE,
    host_pid_of,
    image_sandbox_host,
    sandbox_factory,
    traversable,
)

from agentbox.machines.base import STREAM_BUFFER, ExecRequest
from agentbox.machines.images import Image
from agentbox.machines.sandbox import SandboxConfig, SandboxMachine
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.kernels import (
    MAX_CODE_BYTES,
    MAX_LINE_BYTES,
    RUNNER_SOURCE,
    CodeInterpreter,
    Context,
    Output,
    lines,
)

#: Seconds a condition (a kernel stopped when idle) may take before a test fails.
DEADLINE_SECONDS = 20.0
POLL_SECONDS = 0.1
#: The small limits the tests give the interpreter.
OUTPUT_LIMIT = 1000
EXECUTION_SECONDS = 2.0
#: Seconds a cell the tests time out would run for.
LONG_SLEEP = 60
#: Failed cells each followed at once by another, in the test of what follows an error.
AFTER_ERROR_ROUNDS = 3
#: Seconds ipykernel would abort requests for after an error, in that test (its default is 0).
ABORT_WINDOW_SECONDS = 1.0
#: Seconds a flood runs while nothing reads the runner, so the kernel's IOPub backlog builds.
BACKLOG_SECONDS = 1.0
#: Characters of each line the flood below prints (one IOPub message each, about).
FLOOD_LINE = 65536
#: Stream lines of an interrupted execution that may still come: what the server buffers
#: unread (2 x STREAM_BUFFER) and the pipe's 64 KiB, with a few the runner relays before its
#: request thread reads the interrupt. The backlog itself is up to thousands.
MOST_RELAYED_AFTER_INTERRUPT = (2 * STREAM_BUFFER + 65536) // FLOOD_LINE + 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def box(kernel_image: Image, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxMachine]:
    """One started sandbox on the kernel image, network off, stopped after the module."""
    host = image_sandbox_host(kernel_image, tmp_path_factory)
    make, made = sandbox_factory(host, traversable(tmp_path_factory.mktemp("kernel-box"), tmp_path_factory))
    try:
        yield await make(SandboxConfig(network=False, image=KERNEL_IMAGE, image_required=True))
    finally:
        for started in made:
            await started.stop()


async def outputs(interpreter: CodeInterpreter, context: Context, code: str) -> list[Output]:
    return [o async for o in interpreter.run(context, code)]


def value(outs: list[Output]) -> str | None:
    """The cell's value as text (its main result's `text/plain`)."""
    return next((o.data.get("text/plain") for o in outs if o.kind == "result" and o.main), None)


def errors(outs: list[Output]) -> list[Output]:
    return [o for o in outs if o.kind == "error"]


def stdout(outs: list[Output]) -> str:
    return "".join(o.text for o in outs if o.kind == "stdout")


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {DEADLINE_SECONDS}s for {what}")
        await asyncio.sleep(POLL_SECONDS)


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_state_stays_in_a_context_and_not_across_contexts(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        first = await interpreter.create()
        assert errors(await outputs(interpreter, first, "x = 21")) == []
        assert value(await outputs(interpreter, first, "x * 2")) == "42"
        other = await interpreter.create()
        failed = errors(await outputs(interpreter, other, "x"))
        assert [e.name for e in failed] == ["NameError"]
        assert any("x" in line for line in failed[0].traceback)
        assert [c.id for c in interpreter.list()] == [first.id, other.id]
    finally:
        await interpreter.close()


async def test_a_kernel_that_died_is_replaced_and_the_next_cell_is_told(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        context = await interpreter.create()
        assert errors(await outputs(interpreter, context, "x = 21")) == []
        died = await outputs(interpreter, context, "import os; os._exit(3)")
        assert [e.name for e in errors(died)] == ["KernelDied"]
        after = await outputs(interpreter, context, "x")
        notice = "".join(o.text for o in after if o.kind == "stderr")
        assert "kernel had exited; a new one was started: its state is gone" in notice
        assert [e.name for e in errors(after)] == ["NameError"]
        quiet = await outputs(interpreter, context, "1 + 1")
        assert value(quiet) == "2" and not [o for o in quiet if o.kind == "stderr"]
    finally:
        await interpreter.close()


async def test_the_kernel_runs_inside_the_sandbox_and_dies_with_it(
    kernel_image: Image, tmp_path_factory: pytest.TempPathFactory
) -> None:
    host = image_sandbox_host(kernel_image, tmp_path_factory)
    make, made = sandbox_factory(host, traversable(tmp_path_factory.mktemp("kernel-dies"), tmp_path_factory))
    machine = await make(SandboxConfig(network=False, image=KERNEL_IMAGE, image_required=True))
    interpreter = CodeInterpreter(machine)
    try:
        context = await interpreter.create()
        code = "import os, socket; (os.getpid(), os.stat('/proc/self/ns/pid').st_ino, socket.gethostname(), os.getcwd())"
        pid, namespace, hostname, cwd = eval(value(await outputs(interpreter, context, code)) or "")
        inside = await machine.exec(ExecRequest(command="hostname; stat -Lc %i /proc/self/ns/pid"))
        assert inside.stdout.decode().split() == [hostname, str(namespace)]
        assert cwd == machine.root and namespace != os.stat("/proc/self/ns/pid").st_ino
        kernel_on_host = host_pid_of(pid, namespace)
        assert kernel_on_host is not None
        await machine.stop()
        await until(
            lambda: not Path(f"/proc/{kernel_on_host}").exists(), "the kernel to be gone with its sandbox"
        )
        await until(lambda: context.kernel is None or not context.kernel.alive, "the runner to see its end")
    finally:
        await interpreter.close()
        for m in made:
            await m.stop()


async def test_results_carry_rich_outputs_streams_and_errors(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        context = await interpreter.create()
        figure = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
        shown = [o for o in await outputs(interpreter, context, figure) if o.kind == "result"]
        assert shown and "image/png" in shown[0].data and not shown[0].main
        html = await outputs(interpreter, context, "from IPython.display import HTML; HTML('<b>hi</b>')")
        assert [o.data.get("text/html") for o in html if o.main] == ["<b>hi</b>"]
        mixed = await outputs(interpreter, context, "import sys; print('out'); print('err', file=sys.stderr)")
        assert stdout(mixed) == "out\n" and [o.text for o in mixed if o.kind == "stderr"] == ["err\n"]
        raw = await outputs(interpreter, context, "import os; os.write(1, b'raw fd\\n'); None")
        assert "raw fd" in stdout(raw)  # relayed by the kernel, never written on the runner's channel
        division = errors(await outputs(interpreter, context, "1/0"))
        assert [(e.name, e.value) for e in division] == [("ZeroDivisionError", "division by zero")]
        assert any("ZeroDivisionError" in line for line in division[0].traceback)
    finally:
        await interpreter.close()


async def test_at_most_max_contexts(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box, max_contexts=2)
    try:
        first = await interpreter.create()
        await interpreter.create()
        with pytest.raises(WorkspaceError) as refused:
            await interpreter.create()
        assert refused.value.error_type == "capacity_exceeded"
        await interpreter.remove(first.id)
        await interpreter.create()
        assert len(interpreter.list()) == 2
    finally:
        await interpreter.close()


async def test_output_up_to_the_limit_passes_and_past_it_is_interrupted(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box, max_output_bytes=OUTPUT_LIMIT)
    try:
        context = await interpreter.create()
        await outputs(interpreter, context, "import sys; kept = 'still here'")
        exact = await outputs(interpreter, context, f"sys.stdout.write('a' * {OUTPUT_LIMIT}); None")
        assert errors(exact) == [] and stdout(exact) == "a" * OUTPUT_LIMIT
        started = time.monotonic()
        flood = await outputs(interpreter, context, "while True: print('b' * 100)")
        assert time.monotonic() - started < EXECUTION_SECONDS * 5
        assert [e.name for e in errors(flood)] == ["OutputLimitExceeded"]
        assert str(OUTPUT_LIMIT) in errors(flood)[0].value
        assert len(stdout(flood)) <= OUTPUT_LIMIT
        assert (
            value(await outputs(interpreter, context, "kept")) == "'still here'"
        )  # interrupted, not restarted
    finally:
        await interpreter.close()


async def test_the_cells_right_after_an_error_run(box: SandboxMachine) -> None:
    """A failed cell must not cost the next request its turn: ipykernel aborts what reaches it
    in a short window after an error when asked to stop on error, and on a busy host the next
    cell (or the restore of a cell's `env`) reached it in that window and came back empty."""
    interpreter = CodeInterpreter(box)
    try:
        context = await interpreter.create()
        # the window a busy host opens by chance, held open for every round here
        widen = f"get_ipython().kernel.stop_on_error_timeout = {ABORT_WINDOW_SECONDS}"
        await outputs(interpreter, context, f"import os; kept = 5; {widen}")
        for _ in range(AFTER_ERROR_ROUNDS):
            failed = [o async for o in interpreter.run(context, "1 / 0", env={"ONLY_FOR_THIS_CELL": "1"})]
            assert [e.name for e in errors(failed)] == ["ZeroDivisionError"]
            after = await outputs(interpreter, context, "(kept, os.environ.get('ONLY_FOR_THIS_CELL'))")
            assert value(after) == "(5, None)"
    finally:
        await interpreter.close()


async def test_a_cell_whose_idle_status_is_lost_still_ends(box: SandboxMachine) -> None:
    """IOPub drops what overflows its queues, a cell's idle status among them (a flood does
    that): the cell ends on its reply, which comes on the shell channel, instead of running
    into its time limit. Here the kernel stops publishing its status at all."""
    interpreter = CodeInterpreter(box, max_execution_seconds=EXECUTION_SECONDS * 5)
    try:
        context = await interpreter.create()
        mute = "k = get_ipython().kernel; k._publish_status = lambda *args, **kwargs: None; kept = 6"
        assert errors(await outputs(interpreter, context, mute)) == []
        started = time.monotonic()
        after = await outputs(interpreter, context, "kept * 7")
        assert value(after) == "42" and errors(after) == []
        assert time.monotonic() - started < EXECUTION_SECONDS * 5
    finally:
        await interpreter.close()


async def test_an_interrupted_flood_is_drained_unread(box: SandboxMachine) -> None:
    """The runner stops relaying an execution the server interrupted (it no longer reads it):
    after the interrupt come only the few lines already on their way, not the backlog in the
    kernel's IOPub queues (thousands of 64 KiB messages), which on a busy host took longer to
    relay than INTERRUPT_GRACE_SECONDS and so cost the context its kernel."""
    argv = ("python3", "-c", RUNNER_SOURCE, "python3", str(MAX_LINE_BYTES), "60")
    runner = await box.spawn(ExecRequest(argv=argv, cwd="/workspace", interactive=True))

    async def ask(request: dict[str, object]) -> None:
        await runner.write_stdin(json.dumps(request).encode() + b"\n")

    try:
        events = lines(runner.stdout, MAX_LINE_BYTES)
        assert json.loads(await anext(events))["event"] == "ready"
        await ask({"op": "execute", "id": 1, "code": f"while True: print('z' * {FLOOD_LINE})", "env": None})
        while json.loads(await anext(events))["event"] != "stdout":
            pass
        await asyncio.sleep(BACKLOG_SECONDS)  # the runner waits on its full pipe; the kernel floods on
        await ask({"op": "interrupt", "id": 1})
        after = 0
        while (event := json.loads(await anext(events)))["event"] != "done":
            after += event["event"] == "stdout"
        assert after <= MOST_RELAYED_AFTER_INTERRUPT
        await ask({"op": "execute", "id": 2, "code": "6 * 7", "env": None})
        replies = []
        while (event := json.loads(await anext(events)))["event"] != "done":
            replies.append(event)
        assert {"event": "result", "id": 2, "data": {"text/plain": "42"}, "main": True} in replies
    finally:
        runner.kill()
        await runner.wait()


async def test_an_execution_past_its_time_is_interrupted(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box, max_execution_seconds=EXECUTION_SECONDS)
    try:
        context = await interpreter.create()
        await outputs(interpreter, context, "import time; kept = 1")
        quick = await outputs(interpreter, context, f"time.sleep({EXECUTION_SECONDS / 4}); 'done'")
        assert value(quick) == "'done'"
        started = time.monotonic()
        slow = await outputs(interpreter, context, f"time.sleep({LONG_SLEEP})")
        took = time.monotonic() - started
        assert EXECUTION_SECONDS <= took < EXECUTION_SECONDS + 5
        assert [e.name for e in errors(slow)] == ["TimeoutError"]
        assert value(await outputs(interpreter, context, "kept + 1")) == "2"
    finally:
        await interpreter.close()


async def test_a_cell_that_ignores_the_interrupt_loses_its_kernel(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box, max_execution_seconds=EXECUTION_SECONDS)
    try:
        context = await interpreter.create()
        stubborn = f"import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); kept = 1; time.sleep({LONG_SLEEP})"
        failed = errors(await outputs(interpreter, context, stubborn))
        assert [e.name for e in failed] == ["TimeoutError"] and "state is gone" in failed[0].value
        assert [e.name for e in errors(await outputs(interpreter, context, "kept"))] == ["NameError"]
    finally:
        await interpreter.close()


async def test_a_caller_that_leaves_interrupts_the_cell(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        context = await interpreter.create()
        await outputs(interpreter, context, "import time; kept = 3")
        run = interpreter.run(context, f"print('started', flush=True); time.sleep({LONG_SLEEP})")
        assert (await anext(run)).kind == "count"
        assert (await anext(run)).text == "started\n"
        await run.aclose()
        started = time.monotonic()
        assert value(await outputs(interpreter, context, "kept")) == "3"
        assert time.monotonic() - started < LONG_SLEEP / 4
    finally:
        await interpreter.close()


async def test_restart_forgets_state_and_idle_kernels_stop(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box, idle_seconds=1.0)
    try:
        context = await interpreter.create()
        await outputs(interpreter, context, "kept = 1")
        await interpreter.restart(context.id)
        assert [e.name for e in errors(await outputs(interpreter, context, "kept"))] == ["NameError"]
        await outputs(interpreter, context, "kept = 2")
        await until(lambda: interpreter.running() == 0, "the idle kernel to stop")
        assert [c.id for c in interpreter.list()] == [context.id]  # the context stays, its state does not
        assert [e.name for e in errors(await outputs(interpreter, context, "kept"))] == ["NameError"]
    finally:
        await interpreter.close()


async def test_refusals_are_typed(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        with pytest.raises(WorkspaceError) as unknown:
            interpreter.get("nope")
        assert unknown.value.error_type == "not_found"
        with pytest.raises(WorkspaceError) as language:
            await interpreter.create("cobol")
        assert language.value.error_type == "bad_request"
        with pytest.raises(WorkspaceError) as no_kernel:
            await interpreter.create("r")  # a language this image has no kernel for
        assert no_kernel.value.error_type == "bad_request" and "'ir' for r" in no_kernel.value.message
        with pytest.raises(WorkspaceError) as cwd:
            await interpreter.create(cwd="/no/such/dir")
        assert cwd.value.error_type == "not_found"
        context = await interpreter.create(cwd="/tmp")
        assert value(await outputs(interpreter, context, "import os; os.getcwd()")) == "'/tmp'"
        longest = "x = 1  #" + "a" * (MAX_CODE_BYTES - len("x = 1  #"))
        assert errors(await outputs(interpreter, context, longest)) == []
        with pytest.raises(WorkspaceError) as too_long:
            await outputs(interpreter, context, longest + "a")
        assert too_long.value.error_type == "bad_request"
        assert interpreter.list() == [context]  # the refused ones left nothing
    finally:
        await interpreter.close()


async def test_restart_and_remove_do_not_wait_for_a_running_cell(box: SandboxMachine) -> None:
    interpreter = CodeInterpreter(box)
    try:
        for stop in (interpreter.restart, interpreter.remove):
            context = await interpreter.create()
            running = asyncio.ensure_future(
                outputs(interpreter, context, f"import time; time.sleep({LONG_SLEEP})")
            )
            await until(context.lock.locked, "the cell to run")
            started = time.monotonic()
            await stop(context.id)
            assert time.monotonic() - started < LONG_SLEEP / 4
            assert [e.name for e in errors(await running)] == ["KernelDied"]
        assert value(await outputs(interpreter, interpreter.list()[0], "1 + 1")) == "2"  # the restarted one
        assert len(interpreter.list()) == 1  # the removed one is gone
    finally:
        await interpreter.close()


async def test_an_image_without_jupyter_is_kernel_unavailable(
    base_image: Image, tmp_path_factory: pytest.TempPathFactory
) -> None:
    host = image_sandbox_host(base_image, tmp_path_factory)
    make, made = sandbox_factory(host, traversable(tmp_path_factory.mktemp("no-kernel"), tmp_path_factory))
    interpreter = CodeInterpreter(await make(SandboxConfig(network=False, image="base", image_required=True)))
    try:
        with pytest.raises(WorkspaceError) as refused:
            await interpreter.create()
        assert refused.value.error_type == "kernel_unavailable" and refused.value.retryable
        assert "jupyter_client" in refused.value.message and interpreter.list() == []
    finally:
        await interpreter.close()
        for m in made:
            await m.stop()
