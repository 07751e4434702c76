"""`agentbox run`, `sessions`, `events`: drive one turn and show it in the terminal.

In-process (the default), `run` opens the home's database, machine registry and file store
itself and starts the same `System` the server runs on (no server needed), so the turn, its
events and its approvals are exactly what the sessions API would show. With `--url` the turn
runs on a server instead, driven through the SDK (`agentbox.client`); nothing is opened on
this side's home. Either way ONE loop shows it: `follow` reads the session's events (here
`EventBus.subscribe(..., until_turn=, deltas=True)`, there the SDK's resumable stream with
deltas, its items read back as the store's `Event` and the runtime's `Delta`) and acts
through a `TurnControl` (answer an approval, abort the turn). Text deltas are printed as they come, tool calls with their inputs, results folded to
`RESULT_LINES` lines, a spinner with the seconds a tool has run, and an `approval.requested` is asked at the
prompt and answered through the control (in-process: the platform's `Approvals`, the same path
as POST .../approvals/{id}; remote: that route).

The exit status says how the turn ended (`EXIT_CODES`): 0 completed, 1 failed, 2 aborted;
3 when the run was refused before a turn started (a bad script, an unknown session) or, remote,
when the server could not be reached or refused, or the stream was lost mid-turn (the SDK
reopens a broken stream from the last event seen, so a restarted server's recovered turn is
followed to its end). Ctrl-C aborts the turn (exit 2), also while the approval prompt waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.status import Status
from rich.text import Text

from agentbox import config as config_mod
from agentbox.agent.events import Delta
from agentbox.agent.models import SCRIPTED, ModelError, model_name_problem
from agentbox.store.approvals import ApprovalNotPending, Decision, Scope
from agentbox.store.sessions import MAX_EVENTS_PAGE, Event, Session

if TYPE_CHECKING:
    from agentbox.client import AgentboxError, AsyncClient, MessageDelta
    from agentbox.client import Event as SdkEvent
    from agentbox.system import System

#: How each terminal turn event maps to the process's exit status.
EXIT_CODES: dict[str, int] = {"turn.completed": 0, "turn.failed": 1, "turn.aborted": 2}
#: Exit status when the run is refused before any turn starts (bad options, script or session),
#: or when a server (`--url`) cannot be reached, refuses a request or its stream is lost.
EXIT_REFUSED = 3
#: Lines of a tool result shown before the rest is folded into "… N more lines".
RESULT_LINES = 4
#: Characters of a tool input (as JSON) shown on a tool call's line.
INPUT_CHARS = 300
#: Characters of an event's payload shown per line by `agentbox events`.
EVENT_LINE_CHARS = 200
#: Answers at the approval prompt: (decision, scope) for each accepted word.
ANSWERS: dict[str, tuple[Decision, Scope]] = {
    "y": ("allow", "once"),
    "yes": ("allow", "once"),
    "n": ("deny", "once"),
    "no": ("deny", "once"),
    "a": ("allow", "session"),
    "always": ("allow", "session"),
}

#: One dim line for events that are worth a glance but need nothing from the user.
NOTES: dict[str, Callable[[dict[str, Any]], str]] = {
    "subagent.started": lambda d: f"  ↳ {d.get('agent')} started: {d.get('description') or '(task)'}",
    "subagent.completed": lambda d: (
        f"  ↳ {d.get('agent')} {d.get('status')} after {d.get('steps')} model calls"
    ),
    "agent.context_compacted": lambda d: (
        f"context compacted ({d.get('reason')}): {d.get('tokens_before')} → {d.get('tokens_after')} tokens"
    ),
    "file.delivered": lambda d: f"delivered {d.get('filename')} ({d.get('bytes')} bytes, {d.get('file_id')})",
    "change_set.updated": lambda d: f"change set {d.get('change_set_id')} updated",
    "browser.screenshot": lambda d: (
        f"screenshot of {d.get('url')} ({d.get('bytes')} bytes, {d.get('file_id')})"
    ),
    "browser.takeover": lambda d: f"you took over the browser ({d.get('cancelled')} action(s) cancelled)",
    "browser.released": lambda d: "the browser is the agent's again",
}

#: What the approval prompt says.
PROMPT = "  [y]es / [n]o / [a]lways (this session): "

#: What `follow` reads: stored events, text deltas, and None (an idle tick, ignored).
Item = Event | Delta | None


class RunRefused(Exception):
    """The run cannot start (the message says why); nothing was submitted."""


@dataclass(frozen=True)
class RunOptions:
    task: str
    model: str = SCRIPTED
    mode: str | None = None
    session: str | None = None
    script: Path | None = None
    instructions: str | None = None
    options: tuple[str, ...] = ()
    """`--option KEY=VALUE`s: the session's `model_options` (a VALUE that parses as JSON is taken as such)."""
    machine: str | None = None

    def creation_flags(self) -> list[str]:
        """The options given that only a new session can take."""
        given = {"--script": self.script, "--instructions": self.instructions, "--option": self.options,
                 "--machine": self.machine}  # fmt: skip
        return [flag for flag, value in given.items() if value]


