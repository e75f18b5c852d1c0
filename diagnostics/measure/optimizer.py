"""What an optimizer step did: the Adam epsilon share and the update's alignment with the gradient.

At a recorded step of the watch, right after the optimizer step (a step post-hook), three
figures of that step (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities"; Molybog et al. 2023, "A theory on Adam instability in large-scale
machine learning"):

    eps_share      over the entries of the parameters whose optimizer state holds
                   ``exp_avg_sq`` (Adam, AdamW and their foreach/fused variants, any optimizer
                   keeping that state with ``betas`` and ``eps`` in its param group): the share
                   with sqrt(v_hat) < eps, v_hat = exp_avg_sq / (1 - beta2^step) (the state's
                   step after the update). NaN when no parameter has such state.
    alignment      cos(Delta W, -g) = -<Delta W, g> / (||Delta W|| ||g||) over all parameters
                   flattened together; Delta W = W_after - W_before, g the gradient the step
                   used (clipped where the loop clipped before ``opt.step``). 1 for plain SGD
                   (Delta W = -lr g). NaN where no gradient was seen (no step taken, a zero
                   update or gradient).
    alignment_min  the smallest per-matrix (ndim >= 2) cos(Delta W_i, -g_i); NaN where none is defined.

The gradient is read in the post-hook, where ``.grad`` still holds what the step used
(torch's optimizers read it without writing it; a scalar rescale in place, as a fused step
under ``GradScaler`` does, leaves every cosine unchanged), against W_before from the
watch's snapshot: no copy of the gradients is kept. Reading after the step also serves
loops whose step runs the forward and backward in a closure (Lightning), where a pre-hook
would see no gradient yet. Only watched parameters that the optimizer holds and that have a
gradient count.

The step's figures travel as sums, one float64 vector on the parameters' device (no host
transfer; :meth:`OptimizerSignals.vector`): [entries with sqrt(v_hat) < eps, entries with
state, then per parameter <Delta W_i, g_i>, ||Delta W_i||^2, ||g_i||^2]; the watch merges it
over the ranks as a sum (:func:`diagnostics.measure.distributed.exchange`) and
:meth:`OptimizerSignals.figures` turns the merged sums into the three figures. A plain
tensor is taken as replicated on every rank of the group (data parallel): each rank adds
1/W of its sums (W ranks), so the merged figures are exact for replicas and for optimizer
state partitioned over the ranks alike. A ``DTensor`` (FSDP2) adds its local shard's sums
where :func:`diagnostics.measure.sharded.local_part` counts it, so the merge gives the
whole tensor's sums; one that cannot be read from its shards (a ``Partial`` placement)
adds nothing (its own cosine NaN, the totals over the rest).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import sharded, update_sums

__all__ = ["OptimizerSignals", "optimizer_signals", "usable_optimizer", "FIGURES"]

#: The figures of a step, in the order :meth:`OptimizerSignals.figures` gives them.
FIGURES = ("eps_share", "alignment", "alignment_min")


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside wrappers that keep it as ``.optimizer`` (accelerate's)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _local(t: Tensor | None, weight: float) -> tuple[Tensor | None, float]:
    """(the tensor to sum over, the weight of its sums) on this rank: a plain tensor as it is with
    ``weight``; a DTensor's local shard with weight 1 where it counts, 0 where another rank counts
    it; (None, 0) where it cannot be read from its shards."""
    if t is None or not sharded.is_dtensor(t):
        return t, weight
    local, counts = sharded.local_part(t)
    return local, (1.0 if counts else 0.0)


class OptimizerSignals:
    """The optimizer figures of one step at a time (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` holding some of ``params`` (a wrapper keeping
            it as ``.optimizer``, such as accelerate's, is looked through); None: off (nothing
            measured, no entry, no record key).
        params: the watched parameters, {name: parameter}.
        world: the number of ranks the watch merges over (1: one process).

    A step post-hook is registered once, here; it measures only while armed (:meth:`arm`, at a
    recorded step) and disarms itself after the first step it sees. :meth:`close` removes it.
    The watch's part: :meth:`arm` at its snapshot, :meth:`entries` into its exchange,
    :meth:`merge` of what came back, :meth:`record` into the record, :meth:`close`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, params: dict[str, Tensor], world: int = 1):
        self.optimizer = _inner(optimizer)
        held = {id(p) for g in (self.optimizer.param_groups if optimizer is not None else ()) for p in g["params"]}
        self.names = [n for n, p in params.items() if id(p) in held]
        self.params = {n: params[n] for n in self.names}
        self.matrices = [i for i, n in enumerate(self.names) if self.params[n].ndim >= 2]
        self.weight = 1.0 / max(1, int(world))
        self.last: dict[str, float] | None = None  # the figures of the last merged step
        self._before: dict[str, Tensor] | None = None
        self._rows: Tensor | None = None
        self._handle = None if optimizer is None else self.optimizer.register_step_post_hook(self._after_step)

    @property
    def on(self) -> bool:
        """Whether an optimizer is measured."""
        return self.optimizer is not None

    def arm(self, before: dict[str, Tensor]) -> dict[str, Tensor]:
        """Measure the next optimizer step, against ``before`` (the watch's copies of the weights
        before it: {name: tensor}); returns ``before``."""
        if self.on:
            self._before, self._rows = before, None
        return before

    def entries(self) -> list[tuple[str, str, Tensor]]:
        """The entries of the watch's exchange: [("optimizer", "sum", :meth:`vector`)] ([] when off)."""
        return [("optimizer", "sum", self.vector())] if self.on else []

    def merge(self, got: dict[str, Any]) -> None:
        """The figures of the exchange's merged "optimizer" entry, kept as ``last`` (nothing when off)."""
        if self.on:
            self.figures(got["optimizer"])

    def record(self) -> dict[str, dict[str, float]]:
        """The record's part: {"optimizer": ``last``} ({} when off)."""
        return {"optimizer": dict(self.last)} if self.on and self.last is not None else {}

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._before, self._rows = None, None

    @torch.no_grad()
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        self._rows = self._update_rows(before)

    def _update_rows(self, before: dict[str, Tensor]) -> Tensor:
        """(P, 3): per parameter <Delta W_i, g_i>, ||Delta W_i||^2, ||g_i||^2, this rank's share
        (zeros for a parameter without a gradient or a copy)."""
        plain = update_sums.sums([self.params[n] for n in self.names], [before.get(n) for n in self.names],
                                 [self.params[n].grad for n in self.names])
        if plain is not None:  # every one a plain tensor with its copy and gradient, on one device: one op
            return plain * self.weight
        rows = []
        for n in self.names:
            p, was = self.params[n], before.get(n)
            grad = p.grad
            now, w = _local(p, self.weight)
            was, _ = _local(was, self.weight)
            g, _ = _local(grad, self.weight)
            if now is None or was is None or g is None or g.is_sparse or not now.shape == was.shape == g.shape:
                rows.append(None)
                continue
            rows.append(update_sums.update_row(now, was, g) * w)
        return self._stack(rows, 3)

    def _stack(self, rows: list[Tensor | None], width: int) -> Tensor:
        home = next((r.device for r in rows if r is not None), self._device())
        zero = torch.zeros(width, dtype=torch.float64, device=home)
        if not rows:
            return zero[:0].reshape(0, width)
        return torch.stack([zero if r is None else r.to(home) for r in rows])

    def _device(self) -> torch.device:
        p = next(iter(self.params.values()), None)
        if p is None:
            return torch.device("cpu")
        local, _ = _local(p, 1.0)
        return (local if local is not None else p).device

    @torch.no_grad()
    def _eps_counts(self) -> Tensor:
        """[entries with sqrt(v_hat) < eps, entries with state] over this rank's share (float64, (2,))."""
        watched = {id(p) for p in self.params.values()}
        found = []  # (v, step, beta2, eps, weight) of each watched parameter with that state
        for group in self.optimizer.param_groups:
            betas, eps = group.get("betas"), group.get("eps")
            if betas is None or eps is None:
                continue
            for p in group["params"]:
                state = self.optimizer.state.get(p) or {}
                if id(p) not in watched or "exp_avg_sq" not in state or "step" not in state:
                    continue
                v, w = _local(state["exp_avg_sq"], self.weight)
                if v is not None:
                    found.append((v, state["step"], betas[1], eps, w))
        rows = update_sums.counts(*[[f[i] for f in found] for i in range(4)])
        if rows is not None:  # every one a plain tensor with a tensor step, on one device: one op
            return (rows * self.weight).sum(0)
        return self._stack([update_sums.eps_row(*f[:4]) * f[4] for f in found], 2).sum(0)

    def vector(self) -> Tensor:
        """The step's sums as one float64 tensor on the parameters' device (no host transfer):
        [small, with state, then <Delta W_i, g_i>, ||Delta W_i||^2, ||g_i||^2 per parameter];
        zeros for the update where no step was seen since :meth:`arm`. Disarms."""
        rows, self._rows, self._before = self._rows, None, None
        if rows is None:
            rows = self._stack([None] * len(self.names), 3)
        eps = self._eps_counts()
        return torch.cat([eps, rows.to(eps.device).reshape(-1)])

    def figures(self, values: list[float] | Tensor) -> dict[str, float]:
        """{eps_share, alignment, alignment_min} from the sums of :meth:`vector` (merged over the
        ranks by the watch); kept as ``last``."""
        values = values.tolist() if isinstance(values, Tensor) else list(values)
        small, total, rows = values[0], values[1], values[2:]
        dots, dd, gg = rows[0::3], rows[1::3], rows[2::3]

        def cos(dot: float, a: float, b: float) -> float:
            return -dot / math.sqrt(a * b) if a > 0 and b > 0 else math.nan

        each = [cos(dots[i], dd[i], gg[i]) for i in self.matrices]
        each = [c for c in each if not math.isnan(c)]
        self.last = {"eps_share": small / total if total > 0 else math.nan,
                     "alignment": cos(math.fsum(dots), math.fsum(dd), math.fsum(gg)),
                     "alignment_min": min(each) if each else math.nan}
        return self.last


def optimizer_signals(optimizer: Any, params: dict[str, Tensor], group: Any = None) -> OptimizerSignals:
    """:class:`OptimizerSignals` of ``optimizer`` over ``params`` merged over ``group`` (a process
    group, None: one process), after checking ``optimizer``: None (off), or a
    ``torch.optim.Optimizer`` holding at least one of ``params`` (else :class:`diagnostics.OptionsError`)."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    if optimizer is None:
        return OptimizerSignals(None, params, world)
    from tinylm import validate

    from ..options import OptionsError

    validate.check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer",
                        fix="the optimizer whose steps train the model (or None)", error=OptionsError)
    signals = OptimizerSignals(optimizer, params, world)
    if not signals.names:
        signals.close()
        validate.refuse(f"optimizer={type(signals.optimizer).__name__}: must hold some of the watched parameters",
                        "pass the optimizer built over this model's parameters", error=OptionsError,
                        argument="optimizer")
    return signals


def usable_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """``optimizer`` when the watch can measure its steps on ``model`` (a ``torch.optim.Optimizer``,
    or a wrapper of one, holding some of the model's parameters), else None: what a trainer
    callback passes on, so that an optimizer of another kind (DeepSpeed's) goes unmeasured
    rather than refused."""
    inner = _inner(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return None
    held = {id(p) for g in inner.param_groups for p in g["params"]}
    return optimizer if any(id(p) in held for p in model.parameters()) else None
