"""The synthetic task of the fidelity experiment: facts in removable chunks, used downstream.

A document (token ids of a tiny vocabulary, no tokenizer)::

    BOS  w*  [SEP f f f SEP]  w*  [SEP f f f SEP]  w*  USE K_j X  w*  QUERY
              chunk A                chunk B

- ``f`` is a fact token ``F(k, v)``: one token that says "key k has value v" (binding by
  adjacency, ``K_k V_v``, did not train in CPU budgets; see docs/fidelity.md).
- ``USE K_j X`` uses key j downstream. Its next token ``X`` is the value ``V_{v_j}`` (written)
  or ``MASK`` (redacted), half and half in training, so the position of ``K_j`` must compute
  ``v_j`` from the chunk to predict its own next token. Evaluation contexts always redact it:
  no downstream token restates the fact.
- ``QUERY`` is ``QU`` ("the value of the used key", answer ``V_{v_j}``) or ``QK K_m`` ("the
  value of key m", answer ``V_{v_m}``).

The removable chunk is A or B (``SEP f f f SEP``); an edit replaces it by the one-token stub
``STUB``. Evaluation kinds (answers are those of the full, unedited context):

  kind          query    fact the answer needs                                 chunk matters
  carried       QU       in the removed chunk; downstream K_j needed it to     yes
                         predict its own next token (the value or MASK)
  direct        QK K_m   in the removed chunk; no downstream token needed it   yes
  carried_ctrl  QU       in the kept chunk                                     no
  direct_ctrl   QK K_m   in the kept chunk                                     no

Pure Python (no torch): the benchmark, the tests and the trainer import it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, NamedTuple

Kind = Literal["carried", "direct", "carried_ctrl", "direct_ctrl"]
KINDS: tuple[Kind, ...] = ("carried", "direct", "carried_ctrl", "direct_ctrl")
REAL_KINDS: frozenset[str] = frozenset({"carried", "direct"})

PAD, BOS, SEP, USE, MASK, STUB, QU, QK = range(8)
N_FILLER = 16
FILLER0 = 8


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the task. The vocabulary follows from them (`vocab_size`).

    n_keys / n_values: key and value alphabet sizes (chance accuracy is ``1 / n_values``).
    facts_per_chunk: facts in each of the two chunks (keys distinct within a document).
    max_fill: filler runs are 0..max_fill tokens long.
    p_written: training only: probability that ``USE K_j`` is followed by the value (else MASK).
    p_stub: training only: probability that one chunk irrelevant to the query is already a stub.
    p_use_query: training only: probability of the ``QU`` query (else ``QK K_m``).
    """

    n_keys: int = 16
    n_values: int = 16
    facts_per_chunk: int = 3
    max_fill: int = 6
    p_written: float = 0.5
    p_stub: float = 0.2
    p_use_query: float = 0.5

    def __post_init__(self) -> None:
        if 2 * self.facts_per_chunk > self.n_keys:
            raise ValueError("n_keys must be >= 2 * facts_per_chunk (keys are distinct)")
        if min(self.n_keys, self.n_values, self.facts_per_chunk) < 1 or self.max_fill < 0:
            raise ValueError("sizes must be positive and max_fill >= 0")

    # ---- vocabulary ------------------------------------------------------------------------
    def key(self, k: int) -> int:
        return FILLER0 + N_FILLER + k

    def value(self, v: int) -> int:
        return FILLER0 + N_FILLER + self.n_keys + v

    def fact(self, k: int, v: int) -> int:
        return FILLER0 + N_FILLER + self.n_keys + self.n_values + k * self.n_values + v

    @property
    def value_ids(self) -> range:
        return range(self.value(0), self.value(self.n_values))

    @property
    def vocab_size(self) -> int:
        return self.fact(self.n_keys - 1, self.n_values - 1) + 1


class Case(NamedTuple):
    """One evaluation context.

    tokens: the context, ending with the query; the model's next token is the answer.
    answer: the correct answer's token id for the full (unedited) context.
    chunk: ``[start, end)`` of the removable chunk in ``tokens``.
    stub: the replacement of the chunk.
    kind: see the module docstring.
    """

    kind: Kind
    tokens: list[int]
    answer: int
    chunk: tuple[int, int]
    stub: tuple[int, ...]


class Example(NamedTuple):
    """A training document: ``tokens`` and the positions whose next token is trained on."""

    tokens: list[int]
    loss_positions: list[int]


