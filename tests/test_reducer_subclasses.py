"""reduce never reads memory a tensor does not have: subclasses, DTensor, sparse, meta, FakeTensor,
non-contiguous and empty tensors through every reducer choice give the reference's numbers or
"not measured" (a Reduction with measured False that counts no entries), never an error or a crash.

The choices: ``auto`` (the numba reducer on the CPU), ``compiled`` (dynamo traced with the
"eager" backend, as the compiled reducer's default-run tests do) and ``reference``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from diagnostics.measure import compiled, numba_reducer, reference
from diagnostics.measure.reducer import Reducer, plain, reduce
from diagnostics.measure.reference import FIELDS

CHOICES = ["auto", "compiled", "reference"]


class Tagged(torch.Tensor):
    """A trivial subclass: only ``__torch_function__``, the memory is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(params=CHOICES)
def choice(request, monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", request.param)
    if request.param == "compiled":
        monkeypatch.setattr(compiled, "_compiled", {})
        monkeypatch.setattr(compiled, "_failed", False)
        monkeypatch.setattr(compiled, "BACKEND", "eager")
        torch._dynamo.reset()
    yield request.param
    if request.param == "compiled":
        torch._dynamo.reset()


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Counts and max |x| identical, mean and M2 to float64 rounding (the reducers' contract)."""
    g, w = got.tolist(), want.tolist()
    for name, a, b in zip(FIELDS, g, w):
        if name in ("mean", "m2"):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12), name
        else:
            assert a == b, name


def _not_measured(r) -> None:
    assert r.measured is False
    assert r.moments.tolist() == [0.0] * len(FIELDS)


def test_subclass_is_read_through_a_plain_view(choice):
    x = _x(6, 8)
    t = x.clone().as_subclass(Tagged)
    assert type(plain(t)) is torch.Tensor and plain(t).data_ptr() == t.data_ptr()
    r = reduce(t, rows=True)
    assert r.measured
    _same(r.moments, reference.moments(x))
    assert torch.allclose(r.row_ms, reference.row_mean_squares(x), rtol=1e-6)
    p = torch.softmax(_x(2, 5, 5), -1).as_subclass(Tagged)
    rp = reduce(p, causal=True, probs=True)
    assert rp.measured and rp.panel[0] == 10.0


def test_non_contiguous_and_empty(choice):
    x = _x(8, 6)
    _same(reduce(x.t()).moments, reference.moments(x))
    _same(reduce(x[:, ::2]).moments, reference.moments(x[:, ::2].contiguous()))
    _same(reduce(x.expand(3, 8, 6)).moments, reference.moments(x.expand(3, 8, 6).contiguous()))
    for empty in (torch.empty(0), torch.empty(3, 0), torch.empty(0, 4)[:, ::2]):
        r = reduce(empty)
        assert r.measured and r.moments.tolist() == [0.0] * len(FIELDS)


def test_meta_and_fake_are_not_measured(choice):
    from torch._subclasses.fake_tensor import FakeTensorMode
    meta = torch.empty(4, 5, device="meta")
    _not_measured(reduce(meta))
    r = reduce(meta, rows=True)
    _not_measured(r)
    assert r.row_ms.shape == (4,) and torch.isnan(r.row_ms).all()
    with FakeTensorMode():
        fake = torch.empty(4, 4)
    _not_measured(reduce(fake))
    rp = reduce(fake, causal=True, probs=True)
    _not_measured(rp)
    assert rp.panel[0] == 0.0 and rp.panel[3] == math.inf  # an empty panel: merging it changes nothing
    _not_measured(Reducer()(meta))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the compiled reducer does not fail on it (and turn off)
def test_functorch_wrapper_is_read_by_torch_ops(choice):
    """Inside ``torch.func.grad`` a tensor has no storage of its own: torch ops reduce it (the
    numba reducer never gets its pointer), and the Reducer does not key it by one."""
    x = _x(5, 3)
    seen = []

    def loss(w):
        seen.append(reduce(w).moments.tolist() == reduce(w.detach()).moments.tolist())
        Reducer()(w)
        return (w * w).sum()
    assert torch.allclose(torch.func.grad(loss)(x), 2 * x)
    assert len(seen) == 1


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_counts_its_implicit_zeros(choice):
    dense = _x(6, 7) * (torch.rand(6, 7, generator=torch.Generator().manual_seed(1)) < 0.3)
    want = reference.moments(dense)
    _same(reduce(dense.to_sparse()).moments, want)
    _same(reduce(dense.to_sparse_csr()).moments, want)
    # uncoalesced COO: a duplicated index holds the sum of its entries
    i = torch.tensor([[0, 0, 2], [1, 1, 3]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([1.5, 2.0, -4.0]), (3, 5), check_invariants=True)
    _same(reduce(coo).moments, reference.moments(coo.to_dense()))
    _not_measured(reduce(dense.to_sparse(), rows=True))  # per-row parts: not from a sparse tensor


def test_numba_refuses_memory_it_cannot_read():
    """The numba reducer's own entry points refuse (TypeError), before any pointer is handed over."""
    for bad in (torch.empty(3, 4, device="meta"), _x(3, 4).to_sparse(), _x(3, 4).as_subclass(Tagged)):
        assert not numba_reducer.takes(bad)
        with pytest.raises(TypeError):
            numba_reducer.summary(bad)
    assert not compiled.takes(torch.empty(3, 4, device="meta"))


@pytest.fixture(scope="module")
def one_rank():
    """A gloo group of one process (this one), destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_through_its_shards(choice, one_rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    x = _x(8, 6)
    for placement in (Shard(0), Shard(1), Replicate()):
        d = distribute_tensor(x, one_rank, [placement])
        r = reduce(d)
        assert r.measured
        _same(r.moments, reference.moments(x))
        _same(Reducer()(d).moments, reference.moments(x))
        _not_measured(reduce(d, rows=True))  # rows of a sharded tensor: not from one shard
    p = torch.nn.Parameter(distribute_tensor(x, one_rank, [Shard(0)]))
    _same(reduce(p).moments, reference.moments(x))
