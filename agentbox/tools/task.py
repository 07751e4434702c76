"""`task`: hand a self-contained piece of work to a subagent and get back its final answer.

The tool is only the model-facing door: its schema is static (so the tools block stays
prompt-cache-stable, as Flue's is) and `run` calls the session's `delegate`, which the agent
layer sets (`agent/subagents.py`: the roster, depth limit, parallelism and the intersection of
permissions live there). A session without one says so instead of failing.
"""

from __future__ import annotations

from pydantic import Field

from agentbox.tools.base import Action, Tool, ToolContext, ToolParams, ToolResult

DESCRIPTION = (
    "Delegate a task to a subagent from the Available Agents list in the system prompt. The subagent "
    "starts fresh: it sees only `prompt` (not this conversation), works in the same workspace with its "
    "own tools and permissions (never more than yours), and only its final message comes back to you. "
    "So write the prompt as a complete brief: the goal, the relevant paths and facts you already know, "
    "and what its answer should contain. Use it for work that would otherwise fill your context: "
    "searching or reading a lot of code, researching, or a well-defined edit. Several read-only tasks "
    "in one reply run in parallel."
)


class TaskParams(ToolParams):
    agent: str = Field(
        description="The subagent's name, as the Available Agents list in the system prompt gives it."
    )
    prompt: str = Field(
        description="The full task for the subagent. It sees only this text, so include every detail it needs."
    )
    description: str = Field(default="", description="A 3-5 word label for the task, shown to the user.")
    resume: str | None = Field(
        default=None,
        description=(
            "The id of an earlier task of this session (`sub_...`, given with its answer) to continue: the "
            "same agent goes on from its own conversation, with `prompt` as its next message."
        ),
    )
    background: bool = Field(
        default=False,
        description=(
            "Run it in the background (read-only agents only): the call returns at once with a task id "
            "and you go on working; the agent's final message arrives later as a `task` signal."
        ),
    )


async def run(ctx: ToolContext, params: TaskParams) -> ToolResult:
    delegate = getattr(ctx, "delegate", None)
    if delegate is None:
        return ToolResult.error("Subagents are not available in this session.")
    result: ToolResult = await delegate(
        params.agent, params.prompt, params.description, background=params.background, resume=params.resume
    )
    return result


TASK = Tool("task", DESCRIPTION, TaskParams, Action.TASK, run, read_only=False)

TOOLS: dict[str, Tool] = {TASK.name: TASK}
