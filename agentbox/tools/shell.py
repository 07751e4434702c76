"""The `exec` tool (seed 000's `bash`, seed 001's `exec`, Flue's `bash`): one command, one result.

Each call is a fresh non-interactive shell, `bash -c` where the machine has bash (what models
write for: `[[ ]]`, arrays, `source`) and `/bin/sh -c` where it does not, so the system prompt
names the one in use (`Shell:`). It runs in its own process group, run by the
layer-2 command engine (`workspace.commands.CommandManager`): it drains both pipes to the
end whatever it keeps, kills the whole group on timeout or cancellation, and reaps what the
command left behind when it ends. No shell state carries over between calls. The engine is
the machine's own (`ctx.services.commands`, the one `/v2/commands` lists), so an agent's
commands are visible and stoppable there and bounded by its caps. Cancelling the call kills
the command and re-raises.

What the model gets back is text that keeps apart every way a command can end:

    Exit code: 0 / Exit code: 2              ended by itself (is_error when not 0)
    ... killed by signal 9 (SIGKILL)         something killed it (exit 128+N)
    Command timed out after N seconds ...    our deadline: exit 124 (Flue's convention)
    Command was cancelled ...                stopped from outside before it ended
    <stdout> ... </stdout>, <stderr> ...     each stream, or `(no output)` when both are empty

Output is shown by its tail (errors and final results live there), at most
`TAIL_MAX_LINES` lines and `TAIL_MAX_BYTES` bytes over both streams. When anything is cut,
a marker says so with totals and names a file inside the machine holding everything that
was captured (`OUTPUT_DIR/<command id>.stdout|.stderr`), so the model can read or grep it.
The engine keeps at most `MAX_CAPTURE_BYTES` over both streams together (each stream's first
64 KiB and the latest rest, the longer tail giving way first); beyond that the marker also
says how many bytes in the middle were dropped.

Secrets: a sandbox's environment is already clean (nothing of the server's leaks in), but
a machine injects its configured variables (env providers) into every command. Variables
whose names look secret (`SECRET_ENV_PATTERN`) are removed for tool commands unless the
session allows them by name (`ToolConfig.exec_env_allow`). `Machine` has no way to drop a
variable it injects, so the command is started as `exec env -u NAME ... <shell> -c <command>`.
With nothing to drop, the shell is spawned as `<shell> -c <command>` with no `/bin/sh` in
front: each program a sandbox starts costs a loader run (and bash its locale files), so the
hop is worth skipping.
"""

from __future__ import annotations

import re
import shlex
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from agentbox.machines.base import ExecRequest, Machine
from agentbox.workspace.commands import MAX_BUFFERED_OUTPUT, Command, CommandManager, OutputBuffer
from agentbox.workspace.errors import WorkspaceError

from .base import Action, Tool, ToolContext, ToolParams, ToolResult

#: Deadline when the model gives none (seed 001: 120 s).
DEFAULT_TIMEOUT_SECONDS = 120
#: Shortest deadline a call may ask for (seed 001: 5 s).
MIN_TIMEOUT_SECONDS = 5
#: Longest deadline a call may ask for (seed 001: 1800 s).
MAX_TIMEOUT_SECONDS = 1800
#: Bytes kept by the command engine over stdout and stderr together (seed 001: 1 MiB); the
#: pipes keep draining past it and the middle of the output is what gets dropped.
MAX_CAPTURE_BYTES = MAX_BUFFERED_OUTPUT
#: Lines of output shown to the model, over both streams, taken from the end (Flue c.2).
TAIL_MAX_LINES = 2000
#: UTF-8 bytes of output shown to the model, over both streams, taken from the end (Flue c.2).
TAIL_MAX_BYTES = 50 * 1024
#: Exit code reported for a command our deadline killed (Flue: a timeout is a result, 124).
TIMEOUT_EXIT_CODE = 124
#: Folder inside the machine where the full captured output of a cut result is saved; it is
#: per sandbox lifetime (/tmp resets when a sandbox is rebuilt, seed 000).
OUTPUT_DIR = "/tmp/agentbox-output"
#: The shell `exec` prefers, looked up in the machine (`Machine.find_program`).
PREFERRED_SHELL = "bash"
#: The shell of a machine without the preferred one (POSIX: every machine has it).
FALLBACK_SHELL = "/bin/sh"
#: Variable names treated as secrets (case-insensitive, anywhere in the name); `AUTHOR`
#: (GIT_AUTHOR_NAME) is not a secret.
SECRET_ENV_PATTERN = re.compile(
    r"KEY|TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH(?!OR)|PRIVATE|COOKIE", re.I
)

