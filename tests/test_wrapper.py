"""The conversation wrapper: policy -> render -> token-exact directives against the last prompt."""

from __future__ import annotations

import difflib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_data import traces_dir

from leyline_agent import ConversationWrapper, Directive, Mode
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.diff import (
    _MAX_REPLACED,
    _index_aligned,
    align_messages,
    diff_rendered,
    diff_tokens,
)
from leyline_agent.directive import apply_directives
from leyline_agent.policies import Conversation, Edit, parse_policy
from leyline_agent.traces import Trace, load
from leyline_agent.wrapper import TurnPlan

POLICIES = [
    "none",
    "stale_tool_outputs",
    "stale_tool_outputs:keep_last=0",
    "token_budget:max_tokens=2500",
    "observation_window:n=2",
    r'redact:patterns=["bash-\\$","[0-9]{3,}"]',
]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return load_renderer()


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return load(traces_dir())


def tool_turn(i: int, output: str) -> list[dict]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": f"step {i}", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": output},
    ]


def conversation(steps: int) -> list[dict]:
    messages = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for i in range(steps):
        messages += tool_turn(i, f"output {i}\n" + "line of text\n" * (5 + i))
    return messages


def check_exact(old: list[int], plan: TurnPlan) -> None:
    assert plan.base_len + plan.dropped == len(old)
    assert apply_directives(old[: plan.base_len], plan.directives) + plan.tail == plan.tokens


def run(wrapper: ConversationWrapper, messages: list[dict], tools: list | None = None) -> TurnPlan:
    old = list(wrapper.tokens)
    plan = wrapper.plan(messages, tools)
    check_exact(old, plan)
    wrapper.commit(plan)
    return plan


def test_first_turn_is_all_tail(renderer: Renderer) -> None:
    w = ConversationWrapper(renderer)
    plan = run(w, conversation(1))
    assert (
        plan.directives == []
        and plan.tail == plan.tokens == renderer.render(conversation(1)).tokens
    )
    assert w.tokens == plan.tokens and plan.base_len == 0 and not plan.fallback


def test_append_only_needs_no_directive(renderer: Renderer) -> None:
    w = ConversationWrapper(renderer)
    first = run(w, conversation(1))
    second = run(w, conversation(2))
    assert second.directives == []
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert second.tail == second.tokens[len(first.tokens) :]
    assert second.reused == len(first.tokens)


def directive_text(renderer: Renderer, old: list[int], d: Directive) -> tuple[str, str]:
    return renderer.decode(old[d.start : d.end]), renderer.decode(d.replacement)


def test_stub_touches_only_the_stubbed_output(renderer: Renderer) -> None:
    w = ConversationWrapper(renderer, "stale_tool_outputs:keep_last=2")
    run(w, conversation(2))
    old, old_spans = list(w.tokens), w._last.spans  # noqa: SLF001
    plan = run(w, conversation(3))
    assert [e.index for e in plan.edits] == [3]
    assert len(plan.directives) == 1
    d = plan.directives[0]
    s, e = old_spans[3]  # the first tool output
    assert s <= d.start < d.end <= e
    removed, added = directive_text(renderer, old, d)
    assert "line of text" in removed and "evicted: 1 old tool outputs" in added
    assert d.mode is Mode.AMORTIZE
    assert old[d.start] != d.replacement[0] and old[d.end - 1] != d.replacement[-1]  # trimmed
    assert plan.messages[3]["content"] == "[evicted: 1 old tool outputs]"


def test_redact_is_forget_and_agent_change_gets_default_mode(renderer: Renderer) -> None:
    msgs = conversation(2)
    w = ConversationWrapper(renderer, default_mode=Mode.FORGET)
    run(w, msgs)
    w.policy = parse_policy(r"redact:patterns=output \d")
    edited = conversation(3)
    edited[0] = {"role": "system", "content": "You are a careful agent. Tests: 3 failed."}
    plan = run(w, edited)
    assert [d.mode for d in plan.directives] == [Mode.FORGET] * 3  # system, two old outputs
    w2 = ConversationWrapper(renderer)
    run(w2, msgs)
    w2_old = list(w2.tokens)
    w2.policy = parse_policy(r"redact:patterns=output \d")
    plan2 = run(w2, edited)
    assert [d.mode for d in plan2.directives] == [Mode.AMORTIZE, Mode.FORGET, Mode.FORGET]
    removed, added = directive_text(renderer, w2_old, plan2.directives[0])
    assert removed == "" and added == " Tests: 3 failed."  # inserted; the rest is kept


