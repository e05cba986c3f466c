"""The splice-mechanics checks on the four MLA shapes of ``architectures.py``: serve each one
(``leyline serve``, dummy weights, debug endpoints), check, tabulate.

Checks, for a δ < 0 and a δ > 0 AMORTIZE splice on a 64-token sequence:

- latent bit-identical: every downstream row's ``c_kv`` bits equal the pre-splice bits;
- rope band exact: the stored ``k_pe`` equals the fp64 rotation of the old one by δ to 1 bf16 ulp
  (``RopeSpec.from_hf_config`` of the served config);
- cached after splice: the spliced sequence is in the tree and a follow-up ``/generate`` reuses
  all of it but the last token;
- KL(full ‖ AMORTIZE), KL(full ‖ FORGET) and KL(fresh ‖ FORGET) of the next-token distribution.
  SGLang's dummy weights (uniform in ±1e-3) give an almost flat distribution (``logprob_spread``
  = max - min log-probability is printed), so these KLs are ~0 and say nothing about quality;
  the trained model of ``divergence.py`` is where KL means something.

If the server does not start, the model is retried with plain RoPE written as YaRN of factor 1
(SGLang 0.5.23's CPU rope needs a scaling dict; see ``architectures.PLAIN_ROPE_AS_YARN``), then
with the MoE layer made dense; every failure is kept in the row's ``errors``.

    python -m leyline_agent.bench.fidelity.arch_check [--only NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch

from leyline_agent.bench.fidelity import architectures
from leyline_agent.bench.fidelity.architectures import ARCHS, VOCAB, Arch, hf_config
from leyline_agent.bench.fidelity.divergence import generate, kl
from leyline_agent.directive import Directive, Mode, apply_directives
from leyline_agent.kernels.rope import RopeSpec, rotate
from leyline_agent.testing.numerics import bf16_ulp

# the command line's description, as ``python -m leyline_agent.bench.fidelity.architectures``
DESCRIPTION = (architectures.__doc__ or "").splitlines()[0]


def _rows(http: httpx.Client, tokens: list[int], key: str) -> dict[str, Any]:
    r = http.post("/leyline/debug/inspect", json={"op": "rows", "tokens": tokens, "extra_key": key})
    r.raise_for_status()
    return r.json()


def check_splices(url: str, cfg: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """The mechanics checks against a running server (debug endpoints on)."""
    lora, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    spec = RopeSpec.from_hf_config(cfg)
    rng = random.Random(seed)
    out: dict[str, Any] = {"latent_identical": True, "rope_max_ulp": 0.0, "cached": True}
    kls: dict[str, list[float]] = {"full_amortize": [], "full_forget": [], "fresh_forget": []}
    run = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=url, timeout=600) as http:
        for delta in (-4, 5):
            toks = [rng.randrange(2, VOCAB) for _ in range(64)]
            s, e = 20, 30
            repl = tuple(rng.randrange(2, VOCAB) for _ in range(e - s + delta))
            ka, kf, k0 = (f"arch-{run}-{delta}-{x}" for x in "af0")
            full = generate(http, [toks, toks], [ka, kf], VOCAB)
            lps = full[0][0].values()
            out["logprob_spread"] = max(out.get("logprob_spread", 0.0), max(lps) - min(lps))
            before = _rows(http, toks, ka)
            for key, mode in ((ka, Mode.AMORTIZE), (kf, Mode.FORGET)):
                d = Directive(start=s, end=e, replacement=repl, mode=mode)
                body = {"tokens": toks, "directives": [d.model_dump(mode="json")], "extra_key": key}
                r = http.post("/leyline/splice", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"splice {mode} failed ({r.status_code}): {r.text[:300]}")
            new = apply_directives(toks, [Directive(start=s, end=e, replacement=repl)])
            after = _rows(http, new, ka)
            out["cached"] &= after["cached"] == len(new)
            for layer in range(len(before["bits"])):
                ob, nb = torch.tensor(before["bits"][layer]), torch.tensor(after["bits"][layer])
                out["latent_identical"] &= bool(torch.equal(nb[:s], ob[:s]))
                out["latent_identical"] &= bool(torch.equal(nb[e + delta :, :lora], ob[e:, :lora]))
                old_pe = torch.tensor(before["values"][layer], dtype=torch.float64)[e:, lora:]
                new_pe = torch.tensor(after["values"][layer], dtype=torch.float64)[
                    e + delta :, lora:
                ]
                if old_pe.shape[-1] != rope_dim:
                    raise RuntimeError(
                        f"KV row has a {old_pe.shape[-1]}-wide rope band, not {rope_dim}"
                    )
                exact = rotate(old_pe, torch.full((old_pe.shape[0],), delta), spec)
                ulps = ((new_pe - exact).abs() / bf16_ulp(exact)).max().item()
                out["rope_max_ulp"] = max(out["rope_max_ulp"], ulps)
            gen = generate(http, [new, new, new], [ka, kf, k0], VOCAB)
            out["cached"] &= gen[0][1] == len(new) - 1 and gen[1][1] == len(new) - 1
            kls["full_amortize"].append(kl(full[0][0], gen[0][0]))
            kls["full_forget"].append(kl(full[1][0], gen[1][0]))
            kls["fresh_forget"].append(kl(gen[2][0], gen[1][0]))
    out["rope_exact"] = out["rope_max_ulp"] <= 1.0
    out["kl"] = {k: max(v) for k, v in kls.items()}
    out["dtype"] = before["dtype"]
    return out


def run_arch(arch: Arch, workdir: Path, log: Any) -> dict[str, Any]:
    """Serve ``arch`` (MoE layer first; all-dense if that fails) and run the checks."""
    from leyline_agent.backends.sglang.launch import EmbeddedServer, ServerError

    row: dict[str, Any] = {
        "name": arch.name,
        "architecture": arch.architecture,
        "source": arch.source,
        "notes": list(arch.notes),
        "shapes": arch.shapes,
    }
    errors: list[str] = []
    attempts = [(True, False)]  # (MoE layer, plain rope served as YaRN factor 1)
    while attempts:
        moe, as_yarn = attempts.pop(0)
        cfg = hf_config(arch, moe=moe, plain_rope_as_yarn=as_yarn)
        label = ("dense+MoE" if moe else "dense") + (", rope as YaRN f=1" if as_yarn else "")
        d = workdir / f"{arch.name}-{'moe' if moe else 'dense'}{'-yarn1' if as_yarn else ''}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        t0 = time.perf_counter()
        log(f"{arch.name}: serving {arch.architecture} ({label}) ...")
        try:
            with EmbeddedServer(
                model_path=d,
                max_total_tokens=4096,
                timeout=600,
                extra_args=["--dtype", "bfloat16", "--load-format", "dummy"]
                + ["--skip-tokenizer-init"],
                env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
            ) as srv:
                row["startup_s"] = round(time.perf_counter() - t0, 1)
                row.update(check_splices(srv.url, cfg))
        except (ServerError, RuntimeError, httpx.HTTPError) as e:
            msg = str(e).strip().splitlines()
            errors.append(f"{label}: " + " | ".join(msg[-6:])[-800:])
            log(f"  failed: {errors[-1][:300]}")
            if "rope_scaling is not None" in str(e) and not as_yarn:
                attempts.append((moe, True))
            elif moe:
                attempts.append((False, as_yarn))
            continue
        row.update(served=True, moe_layer=moe, rope_served_as_yarn_f1=as_yarn, errors=errors)
        return row
    row.update(served=False, errors=errors)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<19}{'class':<24}{'heads':>6}{'lora':>6}{'nope':>6}{'rope':>6}{'v':>5}"
        f"{'served':>8}{'MoE':>5}{'latent=':>9}{'rope ulp':>9}{'cached':>8}"
        f"{'KL(full|A)':>12}{'KL(full|F)':>12}{'KL(fresh|F)':>12}{'lp spread':>10}"
    )
    lines = [head]
    for r in rows:
        s = r["shapes"]
        base = (
            f"{r['name']:<19}{r['architecture']:<24}{s['num_attention_heads']:>6}"
            f"{s['kv_lora_rank']:>6}{s['qk_nope_head_dim']:>6}{s['qk_rope_head_dim']:>6}"
            f"{s['v_head_dim']:>5}"
        )
        if not r.get("served"):
            lines.append(base + f"{'no':>8}   see errors")
            continue
        k = r["kl"]
        served = "yes*" if r.get("rope_served_as_yarn_f1") else "yes"
        lines.append(
            base + f"{served:>8}{'yes' if r['moe_layer'] else 'no':>5}"
            f"{str(r['latent_identical']):>9}{r['rope_max_ulp']:>9.2f}{str(r['cached']):>8}"
            f"{k['full_amortize']:>12.1e}{k['full_forget']:>12.1e}{k['fresh_forget']:>12.1e}"
            f"{r['logprob_spread']:>10.1e}"
        )
    lines.append(
        "  yes*: served with rope_scaling = YaRN factor 1 (numerically plain RoPE): SGLang 0.5.23's "
        "CPU rope (get_rope_cpu) supports only deepseek_yarn and asserts rope_scaling is not None"
    )
    for r in rows:
        for note in r["notes"]:
            lines.append(f"  {r['name']}: {note}")
        lines.append(f"  {r['name']}: source {r['source']}")
        for err in r.get("errors", []):
            lines.append(f"  {r['name']}: error {err[:400]}")
    return "\n".join(lines)


def run(only: str | None = None, log: Any = None) -> dict[str, Any]:
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    archs = [a for a in ARCHS if only is None or a.name == only]
    if not archs:
        raise ValueError(f"unknown model {only!r}; one of {[a.name for a in ARCHS]}")
    with tempfile.TemporaryDirectory(prefix="leyline-arch-") as tmp:
        rows = [run_arch(a, Path(tmp), say) for a in archs]
    return {"experiment": "architectures", "vocab": VOCAB, "layers": 2, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--only", default=None, help="one model name")
    parser.add_argument("--out", type=Path, default=None, help="write architectures.json here")
    args = parser.parse_args(argv)
    result = run(args.only)
    print(table(result["rows"]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "architectures.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
