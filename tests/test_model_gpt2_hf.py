"""The "gpt2" preset's architecture is GPT-2's: tinylm against ``transformers.GPT2LMHeadModel``.

A randomly initialised Hugging Face GPT-2 (built from a config here; nothing is downloaded)
has its weights mapped onto a tinylm model of the same sizes: ``c_attn`` (a Conv1D, weight
(d, 3d)) splits into q/k/v_proj, Conv1D weights are transposed, ``wte``/``wpe``/``ln_f`` map
to ``token_embeddings``/``position_embeddings``/``ln_final``. Logits must agree in float64.
"""

from __future__ import annotations

import pytest
import torch

import tinylm

transformers = pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')

CONFIG = tinylm.preset("gpt2", vocab_size=41, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=64)


def _hf_gpt2(c: tinylm.ModelConfig, activation: str = "gelu_new"):
    cfg = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.context_length, n_embd=c.d_model, n_layer=c.num_layers,
        n_head=c.num_heads, n_inner=c.d_ff, activation_function=activation, layer_norm_epsilon=c.eps,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).double().eval()
        with torch.no_grad():  # GPT-2 starts its biases and LayerNorm at 0 / 1: randomise all, so each must map
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def _to_tinylm(hf, c: tinylm.ModelConfig) -> dict[str, torch.Tensor]:
    """The tinylm state dict of a Hugging Face GPT-2 (Conv1D weights are (in, out): transposed)."""
    s = hf.state_dict()
    out = {"token_embeddings.weight": s["transformer.wte.weight"], "position_embeddings.weight": s["transformer.wpe.weight"],
           "ln_final.weight": s["transformer.ln_f.weight"], "ln_final.bias": s["transformer.ln_f.bias"],
           "lm_head.weight": s["transformer.wte.weight"]}
    for i in range(c.num_layers):
        h, t = f"transformer.h.{i}.", f"layers.{i}."
        for a, b in (("ln_1", "ln1"), ("ln_2", "ln2")):
            out[t + b + ".weight"], out[t + b + ".bias"] = s[h + a + ".weight"], s[h + a + ".bias"]
        qkv_w, qkv_b = s[h + "attn.c_attn.weight"].T.chunk(3, dim=0), s[h + "attn.c_attn.bias"].chunk(3)
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[t + f"attn.{name}.weight"], out[t + f"attn.{name}.bias"] = qkv_w[j], qkv_b[j]
        for a, b in (("attn.c_proj", "attn.output_proj"), ("mlp.c_fc", "ffn.w1"), ("mlp.c_proj", "ffn.w2")):
            out[t + b + ".weight"], out[t + b + ".bias"] = s[h + a + ".weight"].T, s[h + a + ".bias"]
    return out


def _gap(c: tinylm.ModelConfig, hf) -> float:
    model = tinylm.TransformerLM(c, dtype=torch.float64).eval()
    model.load_state_dict(_to_tinylm(hf, c))
    x = torch.randint(0, c.vocab_size, (3, c.context_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((model(x) - hf(x).logits).abs().max())


def test_gpt2_preset_computes_huggingface_gpt2():
    assert _gap(CONFIG, _hf_gpt2(CONFIG)) < 1e-12


def test_the_comparison_tells_gelu_new_from_exact_gelu():
    """Negative control: Hugging Face's "gelu" (exact) where GPT-2 has "gelu_new" (tanh) is told apart."""
    assert _gap(CONFIG, _hf_gpt2(CONFIG, activation="gelu")) > 1e-6
