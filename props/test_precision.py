"""Every function at float64, float32, bfloat16 and float16, held to tolerances from that dtype's unit roundoff.

The input is drawn in float64 and rounded to the dtype under test, so it is exact in
that dtype; the reference is the same formula evaluated in float64 on that exact
input. The claim for each function and dtype d:

    |f_d(x) - f(x)| <= u_d |f(x)| + K u_c * size

u_d is d's unit roundoff (the one final rounding to the output dtype), u_c that of
the dtype the function computes in: d itself for float32 and float64, float32 for
bf16/fp16 where the function upcasts (softmax, log_softmax, logsumexp,
cross_entropy, RMSNorm), d for the element-wise silu and for attention's matmuls.
K and ``size`` come from the condition of the computation (softmax: the rounding of
x - max is amplified by exp, so K grows with |x - max|; a sum of n terms: n + 4).
A result computed internally in a lower precision than claimed misses these bounds
by orders of magnitude; the negative controls show that the same checks reject
such computations (float64 inputs computed in float32, float32 in bf16, half
precision without the float32 upcast).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff

U32 = unit_roundoff(torch.float32)
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
LOW = (torch.bfloat16, torch.float16)


def _u_compute(dtype: torch.dtype) -> float:
    """Unit roundoff of the compute dtype of an upcasting function: float32 for bf16/fp16."""
    return U32 if dtype in LOW else unit_roundoff(dtype)


def _floor(dtype: torch.dtype) -> float:
    """Absolute floor: the spacing of subnormals of ``dtype`` (where relative error stops meaning anything)."""
    return float(torch.finfo(dtype).tiny) * unit_roundoff(dtype) * 2


@st.composite
def rows_in(draw, dtype, max_rows: int = 6, max_cols: int = 16, max_exp: float = 1.0):
    """(x in ``dtype``, exact float64 copy): N(0,1) 10^e, e in [-1, max_exp], rounded to ``dtype``."""
    rows, cols = draw(sizes(1, max_rows)), draw(sizes(1, max_cols))
    e = draw(st.floats(-1.0, max_exp))
    x = (torch.randn(rows, cols, generator=generator(draw(seeds())), dtype=torch.float64) * 10.0**e).to(dtype)
    return x, x.double()


def _ratio(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() / tol).max())


def softmax_tol(x64: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, u_c: float) -> torch.Tensor:
    """u_d p + 2 (|x - max| + n + 8) u_c p + floor, per element."""
    n = x64.shape[-1]
    y = (x64 - x64.amax(-1, keepdim=True)).abs()
    return unit_roundoff(dtype) * ref + 2 * (y + n + 8) * u_c * ref + _floor(dtype)


@prop("softmax at f64/f32/bf16/fp16: err <= u_d p + 2(|x - max| + n + 8) u_c p (u_c: float32 for half)", needs=("softmax",))
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_softmax_precision(impl, dtype, data):
    x, x64 = data.draw(rows_in(dtype))
    out, ref = impl.softmax(x, -1), torch.softmax(x64, -1)
    assert out.dtype == dtype, f"softmax returned {out.dtype} for {dtype}"
    check(_ratio(out, ref, softmax_tol(x64, ref, dtype, _u_compute(dtype))), 1.0, f"softmax in {dtype}", kind="err/tol")


def _softmax_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax computed op by op in ``dtype`` (each op rounded to it), returned in x's dtype."""
    y = x.to(dtype)
    z = torch.exp(y - y.amax(-1, keepdim=True))
    return (z / z.sum(-1, keepdim=True)).to(x.dtype)


@prop("negative control: the softmax precision check rejects f64 computed in f32, f32 in bf16, half without upcast", needs=())
@given(dtype=st.sampled_from(DTYPES), seed=seeds())
def test_softmax_precision_rejects_wrong_precision(dtype, seed):
    lower = {torch.float64: torch.float32, torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}[dtype]
    x = (torch.randn(32, 16, generator=generator(seed), dtype=torch.float64) * 3).to(dtype)
    x64 = x.double()
    ref = torch.softmax(x64, -1)
    ratio = _ratio(_softmax_in(x, lower), ref, softmax_tol(x64, ref, dtype, _u_compute(dtype)))
    check(1.0 / ratio, 1.0, "negative control", kind="tol/err")
    assert ratio > 1.0, f"a softmax computed in {lower} passed the {dtype} bound"


@prop("log_softmax at all dtypes: err <= u_d |ref| + 4(n+8) u_c (|x - max| + |lse - max| + 1)", needs=("log_softmax",))
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_log_softmax_precision(impl, dtype, data):
    x, x64 = data.draw(rows_in(dtype))
    out, ref = impl.log_softmax(x, -1), torch.log_softmax(x64, -1)
    assert out.dtype == dtype
    m = x64.amax(-1, keepdim=True)
    size = (x64 - m).abs() + (torch.logsumexp(x64, -1, keepdim=True) - m).abs() + 1
    tol = unit_roundoff(dtype) * ref.abs() + 4 * (x64.shape[-1] + 8) * _u_compute(dtype) * size
    check(_ratio(out, ref, tol), 1.0, f"log_softmax in {dtype}", kind="err/tol")


@prop("logsumexp at all dtypes: err <= u_d |ref| + 4(n+8) u_c (|max| + 1), O(1) and large logits", needs=("logsumexp",))
@given(dtype=st.sampled_from(DTYPES), data=st.data(), max_exp=st.sampled_from([0.5, 3.0]))
def test_logsumexp_precision(impl, dtype, data, max_exp):
    # at O(1) logits the rounding of log(sum) in the dtype itself (u_d |log n|) exceeds the bound: it must be float32
    x, x64 = data.draw(rows_in(dtype, max_rows=32, max_exp=max_exp))
    out, ref = impl.logsumexp(x, -1), torch.logsumexp(x64, -1)
    assert out.dtype == dtype
    tol = unit_roundoff(dtype) * ref.abs() + 4 * (x64.shape[-1] + 8) * _u_compute(dtype) * (x64.amax(-1).abs() + 1)
    check(_ratio(out, ref, tol), 1.0, f"logsumexp in {dtype}", kind="err/tol")


