"""The alerts of a history that stores none, replayed: a history JSON or a checkpoint keeps the
records, the loss series and the alarms (events), not the alerts the watch reported; this module
reports them again, record by record, as the watch did (:class:`~diagnostics.jobs.watch_alerts.AlertBook`
over the records so far and the steps logged before each; each spike or non-finite loss an alert
after the record of its step, its threshold the spike factor x the running loss of the steps
before it).
"""

from __future__ import annotations

import math
from typing import Any

from ..judge.over_time import Extremes, record_verdicts
from ..judge.precursors import Alert
from ..judge.thresholds import Thresholds
from .watch_alerts import AlertBook, WatchEvent

__all__ = ["replay_alerts"]


class _Loss:
    """The watch's running loss (:meth:`diagnostics.Watch.alarm`): its EMA over finite losses that
    raised no spike."""

    def __init__(self, th: Thresholds, enabled: bool):
        self.th, self.enabled = th, enabled
        self.ema: float | None = None
        self.n = 0
        self.armed = True

    def take(self, loss: float) -> None:
        if loss is None or not math.isfinite(loss):
            return
        if self.enabled and self.ema is not None and self.n >= self.th.spike_warmup:
            high = loss > self.th.spike_factor * self.ema
            spike = high and self.armed
            self.armed = not high
            if spike:
                return
        beta = self.th.spike_ema
        self.ema = loss if self.ema is None else beta * self.ema + (1 - beta) * loss
        self.n += 1


def replay_alerts(data: dict[str, Any], thresholds: Thresholds) -> list[Alert]:
    """The alerts the watch reported over ``data`` (a history dict), in the order it reported them."""
    header = {k: v for k, v in data.items() if k not in ("series", "records", "events")}
    series = data["series"]
    h = {**header, "series": {k: [] for k in series}, "records": [], "events": []}
    book = AlertBook(h, thresholds, 8, int(data.get("watch_every") or 1))
    loss = _Loss(thresholds, bool(data.get("watch_every")))
    earlier = Extremes()
    todo = sorted([(r["step"], 0, k) for k, r in enumerate(data["records"])]
                  + [(e["step"], 1, k) for k, e in enumerate(data["events"]) if isinstance(e.get("step"), int)])
    logged = 0
    for step, kind, k in todo:
        while logged < len(series["step"]) and series["step"][logged] < step:  # the steps logged before it
            for key in series:
                h["series"][key].append(series[key][logged])
            loss.take(series["loss"][logged])
            logged += 1
        if kind == 0:
            rec = data["records"][k]
            h["records"].append(rec)
            rows = record_verdicts(rec, earlier, data.get("norm"), thresholds, data.get("kinds"))
            earlier.update(rec)
            book.judge(rec, rows, [])
        else:
            e = data["events"][k]
            event = WatchEvent(e["step"], e["kind"], e.get("site"), e.get("stat"), e.get("moved_at"), e["message"])
            h["events"].append(e)
            at = series["step"].index(step) if step in series["step"] else None
            value = series["loss"][at] if at is not None else math.nan
            book.emit(book.event_alert(event, value, thresholds.spike_factor * (loss.ema or math.nan)), [])
    return list(book.alerts)
