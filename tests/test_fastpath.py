"""Attention's two paths: explicit scores and weights when something observes them (a hook on a
Tap, the ``explicit`` flag) or dropout draws on them, torch's fused kernel otherwise (a probe
keeps it: it measures the weights from q, k, v through an observer).
They must compute the same heads (to rounding) and the switch must be taken exactly then.

Tolerance of the two paths' difference, from the unit roundoff u of the dtype. A score
s_ij = q_i . k_j / sqrt(d_k) computed by either path is off by at most d_k u S (a dot product
of d_k terms; S = max|q| max|k| / sqrt(d_k) bounds |q_i||k_j| / sqrt(d_k)). A shift of every
score of a row by at most e moves the softmax row by at most 2 e in l1 norm, and normalising
a row of T terms adds about T u; the weighted sum of the values adds another T u max|v|. Both
paths err, so the heads differ by at most about max|v| (4 d_k u S + 4 T u); the tests allow
twice that, TOL = 8 u max|v| (d_k S + T). The module's output and the gradients are linear
maps of the heads and of the attention core's gradient (whose softmax backward
p * (g - <g, p>) is off by the same relative amount as p), the same maps on both paths, so
each is held to 8 u (d_k S + T) times its own largest entry. A negative control shows the
same tolerance rejects a specific wrong fused call (attention that is not causal, or scaled by
1/d_k).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import tinylm
from diagnostics import diff, probe
from diagnostics.options import ProbeOptions
from tinylm import functional as TF

SDPA = torch.nn.functional.scaled_dot_product_attention


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _tolerance(q, k, v, scale: float = 1.0) -> float:
    """8 u max|v| (d_k S + T) (see the module docstring), times ``scale``."""
    d_k, T = q.shape[-1], q.shape[-2]
    S = float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) / math.sqrt(d_k)
    return 8 * _unit(q.dtype) * (d_k * S + T) * float(v.abs().max()) * scale


class Heads:
    """Records what the attention hands to output_proj (its heads) by a pre-hook on output_proj,
    which is not a Tap and so does not change the path."""

    def __init__(self, attn: tinylm.MultiHeadSelfAttention):
        self.seen: list[torch.Tensor] = []
        self.handle = attn.output_proj.register_forward_pre_hook(lambda m, a: self.seen.append(a[0]))

    def remove(self):
        self.handle.remove()


def _observed(attn):
    """Attach a no-op observer to the probs Tap; returns its handle."""
    return attn.probs.register_forward_hook(lambda *a: None)


def _qkv(attn, x, pos):
    """q, k, v as the attention computes them (after RoPE), for the tolerance."""
    from einops import rearrange

    split = "... t (h d) -> ... h t d"
    q, k, v = (rearrange(p(x), split, h=attn.num_heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if attn.rope is not None:
        T = x.shape[-2]
        pos = torch.arange(T) if pos is None else pos
        pos = pos.unsqueeze(-2) if pos.dim() > 1 else pos
        q, k = attn.rope(q, pos), attn.rope(k, pos)
    return q, k, v


def _both_paths(attn, x, pos, upstream):
    """(heads, grads) of the fused path and of the explicit one, for the same input and upstream gradient."""
    out = {}
    for path in ("fused", "explicit"):
        handle = _observed(attn) if path == "explicit" else None
        heads = Heads(attn)
        xx = x.detach().clone().requires_grad_(True)
        try:
            y = attn(xx, pos)
        finally:
            heads.remove()
            if handle is not None:
                handle.remove()
        attn.zero_grad(set_to_none=True)
        (y * upstream).sum().backward()
        grads = {"x": xx.grad}
        grads.update({n: p.grad for n, p in attn.named_parameters()})
        out[path] = (heads.seen[0].detach(), y.detach(), grads)
    return out


CASES = [
    # (lead dims, T, heads, d_k, rope, positions)
    ((2,), 9, 2, 4, True, "default"),
    ((3,), 17, 4, 8, True, "batched"),
    ((), 6, 3, 2, True, "shared"),
    ((2, 2), 5, 2, 6, False, "default"),
    ((1,), 1, 1, 4, True, "default"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lead,T,H,dk,rope,positions", CASES)
def test_fused_and_explicit_paths_agree_with_gradients(dtype, lead, T, H, dk, rope, positions):
    g = torch.Generator().manual_seed(T * 31 + H)
    d = H * dk
    attn = tinylm.MultiHeadSelfAttention(d, H, max_seq_len=64, theta=10000.0 if rope else None).to(dtype)
    x = torch.randn(*lead, T, d, generator=g, dtype=dtype)
    pos = None
    if positions == "shared":
        pos = torch.randperm(64, generator=g)[:T].sort().values
    elif positions == "batched":
        pos = torch.stack([torch.randperm(64, generator=g)[:T].sort().values for _ in range(lead[0])])
    upstream = torch.randn(*lead, T, d, generator=g, dtype=dtype)
    got = _both_paths(attn, x, pos, upstream)
    (hf, yf, gf), (he, ye, ge) = got["fused"], got["explicit"]
    with torch.no_grad():
        q, k, v = _qkv(attn, x, pos)
    tol = _tolerance(q, k, v)
    assert float((hf - he).abs().max()) <= tol
    # the output and every gradient: linear maps of the heads (forward) and of the attention
    # core's gradient (backward), applied alike on both paths, so their differences stay within
    # the same relative bound, taken of each tensor's own scale
    rel = tol / float(v.abs().max())
    assert float((yf - ye).abs().max()) <= rel * float(ye.abs().max())
    # a gradient that is exactly zero (T = 1: one key, so the softmax is constant and q, k get
    # none) is bounded by the layer's largest gradient: the fused kernel's rounding of that zero
    # is of the scale of the products it sums, not of the zero
    layer = max(float(t.abs().max()) for t in ge.values())
    for name in gf:
        scale = float(ge[name].abs().max()) or layer
        assert float((gf[name] - ge[name]).abs().max()) <= rel * scale, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tolerance_rejects_a_wrong_fused_call(dtype):
    """Negative control: the heads' tolerance rejects attention that is not causal and attention
    scaled by 1/d_k, each against the explicit path."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, dtype=dtype) for _ in range(3))
    explicit = TF.scaled_dot_product_attention(q, k, v, TF.causal_mask(12))
    tol = _tolerance(q, k, v)
    assert float((SDPA(q, k, v, is_causal=True) - explicit).abs().max()) <= tol
    assert float((SDPA(q, k, v) - explicit).abs().max()) > 100 * tol
    assert float((SDPA(q, k, v, is_causal=True, scale=1 / 8) - explicit).abs().max()) > 100 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Tq,Tk", [(7, 7), (5, 11), (1, 4)])
