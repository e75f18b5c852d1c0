"""``diagnose`` on trained models: the precursors of a training failure that one measurement shows
(attention logits and entropy, the output logits' log Z and largest logit, massive activations),
each a warning with its number, threshold, cause and fix; and a shallow healthy stack trained hard
is not called exploding.

The reproductions train small models (d_model 64, 2 blocks) on the bytes of Python's own standard
library with AdamW, one thread: a high learning rate whose attention logits grow, checkpointed
while its loss still falls, and its lower-learning-rate control.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import diagnostics
import tinylm
from diagnostics import DiagnoseOptions, Thresholds, diagnose
from diagnostics.judge import coverage, judge
from diagnostics.jobs.diagnose_peaks import block_peaks, peak_ratio
from diagnostics.result import AttentionRow, DepthRow, TensorRow
from tinylm.data import get_batch, stdlib_corpus

from test_nanogpt import GPT, GPTConfig

PRECURSORS = {"attn_logits", "attn_entropy", "output_logits", "massive_activations"}


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(400_000)


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def train(model, data, lr, steps, seed=0, warmup=0, clip=0.0, weight_decay=0.0):
    """AdamW (0.9, 0.95) at a constant ``lr`` (after a linear warm-up), batches of 16 x 64 bytes.
    Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    gen, losses = torch.Generator().manual_seed(seed), []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (t + 1) / warmup) if warmup else lr
        x, y = get_batch(data, 16, 64, gen)
        out = model(x, targets=y) if isinstance(model, GPT) else model(x)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def tiny(seed=0, layers=2):
    cfg = tinylm.ModelConfig(vocab_size=256, context_length=64, d_model=64, num_layers=layers, num_heads=4,
                             d_ff=192)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(seed))


def gpt(seed=0, layers=2):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=layers, n_head=4, n_embd=64, bias=True))


def look(model, data):
    return diagnose(model.eval(), data[:50_000], DiagnoseOptions(batch_size=4, batches=1, seq_len=64, theory="none"))


def _rendered(result):
    import io

    from rich.console import Console

    from reports.render import report

    console = Console(width=100, file=io.StringIO(), color_system=None)
    console.print(report(result))
    return " ".join(console.file.getvalue().split())


def causes(result):
    return {f.cause for f in result.findings}


# ---------------------------------------------------------------- reproductions


def test_high_lr_attention_logits_are_named_and_the_control_is_not(corpus):
    """lr 3e-2 without warm-up: the attention logits pass 200 within 150 steps while the loss still
    falls (they keep growing, to ~2000 by step 300, and the loss stalls ~0.5 nats above the
    control's); the lr 3e-3 control's stay ~12."""
    high, low = tiny(), tiny()
    losses = train(high, corpus, 3e-2, 150)
    train(low, corpus, 3e-3, 150)
    assert min(losses[-10:]) < losses[0]  # still learning: the checkpoint precedes the failure
    r = look(high, corpus)
    f = next(f for f in r.findings if f.cause == "attn_logits")
    assert f.severity == "warn" and f.value > f.threshold == Thresholds().attn_logit == 200
    assert f.where.endswith(".attn.scores") and f.statistic.startswith("largest |attention logit|")
    assert "qk-norm" in f.suggestion and "learning rate" in f.suggestion
    assert "attention logits" in r.judged
    text = _rendered(r)
    assert "attention logits growing" in text and "qk-norm" in text
    control = look(low, corpus)
    assert not causes(control) & PRECURSORS, [f.message for f in control.findings]
    assert max(t.max_abs for t in control.tensors if t.kind == "attn_scores") < 25


def test_high_lr_nanogpt_attention_logits_through_sdpa(corpus):
    """The same on a plain nanoGPT-style module, its attention a scaled_dot_product_attention call."""
    high = gpt()
    train(high, corpus, 3e-2, 50)
    r = look(high, corpus)
    f = next(f for f in r.findings if f.cause == "attn_logits")
    assert f.where.startswith("transformer.h.") and f.value > 200 and f.severity == "warn"


def test_two_block_gpt_trained_hard_is_not_failed(corpus):
    """A plain 2-block GPT at lr 1e-2 (warm-up 30, clip 1, weight decay 0.1): its stream grows from a
    small embedding through one grown block, which is not an explosion."""
    m = gpt(seed=1)
    losses = train(m, corpus, 1e-2, 150, seed=1, warmup=30, clip=1.0, weight_decay=0.1)
    assert losses[-1] < 3.0
    r = look(m, corpus)
    assert not any(f.severity == "fail" for f in r.findings), [f.message for f in r.findings]
    assert not any(f.kind == "exploding" for f in r.findings)


