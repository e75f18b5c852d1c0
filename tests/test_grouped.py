"""The CUDA structure of ``tinylm::summaries``: a list of tensors reduced by one compiled call per
distinct dtype and size (diagnostics.measure.grouped), against the reference.

Contract, as for the per-tensor compiled reducer (tests/test_compiled_reducer.py): counts and
max |x| identical; mean and M2 to float64 rounding. The
formulas run uncompiled in the property (the numbers torch.compile must reproduce), traced by
dynamo (``backend="eager"``: whole graphs, no code generation) where compilation itself is the
point, and compiled by inductor only under ``-m slow``.
"""

from __future__ import annotations

import math
import shutil
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compiled_reducer import _SPECIAL, U64
from torch._dynamo.utils import counters

from diagnostics.measure import compiled, grouped, reduction, reference

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_EXACT = [0, 1, 4, 5, 6, 7, 8, 9]  # all FIELDS but mean and M2


def _check(got, xs):
    """Row i of ``got`` holds the reference's counts and max |x| of xs[i] exactly, and its mean
    and M2 within what the shifted float64 sums round (tests/test_compiled_reducer.py derives
    the bound: (n + 4) u sum d^2 with d = x - K) plus the rounding of this check's own oracle
    (fsum, correctly rounded sums: its mean is off by at most u |mean|, its M2 by n (u mean)^2)."""
    assert got.shape == (len(xs), 10) and got.dtype == torch.float64
    for row, x in zip(got.tolist(), xs):
        want = reference.moments(x).tolist()
        assert [row[i] for i in _EXACT] == [want[i] for i in _EXACT], (x.dtype, tuple(x.shape))
        f = [v for v in x.double().reshape(-1).tolist() if math.isfinite(v)]
        if not f:
            assert row[2:4] == [0.0, 0.0]
            continue
        first = x.double().reshape(-1)[0].item()
        K, n = (first if math.isfinite(first) else 0.0), len(f)
        mean = math.fsum(f) / n
        m2 = math.fsum((v - mean) ** 2 for v in f)
        sum_d2, sum_d = math.fsum((v - K) ** 2 for v in f), math.fsum(abs(v - K) for v in f)
        assert abs(row[2] - mean) <= (n + 4) * U64 * sum_d / n + 2 * U64 * abs(mean), (row[2], mean)
        assert abs(row[3] - m2) <= (n + 4) * U64 * sum_d2 + 4 * n * (U64 * mean) ** 2 + 1e-300, (row[3], m2)


@pytest.fixture
def uncompiled(monkeypatch):
    """The compiled calls run the formulas as plain torch, counted."""
    calls = []

    def call(fn, *args):
        calls.append(args[0].shape)
        return fn(*args)
    monkeypatch.setattr(compiled, "call", call)  # the per-tensor reducer's way in
    monkeypatch.setattr(compiled, "_function", lambda fn: lambda *args: call(fn, *args))  # the grouped one's
    return calls


@pytest.fixture
def traced(monkeypatch):
    """A compiled path with nothing built, dynamo tracing with the "eager" backend (no code
    generation), restored afterwards."""
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    torch._dynamo.reset()
    yield monkeypatch
    torch._dynamo.reset()


def _tensor(draw, n_max=3000):
    dtype = draw(st.sampled_from(_DTYPES))
    n = draw(st.integers(0, n_max))
    shape = draw(st.sampled_from([(n,), (1, n), (n, 1)] + ([()] if n == 1 else [])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]))
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale + draw(st.sampled_from([0.0, 1.0, -1e3]))
    specials = draw(st.lists(st.sampled_from(_SPECIAL), max_size=4)) if n else []
    if specials:
        x[torch.randint(0, n, (len(specials),), generator=g)] = torch.tensor(specials, dtype=torch.float64)
    x = x.to(dtype).reshape(shape)
    if draw(st.booleans()) and n > 1:  # non-contiguous: every other entry of a larger buffer
        x = torch.stack([x, x], -1)[..., 0]
    return x


@st.composite
def _lists(draw):
    xs = [_tensor(draw) for _ in range(draw(st.integers(1, 8)))]
    again = draw(st.lists(st.tuples(st.integers(0, len(xs) - 1), st.booleans()), max_size=5))
    return xs + [xs[i].clone() * 2 if same else xs[i].reshape(1, -1) * 3 for i, same in again]  # groups, shapes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(xs=_lists(), bound=st.sampled_from([grouped.BOUND, 64, 4096]))
def test_every_tensors_moments_in_the_lists_order(uncompiled, xs, bound):
    """Property: whatever the list (dtypes mixed, empty, non-contiguous, non-finite, subnormal,
    huge, repeated sizes; chunked by a small byte bound), row i is the reference's summary of
    xs[i], from one call per chunk of the plan (none for empty tensors)."""
    uncompiled.clear()  # the fixture's count, shared by the examples
    got = grouped.moments(xs, bound)
    _check(got, xs)
    chunks = grouped.plan(xs, bound)
    assert len(uncompiled) == sum(1 for _, n, _ in chunks if n)
    for dtype, n, idx in chunks:  # each chunk one dtype and size, within the bound unless alone
        assert {(xs[i].dtype, xs[i].numel()) for i in idx} == {(dtype, n)}
        assert len(idx) * n * dtype.itemsize <= bound or len(idx) == 1 or n == 0


