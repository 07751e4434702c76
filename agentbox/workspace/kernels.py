"""The code interpreter of a machine: stateful contexts, each a Jupyter kernel running inside it.

A context (id, language, cwd) is one kernel; what a cell defines stays for the next cell of
the same context. The kernel runs inside the machine: `kernel_runner.py` is run with the
machine's own `python3 -c` as a command of the machine (so it needs jupyter_client and the
kernel there: Debian's `python3-ipykernel` and Deno's kernelspec, in the `data` image), starts
the kernel with jupyter_client and relays its messages as JSON lines over the command's stdin
and stdout. The server never runs the cell's code, and never connects to a port the sandbox
controls.

Kernels start on a context's first execution (or its creation), and stop when the context
is removed, when the interpreter closes (its machine stops or its session goes), or after
`IDLE_SECONDS` without an execution (a running kernel would otherwise keep the sandbox
from ever being idle); a stopped context starts a new kernel, its state gone.

Limits, each a constructor parameter: `max_contexts` at once, `max_output_bytes` of output
per execution (past it the cell is interrupted and ends with an `OutputLimitExceeded`
error), `max_execution_seconds` (past it the cell is interrupted and ends with a
`TimeoutError` error). A cell that ignores the interrupt for `INTERRUPT_GRACE_SECONDS` has
its kernel stopped and the context starts over. Deno's kernel does not survive an interrupt
(it exits on SIGINT and ignores Jupyter's interrupt message): a JavaScript cell past a limit
ends its context's state, and the error says so. Failures before a cell runs are
`WorkspaceError`s: `not_found` (no such context), `bad_request` (no kernel for the
language, code too long), `capacity_exceeded` (too many contexts), `kernel_unavailable`
(the kernel could not start).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentbox.machines.base import ExecRequest, Machine, Process, inside_path
from agentbox.workspace.errors import WorkspaceError

RUNNER_SOURCE = (Path(__file__).parent / "kernel_runner.py").read_text()
#: The language a context gets when none is named, and the Jupyter kernel of each language
#: (the kernelspec the image must have: the `data` image has `python3` and Deno's `deno`).
DEFAULT_LANGUAGE = "python"
KERNELS = {
    "python": "python3",
    "javascript": "deno",
    "typescript": "deno",
    "r": "ir",
    "java": "java",
    "bash": "bash",
}
#: Other names of a language, as E2B's server reads them (a context made as `js` is `javascript`).
ALIASES = {"js": "javascript", "ts": "typescript"}
#: Contexts (kernels) a machine keeps at once.
MAX_CONTEXTS = 8
#: Bytes of output (streams, results, errors) one execution may produce.
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
#: Seconds one execution may run (E2B's default `timeout`).
MAX_EXECUTION_SECONDS = 300.0
#: Bytes of code one execution may carry.
MAX_CODE_BYTES = 1024 * 1024
#: Bytes of one line from the runner (one message: a PNG, a chunk of output) at most.
MAX_LINE_BYTES = MAX_OUTPUT_BYTES + 64 * 1024
#: Seconds a kernel gets to start and answer.
KERNEL_START_SECONDS = 60.0
#: Seconds an interrupted cell gets to stop before its kernel is stopped (and its state lost).
#: A flooding cell's queued output is drained before the kernel reports the interrupt, which
#: took over 5 s on a loaded 2-core host.
INTERRUPT_GRACE_SECONDS = 15.0
#: Seconds without an execution after which the kernels stop (their contexts stay listed).
IDLE_SECONDS = 1800.0
#: Seconds the runner gets to exit after its stdin closes before it is killed.
RUNNER_EXIT_SECONDS = 5.0
#: Bytes of the runner's (and its kernel's) stderr kept for error messages.
STDERR_TAIL_BYTES = 4096
#: Messages of one execution waiting for its caller at most (then the runner waits).
MAX_QUEUED_EVENTS = 256
#: Bytes read from the runner at a time.
READ_CHUNK = 65536
#: Bytes of a context id the interpreter makes (hex), and what an id a caller names must be.
CONTEXT_ID_BYTES = 8
CONTEXT_ID_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Kind = Literal["stdout", "stderr", "result", "error", "count"]


def language_named(language: str | None) -> str:
    """The language `language` names (`DEFAULT_LANGUAGE` when none); one without a kernel is refused."""
    name = (language or DEFAULT_LANGUAGE).strip().lower()
    name = ALIASES.get(name, name)
    if name not in KERNELS:
        known = ", ".join((*KERNELS, *ALIASES))
        raise error("bad_request", f"no kernel for language {language!r}: one of {known}")
    return name


def error(error_type: str, message: str) -> WorkspaceError:
    retryable = error_type == "kernel_unavailable"
    return WorkspaceError(
        error_type, message, "code", exception_type="CodeInterpreterError", retryable=retryable
    )


@dataclass(frozen=True)
class Output:
    """One piece of an execution's output, in the order the kernel sent it."""

    kind: Kind
    text: str = ""
    """A stream's text (stdout, stderr)."""
    data: dict[str, Any] = field(default_factory=dict)
    """A result's representations by MIME type (`text/plain`, `image/png` as base64, ...)."""
    main: bool = False
    """A result that is the cell's value (not a `display` call's)."""
    name: str = ""
    value: str = ""
    traceback: tuple[str, ...] = ()
    count: int = 0
    """The kernel's execution count (`kind == "count"`)."""
    stopped: bool = False
    """An error of the interpreter's own (a limit hit, the kernel gone), not one the code raised."""

    @staticmethod
    def failure(name: str, value: str) -> Output:
        return Output("error", name=name, value=value, stopped=True)

    def size(self) -> int:
        """Bytes it counts against the execution's output limit."""
        return (
            len(self.text)
            + len(self.name)
            + len(self.value)
            + sum(map(len, self.traceback))
            + sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in self.data.values())
        )


