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

__all__ = ["PLOT_KINDS", "depth_figure", "compare_figure"]

#: tensor kinds drawn over depth, with their colours.
PLOT_KINDS = {
    "residual": "tab:blue",
    "resid_mid": "tab:cyan",
    "attn_branch": "tab:orange",
    "ffn_branch": "tab:green",
    "attn_scores": "tab:purple",
}


def _ok(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _series(variances: Any, kind: str, direction: str, column: str) -> tuple[list[int], list[float]]:
    """(depth, value) of the "var" rows of ``kind`` in ``direction`` with a block: ``column`` is
    "value" (measured) or "predicted"; depth k is the output of block k-1, as in the depth rows."""
    rows = variances[(variances["kind"] == kind) & (variances["direction"] == direction) & variances["block"].notna()]
    xs, ys = [], []
    for block, v in zip(rows["block"], rows[column]):
        v = float(v)
        if _ok(v):
            xs.append(int(block) + 1)
            ys.append(v)
    return xs, ys


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
    thresholds shaded. Returns the Figure."""
    frame = result.to_frame()
    variances = frame[frame["statistic"] == "var"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, direction in zip(axes, ("forward", "backward")):
        drew = False
        for kind, colour in PLOT_KINDS.items():
            xs, ys = _series(variances, kind, direction, "value")
            if xs:
                ax.plot(xs, ys, "o-", color=colour, ms=3, lw=1.5, label=kind)
                drew = True
            px, py = _series(variances, kind, direction, "predicted")
            if px:
                ax.plot(px, py, "--", color=colour, lw=1, alpha=0.8, label=f"{kind} predicted")
        depth = result.depth
        key, pkey = ("forward_var", "forward_predicted") if direction == "forward" else ("backward_var", "backward_predicted")
        if depth:
            x0 = [r.index for r in depth if r.index == 0 and _ok(getattr(r, key))]
            if x0:
                ax.plot([0], [getattr(depth[0], key)], "s", color="black", ms=4, label="embedding output")
        if drew:
            ax.set_yscale("log")
            _shade_thresholds(ax, result, direction)
        else:
            ax.text(0.5, 0.5, "nothing finite to draw", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("depth (0 = embedding output, k = after block k-1)")
        ax.set_ylabel("variance of activations" if direction == "forward" else "variance of gradients")
        ax.set_title(f"{direction}: measured (solid) vs predicted (dashed)", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if drew:
            ax.legend(fontsize=7, loc="best")
    verdict = "healthy" if result.healthy else f"{len(result.findings)} finding(s): " + ", ".join(
        sorted({f.kind.replace('_', '-') for f in result.findings}))
    cfg = result.header.config or {}
    fig.suptitle(f"{result.header.model_class} L={cfg.get('num_layers', '?')} d={cfg.get('d_model', '?')} "
                 f"init={result.header.init or '?'}: {verdict}", fontsize=11)
    return fig


def compare_figure(tidy: Any, schemes: Sequence[str] | None = None) -> Any:
    """A grid, one row per scheme and one column per direction, of residual-stream variance over depth.

    ``tidy`` is the tidy frame of ``diagnostics.compare`` (the one result schema; this reads
    scheme, depth, width, seed, kind, block, direction, statistic, value). One colour per model depth L,
    one thin line per seed; position 0 is the embedding output, k the output of block k-1.
    With several widths, the widest is drawn.
    """
    frame = tidy[(tidy["statistic"] == "var") & tidy["kind"].isin(["embedding", "residual"])]
    schemes = list(schemes) if schemes is not None else list(dict.fromkeys(frame["scheme"]))
    n = max(len(schemes), 1)
    fig, axes = plt.subplots(n, 2, figsize=(10, 2.3 * n + 0.8), squeeze=False, constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    depths = sorted({int(d) for d in frame["depth"]})
    for i, scheme in enumerate(schemes):
        for j, direction in enumerate(("forward", "backward")):
            ax = axes[i][j]
            sub = frame[(frame["scheme"] == scheme) & (frame["direction"] == direction)]
            if len(sub) and sub["width"].nunique() > 1:
                sub = sub[sub["width"] == sub["width"].max()]
            drew = False
            for k, depth in enumerate(depths):
                colour = cmap(0.85 * k / max(len(depths) - 1, 1))
                d = sub[sub["depth"] == depth]
                for m, (seed, g) in enumerate(d.groupby("seed")):
                    pos = [0 if kind == "embedding" else int(b) + 1 for kind, b in zip(g["kind"], g["block"])]
                    pts = sorted((p, v) for p, v in zip(pos, g["value"]) if _ok(v))
                    if pts:
                        ax.plot([p for p, _ in pts], [v for _, v in pts], "-", color=colour, lw=1.1, alpha=0.8,
                                label=f"L={depth}" if m == 0 else None)
                        drew = True
            if drew:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{scheme}: {direction}", fontsize=9)
            if i == n - 1:
                ax.set_xlabel("position in the residual stream (0 = embedding)")
            if j == 0:
                ax.set_ylabel("variance")
            if i == 0 and j == 1 and drew:
                ax.legend(fontsize=7, loc="best")
    fig.suptitle("Residual stream variance over depth per init scheme (one line per seed)", fontsize=10)
    return fig
