"""What the trainer callbacks share (:mod:`.hf`, :mod:`.lightning`): one optimizer step of a
framework's loop driven through a :class:`diagnostics.Watch`, and the scalars of a record as
the metric writers name them (:mod:`.wandb`, a Lightning logger).

A step, as the callbacks drive it::

    steps.begin(t)            # before the step's first micro-batch: the probe on when t is due
    steps.before_optimizer()  # the micro-batches' forward and backward are done: probe off, parameters copied
    steps.end(t, loss, lr)    # after the optimizer step: kept until finish() when the framework logs later
    steps.finish(grad_norm)   # the record, the alarms, the series entry and the writers; returns a fail
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

from ..jobs.watch import Watch, WatchFailure, WatchStop

__all__ = ["Steps", "record_scalars", "step_scalars"]

#: where a framework callback's alerts go (each warning or fail of the watch, with its cause and fix)
_LOG = logging.getLogger("diagnostics.watch")


def step_scalars(loss: float, lr: float, grad_norm: float) -> dict[str, float]:
    """The scalars of a logged step: ``train/loss`` always, ``train/lr`` and ``train/grad_norm`` when known."""
    out = {"train/loss": float(loss)}
    for name, v in (("train/lr", lr), ("train/grad_norm", grad_norm)):
        if not math.isnan(v):
            out[name] = float(v)
    return out


def record_scalars(record: dict[str, Any], verdicts: list[dict[str, Any]]) -> dict[str, float]:
    """The scalars of a record, named as the TensorBoard writer names them:
    ``watch/activation_var/<site>``, ``watch/gradient_var/<site>``, ``watch/max_abs/<site>``,
    ``watch/update_ratio/<parameter>``, ``watch/attention_entropy/<site>`` and ``watch/not_ok``
    (how many of the record's verdicts are not ok)."""
    out: dict[str, float] = {}
    for site, st in record["stats"].items():
        out[f"watch/activation_var/{site}"] = st["fwd_var"]
        out[f"watch/gradient_var/{site}"] = st["grad_var"]
        out[f"watch/max_abs/{site}"] = st["fwd_absmax"]
    for name, r in (record.get("update_ratio") or {}).items():
        out[f"watch/update_ratio/{name}"] = r
    for site, a in (record.get("attention") or {}).items():
        out[f"watch/attention_entropy/{site}"] = a["entropy_mean"]
    out["watch/not_ok"] = float(len(verdicts))
    from ..jobs.watch_precision import precision_scalars  # Watch(precision=...): per-GEMM SQNR
    return {**out, **precision_scalars(record)}


class Steps:
    """Drives ``watch`` one optimizer step at a time (see the module docstring).

    A step t runs the probe from :meth:`begin` to :meth:`before_optimizer` when the watch
    records it (due, or the step after an alarm); :meth:`end` ends it with its loss and
    learning rate and, unless ``wait`` is set, :meth:`finish` at once with no grad_norm.
    A step kept waiting is finished by the next :meth:`begin` or by :meth:`close`.
    """

    def __init__(self, watch: Watch):
        self.watch = watch
        self.recording = False
        self._capture: contextlib.ExitStack | None = None
        self._before: dict[str, Any] = {}
        self._ended: tuple[int, float | None, float, bool, dict[str, Any]] | None = None

    @property
    def waiting(self) -> int | None:
        """The step ended and not yet finished (None if none)."""
        return None if self._ended is None else self._ended[0]

    def begin(self, t: int) -> bool:
        """Step t starts: finish a step still waiting, and turn the probe on when t is recorded."""
        self.finish()
        self.close_capture()
        self.recording = self.watch._starts(int(t))
        if self.recording:
            self._capture = contextlib.ExitStack()
            self._capture.enter_context(self.watch.capture())
        return self.recording

    def close_capture(self) -> None:
        if self._capture is not None:
            stack, self._capture = self._capture, None
            stack.close()

    def before_optimizer(self) -> None:
        """The step's forward and backward passes are done: the probe off, the parameters copied."""
        self.close_capture()
        self._before = self.watch.snapshot_params() if self.recording else {}

    def end(self, t: int, loss: float | None, lr: float, wait: bool = False) -> WatchFailure | None:
        """Step t's optimizer step is done (``loss`` None: unknown, kept as NaN). ``wait``: keep it
        for :meth:`finish` (the framework logs its grad_norm later); else finish it now."""
        self.close_capture()
        self._ended = (int(t), loss, lr, self.recording, self._before)
        self._before = {}
        self.recording = False
        return None if wait else self.finish()

    def finish(self, grad_norm: float = math.nan) -> WatchFailure | None:
        """The waiting step's record (when recorded), alarms, series entry and writers; returns
        the first fail found (None if none). Under the watch's ``stop="raise"`` raises
        :class:`WatchStop` after :meth:`close`."""
        if self._ended is None:
            return None
        (t, loss, lr, recording, before), self._ended = self._ended, None
        w = self.watch
        w._end_step(t, loss, lr, grad_norm, recording, before)
        w.log(t, math.nan if loss is None else loss, lr, grad_norm)
        for alert in w.book.take_new():  # a framework's loop has no record() to return them: its log has them
            _LOG.log(logging.ERROR if alert.severity == "fail" else logging.WARNING, "%s", alert.message)
        try:
            return w._check_stop()
        except WatchStop:
            self.close_capture()  # the framework will not reach its own end
            w.close()
            raise

    def close(self) -> None:
        """The probe off, a waiting step finished, the watch's writers closed."""
        self.close_capture()
        try:
            self.finish()
        finally:
            self.watch.close()
