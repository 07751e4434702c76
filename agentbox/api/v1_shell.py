"""AIO `/v1/shell/*`: terminal-style commands with one combined output and OpenHands statuses.

Upstream runs a tmux pty per session. Here, as in `/v1/bash`, each command is a fresh
`/bin/sh -c` in its session's working directory, run by the sandbox's `CommandManager`,
with its stderr joined to its stdout (`exec 2>&1` ahead of the command) so that `output`
reads the way a terminal shows it. There is no pty (programs see pipes, not a tty), no
prompt, and no shell state between commands: `cd` and `export` do not persist, `exec_dir`
does (it moves the session, as a `cd` would in a terminal). Sessions are shared with
`/v1/bash` (see there).

Statuses (`commands.SHELL_STATUS`): running, completed, hard_timeout (the `hard_timeout`
deadline passed and the command was killed), terminated (killed), and no_change_timeout: a
sync exec whose command printed nothing for `no_change_timeout` seconds answers with it
while the command keeps running (`view`, `wait`, `write`, `kill` reach it afterwards).

`/v1/shell/terminal-url` answers `success: false` with an empty string: there is no web
terminal behind this API.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal
from weakref import WeakKeyDictionary

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox.api.envelope import json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox, Sandbox
from agentbox.api.schemas import v1_reply
from agentbox.api.v1_bash import (
    KILL_WAIT_SECONDS,
    MAX_LONG_POLL_SECONDS,
    SYNC_WAIT_CAP,
    check_wait,
    directory,
    middle_truncate,
    session_for,
)
from agentbox.timestamps import timestamp
from agentbox.workspace.commands import MAX_SESSIONS, SHELL_STATUS, Command, ShellSession
from agentbox.workspace.errors import WorkspaceError, bad_request

router = APIRouter(prefix="/v1/shell", tags=["shell"])

#: Seconds without new output after which a sync exec answers `no_change_timeout`
#: (upstream's session default); a session or a command may set its own.
DEFAULT_NO_CHANGE_TIMEOUT = 120.0
#: Characters of output answered when `truncate` is on (upstream's 30 000); the middle goes.
MAX_OUTPUT_CHARS = 30_000
#: Commands of a session listed in `view`'s `console`, newest last.
CONSOLE_RECORDS = 20
#: A session used within this many seconds counts as active in `sessions/stats`.
ACTIVE_WINDOW_SECONDS = 300
#: How long `wait` waits when the caller names neither `seconds` nor `max_wait_seconds`.
DEFAULT_WAIT_SECONDS = 30.0
#: What joins a command's stderr to its stdout, in order.
JOIN_STDERR = "exec 2>&1\n"
#: The `session_timeout` of `sessions/stats`: sessions do not expire on their own.
SESSION_TIMEOUT_SECONDS = 0

#: Per-session `no_change_timeout`, set by `sessions/create` and `sessions/update`. Keyed by
#: the session object, so an entry goes when its session is closed and forgotten.
_no_change: WeakKeyDictionary[ShellSession, float] = WeakKeyDictionary()


class ExecBody(BaseModel):
    command: str
    id: str | None = None
    exec_dir: str | None = None
    async_mode: bool | None = None
    timeout: float | None = None
    strict: bool | None = None
    no_change_timeout: float | None = None
    hard_timeout: float | None = None
    preserve_symlinks: bool | None = None
    truncate: bool | None = None


class SessionBody(BaseModel):
    id: str


class WaitBody(BaseModel):
    id: str
    seconds: float | None = None
    max_wait_seconds: float | None = None


class WriteBody(BaseModel):
    id: str
    input: str
    press_enter: bool


class CreateSessionBody(BaseModel):
    id: str | None = None
    exec_dir: str | None = None
    no_change_timeout: float | None = None
    preserve_symlinks: bool | None = None


class UpdateSessionBody(BaseModel):
    id: str
    no_change_timeout: float | None = None


# ---------------------------------------------------------------- replies (`data` of each route)


class ConsoleRecord(BaseModel):
    ps1: str
    command: str
    output: str


class ShellResult(BaseModel):
    session_id: str
    command: str
    status: str
    output: str
    console: list[ConsoleRecord]
    exit_code: int | None


class ShellView(BaseModel):
    session_id: str
    output: str
    status: str
    console: list[ConsoleRecord]
    command: str | None
    exit_code: int | None


class ShellWait(BaseModel):
    status: str
    command: str | None
    exit_code: int | None


class ShellWrite(BaseModel):
    status: str
    command: str


class ShellKill(BaseModel):
    status: str
    exit_code: int | None
    returncode: int | None


class ShellCreated(BaseModel):
    session_id: str
    working_dir: str


class ShellUpdated(BaseModel):
    session_id: str
    no_change_timeout: float


class ShellSessionInfo(BaseModel):
    working_dir: str
    created_at: str
    last_used_at: str
    age_seconds: float
    status: str
    current_command: str | None


class ShellSessions(BaseModel):
    sessions: dict[str, ShellSessionInfo]


class ShellStats(BaseModel):
    total_sessions: int
    active_sessions: int
    idle_sessions: int
    max_sessions: int
    session_timeout: float
    usage_ratio: float


class ShellClosed(BaseModel):
    closed: list[str]


class NoTerminal(BaseModel):
    """`GET /v1/shell/terminal-url`: always `success: false`, with an empty string as `data`."""

    success: Literal[False]
    message: str
    data: Literal[""]
    hint: None


# ---------------------------------------------------------------- shapes


def shown_command(cmd: Command) -> str:
    return cmd.command.removeprefix(JOIN_STDERR)


def output_of(cmd: Command, truncate: bool = True) -> str:
    text = cmd.stdout.text() + cmd.stderr.text()
    return middle_truncate(text, MAX_OUTPUT_CHARS if truncate else 0)


def console_record(cmd: Command, truncate: bool = True) -> dict[str, Any]:
    return {"ps1": f"{cmd.cwd or '/'} $", "command": shown_command(cmd), "output": output_of(cmd, truncate)}


def command_result(session_id: str, cmd: Command, status: str, truncate: bool) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "command": shown_command(cmd),
        "status": status,
        "output": output_of(cmd, truncate),
        "console": [console_record(cmd, truncate)],
        "exit_code": cmd.exit_code,
    }


def session_info(session: ShellSession) -> dict[str, Any]:
    return {
        "working_dir": session.working_dir,
        "created_at": timestamp(session.created_at),
        "last_used_at": timestamp(session.last_used_at),
        "age_seconds": session.age_seconds,
        "status": "busy" if session.current_command_id else session.status,
        "current_command": session.current_command.removeprefix(JOIN_STDERR)
        if session.current_command
        else None,
    }


def check_no_change(seconds: float | None) -> float | None:
    if seconds is not None and seconds <= 0:
        raise bad_request("exec", f"no_change_timeout must be > 0 seconds, got {seconds}")
    return seconds


def last_command(sb: Sandbox, session: ShellSession) -> Command | None:
    return sb.commands.get(session.last_command_id) if session.last_command_id else None


# ---------------------------------------------------------------- waiting


async def settle(sb: Sandbox, cmd: Command, timeout: float, no_change: float) -> str:
    """Wait for `cmd` to end; `running` once `timeout` passes, `no_change_timeout` once it is quiet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    quiet_since = loop.time()
    seen = cmd.stdout.total + cmd.stderr.total
    while not cmd.finished:
        now = loop.time()
        if now >= deadline:
            return "running"
        if now >= quiet_since + no_change:
            return "no_change_timeout"
        wait = min(deadline, quiet_since + no_change) - now
        await sb.commands.wait_output(cmd.id, cmd.stdout.total, cmd.stderr.total, wait)
        total = cmd.stdout.total + cmd.stderr.total
        if total != seen:
            seen, quiet_since = total, loop.time()
    return SHELL_STATUS[cmd.status]


