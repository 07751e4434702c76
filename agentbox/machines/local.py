"""The `local` kind: the host itself, shared by every session, not isolated.

Commands run as the server's user in their own session and process group, in `root` by
default, with a minimal environment (PATH, HOME, LANG plus what env providers inject), not
the server's own. Reads may go anywhere the server can read; the tool layer asks before
writes outside `root` (seed 004). Never offer this kind to untrusted users.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from agentbox.machines.base import OS, ExecRequest, ExecResult, collect, pipes_only
from agentbox.machines.binaries import ripgrep_binary
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import HostView, Mount

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def exit_code(returncode: int) -> int:
    """asyncio reports death by signal N as -N; shells (and we) say 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class HostProcess:
    """A `Process` over an asyncio subprocess that leads its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.pid = proc.pid
        assert proc.stdout is not None and proc.stderr is not None
        self.stdout: asyncio.StreamReader = proc.stdout
        self.stderr: asyncio.StreamReader = proc.stderr

    async def write_stdin(self, data: bytes) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()

    async def close_stdin(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()

    async def wait(self) -> int:
        return exit_code(await self._proc.wait())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class LocalMachine(HostFiles):
    kind = "local"
    isolated = False
    os: OS = "linux"

    def __init__(self, name: str, root: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        root.mkdir(parents=True, exist_ok=True)
        self.root = str(root.resolve())
        self.view = HostView([Mount("/", Path("/"))], self.root)
        self.env = env or {}
        self.ripgrep = ripgrep_binary()
        self.owner = None
        self.users = {}

    network_on = True

    def command_env(self, request: ExecRequest) -> dict[str, str]:
        base = {"PATH": BASE_PATH, "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
        return {**base, **self.env, **request.env}

    async def spawn(self, request: ExecRequest) -> HostProcess:
        """A host process on pipes; a pty is refused (`TerminalUnsupported`): the host's own
        terminals are not handed out through agentbox."""
        pipes_only(request, f"the local machine {self.name!r}")
        cwd = self.view.absolute(request.cwd or self.root)
        proc = await asyncio.create_subprocess_exec(
            *request.args(),
            cwd=cwd,
            env=self.command_env(request),
            stdin=asyncio.subprocess.PIPE
            if request.stdin is not None or request.interactive
            else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        process = HostProcess(proc)
        if request.stdin is not None:
            await process.write_stdin(request.stdin)
            await process.close_stdin()
        return process

    async def exec(self, request: ExecRequest) -> ExecResult:
        process = await self.spawn(request)
        return await collect(process, request.output_limit, request.timeout)

    async def close(self) -> None:
        return None
