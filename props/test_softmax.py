"""Softmax, log-softmax, logsumexp and cross-entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import example, given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import dyadic_logits, finite_exponents, generator, seeds, sizes, wide_tensors
from props.tolerances import TINY, compute_roundoff, flush_floor, unit_roundoff

U32 = unit_roundoff(torch.float32)
U64 = unit_roundoff(torch.float64)

F32_MAX = float(torch.finfo(torch.float32).max)


@st.composite
def logit_rows(draw, max_rows: int = 4, max_cols: int = 12, max_exp: float = 3.0) -> torch.Tensor:
    """float32 logits (rows, cols): standard normal times 10^e, e in [-3, max_exp]."""
    rows, cols = draw(sizes(1, max_rows)), draw(sizes(1, max_cols))
    e = draw(st.floats(-3.0, max_exp))
    g = generator(draw(seeds()))
    return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 10.0**e).clamp(-F32_MAX, F32_MAX).float()


# -- 6. softmax -------------------------------------------------------------------------------------


@prop("softmax(z + c) == softmax(z) bitwise when z + c is exact (dyadic grid)", needs=("softmax",))
@given(z=dyadic_logits(), k=st.integers(-(2**14), 2**14))
def test_softmax_shift_exact(impl, z, k):
    c = k / 16.0  # on the grid 2^-4, |c| <= 2^10: z + c is exact in float32
    shifted = z + c
    assert torch.equal(shifted - c, z)  # the shift really is exact
    p, q = impl.softmax(z, -1), impl.softmax(shifted, -1)
    differing = int((p != q).sum())
    check(differing, 0, "softmax(z + c) differs bitwise from softmax(z) on an exact dyadic shift", kind="elements")


@prop("|softmax(z+c) - softmax(z)| <= p (e^{2 delta} - 1 + 2(n+4)u), delta = u(|c| + max|z|)", needs=("softmax",))
@given(z=logit_rows(max_exp=2.0), c=st.floats(-1e4, 1e4, allow_nan=False))
def test_softmax_shift_ulp(impl, z, c):
    n = z.shape[-1]
    c32 = torch.tensor(c, dtype=torch.float32)
    delta = U32 * (abs(float(c32)) + float(z.abs().max())) * 2
    spread = float(z.max() - z.min())
    rel = math.expm1(2 * delta + 2 * U32 * (spread + 2 * delta)) + 2 * (n + 4) * U32
    p, q = impl.softmax(z, -1).double(), impl.softmax(z + c32, -1).double()
    tol = rel * torch.maximum(p, q) + TINY
    ratio = float(((p - q).abs() / tol).max())
    check(ratio, 1.0, f"softmax shift by c={c} beyond the ulp-derived bound", kind="err/tol")


@prop("sum_i softmax(z)_i = 1 +- (n+4)u, finite for |z| up to float32 max", needs=("softmax",))
@given(z=logit_rows(max_exp=38.5))
@example(z=torch.tensor([[88.8, 0.0, -1.0], [-110.0, -110.0, -111.0], [1e4, -1e4, 0.0], [5.0, 5.0, 5.0]]))
@example(z=torch.tensor([[F32_MAX, -F32_MAX, 0.0], [F32_MAX, F32_MAX, F32_MAX], [-F32_MAX, -F32_MAX, 1.0]]))
def test_softmax_rows_sum_to_one(impl, z):
    p = impl.softmax(z, -1)
    assert bool(torch.isfinite(p).all()), f"softmax gave NaN/inf for logits up to {float(z.abs().max()):.3g}"
    assert bool((p >= 0).all())
    err = float((p.double().sum(-1) - 1).abs().max())
    check(err, (z.shape[-1] + 4) * U32, "softmax rows do not sum to 1")


@prop("softmax(z) = torch.softmax(z) to (n+8)u relative (float64)", needs=("softmax",))
@given(z=logit_rows(max_exp=2.0), dim=st.sampled_from([0, -1]))
def test_softmax_matches_torch(impl, z, dim):
    z = z.double()
    p, ref = impl.softmax(z, dim), torch.softmax(z, dim)
    n = z.shape[dim]
    err = float(((p - ref).abs() / (ref + TINY)).max())
    check(err, 2 * (n + 8) * U64 * (1 + float(z.abs().max())), "softmax differs from torch.softmax")


# -- 7. logsumexp and log-softmax -------------------------------------------------------------------


def _lse64(z: torch.Tensor) -> torch.Tensor:
    """Reference m + log sum exp(z - m) in float64."""
    z = z.double()
    m = z.amax(-1, keepdim=True)
    return (m + torch.log(torch.exp(z - m).sum(-1, keepdim=True))).squeeze(-1)


@prop("logsumexp(z) = m + log sum exp(z - m), finite where log sum exp(z) overflows", needs=("logsumexp",))
@given(z=logit_rows(max_exp=4.0))
@example(z=torch.tensor([[100.0, 99.0, 0.0], [-1000.0, -1001.0, -1000.5]]))
def test_logsumexp_identity(impl, z):
    out = impl.logsumexp(z, -1).double()
    ref = _lse64(z)
    n = z.shape[-1]
    tol = (4 * ref.abs() + (n + 4)) * U32
    err = float(((out - ref).abs() / tol).max())
    check(err, 1.0, "logsumexp differs from m + log sum exp(z - m)", kind="err/tol")


@prop("log_softmax(z) = z - logsumexp(z), finite where log(softmax(z)) = -inf", needs=("log_softmax",))
@given(z=logit_rows(max_exp=4.0))
@example(z=torch.tensor([[0.0, -200.0, -1e4], [1e4, 0.0, -1e4]]))
def test_log_softmax_stable(impl, z):
    out = impl.log_softmax(z, -1)
    assert bool(torch.isfinite(out).all()), "log_softmax gave -inf/NaN for finite logits"
    ref = z.double() - _lse64(z)[..., None]
    tol = (4 * (z.double().abs() + _lse64(z).abs()[..., None]) + z.shape[-1] + 4) * U32
    err = float(((out.double() - ref).abs() / tol).max())
    check(err, 1.0, "log_softmax differs from z - logsumexp(z)", kind="err/tol")


@prop("negative control: on the edge example naive log(softmax(z)) is -inf", needs=())
def test_log_softmax_pitfall_is_exercised():
    """The edge example above really is one where naive log(softmax) fails (so the property has teeth)."""
    z = torch.tensor([[0.0, -200.0, -1e4]])
    naive = torch.log(torch.softmax(z, -1))
    assert torch.isinf(naive).any()
    check(0.0 if torch.isinf(naive).any() else 1.0, 0.0, "naive log(softmax) stayed finite", kind="finite count")


# -- 8. cross-entropy -------------------------------------------------------------------------------


@st.composite
def ce_batches(draw, max_lead: int = 3, max_classes: int = 10):
    """float64 logits (..., C) with 1-2 leading dims, integer targets (...)."""
    lead = draw(st.lists(sizes(1, max_lead), min_size=1, max_size=2))
    C = draw(sizes(2, max_classes))
    g = generator(draw(seeds()))
    scale = 10.0 ** draw(st.floats(-1.0, 1.5))
    logits = torch.randn(*lead, C, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, C, tuple(lead), generator=g)
    return logits, targets


@prop("CE = mean(-z_c + logsumexp(z)) = F.cross_entropy (float64)", needs=("cross_entropy",))
@given(batch=ce_batches(), ls=st.sampled_from([0.0, 0.1, 0.3]))
def test_cross_entropy_value(impl, batch, ls):
    logits, targets = batch
    C = logits.shape[-1]
    loss = impl.cross_entropy(logits, targets, label_smoothing=ls) if ls else impl.cross_entropy(logits, targets)
    lse = _lse64(logits)
    nll = lse - logits.gather(-1, targets[..., None]).squeeze(-1)
    ref = ((1 - ls) * nll + ls * (lse - logits.mean(-1))).mean()
    torch_ref = TF.cross_entropy(logits.reshape(-1, C), targets.reshape(-1), label_smoothing=ls)
    tol = 16 * (C + 4) * U64 * (1 + float(lse.abs().max()) + float(logits.abs().max()))
    err = max(abs(float(loss) - float(ref)), abs(float(loss) - float(torch_ref)))
    check(err, tol, f"cross_entropy(label_smoothing={ls}) differs from -z_c + logsumexp(z)")


def _ce_grad_error(impl, logits, targets, ls: float, claim: str) -> float:
    """max |dCE/dz - claimed| for the claimed gradient: 'p-y' ((p - q)/N) or the wrong 'p' (p/N)."""
    z = logits.clone().requires_grad_(True)
    loss = impl.cross_entropy(z, targets, label_smoothing=ls) if ls else impl.cross_entropy(z, targets)
    (grad,) = torch.autograd.grad(loss, z)
    C = logits.shape[-1]
    N = targets.numel()
    p = torch.softmax(logits, -1)
    y = TF.one_hot(targets, C).to(logits.dtype)
    q = (1 - ls) * y + ls / C
    claimed = (p - q) / N if claim == "p-y" else p / N
    return float((grad - claimed).abs().max())


def _ce_grad_tol(logits) -> float:
    return 16 * (logits.shape[-1] + 4) * U64 / logits[..., 0].numel()


@prop("dCE/dz = (p - y)/N exactly (float64, few ulps)", needs=("cross_entropy",))
@given(batch=ce_batches())
def test_cross_entropy_gradient(impl, batch):
    logits, targets = batch
    check(_ce_grad_error(impl, logits, targets, 0.0, "p-y"), _ce_grad_tol(logits), "CE gradient is not (p - y)/N")


@prop("smoothing eps: dCE/dz = (p - q)/N, q = (1-eps) y + eps/C", needs=("cross_entropy",))
@given(batch=ce_batches(), ls=st.sampled_from([0.05, 0.1, 0.3, 1.0]))
def test_cross_entropy_gradient_smoothed(impl, batch, ls):
    logits, targets = batch
    err = _ce_grad_error(impl, logits, targets, ls, "p-y")
    check(err, _ce_grad_tol(logits), f"label-smoothed CE gradient is not (p - q)/N at eps={ls}")


@prop("negative control: the gradient check rejects the wrong claim dCE/dz = p/N", needs=("cross_entropy",))
@given(batch=ce_batches())
def test_cross_entropy_gradient_rejects_p(impl, batch):
    logits, targets = batch
    err = _ce_grad_error(impl, logits, targets, 0.0, "p")
    # the wrong claim misses -y/N at each target: an error of 1/N, far above the tolerance
    assert err > _ce_grad_tol(logits), "the CE gradient check failed to reject the wrong claim p/N"
    check(_ce_grad_tol(logits) / err, 1.0, "negative control", kind="tol/err")


# -- 9. the whole finite range ---------------------------------------------------------------------------
#
# The properties above draw most logits near N(0, 1) (up to 10^4 for the shift and log-softmax).
# Here every row carries its own magnitude, log-uniform over the dtype's whole normal range
# (props.strategies.wide_tensors), in float64, float32, bfloat16 and float16, and rows run up
# to 10^5 entries. The input is exact in its dtype; the reference is float64 on that input.
# u_d is the output dtype's unit roundoff (one final rounding), u_c the compute dtype's
# (float32 for bf16/fp16: every function here upcasts), t_d 8 times the compute dtype's
# smallest normal (a result below it may be flushed to zero) plus the spacing of the dtype's
# subnormals: props.tolerances.flush_floor.

ALL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _long(max_n: int) -> st.SearchStrategy[int]:
    """Row lengths log-uniform over [1025, max_n]: past one 1024-entry block, up to max_n."""
    return st.floats(math.log10(1025), math.log10(max_n)).map(lambda e: int(round(10.0**e)))


def _sum_bound(n: int, dtype: torch.dtype) -> float:
    """|sum_i p_i - 1| for n probabilities computed in u_c and rounded once each to the dtype:
    (n + 4) u_c (the computed row, Higham Thm 3.1) + u_d (1 + (n + 4) u_c) (the roundings) + n t_d."""
    u_c, u_d = compute_roundoff(dtype), unit_roundoff(dtype)
    return (n + 4) * u_c + u_d * (1 + (n + 4) * u_c) + n * flush_floor(dtype)


def _softmax_ratio(p: torch.Tensor, x: torch.Tensor) -> float:
    """max over the elements of |p - ref| / (u_d ref + 2(|x - max| + n + 8) u_c ref + t_d), ref in float64."""
    x64 = x.double()
    ref = torch.softmax(x64, -1)
    n, dtype = x.shape[-1], x.dtype
    spread = (x64 - x64.amax(-1, keepdim=True)).abs()
    tol = unit_roundoff(dtype) * ref + 2 * (spread + n + 8) * compute_roundoff(dtype) * ref + flush_floor(dtype)
    return float(((p.double() - ref).abs() / tol).max())


def _softmax_wide_checks(impl, x: torch.Tensor, what: str) -> None:
    p = impl.softmax(x, -1)
    assert p.dtype == x.dtype, f"softmax returned {p.dtype} for {x.dtype} logits"
    assert bool(torch.isfinite(p).all()), f"softmax gave NaN/inf for {x.dtype} logits up to {float(x.abs().max()):.3g}"
    assert bool(((p >= 0) & (p <= 1)).all()), "softmax left [0, 1]"
    err = float((p.double().sum(-1) - 1).abs().max())
    check(max(err / _sum_bound(x.shape[-1], x.dtype), _softmax_ratio(p, x)), 1.0,
          f"{what}: rows do not sum to 1 or differ from the float64 softmax ({x.dtype})", kind="err/tol")


@prop("softmax over the whole finite range (per-row magnitudes over the dtype's normal range, all dtypes): finite, "
      "sums to 1 within (n+4)u_c + u_d, equals float64 softmax within u_d p + 2(|x-max|+n+8)u_c p", needs=("softmax",))
@given(x=wide_tensors(dtypes=st.sampled_from(ALL_DTYPES), headroom=1.0))
def test_softmax_wide_range(impl, x):
    _softmax_wide_checks(impl, x, "softmax over the whole finite range")


@prop("softmax of rows of 1025 to 10^5 entries at any magnitude (f32/bf16/fp16): finite, "
      "sums to 1 within (n+4)u_c + u_d, equals float64 softmax element-wise", needs=("softmax",))
@settings(max_examples=6)
@given(x=wide_tensors(rows=sizes(1, 2), cols=_long(100_000),
                      dtypes=st.sampled_from(ALL_DTYPES[1:]), min_exp=-3.0, max_exp=30.0))
def test_softmax_long_rows(impl, x):
    _softmax_wide_checks(impl, x, "softmax over a long row")


@pytest.mark.slow
@prop("softmax of rows up to 2^22 entries at any magnitude, all dtypes (slow variant)", needs=("softmax",))
@settings(max_examples=8)
@given(x=wide_tensors(rows=sizes(1, 2), cols=_long(2**22),
                      dtypes=st.sampled_from(ALL_DTYPES), min_exp=-3.0, max_exp=30.0))
def test_softmax_long_rows_thorough(impl, x):
    _softmax_wide_checks(impl, x, "softmax over a very long row")


def _shift_rel(n: int, dtype: torch.dtype, delta: float, spread: float) -> float:
    """The shift bound's relative size: the shift moves each difference x_i - x_j by at most 2 delta
    (z + c rounded in the dtype), which exp turns into e^{2 delta} - 1; both rows are computed with
    error (|x - max| + 2 delta) 2u_c + (n + 4)u_c and rounded (u_d). Capped at 1: |p - q| <= max(p, q)."""
    u_c, u_d = compute_roundoff(dtype), unit_roundoff(dtype)
    arg = 2 * delta + 2 * u_c * (spread + 2 * delta)
    return min(1.0, math.expm1(min(arg, 1.0)) + 2 * (n + 4) * u_c + 2 * u_d)


@st.composite
def shifted_rows(draw, headroom: float = 4.0, rows=None, cols=None):
    """(z, c): logits over the whole finite range less a factor ``headroom`` (wide_tensors) and a
    shift c = +-10^e, e uniform over the same dtype's exponents, so that z + c stays finite."""
    z = draw(wide_tensors(rows=rows, cols=cols, dtypes=st.sampled_from(ALL_DTYPES), headroom=headroom))
    lo, hi = finite_exponents(z.dtype, headroom=headroom)
    return z, math.copysign(10.0 ** draw(st.floats(lo, hi)), draw(st.sampled_from([-1.0, 1.0])))


