"""Attention statistics from the heads' inputs (diagnostics.measure.attention) against the explicit path.

Contract: on the same q, k, v and upstream gradient, the blockwise statistics equal those of
the explicit path's scores, weights and their gradients (tinylm.functional.attention_scores,
softmax, the autograd of ``probs @ v``) reduced over their causal entries: counts and max |x|
identical, mean and M2 to float64 rounding of the reduction (the same tensors, formed in
blocks, summed in another order), the panel's row counts identical and its entropies to
rounding. Then the probe: the fused path under a probe records the same figures as the explicit
path under a probe, in the same order, and a probe keeps the fused kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import probe
from diagnostics.measure import attention
from diagnostics.measure.reducer import reduce
from diagnostics.measure.reference import ATTN_FIELDS, FIELDS
from tinylm import functional as TF

U64 = torch.finfo(torch.float64).eps / 2


def _explicit(q, k, v, dO):
    """The explicit path's statistics: (S fwd, P fwd, P panel, dS, dP), reduced as a probe reduces a Tap."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    s = TF.attention_scores(q, k, TF.causal_mask(q.shape[-2]))
    p = TF.softmax(s, dim=-1)
    got = {}
    s.register_hook(lambda g: got.__setitem__("ds", reduce(g, causal=True).moments))
    p.register_hook(lambda g: got.__setitem__("dp", reduce(g, causal=True).moments))
    r = reduce(p.detach(), causal=True, probs=True)
    (p @ v).backward(dO)
    return reduce(s.detach(), causal=True).moments, r.moments, r.panel, got["ds"], got["dp"]


def _close(got: torch.Tensor, want: torch.Tensor, names=FIELDS, rel: float = 1e-6) -> list:
    """Fields that differ: counts and extremes exactly; M2 and the entropies to ``rel``; the mean
    to ``rel`` of the spread (a mean of about 0, as the scores' gradient has, is rounding noise)."""
    bad = []
    v = dict(zip(names, want.tolist()))
    spread = math.sqrt(v["m2"] / v["count"]) if "m2" in v and v["count"] else 0.0
    for n, a, b in zip(names, got.tolist(), want.tolist()):
        if n == "mean":
            ok = abs(a - b) <= rel * (spread + abs(b))
        elif n in ("m2", "entropy_mean", "entropy_m2", "entropy_min"):
            ok = a == b or abs(a - b) <= rel * abs(b)
        else:
            ok = a == b
        if not ok:
            bad.append((n, a, b))
    return bad


