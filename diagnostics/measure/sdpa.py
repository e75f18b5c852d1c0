"""Attention that a model computes with ``torch.nn.functional.scaled_dot_product_attention``, seen.

A fused attention kernel never forms its scores or weights, so no module hook can read
them. Under a probe of a model that is not a tinylm model, :class:`SDPAWatch` (a
``TorchFunctionMode``, or the function's name in ``torch.nn.functional`` where that catches
the model's calls: :mod:`.attention_watch`) sees each call of the function with its arguments (q, k after any
rotary embedding, the mask, ``is_causal``, ``scale``, ``enable_gqa``), measures the
attention of a sample of query rows, and passes the call on unchanged:

    s_tj = scale * q_t . k_j      (scale: the call's, else 1 / sqrt(d_k)),
    masked keys removed (a boolean mask: False; an additive mask: added; is_causal: j > t),
    p_t = softmax_j(s_tj),

for the rows t of :func:`sample_rows` (every row up to :data:`ROWS`, else :data:`ROWS`
evenly spaced rows, the first and the last included) and every key, so its memory is
B x H x ROWS x S, never T x T, in float32 at least. An additive mask's entries that are -inf or <= finfo.min / 2
(Hugging Face adds finfo.min) mask their keys. From those rows (:func:`row_statistics`): the
moments of the unmasked scores, the attention panel of
:func:`diagnostics.measure.reference.panel` (entropy per row, its minimum and the saturated
fraction over rows with more than one key) and, when asked, the :data:`SIGNAL` vector
[max |s_tj| over the unmasked entries, sum over the rows of ln(n_t), rows], n_t = the keys
row t may attend to (at least 1), so sum ln(n_t) / rows is the mean entropy ceiling. A call
is named by the module running it (the innermost watched module on the stack, e.g.
``transformer.h.0.attn``).

Not seen here: attention computed by explicit matmul and softmax ("eager" implementations;
:mod:`diagnostics.measure.eager_attention` sees those), other fused kernels
(flash-attention packages, xformers), and anything about the heads' outputs beyond what the
module hooks read. A sample of rows estimates the row averages (entropy, saturated
fraction, entropy ceiling) without bias, the minimum entropy and the largest logit only over
the rows sampled.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import numba_reducer, reduction, reference
from .reducer_choice import chosen
from .reference import SATURATED_PROB

__all__ = ["SDPAWatch", "sample_rows", "sampled_attention", "row_statistics", "row_statistics_each", "rows_of",
           "rows_of_each", "masked_additive", "summary", "summaries", "ROWS", "SIGNAL"]

_PLAIN = (Tensor, torch.nn.Parameter)

#: query rows measured per call: all of them up to this many, else this many evenly spaced
ROWS = 64
#: Layout of an attention layer's signal vector (merged: the largest, the sum, the sum)
SIGNAL = ("max_logit", "ceiling_sum", "rows")


def sample_rows(T: int, rows: int = ROWS) -> Tensor:
    """The query rows measured of T: all when T <= rows, else ``rows`` evenly spaced (0 and T-1 included)."""
    if T <= rows:
        return torch.arange(T)
    return torch.linspace(0, T - 1, rows).round().long().unique()


def masked_additive(m: Tensor) -> Tensor:
    """Where an additive mask (or a row of logits with the mask added) masks its key: -inf, or
    <= finfo(dtype).min / 2 (Hugging Face adds finfo.min); NaN is not a mask."""
    return (m == -math.inf) | (m <= torch.finfo(m.dtype).min / 2)


@torch.no_grad()
def row_statistics(s: Tensor, allowed: Tensor, signal: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(the FIELDS moments of the unmasked finite scores; the ATTN_FIELDS panel of the rows'
    softmax; the :data:`SIGNAL` vector or None) of attention logits ``s`` (..., R, S) (float32 at
    least, the scale and any additive mask applied) where ``allowed`` (broadcast to s) marks the
    keys each row may attend to. p_t = softmax over the allowed keys (a row with none: all 0);
    the panel is [rows, mean entropy, M2 of the entropy, min entropy over rows with more than
    one key, count of those rows, how many of them put > 0.99 on one key]. The moments are
    :func:`.reference.moments` of the masked entries: no step waits for the device."""
    return _first(row_statistics_each(s[None], allowed, signal))


