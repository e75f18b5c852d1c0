"""Verdicts: what is wrong, where, how badly (fail / warn) and why (the cause the evidence supports).

Every finding carries the number that triggered it, the threshold it crossed, its severity
and its cause, with the fix for that cause worded for the model's build. :func:`judge` is a
short pipeline: read the symptoms off the measurement (:mod:`.symptoms`), read the evidence of
each cause beside them (:mod:`.evidence`), attribute each symptom to the cause that explains
it, one finding per cause (:mod:`.causes`), and give each tensor, parameter and attention
layer its verdict. The thresholds are :class:`~.thresholds.Thresholds`; docs/verdicts.md holds
the decision table and the healthy models the thresholds were calibrated on.
"""

from __future__ import annotations

from ..result import AttentionRow, DepthRow, Finding, ParamRow, TensorRow
from . import symptoms
from .causes import attribute
from .evidence import evidence
from .symptoms import Reading, Sites
from .thresholds import Thresholds

__all__ = ["judge"]


def judge(tensors: list[TensorRow], params: list[ParamRow], attention: list[AttentionRow], depth: list[DepthRow],
          order: list[str], thresholds: Thresholds, deliberate_zero: set[str] = frozenset(),
          scale_invariant: bool = False, architecture: dict | None = None, flat: dict[str, float] | None = None,
          loss: tuple[float, float, str] | None = None, fresh: bool | None = None,
          logits: dict[str, float] | None = None, peaks: dict[str, float] | None = None,
          kinds: list | None = None
          ) -> tuple[list[Finding], dict[tuple[str, str], str], dict[str, str], dict[str, str]]:
    """All findings (one per cause, fail first), and the verdict of each tensor (name, direction),
    parameter and attention layer.

    ``order``: tensor names in forward execution order (the first non-finite one is named).
    ``deliberate_zero``: tensor names that are exactly zero by design (output of a Linear
    whose init scheme declares it constant 0, e.g. the zero-residual scheme).
    ``scale_invariant``: every read of the stream goes through a norm (pre-norm), so a
    stream c times smaller gets a gradient c times larger; the backward gains are then
    judged on Var(g_k) Var(x_k), which that rescaling leaves unchanged.
    ``architecture``: what is known of the build ({"norm", "ffn", "rope", "num_layers", "d_model",
    "d_k", "init"}; None for a module that is not a tinylm model): the causes and the advice
    depend on it. ``flat``: {SiLU gate input name: fraction of its entries in the flat region}.
    ``loss``: (mean next-token cross-entropy, ln V, the severity of a loss far above ln V), where
    the loss is judged (None: not judged). Block k's output is ``depth`` row k + 1 (row 0: the
    stream before the blocks); blocks are the tensors' ``block`` fields. ``fresh``: whether the
    weights are at their declared init (one decision per diagnosis; None: unknown): the score
    scaling is judged on fresh weights only. ``logits``: the output logits' scale
    ({"logz_mean", "logz_std", "logz_absmax", "max_logit", "rows"}, log Z = logsumexp of a row's
    logits; None: not read); ``peaks``: {block output name: max |x| / median |x|}. The precursors
    of a training failure (attention logits and entropy, the output logits, massive activations)
    are judged on weights not known fresh (``fresh`` False or None). ``kinds``: each weight kind's
    state (:class:`~.kinds.WeightKind`); a misscaled kind is a finding of its own (cause "kind_scale").
    """
    th = thresholds
    arch = architecture or {}
    norm = arch.get("norm")
    if norm is None and scale_invariant:
        norm = "pre"
    sites = Sites(tensors, order, depth)
    reading = Reading()
    # the symptoms, in this order: the roots an explosion marks decide what is downstream of it
    symptoms.non_finite(reading, tensors, params, sites, th)
    for direction, values in symptoms.stream_values(depth, scale_invariant):
        symptoms.stream(reading, direction, values, sites, th, scale_invariant)
    symptoms.branches(reading, tensors, sites, th, deliberate_zero)
    symptoms.starved_weights(reading, params, sites, th, deliberate_zero)
    symptoms.dead(reading, tensors, sites, th, deliberate_zero)
    symptoms.saturated(reading, attention, th)
    symptoms.loss(reading, loss, th)
    if fresh is not True:  # at a declared init these scales are the init's (the evidence below judges it)
        symptoms.attention_logits(reading, tensors, th)
        symptoms.attention_entropy(reading, attention, th)
        symptoms.output_logits(reading, logits, th)
        symptoms.massive(reading, peaks, sites, th)
    # the evidence beside them: scores read from a blown-up stream say nothing of their scaling
    # (float32 rounds q k at that size)
    # misscaled kinds are findings of their own: the model-wide weight scale is read without them,
    # unless every kind of the blocks is misscaled (the whole init off: that finding names them)
    misscaled = [k for k in kinds or () if k.state == "misscaled"]
    block_kinds = [k for k in kinds or () if k.blocks and k.factor is not None]
    whole = bool(block_kinds) and all(k.state == "misscaled" for k in block_kinds)
    apart = set() if whole else {n.removesuffix(".weight") for k in misscaled for n in k.names}
    ev = evidence(tensors, params, architecture, flat, set(deliberate_zero) | apart, depth, fresh)
    ev.kinds = misscaled
    ev.score_ratio = {b: r for b, r in ev.score_ratio.items() if not reading.downstream("forward", b)}
    ev.dead_blocks = {s.block for s in reading.symptoms if s.family == "dead" and ".ffn" in s.where}
    findings = attribute(reading.symptoms, ev, th, norm, reading.folded, arch)
    _name_in_tables(findings, reading, sites, params, attention)
    return findings, reading.tensors, reading.params, reading.attention


def _name_in_tables(findings: list[Finding], reading: Reading, sites: Sites, params: list[ParamRow],
                    attention: list[AttentionRow]) -> None:
    """A tensor, parameter or attention layer a finding names carries its kind as verdict in the
    tables too (where it has none other than ok)."""
    for f in findings:
        key = (f.where, f.direction or "forward")
        if key in sites.rows:
            if reading.tensors.get(key, "ok") == "ok":
                reading.tensors[key] = f.kind
        elif f.where in {p.name for p in params} and reading.params.get(f.where, "ok") == "ok":
            reading.params[f.where] = f.kind
        elif f.where in {a.name for a in attention} and reading.attention.get(f.where, "ok") == "ok":
            reading.attention[f.where] = f.kind
