"""Each init scheme draws what it declares: the declared variance within a stated
statistical tolerance, the declared bounds exactly.

The check: for n i.i.d. draws of a zero-mean distribution with variance v and
fourth moment mu4, the sample mean square m2 has mean v and standard error
sqrt((mu4 - v^2) / n). We reject when |m2 - v| > z * se with z = Phi^-1(1 - alpha/2),
alpha = 1e-6 per assertion (z = 4.89). mu4 comes from scipy's distributions.
"""

import math

import pytest
import scipy.stats as ss
import torch

import tinylm
from tinylm import init

ALPHA = 1e-6
Z = ss.norm.isf(ALPHA / 2)


def fourth_moment(dist: init.Dist) -> float:
    if dist.family == "uniform":
        return ss.uniform(dist.low, dist.high - dist.low).moment(4)
    if dist.family == "normal":
        return 3 * dist.std**4
    a, b = dist.low / dist.std, dist.high / dist.std
    return ss.truncnorm(a, b, scale=dist.std).moment(4)


def variance_z(x: torch.Tensor, variance: float, dist: init.Dist) -> float:
    """z-score of the sample mean square of x against the claimed variance (mean 0)."""
    x = x.detach().double().flatten()
    se = math.sqrt((fourth_moment(dist) - dist.variance**2) / x.numel())
    return (x.pow(2).mean().item() - variance) / se


def test_truncated_variance_formula_against_scipy():
    for k, want in ((3.0, 0.97334), (2.0, 0.77374)):
        assert init.truncnorm_variance(1.0, -k, k) == pytest.approx(ss.truncnorm(-k, k).var(), rel=1e-12)
        assert init.truncnorm_variance(1.0, -k, k) == pytest.approx(want, abs=5e-6)
    assert init.truncnorm_variance(0.5, -0.3, 1.2) == pytest.approx(ss.truncnorm(-0.6, 2.4, scale=0.5).var(), rel=1e-12)


@pytest.mark.parametrize("scheme", sorted(init.SCHEMES))
def test_every_parameter_has_its_declared_variance_and_bounds(scheme):
    model = tinylm.TransformerLM(tinylm.preset("tiny", init=scheme), generator=torch.Generator().manual_seed(0))
    declared = init.declare(model, scheme)
    params = dict(model.named_parameters())
    assert set(declared) == set(params)
    for name, dist in declared.items():
        p = params[name].detach()
        lo, hi = dist.bounds
        assert p.min().item() >= lo and p.max().item() <= hi, name
        if dist.family == "constant":
            assert torch.all(p == dist.value), name
        else:
            assert abs(variance_z(p, dist.variance, dist)) < Z, (name, dist)


def test_negative_control_untruncated_variance_is_rejected():
    """The same check rejects the claim Var = sigma^2 for a 3-sigma truncated normal (the 2.7% correction)."""
    dist = init.Dist("trunc_normal", std=0.1, low=-0.3, high=0.3)
    x = dist.sample_(torch.empty(400_000, dtype=torch.float64), torch.Generator().manual_seed(0))
    assert abs(variance_z(x, dist.variance, dist)) < Z
    assert abs(variance_z(x, dist.std**2, dist)) > Z  # about 16 standard errors away


def test_negative_control_wrong_fan_is_rejected():
    """cs336's lm_head: 2/(d_in + d_out) is accepted, Kaiming's 2/d_in is rejected."""
    model = tinylm.TransformerLM(tinylm.preset("tiny"), generator=torch.Generator().manual_seed(0))
    dist = init.declare(model, "cs336")["lm_head.weight"]
    w = model.lm_head.weight
    assert abs(variance_z(w, dist.variance, dist)) < Z
    assert abs(variance_z(w, 0.97334 * 2 / 64, dist)) > Z


