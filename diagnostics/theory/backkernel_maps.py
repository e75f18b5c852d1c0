"""The maps of the backward token-kernel theory: how a norm, an FFN activation and a causal attention
head carry the gradient's kernel G_st = E[g_s . g_t]/d (T x T) back from a module's output to its
input, given the forward kernel K its input had, in the large-width limit at init.

* :func:`norm_backward`: RMSNorm, E[g^2] G_st / sqrt((K_ss+eps)(K_tt+eps)) c_st, c_st the
  finite-width factor of the projection and of the chi-square token norms;
  :func:`layer_norm_backward`: LayerNorm, the rank d-2 projection with the chi-square fluctuation of
  the token's variance.
* :func:`dact_cross_moment` (:func:`dsilu_cross_moment`): E[f'(a_s) f'(a_t)] for a zero-mean Gaussian
  a of covariance Ka (2-D Gauss-Hermite quadrature; ReLU in closed form).
* :func:`attention_backward`: one causal head's value, query and key gradient kernels and the mean
  squares of the probabilities' and scores' gradients, over the forward walk's attention draws
  (:func:`.tokenkernel_maps.attention_samples`).

The theory these maps make (every rule, its validity) and the walk of the block plan that applies
them: :mod:`.backkernel`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import tinylm

from .gaussian import ACTIVATIONS, layernorm_factors
from .tokenkernel_maps import _act_pair, _rope_tables, _sqrt_factor, attention_samples

__all__ = ["norm_backward", "layer_norm_backward", "dact_cross_moment", "dsilu_cross_moment", "attention_backward"]

#: Monte Carlo draws of (g_o, v) per draw of (q, k), for the query and key gradients
_INNER = 4


def norm_backward(G: np.ndarray, K: np.ndarray, gain2: float, eps: float, d: int) -> np.ndarray:
    """RMSNorm's backward kernel map (module doc): E[g^2] G_st / sqrt((K_ss+eps)(K_tt+eps)) c_st."""
    diag = np.diag(K)
    r = 1.0 / np.sqrt(diag + eps)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = 1.0 / np.sqrt(np.clip(diag, 1e-300, None))
        rho2 = np.clip((K * s[:, None] * s[None, :]) ** 2, 0.0, 1.0)
    c = (1.0 - (2.0 - rho2) / d) * (1.0 + (3.0 + rho2) / (2.0 * d))
    np.fill_diagonal(c, (d - 1.0) / (d - 2.0) if d > 2 else 1.0)
    return gain2 * G * r[:, None] * r[None, :] * c


