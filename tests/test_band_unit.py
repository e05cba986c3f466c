"""``numerics.band_unit``: the tolerance of a re-rotated rope band. bf16 rows with components of
very different sizes, moved by ``delta_rotate`` (the torch path a CPU server runs), are within it
everywhere, while the plain 1-bf16-ulp metric is exceeded where a component cancels to near zero
(as on layer 11 of SmolLM2-135M's real weights: 8.13 plain ulps)."""

from __future__ import annotations

import torch

from leyline_agent.kernels.delta_rotation import delta_rotate
from leyline_agent.kernels.rope import RopeBand, RopeSpec, rotate
from leyline_agent.testing.numerics import band_unit, ulp


def test_rotated_bf16_band_within_band_unit_but_not_within_one_plain_ulp() -> None:
    torch.manual_seed(0)
    spec, band = RopeSpec(rotary_dim=64, base=100000.0, pairing="neox"), RopeBand(0, 64)
    n = 4000
    scale = torch.exp(torch.randn(1, 3, 64) * 1.5)  # a few large pairs, many small ones
    buf = (torch.randn(n, 3, 64) * scale).to(torch.bfloat16)
    old = buf.clone()
    src, pos = torch.arange(n), torch.randint(0, 8000, (n,))
    new = (pos + torch.randint(-300, 300, (n,))).clamp_min(0)
    delta_rotate([buf], src, src, pos, new, spec, band, impl="torch")
    exact = rotate(old.double(), new - pos, spec)
    err = (buf.double() - exact).abs()
    unit = band_unit(exact, old.double())
    assert unit.shape == exact.shape and bool((unit >= ulp(exact)).all())
    assert float((err / unit).max()) <= 1.0  # measured 0.65
    plain = err / ulp(exact)
    worst = plain.flatten().argmax()
    assert float(plain.max()) > 1.0  # measured 6.74: the plain metric alone would fail
    # ... and only where the exact value is tiny against its row's band
    norms = old.double().norm(dim=-1, keepdim=True).expand_as(exact).flatten()
    assert float(exact.flatten()[worst].abs() / norms[worst]) < 1e-6
