"""benchmarks/gpu_check.sh in its --cpu mode: every step runs, one summary is written, and the
device-to-host counter it uses counts what it should (with a negative control)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check_steps import TransferCounter, _reads  # noqa: E402

STEPS = ("tests", "bench_model", "bench_overhead", "bench_diagnose", "watch", "transfers", "nccl_2_ranks")


def test_counter_counts_scalar_reads_and_nothing_else():
    x = torch.randn(8, 8)
    with TransferCounter() as c:
        y = (x @ x).sum()
        float(y)
        y.item()
        bool(y > 0)
    assert c.counts["item"] == 3 and c.syncs == 0 and _reads(c, "cpu") == (3, 0) and _reads(c, "cuda") == (0, 0)
    with TransferCounter() as none:  # negative control: tensor work without a read to the host
        z = (x @ x).softmax(-1).sum(0)
        z.add_(1.0)
        torch.stack([z, z]).cpu()  # already on the CPU: no transfer
    assert none.counts["item"] == 0 and none.syncs == 0


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
@pytest.mark.slow  # seven interpreters, each importing torch: about a minute, more on a busy machine
def test_cpu_mode_runs_every_step_and_writes_one_summary(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_BUDGET="240")
    env.pop("PYTHONPATH", None)  # the script sets it to the repository root itself
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "# gpu_check (cpu)" in summary and f"torch {torch.__version__}" in summary
    for step in STEPS:
        row = re.search(rf"^\| {step} \| (\S+)", summary, re.M)
        assert row is not None, step
        assert row.group(1) == ("skip" if step == "nccl_2_ranks" else "pass"), (step, summary)
    assert "the two-rank NCCL merge needs two GPUs" in summary
    assert done.returncode == 0, done.stderr[-2000:]
