"""Verdict defaults: healthy pre-norm at depth 2, 8, 48; exploding, vanishing and non-finite models named,
each finding with its cause and severity."""

import math

import pytest
import torch

import tinylm
from diagnostics import DepthRow, DiagnoseOptions, OptionsError, TensorRow, Thresholds, diagnose
from diagnostics.judge import judge
from diagnostics.judge.symptoms import growth

OPTS = DiagnoseOptions(batch_size=2, seq_len=16, batches=1)
OPTS48 = DiagnoseOptions(batch_size=1, seq_len=16, batches=1)


def model_of(L, norm="pre", init="cs336", d=128, seed=0):
    cfg = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=d, num_layers=L, num_heads=4,
                             d_ff=tinylm.default_d_ff(d), norm=norm, init=init)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(seed))


def tiny_std(site):
    if site.kind == "linear_weight":
        return tinylm.init.Dist("normal", std=1e-3, why="every weight std 1e-3 (test)")
    return tinylm.init.cs336(site)


if "test-std-1e-3" not in tinylm.init.SCHEMES:
    tinylm.init.register("test-std-1e-3", tiny_std)


@pytest.mark.parametrize("L", [2, 8, 48])
def test_cs336_pre_norm_is_healthy(L):
    r = diagnose(model_of(L), options=OPTS48 if L == 48 else OPTS)
    assert r.healthy, [f.message for f in r.findings]
    grown = r.depth[-1].forward_var / r.depth[0].forward_var
    if L == 48:
        # the stream grows ~linearly with depth (~40x over 48 blocks at d 128): not geometric, not exploding
        assert 20 < grown < 80
        assert growth([d.forward_var for d in r.depth]) == "linear"
        assert max(b.forward_var / a.forward_var for a, b in zip(r.depth, r.depth[1:])) < 2


def test_no_norm_explodes_and_names_the_first_block():
    r = diagnose(model_of(8, norm="none"), options=OPTS)
    ex = [f for f in r.findings if f.kind == "exploding"]
    assert len(r.findings) == 1 and ex, [f.message for f in r.findings]
    f = ex[0]
    assert f.cause == "no_norm" and f.severity == "fail" and "pre-norm" in f.suggestion
    v = [d.forward_var for d in r.depth]
    gains = [b / a for a, b in zip(v, v[1:])]
    # the first block that starts three blocks in a row each multiplying the stream by more than 4
    first = next(k for k in range(len(gains) - 2) if all(g > 4 for g in gains[k:k + 3]))
    assert f.direction == "forward" and f.where == f"layers.{first}" and f.block == first
    assert f.value == pytest.approx(gains[first]) and f.threshold == 4.0 and f.value > f.threshold
    assert all(math.isfinite(d.forward_var) for d in r.depth)  # still finite, yet exploding
    assert growth([d.forward_var for d in r.depth]) == "geometric"
    assert r.tensor(f.where).verdict == "exploding"  # the block the finding names is flagged in the table
    assert not r.healthy


def test_tiny_weights_vanish_and_the_cause_is_the_weight_scale():
    r = diagnose(model_of(8, norm="none", init="test-std-1e-3"), options=OPTS)
    assert [(f.cause, f.severity) for f in r.findings] == [("init_scale", "fail")], [f.message for f in r.findings]
    f = r.findings[0]
    # the evidence: std^2 fan_in = 1e-6 * 128, far under the 0.01 threshold (the declared scheme is this one)
    assert f.value == pytest.approx(1e-6 * 128, rel=0.05) and f.value < f.threshold == 0.01
    assert f.kind == "vanishing" and "consequences" in f.message and "layers.0.attn adds" in f.message
    assert "1/sqrt(fan_in)" in f.suggestion
    # the stream itself keeps the embedding's variance
    assert r.depth[-1].forward_var == pytest.approx(r.depth[0].forward_var, rel=0.01)
    assert r.tensor("layers.7.ffn").verdict == "vanishing"


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.float32, 6), (torch.bfloat16, 10)])
def test_exploding_no_norm_model_names_one_root_cause(dtype, seed):
    """No norm, L 8: the stream explodes (variance ~1e43-1e74 by the last block; seed 6 overflows in
    block 7's scores). Readings measured against the blown-up scale (branch / stream, a block's weight
    gradients / the model's largest, the gradient's gain below an overflow) are consequences of the
    explosion: no vanishing finding, the exploding finding says what it swallowed. Before the fix seed 6
    was also called "vanishing" (block 0's weight gradients 0x the largest), and so was bf16 seed 10
    (block 6's, 1.9e-9x)."""
    r = diagnose(model_of(8, norm="none", seed=seed).to(dtype), options=OPTS)
    assert {f.cause for f in r.findings} == {"no_norm"}, [f.message for f in r.findings]
    root = r.findings[0]
    assert root.kind == "exploding" and root.severity == "fail"
    overflowed = any(t.frac_nonfinite > 0 for t in r.tensors if t.name.startswith("layers.7."))
    assert r.depth[-1].forward_var > 1e40 or not math.isfinite(r.depth[-1].forward_var) or overflowed
    assert all(t.verdict != "vanishing" for t in r.tensors) and all(p.verdict != "vanishing" for p in r.params)
    if seed != 0:  # the swallowed readings are named in the root finding, not lost
        assert "downstream" in root.message, root.message


