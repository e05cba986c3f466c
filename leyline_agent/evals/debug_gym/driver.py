"""The driver that runs inside debug-gym's own venv (``python -P driver.py CMD SPEC.json``).

It imports debug-gym 1.3.0 and nothing from Leyline (Leyline is not installed in that venv), and
drives debug-gym's Python API the way ``python -m scripts.run --config FILE`` does (create_env,
LLM.instantiate, create_agent, agent.run, save_trajectory, save_patch), with fixes for 1.3.0's
faults (see ``apply_fixes`` and ``docs/debug_gym.md``).

Commands:

- ``prepare SPEC``: resolve the mini_nightmare data (``data_dir``; else debug-gym's cache or its
  download; else, offline, the copy inside the wheel completed with the ``.debugignore`` and
  ``.debugreadonly`` files it lacks) and print ``{"data_dir", "source", "tasks"}``.
- ``run SPEC``: run froggy on every task of ``spec["tasks"]`` and print one JSON event per line
  (``task_start``, ``step``, ``task_end``) on stdout; everything else goes to stderr.

SPEC (JSON): ``arm, tasks, data_dir, out_dir, llm_config, llm_name, max_steps (model calls),
tools, max_tokens, temperature, sessions {task: id}, grammars {task: {"tool,…": ebnf}} | null,
run_timeout,
terminal_env {VAR: value}, max_attempts``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SESSION_HEADER = "X-Leyline-Session"
# SGLang's overflow messages; 1.3.0 only knows "maximum context length" and retries the other.
CONTEXT_OVERFLOW = ("maximum context length", "longer than the model's context length")
WHEEL_IGNORE = "__pycache__/\n*.py[cod]\n.pytest_cache/\nexps/\n"
WHEEL_READONLY = "*test*.py\n"

_events = sys.stdout


def emit(event: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def apply_fixes(max_attempts: int) -> None:
    """Work around debug-gym 1.3.0's faults (each one documented in docs/debug_gym.md).

    - Fault 2: ``MiniNightmareEnv.setup_terminal`` runs ``git add *.py *.txt``, which adds
      nothing when a task has no ``.txt`` file, so the recorded patch is empty: add each pattern
      on its own.
    - Fault 5: one of SGLang's context-overflow messages is not recognised and retried up to
      100 times with back-off: recognise it, and retry any error at most ``max_attempts`` times.
    - Fault 1 (``submit`` does not end an unresolved episode) is fixed per env in ``run_task``.
    """
    from debug_gym.gym.envs.mini_nightmare import MiniNightmareEnv
    from debug_gym.llms import openai as dg_openai

    def setup_terminal(self: Any) -> None:
        run = self.terminal.run
        run("git init")
        run("git config user.name 'debug-gym'")
        run("git config user.email '<>'")
        run("git add -- '*.py'")
        run("git add -- '*.txt'")  # fails alone (harmlessly) when there is none
        run("git commit -qm 'Init'")
        run("git add .debugignore .debugreadonly")
        run("git commit -qm 'Add debug-gym ignore and read-only files'")

    MiniNightmareEnv.setup_terminal = setup_terminal
    keywords = list(dg_openai.OpenAILLM.context_length_error_message_keywords)
    dg_openai.OpenAILLM.context_length_error_message_keywords = keywords + [
        k for k in CONTEXT_OVERFLOW if k not in keywords
    ]
    retry = dg_openai.retry_on_exception

    def bounded_retry(func: Any, should_retry: Any, **kwargs: Any) -> Any:
        return retry(func, should_retry, max_wait=10, max_attempts=max_attempts)

    dg_openai.retry_on_exception = bounded_retry


def allowed_tools(tools: list[str], history: list[str]) -> list[str]:
    """Tools not used in the last ``len(tools) - 1`` steps (see ``grammar.step_grammars``)."""
    recent = set(history[len(history) - len(tools) + 1 :]) if len(tools) > 1 else set()
    return [t for t in tools if t not in recent]


def _wheel_data() -> Path:
    import debug_gym

    return Path(debug_gym.__file__).resolve().parent.parent / "data" / "mini_nightmare"


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    from debug_gym.gym.envs.mini_nightmare import MiniNightmareEnv

    names = list(MiniNightmareEnv.TASK_NAMES)
    if spec.get("data_dir"):
        MiniNightmareEnv.DATA_PATH = Path(spec["data_dir"]).resolve()
        MiniNightmareEnv.load_dataset(build_image=False)  # raises on missing files
        return {"data_dir": str(MiniNightmareEnv.DATA_PATH), "source": "--data-dir", "tasks": names}
    try:  # debug-gym's cache, downloaded when missing (needs the network)
        MiniNightmareEnv.load_dataset(build_image=False)
        source = "debug-gym cache or download"
        return {"data_dir": str(MiniNightmareEnv.DATA_PATH), "source": source, "tasks": names}
    except Exception as e:  # noqa: BLE001 - offline: fall back to the wheel's copy
        print(f"debug-gym's data download failed ({e!r}); using the wheel's copy", file=sys.stderr)
    dest = Path(spec["out_dir"]) / "mini_nightmare"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(_wheel_data(), dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in names:
        (dest / name / ".debugignore").write_text(WHEEL_IGNORE)
        (dest / name / ".debugreadonly").write_text(WHEEL_READONLY)
    source = "debug-gym wheel (completed with .debugignore/.debugreadonly; no patcher .txt)"
    return {"data_dir": str(dest), "source": source, "tasks": names}


def run_task(spec: dict[str, Any], task: str, task_data: dict[str, Any]) -> dict[str, Any]:
    """One froggy episode; returns the ``task_end`` fields."""
    from debug_gym.agents.base_agent import create_agent
    from debug_gym.agents.utils import save_patch, save_trajectory
    from debug_gym.experiment import create_env
    from debug_gym.llms.base import LLM
    from debug_gym.logger import DebugGymLogger

    task_dir = Path(spec["out_dir"]) / task
    logger = DebugGymLogger(task, log_dir=str(task_dir), level="WARNING", mode="w")
    config = {
        "uuid": spec["sessions"][task],
        "terminal": {
            "type": "local",
            "include_os_env_vars": False,  # the terminal gets only terminal_env
            "env_vars": spec["terminal_env"],
        },
        "env": {"run_timeout": spec["run_timeout"]},
        "tools": spec["tools"],
    }
    counts = {"steps": 0, "tool_calls": 0, "empty_tool_responses": 0, "submitted": False}
    env = llm = None
    t0 = time.perf_counter()
    try:
        env = create_env(config, task_data, logger)
        llm = LLM.instantiate(
            name=spec["llm_name"],
            llm_config_file_path=spec["llm_config"],
            logger=logger,
            temperature=spec["temperature"],
            max_tokens=spec["max_tokens"],
        )
        kwargs = dict(llm.config.generate_kwargs)
        kwargs["extra_headers"] = {SESSION_HEADER: spec["sessions"][task]}
        grammars = (spec.get("grammars") or {}).get(task) or {}
        history: list[str] = []

        def constrain() -> None:  # the grammar of the tools allowed for the next call
            key = ",".join(allowed_tools(spec["tools"], history))
            kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "ebnf": grammars[key]}

        if grammars:
            constrain()
        llm.config.generate_kwargs = kwargs
        # debug-gym's max_steps N makes N - 1 model calls; spec["max_steps"] counts calls.
        agent_config = {"type": "froggy", "max_steps": spec["max_steps"] + 1}
        agent = create_agent(agent_config, llm=llm, logger=logger)
        names = {t.name for t in env.tools}
        step = env.step

        def counted_step(action: Any, content: Any = None, reasoning: Any = None) -> Any:
            info = step(action, content, reasoning)
            name = action.get("name") if isinstance(action, dict) else getattr(action, "name", "")
            counts["steps"] += 1
            counts["tool_calls"] += name in names
            counts["empty_tool_responses"] += name == "empty_tool_response"
            if name == "submit":  # fault 1: an unresolved submit must end the episode too
                env.terminated = info.terminated = counts["submitted"] = True
            history.append(str(name or ""))  # no name: matches no tool
            if grammars:
                constrain()
            emit("step", task=task, step=counts["steps"], tool=name, resolved=bool(info.resolved))
            return info

        env.step = counted_step
        agent.run(env)
        save_trajectory(agent, task_dir, logger)
        save_patch(env, task_dir, logger)
        patch = (task_dir / "debug_gym.patch").read_text()
        return {
            **counts,
            "resolved": bool(env.resolved),
            "score": env.score,
            "max_score": env.max_score,
            "patch_lines": sum(
                ln[:1] in "+-" and ln[:3] not in ("+++", "---") for ln in patch.splitlines() if ln
            ),
            "wall_s": time.perf_counter() - t0,
            "error": None,
        }
    except Exception as e:  # noqa: BLE001 - one failed task must not end the arm
        traceback.print_exc()
        return {**counts, "resolved": False, "wall_s": time.perf_counter() - t0, "error": repr(e)}
    finally:
        if env is not None:
            env.close()  # removes the throwaway working directory
        if llm is not None:
            llm.close()


def run(spec: dict[str, Any]) -> None:
    from debug_gym.gym.envs.mini_nightmare import MiniNightmareEnv
    from debug_gym.logger import DebugGymLogger

    main_logger = DebugGymLogger("debug-gym", level="ERROR")
    main_logger.set_no_live()
    apply_fixes(spec["max_attempts"])
    MiniNightmareEnv.DATA_PATH = Path(spec["data_dir"])
    dataset = MiniNightmareEnv.load_dataset(problems=spec["tasks"], build_image=False)
    for task in spec["tasks"]:
        emit("task_start", task=task)
        emit("task_end", task=task, **run_task(spec, task, dataset[task]))


def main(argv: list[str]) -> int:
    global _events
    if len(argv) != 2 or argv[0] not in ("prepare", "run"):
        print("usage: driver.py prepare|run SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    _events, sys.stdout = sys.stdout, sys.stderr  # debug-gym's console output goes to stderr
    if argv[0] == "prepare":
        emit("prepared", **prepare(spec))
    else:
        run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
