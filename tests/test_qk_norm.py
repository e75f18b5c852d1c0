"""QK-norm (``ModelConfig.qk_norm``): keys, checkpoints, both attention paths, grouped queries, the
command line, the Hugging Face refusal, init declarations, and theory that says it does not cover it."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from clihelp import assert_one_line_error
from reports.cli import main
from tinylm import checkpoint, hf
from tinylm.errors import ConfigError
from tinylm.layers import MultiHeadSelfAttention
from tinylm.reference import BuiltinLM


def config(**changes) -> tinylm.ModelConfig:
    base = dict(vocab_size=64, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
    return tinylm.ModelConfig(**{**base, **changes})


def model(seed: int = 0, **changes) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(config(**changes), generator=torch.Generator().manual_seed(seed))


def randomised(m: torch.nn.Module, seed: int = 1, std: float = 0.5) -> torch.nn.Module:
    """Every parameter redrawn (norm gains and biases too, so a gain or bias that is ignored shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std + (1.0 if p.dim() == 1 else 0.0))
    return m


def test_state_dict_keys_and_shapes():
    none = model().state_dict()
    rms = model(qk_norm="rms").state_dict()
    layer = model(qk_norm="layer").state_dict()
    assert list(model(qk_norm="none").state_dict()) == list(none)  # the default is today's model
    assert not any("q_norm" in k or "k_norm" in k for k in none)
    extra_rms = sorted(set(rms) - set(none))
    assert extra_rms == sorted(f"layers.{i}.attn.{n}_norm.weight" for i in range(2) for n in "qk")
    assert sorted(set(layer) - set(none)) == sorted(f"layers.{i}.attn.{n}_norm.{w}" for i in range(2) for n in "qk"
                                                    for w in ("weight", "bias"))
    assert all(rms[k].shape == (8,) for k in extra_rms)  # d_k = 16 / 2, shared by the heads
    assert set(rms) - set(extra_rms) == set(none)


def test_validation_is_one_line():
    with pytest.raises(ConfigError) as e:
        config(qk_norm="l2")
    assert str(e.value) == "qk_norm='l2': must be one of none, rms, layer"
    assert e.value.argument == "qk_norm"
    with pytest.raises(ValueError, match="qk_norm='l2'"):
        MultiHeadSelfAttention(16, 2, qk_norm="l2")


def test_parameter_count_and_init_declarations():
    for qk in ("rms", "layer"):
        m = model(qk_norm=qk)
        assert m.num_parameters() == tinylm.memory._params(m.config)
        for scheme in tinylm.init.SCHEMES:
            decl = tinylm.init.declare(m, scheme)
            assert set(decl) == {n for n, _ in m.named_parameters()}
            for name, dist in decl.items():
                if "_norm." in name:
                    assert dist.family == "constant" and dist.value == (1.0 if name.endswith("weight") else 0.0)
            tinylm.init.apply(randomised(m), scheme, generator=torch.Generator().manual_seed(0))
            for name, p in m.named_parameters():
                if "_norm.weight" in name:
                    assert torch.equal(p, torch.ones_like(p)), (scheme, name)
                elif "_norm.bias" in name:
                    assert torch.equal(p, torch.zeros_like(p)), (scheme, name)


