"""Seed 000's file API: uploads given to agents and files they delivered, outside any sandbox.

    POST   /v1/files                multipart `file` (+ `session_id`)   201 record / 413 / 422
    GET    /v1/files                ?session_id&limit&after             {items, has_more, next_after}
    GET    /v1/files/{id}                                               the record / 404
    GET    /v1/files/{id}/content   + Range                             200 / 206 / 416, streamed
    DELETE /v1/files/{id}                                               {id, deleted: true} / 404

Mounted once at the root (not per sandbox): a file belongs to no sandbox and outlives its
session. Bytes and records live in `agentbox.store.files.FileStore` (the system's `files`).

Uploads: Starlette spools the multipart body to an anonymous temp file, then the part is
streamed into the store, so no more than a chunk is ever in memory. A body whose
Content-Length already exceeds MAX_UPLOAD_BODY_BYTES is refused before a byte of it is read
(a client sending `Expect: 100-continue`, as curl does for large bodies, never sends it);
a body without a length is cut off at the same limit while it arrives. Either way, and when
the file itself passes MAX_FILE_BYTES, the answer is 413 and nothing is stored.

Listing is newest first (ids sort by creation) and paged: `limit` files (LIST_LIMIT_DEFAULT,
at most LIST_LIMIT_MAX), and `after=<id>` continues after the last file of the previous page
(`next_after` gives it while `has_more`). `session_id` narrows the list to that session's
uploads and deliveries.

Errors use the envelope of the rest of the API (`envelope.failure`) with their own status
(always, even though the path starts with /v1/: these are not AIO v1 routes); a malformed
form is a 422 of `envelope.body_errors`, a malformed query a 400 as everywhere else.
"""

from __future__ import annotations

import mimetypes
import os
import posixpath
from collections.abc import AsyncIterator, Iterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from agentbox.api.envelope import BodyTooLarge, body_errors, capped, failure, query_error
from agentbox.api.schemas import failures, streamed
from agentbox.api.v2_fs import attachment
from agentbox.ids import FILE, SESSION_ID_RULE, is_id, is_session_id
from agentbox.store.files import MAX_FILE_BYTES, FileNotFound, FileStore, FileTooLarge, InvalidFile
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.files import RangeNotSatisfiable, parse_range

router = APIRouter(tags=["files"])

#: Bytes of multipart framing (boundaries, part headers, the `session_id` field) allowed on top
#: of a MAX_FILE_BYTES file; also the most one non-file form field may hold.
MULTIPART_SLACK_BYTES = 64 * 1024
#: Largest upload request body: a body past it cannot hold a file the store would keep.
MAX_UPLOAD_BODY_BYTES = MAX_FILE_BYTES + MULTIPART_SLACK_BYTES
#: Form fields besides the file an upload may carry (unknown ones are ignored).
MAX_FORM_FIELDS = 16
#: Files listed per page when `limit` is not given, and the most a page may ask for.
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 1000
#: Tuning, not a limit: bytes read per step from the spooled upload and from a blob.
CHUNK_BYTES = 1024 * 1024

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "The file's bytes."},
                        "session_id": {"type": "string", "description": "The session the file is for."},
                    },
                    "required": ["file"],
                }
            }
        },
    }
}


class FileRecord(BaseModel):
    id: str = Field(description="`file_<ulid>`; sorts by creation.")
    filename: str
    bytes: int
    sha256: str
    created_at: str = Field(description="UTC, RFC 3339 with milliseconds: `2026-12-01T15:51:35.350Z`.")
    session_id: str | None = Field(
        description="The session it was uploaded for, attached to (by a message) or delivered in."
    )
    source: str = Field(description="`upload` (given to an agent) or `delivery` (`deliver_file`).")
    turn_id: str | None = Field(None, description="For a delivery: the turn that delivered it.")
    tool_use_id: str | None = Field(None, description="For a delivery: the `deliver_file` call.")


