"""`todo_write`: the model's own task list, stored with the session (seed 000).

The model always sends the whole list, which replaces the stored one (Claude Code's TodoWrite
shape), and gets the whole list back, so the list in its context is never out of date. It is
bookkeeping (`Action.META`): allowed in every tier and in plan mode, and it touches nothing in
the machine.

Rules, checked before anything is stored (a list that breaks one is refused whole):
- every item has non-empty `content` of at most `MAX_TODO_CHARS` characters;
- at most `MAX_TODOS` items;
- ids are unique; an item without an id gets the next number (ids are strings);
- at most `MAX_IN_PROGRESS` item is `in_progress`: the model works on one thing at a time and
  marks it `completed` before starting the next, so the list shows where it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Action, Tool, ToolContext, ToolParams, ToolResult

#: Items a list may hold.
MAX_TODOS = 100
#: Characters of one item's content.
MAX_TODO_CHARS = 500
#: Characters of one item's id.
MAX_TODO_ID_CHARS = 64
#: Items that may be `in_progress` at once.
MAX_IN_PROGRESS = 1

Status = Literal["pending", "in_progress", "completed"]
#: How each status is drawn in the list shown to the model.
CHECKBOX: dict[str, str] = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]"}

DESCRIPTION = (
    "Write your task list for this session: send the WHOLE list every time (it replaces the previous "
    "one) and get it back. Use it for work with several steps: add the steps as `pending`, mark the one "
    f"you are working on `in_progress` (at most {MAX_IN_PROGRESS} at a time) and mark each `completed` as "
    "soon as it is done. Keep an item's `id` when you update it; new items may omit it. "
    f"At most {MAX_TODOS} items of {MAX_TODO_CHARS} characters."
)


class TodoItem(ToolParams):
    id: str | None = Field(default=None, description="The item's id from the last list; omit for a new item.")
    content: str = Field(description="What to do, as a short imperative sentence.")
    status: Status = Field(description="pending, in_progress (at most one item) or completed.")


class TodoParams(ToolParams):
    todos: list[TodoItem] = Field(description="The whole task list, in order; an empty list clears it.")


async def run_todo_write(ctx: ToolContext, params: TodoParams) -> ToolResult:
    problem = check(params.todos)
    if problem is not None:
        return ToolResult.error(f"The task list was not saved: {problem}")
    previous = await ctx.todos.get(ctx.session_id)
    items = with_ids(params.todos, previous)
    await ctx.todos.put(ctx.session_id, items)
    return ToolResult.text(render(items), todos=items)


def check(todos: list[TodoItem]) -> str | None:
    """The first rule the list breaks, as a sentence, or None."""
    if len(todos) > MAX_TODOS:
        return f"it has {len(todos)} items, more than {MAX_TODOS}."
    seen: set[str] = set()
    for number, item in enumerate(todos, 1):
        if not item.content.strip():
            return f"item {number} has no content."
        if len(item.content) > MAX_TODO_CHARS:
            return f"item {number} is {len(item.content)} characters long, more than {MAX_TODO_CHARS}."
        if item.id is not None:
            if not item.id.strip() or len(item.id) > MAX_TODO_ID_CHARS:
                return f"item {number} has an empty id or one longer than {MAX_TODO_ID_CHARS} characters."
            if item.id in seen:
                return f"the id {item.id!r} is used twice."
            seen.add(item.id)
    in_progress = sum(1 for item in todos if item.status == "in_progress")
    if in_progress > MAX_IN_PROGRESS:
        return (
            f"{in_progress} items are in_progress; at most {MAX_IN_PROGRESS} may be. Mark finished work "
            "completed and leave the rest pending."
        )
    return None


def with_ids(todos: list[TodoItem], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as stored: ids kept, missing ones numbered after every numeric id used so far."""
    ids = [*(t.id for t in todos), *(p.get("id") for p in previous)]
    next_id = max((int(i) for i in ids if isinstance(i, str) and i.isascii() and i.isdigit()), default=0) + 1
    items: list[dict[str, Any]] = []
    for item in todos:
        ident = item.id
        if ident is None:
            ident, next_id = str(next_id), next_id + 1
        items.append({"id": ident, "content": item.content.strip(), "status": item.status})
    return items


def render(items: list[dict[str, Any]]) -> str:
    """The list as the model reads it back: a count line, then one checkbox line per item."""
    if not items:
        return "The task list is empty."
    counts = {status: sum(1 for i in items if i["status"] == status) for status in CHECKBOX}
    head = (
        f"Task list ({len(items)} items: {counts['completed']} completed, {counts['in_progress']} in progress, "
        f"{counts['pending']} pending):"
    )
    return "\n".join([head, *(f"{CHECKBOX[i['status']]} {i['id']}. {i['content']}" for i in items)])


TODO_WRITE = Tool(
    name="todo_write",
    description=DESCRIPTION,
    params=TodoParams,
    action=Action.META,
    run=run_todo_write,
    read_only=False,
    machine=False,
)

TOOLS: dict[str, Tool] = {TODO_WRITE.name: TODO_WRITE}
