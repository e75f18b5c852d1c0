"""Coverage: which checks :func:`~.verdicts.judge` could make from one measurement, and why not the others."""

from __future__ import annotations

from ..result import CHECKS, LOSS, STREAM_BACKWARD, STREAM_FORWARD, AttentionRow, DepthRow, ParamRow, TensorRow
from .evidence import evidence

__all__ = ["coverage"]


def coverage(tensors: list[TensorRow], params: list[ParamRow], attention: list[AttentionRow], depth: list[DepthRow],
             architecture: dict | None = None, flat: dict[str, float] | None = None,
             deliberate_zero: set[str] = frozenset(), loss_reason: str = "", stream_reason: str = "",
             fresh: bool | None = None, logits: dict | None = None,
             peaks: dict[str, float] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """What :func:`~.verdicts.judge` could judge from these records (the check names of
    :data:`diagnostics.result.CHECKS`, in that order), and each check it could not, with why.

    ``loss_reason``: why the loss was not judged against ln V ("" if it was); ``stream_reason``:
    why there is no residual stream (no block stack found; "" if there is one). A check that
    does not apply to a known build (post-norm imbalance of a pre-norm tinylm model) is neither.
    ``fresh``: the diagnosis's one decision whether the weights are at their declared init.
    ``logits`` / ``peaks``: the output logits' scale and the block outputs' peak ratios
    (:func:`~.verdicts.judge`'s); the precursors they feed are judged on weights not known fresh.
    """
    arch = architecture or {}
    tiny = "init" in arch  # a tinylm model's build is known from its config; another's only its norms
    ev = evidence(tensors, params, architecture, flat, deliberate_zero, depth, fresh)
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
        "no declared init (a tinylm scheme, or a Hugging Face config's initializer_range)",
        "attention (saturated rows)": "" if attention else
        "no attention seen (no scaled_dot_product_attention call; explicit matmul-softmax attention is not seen)",
        "attention score scaling": "" if ev.fresh and ev.score_ratio else
        ("no attention seen" if not (tiny or attention) else
         "judged on weights at their declared init only, and these have moved off it (trained)" if fresh is False
         else "judged on weights at their declared init only, and no init is declared" if fresh is None
         else "no q/k projections measured beside the scores"),
        "SiLU gates in the flat region": "" if flat else "no SiLU gate known (a tinylm SwiGLU or SiLU FFN)",
        "residual branches": "" if any(r.kind in ("attn_branch", "ffn_branch") for r in tensors) else
        "the branches of a block are known for tinylm models only",
        "exactly-zero (dead) tensors": "" if any(r.direction == "forward" for r in tensors) else "no tensor measured",
        "non-finite values": "",
        LOSS: loss_reason,
        **_precursors(tensors, attention, fresh, logits, peaks),
    }
    if arch.get("norm") == "post":
        reasons["post-norm gradient imbalance"] = "" if ev.imbalance is not None else few
    elif not tiny and arch.get("norm") != "none":
        reasons["post-norm gradient imbalance"] = "norm placement unknown (not a tinylm model)"
    order = [c for c in CHECKS if c in reasons]
    return [c for c in order if not reasons[c]], [(c, reasons[c]) for c in order if reasons[c]]


def _precursors(tensors: list[TensorRow], attention: list[AttentionRow], fresh: bool | None, logits: dict | None,
                peaks: dict[str, float] | None) -> dict[str, str]:
    """Why each precursor check could not be made ("" where it could)."""
    at_init = "judged on trained weights only, and these are at their declared init" if fresh else ""
    scores = any(r.kind == "attn_scores" and r.direction == "forward" for r in tensors)
    return {
        "attention logits": at_init or ("" if scores else
                                        "no attention scores measured (a tinylm attention or a "
                                        "scaled_dot_product_attention call)"),
        "attention entropy": at_init or ("" if attention else "no attention seen"),
        "output logits (log Z, largest logit)": at_init or ("" if logits else
                                                           "the model's output holds no next-token logits (B, T, V)"),
        "massive activations (peak / median)": at_init or (
            "" if any(v == v for v in (peaks or {}).values()) else "no block output measured (no block stack found)"),
    }
