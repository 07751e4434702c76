"""The workbench's `search target=web`, `read url` and `read target=skill`, through the real
runner and its tiers, against a loopback web server; and the `[tools]` table that configures them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_tools_skills_todo import make_skill, skill_md
from test_tools_toolsets import session
from test_tools_web import LoopbackServer
from test_tools_web import server as web_server

from agentbox import config as config_mod
from agentbox.agent.agents import BUILTIN_AGENTS
from agentbox.agent.prompt import assemble
from agentbox.machines.local import LocalMachine
from agentbox.store.db import Database
from agentbox.tools.runner import SessionTools
from agentbox.tools.tiers import Tier
from agentbox.tools.web import MAX_SEARCH_RESULTS

server = web_server  # the loopback site and search provider of the web tool tests


def workbench(
    tmp_path: Path, db: Database, tier: Tier, site: LoopbackServer, plan: bool = False
) -> SessionTools:
    tools = session(tmp_path, db, "workbench", tier, plan=plan)
    tools.config = replace(tools.config, web_search_url=site.url + "/search", web_allow_private=True)
    return tools


@pytest.fixture
def site(server: LoopbackServer) -> Iterator[LoopbackServer]:
    seen = len(server.seen)
    yield server
    del server.seen[seen:]


async def test_search_target_web_asks_the_provider_in_full_auto(
    tmp_path: Path, db: Database, site: LoopbackServer
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    result = await tools.call("search", {"query": "rust", "target": "web", "limit": 2})
    assert not result.is_error, result.as_text()
    assert [r["url"] for r in result.data["results"]] == ["https://example.org/1", "https://example.org/2"]
    assert site.seen[-1] == "/search?q=rust&n=2"


async def test_a_web_limit_over_the_providers_maximum_is_clamped_and_said(
    tmp_path: Path, db: Database, site: LoopbackServer
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    result = await tools.call("search", {"query": "x", "target": "web", "limit": MAX_SEARCH_RESULTS + 1})
    assert len(result.data["results"]) == MAX_SEARCH_RESULTS
    assert site.seen[-1] == f"/search?q=x&n={MAX_SEARCH_RESULTS}"
    assert f"clamped to {MAX_SEARCH_RESULTS}" in result.as_text()


@pytest.mark.parametrize(
    ("tier", "plan"),
    [(Tier.READ_ONLY, False), (Tier.WORKSPACE_WRITE, False), (Tier.WORKSPACE_WRITE, True)],
)
async def test_the_web_targets_are_refused_below_the_full_tiers(
    tmp_path: Path, db: Database, site: LoopbackServer, tier: Tier, plan: bool
) -> None:
    tools = workbench(tmp_path, db, tier, site, plan=plan)
    seen = len(site.seen)
    searched = await tools.call("search", {"query": "rust", "target": "web"})
    fetched = await tools.call("read", {"url": site.url + "/text"})
    assert searched.is_error and fetched.is_error
    for refused in (searched, fetched):  # the tier's final refusal of web actions, not another error
        assert "is not permitted" in refused.as_text() and "web actions are forbidden" in refused.as_text()
    assert len(site.seen) == seen  # nothing left the server


async def test_plan_in_full_auto_still_researches_the_web(
    tmp_path: Path, db: Database, site: LoopbackServer
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site, plan=True)
    fetched = await tools.call("read", {"url": site.url + "/text"})
    assert not fetched.is_error and "plain text, ünïcode" in fetched.as_text()
    written = await tools.call("write", {"path": "a.md", "content": "x"})
    assert written.is_error and not (tmp_path / "ws/a.md").exists()


async def test_read_url_continues_by_offset(tmp_path: Path, db: Database, site: LoopbackServer) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    first = await tools.call("read", {"url": site.url + "/long"})
    assert not first.is_error and first.data["nextOffset"]
    second = await tools.call("read", {"url": site.url + "/long", "offset": first.data["nextOffset"]})
    assert f"[Showing characters {first.data['nextOffset']}-" in second.as_text()


async def test_notes_search_is_unchanged_and_notes_filters_do_not_go_to_the_web(
    tmp_path: Path, db: Database, site: LoopbackServer
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    (tmp_path / "ws/plan.md").write_text("# Plan\n\nThe quarterly rollout of zeppelins.\n")
    notes = await tools.call("search", {"query": "zeppelins"})
    assert not notes.is_error and notes.data["results"][0]["path"].endswith("plan.md")
    seen = len(site.seen)
    mixed = await tools.call("search", {"query": "zeppelins", "target": "web", "pathPrefix": "docs"})
    assert mixed.is_error and "pathPrefix narrow a notes search only" in mixed.as_text()
    assert len(site.seen) == seen


@pytest.mark.parametrize(
    "args",
    [
        {"url": "http://x.test/", "path": "a.md"},
        {"url": "http://x.test/", "page": 2},
        {"url": "http://x.test/", "target": "skill", "skillId": "s"},
        {"target": "skill"},
        {"skillId": "s"},
        {},
    ],
)
async def test_read_refuses_mixed_targets(
    tmp_path: Path, db: Database, site: LoopbackServer, args: dict[str, object]
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    seen = len(site.seen)
    result = await tools.call("read", args)
    assert result.is_error, result.as_text()
    assert len(site.seen) == seen


async def test_with_the_web_off_no_tool_reaches_it(
    tmp_path: Path, db: Database, site: LoopbackServer
) -> None:
    tools = workbench(tmp_path, db, Tier.FULL_AUTO, site)
    tools.config = replace(tools.config, web=False)
    searched = await tools.call("search", {"query": "rust", "target": "web"})
    fetched = await tools.call("read", {"url": site.url + "/text"})
    assert "the web is off" in searched.as_text() and "the web is off" in fetched.as_text()
    default = session(tmp_path, db, "default", Tier.FULL_AUTO)
    default.config = replace(default.config, web=False, web_search_url=site.url + "/search")
    assert not {"web_fetch", "web_search"} & {t.name for t in default.offered()}


async def test_read_target_skill_gives_instructions_then_files(tmp_path: Path, db: Database) -> None:
    tools = session(tmp_path, db, "workbench", Tier.READ_ONLY)  # the base permission is enough
    make_skill(
        tmp_path / "ws/.agents/skills", "pdf-tools", skill_md("pdf-tools", body="Use the template."),
        {"template.md": b"# Template\n"},
    )  # fmt: skip
    loaded = await tools.call("read", {"target": "skill", "skillId": "pdf-tools"})
    assert not loaded.is_error and "Use the template." in loaded.as_text()
    assert 'read {"target": "skill", "skillId": "pdf-tools", "path": "<path>"}' in loaded.as_text()
    file = await tools.call("read", {"target": "skill", "skillId": "pdf-tools", "path": "template.md"})
    assert not file.is_error and "# Template" in file.as_text()
    escape = await tools.call("read", {"target": "skill", "skillId": "pdf-tools", "path": "../../../x"})
    assert escape.is_error
    missing = await tools.call("read", {"target": "skill", "skillId": "nope"})
    assert "Available skills: pdf-tools" in missing.as_text()


async def test_the_prompt_names_the_toolsets_own_way_to_load_a_skill(tmp_path: Path) -> None:
    from agentbox.tools.skills import discover

    make_skill(tmp_path / ".agents/skills", "pdf-tools", skill_md("pdf-tools"))
    machine = LocalMachine("local", tmp_path)
    skills = (await discover(machine, config_mod.ToolConfig())).skills
    calls = {
        name: await assemble("x", machine, skills=skills, toolset=name)
        for name in ("default", "workbench", "flue")
    }
    assert "call `use_skill`" in calls["default"] and "use_skill" not in calls["workbench"]
    assert 'call `read` with `"target": "skill"`' in calls["workbench"]
    assert "call `activate_skill`" in calls["flue"]


def test_explore_has_read_only_web_research() -> None:
    explore = BUILTIN_AGENTS["explore"]
    assert {"web_search", "web_fetch"} <= set(explore.tools) and explore.read_only


def test_the_tools_table_configures_the_tools(tmp_path: Path) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(
        '[tools]\nweb = false\nweb_search_url = "https://search.example/q"\nskill_dirs = ["/srv/skills"]\n'
    )
    tools = config_mod.load(path, env={}).tools
    assert (tools.web, tools.web_search_url, tools.skill_dirs) == (
        False,
        "https://search.example/q",
        ["/srv/skills"],
    )
    assert config_mod.load(tmp_path / "absent.toml", env={}).tools == config_mod.ToolConfig()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('web_search_uri = "https://x"', "[tools] has no setting 'web_search_uri'"),
        ('web = "yes"', "[tools] web must be true or false"),
        ('web_search_url = "ftp://x"', "must be an http(s) URL"),
        ("skill_dirs = [1]", "skill_dirs must be a list of strings"),
    ],
)
def test_a_tools_table_it_cannot_take_is_refused(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(f"[tools]\n{table}\n")
    with pytest.raises(config_mod.ConfigError) as caught:
        config_mod.load(path, env={})
    assert message in str(caught.value)
