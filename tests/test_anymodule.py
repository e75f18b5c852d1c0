"""Honest verdicts for any nn.Module: the block stack found by structure, the stream and the loss
judged by the same rules as tinylm's, attention seen through scaled_dot_product_attention, and a
model with nothing judgeable called "not judged", never healthy.

Thresholds here are the verdicts' own (diagnostics.Thresholds); the cases sit far from them
(the broken ones by factors of 4 to 1e4, the healthy ones by factors of 3 to 100), so these are
deterministic checks on seeded models, not statistical tests.
"""

from __future__ import annotations

import io
import math
import types

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import tinylm
from tinylm import checkpoint
from benchmarks.verdict_zoo import GeluBlock, GeluLM, hf
from diagnostics import DiagnoseOptions, DiagnoseResult, OptionsError, diagnose
from diagnostics.measure import reference
from diagnostics.measure.blocks import find_blocks
from diagnostics.measure.sdpa import ROWS, SDPAWatch, sampled_attention
from diagnostics.result import LOSS, STREAM_BACKWARD, STREAM_FORWARD

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

OPTS = DiagnoseOptions(batch_size=2, seq_len=16, batches=2)
V = 1000


def gpt2(layers: int = 2, std: float | None = None):
    return hf("gpt2", std=std, L=layers, V=V)()


def llama(layers: int = 2):
    return hf("llama", L=layers, V=V)()


# ----------------------------------------------------------------------------- the block stack


@pytest.mark.parametrize("layers,norm", [(1, "pre"), (3, "pre"), (3, "post"), (2, "none")])
def test_the_stack_found_in_a_tinylm_model_is_its_plan(layers, norm):
    cfg = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=layers, num_heads=2, d_ff=32,
                             norm=norm)
    model = tinylm.TransformerLM(cfg, device="meta")
    stack = find_blocks(model)
    assert stack.names == tinylm.plan.build(cfg).block_outputs()[1:]
    for name, _ in model.named_modules():
        assert stack.index(name) == tinylm.plan.block_index(name), name


def test_the_stack_is_found_by_structure_in_any_model():
    assert find_blocks(gpt2(3)).names == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert find_blocks(llama(2)).names == ("model.layers.0", "model.layers.1")
    assert find_blocks(GeluLM(L=4)).names == tuple(f"blocks.{i}" for i in range(4))

    class Wide(nn.Module):  # a longer list of leaf Linears and a list of mixed classes are not block stacks
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4) for _ in range(9)])
            self.mixed = nn.Sequential(GeluBlock(4, 1.0), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
            self.blocks = nn.Sequential(GeluBlock(4, 1.0), GeluBlock(4, 1.0))
    assert find_blocks(Wide()).names == ("blocks.0", "blocks.1")
    assert find_blocks(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))) is None


# ----------------------------------------------------------------------------- verdicts of plain and HF models


def test_an_exploding_gelu_residual_model_fails_on_its_stream_gain_and_its_ordinary_twin_is_healthy():
    bad = diagnose(GeluLM(gain=4.0), options=OPTS)
    assert bad.status == "not healthy" and not bad.healthy
    f = next(f for f in bad.failures if f.kind == "exploding" and f.direction == "forward")
    assert f.statistic == "per-block forward variance gain" and f.value > 4 and f.where.startswith("blocks.")
    assert f.cause == "no_norm"  # its blocks hold no norm module: known from the structure
    assert [d.name for d in bad.depth] == ["blocks.input", *(f"blocks.{i}" for i in range(8))]
    assert bad.header.loss > 2 * bad.header.loss_uniform and "ln V" in f.message  # the loss, as a consequence
    # negative control: the same architecture at torch's default scale is not called exploding
    good = diagnose(GeluLM(gain=1.0), options=OPTS)
    assert good.findings == [] and good.status == "healthy"
    assert {STREAM_FORWARD, STREAM_BACKWARD, LOSS, "block weight gradients"} <= set(good.judged)


def test_hf_gpt2_with_weights_std_10_fails_with_the_loss_far_above_ln_v():
    r = diagnose(gpt2(4, std=10.0), options=OPTS)
    assert not r.healthy and r.header.loss > 50 * r.header.loss_uniform
    text = " ".join(f.message for f in r.failures)
    assert "ln V" in text and ("exploding" in {f.kind for f in r.failures} or "saturated" in text)
    assert {f.cause for f in r.failures} == {"init_scale"}
    assert all(a.saturated_frac > 0.99 for a in r.attention) and len(r.attention) == 4


@pytest.mark.parametrize("build", [lambda: gpt2(2), lambda: gpt2(4), lambda: llama(3)], ids=["gpt2-L2", "gpt2-L4",
                                                                                             "llama-L3"])
def test_hf_models_at_their_default_init_are_healthy_and_say_what_was_checked(build):
    model = build()
    r = diagnose(model, options=OPTS)
    assert r.findings == [] and r.status == "healthy"
    assert {STREAM_FORWARD, STREAM_BACKWARD, LOSS, "attention (saturated rows)", "non-finite values"} <= set(r.judged)
    assert dict(r.not_judged)["residual branches"]  # a reason, not silence
    layers = len(find_blocks(model))
    assert len(r.attention) == layers and all(a.saturated_frac < 0.1 for a in r.attention)
    assert len(r.depth) == layers + 1 and r.header.loss < 1.1 * r.header.loss_uniform


