"""The divergence microbenchmark: full context vs AMORTIZE vs FORGET, through a real server.

For every case of ``task.py`` (the context ends with a query; its next token is the answer) three
paths give a next-token distribution, all through SGLang with the Leyline plugin:

- full:     ``/generate`` on the unedited context (namespace A; this also caches it).
- AMORTIZE: ``/leyline/splice`` replaces the fact chunk by the stub in namespace A (downstream KV
  kept, k_pe δ-rotated), then ``/generate`` on the edited context: every token but the last comes
  from the spliced cache (checked through ``cached_tokens``), the query token is recomputed.
- FORGET:   the same on a second copy of the context (namespace B) with ``mode: forget``:
  everything from the chunk on is re-prefilled and the old span purged.
- fresh:    (a check, not a path) the edited context prefilled in a third, empty namespace;
  FORGET must equal it up to the prefill split.
- reference: (a check) transformers' own greedy next token on the full and the edited contexts
  (the saved model, fp32): the server's full and fresh argmax must match it.

Distributions are complete (``top_logprobs_num`` = vocabulary size), so KL(full ‖ path) is exact.
Mechanics are checked per case: AMORTIZE is in place, prefills only the stub and rotates the whole
tail; FORGET prefills from the chunk on; the follow-up ``/generate`` hits the cache for all but the
query token.

    python -m leyline_agent.bench.fidelity.divergence --model-path DIR [--n 500] [--backend URL] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from leyline_agent.bench.fidelity.task import KINDS, REAL_KINDS, Case, TaskSpec, edited, make_cases
from leyline_agent.client import LeylineClient
from leyline_agent.directive import Directive, Mode

PATHS = ("amortize", "forget")


@dataclass(frozen=True)
class BenchSpec:
    """n: cases per kind; batch: cases per round of requests; seed: case generation."""

    n: int = 500
    batch: int = 32
    seed: int = 1


def generate(
    http: httpx.Client, contexts: Sequence[list[int]], keys: Sequence[str], top_k: int
) -> list[tuple[dict[int, float], int]]:
    """Batched greedy ``/generate`` of one token. Returns ``(logprob by token id, cached_tokens)``
    per context."""
    body = {
        "input_ids": [list(c) for c in contexts],
        "extra_key": list(keys),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": top_k,
        "logprob_start_len": -1,
    }
    r = http.post("/generate", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"/generate failed ({r.status_code}): {r.text[:500]}")
    out = []
    for item in r.json():
        meta = item["meta_info"]
        top = meta["output_top_logprobs"][0]
        out.append(({int(t): float(lp) for lp, t, _ in top}, int(meta.get("cached_tokens", 0))))
    return out


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p ‖ q) in nats from log-probabilities over the same support."""
    total = 0.0
    for t, lp in p.items():
        if lp == -math.inf:
            continue
        lq = q.get(t, -math.inf)
        total += math.exp(lp) * (lp - lq)
    return max(total, 0.0)


def _argmax(d: dict[int, float]) -> int:
    return max(d, key=lambda t: d[t])


