"""LeylineRadixCache tree surgery on a real SGLang allocator (CPU), in process."""

from __future__ import annotations

from array import array

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from leyline_agent.backends.sglang.radix import LeylineRadixCache  # noqa: E402

pytestmark = pytest.mark.sglang


def make_tree(size: int = 256) -> LeylineRadixCache:
    alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, need_sort=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1
    )
    return LeylineRadixCache(params)


def put(tree: LeylineRadixCache, tokens: list[int], ns: str = "a") -> torch.Tensor:
    key = RadixKey(array("q", tokens), ns)
    have = tree.match_prefix(MatchPrefixParams(key=key))
    n = int(have.device_prefix_len)
    slots = tree.path_device_indices(have.last_device_node)[:n]
    new = tree.token_to_kv_pool_allocator.alloc(len(tokens) - n)
    value = torch.cat([slots, new]).to(torch.int64)
    res = tree.insert(InsertParams(key=key, value=value))
    assert int(res.prefix_len) == n
    return value


def match(tree: LeylineRadixCache, tokens: list[int], ns: str = "a"):
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), ns)))


def test_chain_from_splits_at_start_and_keeps_values() -> None:
    tree = make_tree()
    slots = put(tree, list(range(100, 130)))
    m = match(tree, list(range(100, 130)))
    parent, chain = tree.chain_from(m.last_device_node, 12)
    assert sum(len(n.key) for n in chain) == 18
    assert torch.equal(tree.path_device_indices(parent), slots[:12])
    assert torch.equal(tree.path_device_indices(m.last_device_node), slots)
    assert tree.check_integrity()["ok"]


def test_detach_chain_hands_slots_over_without_freeing() -> None:
    tree = make_tree()
    slots = put(tree, list(range(30)))
    m = match(tree, list(range(30)))
    parent, chain = tree.chain_from(m.last_device_node, 10)
    assert tree.chain_is_exclusive(chain, own_locks=0)
    free_before = tree.token_to_kv_pool_allocator.available_size()
    mine = tree.detach_chain(parent, chain)
    assert torch.equal(mine, slots[10:])
    assert tree.token_to_kv_pool_allocator.available_size() == free_before
    assert int(match(tree, list(range(30))).device_prefix_len) == 10
    # the caller owns 20 slots now: the identity holds with them counted as in use
    assert tree.check_integrity(in_use=20)["ok"]
    tree.token_to_kv_pool_allocator.free(mine)
    assert tree.check_integrity()["ok"]


def test_shared_branch_is_not_exclusive_and_extension_is_detected() -> None:
    tree = make_tree()
    put(tree, list(range(40)))
    put(tree, list(range(20)) + [999, 998])
    m = match(tree, list(range(40)))
    _, chain = tree.chain_from(m.last_device_node, 5)
    assert not tree.chain_is_exclusive(chain, own_locks=0)  # [5, 20) is shared
    m30 = match(tree, list(range(30)))
    ext = tree.single_chain_below(m30.last_device_node)
    assert ext is not None and sum(len(n.key) for n in ext) == 10
    tree.inc_lock_ref(m.last_device_node)
    assert tree.single_chain_below(m30.last_device_node) is None  # locked by a request
    tree.dec_lock_ref(m.last_device_node)


def test_purge_subtree_frees_everything_below_and_refuses_locked() -> None:
    tree = make_tree()
    a = put(tree, list(range(50)))
    put(tree, list(range(30)) + [7] * 5)
    m = match(tree, list(range(50)))
    parent, chain = tree.chain_from(m.last_device_node, 25)
    tree.inc_lock_ref(m.last_device_node)
    with pytest.raises(RuntimeError, match="in use"):
        tree.purge_subtree(parent, chain[0])
    tree.dec_lock_ref(m.last_device_node)
    assert tree.check_integrity()["ok"]
    freed = tree.purge_subtree(parent, chain[0])
    assert freed == 25 + 5
    assert not set(a[25:].tolist()) & set(tree.all_slots().tolist())
    assert int(match(tree, list(range(50))).device_prefix_len) == 25
    assert tree.check_integrity()["ok"]


def test_integrity_detects_a_leaked_slot() -> None:
    tree = make_tree()
    put(tree, list(range(10)))
    tree.token_to_kv_pool_allocator.alloc(3)  # taken, owned by nobody
    assert not tree.check_integrity()["ok"]
    assert tree.check_integrity(in_use=3)["ok"]


def test_staged_prefix_overrides_the_tree_path_for_a_prefill() -> None:
    tree = make_tree()

    class Req:  # the two attributes prefix_device_indices reads
        rid = "splice-1"
        prefix_len = 3

    tree.stage_prefix(Req.rid, torch.tensor([9, 8, 7, 6]))
    assert tree.prefix_device_indices(Req()).tolist() == [9, 8, 7]
    tree.unstage_prefix(Req.rid)
    assert Req.rid not in tree.staged_prefixes


