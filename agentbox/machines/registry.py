"""Which machine serves a request, opened once, suspended when idle, resumed on demand.

Seed 004's open flow, in order: resolve the name (the default machine when none is
given), check the caller's level against `machine:<name>`, find the instance for its scope
(shared kinds: one per name; per-session kinds: one per (name, session)), open it once
even under concurrent requests, resume it if it was suspended, and mark it used.

Lifecycle of a per-session sandbox (seed 000):

    (none) ──open──▶ running ──idle > idle_minutes, not busy──▶ suspended
                        ▲                                          │
                        └──────────── next request (rebuild) ◀─────┘

A bwrap sandbox cannot be frozen to disk, so "suspend" releases everything but
`/workspace` — exactly seed 000's reclaim — and "resume" is a transparent rebuild with
/tmp, $HOME, env and system installs reset. Markers record every open and close; since
bwrap sandboxes die with the server (`--die-with-parent`), after a restart a live marker
leads to cleaning up what the dead sandbox left and to a lazy rebuild under the same id.
A session's workspace is purged after `purge_days` without activity.

A sandbox, as the lifecycle API lists it (`sandboxes`), is a session id with per-session
state here: a machine open under it (running, or suspended: "stopped") or a workspace on
disk (after a restart, before the lazy rebuild). Deleting a session retires its id
(`retire`, before its machines close): opening a per-session machine under a retired id is
refused with `SessionDeleted`, whichever surface asks, so a late request cannot bring back
an empty sandbox under the deleted session's name.

A session's workspace is an ext4 image of `disk_mb` (see `disk.py`), mounted on the
session's workspace directory before its first sandbox starts and unmounted when the
session is closed or the server stops.

Capacity, server-wide: at most `max_sandboxes` sandboxes run at once, and their memory
limits (`memory_mb`) sum to at most `max_sandbox_memory_mb`. Opening or resuming one more
past either first reclaims idle sandboxes, least recently used first: any with no command
and no leftover process for PRESSURE_IDLE_SECONDS (or `idle_minutes`, if shorter), as the
janitor would later. If that makes no room the open fails with `CapacityExceeded` (HTTP
503 `capacity_exceeded` with Retry-After; for a turn, `turn.failed` `machine_unavailable`
naming the machine); Retry-After is when the next live sandbox becomes reclaimable, or
BUSY_RETRY_SECONDS when all of them are busy. An entry with `memory_mb = 0` (no limit)
counts toward `max_sandboxes` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from agentbox.config import MAX_LEVEL, SECRET_FIELDS, MachineConfig, Settings
from agentbox.ids import SESSION_ID_RULE, is_session_id, new_id
from agentbox.machines import disk
from agentbox.machines.base import Lifetime, Machine
from agentbox.machines.errors import (
    CapacityExceeded,
    MachineDenied,
    MachineError,
    MachineNotFound,
    MachineUnavailable,
    PathEscape,
    SessionDeleted,
)
from agentbox.machines.kinds import KINDS, Build, Kind, memory_mb
from agentbox.machines.sandbox import SandboxHost, release_orphans
from agentbox.secrets import SecretBox, SecretError, redact

#: Seconds between janitor sweeps (idle reclaim and workspace purge).
JANITOR_INTERVAL = 30.0
#: Session id used when a request names none (the root routes of the sandbox API).
DEFAULT_SESSION = "default"
ACTIVITY_FILE = ".last_active"
#: Seconds between two updates of a session's activity file (its mtime drives the purge).
ACTIVITY_RESOLUTION = 60.0

log = logging.getLogger(__name__)

#: At the sandbox cap, a sandbox idle this long (seconds: no command, no process left) is
#: reclaimed to make room rather than refusing a new one (the janitor waits for idle_minutes).
PRESSURE_IDLE_SECONDS = 60.0
#: Retry-After (seconds) of a refusal at the cap when every live sandbox is busy.
BUSY_RETRY_SECONDS = 30

EnvProvider = Callable[[str, str | None], dict[str, str]]


class MarkerLog(Protocol):
    """Durable session markers (implemented by `agentbox.store.markers.MarkersRepo`)."""

    async def append(
        self, session_id: str, machine: str, kind: str, sandbox_id: str, data: dict[str, Any]
    ) -> None: ...

    async def clear(self, session_id: str, machine: str) -> None: ...

    async def latest(self, session_id: str, machine: str) -> Any: ...

    async def live(self) -> list[Any]: ...

    async def retire(self, session_id: str) -> None: ...

    async def retired(self, session_id: str) -> bool: ...


@dataclass
class Entry:
    machine: Machine
    config: MachineConfig
    session_id: str | None
    state: str = "running"
    generation: int = 1
    """How many lifetimes this instance has had: 1 = created, more = rebuilt."""
    touched: float = float("-inf")
    """When the activity file was last updated (monotonic)."""


@dataclass(frozen=True)
class SandboxState:
    """What a session id holds here, as the sandbox lifecycle API shows it."""

    session_id: str
    machines: list[tuple[str, str, str]]
    """(name, kind, "running" | "stopped") of each per-session machine known under the id."""
    workspace_bytes: int
    last_used: float | None
    """Wall-clock seconds of the last use: a request to a machine, or the activity file."""

    @property
    def state(self) -> str:
        return "running" if any(state == "running" for _, _, state in self.machines) else "stopped"


class Registry:
    def __init__(self, settings: Settings, markers: MarkerLog | None = None) -> None:
        self.settings = settings
        self.markers = markers
        self.providers: list[EnvProvider] = []
        self._entries: dict[tuple[str, str | None], Entry] = {}
        self._opening: dict[tuple[str, str | None], asyncio.Future[Entry]] = {}
        self._locks: dict[tuple[str, str | None], asyncio.Lock] = {}
        self._shared: dict[str, Any] = {}
        """Each kind's shared object (`Kind.shared`), made at its first machine."""
        self._starting: dict[tuple[str, str | None], int] = {}
        """Sandboxes being started or resumed, with their memory limit (MiB): they count already."""
        self._attached: set[str] = set()
        """Sessions whose workspace image this registry mounted."""
        self._disk_lock = threading.Lock()
        """One attach at a time (two machines of a session share its workspace)."""
        self._warned_disk = False
        self._janitor: asyncio.Task[None] | None = None
        self.on_ready: list[Callable[[Entry, bool], Awaitable[None]]] = []

    # configuration and routing ------------------------------------------------------

    @property
    def sandbox_host(self) -> SandboxHost:
        """The sandbox kind's shared host (its uid owns the workspace images)."""
        return cast(SandboxHost, self.shared(KINDS["sandbox"]))

    def shared(self, kind: Kind) -> Any:
        if kind.shared is None:
            return None
        if kind.name not in self._shared:
            self._shared[kind.name] = kind.shared(self.settings)
        return self._shared[kind.name]

    def kind(self, config: MachineConfig) -> Kind:
        kind = KINDS.get(config.kind)
        if kind is None:
            raise MachineNotFound(
                f"machine {config.name!r} has kind {config.kind!r}, which this build does not have "
                f"(kinds: {', '.join(KINDS)})"
            )
        return kind

    def config(self, name: str | None) -> MachineConfig:
        name = name or self.settings.default_machine
        config = self.settings.machine(name)
        if config is None:
            raise MachineNotFound(f"no machine named {name!r} is configured")
        return config

    def check(self, config: MachineConfig, level: int) -> None:
        if level < config.required_level:
            raise MachineDenied(
                f"machine:{config.name} needs permission level {config.required_level}, caller has {level}"
            )

    def delegable(self, level: int) -> list[str]:
        """Machines a model may choose: on the allow-list and within the caller's level."""
        return [
            n for n in self.settings.delegable
            if (c := self.settings.machine(n)) is not None and level >= c.required_level
        ]  # fmt: skip

    def choose(self, name: str, level: int) -> MachineConfig:
        if name not in self.delegable(level):
            raise MachineDenied(f"machine {name!r} is not one a model may choose here")
        return self.config(name)

    def session_dir(self, session_id: str) -> Path:
        return self.settings.home / "sessions" / checked_session(session_id)

    # the open flow --------------------------------------------------------------------

    async def open(
        self, session_id: str | None = None, name: str | None = None, *, level: int = MAX_LEVEL
    ) -> Machine:
        return (await self.open_entry(session_id, name, level=level)).machine

    async def open_entry(
        self, session_id: str | None = None, name: str | None = None, *, level: int = MAX_LEVEL
    ) -> Entry:
        config = self.config(name)
        self.check(config, level)
        sid = checked_session(session_id or DEFAULT_SESSION) if config.per_session else None
        key = (config.name, sid)
        entry = self._entries.get(key)
        if entry is not None and entry.state == "running":
            self._touch(entry)
            return entry
        if key in self._opening:
            return await asyncio.shield(self._opening[key])
        fut: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            async with self._lock(key):  # never while the same machine is being suspended
                entry = self._entries.get(key)
                if entry is None or entry.state != "running":
                    async with self._room(config, key):  # counted from here until it is an entry
                        entry = await (self._create(config, sid) if entry is None else self._resume(entry))
                        self._entries[key] = entry
            fut.set_result(entry)
        except BaseException as exc:
            if isinstance(exc, MachineUnavailable):
                log.warning("machine %s of session %s failed to start: %s", config.name, sid or "-", exc)
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._opening[key]
        self._touch(entry)
        for hook in self.on_ready:
            await hook(entry, entry.generation > 1)
        return entry

    def describe(self) -> list[dict[str, Any]]:
        """Machine configuration for ordinary queries: secret fields never in plaintext."""
        return [
            {"name": c.name, "kind": c.kind, "level": c.required_level, "per_session": c.per_session,
             "options": redact(c.options, SECRET_FIELDS), "env": sorted(c.env)}
            for c in self.settings.machines.values()
        ]  # fmt: skip

    def secrets(self, config: MachineConfig) -> dict[str, Any]:
        """The entry's options with `enc:` secrets decrypted: only when opening it."""
        return SecretBox(self.settings.home).decrypt_fields(config.options, SECRET_FIELDS)

    def unsealed(self, config: MachineConfig) -> MachineConfig:
        """The entry as a kind gets it to make (or sweep) machines: its secrets decrypted."""
        return MachineConfig(config.name, config.kind, self.secrets(config), config.level, config.env)

    def view(self, session_id: str | None = None, name: str | None = None) -> Machine:
        """The machine as a session would get it, without starting anything: the live one if it
        is open, else an unstarted one whose path map works (the workspace is a host folder), so
        it can be described (a system prompt's machine line, listing, AGENTS.md) for nothing."""
        config = self.config(name)
        sid = checked_session(session_id or DEFAULT_SESSION) if config.per_session else None
        entry = self._entries.get((config.name, sid))
        if entry is not None:
            return entry.machine
        if sid is not None and disk.image_of(self._workspace(sid)).exists():
            with contextlib.suppress(MachineUnavailable):  # then it reads as empty until a start
                self._attach(config, sid)  # its files are in the image: readable without a start
        return self._machine(config, sid, new_id("sbx"))

    async def _create(self, config: MachineConfig, session_id: str | None) -> Entry:
        if session_id is not None and await self.retired(session_id):
            raise deleted(session_id)
        config = self.unsealed(config)
        instance_id, recovered = await self._recovered(session_id, config.name) if session_id else (None, {})
        machine = self._machine(config, session_id, instance_id or new_id("sbx"), recovered)
        if isinstance(machine, Lifetime):
            assert session_id is not None
            await asyncio.to_thread(self._attach, config, session_id)
            await machine.start()
            await self._mark(session_id, config, machine)
            return Entry(machine, config, session_id)
        return Entry(machine, config, None)

    def _machine(
        self,
        config: MachineConfig,
        session_id: str | None,
        instance_id: str,
        recovered: dict[str, Any] | None = None,
    ) -> Machine:
        """The machine object for `config` (not started), built by its kind's row."""
        kind = self.kind(config)
        build = Build(
            config, self.settings, self._env(config, session_id), self.shared(kind), session_id, instance_id,
            self.session_dir(session_id) if config.per_session and session_id is not None else None,
            recovered or {},
        )  # fmt: skip
        return kind.make(build)

    async def _resume(self, entry: Entry) -> Entry:
        machine = entry.machine
        if isinstance(machine, Lifetime):
            assert entry.session_id is not None
            await asyncio.to_thread(self._attach, entry.config, entry.session_id)
            await machine.start()
            await self._mark(entry.session_id, entry.config, machine)
        entry.state = "running"
        entry.generation += 1
        return entry

    # capacity and disk -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _room(self, config: MachineConfig, key: tuple[str, str | None]) -> AsyncIterator[None]:
        """Hold a place under the server's caps for a per-session machine while it starts (or refuse one)."""
        if not config.per_session:
            yield
            return
        memory = memory_mb(config)
        await self._reclaim_for(memory)
        problem = self._over_cap(memory)
        if problem is not None:
            raise CapacityExceeded(
                f"machine {config.name!r} cannot start a sandbox now: {problem}",
                retry_after=self._retry_after(),
            )
        self._starting[key] = memory
        try:
            yield
        finally:
            del self._starting[key]

    def _running(self) -> list[tuple[Entry, Lifetime]]:
        return [
            (e, e.machine)
            for e in self._entries.values()
            if isinstance(e.machine, Lifetime) and e.state == "running"
        ]

    def _live(self) -> dict[tuple[str, str | None], int]:
        """Running and starting sandboxes, each with its memory limit (MiB)."""
        live = {(e.config.name, e.session_id): memory_mb(e.config) for e, _ in self._running()}
        return {**live, **self._starting}

    def _over_cap(self, memory: int) -> str | None:
        live = self._live()
        cap, memory_cap = self.settings.max_sandboxes, self.settings.max_sandbox_memory_mb
        if len(live) >= cap:
            return f"the server already runs {len(live)} sandboxes (max_sandboxes = {cap})"
        total = sum(live.values()) + memory
        if memory and total > memory_cap:
            return (
                f"its memory limit of {memory} MiB would bring live sandboxes' limits to {total} MiB "
                f"(max_sandbox_memory_mb = {memory_cap})"
            )
        return None

    def _idle_for(self) -> list[tuple[float, Entry]]:
        """Running sandboxes with nothing running, each with the seconds until it may be
        reclaimed under pressure (<= 0: now), least recently used first."""
        threshold, now = min(PRESSURE_IDLE_SECONDS, self.settings.idle_minutes * 60), time.monotonic()
        idle = [(threshold - (now - m.last_used), e) for e, m in self._running() if not m.busy()]
        return sorted(idle, key=lambda pair: pair[0])

    async def _reclaim_for(self, memory: int) -> None:
        for wait, entry in self._idle_for():
            if wait > 0 or self._over_cap(memory) is None:
                return
            await self.suspend(entry)

    def _retry_after(self) -> int:
        """Seconds until the next live sandbox becomes reclaimable (if none is busy forever)."""
        idle = self._idle_for()
        return max(1, math.ceil(idle[0][0])) if idle else BUSY_RETRY_SECONDS

    def _workspace(self, session_id: str) -> Path:
        return self.session_dir(session_id) / "workspace"

    def _attach(self, config: MachineConfig, session_id: str) -> None:
        """Mount the session's workspace image (made on first use) when it has a budget."""
        size = int(config.options.get("disk_mb", disk.DEFAULT_DISK_MB) or 0)
        if size <= 0 or not self.kind(config).workspace_disk:
            return
        if not disk.available():
            if not self._warned_disk:
                self._warned_disk = True
                log.warning("no workspace disk budgets: needs root, %s and mkfs.ext4", disk.LOOP_CONTROL)
            return
        host = self.sandbox_host
        with self._disk_lock:
            disk.attach(self._workspace(session_id), size, host.uid, host.gid)
            self._attached.add(session_id)

    def _detach(self, session_id: str) -> None:
        if session_id in self._attached:
            self._attached.discard(session_id)
            disk.detach(self._workspace(session_id))

    def _env(self, config: MachineConfig, session_id: str | None) -> dict[str, str]:
        env = dict(config.env)
        for provider in self.providers:
            env.update(provider(config.name, session_id))
        return env

    async def _mark(self, session_id: str, config: MachineConfig, machine: Lifetime) -> None:
        if self.markers is not None:
            await self.markers.append(
                session_id, config.name, config.kind, machine.instance_id, machine.marker()
            )

    async def _recovered(self, session_id: str, name: str) -> tuple[str | None, dict[str, Any]]:
        """The instance id and marker data of the machine's last lifetime (a restart's), if any."""
        if self.markers is None:
            return None, {}
        marker = await self.markers.latest(session_id, name)
        if marker is None:
            return None, {}
        return marker.sandbox_id, dict(marker.data)

    def _touch(self, entry: Entry) -> None:
        """Mark the session active (for the purge), at most once per ACTIVITY_RESOLUTION."""
        now = time.monotonic()
        if entry.session_id is None or now - entry.touched < ACTIVITY_RESOLUTION:
            return
        entry.touched = now
        with contextlib.suppress(OSError):
            path = self.session_dir(entry.session_id) / ACTIVITY_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()

    # lifecycle --------------------------------------------------------------------------

    async def retire(self, session_id: str) -> None:
        """Refuse every later open under `session_id` (its session is being deleted)."""
        if self.markers is not None:
            await self.markers.retire(checked_session(session_id))

    async def retired(self, session_id: str) -> bool:
        return self.markers is not None and await self.markers.retired(session_id)

    async def sandboxes(self, after: str | None = None, limit: int | None = None) -> list[SandboxState]:
        """The sandboxes (see the module docstring) with an id after `after`, in id order."""
        ids = {sid for _, sid in self._entries if sid is not None} | set(self._workspace_ids())
        chosen = sorted(sid for sid in ids if after is None or sid > after)[:limit]
        live = await self.markers.live() if self.markers is not None and chosen else []
        return [await self._sandbox(sid, [m for m in live if m.session_id == sid]) for sid in chosen]

    async def sandbox(self, session_id: str) -> SandboxState | None:
        """The sandbox of `session_id`; None if the id holds nothing here."""
        session_id = checked_session(session_id)
        held = any(sid == session_id for _, sid in self._entries) or self._has_workspace(session_id)
        if not held:
            return None
        live = await self.markers.live() if self.markers is not None else []
        return await self._sandbox(session_id, [m for m in live if m.session_id == session_id])

    async def _sandbox(self, session_id: str, markers: list[Any]) -> SandboxState:
        open_ = [(e.config.name, e.config.kind, "running" if e.state == "running" else "stopped", e)
                 for (_, sid), e in self._entries.items() if sid == session_id]  # fmt: skip
        machines = [(name, kind, state) for name, kind, state, _ in open_]
        machines += [
            (m.machine, m.kind, "stopped") for m in markers if m.machine not in {n for n, *_ in open_}
        ]
        used = [wall_time(e.machine.last_used) for *_, e in open_ if isinstance(e.machine, Lifetime)]
        with contextlib.suppress(OSError):
            used.append((self.session_dir(session_id) / ACTIVITY_FILE).stat().st_mtime)
        size = await asyncio.to_thread(disk.usage, self._workspace(session_id))
        return SandboxState(session_id, machines, size, max(used, default=None))

    def _workspace_ids(self) -> list[str]:
        sessions = self.settings.home / "sessions"
        if not sessions.is_dir():
            return []
        return [d.name for d in sessions.iterdir() if is_session_id(d.name) and self._has_workspace(d.name)]

    def _has_workspace(self, session_id: str) -> bool:
        workspace = self._workspace(session_id)
        return workspace.is_dir() or disk.image_of(workspace).exists()

    def entry(self, session_id: str | None, name: str | None = None) -> Entry | None:
        config = self.config(name)
        sid = checked_session(session_id or DEFAULT_SESSION) if config.per_session else None
        return self._entries.get((config.name, sid))

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def _lock(self, key: tuple[str, str | None]) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def suspend(self, entry: Entry) -> None:
        async with self._lock((entry.config.name, entry.session_id)):
            if isinstance(entry.machine, Lifetime) and entry.state == "running":
                entry.state = "suspended"
                await entry.machine.stop()

    async def close_session(self, session_id: str, *, purge: bool = False) -> None:
        """Close every machine of a session (and with `purge`, delete its workspace)."""
        for key, entry in list(self._entries.items()):
            if key[1] == session_id:
                machine = entry.machine
                await (machine.destroy() if isinstance(machine, Lifetime) else machine.close())
                del self._entries[key]
                if self.markers is not None:
                    await self.markers.clear(session_id, key[0])
        self._detach(session_id)
        if purge:
            disk.remove(self._workspace(session_id))
            shutil.rmtree(self.session_dir(session_id), ignore_errors=True)

    async def recover(self) -> list[str]:
        """After a restart: clean up what dead sandboxes left; they rebuild lazily."""
        release_orphans()  # mounts and cgroups of dead servers, whatever their home
        recovered: list[str] = []
        sessions = self.settings.home / "sessions"
        if disk.available() and sessions.is_dir():
            disk.detach_all(sessions)  # a dead server's workspace mounts: remounted on demand
        if self.markers is None:
            return recovered
        live = await self.markers.live()
        for marker in live:
            if not is_session_id(marker.session_id):  # written before ids were checked whole
                continue
            run = self.session_dir(marker.session_id) / "run" / marker.machine
            shutil.rmtree(run, ignore_errors=True)
            recovered.append(marker.session_id)
        # A deleted session's marker is live when the server died before closing its machines.
        kept = [m for m in live if not await self.markers.retired(m.session_id)]
        await self._sweep_leftovers({marker.sandbox_id for marker in kept})
        return recovered

    async def _sweep_leftovers(self, keep: set[str]) -> None:
        """Each kind's own leftovers that no live session names (a dead server's containers,
        its E2B sandboxes).

        An engine that cannot be reached is logged, not fatal: its machines report it when used.
        """
        for kind in KINDS.values():
            configs = [c for c in self.settings.machines.values() if c.kind == kind.name]
            if kind.sweep is None or not configs:
                continue
            try:
                opened = [self.unsealed(c) for c in configs]
                removed = await kind.sweep(self.shared(kind), opened, keep)
            except SecretError as exc:
                log.warning(
                    "could not sweep leftovers of %s machines: a secret is unreadable: %s", kind.name, exc
                )
                continue
            except MachineError as exc:
                log.warning("could not sweep leftovers of %s machines: %s", kind.name, exc.message)
                continue
            if removed:
                log.info("removed %d leftover %s machine(s) no live session names", len(removed), kind.name)

    async def sweep(self, now: float | None = None) -> None:
        """Reclaim idle sandboxes and purge long-inactive workspaces."""
        now = time.monotonic() if now is None else now
        idle = self.settings.idle_minutes * 60
        for entry in self.entries():
            m = entry.machine
            if not isinstance(m, Lifetime) or entry.state != "running":
                continue
            if not m.busy() and now - m.last_used > idle:
                await self.suspend(entry)
        self.purge_inactive()

    def purge_inactive(self, wall_now: float | None = None) -> list[str]:
        wall_now = time.time() if wall_now is None else wall_now
        limit = self.settings.purge_days * 86400
        purged: list[str] = []
        sessions = self.settings.home / "sessions"
        if not sessions.is_dir():
            return purged
        live = {e.session_id for e in self.entries() if e.state == "running"}
        for d in sessions.iterdir():
            marker = d / ACTIVITY_FILE
            if d.name in live or not marker.exists():
                continue
            if wall_now - marker.stat().st_mtime > limit and (d / "workspace").exists():
                self._attached.discard(d.name)
                disk.remove(d / "workspace")
                purged.append(d.name)
        return purged

    def start_janitor(self) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(JANITOR_INTERVAL)
                with contextlib.suppress(Exception):
                    await self.sweep()

        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(loop())

    async def shutdown(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            self._janitor = None
        for entry in self.entries():
            with contextlib.suppress(Exception):
                await entry.machine.close()
        self._entries.clear()
        for session_id in list(self._attached):
            self._detach(session_id)


def deleted(session_id: str) -> SessionDeleted:
    """The refusal of a retired id, wherever it is asked for."""
    return SessionDeleted(
        f"session {session_id} was deleted: its sandbox is gone for good (a new session has a new id)"
    )


def wall_time(monotonic: float) -> float:
    """The wall-clock time of a `time.monotonic()` reading."""
    return time.time() - (time.monotonic() - monotonic)


def checked_session(session_id: str) -> str:
    """`session_id` if it may name a session directory (`ids.is_session_id`), else `PathEscape`.

    Every path of a session is made from its id here, so this is the one check: the HTTP
    layer, MCP and the CLI all reach a session's files through the registry.
    """
    if not is_session_id(session_id):
        raise PathEscape(f"invalid session id {session_id!r}: {SESSION_ID_RULE}", path=str(session_id))
    return session_id
