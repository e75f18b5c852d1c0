"""Statistics of sharded tensors (``DTensor``: FSDP2's ``fully_shard``, tensor parallelism) from their local shards.

A ``DTensor`` is one logical tensor whose entries live on the ranks of a device mesh: along
a mesh dimension placed ``Shard(d)`` each rank holds a different slice, along one placed
``Replicate()`` every rank holds the same entries, and ``Partial()`` entries are pending sums
(no rank holds a value). Its statistics come from the local shards (``t.to_local()``), never
from a gathered full tensor:

* each rank reduces its local shard to a :data:`~.reference.FIELDS` vector (float64, by the
  function it is given: :func:`.reducer.reduce`); a rank counts its entries only when it sits
  at coordinate 0 of every ``Replicate`` mesh dimension (so each entry is counted once), the
  others contribute an empty vector (count 0);
* the vectors of all the tensors on one mesh are packed into one float64 tensor (P, 10) and
  gathered with ONE ``all_gather`` over the mesh's ranks (:func:`gather`);
* every rank merges the gathered (W, P, 10) exactly, in rank order (:func:`merge_ranks`):
  n = sum_r n_r, mean = sum_r n_r mean_r / n, M2 = sum_r M2_r + sum_r n_r (mean_r - mean)^2
  (Chan's update over W parts at once), max for max|x|, sums for the counts.

Gathering the per-rank vectors (10 floats per tensor and rank) and merging them exactly was
chosen over all-reducing sums: it needs one collective, keeps M2 free of the cancellation of
a sum of squares, and gives every rank the same bits. Norms follow from the merged moments
(||W||_F^2 = M2 + n mean^2); the update ratio ||W - W_before||_F / ||W_before||_F
(:func:`update_ratio_vector`) packs the two sums of squares it needs per tensor into one
gather the same way. What needs the full matrix (spectral norm, stable rank) is not measured
for a sharded parameter: :func:`whole` says whether a tensor's local part is the whole of it.

A ``Partial`` placement, a rank outside the mesh, or a mesh whose ranks are neither the
mesh's own 1-D group nor the whole job leave a tensor not measured (None), never a wrong number.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from . import numba_reducer, reduction

__all__ = ["is_dtensor", "local_part", "whole", "gather", "merge_ranks", "moments", "update_ratio_vector",
           "update_ratios", "NOT_MEASURED_SPECTRAL"]

#: What a sharded parameter's row says of its spectral norm and stable rank.
NOT_MEASURED_SPECTRAL = "spectral norm, stable rank not measured: needs the full matrix under sharding"


_PLAIN = (Tensor, torch.nn.Parameter)
_F32 = torch.float32
_DTENSOR: list = []  # [DTensor or None], looked up once per process


def _dtensor_type():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - a torch without torch.distributed
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a parameter of one included)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_part(t: Tensor) -> tuple[Tensor | None, bool]:
    """(local tensor, whether this rank's entries count) of DTensor ``t``.

    A rank counts at coordinate 0 of every ``Replicate`` mesh dimension (``Shard`` dimensions:
    every coordinate). (None, False) when ``t`` cannot be measured from its shards: a
    ``Partial`` placement (pending sums) or a rank outside ``t``'s mesh."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None, False
    counts = True
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            continue
        if not placement.is_replicate():
            return None, False
        counts = counts and coord[dim] == 0
    return t.to_local(), counts


def whole(t: Tensor) -> Tensor | None:
    """``t`` itself for a plain tensor; a DTensor's local tensor when it holds every entry (every
    placement ``Replicate``); else None (the full tensor lives on several ranks)."""
    if not is_dtensor(t):
        return t
    if all(p.is_replicate() for p in t.placements):
        return t.to_local()
    return None


def _group(mesh):
    """The process group over all of ``mesh``'s ranks (its own for a 1-D mesh, the default group
    for a mesh over every rank of the job); None when there is no such group to use."""
    import torch.distributed as dist
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return None


def gather(packed: Tensor, group) -> Tensor:
    """(W, *packed.shape): ``packed`` of every rank of ``group``, in rank order (one ``all_gather``)."""
    import torch.distributed as dist
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed.contiguous(), group=group)
    return torch.stack(parts)


def merge_ranks(v: Tensor) -> Tensor:
    """(P, 10) FIELDS vectors merged over the first axis of ``v`` (W, P, 10), exactly, in float64:
    n = sum n_r, mean = sum n_r mean_r / n, M2 = sum M2_r + sum n_r (mean_r - mean)^2, max|x| the
    largest, every count summed (a part with n_r = 0 adds nothing)."""
    v = v.double()
    out = v.sum(0)
    n = v[..., 1]
    total = out[:, 1]
    mean = torch.where(total > 0, (n * v[..., 2]).sum(0) / total.clamp(min=1.0), 0.0)
    spread = torch.where(n > 0, n * (v[..., 2] - mean).square(), 0.0).sum(0)
    out[:, 2] = mean
    out[:, 3] = v[..., 3].sum(0) + spread
    out[:, 4] = v[..., 4].amax(0)
    return out


