"""Seed 002's command routes, `/v2/commands`, over the sandbox's `CommandManager`.

    POST   /v2/commands         {command, cwd, env, timeout, mode: sync|async}
    GET    /v2/commands         every command kept (without output)
    GET    /v2/commands/{id}    status and output so far (?wait= seconds for it to end)
    DELETE /v2/commands/{id}    kill its process group (SIGKILL) and report how it ended

A command's own outcome is data, not a failure: a non-zero exit, a timeout or a kill is
`success: true` with `status` and `exit_code` saying what happened. Failures are about the
request (an empty command, a missing cwd, an unknown id) and use the error envelope.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from agentbox.api.envelope import json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import SANDBOX_FAILURES, V2_FAILURES, Envelope, failures
from agentbox.timestamps import timestamp
from agentbox.workspace.commands import (
    DEFAULT_TIMEOUT_SECONDS,
    DRAIN_GRACE_SECONDS,
    KILL_GRACE_SECONDS,
    MAX_INPUT_BYTES,
    MAX_TIMEOUT_SECONDS,
    Command,
    Status,
)

router = APIRouter(tags=["v2 commands"], responses=failures(*V2_FAILURES, *SANDBOX_FAILURES))

#: How long DELETE waits for a killed command's record to close before answering.
KILL_WAIT_SECONDS = KILL_GRACE_SECONDS + DRAIN_GRACE_SECONDS


class CommandBody(BaseModel):
    command: str = Field(description="A shell command line, run as `/bin/sh -c` in its own process group.")
    cwd: str | None = Field(None, description="Working directory inside the sandbox (default /workspace).")
    env: dict[str, str] | None = Field(
        None, description="Variables added to the sandbox's clean environment."
    )
    timeout: float | None = Field(
        None,
        allow_inf_nan=False,
        description=f"Seconds before the command is killed (sync default {DEFAULT_TIMEOUT_SECONDS:g}, "
        f"at most {MAX_TIMEOUT_SECONDS:g}; async: none unless given).",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync waits for the end; async returns at once."
    )
    stdin: str | None = Field(
        None,
        description=f"Text written to the command's standard input, which is then closed (at most "
        f"{MAX_INPUT_BYTES} UTF-8 bytes); without it stdin is empty.",
    )


class CommandSummary(BaseModel):
    """What identifies a command and how it stands (`summary`)."""

    command_id: str
    command: str
    cwd: str | None
    status: Status
    exit_code: int | None
    started_at: str
    finished_at: str | None
    duration: float = Field(description="Seconds it ran (so far, while running).")
    error: str | None


class CommandOutput(CommandSummary):
    """A command with the output kept so far (`described`)."""

    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool


class CommandList(BaseModel):
    commands: list[CommandSummary]


def summary(cmd: Command) -> dict[str, Any]:
    """What identifies a command and how it stands, without its output."""
    return {
        "command_id": cmd.id,
        "command": cmd.command,
        "cwd": cmd.cwd,
        "status": cmd.status,
        "exit_code": cmd.exit_code,
        "started_at": timestamp(cmd.started_at),
        "finished_at": timestamp(cmd.finished_at) if cmd.finished_at else None,
        "duration": cmd.duration,
        "error": cmd.error,
    }


def described(cmd: Command) -> dict[str, Any]:
    """`summary` plus the output kept so far (head and tail when it overflowed)."""
    return {
        **summary(cmd),
        "stdout": cmd.stdout.text(),
        "stderr": cmd.stderr.text(),
        "stdout_truncated": cmd.stdout.truncated,
        "stderr_truncated": cmd.stderr.truncated,
    }


@router.post("/v2/commands", openapi_extra=json_body(CommandBody), response_model=Envelope[CommandOutput])
async def run(request: Request, sandbox: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, CommandBody)
    manager = sandbox.commands
    data = None if body.stdin is None else body.stdin.encode("utf-8", "surrogateescape")
    if body.mode == "async":
        cmd = await manager.start(
            body.command, cwd=body.cwd, env=body.env, timeout=body.timeout, stdin=False, input=data
        )
        return ok(described(cmd), message="Command started")
    cmd = await manager.run(body.command, cwd=body.cwd, env=body.env, timeout=body.timeout, input=data)
    return ok(described(cmd), message=f"Command {cmd.status}")


@router.get("/v2/commands", response_model=Envelope[CommandList])
async def list_commands(sandbox: CurrentSandbox) -> JSONResponse:
    return ok({"commands": [summary(cmd) for cmd in sandbox.commands.list()]})


@router.get("/v2/commands/{command_id}", response_model=Envelope[CommandOutput])
async def get_command(
    command_id: str,
    sandbox: CurrentSandbox,
    wait: Annotated[
        float,
        Query(
            allow_inf_nan=False, description="Seconds to wait for the command to end (0 = answer at once)."
        ),
    ] = 0.0,
) -> JSONResponse:
    cmd = await sandbox.commands.wait(command_id, wait) if wait else sandbox.commands.get(command_id)
    return ok(described(cmd))


@router.delete("/v2/commands/{command_id}", response_model=Envelope[CommandOutput])
async def kill_command(command_id: str, sandbox: CurrentSandbox) -> JSONResponse:
    sandbox.commands.kill(command_id)
    cmd = await sandbox.commands.wait(command_id, KILL_WAIT_SECONDS)
    return ok(described(cmd), message=f"Command {cmd.status}")
