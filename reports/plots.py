"""Matplotlib figures (Agg backend, no display needed): variance over depth, and the compare grid.

The figures draw the tidy frame of the one result schema
(:data:`diagnostics.result.COLUMNS`): a :class:`diagnostics.DiagnoseResult`'s
``to_frame()`` (with its depth rows and thresholds for the stream and the bands)
or the tidy frame of ``diagnostics.compare``; nothing is computed here beyond
choosing what goes on which axis.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .fmt import verdict_words  # noqa: E402

__all__ = ["PLOT_KINDS", "depth_figure", "compare_figure"]

#: tensor kinds drawn over depth, with their colours; the first (the residual stream, what the
#: verdicts judge) is drawn above the others and thicker, so no branch line hides it.
PLOT_KINDS = {
    "residual": "tab:blue",
    "resid_mid": "tab:cyan",
    "attn_branch": "tab:orange",
    "ffn_branch": "tab:green",
    "attn_scores": "tab:purple",
}


def _ok(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _series(variances: Any, kind: str, direction: str, column: str, valid: bool | None = None
            ) -> tuple[list[int], list[float]]:
    """(depth, value) of the "var" rows of ``kind`` in ``direction`` with a block: ``column`` is
    "value" (measured) or "predicted"; depth k is the output of block k-1, as in the depth rows.
    ``valid``: True or False keeps only the predictions inside (outside) their validity."""
    rows = variances[(variances["kind"] == kind) & (variances["direction"] == direction) & variances["block"].notna()]
    if valid is not None:
        rows = rows[rows["valid"].fillna(True).astype(bool) == valid]
    xs, ys = [], []
    for block, v in zip(rows["block"], rows[column]):
        v = float(v)
        if _ok(v):
            xs.append(int(block) + 1)
            ys.append(v)
    return xs, ys


#: z-order of the lines: the threshold bands below everything, branches, then the residual stream on top.
Z_BRANCH, Z_RESIDUAL = 2.0, 3.0


def _shade_thresholds(ax: Any, result: Any, direction: str) -> None:
    """Shade the per-block gain beyond the verdict thresholds, anchored at the embedding's variance.

    The band shows where the residual variance would be if it grew (or shrank) by
    the threshold factor per block from the embedding output: outside it, the
    verdict is exploding (above) or vanishing (below).
    """
    th = result.thresholds or {}
    up, down = th.get("exploding_gain"), th.get("vanishing_gain")
    rows = [r for r in result.depth]
    if not rows:
        return
    start = rows[0].forward_var if direction == "forward" else rows[-1].backward_var
    if not _ok(start):
        return
    n = len(rows) - 1
    xs = list(range(len(rows)))
    if direction == "forward":
        steps = xs
    else:  # the gradient flows from the top down
        steps = [n - x for x in xs]
    lo, hi = ax.get_ylim()
    if _ok(up):
        ax.fill_between(xs, [start * up**s for s in steps], [max(hi, start * up**n) * 10] * len(xs),
                        color="red", alpha=0.08, label=f"exploding (x{up:g}/block)")
    if _ok(down):
        ax.fill_between(xs, [min(lo, start * down**n) / 10] * len(xs), [start * down**s for s in steps],
                        color="gold", alpha=0.12, label=f"vanishing (x{down:g}/block)")
    ax.set_ylim(lo, hi)


def depth_figure(result: Any) -> Any:
    """Variance over depth: forward (activations) and backward (gradients), one line per tensor kind,
    measured solid, predicted dashed (the "var" rows of ``result.to_frame()``), the verdict
    thresholds shaded. A prediction outside its validity (the table's ``*``) is not joined to the
    dashed line: it is drawn as an ``x`` on a dotted line labelled "(outside validity)". The residual
    stream is drawn above the branches. Returns the Figure."""
    frame = result.to_frame()
    variances = frame[frame["statistic"] == "var"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, direction in zip(axes, ("forward", "backward")):
        drew = False
        for kind, colour in PLOT_KINDS.items():
            top = kind == "residual"
            z = Z_RESIDUAL if top else Z_BRANCH
            xs, ys = _series(variances, kind, direction, "value")
            if xs:
                ax.plot(xs, ys, "o-", color=colour, ms=4 if top else 3, lw=2.2 if top else 1.3, label=kind, zorder=z)
                drew = True
            px, py = _series(variances, kind, direction, "predicted", valid=True)
            if px:
                ax.plot(px, py, "--", color=colour, lw=1.2 if top else 1, alpha=0.8, label=f"{kind} predicted",
                        zorder=z)
            qx, qy = _series(variances, kind, direction, "predicted", valid=False)
            if qx:
                ax.plot(qx, qy, "x:", color=colour, ms=5, lw=0.8, alpha=0.7,
                        label=f"{kind} predicted (outside validity)", zorder=z - 0.5)
        depth = result.depth
        key, pkey = ("forward_var", "forward_predicted") if direction == "forward" else ("backward_var", "backward_predicted")
        if depth:
            x0 = [r.index for r in depth if r.index == 0 and _ok(getattr(r, key))]
            if x0:
                ax.plot([0], [getattr(depth[0], key)], "s", color="black", ms=4, label="embedding output",
                        zorder=Z_RESIDUAL)
        if drew:
            ax.set_yscale("log")
            _shade_thresholds(ax, result, direction)
        else:
            ax.text(0.5, 0.5, "nothing finite to draw", ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("depth (0 = embedding output, k = after block k-1)")
        ax.set_ylabel("variance of activations" if direction == "forward" else "variance of gradients")
        ax.set_title(f"{direction}: measured (solid) vs predicted (dashed; x outside validity)", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    _shared_legend(fig, axes)
    fig.suptitle(f"{figure_title(result)}: {verdict_words(result)}", fontsize=11)
    return fig


def figure_title(result: Any) -> str:
    """What the figure is of, in words that name only what is known: a tinylm model's depth, width and
    declared init; of another model, its class, the blocks found and the declared init if any."""
    h = result.header
    cfg = h.config or {}
    declared = getattr(h, "declared", "") or (f"{h.init} (model config)" if h.init else "")
    init = f"init {declared.split(':')[0]}" if declared and not declared.startswith("none") else "no declared init"
    if cfg:
        return f"{h.model_class} L={cfg.get('num_layers')} d={cfg.get('d_model')}, {init}"
    blocks = max(0, len(result.depth) - 1)
    shape = f"{blocks} blocks found" if blocks else "no block stack found"
    return f"{h.model_class} (not tinylm: {shape}, width unknown), {init}"


def _shared_legend(fig: Any, axes: Sequence[Any]) -> None:
    """One legend for all panels, below them, each label once (a legend inside a panel hides its lines)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if "flagged" in seen:  # the marker's key after the lines'
        seen["flagged"] = seen.pop("flagged")
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=min(4, len(seen)), fontsize=7,
                   frameon=False)


