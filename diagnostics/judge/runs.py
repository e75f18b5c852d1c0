"""A run judged whole, and two runs judged side by side.

:func:`outcome`: what a run came to, from its verdicts over time, its alerts, its alarms and its
loss: "failed" at the first fail (a non-finite or exploding verdict, an alert of severity fail, a
non-finite loss), else "warned" at the first warning (an alert of severity warn, a vanishing
gradient, a loss spike), else "ok" when at least one record was judged, else "not judged" (steps
logged but nothing recorded: the loss alone says nothing about the layers).

:func:`parting`: where two runs part ways. Their records are aligned by step; each signal (every
site's forward and gradient variance and largest |x|, each attention layer's largest logit and
mean entropy, the loss) is compared on a log scale, against the runs' own noise:

* the offset: d0 = mean of d = log a - log b over the first :data:`EARLY` aligned records (one: the runs are told apart from their second record on)
  (two runs of one seed start at d0 = 0; runs of other seeds or inits at their own offset);
* each run's scatter s: its record-to-record wander, from the increments of log x over all its
  records, robustly (1.4826 x their median absolute deviation, / sqrt(2): a smoothly moving level
  plus independent scatter; the few large jumps of a departure leave it unchanged, so it can be
  learnt from the whole run even when the runs part at their fourth record).

At each later record, z_t = |d_t - d0| / sqrt((s_a^2 + s_b^2) (1 + 1 / EARLY)); a signal departs
at the first record where z_t passes Student's t quantile (degrees of freedom: the increments
less one, the smaller run's) of ``alpha`` / (2 x the number of tests made): under that noise model
the false-alarm probability of the whole comparison is at most ``alpha`` (1e-6 by default). A
signal finite in one run and not the other departs at once (z = inf). The first departure is the
earliest step, then the most upstream site (forward order) among forward statistics, then the
most downstream among gradients (the first the backward reaches), the loss last.
"""

from __future__ import annotations

import math
from typing import Any

from .over_time import FAIL_VERDICTS

__all__ = ["outcome", "parting", "what_moved", "signal_series", "ALPHA", "STATS", "ATTENTION"]

ALPHA = 1e-6
EARLY = 1  # aligned records that set the runs' offset
STATS = ("fwd_var", "grad_var", "fwd_absmax")  # per site, in this order of precedence
ATTENTION = ("max_logit", "entropy_mean")
_SCATTER_FLOOR = 1e-6  # relative: a constant signal still has its float64 rounding


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def outcome(history: dict[str, Any], rows: list[dict[str, Any]], alerts: list[Any]) -> dict[str, Any]:
    """{"status": "failed" | "warned" | "ok" | "not judged", "step": t or None, "why": a line}.

    Args:
        history: the history dict (its series, records and events).
        rows: its non-ok verdict rows (:func:`diagnostics.judge.over_time.verdicts`).
        alerts: the alerts the watch reported (:class:`diagnostics.judge.precursors.Alert`).
    """
    fails, warns = [], []  # (step, what, detail)
    for r in rows:
        if r["verdict"] in FAIL_VERDICTS or r["verdict"] == "vanishing":
            (fails if r["verdict"] in FAIL_VERDICTS else warns).append(
                (r["step"], f"{r['site']} {r['verdict']}", f" ({r['stat']} = {r['value']:.3g})"))
    for a in alerts:
        (fails if a.severity == "fail" else warns).append((a.step, f"{a.site or 'the model'} {a.signal}",
                                                           f" ({a.value:.3g} against {a.threshold:.3g})"))
    for e in history.get("events") or []:
        kind = e.get("kind")
        (fails if kind == "nonfinite" else warns).append((e.get("step"), f"the loss {kind}", ""))
    series = history.get("series") or {}
    bad = next(((t, v) for t, v in zip(series.get("step") or [], series.get("loss") or []) if not _finite(v)), None)
    if bad is not None:
        fails.append((bad[0], "the loss non-finite", f" ({bad[1]})"))
    for status, found in (("failed", fails), ("warned", warns)):
        found = [f for f in found if isinstance(f[0], int)]
        if found:
            step = min(f[0] for f in found)
            first = {}
            for t, what, detail in found:
                if t == step:
                    first.setdefault(what, what + detail)
            later = len({(t, w) for t, w, _ in found if t != step})
            why = "; ".join(first.values()) + (f"; {later} more later" if later else "")
            return {"status": status, "step": step, "why": why}
    if history.get("records"):
        return {"status": "ok", "step": None, "why": f"{len(history['records'])} records judged, every verdict ok, no alert"}
    return {"status": "not judged", "step": None, "why": "no record: only the loss was logged"}


