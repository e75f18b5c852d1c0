"""``tinylm compare``: the table, the plot, the CSV, ``--data``, and its usage errors (small grids).

Most cases call ``reports.cli.main`` in-process (fast); one ``--data --steps`` run goes
through the installed console script in a subprocess.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from clihelp import assert_one_line_error
from diagnostics.result import COLUMNS
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
    assert tuple(tidy.columns) == COLUMNS  # the one schema
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
    base = dict(scheme="cs336", depth=8, width=128, seeds=3, data="uniform random tokens", vocab_size=256, initial_loss=5.9, ln_vocab=math.log(256),
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


def test_compare_table_title_names_the_tokens_and_fits_80_columns_with_early_loss():
    s = _summary(early_loss=4.2, steps=200, data="tokens.npy (1,234 tokens)", vocab_size=1000,
                 ln_vocab=math.log(1000), scheme="zero-residual", verdict="non_finite",
                 slope_forward_low=0.1931, slope_forward_high=0.2131)  # a symmetric interval, as t_interval gives
    s.loc[1, ["width", "slope_forward_low"]] = [256, float("nan")]
    for width in (80, 120):
        buf = io.StringIO()
        Console(width=width, file=buf, color_system=None).print(CompareTable(s))
        lines = buf.getvalue().splitlines()
        assert max(len(line) for line in lines) <= width
        assert lines[1].strip() == "tokens: tokens.npy (1,234 tokens); vocabulary 1,000"
        assert "ln V = 6.908" in " ".join(lines)
        row = next(line for line in lines if line.startswith("zero-residual")).split()
        assert row[1:3] == ["8", "128"] and "4.200" in row and "non-finite" in row  # nothing squeezed out
        # narrow: the symmetric 99% intervals as half-widths, so loss@200 fits
        assert ("+0.20±0.01" in row) == (width < 100) and ("[+0.19," in row) == (width >= 100)


# ----------------------------------------------------------------------------- --data


def _snapshot(*paths: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths if p.is_file()}


def test_compare_on_a_token_file_sizes_the_vocabulary_to_it(capsys, tmp_path):
    data, csv = tmp_path / "ids.npy", tmp_path / "tidy.csv"
    np.save(data, (np.arange(4000) * 7919) % 1000)  # ids 0..999
    before = _snapshot(data)
    code, out, err = run_cli(capsys, "--schemes", "cs336", "--depths", "1", "--widths", "32", "--seeds", "2",
                             "--data", data, "--csv", csv, "--no-progress", "--width", "100")
    assert code == 0, err
    flat = "".join(out.split())  # a long tmp path may wrap anywhere, even inside itself
    assert "".join(f"tokens: {data} (4,000 tokens); vocabulary 1,000".split()) in flat
    assert "lnV=6.908" in flat
    loss = float(next(line for line in out.splitlines() if line.startswith("cs336")).split()[2])
    assert abs(loss - math.log(1000)) < 0.5  # the loss at init is against the vocabulary actually built
    assert set(pd.read_csv(csv)["seed"]) == {0, 1}
    assert _snapshot(data) == before


@pytest.mark.parametrize("name, content, extra, phrases", [
    ("missing.npy", None, [], ["missing.npy", "no such file"]),
    ("empty.txt", b"", [], ["empty.txt", "empty file"]),
    ("tokens.csv", b"1,2,3\n" * 20, [], ["unknown suffix '.csv'", ".npy, .bin (uint16) or .txt"]),
    ("broken.npy", b"not an array" * 10, [], ["not a readable .npy", "np.save"]),
    ("odd.bin", b"\x01" * 101, [], ["odd byte count", "uint16"]),
    ("matrix.npy", np.zeros((4, 40), dtype=np.int64), [], ["2-D int64", "1-D integer array"]),
    ("wide.npy", np.array([1, 2, 300, 4] * 10), ["--vocab-size", "256"],
     ["token id 300", "[0, 256)", "use --vocab-size 301 or more", "leave --vocab-size out"]),
    ("negative.npy", np.array([1, 2, -3, 4] * 10), [], ["token id -3 is negative"]),
    ("huge.npy", np.array([1, 2, 1 << 24, 4] * 10), [], ["16,777,216", "do not look like token ids"]),
    ("short.txt", b"0123456789", [], ["10 tokens are fewer than the 33", "at least 33 tokens"]),
])
def test_bad_data_is_one_line_and_the_file_untouched(capsys, tmp_path, name, content, extra, phrases):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        np.save(path, content)
    before = _snapshot(path)
    code, out, err = run_cli(capsys, "--schemes", "cs336", "--depths", "1", "--widths", "32", "--seeds", "1",
                             "--data", path, *extra, "--no-progress")
    assert_one_line_error(code, err, *phrases)
    assert out == "" and _snapshot(path) == before


def test_data_is_never_an_output(capsys, tmp_path):
    data = tmp_path / "ids.npy"
    np.save(data, np.arange(100))
    before = _snapshot(data)
    for flag in ("--csv", "--plot"):
        code, _, err = run_cli(capsys, "--data", data, flag, data, "--no-progress")
        assert_one_line_error(code, err, flag, "--data file itself")
    code, _, err = run_cli(capsys, "--data", tmp_path, "--no-progress")
    assert_one_line_error(code, err, "is a directory")
    code, _, err = run_cli(capsys, "--vocab-size", "0", "--no-progress")
    assert_one_line_error(code, err, "--vocab-size")
    assert _snapshot(data) == before


def test_end_to_end_data_and_steps_through_the_console_script(tmp_path):
    """``tinylm compare --data notes.txt --steps 2`` in a fresh interpreter: the table names the file,
    has the loss after 2 steps, fits 80 columns, and the file is read, never written."""
    data = tmp_path / "notes.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 30)
    before = _snapshot(data)  # run in tmp_path, the file named relatively: a short title line
    exe = Path(sys.executable).with_name("tinylm")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from reports.cli import main; sys.exit(main())"]
    cmd += ["compare", "--data", "notes.txt", "--steps", "2", "--schemes", "zero-residual", "--depths", "1",
            "--widths", "32", "--seeds", "2", "--width", "80"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1].strip() == "tokens: notes.txt (1,320 tokens); vocabulary 256"
    assert "loss@2" in r.stdout and max(len(line) for line in lines) <= 80
    rows = [line.split() for line in lines if line.startswith("zero-residual")]
    assert len(rows) == 1 and rows[0][:2] == ["zero-residual", "1"]
    assert float(rows[0][-2]) < float(rows[0][2])  # loss@2 below the loss at init (5.561 < 5.580 measured)
    assert r.stderr == "" and _snapshot(data) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_compare_table_falls_back_to_a_narrower_layout_rather_than_truncate():
    """At 100 columns a long scheme name, a wide interval and a loss@N column overflow the wide
    layout: the table takes the compact one instead of cutting cells with an ellipsis."""
    s = _summary(early_loss=4.2, steps=5, scheme="zero-residual", slope_backward_low=-11.54, slope_backward_high=11.05)
    for width, form in ((100, "-0.24 [-11.54,+11.05]"), (110, "-0.245 [-11.54, +11.05]")):
        buf = io.StringIO()
        Console(width=width, file=buf, color_system=None).print(CompareTable(s))
        out = buf.getvalue()
        assert max(len(line) for line in out.splitlines()) <= width and "…" not in out
        assert form in out and "exploding" in out