def _first(each: tuple[Tensor, Tensor, Tensor | None]) -> tuple[Tensor, Tensor, Tensor | None]:
    """Row 0 of each matrix of (moments, panel, signal or None)."""
    return each[0][0], each[1][0], None if each[2] is None else each[2][0]


@torch.no_grad()
def row_statistics_each(s: Tensor, allowed: Tensor, signal: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`row_statistics` of each s[g] of logits stacked on a first dimension (each call of a
    group), ``allowed`` broadcast to s, as matrices: moments (G, 10), panel (G, 6), signal (G, 3)
    or None. Every figure is reduced over all dimensions but the first, so a group of any size
    takes the same ops (on a GPU the same launches as one call)."""
    G = s.shape[0]
    allowed = allowed.expand(s.shape)
    s = torch.where(allowed, s, -math.inf)
    moments = reference.moments_each(s, allowed & torch.isfinite(s))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key left: all zero
    h = torch.special.entr(p.double()).sum(-1).reshape(G, -1)  # (G, rows)
    keys = allowed.sum(-1).reshape(G, -1)
    later = keys > 1
    top = p.amax(-1).reshape(G, -1)
    n = h.shape[1]
    mean = h.mean(1) if n else h.new_zeros(G)
    lowest = torch.where(later, h, math.inf).amin(1) if n else h.new_full((G,), math.inf)
    rows = h.new_full((G,), float(n))
    panel = torch.stack([rows, mean, (h - mean[:, None]).square().sum(1), lowest, later.sum(1).double(),
                         ((top > SATURATED_PROB) & later).sum(1).double()], 1)
    if not signal:
        return moments, panel, None
    # |s| of the allowed entries (NaN and +inf kept: they are logits), 0 for the masked
    flat = torch.where(allowed, s.abs(), 0.0).reshape(G, -1)
    largest = flat.amax(1).double() if flat.shape[1] else h.new_zeros(G)
    return moments, panel, torch.stack([largest, keys.clamp(min=1).double().log().sum(1), rows], 1)


def rows_of(s: Tensor, allowed: Tensor, signal: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`row_statistics`: for CPU logits under ``TINYLM_REDUCER=auto`` once numba's cache holds
    its loop, the rows' softmax (one op) and one call into that loop (:mod:`._numba_rows`; the
    same figures to the rounding of the logarithms and the order of the sums), else the torch
    formulas (what a CUDA tensor gets: ``TINYLM_REDUCER=cuda`` makes a CPU tensor take them too)."""
    return _first(rows_of_each(s[None], allowed, signal))


def rows_of_each(s: Tensor, allowed: Tensor, signal: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`rows_of` of each s[g] of logits stacked on a first dimension (each call of a group),
    ``allowed`` broadcast to one s[g], as :func:`row_statistics_each`'s matrices: on numba's path
    one softmax for all of them (a row's softmax is the row's alone, whatever rows are beside it)
    and one call into the loop each."""
    one = s.shape[1:]
    if not (s.is_cpu and s.dtype in _ROW_DTYPES and type(s) in _PLAIN and s.numel() and chosen() == "auto"
            and numba_reducer.available() and numba_reducer.ready()):
        return row_statistics_each(s, allowed, signal)
    S = s.shape[-1]
    if allowed.dim() != 2 or not allowed.is_contiguous():  # (A, S): row m of the logits reads row m % A
        lead = allowed.shape[:-2] if allowed.dim() > 2 else ()
        a = allowed.expand(one) if any(d != 1 for d in lead) else allowed.expand(one[-2:])
        allowed = a.reshape(-1, S).contiguous()
    flat = s.detach().reshape(s.shape[0], -1, allowed.shape[0], S).contiguous()  # no gradient flows through here
    p = torch.softmax(torch.where(allowed, flat, -math.inf), -1)  # the rows' weights, one vectorised op
    loop, keys, got = numba_reducer.rows_loop(), allowed.numpy(), np.zeros((s.shape[0], 19))
    for g in range(s.shape[0]):
        loop(flat[g].view(-1, S).numpy(), p[g].view(-1, S).numpy(), keys, got[g])
    out = torch.from_numpy(got)
    return out[:, :10], out[:, 10:16], out[:, 16:] if signal else None


_ROW_DTYPES = (torch.float32, torch.float64)


_KEYS: dict = {}


def _rows_and_keys(T: int, S: int, rows: int, is_causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """(the sampled rows of T, the (R, S) keys each may attend to before any mask: all, or with
    ``is_causal`` those up to the row), made once per shape and device (read only: never written
    in place; at most 64 shapes kept), afresh under a dispatch mode (a FakeTensor mode would make
    them fake)."""
    key = (T, S, rows, is_causal, device)
    got = _KEYS.get(key)
    if got is None:
        idx = sample_rows(T, rows).to(device)
        allowed = torch.ones(len(idx), S, dtype=torch.bool, device=device)
        if is_causal:
            allowed = torch.arange(S, device=device)[None, :] <= idx[:, None]
        got = (idx, allowed)
        if not torch._C._len_torch_dispatch_stack():
            if len(_KEYS) >= 64:  # lengths that keep changing (a growing cache of keys) keep a few
                _KEYS.clear()
            _KEYS[key] = got
    return got


def _logits(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None, rows: int
            ) -> tuple[Tensor, Tensor]:
    """(s, allowed) of the sampled query rows of a call (see :func:`sampled_attention`)."""
    q, k = q.detach(), k.detach()
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    T, S = q.shape[-2], k.shape[-2]
    idx, allowed = _rows_and_keys(T, S, rows, is_causal, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    wide = torch.promote_types(q.dtype, torch.float32)
    s = (q.index_select(-2, idx).to(wide) @ k.to(wide).transpose(-1, -2)) * scale  # (..., H, R, S)
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() < 2 or attn_mask.shape[-2] == 1 else attn_mask.index_select(-2, idx)
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            s = s + m.to(wide)
            allowed = allowed & torch.isfinite(m) & ~masked_additive(m)
    return s, allowed


@torch.no_grad()
def sampled_attention(q: Tensor, k: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                      scale: float | None = None, rows: int = ROWS) -> tuple[Tensor, Tensor]:
    """(the unmasked scores of the sampled rows, flattened; the ATTN_FIELDS panel of their softmax rows).

    q (..., H, T, d), k (..., Hk, S, d) with H a multiple of Hk (grouped keys are shared by
    H / Hk consecutive query heads). The panel is that of :func:`row_statistics`."""
    s, allowed = _logits(q, k, attn_mask, is_causal, scale, rows)
    allowed = allowed.expand(s.shape)
    kept = torch.where(allowed, s, -math.inf)
    return kept[allowed & torch.isfinite(kept)], row_statistics(s, allowed)[1]


_LIB = torch.library.Library("tinylm", "FRAGMENT")
_LIB.define("sdpa_summary(Tensor q, Tensor k, Tensor? attn_mask, bool is_causal, float? scale, int rows, "
            "bool signal) -> Tensor")


def _summary_kernel(q, k, attn_mask, is_causal, scale, rows, signal):
    """[moments, panel, signal vector] of :func:`row_statistics` of a call's sampled rows, in one vector."""
    with torch._C.DisableTorchFunction():
        s, allowed = _logits(q, k, attn_mask, is_causal, scale, rows)
        return torch.cat([v for v in rows_of(s, allowed, signal) if v is not None])


_LIB.impl("sdpa_summary", _summary_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::sdpa_summary", lib=_LIB)
def _(q, k, attn_mask, is_causal, scale, rows, signal):
    return q.new_empty((16 + (len(SIGNAL) if signal else 0),), dtype=torch.float64)


def summary(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None,
            signal: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`row_statistics` of a call's sampled rows (moments, panel, the SIGNAL vector or None)
    from one dispatched op, ``tinylm::sdpa_summary``, cut by one ``split``; CPU tensors under
    ``TINYLM_REDUCER=auto``, where nothing observes the ops (:func:`.reduction.direct`), without
    the op's dispatch (what its kernel computes, uncut: the same bits)."""
    if q.is_cpu and chosen() == "auto" and type(q) in _PLAIN and type(k) in _PLAIN and reduction.direct():
        with torch.no_grad(), torch._C.DisableTorchFunction():
            s, allowed = _logits(q, k, attn_mask, is_causal, None if scale is None else float(scale), ROWS)
            return rows_of(s, allowed, signal)
    with torch.no_grad():
        vec = torch.ops.tinylm.sdpa_summary(q, k, attn_mask, is_causal, None if scale is None else float(scale), ROWS,
                                            signal)
    parts = vec.split_with_sizes([10, 6, len(SIGNAL)] if signal else [10, 6])
    return parts[0], parts[1], parts[2] if signal else None


def _group_kernel(qs, ks, attn_mask, is_causal, scale, rows, signal) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`rows_of` of each call of a group (q of one shape, k of one shape, one mask): the
    sampled rows' logits of all of them from one stacked product and their weights from one
    softmax (:func:`rows_of_each`), each call's figures from its slice (the same bits as the call
    alone: one (R, d) x (d, S) product per head either way, and a row's softmax is its own)."""
    if len(qs) == 1:  # a call alone (past the queue's bound, or the only one of its shape): views, no copy
        q, k = qs[0][None], ks[0][None]
    else:  # the stacks copy what waited: at most the queue's bound
        q, k = torch.stack(qs), torch.stack(ks)
    s, allowed = _logits(q, k, attn_mask, is_causal, scale, rows)
    return rows_of_each(s, allowed, signal)


_LIB.define("sdpa_summaries(Tensor[] q, Tensor[] k, Tensor? attn_mask, bool is_causal, float? scale, int rows, "
            "bool signal) -> Tensor")


def _summaries_kernel(qs, ks, attn_mask, is_causal, scale, rows, signal):
    """(calls, width): :func:`_summary_kernel`'s vector of each call of a group, one row each."""
    with torch._C.DisableTorchFunction():
        return torch.cat([v for v in _group_kernel(qs, ks, attn_mask, is_causal, scale, rows, signal) if v is not None],
                         1)


_LIB.impl("sdpa_summaries", _summaries_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::sdpa_summaries", lib=_LIB)
def _(qs, ks, attn_mask, is_causal, scale, rows, signal):
    return qs[0].new_empty((len(qs), 16 + (len(SIGNAL) if signal else 0)), dtype=torch.float64)


def summaries(qs: list[Tensor], ks: list[Tensor], attn_mask: Tensor | None, is_causal: bool, scale: float | None,
              signal: bool = False) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """:func:`summary` of each of several calls that share their shapes, dtypes, device, mask,
    ``is_causal`` and ``scale`` (a model's layers): one stacked product of the sampled rows for
    all of them and, through the op, one ``tinylm::sdpa_summaries`` and one ``unbind``; without
    the op's dispatch where :func:`summary` skips it. Each call's figures are those it gets alone."""
    scale = None if scale is None else float(scale)
    q = qs[0]
    if q.is_cpu and chosen() == "auto" and all(type(t) in _PLAIN for t in (*qs, *ks)) and reduction.direct():
        with torch.no_grad(), torch._C.DisableTorchFunction():
            moments, panel, vec = _group_kernel(qs, ks, attn_mask, is_causal, scale, ROWS, signal)
        return list(zip(moments.unbind(0), panel.unbind(0), vec.unbind(0) if signal else [None] * len(qs)))
    with torch.no_grad():
        vecs = torch.ops.tinylm.sdpa_summaries(qs, ks, attn_mask, is_causal, scale, ROWS, signal)
        parts = [p.unbind(0) for p in vecs.split_with_sizes([10, 6, len(SIGNAL)] if signal else [10, 6], dim=1)]
    return list(zip(parts[0], parts[1], parts[2] if signal else [None] * len(qs)))


#: the function itself (a builtin), whatever name ``torch.nn.functional`` gives it later
SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class SDPAWatch(TorchFunctionMode):
    """While entered, every call of ``F.scaled_dot_product_attention`` is measured on its
    sampled rows (:func:`row_statistics`) and reported as ``record(name, moments, panel)`` (the
    scores' FIELDS vector, the panel) and, given ``signal``, ``signal(name, vector)`` (the
    :data:`SIGNAL` vector; no step waits for the device); the call
    then runs as it would have. ``where()`` names the caller (None: the call is not reported).
    The measurement runs with torch functions' overrides off, so no other mode sees its ops.
    ``probe_own``: the mode passes every other function on untouched, so the probe's reductions
    may skip their op's dispatch while it is on (:func:`.reduction.direct`). ``seconds``: the
    wall time spent measuring calls (the reports included), which the owner reads and resets.

    A call may also reach :meth:`measure_sdpa` another way (:mod:`.attention_watch`: through the
    module attribute, without the mode); while such a call runs (``caught`` > 0) the mode passes
    it on, and ``missed`` counts the calls the mode measured itself. With a ``queue``, a call of
    plain tensors waits there and is measured, and reported, at the queue's flush."""

    probe_own = True

    def __init__(self, record: Callable[[str, Tensor, Tensor], None], where: Callable[[], str | None],
                 signal: Callable[[str, Tensor], None] | None = None):
        super().__init__()
        self.record, self.where, self.signal = record, where, signal
        #: where calls wait to be measured together (an :class:`~.sdpa_queue.SDPAQueue`), else None: in the call
        self.queue = None
        self.seconds = 0.0
        self.caught = 0
        self.missed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA and not self.caught and self.measure_sdpa(args, kwargs):
            self.missed += 1
        return func(*args, **kwargs)

    def measure_sdpa(self, args: tuple, kwargs: dict) -> bool:
        """Measure one ``scaled_dot_product_attention`` call (its arguments as given) if
        ``where()`` names it; whether it did."""
        name = self.where()
        if name is None:
            return False
        t0 = time.perf_counter()
        call = {**dict(zip(_NAMES, args)), **kwargs}
        q, k, mask = call["query"], call["key"], call.get("attn_mask")
        if self.queue is not None and self.queue.takes(q, k, mask):  # measured with the others at its flush
            if self.queue.add(name, q, k, mask, bool(call.get("is_causal", False)), call.get("scale")):
                with torch._C.DisableTorchFunction():
                    self.queue.flush()
            self.seconds += time.perf_counter() - t0
            return True
        with torch._C.DisableTorchFunction():
            moments, panel, vec = summary(call["query"], call["key"], call.get("attn_mask"),
                                          bool(call.get("is_causal", False)), call.get("scale"),
                                          self.signal is not None)
        self.report(name, moments, panel, vec)
        self.seconds += time.perf_counter() - t0
        return True

    def report(self, name: str, moments: Tensor, panel: Tensor, vec: Tensor | None) -> None:
        """Hand one measured call to ``record`` (and its signal vector, if any, to ``signal``)."""
        self.record(name, moments, panel)
        if vec is not None:
            self.signal(name, vec)
