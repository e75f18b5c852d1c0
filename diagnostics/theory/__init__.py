"""Theory: the predicted moments of every tensor the probe measures.

Two theories, one :class:`Prediction` type, one :func:`predict` that combines them:

* :mod:`.independent` — per-layer rules that treat the tokens of a sequence as
  independent (forward and backward, global at init or local from measured inputs);
  the rule of each kind of site in :mod:`.independent_rules`;
* :mod:`.tokenkernel` — the token-kernel theory, which carries the T x T covariance
  between a sequence's positions forward through the blocks (global mode); its maps
  (norm, attention, activations) in :mod:`.tokenkernel_maps`;
* :mod:`.backkernel` — the same theory backward: the T x T covariance of the gradient
  between positions, carried from the cross-entropy gradient down to the embeddings; its
  maps in :mod:`.backkernel_maps`;
* :mod:`.gaussian` — the Gaussian expectations all three read (activation, LayerNorm and
  softmax moments, the cross-entropy gradient).

``predict`` takes every prediction from the independent-token rules and, in global
mode, replaces the forward ones by the token-kernel theory's and the backward ones by
the backward kernel's, keeping the one it replaces in ``Prediction.independent``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from torch import nn

import tinylm

from ..measure.moments import ProbeStats
from ..options import OptionsError
from .independent import ce_grad_mean_square, independent_predictions, silu_moments, softmax_moments
from .prediction import Prediction, no_variance_left, qk_norm_outside
from . import backkernel
from .backkernel import BackwardKernel, backward_kernel, cached_backward_kernel
from .tokenkernel import KernelTheory, cached_kernel_theory, kernel_theory, token_coincidence

__all__ = [
    "Prediction",
    "predict",
    "KernelTheory",
    "kernel_theory",
    "cached_kernel_theory",
    "token_coincidence",
    "BackwardKernel",
    "backward_kernel",
    "cached_backward_kernel",
    "silu_moments",
    "softmax_moments",
    "ce_grad_mean_square",
]


def predict(model: nn.Module, mode: str, stats: ProbeStats | None = None, *, seq_len: int,
            tokens: float | None = None, scheme: str | None = None, softmax: tuple[float, float] | None = None,
            forward: str = "kernel", coincidence=None, backward: str | None = None
            ) -> dict[tuple[str, str], Prediction]:
    """Predicted moments of every instrumented tensor of a tinylm model, keyed (name, direction).

    mode "global": analytic at init from the declared distributions of ``scheme``
    (default ``model.config.init``); ``forward="kernel"`` (default) takes the forward
    predictions from the token-kernel theory (:func:`.tokenkernel.cached_kernel_theory`,
    computed once per process for each config, seq_len, scheme and ``coincidence``), keeping
    the independent-token ones in ``Prediction.independent``; ``forward="independent"``
    keeps the independent-token rules for every prediction. ``backward`` (default: as
    ``forward``): "kernel" takes the gradient predictions from the backward kernel
    (:func:`.backkernel.cached_backward_kernel`, which walks the forward kernels of the same
    config), keeping the independent-token ones in ``Prediction.independent``, for the configurations and
    lengths it covers (:func:`.backkernel.not_covered`; the others keep the independent-token rules); where the
    cross-entropy rule's premise fails (``softmax=``) every backward kernel prediction is
    outside validity with that reason. ``coincidence``: the (T, T)
    fraction of sequences holding the same token at positions s and t
    (:func:`.tokenkernel.token_coincidence`), None for uniform random tokens.
    Global predictions describe the model without dropout (eval mode, as ``probe``
    measures by default). mode "local": from ``stats`` (measured moments) and the
    model's actual weights (``forward`` and ``coincidence`` unused). ``tokens``:
    positions per loss (batch x seq_len), which sets the scale of every gradient (the
    loss is their mean); required in global mode; in local mode None reads it from
    ``stats`` as the count of one batch, which is wrong
    when ``stats`` pools several batches: pass it then. ``softmax``: the measured
    (E[sum_c p_c^2], E[p_y]) over the loss's positions (diagnose measures them), against
    which the cross-entropy rule's premises are checked (None: not checked).
    Returns {} for a model that is not a tinylm.TransformerLM. Predictions outside their
    stated validity carry valid=False and say why (see :mod:`.independent`); with a per-head
    query/key norm (``qk_norm``) the predictions it changes are outside validity
    (:func:`.prediction.qk_norm_outside`).
    """
    if mode not in ("local", "global"):
        raise OptionsError(f"mode={mode!r}: choose 'local' or 'global'")
    if forward not in ("kernel", "independent"):
        raise OptionsError(f"forward={forward!r}: choose 'kernel' (token-kernel theory) or 'independent'")
    backward = forward if backward is None else backward
    if backward not in ("kernel", "independent"):
        raise OptionsError(f"backward={backward!r}: choose 'kernel' (backward token-kernel theory) or 'independent'")
    if not isinstance(model, tinylm.TransformerLM):
        return {}
    if mode == "local" and stats is None:
        raise OptionsError("mode='local' needs stats= (the ProbeStats of a run) to read the layers' inputs from")
    if mode == "global" and tokens is None:
        raise OptionsError("mode='global' needs tokens= (batch x seq_len positions per loss)")
    # an absurdly scaled model overflows float64 on the way: the numbers become inf or NaN (never an
    # exception) and each such prediction is marked outside validity, so numpy's warnings are noise here
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        out = independent_predictions(model, mode, stats, seq_len=seq_len, tokens=tokens, scheme=scheme,
                                      softmax=softmax)
        bk = None
        if mode == "global" and backward == "kernel" and backkernel.not_covered(model.config, int(seq_len)) is None:
            bk = cached_backward_kernel(model.config, int(seq_len), tokens=float(tokens), scheme=scheme,
                                        coincidence=coincidence)
        if mode == "global" and forward == "kernel":
            kt = bk.forward if bk is not None else cached_kernel_theory(model.config, int(seq_len), scheme=scheme,
                                                                        coincidence=coincidence)
            out = _with_kernel(out, kt.predictions(dropout_active=False))
        if bk is not None:
            out = _with_kernel(out, bk.predictions(dropout_active=False))
        if mode == "global":  # every global gradient starts from the cross-entropy rule at the logits
            out = _ce_premise(out, out.get((tinylm.plan.HEAD, "backward")))
        out = qk_norm_outside(out, model.config, tinylm.plan.build(model.config), mode)
    return _no_impossible_variance(out)


def _no_impossible_variance(preds: dict[tuple[str, str], Prediction]) -> dict[tuple[str, str], Prediction]:
    """Every prediction whose variance E[x^2] - E[x]^2 is negative or not finite marked outside validity,
    with the value and why: a variance cannot be negative, so the rules' premises failed there (a mean
    predicted larger than the root mean square, as a local rule combines measured moments of trained weights)."""
    out = {}
    for key, p in preds.items():
        v = p.var
        if math.isfinite(v) and v >= 0:
            out[key] = p
            continue
        why = (f"the rules give a {'negative' if v < 0 else 'non-finite'} variance ({v:.3g}): their premises fail "
               "here" if not math.isnan(v) else "the rules give no finite variance here: their premises fail")
        out[key] = dataclasses.replace(p, valid=False, validity=why if p.valid else f"{why}; {p.validity}")
    return out


def _ce_premise(preds: dict[tuple[str, str], Prediction], ce: Prediction | None) -> dict[tuple[str, str], Prediction]:
    """Every global backward prediction (the backward kernel's or the independent-token one) outside validity when
    the cross-entropy rule's premise (a near-uniform softmax independent of the targets, checked by the
    independent-token rule at the logits) fails: each is that rule carried down."""
    if ce is None or ce.valid:
        return preds
    why = "every gradient starts at the logits, where " + ce.validity
    return {k: dataclasses.replace(p, valid=False, validity=why) if p.valid and k[1] == "backward" else p
            for k, p in preds.items()}


def _with_kernel(indep: dict[tuple[str, str], Prediction], kernel: dict[tuple[str, str], Prediction]
                 ) -> dict[tuple[str, str], Prediction]:
    """The kernel theory's predictions (forward or backward) in place of the independent-token ones,
    each keeping the one it replaces in ``independent``; except where the kernel's is outside
    validity and the independent-token one is not (block 0 without a norm; the logits' gradient
    without a norm): that one stays."""
    out = dict(indep)
    for key, k in kernel.items():
        i = indep.get(key)
        if i is not None and i.valid and not k.valid:
            continue
        out[key] = no_variance_left(dataclasses.replace(k, independent=i))
    return out
