"""``clear_tool_uses`` (Anthropic's ``clear_tool_uses_20250919`` as a policy): trigger, keep,
exclude_tools, clear_at_least, and once cleared stays cleared."""

from __future__ import annotations

from typing import Any

from leyline_agent.policies import ClearToolUses, Conversation, Edit, apply_edits, parse_policy
from leyline_agent.policies.clear_tool_uses import PLACEHOLDER


def loop(steps: int, names: tuple[str, ...] = ("read_file",)) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "fix it"}]
    for s in range(steps):
        name = names[s % len(names)]
        call = {"id": f"c{s}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{s}", "content": f"output {s} " * 20})
    return msgs


def run(policy: ClearToolUses, msgs: list[dict[str, Any]], previous: list[Edit] | None = None):
    counts = [40 if m["role"] == "tool" else 5 for m in msgs]
    return policy(Conversation(msgs, counts, previous=previous or []))


def cleared(edits: list[Edit]) -> list[int]:
    return [e.index for e in edits]


def test_all_but_the_last_keep_results_past_the_trigger() -> None:
    msgs = loop(4)  # tool results at 2, 4, 6, 8; 4 x 40 + 5 x 5 = 185 tokens
    assert run(ClearToolUses(trigger_tokens=186, keep=1), msgs) == []
    edits = run(ClearToolUses(trigger_tokens=185, keep=1), msgs)
    assert cleared(edits) == [2, 4, 6]
    assert all(e.replacement == PLACEHOLDER and e.mode.value == "amortize" for e in edits)
    out = apply_edits(msgs, edits).messages
    assert [m["content"] for m in out if m["role"] == "tool"][-1] == msgs[8]["content"]
    assert (
        parse_policy("clear_tool_uses:trigger_tokens=0,keep=2")(
            Conversation(msgs, [40] * len(msgs))
        )[-1].index
        == 4
    )


def test_excluded_tools_and_clear_at_least() -> None:
    msgs = loop(4, names=("read_file", "memory"))  # c1 and c3 are memory
    assert cleared(
        run(ClearToolUses(trigger_tokens=0, keep=0, exclude_tools=("memory",)), msgs)
    ) == [2, 6]
    assert run(ClearToolUses(trigger_tokens=0, keep=3, clear_at_least=41), msgs) == []  # frees 40
    assert cleared(run(ClearToolUses(trigger_tokens=0, keep=2, clear_at_least=80), msgs)) == [2, 4]


def test_once_cleared_stays_cleared() -> None:
    policy = ClearToolUses(trigger_tokens=185, keep=1)
    first = run(policy, loop(4))
    # the agent drops its last step: under the trigger now, but what was cleared stays cleared
    again = run(policy, loop(3), previous=first)
    assert cleared(again) == [2, 4, 6] and cleared(run(policy, loop(3))) == []
