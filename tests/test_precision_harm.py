"""precision on an outlier feature: the operand named, and the harm ranking (noise power injected)."""

from __future__ import annotations

import pytest
import torch

import tinylm
from diagnostics import PrecisionOptions, precision
from diagnostics.judge.precision import worst_operand

CHANNEL = 5
HIT = tuple(f"layers.0.attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))


def _model(outlier: float | None):
    """A 2-layer tinylm; with ``outlier``, channel 5 of layer 0's attention input multiplied by it at
    every token and the weight columns reading it zeroed (harmless in high precision)."""
    torch.manual_seed(0)
    model = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=128, context_length=64, d_model=64, num_layers=2,
                                                    num_heads=4, d_ff=128))
    if outlier is not None:
        def hook(mod, args, out):
            out = out.clone()
            out[..., CHANNEL] = out[..., CHANNEL] * outlier
            return out
        model.layers[0].ln1.register_forward_hook(hook)
        with torch.no_grad():
            for name in HIT:
                model.get_submodule(name).weight[:, CHANNEL] = 0.0
    return model


def _run(outlier):
    return precision(_model(outlier), options=PrecisionOptions(recipes=("tensorwise", "rowwise"), batch_size=2,
                                                               seq_len=64, theory=False))


@pytest.fixture(scope="module")
def results():
    return _run(1e6), _run(None)


def test_outlier_feature_names_the_input_and_tops_the_harm(results):
    hit, plain = results
    rows = {(r.module, r.gemm, r.recipe): r for r in hit.rows}
    for m in HIT:
        r = rows[(m, "fprop", "tensorwise")]
        # the input's own relative error is small (the outlier channel holds its power), yet its other
        # channels flush: the input is named, as an outlier feature, and theory off says what it measured
        assert r.verdict == "fail" and r.worst_operand == "input", r
        assert "outlier feature" in r.cause and "flush to zero" in r.cause and "measures" in r.cause, r.cause
    harm = hit.harm("tensorwise")
    # fprop at ~0 dB injects noise as large as its output; three GEMMs at >= 20 dB inject <= 0.03
    assert min(harm[m] for m in HIT) > 0.5
    assert max(v for m, v in harm.items() if m not in HIT) < 0.05
    assert set(sorted(harm, key=harm.get)[-3:]) == set(HIT)
    # negative control: the same model without the outlier: nothing fails, no module's harm stands out
    assert plain.keep_in_bf16("tensorwise") == []
    assert max(plain.harm("tensorwise").values()) < 0.05


def test_harm_is_absolute_and_counts_e5m2_gradients(results):
    """Verdicts are judged against each format's own ideal; harm is not: tensorwise's E5M2 gradients
    (two mantissa bits against E4M3's three: about 4.4 dB, 2.75x the noise, in dgrad and wgrad) make
    its harm about twice rowwise's at every module the outlier does not reach."""
    _, plain = results
    tw, rw = plain.harm("tensorwise"), plain.harm("rowwise")
    body = [m for m in tw if m.startswith("layers.")]
    assert all(tw[m] > 1.3 * rw[m] for m in body), {m: tw[m] / rw[m] for m in body}
    assert all(r.verdict == "ok" for r in plain.rows if r.module in body)  # yet all judged ok
    # the sum over the three GEMMs of 10^(-SQNR/10), each GEMM's SQNR the lower of output and typical row
    m = body[0]
    want = sum(10 ** (-min(r.sqnr_db, r.row_sqnr_db) / 10) for r in plain.rows
               if r.module == m and r.recipe == "tensorwise")
    assert tw[m] == pytest.approx(want, rel=1e-12)
    assert worst_operand({"a": {"underflow": 0.5, "typical_relative_noise": 1e-4},
                          "b": {"underflow": 0.0, "typical_relative_noise": 1e-2}})["underflow"] == 0.5


def _fprop_sqnr(x, w, name):
    """fprop's SQNR (dB) of x W^T in recipe ``name``, and the share of x's entries flushed to 0."""
    import math

    from diagnostics.measure.quant import quantize, recipe

    cx, cw = recipe(name).casts("fprop")
    qx, _ = quantize(x, cx, stats=False)
    qw, _ = quantize(w, cw, stats=False)
    ref = x @ w.t()
    return 10 * math.log10(float(ref.square().sum() / (qx @ qw.t() - ref).square().sum())), \
        float(((qx == 0) & (x != 0)).float().mean())


def test_an_outlier_feature_of_a_million_fails_every_fp8_recipe_mx_least():
    """docs/precision.md: a channel x 10^6 (its weights zero) shares a scale with other channels in
    every recipe's fprop group: tensorwise loses almost all, rowwise most, MXFP8 its 32-channel block.
    Negative control: the same input without the outlier measures above 25 dB in each."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 64, generator=gen), torch.randn(96, 64, generator=gen) / 8
    w[:, CHANNEL] = 0
    clean = {r: _fprop_sqnr(x, w, r) for r in ("tensorwise", "rowwise", "mxfp8")}
    x[:, CHANNEL] *= 1e6
    hit = {r: _fprop_sqnr(x, w, r) for r in ("tensorwise", "rowwise", "mxfp8")}
    assert hit["tensorwise"][0] < hit["rowwise"][0] < hit["mxfp8"][0] < 10
    assert hit["tensorwise"][1] > 0.95 and 0.5 < hit["rowwise"][1] < 0.95 and 0.3 < hit["mxfp8"][1] < 0.5
    assert all(sqnr > 25 and flushed == 0 for sqnr, flushed in clean.values())


def test_predicted_loss_prices_a_lost_output_at_what_it_carries(results):
    """A layer whose input flushes loses its output (fprop: e = -y) and its weight's descent (wgrad,
    every column but the outlier's 0): both are priced at fisher(y), what the output carries for the
    loss, so the two agree to a few percent (the flushed share is nearly 1; the outlier channel's
    weights are zero, so y is the other channels' alone); dgrad, unhurt, costs 1e-3 of that. The hit
    modules top ``harm(by="loss")``. Negative control: without the outlier the same modules' fprop
    costs under 1% of it (rounding noise at ~28 dB, not a lost output)."""
    hit, plain = results
    cost = {(r.module, r.gemm): r.predicted_loss for r in hit.rows if r.recipe == "tensorwise"}
    for m in HIT:
        assert cost[(m, "wgrad")] == pytest.approx(cost[(m, "fprop")], rel=0.05)
        assert cost[(m, "dgrad")] < 1e-2 * cost[(m, "fprop")]
    by_loss = hit.harm("tensorwise", by="loss")
    assert set(sorted(by_loss, key=by_loss.get)[-3:]) == set(HIT)
    assert by_loss[HIT[0]] == pytest.approx(sum(cost[(HIT[0], g)] for g in ("fprop", "dgrad", "wgrad")), rel=1e-12)
    clean = {(r.module, r.gemm): r.predicted_loss for r in plain.rows if r.recipe == "tensorwise"}
    assert all(clean[(m, "fprop")] < 1e-2 * cost[(m, "fprop")] for m in HIT)
    assert "predicted_loss" in hit.to_frame().columns
    with pytest.raises(ValueError, match="by='loss'"):
        hit.harm("tensorwise", by="nope")
