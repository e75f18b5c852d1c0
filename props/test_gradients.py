"""Vector-Jacobian products of every function with a hand-written backward, against independent derivations.

softmax, log_softmax, logsumexp and cross_entropy carry their own backward passes in
tinylm. Each is checked here with a random upstream gradient g (not ones: with g = 1
the softmax VJP is 0 whatever the code does) and a random logit scale, along every
axis (not only the last), on tensors of rank 1 to 4 with masked (-inf) entries,
against the closed form in float64:

    softmax:      dx = p * (g - <g, p>)           log_softmax:  dx = g - p * sum(g)
    logsumexp:    dx = g * p                      cross_entropy: dz = g (p - q) / N

where p = softmax(x) along the axis. The closed form is evaluated from torch's own
softmax (an independent forward). Tolerances are relative to the size of the
terms: the forward p carries relative error <= (|x - max| + n + 8) u (the rounding
of x - max is amplified by exp), the sums <= (n + 4) u (Higham Thm 3.1); the bound
is twice that. Finite differences (``torch.autograd.gradcheck``, float64) confirm
the closed forms themselves on small cases.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import example, given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, seeds, sizes, wide_tensors
from props.tolerances import TINY, flush_floor, unit_roundoff

U64 = unit_roundoff(torch.float64)


@st.composite
def axis_cases(draw, max_rank: int = 4, max_side: int = 6, masked: bool = True):
    """(x float64 of rank 1-4, dim in [-rank, rank), upstream-gradient seed): x = N(0,1) 10^e with some -inf entries.

    At least one entry of every slice along ``dim`` stays finite, so no softmax row is fully masked.
    """
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(sizes(1, max_side)) for _ in range(rank))
    dim = draw(st.integers(-rank, rank - 1))
    g = generator(draw(seeds()))
    scale = 10.0 ** draw(st.floats(-2.0, 1.5))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if masked and draw(st.booleans()):
        drop = torch.rand(shape, generator=g) < 0.3
        keep_one = torch.zeros(shape, dtype=torch.bool).index_fill_(dim % rank, torch.tensor([0]), True)
        x = x.masked_fill(drop & ~keep_one, float("-inf"))
    return x, dim, draw(seeds())


def _vjp(fn, x: torch.Tensor, g_seed: int, scale: float = 1.0):
    """(dx, g): the VJP of fn at x for a random upstream g ~ N(0, scale^2) of fn(x)'s shape."""
    xx = x.clone().requires_grad_(True)
    y = fn(xx)
    g = torch.randn(y.shape, generator=generator(g_seed), dtype=y.dtype) * scale
    (dx,) = torch.autograd.grad(y, xx, grad_outputs=g)
    return dx, g


def _rel(x: torch.Tensor, dim: int, u: float = U64) -> float:
    """2 (max|x - max| + n + 8) u: the relative accuracy of p = softmax(x) and of the sums below."""
    n = x.shape[dim]
    fin = torch.isfinite(x)
    spread = float((x.amax(dim, keepdim=True) - x).masked_fill(~fin, 0).max()) if bool(fin.any()) else 0.0
    return 2 * (spread + n + 8) * u


def _ratio(err: torch.Tensor, size: torch.Tensor, rel: float) -> float:
    return float((err / (rel * size + TINY)).max())


@prop("softmax VJP: dx = p (g - <g, p>) along any dim, random g and scale (float64)", needs=("softmax",))
@given(case=axis_cases(), gscale=st.floats(0.01, 100.0))
def test_softmax_vjp(impl, case, gscale):
    x, dim, gs = case
    dx, g = _vjp(lambda v: impl.softmax(v, dim), x, gs, gscale)
    p = torch.softmax(x, dim)
    s = (g * p).sum(dim, keepdim=True)
    want = p * (g - s)
    size = p * (g.abs() + (g.abs() * p).sum(dim, keepdim=True))
    check(_ratio((dx - want).abs(), size, _rel(x, dim)), 1.0, f"softmax VJP along dim={dim}", kind="err/tol")


@prop("log_softmax VJP: dx = g - p sum(g) along any dim, random g and scale (float64)", needs=("log_softmax",))
@given(case=axis_cases(), gscale=st.floats(0.01, 100.0))
def test_log_softmax_vjp(impl, case, gscale):
    x, dim, gs = case
    dx, g = _vjp(lambda v: impl.log_softmax(v, dim), x, gs, gscale)
    p = torch.softmax(x, dim)
    total = g.sum(dim, keepdim=True)
    want = g - p * total
    size = g.abs() + p * g.abs().sum(dim, keepdim=True)
    check(_ratio((dx - want).abs(), size, _rel(x, dim)), 1.0, f"log_softmax VJP along dim={dim}", kind="err/tol")


