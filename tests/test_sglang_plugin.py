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
    out = s._request_dispatcher(ipc.SpliceReqInput(payload=json.dumps(body), rid="r7"))
    assert isinstance(out, ipc.SpliceReqOutput) and out.rid == "r7"  # mux.RidMux matches by it
    assert out.status == 501 and "radix-cache-backend leyline" in json.loads(out.body)["error"]
    bad = s._request_dispatcher(ipc.SpliceReqInput(payload="{not json"))
    assert bad.status == 422


def test_rid_mux_keeps_many_in_flight_and_matches_replies_by_rid() -> None:
    """The scheduler side is a list here (replies made by hand, in reverse order); the real one
    is in test_sglang_backend (concurrent splices)."""
    import asyncio

    from leyline_agent.backends.sglang import ipc
    from leyline_agent.backends.sglang.mux import RidMux

    sent: list[ipc.SpliceReqInput] = []
    mux = RidMux(sent.append, fan_out=2)

    async def run() -> list[list[ipc.SpliceReqOutput]]:
        calls = [asyncio.ensure_future(mux(ipc.SpliceReqInput(payload=str(i)))) for i in range(5)]
        await asyncio.sleep(0)
        assert len(sent) == 5 and mux.in_flight == 5  # all sent before any reply
        assert len({r.rid for r in sent}) == 5
        mux.handle_recv(ipc.SpliceReqOutput(status=200, body="stray", rid="leyline-none"))
        for dp in (1, 0):
            for req in reversed(sent):
                mux.handle_recv(
                    ipc.SpliceReqOutput(status=200, body=req.payload, dp_rank=dp, rid=req.rid)
                )
        return list(await asyncio.gather(*calls))

    results = asyncio.run(run())
    assert [sorted(o.dp_rank for o in outs) for outs in results] == [[0, 1]] * 5
    assert [{o.body for o in outs} for outs in results] == [{str(i)} for i in range(5)]
    assert mux.figures() == {"requests": 5, "in_flight": 0, "in_flight_max": 5}


def test_rid_mux_forgets_a_cancelled_caller() -> None:
    import asyncio

    from leyline_agent.backends.sglang import ipc
    from leyline_agent.backends.sglang.mux import RidMux

    sent: list[ipc.SpliceReqInput] = []
    mux = RidMux(sent.append, fan_out=1)

    async def run() -> None:
        call = asyncio.ensure_future(mux(ipc.SpliceReqInput(payload="x")))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert mux.in_flight == 0
        mux.handle_recv(ipc.SpliceReqOutput(status=200, body="late", rid=sent[0].rid))  # dropped

    asyncio.run(run())


def test_mux_install_swaps_sglangs_queueing_communicators() -> None:
    """A stand-in tokenizer manager with SGLang's real dispatcher and communicators (a real
    TokenizerManager needs a whole server: test_sglang_backend)."""
    import asyncio

    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.utils import TypeBasedDispatcher

    from leyline_agent.backends.sglang import ipc, mux

    sent: list[object] = []

    class StubTokenizerManager:
        def __init__(self) -> None:
            self._result_dispatcher = TypeBasedDispatcher([])
            for name, out in zip(
                mux.NAMES, (ipc.SpliceReqOutput, ipc.InspectReqOutput), strict=True
            ):
                comm = FanOutCommunicator(sent.append, 3)
                setattr(self, f"{name}_communicator", comm)
                self._result_dispatcher += TypeBasedDispatcher([(out, comm.handle_recv)])

    tm = StubTokenizerManager()
    assert mux.install("kept", tm) == "kept"
    assert mux.install(None, tm) is None  # idempotent
    for name in mux.NAMES:
        m = getattr(tm, f"{name}_communicator")
        assert isinstance(m, mux.RidMux) and m._fan_out == 3
        m.set_fan_out(2)
        assert m._fan_out == 2
    m = tm.leyline_splice_communicator

    async def one() -> list[ipc.SpliceReqOutput]:
        call = asyncio.ensure_future(m(ipc.SpliceReqInput(payload="p")))
        await asyncio.sleep(0)
        tm._result_dispatcher(ipc.SpliceReqOutput(status=201, body="b", rid=sent[-1].rid))
        tm._result_dispatcher(ipc.SpliceReqOutput(status=202, body="c", rid=sent[-1].rid))
        return await call

    assert [o.status for o in asyncio.run(one())] == [201, 202]  # through SGLang's dispatcher
