"""The loops of the numba reducer, :mod:`diagnostics.measure.numba_reducer` (imported on first use: numba's import and its
on-disk cache load cost about a second, which a program that never probes should not pay).

Module-level functions, so that numba's ``cache=True`` finds them again in the next process.
Every loop reads the float32 bits (one uint32 array; a value is a register bitcast away); the
hot loops are explicit vectors written with llvmlite (see the section below), the rare ones
numba loops that index a view from 0 (a loop from a variable start costs numba a
negative-index wrap per entry, and LLVM then gathers instead of loading). A segment's raw row
has :data:`NRAW` fields; the finished vectors are the FIELDS of :mod:`diagnostics.measure.reference` (10)
and, for attention probabilities, its ATTN_FIELDS (6).
"""

import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# the loops rely on inf and NaN propagating through the sums: no fast-math flag but reassoc
# (on the final adds of lanes)
I32 = ir.IntType(32)
F32 = np.float32
ABS = np.uint32(0x7FFFFFFF)
#: entries per segment of a flat tensor (16 KiB of float32: fits the L1 cache)
SEG = 4096
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
# evaluated in float32, 1.2e-7 (tests/test_numba_reducer.py checks every binade). A polynomial, not
# the atanh series: no division per entry.
P0, P1, P2, P3, P4, P5, P6, P7, P8, P9 = (F32(c) for c in (
    1.0, -0.49999988079071045, 0.33333325386047363, -0.25001585483551025, 0.2000207155942917,
    -0.16609126329421997, 0.14180079102516174, -0.13240842521190643, 0.129141703248024, -0.07638592272996902))


@intrinsic
def at(typingctx, addr):
    """The uint32 pointer at the integer address ``addr`` (of memory the caller keeps alive)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], I32.as_pointer())
    return types.CPointer(types.uint32)(types.intp), codegen


@intrinsic
def as_f32(typingctx, bits):
    """The float32 whose bits are the uint32 ``bits`` (a register bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# -- explicit vector loops over the *rows* of a tensor's bits: flat (T = 0), one row of all its
# entries; causal (T > 0), the T rows of a T x T matrix, row t its first t + 1 entries. Full
# LANES-wide vectors, then the rest of the row as one vector loaded under a mask. numba leaves
# LLVM's vectoriser at its preferred 256-bit width (4 float64 per operation) and a scalar loop
# for each remainder; these take the widest registers the CPU has (AVX-512: 8 float64 per
# operation) and carry their accumulators across rows (causal rows are short). --

#: lanes of the explicit vectors
LANES = 16
VI = ir.VectorType(I32, LANES)
VF = ir.VectorType(ir.FloatType(), LANES)
VD = ir.VectorType(ir.DoubleType(), LANES)
MASK = ir.VectorType(ir.IntType(1), LANES)
#: how far ahead (bytes) the reading loops ask for the data they will read: in a hook the
#: tensor was written before other work and is read from memory, and the hardware prefetcher
#: alone leaves the loop waiting (benchmarks/bench_cold_read.py: the numba reducer against a plain
#: torch.sum of tensors just made by their op)
AHEAD = 4096


def _fn(builder, name, ret, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)


def _splat(builder, value, vty):
    undef = ir.Constant(vty, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(I32, 0)), undef,
                                  ir.Constant(VI, [0] * LANES))


def _ints(v):
    return ir.Constant(VI, [int(v)] * LANES)


def _tail(builder, full, length):
    """The <LANES x i1> mask of the vector that starts at entry ``full`` (a multiple of LANES):
    the lanes whose entry is before ``length``."""
    lanes = builder.add(ir.Constant(VI, list(range(LANES))), _splat(builder, builder.trunc(full, I32), VI))
    return builder.icmp_signed("<", lanes, _splat(builder, builder.trunc(length, I32), VI))


