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
    max          the largest of each entry over the ranks (NaN ignored; NaN when every rank's is)
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
from .moments import AttnMoments, Moments, ParamStats, ProbeStats

__all__ = ["merge_distributed", "exchange", "process_group", "KINDS", "PARAM_FIELDS"]

#: How an entry of :func:`exchange` merges over the ranks (see the module docstring).
KINDS = ("moments", "attention", "sum", "mean", "first", "max")
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
    if kind == "max":
        return [max((x for x in col if not math.isnan(x)), default=math.nan) for col in zip(*rows)]
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
        One all-gather of one float64 vector, and one host transfer, whatever the number of
        entries; the float values given stay on the host (in one process nothing is sent to
        the device; over NCCL they go to it in one copy).
    """
    host, tensors, layout = [0.0], [], []  # host[0]: the layout hash
    at_tensor = 0
    for key, kind, vec in entries:
        if kind not in KINDS:
            raise OptionsError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
        flagged = kind in ("moments", "attention")  # these carry a flag: measured on this rank (1) or not (0)
        present = 1.0
        if vec is None:
            if not flagged:
                raise OptionsError(f"{key}: a {kind} entry needs its values; pass a vector")
            vec, present = (Moments() if kind == "moments" else AttnMoments()).vector(), 0.0
        if isinstance(vec, Tensor):  # stays on its device; the flag (known here) on the host
            t = vec.detach().reshape(-1).to(torch.float64)
            tensors.append(t)
            segments = [("t", at_tensor, t.numel())]
            at_tensor += t.numel()
        else:
            segments = [("h", len(host), len(vec))]
            host += [float(v) for v in vec]
        if flagged:
            segments.append(("h", len(host), 1))
            host.append(present)
        layout.append((key, kind, segments))
    host[0] = _layout_hash([(k, kind, sum(n for _, _, n in seg)) for k, kind, seg in layout])
    segments = [("h", 0, 1)] + [seg for _, _, segs in layout for seg in segs]  # the packed order
    rows = _rows(host, tensors, segments, group)
    out: dict[str, list[float] | None] = {}
    at = 1
    for key, kind, segs in layout:
        n = sum(k for _, _, k in segs)
        out[key] = _merge_rows(kind, [r[at:at + n] for r in rows])
        at += n
    return out


def _rows(host: list[float], tensors: list[Tensor], segments: list[tuple[str, int, int]], group
          ) -> list[list[float]]:
    """Each rank's values in the packed order (``segments``: (host "h" or tensors "t", offset,
    length) in turn), rank order. One process: the tensors' values in one host transfer, the
    host's as they are. Over a group: both packed in one float64 vector on the collective's
    device (the tensors moved there once, the host's values copied there once), one
    all_gather; a layout that differs between ranks raises on every rank."""
    device = next((t.device for t in tensors if not t.is_cpu), torch.device("cpu"))
    dev = torch.cat([t.to(device) for t in tensors]) if tensors else None
    if group is None:
        values = {"h": host, "t": dev.tolist() if dev is not None else []}
        return [[x for part, at, n in segments for x in values[part][at:at + n]]]
    target = _device(group)
    if dev is not None and dev.device != target:
        dev = dev.cpu() if target.type == "cpu" else dev.to(target)
    parts = {"h": torch.tensor(host, dtype=torch.float64).to(target), "t": dev}
    packed = torch.cat([parts[part][at:at + n] for part, at, n in segments])
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    rows = torch.stack(gathered).tolist()
    if any(r[0] != rows[0][0] for r in rows):
        raise OptionsError("the ranks measured different tensors (their layouts differ); every rank must "
                           "run the same model through the same code")
    return rows


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
