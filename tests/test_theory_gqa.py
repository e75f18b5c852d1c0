"""The theories on grouped-query attention: measured against predicted at init.

d 128, 8 query heads sharing 2 key/value heads (G = 4), L 4, cs336 init, uniform random tokens.
Forward, every figure is multi-head attention's (a K/V head's output is computed as before; the
output projection's input has the same variance per element). Backward, a K/V head's gradient
sums its G query heads' (uncorrelated at init): G times one head's. Where the sum's fluctuation
over sequences leaves the expected kernel (the values' gradient, the attention's input gradient,
the stream beyond the depth budget), the predictions say so (outside validity).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import tinylm
from diagnostics import DiagnoseOptions, diagnose

CONFIG = tinylm.ModelConfig(vocab_size=512, context_length=32, d_model=128, num_layers=4, num_heads=8, d_ff=352,
                            num_kv_heads=2)


def _ratios(config: tinylm.ModelConfig, seeds: int) -> pd.DataFrame:
    """Per (name, direction): the geometric mean over seeds of measured / predicted variance, the
    predicted variance of the first seed, and whether every seed's prediction is valid."""
    frames = []
    for seed in range(seeds):
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(100 + seed))
        result = diagnose(model, None, DiagnoseOptions(batch_size=8, seq_len=32, batches=2, seed=seed))
        f = result.to_frame()
        frames.append(f[(f.statistic == "var") & f.predicted.notna()][["name", "direction", "value", "predicted",
                                                                        "valid"]])
    f = pd.concat(frames)
    f["log_ratio"] = np.log(f.value / f.predicted)
    return f.groupby(["name", "direction"]).agg(ratio=("log_ratio", lambda x: float(np.exp(x.mean()))),
                                                predicted=("predicted", "first"), valid=("valid", "all"))


@pytest.mark.parametrize("seeds", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_gqa_predictions_hold_where_valid(seeds):
    r = _ratios(CONFIG, seeds)
    valid = r[r.valid]
    worst = (np.log(valid.ratio)).abs().idxmax()
    assert abs(np.log(valid.ratio[worst])) < np.log(1.15), (worst, valid.ratio[worst])
    # what the group sum changes is predicted too, though marked outside validity
    for i in range(4):
        v = r.loc[(f"layers.{i}.attn.v_proj", "backward")]
        assert not v.valid and 0.85 < v.ratio < 1.2, (i, v.ratio)
        # negative control: one head's gradient (no sum over the group) misses by ~G = 4, far outside the bound
        assert abs(np.log(4 * v.ratio)) > np.log(1.15) * 5
    for name in ("layers.0.ln1", "layers.3.ln1"):
        assert not r.loc[(name, "backward")].valid
    assert r.loc[("layers.3", "backward")].valid and r.loc[("layers.3.attn.heads", "forward")].valid


def test_gqa_validity_reasons_and_rules():
    """The marks say why, and the rules name the group sum; multi-head attention is unchanged."""
    from diagnostics.theory import backkernel

    bk = backkernel.backward_kernel(CONFIG.replace(num_layers=2), 16, tokens=128.0)
    preds = bk.predictions(dropout_active=False)
    v = preds[("layers.1.attn.v_proj", "backward")]
    assert not v.valid and "grouped-query attention" in v.validity and "summed over 4 query heads" in v.rule
    assert preds[("layers.1.attn.output_proj", "backward")].valid
    mha = backkernel.backward_kernel(CONFIG.replace(num_layers=2, num_kv_heads=None), 16, tokens=128.0)
    m = mha.predictions(dropout_active=False)[("layers.1.attn.v_proj", "backward")]
    assert m.valid and "summed" not in m.rule
