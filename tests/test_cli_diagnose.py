"""The ``diagnose`` command: intake, exit codes, exports, and a few true end-to-end runs.

Most cases call ``reports.cli.main`` in-process (fast); a few run the installed
entry point in a subprocess, including one run of the true default (no argument).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import tinylm
from reports.cli import main
from tinylm import checkpoint

SMALL = ["--batch-size", "2", "--batches", "2", "--no-progress", "--width", "100"]


def small_model(**changes) -> tinylm.TransformerLM:
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                                **changes)
    return tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "model.pt"
    checkpoint.save(path, small_model(), iteration=7)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["diagnose", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- usage errors: one line, exit 2


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinylm: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_output_over_the_checkpoint_is_refused_and_the_file_untouched(capsys, ckpt):
    before, mtime = ckpt.read_bytes(), ckpt.stat().st_mtime_ns
    for flag in ("--json", "--csv", "--html", "--svg", "--plot"):
        code, _, err = run_cli(capsys, ckpt, flag, ckpt, *SMALL)
        _one_line_error(code, err, flag, "checkpoint itself")
    # the same file through another spelling of its path
    code, _, err = run_cli(capsys, ckpt, "--json", ckpt.parent / "." / ckpt.name, *SMALL)
    _one_line_error(code, err, "--json")
    assert ckpt.read_bytes() == before and ckpt.stat().st_mtime_ns == mtime


def test_seq_len_above_context_and_bad_flags(capsys, ckpt):
    code, _, err = run_cli(capsys, ckpt, "--seq-len", 17, *SMALL)
    _one_line_error(code, err, "--seq-len 17", "context length 16")
    code, _, err = run_cli(capsys, ckpt, "--seeds", 3, *SMALL)
    _one_line_error(code, err, "--seeds 3", "--batches")
    code, _, err = run_cli(capsys, ckpt, "--batch-size", 0)
    _one_line_error(code, err, "--batch-size")
    code, _, err = run_cli(capsys, ckpt, "--json", "a.json", "--csv", "a.json", *SMALL)
    _one_line_error(code, err, "both write")


def test_bare_state_dict_needs_num_heads(capsys, tmp_path):
    path = tmp_path / "bare.pt"
    torch.save(small_model().state_dict(), path)
    code, _, err = run_cli(capsys, path, *SMALL)
    _one_line_error(code, err, "--num-heads")


def test_bad_data_is_one_line(capsys, ckpt, tmp_path):
    bad = tmp_path / "tokens.npy"
    np.save(bad, np.array([1, 2, 300, 4] * 10, dtype=np.int64))  # 300 is outside the vocabulary of 256
    code, _, err = run_cli(capsys, ckpt, "--data", bad, *SMALL)
    _one_line_error(code, err, "300", "vocabulary")
    code, _, err = run_cli(capsys, ckpt, "--data", tmp_path / "missing.npy", *SMALL)
    _one_line_error(code, err, "no such file")
