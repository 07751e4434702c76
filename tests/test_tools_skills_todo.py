"""Skills (discovery, activation, resources) in a real sandbox, and todo_write on a real SQLite store."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import traversable

from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.store.db import Database
from agentbox.store.todos import TodoRepo
from agentbox.tools import skills as skills_mod
from agentbox.tools.base import Action, FileStore, Operation, TodoStore, ToolConfig, ToolResult
from agentbox.tools.skills import (
    MAX_COMPATIBILITY_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_NAME_CHARS,
    MAX_SKILL_FILE_BYTES,
    READ_SKILL_RESOURCE,
    RESOURCE_PAGE_CHARS,
    USE_SKILL,
    ReadResourceParams,
    UseSkillParams,
    catalog,
    catalog_text,
    discover,
)
from agentbox.tools.todo import MAX_TODO_CHARS, MAX_TODOS, TODO_WRITE, TodoParams
from tests.scoped import Scoped

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Ctx(Scoped):
    machine: Any
    todos: TodoStore
    session_id: str = "ses_skills"
    turn_id: str | None = "trn_skills"
    config: ToolConfig = field(default_factory=ToolConfig)
    reads: dict[str, str] = field(default_factory=dict)
    files: FileStore | None = None
    deliveries: int = 0
    services: Any = None  # no machine services: tools make what they need
    asked: list[tuple[Action, str, dict[str, Any]]] = field(default_factory=list)

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        raise AssertionError("skills and todos never plan workspace operations")

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        self.asked.append((action, tool, detail))
        return None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def machine(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxMachine]:
    d = traversable(tmp_path_factory.mktemp("skills-tool"), tmp_path_factory)
    m = SandboxMachine(
        "sandbox", new_id(SANDBOX), sandbox_host, SandboxConfig(network=False), d / "workspace", d / "run"
    )
    await m.start()
    yield m
    await m.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def todos(tmp_path: Path) -> AsyncIterator[TodoRepo]:
    async with Database.in_home(tmp_path / "home") as db:
        yield TodoRepo(db)


def skill_md(
    name: str, description: str = "Does a thing.", body: str = "Step 1.\nStep 2.", **extra: str
) -> str:
    fields = "".join(f"{k}: {v}\n" for k, v in extra.items())
    return f"---\nname: {name}\ndescription: {description}\n{fields}---\n\n{body}\n"


def make_skill(root: Path, folder: str, text: str | None, files: dict[str, bytes] | None = None) -> Path:
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    if text is not None:
        (d / "SKILL.md").write_text(text)
    for rel, data in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


@pytest.fixture
def workspace_skills(machine: SandboxMachine) -> Path:
    """An empty `.agents/skills` in the sandbox's workspace (cleared between tests)."""
    root = machine.workspace / ".agents" / "skills"
    if root.exists():
        for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_symlink() or path.is_file():
                path.unlink()
            else:
                path.rmdir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def ctx_for(machine: Any, *skill_dirs: Path) -> Ctx:
    return Ctx(machine, MemoryTodos(), config=ToolConfig(skill_dirs=[str(d) for d in skill_dirs]))


class MemoryTodos:
    async def get(self, session_id: str) -> list[dict[str, Any]]:
        return []

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        pass


# -- discovery ---------------------------------------------------------------------------


