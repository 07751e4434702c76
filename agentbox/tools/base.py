"""What a model-facing tool is, what it returns, and what it may ask of its context.

A tool is a thin function over layer-2 operations with a pydantic input model (its JSON
schema) and an `Action` that tells the permission layer what kind of thing it does. Tools
never decide policy themselves: a file-changing tool *plans* `Operation`s and hands them
to `ctx.commit`, which applies them now or stages them in a change set depending on the
tier; a tool that needs a human says so through `ctx.authorize`. Errors a model can act on
come back as `ToolResult(is_error=True)`, never as exceptions (mini-swe-agent's rule:
recoverable conditions go back to the model as messages).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from agentbox.config import ToolConfig

if TYPE_CHECKING:
    from agentbox.tools.knowledge_bases import Scope
    from agentbox.tools.services import MachineServices


class Action(enum.StrEnum):
    """What a call does, as seed 001's permission table distinguishes it."""

    READ = "read"  # read / list / search inside the workspace
    READ_EXTERNAL = "read_external"  # read outside the workspace root
    WRITE = "write"  # edit / write / move / delete: produces Operations
    EXEC = "exec"  # run a command
    WEB = "web"  # web search / fetch (external research)
    BROWSER_READ = "browser_read"
    BROWSER_WRITE = "browser_write"
    MCP = "mcp"  # a tool of an external MCP server
    TASK = "task"  # delegate to a subagent
    META = "meta"  # the model's own bookkeeping: todo list, skills, delivery


@dataclass(frozen=True)
class TextBlock:
    text: str
    type: Literal["text"] = "text"


@dataclass(frozen=True)
class ImageBlock:
    media_type: str
    data: str  # base64
    type: Literal["image"] = "image"


Block = TextBlock | ImageBlock


@dataclass
class ToolResult:
    content: list[Block]
    is_error: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    """Structured extras for events and APIs (delivered files, change set ids, ...)."""

    @classmethod
    def text(cls, text: str, **data: Any) -> ToolResult:
        return cls([TextBlock(text)], False, data)

    @classmethod
    def error(cls, text: str, **data: Any) -> ToolResult:
        return cls([TextBlock(text)], True, data)

    def as_text(self) -> str:
        return "\n".join(
            b.text if isinstance(b, TextBlock) else f"[image {b.media_type}]" for b in self.content
        )


OperationKind = Literal["write", "edit", "mkdir", "move", "rename", "delete"]


@dataclass(frozen=True)
class Operation:
    """One planned change to the workspace; applied now or reviewed later as part of a change set.

    `before`/`after` are the full texts for `write`/`edit` (for the diff and the stale check);
    `dest` is the target of `move`/`rename`. `expect` fingerprints the file as it was planned
    against, so applying a stale operation fails instead of clobbering newer content.
    """

    kind: OperationKind
    path: str
    dest: str | None = None
    before: str | None = None
    after: str | None = None
    expect: str | None = None
    summary: str = ""


class TodoStore(Protocol):
    async def get(self, session_id: str) -> list[dict[str, Any]]: ...

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None: ...


class FileStore(Protocol):
    """The durable file store of seed 000 (uploads and deliveries), content-addressed blobs."""

    async def put_path(
        self,
        host_path: Any,
        filename: str,
        *,
        session_id: str | None,
        source: str,
        turn_id: str | None = None,
        tool_use_id: str | None = None,
    ) -> dict[str, Any]:
        """Store a copy of a host file; returns its record ({id, filename, bytes, sha256, created_at})."""
        ...

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        filename: str,
        *,
        session_id: str | None,
        source: str,
        turn_id: str | None = None,
        tool_use_id: str | None = None,
        max_bytes: int = ...,
    ) -> dict[str, Any]:
        """Store bytes as they arrive (a machine's file, read through its file operations);
        past `max_bytes` nothing is kept."""
        ...


class FileIds(Protocol):
    """The file ids a session was shown (`agentbox.store.file_ids`)."""

    async def remember(self, session_id: str, paths: Iterable[str]) -> dict[str, str]:
        """Ids for these absolute paths, recorded for the session; path -> id."""
        ...

    async def path_of(self, session_id: str, fid: str) -> str | None:
        """The path an id of this session names, or None."""
        ...


class ToolContext(Protocol):
    """What a tool may use. Built by the runner; tests build real ones."""

    machine: Any  # a `Machine`; `SessionTools` holds None for a session without one, and no tool
    # that needs a machine is offered there (`Tool.machine`)
    session_id: str
    turn_id: str | None
    config: ToolConfig
    reads: dict[str, str]
    """Inside path -> fingerprint of the file when the model last read it (stale-write check)."""
    todos: TodoStore
    files: FileStore | None
    deliveries: int
    """Files delivered in this turn so far (seed 000: at most 10 a turn)."""

    @property
    def tool_use_id(self) -> str | None:
        """The id of the call running now (None outside a model's call, e.g. a direct MCP call)."""
        ...

    services: MachineServices | None
    """The machine's command manager, watch hub and knowledge index (None without a machine)."""
    file_ids: FileIds | None
    """Where `list` and `search` record the file ids they show (None: they show none)."""

    @property
    def scope(self) -> Scope:
        """The session's knowledge bases on its machine: where relative paths start, and which
        paths are its own (`knowledge_bases.py`)."""
        ...

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        """Apply now or stage as a pending change set, as the tier says; returns what to tell the model."""
        ...

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        """None when allowed (possibly after a human approved); else the refusal text for the model."""
        ...

    async def staged_folders(self) -> set[str]:
        """Folders (inside paths) a pending `mkdir` of this turn's change set will create, where
        the tier stages writes: a file planned inside one stands on it. Empty otherwise."""
        ...


async def shown_file_ids(ctx: ToolContext, paths: Iterable[str]) -> dict[str, str]:
    """The file ids of files a tool shows, recorded for the session; path -> id (none where
    the context keeps no ids)."""
    if ctx.file_ids is None:
        return {}
    return await ctx.file_ids.remember(ctx.session_id, paths)


Run = Callable[[ToolContext, Any], Awaitable[ToolResult]]


class ToolParams(BaseModel):
    """A tool's arguments. A name the tool does not take is refused, not dropped: a model that
    passes `target: "web"` to a tool without one must hear so rather than get another search."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Tool:
    """One model-facing tool: a name, a schema, a paragraph a model can act on, and a function."""

    name: str
    description: str
    params: type[BaseModel]
    action: Action
    run: Run
    read_only: bool = True
    destructive: bool = False
    machine: bool = True
    """Whether it works on the session's machine (a session without one is not offered it)."""
    gates_itself: bool = False
    """Whether the tool authorizes each call itself (`ctx.authorize` with the action the call
    really takes and the detail a user needs to judge it) instead of the runner asking for
    `action` up front; what the tier forbids for `action` is still refused before it runs."""
    available: Callable[[Any, ToolConfig], bool] | None = None
    """Whether the tool exists for a (machine, config): `browser` only where the machine's entry
    enables it, `web_search` only where a provider is configured; None: everywhere."""
    narrows: str | None = None
    """The canonical tool this one is a part of (`browser_read` of `browser`): a subagent that lists
    it gets it where its parent has the whole tool, under the parent's name for that tool."""

    def schema(self) -> dict[str, Any]:
        return self.params.model_json_schema()

    def renamed(self, name: str, description: str | None = None) -> Tool:
        return dataclasses.replace(self, name=name, description=description or self.description)
