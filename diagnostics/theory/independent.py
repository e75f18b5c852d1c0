"""Predicted forward and gradient variance of every instrumented tensor of a tinylm model.

One recursion serves both modes; they differ only in where a layer's inputs come from:

* ``global``: purely analytic at init. Weights enter through their declared
  distributions (``tinylm.init.declare``; second moment E[w^2] = Dist.variance +
  Dist.mean^2, truncation corrected), activations through the predictions for
  the layers before. The rules below assume independent tokens (uniform random
  tokens). For a tinylm model the *forward* predictions then come from the
  token-kernel theory (:mod:`diagnostics.theory.tokenkernel`, ``forward="kernel"``, the default),
  which tracks the correlation between a sequence's tokens (accuracy: docs/theory.md);
  each of those predictions
  keeps the independent-token one in ``Prediction.independent``. So do the backward
  predictions, from the backward kernel (:mod:`diagnostics.theory.backkernel`).
* ``local``: each layer from the *measured* moments of its own input (a
  :class:`ProbeStats` of one replicate) and its *actual* weights. Works for a
  trained checkpoint, where measured/predicted shows how far training has aligned
  a layer's weights with its inputs (1 for a random matrix).

Rules (x: input, y: output, g: gradient of the loss; E[.^2] a mean square per element):

* Embedding: E[y^2] = E[w^2] (local: the mean square of the whole table).
* Linear y = W x (+ b), W (d_out, d_in): E[y^2] = ||W||_F^2 / d_out E[x^2] (+ E[b^2])  (global: d_in E[w^2] E[x^2]);
  backward E[g_x^2] = ||W||_F^2 / d_in E[g_y^2]  (global: d_out E[w^2] E[g_y^2]).
* RMSNorm y = gain x / sqrt(ms(x) + eps): E[y^2] = mean(gain^2) ms/(ms + eps); backward
  E[g_x^2] = mean(gain^2) E[g_y^2] E[1/(ms + eps)] (d-1)/d (the projection onto x removes
  1/d of the energy); local mode measures the per-token product mean_t E[g_y^2]_t/(ms_t + eps)
  (gradient and norm vary together over positions, so pooling them separately is biased
  beyond block 0), global mode takes E[g_y^2] d/((d-2)(ms + eps)) (chi-square token norms).
* LayerNorm y = g (x - mean)/sqrt(v + eps) + b, v the token's population variance (d v/var ~
  chi2_{d-1}): E[y^2] = mean(g^2) E[v/(v+eps)] + mean(b^2); backward E[g_x^2] = mean(g^2) E[g_y^2]
  E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))] (the Jacobian P - u u^T/d removes the directions 1
  and u: rank d-2), for a gradient whose direction is independent of the normalised token (a
  near-uniform softmax, as at init). :func:`layernorm_moments`; var from the input's variance
  (measured in local mode).
* SwiGLU h = silu(a) * b, a, b independent Gaussians: E[h^2] = E[silu(a)^2] E[b^2];
  backward E[g_b^2] = E[g_h^2] E[silu(a)^2], E[g_a^2] = E[g_h^2] E[b^2] E[silu'(a)^2]
  (Gaussian expectations by scipy.integrate.quad). Non-gated MLP h = f(a), f one of
  :data:`ACTIVATIONS` (SiLU, GELU exact and tanh, ReLU): E[h^2] = E[f(a)^2], mean E[f(a)],
  backward E[g_a^2] = E[g_h^2] E[f'(a)^2] (:func:`activation_moments`, any mean and variance).
* Biases: a Linear's bias adds E[b^2] to its output's mean square (0 at init for every scheme
  but torch-default); v_proj's bias passes the attention whole (rows of A sum to 1):
  E[heads^2] = (E[v^2] - E[b_v^2]) mean_t E[sum_j a_tj^2] + E[b_v^2].
* Learned positions: E[resid_in^2] = E[w_tok^2] + E[w_pos^2] (independent tables); backward,
  the token embedding's gradient is resid_in's, the position table's output (one (T, d) tensor
  broadcast over the batch) B = N/T times it (the batch's sequences' gradients are independent).
* Attention (causal, T positions, scores s ~ N(0, sigma^2) with sigma^2 = E[q^2] E[k^2]):
  row t is a softmax over n = t+1 scores; S2(n) = E[sum_j a_j^2] (Monte Carlo with a fixed
  seed, shared draws across n). Heads: E[o^2] = E[v^2] (1/T) sum_t S2(t+1); probabilities
  over the causal entries: mean 2/(T+1), E[p^2] = sum_t S2(t+1) / (T(T+1)/2). Backward:
  E[g_p^2] = d_k E[g_o^2] E[v^2]; E[g_s^2] = E[g_p^2] E[sum_j a_j^2 (1 - 2 a_j + S2)] per
  causal entry; E[g_q^2] = E[k^2] E[sum_j g_s,tj^2] / d_k, E[g_k^2] likewise with q,
  E[g_v^2] = E[g_o^2] (1/T) sum_t S2(t+1).
* Residual stream: branch variances add (pre-norm and no-norm); post-norm normalises the sum.
  Backward, an add passes its output's gradient to both terms and a residual point's gradient
  is the sum of what its readers pass back (the add, and the branch or norm that reads it).

The rules are applied one per step of the block plan (:mod:`tinylm.plan`), forward in the
plan's order and backward in reverse, so every norm placement the plan describes is covered
by the same four rules (norm, attention, FFN, residual add).
* Cross-entropy gradient (mean over the N positions of one loss, V classes): E[g^2] =
  (E[sum_c p_c^2] - 2 E[p_y] + 1) / (V N^2), taken with E[sum p^2] = S2(V) for iid logits of
  variance sigma_l^2 and E[p_y] = 1/V (targets independent of p): a near-uniform softmax, as at
  init. N is the count of one loss even when the moments pool several batches (each gradient
  is scaled by its own loss's 1/N).

Validity: every rule here assumes independent tokens. At init, attention mixes a
component shared by all positions into the stream (tokens become correlated), so
beyond block 0 the independent-token global prediction of the attention heads/branch
and of the stream is "outside validity" (the kernel theory, which replaces them by
default, is valid there: its own validity is used, see ``KernelTheory.predictions``;
where it is outside validity and the independent-token rule is not, as in block 0
without a norm, the independent-token prediction is kept); so is, in local mode,
the heads prediction beyond block 0.
The cross-entropy rule is outside validity when the measured softmax moments (``softmax=``)
break its premises: the measured E[sum p^2] - 2 E[p_y] + 1 differs from the rule's by more
than the mode's tolerance (5% local, 10% global), as on a trained model (a peaked softmax,
predictable targets). A prediction whose variance comes out <= 0 (local mode: a measured
output mean larger than the random-matrix mean square) is outside validity too.
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
from torch import nn

import tinylm
from tinylm.init import declare

from ..options import OptionsError
from ..measure.moments import ProbeStats
from .prediction import Prediction, no_variance_left

__all__ = [
    "independent_predictions",
    "ACTIVATIONS",
    "Activation",
    "activation_of",
    "activation_moments",
    "silu_moments",
    "layernorm_moments",
    "layernorm_factors",
    "softmax_moments",
    "ce_grad_mean_square",
]

_MC_DRAWS = 8192
_MC_SEED = 1234


# ---------------------------------------------------------------- Gaussian expectations

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


# ---------------------------------------------------------------- the recursion

class _Source:
    """Where a rule's inputs come from: measured (local) or predicted (global)."""

    def __init__(self, model: tinylm.TransformerLM, mode: str, stats: ProbeStats | None, seq_len: int,
                 tokens: float, scheme: str | None, softmax: tuple[float, float] | None = None):
        self.model, self.mode, self.stats, self.T, self.N = model, mode, stats, seq_len, tokens
        self.softmax = softmax
        self.config = model.config
        self.plan = tinylm.plan.build(model.config)
        self.producer = self.plan.producers()
        self.out: dict[tuple[str, str], Prediction] = {}
        self.params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head keeps its name
        if mode == "global":
            self.decl = declare(model, scheme or self.config.init)

    # inputs
    def ms(self, name: str, direction: str = "forward") -> float:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction)) if self.stats else None
            if m is None or not m.count:
                raise KeyError((name, direction))
            return m.mean_square
        return self.out[(name, direction)].mean_square

    def mean(self, name: str, direction: str = "forward") -> float:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction))
            return m.mean if m is not None and m.count else 0.0
        p = self.out.get((name, direction))
        return p.mean if p is not None else 0.0

    def var(self, name: str, direction: str = "forward") -> float:
        m = self.mean(name, direction)
        return self.ms(name, direction) - m * m

    def fwd_ms(self, name: str) -> float:
        """E[x^2] of a tensor: ``ms`` for a named one; for a residual sum no module outputs, the sum of
        its two terms' (independent at init: the branch's output weights are zero-mean)."""
        if tinylm.plan.is_sum(name):
            a, b = self.producer[name].reads
            return self.fwd_ms(a) + self.fwd_ms(b)
        return self.ms(name)

    def fwd_var(self, name: str) -> float:
        """The variance (mean square minus mean^2) of a tensor, as ``fwd_ms`` (a residual sum: its terms' sum)."""
        if tinylm.plan.is_sum(name):
            a, b = self.producer[name].reads
            return self.fwd_var(a) + self.fwd_var(b)
        return self.var(name)

    def second_moment(self, pname: str) -> float:
        """mean(w^2): actual (local) or declared E[w^2] (global)."""
        if self.mode == "local":
            return float(self.params[pname].detach().double().square().mean())
        if pname not in self.decl and pname == f"{self.plan.head}.weight":  # tied to the token embeddings
            pname = f"{self.plan.embedding}.weight"
        d = self.decl[pname]
        return d.variance + d.mean * d.mean

    # outputs
    def put(self, name: str, direction: str, ms: float, rule: str, *, mean: float | None = None,
            valid: bool = True, why: str = "") -> None:
        if mean is None:
            mean = self.mean(name, direction) if self.mode == "local" else 0.0
        self.out[(name, direction)] = Prediction(ms, mean, valid, why, rule)

    def has(self, name: str, direction: str = "forward") -> bool:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction)) if self.stats else None
            return m is not None and bool(m.count)
        return (name, direction) in self.out


