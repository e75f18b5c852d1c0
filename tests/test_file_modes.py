"""Every file a verb writes gets the mode the user's umask gives a new file (0o666 & ~umask), and a
file it replaces keeps its own mode, as a plain ``open(path, "w")`` would: reports (--json,
--csv, --html, --svg, --plot), checkpoints, fingerprints, a Hugging Face directory, the watch's
files. The atomic writers write a private temporary file first; its 0o600 must not leak."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

import tinylm
from reports.cli import main
from tinylm import checkpoint

SMALL = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FAST = ["--batch-size", "1", "--batches", "1", "--seq-len", "4", "--no-progress", "--width", "100"]


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _run(capsys, argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 0, err


def test_every_report_and_checkpoint_honours_the_umask(tmp_path, capsys, umask):
    want = 0o666 & ~umask
    ckpt = tmp_path / "m.pt"
    _run(capsys, ["init", "--preset", "tiny", "--num-layers", "1", "--d-model", "16", "-o", ckpt])
    out = {s: tmp_path / f"r.{s}" for s in ("json", "csv", "html", "svg", "png")}
    _run(capsys, ["diagnose", ckpt, *FAST, "--json", out["json"], "--csv", out["csv"], "--html", out["html"],
                  "--svg", out["svg"], "--plot", out["png"]])
    fp, dj, dc = tmp_path / "a.fp", tmp_path / "d.json", tmp_path / "d.csv"
    _run(capsys, ["diff", ckpt, ckpt, "--save", fp, "--json", dj, "--csv", dc, "--batch-size", "1", "--seq-len", "4",
                  "--k", "4", "--width", "100"])
    hf = tmp_path / "hf"
    _run(capsys, ["export", ckpt, "--hf", hf])
    written = [ckpt, *out.values(), fp, dj, dc, hf / "config.json", hf / "model.safetensors"]
    assert {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in written} == \
        {str(p.relative_to(tmp_path)): oct(want) for p in written}


def test_train_and_its_watch_files_honour_the_umask(tmp_path, capsys, umask):
    want = 0o666 & ~umask
    data = tmp_path / "d.npy"
    np.save(data, np.arange(400, dtype=np.int64) % 256)
    os.chmod(data, 0o644)
    paths = {"-o": tmp_path / "t.pt", "--watch-json": tmp_path / "w.json", "--watch-csv": tmp_path / "w.csv"}
    _run(capsys, ["train", "--preset", "tiny", "--num-layers", "1", "--d-model", "16", "--context-length", "8",
                  "--data", data, "--steps", "2", "--batch-size", "2", "--quiet",
                  *[str(a) for kv in paths.items() for a in kv]])
    assert {k: oct(_mode(p)) for k, p in paths.items()} == {k: oct(want) for k in paths}


def test_a_replaced_file_keeps_its_own_mode(tmp_path, umask):
    path = tmp_path / "r.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    checkpoint.atomic_write(path, lambda tmp: open(tmp, "w").write("[]"))
    assert path.read_text() == "[]" and _mode(path) == 0o640
    fresh = tmp_path / "new.pt"
    checkpoint.save(fresh, tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0)))
    assert _mode(fresh) == 0o666 & ~umask  # negative control of the first: a new file follows the umask
