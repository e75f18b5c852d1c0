"""The numba kernel called without the op's dispatch (where nothing observes the ops) gives the
op's numbers bit for bit; the op is what an observer (a dispatch mode) and ``TINYLM_REDUCER=cuda`` see."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tinylm
from diagnostics import probe
from diagnostics.measure import reduction
from diagnostics.measure.opcount import OpCount
from diagnostics.measure.reducer import reduce
from diagnostics.measure.reducer_choice import chosen, pinned


class _Watching(TorchDispatchMode):
    """A dispatch mode that only passes every op on: what any observer of the ops looks like."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_PARTS = ("moments", "panel", "row_ms", "cosine", "inv", "below", "weighted")


def _requests():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 16, generator=g) * 3 + 1
    s = torch.randn(2, 3, 12, 12, generator=g)
    w = torch.rand(3, 8, generator=g)
    return [(x, {}), (x.bfloat16(), {}), (s, {"causal": True}), (s.softmax(-1), {"causal": True, "probs": True}),
            (x, {"rows": True, "cosine": True, "inv_eps": 1e-5, "below": -1.0, "weight": w})]


def _same(a, b) -> bool:
    return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
               for u, v in zip((getattr(a, k) for k in _PARTS), (getattr(b, k) for k in _PARTS)))


def test_direct_numba_parts_are_the_ops_bits(monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    for x, kw in _requests():
        assert reduction.lane(x)
        fast = reduce(x, **kw)
        with OpCount() as ops:  # an observer: the op is dispatched
            assert not reduction.lane(x)
            slow = reduce(x, **kw)
        assert ops.counts["summary.default"] == 1
        assert _same(fast, slow), kw


def test_negative_control_the_comparison_sees_one_ulp(monkeypatch):
    """The same comparison rejects the reduction of a tensor one entry of which moved by one ulp."""
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    x, kw = _requests()[-1]
    y = x.clone()
    y.view(-1)[5] = torch.nextafter(y.view(-1)[5], torch.tensor(float("inf")))
    assert not _same(reduce(x, **kw), reduce(y, **kw))


def test_never_direct_under_the_cuda_structure_or_a_pin(monkeypatch):
    x, _ = _requests()[0]
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    assert not reduction.lane(x) and reduction.route(x) == reduction.CUDA
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    with pinned():
        os.environ["TINYLM_REDUCER"] = "cuda"  # read once by the pin: the choice holds inside
        assert chosen() == "auto" and reduction.lane(x)
    assert chosen() == "cuda"


def _probed(model, tokens, mode=None):
    with probe(model) as run:
        if mode is None:
            tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        else:
            with mode:
                tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    s = run.stats
    return {**{k: m.vector() for k, m in s.tensors.items()}, **{k: m.vector() for k, m in s.inv_ms.items()},
            **{k: m.vector() for k, m in s.norm_back.items()}, **{k: vars(m) for k, m in s.attention.items()}}


@pytest.fixture(scope="module")
def small():
    config = tinylm.preset("tiny", num_layers=2, context_length=16, d_model=32, num_heads=4, vocab_size=128)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    return model, torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


def test_a_probed_pass_measures_the_same_bits_with_and_without_the_dispatch(small, monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    model, tokens = small
    direct = _probed(model, tokens)
    dispatched = _probed(model, tokens, _Watching())
    assert direct.keys() == dispatched.keys() and len(direct) > 40
    assert direct == dispatched


def test_negative_control_a_probed_pass_by_plain_torch_differs(small, monkeypatch):
    model, tokens = small
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    direct = _probed(model, tokens)
    monkeypatch.setenv("TINYLM_REDUCER", "reference")
    reference = _probed(model, tokens)
    assert direct.keys() == reference.keys() and direct != reference


def test_the_records_fields_are_the_vectors_layout():
    """The probe builds its records positionally from the vectors: their field order is the layout."""
    from dataclasses import fields

    from diagnostics.measure.moments import AttnMoments, Moments
    from diagnostics.measure.reference import ATTN_FIELDS, FIELDS

    assert [f.name for f in fields(Moments)] == list(FIELDS)
    assert [f.name for f in fields(AttnMoments)] == list(ATTN_FIELDS)
    assert [f.name for f in fields(Moments)] != list(reversed(FIELDS))  # negative control: order is compared


@pytest.mark.parametrize("signal", [False, True])
def test_sdpa_and_attention_summaries_are_the_ops_bits_without_the_dispatch(signal, monkeypatch):
    from diagnostics.measure import attention, sdpa

    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    q, k, v, g = (torch.randn(2, 4, 20, 8, generator=torch.Generator().manual_seed(i)) for i in range(4))
    mask = torch.rand(20, 20, generator=torch.Generator().manual_seed(5)) > 0.3
    fast = sdpa.summary(q, k, mask, False, None, signal)
    fast_attn = attention.summary(q, k, v, g)
    with OpCount() as ops:
        slow = sdpa.summary(q, k, mask, False, None, signal)
        slow_attn = attention.summary(q, k, v, g)
    assert ops.counts["sdpa_summary.default"] == 1 and ops.counts["attention_summary.default"] == 1
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(fast, slow))
    assert fast_attn.keys() == slow_attn.keys()
    assert all(torch.equal(fast_attn[key], slow_attn[key]) for key in fast_attn)