def _bias2(src: _Source, name: str) -> float:
    """E[b^2] of module ``name``'s bias (0 without one): a bias adds it to every output's mean square."""
    return src.second_moment(f"{name}.bias") if f"{name}.bias" in src.params else 0.0


def _linear_fwd(src: _Source, name: str, x: str, kind_rule: str = "linear") -> float:
    w = src.params[f"{name}.weight"]
    d_out, d_in = w.shape
    b2 = _bias2(src, name)
    ms = d_in * src.second_moment(f"{name}.weight") * src.ms(x) + b2
    src.put(name, "forward", ms, f"{kind_rule}: d_in E[w^2] E[x^2]" + (" + E[b^2]" if b2 or f"{name}.bias" in src.params
                                                                         else ""))
    return ms


def _linear_back_factor(src: _Source, name: str) -> float:
    """d_out E[w^2]: the factor from E[g_y^2] to this Linear's share of E[g_x^2]."""
    w = src.params[f"{name}.weight"]
    return w.shape[0] * src.second_moment(f"{name}.weight")


def _is_layer(src: _Source) -> bool:
    return src.config.norm_kind == "layer"


def _norm_word(src: _Source) -> str:
    return "layernorm" if _is_layer(src) else "rmsnorm"


def _norm_fwd(src: _Source, name: str, x_ms: float, out_name: str | None = None, x_var: float | None = None) -> float:
    """RMSNorm: mean(gain^2) ms/(ms + eps). LayerNorm: mean(gain^2) E[v/(v + eps)] + mean(b^2), v the
    token's variance (:func:`layernorm_moments`, from the input's variance ``x_var``, default ``x_ms``)."""
    gain2 = src.second_moment(f"{name}.weight")
    eps = src.config.eps
    if _is_layer(src):
        var = x_ms if x_var is None else x_var
        fwd, _ = layernorm_moments(round(max(var, 0.0), 12), src.config.d_model, eps)
        ms = gain2 * fwd + _bias2(src, name)
        rule = "layernorm: mean(gain^2) E[v/(v+eps)] + mean(b^2) (v ~ var chi2_{d-1}/d)"
    else:
        ms = gain2 * x_ms / (x_ms + eps) if x_ms + eps > 0 else 0.0
        rule = "rmsnorm: mean(gain^2) ms/(ms+eps)"
    src.put(out_name or name, "forward", ms, rule)
    return ms


