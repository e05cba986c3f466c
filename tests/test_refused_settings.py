"""Server settings a splice cannot be made right on are refused with 501 before any change
(issue 27): HiCache (``--enable-hierarchical-cache``), speculative decoding (EAGLE/MTP draft
pools) and LoRA (``--enable-lora``: the replacement would be prefilled without the adapter). At the preflight level, in process: a real ``LeylineRadixCache`` on a real SGLang
allocator and SGLang's own ``SpeculativeAlgorithm``, under a stand-in scheduler object (a real
``Scheduler`` needs a whole server, and neither setting runs on this CPU-only machine)."""

from __future__ import annotations

import json
from array import array

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

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
        ("NONE", False, True, "--enable-lora"),
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