def _rows(builder, ary, T, D, body, row_end=None, prefetch=False):
    """Call body(bits, mask) for each vector of each row, then row_end(t) (mask None: all
    lanes; else the <LANES x i1> lanes in the row, the others loaded as 0). Rows: causal
    (T > 0), row t the first t + 1 entries of row t of a T x T matrix; flat, consecutive rows
    of D entries (D = the size: one row). ``prefetch``: each full vector also asks for the
    line :data:`AHEAD` bytes further on (causal: the same columns as many rows further down, a
    line the loop will read), so that a tensor read from memory arrives before it is needed."""
    n = builder.extract_value(ary.shape, 0)
    causal = builder.icmp_signed(">", T, ir.Constant(T.type, 0))
    stride = builder.select(causal, T, D)
    nrows = builder.select(causal, T, builder.sdiv(n, D))
    step = ir.Constant(n.type, LANES)
    load = _fn(builder, f"llvm.masked.load.v{LANES}i32.p0", VI, VI.as_pointer(), I32, MASK, VI)
    if prefetch:
        i8p = ir.IntType(8).as_pointer()
        pf = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), i8p, I32, I32, I32)
        entries = ir.Constant(n.type, AHEAD // 4)
        # causal: whole rows ahead, at least AHEAD bytes (rows t + k of a matrix exist for all
        # but the last k rows; past them the line is the next matrix's, or past the tensor,
        # which a prefetch may name: it never faults)
        down = builder.mul(builder.add(builder.sdiv(builder.sub(entries, ir.Constant(n.type, 1)), builder.select(
            causal, T, ir.Constant(n.type, 1))), ir.Constant(n.type, 1)), T)
        ahead = builder.select(causal, down, entries)
    with cgutils.for_range(builder, nrows) as loop:
        t = loop.index
        row = builder.gep(ary.data, [builder.mul(t, stride)])
        length = builder.select(causal, builder.add(t, ir.Constant(t.type, 1)), D)
        full = builder.and_(length, ir.Constant(n.type, -LANES))
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), full, step) as (i, _):
            if prefetch:
                builder.call(pf, [builder.bitcast(builder.gep(row, [builder.add(i, ahead)]), i8p),
                                  ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
            body(builder.load(builder.bitcast(builder.gep(row, [i]), VI.as_pointer()), align=4), None)
        with builder.if_then(builder.icmp_signed("<", full, length)):
            mask = _tail(builder, full, length)
            ptr = builder.bitcast(builder.gep(row, [full]), VI.as_pointer())
            body(builder.call(load, [ptr, ir.Constant(I32, 4), mask, _ints(0)]), mask)
        if row_end is not None:
            row_end(t)


def _reduce_add(builder, acc):
    """Sum of the lanes of an integer accumulator, as int64."""
    wide = ir.VectorType(ir.IntType(64), LANES)
    return builder.call(_fn(builder, f"llvm.vector.reduce.add.v{LANES}i64", ir.IntType(64), wide),
                        [builder.zext(acc, wide)])


def _screen(rows):
    """The codegen of :func:`screen` (``rows`` False) or :func:`screen_rows`."""
    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        k = _splat(builder, args[3], VD)
        zeros = ir.Constant(VD, [0.0] * LANES)
        a1 = cgutils.alloca_once_value(builder, zeros)
        a2 = cgutils.alloca_once_value(builder, zeros)
        hi = cgutils.alloca_once_value(builder, _ints(0))
        lo = cgutils.alloca_once_value(builder, _ints(ABS))
        fma = _fn(builder, f"llvm.fma.v{LANES}f64", VD, VD, VD, VD)
        umax = _fn(builder, f"llvm.umax.v{LANES}i32", VI, VI, VI)
        umin = _fn(builder, f"llvm.umin.v{LANES}i32", VI, VI, VI)
        add = _fn(builder, f"llvm.vector.reduce.fadd.v{LANES}f64", f64, f64, VD)
        rsq = cgutils.alloca_once_value(builder, zeros) if rows else None

        def body(bits, mask):
            x = builder.fpext(builder.bitcast(bits, VF), VD)
            d = builder.fsub(x, k)
            m = builder.and_(bits, _ints(ABS))
            if mask is not None:  # lanes past the row: d = 0 and |x| = 0 (neutral for the max)
                d = builder.select(mask, d, zeros)
            builder.store(builder.fadd(builder.load(a1), d), a1)
            builder.store(builder.call(fma, [d, d, builder.load(a2)]), a2)
            builder.store(builder.call(umax, [builder.load(hi), m]), hi)
            low = m if mask is None else builder.select(mask, m, _ints(ABS))
            builder.store(builder.call(umin, [builder.load(lo), low]), lo)
            if rows:  # flat rows are whole vectors but for their last: x = 0 past the row
                builder.store(builder.call(fma, [x, x, builder.load(rsq)]), rsq)

        def row_end(t):
            out = context.make_array(signature.args[4])(context, builder, args[4])
            total = builder.call(add, [ir.Constant(f64, 0.0), builder.load(rsq)], fastmath=("reassoc",))
            builder.store(total, builder.gep(out.data, [t]))
            builder.store(zeros, rsq)

        _rows(builder, ary, args[1], args[2], body, row_end if rows else None, prefetch=True)
        s1 = builder.call(add, [ir.Constant(f64, 0.0), builder.load(a1)], fastmath=("reassoc",))
        s2 = builder.call(add, [ir.Constant(f64, 0.0), builder.load(a2)], fastmath=("reassoc",))
        top = builder.call(_fn(builder, f"llvm.vector.reduce.umax.v{LANES}i32", I32, VI), [builder.load(hi)])
        bot = builder.call(_fn(builder, f"llvm.vector.reduce.umin.v{LANES}i32", I32, VI), [builder.load(lo)])
        return context.make_tuple(builder, signature.return_type, [s1, s2, top, bot])
    return codegen


_SCREENED = types.Tuple((types.float64, types.float64, types.uint32, types.uint32))


@intrinsic
def screen(typingctx, xb, T, D, K):
    """(s1, s2, top, bot): float64 sums of d = x - K and of d^2, and the largest and smallest
    |x| bits, over the rows of ``xb`` (see :func:`_rows`). Lane sums are added at the end.
    No finiteness test per entry: a non-finite entry makes the sums non-finite."""
    return _SCREENED(xb, T, D, K), _screen(False)


@intrinsic
def screen_rows(typingctx, xb, T, D, K, rowsq):
    """:func:`screen` of flat rows of D entries (T = 0), writing each row's sum of x^2 (float64)
    to ``rowsq`` from the same read."""
    return _SCREENED(xb, T, D, K, rowsq), _screen(True)


@intrinsic
def small(typingctx, xb, T):
    """Counts of nonzero, |x| < 2^-14 and |x| < 2^-126 (zeros included in both) over the rows of
    ``xb`` (flat T = 0: all of it; or causal)."""
    sig = types.UniTuple(types.int64, 3)(xb, T)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        accs = [cgutils.alloca_once_value(builder, _ints(0)) for _ in range(3)]

        def body(bits, mask):
            m = builder.and_(bits, _ints(ABS))
            for acc, op, bound in zip(accs, ("!=", "<", "<"), (0, E113, E1)):
                hit = builder.icmp_unsigned(op, m, _ints(bound))
                if mask is not None:
                    hit = builder.and_(hit, mask)
                builder.store(builder.add(builder.load(acc), builder.zext(hit, VI)), acc)

        _rows(builder, ary, args[1], builder.extract_value(ary.shape, 0), body)
        return context.make_tuple(builder, signature.return_type, [_reduce_add(builder, builder.load(a)) for a in accs])
    return sig, codegen


@intrinsic
def entropy_rows(typingctx, pb, T, hrow, toprow):
    """For each row t of the causal T x T matrix of probabilities ``pb`` (see :func:`_rows`):
    hrow[t] = -sum p ln p (float64 sums of float32 terms) and toprow[t] = the bits of its
    largest p.

    ln p = k ln 2 + ln(1 + u) with p = (1 + u) 2^k, 1 + u in [sqrt(1/2), sqrt(2)): k is read
    off the bits of p / sqrt(1/2), 1 + u is p with its exponent replaced, and ln(1 + u) =
    u P(u) with P evaluated by Estrin's scheme (a dependency chain of 4 operations instead of
    Horner's 9: rows are short, and the loop waited on the chain). Entries below 2^-126 (and
    zeros, and the lanes past a row) contribute 0. One loop over all rows, each row's sums
    reduced and stored at its end.
    """
    sig = types.void(pb, T, hrow, toprow)

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        hout = context.make_array(signature.args[2])(context, builder, args[2])
        tout = context.make_array(signature.args[3])(context, builder, args[3])
        zeros = ir.Constant(VD, [0.0] * LANES)
        h = cgutils.alloca_once_value(builder, zeros)
        hi = cgutils.alloca_once_value(builder, _ints(0))
        fma = _fn(builder, f"llvm.fma.v{LANES}f32", VF, VF, VF, VF)
        umax = _fn(builder, f"llvm.umax.v{LANES}i32", VI, VI, VI)
        const = lambda v: ir.Constant(VF, [float(v)] * LANES)  # noqa: E731  (float32 values: exact)

        def body(b, mask):  # lanes past the row hold 0: below 2^-126, they add nothing
            k = builder.ashr(builder.sub(b, _ints(0x3F3504F3)), _ints(23))
            u = builder.fsub(builder.bitcast(builder.sub(b, builder.shl(k, _ints(23))), VF), const(1.0))
            u2 = builder.fmul(u, u)
            u4 = builder.fmul(u2, u2)
            a = [builder.call(fma, [const(c1), u, const(c0)]) for c0, c1 in ((P0, P1), (P2, P3), (P4, P5), (P6, P7), (P8, P9))]
            low = builder.call(fma, [a[1], u2, a[0]])
            mid = builder.call(fma, [a[3], u2, a[2]])
            poly = builder.call(fma, [builder.call(fma, [a[4], u4, mid]), u4, low])
            ln = builder.call(fma, [builder.sitofp(k, VF), const(LN2), builder.fmul(u, poly)])
            term = builder.fmul(builder.bitcast(b, VF), ln)
            keep = builder.icmp_unsigned(">=", b, _ints(E1))
            wide = builder.fpext(builder.select(keep, term, const(0.0)), VD)
            builder.store(builder.fsub(builder.load(h), wide), h)
            builder.store(builder.call(umax, [builder.load(hi), builder.and_(b, _ints(ABS))]), hi)

        add = _fn(builder, f"llvm.vector.reduce.fadd.v{LANES}f64", f64, f64, VD)
        top = _fn(builder, f"llvm.vector.reduce.umax.v{LANES}i32", I32, VI)

        def row_end(t):
            total = builder.call(add, [ir.Constant(f64, 0.0), builder.load(h)], fastmath=("reassoc",))
            builder.store(total, builder.gep(hout.data, [t]))
            builder.store(builder.call(top, [builder.load(hi)]), builder.gep(tout.data, [t]))
            builder.store(zeros, h)
            builder.store(_ints(0), hi)

        _rows(builder, ary, args[1], args[1], body, row_end, prefetch=True)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def add_scaled(typingctx, xb, scale, acc):
    """acc += scale * x over the float32 bits ``xb`` (a row; float64 products and sums), in
    LANES-wide vectors, the last loaded and stored under a mask."""
    sig = types.void(xb, scale, acc)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.args[2])(context, builder, args[2])
        n = builder.extract_value(ary.shape, 0)
        k = _splat(builder, args[1], VD)
        fma = _fn(builder, f"llvm.fma.v{LANES}f64", VD, VD, VD, VD)
        load = _fn(builder, f"llvm.masked.load.v{LANES}i32.p0", VI, VI.as_pointer(), I32, MASK, VI)
        loadd = _fn(builder, f"llvm.masked.load.v{LANES}f64.p0", VD, VD.as_pointer(), I32, MASK, VD)
        stored = _fn(builder, f"llvm.masked.store.v{LANES}f64.p0", ir.VoidType(), VD, VD.as_pointer(), I32, MASK)
        full = builder.and_(n, ir.Constant(n.type, -LANES))
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), full, ir.Constant(n.type, LANES)) as (i, _):
            x = builder.fpext(builder.bitcast(builder.load(builder.bitcast(builder.gep(ary.data, [i]), VI.as_pointer()),
                                                           align=4), VF), VD)
            ptr = builder.bitcast(builder.gep(out.data, [i]), VD.as_pointer())
            builder.store(builder.call(fma, [x, k, builder.load(ptr, align=8)]), ptr, align=8)
        with builder.if_then(builder.icmp_signed("<", full, n)):
            mask = _tail(builder, full, n)
            bits = builder.call(load, [builder.bitcast(builder.gep(ary.data, [full]), VI.as_pointer()),
                                       ir.Constant(I32, 4), mask, _ints(0)])
            ptr = builder.bitcast(builder.gep(out.data, [full]), VD.as_pointer())
            a = builder.call(loadd, [ptr, ir.Constant(I32, 8), mask, ir.Constant(VD, [0.0] * LANES)])
            x = builder.fpext(builder.bitcast(bits, VF), VD)
            builder.call(stored, [builder.call(fma, [x, k, a]), ptr, ir.Constant(I32, 8), mask])
        return context.get_dummy_value()
    return sig, codegen


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
