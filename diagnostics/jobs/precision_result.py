"""The result of :func:`diagnostics.precision`: per linear layer, GEMM and recipe, measured SQNR,
theory beside it, and the verdict; which modules to keep in bf16 per recipe, as a list and as a
``module_filter_fn`` for torchao."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

__all__ = ["PrecisionRow", "PrecisionResult", "PRECISION_COLUMNS", "PRECISION_SCHEMA_VERSION"]

PRECISION_SCHEMA_VERSION = "2"


@dataclass
class PrecisionRow:
    """One module, GEMM (fprop / dgrad / wgrad) and recipe.

    ``sqnr_db`` 10 log10(||ref||^2 / ||ref - quantized||^2) of the GEMM's output; ``row_sqnr_db`` the
    median over the output's rows (tokens; output features for wgrad) of each row's SQNR: what a
    typical row gets where a few rows of large power dominate ``sqnr_db``; ``predicted_sqnr_db``
    theory's (``valid`` False with ``why_invalid`` where its premise fails); ``ideal_sqnr_db`` what the
    element formats' mantissas alone allow; ``underflow`` / ``overflow`` the shares of the two
    operands' non-zero entries that became 0 / saturated; ``scale_min_log2`` / ``scale_max_log2`` the
    range of the scales applied; ``worst_operand`` the operand that brings most of the error
    (diagnostics.judge.precision.worst_operand) and its ``peak_to_median`` and ``channel_ratio``;
    ``role`` head / swiglu_product / router / linear; ``block`` its block (None outside), ``depth``
    its order among the measured modules; ``predicted_loss`` the training-loss increase predicted for
    casting this GEMM alone (diagnostics.theory.loss_cost: fprop the Fisher term of its output's
    error, dgrad / wgrad the share of their gradient's descent lost times what it trains)."""

    module: str
    gemm: str
    recipe: str
    sqnr_db: float
    row_sqnr_db: float
    predicted_sqnr_db: float
    ideal_sqnr_db: float
    valid: bool
    why_invalid: str
    underflow: float
    overflow: float
    scale_min_log2: float
    scale_max_log2: float
    worst_operand: str
    peak_to_median: float
    channel_ratio: float
    role: str
    block: int | None
    depth: int
    m: int
    n: int
    k: int
    verdict: str
    cause: str
    fix: str
    predicted_loss: float = math.nan

    @property
    def loss_db(self) -> float:
        """dB lost to the mantissa-only ideal, by the output or by its typical row (the larger loss)."""
        return self.ideal_sqnr_db - min(self.sqnr_db, self.row_sqnr_db)


PRECISION_COLUMNS = tuple(f.name for f in fields(PrecisionRow))
_RANK = {"fail": 0, "warn": 1, "not measured": 2, "ok": 3}


def _num(v):
    return v if not isinstance(v, float) or math.isfinite(v) else str(v)


@dataclass
class PrecisionResult:
    """``rows`` (one per module, GEMM and recipe, in forward order), ``recipes`` their names,
    ``skipped`` (module, why) not measured, ``meta`` the pass (model, tokens, loss, thresholds)."""

    rows: list[PrecisionRow]
    recipes: tuple[str, ...]
    skipped: list[tuple[str, str]]
    meta: dict
    schema_version: str = field(default=PRECISION_SCHEMA_VERSION)

    @property
    def modules(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.setdefault(r.module, None)
        return list(seen)

    def worst(self, recipe: str | None = None, n: int | None = None) -> list[PrecisionRow]:
        """Rows by verdict (fail first), then by dB lost; of one recipe if given."""
        rows = [r for r in self.rows if recipe is None or r.recipe == recipe]
        rows.sort(key=lambda r: (_RANK[r.verdict], -r.loss_db if math.isfinite(r.loss_db) else -math.inf))
        return rows[:n] if n is not None else rows

    def keep_in_bf16(self, recipe: str) -> list[str]:
        """The modules with a GEMM that fails in ``recipe``: the ones to keep in high precision."""
        return [m for m in self.modules if any(r.module == m and r.recipe == recipe and r.verdict == "fail"
                                               for r in self.rows)]

    def harm(self, recipe: str, by: str = "noise") -> dict[str, float]:
        """Per module, a ranking of what converting it in ``recipe`` costs.

        ``by="loss"``: the predicted training-loss increase, the sum of its three GEMMs'
        ``predicted_loss`` (diagnostics.theory.loss_cost). ``by="noise"`` (the default): the noise
        power its three GEMMs inject, each relative to its own output's power: the sum of
        10^(-SQNR/10) over fprop, dgrad and wgrad, each GEMM's SQNR the lower of the output's and its
        typical row's (inf where an output is not finite); absolute, not against the format's ideal,
        so a recipe's uniform cost (E5M2 gradients) counts too."""
        if by not in ("noise", "loss"):
            raise ValueError(f"by={by!r}: must be 'noise' or 'loss'; pass by='loss' for the predicted loss increase")
        out: dict[str, float] = {}
        for r in self.rows:
            if r.recipe != recipe:
                continue
            if by == "loss":
                out[r.module] = out.get(r.module, 0.0) + r.predicted_loss
                continue
            db = min(r.sqnr_db, r.row_sqnr_db) if math.isfinite(r.row_sqnr_db) else r.sqnr_db
            out[r.module] = out.get(r.module, 0.0) + (10.0 ** (-db / 10) if not math.isnan(db) else 0.0)
        return out

    def module_filter_fn(self, recipe: str) -> Callable[[object, str], bool]:
        """For torchao's ``convert_to_float8_training(model, module_filter_fn=...)`` (and quantize_):
        True for a measured module that may be converted in ``recipe`` (it has no failing GEMM)."""
        keep = set(self.keep_in_bf16(recipe))
        measured = set(self.modules)

        def convert(module, fqn: str) -> bool:
            return fqn in measured and fqn not in keep

        return convert

    @property
    def ok(self) -> bool:
        """No GEMM fails in any recipe (and something was measured)."""
        return bool(self.rows) and all(r.verdict != "fail" for r in self.rows)

    def to_frame(self):
        """Tidy rows (columns :data:`PRECISION_COLUMNS`)."""
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.rows], columns=list(PRECISION_COLUMNS))

    def to_dict(self) -> dict:
        return {"schema_version": self.schema_version, "summary": str(self), "recipes": list(self.recipes),
                "columns": list(PRECISION_COLUMNS),
                "rows": [[_num(getattr(r, c)) for c in PRECISION_COLUMNS] for r in self.rows],
                "keep_in_bf16": {rc: self.keep_in_bf16(rc) for rc in self.recipes},
                "skipped": [list(s) for s in self.skipped], "meta": self.meta}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def _line(self, recipe: str) -> str:
        rows = [r for r in self.rows if r.recipe == recipe]
        fails = {r.module for r in rows if r.verdict == "fail"}
        warns = {r.module for r in rows if r.verdict == "warn"} - fails
        worst = min((r for r in rows if math.isfinite(r.sqnr_db)), key=lambda r: r.sqnr_db, default=None)
        low = f"; lowest {worst.sqnr_db:.1f} dB at {worst.module} ({worst.gemm})" if worst else ""
        if fails:
            names = sorted(fails, key=self.modules.index)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            return f"{recipe}: keep {len(fails)} of {len(self.modules)} in bf16 ({shown}){low}"
        tail = f", {len(warns)} warned" if warns else ""
        return f"{recipe}: all {len(self.modules)} linear layers ok{tail}{low}"

    def __str__(self) -> str:
        if not self.rows:
            return "nothing measured: no linear layer found" + (f" ({len(self.skipped)} skipped)" if self.skipped else "")
        lines = [self._line(rc) for rc in self.recipes]
        first = next((r for r in self.worst() if r.verdict == "fail"), None)
        if first is not None:
            lines.append(f"worst: {first.cause} -> {first.fix}")
        if self.skipped:
            lines.append(f"{len(self.skipped)} module(s) not measured: " +
                         "; ".join(f"{m} ({why})" for m, why in self.skipped[:3]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PrecisionResult({self._line(self.recipes[0]) if self.rows else 'empty'})"
