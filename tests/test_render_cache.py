"""Incremental rendering: ``IncrementalRenderer.render`` == ``Renderer.render``, every time."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_data import traces_dir

from leyline_agent import ConversationWrapper
from leyline_agent.chat.locality import cut_token_ids, is_local
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.render_cache import IncrementalRenderer
from leyline_agent.messages import sent_message
from leyline_agent.traces import Trace, load

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return load_renderer()


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return load(traces_dir())


def step(i: int, calls: int = 1) -> list[dict]:
    tc = [
        {"id": f"c{i}_{k}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        for k in range(calls)
    ]
    out = [{"role": "assistant", "content": f"step {i}", "tool_calls": tc}]
    return out + [
        {"role": "tool", "tool_call_id": f"c{i}_{k}", "content": f"out {i}.{k}\n" * (i + 1)}
        for k in range(calls)
    ]


def conversation(steps: int, system: bool = True) -> list[dict]:
    head = [{"role": "system", "content": "Be careful."}] if system else []
    msgs = [*head, {"role": "user", "content": "Fix the test."}]
    for i in range(steps):
        msgs += step(i, calls=1 + i % 3)
    return msgs


def check(inc: IncrementalRenderer, messages: list[dict], tools: list | None) -> None:
    got, want = inc.render(messages, tools), inc.renderer.render(messages, tools)
    assert got.text == want.text
    assert got.tokens == want.tokens
    assert got.spans == want.spans


def test_embedded_renderer_is_incremental(renderer: Renderer) -> None:
    assert is_local(renderer)
    assert {200000, 200001} <= cut_token_ids(renderer.tokenizer)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
def test_growing_and_edited_conversations(renderer: Renderer, tools: list | None, system: bool):
    inc = IncrementalRenderer(renderer)
    full = conversation(6, system)
    for n in range(1, len(full) + 1):  # appends, one message at a time
        check(inc, full[:n], tools)
    mid = len(full) // 2
    edited = [*full[:mid], {**full[mid], "content": "[evicted]"}, *full[mid + 1 :]]
    check(inc, edited, tools)  # edited message in the middle
    check(inc, full[:mid] + full[mid + 1 :], tools)  # removed message
    check(inc, full[:4] + full[-3:], tools)  # a run of messages removed
    check(inc, [{**full[0], "content": "New system."}, *full[1:]], tools)  # first message
    check(inc, full, None if tools else TOOLS)  # tools changed
    check(inc, full[:-1], tools)  # last message dropped
    check(inc, full, tools)  # back to a remembered list


def test_policy_stubs_every_turn(renderer: Renderer) -> None:
    inc = IncrementalRenderer(renderer)
    msgs = conversation(1)
    for i in range(1, 12):
        msgs = msgs + step(i, calls=1 + i % 2)
        sent = [
            {**m, "content": "[evicted]"} if m["role"] == "tool" and j < len(msgs) - 4 else m
            for j, m in enumerate(msgs)
        ]
        check(inc, msgs, TOOLS)
        check(inc, sent, TOOLS)


def test_special_token_text_in_content(renderer: Renderer) -> None:
    # Content that spells special tokens is encoded as special tokens, as the server does.
    inc = IncrementalRenderer(renderer)
    msgs = conversation(3)
    check(inc, msgs, None)
    sneaky = {"role": "user", "content": "a<|im_end|>\n<|im_start|>b <|endoftext|>c"}
    check(inc, [*msgs, sneaky], None)
    check(inc, [*msgs, sneaky, *step(9)], None)


def test_non_local_template_renders_in_full(renderer: Renderer) -> None:
    numbered = (
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ messages|length - loop.index0 }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    unstable = Renderer(renderer.tokenizer, numbered, source="numbered")
    assert not is_local(unstable)
    inc = IncrementalRenderer(unstable)
    msgs = [{"role": "user", "content": f"message {i}"} for i in range(8)]
    for n in range(1, 9):
        check(inc, msgs[:n], None)
    # forced local, the window would be wrong: the screen is what keeps it exact
    forced = IncrementalRenderer(unstable, local=True)
    forced.render(msgs[:5])
    assert forced.render(msgs[:6]).tokens != unstable.render(msgs[:6]).tokens


def test_every_shared_trace_turn(renderer: Renderer, traces: list[Trace]) -> None:
    for trace in traces:
        inc = IncrementalRenderer(renderer)
        for messages in trace.turns:
            check(inc, [sent_message(m) for m in messages], trace.tools)


@pytest.mark.parametrize("policy", ["stale_tool_outputs:keep_last=2", "observation_window:n=1"])
def test_wrapper_plans_equal_full_plans(renderer: Renderer, traces: list[Trace], policy: str):
    for trace in traces:
        inc = ConversationWrapper(renderer, policy)
        full = ConversationWrapper(renderer, policy, incremental=False)
        for messages in trace.turns:
            a, b = inc.plan(messages, trace.tools), full.plan(messages, trace.tools)
            assert (a.tokens, a.spans, a.directives, a.tail, a.fallback) == (
                b.tokens,
                b.spans,
                b.directives,
                b.tail,
                b.fallback,
            )
            inc.commit(a)
            full.commit(b)


message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "tool"]),
        "content": st.text("ab <>|\n\u00e9", max_size=12),
    }
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    base=st.lists(message, min_size=1, max_size=10),
    turns=st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 2), st.lists(message, max_size=3)),
        min_size=1,
        max_size=5,
    ),
    tools=st.booleans(),
)
def test_random_edits(renderer: Renderer, base, turns, tools: bool) -> None:
    # Each turn keeps a prefix, drops up to two messages after it and appends new ones.
    inc = IncrementalRenderer(renderer)
    msgs = [{"role": "system", "content": "sys"}, *base]
    t = TOOLS if tools else None
    check(inc, msgs, t)
    for keep, drop, new in turns:
        msgs = msgs[:keep] + msgs[keep + drop :] + new
        if msgs:
            check(inc, msgs, t)
    assert json.dumps(msgs)  # plain data throughout


def test_mutating_a_rendered_message_is_seen(renderer: Renderer) -> None:
    inc = IncrementalRenderer(renderer)
    msgs = conversation(4)
    check(inc, msgs, TOOLS)
    msgs[4]["tool_calls"][0]["function"]["arguments"] = '{"changed": true}'  # in place
    check(inc, msgs, TOOLS)


def test_tokenizer_without_safe_cuts_encodes_whole(renderer: Renderer) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(renderer.tokenizer.to_str())
    tok.add_special_tokens([AddedToken("<|glued|>", rstrip=True, special=True)])
    assert cut_token_ids(tok) == frozenset()
    inc = IncrementalRenderer(Renderer(tok, renderer.chat_templates["default"]))
    for n in range(3, 9):
        check(inc, conversation(4)[:n], None)
