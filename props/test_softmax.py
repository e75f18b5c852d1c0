"""Softmax, log-softmax, logsumexp and cross-entropy."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as TF
from hypothesis import example, given
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import dyadic_logits, generator, seeds, sizes
from props.tolerances import TINY, unit_roundoff

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
