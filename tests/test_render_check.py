"""Which turns ask the backend for the prompt token ids (``chat_turn.render_check``): the first,
every ``CHECK_EVERY``-th, one with template variables, and those after a disagreement; the others
check the answer's prompt length only.

The backend's answers here are fakes built from the plan (the decision is made before any
request; the live parity tests, ``test_render_parity.py``, run it against a real server)."""

from __future__ import annotations

from typing import Any

import pytest

from leyline_agent import chat_turn
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.client import LeylineClient
from leyline_agent.session import SessionCore
from leyline_agent.wrapper import ConversationWrapper


@pytest.fixture(scope="module")
def renderer() -> Any:
    return load_renderer()


@pytest.fixture(autouse=True)
def check_every(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (the test session checks every turn: ``conftest.py``)."""
    monkeypatch.setattr(chat_turn, "CHECK_EVERY", 16)


def test_check_every_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEYLINE_RENDER_CHECK_EVERY", "3")
    assert chat_turn._check_every() == 3
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("LEYLINE_RENDER_CHECK_EVERY", bad)
        with pytest.raises(ValueError, match="LEYLINE_RENDER_CHECK_EVERY must be an integer"):
            chat_turn._check_every()


def new_core(renderer: Any) -> SessionCore:
    # NOTE: policy none and appended turns only: no splice is ever sent to this address.
    return SessionCore(LeylineClient("http://127.0.0.1:9"), ConversationWrapper(renderer, "none"))


def body(turn: int, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"question {t}"})
        if t < turn:
            messages.append({"role": "assistant", "content": f"answer {t}"})
    return {"model": "default", "messages": messages, "max_tokens": 1, **extra}


def fake_answer(ct: chat_turn.ChatTurn, prompt: int | None = None) -> dict[str, Any]:
    """What SGLang answers for the turn's prompt: the plan's ids where asked (fake)."""
    tokens = ct.pending.plan.tokens
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "a"}}
    if ct.body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = list(tokens)
    usage = {"prompt_tokens": len(tokens) if prompt is None else prompt, "completion_tokens": 1}
    return {"choices": [choice], "usage": usage}


def run_turn(core: SessionCore, b: dict[str, Any], prompt: int | None = None) -> tuple[bool, Any]:
    ct = chat_turn.prepare(core, b)
    asked = bool(ct.body.get("return_prompt_token_ids"))
    data = fake_answer(ct, prompt)
    record = chat_turn.complete(core, ct, data, request_ms=1.0, prompt_ids=ct.prompt_ids(data))
    return asked, record


def test_ids_asked_on_the_first_turn_then_every_nth_with_a_fake_backend(renderer: Any) -> None:
    core = new_core(renderer)
    asked = [run_turn(core, body(t))[0] for t in range(2 * chat_turn.CHECK_EVERY + 1)]
    expected = [t % chat_turn.CHECK_EVERY == 0 for t in range(2 * chat_turn.CHECK_EVERY + 1)]
    assert asked == expected
    assert not any(r.render_mismatch for r in core.records)


def test_ids_asked_after_a_length_disagreement_with_a_fake_backend(renderer: Any) -> None:
    core = new_core(renderer)
    assert run_turn(core, body(0))[0]
    asked, record = run_turn(core, body(1), prompt=3)  # the backend's prompt is another length
    assert not asked and record.render_mismatch and core.wrapper.tokens == []
    asked, record = run_turn(core, body(2))  # tokens unknown: checked again
    assert asked and not record.render_mismatch
    assert not run_turn(core, body(3))[0]


def test_ids_asked_with_template_variables_or_by_the_client_with_a_fake_backend(
    renderer: Any,
) -> None:
    core = new_core(renderer)
    run_turn(core, body(0))
    assert run_turn(core, body(1, chat_template_kwargs={"enable_thinking": False}))[0]
    ct = chat_turn.prepare(core, body(2, return_prompt_token_ids=True))
    data = fake_answer(ct)
    assert ct.body["return_prompt_token_ids"] and ct.prompt_ids(data) == ct.pending.plan.tokens
    assert "prompt_token_ids" in data["choices"][0]  # the client asked: kept in its answer


def test_streamed_turns_ask_in_the_stream_on_the_same_turns(renderer: Any) -> None:
    core = new_core(renderer)
    first = chat_turn.prepare(core, body(0, stream=True))
    assert first.body["return_input_ids_in_sglext"] is True
    assert first.body["stream_options"] == {"include_usage": True}
    run_turn(core, body(0))  # the turn answered (not streamed here)
    second = chat_turn.prepare(core, body(1, stream=True))
    assert "return_input_ids_in_sglext" not in second.body
    assert second.body["stream_options"] == {"include_usage": True}
