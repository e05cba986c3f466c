"""Train the tiny model of the fidelity experiment (CPU, seeded, cached): MLA or GQA.

``arch="mla"`` (default): a ``DeepseekV2ForCausalLM`` from transformers (MLA: ``kv_lora_rank``
latent + ``qk_rope_head_dim`` rope key, YaRN rope with ``mscale = mscale_all_dim = 0.707``, every
layer dense). ``arch="gqa"``: a ``LlamaForCausalLM`` with ``kv_heads`` < ``heads`` KV heads of
``head_dim``, plain RoPE (θ 10000, NeoX halves). Either is trained on the task of ``task.py``
with the same recipe (AdamW, cosine schedule, seed, steps, batch). Loss is taken on the two positions whose next
token the task defines (the token after ``USE K_j`` and the answer). Saved with
``save_pretrained`` (``config.json`` + ``model.safetensors``, fp32) plus ``fidelity.json`` (task
spec, training spec, accuracies) so that SGLang serves it through its normal loader
(``--skip-tokenizer-init``: there is no tokenizer).

The output directory defaults to ``$LEYLINE_CACHE/fidelity-model/<hash>`` (``LEYLINE_CACHE``
defaults to ``~/.cache/leyline``), where the hash covers this file, ``task.py`` and the
arguments (``arch`` included); an existing complete directory is reused, so reruns and CI do
not retrain.

    python -m leyline_agent.bench.fidelity.train [--arch mla|gqa] [--steps N] [--out DIR] [--force]

Prints the full-context accuracy per task kind (and, for reference, the accuracy after the
chunk is replaced by the stub and the context re-prefilled: what FORGET computes), then one JSON
document as the last stdout line.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from leyline_agent.bench.fidelity.task import KINDS, PAD, Case, TaskSpec, edited, make_cases
from leyline_agent.bench.fidelity.task import training_example as task_example
from leyline_agent.cache import cache_root
from leyline_agent.embedded.model import TinyMLAConfig

FILES_HASHED = ("train.py", "task.py")

Arch = Literal["mla", "gqa"]
ARCHS: tuple[Arch, ...] = ("mla", "gqa")


@dataclass(frozen=True)
class TrainSpec:
    """Model shape and optimisation. Every field enters the cache hash.

    arch: ``mla`` (DeepSeek-V2: ``kv_lora_rank``, ``qk_*_head_dim``, ``v_head_dim`` apply) or
    ``gqa`` (Llama: ``kv_heads`` KV heads of ``head_dim``; ``heads`` query heads share them).
    """

    arch: Arch = "mla"
    seed: int = 0
    steps: int = 800
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    eval_cases: int = 200


class TrainResult(NamedTuple):
    model_dir: Path
    info: dict[str, Any]
    reused: bool


def model_config(spec: TrainSpec, task: TaskSpec) -> dict[str, Any]:
    """The Hugging Face config dict of ``spec.arch`` (transformers 5 spelling:
    ``rope_parameters``). MLA: every layer dense (no expert tensors), YaRN ×4 over 1,024
    positions. GQA: Llama, plain RoPE θ 10000, untied embeddings.

    Raises ``ValueError`` on an unknown arch or ``heads`` not a multiple of ``kv_heads``.
    """
    if spec.arch == "gqa":
        if spec.kv_heads < 1 or spec.heads % spec.kv_heads:
            raise ValueError(f"heads {spec.heads} must be a multiple of kv_heads {spec.kv_heads}")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": task.vocab_size,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": PAD,
            "torch_dtype": "float32",
        }
    if spec.arch != "mla":
        raise ValueError(f"unknown arch {spec.arch!r}; one of {ARCHS}")
    return TinyMLAConfig(
        vocab_size=task.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        dense_layers=spec.layers,
        num_attention_heads=spec.heads,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        max_position_embeddings=4096,
        yarn_factor=4.0,
        yarn_original_max_position_embeddings=1024,
        beta_fast=32.0,
        beta_slow=1.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        torch_dtype="float32",
        rope_key="rope_parameters",
    ).to_hf()


def spec_hash(spec: TrainSpec, task: TaskSpec) -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in FILES_HASHED:
        h.update((here / name).read_bytes())
    h.update(json.dumps([dataclasses.asdict(spec), dataclasses.asdict(task)]).encode())
    return h.hexdigest()[:16]


def default_out(spec: TrainSpec, task: TaskSpec) -> Path:
    return cache_root() / "fidelity-model" / spec_hash(spec, task)


def new_model(spec: TrainSpec, task: TaskSpec) -> Any:
    """A freshly initialised transformers model of ``spec.arch`` (fp32, seeded by the caller)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    cfg = model_config(spec, task)
    if spec.arch == "gqa":
        return LlamaForCausalLM(LlamaConfig(**cfg))
    return DeepseekV2ForCausalLM(DeepseekV2Config(**cfg))


