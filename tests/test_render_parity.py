"""Render parity with the backend and a session state that follows the cache (issue 12).

Against the real server (``leyline_server``) through the proxy: every shape of message list the
chat API accepts either renders to exactly the backend's prompt token ids (``render_mismatch``
False: the proxy compares ids, not lengths) or is refused with a 400 before any splice; a
mismatch is adopted (resync); a splice that ran is the session's state even when the client
disconnects; a generation prompt the next list does not follow is a plain prefix hit. The
template-kwargs case is checked in-process against transformers (what SGLang renders with).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_proxy import TOOLS, agent_conversation, new_id, serve_proxy, session_detail

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.request import final_assistant, template_kwargs
from leyline_agent.embedded.model import default_model_dir
from leyline_agent.wrapper import ConversationWrapper

SYS = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 2 + 2?"}
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
}


def _effort_template() -> str:
    """The embedded template, but the default system prompt reads ``reasoning_effort``: " high"
    replaces " helpful" (one token for one: equal length, differing from token 6)."""
    config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    old = "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    new = (
        "{{- '<|im_start|>system\\nYou are a ' + (reasoning_effort if reasoning_effort is "
        "defined else 'helpful') + ' assistant.<|im_end|>\\n' }}"
    )
    assert config["chat_template"].count(old) == 1
    return config["chat_template"].replace(old, new)


@pytest.fixture(scope="module")
def effort_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the embedded tokenizer directory with ``_effort_template``."""
    out = tmp_path_factory.mktemp("effort-model")
    for f in default_model_dir().iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = _effort_template()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def proxy(leyline_server: str) -> Iterator[str]:
    with serve_proxy(leyline_server, "none") as url:
        yield url


def post(proxy: str, sid: str, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    payload = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0, **body}
    return httpx.post(
        proxy + "/v1/chat/completions",
        json=payload,
        headers={"X-Leyline-Session": sid},
        timeout=300,
    )


def last_record(proxy: str, sid: str) -> dict[str, Any]:
    return session_detail(proxy, sid)["records"][-1]


