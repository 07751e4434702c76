"""Knowledge bases and file ids: what a session selects is its own; everything else is external.

Real machines (a bubblewrap sandbox and the host), a real SQLite file for the file ids, the real
tools. The attacks: an unselected knowledge base inside a selected one is read, walked or
searched without asking; a document outside the knowledge bases is read by a guessed path; an
id from another session names a file here; a session registers a folder outside the workspace.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from test_tools_read import (
    Box,
    Ctx,
    host_box,
    local,
    make_pdf,
    make_png,
    read,
    sandbox,
    text_of,
)

from agentbox.agent.prompt import facts
from agentbox.config import ConfigError, KnowledgeBaseSpec, knowledge_bases
from agentbox.store.db import Database
from agentbox.store.file_ids import MAX_FILE_IDS, FileIdRepo
from agentbox.tools.base import Action
from agentbox.tools.edit import EDIT, EditParams
from agentbox.tools.find import GLOB, GREP, LIST, GlobParams, GrepParams, ListParams
from agentbox.tools.knowledge import SEARCH, SearchParams
from agentbox.tools.knowledge_bases import (
    MAX_SESSION_KNOWLEDGE_BASES,
    ScopeError,
    selection,
    session_selection,
)
from agentbox.tools.services import MachineServices
from agentbox.tools.shell import working_dir

__all__ = ["host_box", "local", "sandbox"]  # fixtures used by name
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module")
async def ids(tmp_path: Path) -> AsyncIterator[FileIdRepo]:
    async with Database(tmp_path / "ids.db") as db:
        yield FileIdRepo(db)


def rel(box: Box, path: str) -> str:
    return posixpath.relpath(box.p(path), box.machine.root)


def kb_ctx(
    box: Box, ids: FileIdRepo | None, selected: list[str] | None, nested: bool = False, **kwargs: Any
) -> Ctx:
    """A context whose session registered `notes` and `private` (inside `notes`) in the box;
    `nested`: also `shared` inside `private` and `hidden` inside `shared`."""
    ctx = box.ctx(**kwargs)
    folders = {"notes": "notes", "private": "notes/private"}
    if nested:
        folders |= {"shared": "notes/private/shared", "hidden": "notes/private/shared/hidden"}
    specs = [KnowledgeBaseSpec(kb_id, rel(box, folder)) for kb_id, folder in folders.items()]
    ctx.knowledge = selection([], "test", specs, selected)
    ctx.file_ids = ids
    return ctx


def seed(box: Box) -> None:
    box.write("notes/a.md", "alpha note\n")
    box.write("notes/private/secret.md", "alpha secret\n")
    box.write("other/b.md", "alpha other\n")


async def test_relative_paths_start_at_the_first_selected_knowledge_base(host_box: Box) -> None:
    seed(host_box)
    ctx = kb_ctx(host_box, None, ["notes"])
    result = await read(ctx, "a.md")
    assert not result.is_error and "alpha note" in text_of(result) and ctx.asked == []
    assert working_dir(ctx, None) == host_box.p("notes") and working_dir(ctx, "x") == host_box.p("notes/x")
    assert working_dir(host_box.ctx(), None) is None  # the whole workspace: the machine's own default


async def test_an_unselected_knowledge_base_inside_a_selected_one_is_external(host_box: Box) -> None:
    seed(host_box)
    ctx = kb_ctx(host_box, None, ["notes"], allow_external=False)
    secret = await read(ctx, "private/secret.md")
    assert secret.is_error and [a[0] for a in ctx.asked] == [Action.READ_EXTERNAL]
    other = await read(ctx, host_box.p("other/b.md"))
    assert other.is_error and len(ctx.asked) == 2  # outside every selected one: asked too
    ctx.asked.clear()
    walked = await LIST.run(ctx, ListParams(path=".", query="alpha"))  # names are not the query
    found = await LIST.run(ctx, ListParams(path=".", query=".md"))
    assert "secret.md" not in text_of(found) and "a.md" in text_of(found) and not walked.is_error
    grepped = await GREP.run(ctx, GrepParams(pattern="alpha", path="."))
    assert "a.md" in text_of(grepped) and "secret" not in text_of(grepped) and ctx.asked == []
    everything = kb_ctx(host_box, None, None, allow_external=False)  # by default every one is selected
    assert (
        not (await read(everything, host_box.p("notes/private/secret.md"))).is_error
        and everything.asked == []
    )


async def test_a_walk_from_above_reaches_a_selected_knowledge_base_inside_an_unselected_one(
    host_box: Box,
) -> None:
    """`notes` (selected) holds `private` (not) holding `shared` (selected) holding `hidden`
    (not): the deepest knowledge base holding a file decides what a walk shows."""
    seed(host_box)
    host_box.write("notes/private/shared/c.md", "alpha shared\n")
    host_box.write("notes/private/shared/hidden/d.md", "alpha hidden\n")
    ctx = kb_ctx(host_box, None, ["notes", "shared"], nested=True, allow_external=False)
    globbed = text_of(await GLOB.run(ctx, GlobParams(pattern="**/*.md")))
    grepped = text_of(await GREP.run(ctx, GrepParams(pattern="alpha", path=".")))
    listed = text_of(await LIST.run(ctx, ListParams(path=".", query=".md")))
    for shown in (globbed, grepped, listed):
        assert "a.md" in shown and "shared/c.md" in shown, shown
        assert "secret.md" not in shown and "d.md" not in shown, shown
    assert ctx.asked == []


async def test_a_link_on_the_way_to_a_nested_knowledge_base_is_not_walked(host_box: Box) -> None:
    """The attack: `private/shared` is a link to a folder outside every knowledge base; handed
    to rg as a root of its own it would be followed, and its files listed without asking."""
    seed(host_box)
    host_box.mkdir("notes/private")
    (host_box.h("notes/private") / "shared").symlink_to(host_box.h("other"))
    ctx = kb_ctx(host_box, None, ["notes", "shared"], nested=True, allow_external=False)
    for result in (
        await GLOB.run(ctx, GlobParams(pattern="**/*.md")),
        await GREP.run(ctx, GrepParams(pattern="alpha", path=".")),
        await LIST.run(ctx, ListParams(path=".", query=".md")),
    ):
        assert "b.md" not in text_of(result) and "alpha other" not in text_of(result), text_of(result)
        assert "a.md" in text_of(result)


async def test_list_gives_file_ids_that_read_takes_and_marks_images(host_box: Box, ids: FileIdRepo) -> None:
    seed(host_box)
    host_box.write("notes/pic.png", make_png())
    ctx = kb_ctx(host_box, ids, ["notes"])
    listed = await LIST.run(ctx, ListParams(path=".", prefix="p"))
    entries = {e["path"]: e for e in listed.data["entries"]}
    assert set(entries) == {host_box.p("notes/pic.png"), None}  # the `private/` folder and the image
    image = entries[host_box.p("notes/pic.png")]
    assert image["fileType"] == "image" and image["requiresVision"] is True
    assert f"fileId={image['fileId']}" in text_of(listed)
    note = (await LIST.run(ctx, ListParams(path=".", fileType="markdown"))).data["entries"][0]
    by_id = await read_by_id(ctx, note["fileId"])
    assert not by_id.is_error and "alpha note" in text_of(by_id)
    unknown = await read_by_id(ctx, "file_" + "0" * 20)
    assert unknown.is_error and "use list or search" in text_of(unknown)
    elsewhere = kb_ctx(host_box, ids, ["notes"], session_id="ses_other")  # another session's id names nothing
    assert (await read_by_id(elsewhere, note["fileId"])).is_error
    both = await read(ctx, "a.md", fileId=note["fileId"])
    assert both.is_error and "one of them" in text_of(both)


async def read_by_id(ctx: Ctx, file_id: str) -> Any:
    from agentbox.tools.read import READ, ReadParams

    return await READ.run(ctx, ReadParams(fileId=file_id))


async def test_an_outside_document_is_read_by_file_id_only(host_box: Box, ids: FileIdRepo) -> None:
    host_box.write("other/report.pdf", make_pdf(["quarterly figures"]))
    ctx = kb_ctx(host_box, ids, ["notes"])
    host_box.mkdir("notes")
    by_path = await read(ctx, host_box.p("other/report.pdf"))
    assert by_path.is_error and "fileId" in text_of(by_path)
    listed = await LIST.run(ctx, ListParams(path=host_box.p("other")))  # an external list: asked
    assert [a[0] for a in ctx.asked] == [Action.READ_EXTERNAL]
    (entry,) = listed.data["entries"]
    by_id = await read_by_id(ctx, entry["fileId"])
    assert not by_id.is_error and "quarterly figures" in text_of(by_id)
    assert [a[0] for a in ctx.asked] == [Action.READ_EXTERNAL] * 2  # every external read asks again


async def test_search_covers_the_selected_knowledge_bases_and_narrows_by_id(
    host_box: Box, ids: FileIdRepo
) -> None:
    seed(host_box)
    host_box.write("notes/private/shared/c.md", "alpha shared\n")  # `shared`, in `private`
    host_box.write("notes/private/shared/hidden/d.md", "alpha hidden\n")  # `hidden`, in `shared`
    ctx = kb_ctx(host_box, ids, ["notes"])
    ctx.services = MachineServices.of(host_box.machine)
    try:
        found = await SEARCH.run(ctx, SearchParams(query="alpha", limit=16))
        paths = {r["path"] for r in found.data["results"]}
        assert paths == {host_box.p("notes/a.md")}  # neither the private one nor the other folder
        (hit,) = found.data["results"]
        assert hit["knowledgeBaseId"] == "notes" and hit["fileId"].startswith("file_")
        assert "alpha note" in text_of(await read_by_id(ctx, hit["fileId"]))
        refused = await SEARCH.run(ctx, SearchParams(query="alpha", knowledgeBaseIds=["private"]))
        assert refused.is_error and "not one this session selected" in text_of(refused)
        both = kb_ctx(host_box, ids, ["notes", "private"])
        both.services = ctx.services
        only = await SEARCH.run(both, SearchParams(query="alpha", knowledgeBaseIds=["private"]))
        assert {r["path"] for r in only.data["results"]} == {
            host_box.p(f"notes/private/{name}") for name in ("secret.md", "shared/c.md", "shared/hidden/d.md")
        }
        outside = await SEARCH.run(ctx, SearchParams(query="alpha", pathPrefix=host_box.p("other")))
        assert outside.is_error and "outside the session's knowledge bases" in text_of(outside)

        nested = kb_ctx(host_box, ids, ["notes", "shared"], nested=True)
        nested.services = ctx.services
        deep = await SEARCH.run(nested, SearchParams(query="alpha", limit=16))
        assert {r["path"] for r in deep.data["results"]} == {
            host_box.p("notes/a.md"), host_box.p("notes/private/shared/c.md"),
        }  # fmt: skip  # the deepest knowledge base holding a file decides
    finally:
        await ctx.services.close()


async def test_a_move_lands_in_the_named_knowledge_base(local: Box) -> None:
    seed(local)
    local.mkdir("other")
    ctx = local.ctx()
    ctx.knowledge = selection(
        [],
        "test",
        [KnowledgeBaseSpec("notes", rel(local, "notes")), KnowledgeBaseSpec("other", rel(local, "other"))],
        ["notes", "other"],
    )
    moved = await EDIT.run(
        ctx, EditParams(path="a.md", mode="move", destination="a.md", destinationKnowledgeBaseId="other")
    )
    assert not moved.is_error and local.h("other/a.md").exists() and not local.h("notes/a.md").exists()
    escaping = EditParams(
        path=local.p("other/a.md"), mode="move", destination="../x.md", destinationKnowledgeBaseId="notes"
    )
    assert "leaves the knowledge base" in text_of(await EDIT.run(ctx, escaping))
    unknown = EditParams(
        path=local.p("other/a.md"), mode="move", destination="x.md", destinationKnowledgeBaseId="nope"
    )
    assert "not one this session selected" in text_of(await EDIT.run(ctx, unknown))
    root = await EDIT.run(ctx, EditParams(path=local.p("other"), mode="delete"))
    assert root.is_error and "root of the knowledge base 'other'" in text_of(root)


async def test_a_session_cannot_register_a_folder_outside_the_workspace() -> None:
    for path in ("/etc", "..", "../x", "a/../../b", ".", "", "a*b", "x\0y"):
        with pytest.raises(ConfigError):
            session_selection([], "sandbox", [{"id": "kb", "path": path}], None)
    ok = session_selection([], "sandbox", [{"id": "kb", "path": "notes/./q1/"}], None)
    assert ok.registered[0].path == "notes/q1"
    with pytest.raises(ConfigError):
        session_selection([], "sandbox", [{"id": "workspace", "path": "x"}], None)
    with pytest.raises(ScopeError):
        session_selection([], "sandbox", [{"id": "a", "path": "x"}, {"id": "a", "path": "y"}], None)
    with pytest.raises(ScopeError):
        session_selection([], "sandbox", [], ["missing"])
    with pytest.raises(ScopeError):
        session_selection([], "sandbox", [], [])
    many = [{"id": f"k{n}", "path": f"d{n}"} for n in range(MAX_SESSION_KNOWLEDGE_BASES)]
    assert len(session_selection([], "sandbox", many, None).registered) == MAX_SESSION_KNOWLEDGE_BASES
    with pytest.raises(ScopeError):
        session_selection([], "sandbox", [*many, {"id": "one-more", "path": "z"}], None)
    configured = knowledge_bases([{"id": "hb", "path": "docs", "machines": ["host"]}])
    assert session_selection(configured, "sandbox", [], None).ids() == ["workspace"]
    assert session_selection(configured, "host", [], None).ids() == ["workspace", "hb"]


async def test_file_ids_keep_at_most_the_newest(ids: FileIdRepo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentbox.store.file_ids.MAX_FILE_IDS", 3)
    first = await ids.remember("s", ["/w/a"])
    later = await ids.remember("s", ["/w/b", "/w/c"])
    assert await ids.path_of("s", first["/w/a"]) == "/w/a"  # exactly at the limit: all kept
    await ids.remember("s", ["/w/d"])
    assert await ids.path_of("s", first["/w/a"]) is None  # past it: the oldest shown goes
    assert MAX_FILE_IDS > 3
    assert await ids.path_of("s", later["/w/b"]) == "/w/b"
    await ids.forget("s")
    assert await ids.path_of("s", later["/w/b"]) is None


async def test_id_and_prefix_parameters_are_bounded() -> None:
    from pydantic import ValidationError

    from agentbox.config import MAX_KNOWLEDGE_BASE_ID_CHARS
    from agentbox.store.file_ids import FILE_ID_CHARS, file_id
    from agentbox.tools.find import MAX_PREFIX_CHARS
    from agentbox.tools.knowledge import MAX_KNOWLEDGE_BASE_IDS
    from agentbox.tools.read import ReadParams

    assert len(file_id("s", "/w/a")) == FILE_ID_CHARS
    ReadParams(fileId="f" * FILE_ID_CHARS)
    with pytest.raises(ValidationError):
        ReadParams(fileId="f" * (FILE_ID_CHARS + 1))
    ListParams(prefix="p" * MAX_PREFIX_CHARS)
    with pytest.raises(ValidationError):
        ListParams(prefix="p" * (MAX_PREFIX_CHARS + 1))
    SearchParams(query="q", knowledgeBaseIds=["k"] * MAX_KNOWLEDGE_BASE_IDS)
    with pytest.raises(ValidationError):
        SearchParams(query="q", knowledgeBaseIds=["k"] * (MAX_KNOWLEDGE_BASE_IDS + 1))
    EditParams(path="a", mode="move", destinationKnowledgeBaseId="k" * MAX_KNOWLEDGE_BASE_ID_CHARS)
    with pytest.raises(ValidationError):
        EditParams(path="a", mode="move", destinationKnowledgeBaseId="k" * (MAX_KNOWLEDGE_BASE_ID_CHARS + 1))
    session_selection([], "x", [{"id": "k" * MAX_KNOWLEDGE_BASE_ID_CHARS, "path": "p"}], None)
    with pytest.raises(ConfigError):
        session_selection([], "x", [{"id": "k" * (MAX_KNOWLEDGE_BASE_ID_CHARS + 1), "path": "p"}], None)


async def test_the_prompt_describes_the_first_selected_knowledge_base_as_the_working_directory(
    host_box: Box,
) -> None:
    seed(host_box)
    scope = kb_ctx(host_box, None, ["notes"]).knowledge.scope(host_box.machine.root)
    text = await facts(host_box.machine, date(2026, 1, 2), scope)
    assert f"Working directory: {host_box.p('notes')}" in text
    listing = text.split("Directory structure:\n", 1)[1]
    assert listing.splitlines() == ["- a.md", "- private/"]  # the base's top level, not the root's
    whole = await facts(
        host_box.machine,
        date(2026, 1, 2),
        kb_ctx(host_box, None, None).knowledge.scope(host_box.machine.root),
    )
    assert f"Working directory: {host_box.machine.root}\n" in whole
    assert f"- {rel(host_box, 'notes').split('/')[0]}/" in whole.split("Directory structure:\n", 1)[1]
