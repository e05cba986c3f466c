"""The plugin's hooks, each on its own, in process (the server tests exercise them together)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang


def test_register_radix_backend_is_idempotent() -> None:
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        registered_radix_cache_backends,
    )

    from leyline_agent.backends.sglang import plugin
    from leyline_agent.backends.sglang.radix import leyline_radix_cache_factory

    plugin.register_radix_backend()
    plugin.register_radix_backend()
    assert registered_radix_cache_backends().count("leyline") == 1
    assert get_radix_cache_factory("leyline") is leyline_radix_cache_factory


def test_add_communicators_adds_each_once() -> None:
    from sglang.srt.managers import tokenizer_control_mixin as tcm

    from leyline_agent.backends.sglang import ipc, plugin

    plugin.add_communicators()
    plugin.add_communicators()
    names = [s[0] for s in tcm._COMMUNICATOR_SPECS]
    assert names.count("leyline_splice") == 1 and names.count("leyline_inspect") == 1
    spec = dict((s[0], s[1]) for s in tcm._COMMUNICATOR_SPECS)
    assert spec["leyline_splice"] is ipc.SpliceReqOutput


def test_cpu_dev_patches() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    from leyline_agent.backends.sglang import cpu_dev

    cpu_dev.apply()
    assert rope_base._is_cpu is True
    assert AttentionBackendRegistry.get_handler("torch_native")() == AttnForwardMethod.MLA


def test_splice_dispatch_with_stub_scheduler() -> None:
    """A real Scheduler needs a whole server (see test_sglang_backend); here a stand-in object
    carries only the dispatcher, so the hook's routing is checked on its own."""
    import json

    from sglang.utils import TypeBasedDispatcher

    from leyline_agent.backends.sglang import ipc, plugin

    class StubScheduler:
        tree_cache = object()  # not a LeylineRadixCache: splices must answer 501

        def __init__(self) -> None:
            self._request_dispatcher = TypeBasedDispatcher([])

    s = StubScheduler()
    assert plugin.add_splice_dispatch("kept", s) == "kept"
    body = {"tokens": [1, 2, 3], "directives": [{"start": 0, "end": 1, "replacement": [5]}]}
    out = s._request_dispatcher(ipc.SpliceReqInput(payload=json.dumps(body)))
    assert isinstance(out, ipc.SpliceReqOutput)
    assert out.status == 501 and "radix-cache-backend leyline" in json.loads(out.body)["error"]
    bad = s._request_dispatcher(ipc.SpliceReqInput(payload="{not json"))
    assert bad.status == 422
