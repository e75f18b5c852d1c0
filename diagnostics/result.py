"""The one result schema (tidy rows) and the result of a diagnosis.

Tidy rows. ``diagnose``, the training watch and ``compare`` all emit rows of one
schema, :data:`COLUMNS`, built by :class:`Row` and turned into a pandas DataFrame
by :func:`frame` (columns in that order, dtypes :data:`DTYPES`); every table, plot
and export in ``reports`` reads that frame or the job's object it came from. One row
is one number: the ``statistic`` of tensor ``name`` in ``direction`` at training
``step`` of ``run``. A column that does not apply to a row is None (NaN in a float
column, <NA> in a nullable integer or boolean one):

==========  =======  ============================================================
column      dtype    meaning
==========  =======  ============================================================
run         object   label of the run (a job's ``run=`` argument; None if unnamed)
step        Int64    training step (the watch; 0 for compare's fresh models)
seed        Int64    seed of the model's init (compare) or of the one seed measured
scheme      object   init scheme (tinylm.init name)
depth       Int64    num_layers of the model
width       Int64    d_model of the model
name        object   tensor (module output), parameter, or None for a whole-model number
kind        object   tensor kind (see :class:`TensorRow`), "parameter", or None
block       Int64    block index i of ``layers.i.*``
direction   object   "forward" (the tensor) or "backward" (the gradient of the loss)
statistic   object   which number: "var", "mean", "max_abs", "count", "loss", ...
value       float64  the number
predicted   float64  theory's prediction of ``value`` (variances only)
ratio       float64  value / predicted: geometric mean over replicates
ratio_low   float64  99% interval of ``ratio`` (Student-t on ln ratio)
ratio_high  float64
valid       boolean  whether ``predicted`` is inside its validity
verdict     object   "ok" or a VERDICT_KINDS entry for the (name, direction); None if not judged
==========  =======  ============================================================

The result of a diagnosis. Every figure the terminal report shows is a field of
:class:`DiagnoseResult`; ``reports`` computes nothing itself.
:meth:`DiagnoseResult.to_json` writes the versioned schema (``SCHEMA_VERSION``);
everything in it but the one timestamp ``created`` is a deterministic function of
the model, the tokens and the options.

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

The document's version is :data:`SCHEMA_VERSION` (written as ``schema_version``);
:meth:`DiagnoseResult.from_dict` reads versions "2" to "5". What each version changed is in
diagnostics/API.md ("Schema versions").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable

from .result_header import Header

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "DTYPES", "Row", "frame", "TENSOR_STATISTICS", "SCHEMA_VERSION", "VERDICT_KINDS",
           "SEVERITIES", "Finding", "TensorRow", "ParamRow", "AttentionRow", "DepthRow", "Header", "DiagnoseResult",
           "CHECKS", "STATUSES"]

SCHEMA_VERSION = "5"

#: The residual stream's per-block gains forward / backward, and the loss against ln V: a
#: diagnosis that judged neither of STREAM_FORWARD and LOSS is "not judged".
STREAM_FORWARD, STREAM_BACKWARD, LOSS = ("residual stream gains (forward)", "residual stream gains (backward)",
                                         "loss against ln V")

#: Every check a diagnosis makes where it can, in the order a report lists them (docs/verdicts.md).
CHECKS = (STREAM_FORWARD, STREAM_BACKWARD, LOSS, "non-finite values", "exactly-zero (dead) tensors",
          "block weight gradients", "attention (saturated rows)", "attention score scaling",
          "weights' scale (std^2 fan_in)", "weights against the declared init", "SiLU gates in the flat region",
          "residual branches", "post-norm gradient imbalance", "attention logits", "attention entropy",
          "output logits (log Z, largest logit)", "massive activations (peak / median)")

#: A diagnosis's status: no failing finding (with or without warnings), a failing finding, or
#: nothing that says whether the model trains was judged.
STATUSES = ("healthy", "healthy, with warnings", "not healthy", "not judged")

#: The verdict kinds, mildest first. "ok" is never a Finding. "misscaled" (scores or weights off
#: their rule) and "imbalanced" (gradients across a post-norm stack) name a cause's own evidence.
VERDICT_KINDS = ("ok", "imbalanced", "misscaled", "vanishing", "exploding", "dead", "saturated", "non_finite")

#: A finding's severity: "fail" (broken: will not train, or already diverged) or "warn" (trains, with care).
SEVERITIES = ("fail", "warn")


#: The tidy row's columns, in order (see the module docstring).
COLUMNS = ("run", "step", "seed", "scheme", "depth", "width", "name", "kind", "block", "direction", "statistic",
           "value", "predicted", "ratio", "ratio_low", "ratio_high", "valid", "verdict")

#: The frame's dtype of each column: nullable integers and booleans, so a missing entry stays missing.
DTYPES = {"run": "object", "step": "Int64", "seed": "Int64", "scheme": "object", "depth": "Int64",
          "width": "Int64", "name": "object", "kind": "object", "block": "Int64", "direction": "object",
          "statistic": "object", "value": "float64", "predicted": "float64", "ratio": "float64",
          "ratio_low": "float64", "ratio_high": "float64", "valid": "boolean", "verdict": "object"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One tidy row: the ``statistic`` of ``name`` (in ``direction``) equals ``value``.

    ``statistic`` and ``value`` are required; every other column defaults to None
    (does not apply). See the module docstring for each column.
    """

    run: str | None = None
    step: int | None = None
    seed: int | None = None
    scheme: str | None = None
    depth: int | None = None
    width: int | None = None
    name: str | None = None
    kind: str | None = None
    block: int | None = None
    direction: str | None = None
    statistic: str
    value: float
    predicted: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    valid: bool | None = None
    verdict: str | None = None

    def __post_init__(self) -> None:
        if self.direction not in (None, "forward", "backward"):
            raise ValueError(f"direction={self.direction!r}: must be 'forward', 'backward' or None")

    def astuple(self) -> tuple:
        """The values in :data:`COLUMNS` order."""
        return tuple(getattr(self, c) for c in COLUMNS)