def signal_series(history: dict[str, Any]) -> dict[tuple[str, str | None], dict[int, float]]:
    """{(signal, site): {step: value}} of the signals :func:`parting` compares (site None: the loss)."""
    out: dict[tuple[str, str | None], dict[int, float]] = {}
    for rec in history.get("records") or []:
        t = rec["step"]
        for site, st in rec["stats"].items():
            for key in STATS:
                if key in st:
                    out.setdefault((key, site), {})[t] = st[key]
        for site, att in (rec.get("attention") or {}).items():
            for key in ATTENTION:
                if key in att:
                    out.setdefault((key, site), {})[t] = att[key]
    series = history.get("series") or {}
    out[("loss", None)] = dict(zip(series.get("step") or [], series.get("loss") or []))
    return out


def _log(x: Any) -> float:
    """log |x| (NaN for a missing value, -inf for 0, inf for a non-finite one)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return math.inf
    if not math.isfinite(x):
        return math.inf
    return math.log(abs(x)) if x != 0 else -math.inf


def _scatter(values: list[float]) -> tuple[float, int]:
    """(s, df): a run's record-to-record scatter of one signal from the increments of its finite
    log values, robustly (1.4826 x the median absolute deviation of the increments, / sqrt(2): a
    level that moves smoothly plus independent scatter; a departure's few large jumps leave it
    as it is), and the increments it rests on less one; (NaN, 0) with fewer than 4."""
    finite = [v for v in values if math.isfinite(v)]
    inc = sorted(b - a for a, b in zip(finite, finite[1:]))
    if len(inc) < 4:
        return math.nan, 0
    med = inc[len(inc) // 2] if len(inc) % 2 else (inc[len(inc) // 2 - 1] + inc[len(inc) // 2]) / 2
    dev = sorted(abs(x - med) for x in inc)
    mad = dev[len(dev) // 2] if len(dev) % 2 else (dev[len(dev) // 2 - 1] + dev[len(dev) // 2]) / 2
    return 1.4826 * mad / math.sqrt(2), len(inc) - 1


def _one(a: dict[int, float], b: dict[int, float], steps: list[int], early: int
         ) -> tuple[float, float, int, list[tuple[int, float, float, float]]] | None:
    """(d0, scale, df, [(step, z, a, b) after the early records]) of one signal, or None when its
    early records are not all finite in both runs or its scatter cannot be estimated."""
    la, lb = [_log(a[t]) for t in steps], [_log(b[t]) for t in steps]
    ea, eb = la[:early], lb[:early]
    if not all(math.isfinite(x) for x in ea + eb):
        return None
    d0 = sum(x - y for x, y in zip(ea, eb)) / early
    (sa, dfa), (sb, dfb) = _scatter(la), _scatter(lb)
    if not (dfa and dfb):
        return None
    floor = _SCATTER_FLOOR * max(1.0, max(abs(x) for x in ea + eb))
    scale = math.sqrt((max(sa, floor) ** 2 + max(sb, floor) ** 2) * (1 + 1 / early))
    out = []
    for t, x, y in zip(steps[early:], la[early:], lb[early:]):
        if math.isfinite(x) and math.isfinite(y):
            z = abs(x - y - d0) / scale
        else:
            z = 0.0 if x == y else math.inf  # finite in one run only (or inf against -inf)
        out.append((t, z, a[t], b[t]))
    return d0, scale, min(dfa, dfb), out


def parting(a: dict[str, Any], b: dict[str, Any], alpha: float = ALPHA) -> dict[str, Any]:
    """Where two histories part ways (module docstring).

    Returns {"first": the first departure or None, "departures": [one per signal that departed,
    in order], "compared": signals compared, "too_few": signals with
    fewer than 5 aligned records (not judged), "steps": aligned records, "early": records that set
    the offset, "tests": tests made, "sites": the sites compared, "threshold": the smallest z threshold, "alpha": alpha, "why": a
    line when nothing could be compared}. Each departure: {"step", "signal", "site", "a", "b",
    "ratio" (exp(d - d0): a / b beyond the offset), "z", "threshold", "baseline_ratio" (exp d0)}.
    """
    from scipy.stats import t as student_t

    sa, sb = signal_series(a), signal_series(b)
    order = {s: k for k, s in enumerate(a.get("sites") or [])}
    keys = [k for k in sa if k in sb]
    record_steps = sorted({r["step"] for r in a.get("records") or []} & {r["step"] for r in b.get("records") or []})
    done = {"first": None, "departures": [], "compared": 0, "too_few": 0, "steps": len(record_steps), "early": 0,
            "threshold": math.nan, "alpha": alpha, "why": None}
    tested: list[tuple[tuple[str, str | None], int, float, float, list]] = []
    for key in keys:
        steps = sorted(set(sa[key]) & set(sb[key]))
        early = EARLY
        if len(steps) < early + 4:
            done["too_few"] += 1
            continue
        got = _one(sa[key], sb[key], steps, early)
        if got is not None:
            tested.append((key, early, got[0], got[2], got[3]))
    if not tested:
        done["why"] = (f"too few records in common ({len(record_steps)} aligned by step; at least {EARLY + 4} needed) "
                       "to learn the runs' own noise")
        return done
    n_tests = sum(len(x[4]) for x in tested)
    per_test = alpha / (2 * max(n_tests, 1))
    limits = {df: float(student_t.isf(per_test, df)) for df in {x[3] for x in tested}}
    rank = {s: k for k, s in enumerate(("fwd_var", "fwd_absmax", "max_logit", "entropy_mean", "grad_var", "loss"))}
    found = []
    for (signal, site), early, d0, df, points in tested:
        hit = next(((t, z, x, y) for t, z, x, y in points if z > limits[df]), None)
        if hit is not None:
            t, z, x, y = hit
            ratio = math.exp(_log(x) - _log(y) - d0) if math.isfinite(z) else math.nan
            found.append({"step": t, "signal": signal, "site": site, "a": x, "b": y, "ratio": ratio, "z": z,
                          "threshold": limits[df], "baseline_ratio": math.exp(d0)})
    def precedence(d: dict[str, Any]) -> tuple:
        group = 2 if d["signal"] == "loss" else 1 if d["signal"] == "grad_var" else 0
        where = order.get(d["site"], len(order))
        return d["step"], group, -where if group == 1 else where, rank[d["signal"]]

    found.sort(key=precedence)
    done.update(first=found[0] if found else None, departures=found, compared=len(tested),
                sites=sorted({site for (_, site), *_ in tested if site is not None}),
                early=EARLY, threshold=min(limits.values()), tests=n_tests)
    return done


def what_moved(report: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    """What moved in a forensics report's records (the last records before a spike or a fail): per
    site and statistic (forward and gradient variance, largest |x|), the rise of its last value over
    its lowest value in the report's earlier records (inf when it stopped being finite); the
    ``top`` largest, largest first: [{"site", "stat", "rise", "from_step", "to_step"}]. Records hold
    no more than the watch kept (``Watch(forensics=N)``)."""
    records = report.get("records") or []
    if len(records) < 2:
        return []
    last, earlier = records[-1], records[:-1]
    found = []
    for site, st in (last.get("stats") or {}).items():
        for key in STATS:
            before = [r["stats"][site].get(key) for r in earlier if site in (r.get("stats") or {})]
            before = [v for v in before if _finite(v) and v > 0]
            v = st.get(key)
            if not before:
                continue
            low = min(before)
            rise = v / low if _finite(v) else math.inf
            found.append({"site": site, "stat": key, "rise": rise, "from_step": earlier[0]["step"],
                          "to_step": last["step"]})
    found.sort(key=lambda d: -d["rise"])
    return found[:top]
