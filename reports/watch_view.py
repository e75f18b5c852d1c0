"""The "during training" panel: a watch history drawn in the terminal and as a plot.

``render_history(history)`` returns a rich renderable: per block, the residual
stream's activation and gradient variance over the recorded steps as a line of
block characters on one shared log scale, the first and last values, and the
first step at which any verdict left ok. ``plot_history(history, path)`` draws
the same with matplotlib (Agg); ``plot_histories({label: history}, path)`` puts
several runs side by side (docs/ablation.png). Each takes a ``diagnostics.History``
or the history dict (wrapped in one). Every series is read from the history's tidy
frame (``History.to_frame``, the one result schema), every verdict from the History
(``verdicts``, ``departures``, ``first_departure``): nothing here computes a statistic
or judges.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["render_history", "plot_history", "plot_histories", "histories_figure", "chart_sites"]

BARS = "▁▂▃▄▅▆▇█"
MAX_COLUMNS = 32
MAX_EVENTS = 3


def chart_sites(history: dict[str, Any]) -> list[str]:
    """The sites charted: the embedding output, each block's output (residual stream), and the logits
    (for another model: every site the watch found, its embeddings, blocks and head)."""
    sites = history.get("sites") or []
    kinds = history.get("kinds") or {}
    tiny = [s for s in sites if s == "token_embeddings" or (s.startswith("layers.") and s.count(".") == 1)
            or kinds.get(s) == "logits" or s == "lm_head"]
    return tiny if "token_embeddings" in tiny else list(sites)


def block_sites(history: dict[str, Any]) -> list[str]:
    """The charted sites that are block outputs (the residual stream), in forward order."""
    kinds = history.get("kinds") or {}
    return [s for s in chart_sites(history)
            if s != "lm_head" and kinds.get(s, "residual") not in ("embedding", "logits", "linear")]


def _as_history(history: Any) -> Any:
    """``history`` as a ``diagnostics.History`` (a dict of the watch's format is wrapped), or None
    when it is not a watch history."""
    from diagnostics import History
    from diagnostics.jobs import check_history

    if isinstance(history, History):
        return history
    checked, _ = check_history(history)
    return None if checked is None else History(checked)


def _series(frame: Any, site: str | None, direction: str | None, statistic: str = "var"
            ) -> tuple[list[int], list[float]]:
    """(steps, values) of one statistic of one site (``site`` None: the whole-model series such as
    "loss") from the tidy frame, in step order."""
    rows = frame[frame["statistic"] == statistic]
    rows = rows[rows["name"].isna()] if site is None else rows[rows["name"] == site]
    if direction is not None:
        rows = rows[rows["direction"] == direction]
    rows = rows.sort_values("step", kind="stable")
    return [int(t) for t in rows["step"]], [float(v) for v in rows["value"]]


def _thin(values: list[float], n: int) -> list[float]:
    """At most n values: consecutive buckets, each shown by its largest value (NaN if any is not
    finite), so that a short excursion is never thinned away."""
    if len(values) <= n:
        return values
    k = math.ceil(len(values) / n)
    out = []
    for i in range(0, len(values), k):
        bucket = values[i:i + k]
        bad = any(v is None or not math.isfinite(v) for v in bucket)
        out.append(math.nan if bad else max(bucket))
    return out


def _spark(values: list[float], lo: float, hi: float) -> str:
    chars = []
    for v in values:
        if v is None or not math.isfinite(v) or v <= 0:
            chars.append("×" if v is None or not (v == v) or math.isinf(v) else " ")
            continue
        x = (math.log10(v) - lo) / (hi - lo) if hi > lo else 0.5
        chars.append(BARS[min(len(BARS) - 1, max(0, int(x * len(BARS))))])
    return "".join(chars)


def _log_range(rows: list[list[float]]) -> tuple[float, float]:
    logs = [math.log10(v) for vals in rows for v in vals if v is not None and math.isfinite(v) and v > 0]
    if not logs:
        return 0.0, 1.0
    return min(logs), max(logs)


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    return f"{v:.3g}"


def render_history(history: Any):
    """A rich renderable of a watch history (a ``diagnostics.History`` or its dict; see the module
    docstring); an empty history says so, and anything else that it is not a watch history."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from .fmt import verdict_text

    h = _as_history(history)
    if h is None:
        return Panel(Text(f"the checkpoint's history ({type(history).__name__}) is not a tinylm watch history; "
                          "nothing to draw"), title="during training", expand=False)
    data = h.data
    records = data.get("records") or []
    losses = (data.get("series") or {}).get("loss") or []
    lines: list[Any] = []
    if losses:
        k, first, last = h.loss_summary()
        lines.append(Text(f"{len(losses)} steps trained (loss {first:.4g} -> {last:.4g}, "
                          f"means of the first and last {k}); {len(records)} watch records, "
                          f"every {data.get('watch_every')} steps"))
    if not records:
        lines.append(Text("no watch records (trained with --watch-every 0)"))
        return Panel(Group(*lines), title="during training", expand=False)

    bad = h.departures()
    sites = chart_sites(data)
    frame = h.to_frame()
    for direction, label in (("forward", "activation variance"), ("backward", "gradient variance")):
        rows = [_thin(_series(frame, s, direction)[1], MAX_COLUMNS) for s in sites]
        lo, hi = _log_range(rows)
        lines.append(Text(f"{label} over steps {records[0]['step']}..{records[-1]['step']} "
                          f"(log scale: {BARS[0]} 1e{lo:.1f} .. {BARS[-1]} 1e{hi:.1f}; × not finite)", style="bold"))
        table = Table(box=None, pad_edge=False)
        table.add_column("site", no_wrap=True)
        table.add_column("over steps", no_wrap=True)
        table.add_column("first", justify="right", no_wrap=True)
        table.add_column("last", justify="right", no_wrap=True)
        table.add_column("verdict", no_wrap=True)
        for site, vals in zip(sites, rows):
            row = bad.get(site)
            verdict = "ok" if row is None else f"{verdict_text(row['verdict'])} at step {row['step']}"
            style = "green" if row is None else "red"
            table.add_row(site, _spark(vals, lo, hi), _fmt(vals[0] if vals else None), _fmt(vals[-1] if vals else None),
                          Text(verdict, style=style))
        lines.append(table)
    dep = h.first_departure()
    if dep is None:
        lines.append(Text(f"every verdict stayed ok over all {len(records)} records", style="green"))
    else:
        thr = "" if not math.isfinite(dep["threshold"]) else f" against the threshold {dep['threshold']:.3g}"
        what = verdict_text(dep["verdict"])
        lines.append(Text(f"first verdict other than ok: step {dep['step']}, {dep['site']} {what} "
                          f"({dep['stat']} = {_fmt(dep['value'])}{thr})", style="bold red"))
    events = data.get("events") or []
    for ev in events[:MAX_EVENTS]:
        lines.append(Text(f"watch: {ev['message']}", style="yellow"))
    if len(events) > MAX_EVENTS:
        lines.append(Text(f"... and {len(events) - MAX_EVENTS} more alarms (steps {', '.join(str(e['step']) for e in events[MAX_EVENTS:][:8])}"
                          f"{', ...' if len(events) > MAX_EVENTS + 8 else ''})", style="yellow"))
    return Panel(Group(*lines), title="during training", expand=False)


def _plot_run(axes, h: Any, label: str | None) -> None:
    """One run's column: loss, residual variance per block, gradient variance per block (``h``: a History)."""
    from .fmt import verdict_text

    frame = h.to_frame()
    ax_loss, ax_fwd, ax_grad = axes
    steps, losses = _series(frame, None, None, "loss")
    ax_loss.plot(steps, losses, lw=0.8, color="black")
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (nats)")
    dep = h.first_departure()
    blocks = block_sites(h.data)
    n_blocks = max(1, len(blocks))
    cmap = __import__("matplotlib").colormaps["viridis"]
    for direction, ax in (("forward", ax_fwd), ("backward", ax_grad)):
        for i, site in enumerate(blocks):
            x, y = _series(frame, site, direction)
            y = [v if v is not None and math.isfinite(v) and v > 0 else float("nan") for v in y]
            ax.plot(x, y, lw=1.2, color=cmap(i / max(1, n_blocks - 1)), label=f"block {i}")
        ax.set_yscale("log")
    ax_fwd.set_ylabel("residual stream variance")
    ax_grad.set_ylabel("its gradient variance")
    for ax in axes:
        if dep is not None:
            ax.axvline(dep["step"], color="red", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    if label:
        what = "" if dep is None else verdict_text(dep["verdict"])
        ax_loss.set_title(label if dep is None else f"{label}\nfirst non-ok: step {dep['step']}, {dep['site']} ({what})",
                          fontsize=9)
    axes[-1].set_xlabel("step")
    ax_fwd.legend(fontsize=7, loc="upper left")


def histories_figure(histories: dict[str, Any], height: float = 8.5) -> Any:
    """The Figure of :func:`plot_histories` (one column per run: label -> History or history dict;
    what is not a watch history is left out), not written anywhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = {k: h for k, h in ((k, _as_history(v)) for k, v in histories.items()) if h is not None}
    n = max(1, len(histories))
    fig, axes = plt.subplots(3, n, figsize=(4.2 * n, height), sharex="col", sharey="row", squeeze=False)
    for j, (label, history) in enumerate(histories.items()):
        _plot_run(list(axes[:, j]), history, label)
    fig.tight_layout()
    return fig


def plot_histories(histories: dict[str, Any], path: str) -> None:
    """One column per run (label -> history): loss, residual variance per block, gradient variance per block.

    Rows share their y axis across runs so magnitudes compare directly. Written atomically (PNG/SVG/PDF by suffix).
    """
    import matplotlib.pyplot as plt

    from diagnostics.integrations.writers import write_atomic

    fig = histories_figure(histories)
    suffix = str(path).rsplit(".", 1)[-1] if "." in str(path) else "png"
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format=suffix))
    plt.close(fig)


def plot_history(history: Any, path: str) -> None:
    """The "during training" plot of one run: loss, residual variance per block, gradient variance per block."""
    plot_histories({"": history}, path)

