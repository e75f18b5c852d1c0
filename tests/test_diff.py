"""``diagnostics.diff``: where two executions of one model part ways, and the evidence it is right.

Every model here is small (d 64, 2-4 layers, vocab 128, 2 x 32 tokens). Equivalent executions
(fused against explicit attention, 1 against 2 threads, float64 against float32, bfloat16 pairs)
must find no departure; the negative controls (a relative 1e-3 move of one matrix of block 1 in
float32, 1e-1 in bfloat16) must be found at block 1, in the forward pass.
"""

from __future__ import annotations

import copy
import io
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import tinylm
from tinylm import checkpoint
from diagnostics import DiffOptions, DiffResult, Fingerprint, OptionsError, diff, diff_against, fingerprint
from diagnostics.jobs.diff import compare_fingerprints
from diagnostics.jobs.fingerprint import FingerprintError, diff_sites, sketch
from diagnostics.judge.departure import Tolerance, relative_departure, sketch_error, unit_roundoff

CONFIG = tinylm.ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=3, num_heads=4, d_ff=128)
OPT = DiffOptions(batch_size=2, seq_len=32)


def model(seed: int = 0, **changes) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(CONFIG.replace(**changes), generator=torch.Generator().manual_seed(seed)).eval()


def perturb(m: nn.Module, name: str, relative: float, seed: int = 0) -> nn.Module:
    """A copy whose parameter ``name`` moved by ``relative`` of its Frobenius norm, in a random direction."""
    twin = copy.deepcopy(m)
    w = dict(twin.named_parameters())[name]
    e = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        w.add_((relative * w.double().norm() * e / e.norm()).to(w.dtype))
    return twin


def explicit(m: tinylm.TransformerLM) -> tinylm.TransformerLM:
    twin = copy.deepcopy(m)
    for a in twin.modules():
        if isinstance(a, tinylm.MultiHeadSelfAttention):
            a.explicit = True
    return twin


# ----------------------------------------------------------------------------- equivalent pairs: no departure


def test_fused_and_explicit_attention_are_the_same_within_roundoff():
    m = model()
    result = diff(m, explicit(m), options=OPT)
    assert result.first is None and result.same, result
    assert len(result.rows) == 2 * (2 + 3 * 3 + 1)  # embedding, 3 x (attn, ffn, block), final norm, logits
    assert max(r.departure for r in result.rows) > 0  # the two paths do round differently
    assert str(result).startswith("same within roundoff: 12 sites x 2 directions")


@pytest.mark.parametrize("variant", ["cpu-threads", "float64", "explicit-attention"])
def test_variants_of_one_model_are_the_same(variant):
    assert diff_against(model(), variant, options=OPT).first is None


def test_bfloat16_pairs_are_the_same_and_bfloat16_against_float32_too():
    m = model()
    bf = DiffOptions(batch_size=2, seq_len=32, reference_dtype="bfloat16", candidate_dtype="bfloat16")
    assert diff(m, explicit(m), options=bf).first is None
    assert diff_against(m, "bf16", options=OPT).first is None
    assert m.lm_head.weight.dtype == torch.float32  # a cast copy was measured, never the model


def test_gpt2_family_fused_and_explicit_are_the_same():
    m = tinylm.TransformerLM(tinylm.preset("gpt2-tiny", vocab_size=128, context_length=32, num_layers=2),
                             generator=torch.Generator().manual_seed(0))
    result = diff(m, explicit(m), options=OPT)
    assert result.first is None, result
    assert not result.unpaired


# ----------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize("name", ["attn.q_proj.weight", "attn.output_proj.weight", "ffn.w1.weight", "ffn.w2.weight"])
def test_a_1e_3_move_of_one_matrix_is_found_at_its_block_in_float32(name):
    m = model()
    first = diff(m, perturb(m, f"layers.1.{name}", 1e-3), options=OPT).first
    assert first is not None and first.block == 1 and first.direction == "forward", first
    assert first.site == ("layers.1.attn" if name.startswith("attn") else "layers.1.ffn")


