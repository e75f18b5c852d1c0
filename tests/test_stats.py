"""Streaming statistics: exact against float64 references, merges equal one run over both.

Every test runs twice: on the numba reducer (:mod:`diagnostics.measure.numba_reducer`, what a
CPU probe uses) and on the plain-torch reference (:mod:`diagnostics.measure.reference`:
``TINYLM_REDUCER=reference``).
"""

import json
import math

import numpy as np
import pytest
import torch

from diagnostics.measure import numba_reducer
from diagnostics.measure import reducer as reducer_module
from diagnostics.measure.moments import FIELDS, AttnMoments, Moments, ProbeStats
from diagnostics.measure.reducer import Reducer, merge_attention_vectors, merge_vectors, reduce
from diagnostics.options import OptionsError


@pytest.fixture(autouse=True, params=["numba", "reference"])
def path(request, monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "auto" if request.param == "numba" else "reference")
    assert numba_reducer.available() == (request.param == "numba")
    return request.param


def summarize(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return reduce(x, causal=causal).moments


def moments_of(x: torch.Tensor) -> Moments:
    return Moments.from_vector(summarize(x).tolist())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.parametrize("n", [7, 1000, 70_000, 300_001])  # one segment, many, and more than PARALLEL_MIN
def test_moments_match_float64_reference(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3 + 0.5
    m = moments_of(x)
    var, mean = torch.var_mean(x.double(), correction=0)
    assert m.count == n and m.n_total == n
    # both paths accumulate in float64: relative error a few float64 ulps times log2(n)
    assert rel(m.mean, mean.item()) < 1e-12 and rel(m.var, var.item()) < 1e-12
    assert m.max_abs == x.abs().max().item()
    assert rel(m.mean_square, (x.double() ** 2).mean().item()) < 1e-12


def test_float64_input_is_summed_in_float64():
    x = torch.randn(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1e3
    m = moments_of(x)
    var, mean = torch.var_mean(x, correction=0)
    assert rel(m.mean, mean.item()) < 1e-14 and rel(m.var, var.item()) < 1e-8


def test_counts_of_zero_nonfinite_underflow_overflow():
    x = torch.tensor([0.0, 0.0, 1e-6, -3e-5, 1e-40, 7e4, -1e5, 2e38, math.inf, -math.inf, math.nan, 1.0, -2.0])
    m = moments_of(x)
    finite = x[torch.isfinite(x)].double()
    assert m.n_total == 13 and m.count == 10
    assert m.frac_nonfinite == pytest.approx(3 / 13)
    assert m.n_zero == 2
    assert m.n_fp16_under == 3        # 1e-6, -3e-5, 1e-40 are nonzero and below 2^-14
    assert m.n_bf16_under == 1        # only 1e-40 is below 2^-126
    assert m.n_fp16_over == 3         # 7e4, -1e5, 2e38 (finite, >= 2^16)
    assert m.n_bf16_over == 1         # 2e38 lies in float32's top binade (>= 2^127)
    assert m.max_abs == pytest.approx(2e38, rel=1e-7)
    assert rel(m.mean, finite.mean().item()) < 1e-12
    assert rel(m.var, finite.var(correction=0).item()) < 1e-12


def test_counts_negative_control_a_normal_tensor_has_none():
    m = moments_of(torch.linspace(0.5, 2.0, 100))
    assert (m.n_zero, m.n_fp16_under, m.n_fp16_over, m.n_bf16_under, m.n_bf16_over, m.frac_nonfinite) == (0, 0, 0, 0, 0, 0)


def test_bf16_input_is_upcast_exactly():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    m = moments_of(x)
    ref = x.double()
    assert rel(m.var, ref.var(correction=0).item()) < 1e-12 and rel(m.mean, ref.mean().item()) < 1e-9


def test_masked_entries_are_ignored():
    T = 6
    valid = torch.ones(T, T, dtype=torch.bool).tril()
    s = torch.randn(3, 2, T, T, generator=torch.Generator().manual_seed(3)).masked_fill(~valid, -math.inf)
    m = Moments.from_vector(summarize(s, causal=True).tolist())
    ref = s[torch.isfinite(s)].double()
    assert m.n_total == m.count == ref.numel() == 3 * 2 * T * (T + 1) // 2
    assert m.frac_nonfinite == 0 and m.n_zero == 0
    assert rel(m.var, ref.var(correction=0).item()) < 1e-12
    # negative control: without the mask the -inf entries count as non-finite
    assert moments_of(s).frac_nonfinite > 0.3


def test_huge_values_do_not_overflow_the_squares():
    x = torch.full((100_000,), 1e30)
    x[::2] = -1e30
    m = moments_of(x)
    assert math.isfinite(m.var) and rel(m.var, 1e60) < 1e-6


def test_vector_merge_equals_one_summary_of_both():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3000, generator=g) * 2 + 1, torch.randn(5000, generator=g) - 3
    merged = Moments.from_vector(merge_vectors(summarize(a), summarize(b)).tolist())
    both = moments_of(torch.cat([a, b]))
    for f in FIELDS:
        assert rel(getattr(merged, f), getattr(both, f)) < 1e-12 or getattr(merged, f) == getattr(both, f), f


def test_python_merge_equals_tensor_merge_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    va, vb = summarize(torch.randn(2000, generator=g)), summarize(torch.randn(777, generator=g) + 5)
    py = Moments.from_vector(va.tolist()).merge(Moments.from_vector(vb.tolist()))
    t = Moments.from_vector(merge_vectors(va, vb).tolist())
    assert py.vector() == t.vector()


def test_reduce_gives_float64_cpu_tensors_and_both_merges_agree_bit_for_bit(path):
    """reduce gives float64 tensors on x's device on either path; merge_vectors and
    merge_attention_vectors merge CPU vectors in numpy and others with torch ops, and the two
    give the same bits, including a merge with an empty summary (n = 0: mean 0, M2 the sum)."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3000, generator=g) * 2 + 1, torch.randn(500, generator=g) - 3
    va, vb = summarize(a), summarize(b)
    assert va.dtype == torch.float64 and va.is_cpu and va.shape == (len(FIELDS),)
    got = merge_vectors(va, vb)
    assert got.tolist() == reducer_module._merge_torch(va, vb, 1, 4, True).tolist()
    empty = summarize(torch.zeros(0))
    assert empty.tolist() == [0.0] * len(FIELDS)
    assert merge_vectors(empty, va).tolist() == reducer_module._merge_torch(empty, va, 1, 4, True).tolist()
    assert merge_vectors(empty, va).tolist() == pytest.approx(list(va.tolist()), rel=1e-15)
    pa = torch.tensor([4.0, 1.5, 0.2, 0.7, 3.0, 1.0], dtype=torch.float64)
    pb = torch.tensor([6.0, 1.1, 0.4, 0.2, 5.0, 2.0], dtype=torch.float64)
    assert merge_attention_vectors(pa, pb).tolist() == reducer_module._merge_torch(pa, pb, 0, 3, False).tolist()
    assert merge_attention_vectors(pa, pb)[3] == 0.2  # the smaller minimum entropy, not the larger
    # negative control: the two halves are not the whole until merged
    assert got.tolist() != vb.tolist() and got[0] == 3500


def test_merge_is_associative_to_rounding():
    g = torch.Generator().manual_seed(6)
    parts = [moments_of(torch.randn(n, generator=g) * (i + 1)) for i, n in enumerate([100, 2000, 50])]
    left = parts[0].merge(parts[1]).merge(parts[2])
    right = parts[0].merge(parts[1].merge(parts[2]))
    assert rel(left.var, right.var) < 1e-13 and rel(left.mean, right.mean) < 1e-13


def test_attention_summary():
    T = 5
    p = torch.full((1, 1, T, T), 0.0)
    for t in range(T):
        p[0, 0, t, : t + 1] = 1.0 / (t + 1)  # uniform causal attention
    p[0, 0, 4] = torch.tensor([0.0, 0.0, 0.0, 0.001, 0.999])  # one saturated row
    a = AttnMoments.from_vector(reduce(p, causal=True, probs=True).panel.tolist())
    ent = [math.log(t + 1) for t in range(4)] + [-(0.001 * math.log(0.001) + 0.999 * math.log(0.999))]
    assert a.rows == T and a.rows_after_first == T - 1
    assert a.entropy_mean == pytest.approx(sum(ent) / T, rel=1e-6)
    # p ln p is evaluated in float32 (summed in float64): relative error ~ a few ulps of 2^-24 over ln p
    assert a.entropy_min == pytest.approx(min(ent[1:]), rel=1e-5)
    assert a.saturated_frac == pytest.approx(1 / 4)  # row 0 (a single key) is not counted


def test_cosine_equals_the_mean_over_pairs_of_different_tokens():
    """reduce(x, cosine=True) gives, per sequence, the mean of cos(x_s, x_t) over its T (T - 1)
    ordered pairs s != t (here computed pair by pair), whether or not the rows are asked for
    too, for tokens of unequal norms (negative control: the cosines of one sequence whose rows
    are negated in turn are not these)."""
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 7).unsqueeze(-1)
    x = x + torch.randn(3, 1, 16, generator=torch.Generator().manual_seed(3))  # cosines far from 0
    xd = x.double()
    c = torch.nn.functional.cosine_similarity(xd.unsqueeze(-2), xd.unsqueeze(-3), dim=-1)  # (3, 7, 7)
    per_seq = (c.sum((-1, -2)) - 7) / (7 * 6)
    want = Moments.from_vector(reference_moments(per_seq))
    for rows in (False, True):
        got = Moments.from_vector(reduce(x, rows=rows, cosine=True).cosine.tolist())
        assert got.count == 3 and got.mean == pytest.approx(want.mean, rel=1e-6)
        assert got.var == pytest.approx(want.var, rel=1e-5)
    sign = torch.ones(7, 1)
    sign[1::2] = -1.0
    wrong = Moments.from_vector(reduce(x * sign, cosine=True).cosine.tolist())
    assert abs(wrong.mean - want.mean) > 1e-2


def reference_moments(v: torch.Tensor) -> list[float]:
    v = v.double().reshape(-1)
    return [v.numel(), v.numel(), v.mean().item(), ((v - v.mean()) ** 2).sum().item(), v.abs().max().item(),
            0, 0, 0, 0, 0]


def test_cosine_of_identical_and_orthogonal_tokens():
    same = torch.ones(2, 4, 8)
    ortho = torch.eye(8)[:4].unsqueeze(0)
    def cos(x):
        return Moments.from_vector(reduce(x, cosine=True).cosine.tolist()).mean
    assert cos(same) == pytest.approx(1.0)
    assert cos(ortho) == pytest.approx(0.0, abs=1e-12)
    assert cos(-same[:, :2].repeat(1, 1, 1) * torch.tensor([[1.0], [-1.0]])) == pytest.approx(-1.0)


def test_probe_stats_round_trip_through_json():
    st = ProbeStats(tensors={("a", "forward"): moments_of(torch.arange(10.0))}, kinds={"a": "linear"}, order=["a"],
                    attention={"p": AttnMoments(4, 1.0, 0.5, 0.2, 3, 1)}, cosine={"a": moments_of(torch.ones(3))},
                    steps=2)
    back = ProbeStats.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back == st


@pytest.mark.parametrize("fill", [-math.inf, 0.0, math.nan])
def test_entries_above_the_diagonal_never_count(fill, path):
    """A causal reduction is the same whatever lies above the diagonal (masked scores hold
    -inf, their probabilities 0), with NaN, zeros and subnormals below it that must count.
    Negative control: without ``causal`` the entries above do count."""
    T = 6
    valid = torch.ones(T, T, dtype=torch.bool).tril()
    s = torch.randn(3, 2, T, T, generator=torch.Generator().manual_seed(8))
    s[0, 0, 3, 1], s[1, 1, 2, 0], s[2, 0, 5, 5] = math.nan, 0.0, 1e-6
    clean = summarize(s, causal=True).tolist()
    filled = s.masked_fill(~valid, fill)
    assert summarize(filled, causal=True).tolist() == clean
    assert summarize(filled).tolist() != clean
    m = Moments.from_vector(clean)
    assert m.n_total == 3 * 2 * 21 and m.count == m.n_total - 1 and m.n_zero == 1 and m.n_fp16_under == 1


def test_bad_input_is_named_in_one_line(path):
    """reduce refuses what its options cannot measure, naming the value and the fix."""
    with pytest.raises(OptionsError, match=r"x.shape=\(3, 4\): causal needs square"):
        reduce(torch.zeros(3, 4), causal=True)
    with pytest.raises(OptionsError, match=r"x=torch.int64: .*floating-point"):
        reduce(torch.zeros(3, dtype=torch.long))
    with pytest.raises(OptionsError, match=r"x.shape=\(5,\): causal and probs need"):
        reduce(torch.zeros(5), probs=True)


def test_reducer_reads_a_tensor_once_and_never_serves_a_stale_one(path):
    """A Reducer returns the very Reduction of the same tensor, unchanged, asked again (the same
    or fewer parts); a tensor changed in place, another tensor at the same values, a causal
    request of a flat one, or a part not read before is reduced afresh (and then remembered)."""
    red = Reducer()
    g = torch.Generator().manual_seed(1)
    t = torch.randn(2, 5, 5, generator=g)
    first = red(t, rows=True)
    assert red(t) is first and red(t, rows=True) is first
    assert red(t.clone()) is not first
    causal = red(t, causal=True)
    assert causal is not first and causal.moments[0] == 2 * 15
    with_cos = red(t, cosine=True)
    assert with_cos is not first and with_cos.row_ms is not None and with_cos.cosine is not None
    assert red(t, rows=True) is with_cos  # now remembered with both parts
    ms = with_cos.row_ms.clone()
    t.mul_(2.0)
    again = red(t, rows=True)
    assert again is not with_cos and torch.allclose(again.row_ms, 4 * ms)
    # only the last `size` tensors are remembered
    small = Reducer(size=2)
    a, b, c = (torch.randn(8, generator=g) for _ in range(3))
    ra = small(a)
    small(b), small(c)
    assert small(a) is not ra and small(a).moments.tolist() == ra.moments.tolist()


def test_the_panel_ignores_what_lies_above_the_diagonal(path):
    """Causal probabilities with NaN or 1 above the diagonal have the panel of the same rows with
    zeros there (the numba reducer never reads them; the reference takes them as 0). Negative
    control: the panel of those rows read whole, without ``causal``, differs."""
    T = 9
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(torch.randn(2, T, T, generator=torch.Generator().manual_seed(12)).masked_fill(~mask, -math.inf), -1)
    want = reduce(p, causal=True, probs=True).panel.tolist()
    for junk in (math.nan, 1.0):
        assert reduce(p.masked_fill(~mask, junk), causal=True, probs=True).panel.tolist() == want
    assert reduce(p.masked_fill(~mask, 1.0), probs=True).panel.tolist() != want
