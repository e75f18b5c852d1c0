"""Statistics of independent replicates: the intervals every job reports beside a figure.

A replicate is one independent repetition of a measurement (a weight draw, or a batch of
one draw); an interval is never taken over the elements of one tensor (those are
correlated). Two intervals, both Student-t over R replicates at confidence c
(:data:`CONFIDENCE`, 99%):

* :func:`t_interval`, symmetric, for a quantity on a linear scale that may be negative
  (a slope of ln variance over depth):

      m ± t_{(1+c)/2, R-1} sd(x) / sqrt(R)

* :func:`log_t_interval`, for a positive ratio (measured / predicted variance), which is
  multiplicative (2x over and 2x under are equally far from 1): the t interval of ln r,
  exponentiated, so the point is the geometric mean and the interval is positive and
  asymmetric around it:

      exp(m),  [exp(m - h), exp(m + h)],  m = mean ln r,  h = t_{(1+c)/2, R-1} sd(ln r) / sqrt(R)

:func:`group_geometric_means` turns (group, ratio) pairs into one ratio per independent
replicate; :func:`interval_scope` says in words what a diagnosis's intervals cover.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

__all__ = ["CONFIDENCE", "t_interval", "log_t_interval", "group_geometric_means", "interval_scope"]

#: the confidence of every interval a job reports
CONFIDENCE = 0.99


@lru_cache(maxsize=256)
def _t_quantile(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def _exp(x: float) -> float:
    """e^x, inf beyond the float64 range instead of OverflowError."""
    return math.exp(x) if x < 709.0 else math.inf


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """(mean, low, high): symmetric Student-t interval of the mean of independent replicates.

    Args:
        values: one number per replicate; non-finite values are dropped.
        confidence: the interval's confidence c.
    Returns: (m, m - h, m + h) with m the mean, h = t_{(1+c)/2, R-1} sd(values, ddof 1) / sqrt(R);
        (nan, None, None) for no finite value, (m, None, None) for one.
    """
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return math.nan, None, None
    m = float(v.mean())
    if v.size < 2:
        return m, None, None
    half = _t_quantile(0.5 + confidence / 2, int(v.size - 1)) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return m, m - half, m + half


def log_t_interval(values: list[float], confidence: float = CONFIDENCE
                   ) -> tuple[float | None, float | None, float | None]:
    """(geometric mean, low, high) of positive ratios from independent replicates: the
    Student-t interval of the mean of ln r, exponentiated.

    With m = mean ln r, s = sd(ln r) (ddof 1) over R replicates and h = t_{(1+c)/2, R-1} s / sqrt(R):
    point exp(m), interval [exp(m - h), exp(m + h)]: asymmetric around the point, always
    positive, exact coverage when ln r is normal (lognormal replicates).

    Replicates that are not finite and positive are not dropped (dropping them would
    bias the estimate silently); the interval is then None, None because ln r is
    undefined (r < 0, nan), -inf (r = 0) or inf (r = inf), and:

    * any r = 0 (a replicate measured zero variance), the others finite and positive:
      point 0, the geometric mean of a set holding 0;
    * any r negative, nan or inf: point None (a ratio of variances is never negative,
      and an overflowed or undefined variance has no meaningful ratio; the non-finite
      verdict reports it).

    Fewer than 2 replicates: the point alone (None for none).
    """
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return None, None, None
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        return None, None, None
    if np.any(v == 0):
        return 0.0, None, None
    logs = np.log(v)
    m = float(logs.mean())
    if v.size < 2:
        return _exp(m), None, None
    half = _t_quantile(0.5 + confidence / 2, int(v.size - 1)) * float(logs.std(ddof=1)) / math.sqrt(v.size)
    return _exp(m), _exp(m - half), _exp(m + half)


def group_geometric_means(ratios: Iterable[tuple[int, float]]) -> list[float]:
    """One ratio per independent replicate from (group, ratio) pairs, in the groups' first-seen order.

    Each group's ratio is the geometric mean of its ratios, exp(mean ln r); a group holding a
    ratio that is not finite and positive passes that one on instead (for :func:`log_t_interval`
    to report). Replicates that share a deviation (the batches of one weight draw) form one group.
    """
    groups: dict[int, list[float]] = {}
    for g, r in ratios:
        groups.setdefault(g, []).append(r)
    out = []
    for values in groups.values():
        bad = [r for r in values if not (math.isfinite(r) and r > 0)]
        out.append(bad[0] if bad else _exp(float(np.mean(np.log(values)))))
    return out


def interval_scope(header) -> str:
    """What the 99% intervals of a diagnosis's ratios cover, in words.

    Args:
        header: a :class:`diagnostics.Header` (its seeds, batches and theory).
    Returns: "" when there are no ratios (theory off or none); with several seeds
        "S weight draws x B batch(es)" (each replicate its own draw: the interval covers the
        draw and the batches); with one seed the replicates are batches of one draw, which
        cover batch noise only: global theory predicts the expectation over draws, so it says
        "(batch noise, not the draw)"; local theory predicts from the actual weights, so
        "B batches of these weights".
    """
    if header.theory not in ("local", "global"):
        return ""
    if header.seeds > 1:
        return f"{header.seeds} weight draws x {header.batches} batch(es)"
    if header.theory == "global":
        return f"{header.batches} batches of one weight draw (batch noise, not the draw)"
    return f"{header.batches} batches of these weights"
