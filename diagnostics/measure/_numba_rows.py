"""The numba loop of sampled attention rows: :func:`diagnostics.measure.sdpa.row_statistics` on a
CPU in one call (imported on first use, as :mod:`._numba`; a module-level function, so that
numba's ``cache=True`` finds it again in the next process).

A row is the logits of one query against every key (the scale and any additive mask applied),
the keys it may attend to and its softmax over those keys (torch's, one vectorised op for all
rows). The loop takes, per row, the softmax's entropy in float64 (ln p = (s - max) - ln z, with
ln z = -ln of the row's largest weight: one logarithm per row) and its largest weight (a row
with no allowed key, a NaN or a +inf among them is all zeros, as ``softmax(...).nan_to_num(0)``
gives), and over all rows the figures ``row_statistics`` returns: the FIELDS of the allowed
finite logits (mean and M2 in two passes, as :func:`.reference.moments`), the ATTN_FIELDS
panel and the SIGNAL vector. They agree with the torch formulas to the rounding of the
logarithms and of the order of the sums.
"""

import math

import numpy as np
from numba import njit

#: entries of the output: FIELDS (10), ATTN_FIELDS (6), SIGNAL (3)
OUT = 19


@njit(cache=True)
def scan(row, ok, acc):
    """Add row's allowed entries to ``acc`` (count, sum, max finite |x|, zeros, |x| < 2^-14,
    finite |x| >= 2^16, |x| < 2^-126, finite |x| >= 2^127, max |x| over all, NaN seen); returns
    (allowed keys, the largest allowed logit, whether one is NaN). Sums in locals, added once."""
    keys = n = zeros = h16u = h16o = b16u = b16o = 0
    total = big = largest = 0.0
    top = -np.inf
    bad = False
    for j in range(row.size):
        if not ok[j]:
            continue
        keys += 1
        x = np.float64(row[j])
        a = abs(x)
        if a < np.inf:
            n += 1
            total += x
            big = max(big, a)
            zeros += x == 0
            h16u += (a < 2.0 ** -14) & (x != 0)
            b16u += (a < 2.0 ** -126) & (x != 0)
            h16o += a >= 2.0 ** 16
            b16o += a >= 2.0 ** 127
        elif x != x:
            bad = True
        largest = max(largest, a)
        top = max(top, x)
    acc[0] += n
    acc[1] += total
    acc[2] = max(acc[2], big)
    acc[3] += zeros
    acc[4] += h16u
    acc[5] += h16o
    acc[6] += b16u
    acc[7] += b16o
    acc[8] = max(acc[8], largest)
    if bad:
        acc[9] = 1
    return keys, top, bad


@njit(cache=True)
def entropy(row, pr, ok, top):
    """(entropy in float64, largest weight) of one row's softmax ``pr`` of logits ``row``."""
    best = pr[0]
    for j in range(pr.size):
        if pr[j] > best:
            best = pr[j]
    lz = -math.log(np.float64(best))  # ln z: the largest weight is exp(0) / z
    ent = 0.0
    for j in range(pr.size):
        if ok[j] and pr[j] > 0:  # -p ln p, with ln p = (s - max) - ln z
            ent -= np.float64(pr[j]) * (np.float64(row[j] - top) - lz)
    return ent, best