def model_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as a dict; `8192` and `true` become JSON values, the rest stay text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RunRefused(f"--option takes KEY=VALUE, not {pair!r}")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


class TurnControl(Protocol):
    """Where the turn runs, as the terminal acts on it (in-process platform or a server)."""

    async def answer(self, approval_id: str, decision: Decision, scope: Scope, message: str | None) -> bool:
        """Answer an approval; False when it was answered already (by someone else)."""
        ...

    async def abort(self, turn_id: str) -> None: ...


def load_script(path: Path) -> list[Any]:
    """The scripted model's steps from a JSON file holding a list (as in the sessions API)."""
    try:
        steps = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunRefused(f"cannot read script {path}: {exc}") from None
    if not isinstance(steps, list):
        raise RunRefused(f"script {path} must hold a JSON list of steps")
    return steps


def reused_session(opts: RunOptions) -> str | None:
    """`--session`, refused with what is fixed when a session is created (`--script`, ...)."""
    fixed = opts.creation_flags()
    if opts.session is not None and fixed:
        raise RunRefused(f"{', '.join(fixed)}: fixed at creation, so not with --session")
    return opts.session


def new_session_fields(opts: RunOptions) -> dict[str, Any]:
    """The fields of the session `run` creates (model, script, permission_mode), checked here so
    both modes refuse the same options the same way."""
    if opts.model == SCRIPTED and opts.script is None:
        raise RunRefused("--model scripted needs --script FILE.json (a list of steps)")
    problem = model_name_problem(opts.model)
    if problem is not None:
        raise RunRefused(f"--model {problem}")
    fields: dict[str, Any] = {"model": opts.model}
    if opts.script is not None:
        fields["script"] = load_script(opts.script)
    if opts.mode is not None:
        fields["permission_mode"] = opts.mode
    if opts.instructions is not None:
        fields["instructions"] = opts.instructions
    if opts.options:
        fields["model_options"] = model_options(opts.options)
    if opts.machine is not None:
        fields["machine"] = opts.machine
    return fields


@asynccontextmanager
async def opened_platform() -> AsyncIterator[System]:
    """The running system on the configured home (`agentbox.system`), closed after."""
    from agentbox.system import opened_system

    async with opened_system(config_mod.load()) as system:
        yield system


async def open_session(p: System, opts: RunOptions) -> Session:
    """The session to run in: `--session` (its mode updated if `--mode` is given), or a new one."""
    reused = reused_session(opts)
    if reused is None:
        fields = new_session_fields(opts)
        return await p.worker.create_session(fields.pop("model"), **fields)
    session = await p.store.get_session(reused)
    if opts.mode is not None and opts.mode != session.permission_mode:
        session = await p.worker.update_session(session.id, {"permission_mode": opts.mode})
    return session


