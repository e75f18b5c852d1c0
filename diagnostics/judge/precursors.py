"""Precursors of training failures, judged over a watch history: what is about to go wrong, why,
and what to change.

Each signal is read from the history's records (the format of :mod:`diagnostics.jobs.history`)
at one or more of its sites (an attention layer, a parameter, a block), and is *past* its
threshold (the fields of :class:`diagnostics.judge.thresholds.Thresholds`) when

    attention_logits   max |attention logit| of a layer          > attn_logit
    attention_entropy  mean row entropy / its causal maximum      < attn_entropy
    log_z              |mean log Z| of the output rows            > logz_limit
    output_logits      max |output logit|                         > logit_limit
    update_large       a matrix's update ratio ||dW|| / ||W||     > update_high
                       (from the second step on: step 0's is judged by first_update)
    first_update       at step 0, the median matrix's update ratio > update_high (Adam's first
                       step is a sign step: each entry moves by the learning rate, a matrix by
                       lr / rms(W), so each matrix alone says nothing of its gradient)
    update_small       the median matrix's update ratio           < update_low
                       (not measured at a record where no matrix moved: no optimizer step ran in it)
    adam_epsilon       share of Adam entries with sqrt(v_hat) < eps > eps_share
    underflow          share of a block's gradient entries that are exact zeros, in a
                       float16 or bfloat16 run                    > underflow_share
    overflow_ahead     max |activation| x overflow_headroom       > the largest finite of the site's
                       float16 format
    init_scale         at step 0, the block matrices' median std / their declared init's std,
                       either way                                 > init_drift
    massive            a block output's max |x| / median |x|      > massive_ratio
    stall              the loss has not fallen over the last plateau_steps steps (its least-squares
                       slope is not below zero at a false-alarm rate of 1e-6) while update_small,
                       adam_epsilon or underflow is past its threshold (reported when it begins)

and, against the run's own baseline and trend (:mod:`diagnostics.judge.baseline`): an exact-zero
share of a site's gradient far above the run's baseline, in any dtype (zero_gradient), and the
attention logits, the output logits and the update ratios growing fast against their own
previous records; and with the watch's precision trend, a GEMM's SQNR in a low-precision recipe
fallen below its own first record's (precision_drop, :mod:`diagnostics.judge.precision_trend`).

A precursor is reported (an :class:`Alert`) at the record where its signal has been past its
threshold at ``early_persist`` records in a row (a share or a format's headroom, which counts
every entry and does not fluctuate as a maximum does: at the first record past it); then not
again at that site until it has come back within its threshold. A value past the fail level
(:data:`FAIL_FACTOR` times past the threshold) is reported at once, as a fail, once per run of
records past the threshold (within the last :data:`LOOKBACK` records). Persistence is what keeps a single noisy record from raising an
alarm; it costs ``(early_persist - 1) x every`` steps of lead.

Every alert says the value, the threshold, how many records in a row the value has been rising,
the cause and the fix, and what was ruled out: the other signals that were measured at that
record and within their thresholds (signals not measured are said to be so, never "ok").

Every function reads the history dict and nothing else.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .baseline import LOW_PRECISION, Window, dense_zeros, growth_alerts, zero_alerts
from .precision_trend import precision_alerts
from .thresholds import Thresholds

__all__ = ["Alert", "SIGNALS", "FAIL_FACTOR", "LOOKBACK", "signal_values", "precursor_alerts", "all_precursor_alerts",
           "LOW_PRECISION"]

#: records a judgement looks back on (a run past a threshold longer than this counts from its start;
#: judging a record costs the same at record 10 and at record 10,000)
LOOKBACK = 64

#: how far past its threshold a signal must go to be a fail (larger-is-worse signals: x this
#: factor; smaller-is-worse: / this factor; shares: halfway from the threshold to 1)
FAIL_FACTOR = 10.0


@dataclass
class Alert:
    """One judged warning or fail of the watch, at ``step``.

    ``signal``: a key of :data:`SIGNALS` (or a verdict over time: "exploding", "vanishing",
    "non_finite", or "spike"); ``site``: where (a module, attention layer, parameter, or None for
    the model); ``value`` against ``threshold``; ``rising``: records in a row the value has moved
    the bad way, ending here; ``since``: the step it first passed its threshold in this run of
    records; ``cause``, ``fix``: what it means and what to change; ``ruled_out``: the signals
    measured here and within their thresholds; ``message``: all of it in a line.
    """

    step: int
    severity: str  # "warn" or "fail"
    signal: str
    site: str | None
    value: float
    threshold: float
    rising: int
    since: int | None
    cause: str
    fix: str
    ruled_out: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Signal:
    """How one precursor is read and judged: ``read(record, history)`` gives {site: value};
    ``threshold`` names the Thresholds field; ``worse`` is "high" or "low"; ``share``: a fraction."""

    name: str
    read: Callable[[dict[str, Any], dict[str, Any]], dict[str, float]]
    threshold: str
    worse: str
    what: str
    cause: str
    fix: str
    share: bool = False
    #: whether the signal must hold for ``early_persist`` records: False for counts over every
    #: entry of a tensor or an optimizer state (a share of zeros, of Adam entries under eps, a
    #: format's headroom), which do not fluctuate from batch to batch as a maximum does
    persist: bool = True


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _attention(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    out = {n: a.get("max_logit") for n, a in (rec.get("attention") or {}).items() if _finite(a.get("max_logit"))}
    for site, st in (rec.get("stats") or {}).items():  # a tinylm scores site (also in older histories)
        if site.rsplit(".", 1)[-1] == "scores" and site[:-len("scores")] + "probs" not in out:
            out[site[:-len("scores")] + "probs"] = st.get("fwd_absmax")
    return {k: float(v) for k, v in out.items() if _finite(v)}


def _entropy(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    out = {}
    for n, a in (rec.get("attention") or {}).items():
        h, ceiling = a.get("entropy_mean"), a.get("entropy_ceiling")
        if _finite(h) and _finite(ceiling) and ceiling > 0:
            out[n] = h / ceiling
    return out


def _logits(key: str) -> Callable[[dict[str, Any], dict[str, Any]], dict[str, float]]:
    def read(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
        v = (rec.get("logits") or {}).get(key)
        return {"logits": abs(float(v))} if _finite(v) else {}
    return read


def _matrices(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    """Update ratios of the matrices (parameters named like weights; biases, gains and norms excluded);
    none at step 0, whose ratios the first_update signal judges."""
    return {} if int(rec.get("step", -1)) == 0 else _ratios(rec, h)


def _ratios(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    shapes = h.get("param_dims") or {}
    out = {}
    for name, r in (rec.get("update_ratio") or {}).items():
        leaf = name.rsplit(".", 1)[-1]
        matrix = shapes.get(name, 2) >= 2 if shapes else (leaf == "weight" and "norm" not in name and "ln" not in name)
        if matrix and _finite(r):
            out[name] = float(r)
    return out


def _median_update(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    ratios = list(_ratios(rec, h).values())
    if not any(ratios):  # no matrix moved: no optimizer step inside the recorded step, nothing measured
        return {}
    return {"model": statistics.median(ratios)}


def _first(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    """The median matrix's update ratio at step 0, the run's first step: Adam's first step is a
    sign step (m_hat / sqrt(v_hat) = +-1), so each entry moves by the learning rate and a matrix's
    ratio is lr / rms(W) whatever its gradient; a matrix initialised small on purpose (GPT-2's
    residual projections) moves by a large fraction of itself by design. The median matrix's ratio
    says how large the learning rate is against the weights' typical scale."""
    return _median_update(rec, h) if int(rec.get("step", -1)) == 0 else {}


