"""What a recorded watch step adds beyond its probe, on the CPU's default path: the peak ratio
and the update ratios from one numba call each, and the judgement of a record reading each
earlier record once.

* The peak ratio's loop (:func:`diagnostics.measure._numba_rows.peak`) selects the median from
  the bits of |x| (a radix select), so its figure is the torch formula's bit for bit: held on
  random tensors of both widths, with zeros, NaN, inf, ties and subnormals, and on rows long
  enough for the select's passes. Negative control: the upper of the two middle values (the
  other common definition of a median) gives a different figure on the same tensors.
* The update ratios' loop (:mod:`diagnostics.measure._numba_update`) sums in another order than
  torch's norms: its figures agree to 1e-12 relative (float64 sums of at most a few million
  float32 squares: the order moves them by ~1e-14), and exactly where a norm is 0 or not
  finite. Negative control: the ratio taken against the weights after the step (the wrong
  denominator) is off by far more than that tolerance.
* The judge's per-signal series, kept as the records come (:class:`diagnostics.judge.baseline.Window`),
  and the zero-gradient baseline equal the per-site formulas, on random histories.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from diagnostics.judge import baseline
from diagnostics.judge.thresholds import Thresholds
from diagnostics.measure import numba_reducer, sharded, signals

pytestmark = pytest.mark.skipif(not numba_reducer.available(), reason="numba not installed")


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    """The loops compiled in this process (the background warm-up's wait is tested elsewhere)."""
    numba_reducer.peak_loop(), numba_reducer.update_loop()
    monkeypatch.setattr(numba_reducer, "ready", lambda: True)


def _torch_peak(x, top, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(signals, "_loop_reads", lambda a, t: False)
        return signals.peak_ratio(x, top)


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 32, 64), (7, 3), (130, 5), (1,), (4, 32, 1000), (200, 8), (3, 1)]
    for i in range(42):
        dtype = torch.float64 if i % 3 == 0 else torch.float32
        x = torch.randn(*shapes[i % len(shapes)], generator=g, dtype=dtype) * 10.0 ** (i % 5 - 2)
        flat = x.view(-1)
        if i % 4 == 0:
            flat[::13] = 0.0
        if i % 5 == 0:
            flat[::17] = math.nan
        if i % 6 == 0:
            flat[::7] = math.inf
        if i % 7 == 0:
            flat[::3] = torch.finfo(dtype).tiny / 8  # subnormal
        if i % 9 == 0:
            x = x.round()  # ties
        if i == 11:
            x.zero_()
        yield x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or bool(a.isnan().all() and b.isnan().all())


def test_peak_ratio_loop_gives_the_torch_formulas_bits(monkeypatch):
    calls = []
    loop = numba_reducer.peak_loop()
    monkeypatch.setattr(numba_reducer, "_peak", lambda *a: calls.append(1) or loop(*a))
    for x in _tensors(0):
        top = x.detach().abs().nan_to_num(0.0, 0.0, 0.0).amax().double()
        got, want = signals.peak_ratio(x, top), _torch_peak(x, top, monkeypatch)
        assert _same(got, want), (tuple(x.shape), x.dtype, got, want)
    assert len(calls) == 42  # every one took the loop


def test_peak_ratio_negative_control_upper_median_differs(monkeypatch):
    """The upper middle value in place of the lower is caught by the same comparison."""
    differs = 0
    for x in _tensors(1):
        a = x.detach().reshape(-1, x.shape[-1])
        s = a[torch.tensor(signals._sampled(a.shape[0], signals.ROWS))].abs().reshape(-1)
        s = s[s.isfinite()].double().sort().values
        if s.numel() % 2 or not s.numel():
            continue
        top = a.abs().nan_to_num(0.0, 0.0, 0.0).amax().double()
        upper = torch.where(s[s.numel() // 2] > 0, top / s[s.numel() // 2], math.nan).reshape(1)
        differs += not _same(upper, signals.peak_ratio(x, top))
    assert differs >= 5


def test_peak_ratio_takes_the_loop_only_on_the_default_path(monkeypatch):
    x = torch.randn(8, 16)
    top = x.abs().amax()
    assert signals._loop_reads(x.reshape(-1, 16), top)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    assert not signals._loop_reads(x.reshape(-1, 16), top)


def _ratios_both(now, was, monkeypatch):
    got = sharded._plain_ratios(now, was)
    with monkeypatch.context() as m:
        m.setattr(sharded, "_loop_reads", lambda n, w: False)
        want = sharded._plain_ratios(now, was)
    return got, want


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)
    now = [torch.randn(n, generator=g) for n in (1 << 20, 4096, 64, 7, 0, 5, 100, 33)]
    was = [t + 1e-3 * torch.randn(t.shape, generator=g) for t in now]
    was[3].zero_()  # moved from zero: inf
    was[5].zero_(), now[5].zero_()  # both zero: 0
    was[6][3] = math.nan
    now[2][1] = math.inf
    return now, was


def test_update_ratio_loop_agrees_with_the_torch_norms(monkeypatch):
    now, was = _pairs(2)
    assert sharded._loop_reads(now, was)
    got, want = _ratios_both(now, was, monkeypatch)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == 0, want == 0)
    finite = want.isfinite() & (want != 0)
    assert finite.sum() == 3  # the three plain pairs; a NaN entry gives 0 on both paths (torch.s where)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=0.0)


