"""AIO `/v1/bash/*`: commands with separate stdout and stderr, read by byte offsets.

Backed by the sandbox's `CommandManager`: every command is a fresh `/bin/sh -c` in its own
process group, started in its session's working directory. A session is that directory
plus bookkeeping, not a live shell, so `cd` and `export` do not carry over from one command
to the next; use `exec_dir` (which also moves the session, as upstream documents) and `env`
(this command only). Statuses are `commands.BASH_STATUS`; `pending` never occurs, since a
command exists only once its process does.

Choices where upstream is silent:

- stdin stays open as a pipe for every command, so `/v1/bash/write` can feed it; a command
  that reads stdin waits for that input (or for `timeout` / `hard_timeout`).
- A sync `exec` without `timeout` waits until the command ends, at most SYNC_WAIT_CAP seconds,
  then answers `running` (the command carries on; read it with `/v1/bash/output`).
- `kill` of a session with no running command answers the last command as it is; the
  kill is idempotent, not an error.
- `sessions/create` with the id of an existing session answers that session.
- `snapshot_path` (restoring a saved shell) has no meaning without a live shell: refused.
- bash and shell sessions live in one namespace (the manager's), so each group's session
  list shows the other's sessions too.
"""

from __future__ import annotations

import errno
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox.api.envelope import json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox, Sandbox
from agentbox.api.schemas import v1_reply
from agentbox.machines.base import Machine
from agentbox.timestamps import timestamp
from agentbox.workspace.commands import (
    BASH_STATUS,
    KILL_SIGNALS,
    MAX_TIMEOUT_SECONDS,
    Command,
    OutputBuffer,
    ShellSession,
)
from agentbox.workspace.errors import WorkspaceError, bad_request, operation

router = APIRouter(prefix="/v1/bash", tags=["bash"])

#: Characters of stdout (and of stderr) a sync `exec` answers when the caller names no
#: `max_output_length` (upstream's default); 0 turns truncation off.
DEFAULT_MAX_OUTPUT_LENGTH = 50_000
#: Longest a sync `exec` without `timeout` waits for its command (the manager's own ceiling).
SYNC_WAIT_CAP = MAX_TIMEOUT_SECONDS
#: Longest one long-poll (`output` with `wait`) blocks, so that it answers before the AIO
#: SDK's 60-second request timeout.
MAX_LONG_POLL_SECONDS = 50.0
#: `wait_timeout` of `output` when the caller names none (upstream's default).
DEFAULT_OUTPUT_WAIT_SECONDS = 30.0
#: How long `kill` waits for the command to end, so that its answer can say how it ended.
KILL_WAIT_SECONDS = 5.0


# ---------------------------------------------------------------- shared with /v1/shell