def frame(rows: Iterable[Row | dict[str, Any]] = ()) -> "pd.DataFrame":
    """The tidy pandas DataFrame of ``rows``: columns :data:`COLUMNS` in order, dtypes :data:`DTYPES`.

    A row is a :class:`Row`, or a dict of some of the columns (the others None; an
    unknown key raises ValueError naming it). No rows give an empty frame with the
    same columns and dtypes, so frames of several runs concatenate.
    """
    import pandas as pd

    records = []
    for r in rows:
        if isinstance(r, dict):
            unknown = set(r) - set(COLUMNS)
            if unknown:
                raise ValueError(f"row keys {sorted(unknown)}: not columns of the schema; use {', '.join(COLUMNS)}")
            records.append(tuple(r.get(c) for c in COLUMNS))
        else:
            records.append(r.astuple())
    df = pd.DataFrame.from_records(records, columns=list(COLUMNS))
    return df.astype(DTYPES)


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

    kind: one of "vanishing", "exploding", "dead", "saturated", "non_finite", "misscaled",
    "imbalanced" (the gravest symptom the cause explains, or its own evidence).
    where: the tensor or parameter name it concerns ("model" for whole-model findings).
    value: the number that triggered it; threshold: the threshold it crossed
    (``value`` > ``threshold`` or < it, as ``message`` says).
    statistic: which number ``value`` is (e.g. "per-block forward variance gain").
    direction: "forward", "backward" or None; block: the first block concerned, or None.
    message: one sentence naming the number and the threshold (and the readings it explains).
    suggestion: the fix for ``cause``, worded for the model's build.
    severity: "fail" (broken: will not train, or already diverged) or "warn" (trains, with
    care). cause: what the evidence supports (a key of diagnostics.judge.causes.CAUSES:
    "non_finite", "score_scale", "saturated_attention", "dead_units", "init_scale", "no_norm",
    "post_norm_depth", "logit_scale", "attn_logits", "attn_entropy", "output_logits",
    "massive_activations", or "unclear" where the evidence does not single one out; "" in
    documents written before causes existed).
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
    severity: str = "fail"
    cause: str = ""


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
        :func:`diagnostics.log_t_interval`.
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


#: The statistics of a tensor that :meth:`DiagnoseResult.rows` writes, one row each.
TENSOR_STATISTICS = ("count", "mean", "var", "mean_square", "max_abs", "frac_zero", "frac_nonfinite",
                     "frac_fp16_underflow", "frac_fp16_overflow", "frac_bf16_underflow", "frac_bf16_overflow")

#: The prediction notes of a tensor written beside the rows in the JSON (schema "3").
_THEORY_NOTES = ("name", "direction", "theory", "rule", "validity", "predicted_independent")


