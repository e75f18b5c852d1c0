"""Attention that a model computes with ``torch.nn.functional.scaled_dot_product_attention``, seen.

A fused attention kernel never forms its scores or weights, so no module hook can read
them. Under a probe of a model that is not a tinylm model, :class:`SDPAWatch` (a
``TorchFunctionMode``) sees each call of the function with its arguments (q, k after any
rotary embedding, the mask, ``is_causal``, ``scale``, ``enable_gqa``), measures the
attention of a sample of query rows, and passes the call on unchanged:

    s_tj = scale * q_t . k_j      (scale: the call's, else 1 / sqrt(d_k)),
    masked keys removed (a boolean mask: False; an additive mask: added; is_causal: j > t),
    p_t = softmax_j(s_tj),

for the rows t of :func:`sample_rows` (every row up to :data:`ROWS`, else :data:`ROWS`
evenly spaced rows, the first and the last included) and every key, so its memory is
B x H x ROWS x S, never T x T. From those rows: the moments of the unmasked scores and the
attention panel of :func:`diagnostics.measure.reference.panel` (entropy per row, its
minimum and the saturated fraction over rows with more than one key). A call is named by the
module running it (the innermost watched module on the stack, e.g. ``transformer.h.0.attn``).

Not seen: attention computed by explicit matmul and softmax ("eager" implementations),
other fused kernels (flash-attention packages, xformers), and anything about the heads'
outputs beyond what the module hooks read. A sample of rows estimates the row averages
(entropy, saturated fraction) without bias, the minimum entropy only over the rows sampled.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .reference import SATURATED_PROB

__all__ = ["SDPAWatch", "sample_rows", "sampled_attention", "ROWS"]

#: query rows measured per call: all of them up to this many, else this many evenly spaced
ROWS = 64


def sample_rows(T: int, rows: int = ROWS) -> Tensor:
    """The query rows measured of T: all when T <= rows, else ``rows`` evenly spaced (0 and T-1 included)."""
    if T <= rows:
        return torch.arange(T)
    return torch.linspace(0, T - 1, rows).round().long().unique()


@torch.no_grad()
def sampled_attention(q: Tensor, k: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                      scale: float | None = None, rows: int = ROWS) -> tuple[Tensor, Tensor]:
    """(the unmasked scores of the sampled rows, flattened; the ATTN_FIELDS panel of their softmax rows).

    q (..., H, T, d), k (..., Hk, S, d) with H a multiple of Hk (grouped keys are shared by
    H / Hk consecutive query heads). The panel is that of :func:`diagnostics.measure.reference.panel`:
    [rows, mean entropy, M2 of the entropy, min entropy over rows with more than one key,
    count of those rows, how many of them put > 0.99 on one key]."""
    q, k = q.detach(), k.detach()
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    T, S = q.shape[-2], k.shape[-2]
    idx = sample_rows(T, rows).to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = (q.index_select(-2, idx).float() @ k.float().transpose(-1, -2)) * scale  # (..., H, R, S)
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
    if is_causal:
        allowed = torch.arange(S, device=s.device)[None, :] <= idx[:, None]
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() < 2 or attn_mask.shape[-2] == 1 else attn_mask.index_select(-2, idx)
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            s = s + m.float()
            allowed = allowed & torch.isfinite(m)
    allowed = allowed.expand(s.shape)
    s = torch.where(allowed, s, -math.inf)
    scores = s[allowed & torch.isfinite(s)]
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key left: all zero
    h = torch.special.entr(p.double()).sum(-1)  # (..., H, R)
    later = allowed.sum(-1) > 1
    top = p.amax(-1)
    hl = h[later]
    mean = h.mean() if h.numel() else h.new_zeros(())
    panel = torch.stack([h.new_tensor(float(h.numel())), mean, (h - mean).square().sum(),
                         hl.amin() if hl.numel() else h.new_tensor(math.inf), h.new_tensor(float(hl.numel())),
                         (top[later] > SATURATED_PROB).sum().double()])
    return scores, panel


class SDPAWatch(TorchFunctionMode):
    """While entered, every call of ``F.scaled_dot_product_attention`` is measured by
    :func:`sampled_attention` and reported as ``record(name, scores, panel)``; the call then
    runs as it would have. ``where()`` names the caller (None: the call is not reported)."""

    def __init__(self, record: Callable[[str, Tensor, Tensor], None], where: Callable[[], str | None]):
        super().__init__()
        self.record, self.where = record, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            name = self.where()
            if name is not None:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
                call = {**dict(zip(names, args)), **kwargs}
                scores, panel = sampled_attention(call["query"], call["key"], call.get("attn_mask"),
                                                  bool(call.get("is_causal", False)), call.get("scale"))
                self.record(name, scores, panel)
        return func(*args, **kwargs)
