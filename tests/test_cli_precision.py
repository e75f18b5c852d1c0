"""``tinylm precision``: the report, exports, --check's exit codes, one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

import tinylm
from tinylm import checkpoint

from clihelp import assert_one_line_error


def _cli(*argv):
    from reports.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["precision", "--width", "120", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def outlier_checkpoint(tmp_path_factory):
    """A model whose layer-0 SwiGLU has one hidden unit with w1 and w3 aligned and large: the product
    entering w2 carries an outlier feature (Fishman et al. 2024)."""
    torch.manual_seed(0)
    model = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2,
                                                    num_heads=4, d_ff=128))
    with torch.no_grad():
        aligned = torch.zeros(64)
        aligned[7] = 100.0
        model.layers[0].ffn.w1.weight[3] = aligned
        model.layers[0].ffn.w3.weight[3] = aligned
    path = tmp_path_factory.mktemp("p") / "m.pt"
    checkpoint.save(path, model)
    return path


def test_check_exits_1_on_a_fail_and_exports(outlier_checkpoint, tmp_path):
    code, out, err = _cli(str(outlier_checkpoint), "--recipes", "tensorwise,mxfp8", "--batch-size", "2", "--seq-len", "32", "--check",
                          "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                          "--plot", str(tmp_path / "r.png"))
    assert code == 1, out + err
    assert "tensorwise: keep 1 of 15 in bf16 (layers.0.ffn.w2)" in out and "Smooth-SwiGLU" in out and "┃" in out
    # the predicted training-loss increase beside the SQNR: a column, with figures in it
    assert "loss +" in out and re.search(r"\d\.\de[-+]\d\d", out), out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["keep_in_bf16"] == {"tensorwise": ["layers.0.ffn.w2"], "mxfp8": []}
    assert (tmp_path / "r.csv").read_text().startswith("module,gemm,recipe,sqnr_db")
    assert (tmp_path / "r.png").stat().st_size > 1000 and "wrote json" in err
    # negative control: without --check the same model exits 0
    code, _, _ = _cli(str(outlier_checkpoint), "--recipes", "rowwise", "--batch-size", "1", "--no-theory")
    assert code == 0


@pytest.mark.parametrize("argv, phrase", [
    (["--recipes", "fp8"], "did you mean 'mxfp8'"),
    (["--recipes", ","], "name at least one"),
    (["--plot", "x.txt"], "--plot x.txt"),
    (["--seed", "-1"], "--seed -1"),
    (["nowhere.pt"], "nowhere.pt"),
    (["--seq-len", "100000"], "--seq-len 100000: the model takes at most 256 tokens"),
])
def test_usage_errors_are_one_line(argv, phrase):
    code, _, err = _cli(*argv)
    assert_one_line_error(code, err, phrase)


def test_recipe_names_match_the_library():
    from diagnostics.measure.quant import RECIPES
    from reports.cmd_precision import RECIPE_NAMES

    assert RECIPE_NAMES == tuple(RECIPES)
