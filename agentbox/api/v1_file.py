"""AIO `/v1/file/*`: file operations, transfers and watchers, wire-compatible with upstream AIO.

Routes only parse, call a layer-2 operation (`workspace.files`, `editor`, `grep`, `watch`)
and shape its result; blocking file work runs in a thread. Every success `data` carries the
fields the AIO SDK 0.0.30 requires of it (aio-api.md §7).

Failures, three styles (aio-api.md §4, seed 002):

- file operations (read, write, replace, search, find, grep, glob, list, upload,
  str_replace_editor, mkdir): HTTP 200, `success: false`, `data` = the error object (the
  app's `WorkspaceError` handler). SDK 0.0.30 cannot parse that `data` on most methods
  (it raises `pydantic.ValidationError`); that is upstream's own incompatibility.
- download: HTTP status codes (404, 403, 400, 416, 409), since the SDK would hand a 200
  JSON error body to its caller as the file's bytes.
- watch routes: resource-style, the envelope with the HTTP status of its `error_type`
  (an unknown watcher is 404; `watch/wait` with nothing happening is 503).

Choices where upstream is silent or this server differs:

- `sudo` is accepted and ignored: the file API has one identity per sandbox.
- `write` creates missing parent directories (as upstream 1.11 documents).
- `find` is `files.search`: files only, hidden names only when the glob spells the dot.
- `upload` without `path` lands in `<machine root>/<filename>` (`/workspace/<filename>` in a
  sandbox; the SDK names raw bytes `upload`). A `path` ending in `/` or naming an existing
  directory receives `<filename>` inside it. The form is spooled by Starlette (memory, then
  a temporary file) before it is staged beside the target; a body past
  `MAX_UPLOAD_FORM_BYTES` is refused (EFBIG) on its Content-Length or as soon as it passes.
- `download?change_policy=abort` pins the file's (inode, size, mtime) when it is opened:
  409 if it changed before the first byte left, a cut connection if it changes later.
- Watch responses are the wrapper with `data` AND the same keys at the top level
  (`data.watcher_id` and `watcher_id`), for both readings of upstream's docs. Poll accepts
  `since` (SDK 0.0.30) and `cursor` (1.9.4); `cursor` wins. `debounce` is accepted and
  ignored (events are reported one to one); `include_patterns` is refused when non-empty.
- The SSE stream (`watch/{id}/events`) sends `watch_started`, then `file_change` events with
  `id: <watcher_id>:<seq>` (and `overflow` markers); `Last-Event-ID` resumes after that seq;
  a comment line is sent every HEARTBEAT_SECONDS so proxies keep the stream open (the stream
  is v2's, `agentbox.api.v2_watch.sse`).
"""

from __future__ import annotations

import errno
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from email.utils import formatdate
from typing import Annotated, Any, Literal, cast
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.datastructures import FormData, UploadFile

from agentbox.api.envelope import BodyError, failure, json_body, ok, parse_body, read_form
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import failures, streamed, v1_reply, v1_stream
from agentbox.api.schemas import mirrored as mirrored_model
from agentbox.api.v2_watch import (
    HEARTBEAT_SECONDS,
    SSE_HEADERS,
    SSE_RESPONSE,
    PollPage,
    WatcherDeleted,
    WatcherInfo,
    WatcherList,
    resume_position,
    sse,
)
from agentbox.machines.base import Machine
from agentbox.workspace import editor as editor_mod
from agentbox.workspace import files, grep
from agentbox.workspace.errors import WorkspaceError, bad_request, failed, operation
from agentbox.workspace.fileops import Download, FileOps, file_ops
from agentbox.workspace.watch import DEFAULT_POLL_LIMIT, Event, wait_for

router = APIRouter(prefix="/v1/file", tags=["file"])

#: Longest a watch long-poll (`poll` timeout, `wait` timeout) blocks, so that it answers
#: before the AIO SDK's 60-second request timeout.
MAX_LONG_POLL_SECONDS = 50.0
#: `watch/wait` timeout when the caller names none (upstream's default).
DEFAULT_WAIT_SECONDS = 30.0
#: Room for the multipart framing around a file of `files.MAX_UPLOAD_BYTES`; a request
#: declaring more than both is refused before any byte is read.
MULTIPART_SLACK_BYTES = 64 * 1024
#: Largest upload body (v1 and v2): declared or counted, it is refused past this while it
#: arrives, so a chunked body is never spooled beyond it.
MAX_UPLOAD_FORM_BYTES = files.MAX_UPLOAD_BYTES + MULTIPART_SLACK_BYTES
#: Upload form limits: the one file part and the `path` field, with room for one stray field.
MAX_FORM_FILES = 1
MAX_FORM_FIELDS = 2
#: Bytes read from a spooled upload at a time.
UPLOAD_CHUNK_BYTES = 1024 * 1024

