"""``diagnose``: probe + theory + verdicts in one call, returning a :class:`DiagnoseResult`.

A pipeline of named stages, read top to bottom in :func:`diagnose`:

1. ``_sample``: the models (the one given, or one re-initialised copy per seed) and each one's batches;
2. ``_measure``: one probe per (seed, batch) replicate, forward and backward, with its loss;
3. ``_pool``: the replicates' moments merged into one record (exact, by Chan's rule);
4. ``_predict``: theory's prediction of every measured moment, per replicate and pooled;
5. ``_rows``: the result's tensor, parameter, attention and depth rows;
6. ``_judge``: the verdicts, the findings and what could and could not be judged;
7. ``_header``: the facts about what was measured.

Each (seed, batch) pair is measured by its own probe and predicted by its own theory,
giving one ratio r = measured/predicted variance per pair. The independent replicates
are the weight draws when there are several seeds (a draw's batches share its deviation
from the expectation, so each draw's ratio is the geometric mean over its batches), else
the batches of the one draw, which cover batch noise but not the draw
(:func:`diagnostics.measure.intervals.interval_scope` says which in words). A ratio of
variances is positive and multiplicative (2x over and 2x under are equally far from 1), so
its 99% interval is a Student-t interval on ln r over the replicates, exponentiated
(:func:`diagnostics.measure.intervals.log_t_interval`):

    ratio = exp(m),  [exp(m - h), exp(m + h)],  m = mean_r ln r,  h = t_{0.995, R-1} sd_r(ln r) / sqrt(R)

The point is the geometric mean of the replicates; the interval is asymmetric
around it and always positive. It is never taken over the elements of one tensor
(those are correlated).

Fresh or trained is decided once (:mod:`.diagnose_init`: the model's declared init, and whether
every weight is still within a fresh draw's spread of it), stored in the header and used by every
check that depends on it. Theory: "global" for a fresh tinylm model whose declared init is a tinylm
scheme, "local" otherwise (:func:`diagnostics.theory.predict`). In global
mode the forward predictions come from the token-kernel theory (:mod:`diagnostics.theory.tokenkernel`),
computed once per process for each (config, seq_len, scheme, token coincidences): the
seeds and batches of a run share it, as they share every global prediction (the theory
is seed-independent). Given tokens enter it through the fraction of sequences holding
the same token at two positions (:func:`diagnostics.theory.tokenkernel.token_coincidence`); uniform
random tokens through its expectation, 1/V. The backward predictions stay with the
independent-token rules.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

import numpy as np
import torch
from torch import Tensor, nn

import tinylm

from ..judge import Thresholds, coverage, judge
from ..measure.blocks import BlockStack, is_norm
from ..measure.intervals import interval_scope
from ..measure.moments import ProbeStats
from ..measure.probe import block_index, probe
from ..measure.sites import Sites, model_sites
from ..measure.wrappers import unwrap
from ..options import DiagnoseOptions, OptionsError, Progress, ProbeOptions
from ..result import AttentionRow, DepthRow, DiagnoseResult, Finding, Header, ParamRow, TensorRow
from ..theory import Prediction, predict
from ..theory.tokenkernel import token_coincidence
from .diagnose_init import FRESH_RULE, Declaration, declaration, fresh
from .diagnose_kinds import at_init, weight_kinds
from .diagnose_peaks import block_peaks
from .diagnose_rows import attention_rows, depth_rows, param_rows, tensor_rows
from .diagnose_sample import batch_loss, kv_heads, model_context, parameter_placement, seed_batches, seed_models
from .diagnose_validity import trained_premise

__all__ = ["diagnose"]

Predictions = dict[tuple[str, str], Prediction]


def diagnose(model: nn.Module, tokens=None, options: DiagnoseOptions | None = None) -> DiagnoseResult:
    """Measure every instrumented tensor forward and backward, predict it, judge it.

    Args:
        model: any nn.Module, called on token ids (B, T) (or as ``options.inputs`` builds its
            arguments); its output is read as next-token logits (B, T, V), a tuple's first
            tensor, ``.logits`` / ``.loss`` (a Hugging Face ModelOutput) or a 0-d loss
            (:func:`diagnostics.measure.outputs.read_output`). The residual stream is its block
            stack's (found by structure); theory needs a tinylm.TransformerLM. Left exactly as it was.
        tokens: (N, T+1) windows, a 1-D token stream, or None (uniform random, seeded).
        options: :class:`DiagnoseOptions`.
    Returns: a :class:`DiagnoseResult` (see diagnostics/API.md), whose ``judged`` and
        ``not_judged`` say which checks could be made; neither the stream nor the loss
        judged is status "not judged", never healthy.
    """
    options, thresholds = _checked(model, options)
    model = unwrap(model)  # compiled or DDP: the module inside, run eagerly on this rank alone
    sample = _sample(model, tokens, options)
    steps = _Steps(options.progress, total=len(sample.models) * len(sample.batches[0]) + 2)
    measured = _measure(sample, options, steps)
    pooled = _pool(measured)
    state = _state(model, sample, measured)
    theory = _predict(model, sample, measured, pooled, options, steps, state)
    rows = _rows(model, sample, measured, pooled, theory, state)
    verdicts = _judge(model, sample, measured, pooled, rows, thresholds, options, steps, state)
    return DiagnoseResult(header=_header(model, sample, measured, theory, options, state),
                          tensors=verdicts.rows.tensors,
                          params=verdicts.rows.params, attention=verdicts.rows.attention, depth=verdicts.rows.depth,
                          findings=verdicts.findings, thresholds=thresholds.to_dict(),
                          created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          judged=verdicts.judged, not_judged=verdicts.not_judged)


# ----------------------------------------------------------------------------- what the stages hand on


@dataclass
class _Sample:
    """What is measured: the models (one per seed), each one's batches (B, seq_len + 1), where the
    tokens came from ("random" or "given"), and the model's sites (:func:`~diagnostics.measure.sites.model_sites`:
    its block stack, None when none is found, and the residual stream's depth points)."""

    models: list[nn.Module]
    batches: list[list[Tensor]]
    source: str
    seq_len: int
    sites: Sites

    @property
    def stack(self) -> BlockStack | None:
        return self.sites.blocks