@dataclass(frozen=True)
class LocalControl:
    """The in-process platform's approvals and worker."""

    platform: System

    async def answer(self, approval_id: str, decision: Decision, scope: Scope, message: str | None) -> bool:
        try:
            await self.platform.approvals.resolve(approval_id, decision, scope, message)
        except ApprovalNotPending:
            return False
        return True

    async def abort(self, turn_id: str) -> None:
        await self.platform.worker.abort(turn_id)


async def read_line() -> str | None:
    """One line from stdin without blocking the loop (None at end of input); cancellable."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    done: asyncio.Future[str | None] = loop.create_future()
    buffer = bytearray()

    def readable() -> None:
        chunk = os.read(fd, 1024)
        buffer.extend(chunk)
        if (not chunk or b"\n" in buffer) and not done.done():
            done.set_result(buffer.decode(errors="replace") if buffer else None)

    try:
        loop.add_reader(fd, readable)
    except (OSError, ValueError, NotImplementedError):  # a regular file: it never blocks for long
        line = await asyncio.to_thread(sys.stdin.readline)
        return line or None
    try:
        return await done
    finally:
        loop.remove_reader(fd)


@dataclass
class Elapsed:
    """A spinner's text that shows how long the tool has run (rich renders it on each refresh)."""

    label: str
    began: float = field(default_factory=time.monotonic)

    def __rich__(self) -> Text:
        return Text(f"{self.label}… {time.monotonic() - self.began:.0f}s")


@dataclass
class Renderer:
    """Shows one session's events in the terminal and answers its approvals at the prompt."""

    console: Console
    control: TurnControl
    streamed: set[str] = field(default_factory=set)
    """Turns whose current reply was already printed from deltas."""
    status: Status | None = None
    interrupted: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by Ctrl-C: the turn is being aborted, so a waiting prompt gives up and no more are asked."""

    def stop_spinner(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    async def show(self, item: Event | Delta) -> None:
        if isinstance(item, Delta):
            self.stop_spinner()
            self.console.print(escape(item.text), end="", style="bold", highlight=False)
            self.streamed.add(item.turn_id)
            return
        data = item.data
        if item.type == "agent.message":
            self.stop_spinner()
            if item.turn_id in self.streamed:
                self.streamed.discard(item.turn_id)
                self.console.print()
            else:
                self.console.print(escape(message_text(data)), style="bold", highlight=False)
        elif item.type == "agent.tool_use":
            self.stop_spinner()
            shown = json.dumps(data.get("input", {}), ensure_ascii=False)
            shown = shown if len(shown) <= INPUT_CHARS else shown[:INPUT_CHARS] + "…"
            self.console.print(f"[cyan]→ {escape(str(data.get('name')))}[/] {escape(shown)}", highlight=False)
            self.status = self.console.status(Elapsed(f"running {data.get('name')}"))
            self.status.start()
        elif item.type == "agent.tool_result":
            self.stop_spinner()
            style = "red" if data.get("is_error") else "dim"
            self.console.print(escape(fold(message_text(data))), style=style, highlight=False)
        elif item.type == "approval.requested":
            self.stop_spinner()
            if not self.interrupted.is_set():  # an aborting turn is not asked about
                await self.ask(data)
        elif item.type == "approval.resolved":
            self.console.print(f"[dim]{escape(resolution(data))}[/]", highlight=False)
        elif item.type in ("session.error", "turn.failed"):
            self.stop_spinner()
            error = data.get("error") or {}
            self.console.print(f"[red]{escape(item.type)}: {escape(str(error.get('message', error)))}[/]")
        elif item.type in EXIT_CODES:
            self.stop_spinner()
            self.console.print(f"[bold]{escape(item.type.removeprefix('turn.'))}[/]")
        elif item.type in NOTES:
            self.console.print(f"[dim]{escape(NOTES[item.type](data))}[/]", highlight=False)

    async def ask(self, data: dict[str, Any]) -> None:
        """Ask until a known answer (y / n / always); end of input denies; Ctrl-C leaves it to the abort."""
        arguments = json.dumps((data.get("detail") or {}).get("arguments", {}), ensure_ascii=False)
        self.console.print(
            f"[yellow]? allow {escape(str(data.get('tool')))} ({escape(str(data.get('action')))})"
            f" {escape(arguments[:INPUT_CHARS])}[/]",
            highlight=False,
        )
        answering = asyncio.ensure_future(self.answer())
        interrupted = asyncio.ensure_future(self.interrupted.wait())
        try:
            await asyncio.wait({answering, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (answering, interrupted):
                waiting.cancel()
            await asyncio.gather(answering, interrupted, return_exceptions=True)
        if answering.cancelled():  # Ctrl-C: the abort settles the approval
            self.console.print()
            return
        decision, scope, message = answering.result()
        if not await self.control.answer(str(data["approval_id"]), decision, scope, message):
            self.console.print("[dim]already answered[/]")

    async def answer(self) -> tuple[Decision, Scope, str | None]:
        while True:
            self.console.print(escape(PROMPT), style="yellow", end="", highlight=False)
            line = await read_line()
            if line is None:
                return "deny", "once", "no answer (end of input)"
            answer = ANSWERS.get(line.strip().lower())
            if answer is not None:
                return answer[0], answer[1], None


def message_text(data: dict[str, Any]) -> str:
    """The text blocks of an event's `content` (a list of blocks or a plain string)."""
    content = data.get("content", "")
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and "text" in b)