DESCRIPTION = (
    "Run a shell command in the machine (`bash -c`, or `/bin/sh -c` where the machine has no bash: the "
    "system prompt's Shell line says which), non-interactively, in a fresh process each time "
    "(no shell state, `cd` or `export` carries over; use `cwd` for the working directory, default the "
    f"workspace root). `timeoutSeconds` is the deadline ({MIN_TIMEOUT_SECONDS}-{MAX_TIMEOUT_SECONDS}, "
    f"default {DEFAULT_TIMEOUT_SECONDS}); on timeout the command and everything it started is killed and "
    f"the result says so with exit code {TIMEOUT_EXIT_CODE}. The result gives the exit code, then stdout "
    f"and stderr separately; only the last {TAIL_MAX_LINES} lines / {TAIL_MAX_BYTES // 1024} KB are shown, "
    "and when output is cut a marker names a file holding the full output: read or grep that file instead "
    "of re-running the command. Do not start servers or other background processes that must outlive the "
    "command: they are killed when it ends. Commands cannot answer password prompts."
)


class ExecParams(ToolParams):
    command: str = Field(
        description="The command line, run with the machine's shell (`bash -c` or `/bin/sh -c`)."
    )
    cwd: str | None = Field(
        default=None,
        description="Working directory inside the machine (absolute, or relative to the first knowledge "
        "base's root). Default: that root (the workspace root unless the session selected others).",
    )
    timeoutSeconds: int = Field(
        default=DEFAULT_TIMEOUT_SECONDS,
        description=f"Seconds before the command is killed, {MIN_TIMEOUT_SECONDS} to {MAX_TIMEOUT_SECONDS}.",
        json_schema_extra={"minimum": MIN_TIMEOUT_SECONDS, "maximum": MAX_TIMEOUT_SECONDS},
    )


@dataclass(frozen=True)
class Shown:
    """What is shown of one stream: its tail, and what a marker needs to describe the cut."""

    name: str
    text: str
    lines: int
    total_lines: int
    total_bytes: int
    buffer: OutputBuffer

    @property
    def cut(self) -> bool:
        return self.buffer.truncated or len(self.text.encode()) < self.total_bytes


async def run_exec(ctx: ToolContext, params: ExecParams) -> ToolResult:
    timeout = params.timeoutSeconds
    if not MIN_TIMEOUT_SECONDS <= timeout <= MAX_TIMEOUT_SECONDS:
        return ToolResult.error(
            f"timeoutSeconds must be between {MIN_TIMEOUT_SECONDS} and {MAX_TIMEOUT_SECONDS}, got {timeout}."
        )
    if not params.command.strip():
        return ToolResult.error("command is empty.")
    refusal = await ctx.authorize(Action.EXEC, "exec", {"command": params.command, "cwd": params.cwd})
    if refusal is not None:
        return ToolResult.error(refusal)
    machine = ctx.machine
    cwd = working_dir(ctx, params.cwd)
    if cwd is not None:
        problem = await cwd_problem(machine, cwd)
        if problem is not None:
            return ToolResult.error(problem)
    hidden = secret_names(machine_env(machine), ctx.config.exec_env_allow)
    manager = ctx.services.commands if ctx.services is not None else CommandManager(machine)
    shell = await ctx.services.shell() if ctx.services is not None else await exec_shell(machine)
    line, argv = shell_command(params.command, shell, hidden), shell_argv(params.command, shell, hidden)
    try:
        cmd = await manager.run(line, argv=argv, cwd=cwd, timeout=timeout)
    except WorkspaceError as exc:
        if ctx.services is not None:
            ctx.services.forget_shell()  # the shell may be what is gone (nothing ran)
        return ToolResult.error(f"Could not run the command: {exc.message}")
    return await _result(machine, cmd, timeout)


def working_dir(ctx: ToolContext, cwd: str | None) -> str | None:
    """Where the command runs: `cwd` (relative ones from the first knowledge base's root), else
    that root; None when that is the machine's own default, its workspace root."""
    scope = ctx.scope
    if cwd is None:
        base = scope.base.root
        return None if base == ctx.machine.root else base
    return scope.absolute(cwd)


