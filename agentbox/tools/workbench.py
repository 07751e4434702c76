"""The workbench toolset's `search` and `read`: one tool each for the workspace, the web and skills.

The workbench names have no `web_search`, `web_fetch`, `use_skill` or `read_skill_resource`
(seed 001): the web is `search target=web` and `read url`, a skill is `read target=skill`.
They are the canonical `search` and `read` with those targets added, and each target runs the
canonical tool that does the job, so nothing is implemented twice:

    search target=notes (default)   the knowledge index (`knowledge.run_search`)
    search target=web               the configured search provider (`web.run_search`)
    read path                       a workspace file (`read.run_read`)
    read url                        a web page (`web.run_fetch`)
    read target=skill skillId       a skill's instructions and file list (`skills.skill_instructions`)
    read target=skill skillId path  one of its files (`skills.run_read_resource`)

The web targets are external research: they ask for `web` themselves, so the tier decides as
for `web_fetch` (refused in read-only and workspace-write, asked on every call in full-ask, free
in full-auto; in plan, allowed only in the full tiers), and they exist only while the tools'
networking setting is on (`[tools] web`; `search target=web` also needs `web_search_url`).
A skill is read with the base permission, in every tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from agentbox.tools import knowledge, read, skills, web
from agentbox.tools.base import TextBlock, Tool, ToolContext, ToolResult

#: What `read target=skill` tells the model to call for one of a skill's files.
SKILL_FILE_CALL = 'read {{"target": "skill", "skillId": "{name}", "path": "<path>"}}'
#: `search` parameters that narrow the knowledge index only.
NOTES_FILTERS = ("knowledgeBaseIds", "pathPrefix", "tags", "fileTypes", "updatedAfter", "updatedBefore")
#: `read` parameters of a workspace file only (a page, a skill's file take `offset` alone).
FILE_ONLY = ("fileId", "startLine", "endLine", "page", "pageEnd", "block", "heading")


class SearchParams(knowledge.SearchParams):
    target: Literal["notes", "web"] = Field(
        default="notes",
        description=(
            "`notes` (default): the workspace's notes and documents. `web`: a web search (external "
            "research: full permission tiers only, asked each time in full-ask), with `query` and `limit` "
            f"(at most {web.MAX_SEARCH_RESULTS}) only."
        ),
    )


class ReadParams(read.ReadParams):
    path: str | None = Field(
        default=None,
        description=(
            "File to read: relative to the first knowledge base's root (the workspace root by default), or "
            "absolute; or give fileId. With target=skill: a file of the skill's package (relative to its "
            "folder), or none for its instructions."
        ),
    )
    url: str | None = Field(
        default=None,
        description=(
            "An http(s) URL to read as text instead of a file (external research: full permission tiers "
            "only, asked each time in full-ask); continue with `offset`."
        ),
    )
    target: Literal["file", "skill"] = Field(
        default="file", description="`file` (default), or `skill` to read a skill named by `skillId`."
    )
    skillId: str | None = Field(
        default=None, description="target=skill: the skill's name, as the catalog lists it."
    )


async def run_search(ctx: ToolContext, params: SearchParams) -> ToolResult:
    if params.target == "notes":
        return await knowledge.run_search(
            ctx, knowledge.SearchParams.model_validate(given(params, {"target"}))
        )
    narrowing = [name for name in NOTES_FILTERS if getattr(params, name) is not None]
    if narrowing:
        return ToolResult.error(
            f"{', '.join(narrowing)} narrow a notes search only; a web search takes query and limit."
        )
    if not ctx.config.web:
        return ToolResult.error(web_off("search target=web"))
    wanted = params.limit or web.DEFAULT_SEARCH_RESULTS
    result = await web.run_search(
        ctx, web.SearchParams(query=params.query, n=min(wanted, web.MAX_SEARCH_RESULTS))
    )
    if wanted > web.MAX_SEARCH_RESULTS and not result.is_error:
        result.content.append(TextBlock(f"Note: limit {wanted} was clamped to {web.MAX_SEARCH_RESULTS}."))
    return result


async def run_read(ctx: ToolContext, params: ReadParams) -> ToolResult:
    file_only = [name for name in FILE_ONLY if getattr(params, name) is not None]
    if params.url is not None:
        if params.path is not None or params.target != "file" or params.skillId is not None or file_only:
            return ToolResult.error("url is read alone (with offset): leave out path, target, skillId and "
                                    f"{', '.join(file_only) or 'the file parameters'}.")  # fmt: skip
        if not ctx.config.web:
            return ToolResult.error(web_off("read url"))
        return await web.run_fetch(ctx, web.FetchParams(url=params.url, offset=params.offset or 0))
    if params.target == "skill":
        if not params.skillId or not params.skillId.strip():
            return ToolResult.error("target=skill needs skillId: the skill's name, as the catalog lists it.")
        if file_only:
            return ToolResult.error(f"{', '.join(file_only)} are for workspace files, not a skill's.")
        if params.path is None:
            return await skills.skill_instructions(ctx, params.skillId, SKILL_FILE_CALL)
        return await skills.run_read_resource(
            ctx, skills.ReadResourceParams(name=params.skillId, path=params.path, offset=params.offset or 0)
        )
    if params.skillId is not None:
        return ToolResult.error("skillId is for target=skill.")
    if params.path is None and params.fileId is None:
        return ToolResult.error("read needs a path or fileId (or a url, or target=skill with skillId).")
    return await read.run_read(
        ctx, read.ReadParams.model_validate(given(params, {"url", "target", "skillId"}))
    )


def given(params: knowledge.SearchParams | read.ReadParams, exclude: set[str]) -> dict[str, Any]:
    """The arguments the model set, for the canonical tool's own parameters."""
    return params.model_dump(exclude_unset=True, exclude=exclude)


def web_off(what: str) -> str:
    return f"{what} is not available: the web is off for this server's tools ([tools] web = false)."


SEARCH = dataclasses.replace(
    knowledge.SEARCH,
    description=knowledge.SEARCH_DESCRIPTION
    + " With target=web, a web search instead (where the server has a search provider).",
    params=SearchParams,
    run=run_search,
)
READ = dataclasses.replace(
    read.READ,
    description=read.READ.description
    + " Also: `url` reads a web page as text; target=skill with `skillId` reads a skill's instructions "
    "(and, with `path`, one of its files).",
    params=ReadParams,
    run=run_read,
)

#: The workbench's tools by canonical name, in place of the canonical ones (`toolsets`).
TOOLS: dict[str, Tool] = {"search": SEARCH, "read": READ}
