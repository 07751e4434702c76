"""Compaction (Flue a.10) as pure functions over a transcript of `ChatMessage`s.

When the conversation nears the model's context window, the older part is summarised (by the
session's model, or the one `compaction.model` names) and replaced by that summary; the most
recent part is kept verbatim:

1. `reserve_tokens(window, max_output)`: room kept free for the reply.
2. `should_compact(context_tokens, window, reserve)`: the threshold trigger, checked at a turn
   boundary (a provider's context-overflow error triggers compaction regardless).
3. `cut_point(messages, keep_recent_tokens)`: where the kept part starts, never at a tool
   result, so a tool call and its results are always on the same side.
4. `summary_request(old, previous_summary, ...)`: the request for the session's model, Flue's
   template, merging into the previous summary when there is one.
5. `finish_summary(...)` and `rebaseline(...)`: the summary with its file lists, and the new
   transcript head (recomposed system prompt + summary message + kept messages).

Images: the summarized part's images go with the summary request, the newest
`MAX_IMAGES_PER_MESSAGE` of them (the others are named in its text), so the summary can say
what they showed.

Token estimate: characters / 4 (`CHARS_PER_TOKEN`), as Flue and pi do, plus `IMAGE_TOKENS` an
image. It is deliberately rough: it only has to place a cut and pad the provider's reported usage for messages sent
after it; a real tokenizer per provider would add dependencies for no change in behaviour.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentbox.agent.models import ChatMessage, ModelRequest, model_name_problem
from agentbox.agent.vision import MAX_IMAGES_PER_MESSAGE
from agentbox.tools.base import ImageBlock, TextBlock
from agentbox.tools.toolsets import TOOLSETS

#: Reserve for the reply when the model's max output is unknown or larger (Flue).
DEFAULT_RESERVE_TOKENS = 20_000
#: Smallest reserve on a small window (Flue).
MIN_RESERVE_TOKENS = 1024
#: Tokens of recent conversation kept verbatim (Flue).
DEFAULT_KEEP_RECENT_TOKENS = 8000
#: Characters per estimated token.
CHARS_PER_TOKEN = 4
#: Tokens an image counts for in the estimate: about what a picture at the edge limit costs
#: (Anthropic: width x height / 750 after scaling to 1.15 megapixels; OpenAI less).
IMAGE_TOKENS = 1600
#: Characters of one tool result shown to the summarizer (Flue).
TOOL_RESULT_EXCERPT_CHARS = 2000
#: Upper bound of the summary's max output tokens (Flue).
MAX_SUMMARY_TOKENS = 16_000
#: Share of the reserve the summary may use as its max output tokens (Flue: 0.8).
SUMMARY_RESERVE_SHARE = 0.8
#: Keys allowed in a `compaction` config object; any other is a mistake (Flue throws too).
CONFIG_KEYS = frozenset({"reserve_tokens", "keep_recent_tokens", "model"})
#: The keys of `CONFIG_KEYS` that hold a count of tokens.
TOKEN_KEYS = frozenset({"reserve_tokens", "keep_recent_tokens"})
#: Tool names (as any toolset calls them) whose `path` argument counts as read / modified for
#: the summary's file lists.
READ_TOOLS = frozenset(
    name for names in TOOLSETS.values() for name, canonical in names if canonical in ("read", "read_image")
)
MODIFY_TOOLS = frozenset(
    name for names in TOOLSETS.values() for name, canonical in names if canonical in ("write", "edit")
)


class CompactionConfigError(ValueError):
    """A `compaction` setting that is neither false nor a valid object."""


@dataclass(frozen=True)
class CompactionConfig:
    enabled: bool = True
    reserve_tokens: int | None = None
    """Fixed reserve; None = model-aware (`reserve_tokens()`)."""
    keep_recent_tokens: int = DEFAULT_KEEP_RECENT_TOKENS
    model: str | None = None
    """The model that writes the summary (`provider:name`, one of the server's configured
    `models`, or the session's own); None = the session's model. A smaller, cheaper model
    summarises as well, and its own window is what the summary request must fit."""


def parse_config(value: Any) -> CompactionConfig:
    """`compaction: false | {reserve_tokens, keep_recent_tokens, model}`; None or true mean the
    defaults. Whether `model` is configured is the caller's check (`check_model`)."""
    if value is None or value is True:
        return CompactionConfig()
    if value is False:
        return CompactionConfig(enabled=False)
    if not isinstance(value, dict):
        raise CompactionConfigError(f"compaction must be false or an object, not {type(value).__name__}")
    unknown = set(value) - CONFIG_KEYS
    if unknown:
        raise CompactionConfigError(
            f"compaction has unknown keys {sorted(unknown)}; allowed: {sorted(CONFIG_KEYS)}"
        )
    for key in TOKEN_KEYS & set(value):
        if not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1:
            raise CompactionConfigError(f"compaction.{key} must be a positive integer")
    model = value.get("model")
    if model is not None and (not isinstance(model, str) or model_name_problem(model) is not None):
        raise CompactionConfigError(
            f"compaction.model must be a model name ('<provider>:<name>'), not {model!r}"
        )
    return CompactionConfig(
        reserve_tokens=value.get("reserve_tokens"),
        keep_recent_tokens=value.get("keep_recent_tokens", DEFAULT_KEEP_RECENT_TOKENS),
        model=model,
    )


def check_model(config: CompactionConfig, session_model: str, configured: Iterable[str]) -> None:
    """Refuse a summary model that is neither the session's own nor one the operator configured
    (`[models."provider:name"]`): another provider's model runs on the server's own credentials
    for it, so which ones may read a session's conversation is the operator's choice."""
    allowed = {session_model, *configured}
    if config.model is not None and config.model not in allowed:
        raise CompactionConfigError(
            f"compaction.model {config.model!r} is not a configured model; configured: {sorted(allowed)}"
        )


# -- trigger -------------------------------------------------------------------------------


def reserve_tokens(window: int, max_output: int | None) -> int:
    """min(20000, max output); when twice that fills the window: max(1024, window // 3)."""
    reserve = DEFAULT_RESERVE_TOKENS if max_output is None else min(DEFAULT_RESERVE_TOKENS, max_output)
    if reserve * 2 >= window:
        reserve = max(MIN_RESERVE_TOKENS, window // 3)
    return reserve


def should_compact(context_tokens: int, window: int | None, reserve: int) -> bool:
    """The threshold trigger: more than `window - reserve` tokens; never with an unknown window."""
    return window is not None and context_tokens > window - reserve


def estimate_tokens(message: ChatMessage) -> int:
    chars = len(message.text)
    for call in message.tool_calls:
        chars += len(call.name) + len(repr(call.input))
    images = sum(isinstance(p, ImageBlock) for p in message.parts)
    return -(-chars // CHARS_PER_TOKEN) + images * IMAGE_TOKENS


def context_tokens(
    messages: Sequence[ChatMessage], reported: int | None = None, reported_at: int = -1
) -> int:
    """Tokens in context: the provider's `reported` count as of message index `reported_at`
    (its last successful reply), plus estimates for the messages after it; all estimated if None."""
    if reported is None:
        return sum(estimate_tokens(m) for m in messages)
    return reported + sum(estimate_tokens(m) for m in messages[reported_at + 1 :])


# -- cut point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    index: int
    """The first kept message; `messages[start:index]` is summarised."""
    turn_start: int
    """Where the cut's turn begins (its user message); < index means a split turn."""

    @property
    def split_turn(self) -> bool:
        return self.turn_start < self.index


def cut_point(
    messages: Sequence[ChatMessage], keep_recent_tokens: int = DEFAULT_KEEP_RECENT_TOKENS, start: int = 0
) -> Cut | None:
    """Where to cut so about `keep_recent_tokens` stay verbatim; None when nothing can be summarised.

    Walk back from the end until the kept messages reach `keep_recent_tokens`, then move to the
    nearest user or assistant message at or after that point (never a tool result: its call is
    before it); when only tool results follow the point, back to the reply that called them.
    `start` is the first message after a previous compaction's summary head.
    """
    kept = 0
    point = len(messages)
    while point > start and kept < keep_recent_tokens:
        point -= 1
        kept += estimate_tokens(messages[point])
    if kept < keep_recent_tokens:
        return None  # everything fits in the kept part
    index = next((i for i in range(point, len(messages)) if messages[i].role != "tool"), None)
    if index is None:
        # Only tool results after the point (a long command's output, mid-turn): keep the reply
        # that called them, more than asked but still a cut, rather than not compacting at all.
        index = next((i for i in range(point - 1, start - 1, -1) if messages[i].role != "tool"), None)
    if index is None or index <= start:
        return None
    turn_start = next((i for i in range(index, start - 1, -1) if messages[i].role == "user"), start)
    return Cut(index, turn_start)


# -- summary -------------------------------------------------------------------------------

SUMMARIZER_SYSTEM = (
    "You are a context summarization assistant. Read the conversation between a user and an AI "
    "coding agent and produce only the structured summary that is asked for. Do not continue the "
    "conversation, do not answer questions in it, and do not call tools."
)

TEMPLATE = """## Goal
[What the user is trying to accomplish]

## Constraints & Preferences
- [Requirements and preferences the user stated]

## Progress
### Done
- [x] [Completed work]
### In Progress
- [ ] [Current work]
### Blocked
- [Issues, if any]

## Key Decisions
- **[Decision]**: [Rationale]

## Next Steps
1. [What should happen next]

## Critical Context
- [Data, references, error messages needed to continue]"""

PRESERVE = "Keep exact file paths, function names, commands and error messages."

SUMMARY_PROMPT = f"""The messages above are a conversation to summarise. Create a structured context \
checkpoint that another model will use to continue the work. Use this format:

{TEMPLATE}

Keep each section concise. {PRESERVE}"""

UPDATE_PROMPT = f"""The messages above are NEW conversation to merge into the summary in \
<previous-summary>. Update it: keep everything still relevant, add new progress, decisions and \
context, move items from In Progress to Done when completed, update Next Steps. Use this format:

{TEMPLATE}

Keep each section concise. {PRESERVE}"""

SPLIT_TURN_PROMPT = """The conversation ends inside a turn whose later part is kept verbatim. \
<turn-prefix> holds that turn's beginning. After the sections above, add:

## Turn Context (split turn)
### Original Request
[What the user asked in this turn]
### Early Progress
[What was done in the turn's prefix]
### Context for Suffix
[What is needed to understand the kept part of the turn]"""


@dataclass(frozen=True)
class SummaryRequest:
    request: ModelRequest
    max_tokens: int
    """The summary's max output tokens: min(0.8 x reserve, 16000)."""
    read_files: tuple[str, ...]
    modified_files: tuple[str, ...]
    """The file lists for `finish_summary`, accumulated with the previous summary's."""


def serialize(messages: Sequence[ChatMessage]) -> str:
    """Tagged text for the summarizer; tool results cut to `TOOL_RESULT_EXCERPT_CHARS`."""
    lines = []
    for m in messages:
        if m.role == "user":
            lines.append(f"[User]: {m.text}")
        elif m.role == "assistant":
            if m.text:
                lines.append(f"[Assistant]: {m.text}")
            if m.tool_calls:
                calls = "; ".join(
                    f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.input.items())})" for c in m.tool_calls
                )
                lines.append(f"[Assistant tool calls]: {calls}")
        else:
            text = m.text
            if len(text) > TOOL_RESULT_EXCERPT_CHARS:
                cut = len(text) - TOOL_RESULT_EXCERPT_CHARS
                text = text[:TOOL_RESULT_EXCERPT_CHARS] + f"\n[... {cut} more characters]"
            lines.append(f"[Tool result{' (error)' if m.is_error else ''}]: {text}")
    return "\n\n".join(lines)


