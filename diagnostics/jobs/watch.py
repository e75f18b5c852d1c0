"""The watch: per-layer statistics over training steps, kept as moments, never tensors.

Every ``every`` steps (and at once when the loss spikes or is not finite) one
training step runs under the probe (:func:`diagnostics.probe`), which reduces,
in float64, each watched tensor and the gradient of the loss with respect to it:

    count n (entries), mean m = sum x / n', variance v = sum (x - m)^2 / n', absmax = max |x|,
    nonfinite = fraction of NaN/inf entries        (n' = the finite entries)

(attention scores and probabilities over the causal positions only). Around the optimizer step of a recorded step the watch also
measures each parameter's update ratio ||W_after - W_before||_F / ||W_before||_F.

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
                                   "grad_mean", "grad_var", "grad_absmax", "grad_nonfinite"}},
                  "attention": {probs site: {"entropy_mean", "saturated"}},
                  "update_ratio": {parameter: r}}, ...],
     "events": [{"step", "kind", "site", "stat", "moved_at", "message"}, ...]}

"kinds", "model" and "thresholds" are optional: a history without them reads the same,
with kind, scheme, depth and width None in its rows and the default thresholds.

Verdicts over time (:func:`verdicts`) compare each site with its own earlier
records (not with the first alone: a badly initialised model starts far from
healthy, and a healthy one's statistics move while it learns), with the watch
thresholds of :class:`diagnostics.judge.Thresholds` (the one set diagnose
uses too; their defaults and margins are documented there):

    non_finite   a NaN or inf in the tensor or its gradient (any site)
    exploding    forward variance above watch_growth (10^3) x the lowest value it had at an earlier record
    vanishing    gradient variance below the highest value it had at an earlier record / watch_shrink (10^4)
    ok           otherwise

exploding and vanishing judge the sites that reach a computation at their scale
(:func:`judged`): attention scores, logits, and the residual stream unless the
model is pre-norm.

The message on a spike names the site that moved first (:func:`first_mover`): the earliest record
at which a variance rose above watch_move (10) x its lowest earlier value.

The history as tidy rows of the one result schema (:func:`to_rows`, :func:`to_frame`):
per record and site, the moments in each direction (statistics "count", "mean", "var",
"max_abs", "frac_nonfinite", with the verdict of that direction at that record); per
record, each attention layer's "entropy_mean" and "saturated_frac" (direction forward)
and each parameter's "update_ratio" (kind "parameter"); per logged step, the model's
"loss", "lr" and "grad_norm" (name None).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

import tinylm
from tinylm.errors import TinyLMError
from torch import nn

from ..measure.sites import model_sites
from ..integrations.writers import WatchWriter, _json_safe
from ..result import Row, frame
from ..judge.thresholds import Thresholds

__all__ = [
    "Watch",
    "WatchEvent",
    "WatchFailure",
    "WatchStop",
    "WatchWriter",
    "History",
    "FAIL_VERDICTS",
    "find_sites",
    "default_sites",
    "verdicts",
    "first_departure",
    "first_mover",
    "judged",
    "to_rows",
    "to_frame",
    "thresholds_of",
    "loss_summary",
    "write_json",
    "write_csv",
]

FORMAT, VERSION = "tinylm-watch", 1
STAT_KEYS = ("count", "fwd_mean", "fwd_var", "fwd_absmax", "fwd_nonfinite",
             "grad_mean", "grad_var", "grad_absmax", "grad_nonfinite")
# a record's key -> (direction, statistic) of the tidy row
_ROW_OF = {"fwd_mean": ("forward", "mean"), "fwd_var": ("forward", "var"), "fwd_absmax": ("forward", "max_abs"),
           "fwd_nonfinite": ("forward", "frac_nonfinite"), "grad_mean": ("backward", "mean"),
           "grad_var": ("backward", "var"), "grad_absmax": ("backward", "max_abs"),
           "grad_nonfinite": ("backward", "frac_nonfinite")}


def thresholds_of(history: dict[str, Any], thresholds: Thresholds | None = None) -> Thresholds:
    """``thresholds`` when given, else those the history was recorded with, else the defaults."""
    if thresholds is not None:
        if not isinstance(thresholds, Thresholds):
            from ..options import OptionsError

            raise OptionsError(f"thresholds={thresholds!r}: pass a diagnostics.Thresholds")
        return thresholds
    stored = history.get("thresholds") if isinstance(history, dict) else None
    return Thresholds.from_dict(stored) if isinstance(stored, dict) else Thresholds()


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


def _is_number(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _history_problem(h: Any) -> str | None:
    """What makes ``h`` not a watch history of the documented shape (None: it is one)."""
    if not isinstance(h, dict):
        return f"it is a {type(h).__name__}, not a dict"
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
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in series["step"]) or not all(
            _is_number(x) for k in ("loss", "lr", "grad_norm") for x in series[k]):
        return "'series' holds a value that is not a number"
    for k in ("kinds", "model", "thresholds"):
        if k in h and h[k] is not None and not isinstance(h[k], dict):
            return f"'{k}' is not a dict"
    if not all(isinstance(a, str) and isinstance(b, str) for a, b in (h.get("kinds") or {}).items()):
        return "'kinds' is not {site: kind}"
    model = h.get("model") or {}
    if not (isinstance(model.get("scheme"), (str, type(None))) and all(
            model.get(k) is None or (isinstance(model.get(k), int) and not isinstance(model.get(k), bool))
            for k in ("depth", "width"))):
        return "'model' is not {scheme: name, depth: int, width: int}"
    if h.get("thresholds") is not None:
        try:
            Thresholds.from_dict(h["thresholds"])
        except (TinyLMError, TypeError) as e:
            return f"'thresholds' does not read: {e}"
    records, events = h.get("records"), h.get("events")
    if not isinstance(records, list) or not isinstance(events, list):
        return "'records' or 'events' is not a list"
    for i, rec in enumerate(records):
        where = f"records[{i}]"
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            return f"{where} is not a record with an integer step"
        if not all(_is_number(rec.get(k)) for k in ("loss", "lr", "grad_norm")):
            return f"{where} holds a loss, lr or grad_norm that is not a number"
        stats = rec.get("stats")
        if not isinstance(stats, dict) or not all(
                isinstance(site, str) and isinstance(st, dict) and all(_is_number(st.get(k)) for k in STAT_KEYS)
                for site, st in stats.items()):
            return f"{where}.stats is not {{site: {{{', '.join(STAT_KEYS[:2])}, ...: number}}}}"
        for part, keys in (("attention", ("entropy_mean", "saturated")), ("update_ratio", None)):
            value = rec.get(part) or {}
            if not isinstance(value, dict):
                return f"{where}.{part} is not a dict"
            for name, v in value.items():
                ok = (isinstance(v, dict) and all(_is_number(v.get(k)) for k in keys)) if keys else _is_number(v)
                if not isinstance(name, str) or not ok:
                    return f"{where}.{part}[{name!r}] is not of the documented shape"
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


def default_sites(model: nn.Module) -> list[str]:
    """The tensors the watch records, in forward order: ``model_sites(model).watch``.

    A tinylm ``TransformerLM``: token_embeddings; per block i: attn.scores (pre-softmax logits,
    causal entries), attn.probs (also gives the attention entropy and saturation), attn (the
    attention branch), resid_mid, ffn (the FFN branch) and the block's output ``layers.i`` (the
    residual stream); the head (the logits). Any other module: :func:`find_sites`.
    """
    return list(model_sites(model).watch)


def find_sites(model: nn.Module) -> list[str]:
    """The sites of any module, found from its structure alone (:mod:`diagnostics.measure.sites`).

    The embedding tables (every ``nn.Embedding``, in module order); each block of the model's
    block stack (each block's output is the residual stream of a decoder such as GPT-2 or
    Llama); the head (the module whose output is the logits: the last linear module outside
    the blocks whose output width is the vocabulary, or tied to the embedding). A module with
    none of these yields an empty list (pass ``sites=``).
    """
    s = model_sites(model)
    found = [*s.embeddings, *(s.blocks.names if s.blocks is not None else ()), *([s.head] if s.head else [])]
    return list(dict.fromkeys(found))


def describe_sites(sites: list[str]) -> str:
    """A short line saying what is watched: the first and last sites and how many."""
    if not sites:
        return "no sites (pass sites=[module names])"
    shown = sites if len(sites) <= 4 else [sites[0], sites[1], "...", sites[-1]]
    return f"{len(sites)} sites: {', '.join(shown)}"


def _site_stats(stats: Any, site: str) -> dict[str, float]:
    """One site's record from a probe's ProbeStats (NaN where a direction was not measured)."""
    out: dict[str, float] = {}
    for direction, prefix in (("forward", "fwd"), ("backward", "grad")):
        m = stats.tensors.get((site, direction))
        if m is None:
            out.update({f"{prefix}_mean": math.nan, f"{prefix}_var": math.nan, f"{prefix}_absmax": math.nan,
                        f"{prefix}_nonfinite": math.nan})
            continue
        if prefix == "fwd":
            out["count"] = int(m.n_total)
        out[f"{prefix}_mean"] = float(m.mean) if m.count else math.nan
        out[f"{prefix}_var"] = float(m.var)
        out[f"{prefix}_absmax"] = float(m.max_abs) if m.count else math.nan
        out[f"{prefix}_nonfinite"] = float(m.frac_nonfinite)
    out.setdefault("count", 0)
    return {k: out[k] for k in STAT_KEYS}


def _attention_stats(stats: Any) -> dict[str, dict[str, float]]:
    return {name: {"entropy_mean": float(a.entropy_mean), "saturated": float(a.saturated_frac)}
            for name, a in stats.attention.items()}


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _running_extremes(history: dict[str, Any], key: str, fn) -> list[dict[str, float]]:
    """For each record k: {site: fn of the finite positive ``key`` values at records 0..k-1} (absent if none)."""
    out, best = [], {}
    for rec in history.get("records") or []:
        out.append(dict(best))
        for site, st in rec["stats"].items():
            v = st.get(key)
            if _finite(v) and v > 0:
                best[site] = fn(best[site], v) if site in best else v
    return out


def judged(site: str, norm: str | None = None) -> bool:
    """Sites whose growth is judged: the attention scores and the logits (what softmax reads),
    and the residual stream (embedding output, resid_mid, block outputs) unless the model is
    pre-norm (``norm="pre"``: every read of its residual stream goes through an RMSNorm, which
    is scale-invariant, so the stream's scale does not reach any computation). Branch outputs
    (attn, ffn) and attention probabilities are only judged for non-finite values: several
    init schemes start the branches at or near zero, so their growth is learning."""
    if site == tinylm.plan.HEAD or site.rsplit(".", 1)[-1] == "scores":
        return True
    return tinylm.plan.on_stream(site) and norm != "pre"


def _site_verdict(st: dict[str, float], low_fwd: float | None, high_grad: float | None, th: Thresholds,
                  ) -> tuple[str, str | None, float, float]:
    """(verdict, statistic, value, threshold) of one site's record, given its earlier extremes
    (None for a site that is not :func:`judged` or has no earlier record)."""
    if st.get("count", 1) == 0 and not _finite(st.get("fwd_nonfinite")):
        return "ok", None, math.nan, math.nan  # not measured at this record (its forward did not run)
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


def verdicts(history: dict[str, Any], thresholds: Thresholds | None = None) -> list[dict[str, Any]]:
    """One row per (record, site) whose verdict is not ok: step, site, verdict, stat, value, threshold.

    exploding: forward variance > watch_growth x the lowest value the site had at an earlier
    record; vanishing: gradient variance < the highest earlier value / watch_shrink;
    non_finite: any NaN/inf entry in the tensor or its gradient. ``thresholds``: see
    :func:`thresholds_of` (None: the history's own, else the defaults).
    """
    th = thresholds_of(history, thresholds)
    records = history.get("records") or []
    lows = _running_extremes(history, "fwd_var", min)
    highs = _running_extremes(history, "grad_var", max)
    rows = []
    for rec, low, high in zip(records, lows, highs):
        for site, st in rec["stats"].items():
            if st.get("count", 1) == 0 and not _finite(st.get("fwd_nonfinite")):
                continue  # not measured at this record
            j = judged(site, history.get("norm"))
            verdict, key, value, threshold = _site_verdict(st, low.get(site) if j else None,
                                                           high.get(site) if j else None, th)
            if verdict != "ok":
                rows.append({"step": rec["step"], "site": site, "verdict": verdict, "stat": key,
                             "value": value, "threshold": threshold})
    return rows


def first_departure(history: dict[str, Any], thresholds: Thresholds | None = None) -> dict[str, Any] | None:
    """The first (step, site) at which any verdict left ok (earliest step, then forward order), or None."""
    rows = verdicts(history, thresholds)
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
            j = judged(site, history.get("norm"))
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


def _describe_move(m: dict[str, Any]) -> str:
    what = "activation variance" if m["stat"] == "fwd_var" else "gradient variance"
    size = "stopped being finite" if math.isinf(m["factor"]) else f"rose to {m['factor']:.3g}x its lowest earlier value"
    return f"{m['site']} moved first: its {what} {size} at step {m['step']}"


# The watch's verdicts that stop a run (``Watch(stop="raise")``) or set ``Watch.failure``: a NaN or
# inf (in a tensor, a gradient or the loss) and a forward variance grown past watch_growth. A
# vanishing gradient is a warning: training often goes on and recovers. These are the watch's
# own words; where a finding carries a severity, "fail" is this set.
FAIL_VERDICTS = ("non_finite", "exploding")


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


class WatchStop(RuntimeError):
    """Raised by :meth:`Watch.record` at the first fail when the watch was built with
    ``stop="raise"``; ``failure`` holds the :class:`WatchFailure`."""

    def __init__(self, failure: WatchFailure):
        self.failure = failure
        super().__init__(failure.message)


class Watch:
    """Records per-site moments and update ratios during training (see the module docstring).

    In your own loop (any ``nn.Module``; :func:`default_sites` says which tensors)::

        watch = Watch(model, every=50, log_dir="runs/x")
        for t, (x, y) in enumerate(batches):
            with watch.step(t):                      # forward, backward and optimizer step inside
                loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
            watch.record(loss.item(), lr=opt.param_groups[0]["lr"])
        watch.close()

    ``log_dir``: write ``watch.csv`` (tidy rows of the result schema), ``watch.jsonl`` (one
    object a line: steps, records, events) and TensorBoard event files there (the TensorBoard
    ones when the ``tensorboard`` package is installed); ``writers``: more
    :class:`WatchWriter` objects (``reports.watch_live.LivePanel`` draws the live panel).
    ``stop``: None goes on whatever happens; "raise" raises :class:`WatchStop` from
    :meth:`record` at the first fail (:data:`FAIL_VERDICTS`, or a non-finite loss).
    :meth:`record` returns the fail found at its step as a :class:`WatchFailure` (None while
    all is well); ``failure`` keeps the run's first.

    The lower-level protocol (``tinylm.train.train`` and the Hugging Face callback use it):
    ``due(t)`` says whether step t is recorded; run that step's forward and backward inside
    ``capture()``; ``alarm(loss)`` after it says "spike", "nonfinite" or None;
    ``snapshot_params()`` before the optimizer step and ``commit(...)`` after it store the
    record; ``log(...)`` every step. ``every=0`` turns recording off (the loss series and the
    non-finite alarm remain).

    ``thresholds``: a :class:`diagnostics.Thresholds` (None: the defaults), the same object
    diagnose takes; the watch reads its watch_* and spike_* fields. ``spike_factor``, when
    given, replaces the thresholds' own (the training options carry one).
    """

    def __init__(self, model: nn.Module, every: int = 25, spike_factor: float | None = None,
                 sites: list[str] | None = None, history: dict[str, Any] | None = None,
                 on_event: Callable[[WatchEvent], None] | None = None, thresholds: Thresholds | None = None,
                 *, log_dir: str | None = None, writers: list[WatchWriter] | tuple = (), stop: str | None = None):
        from tinylm import validate

        from ..options import OptionsError

        if not isinstance(model, nn.Module):
            raise OptionsError(f"model={type(model).__name__}: the watch needs a torch.nn.Module")
        validate.integer("every", every, low=0, fix="every=N (0 turns recording off)", error=OptionsError)
        if stop not in (None, "raise"):
            raise OptionsError(f"stop={stop!r}: must be None (go on) or \"raise\" (raise WatchStop at the first fail)")
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise OptionsError(f"thresholds={thresholds!r}: pass a diagnostics.Thresholds")
        thresholds = thresholds or Thresholds()
        if spike_factor is not None:
            thresholds = replace(thresholds, spike_factor=float(spike_factor))
        self.thresholds = thresholds
        self.model = model
        self.every = int(every)
        self.spike_factor = thresholds.spike_factor
        names = {n for n, _ in model.named_modules()}
        self.sites = list(sites) if sites is not None else default_sites(model)
        unknown = [s for s in self.sites if s not in names]
        if unknown:
            raise TinyLMError(f"watch site(s) {', '.join(unknown[:3])} are not modules of the model; "
                              "name modules from model.named_modules()")
        self.on_event = on_event
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        config = getattr(model, "config", None)
        history, self.history_problem = check_history(history)  # a damaged history: start a new one
        if history is not None:
            self.history = history
        else:
            from ..measure.probe import instrument_points

            kinds = instrument_points(model)
            self.history = {"format": FORMAT, "version": VERSION, "watch_every": self.every,
                            "spike_factor": self.spike_factor, "sites": list(self.sites),
                            "norm": getattr(config, "norm", None),
                            "kinds": {s: kinds.get(s, "module") for s in self.sites},
                            "model": {"scheme": getattr(config, "init", None),
                                      "depth": getattr(config, "num_layers", None),
                                      "width": getattr(config, "d_model", None)},
                            "series": {"step": [], "loss": [], "lr": [], "grad_norm": []},
                            "records": [], "events": []}
        self.history["thresholds"] = thresholds.to_dict()  # a resumed run judges all its records by these
        self.events: list[WatchEvent] = []
        self._pending: dict[str, dict[str, float]] | None = None
        self._pending_attention: dict[str, dict[str, float]] = {}
        self._ema: float | None = None
        self._n = 0
        self._armed = True
        for loss in self.history["series"]["loss"]:  # a resumed run continues the running loss
            self._update_ema(loss)
        # running extremes of each site's variances over the records so far (the verdicts' reference)
        self._low: dict[str, float] = {}
        self._high: dict[str, float] = {}
        for rec in self.history["records"]:
            self._update_extremes(rec)
        self.stop = stop
        self.failure: WatchFailure | None = None
        self._new_failure: WatchFailure | None = None
        self._open_step: dict[str, Any] | None = None  # the step entered by step() and not yet recorded
        self._force_next = False
        self.writers: list[WatchWriter] = []
        if log_dir is not None:
            from ..integrations.writers import default_writers

            self.writers += default_writers(log_dir, append=bool(self.history["series"]["step"]))
        for w in writers:
            if not isinstance(w, WatchWriter):
                raise OptionsError(f"writers: {type(w).__name__} is not a diagnostics WatchWriter; subclass "
                                   "diagnostics.jobs.watch.WatchWriter")
            self.writers.append(w)
        self._writer_names = [type(w).__name__ for w in self.writers]
        for w in self.writers:
            w.open(self)

    def record_rows(self, record: dict[str, Any], verdicts: list[dict[str, Any]], run: str | None = None) -> list[Row]:
        """The tidy rows of one of this watch's records (:func:`record_rows`), given its non-ok verdicts."""
        return record_rows(self.history, record, {(v["step"], v["site"]): v for v in verdicts}, run)

    def step_rows(self, t: int, loss: float, lr: float, grad_norm: float, run: str | None = None) -> list[Row]:
        """The tidy rows of one logged step (:func:`step_rows`)."""
        return step_rows(self.history, t, loss, lr, grad_norm, run)

    def describe(self) -> str:
        """What the watch watches, in a line (the sites, how often, where it writes)."""
        where = ", ".join(self._writer_names) or "the history only"
        every = f"every {self.every} steps" if self.every else "never (every=0: the loss alone)"
        return f"watching {describe_sites(self.sites)}; recorded {every}; writing to {where}"

    def __repr__(self) -> str:
        n = len(self.history["records"])
        return f"Watch({self.describe()}; {n} record{'' if n == 1 else 's'})"

    def _repr_html_(self) -> str:
        return History(self.history)._repr_html_()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Commit a step left without :meth:`record` and close the writers (files flushed), even
        when that step's record raises :class:`WatchStop`."""
        try:
            self._finish_open()
        finally:
            writers, self.writers = self.writers, []
            for w in writers:
                w.close()

    # ------------------------------------------------------------------- your own loop

    @contextlib.contextmanager
    def step(self, t: int) -> Iterator["Watch"]:
        """Step t of your loop: when it is due (every ``every`` steps, and the step after a
        spike) the forward and backward inside run under the probe, and the parameters are
        copied first so that :meth:`record` gives each one's update ratio (put the optimizer
        step inside the ``with`` or between it and :meth:`record`). Hooks are removed on exit,
        whatever happens."""
        from tinylm import validate

        from ..options import OptionsError

        validate.integer("t", t, low=0, fix="watch.step(t) with the step number t", error=OptionsError)
        self._finish_open()
        recording = self._starts(int(t))
        self._open_step = {"t": int(t), "recording": recording,
                           "before": self.snapshot_params() if recording else {}}
        if recording:
            with self.capture():
                yield self
        else:
            yield self

    def record(self, loss: float | torch.Tensor, lr: float | None = None, grad_norm: float | torch.Tensor | None = None
               ) -> WatchFailure | None:
        """The end of the step entered by :meth:`step`: its loss (a float or a 0-d tensor), learning
        rate and gradient norm (None: not known, kept as NaN). Stores the record when the step
        was recorded, raises the spike and non-finite alarms and writes to the writers.

        Returns the first :class:`WatchFailure` found at this step (None when there is none; a
        fail that persists is returned at each step it is found); with ``stop="raise"`` raises
        :class:`WatchStop` instead. ``failure`` keeps the first of the run.
        """
        if self._open_step is None:
            from ..options import OptionsError

            raise OptionsError("watch.record(...) without a step: call it after `with watch.step(t):`")
        if loss is None:
            from ..options import OptionsError

            raise OptionsError("watch.record(loss=None): pass the step's loss (a float or a 0-d tensor)")
        lr, grad_norm = (math.nan if v is None else float(v) for v in (lr, grad_norm))
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        return self._finish_open(float(loss), lr, grad_norm)

    def _finish_open(self, loss: float | None = None, lr: float = math.nan, grad_norm: float = math.nan
                     ) -> WatchFailure | None:
        """Record the open step (``loss`` None: left without :meth:`record`, kept as NaN and not alarmed on)."""
        open_step, self._open_step = self._open_step, None
        if open_step is None:
            return None
        t = open_step["t"]
        self._end_step(t, loss, lr, grad_norm, open_step["recording"], open_step["before"])
        self.log(t, math.nan if loss is None else loss, lr, grad_norm)
        return self._check_stop()

    def _starts(self, t: int) -> bool:
        """Whether step t is recorded: it is due, or the step before it raised an alarm."""
        recording = self.enabled and (self.due(t) or self._force_next)
        self._force_next = False
        return recording

    def _end_step(self, t: int, loss: float | None, lr: float, grad_norm: float, recording: bool,
                  before: dict[str, torch.Tensor]) -> str | None:
        """After step t's optimizer step: the alarm on its loss (None: no loss known, no alarm),
        its record when ``recording``, an alarm's event (a step not recorded makes the next one
        recorded) and a non-finite loss's failure. Returns the alarm. The series entry is the
        caller's (:meth:`log`)."""
        alarm = None if loss is None else self.alarm(loss)
        loss = math.nan if loss is None else loss
        if recording:
            self.commit(t, loss, lr, grad_norm, reason=alarm or "interval", before=before)
        elif alarm:
            self._raise_event(t, alarm, loss)
            self._force_next = True  # record the next step: what moved is there to be seen
        if alarm == "nonfinite":
            self._fail(WatchFailure(t, "non_finite", None, "loss", loss, math.nan,
                                    f"step {t}: the loss is {loss} (not finite)"))
        return alarm

    def _fail(self, failure: WatchFailure) -> None:
        if self._new_failure is None:
            self._new_failure = failure
        if self.failure is None:
            self.failure = failure

    def _check_stop(self) -> WatchFailure | None:
        """The first failure found since the last call (None if none); raises WatchStop under stop="raise"."""
        found, self._new_failure = self._new_failure, None
        if found is not None and self.stop == "raise":
            raise WatchStop(found)
        return found

    def _update_extremes(self, rec: dict[str, Any]) -> None:
        for site, st in rec["stats"].items():
            for key, best, fn in (("fwd_var", self._low, min), ("grad_var", self._high, max)):
                v = st.get(key)
                if _finite(v) and v > 0:
                    best[site] = fn(best[site], v) if site in best else v

    def _judge(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """The non-ok verdict rows of a new record (as :func:`verdicts` gives them for it), from the
        running extremes of the records before it; updates those extremes."""
        rows = []
        norm = self.history.get("norm")
        for site, st in rec["stats"].items():
            if st.get("count", 1) == 0 and not _finite(st.get("fwd_nonfinite")):
                continue
            j = judged(site, norm)
            verdict, key, value, threshold = _site_verdict(st, self._low.get(site) if j else None,
                                                           self._high.get(site) if j else None, self.thresholds)
            if verdict != "ok":
                rows.append({"step": rec["step"], "site": site, "verdict": verdict, "stat": key,
                             "value": value, "threshold": threshold})
        self._update_extremes(rec)
        for row in rows:
            if row["verdict"] in FAIL_VERDICTS:
                what = {"non_finite": "is not finite", "exploding": "grew past its threshold"}[row["verdict"]]
                self._fail(WatchFailure(row["step"], row["verdict"], row["site"], row["stat"], row["value"],
                                        row["threshold"],
                                        f"step {row['step']}: {row['site']} {row['verdict']}: {row['stat']} = "
                                        f"{row['value']:.3g} {what} (threshold {row['threshold']:.3g})"))
                break
        return rows

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, t: int) -> bool:
        return self.enabled and t % self.every == 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The probe on for the forward and backward inside (hooks removed on exit, whatever happens).

        The probe runs in training mode and leaves the gradients for the optimizer.
        """
        if not self.enabled:
            yield
            return
        from ..options import ProbeOptions
        from ..measure.probe import probe

        options = ProbeOptions(modules=tuple(self.sites), backward=True, attention=True, cosine=False, params=False,
                               spectral=False, restore_grads=False, eval_mode=False)
        with probe(self.model, options) as run:
            yield
        stats = run.stats
        self._pending = {site: _site_stats(stats, site) for site in self.sites}
        self._pending_attention = _attention_stats(stats)

    def _update_ema(self, loss: float) -> None:
        if not _finite(loss):
            return
        beta = self.thresholds.spike_ema
        self._ema = loss if self._ema is None else beta * self._ema + (1 - beta) * loss
        self._n += 1

    def alarm(self, loss: float) -> str | None:
        """"nonfinite", "spike" (loss > spike_factor x running loss; once until it falls back) or None."""
        if not _finite(loss):
            return "nonfinite"
        kind = None
        if self.enabled and self._ema is not None and self._n >= self.thresholds.spike_warmup:
            high = loss > self.spike_factor * self._ema
            if high and self._armed:
                kind = "spike"
            self._armed = not high
        if kind is None:
            self._update_ema(loss)
        return kind

    @torch.no_grad()
    def snapshot_params(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters, for the update ratio of the step about to be taken."""
        if not self.enabled:
            return {}
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def _update_ratios(self, before: dict[str, torch.Tensor]) -> dict[str, float]:
        if not before:
            return {}
        names = list(before)
        num = torch.stack([torch.linalg.vector_norm((self.params[n] - before[n]).double()) for n in names])
        den = torch.stack([torch.linalg.vector_norm(before[n].double()) for n in names])
        ratio = torch.where(den > 0, num / den, torch.where(num > 0, torch.inf, 0.0))
        return dict(zip(names, ratio.tolist()))

    def commit(self, t: int, loss: float, lr: float, grad_norm: float, reason: str = "interval",
               before: dict[str, torch.Tensor] | None = None) -> None:
        """Store the record of step t (the moments captured, the update ratios since ``before``)."""
        if not self.enabled or self._pending is None:
            return
        record = {"step": int(t), "reason": reason, "loss": float(loss), "lr": float(lr), "grad_norm": float(grad_norm),
                  "stats": self._pending, "attention": self._pending_attention,
                  "update_ratio": self._update_ratios(before or {})}
        self._pending = None
        self.history["records"].append(record)
        rows = self._judge(record)
        for w in self.writers:
            w.record(record, rows)
        if reason in ("spike", "nonfinite"):
            self._raise_event(t, reason, loss)

    def _raise_event(self, t: int, kind: str, loss: float) -> None:
        m = first_mover(self.history, thresholds=self.thresholds)
        if kind == "nonfinite":
            head = f"step {t}: the loss is {loss} (not finite)"
        else:
            head = f"step {t}: the loss spiked to {loss:.4g} ({loss / self._ema:.2f}x the running loss {self._ema:.4g})"
        if m is None:
            tail = f"no watched variance had risen above {self.thresholds.watch_move:g}x its lowest earlier value"
        else:
            tail = _describe_move(m)
        event = WatchEvent(t, kind, m and m["site"], m and m["stat"], m and m["step"], f"{head}; {tail}")
        self.events.append(event)
        self.history["events"].append(event.to_dict())
        for w in self.writers:
            w.event(event)
        if self.on_event is not None:
            self.on_event(event)

    def log(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        s = self.history["series"]
        s["step"].append(int(t))
        s["loss"].append(float(loss))
        s["lr"].append(float(lr))
        s["grad_norm"].append(float(grad_norm))
        for w in self.writers:
            w.step(int(t), float(loss), float(lr), float(grad_norm))


def loss_summary(history: dict[str, Any]) -> tuple[int, float, float]:
    """(k, mean loss of the first k steps, mean of the last k), k = min(10, steps // 4) (at least 1);
    NaN means when no step was logged. Non-finite losses count (a diverged run's mean is inf/NaN)."""
    losses = (history.get("series") or {}).get("loss") or []
    if not losses:
        return 0, math.nan, math.nan
    k = max(1, min(10, len(losses) // 4))
    return k, sum(losses[:k]) / k, sum(losses[-k:]) / k


# --------------------------------------------------------------------------- exports


def to_rows(history: dict[str, Any], run: str | None = None, thresholds: Thresholds | None = None) -> list[Row]:
    """The history as tidy rows of the one result schema (:class:`diagnostics.result.Row`; see the
    module docstring for which statistics), in record order, then site order, forward before
    backward; then the per-step series. Columns: run = ``run``; step; scheme, depth, width from
    the history's "model" (None in a history stored without it); name, kind, block, direction,
    statistic, value; verdict: the site's verdict at that record in the direction it concerns
    (an exploding or non-finite forward variance on the forward rows, a vanishing or non-finite
    gradient on the backward rows; "ok" on the other direction; None on rows never judged:
    a site not measured at that record, attention, update ratios, the series). predicted,
    ratio and its interval, valid: None (the watch predicts nothing).
    """
    bad = {(r["step"], r["site"]): r for r in verdicts(history, thresholds)}
    rows: list[Row] = []
    for rec in history.get("records") or []:
        rows += record_rows(history, rec, bad, run)
    series = history.get("series") or {}
    for k, step in enumerate(series.get("step") or []):
        rows += step_rows(history, step, *((series.get(s) or [])[k] if k < len(series.get(s) or []) else math.nan
                                           for s in ("loss", "lr", "grad_norm")), run=run)
    return rows


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
        measured = not (st.get("count", 1) == 0 and not _finite(st.get("fwd_nonfinite")))
        for direction in ("forward", "backward"):
            verdict = v["verdict"] if judged_dir == direction else ("ok" if measured else None)
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
    for param, ratio in (rec.get("update_ratio") or {}).items():
        rows.append(Row(**common, step=step, name=param, kind="parameter", block=block_index(param),
                        statistic="update_ratio", value=_num(ratio)))
    return rows


def to_frame(history: dict[str, Any], run: str | None = None, thresholds: Thresholds | None = None):
    """The tidy pandas DataFrame of :func:`to_rows` (columns and dtypes of :func:`diagnostics.result.frame`)."""
    return frame(to_rows(history, run, thresholds))


class History:
    """A watch history (the dict of the module docstring) with a face: it draws itself in a
    notebook (``_repr_html_``: the loss and the residual stream's variances over steps, the
    first verdict other than ok, the alarms) and gives its tidy frame and verdicts.

    The dict stays the stored form (checkpoints, ``TrainResult.history``): ``History(d).data``
    is ``d`` itself, and ``History(d)[key]`` reads it.
    """

    def __init__(self, history: dict[str, Any]):
        from ..options import OptionsError

        why = _history_problem(history)
        if why:
            raise OptionsError(f"history: not a watch history ({why}); pass the dict a Watch or "
                               "tinylm train recorded")
        self.data = history

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __repr__(self) -> str:
        return (f"History({len(self.data['series']['step'])} steps, {len(self.data['records'])} records, "
                f"{len(self.data['events'])} alarms)")

    def to_frame(self, run: str | None = None):
        return to_frame(self.data, run)

    def verdicts(self) -> list[dict[str, Any]]:
        return verdicts(self.data)

    def first_departure(self) -> dict[str, Any] | None:
        return first_departure(self.data)

    def _repr_html_(self) -> str:
        from ..display import html

        return html(self)


def _num(x: Any) -> float:
    """A stored number as a float (None and the JSON strings of non-finite values included)."""
    if x is None:
        return math.nan
    return float(x)


def write_json(history: dict[str, Any], path: str) -> None:
    """The history as JSON (NaN as null, infinities as the strings "inf"/"-inf"), written atomically."""
    import json

    from tinylm.checkpoint import atomic_write

    text = json.dumps(_json_safe(history), indent=1, allow_nan=False)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def write_csv(history: dict[str, Any], path: str, run: str | None = None) -> None:
    """The tidy frame of :func:`to_frame` as CSV (no index column), written atomically."""
    from tinylm.checkpoint import atomic_write

    df = to_frame(history, run)
    atomic_write(path, lambda tmp: df.to_csv(tmp, index=False, lineterminator="\n"))


def train_watched(model: nn.Module, tokens, options, *, sites: list[str] | None = None,
                  on_event: Callable[[WatchEvent], None] | None = None, resume: dict[str, Any] | None = None,
                  thresholds: Thresholds | None = None, **kwargs: Any):
    """``tinylm.train.train`` with a :class:`Watch` built from ``options`` (``watch_every``,
    ``spike_factor``) and ``thresholds`` (None: the defaults) that continues the resumed run's
    history; ``sites``: the tensors it records (None: its default set); other keyword
    arguments go to ``train``."""
    from tinylm.train import train

    watch = Watch(model, every=options.watch_every, spike_factor=options.spike_factor, sites=sites,
                  history=(resume or {}).get("history"), on_event=on_event, thresholds=thresholds)
    return train(model, tokens, options, resume=resume, monitor=watch, **kwargs)
