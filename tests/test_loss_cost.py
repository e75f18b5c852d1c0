"""diagnostics.theory.loss_cost: the Fisher term's first-order change is the loss's own, and the share of
descent a gradient loses counts a flushed channel alike with the others."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics.measure.quant import quantize, recipe
from diagnostics.theory.loss_cost import descent_lost, fisher

B, T = 3, 16


def _model():
    torch.manual_seed(0)
    cfg = tinylm.ModelConfig(vocab_size=64, context_length=T, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    return tinylm.TransformerLM(cfg).double()


def _sequence_losses(model, ids, layer, e=None):
    """Per sequence the mean next-token loss, with ``e`` (B*T, N) added to ``layer``'s output."""
    def hook(mod, args, out):
        return out if e is None else out + e.reshape(out.shape)
    h = layer.register_forward_hook(hook)
    try:
        logits = model(ids[:, :-1])
    finally:
        h.remove()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return ce.reshape(B, T).mean(1)


def test_fisher_first_order_term_is_each_sequences_loss_change():
    """d_b = B sum_{t in b} g_t . e_t (g of the batch's mean loss) is sequence b's first-order loss
    change: in float64 the remainder l_b(eps e) - l_b(0) - eps d_b is of second order (halving eps
    quarters it, within 10%), and far below eps d_b. Negative control: without the batch factor B
    (the gradient of the mean taken for a sequence's own) the remainder is of first order."""
    model = _model()
    layer = model.layers[1].attn.v_proj
    ids = torch.randint(0, 64, (B, T + 1), generator=torch.Generator().manual_seed(1))
    store = {}
    def keep_grad(mod, args, out):
        out.register_hook(lambda g: store.setdefault("g", g))
    h = layer.register_forward_hook(keep_grad)
    _sequence_losses(model, ids, layer).mean().backward()
    h.remove()
    g = store["g"].reshape(B * T, -1)
    e = torch.randn(g.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    d = (g * e).sum(1).reshape(B, T).sum(1) * B
    with torch.no_grad():
        base = _sequence_losses(model, ids, layer)
        rest = {eps: _sequence_losses(model, ids, layer, eps * e) - base - eps * d for eps in (1e-3, 5e-4)}
        wrong = _sequence_losses(model, ids, layer, 1e-3 * e) - base - 1e-3 * d / B
    ratio = rest[1e-3] / rest[5e-4]
    assert torch.allclose(ratio, torch.full_like(ratio, 4.0), rtol=0.1), ratio
    assert bool((rest[1e-3].abs() < 0.05 * (1e-3 * d).abs()).all())
    assert bool((wrong.abs() > 0.3 * (1e-3 * d).abs()).all())  # the control: a first-order miss
    assert fisher(g, e, B) == pytest.approx(0.5 * float(d.square().mean()), rel=1e-12)


def _wgrad(outlier: float | None):
    """wgrad dW = g^T x of Gaussian x (512, 64) and g (512, 96), quantized in tensorwise; channel 5 of x
    multiplied by ``outlier``."""
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(512, 64, generator=gen), torch.randn(512, 96, generator=gen) * 1e-3
    if outlier is not None:
        x[:, 5] *= outlier
    cg, cx = recipe("tensorwise").casts("wgrad")
    qg, _ = quantize(g.t().contiguous(), cg, stats=False)
    qx, _ = quantize(x.t().contiguous(), cx, stats=False)
    return qg @ qx.t(), g.t() @ x


def test_descent_lost_counts_flushed_channels_alike_and_noise_as_free():
    """A channel 10^6 x the others flushes the other 63 to zero in tensorwise's E4M3 input: with each
    entry weighed by its curvature (the factored Fisher) about 63/64 of the descent is lost, though
    the outlier's column holds ~all of dW's power. Without the outlier: rounding to nearest leaves an
    error uncorrelated with the rounded value (e = c - x within a bin: E[x e] = -E[e^2]), so a gradient
    arrives shrunk by its relative noise power rho (~3.4e-3 here, E5M2 x E4M3): the share lost is rho
    up to its draw (standard deviation ~sqrt(rho / 6144) ~ 7e-4 over the 6144 entries: 30% of rho is
    more than 4.9 of them, a false alarm below 1e-6). Negative control: the plain first-order share
    (every entry weighed 1) calls the flushed case free."""
    q, ref = _wgrad(1e6)
    assert bool((q[:, :5] == 0).all())
    assert descent_lost(q, ref) > 0.9
    assert descent_lost(q, ref, per_row=False) > 0.9
    plain = 1 - float((q * ref).sum() / ref.square().sum())
    assert plain < 0.01  # the control: the outlier column's power hides the loss
    q, ref = _wgrad(None)
    rho = float((q - ref).square().sum() / ref.square().sum())
    assert 1e-3 < rho < 1e-2
    assert descent_lost(q, ref) == pytest.approx(rho, rel=0.3)
    assert descent_lost(torch.full_like(q, math.nan), ref) == 1.0 and descent_lost(q, torch.zeros_like(ref)) == 0.0