def resolution(data: dict[str, Any]) -> str:
    """An `approval.resolved` as a person says it."""
    tool, decision, message = data.get("tool", "the call"), data.get("decision"), data.get("message")
    if decision == "allow":
        said = f"{tool} allowed " + (
            "for the rest of the session" if data.get("scope") == "session" else "once"
        )
    elif decision == "deny":
        said = f"{tool} denied"
    else:  # cancelled: the turn ended (aborted) before anyone answered
        said = f"{tool} not asked any more: the turn ended before an answer"
    return f"{said}: {message}" if message and decision != "cancelled" else said


#: Lines of an exec result that only mark where each stream starts and ends (`tools.shell`).
STREAM_TAGS = frozenset({"<stdout>", "</stdout>", "<stderr>", "</stderr>"})


def fold(text: str, keep: int = RESULT_LINES) -> str:
    """The first `keep` lines of `text` and how many more there were; an exec result's stream
    tags are left out (stderr is announced by a line of its own)."""
    lines = ["stderr:" if line == "<stderr>" else line for line in text.splitlines()]
    lines = [line for line in lines if line not in STREAM_TAGS]
    if len(lines) <= keep:
        return "\n".join(lines)
    return "\n".join([*lines[:keep], f"… {len(lines) - keep} more lines"])


async def follow(
    console: Console, control: TurnControl, session_id: str, turn_id: str, items: AsyncGenerator[Item, None]
) -> int:
    """Render the turn from `items` (the session's events from before it was submitted) to its
    end; Ctrl-C aborts it through `control`. The exit status (see `EXIT_CODES`)."""
    renderer = Renderer(console, control)
    loop = asyncio.get_running_loop()
    aborting: list[asyncio.Task[Any]] = []

    def interrupted() -> None:
        if not aborting:
            renderer.interrupted.set()
            aborting.append(loop.create_task(control.abort(turn_id)))

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, interrupted)
    console.print(f"[dim]session {session_id} · turn {turn_id}[/]")  # Ctrl-C aborts from here
    ended = "turn.aborted"
    try:
        async with contextlib.aclosing(items):
            async for item in items:
                if item is None or item.turn_id not in (turn_id, None):
                    continue
                await renderer.show(item)
                if isinstance(item, Event) and item.turn_id == turn_id and item.type in EXIT_CODES:
                    ended = item.type
                    break
    finally:
        renderer.stop_spinner()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
        await asyncio.gather(*aborting, return_exceptions=True)
    return EXIT_CODES[ended]


