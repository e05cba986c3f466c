"""``leyline eval debug-gym``: unit tests of its pure parts, and one end-to-end run.

The end-to-end test runs the real debug-gym 1.3.0 (its own venv, created on first use: about a
minute of installs from PyPI) on two mini_nightmare tasks with the embedded default model behind
the proxy, every arm, ``--max-steps 4``. Task data: ``$LEYLINE_MINI_NIGHTMARE``, else
``../shared/mini_nightmare`` beside the checkout, else debug-gym's cache/download, else (offline)
the copy inside its wheel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from shared_data import shared_dir
from typer.testing import CliRunner

from leyline_agent.accounting import Totals
from leyline_agent.arms import arm_switch
from leyline_agent.evals.debug_gym import venv
from leyline_agent.evals.debug_gym.driver import allowed_tools
from leyline_agent.evals.debug_gym.grammar import (
    READ_ONLY_TOOLS,
    step_grammars,
    task_files,
    tool_call_grammar,
)
from leyline_agent.evals.debug_gym.runner import EvalError, session_totals, tools_for
from leyline_agent.evals.debug_gym.spec import ROW_OMITS, EvalSpec, TaskResult, parse_tasks
from leyline_agent.evals.debug_gym.venv import requirements_key, write_tree_shim

REPO = Path(__file__).resolve().parents[1]


def test_arm_switches() -> None:
    policy = "stale_tool_outputs:keep_last=2"
    assert arm_switch("none", policy) == ("none", False)
    assert arm_switch("reprefill", policy) == (policy, False)
    assert arm_switch("splice", policy) == (policy, True)


def test_spec_validates_tasks_and_arms() -> None:
    assert parse_tasks("all")[0] == "config" and len(parse_tasks("all")) == 10
    assert EvalSpec(tasks=parse_tasks("purr, counter,purr")).tasks == ["purr", "counter"]
    with pytest.raises(ValueError, match="unknown tasks"):
        EvalSpec(tasks=["nope"])
    with pytest.raises(ValueError):
        EvalSpec(arms=["both"])  # type: ignore[list-item]


def test_grammar_is_bounded_and_read_only(tmp_path: Path) -> None:
    (tmp_path / "a_code.py").write_text("x = 1\n")
    (tmp_path / "test.py").write_text("")
    (tmp_path / ".debugignore").write_text("")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"")
    files = task_files(tmp_path)
    assert files == ["a_code.py", "test.py"]
    g = tool_call_grammar(READ_ONLY_TOOLS, files)
    assert g.startswith('root ::= "<tool_call>\\n{\\"name\\": " call "}\\n</tool_call>"')
    assert 'path ::= "\\"a_code.py\\"" | "\\"test.py\\""' in g
    assert "call_eval" in g and "call_listdir" in g
    with pytest.raises(ValueError, match="only view, listdir, eval"):
        tool_call_grammar(["view", "bash"], files)
    with pytest.raises(ValueError, match="at least one file"):
        tool_call_grammar(["view"], [])
    steps = step_grammars(READ_ONLY_TOOLS, files)
    assert len(steps) == 7 and steps["view,listdir,eval"] == g
    assert "call_view" not in steps["listdir,eval"] and "call_eval" in steps["listdir,eval"]


def test_recent_tools_are_not_repeated() -> None:
    tools = list(READ_ONLY_TOOLS)
    assert allowed_tools(tools, []) == tools
    assert allowed_tools(tools, ["listdir"]) == ["view", "eval"]
    assert allowed_tools(tools, ["listdir", "view"]) == ["eval"]  # a cycle through all three
    assert allowed_tools(tools, ["listdir", "view", "eval"]) == ["listdir"]
    assert allowed_tools(["view"], ["view", "view"]) == ["view"]
    keys = step_grammars(tools, ["a.py"])
    history: list[str] = []
    for _ in range(7):  # every subset the driver can ask for has a grammar
        allowed = allowed_tools(tools, history)
        assert ",".join(allowed) in keys
        history.append(allowed[0])


def test_tools_stay_read_only_under_constraints() -> None:
    assert tools_for(EvalSpec(), constrained=True) == list(READ_ONLY_TOOLS)
    assert "edit" in tools_for(EvalSpec(), constrained=False)
    assert "bash" not in tools_for(EvalSpec(), constrained=False)
    with pytest.raises(EvalError, match="only view, listdir, eval"):
        tools_for(EvalSpec(tools=["view", "bash"]), constrained=True)


def test_tree_shim_prints_what_listdir_parses(tmp_path: Path) -> None:
    shim = write_tree_shim(tmp_path / "shims")
    root = tmp_path / "task"
    (root / "sub").mkdir(parents=True)
    for name in ("b.py", "a10.py", "a9.py", "sub/c.py"):
        (root / name).write_text("")
    cmd = [str(shim), "--charset=ASCII", "--noreport", "-a", "-v", "-F", "-f", "-l", "-L", "2"]
    out = subprocess.run([*cmd, str(root)], capture_output=True, text=True, check=True).stdout
    first, *rest = out.splitlines()
    assert first == str(root)
    assert all("-- " in line for line in rest)  # debug-gym asserts this for every line
    names = [line.split("-- ", 1)[1] for line in rest]
    assert names == [f"{root}/a9.py", f"{root}/a10.py", f"{root}/b.py", f"{root}/sub/"] + [
        f"{root}/sub/c.py"
    ]
    assert rest[-1].startswith("    `-- ")


def test_session_totals_split_edited_turns() -> None:
    records = [
        {"turn": 0, "prompt_tokens": 100, "server_cached_tokens": 0, "prefilled_tokens": 100,
         "reused_tokens": 0, "best_reused_tokens": 0},
        {"turn": 1, "prompt_tokens": 150, "server_cached_tokens": 140, "prefilled_tokens": 15,
         "reused_tokens": 135, "best_reused_tokens": 135, "edited": True, "spliced": True,
         "splice_prefilled_tokens": 5, "policy_edits": 1},
    ]  # fmt: skip
    t = session_totals({"records": records})
    assert t.turns == 2 and t.edited_turns == 1 and t.spliced_turns == 1
    assert t.policy_edited_turns == 1
    assert t.prompt_tokens == 250 and t.prefilled_tokens == 115
    assert t.reused_tokens == 135 and t.server_cached_tokens == 140
    assert t.edited_prefilled_tokens == 15 and t.splice_prefilled_tokens == 5
    assert session_totals(None).turns == 0


# The keys of a results.json task row (before TaskResult was built from Totals).
ROW_KEYS = {
    "arm", "task", "session", "resolved", "steps", "tool_calls", "empty_tool_responses",
    "submitted", "patch_lines", "turns", "edited_turns", "policy_edited_turns", "spliced_turns",
    "splice_misses", "prompt_tokens", "reused_tokens", "server_cached_tokens",
    "best_reused_tokens", "prefilled_tokens", "splice_prefilled_tokens", "edited_prompt_tokens",
    "edited_prefilled_tokens", "wall_s", "error",
}  # fmt: skip


def test_task_result_rows_are_flat_and_carry_the_totals() -> None:
    totals = dataclasses.replace(session_totals(None), turns=3, prompt_tokens=90, splice_ms=2.5)
    r = TaskResult(arm="splice", task="counter", session="s", steps=3, totals=totals)
    row = r.model_dump(mode="json")
    assert ROW_KEYS <= set(row) and "totals" not in row
    assert set(row) == ROW_KEYS | {f.name for f in dataclasses.fields(Totals)} - ROW_OMITS
    assert list(row)[-2:] == ["wall_s", "error"]
    assert (row["turns"], row["prompt_tokens"], row["steps"]) == (3, 90, 3)
    back = TaskResult.model_validate(row)  # a row reads back (the omitted fields at 0)
    assert back.totals.prompt_tokens == 90 and back.totals.splice_ms == 0.0
    assert back.model_dump(mode="json") == row
    assert TaskResult(arm="none", task="c", session="s").totals == Totals()


def test_real_weights_note_says_why_few_resolve() -> None:
    from leyline_agent.evals.debug_gym.report import notes
    from leyline_agent.evals.debug_gym.runner import EvalRun

    rows = [
        TaskResult(arm="none", task="counter", session="a", steps=3, tool_calls=1,
                   empty_tool_responses=2),
        TaskResult(arm="splice", task="counter", session="b", steps=3, tool_calls=0,
                   empty_tool_responses=3),
    ]  # fmt: skip
    run = EvalRun(EvalSpec(tasks=["counter"], max_steps=4), rows, {"load_format": "auto"},
                  {}, ["view"], False, {}, 1.0)  # fmt: skip
    why = [n for n in notes(run) if n.startswith("why so few resolve")]
    assert len(why) == 1 and "1 of 6 model calls were valid" in why[0]
    assert "5 replies held no tool call" in why[0] and "--max-steps 4" in why[0]
    dummy = dataclasses.replace(run, backend={"load_format": "dummy"})
    assert not any(n.startswith("why so few") for n in notes(dummy))
    constrained = dataclasses.replace(run, constrained=True)
    assert not any(n.startswith("why so few") for n in notes(constrained))


def test_requirements_key_changes_with_every_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    key = requirements_key()
    assert len(key) == 16 and int(key, 16) >= 0
    bumped = tuple(d.replace("==", "==9.", 1) if i == 0 else d
                   for i, d in enumerate(venv.RUNTIME_DEPS))  # fmt: skip
    monkeypatch.setattr(venv, "RUNTIME_DEPS", bumped)
    assert requirements_key() != key
    monkeypatch.undo()
    assert requirements_key() == key
    monkeypatch.setattr(venv, "_TREE_SHIM", venv._TREE_SHIM + "\n")
    assert requirements_key() != key


def _data_dir() -> str | None:
    env = os.environ.get("LEYLINE_MINI_NIGHTMARE")
    if env:
        return env
    shared = shared_dir("mini_nightmare")
    return str(shared) if shared and (shared / "counter" / ".debugignore").is_file() else None


@pytest.mark.sglang
@pytest.mark.timeout(3600)
def test_debug_gym_end_to_end(leyline_server: str, tmp_path: Path) -> None:
    """Two tasks, every arm, 4 model calls each, embedded default (random weights)."""
    from leyline_agent.commands.eval import app

    out = tmp_path / "out"
    args = ["debug-gym", "--tasks", "counter,grader", "--max-steps", "4"]
    args += ["--backend", leyline_server, "--out", str(out)]
    if _data_dir():
        args += ["--data-dir", _data_dir()]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output[-3000:]
    headline = json.loads(result.stdout.strip().splitlines()[-1])
    arms = headline["arms"]
    assert set(arms) == {"none", "reprefill", "splice"}
    doc = json.loads((out / "results.json").read_text())
    assert (out / "tokens.png").stat().st_size > 0
    assert any("random weights" in n for n in headline["notes"])
    for arm, totals in arms.items():
        assert totals["tasks"] == 2 and totals["resolved"] == 0, arm
        assert totals["tool_calls"] > 0, arm  # tools really ran
        assert totals["prompt_tokens"] > 0, arm
    for task in doc["tasks"]:
        assert task["error"] is None, task
        assert task["steps"] == 4 and task["turns"] == 4, task  # every call went through the proxy
        assert task["tool_calls"] == 4, task  # constrained decoding: a valid call every time
    for arm in ("reprefill", "splice"):
        assert arms[arm]["policy_edited_turns"] >= 1, arm
        assert arms[arm]["edited_turns"] >= 1, arm
    assert arms["none"]["policy_edited_turns"] == 0
    assert doc["arms"]["splice"]["spliced_turns"] >= 1
    assert doc["arms"]["splice"]["splice_misses"] == 0
    assert arms["splice"]["edited_prefilled_tokens"] < arms["reprefill"]["edited_prefilled_tokens"]


def tomorrow_date_fix(task_dir: Path) -> str:
    """mini_nightmare's tomorrow_date with its known fix: ``date_plus_one`` adds a day."""
    src = (task_dir / "tomorrow_date_code.py").read_text()
    start, end = src.index("    def date_plus_one"), src.index("    def tomorrow")
    fixed = "    def date_plus_one(self, today):\n        return today + timedelta(days=1)\n\n"
    src = src[:start] + fixed + src[end:]
    return src.replace(
        "from datetime import datetime\n", "from datetime import datetime, timedelta\n"
    )


