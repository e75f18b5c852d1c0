"""The probe's queued requests with rows (:mod:`diagnostics.measure.pending_rows`): one call into
numba's loop gives each request today's bits (a whole probed pass of tinylm and a Hugging Face
GPT-2, forward and backward, one pass and two), nothing is left for the hooks to reduce, a tensor
changed in place is not measured, and the cold-start check covers the loop."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import probe
from diagnostics.measure import numba_reducer, pending_rows, reduction
from diagnostics.measure.pending import Pending
from diagnostics.measure.pending_rows import Rows
from diagnostics.measure.probe import _IN_PLACE
from diagnostics.measure.reducer import reduce

from test_pending import _bits, _gpt2, _step, _tinylm, _tokens


def _probed(model, passes: int, queued: bool, monkeypatch):
    """The stats of ``passes`` probed passes, the requests with rows queued or reduced in their hooks."""
    if not queued:
        monkeypatch.setattr(Pending, "takes_rows", lambda self, x: False)
    flushed = []
    real = Rows.reduce
    monkeypatch.setattr(Rows, "reduce", lambda self: flushed.append(len(self)) or real(self))
    with probe(model) as run:
        for p in range(passes):
            _step(model, _tokens(p))
    model.zero_grad(set_to_none=True)
    stats = run.stats
    monkeypatch.undo()
    return stats, flushed


@pytest.mark.parametrize("make", [_tinylm, _gpt2], ids=["tinylm", "gpt2"])
@pytest.mark.parametrize("passes", [1, 2])
def test_a_probed_pass_gives_the_same_bits_with_the_rows_queued(make, passes, monkeypatch):
    """Every figure (moments, cosine, inverse row mean squares, the gates' counts, the norms'
    weighted gradients) bit for bit as when each request is reduced in its hook, and the queue
    took them: forward and backward flushes, none of the hooks' own numba calls with rows left.
    Negative control: eps 10% off (the factor moves by a few float32 ulps) changes the figures it feeds."""
    model = make()
    calls: dict = {False: [], True: []}
    runs = {}
    real = reduction.numba_parts
    for queued in (False, True):  # the lane's calls with rows or extras (rows, cosine, inv_eps, below, weight)
        monkeypatch.setattr(reduction, "numba_parts", lambda *a, _q=queued: calls[_q].append(a[3:]) or real(*a))
        runs[queued] = _probed(model, passes, queued, monkeypatch)
    (hooked, none), (queued, flushed) = runs[False], runs[True]
    with_rows = [[p for p in calls[q] if p[0] or p[1] or p[2] >= 0 or p[3] == p[3] or p[4] is not None]
                 for q in (False, True)]
    assert none == [] and len(flushed) >= passes and min(flushed) > 0
    assert with_rows[1] == [] and len(with_rows[0]) > 0  # in the hooks: none left (control: all of them before)
    assert _bits(queued) == _bits(hooked)
    if make is _tinylm:
        assert queued.cosine and queued.inv_ms and queued.norm_back and queued.flat
        real_vector = Rows.vector
        nudged = lambda self, i, eps=-1.0, weight=None, later=False: real_vector(  # noqa: E731
            self, i, eps * 1.1 if eps >= 0 else eps, weight, later)
        monkeypatch.setattr(Rows, "vector", nudged)
        off, _ = _probed(model, passes, True, monkeypatch)
        differ = {k[0] for k, v in _bits(off).items() if _bits(hooked)[k] != v}
        assert {"inv", "nb"} <= differ


def _requests():
    """Tensors of several shapes (rows not a multiple of the vector width; one row; NaN and inf;
    tiny values), with what each is asked for."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 24, generator=g) * 2 + 0.5
    bad = torch.randn(2, 7, 50, generator=g)
    bad[0, 1, 3], bad[1, 2, 0] = float("nan"), float("inf")
    return [(x, dict(rows=True, cosine=True), 1e-5), (bad, dict(rows=True, cosine=True), 1e-3),
            (torch.randn(40, generator=g) * 1e-20, dict(rows=True), 1e-5),
            (torch.randn(4, 1, 16, generator=g), dict(rows=True, cosine=True), 0.0),
            (torch.randn(6, 33, generator=g) - 5, dict(below=-6.0), None),
            (torch.full((3, 16), -6.3), dict(below=-6.3), None)]  # an edge float32 rounds: compared as torch does


