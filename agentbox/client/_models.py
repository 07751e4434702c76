"""What the API answers, as small typed records; each keeps the whole answer in `raw`.

A record is read with `of(answer)`: the fields it names are taken from the answer (missing
ones keep their default), so a server that adds fields never breaks the client, and what
this SDK does not model yet is still in `raw`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentbox.client._events import Event, TurnEnded, text_of

R = TypeVar("R", bound="Record")


@dataclass(frozen=True)
class Record:
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls: type[R], answer: dict[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        return cls(raw=answer, **{k: v for k, v in answer.items() if k in names})


@dataclass(frozen=True)
class Session(Record):
    id: str = ""
    model: str = ""
    status: str = ""
    """`idle`, `running` or `awaiting_approval`."""
    permission_mode: str = ""
    machine: str | None = None
    toolset: str = ""
    instructions: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""
    last_seq: int = 0
    """The seq of the session's last event: a stream from here shows only what comes next."""
    usage: dict[str, int] = field(default_factory=dict)
    sandbox: dict[str, Any] | None = None


@dataclass(frozen=True)
class Turn(Record):
    id: str = ""
    session_id: str = ""
    status: str = ""
    content: str = ""
    files: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None
    error: dict[str, Any] | None = None
    idempotency_key: str | None = None
    created_at: str = ""
    ended_at: str | None = None


@dataclass(frozen=True)
class Submission(Record):
    """A message accepted: its turn, and whether this call created it (False: a retried key)."""

    turn_id: str = ""
    created: bool = True
    turn: Turn | None = None

    @classmethod
    def of(cls, answer: dict[str, Any]) -> Submission:
        turn = answer.get("turn")
        return cls(raw=answer, turn_id=str(answer.get("turn_id", "")), created=bool(answer.get("created", True)),
                   turn=Turn.of(turn) if isinstance(turn, dict) else None)  # fmt: skip


@dataclass(frozen=True)
class Approval(Record):
    id: str = ""
    session_id: str = ""
    turn_id: str | None = None
    tool: str = ""
    action: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    status: str = ""
    """`pending`, `allowed`, `denied` or `cancelled`."""
    scope: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Operation(Record):
    id: str = ""
    kind: str = ""
    path: str = ""
    summary: str = ""
    diff: str = ""
    """The unified diff (empty in a change-set listing; `changes.get` has it)."""
    status: str = ""
    """`pending`, `applied`, `rejected` or `failed`."""
    reason: str | None = None


@dataclass(frozen=True)
class ChangeSet(Record):
    id: str = ""
    session_id: str = ""
    turn_id: str | None = None
    status: str = ""
    """`open` while an operation waits; then `applied`, `rejected` or `partially_applied`."""
    operations: tuple[Operation, ...] = ()

    @classmethod
    def of(cls, answer: dict[str, Any]) -> ChangeSet:
        ops = tuple(Operation.of(op) for op in answer.get("operations", []))
        base = super().of({k: v for k, v in answer.items() if k != "operations"})
        return dataclasses.replace(base, raw=answer, operations=ops)

    @property
    def diff(self) -> str:
        """Every operation's diff, in order."""
        return "".join(op.diff for op in self.operations)


@dataclass(frozen=True)
class FileInfo(Record):
    id: str = ""
    filename: str = ""
    bytes: int = 0
    sha256: str = ""
    created_at: str = ""
    session_id: str | None = None
    source: str = ""
    """`upload` (given to an agent) or `delivery` (delivered by one)."""
    turn_id: str | None = None


@dataclass(frozen=True)
class Command(Record):
    """A command in a sandbox: its status and the output kept so far."""

    command_id: str = ""
    command: str = ""
    cwd: str | None = None
    status: str = ""
    """`running`, `completed`, `failed`, `timeout` or `killed`."""
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None


@dataclass(frozen=True)
class FileEntry(Record):
    """One entry of a sandbox directory listing."""

    name: str = ""
    path: str = ""
    is_directory: bool = False
    is_symlink: bool = False
    size: int | None = None
    modified_time: str | None = None
    """RFC 3339 in UTC."""
    permissions: str | None = None
    """`rw-r--r--`, when asked for."""
    extension: str | None = None
    """With its dot (`.py`); None for a directory."""


@dataclass(frozen=True)
class FileChange(Record):
    """One change a sandbox watcher saw."""

    seq: int = 0
    type: str = ""
    """`create`, `write`, `remove`, `rename` or `chmod`; `overflow`: changes were lost (rescan)."""
    path: str = ""
    relative_path: str = ""
    is_dir: bool = False
    old_path: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class TurnResult:
    """A turn followed to its end by `messages.run`."""

    turn_id: str
    events: list[Event]
    """The turn's events, in seq order, its terminal event last."""

    @property
    def ended(self) -> TurnEnded:
        last = self.events[-1]
        assert isinstance(last, TurnEnded)
        return last

    @property
    def status(self) -> str:
        """`completed`, `failed` or `aborted`."""
        return self.ended.status

    @property
    def text(self) -> str:
        """The text of the turn's last agent message ("" if it wrote none)."""
        replies = [e for e in self.events if e.type == "agent.message"]
        return text_of(replies[-1].data.get("content")) if replies else ""
