"""The three toolsets: one implementation, three sets of names (issue 4).

Every tool exists once, under its canonical name, in the module that implements it; a
toolset is only a renaming (`Tool.renamed`), so parameters are the same in every toolset
and the behaviour cannot drift apart:

    canonical            default          workbench   flue
    exec                 bash             exec        bash
    read                 read_file        read        read
    write                write_file       write       write
    edit                 edit_file        edit        edit
    glob / grep          glob / grep      -           glob / grep
    list                 list             list        -
    search (knowledge)   search           search      -
    todo_write           todo_write       -           -
    deliver_file         deliver_file     -           -
    use_skill            use_skill        -           activate_skill
    read_skill_resource  -                -           read_skill_resource
    read_image           read_image       -           -
    web_search/web_fetch web_search/...   -           -
    browser              browser          browser     -
    task                 task             task        task

In the workbench, `search` also takes `target=web` and `read` takes `url` and `target=skill`
(`variants`, `workbench.py`): the same tools with the web and skills as targets, in place of
the web and skill tools it has no names for.

`write` differs in one switch: `default` and `flue` may overwrite a file the model read in
this session and that has not changed since (`overwrite_if_read`); `workbench` never
overwrites (seed 001). `browser` is in a toolset everywhere but offered only on a machine
whose entry enables it (`Tool.available`), and `mcp__<server>__<tool>` tools are added by the
runtime that connects the servers.

`task` is here as a door only: its delegate (the subagent runner) is set by the agent layer,
and MCP leaves it out (over MCP the client is the agent). A canonical tool whose module does
not exist is left out of every toolset; `unavailable(name)` says which. A module that exists but fails
to import is a bug and raises.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from agentbox.tools.base import Tool

log = logging.getLogger(__name__)

#: Modules that define canonical tools in a module-level `TOOLS` dict (write also has `make_write`).
TOOL_MODULES: tuple[str, ...] = (
    "agentbox.tools.read",
    "agentbox.tools.write",
    "agentbox.tools.edit",
    "agentbox.tools.find",
    "agentbox.tools.shell",
    "agentbox.tools.web",
    "agentbox.tools.todo",
    "agentbox.tools.skills",
    "agentbox.tools.deliver",
    "agentbox.tools.knowledge",
    "agentbox.tools.browser",
    "agentbox.tools.task",
)

#: Per toolset, (name the model sees, canonical name), in the order tools are offered.
TOOLSETS: dict[str, tuple[tuple[str, str], ...]] = {
    "default": (
        ("bash", "exec"),
        ("read_file", "read"),
        ("write_file", "write"),
        ("edit_file", "edit"),
        ("glob", "glob"),
        ("grep", "grep"),
        ("todo_write", "todo_write"),
        ("deliver_file", "deliver_file"),
        ("use_skill", "use_skill"),
        ("read_image", "read_image"),
        ("web_search", "web_search"),
        ("web_fetch", "web_fetch"),
        ("list", "list"),
        ("search", "search"),
        ("browser", "browser"),
        ("task", "task"),
    ),
    "workbench": (
        ("search", "search"),
        ("read", "read"),
        ("list", "list"),
        ("edit", "edit"),
        ("write", "write"),
        ("exec", "exec"),
        ("browser", "browser"),
        ("task", "task"),
    ),
    "flue": (
        ("read", "read"),
        ("write", "write"),
        ("edit", "edit"),
        ("bash", "exec"),
        ("grep", "grep"),
        ("glob", "glob"),
        ("task", "task"),
        ("activate_skill", "use_skill"),
        ("read_skill_resource", "read_skill_resource"),
    ),
}

#: Whether each toolset's write may replace a file read (and unchanged) in this session.
OVERWRITE_IF_READ: dict[str, bool] = {"default": True, "workbench": False, "flue": True}

DEFAULT_TOOLSET = "default"


def _module(name: str) -> ModuleType | None:
    """The module, or None when it does not exist (yet); other import failures raise."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        log.debug("tool module %s is not there; its tools are left out", name)
        return None


def canonical_tools(*, overwrite_if_read: bool) -> dict[str, Tool]:
    """Every tool that exists, by canonical name."""
    tools: dict[str, Tool] = {}
    for name in TOOL_MODULES:
        module = _module(name)
        if module is None:
            continue
        tools.update(getattr(module, "TOOLS", {}))
        make_write = getattr(module, "make_write", None)
        if make_write is not None:
            tools["write"] = make_write(overwrite_if_read)
    return tools


def variants(name: str) -> dict[str, Tool]:
    """The toolset's own implementations of canonical tools: the workbench's `search` and `read`
    take the web and skills as targets (`workbench.py`), since it has no tool of their own."""
    if name != "workbench":
        return {}
    from agentbox.tools import workbench

    return workbench.TOOLS


def toolset(name: str = DEFAULT_TOOLSET, *, overwrite_if_read: bool | None = None) -> dict[str, Tool]:
    """The tools of toolset `name`, keyed by the names the model sees, in offering order.

    `overwrite_if_read` overrides the toolset's own write rule (`OVERWRITE_IF_READ`).
    """
    if name not in TOOLSETS:
        raise ValueError(f"unknown toolset {name!r}; choose one of {', '.join(sorted(TOOLSETS))}")
    rule = OVERWRITE_IF_READ[name] if overwrite_if_read is None else overwrite_if_read
    tools = {**canonical_tools(overwrite_if_read=rule), **variants(name)}
    return {
        shown: tools[canonical].renamed(shown) for shown, canonical in TOOLSETS[name] if canonical in tools
    }


def unavailable(name: str = DEFAULT_TOOLSET) -> list[str]:
    """The names of toolset `name` whose implementation does not exist (yet)."""
    present = toolset(name)
    return [shown for shown, _ in TOOLSETS[name] if shown not in present]
