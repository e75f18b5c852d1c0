"""compare(): tidy and summary frames over schemes, depths, widths and seeds."""

import math

import numpy as np
import pytest
import torch

import tinylm
from diagnostics import CompareOptions, OptionsError, compare
from tinylm.data import DataError
from diagnostics.jobs.compare import SUMMARY_COLUMNS, stream_slope
from diagnostics.result import COLUMNS, DTYPES


@pytest.fixture(scope="module")
def frames():
    calls = []
    tidy, summary = compare(CompareOptions(schemes=["cs336", "zero-residual"], depths=(2, 4), widths=(32,), seeds=2,
                                           seq_len=8, progress=lambda d, t, s: calls.append((d, t, s))))
    return tidy, summary, calls


def test_tidy_has_one_row_per_tensor_direction_statistic(frames):
    tidy, _, _ = frames
    assert list(tidy.columns) == list(COLUMNS) and tidy.dtypes.astype(str).to_dict() == DTYPES  # the one schema
    # per model: stream points (L+1) + logits, forward and backward, 4 statistics
    expected = sum(2 * 2 * (L + 2) * 2 * 4 for L in (2, 4))
    assert len(tidy) == expected
    assert not tidy.duplicated(["scheme", "depth", "width", "seed", "name", "direction", "statistic"]).any()
    assert set(tidy.statistic) == {"var", "mean", "max_abs", "frac_zero"}
    assert set(tidy.step) == {0} and tidy.predicted.isna().all() and tidy.valid.isna().all() and tidy.run.isna().all()
    # the stream is judged (healthy here), the logits are not
    assert set(tidy[tidy.name != "lm_head"].verdict) == {"ok"} and tidy[tidy.name == "lm_head"].verdict.isna().all()


def test_summary_per_scheme_and_depth(frames):
    _, summary, calls = frames
    assert list(summary.columns) == SUMMARY_COLUMNS and len(summary) == 4
    assert all(v == pytest.approx(math.log(256)) for v in summary.ln_vocab)
    assert ((summary.initial_loss - summary.ln_vocab).abs() < 0.5).all()
    zr = summary[summary.scheme == "zero-residual"]
    assert (zr.slope_forward.abs() < 1e-9).all() and (zr.max_min_ratio == 1).all()  # blocks start as the identity
    cs = summary[summary.scheme == "cs336"]
    assert (cs.slope_forward > 0).all() and (cs.slope_forward_low < cs.slope_forward).all()
    assert set(summary.verdict) == {"ok"}
    assert [c[0] for c in calls] == list(range(1, 9)) and calls[-1][1] == 8


def test_no_norm_summary_says_exploding():
    tidy, summary = compare(CompareOptions(schemes=["cs336"], depths=(6,), widths=(64,), seeds=1, seq_len=8, norm="none",
                                           run="no-norm"))
    assert summary.verdict.iloc[0] == "exploding" and summary.slope_forward.iloc[0] > 1
    # the tidy rows carry the same verdict on the stream tensors the finding names
    bad = tidy[tidy.verdict == "exploding"]
    assert len(bad) and set(bad.kind) <= {"residual", "embedding"} and set(tidy.run) == {"no-norm"}


def test_steps_give_an_early_loss():
    _, summary = compare(CompareOptions(schemes=["cs336"], depths=(1,), widths=(32,), seeds=1, steps=3, seq_len=8))
    assert summary.steps.iloc[0] == 3 and math.isfinite(summary.early_loss.iloc[0])
    assert summary.vocab_size.iloc[0] == 256


def test_stream_slope():
    assert stream_slope([1, 2, 4, 8]) == pytest.approx(math.log(2))
    assert math.isnan(stream_slope([1.0, float("inf")]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(schemes=["nope"]), "unknown init scheme"), (dict(depths=(0,)), "depths="), (dict(seeds=0), "seeds="),
    (dict(steps=-1), "steps="), (dict(tensors="some"), "tensors="),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(tinylm.TinyLMError, match=match):
        compare(CompareOptions(**kwargs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size=0"), (dict(norm="sandwich"), "norm='sandwich'"), (dict(lr=0.0), "lr=0.0"),
    (dict(progress="bar"), "progress='bar'"), (dict(thresholds={"exploding_gain": 2}), "thresholds="),
    (dict(widths=[]), "widths="),
])
def test_options_are_checked_when_made(kwargs, match):
    with pytest.raises(OptionsError, match=match):
        CompareOptions(**kwargs)


def test_compare_takes_one_options_object():
    """compare takes one CompareOptions; anything else is refused with the way to write it."""
    options = CompareOptions(schemes=["cs336"], depths=[2], widths=(32,))
    assert options.schemes == ("cs336",) and options.depths == (2,)  # sequences are kept as tuples
    with pytest.raises(OptionsError, match=r"options=\['cs336'\]: must be a diagnostics.CompareOptions"):
        compare(["cs336"])
    with pytest.raises(TypeError):
        compare(schemes=["cs336"])


@pytest.mark.slow
def test_default_comparison_runs():
    tidy, summary = compare()
    assert len(summary) == len(tinylm.init.SCHEMES) * 3
    assert summary[summary.scheme == "cs336"].verdict.eq("ok").all()


# ----------------------------------------------------------------------------- data: tokens from a file or array

TINY = dict(depths=(1,), widths=(32,), seq_len=8)


def test_data_feeds_the_measured_batch_and_the_training_steps():
    """One repeated token is learnt in five steps; uniform random tokens cannot be learnt at all."""
    kw = dict(TINY, seeds=2, steps=5, lr=1e-2)
    sevens = np.full(100, 7, dtype=np.int64)
    tidy, const = compare(CompareOptions(schemes=["cs336"], data=sevens, data_name="sevens", **kw))
    _, rand = compare(CompareOptions(schemes=["cs336"], data=np.random.default_rng(0).integers(0, 256, 2000), **kw))
    assert const.data.iloc[0] == "sevens (100 tokens)" and rand.data.iloc[0] == "given tokens (2,000 tokens)"
    ln_v = math.log(256)
    assert const.early_loss.iloc[0] < ln_v - 2  # measured 2.38
    assert abs(rand.early_loss.iloc[0] - ln_v) < 0.3  # measured 5.57
    # the measured batch is the data: every position embeds token 7, so the embedding output's
    # pooled variance is that of row 7 of the embedding of the model seed 0 builds
    config = tinylm.ModelConfig(vocab_size=256, context_length=8, d_model=32, num_layers=1, num_heads=1,
                                d_ff=tinylm.default_d_ff(32), init="cs336")
    row = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)).token_embeddings.weight[7]
    got = tidy.query("seed == 0 and name == 'token_embeddings' and direction == 'forward' and statistic == 'var'")
    assert got.value.iloc[0] == pytest.approx(row.double().var(unbiased=False).item(), rel=1e-9)


