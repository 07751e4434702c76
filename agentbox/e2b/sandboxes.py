"""E2B sandboxes as agentbox sessions: what E2B's control plane knows about each one.

An E2B sandbox is a configured machine's per-session sandbox of a session whose id is the
sandbox id (`ses_<ulid>`), so `/sandboxes/<id>/v2/...` of agentbox's own API reaches the same
sandbox. `templateID` picks the machine (`template_machine`):

    absent, `base`, `code-interpreter-v1`   the default machine (`code-interpreter-v1` is what
                                            `e2b-code-interpreter` asks for; its code contexts
                                            need a Jupyter kernel in that machine's image)
    a configured machine's name             that machine, if it is per-session (a sandbox, a
                                            container, a remote E2B sandbox: not the host's)
    an image name                           the per-session machine that runs that image (the
                                            default one first)

An unknown template is a 404 that lists the ones this server has (`templates`). Beside the session this table keeps what E2B adds: the template, `metadata`,
`envVars` (the sandbox's environment, given to the registry as an env provider so every
process sees them), the `envdAccessToken` envd checks, and the end of its lifetime.

Lifetime, E2B's states on agentbox's machine lifecycle:

    running ──pause──▶ paused ──connect / resume──▶ running       (the timer is off while paused)
       │                  │
       └──kill, or end_at passes (set_timeout / connect / refreshes move it)──▶ gone

`pause` is filesystem-only, whatever the client asks for (`memory`): agentbox's reclaim,
so `/workspace` is kept and processes, `/tmp` and `$HOME` are not. `kill` closes the
machine and purges the workspace. Each sandbox is also recorded in its session's directory
(`records.py`), and `restore` reads the records back when the server starts: a sandbox
outlives a restart (its processes do not), and one whose end passed while the server was
down is killed then.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from agentbox.config import MachineConfig, Settings
from agentbox.e2b import records
from agentbox.e2b.metrics import FRESH_SECONDS, METRICS_INTERVAL_SECONDS, Sample, Samples
from agentbox.ids import SESSION, new_id
from agentbox.machines.base import Metered
from agentbox.machines.cgroups import Limits
from agentbox.machines.disk import DEFAULT_DISK_MB
from agentbox.machines.errors import ImageNotFound
from agentbox.machines.kinds import memory_mb
from agentbox.secrets import SecretBox
from agentbox.system import System
from agentbox.tools.services import MachineServices

log = logging.getLogger(__name__)

#: The lifetime of a sandbox created without `timeout`, in seconds (E2B's default).
DEFAULT_TIMEOUT_SECONDS = 300
#: The longest lifetime one `timeout` may ask for, in seconds (E2B's Pro cap).
MAX_TIMEOUT_SECONDS = 24 * 3600
#: The template a sandbox gets without `templateID`: the image agentbox sandboxes run on.
DEFAULT_TEMPLATE = "base"
#: The template `e2b-code-interpreter`'s `Sandbox.create()` asks for: an alias of the default
#: machine's image, whose code contexts need `python3-ipykernel` there (the `data` image has it).
CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1"
#: The envd version agentbox claims: the SDK turns features on by it (0.5.7: octet-stream
#: uploads; not 0.6.2, whose file metadata as xattrs is not served).
ENVD_VERSION = "0.5.7"
#: Sandboxes E2B's control plane keeps at once (the registry's own caps still apply).
MAX_E2B_SANDBOXES = 256
#: The first pid envd hands out; pids are this table's numbers for the machine's commands.
FIRST_PID = 1000
#: Processes a sandbox remembers by pid at most (the command manager keeps about as many).
MAX_PIDS_KEPT = 256
#: Idempotency keys remembered at most (the oldest is forgotten first).
MAX_IDEMPOTENCY_KEYS = 1024
#: Bytes of the envd access token (hex-encoded, so twice as many characters).
ACCESS_TOKEN_BYTES = 24


class E2BError(Exception):
    """An error E2B's SDK reads: an HTTP status and a message, as `{code, message}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(sandbox_id: str) -> E2BError:
    """The SDK tells "not running" from other failures by the words "was not found"."""
    return E2BError(404, f"sandbox {sandbox_id!r} was not found")


