"""Whether a weight tensor still looks like an i.i.d. draw of its declared family, at some scale.

Read by diagnose per kind of weight (:mod:`diagnostics.jobs.diagnose_kinds`). The null hypothesis
of every test here is "the n entries are an i.i.d. draw of the declared distribution, multiplied
by one unknown constant c"; each test's threshold is computed from that null with a false-alarm
probability of :data:`NULL_RATE` (the chance that a true draw at another scale is called "not a
draw"), never from the sample:

* mean: a declared zero-mean family gives |sum w| / (rms sqrt(n)) ~ |N(0, 1)| (central limit);
  the threshold is the two-sided normal quantile;
* shape: the Kolmogorov-Smirnov distance D between the entries divided by c_hat (c_hat = rms /
  declared rms) and the declared CDF. Dvoretzky-Kiefer-Wolfowitz with Massart's constant bounds
  P(sqrt(n) D > x) <= 2 exp(-2 x^2) for a known CDF at every n; estimating the scale makes D
  stochastically smaller (Lilliefors), so the bound stays conservative;
* spectrum: the largest singular value of an m x k draw with entry std s is at most
  s (sqrt(m) + sqrt(k)) in expectation (Gordon, Gaussian entries; Bai-Yin's edge for other
  families), and 1-Lipschitz in the entries: Gaussian concentration (and that of the log-concave
  truncated normal) gives P(s_max > edge + t s) <= exp(-t^2 / 2); uniform entries are
  sub-Gaussian with parameter sqrt(3) s, so t is widened by sqrt(3). Trained matrices grow
  outliers above this edge (learned low-rank directions);
* rows and columns: under the null every row (and every column) of a matrix has the same variance;
  Bartlett's statistic of the rows' mean squares (zero mean known, so each has its full count of
  degrees of freedom) is chi-square with (rows - 1) degrees of freedom for normal entries, and
  (1 + (k - 3) / 2) times that for entries of kurtosis k (Box 1953), so it is divided by that
  factor. Training moves rows apart (a token seen often against one never seen, whose row only
  weight decay shrinks; units that learned against units that did not);
* per-block stds (:func:`consistent`): the std of n i.i.d. entries of kurtosis k has relative
  standard deviation sqrt((k - 1) / (4 n)); over B blocks drawn alike the weighted spread of
  ln std is chi-square with B - 1 degrees of freedom.

Several tests on one kind share the rate by Bonferroni (each gets rate / count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as st

from tinylm.init import Dist

__all__ = ["NULL_RATE", "MAX_ENTRIES", "Shape", "shape", "consistent", "kurtosis"]

#: The false-alarm probability of each test (split over the tests of one kind).
NULL_RATE = 1e-6

#: At most this many entries of a tensor enter the distribution test (an evenly strided subset:
#: under the null any fixed subset of an i.i.d. draw is one, so the test keeps its rate).
MAX_ENTRIES = 1 << 18


@dataclass(frozen=True)
class Shape:
    """One tensor against its declared family: ``n`` entries, ``rms``, the three statistics and
    their thresholds (``spectral`` None where the spectral norm was not measured), and ``why`` the
    first test that fails ("" when the tensor passes every one)."""

    n: int
    rms: float
    rows: float
    columns: float
    rows_limit: float
    mean_z: float
    mean_limit: float
    ks: float
    ks_limit: float
    spectral: float | None
    spectral_limit: float
    why: str = ""

    @property
    def draw(self) -> bool:
        return not self.why


def _cdf(dist: Dist):
    """The declared family's CDF (a scipy frozen distribution), or None for a constant one."""
    if dist.family == "normal":
        return st.norm(scale=dist.std)
    if dist.family == "trunc_normal":
        return st.truncnorm(dist.low / dist.std, dist.high / dist.std, scale=dist.std)
    if dist.family == "uniform":
        return st.uniform(loc=dist.low, scale=dist.high - dist.low)
    return None


def kurtosis(dist: Dist) -> float:
    """E[x^4] / E[x^2]^2 of the declared family (3 normal, 1.8 uniform, below 3 truncated)."""
    cdf = _cdf(dist)
    if cdf is None:
        return 1.0
    m2, m4 = cdf.moment(2), cdf.moment(4)
    return float(m4 / (m2 * m2))


