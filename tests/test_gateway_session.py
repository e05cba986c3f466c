"""The session side of in-band edits (``gateway.py``) without a server: a real ``SessionCore``
(embedded renderer, the ``stale_tool_outputs`` policy) whose answers are given as the worker
would send them (status, headers, body); nothing is sent (``LeylineClient(gateway=True)`` to an
unused URL)."""

from __future__ import annotations

import json
from functools import cache

import pytest

from leyline_agent import gateway, inband
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.client import LeylineClient
from leyline_agent.policies import parse_policy
from leyline_agent.session import Pending, SessionCore
from leyline_agent.testing.soak import TOOLS, turn_messages
from leyline_agent.wrapper import ConversationWrapper


@cache
def _renderer():  # type: ignore[no-untyped-def]
    return load_renderer(None)


def edited_turn(worker: str = "w1") -> tuple[SessionCore, Pending, dict]:
    """A session after three unedited turns answered by ``worker``, its fourth (edited) planned
    and deferred."""
    wrapper = ConversationWrapper(_renderer(), parse_policy("stale_tool_outputs:keep_last=2"))
    client = LeylineClient("http://127.0.0.1:9", gateway=True)
    core = SessionCore(client, wrapper, session_id="s1", share_exact=False)
    turns = turn_messages(7, 4, 6)
    for t in range(3):
        pending = core.plan(turns[t], TOOLS)
        assert gateway.defer(core, pending) is None  # nothing to edit yet
        gateway.settle(core, pending, None, 200, {inband.WORKER_HEADER: worker}, {})
        n = len(pending.plan.tokens)
        core.finish(pending, prompt_tokens=n, cached_tokens=0, request_ms=1.0)
    pending = core.plan(turns[3], TOOLS)
    edit = gateway.defer(core, pending)
    assert edit is not None and pending.plan.directives
    return core, pending, edit


def test_defer_sends_the_held_tokens_and_the_routing_key() -> None:
    core, pending, edit = edited_turn()
    assert edit["tokens"] == core.wrapper.tokens and edit["extra_key"] == "leyline:s1"
    assert len(edit["directives"]) == len(pending.plan.directives)
    assert gateway.routing_headers(core) == {inband.ROUTING_HEADER: "leyline:s1"}
    assert not pending.committed  # nothing is committed before the answer


def test_a_spliced_answer_commits_like_a_splice() -> None:
    core, pending, edit = edited_turn()
    body = {
        "new_length": 100, "prefix_reused": 10, "prefilled": 3, "rotated": 50,
        "in_place": True, "elapsed_ms": 2.5,
    }  # fmt: skip
    headers = {inband.RESULT_HEADER: json.dumps(body), inband.WORKER_HEADER: "w1"}
    assert gateway.settle(core, pending, edit, 200, headers, {}) is False
    assert pending.committed and pending.splice.response is not None
    assert pending.splice.response.prefilled == 3 and pending.splice.error is None
    plan = pending.plan
    assert core.wrapper.tokens == plan.tokens[: len(plan.tokens) - len(plan.tail)]


@pytest.mark.parametrize(
    ("worker", "reason"), [("w2", "failover"), ("w1", "not_cached")], ids=["moved", "stayed"]
)
def test_a_refused_edit_is_a_miss_and_the_request_is_sent_again(worker: str, reason: str) -> None:
    core, pending, edit = edited_turn()
    held = list(core.wrapper.tokens)
    headers = {inband.REFUSED_HEADER: "409", inband.WORKER_HEADER: worker}
    data = {"error": "409: sequence not cached", "request": "not run"}
    assert gateway.settle(core, pending, edit, 409, headers, data) is True
    assert pending.splice.response is None and pending.splice.reason == reason
    assert not pending.committed and core.wrapper.tokens == held  # nothing committed
    assert (pending.splice.best_reused == 0) is (reason == "failover")
    again = gateway.without_edit(core, {"messages": [], inband.FIELD: edit, "extra_key": "x"})
    assert inband.FIELD not in again and again["extra_key"] == "leyline:s1"


def test_an_answer_without_the_plugin_is_a_miss_no_plugin() -> None:
    core, pending, edit = edited_turn()
    assert gateway.settle(core, pending, edit, 200, {}, {}) is False
    assert pending.splice.reason == "no_plugin" and not pending.committed
