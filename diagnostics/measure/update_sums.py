"""An optimizer step's sums for every parameter from one dispatched op each: ``tinylm::update_sums``
and ``tinylm::eps_counts``.

    rows = torch.ops.tinylm.update_sums(now, was, grads)     # (P, 3) float64
    counts = torch.ops.tinylm.eps_counts(v, steps, beta2, eps)  # (P, 2) float64

Row i is [<Delta W_i, g_i>, ||Delta W_i||^2, ||g_i||^2] with Delta W_i = now_i - was_i taken in
float64 (the difference of two float32 or narrower values, exact) and g_i in float64, each
sum a float64 dot product: the figures of :mod:`.optimizer` (:func:`update_row`: about ten ops per parameter
taken one by one: two conversions, a subtraction, views, three dot products, a stack). The
op is registered for ``CompositeExplicitAutograd`` (no autograd wrapper; call it under
``no_grad``) with a fake kernel for tracing; its kernel runs those same torch ops, so its
numbers are the per-parameter path's to the bit. It takes plain strided tensors on one
device, the three lists of equal length, each triple of one shape (:func:`sums` checks).
One op is one dispatch from Python; on a GPU its kernel still launches its few small kernels
per parameter inside (a fused kernel over the list would make them one launch).

``eps_counts`` row i is :func:`eps_row` of Adam's second moment v_i (``exp_avg_sq``), its
step (a tensor), beta2 and eps: [entries with sqrt(v_hat) < eps, entries], v_hat = v /
(1 - beta2^step); its kernel runs :func:`eps_row` for each parameter (about ten ops inside),
the per-parameter path's numbers to the bit; :func:`counts` checks its arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sums", "counts", "eps_row", "update_row"]

_PLAIN = (Tensor, torch.nn.Parameter)

_LIB = torch.library.Library("tinylm", "FRAGMENT")
_LIB.define("update_sums(Tensor[] now, Tensor[] was, Tensor[] grads) -> Tensor")


def _kernel(now: list[Tensor], was: list[Tensor], grads: list[Tensor]) -> Tensor:
    with torch._C.DisableTorchFunction():  # a kernel: what it reads is its own
        return torch.stack([update_row(*args) for args in zip(now, was, grads)])


def update_row(now: Tensor, was: Tensor, grad: Tensor) -> Tensor:
    """[<Delta W, g>, ||Delta W||^2, ||g||^2] as float64 (3,), Delta W = now - was taken in float64."""
    d = now.detach().to(torch.float64, copy=True).sub_(was).reshape(-1)  # Delta W in float64, exactly
    g = grad.detach().double().reshape(-1)
    return torch.stack([torch.dot(d, g), torch.dot(d, d), torch.dot(g, g)])


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


def eps_row(v: Tensor, step: Tensor | float, beta2: float, eps: float) -> Tensor:
    """[entries of ``v`` with sqrt(v / (1 - beta2^step)) < eps, entries] as float64 (2,)."""
    step = step.to(v.device, torch.float64) if isinstance(step, Tensor) else float(step)
    # sqrt(v / (1 - beta2^step)) < eps  <=>  v < eps^2 (1 - beta2^step)
    limit = (1 - beta2 ** step) * eps ** 2
    small = (v.detach().double() < limit).sum().double()
    return torch.stack([small, small.new_tensor(float(v.numel()))])


_LIB.define("eps_counts(Tensor[] v, Tensor[] steps, float[] beta2, float[] eps) -> Tensor")


def _eps_kernel(v: list[Tensor], steps: list[Tensor], beta2: list[float], eps: list[float]) -> Tensor:
    with torch._C.DisableTorchFunction():
        return torch.stack([eps_row(*args) for args in zip(v, steps, beta2, eps)])


_LIB.impl("eps_counts", _eps_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::eps_counts", lib=_LIB)
def _(v, steps, beta2, eps):
    return v[0].new_empty((len(v), 2), dtype=torch.float64)


@torch.no_grad()
def counts(v: list[Tensor], steps: list, beta2: list, eps: list) -> Tensor | None:
    """(P, 2) float64 of :func:`eps_row` from one ``tinylm::eps_counts``, or None where the op
    does not take these (empty; a DTensor, sparse or non-strided v; a step that is not a
    tensor, a beta2 or eps that is not a Python number; v on more than one device)."""
    if not v or not all(_plain(t) and isinstance(s, Tensor) and type(b) in (int, float) and type(e) in (int, float)
                        for t, s, b, e in zip(v, steps, beta2, eps)):
        return None
    if len({t.device for t in v}) != 1:
        return None
    return torch.ops.tinylm.eps_counts(v, steps, [float(b) for b in beta2], [float(e) for e in eps])
