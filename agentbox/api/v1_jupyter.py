"""AIO `/v1/jupyter/*`: the machine's code contexts as Jupyter sessions (the AIO SDK's `jupyter`).

    POST   /v1/jupyter/execute            {code, timeout?, kernel_name?, session_id?, cwd?}
    GET    /v1/jupyter/info               the kernels and the limits
    GET    /v1/jupyter/sessions           {sessions: {id: {kernel_name, last_used, age_seconds}}}
    POST   /v1/jupyter/sessions/create    {session_id?, kernel_name?, cwd?}
    DELETE /v1/jupyter/sessions/{id}      one session
    DELETE /v1/jupyter/sessions           every session

A session is a context of `agentbox.workspace.kernels` (a kernel inside the sandbox). An
`execute` naming an unknown `session_id` makes that session; one naming none runs in the
machine's default Python context (the one E2B's SDK uses without a context), and says
which. Kernel names are Jupyter's: `python3` (`python3.11` and the like name the same
kernel: the image has one Python), `deno` (JavaScript and TypeScript, where the image has
Deno's kernel). `status` is `ok`, `error` or `timeout`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox.api.envelope import failure, json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import v1_reply
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.kernels import (
    DEFAULT_LANGUAGE,
    IDLE_SECONDS,
    KERNELS,
    CodeInterpreter,
    Context,
    Output,
    error,
)

router = APIRouter(prefix="/v1/jupyter", tags=["jupyter"])

#: Seconds an execution runs when the caller names no `timeout`: under the AIO SDK's own
#: 60-second request timeout.
DEFAULT_TIMEOUT_SECONDS = 30
#: The kernel a session gets when the caller names none.
DEFAULT_KERNEL = KERNELS[DEFAULT_LANGUAGE]


class ExecuteBody(BaseModel):
    code: str
    timeout: float | None = None
    kernel_name: str | None = None
    session_id: str | None = None
    cwd: str | None = None


class CreateSessionBody(BaseModel):
    session_id: str | None = None
    kernel_name: str | None = None
    cwd: str | None = None


class JupyterOutput(BaseModel):
    output_type: str
    name: str | None = None
    text: str | None = None
    data: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    execution_count: int | None = None
    ename: str | None = None
    evalue: str | None = None
    traceback: list[str] | None = None


class JupyterExecution(BaseModel):
    kernel_name: str
    session_id: str | None = None
    status: str
    execution_count: int | None = None
    outputs: list[JupyterOutput]
    code: str
    msg_id: str | None = None


class JupyterInfo(BaseModel):
    default_kernel: str
    available_kernels: list[str]
    active_sessions: int
    session_timeout_seconds: int
    max_sessions: int
    description: str
    kernel_detection: str


class JupyterSession(BaseModel):
    kernel_name: str
    last_used: float
    age_seconds: int


class JupyterSessions(BaseModel):
    sessions: dict[str, JupyterSession]


class JupyterCreated(BaseModel):
    session_id: str
    kernel_name: str
    message: str


def language_of(kernel_name: str | None) -> str:
    """The interpreter's language for a Jupyter kernel name (`python3`, `python3.12`, ...)."""
    name = (kernel_name or DEFAULT_KERNEL).lower()
    if name == "python" or name.startswith("python3"):
        return "python"
    known: dict[str, str] = {}
    for language, kernel in KERNELS.items():  # a kernel of two languages is its first's (deno: javascript)
        known.setdefault(kernel, language)
    if name in known:
        return known[name]
    raise error("bad_request", f"no kernel {kernel_name!r}: this machine's kernel is {DEFAULT_KERNEL!r}")


def jupyter_output(output: Output, count: int | None) -> dict[str, Any] | None:
    """An output as a Jupyter notebook output (nbformat's shape); None for the execution count."""
    if output.kind in ("stdout", "stderr"):
        return {"output_type": "stream", "name": output.kind, "text": output.text}
    if output.kind == "result" and output.main:
        return {
            "output_type": "execute_result",
            "data": output.data,
            "metadata": {},
            "execution_count": count,
        }
    if output.kind == "result":
        return {"output_type": "display_data", "data": output.data, "metadata": {}}
    if output.kind == "error":
        return {"output_type": "error", "ename": output.name, "evalue": output.value,
                "traceback": list(output.traceback)}  # fmt: skip
    return None


