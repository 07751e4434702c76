"""The three toolsets: seed names over one implementation, same parameters everywhere, tiers on top."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agentbox.machines.base import Machine
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.store.approvals import ApprovalsRepo
from agentbox.store.changes import ChangesRepo
from agentbox.store.db import Database
from agentbox.store.todos import TodoRepo
from agentbox.tools import toolsets as toolsets_mod
from agentbox.tools.approvals import Approvals
from agentbox.tools.base import Action
from agentbox.tools.changes import ChangeSets
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import Tier
from agentbox.tools.toolsets import TOOLSETS, canonical_tools, toolset, unavailable, variants

# The names as the seeds give them (000: the hosted platform, 001: the desktop agent without
# `browser`, 003: Flue's six plus its reserved framework tools).
SEED_NAMES = {
    "default": [
        "bash", "read_file", "write_file", "edit_file", "glob", "grep", "todo_write", "deliver_file",
        "use_skill", "read_image", "web_search", "web_fetch", "list", "search", "browser", "task",
    ],
    "workbench": ["search", "read", "list", "edit", "write", "exec", "browser", "task"],
    "flue": ["read", "write", "edit", "bash", "grep", "glob", "task", "activate_skill", "read_skill_resource"],
}  # fmt: skip


def session(
    tmp_path: Path, db: Database, name: str, tier: Tier, machine: Machine | None = None, plan: bool = False
) -> SessionTools:
    (tmp_path / "ws").mkdir(exist_ok=True)
    return SessionTools(
        machine=machine or LocalMachine("local", tmp_path / "ws"),
        plan=plan,
        session_id="ses_t",
        tier=tier,
        toolset=toolset(name),
        changes=ChangeSets(ChangesRepo(db)),
        approvals=Approvals(ApprovalsRepo(db)),
        todos=TodoRepo(db),
        turn_id="trn_t",
    )


@pytest.mark.parametrize("name", sorted(SEED_NAMES))
def test_toolset_names_are_the_seeds(name: str) -> None:
    assert [shown for shown, _ in TOOLSETS[name]] == SEED_NAMES[name]
    present = toolset(name)
    missing = unavailable(name)
    # What exists is offered in seed order; what is not written yet is reported, never invented.
    assert list(present) == [n for n in SEED_NAMES[name] if n not in missing]
    assert sorted([*present, *missing]) == sorted(SEED_NAMES[name])
    for shown, tool in present.items():
        assert tool.name == shown


def test_the_core_tools_exist_in_every_toolset() -> None:
    core = {"default": ["bash", "read_file", "write_file", "edit_file"], "workbench": ["read", "edit", "write", "exec"],
            "flue": ["read", "write", "edit", "bash"]}  # fmt: skip
    for name, names in core.items():
        assert set(names) <= set(toolset(name)), unavailable(name)


def test_renamed_tools_share_one_implementation_and_one_schema() -> None:
    canonical = canonical_tools(overwrite_if_read=True)
    for name in TOOLSETS:
        tools = toolset(name)
        for shown, original in TOOLSETS[name]:
            if shown not in tools:
                continue
            tool, source = tools[shown], variants(name).get(original) or canonical[original]
            assert tool.params is source.params
            assert tool.run is source.run or original == "write"  # write is built per overwrite rule
            assert tool.action == source.action and tool.read_only == source.read_only
            assert tool.schema() == source.schema()
            assert tool.description


def test_parameter_names_are_the_same_in_every_toolset() -> None:
    by_canonical: dict[str, list[dict[str, object]]] = {}
    for name in TOOLSETS:
        tools = toolset(name)
        for shown, original in TOOLSETS[name]:
            if shown in tools and original not in variants(name):
                by_canonical.setdefault(original, []).append(tools[shown].schema()["properties"])
    assert by_canonical["exec"][0].keys() >= {"command", "cwd", "timeoutSeconds"}
    assert by_canonical["write"][0].keys() >= {"path", "content"}
    for original, schemas in by_canonical.items():
        assert all(s.keys() == schemas[0].keys() for s in schemas), original


def test_bash_is_exec_and_flue_activate_skill_is_use_skill() -> None:
    assert toolset("default")["bash"].action == Action.EXEC
    assert toolset("flue")["bash"].action == Action.EXEC
    assert toolset("workbench")["exec"].action == Action.EXEC
    flue, default = toolset("flue"), toolset("default")
    if "activate_skill" in flue and "use_skill" in default:
        assert flue["activate_skill"].run is default["use_skill"].run


def test_unknown_toolset_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown toolset"):
        toolset("nope")


def test_a_missing_module_is_skipped_but_a_broken_one_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert toolsets_mod._module("agentbox.tools.not_written_yet") is None
    (tmp_path / "agentbox_broken_tool_module.py").write_text("import agentbox_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError):
        toolsets_mod._module("agentbox_broken_tool_module")


@pytest.mark.parametrize(
    ("name", "tier", "offered"),
    [
        ("workbench", Tier.READ_ONLY, {"search", "read", "list", "task"}),
        ("workbench", Tier.WORKSPACE_WRITE, {"search", "read", "list", "task", "edit", "write"}),
        ("workbench", Tier.FULL_ASK, {"search", "read", "list", "task", "edit", "write", "exec"}),
        ("workbench", Tier.FULL_AUTO, {"search", "read", "list", "task", "edit", "write", "exec"}),
        ("flue", Tier.READ_ONLY, {"read", "grep", "glob", "task", "activate_skill", "read_skill_resource"}),
        ("flue", Tier.FULL_ASK, set(SEED_NAMES["flue"])),
        ("default", Tier.READ_ONLY,
         {"read_file", "glob", "grep", "todo_write", "deliver_file", "use_skill", "read_image", "list", "search",
          "task"}),
        ("default", Tier.WORKSPACE_WRITE,
         {"read_file", "write_file", "edit_file", "glob", "grep", "todo_write", "deliver_file", "use_skill",
          "read_image", "list", "search", "task"}),
        # a machine without a browser, a server without a search provider
        ("default", Tier.FULL_ASK, set(SEED_NAMES["default"]) - {"browser", "web_search"}),
    ],
)  # fmt: skip
async def test_offered_tools_per_tier(
    tmp_path: Path, db: Database, name: str, tier: Tier, offered: set[str]
) -> None:
    tools = session(tmp_path, db, name, tier)
    present = set(toolset(name))
    assert {t.name for t in tools.offered()} == offered & present


async def test_web_search_is_offered_only_where_a_provider_is_configured(
    tmp_path: Path, db: Database
) -> None:
    tools = session(tmp_path, db, "default", Tier.FULL_AUTO)
    assert "web_search" not in {t.name for t in tools.offered()}
    called = await tools.call("web_search", {"query": "agentbox"})
    assert called.is_error and "There is no tool named 'web_search'" in called.as_text()
    tools.config = replace(tools.config, web_search_url="http://127.0.0.1:9/search")
    assert "web_search" in {t.name for t in tools.offered()}


@pytest.mark.parametrize(("name", "overwrites"), [("default", True), ("flue", True), ("workbench", False)])
async def test_write_overwrites_a_read_file_only_in_default_and_flue(
    tmp_path: Path, db: Database, name: str, overwrites: bool
) -> None:
    tools = session(tmp_path, db, name, Tier.FULL_AUTO)
    (tmp_path / "ws/a.txt").write_text("old")
    read_name = "read_file" if name == "default" else "read"
    write_name = "write_file" if name == "default" else "write"
    assert not (await tools.call(read_name, {"path": "a.txt"})).is_error
    result = await tools.call(write_name, {"path": "a.txt", "content": "new"})
    assert result.is_error is not overwrites, result.as_text()
    assert (tmp_path / "ws/a.txt").read_text() == ("new" if overwrites else "old")
    # Never without a read first, in any toolset.
    (tmp_path / "ws/b.txt").write_text("unread")
    unread = await tools.call(write_name, {"path": "b.txt", "content": "new"})
    assert unread.is_error and (tmp_path / "ws/b.txt").read_text() == "unread"


async def test_overwrite_rule_can_be_overridden(tmp_path: Path, db: Database) -> None:
    tools = session(tmp_path, db, "workbench", Tier.FULL_AUTO)
    tools.toolset = toolset("workbench", overwrite_if_read=True)
    (tmp_path / "ws/a.txt").write_text("old")
    await tools.call("read", {"path": "a.txt"})
    assert not (await tools.call("write", {"path": "a.txt", "content": "new"})).is_error


@pytest.mark.parametrize(
    ("tier", "plan", "offered"),
    [(Tier.READ_ONLY, False, False), (Tier.WORKSPACE_WRITE, False, False), (Tier.FULL_ASK, False, True),
     (Tier.FULL_AUTO, False, True), (Tier.FULL_AUTO, True, True), (Tier.WORKSPACE_WRITE, True, False)],
)  # fmt: skip
@pytest.mark.parametrize("enabled", [True, False])
async def test_the_browser_is_offered_where_enabled_and_the_tier_allows_it(
    tmp_path: Path,
    db: Database,
    sandbox_host: SandboxHost,
    tier: Tier,
    plan: bool,
    offered: bool,
    enabled: bool,
) -> None:
    machine = SandboxMachine(
        "web", "sbx_offer", sandbox_host, SandboxConfig(browser=enabled), tmp_path / "ws", tmp_path / "run"
    )
    for name in ("default", "workbench"):
        tools = session(tmp_path, db, name, tier, machine, plan)
        assert ("browser" in [t.name for t in tools.offered()]) == (offered and enabled)
    if not (offered and enabled):  # not offered: a call anyway is refused, never run
        called = await session(tmp_path, db, "default", tier, machine, plan).call(
            "browser", {"action": "tabs.list"}
        )
        assert called.is_error


def test_the_workbench_variants_only_add_targets_to_the_canonical_tools() -> None:
    canonical = canonical_tools(overwrite_if_read=False)
    added = {"search": {"target"}, "read": {"url", "target", "skillId"}}
    for original, tool in variants("workbench").items():
        base = canonical[original]
        assert issubclass(tool.params, base.params) and tool.action == base.action
        assert tool.schema()["properties"].keys() == base.schema()["properties"].keys() | added[original]
    assert variants("default") == variants("flue") == {}
