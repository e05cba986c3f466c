"""The import graph's promises (issue: one turn core, the session layer re-cut): the agent core
imports nothing from ``backends/``, and accounting imports no session code. Read from the source
with ``ast``, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "leyline_agent"
AGENT_CORE = [
    "wire.py", "directive.py", "messages.py", "markers.py", "client.py", "placement.py",
    "retention.py", "session.py", "chat_turn.py", "generate_turn.py", "api.py", "accounting.py",
    "wrapper.py", "diff.py", "token_changes.py", *[f"proxy/{p.name}" for p in sorted((PACKAGE / "proxy").glob("*.py"))],
    *[f"chat/{p.name}" for p in sorted((PACKAGE / "chat").glob("*.py"))],
]  # fmt: skip


def imported(path: Path, package: str | None = None) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved against
    ``package``, by default the file's own)."""
    tree = ast.parse(path.read_text())
    if package is None:
        package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
    return out


@pytest.mark.parametrize("name", AGENT_CORE)
def test_the_agent_core_imports_nothing_from_backends(name: str) -> None:
    bad = sorted(m for m in imported(PACKAGE / name) if m.startswith("leyline_agent.backends"))
    assert bad == [], f"{name} imports {bad}"


def test_accounting_imports_no_session_code() -> None:
    mods = imported(PACKAGE / "accounting.py")
    session_side = {"leyline_agent.session", "leyline_agent.chat_turn", "leyline_agent.api"}
    assert mods & session_side == set()
    assert "leyline_agent.wire" in mods  # it reads the splice's answer type, a contract


def test_the_scan_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The check can fail: an import inside a function, or a relative one, is caught."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from leyline_agent.backends.sglang import launch\n"
                    "from ..backends import sglang\n")  # fmt: skip
    assert imported(fake, "leyline_agent.proxy") == {
        "leyline_agent.backends.sglang", "leyline_agent.backends"
    }  # fmt: skip
