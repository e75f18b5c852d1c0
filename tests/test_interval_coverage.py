"""The 99% interval of measured/predicted covers what it says it covers.

Global theory predicts a fresh model's variances as an expectation over the weight draw. With
several seeds each draw is one replicate (its own tokens; the geometric mean over its batches),
so the interval must cover 1 in 99% of runs: across runs with disjoint seeds, the number of
intervals that exclude 1 is at most Binomial(n, 0.01), and the check fails with probability
ALPHA = 1e-6 per assertion. With one seed the replicates are batches of one draw: the interval
covers batch noise, not the draw, and says so (``interval_scope``); the same check, asked to
accept those intervals as covering the draw, rejects them (the negative control).

The tensor is block 0's query projection, whose prediction is the exact expectation over the
draw (d_in E[w^2] E[x^2], x the normed embedding); a narrow model (d 16) with many tokens per
batch makes the draw's deviation (~9%) dominate batch noise (~3%).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import tinylm
from diagnostics import DiagnoseOptions, diagnose, interval_scope

ALPHA = 1e-6
CONFIG = tinylm.ModelConfig(vocab_size=64, context_length=32, d_model=16, num_layers=1, num_heads=2, d_ff=32)
TENSOR = ("layers.0.attn.q_proj", "forward")


def most_exclusions(n: int, rate: float = 1 - 0.99) -> int:
    """The largest count of intervals excluding 1 among n that a 99% interval gives but with probability ALPHA."""
    return int(stats.binom(n, rate).isf(ALPHA))


def exclusions(n: int, seeds: int, batches: int) -> tuple[int, list[str]]:
    """How many of n runs (disjoint seeds) give an interval for TENSOR that excludes 1, and their scopes."""
    count, scopes = 0, []
    for run in range(n):
        base = 1000 + run * seeds
        model = tinylm.TransformerLM(CONFIG, generator=torch.Generator().manual_seed(base))
        result = diagnose(model, options=DiagnoseOptions(batch_size=8, seq_len=32, batches=batches, seeds=seeds,
                                                         seed=base, theory="global"))
        row = result.tensor(*TENSOR)
        assert row.valid and row.ratio_low is not None
        count += not row.ratio_low <= 1.0 <= row.ratio_high
        scopes.append(interval_scope(result.header))
    return count, scopes


def check_coverage(n: int, seeds: int, batches: int) -> None:
    count, scopes = exclusions(n, seeds, batches)
    assert count <= most_exclusions(n), (count, n)
    assert set(scopes) == {f"{seeds} weight draws x {batches} batch(es)"}


def test_intervals_over_several_draws_cover_the_draw():
    check_coverage(20, seeds=3, batches=1)


@pytest.mark.slow
def test_intervals_over_several_draws_cover_the_draw_thoroughly():
    check_coverage(150, seeds=4, batches=2)


def test_negative_control_batches_of_one_draw_do_not_cover_the_draw():
    """The same check rejects one-seed intervals (batches only) as intervals over the draw; their label
    says they cover batches of one draw."""
    n = 20
    count, scopes = exclusions(n, seeds=1, batches=6)
    assert count > most_exclusions(n), count
    assert set(scopes) == {"6 batches of one weight draw (batch noise, not the draw)"}


def test_the_scope_follows_the_header():
    from diagnostics.result import Header

    h = Header("TransformerLM", None, 1, "cs336", 1, 1, 8, 4, 1, 0, "global", 1.0, None, "random")
    assert "one weight draw" in interval_scope(h)
    assert interval_scope(h.__class__(**{**h.__dict__, "theory": "local"})) == "4 batches of these weights"
    assert interval_scope(h.__class__(**{**h.__dict__, "seeds": 3})) == "3 weight draws x 4 batch(es)"
    assert interval_scope(h.__class__(**{**h.__dict__, "theory": "off"})) == ""
