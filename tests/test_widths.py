"""Reports at 60, 80 and 120 columns: every number whole, the key columns present.

Each report is rendered from a real (small) run to a fixed-width console. A number that
rich had to shrink ends in an ellipsis (``5.7e…``); none may. A negative control renders
the widest layout into a narrow console and shows the check catches exactly that.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

import tinylm
from diagnostics import DiagnoseOptions, diagnose
from diagnostics import CompareOptions, compare
from props.runner import PropertyResult, SuiteRun
from reports.cli import main
from tinylm import checkpoint
from reports.fmt import num
from reports.props_view import render_suite, suite_table
from reports.render import SUMMARY_KINDS, AttentionTable, LayerTable, ReportContext, report
from reports.render_compare import CompareTable, compare_table

WIDTHS = (60, 80, 120)
NUMBER = re.compile(r"^[-+]?(\d+(\.\d+)?(e[-+]?\d+)?|nan|inf)\*?$")


def render(obj, width: int) -> str:
    buf = io.StringIO()
    Console(width=width, file=buf, color_system=None).print(obj)
    return buf.getvalue()


def assert_whole(text: str, width: int) -> None:
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width


def table_rows(text: str, title: str) -> tuple[str, list[list[str]]]:
    """The header line and the rows (split on spaces) of the table titled ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    header = lines[start + 1]
    rows = []
    for line in lines[start + 3:]:
        if not line.strip() or not line.startswith((" ", "L", "l", "t")) or "=" in line:
            break
        rows.append(line.split())
    return header, rows


@pytest.fixture(scope="module")
def exploding():
    """An 8-block model without norms: variances up to ~1e74 and non-finite scores (long exponents)."""
    cfg = tinylm.preset("tiny", norm="none", num_layers=8)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0)).eval()
    return diagnose(model, None, DiagnoseOptions(batch_size=1, seq_len=16, batches=4, seeds=1, seed=0))


def test_diagnose_report_keeps_every_number_whole(exploding):
    biggest = max(r.var for r in exploding.tensors
                  if r.direction == "forward" and r.var == r.var and r.kind in SUMMARY_KINDS)
    for width in WIDTHS:
        out = render(report(exploding, ReportContext(source="m.pt")), width)
        assert_whole(out, width)
        header, rows = table_rows(out, "Per layer")
        for col in ("tensor", "fwd", "ratio", "grad", "flags"):
            assert col in header, (width, header)
        assert rows and all(NUMBER.match(row[1]) for row in rows), (width, rows)  # the fwd column
        assert any(num(biggest, d) in out for d in (1, 2, 3)), (width, biggest)  # exponent and all
        att = out[out.index("Attention and rank collapse"):]
        att_header = next(line for line in att.splitlines() if line.lstrip().startswith(("block", "blk")))
        assert "cos" in att_header and "flags" in att_header


def test_the_check_catches_a_cut_number(exploding):
    """Negative control: the widest per-layer and attention layouts forced into 60 columns are cut."""
    assert "…" in render(LayerTable(exploding).table(120), 60)
    assert "…" in render(AttentionTable(exploding).layouts()[0](), 50)


@pytest.fixture(scope="module")
def summary():
    _, summary = compare(CompareOptions(schemes=["cs336", "small-init", "zero-residual"], depths=[2, 4], widths=[16, 32],
                                        seeds=2, steps=1, seed=0))
    return summary


def test_compare_report_keeps_every_number_whole(summary):
    for width in WIDTHS:
        out = render(CompareTable(summary), width)
        assert_whole(out, width)
        header = next(line for line in out.splitlines() if line.startswith("scheme"))
        for col in ("scheme", "L", "loss", "fwd slope", "bwd slope", "verdict"):
            assert col in header, (width, header)
        assert "zero-residual" in out.replace("\n", "")
    assert "…" in render(compare_table(summary, 120, "wide"), 60)  # negative control


def _suite() -> SuiteRun:
    rows = [
        PropertyResult("softmax_shift_invariance_over_every_float_range", "test_softmax",
                       "softmax(z + c) = softmax(z) for every shift c within the float range", "passed", 25,
                       1.234567e-12, 4.892e-7, "|z|", 1e-6),
        PropertyResult("truncnorm_samples", "test_init", "Var = 0.97334 s^2", "failed", 3, 7.123e+11, 4.89, "|z|", 1e-6,
                       message="Var(x) = 1: |z|=7.1e11 vs 4.89", example="dtype=torch.bfloat16, data=[1.5, -0.25]"),
        PropertyResult("rope_formula_and_norm", "test_attention", "RoPE rotates pairs", "skipped",
                       message="implementation 'mine' provides no rope", missing=("rope",)),
    ]
    return SuiteRun(rows, seconds=12.3, returncode=1, impl="mine", profile="ci", max_examples=25)


def test_props_report_keeps_every_number_whole():
    run = _suite()
    for width in WIDTHS:
        for verbose in (False, True):
            out = render(render_suite(run, verbose=verbose), width)
            assert_whole(out, width)
            flat = " ".join(out.split())
            assert "truncnorm_samples" in out  # a name whole on its line
            assert "7.12e+11" in flat and "4.89" in flat and "truncnorm_samples" in flat
            assert "example dtype=torch.bfloat16" in flat and "rope (1)" in flat
            if verbose:
                header = next(line for line in out.splitlines() if "worst" in line)
                for col in ("property", "worst", "tol.", "result"):
                    assert col in header, (width, header)
                assert "1.23e-12 |z|" in flat
    # negative control: the boxed table squeezed into 60 columns folds names into slivers
    assert "truncnorm_samples" not in render(suite_table(run, 120), 60)


def test_exports_are_laid_out_wide_whatever_the_terminal(tmp_path, capsys):
    """--html and --svg from a script (an 80-column console) are rendered at 120 columns: the wide
    per-layer headings ("fwd var") are in the files and not on the narrow terminal."""
    ckpt = tmp_path / "m.pt"
    cfg = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
    checkpoint.save(ckpt, tinylm.TransformerLM(cfg))
    html, svg = tmp_path / "r.html", tmp_path / "r.svg"
    assert main(["diagnose", str(ckpt), "--batch-size", "1", "--batches", "2", "--seq-len", "4", "--no-progress",
                 "--width", "80", "--html", str(html), "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "fwd var" not in out and "fwd" in out
    assert "fwd var" in html.read_text()
    assert "fwd&#160;var" in svg.read_text() or "fwd var" in svg.read_text()