@prop("logsumexp VJP: dx = g p along any dim, random g and scale (float64)", needs=("logsumexp",))
@given(case=axis_cases(), gscale=st.floats(0.01, 100.0))
def test_logsumexp_vjp(impl, case, gscale):
    x, dim, gs = case
    dx, g = _vjp(lambda v: impl.logsumexp(v, dim), x, gs, gscale)
    p = torch.softmax(x, dim)
    want = g.unsqueeze(dim) * p
    size = g.abs().unsqueeze(dim) * p
    check(_ratio((dx - want).abs(), size, _rel(x, dim)), 1.0, f"logsumexp VJP along dim={dim}", kind="err/tol")


@prop("negative control: the softmax VJP check rejects the upstream-of-ones shortcut dx = p (g - 1)", needs=("softmax",))
@given(case=axis_cases(masked=False))
def test_softmax_vjp_rejects_ones_shortcut(impl, case):
    """A backward that assumes <g, p> = 1 (true only for g = 1) differs by p (1 - <g, p>): far above the bound."""
    x, dim, gs = case
    dx, g = _vjp(lambda v: impl.softmax(v, dim), x, gs)
    p = torch.softmax(x, dim)
    wrong = p * (g - 1.0)
    size = p * (g.abs() + (g.abs() * p).sum(dim, keepdim=True))
    err = (dx - wrong).abs()
    gap = p * ((g * p).sum(dim, keepdim=True) - 1).abs()
    usable = gap > 1e3 * _rel(x, dim) * size  # where the two claims differ by far more than the tolerance
    if not bool(usable.any()):
        return
    ratio = _ratio(err[usable], size[usable], _rel(x, dim))
    check(1.0 / ratio, 1.0, "negative control", kind="tol/err")
    assert ratio > 1.0


@st.composite
def ce_cases(draw):
    """float64 logits (..., C) with 1-3 leading dims, targets, smoothing and an upstream scalar."""
    lead = tuple(draw(st.lists(sizes(1, 4), min_size=1, max_size=3)))
    C = draw(sizes(2, 12))
    g = generator(draw(seeds()))
    logits = torch.randn(*lead, C, generator=g, dtype=torch.float64) * 10.0 ** draw(st.floats(-1.0, 1.5))
    targets = torch.randint(0, C, lead, generator=g)
    ls = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    up = draw(st.floats(0.01, 100.0)) * draw(st.sampled_from([-1.0, 1.0]))
    return logits, targets, ls, up


@prop("cross_entropy VJP: dz = g (p - q)/N for a random upstream scalar g and any smoothing (float64)", needs=("cross_entropy",))
@given(case=ce_cases())
def test_cross_entropy_vjp(impl, case):
    logits, targets, ls, up = case
    z = logits.clone().requires_grad_(True)
    loss = impl.cross_entropy(z, targets, label_smoothing=ls)
    (dz,) = torch.autograd.grad(loss, z, grad_outputs=torch.tensor(up, dtype=loss.dtype))
    C, N = logits.shape[-1], targets.numel()
    q = (1 - ls) * TF.one_hot(targets, C).to(logits.dtype) + ls / C
    p = torch.softmax(logits, -1)
    want = up * (p - q) / N
    size = abs(up) * (p + q) / N
    check(_ratio((dz - want).abs(), size, _rel(logits, -1)), 1.0, f"CE VJP at upstream {up:.3g}, eps={ls}", kind="err/tol")


@prop("finite differences (gradcheck, float64) agree with the backward of all four, on any dim", needs=("softmax", "log_softmax", "logsumexp", "cross_entropy"))
@settings(max_examples=10)
@given(case=axis_cases(max_rank=3, max_side=4, masked=False))
def test_gradcheck_all(impl, case):
    x, dim, gs = case
    x = x / (1 + float(x.abs().max()))  # O(1) logits: the finite-difference step 1e-6 resolves them
    fns = {
        "softmax": lambda v: impl.softmax(v, dim),
        "log_softmax": lambda v: impl.log_softmax(v, dim),
        "logsumexp": lambda v: impl.logsumexp(v, dim),
    }
    for name, fn in fns.items():
        assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(True),), eps=1e-6, atol=1e-7, rtol=1e-5), name
    flat = x.reshape(-1, x.shape[-1])
    t = torch.randint(0, flat.shape[-1], flat.shape[:-1], generator=generator(gs))
    ce = lambda v: impl.cross_entropy(v, t, label_smoothing=0.1)  # noqa: E731
    assert torch.autograd.gradcheck(ce, (flat.clone().requires_grad_(True),), eps=1e-6, atol=1e-7, rtol=1e-5)
    check(0.0, 0.0, "gradcheck", kind="passes")