def _fill(rng: random.Random, spec: TaskSpec) -> list[int]:
    return [FILLER0 + rng.randrange(N_FILLER) for _ in range(rng.randint(0, spec.max_fill))]


def _document(
    rng: random.Random,
    spec: TaskSpec,
    *,
    used_chunk: int,
    query: Literal["use", "key"],
    key_chunk: int,
    written: bool,
    stub_chunk: int | None = None,
) -> tuple[list[int], int, list[tuple[int, int]], int]:
    """Build one document. Returns ``(tokens, answer, chunk_spans, use_position)``.

    used_chunk: chunk (0/1) holding the used key's fact; key_chunk: chunk holding the queried
    key's fact for ``QK`` (it differs from the used key). ``stub_chunk`` writes that chunk as
    the stub instead (it must hold neither needed fact).
    """
    n = spec.facts_per_chunk
    keys = rng.sample(range(spec.n_keys), 2 * n)
    values = [rng.randrange(spec.n_values) for _ in keys]
    slots = [list(range(n)), list(range(n, 2 * n))]  # indices into keys, per chunk
    j = rng.choice(slots[used_chunk])
    m = rng.choice([i for i in slots[key_chunk] if i != j])
    tokens = [BOS] + _fill(rng, spec)
    spans: list[tuple[int, int]] = []
    for c in (0, 1):
        start = len(tokens)
        if c == stub_chunk:
            tokens.append(STUB)
        else:
            order = slots[c][:]
            rng.shuffle(order)
            tokens += [SEP] + [spec.fact(keys[i], values[i]) for i in order] + [SEP]
        spans.append((start, len(tokens)))
        tokens += _fill(rng, spec)
    use_pos = len(tokens) + 1
    x = spec.value(values[j]) if written else MASK
    tokens += [USE, spec.key(keys[j]), x] + _fill(rng, spec)
    if query == "use":
        tokens.append(QU)
        answer = spec.value(values[j])
    else:
        tokens += [QK, spec.key(keys[m])]
        answer = spec.value(values[m])
    return tokens, answer, spans, use_pos


def training_example(rng: random.Random, spec: TaskSpec) -> Example:
    """A random training document with its answer appended; loss on ``X`` and on the answer."""
    query: Literal["use", "key"] = "use" if rng.random() < spec.p_use_query else "key"
    used_chunk, key_chunk = rng.randrange(2), rng.randrange(2)
    stub_chunk = None
    needed = {used_chunk} | ({key_chunk} if query == "key" else set())
    if rng.random() < spec.p_stub and len(needed) == 1:
        stub_chunk = 1 - next(iter(needed))
    tokens, answer, _, use_pos = _document(
        rng,
        spec,
        used_chunk=used_chunk,
        query=query,
        key_chunk=key_chunk,
        written=rng.random() < spec.p_written,
        stub_chunk=stub_chunk,
    )
    tokens.append(answer)
    return Example(tokens, [use_pos, len(tokens) - 2])


def make_case(rng: random.Random, kind: Kind, spec: TaskSpec) -> Case:
    """One evaluation context of ``kind`` (the value after ``USE K_j`` is always redacted)."""
    removed = rng.randrange(2)
    kept = 1 - removed
    query: Literal["use", "key"]
    if kind == "carried":
        used_chunk, query, key_chunk = removed, "use", kept
    elif kind == "carried_ctrl":
        used_chunk, query, key_chunk = kept, "use", kept
    elif kind == "direct":
        used_chunk, query, key_chunk = kept, "key", removed
    elif kind == "direct_ctrl":
        used_chunk, query, key_chunk = kept, "key", kept
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    tokens, answer, spans, _ = _document(
        rng, spec, used_chunk=used_chunk, query=query, key_chunk=key_chunk, written=False
    )
    return Case(kind, tokens, answer, spans[removed], (STUB,))


def make_cases(n: int, seed: int, spec: TaskSpec, kinds: tuple[Kind, ...] = KINDS) -> list[Case]:
    """``n`` cases of every kind in ``kinds``, interleaved, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [make_case(rng, kind, spec) for _ in range(n) for kind in kinds]


def edited(case: Case) -> list[int]:
    """The context with the chunk replaced by the stub (what AMORTIZE and FORGET produce)."""
    s, e = case.chunk
    return case.tokens[:s] + list(case.stub) + case.tokens[e:]
