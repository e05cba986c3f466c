"""Fidelity on a real model and real agent traces (paper §4.3): ``leyline bench fidelity --model
smollm2-135m-instruct``.

Cases: every turn of every trace whose messages a policy edits, for each of ``policies``
(``stale_tool_outputs`` keeping the last 0, 1, 2 or 3 steps' outputs: four edits of each turn). A
turn's recorded messages are first made plain text and fitted to ``budget`` tokens (``fit``: each
message's text capped at ``cap_chars`` characters, its head kept, by ``messages.flatten``; then the
first message if it is a system prompt plus the longest run of last messages that renders within
``budget``); the policy edits the fitted turn. ``full`` is the fitted turn rendered as is,
``edited`` the policy's version; the directives are the token regions that differ
(``token_changes``). Per case, on one server, each path in its own namespace:

- full: ``full`` prefilled, ``new_tokens`` greedy tokens with top-``top_k`` logprobs (the warm,
  unedited full context);
- AMORTIZE: the splice of ``full`` into ``edited`` (``target_extra_key``: the cached ``full`` is
  left as it was), then the same generation on ``edited``;
- FORGET: the same with FORGET directives;
- fresh: ``edited`` prefilled from nothing.

Reported with Wilson 95% intervals: AMORTIZE's first token and first ``new_tokens`` tokens equal
the full context's; FORGET's equal to the fresh prefill's; AMORTIZE's first token equal to
FORGET's; KL(full || AMORTIZE) and KL(full || FORGET) on the first position from the top-k
logprobs (over the full context's top-k, both renormalised there; a token outside the other's
top-k gets its smallest listed logprob).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from leyline_agent.directive import Directive, Mode
from leyline_agent.messages import flatten


@dataclass(frozen=True)
class TraceFidelitySpec:
    """``budget``: tokens of a fitted turn; ``cap_chars``: characters kept of each message;
    ``n``: most cases; ``new_tokens``: greedy tokens compared; ``top_k``: logprobs for KL."""

    policies: tuple[str, ...] = (
        "stale_tool_outputs:keep_last=0",
        "stale_tool_outputs:keep_last=1",
        "stale_tool_outputs:keep_last=2",
        "stale_tool_outputs:keep_last=3",
    )
    budget: int = 1536
    cap_chars: int = 1200
    n: int = 200
    new_tokens: int = 8
    top_k: int = 10


@dataclass(frozen=True)
class Case:
    trace: str
    turn: int
    policy: str
    cap: int
    full: list[int]
    edited: list[int]
    directives: list[Directive]


def fit(
    messages: list[dict[str, Any]], count: Callable[[list[dict[str, Any]]], int], budget: int
) -> list[dict[str, Any]] | None:
    """The first message if it is a system prompt, plus the longest run of last messages whose
    rendering (``count``) stays within ``budget`` tokens; None when not even the last fits."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(head) :]
    lo = None
    for start in range(len(rest) - 1, -1, -1):
        if count(head + rest[start:]) > budget:
            break
        lo = start
    return None if lo is None else head + rest[lo:]


def cases(traces: Sequence[Any], renderer: Any, spec: TraceFidelitySpec) -> Iterator[Case]:
    """The edited turns of ``traces`` as cases (see the module docstring), at most ``spec.n``."""
    from leyline_agent.policies import parse_policy
    from leyline_agent.policies.edits import apply_edits
    from leyline_agent.policies.protocol import Conversation
    from leyline_agent.token_changes import token_changes

    def ids(msgs: list[dict[str, Any]]) -> list[int]:
        return list(renderer.encode(renderer.render_text(msgs)))

    made = 0
    for spec_policy, trace, (t, turn) in (
        (p, tr, tt) for p in spec.policies for tr in traces for tt in enumerate(tr.turns)
    ):
        policy = parse_policy(spec_policy)
        fitted = fit(flatten(turn, spec.cap_chars), lambda m: len(ids(m)), spec.budget)
        if not fitted:
            continue
        counts = [len(renderer.encode(str(m["content"]))) + 4 for m in fitted]
        conv = Conversation(fitted, counts, turn=t, count_tokens=lambda s: len(renderer.encode(s)))
        edits = list(policy(conv))
        if not edits:
            continue
        edited_msgs = apply_edits(fitted, edits).messages
        full, edited = ids(fitted), ids(edited_msgs)
        found = token_changes(full, edited) or []
        ds = [Directive(start=a, end=b, replacement=tuple(edited[c:d])) for a, b, c, d in found]
        if not ds:
            continue
        yield Case(trace.name, t, spec_policy, spec.cap_chars, full, edited, ds)
        made += 1
        if made >= spec.n:
            return


def _first(res: Any) -> dict[int, float]:
    rows = (res.meta.get("output_top_logprobs") or [[]])[0]
    return {int(r[1]): float(r[0]) for r in rows}