@pytest.mark.sglang
@pytest.mark.timeout(3600)
def test_debug_gym_reports_resolved_with_a_scripted_fix(
    leyline_server: str, tmp_path: Path
) -> None:
    """The harness can report success: ``ScriptedFixLLM`` (a test double, not a model) sits
    between each arm's proxy and the real server and answers froggy with view, edit (the known
    fix of tomorrow_date), eval, submit. Everything else is real: debug-gym 1.3.0, the proxy,
    the policy (the 4th call holds 3 steps, so stale_tool_outputs:keep_last=2 stubs the first
    output), the splices and the engine."""
    from scripted_llm import ScriptedFixLLM

    from leyline_agent.evals.debug_gym.runner import run_eval

    data = Path(_data_dir() or pytest.skip("mini_nightmare data not found"))
    script = [
        ("view", {"path": "test.py"}),
        ("view", {"path": "tomorrow_date_code.py"}),
        (
            "edit",
            {
                "path": "tomorrow_date_code.py",
                "new_code": tomorrow_date_fix(data / "tomorrow_date"),
            },
        ),
        ("eval", {}),
        ("submit", {}),
    ]
    spec = EvalSpec(
        tasks=["tomorrow_date"],
        max_steps=6,
        constrain=False,
        tools=["view", "edit", "eval", "submit"],
        data_dir=str(data),
        out=str(tmp_path / "out"),
        max_tokens=8,
    )
    with ScriptedFixLLM(leyline_server, script) as llm:
        spec.backend = llm.url
        run = run_eval(spec)
    calls = len(script) - 1  # up to the resolving eval
    assert llm.calls == 3 * calls
    assert {r.arm for r in run.results} == {"none", "reprefill", "splice"} and not run.skipped_arms
    for r in run.results:
        assert r.error is None, r
        assert r.resolved, r
        assert r.steps == r.turns == calls and r.tool_calls == calls, r  # all through the proxy
        assert r.patch_lines > 0, r
    by_arm = {r.arm: r for r in run.results}
    assert by_arm["none"].policy_edited_turns == 0
    assert by_arm["reprefill"].policy_edited_turns == by_arm["splice"].policy_edited_turns == 1
    assert by_arm["splice"].spliced_turns >= 1 and by_arm["splice"].splice_misses == 0
