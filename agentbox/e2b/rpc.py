"""What envd's services share: Connect errors from workspace errors, paths, keepalives, codecs."""

from __future__ import annotations

import base64
import binascii
import contextlib
import posixpath
from collections.abc import Iterator
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from agentbox.e2b.sandboxes import E2BError
from agentbox.machines.errors import MachineError
from agentbox.workspace.errors import WorkspaceError, translate

#: Seconds a process stream may go without output before a keepalive event is sent, at most;
#: a client asks for its own interval in `Keepalive-Ping-Interval` (the SDK: 50), and at least
#: MIN_KEEPALIVE_SECONDS.
KEEPALIVE_SECONDS = 30.0


MIN_KEEPALIVE_SECONDS = 1.0
#: Whom a process runs as when the call names nobody: envd's default user (`machines/account.py`).
DEFAULT_USER = "user"


#: WorkspaceError types as Connect codes and as envd's HTTP statuses.
ERROR_CODES: dict[str, tuple[Code, int]] = {
    "not_found": (Code.NOT_FOUND, 404),
    "machine_not_found": (Code.NOT_FOUND, 404),
    "permission_denied": (Code.PERMISSION_DENIED, 403),
    "machine_denied": (Code.PERMISSION_DENIED, 403),
    "read_only_filesystem": (Code.PERMISSION_DENIED, 403),
    "already_exists": (Code.ALREADY_EXISTS, 409),
    "invalid_path": (Code.INVALID_ARGUMENT, 400),
    "invalid_target": (Code.INVALID_ARGUMENT, 400),
    "decode_error": (Code.INVALID_ARGUMENT, 400),
    "bad_request": (Code.INVALID_ARGUMENT, 400),
    "no_space_left": (Code.RESOURCE_EXHAUSTED, 507),
    "capacity_exceeded": (Code.RESOURCE_EXHAUSTED, 429),
    "machine_unavailable": (Code.UNAVAILABLE, 503),
    "kernel_unavailable": (Code.UNAVAILABLE, 503),
    "unsupported": (Code.UNIMPLEMENTED, 501),
}


DEFAULT_ERROR = (Code.INTERNAL, 500)


def workspace_error(exc: Exception, op: str, path: str | None) -> WorkspaceError:
    return exc if isinstance(exc, WorkspaceError) else translate(exc, op, path)


@contextlib.contextmanager
def rpc_errors(op: str, path: str | None = None) -> Iterator[None]:
    """Machine and workspace failures as the Connect errors envd answers with."""
    try:
        yield
    except (WorkspaceError, MachineError, OSError) as exc:
        err = workspace_error(exc, op, path)
        raise ConnectError(ERROR_CODES.get(err.error_type, DEFAULT_ERROR)[0], err.message) from None
    except E2BError as exc:
        raise ConnectError(Code.UNAVAILABLE, exc.message) from None  # gone: as the proxy says it


def sandbox_id_of(ctx: RequestContext[Any, Any]) -> str:
    return ctx.request_headers.get("e2b-sandbox-id", "")


def keepalive_of(ctx: RequestContext[Any, Any]) -> float:
    """The keepalive interval the client asked for, within our bounds."""
    try:
        asked = float(ctx.request_headers.get("keepalive-ping-interval", KEEPALIVE_SECONDS))
    except ValueError:
        asked = KEEPALIVE_SECONDS
    return min(max(asked, MIN_KEEPALIVE_SECONDS), KEEPALIVE_SECONDS)


def inside_path(machine_root: str, path: str) -> str:
    """E2B's path as the machine's: relative ones from the machine's root."""
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, "path is empty")
    return path if path.startswith("/") else posixpath.join(machine_root, path)


def oneof(name: str, value: Any) -> Any:
    """A oneof member; its field name is checked by the message at run time, not by mypy."""
    return Oneof(name, value)


class CheckedDecoding:
    """A Connect codec whose undecodable message is the client's error (`invalid_argument`),
    not an `unknown` 500 as the library answers it."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec

    def name(self) -> str:
        return str(self._codec.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._codec.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._codec.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:
            name = self.name()
            raise ConnectError(Code.INVALID_ARGUMENT, f"malformed {name} message: {exc}") from None


CODECS = [CheckedDecoding(proto_binary_codec()), CheckedDecoding(proto_json_codec())]


def user_of(ctx: RequestContext[Any, Any]) -> str:
    """Whom the call runs as: `Authorization: Basic base64("<user>:")`, as the SDK sends it for
    `user=`, or DEFAULT_USER without the header."""
    header = ctx.request_headers.get("authorization")
    if header is None:
        return DEFAULT_USER
    scheme, _, value = header.partition(" ")
    try:
        decoded = base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        decoded = ""
    name = decoded.partition(":")[0]
    if scheme.lower() != "basic" or not name:
        raise ConnectError(Code.INVALID_ARGUMENT, "Authorization must be Basic base64('<user>:')")
    return name