def test_stdlib_bytes_as_data_train_exactly_as_the_default_does():
    """Without data the steps train on the standard library's bytes: the same bytes given as data give
    the same early loss, while the loss at init is now measured on text instead of random tokens."""
    from diagnostics.jobs.compare import _corpus

    kw = dict(TINY, seeds=1, steps=3)
    _, default = compare(CompareOptions(schemes=["cs336"], **kw))
    _, given = compare(CompareOptions(schemes=["cs336"], data=_corpus(), data_name="stdlib", **kw))
    assert default.data.iloc[0] == "uniform random tokens; steps on the standard library's bytes"
    assert given.early_loss.iloc[0] == default.early_loss.iloc[0]
    assert given.initial_loss.iloc[0] != default.initial_loss.iloc[0]


def test_vocabulary_is_sized_to_the_data_unless_given(tmp_path):
    ids = np.arange(2000) % 1000  # largest id 999
    _, sized = compare(CompareOptions(schemes=["cs336"], data=ids, seeds=1, **TINY))
    assert sized.vocab_size.iloc[0] == 1000 and sized.ln_vocab.iloc[0] == pytest.approx(math.log(1000))
    assert abs(sized.initial_loss.iloc[0] - math.log(1000)) < 0.5  # ln V of the vocabulary actually built
    text = tmp_path / "t.txt"
    text.write_bytes(b"abc def\n" * 8)  # ids below 256 keep the byte vocabulary
    _, bytes_ = compare(CompareOptions(schemes=["cs336"], data=text, seeds=1, **TINY))
    assert bytes_.vocab_size.iloc[0] == 256 and bytes_.data.iloc[0] == f"{text} (64 tokens)"
    _, given = compare(CompareOptions(schemes=["cs336"], data=ids, vocab_size=1200, seeds=1, **TINY))
    assert given.vocab_size.iloc[0] == 1200 and given.ln_vocab.iloc[0] == pytest.approx(math.log(1200))
    with pytest.raises(DataError, match=r"token id 999 is outside .*use vocab_size 1000 or more"):
        compare(CompareOptions(schemes=["cs336"], data=ids, vocab_size=999, seeds=1, **TINY))
    _, random_ = compare(CompareOptions(schemes=["cs336"], vocab_size=1000, seeds=1, **TINY))
    assert random_.ln_vocab.iloc[0] == pytest.approx(math.log(1000)) and random_.data.iloc[0] == "uniform random tokens"


def test_data_exactly_one_sequence_long_is_enough():
    _, s = compare(CompareOptions(schemes=["cs336"], data=np.arange(9), seeds=1, **TINY))  # seq_len + 1 = 9 tokens
    assert math.isfinite(s.initial_loss.iloc[0])
    with pytest.raises(DataError, match=r"8 tokens are fewer than seq_len \+ 1 = 9"):
        compare(CompareOptions(schemes=["cs336"], data=np.arange(8), seeds=1, **TINY))


@pytest.mark.parametrize("data, match", [
    (np.zeros((4, 10), dtype=np.int64), "2-D int64 array; tokens must be a 1-D integer array"),
    (np.linspace(0, 1, 50), "1-D float64 array; tokens must be a 1-D integer array"),
    (np.array([], dtype=np.int64), "no tokens"),
    (np.array([3] * 20 + [-1]), "token id -1 is negative"),
    (np.array([5] * 20 + [1 << 20]), "would need a vocabulary of 1,048,577"),
])
def test_bad_data_is_named(data, match):
    with pytest.raises(DataError, match=match):
        compare(CompareOptions(schemes=["cs336"], data=data, seeds=1, **TINY))


def test_missing_data_file_and_bad_vocab_size(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        compare(CompareOptions(schemes=["cs336"], data=tmp_path / "missing.npy", seeds=1, **TINY))
    with pytest.raises(OptionsError, match="vocab_size=0"):
        compare(CompareOptions(schemes=["cs336"], vocab_size=0, seeds=1, **TINY))
