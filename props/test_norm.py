"""Inverted dropout, RMSNorm, LayerNorm and BatchNorm."""

from __future__ import annotations


import math

import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.stattests import ALPHA, binomial_test, mean_test, variance_test
from props.strategies import LOW_PRECISION, finite_exponents, generator, seeds, sizes, wide_tensors
from props.tolerances import compute_roundoff, flush_floor, unit_roundoff

U64 = unit_roundoff(torch.float64)
N_DROP = 200_000

# -- 11. inverted dropout -----------------------------------------------------------------------------


def _drop(impl, c: float, p: float, seed: int) -> torch.Tensor:
    x = torch.full((N_DROP,), c, dtype=torch.float64)
    return impl.dropout(x, p, True, generator(seed))


@prop("dropout: y in {0, x/(1-p)}; #zeros ~ Binomial(n, p) (binomtest); E[y] = x", needs=("dropout",), alpha=ALPHA)
@settings(max_examples=6)
@given(c=st.sampled_from([1.0, -2.5, 0.1]), p=st.sampled_from([0.1, 0.3, 0.7]), seed=seeds())
def test_dropout_moments(impl, c, p, seed):
    y = _drop(impl, c, p, seed)
    kept = y != 0
    scaled = c / (1 - p)
    off = float((y[kept] - scaled).abs().max()) if bool(kept.any()) else 0.0
    assert off <= 4 * U64 * abs(scaled), "kept values are not x/(1-p)"
    count = binomial_test(int((~kept).sum()), N_DROP, p, alpha=ALPHA / 3, claim="P(drop) = p")
    mean = mean_test(y, c, p / (1 - p) * c * c, alpha=ALPHA / 3, claim="E[y] = x")
    # y - x is -x w.p. p and x p/(1-p) w.p. 1-p: mean 0, variance p/(1-p) x^2, known fourth moment
    mu4 = p * c**4 + (1 - p) * (c * p / (1 - p)) ** 4
    var = variance_test(y - c, p / (1 - p) * c * c, mu4, alpha=ALPHA / 3, claim="Var(y) = p/(1-p) x^2")
    worst = max((count, mean, var), key=lambda r: r.statistic / r.threshold)
    worst.record()
    assert not (count.rejected or mean.rejected or var.rejected), f"{count}; {mean}; {var}"


@prop("negative control: E[y] = (1-p) x (no rescale) and P(drop) = 1-p are rejected", needs=("dropout",), alpha=ALPHA)
@settings(max_examples=3)
@given(p=st.sampled_from([0.1, 0.3]), seed=seeds())
def test_dropout_rejects_wrong_claims(impl, p, seed):
    y = _drop(impl, 1.0, p, seed)
    no_rescale = mean_test(y, 1.0 - p, p / (1 - p), claim="E[y] = (1-p) x")
    swapped = binomial_test(int((y == 0).sum()), N_DROP, 1 - p, claim="P(drop) = 1 - p")
    check(max(no_rescale.threshold / no_rescale.statistic, swapped.threshold / swapped.statistic), 1.0, "negative control", kind="crit/stat")
    assert no_rescale.rejected and swapped.rejected


@prop("dropout is the identity in eval mode and at p = 0", needs=("dropout",))
@given(seed=seeds(), p=st.sampled_from([0.0, 0.2, 0.9]))
def test_dropout_eval_identity(impl, seed, p):
    x = torch.randn(7, 5, generator=generator(seed))
    assert torch.equal(impl.dropout(x, p, False, generator(seed)), x)
    assert torch.equal(impl.dropout(x, 0.0, True, generator(seed)), x)
    check(0.0, 0.0, "eval identity", kind="exact")


# -- 12. RMSNorm --------------------------------------------------------------------------------------


@st.composite
def rms_inputs(draw, max_d: int = 32):
    """(x (rows, d) float64 with per-row scales over 10^[-4, 4], gain (d,), eps)."""
    rows, d = draw(sizes(1, 6)), draw(sizes(1, max_d))
    g = generator(draw(seeds()))
    row_scale = 10.0 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * 8 - 4)
    x = torch.randn(rows, d, generator=g, dtype=torch.float64) * row_scale
    gain = 1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    eps = draw(st.sampled_from([1e-5, 1e-6, 1e-3]))
    return x, gain, eps


