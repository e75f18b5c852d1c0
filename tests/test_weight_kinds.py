"""Fresh, misscaled or trained per weight kind; local predictions that read a trained weight are outside validity.

A fresh model with one kind of its blocks scaled by c is named (kind, factor, blocks) whatever the
family (tinylm, a Hugging Face Llama built from a config, the same Llama read through
tinylm.hf); untouched and trained models get no such finding. The shape tests that tell a
rescaled draw from trained weights hold their false-alarm rate on true draws of each family and
reject each kind of departure they are built for.
"""

import math

import pytest
import torch

import tinylm
import tinylm.hf
from diagnostics import DiagnoseOptions, diagnose
from diagnostics.measure.weight_shape import NULL_RATE, consistent, kurtosis, shape
from tinylm.init import Dist

OPTS = DiagnoseOptions(batch_size=2, seq_len=16, batches=2, theory="none")


def _tiny(L=4, seed=0):
    cfg = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=64, num_layers=L, num_heads=2,
                             d_ff=tinylm.default_d_ff(64))
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(seed))


def _scale(model, suffix, c):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(f".{suffix}.weight"):
                p.mul_(c)
    return model


def _llama(L=4):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _named(result, kind):
    """The kind_scale finding naming ``kind`` and the header's entry of ``kind``."""
    f = [f for f in result.findings if f.cause == "kind_scale" and kind in f.message]
    k = next(k for k in result.header.kinds if k["kind"] == kind)
    return f, k


@pytest.mark.parametrize("suffix,c", [("ffn.w2", 2.0), ("attn.q_proj", 0.5), ("ffn.w1", 1 / 8)])
def test_one_tinylm_kind_scaled_is_named_with_its_factor_and_blocks(suffix, c):
    r = diagnose(_scale(_tiny(), suffix, c), options=OPTS)
    found, k = _named(r, suffix)
    assert len(found) == 1 and r.status != "healthy"
    assert k["state"] == "misscaled" and k["blocks"] == [0, 1, 2, 3] and abs(k["factor"] / c - 1) < 0.05
    assert found[0].severity == ("warn" if 1 / 4 <= c <= 4 else "fail")
    assert "blocks 0-3" in found[0].message and "forward" in found[0].message and "backward" in found[0].message
    assert all(x["state"] == "fresh" for x in r.header.kinds if x["kind"] != suffix and x["factor"] is not None)
    if c == 2.0:  # the header says it (JSON and the report's init line)
        import io
        import json

        from rich.console import Console

        from diagnostics.result import DiagnoseResult
        from reports.render import ReportContext, header_table

        assert DiagnoseResult.from_dict(json.loads(r.to_json())).header.kinds == r.header.kinds
        console = Console(width=200, file=io.StringIO(), color_system=None)
        console.print(header_table(r, ReportContext()))
        line = next(x for x in console.file.getvalue().splitlines() if x.startswith("init"))
        assert f"misscaled {suffix} x2.00 blocks 0-3" in line and "fresh (at its declared init): every other" in line


def test_an_untouched_model_has_every_kind_fresh_and_no_finding():
    r = diagnose(_tiny(), options=OPTS)
    assert r.healthy and r.header.fresh is True
    assert {k["state"] for k in r.header.kinds} == {"fresh"}


@pytest.mark.parametrize("suffix,c", [("mlp.down_proj", 6.0)])
def test_a_hugging_face_llama_kind_scaled_is_named(suffix, c):
    r = diagnose(_scale(_llama(), suffix, c), options=OPTS)
    found, k = _named(r, suffix)
    assert len(found) == 1 and k["state"] == "misscaled" and k["blocks"] == [0, 1, 2, 3]
    assert abs(k["factor"] / c - 1) < 0.05
    untouched = diagnose(_llama(), options=OPTS)  # negative control
    assert untouched.healthy and {k["state"] for k in untouched.header.kinds} == {"fresh"}


def test_a_llama_read_through_tinylm_hf_is_judged_per_kind(tmp_path):
    _llama().save_pretrained(tmp_path)
    model, _ = tinylm.hf.load(tmp_path)
    r = diagnose(_scale(model, "ffn.w2", 4.0), options=OPTS)
    found, k = _named(r, "ffn.w2")
    assert len(found) == 1 and k["state"] == "misscaled" and abs(k["factor"] / 4 - 1) < 0.05