def output_of(event: dict[str, Any]) -> Output | None:
    """An output from a runner's event, or None for one that is not a well-formed output."""
    kind = event.get("event")
    if kind in ("stdout", "stderr") and isinstance(event.get("text"), str):
        return Output(kind, text=event["text"])
    if kind == "result" and isinstance(event.get("data"), dict):
        return Output("result", data=event["data"], main=event.get("main") is True)
    if kind == "error":
        trace = event.get("traceback")
        lines = tuple(str(t) for t in trace) if isinstance(trace, list) else ()
        return Output(
            "error", name=str(event.get("name", "")), value=str(event.get("value", "")), traceback=lines
        )
    if kind == "count" and isinstance(event.get("count"), int):
        return Output("count", count=event["count"])
    return None


class RunnerBroken(Exception):
    """The runner's output stopped being its protocol (a line past the limit)."""


async def lines(stream: asyncio.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The newline-ended lines of `stream`, each at most `limit` bytes (else `RunnerBroken`)."""
    buffer = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        start = len(buffer)
        buffer += chunk
        while (end := buffer.find(b"\n", start)) >= 0:
            yield bytes(buffer[:end])
            del buffer[: end + 1]
            start = 0
        if len(buffer) > limit:
            raise RunnerBroken(f"the kernel runner sent a line of more than {limit} bytes")


#: The end of an execution (its `done`, or the kernel gone) on its queue.
END = None


class Kernel:
    """One runner and the kernel it started: executions one at a time, interrupts at any time."""

    def __init__(self, process: Process, max_line_bytes: int) -> None:
        self.process = process
        self.max_line_bytes = max_line_bytes
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.stderr_tail = b""
        self._ids = itertools.count(1)
        self._live: dict[int, asyncio.Queue[Output | None]] = {}
        """Execution -> the queue its caller reads (until the caller leaves)."""
        self._running: dict[int, asyncio.Event] = {}
        """Execution -> set when it has ended in the kernel."""
        self._pending: list[tuple[int, Output | None]] = []
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._gone = False
        self._tasks = [
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._write()),
            asyncio.ensure_future(self._drain_stderr()),
        ]

    @classmethod
    async def start(
        cls,
        machine: Machine,
        kernel: str,
        cwd: str,
        max_line_bytes: int,
        start_seconds: float,
        language: str = "",
    ) -> Kernel:
        """Run the runner in `machine` and wait for its kernel to be ready (`language`: what the
        caller asked for, named in the refusal when the machine has no such kernel)."""
        language = f" for {language}: its image has none" if language else ""
        argv = ("python3", "-c", RUNNER_SOURCE, kernel, str(max_line_bytes), str(start_seconds))
        try:
            process = await machine.spawn(ExecRequest(argv=argv, cwd=cwd, interactive=True))
        except FileNotFoundError:
            raise error("kernel_unavailable", "the machine has no python3 to run a kernel with") from None
        self = cls(process, max_line_bytes)
        try:
            reply = await asyncio.wait_for(asyncio.shield(self.ready), start_seconds + RUNNER_EXIT_SECONDS)
        except TimeoutError as exc:
            await self.close()
            why = self.stderr_tail.decode(errors="replace").strip() or str(exc) or "it did not answer"
            raise error("kernel_unavailable", f"the {kernel} kernel did not start: {why[-1000:]}") from None
        if reply.get("event") != "ready":
            await self.close()
            if reply.get("reason") == "no_kernel":
                raise error("bad_request", f"this machine has no Jupyter kernel {kernel!r}{language}")
            said = self.stderr_tail.decode(errors="replace").strip()[-1000:]
            why = "; ".join(filter(None, (str(reply.get("message", "")), said)))
            raise error("kernel_unavailable", f"the {kernel} kernel did not start: {why}")
        return self

    @property
    def alive(self) -> bool:
        return not self._gone

    async def _read(self) -> None:
        why = "the kernel runner exited"
        try:
            async for line in lines(self.process.stdout, self.max_line_bytes):
                self._dispatch(line)
                await self._deliver()
        except Exception as exc:  # RunnerBroken, or the machine's channel broke
            why = str(exc) or why
            self.process.kill()
        finally:
            self._gone = True
            if not self.ready.done():
                self.ready.set_result({"event": "failed", "reason": "start", "message": why})
            for running in self._running.values():
                running.set()
            self._running.clear()
            for queue in self._live.values():  # no reader left to deliver it: make room, end it now
                while queue.full():
                    queue.get_nowait()
                queue.put_nowait(END)
            self._outbox.put_nowait(None)

    def _dispatch(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind = event.get("event")
        if kind in ("ready", "failed") and not self.ready.done():
            self.ready.set_result(event)
            return
        n = event.get("id")
        if not isinstance(n, int) or n not in self._running:
            return
        if kind == "done":
            self._running.pop(n).set()
            self._pending.append((n, END))
        elif kind == "oversize":
            failure = Output.failure("OutputLimitExceeded", f"one output was {event.get('bytes')} bytes")
            self._pending.append((n, failure))
        elif (output := output_of(event)) is not None:
            self._pending.append((n, output))

    async def _deliver(self) -> None:
        """Hand the dispatched outputs to their callers, waiting while a caller's queue is full;
        the outputs of an execution whose caller left are dropped."""
        pending, self._pending = self._pending, []
        for n, output in pending:
            queue = self._live.get(n)
            if queue is not None:
                await queue.put(output)

    async def _write(self) -> None:
        while (line := await self._outbox.get()) is not None:
            try:
                await self.process.write_stdin(line)
            except Exception:
                self.process.kill()
                return
        with contextlib.suppress(Exception):
            await self.process.close_stdin()

    async def _drain_stderr(self) -> None:
        with contextlib.suppress(Exception):
            while chunk := await self.process.stderr.read(READ_CHUNK):
                self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL_BYTES:]

    def _send(self, request: dict[str, Any]) -> None:
        self._outbox.put_nowait(json.dumps(request).encode() + b"\n")

    def interrupt(self, n: int) -> None:
        """Interrupt execution `n`, which nobody reads any more (KeyboardInterrupt in Python; the
        kernel keeps its state). The runner drains its output unread, so a flood ends in about
        the time the kernel takes to stop, not the time relaying its backlog would."""
        if not self._gone:
            self._send({"op": "interrupt", "id": n})

    async def settle(self, seconds: float) -> bool:
        """Wait for every execution sent to end; False when one did not within `seconds`."""
        waits = [e.wait() for e in self._running.values()]
        if not waits:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*waits), seconds)
        except TimeoutError:
            return False
        return True

    async def run(
        self, code: str, env: dict[str, str] | None, seconds: float, max_output: int
    ) -> AsyncIterator[Output]:
        """One cell's outputs until it ends, or until it hits a limit (then the last output is
        the error that says so). A caller that stops reading early interrupts the cell."""
        if self._gone:
            yield Output.failure("KernelDied", "the kernel is not running")
            return
        n = next(self._ids)
        queue: asyncio.Queue[Output | None] = asyncio.Queue(MAX_QUEUED_EVENTS)
        self._live[n], self._running[n] = queue, asyncio.Event()
        self._send({"op": "execute", "id": n, "code": code, "env": env})
        deadline = asyncio.get_running_loop().time() + seconds
        spent, ended = 0, False
        try:
            while True:
                try:
                    output = await asyncio.wait_for(queue.get(), deadline - asyncio.get_running_loop().time())
                except TimeoutError:
                    ended = True
                    message = f"the execution ran past its limit of {seconds:g} seconds and was interrupted"
                    yield await self._stop(n, Output.failure("TimeoutError", message))
                    return
                if output is END:
                    ended = True
                    if self._gone:
                        why = self.stderr_tail.decode(errors="replace").strip()[-1000:]
                        yield Output.failure(
                            "KernelDied", f"the kernel exited; its state is gone. {why}".strip()
                        )
                    return
                spent += output.size()
                if spent > max_output:
                    ended = True
                    message = (
                        f"the execution's output passed its limit of {max_output} bytes and was interrupted"
                    )
                    yield await self._stop(n, Output.failure("OutputLimitExceeded", message))
                    return
                yield output
        finally:
            if not ended:  # the caller went away: stop the cell; the next execution waits for it
                self.interrupt(n)
            self._abandon(n)

    def _abandon(self, n: int) -> None:
        """No caller reads execution `n` any more: a reader waiting for room goes on, and drops the rest."""
        queue = self._live.pop(n, None)
        while queue is not None and not queue.empty():
            queue.get_nowait()

    async def _stop(self, n: int, failure: Output) -> Output:
        """Interrupt execution `n` and wait for it to end; a kernel that does not is stopped."""
        self._abandon(n)
        self.interrupt(n)
        running = self._running.get(n)
        if running is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.wait(), INTERRUPT_GRACE_SECONDS)
        if n in self._running:
            await self.close()
            return Output.failure(
                failure.name,
                failure.value
                + "; it ignored the interrupt, so its kernel was stopped and the context's state is gone",
            )
        if self._gone:  # a kernel that an interrupt ends (Deno's): say so now, not at the next cell
            return Output.failure(
                failure.name,
                failure.value + "; its kernel exited on the interrupt and the context's state is gone",
            )
        return failure

    async def close(self) -> None:
        """Close the runner's stdin (it shuts its kernel down), then kill what is left."""
        self._gone = True
        self._outbox.put_nowait(None)
        try:
            await asyncio.wait_for(self.process.wait(), RUNNER_EXIT_SECONDS)
        except Exception:
            self.process.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.process.wait(), RUNNER_EXIT_SECONDS)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass
