"""Re-tokenizing around an edit (``chat.retokenize``, ``chat.head``): equal to a full tokenization.

Generated edits (hypothesis) of texts mixing words, digits, punctuation, indentation, blank lines
and multi-byte characters (accents, CJK, emoji, combining marks), at any position (inside tokens,
across token and line boundaries), with the embedded o200k tokenizer; then the same through the
incremental renderer and the wrapper, with a first message over 100k characters edited near its
end every turn (debug-gym's froggy: the task plus a test report whose ``Date:`` line changes).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from leyline_agent import ConversationWrapper
from leyline_agent.chat.head import head_local
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.render_cache import IncrementalRenderer
from leyline_agent.chat.retokenize import (
    Starts,
    encoding_starts,
    line_cuts,
    prefix_len,
    resplice,
    suffix_len,
)

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return load_renderer()


def encode(tok: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    enc = tok.encode(text, add_special_tokens=False)
    return enc.ids, encoding_starts(enc)


LINES = [
    "Date: Tue Dec  1 22:18:20 2026",
    "tests/test_io.py::test_read FAILED",
    "    def f(x):  # naïve café",
    "\treturn x**2",
    "",
    "  ",
    "数学 über 😀👍🏽 x\u0301y",
    "1234567 passed in 0.31s",
    "E   AssertionError: assert 'a' == 'b'",
    "...",
    "/usr/lib/python3.12",
    "ÅNGSTRÖM it's DON'T",
]
pieces = st.text(alphabet="ab Z9\n\t.:/'é日😀\u0301-", max_size=12)


@st.composite
def edited_texts(draw: st.DrawFn) -> tuple[str, str]:
    lines = draw(st.lists(st.sampled_from(LINES), min_size=30, max_size=80))
    old = "\n".join(lines) + draw(st.sampled_from(["", "\n", "<|im_end|>"]))
    at = draw(st.integers(0, len(old)))
    cut = draw(st.integers(0, min(12, len(old) - at)))
    new = old[:at] + draw(pieces) + old[at + cut :]
    return old, new


@SETTINGS
@given(edited_texts())
def test_resplice_equals_a_full_tokenization(renderer: Renderer, texts: tuple[str, str]) -> None:
    tok = renderer.tokenizer
    old, new = texts
    old_ids, old_starts = encode(tok, old)
    stats: dict[str, int] = {}
    kept: list[tuple[int, int, int]] = []
    out = resplice(
        lambda t: tok.encode(t, add_special_tokens=False),
        old,
        old_ids,
        Starts.of(old_starts),
        new,
        stats,
        kept=kept,
    )
    assert stats.get("window_fallbacks", 0) == 0  # the check never rejects o200k's line cuts
    if out is not None:
        ids, starts = out
        assert (ids, starts.tolist()) == encode(tok, new)
        # the runs it reports as copied are the old tokens at those places (how much it keeps
        # depends on where line cuts fall: a repeated line next to the edit can leave most of a
        # short text in the window, so no size is asserted here; bench_planning measures it)
        assert all(ids[j : j + n] == old_ids[i : i + n] for i, j, n in kept)
        runs = sorted(kept, key=lambda r: r[1])  # disjoint in the new tokens
        assert all(a[1] + a[2] <= b[1] for a, b in zip(runs, runs[1:], strict=False))


def test_resplice_windows_a_small_edit_of_a_long_text(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    old = "\n".join(LINES * 200)
    at = old.index("22:18:20", len(old) - 500)
    for new in (old[:at] + "23:59:59" + old[at + 8 :], old[:at] + "😀" + old[at + 1 :]):
        stats: dict[str, int] = {}
        ids, starts = encode(tok, old)
        out = resplice(
            lambda t: tok.encode(t, add_special_tokens=False),
            old,
            ids,
            Starts.of(starts),
            new,
            stats,
        )
        assert out is not None and stats == {"windowed": 1}
        assert (out[0], out[1].tolist()) == encode(tok, new)


def test_resplice_falls_back_when_the_old_tokens_disagree(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    old = "\n".join(LINES * 50)
    ids, starts = encode(tok, old)
    wrong = list(ids)
    wrong[-40] = 0  # tokens that are not old's encoding near the edit: the check catches it
    new = old[:-100] + "X" + old[-99:]
    stats: dict[str, int] = {}
    encode_ = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    assert resplice(encode_, old, wrong, Starts.of(starts), new, stats) is None
    assert stats == {"window_fallbacks": 1}


def test_line_cuts_screen(renderer: Renderer) -> None:
    assert line_cuts(renderer.tokenizer)
    prefixed = Tokenizer.from_str(renderer.tokenizer.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not line_cuts(prefixed)
    spaced = Tokenizer.from_str(renderer.tokenizer.to_str())
    spaced.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # pieces may hold "\n" + letter
    assert not line_cuts(spaced)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=40),  # runs flatten
    st.integers(-3, 40),
    st.integers(-3, 40),
    st.integers(-20, 20),
    st.integers(-3, 60),
)
def test_starts_behave_like_lists(runs: list[list[int]], i: int, j: int, shift: int, x: int):
    flat, segs, at = [], [], 0
    for run in runs:  # increasing segments (duplicates inside a run, as split characters give)
        local = sorted(run)
        segs.append((at + 1, local, 0, len(local)))
        flat += [at + 1 + v for v in local]
        at = flat[-1] + 1 if flat else at
    starts = Starts(segs)
    assert starts.tolist() == flat and len(starts) == len(flat)
    assert [starts[k] for k in range(len(flat))] == flat
    from bisect import bisect_left, bisect_right

    assert starts.bisect_left(x) == bisect_left(flat, x)
    assert starts.bisect_right(x) == bisect_right(flat, x)
    lo, hi = max(i, 0), max(j, 0)
    assert starts.slice(i, j, shift).tolist() == [v + shift for v in flat[lo:hi]]
    assert (starts.slice(0, i) + starts.slice(i, len(flat))).tolist() == flat


@given(st.text("ab\u00e9", max_size=30), st.text("ab\u00e9", max_size=30))
def test_prefix_and_suffix_len(a: str, b: str) -> None:
    import os

    p = prefix_len(a, b)
    assert p == len(os.path.commonprefix([a, b]))
    cap = min(len(a), len(b)) - p
    s = suffix_len(a, b, cap)
    assert s == min(cap, len(os.path.commonprefix([a[::-1], b[::-1]])))


def test_embedded_template_is_head_local(renderer: Renderer) -> None:
    assert head_local(renderer)
    numbered = (
        "{% for m in messages %}{{ messages[0].content | length }}{{ m.content }}{% endfor %}"
    )
    assert not head_local(Renderer(renderer.tokenizer, numbered, source="numbered"))


def report(turn: int, lines: int) -> str:
    body = [
        f"tests/test_m{k % 7}.py::test_{k} {'PASSED' if k % 3 else 'FAILED'}" for k in range(lines)
    ]
    body.insert(lines - 5, f"Date: Tue Dec  1 22:{turn // 60 % 60:02d}:{turn % 60:02d} 2026")
    return "Task: fix the failing tests.\n\n" + "\n".join(body)


def step(i: int) -> list[dict]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": f"step {i}", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}\n" * (3 + i)},
    ]


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 4000), st.integers(0, 6), pieces, st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["system", "user"]),
    st.booleans(),
)
def test_head_edits_render_exactly(renderer: Renderer, edits, role: str, tools: bool) -> None:
    """A long first message edited anywhere (a few characters, possibly multi-byte) while steps
    are appended: the incremental render equals the full one, text, tokens and spans."""
    inc = IncrementalRenderer(renderer)
    t = TOOLS if tools else None
    head = report(0, 150)
    msgs = [{"role": role, "content": head}, {"role": "user", "content": "Fix it."}, *step(0)]
    prev = inc.render(msgs, t)
    for turn, (at, cut, text, grow) in enumerate(edits):
        at = min(at, len(head))
        head = head[:at] + text + head[at + cut :]
        msgs = [{**msgs[0], "content": head}, *msgs[1:], *(step(turn + 1) if grow else [])]
        got, want = inc.render(msgs, t), renderer.render(msgs, t)
        assert (got.text, got.tokens, got.spans) == (want.text, want.tokens, want.spans)
        # the runs the diff skips comparing are equal, and cover all but the change's window
        runs = inc.copied(got, prev.tokens)
        assert all(got.tokens[j : j + n] == prev.tokens[i : i + n] for i, j, n in runs)
        assert sum(n for _, _, n in runs) >= len(prev.tokens) - 3000
        assert inc.copied(got, list(prev.tokens)) == []  # another list: nothing is known
        prev = got
    assert inc.stats["window_fallbacks"] == 0


def test_wrapper_plans_a_huge_first_message_edit_as_a_small_splice(renderer: Renderer) -> None:
    """debug-gym's shape: message 0 over 100k characters, its Date line changed every turn, tool
    steps appended. The plan replaces a few tokens in message 0 and keeps every token after it;
    the incremental plan equals the full one, and no window check failed."""
    inc = ConversationWrapper(renderer, "none")
    full = ConversationWrapper(renderer, "none", incremental=False)
    msgs = [{"role": "system", "content": report(0, 3000)}, {"role": "user", "content": "Go."}]
    assert len(msgs[0]["content"]) > 100_000
    for k in range(6):  # tool steps with long outputs: about 12k tokens after message 0
        msgs += [step(k)[0], {**step(k)[1], "content": report(k, 150)}]
    for turn in range(1, 5):
        msgs = [{**msgs[0], "content": report(turn, 3000)}, *msgs[1:], *step(10 + turn)]
        a, b = inc.plan(msgs, TOOLS), full.plan(msgs, TOOLS)
        assert (a.tokens, a.spans, a.directives, a.tail) == (
            b.tokens,
            b.spans,
            b.directives,
            b.tail,
        )
        if turn > 1:
            (d,) = a.directives  # one small directive inside message 0
            first = a.spans[0]
            assert first[0] <= d.start < d.end <= first[1] and d.removed <= 4
            assert len(d.replacement) <= 4
            assert a.reused >= a.base_len - 4 and not a.fallback
            assert a.base_len - d.end > 10_000  # every token after it is kept
        inc.commit(a)
        full.commit(b)
    assert inc.incremental is not None
    assert inc.incremental.stats["windowed"] >= 3 and inc.incremental.stats["window_fallbacks"] == 0
    assert json.dumps(a.tail)


def test_a_tokenizer_without_line_cuts_encodes_changed_pieces_whole(renderer: Renderer) -> None:
    tok = Tokenizer.from_str(renderer.tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    plain = Renderer(tok, renderer.chat_templates["default"])
    assert not line_cuts(tok)
    inc = IncrementalRenderer(plain)
    msgs = [{"role": "system", "content": report(0, 150)}, {"role": "user", "content": "Go."}]
    for turn in range(1, 4):
        msgs = [{**msgs[0], "content": report(turn, 150)}, *msgs[1:], *step(turn)]
        got, want = inc.render(msgs, TOOLS), plain.render(msgs, TOOLS)
        assert (got.text, got.tokens, got.spans) == (want.text, want.tokens, want.spans)
    assert inc.stats == {"windowed": 0, "window_fallbacks": 0}


def test_first_message_edited_with_others(renderer: Renderer) -> None:
    """The first message's content changed together with message 1 or 2 (rendered in full),
    with messages dropped at the end, or with its role changed (not a head edit)."""
    inc = IncrementalRenderer(renderer)
    base = [{"role": "system", "content": report(0, 150)}, {"role": "user", "content": "Go."}]
    base += [m for k in range(4) for m in step(k)]
    cases = [
        base,
        [{**base[0], "content": report(1, 150)}, {"role": "user", "content": "Now."}, *base[2:]],
        [{**base[0], "content": report(2, 150)}, base[1], {**base[2], "content": "x"}, *base[3:]],
        [{**base[0], "content": report(3, 150)}, *base[1:-2]],
        [{"role": "user", "content": report(3, 150)}, *base[1:]],
        base,
    ]
    for msgs in cases:
        for tools in (None, TOOLS):
            got, want = inc.render(msgs, tools), renderer.render(msgs, tools)
            assert (got.text, got.tokens, got.spans) == (want.text, want.tokens, want.spans)
