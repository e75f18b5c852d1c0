"""The block plan of the GPT-2 family against the model: learned positions, LayerNorm, MLPs, biases.

The replay of ``tests/test_plan.py`` (every step recomputed from the recorded tensors, bit for
bit) runs on each family member; the facts a step carries (``variant``, ``bias``) are held to
the module that computes it. Each check has a negative control: the plan of a neighbouring
configuration must fail it.
"""

from __future__ import annotations

import pytest
import torch
from test_plan import _mismatches

import tinylm
from tinylm import plan as tplan

BASE = tinylm.ModelConfig(vocab_size=41, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24)
FAMILY = [
    dict(norm_kind="layer", ffn="gelu_tanh", positions="learned", bias=True, tie_embeddings=True),
    dict(norm_kind="layer", ffn="relu", positions="none", bias=False),
    dict(norm_kind="rms", ffn="gelu", positions="learned", bias=True),
    dict(norm_kind="layer", ffn="swiglu", positions="rope", bias=True),
]


def _model(cfg):
    gen = torch.Generator().manual_seed(11)
    return tinylm.TransformerLM(cfg, generator=gen, dtype=torch.float64).eval(), torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)


def _fact_mismatches(model, plan) -> list[str]:
    """Every step whose ``variant`` / ``bias`` does not say what its module computes."""
    mods = dict(model.named_modules())
    bad = []
    for step in (s for b in plan.blocks for s in b.steps if s.kind != "add"):
        m = mods[step.module]
        if step.kind == "norm":
            variant = "layer" if isinstance(m, tinylm.LayerNorm) else "rms"
            bias = getattr(m, "bias", None) is not None
        elif step.kind == "attention":
            variant, bias = ("rope" if m.rope is not None else "nope"), m.q_proj.bias is not None
        else:
            variant = "swiglu" if isinstance(m, tinylm.SwiGLU) else m.activation
            bias = m.w1.bias is not None
        if (variant, bias) != (step.variant, step.bias):
            bad.append(f"{step.module}: plan says {(step.variant, step.bias)}, the module is {(variant, bias)}")
    return bad


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("changes", FAMILY, ids=lambda ch: "-".join(str(v) for v in ch.values()))
def test_plan_matches_the_family_model(norm, changes):
    cfg = BASE.replace(norm=norm, **changes)
    model, tokens = _model(cfg)
    plan = tplan.build(cfg)
    assert _mismatches(model, plan, tokens) == []
    assert _fact_mismatches(model, plan) == []


def test_a_plan_without_the_position_table_is_caught():
    """Negative control: a learned-position model replayed with the plan of its NoPE twin (block 0
    reading the token embedding alone) disagrees at the first norm."""
    cfg = BASE.replace(**FAMILY[0])
    model, tokens = _model(cfg)
    found = _mismatches(model, tplan.build(cfg.replace(positions="none")), tokens)
    assert any(f.startswith("layers.0.ln1:") or f.startswith("order:") for f in found), found


@pytest.mark.parametrize("other", [dict(norm_kind="rms"), dict(ffn="gelu"), dict(bias=False), dict(positions="rope")])
def test_the_facts_of_a_neighbouring_config_are_caught(other):
    """Negative control: the plan of a config that differs in one family choice misstates a step."""
    cfg = BASE.replace(**FAMILY[0])
    model, _ = _model(cfg)
    assert _fact_mismatches(model, tplan.build(cfg.replace(**other)))


def test_gpt2_plan_reads_as_the_model():
    cfg = BASE.replace(num_layers=1, **FAMILY[0])
    p = tplan.build(cfg)
    assert p.describe().splitlines()[:4] == [
        "token_embeddings: embedding(token_ids) -> token_embeddings",
        "position_embeddings: embedding(positions) -> position_embeddings",
        "resid_in: add(token_embeddings, position_embeddings) -> resid_in",
        "layers.0.ln1: norm(resid_in) -> layers.0.ln1"]
    assert p.residual_points() == ("resid_in", "layers.0.resid_mid", "layers.0")
    assert p.embedding == "token_embeddings" and p.positions == "position_embeddings" and p.norm_kind == "layer"
    assert [b.stream for b in p.branches()] == ["resid_in", "layers.0.resid_mid"]
    assert tplan.branch_stream("attn", 0, p.input) == "resid_in" and tplan.on_stream("resid_in")
    default = tplan.build(BASE)
    assert default.input == default.embedding == "token_embeddings" and default.positions is None
    assert {(s.variant, s.bias) for s in default.blocks[0].steps if s.kind == "norm"} == {("rms", False)}


def test_plan_names_are_the_probes_names_with_learned_positions():
    from diagnostics.measure.probe import instrument_points

    cfg = BASE.replace(**FAMILY[0])
    p = tplan.build(cfg)
    points = instrument_points(tinylm.TransformerLM(cfg, device="meta"))
    named = {n for b in p.blocks for s in b.steps for n in s.writes + s.reads if "+" not in n}
    assert named - set(points) == set()
    assert points["resid_in"] == "embedding" and points["layers.0.ffn"] == "ffn_branch"
    assert points["layers.0.ln1"] == "norm" and points["position_embeddings"] == "embedding"
