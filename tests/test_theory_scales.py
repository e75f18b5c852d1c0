"""A finite model always gets a report, whatever the scale of its weights.

Property-style: on a grid of weight scales (std 0.01 to 100, including the badly scaled 3 and 10,
and N(0, 1) Linear weights in a 12-layer model, whose logits reach a std in the hundreds), every
norm placement and every theory mode, ``diagnose`` returns a result without an exception; every
measurement of a finite tensor is finite; every prediction is either inside its validity and a
finite number, or outside it with a reason; every ratio is a number or absent; the verdicts are
those of a measurement-only run (theory never changes them); and the report renders. The Monte
Carlo softmax moments and the SiLU moments hold their exact bounds at any score scale.
"""

from __future__ import annotations

import importlib
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import tinylm
from diagnostics import DiagnoseOptions, diagnose
from diagnostics.theory import Prediction
from diagnostics.theory.gaussian import SIGMA_CAP, silu_moments, softmax_moments
from diagnostics.theory.prediction import no_variance_left
from reports.render import ReportContext, report

SMALL = dict(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
OPTS = dict(batch_size=2, batches=2, seq_len=8)


def scaled(config: tinylm.ModelConfig, std: float, linear_only: bool = False) -> tinylm.TransformerLM:
    """A model whose weights are N(0, std^2): all of them, or (linear_only) only the Linear weights."""
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not linear_only or (p.dim() == 2 and name != "token_embeddings.weight"):
                p.normal_(0.0, std, generator=gen)
    return model


def check_report(result, theory: str) -> None:
    """What every run must give, whatever the scale (see the module doc)."""
    assert result.tensors, "a report with measurements"
    for r in result.tensors:
        if r.frac_nonfinite == 0:
            assert math.isfinite(r.var) and r.var >= 0, (r.name, r.direction, r.var)
        if r.predicted is None:
            continue
        assert theory != "off"
        if r.valid:
            assert math.isfinite(r.predicted), (r.name, r.direction, r.predicted)
        else:
            assert r.validity, f"{r.name} {r.direction}: outside validity without a reason"
        assert r.ratio is None or (math.isfinite(r.ratio) and r.ratio >= 0), (r.name, r.ratio)
        if r.ratio_low is not None:
            assert 0 <= r.ratio_low <= r.ratio_high  # 0 and inf: a spread beyond the float range
    text = io.StringIO()
    Console(file=text, width=100, color_system=None).print(report(result, ReportContext()))
    assert "verdict" in text.getvalue()


def kinds(result) -> list[tuple[str, str]]:
    return [(f.kind, f.where) for f in result.findings]


SCALES = [3.0, 10.0, 100.0] + [pytest.param(s, marks=pytest.mark.slow) for s in (0.01, 0.3, 1.0, 30.0)]


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
@pytest.mark.parametrize("std", SCALES)
def test_every_scale_gets_a_report_in_every_theory_mode(norm, std):
    """auto picks local on these (no weight follows its declared init), so the default run checks the
    two theories and off; the slow variant adds auto and more scales."""
    model = scaled(tinylm.ModelConfig(**SMALL, norm=norm), std)
    measured_only = diagnose(model, options=DiagnoseOptions(**OPTS, theory="off"))
    assert measured_only.header.theory == "off"
    assert all(r.predicted is None for r in measured_only.tensors)
    check_report(measured_only, "off")
    slow = std not in (3.0, 10.0, 100.0)
    for theory in ("local", "global") + (("auto",) if slow else ()):
        result = diagnose(model, options=DiagnoseOptions(**OPTS, theory=theory))
        assert result.header.theory in ("local", "global"), (theory, result.header.theory)
        check_report(result, theory)
        assert kinds(result) == kinds(measured_only), "theory never changes a verdict"


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_unscaled_linear_weights_in_a_12_layer_model_get_a_report(norm):
    """The common "forgot to scale the init" bug: N(0, 1) Linear weights, 12 blocks (logit std in the
    stream growing through the blocks, an overflowing one without a norm)."""
    config = tinylm.ModelConfig(vocab_size=256, context_length=8, d_model=32, num_layers=12, num_heads=2, d_ff=64,
                                norm=norm)
    result = diagnose(scaled(config, 1.0, linear_only=True), options=DiagnoseOptions(**OPTS))
    assert result.header.theory == "local"
    # the bug is found and named whatever the norm; pre-norm keeps the stream trainable (a warning),
    # post-norm and no norm break (a failure)
    assert "init_scale" in {f.cause for f in result.findings}, result.findings
    assert result.healthy == (norm == "pre") and all(f.severity == "warn" for f in result.findings) == (norm == "pre")
    check_report(result, "local")


@pytest.mark.parametrize("head_std", [10.0, 1e3])
def test_logits_past_the_old_overflow_get_a_gradient_prediction(head_std):
    """A large vocabulary (the e^{sigma^2}/V branch of the softmax moment) with logit std 40 and 4000,
    far past 27, where exp(sigma^2) overflowed: the head's gradient is predicted, finite, and valid or
    outside validity with its reason."""
    model = tinylm.TransformerLM(tinylm.ModelConfig(**{**SMALL, "vocab_size": 5000}),
                                 generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_std, generator=torch.Generator().manual_seed(2))
    result = diagnose(model, options=DiagnoseOptions(**OPTS))
    assert math.sqrt(result.tensor("lm_head").var) > 27
    grad = result.tensor("lm_head", "backward")
    assert grad.predicted is not None and math.isfinite(grad.predicted)
    check_report(result, result.header.theory)


def test_global_theory_on_weights_that_do_not_follow_the_declared_init_is_outside_validity():
    """A premise the measurement contradicts: forced global theory on std-10 weights predicts the declared
    init, so every prediction is marked outside validity, naming a parameter and its drift."""
    result = diagnose(scaled(tinylm.ModelConfig(**SMALL), 10.0), options=DiagnoseOptions(**OPTS, theory="global"))
    predicted = [r for r in result.tensors if r.predicted is not None]
    assert predicted and not any(r.valid for r in predicted)
    assert all("do not follow" in r.validity and "x its declared std" in r.validity for r in predicted)
    # negative control: a fresh draw keeps its valid global predictions
    fresh = tinylm.TransformerLM(tinylm.ModelConfig(**SMALL), generator=torch.Generator().manual_seed(0))
    result = diagnose(fresh, options=DiagnoseOptions(**OPTS, theory="global"))
    assert any(r.valid for r in result.tensors if r.predicted is not None)
    assert not any("do not follow" in r.validity for r in result.tensors)


def test_none_is_an_alias_of_off():
    assert DiagnoseOptions(theory="none").theory == "off"
    assert DiagnoseOptions(theory="none") == DiagnoseOptions(theory="off")


@pytest.mark.parametrize("error", [OverflowError("math range error"), ValueError("cannot convert float NaN to integer"),
                                   RuntimeError("a bug inside theory")])
def test_any_failure_inside_theory_leaves_the_measurement_and_the_verdict(monkeypatch, error):
    D = importlib.import_module("diagnostics.jobs.diagnose")  # the module (the package re-exports the function)

    def broken(*a, **k):
        raise error

    model = scaled(tinylm.ModelConfig(**SMALL, norm="none"), 3.0)
    measured_only = diagnose(model, options=DiagnoseOptions(**OPTS, theory="off"))
    monkeypatch.setattr(D, "predict", broken)
    with pytest.warns(RuntimeWarning, match=f"could not be computed .*{type(error).__name__}"):
        result = diagnose(model, options=DiagnoseOptions(**OPTS))
    assert result.header.theory == "off" and all(r.predicted is None for r in result.tensors)
    assert kinds(result) == kinds(measured_only) and not result.healthy
    check_report(result, "none")


# ---------------------------------------------------------------- the moments, at any scale

@settings(max_examples=40, deadline=None)
@given(log_sigma=st.floats(-3.0, 308.0), n=st.integers(1, 24))
def test_softmax_moments_hold_their_exact_bounds_at_any_scale(log_sigma, n):
    """Per draw, a = softmax(z) has 1/n <= sum a^2 <= 1, sum a^3 <= sum a^2, (sum a^2)^2 <= sum a^2 and
    0 <= entropy <= ln n; so do their means, at any score std (1e-3 to 1e308). The entropy is a
    difference of two logs of the scores' size (up to 1e5 at the std cap): rounding, 1e-6 at most."""
    m = softmax_moments(10.0**log_sigma if log_sigma < 308 else 1.7e308, n)
    k = np.arange(1, n + 1)
    tol = 1e-9
    assert np.all(np.isfinite(m["s2"])) and np.all(np.isfinite(m["entropy"]))
    assert np.all(m["s2"] >= 1 / k - tol) and np.all(m["s2"] <= 1 + tol)
    assert np.all(m["s3"] <= m["s2"] + tol) and np.all(m["s2sq"] <= m["s2"] + tol)
    assert np.all(m["entropy"] >= 0) and np.all(m["entropy"] <= np.log(k) + 1e-6)
    assert m["s2"][0] == pytest.approx(1.0, abs=tol)  # one position: the softmax is 1


def test_softmax_moments_match_the_two_position_integral_in_both_summation_paths():
    """For n = 2, sum a^2 = 1 - X with X = 2 p (1 - p), p = sigmoid(d), d = z1 - z2 ~ N(0, 2 sigma^2):
    E[X] by quadrature. X lies in [0, 1/2], so Var X <= E[X]/2 and the Monte Carlo mean of R draws is
    within z sqrt(E[X] / (2R)) of E[X] but with probability 1e-6 (z = 4.89). sigma 1 takes the direct
    sums, sigma 100 the log-space ones (its draws span far more than 230 nats). Negative control:
    the moments at sigma 30 do not pass as those at sigma 100."""
    from scipy import integrate, special, stats

    def expected_x(sigma):
        f = lambda d: 2 * stats.norm.pdf(d, scale=math.sqrt(2) * sigma) * special.expit(d) * special.expit(-d)  # noqa: E731
        return integrate.quad(f, -np.inf, np.inf, epsabs=0, epsrel=1e-10, limit=400)[0]

    z = stats.norm.isf(1e-6 / 2)
    rows = 8192  # the draws softmax_moments takes for two positions
    for sigma in (1.0, 100.0):
        ex = expected_x(sigma)
        got = 1.0 - softmax_moments(sigma, 2)["s2"][1]
        assert abs(got - ex) <= z * math.sqrt(ex / 2 / rows), (sigma, got, ex)
    ex = expected_x(100.0)
    wrong = 1.0 - softmax_moments(30.0, 2)["s2"][1]
    assert abs(wrong - ex) > z * math.sqrt(ex / 2 / rows)


def test_the_score_std_is_capped_where_every_draw_is_one_hot():
    assert softmax_moments(SIGMA_CAP * 1e100, 8)["s2"] == pytest.approx(softmax_moments(SIGMA_CAP, 8)["s2"], abs=0)
    assert softmax_moments(SIGMA_CAP, 256)["s2"][-1] > 1 - 1e-3


@pytest.mark.parametrize("mu, sigma", [(0.0, 1e160), (1e200, 0.0), (-1e200, 1.0), (0.0, math.inf)])
def test_silu_moments_leave_the_float_range_as_inf_or_nan_not_an_exception(mu, sigma):
    m1, m2, d2 = silu_moments(mu, sigma)
    assert not math.isfinite(m2) or m2 >= 0
    assert math.isnan(d2) or 0 <= d2 <= 1.2  # silu' lies in [-0.1, 1.1]


def test_a_prediction_past_the_float_range_is_outside_validity_with_its_reason():
    for p in (Prediction(math.inf, 0.0, True, "", "rule"), Prediction(math.nan, 0.0, True, "", "rule"),
              Prediction(1e300, 1e200, True, "", "rule")):
        q = no_variance_left(p)
        assert not q.valid and "double precision" in q.validity
    ok = no_variance_left(Prediction(2.0, 0.5, True, "", "rule"))
    assert ok.valid and ok.var == pytest.approx(1.75)  # negative control: a finite prediction stays valid


@pytest.mark.parametrize("norm", ["pre", "none"])
@pytest.mark.parametrize("std", [pytest.param(10.0, marks=pytest.mark.slow), 1e4])
def test_global_theory_of_an_absurd_declared_init_runs_quietly(monkeypatch, norm, std):
    """A registered scheme that declares N(0, std^2) weights: global theory follows the declared scale
    through the blocks (past float64 for 1e4 without a norm) without an exception or a numpy warning;
    whatever overflowed is outside validity with its reason."""
    import warnings

    from tinylm.init import Dist

    def absurd(site):
        return Dist("normal", std=std) if site.kind in ("linear_weight", "embedding") else tinylm.init.cs336(site)

    monkeypatch.setitem(tinylm.init.SCHEMES, "absurd", absurd)
    config = tinylm.ModelConfig(**{**SMALL, "vocab_size": 5000, "num_layers": 3}, norm=norm, init="absurd")
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = diagnose(model, options=DiagnoseOptions(**OPTS, theory="global"))
    assert result.header.theory == "global"
    check_report(result, "global")
