"""Predicted training-loss increase of casting one GEMM: what its error costs the loss, not only how
large the error is.

SQNR says how much of a GEMM's output is lost; the loss may need that output a lot or not at all.
From the one forward and backward ``precision`` runs (g = dL/dy of the batch's mean loss L) each
GEMM's error is weighed by the loss's own sensitivity, in loss units:

fprop (y = x W^T, error e = y_q - y). The batch is B sequences, L = (1/B) sum_b l_b, and y_t of
sequence b reaches only l_b, so the first-order change of l_b is d_b = B sum_{t in b} g_t . e_t.
Training re-draws rounding noise each step and settles where the first-order effect of what it can
adjust vanishes; what remains, for noise and for a systematic loss alike (a flushed input: e = -y,
the layer's output gone), is the second-order term. Its Gauss-Newton estimate from the sequences'
own gradients (the empirical Fisher) is

    fisher(e) = 1/2 * (1/B) * sum_b d_b^2                                     (loss units)

For e = -y this is the layer's Taylor importance, fisher(y): the loss the layer's output carries.

dgrad and wgrad change no loss at the step; they change the update, and what a gradient G buys is
descent. Along an entry a step can gain G^2 / (2 F), F the curvature there (a Newton step; the plain
first-order view, every entry weighed 1, is wrong here: an outlier channel's gradient is large and
so is its curvature, so it buys no more than the others); arriving as G_q it gains G_q G / F to
first order. The share lost is

    lost(G_q, G) = clip(1 - sum G_q G / F / sum G^2 / F, 0, 1)

with F the factored empirical Fisher of the measured gradient (Adafactor's factoring of the second
moment: the entry's row mean square times its column's) for wgrad's dW (rows: output features,
columns: input features), and per input channel (column) for dgrad's dx, whose rows are tokens that
the upstream weight gradients sum over. Two regimes follow. Rounding to nearest leaves an error
uncorrelated with the rounded value (within a bin e = c - x, so E[x e] = -E[e^2]): a gradient
arrives shrunk by its relative noise power rho, and lost ~ rho (E5M2's 24.5 dB: 0.35%); the noise
besides is small beside the minibatch's own and is not priced. Where a group's inputs flush to zero
their columns arrive as 0 and their whole share is lost, whatever their size.

What the lost share costs is that share of what the gradient trains: wgrad trains the layer's
weight, whose output carries fisher(y); dgrad trains everything upstream through the layer's input
x, which carries fisher(x) = 1/2 (1/B) sum_b (B sum_{t in b} dx_t . x_t)^2. So

    fprop: fisher(e)      dgrad: lost(dx_q, dx) * fisher(x)      wgrad: lost(dW_q, dW) * fisher(y)

and a module's predicted increase is the sum over its three GEMMs. Assumptions, stated so the
measurement can contradict them: the second-order, Gauss-Newton view of the loss at the step
measured (a model at its initial weights predicting a whole run's cost, in rank if not in size);
a layer that loses its descent costs what its output carries; gradient noise free beside the
minibatch's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["fisher", "descent_lost", "gemm_loss_costs"]


def fisher(g: Tensor, e: Tensor, sequences: int) -> float:
    """1/2 (1/B) sum_b (B sum_{t in b} g_t . e_t)^2 for g, e (B*T, N) in token order, B = ``sequences``
    (g the gradient of the batch's mean loss)."""
    b = max(int(sequences), 1)
    per_token = (g * e).sum(1).double()  # float32 products, pairwise sums along the row
    if per_token.numel() % b:
        b = 1
    d = per_token.reshape(b, -1).sum(1) * b
    return float(0.5 * d.square().mean())


def descent_lost(q: Tensor, ref: Tensor, per_row: bool = True) -> float:
    """The share of ``ref``'s achievable descent lost when the gradient arrives as ``q``:
    clip(1 - sum q r / F / sum r^2 / F, 0, 1), F each entry's curvature estimated by the factored
    empirical Fisher (its row's mean square times its column's, over the whole's; its column's alone
    with ``per_row`` False). 0 where ``ref`` is 0; 1 where ``q`` is not finite."""
    r = ref.float()
    sq = r.square()
    rw = r * _inverse(sq.mean(0))[None, :]
    if per_row:
        rw.mul_(_inverse(sq.mean(1))[:, None])
    power = float(torch.dot(r.reshape(-1), rw.reshape(-1)))
    if power == 0:
        return 0.0
    kept = float(torch.dot(q.float().reshape(-1), rw.reshape(-1))) / power
    return min(max(1.0 - kept, 0.0), 1.0) if math.isfinite(kept) else 1.0


def _inverse(v: Tensor) -> Tensor:
    return torch.where(v > 0, 1.0 / v, torch.zeros_like(v))


def gemm_loss_costs(x: Tensor, g: Tensor, refs: dict[str, Tensor], sequences: int) -> dict[str, float]:
    """What a layer's output and input carry for the loss: {"y": fisher(y), "x": fisher(x)} from its input
    x (M, K), output gradient g (M, N) and the references' fprop y (M, N) and dgrad dx (M, K)."""
    with torch.no_grad():
        return {"y": fisher(g, refs["fprop"], sequences), "x": fisher(refs["dgrad"], x, sequences)}
