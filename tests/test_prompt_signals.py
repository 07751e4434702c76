"""The frozen system prompt (agent/prompt.py) and signal narration (agent/signals.py)."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest

from agentbox.agent import prompt
from agentbox.agent.models import ToolSpec
from agentbox.agent.prompt import Subagent, assemble
from agentbox.agent.signals import (
    INSTRUCTIONS_UPDATED,
    Environment,
    Resource,
    Signal,
    diff,
    text_digest,
    tool_resources,
)
from agentbox.machines.base import environment_line
from agentbox.machines.local import LocalMachine
from agentbox.machines.ssh import SshMachine
from agentbox.tools.base import ToolConfig
from agentbox.tools.skills import catalog

TODAY = date(2026, 3, 4)


@pytest.fixture
def machine(tmp_path: Path) -> LocalMachine:
    root = tmp_path / "root"
    root.mkdir()
    (root / "AGENTS.md").write_text("Run `make test` before committing.\n")
    (root / "CLAUDE.md").write_text("Prefer small functions.\n")
    skill = root / ".agents" / "skills" / "pdf-tools"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text(
        "---\nname: pdf-tools\ndescription: Fill and split PDFs.\n---\n\nSteps.\n"
    )
    (root / "src").mkdir()
    (root / "README.md").write_text("hello")
    return LocalMachine("local", root)


async def test_prompt_has_every_section_in_order(machine: LocalMachine) -> None:
    skills = await catalog(machine, ToolConfig())
    roster = [Subagent("explore", "Reads the   code\nbase.")]
    text = await assemble("You are a careful agent.", machine, skills=skills, subagents=roster, today=TODAY)
    order = [
        "You are a careful agent.",
        "# AGENTS.md\n\nRun `make test` before committing.",
        "# CLAUDE.md\n\nPrefer small functions.",
        "## Available Skills",
        "- pdf-tools: Fill and split PDFs.",
        "## Available Agents",
        "- explore: Reads the code base.",
        "Date: 2026-03-04",
        environment_line(machine),
        f"Working directory: {machine.root}",
        "Directory structure:\n- .agents/\n- AGENTS.md\n- CLAUDE.md\n- README.md\n- src/",
    ]
    positions = [text.index(part) for part in order]
    assert positions == sorted(positions)
    assert text.startswith("You are a careful agent.\n\n# AGENTS.md")


async def test_prompt_without_machine_has_no_workspace_part(machine: LocalMachine) -> None:
    text = await assemble("Be brief.", None, today=TODAY)
    assert text == f"Be brief.\n\n## Available Agents\n\n{prompt.NO_AGENTS}\n\nDate: 2026-03-04"
    for absent in ("AGENTS.md", "Machine:", "Working directory", "Directory structure", "Available Skills"):
        assert absent not in text


async def test_prompt_is_frozen_until_reassembled(machine: LocalMachine) -> None:
    first = await assemble("x", machine, today=TODAY)
    assert await assemble("x", machine, today=TODAY) == first
    (Path(machine.root) / "AGENTS.md").write_text("Changed.")
    second = await assemble("x", machine, today=TODAY)
    assert "Changed." in second and "Changed." not in first


async def test_missing_or_unreadable_context_files_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "AGENTS.md").mkdir()  # a folder, not a file
    (root / "CLAUDE.md").symlink_to(root / "nowhere.md")  # a dangling link
    text = await assemble("Hi.", LocalMachine("local", root), today=TODAY)
    assert "# AGENTS.md" not in text and "# CLAUDE.md" not in text
    assert "Directory structure:\n- AGENTS.md/\n- CLAUDE.md" in text


async def test_context_file_cut_at_limit(machine: LocalMachine) -> None:
    limit = prompt.MAX_CONTEXT_FILE_CHARS
    agents = Path(machine.root) / "AGENTS.md"
    agents.write_text("a" * limit)
    assert "cut at" not in await prompt.context_files(machine)
    agents.write_text("a" * (limit + 1))
    text = await prompt.context_files(machine)
    assert f"cut at {limit} characters" in text and "a" * (limit + 1) not in text


async def test_listing_capped_at_limit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    m = LocalMachine("local", root)
    limit = prompt.MAX_LISTING_ENTRIES
    for i in range(limit):
        (root / f"f{i:04d}").write_text("")
    listing = await prompt.directory_listing(m)
    assert listing.count("\n") == limit - 1 and "more entries" not in listing
    (root / "zzz").mkdir()
    (root / "zzz2").write_text("")
    listing = await prompt.directory_listing(m)
    assert listing.splitlines()[-1] == "[... and 2 more entries]"
    assert len(listing.splitlines()) == limit + 1


async def test_the_prompt_describes_an_ssh_workspace(ssh: SshMachine, remote_root: Path) -> None:
    """Through the protocol: context files (cut at the limit), the listing and the machine line;
    a context file that is a link is skipped, since where it leads cannot be seen."""
    limit = prompt.MAX_CONTEXT_FILE_CHARS
    (remote_root / "AGENTS.md").write_text("é" * (limit + 1))
    (remote_root / "secret.md").write_text("Not for the prompt.")
    (remote_root / "CLAUDE.md").symlink_to(remote_root / "secret.md")
    (remote_root / "src").mkdir()
    (remote_root / "src-link").symlink_to(remote_root / "src")
    text = await assemble("Hi.", ssh, today=TODAY)
    assert f"# AGENTS.md\n\n{'é' * limit}\n[... AGENTS.md cut at {limit} characters]" in text
    assert "# CLAUDE.md" not in text and "Not for the prompt." not in text
    assert environment_line(ssh) in text and f"Working directory: {ssh.root}" in text
    assert "Directory structure:\n- AGENTS.md\n- CLAUDE.md\n- secret.md\n- src/\n- src-link" in text
    assert text.endswith("- src-link")


# -- signals -------------------------------------------------------------------------------


def env(**changes: object) -> Environment:
    base: dict[str, object] = {
        "machine": "Machine: box (sandbox, linux), workspace /workspace",
        "cwd": "/workspace",
        "tools": tool_resources([ToolSpec("read", "Read a file.", {"type": "object"})]),
        "skills": (Resource("pdf-tools", "Fill PDFs."),),
        "subagents": (Resource("explore", "Reads code."),),
        "permission_mode": "edit",
        "instructions_digest": text_digest("Be careful."),
    }
    base.update(changes)
    return Environment(**base)  # type: ignore[arg-type]


def test_no_change_no_signal() -> None:
    assert diff(env(), env()) == []


def test_render_escapes_body_and_attributes() -> None:
    s = Signal("resources", 'a <b> & "c"', (("resource", 'x"<'),))
    assert s.render() == '<signal type="resources" resource="x&quot;&lt;">\na &lt;b&gt; &amp; "c"\n</signal>'
    assert s.message().role == "user" and s.message().text == s.render()


def test_sandbox_detached() -> None:
    [signal] = diff(env(), env(machine=None, cwd=None, tools=()))
    assert signal.type == "environment"
    assert "No sandbox remains: shell and file tools are unavailable" in signal.body
    assert "re-verify" in signal.body
    assert "All available tools: none" in signal.body
    assert "- pdf-tools: Fill PDFs." in signal.body and "- explore: Reads code." in signal.body


def test_sandbox_attached_supersedes_resource_deltas() -> None:
    before = env(machine=None, cwd=None, tools=())
    [signal] = diff(before, env())
    assert signal.type == "environment"
    assert signal.body.startswith(
        "A sandbox was attached.\nMachine: box (sandbox, linux), workspace /workspace"
    )
    assert "Working directory: /workspace" in signal.body
    assert "All available tools: read" in signal.body
    assert "re-verify" not in signal.body  # nothing came before it


def test_sandbox_replaced() -> None:
    [signal] = diff(env(), env(machine="Machine: other (local, linux), workspace /srv", cwd="/srv"))
    assert "A sandbox was replaced." in signal.body and "Working directory: /srv" in signal.body
    assert "re-verify" in signal.body


def test_tool_added_removed_updated() -> None:
    before = env(tools=tool_resources([ToolSpec("read", "R", {"a": 1}), ToolSpec("exec", "E", {})]))
    after = env(tools=tool_resources([ToolSpec("read", "R", {"a": 2}), ToolSpec("grep", "G", {})]))
    [signal] = diff(before, after)
    assert signal.type == "resources" and signal.attributes == (("resource", "tool"),)
    assert signal.body == (
        "New tool available:\n- grep\n"
        'The tool "exec" is no longer available.\n'
        'The tool "read" was updated.\n'
        "All available tools: read, grep"
    )


def test_skills_added_and_removed() -> None:
    after = env(skills=(Resource("csv", "Tables."), Resource("md", "Markdown.")))
    [signal] = diff(env(), after)
    assert signal.attributes == (("resource", "skill"),)
    assert signal.body == (
        "New skills available:\n- csv: Tables.\n- md: Markdown.\n"
        'The skill "pdf-tools" is no longer available.\n'
        "All available skills: csv, md"
    )


def test_subagent_description_update() -> None:
    [signal] = diff(env(), env(subagents=(Resource("explore", "Reads code fast."),)))
    assert signal.attributes == (("resource", "subagent"),)
    assert 'The agent "explore" was updated:\n- explore: Reads code fast.' in signal.body


def test_permission_mode_changed() -> None:
    [signal] = diff(env(), env(permission_mode="read_only"))
    assert signal.type == "permissions"
    assert signal.body.startswith("Permission mode changed from edit to read_only")


def test_instructions_updated() -> None:
    [signal] = diff(env(), env(instructions_digest=text_digest("Be bold.")))
    assert signal == Signal("instructions", INSTRUCTIONS_UPDATED)


def test_several_changes_in_one_boundary_in_order() -> None:
    after = env(skills=(), permission_mode="full", instructions_digest="x")
    types = [s.type for s in diff(env(), after)]
    assert types == ["resources", "permissions", "instructions"]
