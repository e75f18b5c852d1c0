"""numba kernels behind :mod:`diagnostics.fused` (imported on first use: numba's import and its
on-disk cache load cost about a second, which a program that never probes should not pay).

Module-level functions, so that numba's ``cache=True`` finds them again in the next process.
Every loop reads the float32 bits (one uint32 array; a value is a register bitcast away) and
indexes a view from 0 (a loop from a variable start costs numba a negative-index wrap per
entry, and LLVM then gathers instead of loading). A block's raw row has :data:`NRAW` fields;
the finished vectors are the FIELDS of
:mod:`diagnostics.stats` (10) and, for attention probabilities, its ATTN_FIELDS (6).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# no nnan/ninf: the kernels rely on inf and NaN propagating through the sums
_FM = {"reassoc", "contract", "nsz", "arcp"}
I32 = ir.IntType(32)
F32 = np.float32
ABS = np.uint32(0x7FFFFFFF)
#: entries per block of a flat tensor (16 KiB of float32: fits the L1 cache); the entries of a
#: causal matrix are packed into blocks of at most this many
SEG = 4096
#: entropies of probability rows are summed in float32 over at most this many entries
CH = 256
#: raw row of one block: n, finite, mean, m2, max |x|, nonzero, |x| < 2^-14, finite |x| >= 2^16,
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


# -- the screening loop: float64 sums of d = x - K; no finiteness test per entry (a non-finite
# entry makes the sums non-finite, which sends the block to `exact`) --

#: lanes of the explicit vectors of :func:`screen_lanes`
LANES = 16


VI = ir.VectorType(I32, LANES)
VF = ir.VectorType(ir.FloatType(), LANES)
VD = ir.VectorType(ir.DoubleType(), LANES)


def _fn(builder, name, ret, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)


def _splat(builder, value, vty):
    undef = ir.Constant(vty, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(I32, 0)), undef,
                                  ir.Constant(VI, [0] * LANES))


@intrinsic
def screen_lanes(typingctx, xb, K):
    """(s1, s2, top, bot) of :func:`screen` over the first len(xb) // LANES * LANES entries.

    Written as explicit LANES-wide vectors: numba leaves LLVM's vectoriser at its preferred
    256-bit width, where each float64 operation covers 4 entries; these take the widest
    registers the CPU has (AVX-512: 8 float64 per operation, half the instructions per entry).
    Lane sums are added at the end."""
    sig = types.Tuple((types.float64, types.float64, types.uint32, types.uint32))(xb, K)

    def codegen(context, builder, signature, args):
        vi, vf, vd, f64 = VI, VF, VD, ir.DoubleType()
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(ary.shape, 0)
        end = builder.and_(n, ir.Constant(n.type, -LANES))
        k = _splat(builder, args[1], vd)
        a1 = cgutils.alloca_once_value(builder, ir.Constant(vd, [0.0] * LANES))
        a2 = cgutils.alloca_once_value(builder, ir.Constant(vd, [0.0] * LANES))
        hi = cgutils.alloca_once_value(builder, ir.Constant(vi, [0] * LANES))
        lo = cgutils.alloca_once_value(builder, ir.Constant(vi, [0x7FFFFFFF] * LANES))
        fma = _fn(builder, f"llvm.fma.v{LANES}f64", vd, vd, vd, vd)
        umax = _fn(builder, f"llvm.umax.v{LANES}i32", vi, vi, vi)
        umin = _fn(builder, f"llvm.umin.v{LANES}i32", vi, vi, vi)
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), end, ir.Constant(n.type, LANES)) as (i, _):
            bits = builder.load(builder.bitcast(builder.gep(ary.data, [i]), vi.as_pointer()), align=4)
            d = builder.fsub(builder.fpext(builder.bitcast(bits, vf), vd), k)
            builder.store(builder.fadd(builder.load(a1), d), a1)
            builder.store(builder.call(fma, [d, d, builder.load(a2)]), a2)
            m = builder.and_(bits, ir.Constant(vi, [0x7FFFFFFF] * LANES))
            builder.store(builder.call(umax, [builder.load(hi), m]), hi)
            builder.store(builder.call(umin, [builder.load(lo), m]), lo)
        add = _fn(builder, f"llvm.vector.reduce.fadd.v{LANES}f64", f64, f64, vd)
        s1 = builder.call(add, [ir.Constant(f64, 0.0), builder.load(a1)], fastmath=("reassoc",))
        s2 = builder.call(add, [ir.Constant(f64, 0.0), builder.load(a2)], fastmath=("reassoc",))
        top = builder.call(_fn(builder, f"llvm.vector.reduce.umax.v{LANES}i32", I32, vi), [builder.load(hi)])
        bot = builder.call(_fn(builder, f"llvm.vector.reduce.umin.v{LANES}i32", I32, vi), [builder.load(lo)])
        return context.make_tuple(builder, signature.return_type, [s1, s2, top, bot])
    return sig, codegen


@njit(fastmath=_FM, cache=True)
def screen(xb, K):
    """sum d and sum d^2 of d = x - K (float64), and the largest and smallest |x| bits."""
    s1, s2, top, bot = screen_lanes(xb, K)
    for i in range(xb.size - xb.size % LANES, xb.size):
        b = xb[i]
        d = np.float64(as_f32(b)) - K
        s1 += d
        s2 += d * d
        m = absbits(b)
        top = umax(top, m)
        bot = umin(bot, m)
    return s1, s2, top, bot


@intrinsic
def entropy(typingctx, pb):
    """-sum p ln p over probabilities p (float32 sums in LANES lanes, added at the end), and the
    bits of the largest p.

    ln p = k ln 2 + ln(1 + u) with p = (1 + u) 2^k, 1 + u in [sqrt(1/2), sqrt(2)): k is read
    off the bits of p / sqrt(1/2), 1 + u is p with its exponent replaced. Entries below
    2^-126 (and zeros) contribute 0. Explicit vectors, the last one loaded under a mask (rows
    are short: a scalar remainder would cost as much as the rest).
    """
    sig = types.Tuple((types.float64, types.uint32))(pb)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(ary.shape, 0)
        n32 = builder.trunc(n, I32)
        iota = ir.Constant(VI, list(range(LANES)))
        h = cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES))
        hi = cgutils.alloca_once_value(builder, ir.Constant(VI, [0] * LANES))
        load = _fn(builder, f"llvm.masked.load.v{LANES}i32.p0", VI, VI.as_pointer(), I32,
                   ir.VectorType(ir.IntType(1), LANES), VI)
        fma = _fn(builder, f"llvm.fma.v{LANES}f32", VF, VF, VF, VF)
        umax = _fn(builder, f"llvm.umax.v{LANES}i32", VI, VI, VI)
        const = lambda v: ir.Constant(VF, [float(v)] * LANES)  # noqa: E731  (float32 values: exact)
        ints = lambda v: ir.Constant(VI, [int(v)] * LANES)  # noqa: E731
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), n, ir.Constant(n.type, LANES)) as (i, _):
            lanes = builder.add(iota, _splat(builder, builder.trunc(i, I32), VI))
            mask = builder.icmp_unsigned("<", lanes, _splat(builder, n32, VI))
            ptr = builder.bitcast(builder.gep(ary.data, [i]), VI.as_pointer())
            b = builder.call(load, [ptr, ir.Constant(I32, 4), mask, ints(0)])
            k = builder.ashr(builder.sub(b, ints(0x3F3504F3)), ints(23))
            u = builder.fsub(builder.bitcast(builder.sub(b, builder.shl(k, ints(23))), VF), const(1.0))
            poly = const(P9)
            for c in (P8, P7, P6, P5, P4, P3, P2, P1, P0):
                poly = builder.call(fma, [poly, u, const(c)])
            ln = builder.call(fma, [builder.sitofp(k, VF), const(LN2), builder.fmul(u, poly)])
            term = builder.fmul(builder.bitcast(b, VF), ln)
            keep = builder.icmp_unsigned(">=", b, ints(E1))
            builder.store(builder.fsub(builder.load(h), builder.select(keep, term, const(0.0))), h)
            builder.store(builder.call(umax, [builder.load(hi), builder.and_(b, ints(ABS))]), hi)
        add = _fn(builder, f"llvm.vector.reduce.fadd.v{LANES}f32", f32, f32, VF)
        total = builder.call(add, [ir.Constant(f32, 0.0), builder.load(h)], fastmath=("reassoc",))
        top = builder.call(_fn(builder, f"llvm.vector.reduce.umax.v{LANES}i32", I32, VI), [builder.load(hi)])
        return context.make_tuple(builder, signature.return_type, [builder.fpext(total, ir.DoubleType()), top])
    return sig, codegen


@njit(cache=True)
def row_panel(pb):
    """The entropy of one row of probabilities (float32 sums over chunks of CH entries, added in
    float64) and the bits of its largest entry."""
    h = 0.0
    top = np.uint32(0)
    for c in range(0, pb.size, CH):
        hc, tc = entropy(pb[c:min(c + CH, pb.size)])
        h += hc
        top = max(top, tc)
    return h, top


# -- loops over a whole block, for the rare cases --

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
def exact(xb, K, acc):
    """Add to acc (s1, s2, max |x|, finite, nonzero, lt113, ge143, e0, e254) every count, the largest
    finite |x| and float64 sums of d = x - K over the finite entries (a block that holds a
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
def block(xb, K, out):
    """Reduce one contiguous block of float32 bits into ``out`` (NRAW): a segment of a flat
    tensor, or the packed causal entries of attention matrices.

    The screening loop sums d = x - K and d^2 in float64 and keeps the largest and smallest
    |x| (as bits: non-negative floats order as their bits do); M2 = sum d^2 - (sum d)^2 / n
    is then exact to ~1e-16 (1 + ((K - mean) / std)^2). Sums that are not finite mean a
    non-finite entry: a second loop then counts everything and sums the finite entries.
    Otherwise the extremes settle the counts when 2^-14 <= |x| < 2^16 throughout (most
    activations) or every |x| is normal and below 2^-14 (most gradients), and a second loop
    over the block (still in the cache) counts them when not.
    """
    n = xb.size
    s1, s2, top, bot = screen(xb, K)
    nf, nz, lt113, ge143, e0, e254 = n, n, 0, 0, 0, 0
    mx = np.float64(as_f32(top))
    if not (np.isfinite(s1) and np.isfinite(s2)):
        acc = np.zeros(9)
        exact(xb, K, acc)
        s1, s2, mx = acc[0], acc[1], acc[2]
        nf, nz, lt113, ge143, e0, e254 = int(acc[3]), int(acc[4]), int(acc[5]), int(acc[6]), int(acc[7]), int(acc[8])
    else:
        if bot >= E113:  # 2^-14 <= |x| < 2^16 throughout
            pass
        elif top < E113 and bot >= E1:  # normal and below 2^-14 throughout (most gradients)
            lt113 = n
        else:
            c = small(xb)
            nz, lt113, e0 = c[0], c[1], c[2]
        if top >= E143:  # finite values at or above 2^16: count them
            for i in range(n):
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
def shift_after(row, K):
    """The shift for the next block: this block's mean, or K when it had no finite entry."""
    return row[2] if row[1] > 0 else K


@njit(cache=True)
def chunks(T):
    """(blocks, entries per block) of one causal T x T matrix: its T (T + 1) / 2 entries on or
    below the diagonal, cut into blocks of at most SEG, as even as can be."""
    nv = T * (T + 1) // 2
    c = (nv + SEG - 1) // SEG
    return c, (nv + c - 1) // c


@njit(cache=True)
def copy(src, dst):
    """dst[:] = src[:]."""
    for i in range(src.size):
        dst[i] = src[i]


@njit(cache=True)
def causal(xb, T, K, res, att, buf):
    """Reduce one causal T x T matrix ``xb`` (bits): its rows' entries on or below the diagonal
    (row t: the first t + 1) are copied, in order, into ``buf`` and reduced block by block (as
    a flat tensor is: no per-row loop tails in the screening loop), into the rows of ``res``
    (one per block). Probabilities (``att`` has room) also get each row's entropy and largest
    entry, from the row just read: att = rows, entropy sum, entropy sum of squares, min entropy
    over rows t >= 1, rows t >= 1, saturated rows t >= 1 (max p > 0.99). Returns the next shift."""
    c, q = chunks(T)
    probs = att.size > 0
    h1 = h2 = 0.0
    hmin = np.inf
    sat = 0
    f = 0
    r = 0
    for t in range(T):
        lo = t * T
        n = t + 1
        if probs:
            h, tp = row_panel(xb[lo:lo + n])
            h1 += h
            h2 += h * h
            if t >= 1:
                hmin = min(hmin, h)
                sat += as_f32(tp) > SATURATED
        while n > 0:
            m = min(n, q - f)
            copy(xb[lo:lo + m], buf[f:f + m])
            f += m
            lo += m
            n -= m
            if f == q:
                block(buf[:f], K, res[r])
                K = shift_after(res[r], K)
                r += 1
                f = 0
    if f > 0:
        block(buf[:f], K, res[r])
        K = shift_after(res[r], K)
    if probs:
        att[0] = T
        att[1] = h1
        att[2] = h2
        att[3] = hmin
        att[4] = T - 1
        att[5] = sat
    return K


@njit(cache=True)
def segments(xb, T, r0, r1, res, att):
    """Fill the rows of ``res`` (and ``att``) that belong to segments r0 <= r < r1: flat (T = 0),
    the block xb[r*SEG : (r+1)*SEG] (the last: what is left); causal, the r-th T x T matrix
    (its blocks: rows r*c ... (r+1)*c - 1 of ``res``). Each block is shifted by the mean of the
    one before it (the first: by its first entry, or 0 if that is not finite), so that
    homogeneous data is summed about a shift near its mean."""
    if r1 <= r0:
        return
    if T > 0:
        c, q = chunks(T)
        buf = np.empty(q, np.uint32)
        K = first_shift(xb[r0 * T * T])
        for r in range(r0, r1):
            lo = r * T * T
            K = causal(xb[lo:lo + T * T], T, K, res[r * c:(r + 1) * c], att[r], buf)
    else:
        K = first_shift(xb[r0 * SEG])
        for r in range(r0, r1):
            lo = r * SEG
            block(xb[lo:min(lo + SEG, xb.size)], K, res[r])
            K = shift_after(res[r], K)


@njit(cache=True)
def finish(res, att):
    """Chan's merge of the block rows in float64 (max for max |x|, sums for the counts), laid
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
def layout(n, T, probs):
    """(segments, res, att) for n entries: flat (T = 0) or causal T x T matrices."""
    if T > 0:
        nseg = n // (T * T)
        nrows = nseg * chunks(T)[0]
    else:
        nseg = (n + SEG - 1) // SEG
        nrows = nseg
    return nseg, np.empty((nrows, NRAW)), np.empty((nseg, 6 if probs else 0))


@njit(cache=True)
def reduce_serial(xb, T, probs):
    """The summary (FIELDS, then ATTN_FIELDS when ``probs``) of the float32 bits ``xb``: all of
    them (T = 0), or the causal entries of T x T matrices."""
    nseg, res, att = layout(xb.size, T, probs)
    segments(xb, T, 0, nseg, res, att)
    return finish(res, att)


@njit(parallel=True, cache=True)
def reduce_parallel(xb, T, probs, threads):
    """reduce_serial, the segments split over ``threads`` numba threads."""
    nseg, res, att = layout(xb.size, T, probs)
    for c in prange(threads):
        segments(xb, T, c * nseg // threads, (c + 1) * nseg // threads, res, att)
    return finish(res, att)
