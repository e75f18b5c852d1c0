"""Verdicts on a GEMM cast to a low-precision recipe: ok / warn / fail, with a cause and a fix.

A GEMM is judged on the lower of its output's SQNR and its typical row's (the median over tokens):
a massive activation at one token dominates the output's power, so the output's SQNR stays high
while every other token loses its precision. The yardstick is what the format's mantissa alone allows for the GEMM's own operands
(``ideal_sqnr_db``, diagnostics.theory.quant): a recipe that loses little to it is as good as its
element format can be; what it loses beyond is range — scaling that sends entries to zero, into the
subnormals, or to saturation. A GEMM is

    fail   when it loses >= ``fail_loss_db`` to the ideal, or its SQNR is below ``floor_db``,
           or its output is not finite;
    warn   when it loses >= ``warn_loss_db``;
    ok     otherwise; "not measured" when it was not (never ok).

The cause names the operand that brings most of the error and what about it does (one entry far
above its median: a massive activation; one channel above the rest: an outlier feature; entries
that flush to zero: a range wider than one scale holds), and the module's role where it matters (the
output head, the SwiGLU product into the down projection, a router). The fix: a finer scaling
(rowwise or MXFP8) where the recipe is tensorwise, Smooth-SwiGLU for the SwiGLU product, else keep
the module in bf16.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

__all__ = ["PrecisionThresholds", "judge_gemm", "module_role", "worst_operand", "VERDICTS"]

VERDICTS = ("ok", "warn", "fail", "not measured")

_SWIGLU_PRODUCT = re.compile(r"(^|\.)(w2|down_proj)$")
_ROUTER = re.compile(r"(^|\.)(router|gate|moe_gate|wg)$")


@dataclass(frozen=True)
class PrecisionThresholds:
    """dB lost to the mantissa-only ideal that make a warn / a fail, and an absolute floor (a fail)."""

    warn_loss_db: float = 3.0
    fail_loss_db: float = 6.0
    floor_db: float = 10.0

    def to_dict(self) -> dict:
        return asdict(self)


def module_role(name: str, is_head: bool) -> str:
    """"head", "swiglu_product" (the product of SwiGLU's two branches entering the down projection),
    "router" or "linear", from what the module does (the head) and its name."""
    if is_head:
        return "head"
    if _SWIGLU_PRODUCT.search(name):
        return "swiglu_product"
    if _ROUTER.search(name):
        return "router"
    return "linear"


def worst_operand(operands: dict[str, dict]) -> dict:
    """The operand that brings most of a GEMM's error: one that loses >= 1% of its non-zero entries to
    range (flushed to zero or saturated) before one that does not, then the larger relative error of
    its typical row, then of the whole. Range first: an operand's relative error is taken against its
    own power, which an outlier feature dominates, so the operand whose other channels all flush can
    show the smaller relative error."""
    def key(o: dict):
        return (o.get("underflow", 0.0) + o.get("overflow", 0.0) >= 0.01, o.get("typical_relative_noise", 0.0),
                o.get("relative_noise", 0.0))
    return max(operands.values(), key=key)


def _operand_cause(op: dict, fmt: str, granularity: str) -> str:
    """Why one operand loses precision, from its descriptors (diagnostics.theory.quant.describe_operand)."""
    p2m, ch, under = op.get("peak_to_median", math.nan), op.get("channel_ratio", math.nan), op.get("underflow", 0.0)
    parts = []
    if p2m >= 1e3:
        parts.append(f"its peak is {p2m:.1e}x its median (a massive activation)" if op["name"] == "input"
                     else f"its peak is {p2m:.1e}x its median")
    if ch >= 20 and op.get("peak_share", 1.0) < 0.5 and op["name"] in ("input", "grad_output"):
        parts.append(f"channel {op.get('top_channel')} carries {ch:.0f}x the median channel's RMS (an outlier feature)")
    if under >= 0.01:
        parts.append(f"{under:.0%} of its non-zero entries flush to zero in {fmt}")
    if op.get("overflow", 0.0) >= 1e-3:
        parts.append(f"{op['overflow']:.2g} of its entries saturate")
    what = "; ".join(parts) or f"its values span more of {fmt}'s range than one scale {granularity} holds"
    return f"{op['name']}: {what}"


def _fix(recipe: str, role: str) -> str:
    keep = "keep it in bf16"
    if role == "swiglu_product":
        return ("Smooth-SwiGLU (a per-channel scale on the product before the down projection), "
                + ("rowwise or MXFP8, or " if recipe == "tensorwise" else "or ") + keep)
    if recipe == "tensorwise":
        return f"rowwise or MXFP8 (a scale per row or per 32 entries), or {keep}"
    if recipe == "rowwise":
        return f"MXFP8 (a scale per 32 entries), or {keep}"
    return keep


def judge_gemm(row: dict, operands: dict[str, dict], thresholds: PrecisionThresholds) -> tuple[str, str, str]:
    """(verdict, cause, fix) of one GEMM and recipe, judged on the lower of the output's SQNR and its
    typical row's (``row_sqnr_db``). ``row`` holds sqnr_db, row_sqnr_db, ideal_sqnr_db, recipe, gemm,
    module, role, format and granularity of the worst operand; ``operands`` each operand's descriptors
    (name, peak_to_median, channel_ratio, top_channel, peak_share, underflow, overflow, relative_noise,
    typical_relative_noise: the operand :func:`worst_operand` picks is named)."""
    sqnr, ideal = min(row["sqnr_db"], row.get("row_sqnr_db", math.inf)), row["ideal_sqnr_db"]
    if sqnr is None or (isinstance(sqnr, float) and math.isnan(sqnr)):
        return "not measured", row.get("cause") or "not measured", ""
    known = ideal is not None and math.isfinite(ideal)  # not when theory was not asked for
    if not known:
        ideal = sqnr
    loss = ideal - sqnr if math.isfinite(sqnr) else math.inf
    if sqnr == -math.inf or loss >= thresholds.fail_loss_db or sqnr < thresholds.floor_db:
        verdict = "fail"
    elif loss >= thresholds.warn_loss_db:
        verdict = "warn"
    else:
        return "ok", (f"within {max(loss, 0.0):.1f} dB of what the mantissa allows" if known
                      else f"{sqnr:.1f} dB (what the mantissa allows not computed: theory off)"), ""
    worst = worst_operand(operands)
    role = row.get("role", "linear")
    where = {"head": " (the output head)", "router": " (a router)",
             "swiglu_product": " (the SwiGLU product into the down projection)"}.get(role, "")
    lost = f"loses {loss:.1f} dB" if known else f"measures {sqnr:.1f} dB"
    cause = (f"{row['recipe']} {lost} at {row['module']}{where} ({row['gemm']}): "
             + _operand_cause(worst, worst.get("format", "fp8"), worst.get("granularity", "")))
    return verdict, cause, _fix(row["recipe"], role)
