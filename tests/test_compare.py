"""compare(): tidy and summary frames over schemes, depths, widths and seeds."""

import math

import pytest

import tinylm
from diagnostics import compare
from diagnostics.compare import SUMMARY_COLUMNS, TIDY_COLUMNS, stream_slope


@pytest.fixture(scope="module")
def frames():
    calls = []
    tidy, summary = compare(["cs336", "zero-residual"], depths=(2, 4), widths=(32,), seeds=2, seq_len=8,
                            progress=lambda d, t, s: calls.append((d, t, s)))
    return tidy, summary, calls


def test_tidy_has_one_row_per_tensor_direction_statistic(frames):
    tidy, _, _ = frames
    assert list(tidy.columns) == TIDY_COLUMNS
    # per model: stream points (L+1) + logits, forward and backward, 4 statistics
    expected = sum(2 * 2 * (L + 2) * 2 * 4 for L in (2, 4))
    assert len(tidy) == expected
    assert not tidy.duplicated(["scheme", "depth", "width", "seed", "tensor", "direction", "statistic"]).any()
    assert set(tidy.statistic) == {"var", "mean", "max_abs", "frac_zero"}


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
    _, summary = compare(["cs336"], depths=(6,), widths=(64,), seeds=1, seq_len=8, norm="none")
    assert summary.verdict.iloc[0] == "exploding" and summary.slope_forward.iloc[0] > 1


def test_steps_give_an_early_loss():
    _, summary = compare(["cs336"], depths=(1,), widths=(32,), seeds=1, steps=3, seq_len=8)
    assert summary.steps.iloc[0] == 3 and math.isfinite(summary.early_loss.iloc[0])


def test_stream_slope():
    assert stream_slope([1, 2, 4, 8]) == pytest.approx(math.log(2))
    assert math.isnan(stream_slope([1.0, float("inf")]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(schemes=["nope"]), "unknown init scheme"), (dict(depths=(0,)), "depths="), (dict(seeds=0), "seeds="),
    (dict(steps=-1), "steps="), (dict(tensors="some"), "tensors="),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(tinylm.TinyLMError, match=match):
        compare(**kwargs)


@pytest.mark.slow
def test_default_comparison_runs():
    tidy, summary = compare()
    assert len(summary) == len(tinylm.init.SCHEMES) * 3
    assert summary[summary.scheme == "cs336"].verdict.eq("ok").all()
