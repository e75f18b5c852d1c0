"""The block plan (tinylm.plan) against the model it describes (TransformerBlock.forward).

For every config variant the model runs once with forward hooks on every module; the
hooks record the order in which modules finish and each one's output. The plan is then
replayed on the recorded tensors: each norm, attention and FFN step is its module applied
to the tensor the plan says it reads, each residual add the sum of the two tensors the
plan names, and every result must be exactly (float64, bit for bit) the tensor the model
produced under the names the plan says the step writes. A plan built for another norm
placement must fail the same check (the negative control).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tinylm
from tinylm import plan as tplan
from tinylm.errors import ConfigError

VARIANTS = list(itertools.product(("pre", "post", "none"), ("swiglu", "silu"), (True, False), (False, True)))


def _config(norm: str, ffn: str, rope: bool, tied: bool, layers: int = 3) -> tinylm.ModelConfig:
    return tinylm.ModelConfig(vocab_size=53, context_length=8, d_model=16, num_layers=layers, num_heads=2, d_ff=24,
                              norm=norm, ffn=ffn, positions="rope" if rope else "none", tie_embeddings=tied)


def _record(model: tinylm.TransformerLM, tokens: torch.Tensor) -> tuple[list[str], dict[str, torch.Tensor], torch.Tensor]:
    """(module names in the order they finished, {name: output}, logits)."""
    order: list[str] = []
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in model.named_modules():
        if mod is model:
            continue

        def hook(_m, _inp, out, name=name):
            order.append(name)
            outputs[name] = out.detach()
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(tokens)
    finally:
        for h in handles:
            h.remove()
    return order, outputs, logits


def _mismatches(model: tinylm.TransformerLM, plan: tplan.ModelPlan, tokens: torch.Tensor) -> list[str]:
    """Every way in which the model's run disagrees with ``plan`` (empty: the plan describes it)."""
    for m in model.modules():  # one attention path for the hooked run and the recomputation below
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = True
    order, rec, logits = _record(model, tokens)
    modules = dict(model.named_modules())
    wanted = set(plan.modules())
    bad = []
    ran = [n for n in order if n in wanted]
    if ran != list(plan.modules()):
        bad.append(f"order: model ran {ran}, plan says {list(plan.modules())}")
    env = {plan.embedding: rec[plan.embedding]}

    def same(name: str, value: torch.Tensor) -> None:
        if "+" in name:  # a sum no module outputs: nothing recorded to compare
            return
        if name not in rec:
            bad.append(f"{name}: the plan writes it, the model records no such output")
        elif not torch.equal(rec[name], value):
            bad.append(f"{name}: the plan's value differs from the model's by {float((rec[name] - value).abs().max()):.3g}")

    if plan.positions is not None:  # learned positions: block 0 reads token + position embeddings
        if plan.positions not in rec:
            return bad + [f"{plan.positions}: the plan adds a position table, the model has none"]
        env[plan.input] = env[plan.embedding] + rec[plan.positions]
        same(plan.input, env[plan.input])

    for block in plan.blocks:
        for step in block.steps:
            missing = [r for r in step.reads if r not in env]
            if missing or step.module not in modules:
                bad.append(f"{step.module}: reads {missing} before they are written, or no such module")
                return bad
            with torch.no_grad():
                if step.kind == "add":
                    value = env[step.reads[0]] + env[step.reads[1]]
                else:
                    value = modules[step.module](env[step.reads[0]])
            for name in step.writes:
                same(name, value)
                env[name] = value
    with torch.no_grad():
        if plan.final_norm is not None:
            if plan.final_norm not in modules or modules[plan.final_norm] is None:
                return bad + [f"{plan.final_norm}: no such module"]
            env[plan.final_norm] = modules[plan.final_norm](env[plan.blocks[-1].output])
            same(plan.final_norm, env[plan.final_norm])
        elif getattr(model, "ln_final", None) is not None:
            bad.append("the model has ln_final, the plan none")
        head = modules[plan.head](env[plan.head_input()])
    if not torch.equal(head, logits):
        bad.append("logits: lm_head of the plan's head input is not the model's output")
    return bad


@pytest.mark.parametrize("norm,ffn,rope,tied", VARIANTS)
def test_plan_matches_the_model(norm, ffn, rope, tied):
    cfg = _config(norm, ffn, rope, tied)
    gen = torch.Generator().manual_seed(7)
    model = tinylm.TransformerLM(cfg, generator=gen, dtype=torch.float64).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
    assert _mismatches(model, tplan.build(cfg), tokens) == []
    # negative control: the plan of either other norm placement does not describe this model
    for other in {"pre", "post", "none"} - {norm}:
        assert _mismatches(model, tplan.build(cfg.replace(norm=other)), tokens), other