def middle_truncate(text: str, limit: int) -> str:
    """`text` cut to its first and last `limit / 2` characters around a marker; 0 = no limit."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    dropped = len(text) - limit
    return f"{text[:head]}\n[... {dropped} characters truncated ...]\n{text[len(text) - tail :]}"


def stream_text(buffer: OutputBuffer) -> tuple[str, int]:
    """All of a stream as text, and the offset the next `/output` read should start from.

    While the stream is open, an incomplete UTF-8 character at its end is left for that
    next read rather than mangled here.
    """
    if buffer.closed or buffer.truncated:
        return buffer.text(), buffer.total
    part = buffer.read(0)
    return part.data.decode("utf-8", "replace"), part.next_offset


async def directory(machine: Machine, path: str, op: str) -> str:
    """`path` as an absolute inside path, which must be an existing directory."""
    with operation(op, path):
        info = await machine.stat(path)
    if info is None:
        raise WorkspaceError(
            "not_found", f"Failed to {op}: no such directory {path}", op, path,
            errno.ENOENT, "ENOENT", "FileNotFoundError",
        )  # fmt: skip
    if not info.is_dir:
        raise WorkspaceError(
            "invalid_target", f"Failed to {op}: not a directory: {path}", op, path,
            errno.ENOTDIR, "ENOTDIR", "NotADirectoryError",
        )  # fmt: skip
    return info.path


async def session_for(sb: Sandbox, session_id: str | None, working_dir: str | None = None) -> ShellSession:
    """The named session (created on first use, in `working_dir` or the machine root), or a new one."""
    if session_id is not None:
        existing = next((s for s in sb.commands.sessions() if s.session_id == session_id), None)
        if existing is not None:
            return existing
    return await sb.commands.open_session(session_id, working_dir)


def check_wait(seconds: float | None, name: str) -> None:
    if seconds is not None and not 0 <= seconds <= MAX_TIMEOUT_SECONDS:
        raise bad_request(
            "exec", f"{name} must be between 0 and {MAX_TIMEOUT_SECONDS:g} seconds, got {seconds}"
        )


# ---------------------------------------------------------------- bodies


class ExecBody(BaseModel):
    command: str
    session_id: str | None = None
    exec_dir: str | None = None
    env: dict[str, str | None] | None = None
    async_mode: bool | None = None
    timeout: float | None = None
    hard_timeout: float | None = None
    max_output_length: int | None = None


class OutputBody(BaseModel):
    session_id: str
    command_id: str | None = None
    offset: int | None = None
    stderr_offset: int | None = None
    wait: bool | None = None
    wait_timeout: float | None = None


class WriteBody(BaseModel):
    session_id: str
    input: str
    command_id: str | None = None


class KillBody(BaseModel):
    session_id: str
    signal: str | None = None


class CreateSessionBody(BaseModel):
    session_id: str | None = None
    exec_dir: str | None = None
    snapshot_path: str | None = None


# ---------------------------------------------------------------- replies (`data` of each route)


class BashCommand(BaseModel):
    command_id: str
    command: str
    status: str
    exit_code: int | None


class BashResult(BashCommand):
    session_id: str
    stdout: str
    stderr: str
    offset: int
    stderr_offset: int


class BashOutput(BaseModel):
    """Output past the offsets; `skipped` and `stderr_skipped` once a command has run."""

    session_id: str
    stdout: str
    stderr: str
    offset: int
    stderr_offset: int
    skipped: int | None = None
    stderr_skipped: int | None = None
    command: BashCommand | None


class BashWritten(BaseModel):
    session_id: str
    command_id: str
    bytes_written: int


class BashKilled(BaseModel):
    session_id: str
    signal: str | None
    killed: bool
    command: BashCommand | None


class BashSession(BaseModel):
    session_id: str
    status: str
    working_dir: str
    created_at: str
    last_used_at: str
    current_command: str | None
    command_count: int


# ---------------------------------------------------------------- shapes


def command_info(cmd: Command) -> dict[str, Any]:
    return {
        "command_id": cmd.id,
        "command": cmd.command,
        "status": BASH_STATUS[cmd.status],
        "exit_code": cmd.exit_code,
    }


def exec_result(session_id: str, cmd: Command, max_output_length: int) -> dict[str, Any]:
    stdout, offset = stream_text(cmd.stdout)
    stderr, stderr_offset = stream_text(cmd.stderr)
    return {
        "session_id": session_id,
        **command_info(cmd),
        "stdout": middle_truncate(stdout, max_output_length),
        "stderr": middle_truncate(stderr, max_output_length),
        "offset": offset,
        "stderr_offset": stderr_offset,
    }


def session_info(session: ShellSession) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "status": session.status,
        "working_dir": session.working_dir,
        "created_at": timestamp(session.created_at),
        "last_used_at": timestamp(session.last_used_at),
        "current_command": session.current_command,
        "command_count": session.command_count,
    }


# ---------------------------------------------------------------- routes


@router.post("/exec", openapi_extra=json_body(ExecBody), response_model=v1_reply(BashResult))
async def exec_command(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Run a command; answer when it ends, when `timeout` passes (`running`), or at once (`async_mode`)."""
    body = await parse_body(request, ExecBody)
    check_wait(body.timeout, "timeout")
    cwd = await directory(sb.machine, body.exec_dir, "exec") if body.exec_dir is not None else None
    session = await session_for(sb, body.session_id, cwd)
    if cwd is not None:
        session.working_dir = cwd
    cmd = await sb.commands.start(
        body.command, env=body.env, timeout=body.hard_timeout, session_id=session.session_id, stdin=True
    )
    limit = DEFAULT_MAX_OUTPUT_LENGTH if body.max_output_length is None else body.max_output_length
    if body.async_mode:
        return ok(exec_result(session.session_id, cmd, 0))
    await sb.commands.wait(cmd.id, SYNC_WAIT_CAP if body.timeout is None else body.timeout)
    return ok(exec_result(session.session_id, cmd, limit))