def shape(weight: torch.Tensor, dist: Dist, spectral_norm: float | None, tests: int = 1) -> Shape | None:
    """The tests of the module docstring on one 2-D tensor, each at rate NULL_RATE / (5 ``tests``);
    None where it cannot be tested (a constant family or zero std; a sharded or meta tensor)."""
    cdf = _cdf(dist)
    if cdf is None or not dist.variance > 0 or type(weight.detach()) is not torch.Tensor or weight.is_meta:
        return None  # a sharded (DTensor) or meta weight: its entries are not all here to test
    w = weight.detach().reshape(-1)
    n = w.numel()
    w64 = w.to(torch.float64)
    rms = float(w64.square().mean().sqrt())
    if not (math.isfinite(rms) and rms > 0):
        return Shape(n, rms, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, None, math.nan,
                     why="no finite non-zero entries")
    rate = NULL_RATE / (5 * tests)
    declared_rms = math.sqrt(dist.variance + dist.mean ** 2)
    mean_z = float(w64.sum()) / (rms * math.sqrt(n)) if dist.mean == 0 else 0.0
    mean_limit = float(st.norm.isf(rate / 2))
    step = max(1, -(-n // MAX_ENTRIES))
    sub = np.sort(w64[::step].cpu().numpy()) * (declared_rms / rms)
    m = sub.size
    f = cdf.cdf(sub)
    ks = math.sqrt(m) * float(max(np.max(np.arange(1, m + 1) / m - f), np.max(f - np.arange(m) / m)))
    ks_limit = math.sqrt(math.log(2 / rate) / 2)
    spectral = None
    t = math.sqrt(2 * math.log(1 / rate)) * (math.sqrt(3) if dist.family == "uniform" else 1.0)
    if spectral_norm is not None and math.isfinite(spectral_norm) and weight.dim() == 2:
        rows, cols = weight.shape
        spectral = spectral_norm / rms - (math.sqrt(rows) + math.sqrt(cols))
    kurt = kurtosis(dist)
    rows = _bartlett(w64.reshape(weight.shape[0], -1), kurt) if weight.dim() == 2 else 0.0
    cols = _bartlett(w64.reshape(weight.shape[0], -1).T, kurt) if weight.dim() == 2 else 0.0
    rows_limit = float(st.chi2.isf(rate, weight.shape[0] - 1)) if weight.shape[0] > 1 else math.inf
    cols_limit = float(st.chi2.isf(rate, w64.numel() // weight.shape[0] - 1)) if weight.dim() == 2 else math.inf
    why = ""
    if abs(mean_z) > mean_limit:
        why = f"mean {mean_z:+.3g} standard errors from 0 (limit {mean_limit:.3g})"
    elif ks > ks_limit:
        why = f"its entries do not follow the declared {dist.family} (KS sqrt(n) D = {ks:.3g} > {ks_limit:.3g})"
    elif rows > rows_limit or cols > cols_limit:
        which, v, lim = ("rows", rows, rows_limit) if rows > rows_limit else ("columns", cols, cols_limit)
        why = f"its {which}' variances differ (Bartlett {v:.4g} > {lim:.4g}): rows or units trained apart"
    elif spectral is not None and spectral > t:
        why = (f"its largest singular value sits {spectral:.3g} entry stds above a random matrix's edge "
               f"(limit {t:.3g}): learned directions")
    return Shape(n, rms, rows, cols, rows_limit, mean_z, mean_limit, ks, ks_limit, spectral, t, why)


def _bartlett(w: torch.Tensor, kurt: float) -> float:
    """Bartlett's statistic over the rows of ``w`` (float64, zero mean known), divided by Box's
    non-normality factor 1 + (kurt - 3) / 2; 0 for fewer than two rows or a zero row."""
    k, m = w.shape
    ms = w.square().mean(dim=1)
    if k < 2 or not bool((ms > 0).all()):
        return 0.0 if k < 2 else math.inf
    pooled = float(ms.mean())
    t = k * m * math.log(pooled) - m * float(ms.log().sum())
    c = 1 + (k / m - 1 / (k * m)) / (3 * (k - 1))
    return t / c / (1 + (kurt - 3) / 2)


def consistent(stds: list[float], counts: list[int], kurt: float) -> tuple[float, float]:
    """(Q, limit): the weighted spread of ln std over blocks drawn alike, Q = sum (ln s_b - m)^2 / v_b
    with v_b = (kurt - 1) / (4 n_b) and m the weighted mean, against the chi-square (B - 1) quantile
    at NULL_RATE. (0, inf) for fewer than two blocks."""
    if len(stds) < 2:
        return 0.0, math.inf
    logs = np.log(np.asarray(stds, dtype=float))
    inv = 4 * np.asarray(counts, dtype=float) / max(kurt - 1, 1e-12)
    mean = float(np.sum(inv * logs) / np.sum(inv))
    q = float(np.sum(inv * (logs - mean) ** 2))
    return q, float(st.chi2.isf(NULL_RATE, len(stds) - 1))
