"""The ``tinylm compare`` table: one row per init scheme, depth (and width), from ``diagnostics.compare``'s summary."""

from __future__ import annotations

import math
from typing import Any, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from .fmt import VERDICT_STYLE, first_that_fits, num, verdict_text

__all__ = ["CompareTable", "compare_table"]


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _signed(v: float, decimals: int) -> str:
    s = f"{v:+.{decimals}f}" if abs(v) < 100 else f"{v:+.3g}"
    return s.replace("-", "+") if float(s) == 0 else s  # no "-0.000"


def _slope(v: Any, lo: Any, hi: Any, compact: bool = False, half_width: bool = False) -> str:
    """A per-block slope of ln Var with its 99% interval over seeds: ``+0.120 [+0.10, +0.14]``;
    ``half_width`` (a narrow table with a loss@N column) writes a symmetric interval as ``+0.12±0.02``."""
    if _missing(v):
        return "-"
    s = _signed(v, 2 if compact else 3)
    if _missing(lo) or _missing(hi):
        return s
    if half_width and math.isclose(hi - v, v - lo, rel_tol=1e-6, abs_tol=1e-12):
        return f"{s}±{(hi - lo) / 2:.2f}"
    sep = "," if compact else ", "
    return f"{s} [{_signed(lo, 2)}{sep}{_signed(hi, 2)}]"


LAYOUTS = ("wide", "compact", "half-width")


#: what a narrow comparison leaves out, one step at a time, once every layout is too wide
DROP_ORDER = ("interval", "max/min", "loss@N")


class CompareTable:
    """A renderable that lays out :func:`compare_table` for the console's width: the first of
    ``LAYOUTS`` whose natural width fits, starting from "wide" at 100 columns or more, else from
    "compact"; when none fits, the intervals, max/min and the loss after training are left out
    one at a time (never a number cut short)."""

    def __init__(self, summary: Any) -> None:
        self.summary = summary

    def layouts(self, width: int) -> list[Any]:
        tries = [lambda layout=layout: compare_table(self.summary, width, layout)
                 for layout in LAYOUTS[0 if width >= 100 else 1:]]
        drops = [DROP_ORDER[:k] for k in range(1, len(DROP_ORDER) + 1)]
        return tries + [lambda d=d: compare_table(self.summary, width, "compact", drop=d) for d in drops]

    def __rich_console__(self, console: Any, options: Any):
        yield first_that_fits(self.layouts(options.max_width), options.max_width)


def _has_steps(summary: Any) -> bool:
    return bool(len(summary)) and bool(summary["early_loss"].notna().any())


def _layout(summary: Any, width: int) -> str:
    return "wide" if width >= 100 else ("half-width" if _has_steps(summary) else "compact")


def compare_table(summary: Any, width: int = 120, layout: str | None = None, drop: Sequence[str] = ()) -> Table:
    """The comparison as a rich Table: scheme, L, d, loss at init vs ln V, forward and backward
    ln-variance slope per block with the 99% interval over seeds, max/min stream variance, verdict
    (and the loss after ``steps`` training steps when there are any). The title's second line
    names the tokens (the summary's ``data`` column) and the vocabulary.

    ``layout``: "wide"; "compact" (slopes with two decimals, gaps of one space); "half-width"
    (compact, and the symmetric 99% intervals written as ``+0.12±0.02``). None picks by
    ``width``: wide from 100 columns, below that compact, or half-width when there is a loss@N
    column, so that the table fits 80 columns. ``drop`` (any of ``DROP_ORDER``) leaves out the
    slopes' intervals, the max/min column or the loss after training, for narrower terminals.
    """
    layout = _layout(summary, width) if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    compact, half_width = layout != "wide", layout == "half-width"
    multi_width = summary["width"].nunique() > 1 if len(summary) else False
    has_steps = _has_steps(summary) and "loss@N" not in drop
    show_interval, show_ratio = "interval" not in drop, "max/min" not in drop
    ln_v = float(summary["ln_vocab"].iloc[0]) if len(summary) else float("nan")
    seeds = int(summary["seeds"].iloc[0]) if len(summary) else 0
    caption = (f"loss at init against ln V = {ln_v:.3f} (a uniform guess); slope: per-block change of ln Var of the "
               "residual stream, forward and (gradient) backward, "
               + (f"± half-width of its 99% interval over {seeds} seeds" if half_width
                  else f"[99% interval over {seeds} seeds]" if show_interval else f"mean over {seeds} seeds")
               + ("; max/min: largest over smallest stream variance across depth" if show_ratio else ""))
    left_out = [c for c in drop if c != "loss@N" or _has_steps(summary)]
    if left_out:
        caption += f"; left out at this width: {', '.join(left_out)} (see --width or --csv)"
    title = Text("Init schemes side by side", style="bold")
    if len(summary) and "data" in summary:
        vocab = summary["vocab_size"].iloc[0] if "vocab_size" in summary else None
        title.append(f"\ntokens: {summary['data'].iloc[0]}" + (f"; vocabulary {int(vocab):,}" if vocab else ""),
                     style="not bold")
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 0 if compact else 1, 0, 0), pad_edge=False, show_edge=False,
              title=title, title_justify="left", title_style="bold",
              caption=caption, caption_justify="left", caption_style="dim")
    t.add_column("scheme", overflow="fold")
    t.add_column("L", justify="right", no_wrap=True)
    if multi_width:
        t.add_column("d", justify="right", no_wrap=True)
    t.add_column("loss" if compact else "loss@init", justify="right", no_wrap=True)
    interval = "" if half_width or not show_interval else " [99%]"  # half-widths: the cells say ±
    t.add_column(f"fwd slope{interval}", justify="right", no_wrap=True)
    t.add_column(f"bwd slope{interval}", justify="right", no_wrap=True)
    if show_ratio:
        t.add_column("max/min", justify="right", no_wrap=True)
    if has_steps:
        steps = int(summary["steps"].iloc[0])
        t.add_column(f"loss@{steps}", justify="right", no_wrap=True)
    t.add_column("verdict", overflow="fold")
    previous = None
    for row in summary.itertuples(index=False):
        if previous is not None and row.scheme != previous:
            t.add_section()
        cells = [row.scheme if row.scheme != previous else "", str(row.depth)]
        previous = row.scheme
        if multi_width:
            cells.append(str(row.width))
        lows = (row.slope_forward_low, row.slope_backward_low) if show_interval else (None, None)
        highs = (row.slope_forward_high, row.slope_backward_high) if show_interval else (None, None)
        cells += [num(row.initial_loss, 4),
                  _slope(row.slope_forward, lows[0], highs[0], compact, half_width),
                  _slope(row.slope_backward, lows[1], highs[1], compact, half_width)]
        if show_ratio:
            cells.append(num(row.max_min_ratio))
        if has_steps:
            cells.append(num(row.early_loss, 4))
        verdict = str(row.verdict)
        cells.append(Text(verdict_text(verdict), style=VERDICT_STYLE.get(verdict, "bold")))
        t.add_row(*cells)
    return t
