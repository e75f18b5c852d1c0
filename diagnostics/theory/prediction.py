"""One prediction of one tensor's moments, whichever theory made it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["Prediction", "no_variance_left", "qk_norm_not_covered", "qk_norm_outside"]


@dataclass(frozen=True)
class Prediction:
    """Predicted moments of one tensor in one direction.

    mean_square: predicted E[x^2]; mean: the mean used (local: measured; global: predicted);
    var = mean_square - mean^2. valid/validity: whether the rule's assumptions hold here.
    rule: which rule produced it (for the report); the token-kernel theory's rules start
    with "kernel". cosine: the predicted mean cosine between different tokens of a sequence
    (the kernel theory, at the residual points; None elsewhere). independent: where the
    kernel theory made this prediction, the independent-token rule's prediction of the same
    tensor (with its own validity), kept for comparison; None otherwise.
    """

    mean_square: float
    mean: float
    valid: bool
    validity: str
    rule: str
    cosine: float | None = None
    independent: Prediction | None = None

    @property
    def var(self) -> float:
        return self.mean_square - self.mean * self.mean  # inf, never OverflowError, past the float64 range


def qk_norm_not_covered(config) -> str:
    """Why the theories do not describe ``config``'s attention ("" where they do): their score rules
    read q and k from the projections, E[s^2] = E[q^2] E[k^2], and a per-head query/key norm
    (``ModelConfig.qk_norm``) replaces those moments by the norm's (about g^2 per entry, whatever
    the projections' scale), so the scores and everything computed from them differ."""
    qk = getattr(config, "qk_norm", "none")
    if qk == "none":
        return ""
    return (f"qk_norm={qk!r} is not covered: the theory takes the attention scores from the q/k projections, "
            "without the per-head query/key norm that sets their scale")


def qk_norm_outside(preds: dict, config, plan, mode: str) -> dict:
    """``preds`` ({(name, direction): Prediction}) with every prediction a qk-norm changes marked
    outside validity (:func:`qk_norm_not_covered` says why; unchanged without qk-norm).

    mode "global" (predictions carried from the embeddings): every backward prediction and every
    forward one from block 0's attention scores on; what block 0 computes before them (the
    embeddings, the norm its attention reads, q_proj, k_proj, v_proj) stays. mode "local" (each rule
    from measured inputs): the scores' forward rule (E[q^2] E[k^2] of the projections) and the
    q/k projections' gradients (which cross the norm's Jacobian)."""
    why = qk_norm_not_covered(config)
    if not why:
        return preds
    if mode == "local":
        def changed(name: str, direction: str) -> bool:
            if direction == "forward":
                return name.endswith(".attn.scores")
            return name.endswith((".attn.q_proj", ".attn.k_proj"))
    else:
        first = plan.blocks[0]
        attn = next(s for s in first.steps if s.kind == "attention")
        before = {plan.embedding, plan.input} | ({plan.positions} if plan.positions else set())
        before |= {s.module for s in first.steps[:first.steps.index(attn)] if s.kind == "norm"}
        before |= {f"{attn.module}.{p}" for p in ("q_proj", "k_proj", "v_proj")}

        def changed(name: str, direction: str) -> bool:
            return direction == "backward" or name not in before
    return {k: dataclasses.replace(p, valid=False, validity=why) if p.valid and changed(*k) else p
            for k, p in preds.items()}


def no_variance_left(p: Prediction) -> Prediction:
    """A valid prediction that cannot be compared with a measured variance is outside validity:
    one whose numbers left the float64 range (inf or NaN: the recursion overflowed on an absurdly
    scaled model), and one whose variance (mean square - mean^2) is not positive."""
    if p.valid and not (math.isfinite(p.mean_square) and math.isfinite(p.mean) and math.isfinite(p.var)):
        return dataclasses.replace(
            p, valid=False, validity=f"cannot be computed in double precision (mean square {p.mean_square:.3g}, "
                                     f"mean {p.mean:.3g}): the model's scale overflows the rule")
    if p.valid and not p.var > 0 and p.mean_square > 0:
        return dataclasses.replace(
            p, valid=False, validity=f"the mean ({p.mean:.3g}) exceeds the predicted root mean square "
                                     f"({math.sqrt(p.mean_square):.3g}): no variance is left to predict (local mode: "
                                     "a trained layer whose weights align with its input's mean, not a random matrix)")
    return p