def summary_request(
    old_messages: Sequence[ChatMessage],
    previous_summary: str | None = None,
    *,
    turn_prefix: Sequence[ChatMessage] = (),
    reserve: int = DEFAULT_RESERVE_TOKENS,
) -> SummaryRequest:
    """The request that summarises `old_messages` (merging into `previous_summary` if any).

    A split turn's prefix goes in the same request under `<turn-prefix>` (Flue makes a second,
    parallel call; one call keeps a summary a single model answer to record and retry).
    """
    parts = [f"<conversation>\n{serialize(old_messages)}\n</conversation>"]
    if previous_summary:
        parts.append(f"<previous-summary>\n{previous_summary}\n</previous-summary>")
    if turn_prefix:
        parts.append(f"<turn-prefix>\n{serialize(turn_prefix)}\n</turn-prefix>")
    parts.append(UPDATE_PROMPT if previous_summary else SUMMARY_PROMPT)
    if turn_prefix:
        parts.append(SPLIT_TURN_PROMPT)
    read, modified = file_lists([*old_messages, *turn_prefix], previous_summary or "")
    text = "\n\n".join(parts)
    images = [p for m in [*old_messages, *turn_prefix] for p in m.parts if isinstance(p, ImageBlock)]
    shown = tuple(images[-MAX_IMAGES_PER_MESSAGE:])
    message = ChatMessage("user", text, parts=(TextBlock(text), *shown) if shown else ())
    request = ModelRequest(SUMMARIZER_SYSTEM, [message], [])
    return SummaryRequest(
        request, min(int(SUMMARY_RESERVE_SHARE * reserve), MAX_SUMMARY_TOKENS), read, modified
    )


