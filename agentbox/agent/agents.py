"""The agent roster: what the `task` tool can delegate to, and where those agents come from.

Sources, later ones overriding earlier ones by name:

1. `BUILTIN_AGENTS`: `explore` (reads the workspace), `researcher` (explore + the web, and looking at the browser's pages) and
   `writer` (explore + write/edit, in `workspace-write`, so its edits are staged as change sets);
2. the server's configuration (`load_agents(..., configured=[{name, description, ...}])`);
3. `.agents/agents/*.md` in the machine's working directory: YAML frontmatter (`name` defaults
   to the file's stem, `description` required, `tools` a list of canonical tool names, default
   explore's, `permission` a tier, default `read-only`, `model` optional) and the instructions as
   the body. Read through the machine's file operations (`workspace/fileops.py`); a file that
   links out of the working directory is skipped (through the protocol, where a link's target
   cannot be seen, any link is). A bad file is skipped and reported, never hides the others.

Running a task as a child agent is `agent/subagents.py`.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from agentbox.agent import prompt as prompt_mod
from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError
from agentbox.tools.base import Action, Tool
from agentbox.tools.skills import SKILL_FILE, SkillError, split_frontmatter
from agentbox.tools.tiers import Tier
from agentbox.tools.toolsets import TOOLSETS, canonical_tools
from agentbox.workspace.fileops import FileOps, file_ops

log = logging.getLogger(__name__)

#: Where a workspace declares agents, relative to the machine's working directory.
AGENTS_DIR = ".agents/agents"
#: Agent files read from `AGENTS_DIR` (by name); the rest are reported and skipped (the roster
#: sits in every system prompt).
MAX_AGENT_FILES = 100
#: Largest agent file read; a bigger one is skipped (its body becomes a system prompt).
MAX_AGENT_FILE_BYTES = 64 * 1024
#: Longest agent description (it is a roster line in every system prompt).
MAX_DESCRIPTION_CHARS = 1024
#: An agent's name: what `task` is called with, and a file stem.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The result of a child that finished without a word (Flue's wording).

#: Actions that only look: a tool with one of these that is also `read_only` changes nothing.
LOOKING = frozenset({Action.READ, Action.READ_EXTERNAL, Action.WEB, Action.BROWSER_READ, Action.META})

EXPLORE_TOOLS: tuple[str, ...] = ("read", "glob", "grep", "list", "search", "read_image")
#: Read-only web research, which explore has too (seed 001: read-only roles may research).
WEB_TOOLS: tuple[str, ...] = ("web_search", "web_fetch")
RESEARCHER_TOOLS: tuple[str, ...] = (*EXPLORE_TOOLS, *WEB_TOOLS, "browser_read")
WRITER_TOOLS: tuple[str, ...] = (*EXPLORE_TOOLS, "write", "edit")


# ---------------------------------------------------------------- what an agent is


@cache
def _tools_by_canonical_name() -> dict[str, Tool]:
    return canonical_tools(overwrite_if_read=False)


def canonical_tool(canonical: str) -> Tool | None:
    """The tool of a canonical name, whether or not a toolset lists it."""
    return _tools_by_canonical_name().get(canonical)


def changes_nothing(canonical: str) -> bool:
    """Whether a tool (by canonical name) only looks: a read-only tool whose action reads.

    A name no module defines is never offered, so it changes nothing; MCP tools may do anything.
    """
    if canonical.startswith("mcp__"):
        return False
    tool = _tools_by_canonical_name().get(canonical)
    return tool is None or (tool.read_only and tool.action in LOOKING)


@dataclass(frozen=True)
class AgentSpec:
    """One agent `task` can delegate to."""

    name: str
    description: str
    """One line for the roster: when to use it."""
    instructions: str
    """Its system prompt (the date and machine lines are appended)."""
    tools: tuple[str, ...] = EXPLORE_TOOLS
    """Canonical tool names it may use (of those its parent has)."""
    tier: Tier = Tier.READ_ONLY
    """The most it may do; it runs under `intersect(parent's tier, tier)`."""
    model: str | None = None
    """Its model; None = the parent session's."""
    source: str = "builtin"
    """Where it was declared: `builtin`, `config`, or the agent file's path."""

    @property
    def read_only(self) -> bool:
        """Whether running it cannot change the workspace nor run commands: its tier is `read-only`
        (which its children inherit), or every tool it lists only looks (`changes_nothing`;
        `task` does not: a child may be a writer)."""
        return self.tier == Tier.READ_ONLY or all(changes_nothing(name) for name in self.tools)


FINAL_MESSAGE = (
    "Your final message (the reply in which you call no tools) is the only thing the agent that "
    "delegated to you will see: it sees neither your tool calls nor their results. Make it a complete, "
    "self-contained answer."
)

