"""The watch's history: its stored format, its checks, its tidy rows, and :class:`History`.

The history is a dict of plain lists, dicts, floats, ints and strings (so
``torch.load(weights_only=True)`` reads it back), of this shape (version 1):

    {"format": "tinylm-watch", "version": 1, "watch_every": K, "spike_factor": f,
     "sites": [site, ...],                                    # forward order
     "norm": "pre" | "post" | "none" | None,                  # the model's norm placement
     "kinds": {site: kind},                                   # tensor kinds (see diagnostics.result)
     "model": {"scheme", "depth", "width"},                   # init scheme, num_layers, d_model (or None)
     "thresholds": {name: value},                             # Thresholds.to_dict() of the watch
     "series": {"step": [...], "loss": [...], "lr": [...], "grad_norm": [...]},   # every step
     "records": [{"step": t, "reason": "interval" | "spike" | "nonfinite",
                  "loss": ..., "lr": ..., "grad_norm": ...,
                  "stats": {site: {"count", "fwd_mean", "fwd_var", "fwd_absmax", "fwd_nonfinite",
                                   "grad_mean", "grad_var", "grad_absmax", "grad_nonfinite",
                                   ["fwd_zero", "grad_zero", "grad_fp16_under", "grad_bf16_under",
                                    "fwd_peak"]}},
                  "attention": {probs site: {"entropy_mean", "saturated",
                                             ["max_logit", "entropy_ceiling", "rows"]}},
                  ["logits": {"logz_mean", "logz_std", "logz_absmax", "max_logit"},]
                  "update_ratio": {parameter: r},
                  ["optimizer": {"eps_share", "alignment", "alignment_min"}],
                  ["dtypes": {site: "float16" | "bfloat16" | "float32" | ...}],
                  ["init": {"drift"}],
                  ["precision": {"tokens", "modules": {module: {...}}}]}, ...],  # watch_precision
     "events": [{"step", "kind", "site", "stat", "moved_at", "message"}, ...]}

"kinds", "model" and "thresholds" are optional: a history without them reads the same,
with kind, scheme, depth and width None in its rows and the default thresholds. So are the
keys in [brackets] (:data:`SIGNAL_KEYS`, :data:`ATTENTION_SIGNALS`, "logits"; the watch's
precursor signals, :mod:`diagnostics.measure.signals`; a record's "optimizer" is there when
the watch was given the optimizer: its figures of that step, :mod:`diagnostics.measure.optimizer`;
"dtypes" names the format each site's output had, which its gradient is computed in; "init",
in a run's record of step 0 only, the median block matrix's std over its declared init's),
each a number where present:

    fwd_zero, grad_zero            fraction of exact zeros among the entries (Moments.frac_zero)
    grad_fp16_under, grad_bf16_under   fraction nonzero and below 2^-14 / 2^-126
    fwd_peak                       max|x| / median|x| of a block output or the head (only there;
                                   NaN when the median is 0)
    max_logit (attention)          largest |attention logit| over the unmasked entries
    entropy_ceiling                mean over the measured rows of ln(keys the row may attend to)
    rows                           query rows measured
    logz_mean, logz_std, logz_absmax   of log Z_t = logsumexp of the head's row t of logits
    max_logit (logits)             largest |output logit|

The history as tidy rows of the one result schema (:func:`to_rows`, :func:`to_frame`):
per record and site, the moments in each direction (statistics "count", "mean", "var",
"max_abs", "frac_nonfinite", and where recorded "frac_zero" (both directions),
"frac_fp16_underflow", "frac_bf16_underflow" (backward) and "peak_ratio" (forward), with the
verdict of that direction at that record); per record, each attention layer's "entropy_mean",
"saturated_frac" and where recorded "max_logit", "entropy_ceiling" and "rows" (direction
forward); the head's "logz_mean", "logz_std", "logz_absmax" and "max_logit" (name None, kind
"logits", direction forward); each parameter's "update_ratio"
(kind "parameter"); the optimizer's "eps_share", "alignment" and "alignment_min" (kind
"optimizer", name None); per logged step, the model's "loss", "lr" and "grad_norm" (name None).

The verdicts over time are :mod:`diagnostics.judge.over_time`'s; :class:`History` computes
them once and keeps them, so that whatever draws a history only reads them.
"""

from __future__ import annotations

import math
from typing import Any

from tinylm.errors import TinyLMError

from ..judge.over_time import NOT_MEASURED, first_departure, first_mover, measured, thresholds_of, verdicts
from ..judge.verdicts import Thresholds
from ..result import Row, frame

