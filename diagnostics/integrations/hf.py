"""The watch in a Hugging Face ``transformers.Trainer``: :class:`WatchCallback`.

    from diagnostics.integrations.hf import WatchCallback
    cb = WatchCallback(every=50, log_dir="runs/x")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    cb.watch.history                                  # the watch history (cb.watch draws in a notebook)

Needs the ``hf`` extra (``pip install "tinylm[hf]"``); this module is the only one that
imports ``transformers``. Step t is the Trainer's optimizer step (``state.global_step``
before it, from 0). Per step the watch keeps:

* loss: the step's loss as the Trainer computes it, from the model output's ``loss`` on each
  micro-batch (a forward hook on the model, in training mode only): summed when the Trainer
  normalised it by the step's token count (``num_items_in_batch``), else averaged; NaN where
  the output carries no loss (a custom ``compute_loss``);
* lr: the optimizer's first group's rate at the optimizer step;
* grad_norm: the Trainer's own (pre-clipping) norm on its logging steps (``logging_steps``),
  NaN between them.

On a recorded step (every ``every`` optimizer steps, and the step after a spike) the probe
runs over all of the step's micro-batches (forward and backward), the parameters are
copied before the optimizer step and the update ratios taken after it. ``stop="signal"``
sets ``control.should_training_stop`` at the first fail (the Trainer ends the run
cleanly); ``stop="raise"`` raises :class:`diagnostics.jobs.watch.WatchStop`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('the Hugging Face callback needs transformers: pip install "tinylm[hf]" '
                      "(or pip install transformers)") from e

from ..jobs.watch import Watch, WatchFailure, WatchStop

__all__ = ["WatchCallback"]


class WatchCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs a :class:`diagnostics.Watch` (see the module
    docstring). Keyword arguments other than ``stop`` go to ``Watch`` (``every``, ``log_dir``,
    ``writers``, ``sites``, ``thresholds``, ``spike_factor``). ``watch`` is None until training
    begins; ``failure`` holds the first fail seen (None while all is well)."""

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
        self._stack: contextlib.ExitStack | None = None
        self._hook = None
        self._losses: list[Any] = []
        self._lr = math.nan
        self._recording = False
        self._before: dict[str, Any] = {}
        self._pending_log: list[Any] | None = None

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.watch is None:
            self.watch = Watch(model, every=self.every, stop="raise" if self.stop == "raise" else None,
                               **self.watch_kwargs)
        self._hook = model.register_forward_hook(self._keep_loss, with_kwargs=True)
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
        self._flush_log()
        w = self.watch
        self._losses = []
        self._recording = w._starts(state.global_step)
        if self._recording:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(w.capture())
        return control

    def _close_capture(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._close_capture()  # the step's forward and backward passes are done
        self._lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else math.nan
        self._before = self.watch.snapshot_params() if self._recording else {}
        return control

    def on_step_end(self, args, state, control, **kwargs):
        w = self.watch
        self._close_capture()
        t = state.global_step - 1
        loss = self._step_loss()
        self._losses = []
        w._end_step(t, loss, self._lr, math.nan, self._recording, self._before)
        self._before = {}
        self._pending_log = [t, math.nan if loss is None else loss, self._lr, math.nan]
        try:
            found = w._check_stop()  # raises WatchStop under stop="raise"
        except WatchStop:
            self.close()  # the Trainer will not reach on_train_end
            raise
        if found is not None:
            self.failure = self.failure or found
            if self.stop == "signal":
                control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The step just ended enters the series, with the Trainer's grad_norm when it logged one."""
        if self._pending_log is not None and self._pending_log[0] == state.global_step - 1 and logs \
                and "grad_norm" in logs:
            self._pending_log[3] = float(logs["grad_norm"])
            self._flush_log()
        return control

    def _flush_log(self) -> None:
        if self._pending_log is not None and self.watch is not None:
            pending, self._pending_log = self._pending_log, None
            self.watch.log(*pending)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    def close(self) -> None:
        """Remove the hooks and close the watch's writers (the Trainer's end does this)."""
        self._close_capture()
        self._flush_log()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.watch is not None:
            self.watch.close()

    def _repr_html_(self) -> str | None:
        return "" if self.watch is None else self.watch._repr_html_()
