"""numba kernels behind :mod:`diagnostics.fused` (imported on first use: numba's import and its
on-disk cache load cost about a second, which a program that never probes should not pay).

Module-level functions, so that numba's ``cache=True`` finds them again in the next process.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# no nnan/ninf: the kernels look at non-finite values
_FM = {"reassoc", "contract", "nsz", "arcp"}
ABS = np.uint32(0x7FFFFFFF)
INF = np.uint32(0x7F800000)
F32 = np.float32
LN2 = F32(math.log(2.0))
# ln(1 + u) = u P(u) on u in [sqrt(1/2) - 1, sqrt(2) - 1]: P of degree 9, a least-squares Chebyshev
# fit of log1p(u)/u on 4000 Chebyshev nodes, rounded to float32. Fit error 4e-9 relative;
# evaluated in float32, 1.2e-7 (tests/test_fused.py checks every binade). A polynomial, not
# the atanh series, because a division per entry keeps the loop from vectorising.
P0, P1, P2, P3, P4, P5, P6, P7, P8, P9 = (F32(c) for c in (
    1.0, -0.49999988079071045, 0.33333325386047363, -0.25001585483551025, 0.2000207155942917,
    -0.16609126329421997, 0.14180079102516174, -0.13240842521190643, 0.129141703248024, -0.07638592272996902))


@intrinsic
def as_f32(typingctx, bits):
    """The float32 whose bits are the uint32 ``bits`` (a register bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# exponent-field boundaries, as bits of |x|: 2^-126 (smallest normal), 2^-14 (fp16's smallest
# normal), 2^16 (above fp16's largest finite), 2^127 (bf16's top binade)
E1 = np.uint32(1 << 23)
E113 = np.uint32(113 << 23)
E143 = np.uint32(143 << 23)
E254 = np.uint32(254 << 23)


@njit(fastmath=_FM, cache=True)
def screen(x, xb, K):
    """sum d, sum d^2 of the finite d = x - K (float64), and the largest and smallest |x| bits."""
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    for i in range(x.size):
        m = xb[i] & ABS
        d = np.float64(x[i]) - K if m < INF else 0.0
        s1 += d
        s2 += d * d
        top = max(top, m)
        bot = min(bot, m)
    return s1, s2, top, bot


@njit(fastmath=_FM, cache=True)
def small(xb):
    """Counts of nonzero, |x| < 2^-14 and |x| < 2^-126 (zeros included in both)."""
    nz = lt113 = e0 = 0
    for i in range(xb.size):
        m = xb[i] & ABS
        nz += m != 0
        lt113 += m < E113
        e0 += m < E1
    return nz, lt113, e0


@njit(fastmath=_FM, cache=True)
def every(xb):
    """Every count and the largest finite |x| bits, for a segment holding large or non-finite values."""
    top = np.uint32(0)
    nf = nz = lt113 = ge143 = e0 = e254 = 0
    for i in range(xb.size):
        m = xb[i] & ABS
        fin = m < INF
        top = max(top, m if fin else np.uint32(0))
        nf += fin
        nz += m != 0
        lt113 += m < E113
        ge143 += (m >= E143) & fin
        e0 += m < E1
        e254 += (m >= E254) & fin
    return top, nf, nz, lt113, ge143, e0, e254


@njit(fastmath=_FM, cache=True)
def screen_small(x, xb, K):
    """screen and small in one loop (for causal rows, where the small side is nearly always open)."""
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    nz = lt113 = e0 = 0
    for i in range(x.size):
        m = xb[i] & ABS
        d = np.float64(x[i]) - K if m < INF else 0.0
        s1 += d
        s2 += d * d
        top = max(top, m)
        bot = min(bot, m)
        nz += m != 0
        lt113 += m < E113
        e0 += m < E1
    return s1, s2, top, bot, nz, lt113, e0


@njit(cache=True)
def span(x, T, t):
    """(lo, hi) of row t: all of x (T = 0), or the first t + 1 entries of row t of the T x T matrix x."""
    if T == 0:
        return 0, x.size
    return t * T, t * T + t + 1


@njit(cache=True)
def segment(x, xb, T, out):
    """One segment into out (the RAW layout): all of x (T = 0), or the entries on and below the
    diagonal of the T x T matrix x (row t: its first t + 1 entries).

    A screening loop accumulates sum d and sum d^2 of the finite d = x - K in float64, K = the
    segment's first entry (0 if not finite), and the largest and smallest |x| (as bits:
    non-negative floats order as their bits do). The counts need a second loop only where the
    extremes leave them open: none when 2^-14 <= |x| < 2^16 throughout (most activations) or
    when every |x| is normal and below 2^-14 (most gradients); the three small-side counts
    when the segment straddles 2^-14 or holds zeros or subnormals; every count when a value
    reaches 2^16 or is not finite. Causal rows are short and their small side is nearly always
    open (probabilities, their gradients), so there the screening loop counts it too. The shift keeps M2 = sum d^2 - (sum d)^2 / n exact to
    ~1e-16 ((K - mean) / std)^2 relative.
    """
    rows = 1 if T == 0 else T
    K = np.float64(x[0]) if (xb[0] & ABS) < INF else 0.0
    n = 0
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    nz = lt113 = e0 = 0
    for t in range(rows):
        lo, hi = span(x, T, t)
        if T == 0:
            a1, a2, tp, bt = screen(x[lo:hi], xb[lo:hi], K)
        else:
            a1, a2, tp, bt, c0, c1, c2 = screen_small(x[lo:hi], xb[lo:hi], K)
            nz += c0
            lt113 += c1
            e0 += c2
        n += hi - lo
        s1 += a1
        s2 += a2
        top = max(top, tp)
        bot = min(bot, bt)
    nf, ge143, e254 = n, 0, 0
    if top >= E143:
        top = np.uint32(0)
        nf = nz = lt113 = e0 = 0
        for t in range(rows):
            lo, hi = span(x, T, t)
            c = every(xb[lo:hi])
            top = max(top, c[0])
            nf += c[1]
            nz += c[2]
            lt113 += c[3]
            ge143 += c[4]
            e0 += c[5]
            e254 += c[6]
    elif T > 0:  # counted in the screening loop
        pass
    elif bot >= E113:  # 2^-14 <= |x| < 2^16 throughout
        nz = n
    elif top < E113 and bot >= E1:  # normal and below 2^-14 throughout (most gradients)
        nz, lt113 = n, n
    else:
        c = small(xb)
        nz, lt113, e0 = c[0], c[1], c[2]
    out[0] = n
    out[1] = nf
    out[2] = K + s1 / nf if nf > 0 else 0.0
    out[3] = max(s2 - s1 * s1 / nf, 0.0) if nf > 0 else 0.0
    out[4] = top
    out[5] = nz
    out[6] = lt113
    out[7] = ge143
    out[8] = e0
    out[9] = e254


@njit(cache=True)
def segments(x, xb, width, causal, r0, r1, res):
    """Fill res[r] for segments r0 <= r < r1: x[r*width : (r+1)*width] (the last: what is left),
    or, causal, the r-th T x T matrix, T = width."""
    for r in range(r0, r1):
        if causal:
            lo = r * width * width
            segment(x[lo:lo + width * width], xb[lo:lo + width * width], width, res[r])
        else:
            lo = r * width
            hi = min(lo + width, x.size)
            segment(x[lo:hi], xb[lo:hi], 0, res[r])


@njit(cache=True)
def merge(res):
    """Chan's merge of the segment rows, in float64 (max for max |x|, sums for the counts)."""
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
        for k in range(5, 10):
            tot[k] += b[k]
    return tot


@njit(cache=True)
def reduce_serial(x, xb, width, causal):
    nseg = x.size // (width * width) if causal else (x.size + width - 1) // width
    res = np.empty((nseg, 10))
    segments(x, xb, width, causal, 0, nseg, res)
    return merge(res)


@njit(parallel=True, cache=True)
def reduce_parallel(x, xb, width, causal, threads):
    nseg = x.size // (width * width) if causal else (x.size + width - 1) // width
    res = np.empty((nseg, 10))
    for c in prange(threads):
        segments(x, xb, width, causal, c * nseg // threads, (c + 1) * nseg // threads, res)
    return merge(res)


@njit(fastmath=_FM, cache=True)
def entropy_row(p, pb):
    """-sum p ln p and max p over one row of probabilities (float32 throughout: rows are short).

    ln p = k ln 2 + ln(1 + u) with p = (1 + u) 2^k, 1 + u in [sqrt(1/2), sqrt(2)): k is read
    off the bits of p / sqrt(1/2), 1 + u is p with its exponent replaced. Entries below
    2^-126 (and zeros) contribute 0.
    """
    h = F32(0.0)
    top = np.uint32(0)
    for i in range(p.size):
        b = pb[i]
        k = np.int32(b - np.uint32(0x3F3504F3)) >> 23
        u = as_f32(b - np.uint32(k << 23)) - F32(1.0)
        lnf = u * (P0 + u * (P1 + u * (P2 + u * (P3 + u * (P4 + u * (P5 + u * (P6 + u * (P7 + u * (P8 + u * P9)))))))))
        h -= p[i] * (F32(k) * LN2 + lnf) if b >= np.uint32(0x00800000) else F32(0.0)
        top = max(top, b)  # p >= 0: the largest bits are the largest p
    return h, as_f32(top)


@njit(cache=True)
def rows(p, pb, width, r0, r1, ent, top):
    """Entropy and max probability of causal rows r0 <= r < r1 (row r: the valid prefix of
    length r % width + 1)."""
    for r in range(r0, r1):
        lo = r * width
        hi = lo + r % width + 1
        ent[r], top[r] = entropy_row(p[lo:hi], pb[lo:hi])


@njit(cache=True)
def attention_serial(p, pb, width):
    n = p.size // width
    ent = np.empty(n)
    top = np.empty(n, dtype=np.float32)
    rows(p, pb, width, 0, n, ent, top)
    return ent, top


@njit(parallel=True, cache=True)
def attention_parallel(p, pb, width, threads):
    n = p.size // width
    ent = np.empty(n)
    top = np.empty(n, dtype=np.float32)
    for c in prange(threads):
        rows(p, pb, width, c * n // threads, (c + 1) * n // threads, ent, top)
    return ent, top