def test_stream_that_overflows_part_way_is_still_called_exploding():
    """No norm, L 10: block 8's scores overflow, so the stream's variance is nan from there on. The
    blocks before the overflow are judged, so the report names the explosion (from block 2) as the
    cause of the non-finite tensor, which it names as a consequence."""
    r = diagnose(model_of(10, norm="none"), options=OPTS)
    assert not math.isfinite(r.depth[-1].forward_var)
    assert [f.cause for f in r.findings] == ["no_norm"], [f.message for f in r.findings]
    f = r.findings[0]
    assert f.kind == "exploding" and f.where == "layers.2", f.message
    assert "layers.8.attn.scores (forward) is the first tensor with non-finite entries" in f.message
    assert r.tensor("layers.8.attn.scores").verdict == "non_finite"


def _row(name, kind, block, var, direction="forward"):
    return TensorRow(name=name, block=block, kind=kind, direction=direction, count=100, mean=0.0, var=var,
                     mean_square=var, max_abs=math.sqrt(var) * 4, frac_zero=0.0, frac_nonfinite=0.0,
                     frac_fp16_underflow=0.0, frac_fp16_overflow=0.0, frac_bf16_underflow=0.0, frac_bf16_overflow=0.0)


def test_branch_small_next_to_an_exploded_stream_is_not_vanishing():
    """judge() on a stream that explodes from block 1 (gains 1.5, 6.7, 100, 1000): block 3's attention
    branch is 1e-9 of the 1e3 stream it is added to, only because the stream blew up: folded into the
    exploding finding. Negative control: block 0's FFN branch, 1e-9 of a stream that has not exploded
    yet, is still a vanishing branch (its own finding: no evidence ties it to the explosion)."""
    fwd = [1.0, 1.5, 10.0, 1e3, 1e6]
    names = ["token_embeddings"] + [f"layers.{i}" for i in range(4)]
    depth = [DepthRow(index=k, name=n, forward_var=v, forward_predicted=None, backward_var=None,
                      backward_predicted=None, cosine=0.0) for k, (n, v) in enumerate(zip(names, fwd))]
    rows = [_row(n, "embedding" if k == 0 else "residual", None if k == 0 else k - 1, v)
            for k, (n, v) in enumerate(zip(names, fwd))]
    rows += [_row("layers.0.resid_mid", "resid_mid", 0, 1.2), _row("layers.0.ffn", "ffn_branch", 0, 1.2e-9),
             _row("layers.0.attn", "attn_branch", 0, 0.2), _row("layers.3.resid_mid", "resid_mid", 3, 1e3),
             _row("layers.3.attn", "attn_branch", 3, 1e-6), _row("layers.3.ffn", "ffn_branch", 3, 1e6)]
    order = ["token_embeddings", "layers.0.attn", "layers.0.resid_mid", "layers.0.ffn", "layers.0",
             "layers.1", "layers.2", "layers.3.attn", "layers.3.resid_mid", "layers.3.ffn", "layers.3"]
    findings, tv, _, _ = judge(rows, [], [], depth, order, Thresholds())
    ex = [f for f in findings if f.kind == "exploding"]
    assert len(ex) == 1 and ex[0].where == "layers.1", [f.message for f in findings]
    assert ex[0].cause == "unclear"  # no build given: the norm placement is unknown, and the finding says so
    assert "layers.3.attn" in ex[0].message and "downstream" in ex[0].message
    van = [f for f in findings if f.kind == "vanishing"]
    assert [f.where for f in van] == ["layers.0.ffn"] and van[0].value == pytest.approx(1e-9)
    assert "layers.3.attn" not in van[0].message  # the downstream branch is not counted either
    assert tv.get(("layers.3.attn", "forward"), "ok") == "ok" and tv[("layers.0.ffn", "forward")] == "vanishing"


def test_nan_weight_is_non_finite_and_named():
    m = model_of(4)
    with torch.no_grad():
        m.layers[2].ffn.w1.weight[3, 5] = float("nan")
    r = diagnose(m, options=OPTS)
    assert [(f.cause, f.severity) for f in r.findings] == [("non_finite", "fail")]
    nf = r.findings[0]
    assert nf.kind == "non_finite" and nf.where == "layers.2.ffn.w1" and "layers.2.ffn.w1.weight" in nf.message
    assert "restore" in nf.suggestion
    assert r.tensor("layers.2.ffn.w1").verdict == "non_finite"
    assert r.tensor("layers.2.ffn.w3").verdict == "ok"  # the sibling reads the same finite input


@pytest.mark.parametrize("init", ["small-init", "kaiming"])
def test_linear_growth_from_a_small_embedding_is_not_exploding(init):
    """small-init's embedding (var 2/(5d)) and kaiming's large branches make the first gains > 4,
    but the increments stay constant: linear growth, not geometric."""
    r = diagnose(model_of(3, init=init, d=64), options=OPTS)
    assert max(b.forward_var / a.forward_var for a, b in zip(r.depth, r.depth[1:])) > 4
    assert not [f for f in r.findings if f.kind == "exploding"], [f.message for f in r.findings]


