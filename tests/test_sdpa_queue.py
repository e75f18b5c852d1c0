"""The SDPA calls of a pass measured together (diagnostics/measure/sdpa_queue.py): each call's
figures are those it gets measured in the call, bit for bit; one op for a group where there
were one per call; a call whose q changed in place before the flush is not measured; mixed
shapes make their own groups.

Negative controls: with the queue off a pass dispatches one ``sdpa_summary`` per call (the
count is what changed); a q scaled by 1 + 2^-20 changes the figures the comparison reads; a call
measured without its in-place change is reported."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diagnostics import ProbeOptions, probe
from diagnostics.measure import sdpa
from diagnostics.measure.opcount import OpCount
from diagnostics.measure.sdpa_queue import SDPAQueue

transformers = pytest.importorskip("transformers")


def _gpt2(layers: int = 3) -> nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _pass(model: nn.Module, options: ProbeOptions | None = None, counter: OpCount | None = None):
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with probe(model, options or ProbeOptions(signals=True)) as run:
        out = model(ids[:, :-1]).logits
        F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return run


def _figures(run) -> dict:
    stats = run.stats
    out = {k: m for k, m in stats.tensors.items() if k[0].endswith(".scores")}
    out.update({k: a for k, a in stats.attention.items()})
    out.update({("max", k): v.tolist() for k, v in run.signals._max.items()})
    out.update({("ceiling", k): [float(x) for x in v] for k, v in run.signals._ceiling.items()})
    return out


def _queue_off(monkeypatch):
    monkeypatch.setattr(SDPAQueue, "takes", staticmethod(lambda q, k, mask: False))


def test_a_pass_measures_each_call_as_alone_with_one_op_for_the_layers(monkeypatch):
    model = _gpt2()
    with OpCount() as ops:
        queued = _figures(_pass(model))
    assert ops.counts["sdpa_summaries.default"] == 1 and ops.counts["sdpa_summary.default"] == 0
    assert sum(1 for k in queued if isinstance(k, tuple) and k[0].endswith(".scores")) == 3
    fast = _figures(_pass(model))  # without an op counter: the direct lane
    with monkeypatch.context() as m:
        _queue_off(m)
        with OpCount() as each:
            alone = _figures(_pass(model))
        alone_fast = _figures(_pass(model))
    assert each.counts["sdpa_summary.default"] == 3 and each.counts["sdpa_summaries.default"] == 0
    assert queued == alone and fast == alone_fast
    # negative control: the comparison reads the figures (a q one part in 2^20 larger moves them)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[:, :32].mul_(1 + 2.0**-20)
    assert _figures(_pass(model)) != fast


def _calls(shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, t, 8, generator=g), torch.randn(2, 4, t, 8, generator=g)) for t in shapes]


@pytest.mark.parametrize("signal", [False, True])
def test_mixed_shapes_make_their_own_groups_and_the_bound_flushes_early(signal):
    calls = _calls([5, 9, 5, 9, 5])
    want = [sdpa.summary(q, k, None, True, None, signal) for q, k in calls]
    for max_bytes in (1 << 20, 0):
        got = []
        queue = SDPAQueue(lambda name, *figures: got.append((name, figures)), signal, max_bytes=max_bytes)
        for i, (q, k) in enumerate(calls):
            if queue.add(f"layer{i}", q, k, None, True, None):
                queue.flush()
        queue.flush()
        assert [n for n, _ in got] == [f"layer{i}" for i in range(5)]
        for (_, g), w in zip(got, want):
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g, w))


def test_a_call_changed_in_place_before_the_flush_is_not_measured():
    (q, k), (q2, k2) = _calls([6, 6], seed=3)
    got = []
    queue = SDPAQueue(lambda name, *figures: got.append(name), False)
    queue.add("a", q, k, None, True, None)
    queue.add("b", q2, k2, None, True, None)
    q2.mul_(2.0)  # after the call, before the flush: its values are not the ones attention saw
    assert queue.flush() == 1 and got == ["a"] and queue.stale == 1
    # negative control: the same calls without the change are both reported
    queue.add("a", q, k, None, True, None)
    queue.add("b", q2, k2, None, True, None)
    assert queue.flush() == 2 and got == ["a", "a", "b"]


def test_a_shared_additive_mask_groups_and_a_different_one_does_not():
    (q, k), (q2, k2), (q3, k3) = _calls([7, 7, 7], seed=5)
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    other = mask.clone()
    other[..., 0] = -math.inf
    want = [sdpa.summary(a, b, m, False, None) for (a, b), m in (((q, k), mask), ((q2, k2), mask), ((q3, k3), other))]
    got = []
    queue = SDPAQueue(lambda name, *figures: got.append(figures), False)
    for (a, b), m in (((q, k), mask), ((q2, k2), mask), ((q3, k3), other)):
        queue.add("x", a, b, m, False, None)
    with OpCount() as ops:
        queue.flush()
    assert ops.counts["sdpa_summaries.default"] == 2  # the shared mask's two calls, the other alone
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


@pytest.mark.parametrize("signal", [False, True])
def test_under_the_cuda_structure_a_group_takes_the_same_ops_for_any_number_of_calls(monkeypatch, signal):
    """What a GPU launches for a group: the kernel of ``tinylm::sdpa_summaries`` dispatches as many ops
    for 8 calls as for 1 (every figure reduced over all dimensions but the group's), and its figures
    are each call's alone to float64 rounding; negative control: the calls one by one dispatch about 8
    times the group's ops."""
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    counts, calls = [], []
    for n in (1, 3, 8):
        calls = _calls([9] * n, seed=n)
        with OpCount() as ops:
            group = sdpa._summaries_kernel([q for q, _ in calls], [k for _, k in calls], None, True, None, sdpa.ROWS,
                                           signal)
        counts.append(ops.total)
    assert counts[0] == counts[1] == counts[2], counts
    with OpCount() as each:
        alone = [sdpa._summary_kernel(q, k, None, True, None, sdpa.ROWS, signal) for q, k in calls]
    assert each.total > 7 * counts[0], (each.total, counts)
    assert all(torch.allclose(g, a, rtol=1e-12, atol=0) for g, a in zip(group.unbind(0), alone))
    monkeypatch.setenv("TINYLM_REDUCER", "auto")  # numba's loop: the same figures to float32 rounding
    numba = [sdpa._summary_kernel(q, k, None, True, None, sdpa.ROWS, signal) for q, k in calls]
    assert all(torch.allclose(g, a, rtol=1e-6, atol=1e-12) for g, a in zip(group.unbind(0), numba))  # float32 weights
