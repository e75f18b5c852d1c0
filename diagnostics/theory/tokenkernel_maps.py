"""The maps of the token-kernel theory: how a norm, a causal attention head and an FFN activation
carry a token kernel K_st = E[x_s . x_t]/d (T x T) forward, in the large-width limit at init.

* :func:`normalize`: RMSNorm, E[g^2] K_st / sqrt((K_ss + eps)(K_tt + eps));
  :func:`layer_normalize`: LayerNorm, E[g^2] (d-1)/d K_st r_s r_t + E[b^2] (r_s^2 = E[v/(v+eps)]/K^c_ss).
* :func:`attention_kernel`: one causal head's output kernel E[A Kv A^T], A = softmax(causal(q k^T /
  sqrt(d_k))), by Monte Carlo over Gaussian q, k (:func:`attention_samples`, RoPE exact) and in
  closed form over v.
* :func:`act_cross_moment` (:func:`silu_cross_moment`): E[f(a_s) f(a_t)] for a zero-mean Gaussian
  a of covariance Ka, f an activation of :data:`.gaussian.ACTIVATIONS` (2-D Gauss-Hermite
  quadrature; ReLU in closed form).
* :func:`mean_cosine`: mean_{s != t} K_st / sqrt(K_ss K_tt).

The theory these maps make, and the walk of the block plan that applies them: :mod:`.tokenkernel`.
The backward kernel (:mod:`.backkernel`) reads the same attention draws.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from functools import lru_cache

import numpy as np
import torch

import tinylm

from .gaussian import ACTIVATIONS, layernorm_factors

__all__ = ["normalize", "layer_normalize", "attention_kernel", "attention_samples", "act_cross_moment",
           "silu_cross_moment", "mean_cosine"]

#: Gauss-Hermite nodes per dimension of the activations' expectations, when not given
_QUAD_NODES = 32
#: rows per panel of the causal products A K A^T (:func:`_add_causal_sandwich`)
_PANEL = 64
#: threads over which :func:`_add_causal_sandwich` spreads its panels (each panel the same ops on any
#: thread, torch itself on one: the sums do not depend on it); set by the walk to the caller's count
WORKERS = ContextVar("tokenkernel_workers", default=1)


def normalize(K: np.ndarray, gain2: float, eps: float) -> np.ndarray:
    """RMSNorm's kernel map: E[g^2] K_st / sqrt((K_ss + eps)(K_tt + eps))."""
    r = 1.0 / np.sqrt(np.diag(K) + eps)
    return gain2 * K * r[:, None] * r[None, :]


def layer_normalize(K: np.ndarray, gain2: float, bias2: float, eps: float, d: int) -> np.ndarray:
    """LayerNorm's kernel map. Removing each token's mean over its d iid elements takes
    E[m_s m_t] = K_st / d from every entry: K^c = (d-1)/d K; then each token is scaled to the mean
    square E[v_s/(v_s + eps)] (:func:`diagnostics.theory.gaussian.layernorm_moments`, v_s ~ K_ss
    chi2_{d-1}/d), and the bias, one vector shared by every position, adds E[b^2] to every entry:
    K'_st = E[g^2] K^c_st r_s r_t + E[b^2], r_s = sqrt(E[v_s/(v_s+eps)] / K^c_ss)
    (~ 1/sqrt(K^c_ss + eps): the RMSNorm map of K^c)."""
    Kc = K * ((d - 1) / d)
    fwd, _ = layernorm_factors(np.diag(K), d, eps)
    dc = np.diag(Kc)
    r = np.sqrt(np.divide(fwd, dc, out=np.zeros_like(dc), where=dc > 0))
    return gain2 * Kc * r[:, None] * r[None, :] + bias2


def mean_cosine(K: np.ndarray) -> float:
    """mean_{s != t} K_st / sqrt(K_ss K_tt): the mean cosine between different tokens."""
    T = K.shape[0]
    if T < 2:
        return math.nan
    r = 1.0 / np.sqrt(np.clip(np.diag(K), 1e-300, None))
    C = K * r[:, None] * r[None, :]
    return float((C.sum() - np.trace(C)) / (T * (T - 1)))


