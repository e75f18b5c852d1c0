"""Single-pass reductions of CPU float32 tensors, compiled with numba.

:func:`diagnostics.stats.summarize` needs, per tensor, about ten numbers (finite count,
mean, M2, max |x|, zeros, fp16/bf16 under- and overflow counts). Computed with one torch
op each, that is ten passes over the tensor and, on the CPU, a freshly page-faulted
temporary for most of them: a probe then cost as much as the forward and backward it
watched. Here the whole vector comes from one read of the data (and, for some segments, a
second loop over the same few kilobytes, still in the cache).

The tensor is cut into *segments*: blocks of :data:`SEG` consecutive entries, or, for
causal attention (``width`` = T), each T x T matrix, of which only the entries on and below
the diagonal are read (row t: its first t + 1 entries). Per segment, one vectorised
screening loop accumulates, in float64, sum d and sum d^2 of the finite d = x - K (K: the
segment's first entry) and the largest and smallest |x| (as bits: non-negative floats order
as their bits do). Then M2 = sum d^2 - (sum d)^2 / n; the shift keeps a tensor whose mean is
far above its spread exact (rounding ~1e-16 ((K - mean) / std)^2 of M2), and no square of a
float32 can overflow float64. The counts (zeros; float32 exponent field below 113, i.e.
|x| < 2^-14; equal to 0, |x| < 2^-126; at least 143 and finite, |x| >= 2^16; equal to 254,
|x| >= 2^127; non-finite) follow from the extremes when they settle them: all in
[2^-14, 2^16) (most activations) or all normal and below 2^-14 (most gradients). Otherwise a
second loop counts the small side, or, when a value reaches 2^16 or is not finite, every
count. Segments merge in float64 by Chan's rule (as :func:`diagnostics.stats.merge_vectors`
merges runs); tensors of at least :data:`PARALLEL_MIN` entries are split over as many numba
threads as torch uses.

:func:`available` says whether numba is importable (and ``TINYLM_FUSED`` is not ``0``);
when it is not, or for other devices and dtypes, ``summarize`` uses plain torch ops with
the same definitions (the tests hold the two paths to each other).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["available", "moments", "attention_rows", "SEG", "RAW", "PARALLEL_MIN"]

#: Entries per segment of a flat tensor (16 KiB of float32: fits the L1 cache).
SEG = 4096
#: Tensors with fewer entries are reduced on the calling thread only.
PARALLEL_MIN = 1 << 18
#: Layout of the raw vector :func:`moments` returns.
RAW = ("n", "n_finite", "mean", "m2", "max_abs", "n_nonzero", "n_e_lt113", "n_e_ge143", "n_e_0", "n_e_254")

_kernels = None
_checked: bool | None = None


def available() -> bool:
    """True when the compiled path can run (numba importable, ``TINYLM_FUSED`` not ``0``)."""
    global _checked
    if os.environ.get("TINYLM_FUSED", "1") == "0":
        return False
    if _checked is None:
        try:
            import numba  # noqa: F401
            _checked = True
        except ImportError:  # pragma: no cover - numba is a declared dependency
            _checked = False
    return _checked


def _build():
    """Import (compiling, or loading from numba's on-disk cache) the kernels, once per process."""
    global _kernels
    if _kernels is None:
        from . import _fused_nb
        _kernels = _fused_nb
    return _kernels


def _threads(size: int) -> int:
    """Threads for ``size`` entries: torch's count (as numba may run them), 1 below PARALLEL_MIN."""
    import torch

    return 1 if size < PARALLEL_MIN else max(1, torch.get_num_threads())


def moments(x: np.ndarray, width: int | None = None) -> np.ndarray:
    """The :data:`RAW` vector (float64) of a C-contiguous float32 array.

    ``width`` None: every entry. ``width`` = T: ``x`` holds causal T x T matrices and only
    the entries on or below each diagonal are read.
    """
    flat = x.reshape(-1)
    if flat.size == 0:
        return np.zeros(len(RAW))
    k = _build()
    args = (flat, flat.view(np.uint32), SEG if width is None else width, width is not None)
    n = _threads(flat.size)
    out = k.reduce_serial(*args) if n == 1 else k.reduce_parallel(*args, n)
    out[4] = float(np.uint32(out[4]).view(np.float32))  # the largest finite |x|, from its bits
    return out


def attention_rows(p: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(entropy, max probability) of each causal row of probabilities ``p`` (..., T, T), T = ``width``.

    Entropy -sum_j p_tj ln p_tj over the row's valid prefix j <= t, in float32 with a
    polynomial logarithm (relative error about 1e-6); returned as float64 / float32 arrays
    of length p.size / T.
    """
    flat = p.reshape(-1)
    if flat.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.float32)
    k = _build()
    n = _threads(flat.size)
    args = (flat, flat.view(np.uint32), width)
    return k.attention_serial(*args) if n == 1 else k.attention_parallel(*args, n)
