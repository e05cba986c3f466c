"""Composed splices on a real model (issue 26): one session's cached conversation edited ``N``
times in succession (``N`` in ``steps``), each edit one AMORTIZE splice of the sequence the
previous one left cached, in place in the session's namespace; then compared with the unedited
full context and with one AMORTIZE splice of all ``N`` edits at once.

The edits (``edits``): ``N`` disjoint spans of ``span`` tokens spread evenly over the part of a
case's full context between ``lo_frac`` of its length and its last ``tail`` tokens, each replaced
by ``filler`` (one token: a stub in the middle of the text). A row after the k-th span is rotated
by k successive splices, so bf16/fp32 rounding of the rotated keys compounds up to ``N`` times
where it would round once in the one-shot splice.

Per session and ``N``: ``full`` (the unedited context: prefill, greedy tokens, top-k logprobs,
shared by all ``N``), ``composed`` (``N`` splices, then the same generation), ``oneshot`` (the
``N`` directives in one splice into its own namespace). Reported with Wilson 95% intervals:
composed first token = full's, composed tokens = one-shot's, and KL(one-shot || composed).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from leyline_agent.bench.fidelity.traces import Case, TraceFidelitySpec, _first, kl, wilson
from leyline_agent.directive import Directive

STEPS = (1, 5, 20)


def edits(
    n_tokens: int, n: int, *, filler: int, span: int = 3, lo_frac: float = 0.2, tail: int = 16
) -> list[Directive]:
    """``n`` directives on a sequence of ``n_tokens`` (old positions, sorted, disjoint), each
    replacing ``span`` tokens by ``[filler]``.

    Raises:
        ValueError: the region between ``lo_frac`` and the last ``tail`` tokens cannot hold ``n``
            spans with a token between them.
    """  # fmt: skip
    lo, hi = int(n_tokens * lo_frac), n_tokens - tail
    stride = (hi - lo) // max(n, 1)
    if n < 1 or stride < span + 1:
        raise ValueError(f"{n} spans of {span} tokens do not fit in [{lo}, {hi}) of {n_tokens}")
    return [
        Directive(start=lo + i * stride, end=lo + i * stride + span, replacement=(filler,))
        for i in range(n)
    ]


def shifted(ds: Sequence[Directive], k: int) -> Directive:
    """Directive ``k`` of ``ds`` (old positions) in the sequence left by applying ``ds[:k]``."""
    d = ds[k]
    shift = sum(x.delta for x in ds[:k])
    return d.model_copy(update={"start": d.start + shift, "end": d.end + shift})


def apply(tokens: Sequence[int], ds: Sequence[Directive]) -> list[int]:
    """``tokens`` with the sorted, disjoint directives ``ds`` applied (old positions)."""
    out, at = [], 0
    for d in ds:
        out += list(tokens[at : d.start]) + list(d.replacement)
        at = d.end
    return out + list(tokens[at:])


def run_session(
    client: Any, case: Case, spec: TraceFidelitySpec, filler: int, steps: Sequence[int] = STEPS
) -> list[dict[str, Any]]:
    """One case's full context and, for each ``N`` in ``steps`` that fits, its composed and
    one-shot paths on ``client`` (a ``LeylineClient``); one row per ``N``."""
    tag = uuid.uuid4().hex[:8]
    gen = dict(max_new_tokens=spec.new_tokens, top_logprobs=spec.top_k)
    base = f"cmp-{tag}-full"
    full = client.generate(case.full, extra_key=base, **gen)
    rows = []
    for n in steps:
        try:
            ds = edits(len(case.full), n, filler=filler)
        except ValueError:
            continue
        final = apply(case.full, ds)
        comp, one = f"cmp-{tag}-{n}-c", f"cmp-{tag}-{n}-o"
        cur = list(case.full)
        prefilled = rotated = 0
        for k in range(n):
            d = shifted(ds, k)
            # the first edit copies the session out of the shared full context; the rest are in
            # place on what the previous splice left cached
            r = client.splice(
                cur, [d], extra_key=base if k == 0 else comp,
                target_extra_key=comp if k == 0 else None,
            )  # fmt: skip
            prefilled, rotated = prefilled + r.prefilled, rotated + r.rotated
            cur = apply(cur, [d])
        assert cur == final
        composed = client.generate(final, extra_key=comp, **gen)
        client.splice(case.full, ds, extra_key=base, target_extra_key=one)
        oneshot = client.generate(final, extra_key=one, **gen)
        pf, pc, po = _first(full), _first(composed), _first(oneshot)
        top = sorted(pf.values(), reverse=True)
        rows.append({
            "trace": case.trace, "turn": case.turn, "cap": case.cap, "steps": n,
            "full_len": len(case.full), "final_len": len(final),
            "prefilled": prefilled, "rotated": rotated,
            "composed_cached": composed.cached_tokens,
            "full": full.output_ids, "composed": composed.output_ids,
            "oneshot": oneshot.output_ids,
            "margin": top[0] - top[1] if len(top) > 1 else None,
            "kl_full_composed": kl(pf, pc), "kl_oneshot_composed": kl(po, pc),
        })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ``N``: composed first token = full's, composed = one-shot (first token, all tokens),
    the edited sequence cached after the last splice, KL medians; Wilson 95% intervals."""
    out: dict[str, Any] = {}
    for n in sorted({r["steps"] for r in rows}):
        rs = [r for r in rows if r["steps"] == n]

        def rate(pred: Any, rs: list[dict[str, Any]] = rs) -> dict[str, Any]:
            k = sum(1 for r in rs if pred(r))
            lo, hi = wilson(k, len(rs))
            return {"k": k, "n": len(rs), "rate": k / len(rs), "ci95": [lo, hi]}

        kls = sorted(
            r["kl_oneshot_composed"]
            for r in rs
            if r["kl_oneshot_composed"] == r["kl_oneshot_composed"]
        )
        out[str(n)] = {
            "composed_first_eq_full": rate(lambda r: r["composed"][:1] == r["full"][:1]),
            "oneshot_first_eq_full": rate(lambda r: r["oneshot"][:1] == r["full"][:1]),
            "composed_first_eq_oneshot": rate(lambda r: r["composed"][:1] == r["oneshot"][:1]),
            "composed_eq_oneshot": rate(lambda r: r["composed"] == r["oneshot"]),
            "composed_cached": rate(lambda r: r["composed_cached"] >= r["final_len"] - 1),
            "kl_oneshot_composed_median": kls[len(kls) // 2] if kls else float("nan"),
            "kl_oneshot_composed_max": kls[-1] if kls else float("nan"),
        }  # fmt: skip
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table, one row per ``N``."""
    lines = [
        "| N splices | composed 1st = full | one-shot 1st = full | composed 1st = one-shot "
        "| composed 8 = one-shot | KL(one-shot ‖ composed) median / max |",
        "|---|---|---|---|---|---|",
    ]

    def cell(s: dict[str, Any]) -> str:
        lo, hi = s["ci95"]
        return f"{s['k']}/{s['n']} ({s['rate']:.1%}; {lo:.1%}–{hi:.1%})"

    for n, s in summary.items():
        lines.append(
            f"| {n} | {cell(s['composed_first_eq_full'])} | {cell(s['oneshot_first_eq_full'])} "
            f"| {cell(s['composed_first_eq_oneshot'])} | {cell(s['composed_eq_oneshot'])} "
            f"| {s['kl_oneshot_composed_median']:.2e} / {s['kl_oneshot_composed_max']:.2e} |"
        )
    return "\n".join(lines)
