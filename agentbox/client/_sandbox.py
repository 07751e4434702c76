"""One session's sandbox over the v2 API (`/sandboxes/{session_id}/v2/...`): commands, files, watch.

`client.sandbox(session_id)` gives a `Sandbox` (or an `AsyncSandbox`); it is made on first
use when the id has no session, and refused with `Gone` once the session was deleted. A
command's own outcome is data (`Command.status`, `exit_code`), never an exception; failures
are about the request (a missing path, an unknown command id). A watch is a context
manager that deletes its watcher when it is left; iterating it yields `FileChange`s as they
happen, resumed after the last one seen when the connection drops.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from agentbox.client import _calls as calls
from agentbox.client._errors import NotFound, ProtocolError
from agentbox.client._models import Command, FileChange, FileEntry
from agentbox.client._resources import Uploadable, upload_bytes
from agentbox.client._streams import afollow, follow
from agentbox.client._transport import (
    DOWNLOAD_CHUNK_BYTES,
    AsyncTransport,
    Resume,
    SyncTransport,
)
from agentbox.sse import ServerSentEvent

#: The frames of a watch stream that carry a change; `watch_started` and heartbeats carry none.
CHANGE_FRAME, OVERFLOW_FRAME = "file_change", "overflow"


def change_of(frame: ServerSentEvent) -> FileChange | None:
    """The change a watch frame carries (an overflow is a change of type `overflow`), else None."""
    if frame.event not in (CHANGE_FRAME, OVERFLOW_FRAME):
        return None
    try:
        data = json.loads(frame.data)
    except ValueError:
        raise ProtocolError(f"a watch event that is not JSON: {frame.data[:80]!r}") from None
    if frame.event == OVERFLOW_FRAME:
        return FileChange(raw=data, seq=int(data.get("after_seq", 0)), type=OVERFLOW_FRAME)
    return FileChange.of(data)


def data_of(answer: Any) -> Any:
    return answer["data"]


@dataclass
class WatchFeed:
    """A watcher's change stream across its connections (a `_streams.Feed`); it never ends
    by itself: the caller stops iterating, or the watcher is deleted."""

    session_id: str
    watcher_id: str
    resume: Resume
    done: bool = False

    @classmethod
    def of(cls, session_id: str, watcher_id: str) -> WatchFeed:
        return cls(session_id, watcher_id, Resume(0, f"the watch stream of {watcher_id}"))

    def call(self) -> calls.Call:
        return calls.watch_stream(self.session_id, self.watcher_id, self.resume.cursor)

    def accept(self, frame: ServerSentEvent) -> FileChange | None:
        change = change_of(frame)
        if change is None or (change.type != OVERFLOW_FRAME and not self.resume.seen(change.seq)):
            return None
        return change

    def closed(self) -> float:
        return self.resume.broke("the server closed the stream")


class Sandbox:
    def __init__(self, transport: SyncTransport, session_id: str) -> None:
        self._t = transport
        self.session_id = session_id

    def info(self) -> dict[str, Any]:
        """The machine (name, kind, os, root) and how it is isolated."""
        return dict(data_of(self._t.json(calls.describe_sandbox(self.session_id))))

    def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> Command:
        """Run a shell command to its end (`/bin/sh -c`, in /workspace unless `cwd`)."""
        call = calls.run_command(
            self.session_id, command, mode="sync", cwd=cwd, env=env, timeout=timeout, stdin=stdin
        )
        return Command.of(data_of(self._t.json(call)))

    def start(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> Command:
        """Start a command and return at once (`status` running); follow it with `command`."""
        call = calls.run_command(
            self.session_id, command, mode="async", cwd=cwd, env=env, timeout=timeout, stdin=stdin
        )
        return Command.of(data_of(self._t.json(call)))

    def command(self, command_id: str, *, wait: float = 0.0) -> Command:
        """A command as it stands, after waiting up to `wait` seconds for it to end."""
        return Command.of(data_of(self._t.json(calls.get_command(self.session_id, command_id, wait))))

    def kill(self, command_id: str) -> Command:
        return Command.of(data_of(self._t.json(calls.kill_command(self.session_id, command_id))))

    def read(self, path: str, *, start_line: int | None = None, end_line: int | None = None) -> str:
        """A text file's content (lines `start_line`..`end_line`, 0-based, end exclusive)."""
        return str(
            data_of(self._t.json(calls.read_text(self.session_id, path, start_line, end_line)))["content"]
        )

    def write(self, path: str, content: str | bytes, *, append: bool = False) -> int:
        """Write text or bytes (the parent must exist); the bytes written."""
        answer = self._t.json(calls.write_file(self.session_id, path, content, append))
        return int(data_of(answer)["bytes_written"])

    def list(
        self, path: str = ".", *, recursive: bool = False, max_depth: int | None = None
    ) -> list[FileEntry]:
        """A directory's entries (name, path, is_directory, size, modified_time, ...)."""
        answer = self._t.json(calls.list_dir(self.session_id, path, recursive, max_depth))
        return [FileEntry.of(entry) for entry in data_of(answer)["files"]]

    def mkdir(self, path: str, *, parents: bool = False) -> bool:
        """Make a directory (and its missing parents with `parents`); whether it was made:
        with `parents`, one that is already there is fine and gives False."""
        return bool(data_of(self._t.json(calls.make_dir(self.session_id, path, parents)))["created"])

    def upload(self, path: str, source: Uploadable) -> int:
        """Put a file at `path` (bytes, a local path or an open file); its size."""
        content, _ = upload_bytes(source, None)
        return int(data_of(self._t.json(calls.upload_to(self.session_id, path, content)))["file_size"])

    def download(self, path: str) -> bytes:
        return self._t.send(calls.download_from(self.session_id, path)).content

    def download_to(self, path: str, dest: str | Path) -> int:
        """Stream a file to `dest` on this machine, a piece at a time; the bytes written."""
        written = 0
        with self._t.stream(calls.download_from(self.session_id, path)) as response, open(dest, "wb") as out:
            for chunk in response.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                written += out.write(chunk)
        return written

    def watch(self, path: str, *, recursive: bool = True, exclude: Sequence[str] | None = None) -> Watch:
        """Watch `path` for changes: `with sandbox.watch(p) as w: for change in w: ...`."""
        answer = self._t.json(calls.start_watch(self.session_id, path, recursive, exclude))
        return Watch(self._t, self.session_id, str(data_of(answer)["watcher_id"]))


