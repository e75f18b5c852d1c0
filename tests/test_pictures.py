"""Each picture kind, rendered, holds what it must: the depth chart (text) and the depth plot mark
predictions outside validity as the table does; the plot draws the residual stream above the
branches; the compare plot keeps every cell, flagged ones marked; the HTML report meets WCAG AA
contrast (4.5:1) for every text/background pair."""

from __future__ import annotations

import io
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console

import tinylm
from diagnostics import DiagnoseOptions, diagnose
from diagnostics.result import frame
from reports import export
from reports.charts import MEASURED, OUTSIDE, PREDICTED, DepthChart, DepthSeries
from reports.plots import PLOT_KINDS, compare_figure, depth_figure
from reports.render import LayerTable, ReportContext, depth_chart, report

OPTS = DiagnoseOptions(batch_size=2, batches=2, seq_len=16)


@pytest.fixture(scope="module")
def post_norm():
    """A deep post-norm model at init: its global backward predictions are outside validity (table ``*``)."""
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=6, num_heads=2, d_ff=64,
                                norm="post")
    options = DiagnoseOptions(batch_size=2, batches=2, seq_len=16, theory="global")
    return diagnose(tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)), options=options)


@pytest.fixture(scope="module")
def exploding():
    """No norm, 6 blocks: the stream explodes and the branches run beside it."""
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=6, num_heads=2, d_ff=64,
                                norm="none")
    return diagnose(tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)), options=OPTS)


def text(renderable, width=100) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def png(fig, tmp_path) -> None:
    path = tmp_path / "figure.png"
    try:
        export.write_figure(path, fig)
    finally:
        plt.close(fig)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the depth chart (text)

def test_the_text_chart_marks_exactly_the_predictions_outside_validity():
    series = DepthSeries("panel", measured=[1.0, 1.0, 1.0, 1.0], predicted=[1e3, 1e3, 1.0, None],
                         valid=[True, False, False, True])
    lines = text(DepthChart(["a", "b", "c", "d"], [series]), width=60).splitlines()
    rows = {line.split("│")[0].strip(): line.split("│")[1] for line in lines if "│" in line and line.split("│")[0].strip()}
    assert PREDICTED in rows["a"] and OUTSIDE not in rows["a"]
    assert OUTSIDE in rows["b"] and PREDICTED not in rows["b"]
    assert OUTSIDE in rows["c"] and MEASURED in rows["c"]  # beside the measurement it coincides with
    assert OUTSIDE not in rows["d"]
    assert "outside validity" in lines[-1] or "outside validity" in lines[-2]


def test_the_report_chart_marks_what_the_table_marks(post_norm):
    """Per depth and direction: a ``*`` in the chart exactly where the table's prediction has one."""
    invalid = {(r.name, r.direction) for r in post_norm.tensors if r.predicted is not None and not r.valid}
    chart = depth_chart(post_norm)
    for panel, direction in zip(chart.panels, ("forward", "backward")):
        marked = [not ok for ok in panel.validity()]
        assert marked == [(row.name, direction) in invalid for row in post_norm.depth]
    backward = [line.split("│")[2] for line in text(chart).splitlines() if line.count("│") == 2]
    flagged = sum((row.name, "backward") in invalid and row.backward_predicted is not None for row in post_norm.depth)
    assert flagged > 0 and sum(OUTSIDE in cell for cell in backward) == flagged
    table = text(LayerTable(post_norm))
    assert "*" in table


# ---------------------------------------------------------------- the depth plot

def test_the_depth_plot_draws_the_residual_stream_above_every_branch(exploding, tmp_path):
    fig = depth_figure(exploding)
    for ax in fig.axes[:2]:
        lines = {line.get_label(): line for line in ax.lines}
        residual = lines["residual"]
        branches = [k for k in PLOT_KINDS if k != "residual"]
        others = [line for label, line in lines.items() if label.split(" ")[0] in branches]
        assert others, "branches drawn too"
        assert all(residual.get_zorder() > line.get_zorder() for line in others)
        assert residual.get_linewidth() > max(line.get_linewidth() for line in others if line.get_label() in PLOT_KINDS)
    png(fig, tmp_path)


def test_the_depth_plot_draws_predictions_outside_validity_apart(post_norm, tmp_path):
    frame_ = post_norm.to_frame()
    var = frame_[(frame_.statistic == "var") & (frame_.kind == "residual") & frame_.predicted.notna()]
    fig = depth_figure(post_norm)
    for ax, direction in zip(fig.axes[:2], ("forward", "backward")):
        lines = {line.get_label(): line for line in ax.lines}
        rows = var[var.direction == direction]
        for valid, label in ((True, "residual predicted"), (False, "residual predicted (outside validity)")):
            want = sorted(int(b) + 1 for b in rows[rows.valid == valid].block)
            if want:
                assert sorted(lines[label].get_xdata()) == want, (direction, label)
            else:
                assert label not in lines
        assert "residual predicted (outside validity)" in lines or direction == "forward"
    png(fig, tmp_path)


