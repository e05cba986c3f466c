"""Tables, ``results.json`` and ``fidelity.png`` from the parts of the fidelity experiment.

Parts (any may be missing): the divergence benchmark per model arch and KV dtype
(``divergence.run``; keyed by a label such as ``float32`` or ``gqa-float32``), the architecture
checks (``arch_check.run``), the rope drift (``drift.run``). The plot has one
panel per part: argmax agreement with the full context and task accuracy per path and case
group; mean KL(full ‖ path) per group (log scale); drift vs number of splices (log-log) with the
paper's 4.7e-3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from leyline_agent.bench.fidelity import arch_check, divergence, drift
from leyline_agent.runinfo import environment

GROUPS = ("carried", "direct", "carried_ctrl", "direct_ctrl")


def consistency_errors(result: dict[str, Any]) -> list[str]:
    """Recompute a bench result's summary from its per-case rows; list every mismatch."""
    errors: list[str] = []
    again = divergence.summarize(result["cases"])
    for name, g in result["summary"].items():
        if name in ("mechanics", "checks"):
            if g != again[name]:
                errors.append(f"{name}: {g} != {again[name]}")
            continue
        h = again[name]
        if g["n"] != h["n"]:
            errors.append(f"{name}: n {g['n']} != {h['n']}")
        for path in divergence.PATHS:
            for metric in ("agreement", "accuracy"):
                a, b = g[path][metric], h[path][metric]
                if (a["k"], a["n"]) != (b["k"], b["n"]) or not 0 <= a["rate"] <= 1:
                    errors.append(f"{name}.{path}.{metric}: {a} vs {b}")
            if not math.isclose(g[path]["kl_mean"], h[path]["kl_mean"], rel_tol=1e-9):
                errors.append(f"{name}.{path}.kl_mean: {g[path]['kl_mean']} vs recomputed")
    s = result["summary"]
    if "real" in s and "control" in s:
        total = s["real"]["n"] + s["control"]["n"]
        if total != len(result["cases"]):
            errors.append(f"real + control = {total} != {len(result['cases'])} cases")
    return errors


def bench_label(arch: str, dtype: str) -> str:
    """The key of one divergence run: ``dtype`` for the MLA model (as before GQA existed),
    ``<arch>-<dtype>`` otherwise; also names ``cases-<label>.jsonl``."""
    return dtype if arch == "mla" else f"{arch}-{dtype}"


def compare_table(benches: dict[str, dict[str, Any]]) -> str:
    """One row per case group and run (``<arch>-<dtype>``): accuracy of the full context
    (server, and transformers when checked), argmax agreement with it and accuracy of AMORTIZE /
    FORGET, mean KL(full ‖ path) in nats. Rates in %, agreement with its 95% Wilson interval."""
    head = (
        f"{'group':<14}{'run':<16}{'n':>5}{'acc full':>10}{'(hf)':>7}"
        f"{'agree A [95% CI]':>24}{'agree F [95% CI]':>24}{'acc A':>8}{'acc F':>8}"
        f"{'KL A':>10}{'KL F':>10}"
    )
    lines = [head]
    for group in ("carried", "direct", "carried_ctrl", "direct_ctrl", "real", "control"):
        for label, res in benches.items():
            g = res["summary"].get(group)
            if g is None:
                continue
            run = f"{res.get('arch', 'mla')}-{res.get('dtype', label)}"
            hf = g.get("accuracy_full_hf")
            cells = []
            for path in divergence.PATHS:
                a = g[path]["agreement"]
                lo, hi = a["ci95"]
                cells.append(f"{a['rate']:.1%} [{lo:.1%}, {hi:.1%}]")
            lines.append(
                f"{group:<14}{run:<16}{g['n']:>5}{g['accuracy_full']['rate']:>10.1%}"
                + (f"{hf['rate']:>7.1%}" if hf else f"{'-':>7}")
                + "".join(f"{c:>24}" for c in cells)
                + f"{g['amortize']['accuracy']['rate']:>8.1%}{g['forget']['accuracy']['rate']:>8.1%}"
                + f"{g['amortize']['kl_mean']:>10.2e}{g['forget']['kl_mean']:>10.2e}"
            )
    return "\n".join(lines)