def _eps(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    v = (rec.get("optimizer") or {}).get("eps_share")
    return {"optimizer": float(v)} if _finite(v) else {}


def _underflow(rec: dict[str, Any], h: dict[str, Any]) -> dict[str, float]:
    dtypes = rec.get("dtypes") or {}
    out = {}
    for site, st in (rec.get("stats") or {}).items():
        z = st.get("grad_zero")
        if dtypes.get(site) in LOW_PRECISION and _finite(z) and (h.get("kinds") or {}).get(site) != "logits":
            out[site] = float(z)
    return out


def _headroom(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    """max |activation| / the largest finite of the site's format, for sites in float16."""
    dtypes = rec.get("dtypes") or {}
    out = {}
    for site, st in (rec.get("stats") or {}).items():
        top, a = LOW_PRECISION.get(dtypes.get(site)), st.get("fwd_absmax")
        if dtypes.get(site) == "float16" and _finite(a):
            out[site] = float(a) / top
    return out


def _init(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    """The factor between the block matrices' std and their declared init's (either way), at step 0."""
    d = (rec.get("init") or {}).get("drift")
    return {"model": max(d, 1.0 / d)} if _finite(d) and d > 0 else {}


def _peak(rec: dict[str, Any], _h: dict[str, Any]) -> dict[str, float]:
    return {site: float(st["fwd_peak"]) for site, st in (rec.get("stats") or {}).items() if _finite(st.get("fwd_peak"))}


SIGNALS: dict[str, Signal] = {s.name: s for s in (
    Signal("attention_logits", _attention, "attn_logit", "high", "max |attention logit|",
           "attention logits are growing (Dehghani et al. 2023; Wortsman et al. 2023): the softmax "
           "saturates and the attention collapses onto single keys",
           "normalise queries and keys (qk-norm: ModelConfig(qk_norm=\"rms\")) or lower the learning rate"),
    Signal("attention_entropy", _entropy, "attn_entropy", "low", "attention entropy / its causal maximum",
           "attention entropy collapse (Zhai et al. 2023): rows put nearly all their weight on one key",
           "qk-norm (ModelConfig(qk_norm=\"rms\")), a lower learning rate or a longer warm-up"),
    Signal("log_z", _logits("logz_mean"), "logz_limit", "high", "|mean log Z| of the output rows",
           "the output logits' log-partition is drifting (Wortsman et al. 2023): the softmax of the "
           "head loses precision and the loss can diverge",
           "add a z-loss (1e-4 x mean (log Z)^2: TrainOptions(z_loss=1e-4), tinylm.functional.z_loss) "
           "or weight decay on the head"),
    Signal("output_logits", _logits("max_logit"), "logit_limit", "high", "max |output logit|",
           "the output logits are growing (Wortsman et al. 2023)",
           "add a z-loss (TrainOptions(z_loss=1e-4)) or weight decay, or lower the learning rate"),
    Signal("update_large", _matrices, "update_high", "high", "update ratio ||dW|| / ||W|| per step",
           "each step moves this matrix by a large fraction of its size: the learning rate is too high for it",
           "lower the learning rate or warm it up (a few hundred steps), and clip the gradient norm"),
    Signal("first_update", _first, "update_high", "high", "median matrix update ratio at the first step",
           "the first optimizer step moves the median matrix by a large fraction of its size (Adam's first step "
           "moves every entry by the learning rate): the learning rate is high against the weights' scale and "
           "the next steps may diverge", "warm the learning rate up (a few hundred steps) or lower it",
           persist=False),
    Signal("update_small", _median_update, "update_low", "low", "median matrix update ratio per step",
           "the updates are too small against the weights: the run stalls",
           "raise the learning rate, or lower Adam's eps if it dominates sqrt(v)"),
    Signal("adam_epsilon", _eps, "eps_share", "high", "share of Adam entries with sqrt(v_hat) < eps",
           "Adam's eps dominates its denominator (Wortsman et al. 2023): the updates shrink with the "
           "gradient and the run stalls", "lower Adam's eps (1e-8, or 1e-15 for very small gradients)",
           share=True, persist=False),
    Signal("underflow", _underflow, "underflow_share", "high", "share of zero gradient entries",
           "gradients underflow to zero in low precision (Micikevicius et al. 2018)",
           "scale the loss (torch.amp.GradScaler) or train in bfloat16", share=True, persist=False),
    Signal("overflow_ahead", _headroom, "overflow_headroom", "high", "max |activation| / float16's largest",
           "activations approach float16's largest finite value: an overflow to inf is near",
           "train in bfloat16, or keep this site in float32", persist=False),
    Signal("init_scale", _init, "init_drift", "high", "block matrices' std / their declared init's (either way)",
           "the weights start far from the scale their init scheme declares: the activations and attention "
           "logits start too large (or too small) and the run trains far worse",
           "re-initialise with the declared scheme (tinylm.init.apply), or declare the scheme you used",
           persist=False),
    Signal("massive", _peak, "massive_ratio", "high", "max |x| / median |x|",
           "massive activations (Sun et al. 2024): a few features dwarf the rest; low-precision formats "
           "lose them or overflow", "keep the residual stream in float32 or bfloat16; check the norms"),
)}


#: one-sided normal quantile of the stall test at a false-alarm rate of 1e-6 (scipy.stats.norm.isf(1e-6))
_Z_STALL = 4.753424308822899
#: the signals that name a stall's cause: a stall is reported only beside one of them
_STALL_CAUSES = ("update_small", "adam_epsilon", "underflow")


def loss_trend(history: dict[str, Any], step: int, window: int) -> tuple[float, float] | None:
    """(slope, its standard error) of the ordinary least-squares line through the finite losses
    logged at the last ``window`` steps up to ``step``; None with fewer than ``window`` // 2 of them."""
    series = history.get("series") or {}
    steps, losses = series.get("step") or [], series.get("loss") or []
    pts = []
    for j in range(len(steps) - 1, -1, -1):  # from the newest: the steps are logged in order
        t = steps[j]
        if t <= step - window:
            break
        if t <= step and _finite(losses[j]):
            pts.append((t, losses[j]))
    if len(pts) < max(3, window // 2):
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    stt = sum((t - mt) ** 2 for t, _ in pts)
    if stt == 0:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in pts) / stt
    resid = sum((v - mv - slope * (t - mt)) ** 2 for t, v in pts)
    return slope, math.sqrt(resid / (n - 2) / stt)


def _stalled(history: dict[str, Any], values: dict[str, dict[str, float]], step: int, th: Thresholds
             ) -> Alert | None:
    """A stall at ``step``: the loss has not fallen over the last ``plateau_steps`` steps (its fitted
    slope is not below zero at the false-alarm rate 1e-6: slope > -4.75 standard errors) while a
    signal that stalls training is past its threshold (:data:`_STALL_CAUSES`)."""
    causes = [n for n in _STALL_CAUSES if any(_past(SIGNALS[n], v, _limit(SIGNALS[n], th)) for v in values.get(n, {}).values())]
    trend = loss_trend(history, step, int(th.plateau_steps)) if causes else None
    if trend is None or trend[0] < -_Z_STALL * trend[1]:
        return None
    slope, se = trend
    sig = SIGNALS[causes[0]]
    fall = -slope * th.plateau_steps
    t = slope / se if se > 0 else math.inf
    message = (f"step {step}: stall: the loss fell only {fall:.3g} over the last {int(th.plateau_steps)} steps "
               f"(slope {slope:.3g} +- {se:.2g} per step: t = {t:.2f}, not below zero at a false-alarm rate of "
               f"1e-6, t > -{_Z_STALL:.2f}) while {causes[0]} is past its threshold; cause: {sig.cause}; fix: {sig.fix}")
    return Alert(step, "warn", "stall", None, slope, -_Z_STALL * se, 0, step, sig.cause, sig.fix,
                 f"the loss is not falling; {', '.join(causes)} past threshold", message)


def _limit(sig: Signal, th: Thresholds) -> float:
    """The threshold value of a signal: overflow_ahead's is the headroom's reciprocal (a fraction of the format's top)."""
    v = float(getattr(th, sig.threshold))
    return 1.0 / v if sig.name == "overflow_ahead" else v


def _fail_limit(sig: Signal, limit: float) -> float:
    if sig.share:
        return (limit + 1.0) / 2.0
    if sig.name == "overflow_ahead":
        return 1.0 / 2.0  # within a factor 2 of the format's largest finite
    if sig.name == "init_scale":
        return limit * limit  # as diagnose's init check: past the threshold squared
    return limit * FAIL_FACTOR if sig.worse == "high" else limit / FAIL_FACTOR


def _past(sig: Signal, value: float | None, limit: float) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value > limit if sig.worse == "high" else value < limit


def signal_values(history: dict[str, Any], k: int) -> dict[str, dict[str, float]]:
    """{signal: {site: value}} at record k (signals not measured there are absent), and under
    "zero_gradient" the exact-zero shares the baseline rule reads (:func:`.baseline.dense_zeros`):
    everything the rules read of a record, computed once per record."""
    rec = history["records"][k]
    out = {}
    for name, sig in SIGNALS.items():
        got = sig.read(rec, history)
        if got:
            out[name] = got
    zeros = dense_zeros(rec, history)
    if zeros:
        out["zero_gradient"] = zeros
    return out


def _rising(sig: Signal, series: list[float | None]) -> int:
    """Records in a row, ending at the last, at which the value moved the bad way."""
    n = 0
    for a, b in zip(reversed(series[:-1]), reversed(series[1:])):
        if a is None or b is None or not (b > a if sig.worse == "high" else b < a):
            break
        n += 1
    return n


def _ruled_out(values: dict[str, dict[str, float]], th: Thresholds, skip: str) -> str:
    """The signals measured here and within their thresholds, and those not measured, in words."""
    within, unmeasured = [], []
    for name, sig in SIGNALS.items():
        if name == skip:
            continue
        got = values.get(name)
        if not got:
            unmeasured.append(name)
            continue
        limit = _limit(sig, th)
        if not any(_past(sig, v, limit) for v in got.values()):
            worst = max(got.values()) if sig.worse == "high" else min(got.values())
            within.append(f"{name} {worst:.3g}")
    text = "within thresholds: " + (", ".join(within) or "none")
    return text + ("; not measured: " + ", ".join(unmeasured) if unmeasured else "")


def _judge_site(sig: Signal, series: list[float | None], th: Thresholds) -> tuple[str, int] | None:
    """(severity, index where its run of past records began) when the last value of ``series``
    should be reported, else None. ``series``: the site's values at the records up to k that
    :func:`precursor_alerts` looks back on."""
    p, limit = (int(th.early_persist) if sig.persist else 1), _limit(sig, th)
    run = 0
    for v in reversed(series):
        if not _past(sig, v, limit):
            break
        run += 1
    if run == 0:
        return None
    begun = len(series) - run
    fail = _fail_limit(sig, limit)
    now_fail = _past(sig, series[-1], fail)
    was_fail = any(_past(sig, v, fail) for v in series[begun:-1])
    if now_fail and not was_fail:  # past the fail level: at once, whatever the persistence
        return "fail", begun
    if run == p and not was_fail:
        return "warn", begun
    return None


def precursor_alerts(history: dict[str, Any], k: int, thresholds: Thresholds | None = None,
                     values: list[dict[str, dict[str, float]]] | None = None, window: Window | None = None
                     ) -> list[Alert]:
    """The precursor alerts first due at record k of ``history``.

    Args:
        history: a watch history dict.
        k: the index of the record judged (its earlier records are the reference).
        thresholds: the thresholds (None: the history's own, else the defaults).
        values: :func:`signal_values` of records 0..k (or more) when already computed (None:
            computed here); only the last :data:`LOOKBACK` up to k are read.
        window: their :class:`~diagnostics.judge.baseline.Window` of :data:`LOOKBACK` records
            ending at k, where the caller keeps one as the records come (None: made here).

    Returns:
        The alerts of record k, most severe first, then in :data:`SIGNALS` order.
    """
    from .over_time import thresholds_of

    th = thresholds_of(history, thresholds)
    values = values if values is not None else [signal_values(history, j) for j in range(k + 1)]
    lo = max(0, k + 1 - LOOKBACK)
    window = window if window is not None else Window.of(values[lo:k + 1], LOOKBACK)
    steps = [int(r["step"]) for r in history["records"][lo:k + 1]]
    out: list[Alert] = []
    stall = _stalled(history, values[k], steps[-1], th)
    if stall is not None and not _stalled_before(history, values, k, th):
        out.append(stall)
    for name, sig in SIGNALS.items():
        for site, series in window.series(name).items():
            due = _judge_site(sig, series, th)
            if due is not None:
                out.append(_alert(history, sig, site, series, steps, due, th, values[k]))
    out += [Alert(**a) for a in zero_alerts(history, k, th, lo, values, window)
            + growth_alerts(history, k, th, lo, window)]
    out += [Alert(**a) for a in precision_alerts(history, k)]  # a GEMM's SQNR against its own first record
    return sorted(out, key=lambda a: a.severity != "fail")


def _stalled_before(history: dict[str, Any], values: list[dict[str, dict[str, float]]], k: int, th: Thresholds
                    ) -> bool:
    """Whether the record before k was already stalled (a stall is reported when it begins)."""
    return k > 0 and _stalled(history, values[k - 1], int(history["records"][k - 1]["step"]), th) is not None


def _alert(history: dict[str, Any], sig: Signal, site: str, series: list[float | None], steps: list[int],
           due: tuple[str, int], th: Thresholds, here: dict[str, dict[str, float]]) -> Alert:
    severity, begun = due
    value, limit = float(series[-1]), _limit(sig, th)
    rising = _rising(sig, series)
    cause, fix = sig.cause, sig.fix
    if sig.name in ("update_large", "first_update") and history.get("norm") == "post":
        cause += " (a post-norm model without warm-up, Xiong et al. 2020)"
        fix = "warm the learning rate up (post-norm needs it, Xiong et al. 2020) or move to pre-norm"
    ruled = _ruled_out(here, th, sig.name)
    cmp = ">" if sig.worse == "high" else "<"
    shown = site[:-len(".probs")] if sig.name.startswith("attention") and site.endswith(".probs") else site
    where = "" if site in ("model", "logits", "optimizer") else f" at {shown}"
    trend = f"rising for {rising} record{'s' if rising != 1 else ''}" if rising else "not rising"
    message = (f"step {steps[-1]}: {sig.name}{where}: {sig.what} = {value:.3g} {cmp} {limit:.3g} since step "
               f"{steps[begun]} ({trend}); cause: {cause}; fix: {fix}; {ruled}")
    return Alert(steps[-1], severity, sig.name, None if where == "" else site, value, limit, rising,
                 steps[begun], cause, fix, ruled, message)


def all_precursor_alerts(history: dict[str, Any], thresholds: Thresholds | None = None) -> list[Alert]:
    """Every precursor alert of a history, record by record (what a watch raised as it went)."""
    records = history.get("records") or []
    values = [signal_values(history, j) for j in range(len(records))]
    out: list[Alert] = []
    window = Window(LOOKBACK)
    for k in range(len(records)):
        window.add(values[k])
        out += precursor_alerts(history, k, thresholds, values, window)
    return out


#: the cause and fix of each verdict over time (:mod:`diagnostics.judge.over_time`) as an alert
_VERDICT_WORDS = {
    "non_finite": ("a NaN or inf appeared in this tensor or its gradient",
                   "find the first site that went non-finite (named here); in float16: scale the loss or "
                   "train in bfloat16; otherwise lower the learning rate and clip the gradient norm"),
    "exploding": ("this site's activation variance grew past its threshold over its own lowest earlier value",
                  "lower the learning rate or warm it up, clip the gradient norm; the precursor alerts "
                  "before this one say what grew first"),
    "vanishing": ("the gradient reaching this site shrank far below its own earlier highest",
                  "check the residual path and the norms; a gradient that recovers later is benign"),
}


def verdict_alert(history: dict[str, Any], rec: dict[str, Any], row: dict[str, Any], th: Thresholds
                  ) -> Alert | None:
    """A verdict over time (a row of :func:`diagnostics.judge.over_time.record_verdicts`:
    non_finite, exploding or vanishing) as an :class:`Alert`, with its cause told apart where the
    record shows it: a vanishing gradient made of zeros in float16 or bfloat16 is underflow, one
    made of zeros in another dtype a cut (zero_gradient), and one in a post-norm model is the
    norms' shrinkage. None for a vanishing gradient of the attention scores that is not
    underflow: sharpening attention shrinks it in healthy runs (the attention signals judge that
    layer), so it stays a verdict row and is not alerted."""
    site, verdict = row["site"], row["verdict"]
    cause, fix = _VERDICT_WORDS[verdict]
    signal = verdict
    if verdict == "vanishing":
        st = (rec.get("stats") or {}).get(site) or {}
        dtype = (rec.get("dtypes") or {}).get(site)
        zero = st.get("grad_zero")
        if dtype in LOW_PRECISION and _finite(zero) and zero > th.underflow_share:
            signal = "underflow"
            cause = (f"{zero:.1%} of its gradient entries are exactly zero in {dtype}: the gradient "
                     "underflows (Micikevicius et al. 2018), it does not vanish")
            fix = SIGNALS["underflow"].fix
        elif _finite(zero) and zero > th.underflow_share:  # zeros in any other dtype: a cut, not a vanishing
            signal = "zero_gradient"
            cause = (f"{zero:.1%} of its gradient entries are exactly zero in {dtype or 'its dtype'}: the gradient is "
                     "cut on its way here (underflow through a cast to float16, a dead branch or a mask), it does "
                     "not vanish")
            fix = "find the cast, gate or mask between this site and the sites above it that keep their gradient"
        elif site.rsplit(".", 1)[-1] in ("scores", "probs"):
            return None
        elif history.get("norm") == "post":
            cause = ("post-norm: each block's norm rescales the gradient on its way down, so the lower "
                     "layers' gradients shrink at the start of training (Xiong et al. 2020)")
            fix = "warm the learning rate up, or move to pre-norm"
    severity = "fail" if verdict in ("non_finite", "exploding") else "warn"
    value, threshold = float(row["value"]), float(row["threshold"])
    message = (f"step {row['step']}: {signal} at {site}: {row['stat']} = {value:.3g} (threshold {threshold:.3g}); "
               f"cause: {cause}; fix: {fix}")
    return Alert(int(row["step"]), severity, signal, site, value, threshold, 0, int(row["step"]), cause, fix, "",
                 message)