async def cwd_problem(machine: Machine, cwd: str) -> str | None:
    """Why `cwd` cannot be a working directory, or None (seed 001: an invalid cwd is an error)."""
    try:
        info = await machine.stat(cwd)
    except Exception as exc:  # a path the machine refuses (escape, NUL) is as good as missing
        return f"cwd {cwd!r} cannot be used: {exc}"
    if info is None:
        return f"cwd {cwd!r} does not exist."
    if not info.is_dir:
        return f"cwd {cwd!r} is not a directory."
    return None


# -- environment ------------------------------------------------------------------------


def machine_env(machine: Machine) -> dict[str, str]:
    """The variables a machine itself gives every command (its base and its env providers)."""
    return dict(machine.command_env(ExecRequest()))


def secret_names(env: Mapping[str, str], allow: Iterable[str] = ()) -> list[str]:
    """Names in `env` that look secret and are not explicitly allowed, sorted."""
    allowed = set(allow)
    return sorted(name for name in env if SECRET_ENV_PATTERN.search(name) and name not in allowed)


async def exec_shell(machine: Machine) -> str:
    """The shell `exec` runs commands with on `machine`: bash where it has one, else /bin/sh."""
    return await machine.find_program(PREFERRED_SHELL) or FALLBACK_SHELL


def shell_command(command: str, shell: str, hidden: Iterable[str] = ()) -> str:
    """What the engine's `/bin/sh -c` runs: `command` under `shell`, without the variables `hidden`.

    `exec` keeps the process (and its group) the same: the engine still kills and reaps it.
    """
    unset = " ".join(f"-u {shlex.quote(name)}" for name in hidden)
    if shell == FALLBACK_SHELL and not unset:
        return command
    return f"exec {f'env {unset} ' if unset else ''}{shlex.quote(shell)} -c {shlex.quote(command)}"


def shell_argv(command: str, shell: str, hidden: Sequence[str] = ()) -> tuple[str, ...]:
    """`command` as an argument vector the machine runs with no `/bin/sh` in front, or () when
    the engine's `/bin/sh -c` must run `shell_command` (variables to drop, or sh is the shell).

    Each program a sandbox starts pays its loader and, for bash, its locale files, so the
    `sh` that would only `exec` bash is worth skipping: what runs is the same `shell -c`,
    in the same process group, with the same environment.
    """
    if shell == FALLBACK_SHELL or hidden:
        return ()
    return (shell, "-c", command)


# -- the result -------------------------------------------------------------------------


async def _result(machine: Machine, cmd: Command, timeout: int) -> ToolResult:
    stdout, stderr = tails(cmd.stdout, cmd.stderr)
    exit_code, headline = _ending(cmd, timeout)
    parts = [headline]
    saved: dict[str, str] = {}
    for shown in (stdout, stderr):
        if not shown.total_bytes:
            continue
        marker = ""
        if shown.cut:
            path, problem = await _save(machine, cmd.id, shown)
            if path is not None:
                saved[shown.name] = path
            marker = _marker(shown, path, problem) + "\n"
        parts.append(f"<{shown.name}>\n{marker}{shown.text}\n</{shown.name}>")
    if not (stdout.total_bytes or stderr.total_bytes):
        parts.append("(no output)")
    data = {
        "command_id": cmd.id,
        "exit_code": exit_code,
        "timed_out": cmd.status == "timed_out",
        "cancelled": cmd.status == "killed",
        "stdout_truncated": stdout.cut,
        "stderr_truncated": stderr.cut,
        "output_files": saved,
        "duration": round(cmd.duration, 3),
    }
    failed = cmd.status != "completed" or exit_code != 0
    return ToolResult.error("\n".join(parts), **data) if failed else ToolResult.text("\n".join(parts), **data)


def _ending(cmd: Command, timeout: int) -> tuple[int | None, str]:
    """(exit code to report, first line of the result) for how the command ended."""
    if cmd.status == "timed_out":
        return TIMEOUT_EXIT_CODE, (
            f"Command timed out after {timeout} seconds and was killed with every process it started "
            f"(exit code {TIMEOUT_EXIT_CODE}). Output so far is below; retry with a larger timeoutSeconds "
            "or a faster command."
        )
    if cmd.status == "killed":
        return (
            cmd.exit_code,
            "Command was cancelled before it finished; it and every process it started were killed.",
        )
    if cmd.status == "failed":
        return cmd.exit_code, f"Command failed to run: {cmd.error or 'the machine stopped'}"
    code = cmd.exit_code if cmd.exit_code is not None else -1
    if code > 128 and code - 128 in signal.valid_signals():
        return code, f"Exit code: {code} (killed by signal {code - 128}, {signal.Signals(code - 128).name})"
    return code, f"Exit code: {code}"


