"""Verdicts: what is wrong, where, how badly (fail / warn) and why (the cause the evidence supports).

Every finding carries the number that triggered it, the threshold it crossed, its severity
and its cause, with the fix for that cause worded for the model's build. All thresholds live
in :class:`Thresholds`, each with its default and rationale; docs/verdicts.md holds the
decision table and the healthy models the thresholds were calibrated on.

Two layers. Symptoms are read off the measurement: the residual stream exploding or
vanishing over depth, a branch or a block's weight gradients vanishing, tensors exactly
zero, attention rows saturated, non-finite entries. Evidence of each cause is read beside
them (:func:`evidence`): the scores' mean square against E[q^2] E[k^2] (about 1 with the
1/sqrt(d_k) scale, on weights at their init), the fraction of SiLU gate inputs in the flat
region, the block weights' variance gain std^2 fan_in and their std against the declared
scheme, the q/k weights' gain, the post-norm stack's gradient imbalance, the norm placement.
Each symptom goes to the cause whose evidence explains it, and each cause makes one finding
that names the symptoms it explains as consequences; a symptom no evidence explains is
reported with cause "unclear", and the finding says what was ruled out.

The stream is judged by the shape of its growth, not one ratio: geometric growth multiplies
the stream block after block, so "exploding" is a run of exploding_run blocks in a row each
multiplying it (forward) or its gradient (backward, on the way down) by more than
exploding_gain. A pre-norm stream adds one normalised branch per block: while the stream is
small next to the branches (small-init's or gpt2's tiny embedding, or a trained model's
grown branches) one block's gain 1 + Var(branch)/Var(stream) can be 40 or 400, but the next
ones fall back towards 1 (linear growth), so no run forms. Where the stream overflows
part-way, the blocks before the overflow are judged.

One root cause: once the stream explodes or turns non-finite, readings measured against the
blown-up scale are its consequences, not separate causes. A branch 1e-9 of an exploded
stream, a block's weight gradients 1e-9 of the model's largest (itself exploded), a gradient
gain of 1e-12 below an overflow, attention saturated by blown-up scores: these are folded
into the root finding's message ("downstream of it"). Downstream means, forward, the blocks
from the first exploding block (or the block of the first non-finite tensor) on; backward,
every block when the forward pass exploded or overflowed (the gradient starts from its
logits), else the blocks from the first backward-exploding or non-finite block down.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from tinylm.plan import block_index as block_of
from tinylm.plan import block_name as plan_block_name
from tinylm.plan import EMBEDDING, RESID_IN, branch_stream
from tinylm.validate import number

from ..options import OptionsError
from ..result import CHECKS, LOSS, STREAM_BACKWARD, STREAM_FORWARD, AttentionRow, DepthRow, Finding, ParamRow, TensorRow

__all__ = ["Thresholds", "judge", "coverage", "growth", "evidence", "CAUSES", "SEVERITIES"]


@dataclass(frozen=True)
class Thresholds:
    """Thresholds of every verdict (defaults, and why).

    The diagnose thresholds were set outside the spread of 66 healthy models (six schemes x
    depth 2-48 x width 64-1024 x sequence length 16-1024 at init, ablations, gpt2-small with
    the gpt2 init at 128-1024 tokens, and short ordinary training runs): none of them gets a
    finding (docs/verdicts.md gives the table and the margins).

    exploding_gain = 4.0, exploding_run = 3: exploding when exploding_run blocks in a row
        (all of them in a shallower model, at least two) each multiply the stream's variance
        (forward) or its gradient's (backward) by more than 4. The largest gain a run of
        healthy blocks all exceed is 3.1 (forward) and 2.2 (backward); unnormalised cs336
        stacks measure 4.7 and up (backward) and 5-22 (forward). One large gain alone is
        linear growth from a small stream (up to 2.6e3 in healthy models), not an explosion.
    exploding_total = 1e4: the stream's variance grew more than 1e4-fold over the stack with
        a geometric shape (log-variance fits a line better than the variance) although no run
        crossed exploding_gain.
    vanishing_gain = 0.25: a run of exploding_run blocks each shrinking the stream (forward)
        or its gradient on the way down to under a quarter (healthy: no run under 0.89).
    vanishing_branch = 1e-8: a residual branch whose variance is below 1e-8 of the stream it
        is added to contributes nothing. The smallest healthy one is 8e-6 (gpt2 post-norm at
        d 128, whose SwiGLU branch is the product of three 0.02-std matrices). Exempt: a
        deliberately zero output (zero-residual), a branch downstream of an explosion.
    vanishing_grad = 1e-4: a block whose median weight-gradient std is below 1e-4 of the
        model's largest (healthy: 3e-3 and up). Exempt as vanishing_branch.
    dead_fraction = 0.9: more than 90% of a tensor's entries exactly zero (dead units);
        exempt: the outputs of a deliberately zero-initialised Linear.
    dead_flat = 0.5, dead_flat_fail = 0.9: dead units, warn / fail, when more than this
        fraction of a SiLU gate's inputs sits in the flat region x < -6 (silu under 0.25% of
        x, slope under 1.3%) with a negative offset (mean < -0.25 std). A zero-mean input puts
        at most half its mass there; healthy models measure under 0.1%
        (a post-norm model trained at lr 1e-2: 2%).
    saturated_rows = 0.9, saturated_fail = 0.99: more than this fraction of query rows (t >= 1)
        put > 0.99 of their attention on one key: softmax gradients vanish there (p(1-p) <
        0.01). Warn, and fail above saturated_fail. Trained healthy models saturate up to
        60-67% of a layer's rows (heads that learn to attend to one token), hence 0.9.
    score_ratio = 4.0: scores misscaled when E[score^2] / (E[q^2] E[k^2]) > 4 on weights at
        their declared init (q and k independent: 1/sqrt(d_k) scaling gives 1; healthy
        models measure 0.9-2.0); fail when it also exceeds d_k / 2 (no scaling gives d_k). Not
        judged on trained weights: learned q/k alignment reaches 5.3 in the healthy trained
        models and 26 in a post-norm one.
    init_gain_high = 8.0, init_gain_low = 0.01: badly scaled weights when the median block
        weight's variance gain std^2 fan_in is above 8 or (residual outputs left out) below
        0.01: fan-in rules give 1/3 (torch-default) to 2 (kaiming), gpt2 0.026 at d 64 and
        0.31 at d 768, trained models 0.09-1.9. Fail past the square of the threshold (two
        such layers in a row, as q.k or v then output_proj, compound), or with a symptom.
        The q/k weights' geometric-mean gain above init_gain_high alone is the evidence of
        attention made too sharp by its weights.
    init_drift = 4.0: badly scaled when the median block weight's std is more than 4 times
        (or under a quarter of) what the declared scheme gives (trained models: at most 1.5).
    post_norm_imbalance = 2.0: a post-norm stack warns when its stream gradient's variance
        changes more than 2-fold from the last block's output to the first's (a least-squares
        line through the log-variances over the blocks): post-norm stacks of depth <= 6 at
        cs336 measure 1.2-1.9, depth 12 measure 1.7-7.9, 24 about 40, 48 about 300.
    nonfinite_fraction = 0.0: any inf or NaN is a finding.
    loss_excess = 9.0: the loss is far above a uniform guess when loss - ln V > loss_excess x ln V
        (loss > 10 ln V), judged where the model is known to be at its init (a tinylm model whose
        weights follow its declared scheme) or its state is unknown (any other model), and the
        loss is the mean next-token cross-entropy. At init the logits z barely depend on the
        target, so loss - ln V is about E[logsumexp z - mean z] - ln V: Var(z)/2 for a small
        spread, about std(z) sqrt(2 ln V) for a large one. The untied healthy zoo models and
        Hugging Face GPT-2 and Llama at their init measure loss / ln V = 1.00 to 1.17; cs336
        with tied embeddings 7.0 (its N(0, 1) embedding as the output layer gives logits of std
        sqrt(d) = 8 at d 64; it trains); GPT-2 with every weight std 10 measures 527, a plain
        residual stack exploding 1.8e4.

    Over training (the watch, :mod:`diagnostics.jobs.watch`), each site against its own
    earlier records; heuristics with a measured margin, not statistical tests (in the
    README's ablation runs at lr 1e-2, d=128, 200 steps, the judged variances of the
    pre-norm baseline rose at most 129x above their lowest earlier value and its gradient
    variances fell at most 59x; post-norm's 75x and 116x; no-norm's scores rose 3e21x):

    watch_growth = 1e3: exploding, a forward variance above watch_growth x the lowest
        value it had at an earlier record.
    watch_shrink = 1e4: vanishing, a gradient variance below the highest value it had at
        an earlier record / watch_shrink.
    watch_move = 10.0: a variance "moved" (the site a spike's message names first) when it
        rose above watch_move x its lowest earlier value.
    spike_factor = 1.5: a loss above spike_factor x the running loss is a spike.
    spike_ema = 0.9: the running loss, ema <- spike_ema ema + (1 - spike_ema) loss.
    spike_warmup = 10: no spike alarm before this many finite losses (the first steps jump).
    """

    exploding_gain: float = 4.0
    exploding_total: float = 1e4
    vanishing_gain: float = 0.25
    vanishing_branch: float = 1e-8
    vanishing_grad: float = 1e-4
    dead_fraction: float = 0.9
    saturated_rows: float = 0.9
    nonfinite_fraction: float = 0.0
    exploding_run: int = 3
    loss_excess: float = 9.0
    score_ratio: float = 4.0
    saturated_fail: float = 0.99
    dead_flat: float = 0.5
    dead_flat_fail: float = 0.9
    init_gain_high: float = 8.0
    init_gain_low: float = 0.01
    init_drift: float = 4.0
    post_norm_imbalance: float = 2.0
    watch_growth: float = 1e3
    watch_shrink: float = 1e4
    watch_move: float = 10.0
    spike_factor: float = 1.5
    spike_ema: float = 0.9
    spike_warmup: int = 10

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            number(f.name, v, low=0.0, error=OptionsError)
        if self.exploding_gain <= 1 or self.vanishing_gain >= 1:
            raise OptionsError(f"exploding_gain={self.exploding_gain}, vanishing_gain={self.vanishing_gain}: "
                               "need exploding_gain > 1 > vanishing_gain")
        for name in ("watch_growth", "watch_shrink", "watch_move", "spike_factor"):
            if getattr(self, name) <= 1:
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be > 1 (a factor of change); "
                                   "pass a larger value")
        if self.spike_ema >= 1:
            raise OptionsError(f"spike_ema={self.spike_ema!r}: must be in [0, 1); pass e.g. 0.9")
        for name in ("spike_warmup", "exploding_run"):
            if getattr(self, name) != int(getattr(self, name)):
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be a whole number")
        if self.exploding_run < 1:
            raise OptionsError(f"exploding_run={self.exploding_run!r}: must be at least 1 block")
        for name in ("init_drift", "score_ratio", "post_norm_imbalance", "init_gain_high"):
            if getattr(self, name) <= 1:
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be > 1 (a factor); pass a larger value")
        if self.init_gain_low >= self.init_gain_high:
            raise OptionsError(f"init_gain_low={self.init_gain_low}, init_gain_high={self.init_gain_high}: "
                               "need init_gain_low < init_gain_high")
        for low, high in (("saturated_rows", "saturated_fail"), ("dead_flat", "dead_flat_fail")):
            if not getattr(self, low) <= getattr(self, high) <= 1:
                raise OptionsError(f"{low}={getattr(self, low)}, {high}={getattr(self, high)}: "
                                   f"need {low} <= {high} <= 1 (fractions)")

    def to_dict(self) -> dict[str, float]:
        """Every threshold as a float, by field name."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> "Thresholds":
        """The thresholds of :meth:`to_dict` (fields it lacks take their defaults; unknown keys raise)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise OptionsError(f"thresholds {unknown}: not fields of Thresholds; use {', '.join(sorted(names))}")
        kw = dict(data)
        for name in ("spike_warmup", "exploding_run"):
            if name in kw and float(kw[name]).is_integer():
                kw[name] = int(kw[name])
        return cls(**kw)


def growth(values: list[float]) -> str:
    """"geometric" when log-variance over depth is fitted better by a line than the variance
    itself (R^2 compared), "linear" otherwise, "flat" under 2x total change, "" if undefined."""
    v = [x for x in values if x is not None and math.isfinite(x) and x > 0]
    if len(v) < 3:
        return ""
    if max(v) / min(v) < 2:
        return "flat"

    def r2(ys: list[float]) -> float:
        n = len(ys)
        xs = list(range(n))
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        syy = sum((y - my) ** 2 for y in ys)
        return (sxy * sxy / (sxx * syy)) if syy > 0 else 1.0

    return "geometric" if r2([math.log(x) for x in v]) > r2(v) else "linear"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


#: The causes a finding can name, each with its words in the report.
CAUSES = {
    "non_finite": "non-finite values",
    "score_scale": "attention scores not scaled by 1/sqrt(d_k)",
    "saturated_attention": "saturated attention",
    "dead_units": "dead units",
    "init_scale": "badly scaled weights",
    "no_norm": "no normalisation",
    "post_norm_depth": "deep post-norm",
    "logit_scale": "logits too large",
    "unclear": "cause unclear",
}

#: symptom kinds, the gravest first (a finding's kind is the gravest of what it explains)
_KIND_ORDER = ("non_finite", "exploding", "vanishing", "dead", "saturated", "misscaled", "imbalanced")

#: A finding's severity: "fail" (broken: will not train, or already diverged) or "warn"
#: (trains, with care).
SEVERITIES = ("fail", "warn")


@dataclass
class _Symptom:
    """One reading past a threshold, before it is attributed to a cause."""

    kind: str
    where: str
    value: float
    threshold: float
    statistic: str
    direction: str | None
    block: int | None
    text: str
    family: str  # "non_finite", "stream", "branch", "grads", "dead", "saturated", "loss"
    severity: str = "fail"


@dataclass
class _Evidence:
    """What the measurement says about each cause (None: not measured or not applicable)."""

    norm: str | None = None  # "pre", "post", "none", or None when the build is unknown
    d_k: int | None = None
    score_ratio: dict[int, float] = field(default_factory=dict)  # block -> E[s^2] / (E[q^2] E[k^2])
    flat: dict[int, float] = field(default_factory=dict)  # block -> fraction of gate inputs below the edge
    gate_offset: dict[int, float] = field(default_factory=dict)  # block -> mean / std of the gate input
    gain_all: float | None = None  # median std^2 fan_in of the block weights
    gain_inner: float | None = None  # the same without the residual outputs
    drift: float | None = None  # median std / declared std of the block weights
    qk_gain: dict[int, float] = field(default_factory=dict)  # block -> sqrt(gain(q) gain(k))
    grad_medians: dict[int, float] = field(default_factory=dict)  # block -> median weight-gradient std
    dead_blocks: set[int] = field(default_factory=set)  # blocks whose FFN holds an exactly-zero tensor
    fresh: bool = False  # every block weight within 5% of its declared init std (q and k independent)
    imbalance: float | None = None  # stream gradient variance at the first block's output / the last's


def _median(v: list[float]) -> float | None:
    v = sorted(x for x in v if x is not None and math.isfinite(x))
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else math.sqrt(v[n // 2 - 1] * v[n // 2]) if v[n // 2 - 1] > 0 else v[n // 2]


def evidence(tensors: list[TensorRow], params: list[ParamRow], architecture: dict | None = None,
             flat: dict[str, float] | None = None, deliberate_zero: set[str] = frozenset(),
             depth: list[DepthRow] = ()) -> _Evidence:
    """The measurements that tell the causes apart (see docs/verdicts.md for each one)."""
    arch = architecture or {}
    ev = _Evidence(norm=arch.get("norm"), d_k=arch.get("d_k"))
    rows = {(r.name, r.direction): r for r in tensors}
    for r in tensors:
        if r.kind != "attn_scores" or r.direction != "forward" or r.block is None:
            continue
        base = r.name[: -len(".scores")]
        q, k = rows.get((f"{base}.q_proj", "forward")), rows.get((f"{base}.k_proj", "forward"))
        if q is None or k is None:
            continue
        den = q.mean_square * k.mean_square
        if den > 0 and math.isfinite(den) and math.isfinite(r.mean_square):
            ev.score_ratio[r.block] = r.mean_square / den
    for name, frac in (flat or {}).items():
        b = block_of(name)
        if b is None:
            continue
        ev.flat[b] = frac
        g = rows.get((name, "forward"))
        if g is not None and g.var > 0 and math.isfinite(g.var):
            ev.gate_offset[b] = g.mean / math.sqrt(g.var)
    weights = [p for p in params if p.block is not None and len(p.shape) == 2 and p.name.endswith(".weight")
               and p.std is not None and math.isfinite(p.std) and p.declared_std != 0
               and p.name[: -len(".weight")] not in deliberate_zero]
    gain = {p.name: p.std ** 2 * p.shape[1] for p in weights}
    ev.gain_all = _median(list(gain.values()))
    ev.gain_inner = _median([g for n, g in gain.items() if not n.endswith((".output_proj.weight", ".w2.weight"))])
    ev.drift = _median([p.drift for p in weights if p.drift is not None])
    ev.fresh = bool(weights) and all(p.drift is not None and abs(p.drift - 1) < 0.05 for p in weights)
    for p in weights:
        if p.name.endswith(".attn.q_proj.weight"):
            kname = p.name.replace(".q_proj.", ".k_proj.")
            if kname in gain:
                ev.qk_gain[p.block] = math.sqrt(gain[p.name] * gain[kname])
    per_block: dict[int, list[float]] = {}
    for p in weights:
        if p.grad_std is not None and math.isfinite(p.grad_std) and p.grad_std > 0:
            per_block.setdefault(p.block, []).append(p.grad_std)
    ev.grad_medians = {b: _median(v) for b, v in sorted(per_block.items())}
    # the block outputs' gradient, bottom over top (the embedding's own scale left out: index 0)
    grads = [d.backward_var for d in depth if d.index >= 1]
    if len(grads) >= 2 and all(g is not None and math.isfinite(g) and g > 0 for g in grads):
        # the least-squares line through ln(gradient variance) over the blocks, end to end: steadier
        # than the two end points alone (each a variance of a few thousand tokens' gradients)
        n = len(grads)
        ys = [math.log(g) for g in grads]
        mx, my = (n - 1) / 2, sum(ys) / n
        slope = sum((k - mx) * (y - my) for k, y in enumerate(ys)) / sum((k - mx) ** 2 for k in range(n))
        ev.imbalance = math.exp(abs(slope) * (n - 1))
    return ev


def _runs(gains: list[tuple[int, float]], beyond, length: int) -> list[int]:
    """Indices j into ``gains`` that start a run of ``length`` consecutive gains each ``beyond`` the
    threshold (fewer when fewer gains remain after j, but at least two blocks)."""
    out = []
    n = len(gains)
    for j in range(n):
        window = gains[j:j + length]
        if len(window) < min(length, n) or len(window) < 2:
            continue
        if all(beyond(g) for _, g in window):
            out.append(j)
    return out


def _stream_advice(norm: str | None, up: bool) -> str:
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


def judge(tensors: list[TensorRow], params: list[ParamRow], attention: list[AttentionRow], depth: list[DepthRow],
          order: list[str], thresholds: Thresholds, deliberate_zero: set[str] = frozenset(),
          scale_invariant: bool = False, architecture: dict | None = None, flat: dict[str, float] | None = None,
          loss: tuple[float, float, str] | None = None
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
    stream before the blocks); blocks are the tensors' ``block`` fields.
    """
    th = thresholds
    arch = architecture or {}
    norm = arch.get("norm")
    if norm is None and scale_invariant:
        norm = "pre"
    tv: dict[tuple[str, str], str] = {}
    pv: dict[str, str] = {}
    av: dict[str, str] = {}
    rows = {(r.name, r.direction): r for r in tensors}
    rank = {n: i for i, n in enumerate(order)}
    symptoms: list[_Symptom] = []

    # non-finite: the first tensor (forward order, then backward in reverse order) to hold inf/NaN
    bad_fwd = sorted((r for r in tensors if r.direction == "forward" and r.frac_nonfinite > th.nonfinite_fraction),
                     key=lambda r: rank.get(r.name, 1 << 30))
    bad_bwd = sorted((r for r in tensors if r.direction == "backward" and r.frac_nonfinite > th.nonfinite_fraction),
                     key=lambda r: -rank.get(r.name, -1))
    bad_params = [p for p in params if p.frac_nonfinite > th.nonfinite_fraction]
    for r in bad_fwd + bad_bwd:
        tv[(r.name, r.direction)] = "non_finite"
    for p in bad_params:
        pv[p.name] = "non_finite"
    first_block_rank = min((rank[r.name] for r in tensors if r.block is not None and r.name in rank), default=1 << 30)
    output_of = {d.index - 1: d.name for d in depth}  # block k -> the name of its output

    def block_name(k: int) -> str:
        return output_of.get(k) or plan_block_name(k)

    def block_at(r: TensorRow) -> int:
        """r's block; a tensor outside the blocks counts as before (embedding) or after them (head)."""
        if r.block is not None:
            return r.block
        return -1 if rank.get(r.name, 1 << 30) < first_block_rank else 1 << 30

    # where the stream's scale stops being trustworthy (see the module docstring)
    fwd_root: int | None = block_at(bad_fwd[0]) if bad_fwd else None
    bwd_root: int | None = block_at(bad_bwd[0]) if bad_bwd else None
    folded: list[str] = []  # vanishing readings downstream of the root, named in its finding

    def mark_root(direction: str, block: int) -> None:
        nonlocal fwd_root, bwd_root
        if direction == "forward":
            fwd_root = block if fwd_root is None else min(fwd_root, block)
        else:
            bwd_root = block if bwd_root is None else max(bwd_root, block)

    def downstream(direction: str, block: int) -> bool:
        if direction == "forward":
            return fwd_root is not None and block >= fwd_root
        return fwd_root is not None or (bwd_root is not None and block <= bwd_root)

    if bad_fwd or bad_bwd or bad_params:
        first = (bad_fwd or bad_bwd or [None])[0]
        where = first.name if first is not None else bad_params[0].name
        value = first.frac_nonfinite if first is not None else bad_params[0].frac_nonfinite
        side = f" ({first.direction})" if first is not None else ""
        held = f"; parameter(s) holding inf/NaN: {', '.join(p.name for p in bad_params[:3])}" if bad_params else ""
        symptoms.append(_Symptom(
            "non_finite", where, value, th.nonfinite_fraction, "fraction of entries non-finite",
            first.direction if first else None, first.block if first else bad_params[0].block,
            f"{where}{side} is the first tensor with non-finite entries ({_fmt(100 * value)}% > "
            f"{_fmt(100 * th.nonfinite_fraction)}%){held}", "non_finite"))

    # exploding / vanishing along the residual stream, judged by the shape of the growth
    fwd = [d.forward_var for d in depth]
    bwd = [d.backward_var for d in depth]
    if scale_invariant and all(b is not None for b in bwd):
        bwd = [b * f for b, f in zip(bwd, fwd)]
    run = max(1, int(th.exploding_run))
    for direction, vals in (("forward", fwd), ("backward", bwd)):
        usable = [v is not None and math.isfinite(v) and v > 0 for v in vals]
        if direction == "forward":
            end = usable.index(False) if False in usable else len(vals)
            start = 0
        else:
            end = len(vals)
            start = len(vals) - (usable[::-1].index(False) if False in usable else len(vals))
        if end - start < 2:
            continue
        if direction == "forward":  # block k takes index k to k+1
            gains = [(k, vals[k + 1] / vals[k]) for k in range(start, end - 1)]
        else:  # on the way down block k takes the gradient at k+1 to k
            gains = [(k, vals[k] / vals[k + 1]) for k in reversed(range(start, end - 1))]
        vals = vals[start:end]
        what = "variance" if direction == "forward" else (
            "gradient variance (times its variance: pre-norm is scale invariant)" if scale_invariant
            else "gradient variance")
        total = vals[-1] / vals[0] if direction == "forward" else vals[0] / vals[-1]
        up = _runs(gains, lambda g: g > th.exploding_gain, run)
        shape = growth(vals if direction == "forward" else vals[::-1])
        if up:
            k, g = gains[up[0]]
            n_up = sum(1 for _, x in gains if x > th.exploding_gain)
            mark_root(direction, k)
            symptoms.append(_Symptom(
                "exploding", block_name(k), g, th.exploding_gain, f"per-block {direction} {what} gain", direction, k,
                f"from block {k} {'on' if direction == 'forward' else 'down'}, {min(run, len(gains))} or more blocks "
                f"in a row each multiply the residual "
                f"stream's {what} by more than {_fmt(th.exploding_gain)} (block {k}: {_fmt(g)}; {n_up} of "
                f"{len(gains)} blocks; {_fmt(total)}x in all, {shape or 'geometric'} growth)", "stream"))
        elif total > th.exploding_total and shape == "geometric":
            geo = total ** (1 / max(len(gains), 1))
            k = next((k for k, g in gains if g >= geo), gains[0][0])
            mark_root(direction, k)
            symptoms.append(_Symptom(
                "exploding", block_name(k), total, th.exploding_total, f"total {direction} {what} growth over depth",
                direction, k, f"the residual stream's {what} grows {_fmt(total)}x over {len(gains)} blocks "
                f"(> {_fmt(th.exploding_total)}; {_fmt(geo)}x per block, geometric growth)", "stream"))
        down = [gains[j] for j in _runs(gains, lambda g: g < th.vanishing_gain, run)]
        folded += [f"block {k}'s {direction} gain {_fmt(g)}" for k, g in down if downstream(direction, k)]
        down = [(k, g) for k, g in down if not downstream(direction, k)]
        if down:
            k, g = down[0]
            symptoms.append(_Symptom(
                "vanishing", block_name(k), g, th.vanishing_gain, f"per-block {direction} {what} gain", direction, k,
                f"from block {k} {'on' if direction == 'forward' else 'down'}, {min(run, len(gains))} or more blocks "
                f"in a row each shrink the residual stream's {what} by a factor under "
                f"{_fmt(th.vanishing_gain)} (block {k}: {_fmt(g)})", "stream"))

    # vanishing branches (forward) and vanishing weight gradients (backward), per block
    small_branches = []
    first = RESID_IN if (RESID_IN, "forward") in rows else EMBEDDING  # block 0 reads token + position embeddings
    for r in tensors:
        if r.direction != "forward" or r.kind not in ("attn_branch", "ffn_branch") or r.block is None:
            continue
        if r.name in deliberate_zero:
            continue
        stream = branch_stream("attn" if r.kind == "attn_branch" else "ffn", r.block, first)
        s = rows.get((stream, "forward"))
        if s is None or not s.var > 0 or not math.isfinite(r.var):
            continue
        ratio = r.var / s.var
        if ratio < th.vanishing_branch:
            if downstream("forward", r.block):
                folded.append(f"{r.name} at {_fmt(ratio)} of the stream")
                continue
            small_branches.append((r, ratio))
            tv[(r.name, "forward")] = "vanishing"
    for r, ratio in small_branches:
        symptoms.append(_Symptom(
            "vanishing", r.name, ratio, th.vanishing_branch, "branch variance / stream variance", "forward", r.block,
            f"{r.name} adds {_fmt(ratio)} of the stream's variance (< {_fmt(th.vanishing_branch)}): its block acts "
            "as the identity", "branch"))
    grads = [(p, p.grad_std) for p in params
             if p.grad_std is not None and math.isfinite(p.grad_std) and len(p.shape) == 2]
    top = max((g for _, g in grads), default=0.0)
    exempt = {block_of(n) for n in deliberate_zero} - {None}
    if top > 0:
        per_block: dict[int, list[float]] = {}
        for p, g in grads:
            if p.block is not None and p.block not in exempt:
                per_block.setdefault(p.block, []).append(g / top)
        medians = {b: sorted(v)[len(v) // 2] for b, v in per_block.items()}
        weak = sorted((b, r) for b, r in medians.items() if r < th.vanishing_grad)
        folded += [f"block {b}'s weight gradients at {_fmt(r)} of the largest" for b, r in weak
                   if downstream("backward", b)]
        weak = [(b, r) for b, r in weak if not downstream("backward", b)]
        for b, _ in weak:
            for q, _g in grads:
                if q.block == b:
                    pv[q.name] = "vanishing"
        for b, ratio in weak:
            symptoms.append(_Symptom(
                "vanishing", block_name(b), ratio, th.vanishing_grad,
                "median weight-gradient std in the block / largest in the model", "backward", b,
                f"the weights of block {b} get gradients {_fmt(ratio)} times the model's largest (median; "
                f"< {_fmt(th.vanishing_grad)})", "grads"))

    # dead tensors (exactly zero)
    dead = [r for r in tensors if r.direction == "forward" and r.kind not in ("attn_probs", "attn_scores")
            and r.name not in deliberate_zero and r.frac_zero > th.dead_fraction]
    for r in sorted(dead, key=lambda r: rank.get(r.name, 1 << 30)):
        tv[(r.name, "forward")] = "dead"
        symptoms.append(_Symptom(
            "dead", r.name, r.frac_zero, th.dead_fraction, "fraction of entries exactly zero", "forward", r.block,
            f"{_fmt(100 * r.frac_zero)}% of {r.name}'s entries are exactly zero (> {_fmt(100 * th.dead_fraction)}%)",
            "dead"))

    # saturated attention
    for a in attention:
        if a.saturated_frac > th.saturated_rows:
            av[a.name] = "saturated"
            if downstream("forward", a.block):  # scores from a blown-up stream
                folded.append(f"{a.name} saturated ({_fmt(100 * a.saturated_frac)}% of rows)")
                continue
            symptoms.append(_Symptom(
                "saturated", a.name, a.saturated_frac, th.saturated_rows,
                "fraction of query rows with max probability > 0.99", "forward", a.block,
                f"{_fmt(100 * a.saturated_frac)}% of {a.name}'s query rows put > 0.99 on one key "
                f"(> {_fmt(100 * th.saturated_rows)}%; score std {_fmt(a.score_std)})", "saturated",
                "fail" if a.saturated_frac > th.saturated_fail else "warn"))

    # the loss against a uniform guess (a non-finite loss is the non-finite tensors' finding)
    if loss is not None:
        value, ln_v, severity = loss
        if ln_v > 0 and math.isfinite(value) and value - ln_v > th.loss_excess * ln_v:
            symptoms.append(_Symptom(
                "misscaled", "loss", value / ln_v, 1 + th.loss_excess,
                "loss / ln V", None, None,
                f"the loss {_fmt(value)} is {_fmt(value / ln_v)} times a uniform guess's ln V = {_fmt(ln_v)} "
                f"(> {_fmt(1 + th.loss_excess)}; a fresh model's logits barely depend on the target, so its loss "
                "is about ln V + Var(logits)/2)", "loss", severity))

    ev = evidence(tensors, params, architecture, flat, deliberate_zero, depth)
    # scores read from a blown-up stream say nothing of their scaling (float32 rounds q k at that size)
    ev.score_ratio = {b: r for b, r in ev.score_ratio.items() if not downstream("forward", b)}
    ev.dead_blocks = {s.block for s in symptoms if s.family == "dead" and ".ffn" in s.where}
    findings = _attribute(symptoms, ev, th, norm, folded, arch)
    # a tensor or parameter a finding names carries its verdict in the tables too
    for f in findings:
        if (f.where, f.direction or "forward") in rows:
            key = (f.where, f.direction or "forward")
            if tv.get(key, "ok") == "ok":
                tv[key] = f.kind
        elif f.where in {p.name for p in params} and pv.get(f.where, "ok") == "ok":
            pv[f.where] = f.kind
        elif f.where in {a.name for a in attention} and av.get(f.where, "ok") == "ok":
            av[f.where] = f.kind
    return findings, tv, pv, av


def _attribute(symptoms: list[_Symptom], ev: _Evidence, th: Thresholds, norm: str | None, folded: list[str],
               arch: dict) -> list[Finding]:
    """One finding per cause: its own evidence, the symptoms it explains, severity and advice."""
    # evidence of each cause, on its own (value, threshold, statistic, where, block, sentence, severity)
    causes: dict[str, dict] = {}

    def cause(name: str, **kw) -> None:
        causes.setdefault(name, {"symptoms": [], **kw})

    d_k = ev.d_k
    # on trained weights q and k align by learning, and the expectation 1 no longer holds: the
    # scaling is judged on weights at their declared init, where q and k are independent
    big_scores = {b: r for b, r in ev.score_ratio.items() if r > th.score_ratio} if ev.fresh else {}
    if big_scores:
        b = max(big_scores, key=big_scores.get)
        r = big_scores[b]
        unscaled = d_k is not None and r > max(th.score_ratio, d_k / 2)
        expect = f"; without the 1/sqrt(d_k) scale it is d_k = {d_k}" if d_k else ""
        cause("score_scale", value=r, threshold=th.score_ratio, where=f"layers.{b}.attn.scores", block=b,
              direction="forward", kind="misscaled",
              statistic="E[score^2] / (E[q^2] E[k^2])",
              text=f"the attention scores' mean square is {_fmt(r)} times E[q^2] E[k^2] in block {b} "
                   f"({len(big_scores)} "
                   f"of {len(ev.score_ratio)} layers > {_fmt(th.score_ratio)}; 1/sqrt(d_k) scaling gives about 1"
                   f"{expect})",
              severity="fail" if unscaled else "warn",
              advice="divide the scores by sqrt(d_k) (Q K^T / sqrt(d_k)); a custom attention that scales by 1 "
                     "or by 1/d_k^(1/4) makes the softmax d_k or sqrt(d_k) times too sharp")
    gain_hi = ev.gain_all is not None and ev.gain_all > th.init_gain_high
    gain_lo = ev.gain_inner is not None and ev.gain_inner < th.init_gain_low
    drift_hi = ev.drift is not None and ev.drift > th.init_drift
    drift_lo = ev.drift is not None and ev.drift < 1 / th.init_drift
    if gain_hi or gain_lo or drift_hi or drift_lo:
        large = gain_hi or drift_hi
        scheme = arch.get("init")
        if (drift_hi or drift_lo) and not (gain_hi or gain_lo):
            value, threshold, stat = ev.drift, th.init_drift if large else 1 / th.init_drift, \
                "median weight std / declared init std"
            text = (f"the block weights' std is {_fmt(ev.drift)} times what the declared {scheme or ''} scheme gives "
                    f"(median; {'>' if large else '<'} {_fmt(threshold)})")
        else:
            value = ev.gain_all if large else ev.gain_inner
            threshold = th.init_gain_high if large else th.init_gain_low
            stat = "median std^2 fan_in of the block weights"
            text = (f"the block weights multiply a unit-variance input's variance by {_fmt(value)} (median std^2 x "
                    f"fan_in; {'>' if large else '<'} {_fmt(threshold)}; fan-in rules give 1/3 to 2)"
                    + (f", std {_fmt(ev.drift)} times the declared {scheme}'s" if ev.drift is not None and scheme
                       else ""))
        # far out (the square of the threshold: two such layers in a row, as q.k or v then output_proj
        # are, compound it) the model is broken whatever the symptoms show
        far = (ev.gain_all is not None and ev.gain_all > th.init_gain_high ** 2) or \
              (ev.gain_inner is not None and ev.gain_inner < th.init_gain_low ** 2) or \
              (ev.drift is not None and not 1 / th.init_drift ** 2 <= ev.drift <= th.init_drift ** 2)
        cause("init_scale", value=value, threshold=threshold, where="model", block=None, direction=None,
              kind="misscaled", large=large, far=far, statistic=stat, text=text,
              severity="fail" if far else "warn",
              advice=("re-initialise with std ~1/sqrt(fan_in) (cs336, kaiming, torch-default), or the declared "
                      f"scheme{' ' + scheme if scheme else ''} as it is written; weights grown this large in "
                      "training point to a learning rate too high or no weight decay") if large else
                     ("re-initialise with std ~1/sqrt(fan_in) (cs336, kaiming): weights this small pass almost "
                      "nothing forward and get almost no gradient"))
    dead_gates = {b: f for b, f in ev.flat.items() if f > th.dead_flat and ev.gate_offset.get(b, 0.0) < -0.25}
    if dead_gates:
        b = max(dead_gates, key=dead_gates.get)
        frac = dead_gates[b]
        cause("dead_units", value=frac, threshold=th.dead_flat, where=f"layers.{b}.ffn.w1", block=b,
              direction="forward", kind="dead",
              statistic="fraction of SiLU inputs below -6 (flat region)",
              text=f"{_fmt(100 * frac)}% of block {b}'s SiLU gate inputs sit in the flat region x < -6 (> "
                   f"{_fmt(100 * th.dead_flat)}%; a zero-mean input puts at most 50% there), driven there by a "
                   f"negative offset (their mean is {_fmt(ev.gate_offset[b])} standard deviations); "
                   f"{len(dead_gates)} of {len(ev.flat)} FFNs",
              severity="fail" if frac > th.dead_flat_fail else "warn",
              advice="the gate weights (w1) point against the input's mean direction: re-initialise w1 zero-mean "
                     "(or lower the learning rate that pushed it there); units whose inputs all sit below -6 pass "
                     "almost nothing and get almost no gradient")
    post_deep = norm == "post" and ev.imbalance is not None and ev.imbalance > th.post_norm_imbalance
    if post_deep:
        L = arch.get("num_layers", len(ev.grad_medians))
        cause("post_norm_depth", value=ev.imbalance, threshold=th.post_norm_imbalance,
              where="layers.0", block=0, direction="backward",
              kind="imbalanced", statistic="stream gradient variance, first block's output / last block's",
              text=f"post-norm at depth {L}: the stream's gradient variance is {_fmt(ev.imbalance)} times larger at "
                   f"the first block's output than at the last's (> {_fmt(th.post_norm_imbalance)}): each post-norm "
                   "rescales the gradient on its way down, so the blocks learn at different rates; Xiong et al. "
                   "2020 (Theorem 1) show post-LN's gradients near the output are large at init, which is why it "
                   "needs warm-up",
              severity="warn",
              advice="warm the learning rate up (a few hundred to thousands of steps, Xiong et al. 2020), or move "
                     "the norm before each branch (pre-norm: config norm='pre'), which needs no warm-up")

    big_qk = {b: g for b, g in ev.qk_gain.items() if g > th.init_gain_high}
    if big_qk and "init_scale" not in causes and "score_scale" not in causes:
        b = max(big_qk, key=big_qk.get)
        cause("saturated_attention", value=big_qk[b], threshold=th.init_gain_high, where=f"layers.{b}.attn",
              block=b, direction="forward", kind="misscaled",
              statistic="sqrt(gain(q_proj) gain(k_proj)), gain = std^2 fan_in",
              text=f"block {b}'s q/k weights multiply variance by {_fmt(big_qk[b])} (std^2 x fan_in, geometric mean "
                   f"of q_proj and k_proj; > {_fmt(th.init_gain_high)}; {len(big_qk)} of {len(ev.qk_gain)} layers): "
                   "the scores are that many times too wide and the softmax too sharp",
              severity="warn",
              advice="re-initialise q_proj and k_proj with std ~1/sqrt(d_model), or add QK-norm (an RMSNorm on q "
                     "and k per head)")

    # attribute the symptoms
    # saturated and dead first: the stream symptoms they cause are attributed to them
    for s in sorted(symptoms, key=lambda s: s.family not in ("saturated", "dead")):
        if s.family in ("non_finite", "loss"):
            continue  # attributed last, to the cause of the explosion it ends (if any)
        if s.family == "saturated":
            if "score_scale" in causes and s.block in ev.score_ratio and ev.score_ratio[s.block] > th.score_ratio:
                causes["score_scale"]["symptoms"].append(s)
            elif "init_scale" in causes and causes["init_scale"]["large"]:
                causes["init_scale"]["symptoms"].append(s)
            else:
                qk = ev.qk_gain.get(s.block)
                big = qk is not None and qk > th.init_gain_high
                note = (f"; its q/k weights multiply variance by {_fmt(qk)} (std^2 fan_in, > "
                        f"{_fmt(th.init_gain_high)}): too large" if big else
                        "; the scores are scaled right and the q/k weights are not outsized, so the evidence "
                        "does not separate learned sharp attention from q/k weights grown in training"
                        if qk is not None else "")
                cause("saturated_attention", value=s.value, threshold=s.threshold, where=s.where, block=s.block,
                      direction="forward", kind="saturated", statistic=s.statistic, text=s.text + note,
                      severity="warn",
                      advice=("re-initialise q_proj and k_proj with std ~1/sqrt(d_model), or add QK-norm (an "
                              "RMSNorm on q and k per head)") if big else
                             ("if it appears early in training, lower the learning rate or add QK-norm; saturated "
                              "rows pass almost no gradient (p(1-p) < 0.01)"))
                causes["saturated_attention"]["symptoms"].append(s)
            continue
        if s.family == "dead":
            b = s.block
            cause("dead_units", value=s.value, threshold=s.threshold, where=s.where, block=b, direction="forward",
                  kind="dead", statistic=s.statistic, text=s.text, severity="fail",
                  advice="units that output exactly zero get no gradient: look for a zeroed weight, a ReLU whose "
                         "inputs are all negative, or a mask that removes everything")
            causes["dead_units"]["symptoms"].append(s)
            continue
        # stream, branch and gradient symptoms
        dead_here = s.block in ev.dead_blocks or ev.flat.get(s.block, 0.0) > th.dead_flat
        if s.family in ("branch", "grads") and "dead_units" in causes and dead_here \
                and (s.family == "grads" or s.where.endswith(".ffn")):
            causes["dead_units"]["symptoms"].append(s)
            continue
        if s.kind == "exploding" and s.direction == "backward" and "score_scale" in causes:
            causes["score_scale"]["symptoms"].append(s)
            continue
        if s.kind == "exploding" and s.direction == "backward" and "saturated_attention" in causes:
            causes["saturated_attention"]["symptoms"].append(s)  # the softmax's Jacobian, far off its mean
            continue
        # weights off their rule in the symptom's direction explain it; weights far off (past the
        # threshold squared) explain every reading, since a few layers then dwarf the rest
        if "init_scale" in causes and (causes["init_scale"]["large"] == (s.kind == "exploding")
                                       or causes["init_scale"]["far"]):
            causes["init_scale"]["symptoms"].append(s)
            continue
        if "post_norm_depth" in causes and s.direction == "backward":
            causes["post_norm_depth"]["symptoms"].append(s)
            continue
        if norm == "none":
            cause("no_norm", value=s.value, threshold=s.threshold, where=s.where, block=s.block,
                  direction=s.direction, kind=s.kind, statistic=s.statistic,
                  text=s.text + ("; the model has no norm, so each block's output feeds the next one's scale"
                                 if s.family == "stream" else
                                 "; the model has no norm, so its branches read the stream at its own scale"),
                  severity="fail", advice=_stream_advice("none", s.kind == "exploding"))
            causes["no_norm"]["symptoms"].append(s)
            continue
        if "no_norm" in causes:
            causes["no_norm"]["symptoms"].append(s)
            continue
        key = f"unclear/{s.kind}/{s.direction}"  # unexplained symptoms of different kinds stay apart
        cause(key, value=s.value, threshold=s.threshold, where=s.where, block=s.block, direction=s.direction,
              kind=s.kind, statistic=s.statistic, text=s.text, severity="fail",
              advice=("the measurement does not single out a cause (scores scaled right, weights of ordinary scale"
                      + ("" if norm else ", norm placement unknown") + "): "
                      + _stream_advice(norm, s.kind == "exploding")))
        causes[key]["symptoms"].append(s)

    for s in symptoms:
        if s.family != "non_finite":
            continue
        weights = "parameter(s) holding" in s.text
        root = next((n for n, c in causes.items() if any(x.kind == "exploding" for x in c["symptoms"])), None)
        if root is None and not weights:
            root = next((n for n in ("score_scale", "init_scale") if n in causes
                         and (n == "score_scale" or causes[n]["large"])), None)
        if root is not None and not weights:
            causes[root]["symptoms"].append(s)
            continue
        cause("non_finite", value=s.value, threshold=s.threshold, where=s.where, block=s.block,
              direction=s.direction, kind="non_finite", statistic=s.statistic, text=s.text, severity="fail",
              advice=("the weights hold inf/NaN: training diverged (or the file is damaged); restore the last finite "
                      "checkpoint, then lower the learning rate, clip gradients or warm up") if weights else
                     ("look at the op that produces this tensor: an overflow (lower the learning rate, check the "
                      "norms and the weights' scale) or a division by zero / log of zero"))
        causes["non_finite"]["symptoms"].append(s)

    for s in symptoms:
        if s.family != "loss":
            continue
        # logits blown up by an exploding stream or by weights too large are their consequence
        root = next((n for n, c in causes.items() if any(x.kind in ("exploding", "non_finite")
                                                           for x in c["symptoms"])), None)
        if root is None and "init_scale" in causes and (causes["init_scale"]["large"] or causes["init_scale"]["far"]):
            root = "init_scale"
        if root is not None:
            causes[root]["symptoms"].append(s)
            continue
        cause("logit_scale", value=s.value, threshold=s.threshold, where="loss", block=None, direction=None,
              kind="misscaled", statistic=s.statistic, text=s.text, severity=s.severity,
              advice="the logits are spread far wider than a fresh model's: scale the output layer down (std about "
                     "1/sqrt(d_model), or 0.02), put a norm before it, and check the weights' scale; on random "
                     "tokens a trained model's loss is ln V plus how peaked its predictions are (pass real tokens)")
        causes["logit_scale"]["symptoms"].append(s)

    out: list[Finding] = []
    for key, c in causes.items():
        name = key.split("/")[0]
        own = sorted((s for s in c["symptoms"] if not c["text"].startswith(s.text)),
                     key=lambda s: s.family != "loss")  # the loss first: the number a reader knows
        severity = c["severity"]
        if name != "post_norm_depth" and any(s.severity == "fail" for s in c["symptoms"]):
            severity = "fail"
        kind = c["kind"]
        if c["symptoms"] and kind in ("imbalanced", "misscaled"):
            pool = c["symptoms"]
            if name == "init_scale":  # the kind says which way the weights are off, where a symptom shows it
                pool = [x for x in pool if (x.kind != "vanishing") == c["large"]] or pool
            kind = min((x.kind for x in pool), key=_KIND_ORDER.index)
        message = c["text"]
        if own:
            message += "; consequences: " + "; ".join(s.text for s in own[:3]) + (
                f"; and {len(own) - 3} more" if len(own) > 3 else "")
        out.append(Finding(kind=kind, where=c["where"], value=c["value"], threshold=c["threshold"], message=message,
                           statistic=c["statistic"], direction=c["direction"], block=c["block"],
                           suggestion=c["advice"], severity=severity, cause=name))
    if folded and out:
        i = next((i for i, f in enumerate(out) if f.kind in ("exploding", "non_finite")), 0)
        f = out[i]
        more = f", and {len(folded) - 2} more" if len(folded) > 2 else ""
        out[i] = replace(f, message=f"{f.message}; {len(folded)} reading(s) downstream of it (vanishing or "
                                    f"saturated-looking) are its consequence, not a second cause "
                                    f"({'; '.join(folded[:2])}{more})")
    out.sort(key=lambda f: (SEVERITIES.index(f.severity), list(CAUSES).index(f.cause)))
    return out


def coverage(tensors: list[TensorRow], params: list[ParamRow], attention: list[AttentionRow], depth: list[DepthRow],
             architecture: dict | None = None, flat: dict[str, float] | None = None,
             deliberate_zero: set[str] = frozenset(), loss_reason: str = "", stream_reason: str = ""
             ) -> tuple[list[str], list[tuple[str, str]]]:
    """What :func:`judge` could judge from these records (the check names of
    :data:`diagnostics.result.CHECKS`, in that order), and each check it could not, with why.

    ``loss_reason``: why the loss was not judged against ln V ("" if it was); ``stream_reason``:
    why there is no residual stream (no block stack found; "" if there is one). A check that
    does not apply to a known build (post-norm imbalance of a pre-norm tinylm model) is neither.
    """
    arch = architecture or {}
    tiny = "init" in arch  # a tinylm model's build is known from its config; another's only its norms
    ev = evidence(tensors, params, architecture, flat, deliberate_zero, depth)
    fwd = [d for d in depth if d.forward_var is not None]
    bwd = [d for d in depth if d.backward_var is not None]
    few = f"only {len(depth)} residual point(s) (before and after the blocks): a run of gains needs 3"
    reasons: dict[str, str] = {
        STREAM_FORWARD: (stream_reason or "no block stack found") if not depth else "" if len(fwd) >= 3 else few,
        STREAM_BACKWARD: (stream_reason or "no block stack found") if not depth else
        "" if len(bwd) >= 3 else ("no gradient reached the residual stream" if fwd else few),
        "block weight gradients": "" if any(p.block is not None and p.grad_std is not None for p in params) else
        "no block holds a weight with a gradient",
        "weights' scale (std^2 fan_in)": "" if ev.gain_all is not None else "no 2-D weights inside the blocks",
        "weights against the declared init": "" if ev.drift is not None else
        "no declared init scheme (a tinylm model declares one)" if not tiny else "the scheme declares no std",
        "attention (saturated rows)": "" if attention else
        "no attention seen (no scaled_dot_product_attention call; explicit matmul-softmax attention is not seen)",
        "attention score scaling": "" if ev.fresh and ev.score_ratio else
        "judged on weights at their declared init only" if tiny or attention else "no attention seen",
        "SiLU gates in the flat region": "" if flat else "no SiLU gate known (a tinylm SwiGLU or SiLU FFN)",
        "residual branches": "" if any(r.kind in ("attn_branch", "ffn_branch") for r in tensors) else
        "the branches of a block are known for tinylm models only",
        "exactly-zero (dead) tensors": "" if any(r.direction == "forward" for r in tensors) else "no tensor measured",
        "non-finite values": "",
        LOSS: loss_reason,
    }
    if arch.get("norm") == "post":
        reasons["post-norm gradient imbalance"] = "" if ev.imbalance is not None else few
    elif not tiny and arch.get("norm") != "none":
        reasons["post-norm gradient imbalance"] = "norm placement unknown (not a tinylm model)"
    order = [c for c in CHECKS if c in reasons]
    return [c for c in order if not reasons[c]], [(c, reasons[c]) for c in order if reasons[c]]
