"""The result of a diagnosis: plain, typed, frozen rows that the report draws.

Every figure the terminal report shows is a field here; ``reports`` computes
nothing itself. :meth:`DiagnoseResult.to_json` writes the versioned schema
(``SCHEMA_VERSION``); everything in it but the one timestamp ``created`` is a
deterministic function of the model, the tokens and the options.

Conventions used by all rows:

* ``direction`` is ``"forward"`` (the tensor itself) or ``"backward"`` (the
  gradient of the mean next-token loss with respect to that tensor).
* ``block`` is the Transformer block index ``i`` for names ``layers.i.*`` and
  ``None`` for tensors outside the blocks (embedding, final norm, head).
* Variances are pooled over every element of the tensor, every token, batch and
  seed measured (population variance, float64).
* A ratio is measured / predicted variance: the geometric mean over independent
  replicates (seeds x batches) of each replicate's ratio; its 99% interval is a
  Student-t interval on ln(ratio) over the replicates, exponentiated (asymmetric,
  always positive), never over the elements of one tensor. ``None`` where there is
  no prediction (the interval also with fewer than two replicates).

Schema versions (``SCHEMA_VERSION``, written as ``schema_version``):

* "1": ratio the arithmetic mean of the replicates' ratios, with a symmetric t interval.
* "2": ratio the geometric mean with the interval on ln(ratio) (above); the global
  forward predictions of a tinylm model from the token-kernel theory
  (:mod:`diagnostics.theory.tokenkernel`); new fields ``TensorRow.rule``,
  ``TensorRow.predicted_independent`` and ``DepthRow.cosine_predicted``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "VERDICT_KINDS",
    "Finding",
    "TensorRow",
    "ParamRow",
    "AttentionRow",
    "DepthRow",
    "Header",
    "DiagnoseResult",
]

SCHEMA_VERSION = "2"

#: The verdict kinds, mildest first. "ok" is never a Finding.
VERDICT_KINDS = ("ok", "vanishing", "exploding", "dead", "saturated", "non_finite")


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become strings "nan", "inf", "-inf"; tuples become lists."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@dataclass(frozen=True)
class Finding:
    """One verdict that is not "ok".

    kind: one of "vanishing", "exploding", "dead", "saturated", "non_finite".
    where: the tensor or parameter name it concerns ("model" for whole-model findings).
    value: the number that triggered it; threshold: the threshold it crossed
    (``value`` > ``threshold`` or < it, as ``message`` says).
    statistic: which number ``value`` is (e.g. "per-block forward variance gain").
    direction: "forward", "backward" or None; block: the first block concerned, or None.
    message: one sentence naming the number and the threshold.
    suggestion: what to try, grounded in the finding.
    """

    kind: str
    where: str
    value: float
    threshold: float
    message: str
    statistic: str = ""
    direction: str | None = None
    block: int | None = None
    suggestion: str = ""


@dataclass(frozen=True)
class TensorRow:
    """One instrumented tensor in one direction.

    name: module name whose output this is (e.g. "layers.3.attn", "layers.3.attn.scores").
    kind: "embedding", "linear", "norm", "attn_scores", "attn_probs", "attn_branch",
        "ffn_branch", "ffn_hidden", "resid_mid", "residual" (a block's output), "logits"
        (the lm_head output) or "module" (any other instrumented leaf).
    count: finite elements measured. var, mean, mean_square, max_abs: their moments.
    frac_zero, frac_nonfinite: fractions of all elements exactly 0 / not finite.
    frac_fp16_underflow / frac_bf16_underflow: nonzero elements with |x| below the
    format's smallest normal; frac_fp16_overflow / frac_bf16_overflow: |x| above its
    largest finite value. (Attention scores: masked -inf entries are excluded from
    every statistic.)
    predicted: theory's predicted variance (None: no theory for this tensor).
    ratio: measured/predicted variance, the geometric mean over replicates (seeds x
        batches) of each replicate's own ratio; ratio_low, ratio_high: its 99% interval,
        a Student-t interval on ln(ratio) over the replicates, exponentiated (asymmetric
        around ratio, always > 0). ratio is None when there is no prediction; the
        interval is None with fewer than 2 replicates, and when a replicate's ratio is 0
        (ratio is then 0) or not finite (ratio None too): see
        diagnostics.diagnose.log_t_interval.
    theory: "local", "global" or "" (no prediction).
    valid: whether the prediction is inside its stated validity; validity: why not
    (empty when valid).
    rule: the rule that made the prediction ("" when none); the token-kernel theory's
    rules start with "kernel" (global forward predictions of a tinylm model).
    predicted_independent: where the kernel theory made ``predicted``, the variance the
    independent-token rule predicts for the same tensor (None otherwise), for comparison.
    verdict: the per-tensor verdict kind ("ok" or a VERDICT_KINDS entry).
    """

    name: str
    block: int | None
    kind: str
    direction: str
    count: int
    mean: float
    var: float
    mean_square: float
    max_abs: float
    frac_zero: float
    frac_nonfinite: float
    frac_fp16_underflow: float
    frac_fp16_overflow: float
    frac_bf16_underflow: float
    frac_bf16_overflow: float
    predicted: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    theory: str = ""
    valid: bool = True
    validity: str = ""
    verdict: str = "ok"
    rule: str = ""
    predicted_independent: float | None = None


@dataclass(frozen=True)
class ParamRow:
    """One parameter (tied parameters once).

    std, grad_std: of the entries and of their gradient (grad_std None when no grad).
    declared_std: the std its init scheme declares (truncation corrected; None when
    the model has no scheme); drift = std / declared_std (None when undefined, e.g.
    a constant-declared gain). spectral_norm, stable_rank (= ||W||_F^2 / ||W||_2^2):
    for 2-D parameters, else None. frac_nonfinite: of the entries.
    """

    name: str
    block: int | None
    shape: tuple[int, ...]
    std: float
    declared_std: float | None
    declared: str
    drift: float | None
    spectral_norm: float | None
    stable_rank: float | None
    grad_std: float | None
    frac_nonfinite: float
    verdict: str = "ok"


@dataclass(frozen=True)
class AttentionRow:
    """The attention panel of one attention layer (heads pooled).

    score_std: std of the finite (unmasked) pre-softmax scores.
    entropy_mean / entropy_min: softmax entropy (nats) per query row, mean and minimum.
    entropy_uniform: mean entropy causal attention would have if uniform (mean of ln(t+1)).
    saturated_frac: fraction of rows whose largest probability exceeds 0.99.
    """

    name: str
    block: int
    score_std: float
    entropy_mean: float
    entropy_min: float
    entropy_uniform: float
    saturated_frac: float
    verdict: str = "ok"


@dataclass(frozen=True)
class DepthRow:
    """The residual stream at one depth, for the depth chart.

    index: 0 is the embedding output (block 0's input), k >= 1 the output of block k-1.
    name: the tensor measured there. forward_var / backward_var: measured variance of
    the stream and of its gradient; *_predicted: theory's (None when none).
    cosine: mean cosine similarity between different tokens' vectors of a sequence
    (0 for independent tokens; towards 1 as tokens collapse onto one direction).
    cosine_predicted: the token-kernel theory's prediction of ``cosine`` (global mode on a
    tinylm model; None otherwise).
    """

    index: int
    name: str
    forward_var: float
    forward_predicted: float | None
    backward_var: float | None
    backward_predicted: float | None
    cosine: float
    cosine_predicted: float | None = None


@dataclass(frozen=True)
class Header:
    """Facts about what was measured.

    config: the tinylm ModelConfig as a dict (None for other modules).
    model_class: the model's class name. parameter_count: distinct parameters.
    init: the init scheme used for declared std and global theory ("" if none).
    tokens_measured: tokens passed through the model in all (over seeds and batches).
    batch_size, seq_len, batches, seeds: as run; seed: the first seed.
    theory: the theory mode used ("local", "global" or "none").
    loss: mean next-token loss measured; loss_uniform: ln(vocab_size) (None if unknown).
    """

    model_class: str
    config: dict[str, Any] | None
    parameter_count: int
    init: str
    tokens_measured: int
    batch_size: int
    seq_len: int
    batches: int
    seeds: int
    seed: int
    theory: str
    loss: float
    loss_uniform: float | None
    token_source: str


@dataclass
class DiagnoseResult:
    """Everything ``diagnose`` found; the report draws from it.

    ``healthy`` is True when ``findings`` is empty. ``thresholds`` holds the
    :class:`diagnostics.judge.verdicts.Thresholds` values used, as a dict.
    ``created`` is the only non-deterministic field (UTC ISO-8601 timestamp).
    """

    header: Header
    tensors: list[TensorRow]
    params: list[ParamRow]
    attention: list[AttentionRow]
    depth: list[DepthRow]
    findings: list[Finding]
    thresholds: dict[str, float]
    created: str = ""
    schema_version: str = field(default=SCHEMA_VERSION)

    @property
    def healthy(self) -> bool:
        return not self.findings

    def tensor(self, name: str, direction: str = "forward") -> TensorRow:
        """The row of tensor ``name`` in ``direction`` (KeyError naming the known names if absent)."""
        for row in self.tensors:
            if row.name == name and row.direction == direction:
                return row
        raise KeyError(f"no tensor {name!r} ({direction}); known: {', '.join(sorted({r.name for r in self.tensors}))}")

    def to_frame(self):
        """Tidy pandas DataFrame: one row per (tensor, direction, statistic).

        Columns: name, block, kind, direction, statistic, value, predicted, ratio,
        ratio_low, ratio_high, valid, verdict. ``predicted`` and the ratio columns are
        filled on the "var" rows only.
        """
        import pandas as pd

        stats = ("count", "mean", "var", "mean_square", "max_abs", "frac_zero", "frac_nonfinite",
                 "frac_fp16_underflow", "frac_fp16_overflow", "frac_bf16_underflow", "frac_bf16_overflow")
        records = []
        for r in self.tensors:
            for s in stats:
                is_var = s == "var"
                records.append({
                    "name": r.name, "block": r.block, "kind": r.kind, "direction": r.direction,
                    "statistic": s, "value": float(getattr(r, s)),
                    "predicted": r.predicted if is_var else None,
                    "ratio": r.ratio if is_var else None,
                    "ratio_low": r.ratio_low if is_var else None,
                    "ratio_high": r.ratio_high if is_var else None,
                    "valid": r.valid, "verdict": r.verdict,
                })
        return pd.DataFrame.from_records(records, columns=[
            "name", "block", "kind", "direction", "statistic", "value", "predicted", "ratio",
            "ratio_low", "ratio_high", "valid", "verdict"])

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema as a dict (see diagnostics/API.md)."""
        return _clean({
            "schema_version": self.schema_version,
            "created": self.created,
            "healthy": self.healthy,
            "header": asdict(self.header),
            "thresholds": dict(self.thresholds),
            "findings": [asdict(f) for f in self.findings],
            "tensors": [asdict(r) for r in self.tensors],
            "params": [asdict(r) for r in self.params],
            "attention": [asdict(r) for r in self.attention],
            "depth": [asdict(r) for r in self.depth],
        })

    def to_json(self, indent: int | None = 2) -> str:
        """The versioned JSON document (keys sorted; byte-identical for equal inputs but ``created``)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DiagnoseResult":
        """Rebuild from :meth:`to_dict` output (string "nan"/"inf" read back as floats)."""
        def num(v: Any) -> Any:
            if isinstance(v, str) and v in ("nan", "inf", "-inf"):
                return float(v)
            return v

        def build(kind, d):
            names = {f.name for f in fields(kind)}
            kw = {k: num(v) for k, v in d.items() if k in names}
            if "shape" in kw:
                kw["shape"] = tuple(kw["shape"])
            return kind(**kw)

        return cls(
            header=build(Header, data["header"]),
            tensors=[build(TensorRow, r) for r in data["tensors"]],
            params=[build(ParamRow, r) for r in data["params"]],
            attention=[build(AttentionRow, r) for r in data["attention"]],
            depth=[build(DepthRow, r) for r in data["depth"]],
            findings=[build(Finding, r) for r in data["findings"]],
            thresholds={k: num(v) for k, v in data["thresholds"].items()},
            created=data.get("created", ""),
            schema_version=data.get("schema_version", SCHEMA_VERSION),
        )
