"""The numba reducer (diagnostics.measure.numba_reducer) against the plain-torch reference.

A CPU probe reduces every float32, bf16 and fp16 tensor with :mod:`diagnostics.measure.numba_reducer`;
float64 and ``TINYLM_REDUCER=reference`` take :mod:`diagnostics.measure.reference`.
:func:`diagnostics.measure.reducer.reduce` must give the same on both: counts and max |x|
exactly, mean and M2 to float64 rounding, the attention panel and the cosines to the float32
rounding of the numba reducer's logarithm and unit vectors.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnostics.measure import numba_reducer
from diagnostics.measure import reference
from diagnostics.measure.moments import FIELDS, AttnMoments, Moments
from diagnostics.measure.reducer import reduce


def summarize(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return reduce(x, causal=causal).moments


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)

_SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, 3e-5, 6.1e-5, 6.2e-5, 65504.0, 65536.0,
            -7e4, 1.7e38, 3.4e38, 1e30, 1.0, -2.5]


def _both(x: torch.Tensor, causal: bool = False, monkeypatch=None) -> tuple[list[float], list[float]]:
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    a = summarize(x, causal).tolist()
    monkeypatch.setenv("TINYLM_REDUCER", "reference")
    b = summarize(x, causal).tolist()
    return a, b


def _disagreements(a: list[float], b: list[float], x: torch.Tensor) -> list[tuple]:
    """What breaks the contract: counts and max |x| identical on both paths; mean and M2 of each
    path against a float64 two-pass computation over the finite entries, within that path's
    rounding: the numba reducer sums float64 shifted by the mean of the segment before (the first:
    by its first entry) (1e-12 of M2); the reference is itself a float64 two-pass (1e-12)."""
    bad = [(name, u, v) for name, u, v in zip(FIELDS, a, b) if name not in ("mean", "m2") and u != v]
    f = x.double().reshape(-1)
    f = f[torch.isfinite(f)]
    if f.numel() == 0:
        return bad
    mean, m2 = f.mean().item(), ((f - f.mean()) ** 2).sum().item()
    spread = math.sqrt(m2 / f.numel())
    if abs(a[2] - mean) > 1e-12 * (abs(mean) + spread):
        bad.append(("numba mean", a[2], mean))
    if abs(a[3] - m2) > 1e-12 * m2 + 1e-300:
        bad.append(("numba m2", a[3], m2))
    if abs(b[2] - mean) > 1e-12 * (abs(mean) + spread):
        bad.append(("reference mean", b[2], mean))
    if abs(b[3] - m2) > 1e-12 * m2 + 1e-300:
        bad.append(("reference m2", b[3], m2))
    return bad


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]),
       offset=st.sampled_from([0.0, 1.0, -1e3]), specials=st.lists(st.sampled_from(_SPECIAL), max_size=6))
def test_numba_reducer_equals_reference(n, seed, scale, offset, specials):
    """Property: for any float32 tensor, the two paths give the same summary (exact counts and
    max; mean and M2 to float64 rounding), whatever non-finite, subnormal or huge values it holds."""
    mp = pytest.MonkeyPatch()
    try:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=g) * scale + offset
        if specials:
            idx = torch.randint(0, n, (len(specials),), generator=g)
            x[idx] = torch.tensor(specials, dtype=torch.float32)
        assert not _disagreements(*_both(x, monkeypatch=mp), x)
    finally:
        mp.undo()


@pytest.mark.parametrize("T", [1, 2, 7, 64, 100])  # 100: 5050 causal entries, packed into two blocks
def test_numba_reducer_causal_equals_masked_reference(T, monkeypatch):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(3, 2, T, T, generator=g)
    x[0, 0, -1, 0] = math.nan
    x[1, 1, 0, -1] = math.inf  # above the diagonal when T > 1: never read
    valid = torch.ones(T, T, dtype=torch.bool).tril()
    a, b = _both(x, True, monkeypatch)
    assert not _disagreements(a, b, x[..., valid])
    assert a[0] == 6 * T * (T + 1) // 2


@pytest.mark.parametrize("shape", [(3, 5, 512), (7, 100), (2, 5000), (9, 1), (1 << 15, 16), (4, 256, 1344)])
def test_summary_rows_reads_the_summary_and_each_rows_sum_of_squares(shape):
    """numba_reducer.summary_rows: the same summary as numba_reducer.summary (to float64 rounding: the segments
    are whole rows) and each row's sum of x^2 against float64, for rows shorter than a vector,
    not a multiple of 16, longer than a segment, and tensors split over threads (negative
    control: the sums shifted by one row are not these)."""
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32) * 3 + 0.5
    vec, rowsq, cos = numba_reducer.summary_rows(x)
    assert cos is None  # only when asked for
    ref = numba_reducer.summary(x)
    assert vec[[0, 1, 4, 5, 6, 7, 8, 9]].tolist() == ref[[0, 1, 4, 5, 6, 7, 8, 9]].tolist()
    assert vec[2] == pytest.approx(ref[2], rel=1e-12) and vec[3] == pytest.approx(ref[3], rel=1e-12)
    want = (x.astype(np.float64) ** 2).sum(-1)
    assert rowsq.shape == want.shape
    np.testing.assert_allclose(rowsq, want, rtol=1e-12)
    assert not np.allclose(rowsq.reshape(-1)[:-1], want.reshape(-1)[1:])


@pytest.mark.parametrize("shape", [(4, 256, 512), (3, 7, 16), (2, 300, 33), (5, 2, 1), (9, 40)])
def test_cosine_from_the_rows_read_equals_the_reference_cosine(shape, monkeypatch):
    """numba_reducer.summary_rows(cosine=True): the summary of each sequence's mean cosine between its
    different rows equals reference.cosines (float64) to float32 rounding of the cosines, for sequences split over threads, rows not a multiple of 16, one-entry rows and
    a single 2-D sequence; a zero row counts as a zero vector on both paths; scaling each row
    by its own positive factor changes nothing. Negative control: negating every other row
    (a cosine's sign flips with one of its rows) gives other cosines."""
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    # a component shared by the tokens of a sequence, so that the cosines are far from 0
    x = torch.randn(shape, generator=g) + torch.randn((*shape[:-2], 1, shape[-1]), generator=g)
    if shape[-2] > 2:
        x[..., -1, :] = 0.0
    want = Moments.from_vector(reference.cosines(x).tolist())
    vec, rowsq, cos = numba_reducer.summary_rows(x, cosine=True)
    got = Moments.from_vector(cos.tolist())
    assert got.count == want.count == math.prod(shape[:-2])
    assert got.mean == pytest.approx(want.mean, abs=1e-6)
    assert got.var == pytest.approx(want.var, rel=1e-4, abs=1e-9)
    assert got.max_abs == pytest.approx(want.max_abs, abs=1e-6)
    scaled = x * torch.rand((*shape[:-1], 1), generator=g).add(0.1).mul(100)
    same = Moments.from_vector(numba_reducer.summary_rows(scaled, cosine=True)[2].tolist())
    assert same.mean == pytest.approx(got.mean, abs=1e-6)
    sign = torch.ones(shape[-2], 1)
    sign[1::2] = -1.0
    flipped = Moments.from_vector(numba_reducer.summary_rows(x * sign, cosine=True)[2].tolist())
    assert abs(flipped.mean - got.mean) > 1e-2


def test_cosine_of_one_row_sequences_is_the_summary_of_nothing():
    """Sequences of one row have no pair of different rows: the summary counts nothing."""
    x = torch.randn(3, 1, 8)
    assert numba_reducer.summary_rows(x, cosine=True)[2].tolist() == [0.0] * 10
    assert numba_reducer.summary_rows(x[0, 0], cosine=True)[2].tolist() == [0.0] * 10


def test_mean_far_above_the_spread_keeps_its_variance():
    """The variance of 1e4 + 1e-3 z comes out to 1e-6 relative: each segment takes a corrected
    two-pass spread about its own mean (negative control: the one-pass sum x^2 - n mean^2
    in float64 loses it to cancellation)."""
    x = 1e4 + 1e-3 * torch.randn(100_000, generator=torch.Generator().manual_seed(9))
    ref = x.double().var(correction=0).item()
    m = Moments.from_vector(numba_reducer.summary(x).tolist())
    assert rel(m.var, ref) < 1e-6
    xd = x.double()
    naive = ((xd * xd).sum() - xd.sum() ** 2 / xd.numel()).item() / xd.numel()
    assert rel(naive, ref) > 1e-3


@pytest.mark.parametrize("T", [40, 300])  # 300: rows longer than one float32 chunk
def test_numba_reducer_attention_panel_matches_float64(T):
    s = torch.randn(2, 3, T, T, generator=torch.Generator().manual_seed(11)) * 4
    p = torch.softmax(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf), -1)
    r = reduce(p, causal=True, probs=True)
    a = AttnMoments.from_vector(r.panel.tolist())
    ent = torch.special.entr(p.double()).sum(-1)
    # float32 p ln p with a polynomial log: relative error ~1e-6 per row
    assert a.entropy_mean == pytest.approx(ent.mean().item(), rel=2e-6)
    assert a.entropy_min == pytest.approx(ent[..., 1:].min().item(), rel=2e-6, abs=1e-6)
    assert a.rows_saturated == (p[..., 1:, :].amax(-1) > 0.99).sum().item()
    assert a.rows == 2 * 3 * T and a.rows_after_first == 2 * 3 * (T - 1)
    # the moments read with the panel are the causal summary's, to the last bit
    assert r.moments.tolist() == summarize(p, causal=True).tolist()


