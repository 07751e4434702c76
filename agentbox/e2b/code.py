"""E2B's code interpreter API (port 49999 of a `code-interpreter-v1` sandbox), on agentbox's port.

The `e2b-code-interpreter` SDK sends these to `E2B_SANDBOX_URL` like envd's requests, with
`E2b-Sandbox-Port: 49999` beside `E2b-Sandbox-Id`; `Envd` hands them here. They reach the
machine's code interpreter (`agentbox.workspace.kernels`: Jupyter kernels inside the sandbox).

    POST   /execute                 {code, context_id?, language?, env_vars?} -> NDJSON lines:
                                    {"type": "stdout" | "stderr", "text", "timestamp"}
                                    {"type": "result", "text", "html", "png", ..., "is_main_result"}
                                    {"type": "error", "name", "value", "traceback"}
                                    {"type": "number_of_executions", "execution_count"}
                                    {"type": "end_of_execution"}
    POST   /contexts                {language?, cwd?} -> {id, language, cwd}
    GET    /contexts                [{id, language, cwd}, ...]
    DELETE /contexts/{id}           204
    POST   /contexts/{id}/restart   204
    GET    /health                  200

The SDK sends the sandbox's `envdAccessToken` (`X-Access-Token`) with `/execute` only, and
its `trafficAccessToken` (`E2B-Traffic-Access-Token`) with every call; agentbox hands out the
same secret as both, and `Envd` refuses a call with neither. An unknown context is a 404
(the SDK's `NotFoundException`); failures are `{code, message}` as envd's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentbox.e2b.control import body_of
from agentbox.e2b.files import http_error
from agentbox.e2b.rpc import DEFAULT_ERROR, ERROR_CODES, workspace_error
from agentbox.e2b.sandboxes import E2BError, SandboxTable
from agentbox.machines.errors import MachineError
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.kernels import CodeInterpreter, Output

log = logging.getLogger(__name__)

#: The port the SDK names for the code interpreter (`E2b-Sandbox-Port`).
CODE_PORT = "49999"
#: What the SDK names each MIME type of a result (the rest go under `extra`).
RESULT_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def line_of(output: Output) -> dict[str, Any]:
    """An output as the SDK's `parse_output` reads it."""
    if output.kind in ("stdout", "stderr"):
        return {"type": output.kind, "text": output.text, "timestamp": time.time_ns()}
    if output.kind == "result":
        line: dict[str, Any] = {"type": "result", "is_main_result": output.main}
        extra = {}
        for mime, value in output.data.items():
            if mime in RESULT_KEYS:
                line[RESULT_KEYS[mime]] = value
            else:
                extra[mime] = value
        if extra:
            line["extra"] = extra
        return line
    if output.kind == "error":
        traceback = "\n".join(output.traceback)
        return {"type": "error", "name": output.name, "value": output.value, "traceback": traceback}
    return {"type": "number_of_executions", "execution_count": output.count}


async def ndjson(outputs: AsyncIterator[Output]) -> AsyncIterator[bytes]:
    async for output in outputs:
        yield json.dumps(line_of(output)).encode() + b"\n"
    yield b'{"type": "end_of_execution"}\n'


def optional_string(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise E2BError(400, f"{key} must be a string")
    return value or None


class CodeHttp:
    """The code interpreter routes of every E2B sandbox."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _interpreter(self, request: Request) -> CodeInterpreter:
        services = await self.table.services(request.headers.get("e2b-sandbox-id", ""))
        return services.code()

    async def execute(self, request: Request) -> Response:
        body = await body_of(request)
        code = body.get("code")
        if not isinstance(code, str):
            raise E2BError(400, "code must be a string")
        context_id, language = optional_string(body, "context_id"), optional_string(body, "language")
        if context_id and language:
            raise E2BError(400, "give a context_id or a language, not both")
        env = body.get("env_vars")
        if env is not None and not (
            isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise E2BError(400, "env_vars must be an object of string values")
        interpreter = await self._interpreter(request)
        context = await interpreter.context_for(context_id, language)
        await interpreter.started(context)  # a kernel that cannot start fails before the stream
        outputs = interpreter.run(context, code, env or None)
        return StreamingResponse(ndjson(outputs), media_type="application/x-ndjson")

    async def create(self, request: Request) -> Response:
        body = await body_of(request)
        interpreter = await self._interpreter(request)
        context = await interpreter.create(optional_string(body, "language"), optional_string(body, "cwd"))
        return JSONResponse(context.view())

    async def list(self, request: Request) -> Response:
        interpreter = await self._interpreter(request)
        return JSONResponse([c.view() for c in interpreter.list()])

    async def remove(self, request: Request) -> Response:
        interpreter = await self._interpreter(request)
        await interpreter.remove(request.path_params["context_id"])
        return Response(status_code=204)

    async def restart(self, request: Request) -> Response:
        interpreter = await self._interpreter(request)
        await interpreter.restart(request.path_params["context_id"])
        return Response(status_code=204)

    async def health(self, request: Request) -> Response:
        return JSONResponse("OK")

    def app(self) -> Starlette:
        def route(path: str, endpoint: Any, method: str) -> Route:
            return Route(path, answered(endpoint), methods=[method])

        routes = [
            route("/execute", self.execute, "POST"),
            route("/contexts", self.create, "POST"),
            route("/contexts", self.list, "GET"),
            route("/contexts/{context_id}", self.remove, "DELETE"),
            route("/contexts/{context_id}/restart", self.restart, "POST"),
            route("/health", self.health, "GET"),
        ]

        async def unrouted(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 404)
            return http_error(status, f"{request.method} {request.url.path} is not served")

        return Starlette(routes=routes, exception_handlers={404: unrouted, 405: unrouted})


def answered(endpoint: Any) -> Any:
    """`endpoint` with every failure answered as `{code, message}`."""

    async def run(request: Request) -> Response:
        try:
            response: Response = await endpoint(request)
            return response
        except E2BError as exc:  # a sandbox gone meanwhile reads as the proxy says it
            return http_error(502 if exc.status == 404 else exc.status, exc.message)
        except (WorkspaceError, MachineError, OSError) as exc:
            err = workspace_error(exc, "code", None)
            return http_error(ERROR_CODES.get(err.error_type, DEFAULT_ERROR)[1], err.message)
        except Exception:
            log.exception("e2b code interpreter: %s %s failed", request.method, request.url.path)
            return http_error(500, "internal error")

    return run
