"""tinylm coord-check: its flags, exit codes, outputs and a user's own model (--impl)."""

from __future__ import annotations

import json
import textwrap

import pandas as pd
import pytest

from clihelp import assert_one_line_error
from reports.cli import main

SMALL = ["--widths", "32,64,128", "--steps", "3", "--num-layers", "1", "--threads", "1"]


@pytest.mark.parametrize("argv, phrase", [
    (["coord-check", "--widths", "64"], "at least two distinct widths"),
    (["coord-check", "--widths", "64,x"], "'x' is not an integer"),
    (["coord-check", "--plot", "p.txt"], "--plot p.txt"),
    (["coord-check", "--impl", "model.py"], "path/to/file.py:factory"),
    (["coord-check", "--impl", "missing.py:make"], "is not a file"),
    (["coord-check", "--parametrization", "np"], "invalid choice"),
])
def test_usage_errors(argv, phrase, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    assert_one_line_error(code, capsys.readouterr().err, phrase)


def test_mup_passes_sp_fails_with_check_and_outputs(capsys, tmp_path):
    csv, js, png = tmp_path / "c.csv", tmp_path / "c.json", tmp_path / "c.png"
    assert main(["coord-check", *SMALL, "--check", "--csv", str(csv), "--json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("coord check: ok")
    frame = pd.read_csv(csv)
    assert list(frame.columns) == ["width", "seed", "step", "site", "kind", "quantity", "value"]
    assert json.loads(js.read_text())["ok"] is True and png.stat().st_size > 1000
    assert main(["coord-check", *SMALL, "--parametrization", "sp", "--check"]) == 1
    assert "depart from muP" in capsys.readouterr().out.splitlines()[0]
    assert main(["coord-check", "--widths", "32,64", "--steps", "1", "--num-layers", "1",
                 "--parametrization", "sp"]) == 0  # without --check: done


def test_impl_factory(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent("""
        import tinylm

        def make(width):
            return tinylm.TransformerLM(tinylm.ModelConfig(
                vocab_size=64, context_length=32, d_model=width, num_layers=1, num_heads=4, d_ff=2 * width,
                parametrization="mup", mup_base_width=32))

        def make_optimizer(model, width):
            import torch
            return torch.optim.Adam(tinylm.mup.param_groups(model, 1e-2))
    """))
    assert main(["coord-check", *SMALL, "--impl", f"{path}:make", "--check"]) == 0
    assert capsys.readouterr().out.startswith("coord check: ok")
    code = main(["coord-check", *SMALL, "--impl", f"{path}:nothing"])
    assert_one_line_error(code, capsys.readouterr().err, "defines no callable 'nothing'")
