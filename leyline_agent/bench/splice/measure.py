"""The measurement of ``leyline bench splice`` (method in the package docstring): the spec, one
trial per (length, repeat), the run."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from leyline_agent.bench.splice.memory import MemoryProbe, NoMemory
from leyline_agent.client import LeylineClient, SpliceRejected
from leyline_agent.directive import Directive, Mode

DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)
TOKEN_RANGE = (1000, 30000)  # ids every common vocabulary has, none of them special


class SpliceBenchSpec(BaseModel):
    """What to measure (the CLI's options; recorded in ``results.json``).

    lengths: cached sequence lengths ``L`` in tokens.
    repeats: trials per length; the report gives medians.
    edit_start, edit_end: the replaced span ``[start, end)`` of the cached sequence.
    replacement: tokens of the replacement.
    new_tokens: tokens appended after the edited sequence in the next request.
    seed: seeds the token ids.
    """

    model_config = ConfigDict(frozen=True)

    lengths: list[int] = Field(default_factory=lambda: list(DEFAULT_LENGTHS), min_length=1)
    repeats: int = Field(default=3, ge=1)
    edit_start: int = Field(default=16, ge=0)
    edit_end: int = 48
    replacement: int = Field(default=8, ge=0)
    new_tokens: int = Field(default=4, ge=1)
    seed: int = 0
    backend: str | None = None

    @field_validator("lengths")
    @classmethod
    def _sorted_unique(cls, lengths: list[int]) -> list[int]:
        if len(set(lengths)) != len(lengths) or any(n < 1 for n in lengths):
            raise ValueError(f"lengths must be distinct positive integers, got {lengths}")
        return sorted(lengths)

    def check(self) -> None:
        """Raises ``ValueError`` when the edit does not fit the shortest length."""
        if not self.edit_start < self.edit_end:
            raise ValueError(f"edit [{self.edit_start}, {self.edit_end}) is empty")
        if self.edit_end >= self.lengths[0]:
            raise ValueError(
                f"edit end {self.edit_end} must lie inside the shortest length {self.lengths[0]}"
            )


class Trial(BaseModel):
    """One repeat at one length (times in milliseconds, client-side wall time).

    splice_ms: the splice call; splice_server_ms: the server's own ``elapsed_ms``;
    timings_ms: the server's breakdown (empty when it reports none).
    next_ms: the request after the splice; next_cached: its cached tokens (== spliced_length on a
    hit). reprefill_ms / reprefill_cached: the same request in a cold namespace.
    memory: the probe's reading after each phase, ``{"splice": {...}, "reprefill": {...}}``.
    """

    length: int
    repeat: int
    spliced_length: int
    prefilled: int
    rotated: int
    splice_ms: float
    splice_server_ms: float
    timings_ms: dict[str, float]
    next_ms: float
    next_prompt: int
    next_cached: int
    reprefill_ms: float
    reprefill_cached: int
    memory: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def splice_total_ms(self) -> float:
        return self.splice_ms + self.next_ms


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def splice_raw(
    client: LeylineClient, tokens: Sequence[int], directive: Directive, extra_key: str
) -> tuple[dict[str, Any], float]:
    """``POST /leyline/splice``; returns the response body (with ``timings_ms`` when the server
    sends it, which ``LeylineClient.splice`` drops) and the wall time in ms.

    Raises:
        SpliceRejected: any status but 200.
    """
    body = {
        "tokens": list(tokens),
        "directives": [directive.model_dump(mode="json")],
        "extra_key": extra_key,
    }
    t0 = time.perf_counter()
    r = client.http.post("/leyline/splice", json=body)
    ms = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        raise SpliceRejected(r.status_code, r.text[:500])
    return r.json(), ms


def run_trial(
    client: LeylineClient,
    spec: SpliceBenchSpec,
    length: int,
    repeat: int,
    run_id: str,
    probe: MemoryProbe | None = None,
) -> Trial:
    """Setup, (a) splice + next request, (b) cold re-prefill; see the module docstring. The probe
    is reset before and read after each of (a) and (b)."""
    probe = probe or NoMemory()
    rng = random.Random(f"{spec.seed}:{length}:{repeat}")
    tokens = _ids(rng, length)
    repl = _ids(rng, spec.replacement)
    tail = _ids(rng, spec.new_tokens)
    ns = f"bench-splice:{run_id}:{length}:{repeat}"
    client.generate(tokens, extra_key=ns, max_new_tokens=1)

    d = Directive(
        start=spec.edit_start, end=spec.edit_end, replacement=tuple(repl), mode=Mode.AMORTIZE
    )
    edited = tokens[: spec.edit_start] + repl + tokens[spec.edit_end :]
    probe.reset()
    res, splice_ms = splice_raw(client, tokens, d, ns)
    nxt = client.generate(edited + tail, extra_key=ns, max_new_tokens=1)
    mem_splice = probe.read()
    probe.reset()
    cold = client.generate(edited + tail, extra_key=f"{ns}:cold", max_new_tokens=1)
    mem_cold = probe.read()
    return Trial(
        length=length,
        repeat=repeat,
        spliced_length=int(res["new_length"]),
        prefilled=int(res["prefilled"]),
        rotated=int(res["rotated"]),
        splice_ms=splice_ms,
        splice_server_ms=float(res["elapsed_ms"]),
        timings_ms={k: float(v) for k, v in (res.get("timings_ms") or {}).items()},
        next_ms=nxt.e2e_ms,
        next_prompt=nxt.prompt_tokens,
        next_cached=nxt.cached_tokens,
        reprefill_ms=cold.e2e_ms,
        reprefill_cached=cold.cached_tokens,
        memory={"splice": mem_splice, "reprefill": mem_cold},
    )


def run(
    spec: SpliceBenchSpec,
    client: LeylineClient,
    *,
    probe: MemoryProbe | None = None,
    log: Callable[[str], None] = lambda _line: None,
    warmup: bool = True,
) -> list[Trial]:
    """Every (length, repeat) trial, lengths in increasing order. A warmup trial at the shortest
    length runs first and is not recorded.

    Raises:
        ValueError: the edit does not fit (``spec.check``).
        SpliceRejected, httpx.HTTPError: the backend refused or failed a request.
    """
    spec.check()
    run_id = uuid.uuid4().hex[:8]
    if warmup:
        run_trial(client, spec, spec.lengths[0], -1, run_id)
    trials: list[Trial] = []
    for length in spec.lengths:
        for rep in range(spec.repeats):
            t = run_trial(client, spec, length, rep, run_id, probe)
            trials.append(t)
            log(
                f"L={length} repeat {rep + 1}/{spec.repeats}: splice+next "
                f"{t.splice_total_ms:.0f} ms, re-prefill {t.reprefill_ms:.0f} ms, "
                f"cached {t.next_cached}/{t.next_prompt}"
            )
    return trials