def test_a_norm_class_not_named_norm_is_still_a_norm(corpus):
    """A GPT whose LayerNorm class is called ``LN`` (its forward calls F.layer_norm): its blocks are
    normalised, so the backward stream is judged on Var(g) Var(x) and the build is not "no norm"."""
    from diagnostics.jobs.diagnose import _architecture, _scale_invariant
    from diagnostics.measure.sites import model_sites
    from test_nanogpt import LayerNorm

    class LN(LayerNorm):
        pass

    m = gpt(seed=3)
    for b in m.transformer.h:
        b.ln_1.__class__ = b.ln_2.__class__ = LN
    arch = _architecture(m, model_sites(m).blocks)
    assert arch == {"norms": True} and _scale_invariant(m, arch)


# ---------------------------------------------------------------- the stream rule on shallow stacks


def _depth(fwd, bwd=None):
    bwd = bwd or [1.0] * len(fwd)
    return [DepthRow(index=k, name=f"layers.{k - 1}" if k else "token_embeddings", forward_var=f,
                     forward_predicted=None, backward_var=b, backward_predicted=None, cosine=None)
            for k, (f, b) in enumerate(zip(fwd, bwd))]


def _judge(depth=(), tensors=(), attention=(), fresh=False, logits=None, peaks=None, scale_invariant=True):
    return judge(list(tensors), [], list(attention), list(depth), [t.name for t in tensors], Thresholds(),
                 scale_invariant=scale_invariant, fresh=fresh, logits=logits, peaks=peaks)[0]


def test_two_block_stack_growing_from_a_small_embedding_is_not_exploding():
    # 0.05 -> 20 -> 1e4: 2e5x in all, a line in log space through three points; linear growth from a
    # small embedding through one grown block cannot be told from it with two gains (both of these
    # were failed as exploding when the total was judged on two gains)
    assert not [f for f in _judge(_depth([0.05, 20.0, 1e4])) if f.kind == "exploding"]
    # the raw gradient variances of a 2-block nanoGPT-style module trained at lr 2e-2: 1.4e6x from the
    # last block down to the embedding, nearly all of it in block 0
    assert not [f for f in _judge(_depth([1.0, 1.0, 1.0], [2.12e-6, 2.97e-12, 1.56e-12]), scale_invariant=False)
                if f.kind == "exploding"]


def test_deeper_geometric_growth_is_still_exploding():
    fs = _judge(_depth([1.0, 6.0, 36.0, 216.0, 1296.0]), scale_invariant=False)
    assert any(f.kind == "exploding" and f.severity == "fail" for f in fs)
    fs = _judge(_depth([1.0, 30.0, 900.0, 27000.0]))  # total 2.7e4 over 3 gains, each 30x: a run
    assert any(f.kind == "exploding" for f in fs)


# ---------------------------------------------------------------- each precursor from its rows


def _scores(block, max_abs, var=4.0):
    return TensorRow(name=f"layers.{block}.attn.scores", block=block, kind="attn_scores", direction="forward",
                     count=100, mean=0.0, var=var, mean_square=var, max_abs=max_abs, frac_zero=0.0,
                     frac_nonfinite=0.0, frac_fp16_underflow=0.0, frac_fp16_overflow=0.0,
                     frac_bf16_underflow=0.0, frac_bf16_overflow=0.0)


def _attn(block, entropy, uniform=3.2, saturated=0.0):
    return AttentionRow(name=f"layers.{block}.attn", block=block, score_std=2.0, entropy_mean=entropy,
                        entropy_min=0.0, entropy_uniform=uniform, saturated_frac=saturated)


def test_attention_logits_warn_with_number_threshold_cause_and_fix():
    fs = _judge(tensors=[_scores(0, 20.0), _scores(1, 360.0), _scores(2, 480.0)])
    [f] = fs
    assert (f.cause, f.severity, f.kind, f.where, f.value, f.threshold) == \
        ("attn_logits", "warn", "misscaled", "layers.2.attn.scores", 480.0, 200.0)
    assert "360" in f.message  # the other layer past the threshold is named as well
    assert "Dehghani" in f.suggestion and 'qk_norm="rms"' in f.suggestion
    assert _judge(tensors=[_scores(0, 480.0)], fresh=True) == []  # at init: the score-scaling check's


def test_collapsed_entropy_goes_to_grown_logits_of_its_layer_else_is_its_own():
    fs = _judge(tensors=[_scores(0, 400.0)], attention=[_attn(0, 0.05, saturated=0.95)])
    assert [f.cause for f in fs] == ["attn_logits"]  # saturated rows and collapsed entropy: its consequences
    assert "mean attention entropy" in fs[0].message and "saturated" in fs[0].message
    [f] = _judge(attention=[_attn(1, 0.05)])
    assert (f.cause, f.kind, f.severity) == ("attn_entropy", "saturated", "warn")
    assert f.value == pytest.approx(0.05 / 3.2) and f.threshold == 0.03