BUILTIN_AGENTS: dict[str, AgentSpec] = {
    spec.name: spec
    for spec in (
        AgentSpec(
            name="explore",
            description=(
                "Read-only codebase exploration: finds files, searches code and reads it to answer a "
                "question about the workspace, looking up a library's documentation on the web where the "
                "session allows it. Cannot change files or run commands."
            ),
            instructions=(
                "You are explore, a subagent that investigates the workspace for another agent. Answer the "
                "task you were given by searching and reading: find candidates by file name and by content, "
                "then read the parts that matter to confirm what you found. Where the session allows the web, "
                "you may search it and fetch a page (a library's documentation, an error message) when the "
                "workspace does not answer. You cannot change files or run commands. Prefer targeted searches to reading whole trees, and stop as soon as you can "
                f"answer. {FINAL_MESSAGE} Give exact paths (and line numbers where they matter), quote the "
                "few lines that prove a point, and say what you could not find."
            ),
            tools=(*EXPLORE_TOOLS, *WEB_TOOLS),
            tier=Tier.FULL_AUTO,  # its tools only look: the tier only lets the parent's web through
        ),
        AgentSpec(
            name="researcher",
            description=(
                "Research in the workspace and on the web (search, fetch pages, read the pages open in the "
                "browser) to answer a question with sources. Changes nothing."
            ),
            instructions=(
                "You are researcher, a subagent that finds facts for another agent: in the workspace's files "
                "and, where the session allows it, on the web (search, then fetch the pages that look "
                "authoritative: official documentation, specifications, the project's own repository). "
                "Check claims against a primary source rather than repeating a summary. If web access is "
                "refused, say so and answer from what you can read. You cannot change files or run "
                f"commands. {FINAL_MESSAGE} Lead with the answer, then the evidence, with the URL or path "
                "of every source, and say what stayed uncertain."
            ),
            tools=RESEARCHER_TOOLS,
            tier=Tier.FULL_AUTO,
        ),
        AgentSpec(
            name="writer",
            description=(
                "Makes a well-defined change to files (write and edit); its changes are staged as change "
                "sets for the user's review. Cannot run commands."
            ),
            instructions=(
                "You are writer, a subagent that makes the file changes another agent describes. Read each "
                "file before you change it, keep to the task's scope, and follow the style of the "
                "surrounding code or text. You cannot run commands. Your changes are staged for the user's "
                "review rather than applied: the file on disk stays as it was until the user applies the "
                f"change set, which is expected. {FINAL_MESSAGE} List every change you made (path and what "
                "changed, with the change set and operation ids you were given), and anything in the task "
                "you did not do and why."
            ),
            tools=WRITER_TOOLS,
            tier=Tier.WORKSPACE_WRITE,
        ),
    )
}

#: The instructions of an agent declared without any.
DEFAULT_INSTRUCTIONS = f"You are a subagent doing one task for another agent. {FINAL_MESSAGE}"


# ---------------------------------------------------------------- loading the roster


class AgentError(Exception):
    """Why one declared agent is not usable (becomes a problem in `LoadedAgents`)."""


@dataclass
class LoadedAgents:
    agents: dict[str, AgentSpec]
    """By name; built-ins overridden by configured ones, those by the workspace's files."""
    problems: list[str] = field(default_factory=list)
    """One line per declaration skipped (also logged as warnings), for the caller to show."""


def known_tool_names() -> frozenset[str]:
    """Every canonical tool name a toolset can offer (what an agent's `tools` may list)."""
    return frozenset(canonical for names in TOOLSETS.values() for _, canonical in names)


async def load_agents(machine: Machine | None, configured: Sequence[Mapping[str, Any]] = ()) -> LoadedAgents:
    """The roster: built-ins, then `configured`, then the workspace's `.agents/agents/*.md`."""
    loaded = LoadedAgents(dict(BUILTIN_AGENTS))
    for index, entry in enumerate(configured):
        label = entry.get("name") if isinstance(entry, Mapping) else None
        where = f"configured agent {label if isinstance(label, str) else f'#{index}'}"
        try:
            if not isinstance(entry, Mapping):
                raise AgentError("it is not a mapping of fields")
            spec = parse_agent(entry, str(entry.get("instructions") or ""), None, "config")
        except AgentError as exc:
            loaded.problems.append(f"skipped {where}: {exc}")
            continue
        loaded.agents[spec.name] = spec
    if machine is not None:
        await _load_workspace(machine, loaded)
    for problem in loaded.problems:
        log.warning("%s", problem)
    return loaded