async def collected(
    interpreter: CodeInterpreter, context: Context, code: str, timeout: float | None
) -> tuple[list[Output], int | None]:
    """Every output of one execution, and the kernel's count for it."""
    seconds = DEFAULT_TIMEOUT_SECONDS if timeout is None else timeout
    if seconds <= 0:
        raise error("bad_request", f"timeout must be more than 0 seconds, got {timeout}")
    outputs = [o async for o in interpreter.run(context, code, seconds=seconds)]
    count = next((o.count for o in outputs if o.kind == "count"), None)
    return [o for o in outputs if o.kind != "count"], count


def status_of(outputs: list[Output]) -> str:
    failed = [o for o in outputs if o.kind == "error"]
    if any(o.stopped and o.name == "TimeoutError" for o in failed):
        return "timeout"
    return "error" if failed else "ok"


async def session(
    interpreter: CodeInterpreter, session_id: str | None, kernel: str | None, cwd: str | None
) -> Context:
    """The named session (made on first use), else the language's default context."""
    language = language_of(kernel)
    if session_id is None:
        return await interpreter.context_for(None, language)
    existing = interpreter.contexts.get(session_id)
    if existing is not None:
        return existing
    try:
        return await interpreter.create(language, cwd, session_id)
    except WorkspaceError as exc:
        if exc.error_type != "already_exists":
            raise
        return interpreter.get(session_id)  # a request naming it at the same time made it


def sdk_failure(exc: WorkspaceError, **required: Any) -> JSONResponse:
    """A failure the AIO SDK can still read: it parses `data` as the route's model, so the
    model's required fields stand beside the error's."""
    return failure(exc, v1=True, also=required)


@router.post("/execute", openapi_extra=json_body(ExecuteBody), response_model=v1_reply(JupyterExecution))
async def execute(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, ExecuteBody)
    interpreter = sb.code()
    try:
        context = await session(interpreter, body.session_id, body.kernel_name, body.cwd)
        outputs, count = await collected(interpreter, context, body.code, body.timeout)
    except WorkspaceError as exc:
        kernel = body.kernel_name or DEFAULT_KERNEL
        return sdk_failure(exc, kernel_name=kernel, status="error", outputs=[], code=body.code)
    shown = [j for o in outputs if (j := jupyter_output(o, count)) is not None]
    return ok({"kernel_name": KERNELS[context.language], "session_id": context.id, "status": status_of(outputs),
               "execution_count": count, "outputs": shown, "code": body.code, "msg_id": None})  # fmt: skip


@router.get("/info", response_model=v1_reply(JupyterInfo))
async def info(sb: CurrentSandbox) -> JSONResponse:
    interpreter = sb.code()
    return ok({
        "default_kernel": DEFAULT_KERNEL, "available_kernels": [DEFAULT_KERNEL],
        "active_sessions": len(interpreter.list()), "session_timeout_seconds": int(IDLE_SECONDS),
        "max_sessions": interpreter.max_contexts,
        "description": "Jupyter kernels inside the sandbox, one per session",
        "kernel_detection": "the image's python3 kernel (python3-ipykernel)",
    })  # fmt: skip


def session_view(context: Context, now: float) -> dict[str, Any]:
    return {"kernel_name": KERNELS[context.language], "last_used": context.last_used,
            "age_seconds": int(now - context.created_at)}  # fmt: skip


@router.get("/sessions", response_model=v1_reply(JupyterSessions))
async def sessions(sb: CurrentSandbox) -> JSONResponse:
    now = time.time()
    return ok({"sessions": {c.id: session_view(c, now) for c in sb.code().list()}})


@router.post(
    "/sessions/create", openapi_extra=json_body(CreateSessionBody), response_model=v1_reply(JupyterCreated)
)
async def create_session(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, CreateSessionBody)
    try:
        context = await sb.code().create(language_of(body.kernel_name), body.cwd, body.session_id)
    except WorkspaceError as exc:
        return sdk_failure(
            exc, session_id=body.session_id or "", kernel_name=body.kernel_name or DEFAULT_KERNEL
        )
    kernel = KERNELS[context.language]
    return ok({"session_id": context.id, "kernel_name": kernel, "message": f"session started on {kernel}"})


@router.delete("/sessions/{jupyter_session_id}", response_model=v1_reply(dict[str, str]))
async def delete_session(jupyter_session_id: str, sb: CurrentSandbox) -> JSONResponse:
    await sb.code().remove(jupyter_session_id)
    return ok({"session_id": jupyter_session_id}, message="session removed")


@router.delete("/sessions", response_model=v1_reply(dict[str, int]))
async def delete_sessions(sb: CurrentSandbox) -> JSONResponse:
    interpreter = sb.code()
    ids = [c.id for c in interpreter.list()]
    for context_id in ids:
        await interpreter.remove(context_id)
    return ok({"removed": len(ids)}, message="sessions removed")
