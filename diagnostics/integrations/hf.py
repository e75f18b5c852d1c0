"""The watch in a Hugging Face ``transformers.Trainer``: :class:`WatchCallback`.

    from diagnostics.integrations.hf import WatchCallback
    cb = WatchCallback(every=50, log_dir="runs/x")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    cb.watch.history                                  # the watch history (cb.watch draws in a notebook)

Needs the ``hf`` extra (``pip install "tinylm[hf]"``); this module is the only one that
imports ``transformers``.

Steps are numbered as the Trainer numbers them in its logs: step t is the optimizer step
after which ``state.global_step == t`` (1, 2, ...). The watch records step t when t is a
multiple of ``every`` (and the step after an alarm), so ``every`` a multiple of
``logging_steps`` puts every record on a step the Trainer logs. Per step the watch keeps:

* loss: the step's loss as the Trainer computes it, from the model output's ``loss`` on each
  micro-batch (a forward hook on the model, in training mode only): summed when the Trainer
  normalised it by the step's token count (``num_items_in_batch``), else averaged; NaN where
  the output carries no loss (a custom ``compute_loss``). The Trainer's logged ``loss`` is
  the mean of these over the steps since its previous log;
* lr: the optimizer's first group's rate at the optimizer step (the Trainer's ``learning_rate``);
* grad_norm: the Trainer's own pre-clipping norm of the accumulated gradients, at the steps
  it logs (``logging_steps``), NaN at the others; a record at a logged step carries it.

A recorded step runs the probe over all of its micro-batches, forward and backward, and
pools their moments: a watched tensor's statistics are those of the optimizer step's whole
batch (``gradient_accumulation_steps`` x ``per_device_train_batch_size`` sequences), and
its gradient statistics are those of the gradient of the step's loss, the loss the
optimizer step descends. With accumulation x A that loss averages over A times the tokens
of one micro-batch, so the gradient at each micro-batch's tensors is 1/A of what the same
micro-batch alone would give (variance 1/A^2): an accumulated step reads as one step of the
whole batch without accumulation (equal up to rounding), not as a step of one micro-batch.
A site whose output is shared across the batch (GPT-2's position embedding, shape
(1, T, D)) is the exception: its gradient is summed over each micro-batch's sequences, so
its statistics depend on the micro-batch size. The parameters are copied before the
optimizer step and the update ratios taken after it; the Trainer's optimizer (a torch
optimizer, through accelerate's wrapper) gives each record its "optimizer" figures
(:mod:`diagnostics.measure.optimizer`).

``stop="signal"`` sets ``control.should_training_stop`` at the first fail (the Trainer ends
the run cleanly after that step); ``stop="raise"`` raises
:class:`diagnostics.jobs.watch.WatchStop`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('the Hugging Face callback needs transformers: pip install "tinylm[hf]" '
                      "(or pip install transformers)") from e

from ..jobs.watch import Watch, WatchFailure, WatchStop
from ..measure.optimizer import usable_optimizer
from ._steps import Steps

__all__ = ["WatchCallback"]


class WatchCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs a :class:`diagnostics.Watch` (see the module
    docstring for the step numbering and what an accumulated step measures).

    Args:
        every: record every ``every`` optimizer steps (steps t with t % every == 0).
        stop: None (go on), "signal" (end the Trainer's run after the first fail) or "raise"
            (raise :class:`~diagnostics.jobs.watch.WatchStop`).
        **watch_kwargs: to :class:`~diagnostics.jobs.watch.Watch` (``log_dir``, ``writers``,
            ``sites``, ``thresholds``, ``spike_factor``; ``optimizer``: by default the Trainer's).

    ``watch`` is None until training begins; ``failure`` holds the first fail seen (None
    while all is well).
    """

    def __init__(self, every: int = 50, *, stop: str | None = None, **watch_kwargs: Any):
        from ..options import OptionsError

        if stop not in (None, "signal", "raise"):
            raise OptionsError(f"stop={stop!r}: must be None (go on), \"signal\" (end the Trainer's run) or "
                               "\"raise\" (raise WatchStop)")
        self.every = every
        self.stop = stop
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.failure: WatchFailure | None = None
        self._steps: Steps | None = None
        self._hook = None
        self._losses: list[Any] = []
        self._lr = math.nan

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.watch is None:
            watch_kwargs = {"optimizer": usable_optimizer(optimizer, model), **self.watch_kwargs}
            self.watch = Watch(model, every=self.every, stop="raise" if self.stop == "raise" else None,
                               **watch_kwargs)
        self._steps = Steps(self.watch)
        self._hook = model.register_forward_hook(self._keep_loss, with_kwargs=True)
        logging_steps = getattr(state, "logging_steps", None) or args.logging_steps
        if args.logging_strategy == "steps" and self.watch.every and isinstance(logging_steps, int) \
                and self.watch.every % logging_steps:
            warnings.warn(f"WatchCallback(every={self.watch.every}) with logging_steps={logging_steps}: records at "
                          "steps the Trainer does not log carry no grad_norm (NaN); make every a multiple of "
                          "logging_steps", stacklevel=2)
        return control

    def _keep_loss(self, module, args, kwargs, output) -> None:
        if not module.training:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None and hasattr(loss, "detach"):
            # a loss normalised by the whole step's token count (the Trainer passes num_items_in_batch)
            # is summed over the micro-batches; one normalised per micro-batch is averaged
            self._losses.append((loss.detach(), kwargs.get("num_items_in_batch") is not None))

    def _step_loss(self) -> float | None:
        """The step's loss as the Trainer computes it (None: the model's outputs carried none)."""
        import torch

        if not self._losses:
            return None
        total = torch.stack([x.double() for x, _ in self._losses])
        scaled = all(s for _, s in self._losses)
        return float(total.sum() if scaled else total.mean())

    def on_step_begin(self, args, state, control, **kwargs):
        self._losses = []
        with self._closed_on_stop():
            self._signal(self._steps.finish(), control)  # a logged step whose log never came
        self._steps.begin(state.global_step + 1)
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._steps.before_optimizer()  # the step's forward and backward passes are done
        self._lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else math.nan
        return control

    def on_step_end(self, args, state, control, **kwargs):
        loss = self._step_loss()
        self._losses = []
        # when the Trainer logs this step (DefaultFlowCallback ran first and set should_log), the
        # step waits for its grad_norm in on_log, which comes before the Trainer checks for a stop
        with self._closed_on_stop():
            self._signal(self._steps.end(state.global_step, loss, self._lr, wait=bool(control.should_log)), control)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The step just ended enters the watch, with the Trainer's grad_norm when it logged one."""
        if self._steps is not None and self._steps.waiting == state.global_step:
            grad_norm = (logs or {}).get("grad_norm")
            with self._closed_on_stop():
                self._signal(self._steps.finish(math.nan if grad_norm is None else float(grad_norm)), control)
        return control

    @contextlib.contextmanager
    def _closed_on_stop(self) -> Iterator[None]:
        """Under stop="raise": the hook removed and the writers closed before WatchStop leaves
        (the Trainer will not reach on_train_end)."""
        try:
            yield
        except WatchStop as stop:
            self.failure = self.failure or stop.failure
            self.close()
            raise

    def _signal(self, found: WatchFailure | None, control: Any) -> None:
        if found is not None:
            self.failure = self.failure or found
            if self.stop == "signal":
                control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    def close(self) -> None:
        """Remove the hooks, finish a step left waiting and close the watch's writers (the
        Trainer's end does this)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._steps is not None:
            try:
                found = self._steps.finish()
                self.failure = self.failure or found
            finally:
                self._steps.close()
        elif self.watch is not None:
            self.watch.close()

    def _repr_html_(self) -> str | None:
        return "" if self.watch is None else self.watch._repr_html_()
