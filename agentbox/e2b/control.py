"""E2B's control plane (its public `spec/openapi.yml`), the routes the `e2b` SDK calls.

    POST   /sandboxes, /v2/sandboxes                 {templateID, timeout, metadata, envVars}  201 Sandbox
                                                     Idempotency-Key: the same sandbox for a retry
    GET    /sandboxes, /v2/sandboxes                 ?metadata=k%3Dv&state=running&limit&nextToken
    GET    /sandboxes/{id}                           200 SandboxDetail
    DELETE /sandboxes/{id}                           204
    POST   /sandboxes/{id}/timeout                   {timeout}  204: the sandbox ends that many seconds from now
    POST   /sandboxes/{id}/refreshes                 {duration}  204: keep it at least that long
    POST   /sandboxes/{id}/connect, /v2/.../connect  {timeout}  200 Sandbox (what `Sandbox.connect` reads), resuming
    POST   /sandboxes/{id}/pause                     {memory}  204, 409 when paused: filesystem-only, always
    POST   /sandboxes/{id}/resume                    {timeout}  201 Sandbox, 409 when running
    GET    /sandboxes/{id}/metrics                   ?start&end (unix seconds)  200 [SandboxMetric]
    GET    /sandboxes/metrics                        ?sandbox_ids=a,b  200 {sandboxes: {id: SandboxMetric}}
                                                     (`metrics.py`: samples of the sandbox's cgroup)

Every request carries `X-API-Key`, checked against the server's API key (any key is taken
when the server has none). Every error, a refused key and malformed JSON included, is
`{code, message}` with `code` the HTTP status: the SDK reads exactly that and nothing else.
A create with an `Idempotency-Key` seen before answers the sandbox that key made, while it is
there. `templateID` picks the configured machine (`sandboxes.template_machine`).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentbox.e2b.metrics import MAX_METRICS_IDS, metric_view
from agentbox.e2b.sandboxes import (
    DEFAULT_TIMEOUT_SECONDS,
    ENVD_VERSION,
    E2BError,
    E2BSandbox,
    SandboxTable,
    checked_strings,
    checked_timeout,
)
from agentbox.machines.errors import CapacityExceeded, MachineError
from agentbox.workspace.errors import WorkspaceError

log = logging.getLogger(__name__)

#: The most sandboxes one page of `GET /v2/sandboxes` holds, and the page without `limit`.
MAX_LIST_LIMIT = 100
#: Bytes of a control-plane request body at most (they are a few small JSON fields).
MAX_BODY_BYTES = 64 * 1024
#: An `Idempotency-Key` as E2B's SDK checks it before sending.
IDEMPOTENCY_KEY = re.compile(r"[a-z0-9-]{1,255}")
#: The client id every sandbox reports (one server, no clusters).
CLIENT_ID = "agentbox"

Endpoint = Callable[[Request, SandboxTable], Awaitable[Response]]


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def key_ok(request: Request, table: SandboxTable) -> bool:
    expected = table.system().settings.api_key
    if not expected:
        return True
    given = request.headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def body_of(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise E2BError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise E2BError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise E2BError(400, "the request body must be a JSON object")
    return value


def whole_number(given: str) -> bool:
    """ASCII digits only: `str.isdigit` also takes `²`, which `int` refuses."""
    return given.isascii() and given.isdigit()


def stamp(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def sandbox_view(sandbox: E2BSandbox) -> dict[str, Any]:
    """The `Sandbox` schema: what create and connect answer."""
    return {
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sandbox.access_token,
        # The code interpreter's calls carry this one (some carry no envd token): the same secret.
        "trafficAccessToken": sandbox.access_token,
    }


def detail_view(sandbox: E2BSandbox, table: SandboxTable) -> dict[str, Any]:
    """The `SandboxDetail` / `ListedSandbox` schema."""
    return {
        **sandbox_view(sandbox),
        "startedAt": stamp(sandbox.started_at),
        "endAt": stamp(sandbox.end_at),
        "state": sandbox.state,
        "metadata": sandbox.metadata,
        **table.shape(sandbox),
    }


# ------------------------------------------------------------------ endpoints


async def create(request: Request, table: SandboxTable) -> Response:
    body = await body_of(request)
    template = body.get("templateID")
    if template is not None and not isinstance(template, str):
        raise E2BError(400, "templateID must be a string")
    timeout = checked_timeout(body.get("timeout", DEFAULT_TIMEOUT_SECONDS))
    metadata = checked_strings(body.get("metadata"), "metadata")
    env = checked_strings(body.get("envVars"), "envVars")
    key = request.headers.get("idempotency-key")
    if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
        raise E2BError(400, "Idempotency-Key must be 1-255 lowercase letters, digits and hyphens")
    sandbox = await table.create_once(key, template, timeout, metadata, env)
    return JSONResponse(sandbox_view(sandbox), status_code=201)


async def list_sandboxes(request: Request, table: SandboxTable) -> Response:
    query = request.query_params
    states = set(filter(None, query.get("state", "").split(",")))
    if states and not states <= {"running", "paused"}:
        raise E2BError(400, "state must be running and/or paused")
    wanted = {k: v for k, v in urllib.parse.parse_qsl(query.get("metadata", ""))}
    limit = _limit(query.get("limit"))
    after = query.get("nextToken") or ""
    found = sorted(
        (s for s in table.list(wanted) if s.id > after and (not states or s.state in states)),
        key=lambda s: s.id,
    )
    page = found[:limit]
    headers = {"X-Next-Token": page[-1].id} if len(found) > limit else {}
    return JSONResponse([detail_view(s, table) for s in page], headers=headers)


def _limit(given: str | None) -> int:
    if given is None:
        return MAX_LIST_LIMIT
    if not whole_number(given) or not 0 < int(given) <= MAX_LIST_LIMIT:
        raise E2BError(400, f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}")
    return int(given)


async def get_sandbox(request: Request, table: SandboxTable) -> Response:
    return JSONResponse(detail_view(table.get(request.path_params["sandbox_id"]), table))


async def kill(request: Request, table: SandboxTable) -> Response:
    await table.kill(request.path_params["sandbox_id"])
    return Response(status_code=204)


async def set_timeout(request: Request, table: SandboxTable) -> Response:
    body = await body_of(request)
    table.set_timeout(request.path_params["sandbox_id"], checked_timeout(body.get("timeout")))
    return Response(status_code=204)


async def refresh(request: Request, table: SandboxTable) -> Response:
    body = await body_of(request)
    duration = body.get("duration", DEFAULT_TIMEOUT_SECONDS)
    table.extend(request.path_params["sandbox_id"], checked_timeout(duration, "duration"))
    return Response(status_code=204)


async def connect(request: Request, table: SandboxTable) -> Response:
    body = await body_of(request)
    sandbox_id = request.path_params["sandbox_id"]
    timeout = checked_timeout(body.get("timeout", DEFAULT_TIMEOUT_SECONDS))
    sandbox = await table.resume(sandbox_id, timeout, strict=False)
    await table.services(sandbox_id)  # running again if agentbox reclaimed it while idle
    return JSONResponse(sandbox_view(sandbox))


async def metrics(request: Request, table: SandboxTable) -> Response:
    """The sandbox's samples in [start, end] (default: since it started, until now)."""
    sandbox = table.get(request.path_params["sandbox_id"])
    start, end = (_unix_seconds(request.query_params.get(name), name) for name in ("start", "end"))
    if start is not None and end is not None and start > end:
        raise E2BError(400, "start must not be after end")
    await table.fresh_sample(sandbox)
    return JSONResponse([metric_view(s) for s in sandbox.samples.between(start, end)])


