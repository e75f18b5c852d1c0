"""Local theory's premise on trained weights: a prediction that reads a trained weight is outside validity.

Internal to :mod:`diagnostics.jobs.diagnose`. The local rules that pass a variance through a weight
(``linear: d_in E[w^2] E[x^2]`` forward, ``linear backward: d_out E[w^2] E[g_y^2]``, the scores'
E[q^2] E[k^2], the gated product E[silu(a)^2] E[b^2], and the branches and gradients built from
them) assume the weight is independent of what it reads: true of a random draw at any scale (a
fresh or misscaled kind), false once training has aligned its rows with its input (a trained kind,
:mod:`.diagnose_kinds`), where the measured/predicted ratio measures that alignment (10x and more
on trained checkpoints), not a fault. Each such prediction is marked outside validity with the
kind that breaks it.
"""

from __future__ import annotations

import dataclasses

from ..judge.kinds import WeightKind
from ..theory import Prediction
from .diagnose_kinds import kind_of

__all__ = ["READS", "trained_premise"]

#: (row name within its block, direction) -> the weight kinds its local rule reads; a forward row
#: not listed whose rule is "linear: ..." reads the kind of its own name (a Linear's output: its own
#: weight); norms and embeddings read their weights exactly (mean(gain^2), E[w^2]) and keep their validity.
READS: dict[tuple[str, str], tuple[str, ...]] = {
    ("attn.scores", "forward"): ("attn.q_proj", "attn.k_proj"),
    ("attn", "forward"): ("attn.output_proj",),
    ("ffn.hidden", "forward"): ("ffn.w1", "ffn.w3"),
    ("ffn", "forward"): ("ffn.w2",),
    ("ffn.hidden", "backward"): ("ffn.w2",),
    ("ffn.w1", "backward"): ("ffn.w2", "ffn.w1", "ffn.w3"),
    ("ffn.w3", "backward"): ("ffn.w2", "ffn.w1", "ffn.w3"),
    ("attn.heads", "backward"): ("attn.output_proj",),
    ("ln1", "backward"): ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    ("ln2", "backward"): ("ffn.w1", "ffn.w3"),
    ("ln_final", "backward"): ("lm_head",),
}


def _reason(k: WeightKind) -> str:
    return (f"the rule takes {k.kind} as independent of what it reads (a random draw), but {k.kind} is trained "
            f"({k.why or 'moved off its declared init'}): its rows align with its input, so the ratio measures "
            "that alignment, not a fault")


def trained_premise(preds: dict[tuple[str, str], Prediction], kinds: list[WeightKind], blocks: tuple[str, ...]
                    ) -> dict[tuple[str, str], Prediction]:
    """``preds`` with every valid prediction whose rule reads a trained kind (:data:`READS`) marked outside
    validity, with why; unchanged where no kind is trained."""
    trained = {k.kind: k for k in kinds if k.state == "trained"}
    if not trained:
        return preds
    out = {}
    for (name, direction), p in preds.items():
        local, _ = kind_of(name + ".weight", blocks)
        own = (local,) if direction == "forward" and p.rule.startswith("linear") else ()
        reads = READS.get((local, direction), own)
        hit = next((trained[r] for r in reads if r in trained), None)
        if hit is not None and p.valid:
            p = dataclasses.replace(p, valid=False, validity=_reason(hit))
        out[(name, direction)] = p
    return out
