"""Shared fixtures. ``leyline_server`` is a real ``leyline serve`` (SGLang on CPU, embedded default
model, dummy weights) on loopback, started once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from requires import require_sglang

# NOTE: every turn's rendering is checked against the backend's prompt ids (the proxy's default
# checks a session's first turn and every 16th: ``chat_turn.render_check``), so that the live
# tests' "no render mismatch" holds for every turn.
os.environ.setdefault("LEYLINE_RENDER_CHECK_EVERY", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the session's server is ``live`` (tests that start their own server
    are marked in their module); ``pytest -m 'not live'`` runs the unit tests only."""
    for item in items:
        if "leyline_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session")
def leyline_server() -> Iterator[str]:
    """Base URL of a running ``leyline serve``. Needs the sglang extra (CI installs it)."""
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer

    url = os.environ.get("LEYLINE_TEST_SERVER")
    if url:  # reuse a server started by hand (faster local iteration)
        yield url
        return
    # NOTE: a small pool (DEFAULT_MAX_TOTAL_TOKENS is 262,144): the tests fit in 16k tokens.
    with EmbeddedServer(max_total_tokens=16384, env={"LEYLINE_DEBUG_ENDPOINTS": "1"}) as srv:
        yield srv.url


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[str]:
    """Base URL of one ``leyline serve`` of SmolLM2-135M-Instruct (real weights, float32 on a
    CPU without bf16 units, an 8,192-token pool, debug endpoints), shared by the modules that use
    the real model; ``LEYLINE_TEST_SMOLLM2_SERVER=URL``: one started by hand
    (``LEYLINE_DEBUG_ENDPOINTS=1 leyline serve --model smollm2-135m-instruct``)."""
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer
    from leyline_agent.models import resolve

    url = os.environ.get("LEYLINE_TEST_SMOLLM2_SERVER")
    if url:
        yield url
        return
    model_dir = resolve("smollm2-135m-instruct", None)
    with EmbeddedServer(
        model_path=model_dir, max_total_tokens=8192, env={"LEYLINE_DEBUG_ENDPOINTS": "1"}
    ) as srv:
        yield srv.url