def layer_norm_backward(G: np.ndarray, K: np.ndarray, gain2: float, eps: float, d: int) -> np.ndarray:
    """LayerNorm's backward kernel map (module doc).

    y = gain * u + bias, u = P x / sigma, P = I - 1 1^T/d, sigma^2 = v + eps (v: the token's variance
    over its d elements), so g_x = (P - rho uh uh^T) (gain * g_y) / sigma with uh = u/|u| (orthogonal
    to 1) and rho = v/(v + eps). For a gradient w = gain * g_y isotropic over the d directions with
    E[w_s . w_t]/d = E[gain^2] G_st:

        E[g_x,s . g_x,t]/d
            = E[gain^2] G_st E[(d - 1 - rho_s - rho_t + rho_s rho_t (uh_s . uh_t)^2) / (d sigma_s sigma_t)]

    (a rank d-2 projection at eps = 0: on the diagonal the trace is d - 2). Off the diagonal
    (uh_s . uh_t)^2 ~ r_st^2 (r_st = K_st/sqrt(K_ss K_tt), the centred tokens' correlation),
    rho_s ~ m K_ss/(m K_ss + eps) with m = (d-1)/d (the centred kernel is m K), and
    E[1/(sigma_s sigma_t)] = (1 + (3 + r_st^2)/(2(d-1))) / sqrt((m K_ss + eps)(m K_tt + eps)): d v/K_ss is
    chi-square with d - 1 degrees of freedom, whose fluctuation enters as RMSNorm's does with d - 1 for d.
    On the diagonal the exact expectation over that law, :func:`.gaussian.layernorm_factors` (the
    independent-token rule): E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))]."""
    diag = np.diag(K)
    m = (d - 1.0) / d
    sig2 = m * diag + eps
    h = 1.0 / np.sqrt(sig2)
    rho = np.divide(m * diag, sig2, out=np.zeros_like(sig2), where=sig2 > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = 1.0 / np.sqrt(np.clip(diag, 1e-300, None))
        r2 = np.clip((K * s[:, None] * s[None, :]) ** 2, 0.0, 1.0)
    trace = (d - 1.0 - rho[:, None] - rho[None, :] + rho[:, None] * rho[None, :] * r2) / d
    fluct = 1.0 + (3.0 + r2) / (2.0 * (d - 1.0)) if d > 1 else np.ones_like(r2)
    c = trace * fluct * h[:, None] * h[None, :]
    _, back = layernorm_factors(diag, d, eps)
    np.fill_diagonal(c, back)
    return gain2 * G * c


def _relu_dpair(rho: np.ndarray) -> np.ndarray:
    """E[relu'(a) relu'(b)] = P(a > 0, b > 0) = 1/4 + arcsin(rho)/(2 pi) (Sheppard), any scales."""
    return 0.25 + np.arcsin(np.clip(rho, -1.0, 1.0)) / (2 * math.pi)


#: Chebyshev degree in rho of the fast path of :func:`dact_cross_moment`
_CHEB_DEGREE = 64


def dact_cross_moment(Ka: np.ndarray, act: str = "silu", nodes: int = 32) -> np.ndarray:
    """E[f'(a_s) f'(a_t)] for a zero-mean Gaussian vector a with covariance ``Ka`` (T x T), f the
    activation ``act`` (:data:`.gaussian.ACTIVATIONS`, with its derivative ``df``).

    ReLU: in closed form, P(a_s > 0, a_t > 0) = 1/4 + arcsin(rho_st)/(2 pi) (:func:`_relu_dpair`).
    Smooth activations (SiLU, GELU exact and tanh): 2-D Gauss-Hermite quadrature
    (a_s = sigma_s z1, a_t = sigma_t (rho z1 + sqrt(1-rho^2) z2)). A normed input (every sigma_s within
    1e-3 of the largest, T > 16) takes a fast path, as the forward's :func:`.tokenkernel_maps.act_cross_moment`
    does: the quadrature at the Chebyshev nodes of degree 64 in rho for at most three sigmas,
    interpolated in rho and then (Lagrange) in sigma; ``tests/test_backward_kernel.py`` holds it to the
    pairwise quadrature."""
    df = ACTIVATIONS[act].df
    T = Ka.shape[0]
    sd = np.sqrt(np.clip(np.diag(Ka), 0.0, None))
    iu, ju = np.triu_indices(T)
    den = sd[iu] * sd[ju]
    rho = np.divide(Ka[iu, ju], den, out=np.zeros_like(den), where=den > 0).clip(-1.0, 1.0)
    if act == "relu":
        out = _relu_dpair(rho)
    elif T > 16 and sd.max() > 0 and np.ptp(sd) <= 1e-3 * sd.max():
        cheb = np.polynomial.chebyshev
        lo, hi = float(sd.min()), float(sd.max())
        s_nodes = np.array([lo, 0.5 * (lo + hi), hi]) if hi - lo > 1e-9 * hi else np.array([0.5 * (lo + hi)])
        x = cheb.chebpts1(_CHEB_DEGREE + 1)
        vals = _act_pair(df, np.repeat(s_nodes, x.size), np.repeat(s_nodes, x.size), np.tile(x, s_nodes.size), nodes)
        s_pair = 0.5 * (sd[iu] + sd[ju])
        out = np.zeros(iu.size)
        for k, s_k in enumerate(s_nodes):
            coef = cheb.chebfit(x, vals[k * x.size:(k + 1) * x.size], _CHEB_DEGREE)
            basis = np.ones(iu.size)
            for m, s_m in enumerate(s_nodes):
                if m != k:
                    basis *= (s_pair - s_m) / (s_k - s_m)
            out += basis * cheb.chebval(rho, coef)
    else:
        out = _act_pair(df, sd[iu], sd[ju], rho, nodes)
    M = np.empty((T, T))
    M[iu, ju] = out
    M[ju, iu] = out
    return M


def dsilu_cross_moment(Ka: np.ndarray, nodes: int = 32) -> np.ndarray:
    """E[silu'(a_s) silu'(a_t)] for a zero-mean Gaussian vector a with covariance ``Ka``: :func:`dact_cross_moment`."""
    return dact_cross_moment(Ka, "silu", nodes)


def attention_backward(K_in: np.ndarray, G_o: np.ndarray, fq: float, fk: float, fv: float, d_k: int, *,
                       rope_theta: float | None, draws: int, seed: int, inner: int = _INNER, bq2: float = 0.0,
                       bk2: float = 0.0, bv2: float = 0.0) -> dict[str, np.ndarray | float]:
    """Backward kernels of one causal attention head given the kernel ``K_in`` of its input and
    the kernel ``G_o`` of the gradient at its output (per element, both T x T).

    The (q, k) draws and patterns A are :func:`.tokenkernel_maps.attention_samples` with the same
    ``draws`` and ``seed`` as the forward walk. Returns "v", "q", "k": (T, T) kernels of the
    gradients at the head's values, queries and keys (before RoPE), per element; "probs_ms",
    "scores_ms": the mean square of the gradients at the probabilities and the scores over the
    causal entries.

    Biases (E[b^2] of q_proj's, k_proj's and v_proj's: ``bq2``, ``bk2``, ``bv2``), one vector shared by
    every position: q's and k's enter the (q, k) draws as in the forward walk; v's adds E[b_v^2] to
    E[v_j^2] in the probabilities' gradient g_o,i . v_j, and cancels in the scores' (v_j - sum_k A_ik v_k)
    and hence in q's and k's; k's cancels in q's gradient (the rows of g_S sum to 0) but q's does not
    in k's, which the draws carry.
    """
    T = K_in.shape[0]
    tri = T * (T + 1) / 2
    Kt = torch.from_numpy(0.5 * (K_in + K_in.T))
    Go = torch.from_numpy(0.5 * (G_o + G_o.T))
    g_scale = float(np.mean(np.diag(G_o)))
    if not (g_scale > 0 and math.isfinite(g_scale)):  # no gradient reaches the head (or it is not finite)
        zero = np.zeros((T, T)) * g_scale
        return {"v": zero, "q": zero.copy(), "k": zero.copy(), "probs_ms": 0.0 * g_scale, "scores_ms": 0.0 * g_scale}
    Rg = _sqrt_factor(G_o / g_scale)  # gradient draws at unit scale; rescaled at the end
    Rv = _sqrt_factor(K_in)
    cos, sin = _rope_tables(rope_theta, d_k, T) if rope_theta is not None else (None, None)
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    GV = torch.zeros(T, T, dtype=torch.float64)
    GQ = torch.zeros(T, T, dtype=torch.float64)
    GK = torch.zeros(T, T, dtype=torch.float64)
    s_ms = 0.0
    n = 0
    for Q, Kk, A in attention_samples(K_in, fq, fk, d_k, rope_theta=rope_theta, draws=draws, seed=seed,
                                      bq2=bq2, bk2=bk2):
        Q, Kk = Q.double(), Kk.double()
        b = A.shape[0]
        n += b
        GV += (A.transpose(-1, -2) @ Go @ A).sum(0)  # value path: A^T G_o A
        AK = A @ Kt  # (b, T, T): row i is (K a_i)^T
        aKa = (AK * A).sum(-1)  # (b, T): a_i^T K a_i
        # E[g_S,ij^2] / (d_k f_v G_o,ii) = A_ij^2 (K_jj - 2 (K a_i)_j + a_i^T K a_i)
        spread = torch.diagonal(Kt)[None, None, :] - 2.0 * AK + aKa[:, :, None]
        s_ms += float((torch.diagonal(Go)[None, :, None] * A * A * spread).sum())
        for _ in range(inner):
            g = Rg @ torch.randn(b, T, d_k, generator=gen, dtype=torch.float64)  # g_o at unit scale
            v = Rv @ torch.randn(b, T, d_k, generator=gen, dtype=torch.float64)  # v / sqrt(f_v)
            gP = g @ v.transpose(-1, -2)  # (b, T, T): g_o,i . v_j
            gS = A * (gP - (A * gP).sum(-1, keepdim=True))  # the softmax Jacobian
            gq = gS @ Kk  # (b, T, d_k): the rotated queries' gradient, in units of sqrt(G f_v f_k / d_k)
            gk = gS.transpose(-1, -2) @ Q  # the rotated keys', in units of sqrt(G f_v f_q / d_k)
            if cos is not None:  # back through RoPE: rotate by the opposite angle
                gq = tinylm.functional.apply_rope(gq, cos, -sin)
                gk = tinylm.functional.apply_rope(gk, cos, -sin)
            GQ += (gq @ gq.transpose(-1, -2)).sum(0)
            GK += (gk @ gk.transpose(-1, -2)).sum(0)
    # g_S = sqrt(G f_v) gS (g_o = sqrt(G) g, v = sqrt(f_v) v); g_q = g_S k / sqrt(d_k) with k = sqrt(f_k) Kk;
    # a kernel per element divides by d_k once more
    fac_q = g_scale * fv * fk / (d_k * d_k * inner * n)
    fac_k = g_scale * fv * fq / (d_k * d_k * inner * n)
    probs_ms = d_k * float((np.diag(G_o)[:, None] * np.tril(np.ones((T, T))) * (fv * np.diag(K_in) + bv2)[None, :]
                            ).sum()) / tri
    return {"v": (GV / n).numpy(), "q": (fac_q * GQ).numpy(), "k": (fac_k * GK).numpy(), "probs_ms": probs_ms,
            "scores_ms": d_k * fv * s_ms / (n * tri)}