def test_system_rewrite_every_turn_plus_stubs(renderer: Renderer) -> None:
    # debug-gym's default prompt embeds the latest test output in message 0 on every turn.
    w = ConversationWrapper(renderer, "stale_tool_outputs:keep_last=1")
    for step in range(1, 5):
        msgs = conversation(step)
        msgs[0] = {"role": "system", "content": f"Agent. Last eval: {step} failed."}
        old = list(w.tokens)
        plan = run(w, msgs)
        if step == 1:
            continue
        assert len(plan.directives) == 2  # the system digit, the newly stale output
        sys_d = plan.directives[0]
        assert directive_text(renderer, old, sys_d) == (str(step - 1), str(step))
        assert not plan.fallback


def test_removed_message_and_several_edits(renderer: Renderer) -> None:
    class DropAndStub:
        def __call__(self, c: Conversation) -> list[Edit]:
            if c.turn == 0:
                return []
            return [
                Edit(index=3, replacement="short"),
                Edit(index=5, replacement=None, mode=Mode.FORGET),
                Edit(index=4, span=(0, 4), replacement="STEP"),
            ]

    w = ConversationWrapper(renderer, DropAndStub())
    run(w, conversation(3))
    old_spans = w._last.spans  # noqa: SLF001
    plan = run(w, conversation(4))
    assert len(plan.messages) == len(conversation(4)) - 1
    # Messages 3..5 are one changed region (a message dropped): each part of it that differs is
    # its own directive (the tokens between them kept), all of the region's strongest mode.
    assert 1 <= len(plan.directives) <= 3
    for d in plan.directives:
        assert old_spans[3][0] <= d.start and d.end <= old_spans[5][1]
        assert d.mode is Mode.FORGET


def test_unstable_template_falls_back_exactly(renderer: Renderer) -> None:
    # A template that re-renders earlier messages: it numbers them from the end.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ messages|length - loop.index0 }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    unstable = Renderer(renderer.tokenizer, template, source="unstable")
    w = ConversationWrapper(unstable)
    first = run(w, conversation(1))
    assert not first.fallback
    old = list(w.tokens)
    plan = run(w, conversation(2))  # 4 -> 6 messages: every header number changes
    assert plan.fallback
    for i, d in enumerate(plan.directives[:3]):  # each a one-token directive on its number
        assert directive_text(unstable, old, d) == (str(4 - i), str(6 - i))
    w = ConversationWrapper(unstable, "stale_tool_outputs:keep_last=1")
    assert [run(w, conversation(s)).fallback for s in (1, 2, 3)] == [False, True, True]


def test_unstable_closing_template(renderer: Renderer) -> None:
    # Closes the tool block only after the last message (like Qwen's consecutive tool outputs);
    # a turn that appends a second tool output reopens a block the old prompt closed.
    w = ConversationWrapper(renderer)
    msgs = conversation(1)
    run(w, msgs)
    extra = {"role": "tool", "tool_call_id": "c0", "content": "second output"}
    plan = run(w, [*msgs, extra])
    assert plan.fallback
    assert len(plan.directives) == 1


def test_server_held_reply_tokens(renderer: Renderer) -> None:
    # The server also holds the reply it generated after the prompt; the next turn's list
    # contains that reply as an assistant message, so nothing needs editing.
    w = ConversationWrapper(renderer)
    first = run(w, conversation(1))
    nxt = conversation(2)
    with_reply = renderer.render(nxt[:5], add_generation_prompt=False).text
    prompt_text = renderer.decode(first.tokens)
    assert with_reply.startswith(prompt_text)
    reply = renderer.encode(with_reply[len(prompt_text) :])
    w.tokens = first.tokens + reply
    plan = w.plan(nxt)
    check_exact(w.tokens, plan)
    assert plan.directives == [] and plan.reused == len(first.tokens) + len(reply)


def test_commit_checks_the_base(renderer: Renderer) -> None:
    w = ConversationWrapper(renderer)
    stale = w.plan(conversation(1))
    w.commit(w.plan(conversation(1)))
    with pytest.raises(ValueError, match="plan was made against 0 tokens"):
        w.commit(stale)
    w.reset()
    assert w.tokens == [] and w.plan(conversation(1)).tail == stale.tokens


