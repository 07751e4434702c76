"""Tool-call arguments as a model wrote them: parsed into an input, or marked as unparsable.

Local and gateway models sometimes write arguments that are not a JSON object. That is the
model's mistake, not a failed turn: the call carries the marker input `{INVALID_ARGUMENTS: raw}`
and `invalid_arguments(call)` is the error result the tool host answers it with (the model
reads it and tries again). Sent back to the provider, the raw text is what the model wrote.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.agent.models import ToolCall

#: The `input` key that marks a call whose arguments could not be parsed.
INVALID_ARGUMENTS = "__invalid_arguments__"
#: How much of unparsable arguments the error result quotes.
QUOTED_ARGUMENTS = 500


def parse_arguments(raw: str) -> dict[str, Any]:
    """A call's input: the JSON object (empty text is `{}`), or the invalid-arguments marker."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {INVALID_ARGUMENTS: raw}
    return value if isinstance(value, dict) else {INVALID_ARGUMENTS: raw}


def raw_arguments(call: ToolCall) -> str | None:
    """The unparsable text of a marked call; None for a call with a real input."""
    if set(call.input) != {INVALID_ARGUMENTS}:
        return None
    return str(call.input[INVALID_ARGUMENTS])


def invalid_arguments(call: ToolCall) -> str | None:
    """The error result for a call whose arguments were not a JSON object; None for a good call."""
    raw = raw_arguments(call)
    if raw is None:
        return None
    return (
        f"The arguments of your {call.name} call were not a valid JSON object, so it was not run: "
        f"{raw[:QUOTED_ARGUMENTS]!r}. Call it again with the arguments as one JSON object."
    )