@prop("cross_entropy at all dtypes: err <= u_d |ref| + 8(C+8) u_c (max|z| + 1)", needs=("cross_entropy",))
@given(dtype=st.sampled_from(DTYPES), data=st.data(), ls=st.sampled_from([0.0, 0.1]))
def test_cross_entropy_precision(impl, dtype, data, ls):
    z, z64 = data.draw(rows_in(dtype))
    t = torch.randint(0, z.shape[-1], z.shape[:-1], generator=generator(data.draw(seeds())))
    out = impl.cross_entropy(z, t, label_smoothing=ls)
    ref = torch.nn.functional.cross_entropy(z64, t, label_smoothing=ls)
    assert out.dtype == dtype, f"cross_entropy returned {out.dtype} for {dtype} logits"
    tol = unit_roundoff(dtype) * ref.abs() + 8 * (z.shape[-1] + 8) * _u_compute(dtype) * (z64.abs().max() + 1)
    check(_ratio(out, ref, tol), 1.0, f"cross_entropy in {dtype}", kind="err/tol")


@prop("silu at all dtypes (element-wise in the dtype): err <= 3 u_d |x s(x)| + floor", needs=("silu",))
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_silu_precision(impl, dtype, data):
    x, x64 = data.draw(rows_in(dtype))
    out = impl.silu(x)
    ref = x64 * torch.sigmoid(x64)
    assert out.dtype == dtype
    tol = 3 * unit_roundoff(dtype) * ref.abs() + _floor(dtype)
    check(_ratio(out, ref, tol), 1.0, f"silu in {dtype}", kind="err/tol")


def rmsnorm_tol(ref: torch.Tensor, dtype: torch.dtype, d: int) -> torch.Tensor:
    """u_d |ref| + 4 (d + 8) u_c |ref| + floor: one final rounding after a float32 (or float64) computation."""
    return (unit_roundoff(dtype) + 4 * (d + 8) * _u_compute(dtype)) * ref.abs() + _floor(dtype)


def _rms64(x64: torch.Tensor, w64: torch.Tensor, eps: float) -> torch.Tensor:
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


@prop("RMSNorm at all dtypes with a random gain: err <= (u_d + 4(d+8) u_c)|ref| (float32 compute for half)", needs=("rmsnorm",))
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_rmsnorm_precision(impl, dtype, data):
    x, x64 = data.draw(rows_in(dtype, max_rows=32))
    d = x.shape[-1]
    w = (1 + 0.5 * torch.randn(d, generator=generator(data.draw(seeds())), dtype=torch.float64)).to(dtype)
    out = impl.rmsnorm(x, w, 1e-5)
    assert out.dtype == dtype
    ref = _rms64(x64, w.double(), 1e-5)
    check(_ratio(out, ref, rmsnorm_tol(ref, dtype, d)), 1.0, f"RMSNorm in {dtype}", kind="err/tol")


@prop("negative control: the RMSNorm precision check rejects a half-precision computation without the float32 upcast", needs=())
@given(dtype=st.sampled_from(LOW), seed=seeds())
def test_rmsnorm_precision_rejects_no_upcast(dtype, seed):
    g = generator(seed)
    x = torch.randn(64, 32, generator=g, dtype=torch.float64).to(dtype)
    w = (1 + 0.5 * torch.randn(32, generator=g, dtype=torch.float64)).to(dtype)
    naive = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # every op rounded to the half dtype
    ref = _rms64(x.double(), w.double(), 1e-5)
    ratio = _ratio(naive, ref, rmsnorm_tol(ref, dtype, 32))
    check(1.0 / ratio, 1.0, "negative control", kind="tol/err")
    assert ratio > 1.0, f"an RMSNorm computed in {dtype} passed the float32-compute bound"


@prop("attention at all dtypes: err <= u_d|ref| + (2(s+1) u_d + (T+8) u_c') P|V|, s = max |q||k|/sqrt(d_k)", needs=("scaled_dot_product_attention",))
@given(dtype=st.sampled_from(DTYPES), seed=seeds(), T=sizes(1, 8), dk=sizes(1, 8), causal=st.booleans())
def test_attention_precision(impl, dtype, seed, T, dk, causal):
    g = generator(seed)
    Q, K, V = (torch.randn(2, T, dk, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    out = impl.scaled_dot_product_attention(Q, K, V, mask)
    assert out.dtype == dtype
    Q64, K64, V64 = Q.double(), K.double(), V.double()
    S = Q64 @ K64.transpose(-2, -1) / math.sqrt(dk)
    if mask is not None:
        S = S.masked_fill(~mask, float("-inf"))
    P = torch.softmax(S, -1)
    ref = P @ V64
    s = float((Q64.norm(dim=-1).amax() * K64.norm(dim=-1).amax()) / math.sqrt(dk))
    u_d, u_acc = unit_roundoff(dtype), _u_compute(dtype)
    spread = 2 * (2 * s + T + 8)  # scores rounded to u_d |s|, amplified by exp, over a row spread <= 2 s
    tol = u_d * ref.abs() + (spread * u_d + (T + 8) * u_acc) * (P @ V64.abs()) + _floor(dtype)
    check(_ratio(out, ref, tol), 1.0, f"attention in {dtype}", kind="err/tol")
