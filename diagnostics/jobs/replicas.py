"""``check_replicas``: whether every data-parallel replica holds the same parameters, in one collective.

    opt.step()
    if t % 100 == 0:
        result = check_replicas(ddp_model)       # every rank calls it; every rank gets the same answer
        if not result.agree: print(result)       # "rank 1 departs at layers.0.ffn.w1.weight ..."

After an optimizer step, data-parallel replicas (DDP; FSDP2's replicated mesh dimension, as in
HSDP) hold the same parameters bit for bit: the same averaged gradients, the same optimizer math.
A replica that does not had a fault (a flipped bit in its memory or arithmetic) or a step that
was not the same (a rank that skipped an update), and from then on the replicas train different
models while the run looks healthy.

Each rank reduces each parameter (its local tensor; a DTensor's local shard) to three int64 words
(:func:`diagnostics.measure.bits.checksums`: the sum of the bit patterns, a position-weighted sum
and the bits of the float64 sum of squares). One ``all_gather`` of the (P, 3) words per group of
replicas, and each rank compares: per parameter the words most ranks hold are the reference
(ties: the lowest rank's), and a rank whose words differ departs there. One flipped bit changes
the first word, so it is always found; with two replicas, which of the two is wrong cannot be
told: the one that differs from the lower rank is named. Cost: one pass over the parameters and
one collective of 24 bytes per parameter tensor.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..measure.bits import checksums
from ..measure.distributed import process_group
from ..measure.wrappers import unwrap

__all__ = ["check_replicas", "ReplicaResult", "ReplicaDeparture"]

REPLICA_SCHEMA_VERSION = "1"


@dataclass
class ReplicaDeparture:
    """A rank whose ``parameter`` differs from the reference replica's: its global ``rank``, the
    reference's rank, and ``relative`` = sqrt(its sum of squares / the reference's) - 1 (0 when
    only the bits moved, inf or NaN when the values are not finite)."""

    rank: int
    parameter: str
    reference_rank: int
    relative: float


@dataclass
class ReplicaResult:
    """``verdict``: "agree", "departs" or "not measured" (one process, or no replicated parameter);
    ``departures`` rank by rank (the first parameter in model order first); ``ranks`` the replicas
    compared, ``parameters`` the tensors compared, ``skipped`` those held by no other replica."""

    verdict: str
    departures: list[ReplicaDeparture]
    ranks: int
    parameters: int
    skipped: list[str] = field(default_factory=list)
    step: int | None = None
    schema_version: str = field(default=REPLICA_SCHEMA_VERSION)

    @property
    def agree(self) -> bool | None:
        return None if self.verdict == "not measured" else self.verdict == "agree"

    @property
    def first(self) -> ReplicaDeparture | None:
        return self.departures[0] if self.departures else None

    def to_frame(self):
        import pandas as pd

        cols = ["step", "rank", "parameter", "reference_rank", "relative"]
        return pd.DataFrame([{"step": self.step, **asdict(d)} for d in self.departures], columns=cols)

    def to_dict(self) -> dict:
        def num(v):
            return v if not isinstance(v, float) or math.isfinite(v) else str(v)
        return {"schema_version": self.schema_version, "summary": str(self), "verdict": self.verdict,
                "step": self.step, "ranks": self.ranks, "parameters": self.parameters, "skipped": self.skipped,
                "departures": [{k: num(v) for k, v in asdict(d).items()} for d in self.departures]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def __str__(self) -> str:
        at = "" if self.step is None else f"step {self.step}: "
        if self.verdict == "not measured":
            return f"{at}not measured: no parameter is held by more than one replica here"
        if self.verdict == "agree":
            return f"{at}the {self.ranks} replicas agree bit for bit on {self.parameters} parameter tensors"
        ranks = sorted({d.rank for d in self.departures})
        f = self.first
        more = f" (and {len(self.departures) - 1} more)" if len(self.departures) > 1 else ""
        return (f"{at}rank {', '.join(map(str, ranks))} departs from rank {f.reference_rank} at {f.parameter} "
                f"(relative size {f.relative:+.2g}){more} — the replicas no longer train the same model: "
                "suspect that rank's device, restart from the last checkpoint on another")


def _replica_group(p: torch.Tensor, default) -> tuple[object | None, torch.Tensor]:
    """(the group of ranks holding the same copy of ``p``, its local tensor): a DTensor's first
    mesh dimension it is replicated on (None if none), else ``default`` (DDP's group)."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return default, p.detach()
    mesh = p.device_mesh
    dims = [i for i, pl in enumerate(placements) if pl.is_replicate()]
    local = p.to_local().detach()
    if not dims or mesh.size(dims[0]) < 2:
        return None, local
    return mesh.get_group(dims[0]), local


def _departures(words: torch.Tensor, names: list[str], ranks: list[int]) -> list[ReplicaDeparture]:
    """words (R, P, 3) int64 gathered over R replicas: who departs, per parameter (module docstring)."""
    out = []
    rows = words.tolist()
    for j, name in enumerate(names):
        held = [tuple(rows[r][j]) for r in range(len(ranks))]
        counts = Counter(held)
        top = max(counts.values())
        ref = next(r for r in range(len(ranks)) if counts[held[r]] == top)
        ss_ref = torch.tensor(held[ref][2]).view(torch.float64).item()
        for r in range(len(ranks)):
            if held[r] != held[ref]:
                ss = torch.tensor(held[r][2]).view(torch.float64).item()
                rel = math.sqrt(ss / ss_ref) - 1 if ss_ref > 0 and math.isfinite(ss) else \
                    (0.0 if ss == ss_ref else math.inf)
                out.append(ReplicaDeparture(ranks[r], name, ranks[ref], rel))
    return out


@torch.no_grad()
def check_replicas(model: nn.Module, group=None, step: int | None = None) -> ReplicaResult:
    """Compare every replica's parameters (module docstring); every rank of the group must call it.

    Args:
        model: the DDP model (or the module inside it), or a model under FSDP2 whose mesh has a
            replicated dimension; parameters held by one rank only (fully sharded) are skipped.
        group: the process group of the replicas of plain (non-DTensor) parameters; None: the DDP
            model's, else the default group.
        step: the step the check follows, for the message.
    Returns: a :class:`ReplicaResult`, the same on every rank.
    """
    default = group if group is not None else process_group(model)
    inner = unwrap(model)
    by_group: dict[object, tuple[list[str], list[torch.Tensor]]] = {}
    skipped = []
    seen = set()
    for name, p in inner.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        g, local = _replica_group(p, default)
        if g is None:
            skipped.append(name)
            continue
        names, words = by_group.setdefault(g, ([], []))
        names.append(name)
        words.append(checksums(local))
    departures, ranks, count = [], 0, 0
    for g, (names, words) in by_group.items():
        mine = torch.stack(words)  # (P, 3)
        n = dist.get_world_size(g)
        gathered = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(gathered, mine, group=g)
        members = [dist.get_global_rank(g, i) for i in range(n)]
        departures += _departures(torch.stack(gathered).cpu(), names, members)
        ranks, count = max(ranks, n), count + len(names)
    if not by_group:
        return ReplicaResult("not measured", [], 1, 0, skipped, step)
    order = {n: i for i, (n, _) in enumerate(inner.named_parameters())}
    departures.sort(key=lambda d: (order.get(d.parameter, 0), d.rank))
    return ReplicaResult("departs" if departures else "agree", departures, ranks, count, skipped, step)