def run_cases(
    base_url: str,
    cases: list[Case],
    vocab_size: int,
    *,
    batch: int = 32,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the three paths (and the fresh check) for every case. One dict per case."""
    client = LeylineClient(base_url)
    run = uuid.uuid4().hex[:8]
    rows: list[dict[str, Any]] = []
    try:
        for b0 in range(0, len(cases), batch):
            part = cases[b0 : b0 + batch]
            ids = range(b0, b0 + len(part))
            ns_a = [f"fid-{run}-{i}-a" for i in ids]
            ns_f = [f"fid-{run}-{i}-f" for i in ids]
            ns_0 = [f"fid-{run}-{i}-0" for i in ids]
            full = generate(client.http, [c.tokens for c in part] * 2, ns_a + ns_f, vocab_size)
            splices: dict[str, list[Any]] = {"amortize": [], "forget": []}
            for c, a, f in zip(part, ns_a, ns_f, strict=True):
                s, e = c.chunk
                for mode, key in ((Mode.AMORTIZE, a), (Mode.FORGET, f)):
                    d = Directive(start=s, end=e, replacement=c.stub, mode=mode)
                    splices[mode.value].append(client.splice(c.tokens, [d], extra_key=key))
            new = [edited(c) for c in part]
            after = generate(client.http, new * 3, ns_a + ns_f + ns_0, vocab_size)
            n = len(part)
            for k, c in enumerate(part):
                p_full, p_full_b = full[k][0], full[n + k][0]
                dist = {"amortize": after[k], "forget": after[n + k]}
                fresh = after[2 * n + k][0]
                s, e = c.chunk
                am, fo = splices["amortize"][k], splices["forget"][k]
                row: dict[str, Any] = {
                    "kind": c.kind,
                    "answer": c.answer,
                    "full_argmax": _argmax(p_full),
                    "full_repeat_kl": kl(p_full, p_full_b),
                    "kl_forget_fresh": kl(fresh, dist["forget"][0]),
                    "fresh_argmax": _argmax(fresh),
                    "mech": {
                        "amortize_in_place": am.in_place,
                        "amortize_prefilled": am.prefilled == len(c.stub),
                        "amortize_rotated": am.rotated == len(c.tokens) - e,
                        "forget_prefilled": fo.prefilled == len(new[k]) - s,
                        "amortize_cached": dist["amortize"][1] == len(new[k]) - 1,
                        "forget_cached": dist["forget"][1] == len(new[k]) - 1,
                    },
                }
                for path in PATHS:
                    p = dist[path][0]
                    row[f"{path}_argmax"] = _argmax(p)
                    row[f"{path}_kl"] = kl(p_full, p)
                    row[f"{path}_p_answer"] = math.exp(p.get(c.answer, -math.inf))
                row["full_p_answer"] = math.exp(p_full.get(c.answer, -math.inf))
                top2 = sorted(p_full.values(), reverse=True)[:2]
                row["full_margin"] = top2[0] - top2[1]  # nats between the two likeliest tokens
                rows.append(row)
            if progress:
                progress(len(part))
    finally:
        client.close()
    return rows


def reference_argmax(model_dir: Path, cases: list[Case]) -> tuple[list[int], list[int]]:
    """transformers' greedy next token (fp32, the saved weights) on each case's full context and
    on its edited context. Returns ``(full, edited)``, one token id per case."""
    from leyline_agent.bench.fidelity.train import load, predict

    model = load(Path(model_dir))
    return predict(model, [c.tokens for c in cases]), predict(model, [edited(c) for c in cases])


def add_reference(rows: list[dict[str, Any]], full: list[int], fresh: list[int]) -> None:
    """Attach the reference argmax (``reference_argmax``) to the per-case rows, in place."""
    for row, f, e in zip(rows, full, fresh, strict=True):
        row["hf_full_argmax"] = f
        row["hf_fresh_argmax"] = e


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def _rate(flags: list[bool]) -> dict[str, Any]:
    k, n = sum(flags), len(flags)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci95": [lo, hi]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, and for "real" (chunk matters) and "control" groups: agreement with the full
    context's argmax, task accuracy, mean and median KL(full ‖ path), mechanics pass counts."""
    groups: dict[str, list[dict[str, Any]]] = {
        k: [r for r in rows if r["kind"] == k] for k in KINDS
    }
    groups["real"] = [r for r in rows if r["kind"] in REAL_KINDS]
    groups["control"] = [r for r in rows if r["kind"] not in REAL_KINDS]
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        if not rs:
            continue
        g: dict[str, Any] = {
            "n": len(rs),
            "accuracy_full": _rate([r["full_argmax"] == r["answer"] for r in rs]),
        }
        if "hf_full_argmax" in rs[0]:
            g["accuracy_full_hf"] = _rate([r["hf_full_argmax"] == r["answer"] for r in rs])
        for path in PATHS:
            g[path] = {
                "agreement": _rate([r[f"{path}_argmax"] == r["full_argmax"] for r in rs]),
                "accuracy": _rate([r[f"{path}_argmax"] == r["answer"] for r in rs]),
                "kl_mean": _mean([r[f"{path}_kl"] for r in rs]),
                "kl_median": _median([r[f"{path}_kl"] for r in rs]),
                "p_answer_mean": _mean([r[f"{path}_p_answer"] for r in rs]),
            }
        g["p_answer_full_mean"] = _mean([r["full_p_answer"] for r in rs])
        out[name] = g
    mech_keys = rows[0]["mech"].keys() if rows else []
    out["mechanics"] = {m: sum(r["mech"][m] for r in rows) for m in mech_keys} | {"n": len(rows)}
    out["checks"] = {
        "full_repeat_kl_max": max((r["full_repeat_kl"] for r in rows), default=0.0),
        "forget_vs_fresh_kl_max": max((r["kl_forget_fresh"] for r in rows), default=0.0),
        "forget_vs_fresh_argmax_agree": sum(r["fresh_argmax"] == r["forget_argmax"] for r in rows),
    }
    if rows and "hf_full_argmax" in rows[0]:
        out["checks"] |= {
            "server_vs_hf_full_argmax_agree": sum(
                r["full_argmax"] == r["hf_full_argmax"] for r in rows
            ),
            "server_vs_hf_fresh_argmax_agree": sum(
                r["fresh_argmax"] == r["hf_fresh_argmax"] for r in rows
            ),
        }
    return out


def run(
    model_dir: Path,
    spec: BenchSpec,
    *,
    backend: str | None = None,
    dtype: str = "float32",
    reference: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate the cases, run them (starting a server on ``model_dir`` unless ``backend``), and
    return ``{"spec", "dtype", "arch", "model", "summary", "seconds", ...}`` (per-case rows under
    ``"cases"``). ``reference``: also compare the server's argmax with transformers' on the same
    contexts (``checks.server_vs_hf_*``; needs transformers and the weights in ``model_dir``).

    Raises ``FileNotFoundError`` when ``model_dir`` has no ``fidelity.json``."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    info_path = Path(model_dir) / "fidelity.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no fidelity.json: train it with leyline_agent.bench.fidelity.train"
        )
    info = json.loads(info_path.read_text())
    task = TaskSpec(**info["task"])
    cases = make_cases(spec.n, spec.seed, task)
    t0 = time.perf_counter()
    done = [0]

    def progress(k: int) -> None:
        done[0] += k
        rate = done[0] / (time.perf_counter() - t0)
        say(f"  {done[0]}/{len(cases)} cases  ({rate:.1f}/s)")

    if backend is None:
        from leyline_agent.backends.sglang.launch import EmbeddedServer

        say(f"starting leyline serve on {model_dir} ({dtype}) ...")
        with EmbeddedServer(
            model_path=Path(model_dir),
            max_total_tokens=32768,
            extra_args=["--dtype", dtype, "--skip-tokenizer-init"],
        ) as srv:
            say(f"server up in {time.perf_counter() - t0:.0f}s")
            t0 = time.perf_counter()
            rows = run_cases(srv.url, cases, task.vocab_size, batch=spec.batch, progress=progress)
    else:
        rows = run_cases(backend, cases, task.vocab_size, batch=spec.batch, progress=progress)
    seconds = round(time.perf_counter() - t0, 1)
    if reference:
        add_reference(rows, *reference_argmax(Path(model_dir), cases))
    return {
        "spec": asdict(spec),
        "dtype": dtype,
        "arch": info["train"].get("arch", "mla"),
        "model": {"dir": str(model_dir), **info},
        "summary": summarize(rows),
        "seconds": seconds,
        "cases": rows,
    }


def table(result: dict[str, Any]) -> str:
    """Plain-text table of the summary (one row per group)."""
    s = result["summary"]
    head = (
        f"{'group':<14}{'n':>5}{'acc full':>10}"
        f"{'agree A':>9}{'agree F':>9}{'acc A':>8}{'acc F':>8}{'KL A':>10}{'KL F':>10}"
    )
    lines = [head]
    for name in ("real", *KINDS, "control"):
        g = s.get(name)
        if g is None:
            continue
        a, f = g["amortize"], g["forget"]
        lines.append(
            f"{name:<14}{g['n']:>5}{g['accuracy_full']['rate']:>10.1%}"
            f"{a['agreement']['rate']:>9.1%}{f['agreement']['rate']:>9.1%}"
            f"{a['accuracy']['rate']:>8.1%}{f['accuracy']['rate']:>8.1%}"
            f"{a['kl_mean']:>10.2e}{f['kl_mean']:>10.2e}"
        )
    m = s["mechanics"]
    lines.append("mechanics (cases passing / n): " + ", ".join(f"{k} {v}" for k, v in m.items()))
    c = s["checks"]
    lines.append(
        f"checks: full repeat KL max {c['full_repeat_kl_max']:.1e}, FORGET vs fresh prefill "
        f"KL max {c['forget_vs_fresh_kl_max']:.1e}, argmax agree "
        f"{c['forget_vs_fresh_argmax_agree']}/{m['n']}"
    )
    if "server_vs_hf_full_argmax_agree" in c:
        lines.append(
            f"server vs transformers (fp32) argmax: full {c['server_vs_hf_full_argmax_agree']}"
            f"/{m['n']}, edited (fresh) {c['server_vs_hf_fresh_argmax_agree']}/{m['n']}; "
            "accuracy full (transformers) "
            + ", ".join(f"{k} {s[k]['accuracy_full_hf']['rate']:.1%}" for k in KINDS if k in s)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--n", type=int, default=BenchSpec.n, help="cases per kind")
    parser.add_argument("--batch", type=int, default=BenchSpec.batch)
    parser.add_argument("--seed", type=int, default=BenchSpec.seed)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default=None, help="URL of a running leyline serve")
    parser.add_argument("--out", type=Path, default=None, help="write bench.json here")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the transformers argmax check"
    )
    args = parser.parse_args(argv)
    spec = BenchSpec(n=args.n, batch=args.batch, seed=args.seed)
    result = run(
        args.model_path,
        spec,
        backend=args.backend,
        dtype=args.dtype,
        reference=not args.no_reference,
    )
    print(table(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bench-{args.dtype}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))


if __name__ == "__main__":
    main()
