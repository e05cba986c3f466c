"""The CLI's help reads as prose: no type placeholders such as ``<bool>``, paragraphs re-wrapped."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from leyline_agent.cli import app

COMMANDS = [[], ["serve"], ["proxy"], ["replay"], ["trace", "check"], ["bench", "splice"]]
COMMANDS += [["eval", "debug-gym"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "leyline")
def test_help_has_no_type_placeholders(cmd: list[str]) -> None:
    res = CliRunner().invoke(app, [*cmd, "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    assert "Usage: leyline" in res.output
    assert "<bool>" not in res.output and "BOOLEAN" not in res.output


def test_bench_help_names_both_benchmarks() -> None:
    res = CliRunner().invoke(app, ["bench", "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    assert "splice" in res.output and "fidelity" in res.output
    assert "Benchmarks: splice (a splice and the next request against a re-prefill" in res.output


def test_replay_help_offers_wide_json_verbose() -> None:
    res = CliRunner().invoke(app, ["replay", "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    for flag in ("--wide", "--json", "--verbose"):
        assert flag in res.output, flag
