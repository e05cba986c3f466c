"""The natural-language carried/direct/control task (``bench/fidelity/nl_task.py``) and its
scoring (``nl_run.summarize``). No server: the cases are built with the embedded model's renderer
and with SmolLM2-135M-Instruct's (ChatML, what ``--task nl`` serves; needs the sglang extra for
the one-time GGUF conversion)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from requires import require_sglang

from leyline_agent.bench.fidelity import nl_run
from leyline_agent.bench.fidelity import nl_task as nt
from leyline_agent.chat.model_dir import load_renderer


@pytest.fixture(scope="module", params=["embedded", "smollm2"])
def renderer(request: pytest.FixtureRequest) -> Any:
    if request.param == "embedded":
        return load_renderer(None)
    require_sglang()
    from leyline_agent.models import resolve

    return load_renderer(resolve("smollm2-135m-instruct", None))


def _count(text: str, value: int) -> int:
    return len(re.findall(rf"(?<!\d){value}(?!\d)", text))


def test_groups_and_where_the_fact_sits(renderer: Any) -> None:
    groups = nt.GROUPS + nt.EXTRA_GROUPS
    cases = list(nt.cases(renderer, 6, seed=3, groups=groups))
    assert [c.group for c in cases] == list(groups) * 6
    for c in cases:
        (d,) = c.directives  # one edit: output A's content becomes the stub
        new = c.full[: d.start] + list(d.replacement) + c.full[d.end :]
        assert new == c.edited and len(c.edited) < len(c.full)
        assert "[evicted: 1 old tool outputs]" in renderer.decode(list(d.replacement))
        assert f"{c.key}: {c.value}" in renderer.decode(c.full[c.fact[0] : c.fact[1]])
        full, edited = renderer.decode(c.full), renderer.decode(c.edited)
        assert full.endswith(f"{c.key}: ") and edited.endswith(f"{c.key}: ")
        restated = _count(full, c.value) - 1  # occurrences besides the fact line
        if not c.group.endswith("_ctrl"):
            assert d.start <= c.fact[0] and c.fact[1] <= d.end  # the fact is in the stubbed span
            assert _count(edited, c.value) == restated
        else:
            assert c.fact[0] >= d.end  # the fact sits after the stub, untouched
            assert _count(edited, c.value) == restated + 1
        assert (restated >= 1) == c.group.startswith("carried")
        if c.group.startswith("used"):  # the last assistant turn names the key, not the value
            assert c.key in str(c.messages[-2]["content"])


def test_cases_are_seeded(renderer: Any) -> None:
    def key(cs: list[nt.NLCase]) -> list[Any]:
        return [(c.group, c.key, c.value, c.full, c.edited, c.directives, c.fact) for c in cs]

    a, b = list(nt.cases(renderer, 3, seed=7)), list(nt.cases(renderer, 3, seed=7))
    assert key(a) == key(b)
    assert key(a) != key(list(nt.cases(renderer, 3, seed=8)))
    with pytest.raises(ValueError, match="groups"):
        next(nt.cases(renderer, 1, groups=("carried", "nope")))


def test_answer_is_the_first_integer() -> None:
    assert nt.answer("877 in config/") == 877
    assert nt.answer("524288\n\n") == 524288
    assert nt.answer("\n```") is None


def _row(group: str, value: int, full: str, amortize: str, forget: str, fresh: str) -> dict:
    row: dict[str, Any] = {"group": group, "value": value, "edited_len": 10}
    for arm, text in zip(nl_run.ARMS, (full, amortize, forget, fresh), strict=True):
        row[arm] = [ord(ch) for ch in text]  # one "token" per character
        row[f"{arm}_answer"] = nt.answer(text)
    return row | {"kl_amortize": 0.1, "kl_forget": 2.0, "amortize_next_cached": 9}


def test_summarize_counts_per_group_and_pools() -> None:
    rows = [
        _row("carried", 47, "47\n", "47\n", "47\n", "47\n"),
        _row("direct", 47, "47\n", "41\n", "38\n", "38\n"),
        _row("direct", 52, "52\n", "52\n", "9\n", "9 \n"),
        _row("direct_ctrl", 30, "31\n", "31\n", "30\n", "30\n"),
    ]
    s = nl_run.summarize(rows)
    assert set(s) == {"carried", "direct", "direct_ctrl", "real", "control"}
    d = s["direct"]
    assert (d["acc_full"]["k"], d["acc_amortize"]["k"], d["acc_forget"]["k"]) == (2, 1, 0)
    assert d["amortize_first_eq_full"]["k"] == 2  # "41" starts with the full context's "4"
    assert d["amortize_answer_eq_full"]["k"] == 1 and d["forget_eq_fresh"]["k"] == 1
    assert s["real"]["acc_amortize"]["n"] == 3 and s["real"]["acc_amortize"]["k"] == 2
    c = s["control"]
    assert c["acc_full"]["k"] == 0 and c["acc_forget"]["k"] == 1
    assert c["forget_answer_eq_full"]["k"] == 0 and c["amortize_answer_eq_full"]["k"] == 1
    lo, hi = s["carried"]["acc_full"]["ci95"]
    assert 0.2 < lo < 0.21 and hi == 1.0  # Wilson, 1 of 1
    assert "| direct | 2 | 100.0% [34.2%, 100.0%] (2/2) | 50.0%" in nl_run.table(s)


def test_run_refuses_no_cases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one case"):
        nl_run.run_nl(tmp_path / "model", tmp_path / "out", n=0)
    assert not (tmp_path / "out").exists()
