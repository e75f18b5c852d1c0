"""``tinylm compare``: the table, the plot, the CSV, and its usage errors (small grids, in-process)."""

from __future__ import annotations

import io
import math

import pandas as pd
import pytest
from rich.console import Console

from reports.cli import main
from reports.render_compare import CompareTable, compare_table

SMALL = ["--depths", "2,4", "--widths", "32", "--seeds", "2", "--no-progress", "--width", "100"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["compare", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_compare_table_plot_and_csv(capsys, tmp_path):
    from PIL import Image

    png, csv = tmp_path / "grid.png", tmp_path / "tidy.csv"
    code, out, err = run_cli(capsys, "--schemes", "cs336,zero-residual", "--plot", png, "--csv", csv, *SMALL)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    # one row per scheme and depth, scheme named on its first row
    assert ["cs336", "2"] == rows[[r[:1] for r in rows].index(["cs336"])][:2]
    assert any(r[:2] == ["zero-residual", "2"] for r in rows)
    assert sum(1 for r in rows if r and r[0] == "4") == 2
    # zero-residual blocks start as the identity: a flat stream (slope 0, max/min 1), verdict ok
    zr = next(r for r in rows if r and r[0] == "zero-residual")
    assert zr[3] == "+0.000" and zr[-2] == "1.00" and zr[-1] == "ok"
    assert "ln V = 5.545" in out.replace("\n", " ")
    tidy = pd.read_csv(csv)
    assert list(tidy.columns) == ["scheme", "depth", "width", "seed", "tensor", "kind", "block", "direction",
                                  "statistic", "value"]
    assert set(tidy["scheme"]) == {"cs336", "zero-residual"} and set(tidy["depth"]) == {2, 4}
    assert set(tidy["seed"]) == {0, 1}
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 300
        lo, hi = img.convert("L").getextrema()
        assert hi - lo > 100, "the plot is blank"


def test_compare_usage_errors(capsys):
    for argv, needle in ((["--schemes", "nope"], "nope"), (["--depths", "2,x"], "--depths"),
                         (["--depths", "0"], "--depths"), (["--steps", "-1"], "--steps")):
        code, _, err = run_cli(capsys, *argv, "--no-progress")
        assert code == 2, err
        line = err.strip()
        assert "\n" not in line and line.startswith("tinylm: error:") and needle in line


def _summary(**over) -> pd.DataFrame:
    base = dict(scheme="cs336", depth=8, width=128, seeds=3, initial_loss=5.9, ln_vocab=math.log(256),
                slope_forward=0.2031, slope_forward_low=0.19, slope_forward_high=0.22, slope_backward=-0.245,
                slope_backward_low=-0.38, slope_backward_high=-0.11, max_min_ratio=5.33, verdict="ok",
                early_loss=None, steps=0)
    rows = [base, {**base, "scheme": "kaiming", "verdict": "exploding", "max_min_ratio": 42.1, "slope_forward": -0.0001,
                   "slope_forward_low": float("nan")}]
    return pd.DataFrame([{**r, **over} for r in rows])


@pytest.mark.parametrize("width", [80, 120])
def test_compare_table_renders_slopes_intervals_and_verdicts(width):
    buf = io.StringIO()
    Console(width=width, file=buf, color_system=None).print(CompareTable(_summary()))
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= width
    cs = next(line for line in out.splitlines() if line.startswith("cs336"))
    if width >= 100:
        assert "+0.203 [+0.19, +0.22]" in cs and "-0.245 [-0.38, -0.11]" in cs
    else:
        assert "+0.20 [+0.19,+0.22]" in cs
    kai = next(line for line in out.splitlines() if line.startswith("kaiming"))
    assert "exploding" in kai and "42.1" in kai and "-0.000" not in kai and "[" not in kai.split()[3]


def test_compare_table_adds_early_loss_and_width_columns():
    s = _summary(early_loss=4.2, steps=20)
    s.loc[1, "width"] = 256
    t = compare_table(s, 120)
    headers = [c.header for c in t.columns]
    assert "loss@20" in headers and "d" in headers
