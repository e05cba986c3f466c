"""``chat_request_view`` on any message list: a fixed point that renders as the raw request does."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.openai import chat_request_view, read_usage
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.request import final_assistant

TEXT = st.text(st.sampled_from("ab é\n{}\"'✓"), max_size=6)
CONTENT = st.one_of(
    st.none(), TEXT, st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), max_size=2)
)
ARGS = st.one_of(
    st.dictionaries(st.sampled_from(["a", "é", "path"]), TEXT, max_size=2).flatmap(
        lambda d: st.sampled_from(
            [json.dumps(d), json.dumps(d, ensure_ascii=False), json.dumps(d, separators=(",", ":"))]
        )
    ),
    st.sampled_from(["{", "[1]", ""]),  # not a JSON object: kept as sent
)


@st.composite
def messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "user", "content": draw(TEXT)}]
    for k in range(draw(st.integers(0, 4))):
        role = draw(st.sampled_from(["user", "assistant", "tool", "system"]))
        m: dict[str, Any] = {"role": role, "content": draw(CONTENT)}
        if role == "assistant" and draw(st.booleans()):
            fn = {"name": "f", "arguments": draw(ARGS)}
            m["tool_calls"] = [{"id": f"c{k}", "type": "function", "function": fn}]
        if role == "tool":
            m["tool_call_id"] = f"c{k}"
        if role == "user" and m["content"] is None:
            m["content"] = ""
        out.append(m)
    return out


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"function": {"name": "g", "strict": True, "extra": 1}, "other": 2},
]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return load_renderer()


def _tokens(renderer: Renderer, msgs: list[dict[str, Any]], tools: Any) -> list[int] | str:
    try:
        return renderer.render(msgs, tools).tokens
    except Exception as e:  # noqa: BLE001 - the two sides must fail alike
        return type(e).__name__


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages(), st.sampled_from([None, TOOLS]), st.booleans())
def test_request_view_is_a_fixed_point_that_renders_as_sent(
    renderer: Renderer, msgs: list[dict[str, Any]], tools: Any, cont: bool
) -> None:
    snapshot = json.dumps(msgs)
    view = chat_request_view(msgs, tools, None, cont)
    assert chat_request_view(*view, None, cont) == view
    assert json.dumps(msgs) == snapshot  # the input is not modified
    raw = msgs if cont else final_assistant(msgs)[0]  # continue_final: SessionCore drops it
    assert _tokens(renderer, view[0], view[1]) == _tokens(renderer, raw, tools)


def test_read_usage_fills_cached_tokens() -> None:
    data: dict[str, Any] = {"usage": {"prompt_tokens": 7}}
    assert read_usage(data, 3) == (7, 0)
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert read_usage({}, 3) == (3, 0)
