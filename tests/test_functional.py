"""Every op of tinylm.functional against torch's own, in float64, for 1 to 4 leading dimensions."""

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given
from hypothesis import strategies as st

from tinylm import functional as F

TOL = dict(rtol=1e-12, atol=1e-12)

leading = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**31 - 1)


def randn(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@given(leading, st.integers(1, 9), seeds, st.sampled_from([0.1, 1.0, 30.0]))
def test_softmax_and_log_softmax_match_torch(lead, n, seed, scale):
    x = randn((*lead, n), seed, scale)
    for dim in range(-x.dim(), x.dim()):
        torch.testing.assert_close(F.softmax(x, dim), TF.softmax(x, dim), **TOL)
        torch.testing.assert_close(F.log_softmax(x, dim), TF.log_softmax(x, dim), **TOL)
        torch.testing.assert_close(F.logsumexp(x, dim), torch.logsumexp(x, dim), **TOL)


@given(leading, st.integers(2, 9), seeds, st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_cross_entropy_matches_torch_with_label_smoothing(lead, C, seed, eps):
    logits = randn((*lead, C), seed, 3.0)
    targets = torch.randint(0, C, lead, generator=torch.Generator().manual_seed(seed + 1))
    ours = F.cross_entropy(logits, targets, label_smoothing=eps)
    ref = TF.cross_entropy(logits.reshape(-1, C), targets.reshape(-1), label_smoothing=eps)
    torch.testing.assert_close(ours, ref, **TOL)


def test_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="targets must have the logits' shape"):
        F.cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.long))


@given(leading, st.integers(1, 6), st.integers(1, 6), st.integers(1, 8), seeds)
def test_sdpa_matches_torch_with_boolean_mask(lead, Tq, Tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    Q, K, V = (torch.randn((*lead, T, d), generator=g, dtype=torch.float64) for T in (Tq, Tk, Tk))
    mask = torch.rand((*lead, Tq, Tk), generator=g) < 0.7
    mask[..., 0] = True  # every query may attend somewhere (an all-masked row is NaN in torch)
    ref = TF.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    torch.testing.assert_close(F.scaled_dot_product_attention(Q, K, V, mask), ref, **TOL)
    torch.testing.assert_close(F.scaled_dot_product_attention(Q, K, V), TF.scaled_dot_product_attention(Q, K, V), **TOL)


@given(leading, st.integers(1, 9), seeds)
def test_silu_matches_torch(lead, n, seed):
    x = randn((*lead, n), seed, 5.0)
    torch.testing.assert_close(F.silu(x), TF.silu(x), **TOL)


@given(leading, st.integers(1, 9), seeds, st.sampled_from([1e-5, 1e-2]))
def test_rms_norm_matches_torch(lead, n, seed, eps):
    x = randn((*lead, n), seed)
    w = randn((n,), seed + 1)
    torch.testing.assert_close(F.rms_norm(x, w, eps), TF.rms_norm(x, (n,), w, eps), **TOL)


def test_rms_norm_upcasts_and_returns_input_dtype():
    x = torch.full((2, 8), 300.0, dtype=torch.float16)  # 300^2 overflows float16 (max 65504)
    out = F.rms_norm(x, None, 1e-5)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), torch.ones(2, 8), rtol=1e-3, atol=1e-3)


def test_dropout_is_inverted_and_identity_in_eval():
    x = torch.ones(200_000, dtype=torch.float64)
    y = F.dropout(x, 0.25, training=True, generator=torch.Generator().manual_seed(0))
    kept = y != 0
    assert torch.all(y[kept] == 1 / 0.75)  # survivors are rescaled by 1/(1-p)
    assert torch.equal(F.dropout(x, 0.25, training=False), x)
    with pytest.raises(ValueError, match="p=1.0"):
        F.dropout(x, 1.0)


def test_causal_mask_is_lower_triangular():
    assert torch.equal(F.causal_mask(4), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_all_masked_row_logsumexp_is_minus_inf_not_nan():
    x = torch.full((3,), float("-inf"), dtype=torch.float64)
    assert F.logsumexp(x).item() == float("-inf")