@dataclass
class _Replicate:
    """One (seed, batch) pair measured: its probe's statistics, the model it measured, and the
    positions (B * T) its mean loss is taken over."""

    stats: ProbeStats
    model: nn.Module
    tokens: int


@dataclass
class _Measured:
    """Every replicate, in (seed, batch) order, with its loss, the V of its next-token logits (None:
    no loss against ln V) and its softmax moments (E[sum p^2], E[p_y]); the output logits' scale
    of the model as given ({} without next-token logits; :func:`_logit_scale`) and its block
    outputs' peak / median ({block output name: max |x| / median |x|}, the largest over its batches)."""

    replicates: list[_Replicate] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    vocabs: set[int | None] = field(default_factory=set)
    softmaxes: list[tuple[float, float]] = field(default_factory=list)
    logits: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)


@dataclass
class _State:
    """The model's declared init and whether its weights are still at it (None: nothing declared),
    decided once for every check; each weight kind's state (:mod:`.diagnose_kinds`), and whether
    every kind is at its init or a fresh draw of it at another scale (``at_init``: the init-dependent
    checks run)."""

    declared: Declaration
    fresh: bool | None
    kinds: list = field(default_factory=list)
    at_init: bool | None = None


@dataclass
class _Theory:
    """The theory mode used ("local", "global" or "off") and its predictions, per replicate and pooled."""

    mode: str
    per_rep: list[Predictions]
    pooled: Predictions


@dataclass
class _Rows:
    tensors: list[TensorRow]
    params: list[ParamRow]
    attention: list[AttentionRow]
    depth: list[DepthRow]


@dataclass
class _Verdicts:
    """The rows with their verdicts, the findings, and the checks made and not made (with why)."""

    rows: _Rows
    findings: list[Finding]
    judged: list[str]
    not_judged: list[tuple[str, str]]


