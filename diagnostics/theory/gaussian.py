"""Gaussian expectations the rules need: the moments of an activation, a LayerNorm and a softmax of
Gaussian inputs, and the cross-entropy gradient of iid Gaussian logits.

* :func:`activation_moments` (:func:`silu_moments`): (E[f(a)], E[f(a)^2], E[f'(a)^2]) for
  a ~ N(mu, sigma^2), f one of :data:`ACTIVATIONS` (SiLU, GELU exact and tanh, ReLU), by
  scipy.integrate.quad (split at ReLU's kink).
* :func:`layernorm_moments` (:func:`layernorm_factors` for an array of variances): LayerNorm's
  forward factor E[v/(v + eps)] and backward factor E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))]
  for a token of d iid elements of variance var, d v/var ~ chi-square with d - 1 degrees of
  freedom (quadrature over that law).
* :func:`softmax_moments`: E[sum_j a_j^2], E[sum_j a_j^3], E[(sum_j a_j^2)^2] and the entropy of
  a = softmax(z), z ~ N(0, sigma^2 I_n), for every n up to n_max (Monte Carlo over fixed-seed
  draws: deterministic).
* :func:`ce_grad_mean_square`: E[g^2] per logit of the mean cross-entropy over N positions with
  random targets, (S2(V) - 2/V + 1)/(V N^2), S2(V) = E[sum p^2] for V iid logits of the given variance.

The independent-token rules (:mod:`.independent`) and the token-kernel theories
(:mod:`.tokenkernel`, :mod:`.backkernel`) read them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from scipy import integrate, special, stats

from ..options import OptionsError

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "activation_of",
    "activation_moments",
    "silu_moments",
    "layernorm_moments",
    "layernorm_factors",
    "softmax_moments",
    "ce_grad_mean_square",
    "SIGMA_CAP",
]

#: Monte Carlo rows of the softmax moments (at most; fewer for long rows) and their seed
_MC_DRAWS = 8192
_MC_SEED = 1234


def _gauss_expect(f: Callable[[float], float], mu: float, sigma: float, kink: float | None = None) -> float:
    """E[f(mu + sigma z)], z ~ N(0, 1), by quad over |z| <= 12, split at ``kink`` (in z) if given."""
    if sigma <= 0:
        return f(mu)
    if not (math.isfinite(mu) and math.isfinite(sigma)):
        return math.nan
    dens = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    with warnings.catch_warnings():  # huge sigma (an exploding model): quad warns about its own tolerance
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        points = [kink] if kink is not None and -12 < kink < 12 else None
        val, _ = integrate.quad(lambda z: f(mu + sigma * z) * dens(z), -12, 12, limit=200, epsabs=0, epsrel=1e-10,
                                points=points)
    return val


def _square(x: float) -> float:
    """x^2, inf where it leaves the float64 range (``x ** 2`` raises OverflowError there)."""
    return x * x


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def _gelu_tanh_inner(x):
    return _SQRT_2_OVER_PI * (x + 0.044715 * x**3)


@dataclass(frozen=True)
class Activation:
    """An FFN activation as the theory needs it: f and f', elementwise on numpy arrays (or floats),
    overflow-free; ``kink``: the point where f' jumps (ReLU's 0), which quadrature splits at."""

    name: str
    f: Callable
    df: Callable
    kink: float | None = None


#: Every activation of ``tinylm.ModelConfig.ffn`` (SwiGLU's gate is "silu"), by name.
ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation("silu", lambda x: x * _sigmoid(x),
                       lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x)))),
    "gelu": Activation("gelu", lambda x: x * special.ndtr(x),
                       lambda x: special.ndtr(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
    "gelu_tanh": Activation("gelu_tanh", lambda x: 0.5 * x * (1.0 + np.tanh(_gelu_tanh_inner(x))),
                            lambda x: 0.5 * (1.0 + np.tanh(_gelu_tanh_inner(x)))
                            + 0.5 * x * (1.0 - np.tanh(_gelu_tanh_inner(x)) ** 2)
                            * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)),
    "relu": Activation("relu", lambda x: np.maximum(x, 0.0), lambda x: np.greater(x, 0.0) * 1.0, kink=0.0),
}


def activation_of(ffn: str) -> Activation:
    """The activation of an FFN kind (``ModelConfig.ffn`` or a plan step's variant): SwiGLU's gate is SiLU."""
    return ACTIVATIONS["silu" if ffn == "swiglu" else ffn]


@lru_cache(maxsize=4096)
def activation_moments(name: str, mu: float, sigma: float) -> tuple[float, float, float]:
    """(E[f(a)], E[f(a)^2], E[f'(a)^2]) for a ~ N(mu, sigma^2), f = ``ACTIVATIONS[name]``, by
    scipy.integrate.quad (split at a kink). At N(0, 1): GELU 0.425221 / 0.455851 for the last
    two, ReLU 1/2 / 1/2 (E[relu] = 1/sqrt(2 pi))."""
    act = ACTIVATIONS[name]
    f, df = (lambda a: float(act.f(a))), (lambda a: float(act.df(a)))
    kink = None if act.kink is None or sigma <= 0 else (act.kink - mu) / sigma
    return (_gauss_expect(f, mu, sigma, kink), _gauss_expect(lambda a: _square(f(a)), mu, sigma, kink),
            _gauss_expect(lambda a: _square(df(a)), mu, sigma, kink))


def silu_moments(mu: float, sigma: float) -> tuple[float, float, float]:
    """(E[silu(a)], E[silu(a)^2], E[silu'(a)^2]) for a ~ N(mu, sigma^2): :func:`activation_moments` of "silu"."""
    return activation_moments("silu", mu, sigma)


@lru_cache(maxsize=64)
def _chi2_rule(k: int, nodes: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Nodes x and weights w (summing to 1) with sum w h(x) = E[h(X)], X ~ chi-square(k), for smooth h:
    Gauss-Legendre on the central [1e-15, 1 - 1e-15] quantile range (k >= 5: h(x) / x stays smooth too),
    else Gauss-Legendre in u = sqrt(x) over [0, upper] (the density's x^(k/2 - 1) singularity absorbed)."""
    law = stats.chi2(k)
    hi = float(law.isf(1e-15))
    g, gw = np.polynomial.legendre.leggauss(nodes)
    if k >= 5:
        lo = float(law.ppf(1e-15))
        x = lo + (hi - lo) * (g + 1) / 2
        w = gw * law.pdf(x)
    else:
        u = math.sqrt(hi) * (g + 1) / 2
        x = u * u
        w = gw * law.pdf(x) * 2 * u  # dx = 2 u du
    return x, w / w.sum()


def layernorm_factors(var: np.ndarray, d: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`layernorm_moments` for an array of input variances (one per token of a kernel's diagonal)."""
    var = np.asarray(var, dtype=np.float64)
    fwd, back = np.full(var.shape, math.nan), np.full(var.shape, math.nan)
    ok = np.isfinite(var) & (var >= 0) & math.isfinite(eps)
    if d <= 1:
        fwd[ok] = 0.0
        return fwd, back
    x, w = _chi2_rule(d - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = var[ok][:, None] / d * x[None, :]  # (n, nodes): v = var X / d
        se = v + eps
        fwd[ok] = np.where(se > 0, v / np.where(se > 0, se, 1.0), 0.0) @ w
        back[ok] = ((d - 2 + (eps / se) ** 2) / (d * se)) @ w
    return fwd, back


@lru_cache(maxsize=4096)
def layernorm_moments(var: float, d: int, eps: float) -> tuple[float, float]:
    """LayerNorm's two factors for a token of d iid elements of variance ``var`` (any mean).

    v, the token's population variance, has d v / var ~ chi-square with d - 1 degrees of
    freedom (the mean removal takes one). With u = (x - mean)/sqrt(v + eps) and rho = v/(v + eps)
    (so |u|^2 = d rho):

    * forward: E[u_i^2] = E[v/(v + eps)], hence E[y^2] = E[g^2] E[v/(v + eps)] + E[b^2] for
      y = g u + b (the probe's mean square; ~1 - eps d/((d-1) var));
    * backward: the Jacobian is (P - u u^T/d) diag(g)/sqrt(v + eps), P = I - 1 1^T/d, i.e.
      P - rho u^ u^T (u^ = u/|u| is orthogonal to 1): for a gradient of isotropic direction
      E|(P - rho u^ u^T) w|^2 = |w|^2 (d - 1 - 2 rho + rho^2)/d, so
      E[g_x^2] = E[g^2] E[g_y^2] E[(d - 2 + (eps/(v + eps))^2) / (d (v + eps))]: a rank d-2
      projection (two directions removed, 1 and u) when eps << v, and E[d/((d-3) var)] for
      1/v at eps = 0 (chi-square with d - 1 degrees of freedom).

    Returns (E[v/(v + eps)], E[(d - 2 + (eps/(v+eps))^2) / (d (v + eps))]), by quadrature over
    the chi-square law (:func:`layernorm_factors`; d = 1: v = 0, the output is the bias alone).
    """
    fwd, back = layernorm_factors(np.array([var], dtype=np.float64), d, eps)
    return float(fwd[0]), float(back[0])


@lru_cache(maxsize=8)
def _normal_draws(rows: int, cols: int) -> np.ndarray:
    return np.random.default_rng(_MC_SEED).standard_normal((rows, cols))


#: Beyond this score (logit) std the softmax is one-hot but for a few draws: E[sum a^2] is within
#: a few 1e-4 of 1 (a row is not one-hot only where its two largest draws lie within ~40/std of
#: each other), so the moments are taken at this std. It keeps every draw and every log-space sum
#: below finite, and the entropy's difference of two logs of the scores' size within 1e-8 or so.
SIGMA_CAP = 1e4


def _finite_sigma(sigma: float) -> float:
    return min(float(sigma), SIGMA_CAP)


@lru_cache(maxsize=4096)
def softmax_moments(sigma: float, n_max: int) -> dict[str, np.ndarray]:
    """Moments of a = softmax(z), z ~ N(0, sigma^2 I_n), for every n = 1..n_max (index n-1).

    Returns arrays "s2" = E[sum_j a_j^2], "s3" = E[sum_j a_j^3], "s2sq" = E[(sum_j a_j^2)^2],
    "entropy" = E[-sum_j a_j ln a_j]. Monte Carlo over a fixed-seed set of draws shared by
    every n (cumulative sums over the columns), so the result is deterministic; the
    relative error of s2 is about 1/sqrt(draws) times its coefficient of variation.

    Any finite sigma works: the sums are taken directly while no term can underflow (every
    draw of a row within 230 nats of the row's largest, so that e^{3(z - max)} stays normal),
    otherwise in log space (``torch.logcumsumexp``, per prefix); sigma beyond
    :data:`SIGMA_CAP` is taken at the cap. A non-finite sigma gives NaN arrays.
    """
    if n_max < 1:
        raise OptionsError(f"n_max={n_max}: needs at least one position")
    if not math.isfinite(sigma):
        nan = np.full(n_max, math.nan)
        return {"s2": nan, "s3": nan, "s2sq": nan, "entropy": nan}
    rows = max(256, min(_MC_DRAWS, int(4_000_000 // n_max)))
    z = _finite_sigma(sigma) * _normal_draws(rows, n_max)
    z = z - z.max(axis=1, keepdims=True)  # shift-invariant; every z <= 0
    if 3.0 * float(-z.min()) < 690.0:  # no e^{kz}, k <= 3, underflows: direct cumulative sums
        e1 = np.exp(z)
        c1, c2, c3 = np.cumsum(e1, 1), np.cumsum(e1**2, 1), np.cumsum(e1**3, 1)
        s2, s3 = c2 / c1**2, c3 / c1**3
        # entropy: H = ln(c1) - sum e z / c1
        ent = np.log(c1) - np.cumsum(e1 * z, 1) / c1
    else:  # a prefix's terms may all underflow against the row's largest: the same sums in log space
        t = torch.from_numpy(z)
        l1 = torch.logcumsumexp(t, 1)
        s2 = torch.exp(torch.logcumsumexp(2 * t, 1) - 2 * l1).numpy()
        s3 = torch.exp(torch.logcumsumexp(3 * t, 1) - 3 * l1).numpy()
        # H = ln sum e^z - sum e^z z / sum e^z, with -z >= 0 summed in log space (ln 0 = -inf: no weight)
        with np.errstate(divide="ignore"):
            log_neg = torch.from_numpy(np.log(-z))
        ent = (l1 + torch.exp(torch.logcumsumexp(t + log_neg, 1) - l1)).numpy()
    ent = np.maximum(ent, 0.0)  # a difference of two logs: rounding may leave -1e-6 (log space) where H is 0
    return {"s2": s2.mean(0), "s3": s3.mean(0), "s2sq": (s2**2).mean(0), "entropy": ent.mean(0)}


@lru_cache(maxsize=1024)
def _s2_at(sigma: float, n: int) -> float:
    """E[sum a^2] for n iid N(0, sigma^2) logits (Monte Carlo, fixed seed; sigma beyond
    :data:`SIGMA_CAP` taken at the cap); beyond 4096 positions e^{sigma^2}/n, capped at 1 (a sum
    of squared probabilities never exceeds 1) and taken in log space, so that no logit scale
    overflows it."""
    if not math.isfinite(sigma):
        return math.nan
    if n > 4096:
        return math.exp(min(sigma * sigma - math.log(n), 0.0))
    rows = max(256, min(_MC_DRAWS, int(4_000_000 // n)))
    z = _finite_sigma(sigma) * _normal_draws(rows, n)
    e = np.exp(z - z.max(axis=1, keepdims=True))  # the row's largest term is 1: the sums never vanish
    return float(((e * e).sum(1) / e.sum(1) ** 2).mean())


def ce_grad_mean_square(logit_var: float, vocab: int, tokens: float) -> float:
    """E[g^2] per logit of the mean cross-entropy over ``tokens`` positions with random targets.

    g = (p - onehot(y)) / N;  E[sum_c (p_c - y_c)^2] = E[sum p^2] - 2/V + 1.
    """
    s2 = _s2_at(round(math.sqrt(max(logit_var, 0.0)), 6), vocab)
    return (s2 - 2.0 / vocab + 1.0) / (vocab * tokens**2)
