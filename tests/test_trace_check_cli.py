"""`leyline trace check`, run through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

from shared_data import traces_dir
from typer.testing import CliRunner

from leyline_agent.cli import app
from leyline_agent.traces import load


def check(*args: str) -> tuple[int, dict | None, str]:
    """Exit code, the last stdout line as JSON (None if it is not), stdout + stderr."""
    result = CliRunner().invoke(app, ["trace", "check", *args])
    lines = result.stdout.strip().splitlines()
    try:
        summary = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        summary = None
    return result.exit_code, summary, result.output


def test_no_policy_needs_no_directives() -> None:
    root = traces_dir()
    code, summary, out = check(str(root))
    traces = load(root)
    assert code == 0, out
    assert summary == {
        "traces": len(traces),
        "turns": sum(len(t.turns) for t in traces),
        "edited_turns": 0,  # the shared traces only ever append messages
        "directives": 0,
        "fallback": 0,  # the embedded template renders every earlier message the same
        "errors": 0,
    }
    assert all(t.name[:8] in out for t in traces)  # the table lists every trace


def test_stale_tool_outputs() -> None:
    root = traces_dir()
    code, summary, _ = check(
        str(root / "swe-agent"),
        str(root / "debug-gym"),
        "--policy",
        "stale_tool_outputs:keep_last=2",
    )
    traces = load(root)
    turns = sum(len(t.turns) for t in traces)
    assert (
        code == 0
        and summary["traces"] == len(traces)
        and summary["turns"] == turns
        and summary["errors"] == summary["fallback"] == 0
    )
    # a turn edits (exactly one output goes stale) whenever an agent step is more than 2 old
    expected = sum(
        1 for t in traces for msgs in t.turns if sum(m["role"] == "assistant" for m in msgs) > 2
    )
    assert summary["edited_turns"] == expected == summary["directives"]


def test_bad_policy_and_empty_input(tmp_path: Path) -> None:
    code, _, _ = check(str(tmp_path), "--policy", "bogus")
    assert code == 2
    code, summary, _ = check(str(tmp_path))
    assert code == 2 and summary is None


def test_model_path_with_failing_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from leyline_agent.embedded.tokenizer import _bytes_to_unicode

    model = tmp_path / "model"
    model.mkdir()
    byte_vocab = {c: i for i, c in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))  # a byte tokenizer loads instantly
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(model / "tokenizer.json"))
    template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    rows = [
        [{"role": "user", "content": "a"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "tool", "content": "c"},
        ],
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    code, summary, out = check(str(trace), "--model-path", str(model))
    assert code == 1
    assert summary == {
        "traces": 1,
        "turns": 2,
        "edited_turns": 0,
        "directives": 0,
        "fallback": 0,
        "errors": 1,
    }
    assert "t turn 1: TemplateError: no tools" in out