def test_polynomial_log_over_every_binade():
    """-p ln p from the numba reducer against float64 at 2^k (1 +- small) for k = -125..0: the
    exponent arithmetic is right in every binade (negative control: ln taken base 2 is not)."""
    ks = np.arange(-125, 1)
    vals = np.concatenate([np.ldexp(1.0, ks), np.ldexp(1.0, ks) * 0.7071, np.ldexp(1.0, ks[:-1]) * 1.4142])
    for v in vals.astype(np.float32):
        row = np.zeros((1, 1), dtype=np.float32)
        row[0, 0] = v
        h = numba_reducer.summary(row, 1, probs=True)[len(FIELDS) + 1]  # the entropy of the one row
        want = -float(v) * math.log(float(v))
        assert h == pytest.approx(want, rel=2e-6), v
        if v != 1:
            assert abs(h - (-float(v) * math.log2(float(v)))) > 1e-3 * abs(want)


_THREADS_CHILD = """
import numpy as np, torch
torch.set_num_threads(1)
from diagnostics.measure import numba_reducer
x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
seen = []
for n in (1, 2, 1, 3, 1):
    torch.set_num_threads(n)
    numba_reducer.summary(x)
    seen.append(torch.get_num_threads())
print(*seen)
"""


def test_the_callers_torch_thread_count_is_left_alone():
    """numba's OpenMP layer shares the runtime with torch and may set the runtime's thread
    count to its own when its pool starts (seen here: a process at torch 1 thread was at 2
    after its first parallel reduction). numba_reducer.summary reduces serially at one thread and puts
    the caller's count back after a parallel launch. A fresh process, so the pool starts inside."""
    out = subprocess.run([sys.executable, "-c", _THREADS_CHILD], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "2", "1", "3", "1"]