@prop("softmax(z + c) = softmax(z) over the whole finite range, all dtypes: within "
      "p (e^{2 delta} - 1 + 2(n+4)u_c + 2u_d), delta = 2u_d(|c| + max|z|)", needs=("softmax",))
@given(case=shifted_rows())
def test_softmax_shift_wide(impl, case):
    z, c = case
    shifted = z + torch.tensor(c, dtype=z.dtype)  # |z|, |c| <= max/4: finite
    assert bool(torch.isfinite(shifted).all())
    delta = 2 * unit_roundoff(z.dtype) * (abs(c) + float(z.double().abs().max()))
    spread = float((z.double().amax(-1) - z.double().amin(-1)).max())
    rel = _shift_rel(z.shape[-1], z.dtype, delta, spread)
    p, q = impl.softmax(z, -1), impl.softmax(shifted, -1)
    assert bool(torch.isfinite(p).all() and torch.isfinite(q).all()), f"softmax gave NaN/inf at shift c={c:.3g} ({z.dtype})"
    p, q = p.double(), q.double()
    tol = rel * torch.maximum(p, q) + 2 * flush_floor(z.dtype) + TINY
    check(float(((p - q).abs() / tol).max()), 1.0, f"softmax shift by c={c:.3g} beyond the ulp-derived bound ({z.dtype})",
          kind="err/tol")


