"""δ-rotation of cached RoPE keys: torch reference against the fp64 oracle, Triton against torch.

Tolerances are stated relative to the band's largest magnitude M and the storage ulp there,
``ulp(M) = 2**(floor(log2 M) - mantissa_bits)``:

- rotate once, compared with the exact ``s·R(i+Δ)k`` (fp64): the stored band is already rounded
  (≤ 0.5 ulp per element), a rotation mixes two such errors into ≤ (|cos|+|sin|)·0.5 ≤ 0.71 ulp,
  and the result is rounded once more (0.5 ulp): 1.21 ulp, so 1.25·ulp(M); plus the fp32 math
  (angle reduced in fp64, then fp32 cos/sin and two products: a few 1e-7·M), budget 1e-6·M,
  which is what decides fp32 storage.
- Δ then -Δ back to the original: the same argument (the first rounding error is rotated back,
  the second is added), so the same bound.
- Triton against torch: same formula, fp32 rounding/contraction differences may flip the final
  rounding by one storage ulp: 1·ulp(M) + 1e-6·M.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from leyline_agent.kernels.delta_rotation import Rotation, check_inputs, delta_rotate
from leyline_agent.kernels.rope import RopeBand, RopeSpec, mla_band, mscale, rotate

# The torch reference (`delta_rotation_ref`) behind the public checks.
delta_rotate_torch = functools.partial(delta_rotate, impl="torch")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
MAX_POS = 160_000


class Layout(NamedTuple):
    spec: RopeSpec
    band: RopeBand
    heads: int
    row: int


def _mla_layout() -> Layout:
    # DeepSeek-V2-like MLA row with non-power-of-two sizes; YaRN mscale ≈ 1.369 ≠ 1.
    config = {
        "model_type": "deepseek_v2",
        "kv_lora_rank": 100,
        "qk_rope_head_dim": 24,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        },
    }
    return Layout(RopeSpec.from_hf_config(config), mla_band(config), 1, 124)


LAYOUTS: dict[str, Layout] = {
    "mla": _mla_layout(),
    "mha-first": Layout(RopeSpec(rotary_dim=24, base=500000.0), RopeBand(0, 24), 3, 40),
    "mha-last": Layout(RopeSpec(rotary_dim=24, pairing="interleaved"), RopeBand(16, 24), 3, 40),
}


class Cache(NamedTuple):
    buffers: list[torch.Tensor]
    keys: list[torch.Tensor]  # fp64 unrotated band per layer [S, H, d]
    pos: torch.Tensor  # [S] positions the stored bands sit at


def make_cache(layout: Layout, dtype: torch.dtype, slots: int = 48, layers: int = 3) -> Cache:
    """Buffers whose band holds ``mscale · R(pos) k`` rounded to ``dtype``; random elsewhere."""
    gen = torch.Generator().manual_seed(1234)
    pos = torch.randint(0, MAX_POS, (slots,), generator=gen)
    s = mscale(layout.spec)
    buffers, keys = [], []
    for _ in range(layers):
        buf = torch.randn(slots, layout.heads, layout.row, generator=gen, dtype=torch.float64)
        k = torch.randn(slots, layout.heads, layout.band.dim, generator=gen, dtype=torch.float64)
        buf[..., layout.band.offset : layout.band.offset + layout.band.dim] = s * rotate(
            k, pos, layout.spec
        )
        buffers.append(buf.to(dtype))
        keys.append(k)
    return Cache(buffers, keys, pos)


def band_of(buf: torch.Tensor, band: RopeBand) -> torch.Tensor:
    return buf[..., band.offset : band.offset + band.dim]


def outside_band(buf: torch.Tensor, band: RopeBand) -> torch.Tensor:
    return torch.cat((buf[..., : band.offset], buf[..., band.offset + band.dim :]), dim=-1)


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA[dtype])


def tol_vs_oracle(dtype: torch.dtype, magnitude: float) -> float:
    return 1.25 * ulp(dtype, magnitude) + 1e-6 * magnitude


def tol_vs_torch(dtype: torch.dtype, magnitude: float) -> float:
    return ulp(dtype, magnitude) + 1e-6 * magnitude


@pytest.fixture
def triton_rotate(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """The Triton kernel on CPU tensors: through the interpreter (scoped TRITON_INTERPRET=1)
    without a GPU; with one, inputs go to CUDA and the buffers come back.

    Same arguments as `delta_rotate`'s first seven, checked by `check_inputs`, plus ``programs``
    (grid target, see `delta_rotate_triton`).
    """
    pytest.importorskip("triton")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at import (jit) and at launch
    from leyline_agent.kernels.delta_rotation_triton import delta_rotate_triton

    def _launch(
        buffers: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
        old_pos: torch.Tensor,
        new_pos: torch.Tensor,
        spec: RopeSpec,
        band: RopeBand,
        *,
        programs: int,
    ) -> None:
        rot = Rotation(src, dst, old_pos, new_pos)
        copies = check_inputs(buffers, rot, spec, band)
        delta_rotate_triton(buffers, rot, spec, band, copies=copies, programs=programs)

    def run(buffers: list[torch.Tensor], *args: object, programs: int = 1024) -> None:
        if not on_gpu:
            _launch(buffers, *args, programs=programs)
            return
        gpu = [b.cuda() for b in buffers]
        _launch(
            gpu, *(a.cuda() if isinstance(a, torch.Tensor) else a for a in args), programs=programs
        )
        for buf, out in zip(buffers, gpu, strict=True):
            buf.copy_(out.cpu())

    return run


def _moves(slots: int, n: int, seed: int, copy: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots, generator=gen)
    src = perm[:n]
    dst = perm[n : 2 * n] if copy else src.clone()
    return src, dst


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_matches_fresh_rotation(layout: Layout, dtype: torch.dtype, copy: bool) -> None:
    cache = make_cache(layout, dtype)
    src, dst = _moves(48, 20, seed=1, copy=copy)
    new_pos = torch.randint(0, MAX_POS, (20,), generator=torch.Generator().manual_seed(2))
    delta_rotate_torch(cache.buffers, src, dst, cache.pos[src], new_pos, layout.spec, layout.band)
    s = mscale(layout.spec)
    for buf, k in zip(cache.buffers, cache.keys, strict=True):
        want = s * rotate(k[src], new_pos, layout.spec)  # keeps mscale: s·R(i+Δ)k
        got = band_of(buf[dst], layout.band).double()
        magnitude = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol_vs_oracle(dtype, magnitude)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_round_trip(layout: Layout, dtype: torch.dtype) -> None:
    cache = make_cache(layout, dtype)
    before = [b.clone() for b in cache.buffers]
    slots = torch.arange(48)
    new_pos = (cache.pos + torch.randint(-5000, 5000, (48,))).clamp(min=0)
    delta_rotate_torch(cache.buffers, slots, slots, cache.pos, new_pos, layout.spec, layout.band)
    delta_rotate_torch(cache.buffers, slots, slots, new_pos, cache.pos, layout.spec, layout.band)
    for buf, orig in zip(cache.buffers, before, strict=True):
        got, want = band_of(buf, layout.band).double(), band_of(orig, layout.band).double()
        magnitude = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol_vs_oracle(dtype, magnitude)
        assert torch.equal(outside_band(buf, layout.band), outside_band(orig, layout.band))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_non_band_bits_untouched(
    layout: Layout, dtype: torch.dtype, impl: str, request: pytest.FixtureRequest
) -> None:
    rotate_fn = request.getfixturevalue("triton_rotate") if impl == "triton" else delta_rotate_torch
    cache = make_cache(layout, dtype, slots=24, layers=2)
    before = [b.clone() for b in cache.buffers]
    # Two in-place entries and three copies to fresh slots.
    src = torch.tensor([0, 3, 5, 7, 9])
    dst = torch.tensor([0, 3, 20, 21, 22])
    new_pos = torch.tensor([0, 17, 123_456, 99, 5])
    rotate_fn(cache.buffers, src, dst, cache.pos[src], new_pos, layout.spec, layout.band)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[dst] = False
    for buf, orig in zip(cache.buffers, before, strict=True):
        # dst rows: non-band columns are the src row's bits; every other row is unchanged.
        assert torch.equal(
            outside_band(buf[dst], layout.band), outside_band(orig[src], layout.band)
        )
        assert torch.equal(buf[untouched], orig[untouched])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_triton_matches_torch(
    layout: Layout, dtype: torch.dtype, triton_rotate: Callable[..., None]
) -> None:
    ref = make_cache(layout, dtype, slots=40, layers=3)
    tri = make_cache(layout, dtype, slots=40, layers=3)
    src = torch.tensor([1, 4, 6, 8, 10, 12, 14, 16, 18])
    dst = torch.tensor([1, 4, 30, 31, 32, 33, 34, 35, 36])
    new_pos = torch.tensor([0, 159_999, 7, 70_000, 3, 1, 100_000, 42, 4096])
    args = (src, dst, ref.pos[src], new_pos, layout.spec, layout.band)
    delta_rotate_torch(ref.buffers, *args)
    triton_rotate(tri.buffers, *args)
    for got, want in zip(tri.buffers, ref.buffers, strict=True):
        magnitude = band_of(want, layout.band).abs().max().item()
        diff = (got.double() - want.double()).abs().max().item()
        assert diff <= tol_vs_torch(dtype, magnitude)


def test_triton_layer_groups(triton_rotate: Callable[..., None]) -> None:
    """Programs that loop several layers (the GPU path for many slots) agree with torch."""
    layout = LAYOUTS["mla"]
    ref = make_cache(layout, torch.float32, slots=40, layers=5)
    tri = make_cache(layout, torch.float32, slots=40, layers=5)
    src, dst = _moves(40, 12, seed=3, copy=True)
    new_pos = torch.randint(0, MAX_POS, (12,))
    args = (src, dst, ref.pos[src], new_pos, layout.spec, layout.band)
    delta_rotate_torch(ref.buffers, *args)
    triton_rotate(tri.buffers, *args, programs=2)  # 1 slot block: 2 groups of 3 and 2 layers
    for got, want in zip(tri.buffers, ref.buffers, strict=True):
        magnitude = band_of(want, layout.band).abs().max().item()
        assert (got - want).abs().max().item() <= tol_vs_torch(torch.float32, magnitude)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (a 4.3 GB buffer)")
def test_triton_offsets_past_2_31_elements() -> None:
    """Rows whose element offsets exceed 2**31 (the kernel indexes in int64) agree with torch:
    n rotated in place, n copied to the last rows of the buffer."""
    layout = LAYOUTS["mla"]
    n = 16
    slots = 2**31 // layout.row + 8 * n
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(2 * n, 1, layout.row, generator=gen).to(torch.bfloat16)
    old_pos = torch.randint(0, MAX_POS, (2 * n,), generator=gen)
    new_pos = torch.randint(0, MAX_POS, (2 * n,), generator=gen)
    ref = [rows.clone()]
    here = torch.arange(2 * n)
    delta_rotate(ref, here, here, old_pos, new_pos, layout.spec, layout.band, impl="torch")

    src = torch.arange(slots - 4 * n, slots - 2 * n, device="cuda")
    assert int(src[0]) * layout.row > 2**31
    dst = torch.cat([src[:n], torch.arange(slots - n, slots, device="cuda")])
    big = torch.zeros(slots, 1, layout.row, dtype=torch.bfloat16, device="cuda")
    big[src] = rows.cuda()
    delta_rotate(
        [big], src, dst, old_pos.cuda(), new_pos.cuda(), layout.spec, layout.band, impl="triton"
    )
    got, want = big[dst].cpu().double(), ref[0].double()
    magnitude = band_of(ref[0], layout.band).abs().max().item()
    assert (got - want).abs().max().item() <= tol_vs_torch(torch.bfloat16, magnitude)


def test_mscale_is_kept_not_reapplied() -> None:
    """The stored key carries YaRN's mscale; the rotation uses unit cos/sin and keeps it."""
    layout = LAYOUTS["mla"]
    s = mscale(layout.spec)
    assert s > 1.3
    cache = make_cache(layout, torch.float32)
    slots = torch.arange(48)
    norms = band_of(cache.buffers[0], layout.band).norm(dim=-1)
    delta_rotate(cache.buffers, slots, slots, cache.pos, cache.pos // 2, layout.spec, layout.band)
    after = band_of(cache.buffers[0], layout.band).norm(dim=-1)
    torch.testing.assert_close(after, norms, rtol=1e-6, atol=0)
    want = s * rotate(cache.keys[0], cache.pos // 2, layout.spec)
    got = band_of(cache.buffers[0], layout.band).double()
    magnitude = want.abs().max().item()
    assert (got - want).abs().max().item() <= tol_vs_oracle(torch.float32, magnitude)


def test_in_place_equals_copy() -> None:
    layout = LAYOUTS["mha-last"]
    a = make_cache(layout, torch.bfloat16)
    b = make_cache(layout, torch.bfloat16)
    src = torch.arange(10)
    new_pos = torch.arange(10) * 1000
    delta_rotate(a.buffers, src, src, a.pos[src], new_pos, layout.spec, layout.band)
    delta_rotate(b.buffers, src, src + 30, b.pos[src], new_pos, layout.spec, layout.band)
    for x, y in zip(a.buffers, b.buffers, strict=True):
        assert torch.equal(x[src], y[src + 30])


def test_empty_is_a_no_op() -> None:
    layout = LAYOUTS["mla"]
    cache = make_cache(layout, torch.float16)
    before = [b.clone() for b in cache.buffers]
    empty = torch.empty(0, dtype=torch.int64)
    delta_rotate(cache.buffers, empty, empty, empty, empty, layout.spec, layout.band)
    assert all(torch.equal(x, y) for x, y in zip(cache.buffers, before, strict=True))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_negative_new_position_raises(impl: str, request: pytest.FixtureRequest) -> None:
    rotate_fn = request.getfixturevalue("triton_rotate") if impl == "triton" else delta_rotate_torch
    layout = LAYOUTS["mla"]
    cache = make_cache(layout, torch.bfloat16)
    before = [b.clone() for b in cache.buffers]
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="negative"):
        rotate_fn(
            cache.buffers,
            slots,
            slots,
            cache.pos[slots],
            torch.tensor([5, -1]),
            layout.spec,
            layout.band,
        )
    assert all(torch.equal(x, y) for x, y in zip(cache.buffers, before, strict=True))


def _bad_cases() -> dict[str, tuple[Callable[[dict], None], type[Exception], str]]:
    def set_(key: str, value: object) -> Callable[[dict], None]:
        return lambda a: a.__setitem__(key, value)

    return {
        "not-a-sequence": (lambda a: a.update(buffers=a["buffers"][0]), TypeError, "sequence"),
        "auto-not-a-sequence": (
            lambda a: a.update(buffers=a["buffers"][0], impl="auto"),
            TypeError,
            "sequence",
        ),
        "no-layers": (set_("buffers", []), TypeError, "non-empty"),
        "non-contiguous": (
            lambda a: a.update(buffers=[b[::2] for b in a["buffers"]]),
            ValueError,
            "contiguous",
        ),
        "fp64-buffer": (
            lambda a: a.update(buffers=[b.double() for b in a["buffers"]]),
            ValueError,
            "dtype",
        ),
        "mixed-layers": (
            lambda a: a["buffers"].__setitem__(1, a["buffers"][1][:10].clone()),
            ValueError,
            "must match",
        ),
        "2d-buffer": (
            lambda a: a.update(buffers=[b[:, 0] for b in a["buffers"]]),
            ValueError,
            "heads",
        ),
        "int32-ids": (lambda a: a.update(src=a["src"].int()), ValueError, "int64"),
        "list-ids": (set_("dst", [0, 1]), TypeError, "torch.Tensor"),
        "length-mismatch": (lambda a: a.update(new_pos=a["new_pos"][:1]), ValueError, "one length"),
        "slot-out-of-range": (set_("dst", torch.tensor([0, 48])), ValueError, r"\[0, 48\)"),
        "negative-old": (set_("old_pos", torch.tensor([-3, 0])), ValueError, "old_pos"),
        "band-mismatch": (set_("band", RopeBand(100, 22)), ValueError, "rotary_dim"),
        "band-outside-row": (
            set_("band", RopeBand(110, 24)),
            ValueError,
            "does not fit",
        ),
        "duplicate-dst": (
            lambda a: a.update(src=torch.tensor([2, 3]), dst=torch.tensor([5, 5])),
            ValueError,
            "repeated",
        ),
        "read-write-hazard": (
            lambda a: a.update(src=torch.tensor([2, 3]), dst=torch.tensor([3, 9])),
            ValueError,
            "fresh slots",
        ),
        "impl-name": (set_("impl", "cuda"), ValueError, "impl"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_inputs_raise(case: tuple[Callable[[dict], None], type[Exception], str]) -> None:
    mutate, error, message = case
    layout = LAYOUTS["mla"]
    cache = make_cache(layout, torch.float16)
    args = {
        "buffers": list(cache.buffers),
        "src": torch.tensor([0, 1]),
        "dst": torch.tensor([0, 1]),
        "old_pos": torch.tensor([10, 20]),
        "new_pos": torch.tensor([11, 21]),
        "spec": layout.spec,
        "band": layout.band,
        "impl": "torch",
    }
    mutate(args)
    with pytest.raises(error, match=message):
        delta_rotate(**args)


def test_triton_on_cpu_without_interpreter_is_refused(
    triton_rotate: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter flag must stay set while calling; without it the wrapper says so."""
    if torch.cuda.is_available():
        pytest.skip("needs the CPU interpreter path")
    monkeypatch.delenv("TRITON_INTERPRET")
    layout = LAYOUTS["mla"]
    cache = make_cache(layout, torch.float16)
    slots = torch.tensor([0])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_rotate(cache.buffers, slots, slots, slots, slots, layout.spec, layout.band)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_dequantize_rotate_quantize_within_twice_the_round_trip(fp8: torch.dtype) -> None:
    """Issue 15's stretch, the executor's fp8 path (``splice.py``: the stored fp8 rows to fp32,
    rotated there, quantized back) against the true key at the new position: its error is at most
    twice that of quantizing the true key there directly (a fresh fp8 prefill), relative L2 over
    4,096 keys; outside the band the bytes are unchanged."""
    torch.manual_seed(0)
    spec, band, n = RopeSpec(rotary_dim=32, base=1e6), RopeBand(0, 32), 4096
    k = torch.randn(n, 2, 48, dtype=torch.float64) * 2.0
    old = torch.randint(0, 30000, (n,))
    delta = torch.randint(-2000, 2000, (n,))
    new = (old + delta).clamp_min(0)

    def at(pos: torch.Tensor) -> torch.Tensor:  # the true key at ``pos`` (fp64)
        out = k.clone()
        out[..., :32] = rotate(k[..., :32], pos, spec)
        return out

    stored = at(old).to(fp8)  # what the cache holds before the splice
    tmp = stored.float()
    rows = torch.arange(n)
    delta_rotate([tmp], rows, rows, old, new, spec, band)
    spliced = tmp.to(fp8)
    truth, fresh = at(new), at(new).to(fp8)
    err = (spliced.double() - truth)[..., :32].norm()
    round_trip = (fresh.double() - truth)[..., :32].norm()
    assert float(err / round_trip) <= 2.0, float(err / round_trip)
    assert torch.equal(spliced.view(torch.uint8)[..., 32:], stored.view(torch.uint8)[..., 32:])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_one_delta_for_all_rows_matches_fresh_rotation(layout: Layout, dtype: torch.dtype) -> None:
    """A splice's case: every row shifted by the same Δ (the torch path then broadcasts one
    cos/sin row)."""
    cache = make_cache(layout, dtype)
    src, dst = _moves(48, 20, seed=3, copy=False)
    new_pos = cache.pos[src] - 7
    assert bool((new_pos >= 0).all())
    delta_rotate_torch(cache.buffers, src, dst, cache.pos[src], new_pos, layout.spec, layout.band)
    s = mscale(layout.spec)
    for buf, k in zip(cache.buffers, cache.keys, strict=True):
        want = s * rotate(k[src], new_pos, layout.spec)
        got = band_of(buf[dst], layout.band).double()
        assert (got - want).abs().max().item() <= tol_vs_oracle(dtype, want.abs().max().item())


@pytest.mark.parametrize("pairing", ["neox", "interleaved"])
@pytest.mark.parametrize("rows", [1, 5], ids=["one cos/sin row", "a row each"])
def test_in_place_pair_rotation_is_bit_identical_to_apply_rotation(pairing: str, rows: int) -> None:
    from leyline_agent.kernels.delta_rotation_ref import rotate_pairs_
    from leyline_agent.kernels.rope import apply_rotation

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 64, generator=gen) * 30
    phi = torch.rand(rows, 1, 32, generator=gen) * 6.3
    cos, sin = phi.cos(), phi.sin()
    want = apply_rotation(x, cos, sin, pairing)  # type: ignore[arg-type]
    got = rotate_pairs_(x.clone(), cos, sin, pairing)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)  # it did rotate
