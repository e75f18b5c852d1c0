"""Nothing the user owns is overwritten: every output path against every input and each other."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tinylm
from reports.cli import main
from reports.intake import check_outputs
from reports.cli import UsageError
from tinylm import checkpoint

SMALL = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FAST = ["--batch-size", "1", "--batches", "1", "--seq-len", "4", "--no-progress", "--width", "100"]


@pytest.fixture()
def files(tmp_path):
    ckpt = tmp_path / "m.pt"
    checkpoint.save(ckpt, tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0)))
    data = tmp_path / "d.npy"
    np.save(data, np.arange(200, dtype=np.int64) % 300)
    return ckpt, data


def _snapshot(*paths):
    return [(p.read_bytes(), p.stat().st_mtime_ns) for p in paths]


def assert_refused(capsys, argv, phrase, *untouched):
    before = _snapshot(*untouched)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and phrase in err and len(err.splitlines()) == 1, (code, err)
    assert _snapshot(*untouched) == before


def test_train_never_writes_over_its_data_even_with_force(files, capsys):
    ckpt, data = files
    assert_refused(capsys, ["train", "--preset", "tiny", "--data", data, "-o", data, "--force", "--steps", "1"],
             "is the --data file itself", data)
    assert_refused(capsys, ["train", "--preset", "tiny", "--data", data, "-o", ckpt.parent / "new.pt",
                      "--watch-json", data, "--steps", "1"], "is the --data file itself", data)


def test_train_never_writes_the_watch_over_the_resumed_checkpoint(files, capsys):
    ckpt, data = files
    assert_refused(capsys, ["train", "--resume", ckpt, "--data", data, "-o", ckpt, "--watch-csv", ckpt, "--steps", "3"],
             "is the --resume checkpoint itself", ckpt, data)


def test_diagnose_refuses_a_derived_output_over_an_input(files, capsys, tmp_path):
    ckpt, data = files
    renamed = tmp_path / "p.training.png"
    os.link(ckpt, renamed)  # the derived training plot of --plot p.png would land on the checkpoint
    assert_refused(capsys, ["diagnose", renamed, "--plot", tmp_path / "p.png", *FAST], "is the checkpoint itself", ckpt)


def test_a_symlink_or_dotdot_path_to_an_input_is_the_input(files, capsys, tmp_path):
    ckpt, data = files
    link = tmp_path / "out.json"
    link.symlink_to(ckpt)
    assert_refused(capsys, ["diagnose", ckpt, "--json", link, *FAST], "is the checkpoint itself", ckpt)
    sub = tmp_path / "sub"
    sub.mkdir()
    assert_refused(capsys, ["diagnose", ckpt, "--csv", sub / ".." / "d.npy", "--data", data, *FAST],
             "is the --data file itself", data)


def test_an_output_replaces_only_a_file_of_its_own_kind(files, capsys, tmp_path):
    ckpt, _ = files
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    assert_refused(capsys, ["diagnose", ckpt, "--json", other, *FAST], "is not a json file", other)
    old = tmp_path / "old.json"
    old.write_text("{}")
    assert main(["diagnose", str(ckpt), "--json", str(old), *FAST]) == 0  # a previous report is replaced
    assert old.read_text() != "{}"


def test_an_output_under_a_regular_file_is_a_usage_error(files, capsys, tmp_path):
    ckpt, _ = files
    assert_refused(capsys, ["diagnose", ckpt, "--json", ckpt / "out.json", *FAST], "is a file, not a directory", ckpt)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes in any directory")
def test_an_output_in_a_read_only_directory_is_a_usage_error(files, capsys, tmp_path):
    ckpt, _ = files
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert_refused(capsys, ["diagnose", ckpt, "--json", ro / "r.json", *FAST], "permission denied", ckpt)
    finally:
        ro.chmod(0o700)


def test_force_replaces_a_previous_output_and_may_replace_names_the_exception(tmp_path):
    out = tmp_path / "run.pt"
    out.write_bytes(b"old")
    with pytest.raises(UsageError, match="exists; pass --force"):
        check_outputs({"-o": str(out)}, {}, force=False)
    check_outputs({"-o": str(out)}, {}, force=True)
    with pytest.raises(UsageError, match="is the --resume checkpoint itself"):
        check_outputs({"-o": str(out)}, {"--resume checkpoint": str(out)}, force=True)
    check_outputs({"-o": str(out)}, {"--resume checkpoint": str(out)}, force=False,
                  may_replace={"-o": "--resume checkpoint"})  # writing a resumed run back over its checkpoint
    with pytest.raises(UsageError, match="both write"):
        check_outputs({"--json": str(tmp_path / "a.json"), "--csv": str(tmp_path / "x" / ".." / "a.json")}, {})


def _checkpoint_with_history(path):
    from diagnostics.jobs.watch import Watch
    from tinylm.functional import cross_entropy

    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    watch = Watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for t in range(3):
        batch = torch.randint(0, 300, (2, 9), generator=gen)
        with watch.capture():
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
        before = watch.snapshot_params()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.commit(t, float(loss.detach()), 0.1, 1.0, before=before)
        watch.log(t, float(loss.detach()), 0.1, 1.0)
    checkpoint.save(path, model, iteration=3, history=watch.history)


def test_a_derived_plot_never_replaces_a_file_the_user_has(tmp_path, capsys):
    ckpt = tmp_path / "trained.pt"
    _checkpoint_with_history(ckpt)
    mine = tmp_path / "r.training.png"
    mine.write_bytes(b"\x89PNG the user's own figure")
    os.utime(mine, ns=(1_000_000_000, 1_000_000_000))
    code = main(["diagnose", str(ckpt), "--plot", str(tmp_path / "r.png"), *FAST])
    err = capsys.readouterr().err
    assert code == 0, err
    assert _snapshot(mine) == [(b"\x89PNG the user's own figure", 1_000_000_000)]
    note = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "r.training.png exists and is kept" in note[0] and "r.training-2.png" in note[0]
    assert (tmp_path / "r.training-2.png").stat().st_size > 1000 and "r.training-2.png" in err.splitlines()[-1]


def test_free_path(tmp_path):
    from reports.export import free_path

    target = tmp_path / "a.training.png"
    assert free_path(target) == str(target)
    target.write_bytes(b"x")
    assert free_path(target) == str(tmp_path / "a.training-2.png")
    (tmp_path / "a.training-2.png").write_bytes(b"x")
    assert free_path(target) == str(tmp_path / "a.training-3.png")