@prop("fully masked row: logsumexp = -inf, softmax/logsumexp of the other rows unchanged bitwise", needs=("logsumexp", "softmax"))
@given(seed=seeds(), rows=sizes(2, 5), n=sizes(1, 8), dim=st.sampled_from([0, 1, -1, -2]))
def test_fully_masked_row(impl, seed, rows, n, dim):
    x = torch.randn(rows, n, generator=generator(seed), dtype=torch.float64) * 5
    if dim % 2 == 0:
        x = x.T.contiguous()  # reduce along axis 0: the rows are x's columns
    other = 1 - dim % 2  # the axis that indexes the rows
    masked = x.clone().index_fill_(other, torch.tensor([0]), float("-inf"))
    lse, lse_ref = impl.logsumexp(masked, dim), impl.logsumexp(x, dim)  # (rows,)
    assert bool(torch.isneginf(lse[0])), f"logsumexp of a fully masked row is {float(lse[0])}, not -inf"
    assert torch.equal(lse[1:], lse_ref[1:]), "a masked row changed another row's logsumexp"
    p, p_ref = impl.softmax(masked, dim), impl.softmax(x, dim)
    rest = torch.arange(1, rows)
    assert torch.equal(p.index_select(other, rest), p_ref.index_select(other, rest)), "a masked row changed another row's softmax"
    check(0.0, 0.0, "fully masked row", kind="exact")


# -- the whole finite range -------------------------------------------------------------------------------
#
# The VJPs above draw logits up to 10^1.5. Here each row of a float32 or float64 tensor carries its
# own magnitude, log-uniform over the dtype's whole normal range (props.strategies.wide_tensors),
# and the four VJPs are held to the same closed forms in float64 on that exact input, with the
# bound's u that of the dtype the implementation computes in. Where |x - max| u >= 1 the bound
# says nothing about the size; the gradient must still be finite.


def _vjp_want(name: str, x64: torch.Tensor, g64: torch.Tensor, targets: torch.Tensor | None):
    """(closed-form VJP, size of its terms) in float64 for the upstream g64, along the last dim."""
    p = torch.softmax(x64, -1)
    if name == "softmax":
        return p * (g64 - (g64 * p).sum(-1, keepdim=True)), p * (g64.abs() + (g64.abs() * p).sum(-1, keepdim=True))
    if name == "log_softmax":
        return g64 - p * g64.sum(-1, keepdim=True), g64.abs() + p * g64.abs().sum(-1, keepdim=True)
    if name == "logsumexp":
        return g64.unsqueeze(-1) * p, g64.abs().unsqueeze(-1) * p
    y = TF.one_hot(targets, x64.shape[-1]).to(x64.dtype)
    N = targets.numel()
    return g64 * (p - y) / N, g64.abs() * (p + y) / N


@prop("softmax/log_softmax/logsumexp/cross_entropy VJPs over the whole finite range (f32, f64): finite "
      "and within 2(|x - max| + n + 8)u (+ e^{4u max|x|} - 1 where lse enters) of the closed forms", needs=())
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp", "cross_entropy"])
@given(x=wide_tensors(dtypes=st.sampled_from([torch.float32, torch.float64]), headroom=8.0), seed=seeds())
@example(x=torch.tensor([[1e4, 10001.0], [-4.25e37, -4.25e37]]), seed=0)  # a large common offset; ties at 10^37
def test_vjp_wide_range(impl, name, x, seed):
    if not impl.has(name):
        pytest.skip(f"implementation {impl.name!r} provides no {name}")
    g = generator(seed)
    targets = torch.randint(0, x.shape[-1], x.shape[:-1], generator=g) if name == "cross_entropy" else None
    fn = {
        "softmax": lambda v: impl.softmax(v, -1),
        "log_softmax": lambda v: impl.log_softmax(v, -1),
        "logsumexp": lambda v: impl.logsumexp(v, -1),
        "cross_entropy": lambda v: impl.cross_entropy(v, targets),
    }[name]
    xx = x.clone().requires_grad_(True)
    y = fn(xx)
    up = torch.randn(y.shape, generator=g, dtype=torch.float64).to(x.dtype)
    (dx,) = torch.autograd.grad(y, xx, grad_outputs=up)
    assert bool(torch.isfinite(dx).all()), f"{name}'s gradient is NaN/inf for {x.dtype} logits up to {float(x.abs().max()):.3g}"
    want, size = _vjp_want(name, x.double(), up.double(), targets)
    u = unit_roundoff(x.dtype)
    rel = _rel(x.double(), -1, u)
    if name != "softmax":
        # the backward may form p = exp(x - lse) from the forward's lse, rounded at the size of max|x|:
        # x - lse then carries 2u(|x| + |lse|) <= 4u max|x| + 2u log n, which exp turns into a relative error
        big = float(x.double().abs().max()) + math.log(x.shape[-1])
        rel += math.expm1(min(1.0, 4 * u * big))
    err = (dx.double() - want).abs() / (rel * size + flush_floor(x.dtype) + TINY)
    check(float(err.max()), 1.0, f"{name} VJP over the whole finite range ({x.dtype})", kind="err/tol")
