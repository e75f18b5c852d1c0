"""Hugging Face directories: tinylm computes the same function as ``transformers`` on the same weights.

Every model here is built in the test from a small config (d 64, 2 layers, vocab 1000) with its
weights drawn from a seeded generator; nothing is downloaded. "Relative error" of a tensor a
against the reference b is ``max|a - b| / max|b|`` over the whole tensor (logits, or one
parameter's gradient); the bound 1e-5 is about 80 float32 units in the last place of the largest
entry, far above the reordering of float32 sums the two implementations differ by and far below
any mapping mistake (a wrong RoPE pairing or a transposed weight changes the logits at order 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tinylm
from tinylm import checkpoint, hf
from tinylm.errors import CheckpointError, TinyLMError
from diagnostics import diff

transformers = pytest.importorskip("transformers")

V, D, L, H, FF, T = 1000, 64, 2, 4, 128, 32
REL = 1e-5  # max|a-b| / max|b| per tensor, float32
TOKENS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))

HAS_GPT2_FAMILY = "norm_kind" in {f.name for f in __import__("dataclasses").fields(tinylm.ModelConfig)}
needs_gpt2_family = pytest.mark.skipif(not HAS_GPT2_FAMILY, reason="tinylm's GPT-2 family (ModelConfig.norm_kind) "
                                                                     "is not in this tree")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn afresh (norm gains and biases away from 1 and 0 too), so that a
    mapping that swaps, transposes or drops any tensor changes the function."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def llama_config(**changes):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=H, max_position_embeddings=T, rms_norm_eps=1e-5, tie_word_embeddings=False)
    kw.update(changes)
    return transformers.LlamaConfig(**kw)


def hf_llama(tmp_path: Path, name: str = "llama", **changes) -> tuple[torch.nn.Module, Path]:
    """A randomly initialised LlamaForCausalLM saved with save_pretrained; (model, its directory)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(**changes))
    randomise(model).eval()
    model.tie_weights()
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


def hf_gpt2(tmp_path: Path, name: str = "gpt2", **changes) -> tuple[torch.nn.Module, Path]:
    kw = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=T, bos_token_id=0, eos_token_id=0,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kw.update(changes)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw))
    randomise(model).eval()
    model.tie_weights()
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


def directory_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def assert_same_function(ours: tinylm.TransformerLM, theirs: torch.nn.Module) -> dict[str, float]:
    """Logits and every parameter's gradient (of one fixed linear functional of the logits)
    within REL of transformers'; returns the relative errors (for docs/hf.md)."""
    weights = torch.randn(*TOKENS.shape, V, generator=torch.Generator().manual_seed(2))
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    a = ours(TOKENS)
    b = theirs(TOKENS).logits
    errors = {"logits": rel(a, b)}
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    ours_grads = hf.to_hf_state({k: p.grad for k, p in ours.named_parameters()}, ours.config)
    theirs_grads = {k: p.grad for k, p in theirs.named_parameters()}
    assert set(ours_grads) == set(theirs_grads)
    for k, g in theirs_grads.items():
        errors[k] = rel(ours_grads[k], g)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= REL, (worst, errors[worst])
    result = diff(ours, theirs, TOKENS)  # every block, branch and gradient, paired by structure
    assert result.first is None and not result.unpaired, result
    return errors


# ----------------------------------------------------------------------------- Llama: the same function


@pytest.mark.parametrize("tied", [False, True])
def test_llama_logits_and_every_gradient_match_transformers(tmp_path, tied):
    theirs, path = hf_llama(tmp_path, tie_word_embeddings=tied, rope_theta=500.0)
    ours, info = hf.load(path)
    assert info.format == "hf-safetensors" and info.config_source == "stored"
    assert ours.config.tie_embeddings is tied and ours.config.rope_theta == 500.0 and ours.config.eps == 1e-5
    assert ours.config.context_length == T and ours.config.d_ff == FF
    if tied:
        assert ours.lm_head.weight is ours.token_embeddings.weight
    assert_same_function(ours.train(), theirs.train())