# ----------------------------------------------------------------------------- what models return, what they take


class Wrapped(nn.Module):
    """GeluLM's logits returned as ``kind``: a tuple, an object with .logits, or a dict; taken by keyword."""

    def __init__(self, kind: str):
        super().__init__()
        self.inner, self.kind = GeluLM(L=2), kind

    def forward(self, *, input_ids):
        z = self.inner(input_ids)
        return {"tuple": (z, None), "object": types.SimpleNamespace(logits=z), "dict": {"logits": z}}[self.kind]


@pytest.mark.parametrize("kind", ["tuple", "object", "dict"])
def test_logits_are_read_from_what_the_model_returns(kind):
    opts = DiagnoseOptions(batch_size=2, seq_len=8, batches=2, inputs=lambda ids: {"input_ids": ids})
    r = diagnose(Wrapped(kind), options=opts)
    assert r.status == "healthy" and LOSS in r.judged and math.isclose(r.header.loss_uniform, math.log(256))


def test_a_custom_loss_is_measured_but_not_judged_against_ln_v_and_an_unreadable_output_says_what_to_pass():
    seen = []

    def loss_fn(logits, targets):
        seen.append(tuple(logits.shape))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
    r = diagnose(GeluLM(L=2), options=DiagnoseOptions(batch_size=2, seq_len=8, batches=2, loss_fn=loss_fn))
    assert seen == [(2, 8, 256)] * 2 and LOSS not in r.judged and "loss_fn" in dict(r.not_judged)[LOSS]
    assert r.header.loss_uniform is None  # a custom loss is not compared with ln V, in the report either

    class Hidden(nn.Module):  # returns hidden states (B, T, d) and no loss: nothing to differentiate
        def __init__(self):
            super().__init__()
            self.inner = GeluLM(L=2)

        def forward(self, ids):
            return [self.inner.emb(ids)[..., :3]]
    with pytest.raises(OptionsError, match=r"^model output list.*pass DiagnoseOptions\(inputs=.*loss_fn=") as e:
        diagnose(Hidden(), options=OPTS)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- not judged


class LossOnly(nn.Module):
    """No block stack, and a 0-d loss instead of logits (``logits=True``: next-token logits)."""

    def __init__(self, logits: bool = False):
        super().__init__()
        self.emb, self.out, self.logits = nn.Embedding(32, 16), nn.Linear(16, 32), logits

    def forward(self, ids):
        z = self.out(self.emb(ids))
        return z if self.logits else z.square().mean()


def test_a_model_with_no_blocks_and_no_logits_is_not_judged_never_healthy():
    r = diagnose(LossOnly(), options=OPTS)
    assert r.status == "not judged" and not r.healthy and r.findings == []
    why = dict(r.not_judged)
    assert "no block stack" in why[STREAM_FORWARD] and "no next-token logits" in why[LOSS]
    assert "non-finite values" in r.judged
    back = DiagnoseResult.from_dict(r.to_dict())
    assert back.status == "not judged" and back.judged == r.judged and back.not_judged == r.not_judged
    # negative control: the same model returning its logits has its loss judged, and is healthy
    judged = diagnose(LossOnly(logits=True), options=OPTS)
    assert judged.status == "healthy" and LOSS in judged.judged and STREAM_FORWARD not in judged.judged


def test_a_loss_far_above_ln_v_alone_is_too_large_logits_warned_on_random_tokens_failed_on_given_ones():
    model = GeluLM(L=2, head_gain=100.0)  # loss 32 ln V
    r = diagnose(model, options=OPTS)
    assert [(f.cause, f.severity, f.where) for f in r.findings] == [("logit_scale", "warn", "loss")]
    assert r.findings[0].value > 10 and r.status == "healthy, with warnings"
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    given = diagnose(model, tokens, options=OPTS)
    assert [(f.cause, f.severity) for f in given.findings] == [("logit_scale", "fail")]
    assert diagnose(GeluLM(L=2, head_gain=1.0), tokens, options=OPTS).findings == []  # negative control


def test_a_tinylm_model_judges_its_loss_by_the_one_fresh_decision():
    """Fresh: a loss far above ln V fails; moved off its init (trained), on random tokens: it warns (a
    trained model's loss there is ln V plus how peaked its predictions are), and a grown head is no alarm."""
    cfg = tinylm.ModelConfig(vocab_size=128, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    fresh = diagnose(model, options=OPTS)
    assert LOSS in fresh.judged and fresh.header.fresh is True
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # a fresh draw at 1.5x: one kind misscaled, named
    scaled = diagnose(model, options=OPTS)
    assert [(f.cause, f.severity) for f in scaled.findings] == [("kind_scale", "warn")]
    with torch.no_grad():
        model.lm_head.weight[:32].mul_(1.5)  # some rows moved, as training moves them: trained
    r = diagnose(model, options=OPTS)
    assert r.header.fresh is False and LOSS in r.judged and r.status == "healthy"
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)  # logits far too wide: judged at warn, as trained on random tokens
    far = diagnose(model, options=OPTS)
    assert [(f.cause, f.severity) for f in far.findings] == [("logit_scale", "warn")]