async def test_discovery_in_the_workspace_and_configured_folders(
    machine: SandboxMachine, workspace_skills: Path, tmp_path: Path
) -> None:
    make_skill(
        workspace_skills, "pdf-tools", skill_md("pdf-tools", "Fill and merge PDF forms.", license="MIT")
    )
    make_skill(workspace_skills, "notes.txt-is-not-a-skill", None)
    (workspace_skills / "README.md").write_text("stray file, not a skill folder")
    configured = tmp_path / "skills"
    make_skill(configured, "brand-voice", skill_md("brand-voice", "Write in the house style."))
    # A link to a skill kept elsewhere in the workspace is followed inside the machine.
    make_skill(machine.workspace / "shared", "linked", skill_md("linked"))
    os.symlink("/workspace/shared/linked", workspace_skills / "linked")
    found = await discover(machine, ToolConfig(skill_dirs=[str(configured)]))
    assert [s.name for s in found.skills] == ["brand-voice", "linked", "pdf-tools"]
    assert found.skills[1].base_dir == "/workspace/shared/linked"
    pdf = found.skills[2]
    assert (pdf.source, pdf.base_dir, pdf.license) == (
        "workspace",
        "/workspace/.agents/skills/pdf-tools",
        "MIT",
    )
    assert pdf.body == "Step 1.\nStep 2."
    assert found.skills[0].source == "configured" and found.skills[0].base_dir == str(
        configured / "brand-voice"
    )
    assert found.warnings == ["skipped skill /workspace/.agents/skills/notes.txt-is-not-a-skill: no SKILL.md"]
    assert catalog_text(found.skills) == (
        "- brand-voice: Write in the house style.\n- linked: Does a thing.\n- pdf-tools: Fill and merge PDF forms."
    )


async def test_no_skills_folder_is_no_skills(machine: SandboxMachine, workspace_skills: Path) -> None:
    workspace_skills.rmdir()
    assert await catalog(machine, ToolConfig()) == []


async def test_malformed_skills_are_skipped_with_a_warning(
    machine: SandboxMachine, workspace_skills: Path, caplog: pytest.LogCaptureFixture
) -> None:
    longest = "a" * MAX_NAME_CHARS
    too_long = "a" * (MAX_NAME_CHARS + 1)
    cases = {
        "good": skill_md("good"),
        longest: skill_md(longest, "x" * MAX_DESCRIPTION_CHARS, compatibility="c" * MAX_COMPATIBILITY_CHARS),
        too_long: skill_md(too_long),
        "no-frontmatter": "# Just markdown\n",
        "unclosed": "---\nname: unclosed\ndescription: d\n",
        "bad-yaml": "---\nname: [unterminated\n---\nbody\n",
        "not-a-mapping": "---\n- a\n- b\n---\nbody\n",
        "wrong-folder": skill_md("other-name"),
        "Upper": skill_md("Upper"),
        "double--hyphen": skill_md("double--hyphen"),
        "-leading": skill_md("-leading"),
        "no-description": "---\nname: no-description\n---\nbody\n",
        "blank-description": skill_md("blank-description", "''"),
        "long-description": skill_md("long-description", "x" * (MAX_DESCRIPTION_CHARS + 1)),
        "long-compat": skill_md("long-compat", compatibility="c" * (MAX_COMPATIBILITY_CHARS + 1)),
        "bad-metadata": skill_md("bad-metadata", metadata="just-a-string"),
        "not-utf8": None,
        "too-big": skill_md("too-big", body="x" * MAX_SKILL_FILE_BYTES),
    }
    for folder, text in cases.items():
        make_skill(workspace_skills, folder, text)
    (workspace_skills / "not-utf8" / "SKILL.md").write_bytes(b"---\nname: not-utf8\ndescription: \xff\n---\n")
    found = await discover(machine, ToolConfig())
    assert [s.name for s in found.skills] == [longest, "good"]
    warned = {w.split(": ", 1)[0].rsplit("/", 1)[1] for w in found.warnings}
    assert warned == set(cases) - {"good", longest}
    reasons = " | ".join(found.warnings)
    for phrase in (
        "does not match its folder",
        "invalid name",
        "no description",
        "not valid YAML",
        "larger than",
    ):
        assert phrase in reasons
    with caplog.at_level("WARNING"):
        assert [s.name for s in await catalog(machine, ToolConfig())] == [longest, "good"]
    assert len([r for r in caplog.records if r.name == skills_mod.__name__]) == len(cases) - 2


