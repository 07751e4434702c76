"""`agentbox run / sessions / events --url`: the same commands against a running `agentbox serve`.

The turn runs on the server; this side only speaks the sessions API (`agentbox.api.sessions`):

    POST  /v1/sessions                       a new session (model, script, permission_mode)
    GET   /v1/sessions/{id}, PATCH ...       `--session`, and `--mode` on it
    POST  /v1/sessions/{id}/messages         the task; 202 {turn_id}
    GET   /v1/sessions/{id}/events/stream    ?after&deltas=true&heartbeat: what `follow` renders
    POST  /v1/sessions/{id}/approvals/{aid}  an answer at the prompt (409: answered already)
    POST  /v1/sessions/{id}/turns/{tid}/abort  Ctrl-C
    GET   /v1/sessions, /v1/sessions/{id}/events   `sessions`, `events` (JSON pages)

The SSE frames are parsed back into the store's `Event` and the runtime's `Delta`, so the
in-process renderer (`cli_run.follow`) shows them unchanged. The stream is read without
`until=turn_end` and closed by this side after its own turn's terminal event (the server's
`until` follows the turn running at request time, which may be another client's).

A stream that breaks before the turn ends is opened again from the last event seen
(`RECONNECTS` times): a restarted server recovers the turn and the client follows it. Every
failure to talk to the server (refused connection, timeout, 401, an error envelope, a stream
that stays lost) is a `RemoteError`: one line, exit status 3, no traceback.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from agentbox.agent.events import DELTA_EVENT, Delta
from agentbox.agent.providers.sse import ServerSentEvent, sse_events
from agentbox.cli_run import (
    EXIT_CODES,
    EXIT_REFUSED,
    Item,
    RunOptions,
    RunRefused,
    event_line,
    follow,
    new_session_fields,
    reused_session,
    session_line,
)
from agentbox.store.approvals import Decision, Scope
from agentbox.store.sessions import MAX_EVENTS_PAGE, Event

#: Seconds a plain request (and connecting the stream) may take.
REQUEST_TIMEOUT_S = 30.0
#: Seconds between the stream's heartbeats (asked of the server: `heartbeat=`).
HEARTBEAT_S = 15.0
#: Seconds the stream may stay silent (no event, no heartbeat) before the server counts as lost.
STREAM_SILENCE_S = 3 * HEARTBEAT_S
#: Times a broken event stream is opened again (from the last event seen) before giving up.
RECONNECTS = 4
#: Seconds before the first reconnect; doubled for each further one (0.5 + 1 + 2 + 4 = 7.5 s).
RECONNECT_DELAY_S = 0.5
#: Characters of a non-envelope error body quoted in a `RemoteError`.
ERROR_BODY_CHARS = 200
#: The wire keys of an event that are its envelope; the rest is its `data` (`Event.to_dict`).
ENVELOPE_KEYS = frozenset({"id", "seq", "type", "session_id", "turn_id", "created_at"})


class RemoteError(Exception):
    """The server could not be reached or refused; the message is one line for the terminal."""


class RemoteRefused(RemoteError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


def refusal(response: httpx.Response) -> RemoteRefused:
    """The error an error response stands for: the envelope's `message`, else the body's start."""
    if response.status_code == 401:
        return RemoteRefused(401, "missing or invalid API key (give --api-key or set AGENTBOX_API_KEY)")
    try:
        body = response.json()
    except ValueError:
        body = None
    message = ""
    if isinstance(body, dict):
        errors = body.get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):  # a bad body (400)
            error = errors[0]
            where = ".".join(str(p) for p in error.get("location", [])[1:])
            message = f"{where}: {error.get('message', '')}" if where else str(error.get("message", ""))
        else:
            message = str(body.get("message") or body.get("detail") or "")
    if not message:
        message = response.text.strip().replace("\n", " ")[:ERROR_BODY_CHARS] or response.reason_phrase
    return RemoteRefused(response.status_code, message)


def unreachable(url: str, exc: httpx.HTTPError) -> RemoteError:
    return RemoteError(f"cannot reach {url}: {exc or type(exc).__name__}")


def event_of(data: dict[str, Any]) -> Event:
    """The stored event a wire event (`Event.to_dict`: envelope and payload, flat) was made from."""
    payload = {k: v for k, v in data.items() if k not in ENVELOPE_KEYS}
    return Event(
        str(data["id"]), str(data["session_id"]), int(data["seq"]), str(data["type"]),
        data.get("turn_id"), payload, str(data["created_at"]),
    )  # fmt: skip


def item_of(frame: ServerSentEvent, after: int) -> Event | Delta:
    """An SSE frame as `follow` reads it; a delta has no seq on the wire: `after` is the last seen."""
    data = _json_object(frame.data)
    if frame.event == DELTA_EVENT:
        return Delta(
            str(data["session_id"]), str(data["turn_id"]), str(data["text"]), int(data["index"]), after
        )
    return event_of(data)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text[:ERROR_BODY_CHARS]}")
    return value


@dataclass
class Remote:
    """A server's sessions API: one `httpx.AsyncClient`, errors as `RemoteError`."""

    url: str
    client: httpx.AsyncClient

    async def call(
        self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        """The JSON of a 2xx answer to `method path` (with `body` as JSON)."""
        try:
            response = await self.client.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise unreachable(self.url, exc) from None
        if response.status_code >= 400:
            raise refusal(response)
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.url}{path}: not a JSON answer (is this an agentbox server?)") from None

    async def last_seq(self, session_id: str) -> int:
        """The seq of the session's last event (the session view's `last_seq`)."""
        session = await self.call("GET", f"/v1/sessions/{session_id}")
        return int(session["last_seq"])

    async def stream(self, session_id: str, after: int, turn_id: str) -> AsyncGenerator[Item, None]:
        """The session's events (and text deltas) after `after`, until `turn_id`'s terminal event.

        A stream that breaks is opened again from the last event seen (the log replays from
        there, so nothing is shown twice or missed), `RECONNECTS` times with a doubling wait:
        a server that restarts recovers the turn, and this side follows it to its end.
        """
        path = f"/v1/sessions/{session_id}/events/stream"
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=STREAM_SILENCE_S)
        lost = ""
        for attempt in range(RECONNECTS + 1):
            if attempt:
                await asyncio.sleep(RECONNECT_DELAY_S * 2 ** (attempt - 1))
            params: dict[str, Any] = {"after": after, "deltas": "true", "heartbeat": HEARTBEAT_S}
            try:
                async with self.client.stream("GET", path, params=params, timeout=timeout) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise refusal(response)
                    async for frame in sse_events(response.aiter_bytes()):
                        item = item_of(frame, after)
                        if isinstance(item, Event):
                            after = item.seq
                        yield item
                        if isinstance(item, Event) and item.turn_id == turn_id and item.type in EXIT_CODES:
                            return
            except httpx.HTTPError as exc:
                lost = f"lost the event stream of {self.url} ({exc or type(exc).__name__})"
            except (ValueError, KeyError, TypeError) as exc:
                lost = f"a malformed event on the stream of {self.url} ({exc})"
                break
            else:
                lost = f"{self.url} closed the event stream"
        raise RemoteError(
            f"{lost} before turn {turn_id} ended; it may still run: agentbox events {session_id} --url {self.url}"
        )

    async def events(self, session_id: str, after: int) -> AsyncIterator[Event]:
        """Every stored event after `after`, a page at a time."""
        while True:
            page = await self.call(
                "GET", f"/v1/sessions/{session_id}/events", params={"after": after, "limit": MAX_EVENTS_PAGE}
            )
            for data in page["items"]:
                yield event_of(data)
            if not page["has_more"]:
                return
            after = int(page["next_after"])


