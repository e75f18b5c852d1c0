"""tinylm's own contract: the block plan against what the model's forward really runs.

``modules()`` is the order in which the model's forward hooks fire; ``producers()``
names, for every tensor a step writes, the step that writes it; the name helpers read a
name as the plan writes it. (``tests/test_plan.py`` replays every step on the recorded
tensors.) Properties of tinylm itself: ``tinylm_only``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import prop
from props.strategies import generator, model_configs
from tinylm import plan as tplan
from tinylm.config import ModelConfig
from tinylm.errors import ConfigError
from tinylm.model import TransformerLM

pytestmark = pytest.mark.tinylm_only


def _fired(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    """Named modules in the order their forward hooks fire during one forward."""
    order: list[str] = []
    handles = [m.register_forward_hook(lambda mod, args, out, n=n: order.append(n)) for n, m in model.named_modules() if n]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return order


@prop("plan.modules() is the order in which the model's named modules finish (forward hooks), for every config")
@settings(max_examples=20, deadline=None)
@given(cfg=model_configs(max_layers=3, max_vocab=16, max_context=6))
def test_modules_are_the_forward_order(cfg):
    p = tplan.build(cfg)
    model = TransformerLM(cfg, generator(0)).eval()
    fired = _fired(model, torch.zeros(1, cfg.context_length, dtype=torch.long))
    mine = p.modules()
    assert [n for n in fired if n in set(mine)] == list(mine)
    assert len(set(mine)) == len(mine), "a module is named twice"
    assert set(mine) <= {n for n, _ in model.named_modules()}
    assert mine[0] == p.embedding == "token_embeddings" and mine[-1] == p.head == "lm_head"


@prop("producers(): every name a step writes maps to that step; the residual points after the embedding all have one")
@settings(max_examples=15, deadline=None)
@given(cfg=model_configs(max_layers=3))
def test_producers_and_points(cfg):
    p = tplan.build(cfg)
    assert p.config is cfg and len(p.blocks) == cfg.num_layers and [b.index for b in p.blocks] == list(range(cfg.num_layers))
    prod = p.producers()
    assert {n for b in p.blocks for s in b.steps for n in s.writes} == set(prod)
    assert all(n in prod[n].writes for n in prod)
    for b in p.blocks:
        assert prod[b.mid].branch == "attn" and prod[b.output].branch == "ffn"
        assert prod[b.mid].kind == ("norm" if cfg.norm == "post" else "add")
        assert b.name == tplan.block_name(b.index) and all(s.output == s.writes[0] for s in b.steps)
    for b in p.blocks:  # the first half of a block's steps is its attention branch (norm, branch, add), the rest its FFN
        half = len(b.steps) // 2
        assert [s.branch for s in b.steps] == ["attn"] * half + ["ffn"] * half
        assert [s.kind for s in b.steps[:half]].count("attention") == 1 and [s.kind for s in b.steps[half:]].count("ffn") == 1
    for br in p.branches():  # a branch reads its norm's output, or with no norm before it, the stream it is added to
        assert br.reads == (br.norm or br.stream) == prod[br.name].reads[0]
    assert set(p.residual_points()[1:]) <= set(prod) and p.embedding not in prod
    assert p.head_input() == ("ln_final" if cfg.norm == "pre" else p.blocks[-1].output)
    assert len(p.describe().splitlines()) == 2 + sum(len(b.steps) for b in p.blocks) + (cfg.norm == "pre")


@prop("name helpers: block_index, on_stream and is_sum read the names the plan writes, and nothing else")
@given(i=st.integers(0, 999), tail=st.sampled_from(["", ".attn", ".ln1", ".resid_mid", ".ffn.w1", "x", ".attn.rope"]))
def test_name_helpers(i, tail):
    name = f"layers.{i}{tail}"
    assert tplan.block_index(name) == (None if tail == "x" else i)
    assert tplan.on_stream(name) == (tail in ("", ".resid_mid"))
    assert tplan.mid_name(i) == f"layers.{i}.resid_mid" and tplan.block_name(i) == f"layers.{i}"
    assert tplan.stream_into(i) == ("token_embeddings" if i == 0 else f"layers.{i - 1}")
    assert tplan.branch_stream("attn", i) == tplan.stream_into(i) and tplan.branch_stream("ffn", i) == tplan.mid_name(i)
    assert not tplan.is_sum(name) and tplan.is_sum(f"{name}+layers.{i}.attn")


def test_name_helpers_at_the_edges():
    assert tplan.on_stream("token_embeddings") and not tplan.on_stream("lm_head") and not tplan.on_stream("ln_final")
    assert not tplan.on_stream("xlayers.0") and tplan.block_index("xlayers.0") is None
    assert tplan.block_index("layers.") is None and tplan.block_index("layers.7.") == 7
    with pytest.raises(ValueError) as info:
        tplan.branch_stream("mlp", 0)
    assert str(info.value) == "kind='mlp': must be 'attn' or 'ffn'"


def test_refusals_name_the_value():
    with pytest.raises(ConfigError) as info:
        tplan.build({"norm": "pre"})
    assert str(info.value) == "config=dict: pass a tinylm.ModelConfig (model.config)"
    with pytest.raises(ConfigError) as info:
        tplan._block(0, "sandwich")  # unreachable through a validated ModelConfig; the guard still names it
    assert str(info.value) == "norm='sandwich': must be 'pre', 'post' or 'none'"
    cfg = ModelConfig(vocab_size=4, context_length=2, d_model=4, num_layers=1, num_heads=1, d_ff=4)
    p = tplan.build(cfg)
    with pytest.raises(KeyError) as info:
        p.branch("layers.0.ln1")
    assert info.value.args[0] == "name='layers.0.ln1': not a branch of this plan; branches look like layers.0.attn, layers.0.ffn"
    assert p.branch("layers.0.attn") == p.branches()[0] and p.branches()[1].name == "layers.0.ffn"
    kinds = {s.kind for norm in ("pre", "post", "none") for s in tplan.build(cfg.replace(norm=norm)).blocks[0].steps}
    assert kinds == set(tplan.STEP_KINDS)
