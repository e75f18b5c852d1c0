"""Replay in a watched loop: chosen steps, and a step that alarms, rerun before the optimizer steps.

    watch = Watch(model, every=50)
    replayer = StepReplay(watch, steps=[1000, 2000])           # and, by default, every alarm
    for t, (x, y) in enumerate(batches):
        with watch.step(t):
            loss = replayer.run(t, lambda: step(x, y))        # your forward and backward
            opt.step(); opt.zero_grad()
        watch.record(loss)
    replayer.results                                           # {step: ReplayResult}

``run(t, fn)`` calls ``fn`` and returns its loss. On a chosen step it is :func:`diagnostics.replay`
(``fn`` twice under the fingerprint hooks, the model left as the first execution left it). On any
other step ``fn`` runs once, bare; then, in one process, when the loss would raise the watch's
alarm (not finite, or a spike against the watch's running loss: :meth:`Watch.alarm`'s rule, read
without changing it), the step is replayed at once, before the optimizer steps:

- the gradients and random generators the real execution left are set aside, the generators
  put back as they were before it, and :func:`replay` runs ``fn`` twice under the hooks: whether
  the step reproduces, and the first site where it does not;
- the real execution's loss and every parameter's gradient are compared bit for bit with the
  rerun's (``original`` in the result's dict): a real execution that alone differs had the fault;
- the real execution's gradients and generators are put back: the optimizer takes its step.

This needs the gradients cleared to None before the step (``optimizer.zero_grad()``'s default)
and a step that writes no buffer; otherwise the alarm is noted as not replayed, with the reason.
A fail the watch judges at a record (after the optimizer step), and under several ranks any alarm
(the watch judges the ranks' mean loss at the record, the same on every rank), replays the next
step instead, on every rank alike. Every result goes into the watch's forensics report of its step
(``report["replay"]``). Other steps cost, in one process with ``on_alarm``, a loop over the
parameters (is any gradient there?), a copy of the random generators' states (a few KB) and the
loss read once (the watch reads it at the record anyway); no hook, no copy of a model tensor.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from tinylm import validate

from ..errors import OptionsError
from ..measure.step_record import rng_state, set_rng_state
from .replay import ReplayOptions, ReplayResult, replay

__all__ = ["StepReplay"]


class StepReplay:
    """Replay chosen steps of a watched loop and the steps that alarm (module docstring).

    Args:
        watch: the loop's :class:`diagnostics.Watch`.
        steps: the steps always replayed.
        every: also replay every ``every`` steps (0: none).
        on_alarm: replay a step whose loss alarms (and the step after a fail).
        options: :class:`diagnostics.ReplayOptions`.
        model: the model ``fn`` calls, when it is a ``torch.compile`` wrapper (the watch holds the
            module inside; replay runs a compiled model eagerly in both executions).
    """

    def __init__(self, watch, steps: Iterable[int] = (), every: int = 0, on_alarm: bool = True,
                 options: ReplayOptions | None = None, model: torch.nn.Module | None = None):
        validate.integer("every", every, low=0, fix="every=N (0: chosen steps only)", error=OptionsError)
        validate.boolean("on_alarm", on_alarm, error=OptionsError)
        self.watch, self.every, self.on_alarm = watch, int(every), bool(on_alarm)
        self.steps = {validate.integer("steps", s, low=0, fix="steps=[t, ...]", error=OptionsError) for s in steps}
        self.options = options or ReplayOptions()
        self.model = model if model is not None else watch.model
        #: every replay, by step: a ReplayResult (a dict {"replayed": False, "why": ...} where it could not run)
        self.results: dict[int, Any] = {}
        self._seen = (0, 0)  # (events, failure known) at the last step

    def chosen(self, t: int) -> bool:
        return t in self.steps or (self.every > 0 and t % self.every == 0)

    def _armed(self) -> bool:
        """Whether the watch raised an alarm or a fail at a record since the last step, at a step
        that was not replayed already."""
        events, failure = self.watch.events, self.watch.failure
        seen = (len(events), failure is not None)
        new = events[self._seen[0]:] if seen[0] > self._seen[0] else []
        steps = {e.step for e in new} | ({failure.step} if seen[1] and not self._seen[1] else set())
        self._seen = seen
        return self.on_alarm and any(s not in self.results for s in steps)

    def run(self, t: int, fn: Callable[[], Any]) -> Any:
        """Step t's forward and backward (``fn``), replayed where chosen or alarming; returns its loss."""
        armed = self._armed()
        if self.chosen(t) or armed:
            result = replay(self.model, fn, self.options)
            self._keep(t, result, "chosen" if self.chosen(t) else "after an alarm")
            return result.loss
        if not self.on_alarm or self.watch.group is not None:
            return fn()
        params = list(self.watch.model.parameters())
        if any(p.grad is not None for p in params):  # an accumulating step: no bare alarm replay
            return fn()
        buffers = [(b, b._version) for b in self.watch.model.buffers()]
        rng = rng_state() if self.options.rng else None
        loss = fn()
        kind = self._would_alarm(loss)
        if kind is not None:
            if any(b._version != v for b, v in buffers):
                self.results[t] = {"replayed": False, "why": "the step wrote buffers; replay needs them as before"}
                self._note(t, self.results[t])
            else:
                self._replay_after(t, fn, loss, params, rng, kind)
        return loss

    def _would_alarm(self, loss: Any) -> str | None:
        """The watch's alarm for ``loss`` (Watch.alarm's rule), its running loss left unchanged."""
        w = self.watch
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if not math.isfinite(value):
            return "nonfinite"
        ready = w.enabled and w._ema is not None and w._n >= w.thresholds.spike_warmup
        return "spike" if ready and w._armed and value > w.spike_factor * w._ema else None

    def _replay_after(self, t: int, fn, loss, params, rng, kind: str) -> None:
        """Replay a step already run bare (module docstring), then put its own state back."""
        real = [p.grad for p in params]
        after = rng_state() if rng is not None else None
        try:
            for p in params:
                p.grad = None
            if rng is not None:
                set_rng_state(rng)
            result = replay(self.model, fn, self.options)
            rerun = [p.grad for p in params]
        finally:
            for p, g in zip(params, real):
                p.grad = g
            if after is not None:
                set_rng_state(after)
        names = [n for n, _ in self.watch.model.named_parameters()]
        differs = [n for n, a, b in zip(names, real, rerun) if not _same(a, b)]
        same_loss = _same(loss, result.loss)
        original = {"reproduced": same_loss and not differs, "loss": _f(loss), "rerun_loss": result.losses[0],
                    "first_gradient_that_differs": differs[0] if differs else None, "gradients_differing": len(differs)}
        self._keep(t, result, f"at a {kind} alarm", original)

    def _keep(self, t: int, result: ReplayResult, why: str, original: dict | None = None) -> None:
        self.results[t] = result
        entry = {"replayed": True, "why": why, **result.to_dict()}
        entry.pop("rows", None)  # the report keeps the answer; result.to_frame() has the rows
        if original is not None:
            entry["original"] = original
        self._note(t, entry)

    def _note(self, t: int, entry: dict) -> None:
        """The replay of step t in the watch's forensics: its report of step t (made at the record,
        or already made, for a replay of the step after an alarm: added to the newest report)."""
        self.watch.book.replays[int(t)] = entry
        for report in self.watch.book.reports:
            if report["step"] == t - 1 and "replay_of_next_step" not in report:
                report["replay_of_next_step"] = entry


def _f(x: Any) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit (NaN where both have it); None only equals None."""
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, torch.Tensor):
        x, y = float(a), _f(b)
        return x == y or (math.isnan(x) and math.isnan(y))
    a, b = a.detach(), b.detach()
    return torch.equal(a, b) or (a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))
