"""muP in tinylm (``ModelConfig(parametrization="mup")``): each rule, exactly.

With width_mult m = d_model / mup_base_width: at m = 1 a muP model is the standard one bit for
bit (same draws, same logits), whatever the config and the scheme; the logits are lm_head's
output times 1/m exactly; the attention scores are q.k sqrt(d_base_head) / d_head; every hidden
weight's declared variance is the scheme's at the base width times 1/m (so fan_in x variance is
constant in width), the readout's and the embeddings' are the base width's. The negative controls
show the same checks reject the standard model off its base width. Exact identities in float64;
these are properties of tinylm's model, so they carry the ``tinylm_only`` marker.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import GPT2_FAMILY, generator, model_configs, seeds
from props.tolerances import unit_roundoff
import tinylm
from tinylm import init
from tinylm.model import TransformerLM

pytestmark = pytest.mark.tinylm_only

U64 = unit_roundoff(torch.float64)
SCHEMES = ("cs336", "kaiming", "torch-default", "gpt2", "small-init", "zero-residual")


def _ids(config, seed):
    return torch.randint(0, config.vocab_size, (2, min(6, config.context_length)), generator=generator(seed))


@prop("muP at its base width (m = 1) equals the standard model exactly: the same draws and the same "
      "logits, for every config of the family and every init scheme")
@settings(max_examples=20)
@given(config=model_configs(**GPT2_FAMILY), scheme=st.sampled_from(SCHEMES), seed=seeds())
def test_mup_at_base_width_is_sp(config, scheme, seed):
    sp = config.replace(init=scheme)
    mu = sp.replace(parametrization="mup", mup_base_width=sp.d_model)
    a = TransformerLM(sp, generator=generator(seed), dtype=torch.float64)
    b = TransformerLM(mu, generator=generator(seed), dtype=torch.float64)
    differ = sum(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    check(differ, 0, "a parameter differs between muP at m = 1 and SP", kind="parameters differing")
    ids = _ids(sp, seed)
    check(float((a(ids) - b(ids)).detach().abs().max()), 0.0, "the logits differ between muP at m = 1 and SP")


def _wide(config, m):
    return config.replace(parametrization="mup", mup_base_width=config.d_model // m)


@prop("muP: logits = lm_head(h) / m exactly, m = d_model / mup_base_width (float64)")
@settings(max_examples=15)
@given(config=model_configs(**GPT2_FAMILY), m=st.sampled_from([2, 4]), seed=seeds())
def test_logits_are_the_head_over_width_mult(config, m, seed):
    config = config.replace(d_model=config.d_model * m, d_ff=config.d_ff * m)
    model = TransformerLM(_wide(config, m), generator=generator(seed), dtype=torch.float64)
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, i, o: seen.append(o))
    with torch.no_grad():
        logits = model(_ids(config, seed))
    handle.remove()
    check(float((logits - seen[0] / m).abs().max() / seen[0].abs().max().clamp(min=1e-300)), 2 * U64,
          "the logits are not lm_head's output / m")


def _scores(attn, x):
    out = []
    attn.explicit = True
    handle = attn.register_observer(lambda q, k, v, heads, weights: out.append(weights[0]))
    try:
        with torch.no_grad():
            attn(x)
    finally:
        handle.remove()
        attn.explicit = False
    return out[0]


@prop("muP: attention scores = q.k sqrt(d_base_head) / d_head (NoPE, float64); SP off its base width "
      "scores 1/sqrt(d_head) (negative control)")
@settings(max_examples=15)
@given(m=st.sampled_from([2, 4, 8]), heads=st.integers(1, 3), base_head=st.sampled_from([2, 4, 8]), seed=seeds())
def test_attention_scores_one_over_d_head(m, heads, base_head, seed):
    from tinylm import ModelConfig

    d = heads * base_head * m
    for parametrization, scale in (("mup", math.sqrt(base_head) / (base_head * m)),
                                   ("sp", 1 / math.sqrt(base_head * m))):
        config = ModelConfig(vocab_size=16, context_length=6, d_model=d, num_layers=1, num_heads=heads, d_ff=d,
                             positions="none", parametrization=parametrization,
                             mup_base_width=d // m if parametrization == "mup" else None)
        attn = TransformerLM(config, generator=generator(seed), dtype=torch.float64).layers[0].attn
        x = torch.randn(1, 6, d, generator=generator(seed + 1), dtype=torch.float64)
        with torch.no_grad():
            q = attn.q_proj(x).view(1, 6, heads, -1).transpose(1, 2)  # (B, H, T, d_head)
            k = attn.k_proj(x).view(1, 6, heads, -1).transpose(1, 2)
        want = (q @ k.transpose(-1, -2)) * scale
        s = _scores(attn, x)
        mask = torch.isfinite(s)
        err = float(((s - want)[mask]).abs().max() / want[mask].abs().max())
        check(err, (base_head * m + 4) * U64, f"{parametrization}: scores are not q.k x {scale:.4g}")


@prop("muP init: each hidden weight's declared variance is the scheme's at the base width over m "
      "(fan_in x variance constant in width); the readout's and the embeddings' are the base width's")
@settings(max_examples=15)
@given(config=model_configs(**GPT2_FAMILY), scheme=st.sampled_from(SCHEMES), m=st.sampled_from([2, 4]))
def test_declared_variances(config, scheme, m):
    base = config.replace(init=scheme, parametrization="mup", mup_base_width=config.d_model)
    wide = base.replace(d_model=config.d_model * m, d_ff=config.d_ff * m)
    at_base = init.declare(TransformerLM(base, device="meta"), scheme)
    at_m = init.declare(TransformerLM(wide, device="meta"), scheme)
    roles = tinylm.mup.classify(TransformerLM(base, device="meta"))
    worst = 0.0
    for name, role in roles.items():
        want = at_base[name].variance / (m if role == "hidden" else 1)
        got = at_m[name].variance
        worst = max(worst, abs(got - want) / max(want, 1e-300)) if want else max(worst, abs(got))
    check(worst, 64 * U64, "a declared variance breaks muP's rule")


@prop("negative control: the standard model's declared hidden variances at m = 4 are not the base width's / m "
      "under the fixed-std gpt2 scheme")
@settings(max_examples=5)
@given(config=model_configs(**GPT2_FAMILY))
def test_sp_fixed_std_breaks_the_rule(config):
    base = config.replace(init="gpt2")
    wide = base.replace(d_model=config.d_model * 4, d_ff=config.d_ff * 4)
    a = init.declare(TransformerLM(base, device="meta"), "gpt2")["layers.0.attn.q_proj.weight"].variance
    b = init.declare(TransformerLM(wide, device="meta"), "gpt2")["layers.0.attn.q_proj.weight"].variance
    check(1 / (abs(b * 4 / a - 1) + 1e-300), 1.0, "SP's fixed std scaled like muP's", kind="1/|rel. departure|")
