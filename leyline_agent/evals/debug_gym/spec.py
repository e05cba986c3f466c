"""What a ``leyline eval debug-gym`` run is (``EvalSpec``) and what it yields (``TaskResult``).

Arms (``leyline_agent.arms``, as in ``leyline replay``, but live: the agent's own requests go
through a proxy):

- ``none``: policy ``none``, no splices: the history only grows; the agent's own mutations
  (froggy's system prompt, see ``docs/debug_gym.md``) are re-prefilled as today.
- ``reprefill``: the policy edits the history; the edited request is sent as is.
- ``splice``: the same edits, executed as directives (``/leyline/splice``) before the request.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from leyline_agent.accounting import Totals
from leyline_agent.arms import ARMS, DEFAULT_POLICY, Arm

TASK_NAMES: tuple[str, ...] = (
    "config",
    "counter",
    "grader",
    "pandas_dataframe",
    "patcher",
    "purr",
    "scientific_calculator",
    "shopping_cart",
    "sum_tree",
    "tomorrow_date",
)
# Tools for a real model; bash is left out (it runs unsandboxed on the host) unless asked for.
FULL_TOOLS: tuple[str, ...] = ("view", "listdir", "eval", "edit", "submit")


class EvalSpec(BaseModel):
    """Arguments of one evaluation (recorded in ``results.json``).

    ``max_steps`` counts model calls per task (debug-gym 1.3.0's own ``max_steps`` N makes N - 1;
    the driver passes N + 1). ``constrain``: force read-only tool calls with a grammar (None: when
    the backend serves dummy weights). ``context_limit_k``: debug-gym's trimming limit in
    thousands of tokens; keep it below the server's context minus ``max_tokens`` minus ~2k.
    """

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=lambda: list(TASK_NAMES))
    arms: list[Arm] = Field(default_factory=lambda: list(ARMS))
    policy: str = DEFAULT_POLICY
    backend: str | None = None
    llm_url: str | None = None
    model: str | None = None
    model_path: str | None = None
    max_steps: int = Field(default=10, ge=1)
    data_dir: str | None = None
    out: str = "debug-gym-results"
    tools: list[str] | None = None
    constrain: bool | None = None
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    context_limit_k: int = Field(default=12, ge=1)
    run_timeout: int = Field(default=30, ge=1)
    max_attempts: int = Field(default=3, ge=1)
    venv: str | None = None

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        unknown = [t for t in tasks if t not in TASK_NAMES]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; mini_nightmare has {', '.join(TASK_NAMES)}")
        if not tasks:
            raise ValueError("no tasks")
        return list(dict.fromkeys(tasks))

    @field_validator("arms")
    @classmethod
    def _arms(cls, arms: list[Arm]) -> list[Arm]:
        if not arms:
            raise ValueError("no arms")
        return list(dict.fromkeys(arms))

    @property
    def out_dir(self) -> Path:
        return Path(self.out)


def parse_tasks(text: str) -> list[str]:
    """``all`` or a comma-separated list of task names."""
    if text.strip() == "all":
        return list(TASK_NAMES)
    return [t.strip() for t in text.split(",") if t.strip()]


# Totals fields a results.json row leaves out (per-turn timings, directive counts, rotated
# tokens, misses by reason: the arm totals and proxy_session.json carry them); every other field,
# a new one included, is a key of each row.
ROW_OMITS = frozenset(
    {
        "rotated_tokens",
        "directives_amortize",
        "directives_forget",
        "splice_ms",
        "request_ms",
        "misses_by_reason",
    }
)
TOTALS_FIELDS = frozenset(f.name for f in fields(Totals))


class TaskResult(BaseModel):
    """One task under one arm. ``totals``: the ``accounting.Totals`` of the task's turns as the
    proxy recorded them (``/leyline/sessions/{id}``; names defined in ``accounting.py``):
    ``edited_*`` cover only the turns whose prompt had directives (the policy's edits or the
    agent's own mutations); ``policy_edited_turns``: turns the policy edited.

    A row (``model_dump``, the ``tasks`` of ``results.json``) is flat: the totals' fields (but
    ``ROW_OMITS``) stand in place of ``totals``; validation takes such a row back."""

    arm: Arm
    task: str
    session: str
    resolved: bool = False
    steps: int = 0
    tool_calls: int = 0
    empty_tool_responses: int = 0
    submitted: bool = False
    patch_lines: int = 0
    totals: Totals = Field(default_factory=Totals)
    wall_s: float = 0.0
    error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """A flat row's totals fields into ``totals``."""
        if not isinstance(data, dict) or "totals" in data:
            return data
        flat = {k: v for k, v in data.items() if k in TOTALS_FIELDS}
        if not flat:
            return data
        rest = {k: v for k, v in data.items() if k not in TOTALS_FIELDS}
        return {**rest, "totals": flat}

    @model_serializer(mode="wrap")
    def _flatten(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for k, v in handler(self).items():
            if k == "totals":
                row.update({n: x for n, x in v.items() if n not in ROW_OMITS})
            else:
                row[k] = v
        return row

    def __getattr__(self, item: str) -> Any:
        """A totals field read on the result (``result.turns``), as before ``totals`` nested
        them."""
        if item in TOTALS_FIELDS and "totals" in self.__dict__:
            return getattr(self.__dict__["totals"], item)
        return super().__getattr__(item)  # type: ignore[misc]
