"""The loops of the numba reducer, :mod:`diagnostics.measure.numba_reducer` (imported on first use: numba's import and its
on-disk cache load cost about a second, which a program that never probes should not pay).

Module-level functions, so that numba's ``cache=True`` finds them again in the next process.
Every loop reads the float32 bits (one uint32 array; a value is a register bitcast away); the
hot loops are explicit vectors written with llvmlite (:mod:`._numba_vectors`), the rare ones
numba loops that index a view from 0 (a loop from a variable start costs numba a
negative-index wrap per entry, and LLVM then gathers instead of loading). Here: one segment's
reduction (:func:`segment`), the segments of a tensor (:func:`segments`, serial or over
threads), their merge (:func:`finish`), the cosine between tokens (:func:`cosines`) and the
entry points (:func:`serial_at`, :func:`parallel_at`; :func:`many_at` of a list of tensors,
:func:`rows_at` of the probe's queued requests with rows). A segment's raw row has :data:`NRAW`
fields; the finished vectors are the FIELDS of :mod:`diagnostics.measure.reference` (10) and,
for attention probabilities, its ATTN_FIELDS (6).
"""

import math

import numpy as np
from numba import carray, njit, prange

from ._numba_vectors import (ABS, E1, E113, E143, E254, F32, INF, add_scaled, as_f32, at, entropy_rows, screen,
                             screen_rows, small)

#: entries per segment of a flat tensor (16 KiB of float32: fits the L1 cache)
SEG = 4096
#: raw row of one segment: n, finite, mean, m2, max |x|, nonzero, |x| < 2^-14, finite |x| >= 2^16,
#: |x| < 2^-126, finite |x| >= 2^127 (zeros are in both small counts)
NRAW = 10
#: a row of probabilities whose largest entry is above this is saturated
SATURATED = F32(0.99)


# -- one segment: a flat block, or one causal T x T matrix --

@njit(cache=True)
def span(n, T, t):
    """(lo, hi) of row t: all n entries (T = 0), or the first t + 1 entries of row t of a T x T matrix."""
    if T == 0:
        return 0, n
    return t * T, t * T + t + 1


@njit(cache=True)
def exact(xb, K, acc):
    """Add to acc (s1, s2, max |x|, finite, nonzero, lt113, ge143, e0, e254) every count, the largest
    finite |x| and float64 sums of d = x - K over the finite entries (a segment that holds a
    non-finite value)."""
    for i in range(xb.size):
        m = xb[i] & ABS
        fin = m < INF
        if fin:
            d = np.float64(as_f32(xb[i])) - K
            acc[0] += d
            acc[1] += d * d
            acc[2] = max(acc[2], np.float64(as_f32(m)))
            acc[3] += 1
            acc[6] += m >= E143
            acc[7] += m < E1
            acc[8] += m >= E254
        acc[4] += m != 0
        acc[5] += m < E113


