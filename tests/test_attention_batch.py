"""A pass's tinylm attention layers measured together (diagnostics.measure.attention_observer).

Contract: the queue changes when and how often the attention statistics are computed, never
what they are. ``statistics_many`` gives each item the bits ``statistics`` gives it alone (any
dtype, items of one or several chunks, forward alone or with the gradient); a probe records the
same bits in the same order whether its queue measures a pass's layers in one flush or each
layer at once; a flush comes when the backward's last attention gradient has come (one op,
``tinylm::attention_summaries``, for all the layers where the ops are observed); a layer whose
tensor changed in place while queued is not measured (no figure, never a wrong one). Each check
has a negative control that shows it rejects a specific wrong answer.
"""

from __future__ import annotations

import pytest
import torch

import tinylm
from diagnostics import probe
from diagnostics.measure import attention
from diagnostics.measure.opcount import OpCount
from tinylm import functional as TF

CFG = tinylm.ModelConfig(vocab_size=64, context_length=32, d_model=32, num_layers=4, num_heads=4, d_ff=48)


def _items(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=g).to(dtype) for _ in range(4)) for shape in shapes]


def _same(a: list[dict], b: list[dict]) -> bool:
    """Every vector of every item bit for bit equal (NaN equal to NaN), None where the other's is."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for key in x:
            if (x[key] is None) != (y[key] is None):
                return False
            if x[key] is not None and not torch.equal(x[key].nan_to_num(7.0), y[key].nan_to_num(7.0)):
                return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16,
                                   pytest.param(torch.float64, marks=pytest.mark.slow)])  # float64: compiled reductions
@pytest.mark.parametrize("shapes", [
    [(4, 4, 32, 16)] * 6,  # launch-bound layers: several joined into one group
    [(2, 3, 20, 8), (1, 3, 20, 8), (3, 2, 20, 8)],  # items of different sizes
    [(2, 12, 128, 8)] * 2,  # two chunks per item (12 matrices of 128^2 each), each group alone
    [(4, 4, 64, 8)] * 3,  # T 64: groups of 32 matrices, two items each
])
def test_layers_measured_together_equal_each_alone(dtype, shapes):
    items = _items(shapes, dtype)
    assert _same(attention.statistics_many(items), [attention.statistics(*it) for it in items])
    fwd = [(q, k, None, None) for q, k, _, _ in items]
    assert _same(attention.statistics_many(fwd, panel=False), [attention.statistics(*it, panel=False) for it in fwd])


def test_negative_control_the_comparison_rejects_another_layers_figures():
    """The same check rejects each item given its neighbour's figures, and the statistics of the
    joined matrices reduced as one tensor (the layers' entries pooled)."""
    items = _items([(4, 4, 32, 16)] * 3, torch.float32)
    many, alone = attention.statistics_many(items), [attention.statistics(*it) for it in items]
    assert not _same(many[1:] + many[:1], alone)
    joined = tuple(torch.cat([it[j] for it in items]) for j in range(4))
    pooled = attention.statistics(*joined)
    assert not _same([pooled], [alone[0]])


def _probed(model, tok, *, at_once=False, grad=True, change=None):
    with probe(model) as run:
        if at_once:  # every entry past the bound: measured as it comes, one layer at a time
            run.attention_queue.max_bytes = -1
        handle = model.layers[0].attn.register_observer(change) if change is not None else None
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                if grad:
                    TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()
                    assert len(run.attention_queue) == 0 and run.attention_queue.waiting == 0
                else:
                    model(tok[:, :-1])
        finally:
            if handle is not None:
                handle.remove()
    model.zero_grad(set_to_none=True)
    return run


def _figures(run):
    s = run.stats
    return list(s.tensors), {k: m.vector() for k, m in s.tensors.items()}, {k: vars(a) for k, a in s.attention.items()}


@pytest.fixture(scope="module")
def model_and_tokens():
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 64, (3, 33), generator=torch.Generator().manual_seed(1))
    return model, tok


@pytest.mark.parametrize("grad", [True, False])
def test_a_probe_records_the_same_bits_whether_layers_wait_or_not(model_and_tokens, grad):
    """One flush for the pass (at the backward's last attention gradient, or on exit without a
    backward) against one per layer: the same records, in the same order, bit for bit."""
    model, tok = model_and_tokens
    together, alone = _probed(model, tok, grad=grad), _probed(model, tok, grad=grad, at_once=True)
    assert together.attention_queue.flushes == 1
    assert alone.attention_queue.flushes == CFG.num_layers
    assert _figures(together) == _figures(alone)
    other = tok.clone()
    other[0, 5] = (other[0, 5] + 1) % 64  # negative control: one token changed changes the figures
    assert _figures(_probed(model, other, grad=grad))[1:] != _figures(together)[1:]


