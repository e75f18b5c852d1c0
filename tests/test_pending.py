"""The probe's deferred queue: plain requests reduced together give today's numbers bit for bit
(tinylm and a Hugging Face GPT-2, forward and backward, one pass and two), are flushed before
anything reads the stores, never measure a tensor changed in place, and keep within their bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tinylm
from diagnostics import ProbeOptions, probe
from diagnostics.measure import pending as pending_module
from diagnostics.measure.moments import Moments
from diagnostics.measure.pending import Pending
from diagnostics.measure.probe import _IN_PLACE, ProbeRun
from diagnostics.measure.reducer import _merge_torch, merge_np, merge_vectors

CFG = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=2, num_heads=2, d_ff=64)


def _tokens(seed, b=3, t=9, vocab=64):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _tinylm():
    return tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=2, n_head=2,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg)
    model.train(False)
    return model


def _step(model, x):
    out = model(x[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    tinylm.functional.cross_entropy(logits, x[:, 1:]).backward()


def _run(model, queued: bool, passes: int, options=None, monkeypatch=None):
    """(run, stats) of ``passes`` probed passes, the queue on or every request reduced at once."""
    if not queued:
        monkeypatch.setattr(ProbeRun, "_plain", lambda self, kind, t, key: False)
    with probe(model, options) as run:
        for p in range(passes):
            _step(model, _tokens(p))
    model.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return run, run.stats


def _bits(stats) -> dict:
    """Every figure of a ProbeStats, as bytes (the same bits or not)."""
    parts = {("t",) + k: m.vector() for k, m in stats.tensors.items()}
    for name, store in (("cos", stats.cosine), ("inv", stats.inv_ms), ("nb", stats.norm_back),
                        ("attn", stats.attention)):
        parts.update({(name, k): list(m.__dict__.values()) if not hasattr(m, "vector") else m.vector()
                      for k, m in store.items()})
    parts.update({("flat", k): v for k, v in stats.flat.items()})
    return {k: np.asarray(v, dtype=np.float64).tobytes() for k, v in parts.items()}


@pytest.mark.parametrize("make", [_tinylm, _gpt2], ids=["tinylm", "gpt2"])
@pytest.mark.parametrize("passes", [1, 2])
def test_the_queue_gives_the_numbers_of_one_reduction_per_hook(make, passes, monkeypatch):
    """A whole probed pass (and two in one probe: the merges keep each site's order), forward and
    backward: the same bits with the queue as with every request reduced in its hook, and the
    queue took most of them. Negative control: a different batch changes the figures."""
    model = make()
    run, queued = _run(model, True, passes, monkeypatch=monkeypatch)
    _, now = _run(model, False, passes, monkeypatch=monkeypatch)
    assert run.queue.flushes >= 1 and run.queue.stale == 0
    assert {d for _, d in queued.tensors} == {"forward", "backward"}
    assert _bits(queued) == _bits(now)
    with probe(model) as other:
        _step(model, _tokens(7))
    model.zero_grad(set_to_none=True)
    assert _bits(other.stats) != _bits(now)


def test_the_stores_are_flushed_before_they_are_read(monkeypatch):
    """The forward's tensors wait until the first gradient, the gradients until a read: ``stats``
    and ``vectors()`` inside the probe see every pass so far, and the pass after them merges in
    order: the same bits as no queue. Negative control: the raw store before a flush lacks the
    queued sites."""
    model, x = _tinylm(), _tokens(0)
    fwd, bwd = ("layers.0.attn.q_proj", "forward"), ("layers.0.attn.q_proj", "backward")
    with probe(model) as run:
        loss = tinylm.functional.cross_entropy(model(x[:, :-1]), x[:, 1:])
        assert fwd in run.queue and fwd not in run._vec  # waiting for the forward's end
        loss.backward()
        assert fwd in run._vec and bwd in run.queue and bwd not in run._vec
        first = run.stats.tensors[bwd]
        vec, _ = run.vectors()
        assert len(run.queue) == 0 and Moments(*vec[bwd].tolist()) == first and first.count > 0
        _step(model, _tokens(1))
    model.zero_grad(set_to_none=True)
    _, now = _run(model, False, 2, monkeypatch=monkeypatch)
    assert _bits(run.stats) == _bits(now)
    assert first.count < run.stats.tensors[bwd].count


class _InPlace(nn.Module):
    """A linear layer whose output the next module doubles in place (an in-place hazard for a queue)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.lin2 = nn.Linear(6, 3)

    def forward(self, x):
        h = self.lin(x)
        h.mul_(2.0)  # after lin's hook saw h
        return self.lin2(h)


def test_a_tensor_changed_in_place_while_queued_is_not_measured(monkeypatch):
    """The layer's output is doubled in place after its hook: the queue must not read the doubled
    values. It is "not measured" (no entries) and counted in ``run.queue.stale``; measured at once it
    is the true figure. Negative control: a queue that skips the version check reports the
    doubled tensor's variance, 4x the true one."""
    torch.manual_seed(0)
    model, x = _InPlace(), torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    opts = ProbeOptions(modules=("lin",), backward=False, params=False)
    with probe(model, opts) as run:
        model(x)
    got = run.stats.tensors[("lin", "forward")]
    assert run.queue.stale == 1 and got.count == 0
    # the model's next probe reduces that site in its hook: measured, the true figure
    with probe(model, opts) as again:
        model(x)
    later = again.stats.tensors[("lin", "forward")]
    assert again.queue.stale == 0 and later.count == 30
    _IN_PLACE.pop(model)  # forget it: the controls below queue the site again
    monkeypatch.setattr(ProbeRun, "_plain", lambda self, kind, t, key: False)
    with probe(model, opts) as now:
        model(x)
    true = now.stats.tensors[("lin", "forward")]
    assert true.count == 30 and now.queue.stale == 0 and later.var == true.var
    _IN_PLACE.pop(model, None)
    monkeypatch.undo()
    real = pending_module._reduced
    monkeypatch.setattr(pending_module, "_reduced", lambda xs, versions, loop: real(xs, [x._version for x in xs], loop))
    with probe(model, opts) as blind:
        model(x)
    wrong = blind.stats.tensors[("lin", "forward")]
    assert wrong.count == 30 and wrong.var == pytest.approx(4 * true.var, rel=1e-12)


def test_the_bounds_flush_early_and_change_no_figure(monkeypatch):
    """Past ``max_bytes`` (or ``max_count``) ``add`` asks for a flush; a probe with a small byte
    bound flushes many times, never holds more than the bound and one tensor, and gives the same
    bits. Negative control: under the bound, ``add`` asks for nothing."""
    q = Pending(max_count=3, max_bytes=10_000)
    xs = [torch.randn(500) for _ in range(3)]  # 2000 bytes each
    assert [q.add(i, x) for i, x in enumerate(xs)] == [False, False, True]  # the count
    q.flush({})
    q = Pending(max_bytes=3000)
    assert [q.add(0, xs[0]), q.add(1, xs[0]), q.add(2, xs[1])] == [False, False, True]  # one tensor read once
    model = _tinylm()
    held = []
    real_add = Pending.add

    def add(self, key, x):
        over = real_add(self, key, x)
        held.append(self.nbytes)
        return over
    monkeypatch.setattr(Pending.__init__, "__defaults__", (pending_module.MAX_COUNT, 16 << 10))
    monkeypatch.setattr(Pending, "add", add)
    with probe(model) as run:
        _step(model, _tokens(0))
    model.zero_grad(set_to_none=True)
    small = run.stats
    monkeypatch.undo()
    largest = max(t.numel() * 4 for t in (torch.empty(3, 8, CFG.d_ff),))
    assert run.queue.flushes > 5 and max(held) <= (16 << 10) + largest
    _, now = _run(model, False, 1, monkeypatch=monkeypatch)
    assert _bits(small) == _bits(now)


def test_a_tensor_queued_twice_is_read_once():
    """A branch is its last projection's output: queued for both names, read once, the same
    vector for both. Negative control: two different tensors are two reads."""
    q = Pending()
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    for key, x in (("a", a), ("a2", a), ("b", b)):
        q.add(key, x)
    assert len(q._xs) == 2 and len(q) == 3
    store: dict = {}
    q.flush(store)
    assert torch.equal(store["a"], store["a2"]) and not torch.equal(store["a"], store["b"])


def test_rows_merge_as_one_merge_each():
    """merge_np on rows: each row bit for bit merge_vectors of that pair, and the torch formula's
    (the merge on other devices), counts of zero included. Negative control: the pairs merged
    the other way round differ in the mean's last bits."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(6, 10, generator=g, dtype=torch.float64) * 100
    b = torch.rand(6, 10, generator=g, dtype=torch.float64) * 3
    a[:, 1] = torch.tensor([5.0, 0.0, 7.0, 1e6, 3.0, 0.0])
    b[:, 1] = torch.tensor([2.0, 4.0, 0.0, 1.0, 1e7, 0.0])
    got = merge_np(a.numpy(), b.numpy())
    want = np.stack([merge_vectors(x, y).numpy() for x, y in zip(a, b)])
    assert got.tobytes() == want.tobytes()
    torch_rule = np.stack([_merge_torch(x, y, 1, 4, True).numpy() for x, y in zip(a, b)])
    assert got.tobytes() == torch_rule.tobytes()
    flipped = np.stack([merge_vectors(y, x).numpy() for x, y in zip(a, b)])
    assert got.tobytes() != flipped.tobytes()


def test_a_vector_reduced_at_once_merges_in_its_turn():
    """A key with entries waiting that gets a vector reduced at once (``ready``) merges it after
    them, as the hooks would have: merge(moments(x), v) then merge with moments(y). Negative
    control: merged first, the result differs in its last bits."""
    from diagnostics.measure.reducer import reduce

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, generator=g) + 3.0, torch.randn(50, generator=g) * 0.1 - 1.0
    v = reduce(torch.randn(70, generator=g) * 5.0).moments
    q = Pending()
    q.add("k", x)
    q.ready("k", v)
    q.add("k", y)
    store: dict = {}
    q.flush(store)
    want = merge_vectors(merge_vectors(reduce(x).moments, v), reduce(y).moments)
    assert store["k"].numpy().tobytes() == want.numpy().tobytes()
    other = merge_vectors(merge_vectors(v, reduce(x).moments), reduce(y).moments)
    assert store["k"].numpy().tobytes() != other.numpy().tobytes()
