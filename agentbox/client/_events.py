"""A session's events as typed values: one dataclass per event type the runtime writes.

Every event has the envelope (`id`, `seq`, `type`, `session_id`, `turn_id`, `created_at`)
and its whole payload in `data`; a typed event also has the payload's fields as attributes.
An event type this SDK does not know yet is kept as a plain `Event`, so a newer server never
breaks an older client. `MessageDelta` is the unstored piece of reply text a stream carries
with `deltas=True`: it has no `seq` and never moves a stream's cursor.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentbox.client._errors import ProtocolError

#: The wire keys of an event that are its envelope; the rest is its payload.
ENVELOPE_KEYS = frozenset({"id", "seq", "type", "session_id", "turn_id", "created_at"})
#: The type of the ephemeral text-delta frames.
DELTA_TYPE = "agent.message.delta"


def text_of(content: Any) -> str:
    """The text blocks of a `content` (a list of blocks or a plain string), joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and "text" in b)


@dataclass(frozen=True)
class Event:
    """One event of a session's log; an unknown type is exactly this."""

    TYPE: ClassVar[str] = ""
    id: str
    seq: int
    type: str
    session_id: str
    turn_id: str | None
    created_at: str
    data: dict[str, Any] = field(repr=False)
    """The whole payload, the typed fields included."""


@dataclass(frozen=True)
class SessionCreated(Event):
    TYPE = "session.created"


@dataclass(frozen=True)
class SessionUpdated(Event):
    TYPE = "session.updated"
    permission_mode: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class SessionError(Event):
    """A failure inside a turn that did not end it (a model call retried, an MCP server down)."""

    TYPE = "session.error"
    error: dict[str, Any] | None = None
    retry: dict[str, Any] | None = None
    purpose: str | None = None


@dataclass(frozen=True)
class UserMessage(Event):
    TYPE = "user.message"
    content: str = ""
    files: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TurnQueued(Event):
    TYPE = "turn.queued"
    queue_position: int = 0


@dataclass(frozen=True)
class TurnStarted(Event):
    TYPE = "turn.started"
    attempt: int = 1


@dataclass(frozen=True)
class TurnEnded(Event):
    """The base of the three terminal events: every turn ends with exactly one of them."""

    @property
    def status(self) -> str:
        return self.type.removeprefix("turn.")


@dataclass(frozen=True)
class TurnCompleted(TurnEnded):
    TYPE = "turn.completed"
    stop_reason: str | None = None
    duration_ms: int | None = None


@dataclass(frozen=True)
class TurnFailed(TurnEnded):
    TYPE = "turn.failed"
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class TurnAborted(TurnEnded):
    TYPE = "turn.aborted"
    reason: str | None = None


@dataclass(frozen=True)
class AgentMessage(Event):
    TYPE = "agent.message"
    content: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return text_of(self.content)


@dataclass(frozen=True)
class ToolUse(Event):
    TYPE = "agent.tool_use"
    tool_use_id: str = ""
    name: str = ""
    input: dict[str, Any] = field(default_factory=dict)
    permission: str | None = None


@dataclass(frozen=True)
class ToolResult(Event):
    TYPE = "agent.tool_result"
    tool_use_id: str = ""
    content: list[dict[str, Any]] = field(default_factory=list)
    is_error: bool = False
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return text_of(self.content)


@dataclass(frozen=True)
class ModelUsage(Event):
    TYPE = "model.usage"
    model: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    latency_ms: int | None = None
    purpose: str | None = None
    agent: str | None = None


@dataclass(frozen=True)
class ApprovalRequested(Event):
    TYPE = "approval.requested"
    approval_id: str = ""
    tool: str = ""
    action: str = ""
    tool_use_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ApprovalResolved(Event):
    TYPE = "approval.resolved"
    approval_id: str = ""
    tool: str = ""
    action: str = ""
    tool_use_id: str | None = None
    decision: str | None = None
    scope: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class ChangeSetUpdated(Event):
    """A change set staged by a tool (`status` None) or decided by the user."""

    TYPE = "change_set.updated"
    change_set_id: str = ""
    status: str | None = None
    operations: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class FileDelivered(Event):
    TYPE = "file.delivered"
    file_id: str = ""
    filename: str = ""
    bytes: int = 0


