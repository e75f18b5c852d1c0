"""The declarations the diagnostics rely on: each Dist's moments, the modules' own init, seeded reproducibility.

* ``Dist.mean`` and ``Dist.variance`` equal scipy's for every family, asymmetric
  truncation included (low != -high), and ``Dist.sample_`` draws match them (mean and
  central second moment, z from the claim's own moments, bounds exact).
* Every parameter site of a model, initialised by its module's own
  ``reset_parameters`` (not by ``tinylm.init.apply``), matches the Dist the default
  scheme (cs336) declares for that site: the module and the declaration cannot drift.
* A seeded init is reproducible bit for bit, for every scheme, draws nothing from
  torch's global generator, and two seeds give two models (negative control).

False-alarm rate ALPHA = 1e-6 per property, Bonferroni-split over its checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sst

from props.record import check, prop
from props.stattests import ALPHA, mean_test, variance_test
from props.strategies import generator, seeds
from tinylm.config import ModelConfig

BUILTIN_SCHEMES = ("cs336", "kaiming", "torch-default", "gpt2", "small-init", "zero-residual")
_CFG = ModelConfig(vocab_size=384, context_length=8, d_model=48, num_layers=2, num_heads=4, d_ff=128)


def _scipy_dist(d):
    """The scipy distribution a Dist declares (None for a constant)."""
    if d.family == "uniform":
        return sst.uniform(loc=d.low, scale=d.high - d.low)
    if d.family == "normal":
        return sst.norm(scale=d.std)
    if d.family == "trunc_normal":
        return sst.truncnorm(d.low / d.std, d.high / d.std, scale=d.std)
    return None


@st.composite
def dists(draw, impl):
    """Dists of every family, trunc_normal with asymmetric bounds a sigma, b sigma (a < b, mass >= 1e-3)."""
    family = draw(st.sampled_from(["trunc_normal", "trunc_normal", "normal", "uniform"]))
    std = 10.0 ** draw(st.floats(-2.0, 0.5))
    if family == "trunc_normal":
        a = draw(st.floats(-4.0, 2.0))
        b = draw(st.floats(a + 0.25, 4.0))
        return impl.init.Dist("trunc_normal", std=std, low=a * std, high=b * std)
    if family == "normal":
        return impl.init.Dist("normal", std=std)
    lo = draw(st.floats(-2.0, 1.0))
    return impl.init.Dist("uniform", low=lo * std, high=(lo + draw(st.floats(0.1, 3.0))) * std)


@prop("Dist.mean / .variance = scipy's for every family, asymmetric truncation included", needs=("init",))
@given(data=st.data())
def test_dist_moments(impl, data):
    d = data.draw(dists(impl))
    ref = _scipy_dist(d)
    m, v = float(ref.mean()), float(ref.var())
    err = max(abs(d.mean - m) / d.actual_std, abs(d.variance - v) / v)
    check(err, 1e-9, f"{d.describe()}: mean/variance differ from scipy", kind="rel error")
    assert impl.init.Dist("constant", value=0.7).variance == 0.0 and impl.init.Dist("constant", value=0.7).mean == 0.7


def _central_mu4(ref) -> float:
    """E[(x - mean)^4] = (excess kurtosis + 3) var^2."""
    var, kurt = (float(v) for v in ref.stats(moments="vk"))
    return (kurt + 3.0) * var * var


def _draw_checks(x: torch.Tensor, d, alpha: float):
    """(worst stat/threshold, message): bounds, mean and central variance of draws ``x`` against Dist ``d``."""
    x = x.detach().double().reshape(-1)
    if d.family == "constant":
        return (0.0 if bool((x == d.value).all()) else math.inf), f"constant {d.value}"
    lo, hi = d.bounds
    if float(x.min()) < lo or float(x.max()) > hi:
        return math.inf, f"draws outside [{lo:.4g}, {hi:.4g}]"
    ref = _scipy_dist(d)
    mean = mean_test(x, d.mean, d.variance, alpha=alpha / 2, claim=f"E = {d.mean:.4g}")
    var = variance_test(x - d.mean, d.variance, _central_mu4(ref), alpha=alpha / 2, claim=f"Var = {d.variance:.4g}")
    worst = max(mean, var, key=lambda r: r.statistic / r.threshold)
    return worst.statistic / worst.threshold, f"{d.describe()}: {mean}; {var}"


@prop("Dist.sample_ draws: bounds exact, mean and central variance as declared (asymmetric truncation too)", needs=("init",), alpha=ALPHA)
@settings(max_examples=12)
@given(data=st.data(), seed=seeds())
def test_dist_samples(impl, data, seed):
    d = data.draw(dists(impl))
    x = d.sample_(torch.empty(100_000, dtype=torch.float64), generator=generator(seed))
    ratio, msg = _draw_checks(x, d, ALPHA)
    check(ratio, 1.0, msg, alpha=ALPHA, kind="|z|/zcrit")


@prop("negative control: draws of an asymmetric TN are rejected as the symmetric TN of the same sigma", needs=("init",), alpha=ALPHA)
@settings(max_examples=3)
@given(seed=seeds())
def test_dist_samples_reject_symmetric_reading(impl, seed):
    d = impl.init.Dist("trunc_normal", std=1.0, low=-1.0, high=3.0)
    x = d.sample_(torch.empty(100_000, dtype=torch.float64), generator=generator(seed))
    wrong = impl.init.Dist("trunc_normal", std=1.0, low=-3.0, high=3.0)
    ratio, _ = _draw_checks(x.clamp(-3.0, 3.0), wrong, ALPHA)
    check(1.0 / ratio, 1.0, "negative control", kind="zcrit/|z|")
    assert ratio > 1.0


@prop("every parameter site: the module's own reset_parameters draws what cs336 declares for it (Bonferroni)", needs=("transformer_lm", "init"), alpha=ALPHA)
@settings(max_examples=2)
@given(seed=seeds(), tie=st.booleans())
def test_module_reset_matches_declaration(impl, seed, tie):
    cfg = _CFG.replace(tie_embeddings=tie)
    model = impl.transformer_lm(cfg, generator(seed))
    decl = impl.init.declare(model, "cs336")
    owners = {}
    for mod in model.modules():
        for prm in mod.parameters(recurse=False):
            owners.setdefault(id(prm), mod)
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            for prm in model.parameters():
                prm.fill_(float("nan"))  # whatever reset_parameters leaves alone shows up
            for mod in {id(m): m for m in owners.values()}.values():
                mod.reset_parameters()
    finally:
        torch.set_rng_state(state)
    params = dict(model.named_parameters())
    alpha = ALPHA / len(decl)
    worst, msg = 0.0, ""
    for name, d in decl.items():
        ratio, text = _draw_checks(params[name], d, alpha)
        if ratio >= worst:
            worst, msg = ratio, f"{name}: {text}"
    check(worst, 1.0, msg, alpha=ALPHA, kind="|z|/zcrit")


@prop("a Linear with bias: reset_parameters draws the cs336 weight and a zero bias", needs=("layers", "init"), alpha=ALPHA)
@settings(max_examples=3)
@given(d_in=st.sampled_from([16, 200]), d_out=st.sampled_from([8, 300]), seed=seeds())
def test_linear_with_bias_reset(impl, d_in, d_out, seed):
    lin = impl.layers.Linear(d_in, d_out, bias=True, dtype=torch.float64)
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        lin.reset_parameters()
    finally:
        torch.set_rng_state(state)
    site = impl.init.ParamSite("weight", "linear_weight", d_in, d_out, False, 1, d_out)
    ratio, msg = _draw_checks(lin.weight, impl.init.cs336(site), ALPHA)
    assert bool((lin.bias == 0).all()), "Linear bias is not initialised to 0"
    check(ratio, 1.0, msg, alpha=ALPHA, kind="|z|/zcrit")


@prop("seeded init is reproducible bit for bit for every scheme, draws nothing from the global RNG; seeds differ", needs=("transformer_lm", "init"))
@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES)
def test_seeded_init_reproducible(impl, scheme):
    cfg = _CFG.replace(init=scheme, vocab_size=64, d_model=16, d_ff=32)
    state = torch.get_rng_state()
    a = impl.transformer_lm(cfg, generator(7)).state_dict()
    torch.manual_seed(99)  # another global state must not matter
    b = impl.transformer_lm(cfg, generator(7)).state_dict()
    torch.set_rng_state(state)
    model = impl.transformer_lm(cfg, generator(8))
    assert torch.equal(torch.get_rng_state(), state), f"{scheme}: a seeded init drew from the global RNG"
    c = {k: v.clone() for k, v in model.state_dict().items()}
    impl.init.apply(model, scheme, generator=generator(7))
    d = model.state_dict()
    differing = [k for k in a if not torch.equal(a[k], b[k]) or not torch.equal(a[k], d[k])]
    assert not differing, f"{scheme}: seed 7 gave different values for {differing[:3]}"
    random_keys = [k for k, v in a.items() if v.numel() > 1 and v.unique().numel() > 1]
    assert random_keys and all(not torch.equal(a[k], c[k]) for k in random_keys), f"{scheme}: seeds 7 and 8 gave the same draws"
    check(len(differing), 0, f"{scheme}: seeded init", kind="tensors")


@prop("Dist validates its fields, naming the bad value: family, uniform bounds (finite, low < high), std >= 0 (0 allowed)", needs=("init",))
def test_dist_validation(impl):
    from tinylm.errors import ConfigError

    Dist = impl.init.Dist
    with pytest.raises(ConfigError, match=r"^family='gamma': must be trunc_normal, normal, uniform or constant$"):
        Dist("gamma")
    for lo, hi in ((1.0, 1.0), (2.0, 1.0), (-math.inf, 1.0), (0.0, math.inf)):
        with pytest.raises(ConfigError, match=rf"^uniform bounds low={lo}, high={hi}: need finite low < high$"):
            Dist("uniform", low=lo, high=hi)
    for fam in ("normal", "trunc_normal"):
        with pytest.raises(ConfigError, match=r"^std=-0.5: must be >= 0$"):
            Dist(fam, std=-0.5, low=-1.0, high=1.0)
        assert Dist(fam, std=0.0, low=-1.0, high=1.0).variance == 0.0  # a zero std is a legal (degenerate) draw
    assert Dist("uniform", low=-1.0, high=3.0).bounds == (-1.0, 3.0) and Dist("constant", value=2.0).bounds == (2.0, 2.0)
    check(0.0, 0.0, "Dist validation", kind="raises")