def tails(stdout: OutputBuffer, stderr: OutputBuffer) -> tuple[Shown, Shown]:
    """The tail of each stream, sharing the line and byte budgets (each gets at least half)."""
    out_text, err_text = _text(stdout), _text(stderr)
    out_lines, err_lines = _line_count(out_text), _line_count(err_text)
    out_bytes, err_bytes = len(out_text.encode()), len(err_text.encode())
    line_budget = _shares(out_lines, err_lines, TAIL_MAX_LINES)
    byte_budget = _shares(out_bytes, err_bytes, TAIL_MAX_BYTES)
    return (
        _shown("stdout", out_text, stdout, line_budget[0], byte_budget[0]),
        _shown("stderr", err_text, stderr, line_budget[1], byte_budget[1]),
    )


def _text(buffer: OutputBuffer) -> str:
    """What was captured, trailing newline dropped (it is not worth a line of its own)."""
    text = buffer.text()
    return text[:-1] if text.endswith("\n") else text


def _line_count(text: str) -> int:
    return text.count("\n") + 1 if text else 0


def _shares(a: int, b: int, budget: int) -> tuple[int, int]:
    """Split `budget` between needs `a` and `b`: each gets up to half, and what one leaves the other may use."""
    first = min(a, budget - min(b, budget // 2))
    return first, min(b, budget - first)


def _shown(name: str, text: str, buffer: OutputBuffer, max_lines: int, max_bytes: int) -> Shown:
    total_lines = _line_count(text)
    lines = text.split("\n")[-max_lines:] if max_lines else []
    tail = "\n".join(lines)
    encoded = tail.encode()
    if len(encoded) > max_bytes:
        tail = encoded[len(encoded) - max_bytes :].decode("utf-8", "ignore")
    return Shown(name, tail, _line_count(tail), total_lines, len(text.encode()), buffer)


def _marker(shown: Shown, path: str | None, problem: str | None) -> str:
    parts = [
        f"[{shown.name} truncated: showing the last {shown.lines} of {shown.total_lines} lines "
        f"({len(shown.text.encode())} of {shown.total_bytes} bytes)"
    ]
    if shown.buffer.truncated:
        parts.append(
            f"; the command wrote {shown.buffer.total} bytes to {shown.name}, and the capture keeps "
            f"{MAX_CAPTURE_BYTES} bytes over both streams, so {shown.buffer.dropped} bytes in the middle "
            "were dropped"
        )
    if path is not None:
        parts.append(f"; full captured output saved to {path}")
    else:
        parts.append(f"; the full output could not be saved: {problem}")
    return "".join(parts) + "]"


async def _save(machine: Machine, command_id: str, shown: Shown) -> tuple[str | None, str | None]:
    """Write what was captured of a stream to `OUTPUT_DIR` inside the machine: (path, None) or (None, why)."""
    path = f"{OUTPUT_DIR}/{command_id}.{shown.name}"
    data = _captured_bytes(shown.buffer)
    try:
        await machine.mkdir(OUTPUT_DIR, parents=True)
        await machine.write(path, data)
    except Exception as exc:  # OSError or a machine error (path refused, machine down): keep the result
        return None, f"{type(exc).__name__}: {exc}"
    return path, None


def _captured_bytes(buffer: OutputBuffer) -> bytes:
    """The kept bytes as written, with a marker line where the engine dropped the middle."""
    if not buffer.truncated:
        return buffer.getvalue()
    head = buffer.read(0)
    tail = buffer.read(head.next_offset)
    return head.data + f"\n[... {buffer.dropped} bytes of output omitted ...]\n".encode() + tail.data


EXEC = Tool(
    name="exec",
    description=DESCRIPTION,
    params=ExecParams,
    action=Action.EXEC,
    run=run_exec,
    read_only=False,
    destructive=True,
)

TOOLS: dict[str, Tool] = {EXEC.name: EXEC}
