"""AIO `/v1/code/*`: one entry point for running code (the AIO SDK's `code`).

    POST /v1/code/execute   {language, code, timeout?, cwd?, stateful?, session_id?}
    GET  /v1/code/info      the languages served

Python and JavaScript (the AIO SDK's two languages) run in a kernel of the machine's code
interpreter (`agentbox.workspace.kernels`): Python in `python3`, JavaScript in Deno's kernel
(where the image has it: the `data` image does). With `stateful` (or a `session_id`), in that
Jupyter session (made on first use, the one `/v1/jupyter` names the same); without, in a
context made for the call and removed after it. `stdout` and `stderr` are the streams
joined, `outputs` the Jupyter outputs, `status` `ok`, `error` or `timeout` (`exit_code` 0
when ok, else 1), `traceback` the error's. Other languages are refused.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentbox.api.envelope import json_body, ok, parse_body
from agentbox.api.sandboxes import CurrentSandbox, Sandbox
from agentbox.api.schemas import v1_reply
from agentbox.api.v1_jupyter import (
    DEFAULT_TIMEOUT_SECONDS,
    JupyterOutput,
    collected,
    jupyter_output,
    sdk_failure,
    session,
    status_of,
)
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.kernels import KERNELS, MAX_EXECUTION_SECONDS, error

router = APIRouter(prefix="/v1/code", tags=["code"])

#: The languages `/v1/code/execute` runs, and what `/v1/code/info` says of each.
LANGUAGES = {
    "python": "Python in a Jupyter kernel inside the sandbox",
    "javascript": "JavaScript in Deno's Jupyter kernel inside the sandbox (images with Deno's kernelspec)",
}


class CodeBody(BaseModel):
    language: str
    code: str
    timeout: float | None = None
    cwd: str | None = None
    stateful: bool | None = None
    session_id: str | None = None


class CodeResult(BaseModel):
    language: str
    status: str
    outputs: list[JupyterOutput] | None = None
    code: str
    stdout: str | None = None
    stderr: str | None = None
    exit_code: int | None = None
    traceback: list[str] | None = None
    session_id: str | None = None


class CodeLanguage(BaseModel):
    language: str
    description: str
    runtime_version: str | None = None
    default_timeout: int | None = None
    max_timeout: int | None = None


class CodeInfo(BaseModel):
    languages: list[CodeLanguage]


@router.post("/execute", openapi_extra=json_body(CodeBody), response_model=v1_reply(CodeResult))
async def execute(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, CodeBody)
    try:
        return await executed(sb, body)
    except WorkspaceError as exc:
        return sdk_failure(exc, language=body.language, status="error", code=body.code)


async def executed(sb: Sandbox, body: CodeBody) -> JSONResponse:
    """The execution's reply; a refusal raises (`execute` answers it)."""
    language = body.language.strip().lower()
    if language not in LANGUAGES:
        raise error(
            "bad_request", f"language {body.language!r} is not served here: one of {', '.join(LANGUAGES)}"
        )
    interpreter = sb.code()
    stateful = bool(body.stateful or body.session_id)
    if stateful:
        context = await session(interpreter, body.session_id, KERNELS[language], body.cwd)
    else:
        context = await interpreter.create(language, body.cwd)
    try:
        outputs, count = await collected(interpreter, context, body.code, body.timeout)
    finally:
        if not stateful:
            await interpreter.remove(context.id)
    status = status_of(outputs)
    failed = next((o for o in outputs if o.kind == "error"), None)
    return ok({
        "language": context.language, "status": status, "code": body.code,
        "outputs": [j for o in outputs if (j := jupyter_output(o, count)) is not None],
        "stdout": "".join(o.text for o in outputs if o.kind == "stdout"),
        "stderr": "".join(o.text for o in outputs if o.kind == "stderr"),
        "exit_code": 0 if status == "ok" else 1,
        "traceback": list(failed.traceback) if failed else None,
        "session_id": context.id if stateful else None,
    })  # fmt: skip


@router.get("/info", response_model=v1_reply(CodeInfo))
async def info(sb: CurrentSandbox) -> JSONResponse:
    languages = [{"language": language, "description": description, "default_timeout": DEFAULT_TIMEOUT_SECONDS,
                  "max_timeout": int(MAX_EXECUTION_SECONDS)} for language, description in LANGUAGES.items()]  # fmt: skip
    return ok({"languages": languages})