async def run_turn(opts: RunOptions, console: Console) -> int:
    """Submit the task in-process and render the turn to its end; the exit status (see `EXIT_CODES`)."""
    async with opened_platform() as p:
        try:
            session = await open_session(p, opts)
        except (RunRefused, LookupError, ValueError, ModelError) as exc:  # ModelError: a bad script
            console.print(f"[red]agentbox run: {escape(str(exc))}[/]")
            return EXIT_REFUSED
        after = await p.store.last_seq(session.id)
        turn_id = (await p.worker.submit(session.id, opts.task)).turn.id
        items = p.bus.subscribe(session.id, after, until_turn=turn_id, deltas=True)
        return await follow(console, LocalControl(p), session.id, turn_id, items)


def session_line(session: dict[str, Any]) -> str:
    """`agentbox sessions`' line: id, model, status (idle / running / awaiting_approval), created."""
    return f"{session['id']}  {session['model']}  {session['status']}  {session['created_at']}"


def event_line(event: Event) -> str:
    """`agentbox events`' line: seq, type, turn, payload cut to `EVENT_LINE_CHARS`."""
    payload = json.dumps(event.data, ensure_ascii=False)
    payload = payload if len(payload) <= EVENT_LINE_CHARS else payload[:EVENT_LINE_CHARS] + "…"
    return f"{event.seq:>5}  {event.type:<22} {event.turn_id or '-'}  {payload}"


async def list_sessions(console: Console) -> int:
    """One `session_line` per session of the home."""
    async with opened_platform() as p:
        after: str | None = None
        while page := await p.store.list_sessions(after=after, limit=MAX_EVENTS_PAGE):
            for s in page:
                line = session_line({**s.to_dict(), "status": await p.store.activity(s.id)})
                console.print(escape(line), highlight=False, soft_wrap=True)
            after = page[-1].id
    return 0


async def print_events(console: Console, session_id: str, after: int) -> int:
    """One `event_line` per event after `after`; 3 if no such session."""
    async with opened_platform() as p:
        try:
            await p.store.get_session(session_id)
        except LookupError as exc:
            console.print(f"agentbox events: {escape(str(exc))}", highlight=False)
            return EXIT_REFUSED
        while page := await p.store.list_events(session_id, after=after, limit=MAX_EVENTS_PAGE):
            for e in page:
                console.print(escape(event_line(e)), highlight=False, soft_wrap=True)
            after = page[-1].seq
    return 0


# ---------------------------------------------------------------- against a server (`--url`)


def remote_failure(exc: AgentboxError) -> str:
    """An SDK failure as the one line the terminal shows."""
    from agentbox.client import APIError, Unauthorized

    if isinstance(exc, Unauthorized):
        return "401 missing or invalid API key (give --api-key or set AGENTBOX_API_KEY)"
    if isinstance(exc, APIError):
        return f"{exc.status} {exc.message}"
    return exc.message


def stored(item: SdkEvent | MessageDelta, after: int) -> Event | Delta:
    """An SDK item as `follow` reads it: the store's `Event`, or a `Delta` placed after `after`."""
    from agentbox.client import MessageDelta

    if isinstance(item, MessageDelta):
        return Delta(item.session_id, item.turn_id, item.text, item.index, after)
    return as_stored(item)


def as_stored(event: SdkEvent) -> Event:
    return Event(
        event.id, event.session_id, event.seq, event.type, event.turn_id, event.data, event.created_at
    )


