"""Symptoms: the readings past a threshold, read off one measurement before any cause is named.

Each reader below takes one family: the first non-finite tensor, the residual stream's
growth over depth (forward, and its gradient backward), residual branches and block weight
gradients that vanish, exactly-zero tensors, saturated attention rows, the loss against a
uniform guess.

The stream is judged by the shape of its growth, not one ratio: geometric growth multiplies
the stream block after block, so "exploding" is a run of exploding_run blocks in a row each
multiplying it (forward) or its gradient (backward, on the way down) by more than
exploding_gain, or a total over the stack past exploding_total whose shape is geometric; both
need at least exploding_run gains. A pre-norm stream adds one normalised branch per block:
while the stream is small next to the branches (small-init's or gpt2's tiny embedding, or a
trained model's grown branches) one block's gain 1 + Var(branch)/Var(stream) can be 40 or 400,
but the next ones fall back towards 1 (linear growth), so no run forms. A stack of fewer than
exploding_run blocks is not called exploding by its gains at all: its two or three points
cannot tell geometric growth from that linear growth (a trained 2-block stack's total is the
embedding's smallness times one grown block), and a line through them in log space fits as
well as one through the variances. Where the stream overflows part-way, the blocks before the
overflow are judged.

One root cause: once the stream explodes or turns non-finite, readings measured against the
blown-up scale are its consequences, not separate causes. A branch 1e-9 of an exploded
stream, a block's weight gradients 1e-9 of the model's largest (itself exploded), a gradient
gain of 1e-12 below an overflow, attention saturated by blown-up scores: :class:`Reading`
folds these into the root finding's message ("downstream of it"). Downstream means, forward,
the blocks from the first exploding block (or the block of the first non-finite tensor) on;
backward, every block when the forward pass exploded or overflowed (the gradient starts from
its logits), else the blocks from the first backward-exploding or non-finite block down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinylm.plan import block_index as block_of
from tinylm.plan import block_name as plan_block_name
from tinylm.plan import EMBEDDING, RESID_IN, branch_stream

from ..result import AttentionRow, DepthRow, ParamRow, TensorRow
from .thresholds import Thresholds

__all__ = ["Symptom", "Reading", "Sites", "growth", "fmt", "non_finite", "stream_values", "stream", "branches",
           "starved_weights", "dead", "saturated", "loss", "attention_logits", "attention_entropy", "output_logits",
           "massive"]

_LAST = 1 << 30  # a rank past every tensor's


def fmt(x: float) -> str:
    """A number as a finding writes it (3 significant digits)."""
    return f"{x:.3g}"


@dataclass
class Symptom:
    """One reading past a threshold, before it is attributed to a cause."""

    kind: str
    where: str
    value: float
    threshold: float
    statistic: str
    direction: str | None
    block: int | None
    text: str
    family: str  # "non_finite", "stream", "branch", "grads", "dead", "saturated", "loss", and the precursors
    # "attn_logit", "attn_entropy", "logits", "massive"
    severity: str = "fail"


@dataclass
class Reading:
    """The symptoms read so far, the readings folded into a root cause, and the per-site verdicts.

    ``forward_root`` / ``backward_root``: the block where the stream's scale (forward) or its
    gradient's (backward) stops being trustworthy (None: nowhere).
    """

    symptoms: list[Symptom] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)  # readings downstream of the root, named in its finding
    tensors: dict[tuple[str, str], str] = field(default_factory=dict)  # (name, direction) -> verdict
    params: dict[str, str] = field(default_factory=dict)  # name -> verdict
    attention: dict[str, str] = field(default_factory=dict)  # name -> verdict
    forward_root: int | None = None
    backward_root: int | None = None

    def mark_root(self, direction: str, block: int) -> None:
        """The stream (forward) or its gradient (backward) is blown up from ``block`` on (down)."""
        if direction == "forward":
            self.forward_root = block if self.forward_root is None else min(self.forward_root, block)
        else:
            self.backward_root = block if self.backward_root is None else max(self.backward_root, block)

    def downstream(self, direction: str, block: int) -> bool:
        """Whether ``block``'s reading in ``direction`` is measured against a blown-up scale."""
        if direction == "forward":
            return self.forward_root is not None and block >= self.forward_root
        return self.forward_root is not None or (self.backward_root is not None and block <= self.backward_root)


