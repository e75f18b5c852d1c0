"""Scaled dot-product attention, multi-head attention and RoPE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.stattests import ALPHA, variance_test
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff

U32 = unit_roundoff(torch.float32)
U64 = unit_roundoff(torch.float64)


@st.composite
def qkv(draw, max_lead: int = 2, max_t: int = 8, max_d: int = 16, dtype=torch.float64):
    """(Q, K, V, mask): random leading dims, mask with at least one True per query row."""
    lead = tuple(draw(st.lists(sizes(1, 3), min_size=0, max_size=max_lead)))
    tq, tk, d, dv = draw(sizes(1, max_t)), draw(sizes(1, max_t)), draw(sizes(1, max_d)), draw(sizes(1, 6))
    g = generator(draw(seeds()))
    Q = torch.randn(*lead, tq, d, generator=g, dtype=dtype)
    K = torch.randn(*lead, tk, d, generator=g, dtype=dtype)
    V = torch.randn(*lead, tk, dv, generator=g, dtype=dtype)
    mask = torch.rand(*lead, tq, tk, generator=g) < 0.6
    mask[..., 0] = True
    return Q, K, V, mask


def _weights(impl, Q, K, mask=None):
    """The attention matrix, read out through V = I (out = P I = P)."""
    tk = K.shape[-2]
    V = torch.eye(tk, dtype=Q.dtype).expand(*K.shape[:-2], tk, tk)
    return impl.scaled_dot_product_attention(Q, K, V, mask)


@prop("attention rows sum to 1; masked keys get weight exactly 0", needs=("scaled_dot_product_attention",))
@given(case=qkv())
def test_attention_rows_and_mask(impl, case):
    Q, K, _, mask = case
    P = _weights(impl, Q, K, mask)
    assert int((P[~mask] != 0).sum()) == 0, "a masked key got non-zero weight"
    err = float((P.sum(-1) - 1).abs().max())
    check(err, (K.shape[-2] + 8) * U64, "attention rows do not sum to 1")


@prop("SDPA(Q, K, V, mask) = torch's scaled_dot_product_attention (float64)", needs=("scaled_dot_product_attention",))
@given(case=qkv())
def test_attention_matches_torch(impl, case):
    Q, K, V, mask = case
    out = impl.scaled_dot_product_attention(Q, K, V, mask)
    ref = TF.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    scale = 1 + float(V.abs().max())
    err = float((out - ref).abs().max()) / scale
    check(err, 16 * (Q.shape[-1] + K.shape[-2] + 8) * U64 * (1 + float(Q.abs().max() * K.abs().max())), "attention differs from torch")


def _score_differences(impl, d: int, n: int, seed: int) -> torch.Tensor:
    """n draws of s0 - s1 = q.(k0 - k1)/sqrt(d), read as log(w0/w1) from two-key attention."""
    g = generator(seed)
    Q = torch.randn(n, 1, d, generator=g, dtype=torch.float64)
    K = torch.randn(n, 2, d, generator=g, dtype=torch.float64)
    w = _weights(impl, Q, K)[:, 0, :]  # (n, 2)
    return torch.log(w[:, 0]) - torch.log(w[:, 1])


def _score_diff_moments(d: int, scale2: float) -> tuple[float, float]:
    """(Var, E x^4) of q.(k0-k1) * sqrt(scale2): q.u with u ~ N(0, 2I) has E x^2 = 2d, E x^4 = 4(3d^2 + 6d)."""
    return 2 * d * scale2, 4 * (3 * d * d + 6 * d) * scale2**2


@prop("unit-variance q, k: scores q.k/sqrt(d_k) have variance 1 (differences: 2)", needs=("scaled_dot_product_attention",), alpha=ALPHA)
@settings(max_examples=4)
@given(d=st.sampled_from([4, 16, 64]), seed=seeds())
def test_attention_score_variance(impl, d, seed):
    diffs = _score_differences(impl, d, 20_000, seed)
    var, mu4 = _score_diff_moments(d, 1.0 / d)
    res = variance_test(diffs, var, mu4, claim="Var(s0 - s1) = 2").record()
    assert not res.rejected, str(res)


@prop("negative control: score variance d_k (no 1/sqrt(d_k) scale) is rejected", needs=("scaled_dot_product_attention",), alpha=ALPHA)
@settings(max_examples=2)
@given(d=st.sampled_from([4, 16]), seed=seeds())
def test_attention_score_variance_rejects_unscaled(impl, d, seed):
    diffs = _score_differences(impl, d, 20_000, seed)
    var, mu4 = _score_diff_moments(d, 1.0)
    res = variance_test(diffs, var, mu4, claim="Var(s0 - s1) = 2 d_k")
    check(res.threshold / res.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert res.rejected, str(res)


@prop("MHA(x) = W_O concat_h softmax(causal(Q_h K_h^T/sqrt(d_k))) V_h = torch SDPA per head", needs=("multihead_self_attention",))
@given(seed=seeds(), heads=st.integers(1, 4), dk=st.sampled_from([2, 4, 6]), T=sizes(1, 7), lead=sizes(1, 3))
def test_multihead_attention_matches_reference(impl, seed, heads, dk, T, lead):
    d = heads * dk
    g = generator(seed)
    ws = [torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(4)]
    x = torch.randn(lead, T, d, generator=g, dtype=torch.float64)
    out = impl.multihead_self_attention(x, *ws, heads)

    def split(t):  # (B, T, H*dk) -> (B, H, T, dk): heads stacked along the projection's rows
        return t.view(lead, T, heads, dk).transpose(1, 2)

    q, k, v = (split(x @ w.T) for w in ws[:3])
    o = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = o.transpose(1, 2).reshape(lead, T, d) @ ws[3].T
    err = float((out - ref).abs().max()) / (1 + float(ref.abs().max()))
    check(err, 64 * (d + T + 8) * U64, "multi-head attention differs from the per-head reference")


# -- 17. RoPE ----------------------------------------------------------------------------------------

ROPE_TOL = 8 * U32  # tables may be stored in float32: a rotation by cos, sin each within u of exact


@st.composite
def rope_case(draw):
    dk = 2 * draw(st.integers(1, 8))
    T = draw(sizes(1, 8))
    g = generator(draw(seeds()))
    theta = draw(st.sampled_from([100.0, 10000.0, 500000.0]))
    x = torch.randn(2, T, dk, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 2048, (T,), generator=g)
    return x, theta, pos


def _rope_ref(x: torch.Tensor, theta: float, pos: torch.Tensor) -> torch.Tensor:
    dk = x.shape[-1]
    k = torch.arange(dk // 2, dtype=torch.float64)
    ang = pos.double()[:, None] * theta ** (-2 * k / dk)  # (T, dk/2): i theta^(-2k/d_k)
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


@prop("RoPE rotates pairs (x_2k, x_2k+1) by i theta^(-2k/d_k); norms preserved", needs=("rope",))
@given(case=rope_case())
def test_rope_formula_and_norm(impl, case):
    x, theta, pos = case
    out = impl.rope(x, theta, pos)
    ref = _rope_ref(x, theta, pos)
    a, b = x[..., 0::2], x[..., 1::2]
    pair = torch.stack((a.abs() + b.abs(),) * 2, -1).flatten(-2)
    formula = float(((out - ref).abs() / (ROPE_TOL * pair + 1e-300)).max())
    norm = float(((out.norm(dim=-1) - x.norm(dim=-1)).abs() / (ROPE_TOL * x.norm(dim=-1))).max())
    check(max(formula, norm), 1.0, "RoPE differs from the rotation by i theta^(-2k/d_k)", kind="err/tol")


@prop("RoPE: <R_i q, R_j k> depends on i - j only", needs=("rope",))
@given(case=rope_case(), shift=st.integers(-1000, 1000))
def test_rope_relative_position(impl, case, shift):
    x, theta, pos = case
    pos2 = pos + shift
    if int(pos2.min()) < 0:
        pos2 = pos2 - int(pos2.min())
    q, k = x[0], x[1]
    dots = impl.rope(q, theta, pos) @ impl.rope(k, theta, pos).T  # (T, T): i, j
    dots2 = impl.rope(q, theta, pos2) @ impl.rope(k, theta, pos2).T
    scale = q.norm(dim=-1)[:, None] * k.norm(dim=-1)[None, :]
    ratio = float(((dots - dots2).abs() / (4 * ROPE_TOL * scale + 1e-300)).max())
    check(ratio, 1.0, "RoPE q.k changed under a common shift of positions", kind="err/tol")
