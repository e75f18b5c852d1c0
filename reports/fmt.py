"""Number formatting for narrow terminal columns: short, aligned, and honest about NaN and missing values."""

from __future__ import annotations

import io
import math
import re
from typing import Any, Callable, Iterable

__all__ = ["num", "ratio_interval", "pct", "VERDICT_STYLE", "verdict_text", "natural_width", "first_that_fits",
           "short_name"]

#: colour of each verdict kind (the word itself is always printed too).
VERDICT_STYLE = {
    "ok": "green",
    "vanishing": "yellow",
    "exploding": "bold red",
    "dead": "red",
    "saturated": "magenta",
    "non_finite": "bold white on red",
}


def num(value: float | int | None, digits: int = 3) -> str:
    """A compact number: ``0.0312``, ``12.3``, ``1.23e-7``, ``4.5e+12``; ``-`` for None; ``nan``/``inf`` as such."""
    if value is None:
        return "-"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    a = abs(v)
    if 1e-2 <= a < 1e4:
        decimals = max(0, digits - 1 - math.floor(math.log10(a)))
        return f"{v:.{decimals}f}"
    mant, exp = f"{v:.{digits - 1}e}".split("e")
    return f"{mant}e{int(exp)}"


def ratio_interval(ratio: float | None, low: float | None, high: float | None, digits: int = 3,
                   sep: str = ", ") -> str:
    """``1.02 [0.97, 1.08]`` (the 99% replicate interval), or just the ratio when there is no interval."""
    if ratio is None:
        return "-"

    def r(v: float) -> str:  # ratios near 1 always with two decimals, so a column lines up: 0.98, 1.00, 2.90
        return f"{v:.2f}" if isinstance(v, (int, float)) and 0.095 <= abs(v) < 9.995 else num(v, digits)

    if low is None or high is None:
        return r(ratio)
    return f"{r(ratio)} [{r(low)}{sep}{r(high)}]"


def pct(fraction: float | None) -> str:
    """A fraction as a percentage: ``0.3%``, ``12%``; ``-`` for None."""
    if fraction is None:
        return "-"
    f = float(fraction)
    if math.isnan(f):
        return "nan"
    p = 100.0 * f
    if p == 0:
        return "0%"
    if p < 0.1:
        return "<0.1%"
    return f"{p:.1f}%" if p < 10 else f"{p:.0f}%"


def verdict_text(kind: str) -> str:
    """The verdict as words (non_finite -> "non-finite")."""
    return kind.replace("_", "-")


def natural_width(renderable: Any) -> int:
    """The columns ``renderable`` takes when nothing limits it (a table's widest row, unwrapped)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000, file=io.StringIO(), color_system=None)
    return Measurement.get(console, console.options, renderable).maximum


def first_that_fits(layouts: Iterable[Callable[[], Any]], width: int) -> Any:
    """The first of ``layouts`` (each a function that builds a table, the fullest first) whose
    natural width fits ``width`` columns, else the last one.

    The one mechanism behind every table that adapts to the terminal: less important columns
    are dropped or abbreviated, one layout at a time, so that no number is ever cut short
    (rich would otherwise shrink a too-wide table's cells to ``5.7e…``).
    """
    table = None
    for build in layouts:
        table = build()
        if natural_width(table) <= width:
            return table
    return table


def short_name(name: str) -> str:
    """A tensor name for a narrow column: ``layers.3.attn.scores`` -> ``L3.attn.scores``,
    ``token_embeddings`` -> ``tok_emb`` (nothing else changes)."""
    name = re.sub(r"^layers\.(\d+)", r"L\1", name)
    return "tok_emb" + name[len("token_embeddings"):] if name.startswith("token_embeddings") else name


def verdict_words(result) -> str:
    """A diagnosis in a few words for a title: "healthy", "not judged" (nothing could be judged), or
    "N finding(s): kind, kind" (the findings' kinds, sorted)."""
    if result.status == "not judged":
        return "not judged"
    if not result.findings:
        return "healthy"
    return f"{len(result.findings)} finding(s): " + ", ".join(sorted({f.kind.replace("_", "-") for f in result.findings}))
