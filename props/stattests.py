"""Statistical checks with a stated false-alarm rate and thresholds from known moments.

Every test here compares a sample with a *claim* (a mean, a variance, a count
probability). The threshold comes from the claim's own moments (computed with
scipy, never estimated from the sample), so the probability that a true claim
is rejected is the stated ``alpha``:

* :func:`mean_test`: z = (mean(x) - mu) / sqrt(var / n), two-sided.
* :func:`variance_test`: for draws with known mean 0, v = mean(x^2) estimates the
  variance sigma^2 with standard error sqrt((mu4 - sigma^4) / n), where mu4 is the
  claim's fourth moment (the truncated normal's, for a truncated-normal claim).
* :func:`binomial_test`: scipy's exact ``binomtest`` for a count of successes.

Each returns a :class:`TestResult` that knows whether it rejected and records
itself (observed |z|, threshold, alpha) for the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as _st

from .record import record

__all__ = [
    "ALPHA",
    "TestResult",
    "z_threshold",
    "mean_test",
    "variance_test",
    "binomial_test",
    "normal_fourth_moment",
    "truncnorm_moments",
    "required_n",
]

#: Default false-alarm probability of one statistical assertion.
ALPHA = 1e-6


def z_threshold(alpha: float = ALPHA) -> float:
    """Two-sided standard-normal critical value: P(|Z| > z) = alpha (4.89 at 1e-6)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha}: a false-alarm probability must be in (0, 1)")
    return float(_st.norm.isf(alpha / 2))


@dataclass(frozen=True)
class TestResult:
    """One statistical comparison of a sample with a claim.

    ``statistic`` is |z| (or, for exact tests, the p-value), ``threshold`` what it is
    compared with, ``alpha`` the false-alarm probability, ``rejected`` the verdict.
    """

    __test__ = False  # not a pytest test class

    claim: str
    statistic: float
    threshold: float
    alpha: float
    rejected: bool
    kind: str = "|z|"

    def record(self) -> "TestResult":
        """Send this result to the property report (no-op outside a property run)."""
        record(self.statistic, self.threshold, alpha=self.alpha, kind=self.kind)
        return self

    def __str__(self) -> str:
        verdict = "rejected" if self.rejected else "not rejected"
        return f"{self.claim}: {self.kind}={self.statistic:.4g} vs {self.threshold:.4g} (alpha={self.alpha:g}) -> {verdict}"


def _as_array(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).reshape(-1).cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def mean_test(x, mu: float, var: float, *, alpha: float = ALPHA, claim: str = "") -> TestResult:
    """Is the mean of i.i.d. draws ``x`` equal to ``mu``, given their variance ``var`` under the claim?

    z = (mean(x) - mu) / sqrt(var / n); reject when |z| > z_{alpha/2}.
    """
    a = _as_array(x)
    n = a.size
    if n < 2 or not var > 0:
        raise ValueError(f"n={n}, var={var}: need at least 2 draws and a positive claimed variance")
    z = abs(float(a.mean()) - mu) / math.sqrt(var / n)
    t = z_threshold(alpha)
    return TestResult(claim or f"E[x] = {mu:.6g}", z, t, alpha, z > t)


def variance_test(x, sigma2: float, mu4: float, *, alpha: float = ALPHA, claim: str = "") -> TestResult:
    """Is Var(x) = ``sigma2`` for i.i.d. zero-mean draws ``x`` whose fourth moment under the claim is ``mu4``?

    v = mean(x^2); SE = sqrt((mu4 - sigma2^2) / n); z = (v - sigma2) / SE (CLT on x^2).
    """
    a = _as_array(x)
    n = a.size
    excess = mu4 - sigma2**2
    if n < 2 or not excess > 0:
        raise ValueError(f"n={n}, mu4 - sigma^4={excess}: need at least 2 draws and mu4 > sigma^4")
    v = float(np.mean(a * a))
    z = abs(v - sigma2) / math.sqrt(excess / n)
    t = z_threshold(alpha)
    return TestResult(claim or f"Var(x) = {sigma2:.6g}", z, t, alpha, z > t)


def binomial_test(k: int, n: int, p: float, *, alpha: float = ALPHA, claim: str = "") -> TestResult:
    """Exact two-sided binomial test that k successes in n trials come from probability ``p``.

    Rejects when the p-value is below ``alpha``. The recorded statistic is -log10(p-value)
    against -log10(alpha), so that larger means "further from the claim" as for |z|.
    """
    pv = float(_st.binomtest(int(k), int(n), float(p)).pvalue)
    stat = -math.log10(max(pv, 1e-300))
    return TestResult(claim or f"P(success) = {p:.6g}", stat, -math.log10(alpha), alpha, pv < alpha, kind="-log10 p")


def normal_fourth_moment(sigma2: float) -> float:
    """E[x^4] = 3 sigma^4 for x ~ N(0, sigma^2)."""
    return 3.0 * sigma2**2


def truncnorm_moments(sigma: float, k: float) -> tuple[float, float]:
    """(variance, fourth moment) of N(0, sigma^2) truncated to [-k sigma, k sigma], from scipy."""
    d = _st.truncnorm(-k, k, loc=0.0, scale=sigma)
    return float(d.var()), float(d.moment(4))


def required_n(effect: float, sigma2: float, mu4: float, *, alpha: float = ALPHA, power_z: float = 1.5) -> int:
    """Draws needed so that a variance off by ``effect`` (absolute) sits at z_{alpha/2} + power_z standard errors.

    With power_z = 1.5 the wrong claim is rejected with probability >= 93%.
    """
    z = z_threshold(alpha) + power_z
    return int(math.ceil((z / effect) ** 2 * (mu4 - sigma2**2)))
