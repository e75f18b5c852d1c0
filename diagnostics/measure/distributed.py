"""Statistics of a data-parallel job: every rank's moments merged exactly, in one collective.

Each rank packs what it measured into ONE float64 vector (per tensor its :data:`FIELDS`
vector and a presence flag, per attention panel its :data:`ATTN_FIELDS` vector and a flag,
and any sums or rank-0 values besides), the vectors are all-gathered once over the process
group, moved to the host once, and each entry is merged over the ranks in rank order:

    moments      Chan's pairwise update (n = n_a + n_b, delta = mean_b - mean_a,
                 mean = mean_a + delta n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n),
                 the largest max|x|, sums for the counts; ranks that did not measure it skipped
    attention    the same over the rows' entropies, the smallest entropy
    sum          the entries added
    mean         the entries' mean over the ranks
    first        rank 0's entries

so every rank gets the same figures, to the bit, that one process merging the ranks' records
in rank order gives. The layout (every entry's key, kind and length) must be the same on
every rank; a hash of it travels in the vector and a rank whose layout differs raises on
every rank (the same exception at the same call, never a rank left waiting).
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..options import OptionsError
from .moments import ATTN_FIELDS, FIELDS, AttnMoments, Moments, ParamStats, ProbeStats

__all__ = ["merge_distributed", "exchange", "process_group", "KINDS", "PARAM_FIELDS"]

#: How an entry of :func:`exchange` merges over the ranks (see the module docstring).
KINDS = ("moments", "attention", "sum", "mean", "first")
#: The numeric fields of a :class:`ParamStats` that travel (rank 0's are kept).
PARAM_FIELDS = ("std", "grad_std", "frac_nonfinite", "grad_frac_nonfinite", "spectral_norm", "stable_rank")


def process_group(model=None):
    """The process group a job merges over, or None for a single process: the group of a
    ``DistributedDataParallel`` ``model`` (else the default group) when ``torch.distributed``
    is initialised and that group has more than one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(model, "process_group", None) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _layout_hash(entries: Sequence[tuple[str, str, int]]) -> float:
    """A float (exact in float64) naming the layout: crc32 of every (key, kind, length)."""
    return float(zlib.crc32(repr(list(entries)).encode()))


