"""Signals: changes during a session told to the model as append-only messages (Flue a.7).

The system prompt is frozen per baseline (`agent/prompt.py`). When something it described
changes, the model learns it from a user-role message appended at the next turn boundary:

    <signal type="T" attr="v">
    BODY
    </signal>

Body and attribute values are XML-escaped (`& < >`, and `"` in attributes), so a tool
description cannot close the tag. The loop takes an `Environment` snapshot at each turn
boundary and appends `diff(previous, current)`; compaction's rebaseline restarts from a new
snapshot. Signal types:

    environment   the sandbox was attached, detached or replaced: a full snapshot (working
                  directory or "no sandbox", all tools, skills and agents); it supersedes
                  that boundary's resource deltas
    resources     attribute resource="tool|skill|subagent": one per changed kind; additions
                  as catalog lines, removals, updates, then all names of that kind
    permissions   the permission mode changed (an agentbox addition; Flue has no tiers)
    instructions  fixed body "System instructions updated." (the instructions are sent anew)
    task          attributes task_id, agent, status: a background task (`task` with
                  `background: true`) finished; the body is its final message. Not a change of
                  the environment: told at the first step boundary after it finished

An entry counts as updated when its description changes, or, for tools, the digest of its
input schema (the schema itself reaches the model in the tools array, so only the name is told).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from agentbox.agent.models import ChatMessage, ToolSpec

TAG = "signal"
INSTRUCTIONS_UPDATED = "System instructions updated."
STALE_WARNING = (
    "Files, paths and results from the previous environment may be inaccessible or different: "
    "re-verify them before relying on them."
)
ResourceKind = Literal["tool", "skill", "subagent"]
#: The kinds in the order their signals are appended, and how a body names one entry.
KIND_WORDS: dict[ResourceKind, tuple[str, str]] = {
    "tool": ("tool", "tools"),
    "skill": ("skill", "skills"),
    "subagent": ("agent", "agents"),
}


def escape(text: str, *, attribute: bool = False) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace('"', "&quot;") if attribute else text


@dataclass(frozen=True)
class Signal:
    type: str
    body: str
    attributes: tuple[tuple[str, str], ...] = ()

    def render(self) -> str:
        attrs = "".join(f' {k}="{escape(v, attribute=True)}"' for k, v in self.attributes)
        return f'<{TAG} type="{escape(self.type, attribute=True)}"{attrs}>\n{escape(self.body)}\n</{TAG}>'

    def message(self) -> ChatMessage:
        return ChatMessage("user", self.render())


@dataclass(frozen=True)
class Resource:
    """One catalog entry as the model knows it; `digest` tells a changed tool schema."""

    name: str
    description: str = ""
    digest: str = ""

    def catalog_line(self) -> str:
        return f"- {self.name}: {' '.join(self.description.split())}"


def tool_resources(specs: Iterable[ToolSpec]) -> tuple[Resource, ...]:
    return tuple(Resource(s.name, s.description, schema_digest(s.input_schema)) for s in specs)


def schema_digest(schema: object) -> str:
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Environment:
    """What the model was told about its surroundings, at one turn boundary."""

    machine: str | None
    """`environment_line(machine)`, or None for a session without a sandbox."""
    cwd: str | None = None
    tools: tuple[Resource, ...] = ()
    skills: tuple[Resource, ...] = ()
    subagents: tuple[Resource, ...] = ()
    permission_mode: str = ""
    instructions_digest: str = ""
    """`text_digest` of the instructions (only a change is told, never the text)."""
    knowledge_bases: tuple[str, ...] = ()
    """The selected knowledge bases, one `id: root` line each, the first where paths start."""

    def resources(self, kind: ResourceKind) -> tuple[Resource, ...]:
        return {"tool": self.tools, "skill": self.skills, "subagent": self.subagents}[kind]


def diff(before: Environment, after: Environment) -> list[Signal]:
    """The signals that tell the model how `after` differs from `before` (none if they agree)."""
    signals: list[Signal] = []
    if (before.machine, before.cwd) != (after.machine, after.cwd):
        signals.append(environment_signal(before, after))
    else:
        if before.knowledge_bases != after.knowledge_bases:
            signals.append(knowledge_signal(after))
        for kind in KIND_WORDS:
            delta = resource_signal(kind, before.resources(kind), after.resources(kind))
            if delta is not None:
                signals.append(delta)
    if before.permission_mode != after.permission_mode:
        signals.append(
            Signal(
                "permissions",
                f"Permission mode changed from {before.permission_mode or 'default'} to "
                f"{after.permission_mode or 'default'}; the tools' permissions follow the new mode.",
            )
        )
    if before.instructions_digest != after.instructions_digest:
        signals.append(Signal("instructions", INSTRUCTIONS_UPDATED))
    return signals


def environment_signal(before: Environment, after: Environment) -> Signal:
    if after.machine is None:
        head = (
            "The sandbox was detached. No sandbox remains: shell and file tools are unavailable, "
            "and there is no working directory."
        )
    else:
        what = "attached" if before.machine is None else "replaced"
        head = f"A sandbox was {what}.\n{after.machine}\nWorking directory: {after.cwd or '(unknown)'}"
    parts = [head]
    if before.machine is not None:
        parts.append(STALE_WARNING)
    parts.append("All available tools: " + (", ".join(t.name for t in after.tools) or "none"))
    parts.append("All available skills:" + _lines(after.skills))
    parts.append("All available agents:" + _lines(after.subagents))
    return Signal("environment", "\n\n".join(parts))


def knowledge_signal(after: Environment) -> Signal:
    listed = "\n".join(after.knowledge_bases) or "(none)"
    return Signal(
        "knowledge_bases",
        f"The session's knowledge bases changed. Relative paths now start at {after.cwd or '(unknown)'}.\n"
        f"Knowledge bases:\n{listed}",
    )


def _lines(entries: Sequence[Resource]) -> str:
    return "\n" + "\n".join(e.catalog_line() for e in entries) if entries else " none"


def resource_signal(
    kind: ResourceKind, before: Sequence[Resource], after: Sequence[Resource]
) -> Signal | None:
    old = {r.name: r for r in before}
    new = {r.name: r for r in after}
    added = [r for r in after if r.name not in old]
    removed = [name for name in old if name not in new]
    updated = [r for r in after if r.name in old and r != old[r.name]]
    if not (added or removed or updated):
        return None
    one, many = KIND_WORDS[kind]
    lines: list[str] = []
    if added:
        lines.append(f"New {one if len(added) == 1 else many} available:")
        lines += [f"- {r.name}" if kind == "tool" else r.catalog_line() for r in added]
    lines += [f'The {one} "{name}" is no longer available.' for name in removed]
    for r in updated:
        if kind == "tool":
            lines.append(f'The {one} "{r.name}" was updated.')
        else:
            lines.append(f'The {one} "{r.name}" was updated:\n{r.catalog_line()}')
    lines.append(f"All available {many}: " + (", ".join(r.name for r in after) or "none"))
    return Signal("resources", "\n".join(lines), (("resource", kind),))


def task_signal(task_id: str, agent: str, status: str, result: str) -> Signal:
    """The notice of a finished background task: its final message (or why it failed) as the body."""
    head = f"The background task {task_id} ({agent}) finished with status {status}. Its final message:"
    return Signal("task", f"{head}\n\n{result}", (("task_id", task_id), ("agent", agent), ("status", status)))
