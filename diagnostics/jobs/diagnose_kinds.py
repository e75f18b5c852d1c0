"""Fresh, misscaled or trained, decided per weight kind (:class:`~diagnostics.judge.kinds.WeightKind`).

Internal to :mod:`diagnostics.jobs.diagnose`. A kind is the parameter name with its block prefix
removed ("layers.3.ffn.w2.weight" -> "ffn.w2"; "model.layers.0.mlp.down_proj.weight" ->
"mlp.down_proj"); a parameter outside the block stack is a kind of its own. Per kind, over the
parameters with a declared distribution (:mod:`.diagnose_init`):

* fresh: every tensor passes the fresh rule (:func:`.diagnose_init.fresh_one`: its std within a
  fresh draw's spread of the declared one; a constant one unchanged);
* misscaled: not fresh, but every tensor is still an i.i.d. draw of its declared family at some
  scale (:func:`diagnostics.measure.weight_shape.shape`: mean, Kolmogorov-Smirnov, spectral edge),
  the per-block stds agree with one common factor
  (:func:`diagnostics.measure.weight_shape.consistent`), and that factor is outside
  [1/MISSCALE_MIN, MISSCALE_MIN];
* trained: otherwise (``why`` says which test failed), and a would-be misscaled kind in a model
  where any other kind is trained: weight decay shrinks the weights training leaves untouched
  (rows of tokens never seen) by one common factor, which keeps them a rescaled fresh draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from ..judge.kinds import MISSCALE_MIN, WeightKind
from ..measure.weight_shape import consistent, kurtosis, shape
from ..result import ParamRow
from .diagnose_init import Declaration, fresh_one

__all__ = ["weight_kinds", "kind_of", "at_init"]


def kind_of(name: str, blocks: tuple[str, ...]) -> tuple[str, int | None]:
    """(kind, block index) of a parameter name, given the block stack's module names in order."""
    base = name.removesuffix(".weight")
    for i, b in enumerate(blocks):
        if base.startswith(b + "."):
            return base[len(b) + 1:], i
    return base, None


def at_init(kinds: list[WeightKind]) -> bool | None:
    """Whether every kind is at its declared init or a fresh draw of it at another scale (None: no kinds)."""
    if not kinds:
        return None
    return all(k.state in ("fresh", "misscaled") for k in kinds)


def weight_kinds(model: nn.Module, params: list[ParamRow], decl: Declaration, blocks: tuple[str, ...]
                 ) -> list[WeightKind]:
    """Every declared kind's state, in the parameters' order; [] when nothing is declared."""
    if not decl.known:
        return []
    named = dict(model.named_parameters())
    groups: dict[str, list[tuple[ParamRow, int | None]]] = {}
    for p in params:
        if p.name in decl.dists and p.name in named and p.name.endswith("weight"):
            kind, block = kind_of(p.name, blocks)
            groups.setdefault(kind, []).append((p, block))
    kinds = [_decide(kind, rows, named.__getitem__, decl) for kind, rows in groups.items()]
    trained = [k.kind for k in kinds if k.state == "trained"]
    if not trained:
        return kinds
    why = (f"a uniformly rescaled draw of its init in a model whose other kinds are trained ({trained[0]}): "
           "weight decay shrinks weights that training leaves untouched by one factor")
    return [replace(k, state="trained", why=why) if k.state == "misscaled" else k for k in kinds]


def _decide(kind: str, rows: list[tuple[ParamRow, int | None]], weight: Callable, decl: Declaration) -> WeightKind:
    """One kind's state (the module docstring's rule)."""
    ps = [p for p, _ in rows]
    dists = [decl.dists[p.name] for p in ps]
    blocks = tuple(sorted({b for _, b in rows if b is not None}))
    first = ps[0]
    fan_in = first.shape[1] if len(first.shape) == 2 else None
    base = dict(kind=kind, blocks=blocks, names=tuple(p.name for p in ps), declared_std=first.declared_std,
                fan_in=fan_in)
    factors = [p.std / p.declared_std for p in ps if p.declared_std and math.isfinite(p.std) and p.std > 0]
    factor = math.exp(sum(math.log(f) for f in factors) / len(factors)) if len(factors) == len(ps) else None
    if all(fresh_one(p, d) for p, d in zip(ps, dists)):
        return WeightKind(state="fresh", factor=factor, **base)
    if factor is None or any(d.family == "constant" for d in dists):
        return WeightKind(state="trained", factor=factor, why="moved off its declared values", **base)
    if 1 / MISSCALE_MIN <= factor <= MISSCALE_MIN:
        return WeightKind(state="trained", factor=factor,
                          why=f"off its declared std by {factor:.3g}x, within [1/{MISSCALE_MIN:g}, {MISSCALE_MIN:g}]",
                          **base)
    for p, d in zip(ps, dists):
        s = shape(weight(p.name), d, p.spectral_norm, tests=len(ps))
        if s is None or not s.draw:
            return WeightKind(state="trained", factor=factor,
                              why=f"{p.name}: {s.why if s is not None else 'not testable'}", **base)
    q, limit = consistent([p.std / p.declared_std for p in ps], [math.prod(p.shape) for p in ps],
                          kurtosis(dists[0]))
    if q > limit:
        return WeightKind(state="trained", factor=factor,
                          why=f"its blocks' stds disagree (chi-square {q:.3g} > {limit:.3g})", **base)
    return WeightKind(state="misscaled", factor=factor, **base)