class Context:
    """A context of the interpreter: its kernel (None until started, or after it stopped)."""

    id: str
    language: str
    cwd: str
    kernel: Kernel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held by the execution running in it (one at a time)."""
    starting: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held while its kernel starts (an execution and a caller that waits for the kernel)."""
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    """When it was made, and when an execution in it last ended (epoch seconds)."""

    def view(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class CodeInterpreter:
    """The contexts of one machine, their kernels started on first use."""

    def __init__(
        self,
        machine: Machine,
        *,
        max_contexts: int = MAX_CONTEXTS,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        max_execution_seconds: float = MAX_EXECUTION_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
        start_seconds: float = KERNEL_START_SECONDS,
    ) -> None:
        self.machine = machine
        self.max_contexts = max_contexts
        self.max_output_bytes = max_output_bytes
        self.max_execution_seconds = max_execution_seconds
        self.idle_seconds = idle_seconds
        self.start_seconds = start_seconds
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        """Language -> the context an execution naming only the language runs in."""
        self.last_used = time.monotonic()
        self._idle: asyncio.Task[None] | None = None
        self._defaulting = asyncio.Lock()
        self._closed = False

    # ------------------------------------------------------------------ contexts

    async def create(
        self, language: str | None = None, cwd: str | None = None, context_id: str | None = None
    ) -> Context:
        """A new context (named `context_id`, else a fresh id) with its kernel started, so a
        language without one fails here."""
        if context_id is not None and not CONTEXT_ID_RULE.fullmatch(context_id):
            raise error(
                "bad_request", f"a context id is 1-64 letters, digits, '.', '_' or '-', not {context_id!r}"
            )
        language = language_named(language)
        where = await self._cwd(cwd)
        if context_id is not None and context_id in self.contexts:
            raise error("already_exists", f"context {context_id!r} exists")
        if len(self.contexts) >= self.max_contexts:
            raise error(
                "capacity_exceeded", f"at most {self.max_contexts} code contexts at once; remove one first"
            )
        context = Context(context_id or secrets.token_hex(CONTEXT_ID_BYTES), language, where)
        self.contexts[context.id] = context
        try:
            await self.started(context)
        except BaseException:
            self.contexts.pop(context.id, None)
            raise
        return context

    async def _cwd(self, cwd: str | None) -> str:
        where = inside_path(self.machine.root, cwd or self.machine.root)
        found = await self.machine.exec(ExecRequest(argv=("test", "-d", where), timeout=KERNEL_START_SECONDS))
        if found.exit_code != 0:  # asked inside: a host-files machine's stat sees only its mounts
            raise error("not_found", f"the working directory {where!r} is not a directory of this machine")
        return where

    def get(self, context_id: str) -> Context:
        context = self.contexts.get(context_id)
        if context is None:
            raise error("not_found", f"context {context_id!r} not found")
        return context

    async def context_for(self, context_id: str | None, language: str | None) -> Context:
        """The named context, else the language's default one (made on first use)."""
        if context_id:
            return self.get(context_id)
        language = language_named(language)
        async with self._defaulting:  # two first executions make one default context
            default = self.contexts.get(self.defaults.get(language, ""))
            if default is None:
                default = await self.create(language)
                self.defaults[language] = default.id
        return default

    def list(self) -> list[Context]:
        return list(self.contexts.values())

    async def restart(self, context_id: str) -> Context:
        """A fresh kernel for the context: what its cells defined is gone. A cell running in it
        is not waited for: it ends with a `KernelDied` error."""
        context = self.get(context_id)
        async with context.starting:
            await self._stop(context)
        await self.started(context)
        return context

    async def remove(self, context_id: str) -> None:
        """Forget the context and stop its kernel (a cell running in it ends with `KernelDied`)."""
        context = self.get(context_id)
        del self.contexts[context_id]
        self.defaults = {k: v for k, v in self.defaults.items() if v != context_id}
        async with context.starting:
            await self._stop(context)

    # ------------------------------------------------------------------ kernels

    async def started(self, context: Context) -> Kernel:
        """The context's running kernel, started when it has none (once, however many ask)."""
        async with context.starting:
            if self._closed:
                raise error("kernel_unavailable", "the code interpreter of this machine is closed")
            if self.contexts.get(context.id) is not context:
                raise error("not_found", f"context {context.id!r} was removed")
            if context.kernel is None or not context.kernel.alive:
                if context.kernel is not None:
                    await context.kernel.close()
                kernel_name = KERNELS[context.language]
                context.kernel = await Kernel.start(
                    self.machine,
                    kernel_name,
                    context.cwd,
                    MAX_LINE_BYTES,
                    self.start_seconds,
                    context.language,
                )
                self.last_used = time.monotonic()
                self._watch_idle()
            return context.kernel

    @staticmethod
    async def _stop(context: Context) -> None:
        if context.kernel is not None:
            kernel, context.kernel = context.kernel, None
            await kernel.close()

    async def run(
        self, context: Context, code: str, env: dict[str, str] | None = None, seconds: float | None = None
    ) -> AsyncIterator[Output]:
        """The outputs of `code` in `context`, one execution of the context at a time."""
        if len(code.encode()) > MAX_CODE_BYTES:
            raise error("bad_request", f"the code is {len(code.encode())} bytes: at most {MAX_CODE_BYTES}")
        limit = self.max_execution_seconds if seconds is None else min(seconds, self.max_execution_seconds)
        async with context.lock:
            died = context.kernel is not None and not context.kernel.alive
            kernel = await self.started(context)
            if not await kernel.settle(INTERRUPT_GRACE_SECONDS):
                await self._stop(context)  # an abandoned cell ignored its interrupt
                kernel = await self.started(context)
                yield Output(
                    "stderr",
                    text="[the previous execution ignored its interrupt; the kernel was restarted]\n",
                )
            elif not kernel.alive:  # an abandoned cell's interrupt ended its kernel (Deno's does)
                died = True
                kernel = await self.started(context)
            if died:  # never a silent loss of state: the cell below would meet a NameError
                yield Output(
                    "stderr",
                    text="[the context's kernel had exited; a new one was started: its state is gone]\n",
                )
            self.last_used = time.monotonic()
            try:
                async for output in kernel.run(code, env, limit, self.max_output_bytes):
                    yield output
            finally:
                self.last_used = time.monotonic()
                context.last_used = time.time()

    def _watch_idle(self) -> None:
        if self._idle is None or self._idle.done():
            self._idle = asyncio.ensure_future(self._stop_when_idle())

    async def _stop_when_idle(self) -> None:
        """Stop every kernel once no cell has run for `idle_seconds` (the contexts stay)."""
        while not self._closed:
            quiet = time.monotonic() - self.last_used
            if any(c.lock.locked() for c in self.contexts.values()):
                await asyncio.sleep(self.idle_seconds)  # a cell runs: it ends as a use
                continue
            if quiet < self.idle_seconds:
                await asyncio.sleep(self.idle_seconds - quiet)
                continue
            for context in list(self.contexts.values()):
                async with context.lock:
                    if time.monotonic() - self.last_used < self.idle_seconds:
                        break  # used meanwhile: watch on
                    await self._stop(context)
            else:
                return

    def running(self) -> int:
        """Kernels running now."""
        return sum(1 for c in self.contexts.values() if c.kernel is not None and c.kernel.alive)

    async def close(self) -> None:
        """Stop every kernel (the machine stops or its session goes); contexts are forgotten."""
        self._closed = True
        if self._idle is not None:
            self._idle.cancel()
        contexts, self.contexts, self.defaults = list(self.contexts.values()), {}, {}
        await asyncio.gather(*(self._stop(c) for c in contexts))  # each runner gets its grace at once