def compare_figure(tidy: Any, schemes: Sequence[str] | None = None) -> Any:
    """A grid, one row per scheme and one column per direction, of residual-stream variance over depth.

    ``tidy`` is the tidy frame of ``diagnostics.compare`` (the one result schema; this reads
    scheme, depth, width, seed, kind, block, direction, statistic, value, verdict). Every cell
    (scheme, depth, width) is drawn: one colour per model depth L, one line style per width d
    (solid the widest), one thin line per seed; position 0 is the embedding output, k the output
    of block k-1. A line whose stream a verdict flagged (verdict not "ok") is drawn thicker with a red
    ``x`` on each flagged position ("flagged" in the legend); a cell with no finite value is named
    in its panel ("no finite value: L=8, d=128"). One legend, below the panels.
    """
    frame = tidy[(tidy["statistic"] == "var") & tidy["kind"].isin(["embedding", "residual"])]
    schemes = list(schemes) if schemes is not None else list(dict.fromkeys(frame["scheme"]))
    n = max(len(schemes), 1)
    fig, axes = plt.subplots(n, 2, figsize=(10, 2.3 * n + 0.8), squeeze=False, constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    depths = sorted({int(d) for d in frame["depth"]})
    widths = sorted({int(w) for w in frame["width"]}, reverse=True)
    styles = {w: WIDTH_STYLES[k % len(WIDTH_STYLES)] for k, w in enumerate(widths)}
    for i, scheme in enumerate(schemes):
        for j, direction in enumerate(("forward", "backward")):
            ax = axes[i][j]
            sub = frame[(frame["scheme"] == scheme) & (frame["direction"] == direction)]
            drew = flagged_any = False
            empty: list[str] = []
            for k, depth in enumerate(depths):
                colour = cmap(0.85 * k / max(len(depths) - 1, 1))
                for width in widths:
                    d = sub[(sub["depth"] == depth) & (sub["width"] == width)]
                    if len(d) and not any(_ok(v) for v in d["value"]):  # named in the panel: nothing finite to draw
                        empty.append(f"L={depth}" + (f", d={width}" if len(widths) > 1 else ""))
                    for m, (seed, g) in enumerate(d.groupby("seed")):
                        pos = [0 if kind == "embedding" else int(b) + 1 for kind, b in zip(g["kind"], g["block"])]
                        pts = sorted((p, v, _flagged(f)) for p, v, f in zip(pos, g["value"], g["verdict"]) if _ok(v))
                        if not pts:
                            continue
                        flagged = [(p, v) for p, v, f in pts if f]
                        label = None
                        if m == 0:
                            label = f"L={depth}" + (f", d={width}" if len(widths) > 1 else "")
                        ax.plot([p for p, _, _ in pts], [v for _, v, _ in pts], styles[width], color=colour,
                                lw=2.2 if flagged else 1.1, alpha=0.8, label=label, zorder=3 if flagged else 2)
                        if flagged:
                            ax.plot([p for p, _ in flagged], [v for _, v in flagged], "x", color="red", ms=7,
                                    mew=2, zorder=4, label=None if flagged_any else "flagged")
                            flagged_any = True
                        drew = True
            if drew:
                ax.set_yscale("log")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if empty:
                ax.text(0.02, 0.04, "no finite value: " + "; ".join(empty), transform=ax.transAxes, fontsize=7,
                        color="darkred", va="bottom", bbox=dict(facecolor="white", edgecolor="darkred", alpha=0.9))
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{scheme}: {direction}", fontsize=9)
            if i == n - 1:
                ax.set_xlabel("position in the residual stream (0 = embedding)")
            if j == 0:
                ax.set_ylabel("variance")
    _shared_legend(fig, [ax for row in axes for ax in row])
    title = "Residual stream variance over depth per init scheme (one line per seed"
    title += "; line style: width d)" if len(widths) > 1 else ")"
    fig.suptitle(title, fontsize=10)
    return fig


#: line styles of the widths in a comparison, widest first.
WIDTH_STYLES = ("-", "--", ":", "-.")


def _flagged(verdict: Any) -> bool:
    return isinstance(verdict, str) and verdict not in ("ok", "")