@dataclass(frozen=True)
class RemoteControl:
    """Approvals and aborts of one session, through the server."""

    remote: Remote
    session_id: str

    async def answer(self, approval_id: str, decision: Decision, scope: Scope, message: str | None) -> bool:
        body = {"decision": decision, "scope": scope, "message": message}
        try:
            await self.remote.call(
                "POST", f"/v1/sessions/{self.session_id}/approvals/{approval_id}", body=body
            )
        except RemoteRefused as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def abort(self, turn_id: str) -> None:
        await self.remote.call("POST", f"/v1/sessions/{self.session_id}/turns/{turn_id}/abort")


@asynccontextmanager
async def connected(url: str, api_key: str | None) -> AsyncIterator[Remote]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
        yield Remote(base, client)


async def open_session(remote: Remote, opts: RunOptions) -> tuple[str, int]:
    """The session to run in (`--session`, its mode updated if `--mode` is given, or a new one)
    and the seq its turn's events will follow."""
    reused = reused_session(opts)
    if reused is None:
        created = await remote.call("POST", "/v1/sessions", body=new_session_fields(opts))
        return str(created["id"]), 0
    session = await remote.call("GET", f"/v1/sessions/{reused}")
    if opts.mode is not None and opts.mode != session["permission_mode"]:
        await remote.call("PATCH", f"/v1/sessions/{reused}", body={"permission_mode": opts.mode})
    return reused, await remote.last_seq(reused)


