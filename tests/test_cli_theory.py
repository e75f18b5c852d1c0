"""``diagnose --theory off``: measurement only, said so on the page and in the JSON; and theory that
fails (or is off) leaves the verdict and the exit code as they are. The intervals say what they cover."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import tinylm
from reports.cli import EXIT_FINDINGS, EXIT_OK, main
from tinylm import checkpoint

SMALL = ["--batch-size", "2", "--batches", "2", "--no-progress", "--width", "120"]


def save(path, **changes):
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=3, num_heads=4, d_ff=64,
                                **changes)
    checkpoint.save(path, tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)))
    return path


def run(capsys, *argv):
    code = main(["diagnose", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("word", ["off", "none"])
def test_theory_off_measures_only_and_says_so(tmp_path, capsys, word):
    ckpt = save(tmp_path / "m.pt")
    code, out, err = run(capsys, ckpt, "--theory", word, "--json", tmp_path / "r.json", *SMALL)
    assert code == EXIT_OK, err
    assert "off: measurement only, no predictions" in out and "theory off: measurement only" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("tensor"))
    assert "pred" not in header and "ratio" not in header and "fwd" in header and "grad" in header
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["header"]["theory"] == "off" and doc["theory"] == []
    column = doc["columns"].index("predicted")
    assert all(row[column] is None for row in doc["rows"])


def test_the_page_says_what_the_intervals_cover(tmp_path, capsys):
    code, out, _ = run(capsys, save(tmp_path / "m.pt"), "--theory", "global", *SMALL)
    assert code == EXIT_OK
    assert "99% intervals over 2 batches of one weight draw (batch noise, not the draw)" in " ".join(out.split())


def test_theory_never_changes_the_exit_code(tmp_path, capsys, monkeypatch):
    """An exploding model (no norm) with --check: exit 1 with theory, without it, and when theory fails."""
    ckpt = save(tmp_path / "x.pt", norm="none", init="kaiming")
    codes = {word: run(capsys, ckpt, "--check", "--theory", word, *SMALL)[0] for word in ("auto", "off")}
    D = importlib.import_module("diagnostics.jobs.diagnose")

    def broken(*a, **k):
        raise ValueError("a failure inside theory")

    monkeypatch.setattr(D, "predict", broken)
    with pytest.warns(RuntimeWarning, match="could not be computed"):
        codes["broken"] = run(capsys, ckpt, "--check", *SMALL)[0]
    assert codes == {"auto": EXIT_FINDINGS, "off": EXIT_FINDINGS, "broken": EXIT_FINDINGS}