@router.post("/output", openapi_extra=json_body(OutputBody), response_model=v1_reply(BashOutput))
async def output(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Output of a session's command (its newest by default) past byte offsets, optionally long-polled."""
    body = await parse_body(request, OutputBody)
    session = sb.commands.session(body.session_id)
    offset, stderr_offset = body.offset or 0, body.stderr_offset or 0
    if body.command_id is None and session.last_command_id is None:
        empty = {
            "stdout": "",
            "stderr": "",
            "offset": offset,
            "stderr_offset": stderr_offset,
            "command": None,
        }
        return ok({"session_id": session.session_id, **empty})
    cmd = sb.commands.session_command(session.session_id, body.command_id)
    if body.wait:
        wait = DEFAULT_OUTPUT_WAIT_SECONDS if body.wait_timeout is None else body.wait_timeout
        check_wait(wait, "wait_timeout")
        await sb.commands.wait_output(cmd.id, offset, stderr_offset, min(wait, MAX_LONG_POLL_SECONDS))
    out, err = cmd.stdout.read(offset), cmd.stderr.read(stderr_offset)
    return ok(
        {
            "session_id": session.session_id,
            "stdout": out.data.decode("utf-8", "replace"),
            "stderr": err.data.decode("utf-8", "replace"),
            "offset": out.next_offset,
            "stderr_offset": err.next_offset,
            "skipped": out.skipped,
            "stderr_skipped": err.skipped,
            "command": command_info(cmd),
        }
    )


@router.post("/write", openapi_extra=json_body(WriteBody), response_model=v1_reply(BashWritten))
async def write(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Write `input` as given (no newline added) to the stdin of a session's running command."""
    body = await parse_body(request, WriteBody)
    cmd = sb.commands.session_command(body.session_id, body.command_id)
    data = body.input.encode("utf-8")
    await sb.commands.write_stdin(cmd.id, data)
    return ok({"session_id": body.session_id, "command_id": cmd.id, "bytes_written": len(data)})


@router.post("/kill", openapi_extra=json_body(KillBody), response_model=v1_reply(BashKilled))
async def kill(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Signal the process group of the session's running command and say how it ended."""
    body = await parse_body(request, KillBody)
    name = (body.signal or "SIGTERM").upper()
    if name not in KILL_SIGNALS:
        raise bad_request("kill", f"signal must be one of {', '.join(KILL_SIGNALS)}, got {body.signal!r}")
    session = sb.commands.session(body.session_id)
    running = session.current_command_id
    if running is None:
        last = session.last_command_id
        info = command_info(sb.commands.get(last)) if last is not None else None
        return ok(
            {"session_id": session.session_id, "signal": None, "killed": False, "command": info},
            message="No running command in this session",
        )
    sb.commands.kill(running, KILL_SIGNALS[name])
    cmd = await sb.commands.wait(running, KILL_WAIT_SECONDS)
    return ok(
        {"session_id": session.session_id, "signal": name, "killed": True, "command": command_info(cmd)}
    )


@router.get("/sessions", response_model=v1_reply(list[BashSession]))
async def sessions(sb: CurrentSandbox) -> JSONResponse:
    return ok([session_info(s) for s in sb.commands.sessions()])


@router.post(
    "/sessions/create", openapi_extra=json_body(CreateSessionBody), response_model=v1_reply(BashSession)
)
async def create_session(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, CreateSessionBody)
    if body.snapshot_path is not None:
        raise bad_request("session", "snapshot_path is not supported: sessions have no live shell to restore")
    cwd = await directory(sb.machine, body.exec_dir, "session") if body.exec_dir is not None else None
    return ok(session_info(await session_for(sb, body.session_id, cwd)))


@router.post("/sessions/{bash_session_id}/close", response_model=v1_reply(BashSession))
async def close_session(bash_session_id: str, sb: CurrentSandbox) -> JSONResponse:
    """Kill the session's running commands and forget it (its commands stay readable by id)."""
    return ok(session_info(sb.commands.close_session(bash_session_id)))