__all__ = [
    "FORMAT",
    "VERSION",
    "STAT_KEYS",
    "OPTIMIZER_KEYS",
    "History",
    "new_history",
    "site_stats",
    "attention_stats",
    "logits_stats",
    "SIGNAL_KEYS",
    "ATTENTION_SIGNALS",
    "LOGITS_KEYS",
    "check_history",
    "thresholds_of",
    "loss_summary",
    "to_rows",
    "step_rows",
    "record_rows",
    "to_frame",
]

FORMAT, VERSION = "tinylm-watch", 1
STAT_KEYS = ("count", "fwd_mean", "fwd_var", "fwd_absmax", "fwd_nonfinite",
             "grad_mean", "grad_var", "grad_absmax", "grad_nonfinite")
OPTIMIZER_KEYS = ("eps_share", "alignment", "alignment_min")  # a record's "optimizer" figures
# a record's key -> (direction, statistic) of the tidy row
_ROW_OF = {"fwd_mean": ("forward", "mean"), "fwd_var": ("forward", "var"), "fwd_absmax": ("forward", "max_abs"),
           "fwd_nonfinite": ("forward", "frac_nonfinite"), "grad_mean": ("backward", "mean"),
           "grad_var": ("backward", "var"), "grad_absmax": ("backward", "max_abs"),
           "grad_nonfinite": ("backward", "frac_nonfinite"),
           "fwd_zero": ("forward", "frac_zero"), "fwd_peak": ("forward", "peak_ratio"),
           "grad_zero": ("backward", "frac_zero"), "grad_fp16_under": ("backward", "frac_fp16_underflow"),
           "grad_bf16_under": ("backward", "frac_bf16_underflow")}
#: the optional per-site keys of a record's stats (the watch's precursor signals)
SIGNAL_KEYS = ("fwd_zero", "grad_zero", "grad_fp16_under", "grad_bf16_under", "fwd_peak")
#: the optional keys of a record's attention layer, and of its "logits"
ATTENTION_SIGNALS = ("max_logit", "entropy_ceiling", "rows")
LOGITS_KEYS = ("logz_mean", "logz_std", "logz_absmax", "max_logit")


# --------------------------------------------------------------------------- building one


def new_history(model: Any, sites: list[str], every: int, spike_factor: float) -> dict[str, Any]:
    """An empty history (no step, record or event yet) for ``model``'s ``sites``, recorded every
    ``every`` steps with the spike alarm at ``spike_factor``; norm, kinds and model come from the
    model (its tinylm config when it has one, else None and kind "module")."""
    from ..measure.probe import instrument_points

    config = getattr(model, "config", None)
    kinds = instrument_points(model)
    return {"format": FORMAT, "version": VERSION, "watch_every": every,
            "spike_factor": spike_factor, "sites": list(sites),
            "norm": getattr(config, "norm", None),
            "kinds": {s: kinds.get(s, "module") for s in sites},
            "model": {"scheme": getattr(config, "init", None),
                      "depth": getattr(config, "num_layers", None),
                      "width": getattr(config, "d_model", None)},
            "series": {"step": [], "loss": [], "lr": [], "grad_norm": []},
            "records": [], "events": []}


def site_stats(stats: Any, site: str, peak: float | None = None) -> dict[str, float]:
    """One site's entry of a record ({key: value} for :data:`STAT_KEYS` and :data:`SIGNAL_KEYS`)
    from a probe's ``ProbeStats`` (NaN where a direction was not measured; count 0 where the
    forward was not, which the verdicts read as "not_measured"). fwd_zero, grad_zero: the
    fraction of exact zeros; grad_fp16_under, grad_bf16_under: the fraction nonzero below
    2^-14 / 2^-126 (:class:`~diagnostics.measure.moments.Moments`); fwd_peak = ``peak``
    (max|x| / median|x|, :mod:`diagnostics.measure.signals`), only when given (the residual
    stream and the head)."""
    out: dict[str, float] = {} if peak is None else {"fwd_peak": float(peak)}
    for direction, prefix in (("forward", "fwd"), ("backward", "grad")):
        m = stats.tensors.get((site, direction))
        if m is None:
            out.update({f"{prefix}_{k}": math.nan for k in ("mean", "var", "absmax", "nonfinite", "zero",
                                                              "fp16_under", "bf16_under")})
            continue
        if prefix == "fwd":
            out["count"] = int(m.n_total)
        out[f"{prefix}_mean"] = float(m.mean) if m.count else math.nan
        out[f"{prefix}_var"] = float(m.var)
        out[f"{prefix}_absmax"] = float(m.max_abs) if m.count else math.nan
        out[f"{prefix}_nonfinite"] = float(m.frac_nonfinite)
        measured = m.n_total > 0
        out[f"{prefix}_zero"] = float(m.frac_zero) if measured else math.nan
        out[f"{prefix}_fp16_under"] = float(m.frac_fp16_underflow) if measured else math.nan
        out[f"{prefix}_bf16_under"] = float(m.frac_bf16_underflow) if measured else math.nan
    out.setdefault("count", 0)
    return {k: out[k] for k in (*STAT_KEYS, *SIGNAL_KEYS) if k in out}


