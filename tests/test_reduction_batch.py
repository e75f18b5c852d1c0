"""The parameters' and gradients' moments in one call into numba's loops: the same bits as one
call per tensor, and covered by the cold-start check and its background compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diagnostics.measure import numba_reducer, reduction


def _tensors():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(64, 64, generator=g), torch.randn(10, generator=g).bfloat16(),
            torch.randn(3, 5, generator=g).t(), torch.zeros(0), torch.full((7,), float("nan")),
            torch.randn(300, generator=g) * 1e-6, torch.randn(1, generator=g).half(),
            torch.randn(5000, generator=g) * 7.0 + 1e4]


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_each_tensors_own_summary_bit_for_bit(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs = _tensors() + [torch.randn(numba_reducer.PARALLEL_MIN + 5)]  # one the threads split
        got = numba_reducer.summaries(xs)[:, :10]
        want = np.stack([numba_reducer.summary(x) for x in xs])
    finally:
        torch.set_num_threads(before)
    assert got.tobytes() == want.tobytes()
    # negative control: one ulp in one entry of one tensor changes that tensor's row
    xs[0] = xs[0].clone()
    xs[0][0, 0] = torch.nextafter(xs[0][0, 0], torch.tensor(np.inf))
    assert numba_reducer.summaries(xs)[0, :10].tobytes() != want[0].tobytes()


def test_causal_buffers_in_one_call_equal_their_own_reductions():
    from diagnostics.measure import reducer

    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, 16, 16, generator=g)
    p = s.softmax(-1)
    xs, probs = [s, p, s.bfloat16(), p], [False, True, False, False]
    got = reduction.causal_parts(xs, probs)
    for x, pr, (mom, panel) in zip(xs, probs, got):
        want = reducer.reduce(x, causal=True, probs=pr)
        assert mom.numpy().tobytes() == want.moments.numpy().tobytes()
        assert (panel is None) == (not pr)
        if pr:
            assert panel.numpy().tobytes() == want.panel.numpy().tobytes()
    # negative control: the whole matrix (not causal) differs from the causal entries' moments
    assert reducer.reduce(s).moments.numpy().tobytes() != got[0][0].numpy().tobytes()


def test_the_probes_list_takes_the_loop_and_the_ops_bits(monkeypatch):
    xs = [x for x in _tensors() if x.numel()]
    direct = reduction.many(xs)  # the direct lane: the loop, no dispatch
    with torch.no_grad():
        op = torch.ops.tinylm.summaries(xs, reduction.NUMBA)
    assert torch.equal(direct.nan_to_num(), op.nan_to_num()) and direct.dtype == torch.float64
    calls = []
    monkeypatch.setattr(numba_reducer, "summary", lambda *a, **k: calls.append(1))
    reduction.many(xs)
    assert calls == []  # none reduced one call per tensor


def test_the_cold_start_check_covers_the_batch_loop(monkeypatch):
    k = numba_reducer._build()
    assert numba_reducer._cached(k) or not hasattr(k.many_at, "_cache")
    for name, expect in (("many_at", False), ("segment", True)):  # segment: no entry point (control)
        fn = getattr(k, name)
        monkeypatch.setattr(fn._cache._cache_file, "_index_path", "/nonexistent/index")
        assert numba_reducer._cached(k) is expect
        monkeypatch.undo()