def test_a_plan_with_the_adds_swapped_is_caught():
    """Negative control inside one placement: a pre-norm plan whose first add reads the norm output
    instead of the stream (x' = ln1(x) + attn) disagrees with the model at resid_mid."""
    cfg = _config("pre", "swiglu", True, False, layers=1)
    gen = torch.Generator().manual_seed(3)
    model = tinylm.TransformerLM(cfg, generator=gen, dtype=torch.float64).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
    good = tplan.build(cfg)
    steps = list(good.blocks[0].steps)
    add = steps[2]
    assert add.kind == "add" and add.reads == ("token_embeddings", "layers.0.attn")
    steps[2] = tplan.Step("add", add.module, ("layers.0.ln1", "layers.0.attn"), add.writes, add.branch)
    bad_block = tplan.BlockPlan(0, good.blocks[0].input, good.blocks[0].mid, good.blocks[0].output, tuple(steps))
    bad = tplan.ModelPlan(cfg, (bad_block,), final_norm=good.final_norm)
    found = _mismatches(model, bad, tokens)
    assert any(f.startswith("layers.0.resid_mid:") for f in found), found


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_plan_names_are_the_probes_names(norm):
    """Every tensor the plan names (sums aside) is a point the probe instruments, with the kind
    the plan gives it; the residual points and branches are what the helpers say."""
    from diagnostics.measure.probe import instrument_points

    cfg = _config(norm, "swiglu", True, False, layers=2)
    p = tplan.build(cfg)
    points = instrument_points(tinylm.TransformerLM(cfg, device="meta"))
    named = {n for b in p.blocks for s in b.steps for n in s.writes + s.reads if "+" not in n}
    assert named - set(points) == set()
    assert p.residual_points() == ("token_embeddings", "layers.0.resid_mid", "layers.0", "layers.1.resid_mid", "layers.1")
    assert p.block_outputs() == ("token_embeddings", "layers.0", "layers.1")
    assert [points[n] for n in p.residual_points()] == ["embedding", "resid_mid", "residual", "resid_mid", "residual"]
    br = p.branches()
    assert [(b.name, b.kind, b.block, b.stream) for b in br] == [
        ("layers.0.attn", "attn", 0, "token_embeddings"), ("layers.0.ffn", "ffn", 0, "layers.0.resid_mid"),
        ("layers.1.attn", "attn", 1, "layers.0"), ("layers.1.ffn", "ffn", 1, "layers.1.resid_mid")]
    assert {points[b.name] for b in br} == {"attn_branch", "ffn_branch"}
    norms = {"pre": ["layers.0.ln1", "layers.0.ln2", "layers.1.ln1", "layers.1.ln2"]}.get(norm, [None] * 4)
    assert [b.norm for b in br] == norms
    assert p.final_norm == ("ln_final" if norm == "pre" else None)
    assert p.branch("layers.1.ffn").stream == "layers.1.resid_mid"
    assert all(tplan.branch_stream(b.kind, b.block) == b.stream for b in br)
    assert [tplan.stream_into(b.index) for b in p.blocks] == [b.input for b in p.blocks]
    with pytest.raises(KeyError, match="name='layers.1.ln1'"):
        p.branch("layers.1.ln1")


def test_block_index_and_bad_input():
    assert [tplan.block_index(n) for n in ("layers.3", "layers.12.attn.q_proj", "lm_head", "layers.x")] == [3, 12, None, None]
    with pytest.raises(ConfigError, match="config=dict"):
        tplan.build({"norm": "pre"})
    with pytest.raises(ValueError, match="kind='mlp'"):
        tplan.branch_stream("mlp", 0)


def test_describe_reads_as_the_block_docstring():
    """The text form of a one-block plan, per placement (TransformerBlock's docstring, step by step)."""
    text = {n: tplan.build(_config(n, "swiglu", True, False, layers=1)).describe() for n in ("pre", "post", "none")}
    assert text["pre"].splitlines()[1:] == [
        "layers.0.ln1: norm(token_embeddings) -> layers.0.ln1",
        "layers.0.attn: attention(layers.0.ln1) -> layers.0.attn",
        "layers.0.resid_mid: add(token_embeddings, layers.0.attn) -> layers.0.resid_mid",
        "layers.0.ln2: norm(layers.0.resid_mid) -> layers.0.ln2",
        "layers.0.ffn: ffn(layers.0.ln2) -> layers.0.ffn",
        "layers.0: add(layers.0.resid_mid, layers.0.ffn) -> layers.0",
        "ln_final: norm(layers.0) -> ln_final",
        "lm_head: linear(ln_final) -> logits"]
    assert text["post"].splitlines()[1:] == [
        "layers.0.attn: attention(token_embeddings) -> layers.0.attn",
        "layers.0: add(token_embeddings, layers.0.attn) -> token_embeddings+layers.0.attn",
        "layers.0.ln1: norm(token_embeddings+layers.0.attn) -> layers.0.ln1 = layers.0.resid_mid",
        "layers.0.ffn: ffn(layers.0.resid_mid) -> layers.0.ffn",
        "layers.0: add(layers.0.resid_mid, layers.0.ffn) -> layers.0.resid_mid+layers.0.ffn",
        "layers.0.ln2: norm(layers.0.resid_mid+layers.0.ffn) -> layers.0.ln2 = layers.0",
        "lm_head: linear(layers.0) -> logits"]
    assert [line.split(":")[0] for line in text["none"].splitlines()] == [
        "token_embeddings", "layers.0.attn", "layers.0.resid_mid", "layers.0.ffn", "layers.0", "lm_head"]


def test_the_watch_records_and_judges_what_the_plan_names():
    import torch

    import tinylm
    from diagnostics.jobs import watch as W
    from diagnostics.judge import over_time as V

    for norm in ("pre", "post", "none"):
        config = tinylm.ModelConfig(vocab_size=20, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32,
                                    norm=norm)
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        p = tinylm.plan.build(config)
        sites = W.default_sites(model)
        assert set(p.residual_points()) <= set(sites) and {b.name for b in p.branches()} <= set(sites)
        assert sites[0] == p.embedding and sites[-1] == p.head
        judged = {s for s in sites if V.judged(s, norm)}
        stream = set(p.residual_points()) if norm != "pre" else set()
        assert judged == stream | {p.head} | {f"{b.name}.scores" for b in p.branches() if b.kind == "attn"}
