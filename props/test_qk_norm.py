"""QK-norm: the per-head query/key norm of tinylm's attention bounds every attention score.

With ``qk_norm="rms"`` the heads' queries and keys are q_hat = q / sqrt(mean(q^2) + eps) * g_q
(and k_hat likewise) over d_k, before RoPE. A rotation keeps norms and |q / sqrt(mean q^2 + eps)|
<= sqrt(d_k), so by Cauchy-Schwarz every score s = q_hat . k_hat / sqrt(d_k) satisfies

    |s| <= |q_hat| |k_hat| / sqrt(d_k) <= sqrt(d_k) max|g_q| max|g_k|

(sqrt(d_k) at unit gains, LayerNorm's centred output included), whatever the weights and the
inputs; and at eps = 0 scaling W_q or W_k by any c > 0 leaves every score unchanged. Without the
norm neither holds (the negative controls). These are properties of tinylm's module, so they carry
the ``tinylm_only`` marker.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import GPT2_FAMILY, generator, model_configs, seeds, sizes
from props.tolerances import unit_roundoff
from tinylm import checkpoint, init, memory
from tinylm.layers import MultiHeadSelfAttention
from tinylm.model import TransformerLM

pytestmark = pytest.mark.tinylm_only

U64 = unit_roundoff(torch.float64)


@st.composite
def attention_case(draw, qk_norms=("rms", "layer"), eps=(0.0, 1e-5)):
    """(attention, x): float64, 1-3 K/V heads in groups of 1-2, d_k 2-16, RoPE or not, weights of
    std 10^e (e in [-3, 4]), inputs of std 10^f (f in [-3, 3]); norm gains 1 and biases 0."""
    kv, groups = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    dk, T, lead = 2 * draw(st.integers(1, 8)), draw(sizes(1, 6)), draw(sizes(1, 2))
    heads = kv * groups
    g = generator(draw(seeds()))
    attn = MultiHeadSelfAttention(heads * dk, heads, 8, 10000.0 if draw(st.booleans()) else None, num_kv_heads=kv,
                                  qk_norm=draw(st.sampled_from(qk_norms)), eps=draw(st.sampled_from(eps)),
                                  dtype=torch.float64)
    scale = 10.0 ** draw(st.floats(-3.0, 4.0))
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    x = torch.randn(lead, T, heads * dk, generator=g, dtype=torch.float64) * 10.0 ** draw(st.floats(-3.0, 3.0))
    return attn, x


def scores_of(attn: MultiHeadSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The attention's scores (..., H, T, T) as its explicit path forms them, masked entries left out
    (a flat tensor of the causal entries)."""
    seen = []
    attn.explicit = True
    handle = attn.register_observer(lambda q, k, v, heads, weights: seen.append(weights[0]))
    try:
        with torch.no_grad():
            attn(x)
    finally:
        handle.remove()
        attn.explicit = False
    s = seen[0]
    return s[torch.isfinite(s)]


def _bound_tol(dk: int) -> float:
    """Rounding of the bound in float64: the norm's mean square and root, RoPE's rotation, the d_k-term dot."""
    return (4 * dk + 16) * U64


@prop("qk-norm (RMSNorm or LayerNorm, unit gains): every score |q_hat.k_hat|/sqrt(d_k) <= sqrt(d_k), "
      "for weights up to 10^4 and any input (float64)")
@given(case=attention_case())
def test_qk_norm_bounds_every_score(case):
    attn, x = case
    s = scores_of(attn, x)
    dk = attn.d_k
    check(float(s.abs().max()) / math.sqrt(dk), 1 + _bound_tol(dk), "a score exceeds sqrt(d_k)", kind="|s|/sqrt(d_k)")


@prop("qk-norm with gains g_q, g_k (RMSNorm): every score <= sqrt(d_k) max|g_q| max|g_k| (float64)")
@given(case=attention_case(qk_norms=("rms",)), seed=seeds(), gain=st.floats(-2.0, 2.0))
def test_qk_norm_bound_with_gains(case, seed, gain):
    attn, x = case
    g = generator(seed)
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.randn(attn.d_k, generator=g, dtype=torch.float64) * 10.0**gain)
        attn.k_norm.weight.copy_(torch.randn(attn.d_k, generator=g, dtype=torch.float64))
    bound = math.sqrt(attn.d_k) * float(attn.q_norm.weight.detach().abs().max()) * float(attn.k_norm.weight.detach().abs().max())
    s = scores_of(attn, x)
    check(float(s.abs().max()) / bound, 1 + _bound_tol(attn.d_k), "a score exceeds sqrt(d_k) max|g_q| max|g_k|",
          kind="|s|/bound")