def test_rows_come_back_in_the_lists_order_with_mixed_dtypes(uncompiled):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, generator=g).to(d) * (i + 1) + i for i, d in enumerate(_DTYPES * 3)]
    xs.insert(3, torch.randn(5, 7, generator=g).t())
    got = grouped.moments(xs)
    _check(got, xs)
    assert len(uncompiled) == 5  # four dtypes of 8 entries, one of 35
    # negative control: the groups' rows as the plan concatenates them are not the list's order
    plain = torch.cat([grouped.rows(torch.stack([xs[i].reshape(-1) for i in idx])[:, None, :])
                       for _, _, idx in grouped.plan(xs)])
    assert not torch.equal(plain[:, 2], got[:, 2])
    assert torch.equal(plain[:, 2].sort().values, got[:, 2].sort().values)


def test_layout_spreads_a_large_tensor_over_rows():
    assert grouped.shape_of(10) == (1, 10)
    assert grouped.shape_of(1280000) == (1250, 1024)
    assert grouped.shape_of(7 * 1031) == (1031, 7)  # the largest divisor at most WIDTH
    assert grouped.shape_of(0) == (1, 1)


def test_the_op_takes_the_grouped_path_and_each_stays_one_by_one(uncompiled, monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 64, generator=g) for _ in range(20)] + [torch.randn(64, generator=g) for _ in range(20)]
    got = reduction.many(xs)
    assert len(uncompiled) == 2
    _check(got, xs)
    one_by_one = reduction.each(xs, reduction.CUDA)
    assert len(uncompiled) == 2 + len(xs)  # control: the per-tensor loop makes a call per tensor
    _check(one_by_one, xs)


def test_fake_kernel_is_unchanged():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xs = [torch.empty(3, 4), torch.empty(7, dtype=torch.bfloat16)]
        out = torch.ops.tinylm.summaries(xs, reduction.CUDA)
    assert out.shape == (2, 10) and out.dtype == torch.float64


def test_traced_whole_once_and_never_per_size(traced):
    """dynamo captures :func:`grouped.rows` as one graph (of a dtype: the slow test takes all
    four) whose sizes are all symbolic, 1 included: new groups, a group of one, a row of one and
    one-entry tensors reuse it. A negative control: the same function compiled with
    ``dynamic=True`` alone makes a new graph for a group of one (dynamo specialises 0 and 1)."""
    g = torch.Generator().manual_seed(2)
    sizes = [[(64, 64)] * 3, [(8192,)] * 5, [(77,)], [(1,)] * 2, [(1,)], [(3000,)] * 2, [(1, 5)], [(5, 1)],
             [(3, 7), (7, 3)]]
    before = counters["stats"]["unique_graphs"]
    for shapes in sizes:
        xs = [torch.randn(*s, generator=g) for s in shapes]
        for x in (xs, [torch.stack([x, x], -1)[..., 0] for x in xs]):  # and each non-contiguous
            _check(grouped.moments(x), x)
    assert counters["stats"]["unique_graphs"] - before == 1 and not compiled._failed
    torch._dynamo.reset()  # dynamo's caches emptied: the next build is marked again
    before = counters["stats"]["unique_graphs"]
    for shapes in ([(64, 64)] * 3, [(77,)], [(1, 5)]):
        grouped.moments([torch.randn(*s, generator=g) for s in shapes])
    assert counters["stats"]["unique_graphs"] - before == 1
    control = torch.compile(lambda x: grouped.rows(x), backend="eager", dynamic=True, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for shape in [(3, 4, 64), (5, 2, 32), (1, 4, 64)]:
        control(torch.randn(*shape, generator=g))
    assert counters["stats"]["unique_graphs"] - before == 2


def test_a_failed_build_falls_back_to_one_call_per_tensor_with_one_warning(uncompiled, monkeypatch):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(compiled, "_function", broken)  # what a backend's failure raises; compiled.call runs
    monkeypatch.setattr(grouped, "_failed", False)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    xs = [torch.randn(6, 5, generator=torch.Generator().manual_seed(3)), torch.zeros(0), torch.randn(7)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = [torch.ops.tinylm.summaries(xs, reduction.CUDA) for _ in range(2)]
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "torch.compile could not build the grouped reduction of many tensors"]
    assert "no compiler here" in str(caught[0].message)
    assert len(uncompiled) == 4 and grouped._failed  # twice the two non-empty tensors, one by one
    for out in got:
        _check(out, xs)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None, reason="no C++ compiler")
def test_inductor_compiles_once_per_dtype(monkeypatch):
    """Compiled by inductor (whose strides add guards of their own): one graph per dtype for
    every size, the reference's numbers."""
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    before = counters["stats"]["unique_graphs"]
    for dtype in _DTYPES:
        for shapes in [[(64, 64)] * 3, [(1,)], [(5000,)], [(2, 1)] * 4, [(1280000,)]]:
            xs = [torch.randn(*s, generator=g).to(dtype) for s in shapes]
            xs[0].view(-1)[0] = math.inf
            _check(grouped.moments(xs), xs)
    assert counters["stats"]["unique_graphs"] - before == len(_DTYPES) and not compiled._failed
    torch._dynamo.reset()
