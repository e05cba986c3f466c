"""Directives: the edit channel's unit of work.

A directive ``D = (start, end, replacement, mode)`` replaces the token span ``[start, end)`` of a
cached sequence with ``replacement``. Every token that follows the span moves by
``delta = len(replacement) - (end - start)`` positions; under AMORTIZE its KV is kept and only its
RoPE band is re-rotated by ``delta`` (``R(delta)·R(i) = R(i + delta)``), under FORGET everything
from ``start`` is re-prefilled and the old span is purged from the cache.

This module is pure Python (pydantic only): policies and the conversation wrapper import it without
torch or sglang.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class Mode(StrEnum):
    """How a directive is executed on the server.

    AMORTIZE: in-place splice; downstream KV is kept and δ-rotated (cheap; the removed span's
        influence on downstream tokens survives in their KV).
    FORGET: re-prefill from ``start`` and purge every cache entry that held the removed span.
    """

    AMORTIZE = "amortize"
    FORGET = "forget"

    @staticmethod
    def strongest(a: Mode | None, b: Mode | None) -> Mode | None:
        """The stronger of two modes (FORGET > AMORTIZE > None)."""
        if Mode.FORGET in (a, b):
            return Mode.FORGET
        return a or b


class DirectiveError(ValueError):
    """A directive (or a set of directives) does not fit the sequence it is applied to."""


class Directive(BaseModel):
    """Replace tokens ``[start, end)`` with ``replacement``.

    Attributes:
        start: first replaced position (token index, >= 0).
        end: one past the last replaced position (>= start); ``start == end`` is an insertion.
        replacement: token ids (ints >= 0) that take the span's place.
        mode: ``Mode.AMORTIZE`` (default) or ``Mode.FORGET``.

    Raises:
        pydantic.ValidationError (a ``ValueError``): negative indices, ``start > end``,
            non-integer or negative token ids.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: StrictInt = Field(ge=0, description="first replaced position")
    end: StrictInt = Field(ge=0, description="one past the last replaced position")
    replacement: tuple[StrictInt, ...] = Field(default=(), description="new token ids")
    mode: Mode = Mode.AMORTIZE

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) must be <= end ({self.end})")
        bad = [t for t in self.replacement if t < 0]
        if bad:
            raise ValueError(f"replacement token ids must be >= 0, got {bad[:5]}")
        return self

    @property
    def removed(self) -> int:
        """Number of tokens removed (``end - start``)."""
        return self.end - self.start

    @property
    def delta(self) -> int:
        """Position shift of every downstream token: ``len(replacement) - (end - start)``."""
        return len(self.replacement) - self.removed

    def apply(self, tokens: Sequence[int]) -> list[int]:
        """Return ``tokens`` with ``[start, end)`` replaced.

        Raises:
            DirectiveError: ``end > len(tokens)``.
        """
        return apply_directives(tokens, [self])


class EditPlan(NamedTuple):
    """The result of applying a set of directives as one edit.

    new_tokens: the edited sequence.
    kept: ``(old_pos, new_pos)`` for every old token that survives (outside every removed span),
        in order; ``new_pos - old_pos`` is the position shift that token receives.
    inserted: ``(new_start, new_end)`` span of every directive's replacement in the new sequence.
    """

    new_tokens: list[int]
    kept: list[tuple[int, int]]
    inserted: list[tuple[int, int]]


def sort_and_check(directives: Sequence[Directive], length: int | None = None) -> list[Directive]:
    """Sort directives by position and check that they do not overlap.

    Two directives overlap when their spans share a position, or when both start at the same
    position (two insertions at one point have no defined order).

    Raises:
        DirectiveError: overlapping directives, or (with ``length``) ``end > length``.
    """
    ordered = sorted(directives, key=lambda d: (d.start, d.end))
    for prev, nxt in zip(ordered, ordered[1:], strict=False):
        if prev.end > nxt.start or prev.start == nxt.start:
            raise DirectiveError(
                f"directives overlap: [{prev.start}, {prev.end}) and [{nxt.start}, {nxt.end}); "
                "merge them into one directive"
            )
    if length is not None and ordered and ordered[-1].end > length:
        d = ordered[-1]
        raise DirectiveError(
            f"directive [{d.start}, {d.end}) ends past the sequence (length {length})"
        )
    return ordered


def plan_edit(tokens: Sequence[int], directives: Sequence[Directive]) -> EditPlan:
    """Apply several non-overlapping directives as one edit.

    The result equals applying them one by one from right to left (so that no directive's offsets
    are disturbed by another's).

    Raises:
        DirectiveError: overlap, or a directive ending past ``len(tokens)``.
    """
    ordered = sort_and_check(directives, len(tokens))
    new_tokens: list[int] = []
    kept: list[tuple[int, int]] = []
    inserted: list[tuple[int, int]] = []
    pos = 0
    for d in ordered:
        for old in range(pos, d.start):
            kept.append((old, len(new_tokens)))
            new_tokens.append(tokens[old])
        inserted.append((len(new_tokens), len(new_tokens) + len(d.replacement)))
        new_tokens.extend(d.replacement)
        pos = d.end
    for old in range(pos, len(tokens)):
        kept.append((old, len(new_tokens)))
        new_tokens.append(tokens[old])
    return EditPlan(new_tokens, kept, inserted)


def apply_directives(tokens: Sequence[int], directives: Sequence[Directive]) -> list[int]:
    """The edited sequence (see :func:`plan_edit`)."""
    return plan_edit(tokens, directives).new_tokens


def position_shifts(length: int, directives: Sequence[Directive]) -> list[int | None]:
    """Per old position, the shift it receives; ``None`` for positions inside a removed span.

    Raises:
        DirectiveError: overlap, or a directive ending past ``length``.
    """
    ordered = sort_and_check(directives, length)
    shifts: list[int | None] = [0] * length
    acc = 0
    pos = 0
    for d in ordered:
        for i in range(pos, d.start):
            shifts[i] = acc
        for i in range(d.start, d.end):
            shifts[i] = None
        acc += d.delta
        pos = d.end
    for i in range(pos, length):
        shifts[i] = acc
    return shifts
