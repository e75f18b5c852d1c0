"""The coordinate check's figure: each site kind's RMS against width, one line per step (as mup's
``plot_coord_data`` draws it), log-log, each panel titled with its judged slope against muP's."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = ("embedding", "attn_logits", "attn_branch", "ffn_branch", "residual", "logits")


def _site_of_kind(result: Any, kind: str) -> str | None:
    """The kind's most departing site (else its last one, the deepest)."""
    departing = [f.site for f in result.findings if f.kind == kind]
    if departing:
        return departing[0]
    sites = [f.site for f in result.judged if f.kind == kind]
    return sites[-1] if sites else None


def coord_figure(result: Any) -> Any:
    """A figure of :class:`diagnostics.CoordCheckResult`: per site kind the change from init (and
    the RMS at init, step 0, dashed) against width, one line per step, mean over seeds."""
    frame = result.to_frame()
    kinds = [k for k in KINDS if _site_of_kind(result, k) is not None]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(3.2 * max(1, len(kinds)), 3.4), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, kind in zip(axes[0], kinds):
        site = _site_of_kind(result, kind)
        rows = frame[(frame.site == site) & frame.quantity.isin(["init", "delta"])]
        mean = rows.groupby(["quantity", "step", "width"])["value"].mean()
        steps = sorted(rows.step.unique())
        for step in steps:
            quantity = "init" if step == 0 else "delta"
            series = mean.loc[(quantity, step)]
            ax.plot(series.index, series.values, marker=".", color=cmap(step / max(1, steps[-1])),
                    linestyle="--" if step == 0 else "-", label=f"t={step}" if step in (0, 1, steps[-1]) else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        fits = {f.quantity: f for f in result.judged if f.site == site}
        words = []
        for q in ("init", "delta"):
            f = fits.get(q)
            if f is not None and f.expected is not None:
                words.append(f"{q} {f.slope:+.2f} (muP {f.expected:+.1f})")
        bad = any(f.site == site for f in result.findings)
        ax.set_title(f"{site}\n" + ", ".join(words), fontsize=8, color="firebrick" if bad else "black")
        ax.set_xlabel("width")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("RMS (init) / RMS of change from init")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(result.headline, fontsize=9)
    fig.tight_layout()
    return fig


def write_coord_plot(result: Any, path: str) -> None:
    fig = coord_figure(result)
    fig.savefig(path, dpi=100)
    plt.close(fig)
