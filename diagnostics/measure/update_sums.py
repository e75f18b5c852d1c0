"""An optimizer step's sums for every parameter from one dispatched op, ``tinylm::update_sums``.

    rows = torch.ops.tinylm.update_sums(now, was, grads)     # (P, 3) float64

Row i is [<Delta W_i, g_i>, ||Delta W_i||^2, ||g_i||^2] with Delta W_i = now_i - was_i taken in
float64 (the difference of two float32 or narrower values, exact) and g_i in float64, each
sum a float64 dot product: the figures of :mod:`.optimizer`, which took them with about ten
ops per parameter (two conversions, a subtraction, views, three dot products, a stack). The
op is registered for ``CompositeExplicitAutograd`` (no autograd wrapper; call it under
``no_grad``) with a fake kernel for tracing; its kernel runs those same torch ops, so its
numbers are the per-parameter path's to the bit. It takes plain strided tensors on one
device, the three lists of equal length, each triple of one shape (:func:`sums` checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sums"]

_PLAIN = (Tensor, torch.nn.Parameter)

_LIB = torch.library.Library("tinylm", "FRAGMENT")
_LIB.define("update_sums(Tensor[] now, Tensor[] was, Tensor[] grads) -> Tensor")


def _kernel(now: list[Tensor], was: list[Tensor], grads: list[Tensor]) -> Tensor:
    with torch._C.DisableTorchFunction():  # a kernel: what it reads is its own
        rows = []
        for p, w, g in zip(now, was, grads):
            d = p.detach().to(torch.float64, copy=True).sub_(w).reshape(-1)  # Delta W in float64, exactly
            g = g.detach().double().reshape(-1)
            rows.append(torch.stack([torch.dot(d, g), torch.dot(d, d), torch.dot(g, g)]))
        return torch.stack(rows)


_LIB.impl("update_sums", _kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::update_sums", lib=_LIB)
def _(now, was, grads):
    return now[0].new_empty((len(now), 3), dtype=torch.float64)


def _plain(t: Tensor | None) -> bool:
    return t is not None and type(t) in _PLAIN and t.layout == torch.strided


@torch.no_grad()
def sums(now: list[Tensor], was: list[Tensor | None], grads: list[Tensor | None]) -> Tensor | None:
    """(P, 3) float64 (module docstring) from one ``tinylm::update_sums``, or None where the op
    does not take these lists (empty, a missing copy or gradient, a DTensor, a sparse or
    non-strided tensor, shapes that differ, more than one device): the caller's own path."""
    if not now or not all(_plain(a) and _plain(b) and _plain(c) and a.shape == b.shape == c.shape
                          for a, b, c in zip(now, was, grads)):
        return None
    if len({t.device for t in (*now, *was, *grads)}) != 1:
        return None
    return torch.ops.tinylm.update_sums(now, was, grads)