def test_one_op_for_the_layers_of_a_pass(model_and_tokens):
    """Where the ops are observed (a dispatch mode: the op's path), a pass dispatches one
    ``attention_summaries`` for all its layers; measured one layer at a time, one
    ``attention_summary`` each (the negative control: the counter sees the difference)."""
    model, tok = model_and_tokens
    _probed(model, tok)  # a first pass builds what it builds outside the count
    with OpCount() as together:
        _probed(model, tok)
    with OpCount() as alone:
        _probed(model, tok, at_once=True)
    assert together.counts.get("attention_summaries.default") == 1
    assert "attention_summary.default" not in together.counts
    assert alone.counts.get("attention_summary.default") == CFG.num_layers
    assert together.total < alone.total


def test_a_layer_changed_in_place_while_queued_is_not_measured(model_and_tokens):
    """Layer 0's k written over after the probe's observer queued it: that layer's figures of the
    pass are "not measured" (count 0), never those of the new values; the other layers' are
    unchanged; a later pass of the same probe measures that layer at once. The negative control:
    the same observer that leaves k alone loses nothing."""
    model, tok = model_and_tokens
    clean = _probed(model, tok, grad=False).stats

    def scale(q, k, v, heads, weights):
        k.mul_(2.0)

    def nothing(q, k, v, heads, weights):
        return None

    changed = _probed(model, tok, grad=False, change=scale)
    got = changed.stats
    assert changed.attention_queue.stale == 1
    assert got.tensors[("layers.0.attn.scores", "forward")].count == 0
    assert got.tensors[("layers.1.attn.scores", "forward")].vector() == \
        clean.tensors[("layers.1.attn.scores", "forward")].vector()
    kept = _probed(model, tok, grad=False, change=nothing)
    assert kept.attention_queue.stale == 0
    assert kept.stats.tensors[("layers.0.attn.scores", "forward")].vector() == \
        clean.tensors[("layers.0.attn.scores", "forward")].vector()
    with probe(model) as run:  # two passes read in between: the first loses layer 0, the second measures it at once
        handle = model.layers[0].attn.register_observer(scale)
        with torch.no_grad():
            model(tok[:, :-1])
            assert run.stats.tensors[("layers.0.attn.scores", "forward")].count == 0
            model(tok[:, :-1])
        handle.remove()
    assert run.attention_queue.stale == 1
    assert run.stats.tensors[("layers.0.attn.scores", "forward")].vector() == \
        clean.tensors[("layers.0.attn.scores", "forward")].vector()


@pytest.fixture
def cuda_structure(monkeypatch):
    """The CUDA structure on the CPU, dynamo's captured graphs run as they are (no code generation)."""
    from diagnostics.measure import compiled
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")
    yield monkeypatch
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_cuda_structure_reduces_a_groups_layers_in_one_compiled_call_per_buffer(cuda_structure):
    """Under ``TINYLM_REDUCER=cuda`` the joined layers' four causal buffers take one compiled call
    each, not one per layer (the negative control: one layer at a time, four per layer), with
    the per-layer figures: counts, max |x| and the panel's row counts equal, mean, M2 and the
    entropies to float64 rounding."""
    from diagnostics.measure import compiled
    items = _items([(2, 4, 16, 8)] * 5, torch.float32)
    calls: list[str] = []
    real = compiled.call

    def counting(fn, *args):
        calls.append(fn.__name__)
        return real(fn, *args)
    cuda_structure.setattr(compiled, "call", counting)
    many = attention.statistics_many(items)
    together, calls[:] = len(calls), []
    alone = [attention.statistics(*it) for it in items]
    assert together == 4 and len(calls) == 4 * len(items)
    exact = {"panel": [0, 3, 4, 5]}
    for a, b in zip(many, alone):
        for key, vec in a.items():
            keep = exact.get(key, [0, 1, 4, 5, 6, 7, 8, 9])
            assert torch.equal(vec[keep], b[key][keep]), key
            assert torch.allclose(vec, b[key], rtol=1e-12, atol=0.0), key