def parse_agent(
    fields: Mapping[str, Any], instructions: str, default_name: str | None, source: str
) -> AgentSpec:
    """An agent from its declared fields; `AgentError` naming the first field that is wrong."""
    name = fields.get("name", default_name)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise AgentError(f"invalid name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
    description = fields.get("description")
    if not isinstance(description, str) or not description.strip():
        raise AgentError("it has no description")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise AgentError(f"the description is longer than {MAX_DESCRIPTION_CHARS} characters")
    permission = fields.get("permission", Tier.READ_ONLY.value)
    try:
        tier = Tier(permission)
    except ValueError:
        raise AgentError(
            f"permission {permission!r} is not one of {', '.join(t.value for t in Tier)}"
        ) from None
    model = fields.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise AgentError("model must be a model name")
    return AgentSpec(
        name=name,
        description=" ".join(description.split()),
        instructions=instructions.strip() or DEFAULT_INSTRUCTIONS,
        tools=_tool_list(fields.get("tools")),
        tier=tier,
        model=model.strip() if model else None,
        source=source,
    )


def _tool_list(value: Any) -> tuple[str, ...]:
    """`tools` as a list of canonical names (or one comma-separated string); default explore's."""
    if value is None:
        return EXPLORE_TOOLS
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AgentError("tools must be a list of tool names")
    known = known_tool_names()
    unknown = [v for v in value if v not in known and not v.startswith("mcp__")]
    if unknown:
        raise AgentError(f"unknown tools {unknown}; canonical names are {', '.join(sorted(known))}")
    return tuple(dict.fromkeys(value))


async def _load_workspace(machine: Machine, loaded: LoadedAgents) -> None:
    folder = posixpath.join(machine.root, AGENTS_DIR)
    ops = file_ops(machine)
    try:
        names = sorted(
            e.name for e in await ops.listdir(folder) if e.name.endswith(".md") and not e.name.startswith(".")
        )
    except FileNotFoundError:
        return
    except Exception as exc:  # not a folder, a link out of the machine, unreadable
        loaded.problems.append(f"agent folder {folder} cannot be read: {exc}")
        return
    if len(names) > MAX_AGENT_FILES:
        loaded.problems.append(
            f"{folder} holds {len(names)} agent files; only the first {MAX_AGENT_FILES} by name are read"
        )
        names = names[:MAX_AGENT_FILES]
    for name in names:
        path = f"{folder}/{name}"
        try:
            spec = await _load_file(ops, machine.root, path, name)
        except AgentError as exc:
            loaded.problems.append(f"skipped agent file {path}: {exc}")
            continue
        loaded.agents[spec.name] = spec


async def _load_file(ops: FileOps, root: str, path: str, filename: str) -> AgentSpec:
    try:
        inside = await ops.contained(root, path)
    except Exception as exc:  # PathEscape and friends: the machine refused the path
        raise AgentError(str(exc)) from exc
    if inside is None:
        raise AgentError("it links out of the working directory")
    text = await _read_agent_file(ops, inside)
    try:
        fields, body = split_frontmatter(text)
    except SkillError as exc:  # the parser is the skills'; its messages name SKILL.md
        raise AgentError(str(exc).replace(SKILL_FILE, filename)) from None
    return parse_agent(fields, body, filename.removesuffix(".md"), path)


async def _read_agent_file(ops: FileOps, inside: str) -> str:
    """Read as a regular file only: a FIFO swapped in is refused, never opened (it would block)."""
    try:
        st = await ops.lstat(inside, follow=True)
        if st is None or not st.is_file:
            raise AgentError("it is not a regular file")
        data = await ops.read_head(inside, MAX_AGENT_FILE_BYTES + 1, follow=False)
    except OSError as exc:
        raise AgentError(f"cannot be read: {exc.strerror or exc}") from None
    except MachineError as exc:
        raise AgentError(f"cannot be read: {exc.message}") from None
    if len(data) > MAX_AGENT_FILE_BYTES:
        raise AgentError(f"it is larger than {MAX_AGENT_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise AgentError("it is not UTF-8 text") from None


def roster(agents: Mapping[str, AgentSpec]) -> list[prompt_mod.Subagent]:
    """The system prompt's `## Available Agents` entries, by name."""
    return [prompt_mod.Subagent(spec.name, spec.description) for _, spec in sorted(agents.items())]


def canonical_names(toolset_name: str) -> dict[str, str]:
    """Model-facing name -> canonical name for one toolset (what `Subagents(canonical=...)` takes)."""
    return {shown: canonical for shown, canonical in TOOLSETS[toolset_name]}


def miss(agent: str, agents: Mapping[str, AgentSpec]) -> str:
    """The factual miss for an undeclared agent (Flue's wording)."""
    available = ", ".join(sorted(agents)) or "none"
    return f'Subagent "{agent}" is not declared. Available subagents: {available}.'
