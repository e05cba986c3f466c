"""Issue 23's case through the real proxy (``--policy none``) and a real ``leyline serve`` whose
model carries a reasoning model's published chat template (Qwen3, GLM-4.5, Kimi-K2-thinking): the
user follow-up after a tool loop drops or empties every earlier think block, and the turn is
spliced at the cost of an exact splice (the think blocks deleted, the tail prefilled), with no
render mismatch on that turn or the next.

A tiny Qwen3-shaped model (dummy weights, the embedded tokenizer) with ``tests/templates/*.jinja``
as its chat template; the conversation is teacher-forced (``max_tokens=1``).

Each family needs a server of its own (the server renders the template), about 1.5 minutes each
on 2 cores: CI runs the issue's given case (``qwen3``); every family's plan is checked without a
server in ``test_reasoning_templates.py``, and ``experiments/agent/reasoning_live.sh`` runs this
module over all of them (``LEYLINE_REASONING_FAMILIES=glm45,kimi_k2_thinking,qwen3``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reasoning import FAMILIES, TOOLS, exact_reuse, session, template
from requires import require_sglang

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.openai import chat_request_view
from leyline_agent.wrapper import ConversationWrapper

pytestmark = [pytest.mark.sglang, pytest.mark.live]


def live_families() -> list[str]:
    """The families to serve: ``$LEYLINE_REASONING_FAMILIES`` (comma-separated), else ``qwen3``.

    Raises:
        ValueError: a name that is not one of ``reasoning.FAMILIES``.
    """
    names = [f for f in os.environ.get("LEYLINE_REASONING_FAMILIES", "qwen3").split(",") if f]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise ValueError(f"LEYLINE_REASONING_FAMILIES: unknown {unknown}; known: {FAMILIES}")
    return names


@pytest.fixture(scope="module", params=live_families())
def thinking_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer
    from leyline_agent.testing.tiny_models import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp(f"{request.param}-thinking"), "qwen3")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = template(request.param)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with EmbeddedServer(model_path=d, max_total_tokens=8192, extra_args=["--dummy"]) as srv:
        yield srv.url, d


def test_follow_up_after_a_tool_loop_splices_the_think_blocks_out(
    thinking_server: tuple[str, Path],
) -> None:
    from test_proxy import new_id, openai_client, serve_proxy, session_detail

    url, model = thinking_server
    turns = session([[1, 1, 1], [1]])  # query, 3 steps, answer + follow-up, one more step
    sid = new_id("thinking")
    with serve_proxy(url, "none", model_path=model) as proxy:
        client = openai_client(proxy, **{"X-Leyline-Session": sid})
        usage = []
        for messages in turns:
            r = client.chat.completions.create(
                model="default", messages=messages, tools=TOOLS, max_tokens=1, temperature=0
            )
            usage.append(r.usage.prompt_tokens)
        detail = session_detail(proxy, sid)
    wrapper = ConversationWrapper(load_renderer(str(model)), "none")
    figures: list[dict[str, Any]] = []
    for t, (messages, rec) in enumerate(zip(turns, detail["records"], strict=True)):
        old = list(wrapper.tokens)
        plan = wrapper.plan(*chat_request_view(messages, TOOLS))
        wrapper.commit(plan)
        exact = exact_reuse(old, plan.tokens)
        figures.append(
            {
                "prompt": rec["prompt_tokens"],
                "prefilled": rec["prefilled_tokens"],
                "exact_prefill": len(plan.tokens) - exact,
                "directives": len(plan.directives),
            }
        )
        assert rec["prompt_tokens"] == len(plan.tokens) == usage[t]
        assert not rec["render_mismatch"], (t, rec)
        assert rec["splice_error"] is None, (t, rec)
        assert rec["reused_tokens"] >= 0.9 * exact, (t, rec, exact)
    print(json.dumps(figures))
    follow_up = detail["records"][4]
    assert follow_up["spliced"] and 3 <= figures[4]["directives"] <= 4  # + the generation prompt
    assert follow_up["prefilled_tokens"] <= figures[4]["exact_prefill"] + 8
