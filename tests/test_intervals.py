"""The 99% interval of measured/predicted: a Student-t interval on ln(ratio) over replicates.

A ratio of variances is positive and multiplicative, so its interval is taken on the
log scale and exponentiated: the point estimate is the geometric mean, the interval is
asymmetric and always positive. The symmetric t interval on the ratio itself (still
used for slopes, which may be negative) is the negative control.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from diagnostics import CONFIDENCE, log_t_interval, t_interval
from diagnostics.measure.intervals import group_geometric_means

ALPHA = 1e-6  # false-alarm probability of each statistical assertion


def test_geometric_mean_of_half_and_two_is_one():
    r, lo, hi = log_t_interval([0.5, 2.0])
    assert r == pytest.approx(1.0, rel=1e-12)
    # exp(+-t_{0.995,1} sd(ln r)/sqrt 2), sd(ln r) = sqrt(2) ln 2: symmetric in ln, so lo * hi = r^2
    half = stats.t.ppf(0.995, 1) * math.log(2)
    assert lo == pytest.approx(math.exp(-half), rel=1e-12) and hi == pytest.approx(math.exp(half), rel=1e-12)
    assert lo * hi == pytest.approx(r * r, rel=1e-12)


def test_widely_spread_ratios_keep_a_positive_interval():
    values = [0.01, 1.0, 100.0, 3.0]
    r, lo, hi = log_t_interval(values)
    assert 0 < lo < r < hi and math.isfinite(hi)
    assert r == pytest.approx(math.exp(np.mean(np.log(values))), rel=1e-12)
    # negative control: the symmetric interval on the ratio itself goes below zero here
    _, old_lo, _ = t_interval(values)
    assert old_lo < 0


def test_the_interval_is_asymmetric_around_the_geometric_mean():
    r, lo, hi = log_t_interval([0.8, 1.0, 1.5, 2.5])
    assert hi - r > r - lo > 0
    assert math.log(hi) - math.log(r) == pytest.approx(math.log(r) - math.log(lo), rel=1e-12)


@pytest.mark.parametrize("values, why", [
    ([1.0, 0.0, 1.2], "zero"), ([1.0, -0.5, 1.2], "negative"), ([1.0, math.nan, 1.2], "nan"),
    ([1.0, math.inf, 1.2], "inf"),
])
def test_non_positive_or_non_finite_replicates_give_no_interval(values, why):
    r, lo, hi = log_t_interval(values)
    assert lo is None and hi is None, why
    if why == "zero":
        assert r == 0.0  # the geometric mean of a set holding 0
    else:
        assert r is None  # no meaningful point either: a ratio of variances is never negative, nan or inf


def test_one_replicate_is_a_point_without_interval_and_none_is_nothing():
    assert log_t_interval([2.0]) == (2.0, None, None)
    assert log_t_interval([]) == (None, None, None)


def coverage(interval, target, sigma, R, trials, seed):
    """How many of ``trials`` intervals from R lognormal(0, sigma) replicates contain ``target``."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.randn(trials, R, generator=g, dtype=torch.float64) * sigma
    hits = 0
    for row in torch.exp(logs).tolist():
        _, lo, hi = interval(row)
        hits += lo <= target <= hi
    return hits


def acceptance(trials):
    """Two-sided acceptance region of the number of covering intervals, false-alarm ALPHA."""
    dist = stats.binom(trials, CONFIDENCE)
    return int(dist.ppf(ALPHA / 2)), int(dist.isf(ALPHA / 2))


def test_log_t_interval_covers_the_median_of_lognormal_replicates():
    """ln r ~ N(0, sigma^2) exactly, so the log-t interval covers the median e^0 = 1 with probability
    exactly 0.99: the count of covering intervals is Binomial(trials, 0.99)."""
    trials = 4000
    lo, hi = acceptance(trials)
    for sigma, R, seed in ((0.05, 3, 0), (1.5, 4, 1), (0.5, 8, 2)):
        hits = coverage(log_t_interval, 1.0, sigma, R, trials, seed)
        assert lo <= hits <= hi, (sigma, R, hits, (lo, hi))


def test_negative_control_symmetric_interval_fails_the_same_check():
    """The same coverage check rejects the symmetric t interval on the ratio itself for widely
    spread replicates (sigma 1.5, 4 replicates): as an interval for the mean of the ratio,
    e^{sigma^2/2}, it covers far less than 99% (a skewed, heavy-tailed ratio)."""
    trials = 4000
    lo, hi = acceptance(trials)
    sigma = 1.5
    hits = coverage(t_interval, math.exp(sigma**2 / 2), sigma, 4, trials, 1)
    assert not lo <= hits <= hi, hits


def test_one_ratio_per_group_is_the_geometric_mean_of_its_ratios():
    """The batches of one weight draw share its deviation: one replicate per draw, exp(mean ln r)."""
    got = group_geometric_means([(0, 0.5), (1, 3.0), (0, 2.0), (1, 3.0)])
    assert got == pytest.approx([1.0, 3.0], rel=1e-12)
    # negative control: the arithmetic mean of 0.5 and 2 is 1.25, not what a replicate of ratios gives
    assert got[0] != pytest.approx(1.25)
    # a ratio that is not finite and positive is passed on for log_t_interval to report
    assert group_geometric_means([(0, 1.0), (0, 0.0), (1, 2.0)]) == [0.0, 2.0]
    assert math.isnan(group_geometric_means([(0, float("nan")), (0, 1.0)])[0])
