"""``--attention-backend leyline_cpu`` (``backends/sglang/attention.py``): the same results as
``torch_native``, layer by layer and end to end.

The layer tests call both backends' ``_run_sdpa_forward_extend`` on the same tensors: SGLang's
real KV pools (``MLATokenToKVPool``, ``MHATokenToKVPool``) and ``ReqToTokenPool``, batches of
several requests with mixed prefix and extend lengths, slots scattered over the pool.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

pytestmark = pytest.mark.sglang

# (prefix_len, extend_len) per request: zero prefix, one new token, long and short extends.
BATCHES = [
    [(0, 7)],
    [(5, 1)],
    [(0, 12), (9, 3), (31, 1), (4, 20)],
    [(17, 5), (0, 1), (0, 9), (40, 2), (2, 2)],
]

# name -> (q_heads, kv_heads, qk_dim, v_dim); "mla" is the embedded model's absorbed MLA layer.
SHAPES = {
    "mla": (4, 1, 80, 64),
    "mha": (4, 4, 32, 32),
    "gqa": (8, 2, 16, 16),
}

# bf16: both backends round to bf16 once per output element, from fp32 sums taken in a different
# order; outputs are O(1), where one bf16 step is 2**-7 .. 2**-6.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _kv_pool(shape: str, dtype: torch.dtype, size: int):
    """SGLang's own pool for the shape, buffers filled with random values."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    _, kv_heads, qk_dim, v_dim = SHAPES[shape]
    common = dict(size=size, page_size=1, dtype=dtype, layer_num=1, device="cpu")
    if shape == "mla":
        pool = MLATokenToKVPool(
            **common, kv_lora_rank=v_dim, qk_rope_head_dim=qk_dim - v_dim, enable_memory_saver=False
        )
    else:
        pool = MHATokenToKVPool(
            **common,
            head_num=kv_heads,
            head_dim=qk_dim,
            v_head_dim=v_dim,
            enable_memory_saver=False,
        )
    k, v = pool.get_key_buffer(0), pool.get_value_buffer(0)
    k.copy_(torch.randn(k.shape))
    if v.data_ptr() != k.data_ptr():  # MLA: v is a view of k's first kv_lora_rank columns
        v.copy_(torch.randn(v.shape))
    return k, v


def _backends():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from leyline_agent.backends.sglang.attention import LeylineCpuAttnBackend

    runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
    return TorchNativeAttnBackend(runner), LeylineCpuAttnBackend(runner)