def _inputs(lead, T, d, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dO = (torch.randn(*lead, T, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(4))
    return q * scale, k * scale, v, dO


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lead,T,block", [((2, 3), 37, 8), ((5,), 64, 64), ((), 20, None), ((1, 2), 130, 64)])
def test_blockwise_statistics_equal_the_explicit_paths(dtype, lead, T, block):
    q, k, v, dO = _inputs(lead, T, 8, dtype, seed=T)
    s, p, panel, ds, dp = _explicit(q, k, v, dO)
    fs, fp, fpanel = attention.forward_statistics(q, k, block=block)
    bs, bp = attention.backward_statistics(q, k, v, dO, block=block)
    # products of small blocks may round differently from the whole matrix's (float32: 1e-7)
    rel = 1e-12 if dtype == torch.float64 else 1e-6
    assert _close(fs, s, rel=rel) == [] and _close(fp, p, rel=rel) == []
    assert _close(fpanel, panel, ATTN_FIELDS, rel=rel) == []
    assert _close(bs, ds, rel=rel) == [] and _close(bp, dp, rel=rel) == []


def test_peaked_scores_flush_and_saturate_as_the_explicit_path():
    """Scores far apart: weights flushed to exactly 0 and rows saturated, counted the same."""
    q, k, v, dO = _inputs((2, 2), 48, 8, torch.float32, seed=1, scale=12.0)
    s, p, panel, ds, dp = _explicit(q, k, v, dO)
    fs, fp, fpanel = attention.forward_statistics(q, k, block=16)
    assert fp[FIELDS.index("n_zero")] > 0 and fpanel[ATTN_FIELDS.index("rows_saturated")] > 0
    assert _close(fs, s) == [] and _close(fp, p) == [] and _close(fpanel, panel, ATTN_FIELDS) == []
    bs, bp = attention.backward_statistics(q, k, v, dO, block=16)
    assert _close(bs, ds) == [] and _close(bp, dp) == []


def test_check_rejects_statistics_of_other_rows():
    """Negative control: the statistics of a shifted causal pattern (one key fewer per row) differ."""
    q, k, v, dO = _inputs((3,), 40, 8, torch.float32, seed=2)
    fs, fp, _ = attention.forward_statistics(q, k)
    s2, p2, _, _, _ = _explicit(q[..., 1:, :], k[..., :-1, :], v[..., :-1, :], dO[..., 1:, :])
    assert _close(fs, s2) != [] and _close(fp, p2) != []


def test_chunks_divide_the_matrices_and_respect_the_budget():
    assert attention._chunk(64, 256) == 4 and attention._chunk(12, 1024) == 1
    assert attention._chunk(7, 128) == 7 and attention._chunk(14, 150) == 7
    assert attention._chunk(3, 4096) == 1  # one matrix over the budget: one at a time


def test_nothing_asked_computes_nothing():
    q, k, v, dO = _inputs((2,), 8, 4, torch.float32, seed=3)
    assert attention.forward_statistics(q, k, scores=False, probs=False) == (None, None, None)
    assert attention.backward_statistics(q, k, v, dO, scores=False, probs=False) == (None, None)
    s, p, panel = attention.forward_statistics(q, k, probs=False)
    assert s is not None and p is None and panel is None


# -- under a probe ------------------------------------------------------------------------------

CFG = tinylm.ModelConfig(vocab_size=64, context_length=96, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def _probed(model, tok, explicit: bool, **options):
    from diagnostics import ProbeOptions
    for m in model.modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = explicit
    try:
        with probe(model, ProbeOptions(**options)) as run:
            TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()
    finally:
        for m in model.modules():
            if isinstance(m, tinylm.MultiHeadSelfAttention):
                m.explicit = False
    model.zero_grad(set_to_none=True)
    return run.stats


def test_probe_on_the_fused_path_records_what_the_explicit_path_records():
    """Same keys in the same order, same counts; moments of the first block's attention (same
    inputs) to float64 rounding, later blocks to the float32 rounding the two paths differ by."""
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (3, 81), generator=torch.Generator().manual_seed(1))
    e, f = _probed(model, tok, True), _probed(model, tok, False)
    assert list(e.tensors) == list(f.tensors) and e.order == f.order and e.kinds == f.kinds
    assert list(e.attention) == list(f.attention) == ["layers.0.attn.probs", "layers.1.attn.probs"]
    for key, m in e.tensors.items():
        if ".attn.scores" not in key[0] and ".attn.probs" not in key[0]:
            continue
        first = key[0].startswith("layers.0.") and key[1] == "forward"
        got, want = torch.tensor(f.tensors[key].vector()), torch.tensor(m.vector())
        for n, a, b in zip(FIELDS, got.tolist(), want.tolist()):
            if n == "mean":  # a mean of about zero (the scores' gradient) is rounding noise
                assert abs(a - b) <= 1e-6 * math.sqrt(m.var) + 1e-12 * abs(b), (key, n)
            elif n in ("m2", "max_abs"):
                assert abs(a - b) <= (1e-12 if first else 1e-4) * abs(b), (key, n, a, b)
            else:
                assert a == b, (key, n, a, b)
    for name, a in e.attention.items():
        b = f.attention[name]
        assert (a.rows, a.rows_after_first, a.rows_saturated) == (b.rows, b.rows_after_first, b.rows_saturated)
        assert abs(a.entropy_mean - b.entropy_mean) <= 1e-6 * a.entropy_mean


def test_probe_keeps_the_fused_kernel_and_measures_only_the_points_asked(monkeypatch):
    calls = {"fused": 0}
    fused = torch.nn.functional.scaled_dot_product_attention

    def count(*a, **kw):
        calls["fused"] += 1
        return fused(*a, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", count)
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    stats = _probed(model, tok, False, modules=["layers.1.attn.scores"])
    assert calls["fused"] == 2
    assert set(stats.tensors) == {("layers.1.attn.scores", "forward"), ("layers.1.attn.scores", "backward")}
    assert stats.attention == {}
    assert all(not m.__dict__.get("_observers") for m in model.modules()
               if isinstance(m, tinylm.MultiHeadSelfAttention))


def test_dropout_in_training_is_measured_on_the_explicit_weights():
    """Training with attention dropout takes the explicit path; the observer reads the weights
    it formed (the gradient through the dropout mask cannot be recomputed from q, k, v)."""
    model = tinylm.TransformerLM(CFG.replace(dropout=0.3), generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    stats = _probed(model, tok, False, eval_mode=False)
    assert ("layers.0.attn.probs", "backward") in stats.tensors
    assert stats.attention["layers.0.attn.probs"].rows == 2 * 4 * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_softmax_is_tinylms_bit_for_bit(dtype):
    """The blockwise softmax (in place, float32 at least) gives tinylm.functional.softmax's bits,
    flushed zeros included; rounded to bf16 it gives the model's weights."""
    g = torch.Generator().manual_seed(4)
    s = (torch.randn(3, 17, 40, generator=g, dtype=torch.float64) * 40).to(dtype)
    s[..., 30:] = -math.inf
    wide = torch.promote_types(dtype, torch.float32)
    want = TF.softmax(s.to(wide), dim=-1)
    assert (want == 0).any() and torch.equal(attention._softmax(s), want)
    out = torch.empty(3, 17, 40, dtype=wide)
    assert torch.equal(attention._softmax(s, out), want) and torch.equal(out, want)
    assert torch.equal(attention._softmax(s).to(dtype), TF.softmax(s, dim=-1))


def test_forward_figures_wait_for_the_gradient_and_never_go_missing():
    """The fused path's forward figures are taken with the gradient's; a forward whose gradient
    never comes is measured on exit, one followed by another forward of the same attention at
    that forward: every way gives the figures of a forward measured at once (no gradient)."""
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    keys = [("layers.1.attn.probs", "forward"), ("layers.0.attn.scores", "forward")]

    def figures(how):
        with probe(model) as run:
            if how == "no_grad":
                with torch.no_grad():
                    model(tok[:, :-1])
            elif how == "dropped":
                model(tok[:, :-1])  # graph kept, never differentiated
            else:  # two forwards, then one backward of both (gradient accumulation)
                loss = sum(TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]) for _ in range(2))
                loss.backward()
        model.zero_grad(set_to_none=True)
        return run.stats

    once, dropped, twice = figures("no_grad"), figures("dropped"), figures("accumulated")
    for key in keys:
        assert dropped.tensors[key].vector() == once.tensors[key].vector()
        a, b = twice.tensors[key], once.tensors[key]
        assert a.count == 2 * b.count and a.max_abs == b.max_abs and abs(a.m2 - 2 * b.m2) <= 1e-9 * b.m2
    assert dropped.attention["layers.1.attn.probs"].vector() == once.attention["layers.1.attn.probs"].vector()
    assert twice.attention["layers.1.attn.probs"].rows == 2 * once.attention["layers.1.attn.probs"].rows
    assert ("layers.0.attn.scores", "backward") in twice.tensors
    assert list(dropped.tensors) == list(once.tensors)


def test_a_subclass_with_its_own_forward_is_measured_through_its_taps():
    """An attention subclass whose forward computes the weights itself (calling the Taps, no
    observer) keeps being measured by hooks on its Taps."""

    class Own(tinylm.MultiHeadSelfAttention):
        def forward(self, x, token_positions=None):
            from einops import rearrange
            split = "... t (h d) -> ... h t d"
            q, k, v = (rearrange(p(x), split, h=self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
            s = self.scores(TF.attention_scores(q, k, TF.causal_mask(x.shape[-2])))
            p = self.probs(TF.softmax(s, dim=-1))
            return self.output_proj(rearrange(p @ v, "... h t d -> ... t (h d)"))

    model = tinylm.TransformerLM(CFG.replace(positions="none"), generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    want = _probed(model, tok, True)
    for block in model.layers:
        block.attn.__class__ = Own
    got = _probed(model, tok, False)
    for key in [("layers.0.attn.scores", "forward"), ("layers.1.attn.probs", "backward")]:
        assert got.tensors[key].count == want.tensors[key].count > 0
    assert got.attention["layers.1.attn.probs"].rows == want.attention["layers.1.attn.probs"].rows


def test_a_windowed_attention_is_measured_over_the_entries_its_window_allows():
    """A sliding window masks causal entries with -inf: those are not scores. The probe measures
    the scores over the (T, T) entries the window allows (sum over rows of min(i + 1, W)), and a
    healthy windowed model is not called non-finite."""
    import dataclasses

    import tinylm
    from diagnostics import DiagnoseOptions, diagnose

    T, W, B, batches = 16, 4, 4, 2
    cfg = dataclasses.replace(tinylm.preset("tiny"), sliding_window=W)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    result = diagnose(model, options=DiagnoseOptions(batch_size=B, batches=batches, seq_len=T))
    assert result.status == "healthy", result.findings
    allowed = sum(min(i + 1, W) for i in range(T))
    assert result.tensor("layers.0.attn.scores").count == allowed * cfg.num_heads * B * batches
    assert result.tensor("layers.0.attn.scores").frac_nonfinite == 0.0