@dataclass(frozen=True)
class RemoteControl:
    """Approvals and aborts of one session, through the server's API."""

    client: AsyncClient
    session_id: str

    async def answer(self, approval_id: str, decision: Decision, scope: Scope, message: str | None) -> bool:
        from agentbox.client import Conflict

        try:
            if decision == "allow":
                await self.client.approvals.allow(
                    self.session_id, approval_id, for_session=scope == "session"
                )
            else:
                await self.client.approvals.deny(self.session_id, approval_id, message)
        except Conflict:
            return False
        return True

    async def abort(self, turn_id: str) -> None:
        await self.client.sessions.abort(self.session_id, turn_id)


async def open_remote_session(client: AsyncClient, opts: RunOptions) -> tuple[str, int]:
    """The session to run in on the server (`--session`, its mode updated if `--mode` is given,
    or a new one) and the seq its turn's events follow."""
    reused = reused_session(opts)
    if reused is None:
        fields = new_session_fields(opts)
        created = await client.sessions.create(fields.pop("model"), **fields)
        return created.id, created.last_seq
    session = await client.sessions.get(reused)
    if opts.mode is not None and opts.mode != session.permission_mode:
        await client.sessions.update(reused, permission_mode=opts.mode)
    return reused, (await client.sessions.get(reused)).last_seq


async def remote_items(
    client: AsyncClient, session_id: str, after: int, turn_id: str
) -> AsyncGenerator[Item, None]:
    """The turn's events and deltas from the server; a stream lost for good is a `StreamLost`
    whose message says how to look again."""
    from agentbox.client import StreamLost

    try:
        async for item in client.events.stream(session_id, after, until_turn=turn_id, deltas=True):
            shown = stored(item, after)
            after = shown.seq if isinstance(shown, Event) else after
            yield shown
    except StreamLost as exc:
        url = client.base_url
        raise StreamLost(
            f"lost the event stream of {url} ({exc.message}) before turn {turn_id} ended; "
            f"it may still run: agentbox events {session_id} --url {url}",
            exc.last_seq,
        ) from None


async def run_remote(opts: RunOptions, console: Console, url: str, api_key: str | None) -> int:
    """Submit the task to the server and render the turn to its end; the exit status (`EXIT_CODES`)."""
    from agentbox.client import AgentboxError, AsyncClient

    try:
        async with AsyncClient(url, api_key) as client:
            try:
                session_id, after = await open_remote_session(client, opts)
            except RunRefused as exc:
                console.print(f"[red]agentbox run: {escape(str(exc))}[/]", highlight=False, soft_wrap=True)
                return EXIT_REFUSED
            turn_id = (await client.messages.send(session_id, opts.task)).turn_id
            items = remote_items(client, session_id, after, turn_id)
            return await follow(console, RemoteControl(client, session_id), session_id, turn_id, items)
    except AgentboxError as exc:
        console.print(f"[red]agentbox run: {escape(remote_failure(exc))}[/]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


async def list_remote_sessions(console: Console, url: str, api_key: str | None) -> int:
    """One `session_line` per session of the server."""
    from agentbox.client import AgentboxError, AsyncClient

    try:
        async with AsyncClient(url, api_key) as client:
            async for session in client.sessions.list():
                console.print(escape(session_line(session.raw)), highlight=False, soft_wrap=True)
    except AgentboxError as exc:
        console.print(f"agentbox sessions: {escape(remote_failure(exc))}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    return 0


async def print_remote_events(
    console: Console, session_id: str, after: int, url: str, api_key: str | None
) -> int:
    """One `event_line` per event of the server's session after `after`; 3 if it has no such session."""
    from agentbox.client import AgentboxError, AsyncClient

    try:
        async with AsyncClient(url, api_key) as client:
            async for event in client.events.list(session_id, after):
                console.print(escape(event_line(as_stored(event))), highlight=False, soft_wrap=True)
    except AgentboxError as exc:
        console.print(f"agentbox events: {escape(remote_failure(exc))}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    return 0