def test_update_ratio_negative_control_wrong_denominator(monkeypatch):
    now, was = _pairs(3)
    right = sharded._plain_ratios(now, was)
    wrong = sharded._plain_ratios(was, now)  # ||W_before - W|| / ||W||: the other norm below
    finite = right.isfinite() & (right != 0) & wrong.isfinite()
    rel = ((wrong[finite] - right[finite]).abs() / right[finite]).max()
    assert rel > 1e-8  # far past the 1e-12 the loop is held to


def test_update_ratio_loop_not_taken_for_other_dtypes_or_paths(monkeypatch):
    now, was = _pairs(4)
    assert not sharded._loop_reads([now[0].double()], [was[0].double()])
    assert not sharded._loop_reads([now[0][::2]], [was[0][::2]])  # not contiguous
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    assert not sharded._loop_reads(now, was)


def _random_values(rng: random.Random, records: int, sites: list[str]) -> list[dict]:
    out = []
    for _ in range(records):
        v = {}
        for name in ("massive", "zero_gradient"):
            got = {s: rng.choice([0.0, 0.0, rng.random(), 0.9]) for s in sites if rng.random() < 0.8}
            if got:
                v[name] = got
        out.append(v)
    return out


def test_window_series_equal_the_per_site_lists():
    """Kept record by record, each window's series are the lists read afresh from its records."""
    rng = random.Random(5)
    for _ in range(40):
        size = rng.randint(1, 6)
        values = _random_values(rng, rng.randint(1, 15), [f"s{i}" for i in range(rng.randint(1, 9))])
        window = baseline.Window(size)
        for k, v in enumerate(values):
            window.add(v)
            last = values[max(0, k + 1 - size):k + 1]
            for name in ("massive", "zero_gradient", "absent"):
                want = {site: [u.get(name, {}).get(site) for u in last] for site in v.get(name, {})}
                assert window.series(name) == want
                assert baseline.Window.of(values[:k + 1], size).series(name) == want
    assert baseline.Window.of([{"a": {"x": 1.0}}, {}], 4).series("a") == {}  # not at the last record: not judged


def test_window_drops_a_site_absent_for_its_length():
    window = baseline.Window(3)
    window.add({"a": {"x": 1.0, "y": 2.0}})
    for _ in range(3):
        window.add({"a": {"y": 2.0}})
    assert set(window._cols["a"]) == {"y"}  # x last seen 3 records ago: out of the window
    window.add({"a": {"x": 5.0}})
    assert window.series("a") == {"x": [None, None, 5.0]}


def _naive_zero_excess(shares: list[dict]) -> dict:
    """The rule as the module docstring states it, one site at a time."""
    out = {}
    for site in shares[-1]:
        own, series = math.inf, []
        for got in shares:
            z = got.get(site)
            series.append(None if z is None else (z, min(min(got.values()), own)))
            own = own if z is None else min(own, z)
        out[site] = series
    return out


def test_zero_alerts_equal_the_rule_site_by_site():
    rng = random.Random(6)
    th = Thresholds()
    limit = float(th.underflow_share)
    for _ in range(100):
        values = _random_values(rng, rng.randint(1, 10), [f"s{i}" for i in range(rng.randint(1, 6))])
        shares = [v.get("zero_gradient", {}) for v in values]
        if not shares[-1]:
            continue
        by_site = baseline.Window.of([{"z": g} for g in shares], len(shares)).series("z")
        fast, naive = baseline._zero_excess(shares, by_site), _naive_zero_excess(shares)
        past = {s for s, ser in naive.items() if ser[-1][0] - ser[-1][1] > limit}
        assert past <= set(fast) and all(fast[s] == naive[s] for s in fast)
