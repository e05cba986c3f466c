"""`leyline replay`: the built-in examples, the trace loaders on the public traces, the totals, and
the real CLI against a real ``leyline serve`` (the ``leyline_server`` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from shared_data import shared_dir

from leyline_agent.arms import ARMS, DEFAULT_POLICY
from leyline_agent.client import LeylineClient
from leyline_agent.directive import apply_directives
from leyline_agent.messages import flatten
from leyline_agent.policies import parse_policy
from leyline_agent.replay import examples_dir
from leyline_agent.replay.plots import plot
from leyline_agent.replay.report import arm_totals, summarize
from leyline_agent.replay.runner import LevelResult, replay_session, session_order
from leyline_agent.replay.spec import ReplaySpec, TurnRow
from leyline_agent.replay.table import table
from leyline_agent.runinfo import git_commit
from leyline_agent.traces import Trace, load
from leyline_agent.wrapper import ConversationWrapper

SHARED_TRACES = shared_dir("traces") or Path("/nonexistent/shared/traces")
HEADLINE_KEYS = {
    "hit_rate": float,
    "best_hit_rate": float,
    "prompt_tokens": int,
    "reused_tokens": int,
    "prefilled_tokens": int,
    "mean_turn_ms": float,
}


def test_examples_are_realistic_tool_sessions() -> None:
    traces = load(examples_dir())
    assert len(traces) == 3
    for trace in traces:
        assert 6 <= len(trace.turns) <= 10, trace.name
        assert trace.tools, trace.name
        wrapper = ConversationWrapper(None, DEFAULT_POLICY)
        edited = 0
        for messages in trace.turns:
            old = wrapper.tokens
            plan = wrapper.plan(messages, trace.tools)
            assert (
                apply_directives(old[: plan.base_len], plan.directives) + plan.tail == plan.tokens
            )
            assert not plan.fallback
            edited += bool(plan.directives)
            wrapper.commit(plan)
        assert edited >= 3, f"{trace.name}: the policy edits only {edited} turns"
        last = trace.turns[-1]
        rendered = wrapper.renderer.render(last, trace.tools)
        tool_tokens = [
            e - s for (s, e), m in zip(rendered.spans, last, strict=True) if m["role"] == "tool"
        ]
        assert tool_tokens and all(90 <= n <= 650 for n in tool_tokens), tool_tokens


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason=f"no public traces at {SHARED_TRACES}")
def test_loaders_read_the_shared_traces() -> None:
    for sub in ("swe-agent", "debug-gym"):
        traces = load(SHARED_TRACES / sub)
        assert traces, sub
        assert all(t.turns and all(turn for turn in t.turns) for t in traces), sub
        assert all(Path(t.source).is_relative_to(SHARED_TRACES) for t in traces)


def _row(arm: str, turn: int, **kw: object) -> TurnRow:
    base = dict(
        turn=turn, prompt_tokens=100, server_cached_tokens=60, prefilled_tokens=40,
        best_reused_tokens=60, level=1, arm=arm, trace="t", turn_ms=10.0, reused_tokens=60,
    )  # fmt: skip
    return TurnRow(**{**base, **kw})


def test_totals_and_ratio() -> None:
    rows = [
        _row("reprefill", 0),
        _row("reprefill", 1, turn_ms=30.0),
        _row("splice", 0),
        _row("splice", 1, prefilled_tokens=10, reused_tokens=90, best_reused_tokens=90,
             edited=True, spliced=True, first_token=5, reference_token=5, argmax_agree=True),
        _row("splice", 2, error="TemplateError: no"),
    ]  # fmt: skip
    t = arm_totals([r for r in rows if r.arm == "splice"])
    assert (t["turns"], t["skipped_turns"], t["prompt_tokens"], t["prefilled_tokens"]) == (
        2, 1, 200, 50,
    )  # fmt: skip
    assert t["reused_tokens"] == 150 and t["hit_rate"] == 0.75 and t["best_hit_rate"] == 0.75
    assert t["argmax_agreement"] == 1.0 and t["argmax_turns"] == 1
    assert arm_totals([r for r in rows if r.arm == "reprefill"])["argmax_agreement"] is None
    s = summarize([LevelResult(1, rows, 1.0)], ["reprefill", "splice"])
    assert s["1"]["splice_vs_reprefill_latency"] == pytest.approx(10.0 / 20.0)


def test_session_order_is_seeded() -> None:
    assert session_order([None, None], ARMS, 1, 0) == [(t, a) for t in range(2) for a in ARMS]  # type: ignore[list-item]
    shuffled = session_order([None] * 3, ARMS, 8, 0)  # type: ignore[list-item]
    assert shuffled == session_order([None] * 3, ARMS, 8, 0)  # type: ignore[list-item]
    assert sorted(shuffled) == sorted(session_order([None] * 3, ARMS, 1, 0))  # type: ignore[list-item]


def test_spec_rejects_bad_levels() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ReplaySpec(traces=["x"], concurrency=[1, 1])
    with pytest.raises(ValueError):
        ReplaySpec(traces=["x"], arms=["splice", "fast"])  # type: ignore[list-item]


def test_git_commit_reads_the_checkout(tmp_path: Path) -> None:
    """Loose ref, packed ref, detached HEAD, a worktree's ``gitdir:`` file; the exact hash."""
    loose, packed, detached, other = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)
    repo = tmp_path / "repo"
    git = repo / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(loose + "\n")
    (git / "packed-refs").write_text(
        f"# pack-refs with: peeled fully-peeled sorted\n{other} refs/heads/main\n"
        f"{packed} refs/heads/old\n^{other}\n"
    )
    (repo / "pkg").mkdir()
    assert git_commit(repo / "pkg" / "mod.py") == loose  # the loose ref wins over packed-refs
    (git / "HEAD").write_text("ref: refs/heads/old\n")
    assert git_commit(repo / "pkg") == packed
    (git / "HEAD").write_text("ref: refs/heads/gone\n")
    assert git_commit(repo) is None
    (git / "HEAD").write_text(detached + "\n")
    assert git_commit(repo) == detached

    tree = tmp_path / "tree"  # `git worktree add`: .git is a file, refs live in the common dir
    wt = git / "worktrees" / "tree"
    wt.mkdir(parents=True)
    (wt / "HEAD").write_text("ref: refs/heads/old\n")
    (wt / "commondir").write_text("../..\n")
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {wt}\n")
    assert git_commit(tree / "file.py") == packed
    assert git_commit(Path("/")) is None