def attention_stats(stats: Any, signals: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """A record's "attention" entry from a probe's ``ProbeStats``: {probs site: {entropy_mean,
    saturated, rows}}, with ``signals`` ({probs site: {max_logit, entropy_ceiling}}, from
    :meth:`diagnostics.measure.signals.Signals.read`) also max_logit and entropy_ceiling (NaN for
    a layer they lack)."""
    out = {}
    for name, a in stats.attention.items():
        out[name] = {"entropy_mean": float(a.entropy_mean), "saturated": float(a.saturated_frac), "rows": float(a.rows)}
        if signals is not None:
            extra = signals.get(name, {})
            out[name].update({k: float(extra.get(k, math.nan)) for k in ("max_logit", "entropy_ceiling")})
    return out


def logits_stats(moments: Any, max_logit: float) -> dict[str, float]:
    """A record's "logits" entry from the :class:`~diagnostics.measure.moments.Moments` of the head's
    log Z_t = logsumexp_j z_tj over its rows t and the largest |z|: {logz_mean, logz_std,
    logz_absmax, max_logit} (NaN where no row was finite)."""
    some = moments.count > 0
    return {"logz_mean": float(moments.mean) if some else math.nan, "logz_std": float(moments.std),
            "logz_absmax": float(moments.max_abs) if some else math.nan, "max_logit": float(max_logit)}


# --------------------------------------------------------------------------- the checks


def _is_number(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _header_problem(h: dict[str, Any]) -> str | None:
    """What is wrong with the parts of a history outside its records and events (None: nothing)."""
    if h.get("format") != FORMAT:
        return f"its format is {h.get('format')!r}, not {FORMAT!r}"
    if h.get("version") != VERSION:
        return f"its version is {h.get('version')!r}; this tinylm reads version {VERSION}"
    sites = h.get("sites")
    if not isinstance(sites, list) or not all(isinstance(x, str) for x in sites):
        return "'sites' is not a list of module names"
    series = h.get("series")
    if not isinstance(series, dict) or not all(isinstance(series.get(k), list) for k in ("step", "loss", "lr", "grad_norm")):
        return "'series' lacks the lists step, loss, lr and grad_norm"
    if len({len(series[k]) for k in ("step", "loss", "lr", "grad_norm")}) != 1:
        return "the lists of 'series' differ in length"
    if not all(_is_int(t) for t in series["step"]) or not all(
            _is_number(x) for k in ("loss", "lr", "grad_norm") for x in series[k]):
        return "'series' holds a value that is not a number"
    for k in ("kinds", "model", "thresholds"):
        if k in h and h[k] is not None and not isinstance(h[k], dict):
            return f"'{k}' is not a dict"
    if not all(isinstance(a, str) and isinstance(b, str) for a, b in (h.get("kinds") or {}).items()):
        return "'kinds' is not {site: kind}"
    model = h.get("model") or {}
    if not (isinstance(model.get("scheme"), (str, type(None)))
            and all(model.get(k) is None or _is_int(model.get(k)) for k in ("depth", "width"))):
        return "'model' is not {scheme: name, depth: int, width: int}"
    if h.get("thresholds") is not None:
        try:
            Thresholds.from_dict(h["thresholds"])
        except (TinyLMError, TypeError) as e:
            return f"'thresholds' does not read: {e}"
    return None


def _record_problem(rec: Any, where: str) -> str | None:
    """What is wrong with one record (None: nothing); ``where`` names it in the message."""
    if not isinstance(rec, dict) or not _is_int(rec.get("step")):
        return f"{where} is not a record with an integer step"
    if not all(_is_number(rec.get(k)) for k in ("loss", "lr", "grad_norm")):
        return f"{where} holds a loss, lr or grad_norm that is not a number"
    stats = rec.get("stats")
    if not isinstance(stats, dict) or not all(
            isinstance(site, str) and isinstance(st, dict) and all(_is_number(st.get(k)) for k in STAT_KEYS)
            and all(_is_number(st[k]) for k in SIGNAL_KEYS if k in st) for site, st in stats.items()):
        return f"{where}.stats is not {{site: {{{', '.join(STAT_KEYS[:2])}, ...: number}}}}"
    for part, keys in (("attention", ("entropy_mean", "saturated")), ("update_ratio", None)):
        value = rec.get(part) or {}
        if not isinstance(value, dict):
            return f"{where}.{part} is not a dict"
        for name, v in value.items():
            ok = (isinstance(v, dict) and all(_is_number(v.get(k)) for k in keys)
                  and all(_is_number(v[k]) for k in ATTENTION_SIGNALS if k in v)) if keys else _is_number(v)
            if not isinstance(name, str) or not ok:
                return f"{where}.{part}[{name!r}] is not of the documented shape"
    opt = rec.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and all(_is_number(opt.get(k)) for k in OPTIMIZER_KEYS)):
        return f"{where}.optimizer is not {{{', '.join(OPTIMIZER_KEYS)}: number}}"
    logits = rec.get("logits")
    if logits is not None and not (isinstance(logits, dict) and all(_is_number(logits.get(k)) for k in LOGITS_KEYS)):
        return f"{where}.logits is not {{{', '.join(LOGITS_KEYS)}: number}}"
    init = rec.get("init")
    if init is not None and not (isinstance(init, dict) and all(_is_number(v) for v in init.values())):
        return f"{where}.init is not {{drift: number}}"
    dtypes = rec.get("dtypes")
    if dtypes is not None and not (isinstance(dtypes, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in dtypes.items())):
        return f"{where}.dtypes is not {{site: dtype name}}"
    return None


def _history_problem(h: Any) -> str | None:
    """What makes ``h`` not a watch history of the documented shape (None: it is one)."""
    if not isinstance(h, dict):
        return f"it is a {type(h).__name__}, not a dict"
    why = _header_problem(h)
    if why:
        return why
    records, events = h.get("records"), h.get("events")
    if not isinstance(records, list) or not isinstance(events, list):
        return "'records' or 'events' is not a list"
    for i, rec in enumerate(records):
        why = _record_problem(rec, f"records[{i}]")
        if why:
            return why
    if not all(isinstance(e, dict) for e in events):
        return "'events' holds an entry that is not a dict"
    return None


def check_history(history: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(history, None) when ``history`` (as read from a checkpoint) has the documented shape;
    (None, why) otherwise: a partial, damaged or unknown history is skipped, never fatal."""
    if history is None:
        return None, None
    why = _history_problem(history)
    return (None, why) if why else (history, None)


def loss_summary(history: dict[str, Any]) -> tuple[int, float, float]:
    """(k, mean loss of the first k steps, mean of the last k), k = min(10, steps // 4) (at least 1);
    NaN means when no step was logged. Non-finite losses count (a diverged run's mean is inf/NaN)."""
    losses = (history.get("series") or {}).get("loss") or []
    if not losses:
        return 0, math.nan, math.nan
    k = max(1, min(10, len(losses) // 4))
    return k, sum(losses[:k]) / k, sum(losses[-k:]) / k


# --------------------------------------------------------------------------- tidy rows


def _num(x: Any) -> float:
    """A stored number as a float (None and the JSON strings of non-finite values included)."""
    if x is None:
        return math.nan
    return float(x)


def _rows_of(history: dict[str, Any], bad_rows: list[dict[str, Any]], run: str | None) -> list[Row]:
    """:func:`to_rows` given the history's non-ok verdict rows."""
    bad = {(r["step"], r["site"]): r for r in bad_rows}
    rows: list[Row] = []
    for rec in history.get("records") or []:
        rows += record_rows(history, rec, bad, run)
    series = history.get("series") or {}
    for k, step in enumerate(series.get("step") or []):
        rows += step_rows(history, step, *((series.get(s) or [])[k] if k < len(series.get(s) or []) else math.nan
                                           for s in ("loss", "lr", "grad_norm")), run=run)
    return rows


def to_rows(history: dict[str, Any], run: str | None = None, thresholds: Thresholds | None = None) -> list[Row]:
    """The history as tidy rows of the one result schema (:class:`diagnostics.result.Row`; see the
    module docstring for which statistics), in record order, then site order, forward before
    backward; then the per-step series. Columns: run = ``run``; step; scheme, depth, width from
    the history's "model" (None in a history stored without it); name, kind, block, direction,
    statistic, value; verdict: the site's verdict at that record in the direction it concerns
    (an exploding or non-finite forward variance on the forward rows, a vanishing or non-finite
    gradient on the backward rows; "ok" on the other direction; "not_measured" on both directions
    of a site that counted no entry at that record; None on rows never judged: attention, logits,
    update ratios, the optimizer's figures, the series). predicted,
    ratio and its interval, valid: None (the watch predicts nothing).
    """
    return _rows_of(history, verdicts(history, thresholds), run)


def step_rows(history: dict[str, Any], step: int, loss: float, lr: float, grad_norm: float,
              run: str | None = None) -> list[Row]:
    """The tidy rows of one logged step: statistics loss, lr and grad_norm (name None)."""
    model = history.get("model") or {}
    common = dict(run=run, scheme=model.get("scheme"), depth=model.get("depth"), width=model.get("width"))
    return [Row(**common, step=step, statistic=stat, value=_num(v))
            for stat, v in (("loss", loss), ("lr", lr), ("grad_norm", grad_norm))]


def record_rows(history: dict[str, Any], rec: dict[str, Any], bad: dict[tuple[int, str], dict[str, Any]],
                run: str | None = None) -> list[Row]:
    """The tidy rows of one record (see :func:`to_rows`); ``bad``: {(step, site): verdict row}
    of its non-ok verdicts."""
    from ..measure.probe import block_index

    model = history.get("model") or {}
    kinds = history.get("kinds") or {}
    common = dict(run=run, scheme=model.get("scheme"), depth=model.get("depth"), width=model.get("width"))
    rows: list[Row] = []
    step = rec["step"]
    for site, st in rec["stats"].items():
        v = bad.get((step, site))
        judged_dir = None if v is None else ("forward" if v["stat"].startswith("fwd") else "backward")
        at = dict(common, step=step, name=site, kind=kinds.get(site), block=block_index(site))
        was_measured = measured(st)
        for direction in ("forward", "backward"):
            verdict = v["verdict"] if judged_dir == direction else ("ok" if was_measured else NOT_MEASURED)
            if "count" in st:
                rows.append(Row(**at, direction=direction, statistic="count", value=_num(st["count"]),
                                verdict=verdict))
            for key, (d, stat) in _ROW_OF.items():
                if d == direction and key in st:
                    rows.append(Row(**at, direction=d, statistic=stat, value=_num(st[key]), verdict=verdict))
    for site, att in (rec.get("attention") or {}).items():
        at = dict(common, step=step, name=site, kind=kinds.get(site, "attn_probs"), block=block_index(site),
                  direction="forward")
        rows.append(Row(**at, statistic="entropy_mean", value=_num(att.get("entropy_mean"))))
        rows.append(Row(**at, statistic="saturated_frac", value=_num(att.get("saturated"))))
        rows += [Row(**at, statistic=k, value=_num(att[k])) for k in ATTENTION_SIGNALS if k in att]
    if isinstance(rec.get("logits"), dict):
        at = dict(common, step=step, kind="logits", direction="forward")
        rows += [Row(**at, statistic=k, value=_num(rec["logits"][k])) for k in LOGITS_KEYS if k in rec["logits"]]
    for param, ratio in (rec.get("update_ratio") or {}).items():
        rows.append(Row(**common, step=step, name=param, kind="parameter", block=block_index(param),
                        statistic="update_ratio", value=_num(ratio)))
    opt = rec.get("optimizer") or {}
    rows += [Row(**common, step=step, kind="optimizer", statistic=k, value=_num(opt[k]))
             for k in OPTIMIZER_KEYS if k in opt]
    from .watch_precision import precision_rows  # a record's per-GEMM SQNR (Watch(precision=...))
    return rows + precision_rows(rec, common)


def to_frame(history: dict[str, Any], run: str | None = None, thresholds: Thresholds | None = None):
    """The tidy pandas DataFrame of :func:`to_rows` (columns and dtypes of :func:`diagnostics.result.frame`)."""
    return frame(to_rows(history, run, thresholds))


# --------------------------------------------------------------------------- History


class History:
    """A watch history (the dict of the module docstring) with its verdicts, judged once.

    The verdicts over time (:func:`diagnostics.judge.over_time.verdicts`) are computed the
    first time any of them is asked for and kept; a renderer reads them here and never judges.
    Should the dict grow afterwards (a running watch appends records), the next question
    judges again, once. ``_repr_html_`` draws the history in a notebook (the loss and the
    residual stream's variances over steps, the first verdict other than ok, the alarms).

    The dict stays the stored form (checkpoints, ``TrainResult.history``): ``History(d).data``
    is ``d`` itself, and ``History(d)[key]`` reads it.

    ``History.read(source)`` reads a run back from what a watch wrote
    (:func:`diagnostics.jobs.history_read.read`) and ``History.compare(a, b)`` puts two runs side
    by side (:func:`diagnostics.jobs.runs_compare.compare_runs`); :mod:`diagnostics.jobs` sets
    both on the class, so that this module imports neither.

    Args:
        history: a dict of the documented shape (else :class:`diagnostics.OptionsError`).
        thresholds: what the verdicts use (None: the history's own, else the defaults;
            :func:`thresholds_of`).
    """

    def __init__(self, history: dict[str, Any], thresholds: Thresholds | None = None):
        from ..options import OptionsError

        why = _history_problem(history)
        if why:
            raise OptionsError(f"history: not a watch history ({why}); pass the dict a Watch or "
                               "tinylm train recorded")
        self.data = history
        self.thresholds = thresholds_of(history, thresholds)
        self._judged_at: int | None = None  # how many records the kept verdicts cover
        self._kept: dict[str, Any] = {}
        #: what ``History.read`` found beside the records: the watch's alerts, its forensics reports,
        #: what reading noticed (lines skipped), the verdicts the record lines carried, the source
        self.alerts: list[Any] = []
        self.forensics: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.stored_verdicts: list[dict[str, Any]] | None = None
        self.source: str | None = None

    def outcome(self) -> dict[str, Any]:
        """What the run came to: {"status": "failed" | "warned" | "ok" | "not judged", "step", "why"}
        (:func:`diagnostics.judge.runs.outcome`, from the kept verdicts and the alerts)."""
        from ..judge.runs import outcome

        return outcome(self.data, self._judgement()["verdicts"], self.alerts)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __repr__(self) -> str:
        return (f"History({len(self.data['series']['step'])} steps, {len(self.data['records'])} records, "
                f"{len(self.data['events'])} alarms)")

    def _judgement(self) -> dict[str, Any]:
        """The kept verdicts, first departure and first departure per site (judged on the first
        call, and again only when the records have grown since; the first mover is added to
        them when first asked for)."""
        n = len(self.data["records"])
        if self._judged_at != n:
            rows = verdicts(self.data, self.thresholds)
            by_site: dict[str, dict[str, Any]] = {}
            for row in rows:
                by_site.setdefault(row["site"], row)
            self._kept = {"verdicts": rows, "first_departure": first_departure(self.data, rows=rows),
                          "by_site": by_site}
            self._judged_at = n
        return self._kept

    def verdicts(self) -> list[dict[str, Any]]:
        """Every non-ok verdict: one row per (record, site) with step, site, verdict, stat, value,
        threshold (:func:`diagnostics.judge.over_time.verdicts`); empty when all is ok."""
        return list(self._judgement()["verdicts"])

    def first_departure(self) -> dict[str, Any] | None:
        """The first verdict other than ok (earliest step, then forward order), or None."""
        return self._judgement()["first_departure"]

    def departures(self) -> dict[str, dict[str, Any]]:
        """{site: its first verdict other than ok} for every site that left ok."""
        return dict(self._judgement()["by_site"])

    def first_mover(self) -> dict[str, Any] | None:
        """The statistic that moved first (:func:`diagnostics.judge.over_time.first_mover`), or None."""
        kept = self._judgement()
        if "first_mover" not in kept:
            kept["first_mover"] = first_mover(self.data, thresholds=self.thresholds)
        return kept["first_mover"]

    def loss_summary(self) -> tuple[int, float, float]:
        """(k, mean loss of the first k steps, of the last k): :func:`loss_summary`."""
        return loss_summary(self.data)

    def to_rows(self, run: str | None = None) -> list[Row]:
        """:func:`to_rows` with the kept verdicts."""
        return _rows_of(self.data, self._judgement()["verdicts"], run)

    def to_frame(self, run: str | None = None):
        """:func:`to_frame` with the kept verdicts (a new DataFrame each call)."""
        return frame(self.to_rows(run))

    def _repr_html_(self) -> str | None:
        from ..display import html

        return html(self)

