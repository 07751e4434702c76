"""The composition root: the one place that builds a running agentbox, for every entry point.

`agentbox serve`, `agentbox mcp`, `agentbox run` and `agentbox exec` each open one `System`
on the home they own (the home's lock) and close it when they end. It holds one of each
service, so what one surface does the others see: a command the agent runs is the machine's
(`/v2/commands` lists it), a change set staged over MCP is the sessions API's to review, a
machine's watches and knowledge index exist once.

    settings ─ home (lock) ─ database ─ registry (machines) ─ services (per machine: watch hub,
    command manager, editor, knowledge index) ─ file store ─ session store ─ event bus ─
    approvals ─ change sets ─ todos ─ worker (turns)

Closed in reverse: the worker (turns stay in the database for the next start), the machines'
services, the registry (stopping machines writes their markers), the database. Nothing here
is module-global; tests open as many systems as they have homes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from agentbox.agent.events import EventBus
from agentbox.agent.worker import Worker
from agentbox.config import Settings
from agentbox.home import HomeClaim, opened_home
from agentbox.machines.registry import Registry
from agentbox.secrets import SecretBox
from agentbox.store.approvals import ApprovalsRepo
from agentbox.store.changes import ChangesRepo
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.store.sessions import SessionStore
from agentbox.store.todos import TodoRepo
from agentbox.tools.approvals import Approvals
from agentbox.tools.changes import ChangeSets
from agentbox.tools.services import Services


@dataclass
class System:
    """One running agentbox: every service, once."""

    settings: Settings
    db: Database
    registry: Registry
    services: Services
    files: FileStore
    store: SessionStore
    bus: EventBus
    approvals: Approvals
    changes: ChangeSets
    todos: TodoRepo
    worker: Worker


@asynccontextmanager
async def opened_system(
    settings: Settings, claim: HomeClaim | None = None, *, turns: bool = True
) -> AsyncIterator[System]:
    """The running system on `settings`' home, closed after.

    `turns`: start the worker, which also recovers the turns an earlier process left open
    (serve and run); `mcp` and `exec` run tools and commands, never turns.
    """
    async with opened_home(settings, claim) as (db, registry):
        await registry.recover()
        registry.start_janitor()
        store = SessionStore(db, SecretBox(settings.home))
        await store.seal_stored()  # sessions from before secrets were sealed
        services = Services(registry)
        files = FileStore(db, settings.home)
        bus = EventBus(store)
        approvals = Approvals(ApprovalsRepo(db))
        changes = ChangeSets(ChangesRepo(db))
        todos = TodoRepo(db)
        worker = Worker(store, bus, registry, files, approvals, changes, todos, services=services)
        system = System(
            settings, db, registry, services, files, store, bus, approvals, changes, todos, worker
        )
        try:
            if turns:
                await worker.start()
            yield system
        finally:
            await worker.close()
            await services.close()