def test_functional_attention_with_masks_matches_torch(dtype, Tq, Tk):
    """tinylm.functional.scaled_dot_product_attention with any mask (True = may attend; every row
    keeps at least one key) equals torch's kernel given the same boolean mask, gradients included."""
    g = torch.Generator().manual_seed(Tq * 13 + Tk)
    q = torch.randn(2, 3, Tq, 6, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, Tk, 6, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, Tk, 5, generator=g, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, 1, Tq, Tk, generator=g) < 0.5
    mask[..., 0] = True  # no row without a key
    up = torch.randn(2, 3, Tq, 5, generator=g, dtype=dtype)
    ours = TF.scaled_dot_product_attention(q, k, v, mask)
    theirs = SDPA(q, k, v, attn_mask=mask)
    tol = _tolerance(q.detach(), k.detach(), v.detach())
    assert float((ours - theirs).detach().abs().max()) <= tol
    go = torch.autograd.grad((ours * up).sum(), (q, k, v))
    gt = torch.autograd.grad((theirs * up).sum(), (q, k, v))
    rel = tol / float(v.detach().abs().max())
    for a, b in zip(go, gt):
        assert float((a - b).abs().max()) <= rel * float(b.abs().max())
    # the mask matters: dropping it moves the result far outside the tolerance
    assert float((TF.scaled_dot_product_attention(q, k, v) - theirs).detach().abs().max()) > 100 * tol