def test_wrong_rope_pairing_is_caught():
    """Negative control: loading q and k without the RoPE row permutation (as if HF rotated
    adjacent pairs) gives logits far outside REL, so the equivalence test can fail."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs = randomise(transformers.LlamaForCausalLM(llama_config())).eval()
    config = hf.config_from_hf(theirs.config.to_dict())
    state = hf.from_hf_state(theirs.state_dict(), config)
    ours = tinylm.TransformerLM(config)
    ours.load_state_dict(state)
    assert rel(ours.eval()(TOKENS), theirs(TOKENS).logits) <= REL
    unpermuted = dict(state)
    for k, v in theirs.state_dict().items():
        for i in range(L):
            if k == f"model.layers.{i}.self_attn.q_proj.weight":
                unpermuted[f"layers.{i}.attn.q_proj.weight"] = v
            if k == f"model.layers.{i}.self_attn.k_proj.weight":
                unpermuted[f"layers.{i}.attn.k_proj.weight"] = v
    ours.load_state_dict(unpermuted)
    assert rel(ours(TOKENS), theirs(TOKENS).logits) > 100 * REL


def test_rope_permutation_formula():
    """Row h*d_k + 2k + j of tinylm's q/k is row h*d_k + k + j*d_k/2 of Hugging Face's."""
    perm = hf.rope_permutation(d_model=16, num_heads=2)
    dk = 8
    for h in range(2):
        for k in range(dk // 2):
            for j in range(2):
                assert perm[h * dk + 2 * k + j] == h * dk + k + j * dk // 2
    assert sorted(perm.tolist()) == list(range(16))


# ----------------------------------------------------------------------------- round trips, bit for bit


def test_hf_to_tinylm_to_hf_is_bit_identical(tmp_path):
    _, path = hf_llama(tmp_path)
    ours, _ = hf.load(path)
    hf.save_pretrained(ours, tmp_path / "back")
    before, after = directory_tensors(path), directory_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "rope_theta": 123.0, "eps": 1e-6}, {"bias": True}])
def test_tinylm_to_hf_to_tinylm_is_bit_identical_and_transformers_agrees(tmp_path, changes):
    config = tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=D, num_layers=L, num_heads=H, d_ff=FF,
                                **changes)
    ours = randomise(tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))).eval()
    hf.save_pretrained(ours, tmp_path / "out")
    back, _ = hf.load(tmp_path / "out")
    assert back.config == config.replace(init=back.config.init)
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert diff(ours, back, TOKENS).first is None
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert_same_function(ours.train(), theirs.train())


# ----------------------------------------------------------------------------- other layouts


def test_bfloat16_weights_keep_their_dtype_and_bits(tmp_path):
    theirs, _ = hf_llama(tmp_path)
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ours, _ = hf.load(tmp_path / "bf16")
    assert ours.token_embeddings.weight.dtype == torch.bfloat16
    hf.save_pretrained(ours, tmp_path / "back")
    before, after = directory_tensors(tmp_path / "bf16"), directory_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_safetensors_and_pytorch_bin_load_the_same_weights(tmp_path):
    theirs, single = hf_llama(tmp_path)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((single / "config.json").read_text())
    torch.save(theirs.state_dict(), binary / "pytorch_model.bin")
    reference = hf.load(single)[0].state_dict()
    for path, fmt in ((tmp_path / "sharded", "hf-safetensors-sharded"), (binary, "hf-pytorch-bin")):
        model, info = hf.load(path)
        assert info.format == fmt
        state = model.state_dict()
        assert all(torch.equal(state[k], reference[k]) for k in reference)


# ----------------------------------------------------------------------------- refusals, one line each


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, phrase", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0"),
])
def test_llama_configs_that_do_not_map_exactly_are_refused(tmp_path, changes, phrase):
    _, path = hf_llama(tmp_path)
    edit_config(path, **changes)
    with pytest.raises(hf.MappingError) as e:
        hf.load(path)
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_llama_with_every_bias_maps_exactly(tmp_path):
    theirs, path = hf_llama(tmp_path, attention_bias=True, mlp_bias=True)
    ours, _ = hf.load(path)
    assert ours.config.bias and ours.layers[0].attn.q_proj.bias is not None
    assert_same_function(ours.train(), theirs.train())


def test_mistral_without_a_window_maps_exactly(tmp_path):
    theirs, path = hf_llama(tmp_path)
    edit_config(path, model_type="mistral", sliding_window=None)
    ours, _ = hf.load(path)
    assert_same_function(ours, theirs)


# ----------------------------------------------------------------------------- grouped queries, sliding windows


def hf_model(tmp_path: Path, family: str, name: str, **changes) -> tuple[torch.nn.Module, Path]:
    """A randomly initialised ``{family}ForCausalLM`` (Llama, Mistral, Qwen2) of the test sizes, saved
    with save_pretrained; (model, its directory)."""
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=H, max_position_embeddings=T, rms_norm_eps=1e-5, tie_word_embeddings=False)
    kw.update(changes)
    config = getattr(transformers, f"{family}Config")(**kw)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    randomise(model).eval()
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


@pytest.mark.parametrize("tied", [False, True])
def test_llama_with_grouped_queries_matches_transformers(tmp_path, tied):
    """Llama 3's grouped-query attention: 2 key/value heads for 4 query heads, the k rows permuted
    per K/V head; logits and every parameter's gradient as transformers computes them."""
    theirs, path = hf_llama(tmp_path, num_key_value_heads=2, tie_word_embeddings=tied)
    ours, _ = hf.load(path)
    assert ours.config.num_kv_heads == 2 and ours.layers[0].attn.k_proj.weight.shape == (2 * D // H, D)
    assert_same_function(ours.train(), theirs.train())


def test_wrong_key_value_grouping_is_caught(tmp_path):
    """Negative control: K/V heads assigned to query heads tiled (h -> h mod H_kv) instead of
    repeated (h -> h // G) give other logits, so the equivalence test can fail."""
    theirs, path = hf_llama(tmp_path, num_key_value_heads=2)
    ours, _ = hf.load(path)
    attn = type(ours.layers[0].attn)
    def tile(self, kv):  # (..., H_kv, T, d_k) -> (..., H, T, d_k), head h reading K/V head h mod H_kv
        return kv.repeat(*([1] * (kv.dim() - 3)), self.num_heads // self.num_kv_heads, 1, 1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "repeat_kv", tile)
        assert rel(ours(TOKENS), theirs(TOKENS).logits) > 100 * REL
    assert rel(ours(TOKENS), theirs(TOKENS).logits) <= REL


@pytest.mark.parametrize("kv", [2, 4])
def test_mistral_with_a_sliding_window_matches_transformers(tmp_path, kv):
    """Mistral's window at sequences longer than it (16 tokens, window 5): query i reads key j iff
    0 <= i - j < 5, exactly transformers' convention; a window one longer or shorter differs."""
    theirs, path = hf_model(tmp_path, "Mistral", "mistral", num_key_value_heads=kv, sliding_window=5)
    ours, _ = hf.load(path)
    assert ours.config.sliding_window == 5 and ours.config.kv_heads == kv
    assert_same_function(ours.train(), theirs.train())
    ours.eval(), theirs.eval()
    for attn in (b.attn for b in ours.layers):  # the explicit path (scores and weights) agrees too
        attn.explicit = True
    assert rel(ours(TOKENS), theirs(TOKENS).logits) <= REL
    for w in (4, 6):
        for attn in (b.attn for b in ours.layers):
            attn.sliding_window = w
        assert rel(ours(TOKENS), theirs(TOKENS).logits) > 100 * REL, w


def test_a_window_at_least_the_context_is_no_window(tmp_path):
    theirs, path = hf_model(tmp_path, "Mistral", "mistral", sliding_window=T)
    ours, _ = hf.load(path)
    assert ours.config.sliding_window is None
    assert_same_function(ours, theirs)


@pytest.mark.parametrize("changes", [{"num_kv_heads": 2},
                                     {"num_kv_heads": 1, "sliding_window": 3, "tie_embeddings": True}])
def test_grouped_queries_and_windows_export_and_come_back(tmp_path, changes):
    """tinylm -> save_pretrained: num_key_value_heads (and Mistral's sliding_window) written;
    transformers computes the same function, and reading it back is bit-identical."""
    config = tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=D, num_layers=L, num_heads=H, d_ff=FF,
                                **changes)
    ours = randomise(tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))).eval()
    hf.save_pretrained(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_key_value_heads"] == changes["num_kv_heads"]
    assert written["model_type"] == ("mistral" if "sliding_window" in changes else "llama")
    back, _ = hf.load(tmp_path / "out")
    assert back.config == config.replace(init=back.config.init)
    a, b = ours.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert_same_function(ours.train(), theirs.train())


def test_qwen2_goes_through_transformers(tmp_path):
    """Qwen2 (biases on q, k and v only, none on o_proj or the MLP) has no exact tinylm counterpart:
    load refuses it, load_any reads it through transformers, grouped queries and all."""
    _, path = hf_model(tmp_path, "Qwen2", "qwen2", num_key_value_heads=2)
    with pytest.raises(hf.MappingError, match="qwen2"):
        hf.load(path)
    model, info = hf.load_any(path)
    assert type(model).__name__ == "Qwen2ForCausalLM" and info.format == "hf-transformers"


def test_load_any_never_refuses_what_transformers_loads(tmp_path):
    """A mapped type whose config tinylm cannot compute (rope scaling) goes through transformers."""
    _, path = hf_llama(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(hf.MappingError):
        hf.load(path)
    model, info = hf.load_any(path)
    assert type(model).__name__ == "LlamaForCausalLM" and "rope" in info.extra["unmapped"]


def test_checkpoint_load_of_a_directory_names_hf_load(tmp_path):
    _, path = hf_llama(tmp_path)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    assert f"tinylm.hf.load({str(path)!r})" in str(e.value) and "diagnose DIR" in str(e.value)
    assert "\n" not in str(e.value)


def test_load_any_keeps_the_stored_dtype(tmp_path):
    theirs, _ = hf_model(tmp_path, "Qwen2", "qwen2", num_key_value_heads=2)
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert hf.stored_dtype(tmp_path / "bf16") == torch.bfloat16
    model, _ = hf.load_any(tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    assert hf.stored_dtype(tmp_path / "bf16") == torch.bfloat16  # from the safetensors header


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-3.2-1B", "no/such/dir"])
def test_a_hub_name_or_missing_path_is_refused_without_download(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        hf.load(name)
    assert "local save_pretrained directories" in str(e.value) and "\n" not in str(e.value)


def test_missing_unexpected_and_misshaped_keys_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = hf_llama(tmp_path)
    good = load_file(str(path / "model.safetensors"))
    cases = {
        "missing 1 key(s): model.layers.1.mlp.up_proj.weight": {k: v for k, v in good.items()
                                                                 if k != "model.layers.1.mlp.up_proj.weight"},
        "unexpected 1 key(s): model.layers.2.mlp.up_proj.weight": {
            **good, "model.layers.2.mlp.up_proj.weight": good["model.layers.1.mlp.up_proj.weight"].clone()},
        "model.layers.0.self_attn.q_proj.weight (64, 32)": {
            **good, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)},
    }
    for phrase, state in cases.items():
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError) as e:
            hf.load(path)
        assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_corrupt_files_and_unsafe_shard_names_are_refused(tmp_path):
    theirs, path = hf_llama(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        hf.load(path)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    spec = json.loads(index.read_text())
    first = next(iter(spec["weight_map"]))
    spec["weight_map"][first] = "../llama/model.safetensors"
    index.write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match="outside the directory"):
        hf.load(tmp_path / "sharded")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        hf.load(tmp_path / "empty")


def test_pytorch_bin_is_read_without_executing_code(tmp_path):
    _, path = hf_llama(tmp_path)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((path / "config.json").read_text())
    torch.save({"weights": tinylm.ModelConfig}, binary / "pytorch_model.bin")  # a class: not a state dict
    with pytest.raises(CheckpointError) as e:
        hf.load(binary)
    assert "tinylm.config.ModelConfig" in str(e.value) and "never executes" in str(e.value)
    assert "--unsafe-load" not in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- export refusals


@pytest.mark.parametrize("changes, phrase", [
    ({"norm": "post"}, "norm='post'"),
    ({"norm": "none"}, "norm='none'"),
    ({"ffn": "silu"}, "ffn='silu'"),
    ({"positions": "none"}, "positions='none'"),
    ({"positions": "learned"}, "positions='learned'"),
    ({"norm_kind": "layer", "ffn": "swiglu", "positions": "learned", "bias": True}, "ffn='swiglu'"),
    ({"norm_kind": "layer", "ffn": "gelu_tanh", "positions": "learned", "bias": False}, "bias=False"),
    ({"norm_kind": "layer", "ffn": "gelu_tanh", "positions": "rope", "bias": True}, "positions='rope'"),
])
def test_export_refuses_configs_with_no_hf_equivalent(tmp_path, changes, phrase):
    config = tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=D, num_layers=L, num_heads=H, d_ff=FF,
                                **changes)
    with pytest.raises(hf.MappingError) as e:
        hf.save_pretrained(tinylm.TransformerLM(config), tmp_path / "out")
    assert phrase in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_non_empty_directory_unless_forced(tmp_path):
    config = tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=D, num_layers=L, num_heads=H, d_ff=FF)
    model = tinylm.TransformerLM(config)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(TinyLMError, match="not empty"):
        hf.save_pretrained(model, tmp_path / "out")
    hf.save_pretrained(model, tmp_path / "out", force=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert hf.load(tmp_path / "out")[0].config.d_model == D


# ----------------------------------------------------------------------------- any other architecture


def test_another_architecture_is_loaded_through_transformers(tmp_path):
    config = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                                        intermediate_size=FF, max_position_embeddings=T)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    with pytest.raises(hf.MappingError, match="gpt_neox"):
        hf.load(tmp_path / "neox")
    model, info = hf.load_any(tmp_path / "neox")
    assert type(model).__name__ == "GPTNeoXForCausalLM" and info.format == "hf-transformers"
    assert not model.training