ChangePolicy = Literal["ignore", "abort"]


def resource_error(error: WorkspaceError, status: int | None = None) -> JSONResponse:
    """The envelope with an HTTP status (download and watch routes), not v1's 200."""
    response = failure(error)
    if status is not None:
        response.status_code = status
    return response


def mirrored(data: dict[str, Any], message: str = "Operation successful") -> JSONResponse:
    """The wrapper with `data`, and `data`'s keys again at the top level (watch routes)."""
    return ok(data, message, **data)


# ---------------------------------------------------------------- bodies


class ReadBody(BaseModel):
    file: str
    start_line: int | None = None
    end_line: int | None = None
    sudo: bool | None = None


class WriteBody(BaseModel):
    file: str
    content: str
    encoding: str | None = None
    append: bool | None = None
    leading_newline: bool | None = None
    trailing_newline: bool | None = None
    sudo: bool | None = None


class ReplaceBody(BaseModel):
    file: str
    old_str: str
    new_str: str
    sudo: bool | None = None


class SearchBody(BaseModel):
    file: str
    regex: str
    sudo: bool | None = None


class FindBody(BaseModel):
    path: str
    glob: str


class GrepBody(BaseModel):
    path: str
    pattern: str
    include: list[str] | None = None
    exclude: list[str] | None = None
    case_insensitive: bool | None = None
    fixed_strings: bool | None = None
    context_before: int | None = None
    context_after: int | None = None
    max_results: int | None = None
    max_file_size: str | None = None
    multiline: bool | None = None
    offset: int | None = None
    type: str | None = None
    recursive: bool | None = None


class GlobBody(BaseModel):
    path: str
    pattern: str
    exclude: list[str] | None = None
    include_hidden: bool | None = None
    files_only: bool | None = None
    include_metadata: bool | None = None
    max_results: int | None = None
    sort_by: str | None = None
    sort_desc: bool | None = None


class ListBody(BaseModel):
    path: str
    recursive: bool | None = None
    show_hidden: bool | None = None
    file_types: list[str] | None = None
    max_depth: int | None = None
    include_size: bool | None = None
    include_permissions: bool | None = None
    sort_by: str | None = None
    sort_desc: bool | None = None


class MkdirBody(BaseModel):
    path: str
    parents: bool | None = None


class EditorBody(BaseModel):
    command: str
    path: str
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: int | None = None
    view_range: list[int] | None = None
    replace_mode: str | None = None
    page_range: list[int] | None = None
    sheet_name: str | None = None
    row_range: list[int] | None = None
    slide_range: list[int] | None = None
    enable_metadata: bool | None = None


class WatchBody(BaseModel):
    path: str
    recursive: bool | None = None
    exclude: list[str] | None = None
    debounce: int | None = None
    include_patterns: list[str] | None = None


class PollBody(BaseModel):
    cursor: int | None = None
    since: int | None = None
    limit: int | None = None
    timeout: float | None = None


class WaitBody(BaseModel):
    path: str
    timeout: float | None = None
    event_types: list[str] | None = None


# ---------------------------------------------------------------- replies (`data` of each route)


class FileRead(BaseModel):
    content: str
    file: str
    line_count: int


class FileWritten(BaseModel):
    file: str
    bytes_written: int


class FileReplaced(BaseModel):
    file: str
    replaced_count: int


class FileSearched(BaseModel):
    """Matching lines of one file and their 0-based numbers."""

    file: str
    matches: list[str]
    line_numbers: list[int]


class FilesFound(BaseModel):
    path: str
    files: list[str]
    truncated: bool


class EditorMetadata(BaseModel):
    command: str
    line_count: int


class EditorResult(BaseModel):
    """v1 `StrReplaceEditorResult`; `metadata` only with `enable_metadata`."""

    output: str
    error: None
    path: str
    prev_exist: bool
    old_content: str | None
    new_content: str | None
    metadata: EditorMetadata | None = None


class Uploaded(BaseModel):
    file_path: str
    file_size: int
    success: bool


class WatchCreated(WatcherInfo):
    initial_cursor: int = Field(description="The cursor to poll from: the watcher's last seq.")