def _norm_back(src: _Source, name: str, g_ms: float, x_ms: float, x_name: str | None = None,
               x_var: float | None = None) -> float:
    """RMSNorm: E[g_x^2] = mean(gain^2) E[g_y^2] E[1/(ms + eps)] (d-1)/d: local mode reads E[1/(ms+eps)] per
    token as measured at ``x_name``; global mode takes d/((d-2)(ms + eps)) (chi-square tokens).
    LayerNorm: mean(gain^2) E[g_y^2] E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))] (:func:`layernorm_moments`,
    from the input's variance ``x_var``, default ``x_ms``, in both modes)."""
    d = src.config.d_model
    gain2 = src.second_moment(f"{name}.weight")
    if _is_layer(src):
        var = x_ms if x_var is None else x_var
        _, back = layernorm_moments(round(max(var, 0.0), 12), d, src.config.eps)
        return gain2 * g_ms * back
    proj = (d - 1) / d if d > 1 else 1.0
    if src.mode == "local" and src.stats is not None:
        nb = src.stats.norm_back.get(name)
        if nb is not None and nb.count:  # measured per token: mean_t E_i[g_y^2]_t / (ms_t + eps)
            return gain2 * nb.mean * proj
        inv = src.stats.inv_ms.get(x_name) if x_name else None
        if inv is not None and inv.count:
            return gain2 * g_ms * inv.mean * proj
    chi = d / (d - 2) if d > 2 else 1.0
    return gain2 * g_ms / (x_ms + src.config.eps) * chi * proj if x_ms + src.config.eps > 0 else 0.0