@njit(cache=True)
def segment(xb, T, D, K, out, att, rowsq):
    """Reduce one segment into ``out`` (NRAW): a flat block (T = 0) or the entries on and below
    the diagonal of a causal T x T matrix. Probabilities (``att`` has room) also get each row's
    entropy and largest entry: att = rows, entropy sum, entropy sum of squares, min entropy over
    rows t >= 1, rows t >= 1, saturated rows t >= 1 (max p > 0.99). A flat block of whole rows
    of D entries (``rowsq`` has room) also gets each row's sum of x^2, from the same read.

    The screening loop sums d = x - K and d^2 in float64 and keeps the largest and smallest
    |x| (as bits: non-negative floats order as their bits do); M2 = sum d^2 - (sum d)^2 / n
    is then exact to ~1e-16 (1 + ((K - mean) / std)^2). Sums that are not finite mean a
    non-finite entry: a second loop then counts everything and sums the finite entries.
    Otherwise the extremes settle the counts when 2^-14 <= |x| < 2^16 throughout (most
    activations) or every |x| is normal and below 2^-14 (most gradients), and a second loop
    over the segment (still in the cache) counts them when not.
    """
    rows = 1 if T == 0 else T
    n = xb.size if T == 0 else T * (T + 1) // 2
    if att.size > 0:
        hs = np.empty(T)
        tops = np.empty(T, np.uint32)
        entropy_rows(xb, T, hs, tops)
        h1 = h2 = 0.0
        hmin = np.inf
        sat = 0
        for t in range(T):
            h = hs[t]
            h1 += h
            h2 += h * h
            if t >= 1:
                hmin = min(hmin, h)
                sat += as_f32(tops[t]) > SATURATED
        att[0] = T
        att[1] = h1
        att[2] = h2
        att[3] = hmin
        att[4] = T - 1
        att[5] = sat
    if rowsq.size > 0:
        s1, s2, top, bot = screen_rows(xb, T, D, K, rowsq)
    else:
        s1, s2, top, bot = screen(xb, T, xb.size, K)
    nf, nz, lt113, ge143, e0, e254 = n, n, 0, 0, 0, 0
    mx = np.float64(as_f32(top))
    if not (np.isfinite(s1) and np.isfinite(s2)):
        acc = np.zeros(9)
        for t in range(rows):
            lo, hi = span(xb.size, T, t)
            exact(xb[lo:hi], K, acc)
        s1, s2, mx = acc[0], acc[1], acc[2]
        nf, nz, lt113, ge143, e0, e254 = int(acc[3]), int(acc[4]), int(acc[5]), int(acc[6]), int(acc[7]), int(acc[8])
    else:
        if bot >= E113:  # 2^-14 <= |x| < 2^16 throughout
            pass
        elif top < E113 and bot >= E1:  # normal and below 2^-14 throughout (most gradients)
            lt113 = n
        else:
            nz, lt113, e0 = small(xb, T)
        if top >= E143:  # finite values at or above 2^16: count them
            for t in range(rows):
                lo, hi = span(xb.size, T, t)
                for i in range(lo, hi):
                    m = xb[i] & ABS
                    ge143 += m >= E143
                    e254 += m >= E254
    out[0] = n
    out[1] = nf
    out[2] = K + s1 / nf if nf > 0 else 0.0
    out[3] = max(s2 - s1 * s1 / nf, 0.0) if nf > 0 else 0.0
    out[4] = mx
    out[5] = nz
    out[6] = lt113
    out[7] = ge143
    out[8] = e0
    out[9] = e254


@njit(cache=True)
def first_shift(b):
    """The first entry as the first shift, or 0 when it is not finite."""
    return np.float64(as_f32(b)) if (b & ABS) < INF else 0.0