def test_trunc_normal_sampler_is_exact_in_the_tails():
    """Rejection sampling keeps the tail shape: P(|x| > 2 sigma | |x| <= 3 sigma), binomial test at 1e-6."""
    dist = init.Dist("trunc_normal", std=1.0, low=-3.0, high=3.0)
    x = dist.sample_(torch.empty(400_000), torch.Generator().manual_seed(1))
    p = (2 * ss.norm.sf(2) - 2 * ss.norm.sf(3)) / (1 - 2 * ss.norm.sf(3))
    k = int((x.abs() > 2).sum())
    assert ss.binomtest(k, x.numel(), p).pvalue > ALPHA
    assert ss.binomtest(k, x.numel(), 2 * ss.norm.sf(2)).pvalue < ALPHA  # negative control: the untruncated tail


def test_low_acceptance_truncation_falls_back_and_respects_bounds():
    dist = init.Dist("trunc_normal", std=1.0, low=2.0, high=2.5)  # acceptance 1.6%: inverse-CDF path
    x = dist.sample_(torch.empty(10_000), torch.Generator().manual_seed(0))
    assert x.min() >= 2.0 and x.max() <= 2.5
    assert dist.mean == pytest.approx(ss.truncnorm(2.0, 2.5).mean(), rel=1e-12)


def test_residual_output_rules():
    c = tinylm.preset("tiny")
    model = tinylm.TransformerLM(c)
    L, d = c.num_layers, c.d_model
    g = init.declare(model, "gpt2")
    assert g["layers.0.attn.output_proj.weight"].std == pytest.approx(0.02 / math.sqrt(2 * L))
    assert g["layers.2.ffn.w2.weight"].std == pytest.approx(0.02 / math.sqrt(2 * L))
    assert g["layers.0.ffn.w1.weight"].std == 0.02
    s = init.declare(model, "small-init")
    assert s["layers.1.ffn.w2.weight"].std == pytest.approx(2 / (L * math.sqrt(d)))
    assert s["layers.1.ffn.w1.weight"].std == pytest.approx(math.sqrt(2 / (5 * d)))
    z = init.declare(model, "zero-residual")
    assert z["layers.0.attn.output_proj.weight"].family == "constant"
    k = init.declare(model, "kaiming")
    assert k["layers.0.ffn.w2.weight"].std == pytest.approx(math.sqrt(2 / c.d_ff))


def test_zero_residual_blocks_start_as_identity():
    c = tinylm.preset("tiny", init="zero-residual")
    model = tinylm.TransformerLM(c).double()
    x = torch.randn(2, 8, c.d_model, dtype=torch.float64)
    torch.testing.assert_close(model.layers[0](x), x, rtol=0, atol=0)


def test_seeded_apply_is_deterministic():
    c = tinylm.preset("tiny")
    a = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(3))
    b = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_register_a_user_scheme():
    def tiny_std(site):
        if site.kind == "linear_weight":
            return init.Dist("normal", std=1e-3, why="deliberately small")
        return init.cs336(site)

    init.register("test-tiny-std", tiny_std)
    try:
        model = tinylm.TransformerLM(tinylm.preset("tiny", init="test-tiny-std"))
        assert model.layers[0].ffn.w1.weight.std().item() == pytest.approx(1e-3, rel=0.05)
        with pytest.raises(tinylm.ConfigError, match="exists already"):
            init.register("test-tiny-std", tiny_std)
    finally:
        init.SCHEMES.pop("test-tiny-std")


def test_unknown_scheme_names_the_choices():
    with pytest.raises(tinylm.ConfigError, match="unknown init scheme 'xavier'.*cs336"):
        tinylm.TransformerLM(tinylm.preset("tiny", init="xavier"))


def test_module_reset_parameters_follow_cs336():
    """Standalone modules (outside a TransformerLM) initialise by the cs336 rule too."""
    lin = tinylm.Linear(300, 500)
    dist = init.cs336(init.ParamSite("w", "linear_weight", 300, 500, False, 1, 500))
    assert abs(variance_z(lin.weight, dist.variance, dist)) < Z
    assert lin.weight.abs().max().item() <= dist.high