@prop("qk-norm (eps = 0): scaling W_q by c > 0 and W_k by c' > 0 leaves every score unchanged (float64)")
@given(case=attention_case(eps=(0.0,)), cq=st.floats(-3.0, 3.0), ck=st.floats(-3.0, 3.0))
def test_qk_norm_scores_ignore_the_weights_scale(case, cq, ck):
    attn, x = case
    before = scores_of(attn, x)
    with torch.no_grad():
        attn.q_proj.weight.mul_(10.0**cq)
        attn.k_proj.weight.mul_(10.0**ck)
    after = scores_of(attn, x)
    err = float((after - before).abs().max()) / math.sqrt(attn.d_k)
    check(err, 4 * _bound_tol(attn.d_k), "the scores changed with the scale of W_q or W_k")


@prop("negative control: without qk-norm, weights of std 3 break the bound sqrt(d_k)")
@settings(max_examples=10)
@given(seed=seeds(), dk=st.sampled_from([4, 8, 16]))
def test_no_qk_norm_breaks_the_bound(seed, dk):
    g = generator(seed)
    attn = MultiHeadSelfAttention(2 * dk, 2, 8, 10000.0, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 3.0)
    x = torch.randn(2, 6, 2 * dk, generator=g, dtype=torch.float64)
    ratio = float(scores_of(attn, x).abs().max()) / math.sqrt(dk)
    check(1 / ratio, 1.0, "negative control: scores without qk-norm stayed within sqrt(d_k)", kind="sqrt(d_k)/max|s|")


@prop("negative control: without qk-norm, scaling W_q by c scales every score by c")
@settings(max_examples=10)
@given(seed=seeds(), c=st.floats(-3.0, 3.0).filter(lambda e: abs(e) > 0.1))
def test_no_qk_norm_scores_follow_the_weights_scale(seed, c):
    g = generator(seed)
    attn = MultiHeadSelfAttention(8, 2, 8, 10000.0, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    before = scores_of(attn, x)
    with torch.no_grad():
        attn.q_proj.weight.mul_(10.0**c)
    after = scores_of(attn, x)
    rel = float(((after - before * 10.0**c).abs().max()) / (before.abs().max() * 10.0**c))
    check(rel, 64 * U64, "without qk-norm the scores did not scale with W_q")
    assert float((after - before).abs().max()) > 0.2 * float(before.abs().max())


@prop("qk-norm configs of the whole family: parameter count = memory._params, every scheme declares the norms' "
      "gains 1 and biases 0 and draws them so, a checkpoint round trip keeps the config and the function")
@settings(max_examples=15, deadline=None)
@given(cfg=model_configs(max_layers=2, max_vocab=24, max_context=6, qk_norms=("rms", "layer"), **GPT2_FAMILY),
       scheme=st.sampled_from(sorted(init.SCHEMES)), seed=seeds())
def test_qk_norm_configs_count_declare_and_round_trip(cfg, scheme, seed, tmp_path_factory):
    model = TransformerLM(cfg, generator(seed))
    assert model.num_parameters() == memory._params(cfg)
    drawn = init.apply(model, scheme, generator=generator(seed))
    norms = {n: p for n, p in model.named_parameters() if "_norm." in n}
    assert len(norms) == cfg.num_layers * (4 if cfg.qk_norm == "layer" else 2)
    for name, p in norms.items():
        value = 1.0 if name.endswith("weight") else 0.0
        assert drawn[name].family == "constant" and drawn[name].value == value and bool((p == value).all()), name
    path = tmp_path_factory.mktemp("qk") / "m.pt"
    checkpoint.save(path, model)
    back, _ = checkpoint.load(path)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=generator(seed))
    with torch.no_grad():
        assert back.config == cfg and torch.equal(back(ids), model.eval()(ids))
