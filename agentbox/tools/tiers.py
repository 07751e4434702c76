"""Seed 001's permission table, exactly, as data.

    action \\ tier     read-only      workspace-write   full-ask          full-auto
    read (workspace)  allow          allow             allow             allow
    read_external     forbid         forbid            ask (each time)   allow
    write             forbid         change set        change set        apply
    exec              forbid         forbid            ask (each time)   allow
    web               forbid         forbid            ask (each time)   allow
    browser_read      forbid         forbid            ask               allow
    browser_write     forbid         forbid            ask               allow
    mcp               forbid         forbid            ask               allow
    task              allow (children get the intersection of their own and the parent's rights)
    meta              allow

`plan` overrides any tier: workspace read-only, no exec, no browser changes, no MCP, no
change application; in the two full tiers it still allows read-only external research
(web, external reads, browser read snapshots), asking in full-ask. What the first two tiers
forbid can never be allowed by a single approval. Seed 004 adds: writes outside the
machine's root need approval, except in full-auto on an isolated machine (`outside_root_write`).

Which tier a session gets is `session_tier`, the one decision every entry point (the sessions
API, `agentbox run`, `agentbox mcp`, `/mcp`) makes: the tier asked for, else the machine's
default (`default_tier`: full-auto where the sandbox is the boundary, full-ask on the host).
Full-auto on a machine that is not isolated is the operator's choice, never a session's:
without `allow_full_auto = true` in the machine's entry it is refused (`FullAutoRefused`).
"""

from __future__ import annotations

import enum

from agentbox.config import MachineConfig
from agentbox.tools.base import Action


class Tier(enum.StrEnum):
    READ_ONLY = "read-only"
    WORKSPACE_WRITE = "workspace-write"
    FULL_ASK = "full-ask"
    FULL_AUTO = "full-auto"


class Decision(enum.StrEnum):
    ALLOW = "allow"
    ASK = "ask"  # a pending approval; the call waits for it
    STAGE = "stage"  # writes become a pending change set
    FORBID = "forbid"


A, Q, S, F = Decision.ALLOW, Decision.ASK, Decision.STAGE, Decision.FORBID

TABLE: dict[Action, tuple[Decision, Decision, Decision, Decision]] = {
    Action.READ: (A, A, A, A),
    Action.READ_EXTERNAL: (F, F, Q, A),
    Action.WRITE: (F, S, S, A),
    Action.EXEC: (F, F, Q, A),
    Action.WEB: (F, F, Q, A),
    Action.BROWSER_READ: (F, F, Q, A),
    Action.BROWSER_WRITE: (F, F, Q, A),
    Action.MCP: (F, F, Q, A),
    Action.TASK: (A, A, A, A),
    Action.META: (A, A, A, A),
}
ORDER = (Tier.READ_ONLY, Tier.WORKSPACE_WRITE, Tier.FULL_ASK, Tier.FULL_AUTO)
#: What plan mode still allows in the full tiers: read-only external research.
PLAN_RESEARCH = {Action.READ_EXTERNAL, Action.WEB, Action.BROWSER_READ}
#: What full-ask asks for on every call (the table's "each time"; seed 001: no cached grants).
#: An answer "for the session" lets this one call through and is recorded as `once`.
EACH_CALL = frozenset({Action.READ_EXTERNAL.value, Action.EXEC.value, Action.WEB.value})


def decide(tier: Tier, action: Action, *, plan: bool = False) -> Decision:
    base = TABLE[action][ORDER.index(tier)]
    if not plan:
        return base
    if action in (Action.READ, Action.TASK, Action.META):
        return base
    if action in PLAN_RESEARCH and tier in (Tier.FULL_ASK, Tier.FULL_AUTO):
        return base
    return Decision.FORBID


def default_tier(isolated: bool) -> Tier:
    """full-auto where the sandbox is the boundary; full-ask on a machine that isn't isolated."""
    return Tier.FULL_AUTO if isolated else Tier.FULL_ASK


class FullAutoRefused(ValueError):
    """`full-auto` asked for on a machine that is not isolated, without the operator's consent."""


def session_tier(machine: MachineConfig | None, requested: Tier | None = None) -> Tier:
    """The tier a session on `machine` (None: no machine) runs with: `requested`, else the default.

    A session without a machine runs nothing anywhere, so it counts as isolated.
    """
    isolated = machine is None or machine.isolated
    if requested is None:
        return default_tier(isolated)
    if requested == Tier.FULL_AUTO and not isolated and machine is not None and not machine.allow_full_auto:
        raise FullAutoRefused(
            f"full-auto on machine {machine.name!r} (kind {machine.kind}: not isolated, the host's own rights) "
            f"needs the operator's `allow_full_auto = true` in its [machines.{machine.name}] entry; "
            "use full-ask (the default there) or an isolated sandbox machine"
        )
    return requested


def outside_root_write(tier: Tier, isolated: bool) -> Decision:
    """A write outside the machine's root. Seed 004: the file tools raise a permission question
    instead of failing, in full-auto too on a machine that is not isolated (the host, an ssh
    host); inside an isolated sandbox the whole sandbox is the agent's, so full-auto writes
    anywhere in it. The tiers that only change the workspace never can."""
    if tier == Tier.FULL_AUTO:
        return Decision.ALLOW if isolated else Decision.ASK
    return Decision.ASK if tier == Tier.FULL_ASK else Decision.FORBID


def intersect(parent: Tier, child: Tier) -> Tier:
    """A subagent's tier: never more than its parent's."""
    return ORDER[min(ORDER.index(parent), ORDER.index(child))]
