"""numba kernels behind :mod:`diagnostics.fused` (imported on first use: numba's import and its
on-disk cache load cost about a second, which a program that never probes should not pay).

Module-level functions, so that numba's ``cache=True`` finds them again in the next process.
Row layouts: a segment's raw row is :data:`RAW`; the finished vectors are the FIELDS of
:mod:`diagnostics.stats` (10) and, for attention probabilities, its ATTN_FIELDS (6).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# no nnan/ninf: the kernels rely on inf and NaN propagating through the sums
_FM = {"reassoc", "contract", "nsz", "arcp"}
I32 = ir.IntType(32)
F32 = np.float32
ABS = np.uint32(0x7FFFFFFF)
#: entropies of probability rows are summed in float32 over at most this many entries
CH = 256
#: raw row of one segment: n, finite, mean, m2, max |x|, nonzero, |x| < 2^-14, finite |x| >= 2^16,
#: |x| < 2^-126, finite |x| >= 2^127 (zeros are in both small counts)
NRAW = 10
# exponent-field boundaries, as bits of |x|: 2^-126 (smallest normal), 2^-14 (fp16's smallest
# normal), 2^16 (above fp16's largest finite), 2^127 (bf16's top binade), inf
E1 = np.uint32(1 << 23)
E113 = np.uint32(113 << 23)
E143 = np.uint32(143 << 23)
E254 = np.uint32(254 << 23)
INF = np.uint32(0x7F800000)
SATURATED = F32(0.99)
LN2 = F32(math.log(2.0))
# ln(1 + u) = u P(u) on u in [sqrt(1/2) - 1, sqrt(2) - 1]: P of degree 9, a least-squares Chebyshev
# fit of log1p(u)/u on 4000 Chebyshev nodes, rounded to float32. Fit error 4e-9 relative;
# evaluated in float32, 1.2e-7 (tests/test_fused.py checks every binade). A polynomial, not
# the atanh series, because a division per entry keeps the loop from vectorising.
P0, P1, P2, P3, P4, P5, P6, P7, P8, P9 = (F32(c) for c in (
    1.0, -0.49999988079071045, 0.33333325386047363, -0.25001585483551025, 0.2000207155942917,
    -0.16609126329421997, 0.14180079102516174, -0.13240842521190643, 0.129141703248024, -0.07638592272996902))


# numba widens integer arithmetic to 64 bits, which halves the lanes of a vectorised loop;
# these keep the bit tests and counters of the screening loops in 32 bits.
@intrinsic
def as_f32(typingctx, bits):
    """The float32 whose bits are the uint32 ``bits`` (a register bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def absbits(typingctx, bits):
    """The bits of |x| from the bits of x (sign cleared)."""
    def codegen(context, builder, signature, args):
        return builder.and_(args[0], ir.Constant(I32, 0x7FFFFFFF))
    return types.uint32(types.uint32), codegen


def _u32_intrinsic(name):
    @intrinsic
    def f(typingctx, a, b):
        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic(name, [I32], ir.FunctionType(I32, [I32, I32]))
            return builder.call(fn, args)
        return types.uint32(types.uint32, types.uint32), codegen
    return f


umax = _u32_intrinsic("llvm.umax")
umin = _u32_intrinsic("llvm.umin")


@intrinsic
def count(typingctx, acc, flag):
    """acc + flag (a bool), in 32 bits."""
    def codegen(context, builder, signature, args):
        return builder.add(args[0], builder.zext(args[1], I32))
    return types.uint32(types.uint32, types.boolean), codegen


# -- screening loops: float64 sums of d = x - K; no finiteness test per entry (a non-finite
# entry makes the sums non-finite, which sends the segment to `exact`) --

@njit(fastmath=_FM, cache=True)
def screen(x, xb, K):
    """sum d and sum d^2 of d = x - K (float64), and the largest and smallest |x| bits."""
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    for i in range(x.size):
        d = np.float64(x[i]) - K
        s1 += d
        s2 += d * d
        m = absbits(xb[i])
        top = umax(top, m)
        bot = umin(bot, m)
    return s1, s2, top, bot


@njit(fastmath=_FM, cache=True)
def screen_small(x, xb, K):
    """screen, and the counts of nonzero, |x| < 2^-14 and |x| < 2^-126 (causal rows, where the
    small side is nearly always open)."""
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    nz = np.uint32(0)
    lt113 = np.uint32(0)
    e0 = np.uint32(0)
    for i in range(x.size):
        d = np.float64(x[i]) - K
        s1 += d
        s2 += d * d
        m = absbits(xb[i])
        top = umax(top, m)
        bot = umin(bot, m)
        nz = count(nz, m != np.uint32(0))
        lt113 = count(lt113, m < E113)
        e0 = count(e0, m < E1)
    return s1, s2, top, bot, nz, lt113, e0


@njit(fastmath=_FM, cache=True)
def entropy(p, pb):
    """-sum p ln p over probabilities p (float32).

    ln p = k ln 2 + ln(1 + u) with p = (1 + u) 2^k, 1 + u in [sqrt(1/2), sqrt(2)): k is read
    off the bits of p / sqrt(1/2), 1 + u is p with its exponent replaced. Entries below
    2^-126 (and zeros) contribute 0.
    """
    h = F32(0.0)
    for i in range(p.size):
        b = pb[i]
        k = np.int32(b - np.uint32(0x3F3504F3)) >> 23
        u = as_f32(b - np.uint32(k << 23)) - F32(1.0)
        lnf = u * (P0 + u * (P1 + u * (P2 + u * (P3 + u * (P4 + u * (P5 + u * (P6 + u * (P7 + u * (P8 + u * P9)))))))))
        h -= p[i] * (F32(k) * LN2 + lnf) if b >= E1 else F32(0.0)
    return h


# -- loops over a whole segment, for the rare cases --

@njit(fastmath=_FM, cache=True)
def small(xb):
    """Counts of nonzero, |x| < 2^-14 and |x| < 2^-126 (zeros included in both)."""
    nz = np.uint32(0)
    lt113 = np.uint32(0)
    e0 = np.uint32(0)
    for i in range(xb.size):
        m = absbits(xb[i])
        nz = count(nz, m != np.uint32(0))
        lt113 = count(lt113, m < E113)
        e0 = count(e0, m < E1)
    return nz, lt113, e0


@njit(cache=True)
def exact(x, xb, K, acc):
    """Add to acc (s1, s2, max |x|, finite, nonzero, lt113, ge143, e0, e254) every count, the largest
    finite |x| and float64 sums of d = x - K over the finite entries (a segment that holds a
    non-finite value)."""
    for i in range(x.size):
        m = xb[i] & ABS
        fin = m < INF
        if fin:
            d = np.float64(x[i]) - K
            acc[0] += d
            acc[1] += d * d
            acc[2] = max(acc[2], np.float64(abs(x[i])))
            acc[3] += 1
            acc[6] += m >= E143
            acc[7] += m < E1
            acc[8] += m >= E254
        acc[4] += m != 0
        acc[5] += m < E113


# -- one segment: a flat block, or one causal T x T matrix (row t: its first t + 1 entries) --

@njit(cache=True)
def span(x, T, t):
    """(lo, hi) of row t: all of x (T = 0), or the first t + 1 entries of row t of the T x T matrix x."""
    if T == 0:
        return 0, x.size
    return t * T, t * T + t + 1


@njit(cache=True)
def segment(x, xb, T, K, out, att):
    """Reduce one segment into ``out`` (NRAW) and, when ``att`` has room, its attention partials
    (rows, entropy sum, entropy sum of squares, min entropy over rows t >= 1, rows t >= 1,
    saturated rows t >= 1) into ``att``.

    The screening loop sums d = x - K and d^2 in float64 and keeps the largest and smallest
    |x| (as bits: non-negative floats order as their bits do); M2 = sum d^2 - (sum d)^2 / n
    is then exact to ~1e-16 (1 + ((K - mean) / std)^2). Sums that are not finite mean a
    non-finite entry: a second loop then counts everything and sums the finite entries.
    Otherwise the extremes settle the counts of a flat segment when 2^-14 <= |x| < 2^16
    throughout (most activations) or every |x| is normal and below 2^-14 (most gradients),
    and a second loop over the segment (still in the cache) counts them when not; causal rows
    count their small side in the screening loop. Probabilities (``att``) also get each row's
    entropy (float32 over chunks of CH entries) and largest entry from the same read.
    """
    rows = 1 if T == 0 else T
    n = x.size if T == 0 else T * (T + 1) // 2
    s1 = 0.0
    s2 = 0.0
    top = np.uint32(0)
    bot = ABS
    nz = lt113 = e0 = 0
    probs = att.size > 0
    h1 = h2 = 0.0
    hmin = np.inf
    sat = 0
    for t in range(rows):
        lo, hi = span(x, T, t)
        if T == 0:
            a1, a2, tp, bt = screen(x, xb, K)
        else:
            a1, a2, tp, bt, c0, c1, c2 = screen_small(x[lo:hi], xb[lo:hi], K)
            nz += c0
            lt113 += c1
            e0 += c2
            if probs:
                h = 0.0
                for c in range(lo, hi, CH):
                    e = min(c + CH, hi)
                    h += entropy(x[c:e], xb[c:e])
                h1 += h
                h2 += h * h
                if t >= 1:
                    hmin = min(hmin, h)
                    sat += as_f32(tp) > SATURATED
        s1 += a1
        s2 += a2
        top = max(top, tp)
        bot = min(bot, bt)
    nf, ge143, e254 = n, 0, 0
    mx = np.float64(as_f32(top))
    if not (np.isfinite(s1) and np.isfinite(s2)):
        acc = np.zeros(9)
        for t in range(rows):
            lo, hi = span(x, T, t)
            exact(x[lo:hi], xb[lo:hi], K, acc)
        s1, s2, mx = acc[0], acc[1], acc[2]
        nf, nz, lt113, ge143, e0, e254 = int(acc[3]), int(acc[4]), int(acc[5]), int(acc[6]), int(acc[7]), int(acc[8])
    else:
        if T > 0:  # counted in the screening loop
            pass
        elif bot >= E113:  # 2^-14 <= |x| < 2^16 throughout
            nz = n
        elif top < E113 and bot >= E1:  # normal and below 2^-14 throughout (most gradients)
            nz, lt113 = n, n
        else:
            c = small(xb)
            nz, lt113, e0 = c[0], c[1], c[2]
        if top >= E143:  # finite values at or above 2^16: count them
            for t in range(rows):
                lo, hi = span(x, T, t)
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
    if probs:
        att[0] = rows
        att[1] = h1
        att[2] = h2
        att[3] = hmin
        att[4] = rows - 1
        att[5] = sat


@njit(cache=True)
def first_finite(x):
    """x[0] as the first shift, or 0 when it is not finite."""
    return np.float64(x[0]) if np.isfinite(x[0]) else 0.0


@njit(cache=True)
def segments(x, xb, width, causal, r0, r1, res, att):
    """Fill res[r] (and att[r]) for segments r0 <= r < r1: x[r*width : (r+1)*width] (the last:
    what is left), or, causal, the r-th T x T matrix, T = width. Each segment is shifted by
    the mean of the one before it (the first: by its first entry, or 0 if that is not finite),
    so that homogeneous data is summed about a shift near its mean."""
    K = 0.0
    for r in range(r0, r1):
        if causal:
            lo = r * width * width
            hi = lo + width * width
        else:
            lo = r * width
            hi = min(lo + width, x.size)
        if r == r0:
            K = first_finite(x[lo:hi])
        segment(x[lo:hi], xb[lo:hi], width if causal else 0, K, res[r], att[r])
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
def reduce_serial(x, xb, width, causal, probs):
    nseg = x.size // (width * width) if causal else (x.size + width - 1) // width
    res = np.empty((nseg, NRAW))
    att = np.empty((nseg, 6 if probs else 0))
    segments(x, xb, width, causal, 0, nseg, res, att)
    return finish(res, att)


@njit(parallel=True, cache=True)
def reduce_parallel(x, xb, width, causal, probs, threads):
    nseg = x.size // (width * width) if causal else (x.size + width - 1) // width
    res = np.empty((nseg, NRAW))
    att = np.empty((nseg, 6 if probs else 0))
    for c in prange(threads):
        segments(x, xb, width, causal, c * nseg // threads, (c + 1) * nseg // threads, res, att)
    return finish(res, att)
