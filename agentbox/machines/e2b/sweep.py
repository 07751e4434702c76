"""What a dead server left on its E2B endpoints, killed when the next one starts (`Kind.sweep`).

A server that dies (or loses a kill to an unreachable endpoint) leaves its sandboxes running,
and billed on E2B's cloud, until their `timeout`. Every sandbox an e2b machine makes carries
its owner in its metadata, `agentbox_home` (`config.home_label` of the server's home), beside
its machine, instance and session. At start the registry hands `sweep` the instance ids that
live sessions' markers name (a deleted session's are not among them); on each configured
endpoint, every sandbox, running or paused, whose `agentbox_home` is this home's and whose
`agentbox_instance` is none of those is killed.

Never touched: the sandboxes of live sessions (their machines connect to them again), and
every sandbox without this home's label: another server's, anyone else's on the same account,
or one made before sandboxes carried the label. The label is checked here on each sandbox
listed, not only by the endpoint's metadata filter, so an endpoint that ignores the filter
kills nothing of anyone else's. An endpoint that cannot be reached or listed is logged and
skipped: its sandboxes are swept at a later start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from agentbox.machines.e2b.machine import HOME_KEY, INSTANCE_KEY
from agentbox.machines.e2b.options import E2BOptions, sdk

log = logging.getLogger(__name__)

#: Sandboxes asked for per page of an endpoint's listing (E2B's own most per page).
SWEEP_PAGE_SIZE = 100
#: Pages of a listing read at most per endpoint at one start; what lies beyond is swept at a
#: later start, so one endpoint cannot hold a start-up in a listing without end.
MAX_SWEEP_PAGES = 100


async def sweep(label: str, entries: Iterable[E2BOptions], keep: set[str]) -> list[str]:
    """Kill the sandboxes of home `label` that no instance id in `keep` names, on the endpoint
    of each entry (each endpoint once); the ids killed."""
    if not label:
        return []  # a sandbox without a home's label is nobody's to sweep
    e2b = sdk()
    endpoints: dict[tuple[tuple[str, Any], ...], E2BOptions] = {}
    for options in entries:
        endpoints.setdefault(tuple(sorted(options.api_params().items())), options)
    killed: list[str] = []
    for options in endpoints.values():
        try:
            killed += await _sweep_endpoint(e2b, options, label, keep)
        except Exception as exc:  # the SDK's and httpx's own: nothing to sweep there now
            log.warning("could not sweep the e2b sandboxes at %s: %s", options.where, exc)
    return killed


async def _sweep_endpoint(e2b: Any, options: E2BOptions, label: str, keep: set[str]) -> list[str]:
    params = options.api_params()
    states = [e2b.SandboxState.RUNNING, e2b.SandboxState.PAUSED]
    query = e2b.SandboxQuery(metadata={HOME_KEY: label}, state=states)
    pages = e2b.AsyncSandbox.list(query=query, limit=SWEEP_PAGE_SIZE, **params)
    found: list[Any] = []
    for _ in range(MAX_SWEEP_PAGES):
        if not pages.has_next:
            break
        found += await pages.next_items()
    if pages.has_next:
        log.warning("more than %d pages of e2b sandboxes at %s: the rest are swept at a later start",
                    MAX_SWEEP_PAGES, options.where)  # fmt: skip
    killed = []
    for info in found:
        metadata = info.metadata or {}
        if metadata.get(HOME_KEY) != label or metadata.get(INSTANCE_KEY) in keep:
            continue
        log.info("killing e2b sandbox %s at %s: no live session names it", info.sandbox_id, options.where)
        await e2b.AsyncSandbox.kill(info.sandbox_id, **params)
        killed.append(info.sandbox_id)
    return killed
