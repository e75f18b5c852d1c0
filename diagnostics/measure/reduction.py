"""One op per tensor: every statistic a probe site needs, as the registered op ``tinylm::summary``.

    vec, row_ms = torch.ops.tinylm.summary(x, width, probs, rows, cosine, inv_eps, below, weight, kernel)

A probe that takes a site's statistics one torch op at a time dispatches tens of ops per
tensor, each a kernel launch on a GPU. Here the whole request is one dispatched op, whatever
its kernel does inside (registered for ``CompositeExplicitAutograd``: no autograd wrapper; a
fake kernel for tracing and meta tensors). ``kernel`` (:func:`route` chooses it) is one of

* :data:`NUMBA`: the numba reducer (:mod:`.numba_reducer`: one read of the tensor), for CPU
  float32, bf16 and fp16 tensors when ``TINYLM_REDUCER`` is ``auto``;
* :data:`CUDA`: the CUDA structure, the compiled reducer (:mod:`.compiled`: the statistics as
  row reductions that ``torch.compile`` fuses, one build per request shape and dtype, dynamic
  sizes), for every other tensor and for CPU tensors too under ``TINYLM_REDUCER=cuda``, so that
  the CPU runs exactly the ops a GPU runs; where compilation failed, the same formulas eagerly;
* :data:`TORCH`: those formulas eagerly (plain torch), while numba's cache is being filled
  (:func:`.numba_reducer.ready`).

Every kernel returns the same numbers (:mod:`.reference` defines them), the compiled ones in
the default ``torch.compile`` stance (a probe runs the model in the eager one). ``vec`` is
float64 on ``x``'s device, the parts asked for in this order (:func:`sizes`):

* FIELDS of the entries (``width`` = T > 0: of the causal entries of (..., T, T) matrices);
* ATTN_FIELDS of attention probabilities (``probs``, causal);
* FIELDS of each sequence's mean cosine between its rows (``cosine``);
* FIELDS of 1 / (row_ms + ``inv_eps``) (``inv_eps`` >= 0; needs ``rows``);
* [entries < ``below``, entries] (``below`` finite);
* FIELDS of row_ms * ``weight`` (``weight`` given: one factor per row; needs ``rows``),

row_ms and its products in float32 (as the probe always took them). ``row_ms``: mean(x^2) over
the last dimension, float32 (float64 for float64 ``x``) with ``rows``, else empty.

The direct lane. On the CPU the op's dispatch (the op's Python entry, its vector cut by a
``split``) costs more than the numba kernel it runs on a small tensor. Where :func:`lane` holds
(the tensor goes to :data:`NUMBA` and :func:`direct`: no dispatch mode, no ``torch.compile``
tracing, no torch-function mode but the probe's own), :func:`.reducer.reduce` calls the same
kernel from Python (:func:`numba_parts`) and gets its parts uncut: the same bits (tests hold
them equal). Anything that observes the ops (an op counter, a FakeTensor mode) sees the op, and
``TINYLM_REDUCER=cuda`` never takes the lane: there the CPU dispatches what a GPU would.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import compiled, grouped, numba_reducer, reference
from .reducer_choice import chosen, pinned
from .wrappers import default_stance

__all__ = ["route", "lane", "direct", "numba_parts", "all_numba", "causal_parts", "numba_moments", "sizes", "many", "each", "DTYPES", "NUMBA", "CUDA", "TORCH"]

#: the dtypes the op reduces
DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))

_PLAIN = (Tensor, torch.nn.Parameter)


def _stance() -> str:
    holder = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(holder, "stance", "default")


def compiling():
    """A context in which compiled functions run compiled: the default ``torch.compile`` stance
    (entered only when another one is set: setting a stance costs more than a small reduction)."""
    return default_stance() if _stance() != "default" else contextlib.nullcontext()


#: the op's kernels: the numba reducer, the CUDA structure (compiled), plain torch ops
NUMBA, CUDA, TORCH = 0, 1, 2


def route(x: Tensor) -> int | None:
    """Which kernel of the op reduces ``x``: :data:`CUDA` the CUDA structure, :data:`NUMBA` the
    numba reducer (:data:`TORCH`, plain torch ops, while numba's cache is being filled:
    :func:`.numba_reducer.ready`), None not the op (the caller's plain torch). The op takes a non-empty plain strided tensor
    (not meta, not inside a ``torch.func`` transform) of :data:`DTYPES`, at least 1-D, unless
    ``TINYLM_REDUCER=reference``; the numba reducer a CPU tensor of its dtypes under ``auto``
    where numba imports; the CUDA structure every other (every tensor off the CPU, and CPU
    tensors under ``TINYLM_REDUCER=cuda``)."""
    if not (type(x) in _PLAIN and x.ndim > 0 and x.dtype in DTYPES and x.layout == torch.strided
            and not x.is_meta and x.numel() > 0):
        return None
    choice = chosen()
    if choice == "reference":
        return None
    if choice == "auto" and numba_reducer.importable() and _numba_tensor(x):  # a functorch wrapper: no memory
        return NUMBA if numba_reducer.ready() else TORCH
    return None if torch._C._functorch.is_functorch_wrapped_tensor(x) else CUDA


def _numba_tensor(x: Tensor) -> bool:
    """Whether the numba reducer reads ``x``: a non-empty plain strided CPU tensor of its dtypes,
    at least 1-D, with memory of its own."""
    return type(x) in _PLAIN and x.is_cpu and x.dtype in numba_reducer.DTYPES and x.ndim > 0 \
        and x.layout == torch.strided and x.numel() > 0 and numba_reducer.has_memory(x)


def _numba_now() -> bool:
    """Whether :func:`route` sends the tensors that :func:`_numba_tensor` takes to :data:`NUMBA`
    now: ``TINYLM_REDUCER=auto``, numba imports and its loops are cached."""
    return chosen() == "auto" and numba_reducer.importable() and numba_reducer.ready()


def _ms_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


_LIB = torch.library.Library("tinylm", "DEF")
_LIB.define("summary(Tensor x, int width, bool probs, bool rows, bool cosine, float inv_eps, float below, "
            "Tensor? weight, int kernel) -> (Tensor, Tensor)")


def _kernel(x: Tensor, width: int, probs: bool, rows: bool, cosine: bool, inv_eps: float, below: float,
            weight: Optional[Tensor], kernel: int) -> tuple[Tensor, Tensor]:
    """The op's one kernel for every device (registered for CompositeExplicitAutograd, so no
    autograd wrapper runs around it): the CUDA structure, plain torch or the numba reducer, by ``kernel``."""
    with torch._C.DisableTorchFunction():  # a kernel: what it reads is its own, never a host read of the caller's
        if kernel != NUMBA:
            mom, panel, ms, cos, extra = _cuda(x, width, probs, rows, cosine, inv_eps, below, weight, kernel == CUDA)
            return _pack(x, (mom, panel, cos, extra), ms)
        mom, ms, cos, inv, under, weighted = _cpu(x, width, probs, rows, cosine, inv_eps, below, weight)
        return _pack(x, (mom, cos, inv, under, weighted), ms)


def _pack(x: Tensor, vectors, ms) -> tuple[Tensor, Tensor]:
    vec = [v for v in vectors if v is not None]
    return (torch.cat(vec) if len(vec) > 1 else vec[0]), (ms if ms is not None else x.new_empty(0, dtype=_ms_dtype(x)))


_LIB.impl("summary", _kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::summary", lib=_LIB)
def _(x, width, probs, rows, cosine, inv_eps, below, weight, kernel):
    n = 10 + (6 if probs else 0) + (10 if cosine else 0) + (10 if inv_eps >= 0 else 0) \
        + (2 if math.isfinite(below) else 0) + (10 if weight is not None else 0)
    return x.new_empty((n,), dtype=torch.float64), \
        x.new_empty(tuple(x.shape[:-1]) if rows else (0,), dtype=_ms_dtype(x))


def sizes(probs: bool, cosine: bool, inv_eps: float, below: float, weight: Tensor | None) -> list[tuple[str, int]]:
    """The parts of the op's first output, in order: (name, entries) of those asked."""
    parts = [("moments", 10), ("panel", 6 if probs else 0), ("cosine", 10 if cosine else 0),
             ("inv", 10 if inv_eps >= 0 else 0), ("below", 2 if math.isfinite(below) else 0),
             ("weighted", 10 if weight is not None else 0)]
    return [(k, n) for k, n in parts if n]