async def many_metrics(request: Request, table: SandboxTable) -> Response:
    """The newest sample of each named sandbox that has one (unknown ids are left out)."""
    given = request.query_params.get("sandbox_ids")
    if not given:
        raise E2BError(400, "sandbox_ids is required: a comma-separated list of sandbox ids")
    ids = list(dict.fromkeys(filter(None, given.split(","))))
    if len(ids) > MAX_METRICS_IDS:
        raise E2BError(400, f"sandbox_ids may name at most {MAX_METRICS_IDS} sandboxes")
    found = {}
    for sandbox_id in ids:
        sandbox = table.find(sandbox_id)
        newest = await table.fresh_sample(sandbox) if sandbox is not None else None
        if newest is not None:
            found[sandbox_id] = metric_view(newest)
    return JSONResponse({"sandboxes": found})


def _unix_seconds(given: str | None, name: str) -> int | None:
    if given is None:
        return None
    if not whole_number(given):
        raise E2BError(400, f"{name} must be a Unix time in whole seconds")
    return int(given)


async def pause(request: Request, table: SandboxTable) -> Response:
    await body_of(request)  # `memory` (older SDKs) or not: the pause is filesystem-only
    await table.pause(request.path_params["sandbox_id"])
    return Response(status_code=204)


async def resume(request: Request, table: SandboxTable) -> Response:
    body = await body_of(request)
    timeout = checked_timeout(body.get("timeout", DEFAULT_TIMEOUT_SECONDS))
    sandbox = await table.resume(request.path_params["sandbox_id"], timeout, strict=True)
    return JSONResponse(sandbox_view(sandbox), status_code=201)


# ------------------------------------------------------------------ the app


def guarded(endpoint: Endpoint, table: SandboxTable) -> Callable[[Request], Awaitable[Response]]:
    """`endpoint` behind the key check, with every failure answered as `{code, message}`."""

    async def run(request: Request) -> Response:
        try:
            if not key_ok(request, table):
                return error(401, "missing or invalid X-API-Key")
            return await endpoint(request, table)
        except E2BError as exc:
            return error(exc.status, exc.message)
        except CapacityExceeded as exc:
            return error(429, str(exc))
        except (MachineError, WorkspaceError) as exc:
            return error(503, str(exc))
        except Exception:
            log.exception("e2b control plane: %s %s failed", request.method, request.url.path)
            return error(500, "internal error")

    return run


def control_app(table: SandboxTable) -> Starlette:
    def route(path: str, endpoint: Endpoint, method: str) -> Route:
        return Route(path, guarded(endpoint, table), methods=[method])

    routes = [
        route("/sandboxes", create, "POST"),
        route("/v2/sandboxes", create, "POST"),
        route("/sandboxes", list_sandboxes, "GET"),
        route("/v2/sandboxes", list_sandboxes, "GET"),
        route("/sandboxes/metrics", many_metrics, "GET"),  # before `{sandbox_id}` takes the name
        route("/sandboxes/{sandbox_id}", get_sandbox, "GET"),
        route("/sandboxes/{sandbox_id}", kill, "DELETE"),
        route("/sandboxes/{sandbox_id}/timeout", set_timeout, "POST"),
        route("/sandboxes/{sandbox_id}/refreshes", refresh, "POST"),
        route("/sandboxes/{sandbox_id}/connect", connect, "POST"),
        route("/v2/sandboxes/{sandbox_id}/connect", connect, "POST"),
        route("/sandboxes/{sandbox_id}/pause", pause, "POST"),
        route("/sandboxes/{sandbox_id}/resume", resume, "POST"),
        route("/sandboxes/{sandbox_id}/metrics", metrics, "GET"),
    ]

    async def unrouted(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return error(status, f"{request.method} {request.url.path} is not served")

    return Starlette(routes=routes, exception_handlers={404: unrouted, 405: unrouted})