async def test_a_name_in_both_places_keeps_the_configured_one(
    machine: SandboxMachine, workspace_skills: Path, tmp_path: Path
) -> None:
    make_skill(workspace_skills, "shared", skill_md("shared", "workspace copy"))
    configured = tmp_path / "skills"
    make_skill(configured, "shared", skill_md("shared", "operator copy"))
    found = await discover(machine, ToolConfig(skill_dirs=[str(configured), str(tmp_path / "missing")]))
    assert [(s.name, s.description) for s in found.skills] == [("shared", "operator copy")]
    assert any("already at" in w for w in found.warnings)
    assert any("missing cannot be read" in w for w in found.warnings)


# -- use_skill ---------------------------------------------------------------------------


async def use(ctx: Ctx, name: str) -> ToolResult:
    return await USE_SKILL.run(ctx, UseSkillParams(name=name))


async def read(ctx: Ctx, name: str, path: str, offset: int = 0) -> ToolResult:
    return await READ_SKILL_RESOURCE.run(ctx, ReadResourceParams(name=name, path=path, offset=offset))


async def test_activation_returns_instructions_base_dir_and_resources(
    machine: SandboxMachine, workspace_skills: Path
) -> None:
    make_skill(
        workspace_skills,
        "pdf-tools",
        skill_md("pdf-tools", body="Run scripts/fill.py on the form."),
        {"scripts/fill.py": b"print('fill')\n", "reference.md": b"# Ref\n", "node_modules/x.js": b"skip"},
    )
    result = await use(ctx_for(machine), "pdf-tools")
    assert not result.is_error
    assert result.as_text() == (
        'Run the skill named "pdf-tools".\n'
        "<skill_instructions>\nRun scripts/fill.py on the form.\n</skill_instructions>\n"
        "Base directory: /workspace/.agents/skills/pdf-tools (resolve relative paths in the instructions from it).\n"
        "<skill_resources>\n- reference.md\n- scripts/fill.py\n</skill_resources>\n"
        'Read a file with read_skill_resource {"name": "pdf-tools", "path": "<path>"}.'
    )
    assert result.data["resources"] == ["reference.md", "scripts/fill.py"]
    # The body is read again at each activation: edits are picked up.
    (workspace_skills / "pdf-tools" / "SKILL.md").write_text(skill_md("pdf-tools", body="New instructions."))
    assert (
        "<skill_instructions>\nNew instructions.\n</skill_instructions>"
        in (await use(ctx_for(machine), "pdf-tools")).as_text()
    )
    # The files are ordinary workspace files: a command in the sandbox runs the script.
    proc = await machine.exec(
        ExecRequest(command="python3 /workspace/.agents/skills/pdf-tools/scripts/fill.py")
    )
    assert proc.stdout == b"fill\n"


async def test_unknown_skill_is_a_factual_miss(machine: SandboxMachine, workspace_skills: Path) -> None:
    make_skill(workspace_skills, "alpha", skill_md("alpha"))
    make_skill(workspace_skills, "beta", skill_md("beta"))
    result = await use(ctx_for(machine), "gamma")
    assert not result.is_error
    assert result.as_text() == 'Skill "gamma" is not available. Available skills: alpha, beta.'
    workspace_skills.joinpath("alpha", "SKILL.md").unlink()
    workspace_skills.joinpath("beta", "SKILL.md").unlink()
    assert (await use(ctx_for(machine), "alpha")).as_text().endswith("Available skills: none.")


async def test_configured_skill_activation(
    machine: SandboxMachine, workspace_skills: Path, tmp_path: Path
) -> None:
    configured = tmp_path / "skills"
    make_skill(configured, "house", skill_md("house"), {"template.md": b"Dear {name},\n"})
    ctx = ctx_for(machine, configured)
    text = (await use(ctx, "house")).as_text()
    assert "not inside the machine: read them with read_skill_resource" in text and "- template.md" in text
    assert (await read(ctx, "house", "template.md")).as_text() == "Dear {name},\n"


