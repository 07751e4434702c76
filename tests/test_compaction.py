"""Compaction (agent/compaction.py): reserve, trigger, cut point, summary request, rebaseline."""

from __future__ import annotations

import random

import pytest

from agentbox.agent import compaction as c
from agentbox.agent.models import ChatMessage, ToolCall


def user(text: str) -> ChatMessage:
    return ChatMessage("user", text)


def assistant(text: str = "", *calls: ToolCall) -> ChatMessage:
    return ChatMessage("assistant", text, list(calls))


def result(call: ToolCall, text: str, is_error: bool = False) -> ChatMessage:
    return ChatMessage("tool", text, tool_use_id=call.id, is_error=is_error)


def tokens(n: int) -> str:
    """Text that estimates to exactly `n` tokens."""
    return "x" * (n * c.CHARS_PER_TOKEN)


# -- reserve and trigger -------------------------------------------------------------------


def test_reserve_large_window() -> None:
    assert c.reserve_tokens(200_000, 64_000) == c.DEFAULT_RESERVE_TOKENS
    assert c.reserve_tokens(200_000, 8192) == 8192
    assert c.reserve_tokens(200_000, None) == c.DEFAULT_RESERVE_TOKENS


def test_reserve_small_window() -> None:
    # boundary: reserve*2 == window switches to window // 3
    assert c.reserve_tokens(40_001, None) == 20_000
    assert c.reserve_tokens(40_000, None) == 40_000 // 3
    assert c.reserve_tokens(16_000, 8000) == 16_000 // 3
    assert c.reserve_tokens(16_001, 8000) == 8000
    # floor
    assert c.reserve_tokens(2048, None) == c.MIN_RESERVE_TOKENS
    assert c.reserve_tokens(3 * 1025, None) == 1025


def test_should_compact_boundary() -> None:
    window, reserve = 100_000, 20_000
    assert not c.should_compact(80_000, window, reserve)
    assert c.should_compact(80_001, window, reserve)
    assert not c.should_compact(10**9, None, reserve)


def test_context_tokens_pads_reported_usage_with_estimates() -> None:
    msgs = [user(tokens(10)), assistant(tokens(5)), result(ToolCall("1", "read", {}), tokens(7))]
    assert c.context_tokens(msgs) == 22
    assert c.context_tokens(msgs, reported=1000, reported_at=1) == 1007


def test_estimate_rounds_up_and_counts_tool_calls() -> None:
    assert c.estimate_tokens(user("x")) == 1
    assert c.estimate_tokens(user("")) == 0
    assert c.estimate_tokens(assistant("", ToolCall("1", "read", {"path": "a"}))) > 0


# -- config --------------------------------------------------------------------------------


def test_parse_config() -> None:
    assert c.parse_config(None) == c.CompactionConfig()
    assert c.parse_config(True) == c.CompactionConfig()
    assert c.parse_config(False).enabled is False
    cfg = c.parse_config({"reserve_tokens": 4000})
    assert cfg.reserve_tokens == 4000 and cfg.keep_recent_tokens == c.DEFAULT_KEEP_RECENT_TOKENS
    assert c.parse_config({"keep_recent_tokens": 100}).keep_recent_tokens == 100
    assert c.parse_config({"model": "openai:small"}).model == "openai:small"
    assert c.parse_config({}).model is None


@pytest.mark.parametrize(
    "bad",
    [
        "yes",
        3,
        {"model": "x"},
        {"model": ""},
        {"model": 3},
        {"summary_model": "openai:x"},
        {"reserve_tokens": 0},
        {"keep_recent_tokens": True},
        {"reserve_tokens": "1"},
    ],
)
def test_parse_config_refuses(bad: object) -> None:
    with pytest.raises(c.CompactionConfigError):
        c.parse_config(bad)


# -- cut point -----------------------------------------------------------------------------


def test_cut_at_user_message_keeps_recent_tokens() -> None:
    msgs = [user(tokens(5000)), assistant(tokens(5000)), user(tokens(5000)), assistant(tokens(5000))]
    cut = c.cut_point(msgs, keep_recent_tokens=8000)
    assert cut == c.Cut(2, 2) and not cut.split_turn


def test_nothing_to_cut_when_everything_fits() -> None:
    msgs = [user(tokens(100)), assistant(tokens(100))]
    assert c.cut_point(msgs, keep_recent_tokens=200) is None  # keep boundary reached at index 0
    assert c.cut_point(msgs, keep_recent_tokens=201) is None
    assert c.cut_point(msgs, keep_recent_tokens=100) == c.Cut(1, 0)


