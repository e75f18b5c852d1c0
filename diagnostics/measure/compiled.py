"""The probe's reductions for any device, as plain torch compiled by ``torch.compile``.

:mod:`.reference` says what every number means, in a form that reads the tensor once per
statistic. Here the same numbers are written so that every statistic of one tensor is a
reduction of its rows over the same index space, which inductor can fuse into one loop
that reads the tensor once (the compiled reducer: used on a GPU, or on a CPU without numba; a
CPU with numba uses the numba reducer, :mod:`.numba_reducer`, which is much faster there:
docs/benchmarks.md):

* the tensor is seen as rows: its last dimension (a flat tensor), or the rows of each
  causal T x T matrix, of which entries j > t of row t are not measured;
* per row, in float64: measured and finite entries, sum d and sum d^2 of d = x - K, the
  largest |x|, the exact zeros and the fp16/bf16 under- and overflow counts; with
  ``probs`` the row's entropy and largest probability; with ``rows`` its mean square;
* the rows' partials are then summed (a pass over one number per row), and
  M2 = sum d^2 - (sum d)^2 / n. The shift K is the tensor's first entry (measured in
  every layout here; 0 when it is not finite), so the cancellation costs about
  u_64 (1 + ((K - mean) / std)^2) of M2 relative, far below what a diagnosis reads.

The cosine between a sequence's rows (``cosine``) normalises each row before summing, a
second read of the tensor; it is :func:`.reference.cosines` as it stands. :func:`call`
compiles any such function the same way (the reducer merges its vectors on a GPU with it:
one fused loop instead of a dozen small ones).

:func:`takes` says whether a tensor goes this way; :func:`reduce` returns the parts or,
when compilation or a compiled call fails, None after one warning, and the reference
takes over for the rest of the process. ``TINYLM_REDUCER=reference`` turns this path off (as it
turns off the numba reducer); ``TINYLM_REDUCER=compiled`` sends CPU tensors here even where
numba is importable (to measure or test this path on a CPU): :mod:`.reducer_choice`.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import numba_reducer, reference
from .reference import SATURATED_PROB
from .reducer_choice import chosen

__all__ = ["available", "takes", "reduce", "call", "moments", "row_partials", "DTYPES", "BACKEND"]

#: Tensor dtypes this path reduces (float64 too: every sum here is in float64).
DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))
#: The ``torch.compile`` backend (a test may put another one here before the first call).
BACKEND = "inductor"

_PLAIN = (Tensor, torch.nn.Parameter)
_failed = False
_compiled: dict[str, object] = {}


def available() -> bool:
    """True unless ``TINYLM_REDUCER=reference`` or compilation has failed in this process (read on every call)."""
    return not _failed and chosen() != "reference"


def takes(x: Tensor) -> bool:
    """Whether :func:`reduce` reduces ``x`` here: a non-empty plain strided tensor (``torch.Tensor`` or
    ``nn.Parameter``; not meta, not inside a ``torch.func`` transform) of :data:`DTYPES`, at least
    1-D, on any device but a CPU whose numba reducer (:mod:`.numba_reducer`) is available."""
    return x.ndim > 0 and x.dtype in DTYPES and (not x.is_cpu or not numba_reducer.available()) \
        and x.numel() > 0 and type(x) in _PLAIN and x.layout == torch.strided and not x.is_meta and available() \
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)


# -- the formulas (plain torch; compiled below, one function per shape of request) --


def row_partials(x: Tensor, measured: Tensor | None, shift: Tensor, probs: bool = False) -> Tensor:
    """Per row of ``x`` (rows along the last dimension), float64, stacked on a last axis of 10
    (12 with ``probs``): measured entries, finite ones, sum d, sum d^2 (d = x - ``shift`` over
    the finite measured entries), max |x| over them, exact zeros, fp16 under/overflow, bf16
    under/overflow (as :data:`.reference.FIELDS` counts them); with ``probs``, the row's entropy
    -sum p ln p (entries not measured taken as 0) and its largest probability (in ``x``'s
    precision, as :func:`.reference.panel` judges saturation)."""
    xd = x.double()
    m = torch.ones_like(x, dtype=torch.bool) if measured is None else measured.expand_as(x)
    finite = m & torch.isfinite(xd)
    a = torch.where(finite, xd.abs(), 0.0)
    d = torch.where(finite, xd - shift, 0.0)
    nonzero = m & (xd != 0)  # NaN is nonzero
    parts = [m.sum(-1), finite.sum(-1), d.sum(-1), (d * d).sum(-1), a.amax(-1), (m & (xd == 0)).sum(-1),
             (nonzero & (xd.abs() < 2.0**-14)).sum(-1), (a >= 2.0**16).sum(-1),
             (nonzero & (xd.abs() < 2.0**-126)).sum(-1), (a >= 2.0**127).sum(-1)]
    if probs:
        p = x if x.dtype == torch.float64 else x.float()
        p = torch.where(m, p, 0.0)
        parts += [torch.special.entr(p.double()).sum(-1), p.amax(-1).double()]
    return torch.stack([t.double() for t in parts], -1)


def finish(total: Tensor, top: Tensor, shift: Tensor) -> Tensor:
    """:data:`.reference.FIELDS` vectors (..., 10) from the :func:`row_partials` summed over a
    tensor's rows (``total``, (..., 10+)), the largest |x| (``top``) and the shift the sums were
    taken from: the mean and M2 from the shifted sums, the rest as summed."""
    count = total[..., 1].clamp(min=1.0)
    mean = shift + total[..., 2] / count
    m2 = (total[..., 3] - total[..., 2] * total[..., 2] / count).clamp(min=0.0)
    return torch.stack([total[..., 0], total[..., 1], mean, m2, top, *total[..., 5:10].unbind(-1)], -1)


def moments(partials: Tensor, shift: Tensor) -> Tensor:
    """The :data:`.reference.FIELDS` vector from :func:`row_partials` of every row (..., 10+)."""
    s = partials.reshape(-1, partials.shape[-1])
    return finish(s[:, :10].sum(0), s[:, 4].amax(), shift)


def _panel(partials: Tensor) -> Tensor:
    """The :data:`.reference.ATTN_FIELDS` vector from the causal :func:`row_partials` (N, T, 12)."""
    h, top = partials[..., 10], partials[..., 11]
    later, top = h[:, 1:], top[:, 1:]  # rows t >= 1
    mean = h.mean()
    lowest = later.amin() if later.numel() else torch.full_like(mean, float("inf"))
    return torch.stack([torch.ones_like(h).sum(), mean, (h - mean).square().sum(), lowest,
                        torch.ones_like(later).sum(), (top > SATURATED_PROB).sum().double()])


def _shift(x: Tensor) -> Tensor:
    first = x.reshape(-1)[0].double()
    return torch.where(torch.isfinite(first), first, 0.0)


def _flat(x: Tensor) -> Tensor:  # x (R, W)
    k = _shift(x)
    return moments(row_partials(x, None, k), k)


def _flat_rows(x: Tensor) -> tuple[Tensor, Tensor]:  # x (R, W): moments and mean(x^2) per row
    k = _shift(x)
    return moments(row_partials(x, None, k), k), x.double().square().mean(-1)


def _flat_rows_cosine(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # x (N, S, W)
    k = _shift(x)
    return moments(row_partials(x, None, k), k), x.double().square().mean(-1), reference.cosines(x)


def _causal(x: Tensor) -> Tensor:  # x (N, T, T)
    k = _shift(x)
    return moments(row_partials(x, reference.causal_mask(x.shape[-1], x.device), k), k)


def _causal_probs(x: Tensor) -> tuple[Tensor, Tensor]:  # x (N, T, T)
    k = _shift(x)
    parts = row_partials(x, reference.causal_mask(x.shape[-1], x.device), k, probs=True)
    return moments(parts, k), _panel(parts)


def _function(fn):
    """``fn`` compiled (built once per process; dynamic shapes, so one build per request shape
    and dtype, not per tensor size)."""
    built = _compiled.get(fn.__name__)
    if built is None:
        built = _compiled[fn.__name__] = torch.compile(fn, backend=BACKEND, dynamic=True, fullgraph=True)
    return built


def call(fn, *args):
    """``fn(*args)`` compiled, or None when compiling or running it fails (warned once; from
    then on :func:`available` is False and the callers compute without this path)."""
    try:
        return _function(fn)(*args)
    except Exception as err:  # noqa: BLE001 - any failure to compile or run: measure without it
        _give_up(err)
        return None


def _give_up(err: BaseException) -> None:
    global _failed
    _failed = True
    inner = err.__cause__ or getattr(err, "inner_exception", None)
    while isinstance(inner, BaseException):  # the backend's own error, under dynamo's wrapper
        err, inner = inner, inner.__cause__ or getattr(inner, "inner_exception", None)
    first = (str(err).strip().splitlines() or [""])[0][:200]
    warnings.warn(f"torch.compile could not build the probe's reductions ({type(err).__name__}: {first}); "
                  "the probe measures with plain torch ops for the rest of this process (same numbers, slower)",
                  RuntimeWarning, stacklevel=3)


def reduce(x: Tensor, causal: bool, probs: bool, rows: bool, cosine: bool):
    """(moments, panel, row_ms, cosine) of ``x`` as :func:`.reducer.reduce` defines them (a part
    not asked for is None), or None when the compiled reducer failed (warned once)."""
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    ms = cos = panel = None
    if causal:
        out = call(_causal_probs if probs else _causal, x.reshape(-1, x.shape[-1], x.shape[-1]))
        if out is None:
            return None
        mom, panel = out if probs else (out, None)
    elif cosine and x.dim() >= 2:
        out = call(_flat_rows_cosine, x.reshape(-1, x.shape[-2], x.shape[-1]))
        if out is None:
            return None
        mom, ms, cos = out
    else:
        out = call(_flat_rows if rows else _flat, x.reshape(-1, x.shape[-1]))
        if out is None:
            return None
        mom, ms = out if rows else (out, None)
    if probs and not causal:  # the panel of rows that are not causal: the reference's, beside the moments
        panel = reference.panel(x, False)
    if cosine and cos is None:  # fewer than 2 dimensions: no sequences, the reference's empty summary
        cos = reference.cosines(x)
    if rows:
        ms = ms.reshape(x.shape[:-1])
        ms = ms if x.dtype == torch.float64 else ms.float()
    return mom, panel, ms if rows else None, cos if cosine else None