def _attention_fwd(src: _Source, i: int, p: str, x: str) -> None:
    """Attention module ``p`` of block i reading tensor ``x``: q, k, v, scores, probs, heads, output_proj."""
    T = src.T
    outside = (False, "tokens are correlated beyond block 0 (attention mixes a shared component into the "
                      "stream); the independent-token rule underestimates")
    for proj in ("q_proj", "k_proj", "v_proj"):
        _linear_fwd(src, f"{p}.{proj}", x)
    s_var = src.ms(f"{p}.q_proj") * src.ms(f"{p}.k_proj")
    src.put(f"{p}.scores", "forward", s_var, "scores: E[q^2] E[k^2]")
    sigma = math.sqrt(max(src.var(f"{p}.scores") if src.mode == "local" else s_var, 0.0))
    mc = softmax_moments(round(sigma, 6), T)
    npairs = T * (T + 1) / 2
    p_ms = float(mc["s2"][:T].sum()) / npairs
    pvalid, pwhy = (True, "") if i == 0 else (False, "beyond block 0 the scores of different keys are correlated "
                                                      "(tokens share a component); the iid-score softmax overestimates")
    src.put(f"{p}.probs", "forward", p_ms, "softmax of Gaussian scores, S2(t+1) by Monte Carlo",
            mean=2.0 / (T + 1), valid=pvalid, why=pwhy)
    a2 = (src.ms(f"{p}.probs") * npairs / T) if src.mode == "local" else float(mc["s2"][:T].mean())
    valid, why = (True, "") if i == 0 else outside
    bv2 = _bias2(src, f"{p}.v_proj")  # rows of A sum to 1: A (V + 1 b^T) = A V + 1 b^T
    src.put(f"{p}.heads", "forward", (src.ms(f"{p}.v_proj") - bv2) * a2 + bv2,
            "heads: E[v^2] mean_t E[sum_j a_tj^2]" + (" (v's bias passes whole: + E[b_v^2])" if bv2 else ""),
            valid=valid, why=why)
    ms = _linear_fwd(src, f"{p}.output_proj", f"{p}.heads")
    gvalid, gwhy = (True, "") if (i == 0 or src.mode == "local") else outside
    src.put(f"{p}.output_proj", "forward", ms, "linear: d_in E[w^2] E[x^2]", valid=gvalid, why=gwhy)
    src.put(p, "forward", ms, "attention branch = output_proj", valid=gvalid, why=gwhy)


def _ffn_fwd(src: _Source, p: str, x: str) -> None:
    """FFN module ``p`` reading tensor ``x``: w1, [w3], hidden, w2 (the activation from :data:`ACTIVATIONS`)."""
    _linear_fwd(src, f"{p}.w1", x)
    a_mean, a_var = src.mean(f"{p}.w1"), max(src.var(f"{p}.w1"), 0.0)
    act = activation_of(src.config.ffn)
    m1, m2, _ = activation_moments(act.name, round(a_mean, 9), round(math.sqrt(a_var), 9))
    if src.config.ffn == "swiglu":
        _linear_fwd(src, f"{p}.w3", x)
        src.put(f"{p}.hidden", "forward", m2 * src.ms(f"{p}.w3"), "swiglu: E[silu(a)^2] E[b^2]",
                mean=None if src.mode == "local" else 0.0)
    else:
        src.put(f"{p}.hidden", "forward", m2, f"{act.name}: E[{act.name}(a)^2]", mean=None if src.mode == "local" else m1)
    ms = _linear_fwd(src, f"{p}.w2", f"{p}.hidden")
    src.put(p, "forward", ms, "ffn branch = w2")


