"""A depth chart drawn with text: log10 variance per block, measured beside predicted.

One row per depth (the residual stream after the embedding, after each block,
...), two panels side by side: forward (activation variance) and backward
(gradient variance). In each panel the horizontal axis is log10 variance on its
own scale; ``●`` marks the measurement, ``○`` the prediction (``◉`` where they
coincide at the chart's resolution), ``*`` a prediction outside its validity (as
the per-layer table marks it; beside the ``●`` where they coincide), ``✗`` a
non-finite measurement. Colour is an aid, never the only carrier: the markers say
the same thing without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

__all__ = ["DepthSeries", "DepthChart", "log10_or_none"]

MEASURED, PREDICTED, BOTH, NONFINITE, OUTSIDE = "●", "○", "◉", "✗", "*"


def log10_or_none(value: float | None) -> float | None:
    """log10(value) for a finite positive value, else None (nothing to place on a log axis)."""
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return math.log10(value)


@dataclass
class DepthSeries:
    """One panel's data: per depth label, the measured and the predicted variance (None: not available),
    and whether each prediction is inside its validity (None: all are)."""

    title: str
    measured: Sequence[float | None]
    predicted: Sequence[float | None]
    style: str = "cyan"
    valid: Sequence[bool] | None = None

    def validity(self) -> list[bool]:
        return [True] * len(self.predicted) if self.valid is None else [bool(v) for v in self.valid]


def _is_nonfinite(v: float | None) -> bool:
    return v is not None and isinstance(v, (int, float)) and not math.isfinite(v)


def _ticks(lo: float, hi: float) -> list[int]:
    """Integer decades inside [lo, hi], thinned to at most 4."""
    decades = list(range(math.ceil(lo), math.floor(hi) + 1))
    while len(decades) > 4:
        decades = decades[::2]
    return decades


def _decade(k: int) -> str:
    return "1" if k == 0 else f"1e{k}"


class DepthChart:
    """A renderable: labels down the left, one panel per :class:`DepthSeries`, fitted to the console width."""

    def __init__(self, labels: Sequence[str], panels: Sequence[DepthSeries], title: str | None = None) -> None:
        for s in panels:
            if len(s.measured) != len(labels) or len(s.predicted) != len(labels) or len(s.validity()) != len(labels):
                raise ValueError(f"panel {s.title!r}: {len(s.measured)} measured / {len(s.predicted)} predicted / "
                                 f"{len(s.validity())} validity values for {len(labels)} labels; give one per label")
        self.labels = list(labels)
        self.panels = list(panels)
        self.title = title

    def _panel_width(self, total: int, label_w: int) -> int:
        n = max(len(self.panels), 1)
        return max(12, (total - label_w - 3 * n) // n)

    def _row_cells(self, s: DepthSeries, width: int, lo: float, hi: float) -> list[Text]:
        span = hi - lo
        rows = []
        for m, p, ok in zip(s.measured, s.predicted, s.validity()):
            cells = [" "] * width
            styles: list[str | None] = [None] * width
            col = lambda v: min(width - 1, max(0, round((v - lo) / span * (width - 1))))  # noqa: E731
            lp, lm = log10_or_none(p), log10_or_none(m)
            if lp is not None:
                c = col(lp)
                cells[c], styles[c] = (PREDICTED, "dim") if ok else (OUTSIDE, "bold yellow")
            if lm is not None:
                c = col(lm)
                for i in range(c):  # a faint trail from the axis makes the shape over depth readable
                    if cells[i] == " ":
                        cells[i], styles[i] = "·", "dim " + s.style
                if cells[c] == OUTSIDE:  # keep the mark beside the measurement it would hide under
                    beside = c + 1 if c + 1 < width else c - 1
                    cells[beside], styles[beside] = OUTSIDE, "bold yellow"
                both = cells[c] == PREDICTED
                cells[c], styles[c] = (BOTH if both else MEASURED), "bold " + s.style
            elif _is_nonfinite(m) or (m is not None and not isinstance(m, (int, float))):
                cells[-1], styles[-1] = NONFINITE, "bold red"
            elif m is not None and isinstance(m, (int, float)) and m <= 0:
                cells[0], styles[0] = "0", "bold red"  # zero variance: off the left of a log axis
            t = Text()
            for ch, st in zip(cells, styles):
                t.append(ch, style=st or "")
            rows.append(t)
        return rows

    def _range(self, s: DepthSeries) -> tuple[float, float]:
        vals = [v for v in (log10_or_none(x) for x in [*s.measured, *s.predicted]) if v is not None]
        if not vals:
            return -1.0, 1.0
        lo, hi = min(vals), max(vals)
        if hi - lo < 1.0:  # at least one decade wide, centred
            mid = 0.5 * (lo + hi)
            lo, hi = mid - 0.5, mid + 0.5
        pad = 0.04 * (hi - lo)
        return lo - pad, hi + pad

    def _axis(self, width: int, lo: float, hi: float) -> Text:
        line = [" "] * width
        for k in _ticks(lo, hi):
            label = _decade(k)
            c = round((k - lo) / (hi - lo) * (width - 1))
            start = min(max(0, c - len(label) // 2), width - len(label))
            if all(ch == " " for ch in line[max(0, start - 1):start + len(label) + 1]):
                line[start:start + len(label)] = label
        return Text("".join(line), style="dim")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        label_w = max([len(x) for x in self.labels] + [5])
        width = self._panel_width(options.max_width, label_w)
        ranges = [self._range(s) for s in self.panels]
        columns = [self._row_cells(s, width, lo, hi) for s, (lo, hi) in zip(self.panels, ranges)]
        if self.title:
            yield Text(self.title, style="bold")
        head = Text(" " * label_w)
        for s in self.panels:
            head.append(" │ ")
            head.append(s.title[:width].ljust(width), style="bold " + s.style)
        yield head
        for i, label in enumerate(self.labels):
            line = Text(label.rjust(label_w))
            for col in columns:
                line.append(" │ ", style="dim")
                line.append_text(col[i])
            yield line
        axis = Text(" " * label_w)
        for lo, hi in ranges:
            axis.append(" └ ", style="dim")
            axis.append_text(self._axis(width, lo, hi))
        yield axis
        shown = [(ok, p) for s in self.panels for ok, p in zip(s.validity(), s.predicted) if p is not None]
        keys = [f"{MEASURED} measured"] + ([f"{PREDICTED} predicted", f"{BOTH} both"] if shown else []) \
            + [f"{NONFINITE} non-finite"] + ([f"{OUTSIDE} outside validity"] if any(not ok for ok, _ in shown) else [])
        lines, pad = [f"{' ' * label_w}   log10 variance;"], " " * (label_w + 3)
        for i, key in enumerate(keys):  # the keys packed into lines of the console's width, each line indented
            gap = " " if i == 0 else "  "
            if len(lines[-1]) + len(gap) + len(key) > options.max_width:
                lines.append(pad + key)
            else:
                lines[-1] += gap + key
        for line in lines:
            yield Text(line, style="dim")