# -- the switch ---------------------------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of each path: torch's fused kernel and tinylm's explicit scores."""
    calls = {"fused": 0, "explicit": 0}
    fused, scores = torch.nn.functional.scaled_dot_product_attention, TF.attention_scores

    def count_fused(*a, **kw):
        calls["fused"] += 1
        return fused(*a, **kw)

    def count_explicit(*a, **kw):
        calls["explicit"] += 1
        return scores(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", count_fused)
    monkeypatch.setattr(TF, "attention_scores", count_explicit)

    def take():
        out = dict(calls)
        calls.update(fused=0, explicit=0)
        return out
    return take


SMALL = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24)


def _model(**changes):
    return tinylm.TransformerLM(SMALL.replace(**changes), generator=torch.Generator().manual_seed(0))


def _step(model):
    tok = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()


def test_a_probe_keeps_the_fused_path(counted):
    """A probe measures the scores and weights without forming them (an observer on each
    attention, diagnostics.measure.attention): the fused kernel stays, and the probe still
    records every attention's scores, weights and panel."""
    model = _model()
    _step(model)
    assert counted() == {"fused": 2, "explicit": 0}
    with probe(model) as run:
        _step(model)
    assert counted() == {"fused": 2, "explicit": 0}
    assert set(run.stats.attention) == {"layers.0.attn.probs", "layers.1.attn.probs"}
    assert run.stats.tensors[("layers.1.attn.scores", "backward")].count > 0
    _step(model)
    assert counted() == {"fused": 2, "explicit": 0}


def test_any_probe_leaves_every_attention_on_one_path(counted):
    """Whatever points a probe hooks, every block computes its attention on the same path while
    it is active (so what a point measures does not depend on the others probed beside it), and
    its observers are taken off on exit, also when the step raises."""
    model = _model()
    with probe(model, ProbeOptions(modules=["layers.1.attn.scores"])):
        _step(model)
    assert counted() == {"fused": 2, "explicit": 0}
    with probe(model, ProbeOptions(modules=["layers.0.attn", "layers.1.ffn"])):
        _step(model)
    assert counted() == {"fused": 2, "explicit": 0}
    with pytest.raises(RuntimeError, match="inside"):
        with probe(model):
            raise RuntimeError("inside")
    attns = [m for m in model.modules() if isinstance(m, tinylm.MultiHeadSelfAttention)]
    assert [m.explicit for m in attns] == [False, False] and not any(m._observers for m in attns)
    assert not any(t.observed for m in attns for t in (m.scores, m.probs))
    _step(model)
    assert counted() == {"fused": 2, "explicit": 0}


@pytest.mark.parametrize("how", ["forward", "forward_pre", "backward", "global"])
def test_any_hook_on_a_tap_takes_the_explicit_path(counted, how):
    model = _model()
    tap = model.layers[0].attn.scores
    if how == "forward":
        h = tap.register_forward_hook(lambda *a: None)
    elif how == "forward_pre":
        h = tap.register_forward_pre_hook(lambda *a: None)
    elif how == "backward":
        h = tap.register_full_backward_hook(lambda *a: None)
    else:
        h = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert tap.observed
        _step(model)
    finally:
        h.remove()
    assert counted() == ({"fused": 0, "explicit": 2} if how == "global" else {"fused": 1, "explicit": 1})
    assert not tap.observed


def test_the_explicit_flag_takes_the_explicit_path(counted):
    model = _model()
    model.layers[0].attn.explicit = True
    _step(model)
    assert counted() == {"fused": 1, "explicit": 1}