@dataclass(frozen=True)
class BrowserScreenshot(Event):
    """A screenshot the `browser` tool took, stored as the session file `file_id` (a PNG)."""

    TYPE = "browser.screenshot"
    file_id: str = ""
    filename: str = ""
    bytes: int = 0
    tab: int | None = None
    url: str | None = None
    tool_use_id: str | None = None


@dataclass(frozen=True)
class BrowserTakeover(Event):
    """The user took the browser over; `cancelled` actions were under way."""

    TYPE = "browser.takeover"
    cancelled: int = 0


@dataclass(frozen=True)
class BrowserReleased(Event):
    TYPE = "browser.released"


@dataclass(frozen=True)
class FilesPlaced(Event):
    """Where a message's attached files were put in the sandbox."""

    TYPE = "files.placed"
    files: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class SubagentStarted(Event):
    TYPE = "subagent.started"
    tool_use_id: str = ""
    agent: str = ""
    description: str | None = None
    depth: int = 1
    task_path: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SubagentCompleted(Event):
    TYPE = "subagent.completed"
    tool_use_id: str = ""
    agent: str = ""
    status: str = ""
    steps: int = 0
    output_chars: int = 0
    task_path: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ContextCompacted(Event):
    TYPE = "agent.context_compacted"
    reason: str = ""
    tokens_before: int = 0
    tokens_after: int = 0
    summary: str = ""


@dataclass(frozen=True)
class EnvironmentSignal(Event):
    """What changed around the agent since it was last told (told at a turn boundary)."""

    TYPE = "agent.signal"
    signals: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class SandboxReady(Event):
    TYPE = "sandbox.ready"
    state: str = ""
    machine: str = ""


@dataclass(frozen=True)
class MessageDelta:
    """A piece of a reply's text as the model produced it (never stored, no seq)."""

    session_id: str
    turn_id: str
    text: str
    index: int
    type: str = DELTA_TYPE


#: The class of each known event type.
EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls
    for cls in (
        SessionCreated, SessionUpdated, SessionError, UserMessage, TurnQueued, TurnStarted,
        TurnCompleted, TurnFailed, TurnAborted, AgentMessage, ToolUse, ToolResult, ModelUsage,
        ApprovalRequested, ApprovalResolved, ChangeSetUpdated, FileDelivered, FilesPlaced,
        SubagentStarted, SubagentCompleted, ContextCompacted, EnvironmentSignal, SandboxReady,
        BrowserScreenshot, BrowserTakeover, BrowserReleased,
    )
}  # fmt: skip
#: The types that end a turn.
TERMINAL_TYPES = frozenset(t for t, cls in EVENT_TYPES.items() if issubclass(cls, TurnEnded))
_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Event))


def event_of(wire: dict[str, Any]) -> Event:
    """The typed event of a wire event (`{envelope..., payload...}`, flat)."""
    try:
        payload = {k: v for k, v in wire.items() if k not in ENVELOPE_KEYS}
        cls = EVENT_TYPES.get(str(wire["type"]), Event)
        own = {
            f.name: payload[f.name]
            for f in dataclasses.fields(cls)
            if f.name not in _BASE_FIELDS and payload.get(f.name) is not None
        }
        return cls(
            id=str(wire["id"]), seq=int(wire["seq"]), type=str(wire["type"]),
            session_id=str(wire["session_id"]), turn_id=wire.get("turn_id"),
            created_at=str(wire["created_at"]), data=payload, **own,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"an event without its fields ({type(exc).__name__}: {exc})") from None


def frame_item(event: str, data: str) -> Event | MessageDelta:
    """An SSE frame of the events stream as an event or a delta."""
    try:
        value = json.loads(data)
    except ValueError:
        raise ProtocolError(f"an event that is not JSON: {data[:80]!r}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"an event that is not a JSON object: {data[:80]!r}")
    if event == DELTA_TYPE:
        try:
            return MessageDelta(str(value["session_id"]), str(value["turn_id"]), str(value["text"]),
                                int(value["index"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a delta without its fields ({exc})") from None
    return event_of(value)
