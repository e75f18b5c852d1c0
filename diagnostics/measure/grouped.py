"""The moments of many tensors from a few compiled calls: the CUDA structure of ``tinylm::summaries``.

One compiled call per tensor costs a GPU its host wrapper and a kernel launch each, and a
probed pass can hand the op about a thousand tensors. Here the list is cut into groups of one
dtype and one number of entries (a pass has few distinct sizes: six for the launch-bound
tinylm pass's 1,020 tensors), each group copied into one (k, r, w) buffer and reduced by one
call of one compiled function (:func:`rows`); the groups' (k, 10) results are put back in the
list's order by one ``cat`` and one ``index_select``. The calls follow the distinct sizes, not
the tensors:

* a tensor of n entries is seen as r rows of w entries, w the largest divisor of n that is at
  most :data:`WIDTH` (n itself when n <= WIDTH): the first reduction runs over k r rows, not
  over k, so a group of one large tensor still spreads over the device;
* :func:`rows` is compiled once per dtype and device, never per shape: its first input of a
  dtype has its three sizes marked unbacked (``torch._dynamo.decorators.mark_unbacked``), so
  the graph holds for every k, r and w, 1 included (dynamo would otherwise specialise sizes
  0 and 1, and inductor's strides add guards of their own: up to eight graphs a dtype, past
  dynamo's recompile limit); every input has the standard strides of a fresh (k, r, w) tensor
  and no view base (dynamo guards on both);
* a group's copy is one ``cat`` per shape in it, each written into its place in the buffer
  (a group's tensors of one shape are taken together; a group of one shape: one ``cat``); a
  group of one tensor is not copied (a view; a copy only where it is not contiguous);
* a group whose buffer would exceed :data:`BOUND` bytes is reduced in chunks of at most that
  many bytes, so the op's extra memory does not grow with the model: a copy of that size
  takes tens of microseconds at a GPU's few TB/s, far more than a launch, so more chunks
  add no launch that matters;
* a tensor with no entries gives a row of zeros, as :func:`.reference.moments` does; under a
  ``TorchDispatchMode`` (which dynamo does not compile under) the formula runs op by op.

The numbers are :func:`.reference.moments`': per row of w entries the float64 partials of
:func:`.compiled.row_partials` (measured and finite entries, sum d and sum d^2 of d = x - K,
max |x|, the zero and under/overflow counts), K the tensor's first entry (0 where it is not
finite), summed over the tensor's r rows, then M2 = sum d^2 - (sum d)^2 / n, as the per-tensor
compiled reducer forms them (its rows are the tensor's last dimension; here they are w
entries): counts and max |x| exact, mean and M2 to the rounding of float64 sums.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from . import compiled

__all__ = ["WIDTH", "BOUND", "rows", "shape_of", "plan", "moments"]

#: most entries in one row of a group's buffer
WIDTH = 1024
#: most bytes in one group's buffer (a chunk of a larger group)
BOUND = 64 << 20

_failed = False  # compiling or running :func:`rows` failed in this process
_orders: dict = {}  # (order, device) -> the index that puts the groups' rows back in the list's order
_ORDERS_KEPT = 16


def rows(x: Tensor) -> Tensor:
    """(k, 10) float64: the FIELDS vector of each x[i] (x: (k, r, w), one tensor of r w entries a slice)."""
    first = x[:, 0, 0].double()
    shift = torch.where(torch.isfinite(first), first, 0.0)  # (k,)
    p = compiled.row_partials(x, None, shift[:, None, None])  # (k, r, 10)
    return compiled.finish(p.sum(1), p[:, :, 4].amax(1), shift)


def shape_of(n: int) -> tuple[int, int]:
    """(r, w): n entries as r rows of w, w the largest divisor of n that is at most :data:`WIDTH`."""
    if n <= WIDTH:
        return 1, max(n, 1)
    w = next(w for w in range(WIDTH, 0, -1) if n % w == 0)
    return n // w, w


def plan(xs: list[Tensor], bound: int = BOUND) -> list[tuple[torch.dtype, int, list[int]]]:
    """The calls :func:`moments` makes: (dtype, entries, indices into ``xs``) per chunk, groups in
    the order of their first tensor, each chunk at most ``bound`` bytes (or one tensor)."""
    groups: dict[tuple[torch.dtype, int], dict[tuple, list[int]]] = {}
    for i, x in enumerate(xs):  # in a group, the tensors of one shape together (one copy each run)
        groups.setdefault((x.dtype, x.numel()), {}).setdefault(tuple(x.shape), []).append(i)
    out = []
    for (dtype, n), shapes in groups.items():
        idx = [i for run in shapes.values() for i in run]
        per = max(1, bound // max(1, n * dtype.itemsize)) if n else len(idx)
        out += [(dtype, n, idx[s:s + per]) for s in range(0, len(idx), per)]
    return out


def _stacked(xs: list[Tensor], n: int) -> Tensor:
    """(len(xs) n,): the entries of ``xs`` (n each; one dtype, at least two tensors) one after
    the other, in one buffer: one ``cat`` per run of one shape, written in place (no flat view
    of each tensor: a view is an op too; non-contiguous tensors are read as they are)."""
    runs, start = [], 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or xs[i].shape != xs[start].shape:
            runs.append((start, i))
            start = i
    if len(runs) == 1 and xs[0].dim():
        return torch.cat(xs).view(-1)
    buf = xs[0].new_empty(len(xs) * n)
    for a, b in runs:
        shape, dst = xs[a].shape, buf[a * n:b * n]
        if len(shape):
            torch.cat(xs[a:b], out=dst.view(-1, *shape[1:]))
        else:  # 0-d tensors
            torch.stack(xs[a:b], out=dst)
    return buf


def _reduce(xs: list[Tensor], n: int) -> Optional[Tensor]:
    """(k, 10): the moments of ``xs`` (one dtype, ``n`` > 0 entries each) from one compiled call."""
    r, w = shape_of(n)
    if len(xs) == 1:  # a view where it is contiguous, with the standard strides (dynamo guards on
        x = xs[0] if xs[0].is_contiguous() else xs[0].contiguous()  # strides, size-1 dims' included)
        buf = x.as_strided((1, r, w), (r * w, w, 1))
    else:
        buf = _stacked(xs, n).view(len(xs), r, w)
    # detached: no view's base, whose sizes dynamo would guard on too; a new tensor object,
    # so the marks below never land on the caller's
    buf = buf.detach()
    if _observed():  # a dispatch mode sees every op: the formulas, op by op
        return rows(buf)
    marked = _marked(compiled._function(rows))
    key = (buf.dtype, buf.device.type)
    if key not in marked:  # the first call of a dtype: a graph for every size (module docstring)
        torch._dynamo.decorators.mark_unbacked(buf, [0, 1, 2])
    try:
        out = compiled._function(rows)(buf)
    except Exception as err:  # noqa: BLE001 - any failure to compile or run: the list one tensor at a time
        _give_up(err)
        return None
    marked.add(key)
    return out


def _give_up(err: BaseException) -> None:
    global _failed
    _failed = True
    first = (str(err).strip().splitlines() or [""])[0][:200]
    warnings.warn(f"torch.compile could not build the grouped reduction of many tensors ({type(err).__name__}: "
                  f"{first}); they are reduced one compiled call per tensor for the rest of this process "
                  "(same numbers, more launches)", RuntimeWarning, stacklevel=4)


def _observed() -> bool:
    """Whether a ``TorchDispatchMode`` is on (dynamo does not compile under one)."""
    return bool(torch._C._len_torch_dispatch_stack())


def _marked(fn) -> set:
    """The (dtype, device type) whose first input to the compiled ``fn`` was marked: kept on
    ``fn`` itself, so a function built anew (another backend, a test's fresh state) marks again;
    emptied where dynamo holds fewer graphs of :func:`rows` than it has marked (its caches were
    reset since: ``torch._dynamo.reset()``), so the next build is marked too."""
    marked = getattr(fn, "tinylm_marked", None)
    if marked is None:
        marked = fn.tinylm_marked = set()
    elif len(marked) > len(_debug_get_cache_entry_list(rows.__code__)):
        marked.clear()
    return marked


def _order(order: list[int], device: torch.device) -> Tensor:
    """The index tensor that takes the groups' rows (in ``order``) back to the list's order, made
    once per order and device (a copy to the device would wait for it)."""
    key = (tuple(order), device)
    idx = _orders.get(key)
    if idx is None:
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        if len(_orders) >= _ORDERS_KEPT:
            _orders.pop(next(iter(_orders)))
        idx = _orders[key] = torch.tensor(inverse, dtype=torch.long, device=device)
    return idx


def moments(xs: list[Tensor], bound: int = BOUND) -> Optional[Tensor]:
    """(N, 10) float64 on the tensors' device: the FIELDS vector of every tensor of ``xs`` (one
    device; :data:`.reduction.DTYPES`, any shape, contiguous or not, empty ones included), in
    the list's order, from one compiled call per chunk of :func:`plan`; None where compilation
    or a compiled call failed, now (warned once) or before in this process: the caller reduces
    them one by one (the per-tensor compiled reducer is a separate build that may still work)."""
    if not xs or _failed:
        return None
    with torch.no_grad():  # the copies write into a buffer (out=): no autograd
        return _moments(xs, bound)


def _moments(xs: list[Tensor], bound: int) -> Optional[Tensor]:
    device = xs[0].device
    order, parts = [], []
    for _dtype, n, idx in plan(xs, bound):
        if n == 0:
            part = torch.zeros(len(idx), 10, dtype=torch.float64, device=device)
        else:
            part = _reduce([xs[i] for i in idx], n)
            if part is None:
                return None
        order += idx
        parts.append(part)
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if order == list(range(len(xs))):
        return out
    return out.index_select(0, _order(order, device))
