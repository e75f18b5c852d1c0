"""``merge_distributed``: global statistics for a data-parallel job.

Every rank contributes its :class:`ProbeStats`; the moments are gathered over the
process group and merged in rank order (Chan's merge), so every rank gets the same
figures the single process would give on the concatenation of all ranks' batches.
"""

from __future__ import annotations

import torch.distributed as dist

from ..options import OptionsError
from .moments import ProbeStats

__all__ = ["merge_distributed"]


def merge_distributed(stats: ProbeStats, group=None) -> ProbeStats:
    """All ranks' ``stats`` merged (rank 0 first); the same result on every rank.

    Needs an initialised default process group (or ``group``); any backend that
    supports ``all_gather_object`` (gloo, nccl) works. Parameters statistics are
    those of rank 0 (data parallel: the replicas hold the same weights).
    """
    if not isinstance(stats, ProbeStats):
        raise OptionsError(f"stats={type(stats).__name__}: pass the ProbeStats of a run (run.stats)")
    if not (dist.is_available() and dist.is_initialized()):
        raise OptionsError("torch.distributed is not initialised: call dist.init_process_group first "
                           "(or use the stats as they are in a single process)")
    world = dist.get_world_size(group)
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, stats.to_dict(), group=group)
    merged = ProbeStats.from_dict(gathered[0])
    for d in gathered[1:]:
        merged = merged.merge(ProbeStats.from_dict(d))
    return merged