def test_diff_tokens() -> None:
    assert diff_tokens([1, 2], [1, 2, 3]) == ([], [3], False)
    d = diff_tokens([1, 2, 5, 6], [1, 2, 3], Mode.FORGET)
    assert d.directives == [Directive(start=2, end=4, mode=Mode.FORGET)] and d.fallback
    assert apply_directives([1, 2, 5, 6], d.directives) + d.tail == [1, 2, 3]


def test_diff_rendered_on_plain_lists(renderer: Renderer) -> None:
    old_msgs, new_msgs = conversation(2), conversation(3)
    new_msgs[3] = {**new_msgs[3], "content": "gone"}
    old, new = renderer.render(old_msgs), renderer.render(new_msgs)
    d = diff_rendered(old_msgs, old.tokens, new_msgs, new, old_spans=old.spans)
    assert len(d.directives) == 1 and not d.fallback
    assert apply_directives(old.tokens, d.directives) + d.tail == new.tokens


# --- every turn of every shared trace ---------------------------------------------------------


def changed_old_spans(prev: TurnPlan, plan: TurnPlan) -> list[tuple[int, int]]:
    """Old spans of messages whose edited content changed (traces only append messages)."""
    return [
        prev.spans[i]
        for i, m in enumerate(prev.messages)
        if i >= len(plan.messages) or plan.messages[i] != m
    ]


def replay(renderer: Renderer, trace: Trace, policy: str) -> tuple[int, int]:
    w = ConversationWrapper(renderer, policy)
    prev, edited, directives = None, 0, 0
    for messages in trace.turns:
        old = list(w.tokens)
        plan = w.plan(messages, trace.tools)
        check_exact(old, plan)
        assert not plan.fallback
        if prev is not None:
            allowed = changed_old_spans(prev, plan)
            for d in plan.directives:
                assert any(s <= d.start and d.end <= e for s, e in allowed), (d, allowed)
                if d.removed and d.replacement:  # token-minimal: ends differ
                    assert old[d.start] != d.replacement[0]
                    assert old[d.end - 1] != d.replacement[-1]
        if policy == "none":
            assert plan.directives == [] and plan.messages == [
                {k: v for k, v in m.items() if not k.startswith("leyline_")} for m in messages
            ]
        edited += bool(plan.directives)
        directives += len(plan.directives)
        w.commit(plan)
        prev = plan
    return edited, directives


@pytest.mark.parametrize("policy", POLICIES)
def test_every_trace_turn_is_exact(renderer: Renderer, traces: list[Trace], policy: str) -> None:
    edited = sum(replay(renderer, t, policy)[0] for t in traces)
    if policy in ("stale_tool_outputs", "observation_window:n=2"):
        assert edited > 0  # the traces are long enough for these to evict something


policy_specs = st.one_of(
    st.just("none"),
    st.integers(0, 4).map(lambda k: f"stale_tool_outputs:keep_last={k}"),
    st.integers(0, 12000).map(lambda n: f"token_budget:max_tokens={n}"),
    st.integers(0, 4).map(lambda n: f"observation_window:n={n}"),
    st.sampled_from(["bash", "[0-9]+", r"\.py", "Current directory"]).map(
        lambda p: f"redact:patterns={json.dumps([p])}"
    ),
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), policy=policy_specs)
def test_trace_property(
    renderer: Renderer, traces: list[Trace], data: st.DataObject, policy: str
) -> None:
    trace = data.draw(st.sampled_from(traces), label="trace")
    replay(renderer, trace, policy)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.integers(1, 5),
    rewrites=st.lists(st.tuples(st.integers(0, 30), st.text("ab \n", max_size=6)), max_size=4),
    drops=st.sets(st.integers(0, 30), max_size=2),
)
def test_random_agent_edits_are_exact(
    renderer: Renderer, steps: int, rewrites: list[tuple[int, str]], drops: set[int]
) -> None:
    # The agent itself rewrites/drops arbitrary earlier messages between turns.
    w = ConversationWrapper(renderer)
    run(w, conversation(steps))
    msgs = conversation(steps + 1)
    for i, text in rewrites:
        if i < len(msgs):
            msgs[i] = {**msgs[i], "content": msgs[i]["content"] + text}
    msgs = [m for i, m in enumerate(msgs) if i not in drops or i == 0]
    plan = run(w, msgs)
    assert all(d.mode is Mode.AMORTIZE for d in plan.directives)


