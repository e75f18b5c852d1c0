"""Activation derivatives and the SwiGLU contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given
from hypothesis import strategies as st
from scipy import optimize

from props.record import check, prop
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff

U64 = unit_roundoff(torch.float64)


@st.composite
def points(draw, max_abs: float = 30.0, n: int = 257) -> torch.Tensor:
    """float64 points: a seeded sample in [-max_abs, max_abs] plus 0 and +-1."""
    g = generator(draw(seeds()))
    x = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * max_abs
    return torch.cat([x, torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)])


def _grad(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x).sum(), x)
    return g


@prop("sigmoid' = s(1 - s); tanh' = 1 - tanh^2 (autograd, float64)", needs=())
@given(x=points())
def test_sigmoid_tanh_derivatives(x):
    s, t = torch.sigmoid(x), torch.tanh(x)
    err = max(float((_grad(torch.sigmoid, x) - s * (1 - s)).abs().max()), float((_grad(torch.tanh, x) - (1 - t * t)).abs().max()))
    check(err, 8 * U64, "sigmoid'/tanh' differ from s(1-s), 1-tanh^2")


@prop("silu(x) = x s(x); silu'(x) = s + x s (1 - s) (float64)", needs=("silu",))
@given(x=points())
def test_silu_and_derivative(impl, x):
    s = torch.sigmoid(x)
    val_err = float(((impl.silu(x) - x * s).abs() / (1 + x.abs())).max())
    d_err = float(((_grad(impl.silu, x) - (s + x * s * (1 - s))).abs() / (1 + x.abs())).max())
    check(max(val_err, d_err), 16 * U64, "silu or its derivative differs from x s(x), s + x s(1-s)")


@prop("relu' = 1[x > 0]; leaky_relu' = 1 or slope", needs=())
@given(x=points(), slope=st.sampled_from([0.01, 0.1, 0.2]))
def test_relu_derivatives(x, slope):
    x = x[x != 0]  # the kink has no derivative
    d_relu = _grad(torch.relu, x)
    d_leaky = _grad(lambda v: TF.leaky_relu(v, slope), x)
    assert torch.equal(d_relu, (x > 0).double())
    assert torch.equal(d_leaky, torch.where(x > 0, torch.ones_like(x), torch.full_like(x, slope)))
    check(0.0, 0.0, "relu derivatives", kind="exact")


def _gelu_tanh_gap(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    return float((TF.gelu(t, approximate="tanh") - TF.gelu(t)).abs())


def gelu_tanh_error_bound() -> float:
    """sup_x |gelu_tanh(x) - gelu(x)|, found by bounded maximisation over both lobes (about 4.7e-4).

    The difference is odd-symmetric up to the 0.5 x factor and decays to 0 beyond |x| ~ 6,
    so the supremum lies in [-6, 6]; each lobe has one maximum.
    """
    best = 0.0
    for lo, hi in ((-6.0, -1.0), (-1.0, 0.0), (0.0, 1.0), (1.0, 6.0)):
        r = optimize.minimize_scalar(lambda v: -_gelu_tanh_gap(v), bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
        best = max(best, -float(r.fun))
    return best


GELU_BOUND = gelu_tanh_error_bound()


@prop("|gelu_tanh(x) - gelu_erf(x)| <= 4.8e-4 (the tanh approximation's sup error)", needs=())
@given(x=points(max_abs=12.0))
def test_gelu_tanh_error_bound(x):
    assert 4.0e-4 < GELU_BOUND < 4.8e-4  # the known figure: about 4.7e-4 near |x| = 2.7
    gap = float((TF.gelu(x, approximate="tanh") - TF.gelu(x)).abs().max())
    check(gap, GELU_BOUND * (1 + 1e-6), "tanh-GELU strays beyond its error bound")


@st.composite
def swiglu_case(draw):
    d = draw(sizes(1, 12))
    d_ff = draw(sizes(1, 24))
    lead = draw(st.lists(sizes(1, 4), min_size=1, max_size=2))
    g = generator(draw(seeds()))
    w1 = torch.randn(d_ff, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    w2 = torch.randn(d, d_ff, generator=g, dtype=torch.float64) / math.sqrt(d_ff)
    w3 = torch.randn(d_ff, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    x = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    return x, w1, w2, w3


@prop("SwiGLU(x) = W2 (silu(W1 x) * W3 x): [..., d] -> [..., d_ff] -> [..., d]", needs=("swiglu",))
@given(case=swiglu_case())
def test_swiglu_formula(impl, case):
    x, w1, w2, w3 = case
    out = impl.swiglu(x, w1, w2, w3)
    assert out.shape == x.shape
    a, b = x @ w1.T, x @ w3.T
    ref = (a * torch.sigmoid(a) * b) @ w2.T
    scale = 1 + float(ref.abs().max())
    check(float((out - ref).abs().max()) / scale, 64 * (w1.shape[0] + w1.shape[1]) * U64, "SwiGLU differs from W2(silu(W1 x) * W3 x)")


@prop("SwiGLU has 3 d d_ff parameters; at d_ff = 8d/3 that is 8 d^2 = a 4d ReLU FFN", needs=("transformer_lm",))
@pytest.mark.parametrize("d_model", [48, 96])
def test_swiglu_parameter_count(impl, d_model):
    from tinylm.config import ModelConfig

    d_ff = 8 * d_model // 3
    cfg = ModelConfig(vocab_size=16, context_length=4, d_model=d_model, num_layers=1, num_heads=4, d_ff=d_ff)
    model = impl.transformer_lm(cfg, generator(0))
    ffn = model.layers[0].ffn
    count = sum(p.numel() for p in ffn.parameters())
    assert count == 3 * d_model * d_ff, f"SwiGLU of d={d_model}, d_ff={d_ff} has {count} parameters"
    assert 3 * d_model * d_ff == 8 * d_model**2 == 2 * d_model * (4 * d_model)
    check(abs(count - 8 * d_model**2), 0, "SwiGLU parameter count", kind="params")