async def run_turn(opts: RunOptions, console: Console, url: str, api_key: str | None) -> int:
    """Submit the task to the server and render the turn to its end; the exit status (`EXIT_CODES`)."""
    try:
        async with connected(url, api_key) as remote:
            try:
                session_id, after = await open_session(remote, opts)
            except RunRefused as exc:
                raise RemoteError(str(exc)) from None
            posted = await remote.call(
                "POST", f"/v1/sessions/{session_id}/messages", body={"content": opts.task}
            )
            turn_id = str(posted["turn_id"])
            items = remote.stream(session_id, after, turn_id)
            return await follow(console, RemoteControl(remote, session_id), session_id, turn_id, items)
    except RemoteError as exc:
        console.print(f"[red]agentbox run: {escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


async def list_sessions(console: Console, url: str, api_key: str | None) -> int:
    """One `session_line` per session of the server."""
    try:
        async with connected(url, api_key) as remote:
            params: dict[str, Any] = {"limit": MAX_EVENTS_PAGE}
            while True:
                page = await remote.call("GET", "/v1/sessions", params=params)
                for session in page["items"]:
                    console.print(escape(session_line(session)), highlight=False, soft_wrap=True)
                if not page["has_more"]:
                    return 0
                params["after"] = page["next_after"]
    except RemoteError as exc:
        console.print(f"agentbox sessions: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


async def print_events(console: Console, session_id: str, after: int, url: str, api_key: str | None) -> int:
    """One `event_line` per event of the server's session after `after`; 3 if it has no such session."""
    try:
        async with connected(url, api_key) as remote:
            async for event in remote.events(session_id, after):
                console.print(escape(event_line(event)), highlight=False, soft_wrap=True)
    except RemoteError as exc:
        console.print(f"agentbox events: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    return 0


#: Seconds each poll of a running command waits for it to end (its output is printed between polls).
EXEC_POLL_WAIT_S = 1.0


async def exec_command(
    argv: list[str], session: str, cwd: str | None, url: str, api_key: str | None, stdin: bytes | None = None
) -> int:
    """`agentbox exec` through a server: the command's exit code, its output printed as it grows.

    The command runs in the server's sandbox of `session` (`POST /sandboxes/{session}/v2/commands`,
    async), then is polled with `?wait=` until it ends. Output the server had to cut (head and
    tail kept) is no longer streamed; a note on stderr says so.
    """
    command = argv[0] if len(argv) == 1 else shlex.join(argv)
    base = f"/sandboxes/{session}/v2/commands"
    async with connected(url, api_key) as remote:
        body: dict[str, Any] = {"command": command, "cwd": cwd, "mode": "async"}
        if stdin is not None:
            body["stdin"] = stdin.decode("utf-8", "surrogateescape")
        data = (await remote.call("POST", base, body=body))["data"]
        shown = {"stdout": 0, "stderr": 0}
        while True:
            _print_new(data, shown)
            if data["status"] != "running":
                break
            params = {"wait": EXEC_POLL_WAIT_S}
            data = (await remote.call("GET", f"{base}/{data['command_id']}", params=params))["data"]
    if data.get("error"):
        raise RemoteError(f"the command could not run: {data['error']}")
    return int(data["exit_code"]) if data.get("exit_code") is not None else 1


def _print_new(data: dict[str, Any], shown: dict[str, int]) -> None:
    """Write the part of each stream not written yet (unless the server cut it meanwhile)."""
    for name, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        text = str(data.get(name) or "")
        if data.get(f"{name}_truncated"):
            if shown[name] >= 0:
                sys.stderr.write(f"[agentbox: {name} was cut by the server; the rest is not shown]\n")
            shown[name] = -1
            continue
        if shown[name] >= 0 and len(text) > shown[name]:
            out.buffer.write(text[shown[name] :].encode())
            out.flush()
            shown[name] = len(text)