class _Steps:
    """Calls ``progress(done, total, what)`` as each step of the pipeline ends."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def advance(self, what: str) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, what)


# ----------------------------------------------------------------------------- the stages


def _checked(model: nn.Module, options: DiagnoseOptions | None) -> tuple[DiagnoseOptions, Thresholds]:
    """The options (default ones for None) and the thresholds, each checked."""
    options = options or DiagnoseOptions()
    if not isinstance(options, DiagnoseOptions):
        raise OptionsError(f"options={type(options).__name__}: pass a diagnostics.DiagnoseOptions")
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: diagnose needs a torch.nn.Module")
    thresholds = options.thresholds or Thresholds()
    if not isinstance(thresholds, Thresholds):
        raise OptionsError(f"thresholds={thresholds!r}: pass a diagnostics.Thresholds")
    return options, thresholds


def _sample(model: nn.Module, tokens, options: DiagnoseOptions) -> _Sample:
    """The models and their batches: ``seq_len`` tokens each (default min(context, 128)), never above the context."""
    context = model_context(model)
    seq_len = options.seq_len or (min(context, 128) if context else 128)
    if context and seq_len > context:
        raise OptionsError(f"seq_len={seq_len} > the model's context_length={context}: pass seq_len <= {context}")
    batches, source = seed_batches(model, tokens, options, seq_len)
    seq_len = batches[0][0].shape[1] - 1
    if context and seq_len > context:
        raise OptionsError(f"tokens of length {seq_len} + 1 > the model's context_length={context} + 1: "
                           "cut the windows")
    return _Sample(models=seed_models(model, options), batches=batches, source=source, seq_len=seq_len,
                   sites=model_sites(model))


def _measure(sample: _Sample, options: DiagnoseOptions, steps: _Steps) -> _Measured:
    """One probe per (seed, batch): forward, loss, backward. Parameters are measured on each seed's
    first batch, their spectra once (the first seed's)."""
    out = _Measured()
    n = len(sample.batches[0])
    blocks = sample.stack.names if sample.stack is not None else ()
    for mi, m in enumerate(sample.models):
        for bi, batch in enumerate(sample.batches[mi]):
            scale: dict = {} if mi == 0 else None  # the model as given: the first seed's
            with probe(m, ProbeOptions(spectral=(mi == 0 and bi == 0), params=(bi == 0))) as run, \
                    block_peaks(m, blocks if mi == 0 else (), out.peaks):
                loss, moments, logit_vocab = batch_loss(m, batch, options, scale)
                loss.backward()
            _add_logit_scale(out.logits, scale)
            out.vocabs.add(logit_vocab)
            out.losses.append(float(loss.detach()))
            out.softmaxes.append(moments)
            out.replicates.append(_Replicate(run.stats, m, batch.shape[0] * sample.seq_len))
            steps.advance(f"measured seed {options.seed + mi}, batch {bi + 1}/{n}")
    return out


def _add_logit_scale(total: dict[str, float], batch: dict | None) -> None:
    """Adds one batch's output-logit sums (:func:`~.diagnose_sample.batch_loss`'s ``logits_out``)
    to ``total``: sums add, maxima take the larger."""
    if not batch:
        return
    for key in ("logz_sum", "logz_squares", "rows"):
        total[key] = total.get(key, 0.0) + batch[key]
    for key in ("logz_absmax", "max_logit"):
        total[key] = max(total.get(key, -math.inf), batch[key]) if math.isfinite(batch[key]) else math.inf


def _logit_scale(total: dict[str, float]) -> dict[str, float] | None:
    """{"logz_mean", "logz_std", "logz_absmax", "max_logit", "rows"} of the output logits over the
    measured rows (log Z_t = logsumexp of row t's logits), or None where none were read."""
    n = total.get("rows", 0)
    if not n:
        return None
    mean = total["logz_sum"] / n
    var = max(total["logz_squares"] / n - mean * mean, 0.0)
    return {"logz_mean": mean, "logz_std": math.sqrt(var), "logz_absmax": total["logz_absmax"],
            "max_logit": total["max_logit"], "rows": n}


def _pool(measured: _Measured) -> ProbeStats:
    """Every replicate's moments merged: the statistics of all their elements together."""
    pooled = measured.replicates[0].stats
    for r in measured.replicates[1:]:
        pooled = pooled.merge(r.stats)
    return pooled


def _state(model: nn.Module, sample: _Sample, measured: _Measured) -> _State:
    """The declared init and the fresh-or-trained decision (:mod:`.diagnose_init`), from the first
    replicate's parameters (the model as given; one seed's draw when several are measured)."""
    decl = declaration(sample.models[0])
    rows = param_rows(measured.replicates[0].stats, lambda n: None, decl.dists)
    kinds = weight_kinds(sample.models[0], rows, decl, sample.stack.names if sample.stack is not None else ())
    is_fresh = fresh(rows, decl)
    return _State(decl, is_fresh, kinds, at_init(kinds) if kinds else is_fresh)


def _predict(model: nn.Module, sample: _Sample, measured: _Measured, pooled: ProbeStats,
             options: DiagnoseOptions, steps: _Steps, state: _State) -> _Theory:
    """Theory's predictions in the mode asked ("auto": global for a fresh tinylm model whose declared
    init is a tinylm scheme, else local; "off" for any other model). A theory that fails warns and
    leaves the measurement without predictions (mode "off"); a global theory whose premise the
    weights contradict is kept but marked outside validity."""
    mode = options.theory
    if mode in ("off", "none"):
        mode = "off"  # measurement only, as asked
    elif not isinstance(model, tinylm.TransformerLM):
        mode = "off"
    elif mode == "auto":
        mode = "global" if state.fresh and state.declared.scheme else "local"
    per_rep: list[Predictions] = []
    pooled_pred: Predictions = {}
    if mode in ("local", "global"):
        try:
            per_rep, pooled_pred = _predictions(mode, sample, measured, pooled)
            mismatch = _init_mismatch(measured.replicates[0].stats) \
                if mode == "global" and len(sample.models) == 1 else ""
            if mismatch:
                per_rep, pooled_pred = _outside_all(per_rep, pooled_pred, mismatch)
            if mode == "local":  # a trained weight breaks the local rules' premise (:mod:`.diagnose_validity`)
                names = sample.stack.names if sample.stack is not None else ()
                per_rep = [trained_premise(pr, state.kinds, names) for pr in per_rep]
                pooled_pred = trained_premise(pooled_pred, state.kinds, names)
        except Exception as e:  # noqa: BLE001 - theory never takes the measurement, the verdict or the exit code down
            warnings.warn(f"theory ({mode}) could not be computed for this model ({type(e).__name__}: {e}); "
                          "the measurements and verdicts stand without predictions", RuntimeWarning, stacklevel=3)
            mode, per_rep, pooled_pred = "off", [], {}
    steps.advance(f"theory ({mode})")
    return _Theory(mode, per_rep, pooled_pred)


def _rows(model: nn.Module, sample: _Sample, measured: _Measured, pooled: ProbeStats, theory: _Theory,
          state: _State) -> _Rows:
    """The tensor rows (with ratios over the independent replicates: the draws when there are several
    seeds, else the batches), the parameter rows (the model as given), attention and depth rows."""
    stack = sample.stack
    index = stack.index if stack is not None else block_index  # a tinylm model's: its plan's, tested equal
    per_seed = len(sample.batches[0])
    several = len(sample.models) > 1
    replicates = [r.stats for r in measured.replicates]
    tensors = tensor_rows(pooled, theory.pooled, replicates, theory.per_rep,
                          lambda k: k // per_seed if several else k, theory.mode, index)
    return _Rows(tensors=tensors, params=param_rows(replicates[0], index, state.declared.dists),
                 attention=attention_rows(pooled, sample.seq_len, index),
                 depth=depth_rows(sample.sites.depth, pooled, theory.pooled))


def _judge(model: nn.Module, sample: _Sample, measured: _Measured, pooled: ProbeStats, rows: _Rows,
           thresholds: Thresholds, options: DiagnoseOptions, steps: _Steps, state: _State) -> _Verdicts:
    """Every verdict (:func:`diagnostics.judge.verdicts.judge`) with the evidence it needs, and the
    checks made (:func:`~diagnostics.judge.verdicts.coverage`); the rows get their verdicts."""
    deliberate = _deliberate_zeros(model, state.declared)
    loss_check, loss_reason = _loss_check(float(np.mean(measured.losses)), measured.vocabs, options,
                                          sample.source, state.at_init)
    arch = _architecture(model, sample.stack, state.declared)
    stream_reason = "" if sample.stack is not None else (
        "no block stack found (an nn.ModuleList or nn.Sequential of blocks of one class)")
    findings, tv, pv, av = judge(rows.tensors, rows.params, rows.attention, rows.depth, list(pooled.order),
                                 thresholds, deliberate, scale_invariant=_scale_invariant(model, arch),
                                 architecture=arch, flat=pooled.flat_frac, loss=loss_check, fresh=state.at_init,
                                 logits=_logit_scale(measured.logits), peaks=measured.peaks, kinds=state.kinds)
    judged, not_judged = coverage(rows.tensors, rows.params, rows.attention, rows.depth, arch, pooled.flat_frac,
                                  deliberate, loss_reason, stream_reason, fresh=state.at_init,
                                  logits=_logit_scale(measured.logits), peaks=measured.peaks)
    judged_rows = _Rows(tensors=[replace(r, verdict=tv.get((r.name, r.direction), "ok")) for r in rows.tensors],
                        params=[replace(p, verdict=pv.get(p.name, "ok")) for p in rows.params],
                        attention=[replace(a, verdict=av.get(a.name, "ok")) for a in rows.attention],
                        depth=rows.depth)
    steps.advance("verdicts")
    return _Verdicts(judged_rows, findings, judged, not_judged)


def _header(model: nn.Module, sample: _Sample, measured: _Measured, theory: _Theory,
            options: DiagnoseOptions, state: _State) -> Header:
    """What was measured, how, and the mean loss beside ln V of the logits where the loss is their
    next-token cross-entropy (a tinylm model's: its vocabulary)."""
    tiny = isinstance(model, tinylm.TransformerLM)
    vocab = next(iter(measured.vocabs)) if len(measured.vocabs) == 1 else None
    loss = float(np.mean(measured.losses))
    dtype, device = parameter_placement(model)
    header = Header(
        model_class=type(model).__name__, config=model.config.to_dict() if tiny else None,
        parameter_count=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        init=state.declared.scheme or "",
        tokens_measured=sum(b.shape[0] for bs in sample.batches for b in bs) * sample.seq_len,
        batch_size=options.batch_size, seq_len=sample.seq_len, batches=len(sample.batches[0]),
        seeds=len(sample.models), seed=options.seed, theory=theory.mode, loss=loss,
        loss_uniform=math.log(vocab) if vocab else None, token_source=sample.source,
        declared=state.declared.words, fresh=state.fresh, fresh_rule=FRESH_RULE, dtype=dtype, device=device,
        kv_heads=kv_heads(model), kinds=[k.to_dict() for k in state.kinds])
    return replace(header, interval=interval_scope(header))


# ----------------------------------------------------------------------------- theory's helpers


#: A parameter whose std is outside [1/x, x] times its declared init std breaks global theory's
#: premise (a fresh draw is within a few percent; a trained or rescaled model need not be).
INIT_MISMATCH = 2.0


def _init_mismatch(stats: ProbeStats) -> str:
    """Why global theory's premise fails, or "" when it holds: the parameter whose std is furthest
    from its declared init, when that is beyond :data:`INIT_MISMATCH`."""
    drifts = [(n, p.drift) for n, p in stats.params.items() if p.drift is not None]
    off = [(n, d) for n, d in drifts if not (math.isfinite(d) and 1 / INIT_MISMATCH <= d <= INIT_MISMATCH)]
    if not off:
        return ""
    name, drift = max(off, key=lambda t: abs(math.log(t[1])) if math.isfinite(t[1]) and t[1] > 0 else math.inf)
    return (f"global theory predicts from the declared init, but the weights do not follow it ({name} has "
            f"{drift:.3g}x its declared std); use theory 'local'")


def _outside_all(per_rep: list[Predictions], pooled: Predictions, why: str) -> tuple[list[Predictions], Predictions]:
    """Every prediction marked outside validity with reason ``why`` (a premise the measurement contradicts)."""
    def mark(preds: Predictions) -> Predictions:
        return {k: dataclasses.replace(p, valid=False, validity=why if p.valid else f"{why}; {p.validity}")
                for k, p in preds.items()}
    marked = [mark(pr) for pr in per_rep]
    return marked, (marked[0] if per_rep and pooled is per_rep[0] else mark(pooled))


def _predictions(mode: str, sample: _Sample, measured: _Measured, pooled: ProbeStats
                 ) -> tuple[list[Predictions], Predictions]:
    """(per-replicate predictions, pooled predictions) of ``mode``.

    Every loss is a mean over one batch's positions, so each prediction is for that count
    (``tokens``), the pooled one included (its moments hold all the batches' positions). The
    measured softmax moments check the premises of the cross-entropy rule (theory.predict): each
    replicate's own in local mode, their mean in global mode and for the pooled prediction. Global
    predictions are seed-independent: one serves every replicate.
    """
    softmaxes = measured.softmaxes
    pooled_softmax = (float(np.mean([s for s, _ in softmaxes])), float(np.mean([p for _, p in softmaxes])))
    # which positions of a sequence hold the same token: all the kernel theory needs of given tokens
    coincidence = None if sample.source == "random" or mode != "global" else \
        token_coincidence(torch.cat([b[:, :-1] for b in sample.batches[0]]))  # the first seed's: all are alike in law
    per_rep: list[Predictions] = []
    for rep, sm in zip(measured.replicates, softmaxes):
        if mode == "global" and per_rep:
            per_rep.append(per_rep[0])
            continue
        per_rep.append(predict(rep.model, mode, rep.stats, seq_len=sample.seq_len, tokens=rep.tokens,
                               softmax=pooled_softmax if mode == "global" else sm, coincidence=coincidence))
    pooled_pred = per_rep[0] if mode == "global" else predict(
        sample.models[0], mode, pooled, seq_len=sample.seq_len, tokens=measured.replicates[0].tokens,
        softmax=pooled_softmax)
    return per_rep, pooled_pred


# ----------------------------------------------------------------------------- the verdicts' evidence


def _deliberate_zeros(model: nn.Module, declared: Declaration) -> set[str]:
    """The modules a tinylm model's declared init makes exactly zero and that are still all zero (a
    zero-initialised output projection or w2, and the attention or FFN branch it ends): their zero
    output is by design, not dead."""
    deliberate: set[str] = set()
    if not isinstance(model, tinylm.TransformerLM):
        return deliberate
    decl = declared.dists
    named = dict(model.named_parameters())
    for pname, dist in decl.items():
        if dist.family == "constant" and dist.value == 0 and pname.endswith(".weight") \
                and not bool(named[pname].detach().any()):
            mod = pname[: -len(".weight")]
            deliberate.add(mod)
            if mod.endswith("attn.output_proj"):
                deliberate.add(mod[: -len(".output_proj")])
            if mod.endswith("ffn.w2"):
                deliberate.add(mod[: -len(".w2")])
    return deliberate


def _loss_check(loss: float, vocabs: set, options: DiagnoseOptions, source: str, fresh: bool | None
                ) -> tuple[tuple[float, float, str] | None, str]:
    """((loss, ln V, severity of a loss far above it), "") where the loss is judged against ln V, else
    (None, why not). Judged: the mean next-token cross-entropy of (B, T, V) logits. Severity "fail"
    where the model is known fresh (``fresh`` True) or the tokens are given (a trained model's loss on
    real tokens is below ln V); "warn" on random tokens for a model known trained (False) or of
    unknown state (None), where a trained model's loss is ln V plus how peaked its predictions are."""
    vocab = next(iter(vocabs)) if len(vocabs) == 1 else None
    if vocab is None:
        return None, ("a custom loss_fn is not next-token cross-entropy" if options.loss_fn is not None else
                      "the model's output holds no next-token logits (B, T, V)")
    if vocab < 2:
        return None, f"the logits have V = {vocab} classes"
    return (loss, math.log(vocab), "fail" if fresh or source == "given" else "warn"), ""


def _scale_invariant(model: nn.Module, arch: dict | None) -> bool:
    """Whether the backward stream is judged on Var(g) Var(x): a pre-norm tinylm model, or any other
    model whose blocks hold a norm module (pre-norm: exact; post-norm: its block outputs are
    normalised, so Var(x) is flat over depth and the product's gains are Var(g)'s)."""
    if isinstance(model, tinylm.TransformerLM):
        return model.config.norm == "pre"
    return bool(arch and arch.get("norms"))


def _architecture(model: nn.Module, stack=None, declared: Declaration | None = None) -> dict | None:
    """What the verdicts' causes and advice need to know of a model's build: a tinylm model's
    norm placement, FFN kind, RoPE, depth, head width and declared init (its tinylm scheme, else the
    declaration's words, "" for none); of any other module, {"norm": "none"} when its blocks hold no
    normalisation module (:func:`~diagnostics.measure.blocks.is_norm`), {"norms": True} when they hold one (placement unknown),
    None without a block stack."""
    if not isinstance(model, tinylm.TransformerLM):
        if stack is None:
            return None
        named = dict(model.named_modules())
        normed = any(is_norm(m) for b in stack.names for m in named[b].modules())
        return {"norms": True} if normed else {"norm": "none"}
    c = model.config
    init = c.init if declared is None else declared.scheme or (declared.words if declared.known else "")
    return {"norm": c.norm, "ffn": c.ffn, "rope": c.rope, "num_layers": c.num_layers, "d_model": c.d_model,
            "d_k": c.head_dim, "init": init}