@pytest.fixture(scope="module")
def trained():
    from tinylm.data import stdlib_corpus
    from tinylm.train import TrainOptions, train

    m = _tiny(L=2)
    train(m, stdlib_corpus(100_000), TrainOptions(steps=30, batch_size=4, lr=1e-2, watch_every=0))
    return m.eval()


def test_a_trained_model_has_no_misscaled_kind_and_the_header_says_which_kind_moved(trained):
    r = diagnose(trained, options=OPTS)
    assert not [f for f in r.findings if f.cause == "kind_scale"]
    states = {k["kind"]: k["state"] for k in r.header.kinds}
    assert "misscaled" not in states.values() and states["ffn.w2"] == "trained"


def test_a_rescaled_kind_beside_trained_ones_is_trained():
    """Weight decay shrinks weights training leaves untouched by one factor: a rescaled draw in a
    model whose other kinds moved is called trained, not misscaled (negative control: the same
    rescaling alone is misscaled)."""
    alone = diagnose(_scale(_tiny(L=2), "attn.v_proj", 0.5), options=OPTS)
    assert _named(alone, "attn.v_proj")[1]["state"] == "misscaled"
    m = _scale(_tiny(L=2), "attn.v_proj", 0.5)
    with torch.no_grad():
        for b in m.layers:  # one kind moved the way training moves it: some rows grown, others not
            b.ffn.w1.weight[: 16].mul_(3.0)
    r = diagnose(m, options=OPTS)
    assert _named(r, "attn.v_proj")[1]["state"] == "trained" and _named(r, "ffn.w1")[1]["state"] == "trained"
    assert not [f for f in r.findings if f.cause == "kind_scale"]


def test_six_blocks_with_w2_x6_are_not_called_healthy():
    """The residual variance grows 1 -> 5 -> 9 -> ... while nothing else is off: named, not healthy."""
    from reports.plots import verdict_words

    r = diagnose(_scale(_tiny(L=6), "ffn.w2", 6.0), options=OPTS)
    assert r.depth[2].forward_var > 5 * r.depth[0].forward_var
    assert not r.healthy and "misscaled" in verdict_words(r) and "blocks 0-5" in r.findings[0].message


# ------------------------------------------------------------------ the shape tests: their rate and their power

FAMILIES = [Dist("normal", std=0.02), Dist("trunc_normal", std=0.1, low=-0.3, high=0.3),
            Dist("uniform", low=-0.125, high=0.125)]


@pytest.mark.parametrize("dist", FAMILIES, ids=lambda d: d.family)
def test_true_draws_at_any_scale_pass_every_shape_test(dist):
    """12 draws (x3 families) of 64 x 172 at c in {1/8, 2, 7}: with each test at rate 1e-6 / 5 the chance
    any of these 36 draws fails is under 4e-5."""
    g = torch.Generator().manual_seed(3)
    for i in range(12):
        w = dist.sample_(torch.empty(64, 172), generator=g) * (1 / 8, 2.0, 7.0)[i % 3]
        s = shape(w, dist, float(torch.linalg.matrix_norm(w.double(), 2)))
        assert s.draw, s.why
    assert NULL_RATE == 1e-6


@pytest.mark.parametrize("dist", FAMILIES, ids=lambda d: d.family)
def test_each_departure_from_a_draw_is_rejected(dist):
    g = torch.Generator().manual_seed(4)
    w = dist.sample_(torch.empty(64, 172), generator=g) * 3.0

    def why(x):
        return shape(x, dist, float(torch.linalg.matrix_norm(x.double(), 2))).why

    assert why(w + 0.3 * w.std()).startswith("mean")  # an offset
    rows = w.clone()
    rows[:16] *= 1.5  # some units grown
    s = shape(rows, dist, float(torch.linalg.matrix_norm(rows.double(), 2)))
    assert not s.draw and s.rows > s.rows_limit  # Bartlett over the rows rejects it (uniform: KS too)
    heavy = torch.distributions.StudentT(3.0).sample((64, 172)) * w.std()  # heavy tails
    assert "do not follow" in why(heavy)
    u, v = torch.randn(64, 1, generator=g), torch.randn(1, 172, generator=g)
    spike = w + w.std() * u @ v / 3  # one learned direction, 35 entry stds: past the BBP edge (mn)^(1/4) = 10
    s = shape(spike, dist, float(torch.linalg.matrix_norm(spike.double(), 2)))
    assert not s.draw and s.spectral > s.spectral_limit


