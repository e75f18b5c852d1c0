"""The numba reducer: single-pass reductions of CPU float32 tensors.

:func:`diagnostics.measure.reducer.reduce` needs, per tensor, about ten numbers (finite count,
mean, M2, max |x|, zeros, fp16/bf16 under- and overflow counts), as
:mod:`diagnostics.measure.reference` defines them. Computed with one torch op each, that is
ten passes over the tensor and, on the CPU, a freshly page-faulted temporary for most of
them. Here the whole vector comes from one read of the data.

The tensor is cut into *segments*: blocks of ``SEG`` (4096) consecutive entries, or, for
causal attention (``width`` = T), each T x T matrix, of which only the entries on and below
the diagonal are read (row t: its first t + 1 entries). Per segment, one screening loop in
explicit 16-lane vectors (AVX-512 registers where the CPU has them; the last vector of a row
loaded under a mask, so a short causal row has no scalar tail, and the accumulators carry
across rows) accumulates, in float64, sum d and sum d^2 of d = x - K, and the largest and
smallest |x| (as bits: non-negative floats order as their bits do). K is the mean of the
segment before (the first: its first entry), so M2 = sum d^2 - (sum d)^2 / n is exact to
~1e-16 (1 + ((K - mean) / std)^2) even for a tensor whose mean is far above its spread, and
no square of a float32 can overflow float64. Sums that come out non-finite mean a non-finite
entry: a second loop then counts everything and sums the finite entries only. The counts
(zeros; float32 exponent field below 113, i.e. |x| < 2^-14; equal to 0, |x| < 2^-126; at
least 143 and finite, |x| >= 2^16; equal to 254, |x| >= 2^127; non-finite) follow from the
extremes when they settle them: all in [2^-14, 2^16) (most activations) or all normal and
below 2^-14 (most gradients). Otherwise a second vector loop over the segment, still in the
cache, counts them. Segments merge in float64 by Chan's rule (as
:func:`diagnostics.measure.reducer.merge_vectors` merges runs), and the loops return the finished
FIELDS vector. Attention probabilities also get their panel (entropy -sum p ln p of each
row, with a polynomial logarithm, and its largest entry), rows of a residual point their
sums of squares and, per sequence, the sum of their unit vectors (the cosine between
tokens). The loops that read a tensor first ask for the line 4 KiB ahead (a software
prefetch): in a hook the tensor comes from memory. Tensors of at least
:data:`PARALLEL_MIN` entries are split (whole segments) over as many numba threads as torch
uses.

:func:`summaries` reduces a list of tensors (a probe's parameters and gradients at its exit,
an attention chunk's causal buffers) in one call into the loops, each exactly as
:func:`summary` would (the same loops, the same bits): one crossing from Python into numba
rather than one per tensor.

:func:`available` says whether numba is importable (and ``TINYLM_REDUCER``, see
:mod:`.reducer_choice`, is ``auto``), and :func:`takes` whether a tensor can be read here; when
not, ``reduce`` hands it to the compiled reducer or the reference (the tests hold this reducer
to the reference).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch as _torch

from .reducer_choice import chosen

__all__ = ["available", "importable", "takes", "has_memory", "ready", "warm", "summary", "summary_rows", "summaries",
           "PARALLEL_MIN", "DTYPES"]

#: Tensors with fewer entries are reduced on the calling thread only.
PARALLEL_MIN = 1 << 18

#: Tensor dtypes this reducer takes (float32, and the formats that convert to it exactly).
DTYPES = frozenset((_torch.float32, _torch.bfloat16, _torch.float16))

#: The tensor types whose memory the loops may read (subclasses may have none: DTensor, FakeTensor).
_PLAIN = (_torch.Tensor, _torch.nn.Parameter)

_loops = None
_rows = None  # the attention rows' loop (:func:`rows_loop`)
_peak = None  # the peak ratio's loop (:func:`peak_loop`)
_update = None  # the update ratios' loop (:func:`update_loop`)
_checked: bool | None = None
_ready = False
_warming = None  # the process filling numba's cache while this one measures with torch ops


def available() -> bool:
    """True when this reducer can run: numba importable and ``TINYLM_REDUCER`` ``auto`` (the other
    choices send CPU tensors to the compiled reducer or the reference; the variable is read on
    every call, so that it can be switched between calls)."""
    return chosen() == "auto" and importable()


def importable() -> bool:
    """Whether numba imports (asked once per process)."""
    global _checked
    if _checked is None:
        try:
            import numba  # noqa: F401
            _checked = True
        except ImportError:  # pragma: no cover - numba is a declared dependency
            _checked = False
    return _checked


def takes(x: _torch.Tensor) -> bool:
    """Whether this reducer reduces tensor ``x``: a plain strided tensor (a ``torch.Tensor`` or
    ``nn.Parameter``, not a subclass) on the CPU, of :data:`DTYPES`, at least 1-D, and :func:`available`.
    (Attribute reads only: ``x.device`` would build an object per call.)"""
    return x.is_cpu and x.dtype in DTYPES and x.ndim > 0 and type(x) in _PLAIN and x.layout == _torch.strided \
        and available()


def has_memory(x: _torch.Tensor) -> bool:
    """Whether the data pointer of ``x`` (a tensor :func:`takes`) can be read: False for a wrapper
    without storage of its own (functorch, functional tensors) and for a null pointer of a
    tensor with entries."""
    try:
        return x.data_ptr() != 0 or x.numel() == 0
    except RuntimeError:
        return False


def _build():
    """Import (compiling, or loading from numba's on-disk cache) the loops, once per process."""
    global _loops
    if _loops is None:
        from . import _numba
        _loops = _numba
    return _loops


def rows_loop():
    """The loop of sampled attention rows (:mod:`._numba_rows`), imported once per process."""
    global _rows
    if _rows is None:
        from ._numba_rows import rows
        _rows = rows
    return _rows


def peak_loop():
    """The peak ratio's loop over sampled rows (:func:`._numba_rows.peak`), imported once per process."""
    global _peak
    if _peak is None:
        from ._numba_rows import peak
        _peak = peak
    return _peak


def update_loop():
    """The update ratios' loop (:func:`._numba_update.ratios`), imported once per process."""
    global _update
    if _update is None:
        from ._numba_update import ratios
        _update = ratios
    return _update


def _cached(k) -> bool:
    """Whether numba's on-disk cache holds the loops the reducer enters by (their index files)."""
    try:
        return all(os.path.exists(d._cache._cache_file._index_path)
                   for d in (k.serial_at, k.parallel_at, k.many_at, k.rows_at, rows_loop(), peak_loop(), update_loop()))
    except AttributeError:  # pragma: no cover - another numba's cache layout: take it as cached
        return True


def ready() -> bool:
    """Whether the loops run now without compiling them in this process: numba's cache holds
    them, or the process started to fill it (:func:`warm`, in the background on the first call
    that found the cache empty) has finished (if it failed, the loops compile here at first
    use). While it runs, the probe measures CPU tensors with torch ops (the same numbers to
    float64 rounding), so a fresh install's first measurement does not wait for the compiler."""
    global _ready, _warming
    if _ready:
        return True
    if _warming is not None:
        if _warming.poll() is None:
            return False
        _warming = None
        _ready = True
        return True
    if _cached(_build()):
        _ready = True
        return True
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        _warming = subprocess.Popen([sys.executable, "-c", "from diagnostics.measure import numba_reducer as n; n.warm()"],
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:  # no process to spare: compile here
        _ready = True
        return True
    return False


def warm() -> None:
    """Compile every loop the reducer enters by (into numba's on-disk cache)."""
    x = _torch.randn(2, 8, 8)
    summary(x), summary(x, 8), summary(x.softmax(-1), 8, probs=True), summary_rows(x), summary_rows(x, True)
    k = _build()
    k.parallel_at(x.data_ptr(), x.numel(), 0, 0, False, 0, 2)
    summaries([x, x[0]]), summaries([x, x.softmax(-1)], 8, [False, True])
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731  (the queue's rows loop: a tensor, two vectors)
    k.rows_at(i64(x.data_ptr()), i64(x.numel()), i64(8), i64(8), np.array([0.0]), i64(0, 0), np.array([1e-5, -1.0]),
              i64(0, 0), np.ones(16, dtype=np.float32))
    for dtype in (np.float32, np.float64):  # the attention rows' loop, for both widths of logits
        z = np.zeros((2, 8), dtype=dtype)
        rows_loop()(z, z, np.ones((2, 8), dtype=np.bool_), np.zeros(19))
        peak_loop()(z, np.arange(2), 1.0)
    addr = np.array([x.data_ptr()], dtype=np.int64)
    update_loop()(addr, addr, np.array([x.numel()], dtype=np.int64), np.zeros(1))


def summaries(xs: list, width: int = 0, probs: list | None = None) -> np.ndarray:
    """(N, 16) float64: :func:`summary` of each CPU tensor of ``xs`` (as :func:`summary` takes them;
    ``width`` T > 0: causal T x T matrices; with its panel in columns 10: where ``probs[i]``,
    else those are 0), bit for bit, from one call into the loops for all those a single thread
    reduces (fewer than :data:`PARALLEL_MIN` entries, or one torch thread); larger ones one
    call each, as :func:`summary` splits them over threads."""
    keep, addrs, ns, big = [], [], [], []
    threads = _torch.get_num_threads()
    for i, x in enumerate(xs):
        if not (type(x) in _PLAIN and x.dtype == _torch.float32 and x.is_cpu and x.layout == _torch.strided
                and x.is_contiguous() and not x.is_neg()):
            x = _readable(x)
        n = x.numel()
        if n >= PARALLEL_MIN and threads > 1:
            big.append(i)
            n = 0  # reduced apart below; zeros here
        addr = x.data_ptr() if n else 0
        if n and not addr:
            raise TypeError("the numba reducer reads a contiguous tensor with memory")
        keep.append(x)  # alive until the loops have read it
        addrs.append(addr)
        ns.append(n)
    k = _loops or _build()
    flags = np.zeros(len(xs), dtype=np.bool_) if probs is None else np.array(probs, dtype=np.bool_)
    out = k.many_at(np.array(addrs, dtype=np.int64), np.array(ns, dtype=np.int64), width, flags & (width > 0))
    for i in big:
        vec = summary(keep[i], width or None, probs=bool(flags[i]))
        out[i, :vec.size] = vec
    return out


def summary(x: np.ndarray | _torch.Tensor, width: int | None = None, probs: bool = False) -> np.ndarray:
    """The summary of a C-contiguous float32 array or a CPU tensor of :data:`DTYPES` (any layout:
    see :func:`_readable`): float64, laid out as FIELDS of
    :mod:`diagnostics.measure.reference`, followed, when ``probs``, by its ATTN_FIELDS.

    ``width`` None: every entry. ``width`` = T: ``x`` holds causal T x T matrices and only
    the entries on or below each diagonal are read; ``probs`` (causal only) adds the
    attention panel of the rows (entropy mean and M2 over all rows, minimum entropy and
    saturated rows, max p > 0.99, over rows t >= 1).
    """
    causal = width is not None
    return _run(x, width if causal else 0, 0, probs and causal, 0)[0]


def summary_rows(x: np.ndarray | _torch.Tensor, cosine: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(summary, sum of squares of each row, cosine): :func:`summary` of every entry of the
    C-contiguous float32 array or CPU tensor (as for :func:`summary`) ``x`` (at least 1-D),
    and, from the same read, sum x^2 over its last dimension (float64, shape ``x.shape[:-1]``).
    ``cosine`` (``x`` at least 2-D: sequences of ``x.shape[-2]`` rows): the summary (FIELDS)
    of each sequence's mean cosine similarity between its different rows, as
    :func:`diagnostics.measure.reference.cosines` defines it, summed in float64 (no values,
    all zeros, for sequences of one row); else None."""
    S = x.shape[-2] if cosine and x.ndim >= 2 else 0
    out, rowsq, cos = _run(x, 0, max(x.shape[-1], 1), False, S)
    if cosine and not cos.size:
        cos = np.zeros(10)  # the summary of no values
    return out, rowsq.reshape(x.shape[:-1]), cos if cosine else None


def _readable(x: _torch.Tensor) -> _torch.Tensor:
    """CPU tensor ``x`` as a contiguous float32 tensor whose memory holds its values in order,
    the one the loops read at its pointer: a copy only when it must convert (bf16/fp16,
    exactly; a strided or expanded view; a pending negation). Other devices and dtypes (a
    float64 tensor would lose digits), subclasses, other layouts and tensors without readable
    memory are refused (TypeError): the loops read raw memory at the pointer handed to them."""
    if type(x) not in _PLAIN or x.layout != _torch.strided or not x.is_cpu or x.is_meta or x.dtype not in DTYPES:
        raise TypeError(f"the numba reducer reads plain strided CPU float32, bfloat16 or float16 tensors, got "
                        f"{type(x).__name__} of {x.dtype}, {x.layout} on {x.device}")
    if not (x.dtype == _torch.float32 and x.is_contiguous() and not x.is_neg()):
        x = x.detach().float().contiguous()  # a copy outside autograd
        x = x.resolve_neg() if x.is_neg() else x
    if x.numel() and (not x.is_contiguous() or not has_memory(x)):
        raise TypeError("the numba reducer reads a contiguous tensor with memory")
    return x  # the common case: read as it is (autograd never sees the read)


def _run(x: np.ndarray | _torch.Tensor, T: int, D: int, probs: bool, S: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The loops on ``x``'s entries, read in place: a tensor at its data pointer (after
    :func:`_readable`), an array at the address of its C-contiguous float32 flattening.
    (summary, rows' sums of squares, cosine summary): see ``_numba.reduce_serial``."""
    if isinstance(x, (np.ndarray, np.generic)):  # a 0-d result of numpy arithmetic is a scalar
        x = np.ascontiguousarray(x.reshape(-1))  # kept alive below, for the loops' read
        if x.dtype != np.float32:
            raise TypeError(f"the numba reducer reads float32, got {x.dtype}")
        n, addr = x.size, x.ctypes.data
    else:
        if not (type(x) in _PLAIN and x.dtype == _torch.float32 and x.is_cpu and x.layout == _torch.strided
                and x.is_contiguous() and not x.is_neg()):  # the common case needs none of _readable's work
            x = _readable(x)  # kept alive below, for the loops' read
        n = x.numel()
        try:
            addr = x.data_ptr()
        except RuntimeError:  # a wrapper without storage of its own
            addr = 0
        if n and not addr:
            raise TypeError("the numba reducer reads a contiguous tensor with memory")
    if n == 0:
        return np.zeros(16 if probs else 10), np.zeros(0), np.zeros(0)
    k = _loops or _build()
    threads = _torch.get_num_threads()
    if n < PARALLEL_MIN or threads <= 1:
        return k.serial_at(addr, n, T, D, probs, S)
    out = k.parallel_at(addr, n, T, D, probs, S, threads)
    if _torch.get_num_threads() != threads:  # numba's OpenMP layer sets the runtime it shares with torch
        _torch.set_num_threads(threads)      # to its own thread count: put the caller's back
    return out