def test_missing_transformers_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(TinyLMError) as e:
        hf.load_any(tmp_path / "m")
    assert 'pip install "tinylm[hf]"' in str(e.value) and "\n" not in str(e.value)


def test_remote_code_is_never_run(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"model_type": "custom", "auto_map": {"AutoModelForCausalLM": "modeling.Custom"}}))
    (tmp_path / "m" / "modeling.py").write_text("raise SystemExit('executed')\n")
    with pytest.raises(CheckpointError) as e:
        hf.load_any(tmp_path / "m")
    assert "remote code" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- GPT-2: the same function


@needs_gpt2_family
@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_logits_and_every_gradient_match_transformers(tmp_path, tied):
    theirs, path = hf_gpt2(tmp_path, tie_word_embeddings=tied, layer_norm_epsilon=1e-6)
    ours, info = hf.load(path)
    assert info.format == "hf-safetensors"
    c = ours.config
    assert (c.norm_kind, c.ffn, c.positions, c.bias, c.tie_embeddings) == ("layer", "gelu_tanh", "learned", True, tied)
    assert c.eps == 1e-6 and c.context_length == T and c.d_ff == 4 * D
    assert_same_function(ours.train(), theirs.train())


@needs_gpt2_family
def test_untransposed_conv1d_weights_are_caught():
    """Negative control: GPT-2's Conv1D weights (in, out) copied without the transpose (square
    c_proj matrices load without a shape error) give logits far outside REL."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs = randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))).eval()
    config = hf.config_from_hf(theirs.config.to_dict())
    state = hf.from_hf_state(theirs.state_dict(), config)
    ours = tinylm.TransformerLM(config)
    ours.load_state_dict(state)
    assert rel(ours.eval()(TOKENS), theirs(TOKENS).logits) <= REL
    for i in range(L):
        state[f"layers.{i}.attn.output_proj.weight"] = theirs.state_dict()[f"transformer.h.{i}.attn.c_proj.weight"]
    ours.load_state_dict(state)
    assert rel(ours(TOKENS), theirs(TOKENS).logits) > 100 * REL


@needs_gpt2_family
def test_gpt2_round_trips_are_bit_identical(tmp_path):
    theirs, path = hf_gpt2(tmp_path)
    ours, _ = hf.load(path)
    hf.save_pretrained(ours, tmp_path / "back")
    before, after = directory_tensors(path), directory_tensors(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back, _ = hf.load(tmp_path / "back")
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    assert type(reloaded).__name__ == "GPT2LMHeadModel"
    assert_same_function(ours.train(), reloaded.train())


@needs_gpt2_family
def test_gpt2_mask_buffers_in_old_files_are_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    theirs, path = hf_gpt2(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    for i in range(L):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, T, T))
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = hf.load(path)
    assert_same_function(ours, theirs)


@needs_gpt2_family
@pytest.mark.parametrize("changes, phrase", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"activation_function": "tanh"}, "activation_function"),
    ({"add_cross_attention": True}, "add_cross_attention"),
])
def test_gpt2_configs_that_do_not_map_exactly_are_refused(tmp_path, changes, phrase):
    _, path = hf_gpt2(tmp_path)
    edit_config(path, **changes)
    with pytest.raises(hf.MappingError) as e:
        hf.load(path)
    assert phrase in str(e.value) and "\n" not in str(e.value)