def test_dropout_and_replaced_taps_take_the_explicit_path(counted):
    model = _model(dropout=0.3)
    model.train()
    _step(model)
    assert counted() == {"fused": 0, "explicit": 2}  # the weights' dropout draws as it always did
    model.eval()
    _step(model)
    assert counted() == {"fused": 2, "explicit": 0}
    model = _model()
    model.layers[1].attn.probs = nn.Identity()  # someone's own observer in the Tap's place
    _step(model)
    assert counted() == {"fused": 1, "explicit": 1}


def test_whole_model_same_under_a_probe_in_float64():
    """The logits and every parameter gradient of a TransformerLM, fused (bare) and explicit
    (the ``explicit`` flag, under a probe), agree in float64 to a few hundred ulp of their scale."""
    model = _model().double()
    tok = torch.randint(0, SMALL.vocab_size, (3, 8), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])  # (B, T)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(tok[:, :-1], pos)
        TF.cross_entropy(logits, tok[:, 1:]).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lf, gf = run()
    attns = [m for m in model.modules() if isinstance(m, tinylm.MultiHeadSelfAttention)]
    for m in attns:
        m.explicit = True
    try:
        with probe(model):
            le, ge = run()
    finally:
        for m in attns:
            m.explicit = False
    u = _unit(torch.float64)
    dims = SMALL.d_model + SMALL.d_ff + SMALL.context_length
    assert float((lf - le).abs().max()) <= 100 * dims * u * float(lf.abs().max())
    for n in gf:
        assert float((gf[n] - ge[n]).abs().max()) <= 100 * dims * u * float(gf[n].abs().max()), n
    explicit = copy.deepcopy(model)
    for m in explicit.modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = True
    for dtype in (torch.float64, torch.float32):  # every block, branch and gradient, within roundoff
        assert diff(model.to(dtype), explicit.to(dtype), tok).first is None


@pytest.mark.parametrize("explicit", [False, True])
def test_batched_positions_rotate_each_sequence_by_its_own(explicit):
    # positions (B, T): row b of the output is the attention of sequence b alone at its 1-D positions
    g = torch.Generator().manual_seed(3)
    attn = tinylm.MultiHeadSelfAttention(8, 2, max_seq_len=32, theta=10000.0).double()
    attn.explicit = explicit
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    pos = torch.stack([torch.randperm(32, generator=g)[:5].sort().values for _ in range(3)])
    together = attn(x, pos)
    for b in range(3):
        alone = attn(x[b], pos[b])
        assert torch.allclose(together[b], alone, rtol=0, atol=1e-12), b
    # negative control: the positions matter (the first row's positions for every row differ)
    assert not torch.allclose(together[1:], attn(x[1:], pos[:1].expand(2, -1)), atol=1e-6)


@pytest.mark.parametrize("register", [
    nn.modules.module.register_module_forward_pre_hook,
    nn.modules.module.register_module_full_backward_hook,
    nn.modules.module.register_module_full_backward_pre_hook,
])
def test_each_kind_of_global_hook_alone_takes_the_explicit_path(counted, register):
    model = _model()
    hook = (lambda *a: None)
    h = register(hook)
    try:
        _step(model)
    finally:
        h.remove()
    assert counted() == {"fused": 0, "explicit": 2}
    _step(model)  # negative control: with the hook gone, the fused kernel again
    assert counted() == {"fused": 2, "explicit": 0}


def test_observed_attention_in_eval_mode_drops_nothing():
    # eval mode with dropout > 0 and an observer: the explicit path runs, and dropout is the identity there
    model = _model(dropout=0.5).eval()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(tokens)
        for block in model.layers:
            block.attn.explicit = True
        explicit = model(tokens)
    assert torch.allclose(fused, explicit, rtol=1e-5, atol=1e-5)