def test_documents_before_version_5_keep_their_status_from_their_findings():
    r = diagnose(LossOnly(), options=OPTS)
    old = dict(r.to_dict(), schema_version="4")
    back = DiagnoseResult.from_dict(old)
    assert back.judged is None and back.status == "healthy" and back.healthy


# ----------------------------------------------------------------------------- attention through SDPA


def test_sampled_attention_equals_the_explicit_attention_of_its_rows():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)  # grouped keys
    scores, panel = sampled_attention(q, k, is_causal=True)
    kk = k.repeat_interleave(2, dim=-3)
    s = q @ kk.transpose(-1, -2) / math.sqrt(8)
    mask = reference.causal_mask(12)
    assert torch.allclose(panel, reference.panel(torch.softmax(s.masked_fill(~mask, -math.inf), -1)).to(panel))
    assert torch.allclose(scores.sort().values, s[mask.expand_as(s)].sort().values, atol=1e-5)
    # T above ROWS: the sampled rows, against an explicit boolean mask, give those rows' statistics
    T = 3 * ROWS
    q, k = torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    mask = reference.causal_mask(T)
    _, panel = sampled_attention(q, k, attn_mask=mask, scale=0.5)
    rows = torch.linspace(0, T - 1, ROWS).round().long()
    p = torch.softmax((0.5 * q @ k.transpose(-1, -2)).masked_fill(~mask, -math.inf), -1)[..., rows, :]
    h = torch.special.entr(p.double()).sum(-1)
    assert panel[0] == h.numel() and torch.isclose(panel[1], h.mean())
    assert panel[5] == (p.amax(-1)[..., 1:] > 0.99).sum() and panel[4] == h[..., 1:].numel()


def test_the_watch_passes_every_call_on_unchanged():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    calls = []
    with SDPAWatch(lambda name, s, p: calls.append(name), lambda: "attn"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == ["attn"] and torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_probe_of_an_hf_model_leaves_no_hook_and_no_mode_behind_even_when_the_step_raises():
    from diagnostics import probe

    model = gpt2(2)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    depth = torch._C._len_torch_function_stack()
    inside = []  # the modes on while an attention module runs
    seen = model.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda m, a, o: inside.append(torch._C._len_torch_function_stack()))
    proj = model.transformer.h[1].attn.c_proj

    def boom(*args):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with probe(model) as run:
            model(torch.randint(0, V, (1, 8)))
            # one mode sees SDPA calls and eager softmax, only while an attention module runs
            assert inside == [depth + 1] and torch._C._len_torch_function_stack() == depth
            proj.forward = boom
            model(torch.randint(0, V, (1, 8)))  # raises inside an attention module: its mode is left all the same
    seen.remove()
    del proj.forward
    assert sorted(run.stats.attention) == ["transformer.h.0.attn.probs", "transformer.h.1.attn.probs"]
    assert torch._C._len_torch_function_stack() == depth
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


# ----------------------------------------------------------------------------- the report and the command line


def test_the_report_says_not_judged_and_lists_what_was_and_was_not_checked():
    from reports.render import verdict_panel

    out = io.StringIO()
    Console(width=100, file=out, color_system=None).print(verdict_panel(diagnose(LossOnly(), options=OPTS)))
    text = out.getvalue()
    assert "NOT JUDGED" in text and "no block stack" in text and "not checked" in text
    assert "HEALTHY" not in text.replace("NOT JUDGED", "")
    out = io.StringIO()
    Console(width=100, file=out, color_system=None).print(verdict_panel(diagnose(GeluLM(L=2), options=OPTS)))
    text = out.getvalue()
    assert "HEALTHY" in text and "checked:" in text and "residual stream gains" in text


def test_check_exits_with_its_own_code_when_nothing_was_judged(tmp_path, capsys, monkeypatch):
    import diagnostics
    from reports.cmd_diagnose import EXIT_NOT_JUDGED
    from reports.cli import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, main

    not_judged = diagnose(LossOnly(), options=OPTS)
    monkeypatch.setattr(diagnostics, "diagnose", lambda *a, **k: not_judged)
    path = tmp_path / "model.pt"
    cfg = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
    checkpoint.save(path, tinylm.TransformerLM(cfg))
    argv = ["diagnose", str(path), "--batch-size", "1", "--batches", "2", "--no-progress", "--width", "100"]
    assert main(argv) == EXIT_OK  # without --check a report is a report
    assert main([*argv, "--check"]) == EXIT_NOT_JUDGED
    assert EXIT_NOT_JUDGED not in (EXIT_OK, EXIT_FINDINGS, EXIT_USAGE)
    assert "NOT JUDGED" in capsys.readouterr().out