def _cpu(x, width, probs, rows, cosine, inv_eps, below, weight):
    """The numba kernel: one read of ``x``; the extras from the rows' sums (CPU tensors).
    (moments, with the panel after them when ``probs``; row_ms; cosine; inv; below; weighted),
    None where not asked."""
    ms = cos = inv = under = weighted = None
    if not (rows or cosine):
        mom = torch.from_numpy(numba_reducer.summary(x, width if width else None, probs=probs))
    else:  # the per-row work in numpy, float32 as torch would round it (a few us less per op)
        vec, rowsq, cosv = numba_reducer.summary_rows(x, cosine)
        mom = torch.from_numpy(vec)
        msn = np.asarray(rowsq / x.shape[-1], dtype=np.float32)  # an array also for 0-d rows
        ms = torch.from_numpy(msn)
        cos = torch.from_numpy(cosv) if cosine else None
    if inv_eps >= 0:
        inv = torch.from_numpy(numba_reducer.summary(np.reciprocal(msn + np.float32(inv_eps))))
    if below == below and below not in (math.inf, -math.inf):
        numpy = x.dtype == torch.float32 and type(x) in _PLAIN and not x.is_neg()  # torch's float32 comparison
        n = np.count_nonzero(x.detach().numpy() < np.float32(below)) if numpy else int((x < below).sum())
        under = torch.tensor([float(n), float(x.numel())], dtype=torch.float64)
    if weight is not None:
        w = weight.reshape(ms.shape)
        weighted = torch.from_numpy(numba_reducer.summary(
            msn * w.numpy() if w.dtype == torch.float32 and w.is_cpu and type(w) in _PLAIN and not w.requires_grad
            else ms * w))
    return mom, ms if rows else None, cos, inv, under, weighted