@pytest.mark.parametrize("name", ["attn.v_proj.weight", "attn.output_proj.weight", "ffn.w1.weight", "ffn.w2.weight"])
def test_a_1e_1_move_of_one_matrix_is_found_at_its_block_in_bfloat16(name):
    m = model()
    bf = DiffOptions(batch_size=2, seq_len=32, reference_dtype="bfloat16", candidate_dtype="bfloat16")
    first = diff(m, perturb(m, f"layers.1.{name}", 1e-1), options=bf).first
    assert first is not None and first.block == 1 and first.direction == "forward", first


def test_a_wrong_backward_is_found_in_the_backward_pass_only():
    """A custom FFN whose backward scales its gradient by 1.01: the forward is identical."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 1.01 * g

    m = model()
    twin = copy.deepcopy(m)
    ffn = twin.layers[1].ffn
    forward = ffn.forward
    ffn.forward = lambda x: forward(Scale.apply(x))
    result = diff(m, twin, options=OPT)
    first = result.first
    assert first is not None and first.direction == "backward" and first.block == 1, first
    assert all(r.ratio <= 1 for r in result.rows if r.direction == "forward")


def test_a_non_finite_weight_is_an_infinite_departure_at_its_block():
    m = model()
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.layers[2].ffn.w2.weight[0, 0] = math.nan
    first = diff(m, twin, options=DiffOptions(batch_size=2, seq_len=32, backward=False)).first
    assert first.site == "layers.2.ffn" and first.departure == math.inf


# ----------------------------------------------------------------------------- pairing by structure


class UserBlock(nn.Module):
    """tinylm's block computed by a user's module with other names."""

    def __init__(self, block: tinylm.TransformerBlock):
        super().__init__()
        self.norm_a, self.attention, self.norm_b, self.mlp = block.ln1, block.attn, block.ln2, block.ffn

    def forward(self, x):
        h = x + self.attention(self.norm_a(x))
        return h + self.mlp(self.norm_b(h))


class UserLM(nn.Module):
    def __init__(self, m: tinylm.TransformerLM):
        super().__init__()
        m = copy.deepcopy(m)
        self.embed = m.token_embeddings
        self.blocks = nn.ModuleList(UserBlock(b) for b in m.layers)
        self.norm, self.head = m.ln_final, m.lm_head

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_a_users_module_pairs_with_tinylm_by_structure():
    m = model()
    user = UserLM(m)
    assert [s.key for s in diff_sites(user)] == [s.key for s in diff_sites(m)]
    assert {s.key: s.module for s in diff_sites(user)}["layers.1.attn"] == "blocks.1.attention"
    result = diff(m, user, options=OPT)
    assert result.first is None and not result.unpaired, result
    first = diff(m, UserLM(perturb(m, "layers.2.ffn.w1.weight", 1e-3)), options=OPT).first
    assert first.site == "layers.2.ffn" and first.candidate_module == "blocks.2.mlp"


def test_what_cannot_be_paired_is_listed():
    result = diff(model(num_layers=3), model(num_layers=2), options=OPT)
    missing = {site for site, _ in result.unpaired}
    assert {"layers.2 (forward)", "layers.2.attn (backward)"} <= missing
    assert "not paired" in str(result)


# ----------------------------------------------------------------------------- the model is left alone


def test_the_model_is_left_exactly_as_it_was():
    m = model().train()
    m.layers[0].attn.q_proj.weight.requires_grad_(False)
    m.lm_head.weight.grad = torch.ones_like(m.lm_head.weight)
    grad = m.lm_head.weight.grad
    state = {k: v.clone() for k, v in m.state_dict().items()}
    fingerprint(m, options=OPT)
    assert m.training and all(x.training for x in m.modules())
    assert not m.layers[0].attn.q_proj.weight.requires_grad
    assert m.lm_head.weight.grad is grad and bool((grad == 1).all())
    assert all(p.grad is None for n, p in m.named_parameters() if n != "lm_head.weight")
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())


def test_hooks_are_removed_when_the_forward_raises():
    m = model()

    def boom(module, args):
        raise RuntimeError("boom")
    h = m.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        fingerprint(m, options=OPT)
    h.remove()
    assert all(not x._forward_hooks and not x._forward_pre_hooks for x in m.modules())
    assert all(p.grad is None for p in m.parameters())


# ----------------------------------------------------------------------------- sketches and fingerprints


def test_the_sketch_estimates_the_relative_distance():
    g = torch.Generator().manual_seed(3)
    b = torch.randn(4, 32, 64, generator=g)
    diffuse = b + 1e-3 * torch.randn(4, 32, 64, generator=g)
    u, v = torch.randn(4 * 32, 1, generator=g), torch.randn(1, 64, generator=g)
    rank_one = b + 1e-3 * (u @ v).reshape(4, 32, 64) / float((u @ v).norm()) * float(b.norm())
    diffuse_err, rank_one_err = sketch_error(32)
    for a, err in ((diffuse, diffuse_err), (rank_one, rank_one_err)):
        exact = float((a.double() - b.double()).norm() / b.double().norm())
        est = relative_departure(sketch(a, 32)[1].numpy(), sketch(b, 32)[1].numpy())
        assert abs(est / exact - 1) < 6 * err, (est, exact, err)  # 6 standard errors: a false alarm ~1e-9


def test_moments_of_the_sketch():
    x = torch.tensor([[1.0, -2.0], [math.inf, 4.0]])
    moments, s = sketch(x, 8)
    count, mean, mean_square, max_abs, nonfinite = moments.tolist()
    assert (count, nonfinite, max_abs) == (3, 1, 4.0)
    assert mean == pytest.approx(1.0) and mean_square == pytest.approx(7.0)
    assert s.shape == (8, 8) and s.dtype == torch.float64


def test_a_fingerprint_round_trips_and_diffs_like_the_models(tmp_path):
    m = model()
    twin = perturb(m, "layers.1.ffn.w2.weight", 1e-3)
    fa = fingerprint(m, options=OPT)
    path = fa.save(tmp_path / "a.npz")
    back = Fingerprint.load(path)
    assert back.meta == json.loads(json.dumps(fa.meta)) and np.array_equal(back.tokens, fa.tokens)
    assert all(np.array_equal(x.sketch, y.sketch) and x.fields() == y.fields() for x, y in zip(fa.records, back.records))
    in_process = diff(m, twin, options=OPT)
    across = diff(back, twin, options=DiffOptions(k=OPT.k))  # the fingerprint fixes the tokens
    assert [r.ratio for r in across.rows] == pytest.approx([r.ratio for r in in_process.rows], rel=1e-12)
    assert across.first.site == in_process.first.site == "layers.1.ffn"
    assert diff(back, m).first is None


def test_fingerprints_of_other_tokens_are_refused():
    a = fingerprint(model(), options=OPT)
    b = fingerprint(model(), options=DiffOptions(batch_size=2, seq_len=32, seed=1))
    with pytest.raises(FingerprintError, match="tokens_sha256="):
        compare_fingerprints(a, b)


def test_a_file_that_is_not_a_fingerprint_is_one_error(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, a=np.zeros(3))
    with pytest.raises(FingerprintError, match="must be a fingerprint file"):
        Fingerprint.load(bad)
    (tmp_path / "y.npz").write_bytes(b"not a zip")
    with pytest.raises(FingerprintError):
        Fingerprint.load(tmp_path / "y.npz")


def test_fingerprint_size_follows_the_formula(tmp_path):
    """(2 k^2 floats per site and direction, plus the tokens and a JSON header): for k = 32 and the
    tinystories preset's 15 sites that is 30 x 8 KiB = 240 KiB, under 1 MiB (measured in the slow test)."""
    fp = fingerprint(model(), options=OPT)
    size = fp.save(tmp_path / "f.npz").stat().st_size
    floats = len(fp.records) * OPT.k ** 2 * 8
    assert floats < size < floats + 16_384


