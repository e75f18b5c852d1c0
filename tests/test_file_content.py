"""Every file a verb writes is read back by its content, whatever its name: fingerprints (diff),
checkpoints (torch.save's zip or safetensors, under each other's suffix or none), and a file of
one kind handed where another is read is told apart in one line."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import diagnostics
import tinylm
from reports.cli import main
from tinylm import checkpoint
from tinylm.errors import CheckpointError

SMALL = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
DIFF = ["--batch-size", "1", "--seq-len", "4", "--k", "4", "--width", "100"]


def is_fingerprint_file(path):
    from reports.intake import is_fingerprint_file as told

    return told(path)


def _model(seed=0):
    return tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(seed))


@pytest.fixture()
def ckpt(tmp_path):
    path = tmp_path / "m.pt"
    checkpoint.save(path, _model())
    return path


def _one_line_error(capsys, argv, phrase):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and phrase in err and len(err.splitlines()) == 1, (code, err)


def test_a_fingerprint_under_any_name_is_diffed(tmp_path, ckpt, capsys):
    opts = diagnostics.DiffOptions(batch_size=1, seq_len=4, k=4)
    a = diagnostics.fingerprint(_model(), options=opts).save(tmp_path / "a.fp")
    b = diagnostics.fingerprint(_model(), options=opts).save(tmp_path / "b")  # no suffix at all
    assert a.name == "a.fp" and b.name == "b"  # written where named, no suffix added
    assert main(["diff", str(a), str(b), "--check", "--width", "100"]) == 0, capsys.readouterr().err
    assert main(["diff", str(ckpt), str(a), "--check", *DIFF]) == 0, capsys.readouterr().err
    assert "fingerprint" in capsys.readouterr().out
    saved = tmp_path / "c.sketch"
    assert main(["diff", str(ckpt), "--save", str(saved), *DIFF]) == 0
    assert is_fingerprint_file(saved) and diagnostics.Fingerprint.load(saved).meta["k"] == 4


def test_content_not_suffix_decides(tmp_path, ckpt):  # negative controls: a zip or an .npz is not enough
    assert not is_fingerprint_file(ckpt)  # torch.save's zip
    np.savez(tmp_path / "arrays.npz", x=np.zeros(3))
    assert not is_fingerprint_file(tmp_path / "arrays.npz")
    shutil.copy(ckpt, tmp_path / "model.npz")
    assert not is_fingerprint_file(tmp_path / "model.npz")
    model, info = checkpoint.load(tmp_path / "model.npz")  # a checkpoint under a fingerprint's suffix
    assert info.format == "tinylm"


def test_a_fingerprint_where_a_checkpoint_is_read_says_so(tmp_path, capsys):
    fp = diagnostics.fingerprint(_model(), options=diagnostics.DiffOptions(batch_size=1, seq_len=4, k=4))
    path = fp.save(tmp_path / "run.pt")
    _one_line_error(capsys, ["diagnose", path, "--no-progress"], "is a fingerprint (written by tinylm diff --save)")
    _one_line_error(capsys, ["diff", path, "--against", "bf16"], "is a fingerprint, which cannot be run again")
    with pytest.raises(CheckpointError, match="is a NumPy .npz archive, not a checkpoint"):
        checkpoint.load(path)


def test_save_replaces_a_fingerprint_only(tmp_path, ckpt, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    _one_line_error(capsys, ["diff", ckpt, "--save", other, *DIFF], "exists and is not a fingerprint")
    assert other.read_text() == "mine"
    old = tmp_path / "old.fp"
    assert main(["diff", str(ckpt), "--save", str(old), *DIFF]) == 0
    assert main(["diff", str(ckpt), "--save", str(old), "--seed", "1", *DIFF]) == 0
    assert diagnostics.Fingerprint.load(old).meta["seed"] == 1


@pytest.mark.parametrize("written,named", [("m.pt", "m.safetensors"), ("m.safetensors", "m.pt"),
                                           ("m.safetensors", "m"), ("m.pt", "m.weights")])
def test_a_checkpoint_under_another_name_loads(tmp_path, written, named):
    model = _model(3)
    checkpoint.save(tmp_path / written, model)
    (tmp_path / written).rename(tmp_path / named)
    loaded, info = checkpoint.load(tmp_path / named)
    assert info.format == ("safetensors" if written.endswith(".safetensors") else "tinylm")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
