"""One error type for every workspace operation, so the HTTP layer only translates.

    WorkspaceError(error_type=...)
    ├── not_found             ENOENT: the path (or a parent) does not exist
    ├── permission_denied     EACCES / EPERM, or a write outside the root awaiting approval
    ├── already_exists        EEXIST: the target is there and the operation won't replace it
    ├── invalid_path          a path that escapes the machine, is empty, too long or loops
    ├── invalid_target        the path exists but is the wrong kind (a dir for a file, ...)
    ├── read_only_filesystem  EROFS: the path is behind a read-only mount
    ├── no_space_left         ENOSPC / EDQUOT
    ├── decode_error          bytes that are not text in the requested encoding
    ├── bad_request           well-formed but unusable input (`old_str not found in file`)
    ├── capacity_exceeded     the server runs all the sandboxes it may (503; `retry_after`)
    ├── machine_not_found     no machine of that name or kind, or a session without one (404)
    ├── machine_denied        the caller's level or the allow-list refuses the machine (403)
    ├── machine_unavailable   the machine could not start or its transport broke (503, retryable)
    ├── session_deleted       the id names a session that was deleted: its sandbox is gone for good
    │                         (410 on every route, v1 too: the request itself is refused)
    ├── unsupported           the machine's kind cannot do what was asked (a pseudo-terminal on
    │                         a kind that runs commands on pipes only; 501)
    ├── method_not_allowed    a known path asked with a method it does not serve (405, `Allow`)
    ├── conflict              the target is in a state that refuses the request now (a page
    │                         dialog waiting to be handled, a browser the user took over)
    ├── timeout               the operation did not finish in its time (a page that never loads)
    ├── browser_unavailable   no Chromium on the machine, or its browser stopped (503, retryable)
    ├── kernel_unavailable    a code context's Jupyter kernel could not start (no jupyter_client
    │                         in the image, a kernel that never answered; 503, retryable)
    └── io_error              anything else the OS reports; retryable when transient

The fields are exactly the `data` object of the AIO error envelope; `retry_after` (seconds,
only for `capacity_exceeded`) goes beside it, as the envelope's `retry_after` and the
response's Retry-After header.
"""

from __future__ import annotations

import errno as errno_mod
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agentbox.machines.errors import (
    CapacityExceeded,
    MachineDenied,
    MachineError,
    MachineNotFound,
    MachineUnavailable,
    OwnerUnsupported,
    PathEscape,
    PermissionRequired,
    SessionDeleted,
    TerminalUnsupported,
)

#: How the machine errors read in the envelope: (family, error_type, retryable).
MACHINE_ERRORS: tuple[tuple[type[MachineError], str, bool], ...] = (
    (MachineNotFound, "machine_not_found", False),
    (MachineDenied, "machine_denied", False),
    (MachineUnavailable, "machine_unavailable", True),
    (SessionDeleted, "session_deleted", False),
    (TerminalUnsupported, "unsupported", False),
)

ERRNO_TYPES: dict[int, str] = {
    errno_mod.ENOENT: "not_found",
    errno_mod.EACCES: "permission_denied",
    errno_mod.EPERM: "permission_denied",
    errno_mod.EEXIST: "already_exists",
    errno_mod.ENOTEMPTY: "already_exists",
    errno_mod.ENOTDIR: "invalid_target",
    errno_mod.EISDIR: "invalid_target",
    errno_mod.EXDEV: "invalid_target",
    errno_mod.EROFS: "read_only_filesystem",
    errno_mod.ENOSPC: "no_space_left",
    errno_mod.EDQUOT: "no_space_left",
    errno_mod.ENAMETOOLONG: "invalid_path",
    errno_mod.ELOOP: "invalid_path",
    errno_mod.EINVAL: "invalid_path",
}

RETRYABLE_ERRNOS = {errno_mod.EAGAIN, errno_mod.EINTR, errno_mod.EBUSY, errno_mod.ETIMEDOUT}