@prop("log_softmax over the whole finite range, all dtypes: finite, within u_d|ref| + (4(|x| + |lse|) + n + 4)u_c",
      needs=("log_softmax",))
@given(x=wide_tensors(dtypes=st.sampled_from(ALL_DTYPES), headroom=4.0))
def test_log_softmax_wide_range(impl, x):
    out = impl.log_softmax(x, -1)
    assert out.dtype == x.dtype, f"log_softmax returned {out.dtype} for {x.dtype} logits"
    assert bool(torch.isfinite(out).all()), f"log_softmax gave NaN/inf for {x.dtype} logits up to {float(x.abs().max()):.3g}"
    x64 = x.double()
    ref = torch.log_softmax(x64, -1)
    # x - lse rounds lse = m + log sum exp(x - m) at the size of m: the bound of test_log_softmax_stable
    lse = torch.logsumexp(x64, -1, keepdim=True)
    size = 4 * (x64.abs() + lse.abs()) + x.shape[-1] + 4
    tol = unit_roundoff(x.dtype) * ref.abs() + compute_roundoff(x.dtype) * size
    check(float(((out.double() - ref).abs() / tol).max()), 1.0, f"log_softmax over the whole finite range ({x.dtype})",
          kind="err/tol")


@prop("cross_entropy over the whole finite range, all dtypes (|z| <= max/512: the smoothed loss sums C N terms of size 2|z|): finite, "
      "within u_d|ref| + 8(C+8)u_c(max|z| + 1) of F.cross_entropy in float64", needs=("cross_entropy",))