# the two terms of each block's residual adds, as the rules name them
_TERMS = {"attn": ("x", "attn"), "ffn": ("h", "ffn")}
_OUTSIDE = "the stream carries the attention's shared component from block 1 on; independent-token sums underestimate"


def _norm_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _norm_fwd(src, step.module, src.fwd_ms(step.reads[0]), x_var=src.fwd_var(step.reads[0]))
    for alias in step.writes[1:]:  # post-norm: the norm's output is a residual point
        a, b = _TERMS[step.branch]
        src.put(alias, "forward", src.out[(step.output, "forward")].mean_square,
                f"post-norm: {step.module.rsplit('.', 1)[-1]}({a} + {b})")


def _attention_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _attention_fwd(src, block.index, step.module, step.reads[0])


def _ffn_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _ffn_fwd(src, step.module, step.reads[0])


def _add_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """Residual add: branch variances add (the branch's output weights are zero-mean at init). A sum
    no module outputs (post-norm) is not predicted: its norm reads it through ``fwd_ms``."""
    if tinylm.plan.is_sum(step.output):
        return
    stream, branch = step.reads
    gvalid = src.mode == "local" or block.index == 0
    a, b = _TERMS[step.branch]
    src.put(step.output, "forward", src.ms(stream) + src.ms(branch), f"residual: Var({a}) + Var({b})",
            valid=gvalid, why="" if gvalid else _OUTSIDE)


_FORWARD = {"norm": _norm_step_fwd, "attention": _attention_step_fwd, "ffn": _ffn_step_fwd, "add": _add_step_fwd}


def _forward(src: _Source) -> None:
    """The forward rules, one per step of the block plan, in the plan's order."""
    plan = src.plan
    src.put(plan.embedding, "forward", src.second_moment(f"{plan.embedding}.weight"), "embedding: E[w^2]")
    if plan.positions is not None:  # learned positions: an independent table, added
        src.put(plan.positions, "forward", src.second_moment(f"{plan.positions}.weight"), "position embedding: E[w^2]")
        src.put(plan.input, "forward", src.ms(plan.embedding) + src.ms(plan.positions),
                "token + position embeddings: E[w_tok^2] + E[w_pos^2]")
    for block in plan.blocks:
        for step in block.steps:
            _FORWARD[step.kind](src, block, step)
    head_in = plan.blocks[-1].output
    if plan.final_norm is not None and (src.mode == "global" or src.has(plan.final_norm)):
        _norm_fwd(src, plan.final_norm, src.ms(head_in), x_var=src.var(head_in))
        head_in = plan.final_norm
    _linear_fwd(src, plan.head, head_in)


def _attention_back(src: _Source, p: str, g_branch: float) -> float:
    """Gradients inside attention module ``p`` given E[g^2] at its output; returns E[g^2] at its input (all of q, k, v)."""
    c, T = src.config, src.T
    dk = c.d_model // c.num_heads
    src.put(f"{p}.output_proj", "backward", g_branch, "attention branch gradient = stream gradient")
    g_o = _linear_back_factor(src, f"{p}.output_proj") * g_branch
    src.put(f"{p}.heads", "backward", g_o, "linear backward: d_out E[w^2] E[g_y^2]")
    g_o = src.ms(f"{p}.heads", "backward")
    npairs = T * (T + 1) / 2
    g_p = dk * g_o * src.ms(f"{p}.v_proj")
    src.put(f"{p}.probs", "backward", g_p, "probs gradient: d_k E[g_o^2] E[v^2]")
    sigma = math.sqrt(max(src.var(f"{p}.scores"), 0.0))
    mc = softmax_moments(round(sigma, 6), T)
    shape = float((mc["s2"][:T] - 2 * mc["s3"][:T] + mc["s2sq"][:T]).sum()) / npairs
    src.put(f"{p}.scores", "backward", src.ms(f"{p}.probs", "backward") * shape,
            "softmax backward: E[g_p^2] E[sum a^2 (1 - 2a + S2)]")
    g_s_row = src.ms(f"{p}.scores", "backward") * npairs / T  # E[sum_j g_s,tj^2], averaged over t
    src.put(f"{p}.q_proj", "backward", src.ms(f"{p}.k_proj") * g_s_row / dk, "q gradient: E[k^2] E[sum_j g_s^2]/d_k")
    src.put(f"{p}.k_proj", "backward", src.ms(f"{p}.q_proj") * g_s_row / dk, "k gradient: E[q^2] E[sum_t g_s^2]/d_k")
    a2 = (src.ms(f"{p}.probs") * npairs / T) if src.mode == "local" else float(mc["s2"][:T].mean())
    src.put(f"{p}.v_proj", "backward", g_o * a2, "v gradient: E[g_o^2] mean_j E[sum_t a_tj^2]")
    return sum(_linear_back_factor(src, f"{p}.{n}") * src.ms(f"{p}.{n}", "backward")
               for n in ("q_proj", "k_proj", "v_proj"))