def _rms_ref(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


@prop("RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g over the last dim (float64)", needs=("rmsnorm",))
@given(case=rms_inputs())
def test_rmsnorm_formula(impl, case):
    x, gain, eps = case
    out, ref = impl.rmsnorm(x, gain, eps), _rms_ref(x, gain, eps)
    assert out.dtype == x.dtype and out.shape == x.shape
    err = float(((out - ref).abs() / (ref.abs() + 1e-300)).max())
    check(err, 4 * (x.shape[-1] + 8) * U64, "RMSNorm differs from x/sqrt(mean(x^2)+eps) g", kind="rel error")


@prop("RMSNorm(a x) = RMSNorm(x) within |N(x)| eps |1 - a^-2| / mean(x^2) (exact as eps -> 0)", needs=("rmsnorm",))
@given(case=rms_inputs(), log_a=st.floats(-3.0, 3.0))
def test_rmsnorm_scale_invariance(impl, case, log_a):
    x, gain, eps = case
    a = 10.0**log_a
    # N(a x) = f N(x) with f^2 = (m + eps)/(m + eps/a^2), so |f - 1| <= |f^2 - 1| <= eps |1 - a^-2| / m
    y, ya = impl.rmsnorm(x, gain, eps), impl.rmsnorm(a * x, gain, eps)
    m = x.pow(2).mean(-1, keepdim=True)
    bound = y.abs() * (eps * abs(1 - a**-2) / m + 8 * (x.shape[-1] + 8) * U64)
    ratio = float(((ya - y).abs() / (bound + 1e-300)).max())
    check(ratio, 1.0, f"RMSNorm scale invariance at a={a:.3g} beyond the eps bound", kind="err/bound")
    y0, y0a = impl.rmsnorm(x, gain, 0.0), impl.rmsnorm(a * x, gain, 0.0)
    assert float(((y0a - y0).abs() / (y0.abs() + 1e-300)).max()) <= 8 * (x.shape[-1] + 8) * U64, "eps=0: not exactly scale invariant"


@prop("output RMS = sqrt(m/(m+eps)): |RMS - 1| <= eps/(2m) + (d+8)u when mean(x^2) = m >> eps", needs=("rmsnorm",))
@given(case=rms_inputs(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_rmsnorm_unit_rms(impl, case, dtype):
    x, _, eps = case
    x = x.to(dtype)
    m = x.double().pow(2).mean(-1)
    keep = m > 1e3 * eps
    if not bool(keep.any()):
        return
    y = impl.rmsnorm(x, torch.ones(x.shape[-1], dtype=dtype), eps).double()
    rms = y.pow(2).mean(-1).sqrt()
    tol = eps / (2 * m) + 4 * (x.shape[-1] + 8) * unit_roundoff(dtype)
    ratio = float(((rms - 1).abs() / tol)[keep].max())
    check(ratio, 1.0, "RMSNorm output RMS is not 1", kind="err/tol")


@prop("fp16/bf16 inputs whose squares overflow: RMSNorm finite and within 2u of float64 (float32 compute)", needs=("rmsnorm",))
@given(dtype=st.sampled_from(LOW_PRECISION), seed=seeds(), d=sizes(2, 64))
@example(dtype=torch.float16, seed=0, d=8)
def test_rmsnorm_low_precision_no_overflow(impl, dtype, seed, d):
    # squares overflow fp16 above 256 and bf16 (float32's range) above 1.8e19: 6e4 (near fp16's max) and 1e18
    # keep mean(x^2) inside float32, so a float32 computation is finite and a half-precision one is not
    big = 6e4 if dtype == torch.float16 else 1e18
    x = (torch.rand(4, d, generator=generator(seed), dtype=torch.float64) * 2 - 1) * big
    x = x.to(dtype)
    y = impl.rmsnorm(x, torch.ones(d, dtype=dtype), 1e-5)
    assert y.dtype == dtype, f"RMSNorm returned {y.dtype} for {dtype} input"
    assert bool(torch.isfinite(y).all()), f"RMSNorm overflowed on {dtype} inputs of magnitude {big:g}"
    ref = _rms_ref(x.double(), torch.ones(d, dtype=torch.float64), 1e-5)
    u = unit_roundoff(dtype)
    ratio = float(((y.double() - ref).abs() / (2 * u * ref.abs() + 1e-3)).max())
    check(ratio, 1.0, f"RMSNorm in {dtype} differs from the float64 reference", kind="err/tol")


@prop("RMSNorm acts on the last dim only: changing another token changes nothing", needs=("rmsnorm",))
@given(seed=seeds(), T=sizes(2, 6), d=sizes(1, 16))
def test_rmsnorm_last_dim_only(impl, seed, T, d):
    g = generator(seed)
    x = torch.randn(2, T, d, generator=g)
    x2 = x.clone()
    x2[:, 0] = torch.randn(2, d, generator=g) * 100
    gain = torch.ones(d)
    y, y2 = impl.rmsnorm(x, gain, 1e-5), impl.rmsnorm(x2, gain, 1e-5)
    changed = int((y[:, 1:] != y2[:, 1:]).sum())
    check(changed, 0, "RMSNorm output of one token depends on another token", kind="elements")


# -- 13. LayerNorm and BatchNorm (torch's modules: the facts the model's design rests on) -------------


@prop("LayerNorm: per-token mean 0, variance v/(v+eps) over the last axis only", needs=())
@given(seed=seeds(), T=sizes(2, 6), d=sizes(2, 32), scale=st.floats(0.01, 100.0))
def test_layernorm_facts(seed, T, d, scale):
    g = generator(seed)
    x = torch.randn(T, d, generator=g, dtype=torch.float64) * scale + 3.0
    ln = torch.nn.LayerNorm(d, eps=1e-5, elementwise_affine=False, dtype=torch.float64)
    y = ln(x)
    v = x.var(-1, unbiased=False)
    mean_err = float(y.mean(-1).abs().max())
    var_err = float((y.var(-1, unbiased=False) - v / (v + 1e-5)).abs().max())
    x2 = x.clone()
    x2[0] += 7.0
    assert torch.equal(ln(x2)[1:], y[1:]), "LayerNorm mixed tokens"
    # the centred values x - mean lose log2(mean(x^2) / v) bits to cancellation: scale the ulp bound by it
    cancel = float((x.pow(2).mean(-1) / (v + 1e-5)).max())
    check(max(mean_err, var_err), 64 * (d + 8) * U64 * (1 + cancel), "LayerNorm per-token moments")


@prop("BatchNorm: batch stats in train, running stats in eval, running <- (1-m) running + m batch", needs=())
@given(seed=seeds(), n=sizes(2, 16), c=sizes(1, 8), momentum=st.sampled_from([0.1, 0.5]))
def test_batchnorm_facts(seed, n, c, momentum):
    g = generator(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * 2 + 1
    bn = torch.nn.BatchNorm1d(c, eps=1e-5, momentum=momentum, affine=False, dtype=torch.float64)
    y = bn(x)  # train mode
    mu, var_b = x.mean(0), x.var(0, unbiased=False)
    err_train = float((y - (x - mu) / torch.sqrt(var_b + 1e-5)).abs().max())
    err_rm = float((bn.running_mean - momentum * mu).abs().max())  # from running_mean = 0
    err_rv = float((bn.running_var - ((1 - momentum) * 1.0 + momentum * x.var(0, unbiased=True))).abs().max())
    bn.eval()
    y_eval = bn(x)
    err_eval = float((y_eval - (x - bn.running_mean) / torch.sqrt(bn.running_var + 1e-5)).abs().max())
    check(max(err_train, err_rm, err_rv, err_eval), 64 * (n + 8) * U64 * 10, "BatchNorm statistics")


# -- 13b. LayerNorm of the implementation under test --------------------------------------------------
#
# LN(x) = (x - m) / s * g + b with m = mean(x), s = sqrt(v + eps), v = mean((x - m)^2) (population).
# Rounding: the centred values x - m carry an error of about (d + 2) u max|x| (the mean's error),
# which the division by s magnifies to (d + 2) u max|x| / s: the ulp bounds below scale with
# r = max|x| / s per row, the bits lost to cancellation when the mean is large against the spread.
# Each property has a negative control: a specific wrong LayerNorm below that the same check rejects.


@st.composite
def ln_inputs(draw, min_d: int = 2, max_d: int = 32):
    """(x (rows, d) float64: spread 10^[-3, 3] per row around an offset up to 10^2 spreads,
    gain (d,), bias (d,), eps)."""
    rows, d = draw(sizes(1, 6)), draw(sizes(min_d, max_d))
    g = generator(draw(seeds()))
    spread = 10.0 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * 6 - 3)
    offset = torch.randn(rows, 1, generator=g, dtype=torch.float64) * spread * 10.0 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * 2)
    x = torch.randn(rows, d, generator=g, dtype=torch.float64) * spread + offset
    gain = 1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    bias = torch.randn(d, generator=g, dtype=torch.float64)
    eps = draw(st.sampled_from([1e-5, 1e-6, 1e-3]))
    return x, gain, bias, eps


def _ln_ref(x: torch.Tensor, gain, bias, eps: float) -> torch.Tensor:
    c = x - x.mean(-1, keepdim=True)
    y = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    return y * gain + bias if gain is not None else y


def _spread(x: torch.Tensor, eps: float) -> torch.Tensor:
    """s = sqrt(v + eps) per row, (rows, 1)."""
    return torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)


def _ulp_bound(x: torch.Tensor, eps: float, gain, bias) -> torch.Tensor:
    """16 (d + 8) u (r max|g| + max|b| + 1) per row, r = max|x| / s (see the section comment)."""
    d = x.shape[-1]
    r = x.abs().amax(-1, keepdim=True) / _spread(x, eps)
    g = float(gain.abs().max()) if gain is not None else 1.0
    b = float(bias.abs().max()) if bias is not None else 0.0
    return 16 * (d + 8) * U64 * (r * g + b + 1)


# Wrong LayerNorms the checks must reject, each a mistake met in practice.
def _ln_unbiased(x, gain, bias, eps):
    """torch.var's default: the unbiased variance (divides by d - 1)."""
    c = x - x.mean(-1, keepdim=True)
    return c / torch.sqrt(c.var(-1, keepdim=True) + eps) * gain + bias


def _ln_no_centering(x, gain, bias, eps):
    """No mean removal: RMSNorm with a bias."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain + bias


def _ln_no_sqrt(x, gain, bias, eps):
    """Divides by the variance instead of its square root."""
    c = x - x.mean(-1, keepdim=True)
    return c / (c.pow(2).mean(-1, keepdim=True) + eps) * gain + bias


def _ln_formula_ratio(fn, case) -> float:
    x, gain, bias, eps = case
    out = fn(x, gain, bias, eps)
    assert out.dtype == x.dtype and out.shape == x.shape, f"LayerNorm returned {out.dtype} {tuple(out.shape)}"
    return float(((out - _ln_ref(x, gain, bias, eps)).abs() / _ulp_bound(x, eps, gain, bias)).max())


@prop("LayerNorm(x) = (x - mean) / sqrt(var + eps) * g + b over the last dim, population variance (float64)", needs=("layer_norm",))
@given(case=ln_inputs())
def test_layer_norm_formula(impl, case):
    check(_ln_formula_ratio(impl.layer_norm, case), 1.0, "LayerNorm differs from (x - mean)/sqrt(var + eps) g + b", kind="err/bound")


@prop("LayerNorm without bias (bias=None) is (x - mean) / sqrt(var + eps) * g", needs=("layer_norm",))
@given(case=ln_inputs())
def test_layer_norm_without_bias(impl, case):
    x, gain, _, eps = case
    out = impl.layer_norm(x, gain, None, eps)
    ratio = float(((out - _ln_ref(x, gain, 0.0, eps)).abs() / _ulp_bound(x, eps, gain, None)).max())
    check(ratio, 1.0, "LayerNorm with bias=None differs from (x - mean)/sqrt(var + eps) g", kind="err/bound")


@prop("negative control: the formula check rejects the unbiased variance (divides by d - 1)", needs=())
@given(case=ln_inputs())
def test_layer_norm_formula_rejects_unbiased_variance(case):
    x, gain, bias, eps = case
    keep = x.var(-1, unbiased=False) > 1e3 * eps  # where eps swamps the variance both are ~ the bias
    assume(bool(keep.any()))
    ratio = _ln_formula_ratio(_ln_unbiased, (x[keep], gain, bias, eps))
    check(1.0 / ratio, 1.0, "negative control", kind="bound/err")
    assert ratio > 1.0


def _ln_shift_ratio(fn, case, shift: torch.Tensor) -> float:
    x, gain, bias, eps = case
    y, ys = fn(x, gain, bias, eps), fn(x + shift, gain, bias, eps)
    bound = _ulp_bound(x, eps, gain, bias) + _ulp_bound(x + shift, eps, gain, bias)
    return float(((ys - y).abs() / bound).max())


def _shifts(x: torch.Tensor, seed: int, eps: float) -> torch.Tensor:
    """One shift per row, of 1 to 10^3 spreads, either sign."""
    g = generator(seed)
    size = 10.0 ** (torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64) * 3)
    sign = torch.where(torch.rand(x.shape[0], 1, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return sign * size * _spread(x, eps)


@prop("LayerNorm(x + c 1) = LayerNorm(x) for any shift c (within the ulps of the larger input)", needs=("layer_norm",))
@given(case=ln_inputs(), seed=seeds())
def test_layer_norm_shift_invariance(impl, case, seed):
    ratio = _ln_shift_ratio(impl.layer_norm, case, _shifts(case[0], seed, case[3]))
    check(ratio, 1.0, "LayerNorm changes when a constant is added to its input", kind="err/bound")


@prop("negative control: the shift check rejects a LayerNorm without mean removal (RMSNorm with a bias)", needs=())
@given(case=ln_inputs(), seed=seeds())
def test_layer_norm_shift_rejects_no_centering(case, seed):
    ratio = _ln_shift_ratio(_ln_no_centering, case, _shifts(case[0], seed, case[3]))
    check(1.0 / ratio, 1.0, "negative control", kind="bound/err")
    assert ratio > 1.0


def _ln_scale_ratio(fn, case, a: float) -> float:
    """LN(a x) = f LN_0(x) g + b with f^2 = (v + eps)/(v + eps/a^2), so |LN(a x) - LN(x)| <=
    |LN(x) - b| eps |1 - a^-2| / v (exact as eps -> 0), plus the ulp bounds of both."""
    x, gain, bias, eps = case
    y, ya = fn(x, gain, bias, eps), fn(a * x, gain, bias, eps)
    v = x.var(-1, unbiased=False, keepdim=True)
    bound = (_ln_ref(x, gain, 0.0, eps).abs() * eps * abs(1 - a**-2) / v
             + _ulp_bound(x, eps, gain, bias) + _ulp_bound(a * x, eps, gain, bias))
    return float(((ya - y).abs() / bound).max())


@prop("LayerNorm(a x) = LayerNorm(x) for a > 0 within |N(x) g| eps |1 - a^-2| / var(x) (exact as eps -> 0)", needs=("layer_norm",))
@given(case=ln_inputs(), log_a=st.floats(-3.0, 3.0))
def test_layer_norm_scale_invariance(impl, case, log_a):
    check(_ln_scale_ratio(impl.layer_norm, case, 10.0**log_a), 1.0, "LayerNorm is not invariant to a positive scale", kind="err/bound")


@prop("negative control: the scale check rejects a LayerNorm that divides by the variance, not its square root", needs=())
@given(case=ln_inputs(), log_a=st.one_of(st.floats(-3.0, -0.5), st.floats(0.5, 3.0)))
def test_layer_norm_scale_rejects_no_sqrt(case, log_a):
    x, gain, bias, eps = case
    a = 10.0**log_a
    # keep the rows where eps swamps neither variance (of x and of a x): the bound's eps term stays small there
    keep = x.var(-1, unbiased=False) * min(1.0, a * a) > 1e3 * eps
    assume(bool(keep.any()))
    ratio = _ln_scale_ratio(_ln_no_sqrt, (x[keep], gain, bias, eps), a)
    check(1.0 / ratio, 1.0, "negative control", kind="bound/err")
    assert ratio > 1.0


def _ln_moment_ratio(fn, case) -> float:
    """Unscaled (g = 1, b = 0): per row |mean(y)| and |mean(y^2) - v/(v + eps)| against d u r^2 bounds."""
    x, _, _, eps = case
    d = x.shape[-1]
    y = fn(x, torch.ones(d, dtype=x.dtype), torch.zeros(d, dtype=x.dtype), eps)
    v = x.var(-1, unbiased=False)
    r = (x.abs().amax(-1) / torch.sqrt(v + eps))
    tol = 16 * (d + 8) * U64 * (1 + r) ** 2
    mean_ratio = y.mean(-1).abs() / tol
    ms_ratio = (y.pow(2).mean(-1) - v / (v + eps)).abs() / tol
    return float(torch.maximum(mean_ratio, ms_ratio).max())


@prop("LayerNorm before the affine: per row mean 0 and mean square v/(v + eps) (= 1 as eps -> 0)", needs=("layer_norm",))
@given(case=ln_inputs())
def test_layer_norm_output_moments(impl, case):
    check(_ln_moment_ratio(impl.layer_norm, case), 1.0, "LayerNorm output moments are not mean 0, mean square v/(v+eps)", kind="err/bound")


@prop("negative control: the moment check rejects the unbiased variance (mean square (d-1)/d)", needs=())
@given(case=ln_inputs())
def test_layer_norm_moments_reject_unbiased_variance(case):
    x, gain, bias, eps = case
    keep = x.var(-1, unbiased=False) > 1e3 * eps  # where eps swamps the variance both give mean square ~0
    assume(bool(keep.any()))
    ratio = _ln_moment_ratio(_ln_unbiased, (x[keep], gain, bias, eps))
    check(1.0 / ratio, 1.0, "negative control", kind="bound/err")
    assert ratio > 1.0


def _ln_jacobian_ratios(fn, x: torch.Tensor, eps: float) -> tuple[float, float]:
    """For the unscaled LayerNorm N at the vector x (d,): (error of its autograd Jacobian against
    (P - y y^T / d) / s with P = I - 1 1^T / d, y = N(x), s = sqrt(v + eps); and, at eps = 0,
    the largest of |J 1|, |J x_c| and the distance of s J's singular values from an orthogonal
    projection's: d - 2 ones and two zeros), each over its ulp bound."""
    from torch.autograd.functional import jacobian

    d = x.shape[-1]
    ones, zeros = torch.ones(d, dtype=x.dtype), torch.zeros(d, dtype=x.dtype)
    N = lambda v: fn(v, ones, zeros, eps)  # noqa: E731
    J = jacobian(N, x)  # (d, d)
    s = float(_spread(x, eps))
    y = _ln_ref(x, None, None, eps)
    P = torch.eye(d, dtype=x.dtype) - 1.0 / d
    want = (P - torch.outer(y, y) / d) / s
    r = float(x.abs().max()) / s
    tol = 16 * (d + 8) * U64 * (1 + r) ** 2 / s
    formula = float((J - want).abs().max()) / tol
    if eps:
        return formula, 0.0
    null = max(float((J @ ones).abs().max()), float((J @ (x - x.mean())).abs().max()) / float((x - x.mean()).abs().max()))
    sv = torch.linalg.svdvals(s * J)
    proj = torch.cat([torch.ones(d - 2, dtype=x.dtype), torch.zeros(2, dtype=x.dtype)])
    structure = max(null / tol, float((sv - proj).abs().max()) / (s * tol))
    return formula, structure


@st.composite
def jacobian_points(draw):
    d = draw(sizes(3, 16))
    g = generator(draw(seeds()))
    x = torch.randn(d, generator=g, dtype=torch.float64) * 10.0 ** draw(st.floats(-2, 2)) + draw(st.floats(-5, 5))
    return x, draw(st.sampled_from([0.0, 1e-5, 0.1]))


@prop("LayerNorm Jacobian = (P - y y^T/d)/s, symmetric; at eps = 0 s J is a rank d-2 projection with nullspace {1, x}", needs=("layer_norm",))
@given(point=jacobian_points())
def test_layer_norm_jacobian(impl, point):
    x, eps = point
    formula, structure = _ln_jacobian_ratios(impl.layer_norm, x, eps)
    check(max(formula, structure), 1.0, "LayerNorm's Jacobian is not (P - y y^T/d)/s of rank d-2", kind="err/bound")


@prop("negative control: the Jacobian check rejects a LayerNorm without mean removal (rank d-1, J 1 != 0)", needs=())
@given(point=jacobian_points())
def test_layer_norm_jacobian_rejects_no_centering(point):
    x, _ = point
    formula, structure = _ln_jacobian_ratios(lambda v, g, b, e: _ln_no_centering(v, g, b, e), x, 0.0)
    check(1.0 / max(formula, structure), 1.0, "negative control", kind="bound/err")
    assert formula > 1.0 and structure > 1.0


# -- the whole finite range ---------------------------------------------------------------------------
#
# The properties above hold RMSNorm and LayerNorm in float64 at scales 10^-4..10^4 (float16 and
# bfloat16 only at one large magnitude). Here every row carries its own magnitude, drawn over
# the dtype's normal range (props.strategies.wide_tensors), in float64, float32, bfloat16 and
# float16, against the formula in float64 on the exact input. Both norms compute in at least
# float32 (u_c: float32 for bf16/fp16), so the range ends where mean(x^2) overflows the compute
# dtype: magnitudes up to 10^18 in float32 and bfloat16 (an RMSNorm of bf16 inputs near 10^19
# and above overflows whatever else it does right), 10^150 in float64; float16 ends at its own
# largest value. At the small end eps takes over: N(x) -> x / sqrt(eps), which the float64
# reference also computes.

ALL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _norm_max_exp(dtype: torch.dtype, headroom: float) -> float:
    """The largest decimal exponent drawn: below the dtype's max / headroom and below
    sqrt(max of the compute dtype) / 10, so that mean(x^2) cannot overflow the computation."""
    compute_max = torch.finfo(torch.promote_types(dtype, torch.float32)).max
    return min(finite_exponents(dtype, headroom)[1], math.log10(compute_max) / 2 - 1)


@st.composite
def wide_norm_rows(draw, max_d: int = 32):
    """(x (rows, d) with per-row magnitudes over the dtype's usable range, gain (d,), eps), x and gain in one dtype."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    x = draw(wide_tensors(rows=sizes(1, 8), cols=sizes(1, max_d), dtypes=st.just(dtype),
                          max_exp=_norm_max_exp(dtype, 8.0)))
    g = generator(draw(seeds()))
    gain = (1 + 0.5 * torch.randn(x.shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    return x, gain, draw(st.sampled_from([1e-5, 1e-6]))


def _rms_wide_ratio(out: torch.Tensor, x: torch.Tensor, gain: torch.Tensor, eps: float) -> float:
    """max |out - ref| / ((u_d + 4(d + 8)u_c)|ref| + t_d): one rounding to the dtype after a u_c computation."""
    ref = _rms_ref(x.double(), gain.double(), eps)
    d, dtype = x.shape[-1], x.dtype
    tol = (unit_roundoff(dtype) + 4 * (d + 8) * compute_roundoff(dtype)) * ref.abs() + flush_floor(dtype)
    return float(((out.double() - ref).abs() / tol).max())


@prop("RMSNorm at magnitudes from the dtype's smallest normal to 10^18 (f32/bf16), 10^150 (f64), fp16's max, "
      "all dtypes: finite, within (u_d + 4(d+8)u_c)|ref| of x / sqrt(mean(x^2) + eps) g in float64", needs=("rmsnorm",))
@given(case=wide_norm_rows())
def test_rmsnorm_wide_range(impl, case):
    x, gain, eps = case
    out = impl.rmsnorm(x, gain, eps)
    assert out.dtype == x.dtype and out.shape == x.shape, f"RMSNorm returned {out.dtype} {tuple(out.shape)} for {x.dtype}"
    assert bool(torch.isfinite(out).all()), f"RMSNorm gave NaN/inf for {x.dtype} inputs up to {float(x.abs().max()):.3g}"
    check(_rms_wide_ratio(out, x, gain, eps), 1.0, f"RMSNorm over the whole range ({x.dtype}, eps={eps})", kind="err/tol")


@prop("RMSNorm(2^k x) = RMSNorm(x) for power-of-two scalings over 10^-6..10^6 (exact inputs), all dtypes: "
      "within |N(x)| eps|1 - a^-2| / mean(x^2) + both rounding bounds", needs=("rmsnorm",))
@given(case=wide_norm_rows(), k=st.integers(-20, 20))
def test_rmsnorm_scale_invariance_wide(impl, case, k):
    x, gain, eps = case
    a = 2.0**k
    xa = (x.double() * a).to(x.dtype)
    # a power of two scales exactly unless the result leaves the dtype's normal range: keep such rows out
    info = torch.finfo(x.dtype)
    mags = x.double().abs()
    exact = ((mags == 0) | ((mags * a >= info.tiny) & (mags >= info.tiny))).all(-1) & (mags.amax(-1) * a <= 10.0 ** _norm_max_exp(x.dtype, 8.0))
    assume(bool(exact.any()))
    x, xa = x[exact], xa[exact]
    assert torch.equal(xa.double(), x.double() * a)
    y, ya = impl.rmsnorm(x, gain, eps), impl.rmsnorm(xa, gain, eps)
    assert bool(torch.isfinite(y).all() and torch.isfinite(ya).all()), f"RMSNorm gave NaN/inf at scale 2^{k} ({x.dtype})"
    ref = _rms_ref(x.double(), gain.double(), eps)
    m = x.double().pow(2).mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # x^2 underflows below 1e-154
    d, dtype = x.shape[-1], x.dtype
    rounding = (unit_roundoff(dtype) + 4 * (d + 8) * compute_roundoff(dtype)) * ref.abs() + flush_floor(dtype)
    bound = ref.abs() * eps * abs(1 - a**-2) / m + 2.5 * rounding
    check(float(((ya.double() - y.double()).abs() / bound).max()), 1.0,
          f"RMSNorm scale invariance at a=2^{k} beyond the eps bound ({dtype})", kind="err/bound")


@st.composite
def wide_ln_rows(draw, max_d: int = 32):
    """(x (rows, d), gain (d,), bias (d,), eps) in one dtype: row i = offset_i + spread_i N(0, 1) with
    spread_i = 10^e_i over the dtype's usable range and |offset_i| = 10^o_i spreads, o_i in [0, 3]."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    rows, d = draw(sizes(1, 8)), draw(sizes(2, max_d))
    lo, _ = finite_exponents(dtype)
    hi = _norm_max_exp(dtype, 8.0)
    g = generator(draw(seeds()))
    o = torch.tensor(draw(st.lists(st.floats(0.0, 3.0), min_size=rows, max_size=rows)), dtype=torch.float64)[:, None]
    top = hi - o - 0.8  # room for the offset and for 6 spreads
    e = lo + (top - lo) * torch.tensor(draw(st.lists(st.floats(0.0, 1.0), min_size=rows, max_size=rows)),
                                       dtype=torch.float64)[:, None]
    sign = torch.where(torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    spread = 10.0**e
    x = (sign * spread * 10.0**o + spread * torch.randn(rows, d, generator=g, dtype=torch.float64)).to(dtype)
    gain = (1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype)
    bias = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    return x, gain, bias, draw(st.sampled_from([1e-5, 1e-6]))


@prop("LayerNorm at spreads over the dtype's range and offsets up to 10^3 spreads, all dtypes: finite, within "
      "u_d|ref| + 16(d+8)u_c(r|g| + |b| + 1), r = max|x| / sqrt(var + eps), of the float64 formula", needs=("layer_norm",))
@given(case=wide_ln_rows())
def test_layer_norm_wide_range(impl, case):
    x, gain, bias, eps = case
    out = impl.layer_norm(x, gain, bias, eps)
    assert out.dtype == x.dtype and out.shape == x.shape, f"LayerNorm returned {out.dtype} {tuple(out.shape)} for {x.dtype}"
    assert bool(torch.isfinite(out).all()), f"LayerNorm gave NaN/inf for {x.dtype} inputs up to {float(x.abs().max()):.3g}"
    x64, g64, b64 = x.double(), gain.double(), bias.double()
    ref = _ln_ref(x64, g64, b64, eps)
    d, u_c = x.shape[-1], compute_roundoff(x.dtype)
    r = x64.abs().amax(-1, keepdim=True) / _spread(x64, eps)
    tol = (unit_roundoff(x.dtype) * ref.abs() + 16 * (d + 8) * u_c * (r * float(g64.abs().max()) + float(b64.abs().max()) + 1)
           + flush_floor(x.dtype))
    check(float(((out.double() - ref).abs() / tol).max()), 1.0, f"LayerNorm over the whole range ({x.dtype}, eps={eps})",
          kind="err/bound")