def file_lists(
    messages: Sequence[ChatMessage], previous_summary: str = ""
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(read, modified) paths from read/write/edit calls plus the previous summary's lists;
    a file both read and modified is listed as modified only."""
    read = set(_tagged(previous_summary, "read-files"))
    modified = set(_tagged(previous_summary, "modified-files"))
    for m in messages:
        for call in m.tool_calls:
            path = call.input.get("path")
            if isinstance(path, str) and path:
                if call.name in READ_TOOLS:
                    read.add(path)
                elif call.name in MODIFY_TOOLS:
                    modified.add(path)
    return tuple(sorted(read - modified)), tuple(sorted(modified))


def _tagged(text: str, tag: str) -> list[str]:
    match = re.search(rf"<{tag}>\n?(.*?)</{tag}>", text, re.S)
    return [line.strip() for line in match.group(1).splitlines() if line.strip()] if match else []


def finish_summary(text: str, read_files: Sequence[str], modified_files: Sequence[str]) -> str:
    """The model's summary (any file lists it echoed removed) followed by the accumulated lists."""
    body = re.sub(r"\s*<(read-files|modified-files)>.*?</\1>", "", text, flags=re.S).strip()
    tail = []
    if read_files:
        tail.append("<read-files>\n" + "\n".join(read_files) + "\n</read-files>")
    if modified_files:
        tail.append("<modified-files>\n" + "\n".join(modified_files) + "\n</modified-files>")
    return "\n\n".join([body, *tail])


# -- rebaseline ----------------------------------------------------------------------------

SUMMARY_HEAD = (
    "The conversation so far was compacted to save context. This summary replaces the earlier "
    "messages; the messages after it are kept verbatim."
)


@dataclass(frozen=True)
class Baseline:
    system: str
    """The system prompt recomposed against the current environment (`prompt.assemble`)."""
    messages: list[ChatMessage]
    """The new transcript: the summary message, then the kept messages."""
    first_kept: int = 1
    """Index in `messages` of the first kept message (`cut_point(start=...)` next time)."""


def summary_message(summary: str) -> ChatMessage:
    return ChatMessage("user", f"{SUMMARY_HEAD}\n\n<summary>\n{summary}\n</summary>")


def previous_summary(message: ChatMessage) -> str | None:
    """The summary inside a head message made by `summary_message`; None for any other message."""
    if message.role != "user" or not message.text.startswith(SUMMARY_HEAD):
        return None
    match = re.search(r"<summary>\n(.*)\n</summary>\s*$", message.text, re.S)
    return match.group(1) if match else None


def rebaseline(system: str, summary: str, kept: Sequence[ChatMessage]) -> Baseline:
    """The new head: a fresh system prompt, the summary as the first message, the kept messages."""
    if kept and kept[0].role == "tool":
        raise ValueError("the kept part cannot start with a tool result (cut with `cut_point`)")
    return Baseline(system, [summary_message(summary), *kept])
