"""``diagnose``: probe + theory + verdicts in one call, returning a :class:`DiagnoseResult`.

Each (seed, batch) pair is measured by its own probe and predicted by its own theory,
giving one ratio r = measured/predicted variance per pair. The independent replicates
are the weight draws when there are several seeds (a draw's batches share its deviation
from the expectation, so each draw's ratio is the geometric mean over its batches), else
the batches of the one draw, which cover batch noise but not the draw
(:func:`interval_scope` says which in words). A ratio of variances is positive and
multiplicative (2x over and 2x under are equally far from 1), so its 99% interval is a
Student-t interval on ln r over the replicates, exponentiated (:func:`log_t_interval`):

    ratio = exp(m),  [exp(m - h), exp(m + h)],  m = mean_r ln r,  h = t_{0.995, R-1} sd_r(ln r) / sqrt(R)

The point is the geometric mean of the replicates; the interval is asymmetric
around it and always positive. It is never taken over the elements of one tensor
(those are correlated).

Theory: "global" for a freshly initialised tinylm model (every parameter's std within 5%
of its declared init), "local" otherwise (:func:`diagnostics.theory.predict`). In global
mode the forward predictions come from the token-kernel theory (:mod:`diagnostics.theory.tokenkernel`),
computed once per process for each (config, seq_len, scheme, token coincidences): the
seeds and batches of a run share it, as they share every global prediction (the theory
is seed-independent). Given tokens enter it through the fraction of sequences holding
the same token at two positions (:func:`diagnostics.theory.tokenkernel.token_coincidence`); uniform
random tokens through its expectation, 1/V. The backward predictions stay with the
independent-token rules.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import replace
from datetime import datetime, timezone
import warnings
from collections.abc import Mapping
from functools import lru_cache

import numpy as np
import torch
from scipy import stats as sstats
from torch import Tensor, nn

import tinylm
from tinylm.init import declare

from ..theory.tokenkernel import token_coincidence
from ..options import DiagnoseOptions, OptionsError, ProbeOptions
from ..measure.sites import model_sites
from ..measure.probe import block_index, probe
from ..result import AttentionRow, DepthRow, DiagnoseResult, Header, ParamRow, TensorRow
from ..measure.moments import ProbeStats
from ..theory import Prediction, predict
from ..judge import Thresholds, coverage, judge

__all__ = ["diagnose", "interval_scope", "log_t_interval", "t_interval"]

CONFIDENCE = 0.99


@lru_cache(maxsize=256)
def _t_quantile(q: float, df: int) -> float:
    return float(sstats.t.ppf(q, df))


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """(mean, low, high): symmetric Student-t interval of the mean of independent replicates
    (None, None if fewer than 2 finite values; non-finite values are dropped).

    For quantities on a linear scale that may be negative (slopes of log-variance over
    depth, in :mod:`diagnostics.compare`). A positive ratio takes :func:`log_t_interval`.
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


def interval_scope(header) -> str:
    """What the 99% intervals of a result's ratios cover, in words, from its :class:`Header`
    (seeds, batches, theory); "" when there are no ratios (theory off or none).

    The replicates are the (seed, batch) pairs. With several seeds each replicate is its own
    weight draw, so the interval covers the draw and the batches. With one seed the replicates
    are batches of one draw: the interval covers batch noise only. Global theory predicts the
    expectation over draws, so there it says so (a draw's own deviation, a few percent at small
    width, is not covered: pass seeds > 1); local theory predicts from the actual weights, so
    batch noise is all there is to cover.
    """
    if header.theory not in ("local", "global"):
        return ""
    if header.seeds > 1:
        return f"{header.seeds} weight draws x {header.batches} batch(es)"
    if header.theory == "global":
        return f"{header.batches} batches of one weight draw (batch noise, not the draw)"
    return f"{header.batches} batches of these weights"


