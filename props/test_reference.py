"""tinylm's own contract: ``tinylm.reference.BuiltinLM`` computes what ``TransformerLM`` computes.

Loaded with a tinylm model's state dict (same keys, strict), the built-in reference
gives the same logits in float64 for every variant it covers, at every length up to
the context, in every input dtype it is given; it refuses the variants it does not
cover, naming them. Properties of tinylm itself: ``tinylm_only``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, model_configs
from tinylm.config import ModelConfig
from tinylm.errors import ConfigError
from tinylm.model import TransformerLM
from tinylm.reference import BuiltinLM

pytestmark = pytest.mark.tinylm_only

U64 = torch.finfo(torch.float64).eps


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norm gains away from 1 (so that a swapped or missing gain shows) and larger weights."""
    g = generator(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 1.5 + 0.25)
    return model


@prop("BuiltinLM with TransformerLM's weights = TransformerLM in float64: pre-norm, SwiGLU or SiLU, RoPE or not, tied or not, "
      "any eps and theta, every length up to the context")
@settings(max_examples=20, deadline=None)
@given(cfg=model_configs(max_layers=2, max_vocab=24, max_context=8, norms=("pre",)), seed=st.integers(0, 2**31),
       eps=st.sampled_from([1e-5, 1e-2, 0.5]), theta=st.sampled_from([3.0, 10000.0]), data=st.data())
def test_builtin_reference_is_the_model(cfg, seed, eps, theta, data):
    cfg = cfg.replace(eps=eps, rope_theta=theta)
    ours = _randomised(TransformerLM(cfg, generator(seed), dtype=torch.float64), seed).eval()
    ref = BuiltinLM(cfg).double()
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert set(ref.state_dict()) == set(ours.state_dict())
    assert (ref.lm_head.weight is ref.token_embeddings.weight) == cfg.tie_embeddings
    T = data.draw(st.integers(1, cfg.context_length))
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=generator(seed + 1))
    with torch.no_grad():
        a, b = ours(tokens), ref(tokens)
    assert a.shape == b.shape == (2, T, cfg.vocab_size) and b.dtype == torch.float64
    scale = float(a.abs().max()) + 1.0
    check(float((a - b).abs().max()) / scale, 512 * cfg.num_layers * (cfg.d_model + cfg.d_ff) * U64,
          "BuiltinLM differs from TransformerLM")


def test_reference_keeps_the_input_dtype_and_computes_norms_in_float32():
    cfg = ModelConfig(vocab_size=16, context_length=6, d_model=8, num_layers=1, num_heads=2, d_ff=12)
    ours = TransformerLM(cfg, generator(3)).eval()
    ref = BuiltinLM(cfg)
    ref.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 16, (1, 6), generator=generator(4))
    assert torch.allclose(ours(tokens), ref(tokens), rtol=1e-4, atol=1e-5)
    x = torch.randn(2, 3, 8, generator=generator(5)).to(torch.bfloat16) * 100
    norm = ref.ln_final
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + cfg.eps)).to(torch.bfloat16)
    got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact)
    assert ref.layers[0].attn.phase.dtype == torch.complex128 and ref.layers[0].attn.phase.shape == (6, 2)
    assert "layers.0.attn.phase" not in ref.state_dict() and ref.config is cfg


@pytest.mark.parametrize("changes, message", [
    ({"norm": "post"}, "BuiltinLM covers pre-norm without dropout; got norm='post', dropout=0.0"),
    ({"norm": "none"}, "BuiltinLM covers pre-norm without dropout; got norm='none', dropout=0.0"),
    ({"dropout": 0.1}, "BuiltinLM covers pre-norm without dropout; got norm='pre', dropout=0.1"),
])
def test_reference_refuses_what_it_does_not_cover(changes, message):
    cfg = ModelConfig(vocab_size=16, context_length=6, d_model=8, num_layers=1, num_heads=2, d_ff=12, **changes)
    with pytest.raises(ConfigError) as info:
        BuiltinLM(cfg)
    assert str(info.value) == message