def plot(benches: dict[str, dict[str, Any]], drift_res: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = max(2 * len(benches) + (1 if drift_res else 0), 1)
    cols = min(panels, 2)
    rows = math.ceil(panels / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.4 * rows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[panels:]:
        ax.set_visible(False)
    ax_i = 0
    width = 0.2
    for label, res in benches.items():
        s = res["summary"]
        groups = [g for g in GROUPS if g in s]
        xs = range(len(groups))
        ax = axes[ax_i]
        bars = [
            ("agree A", "amortize", "agreement", "tab:blue", None),
            ("agree F", "forget", "agreement", "tab:orange", None),
            ("acc A", "amortize", "accuracy", "tab:blue", "//"),
            ("acc F", "forget", "accuracy", "tab:orange", "//"),
        ]
        for i, (label, path_name, metric, color, hatch) in enumerate(bars):
            ax.bar(
                [x + (i - 1.5) * width for x in xs],
                [s[g][path_name][metric]["rate"] for g in groups],
                width,
                label=label,
                color=color,
                hatch=hatch,
                alpha=0.55 if hatch else 0.9,
                edgecolor="black",
                linewidth=0.4,
            )
        ax.scatter(
            list(xs),
            [s[g]["accuracy_full"]["rate"] for g in groups],
            marker="_",
            s=400,
            color="black",
            label="acc full",
            zorder=3,
        )
        chance = res["model"].get("chance")
        if chance:
            ax.axhline(chance, color="gray", ls=":", lw=1, label="chance")
        ax.set_xticks(list(xs), groups, fontsize=8)
        ax.set_ylim(0, 1.3)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_title(f"agreement with full ctx / accuracy ({label}, n={res['spec']['n']}/kind)")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
        ax_i += 1
        ax = axes[ax_i]
        for i, (path_name, color) in enumerate(
            (("amortize", "tab:blue"), ("forget", "tab:orange"))
        ):
            vals = [max(s[g][path_name]["kl_mean"], 1e-12) for g in groups]
            ax.bar([x + (i - 0.5) * 0.35 for x in xs], vals, 0.35, label=path_name, color=color)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), groups, fontsize=8)
        ax.set_title(f"mean KL(full ‖ path), nats ({label})")
        ax.legend(fontsize=7)
        ax_i += 1
    if drift_res:
        ax = axes[ax_i]
        cps = [c for c in drift_res["checkpoints"] if c > 0]
        for row in drift_res["rows"]:
            ax.plot(
                cps,
                [drift.rel_l2_at(row, c) for c in cps],
                marker="o",
                ls="-" if row["math"] == "fp32" else "--",
                label=f"{row['dtype']} storage, {row['math']} math",
            )
        ax.axhline(drift_res["paper_bf16_rel_l2"], color="red", ls=":", label="paper bf16 4.7e-3")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("composed splices")
        ax.set_title("rope-band relative L2 drift")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build(
    out: Path,
    benches: dict[str, dict[str, Any]],
    archs: dict[str, Any] | None = None,
    drift_res: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """Write ``results.json``, ``cases-<label>.jsonl`` and ``fidelity.png`` into ``out``.

    ``benches``: divergence results by label (``bench_label``). Returns ``(results,
    tables_text)``; the text adds ``compare_table`` when the runs cover more than one arch.
    """
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"experiment": "fidelity", "environment": environment(), "bench": {}}
    texts: list[str] = []
    for label, res in benches.items():
        slim = {k: v for k, v in res.items() if k != "cases"}
        slim["consistency_errors"] = consistency_errors(res)
        results["bench"][label] = slim
        with (out / f"cases-{label}.jsonl").open("w") as f:
            for row in res["cases"]:
                f.write(json.dumps(row) + "\n")
        acc = res["model"].get("accuracy", {})
        texts.append(
            f"== divergence benchmark, {res.get('arch', 'mla')} model, KV {res['dtype']}, "
            f"{res['spec']['n']} cases per kind "
            f"({res['seconds']:.0f}s) ==\n"
            + "model full-context accuracy at training time: "
            + ", ".join(f"{k} {v['full']:.1%}" for k, v in acc.items())
            + f" (chance {res['model'].get('chance', float('nan')):.1%})\n"
            + divergence.table(res)
        )
    if len({res.get("arch", "mla") for res in benches.values()}) > 1:
        texts.append("== MLA vs GQA ==\n" + compare_table(benches))
    if archs:
        results["architectures"] = archs
        texts.append(
            "== architectures (dummy weights, bf16) ==\n" + arch_check.table(archs["rows"])
        )
    if drift_res:
        results["drift"] = drift_res
        texts.append("== rope drift ==\n" + drift.table(drift_res))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if benches or drift_res:
        plot(benches, drift_res, out / "fidelity.png")
    return results, "\n\n".join(texts)