def test_one_call_gives_each_request_its_own_bits():
    """Moments, cosine, the count below an edge, 1 / (row_ms + eps) (its summary and the vector)
    and row_ms * weight (a float32 tensor, or a vector the same flush made), as reduce gives
    each request alone. Negative control: one ulp in one entry of one tensor changes its row."""
    rows = Rows()
    asked = []
    for x, kw, eps in _requests():
        i = rows.tensor(x, kw.get("rows", False), kw.get("cosine", False), kw.get("below", math.nan))
        j = rows.vector(i, eps, later=True) if eps is not None else None
        asked.append((i, j))
    w = torch.rand(3, 5, generator=torch.Generator().manual_seed(5))
    k = rows.vector(0, weight=w)
    parts, summaries = rows.reduce()
    for (x, kw, eps), (i, j) in zip(_requests(), asked):
        want = reduce(x, inv_eps=eps if eps is not None else -1.0, **kw)
        mom, cos, below = parts[i]
        assert mom.numpy().tobytes() == want.moments.numpy().tobytes()
        assert (cos is None) == (want.cosine is None) and (cos is None or torch.equal(cos, want.cosine))
        assert (below is None) == (want.below is None) and (below is None or torch.equal(below, want.below))
        if j is not None:
            assert summaries[j].numpy().tobytes() == want.inv.numpy().tobytes()
            factor = (want.row_ms + eps).reciprocal_()
            assert rows.laters[j].value.numpy().tobytes() == factor.numpy().tobytes()
    x = _requests()[0][0]
    assert summaries[k].numpy().tobytes() == reduce(x, rows=True, weight=w).weighted.numpy().tobytes()
    again = Rows()
    y = x.clone()
    y[2, 4, 23] = torch.nextafter(y[2, 4, 23], torch.tensor(math.inf))
    again.tensor(y, True, True)
    assert again.reduce()[0][0][0].numpy().tobytes() != parts[0][0].numpy().tobytes()


def test_a_factor_made_at_the_flush_weighs_a_later_gradient():
    """A norm's factor, a Later filled by the forward's flush, weighs its gradient in the next
    flush: the bits of reduce(grad, rows=True, weight=factor)."""
    g = torch.Generator().manual_seed(6)
    x, grad = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g) * 1e-3
    first = Rows()
    j = first.vector(first.tensor(x, True), 1e-5, later=True)
    first.reduce()
    later = first.laters[j]
    second = Rows()
    k = second.vector(second.tensor(grad, True), weight=later)
    _, summaries = second.reduce()
    want = reduce(grad, rows=True, weight=(reduce(x, rows=True).row_ms + 1e-5).reciprocal_()).weighted
    assert summaries[k].numpy().tobytes() == want.numpy().tobytes()


def test_a_residual_changed_in_place_while_queued_is_not_measured():
    """A block's output doubled in place after the probe's hook queued it: its moments count
    nothing and its cosine and inverse row mean squares are absent (not measured), never the
    doubled figures; the model's next probe reduces that site in its hook. Negative control:
    the site's neighbour, untouched, is measured in the same pass."""
    model, x = _tinylm(), _tokens(0)
    with torch.no_grad(), probe(model) as run:  # the doubling hook runs after the probe's
        handle = model.layers[0].register_forward_hook(lambda m, i, o: [o.mul_(2.0)] and None)
        model(x[:, :-1])
    try:
        s = run.stats
        assert run.queue.stale == 3 and ("layers.0", "forward") in run.queue.stale_keys
        assert s.tensors[("layers.0", "forward")].count == 0 and "layers.0" not in s.cosine
        assert "layers.0" not in s.inv_ms and s.tensors[("layers.1", "forward")].count > 0
        with torch.no_grad(), probe(model) as again:
            model(x[:, :-1])
        assert again.queue.stale == 0 and again.stats.tensors[("layers.0", "forward")].count > 0
        assert "layers.0" in again.stats.cosine
    finally:
        handle.remove()
        _IN_PLACE.pop(model, None)


def test_under_an_observer_or_the_cuda_structure_nothing_with_rows_waits(monkeypatch):
    """What an op counter or ``TINYLM_REDUCER=cuda`` sees stays the op per request: the queue
    takes no request with rows there. Negative control: the default path takes one."""
    from diagnostics.measure.opcount import OpCount

    x = torch.randn(4, 8, 16)
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    assert Pending().takes_rows(x)
    with OpCount():
        assert not Pending().takes_rows(x)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    assert not Pending().takes_rows(x)


def test_the_cold_start_check_covers_the_rows_loop(monkeypatch):
    k = numba_reducer._build()
    rows_at = k.rows_at
    assert numba_reducer._cached(k) or not hasattr(rows_at, "_cache")
    for fn, expect in ((rows_at, False), (pending_rows, True)):  # a module has no cache (control)
        if hasattr(fn, "_cache"):
            monkeypatch.setattr(fn._cache._cache_file, "_index_path", "/nonexistent/index")
        assert numba_reducer._cached(k) is expect
        monkeypatch.undo()
