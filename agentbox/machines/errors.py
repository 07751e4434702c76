"""Every way a machine can refuse or fail, in one place.

    MachineError
    ├── PathEscape            a path leaves what the machine exposes (`..`, a symlink out,
    │                         a device file); never followed, whatever the caller's rights
    ├── PermissionRequired    a write outside the machine's root: allowed only after the
    │                         caller approves (the tool layer turns it into an approval)
    ├── MachineDenied         the caller's level or the routing allow-list refuses the machine
    ├── MachineNotFound       no machine of that name is configured
    ├── SessionDeleted        the id is a deleted session's: nothing opens under it again
    ├── MachineUnavailable    the machine could not be opened or its transport broke
    │   └── ContainerGone     a docker machine's container is not on its engine any more
    │                         (removed behind agentbox's back)
    ├── CapacityExceeded      the server already runs max_sandboxes sandboxes (or their memory
    │                         limits would pass max_sandbox_memory_mb): 503, retry after a while
    ├── OwnerUnsupported      `?user=` names an owner this machine cannot set, or a command
    │                         asks for an account it does not have
    ├── TerminalUnsupported   a command asked for a pseudo-terminal on a kind that gives none
    └── ImageError            an image (`images.py`) that is not built (ImageNotFound), held by
                              a running sandbox (ImageInUse), asked for wrongly
                              (InvalidImageSpec) or that failed to build (ImageBuildFailed)

Ordinary filesystem failures stay `OSError`s with their errno; the workspace layer turns
both families into one `WorkspaceError`.
"""

from __future__ import annotations


class MachineError(Exception):
    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path


class PathEscape(MachineError):
    pass


class PermissionRequired(MachineError):
    def __init__(self, message: str, *, path: str, action: str) -> None:
        super().__init__(message, path=path)
        self.action = action


class MachineDenied(MachineError):
    pass


class MachineNotFound(MachineError):
    pass


class SessionDeleted(MachineError):
    """The session id was retired when its session was deleted; its sandbox is gone for good."""


class MachineUnavailable(MachineError):
    pass


class ContainerGone(MachineUnavailable):
    pass


class CapacityExceeded(MachineError):
    """No room for one more live sandbox; `retry_after` says when one may have been reclaimed."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OwnerUnsupported(MachineError):
    pass


class TerminalUnsupported(MachineError):
    """The machine's kind runs commands on pipes only (`ExecRequest.pty` is refused)."""


class ImageError(MachineError):
    """An image could not be found, changed or built (`images.py`)."""


class ImageNotFound(ImageError):
    pass


class ImageInUse(ImageError):
    """A running sandbox (or another build) holds the image: retry once it is done."""


class InvalidImageSpec(ImageError):
    """A name, profile or package list that cannot name an image."""


class ImageBuildFailed(ImageError):
    pass