def lane(x: Tensor) -> bool:
    """``route(x) == NUMBA and direct()``, its checks in the order that settles most tensors
    soonest: whether :func:`numba_parts` may reduce ``x``."""
    return _numba_tensor(x) and _numba_now() and direct()


def all_numba(xs) -> bool:
    """``all(route(x) == NUMBA for x in xs)``, the choice and numba's readiness asked once."""
    return _numba_now() and all(_numba_tensor(x) for x in xs)


def causal_parts(xs: list[Tensor], probs: list[bool]) -> list[tuple[Tensor, Tensor | None]] | None:
    """[(moments, panel or None)] of each causal (..., T, T) tensor of ``xs`` (one T), from one
    call into numba's loops, or None where they do not all take the direct lane (:func:`lane`):
    what :func:`.reducer.reduce` (``causal``, ``probs``) gives each, bit for bit."""
    if not (xs and direct() and all_numba(xs)):
        return None
    vec = torch.from_numpy(numba_reducer.summaries(xs, xs[0].shape[-1], probs))
    return [(v[:10], v[10:] if p else None) for v, p in zip(vec, probs)]


def direct() -> bool:
    """Whether a tensor that :func:`route` sends to :data:`NUMBA` may skip the op's dispatch
    (:func:`numba_parts`: the same kernel, called from Python; the same bits): nothing observes
    or transforms the ops of this moment. Not while a ``TorchDispatchMode`` is on (an op
    counter, a FakeTensor mode), while ``torch.compile`` traces, or while a
    ``TorchFunctionMode`` other than the probe's own attention watchers (a class attribute
    ``probe_own`` True) is on. Never taken under ``TINYLM_REDUCER=cuda``: route gives
    :data:`NUMBA` under ``auto`` only."""
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_function_stack():
        from torch.overrides import _get_current_function_mode_stack
        return all(getattr(m, "probe_own", False) for m in _get_current_function_mode_stack())
    return True


def numba_parts(x: Tensor, width: int, probs: bool, rows: bool, cosine: bool, inv_eps: float, below: float,
                weight: Optional[Tensor]) -> tuple:
    """What the op's numba kernel computes, without the op: (moments, panel, row_ms, cosine, inv,
    below, weighted), None where not asked (row_ms empty without ``rows``, as the op's). The
    vectors are those the op's output holds (its parts are cut from their concatenation), bit
    for bit. Call only where :func:`route` gives :data:`NUMBA` and :func:`direct` holds."""
    mom, ms, cos, inv, under, weighted = _cpu(x, width, probs, rows, cosine, inv_eps, below, weight)
    panel = mom[10:] if probs else None
    return (mom[:10] if probs else mom), panel, ms, cos, inv, under, weighted


def numba_moments(x: Tensor, width: int, probs: bool) -> tuple[Tensor, Tensor | None]:
    """(moments, panel or None): :func:`numba_parts` of a request with no rows, cosine or extras
    (most of a probe's), in one frame: a float32 tensor that one thread reduces goes straight
    to the loop's entry point (what :func:`.numba_reducer.summary` calls; the same bits). Call
    only where :func:`lane` holds (and ``probs`` only with ``width``)."""
    n = x.numel()
    if x.dtype == torch.float32 and x.is_contiguous() and not x.is_neg() \
            and (n < numba_reducer.PARALLEL_MIN or torch.get_num_threads() <= 1):
        k = numba_reducer._loops or numba_reducer._build()
        mom = torch.from_numpy(k.serial_at(x.data_ptr(), n, width, 0, probs, 0)[0])
    else:
        mom = torch.from_numpy(numba_reducer.summary(x, width if width else None, probs=probs))
    return (mom[:10], mom[10:]) if probs else (mom, None)


