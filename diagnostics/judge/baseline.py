"""Precursors judged against the run's own baseline and trend, beside the absolute thresholds of
:mod:`diagnostics.judge.precursors`.

Two rules, each read from the history's records (nothing else):

``zero_gradient`` — a share of exact zeros in a site's gradient far above the run's own
baseline, in any dtype. A gradient that reaches the residual stream, a branch's output or an
embedding's output is dense: nothing in the model zeroes its entries, so its exact-zero share is
the run's own figure, the same at every such site (0 in most runs; the masked share of a padded
batch). The baseline of a site at a record is the lowest share of (a) the watched stream, branch
and embedding sites of that record (the gradient that reaches the sites above a cut) and (b)
the site's own earlier records (within :data:`~diagnostics.judge.precursors.LOOKBACK`). A site
whose share is more than ``underflow_share`` above its baseline is reported at that record (a
share counts every entry and does not fluctuate: no persistence), as a fail when it is more
than halfway from its baseline to 1. Sites whose gradient is float16 or bfloat16 are left to the
absolute ``underflow`` rule. The causes that fit are named: underflow through a cast to
float16 (an fp32 tensor holding fp16-rounded values: a ``.half()`` and back, a hook, a
collective in fp16) — the one that fits when every surviving entry is below float16's smallest
normal, 2^-14 — a dead branch (a zero gate or scale, dead units) or a mask that blocks the
gradient. No baseline exists where every watched site is cut at once from the first record.

growth — a maximum growing fast against its own previous records: the largest |attention
logit| of a layer (``attention_logits``), the largest |output logit| (``output_logits``) and a
matrix's update ratio (``update_large``, from step 10 on). A site is past at a record when its
value is above the signal's floor (:data:`FLOOR`) and at least :data:`GROWTH` [signal] x its
value at the record before; it is reported (a warn, under the signal's name) when it has been
past at :data:`PERSIST` [signal] records in a row, once per run of such records. Healthy runs
grow too (attention sharpens, a warm-up raises the updates) but slower and then level off;
the factors, floors and persistence sit above the healthy runs' fastest growth in the tuning set
(benchmarks/instability_runs.py; docs/instability.md gives the healthy extremes beside them).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from .thresholds import Thresholds

__all__ = ["zero_alerts", "growth_alerts", "dense_zeros", "Window", "DENSE_KINDS", "GROWTH", "FLOOR", "PERSIST", "LOW_PRECISION"]

#: the largest finite value of each low-precision format a site may run in
LOW_PRECISION = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}

#: site kinds whose gradient is dense by construction (the baseline sites of zero_gradient)
DENSE_KINDS = ("embedding", "residual", "resid_mid", "attn_branch", "ffn_branch")

#: float16's smallest normal: a cut whose surviving entries all lie below it is an fp16 underflow
_FP16_TINY = 2.0 ** -14

#: the growth per record (a factor over the record before) a signal must reach, by signal; the
#: tuning set's healthy runs reach at most 1.46 (attention logits above 20, two records in a row)
#: and 1.85 (an update ratio above 0.05, one record: a linear warm-up's step from 10 to 20)
GROWTH = {"attention_logits": 2.0, "output_logits": 2.0, "update_large": 4.0}

#: the smallest value the growth rule judges, by signal (below it a growth is not a precursor)
FLOOR = {"attention_logits": 20.0, "output_logits": 20.0, "update_large": 0.05}

#: records in a row a growth must hold, by signal (an update ratio follows the learning rate
#: without noise: one record)
PERSIST = {"attention_logits": 2, "output_logits": 2, "update_large": 1}

_WORDS = {
    "attention_logits": ("max |attention logit|", "the attention logits are growing fast "
                         "(Dehghani et al. 2023; Wortsman et al. 2023): the softmax will saturate and the attention "
                         "collapse onto single keys",
                         "normalise queries and keys (qk-norm: ModelConfig(qk_norm=\"rms\")) or lower the "
                         "learning rate"),
    "output_logits": ("max |output logit|", "the output logits are growing fast "
                      "(Wortsman et al. 2023): the head's softmax will lose precision and the loss can diverge",
                      "add a z-loss (TrainOptions(z_loss=1e-4)) or weight decay on the head, or lower the "
                      "learning rate"),
    "update_large": ("update ratio ||dW|| / ||W|| per step", "this matrix's updates grew several-fold in one record: "
                     "the learning rate (or the gradient reaching the optimizer) is rising",
                     "check the learning-rate schedule (a restart or a wrong step count), lower the learning "
                     "rate, and clip the gradient norm"),
}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def dense_zeros(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    """{site: grad_zero} of the record's dense sites (:data:`DENSE_KINDS`) outside float16/bfloat16:
    what the zero_gradient rule reads of a record (computed once per record, with the signals'
    values: :func:`diagnostics.judge.precursors.signal_values`)."""
    kinds, dtypes = h.get("kinds") or {}, rec.get("dtypes") or {}
    out = {}
    for site, st in (rec.get("stats") or {}).items():
        z = st.get("grad_zero")
        if kinds.get(site) in DENSE_KINDS and dtypes.get(site) not in LOW_PRECISION and _finite(z):
            out[site] = float(z)
    return out


class Window:
    """The values of the last ``size`` records by signal and site, each site's series kept as the
    records come (:meth:`add`: the cost of one record, whatever the window's length), so that
    judging a record reads each series once rather than every earlier record again.
    :meth:`series` gives the series of the sites measured at the newest record; a site absent
    from ``size`` records in a row is dropped."""

    def __init__(self, size: int):
        self.size, self.count = size, 0
        self._cols: dict[str, dict[str, deque]] = {}
        self._seen: dict[tuple[str, str], int] = {}  # (signal, site) -> the record it was last measured at
        self._last: dict[str, dict[str, float]] = {}

    @classmethod
    def of(cls, values: list[dict[str, dict[str, float]]], size: int) -> "Window":
        """The window after the last ``size`` of ``values``."""
        w = cls(size)
        for v in values[-size:] if size else ():
            w.add(v)
        return w

    def add(self, v: dict[str, dict[str, float]]) -> None:
        """The values of the next record ({signal: {site: value}}, :func:`~.precursors.signal_values`)."""
        pad = min(self.count, self.size)
        for name, got in v.items():
            cols = self._cols.setdefault(name, {})
            for site in got:
                if site not in cols:
                    cols[site] = deque([None] * pad, maxlen=self.size)
                self._seen[(name, site)] = self.count
        gone = []
        for name, cols in self._cols.items():
            got = v.get(name, {})
            for site, col in cols.items():
                col.append(got.get(site))
                if self.count - self._seen[(name, site)] >= self.size:
                    gone.append((name, site))
        for name, site in gone:
            del self._cols[name][site], self._seen[(name, site)]
        self.count += 1
        self._last = v

    def series(self, name: str) -> dict[str, list[float | None]]:
        """{site: its value of ``name`` at each record of the window, None where absent} for the
        sites measured at the newest record."""
        cols = self._cols.get(name, {})
        return {site: list(cols[site]) for site in self._last.get(name, ())}


def _zero_excess(shares: list[dict[str, float]], by_site: dict[str, list[float | None]]
                 ) -> dict[str, list[tuple[float, float] | None]]:
    """{site: [(share, baseline) or None per record]} (module docstring) from each record's
    :func:`dense_zeros` (``shares``; ``by_site``: the same as each site's series), for the sites
    whose share at the last record is past any baseline (share > 0: a site at 0 never is)."""
    lows = [min(got.values(), default=math.inf) for got in shares]  # each record's lowest dense share
    out: dict[str, list[tuple[float, float] | None]] = {}
    for site, series in by_site.items():
        if not series[-1] > 0.0:
            continue
        own, pairs = math.inf, []
        for z, low in zip(series, lows):
            pairs.append(None if z is None else (z, min(low, own)))
            own = own if z is None else min(own, z)
        out[site] = pairs
    return out


def zero_alerts(history: dict[str, Any], k: int, th: Thresholds, lo: int,
                values: list[dict[str, dict[str, float]]], window: Window) -> list[dict[str, Any]]:
    """The zero_gradient alerts first due at record k (records ``lo``..k looked back on), each as
    the fields of a :class:`diagnostics.judge.precursors.Alert`; ``values``: the
    :func:`~diagnostics.judge.precursors.signal_values` of records 0..k (their "zero_gradient"),
    ``window``: their :class:`Window` over ``lo``..k."""
    records = history["records"][lo:k + 1]
    limit = float(th.underflow_share)
    out = []
    for site, series in _zero_excess([v.get("zero_gradient", {}) for v in values[lo:k + 1]],
                                     window.series("zero_gradient")).items():
        past = [s is not None and s[0] - s[1] > limit for s in series]
        fail = [s is not None and s[0] - s[1] > (limit + 1.0) / 2.0 for s in series]
        if not past[-1]:
            continue
        run = next((j for j in range(len(past) - 1, -1, -1) if not past[j]), -1) + 1
        if fail[-1] and not any(fail[run:-1]):
            severity = "fail"
        elif run == len(past) - 1:
            severity = "warn"
        else:
            continue
        share, base = series[-1]
        st = records[-1]["stats"][site]
        out.append(_zero_alert(records, site, share, base, st, severity, limit, run))
    return out


def _zero_alert(records: list[dict[str, Any]], site: str, share: float, base: float,
                st: dict[str, Any], severity: str, limit: float, run: int) -> dict[str, Any]:
    step = int(records[-1]["step"])
    top = st.get("grad_absmax")
    fits = ""
    if _finite(top) and 0 < top < _FP16_TINY:
        fits = (f"; every surviving entry is below float16's smallest normal (max |g| {top:.2g} < 6.1e-05): "
                "underflow through a float16 cast fits")
    cause = (f"{share:.3%} of the gradient entries reaching here are exactly zero, against {base:.3%} at the "
             "run's baseline (the least-zero watched stream, branch or embedding site, and this site's earlier "
             "records): the gradient is cut on its way here by underflow through a cast to float16 (fp32 tensors "
             "holding fp16-rounded values, without loss scaling), a dead branch (a zero gate or scale, dead "
             f"units) or a mask that blocks it{fits}")
    fix = ("find the cast, gate or mask between this site and the sites above it that keep their gradient: keep "
           "that tensor in float32 or scale the loss (torch.amp.GradScaler) where the cast is meant; "
           "re-initialise a zero gate; check the mask")
    message = (f"step {step}: zero_gradient at {site}: share of exact zeros in the gradient = {share:.4g} > "
               f"{base + limit:.3g} (the baseline {base:.3g} + {limit:g}) since step {int(records[run]['step'])}; "
               f"cause: {cause}; fix: {fix}")
    return dict(step=step, severity=severity, signal="zero_gradient", site=site, value=share,
                threshold=base + limit, rising=0, since=int(records[run]["step"]), cause=cause, fix=fix,
                ruled_out="", message=message)


def growth_alerts(history: dict[str, Any], k: int, th: Thresholds, lo: int, window: Window) -> list[dict[str, Any]]:
    """The growth alerts first due at record k (module docstring), as the fields of an Alert;
    ``window``: the :class:`Window` of records ``lo``..k."""
    records = history["records"]
    out = []
    for name, factor in GROWTH.items():
        p = PERSIST[name]
        for site, series in window.series(name).items():
            now = series[-1]
            past = [b is not None and a is not None and a > 0 and b > FLOOR[name] and b >= factor * a
                    for a, b in zip([None, *series[:-1]], series)]
            run = next((j for j in range(len(past) - 1, -1, -1) if not past[j]), -1) + 1
            if len(past) - run != p:
                continue
            what, cause, fix = _WORDS[name]
            step, since = int(records[k]["step"]), int(records[lo + run]["step"])
            start = series[run - 1]
            shown = site[:-len(".probs")] if site.endswith(".probs") else site
            where = "" if site in ("model", "logits") else f" at {shown}"
            message = (f"step {step}: {name}{where}: {what} = {now:.3g}, {now / start:.3g}x its {start:.3g} at step "
                       f"{int(records[lo + run - 1]['step'])} (at least {factor:g}x per record for {p} record"
                       f"{'s' if p > 1 else ''}, above {FLOOR[name]:g}); cause: {cause}; fix: {fix}")
            out.append(dict(step=step, severity="warn", signal=name, site=site if where else None, value=float(now),
                            threshold=factor * float(series[-2]), rising=p, since=since, cause=cause, fix=fix,
                            ruled_out="", message=message))
    return out
