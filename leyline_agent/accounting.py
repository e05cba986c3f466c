"""Turn accounting: what one turn cost (``TurnRecord``) and sums over turns (``Totals``).

One name, one meaning, for every report (proxy sessions and ``/metrics``, ``leyline replay``,
``leyline eval debug-gym``); tokens are counts, times milliseconds:

=============================  ==================================================================
``prompt_tokens``              tokens of the prompt the backend received
``server_cached_tokens``       the backend's own count of cached prompt tokens (SGLang's
                               ``usage.prompt_tokens_details.cached_tokens``); it also counts
                               the replacement tokens a splice prefilled just before the request
``prefilled_tokens``           tokens run through the model for the turn: the request's uncached
                               part plus what the splice prefilled (``splice_prefilled_tokens``)
``reused_tokens``              ``prompt − prefilled``: prompt tokens whose KV was reused
``best_reused_tokens``         an upper bound of ``reused_tokens`` under the session's arm
                               (``best_reused``): in the session's own namespace the prefix it
                               left there; in a shared namespace (the proxy's, before a
                               session's first splice) the whole prompt, since any session may
                               have cached it: a loose bound there, not cache lost
``reprefill_tokens``           tokens a re-prefill of the same prompt would have prefilled: on a
                               spliced turn, ``prompt`` minus the longest prefix of the new
                               prompt that the backend held unchanged before the splice (the
                               session's previous prompt); on any other turn ``prefilled`` (no
                               splice ran: the turn was that re-prefill)
``saved_tokens``               ``reprefill − prefilled``: what the splice saved (0 unspliced)
``rotated_tokens``             cached tokens a splice moved to new positions (re-rotated)
``policy_edits``               edits the policy returned for the turn (``policy_edited_turns``:
                               turns with at least one)
``edited``                     the prompt carried directives: the policy's edits or the agent's own
                               changes to its history
=============================  ==================================================================

``hit_rate = reused / prompt``; ``best_hit_rate = best_reused / prompt``. The bare name
``cached_tokens`` is only the wire field of the backend's answers (OpenAI ``usage``, SGLang's
``meta_info``) and the Prometheus family ``leyline_proxy_cached_tokens_total``, which is
``server_cached_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel

from leyline_agent.directive import Mode
from leyline_agent.wire import SpliceResponse

if TYPE_CHECKING:
    from leyline_agent.wrapper import TurnPlan


class SpliceOutcome(NamedTuple):
    """What a turn's splice did: the backend's answer (None: no splice ran), why it could not
    run (``error``, ``reason``: ``client.miss_reason``), its time in ms, the turn's
    ``best_reused`` bound, and ``held_prefix``: the longest prefix of the new prompt the backend
    held unchanged before the splice (what a re-prefill would have reused; 0: unknown, the
    splice's ``prefix_reused`` stands for it)."""

    response: SpliceResponse | None = None
    error: str | None = None
    reason: str | None = None
    ms: float = 0.0
    best_reused: int = 0
    held_prefix: int = 0  # prompt tokens the backend held unchanged before the splice
    shared: bool = False  # the request ran in a shared namespace (best_reused: the whole prompt)


class TurnRecord(BaseModel):
    """One turn (see the module docstring for the token quantities)."""

    turn: int
    prompt_tokens: int
    server_cached_tokens: int
    prefilled_tokens: int
    reused_tokens: int
    best_reused_tokens: int
    splice_prefilled_tokens: int = 0
    reprefill_tokens: int = 0
    saved_tokens: int = 0
    rotated_tokens: int = 0
    policy_edits: int = 0
    directives_amortize: int = 0
    directives_forget: int = 0
    edited: bool = False
    spliced: bool = False
    shared: bool = False  # ran in a shared namespace: its best_reused_tokens is its whole prompt
    splice_error: str | None = None
    splice_miss_reason: str | None = None  # client.miss_reason of splice_error
    splice_ms: float = 0.0
    request_ms: float = 0.0
    ttft_ms: float | None = None
    first_token: int | None = None
    render_mismatch: bool = False  # the backend's prompt tokens differ from the rendered ones
    resynced: bool = False  # ... and the session adopted the backend's tokens
    error: str | None = None  # the request failed after the cache changed (a splice ran)

    @classmethod
    def of(
        cls,
        plan: TurnPlan,
        splice: SpliceOutcome,
        *,
        turn: int,
        prompt_tokens: int,
        cached_tokens: int,
        **rest: Any,
    ) -> TurnRecord:
        """The record of a finished turn: its ``plan`` (``TurnPlan``), what its splice did, and
        the request's figures (``cached_tokens``: the backend's count). ``rest``: the
        request-side fields (``request_ms``, ``ttft_ms``, ``first_token``, ``render_mismatch``,
        ``resynced``, ``error``)."""
        answer = splice.response
        modes = [d.mode for d in plan.directives]
        splice_prefilled = answer.prefilled if answer else 0
        prefilled = prompt_tokens - cached_tokens + splice_prefilled
        held = splice.held_prefix or (answer.prefix_reused if answer else 0)  # NOTE: in-band: 0
        reprefill = prompt_tokens - min(held, prompt_tokens) if answer else prefilled
        return cls(
            turn=turn,
            prompt_tokens=prompt_tokens,
            server_cached_tokens=cached_tokens,
            prefilled_tokens=prefilled,
            reused_tokens=max(0, prompt_tokens - prefilled),
            best_reused_tokens=min(splice.best_reused, prompt_tokens),
            splice_prefilled_tokens=splice_prefilled,
            reprefill_tokens=reprefill,
            saved_tokens=reprefill - prefilled,
            rotated_tokens=answer.rotated if answer else 0,
            policy_edits=len(plan.edits),
            directives_amortize=modes.count(Mode.AMORTIZE),
            directives_forget=modes.count(Mode.FORGET),
            edited=bool(plan.directives),
            spliced=answer is not None,
            shared=splice.shared,
            splice_error=splice.error,
            splice_miss_reason=splice.reason,
            splice_ms=splice.ms,
            **rest,
        )


@dataclass
class Totals:
    """Sums over turns (see the module docstring).

    ``splice_misses``: edited turns whose splice could not run (the request went out anyway),
    also counted per reason in ``misses_by_reason``; ``shared_turns``: turns run in a shared
    namespace, whose ``best_reused_tokens`` is their whole prompt; ``edited_prompt_tokens`` and
    ``edited_prefilled_tokens`` cover the edited turns only.
    """

    turns: int = 0
    edited_turns: int = 0
    policy_edited_turns: int = 0
    spliced_turns: int = 0
    splice_misses: int = 0
    shared_turns: int = 0
    prompt_tokens: int = 0
    server_cached_tokens: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    best_reused_tokens: int = 0
    splice_prefilled_tokens: int = 0
    reprefill_tokens: int = 0
    saved_tokens: int = 0
    rotated_tokens: int = 0
    edited_prompt_tokens: int = 0
    edited_prefilled_tokens: int = 0
    directives_amortize: int = 0
    directives_forget: int = 0
    splice_ms: float = 0.0
    request_ms: float = 0.0
    misses_by_reason: Counter[str] = field(default_factory=Counter)

    def add(self, r: TurnRecord) -> None:
        self.turns += 1
        self.edited_turns += r.edited
        self.policy_edited_turns += r.policy_edits > 0
        self.spliced_turns += r.spliced
        self.shared_turns += r.shared
        self.prompt_tokens += r.prompt_tokens
        self.server_cached_tokens += r.server_cached_tokens
        self.prefilled_tokens += r.prefilled_tokens
        self.reused_tokens += r.reused_tokens
        self.best_reused_tokens += r.best_reused_tokens
        self.splice_prefilled_tokens += r.splice_prefilled_tokens
        self.reprefill_tokens += r.reprefill_tokens
        self.saved_tokens += r.saved_tokens
        self.rotated_tokens += r.rotated_tokens
        if r.edited:
            self.edited_prompt_tokens += r.prompt_tokens
            self.edited_prefilled_tokens += r.prefilled_tokens
        self.directives_amortize += r.directives_amortize
        self.directives_forget += r.directives_forget
        if r.splice_error is not None:
            self.splice_misses += 1
            self.misses_by_reason[r.splice_miss_reason or "backend_error"] += 1
        self.splice_ms += r.splice_ms
        self.request_ms += r.request_ms

    def merge(self, other: Totals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def of(cls, records: Iterable[TurnRecord]) -> Totals:
        out = cls()
        for r in records:
            out.add(r)
        return out

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        return self.best_reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field, ``misses_by_reason`` as a plain dict, ``hit_rate`` and
        ``best_hit_rate``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["misses_by_reason"] = dict(self.misses_by_reason)
        out["hit_rate"], out["best_hit_rate"] = self.hit_rate, self.best_hit_rate
        return out


def best_reused(
    plan: TurnPlan, held: Sequence[int], reply: Sequence[int] | int | None, *, splice: bool
) -> int:
    """An upper bound of a turn's reused tokens (prompt − prefilled) under the session's arm.

    Args:
        plan: the turn's plan (its tokens, tail, directives and ``base_len``).
        held: the previous prompt, which the session's namespace holds (empty: first turn, or
            after a reset).
        reply: that turn's reply after ``held`` (SGLang caches generated tokens too): its ids
            (``/generate``), its length (chat: ``usage.completion_tokens``), or None: unknown.
        splice: the arm sends directives to ``/leyline/splice``.

    ``splice`` with directives: the spliced prefix less the replacements the splice prefills
    (nothing follows the spliced prefix). Otherwise: the prefix shared with the previous prompt
    (up to the first directive) and, when that is the whole previous prompt, the reply tokens
    this prompt continues with: exactly when the reply's ids are known, at most its length
    otherwise, the rest of the prompt when unknown. Nothing held: 0, or the whole prompt when
    the reply is unknown (after ``SessionCore.forget`` or a prompt of unknown tokens: the
    namespace may hold anything).

    NOTE: older sequences of the namespace are taken to extend this prompt no further than the
    previous one (true while each turn's edits include the previous turn's).
    """
    if not held:
        return len(plan.tokens) if reply is None else 0
    if splice and plan.directives:
        replaced = sum(len(d.replacement) for d in plan.directives)
        return len(plan.tokens) - len(plan.tail) - replaced
    shared = min((d.start for d in plan.directives), default=plan.base_len)
    if shared < len(held):
        return shared
    rest = plan.tokens[len(held) :]
    if reply is None:
        return shared + len(rest)
    if isinstance(reply, int):
        return shared + min(reply, len(rest))
    n = 0
    for a, b in zip(reply, rest, strict=False):
        if a != b:
            break
        n += 1
    return shared + n