# -- read_skill_resource -----------------------------------------------------------------


async def test_resource_reading_and_paging(machine: SandboxMachine, workspace_skills: Path) -> None:
    long = "".join(f"{i:04d}\n" for i in range(2500))  # 12 500 characters
    make_skill(
        workspace_skills, "docs", skill_md("docs"), {"ref/long.md": long.encode(), "small.txt": b"hi\n"}
    )
    ctx = ctx_for(machine)
    assert (await read(ctx, "docs", "small.txt")).as_text() == "hi\n"
    assert (await read(ctx, "docs", "./ref/../small.txt")).as_text() == "hi\n"
    first = await read(ctx, "docs", "ref/long.md")
    assert first.data["nextOffset"] == RESOURCE_PAGE_CHARS
    assert first.as_text() == (
        long[:RESOURCE_PAGE_CHARS]
        + f"\n\n[Showing characters 0-{RESOURCE_PAGE_CHARS} of {len(long)}. Use offset={RESOURCE_PAGE_CHARS} to continue.]"
    )
    last = await read(ctx, "docs", "ref/long.md", 2 * RESOURCE_PAGE_CHARS)
    assert last.as_text() == long[2 * RESOURCE_PAGE_CHARS :] and last.data["nextOffset"] is None
    past = await read(ctx, "docs", "ref/long.md", len(long))
    assert past.is_error and "past the end" in past.as_text()


async def test_resource_errors_and_escapes(machine: SandboxMachine, workspace_skills: Path) -> None:
    make_skill(workspace_skills, "docs", skill_md("docs"), {"image.png": b"\x89PNG\0\0", "sub/a.txt": b"a"})
    make_skill(workspace_skills, "other", skill_md("other"), {"secret.txt": b"other skill's"})
    (machine.workspace / "outside.txt").write_text("workspace file outside the skill")
    os.symlink("/workspace/outside.txt", workspace_skills / "docs" / "link-out")
    os.symlink("../other/secret.txt", workspace_skills / "docs" / "sibling-link")
    os.symlink("/etc/hostname", workspace_skills / "docs" / "etc-link")
    ctx = ctx_for(machine)
    expectations = {
        "../other/secret.txt": "not a path inside the skill",
        "..": "not a path inside the skill",
        "/etc/hostname": "not a path inside the skill",
        "": "not a path inside the skill",
        "sub/../../other/secret.txt": "not a path inside the skill",
        "link-out": "leads out of the skill",
        "sibling-link": "leads out of the skill",
        "etc-link": "leads out of the skill",
        "missing.txt": "has no file missing.txt",
        "sub": "is a folder",
        "image.png": "binary file",
    }
    for path, message in expectations.items():
        result = await read(ctx, "docs", path)
        assert result.is_error and message in result.as_text(), (path, result.as_text())
        assert "other skill's" not in result.as_text() and "workspace file" not in result.as_text()
    # Links that leave the skill are not listed as its resources either.
    listed = (await use(ctx, "docs")).data["resources"]
    assert listed == ["image.png", "sub/a.txt"]
    miss = await read(ctx, "nope", "a.txt")
    assert not miss.is_error and miss.as_text().startswith('Skill "nope" is not available.')


async def test_skills_also_work_on_a_local_machine(tmp_path: Path) -> None:
    machine = LocalMachine("local", tmp_path / "root")
    make_skill(Path(machine.root) / ".agents" / "skills", "local-one", skill_md("local-one"), {"a.txt": b"A"})
    ctx = ctx_for(machine)
    assert (
        f"Base directory: {machine.root}/.agents/skills/local-one" in (await use(ctx, "local-one")).as_text()
    )
    assert (await read(ctx, "local-one", "a.txt")).as_text() == "A"