def _exp(x: float) -> float:
    """e^x, inf beyond the float64 range instead of OverflowError."""
    return math.exp(x) if x < 709.0 else math.inf


def _context(model: nn.Module) -> int | None:
    """The longest sequence the model takes: a tinylm model's context_length, else a config's
    ``max_position_embeddings`` or ``n_positions`` (Hugging Face), else None (unknown)."""
    config = getattr(model, "config", None)
    if isinstance(model, tinylm.TransformerLM):
        return config.context_length
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def _vocab(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    for m in model.modules():
        if isinstance(m, (nn.Embedding, tinylm.Embedding)):
            return m.num_embeddings
    return None


def _batches(model: nn.Module, tokens, options: DiagnoseOptions, seq_len: int) -> tuple[list[list[Tensor]], str]:
    """The measured batches of each seed, each (B, seq_len + 1) int64. Random tokens and windows of a
    1-D stream are drawn afresh for every seed (the first seed's are those of a one-seed run), so
    that the seeds are independent replicates; given (N, T+1) windows are the same for every seed."""
    draws = options.seeds
    if tokens is None:
        vocab = _vocab(model)
        if vocab is None:
            raise OptionsError("tokens=None: cannot draw random tokens for a model without a vocabulary "
                               "(no config.vocab_size, no Embedding); pass tokens=")
        gen = torch.Generator().manual_seed(options.seed)
        return [[torch.randint(0, vocab, (options.batch_size, seq_len + 1), generator=gen)
                 for _ in range(options.batches)] for _ in range(draws)], "random"
    if not isinstance(tokens, Tensor):
        arr = np.asarray(tokens)  # a memory-mapped token file stays mapped: only the sampled windows are read
        if arr.dtype.kind not in "iu":
            raise OptionsError(f"tokens dtype {arr.dtype}: token ids must be integers")
        stream = arr if arr.ndim == 1 else None
        t = None if stream is not None else torch.from_numpy(np.array(arr, dtype=np.int64))
    else:
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise OptionsError(f"tokens dtype {tokens.dtype}: token ids must be integers")
        t = tokens.long()
        stream = t.numpy() if t.dim() == 1 else None
    if stream is not None:
        from tinylm.data import get_batch

        gen = torch.Generator().manual_seed(options.seed)
        out = []
        for _ in range(draws):
            out.append([])
            for _ in range(options.batches):
                x, y = get_batch(stream, options.batch_size, seq_len, gen)
                out[-1].append(torch.cat([x, y[:, -1:]], dim=1))
        return out, "given"
    if t.dim() != 2 or t.shape[1] < 3:
        raise OptionsError(f"tokens shape {tuple(t.shape)}: pass (N, T+1) windows with T >= 2, or a 1-D token stream")
    b = options.batch_size
    chunks = [t[i:i + b] for i in range(0, t.shape[0], b)]
    if len(chunks) > 1 and chunks[-1].shape[0] < b:
        chunks = chunks[:-1]
    return [chunks] * draws, "given"


def _call(model: nn.Module, ids: Tensor, options: DiagnoseOptions):
    """The model's output on token ids (B, T), called as ``options.inputs`` says."""
    x = options.inputs(ids) if options.inputs is not None else ids
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def _read(output) -> tuple[Tensor | None, Tensor | None]:
    """(logits, loss) of a model's output, either None: a tensor (0-d: a loss), a tuple or list
    (its first tensor), or an object or mapping with ``logits`` / ``loss`` (a Hugging Face ModelOutput)."""
    if isinstance(output, Tensor):
        return (output, None) if output.dim() else (None, output)
    if isinstance(output, (tuple, list)):
        first = next((o for o in output if isinstance(o, Tensor)), None)
        return _read(first) if first is not None else (None, None)
    get = output.get if isinstance(output, Mapping) else (lambda k: getattr(output, k, None))
    logits, loss = get("logits"), get("loss")
    return (logits if isinstance(logits, Tensor) else None), (loss if isinstance(loss, Tensor) else None)


_HOW = ("diagnose reads next-token logits (B, T, V), a tuple whose first tensor they are, an object with .logits "
        "or .loss, or a 0-d loss; pass DiagnoseOptions(inputs=ids -> model arguments, loss_fn=(logits, targets) -> "
        "loss) (diagnostics/API.md)")


def _loss(model: nn.Module, batch: Tensor, options: DiagnoseOptions | None = None
          ) -> tuple[Tensor, tuple[float, float], int | None]:
    """The loss of ``batch`` (B, T+1) whose gradient is measured, the two softmax moments the
    theory's cross-entropy-gradient rule rests on, over its B*T positions: (E[sum_c p_c^2], E[p_y])
    (NaN without next-token logits), and V when the loss is the mean next-token cross-entropy of
    (B, T, V) logits (None otherwise: the loss is then not comparable with ln V).

    The moments are computed under no_grad from the logits upcast to float32, in chunks of rows
    (memory stays ~16 MB whatever the vocabulary), and summed in float64.
    """
    options = options or DiagnoseOptions()
    batch = batch.to(next((p.device for p in model.parameters()), batch.device))  # tokens go where the weights are
    ids, targets = batch[:, :-1], batch[:, 1:]
    output = _call(model, ids, options)
    logits, own = _read(output)
    next_token = logits is not None and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) \
        and logits.is_floating_point() and int(targets.max()) < logits.shape[-1]
    if options.loss_fn is not None:
        if logits is None:
            raise OptionsError(f"model output {type(output).__name__}: holds no logits tensor for loss_fn; {_HOW}")
        loss = options.loss_fn(logits, targets)
    elif next_token:
        loss = tinylm.functional.cross_entropy(logits.float(), targets)
    elif own is not None:
        loss = own
    else:
        shape = f" of shape {tuple(logits.shape)}" if logits is not None else ""
        raise OptionsError(f"model output {type(output).__name__}{shape}: not next-token logits for ids of shape "
                           f"{tuple(ids.shape)}; {_HOW}")
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise OptionsError(f"loss {type(loss).__name__}: must be a one-element float tensor; {_HOW}")
    loss = loss.reshape(())
    if not next_token:
        return loss, (math.nan, math.nan), None
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])  # (B*T, V)
        y = targets.reshape(-1, 1).to(flat.device)
        rows = max(1, (1 << 22) // flat.shape[1])
        s2 = torch.zeros((), dtype=torch.float64, device=flat.device)
        py = torch.zeros((), dtype=torch.float64, device=flat.device)
        for i in range(0, flat.shape[0], rows):
            p = torch.softmax(flat[i:i + rows].float(), dim=-1)
            s2 += p.square().sum(dtype=torch.float64)
            py += p.gather(1, y[i:i + rows]).sum(dtype=torch.float64)
        n = max(flat.shape[0], 1)
    return loss, (float(s2) / n, float(py) / n), None if options.loss_fn is not None else int(logits.shape[-1])


def _models(model: nn.Module, options: DiagnoseOptions) -> list[nn.Module]:
    if options.seeds == 1:
        return [model]
    if not isinstance(model, tinylm.TransformerLM):
        raise OptionsError(f"seeds={options.seeds}: re-initialising needs a tinylm.TransformerLM; use seeds=1")
    out = []
    for i in range(options.seeds):
        m = copy.deepcopy(model)
        tinylm.init.apply(m, model.config.init, generator=torch.Generator().manual_seed(options.seed + i))
        m.zero_grad(set_to_none=True)
        out.append(m)
    return out


def _fresh_init(stats: ProbeStats) -> bool:
    drifts = [p.drift for p in stats.params.values() if p.drift is not None]
    consts = [p for p in stats.params.values() if p.declared_std == 0]
    return bool(drifts) and all(abs(d - 1) < 0.05 for d in drifts) and all(p.std == 0 for p in consts)


def _per_draw(ratios: list[tuple[int, float]]) -> list[float]:
    """One ratio per independent replicate from (group, ratio) pairs: the geometric mean of each group's
    ratios (a group holding a ratio that is not finite and positive passes that one on, for
    :func:`log_t_interval` to report). The group is the weight draw when there are several (the
    batches of one draw share its deviation, so they are not independent of each other), else the
    batch."""
    groups: dict[int, list[float]] = {}
    for g, r in ratios:
        groups.setdefault(g, []).append(r)
    out = []
    for values in groups.values():
        bad = [r for r in values if not (math.isfinite(r) and r > 0)]
        out.append(bad[0] if bad else _exp(float(np.mean(np.log(values)))))
    return out


def _comparable(p: Prediction) -> bool:
    """Whether a predicted variance can divide a measured one: finite and positive."""
    return math.isfinite(p.var) and p.var > 0


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


def _outside_all(per_rep: list[dict], pooled: dict, why: str) -> tuple[list[dict], dict]:
    """Every prediction marked outside validity with reason ``why`` (a premise the measurement contradicts)."""
    def mark(preds: dict) -> dict:
        return {k: dataclasses.replace(p, valid=False, validity=why if p.valid else f"{why}; {p.validity}")
                for k, p in preds.items()}
    marked = [mark(pr) for pr in per_rep]
    return marked, (marked[0] if per_rep and pooled is per_rep[0] else mark(pooled))


def _predictions(mode, replicates, softmaxes, pooled, models, batches, source, seq_len, pooled_softmax):
    """(per-replicate predictions, pooled predictions) of ``mode`` (see :func:`diagnose`)."""
    per_rep: list[dict[tuple[str, str], Prediction]] = []
    # which positions of a sequence hold the same token: all the kernel theory needs of given tokens
    coincidence = None if source == "random" or mode != "global" else \
        token_coincidence(torch.cat([b[:, :-1] for b in batches]))  # the first seed's: all are alike in law
    for (st, m, n_tok), sm in zip(replicates, softmaxes):
        if mode == "global" and per_rep:
            per_rep.append(per_rep[0])
            continue
        per_rep.append(predict(m, mode, st, seq_len=seq_len, tokens=n_tok,
                               softmax=pooled_softmax if mode == "global" else sm, coincidence=coincidence))
    pooled_pred = per_rep[0] if mode == "global" else predict(models[0], mode, pooled, seq_len=seq_len,
                                                                  tokens=replicates[0][2], softmax=pooled_softmax)
    return per_rep, pooled_pred


def _loss_check(loss: float, vocabs: set, options: DiagnoseOptions, tiny: bool, source: str, fresh: bool
                ) -> tuple[tuple[float, float, str] | None, str]:
    """((loss, ln V, severity of a loss far above it), "") where the loss is judged against ln V, else
    (None, why not). Judged: the mean next-token cross-entropy of (B, T, V) logits, of a tinylm model
    whose weights follow its declared init or of any other model (whose state is unknown). Severity
    "fail" where the model is known to be fresh or the tokens are given (a trained model's loss on
    real tokens is below ln V); "warn" for another model on random tokens, where a trained model's
    loss is ln V plus how peaked its predictions are."""
    vocab = next(iter(vocabs)) if len(vocabs) == 1 else None
    if vocab is None:
        return None, ("a custom loss_fn is not next-token cross-entropy" if options.loss_fn is not None else
                      "the model's output holds no next-token logits (B, T, V)")
    if vocab < 2:
        return None, f"the logits have V = {vocab} classes"
    if tiny and not fresh:
        return None, ("judged at init only: the weights do not follow the declared init (trained?), and on random "
                      "tokens a trained model's loss is ln V plus how peaked its predictions are")
    return (loss, math.log(vocab), "fail" if tiny or source == "given" else "warn"), ""


def _architecture(model: nn.Module, stack=None) -> dict | None:
    """What the verdicts' causes and advice need to know of a model's build: a tinylm model's
    norm placement, FFN kind, RoPE, depth, head width and init scheme; of any other module, only
    {"norm": "none"} when its blocks hold no normalisation module (no class whose name holds
    "Norm": LayerNorm, RMSNorm, LlamaRMSNorm, ...), else None (unknown)."""
    if not isinstance(model, tinylm.TransformerLM):
        if stack is None:
            return None
        named = dict(model.named_modules())
        normed = any("Norm" in type(m).__name__ for b in stack.names for m in named[b].modules())
        return None if normed else {"norm": "none"}
    c = model.config
    return {"norm": c.norm, "ffn": c.ffn, "rope": c.rope, "num_layers": c.num_layers, "d_model": c.d_model,
            "d_k": c.head_dim, "init": c.init}


def diagnose(model: nn.Module, tokens=None, options: DiagnoseOptions | None = None) -> DiagnoseResult:
    """Measure every instrumented tensor forward and backward, predict it, judge it.

    Args:
        model: any nn.Module, called on token ids (B, T) (or as ``options.inputs`` builds its
            arguments); its output is read as next-token logits (B, T, V), a tuple's first
            tensor, ``.logits`` / ``.loss`` (a Hugging Face ModelOutput) or a 0-d loss. The
            residual stream is its block stack's (found by structure); theory needs a
            tinylm.TransformerLM. Left exactly as it was.
        tokens: (N, T+1) windows, a 1-D token stream, or None (uniform random, seeded).
        options: :class:`DiagnoseOptions`.
    Returns: a :class:`DiagnoseResult` (see diagnostics/API.md), whose ``judged`` and
        ``not_judged`` say which checks could be made; neither the stream nor the loss
        judged is status "not judged", never healthy.
    """
    options = options or DiagnoseOptions()
    if not isinstance(options, DiagnoseOptions):
        raise OptionsError(f"options={type(options).__name__}: pass a diagnostics.DiagnoseOptions")
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: diagnose needs a torch.nn.Module")
    thresholds = options.thresholds or Thresholds()
    if not isinstance(thresholds, Thresholds):
        raise OptionsError(f"thresholds={thresholds!r}: pass a diagnostics.Thresholds")
    tiny = isinstance(model, tinylm.TransformerLM)
    context = _context(model)
    seq_len = options.seq_len or (min(context, 128) if context else 128)
    if context and seq_len > context:
        raise OptionsError(f"seq_len={seq_len} > the model's context_length={context}: pass seq_len <= {context}")
    seed_batches, source = _batches(model, tokens, options, seq_len)
    batches = seed_batches[0]
    seq_len = batches[0].shape[1] - 1
    if context and seq_len > context:
        raise OptionsError(f"tokens of length {seq_len} + 1 > the model's context_length={context} + 1: "
                           "cut the windows")
    models = _models(model, options)
    progress = options.progress
    total = len(models) * len(batches) + 2
    done = 0

    replicates: list[tuple[ProbeStats, nn.Module, int]] = []
    losses: list[float] = []
    vocabs: set[int | None] = set()  # V of the next-token logits per batch (None: no loss against ln V)
    softmaxes: list[tuple[float, float]] = []  # (E[sum p^2], E[p_y]) per replicate
    for mi, m in enumerate(models):
        for bi, batch in enumerate(seed_batches[mi]):
            popts = ProbeOptions(spectral=(mi == 0 and bi == 0), params=(bi == 0))
            with probe(m, popts) as run:
                loss, moments, logit_vocab = _loss(m, batch, options)
                loss.backward()
            vocabs.add(logit_vocab)
            losses.append(float(loss.detach()))
            softmaxes.append(moments)
            replicates.append((run.stats, m, batch.shape[0] * seq_len))
            done += 1
            if progress:
                progress(done, total, f"measured seed {options.seed + mi}, batch {bi + 1}/{len(batches)}")
    pooled = replicates[0][0]
    for st, _, _ in replicates[1:]:
        pooled = pooled.merge(st)
    first_params = replicates[0][0].params

    # theory
    mode = options.theory
    if mode == "off":
        pass  # measurement only, as asked
    elif not tiny:
        mode = "none"
    elif mode == "auto":
        mode = "global" if _fresh_init(replicates[0][0]) else "local"
    # Every loss is a mean over one batch's positions, so each prediction is for that count
    # (``tokens``), the pooled one included (its moments hold all the batches' positions). The
    # measured softmax moments check the premises of the cross-entropy rule (theory.predict).
    per_rep: list[dict[tuple[str, str], Prediction]] = []
    pooled_pred: dict[tuple[str, str], Prediction] = {}
    pooled_softmax = (float(np.mean([s for s, _ in softmaxes])), float(np.mean([p for _, p in softmaxes])))
    if mode in ("local", "global"):
        try:
            per_rep, pooled_pred = _predictions(mode, replicates, softmaxes, pooled, models, batches, source,
                                                seq_len, pooled_softmax)
            mismatch = _init_mismatch(replicates[0][0]) if mode == "global" and len(models) == 1 else ""
            if mismatch:
                per_rep, pooled_pred = _outside_all(per_rep, pooled_pred, mismatch)
        except Exception as e:  # noqa: BLE001 - theory never takes the measurement, the verdict or the exit code down
            warnings.warn(f"theory ({mode}) could not be computed for this model ({type(e).__name__}: {e}); "
                          "the measurements and verdicts stand without predictions", RuntimeWarning, stacklevel=2)
            mode, per_rep, pooled_pred = "none", [], {}
    done += 1
    if progress:
        progress(done, total, f"theory ({mode})")

    # tensor rows
    sites = model_sites(model)
    stack = sites.blocks
    index = stack.index if stack is not None else block_index  # a tinylm model's: its plan's, tested equal
    rows: list[TensorRow] = []
    names = list(pooled.order)
    for direction in ("forward", "backward"):
        seq = names if direction == "forward" else list(reversed(names))
        for name in seq:
            mom = pooled.tensors.get((name, direction))
            if mom is None:
                continue
            pred = pooled_pred.get((name, direction))
            ratio = low = high = None
            if pred is not None and _comparable(pred):
                rs = []
                for k, ((st, _, _), pr) in enumerate(zip(replicates, per_rep)):
                    mm, pp = st.tensors.get((name, direction)), pr.get((name, direction))
                    if mm is not None and pp is not None and _comparable(pp) and mm.count:
                        rs.append((k // len(batches) if len(models) > 1 else k, mm.var / pp.var))
                ratio, low, high = log_t_interval(_per_draw(rs))
            rows.append(TensorRow(
                name=name, block=index(name), kind=pooled.kinds.get(name, "module"), direction=direction,
                count=int(mom.count), mean=mom.mean, var=mom.var, mean_square=mom.mean_square, max_abs=mom.max_abs,
                frac_zero=mom.frac_zero, frac_nonfinite=mom.frac_nonfinite,
                frac_fp16_underflow=mom.frac_fp16_underflow, frac_fp16_overflow=mom.frac_fp16_overflow,
                frac_bf16_underflow=mom.frac_bf16_underflow, frac_bf16_overflow=mom.frac_bf16_overflow,
                predicted=pred.var if pred is not None else None, ratio=ratio, ratio_low=low, ratio_high=high,
                theory=mode if pred is not None else "", valid=pred.valid if pred is not None else True,
                validity=pred.validity if pred is not None else "", rule=pred.rule if pred is not None else "",
                predicted_independent=pred.independent.var if pred is not None and pred.independent else None,
            ))

    params = [ParamRow(
        name=n, block=index(n), shape=tuple(p.shape), std=p.std, declared_std=p.declared_std,
        declared=p.declared, drift=p.drift, spectral_norm=p.spectral_norm, stable_rank=p.stable_rank,
        grad_std=p.grad_std, frac_nonfinite=p.frac_nonfinite) for n, p in first_params.items()]

    attention: list[AttentionRow] = []
    for name, am in pooled.attention.items():
        base = name[: -len(".probs")] if name.endswith(".probs") else name
        sc = pooled.tensors.get((f"{base}.scores", "forward"))
        T = seq_len
        attention.append(AttentionRow(
            name=base, block=index(name) if index(name) is not None else -1,
            score_std=sc.std if sc is not None else math.nan, entropy_mean=am.entropy_mean,
            entropy_min=am.entropy_min, entropy_uniform=float(np.mean(np.log(np.arange(1, T + 1)))),
            saturated_frac=am.saturated_frac))

    depth: list[DepthRow] = []
    for k, name in enumerate(sites.depth):
        f = pooled.tensors.get((name, "forward"))
        if f is None:
            continue
        b = pooled.tensors.get((name, "backward"))
        pf, pb = pooled_pred.get((name, "forward")), pooled_pred.get((name, "backward"))
        cos = pooled.cosine.get(name)
        depth.append(DepthRow(index=k, name=name, forward_var=f.var, forward_predicted=pf.var if pf else None,
                              backward_var=b.var if b is not None else None,
                              backward_predicted=pb.var if pb else None,
                              cosine=cos.mean if cos is not None else math.nan,
                              cosine_predicted=pf.cosine if pf is not None else None))

    # verdicts
    deliberate: set[str] = set()
    if tiny:
        decl = declare(model, model.config.init) if model.config.init in tinylm.init.SCHEMES else {}
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
    loss_check, loss_reason = _loss_check(float(np.mean(losses)), vocabs, options, tiny, source,
                                          tiny and _fresh_init(replicates[0][0]))
    stream_reason = "" if stack is not None else (
        "no block stack found (an nn.ModuleList or nn.Sequential of blocks of one class)")
    findings, tv, pv, av = judge(rows, params, attention, depth, list(pooled.order), thresholds, deliberate,
                                 scale_invariant=tiny and model.config.norm == "pre",
                                 architecture=_architecture(model, stack), flat=pooled.flat_frac, loss=loss_check)
    judged, not_judged = coverage(rows, params, attention, depth, _architecture(model, stack), pooled.flat_frac,
                                  deliberate, loss_reason, stream_reason)
    rows = [dataclasses.replace(r, verdict=tv.get((r.name, r.direction), "ok")) for r in rows]
    params = [dataclasses.replace(p, verdict=pv.get(p.name, "ok")) for p in params]
    attention = [dataclasses.replace(a, verdict=av.get(a.name, "ok")) for a in attention]
    done += 1
    if progress:
        progress(done, total, "verdicts")

    config = model.config.to_dict() if tiny else None
    # ln V of the logits where the loss is their next-token cross-entropy (a tinylm model's: its vocabulary)
    vocab = next(iter(vocabs)) if len(vocabs) == 1 else None
    header = Header(
        model_class=type(model).__name__, config=config,
        parameter_count=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        init=model.config.init if tiny else "", tokens_measured=sum(b.shape[0] for bs in seed_batches for b in bs) * seq_len,
        batch_size=options.batch_size, seq_len=seq_len, batches=len(batches), seeds=len(models), seed=options.seed,
        theory=mode, loss=float(np.mean(losses)), loss_uniform=math.log(vocab) if vocab else None,
        token_source=source)
    header = replace(header, interval=interval_scope(header))
    return DiagnoseResult(header=header, tensors=rows, params=params, attention=attention, depth=depth,
                          findings=findings, thresholds=thresholds.to_dict(),
                          created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          judged=judged, not_judged=not_judged)
