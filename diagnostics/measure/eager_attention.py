"""Attention that a model computes with an explicit softmax ("eager" attention), seen.

Hugging Face's eager attention, nanoGPT's non-flash path and minGPT form the attention
logits themselves and call a softmax over the keys:

    s = scale * q k^T (+ an additive mask, or masked_fill(-inf)),   p = softmax(s, dim=-1).

Under a probe with ``signals`` on, :class:`EagerAttentionWatch` (a ``TorchFunctionMode``)
sees every call of ``torch.softmax``, ``torch.nn.functional.softmax``, ``torch.special.softmax``
and ``Tensor.softmax`` and takes one as attention when it is

    over the last dimension of a 4-D floating tensor (B, H, T, S), called while the probe's
    watch is on: while a block's attention child runs (a child whose class name ends in
    ``Attention``), or, in a block without one, while the block runs.

Its input rows are the logits with the scale and mask applied. An entry that is -inf, or
<= finfo(dtype).min / 2 (Hugging Face adds finfo.min to the masked entries), is masked: not a
score. The rows of :func:`diagnostics.measure.sdpa.sample_rows` (every row up to 64, else 64
evenly spaced, the first and the last included) are measured by
:func:`diagnostics.measure.sdpa.row_statistics`' figures (:func:`~diagnostics.measure.sdpa.rows_of`: one numba
call on a CPU) in float32 at least, so the cost is B x H x
64 x S whatever T is: the moments of the unmasked scores, the attention panel (entropy per
row, the saturated fraction) and the signal vector [max |s| over the unmasked entries,
sum over the rows of ln(unmasked keys), rows]. The call then runs as it would have.

A softmax of another shape or over another dimension (a router's, a classifier's) is not
attention and is passed on unmeasured; the watch does not see a call made elsewhere.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .sdpa import ROWS, SDPA, SDPAWatch, masked_additive, rows_of, sample_rows

__all__ = ["EagerAttentionWatch", "eager_rows", "is_attention_softmax", "SOFTMAX"]

#: the softmax functions seen (a TorchFunctionMode receives these as ``func``)
SOFTMAX = (torch.softmax, F.softmax, torch.special.softmax, Tensor.softmax)
#: what the watch measures: the softmax functions and SDPA
_SEEN = frozenset((*SOFTMAX, SDPA))


def _call(func, args: tuple, kwargs: dict) -> tuple[object, object]:
    """(input, dim) of a softmax call, whichever way its arguments were given."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return x, dim


def is_attention_softmax(x: object, dim: object) -> bool:
    """Whether a softmax of ``x`` over ``dim`` is attention: a 4-D (B, H, T, S) floating tensor
    with at least one key, over its last dimension (-1 or 3)."""
    return (isinstance(x, Tensor) and x.dim() == 4 and x.is_floating_point() and x.shape[-1] > 0
            and isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, 3))


@torch.no_grad()
def eager_rows(x: Tensor, rows: int = ROWS, signal: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`~diagnostics.measure.sdpa.row_statistics` of the sampled query rows of softmax logits
    ``x`` (B, H, T, S), in float32 at least, with the masked entries (module docstring) not scores."""
    idx = sample_rows(x.shape[-2], rows).to(x.device)
    s = x.detach().index_select(-2, idx)  # (B, H, R, S)
    allowed = ~masked_additive(s)
    return rows_of(s.to(torch.promote_types(s.dtype, torch.float32)), allowed, signal)


class EagerAttentionWatch(SDPAWatch):
    """An :class:`~diagnostics.measure.sdpa.SDPAWatch` (its ``scaled_dot_product_attention``
    calls measured as there) that, while entered, also measures every softmax that
    :func:`is_attention_softmax` takes for attention (:func:`eager_rows`), reported as
    ``record(name, scores, panel)`` and, given ``signal``, ``signal(name, vector)``; ``where()``
    names the caller (None: not reported, as outside every block). One mode sees both kinds of
    attention, so a call pays one interception. The call then runs unchanged. The measurement
    runs with torch functions' overrides off, so no other mode sees its ops (its own softmax
    included)."""

    def __init__(self, record: Callable[[str, Tensor, Tensor], None], where: Callable[[], str | None],
                 signal: Callable[[str, Tensor], None] | None = None, rows: int = ROWS):
        super().__init__(record, where, signal)
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _SEEN:  # every other function (nearly all calls): passed on in one frame
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if func in SOFTMAX:
            x, dim = _call(func, args, kwargs)
            name = self.where() if is_attention_softmax(x, dim) else None
            if name is not None:
                t0 = time.perf_counter()
                with torch._C.DisableTorchFunction():
                    moments, panel, vec = eager_rows(x, self.rows, self.signal is not None)
                self.report(name, moments, panel, vec)
                self.seconds += time.perf_counter() - t0
                self.missed += 1  # seen by the mode alone
            return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)

