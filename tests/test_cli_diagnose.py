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
from clihelp import assert_one_line_error
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


def test_output_over_the_checkpoint_is_refused_and_the_file_untouched(capsys, ckpt):
    before, mtime = ckpt.read_bytes(), ckpt.stat().st_mtime_ns
    for flag in ("--json", "--csv", "--html", "--svg", "--plot"):
        code, _, err = run_cli(capsys, ckpt, flag, ckpt, *SMALL)
        assert_one_line_error(code, err, flag, "checkpoint itself")
    # the same file through another spelling of its path
    code, _, err = run_cli(capsys, ckpt, "--json", ckpt.parent / "." / ckpt.name, *SMALL)
    assert_one_line_error(code, err, "--json")
    assert ckpt.read_bytes() == before and ckpt.stat().st_mtime_ns == mtime


def test_seq_len_above_context_and_bad_flags(capsys, ckpt):
    code, _, err = run_cli(capsys, ckpt, "--seq-len", 17, *SMALL)
    assert_one_line_error(code, err, "--seq-len 17", "context length 16")
    code, _, err = run_cli(capsys, ckpt, "--seeds", 3, *SMALL)
    assert_one_line_error(code, err, "--seeds 3", "--batches")
    code, _, err = run_cli(capsys, ckpt, "--batch-size", 0)
    assert_one_line_error(code, err, "--batch-size")
    code, _, err = run_cli(capsys, ckpt, "--json", "a.json", "--csv", "a.json", *SMALL)
    assert_one_line_error(code, err, "both write")


def test_a_batch_that_cannot_fit_is_refused_before_allocating(capsys, ckpt):
    code, _, err = run_cli(capsys, ckpt, "--batch-size", 10**9, "--no-progress")
    assert_one_line_error(code, err, "GiB", "--batch-size")


def test_bare_state_dict_needs_num_heads(capsys, tmp_path):
    path = tmp_path / "bare.pt"
    torch.save(small_model().state_dict(), path)
    code, _, err = run_cli(capsys, path, *SMALL)
    assert_one_line_error(code, err, "--num-heads")


def test_bad_data_is_one_line(capsys, ckpt, tmp_path):
    bad = tmp_path / "tokens.npy"
    np.save(bad, np.array([1, 2, 300, 4] * 10, dtype=np.int64))  # 300 is outside the vocabulary of 256
    code, _, err = run_cli(capsys, ckpt, "--data", bad, *SMALL)
    assert_one_line_error(code, err, "300", "vocabulary")
    code, _, err = run_cli(capsys, ckpt, "--data", tmp_path / "missing.npy", *SMALL)
    assert_one_line_error(code, err, "no such file")


# ----------------------------------------------------------------------------- runs on real models


def _check_schema(doc: dict) -> None:
    """The JSON document against the schema of diagnostics/result.py (version 3): every section present,
    every row with exactly the tidy columns (and every other object exactly its dataclass's fields),
    numbers as numbers or the strings nan/inf/-inf."""
    from dataclasses import fields

    from diagnostics.result import COLUMNS, SCHEMA_VERSION, AttentionRow, DepthRow, Finding, Header, ParamRow

    assert doc["schema_version"] == SCHEMA_VERSION == "5"
    assert isinstance(doc["created"], str) and doc["created"]
    assert isinstance(doc["healthy"], bool) and doc["healthy"] == (not doc["findings"])
    assert set(doc) == {"schema_version", "created", "healthy", "header", "thresholds", "findings", "columns",
                        "rows", "theory", "params", "attention", "depth", "status", "judged", "not_judged"}
    assert doc["columns"] == list(COLUMNS)
    assert set(doc["header"]) == {f.name for f in fields(Header)}
    for key, kind in (("findings", Finding), ("params", ParamRow), ("attention", AttentionRow), ("depth", DepthRow)):
        names = {f.name for f in fields(kind)}
        for row in doc[key]:
            assert set(row) == names, (key, set(row) ^ names)
    rows = [dict(zip(COLUMNS, row)) for row in doc["rows"]]
    assert all(len(row) == len(COLUMNS) for row in doc["rows"])
    for row in rows:
        assert row["direction"] in ("forward", "backward")
        v = row["value"]
        assert isinstance(v, (int, float)) or v in ("nan", "inf", "-inf"), (row["statistic"], v)
    assert {r["statistic"] for r in rows} >= {"var", "mean", "max_abs", "frac_nonfinite"}
    for note in doc["theory"]:
        assert set(note) == {"name", "direction", "theory", "rule", "validity", "predicted_independent"}
    assert all(isinstance(v, (int, float)) for v in doc["thresholds"].values())


def test_every_export_is_written_and_reads_back(capsys, ckpt, tmp_path):
    from PIL import Image

    from diagnostics import DiagnoseResult
    from diagnostics.result import COLUMNS

    out = {k: tmp_path / f"report.{k}" for k in ("json", "csv", "html", "svg", "png")}
    code, stdout, err = run_cli(capsys, ckpt, "--json", out["json"], "--csv", out["csv"], "--html", out["html"],
                                "--svg", out["svg"], "--plot", out["png"], *SMALL)
    assert code == 0, err
    doc = json.loads(out["json"].read_text())
    _check_schema(doc)
    result = DiagnoseResult.from_dict(doc)
    assert result.header.parameter_count == small_model().num_parameters()
    frame = pd.read_csv(out["csv"])
    assert tuple(frame.columns) == COLUMNS
    assert len(frame) == len(result.to_frame()) and {"forward", "backward"} <= set(frame["direction"])
    var = frame[(frame["statistic"] == "var") & (frame["name"] == "layers.1") & (frame["direction"] == "forward")]
    assert math.isclose(float(var["value"].iloc[0]), result.tensor("layers.1").var, rel_tol=1e-12)
    html = out["html"].read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "Per layer" in html and "verdict" in html
    svg = out["svg"].read_text()
    assert svg.lstrip().startswith("<svg") and svg.rstrip().endswith("</svg>")
    with Image.open(out["png"]) as img:
        assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200
        lo, hi = img.convert("L").getextrema()
        assert hi - lo > 100, "the plot is blank"
    assert "wrote json" in err
    # no temporary files left beside the outputs
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.pt", *(p.name for p in out.values())])