def _ffn_back(src: _Source, p: str, g_branch: float) -> float:
    """Gradients inside FFN module ``p`` given E[g^2] at its output; returns E[g^2] at its input."""
    src.put(f"{p}.w2", "backward", g_branch, "ffn branch gradient")
    src.put(f"{p}.hidden", "backward", _linear_back_factor(src, f"{p}.w2") * g_branch,
            "linear backward: d_out E[w^2] E[g_y^2]")
    g_h = src.ms(f"{p}.hidden", "backward")
    a_mean, a_var = src.mean(f"{p}.w1"), max(src.var(f"{p}.w1"), 0.0)
    act = activation_of(src.config.ffn)
    _, m2, d2 = activation_moments(act.name, round(a_mean, 9), round(math.sqrt(a_var), 9))
    if src.config.ffn == "swiglu":
        src.put(f"{p}.w3", "backward", g_h * m2, "swiglu backward: E[g_h^2] E[silu(a)^2]")
        src.put(f"{p}.w1", "backward", g_h * src.ms(f"{p}.w3") * d2, "swiglu backward: E[g_h^2] E[b^2] E[silu'(a)^2]")
        return (_linear_back_factor(src, f"{p}.w1") * src.ms(f"{p}.w1", "backward")
                + _linear_back_factor(src, f"{p}.w3") * src.ms(f"{p}.w3", "backward"))
    src.put(f"{p}.w1", "backward", g_h * d2, f"{act.name} backward: E[g_h^2] E[{act.name}'(a)^2]")
    return _linear_back_factor(src, f"{p}.w1") * src.ms(f"{p}.w1", "backward")


def _ce_validity(src: _Source, logit_var: float) -> tuple[bool, str]:
    """Whether the measured softmax moments keep the cross-entropy rule's premises (module doc)."""
    if src.softmax is None:
        return True, ""
    V = src.config.vocab_size
    s2_m, py_m = src.softmax
    s2 = _s2_at(round(math.sqrt(max(logit_var, 0.0)), 6), V)
    assumed, actual = s2 - 2.0 / V + 1.0, s2_m - 2.0 * py_m + 1.0
    tol = 0.05 if src.mode == "local" else 0.10
    if not (math.isfinite(actual) and math.isfinite(assumed)):
        return False, "the softmax of the logits is not finite"
    if abs(actual / assumed - 1.0) <= tol:
        return True, ""
    # name the premise(s) behind the gap, the larger first (a term under a quarter of the other is left out)
    terms = [(abs(s2_m - s2), f"E[sum p^2] = {s2_m:.3g} where iid logits of the measured variance give {s2:.3g} "
                              f"({'a more peaked' if s2_m > s2 else 'a flatter'} softmax)"),
             (2.0 * abs(py_m - 1.0 / V), f"E[p_y] = {py_m:.3g} where targets independent of p give 1/V = {1.0 / V:.3g} "
                                         f"({'the model predicts its targets' if py_m > 1.0 / V else 'the targets get less than a uniform share'})")]
    terms.sort(key=lambda t: -t[0])
    named = [text for size, text in terms if size >= 0.25 * terms[0][0]]
    return False, ("the rule assumes a near-uniform softmax independent of the targets (as at init); measured "
                   + " and ".join(named) + f", so E[sum_c (p_c - y_c)^2] is {actual / assumed:.3g}x the rule's")


