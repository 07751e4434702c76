"""Agent Skills: discovery, the catalog, `use_skill` (Flue's `activate_skill`) and `read_skill_resource`.

A skill is a folder holding `SKILL.md` (YAML frontmatter + markdown instructions) and any
supporting files, in the open Agent Skills format. Skills are found in two places:

- the workspace: `<root>/.agents/skills/<name>/SKILL.md`, through the machine's file
  operations (`workspace/fileops.py`), whatever its kind; their files are ordinary workspace
  files the model can also read or run;
- folders the server is configured with (`ToolConfig.skill_dirs`), host folders the machine
  cannot see: their files are read only through `read_skill_resource`, through a view of
  that one folder (`SkillFolder`, so their links cannot lead out of it either).

Every skill carries the file operations its files are read through (`Skill.files`) and its
folder there (`Skill.dir`, links resolved). On host files (and a configured folder) links
are followed by descriptor inside the machine (or folder) only, and a FIFO or device swapped
in is refused rather than opened. Through the protocol (ssh), where a link's target cannot be
seen, no link inside the workspace is followed at all, and only regular files are opened.

Frontmatter rules (Flue a.11): `name` is lowercase letters, digits and single hyphens, at most
`MAX_NAME_CHARS`, and equals the folder name; `description` is non-empty, at most
`MAX_DESCRIPTION_CHARS`; `compatibility` at most `MAX_COMPATIBILITY_CHARS`; `license`,
`metadata` and `allowed-tools` are informational (not enforced); other fields are ignored. A
skill that breaks a rule is skipped and the reason kept as a warning; one bad skill never
hides the others. A name found twice keeps the configured folder's skill (the operator's)
over the workspace's, with a warning.

Progressive disclosure: the system prompt carries one catalog line per skill
(`catalog_text`); `use_skill` returns the instructions, re-read from disk at every call so
edits are picked up, with the base folder and the list of the skill's files. Skills are
bookkeeping (`Action.META`): reading them is allowed in every tier (seed 001: "enabled skill
resources" are readable at the base level).
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from agentbox.machines.base import FileStat, Machine
from agentbox.machines.errors import MachineError
from agentbox.machines.hostfs import HostFiles
from agentbox.machines.hostview import HostView, Mount
from agentbox.workspace.fileops import FileOps, HostOps, file_ops

from .base import Action, Tool, ToolConfig, ToolContext, ToolParams, ToolResult

log = logging.getLogger(__name__)

SKILL_FILE = "SKILL.md"
#: Where skills live in a workspace, relative to the machine's root.
WORKSPACE_SKILLS_DIR = ".agents/skills"
#: Longest skill name (the Agent Skills spec).
MAX_NAME_CHARS = 64
#: Longest description (the Agent Skills spec).
MAX_DESCRIPTION_CHARS = 1024
#: Longest `compatibility` note (the Agent Skills spec).
MAX_COMPATIBILITY_CHARS = 500
#: Largest SKILL.md read; a bigger one is skipped with a warning.
MAX_SKILL_FILE_BYTES = 1024 * 1024
#: Skills in one catalog; the rest are skipped with a warning (the catalog sits in every prompt).
MAX_SKILLS = 100
#: Files listed by `use_skill`; past it the list says how many more there are.
MAX_RESOURCES_LISTED = 100
#: Largest resource `read_skill_resource` reads.
MAX_RESOURCE_BYTES = 10 * 1024 * 1024
#: Characters of a resource one call shows (seed 001's read window); `nextOffset` continues.
RESOURCE_PAGE_CHARS = 6000
#: Folders never listed as resources (Flue's packaging skips them too).
SKIPPED_DIRS = frozenset({".git", "node_modules", "dist", "__pycache__"})

NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
Source = Literal["workspace", "configured"]


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    files: FileOps = field(compare=False, repr=False)
    """What the skill's files are read through: the machine's file operations, or its configured folder's."""
    dir: str
    """The skill's folder in `files`, links resolved."""
    base_dir: str
    """The folder as the model can name it: an inside path for workspace skills, else the host path."""
    source: Source
    body: str = ""
    """The instructions (SKILL.md after the frontmatter) as read at discovery."""
    license: str | None = None
    compatibility: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    allowed_tools: str | None = None

    def catalog_line(self) -> str:
        return f"- {self.name}: {' '.join(self.description.split())}"


