"""Runs side by side: where two watched runs part ways, and what each one's watch said.

``History.compare(a, b)`` (or :func:`compare_runs`) aligns two runs' records by step and finds
the first site and signal whose values differ beyond the runs' own noise
(:func:`diagnostics.judge.runs.parting`: the noise learnt from each run's early records, the
false-alarm probability of the whole comparison ``alpha``, 1e-6 by default), with each run's
outcome and the alerts it raised. The result answers first in ``str()``; ``to_frame()`` gives one
tidy row per signal that departed, ``to_json()`` all of it with a schema version.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tinylm import validate

from ..errors import OptionsError
from ..judge.runs import ALPHA, parting

__all__ = ["RunsComparison", "compare_runs", "SCHEMA_VERSION", "describe_departure", "label_of"]

SCHEMA_VERSION = 1
_WHAT = {"fwd_var": "activation variance", "grad_var": "gradient variance", "fwd_absmax": "largest |x|",
         "max_logit": "largest attention logit", "entropy_mean": "attention entropy", "loss": "loss"}


def describe_departure(d: dict[str, Any], labels: tuple[str, str] = ("a", "b")) -> str:
    """A departure in words: "<site>: its <signal> parts ways at step t (b/a = ...x beyond the early
    offset, z = ...)"."""
    where = d["site"] or "the model"
    size = ("finite in one run only" if not math.isfinite(d["z"])
            else f"{labels[0]} at {d['ratio']:.3g}x {labels[1]} beyond their early offset, z = {d['z']:.1f}")
    return f"{where}: its {_WHAT.get(d['signal'], d['signal'])} parts ways at step {d['step']} ({size})"


def label_of(source: str | None) -> str | None:
    """A run's short name from where it was read: its log dir's name (or the file's stem)."""
    if not source:
        return None
    from pathlib import Path

    p = Path(source)
    return p.parent.name if p.name == "watch.jsonl" and p.parent.name else p.stem


class RunsComparison:
    """Two runs side by side (module docstring): ``labels``, ``histories``, ``outcomes``,
    ``parting`` (the judge's dict), ``first`` (the first departure, or None)."""

    def __init__(self, a: Any, b: Any, labels: tuple[str, str], alpha: float):
        self.histories = (a, b)
        self.labels = labels
        self.alpha = alpha
        self.parting = parting(a.data, b.data, alpha)
        self.outcomes = (a.outcome(), b.outcome())

    @property
    def first(self) -> dict[str, Any] | None:
        return self.parting["first"]

    def __str__(self) -> str:
        p, (la, lb) = self.parting, self.labels
        lines = []
        for label, o in zip(self.labels, self.outcomes):
            at = f" at step {o['step']}" if o["step"] is not None else ""
            lines.append(f"{label}: {o['status']}{at} ({o['why']})")
        if p["why"]:
            lines.append(f"where they part ways: not judged ({p['why']})")
        elif p["first"] is None:
            lines.append(f"{la} and {lb} do not part ways beyond their own noise over {p['steps']} aligned records "
                         f"({p['compared']} signals; false-alarm probability {self.alpha:g})")
        if p["too_few"]:
            lines.append(f"not judged: {p['too_few']} signals with too few aligned records (at least 5) to learn "
                         "their noise")
        else:
            lines.append("first departure: " + describe_departure(p["first"], self.labels))
        for row in self.alert_departures():
            other = self.labels[1] if row["run"] == self.labels[0] else self.labels[0]
            whose = "the loss" if row["site"] is None else "its site"
            tail = (f"{whose} parted from {other} at step {row['departed_at']} ({_WHAT.get(row['departure_signal'])})"
                    if row["departed_at"] is not None else f"{whose} did not part from {other} beyond the noise"
                    if row["compared"] else "its site is not among those compared")
            lines.append(f"  {row['run']} step {row['step']}: {row['severity']} {row['signal']} at "
                         f"{row['site'] or 'the model'}: {tail}")
        return "\n".join(lines)

    def alert_departures(self) -> list[dict[str, Any]]:
        """Each run's alerts (the first of each signal and site), each with the step at which its site
        parted from the other run (``departed_at``, None if it did not; the loss for an alert on the
        model) and by which signal (``compared`` False: the site, a parameter, is not compared): which alerts mark what the runs do differently, and which both share."""
        first: dict[str, dict[str, Any]] = {}
        for d in self.parting["departures"]:
            first.setdefault(d["site"] or "", d)  # departures are in precedence order: the earliest first
        out, seen = [], set()
        for label, h in zip(self.labels, self.histories):
            for a in h.alerts:
                if (label, a.signal, a.site) in seen:
                    continue
                seen.add((label, a.signal, a.site))
                d = first.get(a.site or "")
                compared = a.site is None or a.site in self.parting.get("sites", ())
                out.append({"run": label, "step": a.step, "severity": a.severity, "signal": a.signal, "site": a.site,
                            "compared": compared, "departed_at": None if d is None else d["step"],
                            "departure_signal": None if d is None else d["signal"]})
        return out

    def __repr__(self) -> str:
        f = self.first
        return f"RunsComparison({self.labels[0]} vs {self.labels[1]}: " + (
            "no departure)" if f is None else f"{f['signal']} at {f['site']} parts ways at step {f['step']})")

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per signal that departed, in precedence order: step, signal, site, value in
        each run, ratio beyond the early offset, z, threshold."""
        z = self.parting["threshold"]
        return [{"step": d["step"], "signal": d["signal"], "site": d["site"], self.labels[0]: d["a"],
                 self.labels[1]: d["b"], "ratio": d["ratio"], "z": d["z"], "threshold": z}
                for d in self.parting["departures"]]

    def to_frame(self):
        import pandas as pd

        cols = ["step", "signal", "site", *self.labels, "ratio", "z", "threshold"]
        return pd.DataFrame(self.to_rows(), columns=cols)

    def to_json(self) -> str:
        from ..integrations.writers import json_safe

        alerts = {label: [a.to_dict() for a in h.alerts] for label, h in zip(self.labels, self.histories)}
        return json.dumps(json_safe({"schema": "tinylm-runs-compare", "version": SCHEMA_VERSION,
                                     "labels": list(self.labels), "outcomes": list(self.outcomes),
                                     "parting": self.parting, "alerts": alerts,
                                     "alert_departures": self.alert_departures()}), indent=1, allow_nan=False)

    def _repr_html_(self) -> str | None:
        from ..display import html

        return html(self)


def compare_runs(a: Any, b: Any, labels: tuple[str, str] | None = None, alpha: float = ALPHA) -> RunsComparison:
    """Two runs side by side: ``a``, ``b`` are :class:`~diagnostics.History` objects, history
    dicts or paths ``History.read`` takes; ``labels`` name them (default: their sources, else "a",
    "b"); ``alpha``: the comparison's false-alarm probability."""
    from .history import History

    validate.number("alpha", alpha, low=0.0, high=0.5, strict_low=True, fix="alpha=X, e.g. 1e-6", error=OptionsError)
    runs = []
    for h in (a, b):
        if isinstance(h, History):
            runs.append(h)
        elif isinstance(h, dict):
            runs.append(History(h))
        else:
            runs.append(History.read(h))
    if labels is None:
        labels = tuple(label_of(h.source) or name for h, name in zip(runs, ("a", "b")))
        if labels[0] == labels[1]:
            labels = ("a", "b")
    return RunsComparison(runs[0], runs[1], tuple(labels), float(alpha))