#: Verbs used in messages ("Failed to read file: ...").
OPERATION_NOUNS = {
    "read": "read file",
    "write": "write file",
    "list": "list directory",
    "mkdir": "create directory",
    "upload": "upload file",
    "download": "download file",
    "edit": "edit file",
    "search": "search files",
    "grep": "grep files",
    "tree": "transfer tree",
    "stat": "stat path",
    "remove": "remove path",
    "rename": "rename path",
    "watch": "watch path",
}


@dataclass
class WorkspaceError(Exception):
    error_type: str
    message: str
    operation: str
    path: str | None = None
    errno: int | None = None
    errno_name: str | None = None
    exception_type: str | None = None
    retryable: bool = False
    retry_after: int | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def to_dict(self) -> dict[str, object]:
        return {
            "errno": self.errno,
            "errno_name": self.errno_name,
            "error_type": self.error_type,
            "exception_type": self.exception_type,
            "message": self.message,
            "operation": self.operation,
            "path": self.path,
            "retryable": self.retryable,
        }


def failed(operation: str, detail: str) -> str:
    return f"Failed to {OPERATION_NOUNS.get(operation, operation)}: {detail}"


def bad_request(operation: str, message: str, path: str | None = None) -> WorkspaceError:
    return WorkspaceError("bad_request", message, operation, path, exception_type="ValueError")


def translate(exc: BaseException, operation: str, path: str | None) -> WorkspaceError:
    """Turn an OSError, a MachineError or a decode failure into a WorkspaceError."""
    if isinstance(exc, WorkspaceError):
        return exc
    if isinstance(exc, PermissionRequired):
        return WorkspaceError(
            "permission_denied",
            failed(operation, exc.message),
            operation,
            path,
            errno_mod.EACCES,
            "EACCES",
            "PermissionRequired",
        )
    if isinstance(exc, PathEscape):
        return WorkspaceError(
            "invalid_path",
            failed(operation, exc.message),
            operation,
            path,
            errno_mod.EACCES,
            "EACCES",
            "PathEscape",
        )
    if isinstance(exc, OwnerUnsupported):
        return WorkspaceError(
            "bad_request", failed(operation, exc.message), operation, path, exception_type="OwnerUnsupported"
        )
    if isinstance(exc, CapacityExceeded):
        return WorkspaceError(
            "capacity_exceeded", failed(operation, exc.message), operation, path,
            exception_type="CapacityExceeded", retryable=True, retry_after=exc.retry_after,
        )  # fmt: skip
    for family, error_type, retryable in MACHINE_ERRORS:
        if isinstance(exc, family):
            return WorkspaceError(
                error_type, failed(operation, exc.message), operation, path,
                exception_type=type(exc).__name__, retryable=retryable,
            )  # fmt: skip
    if isinstance(exc, MachineError):
        return WorkspaceError(
            "io_error",
            failed(operation, exc.message),
            operation,
            path,
            exception_type=type(exc).__name__,
            retryable=True,
        )
    if isinstance(exc, UnicodeError):
        return WorkspaceError(
            "decode_error",
            failed(operation, f"content is not valid text: {exc}"),
            operation,
            path,
            exception_type=type(exc).__name__,
        )
    if isinstance(exc, OSError) and exc.errno is not None:
        code = exc.errno
        detail = f"{os.strerror(code)} (os error {code})"
        return WorkspaceError(
            ERRNO_TYPES.get(code, "io_error"),
            failed(operation, detail),
            operation,
            path,
            code,
            errno_mod.errorcode.get(code),
            type(exc).__name__,
            code in RETRYABLE_ERRNOS,
        )
    return WorkspaceError(
        "io_error",
        failed(operation, str(exc) or type(exc).__name__),
        operation,
        path,
        exception_type=type(exc).__name__,
    )


@contextmanager
def operation(name: str, path: str | None) -> Iterator[None]:
    """Run a block whose failures become WorkspaceErrors for `name` on `path`."""
    try:
        yield
    except (OSError, MachineError, UnicodeError, WorkspaceError) as exc:
        raise translate(exc, name, path) from exc