def templates(settings: Settings) -> list[str]:
    """The templates this server has: the aliases of the default machine, then each
    per-session machine's name and, where it names one, its image."""
    names = [DEFAULT_TEMPLATE, CODE_INTERPRETER_TEMPLATE]
    for config in _template_machines(settings):
        names += [config.name, *([str(config.options["image"])] if config.options.get("image") else [])]
    return list(dict.fromkeys(names))


def template_machine(settings: Settings, template: str) -> MachineConfig:
    """The configured machine `template` picks (see the module docstring); a 404 that lists
    the templates for one this server does not have, a 503 when the default machine is not
    per-session and the template falls to it."""
    machines = _template_machines(settings)
    if template in (DEFAULT_TEMPLATE, CODE_INTERPRETER_TEMPLATE):
        default = settings.machine(settings.default_machine)
        if default is None or not default.per_session:
            raise E2BError(
                503, f"the default machine {settings.default_machine!r} is not a per-session sandbox"
            )
        return default
    chosen = next((c for c in machines if c.name == template), None) or next(
        (c for c in machines if str(c.options.get("image", "")) == template), None
    )
    if chosen is None:
        raise E2BError(
            404,
            f"template {template!r} not found; this server has {', '.join(map(repr, templates(settings)))}",
        )
    return chosen


def _template_machines(settings: Settings) -> list[MachineConfig]:
    """The per-session machines, the default one first."""
    configs = [c for c in settings.machines.values() if c.per_session]
    return sorted(configs, key=lambda c: c.name != settings.default_machine)


@dataclass(frozen=True)
class Launched:
    """A process envd started: the machine's command and how E2B described it."""

    command_id: str
    config: Any
    """The `process.ProcessConfig` it was started with (what `List` shows)."""
    tag: str | None = None


@dataclass
class E2BSandbox:
    id: str
    template: str
    metadata: dict[str, str]
    env: dict[str, str]
    access_token: str
    started_at: datetime
    end_at: datetime
    pids: dict[int, Launched] = field(default_factory=dict)
    """pid -> the machine's command (`CommandManager`) it names."""
    tags: dict[str, int] = field(default_factory=dict)
    """A command's tag (E2B's name for it) -> its pid."""
    watch_cursors: dict[str, int] = field(default_factory=dict)
    """A polled watcher's id (the machine's watch hub's) -> the seq its events were read to."""
    state: str = "running"
    """E2B's state: `running` or `paused` (gone sandboxes are not in the table)."""
    samples: Samples = field(default_factory=Samples)
    """Its metrics (`metrics.py`): a bounded ring, gone with the sandbox."""
    machine: str | None = None
    """The configured machine its template picked (None: the default machine)."""
    _next_pid: itertools.count[int] = field(default_factory=lambda: itertools.count(FIRST_PID))
    _expiry: asyncio.Task[None] | None = None

    def new_pid(self, launched: Launched) -> int:
        pid = next(self._next_pid)
        self.pids[pid] = launched
        if launched.tag:
            self.tags[launched.tag] = pid
        while len(self.pids) > MAX_PIDS_KEPT:
            oldest = next(iter(self.pids))
            gone = self.pids.pop(oldest)
            if gone.tag and self.tags.get(gone.tag) == oldest:
                del self.tags[gone.tag]
        return pid

    def token_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.access_token.encode())

    def signature_ok(self, url: SignedUrl) -> bool:
        """Whether `url` was signed with this sandbox's token, and is not expired."""
        if url.expiration is not None and url.expiration < time.time():
            return False
        return hmac.compare_digest(url.signature.encode(), url.expected(self.access_token).encode())


@dataclass(frozen=True)
class SignedUrl:
    """A file URL the SDK signed (`download_url` / `upload_url`): usable without headers.

    The signature is `v1_` + unpadded base64 of sha256("path:operation:user:token[:expiration]"),
    with `user` empty for the default user; it names no sandbox, so the sandbox is the one
    whose token makes it.
    """

    path: str
    operation: str
    """`read` (GET) or `write` (POST)."""
    user: str
    signature: str
    expiration: int | None

    def expected(self, token: str) -> str:
        raw = f"{self.path}:{self.operation}:{self.user}:{token}"
        if self.expiration is not None:
            raw += f":{self.expiration}"
        digest = hashlib.sha256(raw.encode()).digest()
        return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def checked_timeout(value: Any, what: str = "timeout") -> int:
    """A lifetime in whole seconds, 1..MAX_TIMEOUT_SECONDS; E2BError 400 otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TIMEOUT_SECONDS:
        raise E2BError(400, f"{what} must be a whole number of seconds from 1 to {MAX_TIMEOUT_SECONDS}")
    return value


def checked_strings(value: Any, what: str) -> dict[str, str]:
    """A JSON object of strings (metadata, envVars); E2BError 400 otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise E2BError(400, f"{what} must be an object of string values")
    return dict(value)