@dataclass
class Discovery:
    skills: list[Skill]
    warnings: list[str]


class SkillError(Exception):
    """Why one skill folder is not a usable skill (becomes a warning)."""


class SkillFolder(HostFiles):
    """A configured skill folder as host files of its own: one read-only mount, its own root."""

    def __init__(self, root: Path) -> None:
        self.name = "skills"
        self.root = str(root)
        self.ripgrep = ""
        self.view = HostView([Mount(str(root), root, writable=False)], str(root))


# -- discovery ---------------------------------------------------------------------------


async def discover(machine: Machine, config: ToolConfig) -> Discovery:
    """Every valid skill (sorted by name) and a warning for each folder skipped."""
    warnings: list[str] = []
    found: dict[str, Skill] = {}
    candidates = [*_configured(config, warnings), *await _in_workspace(machine, warnings)]
    for where, load in candidates:
        try:
            skill = await load()
        except SkillError as exc:
            warnings.append(f"skipped skill {where}: {exc}")
            continue
        if skill.name in found:
            warnings.append(
                f"skipped skill {where}: a skill named {skill.name!r} is already at {found[skill.name].base_dir}"
            )
            continue
        if len(found) >= MAX_SKILLS:
            warnings.append(f"skipped skill {where}: more than {MAX_SKILLS} skills")
            continue
        found[skill.name] = skill
    return Discovery(sorted(found.values(), key=lambda s: s.name), warnings)


async def catalog(machine: Machine, config: ToolConfig) -> list[Skill]:
    """The skills to offer (the system prompt's catalog); skipped ones are logged."""
    found = await discover(machine, config)
    for warning in found.warnings:
        log.warning("%s", warning)
    return found.skills


def catalog_text(skills: list[Skill]) -> str:
    """One line per skill, for the system prompt; empty when there are none."""
    return "\n".join(skill.catalog_line() for skill in skills)


Loader = tuple[str, Callable[[], Awaitable[Skill]]]


def _configured(config: ToolConfig, warnings: list[str]) -> list[Loader]:
    loaders: list[Loader] = []
    for folder in config.skill_dirs:
        root = Path(folder).resolve()  # operator configuration: a host folder, trusted
        try:
            entries = sorted(e.name for e in os.scandir(root) if not e.name.startswith("."))
        except OSError as exc:
            warnings.append(f"skill folder {folder} cannot be read: {exc.strerror or exc}")
            continue
        ops = HostOps(SkillFolder(root))
        for name in entries:
            directory = root / name
            if directory.is_dir():
                loaders.append((str(directory), partial(_load, ops, str(directory), name, "configured")))
    return loaders


async def _in_workspace(machine: Machine, warnings: list[str]) -> list[Loader]:
    inside = posixpath.join(machine.root, WORKSPACE_SKILLS_DIR)
    ops = file_ops(machine)
    try:
        entries = [e.name for e in await ops.listdir(inside) if _maybe_folder(e.name, e.stat)]
    except FileNotFoundError:
        return []
    except Exception as exc:  # not a folder, a link out of the machine, unreadable
        warnings.append(f"skill folder {inside} cannot be read: {exc}")
        return []
    loaders: list[Loader] = []
    for name in entries:
        path = f"{inside}/{name}"
        loaders.append((path, partial(_load, ops, path, name, "workspace")))
    return loaders


def _maybe_folder(name: str, st: FileStat) -> bool:
    """A skill candidate: a visible folder, or a link (followed later, where it can be checked)."""
    return not name.startswith(".") and (st.is_dir or st.is_symlink)


