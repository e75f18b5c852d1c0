"""Evidence: the measurements that tell the causes of a symptom apart.

Read from the probe's records beside the symptoms: the scores' mean square against
E[q^2] E[k^2] (about 1 with the 1/sqrt(d_k) scale, on weights at their init), the fraction of
SiLU gate inputs in the flat region and their offset, the block weights' variance gain
std^2 fan_in and their std against the declared scheme, the q/k weights' gain, each block's
median weight-gradient std, and the post-norm stack's gradient imbalance. docs/verdicts.md
gives the measurement behind each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinylm.plan import block_index as block_of

from ..result import DepthRow, ParamRow, TensorRow
from .kinds import role

__all__ = ["Evidence", "evidence"]


@dataclass
class Evidence:
    """What the measurement says about each cause (None: not measured or not applicable)."""

    norm: str | None = None  # "pre", "post", "none", or None when the build is unknown
    d_k: int | None = None
    score_ratio: dict[int, float] = field(default_factory=dict)  # block -> E[s^2] / (E[q^2] E[k^2])
    flat: dict[int, float] = field(default_factory=dict)  # block -> fraction of gate inputs below the edge
    gate_offset: dict[int, float] = field(default_factory=dict)  # block -> mean / std of the gate input
    gain_all: float | None = None  # median std^2 fan_in of the block weights
    gain_inner: float | None = None  # the same without the residual outputs
    drift: float | None = None  # median std / declared std of the block weights
    qk_gain: dict[int, float] = field(default_factory=dict)  # block -> sqrt(gain(q) gain(k))
    grad_medians: dict[int, float] = field(default_factory=dict)  # block -> median weight-gradient std
    dead_blocks: set[int] = field(default_factory=set)  # blocks whose FFN holds an exactly-zero tensor
    fresh: bool = False  # the weights at their declared init (the diagnosis's one decision): q, k independent
    imbalance: float | None = None  # stream gradient variance at the first block's output / the last's
    kinds: list = field(default_factory=list)  # the misscaled weight kinds (WeightKind), each its own finding


def median(v: list[float]) -> float | None:
    """The median of the finite values (an even count: the geometric mean of the middle two
    when the lower is positive, else the upper); None when there are none."""
    v = sorted(x for x in v if x is not None and math.isfinite(x))
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else math.sqrt(v[n // 2 - 1] * v[n // 2]) if v[n // 2 - 1] > 0 else v[n // 2]


def evidence(tensors: list[TensorRow], params: list[ParamRow], architecture: dict | None = None,
             flat: dict[str, float] | None = None, deliberate_zero: set[str] = frozenset(),
             depth: list[DepthRow] = (), fresh: bool | None = None) -> Evidence:
    """The measurements that tell the causes apart (see docs/verdicts.md for each one).

    Args:
        tensors, params, depth: the probe's records.
        architecture: what is known of the build ({"norm", "d_k", ...}; None: nothing).
        flat: {SiLU gate input name: fraction of its entries below -6}.
        deliberate_zero: tensor names exactly zero by design (their Linear's weight is left out).
        fresh: whether the weights are at their declared init (decided once per diagnosis; None: unknown,
            treated as not fresh).

    Returns:
        The :class:`Evidence`; ``dead_blocks`` is left empty (the symptoms fill it).
    """
    arch = architecture or {}
    ev = Evidence(norm=arch.get("norm"), d_k=arch.get("d_k"))
    rows = {(r.name, r.direction): r for r in tensors}
    ev.score_ratio = _score_ratios(tensors, rows)
    ev.flat, ev.gate_offset = _gates(flat or {}, rows)
    _weights(ev, params, deliberate_zero)
    ev.fresh = bool(fresh)
    ev.imbalance = _imbalance(depth)
    return ev


def _score_ratios(tensors: list[TensorRow], rows: dict) -> dict[int, float]:
    """Per block: E[s^2] / (E[q^2] E[k^2]) of its attention scores over the q and k they are formed
    from: the per-head q/k norms' outputs where the model has them (qk-norm), else the projections."""
    out: dict[int, float] = {}
    for r in tensors:
        if r.kind != "attn_scores" or r.direction != "forward" or r.block is None:
            continue
        base = r.name[: -len(".scores")]
        q = rows.get((f"{base}.q_norm", "forward")) or rows.get((f"{base}.q_proj", "forward"))
        k = rows.get((f"{base}.k_norm", "forward")) or rows.get((f"{base}.k_proj", "forward"))
        if q is None or k is None:
            continue
        den = q.mean_square * k.mean_square
        if den > 0 and math.isfinite(den) and math.isfinite(r.mean_square):
            out[r.block] = r.mean_square / den
    return out


def _gates(flat: dict[str, float], rows: dict) -> tuple[dict[int, float], dict[int, float]]:
    """Per block: the fraction of its SiLU gate inputs in the flat region, and their mean / std."""
    fractions: dict[int, float] = {}
    offsets: dict[int, float] = {}
    for name, frac in flat.items():
        b = block_of(name)
        if b is None:
            continue
        fractions[b] = frac
        g = rows.get((name, "forward"))
        if g is not None and g.var > 0 and math.isfinite(g.var):
            offsets[b] = g.mean / math.sqrt(g.var)
    return fractions, offsets


def _weights(ev: Evidence, params: list[ParamRow], deliberate_zero: set[str]) -> None:
    """The block weights' gains std^2 fan_in (all, inner, q/k), std drift, freshness and gradients."""
    weights = [p for p in params if p.block is not None and len(p.shape) == 2 and p.name.endswith(".weight")
               and p.std is not None and math.isfinite(p.std) and p.declared_std != 0
               and p.name[: -len(".weight")] not in deliberate_zero]
    gain = {p.name: p.std ** 2 * p.shape[1] for p in weights}
    ev.gain_all = median(list(gain.values()))
    ev.gain_inner = median([g for n, g in gain.items() if role(n.removesuffix(".weight"), True) != "residual"])
    ev.drift = median([p.drift for p in weights if p.drift is not None])
    for p in weights:
        if p.name.endswith(".attn.q_proj.weight"):
            kname = p.name.replace(".q_proj.", ".k_proj.")
            if kname in gain:
                ev.qk_gain[p.block] = math.sqrt(gain[p.name] * gain[kname])
    per_block: dict[int, list[float]] = {}
    for p in weights:
        if p.grad_std is not None and math.isfinite(p.grad_std) and p.grad_std > 0:
            per_block.setdefault(p.block, []).append(p.grad_std)
    ev.grad_medians = {b: median(v) for b, v in sorted(per_block.items())}


def _imbalance(depth: list[DepthRow]) -> float | None:
    """exp(|slope| (n - 1)), slope of the least-squares line through ln Var(g) of the n block outputs.

    The embedding's own scale (depth row 0) is left out; the line uses every block, which is
    steadier than the two end points alone (each a variance of a few thousand tokens' gradients).
    """
    grads = [d.backward_var for d in depth if d.index >= 1]
    if not (len(grads) >= 2 and all(g is not None and math.isfinite(g) and g > 0 for g in grads)):
        return None
    n = len(grads)
    ys = [math.log(g) for g in grads]
    mx, my = (n - 1) / 2, sum(ys) / n
    slope = sum((k - mx) * (y - my) for k, y in enumerate(ys)) / sum((k - mx) ** 2 for k in range(n))
    return math.exp(abs(slope) * (n - 1))