def test_json_is_byte_identical_across_runs_but_the_timestamp(capsys, ckpt, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_cli(capsys, ckpt, "--json", a, *SMALL)[0] == 0
    assert run_cli(capsys, ckpt, "--json", b, *SMALL)[0] == 0
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    da.pop("created"), db.pop("created")
    assert da == db
    strip = lambda text: "\n".join(line for line in text.splitlines() if '"created"' not in line)  # noqa: E731
    assert strip(a.read_text()) == strip(b.read_text())


def test_report_of_a_checkpoint_shows_its_source(capsys, ckpt):
    before, mtime = ckpt.read_bytes(), ckpt.stat().st_mtime_ns
    code, out, err = run_cli(capsys, ckpt, *SMALL)
    assert code == 0, err
    assert ckpt.read_bytes() == before and ckpt.stat().st_mtime_ns == mtime, "diagnose changed its input"
    assert "tinylm checkpoint" in out and "iteration 7" in out and str(ckpt) in out.replace("\n", "")
    assert "Per layer" in out and "Variance over depth" in out and "verdict" in out


def test_check_exit_codes_healthy_and_nan_weights(capsys, tmp_path, ckpt):
    code, out, err = run_cli(capsys, ckpt, "--check", *SMALL)
    assert code == 0, out + err
    broken = small_model()
    with torch.no_grad():
        broken.layers[1].attn.q_proj.weight[0, 0] = float("nan")
    path = tmp_path / "broken.pt"
    checkpoint.save(path, broken)
    code, out, err = run_cli(capsys, path, "--check", *SMALL)
    assert code == 1, err
    assert "NOT HEALTHY" in out and "layers.1" in out and "non-finite" in out.lower()
    # without --check the report is the same but the exit code is 0
    assert run_cli(capsys, path, *SMALL)[0] == 0


def test_exploding_model_is_found(capsys, tmp_path):
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=8, num_heads=4, d_ff=64,
                                norm="none")
    path = tmp_path / "nonorm.pt"
    checkpoint.save(path, tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)))
    code, out, err = run_cli(capsys, path, "--check", *SMALL)
    assert code == 1, out + err
    assert "EXPLODING" in out and "try" in out


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100")
    return env


def test_end_to_end_on_init_checkpoint_and_bare_state_dict(tmp_path, capsys):
    """``tinylm init`` writes a checkpoint; in a fresh interpreter ``diagnose`` reads it, and a bare
    ``torch.compile``-prefixed state dict with the flags the file cannot give."""
    path = tmp_path / "tiny.pt"
    assert main(["init", "--preset", "tiny", "-o", str(path)]) == 0, capsys.readouterr().err
    bare = tmp_path / "bare.pt"
    model, _ = checkpoint.load(path)
    torch.save({f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, bare)
    script = (
        "import sys\nfrom reports.cli import main\n"
        f"a = main(['diagnose', {str(path)!r}, '--check', '--batches', '2', '--no-progress'])\n"
        f"b = main(['diagnose', {str(bare)!r}, '--num-heads', '4', '--rope-theta', '10000', "
        "'--context-length', '16', '--batches', '2', '--no-progress'])\n"
        "sys.exit(10 * a + b)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("HEALTHY") >= 2 and "state_dict checkpoint" in r.stdout and "Traceback" not in r.stderr


def test_end_to_end_default_run_no_argument(tmp_path):
    """The README Quickstart's main job: plain ``diagnose``, the true default, through its console script."""
    exe = Path(sys.executable).with_name("diagnose")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from reports.cli import diagnose_main; sys.exit(diagnose_main())"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "fresh tinystories preset" in r.stdout and "V=10000 ctx=256 d=512 L=4 H=16 d_ff=1344" in r.stdout
    assert "verdict" in r.stdout and "Per layer" in r.stdout and "Variance over depth" in r.stdout
    assert list(tmp_path.iterdir()) == [], "the default run must not write files"


def test_checkpoint_with_training_history_gets_the_during_training_panel_and_plot(capsys, tmp_path):
    from diagnostics.jobs.watch import Watch
    from tinylm.functional import cross_entropy

    model = small_model()
    watch = Watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for t in range(3):
        batch = torch.randint(0, 256, (2, 17), generator=gen)
        with watch.capture():
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
        before = watch.snapshot_params()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.commit(t, float(loss.detach()), 0.1, 1.0, before=before)
        watch.log(t, float(loss.detach()), 0.1, 1.0)
    path = tmp_path / "trained.pt"
    checkpoint.save(path, model, iteration=3, history=watch.history)
    png = tmp_path / "depth.png"
    code, out, err = run_cli(capsys, path, "--plot", png, *SMALL)
    assert code == 0, err
    assert "during training" in out and "iteration 3" in out
    assert png.exists() and (tmp_path / "depth.training.png").stat().st_size > 1000
    assert "depth.training.png" in err
