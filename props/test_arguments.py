"""Every argument of every public function, not only its default; every argument check and its message.

Defaults are checked by calling without the argument and comparing bitwise with the
explicit value; the other values by their own formula. Bad arguments must raise a
ValueError whose message names ``name=value`` (the project's message pattern).
Dropout's generator must be the only randomness it draws from: a seeded call
replays bitwise, leaves torch's global generator untouched, and p = 0 draws nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given
from hypothesis import strategies as st

from props.record import check, prop
from props.stattests import binomial_test
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff

U64 = unit_roundoff(torch.float64)


@st.composite
def mats(draw, max_side: int = 6):
    g = generator(draw(seeds()))
    shape = tuple(draw(st.lists(sizes(1, max_side), min_size=1, max_size=3)))
    return torch.randn(shape, generator=g, dtype=torch.float64) * 3


@prop("defaults: softmax, log_softmax, logsumexp use dim=-1 and keepdim=False (bitwise)", needs=("softmax", "log_softmax", "logsumexp"))
@given(x=mats())
def test_reduction_defaults(impl, x):
    assert torch.equal(impl.softmax(x), impl.softmax(x, -1))
    assert torch.equal(impl.log_softmax(x), impl.log_softmax(x, -1))
    assert torch.equal(impl.logsumexp(x), impl.logsumexp(x, -1))
    assert impl.logsumexp(x).shape == x.shape[:-1]
    check(0.0, 0.0, "defaults", kind="exact")


@prop("logsumexp(keepdim=True) keeps the reduced axis (size 1) with the same values, on any dim", needs=("logsumexp",))
@given(x=mats(), data=st.data())
def test_logsumexp_keepdim(impl, x, data):
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1), label="dim")
    kept = impl.logsumexp(x, dim, keepdim=True)
    want_shape = list(x.shape)
    want_shape[dim] = 1
    assert list(kept.shape) == want_shape, f"keepdim=True gave shape {tuple(kept.shape)}"
    assert torch.equal(kept.squeeze(dim), impl.logsumexp(x, dim, keepdim=False))
    err = float((kept - torch.logsumexp(x, dim, keepdim=True)).abs().max())
    check(err, 4 * (x.shape[dim] + 8) * U64 * (1 + float(x.abs().max())), f"logsumexp keepdim along dim={dim}")


@prop("cross_entropy: label_smoothing defaults to 0 (bitwise) and 1 gives the uniform target: lse - mean z", needs=("cross_entropy",))
@given(seed=seeds(), N=sizes(1, 6), C=sizes(2, 9))
def test_cross_entropy_smoothing_ends(impl, seed, N, C):
    g = generator(seed)
    z = torch.randn(N, C, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, C, (N,), generator=g)
    default = impl.cross_entropy(z, t)
    assert torch.equal(default, impl.cross_entropy(z, t, label_smoothing=0.0)), "label_smoothing does not default to 0"
    lse = torch.logsumexp(z, -1)
    full = impl.cross_entropy(z, t, label_smoothing=1.0)
    err = max(abs(float(default) - float((lse - z[torch.arange(N), t]).mean())), abs(float(full) - float((lse - z.mean(-1)).mean())))
    check(err, 16 * (C + 8) * U64 * (1 + float(z.abs().max())), "CE at label_smoothing 0 (default) and 1")


@prop("cross_entropy with masked (-inf) non-target classes stays finite and equals the unmasked-class formula", needs=("cross_entropy",))
@given(seed=seeds(), N=sizes(1, 6), C=sizes(3, 9))
def test_cross_entropy_masked_classes(impl, seed, N, C):
    g = generator(seed)
    z = torch.randn(N, C, generator=g, dtype=torch.float64)
    t = torch.randint(0, C, (N,), generator=g)
    masked = (torch.rand(N, C, generator=g) < 0.4) & (torch.arange(C) != t[:, None])
    zm = z.masked_fill(masked, float("-inf"))
    loss = impl.cross_entropy(zm, t)
    assert math.isfinite(float(loss)), f"cross_entropy with masked classes is {float(loss)}"
    ref = (torch.logsumexp(zm, -1) - z[torch.arange(N), t]).mean()
    check(abs(float(loss - ref)), 16 * (C + 8) * U64 * (1 + float(z.abs().max())), "CE with masked classes")


@prop("cross_entropy rejects label_smoothing outside [0, 1] and mismatched shapes, naming the value", needs=("cross_entropy",))
@pytest.mark.parametrize("ls", [-0.1, 1.5, 2.0, 3.0])
def test_cross_entropy_bad_arguments(impl, ls):
    z, t = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"label_smoothing={ls}"):
        impl.cross_entropy(z, t, label_smoothing=ls)
    msg = r"^logits shape \(2, 3\) and targets shape \(3,\): targets must have the logits' shape without the last \(class\) dimension$"
    with pytest.raises(ValueError, match=msg):
        impl.cross_entropy(z, torch.zeros(3, dtype=torch.long))
    check(0.0, 0.0, "argument checks", kind="raises")


# -- dropout ------------------------------------------------------------------------------------------


@prop("dropout: training defaults to True; p = 1 and p < 0 raise naming p=; p = 0 returns x and draws nothing", needs=("dropout",), alpha=1e-6)
@given(seed=seeds(), p=st.sampled_from([0.25, 0.5]))
def test_dropout_arguments(impl, seed, p):
    x = torch.ones(2000, dtype=torch.float64)
    y = impl.dropout(x, p, generator=generator(seed))
    res = binomial_test(int((y == 0).sum()), x.numel(), p, claim="default training=True drops with probability p").record()
    assert not res.rejected, str(res)
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"p={bad}"):
            impl.dropout(x, bad, True, generator(seed))
    gen = generator(seed)
    before = gen.get_state()
    assert torch.equal(impl.dropout(x, 0.0, True, gen), x)
    assert torch.equal(gen.get_state(), before), "dropout at p = 0 drew from the generator"
    on_meta = impl.dropout(torch.empty(3, 4, device="meta"), p, True)  # the mask is drawn on x's device
    assert on_meta.device.type == "meta" and on_meta.shape == (3, 4)


@prop("dropout is reproducible from its generator alone: same seed bitwise equal, global RNG untouched; seeds differ", needs=("dropout",))
@given(seed=seeds(), p=st.sampled_from([0.1, 0.5]))
def test_dropout_generator(impl, seed, p):
    x = torch.randn(512, generator=generator(seed + 1), dtype=torch.float64)
    state = torch.get_rng_state()
    a = impl.dropout(x, p, True, generator(seed))
    torch.manual_seed(12345)  # a different global state must not matter
    b = impl.dropout(x, p, True, generator(seed))
    torch.set_rng_state(state)
    c = impl.dropout(x, p, True, generator(seed))
    assert torch.equal(torch.get_rng_state(), state), "dropout with a generator drew from the global RNG"
    assert torch.equal(a, b) and torch.equal(a, c), "dropout with the same generator seed differs"
    other = impl.dropout(x, p, True, generator(seed ^ 0x5A5A5A5A))
    assert not torch.equal(a, other), "dropout ignores its generator (two seeds, same mask)"  # P = 2^-512-ish
    check(0.0, 0.0, "dropout generator", kind="exact")


# -- helpers of tinylm.functional -----------------------------------------------------------------------


@prop("causal_mask(T, device): True where j <= i, on the device asked for", needs=("functional",))
@given(T=sizes(1, 12))
def test_causal_mask(impl, T):
    m = impl.functional.causal_mask(T)
    i = torch.arange(T)
    assert m.dtype == torch.bool and torch.equal(m, i[:, None] >= i[None, :])
    assert impl.functional.causal_mask(T, device="meta").device.type == "meta", "causal_mask ignored its device"
    check(0.0, 0.0, "causal mask", kind="exact")


@prop("attention_scores: Q K^T / sqrt(d_k), -inf exactly where mask is False; mask=None masks nothing", needs=("functional",))
@given(seed=seeds(), tq=sizes(1, 6), tk=sizes(1, 6), dk=sizes(1, 8))
def test_attention_scores(impl, seed, tq, tk, dk):
    g = generator(seed)
    Q, K = torch.randn(2, tq, dk, generator=g, dtype=torch.float64), torch.randn(2, tk, dk, generator=g, dtype=torch.float64)
    mask = torch.rand(tq, tk, generator=g) < 0.5
    S, S0 = impl.functional.attention_scores(Q, K, mask), impl.functional.attention_scores(Q, K)
    ref = Q @ K.transpose(-2, -1) / math.sqrt(dk)
    assert bool(torch.isneginf(S[..., ~mask]).all()) and bool(torch.isfinite(S[..., mask]).all())
    assert bool(torch.isfinite(S0).all())
    err = float((S0 - ref).abs().max()) / (1 + float(ref.abs().max()))
    assert torch.equal(S[..., mask], S0[..., mask])
    check(err, 4 * (dk + 4) * U64, "attention scores")


@prop("rope_angles = p theta^(-2k/d_k) in float64 for any position dtype; odd d_k raises naming d_k=", needs=("functional",))
@given(seed=seeds(), dk=st.integers(1, 8).map(lambda k: 2 * k), theta=st.sampled_from([10.0, 1e4, 5e5]))
def test_rope_angles(impl, seed, dk, theta):
    pos = torch.randint(0, 4096, (5,), generator=generator(seed))
    ang = impl.functional.rope_angles(theta, dk, pos)
    k = torch.arange(dk // 2, dtype=torch.float64)
    ref = pos.double()[:, None] * theta ** (-2 * k / dk)
    assert ang.dtype == torch.float64 and ang.shape == (5, dk // 2)
    assert torch.equal(impl.functional.rope_angles(theta, dk, pos.to(torch.int32)), ang)
    with pytest.raises(ValueError, match=rf"d_k={dk + 1}"):
        impl.functional.rope_angles(theta, dk + 1, pos)
    err = float(((ang - ref).abs() / (ref.abs() + 1e-300)).max())
    check(err, 8 * U64, "rope angles", kind="rel error")


@prop("apply_rope(x, cos, sin) rotates adjacent pairs by the given angles (any angles, any leading dims)", needs=("functional",))
@given(seed=seeds(), dk=st.integers(1, 6).map(lambda k: 2 * k), T=sizes(1, 5))
def test_apply_rope(impl, seed, dk, T):
    g = generator(seed)
    x = torch.randn(3, T, dk, generator=g, dtype=torch.float64)
    ang = torch.rand(T, dk // 2, generator=g, dtype=torch.float64) * 20 - 10
    out = impl.functional.apply_rope(x, torch.cos(ang), torch.sin(ang))
    a, b = x[..., 0::2], x[..., 1::2]
    ref = torch.stack((a * torch.cos(ang) - b * torch.sin(ang), a * torch.sin(ang) + b * torch.cos(ang)), -1).flatten(-2)
    check(float((out - ref).abs().max()), 4 * U64 * (1 + float(x.abs().max())), "apply_rope")


@prop("rms_norm(x, weight=None, eps) is the gainless x / sqrt(mean(x^2) + eps), at any eps", needs=("functional",))
@given(seed=seeds(), d=sizes(1, 16), eps=st.sampled_from([0.0, 1e-6, 1e-2, 10.0]))
def test_rms_norm_no_weight(impl, seed, d, eps):
    x = torch.randn(4, d, generator=generator(seed), dtype=torch.float64) + 0.1
    out = impl.functional.rms_norm(x, None, eps)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    check(float(((out - ref).abs() / (ref.abs() + 1e-300)).max()), 4 * (d + 8) * U64, "rms_norm without weight", kind="rel error")


@prop("scaled_dot_product_attention: mask=None is full (unmasked) attention, = torch SDPA", needs=("scaled_dot_product_attention",))
@given(seed=seeds(), tq=sizes(1, 6), tk=sizes(1, 6), dk=sizes(1, 8))
def test_attention_no_mask(impl, seed, tq, tk, dk):
    g = generator(seed)
    Q, K, V = (torch.randn(2, t, dk, generator=g, dtype=torch.float64) for t in (tq, tk, tk))
    out = impl.scaled_dot_product_attention(Q, K, V)
    ref = TF.scaled_dot_product_attention(Q, K, V)
    check(float((out - ref).abs().max()), 16 * (dk + tk + 8) * U64 * (1 + float(Q.abs().max() * K.abs().max())), "SDPA without mask")