def test_block_stds_that_disagree_are_rejected():
    k = kurtosis(FAMILIES[0])
    assert abs(k - 3) < 1e-9
    q, limit = consistent([1.0, 1.01, 0.99, 1.0], [11008] * 4, k)  # a fresh draw's spread (sd 0.7%)
    assert q < limit
    q, limit = consistent([1.0, 1.1, 0.9, 1.0], [11008] * 4, k)  # blocks trained apart
    assert q > limit and math.isfinite(limit)


# ------------------------------------------------------------------ local theory's premise on trained weights

LINEAR = ("linear", "swiglu", "scores", "ffn branch", "attention branch")


def test_local_predictions_that_read_a_trained_weight_are_outside_validity(trained):
    """A local rule passes variance through a weight as if it were independent of its input: on a trained
    kind the ratio measures the alignment training made, so it is shown outside validity, with why."""
    r = diagnose(trained, options=DiagnoseOptions(batch_size=2, seq_len=16, batches=2, theory="local"))
    states = {k["kind"]: k["state"] for k in r.header.kinds}
    assert states["ffn.w2"] == "trained"
    rows = {(t.name, t.direction): t for t in r.tensors}
    for name in ("layers.0.ffn.w2", "layers.0.ffn", "layers.1.ffn.hidden"):
        t = rows[(name, "forward")]
        assert not t.valid and "trained" in t.validity, (name, t.validity)
    assert not rows[("layers.0.ln2", "backward")].valid  # read by w1 and w3
    # the table shows no ratio for them: "-*", never a number beside "ok"
    import io

    from rich.console import Console

    from reports.render import LayerTable

    console = Console(width=140, file=io.StringIO(), color_system=None)
    console.print(LayerTable(r, all_tensors=True))
    line = next(x for x in console.file.getvalue().splitlines() if x.split() and x.split()[0] == "layers.0.ffn.w2")
    assert "-*" in line and f"{rows[('layers.0.ffn.w2', 'forward')].ratio:.2f}" not in line
    # every row a trained kind's rule reads is out; a ratio beside a valid mark reads fresh weights only
    for t in r.tensors:
        if t.valid and t.ratio is not None and t.rule.startswith(LINEAR) and t.block is not None \
                and t.direction == "forward":
            own = t.name.split(".", 2)[-1]
            assert states.get(own, "fresh") != "trained", t.name


def test_a_fresh_model_keeps_valid_local_ratios():
    """Negative control: at init every linear rule's premise holds: valid, ratio near 1."""
    r = diagnose(_tiny(L=2), options=DiagnoseOptions(batch_size=2, seq_len=16, batches=2, theory="local"))
    linear = [t for t in r.tensors if t.rule.startswith("linear: ") and t.block is not None]
    assert len(linear) >= 10 and all(t.valid for t in linear)
    assert all(0.5 < t.ratio < 2 for t in linear)


@pytest.mark.slow
def test_a_model_trained_hard_has_no_misscaled_kind_and_no_valid_ratio_far_from_one():
    """200 steps at lr 5e-2: every kind moves (the block kinds 1.2x to 2.5x, the head 7x) and none is
    called misscaled; every local ratio beyond [1/3, 3] is outside validity."""
    from tinylm.data import stdlib_corpus
    from tinylm.train import TrainOptions, train

    cfg = tinylm.ModelConfig(vocab_size=256, context_length=32, d_model=32, num_layers=2, num_heads=1,
                             d_ff=tinylm.default_d_ff(32))
    m = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    train(m, stdlib_corpus(400_000), TrainOptions(steps=200, batch_size=8, lr=5e-2, watch_every=0))
    r = diagnose(m.eval(), options=DiagnoseOptions(batch_size=2, seq_len=32, batches=2, theory="local"))
    assert "misscaled" not in {k["state"] for k in r.header.kinds}
    assert not [f for f in r.findings if f.cause == "kind_scale"]
    far = [t.name for t in r.tensors if t.valid and t.ratio is not None and not 1 / 3 < t.ratio < 3
           and t.rule.startswith(LINEAR) and t.direction == "forward"]
    assert not far, far