@pytest.mark.slow
def test_tinystories_fingerprint_is_under_one_mebibyte(tmp_path):
    m = tinylm.TransformerLM(tinylm.preset("tinystories"), generator=torch.Generator().manual_seed(0))
    size = fingerprint(m, options=DiffOptions(batch_size=4, seq_len=256)).save(tmp_path / "t.npz").stat().st_size
    assert size < 2 ** 20, size


# ----------------------------------------------------------------------------- judge, result, options


def test_tolerance_formula():
    t = Tolerance(forward=2.0, backward=3.0, growth=0.5)
    u32, ubf = 2.0 ** -24, 2.0 ** -8
    assert t(("float32", "float32"), 64, 0, "forward") == pytest.approx(2 * (u32 + u32 * 8))
    assert t(("float32", "bfloat16"), 64, 2, "backward") == pytest.approx(3 * (ubf + u32 * 8) * 2)
    assert t(("float64", "float64"), 64, 0, "forward") == pytest.approx(2 * 2.0 ** -53 * 9)
    assert unit_roundoff("torch.float16") == 2.0 ** -11


def test_result_exports_and_says_the_answer_first():
    m = model()
    result = diff(m, perturb(m, "layers.0.attn.v_proj.weight", 1e-3), options=OPT)
    assert isinstance(result, DiffResult)
    assert str(result).startswith("departs at layers.0.attn (forward): ")
    assert repr(result).startswith("DiffResult(departs at layers.0.attn")
    frame = result.to_frame()
    assert {"site", "direction", "block", "departure", "tolerance", "ratio"} <= set(frame.columns)
    assert len(frame) == len(result.rows)
    doc = json.loads(result.to_json())
    assert doc["first"]["site"] == "layers.0.attn" and len(doc["rows"]) == len(result.rows)