@njit(cache=True)
def width_of(T, D):
    """Entries per segment: a causal T x T matrix; SEG flat entries, or, with rows of D entries,
    as many whole rows as fit in SEG (at least one)."""
    if T > 0:
        return T * T
    return SEG if D == 0 else D * max(1, SEG // D)


@njit(cache=True)
def unit_sums(xb, D, S, row0, rowsq, units):
    """Add each row of D entries of ``xb`` (rows row0, row0 + 1, ... of the tensor), divided by
    its norm sqrt(rowsq), to the float64 sum ``units[b]`` of its sequence b (S rows each). A
    zero row adds nothing; a row with a non-finite entry makes its sequence's sum NaN. The rows
    were just read for their sums of squares: this reads them again from the L1 cache."""
    for i in range(xb.size // D):
        q = rowsq[i]
        if q != 0.0:
            add_scaled(xb[i * D:(i + 1) * D], 1.0 / math.sqrt(q), units[(row0 + i) // S])


@njit(cache=True)
def segments(xb, T, D, r0, r1, res, att, rowsq, S, units):
    """Fill res[r] (and att[r], and the rows' sums of squares) for segments r0 <= r < r1 of
    :func:`width_of` entries (the last: what is left). Each segment is shifted by the mean of
    the one before it (the first: by its first entry, or 0 if that is not finite), so that
    homogeneous data is summed about a shift near its mean. With sequences of S > 1 rows,
    each row's unit vector is added to its sequence's sum in ``units`` (:func:`unit_sums`)."""
    if r1 <= r0:
        return
    width = width_of(T, D)
    per = width // D if D > 0 else 0
    K = first_shift(xb[r0 * width])
    for r in range(r0, r1):
        lo = r * width
        hi = min(lo + width, xb.size)
        sq = rowsq[r * per:r * per + (hi - lo) // D] if D > 0 else rowsq
        segment(xb[lo:hi], T, D, K, res[r], att[r], sq)
        if S > 1:
            unit_sums(xb[lo:hi], D, S, r * per, sq, units)
        K = res[r, 2] if res[r, 1] > 0 else K


@njit(cache=True)
def finish(res, att):
    """Chan's merge of the segment rows in float64 (max for max |x|, sums for the counts), laid
    out as FIELDS (and ATTN_FIELDS when ``att`` has columns)."""
    tot = res[0].copy()
    for r in range(1, res.shape[0]):
        b = res[r]
        na, nb = tot[1], b[1]
        n = na + nb
        if nb > 0:
            delta = b[2] - tot[2]
            tot[2] = tot[2] + delta * nb / n
            tot[3] = tot[3] + b[3] + delta * delta * na * nb / n
        tot[4] = max(tot[4], b[4])
        tot[0] += b[0]
        tot[1] = n
        for k in range(5, NRAW):
            tot[k] += b[k]
    out = np.zeros(10 + (6 if att.shape[1] else 0))
    zeros = tot[0] - tot[5]
    out[0] = tot[0]
    out[1] = tot[1]
    out[2] = tot[2]
    out[3] = tot[3]
    out[4] = tot[4]
    out[5] = zeros
    out[6] = tot[6] - zeros
    out[7] = tot[7]
    out[8] = tot[8] - zeros
    out[9] = tot[9]
    if att.shape[1]:
        rows = att[:, 0].sum()
        h1 = att[:, 1].sum()
        mean = h1 / rows
        # sums of squares per matrix are of O(1) entropies: a float64 one-pass M2 stays exact
        out[10] = rows
        out[11] = mean
        out[12] = max(att[:, 2].sum() - h1 * mean, 0.0)
        out[13] = att[:, 3].min()
        out[14] = att[:, 4].sum()
        out[15] = att[:, 5].sum()
    return out


@njit(cache=True)
def layout(n, T, D, probs):
    """(segments, res, att, rowsq) for n entries: flat (T = 0; rows of D entries when D > 0)
    or causal T x T matrices."""
    width = width_of(T, D)
    nseg = n // width if T > 0 else (n + width - 1) // width
    return nseg, np.empty((nseg, NRAW)), np.empty((nseg, 6 if probs else 0)), np.empty(n // D if D > 0 else 0)


@njit(cache=True)
def cosines(units, S):
    """The summary (FIELDS) of each sequence's mean cosine similarity between its different rows,
    from ``units`` (threads, sequences, D): per thread, each sequence's sum of the unit vectors
    u_t = x_t / |x_t| of the rows it read. |sum_t u_t|^2 = S + the sum over the S (S - 1)
    ordered pairs s != t of cos(x_s, x_t). The cosines are rounded to float32 (6e-8 relative)
    and summarised (:func:`diagnostics.measure.reference.cosines` keeps them in float64)."""
    cos = np.empty(units.shape[1], np.float32)
    for b in range(cos.size):
        u = units[0, b].copy()
        for c in range(1, units.shape[0]):
            u += units[c, b]
        cos[b] = ((u * u).sum() - S) / (S * (S - 1))
    nseg, res, att, rowsq = layout(cos.size, 0, 0, False)
    none = np.zeros((0, 0))
    segments(cos.view(np.uint32), 0, 0, 0, nseg, res, att, rowsq, 0, none)
    return finish(res, att)


@njit(cache=True)
def units_for(n, D, S, threads):
    """Zeroed (threads, sequences, D) sums of unit vectors for sequences of S > 1 rows of D
    entries, else an empty array."""
    if S < 2:
        return np.zeros((threads, 0, 0))
    return np.zeros((threads, n // (D * S), D))


@njit(cache=True)
def reduce_serial(xb, T, D, probs, S):
    """(summary, rowsq, cosine): the summary (FIELDS, then ATTN_FIELDS when ``probs``) of the
    float32 bits ``xb``: all of them (T = 0), or the causal entries of T x T matrices; for flat
    rows of D > 0 entries, each row's sum of x^2 (else empty); and, for sequences of S > 1 such
    rows, the summary of their :func:`cosines` (else empty)."""
    nseg, res, att, rowsq = layout(xb.size, T, D, probs)
    units = units_for(xb.size, D, S, 1)
    segments(xb, T, D, 0, nseg, res, att, rowsq, S, units[0])
    return finish(res, att), rowsq, cosines(units, S) if S > 1 else np.zeros(0)


@njit(parallel=True, cache=True)
def reduce_parallel(xb, T, D, probs, S, threads):
    """reduce_serial, the segments split over ``threads`` numba threads (each with its own sums
    of unit vectors, added at the end)."""
    nseg, res, att, rowsq = layout(xb.size, T, D, probs)
    units = units_for(xb.size, D, S, threads)
    for c in prange(threads):
        segments(xb, T, D, c * nseg // threads, (c + 1) * nseg // threads, res, att, rowsq, S, units[c])
    return finish(res, att), rowsq, cosines(units, S) if S > 1 else np.zeros(0)


@njit(cache=True)
def serial_at(addr, n, T, D, probs, S):
    """:func:`reduce_serial` of the n float32 entries at address ``addr``. Taking an address
    rather than an array spares the caller a numpy view of its tensor: in a hook, where the
    interpreter runs out of the caches, that view, its reshape and the typing of an array
    argument cost more than a small tensor's reduction."""
    return reduce_serial(carray(at(addr), n), T, D, probs, S)


@njit(cache=True)
def parallel_at(addr, n, T, D, probs, S, threads):
    """:func:`reduce_parallel` of the n float32 entries at address ``addr`` (a function apart
    from :func:`serial_at`, so that a program that reduces serially never starts the pool)."""
    return reduce_parallel(carray(at(addr), n), T, D, probs, S, threads)


@njit(cache=True)
def many_at(addrs, ns, T, probs):
    """(N, 16): :func:`reduce_serial`'s summary of each of N tensors, the ns[i] float32 entries at
    address addrs[i] (int64 arrays): every entry (T = 0) or the causal entries of T x T matrices,
    with the attention panel after the FIELDS where probs[i] (else columns 10: are 0). A tensor
    of no entries gets the summary of no values (zeros). The parameters and gradients of a
    probe's exit, or an attention's buffers, in one call rather than one each."""
    out = np.zeros((addrs.size, 16))
    for i in range(addrs.size):
        if ns[i] > 0:
            vec = reduce_serial(carray(at(addrs[i]), ns[i]), T, 0, probs[i], 0)[0]
            out[i, :vec.size] = vec
    return out


# -- the probe's queued requests with rows (:mod:`diagnostics.measure.pending_rows`): many tensors, each
# with its own request, and the per-token vectors made from their rows, in one call. Each tensor is
# reduced by reduce_serial exactly as summary_rows (rows of D entries) or summary (flat, D = 0) reduces it
# alone, and each per-token vector (1 / (ms + eps), or ms * w) is made in float32 as
# reduction._cpu makes it in numpy (ms = float32(sum of squares / D); IEEE float32 add, divide and
# multiply) and summarised as summary summarises it: the same bits as one call each. (Here, not in a
# module of its own: numba's cache is keyed on the file of the function it compiles, and this one
# inlines the loops above.) --

@njit(cache=True)
def below_count(xb, edge):
    """How many of the float32 entries (bits ``xb``) compare below the float32 ``edge``."""
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
            under[i] = below_count(xb, np.float32(edges[i]))  # compared in float32, as numpy and torch compare
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