class Sites:
    """Look-ups over one measurement's records: rows by (name, direction), execution rank, block names."""

    def __init__(self, tensors: list[TensorRow], order: list[str], depth: list[DepthRow]) -> None:
        self.rows = {(r.name, r.direction): r for r in tensors}
        self.rank = {n: i for i, n in enumerate(order)}
        self.first_block_rank = min((self.rank[r.name] for r in tensors if r.block is not None and r.name in self.rank),
                                    default=_LAST)
        self.output_of = {d.index - 1: d.name for d in depth}  # block k -> the name of its output

    def block_name(self, k: int) -> str:
        """The name of block k's output."""
        return self.output_of.get(k) or plan_block_name(k)

    def block_at(self, r: TensorRow) -> int:
        """r's block; a tensor outside the blocks counts as before (embedding) or after them (head)."""
        if r.block is not None:
            return r.block
        return -1 if self.rank.get(r.name, _LAST) < self.first_block_rank else _LAST


def growth(values: list[float]) -> str:
    """The shape of a variance's change over depth.

    Returns:
        "geometric" when log-variance over depth is fitted better by a line than the variance
        itself (R^2 compared), "linear" otherwise, "flat" under 2x total change, "" if undefined
        (fewer than 3 finite positive values).
    """
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


def non_finite(reading: Reading, tensors: list[TensorRow], params: list[ParamRow], sites: Sites,
               th: Thresholds) -> None:
    """The first tensor (forward in execution order, then backward in reverse order) to hold inf/NaN,
    and the parameters that hold them; the stream's roots start at the first tensor's block."""
    bad_fwd = sorted((r for r in tensors if r.direction == "forward" and r.frac_nonfinite > th.nonfinite_fraction),
                     key=lambda r: sites.rank.get(r.name, _LAST))
    bad_bwd = sorted((r for r in tensors if r.direction == "backward" and r.frac_nonfinite > th.nonfinite_fraction),
                     key=lambda r: -sites.rank.get(r.name, -1))
    bad_params = [p for p in params if p.frac_nonfinite > th.nonfinite_fraction]
    for r in bad_fwd + bad_bwd:
        reading.tensors[(r.name, r.direction)] = "non_finite"
    for p in bad_params:
        reading.params[p.name] = "non_finite"
    reading.forward_root = sites.block_at(bad_fwd[0]) if bad_fwd else None
    reading.backward_root = sites.block_at(bad_bwd[0]) if bad_bwd else None
    if not (bad_fwd or bad_bwd or bad_params):
        return
    first = (bad_fwd or bad_bwd or [None])[0]
    where = first.name if first is not None else bad_params[0].name
    value = first.frac_nonfinite if first is not None else bad_params[0].frac_nonfinite
    side = f" ({first.direction})" if first is not None else ""
    held = f"; parameter(s) holding inf/NaN: {', '.join(p.name for p in bad_params[:3])}" if bad_params else ""
    reading.symptoms.append(Symptom(
        "non_finite", where, value, th.nonfinite_fraction, "fraction of entries non-finite",
        first.direction if first else None, first.block if first else bad_params[0].block,
        f"{where}{side} is the first tensor with non-finite entries ({fmt(100 * value)}% > "
        f"{fmt(100 * th.nonfinite_fraction)}%){held}", "non_finite"))