def test_a_tensor_is_read_in_place_like_its_array():
    """summary and summary_rows take a CPU tensor (read at its data pointer) or a numpy array
    (at the address of its C-contiguous flattening): the same vectors, bit for bit, for a
    tensor and its array, for a strided array (copied first) and for causal matrices."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 40, 33, generator=g)
    a = x.numpy()
    assert numba_reducer.summary(x).tolist() == numba_reducer.summary(a).tolist()
    vt, rt, ct = numba_reducer.summary_rows(x, cosine=True)
    va, ra, ca = numba_reducer.summary_rows(a, cosine=True)
    assert vt.tolist() == va.tolist() and rt.tolist() == ra.tolist() and rt.shape == (6, 40)
    assert ct.tolist() == ca.tolist()
    strided = a[:, ::2, :]
    assert numba_reducer.summary(strided).tolist() == numba_reducer.summary(np.ascontiguousarray(strided)).tolist()
    s = torch.randn(3, 2, 17, 17, generator=g)
    assert numba_reducer.summary(s, 17, probs=True).tolist() == numba_reducer.summary(s.numpy(), 17, probs=True).tolist()
    # negative control: another tensor's pointer gives other numbers
    assert numba_reducer.summary(x).tolist() != numba_reducer.summary(x + 1).tolist()
    with pytest.raises(TypeError, match="float32"):
        numba_reducer.summary(a.astype(np.float64))
    # a tensor whose memory is not its values in order is read from its contiguous float32
    # copy (an expanded view has fewer entries than its size: reading it at its pointer would
    # run past the storage); a dtype that would lose digits, or another device, is refused
    negated = torch._neg_view(x)  # what a real tensor's pending negation looks like
    assert negated.is_neg()
    for odd in (x[:, ::2], torch.randn(1, 33).expand(1000, 33), negated, x.to(torch.bfloat16)):
        plain = torch.tensor(odd.float().tolist())
        assert numba_reducer.summary(odd).tolist() == numba_reducer.summary(plain).tolist()
        assert [r.tolist() for r in numba_reducer.summary_rows(odd, cosine=True)] \
            == [r.tolist() for r in numba_reducer.summary_rows(plain, cosine=True)]
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        numba_reducer.summary(x.double())


def _cases():
    """(name, tensor, options) the probe meets and a few it should survive: odd sizes, strided
    and expanded views, a pending negation, fp16 and bf16, causal scores and probabilities,
    rows with their cosines, and tensors large enough to be split over threads."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4, 67, 97, generator=g) * 2 + 0.3
    big = torch.randn(8, 256, 160, generator=g)  # 327,680 entries >= PARALLEL_MIN
    T = 37
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = torch.randn(3, 2, T, T, generator=g) * 3
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
    ps = torch.softmax(torch.randn(2, 4, 130, 130, generator=g).mul(6).masked_fill(
        ~torch.ones(130, 130, dtype=torch.bool).tril(), -math.inf), -1)  # 135,200 entries, saturated rows
    pbig = torch.softmax(torch.randn(4, 4, 256, 256, generator=g).masked_fill(
        ~torch.ones(256, 256, dtype=torch.bool).tril(), -math.inf), -1)  # 1,048,576 entries
    rows = dict(rows=True, cosine=True)
    return [
        ("odd flat", x, {}), ("one entry", x[:1, :1, :1], {}), ("strided", x[:, ::3, 1::2], {}),
        ("transposed", x.transpose(0, 2), {}), ("expanded", torch.randn(1, 33, generator=g).expand(500, 33), {}),
        ("negated view", torch._neg_view(x), {}), ("fp16", x.half(), {}), ("bf16", x.bfloat16(), {}),
        ("big", big, {}), ("big rows", big, rows), ("rows", x, rows), ("strided rows", x[:, 1::2], rows),
        ("bf16 rows", x.bfloat16(), rows), ("one-row sequences", x[:, :1], rows), ("2-D rows", x[0], rows),
        ("causal scores", s, dict(causal=True)), ("causal fp16", s.half(), dict(causal=True)),
        ("causal strided", s[:, :1], dict(causal=True)),
        ("probs", p, dict(causal=True, probs=True)), ("saturated probs", ps, dict(causal=True, probs=True)),
        ("big probs", pbig, dict(causal=True, probs=True)), ("bf16 probs", p.bfloat16(), dict(causal=True, probs=True)),
    ]


