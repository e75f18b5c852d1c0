"""The rows of a :class:`~diagnostics.result.DiagnoseResult`, built from pooled moments and predictions.

Internal to :mod:`diagnostics.jobs.diagnose` (its ``_rows`` stage). Each builder reads the
pooled :class:`~diagnostics.measure.moments.ProbeStats` of every replicate and, for the
tensors, the predictions of each replicate, whose ratios give the interval
(:func:`diagnostics.measure.intervals.log_t_interval` over one ratio per independent replicate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ..measure.intervals import group_geometric_means, log_t_interval
from ..measure.moments import ProbeStats
from ..result import AttentionRow, DepthRow, ParamRow, TensorRow
from ..theory import Prediction

__all__ = ["comparable", "tensor_rows", "param_rows", "attention_rows", "depth_rows"]

Predictions = dict[tuple[str, str], Prediction]
BlockIndex = Callable[[str], "int | None"]


def comparable(p: Prediction) -> bool:
    """Whether a predicted variance can divide a measured one: finite and positive."""
    return math.isfinite(p.var) and p.var > 0


def _possible(v: float) -> bool:
    """Whether a predicted variance can be reported: finite and not negative (else the prediction is
    outside validity, with why, and the row carries no number)."""
    return math.isfinite(v) and v >= 0


def _ratio(name: str, direction: str, replicates: Sequence[ProbeStats], per_rep: Sequence[Predictions],
           group: Callable[[int], int]) -> tuple[float | None, float | None, float | None]:
    """(ratio, low, high) of measured over predicted variance over the replicates (replicate k in
    independent group ``group(k)``)."""
    rs = []
    for k, (st, pr) in enumerate(zip(replicates, per_rep)):
        mm, pp = st.tensors.get((name, direction)), pr.get((name, direction))
        if mm is not None and pp is not None and comparable(pp) and mm.count:
            rs.append((group(k), mm.var / pp.var))
    return log_t_interval(group_geometric_means(rs))


def tensor_rows(pooled: ProbeStats, pooled_pred: Predictions, replicates: Sequence[ProbeStats],
                per_rep: Sequence[Predictions], group: Callable[[int], int], mode: str,
                index: BlockIndex) -> list[TensorRow]:
    """One row per measured tensor and direction: forward in the order the tensors were produced,
    backward in the reverse; each with its prediction (theory ``mode``) and ratio interval."""
    rows: list[TensorRow] = []
    names = list(pooled.order)
    for direction in ("forward", "backward"):
        for name in names if direction == "forward" else list(reversed(names)):
            mom = pooled.tensors.get((name, direction))
            if mom is None:
                continue
            pred = pooled_pred.get((name, direction))
            ratio = low = high = None
            if pred is not None and comparable(pred):
                ratio, low, high = _ratio(name, direction, replicates, per_rep, group)
            rows.append(TensorRow(
                name=name, block=index(name), kind=pooled.kinds.get(name, "module"), direction=direction,
                count=int(mom.count), mean=mom.mean, var=mom.var, mean_square=mom.mean_square, max_abs=mom.max_abs,
                frac_zero=mom.frac_zero, frac_nonfinite=mom.frac_nonfinite,
                frac_fp16_underflow=mom.frac_fp16_underflow, frac_fp16_overflow=mom.frac_fp16_overflow,
                frac_bf16_underflow=mom.frac_bf16_underflow, frac_bf16_overflow=mom.frac_bf16_overflow,
                predicted=pred.var if pred is not None and _possible(pred.var) else None, ratio=ratio,
                ratio_low=low, ratio_high=high,
                theory=mode if pred is not None else "", valid=pred.valid if pred is not None else True,
                validity=pred.validity if pred is not None else "", rule=pred.rule if pred is not None else "",
                predicted_independent=pred.independent.var if pred is not None and pred.independent
                and _possible(pred.independent.var) else None,
            ))
    return rows


def param_rows(first: ProbeStats, index: BlockIndex, declared: dict | None = None) -> list[ParamRow]:
    """One row per parameter, from the first replicate's statistics (the model as given).

    ``declared``: {name: tinylm.init.Dist}, the model's declared init
    (:func:`~diagnostics.jobs.diagnose_init.declaration`); a parameter not in it has no declared std.
    None: the probe's own (from ``model.config.init``)."""
    rows = []
    for n, p in first.params.items():
        std_d, words = p.declared_std, p.declared
        if declared is not None:
            d = declared.get(n)
            std_d, words = (d.actual_std, d.describe()) if d is not None else (None, "")
        drift = p.std / std_d if std_d and math.isfinite(p.std) else None
        rows.append(ParamRow(
            name=n, block=index(n), shape=tuple(p.shape), std=p.std, declared_std=std_d,
            declared=words, drift=drift, spectral_norm=p.spectral_norm, stable_rank=p.stable_rank,
            grad_std=p.grad_std, frac_nonfinite=p.frac_nonfinite, note=p.note))
    return rows


def attention_rows(pooled: ProbeStats, seq_len: int, index: BlockIndex) -> list[AttentionRow]:
    """One row per attention layer: score std, entropy (mean, min, and that of causal attention
    spread evenly, mean over t of ln t), saturated rows."""
    rows: list[AttentionRow] = []
    for name, am in pooled.attention.items():
        base = name[: -len(".probs")] if name.endswith(".probs") else name
        sc = pooled.tensors.get((f"{base}.scores", "forward"))
        rows.append(AttentionRow(
            name=base, block=index(name) if index(name) is not None else -1,
            score_std=sc.std if sc is not None else math.nan, entropy_mean=am.entropy_mean,
            entropy_min=am.entropy_min, entropy_uniform=float(np.mean(np.log(np.arange(1, seq_len + 1)))),
            saturated_frac=am.saturated_frac))
    return rows


def depth_rows(points: Sequence[str], pooled: ProbeStats, pooled_pred: Predictions) -> list[DepthRow]:
    """One row per measured stream point (index k = its place in ``points``): forward and backward
    variance beside their predictions, and the mean cosine between tokens beside its prediction."""
    rows: list[DepthRow] = []
    for k, name in enumerate(points):
        f = pooled.tensors.get((name, "forward"))
        if f is None:
            continue
        b = pooled.tensors.get((name, "backward"))
        pf, pb = pooled_pred.get((name, "forward")), pooled_pred.get((name, "backward"))
        cos = pooled.cosine.get(name)  # not measured (None) where the probe sees no token vectors
        rows.append(DepthRow(index=k, name=name, forward_var=f.var, forward_predicted=pf.var if pf else None,
                             backward_var=b.var if b is not None else None,
                             backward_predicted=pb.var if pb else None,
                             cosine=cos.mean if cos is not None and math.isfinite(cos.mean) else None,
                             cosine_predicted=pf.cosine if pf is not None else None))
    return rows
