"""Every job on the Hugging Face causal LMs people train, as transformers builds them.

Each architecture is built from its own config class at a test size (2 layers, d_model 64, 4
heads; no weights are read) and goes through ``diagnose``, ``diff``, a ``Watch`` inside a plain
AdamW loop and ``precision``: transformers' own modules, attention implementations (SDPA, ALiBi,
RoPE variants, QK-norm, soft-capping, sliding windows, multi-latent attention), parallel blocks
and mixtures of experts, none of them written here. What is held, per architecture:

* ``diagnose``: every point of ``instrument_points`` measured forward and backward, one attention
  row per layer and a depth row per residual point;
* ``diff``: a model against its twin (same seed) is the same within roundoff at every site, none
  unpaired, every block's attention and MLP found (OPT's MLP of the block's own linear layers) and
  the final norm (OLMo's without parameters, OPT's registered before the blocks); the negative control, noise added to one linear layer of block 1, departs first in
  block 1 (never earlier);
* the watch: two records in four steps, each with every block's moments and every layer's
  attention;
* ``precision``: every ``nn.Linear`` (or GPT-2 ``Conv1D``) measured;
* the model left as it was (parameters bit for bit) and ``scaled_dot_product_attention`` put back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import diagnostics  # noqa: E402
from diagnostics import DiagnoseOptions, DiffOptions, PrecisionOptions  # noqa: E402
from diagnostics.measure.blocks import find_blocks  # noqa: E402

V, D, L, H = 512, 64, 2, 4
_COMMON = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=128,
               max_position_embeddings=64)
_GPT = dict(n_embd=D, n_layer=L, n_head=H, n_positions=64)
_KV2 = dict(num_key_value_heads=2)
#: name: (config class, model class, what differs from _COMMON)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", _KV2),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _KV2),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_KV2, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, num_key_value_heads=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_KV2, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_KV2, head_dim=16)),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=H)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _KV2),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_KV2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_KV2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         n_group=1, topk_group=1)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=8)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(_GPT, rotary_dim=8, n_ctx=64)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=D)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=L, n_head=H)),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", _GPT),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _GPT),
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=D, n_layers=L, n_heads=H, max_seq_len=64)),
}


def _build(arch: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    if not hasattr(transformers, config_cls) or not hasattr(transformers, model_cls):
        pytest.skip(f"this transformers has no {model_cls}")
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from transformers.pytorch_utils import Conv1D
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def _watched_steps(model: torch.nn.Module, steps: int = 4) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = diagnostics.Watch(model, every=2, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            x = torch.randint(0, V, (2, 17), generator=g)
            with watch.step(step):
                logits = model(x[:, :-1]).logits
                F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
    finally:
        watch.close()
    return watch.history


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_job_runs_on_the_architecture_and_measures_every_site(arch):
    model = _build(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sdpa = F.scaled_dot_product_attention
    blocks = find_blocks(model)
    assert blocks is not None and len(blocks) == L

    result = diagnostics.diagnose(model, None, DiagnoseOptions(batch_size=2, seq_len=16, batches=2))
    measured = {(t.name, t.direction) for t in result.tensors if t.count}
    unmeasured = [(p, d) for p in diagnostics.instrument_points(model) for d in ("forward", "backward")
                  if (p, d) not in measured]
    assert not unmeasured, unmeasured
    assert len(result.attention) == L and len(result.depth) == L + 1

    twin = _build(arch)
    same = diagnostics.diff(model, twin, None, DiffOptions(batch_size=2, seq_len=16))
    assert not same.departures and not same.unpaired and str(same).startswith("same within roundoff")
    assert len({r.site for r in same.rows}) == 3 * L + 3  # embedding; each block's attention, MLP, output; norm; logits
    name, layer = _linears(dict(twin.named_modules())[blocks.names[1]])[-1]
    with torch.no_grad():  # negative control: noise no norm can absorb, in block 1
        g = torch.Generator().manual_seed(2)
        layer.weight.add_(torch.randn(layer.weight.shape, generator=g) * 0.5 * float(layer.weight.std()))
    moved = diagnostics.diff(model, twin, None, DiffOptions(batch_size=2, seq_len=16))
    assert moved.first is not None and moved.first.block == 1, (name, moved.first)

    precision = diagnostics.precision(model, None, PrecisionOptions(batch_size=2, seq_len=16)).to_frame()
    assert set(precision["module"]) == {n for n, _ in _linears(model)}

    assert F.scaled_dot_product_attention is sdpa
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    history = _watched_steps(model)
    assert [r["step"] for r in history["records"]] == [0, 2]
    for rec in history["records"]:
        assert set(blocks.names) <= set(rec["stats"]), sorted(rec["stats"])
        assert len(rec["attention"]) == L
