"""Wire types of ``/leyline/splice`` (``leyline_agent/wire.py``): pydantic only, no SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from leyline_agent.wire import Namespace, SpliceRequest, SpliceResponse


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
        "import leyline_agent.wire, leyline_agent.backends.sglang.plan\n"
        "import leyline_agent.client\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_target_namespace_of_a_splice() -> None:
    body = {"tokens": [1, 2], "directives": [{"start": 0, "end": 1}], "cache_salt": "t"}
    same = SpliceRequest.model_validate({**body, "extra_key": "a"})
    assert not same.crosses and same.target == Namespace("a", "t")
    equal = SpliceRequest.model_validate({**body, "extra_key": "a", "target_extra_key": "a"})
    assert not equal.crosses and equal.target == Namespace("a", "t")
    other = SpliceRequest.model_validate({**body, "extra_key": "a", "target_extra_key": "b"})
    assert other.crosses and other.target == Namespace("b", "t")
    from_default = SpliceRequest.model_validate({**body, "target_extra_key": "b"})
    assert from_default.crosses and from_default.namespace == Namespace(None, "t")


def test_fork_pin_unpin_bodies_are_checked() -> None:
    from leyline_agent.wire import ForkRequest, PinRequest, UnpinRequest

    fork = ForkRequest.model_validate({"tokens": [1, 2], "extra_key": "a", "target_extra_key": "b"})
    as_splice = fork.as_splice()
    assert as_splice.directives == [] and as_splice.crosses and as_splice.tokens == [1, 2]
    for bad in (
        {"tokens": [1], "extra_key": "a", "target_extra_key": "a"},  # a fork copies
        {"tokens": [], "target_extra_key": "b"},
        {"tokens": [1]},  # no target
        {"tokens": [1], "target_extra_key": "b", "directives": []},  # unknown field
    ):
        with pytest.raises(ValidationError):
            ForkRequest.model_validate(bad)
    assert PinRequest.model_validate({"tokens": [1], "ttl_s": 86400}).ttl_s == 86400
    for ttl in (0, -1, 86400.5, "soon"):
        with pytest.raises(ValidationError):
            PinRequest.model_validate({"tokens": [1], "ttl_s": ttl})
    with pytest.raises(ValidationError):
        PinRequest.model_validate({"tokens": [1]})  # a pin needs its TTL
    assert UnpinRequest.model_validate({"owner": "s"}).pin_id is None
    for bad in ({}, {"pin_id": "p0-x", "owner": "s"}):
        with pytest.raises(ValidationError, match="exactly one"):
            UnpinRequest.model_validate(bad)
