"""Theory never takes the measurement down: any scale of weights gets a report."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import DiagnoseOptions, diagnose
from diagnostics.theory.gaussian import _s2_at

SMALL = tinylm.ModelConfig(vocab_size=5000, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
OPTS = DiagnoseOptions(batch_size=2, batches=2, seq_len=8)


@pytest.mark.parametrize("sigma", [0.5, 3.0, 27.0, 40.0, 1e3])
def test_the_sum_of_squared_probabilities_is_at_most_one_at_any_logit_scale(sigma):
    s2 = _s2_at(sigma, 50_000)
    assert 0 < s2 <= 1
    assert s2 == pytest.approx(min(1.0, math.exp(sigma**2) / 50_000)) if sigma < 4 else s2 == 1.0


@pytest.mark.parametrize("std", [3.0, 10.0])
def test_a_badly_scaled_model_gets_a_report_not_a_crash(std):
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std, generator=torch.Generator().manual_seed(1))
    result = diagnose(model, options=OPTS)
    assert not result.healthy and result.header.theory in ("local", "global")


def test_a_theory_that_fails_leaves_the_measurement_and_says_so(monkeypatch):
    import importlib

    D = importlib.import_module("diagnostics.jobs.diagnose")  # the module (the package re-exports the function)

    def broken(*a, **k):
        raise OverflowError("math range error")

    monkeypatch.setattr(D, "predict", broken)
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="could not be computed .*OverflowError"):
        result = diagnose(model, options=OPTS)
    assert result.header.theory == "off" and result.tensors
    assert all(r.predicted is None for r in result.tensors)
