"""envd, E2B's in-sandbox daemon, served by agentbox for its sandboxes: Connect RPC and `/files`.

The `e2b` SDK sends every envd request to one URL (`E2B_SANDBOX_URL`) with the sandbox in
`E2b-Sandbox-Id` and the sandbox's `envdAccessToken` in `X-Access-Token`; `Envd` checks
both, then hands the request to one of:

    /process.Process/{Start,Connect,List,SendSignal,SendInput,CloseStdin}   Connect RPC
    /filesystem.Filesystem/{Stat,ListDir,MakeDir,Move,Remove}               Connect RPC
    /filesystem.Filesystem/{WatchDir,CreateWatcher,GetWatcherEvents,RemoveWatcher}
    GET  /files?path=        the file's bytes
    POST /files?path=        multipart (a part per file, named by its path) or octet-stream (gzip too)
    /files?...&signature=    a signed URL (`download_url`, `upload_url`): no headers, the sandbox
                             is the one whose token made the signature
    GET  /health             204

and, for requests with `E2b-Sandbox-Port: 49999`, E2B's code interpreter (`code.py`).
The services live beside this module: `process.py` (over the machine's command manager),
`filesystem.py` (over `file_ops` and the watch hub), `files.py` (the HTTP routes), and what
they share in `rpc.py`. Processes run as the account the call names (`process.py`); file
operations need no account, since both of a sandbox's are the same owner (`machines/account.py`).
Not served yet: file metadata.
"""

from __future__ import annotations

import urllib.parse

from connectrpc.code import Code
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.e2b.code import CODE_PORT, CodeHttp
from agentbox.e2b.envd_gen.filesystem.filesystem_connect import FilesystemASGIApplication
from agentbox.e2b.envd_gen.process.process_connect import ProcessASGIApplication
from agentbox.e2b.files import FILES_PATH, FilesHttp, http_error
from agentbox.e2b.filesystem import FilesystemService
from agentbox.e2b.process import ProcessService
from agentbox.e2b.rpc import CODECS
from agentbox.e2b.sandboxes import E2BError, SandboxTable, SignedUrl

#: The header naming the sandbox of an envd request, and envd's file route.
SANDBOX_HEADER = b"e2b-sandbox-id"
#: The header naming the sandbox port a request is for (envd's own when absent).
PORT_HEADER = "e2b-sandbox-port"


class Envd:
    """The envd of every E2B sandbox: the sandbox by header, its token checked, then the service."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table
        self.process: ASGIApp = ProcessASGIApplication(ProcessService(table), codecs=CODECS)
        self.filesystem: ASGIApp = FilesystemASGIApplication(FilesystemService(table), codecs=CODECS)
        self.http: ASGIApp = FilesHttp(table).app()
        self.code: ASGIApp = CodeHttp(table).app()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == FILES_PATH and not has_header(scope, SANDBOX_HEADER):
            signed = self._signed(scope)
            if isinstance(signed, Response):
                await signed(scope, receive, send)
                return
            await self.http(signed, receive, send)
            return
        refused = self._refused(scope, path)
        if refused is not None:
            await refused(scope, receive, send)
            return
        if header(scope, PORT_HEADER) == CODE_PORT:
            await self.code(scope, receive, send)
        elif path.startswith("/process.Process/"):
            await self.process(scope, receive, send)
        elif path.startswith("/filesystem.Filesystem/"):
            await self.filesystem(scope, receive, send)
        else:
            await self.http(scope, receive, send)

    def _refused(self, scope: Scope, path: str) -> Response | None:
        """What E2B's proxy and envd answer before any service: a 502 "was not found" for a
        sandbox that is not (or no longer) there, which the SDK reads as "not running", a 502
        for a paused one (not running either, until `connect`), and a 401 without the
        sandbox's token (`/health` needs none)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rpc = path.startswith(("/process.Process/", "/filesystem.Filesystem/"))
        sandbox_id = headers.get("e2b-sandbox-id", "")
        try:
            sandbox = self.table.get(sandbox_id)
        except E2BError as exc:
            return rpc_error(Code.UNAVAILABLE, 502, exc.message) if rpc else http_error(502, exc.message)
        if sandbox.state == "paused":
            message = f"sandbox {sandbox_id!r} is paused; connect to it to resume it"
            return rpc_error(Code.UNAVAILABLE, 502, message) if rpc else http_error(502, message)
        given = [headers.get("x-access-token")]
        if headers.get(PORT_HEADER) == CODE_PORT:  # the SDK sends the traffic token on every call
            given.append(headers.get("e2b-traffic-access-token"))
        if path != "/health" and not any(sandbox.token_ok(token) for token in given):
            message = "missing or invalid X-Access-Token"
            return rpc_error(Code.UNAUTHENTICATED, 401, message) if rpc else http_error(401, message)
        return None

    def _signed(self, scope: Scope) -> Scope | Response:
        """A signed file URL's request, as if it carried its sandbox's header; else 401."""
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1")))
        expiration = query.get("signature_expiration")
        if "signature" not in query or (expiration is not None and not expiration.isdigit()):
            return http_error(401, "a file URL needs a signature (or the sandbox's headers)")
        url = SignedUrl(
            query.get("path", ""),
            "write" if scope["method"] == "POST" else "read",
            query.get("username", ""),
            query["signature"],
            int(expiration) if expiration is not None else None,
        )
        sandbox = self.table.signed(url)
        if sandbox is None or sandbox.state != "running":
            return http_error(401, "the signature is invalid or expired")
        return {**scope, "headers": [*scope["headers"], (SANDBOX_HEADER, sandbox.id.encode())]}


def header(scope: Scope, name: str) -> str | None:
    wanted = name.encode()
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == wanted), None)


def has_header(scope: Scope, name: bytes) -> bool:
    return any(k.lower() == name for k, _ in scope["headers"])


def rpc_error(code: Code, status: int, message: str) -> JSONResponse:
    """A Connect unary error body; the SDK reads the same shape from a streaming call's status."""
    return JSONResponse({"code": code.value, "message": message}, status_code=status)
