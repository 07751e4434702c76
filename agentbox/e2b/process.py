"""envd's `process.Process` over the machine's command manager.

A process is a command of the machine's `CommandManager` (so `/v2/commands` lists it too);
its pid is a number the sandbox's table hands out, not the kernel's. `Start` streams the
start event, stdout / stderr data as it comes, keepalives while quiet, then the end.

PTYs: `Start` with `pty` runs the command on a pseudo-terminal of `pty.size`, opened inside
the sandbox by its exec agent (`ExecRequest.pty`), as the command's controlling terminal;
its output comes as `pty` data (never stdout / stderr), under the command manager's output
caps. `SendInput` and `StreamInput` type `pty` input into it, `Update` with `pty.size`
resizes it (the command gets SIGWINCH; an `Update` without `pty` changes nothing), and
`Connect`, `List` (its config as started: the proto's `ProcessInfo` has no PTY field),
`SendSignal` and `CloseStdin` treat it as any process. Input of the other kind (`stdin` to a
PTY, `pty` to a pipe process) is FAILED_PRECONDITION, as envd refuses it; a machine whose
kind gives no terminals (ssh, local, e2b) answers UNIMPLEMENTED. Each side of a size is
1..`MAX_TERMINAL_SIDE` (the kernel's `winsize`); others are INVALID_ARGUMENT.

`StreamInput` (client streaming; the SDK's `commands.stream_input` / `pty.stream_input`):
a start event naming the process, then data events written in order and keepalives; input
before the start, or a second start, is INVALID_ARGUMENT. Input to a process that has ended
is NOT_FOUND, as envd forgets ended processes. Each message is within connectrpc's request
cap (4 MiB) and is written before the next is read, waiting for the process to take it (the
command manager's stdin timeout), so a long stream holds one message at a time.

Users: a process runs as the account the call names (`Authorization: Basic`, the SDK's
`user=`), `user` when it names none, as envd does. A sandbox has `user` (uid 1000, home
/home/user) and `root` (`machines/account.py`); another name is INVALID_ARGUMENT. Kinds
without accounts run it as their own identity. The working directory is the machine's root
(/workspace, which persists) unless `cwd` is given, not the user's home as in E2B's cloud.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from agentbox.e2b.envd_gen.process import process_pb as pr
from agentbox.e2b.envd_gen.process.process_connect import Process
from agentbox.e2b.rpc import inside_path, keepalive_of, oneof, rpc_errors, sandbox_id_of, user_of
from agentbox.e2b.sandboxes import E2BSandbox, Launched, SandboxTable
from agentbox.machines.base import MAX_TERMINAL_SIDE, TerminalSize
from agentbox.tools.services import MachineServices
from agentbox.workspace.commands import MAX_TIMEOUT_SECONDS, Command

#: The shortest deadline put on a process (a call whose timeout has all but run out), and the
#: longest (the command manager's cap).
MIN_PROCESS_SECONDS = 0.001


MAX_PROCESS_SECONDS = MAX_TIMEOUT_SECONDS


#: A process ended by signal N exits 128+N (the command manager's convention).
SIGNAL_EXIT_BASE = 128


#: E2B's signals and the ones they send.
SIGNALS = {pr.Signal.SIGKILL: signal.SIGKILL, pr.Signal.SIGTERM: signal.SIGTERM}


def process_deadline(ctx: RequestContext[Any, Any]) -> float | None:
    """The process's deadline as envd sets it: the call's timeout (`Connect-Timeout-Ms`; the SDK
    sends its command `timeout`), none without one. The stream ending sooner (the client went
    away) does not kill the process. A deadline past the command manager's cap is not put on
    the process (it is still bounded by the sandbox's lifetime)."""
    remaining = ctx.timeout_ms
    if remaining is None:
        return None
    seconds = max(remaining / 1000, MIN_PROCESS_SECONDS)
    return seconds if seconds <= MAX_PROCESS_SECONDS else None


class ProcessService(Process):
    """`process.Process` over the machine's command manager."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _opened(self, ctx: RequestContext[Any, Any]) -> tuple[E2BSandbox, MachineServices]:
        sandbox_id = sandbox_id_of(ctx)
        with rpc_errors("exec"):
            return self.table.get(sandbox_id), await self.table.services(sandbox_id)

    def _launched(self, sandbox: E2BSandbox, selector: pr.ProcessSelector | None) -> Launched:
        which = selector.selector if selector is not None else None
        pid = None
        if which is not None and which.field == "pid":
            pid = int(which.value)
        elif which is not None and which.field == "tag":
            pid = sandbox.tags.get(str(which.value))
        launched = sandbox.pids.get(pid) if pid is not None else None
        if launched is None:
            raise ConnectError(Code.NOT_FOUND, f"process {which.value if which else None!r} not found")
        return launched

    async def list(self, request: pr.ListRequest, ctx: RequestContext[Any, Any]) -> pr.ListResponse:
        sandbox, services = await self._opened(ctx)
        running = {c.id for c in services.commands.list() if not c.finished}
        return pr.ListResponse(
            processes=[
                pr.ProcessInfo(config=p.config, pid=pid, tag=p.tag)
                for pid, p in sandbox.pids.items()
                if p.command_id in running
            ]
        )

    async def start(
        self, request: pr.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.StartResponse]:
        sandbox, services = await self._opened(ctx)
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        size = terminal_size(request.pty)
        root = services.machine.root
        cwd = inside_path(root, config.cwd) if config.cwd else None
        stdin = True if request.stdin is None else request.stdin
        line = shlex.join([config.cmd, *config.args])
        with rpc_errors("exec", cwd):
            cmd = await services.commands.start(
                # On a terminal the program itself leads the session (no shell between it and
                # its tty), so a kill of its group reaches the shell the SDK starts there.
                f"exec {line}" if size is not None else line,
                cwd=cwd,
                env=dict(config.envs),
                stdin=stdin,
                timeout=process_deadline(ctx),
                pty=size,
                user=user_of(ctx),
            )
        pid = sandbox.new_pid(Launched(cmd.id, config, request.tag))
        yield pr.StartResponse(event=started(pid))
        async for event in follow(services, cmd, 0, 0, keepalive_of(ctx)):
            yield pr.StartResponse(event=event)

    async def connect(
        self, request: pr.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pr.ConnectResponse]:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        with rpc_errors("exec"):
            cmd = services.commands.get(launched.command_id)
        pid = next(p for p, v in sandbox.pids.items() if v is launched)
        yield pr.ConnectResponse(event=started(pid))
        async for event in follow(services, cmd, cmd.stdout.total, cmd.stderr.total, keepalive_of(ctx)):
            yield pr.ConnectResponse(event=event)

    async def _running(
        self, ctx: RequestContext[Any, Any], selector: pr.ProcessSelector | None
    ) -> tuple[MachineServices, Command]:
        """The selected process's command while it runs; one that has ended is NOT_FOUND, as
        envd forgets its ended processes."""
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, selector)
        with rpc_errors("exec"):
            cmd = services.commands.get(launched.command_id)
        if cmd.finished:
            raise ConnectError(Code.NOT_FOUND, "the process has ended")
        return services, cmd

    async def send_signal(
        self, request: pr.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendSignalResponse:
        services, cmd = await self._running(ctx, request.process)
        sig = SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"signal {request.signal!r} is not one envd sends")
        with rpc_errors("kill"):
            services.commands.kill(cmd.id, sig)
        return pr.SendSignalResponse()

    async def send_input(
        self, request: pr.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pr.SendInputResponse:
        services, cmd = await self._running(ctx, request.process)
        await write_input(services, cmd, request.input)
        return pr.SendInputResponse()

    async def close_stdin(
        self, request: pr.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pr.CloseStdinResponse:
        sandbox, services = await self._opened(ctx)
        launched = self._launched(sandbox, request.process)
        with rpc_errors("stdin"):
            await services.commands.close_stdin(launched.command_id)
        return pr.CloseStdinResponse()

    async def stream_input(
        self, request: AsyncIterator[pr.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> pr.StreamInputResponse:
        """A start event naming the process, then its input in order; keepalives are skipped."""
        target: tuple[MachineServices, Command] | None = None
        async for message in request:
            event = message.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                if target is not None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "the input stream has started already")
                target = await self._running(ctx, event.value.process)
                continue
            if target is None:
                raise ConnectError(
                    Code.INVALID_ARGUMENT, "input came before the start event naming the process"
                )
            services, cmd = target
            if cmd.finished:
                raise ConnectError(Code.NOT_FOUND, "the process has ended")
            await write_input(services, cmd, event.value.input)
        if target is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "the input stream named no process")
        return pr.StreamInputResponse()

    async def update(self, request: pr.UpdateRequest, ctx: RequestContext[Any, Any]) -> pr.UpdateResponse:
        services, cmd = await self._running(ctx, request.process)
        size = terminal_size(request.pty)
        if size is None:
            return pr.UpdateResponse()  # envd's Update changes only what it names
        if cmd.pty is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the process has no pty to resize")
        with rpc_errors("resize"):
            services.commands.resize(cmd.id, size)
        return pr.UpdateResponse()


def terminal_size(pty: pr.PTY | None) -> TerminalSize | None:
    """The terminal a `pty` field asks for: None without one; its size is required."""
    if pty is None:
        return None
    if pty.size is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "pty.size is required")
    try:
        return TerminalSize(rows=pty.size.rows, cols=pty.size.cols)
    except ValueError:
        raise ConnectError(
            Code.INVALID_ARGUMENT,
            f"pty.size must be 1..{MAX_TERMINAL_SIDE} rows and cols, got {pty.size.rows}x{pty.size.cols}",
        ) from None


async def write_input(services: MachineServices, cmd: Command, given: pr.ProcessInput | None) -> None:
    """Write `stdin` input to a pipe process, `pty` input to a terminal; the other kind is refused."""
    value = given.input if given is not None else None
    if value is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "input is empty: give stdin or pty bytes")
    wanted = "pty" if cmd.pty is not None else "stdin"
    if value.field != wanted:
        raise ConnectError(
            Code.FAILED_PRECONDITION,
            f"the process {'runs' if cmd.pty else 'does not run'} on a pty: send {wanted} input",
        )
    with rpc_errors("stdin"):
        await services.commands.write_stdin(cmd.id, bytes(value.value))


def started(pid: int) -> pr.ProcessEvent:
    return pr.ProcessEvent(event=oneof("start", pr.ProcessEvent.StartEvent(pid=pid)))


async def follow(
    services: MachineServices, cmd: Command, out: int, err: int, keepalive: float
) -> AsyncIterator[pr.ProcessEvent]:
    """The command's output from these offsets as data events (a terminal's as `pty` data),
    keepalives while it is quiet, then its end."""
    out_kind = "pty" if cmd.pty is not None else "stdout"
    while True:
        with rpc_errors("exec"):
            cmd = await services.commands.wait_output(cmd.id, out, err, timeout=keepalive)
        stdout, stderr = cmd.stdout.read(out), cmd.stderr.read(err)
        out, err = stdout.next_offset, stderr.next_offset
        if stdout.data:
            yield data_event(oneof(out_kind, stdout.data))
        if stderr.data:
            yield data_event(oneof("stderr", stderr.data))
        if stdout.data or stderr.data:
            continue
        if cmd.finished:
            yield pr.ProcessEvent(event=oneof("end", ended(cmd)))
            return
        yield pr.ProcessEvent(event=oneof("keepalive", pr.ProcessEvent.KeepAlive()))


def data_event(output: Any) -> pr.ProcessEvent:
    return pr.ProcessEvent(event=oneof("data", pr.ProcessEvent.DataEvent(output=output)))


def ended(cmd: Command) -> pr.ProcessEvent.EndEvent:
    """The end as envd reports it: Go's `ProcessState.String()` in `status`."""
    code = -1 if cmd.exit_code is None else cmd.exit_code
    signalled = cmd.status in ("killed", "timed_out") and code > SIGNAL_EXIT_BASE
    status = f"signal: {signal_name(code - SIGNAL_EXIT_BASE)}" if signalled else f"exit status {code}"
    return pr.ProcessEvent.EndEvent(exit_code=code, exited=not signalled, status=status, error=cmd.error)


def signal_name(number: int) -> str:
    """The signal as Go's `ProcessState.String()` words it (`killed`, `terminated`), or its
    number for one the C library does not name."""
    described = signal.strsignal(number) if 0 < number < signal.NSIG else None
    return described.lower() if described else str(number)
