"""Each request of the API as a `Call`: written once, sent by the sync and the async client.

Paths, bodies and query parameters live here and nowhere else; the resources only send a
call and read its answer into a record.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from typing import Any, Literal, TypedDict
from urllib.parse import quote

from agentbox.client._transport import HEARTBEAT_S, Call

#: Items asked for per page when a listing is walked page by page (the server's most for events).
PAGE_SIZE = 1000
#: Sessions asked for per page (the server allows at most 1000).
SESSIONS_PAGE_SIZE = 1000


class SessionFields(TypedDict, total=False):
    """What a new session may be given besides its model (the fields of POST /v1/sessions)."""

    instructions: str
    """The system instructions added to the agent's prompt."""
    mcp_servers: list[Any]
    """`{"name", "command"}` (runs in the session's machine), `{"name", "url"}`, or `{"server": name}`."""
    toolset: str
    """`default`, `workbench` or `flue`: the names the tools go by."""
    permission_mode: str
    """A tier (`read-only`, `workspace-write`, `full-ask`, `full-auto`...) or `plan`."""
    machine: str
    """The machine its turns run on (`none`: no sandbox); absent: the default."""
    metadata: dict[str, Any]
    """Anything the caller wants kept with the session."""
    script: list[Any]
    """The scripted model's steps (model `scripted`)."""
    model_options: dict[str, Any]
    """Provider options: base_url, api_key, timeout, context_window, max_output_tokens, ..."""
    compaction: bool | dict[str, Any]
    """False, or `{reserve_tokens, keep_recent_tokens, model}`; absent: the defaults."""


def segment(value: str) -> str:
    """An id as one path segment (an id with a `/` cannot reach another route)."""
    return quote(value, safe="")


def session_path(session_id: str, *rest: str) -> str:
    return "/".join([f"/v1/sessions/{segment(session_id)}", *rest])


# ---------------------------------------------------------------- sessions


def create_session(model: str, fields: SessionFields) -> Call:
    return Call("POST", "/v1/sessions", json={"model": model, **fields})


def list_sessions(after: str | None, limit: int = SESSIONS_PAGE_SIZE) -> Call:
    return Call("GET", "/v1/sessions", params={"limit": limit, **({"after": after} if after else {})})


def get_session(session_id: str) -> Call:
    return Call("GET", session_path(session_id))


def update_session(session_id: str, permission_mode: str | None, metadata: dict[str, Any] | None) -> Call:
    changes: dict[str, Any] = {}
    if permission_mode is not None:
        changes["permission_mode"] = permission_mode
    if metadata is not None:
        changes["metadata"] = metadata
    return Call("PATCH", session_path(session_id), json=changes)


def delete_session(session_id: str) -> Call:
    return Call("DELETE", session_path(session_id))


def abort(session_id: str, turn_id: str | None) -> Call:
    if turn_id is None:
        return Call("POST", session_path(session_id, "abort"))
    return Call("POST", session_path(session_id, "turns", segment(turn_id), "abort"))


def get_turn(session_id: str, turn_id: str) -> Call:
    return Call("GET", session_path(session_id, "turns", segment(turn_id)))


# ---------------------------------------------------------------- messages and events


def send_message(session_id: str, content: str, files: Sequence[str], idempotency_key: str | None) -> Call:
    """A message; without a key one is made, so a retry after a lost answer cannot queue it twice."""
    key = idempotency_key or f"sdk-{uuid.uuid4()}"
    body = {"content": content, "files": list(files)}
    return Call("POST", session_path(session_id, "messages"), json=body, headers={"Idempotency-Key": key})


def list_events(session_id: str, after: int, limit: int = PAGE_SIZE) -> Call:
    return Call("GET", session_path(session_id, "events"), params={"after": after, "limit": limit})


def event_stream(session_id: str, after: int, *, deltas: bool, until_turn_end: bool) -> Call:
    params: dict[str, Any] = {"after": after, "heartbeat": HEARTBEAT_S}
    if deltas:
        params["deltas"] = "true"
    if until_turn_end:
        params["until"] = "turn_end"
    return Call("GET", session_path(session_id, "events", "stream"), params=params)


# ---------------------------------------------------------------- approvals and changes


def list_approvals(session_id: str, pending: bool) -> Call:
    return Call(
        "GET", session_path(session_id, "approvals"), params={"status": "pending"} if pending else None
    )


def answer_approval(
    session_id: str,
    approval_id: str,
    decision: Literal["allow", "deny"],
    scope: Literal["once", "session"] = "once",
    message: str | None = None,
) -> Call:
    body: dict[str, Any] = {"decision": decision, "scope": scope}
    if message is not None:
        body["message"] = message
    return Call("POST", session_path(session_id, "approvals", segment(approval_id)), json=body)


def list_changes(session_id: str) -> Call:
    return Call("GET", session_path(session_id, "changes"))


def get_changes(session_id: str, change_set_id: str) -> Call:
    return Call("GET", session_path(session_id, "changes", segment(change_set_id)))