def test_zero_residual_is_not_called_dead_or_vanishing():
    r = diagnose(model_of(4, init="zero-residual"), options=OPTS)
    assert r.healthy, [f.message for f in r.findings]


def test_saturated_attention_is_flagged_with_its_cause():
    m = model_of(2)
    with torch.no_grad():
        m.layers[1].attn.q_proj.weight.mul_(30.0)
        m.layers[1].attn.k_proj.weight.mul_(30.0)
    r = diagnose(m, options=OPTS)
    assert {f.cause for f in r.findings} == {"saturated_attention"}, [f.message for f in r.findings]
    f = r.findings[0]
    assert f.where == "layers.1.attn" and f.severity == "fail" and "QK-norm" in f.suggestion
    assert "% of layers.1.attn's query rows" in f.message  # the saturation is named as what it explains
    assert r.attention[0].verdict == "ok" and r.attention[1].verdict == "saturated"


def test_missing_score_scale_is_named_and_a_scaled_model_is_not():
    """Scores without 1/sqrt(d_k): E[s^2] / (E[q^2] E[k^2]) ~ d_k = 64 (1 with the scale). Negative
    control: the same model with the scale measures ~1 and gets no finding."""
    from benchmarks.verdict_zoo import scaled_scores

    for power, expect in ((0.5, 64.0), (0.0, 1.0)):
        m = scaled_scores(power, d=128, L=2, heads=2)()
        r = diagnose(m, options=OPTS)
        if power:
            assert [(f.cause, f.severity) for f in r.findings] == [("score_scale", "fail")]
            assert r.findings[0].value == pytest.approx(expect, rel=0.25) and "sqrt(d_k)" in r.findings[0].suggestion
        else:
            assert r.healthy and not r.findings, [f.message for f in r.findings]


def test_deep_post_norm_warns_and_the_advice_fits_the_build():
    from benchmarks.verdict_zoo import fresh

    # 32 tokens: depth 12 reads 2.7-6.8 over seeds there, clear of the threshold 2 (docs/verdicts.md)
    r = diagnose(fresh(d=64, L=12, T=32, norm="post")(), options=DiagnoseOptions(batch_size=2, seq_len=32, batches=2))
    assert [(f.cause, f.severity) for f in r.findings] == [("post_norm_depth", "warn")], [f.message for f in r.findings]
    assert r.healthy and r.warnings and not r.failures  # trains, with care
    assert "warm" in r.findings[0].suggestion and "Xiong" in r.findings[0].message
    # a pre-norm model is never told to add pre-norm
    for f in diagnose(model_of(2, d=64), options=OPTS).findings:
        raise AssertionError(f"healthy pre-norm model got {f.message}")


def test_advice_never_adds_pre_norm_to_a_pre_norm_model():
    """Every broken pre-norm model of the zoo: no suggestion tells it to add or move to pre-norm."""
    from benchmarks.verdict_zoo import CASES

    for case in CASES:
        if not case.quick or case.cause is None:
            continue
        m = case.build()
        if m.config.norm != "pre":
            continue
        r = diagnose(m, options=DiagnoseOptions(batch_size=2, seq_len=case.seq_len, batches=2, theory="none"))
        for f in r.findings:
            assert "pre-norm (" not in f.suggestion and "norm='pre'" not in f.suggestion, (case.name, f.suggestion)


def test_thresholds_are_validated_and_change_verdicts():
    with pytest.raises(OptionsError, match="exploding_gain"):
        Thresholds(exploding_gain=0.5)
    with pytest.raises(OptionsError, match="dead_fraction"):
        Thresholds(dead_fraction=float("nan"))
    with pytest.raises(OptionsError, match="saturated_fail"):
        Thresholds(saturated_rows=0.9, saturated_fail=0.5)
    with pytest.raises(OptionsError, match="exploding_run"):
        Thresholds(exploding_run=1.5)
    assert Thresholds.from_dict(Thresholds().to_dict()) == Thresholds()
    old = {k: v for k, v in Thresholds().to_dict().items() if k in ("exploding_gain", "vanishing_gain", "watch_growth")}
    assert Thresholds.from_dict(old) == Thresholds()  # a history written before the new fields
    # negative control: a threshold below what a healthy model measures turns it into a finding
    # (4 blocks: a stack shallower than exploding_run has no run of gains to judge)
    r = diagnose(model_of(4), options=DiagnoseOptions(batch_size=2, seq_len=16, batches=1,
                                                       thresholds=Thresholds(exploding_gain=1.01)))
    assert any(f.kind == "exploding" for f in r.findings)


def test_growth_classifier():
    assert growth([1 + 0.8 * k for k in range(49)]) == "linear"
    assert growth([1.5**k for k in range(12)]) == "geometric"
    assert growth([1.0, 1.1, 1.2]) == "flat"