def backend_ids(server: str, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    payload = {"model": "default", "messages": messages, "max_tokens": 1, **body}
    r = httpx.post(
        server + "/v1/chat/completions",
        json={**payload, "return_prompt_token_ids": True},
        timeout=300,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["prompt_token_ids"]


# --- kind 1: the wrapper renders the backend's tokens, or notices -------------------------------


@pytest.mark.parametrize(
    ("name", "messages", "extra", "prompt"),
    [
        # SGLang renders a trailing assistant message as a user turn (same length as an
        # assistant turn: only a length check missed it).
        ("trailing_assistant", [USER, {"role": "assistant", "content": "4."}], {}, 34),
        # ... continue_final_message: without it, its text after the generation prompt.
        (
            "continue_final",
            [USER, {"role": "assistant", "content": "The answer is"}],
            {"continue_final_message": True},
            30,
        ),
        # ... a trailing tool call with content null: a user turn with "" (calls dropped).
        ("trailing_tool_call", [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}], {}, 32),
        ("names", [{**SYS, "name": "s"}, {**USER, "name": "u"}], {}, 25),
        (
            "parts",
            [
                {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "terse."}]},
                {"role": "user", "content": [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Now."}]},
            ],
            {},
            22,
        ),
        (
            "tool_list_content",
            [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x = 1"}, {"type": "text", "text": "y"}]},
            ],
            {},
            77,
        ),
        ("n_2", [SYS, USER], {"n": 2}, 25),
        ("max_completion_tokens", [SYS, USER], {"max_completion_tokens": 2}, 25),
    ],
)  # fmt: skip
def test_rendered_ids_equal_the_backends(
    proxy: str, leyline_server: str, name: str, messages: list, extra: dict, prompt: int
) -> None:
    sid = new_id(f"parity-{name}")
    r = post(proxy, sid, messages, **extra)
    assert r.status_code == 200, r.text
    data = r.json()
    assert all("prompt_token_ids" not in c for c in data["choices"])  # asked for, then stripped
    assert len(data["choices"]) == extra.get("n", 1)
    rec = last_record(proxy, sid)
    assert (rec["prompt_tokens"], rec["render_mismatch"], rec["resynced"]) == (prompt, False, False)
    assert len(backend_ids(leyline_server, messages, **extra)) == prompt


def test_trailing_assistant_then_next_turn_splices(proxy: str) -> None:
    """The cache holds the trailing assistant as a user turn; the next turn (where it is an
    assistant turn) is an edit the splice executes (it got 409 when the wrapper held an
    assistant turn of the same length)."""
    sid = new_id("parity-trailing-next")
    first = [SYS, USER, {"role": "assistant", "content": "4."}]
    assert post(proxy, sid, first).status_code == 200
    r = post(proxy, sid, [*first, {"role": "user", "content": "And 3 + 3?"}])
    assert r.status_code == 200
    rec = last_record(proxy, sid)
    assert (rec["edited"], rec["spliced"], rec["splice_error"]) == (True, True, None)
    assert (rec["prompt_tokens"], rec["render_mismatch"]) == (44, False)


def test_stream_reads_ids_from_sglext_and_strips_them(proxy: str) -> None:
    sid = new_id("parity-stream")
    body = {"stream": True, "max_tokens": 2, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST",
        proxy + "/v1/chat/completions",
        json={"model": "default", "messages": [SYS, USER], **body},
        headers={"X-Leyline-Session": sid},
        timeout=300,
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert not any("input_ids" in line and '"input_ids":null' not in line for line in lines)
    rec = last_record(proxy, sid)
    assert (rec["prompt_tokens"], rec["render_mismatch"], rec["resynced"]) == (25, False, False)


@pytest.mark.parametrize(
    ("messages", "extra", "message"),
    [
        ([{"role": "function", "name": "f", "content": "x"}, USER], {}, "unsupported message role: function"),
        ([{"role": "user"}], {}, "a user message needs 'content'"),
        ([{"role": "bogus", "content": "x"}], {}, "'role' must be one of"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{bad"}}]}, USER],
            {},
            "Assistant tool call function.arguments must be valid JSON.",
        ),
        ([USER], {"n": 0}, "'n' must be an integer >= 1"),
        ([USER], {"max_completion_tokens": 200000}, "You requested a total of 200027 tokens"),
    ],
)  # fmt: skip
def test_refused_before_any_splice_in_the_backends_format(
    proxy: str, leyline_server: str, messages: list, extra: dict, message: str
) -> None:
    sid = new_id("parity-refused")
    r = post(proxy, sid, messages, **extra)
    assert r.status_code == 400
    assert r.json()["object"] == "error" and message in r.json()["message"]
    backend = httpx.post(
        leyline_server + "/v1/chat/completions",
        json={"model": "default", "messages": messages, "max_tokens": 1, **extra},
        timeout=300,
    )
    assert backend.status_code == 400  # the backend refuses it too
    assert httpx.get(f"{proxy}/leyline/sessions", timeout=10).json()["totals"]["turns"] >= 0
    detail = httpx.get(f"{proxy}/leyline/sessions/{sid}", timeout=10)
    assert detail.status_code == 404 or detail.json()["records"] == []


def test_mismatch_is_adopted_and_counted(leyline_server: str, effort_model: Path) -> None:
    """The proxy's template reads ``reasoning_effort``, the backend's does not: equal length,
    other ids. The proxy adopts the backend's ids, so the next turn's splice hits."""
    with serve_proxy(leyline_server, "none", model_path=effort_model) as proxy:
        sid = new_id("parity-effort")
        first = [USER]
        r = post(proxy, sid, first, reasoning_effort="high")
        assert r.status_code == 200
        rec = last_record(proxy, sid)
        assert (rec["prompt_tokens"], rec["render_mismatch"], rec["resynced"]) == (27, True, True)
        # The reply is dropped and another user turn follows, without the effort: renders as
        # the backend does; the cached prefix (the backend's tokens) is a plain prefix hit.
        r = post(proxy, sid, [*first, {"role": "user", "content": "Again."}])
        assert r.status_code == 200
        rec = last_record(proxy, sid)
        assert (rec["render_mismatch"], rec["edited"], rec["spliced"]) == (False, False, False)
        assert rec["server_cached_tokens"] == 25  # 27 minus the opener's "assistant\n"
        text = httpx.get(proxy + "/metrics", timeout=10).text
        assert "leyline_proxy_render_mismatches_total 1" in text
        assert "leyline_proxy_resyncs_total 1" in text


def test_template_kwargs_render_as_transformers(effort_model: Path) -> None:
    """``chat_template_kwargs`` / ``reasoning_effort`` reach the template as SGLang passes them
    (transformers' ``apply_chat_template(**kwargs)``), through the renderer and the wrapper."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(effort_model))
    renderer = load_renderer(effort_model)
    messages = [USER, {"role": "assistant", "content": "4."}, {"role": "user", "content": "x"}]
    for body in (
        {"reasoning_effort": "high"},
        {"chat_template_kwargs": {"reasoning_effort": "low"}, "reasoning_effort": "high"},
        {"chat_template_kwargs": {"unused": 1}},
    ):
        kwargs = template_kwargs(body)
        ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        ours = renderer.render(messages, template_kwargs=kwargs)
        assert ours.text == ref
        assert ours.tokens == hf.encode(ref, add_special_tokens=False)
        plan = ConversationWrapper(renderer).plan(messages, template_kwargs=kwargs)
        assert plan.tokens == ours.tokens
    effort = renderer.render(messages, template_kwargs={"reasoning_effort": "high"}).tokens
    plain = renderer.render(messages).tokens
    first = next(i for i, (a, b) in enumerate(zip(effort, plain, strict=True)) if a != b)
    assert (len(effort), len(plain), first) == (40, 40, 6)


def test_final_assistant_mirrors_sglang() -> None:
    pytest.importorskip("sglang")
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    for cont in (False, True):
        for last in (
            {"role": "assistant", "content": "x"},
            {"role": "assistant", "content": ""},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            {"role": "user", "content": "x"},
        ):
            req = ChatCompletionRequest(
                model="m", messages=[USER, last], continue_final_message=cont
            )
            ref = OpenAIServingChat._handle_last_assistant_message(None, [USER, dict(last)], req)  # type: ignore[arg-type]
            assert final_assistant([USER, last], cont) == (list(ref[0]), ref[1])


# --- kind 2: the session state follows the cache -------------------------------------------------


def test_disconnect_mid_stream_keeps_the_spliced_state(leyline_server: str, tmp_path: Path) -> None:
    """Turn 3 is spliced (keep_last=1 stubs step 1) and streamed; the client leaves after the
    first ``data:`` line. The turn is recorded (and written), and turn 4's splice hits."""
    turns = agent_conversation(3)
    sid = new_id("parity-disconnect")
    with serve_proxy(
        leyline_server, "stale_tool_outputs:keep_last=1", record_dir=tmp_path
    ) as proxy:
        for messages in turns[:2]:
            r = post(proxy, sid, messages, tools=TOOLS)
            assert r.status_code == 200
        body = {"model": "default", "messages": turns[2], "tools": TOOLS, "max_tokens": 64}
        with httpx.stream(
            "POST",
            proxy + "/v1/chat/completions",
            json={**body, "stream": True},
            headers={"X-Leyline-Session": sid},
            timeout=300,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
        r = post(proxy, sid, turns[3], tools=TOOLS)
        assert r.status_code == 200
        records = session_detail(proxy, sid)["records"]
        assert [(x["spliced"], x["splice_error"], x["error"]) for x in records] == [
            (False, None, None),
            (False, None, None),
            (True, None, "client disconnected"),
            (True, None, None),
        ]
        (path,) = tmp_path.glob("*.jsonl")
        lines = path.read_text().splitlines()
        assert [json.loads(x)["turn"] for x in lines] == [0, 1, 2, 3]


def test_unfollowed_generation_prompt_is_a_prefix_hit(proxy: str) -> None:
    """mini-swe-agent drops an unusable reply: the next list has no assistant message after
    the old generation prompt. No splice, not an edited turn, the prefix before it cached."""
    sid = new_id("parity-opener")
    first = [SYS, USER]
    assert post(proxy, sid, first).status_code == 200
    r = post(proxy, sid, [*first, {"role": "user", "content": "Reply in one word."}])
    assert r.status_code == 200
    a, b = session_detail(proxy, sid)["records"]
    assert (b["edited"], b["spliced"], b["directives_amortize"]) == (False, False, 0)
    assert (a["prompt_tokens"], b["server_cached_tokens"], b["best_reused_tokens"]) == (25, 23, 23)


def test_wrapper_reuses_the_prefix_before_the_opener() -> None:
    renderer: Renderer = load_renderer(None)
    wrapper = ConversationWrapper(renderer)
    first = wrapper.plan([SYS, USER])
    wrapper.commit(first)
    plan = wrapper.plan([SYS, USER, {"role": "user", "content": "Again."}])
    assert (plan.directives, plan.base_len, plan.dropped) == ([], 23, 2)
    assert wrapper.tokens[: plan.base_len] + plan.tail == plan.tokens
    assert plan.tokens[:23] == first.tokens[:23] and plan.tail == plan.tokens[23:]
    wrapper.commit(plan)
    assert wrapper.tokens == plan.tokens