class SandboxTable:
    """Every E2B sandbox of one running server, with the timers that end them."""

    def __init__(
        self, system_of: Callable[[], System | None], *, interval: float = METRICS_INTERVAL_SECONDS
    ) -> None:
        self._system_of = system_of
        self._interval = interval
        """Seconds between two metrics samples of each running sandbox."""
        self._sampler: asyncio.Task[None] | None = None
        self._sandboxes: dict[str, E2BSandbox] = {}
        self._provided: System | None = None
        """The system whose registry has our env provider (once per system)."""
        self._by_key: dict[str, asyncio.Future[E2BSandbox]] = {}
        """Idempotency-Key -> the create it started (done or still starting)."""

    def system(self) -> System:
        system = self._system_of()
        if system is None:
            raise E2BError(503, "the server is not open (starting or shutting down)")
        if self._provided is not system:
            system.registry.providers.append(self._env_of)
            self._provided = system
        return system

    def _env_of(self, machine: str, session_id: str | None) -> dict[str, str]:
        sandbox = self._sandboxes.get(session_id or "")
        return dict(sandbox.env) if sandbox is not None else {}

    # -- control plane --------------------------------------------------------------

    async def create_once(
        self,
        key: str | None,
        template: str | None,
        timeout: int,
        metadata: dict[str, str],
        env: dict[str, str],
    ) -> E2BSandbox:
        """`create`, or for an `Idempotency-Key` seen before the sandbox that key made (the same
        one for a retry racing the first try) while that sandbox is there."""
        if key is None:
            return await self.create(template, timeout, metadata, env)
        earlier = self._by_key.get(key)
        if earlier is not None and (not earlier.done() or earlier.exception() is None):
            sandbox = await asyncio.shield(earlier)
            if sandbox.id in self._sandboxes:
                return sandbox
        made: asyncio.Future[E2BSandbox] = asyncio.get_running_loop().create_future()
        self._by_key.pop(key, None)
        self._by_key[key] = made
        while len(self._by_key) > MAX_IDEMPOTENCY_KEYS:
            del self._by_key[next(iter(self._by_key))]
        try:
            made.set_result(await self.create(template, timeout, metadata, env))
        except BaseException as exc:
            made.set_exception(exc)
            made.exception()  # retrieved: a later retry creates anew
            raise
        return made.result()

    async def create(
        self, template: str | None, timeout: int, metadata: dict[str, str], env: dict[str, str]
    ) -> E2BSandbox:
        """A new sandbox, started (so the first command finds it running) and timed."""
        system = self.system()
        template = template or DEFAULT_TEMPLATE
        config = template_machine(system.settings, template)
        if len(self._sandboxes) >= MAX_E2B_SANDBOXES:
            raise E2BError(429, f"at most {MAX_E2B_SANDBOXES} sandboxes at once; kill one first")
        now = datetime.now(UTC)
        sandbox = E2BSandbox(
            new_id(SESSION), template, metadata, env, secrets.token_hex(ACCESS_TOKEN_BYTES),
            now, now + timedelta(seconds=timeout), machine=config.name,
        )  # fmt: skip
        self._sandboxes[sandbox.id] = sandbox
        try:
            await system.services.get(sandbox.id, sandbox.machine)
            self._record(sandbox)
        except BaseException as exc:
            del self._sandboxes[sandbox.id]
            await self._close_machine(system, sandbox.id)
            if ImageNotFound in (type(exc), type(exc.__cause__)):  # the operator's to build: no retry helps
                raise E2BError(404, f"template {template!r} is not ready: {exc}") from None
            raise
        self._arm(sandbox)
        return sandbox

    async def restore(self) -> list[str]:
        """Read back the sandboxes an earlier server recorded; kill those whose end has passed.
        Returns the ids restored (their machines start again on first use)."""
        system = self.system()
        restored = []
        sessions = system.settings.home / "sessions"
        for fields in await asyncio.to_thread(records.load_all, sessions, self._box()):
            sandbox = E2BSandbox(**fields)
            self._sandboxes[sandbox.id] = sandbox
            if sandbox.machine is not None and system.settings.machine(sandbox.machine) is None:
                log.info(
                    "e2b sandbox %s ran on machine %r, no longer configured; killing it",
                    sandbox.id,
                    sandbox.machine,
                )
                await self._kill_logged(sandbox)
                continue
            if sandbox.state == "running" and sandbox.end_at <= datetime.now(UTC):
                log.info(
                    "e2b sandbox %s reached its timeout while the server was down; killing it", sandbox.id
                )
                await self._kill_logged(sandbox)
                continue
            self._arm(sandbox)
            restored.append(sandbox.id)
        return restored

    def signed(self, url: SignedUrl) -> E2BSandbox | None:
        """The sandbox whose token signed `url` (each is tried: at most MAX_E2B_SANDBOXES)."""
        return next((s for s in self._sandboxes.values() if s.signature_ok(url)), None)

    def find(self, sandbox_id: str) -> E2BSandbox | None:
        return self._sandboxes.get(sandbox_id)

    def get(self, sandbox_id: str) -> E2BSandbox:
        sandbox = self.find(sandbox_id)
        if sandbox is None:
            raise not_found(sandbox_id)
        return sandbox

    def list(self, metadata: Mapping[str, str] | None = None) -> list[E2BSandbox]:
        wanted = dict(metadata or {})
        return [s for s in self._sandboxes.values() if all(s.metadata.get(k) == v for k, v in wanted.items())]

    def set_timeout(self, sandbox_id: str, timeout: int) -> E2BSandbox:
        """End the sandbox `timeout` seconds from now (sooner or later than before)."""
        sandbox = self.get(sandbox_id)
        sandbox.end_at = datetime.now(UTC) + timedelta(seconds=timeout)
        self._record(sandbox)
        self._arm(sandbox)
        return sandbox

    def extend(self, sandbox_id: str, timeout: int) -> E2BSandbox:
        """Keep the sandbox at least `timeout` seconds more (what `connect` does)."""
        sandbox = self.get(sandbox_id)
        if sandbox.end_at < datetime.now(UTC) + timedelta(seconds=timeout):
            self.set_timeout(sandbox_id, timeout)
        return sandbox

    async def pause(self, sandbox_id: str) -> None:
        """Release everything but the workspace (the registry's reclaim); 409 when already paused."""
        sandbox = self.get(sandbox_id)
        if sandbox.state == "paused":
            raise E2BError(409, f"sandbox {sandbox_id!r} is already paused")
        sandbox.state = "paused"
        self._record(sandbox)
        self._disarm(sandbox)
        system = self.system()
        entry = system.registry.entry(sandbox_id, sandbox.machine)
        if entry is not None:
            await system.registry.suspend(entry)

    async def resume(self, sandbox_id: str, timeout: int, *, strict: bool) -> E2BSandbox:
        """Run a paused sandbox again (rebuilt on its workspace) with `timeout` seconds to live;
        with `strict`, a sandbox that is already running is a 409 (the `resume` route)."""
        sandbox = self.get(sandbox_id)
        if sandbox.state != "paused":
            if strict:
                raise E2BError(409, f"sandbox {sandbox_id!r} is already running")
            return self.extend(sandbox_id, timeout)
        await self.system().services.get(sandbox_id, sandbox.machine)
        sandbox.state = "running"
        return self.set_timeout(sandbox_id, timeout)

    async def kill(self, sandbox_id: str) -> None:
        """Close the machine and purge its workspace, then forget the sandbox: once it reads as
        gone, nothing of it is left."""
        sandbox = self.get(sandbox_id)
        if sandbox._expiry is not asyncio.current_task():
            self._disarm(sandbox)
        await self._close_machine(self.system(), sandbox_id)
        self._sandboxes.pop(sandbox_id, None)

    async def services(self, sandbox_id: str) -> MachineServices:
        """The sandbox's machine and its services (rebuilt transparently if agentbox reclaimed it
        while idle); a paused sandbox stays paused until `connect` or `resume`."""
        sandbox = self.get(sandbox_id)
        if sandbox.state == "paused":
            raise E2BError(409, f"sandbox {sandbox_id!r} is paused; connect to it to resume it")
        return await self.system().services.get(sandbox_id, sandbox.machine)

    def shape(self, sandbox: E2BSandbox) -> dict[str, int]:
        """cpuCount, memoryMB, diskSizeMB of its machine as the SDK shows them (0: no limit set);
        the CPUs are the limit every sandbox gets without `cpus` (`Limits`), as its metrics count them."""
        config = self.system().registry.config(sandbox.machine)
        options = config.options
        return {
            "cpuCount": math.ceil(float(options.get("cpus") or Limits().cpus or 0)) or (os.cpu_count() or 1),
            "memoryMB": memory_mb(config),
            "diskSizeMB": int(options.get("disk_mb", DEFAULT_DISK_MB) or 0),
        }

    async def close(self) -> None:
        """Stop the timers (the machines close with the system)."""
        for sandbox in self._sandboxes.values():
            self._disarm(sandbox)
        self._sandboxes.clear()
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None

    # -- metrics --------------------------------------------------------------------------

    async def sample(self, sandbox: E2BSandbox) -> Sample | None:
        """A new sample of a running sandbox's machine, added to its ring; None when there is
        nothing to measure (paused, reclaimed while idle, or a kind that is not `Metered`)."""
        entry = (
            self.system().registry.entry(sandbox.id, sandbox.machine) if sandbox.state == "running" else None
        )
        if entry is None or not isinstance(entry.machine, Metered):
            return None
        usage = await asyncio.to_thread(entry.machine.usage)
        return sandbox.samples.add(usage, time.time()) if usage is not None else None

    async def fresh_sample(self, sandbox: E2BSandbox) -> Sample | None:
        """The newest sample, taken now when the newest is older than FRESH_SECONDS."""
        newest = sandbox.samples.newest()
        if newest is None or time.time() - newest.at > FRESH_SECONDS:
            newest = await self.sample(sandbox) or newest
        return newest

    async def _sample_all(self) -> None:
        """Every interval, a sample of each running sandbox (a failure is logged, not fatal)."""
        while True:
            await asyncio.sleep(self._interval)
            for sandbox in list(self._sandboxes.values()):
                try:
                    await self.sample(sandbox)
                except E2BError:
                    break  # the server is not open: the next round tries again
                except Exception:
                    log.exception("e2b sandbox %s: its metrics sample failed", sandbox.id)

    # -- records and lifetime -----------------------------------------------------------

    def _box(self) -> SecretBox:
        return SecretBox(self.system().settings.home)

    def _record(self, sandbox: E2BSandbox) -> None:
        """Write the sandbox's record (a few hundred bytes: on the loop, like the activity file)."""
        records.save(self.system().registry.session_dir(sandbox.id), sandbox, self._box())

    def _arm(self, sandbox: E2BSandbox) -> None:
        self._disarm(sandbox)
        if sandbox.state == "running":
            sandbox._expiry = asyncio.create_task(self._expire(sandbox))
        if self._sampler is None:
            self._sampler = asyncio.create_task(self._sample_all())

    @staticmethod
    def _disarm(sandbox: E2BSandbox) -> None:
        if sandbox._expiry is not None:
            sandbox._expiry.cancel()
            sandbox._expiry = None

    async def _expire(self, sandbox: E2BSandbox) -> None:
        delay = (sandbox.end_at - datetime.now(UTC)).total_seconds()
        await asyncio.sleep(max(0.0, delay))
        log.info("e2b sandbox %s reached its timeout; killing it", sandbox.id)
        await self._kill_logged(sandbox)

    async def _kill_logged(self, sandbox: E2BSandbox) -> None:
        """`kill` where nobody waits for it (a timer, the restore): a failure is logged, and the
        sandbox stays listed, so a later `kill` can try again."""
        try:
            await self.kill(sandbox.id)
        except E2BError:
            pass  # killed meanwhile
        except Exception:
            log.exception("e2b sandbox %s could not be killed", sandbox.id)

    @staticmethod
    async def _close_machine(system: System, sandbox_id: str) -> None:
        await system.services.forget(sandbox_id)
        await system.registry.close_session(sandbox_id, purge=True)