# ---------------------------------------------------------------- routes


@router.post("/exec", openapi_extra=json_body(ExecBody), response_model=v1_reply(ShellResult))
async def exec_command(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, ExecBody)
    check_wait(body.timeout, "timeout")
    no_change = check_no_change(body.no_change_timeout)
    cwd = None
    if body.exec_dir is not None:
        try:
            cwd = await directory(sb.machine, body.exec_dir, "exec")
        except WorkspaceError:
            if body.strict:
                raise  # otherwise the session's own directory is used, as upstream does
    session = await session_for(sb, body.id, cwd)
    if cwd is not None:
        session.working_dir = cwd
    cmd = await sb.commands.start(
        JOIN_STDERR + body.command, timeout=body.hard_timeout, session_id=session.session_id, stdin=True
    )
    truncate = body.truncate is not False
    if body.async_mode:
        return ok(command_result(session.session_id, cmd, "running", truncate))
    quiet = no_change or _no_change.get(session, DEFAULT_NO_CHANGE_TIMEOUT)
    status = await settle(sb, cmd, SYNC_WAIT_CAP if body.timeout is None else body.timeout, quiet)
    return ok(command_result(session.session_id, cmd, status, truncate))


@router.post("/view", openapi_extra=json_body(SessionBody), response_model=v1_reply(ShellView))
async def view(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """The session's newest command and its output, with the console of its recent commands."""
    body = await parse_body(request, SessionBody)
    session = sb.commands.session(body.id)
    cmd = last_command(sb, session)
    console = [c for c in sb.commands.list() if c.session_id == session.session_id][-CONSOLE_RECORDS:]
    return ok(
        {
            "session_id": session.session_id,
            "output": output_of(cmd) if cmd else "",
            "status": SHELL_STATUS[cmd.status] if cmd else "completed",
            "console": [console_record(c) for c in console],
            "command": shown_command(cmd) if cmd else None,
            "exit_code": cmd.exit_code if cmd else None,
        }
    )


@router.post("/wait", openapi_extra=json_body(WaitBody), response_model=v1_reply(ShellWait))
async def wait(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Wait up to `seconds` (at most `max_wait_seconds`) for the session's newest command to end."""
    body = await parse_body(request, WaitBody)
    session = sb.commands.session(body.id)
    seconds = next((s for s in (body.seconds, body.max_wait_seconds) if s is not None), DEFAULT_WAIT_SECONDS)
    if body.max_wait_seconds is not None:
        seconds = min(seconds, body.max_wait_seconds)
    check_wait(seconds, "seconds")
    cmd = last_command(sb, session)
    if cmd is None:
        return ok({"status": "completed", "command": None, "exit_code": None})
    await sb.commands.wait(cmd.id, min(seconds, MAX_LONG_POLL_SECONDS))
    return ok({"status": SHELL_STATUS[cmd.status], "command": shown_command(cmd), "exit_code": cmd.exit_code})


@router.post("/write", openapi_extra=json_body(WriteBody), response_model=v1_reply(ShellWrite))
async def write(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Type `input` (plus a newline with `press_enter`) into the session's running command."""
    body = await parse_body(request, WriteBody)
    session = sb.commands.session(body.id)
    if session.current_command_id is None:
        raise bad_request("write", f"No running process in session {body.id} to write to")
    text = body.input + ("\n" if body.press_enter else "")
    cmd = await sb.commands.write_stdin(session.current_command_id, text.encode("utf-8"))
    return ok({"status": SHELL_STATUS[cmd.status], "command": shown_command(cmd)})


@router.post("/kill", openapi_extra=json_body(SessionBody), response_model=v1_reply(ShellKill))
async def kill(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """SIGKILL the process group of the session's running command; idempotent when none runs."""
    body = await parse_body(request, SessionBody)
    session = sb.commands.session(body.id)
    running = session.current_command_id
    if running is None:
        cmd = last_command(sb, session)
        status = SHELL_STATUS[cmd.status] if cmd else "completed"
        code = cmd.exit_code if cmd else None
        return ok({"status": status, "exit_code": code, "returncode": code}, message="No running process")
    sb.commands.kill(running)
    cmd = await sb.commands.wait(running, KILL_WAIT_SECONDS)
    return ok({"status": SHELL_STATUS[cmd.status], "exit_code": cmd.exit_code, "returncode": cmd.exit_code})


@router.post(
    "/sessions/create", openapi_extra=json_body(CreateSessionBody), response_model=v1_reply(ShellCreated)
)
async def create_session(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """A new session (or the existing one of that id) whose commands start in `exec_dir`."""
    body = await parse_body(request, CreateSessionBody)
    no_change = check_no_change(body.no_change_timeout)
    cwd = await directory(sb.machine, body.exec_dir, "session") if body.exec_dir is not None else None
    session = await session_for(sb, body.id, cwd)
    if no_change is not None:
        _no_change[session] = no_change
    return ok({"session_id": session.session_id, "working_dir": session.working_dir})


@router.post(
    "/sessions/update", openapi_extra=json_body(UpdateSessionBody), response_model=v1_reply(ShellUpdated)
)
async def update_session(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, UpdateSessionBody)
    session = sb.commands.session(body.id)
    no_change = check_no_change(body.no_change_timeout)
    if no_change is not None:
        _no_change[session] = no_change
    return ok(
        {
            "session_id": session.session_id,
            "no_change_timeout": _no_change.get(session, DEFAULT_NO_CHANGE_TIMEOUT),
        }
    )


@router.get("/sessions", response_model=v1_reply(ShellSessions))
async def list_sessions(sb: CurrentSandbox) -> JSONResponse:
    return ok({"sessions": {s.session_id: session_info(s) for s in sb.commands.sessions()}})


@router.get("/sessions/stats", response_model=v1_reply(ShellStats))
async def session_stats(sb: CurrentSandbox) -> JSONResponse:
    sessions = sb.commands.sessions()
    now = time.time()
    active = sum(
        1
        for s in sessions
        if s.current_command_id or now - s.last_used_at.timestamp() <= ACTIVE_WINDOW_SECONDS
    )
    return ok(
        {
            "total_sessions": len(sessions),
            "active_sessions": active,
            "idle_sessions": len(sessions) - active,
            "max_sessions": MAX_SESSIONS,
            "session_timeout": SESSION_TIMEOUT_SECONDS,
            "usage_ratio": len(sessions) / MAX_SESSIONS,
        }
    )


@router.get("/terminal-url", response_model=NoTerminal)
async def terminal_url() -> JSONResponse:
    """Not available: `success: false` with an empty string (the SDK's `ResponseStr` still parses)."""
    message = "No web terminal: this sandbox runs commands through /v1/shell/exec and /v1/bash/exec"
    return JSONResponse({"success": False, "message": message, "data": "", "hint": None})


@router.delete("/sessions", response_model=v1_reply(ShellClosed))
async def cleanup_all_sessions(sb: CurrentSandbox) -> JSONResponse:
    closed = [sb.commands.close_session(s.session_id).session_id for s in sb.commands.sessions()]
    return ok({"closed": closed})


@router.delete("/sessions/{shell_session_id}", response_model=v1_reply(ShellClosed))
async def cleanup_session(shell_session_id: str, sb: CurrentSandbox) -> JSONResponse:
    sb.commands.close_session(shell_session_id)
    return ok({"closed": [shell_session_id]})
