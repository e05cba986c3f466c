"""What a test needs from the environment."""

from __future__ import annotations

import os

import pytest


def require_sglang() -> None:
    """Skip without the sglang extra locally; in CI (``CI`` set) a missing extra is a failure."""
    if os.environ.get("CI"):
        import sglang  # noqa: F401
    else:
        pytest.importorskip("sglang", reason="the sglang extra is not installed")
