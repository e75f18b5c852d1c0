"""The GPT-2 family in tinylm: keys, the torch built-in reference, learned positions, init, checkpoints.

One ModelConfig describes the CS336 block and GPT-2 (LayerNorm with bias, GELU/ReLU MLPs,
learned absolute positions, biases). The CS336 default keeps its state-dict keys exactly;
every family member computes what ``tinylm.reference.BuiltinLM`` (nn.LayerNorm, F.gelu,
F.relu, nn.Embedding positions) computes, logits and gradients.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

import tinylm
from tinylm import checkpoint
from tinylm import functional as F
from tinylm.errors import ConfigError
from tinylm.reference import BuiltinLM

U32, U64 = 2.0**-24, 2.0**-53
BASE = tinylm.ModelConfig(vocab_size=37, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24)
GPT2 = tinylm.preset("gpt2-tiny", vocab_size=37, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=64)

#: the CS336 assignment-1 keys of a one-block model: the default configuration must keep them exactly
CS336_KEYS = {
    "token_embeddings.weight", "layers.0.ln1.weight", "layers.0.ln2.weight", "ln_final.weight", "lm_head.weight",
    *(f"layers.0.attn.{p}_proj.weight" for p in ("q", "k", "v", "output")),
    *(f"layers.0.ffn.w{i}.weight" for i in (1, 2, 3)),
}
GPT2_KEYS = {
    "token_embeddings.weight", "position_embeddings.weight", "lm_head.weight",
    *(f"{m}.{p}" for m in ("layers.0.ln1", "layers.0.ln2", "ln_final") for p in ("weight", "bias")),
    *(f"layers.0.attn.{m}_proj.{p}" for m in ("q", "k", "v", "output") for p in ("weight", "bias")),
    *(f"layers.0.ffn.w{i}.{p}" for i in (1, 2) for p in ("weight", "bias")),
}

#: every family choice at once is too many for the default run: each value of each new field
#: appears, with the others varied along (a covering set, not the product)
FAMILY = [
    dict(norm_kind="layer", ffn="gelu_tanh", positions="learned", bias=True, tie_embeddings=True),  # GPT-2
    dict(norm_kind="layer", ffn="gelu", positions="rope", bias=False),
    dict(norm_kind="rms", ffn="relu", positions="learned", bias=True),
    dict(norm_kind="layer", ffn="swiglu", positions="none", bias=True),
    dict(norm_kind="rms", ffn="silu", positions="rope", bias=True),
    dict(norm_kind="layer", ffn="relu", positions="learned", bias=False, tie_embeddings=True),
]


def tokens(c, shape, seed=0):
    return torch.randint(0, c.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def randomize_(model, seed=0):
    """Every parameter drawn at random (gains, biases and all), so that a zero bias or a unit gain
    cannot hide a wiring mistake."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and (".ln" in name or name.startswith("ln_final"))
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) + (1.0 if gain else 0.0))
    return model


def pair(c, dtype, seed=0):
    """(tinylm model, BuiltinLM) of config ``c`` with the same random weights, in ``dtype``."""
    cast = {torch.float64: torch.nn.Module.double, torch.float32: torch.nn.Module.float}[dtype]  # not .to: the
    model = randomize_(cast(tinylm.TransformerLM(c)), seed)  # reference's complex RoPE phases must stay complex
    ref = cast(BuiltinLM(c))
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_default_config_keeps_the_cs336_keys():
    assert set(tinylm.TransformerLM(BASE.replace(num_layers=1)).state_dict()) == CS336_KEYS


def test_gpt2_keys_and_the_lm_head_has_no_bias():
    model = tinylm.TransformerLM(GPT2.replace(num_layers=1, tie_embeddings=False))
    assert set(model.state_dict()) == GPT2_KEYS
    assert model.lm_head.bias is None
    assert model.position_embeddings.weight.shape == (GPT2.context_length, GPT2.d_model)
    no_ln_bias = tinylm.TransformerLM(GPT2.replace(num_layers=1, bias=False))
    assert {k for k in no_ln_bias.state_dict() if k.endswith(".bias")} == set()


@pytest.mark.parametrize("changes", FAMILY, ids=lambda ch: "-".join(str(v) for v in ch.values()))
def test_family_matches_the_builtin_reference(changes):
    """float64: logits and every parameter's gradient equal to 1e-12 relative (rounding only)."""
    c = BASE.replace(**changes)
    model, ref = pair(c, torch.float64)
    x = tokens(c, (3, c.context_length))
    y, y_ref = model(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    grads, ref_grads = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-10, atol=1e-10, msg=name)


