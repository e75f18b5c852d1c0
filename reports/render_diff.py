"""The ``tinylm diff`` report: the answer first, then a depth chart of departure over tolerance.

The chart has one row per site in forward order (the stream entering the blocks, each block's
attention, MLP and output, the final norm, the logits) and two panels, forward and backward. In
each panel the horizontal axis is log10(departure / tolerance) on one scale shared by both; the
bar runs from the left edge to the value, ``┃`` marks the tolerance (ratio 1), a bar past it ends
in ``✗`` (departs) and is drawn red, ``0`` marks an exact match (departure 0) and ``∞`` a
non-finite count that differs. Colour is an aid: the markers say the same without it.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text

__all__ = ["DepartureChart", "report"]

BAR, LIMIT, OVER, EXACT, INFINITE = "█", "┃", "✗", "0", "∞"


def _log(ratio: float) -> float | None:
    return math.log10(ratio) if ratio > 0 and math.isfinite(ratio) else None


class DepartureChart:
    """A renderable: per site, log10(departure/tolerance) forward and backward (module docstring)."""

    def __init__(self, rows: list[Any]) -> None:
        self.sites: list[str] = []
        self.values: dict[tuple[str, str], float] = {}
        for r in rows:
            if r.site not in self.sites and r.direction == "forward":
                self.sites.append(r.site)
            self.values[(r.site, r.direction)] = r.ratio
        for r in rows:  # a site measured backward only
            if r.site not in self.sites:
                self.sites.append(r.site)
        logs = [v for v in (_log(x) for x in self.values.values()) if v is not None]
        self.lo = math.floor(min(logs + [-3.0]))
        self.hi = math.ceil(max(logs + [1.0]))

    def _cell(self, ratio: float | None, width: int) -> Text:
        col = lambda v: min(width - 1, max(0, round((v - self.lo) / (self.hi - self.lo) * (width - 1))))  # noqa: E731
        limit = col(0.0)
        cells = [" "] * width
        cells[limit] = LIMIT
        t = Text()
        if ratio is None:
            return Text("not paired".ljust(width), style="dim")
        lg = _log(ratio)
        style = "green"
        if ratio == 0:
            cells[0] = EXACT
        elif lg is None:
            cells[-1], style = INFINITE, "bold red"
        else:
            end = col(lg)
            departs = ratio > 1.0
            style = "bold red" if departs else "green"
            for i in range(end + 1):
                if cells[i] == " ":
                    cells[i] = BAR
            if departs:
                cells[end] = OVER
        for i, ch in enumerate(cells):
            t.append(ch, style="dim" if ch == LIMIT else style)
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        label_w = max([len(s) for s in self.sites] + [5])
        width = max(12, (options.max_width - label_w - 6) // 2)
        head = Text(" " * label_w)
        for title in ("forward", "backward (from the loss)"):
            head.append(" │ ")
            head.append(title[:width].ljust(width), style="bold")
        yield head
        for site in self.sites:
            line = Text(site.rjust(label_w))
            for direction in ("forward", "backward"):
                line.append(" │ ", style="dim")
                line.append_text(self._cell(self.values.get((site, direction)), width))
            yield line
        axis = Text(" " * label_w)
        ticks = [k for k in range(self.lo, self.hi + 1)]
        for _ in range(2):
            axis.append(" └ ", style="dim")
            row = [" "] * width
            for k in ticks[:: max(1, len(ticks) // 4)] + [0]:
                label = "1" if k == 0 else f"1e{k}"
                c = round((k - self.lo) / (self.hi - self.lo) * (width - 1))
                start = min(max(0, c - len(label) // 2), width - len(label))
                if all(ch == " " for ch in row[max(0, start - 1):start + len(label) + 1]):
                    row[start:start + len(label)] = label
            axis.append("".join(row), style="dim")
        yield axis
        yield Text(f"{' ' * label_w}   departure / tolerance (log scale); {LIMIT} tolerance  {OVER} departs  "
                   f"{EXACT} identical  {INFINITE} non-finite differs", style="dim")


def _side(name: str, meta: dict, source: str) -> Text:
    model = meta.get("model", {})
    return Text(f"{name}: {source} — {model.get('class')}, {model.get('parameters', 0):,} parameters, "
                f"{meta.get('dtype')} on {meta.get('device')}, {meta.get('threads')} thread(s)", style="dim")


def report(result: Any, reference: str, candidate: str) -> Group:
    """The whole report of a :class:`diagnostics.DiffResult`; ``reference``/``candidate`` say where each came from."""
    first = result.first
    answer = Text(str(result), style="bold green" if result.same else "bold red")
    parts: list[Any] = [Text("tinylm diff", style="bold"), answer,
                        _side("reference", result.reference, reference), _side("candidate", result.candidate, candidate),
                        Text(f"tokens: {result.reference.get('batch_size')} x {result.reference.get('seq_len')} "
                             f"(sha256 {str(result.reference.get('tokens_sha256'))[:12]}), sketch k={result.reference.get('k')}",
                             style="dim")]
    if first is not None:
        parts.append(Text(f"first departure: {first.site} ({first.direction}), block {first.block}: "
                          f"||a-b||/||b|| = {first.departure:.3g}, tolerance {first.tolerance:.3g} "
                          f"(ratio {first.ratio:.3g}; {first.reference_dtype} vs {first.candidate_dtype}); "
                          f"{len(result.departures)} of {len(result.rows)} comparisons depart", style="red"))
    if result.rows:
        parts += [Text(""), DepartureChart(result.rows)]
    t = result.tolerance
    parts.append(Text(f"tolerance = c (u_store + u_acc sqrt(width)) (1 + {t.get('growth')} depth), c = "
                      f"{t.get('forward')} forward, {t.get('backward')} backward (docs/diff.md)", style="dim"))
    if result.unpaired:
        parts.append(Text("not compared: " + "; ".join(f"{s} ({why})" for s, why in result.unpaired), style="yellow"))
    return Group(*parts)
