"""What every statistic the probe takes means, in plain torch: the reference the other reducers are held to.

:func:`diagnostics.measure.reducer.reduce` returns these numbers; on a CPU it computes them with
the numba reducer (:mod:`.numba_reducer`), elsewhere with the compiled reducer (:mod:`.compiled`,
these functions written for ``torch.compile``) or with the functions below. Everything is in
float64 (fp16, bf16 and float32 convert to it exactly).

* :func:`moments` — the :data:`FIELDS` vector of the measured entries of a tensor;
* :func:`panel` — the :data:`ATTN_FIELDS` vector of attention probabilities, row by row;
* :func:`row_mean_squares` — mean(x^2) over the last dimension;
* :func:`cosines` — per sequence, the mean cosine similarity between its different rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FIELDS", "ATTN_FIELDS", "SATURATED_PROB", "moments", "moments_each", "panel", "row_mean_squares", "cosines",
           "causal_mask"]

#: Layout of a moment vector: measured entries, finite ones, their mean and M2 = sum (x - mean)^2,
#: max |x| over the finite ones; counts of exact zeros, fp16 underflow (nonzero |x| < 2^-14) and
#: overflow (finite |x| >= 2^16), bf16 underflow (nonzero |x| < 2^-126) and overflow (finite |x| >= 2^127).
FIELDS = ("n_total", "count", "mean", "m2", "max_abs", "n_zero",
          "n_fp16_under", "n_fp16_over", "n_bf16_under", "n_bf16_over")
#: Layout of an attention panel: rows, mean and M2 of the rows' entropies, the smallest entropy
#: of a row t >= 1, rows t >= 1, rows t >= 1 whose largest probability exceeds SATURATED_PROB.
ATTN_FIELDS = ("rows", "entropy_mean", "entropy_m2", "entropy_min", "rows_after_first", "rows_saturated")
SATURATED_PROB = 0.99


def causal_mask(T: int, device: torch.device | str = "cpu") -> Tensor:
    """(T, T) bool, True on and below the diagonal: the entries causal attention measures."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def moments(x: Tensor, measured: Tensor | None = None) -> Tensor:
    """The FIELDS vector (float64) of the entries of ``x`` where ``measured`` (broadcast to x) is True."""
    return moments_each(x[None], None if measured is None else measured.expand_as(x)[None])[0]


def moments_each(x: Tensor, measured: Tensor | None = None) -> Tensor:
    """(G, 10): the FIELDS vector of each x[g] (the entries where ``measured``, broadcast to x, is
    True), every figure reduced over all dimensions but the first: the same ops for any G."""
    x = x.detach().double()
    m = torch.ones_like(x, dtype=torch.bool) if measured is None else measured.expand_as(x)
    x, m = x.reshape(x.shape[0], -1), m.reshape(x.shape[0], -1)
    finite = m & torch.isfinite(x)
    a = torch.where(finite, x.abs(), 0.0)
    count = finite.sum(1)
    mean = torch.where(finite, x, 0.0).sum(1) / count.clamp(min=1)
    m2 = torch.where(finite, x - mean[:, None], 0.0).square().sum(1)
    nonzero = m & (x != 0)  # NaN is nonzero
    return torch.stack([
        m.sum(1), count, mean, m2, a.amax(1) if x.shape[1] else a.sum(1),
        (m & (x == 0)).sum(1),
        (nonzero & (x.abs() < 2.0**-14)).sum(1), (a >= 2.0**16).sum(1),
        (nonzero & (x.abs() < 2.0**-126)).sum(1), (a >= 2.0**127).sum(1),
    ], 1).double()


def panel(p: Tensor, causal: bool = True) -> Tensor:
    """The ATTN_FIELDS vector of probabilities ``p`` (..., T, S), each row summing to 1.

    Row t's entropy is H_t = -sum_j p_tj ln p_tj (0 ln 0 = 0); ``causal``: entries above the
    diagonal are taken to be 0, whatever they hold. Row 0 of causal attention has one key and is always
    saturated, so the minimum and the saturated rows are over rows t >= 1 only."""
    p = p.detach()
    p = p.double() if p.dtype == torch.float64 else p.float()  # saturation is judged in p's precision
    if causal:
        p = torch.where(causal_mask(p.shape[-1], p.device), p, 0.0)
    h = torch.special.entr(p.double()).sum(-1)  # (..., T)
    later, top = h[..., 1:], p[..., 1:, :].amax(-1)  # rows t >= 1
    mean = h.mean() if h.numel() else h.new_zeros(())
    lowest = later.amin() if later.numel() else h.new_tensor(float("inf"))
    return torch.stack([h.new_tensor(float(h.numel())), mean, (h - mean).square().sum(), lowest,
                        h.new_tensor(float(later.numel())), (top > SATURATED_PROB).sum().double()])


def row_mean_squares(x: Tensor) -> Tensor:
    """mean(x^2) over the last dimension, summed in float64; float32 (float64 for float64 ``x``)."""
    ms = x.detach().double().square().mean(-1)
    return ms if x.dtype == torch.float64 else ms.float()


def cosines(x: Tensor) -> Tensor:
    """The FIELDS vector of each sequence's mean cosine between its different rows.

    For a sequence x (T, d) of unit vectors u_t = x_t / |x_t| (a zero row: u_t = 0),
    |sum_t u_t|^2 = T + sum_{s != t} cos(x_s, x_t), so the mean over the T (T - 1) ordered pairs
    is (|sum_t u_t|^2 - T) / (T (T - 1)). ``x`` (..., T, d): one value per leading index; no values
    (a vector of zeros) when T < 2."""
    x = x.detach().double()
    if x.dim() < 2 or x.shape[-2] < 2:
        return moments(x.new_zeros(0))
    T = x.shape[-2]
    u = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    s = u.sum(-2)  # (..., d)
    return moments(((s * s).sum(-1) - T) / (T * (T - 1)))
