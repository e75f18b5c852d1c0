"""The explicit vector loops of the numba reducer (:mod:`diagnostics.measure._numba` drives them):
numba intrinsics written with llvmlite that walk the rows of a tensor's float32 bits (one uint32
array; a value is a register bitcast away) in LANES-wide vectors.

* :func:`screen` (:func:`screen_rows`): float64 sums of d = x - K and d^2 and the largest and
  smallest |x| (as bits) over the rows (and each flat row's sum of x^2);
* :func:`small`: counts of nonzero entries and of |x| below 2^-14 and 2^-126;
* :func:`entropy_rows`: each causal row's entropy -sum p ln p (ln by a degree-9 polynomial) and
  its largest entry;
* :func:`add_scaled`: acc += scale * x (the unit vectors of the cosine between tokens);
* :func:`at`, :func:`as_f32`: a pointer at an address, the float32 of uint32 bits.

numba's on-disk cache (``cache=True``) is keyed on the source file of each jitted function, which
for every loop here is ``_numba.py``: after editing this module, clear the ``__pycache__`` beside
it (or touch ``_numba.py``) so that the cached loops are compiled again.
"""

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# the loops rely on inf and NaN propagating through the sums: no fast-math flag but reassoc
# (on the final adds of lanes)
I32 = ir.IntType(32)
F32 = np.float32
ABS = np.uint32(0x7FFFFFFF)
# exponent-field boundaries, as bits of |x|: 2^-126 (smallest normal), 2^-14 (fp16's smallest
# normal), 2^16 (above fp16's largest finite), 2^127 (bf16's top binade), inf
E1 = np.uint32(1 << 23)
E113 = np.uint32(113 << 23)
E143 = np.uint32(143 << 23)
E254 = np.uint32(254 << 23)
INF = np.uint32(0x7F800000)
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
