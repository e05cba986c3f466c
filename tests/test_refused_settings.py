"""Server settings a splice cannot be made right on are refused with 501 before any change
(issue 27): HiCache (``--enable-hierarchical-cache``) and speculative decoding (EAGLE/MTP draft
pools). ``--enable-lora`` is not refused as such any more (a splice names its adapter:
``tests/test_lora_splice.py`` on a live server); what is refused under it (an adapter the server
has not loaded, a ``lora_path`` without ``--enable-lora``: 400) is checked here too. At the
preflight level, in process: a real ``LeylineRadixCache`` on a real SGLang allocator and SGLang's
own ``SpeculativeAlgorithm``, under a stand-in scheduler object (a real ``Scheduler`` needs a whole
server, and neither HiCache nor speculation runs on this CPU-only machine)."""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from leyline_agent.backends.sglang.preflight import check_settings  # noqa: E402
from leyline_agent.backends.sglang.radix import LeylineRadixCache  # noqa: E402
from leyline_agent.backends.sglang.splice import SpliceExecutor  # noqa: E402

pytestmark = pytest.mark.sglang


class StandInScheduler:
    """Only what preflight reads before its refusals; a refusal must come before the rest."""

    def __init__(self, spec: str = "NONE", hicache: bool = False, lora: bool = False) -> None:
        alloc = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", None, need_sort=False)
        self.tree_cache = LeylineRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                page_size=1,
            )
        )  # fmt: skip
        self.token_to_kv_pool_allocator = alloc
        self.spec_algorithm = SpeculativeAlgorithm.from_string(spec)
        self.enable_hierarchical_cache = hicache
        self.enable_lora = lora
        if lora:  # one loaded adapter, "ad1", as SGLang's LoRA manager lists it (a real LoRARef)
            ref = LoRARef(lora_name="ad1", lora_path="/nonexistent/ad1")
            manager = SimpleNamespace(lora_refs={ref.lora_id: ref})
            self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))


def cache_one(s: StandInScheduler) -> list[int]:
    toks = list(range(10, 30))
    slots = s.token_to_kv_pool_allocator.alloc(len(toks))
    s.tree_cache.insert(InsertParams(key=RadixKey(array("q", toks), None), value=slots))
    return toks


@pytest.mark.parametrize(
    ("spec", "hicache", "lora", "reason"),
    [
        ("EAGLE", False, False, "speculative decoding (EAGLE)"),
        ("EAGLE3", False, False, "speculative decoding (EAGLE3)"),
        ("STANDALONE", False, False, "speculative decoding (STANDALONE)"),
        ("NONE", True, False, "--enable-hierarchical-cache"),
    ],
)
def test_splice_and_fork_refused_with_501_before_any_change(
    spec: str, hicache: bool, lora: bool, reason: str
) -> None:
    s = StandInScheduler(spec, hicache, lora)
    toks = cache_one(s)
    free, evictable = s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size()
    ex = SpliceExecutor(s)  # type: ignore[arg-type]
    body = {"tokens": toks, "directives": [{"start": 2, "end": 4, "replacement": [7, 8, 9]}]}
    for op, payload in [
        ("splice", body),
        ("fork", {"tokens": toks, "target_extra_key": "child"}),
    ]:
        status, answer = ex.handle(json.dumps(payload), op)
        assert status == 501, answer
        assert reason in json.loads(answer)["error"], answer
    # nothing allocated, locked or inserted
    assert s.token_to_kv_pool_allocator.available_size() == free
    assert s.tree_cache.evictable_size() == evictable and s.tree_cache.protected_size_ == 0


def test_no_speculation_and_no_hicache_pass_the_settings_check() -> None:
    check_settings(StandInScheduler())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lora", "status", "reason"),
    [
        (False, 400, "LoRA is not enabled on this server"),
        (True, 400, "unknown LoRA adapter 'ad9'"),
    ],
)
def test_lora_adapter_not_loaded_is_refused_before_any_change(
    lora: bool, status: int, reason: str
) -> None:
    s = StandInScheduler(lora=lora)
    check_settings(s)  # type: ignore[arg-type]  # --enable-lora itself passes
    assert not lora or s.tp_worker.model_runner.lora_manager.lora_refs
    toks = cache_one(s)
    free, evictable = s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size()
    ex = SpliceExecutor(s)  # type: ignore[arg-type]
    body = {
        "tokens": toks,
        "directives": [{"start": 2, "end": 4, "replacement": [7, 8, 9]}],
        "lora_path": "ad9",
    }
    for op, payload in [
        ("splice", body),
        ("fork", {"tokens": toks, "target_extra_key": "child", "lora_path": "ad9"}),
    ]:
        status_got, answer = ex.handle(json.dumps(payload), op)
        assert status_got == status, answer
        assert reason in json.loads(answer)["error"]["message"], answer
    assert s.token_to_kv_pool_allocator.available_size() == free
    assert s.tree_cache.evictable_size() == evictable and s.tree_cache.protected_size_ == 0


def test_lora_adapter_that_cannot_join_the_running_batch_is_503_stand_in_manager() -> None:
    """``--max-loras-per-batch 1`` with a running request on another adapter: SGLang's own
    ``LoRAManager.validate_lora_batch`` (bound to the stand-in manager) says no, so the splice
    would evict the running request's adapter from the LoRA pool; 503, nothing changed."""
    from types import MethodType

    from sglang.srt.lora.lora_manager import LoRAManager

    s = StandInScheduler(lora=True)
    manager = s.tp_worker.model_runner.lora_manager
    other = LoRARef(lora_name="ad0", lora_path="/nonexistent/ad0")
    manager.lora_refs[other.lora_id] = other
    manager.max_loras_per_batch, manager.num_pinned_loras = 1, 0
    manager.validate_lora_batch = MethodType(LoRAManager.validate_lora_batch, manager)
    running = SimpleNamespace(lora_id=other.lora_id, finished=lambda: False)
    s.running_batch = SimpleNamespace(reqs=[running])  # type: ignore[attr-defined]
    toks = cache_one(s)
    free, evictable = s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size()
    body = {"tokens": toks, "directives": [{"start": 2, "end": 4, "replacement": [7]}]}
    status, answer = SpliceExecutor(s).handle(json.dumps({**body, "lora_path": "ad1"}))  # type: ignore[arg-type]
    assert status == 503, answer
    assert "cannot be loaded beside the adapters running now" in json.loads(answer)["error"]
    assert s.token_to_kv_pool_allocator.available_size() == free
    assert s.tree_cache.evictable_size() == evictable and s.tree_cache.protected_size_ == 0