def stream_values(depth: list[DepthRow], scale_invariant: bool) -> list[tuple[str, list]]:
    """The stream's variance over depth, forward, and its gradient's, backward (times the variance
    when the stack is scale invariant and every gradient was measured)."""
    fwd = [d.forward_var for d in depth]
    bwd = [d.backward_var for d in depth]
    if scale_invariant and all(b is not None for b in bwd):
        bwd = [b * f for b, f in zip(bwd, fwd)]
    return [("forward", fwd), ("backward", bwd)]


def _gains(direction: str, vals: list) -> tuple[list[tuple[int, float]], list[float]]:
    """(block, gain) in the direction of travel over the usable stretch of ``vals``, and that stretch.

    Forward, the stretch runs from the start to the first value that is missing, non-finite or 0
    (an overflow part-way); backward, from the last such value to the end. Block k takes index k
    to k + 1 forward, and the gradient at k + 1 to k on the way down.
    """
    usable = [v is not None and math.isfinite(v) and v > 0 for v in vals]
    if direction == "forward":
        start, end = 0, usable.index(False) if False in usable else len(vals)
    else:
        start, end = len(vals) - (usable[::-1].index(False) if False in usable else len(vals)), len(vals)
    if end - start < 2:
        return [], []
    if direction == "forward":
        gains = [(k, vals[k + 1] / vals[k]) for k in range(start, end - 1)]
    else:
        gains = [(k, vals[k] / vals[k + 1]) for k in reversed(range(start, end - 1))]
    return gains, vals[start:end]


def _runs(gains: list[tuple[int, float]], beyond, length: int) -> list[int]:
    """Indices j into ``gains`` that start a run of ``length`` consecutive gains each ``beyond`` the
    threshold. A stack with fewer blocks than ``length`` has no run: one or two large gains are what a
    pre-norm stream's linear growth gives (its first blocks add branches to a small embedding)."""
    n = len(gains)
    return [j for j in range(n - length + 1) if all(beyond(g) for _, g in gains[j:j + length])]


def stream(reading: Reading, direction: str, vals: list, sites: Sites, th: Thresholds,
           scale_invariant: bool) -> None:
    """Exploding (a run of large gains, or a large geometric total over at least exploding_run gains)
    and vanishing (a run of small gains) in one direction; an explosion marks the root, vanishing
    downstream of it is folded."""
    gains, vals = _gains(direction, vals)
    if not gains:
        return
    what = "variance" if direction == "forward" else (
        "gradient variance (times its variance: pre-norm is scale invariant)" if scale_invariant
        else "gradient variance")
    run = max(1, int(th.exploding_run))
    way = "on" if direction == "forward" else "down"
    total = vals[-1] / vals[0] if direction == "forward" else vals[0] / vals[-1]
    up = _runs(gains, lambda g: g > th.exploding_gain, run)
    shape = growth(vals if direction == "forward" else vals[::-1])
    if up:
        k, g = gains[up[0]]
        n_up = sum(1 for _, x in gains if x > th.exploding_gain)
        reading.mark_root(direction, k)
        reading.symptoms.append(Symptom(
            "exploding", sites.block_name(k), g, th.exploding_gain, f"per-block {direction} {what} gain", direction, k,
            f"from block {k} {way}, {run} or more blocks "
            f"in a row each multiply the residual "
            f"stream's {what} by more than {fmt(th.exploding_gain)} (block {k}: {fmt(g)}; {n_up} of "
            f"{len(gains)} blocks; {fmt(total)}x in all, {shape or 'geometric'} growth)", "stream"))
    elif total > th.exploding_total and shape == "geometric" and len(gains) >= run:
        geo = total ** (1 / max(len(gains), 1))
        k = next((k for k, g in gains if g >= geo), gains[0][0])
        reading.mark_root(direction, k)
        reading.symptoms.append(Symptom(
            "exploding", sites.block_name(k), total, th.exploding_total, f"total {direction} {what} growth over depth",
            direction, k, f"the residual stream's {what} grows {fmt(total)}x over {len(gains)} blocks "
            f"(> {fmt(th.exploding_total)}; {fmt(geo)}x per block, geometric growth)", "stream"))
    down = [gains[j] for j in _runs(gains, lambda g: g < th.vanishing_gain, run)]
    reading.folded += [f"block {k}'s {direction} gain {fmt(g)}" for k, g in down if reading.downstream(direction, k)]
    down = [(k, g) for k, g in down if not reading.downstream(direction, k)]
    if down:
        k, g = down[0]
        reading.symptoms.append(Symptom(
            "vanishing", sites.block_name(k), g, th.vanishing_gain, f"per-block {direction} {what} gain", direction, k,
            f"from block {k} {way}, {run} or more blocks "
            f"in a row each shrink the residual stream's {what} by a factor under "
            f"{fmt(th.vanishing_gain)} (block {k}: {fmt(g)})", "stream"))