class Watch:
    """A watcher of the sandbox; iterating yields its changes, leaving deletes it."""

    def __init__(self, transport: SyncTransport, session_id: str, watcher_id: str) -> None:
        self._t = transport
        self.session_id, self.id = session_id, watcher_id
        self._feed = WatchFeed.of(session_id, watcher_id)

    def __iter__(self) -> Iterator[FileChange]:
        return follow(self._t, self._feed)

    def close(self) -> None:
        try:
            self._t.json(calls.delete_watch(self.session_id, self.id))
        except NotFound:
            pass

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandbox:
    def __init__(self, transport: AsyncTransport, session_id: str) -> None:
        self._t = transport
        self.session_id = session_id

    async def info(self) -> dict[str, Any]:
        return dict(data_of(await self._t.json(calls.describe_sandbox(self.session_id))))

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> Command:
        call = calls.run_command(
            self.session_id, command, mode="sync", cwd=cwd, env=env, timeout=timeout, stdin=stdin
        )
        return Command.of(data_of(await self._t.json(call)))

    async def start(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> Command:
        call = calls.run_command(
            self.session_id, command, mode="async", cwd=cwd, env=env, timeout=timeout, stdin=stdin
        )
        return Command.of(data_of(await self._t.json(call)))

    async def command(self, command_id: str, *, wait: float = 0.0) -> Command:
        return Command.of(data_of(await self._t.json(calls.get_command(self.session_id, command_id, wait))))

    async def kill(self, command_id: str) -> Command:
        return Command.of(data_of(await self._t.json(calls.kill_command(self.session_id, command_id))))

    async def read(self, path: str, *, start_line: int | None = None, end_line: int | None = None) -> str:
        answer = await self._t.json(calls.read_text(self.session_id, path, start_line, end_line))
        return str(data_of(answer)["content"])

    async def write(self, path: str, content: str | bytes, *, append: bool = False) -> int:
        answer = await self._t.json(calls.write_file(self.session_id, path, content, append))
        return int(data_of(answer)["bytes_written"])

    async def list(
        self, path: str = ".", *, recursive: bool = False, max_depth: int | None = None
    ) -> list[FileEntry]:
        answer = await self._t.json(calls.list_dir(self.session_id, path, recursive, max_depth))
        return [FileEntry.of(entry) for entry in data_of(answer)["files"]]

    async def mkdir(self, path: str, *, parents: bool = False) -> bool:
        return bool(data_of(await self._t.json(calls.make_dir(self.session_id, path, parents)))["created"])

    async def upload(self, path: str, source: Uploadable) -> int:
        content, _ = upload_bytes(source, None)
        return int(data_of(await self._t.json(calls.upload_to(self.session_id, path, content)))["file_size"])

    async def download(self, path: str) -> bytes:
        return (await self._t.send(calls.download_from(self.session_id, path))).content

    async def download_to(self, path: str, dest: str | Path) -> int:
        written = 0
        async with self._t.stream(calls.download_from(self.session_id, path)) as response:
            with open(dest, "wb") as out:
                async for chunk in response.aiter_bytes(DOWNLOAD_CHUNK_BYTES):
                    written += out.write(chunk)
        return written

    async def watch(
        self, path: str, *, recursive: bool = True, exclude: Sequence[str] | None = None
    ) -> AsyncWatch:
        """`async with await sandbox.watch(p) as w: async for change in w: ...`."""
        answer = await self._t.json(calls.start_watch(self.session_id, path, recursive, exclude))
        return AsyncWatch(self._t, self.session_id, str(data_of(answer)["watcher_id"]))


class AsyncWatch:
    def __init__(self, transport: AsyncTransport, session_id: str, watcher_id: str) -> None:
        self._t = transport
        self.session_id, self.id = session_id, watcher_id
        self._feed = WatchFeed.of(session_id, watcher_id)

    def __aiter__(self) -> AsyncIterator[FileChange]:
        return afollow(self._t, self._feed)

    async def close(self) -> None:
        try:
            await self._t.json(calls.delete_watch(self.session_id, self.id))
        except NotFound:
            pass

    async def __aenter__(self) -> AsyncWatch:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
