"""diagnose(): the result object, its JSON schema and frame, options, token forms, and the model untouched."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import tinylm
from diagnostics import SCHEMA_VERSION, DiagnoseOptions, DiagnoseResult, OptionsError, diagnose
from diagnostics.result import COLUMNS, DTYPES, Row, frame


CFG = tinylm.ModelConfig(vocab_size=128, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
OPTS = DiagnoseOptions(batch_size=2, seq_len=8, batches=3)


@pytest.fixture(scope="module")
def result():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    return model, diagnose(model, options=OPTS)


def test_result_exposes_what_the_report_needs(result):
    model, r = result
    h = r.header
    assert h.model_class == "TransformerLM" and h.config == CFG.to_dict() and h.init == "cs336"
    assert h.parameter_count == model.num_parameters() and h.tokens_measured == 3 * 2 * 8
    assert h.theory == "global" and h.loss_uniform == pytest.approx(math.log(128)) and h.token_source == "random"
    row = r.tensor("layers.0.ffn.w1", "forward")
    assert row.kind == "linear" and row.block == 0 and row.predicted > 0 and row.valid
    assert row.ratio_low < row.ratio < row.ratio_high  # 3 replicates: a t interval
    assert {t.direction for t in r.tensors} == {"forward", "backward"}
    p = next(p for p in r.params if p.name == "layers.1.attn.q_proj.weight")
    assert p.declared_std > 0 and p.drift == pytest.approx(1, abs=0.2) and p.spectral_norm > 0
    assert 1 <= p.stable_rank <= 32 and p.grad_std > 0
    assert [a.name for a in r.attention] == ["layers.0.attn", "layers.1.attn"]
    assert 0 < r.attention[0].entropy_mean <= r.attention[0].entropy_uniform + 1e-9
    assert [d.index for d in r.depth] == [0, 1, 2] and r.depth[0].name == "token_embeddings"
    assert all(d.forward_predicted and d.backward_var > 0 for d in r.depth)
    assert r.healthy and r.findings == []


def test_json_is_versioned_and_deterministic_but_for_created(result):
    # same inputs, same thread count (reductions over 1 or 2 threads may round differently)
    model, r = result
    r2 = diagnose(model, options=OPTS)
    a, b = json.loads(r.to_json()), json.loads(r2.to_json())
    assert a["schema_version"] == SCHEMA_VERSION and "created" in a
    a.pop("created"), b.pop("created")
    assert a == b
    assert r.to_json().replace(r.created, "") == r2.to_json().replace(r2.created, "")  # byte-identical
    back = DiagnoseResult.from_dict(json.loads(r.to_json()))
    assert back.tensors == r.tensors and back.header == r.header and back.depth == r.depth


def test_frame_is_tidy(result):
    _, r = result
    df = r.to_frame(run="fresh")
    assert list(df.columns) == list(COLUMNS) and df.dtypes.astype(str).to_dict() == DTYPES
    assert len(df) == len(r.tensors) * 11
    assert set(df.run) == {"fresh"} and df.step.isna().all()
    assert set(df.seed) == {0} and set(df.scheme) == {"cs336"} and set(df.depth) == {2} and set(df.width) == {32}
    v = df[(df.name == "lm_head") & (df.direction == "backward") & (df.statistic == "var")]
    assert len(v) == 1 and v.predicted.iloc[0] > 0 and bool(v.valid.iloc[0])
    assert v.ratio.iloc[0] == r.tensor("lm_head", "backward").ratio
    other = df[df.statistic != "var"]  # predictions and their validity belong to the variance rows
    assert other.predicted.isna().all() and other.ratio.isna().all() and other.valid.isna().all()
    assert set(df.verdict) == {"ok"}


def test_json_reads_back_schema_2_documents(result):
    """A version "2" document (per-tensor objects, as written before the tidy rows) built from the
    same result reads back to the same tensors; a version-3 one has rows and no "tensors"."""
    from dataclasses import asdict

    _, r = result
    doc = json.loads(r.to_json())
    assert doc["schema_version"] == "5" and "tensors" not in doc
    assert doc["columns"] == list(COLUMNS) and len(doc["rows"]) == len(r.tensors) * 11
    assert all(len(row) == len(COLUMNS) for row in doc["rows"])
    assert r.to_json().count("\n") < len(doc["rows"]) + 2000  # one line per row, not one per value
    assert json.loads(r.to_json(indent=None)) == doc
    assert {(t["name"], t["direction"]) for t in doc["theory"]} == {(t.name, t.direction) for t in r.tensors
                                                                   if t.predicted is not None}
    old = {k: v for k, v in doc.items() if k not in ("columns", "rows", "theory")}
    old["schema_version"] = "2"
    old["tensors"] = json.loads(json.dumps([asdict(t) for t in r.tensors]))
    back = DiagnoseResult.from_dict(old)
    assert back.schema_version == "2" and back.tensors == r.tensors and back.depth == r.depth
    assert json.loads(back.to_json())["schema_version"] == "5"  # written again: the current layout
    with pytest.raises(ValueError, match="schema_version='1'"):
        DiagnoseResult.from_dict({**old, "schema_version": "1"})


def test_rows_build_the_frame_and_refuse_unknown_columns():
    df = frame([Row(statistic="loss", value=2.5, step=3), {"name": "x", "statistic": "var", "value": 1.0, "block": 2}])
    assert list(df.columns) == list(COLUMNS) and list(df.step.astype(object)) == [3, pd.NA]
    assert pd.isna(df["name"].iloc[0]) and df.block.iloc[1] == 2
    assert frame().dtypes.astype(str).to_dict() == DTYPES  # an empty frame concatenates with any other
    with pytest.raises(ValueError, match=r"\['site'\]: not columns"):
        frame([{"site": "x", "statistic": "var", "value": 1.0}])
    with pytest.raises(ValueError, match="direction='up'"):
        Row(statistic="var", value=1.0, direction="up")


def test_model_is_left_exactly_as_it_was():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(1))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=8, batches=1))
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_progress_and_given_tokens():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(2))
    calls = []
    windows = torch.randint(0, 128, (6, 9), generator=torch.Generator().manual_seed(3))
    r = diagnose(model, windows, DiagnoseOptions(batch_size=2, progress=lambda d, t, s: calls.append((d, t, s))))
    assert r.header.token_source == "given" and r.header.batches == 3 and r.header.seq_len == 8
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1)) and calls[-1][0] == calls[-1][1]
    stream = np.arange(500) % 128
    r = diagnose(model, stream, DiagnoseOptions(batch_size=2, seq_len=8, batches=2))
    assert r.header.tokens_measured == 32


def test_seeds_reinitialise_copies():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(4))
    before = model.layers[0].ffn.w1.weight.clone()
    r = diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=8, batches=1, seeds=3))
    assert r.header.seeds == 3 and torch.equal(model.layers[0].ffn.w1.weight, before)
    assert r.tensor("layers.0.ffn.w1").ratio_low is not None


def test_trained_looking_model_gets_local_theory():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.layers[0].ffn.w1.weight.mul_(3.0)  # drifted from its declared std
    r = diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=8, batches=2))
    assert r.header.theory == "local"
    assert r.tensor("layers.0.ffn.w1").ratio == pytest.approx(1, abs=0.1)  # local reads the actual weights
    assert next(p for p in r.params if p.name == "layers.0.ffn.w1.weight").drift == pytest.approx(3, rel=0.05)


def test_any_module_without_theory():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(20, 8), nn.Linear(8, 20)

        def forward(self, x):
            return self.out(torch.tanh(self.emb(x)))

    r = diagnose(Tiny(), options=DiagnoseOptions(batch_size=2, seq_len=5, batches=2))
    assert r.header.theory == "off" and r.depth == [] and r.tensor("out").predicted is None
    assert r.header.loss_uniform == pytest.approx(math.log(20))


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size=0"), (dict(seq_len=1), "seq_len=1"), (dict(theory="exact"), "theory="),
    (dict(seed=-1), "seed=-1"), (dict(progress=3), "progress="),
])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(OptionsError, match=match):
        DiagnoseOptions(**kwargs)


def test_bad_inputs_are_named():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(6))
    with pytest.raises(OptionsError, match="context_length=16"):
        diagnose(model, options=DiagnoseOptions(seq_len=64))
    with pytest.raises(OptionsError, match="dtype"):
        diagnose(model, torch.rand(4, 9))
    with pytest.raises(OptionsError, match="seeds=2"):
        diagnose(nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5)), options=DiagnoseOptions(seeds=2, seq_len=4))


def test_ratio_is_the_geometric_mean_with_a_log_scale_interval():
    """Three replicates measured together give the geometric mean of the three measured alone, and
    the t interval of ln(ratio) over them: exp(mean ln r +- t_{0.995,2} sd(ln r)/sqrt 3). Each r is
    the replicate's measured variance over the run's prediction: with given tokens the global forward
    prediction (the kernel theory) depends on which positions share a token, so a run on two of the
    windows predicts slightly differently from the run on all six."""
    from scipy import stats as sstats

    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(7))
    windows = torch.randint(0, 128, (6, 9), generator=torch.Generator().manual_seed(8))
    opts = DiagnoseOptions(batch_size=2)
    together = diagnose(model, windows, opts)
    assert together.header.batches == 3 and together.header.theory == "global"
    for name, direction in (("layers.0.ffn.w1", "forward"), ("layers.1.attn", "forward"), ("lm_head", "backward")):
        alone = [diagnose(model, windows[i:i + 2], opts).tensor(name, direction) for i in (0, 2, 4)]
        assert all(a.ratio_low is None for a in alone)  # one replicate: no interval
        row = together.tensor(name, direction)
        logs = np.log([a.var / row.predicted for a in alone])
        half = sstats.t.ppf(0.995, 2) * logs.std(ddof=1) / math.sqrt(3)
        assert row.ratio == pytest.approx(math.exp(logs.mean()), rel=1e-9)
        assert row.ratio_low == pytest.approx(math.exp(logs.mean() - half), rel=1e-9)
        assert row.ratio_high == pytest.approx(math.exp(logs.mean() + half), rel=1e-9)
        assert 0 < row.ratio_low < row.ratio < row.ratio_high


def test_global_forward_predictions_come_from_the_kernel_theory(result):
    """In global mode the forward rows carry the kernel theory's prediction (rule "kernel ...") with the
    independent-token one beside it, the backward rows the backward kernel's (with the independent-token one
    beside it too); the depth rows the predicted token cosine (1/V at the embedding for uniform random tokens)."""
    _, r = result
    attn = r.tensor("layers.1.attn")
    assert attn.rule.startswith("kernel") and attn.valid and attn.predicted_independent > 0
    assert attn.predicted != attn.predicted_independent
    back = r.tensor("layers.1.attn", "backward")
    assert back.rule.startswith("kernel") and back.predicted_independent > 0
    assert [d.cosine_predicted is not None for d in r.depth] == [True, True, True]
    assert r.depth[0].cosine_predicted == pytest.approx(1 / 128, rel=1e-12)
    assert 0 < r.depth[1].cosine_predicted < r.depth[2].cosine_predicted < 1


def test_kernel_theory_runs_once_and_reads_the_given_tokens(monkeypatch):
    """Seeds share one kernel theory, and a second diagnose of the same config, length and tokens
    reuses it. Given tokens reach it through their coincidences: windows that repeat one token at
    every position make every token vector the same, and the kernel predicts cosine 1 throughout."""
    import diagnostics.theory.tokenkernel as kernel

    calls = []
    real = kernel.kernel_theory
    monkeypatch.setattr(kernel, "kernel_theory", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    kernel.clear_cache()
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    opts = DiagnoseOptions(batch_size=2, seq_len=8, batches=2, seeds=2)
    diagnose(model, options=opts)
    diagnose(model, options=opts)
    assert len(calls) == 1
    same = diagnose(model, torch.full((4, 9), 5), DiagnoseOptions(batch_size=2))
    assert len(calls) == 2 and same.header.token_source == "given"
    for d in same.depth:
        assert d.cosine_predicted == pytest.approx(1.0, abs=1e-9) and d.cosine == pytest.approx(1.0, abs=1e-5)
    kernel.clear_cache()