def _float32_gap(c, ref_config):
    """(max |tinylm - reference| over logits, its tolerance k u (1 + max|logit|)), float32, with
    k = 8 (d + d_ff + T) L: the longest chain of roundings (a dot product of d or d_ff terms,
    T attention terms, per block) with a factor 8 to spare."""
    model, _ = pair(c, torch.float32, seed=3)
    ref = BuiltinLM(ref_config).float()
    ref.load_state_dict(model.state_dict())
    x = tokens(c, (2, c.context_length), seed=3)
    k = 8 * (c.d_model + c.d_ff + c.context_length) * c.num_layers
    with torch.no_grad():
        y, y_ref = model(x), ref(x)
    return float((y - y_ref).abs().max()), k * U32 * (1 + float(y_ref.abs().max()))


def test_gpt2_float32_within_rounding_of_the_builtin_reference():
    """float32: logits within k u (1 + max|logit|), and every gradient within k u (1 + max|grad|)."""
    c = GPT2
    gap, tol = _float32_gap(c, c)
    assert gap <= tol
    model, ref = pair(c, torch.float32, seed=3)
    x = tokens(c, (2, c.context_length), seed=3)
    model(x).sum().backward()
    ref(x).sum().backward()
    k = 8 * (c.d_model + c.d_ff + c.context_length) * c.num_layers
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = ref_grads[name].grad
        assert float((p.grad - g).abs().max()) <= k * U32 * (1 + float(g.abs().max())), name


def test_float32_tolerance_rejects_the_wrong_gelu():
    """Negative control: a reference with the exact GELU where GPT-2 has the tanh approximation
    (they differ by < 5e-4 per activation) falls outside the float32 tolerance."""
    gap, tol = _float32_gap(GPT2, GPT2.replace(ffn="gelu"))
    assert gap > tol


def test_learned_positions_add_the_table_rows_and_refuse_beyond_the_context():
    c = GPT2.replace(num_layers=1)
    model = randomize_(tinylm.TransformerLM(c).double())
    x = tokens(c, (2, 5))
    shifted = torch.arange(2, 7)
    seen = {}
    handle = model.resid_in.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o))
    model(x, shifted)
    handle.remove()
    want = model.token_embeddings.weight[x] + model.position_embeddings.weight[2:7]
    torch.testing.assert_close(seen["h"], want, rtol=0, atol=0)
    assert not torch.equal(model(x), model(x, shifted))  # the positions matter
    torch.testing.assert_close(model(x), model(x, torch.arange(5)), rtol=0, atol=0)  # default 0 .. T-1
    for bad in (torch.arange(4, 9), torch.tensor([-1, 0, 1, 2, 3])):
        with pytest.raises(ValueError, match=r"learned position table has context_length=8 rows: pass positions in \[0, 8\)"):
            model(x, bad)
    with pytest.raises(ValueError, match="sequence length 9 > context_length=8"):
        model(tokens(c, (1, 9)))


def test_functional_ops_equal_torchs():
    x = torch.randn(4, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3 + 0.5
    w, b = torch.rand(33, dtype=torch.float64) + 0.5, torch.randn(33, dtype=torch.float64)
    tF = torch.nn.functional
    torch.testing.assert_close(F.layer_norm(x, w, b, 1e-5), tF.layer_norm(x, (33,), w, b, 1e-5), rtol=0, atol=1e-14)
    torch.testing.assert_close(F.gelu(x), tF.gelu(x), rtol=0, atol=4 * U64 * 10)
    torch.testing.assert_close(F.gelu(x, approximate="tanh"), tF.gelu(x, approximate="tanh"), rtol=0, atol=4 * U64 * 10)
    assert torch.equal(F.relu(x), tF.relu(x))
    half = x.to(torch.bfloat16)
    assert F.layer_norm(half, None, None, 1e-5).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="approximate='erf': must be 'none' or 'tanh'"):
        F.gelu(x, approximate="erf")


def test_siluffn_is_the_silu_mlp():
    torch.manual_seed(0)
    a = tinylm.SiLUFFN(8, 12).double()
    b = tinylm.MLP(8, 12, "silu").double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 8, dtype=torch.float64)
    assert isinstance(a, tinylm.MLP) and torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="activation='tanh': must be one of silu, gelu, gelu_tanh, relu"):
        tinylm.MLP(8, 12, "tanh")