def moments(tensors: list[Tensor], vector: Callable[[Tensor], Tensor]) -> list[Tensor | None]:
    """The FIELDS vector (float64) of every tensor of ``tensors``, in order.

    ``vector``: the FIELDS vector of a plain tensor (``lambda t: reduce(t).moments``, on the
    tensor's device): plain tensors get theirs. DTensors: each rank reduces its local shard with
    it, the vectors of all DTensors on one mesh go through one :func:`gather` and
    :func:`merge_ranks` (one collective per mesh; the same vector on every rank, on the local
    shards' device). None: not measured (see :func:`local_part`; a mesh without a group). Every
    rank of a mesh must call this with the same DTensors in the same order (as an SPMD program does)."""
    out: list[Tensor | None] = [None] * len(tensors)
    by_mesh: dict = {}
    for i, t in enumerate(tensors):
        if is_dtensor(t):
            by_mesh.setdefault(t.device_mesh, []).append(i)
        else:
            out[i] = vector(t)
    for mesh, index in by_mesh.items():
        group = _group(mesh)
        device = tensors[index[0]].to_local().device  # the device the mesh's collectives take
        if group is None or mesh.get_coordinate() is None or device.type == "meta":
            continue
        vecs, known = [], []
        for i in index:
            local, counts = local_part(tensors[i])
            known.append(local is not None)
            vec = vector(local) if local is not None and counts else None
            vecs.append(vec)
        packed = torch.stack([torch.zeros(10, dtype=torch.float64, device=device) if v is None else v.to(device)
                              for v in vecs])
        merged = merge_ranks(gather(packed, group))
        for j, i in enumerate(index):
            if known[j]:
                out[i] = merged[j]
    return out


def _loop_reads(now: list[Tensor], was: list[Tensor]) -> bool:
    """Whether :func:`_plain_ratios` takes numba's loop: every tensor a plain contiguous CPU float32
    one, the two of a pair alike in size, under ``TINYLM_REDUCER=auto`` where nothing observes the
    ops (:func:`.reduction.direct`) and the loop is compiled (:func:`.numba_reducer.ready`)."""
    if not (reduction.direct() and reduction.all_numba(())):
        return False
    return all(type(a) in _PLAIN and type(b) in _PLAIN and a.dtype is _F32 and b.dtype is _F32 and a.is_cpu
               and b.is_cpu and a.is_contiguous() and b.is_contiguous() and a.numel() == b.numel()
               for a, b in zip(now, was))


def _sum_squares(t: Tensor) -> Tensor:
    return t.detach().double().square().sum()


@torch.no_grad()
def _plain_ratios(now: list[Tensor], was: list[Tensor]) -> Tensor:
    """The ratios of plain tensors in a fixed number of ops, whatever their number: the
    differences and both norms (float64 sums) by ``torch._foreach_*``, one stack each; or, for
    CPU float32 tensors on the default path, one call into numba's loop
    (:mod:`._numba_update`: each pair read once, no differences kept)."""
    if _loop_reads(now, was):
        out = np.zeros(len(now))
        addr = [np.fromiter([t.data_ptr() for t in ts], np.int64, len(ts)) for ts in (now, was)]
        numba_reducer.update_loop()(addr[0], addr[1], np.fromiter([t.numel() for t in now], np.int64, len(now)), out)
        return torch.from_numpy(out)
    num = torch.stack(torch._foreach_norm(torch._foreach_sub(now, was), 2, dtype=torch.float64))
    den = torch.stack(torch._foreach_norm(was, 2, dtype=torch.float64))
    return torch.where(den > 0, num / den, torch.where(num > 0, torch.inf, 0.0))


def update_ratio_vector(params: dict[str, Tensor], before: dict[str, Tensor]) -> Tensor | None:
    """||W - W_before||_F / ||W_before||_F for every name of ``before``, in its order, as one
    plain float64 tensor (no host transfer; None when ``before`` is empty). ``params``: the
    weights now. inf for a zero W_before that moved, 0 for one that did not, NaN where a sharded
    parameter cannot be measured. Plain tensors as they are; DTensors (``before`` a clone of the
    same placements) from their local shards: the two sums of squares of every counting rank,
    packed per mesh into one :func:`gather` and summed in rank order. Every rank of a mesh must
    call this alike."""
    names = list(before)
    if not names:
        return None
    if not any(is_dtensor(params[n]) or is_dtensor(before[n]) for n in names):
        return _plain_ratios([params[n] for n in names], [before[n] for n in names])
    sums: dict[str, Tensor | None] = {}
    by_mesh: dict = {}
    for n in names:
        p, b = params[n], before[n]
        if is_dtensor(p):
            by_mesh.setdefault(p.device_mesh, []).append(n)
        else:
            sums[n] = torch.stack([_sum_squares(p - b), _sum_squares(b)])
    for mesh, group_names in by_mesh.items():
        group = _group(mesh)
        device = params[group_names[0]].to_local().device
        if group is None or mesh.get_coordinate() is None or device.type == "meta":
            sums.update({n: None for n in group_names})
            continue
        rows, known = [], []
        for n in group_names:
            now, counts = local_part(params[n])
            was, _ = local_part(before[n]) if is_dtensor(before[n]) else (None, False)
            ok = now is not None and was is not None and now.shape == was.shape
            known.append(ok)
            rows.append(torch.stack([_sum_squares(now - was), _sum_squares(was)]) if ok and counts
                        else torch.zeros(2, dtype=torch.float64, device=device))
        total = gather(torch.stack(rows), group).sum(0)
        sums.update({n: total[j] if known[j] else None for j, n in enumerate(group_names)})
    home = next((v.device for v in sums.values() if v is not None), torch.device("cpu"))
    nan = torch.full((2,), math.nan, dtype=torch.float64, device=home)
    both = torch.stack([nan if sums[n] is None else sums[n].to(home) for n in names])  # (P, 2)
    num, den = both[:, 0].sqrt(), both[:, 1].sqrt()
    return torch.where(den > 0, num / den, torch.where(num > 0, torch.inf, 0.0))


def update_ratios(params: dict[str, Tensor], before: dict[str, Tensor]) -> dict[str, float]:
    """{name: ratio} of :func:`update_ratio_vector` (one host transfer for all of them)."""
    v = update_ratio_vector(params, before)
    return dict(zip(before, v.tolist())) if v is not None else {}
