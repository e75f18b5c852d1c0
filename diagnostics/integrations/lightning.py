"""The watch in a Lightning run: :class:`WatchCallback`, a ``lightning.pytorch.Callback``.

    from diagnostics.integrations.lightning import WatchCallback
    cb = WatchCallback(every=50, log_dir="runs/x")
    lightning.pytorch.Trainer(callbacks=[cb], ...).fit(module, data)
    cb.watch.history                                  # the watch history (cb.watch draws in a notebook)

Needs the ``lightning`` extra (``pip install "tinylm[lightning]"``); this module is the only
one that imports ``lightning``. The watch runs on the LightningModule (its sites are found
in the module's own structure, :func:`diagnostics.jobs.watch.find_sites`, named from the
LightningModule: ``model.layers.0`` for a model kept as ``self.model``).

Step t is the optimizer step taken when ``trainer.global_step`` is t (0, 1, ...: the step of
what ``training_step`` logs in it); the watch records step t when t is a multiple of
``every`` (and the step after an alarm). Per step the watch keeps:

* loss: the loss ``training_step`` returned (its ``"loss"`` entry for a dict), averaged over
  the step's micro-batches (``accumulate_grad_batches``), as Lightning averages them for the
  backward pass;
* lr: the optimizer's first group's rate at the optimizer step;
* grad_norm: on a recorded step, the 2-norm of all the LightningModule's parameter gradients
  before the optimizer step and before Lightning clips them (``gradient_clip_val``); NaN on
  the others (the watch computes no norm between records).

A recorded step runs the probe from the first micro-batch's ``on_train_batch_start`` to
``on_before_optimizer_step`` and pools the micro-batches' moments: a watched tensor's
statistics are those of the optimizer step's whole batch, and its gradient statistics those
of the gradient of the step's loss (each micro-batch's loss divided by
``accumulate_grad_batches``: 1/A of the gradient the same micro-batch alone would give,
variance 1/A^2; an accumulated step reads as one step of the whole batch). The parameters
are copied before the optimizer step and the update ratios taken after it; the trainer's
optimizer (when it has exactly one) gives each record its "optimizer" figures
(:mod:`diagnostics.measure.optimizer`).

With ``log_to_logger`` (the default) each record's scalars go to the trainer's loggers
(``logger.log_metrics(..., step=t)``, the names of the TensorBoard writer:
``watch/gradient_var/<site>``...); the watch's own writers (``log_dir``, ``writers``) write
as in any loop. ``stop="signal"`` sets ``trainer.should_stop`` at the first fail (the run
ends after that step); ``stop="raise"`` raises :class:`diagnostics.jobs.watch.WatchStop`.
Written for automatic optimization (one optimizer).
"""

from __future__ import annotations

import math
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('the Lightning callback needs lightning: pip install "tinylm[lightning]" '
                      "(or pip install lightning)") from e

import torch

from ..jobs.watch import Watch, WatchFailure, WatchStop
from ..measure.optimizer import usable_optimizer
from ._steps import Steps, record_scalars
from .writers import WatchWriter

__all__ = ["WatchCallback", "LoggerWriter"]


class LoggerWriter(WatchWriter):
    """Each record's scalars (:func:`diagnostics.integrations._steps.record_scalars`) to a
    Lightning trainer's loggers, at the record's step."""

    def __init__(self, loggers: list[Any]):
        self.loggers = list(loggers)

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        scalars = record_scalars(record, verdicts)
        for logger in self.loggers:
            logger.log_metrics(scalars, step=int(record["step"]))


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) else None


@torch.no_grad()
def _grad_norm(module: torch.nn.Module) -> float:
    norms = [torch.linalg.vector_norm(p.grad.detach().double()) for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else math.nan


class WatchCallback(Callback):
    """A ``lightning.pytorch.Callback`` that runs a :class:`diagnostics.Watch` over the
    LightningModule's training steps (see the module docstring for the step numbering and
    what an accumulated step measures).

    Args:
        every: record every ``every`` optimizer steps (steps t with t % every == 0).
        stop: None (go on), "signal" (``trainer.should_stop`` after the first fail) or "raise"
            (raise :class:`~diagnostics.jobs.watch.WatchStop`).
        log_to_logger: send each record's scalars to the trainer's loggers.
        **watch_kwargs: to :class:`~diagnostics.jobs.watch.Watch` (``log_dir``, ``writers``,
            ``sites``, ``thresholds``, ``spike_factor``; ``optimizer``: by default the trainer's one).

    ``watch`` is None until fitting starts; ``failure`` holds the first fail seen (None while
    all is well).
    """

    def __init__(self, every: int = 50, *, stop: str | None = None, log_to_logger: bool = True, **watch_kwargs: Any):
        from ..options import OptionsError

        if stop not in (None, "signal", "raise"):
            raise OptionsError(f"stop={stop!r}: must be None (go on), \"signal\" (stop the Lightning trainer) or "
                               "\"raise\" (raise WatchStop)")
        self.every = every
        self.stop = stop
        self.log_to_logger = log_to_logger
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.failure: WatchFailure | None = None
        self._steps: Steps | None = None
        self._t: int | None = None  # the step whose micro-batches are running
        self._losses: list[torch.Tensor] = []
        self._lr = math.nan
        self._grad_norm = math.nan
        self._stepped = False

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.watch is None:
            kwargs = dict(self.watch_kwargs)
            if self.log_to_logger and trainer.loggers:
                kwargs["writers"] = [*kwargs.get("writers", ()), LoggerWriter(trainer.loggers)]
            optimizers = list(getattr(trainer, "optimizers", None) or [])
            kwargs.setdefault("optimizer", usable_optimizer(optimizers[0], pl_module) if len(optimizers) == 1 else None)
            self.watch = Watch(pl_module, every=self.every, stop="raise" if self.stop == "raise" else None, **kwargs)
        self._steps = Steps(self.watch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        t = trainer.global_step
        if t != self._t:  # the step's first micro-batch
            self._signal(self._steps.finish(), trainer)
            self._t, self._losses, self._stepped = t, [], False
            self._lr = self._grad_norm = math.nan
            self._steps.begin(t)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._steps.before_optimizer()  # the step's forward and backward passes are done; not yet clipped
        self._lr = float(optimizer.param_groups[0]["lr"])
        self._grad_norm = _grad_norm(pl_module) if self._steps.recording else math.nan
        self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = _loss_of(outputs)  # divided by accumulate_grad_batches in automatic optimization
        if loss is not None:
            self._losses.append(loss)
        if not self._stepped:
            return
        step_loss = float(torch.stack(self._losses).double().sum()) if self._losses else None
        self._steps.end(self._t, step_loss, self._lr, wait=True)
        self._signal(self._steps.finish(self._grad_norm), trainer)
        self._losses, self._stepped = [], False

    def _signal(self, found: WatchFailure | None, trainer: Any) -> None:
        if found is not None:
            self.failure = self.failure or found
            if self.stop == "signal":
                trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, WatchStop):
            self.failure = self.failure or exception.failure
        self.close()

    def close(self) -> None:
        """The probe off, a waiting step finished and the watch's writers closed (the end of
        fitting does this)."""
        if self._steps is not None:
            steps, self._steps = self._steps, None
            try:
                found = steps.finish()
                self.failure = self.failure or found
            finally:
                steps.close()

    def _repr_html_(self) -> str | None:
        return "" if self.watch is None else self.watch._repr_html_()