def _psd_sqrt(K: np.ndarray) -> np.ndarray:
    """A matrix R with R R^T = K (symmetric eigendecomposition; tiny negative eigenvalues clipped)."""
    w, U = np.linalg.eigh(0.5 * (K + K.T))
    return U * np.sqrt(np.clip(w, 0.0, None))[None, :]


def _rope_tables(theta: float, d_k: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = tinylm.functional.rope_angles(theta, d_k, torch.arange(T))  # (T, d_k/2), float64
    return torch.cos(angles), torch.sin(angles)


def _sqrt_factor(K: np.ndarray) -> torch.Tensor:
    """A matrix R with R R^T = K: the Cholesky factor (lower triangular), or, for a singular K
    (e.g. identical tokens), the symmetric eigendecomposition with tiny negative eigenvalues clipped.
    A non-finite K (a stream beyond float64) gives NaN: every prediction downstream is then NaN."""
    if not np.all(np.isfinite(K)):
        return torch.full(K.shape, math.nan, dtype=torch.float64)
    Kt = torch.from_numpy(0.5 * (K + K.T))
    L, info = torch.linalg.cholesky_ex(Kt)
    if int(info) == 0 and bool(torch.isfinite(L).all()):
        return L
    return torch.from_numpy(_psd_sqrt(K))


def attention_samples(K_in: np.ndarray, fq: float, fk: float, d_k: int, *, rope_theta: float | None, draws: int,
                      seed: int, bq2: float = 0.0, bk2: float = 0.0):
    """The Monte Carlo draws of one causal attention head given its input kernel ``K_in``, in chunks:
    yields (Q, K, A), Q and K (b, T, d_k) with rows of covariance ``K_in`` (RoPE applied when
    ``rope_theta`` is given; the model's q is sqrt(fq) Q, its k sqrt(fk) K) and the attention
    patterns A = softmax(causal(sqrt(fq fk / d_k) Q K^T)) (b, T, T) in float64, rows summing to 1.
    ``bq2``, ``bk2``: E[b^2] of q_proj's and k_proj's biases, one Gaussian vector per draw added to
    every row (a bias is shared by all positions). Deterministic in ``seed``: :func:`attention_kernel`
    (forward) and the backward kernel (:mod:`.backkernel`) see the same patterns. Sampling precision: :func:`attention_kernel`."""
    T = K_in.shape[0]
    R = _sqrt_factor(K_in)  # (T, T), R R^T = K_in, float64
    # float32 unless the scores (~ sqrt(fq fk) K_tt) could overflow it (a stream exploding without a norm)
    sample = torch.float32 if math.sqrt(fq * fk) * float(np.abs(np.diag(K_in)).max()) < 1e15 else torch.float64
    Rs = R.to(sample)
    gen = torch.Generator().manual_seed(int(seed))
    causal = torch.zeros(T, T, dtype=sample).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    cos, sin = _rope_tables(rope_theta, d_k, T) if rope_theta is not None else (None, None)
    if cos is not None:
        cos, sin = cos.to(sample), sin.to(sample)
    scale = math.sqrt(fq * fk / d_k)  # scores = (sqrt(fq) Q)(sqrt(fk) K)^T / sqrt(d_k)
    chunk = max(1, min(draws, int(2**22 // (T * T))))
    done = 0
    while done < draws:
        b = min(chunk, draws - done)
        Q = Rs @ torch.randn(b, T, d_k, generator=gen, dtype=sample)  # (b, T, d_k): rows with covariance K_in
        Kk = Rs @ torch.randn(b, T, d_k, generator=gen, dtype=sample)
        if bq2 > 0 and fq > 0:  # in units of sqrt(fq): Q is scaled by it in the scores
            Q = Q + math.sqrt(bq2 / fq) * torch.randn(b, 1, d_k, generator=gen, dtype=sample)
        if bk2 > 0 and fk > 0:
            Kk = Kk + math.sqrt(bk2 / fk) * torch.randn(b, 1, d_k, generator=gen, dtype=sample)
        if cos is not None:
            Q, Kk = tinylm.functional.apply_rope(Q, cos, sin), tinylm.functional.apply_rope(Kk, cos, sin)
        S = torch.baddbmm(causal.expand(b, T, T), Q, Kk.transpose(-1, -2), alpha=scale)  # (b, T, T), -inf above
        A = torch.softmax(S, dim=-1).double()
        A /= A.sum(-1, keepdim=True)  # rows sum to 1 in float64
        yield Q, Kk, A
        done += b


def attention_kernel(K_in: np.ndarray, fq: float, fk: float, fv: float, d_k: int, *, rope_theta: float | None,
                     draws: int, seed: int, bq2: float = 0.0, bk2: float = 0.0) -> dict[str, np.ndarray | float]:
    """Kernel of one causal attention head's output given the kernel ``K_in`` of its input.

    The attention patterns A are sampled in float32 (q, k, scores, softmax: a Monte Carlo
    sample, whose float32 rounding, ~1e-7 relative, is far below its sampling error; float64
    when the scores could leave float32's range); each row of A is then renormalised in
    float64 and the products A K_in A^T are float64, so the identities (identical tokens pass
    unchanged; row 0 attends to itself) hold to float64 rounding.

    Args:
        K_in: (T, T) kernel of the attention's input (the normed stream for pre-norm).
        fq, fk, fv: d_in E[w^2] of q_proj, k_proj, v_proj (so Kq = fq K_in, ...).
        d_k: head dimension. rope_theta: RoPE base, or None for no RoPE.
        draws: Monte Carlo draws of (Q, K) for one head. seed: seeds the draws (a torch.Generator).
        bq2, bk2: E[b^2] of q_proj's and k_proj's biases: each draw adds one Gaussian vector of that
            variance to every row of Q (K), before RoPE (a bias is shared by all positions).
    Returns:
        "heads": (T, T) E[A Kv A^T];  "s2": (T,) E[sum_j a_tj^2] per query row;
        "scores_ms": mean square of the scores over the causal entries (exact, not sampled).
    """
    T = K_in.shape[0]
    Kt = torch.from_numpy(0.5 * (K_in + K_in.T))  # float64
    acc = torch.zeros(T, T, dtype=torch.float64)  # sum over draws of A K A^T, lower block triangle only
    s2 = torch.zeros(T, dtype=torch.float64)
    for _, _, A in attention_samples(K_in, fq, fk, d_k, rope_theta=rope_theta, draws=draws, seed=seed,
                                  bq2=bq2, bk2=bk2):
        s2 += (A * A).sum(-1).sum(0)
        _add_causal_sandwich(acc, A, Kt)
    acc = torch.tril(acc) + torch.tril(acc, -1).T  # the upper triangle from the lower (A K A^T is symmetric)
    diag = np.diag(K_in)
    scores_ms = float((np.tril(np.outer(fq * diag + bq2, fk * diag + bk2)).sum()) / (T * (T + 1) / 2))
    heads = fv * (acc / draws).numpy()
    return {"heads": heads, "s2": (s2 / draws).numpy(), "scores_ms": scores_ms}


def _add_causal_sandwich(acc: torch.Tensor, A: torch.Tensor, K: torch.Tensor) -> None:
    """acc[s, t] += sum_b (A_b K A_b^T)[s, t] for t < the end of s's panel of ``_PANEL`` rows
    (the lower block triangle; the rest of acc is left alone), for causal (lower-triangular) A_b.

    The causal structure cuts the work: (A K A^T)_st = sum_{k <= t} (A K)_sk A_tk, and
    (A K)_sk = sum_{j <= s} A_sj K_jk, so for the rows s of a panel ending at row ``hi`` and every
    t < hi only the leading hi x hi blocks of A and K enter. Two products of (p, hi) by (hi, hi)
    per panel: about T^3 / 3 multiply-adds each over all panels (the dense A K A^T costs 2 T^3),
    and the same sums as the dense product up to float64 rounding.

    The panels run on :data:`WORKERS` threads (the caller's torch thread count; the matrix
    products release the interpreter), each the same ops whichever thread runs it: the same bits.

    Shapes: acc (T, T) float64; A (b, T, T) float64, zero above the diagonal; K (T, T) float64.
    """
    T = A.shape[-1]

    def panel(lo: int) -> None:
        hi = min(T, lo + _PANEL)
        AK = A[:, lo:hi, :hi] @ K[:hi, :hi]  # (b, p, hi): (A K)[rows, :hi]
        acc[lo:hi, :hi] += (AK @ A[:, :hi, :hi].transpose(-1, -2)).sum(0)  # (p, hi): (A K A^T)[rows, :hi]
    starts = range(0, T, _PANEL)
    workers = min(WORKERS.get(), len(starts))
    if workers <= 1:
        for lo in starts:
            panel(lo)
        return
    with ThreadPoolExecutor(workers) as pool:  # each panel writes its own rows; the largest first
        list(pool.map(panel, reversed(starts)))


@lru_cache(maxsize=8)
def _gauss_hermite(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights (summing to 1) of probabilists' Gauss-Hermite quadrature: E[f(z)], z ~ N(0, 1)."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    x.flags.writeable = False
    w = w / w.sum()
    w.flags.writeable = False
    return x, w


def _act_pair(f, s_i: np.ndarray, s_j: np.ndarray, rho: np.ndarray, nodes: int) -> np.ndarray:
    """E[f(a) f(b)] for a = s_i z1, b = s_j (rho z1 + sqrt(1 - rho^2) z2), elementwise over pairs."""
    x, w = _gauss_hermite(nodes)
    out = np.empty(rho.size)
    step = max(1, 2**20 // (nodes * nodes))
    for lo in range(0, rho.size, step):
        sl = slice(lo, lo + step)
        r = rho[sl]
        fa = f(s_i[sl][None, :] * x[:, None])  # (n1, P): f(a) at node z1
        zt = r[None, None, :] * x[:, None, None] + np.sqrt(1.0 - r * r)[None, None, :] * x[None, :, None]  # (n1, n2, P)
        fb = f(s_j[sl][None, None, :] * zt)
        out[sl] = np.einsum("i,j,ip,ijp->p", w, w, fa, fb)
    return out


def _act_cheb(f, s_nodes: np.ndarray, nodes: int) -> np.ndarray:
    """Chebyshev coefficients (n + 1, len(s_nodes)) in rho on [-1, 1] of
    g(s, rho) = E[f(s z1) f(s (rho z1 + sqrt(1 - rho^2) z2))], one column per s (f smooth: SiLU, GELU).

    Interpolated at degree 32, 64 or 128, the first whose last four coefficients fall below
    1e-14 of the largest (g is analytic in rho: its coefficients decay geometrically, to 1e-14
    by degree ~20 at s = 0.75 and ~50 at s = 1.5), then trimmed of trailing coefficients below
    1e-15 of the sum of their magnitudes: the error stays below 1e-12 relative.
    """
    cheb = np.polynomial.chebyshev
    k = s_nodes.size
    for deg in (32, 64, 128):
        x = cheb.chebpts1(deg + 1)
        vals = _act_pair(f, np.repeat(s_nodes, x.size), np.repeat(s_nodes, x.size), np.tile(x, k), nodes)
        coef = cheb.chebvander(x, deg).T @ vals.reshape(k, deg + 1).T  # (deg + 1, k), as chebinterpolate
        coef[0] /= deg + 1
        coef[1:] /= 0.5 * (deg + 1)
        mag = np.abs(coef)
        if np.all(mag[-4:].max(0) <= 1e-14 * mag.max(0)):
            break
    keep = np.nonzero(np.any(mag > 1e-15 * mag.sum(0), axis=1))[0]
    return coef[: int(keep.max()) + 1 if keep.size else 1]


def _relu_pair(s_i: np.ndarray, s_j: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """E[relu(a) relu(b)] in closed form (the arc-cosine kernel of degree 1):
    s_i s_j (sqrt(1 - rho^2) + (pi - arccos rho) rho) / (2 pi)."""
    r = np.clip(rho, -1.0, 1.0)
    return s_i * s_j * (np.sqrt(1.0 - r * r) + (math.pi - np.arccos(r)) * r) / (2 * math.pi)


def act_cross_moment(Ka: np.ndarray, act: str = "silu", nodes: int = _QUAD_NODES) -> np.ndarray:
    """E[f(a_s) f(a_t)] for a zero-mean Gaussian vector a with covariance ``Ka`` (T x T), f the
    activation ``act`` (:data:`diagnostics.theory.gaussian.ACTIVATIONS`).

    ReLU: the closed form of :func:`_relu_pair`. Smooth activations (SiLU, GELU exact and tanh):
    2-D Gauss-Hermite quadrature (``nodes`` per dimension) per pair: a_s = sigma_s z1,
    a_t = sigma_t (rho z1 + sqrt(1 - rho^2) z2) with z1, z2 iid N(0, 1). When the sigma_t
    agree to 1e-3 (a normed input, where eps makes them differ by ~eps/K_tt), the
    expectation is taken as g((sigma_s + sigma_t)/2, rho), g(s, rho) the equal-sigma
    expectation (off by O((sigma_s - sigma_t)^2), below 1e-7 relative), computed as a
    Chebyshev series in rho (:func:`_act_cheb`, error below 1e-12) at 3 values of s and
    interpolated in s (one value when the sigma_t agree to 1e-9); evaluated on the upper
    triangle only: a cost of O(T^2) cheap operations.
    """
    f = ACTIVATIONS[act].f
    sd = np.sqrt(np.clip(np.diag(Ka), 0.0, None))
    T = Ka.shape[0]
    iu, ju = np.triu_indices(T)
    den = sd[iu] * sd[ju]
    if act == "relu":
        rho = np.divide(Ka[iu, ju], den, out=np.zeros_like(den), where=den > 0)
        out = _relu_pair(sd[iu], sd[ju], rho)
    elif T > 16 and sd.max() > 0 and np.ptp(sd) <= 1e-3 * sd.max():
        lo, hi = float(sd.min()), float(sd.max())
        s_nodes = np.array([lo, 0.5 * (lo + hi), hi]) if hi - lo > 1e-9 * hi else np.array([0.5 * (lo + hi)])
        s_pair = 0.5 * (sd[iu] + sd[ju])
        rho = np.clip(Ka[iu, ju] / den, -1.0, 1.0)
        coef = _act_cheb(f, s_nodes, nodes)
        g = np.polynomial.chebyshev.chebvander(rho, coef.shape[0] - 1) @ coef  # (P, k): g(s_k, rho_p)
        out = np.zeros(iu.size)
        for k, s_k in enumerate(s_nodes):  # Lagrange interpolation in s through the s nodes
            basis = np.ones(iu.size)
            for m, s_m in enumerate(s_nodes):
                if m != k:
                    basis *= (s_pair - s_m) / (s_k - s_m)
            out += basis * g[:, k]
    else:
        rho = np.divide(Ka[iu, ju], den, out=np.zeros_like(den), where=den > 0).clip(-1.0, 1.0)
        out = _act_pair(f, sd[iu], sd[ju], rho, nodes)
    M = np.empty((T, T))
    M[iu, ju] = out
    M[ju, iu] = out
    return M


def silu_cross_moment(Ka: np.ndarray, nodes: int = _QUAD_NODES) -> np.ndarray:
    """E[silu(a_s) silu(a_t)] for a zero-mean Gaussian vector a with covariance ``Ka``: :func:`act_cross_moment`."""
    return act_cross_moment(Ka, "silu", nodes)


def _act_mean(var: np.ndarray, act: str, nodes: int = _QUAD_NODES) -> np.ndarray:
    """E[f(a)] for a ~ N(0, var), per entry (ReLU: sqrt(var / (2 pi)); else Gauss-Hermite)."""
    sd = np.sqrt(np.clip(var, 0.0, None))
    if act == "relu":
        return sd / math.sqrt(2 * math.pi)
    x, w = _gauss_hermite(nodes)
    return ACTIVATIONS[act].f(sd[:, None] * x[None, :]) @ w