@given(z=wide_tensors(rows=sizes(1, 8), cols=sizes(2, 12), dtypes=st.sampled_from(ALL_DTYPES), headroom=512.0),
       seed=seeds(), ls=st.sampled_from([0.0, 0.1]))
def test_cross_entropy_wide_range(impl, z, seed, ls):
    t = torch.randint(0, z.shape[-1], z.shape[:-1], generator=generator(seed))
    loss = impl.cross_entropy(z, t, label_smoothing=ls) if ls else impl.cross_entropy(z, t)
    assert loss.dtype == z.dtype, f"cross_entropy returned {loss.dtype} for {z.dtype} logits"
    assert bool(torch.isfinite(loss)), f"cross_entropy is {float(loss)} for {z.dtype} logits up to {float(z.abs().max()):.3g}"
    z64 = z.double()
    ref = TF.cross_entropy(z64, t, label_smoothing=ls)
    tol = unit_roundoff(z.dtype) * ref.abs() + 8 * (z.shape[-1] + 8) * compute_roundoff(z.dtype) * (z64.abs().max() + 1)
    check(float((loss.double() - ref).abs() / tol), 1.0, f"cross_entropy(label_smoothing={ls}) over the whole finite range "
          f"({z.dtype})", kind="err/tol")


@prop("cross_entropy(z + c) = cross_entropy(z) over the whole finite range, all dtypes: within "
      "2 delta + u_d(|CE(z)| + |CE(z+c)|) + 8(C+8)u_c(2 max|z| + |c| + 2), delta = 2u_d(|c| + max|z|)",
      needs=("cross_entropy",))