def _device(group) -> torch.device:
    """Where the collective's tensor lives: the current CUDA device under NCCL, else the host."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _merge_rows(kind: str, rows: list[list[float]]) -> list[float] | None:
    """One entry merged over the ranks' rows (rank order); None for moments or attention that
    no rank measured (presence flag 0 everywhere)."""
    if kind == "first":
        return list(rows[0])
    if kind == "sum":
        return [math.fsum(col) for col in zip(*rows)]
    if kind == "mean":
        return [math.fsum(col) / len(rows) for col in zip(*rows)]
    cls = Moments if kind == "moments" else AttnMoments
    merged = None
    for row in rows:
        if row[-1] > 0:
            m = cls.from_vector(row[:-1])
            merged = m if merged is None else merged.merge(m)
    return None if merged is None else merged.vector()


def exchange(entries: Sequence[tuple[str, str, Tensor | Sequence[float] | None]], group=None
             ) -> dict[str, list[float] | None]:
    """Every entry merged over the ranks of ``group`` (None: a single process, nothing sent).

    Args:
        entries: (key, kind, vector) with kind in :data:`KINDS`; a "moments" vector is a
            :data:`FIELDS` vector, an "attention" one an :data:`ATTN_FIELDS` vector, None where
            this rank did not measure it; vectors may be tensors on any device or float lists.
            The keys, kinds and lengths must be the same on every rank.
        group: a process group of more than one rank, or None.

    Returns:
        {key: the merged values as floats (None: measured by no rank)}, the same on every rank.
        One all-gather of one float64 vector, and one host transfer, whatever the number of entries.
    """
    layout, parts = [], []
    for key, kind, vec in entries:
        if kind not in KINDS:
            raise OptionsError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
        width = len(FIELDS) if kind == "moments" else len(ATTN_FIELDS) if kind == "attention" else None
        if vec is None:
            if width is None:
                raise OptionsError(f"{key}: a {kind} entry needs its values; pass a vector")
            vec = (Moments() if kind == "moments" else AttnMoments()).vector() + [0.0]
        elif width is not None:
            vec = torch.cat([torch.as_tensor(vec, dtype=torch.float64).reshape(-1),
                             torch.ones(1, dtype=torch.float64, device=getattr(vec, "device", None))])
        parts.append(vec)
        layout.append((key, kind, len(vec)))
    device = next((p.device for p in parts if isinstance(p, Tensor) and not p.is_cpu), torch.device("cpu"))
    head = torch.tensor([_layout_hash(layout)], dtype=torch.float64, device=device)
    packed = torch.cat([head] + [torch.as_tensor(p, dtype=torch.float64).reshape(-1).to(device) for p in parts])
    if group is None:
        rows = [packed.tolist()]
    else:
        target = _device(group)
        if packed.device != target:
            packed = packed.cpu() if target.type == "cpu" else packed.to(target)
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, packed, group=group)
        rows = torch.stack(gathered).tolist()
        if any(r[0] != rows[0][0] for r in rows):
            raise OptionsError("the ranks measured different tensors (their layouts differ); every rank must "
                               "run the same model through the same code")
    out: dict[str, list[float] | None] = {}
    at = 1
    for key, kind, n in layout:
        out[key] = _merge_rows(kind, [r[at:at + n] for r in rows])
        at += n
    return out


def _param_values(p: ParamStats) -> list[float]:
    return [math.nan if getattr(p, f) is None else float(getattr(p, f)) for f in PARAM_FIELDS]


def merge_distributed(stats: ProbeStats, group=None) -> ProbeStats:
    """All ranks' ``stats`` merged (rank 0 first); the same result on every rank.

    Needs an initialised default process group (or ``group``); any backend with
    ``all_gather`` (gloo, nccl). One all-gather of one float64 vector (:func:`exchange`).
    Parameter statistics are rank 0's (data parallel: the replicas hold the same weights),
    ``steps`` and the SiLU flat-region counts are summed, everything else merged as moments.
    Every rank must have measured the same tensors (else each raises OptionsError).
    """
    if not isinstance(stats, ProbeStats):
        raise OptionsError(f"stats={type(stats).__name__}: pass the ProbeStats of a run (run.stats)")
    if not (dist.is_available() and dist.is_initialized()):
        raise OptionsError("torch.distributed is not initialised: call dist.init_process_group first "
                           "(or use the stats as they are in a single process)")
    group = group if group is not None else dist.group.WORLD
    entries = [(f"t/{n}/{d}", "moments", m.vector()) for (n, d), m in stats.tensors.items()]
    entries += [(f"a/{n}", "attention", a.vector()) for n, a in stats.attention.items()]
    for part in ("cosine", "inv_ms", "norm_back"):
        entries += [(f"{part}/{n}", "moments", m.vector()) for n, m in getattr(stats, part).items()]
    entries += [(f"flat/{n}", "sum", list(v)) for n, v in stats.flat.items()]
    entries += [(f"p/{n}", "first", _param_values(p)) for n, p in stats.params.items()]
    entries.append(("steps", "sum", [float(stats.steps)]))
    got = exchange(entries, group if dist.get_world_size(group) > 1 else None)

    def moments(prefix: str, cls, items):
        return {k: cls.from_vector(got[f"{prefix}{n}"]) for k, n in items if got[f"{prefix}{n}"] is not None}

    params = {}
    for n, p in stats.params.items():
        values = dict(zip(PARAM_FIELDS, got[f"p/{n}"]))
        params[n] = ParamStats(**{**p.__dict__, **{f: None if getattr(p, f) is None else values[f]
                                                   for f in PARAM_FIELDS}})
    return ProbeStats(
        tensors=moments("t/", Moments, [((n, d), f"{n}/{d}") for n, d in stats.tensors]),
        kinds=dict(stats.kinds), order=list(stats.order),
        attention=moments("a/", AttnMoments, [(n, n) for n in stats.attention]),
        cosine=moments("cosine/", Moments, [(n, n) for n in stats.cosine]), params=params,
        steps=int(got["steps"][0]),
        inv_ms=moments("inv_ms/", Moments, [(n, n) for n in stats.inv_ms]),
        norm_back=moments("norm_back/", Moments, [(n, n) for n in stats.norm_back]),
        flat={n: got[f"flat/{n}"] for n in stats.flat},
    )
