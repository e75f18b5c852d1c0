"""Causes: each symptom goes to the cause whose evidence explains it, and each cause makes one finding.

First every cause with evidence of its own is opened (attention scores not scaled, weights
badly scaled, gates driven into SiLU's flat region, a deep post-norm stack, q/k weights too
large). Then each symptom is attributed in the order docs/verdicts.md gives ("How a cause is
chosen"): saturated and dead symptoms first, since the stream symptoms they cause go to them;
non-finite tensors and the loss last, to the cause of the explosion they end, if any. A symptom
no evidence explains gets cause "unclear", and its finding says what was ruled out. Each cause
then makes one finding naming the symptoms it explains as consequences, with the fix for that
cause worded for the model's build.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..result import Finding
from .evidence import Evidence
from .kinds import kind_cause, role
from .symptoms import Symptom, fmt
from .thresholds import Thresholds

__all__ = ["CAUSES", "SEVERITIES", "attribute"]

#: The causes a finding can name, each with its words in the report.
CAUSES = {
    "non_finite": "non-finite values",
    "score_scale": "attention scores not scaled by 1/sqrt(d_k)",
    "saturated_attention": "saturated attention",
    "dead_units": "dead units",
    "init_scale": "badly scaled weights",
    "kind_scale": "one weight kind misscaled",
    "no_norm": "no normalisation",
    "post_norm_depth": "deep post-norm",
    "logit_scale": "logits too large",
    "attn_logits": "attention logits growing",
    "attn_entropy": "attention entropy collapse",
    "output_logits": "output logits drifting",
    "massive_activations": "massive activations",
    "unclear": "cause unclear",
}

#: the precursors' symptom families (:mod:`.symptoms`), each judged by its own cause unless an
#: earlier one explains it
_PRECURSORS = ("attn_logit", "attn_entropy", "logits", "massive")

#: A finding's severity: "fail" (broken: will not train, or already diverged) or "warn"
#: (trains, with care).
SEVERITIES = ("fail", "warn")

#: symptom kinds, the gravest first (a finding's kind is the gravest of what it explains)
_KIND_ORDER = ("non_finite", "exploding", "vanishing", "dead", "saturated", "misscaled", "imbalanced")

_QK_ADVICE = ("re-initialise q_proj and k_proj with std ~1/sqrt(d_model), or add QK-norm (an RMSNorm on q and k "
              "per head)")


@dataclass
class _Cause:
    """One cause's finding before its symptoms are folded in: its own evidence, sentence and advice.

    ``large`` / ``far`` (badly scaled weights only): the weights are too large (else too small);
    they are past the threshold squared, so they explain symptoms of either direction.
    """

    value: float
    threshold: float
    where: str
    block: int | None
    direction: str | None
    kind: str
    statistic: str
    text: str
    severity: str
    advice: str
    large: bool = False
    far: bool = False
    symptoms: list[Symptom] = field(default_factory=list)


class _Causes(dict):
    """The causes opened so far, by key (a cause name, or "unclear/<kind>/<direction>"), in the order opened."""

    def open(self, key: str, **kw) -> _Cause:
        """The cause ``key``, opened with ``kw`` unless it is open already (the first opening stands)."""
        if key not in self:
            self[key] = _Cause(**kw)
        return self[key]

    def explains(self, key: str, s: Symptom) -> None:
        self[key].symptoms.append(s)

    def open_for(self, key: str, s: Symptom, **kw) -> None:
        """Open ``key`` from symptom ``s`` (its where, block, statistic, value and threshold) and give it ``s``."""
        kw = {"value": s.value, "threshold": s.threshold, "where": s.where, "block": s.block,
              "statistic": s.statistic, **kw}
        self.open(key, **kw).symptoms.append(s)


def attribute(symptoms: list[Symptom], ev: Evidence, th: Thresholds, norm: str | None, folded: list[str],
              arch: dict) -> list[Finding]:
    """One finding per cause: its own evidence, the symptoms it explains, severity and advice.

    Args:
        symptoms: what :mod:`.symptoms` read, in reading order.
        ev: the evidence beside them.
        norm: the norm placement ("pre", "post", "none"; None: unknown).
        folded: readings downstream of the root cause, named in its finding.
        arch: what is known of the build ({"init", "num_layers", ...}).

    Returns:
        The findings, fail first, then in the order of :data:`CAUSES`.
    """
    causes = _Causes()
    _score_scale(causes, ev, th)
    _init_scale(causes, ev, th, arch)
    _kind_scale(causes, ev, th, arch)
    _dead_gates(causes, ev, th)
    _post_norm_depth(causes, ev, th, norm, arch)
    _qk_weights(causes, ev, th)
    # attention logits first (the saturated rows and the collapsed entropy they cause go to them),
    # then saturated and dead (the stream symptoms they cause are attributed to them)
    for s in sorted(symptoms, key=lambda s: (s.family != "attn_logit", s.family not in ("saturated", "dead"))):
        if s.family == "attn_logit":
            _attn_logit(causes, s, ev, th)
        elif s.family == "saturated":
            _saturated(causes, s, ev, th)
        elif s.family == "dead":
            _dead(causes, s)
        elif s.family not in ("non_finite", "loss") + _PRECURSORS:  # non-finite and the loss: last, to the
            _stream(causes, s, ev, th, norm)                         # explosion they end
    for s in symptoms:
        if s.family == "non_finite":
            _non_finite(causes, s)
    for s in symptoms:
        if s.family == "loss":
            _loss(causes, s)
    for s in symptoms:
        if s.family == "attn_entropy":
            _attn_entropy(causes, s)
        elif s.family == "logits":
            _output_logits(causes, s)
        elif s.family == "massive":
            _massive(causes, s)
    return _findings(causes, folded)


# ------------------------------------------------------------------ causes with evidence of their own

def _score_scale(causes: _Causes, ev: Evidence, th: Thresholds) -> None:
    """Scores wider than E[q^2] E[k^2] by more than score_ratio, judged on weights at their declared
    init only (on trained weights q and k align by learning, and the expectation 1 no longer holds)."""
    big = {b: r for b, r in ev.score_ratio.items() if r > th.score_ratio} if ev.fresh else {}
    if not big:
        return
    b = max(big, key=big.get)
    r = big[b]
    d_k = ev.d_k
    unscaled = d_k is not None and r > max(th.score_ratio, d_k / 2)
    expect = f"; without the 1/sqrt(d_k) scale it is d_k = {d_k}" if d_k else ""
    causes.open("score_scale", value=r, threshold=th.score_ratio, where=f"layers.{b}.attn.scores", block=b,
                direction="forward", kind="misscaled",
                statistic="E[score^2] / (E[q^2] E[k^2])",
                text=f"the attention scores' mean square is {fmt(r)} times E[q^2] E[k^2] in block {b} "
                     f"({len(big)} "
                     f"of {len(ev.score_ratio)} layers > {fmt(th.score_ratio)}; 1/sqrt(d_k) scaling gives about 1"
                     f"{expect})",
                severity="fail" if unscaled else "warn",
                advice="divide the scores by sqrt(d_k) (Q K^T / sqrt(d_k)); a custom attention that scales by 1 "
                       "or by 1/d_k^(1/4) makes the softmax d_k or sqrt(d_k) times too sharp")


def _init_scale(causes: _Causes, ev: Evidence, th: Thresholds, arch: dict) -> None:
    """Block weights whose median gain std^2 fan_in is outside [init_gain_low, init_gain_high], or whose
    median std is outside [1/init_drift, init_drift] times the declared scheme's; far out (past the
    threshold squared: two such layers in a row, as q.k or v then output_proj, compound it) the model
    is broken whatever the symptoms show."""
    gain_hi = ev.gain_all is not None and ev.gain_all > th.init_gain_high
    gain_lo = ev.gain_inner is not None and ev.gain_inner < th.init_gain_low
    drift_hi = ev.drift is not None and ev.drift > th.init_drift
    drift_lo = ev.drift is not None and ev.drift < 1 / th.init_drift
    if not (gain_hi or gain_lo or drift_hi or drift_lo):
        return
    large = gain_hi or drift_hi
    scheme = arch.get("init")
    if (drift_hi or drift_lo) and not (gain_hi or gain_lo):
        value, threshold, stat = ev.drift, th.init_drift if large else 1 / th.init_drift, \
            "median weight std / declared init std"
        text = (f"the block weights' std is {fmt(ev.drift)} times what their declared init ({scheme or 'declared'}) "
                f"gives "
                f"(median; {'>' if large else '<'} {fmt(threshold)})")
    else:
        value = ev.gain_all if large else ev.gain_inner
        threshold = th.init_gain_high if large else th.init_gain_low
        stat = "median std^2 fan_in of the block weights"
        text = (f"the block weights multiply a unit-variance input's variance by {fmt(value)} (median std^2 x "
                f"fan_in; {'>' if large else '<'} {fmt(threshold)}; fan-in rules give 1/3 to 2)"
                + (f", std {fmt(ev.drift)} times the declared {scheme}'s" if ev.drift is not None and scheme
                   else ""))
    far = (ev.gain_all is not None and ev.gain_all > th.init_gain_high ** 2) or \
          (ev.gain_inner is not None and ev.gain_inner < th.init_gain_low ** 2) or \
          (ev.drift is not None and not 1 / th.init_drift ** 2 <= ev.drift <= th.init_drift ** 2)
    causes.open("init_scale", value=value, threshold=threshold, where="model", block=None, direction=None,
                kind="misscaled", large=large, far=far, statistic=stat, text=text,
                severity="fail" if far else "warn",
                advice=("re-initialise with std ~1/sqrt(fan_in) (cs336, kaiming, torch-default), or the declared "
                        f"scheme{' ' + scheme if scheme else ''} as it is written; weights grown this large in "
                        "training point to a learning rate too high or no weight decay") if large else
                       ("re-initialise with std ~1/sqrt(fan_in) (cs336, kaiming): weights this small pass almost "
                        "nothing forward and get almost no gradient"))


def _kind_scale(causes: _Causes, ev: Evidence, th: Thresholds, arch: dict) -> None:
    """One finding per misscaled weight kind (:mod:`.kinds`), unless the model-wide badly scaled weights
    (init_scale) are open in the same direction: that finding names the kinds then."""
    init = causes.get("init_scale")
    for k in ev.kinds:
        if init is not None and init.large == (k.factor > 1):
            init.text += f"; {k.kind} x{fmt(k.factor)}"
            continue
        causes.open(f"kind_scale/{k.kind}", **kind_cause(k, th.init_drift, arch.get("num_layers"), ev.d_k))


def _kind_root(causes: _Causes, large: bool | None, only: str | None = None) -> str | None:
    """The first open misscaled-kind cause (key) whose direction is ``large`` (or any far one; any at
    all for None), of role ``only`` (:func:`.kinds.role`) where given; None when none is open."""
    for key, c in causes.items():
        if not key.startswith("kind_scale/") or (only and role(key.split("/", 1)[1], True) != only):
            continue
        if large is None or c.large == large or c.far:
            return key
    return None


def _dead_gates(causes: _Causes, ev: Evidence, th: Thresholds) -> None:
    """SiLU gates with more than dead_flat of their inputs below -6, driven there by a negative
    offset (mean < -0.25 std)."""
    dead = {b: f for b, f in ev.flat.items() if f > th.dead_flat and ev.gate_offset.get(b, 0.0) < -0.25}
    if not dead:
        return
    b = max(dead, key=dead.get)
    frac = dead[b]
    causes.open("dead_units", value=frac, threshold=th.dead_flat, where=f"layers.{b}.ffn.w1", block=b,
                direction="forward", kind="dead",
                statistic="fraction of SiLU inputs below -6 (flat region)",
                text=f"{fmt(100 * frac)}% of block {b}'s SiLU gate inputs sit in the flat region x < -6 (> "
                     f"{fmt(100 * th.dead_flat)}%; a zero-mean input puts at most 50% there), driven there by a "
                     f"negative offset (their mean is {fmt(ev.gate_offset[b])} standard deviations); "
                     f"{len(dead)} of {len(ev.flat)} FFNs",
                severity="fail" if frac > th.dead_flat_fail else "warn",
                advice="the gate weights (w1) point against the input's mean direction: re-initialise w1 zero-mean "
                       "(or lower the learning rate that pushed it there); units whose inputs all sit below -6 pass "
                       "almost nothing and get almost no gradient")


def _post_norm_depth(causes: _Causes, ev: Evidence, th: Thresholds, norm: str | None, arch: dict) -> None:
    """A post-norm stack whose stream gradient's variance changes more than post_norm_imbalance-fold
    over the blocks (always a warning)."""
    if not (norm == "post" and ev.imbalance is not None and ev.imbalance > th.post_norm_imbalance):
        return
    L = arch.get("num_layers", len(ev.grad_medians))
    causes.open("post_norm_depth", value=ev.imbalance, threshold=th.post_norm_imbalance,
                where="layers.0", block=0, direction="backward",
                kind="imbalanced", statistic="stream gradient variance, first block's output / last block's",
                text=f"post-norm at depth {L}: the stream's gradient variance is {fmt(ev.imbalance)} times larger at "
                     f"the first block's output than at the last's (> {fmt(th.post_norm_imbalance)}): each post-norm "
                     "rescales the gradient on its way down, so the blocks learn at different rates; Xiong et al. "
                     "2020 (Theorem 1) show post-LN's gradients near the output are large at init, which is why it "
                     "needs warm-up",
                severity="warn",
                advice="warm the learning rate up (a few hundred to thousands of steps, Xiong et al. 2020), or move "
                       "the norm before each branch (pre-norm: config norm='pre'), which needs no warm-up")


def _qk_weights(causes: _Causes, ev: Evidence, th: Thresholds) -> None:
    """q/k weights whose geometric-mean gain sqrt(g_q g_k) exceeds init_gain_high: attention made too
    sharp by its weights (unless the weights' scale or the score scaling already explains it)."""
    big = {b: g for b, g in ev.qk_gain.items() if g > th.init_gain_high}
    if not big or "init_scale" in causes or "score_scale" in causes or _kind_root(causes, True, "query_key"):
        return
    b = max(big, key=big.get)
    causes.open("saturated_attention", value=big[b], threshold=th.init_gain_high, where=f"layers.{b}.attn",
                block=b, direction="forward", kind="misscaled",
                statistic="sqrt(gain(q_proj) gain(k_proj)), gain = std^2 fan_in",
                text=f"block {b}'s q/k weights multiply variance by {fmt(big[b])} (std^2 x fan_in, geometric mean "
                     f"of q_proj and k_proj; > {fmt(th.init_gain_high)}; {len(big)} of {len(ev.qk_gain)} layers): "
                     "the scores are that many times too wide and the softmax too sharp",
                severity="warn", advice=_QK_ADVICE)


# ------------------------------------------------------------------ attributing the symptoms

def _saturated(causes: _Causes, s: Symptom, ev: Evidence, th: Thresholds) -> None:
    """Saturated rows: the score scaling if that layer's scores are misscaled, else its attention logits
    where they are a finding of their own (not explained by the q/k weights' evidence, nor by all
    weights far too large), else weights too large, else saturated attention itself (with the q/k
    weights' gain in the message)."""
    if "score_scale" in causes and s.block in ev.score_ratio and ev.score_ratio[s.block] > th.score_ratio:
        causes.explains("score_scale", s)
        return
    qk = ev.qk_gain.get(s.block)
    big = qk is not None and qk > th.init_gain_high
    init = causes.get("init_scale")
    if not (init is not None and init.far) and "attn_logits" in causes \
            and any(x.block == s.block for x in causes["attn_logits"].symptoms):
        causes.explains("attn_logits", s)  # logits grown in training make the rows one-hot
        return
    if init is not None and init.large:
        causes.explains("init_scale", s)
        return
    qk_kind = _kind_root(causes, True, "query_key")
    if qk_kind:
        causes.explains(qk_kind, s)
        return
    note = (f"; its q/k weights multiply variance by {fmt(qk)} (std^2 fan_in, > "
            f"{fmt(th.init_gain_high)}): too large" if big else
            "; the scores are scaled right and the q/k weights are not outsized, so the evidence "
            "does not separate learned sharp attention from q/k weights grown in training"
            if qk is not None else "")
    causes.open_for("saturated_attention", s, direction="forward", kind="saturated", text=s.text + note,
                    severity="warn",
                    advice=_QK_ADVICE if big else
                    ("if it appears early in training, lower the learning rate or add QK-norm; saturated "
                     "rows pass almost no gradient (p(1-p) < 0.01)"))


def _dead(causes: _Causes, s: Symptom) -> None:
    """Exactly-zero tensors: dead units."""
    causes.open_for("dead_units", s, direction="forward", kind="dead", text=s.text, severity="fail",
                    advice="units that output exactly zero get no gradient: look for a zeroed weight, a ReLU whose "
                           "inputs are all negative, or a mask that removes everything")


def _stream(causes: _Causes, s: Symptom, ev: Evidence, th: Thresholds, norm: str | None) -> None:
    """A stream, branch or weight-gradient symptom: dead units in its block, the score scaling or
    saturated attention (a backward explosion: the softmax's Jacobian, far off its mean), the weights'
    scale, post-norm depth (backward), no normalisation, else unclear (kept apart by kind and direction)."""
    dead_here = s.block in ev.dead_blocks or ev.flat.get(s.block, 0.0) > th.dead_flat
    backward_up = s.kind == "exploding" and s.direction == "backward"
    init = causes.get("init_scale")
    if s.family in ("branch", "grads") and "dead_units" in causes and dead_here \
            and (s.family == "grads" or s.where.endswith(".ffn")):
        causes.explains("dead_units", s)
    elif backward_up and "score_scale" in causes:
        causes.explains("score_scale", s)
    elif backward_up and "saturated_attention" in causes:
        causes.explains("saturated_attention", s)
    elif init is not None and (init.large == (s.kind == "exploding") or init.far):
        # weights off their rule in the symptom's direction explain it; weights far off explain every
        # reading, since a few layers then dwarf the rest
        causes.explains("init_scale", s)
    elif _kind_root(causes, s.kind == "exploding"):
        causes.explains(_kind_root(causes, s.kind == "exploding"), s)
    elif "post_norm_depth" in causes and s.direction == "backward":
        causes.explains("post_norm_depth", s)
    elif norm == "none":
        causes.open_for("no_norm", s, direction=s.direction, kind=s.kind,
                        text=s.text + ("; the model has no norm, so each block's output feeds the next one's scale"
                                       if s.family == "stream" else
                                       "; the model has no norm, so its branches read the stream at its own scale"),
                        severity="fail", advice=stream_advice("none", s.kind == "exploding"))
    elif "no_norm" in causes:
        causes.explains("no_norm", s)
    else:
        causes.open_for(f"unclear/{s.kind}/{s.direction}", s, direction=s.direction, kind=s.kind, text=s.text,
                        severity="fail",
                        advice=("the measurement does not single out a cause (scores scaled right, weights of "
                                "ordinary scale" + ("" if norm else ", norm placement unknown") + "): "
                                + stream_advice(norm, s.kind == "exploding")))


def _non_finite(causes: _Causes, s: Symptom) -> None:
    """A non-finite tensor goes to the cause of the explosion that reached it (else to misscaled
    scores or weights too large); non-finite weights are their own cause."""
    weights = "parameter(s) holding" in s.text
    root = next((n for n, c in causes.items() if any(x.kind == "exploding" for x in c.symptoms)), None)
    if root is None and not weights:
        root = next((n for n in ("score_scale", "init_scale") if n in causes
                     and (n == "score_scale" or causes[n].large)), None) or _kind_root(causes, True)
    if root is not None and not weights:
        causes.explains(root, s)
        return
    causes.open_for("non_finite", s, direction=s.direction, kind="non_finite", text=s.text, severity="fail",
                    advice=("the weights hold inf/NaN: training diverged (or the file is damaged); restore the last "
                            "finite checkpoint, then lower the learning rate, clip gradients or warm up")
                    if weights else
                    ("look at the op that produces this tensor: an overflow (lower the learning rate, check "
                     "the norms and the weights' scale) or a division by zero / log of zero"))



def _scale_root(causes: "_Causes") -> str | None:
    """The open cause a symptom of scale is the consequence of: an exploding or non-finite stream,
    else weights too large or far from their init (None: neither is open)."""
    root = next((n for n, c in causes.items() if any(x.kind in ("exploding", "non_finite") for x in c.symptoms)),
                None)
    init = causes.get("init_scale")
    if root is None and init is not None and (init.large or init.far):
        root = "init_scale"
    return root or _kind_root(causes, True)

def _loss(causes: _Causes, s: Symptom) -> None:
    """A loss far above ln V: logits blown up by an exploding or non-finite stream, or by weights too
    large, are their consequence; else the logits' scale is its own cause."""
    root = _scale_root(causes)
    if root is not None:
        causes.explains(root, s)
        return
    causes.open_for("logit_scale", s, where="loss", block=None, direction=None, kind="misscaled", text=s.text,
                    severity=s.severity,
                    advice="the logits are spread far wider than a fresh model's: scale the output layer down (std "
                           "about 1/sqrt(d_model), or 0.02), put a norm before it, and check the weights' scale; on "
                           "random tokens a trained model's loss is ln V plus how peaked its predictions are (pass "
                           "real tokens)")


def _attn_logit(causes: _Causes, s: Symptom, ev: Evidence, th: Thresholds) -> None:
    """A layer's attention logits past attn_logit: the score scaling, weights far off their rule (past
    the threshold squared) or q/k weights too large where their evidence shows it, else logits grown
    in training (one finding for every layer). Weights grown less in training do not explain them:
    the logits are the instability's own signal, and qk-norm its own fix."""
    if "score_scale" in causes and ev.score_ratio.get(s.block, 0.0) > th.score_ratio:
        causes.explains("score_scale", s)
    elif "init_scale" in causes and causes["init_scale"].far:
        causes.explains("init_scale", s)
    elif _kind_root(causes, True, "query_key"):
        causes.explains(_kind_root(causes, True, "query_key"), s)
    elif ev.qk_gain.get(s.block, 0.0) > th.init_gain_high and "saturated_attention" in causes:
        causes.explains("saturated_attention", s)
    elif "attn_logits" in causes:
        c = causes["attn_logits"]
        c.symptoms.append(s)
        if s.value > c.value:  # the finding names the largest
            c.value, c.where, c.block, c.text = s.value, s.where, s.block, s.text
    else:
        causes.open_for("attn_logits", s, direction="forward", kind="misscaled", text=s.text, severity="warn",
                        advice="attention logits growing in training precede attention entropy collapse and loss "
                               "spikes (Dehghani et al. 2023, Wortsman et al. 2023): normalise q and k (qk-norm, "
                               "ModelConfig(qk_norm=\"rms\")) or lower the learning rate")


def _attn_entropy(causes: _Causes, s: Symptom) -> None:
    """A layer's attention entropy collapsed: its grown logits, or the cause of its saturated rows,
    where one is open for it, or weights far off their rule; else entropy collapse itself."""
    for key in ("attn_logits", "score_scale", "saturated_attention"):
        if key in causes and (key != "attn_logits" or any(x.block == s.block for x in causes[key].symptoms)):
            causes.explains(key, s)
            return
    if "init_scale" in causes and causes["init_scale"].far:
        causes.explains("init_scale", s)
        return
    if _kind_root(causes, None, "query_key"):
        causes.explains(_kind_root(causes, None, "query_key"), s)
        return
    causes.open_for("attn_entropy", s, direction="forward", kind="saturated", text=s.text, severity="warn",
                    advice="attention entropy collapse makes training unstable (Zhai et al. 2023): lower the "
                           "learning rate, warm it up longer, or normalise q and k (qk-norm, "
                           "ModelConfig(qk_norm=\"rms\"))")


def _output_logits(causes: _Causes, s: Symptom) -> None:
    """The output logits' scale: a consequence of an explosion, of weights too large or of logits
    too large (the loss far above ln V) where those are open; else output-logit drift itself."""
    root = next((n for n, c in causes.items() if any(x.kind in ("exploding", "non_finite") for x in c.symptoms)),
                None)
    init = causes.get("init_scale")
    if root is None and init is not None and (init.large or init.far):
        root = "init_scale"
    root = root or _kind_root(causes, True)
    if root is None and "logit_scale" in causes:
        root = "logit_scale"
    if root is not None:
        causes.explains(root, s)
        return
    causes.open_for("output_logits", s, where="logits", block=None, direction=None, kind="misscaled", text=s.text,
                    severity="warn",
                    advice="the output logits grow or drift with nothing to hold them (a softmax ignores a shift, "
                           "so log Z wanders; large logits round away the small probabilities and overflow in "
                           "low precision): add a z-loss (TrainOptions(z_loss=1e-4), tinylm.functional.z_loss, "
                           "PaLM) or weight decay on the output layer")


def _massive(causes: _Causes, s: Symptom) -> None:
    """A block output's peak far above its median: weights too large or an explosion where open;
    else massive activations (a warning: they overflow float16 first, and dominate a norm's scale)."""
    root = _scale_root(causes)
    if root is not None:
        causes.explains(root, s)
        return
    causes.open_for("massive_activations", s, direction="forward", kind="misscaled", text=s.text, severity="warn",
                    advice="a few entries thousands of times the typical one (Sun et al. 2024) risk overflow in "
                           "float16 (largest finite 65504) and set the scale of every norm that reads them: keep "
                           "float32 or bfloat16 for the residual stream, lower the learning rate, or add weight "
                           "decay")


def stream_advice(norm: str | None, up: bool) -> str:
    """What to do about a stream that grows (``up``) or shrinks geometrically, for this build."""
    if norm == "none":
        return ("the model has no norm: add pre-norm (an RMSNorm before each branch, config norm='pre'), or "
                "scale the residual outputs by 1/sqrt(2L) (the gpt2 or small-init schemes)")
    if norm == "post":
        return ("post-norm re-normalises the stream after each block; a geometric change through it comes from "
                "the branches' weights: check their scale, warm the learning rate up, or move to pre-norm")
    if norm == "pre":
        return ("the model is pre-norm already, so the branches cannot feed the stream's scale back: check the "
                "weights' scale (init, or grown in training) and the learning rate")
    if up:
        return ("if the branches read the stream without a norm, add one (pre-norm); else check the weights' "
                "scale and scale the residual outputs by 1/sqrt(2L)")
    return "check the norm placement and the scale of the residual branches"


# ------------------------------------------------------------------ the findings

def _findings(causes: _Causes, folded: list[str]) -> list[Finding]:
    """One finding per cause, its consequences listed (the loss first, the precursors last), the
    readings folded into the first exploding or non-finite finding; fail first, then in the order
    of :data:`CAUSES`."""
    out: list[Finding] = []
    for key, c in causes.items():
        name = key.split("/")[0]
        own = sorted((s for s in c.symptoms if not c.text.startswith(s.text)),  # the loss first: the number a
                     key=lambda s: (s.family != "loss", s.family in _PRECURSORS))  # reader knows; precursors last
        severity = c.severity
        if name != "post_norm_depth" and any(s.severity == "fail" for s in c.symptoms):
            severity = "fail"
        kind = c.kind
        if c.symptoms and kind in ("imbalanced", "misscaled"):
            pool = c.symptoms
            if name == "init_scale":  # the kind says which way the weights are off, where a symptom shows it
                pool = [x for x in pool if (x.kind != "vanishing") == c.large] or pool
            kind = min((x.kind for x in pool), key=_KIND_ORDER.index)
        message = c.text
        if own:
            message += "; consequences: " + "; ".join(s.text for s in own[:3]) + (
                f"; and {len(own) - 3} more" if len(own) > 3 else "")
        out.append(Finding(kind=kind, where=c.where, value=c.value, threshold=c.threshold, message=message,
                           statistic=c.statistic, direction=c.direction, block=c.block,
                           suggestion=c.advice, severity=severity, cause=name))
    if folded and out:
        i = next((i for i, f in enumerate(out) if f.kind in ("exploding", "non_finite")), 0)
        f = out[i]
        more = f", and {len(folded) - 2} more" if len(folded) > 2 else ""
        out[i] = replace(f, message=f"{f.message}; {len(folded)} reading(s) downstream of it (vanishing or "
                                    f"saturated-looking) are its consequence, not a second cause "
                                    f"({'; '.join(folded[:2])}{more})")
    out.sort(key=lambda f: (SEVERITIES.index(f.severity), list(CAUSES).index(f.cause)))
    return out