def _backward(src: _Source) -> None:
    """The backward rules: cross-entropy at the logits, then one rule per step of the block plan in reverse."""
    plan, V = src.plan, src.config.vocab_size
    head = plan.head
    if src.N > 0:
        n_tokens = src.N  # the positions of one loss, also when the stats pool several batches
    else:
        n_tokens = src.stats.tensors[(head, "forward")].n_total / V
    logit_var = src.var(head)
    valid, why = _ce_validity(src, logit_var)
    src.put(head, "backward", ce_grad_mean_square(logit_var, V, n_tokens),
            "cross-entropy: (E[sum p^2] - 2/V + 1)/(V N^2)", mean=0.0, valid=valid, why=why)
    g_head_in = _linear_back_factor(src, head) * src.ms(head, "backward")
    last = plan.blocks[-1].output
    if plan.final_norm is not None and src.has(plan.final_norm):
        fn = plan.final_norm
        src.put(fn, "backward", g_head_in, "linear backward: d_out E[w^2] E[g_y^2]")
        src.put(last, "backward", _norm_back(src, fn, src.ms(fn, "backward"), src.ms(last), last, src.var(last)),
                f"{_norm_word(src)} backward")
    else:
        src.put(last, "backward", g_head_in, "linear backward: d_out E[w^2] E[g_y^2]")
    walk = _BackWalk(src)
    for block in reversed(plan.blocks):
        for step in reversed(block.steps):
            walk.finish(block, step.writes)
            _BACKWARD[step.kind](walk, block, step)
    if plan.positions is None:
        walk.finish(None, (plan.embedding,))
        return
    walk.finish(None, (plan.input,))  # the sum passes its gradient to both tables' outputs
    src.put(plan.embedding, "backward", src.ms(plan.input, "backward"), "g_in (token + position embeddings)")
    # the position rows are one (T, d) tensor broadcast over the batch: its gradient sums the batch's B = N/T
    # sequences, whose gradients are independent at init (different targets)
    batch = src.N / src.T if src.N > 0 else 1.0
    src.put(plan.positions, "backward", batch * src.ms(plan.input, "backward"),
            "position embedding: B E[g_in^2] (summed over the batch's B sequences)",
            valid=src.mode == "global", why="" if src.mode == "global" else
            "local mode does not know how many sequences the measured gradient summed")


class _BackWalk:
    """The backward rules walk the plan's steps in reverse. Each step hands the tensors it read a
    contribution to their gradient: (value, label, rule). A value is a number, or a tensor name
    whose gradient (measured in local mode, predicted in global) it is, read when the contributions
    are summed. A tensor's gradient is put once every step that reads it has contributed, i.e. when
    the walk reaches the step that wrote it: alone, a contribution keeps its own rule; several
    (a residual point: the add passes the gradient through, the branch or its norm adds its input
    gradient) make "residual backward: a + b" of their labels."""

    def __init__(self, src: _Source):
        self.src = src
        self.parts: dict[str, list[tuple[float | str, str, str]]] = {}
        self.sums: dict[str, float] = {}  # gradients of residual sums no module outputs

    def give(self, name: str, value: float | str, label: str, rule: str = "") -> None:
        self.parts.setdefault(name, []).append((value, label, rule))

    def grad(self, name: str) -> float:
        return self.sums[name] if tinylm.plan.is_sum(name) else self.src.ms(name, "backward")

    def finish(self, block: tinylm.plan.BlockPlan | None, names: tuple[str, ...]) -> None:
        src = self.src
        got = [n for n in names if n in self.parts]
        assert len(got) <= 1, f"{names}: one tensor, read under one name"
        for name in got:
            parts = self.parts.pop(name)
            values = [src.ms(v, "backward") if isinstance(v, str) else v for v, _, _ in parts]
            total = values[0] if len(values) == 1 else sum(values[1:], values[0])
            if tinylm.plan.is_sum(name):
                self.sums[name] = total
            else:
                rule = parts[0][2] if len(parts) == 1 else "residual backward: " + " + ".join(p[1] for p in parts)
                src.put(name, "backward", total, rule)
        primary = names[-1]  # a step that writes two names: its module's output is the residual point's alias
        for alias in names[:-1]:
            if block is not None and primary == block.output:
                rule = "block output"
            else:
                rule = f"{alias.rsplit('.', 1)[-1]} output = {primary.rsplit('.', 1)[-1]}"
            src.put(alias, "backward", src.ms(primary, "backward"), rule)


def _norm_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    src, x = walk.src, step.reads[0]
    g = _norm_back(src, step.module, src.ms(step.writes[-1], "backward"), src.fwd_ms(x), 
                   None if tinylm.plan.is_sum(x) else x, x_var=src.fwd_var(x))
    walk.give(x, g, f"{_norm_word(src)} backward")


def _branch_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """A branch's backward starts from the gradient at its output (local mode: as measured there, which
    inverted dropout scales against the stream's) and hands its input the gradient it passes back."""
    src = walk.src
    back, what = (_attention_back, "attention") if step.kind == "attention" else (_ffn_back, "ffn")
    g_in = back(src, step.module, src.ms(step.output, "backward"))
    walk.give(step.reads[0], g_in, f"{what} input gradient", "linear backward into the norm output")


