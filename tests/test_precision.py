"""precision: the job's API, its verdicts on an injected massive activation, the model left as it was."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import tinylm
from diagnostics import OptionsError, PrecisionOptions, PrecisionResult, precision
from diagnostics.measure.quant import FORMATS, RECIPES, round_to_format

CHANNEL = 5


def _model(seed: int = 0) -> tinylm.TransformerLM:
    torch.manual_seed(seed)
    return tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=128, context_length=64, d_model=64, num_layers=2,
                                                   num_heads=4, d_ff=128))


def _massive(model: nn.Module, value: float = 1e5):
    """One entry of layer 0's attention input (token 0, one channel) set to ``value`` x its size: a
    massive activation (Sun et al. 2024) as a hook the model carries."""
    def hook(mod, args, out):
        out = out.clone()
        out[:, 0, CHANNEL] = value
        return out
    return model.layers[0].ln1.register_forward_hook(hook)


@pytest.fixture(scope="module")
def outlier_result() -> PrecisionResult:
    model = _model()
    handle = _massive(model)
    try:
        return precision(model, options=PrecisionOptions(batch_size=2, seq_len=64))
    finally:
        handle.remove()


def test_massive_activation_fails_tensorwise_at_its_modules_only(outlier_result):
    hit = {f"layers.0.attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
    rows = {(r.module, r.gemm, r.recipe): r for r in outlier_result.rows}
    for m in hit:
        r = rows[(m, "fprop", "tensorwise")]
        assert r.verdict == "fail" and r.loss_db > 6, r
        assert "massive activation" in r.cause and "rowwise or MXFP8" in r.fix, r.cause
        for recipe in ("rowwise", "mxfp8"):
            other = rows[(m, "fprop", recipe)]
            assert other.verdict == "ok" and other.sqnr_db >= 25, other
    assert hit <= set(outlier_result.keep_in_bf16("tensorwise"))
    assert outlier_result.keep_in_bf16("rowwise") == [] and outlier_result.keep_in_bf16("mxfp8") == []
    # negative control: layer 1 never sees the massive entry in its inputs' fprop
    assert all(r.verdict != "fail" for r in outlier_result.rows if r.module.startswith("layers.1") and r.gemm == "fprop")
    convert = outlier_result.module_filter_fn("tensorwise")
    assert not convert(None, "layers.0.attn.q_proj") and convert(None, "layers.1.attn.q_proj")
    assert not convert(None, "token_embeddings")  # not a measured GEMM


def test_healthy_model_is_ok_and_theory_within_1db():
    result = precision(_model(1), options=PrecisionOptions(batch_size=2, seq_len=64))
    assert result.ok, str(result)
    valid = [r for r in result.rows if r.valid]
    assert len(valid) >= len(result.rows) // 2
    assert all(abs(r.predicted_sqnr_db - r.sqnr_db) <= 1.0 for r in valid)
    # tensorwise's E5M2 gradients: dgrad about 4 dB below rowwise's E4M3 (fewer mantissa bits, not range)
    tw = [r.sqnr_db for r in result.rows if r.gemm == "dgrad" and r.recipe == "tensorwise"]
    rw = [r.sqnr_db for r in result.rows if r.gemm == "dgrad" and r.recipe == "rowwise"]
    assert 2.5 < sum(rw) / len(rw) - sum(tw) / len(tw) < 5.5


def test_result_api(outlier_result):
    text = str(outlier_result)
    assert text.splitlines()[0].startswith("tensorwise: keep")
    frame = outlier_result.to_frame()
    for col in ("module", "gemm", "recipe", "sqnr_db", "predicted_sqnr_db", "underflow", "overflow", "verdict",
                "cause", "fix"):
        assert col in frame.columns
    assert len(frame) == len(outlier_result.modules) * 3 * 3
    data = json.loads(outlier_result.to_json())
    assert data["schema_version"] == "2" and data["keep_in_bf16"]["tensorwise"]
    assert ("token_embeddings", "its input or output is not one floating tensor") in outlier_result.skipped


def test_model_left_exactly_as_it_was():
    model = _model()
    model.train()
    model.lm_head.weight.requires_grad_(False)
    model.layers[0].ffn.w1.weight.grad = torch.ones_like(model.layers[0].ffn.w1.weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    precision(model, options=PrecisionOptions(recipes=("rowwise",), batch_size=1, seq_len=32, theory=False))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and all(m.training for m in model.modules())
    assert not model.lm_head.weight.requires_grad
    assert torch.equal(model.layers[0].ffn.w1.weight.grad, torch.ones_like(model.layers[0].ffn.w1.weight))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "layers.0.ffn.w1.weight")


def test_hooks_removed_when_the_forward_raises():
    model = _model()

    def boom(*a):
        raise RuntimeError("boom")
    h = model.layers[1].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        precision(model, options=PrecisionOptions(recipes=("mxfp8",), batch_size=1, seq_len=32))
    h.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_module_that_is_not_one_gemm_is_not_measured():
    model = _model()
    model.layers[0].ffn.w1 = _Shim(model.layers[0].ffn.w1.weight.shape)
    result = precision(model, options=PrecisionOptions(recipes=("rowwise",), batch_size=1, seq_len=32))
    assert "layers.0.ffn.w1" not in result.modules and "layers.0.ffn.w3" in result.modules
    assert any(m == "layers.0.ffn.w1" and "not x W^T" in why for m, why in result.skipped)


class _Shim(nn.Module):
    """A 2-D weight whose forward is not x W^T: skipped, not judged."""

    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape) / shape[1] ** 0.5)

    def forward(self, x):
        return torch.tanh(3 * x @ self.weight.t())


@pytest.mark.parametrize("bad, match", [
    (dict(recipes=("fp8",)), "recipes='fp8': must be one of"),
    (dict(recipes=()), "recipes=\\(\\): must name at least one recipe"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(theory="yes"), "theory='yes'"),
])
def test_options_refused_with_the_argument_named(bad, match):
    with pytest.raises(OptionsError, match=match):
        PrecisionOptions(**bad)


def test_generic_rounding_is_round_to_nearest_even_with_subnormals():
    e4m3 = FORMATS["e4m3"]
    x = torch.tensor([0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 1.0625, 1.1875, 447.0, 1e9, -1e9, 17.0])
    want = torch.tensor([0.0, 2.0 ** -9, 0.0, 2.0 ** -9, 1.0, 1.25, 448.0, 448.0, -448.0, 16.0])
    assert torch.equal(round_to_format(x, e4m3, native=False), want)
    assert math.isclose(e4m3.dynamic_range_binades, math.log2(448 / 2 ** -9))
    assert RECIPES["tensorwise"].dgrad[0].format.name == "e5m2" and RECIPES["rowwise"].dgrad[0].format.name == "e4m3"


def test_trend_alerts_when_a_gemm_falls_from_its_start():
    from diagnostics.jobs.precision_trend import PrecisionTrend

    model = _model()
    trend = PrecisionTrend("tensorwise", drop_db=6.0, batch_size=2, seq_len=32)
    assert trend.record(0, model) == []  # healthy start
    handle = _massive(model)
    try:
        alerts = trend.record(50, model)
    finally:
        handle.remove()
    assert {(a.module, a.gemm) for a in alerts} >= {("layers.0.attn.q_proj", "fprop")}
    assert all(a.module.startswith("layers.0.attn.") for a in alerts), alerts  # negative control: nothing else fell
    assert "fell" in str(alerts[0]) and trend.to_frame()["step"].nunique() == 2
    assert trend.record(100, model) == []  # recovered: no new alert
