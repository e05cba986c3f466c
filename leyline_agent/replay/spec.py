"""What a replay is (``ReplaySpec``) and what each replayed turn yields (``TurnRow``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from leyline_agent.accounting import TurnRecord
from leyline_agent.arms import ARMS, DEFAULT_POLICY, Arm


class ReplaySpec(BaseModel):
    """What to replay and how (the CLI's options; recorded in ``results.json``).

    traces: trace files or directories as given (the built-in examples' directory included).
    policy: policy spec of the ``reprefill`` and ``splice`` arms.
    arms: arms to run, in report order.
    concurrency: levels; at each, that many sessions run at once.
    max_turns: replay only the first N turns of each trace (None: all).
    cap_chars: each message of every turn made plain text and cut to its first N characters
        before the turn is rendered (``messages.flatten``, the cut of ``leyline bench fidelity
        --cap-chars``: fits long traces into a small context; None: messages as recorded).
    backend: the first ``--backend`` (None: the embedded server); backends: every one given
        (several: each session runs on its namespace's home backend, ``routing.home``).
    seed: seeds the order in which a level's sessions are submitted.
    agreement: run the argmax reference path on spliced turns.
    """

    model_config = ConfigDict(frozen=True)

    traces: list[str]
    policy: str = DEFAULT_POLICY
    arms: list[Arm] = Field(default_factory=lambda: list(ARMS), min_length=1)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1)
    max_turns: int | None = Field(default=None, ge=1)
    cap_chars: int | None = Field(default=None, ge=1)
    model_path: str | None = None
    backend: str | None = None
    backends: list[str] = Field(default_factory=list)
    seed: int = 0
    agreement: bool = True

    @field_validator("arms")
    @classmethod
    def _unique_arms(cls, arms: list[Arm]) -> list[Arm]:
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms given twice: {arms}")
        return arms

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, levels: list[int]) -> list[int]:
        if any(c < 1 for c in levels) or len(set(levels)) != len(levels):
            raise ValueError(f"concurrency levels must be distinct integers >= 1, got {levels}")
        return levels


class TurnRow(TurnRecord):
    """One replayed turn: the session's ``TurnRecord`` plus where it ran.

    turn_ms: splice time + request time (end to end, as the agent waits).
    reference_token: first token of the exact reference path (spliced turns of the splice arm).
    reference_margin: the reference's top two log-probabilities of that token's position, their
        difference in nats (None where no reference ran or the backend gave none).
    argmax_agree: ``first_token == reference_token`` (None where no reference ran).
    error: why the turn could not run (template or policy error, or the backend refused the
        request with a 4xx status, e.g. a prompt longer than the model's context); it was skipped
        and the next turn started a fresh prompt.
    skip_reason: the short form of ``error`` that the totals count (``TemplateError``,
        ``PolicyError``, ``HTTP 400``, ...).
    backend: the URL of the backend the session ran on.
    """

    level: int
    arm: Arm
    trace: str
    turn_ms: float = 0.0
    reference_token: int | None = None
    reference_margin: float | None = None
    argmax_agree: bool | None = None
    error: str | None = None
    skip_reason: str | None = None
    backend: str | None = None
