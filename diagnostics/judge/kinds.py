"""Weight kinds: fresh, misscaled or trained, one decision per kind, and the finding of a misscaled one.

A weight kind is one role a weight plays in every block ("ffn.w2", "attn.q_proj",
"mlp.down_proj", "attn.c_attn", ...; a weight outside the block stack is a kind of its own). The
decision (:mod:`diagnostics.jobs.diagnose_kinds`) gives each kind a :class:`WeightKind`: "fresh"
(every tensor within a fresh draw's spread of its declared std), "misscaled" (every tensor still
an i.i.d. draw of its declared family, by the shape tests of
:mod:`diagnostics.measure.weight_shape`, with one common factor c outside [1/MISSCALE_MIN,
MISSCALE_MIN] of the declared std) or "trained" (moved off its declared init otherwise). This
module words a misscaled kind's finding: its factor, blocks, what it does to the forward and
backward gains, the common bugs that give that factor, and the fix.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["WeightKind", "MISSCALE_MIN", "role", "effect", "likely_bug", "kind_cause", "blocks_text"]

#: A kind is misscaled when its common factor c (measured std / declared std) is outside
#: [1/MISSCALE_MIN, MISSCALE_MIN]: trained weights of a few hundred steps drift by under 10%, and a
#: factor this large changes every variance the kind passes by more than 2x.
MISSCALE_MIN = 1.5

_RESIDUAL = ("output_proj", "w2", "o_proj", "down_proj", "c_proj", "fc2", "out_proj", "dense_4h_to_h",
             "attn_proj", "mlp_proj", "dense")
_QUERY_KEY = ("q_proj", "k_proj", "query", "key", "wq", "wk")


@dataclass(frozen=True)
class WeightKind:
    """One kind's state: ``kind`` its name (block prefix removed, no ``.weight``), ``state`` ("fresh",
    "misscaled", "trained"), ``factor`` (measured std / declared std over its tensors: their geometric
    mean; None for a constant-declared kind), ``blocks`` (the block indices holding it; () outside the
    stack), ``names`` (its parameters), ``declared_std`` (the first tensor's), ``fan_in`` (of the first
    2-D tensor, None otherwise) and ``why`` (the test that made it "trained", "" otherwise)."""

    kind: str
    state: str
    factor: float | None
    blocks: tuple[int, ...]
    names: tuple[str, ...]
    declared_std: float | None = None
    fan_in: int | None = None
    why: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocks"], d["names"] = list(self.blocks), list(self.names)
        return d


def role(kind: str, in_blocks: bool) -> str:
    """"residual" (the last layer of a branch, its output added to the stream), "query_key", "input"
    (any other block weight), "embedding" or "head" (outside the blocks), by the module's name."""
    module = kind.removesuffix(".weight").split(".")[-1]
    if not in_blocks:
        return "embedding" if any(s in kind for s in ("emb", "wte", "wpe", "tok")) else "head"
    if module in _RESIDUAL:
        return "residual"
    if module in _QUERY_KEY:
        return "query_key"
    return "input"


def blocks_text(blocks: tuple[int, ...]) -> str:
    """"blocks 0-3", "blocks 0, 2", "block 1", "outside the blocks"."""
    if not blocks:
        return "outside the blocks"
    if len(blocks) == 1:
        return f"block {blocks[0]}"
    if list(blocks) == list(range(blocks[0], blocks[-1] + 1)):
        return f"blocks {blocks[0]}-{blocks[-1]}"
    return "blocks " + ", ".join(str(b) for b in blocks)


