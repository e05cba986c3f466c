"""SmolLM2-135M-Instruct served for real on CPU (``leyline serve --model smollm2-135m-instruct``,
real weights, float32 on this CPU (no bf16 units), 30 layers, GQA 9/3): it answers, its splices
answer 200 and keep the cache consistent, FORGET equals a fresh prefill. The server is the
session's (``conftest.smollm2_server``), shared with ``test_mini_swe_agent_smollm2.py``."""

from __future__ import annotations

import json

import httpx
import pytest
from live import assert_integrity, ns, stats
from openai import OpenAI

from leyline_agent.client import LeylineClient
from leyline_agent.directive import Directive, Mode
from leyline_agent.testing import model_check

pytestmark = [pytest.mark.sglang, pytest.mark.live]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm2_server: str) -> str:
    """The session's SmolLM2 server (``conftest.smollm2_server``)."""
    return smollm2_server


def _chat_ids(url: str, messages: list[dict[str, str]]) -> list[int]:
    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.models import resolve

    renderer = load_renderer(resolve(MODEL, None))
    return renderer.encode(renderer.render_text(messages))


def test_answers_the_capital_of_france(server: str) -> None:
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    assert "Paris" in (r.choices[0].message.content or "")


def test_amortize_splice_then_the_edited_sequence_is_cached(server: str) -> None:
    messages = [
        {"role": "user", "content": "Read the file notes.txt."},
        {"role": "assistant", "content": "The file says: the meeting moved to room 12 on Tuesday."},
        {"role": "user", "content": "Thanks. Where is the meeting?"},
    ]
    ids = _chat_ids(server, messages)
    start = ids.index(2) + 1  # after the system message's <|im_end|>
    end = start + 8
    key = ns()
    with LeylineClient(server) as c:
        first = c.generate(ids, extra_key=key)
        assert first.cached_tokens == 0
        r = c.splice(ids, [Directive(start=start, end=end, replacement=[28, 29], mode=Mode.AMORTIZE)],
                     extra_key=key)  # fmt: skip
        assert r.prefilled >= 2 and r.rotated == len(ids) - end
        edited = ids[:start] + [28, 29] + ids[end:]
        nxt = c.generate(edited + [198], extra_key=key, max_new_tokens=4)
        assert nxt.cached_tokens == len(edited)
        assert len(nxt.output_ids) == 4
        st = c.stats()
    assert st["ok"] is True, st


def test_forget_equals_a_fresh_prefill(server: str) -> None:
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "README.md setup.py src/ tests/ docs/ LICENSE"},
        {"role": "user", "content": "Which file holds the license?"},
    ]
    ids = _chat_ids(server, messages)
    i = ids.index(2) + 1
    d = Directive(start=i + 3, end=i + 12, replacement=[], mode=Mode.FORGET)
    edited = ids[: d.start] + ids[d.end :]
    key, fresh = ns(), ns()
    with LeylineClient(server) as c:
        c.generate(ids, extra_key=key)
        c.splice(ids, [d], extra_key=key)
        spliced = c.generate(edited, extra_key=key, max_new_tokens=8)
        assert spliced.cached_tokens == len(edited) - 1 or spliced.cached_tokens == len(edited)
        cold = c.generate(edited, extra_key=fresh, max_new_tokens=8)
        assert cold.cached_tokens == 0
    assert spliced.output_ids == cold.output_ids


def test_forget_rows_and_integrity(server: str) -> None:
    """FORGET's KV rows are those of a fresh prefill (bf16 tolerance: the two prefills split
    the attention differently), and the idle server's counters are consistent."""
    with httpx.Client(base_url=server, timeout=600) as c:
        forget = model_check.check_forget(c)
        assert forget["forget_rows"] > 0
        assert_integrity(stats(c))
        print(json.dumps({"model": MODEL, **forget}))
