"""Run froggy on mini_nightmare through the Leyline proxy, arm by arm.

Per run::

    venv = ensure_venv()                                  # debug-gym's own environment
    backend = the embedded `leyline serve` | --backend | --llm-url
    data = driver.py prepare                              # where the tasks are
    for arm in arms:
        with ProxyServer(backend, arm's policy, splice)   # in-process, a free loopback port
            driver.py run                                 # debug-gym's venv; events on stdout
            GET /leyline/sessions/{id} per task           # the proxy's per-turn records, totals

Every task's session is ``X-Leyline-Session: dg-<run>-<arm>-<task>``, so arms and runs never
share the backend's cache namespace. The driver runs each task in a throwaway working directory
under ``OUT/<arm>/workdirs`` (debug-gym copies the task there and removes it afterwards); tools run
unsandboxed on this host.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leyline_agent.accounting import Totals, TurnRecord
from leyline_agent.arms import Arm, arm_switch
from leyline_agent.evals.debug_gym.backend import Backend, EvalError, ProxyServer, open_backend
from leyline_agent.evals.debug_gym.grammar import READ_ONLY_TOOLS, step_grammars, task_files
from leyline_agent.evals.debug_gym.process import Event, prepare_data, run_driver, terminal_env
from leyline_agent.evals.debug_gym.spec import FULL_TOOLS, EvalSpec, TaskResult
from leyline_agent.evals.debug_gym.venv import DebugGymVenv, ensure_venv


def tools_for(spec: EvalSpec, constrained: bool) -> list[str]:
    """The tool set: read-only under constraints, else ``FULL_TOOLS`` (``--tools`` overrides)."""
    tools = list(spec.tools or (READ_ONLY_TOOLS if constrained else FULL_TOOLS))
    if constrained and any(t not in READ_ONLY_TOOLS for t in tools):
        raise EvalError(
            f"with constrained (random-weight) tool calls only {', '.join(READ_ONLY_TOOLS)} are "
            f"allowed; got {', '.join(tools)}"
        )
    return tools


def session_totals(detail: dict[str, Any] | None) -> Totals:
    """The turn totals of one proxy session (``GET /leyline/sessions/{id}``)."""
    records = (detail or {}).get("records") or []
    return Totals.of(TurnRecord.model_validate(r) for r in records)


@dataclass
class ArmContext:
    """Everything ``run_arm`` needs besides the arm."""

    spec: EvalSpec
    venv: DebugGymVenv
    backend: Backend
    data_dir: Path
    tools: list[str]
    grammars: dict[str, dict[str, str]] | None
    run_id: str
    tokenizer_dir: Path


def write_llm_config(ctx: ArmContext, proxy_url: str, path: Path) -> None:
    """debug-gym's LLM registry file (``llm.yaml``; JSON is valid YAML)."""
    entry = {
        "model": ctx.backend.model,
        "endpoint": f"{proxy_url}/v1",
        "api_key": "leyline",  # the proxy needs none; the backend's key stays in the proxy
        "tokenizer": str(ctx.tokenizer_dir),
        "tags": ["vllm"],  # a local Hugging Face tokenizer: token counting works offline
        "context_limit": ctx.spec.context_limit_k,
        "generate_kwargs": {},
    }
    path.write_text(json.dumps({"leyline": entry}, indent=1))


def run_arm(ctx: ArmContext, arm: Arm, on_event: Callable[[Event], None]) -> list[TaskResult]:
    """All tasks under one arm; returns one result per task."""
    spec = ctx.spec
    switch = arm_switch(arm, spec.policy)
    out = spec.out_dir.resolve() / arm
    out.mkdir(parents=True, exist_ok=True)
    sessions = {t: f"dg-{ctx.run_id}-{arm}-{t}" for t in spec.tasks}
    with ProxyServer(
        ctx.backend.url,
        switch.policy,
        splice=switch.splice,
        model_path=spec.model_path,
        backend_api_key=ctx.backend.api_key,
    ) as proxy:
        write_llm_config(ctx, proxy.url, out / "llm.yaml")
        doc = {
            "arm": arm,
            "tasks": spec.tasks,
            "data_dir": str(ctx.data_dir),
            "out_dir": str(out),
            "llm_config": str(out / "llm.yaml"),
            "llm_name": "leyline",
            "max_steps": spec.max_steps,
            "tools": ctx.tools,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "sessions": sessions,
            "grammars": ctx.grammars,
            "run_timeout": spec.run_timeout,
            "terminal_env": terminal_env(ctx.venv, out / "workdirs"),
            "max_attempts": spec.max_attempts,
        }
        ends: dict[str, Event] = {}

        def forward(event: Event) -> None:
            if event.get("event") == "task_end":
                ends[event["task"]] = event
            on_event({**event, "arm": arm})

        run_driver(ctx.venv, "run", doc, out / "driver.json", out / "driver.log", forward)
        results = []
        for task in spec.tasks:
            end = ends.get(task, {"error": "the driver reported no result"})
            fields = {
                k: end[k]
                for k in TaskResult.model_fields
                if k in end and k not in ("arm", "task", "session", "totals")
            }
            detail = proxy.session(sessions[task])
            if detail is not None and (out / task).is_dir():  # the proxy's per-turn records
                (out / task / "proxy_session.json").write_text(json.dumps(detail, indent=1))
            totals = session_totals(detail)
            results.append(
                TaskResult(arm=arm, task=task, session=sessions[task], **fields, totals=totals)
            )
    return results


@dataclass
class EvalRun:
    spec: EvalSpec
    results: list[TaskResult]
    backend: dict[str, Any]
    data: dict[str, Any]
    tools: list[str]
    constrained: bool
    skipped_arms: dict[str, str]
    wall_s: float


def run_eval(
    spec: EvalSpec,
    *,
    on_event: Callable[[Event], None] = lambda e: None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    backend_api_key: str | None = None,
) -> EvalRun:
    """The whole evaluation (see the module docstring). ``backend_api_key``: the key of
    ``spec.backend`` / ``spec.llm_url``, forwarded by the proxies (not part of the spec, so it is
    never written to ``results.json``).

    Raises:
        EvalError, VenvError: the venv, the backend, the data or a driver failed as a whole.
        ServerError: the embedded server did not come up.
    """
    from leyline_agent.embedded.model import default_model_dir

    t0 = time.perf_counter()
    venv = ensure_venv(Path(spec.venv) if spec.venv else None, log=log)
    data = prepare_data(spec, venv)
    data_dir = Path(data["data_dir"])
    with open_backend(spec, log, backend_api_key) as backend:
        constrained = backend.dummy if spec.constrain is None else spec.constrain
        tools = tools_for(spec, constrained)
        grammars = None
        if constrained:
            grammars = {t: step_grammars(tools, task_files(data_dir / t)) for t in spec.tasks}
        skipped = {}
        if "splice" in spec.arms and not backend.leyline:
            skipped["splice"] = f"{backend.url} is not a Leyline-enabled SGLang (no /leyline/stats)"
            log(f"skipping the splice arm: {skipped['splice']}")
        ctx = ArmContext(
            spec, venv, backend, data_dir, tools, grammars, uuid.uuid4().hex[:8],
            Path(spec.model_path) if spec.model_path else default_model_dir(),
        )  # fmt: skip
        results = []
        for arm in spec.arms:
            if arm not in skipped:
                results += run_arm(ctx, arm, on_event)
        info = backend.info
    return EvalRun(spec, results, info, data, tools, constrained, skipped, time.perf_counter() - t0)
