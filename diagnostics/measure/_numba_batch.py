"""The numba loop of the probe's queued requests with rows (:mod:`diagnostics.measure.pending_rows`
drives it): many tensors, each with its own request, and the per-token vectors made from their
rows, reduced in one call from Python.

Module-level functions, so that numba's ``cache=True`` finds them again in the next process. Each
tensor is reduced by :func:`._numba.reduce_serial` exactly as :func:`.numba_reducer.summary_rows`
(rows of D entries) or :func:`.numba_reducer.summary` (flat, D = 0) reduces it alone, and each
per-token vector (1 / (ms + eps), or ms * w) is made in float32 as :func:`.reduction._cpu` makes it
in numpy (ms = float32(sum of squares / D); IEEE float32 add, divide and multiply) and summarised
by the same loop as :func:`.numba_reducer.summary` of that vector: the same bits as one call each.
"""

import numpy as np
from numba import carray, njit

from ._numba import reduce_serial
from ._numba_vectors import as_f32, at


@njit(cache=True)
def below_count(xb, edge):
    """How many of the float32 entries (bits ``xb``) compare below ``edge`` (NaN: none)."""
    c = 0
    for i in range(xb.size):
        c += as_f32(xb[i]) < edge
    return c


@njit(cache=True)
def rows_at(addrs, ns, ds, ss, edges, src, eps, wat, w32):
    """Tensor i: the ns[i] float32 entries at addrs[i]; ds[i] > 0: rows of ds[i] entries (each
    row's sum of squares), 0: flat; ss[i] > 1: the cosine of sequences of ss[i] rows; edges[i]
    not NaN: the count of entries below it. Vector j, from the rows of tensor src[j]:
    1 / (ms + eps[j]) where eps[j] >= 0, else ms * w32[wat[j]:], one value per row.

    Returns (moments (N, 10), cosine (N, 10; zeros where not asked), below counts (N,),
    the vectors' summaries (J, 10), the vectors (float32, one after the other), their starts (J + 1))."""
    n = addrs.size
    mom = np.zeros((n, 10))
    cos = np.zeros((n, 10))
    under = np.zeros(n)
    rowat = np.zeros(n + 1, np.int64)
    for i in range(n):
        rowat[i + 1] = rowat[i] + (ns[i] // ds[i] if ds[i] > 0 else 0)
    rowsq = np.empty(rowat[n])
    for i in range(n):
        if ns[i] == 0:  # changed in place: not read
            continue
        xb = carray(at(addrs[i]), ns[i])
        vec, rsq, cs = reduce_serial(xb, 0, ds[i], False, ss[i])
        mom[i] = vec
        if cs.size:
            cos[i] = cs
        rowsq[rowat[i]:rowat[i + 1]] = rsq
        if edges[i] == edges[i]:
            under[i] = below_count(xb, edges[i])
    m = src.size
    start = np.zeros(m + 1, np.int64)
    for j in range(m):
        start[j + 1] = start[j] + rowat[src[j] + 1] - rowat[src[j]]
    vals = np.empty(start[m], np.float32)
    res = np.zeros((m, 10))
    for j in range(m):
        s = src[j]
        d = ds[s]
        e = np.float32(eps[j])
        for r in range(start[j + 1] - start[j]):
            ms = np.float32(rowsq[rowat[s] + r] / d)
            if eps[j] >= 0:
                vals[start[j] + r] = np.float32(1.0) / (ms + e)
            else:
                vals[start[j] + r] = ms * w32[wat[j] + r]
        res[j] = reduce_serial(vals[start[j]:start[j + 1]].view(np.uint32), 0, 0, False, 0)[0]
    return mom, cos, under, res, vals, start
