"""Inverted dropout, RMSNorm, LayerNorm and BatchNorm."""

from __future__ import annotations


import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.stattests import ALPHA, binomial_test, mean_test, variance_test
from props.strategies import LOW_PRECISION, generator, seeds, sizes
from props.tolerances import unit_roundoff

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
