"""The probe's queued requests that ask for more than the moments: reduced together, by one call.

    rows = Rows()
    i = rows.tensor(h, rows=True, cosine=True)      # a residual point: moments, row_ms, cosine
    inv = rows.vector(i, eps=1e-5)                  # FIELDS of 1 / (row_ms + eps), and the vector itself
    g = rows.tensor(grad, rows=True)
    w = rows.vector(g, weight=inv_factor)           # FIELDS of row_ms * weight
    got = rows.reduce()                             # one call into numba's loop for them all

A probe site that asks for more than the moments of its tensor (the residual points' cosine and
inverse row mean squares, a gate's count below the flat edge, a norm's per-token factor and its
gradient's weighted figure) costs, reduced in its hook, the Python around the kernel (the
reducer, its result, the merges) several times over the kernel itself. Here such a request is
kept as (tensor, its version, what is asked) and :meth:`Rows.reduce` reduces every tensor and
makes every per-token vector in one call into :func:`._numba.rows_at`: each tensor as
:func:`.reduction.numba_parts` reduces it alone (the same loops, the same bits), each vector in
float32 as that function makes it. :class:`.pending.Pending` holds one :class:`Rows` beside its
plain requests and merges their vectors in the order the requests came.

Taken: what the direct lane reduces on one thread (:meth:`Rows.takes`: numba's choice, nothing
observing the ops, a contiguous CPU float32 tensor of fewer than
:data:`~.numba_reducer.PARALLEL_MIN` entries). Anything else (and everything under
``TINYLM_REDUCER=cuda``, where the CPU dispatches what a GPU would) is reduced in its hook.

A norm's factor. Its per-token 1 / (mean x^2 + eps) is made in the forward and weighs its output's
gradient in the backward: :meth:`Rows.vector` returns a :class:`Later` that the flush fills
(``value``: the float32 vector, None when its tensor changed in place before the flush; the probe
flushes the forward's requests before the first gradient, so a gradient always finds it filled).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from . import numba_reducer, reduction

__all__ = ["Rows", "Later"]

_PLAIN = (Tensor, torch.nn.Parameter)
_F32, _STRIDED = torch.float32, torch.strided


class Later:
    """A per-token vector that a flush makes: ``value`` (a float32 tensor of ``shape``) once
    ``done``; None if its tensor changed in place before it was read."""

    __slots__ = ("value", "array", "done", "shape")

    def __init__(self, shape: tuple):
        self.value: Tensor | None = None
        self.array: np.ndarray | None = None  # the same values, flat (what the queue's loop reads)
        self.done = False
        self.shape = shape


class Rows:
    """The requests with rows of one flush (module docstring)."""

    def __init__(self):
        self.xs: list[Tensor] = []
        self._vers: list[int] = []
        self._ds: list[int] = []
        self._ss: list[int] = []
        self._edges: list[float] = []
        self._ids: dict = {}  # (id, D, edge) -> index (the queue holds the tensor: ids are unique)
        self._src: list[int] = []  # vector j: its tensor
        self._eps: list[float] = []  # >= 0: 1 / (ms + eps); else ms * weight
        self._weights: list = []  # the weight (a Later or a float32 tensor), else None
        self.laters: list[Later | None] = []  # the Later a vector fills, else None
        self._invs: dict = {}  # (tensor, eps) -> its vector 1 / (row_ms + eps)
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.xs)

    @staticmethod
    def takes(x: Tensor) -> bool:
        """Whether a request with rows of ``x`` can wait: the direct lane's numba kernel would
        reduce it on one thread, read as it is (and so the queue's loop reads it the same)."""
        return type(x) in _PLAIN and x.dtype is _F32 and x.is_cpu and x.layout is _STRIDED and x.ndim > 0 \
            and 0 < x.numel() < numba_reducer.PARALLEL_MIN and x.is_contiguous() and not x.is_neg() \
            and numba_reducer.has_memory(x) and reduction.direct()

    def tensor(self, x: Tensor, rows: bool = False, cosine: bool = False, below: float = math.nan) -> int:
        """The index of ``x``'s reduction (each tensor read once per request kind): its moments, with
        ``rows`` each row's mean square, with ``cosine`` (``x`` at least 2-D) its cosine between
        tokens, with ``below`` finite the count of entries below it."""
        d = max(x.shape[-1], 1) if rows else 0
        edge = below if below == below and not math.isinf(below) else math.nan
        k = (id(x), d, edge if edge == edge else None)
        i = self._ids.get(k)
        if i is None or self._vers[i] != x._version:
            i = len(self.xs)
            self.xs.append(x)
            self._vers.append(x._version)
            self._ds.append(d)
            self._ss.append(0)
            self._edges.append(edge)
            self._ids[k] = i
            self.nbytes += x.numel() * 4
        if cosine and x.ndim >= 2:
            self._ss[i] = x.shape[-2]
        return i

    def vector(self, i: int, eps: float = -1.0, weight=None, later: bool = False) -> int:
        """Vector j (its index) of tensor ``i``'s rows: 1 / (row_ms + eps) (``eps`` >= 0), else
        row_ms * ``weight`` (a :class:`Later`, or a float32 CPU tensor of one factor per row);
        ``later``: a :class:`Later` of it is filled at the flush (``self.laters[j]``)."""
        if weight is None:  # 1 / (row_ms + eps) of a tensor asked twice (a residual point's figure, the next
            j = self._invs.get((i, eps))  # norm's factor): made once
            if j is not None:
                if later and self.laters[j] is None:
                    self.laters[j] = Later(tuple(self.xs[i].shape[:-1]))
                return j
            self._invs[(i, eps)] = len(self._src)
        self._src.append(i)
        self._eps.append(float(eps) if eps >= 0 else -1.0)
        self._weights.append(weight)
        self.laters.append(Later(tuple(self.xs[i].shape[:-1])) if later else None)
        return len(self._src) - 1

    def source(self, j: int) -> int:
        """The tensor of vector ``j``."""
        return self._src[j]

    def reduce(self) -> tuple[list, list]:
        """([(moments, cosine, below) of each tensor, or None where it changed in place], [the
        summary of each vector, or None]): one call into numba's loop where nothing observes the
        ops; else (an observer came since the requests) :meth:`_each`. Fills the Laters."""
        live = [x._version == v for x, v in zip(self.xs, self._vers)]
        weights, ok = self._weight_vectors(live)
        if not reduction.direct():
            return self._each(live, ok)
        jobs = [j for j in range(len(self._src)) if ok[j]]
        n = len(self.xs)
        addrs = np.fromiter([x.data_ptr() if v else 0 for x, v in zip(self.xs, live)], np.int64, n)
        ns = np.fromiter([x.numel() if v else 0 for x, v in zip(self.xs, live)], np.int64, n)
        given = [weights[j] for j in jobs if weights[j] is not None]
        sizes = [0 if weights[j] is None else weights[j].size for j in jobs]
        wat = np.cumsum([0] + sizes[:-1], dtype=np.int64) if jobs else np.zeros(0, np.int64)
        k = numba_reducer._loops or numba_reducer._build()
        mom, cos, under, res, vals, start = k.rows_at(
            addrs, ns, np.array(self._ds, np.int64), np.array(self._ss, np.int64), np.array(self._edges),
            np.array([self._src[j] for j in jobs], np.int64), np.array([self._eps[j] for j in jobs]), wat,
            np.concatenate(given) if given else np.zeros(0, np.float32))
        moms = torch.from_numpy(mom).unbind(0)
        coss = _rows_of(cos, [i for i in range(n) if self._ss[i]])
        counted = [i for i in range(n) if self._edges[i] == self._edges[i]]  # an edge asked (not NaN)
        belows = _rows_of(np.stack([under, ns.astype(np.float64)], 1), counted)
        parts = [(moms[i], coss.get(i), belows.get(i)) if live[i] else None for i in range(n)]
        summaries: list = [None] * len(self._src)
        for j, vec in zip(jobs, torch.from_numpy(res).unbind(0) if jobs else ()):
            summaries[j] = vec
        for t, j in enumerate(jobs):
            later = self.laters[j]
            if later is not None:
                later.array = vals[start[t]:start[t + 1]]
                later.value = torch.from_numpy(later.array.reshape(later.shape))
        for later in self.laters:
            if later is not None:
                later.done = True
        return parts, summaries

    def _weight_vectors(self, live: list[bool]) -> tuple[list, list[bool]]:
        """(each vector's weight as a flat float32 array, else None; whether vector j can be made:
        its tensor unchanged, its weight known and of one factor per row)."""
        weights, ok = [], []
        for i, w in zip(self._src, self._weights):
            if w is None:  # 1 / (row_ms + eps)
                weights.append(None)
                ok.append(live[i] and self._ds[i] > 0)
                continue
            if type(w) is Later:
                arr = w.array
            else:
                arr = w.detach().reshape(-1).numpy() if w.dtype is _F32 and w.is_cpu and type(w) in _PLAIN else None
            weights.append(arr)
            ok.append(live[i] and self._ds[i] > 0 and arr is not None and arr.size * self._ds[i] == self.xs[i].numel())
        return weights, ok

    def _each(self, live: list[bool], ok: list[bool]) -> tuple[list, list]:
        """:meth:`reduce` one request at a time by :func:`.reducer.reduce` (its op where observed)."""
        from .reducer import reduce

        parts, rms = [], []
        for i, x in enumerate(self.xs):
            if not live[i]:
                parts.append(None)
                rms.append(None)
                continue
            r = reduce(x, rows=self._ds[i] > 0, cosine=self._ss[i] > 0, below=self._edges[i])
            parts.append((r.moments, r.cosine, r.below))
            rms.append(r.row_ms)
        summaries: list = [None] * len(self._src)
        for j, (i, w) in enumerate(zip(self._src, self._weights)):
            if ok[j]:
                w = w.value if isinstance(w, Later) else w
                value = (rms[i] + self._eps[j]).reciprocal() if w is None else rms[i] * w.reshape(rms[i].shape)
                summaries[j] = reduce(value).moments
                if self.laters[j] is not None:
                    self.laters[j].value = value
                    self.laters[j].array = value.reshape(-1).numpy()
            if self.laters[j] is not None:
                self.laters[j].done = True
        return parts, summaries


def _rows_of(a: np.ndarray, idx: list[int]) -> dict[int, Tensor]:
    """{i: row i of ``a`` as a tensor} for the rows ``idx`` (views of one tensor)."""
    return dict(zip(idx, torch.from_numpy(a[idx]).unbind(0))) if idx else {}
