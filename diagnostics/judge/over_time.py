"""Verdicts over time: each watched site judged against its own earlier records.

A watch history (the format of :mod:`diagnostics.jobs.history`) holds, per record, each
site's moments. A site is compared with its own earlier records (not with the first alone:
a badly initialised model starts far from healthy, and a healthy one's statistics move
while it learns), with the watch thresholds of :class:`diagnostics.judge.thresholds.Thresholds`
(the one set diagnose uses too; their defaults and margins are documented there):

    non_finite   a NaN or inf in the tensor or its gradient (any site)
    exploding    forward variance above watch_growth (10^3) x the lowest value it had at an earlier record
    vanishing    gradient variance below the highest value it had at an earlier record / watch_shrink (10^4)
    not_measured the site's forward was not seen at that record (count 0: a hook that never ran,
                 a module the model does not call); never ok, never a fail, never a reference
    ok           otherwise

exploding and vanishing judge the sites that reach a computation at their scale
(:func:`judged`): attention scores, logits, and the residual stream unless the model is
pre-norm.

The site that moved first (:func:`first_mover`, named in the message of a spike): the
earliest record at which a variance rose above watch_move (10) x its lowest earlier value.

Every function reads the history dict and nothing else; none records or draws.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import tinylm

from .verdicts import Thresholds

__all__ = [
    "FAIL_VERDICTS",
    "NOT_MEASURED",
    "Extremes",
    "thresholds_of",
    "measured",
    "judged",
    "record_verdicts",
    "verdicts",
    "first_departure",
    "first_mover",
    "describe_move",
]

# The watch's verdicts that stop a run (``Watch(stop="raise")``) or set ``Watch.failure``: a NaN or
# inf (in a tensor, a gradient or the loss) and a forward variance grown past watch_growth. A
# vanishing gradient is a warning: training often goes on and recovers. These are the watch's
# own words; where a finding carries a severity, "fail" is this set.
FAIL_VERDICTS = ("non_finite", "exploding")
#: The verdict of a site that was not measured at a record (count 0): it says nothing about the
#: site's health, so it is never "ok"; it does not stop a run.
NOT_MEASURED = "not_measured"


def thresholds_of(history: dict[str, Any], thresholds: Thresholds | None = None) -> Thresholds:
    """The thresholds a history is judged by.

    Args:
        history: a watch history dict.
        thresholds: a :class:`Thresholds`, or None.

    Returns:
        ``thresholds`` when given, else those the history was recorded with (its
        "thresholds" entry), else the defaults.
    """
    if thresholds is not None:
        if not isinstance(thresholds, Thresholds):
            from ..errors import OptionsError

            raise OptionsError(f"thresholds={thresholds!r}: pass a diagnostics.Thresholds")
        return thresholds
    stored = history.get("thresholds") if isinstance(history, dict) else None
    return Thresholds.from_dict(stored) if isinstance(stored, dict) else Thresholds()


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def measured(st: dict[str, float]) -> bool:
    """Whether one site's record was measured: False when it counted no entry (count 0: its
    forward did not run, or ran where no hook saw it); such a record is judged
    :data:`NOT_MEASURED` and is never a reference."""
    return st.get("count", 1) != 0


class Extremes:
    """The running extremes of each site's variances over the records seen so far (the
    reference every verdict compares with): ``low[site]`` = min of its finite positive forward
    variances, ``high[site]`` = max of its finite positive gradient variances."""

    def __init__(self) -> None:
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}

    def update(self, rec: dict[str, Any]) -> None:
        """Take in one record (after judging it: a record is judged against the earlier ones)."""
        for site, st in rec["stats"].items():
            for key, best, fn in (("fwd_var", self.low, min), ("grad_var", self.high, max)):
                v = st.get(key)
                if _finite(v) and v > 0:
                    best[site] = fn(best[site], v) if site in best else v


def _running_extremes(history: dict[str, Any], key: str, fn: Callable[[float, float], float]
                      ) -> list[dict[str, float]]:
    """For each record k: {site: fn of the finite positive ``key`` values at records 0..k-1} (absent if none)."""
    out, best = [], {}
    for rec in history.get("records") or []:
        out.append(dict(best))
        for site, st in rec["stats"].items():
            v = st.get(key)
            if _finite(v) and v > 0:
                best[site] = fn(best[site], v) if site in best else v
    return out


def judged(site: str, norm: str | None = None, kind: str | None = None) -> bool:
    """Sites whose growth is judged: the attention scores and the logits (what softmax reads:
    the head, of kind "logits" whatever its name),
    and the residual stream (embedding output, resid_mid, block outputs) unless the model is
    pre-norm (``norm="pre"``: every read of its residual stream goes through an RMSNorm, which
    is scale-invariant, so the stream's scale does not reach any computation). Branch outputs
    (attn, ffn) and attention probabilities are only judged for non-finite values: several
    init schemes start the branches at or near zero, so their growth is learning."""
    if kind == "logits" or site == tinylm.plan.HEAD or site.rsplit(".", 1)[-1] == "scores":
        return True
    return tinylm.plan.on_stream(site) and norm != "pre"


def _site_verdict(st: dict[str, float], low_fwd: float | None, high_grad: float | None, th: Thresholds,
                  ) -> tuple[str, str | None, float, float]:
    """(verdict, statistic, value, threshold) of one site's record, given its earlier extremes
    (None for a site that is not :func:`judged` or has no earlier record)."""
    if not measured(st):
        return NOT_MEASURED, "count", 0.0, math.nan
    if st.get("fwd_nonfinite", 0.0) > 0 or not _finite(st.get("fwd_var")):
        return "non_finite", "fwd_nonfinite", st.get("fwd_nonfinite", math.nan), 0.0
    if st.get("grad_nonfinite", 0.0) > 0 or (high_grad is not None and not _finite(st.get("grad_var"))):
        return "non_finite", "grad_nonfinite", st.get("grad_nonfinite", math.nan), 0.0
    v = st["fwd_var"]
    if low_fwd is not None and v > th.watch_growth * low_fwd:
        return "exploding", "fwd_var", v, th.watch_growth * low_fwd
    g = st.get("grad_var")
    if high_grad is not None and _finite(g) and g < high_grad / th.watch_shrink:
        return "vanishing", "grad_var", g, high_grad / th.watch_shrink
    return "ok", None, math.nan, math.nan


def record_verdicts(rec: dict[str, Any], earlier: Extremes, norm: str | None, th: Thresholds,
                    kinds: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The non-ok verdicts of one record, judged against the extremes of the records before it.

    Args:
        rec: one record of a history ({"step", "stats": {site: moments}, ...}).
        earlier: the :class:`Extremes` of the earlier records (not updated here).
        norm: the model's norm placement ("pre", "post", "none" or None), for :func:`judged`.
        th: the thresholds.
        kinds: the history's site kinds (a head of kind "logits" is judged for growth whatever its name).

    Returns:
        One row per site whose verdict is not ok (:data:`NOT_MEASURED` included), in the
        record's site order: step, site, verdict, stat, value, threshold.
    """
    rows = []
    for site, st in rec["stats"].items():
        j = judged(site, norm, (kinds or {}).get(site))
        verdict, key, value, threshold = _site_verdict(st, earlier.low.get(site) if j else None,
                                                       earlier.high.get(site) if j else None, th)
        if verdict != "ok":
            rows.append({"step": rec["step"], "site": site, "verdict": verdict, "stat": key,
                         "value": value, "threshold": threshold})
    return rows


def verdicts(history: dict[str, Any], thresholds: Thresholds | None = None) -> list[dict[str, Any]]:
    """One row per (record, site) whose verdict is not ok: step, site, verdict, stat, value, threshold.

    exploding: forward variance > watch_growth x the lowest value the site had at an earlier
    record; vanishing: gradient variance < the highest earlier value / watch_shrink;
    non_finite: any NaN/inf entry in the tensor or its gradient; not_measured: count 0 at that
    record (:data:`NOT_MEASURED`). ``thresholds``: see
    :func:`thresholds_of` (None: the history's own, else the defaults).
    """
    th = thresholds_of(history, thresholds)
    earlier = Extremes()
    rows: list[dict[str, Any]] = []
    for rec in history.get("records") or []:
        rows += record_verdicts(rec, earlier, history.get("norm"), th, history.get("kinds"))
        earlier.update(rec)
    return rows


def first_departure(history: dict[str, Any], thresholds: Thresholds | None = None,
                    rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The first (step, site) at which any verdict left ok (earliest step, then forward order), or None.

    ``rows``: the history's :func:`verdicts` when already computed (None: computed here)."""
    rows = verdicts(history, thresholds) if rows is None else rows
    if not rows:
        return None
    order = {s: k for k, s in enumerate(history.get("sites") or [])}
    return min(rows, key=lambda r: (r["step"], order.get(r["site"], len(order))))


def first_mover(history: dict[str, Any], factor: float | None = None, thresholds: Thresholds | None = None
                ) -> dict[str, Any] | None:
    """The statistic that moved first: the earliest record at which some site's tensor or
    gradient stopped being finite, or a :func:`judged` site's forward or gradient variance
    rose above ``factor`` (default: the thresholds' watch_move, see :func:`thresholds_of`) x the
    lowest value it had at any earlier record. At that record: the first such site in
    forward order among forward variances (the most upstream activation), else the last
    in forward order among gradient variances (the first the backward pass reaches).
    Returns {"site", "stat", "step", "factor"} (factor: the rise, inf if not finite) or None.
    """
    factor = thresholds_of(history, thresholds).watch_move if factor is None else factor
    records = history.get("records") or []
    order = {s: k for k, s in enumerate(history.get("sites") or [])}
    lows = {key: _running_extremes(history, key, min) for key in ("fwd_var", "grad_var")}
    for k, rec in enumerate(records):
        moved = {"fwd_var": [], "grad_var": []}
        for site, st in rec["stats"].items():
            if not measured(st):
                continue  # nothing seen: nothing moved
            j = judged(site, history.get("norm"), (history.get("kinds") or {}).get(site))
            for key in moved:
                v = st.get(key)
                nonfinite = st.get(key.split("_")[0] + "_nonfinite", 0.0)
                low = lows[key][k].get(site)
                if (nonfinite or 0.0) > 0 or (low is not None and not _finite(v)):
                    moved[key].append((order.get(site, len(order)), site, math.inf))  # any site
                elif j and low is not None and v > factor * low:
                    moved[key].append((order.get(site, len(order)), site, v / low))
        if moved["fwd_var"]:
            _, site, rise = min(moved["fwd_var"])
            return {"site": site, "stat": "fwd_var", "step": rec["step"], "factor": rise}
        if moved["grad_var"]:
            _, site, rise = max(moved["grad_var"])
            return {"site": site, "stat": "grad_var", "step": rec["step"], "factor": rise}
    return None


def describe_move(m: dict[str, Any]) -> str:
    """A :func:`first_mover` result in words: "<site> moved first: its <activation|gradient>
    variance <rose to Nx its lowest earlier value|stopped being finite> at step t"."""
    what = "activation variance" if m["stat"] == "fwd_var" else "gradient variance"
    size = "stopped being finite" if math.isinf(m["factor"]) else f"rose to {m['factor']:.3g}x its lowest earlier value"
    return f"{m['site']} moved first: its {what} {size} at step {m['step']}"