class FileList(BaseModel):
    items: list[FileRecord] = Field(description="Newest first.")
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` for the next page; null on the last.")


class FileDeleted(BaseModel):
    id: str
    deleted: bool = True


def file_store(request: Request) -> FileStore:
    store: FileStore = request.app.state.system.files
    return store


Store = Annotated[FileStore, Depends(file_store)]


# ---------------------------------------------------------------- errors


def refusal(status: int, error_type: str, operation: str, error: Exception) -> JSONResponse:
    """The envelope for a store refusal, with `status` (not the AIO v1 "always 200")."""
    detail = WorkspaceError(error_type, str(error), operation, exception_type=type(error).__name__)
    response = failure(detail)
    response.status_code = status
    return response


def not_found(operation: str, file_id: str) -> JSONResponse:
    return refusal(404, "not_found", operation, FileNotFound(file_id))


def too_large() -> JSONResponse:
    """413, and the connection closed: the server would otherwise drain the rest of the body."""
    response = refusal(413, "too_large", "upload", FileTooLarge(MAX_FILE_BYTES))
    response.headers["connection"] = "close"
    return response


def form_error(message: str, kind: str, *loc: str) -> JSONResponse:
    return body_errors([{"loc": list(loc), "msg": message, "type": kind}])


# ---------------------------------------------------------------- upload


@router.post(
    "/v1/files",
    status_code=201,
    response_model=FileRecord,
    openapi_extra=UPLOAD_BODY,
    responses={413: {"description": "The file is larger than 100 MiB; nothing was stored."}},
)
async def upload(request: Request, store: Store) -> Any:
    if declared_too_large(request):
        return too_large()
    if not is_multipart(request):
        return form_error("Field required (send multipart/form-data with a `file` part)", "missing", "file")
    try:
        form = await read_form(request)
    except BodyTooLarge:
        return too_large()
    except MultiPartException as exc:
        return form_error(exc.message, "multipart")
    try:
        return await store_upload(store, form)
    finally:
        await form.close()


def declared_too_large(request: Request) -> bool:
    declared = request.headers.get("content-length", "")
    return declared.isdigit() and int(declared) > MAX_UPLOAD_BODY_BYTES


def is_multipart(request: Request) -> bool:
    content_type = request.headers.get("content-type", "")
    return content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


async def read_form(request: Request) -> FormData:
    """Parse the multipart body (files spooled by Starlette), cut off past the body limit."""
    parser = MultiPartParser(
        request.headers,
        capped(request.stream(), MAX_UPLOAD_BODY_BYTES),
        max_files=1,
        max_fields=MAX_FORM_FIELDS,
        max_part_size=MULTIPART_SLACK_BYTES,
    )
    return await parser.parse()


async def store_upload(store: FileStore, form: FormData) -> Any:
    part = form.get("file")
    if part is None:
        return form_error("Field required", "missing", "file")
    if not isinstance(part, UploadFile):
        return form_error("`file` must be a file part (with a file name)", "file_type", "file")
    session_id = form.get("session_id") or None
    if session_id is not None and not is_session_id(session_id):
        return form_error(f"a session id is {SESSION_ID_RULE}", "value_error", "session_id")
    name = posixpath.basename(part.filename or "")
    try:
        return await store.put_stream(spooled_chunks(part), name, session_id=session_id, source="upload")
    except FileTooLarge:
        return too_large()
    except InvalidFile as exc:
        return form_error(str(exc), "value_error", "file", "filename")


async def spooled_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(CHUNK_BYTES):
        yield chunk


# ---------------------------------------------------------------- list, get, delete


@router.get("/v1/files", response_model=FileList)
async def list_files(
    store: Store,
    session_id: Annotated[
        str | None, Query(description="Only this session's uploads and deliveries.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX, description="Files per page.")] = LIST_LIMIT_DEFAULT,
    after: Annotated[str | None, Query(description="The `next_after` of the previous page.")] = None,
) -> Any:
    if after is not None and not is_id(after, FILE):
        return query_error(f"Invalid request parameters: after: {after!r} is not a file id")
    rows = await store.list(session_id, before=after, limit=limit + 1)
    page = rows[:limit]
    has_more = len(rows) > limit
    return {"items": page, "has_more": has_more, "next_after": page[-1]["id"] if has_more else None}


@router.get("/v1/files/{file_id}", response_model=FileRecord, responses=failures(404))
async def get_file(file_id: str, store: Store) -> Any:
    try:
        return await store.get(file_id)
    except FileNotFound:
        return not_found("stat", file_id)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=failures(404))
async def delete_file(file_id: str, store: Store) -> Any:
    try:
        await store.delete(file_id)
    except FileNotFound:
        return not_found("remove", file_id)
    return {"id": file_id, "deleted": True}


# ---------------------------------------------------------------- content


@router.get(
    "/v1/files/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        **streamed("*/*", "The bytes (the media type its name suggests); 206 for a Range", 206),
        **failures(404, 416),
    },
)
async def content(file_id: str, request: Request, store: Store) -> Response:
    """The bytes, streamed; a single `Range` is honoured (206, or 416 outside the file)."""
    try:
        record = await store.get(file_id)
        blob = await run_in_threadpool(open, store.blob_path(record["sha256"]), "rb")
    except (FileNotFound, FileNotFoundError):  # the second: deleted between the two steps
        return not_found("download", file_id)
    size = os.fstat(blob.fileno()).st_size
    try:
        span = parse_range(request.headers.get("range"), size)
    except RangeNotSatisfiable as exc:
        blob.close()
        response = failure(exc)
        response.status_code = 416
        response.headers["Content-Range"] = f"bytes */{size}"
        return response
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Disposition": attachment(record["filename"]),
        "ETag": f'"{record["sha256"]}"',
        # Guessed from the name, without a charset: the bytes are the uploader's, in any encoding.
        "Content-Type": mimetypes.guess_type(record["filename"])[0] or "application/octet-stream",
        "X-Content-Type-Options": "nosniff",
    }
    start, end, status = 0, size - 1, 200
    if span is not None:
        (start, end), status = span, 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(end - start + 1)
    return StreamingResponse(read_span(blob, start, end), status, headers)


def read_span(blob: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    """Bytes `start..end` (inclusive) of an open blob, which is closed at the end.

    The blob was opened before the response started, so a delete meanwhile (which unlinks
    it) does not cut the download short.
    """
    with blob:
        blob.seek(start)
        left = end - start + 1
        while left > 0 and (chunk := blob.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            yield chunk
