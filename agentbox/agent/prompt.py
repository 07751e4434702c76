"""The frozen system prompt (Flue's context composition, a.6), assembled once per baseline.

Sections, in order, blank-line joined (an empty section is left out):

1. the session's instructions;
2. `AGENTS.md` and `CLAUDE.md` from the working directory, each under a `# <file>` heading;
3. `## Available Skills`: how to use them, then one catalog line per skill;
4. `## Available Agents`: the subagent roster (or that there is none and `task` is not to be used);
5. `Date: <YYYY-MM-DD>`, then the machine line (seed 004), `Working directory: <root>` and
   `Directory structure:` (the top level of the working directory only, as Flue does).

Why frozen: a prompt that changes under the model invalidates provider prompt caches and
rewrites history the model already reasoned about. Changes during a session are told as
signals (`agent/signals.py`) at the next turn boundary; compaction rebaselines, i.e. calls
`assemble` again against the current environment.

A session without a machine (`machine: none`) gets no workspace part (2 and the machine,
working directory and listing lines of 5): it has no file or shell tools to use them with.

Files are read through the machine's file operations (`workspace/fileops.py`), whatever its
kind: on host files by descriptor (links followed inside the machine only), so a context file
that links out of the machine is skipped, never read; through the protocol (ssh) a context
file that is a link is skipped, since where it leads cannot be seen.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date

from agentbox.machines.base import TRASH_DIR, Machine, environment_line
from agentbox.tools.knowledge_bases import Scope
from agentbox.tools.shell import exec_shell
from agentbox.tools.skills import Skill, catalog_text
from agentbox.workspace.fileops import file_ops

#: The context files read from the working directory, in this order (Flue reads both).
CONTEXT_FILES = ("AGENTS.md", "CLAUDE.md")
#: Characters of one context file put in the prompt; the rest is cut with a marker (the prompt
#: is sent with every model call, so one huge file must not eat the context window).
MAX_CONTEXT_FILE_CHARS = 32_000
#: Entries of the working directory's top-level listing; past it a line says how many more.
MAX_LISTING_ENTRIES = 100
#: Bytes read of a context file: enough for `MAX_CONTEXT_FILE_CHARS` + 1 characters of UTF-8.
MAX_CONTEXT_FILE_BYTES = 4 * (MAX_CONTEXT_FILE_CHARS + 1)

SKILLS_HEADING = "## Available Skills"
#: Before a skill's catalog: `{call}` is how the session's toolset loads one (`SKILL_CALLS`).
SKILLS_INTRO = "Before starting work that matches a skill below, {call} to load its instructions."
#: How each toolset loads a skill: the workbench has no skill tool, its `read` takes skills.
SKILL_CALLS = {
    "default": "call `use_skill` with its name",
    "flue": "call `activate_skill` with its name",
    "workbench": 'call `read` with `"target": "skill"` and its name as `skillId`',
}
AGENTS_HEADING = "## Available Agents"
AGENTS_INTRO = "Delegate with the `task` tool to one of these agents:"
NO_AGENTS = "None. There are no subagents: do not call `task`."


@dataclass(frozen=True)
class Subagent:
    """One roster entry: what the `task` tool can delegate to."""

    name: str
    description: str

    def roster_line(self) -> str:
        return f"- {self.name}: {' '.join(self.description.split())}"


async def assemble(
    instructions: str,
    machine: Machine | None,
    *,
    skills: Sequence[Skill] = (),
    subagents: Sequence[Subagent] = (),
    today: date | None = None,
    toolset: str = "default",
    scope: Scope | None = None,
) -> str:
    """The system prompt for one baseline. `machine` is None for a session without a sandbox;
    `scope` its knowledge bases (None: the workspace root alone)."""
    sections = [
        instructions.strip(),
        await context_files(machine) if machine is not None else "",
        skills_section(skills, toolset),
        agents_section(subagents),
        await facts(machine, today or date.today(), scope),
    ]
    return "\n\n".join(s for s in sections if s)


async def context_files(machine: Machine) -> str:
    """AGENTS.md then CLAUDE.md from the working directory, each under its name; '' if neither."""
    parts = []
    for name in CONTEXT_FILES:
        text = await read_context_file(machine, name)
        if text is not None and text.strip():
            parts.append(f"# {name}\n\n{text.strip()}")
    return "\n\n".join(parts)


async def read_context_file(machine: Machine, name: str) -> str | None:
    """The file's text (cut at `MAX_CONTEXT_FILE_CHARS`), or None when absent or not readable."""
    ops = file_ops(machine)
    path = posixpath.join(machine.root, name)
    try:  # a FIFO or device swapped in is refused, never opened
        if await ops.contained("/", path) is None:
            return None  # a link whose target cannot be checked (through the protocol)
        data = await ops.read_head(path, MAX_CONTEXT_FILE_BYTES)
    except Exception:  # PathEscape (a link out of the machine), permissions, a vanished file
        return None
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_CONTEXT_FILE_CHARS:
        return text[:MAX_CONTEXT_FILE_CHARS] + f"\n[... {name} cut at {MAX_CONTEXT_FILE_CHARS} characters]"
    return text


def skills_section(skills: Sequence[Skill], toolset: str = "default") -> str:
    if not skills:
        return ""
    intro = SKILLS_INTRO.format(call=SKILL_CALLS.get(toolset, SKILL_CALLS["default"]))
    return f"{SKILLS_HEADING}\n\n{intro}\n\n{catalog_text(list(skills))}"


def agents_section(subagents: Sequence[Subagent]) -> str:
    if not subagents:
        return f"{AGENTS_HEADING}\n\n{NO_AGENTS}"
    lines = "\n".join(agent.roster_line() for agent in subagents)
    return f"{AGENTS_HEADING}\n\n{AGENTS_INTRO}\n\n{lines}"


async def facts(machine: Machine | None, today: date, scope: Scope | None = None) -> str:
    lines = [f"Date: {today.isoformat()}"]
    if machine is not None:
        lines.append(environment_line(machine))
        working = scope.base.root if scope is not None else machine.root
        lines.append(f"Working directory: {working}")
        if scope is not None and len(scope.registered) > 1:
            lines.append(
                "Knowledge bases (your own files; relative paths start at the first; search and "
                "knowledgeBaseIds use these ids):\n" + "\n".join(f"- {line}" for line in scope.describe())
            )
        lines.append(f"Shell: {await exec_shell(machine)} (the exec tool runs each command with it, -c)")
        listing = await directory_listing(machine, working)
        if listing:
            lines.append(f"Directory structure:\n{listing}")
    return "\n".join(lines)


async def directory_listing(machine: Machine, folder: str | None = None) -> str:
    """The top level of `folder` (the working directory; default the machine's root), not
    recursive, folders with a trailing `/`, sorted."""
    try:
        entries = await file_ops(machine).listdir(folder or machine.root)
    except Exception:  # an unreadable root leaves the listing out rather than failing the prompt
        return ""
    names = [  # a link is listed as itself, wherever it leads; the trash is no entry of the agent's
        e.name + ("/" if e.stat.is_dir and not e.stat.is_symlink else "")
        for e in sorted(entries, key=lambda e: e.name)
        if e.name != TRASH_DIR
    ]
    shown = names[:MAX_LISTING_ENTRIES]
    lines = [f"- {name}" for name in shown]
    if len(names) > len(shown):
        lines.append(f"[... and {len(names) - len(shown)} more entries]")
    return "\n".join(lines)