# ---------------------------------------------------------------- the compare plot

def compare_tidy() -> pd.DataFrame:
    """Two widths x two depths x two seeds of one scheme; only d 32, L 4 is flagged (at block 2), and
    d 64, L 2 has nothing finite."""
    rows = []
    for width in (32, 64):
        for depth in (2, 4):
            for seed in (0, 1):
                for pos in range(depth + 1):
                    kind = "embedding" if pos == 0 else "residual"
                    value = math.nan if (width, depth) == (64, 2) else (1.0 + pos) * (1 + seed / 10) * width / 32
                    flagged = (width, depth) == (32, 4) and pos == 3
                    for direction in ("forward", "backward"):
                        rows.append(dict(scheme="cs336", depth=depth, width=width, seed=seed, kind=kind,
                                         block=None if pos == 0 else pos - 1, direction=direction, statistic="var",
                                         value=value, verdict="exploding" if flagged else "ok"))
    return frame(rows)


def test_the_compare_plot_keeps_every_cell_and_marks_the_flagged_one(tmp_path):
    fig = compare_figure(compare_tidy())
    for ax in fig.axes[:2]:
        drawn = [line for line in ax.lines if len(line.get_xdata()) > 1]
        styles = {(len(line.get_xdata()), line.get_linestyle()) for line in drawn}
        assert styles == {(3, "--"), (5, "--"), (5, "-")}, styles  # d 64 solid (widest), d 32 dashed
        assert len(drawn) == 3 * 2  # three finite cells, two seeds each
        marks = [line for line in ax.lines if line.get_marker() == "x"]
        assert marks and all(list(m.get_xdata()) == [3] for m in marks)
        notes = [t.get_text() for t in ax.texts]
        assert any("no finite value" in t and "L=2, d=64" in t for t in notes)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "flagged" in labels and {"L=2, d=32", "L=4, d=32", "L=4, d=64"} <= set(labels)
    png(fig, tmp_path)


# ---------------------------------------------------------------- the HTML report

def unhealthy_console() -> Console:
    """A recorded report that holds every style the report uses: findings (non-finite white on red,
    exploding, vanishing in yellow), dim captions, the chart's marks, verdict cells."""
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=3, num_heads=2, d_ff=64,
                                norm="none")
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.layers[1].ffn.w2.weight[0, 0] = float("nan")
    result = diagnose(model, options=OPTS)
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(report(result, ReportContext(nonfinite_params=["layers.1.ffn.w2.weight"])))
    console.print("[yellow]vanishing[/] [bold white on red]NON-FINITE[/] [dim]a caption[/] [dim cyan]a trail[/]")
    return console


def test_the_html_report_meets_wcag_aa_contrast(tmp_path):
    console = unhealthy_console()
    path = tmp_path / "report.html"
    export.write_console(path, console, "html")
    html = path.read_text()
    pairs = export.contrast_pairs(html)
    assert len(pairs) > 5 and any(bg != pairs[0][2] for _, _, bg in pairs), "styles with their own background"
    low = [(s, fg, bg, round(export.contrast_ratio(fg, bg), 2)) for s, fg, bg in pairs
           if export.contrast_ratio(fg, bg) < export.AA_CONTRAST]
    assert not low, low
    # negative control: the same console's plain export fails the same check
    raw = console.export_html(clear=False, inline_styles=False)
    assert min(export.contrast_ratio(fg, bg) for _, fg, bg in export.contrast_pairs(raw)) < export.AA_CONTRAST


def test_contrast_ratios_are_wcags():
    assert export.contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0)
    assert export.contrast_ratio("#ffffff", "#ffffff") == pytest.approx(1.0)
    assert export.contrast_ratio("#767676", "#ffffff") == pytest.approx(4.54, abs=0.01)  # the AA grey on white
    assert export.contrast_ratio("#7f7f7f", "#ffffff") < 4.5 < export.contrast_ratio("#757575", "#ffffff")


def test_accessible_html_changes_only_the_colours_that_fall_short():
    html = ("<style>\n.r1 {color: #7f7f7f; text-decoration-color: #7f7f7f}\n.r2 {color: #000000}\n"
            ".r3 {color: #c0c0c0; background-color: #800000; font-weight: bold}\nbody {\n    color: #000000;\n"
            "    background-color: #ffffff;\n}\n</style>")
    fixed = export.accessible_html(html)
    pairs = dict((s, (fg, bg)) for s, fg, bg in export.contrast_pairs(fixed))
    assert pairs[".r2"] == ("#000000", "#ffffff") and pairs[".r3"] == ("#c0c0c0", "#800000")
    fg, bg = pairs[".r1"]
    assert fg != "#7f7f7f" and export.AA_CONTRAST <= export.contrast_ratio(fg, bg) < 5.0  # just enough
    assert "text-decoration-color: " + fg in fixed
    channels = np.array([int(fg[i:i + 2], 16) for i in (1, 3, 5)])
    assert np.ptp(channels) == 0, "a grey stays grey (its hue kept)"
