"""muP in tinylm: each rule exactly, equality with SP at the base width, and negative controls."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from tinylm import ConfigError, ModelConfig, TransformerLM, preset
from tinylm import checkpoint, init

BASE = 64


def _mup(name="tiny", width=BASE, **kw):
    c = preset(name)
    return c.replace(d_model=width, d_ff=c.d_ff * width // c.d_model, parametrization="mup", mup_base_width=BASE,
                     **kw)


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_mup_at_base_width_equals_sp_exactly(name):
    sp = TransformerLM(preset(name), generator=torch.Generator().manual_seed(1))
    mu = TransformerLM(_mup(name), generator=torch.Generator().manual_seed(1))
    assert sp.state_dict().keys() == mu.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(sp.state_dict().values(), mu.state_dict().values()))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(sp(ids), mu(ids))
    groups = tinylm.mup.param_groups(mu, 1e-3)
    assert {g["lr"] for g in groups} == {1e-3}


def test_multipliers_exact_values():
    c = _mup(width=256)
    assert c.width_mult == 4.0 and c.output_multiplier == 0.25
    assert c.attention_multiplier == math.sqrt(16 / 64)  # d_base_head 16, d_head 64: logits sqrt(16) q.k / 64
    model = TransformerLM(c)
    assert model.output_multiplier == 0.25 and model.layers[0].attn.query_multiplier == 0.5
    assert c.replace(mup_base_head_dim=64).attention_multiplier == 1.0  # heads grown instead of d_head
    assert c.replace(mup_base_depth=1).branch_multiplier == 1 / 3
    sp = preset("tiny").replace(d_model=256, d_ff=512)
    assert (sp.width_mult, sp.output_multiplier, sp.attention_multiplier, sp.branch_multiplier) == (1.0, 1.0, 1.0, 1.0)


def test_attention_logits_scale_one_over_d_head():
    """scores = q.k sqrt(d_base) / d_head: the explicit path's scores equal it (negative control: not 1/sqrt(d_head))."""
    model = TransformerLM(_mup(width=256, positions="none"))
    attn = model.layers[0].attn
    x = torch.randn(1, 8, 256, generator=torch.Generator().manual_seed(0))
    seen = {}
    attn.register_observer(lambda q, k, v, heads, weights: seen.update(q=q, k=k))
    attn.explicit = True
    h = attn.scores.register_forward_hook(lambda m, i, o: seen.update(s=o))
    with torch.no_grad():
        attn(x)
    h.remove()
    raw_q = attn.q_proj(x).view(1, 8, 4, 64).transpose(1, 2)
    raw_k = attn.k_proj(x).view(1, 8, 4, 64).transpose(1, 2)
    want = (raw_q @ raw_k.transpose(-1, -2)) * math.sqrt(16) / 64
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(seen["s"][..., mask], want[..., mask], rtol=1e-5, atol=1e-5)
    wrong = (raw_q @ raw_k.transpose(-1, -2)) / 8  # the SP scale: a negative control
    assert not torch.allclose(seen["s"][..., mask], wrong[..., mask], rtol=1e-3, atol=1e-3)


def test_declared_init_rules():
    c = _mup(width=256)
    model = TransformerLM(c, device="meta")
    decl = init.declare(model, "cs336")
    base = init.declare(TransformerLM(_mup(width=BASE), device="meta"), "cs336")
    m = c.width_mult
    for name in ("layers.0.attn.q_proj.weight", "layers.0.ffn.w1.weight", "layers.0.ffn.w2.weight"):
        assert decl[name].std == pytest.approx(base[name].std / math.sqrt(m), rel=1e-12)  # var ~ 1/fan_in
    assert decl["lm_head.weight"].std == base["lm_head.weight"].std  # readout: constant
    assert decl["token_embeddings.weight"].std == base["token_embeddings.weight"].std
    g = init.declare(TransformerLM(_mup("gpt2-tiny", width=256), device="meta"), "gpt2")
    assert g["layers.0.attn.q_proj.weight"].std == pytest.approx(0.02 / 2)  # a fixed std becomes 0.02/sqrt(m)
    sp = init.declare(TransformerLM(preset("gpt2-tiny").replace(d_model=256, d_ff=1024), device="meta"), "gpt2")
    assert sp["layers.0.attn.q_proj.weight"].std == 0.02  # negative control: SP keeps it fixed


def test_zero_init_options():
    model = TransformerLM(_mup(width=128, mup_readout_zero_init=True, mup_query_zero_init=True))
    assert not model.lm_head.weight.any() and not model.layers[0].attn.q_proj.weight.any()
    assert model.layers[0].attn.k_proj.weight.any()
    with pytest.raises(ConfigError, match="mup_readout_zero_init=True with tie_embeddings=True"):
        _mup("gpt2-tiny", mup_readout_zero_init=True)


