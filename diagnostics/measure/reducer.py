"""``reduce``: every statistic the probe takes of a tensor, from one read of it where it can.

    r = reduce(x)                            # r.moments: FIELDS vector of every entry
    r = reduce(scores, causal=True)          # over the entries on and below each diagonal
    r = reduce(probs, causal=True, probs=True)   # r.panel: ATTN_FIELDS of the rows
    r = reduce(h, rows=True, cosine=True)    # r.row_ms: mean(x^2) per row; r.cosine: per-sequence cosines

What each number means is :mod:`.reference` (plain torch, float64). A plain tensor is reduced
by one dispatched op, ``tinylm::summary`` (:mod:`.reduction`), which computes every part asked
for (moments, panel, row mean squares, cosines, and the figures a probe site adds) from one
read: its numba kernel (:mod:`.numba_reducer`) for a CPU tensor of float32, bf16 or fp16 (called
directly, without the op's dispatch, where nothing observes the ops: :func:`.reduction.direct`;
the same bits); its
CUDA-structure kernel, the compiled reducer (:mod:`.compiled`, ``torch.compile``), for any other
(a GPU's; a CPU's where numba is missing, or under ``TINYLM_REDUCER=cuda``); plain torch ops
inside the same op while numba's cache is being filled or where compilation failed (one
warning). ``TINYLM_REDUCER=reference`` sends everything to the reference, op by op
(:mod:`.reducer_choice`). The tests hold both kernels to the reference (counts and max |x|
exactly, mean and M2 to float64 rounding). Either way the result is a
:class:`Reduction` of float64 tensors on ``x``'s device (row mean squares: float32, float64
for float64 ``x``), with no device sync.

Only a plain strided tensor's memory is ever read (:func:`plain`): a subclass that only
overrides ``__torch_function__`` is read through a plain view of the same memory; a
``DTensor`` (FSDP2, tensor parallel) through its local shard, merged over its mesh by
:mod:`.sharded` (one collective; moments only); a sparse tensor through its stored values and
the count of its implicit zeros (moments only). Anything else (a meta tensor, a FakeTensor or
other ``__torch_dispatch__`` subclass, an uninitialized parameter, another layout, and the
parts a sharded or sparse tensor cannot give) is not measured: a :class:`Reduction` with
``measured`` False, whose moments count no entries.

A :class:`Reducer` is ``reduce`` with a memory of the last few tensors it reduced: a tensor
that reaches two hooks back to back (a branch is its last projection's output; backward, a
gradient passes unchanged to the branch added at a residual point; a block's output is the
next norm's input) is read once. A tensor is recognised by object (a weak reference, so a
live match cannot be a reused address), data pointer and version (so one changed in place
is read again).
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from tinylm.validate import check, refuse

from ..options import OptionsError
from . import compiled, reduction, reference, sharded
from .reference import ATTN_FIELDS, FIELDS

__all__ = ["Reduction", "reduce", "Reducer", "plain", "merge_vectors", "merge_attention_vectors", "FIELDS",
           "ATTN_FIELDS"]


class Reduction(NamedTuple):
    """What :func:`reduce` measured of one tensor (a part not asked for is None).

    moments: (10,) float64, laid out as :data:`FIELDS`. panel: (6,) float64, :data:`ATTN_FIELDS`.
    row_ms: mean(x^2) over the last dimension, shape ``x.shape[:-1]``. cosine: (10,) float64,
    :data:`FIELDS` of each sequence's mean cosine between its different rows. measured: False when
    the tensor could not be read (see the module docstring): every vector then counts no entries
    (the panel's minimum entropy inf, row mean squares NaN), so merging it changes nothing.
    inv: FIELDS of 1 / (row_ms + inv_eps); below: (2,) [entries < below, entries]; weighted:
    FIELDS of row_ms * weight (:func:`reduce`'s ``inv_eps``, ``below``, ``weight``)."""

    moments: Tensor
    panel: Tensor | None = None
    row_ms: Tensor | None = None
    cosine: Tensor | None = None
    measured: bool = True
    inv: Tensor | None = None
    below: Tensor | None = None
    weighted: Tensor | None = None


_PLAIN = (Tensor, torch.nn.Parameter)


def plain(x: Tensor) -> Tensor | None:
    """``x`` as a plain strided tensor whose memory the reducers may read, or None.

    A ``torch.Tensor`` or ``nn.Parameter``: ``x``; a subclass that overrides only
    ``__torch_function__``: a plain view of its memory. None: a subclass that overrides
    ``__torch_dispatch__`` (DTensor, FakeTensor, ...), an uninitialized parameter, a meta tensor
    or a layout other than strided. (The numba reducer checks the data pointer itself.)"""
    if type(x) not in _PLAIN:
        if type(x).__torch_dispatch__ is not Tensor.__torch_dispatch__ \
                or isinstance(x, torch.nn.parameter.UninitializedTensorMixin):
            return None
        with torch._C.DisableTorchFunctionSubclass():
            x = x.as_subclass(Tensor)
    if x.layout is not torch.strided or x.is_meta:
        return None
    return x


def _not_measured(x: Tensor, probs: bool, rows: bool, cosine: bool) -> Reduction:
    """The :class:`Reduction` of a tensor that could not be read (CPU vectors that count nothing)."""
    zeros = torch.zeros(len(FIELDS), dtype=torch.float64)
    panel = torch.tensor([0.0, 0.0, 0.0, float("inf"), 0.0, 0.0], dtype=torch.float64) if probs else None
    row_ms = torch.full(tuple(x.shape[:-1]), float("nan")) if rows else None
    return Reduction(zeros, panel, row_ms, zeros.clone() if cosine else None, measured=False)


def _sparse_values(x: Tensor) -> Tensor | None:
    """The stored values of a sparse tensor (COO coalesced: duplicates summed), else None."""
    if x.layout == torch.sparse_coo:
        return x.coalesce().values()
    if x.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return x.values()
    return None


def _moments(x: Tensor) -> Tensor:
    return reduce(x).moments


def _unplain(x: Tensor, causal: bool, probs: bool, rows: bool, cosine: bool) -> Reduction:
    """:func:`reduce` of a tensor :func:`plain` refuses: a DTensor's merged shards, a sparse
    tensor's values with its implicit zeros, else not measured (and so for any part but moments)."""
    if causal or probs or rows or cosine:
        return _not_measured(x, probs, rows, cosine)
    if sharded.is_dtensor(x):
        vec = sharded.moments([x], _moments)[0]
        return Reduction(vec) if vec is not None else _not_measured(x, False, False, False)
    values = _sparse_values(x) if not x.is_meta else None
    if values is None or plain(values) is None:
        return _not_measured(x, False, False, False)
    k = float(x.numel() - values.numel())  # implicit zeros: measured, finite, zero
    zeros = torch.tensor([k, k, 0.0, 0.0, 0.0, k, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=values.device)
    return Reduction(merge_vectors(reduce(values).moments, zeros))


def _check(x: Tensor, causal: bool, probs: bool, rows: bool) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, Tensor) else type(x).__name__
        refuse(f"x={what}: reduce measures a floating-point tensor", "pass one (e.g. x.float())", error=OptionsError,
               argument="x")
    if (causal or probs) and x.dim() < 2:
        refuse(f"x.shape={tuple(x.shape)}: causal and probs need (..., T, S) rows",
               "pass a tensor of at least 2 dimensions", error=OptionsError, argument="x")
    if causal and x.shape[-1] != x.shape[-2]:
        refuse(f"x.shape={tuple(x.shape)}: causal needs square (..., T, T) matrices", "pass causal=False",
               error=OptionsError, argument="x")
    if rows and x.dim() < 1:
        refuse("x.shape=(): rows needs a last dimension", "pass a tensor of at least 1 dimension", error=OptionsError,
               argument="x")


def reduce(x: Tensor, *, causal: bool = False, probs: bool = False, rows: bool = False,
           cosine: bool = False, inv_eps: float = -1.0, below: float = math.nan,
           weight: Tensor | None = None) -> Reduction:
    """The statistics of ``x`` that :mod:`.reference` defines, as a :class:`Reduction`.

    ``causal``: ``x`` is (..., T, T) and only the entries on and below each diagonal are
    measured (the others are never read). ``probs``: also the attention panel of the rows of
    probabilities ``x`` (entries above the diagonal taken as 0 when ``causal``). ``rows``: also
    mean(x^2) over the last dimension. ``cosine``: also the moments of each sequence's mean
    cosine between its rows (sequences: ``x.shape[-2]`` rows of ``x.shape[-1]`` entries).
    ``inv_eps`` >= 0 (with ``rows``): also the moments of 1 / (row_ms + inv_eps); ``below``
    (finite): also [entries < below, entries]; ``weight`` (with ``rows``; one factor per row):
    also the moments of row_ms * weight. A plain tensor is reduced by one dispatched op
    (:mod:`.reduction`). Raises OptionsError for a tensor these do not fit; a tensor whose
    memory cannot be read is measured through its parts or not at all (module docstring:
    ``measured``)."""
    _check(x, causal, probs, rows)
    if not (rows or cosine or probs and not causal) and inv_eps < 0 and below != below and weight is None \
            and reduction.lane(x):  # most requests: moments (and a causal panel), one frame
        return Reduction(*reduction.numba_moments(x, x.shape[-1] if causal else 0, probs))
    if (causal or not probs) and reduction.lane(x):  # the op's numba kernel without its dispatch
        mom, panel, ms, cos, inv, under, weighted = reduction.numba_parts(
            x, x.shape[-1] if causal else 0, probs, rows, cosine, inv_eps, below, weight)
        return Reduction(mom, panel, ms, cos, inv=inv, below=under, weighted=weighted)
    readable = plain(x)
    if readable is None:
        return _unplain(x, causal, probs, rows, cosine)
    x = readable
    kernel = reduction.route(x) if (causal or not probs) else None  # a panel of full rows: plain torch below
    if kernel is not None:
        with torch.no_grad():
            vec, ms = torch.ops.tinylm.summary(x, x.shape[-1] if causal else 0, probs, rows, cosine, inv_eps, below,
                                               weight, kernel)
        parts = reduction.sizes(probs, cosine, inv_eps, below, weight)
        got = dict(zip([k for k, _ in parts], vec.split_with_sizes([n for _, n in parts]))) if len(parts) > 1 \
            else {"moments": vec}
        return Reduction(got["moments"], got.get("panel"), ms if rows else None, got.get("cosine"),
                         inv=got.get("inv"), below=got.get("below"), weighted=got.get("weighted"))
    mask = reference.causal_mask(x.shape[-1], x.device) if causal else None
    r = Reduction(reference.moments(x, mask), reference.panel(x, causal) if probs else None,
                  reference.row_mean_squares(x) if rows or weight is not None or inv_eps >= 0 else None,
                  reference.cosines(x) if cosine else None)
    return _with_extra(r, inv_eps, below, weight, x)


def _with_extra(r: Reduction, inv_eps: float, below: float, weight: Tensor | None, x: Tensor) -> Reduction:
    """``r`` with its ``inv``, ``below`` and ``weighted`` parts, computed with torch ops."""
    parts = {}
    if inv_eps >= 0:
        parts["inv"] = reference.moments((r.row_ms + inv_eps).reciprocal())
    if math.isfinite(below):
        parts["below"] = torch.stack([(x.detach() < below).sum(), torch.tensor(x.numel(), device=x.device)]).double()
    if weight is not None:
        parts["weighted"] = reference.moments(r.row_ms * weight.reshape(r.row_ms.shape))
    return r._replace(**parts)


class Reducer:
    """:func:`reduce` that knows the last ``size`` tensors it reduced (see the module docstring).

    ``reducer(x, ...)`` returns the :class:`Reduction` of a remembered ``x`` (same object, data
    pointer and version; same ``causal``) when it holds every part asked for, and otherwise
    reduces ``x`` again, asking also for the parts it had, and remembers that."""

    def __init__(self, size: int = 4):
        check("size", size, lambda v: isinstance(v, int) and v >= 1, "be a positive int (the tensors remembered)",
              fix="e.g. 4", error=OptionsError)
        self.size = size
        self._recent: list[tuple[weakref.ref, tuple, Reduction, tuple]] = []  # most recent first

    def __call__(self, x: Tensor, *, causal: bool = False, probs: bool = False, rows: bool = False,
                 cosine: bool = False, inv_eps: float = -1.0, below: float = math.nan,
                 weight: Tensor | None = None) -> Reduction:
        try:
            key = (x.data_ptr(), x._version, causal) if type(x) in _PLAIN else None  # the object: checked below
        except RuntimeError:  # no storage (sparse; functorch and functional wrappers)
            key = None
        if key is None:  # nothing of its own to recognise it by
            return reduce(x, causal=causal, probs=probs, rows=rows, cosine=cosine, inv_eps=inv_eps, below=below,
                          weight=weight)
        for i, (ref, k, r, ext) in enumerate(self._recent):
            if k == key and ref() is x:
                if (not probs or r.panel is not None) and (not rows or r.row_ms is not None) \
                        and (not cosine or r.cosine is not None) and (inv_eps < 0 or ext[0] == inv_eps) \
                        and (below != below or ext[1] == below) and (weight is None or ext[2] is weight):
                    return r
                probs, rows, cosine = probs or r.panel is not None, rows or r.row_ms is not None, \
                    cosine or r.cosine is not None
                inv_eps = inv_eps if inv_eps >= 0 else ext[0]
                below = below if below == below else ext[1]
                del self._recent[i]
                break
        r = reduce(x, causal=causal, probs=probs, rows=rows, cosine=cosine, inv_eps=inv_eps, below=below,
                   weight=weight)
        self._recent = [(weakref.ref(x), key, r, (inv_eps, below, weight))] + self._recent[:self.size - 1]
        return r


def merge_np(a: np.ndarray, b: np.ndarray, n: int = 1, ext: int = 4, largest: bool = True) -> np.ndarray:
    """:func:`_merge`'s rule in numpy on the last axis: two vectors, or rows of them merged pairwise
    (``a[i]`` with ``b[i]``), each row bit for bit the merge of its two vectors. The defaults are
    :data:`FIELDS`' layout (:func:`merge_vectors`)."""
    out = a + b
    na, nb = a[..., n], b[..., n]
    total = na + nb
    some = total > 0
    safe = np.where(some, total, 1.0)
    delta = b[..., n + 1] - a[..., n + 1]
    out[..., n + 1] = np.where(some, a[..., n + 1] + delta * nb / safe, 0.0)
    out[..., n + 2] = a[..., n + 2] + b[..., n + 2] + np.where(some, delta * delta * na * nb / safe, 0.0)
    out[..., ext] = (np.maximum if largest else np.minimum)(a[..., ext], b[..., ext])
    return out


def _merge_torch(a: Tensor, b: Tensor, n: int, ext: int, largest: bool) -> Tensor:
    b = b.to(a.device)
    na, nb = a[n], b[n]
    total = na + nb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    delta = b[n + 1] - a[n + 1]
    out = a + b
    out[n + 1] = torch.where(total > 0, a[n + 1] + delta * nb / safe, torch.zeros_like(total))
    out[n + 2] = a[n + 2] + b[n + 2] + delta * delta * na * nb / safe
    out[ext] = (torch.maximum if largest else torch.minimum)(a[ext], b[ext])
    return out


def _merge(a: Tensor, b: Tensor, n: int, ext: int, largest: bool) -> Tensor:
    """Merge two vectors: (count, mean, M2) at n, n+1, n+2 by Chan's rule, the larger
    (``largest``) or smaller at ``ext``, and a sum everywhere else; on the CPU in numpy (a few
    microseconds), elsewhere with torch ops on the tensors' device (no sync), compiled into
    one pass where :mod:`.compiled` is available. numpy and torch ops give the same bits;
    compiled code may round a multiply-add once instead of twice."""
    if a.is_cpu and b.is_cpu:
        return torch.from_numpy(merge_np(a.numpy(), b.numpy(), n, ext, largest))
    if compiled.available():
        with reduction.compiling():  # the default stance, where a probe runs the model eagerly
            out = compiled.call(_merge_torch, a, b.to(a.device), n, ext, largest)
        if out is not None:
            return out
    return _merge_torch(a, b, n, ext, largest)


def merge_vectors(a: Tensor, b: Tensor) -> Tensor:
    """Two :data:`FIELDS` vectors merged into the vector of both tensors' entries: n = n_a + n_b,
    delta = mean_b - mean_a, mean = mean_a + delta n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n
    (Chan), max for max|x|, sums for the counts. (Vectors of :func:`reduce` carry no autograd
    history; a new tensor is returned and neither input changes.)"""
    return _merge(a, b, 1, 4, True)


def merge_attention_vectors(a: Tensor, b: Tensor) -> Tensor:
    """Two :data:`ATTN_FIELDS` vectors merged (Chan for the entropy over rows, min for its minimum)."""
    return _merge(a, b, 0, 3, False)
