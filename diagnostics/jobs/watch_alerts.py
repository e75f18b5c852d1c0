"""What the watch reports: its events, failures and alerts, the report :meth:`Watch.record`
returns, and the book that keeps a run's alerts and forensics.

:class:`AlertBook` turns each new record into alerts (:mod:`diagnostics.judge.precursors`):
every verdict over time that was ok at the record before (a fail or a vanishing gradient,
with its cause told apart), and every precursor first due at it; a spike or a non-finite loss
is an alert too, whose cause is the first precursor reported before it. The alerts of one
record are :func:`grouped` by signal and severity (one alert naming every site). Each alert goes to
the run's list, to the loop's next :class:`WatchReport` and to the writers that take alerts;
a spike or a fail also makes a forensics report: the last ``forensics`` records and the steps
logged over the same span, kept in a ring buffer (``forensics`` x ``every`` steps).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from ..judge.baseline import Window
from ..judge.precursors import LOOKBACK, Alert, precursor_alerts, signal_values, verdict_alert
from ..judge.thresholds import Thresholds

__all__ = ["WatchEvent", "WatchFailure", "WatchReport", "WatchStop", "AlertBook", "failure_of", "grouped"]


@dataclass
class WatchEvent:
    """A spike or a non-finite loss, with the site whose statistics moved first."""

    step: int
    kind: str  # "spike" or "nonfinite"
    site: str | None
    stat: str | None  # "fwd_var" or "grad_var"
    moved_at: int | None  # the step at which that statistic had first moved
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "site": self.site, "stat": self.stat,
                "moved_at": self.moved_at, "message": self.message}


@dataclass
class WatchFailure:
    """The first ``fail`` the watch saw: at ``step``, ``site`` (None for the loss) gave
    ``verdict`` with ``stat`` = ``value`` against ``threshold``; ``message`` says it in a line."""

    step: int
    verdict: str  # one of FAIL_VERDICTS
    site: str | None
    stat: str | None
    value: float
    threshold: float
    message: str


@dataclass
class WatchReport:
    """What :meth:`Watch.record` tells the loop about its step: ``alerts``, every warning and fail
    first reported at this step (:class:`diagnostics.judge.precursors.Alert`: the signal, the value
    against its threshold, the cause and the fix), and ``failure``, the first fail as a
    :class:`WatchFailure` (None if none).

    ``bool(report)`` is True when there is a failure, so ``if watch.record(...): break`` stops at
    a fail and goes on through warnings; iterate over it for the alerts themselves.
    """

    alerts: list[Alert] = field(default_factory=list)
    failure: WatchFailure | None = None

    def __bool__(self) -> bool:
        return self.failure is not None

    def __iter__(self) -> Iterator[Alert]:
        return iter(self.alerts)

    def __len__(self) -> int:
        return len(self.alerts)

    @property
    def warnings(self) -> list[Alert]:
        return [a for a in self.alerts if a.severity == "warn"]


class WatchStop(RuntimeError):
    """Raised by :meth:`Watch.record` at the first fail when the watch was built with
    ``stop="raise"``; ``failure`` holds the :class:`WatchFailure`."""

    def __init__(self, failure: WatchFailure):
        self.failure = failure
        super().__init__(failure.message)


def failure_of(row: dict[str, Any]) -> WatchFailure:
    """The :class:`WatchFailure` of a fail verdict row ({step, site, verdict, stat, value, threshold})."""
    what = {"non_finite": "is not finite", "exploding": "grew past its threshold"}[row["verdict"]]
    return WatchFailure(row["step"], row["verdict"], row["site"], row["stat"], row["value"], row["threshold"],
                        f"step {row['step']}: {row['site']} {row['verdict']}: {row['stat']} = "
                        f"{row['value']:.3g} {what} (threshold {row['threshold']:.3g})")


def grouped(alerts: list[Alert]) -> list[Alert]:
    """One alert per (signal, severity) of a record: the first of each group (its most upstream
    site, in the order the alerts came) stands for it, its message naming how many sites and which
    (the first five); the others are folded in. Order: each group where its first alert was."""
    groups: dict[tuple[str, str], list[Alert]] = {}
    for a in alerts:
        groups.setdefault((a.signal, a.severity), []).append(a)
    out = []
    for members in groups.values():
        head = members[0]
        if len(members) > 1:
            names = [m.site or "model" for m in members]
            more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
            head = replace(head, message=f"{head.message} [at {len(names)} sites: {', '.join(names[:5])}{more}]")
        out.append(head)
    return out


class AlertBook:
    """A run's alerts and forensics (module docstring).

    Args:
        history: the watch's history dict (read, never written).
        thresholds: the thresholds the alerts are judged by.
        forensics: records kept for a report (at least 1).
        every: the watch's interval (the ring buffer keeps ``forensics x every`` steps).
    """

    def __init__(self, history: dict[str, Any], thresholds: Thresholds, forensics: int, every: int):
        self.history, self.thresholds, self.forensics_records = history, thresholds, forensics
        self.alerts: list[Alert] = []
        self._new: list[Alert] = []
        self._values = [signal_values(history, k) for k in range(len(history["records"]))]
        self._window = Window.of(self._values, LOOKBACK)  # each series kept as the records come
        self._open: set[tuple[str, str]] = set()  # (site, verdict) not ok at the last record
        #: the last ten forensics reports
        self.reports: deque[dict[str, Any]] = deque(maxlen=10)
        #: step -> what replaying it found (diagnostics.jobs.watch_replay), joined to that step's report
        self.replays: dict[int, dict[str, Any]] = {}
        #: (step, loss, lr, grad_norm) of the last logged steps
        self.ring: deque[tuple[int, float, float, float]] = deque(maxlen=forensics * max(every, 1))

    def take_new(self) -> list[Alert]:
        """The alerts reported since the last call."""
        new, self._new = self._new, []
        return new

    def judge(self, rec: dict[str, Any], rows: list[dict[str, Any]], writers: list) -> list[WatchFailure]:
        """Report the alerts of ``rec``, the history's newest record, whose non-ok verdict rows are
        ``rows``; returns the failures of the precursors past their fail level."""
        judged = [r for r in rows if r["verdict"] in ("non_finite", "exploding", "vanishing")]
        alerts = [a for r in judged if (r["site"], r["verdict"]) not in self._open
                  for a in [verdict_alert(self.history, rec, r, self.thresholds)] if a is not None]
        self._open = {(r["site"], r["verdict"]) for r in judged}
        self._values.append(signal_values(self.history, len(self.history["records"]) - 1))
        self._window.add(self._values[-1])
        found = precursor_alerts(self.history, len(self._values) - 1, self.thresholds, self._values, self._window)
        for a in grouped(alerts + found):
            self.emit(a, writers)
        return [WatchFailure(a.step, a.signal, a.site, a.signal, a.value, a.threshold, a.message)
                for a in found if a.severity == "fail"]

    def emit(self, alert: Alert, writers: list) -> None:
        """Report an alert: to the run's list, the loop's next report and the writers that take
        alerts; a fail also makes a forensics report (one per step)."""
        self.alerts.append(alert)
        self._new.append(alert)
        for w in writers:
            if hasattr(w, "alert"):
                w.alert(alert)
        if alert.severity == "fail" and not any(r["step"] == alert.step for r in self.reports):
            self.forensics(alert, writers)

    def report(self, trigger: Alert | WatchEvent) -> dict[str, Any]:
        """What moved before ``trigger``: its step and message, the last ``forensics`` records
        (each site's statistics, attention, logits, update ratios) and the logged steps of the
        same span (loss, lr, grad_norm), oldest first."""
        steps = [{"step": t, "loss": loss, "lr": lr, "grad_norm": g} for t, loss, lr, g in self.ring]
        replay = {"replay": self.replays[int(trigger.step)]} if int(trigger.step) in self.replays else {}
        return {"step": int(trigger.step), "trigger": trigger.to_dict(), **replay,
                "records": list(self.history["records"][-self.forensics_records:]), "steps": steps}

    def forensics(self, trigger: Alert | WatchEvent, writers: list) -> None:
        """Make, keep and write (to the writers that take them) the report of ``trigger``."""
        report = self.report(trigger)
        self.reports.append(report)
        for w in writers:
            if hasattr(w, "forensics"):
                w.forensics(report)

    def event_alert(self, event: WatchEvent, loss: float, spike_limit: float) -> Alert:
        """A spike (warn, its threshold ``spike_limit``) or a non-finite loss (fail) as an
        :class:`Alert`, whose cause is the first precursor reported before it."""
        earlier = [a for a in self.alerts if a.signal not in ("spike", "non_finite")]
        if earlier:
            first = earlier[0]
            cause, fix = f"preceded by {first.signal} at step {first.step} ({first.cause})", first.fix
        else:
            cause, fix = "no precursor was reported before it", "lower the learning rate, clip the gradient norm"
        spike = event.kind == "spike"
        return Alert(event.step, "warn" if spike else "fail", "spike" if spike else "non_finite", event.site,
                     float(loss), spike_limit if spike else math.nan, 0, event.step, cause, fix, "",
                     f"{event.message}; {cause}; fix: {fix}")
