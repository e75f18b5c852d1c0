"""--width below the narrowest report is refused in one line (exit 2, before torch loads); at the
floor itself the report is drawn whole (the negative control: the floor is not set too high)."""

from __future__ import annotations

import re

import pytest
import torch

import tinylm
from reports.cli import main
from reports.intake import MIN_WIDTH
from tinylm import checkpoint

ARGS = {"diagnose": [], "compare": ["--no-progress"], "diff": ["m.pt", "--against", "bf16"], "props": []}


@pytest.mark.parametrize("width", [1, 5, MIN_WIDTH - 1])
@pytest.mark.parametrize("verb", sorted(ARGS))
def test_a_width_below_the_narrowest_report_is_one_line(capsys, verb, width):
    code = main([verb, *ARGS[verb], "--width", str(width)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"argument --width: {width} columns is narrower than the narrowest report" in err
    assert f"give at least {MIN_WIDTH}" in err


def test_at_the_floor_every_line_fits_and_no_number_is_cut(tmp_path, capsys):
    path = tmp_path / "nonorm8.pt"  # long exponents (1e+75) and non-finite scores: the widest numbers drawn
    cfg = tinylm.preset("tiny", norm="none", num_layers=8)
    checkpoint.save(path, tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0)))
    assert main(["diagnose", str(path), "--batch-size", "1", "--batches", "2", "--seq-len", "16", "--no-progress",
                 "--theory", "local", "--width", str(MIN_WIDTH)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= MIN_WIDTH and "…" not in out
    assert "Per layer" in out and "e+75" in out
    assert "non-finite" in out and "saturated" in out  # flag words whole, not folded over two lines
    cut = re.compile(r"^\s*(fini)?te\b|^\s*(ur)?ated\b|non-fini\s*$|satur\s*$", re.M)
    assert not cut.search(out)
    from reports.render import ReportContext, report  # negative control: two columns fewer cut a word
    from diagnostics import DiagnoseOptions, diagnose
    from rich.console import Console
    import io
    model, _ = checkpoint.load(path)
    result = diagnose(model, None, DiagnoseOptions(batch_size=1, batches=2, seq_len=16, theory="local"))
    buf = io.StringIO()
    Console(width=MIN_WIDTH - 2, file=buf, color_system=None).print(report(result, ReportContext()))
    assert cut.search(buf.getvalue())