@pytest.mark.parametrize("qk", ["rms", "layer"])
@pytest.mark.parametrize("kv, window", [(None, None), (1, None), (1, 3)])
def test_explicit_and_fused_paths_agree_with_the_formula(qk, kv, window):
    """Both paths equal a per-head reference written out here: norm(q), norm(k) over d_k with the
    shared gain (and bias), RoPE, K/V heads repeated, scaled dot-product attention."""
    g = torch.Generator().manual_seed(3)
    attn = randomised(MultiHeadSelfAttention(32, 4, 8, 10000.0, num_kv_heads=kv, sliding_window=window, qk_norm=qk,
                                             eps=1e-5, dtype=torch.float64))
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    H, Hkv, dk = 4, kv or 4, 8

    def norm(t, mod):
        if qk == "rms":
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * mod.weight
        c = t - t.mean(-1, keepdim=True)
        return c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * mod.weight + mod.bias

    with torch.no_grad():
        q = norm(attn.q_proj(x).view(2, 7, H, dk).transpose(1, 2), attn.q_norm)
        k = norm(attn.k_proj(x).view(2, 7, Hkv, dk).transpose(1, 2), attn.k_norm)
        v = attn.v_proj(x).view(2, 7, Hkv, dk).transpose(1, 2)
        pos = torch.arange(7)
        q, k = attn.rope(q, pos), attn.rope(k, pos)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn.mask(7))
        ref = attn.output_proj(heads.transpose(1, 2).reshape(2, 7, 32))
        outs = {}
        for explicit in (False, True):
            attn.explicit = explicit
            outs[explicit] = attn(x)
    for explicit, out in outs.items():
        assert float((out - ref).abs().max()) < 1e-12, explicit
    # the norm matters: the same weights without it compute another function
    plain = MultiHeadSelfAttention(32, 4, 8, 10000.0, num_kv_heads=kv, sliding_window=window, dtype=torch.float64)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "_norm" not in k})
    with torch.no_grad():
        assert float((plain(x) - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("qk", ["rms", "layer"])
def test_the_model_equals_the_builtin_reference(qk):
    m = randomised(model(qk_norm=qk).double())
    ref = BuiltinLM(m.config).double()
    ref.load_state_dict(m.state_dict())
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((m(ids) - ref(ids)).abs().max()) < 1e-12


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checkpoint_round_trip(tmp_path, suffix):
    m = randomised(model(qk_norm="layer", num_kv_heads=1))
    path = tmp_path / f"m{suffix}"
    checkpoint.save(path, m)
    back, _ = checkpoint.load(path)
    assert back.config == m.config and back.config.qk_norm == "layer"
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(back(ids), m.eval()(ids))


def test_a_bare_state_dict_shows_its_qk_norm(tmp_path):
    for qk in ("rms", "layer"):
        path = tmp_path / f"{qk}.pt"
        torch.save(model(qk_norm=qk).state_dict(), path)
        back, _ = checkpoint.load(path, num_heads=2, context_length=8, rope_theta=10000.0)
        assert back.config.qk_norm == qk


def test_a_checkpoint_stored_before_the_field_loads(tmp_path):
    m = model()
    path = tmp_path / "old.pt"
    checkpoint.save(path, m)
    obj = torch.load(path, weights_only=True)
    del obj["config"]["qk_norm"]
    torch.save(obj, path)
    back, _ = checkpoint.load(path)
    assert back.config.qk_norm == "none" and back.config == m.config
    assert tinylm.ModelConfig.from_dict({k: v for k, v in m.config.to_dict().items() if k != "qk_norm"}) == m.config


def test_cli_init_takes_qk_norm(tmp_path, capsys):
    out = tmp_path / "m.pt"
    assert main(["init", "--preset", "tiny", "--qk-norm", "rms", "--num-kv-heads", "2", "-o", str(out)]) == 0
    back, _ = checkpoint.load(out)
    assert back.config.qk_norm == "rms" and "layers.0.attn.q_norm.weight" in back.state_dict()
    capsys.readouterr()
    code = main(["init", "--qk-norm", "l2", "-o", str(tmp_path / "x.pt")])
    assert_one_line_error(code, capsys.readouterr().err, "--qk-norm", "'l2'")


def test_hugging_face_export_refuses_qk_norm(tmp_path, capsys):
    for qk, preset in (("rms", "tiny"), ("layer", "gpt2-tiny")):
        c = tinylm.preset(preset, qk_norm=qk)
        with pytest.raises(hf.MappingError) as e:
            hf.hf_config(c)
        assert str(e.value) == (f"qk_norm={qk!r}: Hugging Face {'Llama' if preset == 'tiny' else 'GPT-2'} normalises "
                                "neither queries nor keys; this model has no Hugging Face equivalent")
        with pytest.raises(hf.MappingError):
            hf.save_pretrained(tinylm.TransformerLM(c, device="meta"), tmp_path / qk)
        assert not (tmp_path / qk).exists()
    src = tmp_path / "m.pt"
    assert main(["init", "--preset", "tiny", "--qk-norm", "rms", "-o", str(src)]) == 0
    capsys.readouterr()
    code = main(["export", str(src), "--hf", str(tmp_path / "out")])
    assert_one_line_error(code, capsys.readouterr().err, "qk_norm='rms'", "no Hugging Face equivalent")


def test_plan_sites_and_watch():
    from diagnostics.measure.sites import model_sites

    c = config(qk_norm="rms", num_kv_heads=1)
    attn = next(s for s in tinylm.plan.build(c).blocks[0].steps if s.kind == "attention")
    assert attn.qk_norm == "rms" and "qk-norm rms" in tinylm.plan.build(c).describe()
    assert "qk-norm" not in tinylm.plan.build(config()).describe()
    with_qk, without = model_sites(model(qk_norm="rms")), model_sites(model())
    assert with_qk.points["layers.0.attn.q_norm"] == with_qk.points["layers.1.attn.k_norm"] == "norm"
    assert {k: v for k, v in with_qk.points.items() if "_norm" not in k} == dict(without.points)
    assert with_qk.watch == without.watch


def test_theory_marks_what_qk_norm_changes_and_the_score_check_reads_the_norms():
    from diagnostics import DiagnoseOptions, diagnose
    from diagnostics.theory import backkernel, kernel_theory

    c = config(qk_norm="rms", init="gpt2")  # small weights: the projections' E[q^2] E[k^2] is far from the scores'
    assert "qk_norm='rms'" in backkernel.not_covered(c, 8) and backkernel.not_covered(config(), 8) is None
    kt = kernel_theory(c, 8).predictions()
    assert not kt[("layers.0.attn.scores", "forward")].valid and kt[("layers.0.attn.q_proj", "forward")].valid
    assert "qk_norm='rms'" in kt[("layers.1", "forward")].validity
    r = diagnose(model(qk_norm="rms", init="gpt2"), options=DiagnoseOptions(batch_size=2, seq_len=8, batches=2))
    rows = {(t.name, t.direction): t for t in r.tensors}
    scores = rows[("layers.0.attn.scores", "forward")]
    assert r.header.theory == "global" and not scores.valid and "qk_norm" in scores.validity
    assert math.isclose(scores.mean_square, 1.0, rel_tol=0.2)  # unit gains: E[s^2] about 1 whatever W_q, W_k
    assert rows[("layers.0.attn.q_proj", "forward")].valid
    assert not any(f.cause == "score_scale" for f in r.findings), r.findings
