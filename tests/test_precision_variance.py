"""The theory's per-entry rounding variance (read from exponent bits, its underflow and saturation
terms skipped where quantize says they cannot apply) against the textbook formula with frexp."""

from __future__ import annotations

import math

import pytest
import torch

from diagnostics.measure.quant import RECIPES, quantize
from diagnostics.theory.quant import element_noise, noise_sums, unit_ideal_noise


def _reference(x, cast):
    """min(step^2 / 12, s^2), (|s| - max)^2 above max, step = 2^(max(floor(log2|s|), emin) - mbits), in x's units."""
    _, _, kept = quantize(x, cast, keep_scaled=True)
    s, fmt = kept.scaled.double(), cast.format
    _, exp = torch.frexp(s.abs())
    step = torch.exp2((exp - 1).clamp(min=fmt.emin).double() - fmt.mbits)
    var = torch.minimum(step**2 / 12, s * s)
    var = torch.where(s.abs() > fmt.max, (s.abs() - fmt.max) ** 2, var)
    r = kept.reader.double()
    var = var * r * r if cast.scale_rounding == "e4m3_nv" else var / (r * r)
    return var.reshape(x.shape[0], -1)[:, : x.shape[1]]


def _operand(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 80, generator=g) * torch.logspace(-30, 3, 80)  # columns across 33 decades
    x[3, :7] = 0.0  # exact zeros
    x[5, 9] = 1e6  # a massive entry
    return x


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("gemm", ["fprop", "wgrad"])
def test_element_noise_matches_frexp_formula(name, gemm):
    x = _operand(1)
    cast = RECIPES[name].casts(gemm)[0]  # input (fprop) or grad_output (wgrad): e4m3, e5m2 or e2m1
    q, st, kept = quantize(x, cast, keep_scaled=True)
    small = x.numel() - st.nonzero + st.underflow > 0
    got = element_noise(x, cast, kept, st.overflow > 0, small).double()
    want = _reference(x, cast)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-20 * float(want.max()))  # float32 range
    # the flags are exact: with them forced on, the same variances
    assert torch.allclose(element_noise(x, cast).double(), want, rtol=1e-5, atol=1e-20 * float(want.max()))  # float32 range
    # negative control: claiming no entry became 0 where one did changes the zeros' variance
    if small:
        wrong = element_noise(x, cast, kept, st.overflow > 0, small=False).double()
        assert not torch.allclose(wrong, want, rtol=1e-5, atol=1e-20 * float(want.max()))  # float32 range


def test_unit_ideal_noise_and_sums():
    x = _operand(2)
    _, exp = torch.frexp(x.double().abs())
    want = torch.where(x == 0, 0.0, torch.exp2(2.0 * (exp - 1).double()) / 12)
    got = unit_ideal_noise(x).double()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-36)
    assert not torch.allclose(got * (1 + 1e-3), want, rtol=1e-6, atol=1e-36)  # the tolerance can fail
    v, v2 = noise_sums(got.float())
    assert torch.allclose(v.double(), want.sum(0), rtol=1e-5) and torch.allclose(v2.double(), (want**2).sum(0), rtol=1e-5)


def test_quantize_skips_clamp_only_where_nothing_saturates():
    x = _operand(3)
    for name in ("tensorwise", "rowwise", "mxfp8", "mxfp4", "nvfp4"):
        cast = RECIPES[name].fprop[0]
        q, st = quantize(x, cast)
        _, _, kept = quantize(x, cast, keep_scaled=True)
        s = kept.scaled
        assert st.overflow == int((s.abs() > cast.format.max).sum()), name
        assert torch.isfinite(q).all(), name
        assert math.isclose(st.power, float(x.double().square().sum()), rel_tol=1e-5), name