def decide_changes(
    session_id: str,
    change_set_id: str,
    verb: Literal["apply", "reject"],
    operations: Sequence[str] | None,
    message: str | None = None,
) -> Call:
    body: dict[str, Any] = {}
    if operations is not None:
        body["operations"] = list(operations)
    if message is not None:
        body["message"] = message
    return Call("POST", session_path(session_id, "changes", segment(change_set_id), verb), json=body)


# ---------------------------------------------------------------- files


def upload_file(content: bytes, filename: str, session_id: str | None) -> Call:
    data = {"session_id": session_id} if session_id else None
    return Call("POST", "/v1/files", files={"file": (filename, content)}, data=data)


def list_files(session_id: str | None, after: str | None, limit: int = PAGE_SIZE) -> Call:
    params: dict[str, Any] = {"limit": limit}
    if session_id:
        params["session_id"] = session_id
    if after:
        params["after"] = after
    return Call("GET", "/v1/files", params=params)


def get_file(file_id: str) -> Call:
    return Call("GET", f"/v1/files/{segment(file_id)}")


def file_content(file_id: str) -> Call:
    return Call("GET", f"/v1/files/{segment(file_id)}/content")


def delete_file(file_id: str) -> Call:
    return Call("DELETE", f"/v1/files/{segment(file_id)}")


# ---------------------------------------------------------------- one session's sandbox (v2)


def sandbox_path(session_id: str, route: str) -> str:
    return f"/sandboxes/{segment(session_id)}/v2/{route}"


def run_command(
    session_id: str,
    command: str,
    *,
    mode: Literal["sync", "async"],
    cwd: str | None,
    env: dict[str, str] | None,
    timeout: float | None,
    stdin: str | bytes | None,
) -> Call:
    body: dict[str, Any] = {"command": command, "mode": mode}
    for name, value in (("cwd", cwd), ("env", env), ("timeout", timeout)):
        if value is not None:
            body[name] = value
    if stdin is not None:
        body["stdin"] = stdin.decode("utf-8", "surrogateescape") if isinstance(stdin, bytes) else stdin
    return Call("POST", sandbox_path(session_id, "commands"), json=body)


def get_command(session_id: str, command_id: str, wait: float) -> Call:
    params = {"wait": wait} if wait else None
    return Call("GET", sandbox_path(session_id, f"commands/{segment(command_id)}"), params=params)


def kill_command(session_id: str, command_id: str) -> Call:
    return Call("DELETE", sandbox_path(session_id, f"commands/{segment(command_id)}"))


def read_text(session_id: str, path: str, start_line: int | None, end_line: int | None) -> Call:
    params: dict[str, Any] = {"path": path}
    if start_line is not None:
        params["start_line"] = start_line
    if end_line is not None:
        params["end_line"] = end_line
    return Call("GET", sandbox_path(session_id, "fs/read"), params=params)


def write_file(session_id: str, path: str, content: str | bytes, append: bool) -> Call:
    """Text as UTF-8; bytes as base64, so any content arrives exactly."""
    if isinstance(content, bytes):
        body = {"path": path, "content": base64.b64encode(content).decode(), "encoding": "base64"}
    else:
        body = {"path": path, "content": content, "encoding": "utf-8"}
    return Call("POST", sandbox_path(session_id, "fs/write"), json={**body, "append": append})


def list_dir(session_id: str, path: str, recursive: bool, max_depth: int | None) -> Call:
    params: dict[str, Any] = {"path": path, "recursive": recursive}
    if max_depth is not None:
        params["max_depth"] = max_depth
    return Call("GET", sandbox_path(session_id, "fs/list"), params=params)


def make_dir(session_id: str, path: str, parents: bool) -> Call:
    return Call("POST", sandbox_path(session_id, "fs/mkdir"), json={"path": path, "parents": parents})


def upload_to(session_id: str, path: str, content: bytes) -> Call:
    name = path.rstrip("/").rsplit("/", 1)[-1] or "upload"
    return Call(
        "POST", sandbox_path(session_id, "fs/upload"), files={"file": (name, content)}, data={"path": path}
    )


def download_from(session_id: str, path: str) -> Call:
    return Call("GET", sandbox_path(session_id, "fs/download"), params={"path": path})


def describe_sandbox(session_id: str) -> Call:
    return Call("GET", sandbox_path(session_id, "sandbox"))


def start_watch(session_id: str, path: str, recursive: bool, exclude: Sequence[str] | None) -> Call:
    body: dict[str, Any] = {"path": path, "recursive": recursive}
    if exclude is not None:
        body["exclude"] = list(exclude)
    return Call("POST", sandbox_path(session_id, "watch"), json=body)


def watch_stream(session_id: str, watcher_id: str, cursor: int) -> Call:
    params = {"cursor": cursor, "heartbeat": HEARTBEAT_S}
    return Call("GET", sandbox_path(session_id, f"watch/{segment(watcher_id)}/events"), params=params)


def delete_watch(session_id: str, watcher_id: str) -> Call:
    return Call("DELETE", sandbox_path(session_id, f"watch/{segment(watcher_id)}"))