# ---- pins (backends/sglang/pins.py) on the same in-process tree ----
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pinned_tree(size: int = 256, fraction: float = 0.5) -> tuple[LeylineRadixCache, Clock]:
    from leyline_agent.backends.sglang.pins import Pins

    tree, clock = make_tree(size), Clock()
    tree.pins = Pins(tree, max_fraction=fraction, clock=clock)
    return tree, clock


def evict(tree: LeylineRadixCache, n: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree.evict(EvictParams(num_tokens=n))


def test_a_pin_survives_eviction_until_its_ttl_passes() -> None:
    tree, clock = pinned_tree()
    put(tree, list(range(40)), "p")
    put(tree, list(range(500, 540)), "q")
    pin = tree.pins.pin(match(tree, list(range(40)), "p").last_device_node, 40, 30.0, "s1")
    assert tree.pins.pinned_slots() == 40 == int(tree.protected_size_)
    evict(tree, 256)  # everything evictable goes: the unpinned sequence
    assert int(match(tree, list(range(40)), "p").device_prefix_len) == 40
    assert int(match(tree, list(range(500, 540)), "q").device_prefix_len) == 0
    assert tree.check_integrity()["ok"]
    clock.t += 30.0  # the TTL passes: the next eviction releases the pin first
    evict(tree, 256)
    assert int(match(tree, list(range(40)), "p").device_prefix_len) == 0
    assert len(tree.pins) == 0 and int(tree.protected_size_) == 0
    assert not tree.pins.unpin(pin.pin_id)  # expired: nothing to release
    assert tree.check_integrity()["ok"]


def test_pin_cap_counts_shared_slots_once_and_refuses_beyond_it() -> None:
    from leyline_agent.backends.sglang.errors import SpliceError

    tree, _ = pinned_tree(size=256, fraction=0.5)  # cap 128 slots
    put(tree, list(range(100)), "p")
    put(tree, list(range(60)) + list(range(900, 920)), "p")  # shares 60 with the first
    put(tree, list(range(300, 350)), "p")
    a = tree.pins.pin(match(tree, list(range(100)), "p").last_device_node, 100, 5.0, "s1")
    b_node = match(tree, list(range(60)) + list(range(900, 920)), "p").last_device_node
    tree.pins.pin(b_node, 80, 5.0, "s2")
    assert tree.pins.pinned_slots() == 120  # 100 + the 20 the second does not share
    protected = int(tree.protected_size_)
    with pytest.raises(SpliceError) as e:  # 120 + 50 > 128
        tree.pins.pin(match(tree, list(range(300, 350)), "p").last_device_node, 50, 5.0, "s3")
    assert e.value.status == 429
    assert len(tree.pins) == 2 and int(tree.protected_size_) == protected  # nothing changed
    assert tree.pins.unpin(a.pin_id)
    assert tree.pins.pinned_slots() == 80
    assert tree.pins.release_owner("s2") == 1 and tree.pins.release_owner("s2") == 0
    assert int(tree.protected_size_) == 0 and tree.check_integrity()["ok"]


def test_locks_on_and_release_under_see_only_pins_through_a_node() -> None:
    tree, _ = pinned_tree()
    put(tree, list(range(50)), "p")
    node = match(tree, list(range(50)), "p").last_device_node
    tree.pins.pin(node, 50, 5.0, None)
    parent, chain = tree.chain_from(node, 30)  # split: the pin's path now has two nodes
    assert [tree.pins.locks_on(n) for n in chain] == [1] * len(chain)
    assert tree.pins.locks_on(parent) == 1
    put(tree, list(range(100, 110)), "p")
    assert tree.pins.locks_on(match(tree, list(range(100, 110)), "p").last_device_node) == 0
    assert tree.pins.release_under(set(tree.subtree_nodes(chain[0]))) == 1
    assert int(tree.protected_size_) == 0 and tree.check_integrity()["ok"]


def test_reset_drops_every_pin() -> None:
    tree, _ = pinned_tree()
    put(tree, list(range(20)), "p")
    tree.pins.pin(match(tree, list(range(20)), "p").last_device_node, 20, 5.0, None)
    tree.reset()  # the scheduler's flush_cache also resets the allocator; the tree is empty
    assert len(tree.pins) == 0 and tree.pins.pinned_slots() == 0
    assert int(tree.protected_size_) == 0 and not tree.root_node.children


def test_free_slots_expands_pages_of_a_paged_allocator() -> None:
    """``/leyline/stats`` counts slots: a paged allocator's free list holds page ids."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from leyline_agent.backends.sglang.integrity import free_slots

    alloc = PagedTokenToKVPoolAllocator(32, 4, torch.bfloat16, "cpu", None, need_sort=False)
    total_free = int(alloc.available_size())
    taken = alloc.alloc(8)
    free = free_slots(alloc)
    assert int(free.numel()) == int(alloc.available_size()) == total_free - 8
    assert len(set(free.tolist())) == int(free.numel())
    assert not set(free.tolist()) & set(taken.tolist())
    alloc.free(taken)
    assert int(free_slots(alloc).numel()) == total_free
    tok = TokenToKVPoolAllocator(32, torch.bfloat16, "cpu", None, need_sort=False)
    assert int(free_slots(tok).numel()) == int(tok.available_size())
