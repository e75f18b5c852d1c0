"""The watch's steps, records and alarms in a Weights & Biases run: :class:`WandbWriter`.

    from diagnostics.integrations.wandb import WandbWriter
    watch = Watch(model, every=50, writers=[WandbWriter()])   # the current wandb run, or one it opens

Needs the ``wandb`` extra (``pip install "tinylm[wandb]"``); this module is the only one that
imports ``wandb``. The writer logs one row per watch step, with ``watch/step`` (the watch's
step number) as the x-axis of every key it writes (``run.define_metric``), so its rows sit
beside whatever else the run logs without taking its step counter:

* every step: ``watch/loss``, and ``watch/lr`` and ``watch/grad_norm`` when known;
* every record: ``watch/activation_var/<site>``, ``watch/gradient_var/<site>``,
  ``watch/max_abs/<site>``, ``watch/update_ratio/<parameter>``,
  ``watch/attention_entropy/<site>``, ``watch/not_ok`` (how many sites are not ok: the same
  scalars as the TensorBoard writer's), and ``watch/verdicts``, a text of each verdict other
  than ok ("site: verdict (stat = value, threshold t)"), when there is one;
* every alarm (a spike or a non-finite loss): ``watch/alarm``, the event's message;
* every alert (a warning or fail with its cause and fix): ``watch/alert``, and a W&B alert
  (``run.alert``, level WARN or ERROR), which W&B sends by e-mail or Slack as the user set it up.

The run's summary keeps ``watch/first_fail``: the message of the first verdict of the
watch's fail kinds (:data:`diagnostics.judge.over_time.FAIL_VERDICTS`) or non-finite loss.
"""

from __future__ import annotations

import math
from typing import Any

try:
    import wandb
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('the W&B writer needs wandb: pip install "tinylm[wandb]" (or pip install wandb)') from e

from ..judge.over_time import FAIL_VERDICTS
from ._steps import record_scalars
from .writers import WatchWriter

__all__ = ["WandbWriter"]


def _verdict_text(verdicts: list[dict[str, Any]]) -> str:
    return "\n".join(f"{v['site']}: {v['verdict']} ({v['stat']} = {v['value']:.3g}, threshold {v['threshold']:.3g})"
                     for v in verdicts)


class WandbWriter(WatchWriter):
    """A :class:`~diagnostics.integrations.writers.WatchWriter` that logs to a wandb run (see the
    module docstring for the keys).

    Args:
        run: the run to log to; None: the current run (``wandb.run``) when the watch opens the
            writer, or, with none current, one opened then by ``wandb.init(**init)`` and
            finished at ``close``.
        **init: keyword arguments of ``wandb.init`` for a run the writer opens (``project``,
            ``name``, ``dir``, ``settings``...).
    """

    def __init__(self, run: Any = None, **init: Any):
        self.run = run
        self.init = init
        self.owns_run = False
        self._row: dict[str, Any] = {}
        self._failed = False

    def open(self, watch: Any) -> None:
        if self.run is None:
            self.run = wandb.run
        if self.run is None:
            self.run = wandb.init(**self.init)
            self.owns_run = True
        self.run.define_metric("watch/step", hidden=True)
        self.run.define_metric("watch/*", step_metric="watch/step")

    def _add(self, t: int, values: dict[str, Any]) -> None:
        if self._row and self._row["watch/step"] != t:
            self._flush()
        self._row.setdefault("watch/step", int(t))
        self._row.update(values)

    def _flush(self) -> None:
        if self._row and self.run is not None:
            row, self._row = self._row, {}
            self.run.log(row)

    def _first_fail(self, message: str) -> None:
        if not self._failed:
            self._failed = True
            self.run.summary["watch/first_fail"] = message

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        """The step's scalars; the step's row (with its record and alarm, which come first) is logged."""
        values = {"watch/loss": float(loss)}
        for name, v in (("watch/lr", lr), ("watch/grad_norm", grad_norm)):
            if not math.isnan(v):
                values[name] = float(v)
        self._add(t, values)
        self._flush()

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        values: dict[str, Any] = record_scalars(record, verdicts)
        if verdicts:
            values["watch/verdicts"] = _verdict_text(verdicts)
            fails = [v for v in verdicts if v["verdict"] in FAIL_VERDICTS]
            if fails:
                self._first_fail(f"step {record['step']}: {_verdict_text(fails[:1])}")
        self._add(record["step"], values)

    def event(self, event: Any) -> None:
        self._add(event.step, {"watch/alarm": event.message})
        if event.kind == "nonfinite":
            self._first_fail(event.message)

    def alert(self, alert: Any) -> None:
        """A warning or fail of the watch: its message in the step's row (``watch/alert``), and a
        W&B alert (``run.alert``: e-mail or Slack, as the user's W&B settings say) at its severity."""
        self._add(alert.step, {"watch/alert": f"{alert.severity}: {alert.message}"})
        if alert.severity == "fail" and alert.signal not in (*FAIL_VERDICTS, "non_finite"):
            self._first_fail(alert.message)  # a precursor past its fail level (the verdicts' own come with their record)
        notify = getattr(self.run, "alert", None)
        if callable(notify):
            level = getattr(getattr(wandb, "AlertLevel", None), "ERROR" if alert.severity == "fail" else "WARN", None)
            title = f"tinylm watch: {alert.signal} at step {alert.step}"
            notify(title=title, text=alert.message[:1000], **({"level": level} if level is not None else {}))

    def close(self) -> None:
        """Log what is pending; finish the run when this writer opened it."""
        self._flush()
        if self.owns_run and self.run is not None:
            self.run.finish()
            self.run = None
            self.owns_run = False
