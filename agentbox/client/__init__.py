"""agentbox's own Python SDK: `Client` and `AsyncClient` for a running `agentbox serve`.

    from agentbox import Client

    with Client("http://127.0.0.1:8091") as client:
        session = client.sessions.create("scripted", script=[{"text": "Hello."}])
        result = client.messages.run(session.id, "hi")
        for event in result.events:
            print(event.seq, event.type)

Groups: `sessions`, `messages`, `events`, `approvals`, `changes`, `files`, and
`sandbox(session_id)` for one session's sandbox. Failures are the `AgentboxError` tree
(`agentbox.client._errors` draws it); events are one dataclass per type (`_events`).
"""

from agentbox.client._calls import SessionFields
from agentbox.client._client import AsyncClient, Client
from agentbox.client._errors import (
    AgentboxError,
    APIError,
    Busy,
    Conflict,
    Gone,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ProtocolError,
    ServerError,
    StreamLost,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unreachable,
)
from agentbox.client._events import (
    AgentMessage,
    ApprovalRequested,
    ApprovalResolved,
    ChangeSetUpdated,
    ContextCompacted,
    EnvironmentSignal,
    Event,
    FileDelivered,
    FilesPlaced,
    MessageDelta,
    ModelUsage,
    SandboxReady,
    SessionCreated,
    SessionError,
    SessionUpdated,
    SubagentCompleted,
    SubagentStarted,
    ToolResult,
    ToolUse,
    TurnAborted,
    TurnCompleted,
    TurnEnded,
    TurnFailed,
    TurnQueued,
    TurnStarted,
    UserMessage,
)
from agentbox.client._models import (
    Approval,
    ChangeSet,
    Command,
    FileChange,
    FileInfo,
    Operation,
    Session,
    Submission,
    Turn,
    TurnResult,
)
from agentbox.client._sandbox import AsyncSandbox, AsyncWatch, Sandbox, Watch

__all__ = [
    "APIError", "AgentMessage", "AgentboxError", "Approval", "ApprovalRequested", "ApprovalResolved",
    "AsyncClient", "AsyncSandbox", "AsyncWatch", "Busy", "ChangeSet", "ChangeSetUpdated", "Client",
    "Command", "Conflict", "ContextCompacted", "EnvironmentSignal", "Event", "FileChange",
    "FileDelivered", "FileInfo", "FilesPlaced", "Gone", "InsufficientStorage", "InvalidRequest",
    "MessageDelta", "ModelUsage", "NotFound", "Operation", "PermissionDenied", "ProtocolError",
    "Sandbox", "SandboxReady", "ServerError", "Session", "SessionCreated", "SessionError",
    "SessionFields", "SessionUpdated", "StreamLost", "SubagentCompleted", "SubagentStarted",
    "Submission", "TooLarge", "ToolResult", "ToolUse", "Turn", "TurnAborted", "TurnCompleted",
    "TurnEnded", "TurnFailed", "TurnQueued", "TurnResult", "TurnStarted", "Unauthorized",
    "Unavailable", "Unreachable", "UserMessage", "Watch",
]  # fmt: skip