@pytest.mark.parametrize("scheme", sorted(tinylm.init.SCHEMES))
def test_every_scheme_declares_every_gpt2_parameter(scheme):
    model = tinylm.TransformerLM(GPT2.replace(tie_embeddings=False), device="meta")
    decl = tinylm.init.declare(model, scheme)
    assert set(decl) == set(dict(model.named_parameters()))
    for name, dist in decl.items():
        if name.endswith(".bias") and ".ln" not in name and not name.startswith("ln_final"):
            if scheme != "torch-default":
                assert (dist.family, dist.value) == ("constant", 0.0), name
        elif name.endswith(".bias"):
            assert (dist.family, dist.value) == ("constant", 0.0), name  # LayerNorm's bias: 0 everywhere
        elif "ln" in name:
            assert (dist.family, dist.value) == ("constant", 1.0), name
    assert decl["position_embeddings.weight"].variance == decl["token_embeddings.weight"].variance


def test_gpt2_init_draws_position_table_from_n_0_002():
    """The position table's second moment against the declared 0.02^2: a z-test with false-alarm
    rate 1e-6 (the mean square of n draws of N(0, s^2) has variance 2 s^4 / n); negative control:
    the same test rejects the token table's cs336 claim N(0, 1)."""
    c = GPT2.replace(context_length=256, d_model=64, num_heads=4)
    model = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(0))
    w = model.position_embeddings.weight.detach().double().flatten()
    z_crit = stats.norm.isf(1e-6 / 2)

    def z(var):
        return abs(float(w.pow(2).mean()) - var) / math.sqrt(2 * var**2 / w.numel())

    assert z(0.02**2) < z_crit
    assert z(1.0) > z_crit


def test_layer_norm_and_biases_start_at_one_and_zero():
    model = tinylm.TransformerLM(GPT2, generator=torch.Generator().manual_seed(0))
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif ".ln" in name or name.startswith("ln_final"):
            assert torch.equal(p, torch.ones_like(p)), name


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("changes", FAMILY[:4], ids=lambda ch: "-".join(str(v) for v in ch.values()))
def test_checkpoint_round_trip_is_bit_identical(tmp_path, suffix, changes):
    c = BASE.replace(**changes)
    model = randomize_(tinylm.TransformerLM(c), seed=5)
    path = tmp_path / f"m{suffix}"
    checkpoint.save(path, model)
    back, info = checkpoint.load(path)
    assert back.config == c and info.config_source == "stored"
    sd, sd2 = model.state_dict(), back.state_dict()
    assert list(sd) == list(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    x = tokens(c, (2, c.context_length))
    assert torch.equal(model.eval()(x), back(x))


def test_old_checkpoints_with_a_rope_flag_still_load(tmp_path):
    """A tinylm file written before ``positions`` existed stores "rope": bool in its config."""
    for rope, positions in ((True, "rope"), (False, "none")):
        c = BASE.replace(positions=positions)
        model = tinylm.TransformerLM(c)
        old = {k: v for k, v in c.to_dict().items() if k not in ("positions", "norm_kind", "bias")}
        old["rope"] = rope
        torch.save({"format": "tinylm", "version": 1, "config": old, "model": model.state_dict()}, tmp_path / "old.pt")
        back, _ = checkpoint.load(tmp_path / "old.pt")
        assert back.config == c and back.config.rope is rope


def test_bare_gpt2_state_dict_shows_positions_biases_and_layernorm(tmp_path):
    model = tinylm.TransformerLM(GPT2)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    back, info = checkpoint.load(tmp_path / "bare.pt", num_heads=GPT2.num_heads, ffn="gelu_tanh", init="gpt2")
    assert info.config_source == "inferred" and back.config == GPT2  # context_length from the position table


def test_family_configs_refuse_bad_values_by_name():
    with pytest.raises(ConfigError, match=r"^positions='alibi': must be one of rope, learned, none$"):
        BASE.replace(positions="alibi")
    with pytest.raises(ConfigError, match=r"^norm_kind='batch': must be one of rms, layer$"):
        BASE.replace(norm_kind="batch")
    assert list(itertools.islice(tinylm.PRESETS, 5)) == ["tiny", "tinystories", "gpt2-small", "gpt2", "gpt2-tiny"]
