"""What each machine has beside it for its whole life: one watch hub, one command manager, one
editor history, (opened on first search) one knowledge index and (made on first use) one
browser and one code interpreter.

The HTTP API, the turn loop's tools and MCP all reach a machine's services through the one
`Services` table the composition root (`agentbox.system`) builds, so a command the agent runs
with `bash` is a command of the machine's manager (listed by `/v2/commands`, bounded by its
caps), and a watch or an index is never made twice for one machine. Entries are keyed by the
machine object, which the registry keeps for a session across its sandbox's lifetimes; they
go when the session is deleted (`forget`) or the system closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.config import MAX_LEVEL
from agentbox.machines.base import Lifetime, Machine
from agentbox.machines.registry import DEFAULT_SESSION, Registry
from agentbox.tools.knowledge import KnowledgeIndex, open_index
from agentbox.tools.shell import exec_shell
from agentbox.workspace.browser import Browser
from agentbox.workspace.browser_cdp import Cdp
from agentbox.workspace.commands import Command, CommandManager
from agentbox.workspace.editor import Editor
from agentbox.workspace.kernels import CodeInterpreter
from agentbox.workspace.watch import WatchHub

#: Sessions whose machine `Services.routes` remembers at most (then it starts over).
MAX_ROUTES = 4096


@dataclass
class MachineServices:
    """One machine and the services that live beside it."""

    session_id: str
    machine: Machine
    watches: WatchHub
    commands: CommandManager
    editor: Editor
    index_path: Path | None = None
    """Where the knowledge index lives; None: beside the machine's workspace or in the home."""
    _index: KnowledgeIndex | None = field(default=None, repr=False)
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _shell: tuple[object, str] | None = field(default=None, repr=False)
    """The exec tool's shell and the lifetime it was found in (`shell`)."""
    _lifetime: Lifetime | None = field(init=False, repr=False)
    """The machine, if it has lifetimes: checked once, as the machine never changes."""
    _browser: Browser | None = field(default=None, repr=False)
    _cdp: Cdp | None = field(default=None, repr=False)
    _code: CodeInterpreter | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._lifetime = self.machine if isinstance(self.machine, Lifetime) else None

    @classmethod
    def of(
        cls,
        machine: Machine,
        session_id: str = DEFAULT_SESSION,
        index_path: Path | None = None,
        on_command: Callable[[], None] | None = None,
        on_command_end: Callable[[Command], None] | None = None,
    ) -> MachineServices:
        commands = CommandManager(machine, on_command, on_command_end)
        # The hub picks its source: inotify on host files, else the machine's own watch.
        return cls(session_id, machine, WatchHub(machine), commands, Editor(), index_path)

    async def shell(self) -> str:
        """The shell the `exec` tool runs commands with here (`exec_shell`), looked up once per
        lifetime of the machine rather than on every call (a remote kind pays a round trip).

        Safe to keep: which shell a sandbox or container has changes with its system tree,
        which a rebuild resets and a new image replaces only in a new lifetime, and each start
        renews `Lifetime.marker()`, the key it is kept under. A command may still remove bash
        within a lifetime, or from a shared machine: the tool then calls `forget_shell` when
        the spawn fails, and the next call looks again.
        """
        lifetime = self._lifetime.marker() if self._lifetime is not None else None
        if self._shell is None or self._shell[0] != lifetime:
            self._shell = (lifetime, await exec_shell(self.machine))
        return self._shell[1]

    def forget_shell(self) -> None:
        """Look the shell up again on the next call (a spawn with the one kept failed)."""
        self._shell = None

    async def knowledge(self) -> KnowledgeIndex:
        """The machine's knowledge index, opened (attached to this watch hub, refreshed) on first use."""
        async with self._opening:
            if self._index is None or self._index.closed:
                self._index = await open_index(self.machine, self.watches, self.index_path)
            return self._index

    def browser(self) -> Browser:
        """The machine's browser (`agentbox.workspace.browser`): Chromium starts on its first action."""
        if self._browser is None:
            self._browser = Browser(self.machine)
        return self._browser

    def cdp(self) -> Cdp:
        """The DevTools endpoint of the machine's browser (`agentbox.workspace.browser_cdp`)."""
        if self._cdp is None or self._cdp.browser is not self.browser():
            self._cdp = Cdp(self.browser())
        return self._cdp

    def code(self) -> CodeInterpreter:
        """The machine's code contexts (`agentbox.workspace.kernels`): kernels start on first use."""
        if self._code is None:
            self._code = CodeInterpreter(self.machine)
        return self._code

    async def close(self) -> None:
        if self._code is not None:
            await self._code.close()
            self._code = None
        if self._browser is not None:
            await self._browser.close()
            self._browser = None
            self._cdp = None
        if self._index is not None:
            await self._index.close()
            self._index = None
        await self.watches.close()
        await self.commands.close()


class Services:
    """Every open machine's services, for one running system."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._by_machine: dict[int, MachineServices] = {}
        self.routes: dict[str, str] = {}
        """Session id -> the machine its requests act on ("" = the default), as looked up once."""
        self.on_command: list[Callable[[], None]] = []
        """Called once per command any machine's CommandManager launches."""
        self.on_command_end: list[Callable[[Command], None]] = []
        """Called once per command any machine's CommandManager saw end, with its record."""

    def remember(self, session_id: str, machine: str) -> None:
        if len(self.routes) >= MAX_ROUTES:
            self.routes.clear()  # a cache: looked up again when needed
        self.routes[session_id] = machine

    async def get(
        self, session_id: str | None = None, machine: str | None = None, *, level: int = MAX_LEVEL
    ) -> MachineServices:
        """The services of the session's machine (the default one unless named), opening it for a
        caller of `level` (`Registry.open` refuses a machine that needs more)."""
        sid = session_id or DEFAULT_SESSION  # the registry refuses an id that is not one
        opened = await self.registry.open(sid, machine, level=level)
        return self.of(opened, sid)

    def of(self, machine: Machine, session_id: str = DEFAULT_SESSION) -> MachineServices:
        """The services of a machine that is already open."""
        services = self._by_machine.get(id(machine))
        if services is None or services.machine is not machine:
            services = MachineServices.of(
                machine, session_id, on_command=self._command_started, on_command_end=self._command_ended
            )
            self._by_machine[id(machine)] = services
        return services

    def _command_started(self) -> None:
        for hook in self.on_command:
            hook()

    def _command_ended(self, command: Command) -> None:
        for hook in self.on_command_end:
            hook(command)

    async def forget(self, session_id: str) -> None:
        self.routes.pop(session_id, None)
        for key, services in list(self._by_machine.items()):
            if services.session_id == session_id:
                del self._by_machine[key]
                await services.close()

    async def close(self) -> None:
        services, self._by_machine = list(self._by_machine.values()), {}
        for s in services:
            await s.close()