def load(model_dir: Path) -> Any:
    """The saved model of ``model_dir`` in transformers (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _complete(out: Path) -> bool:
    return all((out / f).is_file() for f in ("config.json", "model.safetensors", "fidelity.json"))


@torch.no_grad()
def init_fact_embeddings(model: Any, task: TaskSpec) -> None:
    """Start each fact token ``F(k, v)`` at ``(E[K_k] + E[V_v]) / sqrt(2)``.

    Only the initialisation: training then moves every row freely. It gives the lookup "which fact
    names key k" a shared direction from step 0, which the task needs and which random rows take
    a long time to find on CPU.
    """
    emb = model.get_input_embeddings().weight
    for k in range(task.n_keys):
        for v in range(task.n_values):
            emb[task.fact(k, v)] = (emb[task.key(k)] + emb[task.value(v)]) / math.sqrt(2)


def _batch(rng: random.Random, task: TaskSpec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids ``[n, L]`` (right-padded) and targets ``[n, L]`` (-100 off the loss positions)."""
    examples = [task_example(rng, task) for _ in range(n)]
    length = max(len(e.tokens) for e in examples)
    ids = torch.full((n, length), PAD, dtype=torch.long)
    targets = torch.full((n, length), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.tokens)] = torch.tensor(e.tokens)
        for p in e.loss_positions:
            targets[i, p] = e.tokens[p + 1]
    return ids, targets


@torch.no_grad()
def predict(model: Any, contexts: list[list[int]], chunk: int = 256) -> list[int]:
    """Greedy next token after each context (left-padded batches)."""
    out: list[int] = []
    for i in range(0, len(contexts), chunk):
        part = contexts[i : i + chunk]
        length = max(len(c) for c in part)
        ids = torch.full((len(part), length), PAD, dtype=torch.long)
        mask = torch.zeros((len(part), length), dtype=torch.long)
        for r, c in enumerate(part):
            ids[r, length - len(c) :] = torch.tensor(c)
            mask[r, length - len(c) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        out += logits.argmax(-1).tolist()
    return out


def evaluate(model: Any, cases: list[Case]) -> dict[str, dict[str, float]]:
    """Accuracy per kind on the full context and on the edited context (re-prefilled)."""
    full = predict(model, [c.tokens for c in cases])
    forget = predict(model, [edited(c) for c in cases])
    res: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        idx = [i for i, c in enumerate(cases) if c.kind == kind]
        if not idx:
            continue
        res[kind] = {
            "n": len(idx),
            "full": sum(full[i] == cases[i].answer for i in idx) / len(idx),
            "reprefill": sum(forget[i] == cases[i].answer for i in idx) / len(idx),
        }
    return res


def train(
    spec: TrainSpec | None = None,
    task: TaskSpec | None = None,
    out: Path | None = None,
    *,
    force: bool = False,
    log: Any = None,
) -> TrainResult:
    """Train (or reuse) the model; returns its directory and ``fidelity.json``'s content.

    ``log``: a callable taking a string (progress lines); default prints to stderr.
    Raises ``OSError`` on an unwritable ``out``.
    """
    spec = spec or TrainSpec()
    task = task or TaskSpec()
    out = Path(out) if out is not None else default_out(spec, task)
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if _complete(out) and not force:
        info = json.loads((out / "fidelity.json").read_text())
        say(f"reusing trained model {out}")
        return TrainResult(out, info, True)

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    model = new_model(spec, task)
    init_fact_embeddings(model, task)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay
    )

    def lr_at(step: int) -> float:
        if step < spec.warmup:
            return spec.lr * (step + 1) / spec.warmup
        t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return spec.lr * 0.5 * (1 + math.cos(math.pi * t))

    t0 = time.perf_counter()
    curve: list[tuple[int, float]] = []
    running = None
    for step in range(spec.steps):
        ids, targets = _batch(rng, task, spec.batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 100 == 0 or step == spec.steps - 1:
            curve.append((step, round(running, 4)))
            say(f"step {step:5d}  loss {running:.3f}  {time.perf_counter() - t0:6.0f}s")
    train_s = time.perf_counter() - t0

    model.eval()
    cases = make_cases(spec.eval_cases, seed=10_000 + spec.seed, spec=task)
    acc = evaluate(model, cases)
    info = {
        "task": dataclasses.asdict(task),
        "train": dataclasses.asdict(spec),
        "params": params,
        "train_seconds": round(train_s, 1),
        "loss_curve": curve,
        "accuracy": acc,
        "chance": 1 / task.n_values,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    # NOTE: transformers 5 drops keys its config class does not declare; SGLang's DeepseekV2 reads
    # moe_layer_freq (and torch_dtype for --dtype auto).
    cfg.update(torch_dtype="float32")
    if spec.arch == "mla":
        cfg.update(moe_layer_freq=1)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "fidelity.json").write_text(json.dumps(info, indent=2))  # written last: "complete"
    return TrainResult(out, info, False)


def accuracy_table(info: dict[str, Any]) -> str:
    lines = [f"{'kind':<14}{'n':>6}{'full ctx':>10}{'re-prefill':>12}"]
    for kind, row in info["accuracy"].items():
        lines.append(f"{kind:<14}{row['n']:>6}{row['full']:>10.1%}{row['reprefill']:>12.1%}")
    lines.append(f"chance {info['chance']:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainSpec()
    parser.add_argument("--arch", choices=ARCHS, default=defaults.arch)
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: cache)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="retrain even if cached")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = dataclasses.replace(
        defaults,
        arch=args.arch,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        layers=args.layers,
        seed=args.seed,
    )
    res = train(spec, out=args.out, force=args.force)
    print(accuracy_table(res.info))
    print(json.dumps({"model_dir": str(res.model_dir), "reused": res.reused, **res.info}))


if __name__ == "__main__":
    main()