@given(case=shifted_rows(headroom=1024.0, rows=sizes(1, 8), cols=sizes(2, 12)), seed=seeds())
def test_cross_entropy_shift_wide(impl, case, seed):
    z, c = case
    t = torch.randint(0, z.shape[-1], z.shape[:-1], generator=generator(seed))
    shifted = z + torch.tensor(c, dtype=z.dtype)  # |z|, |c| <= max/1024: the loss stays finite
    a, b = impl.cross_entropy(z, t), impl.cross_entropy(shifted, t)
    assert bool(torch.isfinite(a) and torch.isfinite(b)), f"cross_entropy is {float(a)}, {float(b)} at shift c={c:.3g} ({z.dtype})"
    # z + c rounded in the dtype moves each difference z_i - z_t by at most 2 delta; each loss carries
    # the bound of cross_entropy_precision, at the size of its own logits
    big = float(z.double().abs().max())
    delta = 2 * unit_roundoff(z.dtype) * (abs(c) + big)
    u_c, u_d = compute_roundoff(z.dtype), unit_roundoff(z.dtype)
    tol = (2 * delta + u_d * (abs(float(a)) + abs(float(b)))
           + 8 * (z.shape[-1] + 8) * u_c * (2 * big + abs(c) + 2) + flush_floor(z.dtype))
    check(abs(float(a) - float(b)) / tol, 1.0, f"cross_entropy shift by c={c:.3g} beyond the ulp-derived bound ({z.dtype})",
          kind="err/tol")
