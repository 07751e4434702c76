"""The AGENTBOX_HOME an entry point works on: its database and its machine registry.

`agentbox serve`, `exec`, `mcp` and `run` each open the same two things in the same order
and close them in reverse; this is that one piece.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from agentbox.config import Settings
from agentbox.machines.registry import Registry
from agentbox.store.db import Database
from agentbox.store.markers import MarkersRepo


@asynccontextmanager
async def opened_home(settings: Settings) -> AsyncIterator[tuple[Database, Registry]]:
    """The home's database (created with its folder if new) and a registry over it; both closed
    after (the registry first: stopping machines writes their markers)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    db = Database.in_home(settings.home)
    await db.connect()
    registry = Registry(settings, MarkersRepo(db))
    try:
        yield db, registry
    finally:
        await registry.shutdown()
        await db.close()