def test_cut_moves_past_tool_results_and_reports_split_turn() -> None:
    call = ToolCall("a", "exec", {"cmd": "ls"})
    msgs = [
        user(tokens(10)),
        assistant("", call),
        result(call, tokens(9000)),
        assistant(tokens(10)),
    ]
    cut = c.cut_point(msgs, keep_recent_tokens=8000)
    assert cut == c.Cut(3, 0) and cut.split_turn


def test_trailing_tool_results_cut_before_their_call() -> None:
    call = ToolCall("a", "exec", {"cmd": "seq 1 100000"})
    msgs = [
        user(tokens(10)),
        assistant(tokens(10)),
        user(tokens(10)),
        assistant("", call),
        result(call, tokens(9000)),
    ]
    cut = c.cut_point(msgs, keep_recent_tokens=8000)
    assert cut == c.Cut(3, 2) and cut.split_turn  # the call stays with its result
    assert c.cut_point(msgs[2:], keep_recent_tokens=8000) == c.Cut(1, 0)
    assert c.cut_point([user(tokens(10)), result(call, tokens(9000))], keep_recent_tokens=8000) is None


def test_cut_respects_previous_summary_head() -> None:
    msgs = [c.summary_message("old"), user(tokens(9000)), assistant(tokens(10))]
    assert c.cut_point(msgs, keep_recent_tokens=8000, start=1) is None
    msgs.append(user(tokens(9000)))
    assert c.cut_point(msgs, keep_recent_tokens=8000, start=1) == c.Cut(3, 3)


def random_transcript(rng: random.Random) -> list[ChatMessage]:
    msgs: list[ChatMessage] = []
    for _turn in range(rng.randint(1, 8)):
        msgs.append(user(tokens(rng.randint(0, 3000))))
        for _step in range(rng.randint(0, 4)):
            calls = [
                ToolCall(f"t{len(msgs)}_{i}", "read", {"path": f"f{i}"}) for i in range(rng.randint(1, 3))
            ]
            msgs.append(assistant(tokens(rng.randint(0, 500)), *calls))
            msgs += [result(call, tokens(rng.randint(0, 6000))) for call in calls]
        msgs.append(assistant(tokens(rng.randint(0, 2000))))
    return msgs


def test_cut_never_separates_a_tool_result_from_its_call() -> None:
    rng = random.Random(1234)
    cuts = 0
    for _ in range(500):
        msgs = random_transcript(rng)
        keep = rng.choice([100, 2000, 8000, 20000])
        cut = c.cut_point(msgs, keep_recent_tokens=keep)
        if cut is None:
            assert sum(c.estimate_tokens(m) for m in msgs[1:]) < keep or all(
                m.role == "tool" for m in msgs[1:]
            )
            continue
        cuts += 1
        assert 0 < cut.index < len(msgs)
        assert msgs[cut.index].role != "tool"
        kept, old = msgs[cut.index :], msgs[: cut.index]
        kept_calls = {call.id for m in kept for call in m.tool_calls}
        old_calls = {call.id for m in old for call in m.tool_calls}
        assert all(m.tool_use_id in kept_calls for m in kept if m.role == "tool")
        assert all(m.tool_use_id in old_calls for m in old if m.role == "tool")
        only_results = all(m.role == "tool" for m in msgs[cut.index + 1 :])  # the fallback: keep their call
        assert only_results or sum(c.estimate_tokens(m) for m in msgs[cut.index + 1 :]) < keep
        assert msgs[cut.turn_start].role == "user" and cut.turn_start <= cut.index
        c.rebaseline("sys", "summary", kept)  # a valid head
    assert cuts > 100


# -- summary -------------------------------------------------------------------------------