@dataclass(frozen=True)
class ParamRow:
    """One parameter (tied parameters once).

    std, grad_std: of the entries and of their gradient (grad_std None when no grad).
    declared_std: the std its init scheme declares (truncation corrected; None when
    the model has no scheme); drift = std / declared_std (None when undefined, e.g.
    a constant-declared gain). spectral_norm, stable_rank (= ||W||_F^2 / ||W||_2^2):
    for 2-D parameters, else None. frac_nonfinite: of the entries. note: what could not be
    measured and why (e.g. the spectra of a sharded parameter), "" when everything was.
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
    note: str = ""


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
    (0 for independent tokens; towards 1 as tokens collapse onto one direction); None where it
    was not measured (a model that is not tinylm, read through its block outputs).
    cosine_predicted: the token-kernel theory's prediction of ``cosine`` (global mode on a
    tinylm model; None otherwise).
    """

    index: int
    name: str
    forward_var: float
    forward_predicted: float | None
    backward_var: float | None
    backward_predicted: float | None
    cosine: float | None
    cosine_predicted: float | None = None


@dataclass
class DiagnoseResult:
    """Everything ``diagnose`` found; the report draws from it.

    ``healthy`` is True when no finding has severity "fail" (``warnings`` lists the ones that
    warn: the model trains, with care) and something that says whether the model trains was
    judged (:attr:`status`); ``failures`` lists the failing ones. ``judged``: the
    :data:`CHECKS` made (None in a document before version "5"); ``not_judged``: (check, why)
    for each one that could not be. ``thresholds`` holds the
    :class:`diagnostics.judge.Thresholds` values used, as a dict.
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
    judged: list[str] | None = None
    not_judged: list[tuple[str, str]] = field(default_factory=list)

    @property
    def status(self) -> str:
        """One of :data:`STATUSES`: "not healthy" with a failing finding; else "not judged" when
        neither the residual stream nor the loss was judged (``judged`` recorded, i.e. a
        document of version "5"); else "healthy, with warnings" or "healthy"."""
        if self.failures:
            return "not healthy"
        if self.judged is not None and not {STREAM_FORWARD, LOSS} & set(self.judged):
            return "not judged"
        return "healthy, with warnings" if self.warnings else "healthy"

    @property
    def healthy(self) -> bool:
        """No failing finding, and the stream or the loss judged (see :attr:`status`)."""
        return self.status in ("healthy", "healthy, with warnings")

    @property
    def failures(self) -> list[Finding]:
        """The findings of severity "fail"."""
        return [f for f in self.findings if f.severity != "warn"]

    @property
    def warnings(self) -> list[Finding]:
        """The findings of severity "warn"."""
        return [f for f in self.findings if f.severity == "warn"]

    def tensor(self, name: str, direction: str = "forward") -> TensorRow:
        """The row of tensor ``name`` in ``direction`` (KeyError naming the known names if absent)."""
        for row in self.tensors:
            if row.name == name and row.direction == direction:
                return row
        raise KeyError(f"no tensor {name!r} ({direction}); known: {', '.join(sorted({r.name for r in self.tensors}))}")

    def rows(self, run: str | None = None) -> list[Row]:
        """The tidy rows (:class:`Row`): one per (tensor, direction, statistic) in :data:`TENSOR_STATISTICS`.

        run, step: ``run`` and None (a diagnosis is of one moment, not a training step);
        seed: the header's seed when one seed was measured, None when the rows pool several;
        scheme, depth, width: the init scheme, num_layers and d_model (None for a model
        without a tinylm config). predicted, ratio, ratio_low, ratio_high and valid are
        filled on the "var" rows of a tensor with a prediction only; verdict is the
        tensor's (name, direction) verdict on each of its rows.
        """
        h = self.header
        cfg = h.config or {}
        common = dict(run=run, seed=h.seed if h.seeds == 1 else None, scheme=h.init or None,
                      depth=cfg.get("num_layers"), width=cfg.get("d_model"))
        out = []
        for r in self.tensors:
            predicted = r.predicted is not None
            for s in TENSOR_STATISTICS:
                var = s == "var"
                out.append(Row(**common, name=r.name, kind=r.kind, block=r.block, direction=r.direction,
                               statistic=s, value=float(getattr(r, s)),
                               predicted=r.predicted if var else None, ratio=r.ratio if var else None,
                               ratio_low=r.ratio_low if var else None, ratio_high=r.ratio_high if var else None,
                               valid=r.valid if var and predicted else None, verdict=r.verdict))
        return out

    def to_frame(self, run: str | None = None):
        """The tidy pandas DataFrame of :meth:`rows`: columns :data:`COLUMNS`, dtypes :data:`DTYPES`."""
        return frame(self.rows(run))

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema as a dict (see diagnostics/API.md), always of the current ``SCHEMA_VERSION``."""
        return _clean({
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "healthy": self.healthy,
            "status": self.status,
            "judged": list(self.judged) if self.judged is not None else None,
            "not_judged": [[c, why] for c, why in self.not_judged],
            "header": asdict(self.header),
            "thresholds": dict(self.thresholds),
            "findings": [asdict(f) for f in self.findings],
            "columns": list(COLUMNS),
            "rows": [list(r.astuple()) for r in self.rows()],
            "theory": [{k: getattr(r, k) for k in _THEORY_NOTES} for r in self.tensors if r.predicted is not None],
            "params": [asdict(r) for r in self.params],
            "attention": [asdict(r) for r in self.attention],
            "depth": [asdict(r) for r in self.depth],
        })

    def to_json(self, indent: int | None = 2) -> str:
        """The versioned JSON document (keys sorted; byte-identical for equal inputs but ``created``).

        With ``indent``, each tidy row is written on one line (as a CSV file would hold it)."""
        doc = self.to_dict()
        if indent is None:
            return json.dumps(doc, sort_keys=True, allow_nan=False)
        rows = doc.pop("rows")
        mark = "\x00rows\x00"  # a placeholder no name can hold
        text = json.dumps({**doc, "rows": mark}, indent=indent, sort_keys=True, allow_nan=False)
        pad = " " * (2 * indent)
        body = ",\n".join(pad + json.dumps(r, allow_nan=False) for r in rows)
        listing = "[\n" + body + "\n" + " " * indent + "]" if rows else "[]"
        return text.replace(json.dumps(mark), listing, 1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DiagnoseResult":
        """Rebuild from :meth:`to_dict` output of schema version "5", "4", "3" or "2" (string "nan"/"inf"
        read back as floats). Version "2" documents carry a "tensors" list, versions "3" and "4" tidy
        "rows" and "theory" notes; either gives the same :class:`TensorRow` list. Findings before "4"
        have no severity or cause: they read as "fail" and "". The rebuilt result keeps
        the version it was read from in ``schema_version``."""
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

        version = str(data.get("schema_version", "2"))
        if version not in ("2", "3", "4", "5"):
            raise ValueError(f"schema_version={version!r}: this reader knows versions '2' to '5'; "
                             "write the document with a matching tinylm")
        if version == "2":
            tensors = [build(TensorRow, r) for r in data["tensors"]]
        else:
            columns = data.get("columns", list(COLUMNS))
            tensors = _tensors_from_rows([{k: num(v) for k, v in zip(columns, r)} for r in data["rows"]],
                                         [{k: num(v) for k, v in t.items()} for t in data.get("theory", [])])
        return cls(
            header=build(Header, data["header"]),
            tensors=tensors,
            params=[build(ParamRow, r) for r in data["params"]],
            attention=[build(AttentionRow, r) for r in data["attention"]],
            depth=[build(DepthRow, r) for r in data["depth"]],
            findings=[build(Finding, r) for r in data["findings"]],
            thresholds={k: num(v) for k, v in data["thresholds"].items()},
            created=data.get("created", ""),
            schema_version=version,
            judged=list(data["judged"]) if version == "5" and data.get("judged") is not None else None,
            not_judged=[(str(c), str(why)) for c, why in data.get("not_judged", [])] if version == "5" else [],
        )

    def __repr__(self) -> str:
        """Short: class, status and counts (``str`` is the report)."""
        from .display import summary

        return summary(self)

    def __str__(self) -> str:
        """The report as the command prints it (:func:`diagnostics.display.text`), else a short summary."""
        from .display import text

        return text(self)

    def _repr_html_(self) -> str:
        """The diagnosis drawn in a notebook (see :mod:`diagnostics.display`)."""
        from .display import html

        return html(self)


def _tensors_from_rows(rows: list[dict[str, Any]], notes: list[dict[str, Any]]) -> list[TensorRow]:
    """The :class:`TensorRow` list that :meth:`DiagnoseResult.rows` and the "theory" notes came from
    (rows grouped by (name, direction) in their order)."""
    grouped: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["name"], r["direction"]), {})[r["statistic"]] = r
    by_key = {(n["name"], n["direction"]): n for n in notes}
    out = []
    for (name, direction), stats in grouped.items():
        var = stats["var"]
        note = by_key.get((name, direction), {})
        values = {s: stats[s]["value"] for s in TENSOR_STATISTICS}
        values["count"] = int(values["count"])
        out.append(TensorRow(
            name=name, block=var["block"], kind=var["kind"], direction=direction, **values,
            predicted=var["predicted"], ratio=var["ratio"], ratio_low=var["ratio_low"], ratio_high=var["ratio_high"],
            theory=note.get("theory", ""), valid=True if var["valid"] is None else bool(var["valid"]),
            validity=note.get("validity", ""), verdict=var["verdict"], rule=note.get("rule", ""),
            predicted_independent=note.get("predicted_independent")))
    return out