@njit(cache=True)
def rows(s, p, allowed, out):
    """Fill ``out`` (OUT float64) from logits ``s`` (M, S) (float32 or float64), their softmax ``p``
    over the allowed keys (the same dtype and shape; torch's, vectorised) and ``allowed`` (A, S)
    bool, row m reading ``allowed[m % A]`` (A divides M: a mask broadcast over leading dims)."""
    M = s.shape[0]
    A = allowed.shape[0]
    sat = p.dtype.type(0.99)
    acc = np.zeros(10)
    h = np.zeros(M)
    keys = np.zeros(M, dtype=np.int64)
    saturated = 0
    ceiling = 0.0
    for m in range(M):
        ok = allowed[m % A]
        n, top, bad = scan(s[m], ok, acc)
        keys[m] = n
        ceiling += math.log(max(n, 1))
        if bad or n == 0 or top == np.inf or top == -np.inf:
            continue  # a row of zeros (softmax's NaN): entropy 0, largest weight 0
        h[m], best = entropy(s[m], p[m], ok, top)
        if n > 1 and best > sat:
            saturated += 1
    mean = acc[1] / max(acc[0], 1.0)
    m2 = 0.0
    for m in range(M):
        ok = allowed[m % A]
        for j in range(s.shape[1]):
            x = np.float64(s[m, j])
            if ok[j] and abs(x) < np.inf:
                m2 += (x - mean) * (x - mean)
    hmean = h.sum() / M if M else 0.0
    hm2 = 0.0
    lowest = math.inf
    for m in range(M):
        hm2 += (h[m] - hmean) * (h[m] - hmean)
        if keys[m] > 1 and h[m] < lowest:
            lowest = h[m]
    out[0], out[1], out[2], out[3], out[4] = acc[0], acc[0], mean, m2, acc[2]
    out[5], out[6], out[7], out[8], out[9] = acc[3], acc[4], acc[5], acc[6], acc[7]
    out[10], out[11], out[12], out[13], out[14], out[15] = M, hmean, hm2, lowest, (keys > 1).sum(), saturated
    out[16] = np.nan if acc[9] else acc[8]
    out[17], out[18] = ceiling, M


#: bits of the radix select's digit (a table of 2^11 counts: small enough to clear at each pass)
_DIGIT = 11


@njit(cache=True)
def _select(bits, k, width):
    """The k-th smallest (0-based) of ``bits``, unsigned integers of ``width`` bits (the bit
    patterns of non-negative floats, which order as the floats do), as a uint64: a radix select,
    :data:`_DIGIT` bits a pass from the top, each pass counting the entries that share the
    prefix found so far."""
    count = np.zeros(1 << _DIGIT, dtype=np.int64)
    prefix = np.uint64(0)
    left = np.int64(k)
    hi = width
    while hi > 0:
        lo = max(hi - _DIGIT, 0)
        nb = hi - lo
        mask = np.uint64((1 << nb) - 1)
        count[:] = 0
        for i in range(bits.size):
            b = np.uint64(bits[i])
            if hi == width or (b >> np.uint64(hi)) == prefix:
                count[np.int64((b >> np.uint64(lo)) & mask)] += 1
        digit = 0
        while left >= count[digit]:
            left -= count[digit]
            digit += 1
        prefix = (prefix << np.uint64(nb)) | np.uint64(digit)
        hi = lo
    return prefix


@njit(cache=True)
def peak(a, idx, top):
    """max |x| / median |x| of :func:`diagnostics.measure.signals.peak_ratio` from ``a`` (N, d),
    float32 or float64, its sampled rows ``idx`` (int64) and ``top`` = max |x| over every finite
    entry: the median torch's (the lower of the two middle values) of the finite |x| of those
    rows, an entry of them (selected exactly: :func:`_select`), so the ratio has the torch
    formula's bits. NaN when that median is 0 or no entry is finite."""
    buf = np.empty(idx.size * a.shape[1], dtype=a.dtype)
    m = 0
    for r in idx:
        row = a[r]
        for j in range(row.size):
            v = abs(row[j])
            if v < np.inf:
                buf[m] = v
                m += 1
    if m == 0:
        return np.nan
    k = (m - 1) // 2
    if a.itemsize == 4:  # float32
        got = np.array([_select(buf[:m].view(np.uint32), k, 32)], dtype=np.uint64).astype(np.uint32)
        median = np.float64(got.view(np.float32)[0])
    else:
        median = np.array([_select(buf[:m].view(np.uint64), k, 64)], dtype=np.uint64).view(np.float64)[0]
    return top / median if median > 0 else np.nan