async def _load(ops: FileOps, path: str, name: str, source: Source) -> Skill:
    """The skill in folder `path`; links are followed inside the machine (or folder), never out of it."""
    try:
        directory = await ops.contained("/", path)
        if directory is None:
            raise SkillError("it is a link, and where it leads cannot be checked on this machine")
        st = await ops.lstat(directory, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if not st.is_dir:
            raise SkillError("not a folder")
        skill_md = await ops.contained(directory, f"{directory}/{SKILL_FILE}")
    except FileNotFoundError:
        raise SkillError(f"no {SKILL_FILE}") from None
    except (OSError, MachineError) as exc:  # PathEscape and friends: the view refused the path
        raise SkillError(str(exc)) from exc
    if skill_md is None:
        raise SkillError(f"{SKILL_FILE} is a link out of the skill's folder")
    base_dir = directory if source == "workspace" else path
    return _parse(await _read_skill_file(ops, skill_md), name, ops, directory, base_dir, source)


async def _read_skill_file(ops: FileOps, path: str) -> str:
    try:
        st = await ops.lstat(path, follow=True)
        if st is not None and not st.is_file:  # refused before it is opened: a FIFO would block
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        data = await ops.read_bytes(path, MAX_SKILL_FILE_BYTES)
    except FileNotFoundError:
        raise SkillError(f"no {SKILL_FILE}") from None
    except (OSError, MachineError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            raise SkillError(f"{SKILL_FILE} is larger than {MAX_SKILL_FILE_BYTES} bytes") from None
        if isinstance(exc, IsADirectoryError | MachineError):
            raise SkillError(f"{SKILL_FILE} is not a regular file") from None
        raise SkillError(f"{SKILL_FILE} cannot be read: {exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SkillError(f"{SKILL_FILE} is not UTF-8 text") from exc


def split_frontmatter(text: str) -> tuple[dict[str, Any], str]:
    """(frontmatter, body) of a SKILL.md; `SkillError` when the frontmatter is missing or not YAML."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise SkillError(f"{SKILL_FILE} does not start with a --- frontmatter block")
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise SkillError(f"{SKILL_FILE}'s frontmatter is not closed by a --- line")
    try:
        data = yaml.safe_load("".join(lines[1:end]))
    except yaml.YAMLError as exc:
        raise SkillError(f"the frontmatter is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise SkillError("the frontmatter is not a mapping of fields")
    return data, "".join(lines[end + 1 :]).strip("\n")


def _parse(text: str, folder: str, ops: FileOps, directory: str, base_dir: str, source: Source) -> Skill:
    data, body = split_frontmatter(text)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise SkillError("the frontmatter has no name")
    if len(name) > MAX_NAME_CHARS or not NAME.fullmatch(name):
        raise SkillError(
            f"invalid name {name!r}: use at most {MAX_NAME_CHARS} lowercase letters, digits and single hyphens"
        )
    if name != folder:
        raise SkillError(f"the name {name!r} does not match its folder {folder!r}")
    description = data.get("description")
    if not isinstance(description, str) or not description.strip():
        raise SkillError("the frontmatter has no description")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise SkillError(f"the description is longer than {MAX_DESCRIPTION_CHARS} characters")
    compatibility = _optional_text(data, "compatibility")
    if compatibility is not None and len(compatibility) > MAX_COMPATIBILITY_CHARS:
        raise SkillError(f"compatibility is longer than {MAX_COMPATIBILITY_CHARS} characters")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise SkillError("metadata is not a mapping")
    return Skill(
        name=name,
        description=description.strip(),
        files=ops,
        dir=directory,
        base_dir=base_dir,
        source=source,
        body=body,
        license=_optional_text(data, "license"),
        compatibility=compatibility,
        metadata={str(k): str(v) for k, v in metadata.items()},
        allowed_tools=_optional_text(data, "allowed-tools"),
    )


def _optional_text(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


async def resources(skill: Skill) -> list[str]:
    """The skill's files other than SKILL.md, relative and sorted; links out of the folder left out."""
    found: list[str] = []
    for node in await skill.files.walk(skill.dir, descend=lambda n: n.name not in SKIPPED_DIRS):
        if node.stat.is_dir and not node.stat.is_symlink:
            continue
        rel = node.rel
        if rel == SKILL_FILE:
            continue
        try:
            await locate(skill, rel)
        except SkillError:
            continue
        found.append(rel)
    return sorted(found)


async def unused_skill_tools(skills: list[Skill]) -> frozenset[str]:
    """The skill tools (canonical names) with nothing to work on, which a turn does not offer:
    `use_skill` and `read_skill_resource` without skills, `read_skill_resource` when no skill
    has a file besides its SKILL.md."""
    if not skills:
        return frozenset({"use_skill", "read_skill_resource"})
    for skill in skills:
        try:
            if await resources(skill):
                return frozenset()
        except (OSError, MachineError):
            return frozenset()  # unknown: offered, and the call says what it finds
    return frozenset({"read_skill_resource"})


# -- use_skill ---------------------------------------------------------------------------


USE_DESCRIPTION = (
    "Load a skill: returns its instructions, which you then follow to do the task, with the skill's base "
    "folder and its files (scripts, references, templates). Call it when a skill in the catalog fits the "
    "task, before starting the work. Read a skill's files with read_skill_resource."
)
READ_DESCRIPTION = (
    "Read a file of a skill (a path relative to the skill's folder, as use_skill lists them). Text only; "
    f"{RESOURCE_PAGE_CHARS} characters from `offset` per call, and a marker with the nextOffset to continue "
    "when there is more. Paths cannot leave the skill's folder."
)


class UseSkillParams(ToolParams):
    name: str = Field(description="The skill's name, as the catalog lists it.")


class ReadResourceParams(ToolParams):
    name: str = Field(description="The skill's name.")
    path: str = Field(description="The file's path relative to the skill's folder, e.g. `scripts/run.py`.")
    offset: int = Field(
        default=0,
        description="Character offset to start from: 0, or the nextOffset of the last result.",
        json_schema_extra={"minimum": 0},
    )


def _miss(name: str, skills: list[Skill]) -> ToolResult:
    available = ", ".join(s.name for s in skills) or "none"
    return ToolResult.text(f'Skill "{name}" is not available. Available skills: {available}.')


async def _find(ctx: ToolContext, name: str) -> tuple[Skill | None, list[Skill]]:
    skills = (await discover(ctx.machine, ctx.config)).skills
    return next((s for s in skills if s.name == name), None), skills


#: How the instructions tell the model to read one of a skill's files (`{name}`: the skill's).
RESOURCE_CALL = 'read_skill_resource {{"name": "{name}", "path": "<path>"}}'


async def run_use_skill(ctx: ToolContext, params: UseSkillParams) -> ToolResult:
    return await skill_instructions(ctx, params.name, RESOURCE_CALL)


async def skill_instructions(ctx: ToolContext, name: str, resource_call: str) -> ToolResult:
    """A skill's instructions and the list of its files, read with `resource_call`."""
    skill, skills = await _find(ctx, name.strip())
    if skill is None:
        return _miss(name, skills)
    call = resource_call.format(name=skill.name)
    files = await resources(skill)
    parts = [
        f'Run the skill named "{skill.name}".',
        "<skill_instructions>",
        skill.body,
        "</skill_instructions>",
    ]
    if skill.source == "workspace":
        parts.append(
            f"Base directory: {skill.base_dir} (resolve relative paths in the instructions from it)."
        )
    else:
        parts.append(
            f"This skill's files are not inside the machine: read them with {call}, and write "
            "what a command needs into the workspace first."
        )
    if files:
        listed = [f"- {rel}" for rel in files[:MAX_RESOURCES_LISTED]]
        if len(files) > MAX_RESOURCES_LISTED:
            listed.append(f"- ... and {len(files) - MAX_RESOURCES_LISTED} more files")
        parts += ["<skill_resources>", *listed, "</skill_resources>"]
        parts.append(f"Read a file with {call}.")
    return ToolResult.text("\n".join(parts), skill=skill.name, base_dir=skill.base_dir, resources=files)


# -- read_skill_resource -----------------------------------------------------------------


async def run_read_resource(ctx: ToolContext, params: ReadResourceParams) -> ToolResult:
    skill, skills = await _find(ctx, params.name.strip())
    if skill is None:
        return _miss(params.name, skills)
    if params.offset < 0:
        return ToolResult.error(f"offset must be 0 or more, got {params.offset}.")
    try:
        inside = await locate(skill, params.path)
        data = await _read_resource(skill.files, inside, params.path)
    except SkillError as exc:
        return ToolResult.error(str(exc))
    text = data.decode("utf-8")
    total = len(text)
    if params.offset > total or (params.offset == total and total > 0):
        return ToolResult.error(
            f"offset {params.offset} is past the end of {params.path} ({total} characters)."
        )
    end = min(params.offset + RESOURCE_PAGE_CHARS, total)
    next_offset = end if end < total else None
    shown = text[params.offset : end]
    if next_offset is not None:
        shown += f"\n\n[Showing characters {params.offset}-{end} of {total}. Use offset={next_offset} to continue.]"
    return ToolResult.text(
        shown, skill=skill.name, path=params.path, nextOffset=next_offset, total_chars=total
    )


async def locate(skill: Skill, rel: str) -> str:
    """The path of a skill's file, links followed; `SkillError` for anything leaving the skill's
    folder (links are followed only where they can be checked, never out of the folder)."""
    clean = posixpath.normpath(rel.strip()) if rel.strip() else ""
    if not clean or clean == "." or clean.startswith("/") or clean == ".." or clean.startswith("../"):
        raise SkillError(
            f"{rel!r} is not a path inside the skill {skill.name!r}: give a relative path like `scripts/run.py`."
        )
    try:
        real = await skill.files.contained(skill.dir, f"{skill.dir}/{clean}")
    except FileNotFoundError:
        raise SkillError(f"The skill {skill.name!r} has no file {clean}.") from None
    except Exception as exc:  # the view refused the path (a link out of it)
        raise SkillError(f"{rel!r} cannot be read: {exc}") from exc
    if real is None:
        raise SkillError(f"{rel!r} leads out of the skill {skill.name!r}; only its own files can be read.")
    return real


async def _read_resource(ops: FileOps, inside: str, rel: str) -> bytes:
    try:
        info = await ops.lstat(inside, follow=True)
    except (OSError, MachineError) as exc:
        raise SkillError(f"{rel} cannot be read: {exc}") from None
    if info is None:
        raise SkillError(f"{rel} cannot be read: it is gone")
    if info.is_dir:
        raise SkillError(f"{rel} is a folder; use_skill lists the skill's files.")
    if not info.is_file:
        raise SkillError(f"{rel} is not a regular file.")
    if info.size > MAX_RESOURCE_BYTES:
        raise SkillError(f"{rel} is larger than {MAX_RESOURCE_BYTES} bytes.")
    try:
        data = await ops.read_bytes(inside, MAX_RESOURCE_BYTES)
    except (OSError, MachineError) as exc:
        raise SkillError(f"{rel} cannot be read: {exc}") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise SkillError(
            f"{rel} is a binary file ({len(data)} bytes); only text files can be read."
        ) from None
    if b"\0" in data:
        raise SkillError(f"{rel} is a binary file ({len(data)} bytes); only text files can be read.")
    return data


USE_SKILL = Tool(
    name="use_skill",
    description=USE_DESCRIPTION,
    params=UseSkillParams,
    action=Action.META,
    run=run_use_skill,
)
READ_SKILL_RESOURCE = Tool(
    name="read_skill_resource",
    description=READ_DESCRIPTION,
    params=ReadResourceParams,
    action=Action.META,
    run=run_read_resource,
)

TOOLS: dict[str, Tool] = {t.name: t for t in (USE_SKILL, READ_SKILL_RESOURCE)}