async def test_skill_tool_metadata() -> None:
    for tool in (USE_SKILL, READ_SKILL_RESOURCE):
        assert tool.action == Action.META and tool.read_only
        assert all(p.get("description") for p in tool.schema()["properties"].values())
    assert set(skills_mod.TOOLS) == {"use_skill", "read_skill_resource"}


# -- todo_write --------------------------------------------------------------------------


async def write(ctx: Ctx, todos: list[dict[str, Any]]) -> ToolResult:
    return await TODO_WRITE.run(ctx, TodoParams.model_validate({"todos": todos}))


async def test_todos_are_stored_with_the_session_and_returned_whole(todos: TodoRepo, tmp_path: Path) -> None:
    ctx = Ctx(LocalMachine("local", tmp_path / "root"), todos)
    result = await write(
        ctx,
        [
            {"content": "Read the data", "status": "completed"},
            {"content": "Fit the model", "status": "in_progress"},
            {"content": "Write the report", "status": "pending"},
        ],
    )
    assert not result.is_error
    assert result.as_text() == (
        "Task list (3 items: 1 completed, 1 in progress, 1 pending):\n"
        "[x] 1. Read the data\n[~] 2. Fit the model\n[ ] 3. Write the report"
    )
    stored = await todos.get("ses_skills")
    assert stored == result.data["todos"] and [t["id"] for t in stored] == ["1", "2", "3"]
    # The next write replaces the list; kept ids stay, new items get fresh numbers.
    again = await write(
        ctx,
        [
            {"id": "2", "content": "Fit the model", "status": "completed"},
            {"id": "3", "content": "Write the report", "status": "in_progress"},
            {"content": "Send it", "status": "pending"},
        ],
    )
    assert [t["id"] for t in again.data["todos"]] == ["2", "3", "4"]
    assert await todos.get("ses_skills") == again.data["todos"]
    assert await todos.get("another-session") == []
    cleared = await write(ctx, [])
    assert cleared.as_text() == "The task list is empty." and await todos.get("ses_skills") == []


@pytest.mark.parametrize(
    ("items", "problem"),
    [
        (
            [{"content": "a", "status": "in_progress"}, {"content": "b", "status": "in_progress"}],
            "in_progress",
        ),
        ([{"content": "  ", "status": "pending"}], "no content"),
        ([{"content": "x" * (MAX_TODO_CHARS + 1), "status": "pending"}], f"more than {MAX_TODO_CHARS}"),
        ([{"content": "x", "status": "pending"}] * (MAX_TODOS + 1), f"more than {MAX_TODOS}"),
        (
            [
                {"id": "a", "content": "x", "status": "pending"},
                {"id": "a", "content": "y", "status": "pending"},
            ],
            "twice",
        ),
    ],
)
async def test_bad_lists_are_refused_and_nothing_is_stored(
    todos: TodoRepo, tmp_path: Path, items: list[dict[str, Any]], problem: str
) -> None:
    ctx = Ctx(LocalMachine("local", tmp_path / "root"), todos)
    await todos.put("ses_skills", [{"id": "1", "content": "keep me", "status": "pending"}])
    result = await write(ctx, items)
    assert result.is_error and result.as_text().startswith("The task list was not saved:")
    assert problem in result.as_text()
    assert await todos.get("ses_skills") == [{"id": "1", "content": "keep me", "status": "pending"}]


async def test_todo_limits_at_their_boundary(todos: TodoRepo, tmp_path: Path) -> None:
    ctx = Ctx(LocalMachine("local", tmp_path / "root"), todos)
    full = [{"content": "x" * MAX_TODO_CHARS, "status": "pending"} for _ in range(MAX_TODOS)]
    result = await write(ctx, full)
    assert not result.is_error and len(await todos.get("ses_skills")) == MAX_TODOS


async def test_todo_schema() -> None:
    schema = TODO_WRITE.schema()
    item = schema["$defs"]["TodoItem"]
    assert item["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]
    assert set(item["required"]) == {"content", "status"}
    assert TODO_WRITE.action == Action.META