def test_summary_request_content() -> None:
    read = ToolCall("r", "read", {"path": "src/app.py"})
    edit = ToolCall("e", "edit", {"path": "src/util.py", "old": "a", "new": "b"})
    msgs = [
        user("Fix the crash in parse()."),
        assistant("Looking.", read, edit),
        result(read, "y" * (c.TOOL_RESULT_EXCERPT_CHARS + 500)),
        result(edit, "Error: not found", is_error=True),
    ]
    req = c.summary_request(msgs, reserve=10_000)
    assert req.max_tokens == 8000
    assert req.request.system == c.SUMMARIZER_SYSTEM and req.request.tools == []
    [prompt] = req.request.messages
    assert prompt.role == "user"
    text = prompt.text
    assert text.startswith("<conversation>\n[User]: Fix the crash in parse().\n\n[Assistant]: Looking.")
    assert (
        "[Assistant tool calls]: read(path='src/app.py'); edit(path='src/util.py', old='a', new='b')" in text
    )
    assert "y" * c.TOOL_RESULT_EXCERPT_CHARS + "\n[... 500 more characters]" in text
    assert "y" * (c.TOOL_RESULT_EXCERPT_CHARS + 1) not in text
    assert "[Tool result (error)]: Error: not found" in text
    for section in ("## Goal", "## Constraints & Preferences", "## Progress", "### Done", "### In Progress",
                    "### Blocked", "## Key Decisions", "## Next Steps", "## Critical Context"):  # fmt: skip
        assert section in text
    assert "<previous-summary>" not in text and "<turn-prefix>" not in text
    assert req.read_files == ("src/app.py",) and req.modified_files == ("src/util.py",)


def test_summary_max_tokens_capped() -> None:
    assert c.summary_request([user("x")], reserve=100_000).max_tokens == c.MAX_SUMMARY_TOKENS


def test_iterative_update_merges_previous_summary_and_file_lists() -> None:
    first = c.summary_request([user("a"), assistant("", ToolCall("1", "read", {"path": "a.py"}))])
    summary1 = c.finish_summary("## Goal\nA", first.read_files, first.modified_files)
    assert summary1 == "## Goal\nA\n\n<read-files>\na.py\n</read-files>"
    head = c.summary_message(summary1)
    assert c.previous_summary(head) == summary1
    assert c.previous_summary(user("hello")) is None

    new = [assistant("", ToolCall("2", "write", {"path": "a.py"}), ToolCall("3", "read", {"path": "b.py"}))]
    second = c.summary_request(new, c.previous_summary(head))
    text = second.request.messages[0].text
    assert f"<previous-summary>\n{summary1}\n</previous-summary>" in text
    assert c.UPDATE_PROMPT in text and c.SUMMARY_PROMPT not in text
    assert second.read_files == ("b.py",) and second.modified_files == ("a.py",)
    # the model echoing stale lists does not duplicate them
    merged = c.finish_summary(
        "## Goal\nA and B\n<read-files>\na.py\n</read-files>", second.read_files, second.modified_files
    )
    assert (
        merged
        == "## Goal\nA and B\n\n<read-files>\nb.py\n</read-files>\n\n<modified-files>\na.py\n</modified-files>"
    )


def test_split_turn_prefix_in_request() -> None:
    call = ToolCall("a", "exec", {"cmd": "ls"})
    msgs = [user("old"), assistant("done"), user(tokens(10)), assistant("", call), result(call, tokens(9000)),
            assistant(tokens(10))]  # fmt: skip
    cut = c.cut_point(msgs, keep_recent_tokens=8000)
    assert cut is not None and cut.split_turn
    req = c.summary_request(msgs[: cut.turn_start], turn_prefix=msgs[cut.turn_start : cut.index])
    text = req.request.messages[0].text
    assert "<conversation>\n[User]: old\n\n[Assistant]: done\n</conversation>" in text
    assert "<turn-prefix>\n[User]: " in text and "## Turn Context (split turn)" in text


def test_rebaseline_head() -> None:
    kept = [user("next"), assistant("ok")]
    base = c.rebaseline("new system", "S", kept)
    assert base.system == "new system"
    assert base.messages[0] == c.summary_message("S") and base.messages[1:] == kept
    assert base.first_kept == 1
    with pytest.raises(ValueError):
        c.rebaseline("s", "S", [ChatMessage("tool", "x", tool_use_id="1")])


def test_tool_result_excerpt_boundary() -> None:
    call = ToolCall("a", "exec", {})
    exact = c.serialize([result(call, "z" * c.TOOL_RESULT_EXCERPT_CHARS)])
    assert exact == "[Tool result]: " + "z" * c.TOOL_RESULT_EXCERPT_CHARS
    over = c.serialize([result(call, "z" * (c.TOOL_RESULT_EXCERPT_CHARS + 1))])
    assert over.endswith("\n[... 1 more characters]")
