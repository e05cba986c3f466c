"""Seeded random traffic against a real ``leyline serve``, checking integrity after every step.

Used by ``tests/test_splice_integrity.py`` (a short run in CI) and by
``experiments/backend/fuzz_splice.py`` (10,000 operations). The server should have a small pool
(1–2k tokens) so that most allocations evict, and ``LEYLINE_DEBUG_ENDPOINTS=1`` (KV rows).

Operations: generate with a reply of random length (the reply stays cached below the prompt, so
in-place splices take it over), splices with 1–4 AMORTIZE/FORGET directives, flushes, and
requests in other namespaces. After every step ``/leyline/stats`` must hold the idle invariants
(see ``backends/sglang/integrity.py``). ``page``: the server's ``--page-size`` (its tree holds full
pages only; the checks compare what it holds). On a sample of successful splices the KV rows are
checked (``invariants.check_rows``): MLA's latent (``c_kv``), or V and K outside the rope band
(MHA/GQA), bit-identical to their source rows; ``k_pe`` or K's rope band within 1 ulp of the
exact rotation to its new position.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from leyline_agent.backends.sglang.paged_plan import clip
from leyline_agent.directive import Directive, Mode, apply_directives
from leyline_agent.kernels.rope import RopeSpec
from leyline_agent.testing.invariants import check_rows, idle_invariants_hold, idle_stats


class InvariantBroken(AssertionError):
    """An integrity invariant or a KV-row check failed; the message names seed and step."""


@dataclass
class FuzzReport:
    seed: int
    steps: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    rows_checked: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "steps": self.steps,
            "ops": dict(self.ops),
            "statuses": dict(self.statuses),
            "rows_checked": self.rows_checked,
        }


class SpliceFuzzer:
    """Seeded random operations against ``base_url``; :meth:`run` raises ``InvariantBroken``.

    ``config``: the served model's HF config (optional; see ``self.spec``); ``page``: its
    ``--page-size``; rows are checked on the steps whose index is a multiple of
    ``check_rows_every`` when that step is a successful splice."""

    def __init__(
        self,
        base_url: str,
        seed: int,
        *,
        config: dict[str, Any] | None = None,
        check_rows_every: int = 5,
        max_reply: int = 24,
        page: int = 1,
    ):
        self.max_reply = max_reply
        self.page = page  # the server's --page-size: its tree holds full pages only
        self.http = httpx.Client(base_url=base_url, timeout=600)
        self.rng = random.Random(seed)
        self.report = FuzzReport(seed=seed)
        # the row check's oracle: the config's RoPE spec (and MLA's kv_lora_rank, the band's
        # offset) when given, else the spec and band the server reports with the rows
        self.lora = int(config["kv_lora_rank"]) if config and "kv_lora_rank" in config else None
        self.spec = RopeSpec.from_hf_config(config) if config else None
        self.check_rows_every = check_rows_every
        self.live: dict[str, list[int]] = {}  # namespace -> a prompt cached there
        self.keys = [f"fuzz-{seed}-{i}" for i in range(3)]

    def close(self) -> None:
        self.http.close()

    # ---- operations ----
    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 150000) for _ in range(n)]

    def _generate(self, key: str, ids: list[int], reply: int) -> dict[str, Any]:
        r = self.http.post(
            "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": reply,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                "extra_key": key,
            },
        )
        self.report.statuses[f"generate {r.status_code}"] += 1
        if r.status_code != 200:
            raise InvariantBroken(f"generate answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def op_generate(self) -> None:
        key = self.rng.choice(self.keys)
        base = self.live.get(key)
        if base and self.rng.random() < 0.6:
            ids = base + self._ids(self.rng.randrange(1, 40))  # the next turn
        else:
            ids = self._ids(self.rng.randrange(20, 400))
        out = self._generate(key, ids, self.rng.randrange(1, self.max_reply + 1))
        self.live[key] = ids if self.rng.random() < 0.5 else ids + list(out["output_ids"])[:-1]

    def op_other_namespace(self) -> None:
        self._generate(
            f"other-{self.rng.randrange(1000)}", self._ids(self.rng.randrange(50, 500)), 4
        )

    def op_flush(self) -> None:
        r = self.http.post("/flush_cache")
        self.report.statuses[f"flush {r.status_code}"] += 1
        self.live.clear()

    def op_splice(self, step: int) -> None:
        key = self.rng.choice(self.keys)
        toks = self.live.get(key)
        if not toks or len(toks) < 8:
            return self.op_generate()
        n = len(toks)
        k = self.rng.randrange(1, 5)
        cuts = sorted(self.rng.sample(range(n + 1), min(2 * k, n + 1)))
        ds = []
        for a, b in zip(cuts[::2], cuts[1::2], strict=False):
            repl = self._ids(self.rng.choice([0, 1, 3, 8, 20]))
            if a == b and not repl:
                continue
            mode = Mode.FORGET if self.rng.random() < 0.15 else Mode.AMORTIZE
            ds.append(Directive(start=a, end=b, replacement=tuple(repl), mode=mode))
        if not ds:
            return
        check = step % self.check_rows_every == 0
        before = self._rows(toks, key) if check else None
        body = {
            "tokens": toks,
            "directives": [d.model_dump(mode="json") for d in ds],
            "extra_key": key,
        }
        r = self.http.post("/leyline/splice", json=body)
        self.report.statuses[f"splice {r.status_code}"] += 1
        if r.status_code == 200:
            new = apply_directives(toks, ds)
            self.live[key] = new
            held = n // self.page * self.page
            if check and before is not None and before["cached"] == held:
                after = self._rows(new, key)
                # a paged tree holds the edit of its full pages (paged_plan.clip), in full pages
                kept = clip(sorted(ds, key=lambda d: d.start), held, n)
                expect = len(apply_directives(toks[:held], kept) if kept else toks[:held])
                if after["cached"] != expect // self.page * self.page:
                    raise InvariantBroken(
                        f"spliced sequence: {after['cached']} of {len(new)} cached (page "
                        f"{self.page}: {expect // self.page * self.page} expected)"
                    )
                self.report.rows_checked += check_rows(before, after, ds, self.lora, self.spec)
        elif r.status_code in (409, 503):
            self.live.pop(key, None)  # evicted or no room: the client would send it in full
        else:
            raise InvariantBroken(f"splice answered {r.status_code}: {r.text[:300]}")

    def _rows(self, toks: list[int], key: str) -> dict[str, Any]:
        r = self.http.post(
            "/leyline/debug/inspect", json={"op": "rows", "tokens": toks, "extra_key": key}
        )
        r.raise_for_status()
        return r.json()

    # ---- the loop ----
    def step(self, i: int) -> None:
        x = self.rng.random()
        if x < 0.35:
            op, fn = "generate", self.op_generate
        elif x < 0.80:
            op, fn = "splice", lambda: self.op_splice(i)
        elif x < 0.97:
            op, fn = "other_namespace", self.op_other_namespace
        else:
            op, fn = "flush", self.op_flush
        self.report.ops[op] += 1
        try:
            fn()
            st = idle_stats(self.http)
            if not idle_invariants_hold(st):
                raise InvariantBroken(f"invariants broken: {st}")
        except AssertionError as e:
            raise InvariantBroken(f"seed {self.report.seed}, step {i} ({op}): {e}") from e
        self.report.steps = i + 1

    def run(self, steps: int, progress: Any = None) -> FuzzReport:
        for i in range(steps):
            self.step(i)
            if progress is not None:
                progress(i + 1)
        return self.report