@pytest.mark.parametrize("optimizer, hidden, other", [("adam", 1e-3 / 4, 1e-3), ("sgd", 1e-3, 4e-3)])
def test_param_groups(optimizer, hidden, other):
    model = TransformerLM(_mup(width=256), device="meta")
    groups = {g["name"]: g for g in tinylm.mup.param_groups(model, 1e-3, optimizer)}
    assert set(groups) == {"embedding", "hidden", "readout", "vector"}
    assert groups["hidden"]["lr"] == pytest.approx(hidden)
    for name in ("embedding", "readout", "vector"):
        assert groups[name]["lr"] == pytest.approx(other)
    n = sum(len(g["params"]) for g in groups.values())
    assert n == len(list(model.parameters()))
    hidden_names = {k for k, v in tinylm.mup.classify(model).items() if v == "hidden"}
    assert "layers.0.attn.q_proj.weight" in hidden_names and "lm_head.weight" not in hidden_names
    sp = TransformerLM(preset("tiny"), device="meta")
    assert [g["lr"] for g in tinylm.mup.param_groups(sp, 1e-3, optimizer)] == [1e-3]  # negative control


def test_config_validation():
    with pytest.raises(ConfigError, match="mup_base_width=None: must"):
        preset("tiny", parametrization="mup")
    with pytest.raises(ConfigError, match="mup_base_width=64 with parametrization='sp'"):
        preset("tiny", mup_base_width=64)
    with pytest.raises(ConfigError, match="parametrization='nope': must"):
        preset("tiny", parametrization="nope")


def test_checkpoint_embeds_fields_and_old_configs_load_as_sp(tmp_path):
    model = TransformerLM(_mup(width=128))
    checkpoint.save(tmp_path / "m.pt", model)
    loaded, _ = checkpoint.load(tmp_path / "m.pt")
    assert loaded.config == model.config and loaded.output_multiplier == 0.5
    ids = torch.randint(0, 100, (1, 8))
    assert torch.equal(loaded(ids), model(ids))
    old = {k: v for k, v in preset("tiny").to_dict().items() if not k.startswith(("parametrization", "mup_"))}
    assert ModelConfig.from_dict(old).parametrization == "sp"


def test_hf_export_refused_off_base_width(tmp_path):
    from tinylm import hf
    from tinylm.errors import TinyLMError

    with pytest.raises(TinyLMError, match="parametrization='mup'.*no Hugging Face"):
        hf.save_pretrained(TransformerLM(_mup(width=128)), tmp_path / "a")
    hf.save_pretrained(TransformerLM(_mup(width=BASE)), tmp_path / "b")  # at the base width it is the SP model


def test_train_loop_keeps_each_groups_scale():
    from tinylm.train import TrainOptions, make_optimizer

    model = TransformerLM(_mup(width=128), device="meta")
    opt = make_optimizer(model, TrainOptions(steps=1, lr=1e-3))
    scales = {g["name"]: g["lr_scale"] for g in opt.param_groups}
    assert scales["hidden"] == 0.5 and scales["embedding"] == 1.0


def test_depth_mup_scales_each_branch():
    """CompleteP (alpha = 1): each branch times L_base / L; at the base depth the model is unchanged."""
    c = _mup(width=BASE)
    deep = TransformerLM(c.replace(mup_base_depth=1), generator=torch.Generator().manual_seed(0))
    plain = TransformerLM(c, generator=torch.Generator().manual_seed(0))
    same = TransformerLM(c.replace(mup_base_depth=c.num_layers), generator=torch.Generator().manual_seed(0))
    assert all(b.branch_multiplier == 1 / c.num_layers for b in deep.layers)
    ids = torch.randint(0, 100, (1, 8))
    assert torch.equal(same(ids), plain(ids))
    assert not torch.allclose(deep(ids), plain(ids))  # negative control: the multiplier acts
    block, x = deep.layers[0], torch.randn(1, 8, BASE)
    with torch.no_grad():
        want = x + block.attn(block.ln1(x)) / c.num_layers
        h = block.resid_mid.register_forward_hook(lambda m, i, o: seen.append(o))
        seen = []
        block(x)
        h.remove()
    torch.testing.assert_close(seen[0], want)


def test_train_flags_build_a_mup_model():
    """``tinylm train --parametrization mup`` builds muP with the preset's d_model as its base width
    (or --mup-base-width); without the flag the model is SP (negative control)."""
    import argparse

    from reports.cmd_train import _MODEL_FLAGS, _build_model

    def args(**kw):
        base = {name: None for name in _MODEL_FLAGS}
        base.update(preset=None, init=None, seed=0)
        base.update(kw)
        return argparse.Namespace(**base)

    model = _build_model(args(parametrization="mup", d_model=128))
    assert model.config.parametrization == "mup" and model.config.mup_base_width == 64
    assert model.config.width_mult == 2.0
    model = _build_model(args(parametrization="mup", mup_base_width=32))
    assert model.config.width_mult == 2.0
    assert _build_model(args(d_model=128)).config.parametrization == "sp"
