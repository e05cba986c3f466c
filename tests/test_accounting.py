"""Turn accounting: ``Totals`` sums ``TurnRecord``s once for every report, and a turn's
``best_reused_tokens`` bounds what the backend can reuse (its reply included)."""

from __future__ import annotations

import json

import httpx
import pytest

from leyline_agent.accounting import Totals, TurnRecord
from leyline_agent.client import LeylineClient
from leyline_agent.generate_turn import generate_turn
from leyline_agent.session import SessionCore
from leyline_agent.wrapper import ConversationWrapper

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
ASK = {"role": "user", "content": "Name a prime number between 10 and 20."}
REPLY = {"role": "assistant", "content": "Thirteen is a prime number between ten and twenty."}
MORE = {"role": "user", "content": "And one between 20 and 30?"}


def _record(**kw: object) -> TurnRecord:
    base = dict(turn=0, prompt_tokens=100, server_cached_tokens=60, prefilled_tokens=40,
                reused_tokens=60, best_reused_tokens=70)  # fmt: skip
    return TurnRecord.model_validate({**base, **kw})


def test_totals_sum_once_with_one_meaning_per_name() -> None:
    records = [
        _record(),
        _record(turn=1, edited=True, spliced=True, policy_edits=2, prefilled_tokens=10,
                reused_tokens=90, server_cached_tokens=95, splice_prefilled_tokens=5,
                best_reused_tokens=90, directives_amortize=2),
        _record(turn=2, edited=True, splice_error="409: gone", splice_miss_reason="not_cached"),
    ]  # fmt: skip
    t = Totals.of(records)
    assert (t.turns, t.edited_turns, t.policy_edited_turns, t.spliced_turns) == (3, 2, 1, 1)
    assert (t.prompt_tokens, t.prefilled_tokens, t.reused_tokens) == (300, 90, 210)
    assert (t.server_cached_tokens, t.best_reused_tokens) == (215, 230)
    assert (t.edited_prompt_tokens, t.edited_prefilled_tokens) == (200, 50)
    assert t.splice_misses == 1 and t.misses_by_reason == {"not_cached": 1}
    assert t.hit_rate == pytest.approx(0.7) and t.best_hit_rate == pytest.approx(230 / 300)
    merged = Totals.of(records[:1])
    merged.merge(Totals.of(records[1:]))
    assert merged == t
    d = t.as_dict()
    assert d["misses_by_reason"] == {"not_cached": 1} and d["hit_rate"] == t.hit_rate
    assert "cached_tokens" not in d
    json.dumps(d)


class PrefixCache:
    """``/generate`` like SGLang's radix cache: every prompt and its output are cached per
    ``extra_key``; a prompt's cached tokens are its longest shared prefix with them (the last
    prompt token is always computed). Answers ``reply`` as the output, once per request."""

    def __init__(self) -> None:
        self.sequences: dict[str, list[list[int]]] = {}
        self.reply: list[int] = [0]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids, seqs = body["input_ids"], self.sequences.setdefault(body["extra_key"], [])
        cached = 0
        for seq in seqs:
            n = 0
            while n < min(len(seq), len(ids) - 1) and seq[n] == ids[n]:
                n += 1
            cached = max(cached, n)
        seqs.append(ids + self.reply)
        meta = {"prompt_tokens": len(ids), "cached_tokens": cached}
        return httpx.Response(200, json={"output_ids": self.reply, "meta_info": meta})


def _core(
    backend: PrefixCache, policy: str = "none", splice: bool = False, share_exact: bool = False
) -> SessionCore:
    """A session on ``backend``; in its own namespace from the first request unless
    ``share_exact`` (the bound is then the whole prompt while it is shared)."""
    client = LeylineClient("http://mock")
    client.http = httpx.Client(base_url="http://mock", transport=httpx.MockTransport(backend))
    wrapper = ConversationWrapper(None, policy)
    return SessionCore(client, wrapper, splice=splice, share_exact=share_exact)


def test_best_is_the_whole_prompt_while_the_namespace_is_shared() -> None:
    """Another session's identical prefix is a hit in the shared namespace: the bound of a
    shared session's turn is its prompt, so reused never exceeds it (before: 0 on a first turn
    that another session's prefix served)."""
    backend = PrefixCache()
    a, b = _core(backend, share_exact=True), _core(backend, share_exact=True)
    assert a.placement.extra_key == b.placement.extra_key != a.placement.own
    generate_turn(a, [SYSTEM, ASK])
    record, _ = generate_turn(b, [SYSTEM, MORE])
    assert record.reused_tokens > 0 and record.best_reused_tokens >= record.reused_tokens
    assert record.best_reused_tokens == record.prompt_tokens
    assert record.shared and Totals.of(b.records).shared_turns == 1  # the loose bound, counted
    own = _core(backend)
    own_record, _ = generate_turn(own, [SYSTEM, MORE])
    assert not own_record.shared and own_record.best_reused_tokens == 0


def test_best_counts_the_reply_the_backend_cached() -> None:
    """SGLang caches the generated reply after the prompt; when the agent sends that reply back
    the backend reuses it too. The bound used to stop at the previous prompt (an OpenAI Agents
    SDK run reported 5,655 cached tokens against a best of 5,592)."""
    turns = [[SYSTEM, ASK], [SYSTEM, ASK, REPLY, MORE]]
    planner = ConversationWrapper(None, "none")
    first = planner.plan(turns[0])
    planner.commit(first)
    second = planner.plan(turns[1])
    backend = PrefixCache()
    backend.reply = second.tail[:5]  # the reply's first tokens, as the next prompt renders them
    core = _core(backend)
    for messages in turns:
        record, _ = generate_turn(core, messages)
    assert record.server_cached_tokens == len(first.tokens) + 5  # the reply was reused
    assert record.reused_tokens == record.server_cached_tokens
    assert record.best_reused_tokens == record.reused_tokens  # the bound holds, and is tight


def test_best_bounds_a_reply_of_known_length_or_unknown() -> None:
    """The chat path knows the reply's length (``usage.completion_tokens``), not its ids."""
    core = _core(PrefixCache())
    first = core.begin([SYSTEM, ASK])
    core.finish(first, prompt_tokens=len(first.plan.tokens), cached_tokens=0, request_ms=1.0,
                completion_tokens=4)  # fmt: skip
    pending = core.begin([SYSTEM, ASK, REPLY, MORE])
    assert pending.best_reused == len(first.plan.tokens) + 4
    core.finish(pending, prompt_tokens=len(pending.plan.tokens), cached_tokens=0, request_ms=1.0)
    third = core.begin([SYSTEM, ASK, REPLY, MORE, REPLY, ASK])
    assert third.best_reused == len(third.plan.tokens)  # reply of unknown length: no bound
    core.forget()
    assert core.begin([SYSTEM, ASK]).best_reused == len(first.plan.tokens)