def _moment_gaps(a: torch.Tensor, b: torch.Tensor) -> list:
    a, b = a.tolist(), b.tolist()
    bad = [(f, u, v) for f, u, v in zip(FIELDS, a, b) if f not in ("mean", "m2") and u != v]
    spread = math.sqrt(b[3] / b[1]) if b[1] else 0.0
    if abs(a[2] - b[2]) > 1e-12 * (abs(b[2]) + spread):
        bad.append(("mean", a[2], b[2]))
    if abs(a[3] - b[3]) > 1e-12 * b[3]:
        bad.append(("m2", a[3], b[3]))
    return bad


@pytest.mark.parametrize("threads", [1, 2])
def test_every_part_of_reduce_equals_the_reference(threads, monkeypatch):
    """reduce through the numba reducer equals reduce on the reference for every case of _cases,
    serial and split over two threads: moments as _disagreements asks (counts and max exact,
    mean and M2 to 1e-12); row mean squares to one float32 rounding; the panel's counts exactly,
    its entropies to the polynomial logarithm's 2e-6; the cosines' count exactly, their mean to
    1e-6 and variance to 1e-4 (the numba reducer rounds each cosine to float32). Negative control:
    the moments of the same tensor shifted by one ulp of its mean are caught."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, x, opts in _cases():
            monkeypatch.setenv("TINYLM_REDUCER", "auto")
            assert numba_reducer.takes(x), name
            a = reduce(x, **opts)
            monkeypatch.setenv("TINYLM_REDUCER", "reference")
            b = reduce(x, **opts)
            assert not _moment_gaps(a.moments, b.moments), (name, _moment_gaps(a.moments, b.moments))
            if opts.get("rows"):
                assert a.row_ms.dtype == b.row_ms.dtype == torch.float32 and a.row_ms.shape == x.shape[:-1]
                torch.testing.assert_close(a.row_ms, b.row_ms, rtol=1.2e-7, atol=0.0)
                ca, cb = Moments.from_vector(a.cosine.tolist()), Moments.from_vector(b.cosine.tolist())
                assert ca.count == cb.count == (math.prod(x.shape[:-2]) if x.shape[-2] > 1 else 0), name
                if cb.count:
                    assert ca.mean == pytest.approx(cb.mean, abs=1e-6), name
                    assert ca.var == pytest.approx(cb.var, rel=1e-4, abs=1e-9), name
                else:  # sequences of one row: the summary of no values on both paths
                    assert a.cosine.tolist() == b.cosine.tolist() == [0.0] * len(FIELDS), name
            if opts.get("probs"):
                pa, pb = AttnMoments.from_vector(a.panel.tolist()), AttnMoments.from_vector(b.panel.tolist())
                assert (pa.rows, pa.rows_after_first, pa.rows_saturated) == (pb.rows, pb.rows_after_first,
                                                                            pb.rows_saturated), name
                assert pa.entropy_mean == pytest.approx(pb.entropy_mean, rel=2e-6), name
                assert pa.entropy_min == pytest.approx(pb.entropy_min, rel=2e-6, abs=1e-6), name
                assert math.sqrt(pa.entropy_m2 / pa.rows) == pytest.approx(math.sqrt(pb.entropy_m2 / pb.rows),
                                                                          rel=1e-4, abs=1e-6), name
        x = _cases()[0][1]
        monkeypatch.setenv("TINYLM_REDUCER", "auto")
        shifted = reduce(x + torch.finfo(torch.float32).eps * 0.3).moments
        assert _moment_gaps(shifted, reduce(x).moments)
    finally:
        torch.set_num_threads(before)
    saturated = dict((name, x) for name, x, _ in _cases())["saturated probs"]
    assert saturated[..., 1:, :].amax(-1).gt(0.99).sum() > 0  # the case does test the saturated count