def test_template_edits_to_several_messages_stay_apart_whatever_the_spans(
    renderer: Renderer,
) -> None:
    """Three small deletions in three messages the messages do not explain (a template dropping
    think blocks once a follow-up comes) are three directives, also when the new spans fall
    wrongly (every inner boundary shifted), and also when the run is too big to match as one
    (then region by region)."""
    from leyline_agent import token_changes as diff_module
    from leyline_agent.chat.spans import Rendered

    msgs = conversation(3)
    old = renderer.render(msgs)
    cuts = [(s + 2, s + 7) for s, _ in (old.spans[2], old.spans[4], old.spans[6])]
    tokens = list(old.tokens)
    for s, e in reversed(cuts):
        del tokens[s:e]

    def moved(p: int) -> int:
        return p - sum(min(e, p) - s for s, e in cuts if s < p)

    exact = [(moved(s), moved(e)) for s, e in old.spans]  # the new tokens' true spans
    shifted = [(s + 3 * (k > 0), e + 3 * (k < len(exact) - 1)) for k, (s, e) in enumerate(exact)]
    for spans in (shifted, exact):
        new = Rendered(tokens, spans)
        d = diff_rendered(msgs, old, msgs, new)
        assert [(x.start, x.end, x.replacement) for x in d.directives] == [
            (s, e, ()) for s, e in cuts
        ]
        assert apply_directives(old.tokens, d.directives) + d.tail == tokens and d.fallback
    small = diff_module.MAX_CELLS
    try:
        diff_module.MAX_CELLS = 16
        d = diff_rendered(msgs, old, msgs, Rendered(tokens, exact))
        assert [(x.start, x.end) for x in d.directives] == cuts
        d = diff_rendered(msgs, old, msgs, Rendered(tokens, shifted))  # exact, if not minimal
        assert apply_directives(old.tokens, d.directives) + d.tail == tokens
    finally:
        diff_module.MAX_CELLS = small


@pytest.mark.parametrize(
    ("policy", "renders"),
    [
        ("none", [6]),
        ("stale_tool_outputs:keep_last=1", [6]),
        ("token_budget:max_tokens=50", [6, 6]),
    ],
)
def test_incoming_list_is_rendered_only_when_sent_or_counted(
    renderer: Renderer, policy: str, renders: list[int]
) -> None:
    """A policy that edits without reading token counts (stale_tool_outputs) costs one render,
    of the edited list; one that reads them (token_budget) also renders the incoming list."""
    w = ConversationWrapper(renderer, policy)
    inner, rendered = w._render, []
    w._render = lambda m, t=None: rendered.append(len(m)) or inner(m, t)  # type: ignore[method-assign]
    plan = w.plan(conversation(2))
    assert rendered == renders
    assert plan.tokens == renderer.render(plan.messages).tokens
    assert (plan.edits != []) == (policy != "none")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9), max_size=14),
    st.sets(st.integers(0, 14), max_size=10),
    st.integers(0, 9),
    st.lists(st.integers(0, 9), max_size=4),
    st.booleans(),
)
def test_align_messages_without_difflib(old, ats, key, appended, distinct) -> None:
    """A list that keeps the old messages at their indices but for a few (stubbed outputs, a
    rewritten first message), then appends, is aligned without difflib: with distinct keys the
    opcodes are difflib's, with any keys they are a valid alignment keeping the others."""
    if distinct:
        old = [("m", i) for i in range(len(old))]
        appended = [("new", i) for i in range(len(appended))]
    new = list(old)
    for at in ats:
        if at < len(old):
            new[at] = ("changed", at) if distinct else key
    new += appended
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b]
    assert (_index_aligned(old, new) is not None) == (
        len(changed) <= _MAX_REPLACED and len(old) - 1 not in changed
    )
    got = align_messages([{}] * len(old), [{}] * len(new), old, new)
    i = j = 0
    for tag, i1, i2, j1, j2 in got:
        assert (i1, j1) == (i, j) and tag in ("equal", "replace", "delete", "insert")
        if tag == "equal":
            assert old[i1:i2] == new[j1:j2]
        i, j = i2, j2
    assert (i, j) == (len(old), len(new))
    if distinct:
        ref = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        if ref and ref[-1][0] == "replace" and ref[-1][2] == len(old):
            tag, i1, i2, j1, j2 = ref.pop()
            ref.append(("replace", i1, i2, j1, j1 + min(i2 - i1, j2 - j1)))
            if j1 + min(i2 - i1, j2 - j1) < j2:
                ref.append(("insert", i2, i2, j1 + min(i2 - i1, j2 - j1), j2))
        assert got == ref