def _extras(x: Tensor, ms: Tensor, inv_eps: float, below: float, weight: Tensor | None) -> Tensor:
    """The ``extra`` vector from ``x`` and its row mean squares ``ms`` (float32 or float64)."""
    parts = []
    if inv_eps >= 0:
        parts.append(reference.moments((ms + inv_eps).reciprocal()))
    if below == below and below not in (math.inf, -math.inf):
        parts.append(torch.stack([(x < below).sum().double(), torch.ones_like(x, dtype=torch.float64).sum()]))
    if weight is not None:
        parts.append(reference.moments(ms * weight.reshape(ms.shape)))
    return torch.cat(parts)


def _cuda(x, width, probs, rows, cosine, inv_eps, below, weight, compile_: bool = True):
    """The CUDA-structure kernel: the compiled reducer (the reference where it failed, or where
    ``compile_`` is False), in the default ``torch.compile`` stance (a probe runs the model in
    the eager one)."""
    compile_ = compile_ and compiled.available()
    if compile_ and _stance() != "default":
        with default_stance():
            return _cuda(x, width, probs, rows, cosine, inv_eps, below, weight, compile_)
    causal = width > 0
    parts = compiled.reduce(x, causal, probs, rows, cosine) if compile_ else None
    if parts is None:
        mask = reference.causal_mask(x.shape[-1], x.device) if causal else None
        parts = (reference.moments(x, mask), reference.panel(x, causal) if probs else None,
                 reference.row_mean_squares(x) if rows else None, reference.cosines(x) if cosine else None)
    mom, panel, ms, cos = parts
    extra = None
    if inv_eps >= 0 or math.isfinite(below) or weight is not None:
        extra = compiled.call(_extras, x, ms, inv_eps, below, weight) if compile_ else None
        if extra is None:
            extra = _extras(x, ms, inv_eps, below, weight)
    return mom, panel, ms if rows else None, cos, extra


_LIB.define("summaries(Tensor[] xs, int kernel) -> Tensor")


def _many_kernel(xs: list[Tensor], kernel: int) -> Tensor:
    """(N, 10): the FIELDS vector of every tensor of ``xs``, by ``kernel``: numba's one loop over
    them all (:func:`.numba_reducer.summaries`); the CUDA structure's few compiled calls, one
    per distinct dtype and size (:func:`.grouped.moments`, in one entry into the default
    ``torch.compile`` stance); plain torch one tensor at a time (:func:`each`)."""
    with torch._C.DisableTorchFunction():
        if kernel == NUMBA:
            return torch.from_numpy(numba_reducer.summaries(xs)[:, :10])
        if kernel == CUDA and compiled.available():
            with compiling():
                out = grouped.moments(xs)
            if out is not None:
                return out
        return each(xs, kernel)


def each(xs: list[Tensor], kernel: int) -> Tensor:
    """(N, 10): :func:`_many_kernel`'s result from one reduction per tensor (``kernel`` CUDA:
    one compiled call each; the plain-torch formulas where it is TORCH or compilation failed)."""
    with compiling() if kernel == CUDA and compiled.available() else contextlib.nullcontext():
        return torch.stack([_cuda(x, 0, False, False, False, -1.0, math.nan, None, kernel == CUDA)[0]
                            if x.numel() else reference.moments(x) for x in xs])


_LIB.impl("summaries", _many_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::summaries", lib=_LIB)
def _(xs, kernel):
    return xs[0].new_empty((len(xs), 10), dtype=torch.float64)


def many(xs: list[Tensor]) -> Tensor | None:
    """(N, 10) float64: the moments of every tensor of ``xs`` from one dispatched op,
    ``tinylm::summaries`` (numba: one loop over them all; the CUDA structure: one compiled call
    per distinct dtype and size inside), or None where they do not all
    take the same kernel on one device (the caller reduces them one by one)."""
    if not xs:
        return None
    if direct() and all_numba(xs):  # the kernel's own loop, without the op's dispatch
        return _many_kernel(xs, NUMBA)
    with pinned():  # the choice read once for the list, not once per tensor
        kinds = {route(x) for x in xs}
    if len(kinds) != 1 or None in kinds or len({x.device for x in xs}) != 1:
        return None
    with torch.no_grad():
        return torch.ops.tinylm.summaries(xs, kinds.pop())