@pytest.mark.sglang
@pytest.mark.timeout(420)
def test_replay_cli_on_examples(leyline_server: str, tmp_path: Path) -> None:
    traces = sorted(examples_dir().glob("*.jsonl"))[:2]
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "leyline_agent.cli", "replay", *map(str, traces),
            "--backend", leyline_server, "--max-turns", "5", "--concurrency", "2",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    arms = doc["arms"]
    assert list(arms) == list(ARMS)
    for name, a in arms.items():
        for key, typ in HEADLINE_KEYS.items():
            assert isinstance(a[key], typ), (name, key)
        assert 0 <= a["reused_tokens"] <= a["prompt_tokens"], name
        assert a["reused_tokens"] + a["prefilled_tokens"] == a["prompt_tokens"], name
        assert a["best_reused_tokens"] >= a["reused_tokens"], name
        assert a["turns"] == 2 * 5 and a["skipped_turns"] == 0, name
    assert arms["splice"]["hit_rate"] > arms["reprefill"]["hit_rate"]
    assert arms["splice"]["prefilled_tokens"] < arms["reprefill"]["prefilled_tokens"]
    assert arms["splice"]["spliced_turns"] == arms["splice"]["edited_turns"] > 0
    assert arms["splice"]["splice_misses"] == 0
    # the embedded model's random weights: the reference's top two log-probabilities are equal
    # on every spliced turn, so its argmax decides nothing and agreement is not applicable
    splice = arms["splice"]
    assert splice["argmax_turns"] == splice["spliced_turns"] == splice["argmax_flat_turns"]
    assert splice["argmax_agreement"] is None and splice["argmax_decided_turns"] == 0
    assert arms["none"]["argmax_agreement"] is None
    assert splice["reprefill_tokens"] == arms["reprefill"]["prefilled_tokens"]  # same turns
    assert splice["saved_tokens"] == splice["reprefill_tokens"] - splice["prefilled_tokens"] > 0
    assert doc["concurrency"] == 2 and set(doc["levels"]) == {"2"}

    results = json.loads((out / "results.json").read_text())
    assert results["arguments"]["concurrency"] == [2]
    env = results["environment"]
    assert env["machine"]["cpu_count"] and env["versions"]["sglang"] and "commit" in env
    assert env["backend"]["url"] == leyline_server
    assert {t["level"] for t in results["turns"]} == {2}
    for png in ("prefilled.png", "prefilled_turns.png", "hit_rate.png", "latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _mock_client(limit: int, status: int = 400, sent: list[int] | None = None) -> LeylineClient:
    """A client whose backend answers ``/generate`` like SGLang: ``status`` for prompts longer
    than ``limit`` tokens (the context), else one token with nothing cached; ``sent``: the
    lengths of the prompts it answered."""

    def handle(request: httpx.Request) -> httpx.Response:
        n = len(json.loads(request.content)["input_ids"])
        if sent is not None and n <= limit:
            sent.append(n)
        if n > limit:
            msg = f"The input ({n} tokens) is longer than the model's context length ({limit})."
            return httpx.Response(status, json={"error": {"message": msg}})
        return httpx.Response(
            200, json={"output_ids": [7], "meta_info": {"prompt_tokens": n, "cached_tokens": 0}}
        )

    client = LeylineClient("http://mock")
    client.http = httpx.Client(base_url="http://mock", transport=httpx.MockTransport(handle))
    return client


def test_a_refused_turn_is_skipped_and_counted() -> None:
    trace = load(examples_dir())[0]
    wrapper = ConversationWrapper(None, "none")
    sizes = []
    for messages in trace.turns:
        plan = wrapper.plan(messages, trace.tools)
        sizes.append(len(plan.tokens))
        wrapper.commit(plan)
    limit = sizes[2] - 1  # turn 2 onwards exceed the "context"
    rows = replay_session(
        _mock_client(limit), None, parse_policy("none"), "none", trace,  # type: ignore[arg-type]
        level=1, session_id="refused", agreement=False,
    )  # fmt: skip
    assert [r.error is None for r in rows] == [n <= limit for n in sizes]
    skipped = [r for r in rows if r.error is not None]
    assert skipped and all(r.skip_reason == "HTTP 400" for r in skipped)
    assert "longer than the model's context length" in skipped[0].error
    t = arm_totals(rows)
    assert t["turns"] == 2 and t["skipped_turns"] == len(sizes) - 2
    assert t["skip_reasons"] == {"HTTP 400": len(sizes) - 2}
    assert t["prompt_tokens"] == sizes[0] + sizes[1]


def test_cap_chars_cuts_each_message_to_its_head() -> None:
    """``--cap-chars N``'s cut (``messages.flatten``, shared with ``bench fidelity``): every
    message made plain text and cut to its first N characters; roles, tool-call ids and the
    observation flag kept; tool calls inline as JSON; a message cuts the same way in every turn."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}  # fmt: skip
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You debug code."},
        {"role": "user", "content": [{"type": "text", "text": "fix"}, "the bug"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "0123456789" * 50},
        {"role": "user", "content": "obs " * 40, "leyline_observation": True},
    ]
    cut = flatten(msgs, 20)
    assert [m["content"] for m in cut] == [
        "You debug code.",
        "fix the bug",
        '\n<tool_call>{"name":',
        "01234567890123456789",
        "obs obs obs obs obs ",
    ]
    assert [m["role"] for m in cut] == [m["role"] for m in msgs]
    assert cut[3]["tool_call_id"] == "c1" and cut[4]["leyline_observation"] is True
    assert "tool_calls" not in cut[2]
    full = flatten(msgs, 10_000)  # above every message's length: nothing cut
    assert full[3]["content"] == msgs[3]["content"] and full[2]["content"].endswith(
        '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}</tool_call>'
    )
    assert flatten(msgs[:4], 20) == cut[:4]  # the next turn's prefix cuts the same way
    with pytest.raises(ValueError, match="cap_chars"):
        flatten(msgs, 0)
    with pytest.raises(ValidationError):
        ReplaySpec(traces=["x"], cap_chars=0)


def test_cli_refuses_a_cap_below_one() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "leyline_agent.cli", "replay", "--cap-chars", "0", "--examples"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--cap-chars" in proc.stderr, proc.stderr[-2000:]


def test_cap_chars_fits_a_long_trace_into_the_context() -> None:
    """A trace whose second turn is longer than the backend's context: refused (skipped with
    HTTP 400) as recorded; with ``cap_chars`` every turn runs, each prompt within the cut."""
    base = [
        {"role": "system", "content": "You debug code."},
        {"role": "user", "content": "The build fails; find out why."},
        {"role": "assistant", "content": "Let me read the build log."},
    ]
    log = {"role": "tool", "content": " ".join(f"line{i}" for i in range(3000))}
    turns = [base[:2], [*base, log], [*base, log, {"role": "assistant", "content": "setup.py"}]]
    trace = Trace("long_log", turns, None, "test")
    sent: list[int] = []
    client = _mock_client(1000, sent=sent)
    rows = replay_session(
        client, None, parse_policy("none"), "none", trace,  # type: ignore[arg-type]
        level=1, session_id="uncut", agreement=False,
    )  # fmt: skip
    assert [r.skip_reason for r in rows] == [None, "HTTP 400", "HTTP 400"]
    sent.clear()
    rows = replay_session(
        client, None, parse_policy("none"), "none", trace,  # type: ignore[arg-type]
        level=1, session_id="cut", agreement=False, cap_chars=200,
    )  # fmt: skip
    assert [r.error for r in rows] == [None, None, None]
    assert [r.prompt_tokens for r in rows] == sent and max(sent) < 1000
    renderer = ConversationWrapper(None, "none").renderer
    want = renderer.encode(renderer.render_text(flatten(turns[2], 200), add_generation_prompt=True))
    assert sent[-1] == len(want)


def test_a_backend_failure_still_ends_the_run() -> None:
    trace = load(examples_dir())[0]
    client = _mock_client(0, status=500)
    with pytest.raises(httpx.HTTPStatusError):
        replay_session(
            client, None, parse_policy("none"), "none", trace,  # type: ignore[arg-type]
            level=1, session_id="down", agreement=False,
        )  # fmt: skip


def test_table_and_plots_lead_with_prefilled_tokens(tmp_path: Path) -> None:
    rows = [
        _row("none", 0), _row("none", 1), _row("splice", 0),
        _row("splice", 1, error="HTTP 400: too long", skip_reason="HTTP 400"),
    ]  # fmt: skip
    spec = ReplaySpec(traces=["x"], arms=["none", "splice"])
    summary = summarize([LevelResult(1, rows, 1.0)], spec.arms)
    t = table(summary, spec)
    assert [c.header for c in t.columns][:3] == ["arm", "prefilled", "vs none"]
    assert t.columns[-1].header == "skipped"  # shown: a turn was skipped
    assert "1 (1 HTTP 400)" in t.columns[-1]._cells
    assert "look lower than none's while it prefills as little" in str(t.caption)
    paths = plot(tmp_path, summary, spec, [LevelResult(1, rows, 1.0)])
    assert [p.name for p in paths] == [
        "prefilled.png", "prefilled_turns.png", "hit_rate.png", "latency.png"
    ]  # fmt: skip
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_replay_cli_skips_a_turn_longer_than_the_server_allows(
    leyline_server: str, tmp_path: Path
) -> None:
    base = [
        {"role": "system", "content": "You debug code."},
        {"role": "user", "content": "The build fails; find out why."},
        {"role": "assistant", "content": "Let me read the build log."},
    ]
    huge = " ".join(f"line{i}" for i in range(9000))  # about 20k tokens: over the 16,384 pool
    turns = [
        base[:2],
        [*base, {"role": "user", "content": huge}],
        [*base, {"role": "user", "content": "The log is too long; the error is in setup.py."}],
    ]
    trace = tmp_path / "long_log.jsonl"
    trace.write_text("".join(json.dumps(t) + "\n" for t in turns))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "leyline_agent.cli", "replay", str(trace),
            "--backend", leyline_server, "--arms", "none", "--no-agreement", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    arm = json.loads(proc.stdout.strip().splitlines()[-1])["arms"]["none"]
    assert (arm["turns"], arm["skipped_turns"], arm["skip_reasons"]) == (2, 1, {"HTTP 400": 1})
    assert "1 (1 HTTP 400)" in proc.stdout
    turns_out = json.loads((out / "results.json").read_text())["turns"]
    assert [t["skip_reason"] for t in turns_out] == [None, "HTTP 400", None]
    assert "exceeds the maximum allowed length" in turns_out[1]["error"]
