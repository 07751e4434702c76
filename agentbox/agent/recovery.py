"""Recovering a turn a dead process left open (Flue a.9): where it stands, and what to do.

Recovery on start, per open turn, in FIFO order. First converge (a reply left `streaming`
by the dead process becomes `aborted`), then classify and act by `RECOVERY`:

    state               meaning                                        action
    queued              never started                                   start
    awaiting_approval   a tool call waits for the user                  wait (left as it is)
    input_only          started, no complete reply yet                  continue (query the model)
    tool_results        the last reply's tool calls all have results    continue
    tools_unresolved    some of its calls have no result                repair, then continue
    replied             the last reply had no tool calls, and no        complete (end_turn)
                        message joined the turn after it

Repair keeps recorded results (never re-run), re-runs read-only tools, and gives every other
unresolved call the "interrupted, outcome unknown" result, except a call whose approval was
answered: denied, the refusal is its result; allowed, it runs (without asking again) only if
this process saw the answer arrive while no task waited for it (a turn left waiting by a
restart), since then it cannot have started; else its outcome is unknown. The calls after
such a call never started either, so they run as usual.

The table is data (`RECOVERY`); the worker converges, classifies and acts on it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from agentbox.store.sessions import Message, Turn


class State(enum.StrEnum):
    QUEUED = "queued"
    AWAITING_APPROVAL = "awaiting_approval"
    INPUT_ONLY = "input_only"
    TOOL_RESULTS = "tool_results"
    TOOLS_UNRESOLVED = "tools_unresolved"
    REPLIED = "replied"


class Act(enum.StrEnum):
    START = "start"
    WAIT = "wait"
    CONTINUE = "continue"
    REPAIR = "repair"
    COMPLETE = "complete"


#: Flue's recovery table (flue-runtime.md a.9) in our states: what to do with an open turn.
RECOVERY: Mapping[State, Act] = {
    State.QUEUED: Act.START,
    State.AWAITING_APPROVAL: Act.WAIT,
    State.INPUT_ONLY: Act.CONTINUE,
    State.TOOL_RESULTS: Act.CONTINUE,
    State.TOOLS_UNRESOLVED: Act.REPAIR,
    State.REPLIED: Act.COMPLETE,
}


def classify(turn: Turn, transcript: Sequence[Message]) -> State:
    """Where an open turn stands, from its recorded rows (after converging)."""
    if turn.status in ("queued", "awaiting_approval"):
        return State(turn.status)
    replies = [
        m for m in transcript if m.turn_id == turn.id and m.role == "assistant" and m.status == "complete"
    ]
    if not replies:
        return State.INPUT_ONLY
    calls = replies[-1].content.get("tool_calls", [])
    if not calls:  # a message that joined after the reply (or a signal told then) is still unanswered
        later = any(m.turn_id == turn.id and m.role == "user" and m.id > replies[-1].id for m in transcript)
        return State.INPUT_ONLY if later else State.REPLIED
    answered = {m.tool_use_id for m in transcript if m.role == "tool"}
    return State.TOOL_RESULTS if all(c["id"] in answered for c in calls) else State.TOOLS_UNRESOLVED