def branches(reading: Reading, tensors: list[TensorRow], sites: Sites, th: Thresholds,
             deliberate_zero: set[str]) -> None:
    """Residual branches whose variance is below vanishing_branch of the stream they are added to
    (deliberately zero ones exempt; downstream of an explosion folded)."""
    small = []
    first = RESID_IN if (RESID_IN, "forward") in sites.rows else EMBEDDING  # block 0 reads token + position embeddings
    for r in tensors:
        if r.direction != "forward" or r.kind not in ("attn_branch", "ffn_branch") or r.block is None:
            continue
        if r.name in deliberate_zero:
            continue
        s = sites.rows.get((branch_stream("attn" if r.kind == "attn_branch" else "ffn", r.block, first), "forward"))
        if s is None or not s.var > 0 or not math.isfinite(r.var):
            continue
        ratio = r.var / s.var
        if ratio < th.vanishing_branch:
            if reading.downstream("forward", r.block):
                reading.folded.append(f"{r.name} at {fmt(ratio)} of the stream")
                continue
            small.append((r, ratio))
            reading.tensors[(r.name, "forward")] = "vanishing"
    for r, ratio in small:
        reading.symptoms.append(Symptom(
            "vanishing", r.name, ratio, th.vanishing_branch, "branch variance / stream variance", "forward", r.block,
            f"{r.name} adds {fmt(ratio)} of the stream's variance (< {fmt(th.vanishing_branch)}): its block acts "
            "as the identity", "branch"))