def _add_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """An add passes its output's gradient to both terms. Where the output is a sum no module
    outputs (post-norm), the branch gets the gradient through the norm that reads the sum, and
    the stream the branch's gradient (equal to the sum's; measured in local mode)."""
    stream, branch = step.reads
    what = "attention" if step.branch == "attn" else "ffn"
    out = step.output
    if tinylm.plan.is_sum(out):
        norm = next(s.module for s in block.steps if s.kind == "norm" and s.reads == (out,))
        walk.give(stream, branch, "g_sum")
        walk.give(branch, walk.grad(out), "g_sum", f"post-norm: {_norm_word(walk.src)} backward of {norm.rsplit('.', 1)[-1]}")
    else:
        walk.give(stream, out, "g_out" if out == block.output else "g_mid")
        walk.give(branch, out, "", f"{what} branch gradient = stream gradient")


_BACKWARD = {"norm": _norm_step_back, "attention": _branch_step_back, "ffn": _branch_step_back, "add": _add_step_back}


def independent_predictions(model: nn.Module, mode: str, stats: ProbeStats | None, *, seq_len: int,
                            tokens: float, scheme: str | None, softmax: tuple[float, float] | None
                            ) -> dict[tuple[str, str], Prediction]:
    """Every prediction the independent-token rules make for a tinylm model, validity marked
    (arguments as :func:`diagnostics.theory.predict`, already checked there)."""
    src = _Source(model, mode, stats, int(seq_len), float(tokens or 0.0), scheme, softmax)
    with torch.no_grad():
        try:
            _forward(src)
        except KeyError:
            pass  # local mode on a partial probe: predict what the measured inputs allow
        try:
            _backward(src)
        except KeyError:
            pass
    return _mark_validity(src.out, src.plan, mode)


_ATTN_INTERNAL = ("attn.probs", "attn.scores", "attn.q_proj", "attn.k_proj", "attn.v_proj")


def _mark_validity(out: dict[tuple[str, str], Prediction], plan: tinylm.plan.ModelPlan, mode: str
                   ) -> dict[tuple[str, str], Prediction]:
    """Flag the backward predictions whose independence assumptions fail (see the module doc).

    * Inside attention (probs, scores, q, k, v gradients) the rules need independent
      tokens forward (block 0) and independent gradients backward (the last block, below
      which every attention layer sums gradients over positions): valid only when L = 1.
    * Global backward below the final norm divides by the stream variance the
      independent-token theory underestimates beyond block 0: valid only when L = 1.
    * No norm: the FFN reads the raw stream, whose scale varies over tokens, so the activation
      rules (local), the FFN products and block outputs (global) and
      every global forward prediction beyond block 0 are outside validity.
    * Any prediction whose variance (mean square - mean^2) is not positive: there is
      nothing to compare the measured variance with.
    """
    num_layers, norm = len(plan.blocks), plan.config.norm
    block_outputs = {b.output for b in plan.blocks}
    marked = {}
    for (name, direction), p in out.items():
        p = no_variance_left(p)
        blk = tinylm.plan.block_index(name)
        if norm == "none" and p.valid:
            unnormalised = "without a norm the FFN reads the raw stream, whose scale varies from token to token"
            if name.endswith(("ffn.hidden", "ffn.w1", "ffn.w3")) and (direction == "backward" or name.endswith("hidden")) \
                    and mode == "local":
                p = Prediction(p.mean_square, p.mean, False, unnormalised + ": the activation's Gaussian moments do not apply",
                               p.rule)
            elif mode == "global" and direction == "forward" and (
                    (num_layers > 1 and ((blk is not None and blk != 0) or name == plan.head))
                    or name.endswith(("ffn.hidden", "ffn.w2", "ffn")) or name in block_outputs):
                p = Prediction(p.mean_square, p.mean, False, unnormalised + " and tokens correlate beyond block 0",
                               p.rule)
        if direction == "backward" and p.valid:
            if num_layers > 1 and name.endswith(_ATTN_INTERNAL):
                p = Prediction(p.mean_square, p.mean, False,
                               "gradients inside attention assume independent tokens forward and backward "
                               "(true only for a single block)", p.rule)
            elif mode == "global" and num_layers > 1 and name not in (plan.head, plan.final_norm):
                p = Prediction(p.mean_square, p.mean, False,
                               "the gradient passes the stream's norms, whose input variance the independent-token "
                               "theory underestimates beyond block 0", p.rule)
        marked[(name, direction)] = p
    return marked