class WatchEvent(BaseModel):
    event: Event


#: What the watch routes answer besides their data: the envelope with their status.
WATCH_FAILURES = failures(400, 404, 500, 503)
#: A download's bytes, or (any failure but the sandbox's, which is v1's 200) the envelope.
DOWNLOAD_RESPONSES = {
    **v1_stream(streamed("application/octet-stream", "The file's bytes; 206 for a Range", 206)),
    **failures(400, 403, 404, 409, 416, 500),
}


#: The multipart body of an upload (v1 and v2), as the route reads it itself.
UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "The file's bytes."},
                        "path": {
                            "type": "string",
                            "description": "Target path; default: the file's name in /workspace.",
                        },
                    },
                }
            }
        },
    }
}


# ---------------------------------------------------------------- read, write, replace, search


@router.post("/read", openapi_extra=json_body(ReadBody), response_model=v1_reply(FileRead))
async def read(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Text of a file, or lines [start_line, end_line) of it (0-based, end exclusive)."""
    body = await parse_body(request, ReadBody)
    result = await file_ops(sb.machine).read_text(body.file, body.start_line, body.end_line)
    return ok({"content": result.content, "file": result.path, "line_count": result.line_count})


@router.post("/write", openapi_extra=json_body(WriteBody), response_model=v1_reply(FileWritten))
async def write(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, WriteBody)
    data = files.decode_content(
        body.content,
        cast(files.Encoding, body.encoding or "utf-8"),
        leading_newline=bool(body.leading_newline),
        trailing_newline=bool(body.trailing_newline),
        path=body.file,
    )
    ops = file_ops(sb.machine)
    await ensure_parent(ops, body.file, "write")
    result = await ops.write_file(body.file, data, append=bool(body.append))
    return ok({"file": result.path, "bytes_written": result.bytes_written})


async def ensure_parent(ops: FileOps, path: str, op: str) -> None:
    """Create the missing directories above `path` (write and upload do, as upstream does)."""
    parent = posixpath.dirname(path)
    with operation(op, path):
        missing = bool(parent) and not await ops.exists(parent)
    if missing:
        await ops.mkdir(parent, parents=True)


@router.post("/replace", openapi_extra=json_body(ReplaceBody), response_model=v1_reply(FileReplaced))
async def replace(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Replace every occurrence of `old_str`, literally; zero occurrences is a success with 0."""
    body = await parse_body(request, ReplaceBody)
    count = await sb.editor.replace(sb.machine, body.file, body.old_str, body.new_str)
    return ok({"file": shown(sb.machine, body.file, "replace"), "replaced_count": count})


@router.post("/search", openapi_extra=json_body(SearchBody), response_model=v1_reply(FileSearched))
async def search(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Lines of one file matching a regex, with 0-based line numbers (upstream's older route)."""
    body = await parse_body(request, SearchBody)
    matches, numbers = await grep.search_in_file(sb.machine, body.file, body.regex)
    return ok({"file": shown(sb.machine, body.file, "search"), "matches": matches, "line_numbers": numbers})


def shown(machine: Machine, path: str, op: str) -> str:
    with operation(op, path):
        return file_ops(machine).shown_path(path)


# ---------------------------------------------------------------- find, grep, glob, list, mkdir


@router.post("/find", openapi_extra=json_body(FindBody), response_model=v1_reply(FilesFound))
async def find(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, FindBody)
    result = await file_ops(sb.machine).search(body.path, body.glob)
    return ok({"path": result.path, "files": result.files, "truncated": result.truncated})


@router.post("/grep", openapi_extra=json_body(GrepBody), response_model=v1_reply(grep.GrepResult))
async def grep_files(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Content search with ripgrep; each match's `line_number` counts from 1."""
    body = await parse_body(request, GrepBody)
    result = await grep.grep(
        sb.machine,
        body.path,
        body.pattern,
        include=body.include,
        exclude=body.exclude,
        case_insensitive=bool(body.case_insensitive),
        fixed_strings=bool(body.fixed_strings),
        context_before=body.context_before or 0,
        context_after=body.context_after or 0,
        max_results=grep.MAX_GREP_RESULTS if body.max_results is None else body.max_results,
        max_file_size=body.max_file_size or grep.DEFAULT_MAX_FILE_SIZE,
        multiline=bool(body.multiline),
        offset=body.offset or 0,
        file_type=body.type,
        recursive=body.recursive is not False,
    )
    return ok(
        {
            "path": result.path,
            "pattern": result.pattern,
            "matches": [vars(m) for m in result.matches],
            "match_count": result.match_count,
            "files_searched": result.files_searched,
            "files_matched": result.files_matched,
            "truncated": result.truncated,
        }
    )


@router.post("/glob", openapi_extra=json_body(GlobBody), response_model=v1_reply(files.GlobResult))
async def glob(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, GlobBody)
    result = await file_ops(sb.machine).glob_files(
        body.path,
        body.pattern,
        exclude=body.exclude,
        include_hidden=bool(body.include_hidden),
        files_only=body.files_only is not False,
        include_metadata=body.include_metadata is not False,
        max_results=body.max_results,
        sort_by=cast(files.GlobSort, body.sort_by or "path"),
        sort_desc=bool(body.sort_desc),
    )
    return ok(
        {
            "path": result.path,
            "pattern": result.pattern,
            "files": [vars(f) for f in result.files],
            "total_count": result.total_count,
            "truncated": result.truncated,
        }
    )


@router.post("/list", openapi_extra=json_body(ListBody), response_model=v1_reply(files.ListResult))
async def list_path(request: Request, sb: CurrentSandbox) -> JSONResponse:
    body = await parse_body(request, ListBody)
    result = await file_ops(sb.machine).list_dir(
        body.path,
        recursive=bool(body.recursive),
        max_depth=body.max_depth,
        show_hidden=body.show_hidden is not False,
        file_types=body.file_types,
        sort_by=cast(files.ListSort, body.sort_by or "name"),
        sort_desc=bool(body.sort_desc),
        include_size=body.include_size is not False,
        include_permissions=bool(body.include_permissions),
    )
    return ok(
        {
            "path": result.path,
            "files": [vars(e) for e in result.files],
            "total_count": result.total_count,
            "directory_count": result.directory_count,
            "file_count": result.file_count,
            "truncated": result.truncated,
        }
    )


@router.post("/mkdir", openapi_extra=json_body(MkdirBody), response_model=v1_reply(files.MkdirResult))
async def mkdir(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Not upstream (seed 002 uses it): create a directory, with `parents` like `mkdir -p`."""
    body = await parse_body(request, MkdirBody)
    result = await file_ops(sb.machine).mkdir(body.path, parents=bool(body.parents))
    return ok({"path": result.path, "created": result.created})


# ---------------------------------------------------------------- the editor


@router.post(
    "/str_replace_editor", openapi_extra=json_body(EditorBody), response_model=v1_reply(EditorResult)
)
async def str_replace_editor(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """The Anthropic/OpenHands text-editor tool: view, create, str_replace, insert, undo_edit."""
    body = await parse_body(request, EditorBody)
    if body.page_range or body.sheet_name or body.row_range or body.slide_range:
        raise bad_request(
            "edit",
            "document views (page_range, sheet_name, row_range, slide_range) are not supported",
            body.path,
        )
    result = await run_editor(sb.editor, sb.machine, body)
    data: dict[str, Any] = {
        "output": result.output,
        "error": None,
        "path": result.path,
        "prev_exist": result.prev_exist,
        "old_content": result.old_content,
        "new_content": result.new_content,
    }
    if body.enable_metadata:
        text = result.new_content
        data["metadata"] = {"command": body.command, "line_count": editor_mod.line_count(text) if text else 0}
    return ok(data)


async def run_editor(editor: editor_mod.Editor, machine: Machine, body: EditorBody) -> editor_mod.EditResult:
    def need(value: Any, name: str) -> Any:
        if value is None:
            raise bad_request("edit", f"`{name}` is required for command `{body.command}`", body.path)
        return value

    if body.command == "view":
        return await editor.view(machine, body.path, body.view_range or None)
    if body.command == "create":
        return await editor.create(machine, body.path, need(body.file_text, "file_text"))
    if body.command == "str_replace":
        old = need(body.old_str, "old_str")
        return await editor.str_replace(machine, body.path, old, body.new_str or "", body.replace_mode)
    if body.command == "insert":
        line = need(body.insert_line, "insert_line")
        return await editor.insert(machine, body.path, line, need(body.new_str, "new_str"))
    if body.command == "undo_edit":
        return await editor.undo_edit(machine, body.path)
    raise bad_request(
        "edit",
        f"Unknown command {body.command!r}: use view, create, str_replace, insert or undo_edit",
        body.path,
    )


# ---------------------------------------------------------------- upload, download


@router.post("/upload", openapi_extra=UPLOAD_FORM, response_model=v1_reply(Uploaded))
async def upload(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Multipart `file` (and optional `path`), staged beside the target and renamed over it."""
    ops = file_ops(sb.machine)
    async with upload_form(request) as form:
        part = form.get("file")
        if not isinstance(part, UploadFile):
            missing = {
                "loc": ["file"],
                "msg": "Field required: a multipart file part named `file`",
                "type": "missing",
            }
            raise BodyError([missing])
        path = form.get("path")
        target = await upload_target(
            ops, sb.machine.root, path if isinstance(path, str) else None, part.filename
        )
        await ensure_parent(ops, target, "upload")
        result = await ops.upload(target, spooled(part))
    return ok({"file_path": result.file_path, "file_size": result.file_size, "success": True})


@asynccontextmanager
async def upload_form(request: Request) -> AsyncIterator[FormData]:
    """The upload's form within `MAX_UPLOAD_FORM_BYTES` (v1 and v2 alike), closed after use."""
    form = await read_form(
        request,
        MAX_UPLOAD_FORM_BYTES,
        max_files=MAX_FORM_FILES,
        max_fields=MAX_FORM_FIELDS,
        operation="upload",
    )
    try:
        yield form
    finally:
        await form.close()


async def upload_target(ops: FileOps, root: str, path: str | None, filename: str | None) -> str:
    """Where an upload goes: `path`, or the part's file name inside `path` / the machine root."""
    if path and not path.endswith("/"):
        with operation("upload", path):
            if not await ops.exists(path) or not (await ops.stat(path)).is_dir:
                return path
    name = posixpath.basename(filename or "")
    if name in ("", ".", ".."):
        raise bad_request("upload", "the file part has no usable file name; give `path`", path)
    return posixpath.join(path or root, name)


async def spooled(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(UPLOAD_CHUNK_BYTES):
        yield chunk


class FileChanged(WorkspaceError):
    """`change_policy=abort` and the file is not what it was when the download opened it."""

    def __init__(self, path: str) -> None:
        super().__init__(
            "io_error", failed("download", "the file changed during the download"), "download", path,
            exception_type="FileChanged", retryable=True,
        )  # fmt: skip


@router.get("/download", response_class=StreamingResponse, responses=DOWNLOAD_RESPONSES)
async def download(
    request: Request,
    path: Annotated[str, Query()],
    sb: CurrentSandbox,
    change_policy: Annotated[ChangePolicy, Query()] = "ignore",
) -> Response:
    """Stream a file's bytes; `Range` gives 206; failures are HTTP errors, not a 200 envelope."""
    try:
        target = await file_ops(sb.machine).download(path)
        span = files.parse_range(request.headers.get("range"), target.size, path)
        start, end = span if span is not None else (0, max(target.size - 1, 0))
        chunks = target.chunks(start, end if span is not None else None)
        first = await anext(chunks, b"")
        if change_policy == "abort" and not await target.unchanged():
            await aclose(chunks)
            raise FileChanged(path)
    except files.RangeNotSatisfiable as exc:
        response = resource_error(exc, 416)
        response.headers["Content-Range"] = f"bytes */{exc.size}"
        return response
    except FileChanged as exc:
        return resource_error(exc, 409)
    except WorkspaceError as exc:
        return resource_error(exc)
    length = end - start + 1 if target.size else 0
    headers = {
        "Content-Length": str(length),
        "Accept-Ranges": "bytes",
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(posixpath.basename(target.path))}",
        "ETag": target.etag,
        "Last-Modified": formatdate(target.mtime, usegmt=True),
    }
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{target.size}"
    body = stream(first, chunks, target if change_policy == "abort" else None)
    return StreamingResponse(
        body,
        status_code=206 if span is not None else 200,
        headers=headers,
        media_type="application/octet-stream",
    )


async def stream(first: bytes, rest: AsyncIterator[bytes], pinned: Download | None) -> AsyncIterator[bytes]:
    """The chunks of a download. With a pinned target each chunk is checked after it is read and
    before it is sent; once the file has changed the generator raises, which cuts the response."""
    try:
        if first:
            yield first
        async for chunk in rest:
            if pinned is not None and not await pinned.unchanged():
                raise FileChanged(pinned.path)
            yield chunk
    finally:
        await aclose(rest)


async def aclose(chunks: AsyncIterator[bytes]) -> None:
    """Close a download's generator now (and with it the file), not when it is collected."""
    if isinstance(chunks, AsyncGenerator):
        await chunks.aclose()


# ---------------------------------------------------------------- watchers


@router.get("/watch", response_model=v1_reply(mirrored_model(WatcherList)))
async def watch_list(sb: CurrentSandbox) -> JSONResponse:
    return mirrored({"watchers": [w.to_dict() for w in sb.watches.list()]})


@router.post(
    "/watch",
    openapi_extra=json_body(WatchBody),
    response_model=v1_reply(mirrored_model(WatchCreated)),
    responses=WATCH_FAILURES,
)
async def watch_create(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Start recording changes under a path; answers `watcher_id` (top level and in `data`)."""
    body = await parse_body(request, WatchBody)
    try:
        if body.include_patterns:
            raise bad_request("watch", "include_patterns is not supported; use exclude", body.path)
        if body.debounce is not None and body.debounce < 0:
            raise bad_request("watch", f"debounce must not be negative, got {body.debounce}", body.path)
        watcher = await sb.watches.start(
            body.path, recursive=body.recursive is not False, exclude=body.exclude
        )
    except WorkspaceError as exc:
        return resource_error(exc)
    return mirrored({**watcher.to_dict(), "initial_cursor": watcher.last_seq})


@router.post(
    "/watch/wait",
    openapi_extra=json_body(WaitBody),
    response_model=v1_reply(mirrored_model(WatchEvent)),
    responses=WATCH_FAILURES,
)
async def watch_wait(request: Request, sb: CurrentSandbox) -> JSONResponse:
    """The next change of exactly `path` (an existing path answers `create` at once); 503 on timeout."""
    body = await parse_body(request, WaitBody)
    timeout = DEFAULT_WAIT_SECONDS if body.timeout is None else body.timeout
    try:
        if timeout < 0:
            raise bad_request("watch", f"timeout must not be negative, got {timeout}", body.path)
        types = (
            body.event_types
            if body.event_types is not None
            else ["create", "write", "remove", "rename", "chmod"]
        )
        event = await wait_for(sb.watches, body.path, min(timeout, MAX_LONG_POLL_SECONDS), types)
        if event is None:
            raise WorkspaceError(
                "io_error", "timed out waiting for file event", "watch", body.path,
                errno.ETIMEDOUT, "ETIMEDOUT", "TimeoutError", retryable=True,
            )  # fmt: skip
    except WorkspaceError as exc:
        return resource_error(exc, 503 if exc.errno == errno.ETIMEDOUT else None)
    return mirrored({"event": event.to_dict()})


@router.post(
    "/watch/{watcher_id}/poll",
    openapi_extra=json_body(PollBody),
    response_model=v1_reply(mirrored_model(PollPage)),
    responses=WATCH_FAILURES,
)
async def watch_poll(watcher_id: str, request: Request, sb: CurrentSandbox) -> JSONResponse:
    """Events after the cursor (`cursor`, or SDK 0.0.30's `since`), long-polling up to `timeout` s."""
    body = await parse_body(request, PollBody)
    cursor = body.cursor if body.cursor is not None else (body.since or 0)
    timeout = min(max(body.timeout or 0.0, 0.0), MAX_LONG_POLL_SECONDS)
    try:
        page = await sb.watches.get(watcher_id).poll(cursor, timeout, body.limit or DEFAULT_POLL_LIMIT)
    except WorkspaceError as exc:
        return resource_error(exc)
    return mirrored(page.to_dict())


@router.get(
    "/watch/{watcher_id}/events",
    response_class=StreamingResponse,
    responses={**v1_stream(SSE_RESPONSE), **WATCH_FAILURES},
)
async def watch_events(watcher_id: str, request: Request, sb: CurrentSandbox) -> Response:
    """Server-sent events: `watch_started`, then `file_change` / `overflow` as they happen."""
    try:
        watcher = sb.watches.get(watcher_id)
        after = resume_position(watcher, request.headers.get("last-event-id"), None)
    except WorkspaceError as exc:
        return resource_error(exc)
    return StreamingResponse(
        sse(watcher, after, HEARTBEAT_SECONDS), media_type="text/event-stream", headers=SSE_HEADERS
    )


@router.delete(
    "/watch/{watcher_id}", response_model=v1_reply(mirrored_model(WatcherDeleted)), responses=WATCH_FAILURES
)
async def watch_stop(watcher_id: str, sb: CurrentSandbox) -> JSONResponse:
    try:
        sb.watches.delete(watcher_id)
    except WorkspaceError as exc:
        return resource_error(exc)
    return mirrored({"watcher_id": watcher_id, "deleted": True})
