"""Variance through Linear layers and the init schemes.

Statistical checks: false-alarm probability ALPHA = 1e-6 each (Bonferroni-split where
one property makes several), thresholds from the claim's own second and fourth
moments (scipy's truncnorm for truncated normals), never from the sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sst

from props.record import check, prop
from props.stattests import ALPHA, mean_test, normal_fourth_moment, truncnorm_moments, variance_test
from props.strategies import generator, seeds
from tinylm.config import ModelConfig

N_TRUNC = 300_000  # 3e5 draws: the 2.7% truncation correction at k=3 sits at 11.1 standard errors


def _sum_moments(d: int, vx: float, vw: float, mu4w: float) -> tuple[float, float]:
    """(E[y^2], E[y^4]) of y = sum_{k<d} x_k w_k, x_k ~ N(0, vx), w_k i.i.d. zero-mean with E w^2 = vw, E w^4 = mu4w."""
    m2 = vx * vw
    m4 = 3 * vx**2 * mu4w
    return d * m2, d * m4 + 3 * d * (d - 1) * m2**2


def _diag_samples(impl, d_in: int, n: int, vx: float, w_std: float, g: torch.Generator, chunk: int = 256):
    """n independent draws of y = x . w (w ~ N(0, w_std^2)): the diagonal of linear(X, W) for X, W (chunk, d_in) per chunk."""
    out = []
    for _ in range(math.ceil(n / chunk)):
        X = torch.randn(chunk, d_in, generator=g, dtype=torch.float64) * math.sqrt(vx)
        W = torch.randn(chunk, d_in, generator=g, dtype=torch.float64) * w_std
        out.append(torch.diagonal(impl.linear(X, W)))
    return torch.cat(out)[:n]


# -- 1. Linear forward --------------------------------------------------------------------------------


@prop("Var(y) = d_in Var(w) Var(x) for i.i.d. zero-mean x, w", needs=("linear",), alpha=ALPHA)
@settings(max_examples=4)
@given(d_in=st.sampled_from([4, 16, 64]), vx=st.sampled_from([0.25, 1.0, 4.0]), seed=seeds())
def test_linear_forward_variance(impl, d_in, vx, seed):
    w_std = 1.0 / math.sqrt(d_in)
    vw, mu4w = w_std**2, normal_fourth_moment(w_std**2)
    m2, m4 = _sum_moments(d_in, vx, vw, mu4w)
    y = _diag_samples(impl, d_in, 20_000, vx, w_std, generator(seed))
    res = variance_test(y, m2, m4, claim="Var(y) = d_in Var(w) Var(x)").record()
    assert not res.rejected, str(res)


@prop("negative control: Var(y) = d_out Var(w) Var(x) (d_out = 2 d_in) is rejected", needs=("linear",), alpha=ALPHA)
@settings(max_examples=2)
@given(d_in=st.sampled_from([8, 32]), seed=seeds())
def test_linear_forward_variance_rejects_d_out(impl, d_in, seed):
    w_std = 1.0 / math.sqrt(d_in)
    vw, mu4w = w_std**2, normal_fourth_moment(w_std**2)
    wrong_m2, wrong_m4 = _sum_moments(2 * d_in, 1.0, vw, mu4w)
    y = _diag_samples(impl, d_in, 20_000, 1.0, w_std, generator(seed))
    res = variance_test(y, wrong_m2, wrong_m4, claim="Var(y) = d_out Var(w) Var(x)")
    check(res.threshold / res.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert res.rejected, f"the variance check failed to reject a wrong claim: {res}"


@prop("fixed W: Var(y_j) = Var(x) ||W_j||^2 over x (each output, Bonferroni)", needs=("linear",), alpha=ALPHA)
@settings(max_examples=5)
@given(d_in=st.integers(2, 48), d_out=st.integers(1, 16), seed=seeds())
def test_linear_forward_fixed_weight(impl, d_in, d_out, seed):
    g = generator(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    x = torch.randn(20_000, d_in, generator=g, dtype=torch.float64)
    y = impl.linear(x, W)  # each column j: N(0, ||W_j||^2) exactly
    worst = None
    for j in range(d_out):
        s2 = float((W[j] ** 2).sum())
        res = variance_test(y[:, j], s2, normal_fourth_moment(s2), alpha=ALPHA / d_out)
        worst = res if worst is None or res.statistic / res.threshold > worst.statistic / worst.threshold else worst
    worst.record()
    assert not worst.rejected, str(worst)


@prop("negative control: fixed W, Var(y_j) = d_in Var(w) Var(x) (ignoring the drawn W) is rejected", needs=("linear",), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds())
def test_linear_forward_fixed_weight_rejects_population_claim(impl, seed):
    g = generator(seed)
    d_in = d_out = 8
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    y = impl.linear(torch.randn(20_000, d_in, generator=g, dtype=torch.float64), W)
    results = [variance_test(y[:, j], float(d_in), normal_fourth_moment(float(d_in)), alpha=ALPHA / d_out) for j in range(d_out)]
    best = max(results, key=lambda r: r.statistic)
    check(best.threshold / best.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert best.rejected, "the per-output check failed to reject the population value for a fixed W"


# -- 2. Linear backward -------------------------------------------------------------------------------


def _backward_samples(impl, d_out: int, n: int, vg: float, w_std: float, g: torch.Generator, chunk: int = 256):
    """n independent draws of (dL/dx)_i = sum_j g_j W_ji: column i of dx for upstream row i, per chunk."""
    out = []
    for _ in range(math.ceil(n / chunk)):
        X = torch.zeros(chunk, chunk, dtype=torch.float64, requires_grad=True)  # d_in = chunk
        W = torch.randn(d_out, chunk, generator=g, dtype=torch.float64) * w_std
        G = torch.randn(chunk, d_out, generator=g, dtype=torch.float64) * math.sqrt(vg)
        (dx,) = torch.autograd.grad(impl.linear(X, W), X, grad_outputs=G)
        out.append(torch.diagonal(dx))
    return torch.cat(out)[:n]


@prop("Var(dL/dx) = d_out Var(w) Var(g)", needs=("linear",), alpha=ALPHA)
@settings(max_examples=4)
@given(d_out=st.sampled_from([4, 16, 64]), vg=st.sampled_from([0.5, 2.0]), seed=seeds())
def test_linear_backward_variance(impl, d_out, vg, seed):
    w_std = 1.0 / math.sqrt(d_out)
    vw, mu4w = w_std**2, normal_fourth_moment(w_std**2)
    m2, m4 = _sum_moments(d_out, vg, vw, mu4w)
    dx = _backward_samples(impl, d_out, 20_000, vg, w_std, generator(seed))
    res = variance_test(dx, m2, m4, claim="Var(dx) = d_out Var(w) Var(g)").record()
    assert not res.rejected, str(res)


@prop("negative control: Var(dL/dx) = d_in Var(w) Var(g) is rejected", needs=("linear",), alpha=ALPHA)
@settings(max_examples=2)
@given(d_out=st.sampled_from([8, 32]), seed=seeds())
def test_linear_backward_variance_rejects_d_in(impl, d_out, seed):
    w_std = 1.0 / math.sqrt(d_out)
    vw, mu4w = w_std**2, normal_fourth_moment(w_std**2)
    wrong_m2, wrong_m4 = _sum_moments(256, 1.0, vw, mu4w)  # d_in = chunk = 256
    dx = _backward_samples(impl, d_out, 20_000, 1.0, w_std, generator(seed))
    res = variance_test(dx, wrong_m2, wrong_m4)
    check(res.threshold / res.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert res.rejected, f"the variance check failed to reject a wrong claim: {res}"


# -- 3. Depth -----------------------------------------------------------------------------------------


def _depth_z(impl, gain: float, L: int, g: torch.Generator, width: int = 256, batch: int = 256, claim_gain=None):
    """Per-layer z-scores of ||h W^T||_F^2 against its exact conditional law given h.

    For W with i.i.d. N(0, v) entries (v = gain/width), E ||h W^T||^2 = width v ||h||^2 and
    Var = 2 width v^2 ||h h^T||_F^2 (a sum of width independent Gaussian quadratic forms),
    so E[mean y_L^2] = (width v)^L E[mean x^2] by the tower rule. ``claim_gain`` tests a wrong v.
    """
    v = gain / width
    v_claim = (claim_gain if claim_gain is not None else gain) / width
    h = torch.randn(batch, width, generator=g, dtype=torch.float64)
    zs, ms = [], [float(h.pow(2).mean())]
    for _ in range(L):
        W = torch.randn(width, width, generator=g, dtype=torch.float64) * math.sqrt(v)
        y = impl.linear(h, W)
        hh = h @ h.T
        mean = width * v_claim * float(h.pow(2).sum())
        sd = math.sqrt(2 * width * v_claim**2 * float(hh.pow(2).sum()))
        zs.append(abs(float(y.pow(2).sum()) - mean) / sd)
        h = y
        ms.append(float(h.pow(2).mean()))
    return zs, ms


@prop("depth: E[y_L^2] = (n Var(w))^L Var(x); vanishes below 1, explodes above", needs=("linear",), alpha=ALPHA)
@settings(max_examples=3)
@given(gain=st.sampled_from([0.5, 1.0, 2.0]), seed=seeds())
def test_depth_variance(impl, gain, seed):
    L = 6
    zs, ms = _depth_z(impl, gain, L, generator(seed))
    zcrit = float(sst.norm.isf(ALPHA / L / 2))
    check(max(zs), zcrit, f"a layer's second moment left its conditional law at gain {gain}", alpha=ALPHA, kind="|z|")
    ratio = ms[-1] / ms[0]
    if gain < 1:
        assert ratio < 1, f"gain {gain}: the signal should vanish, ratio {ratio}"
    if gain > 1:
        assert ratio > 1, f"gain {gain}: the signal should explode, ratio {ratio}"


@prop("negative control: depth check rejects n Var(w) = 1 when it is 1.5", needs=("linear",), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds())
def test_depth_variance_rejects_wrong_gain(impl, seed):
    L = 6
    zs, _ = _depth_z(impl, 1.5, L, generator(seed), claim_gain=1.0)
    zcrit = float(sst.norm.isf(ALPHA / L / 2))
    check(zcrit / max(zs), 1.0, "negative control", kind="zcrit/|z|")
    assert max(zs) > zcrit


@prop("Xavier 2/(d_in+d_out) = harmonic mean of 1/d_in and 1/d_out", needs=())
@given(d_in=st.integers(1, 10_000), d_out=st.integers(1, 10_000))
def test_xavier_is_harmonic_compromise(d_in, d_out):
    from fractions import Fraction

    a, b = Fraction(1, d_in), Fraction(1, d_out)
    harmonic = 2 / (1 / a + 1 / b)
    assert harmonic == Fraction(2, d_in + d_out)
    assert min(a, b) <= harmonic <= max(a, b)
    check(0.0, 0.0, "harmonic mean", kind="exact")


def _kaiming_relu_samples(impl, d_in: int, n: int, g: torch.Generator):
    std = math.sqrt(2.0 / d_in)
    y = _diag_samples(impl, d_in, n, 1.0, std, g)
    vw, mu4w = std**2, normal_fourth_moment(std**2)
    m2, m4 = _sum_moments(d_in, 1.0, vw, mu4w)
    return torch.relu(y) ** 2, m2, m4


@prop("Kaiming: E[relu(y)^2] = d_in Var(w) Var(x) / 2 (= Var(x) at 2/d_in)", needs=("linear",), alpha=ALPHA)
@settings(max_examples=3)
@given(d_in=st.sampled_from([8, 32, 64]), seed=seeds())
def test_kaiming_relu_second_moment(impl, d_in, seed):
    r2, m2, m4 = _kaiming_relu_samples(impl, d_in, 20_000, generator(seed))
    # relu(y)^2 has mean E[y^2]/2 and variance E[y^4]/2 - (E[y^2]/2)^2 (y symmetric)
    res = mean_test(r2, m2 / 2, m4 / 2 - (m2 / 2) ** 2, claim="E relu(y)^2 = n Var(w) Var(x)/2").record()
    assert not res.rejected, str(res)
    assert abs(m2 / 2 - 1.0) < 1e-12  # at Var(w) = 2/d_in the second moment is kept exactly


@prop("negative control: E[relu(y)^2] = d_in Var(w) Var(x) (no 1/2) is rejected", needs=("linear",), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds())
def test_kaiming_relu_rejects_no_half(impl, seed):
    r2, m2, m4 = _kaiming_relu_samples(impl, 32, 20_000, generator(seed))
    res = mean_test(r2, m2, m4 / 2 - (m2 / 2) ** 2)
    check(res.threshold / res.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert res.rejected


# -- 4. Truncated normal ------------------------------------------------------------------------------


def truncnorm_var_formula(k: float) -> float:
    """1 - 2 k phi(k) / (2 Phi(k) - 1): the variance of N(0, 1) truncated to [-k, k]."""
    return 1.0 - 2.0 * k * sst.norm.pdf(k) / (2.0 * sst.norm.cdf(k) - 1.0)


@prop("Var TN(0, s^2, +-k s) = s^2 (1 - 2k phi(k)/(2 Phi(k) - 1)) = scipy truncnorm", needs=("init",))
@given(k=st.floats(0.25, 8.0), sigma=st.floats(1e-3, 10.0))
def test_truncnorm_variance_formula(impl, k, sigma):
    want = sigma**2 * truncnorm_var_formula(k)
    scipy_var = float(sst.truncnorm(-k, k, scale=sigma).var())
    got = impl.init.truncnorm_variance(sigma, -k * sigma, k * sigma)
    err = max(abs(got - want), abs(scipy_var - want)) / want
    check(err, 1e-9, f"truncated-normal variance at k={k}", kind="rel error")
    assert round(truncnorm_var_formula(3.0), 5) == 0.97334 and round(truncnorm_var_formula(2.0), 5) == 0.77374


def _tn_samples(impl, std: float, k: float, n: int, seed: int) -> torch.Tensor:
    dist = impl.init.Dist("trunc_normal", std=std, low=-k * std, high=k * std)
    return dist.sample_(torch.empty(n, dtype=torch.float64), generator=generator(seed))


@prop("TN(0, s^2, +-3s) draws: Var = 0.97334 s^2 (z from truncnorm mu4), bounds exact", needs=("init",), alpha=ALPHA)
@settings(max_examples=3)
@given(std=st.sampled_from([0.02, 1.0, 3.0]), k=st.sampled_from([2.0, 3.0]), seed=seeds())
def test_truncnorm_samples(impl, std, k, seed):
    x = _tn_samples(impl, std, k, N_TRUNC, seed)
    assert float(x.abs().max()) <= k * std, "a truncated-normal draw lies outside its bounds"
    var, mu4 = truncnorm_moments(std, k)
    res = variance_test(x, var, mu4, claim=f"Var = {var / std**2:.5f} s^2").record()
    assert not res.rejected, str(res)


@prop("negative control: TN(+-3s) draws reject the untruncated Var = s^2 (>= 6.5 SE)", needs=("init",), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds())
def test_truncnorm_samples_reject_untruncated(impl, seed):
    std = 0.5
    var, mu4 = truncnorm_moments(std, 3.0)
    se = math.sqrt((mu4 - var**2) / N_TRUNC)
    assert (std**2 - var) / se >= 11.0  # the power the sample size was chosen for (z_crit = 4.89)
    x = _tn_samples(impl, std, 3.0, N_TRUNC, seed)
    res = variance_test(x, std**2, normal_fourth_moment(std**2), claim="Var = s^2 (untruncated)")
    check(res.threshold / res.statistic, 1.0, "negative control", kind="zcrit/|z|")
    assert res.rejected, str(res)


@prop("pitfall: torch trunc_normal_(std=0.02) cuts at absolute +-2 = +-100 s: Var = s^2", needs=(), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds())
def test_torch_trunc_normal_bounds_are_absolute(seed):
    std = 0.02
    x = torch.nn.init.trunc_normal_(torch.empty(N_TRUNC, dtype=torch.float64), std=std, generator=generator(seed))
    assert float(x.abs().max()) > 2 * std  # not cut at 2 sigma
    res = variance_test(x, std**2, normal_fourth_moment(std**2), claim="Var = s^2 (effectively untruncated)").record()
    assert not res.rejected, str(res)
    var2, mu42 = truncnorm_moments(std, 2.0)
    wrong = variance_test(x, var2, mu42, claim="Var = 0.77374 s^2 (as if cut at 2 sigma)")
    assert wrong.rejected, f"the check failed to reject the 2-sigma reading: {wrong}"


# -- 5. Every init scheme yields what it declares, and declares the documented rule ------------------

_CFG = ModelConfig(vocab_size=512, context_length=8, d_model=64, num_layers=2, num_heads=4, d_ff=176)


def _documented(scheme: str, name: str, kind: str, fan_in: int, fan_out: int, L: int, d: int):
    """The rule of the init table in docs/model.md for one parameter: (family, std, low, high) or ('constant', value)."""
    resid = name.endswith(("attn.output_proj.weight", "ffn.w2.weight"))
    if kind == "norm_gain":
        return ("constant", 1.0)
    if scheme in ("cs336", "kaiming", "zero-residual"):
        if kind == "embedding":
            return ("trunc_normal", 1.0, -3.0, 3.0)
        if scheme == "zero-residual" and resid:
            return ("constant", 0.0)
        s = math.sqrt(2.0 / fan_in) if scheme == "kaiming" else math.sqrt(2.0 / (fan_in + fan_out))
        return ("trunc_normal", s, -3 * s, 3 * s)
    if scheme == "torch-default":
        if kind == "embedding":
            return ("normal", 1.0)
        b = 1.0 / math.sqrt(fan_in)
        return ("uniform", -b, b)
    if scheme == "gpt2":
        return ("normal", 0.02 / math.sqrt(2 * L) if resid else 0.02)
    if scheme == "small-init":
        return ("normal", 2.0 / (L * math.sqrt(d)) if resid else math.sqrt(2.0 / (5 * d)))
    raise AssertionError(f"no documented rule for scheme {scheme}")


BUILTIN_SCHEMES = ("cs336", "kaiming", "torch-default", "gpt2", "small-init", "zero-residual")


def _shape_of(d) -> tuple:
    if d.family == "constant":
        return ("constant", d.value)
    if d.family == "uniform":
        return ("uniform", d.low, d.high)
    if d.family == "normal":
        return ("normal", d.std)
    return ("trunc_normal", d.std, d.low, d.high)


@prop("each scheme declares the documented rule for every parameter", needs=("transformer_lm", "init"))
@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES)
def test_init_declares_documented_rule(impl, scheme):
    model = impl.transformer_lm(_CFG.replace(init=scheme), generator(0))
    sites = impl.init.sites(model)
    worst = 0.0
    for name, dist in impl.init.declare(model, scheme).items():
        site = sites[name][0]
        want = _documented(scheme, name, site.kind, site.fan_in, site.fan_out, _CFG.num_layers, _CFG.d_model)
        got = _shape_of(dist)
        assert got[0] == want[0], f"{scheme}: {name} declared {got}, documented {want}"
        rel = max((abs(a - b) / max(abs(b), 1e-300) for a, b in zip(got[1:], want[1:])), default=0.0)
        worst = max(worst, rel)
        assert rel <= 1e-12, f"{scheme}: {name} declared {got}, documented {want}"
    check(worst, 1e-12, f"{scheme}: declaration", kind="rel error")


def _sample_test(x: torch.Tensor, dist, alpha: float):
    """(statistic/threshold ratio, message) of the draws ``x`` against the declared ``dist``."""
    x = x.detach().double().reshape(-1)
    if dist.family == "constant":
        return (0.0 if bool((x == dist.value).all()) else math.inf), "constant"
    lo, hi = dist.bounds
    if float(x.min()) < lo or float(x.max()) > hi:
        return math.inf, f"draws outside [{lo}, {hi}]"
    if dist.family == "uniform":
        w = dist.high - dist.low
        c = x - (dist.low + dist.high) / 2
        res = variance_test(c, w**2 / 12, w**4 / 80, alpha=alpha)
    elif dist.family == "normal":
        res = variance_test(x, dist.std**2, normal_fourth_moment(dist.std**2), alpha=alpha)
    else:
        var, mu4 = truncnorm_moments(dist.std, dist.high / dist.std)
        res = variance_test(x, var, mu4, alpha=alpha)
    return res.statistic / res.threshold, str(res)


@prop("every parameter's draws match the declared variance and bounds (Bonferroni)", needs=("transformer_lm", "init"), alpha=ALPHA)
@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES)
def test_init_samples_match_declaration(impl, scheme):
    model = impl.transformer_lm(_CFG.replace(init=scheme), generator(1))
    decl = impl.init.declare(model, scheme)
    params = dict(model.named_parameters())
    alpha = ALPHA / len(decl)
    worst, msg = 0.0, ""
    for name, dist in decl.items():
        ratio, text = _sample_test(params[name], dist, alpha)
        if ratio > worst:
            worst, msg = ratio, f"{name}: {text}"
    check(worst, 1.0, f"{scheme}: {msg}", alpha=ALPHA, kind="|z|/zcrit")


def _standardized_cs336_linear_draws(impl) -> torch.Tensor:
    """Every truncated-normal parameter of a cs336 model divided by its declared sigma: i.i.d. N(0,1) cut at +-3."""
    model = impl.transformer_lm(_CFG.replace(init="cs336"), generator(2))
    params = dict(model.named_parameters())
    parts = [
        params[name].detach().double().reshape(-1) / dist.std
        for name, dist in impl.init.declare(model, "cs336").items()
        if dist.family == "trunc_normal"
    ]
    return torch.cat(parts)


@prop("cs336 draws / sigma pooled: Var = 0.97334; negative control: Var = 1 (untruncated) rejected", needs=("transformer_lm", "init"), alpha=ALPHA)
def test_init_pooled_truncation_and_rejects_untruncated(impl):
    x = _standardized_cs336_linear_draws(impl)
    var, mu4 = truncnorm_moments(1.0, 3.0)
    right = variance_test(x, var, mu4, claim="Var = 0.97334").record()
    wrong = variance_test(x, 1.0, 3.0, claim="Var = 1 (untruncated)")
    assert not right.rejected, str(right)
    assert wrong.rejected, f"{x.numel()} pooled draws failed to reject the untruncated variance: {wrong}"


@pytest.mark.slow
@prop("slow: TN(0, 1, +-k) draws for k = 1..4, 3e6 each: Var = 1 - 2k phi(k)/(2 Phi(k) - 1)", needs=("init",), alpha=ALPHA)
@given(k=st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0]), seed=seeds())
def test_truncnorm_samples_many_k(impl, k, seed):
    x = _tn_samples(impl, 1.0, k, 3_000_000, seed)
    assert float(x.abs().max()) <= k
    var, mu4 = truncnorm_moments(1.0, k)
    assert abs(var - truncnorm_var_formula(k)) < 1e-12
    res = variance_test(x, var, mu4, claim=f"Var = {var:.5f}").record()
    assert not res.rejected, str(res)