def effect(k: WeightKind) -> str:
    """What the factor does to the forward and backward gains, for the kind's role."""
    c = k.factor
    c2 = f"{c * c:.3g}"
    r = role(k.kind, bool(k.blocks))
    if r == "residual":
        return (f"forward: its branch adds {c2}x the declared variance to the residual stream at each of its "
                f"blocks, so the stream {'grows' if c > 1 else 'is fed'} {'faster' if c > 1 else 'less'} with depth "
                f"than the init intends; backward: the gradient it sends into its branch has {c2}x the variance")
    if r == "query_key":
        return (f"forward: the attention scores' std is {c:.3g}x the declared init's, so the softmax is "
                f"{'sharper' if c > 1 else 'flatter'} than intended; backward: the gradients through the scores "
                f"scale alike")
    if r == "embedding":
        return (f"forward: the residual stream starts at {c2}x its declared variance; backward: the embedding's "
                f"gradient is unchanged, its relative updates {1 / c:.3g}x")
    if r == "head":
        return (f"forward: the logits' std is {c:.3g}x the declared init's; backward: the gradient into the stack "
                f"has {c2}x the variance")
    return (f"forward: each of its layers passes {c2}x the declared variance on; backward: the gradient it "
            f"passes back to its input has {c2}x the variance")


def likely_bug(k: WeightKind, num_layers: int | None, d_k: int | None) -> str:
    """The common bug whose factor is within 15% of the kind's, or "": a 1/sqrt(fan_in) missing or applied
    twice (any kind), the residual scaling 1/sqrt(2L) missing or applied twice (a residual output), an
    attention scale folded into the projection (q or k)."""
    c = k.factor
    r = role(k.kind, bool(k.blocks))
    cands: list[tuple[float, str]] = []
    if k.fan_in:
        f = math.sqrt(k.fan_in)
        cands += [(f, f"std without its 1/sqrt(fan_in) = 1/{f:.3g}"), (1 / f, "1/sqrt(fan_in) applied twice")]
    if num_layers and num_layers > 1 and r == "residual":
        s = math.sqrt(2 * num_layers)
        cands += [(s, f"the residual scaling 1/sqrt(2L) = 1/{s:.3g} missing"),
                  (1 / s, f"the residual scaling 1/sqrt(2L) = 1/{s:.3g} applied twice")]
    if d_k and d_k > 1 and r == "query_key":
        cands += [(d_k ** 0.25, "the attention scale d_k^(1/4) folded into the projection"),
                  (d_k ** -0.25, "the attention scale 1/d_k^(1/4) folded into the projection"),
                  (d_k ** 0.5, "the attention scale sqrt(d_k) folded into the projection"),
                  (d_k ** -0.5, "the attention scale 1/sqrt(d_k) folded into the projection")]
    near = [(abs(math.log(c / x)), w) for x, w in cands if abs(math.log(c / x)) < math.log(1.15)]
    return min(near)[1] if near else ""


def kind_cause(k: WeightKind, drift_fail: float, num_layers: int | None = None, d_k: int | None = None) -> dict:
    """The finding's fields of a misscaled kind: value (the factor), threshold, where, block, statistic,
    text, severity (fail outside [1/drift_fail, drift_fail], warn inside), advice, large."""
    c = k.factor
    large = c > 1
    bug = likely_bug(k, num_layers, d_k)
    declared = f" (std {k.declared_std:.3g})" if k.declared_std else ""
    text = (f"{k.kind} is a fresh draw of its declared init at {c:.3g}x its std{declared}, in "
            f"{blocks_text(k.blocks)} ({len(k.names)} tensor(s)): {effect(k)}")
    where = k.names[0].removesuffix(".weight")
    cause = bug or ("one kind of layer initialised with the wrong std: a missing or extra 1/sqrt(fan_in), the "
                    "residual scaling 1/sqrt(2L) applied twice or not at all, or an attention scale folded into a "
                    "projection")
    return dict(value=c, threshold=MISSCALE_MIN if large else 1 / MISSCALE_MIN, where=where,
                block=k.blocks[0] if k.blocks else None, direction=None, kind="misscaled", large=large,
                far=not 1 / drift_fail <= c <= drift_fail,
                statistic=f"std / declared init std of every {k.kind} (one factor; the entries a fresh draw's shape)",
                text=text, severity="warn" if 1 / drift_fail <= c <= drift_fail else "fail",
                advice=f"likely cause: {cause}; re-initialise {k.kind} with its declared std"
                       f"{' ' + format(k.declared_std, '.3g') if k.declared_std else ''} (divide it by {c:.3g})")
