"""Wire types of ``/leyline/splice`` (``backends/sglang/wire.py``): pydantic only, no SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from leyline_agent.backends.sglang.wire import Namespace, SpliceRequest, SpliceResponse


def test_namespace_fields_and_apply() -> None:
    assert Namespace().fields() == {}
    assert Namespace("ns").fields() == {"extra_key": "ns"}
    assert Namespace("ns", "salt").fields() == {"extra_key": "ns", "cache_salt": "salt"}
    assert Namespace("ns", "").fields() == {"extra_key": "ns"}  # an empty salt is no salt
    body = {"model": "m", "extra_key": "client", "cache_salt": "theirs"}
    assert Namespace("ns").apply(body) == {"model": "m", "extra_key": "ns"}
    assert Namespace("ns", "s").apply(body) == {"model": "m", "extra_key": "ns", "cache_salt": "s"}
    req = SpliceRequest(tokens=[1], directives=[{"start": 0, "end": 1}], cache_salt="s")
    assert req.namespace == Namespace(None, "s")


def test_request_forbids_unknown_fields_and_declares_the_test_hooks() -> None:
    body = {"tokens": [1, 2], "directives": [{"start": 0, "end": 1}]}
    with pytest.raises(ValidationError, match="Extra inputs"):
        SpliceRequest.model_validate({**body, "debug_fail_before_prefill": True})
    req = SpliceRequest.model_validate({**body, "debug_fail_after_prefill": True})
    assert req.debug_fail_after_prefill and req.debug_fault is None


def test_response_keeps_http_ms_off_the_wire() -> None:
    r = SpliceResponse(
        new_length=3, prefix_reused=1, prefilled=1, rotated=1, in_place=True, elapsed_ms=1.0
    )
    assert "http_ms" not in r.model_dump_json()
    again = SpliceResponse.model_validate({**r.model_dump(), "http_ms": 2.5, "future_field": 1})
    assert again.http_ms == 2.5 and again.copied == 0 and again.purged == 0


def test_wire_and_plan_import_without_sglang_or_torch() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'sglang', 'triton', 'transformers'):\n"
        "    sys.modules[name] = None\n"
        "import leyline_agent.backends.sglang.wire, leyline_agent.backends.sglang.plan\n"
        "import leyline_agent.client\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