def kl(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(p || q) in nats over p's top-k tokens, both renormalised over that set; a token
    missing from q's top-k gets q's smallest listed logprob."""
    if not p or not q:
        return float("nan")
    floor = min(q.values())
    qs = {t: q.get(t, floor) for t in p}
    zp = math.log(sum(math.exp(v) for v in p.values()))
    zq = math.log(sum(math.exp(v) for v in qs.values()))
    return sum(math.exp(v - zp) * ((v - zp) - (qs[t] - zq)) for t, v in p.items())


def run_case(client: Any, case: Case, spec: TraceFidelitySpec) -> dict[str, Any]:
    """One case's four paths on ``client`` (a ``LeylineClient``); the comparisons as a dict."""
    tag = uuid.uuid4().hex[:8]
    a, b, c, d = (f"fid-{tag}-{x}" for x in "abcd")
    gen = dict(max_new_tokens=spec.new_tokens, top_logprobs=spec.top_k)
    full = client.generate(case.full, extra_key=a, **gen)
    am = client.splice(case.full, case.directives, extra_key=a, target_extra_key=b)
    amort = client.generate(case.edited, extra_key=b, **gen)
    fg_dirs = [x.model_copy(update={"mode": Mode.FORGET}) for x in case.directives]
    fg = client.splice(case.full, fg_dirs, extra_key=a, target_extra_key=c)
    forget = client.generate(case.edited, extra_key=c, **gen)
    fresh = client.generate(case.edited, extra_key=d, **gen)
    pf, pa, pg = _first(full), _first(amort), _first(forget)
    top = sorted(pf.values(), reverse=True)
    return {
        "trace": case.trace, "turn": case.turn, "policy": case.policy, "cap": case.cap,
        "full_len": len(case.full),
        "edited_len": len(case.edited), "directives": len(case.directives),
        "removed": sum(x.end - x.start for x in case.directives),
        "amortize_prefilled": am.prefilled, "amortize_rotated": am.rotated,
        "amortize_ms": am.elapsed_ms, "forget_ms": fg.elapsed_ms, "forget_prefilled": fg.prefilled,
        "amortize_next_cached": amort.cached_tokens, "forget_next_cached": forget.cached_tokens,
        "full": full.output_ids, "amortize": amort.output_ids, "forget": forget.output_ids,
        "fresh": fresh.output_ids, "margin": top[0] - top[1] if len(top) > 1 else None,
        "kl_amortize": kl(pf, pa), "kl_forget": kl(pf, pg),
    }  # fmt: skip


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of ``k`` successes in ``n`` trials (``(nan, nan)`` for n=0)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Agreement rates with Wilson intervals, KL medians, and the misses' margins."""
    n = len(rows)

    def rate(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        k = sum(1 for r in rows if pred(r))
        lo, hi = wilson(k, n)
        return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci95": [lo, hi]}

    def med(key: str) -> float:
        xs = sorted(r[key] for r in rows if r[key] == r[key])
        return xs[len(xs) // 2] if xs else float("nan")

    return {
        "amortize_first_eq_full": rate(lambda r: r["amortize"][:1] == r["full"][:1]),
        "amortize_8_eq_full": rate(lambda r: r["amortize"] == r["full"]),
        "forget_first_eq_full": rate(lambda r: r["forget"][:1] == r["full"][:1]),
        "forget_eq_fresh": rate(lambda r: r["forget"] == r["fresh"]),
        "amortize_first_eq_forget": rate(lambda r: r["amortize"][:1] == r["forget"][:1]),
        "amortize_cached_after": rate(lambda r: r["amortize_next_cached"] >= r["edited_len"] - 1),
        "kl_amortize_median": med("kl_amortize"),
        "kl_forget_median": med("kl_forget"),
        "amortize_ms_median": med("amortize_ms"),
        "forget_ms_median": med("forget_ms"),
        "misses_margin": [r["margin"] for r in rows if r["amortize"][:1] != r["full"][:1]],
    }


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (rate, k/n, Wilson 95%)."""
    lines = ["| comparison | agreement | 95% (Wilson) |", "|---|---|---|"]
    for key, label in (
        ("amortize_first_eq_full", "AMORTIZE first token = full context"),
        ("amortize_8_eq_full", "AMORTIZE first 8 tokens = full context"),
        ("forget_first_eq_full", "FORGET first token = full context"),
        ("forget_eq_fresh", "FORGET 8 tokens = fresh prefill"),
        ("amortize_first_eq_forget", "AMORTIZE first token = FORGET"),
        ("amortize_cached_after", "edited sequence cached after AMORTIZE"),
    ):
        s = summary[key]
        lo, hi = s["ci95"]
        lines.append(f"| {label} | {s['k']}/{s['n']} ({s['rate']:.1%}) | {lo:.1%}–{hi:.1%} |")
    lines.append(
        f"| KL(full ‖ ·), first position, median | AMORTIZE {summary['kl_amortize_median']:.4f} "
        f"| FORGET {summary['kl_forget_median']:.4f} |"
    )
    return "\n".join(lines)


def interleave(groups: Sequence[Sequence[Case]]) -> list[Case]:
    """One case of each group in turn (``[[a1, a2], [b1]]`` -> ``[a1, b1, a2]``), so that the
    first ``n`` cases hold every (cap, policy) group as evenly as the groups allow."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def policy_table(rows: list[dict[str, Any]]) -> str:
    """First-token agreement with the full context per policy (Markdown): AMORTIZE and FORGET,
    each with its Wilson 95% interval. A policy that stubs the newest tool output
    (``keep_last=0``) removes what the next token reads, with few rows after it to carry it."""
    lines = ["| policy | n | AMORTIZE first = full | FORGET first = full |", "|---|---|---|---|"]
    for policy in sorted({r["policy"] for r in rows}):
        rs = [r for r in rows if r["policy"] == policy]
        cells = []
        for arm in ("amortize", "forget"):
            k = sum(r[arm][:1] == r["full"][:1] for r in rs)
            lo, hi = wilson(k, len(rs))
            cells.append(f"{k}/{len(rs)} ({k / len(rs):.1%}; {lo:.1%}–{hi:.1%})")
        lines.append(f"| {policy} | {len(rs)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def spec_dict(spec: TraceFidelitySpec) -> dict[str, Any]:
    return asdict(spec)