def starved_weights(reading: Reading, params: list[ParamRow], sites: Sites, th: Thresholds,
                    deliberate_zero: set[str]) -> None:
    """Blocks whose median weight-gradient std is below vanishing_grad of the model's largest
    (blocks holding a deliberately zero output exempt; downstream of an explosion folded)."""
    grads = [(p, p.grad_std) for p in params
             if p.grad_std is not None and math.isfinite(p.grad_std) and len(p.shape) == 2]
    top = max((g for _, g in grads), default=0.0)
    if not top > 0:
        return
    exempt = {block_of(n) for n in deliberate_zero} - {None}
    per_block: dict[int, list[float]] = {}
    for p, g in grads:
        if p.block is not None and p.block not in exempt:
            per_block.setdefault(p.block, []).append(g / top)
    medians = {b: sorted(v)[len(v) // 2] for b, v in per_block.items()}
    weak = sorted((b, r) for b, r in medians.items() if r < th.vanishing_grad)
    reading.folded += [f"block {b}'s weight gradients at {fmt(r)} of the largest" for b, r in weak
                       if reading.downstream("backward", b)]
    weak = [(b, r) for b, r in weak if not reading.downstream("backward", b)]
    for b, _ in weak:
        for q, _g in grads:
            if q.block == b:
                reading.params[q.name] = "vanishing"
    for b, ratio in weak:
        reading.symptoms.append(Symptom(
            "vanishing", sites.block_name(b), ratio, th.vanishing_grad,
            "median weight-gradient std in the block / largest in the model", "backward", b,
            f"the weights of block {b} get gradients {fmt(ratio)} times the model's largest (median; "
            f"< {fmt(th.vanishing_grad)})", "grads"))


def dead(reading: Reading, tensors: list[TensorRow], sites: Sites, th: Thresholds, deliberate_zero: set[str]) -> None:
    """Tensors (attention scores and probabilities aside) more than dead_fraction exactly zero."""
    found = [r for r in tensors if r.direction == "forward" and r.kind not in ("attn_probs", "attn_scores")
             and r.name not in deliberate_zero and r.frac_zero > th.dead_fraction]
    for r in sorted(found, key=lambda r: sites.rank.get(r.name, _LAST)):
        reading.tensors[(r.name, "forward")] = "dead"
        reading.symptoms.append(Symptom(
            "dead", r.name, r.frac_zero, th.dead_fraction, "fraction of entries exactly zero", "forward", r.block,
            f"{fmt(100 * r.frac_zero)}% of {r.name}'s entries are exactly zero (> {fmt(100 * th.dead_fraction)}%)",
            "dead"))


def saturated(reading: Reading, attention: list[AttentionRow], th: Thresholds) -> None:
    """Attention layers with more than saturated_rows of their query rows putting > 0.99 on one key
    (downstream of an explosion folded: scores from a blown-up stream)."""
    for a in attention:
        if not a.saturated_frac > th.saturated_rows:
            continue
        reading.attention[a.name] = "saturated"
        if reading.downstream("forward", a.block):
            reading.folded.append(f"{a.name} saturated ({fmt(100 * a.saturated_frac)}% of rows)")
            continue
        reading.symptoms.append(Symptom(
            "saturated", a.name, a.saturated_frac, th.saturated_rows,
            "fraction of query rows with max probability > 0.99", "forward", a.block,
            f"{fmt(100 * a.saturated_frac)}% of {a.name}'s query rows are saturated, putting > 0.99 on one key "
            f"(> {fmt(100 * th.saturated_rows)}%; score std {fmt(a.score_std)})", "saturated",
            "fail" if a.saturated_frac > th.saturated_fail else "warn"))


def loss(reading: Reading, judged: tuple[float, float, str] | None, th: Thresholds) -> None:
    """The loss against a uniform guess: loss - ln V > loss_excess ln V (a non-finite loss is the
    non-finite tensors' finding). ``judged``: (loss, ln V, severity), or None where not judged."""
    if judged is None:
        return
    value, ln_v, severity = judged
    if ln_v > 0 and math.isfinite(value) and value - ln_v > th.loss_excess * ln_v:
        reading.symptoms.append(Symptom(
            "misscaled", "loss", value / ln_v, 1 + th.loss_excess,
            "loss / ln V", None, None,
            f"the loss {fmt(value)} is {fmt(value / ln_v)} times a uniform guess's ln V = {fmt(ln_v)} "
            f"(> {fmt(1 + th.loss_excess)}; a fresh model's logits barely depend on the target, so its loss "
            "is about ln V + Var(logits)/2)", "loss", severity))


# ------------------------------------------------------------------ precursors of a training failure
# Read on trained weights only (``fresh`` not True): at a declared init the scores' and the logits'
# scale are the init's, judged by the score-scaling and weight-scale evidence.

def attention_logits(reading: Reading, tensors: list[TensorRow], th: Thresholds) -> None:
    """Attention layers whose largest |score| (the scaled logit q.k / sqrt(d_k) over the unmasked
    entries, the scores' max_abs) exceeds attn_logit (downstream of an explosion folded)."""
    for r in tensors:
        if r.kind != "attn_scores" or r.direction != "forward" or not r.max_abs > th.attn_logit:
            continue
        base = r.name[: -len(".scores")] if r.name.endswith(".scores") else r.name
        if r.block is not None and reading.downstream("forward", r.block):
            reading.folded.append(f"{base}'s largest attention logit {fmt(r.max_abs)}")
            continue
        reading.symptoms.append(Symptom(
            "misscaled", r.name, r.max_abs, th.attn_logit, "largest |attention logit| (q.k / sqrt(d_k))", "forward",
            r.block, f"{base}'s largest attention logit |q.k| / sqrt(d_k) is {fmt(r.max_abs)} (> "
            f"{fmt(th.attn_logit)}; score std {fmt(math.sqrt(r.var)) if r.var >= 0 else 'nan'})", "attn_logit", "warn"))


def attention_entropy(reading: Reading, attention: list[AttentionRow], th: Thresholds) -> None:
    """Attention layers whose mean row entropy is below attn_entropy of its causal maximum (the mean
    over rows of ln(keys the row may attend to)); downstream of an explosion folded."""
    for a in attention:
        if not (a.entropy_uniform > 0 and math.isfinite(a.entropy_mean)):
            continue
        ratio = a.entropy_mean / a.entropy_uniform
        if not ratio < th.attn_entropy:
            continue
        if reading.downstream("forward", a.block):
            reading.folded.append(f"{a.name}'s attention entropy at {fmt(ratio)} of its maximum")
            continue
        reading.symptoms.append(Symptom(
            "saturated", a.name, ratio, th.attn_entropy, "mean attention entropy / its causal maximum", "forward",
            a.block, f"{a.name}'s mean attention entropy is {fmt(a.entropy_mean)} nats, {fmt(ratio)} of the "
            f"{fmt(a.entropy_uniform)} of uniform causal attention (< {fmt(th.attn_entropy)})", "attn_entropy",
            "warn"))


def output_logits(reading: Reading, logits: dict | None, th: Thresholds) -> None:
    """The output logits' scale: |mean log Z| > logz_limit (log Z_t = logsumexp of row t's logits)
    and the largest |logit| > logit_limit. ``logits``: {"logz_mean", "logz_std", "logz_absmax",
    "max_logit", "rows"}, or None where no next-token logits were read."""
    if not logits:
        return
    mean, top = logits["logz_mean"], logits["max_logit"]
    if abs(mean) > th.logz_limit:
        reading.symptoms.append(Symptom(
            "misscaled", "logits", abs(mean), th.logz_limit, "|mean log Z| of the output rows", None, None,
            f"the output rows' log-partition log Z = logsumexp(logits) averages {fmt(mean)} (|mean| > "
            f"{fmt(th.logz_limit)}; std {fmt(logits['logz_std'])} over {int(logits['rows'])} rows): the logits "
            "drift together, which the softmax does not see and nothing holds back", "logits", "warn"))
    if top > th.logit_limit:
        reading.symptoms.append(Symptom(
            "misscaled", "logits", top, th.logit_limit, "largest |output logit|", None, None,
            f"the largest |output logit| is {fmt(top)} (> {fmt(th.logit_limit)})", "logits", "warn"))


def massive(reading: Reading, peaks: dict[str, float] | None, sites: Sites, th: Thresholds) -> None:
    """Block outputs whose max |x| / median |x| exceeds massive_ratio (downstream of an explosion folded)."""
    block_of_name = {n: k for k, n in sites.output_of.items()}
    for name, ratio in (peaks or {}).items():
        if not (math.isfinite(ratio) and ratio > th.massive_ratio):
            continue
        k = block_of_name.get(name, block_of(name))
        if k is not None and reading.downstream("forward", k):
            reading.folded.append(f"{name}'s peak at {fmt(ratio)} x its median")
            continue
        reading.symptoms.append(Symptom(
            "misscaled", name, ratio, th.massive_ratio, "max |x| / median |x| of the block output", "forward", k,
            f"{name}'s largest |activation| is {fmt(ratio)} times its median (> {fmt(th.massive_ratio)})",
            "massive", "warn"))
