"""The command line as a user meets it: early checks without torch, "did you mean", exit codes,
a CS336 checkpoint in one try, the tokens diagnose measures, --threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tinylm
from reports import cli
from reports.cli import main
from tinylm import checkpoint
from clihelp import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]
SMALL = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FAST = ["--batch-size", "1", "--batches", "2", "--seq-len", "4", "--no-progress"]


def _in_subprocess(argv: list[str], cwd: Path) -> tuple[int, bool, str]:
    """Run ``main(argv)`` in a fresh interpreter: (exit code, whether torch got imported, stderr)."""
    code = textwrap.dedent(f"""
        import sys
        from reports.cli import main
        code = main({argv!r})
        print("RESULT", code, "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, timeout=120)
    exit_code, imported = proc.stdout.split("RESULT")[-1].split()
    return int(exit_code), imported == "True", proc.stderr


def test_usage_errors_are_found_before_torch_is_imported(tmp_path):
    """Mistyped flags, bad output suffixes, missing inputs, unknown presets and schemes: exit 2 with
    torch never imported (so the answer takes a fraction of a second)."""
    cases = [
        (["diagnose", "--bogus"], "unrecognized"),
        (["diagnose", "--plot", "r.txt"], "--plot r.txt"),
        (["diagnose", "missing.pt"], "no such file"),
        (["diagnose", "--device", "gpu"], "--device gpu"),
        (["diagnose", "--json", "r.csv"], "--json r.csv"),
        (["init", "--preset", "tinny", "-o", "m.pt"], "did you mean 'tiny'"),
        (["train", "--init", "gpt3", "-o", "m.pt"], "did you mean 'gpt2'"),
        (["train", "-o", "m.pt", "--watch-csv", "w.json"], "--watch-csv w.json"),
        (["compare", "--schemes", "cs336,kaiming2"], "kaiming2"),
        (["compare", "--plot", "grid.txt"], "--plot grid.txt"),
        (["props", "--workers", "2"], "--mutate only"),
        (["diagnse"], "did you mean 'diagnose'"),
    ]
    for argv, phrase in cases:
        code, imported, err = _in_subprocess(argv, tmp_path)
        assert_one_line_error(code, err, phrase)
        assert not imported, (argv, "imported torch before refusing the flags")
    # the check can fail: a command that does its work imports torch
    code, imported, err = _in_subprocess(["init", "-o", "m.pt"], tmp_path)
    assert code == 0 and imported, err


def test_did_you_mean_for_commands_flags_and_choices(capsys):
    for argv, phrase in [(["diagnse"], "did you mean 'diagnose'?"),
                         (["diagnose", "--devcie", "cpu"], "did you mean '--device'?"),
                         (["diagnose", "--dtype", "bfloat61"], "did you mean 'bfloat16'?"),
                         (["compare", "--schemes", "small_init"], "did you mean 'small-init'?")]:
        code = main(argv)
        assert_one_line_error(code, capsys.readouterr().err, phrase)
    # nothing close: no guess
    assert main(["diagnose", "--zzzzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def _dict_keys(path: Path, name: str) -> tuple[str, ...]:
    """The keys of the module-level dict literal ``name`` in ``path`` (as written, whatever other
    tests registered since)."""
    import ast

    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name:
            return tuple(k.value for k in node.value.keys)
    raise AssertionError(f"no {name} in {path}")


def test_the_offered_presets_and_schemes_are_tinylms():
    assert cli.PRESET_NAMES == _dict_keys(ROOT / "tinylm" / "config.py", "PRESETS") == tuple(tinylm.PRESETS)
    assert cli.SCHEME_NAMES == _dict_keys(ROOT / "tinylm" / "init.py", "SCHEMES")
    assert set(cli.SCHEME_NAMES) <= set(tinylm.init.SCHEMES)


def test_threads_flag_sets_torchs_threads(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["init", "--threads", "1", "-o", str(tmp_path / "m.pt")]) == 0
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert main(["--threads", "1", "init", "-o", str(tmp_path / "m2.pt")]) == 0  # before the verb too
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert_one_line_error(main(["init", "--threads", "0", "-o", str(tmp_path / "n.pt")]), capsys.readouterr().err,
                          "--threads")


def test_train_exits_4_when_it_stops_on_a_nonfinite_loss(tmp_path, capsys):
    data = tmp_path / "d.npy"
    np.save(data, (np.arange(3000) * 7) % 256)
    base = ["train", "--preset", "tiny", "--vocab-size", "256", "--steps", "3", "--batch-size", "1", "--warmup", "0",
            "--data", str(data), "--quiet", "--force", "-o"]
    assert main([*base, str(tmp_path / "nan.pt"), "--lr", "1e30"]) == cli.EXIT_NONFINITE == 4
    assert "non-finite loss" in capsys.readouterr().out
    assert (tmp_path / "nan.pt").exists()
    assert main([*base, str(tmp_path / "ok.pt"), "--lr", "1e-3"]) == 0  # the same run at a sane rate


def test_a_bare_cs336_state_dict_names_every_missing_flag_with_a_command(tmp_path, capsys):
    path = tmp_path / "bare.pt"
    torch.save(tinylm.TransformerLM(SMALL).state_dict(), path)
    code = main(["diagnose", str(path), *FAST])
    err = capsys.readouterr().err
    assert_one_line_error(code, err, "--num-heads", "--context-length", "--rope-theta", f"diagnose {path} --num-heads")
    assert "d_model=16" in err
    # one given: only the others are asked for, and the command keeps the one given
    code = main(["diagnose", str(path), "--num-heads", "2", *FAST])
    err = capsys.readouterr().err
    assert_one_line_error(code, err, "--context-length", "--rope-theta", "--num-heads 2")
    assert "not --context-length, --rope-theta" in err
    # the command it gives runs (with this model's real values in place of the examples)
    assert main(["diagnose", str(path), "--num-heads", "2", "--context-length", "8", "--rope-theta", "10000",
                 *FAST]) == 0
    # the library says the same in one error
    with pytest.raises(checkpoint.MissingOptionsError) as e:
        checkpoint.load(path)
    assert e.value.missing == ["num_heads", "context_length", "rope_theta"]


def test_a_whole_pickled_module_names_unsafe_load_and_its_risk(tmp_path, capsys):
    model = tinylm.TransformerLM(SMALL)
    for legacy in (False, True):
        path = tmp_path / f"module{legacy}.pt"
        torch.save(model, path, _use_new_zipfile_serialization=not legacy)
        code = main(["diagnose", str(path), *FAST])
        assert_one_line_error(code, capsys.readouterr().err, "--unsafe-load", "runs the code", "torch.save(model)")


def _confident(path: Path) -> None:
    """A checkpoint whose predictions are far from uniform (a trained model's shape, cheaply)."""
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    checkpoint.save(path, model)


def test_random_tokens_are_said_and_a_loss_above_ln_v_is_explained(tmp_path, capsys):
    ckpt = tmp_path / "confident.pt"
    _confident(ckpt)
    assert main(["diagnose", str(ckpt), *FAST, "--width", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "uniform random tokens" in out and "pass --data PATH" in out
    assert "above ln V because the tokens are random" in out
    # a fresh model is measured on random tokens too, without the note for trained checkpoints
    assert main(["diagnose", *FAST, "--width", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "uniform random tokens" in out and "above ln V because" not in out and "pass --data" not in out


def test_diagnose_uses_the_training_data_a_checkpoint_recorded(tmp_path, capsys):
    data = tmp_path / "d.npy"
    np.save(data, (np.arange(3000) * 7) % 256)
    run = tmp_path / "run.pt"
    assert main(["train", "--preset", "tiny", "--vocab-size", "256", "--steps", "1", "--batch-size", "1",
                 "--data", str(data), "--quiet", "-o", str(run)]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(run), *FAST, "--width", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{data.resolve()} (3,000 tokens), the training data the checkpoint recorded" in out
    assert "uniform random tokens" not in out
    # --data overrides it; a recorded file that is gone falls back to random tokens, saying so
    other = tmp_path / "other.npy"
    np.save(other, np.arange(500) % 256)
    assert main(["diagnose", str(run), "--data", str(other), *FAST, "--width", "200"]) == 0
    assert f"{other} (500 tokens)" in " ".join(capsys.readouterr().out.split())
    data.unlink()
    assert main(["diagnose", str(run), *FAST, "--width", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "uniform random tokens" in out and "is gone" in out


class _ClosedPipe:
    """A stdout whose reader has gone away, as under ``tinylm ... | head``."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def _printing_verb(monkeypatch) -> None:
    """Stand a verb in that prints a report and succeeds (argparse's own --help swallows OSError)."""
    import argparse

    def run(args) -> int:
        print("a report line")
        return 0

    ns = argparse.Namespace(verb="report", _parser=argparse.ArgumentParser(), _check=None, threads=None, threads_first=None, _run=run)
    monkeypatch.setattr(cli, "_parse", lambda parser, argv: ns)


def test_closed_pipe_exits_quietly_with_141(monkeypatch, capsys):
    _printing_verb(monkeypatch)
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["report"]) == cli.EXIT_PIPE == 141
    assert "internal error" not in capsys.readouterr().err


def test_open_pipe_control_exits_0(monkeypatch, capsys):
    _printing_verb(monkeypatch)
    assert main(["report"]) == 0
    assert "a report line" in capsys.readouterr().out
