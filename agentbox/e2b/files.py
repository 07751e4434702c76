"""envd's plain HTTP file routes: `GET /files` (download) and `POST /files` (upload), `/health`.

Errors are `{code, message}` with the HTTP status as `code`, as envd answers them.
"""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentbox.api.envelope import BodyTooLarge, read_form
from agentbox.api.v1_file import MAX_UPLOAD_FORM_BYTES, spooled
from agentbox.e2b.rpc import DEFAULT_ERROR, ERROR_CODES, inside_path, workspace_error
from agentbox.e2b.sandboxes import E2BError, SandboxTable
from agentbox.machines.errors import MachineError
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import file_ops

FILES_PATH = "/files"


#: Files one multipart upload may carry (`files.write_files`); the whole form is within the upload limit.
MAX_UPLOAD_FILES = 100


def http_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def failure(exc: Exception, op: str, path: str | None) -> JSONResponse:
    if isinstance(exc, E2BError):  # the sandbox went away meanwhile: as the proxy says it
        return http_error(502 if exc.status == 404 else exc.status, exc.message)
    err = workspace_error(exc, op, path)
    return http_error(ERROR_CODES.get(err.error_type, DEFAULT_ERROR)[1], err.message)


#: Most bytes one step of a gzip upload's inflation yields: a small compressed chunk can stand
#: for gigabytes, so it is inflated a piece at a time (the upload's size limit stops the whole).
GUNZIP_PIECE_BYTES = 1024 * 1024


async def gunzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    async for chunk in chunks:
        data = chunk
        while data:
            if out := inflate.decompress(data, GUNZIP_PIECE_BYTES):
                yield out
            data = inflate.unconsumed_tail
    if tail := inflate.flush():
        yield tail


def written(path: str) -> dict[str, str]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


class FilesHttp:
    """envd's `/files` and `/health`."""

    def __init__(self, table: SandboxTable) -> None:
        self.table = table

    async def _ops(self, request: Request) -> tuple[str, Any]:
        services = await self.table.services(request.headers.get("e2b-sandbox-id", ""))
        return services.machine.root, file_ops(services.machine)

    async def download(self, request: Request) -> Response:
        path = request.query_params.get("path", "")
        try:
            root, ops = await self._ops(request)
            path = inside_path(root, path)
            target = await ops.download(path)
        except ConnectError as exc:
            return http_error(400, exc.message)
        except (WorkspaceError, MachineError, OSError, E2BError) as exc:
            return failure(exc, "download", path)
        headers = {"Content-Length": str(target.size)}
        return StreamingResponse(
            target.chunks(0, None), media_type="application/octet-stream", headers=headers
        )

    async def upload(self, request: Request) -> Response:
        path = request.query_params.get("path")
        try:
            root, ops = await self._ops(request)
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                return JSONResponse(await self._multipart(request, root, ops, path))
            if not path:
                return http_error(400, "path is required for an octet-stream upload")
            target = inside_path(root, path)
            chunks: AsyncIterator[bytes] = request.stream()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                chunks = gunzipped(chunks)
            await self._store(ops, target, chunks)
            return JSONResponse([written(target)])
        except ConnectError as exc:
            return http_error(400, exc.message)
        except BodyTooLarge as exc:
            return http_error(413, str(exc))
        except HTTPException as exc:  # a malformed form, or one with too many parts
            return http_error(exc.status_code, exc.detail)
        except zlib.error as exc:
            return http_error(400, f"the body is not gzip: {exc}")
        except (WorkspaceError, MachineError, OSError, E2BError) as exc:
            return failure(exc, "upload", path)

    async def _multipart(
        self, request: Request, root: str, ops: Any, path: str | None
    ) -> list[dict[str, str]]:
        """Every file part, to `path` when there is one part, else to the part's own name (the
        SDK names each part by its path)."""
        out = []
        form = await read_form(
            request, MAX_UPLOAD_FORM_BYTES, max_files=MAX_UPLOAD_FILES, max_fields=0, operation="upload"
        )
        try:
            parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not parts:
                raise ConnectError(Code.INVALID_ARGUMENT, "the form has no file part")
            for part in parts:
                name = path if path and len(parts) == 1 else part.filename
                target = inside_path(root, name or "")
                await self._store(ops, target, spooled(part))
                out.append(written(target))
        finally:
            await form.close()
        return out

    @staticmethod
    async def _store(ops: Any, target: str, chunks: AsyncIterator[bytes]) -> None:
        """Write the file, making its parent directories first (as envd does)."""
        parent = posixpath.dirname(target)
        if parent and not await ops.exists(parent):
            await ops.makedirs(parent)
        await ops.upload(target, chunks)

    async def health(self, request: Request) -> Response:
        return Response(status_code=204)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(FILES_PATH, self.download, methods=["GET"]),
                Route(FILES_PATH, self.upload, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )
