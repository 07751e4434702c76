"""Seed 002's file routes, `/v2/fs/*`: thin translations onto `agentbox.workspace`.

    POST /v2/fs/mkdir      {path, parents}                       ?user=
    POST /v2/fs/write      {path, content, encoding, append, ...} ?user=   in place, or staged with user
    GET  /v2/fs/list       ?path&recursive&max_depth&...         ?user=
    GET  /v2/fs/search     ?path&pattern ("**" aware) -> flat list of paths
    POST /v2/fs/grep       {path, pattern, context_before, ...}   1-based line_number (ripgrep)
    POST /v2/fs/edit       {command: str_replace|insert|undo_edit, path, old_str, new_str, insert_line}
    GET  /v2/fs/read       ?path&start_line&end_line             0-based, end exclusive
    GET  /v2/fs/download   ?path + Range                          200 / 206 / 416, streamed
    POST /v2/fs/upload     multipart: file, path                  staged through .aiod-upload-<id>.part
    GET  /v2/fs/tree       ?path                                  a tar of the directory, streamed
    PUT  /v2/fs/tree       ?path, tar body                        members escaping the target refused

`?user=` names the owner of what a route creates (seed 002: not an execution identity; the
daemon's own rights apply). Routes that create nothing accept it too and check that the
machine knows the user, so a wrong name is the same clear 400 everywhere. The byte-stream
routes (download, GET tree) take no `user`: passing one is a 400, not silently ignored.

JSON bodies are parsed with `parse_body` (an empty body is `{}`, mistakes get the envelope)
and documented with `json_body`; blocking file work runs in a worker thread.
"""

from __future__ import annotations

import dataclasses
import mimetypes
import posixpath
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile

from agentbox.api.envelope import BodyError, failure, json_body, ok, parse_body, refuse_declared
from agentbox.api.sandboxes import CurrentSandbox
from agentbox.api.schemas import SANDBOX_FAILURES, V2_FILE_FAILURES, Envelope, failures, streamed
from agentbox.api.v1_file import UPLOAD_FORM, upload_form
from agentbox.machines.base import Machine
from agentbox.workspace import files, grep, tree
from agentbox.workspace.editor import Editor, EditResult
from agentbox.workspace.errors import bad_request
from agentbox.workspace.fileops import check_user, file_ops
from agentbox.workspace.files import RangeNotSatisfiable

router = APIRouter(tags=["v2 files"], responses=failures(*V2_FILE_FAILURES, *SANDBOX_FAILURES))
#: Routes that decode text answer 422 `decode_error` for bytes that are not (UTF-8, base64).
DECODES = failures(422)

#: Tuning, not a limit: bytes read from an uploaded part per chunk handed to `files.upload`.
UPLOAD_CHUNK_BYTES = 1024 * 1024
#: The editor commands `/v2/fs/edit` keeps (seed 002); `view` and `create` have their own routes.
EDIT_COMMANDS = ("str_replace", "insert", "undo_edit")
#: Where each refused editor command went instead.
EDIT_REPLACEMENTS = {"view": "GET /v2/fs/read", "create": "POST /v2/fs/write"}

UserQuery = Annotated[
    str | None,
    Query(description="Owner of the files and directories the request creates (not an execution identity)."),
]
PathQuery = Annotated[
    str, Query(description="A path inside the sandbox; relative paths start at /workspace.")
]


# ---------------------------------------------------------------- shared pieces


def refuse_user(request: Request, op: str) -> None:
    """Byte-stream routes run as the daemon and create nothing: `?user=` is an error there."""
    if "user" in request.query_params:
        raise bad_request(op, f"?user= is not supported by {request.url.path.rsplit('/v2/', 1)[-1]}")


def data_of(result: Any) -> dict[str, Any]:
    """A result dataclass as JSON data, as `dataclasses.asdict` makes it. A result of plain
    fields (a read's, a write's) is copied field by field: asdict's deep copy of each value
    took 6 us of a 1 KiB read."""
    data = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    if any(isinstance(v, list | tuple | dict) or dataclasses.is_dataclass(v) for v in data.values()):
        return dataclasses.asdict(result)
    return data


# ---------------------------------------------------------------- bodies


class MkdirBody(BaseModel):
    path: str = Field(description="Directory to create.")
    parents: bool = Field(False, description="Create missing parents; an existing directory is then fine.")


class WriteBody(BaseModel):
    path: str = Field(description="File to write; its parent directory must exist.")
    content: str = Field(description="The content, as text or base64 (see `encoding`).")
    encoding: Literal["utf-8", "base64", "raw"] = Field("utf-8", description="How `content` is encoded.")
    append: bool = Field(False, description="Append instead of replacing the content.")
    leading_newline: bool = Field(False, description="Write a newline before the content.")
    trailing_newline: bool = Field(False, description="Write a newline after the content.")


class GrepBody(BaseModel):
    path: str = Field(description="A file, or a directory searched recursively.")
    pattern: str = Field(description="A Rust regex (ripgrep), or a literal with `fixed_strings`.")
    include: str | list[str] | None = Field(None, description="Globs of files to search (`*.py`).")
    exclude: str | list[str] | None = Field(None, description="Globs of files to skip.")
    case_insensitive: bool = False
    fixed_strings: bool = False
    context_before: int = Field(0, description="Lines of context before each match.")
    context_after: int = Field(0, description="Lines of context after each match.")
    max_results: int = Field(grep.MAX_GREP_RESULTS, description="Matches returned at most.")
    max_file_size: str | int = Field(grep.DEFAULT_MAX_FILE_SIZE, description="Skip larger files (`1M`).")
    multiline: bool = False
    offset: int = Field(0, description="Matches skipped before `max_results` are kept.")
    type: str | None = Field(None, description="A ripgrep file type (`py`, `rust`).")
    recursive: bool = True
    hidden: bool = Field(False, description="Search hidden files and directories too.")
    respect_gitignore: bool = True


class EditBody(BaseModel):
    command: str = Field(description="One of str_replace, insert, undo_edit (view and create are refused).")
    path: str = Field(description="The file to edit.")
    old_str: str | None = Field(None, description="str_replace: the text to replace, matched literally.")
    new_str: str | None = Field(
        None, description="str_replace: the replacement; insert: the lines to insert."
    )
    insert_line: int | None = Field(None, description="insert: the line after which to insert (0 = top).")
    replace_mode: str | None = Field(None, description="str_replace: ALL, FIRST or LAST instead of unique.")


# ---------------------------------------------------------------- routes


@router.post("/v2/fs/mkdir", openapi_extra=json_body(MkdirBody), response_model=Envelope[files.MkdirResult])
async def mkdir(request: Request, sandbox: CurrentSandbox, user: UserQuery = None) -> JSONResponse:
    body = await parse_body(request, MkdirBody)
    result = await file_ops(sandbox.machine).mkdir(body.path, parents=body.parents, user=user)
    return ok(data_of(result))


@router.post(
    "/v2/fs/write",
    openapi_extra=json_body(WriteBody),
    response_model=Envelope[files.WriteResult],
    responses=DECODES,
)
async def write(request: Request, sandbox: CurrentSandbox, user: UserQuery = None) -> JSONResponse:
    body = await parse_body(request, WriteBody)
    data = files.decode_content(
        body.content,
        body.encoding,
        leading_newline=body.leading_newline,
        trailing_newline=body.trailing_newline,
        path=body.path,
    )
    result = await file_ops(sandbox.machine).write_file(body.path, data, append=body.append, user=user)
    return ok(data_of(result))


@router.get("/v2/fs/list", response_model=Envelope[files.ListResult])
async def list_dir(
    sandbox: CurrentSandbox,
    path: PathQuery,
    recursive: bool = False,
    max_depth: Annotated[int | None, Query(description="Depth when recursive; 1 = direct children.")] = None,
    show_hidden: bool = True,
    file_types: Annotated[list[str] | None, Query(description="Extensions to keep (`.py`).")] = None,
    sort_by: files.ListSort = "name",
    sort_desc: bool = False,
    include_size: bool = True,
    include_permissions: bool = False,
    user: UserQuery = None,
) -> JSONResponse:
    await check_user(sandbox.machine, user, "list", path)
    result = await file_ops(sandbox.machine).list_dir(
        path,
        recursive=recursive,
        max_depth=max_depth,
        show_hidden=show_hidden,
        file_types=file_types,
        sort_by=sort_by,
        sort_desc=sort_desc,
        include_size=include_size,
        include_permissions=include_permissions,
    )
    return ok(data_of(result))


@router.get("/v2/fs/search", response_model=Envelope[files.SearchResult])
async def search(
    sandbox: CurrentSandbox,
    path: PathQuery,
    pattern: Annotated[str, Query(description="A glob relative to path: `**/*.py`, `src/*.{ts,tsx}`.")],
    exclude: Annotated[
        list[str] | None, Query(description="Globs of names (or relative paths) to skip.")
    ] = None,
    include_hidden: bool = False,
    files_only: bool = True,
    max_results: int | None = None,
    user: UserQuery = None,
) -> JSONResponse:
    await check_user(sandbox.machine, user, "search", path)
    result = await file_ops(sandbox.machine).search(
        path,
        pattern,
        exclude=exclude,
        include_hidden=include_hidden,
        files_only=files_only,
        max_results=max_results,
    )
    return ok(data_of(result))


@router.post("/v2/fs/grep", openapi_extra=json_body(GrepBody), response_model=Envelope[grep.GrepResult])
async def grep_route(request: Request, sandbox: CurrentSandbox, user: UserQuery = None) -> JSONResponse:
    body = await parse_body(request, GrepBody)
    await check_user(sandbox.machine, user, "grep", body.path)
    result = await grep.grep(
        sandbox.machine,
        body.path,
        body.pattern,
        include=body.include,
        exclude=body.exclude,
        case_insensitive=body.case_insensitive,
        fixed_strings=body.fixed_strings,
        context_before=body.context_before,
        context_after=body.context_after,
        max_results=body.max_results,
        max_file_size=body.max_file_size,
        multiline=body.multiline,
        offset=body.offset,
        file_type=body.type,
        recursive=body.recursive,
        hidden=body.hidden,
        respect_gitignore=body.respect_gitignore,
    )
    return ok(data_of(result))


@router.post(
    "/v2/fs/edit", openapi_extra=json_body(EditBody), response_model=Envelope[EditResult], responses=DECODES
)
async def edit(request: Request, sandbox: CurrentSandbox, user: UserQuery = None) -> JSONResponse:
    body = await parse_body(request, EditBody)
    await check_user(sandbox.machine, user, "edit", body.path)
    result = await run_edit(sandbox.editor, sandbox.machine, body)
    return ok(data_of(result))


async def run_edit(editor: Editor, machine: Machine, body: EditBody) -> Any:
    """One of the three editor commands v2 keeps; the others name the route to use instead."""
    command, path = body.command, body.path
    if command in EDIT_REPLACEMENTS:
        raise bad_request(
            "edit", f"command {command!r} is not available here; use {EDIT_REPLACEMENTS[command]}", path
        )
    if command not in EDIT_COMMANDS:
        raise bad_request("edit", f"command must be one of {', '.join(EDIT_COMMANDS)}, not {command!r}", path)
    if command == "str_replace":
        if body.old_str is None:
            raise bad_request("edit", "str_replace needs old_str", path)
        return await editor.str_replace(machine, path, body.old_str, body.new_str or "", body.replace_mode)
    if command == "insert":
        if body.insert_line is None or body.new_str is None:
            raise bad_request("edit", "insert needs insert_line and new_str", path)
        return await editor.insert(machine, path, body.insert_line, body.new_str)
    return await editor.undo_edit(machine, path)


@router.get("/v2/fs/read", response_model=Envelope[files.ReadResult], responses=DECODES)
async def read(
    sandbox: CurrentSandbox,
    path: PathQuery,
    start_line: Annotated[int | None, Query(description="First line, 0-based.")] = None,
    end_line: Annotated[int | None, Query(description="Line to stop before (exclusive).")] = None,
    user: UserQuery = None,
) -> JSONResponse:
    await check_user(sandbox.machine, user, "read", path)
    result = await file_ops(sandbox.machine).read_text(path, start_line, end_line)
    return ok(data_of(result))


@router.get(
    "/v2/fs/download",
    response_class=StreamingResponse,
    responses={
        **streamed("*/*", "The file's bytes (its guessed media type); 206 for a Range", 206),
        **failures(416),
    },
)
async def download(request: Request, sandbox: CurrentSandbox, path: PathQuery) -> Response:
    refuse_user(request, "download")
    target = await file_ops(sandbox.machine).download(path)
    try:
        span = files.parse_range(request.headers.get("range"), target.size, path)
    except RangeNotSatisfiable as exc:
        response = failure(exc)
        response.status_code = 416
        response.headers["Content-Range"] = f"bytes */{exc.size}"
        return response
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Disposition": attachment(posixpath.basename(target.path)),
        "Last-Modified": http_date(target.mtime),
    }
    media_type = mimetypes.guess_type(target.path)[0] or "application/octet-stream"
    if span is None:
        headers["Content-Length"] = str(target.size)
        return StreamingResponse(target.chunks(0, None), media_type=media_type, headers=headers)
    start, end = span
    headers["Content-Length"] = str(end - start + 1)
    headers["Content-Range"] = f"bytes {start}-{end}/{target.size}"
    return StreamingResponse(
        target.chunks(start, end), status_code=206, media_type=media_type, headers=headers
    )


def attachment(name: str) -> str:
    """A Content-Disposition naming the file, safe for any name (RFC 6266 `filename*`)."""
    ascii_name = "".join(
        "_" if c < " " or c in '"\\\x7f' else c for c in name.encode("ascii", "replace").decode()
    )  # a control character (a newline in a file name) would make the header invalid
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


def http_date(timestamp: float) -> str:
    return formatdate(timestamp, usegmt=True)


class UploadData(BaseModel):
    """An upload's result: where it landed (`path` and `file_path` alike) and its size."""

    path: str
    file_path: str
    file_size: int


@router.post("/v2/fs/upload", openapi_extra=UPLOAD_FORM, response_model=Envelope[UploadData])
async def upload(request: Request, sandbox: CurrentSandbox, user: UserQuery = None) -> JSONResponse:
    """Read within `v1_file.MAX_UPLOAD_FORM_BYTES` while it arrives (never spooled past it)."""
    machine = sandbox.machine
    async with upload_form(request) as form:
        file, path = form.get("file"), form.get("path")
        if not isinstance(file, UploadFile):
            raise BodyError(
                [{"loc": ["file"], "msg": "Field required: a multipart file part", "type": "missing"}]
            )
        if path is not None and not isinstance(path, str):
            raise BodyError([{"loc": ["path"], "msg": "`path` must be a text field", "type": "string_type"}])
        target = path if path is not None else upload_default_path(machine, file.filename)
        result = await file_ops(machine).upload(target, upload_chunks(file), user=user)
    return ok({"path": result.file_path, **data_of(result)})


def upload_default_path(machine: Machine, filename: str | None) -> str:
    """Without `path`, an upload lands in the machine's root under the part's own file name."""
    name = posixpath.basename(filename or "")
    if name in ("", ".", ".."):
        raise bad_request("upload", "no path given and the uploaded part has no usable file name")
    return posixpath.join(machine.root, name)


async def upload_chunks(file: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await file.read(UPLOAD_CHUNK_BYTES):
        yield chunk


@router.get(
    "/v2/fs/tree",
    response_class=StreamingResponse,
    responses=streamed("application/x-tar", "The directory as a tar archive"),
)
async def get_tree(request: Request, sandbox: CurrentSandbox, path: PathQuery) -> Response:
    refuse_user(request, "tree")
    chunks = await file_ops(sandbox.machine).tar_stream(path)
    name = posixpath.basename(path.rstrip("/")) or "root"
    headers = {"Content-Disposition": attachment(f"{name}.tar")}
    return StreamingResponse(chunks, media_type="application/x-tar", headers=headers)


TAR_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.put("/v2/fs/tree", openapi_extra=TAR_BODY, response_model=Envelope[tree.TreeResult])
async def put_tree(
    request: Request, sandbox: CurrentSandbox, path: PathQuery, user: UserQuery = None
) -> JSONResponse:
    refuse_declared(request, tree.MAX_TREE_BYTES, "tree")  # a larger body is refused unread
    result = await file_ops(sandbox.machine).untar(path, request.stream(), user=user)
    return ok(data_of(result))