@pytest.mark.parametrize("kw, phrase", [({"k": 1}, "k=1: must"), ({"batch_size": 0}, "batch_size=0: must"),
                                        ({"reference_dtype": "int8"}, "reference_dtype='int8': must")])
def test_bad_options_name_the_argument(kw, phrase):
    with pytest.raises(OptionsError, match=phrase):
        DiffOptions(**kw)


def test_a_side_that_is_neither_model_nor_fingerprint_is_refused():
    with pytest.raises(OptionsError, match="candidate=str: must be"):
        diff(model(), "model.pt")


@pytest.mark.slow
def test_compiled_blocks_are_the_same_as_eager():
    m = model(num_layers=2)
    assert diff_against(m, "compiled", options=OPT).first is None


# ----------------------------------------------------------------------------- the command


def _cli(*argv):
    import contextlib

    from reports.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["diff", "--width", "100", *argv])
    return code, out.getvalue(), err.getvalue()


def test_command_checks_reports_and_exports(tmp_path):
    m = model()
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    checkpoint.save(a, m)
    checkpoint.save(b, perturb(m, "layers.1.ffn.w1.weight", 1e-3))
    code, out, _ = _cli(str(a), str(b), "--check", "--batch-size", "2", "--json", str(tmp_path / "r.json"),
                        "--csv", str(tmp_path / "r.csv"))
    assert code == 1 and "departs at layers.1.ffn (forward)" in out.splitlines()[1]
    assert "┃" in out and "✗" in out
    assert json.loads((tmp_path / "r.json").read_text())["first"]["block"] == 1
    assert (tmp_path / "r.csv").read_text().startswith("site,direction,block")
    code, out, _ = _cli(str(a), "--against", "cpu-threads", "--check", "--batch-size", "2")
    assert code == 0 and "same within roundoff" in out
    code, _, err = _cli(str(a), "--save", str(tmp_path / "a.npz"), "--batch-size", "2")
    assert code == 0 and "wrote fingerprint" in err
    code, out, _ = _cli(str(tmp_path / "a.npz"), str(a), "--check")
    assert code == 0 and "same within roundoff" in out


@pytest.mark.parametrize("argv, phrase", [
    (["missing.pt", "--against", "bf16"], "no such file"),
    (["{a}"], "no candidate"),
    (["{a}", "--against", "bf17"], "did you mean 'bf16'"),
    (["{a}", "{a}", "--against", "bf16"], "give one of them"),
    (["{a}", "--save", "{tmp}/f.json"], "exists and is not a fingerprint"),
    (["{tmp}/bad.npz", "{a}"], "a text file, not a checkpoint"),  # neither kind, by content
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, phrase):
    a = tmp_path / "a.pt"
    checkpoint.save(a, model())
    (tmp_path / "bad.npz").write_bytes(b"nope")
    (tmp_path / "f.json").write_text("{}")
    code, _, err = _cli(*[x.format(a=a, tmp=tmp_path) for x in argv])
    assert code == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