def _run_both(
    shape: str,
    dtype: torch.dtype,
    batch: list[tuple[int, int]],
    seed: int,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    torch.manual_seed(seed)
    rng = random.Random(seed)
    q_heads, kv_heads, qk_dim, v_dim = SHAPES[shape]
    pool_size = 256
    k_cache, v_cache = _kv_pool(shape, dtype, pool_size)
    r2t = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
    slots = rng.sample(range(1, pool_size + 1), sum(p + e for p, e in batch))  # slot 0 reserved
    rows = rng.sample(range(1, 9), len(batch))
    for row, (p, e) in zip(rows, batch, strict=True):
        r2t.req_to_token[row, : p + e] = torch.tensor([slots.pop() for _ in range(p + e)])
    prefix = torch.tensor([p for p, _ in batch])
    extend = torch.tensor([e for _, e in batch])
    n_new = int(extend.sum())
    query = torch.randn(n_new, q_heads, qk_dim).to(dtype)
    args = dict(
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=r2t.req_to_token,
        req_pool_indices=torch.tensor(rows),
        seq_lens=prefix + extend,
        extend_prefix_lens=prefix,
        extend_seq_lens=extend,
        scaling=qk_dim**-0.5,
        enable_gqa=q_heads != kv_heads,
        **{"causal": True, **kwargs},
    )
    native, leyline = _backends()
    outs = []
    for backend in (native, leyline):
        out = torch.full((n_new, q_heads, v_dim), float("nan"), dtype=dtype)
        backend._run_sdpa_forward_extend(query, out, **args)
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch_idx", range(len(BATCHES)))
def test_extend_matches_torch_native(shape: str, dtype: torch.dtype, batch_idx: int) -> None:
    want, got = _run_both(shape, dtype, BATCHES[batch_idx], seed=batch_idx)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sliding_window_matches(shape: str) -> None:
    want, got = _run_both(shape, torch.float32, BATCHES[3], seed=7, sliding_window_size=6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_non_causal_matches() -> None:
    want, got = _run_both("mha", torch.float32, BATCHES[2], seed=3, causal=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _run_both_decode(
    shape: str, dtype: torch.dtype, seq_lens: list[int], seed: int, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per request against ``seq_lens`` cached keys, both backends."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    torch.manual_seed(seed)
    rng = random.Random(seed)
    q_heads, kv_heads, qk_dim, v_dim = SHAPES[shape]
    k_cache, v_cache = _kv_pool(shape, dtype, 256)
    r2t = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
    slots = rng.sample(range(1, 257), sum(seq_lens))
    rows = rng.sample(range(1, 9), len(seq_lens))
    for row, n in zip(rows, seq_lens, strict=True):
        r2t.req_to_token[row, :n] = torch.tensor([slots.pop() for _ in range(n)])
    query = torch.randn(len(seq_lens), q_heads, qk_dim).to(dtype)
    args = dict(
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=r2t.req_to_token,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        scaling=qk_dim**-0.5,
        enable_gqa=q_heads != kv_heads,
        **{"causal": False, **kwargs},  # as SGLang's forward_decode calls it
    )
    outs = []
    for backend in _backends():
        out = torch.full((len(seq_lens), q_heads, v_dim), float("nan"), dtype=dtype)
        backend._run_sdpa_forward_decode(query, out, **args)
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_matches_torch_native(shape: str, dtype: torch.dtype) -> None:
    want, got = _run_both_decode(shape, dtype, [1, 9, 40, 3, 70], seed=5)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    want, got = _run_both_decode(shape, torch.float32, [12, 30], seed=6, sliding_window_size=8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_sdpa_equals_sdpa_with_enable_gqa() -> None:
    """The stacked form against SDPA's own GQA, with a mask, causal and plain, bit for bit in
    fp32 at these sizes."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from leyline_agent.backends.sglang.attention import grouped_sdpa

    torch.manual_seed(0)
    for n in (5, 100):  # stacked, and past FOLD_MAX_QUERIES
        q, k, v = torch.randn(8, n, 16), torch.randn(2, n, 16), torch.randn(2, n, 12)
        mask = torch.rand(n, n) > 0.3
        mask[:, 0] = True
        for m, causal in ((mask, False), (None, True), (None, False)):
            want = sdpa(q[None], k[None], v[None], attn_mask=m, is_causal=causal, enable_gqa=True)
            got = grouped_sdpa(q, k, v, m, causal, None)
            torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)


def test_zero_length_extend_is_skipped() -> None:
    """A request with no new tokens in the batch writes nothing and shifts nothing."""
    want, got = _run_both("mla", torch.float32, [(3, 4), (6, 0), (2, 5)], seed=11)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_register_backend_is_idempotent() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    from leyline_agent.backends.sglang import attention

    attention.register_backend()
    attention.register_backend()
    assert ATTENTION_BACKENDS["leyline_cpu"] is attention.create_leyline_cpu_backend
    assert ATTENTION_BACKEND_CHOICES.count("leyline_cpu") == 1
    attention.register_deepseek_forward_method()
    assert AttentionBackendRegistry.get_handler("leyline_cpu")() == AttnForwardMethod.MLA


@pytest.mark.live
def test_launch_uses_leyline_cpu_on_cpu(tmp_path) -> None:
    from leyline_agent.backends.sglang.launch import server_command

    def backend(cpu: bool) -> str | None:
        argv, _ = server_command(
            tmp_path, port=1, dummy=True, dtype=None, max_total_tokens=None, extra=[], cpu=cpu
        )
        return (
            argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else None
        )

    assert backend(cpu=True) == "leyline_cpu"
    assert backend(cpu=False) is None


# Prompts for the end-to-end test: two requests prefilled together, then each one extended after
# a prefix-cache hit (a real extend with a prefix), then a new request.
_E2E_BASE = [list(range(1000 + 37 * i, 1000 + 37 * i + 40)) for i in range(2)]
_E2E_STEPS = [
    _E2E_BASE,
    [_E2E_BASE[0] + [11, 12, 13], _E2E_BASE[1] + [21]],
    [list(range(5000, 5025))],
]


def _greedy_outputs(backend: str) -> list[tuple[list[int], int]]:
    import httpx

    from leyline_agent.backends.sglang.launch import EmbeddedServer

    results = []
    # fp32 so that the two kernels' rounding cannot flip a near-tie of the random-weight logits.
    with EmbeddedServer(
        max_total_tokens=4096,
        extra_args=["--dtype", "float32", "--random-seed", "0", "--attention-backend", backend],
    ) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            info = json.dumps(http.get("/server_info").json())
            assert f'"attention_backend": "{backend}"' in info  # the resolved server args
            for prompts in _E2E_STEPS:
                body = {
                    "input_ids": prompts,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                }
                r = http.post("/generate", json=body)
                r.raise_for_status()
                for item in r.json():
                    results.append((item["output_ids"], item["meta_info"]["cached_tokens"]))
    return results


@pytest.mark.live
def test_greedy_tokens_unchanged_end_to_end() -> None:
    """Two real servers, one after the other: the same greedy tokens with either backend."""
    native = _greedy_outputs("torch_native")
    leyline = _greedy_outputs("leyline_cpu")
    assert [ids for ids, _ in leyline] == [ids for ids, _ in native]
    assert all(len(ids) == 8 for ids, _ in leyline)
    cached = [c for _, c in leyline]
    assert cached[2] >= 40 and cached[3] >= 40  # the second step extended after a cached prefix
