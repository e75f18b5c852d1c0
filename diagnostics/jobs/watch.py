"""The watch: per-layer statistics over training steps, kept as moments, never tensors.

Every ``every`` steps (and at once when the loss spikes or is not finite) one
training step runs under the probe (:func:`diagnostics.probe`), which reduces,
in float64, each watched tensor and the gradient of the loss with respect to it:

    count n (entries), mean m = sum x / n', variance v = sum (x - m)^2 / n', absmax = max |x|,
    nonfinite = fraction of NaN/inf entries        (n' = the finite entries)

(attention scores and probabilities over the causal positions only), and the precursor signals
of :mod:`diagnostics.measure.signals` (every attention layer's largest logit and entropy against
its ceiling, the head's log Z, the residual stream's peak ratio; the history's optional keys).
Around a recorded step's optimizer step it measures each parameter's update ratio
||W_after - W_before||_F / ||W_before||_F.

What it records is a history of the format of :mod:`diagnostics.jobs.history`. Each new
record is judged at once against the records before it (:mod:`diagnostics.judge.over_time`:
non_finite, exploding, vanishing), and its non-ok verdicts go to the writers
(:mod:`diagnostics.integrations.writers`). The message on a spike names the site that moved
first (:func:`diagnostics.judge.over_time.first_mover`).

A recorded step moves its statistics to the host once: the loss, every site's moment vectors
and the update ratios travel packed in one float64 vector
(:func:`diagnostics.measure.distributed.exchange`). Under ``torch.distributed`` (initialised,
more than one rank) that vector is all-gathered once over the process group (the DDP model's,
else the default group) and merged over the ranks (Chan's update, rank order): every rank
holds the same record, judges the ranks' mean loss, and reaches the same verdict at the same
step; rank 0 alone writes. A step not recorded sends only the loss, lr and grad_norm then.
A compiled or DDP model is watched through the module inside it (its own site names); a
recorded step runs it eagerly (:mod:`diagnostics.measure.wrappers`). See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from tinylm import validate
from tinylm.errors import TinyLMError
from torch import nn

from ..errors import OptionsError

from ..integrations.writers import WatchWriter
from ..judge.over_time import FAIL_VERDICTS, Extremes, describe_move, first_mover, record_verdicts
from ..judge.precursors import Alert
from ..judge.thresholds import Thresholds
from ..measure.distributed import exchange, process_group
from ..measure.moments import AttnMoments, Moments, ProbeStats
from ..measure.optimizer import optimizer_signals
from ..measure.signals import init_drift
from ..measure import sharded
from ..measure.sites import model_sites
from ..measure.wrappers import unwrap
from ..result import Row
from .watch_precision import precision_tap
from .watch_record import copy_params, host_values
from .watch_alerts import AlertBook, WatchEvent, WatchFailure, WatchReport, WatchStop, failure_of
from .history import attention_stats, check_history, logits_stats, new_history, record_rows, site_stats, step_rows

__all__ = ["Watch", "WatchReport", "WatchEvent", "WatchFailure", "WatchStop", "find_sites", "default_sites",
           "describe_sites", "train_watched"]


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


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _checked_thresholds(model: Any, every: Any, stop: Any, thresholds: Any, spike_factor: float | None
                        ) -> Thresholds:
    """The watch's thresholds, after checking the arguments of :class:`Watch` that need no model walk."""
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
    return thresholds


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
    ones when the ``tensorboard`` package is installed); ``writers``: more writers, each an
    object with the methods of :class:`diagnostics.integrations.writers.WatchWriter` (the
    command line's live panel is one).
    ``stop``: None goes on whatever happens; "raise" raises :class:`WatchStop` from
    :meth:`record` at the first fail (:data:`diagnostics.judge.over_time.FAIL_VERDICTS`, or
    a non-finite loss). :meth:`record` returns the fail found at its step as a
    :class:`WatchFailure` (None while all is well); ``failure`` keeps the run's first.

    The lower-level protocol (``tinylm.train.train`` and the Hugging Face callback use it):
    ``due(t)`` says whether step t is recorded; run that step's forward and backward inside
    ``capture()``; ``alarm(loss)`` after it says "spike", "nonfinite" or None;
    ``snapshot_params()`` before the optimizer step and ``commit(...)`` after it store the
    record; ``log(...)`` every step. ``every=0`` turns recording off (the loss series and the
    non-finite alarm remain).

    ``model`` may be ``torch.compile``'d (before or after the watch is made) and wrapped in
    ``DistributedDataParallel``; over several ranks the watch merges its records and the loss
    over the process group by itself, and only rank 0 opens the writers (module docstring).

    ``thresholds``: a :class:`diagnostics.Thresholds` (None: the defaults), the same object diagnose takes; the
    watch reads its watch_* and spike_* fields. ``spike_factor``, when given, replaces the thresholds' own (the
    training options carry one). ``optimizer``: the loop's optimizer (figures: :mod:`diagnostics.measure.optimizer`).
    ``precision``: None (off), a recipe name or a :class:`diagnostics.PrecisionWatch`: each record also holds every
    linear layer's GEMM SQNR in that recipe, alerted on a drop (:mod:`diagnostics.jobs.watch_precision`).
    """

    def __init__(self, model: nn.Module, every: int = 25, spike_factor: float | None = None,
                 sites: list[str] | None = None, history: dict[str, Any] | None = None,
                 on_event: Callable[[WatchEvent], None] | None = None, thresholds: Thresholds | None = None,
                 *, log_dir: str | None = None, writers: list[WatchWriter] | tuple = (), stop: str | None = None,
                 optimizer: torch.optim.Optimizer | None = None, forensics: int = 8, precision: Any = None):
        thresholds = _checked_thresholds(model, every, stop, thresholds, spike_factor)
        validate.integer("forensics", forensics, low=1, fix="forensics=N (records kept for a report)", error=OptionsError)
        self.thresholds = thresholds
        #: the process group the records and the loss are merged over (None: one process)
        self.group = process_group(model)
        self.rank = 0 if self.group is None else torch.distributed.get_rank(self.group)
        model = unwrap(model)  # a compiled or DDP model: the module inside (the same parameters)
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
        self._probed = tuple(dict.fromkeys([*self.sites, *(n for n, k in model_sites(model).points.items()
                                                           if k in ("attn_scores", "attn_probs", "logits"))]))
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._opt = optimizer_signals(optimizer, self.params, self.group)  # its figures (off without one)
        history, self.history_problem = check_history(history)  # a damaged history: start a new one
        self.history = history if history is not None else new_history(model, self.sites, self.every, self.spike_factor)
        self.history["thresholds"] = thresholds.to_dict()  # a resumed run judges all its records by these
        self.precision = precision_tap(model, precision, self.history)  # per-GEMM SQNR (watch_precision)
        self.events: list[WatchEvent] = []
        self._pending: dict[str, dict[str, float]] | None = None
        self._raw: tuple | None = None  # the probe's vectors and signals of a recorded step, not yet moved
        self._ratios: dict[str, float] | None = None
        self._merged: tuple | None = None  # (t, loss, lr, grad_norm) as step t was judged
        self._pending_attention: dict[str, dict[str, float]] = {}
        self._pending_logits: dict[str, float] | None = None
        self._pending_dtypes: dict[str, str] = {}  # site -> its forward dtype at the record
        self._init: Any = None  # the first record's init drift: a tensor until it moves, then a float
        self._ema: float | None = None
        self._n = 0
        self._armed = True
        for loss in self.history["series"]["loss"]:  # a resumed run continues the running loss
            self._update_ema(loss)
        # running extremes of each site's variances over the records so far (the verdicts' reference)
        self._earlier = Extremes()
        for rec in self.history["records"]:
            self._earlier.update(rec)
        self.history.setdefault("param_dims", {n: int(p.dim()) for n, p in self.params.items()})
        #: the run's alerts and forensics (:class:`diagnostics.jobs.watch_alerts.AlertBook`)
        self.book = AlertBook(self.history, thresholds, int(forensics), self.every)
        self.stop = stop
        self.failure: WatchFailure | None = None
        self._new_failure: WatchFailure | None = None
        self._open_step: dict[str, Any] | None = None  # the step entered by step() and not yet recorded
        self._force_next = False
        self.writers = self._writers(log_dir, writers)
        self._writer_names = [type(w).__name__ for w in self.writers]
        for w in self.writers:
            w.open(self)

    def _writers(self, log_dir: str | None, writers: list[WatchWriter] | tuple) -> list[WatchWriter]:
        """The default writers of ``log_dir`` followed by ``writers``, each checked (none opened yet)."""
        out: list[WatchWriter] = []
        if self.rank != 0:  # one set of files for a distributed run: rank 0's
            return out
        if log_dir is not None:
            from ..integrations.writers import default_writers

            out += default_writers(log_dir, append=bool(self.history["series"]["step"]))
        for w in writers:
            if not isinstance(w, WatchWriter):
                raise OptionsError(f"writers: {type(w).__name__} is not a diagnostics WatchWriter; give it the "
                                   "methods open, step, record, event and close, or subclass "
                                   "diagnostics.integrations.writers.WatchWriter")
            out.append(w)
        return out

    def record_rows(self, record: dict[str, Any], verdicts: list[dict[str, Any]], run: str | None = None) -> list[Row]:
        """The tidy rows of one of this watch's records (:func:`diagnostics.jobs.history.record_rows`),
        given its non-ok verdicts."""
        return record_rows(self.history, record, {(v["step"], v["site"]): v for v in verdicts}, run)

    def step_rows(self, t: int, loss: float, lr: float, grad_norm: float, run: str | None = None) -> list[Row]:
        """The tidy rows of one logged step (:func:`diagnostics.jobs.history.step_rows`)."""
        return step_rows(self.history, t, loss, lr, grad_norm, run)

    def describe(self) -> str:
        """What the watch watches, in a line (the sites, how often, where it writes)."""
        where = ", ".join(self._writer_names) or "the history only"
        every = f"every {self.every} steps" if self.every else "never (every=0: the loss alone)"
        ranks = ""
        if self.group is not None:
            n = torch.distributed.get_world_size(self.group)
            ranks = f"; merged over {n} ranks" + ("" if self.rank == 0 else f" (rank {self.rank} writes nothing)")
        return f"watching {describe_sites(self.sites)}; recorded {every}{ranks}; writing to {where}"

    def __repr__(self) -> str:
        n = len(self.history["records"])
        return f"Watch({self.describe()}; {n} record{'' if n == 1 else 's'})"

    def _repr_html_(self) -> str | None:
        from .history import History

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
            self._opt.close()  # the optimizer's hook removed
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
               ) -> WatchReport:
        """The end of the step entered by :meth:`step`: its loss (a float or a 0-d tensor), learning
        rate and gradient norm (None: not known, kept as NaN). Stores the record when the step
        was recorded, judges it, raises the spike and non-finite alarms and writes to the writers.

        Returns a :class:`WatchReport`: the warnings and fails first reported at this step
        (``report.alerts``, each with its cause and fix) and the first :class:`WatchFailure` found
        at it (``report.failure``; a fail that persists is returned at each step it is found);
        ``bool(report)`` is whether there is a failure. With ``stop="raise"`` a failure raises
        :class:`WatchStop` instead. ``failure`` keeps the first of the run, ``alerts`` all of them.
        """
        if self._open_step is None:
            raise OptionsError("watch.record(...) without a step: call it after `with watch.step(t):`")
        if loss is None:
            raise OptionsError("watch.record(loss=None): pass the step's loss (a float or a 0-d tensor)")
        return self._finish_open(loss, lr, grad_norm)

    def _finish_open(self, loss: float | torch.Tensor | None = None, lr: Any = None, grad_norm: Any = None
                     ) -> WatchReport:
        """Record the open step (``loss`` None: left without :meth:`record`, kept as NaN and not alarmed on)."""
        open_step, self._open_step = self._open_step, None
        if open_step is None:
            return WatchReport()
        t = open_step["t"]
        self._end_step(t, loss, lr, grad_norm, open_step["recording"], open_step["before"])
        self.log(t, *self._merged[1:])
        return WatchReport(self.book.take_new(), self._check_stop())

    def _values(self, loss: Any, lr: Any, grad_norm: Any, before: dict[str, torch.Tensor] | None
                ) -> tuple[float, float, float]:
        """(loss, lr, grad_norm) of the step as floats (None: NaN); over a process group the loss
        is the ranks' mean, lr and grad_norm rank 0's. With ``before`` (a recorded step) the
        probe's vectors and the update ratios travel in the same exchange (one host transfer,
        one collective over the ranks), and the merged record is kept for :meth:`commit`.
        One process, a step not recorded: the loss is read once (none for a float loss)."""
        def entry(v: Any) -> Any:
            if v is None:
                return [math.nan]
            return v.detach().double().reshape(1) if isinstance(v, torch.Tensor) else [float(v)]

        if self.group is None and before is None:
            return tuple(math.nan if v is None else float(v.detach() if isinstance(v, torch.Tensor) else v)
                         for v in (loss, lr, grad_norm))
        got = self._collect(before, [("loss", "mean", entry(loss)), ("lr", "first", entry(lr)),
                                     ("grad_norm", "first", entry(grad_norm))])
        return got["loss"][0], got["lr"][0], got["grad_norm"][0]

    def _collect(self, before: dict[str, torch.Tensor] | None, entries: list) -> dict[str, Any]:
        """:func:`diagnostics.measure.distributed.exchange` of ``entries`` and, when the probe's
        vectors are waiting, each site's moments, the attention panels and the update ratios
        since ``before`` and the probe's signals (:mod:`diagnostics.measure.signals`); keeps the
        record's parts (``_pending``, ``_pending_attention``, ``_pending_logits``, ``_ratios``)."""
        raw, self._raw = self._raw, None
        names: list[str] = []
        if raw is not None:
            tensors, attention, signals = raw
            entries = entries + [(f"t/{s}/{d}", "moments", tensors.get((s, d)))
                                 for s in self.sites for d in ("forward", "backward")]
            entries += [(f"a/{n}", "attention", v) for n, v in attention.items()] + signals.entries(tensors)
            names, ratios = self._ratio_vector(before or {})
            if names:
                entries.append(("update_ratio", "first", ratios))
            entries += self._opt.entries()  # the optimizer's sums (none without one)
            if isinstance(self._init, torch.Tensor):
                entries.append(("init", "first", self._init))
        got = exchange(host_values(entries, self.group), self.group)  # one transfer, no op per entry
        if raw is not None:
            merged = ProbeStats(
                tensors={(s, d): Moments.from_vector(got[f"t/{s}/{d}"]) for s in self.sites
                         for d in ("forward", "backward") if got[f"t/{s}/{d}"] is not None},
                attention={n: AttnMoments.from_vector(got[f"a/{n}"]) for n in raw[1] if got[f"a/{n}"] is not None})
            extra, logz, peaks = signals.read(got)
            self._pending_logits = None if logz is None else logits_stats(*logz)
            self._pending_dtypes = {s: signals.dtypes[s] for s in self.sites if s in signals.dtypes}
            self._pending = {site: site_stats(merged, site, peaks.get(site)) for site in self.sites}
            self._pending_attention = attention_stats(merged, extra)
            self._ratios = dict(zip(names, got["update_ratio"])) if names else {}
            self._opt.merge(got)
            if isinstance(self._init, torch.Tensor):
                self._init = float(got["init"][0])
        return got

    def _starts(self, t: int) -> bool:
        """Whether step t is recorded: it is due, or the step before it raised an alarm."""
        recording = self.enabled and (self.due(t) or self._force_next)
        self._force_next = False
        return recording

    def _end_step(self, t: int, loss: float | torch.Tensor | None, lr: Any, grad_norm: Any, recording: bool,
                  before: dict[str, torch.Tensor]) -> str | None:
        """After step t's optimizer step: the alarm on its loss (None: no loss known, no alarm),
        its record when ``recording``, an alarm's event (a step not recorded makes the next one
        recorded) and a non-finite loss's failure. Returns the alarm. Over a process group the
        loss judged is the ranks' mean (:meth:`_values`), so every rank raises the same alarm at
        the same step. The series entry is the caller's (:meth:`log`, which takes these merged
        values for step t)."""
        known = loss is not None
        loss, lr, grad_norm = self._values(loss, lr, grad_norm, before if recording else None)
        self._merged = (t, loss, lr, grad_norm)
        alarm = self.alarm(loss) if known else None
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

    def _judge(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """The non-ok verdict rows of a new record (as :func:`diagnostics.judge.over_time.verdicts`
        gives them for it), from the running extremes of the records before it; updates those
        extremes and notes the first fail among the rows."""
        rows = record_verdicts(rec, self._earlier, self.history.get("norm"), self.thresholds, self.history.get("kinds"))
        self._earlier.update(rec)
        fail = next((row for row in rows if row["verdict"] in FAIL_VERDICTS), None)
        if fail is not None:
            self._fail(failure_of(fail))
        for failure in self.book.judge(rec, rows, self.writers):
            self._fail(failure)
        return rows

    @property
    def alerts(self) -> list[Alert]:
        """Every warning and fail reported so far (:class:`diagnostics.judge.precursors.Alert`)."""
        return self.book.alerts

    @property
    def reports(self) -> Any:
        """The last ten forensics reports (:meth:`forensics_report`), oldest first."""
        return self.book.reports

    def forensics_report(self, trigger: Alert | WatchEvent) -> dict[str, Any]:
        """What moved before ``trigger`` (:meth:`diagnostics.jobs.watch_alerts.AlertBook.report`)."""
        return self.book.report(trigger)

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, t: int) -> bool:
        return self.enabled and t % self.every == 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The probe on for the forward and backward inside (hooks removed on exit, whatever happens):
        the watched sites and the signals of every attention layer and of the head, in training
        mode, the gradients left for the optimizer."""
        if not self.enabled:
            yield
            return
        from ..options import ProbeOptions
        from ..measure.probe import probe

        options = ProbeOptions(modules=self._probed, backward=True, attention=True, cosine=False, params=False,
                               spectral=False, restore_grads=False, eval_mode=False, signals=True)
        with probe(self.model, options) as run, self.precision.capture():
            yield
        self._raw = (*run.vectors(), run.signals)  # moved to the host (and merged over the ranks) once, at record
        self._pending, self._ratios = None, None

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
        """Copies of the parameters, for the update ratio (and optimizer figures) of the step about to be taken."""
        if not self.enabled:
            return {}
        copies = copy_params(self.params)  # one op per device and dtype
        if not self.history["records"]:  # the first record: the weights against their declared init
            self._init = init_drift(self.model, copies)
        return self._opt.arm(copies)

    @torch.no_grad()
    def _ratio_vector(self, before: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
        """(names, ||W - W_before||_F / ||W_before||_F per parameter as one float64 tensor on the
        parameters' device; inf for a zero W_before that moved, 0 for one that did not)."""
        if not before:
            return [], None
        return list(before), sharded.update_ratio_vector(self.params, before)  # DTensors from their shards

    def commit(self, t: int, loss: float, lr: float, grad_norm: float, reason: str = "interval",
               before: dict[str, torch.Tensor] | None = None) -> None:
        """Store the record of step t (the moments captured, the update ratios since ``before``)."""
        if self._raw is not None:  # the lower-level protocol: the vectors move (and merge) here
            self._collect(before, [])
        if not self.enabled or self._pending is None:
            return
        record = {"step": int(t), "reason": reason, "loss": float(loss), "lr": float(lr), "grad_norm": float(grad_norm),
                  "stats": self._pending, "attention": self._pending_attention, "update_ratio": self._ratios or {},
                  **self._opt.record(), **self.precision.take()}
        if self._pending_logits is not None:
            record["logits"] = self._pending_logits
        if self._pending_dtypes:
            record["dtypes"] = self._pending_dtypes
        drift, self._init = self._init, None
        if t == 0 and not self.history["records"] and drift is not None:  # a run from its init
            record["init"] = {"drift": drift}
        self._pending, self._ratios = None, None
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
            tail = describe_move(m)
        event = WatchEvent(t, kind, m and m["site"], m and m["stat"], m and m["step"], f"{head}; {tail}")
        self.events.append(event)
        self.history["events"].append(event.to_dict())
        for w in self.writers:
            w.event(event)
        if self.on_event is not None:
            self.on_event(event)
        self.book.forensics(event, self.writers)
        self.book.emit(self.book.event_alert(event, loss, self.spike_factor * (self._ema or math.nan)), self.writers)

    def log(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        """Step t's entry of the loss series (and the writers'); over a process group, right after
        :meth:`_end_step` of step t, the loss it judged (the ranks' mean) replaces ``loss``."""
        merged, self._merged = self._merged, None
        if self.group is not None and merged is not None and merged[0] == t:
            loss = merged[1]
        s = self.history["series"]
        s["step"].append(int(t))
        s["loss"].append(float(loss))
        s["lr"].append(float(lr))
        s["grad_norm"].append(float(grad_norm))
        self.book.ring.append((int(t), float(loss), float(lr), float(grad_norm)))
        for w in self.writers:
            w.step(int(t), float(loss), float(lr), float(grad_norm))


def train_watched(model: nn.Module, tokens, options, *, sites: list[str] | None = None,
                  on_event: Callable[[WatchEvent], None] | None = None, resume: dict[str, Any] | None = None,
                  thresholds: Thresholds | None = None, writers: list[WatchWriter] | tuple = (), **kwargs: Any):
    """``tinylm.train.train`` with a :class:`Watch` built from ``options`` (``watch_every``, ``spike_factor``)
    and ``thresholds`` (None: the defaults) that continues the resumed run's history and measures the steps
    of the run's optimizer (``optimizer`` in ``kwargs``, else ``make_optimizer``); ``sites``: the tensors
    it records (None: its default set); ``writers``: where its steps, records and alerts go
    (:class:`diagnostics.integrations.writers.WatchWriter`); other keyword arguments go to ``train``."""
    from tinylm.train import make_optimizer, train
    opt = kwargs.pop("optimizer", None) or make_optimizer(model, options)
    with Watch(model, every=options.watch_every, spike_factor=options.spike_factor, sites=sites, optimizer=opt,
               history=(resume or {}).get("history"), on_event=on_event, thresholds=thresholds,
               writers=writers) as watch:
        return train(model, tokens, options, resume=resume, monitor=watch, optimizer=opt, **kwargs)