def test_output_logits_drift_and_size():
    scale = {"logz_mean": 42.0, "logz_std": 1.0, "logz_absmax": 45.0, "max_logit": 150.0, "rows": 256}
    [f] = _judge(logits=scale)
    assert (f.cause, f.severity, f.value, f.threshold) == ("output_logits", "warn", 42.0, 30.0)
    assert "largest |output logit| is 150" in f.message and "z-loss" in f.suggestion
    assert _judge(logits={**scale, "logz_mean": 7.0, "max_logit": 20.0}) == []


def test_massive_activations_name_the_block_and_the_float16_risk():
    [f] = _judge(_depth([1.0, 2.0, 3.0]), peaks={"layers.0": 30.0, "layers.1": 3e4})
    assert (f.cause, f.where, f.block, f.value, f.severity) == ("massive_activations", "layers.1", 1, 3e4, "warn")
    assert "float16" in f.suggestion


def test_precursors_downstream_of_an_exploded_stream_are_folded():
    depth = _depth([1.0, 10.0, 100.0, 1e3, 1e4, 1e5])
    fs = _judge(depth, tensors=[_scores(3, 500.0)], peaks={"layers.3": 1e5}, scale_invariant=False)
    assert [f.cause for f in fs] == ["unclear"] and "downstream" in fs[0].message


def test_coverage_says_what_was_not_measured():
    rows = [_scores(0, 1.0)]
    judged, not_judged = coverage(rows, [], [], [], fresh=False, logits=None, peaks={})
    why = dict(not_judged)
    assert "attention logits" in judged
    assert "no next-token logits" in why["output logits (log Z, largest logit)"]
    assert "no block output" in why["massive activations (peak / median)"]
    assert "no attention seen" in why["attention entropy"]
    _, not_judged = coverage(rows, [], [], [], fresh=True, logits={"rows": 1}, peaks={"layers.0": 2.0})
    assert all("trained weights only" in dict(not_judged)[c] for c in
               ("attention logits", "attention entropy", "output logits (log Z, largest logit)",
                "massive activations (peak / median)"))


def test_peak_ratio_and_its_hooks():
    x = torch.ones(4, 8, 16)
    x[0, 0, 3] = 5000.0
    assert peak_ratio(x) == pytest.approx(5000.0)
    assert math.isnan(peak_ratio(torch.zeros(2, 3)))
    m = tiny()
    out = {}
    with block_peaks(m, ("layers.0", "layers.1"), out):
        m(torch.randint(0, 256, (2, 16)))
    assert set(out) == {"layers.0", "layers.1"} and all(v > 1 for v in out.values())
    assert not m.layers[0]._forward_hooks  # removed on exit


def test_diagnose_reads_log_z_off_the_logits_it_already_has(corpus):
    m = tiny()
    train(m, corpus, 3e-3, 20)
    r = look(m, corpus)
    assert "output logits (log Z, largest logit)" in r.judged and "massive activations (peak / median)" in r.judged
    scale = {}
    batch = torch.from_numpy(corpus[:65 * 4].astype("int64")).reshape(4, 65)
    diagnostics.jobs.diagnose_sample.batch_loss(m, batch, DiagnoseOptions(), scale)
    with torch.no_grad():
        log_z = torch.logsumexp(m(batch[:, :-1]).float(), dim=-1)
    assert scale["rows"] == 256
    assert scale["logz_sum"] / 256 == pytest.approx(float(log_z.mean()), rel=1e-5)
    assert scale["logz_absmax"] == pytest.approx(float(log_z.abs().max()), rel=1e-5)


@pytest.mark.slow
def test_high_lr_entropy_collapses_and_logits_keep_growing(corpus):
    """300 steps: lr 3e-2's attention logits grow past 1000 and its entropy collapses below 5% of the
    maximum while its loss stalls above the control's; the control (lr 3e-3) stays below both thresholds."""
    high, low = tiny(), tiny()
    lh = train(high, corpus, 3e-2, 300)
    ll = train(low, corpus, 3e-3, 300)
    assert sum(lh[-20:]) / 20 > sum(ll[-20:]) / 20 + 0.2
    r = look(high, corpus)
    f = next(f for f in r.findings if f.cause == "attn_logits")
    assert f.value > 500 and "entropy" in f.message
    control = look(low, corpus)
    assert not causes(control) & PRECURSORS, [f.message for f in control.findings]


def test_the_report_words_every_cause():
    from diagnostics.judge.causes import CAUSES
    from reports import render

    assert render._CAUSE_WORDS == CAUSES
