"""What a probed pass dispatches in the launch-bound regime (a small, deep model): op counts are
deterministic, so they are held exactly where a GPU pays per op."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import probe
from diagnostics.measure import attention, compiled, reference
from diagnostics.measure.opcount import OpCount
from diagnostics.measure.reducer import reduce


def _model(d_model=64, layers=24, T=32):
    config = tinylm.preset("tiny", num_layers=layers, context_length=T, d_model=d_model, num_heads=4, vocab_size=512)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 512, (4, T + 1), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _step(model, tokens):
    tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    model.zero_grad(set_to_none=True)


def _counts(model, tokens):
    """(bare ops, probed ops (the whole ``with`` block), host reads inside forward and backward)."""
    with OpCount() as bare:
        _step(model, tokens)
    with probe(model) as run:  # what a first pass builds (nothing for the numba path) stays out of the count
        _step(model, tokens)
    run.stats  # noqa: B018
    with OpCount() as ops:
        with probe(model) as run:
            before = ops.host_reads
            _step(model, tokens)
            inside = ops.host_reads - before
        run.stats  # noqa: B018
    return bare.total, ops.total, inside


@pytest.fixture
def eager_backend(monkeypatch):
    """The CUDA structure on the CPU with dynamo's captured graphs run as they are (no code generation)."""
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setattr(compiled, "_failed", False)
    yield monkeypatch
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def launch_bound():
    return _model()


def test_probed_pass_dispatches_at_most_1_5x_the_bare_ops_and_reads_nothing_inside(launch_bound, monkeypatch):
    model, tokens = launch_bound
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    bare, probed, inside = _counts(model, tokens)
    assert probed <= 1.5 * bare, (bare, probed)
    assert inside == 0


@pytest.mark.slow  # dynamo traces every kind of request once (about 30-60 s on 2 busy cores)
def test_the_cuda_structure_dispatches_the_same_ops(eager_backend):
    model, tokens = _model(layers=2)
    eager_backend.setenv("TINYLM_REDUCER", "auto")
    auto = _counts(model, tokens)
    eager_backend.setenv("TINYLM_REDUCER", "cuda")
    assert _counts(model, tokens) == auto


def test_negative_control_torch_ops_per_statistic_exceed_the_bound(monkeypatch):
    """The same count rejects a probe that takes its statistics one torch op at a time."""
    model, tokens = _model(layers=2)
    monkeypatch.setenv("TINYLM_REDUCER", "reference")
    bare, probed, _ = _counts(model, tokens)
    assert probed > 1.5 * bare


def test_negative_control_a_host_read_in_forward_is_counted(launch_bound):
    model, tokens = launch_bound
    handle = model.layers[3].register_forward_hook(lambda m, i, o: [o.abs().amax().item()] and None)
    try:
        assert _counts(model, tokens)[2] == 1
    finally:
        handle.remove()


def test_added_ops_per_site_do_not_grow_with_the_tensors():
    """Twice the width, four times the tokens: the probe adds exactly the same ops."""
    added = []
    for d_model, T in ((64, 32), (128, 128)):
        model, tokens = _model(d_model=d_model, layers=2, T=T)
        bare, probed, _ = _counts(model, tokens)
        added.append(probed - bare)
    assert added[0] == added[1]


def test_negative_control_blockwise_attention_outside_the_op_grows_with_T():
    """The counter sees growth where there is some: the attention's statistics taken op by op
    (blocks of 64 query rows on the CPU) dispatch more ops at T 128 than at T 32; the op, one."""
    counts, op_counts = [], []
    for T in (32, 128):
        q, k, v, g = (torch.randn(2, 4, T, 16, generator=torch.Generator().manual_seed(i)) for i in range(4))
        with OpCount() as ops:
            attention.statistics(q, k, v, g)
        counts.append(ops.total)
        with OpCount() as ops:
            attention.summary(q, k, v, g)
        op_counts.append(ops.counts["attention_summary.default"])
    assert counts[1] > counts[0]
    assert op_counts == [1, 1]


@pytest.mark.parametrize("choice", ["auto", pytest.param("cuda", marks=pytest.mark.slow)])
def test_one_op_per_tensor_with_every_figure_of_the_site(choice, eager_backend):
    """reduce with every part asked for is one dispatched op (one more to cut its vector), and its
    figures are the reference's: moments, cosine, inverse row mean squares, the count below an
    edge and the weighted row mean squares."""
    eager_backend.setenv("TINYLM_REDUCER", choice)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))
    w = torch.rand(3, 8, generator=torch.Generator().manual_seed(1))
    reduce(x, rows=True, cosine=True, inv_eps=1e-5, below=-1.0, weight=w)
    with OpCount() as ops:
        r = reduce(x, rows=True, cosine=True, inv_eps=1e-5, below=-1.0, weight=w)
    assert ops.total == 2 and ops.counts["summary.default"] == 1
    ms = reference.row_mean_squares(x)
    want = {"moments": reference.moments(x), "cosine": reference.cosines(x),
            "inv": reference.moments((ms + 1e-5).reciprocal()), "weighted": reference.moments(ms * w)}
    for key, vec in want.items():
        got = getattr(r, key)
        assert got[[0, 1, 5]].tolist() == vec[[0, 1, 5]].tolist(), key  # counts exactly
        # float64 sums agree to its rounding; the cosines of float32 unit vectors to float32's
        tol = 8 * torch.finfo(torch.float32).eps if key == "cosine" else 1e-12
        assert torch.allclose(got, vec, rtol=tol, atol=tol), key
    assert r.below.tolist() == [float((x < -1.0).sum()), float(x.numel())]
    assert torch.allclose(r.row_ms, ms, rtol=2 * torch.finfo(torch.float32).eps)


def test_the_op_has_a_fake_kernel():
    x = torch.empty(4, 6, 6, device="meta")
    vec, ms = torch.ops.tinylm.summary(x, 6, True, False, False, -1.0, math.nan, None, 1)
    assert vec.shape == (16,) and vec.dtype == torch.float64 and ms.shape == (0,)
    vec, ms = torch.ops.tinylm.summary(x, 0, False, True, True, 1e-5, -6.0, None, 0)
    assert vec.shape == (32,) and ms.shape == (4, 6)


def test_a_cold_process_measures_with_torch_ops_while_numba_compiles_elsewhere(monkeypatch):
    """An empty numba cache: the first call starts one background process and the op runs its
    plain-torch kernel (the reference's numbers) until that process has finished; then numba."""
    from diagnostics.measure import numba_reducer, reduction

    started = []

    class Proc:
        code = None

        def __init__(self, *args, **kwargs):
            started.append(args)

        def poll(self):
            return Proc.code

    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    monkeypatch.setattr(numba_reducer, "_ready", False)
    monkeypatch.setattr(numba_reducer, "_warming", None)
    monkeypatch.setattr(numba_reducer, "_cached", lambda k: False)
    monkeypatch.setattr(numba_reducer.subprocess, "Popen", Proc)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    assert reduction.route(x) == reduction.TORCH and reduction.route(x) == reduction.TORCH
    assert len(started) == 1
    assert torch.equal(reduce(x).moments, reference.moments(x))
    Proc.code = 0
    assert reduction.route(x) == reduction.NUMBA and len(started) == 1


def test_hf_gpt2_probed_pass_within_1_5x_the_bare_ops(monkeypatch):
    """The same bound for a Hugging Face GPT-2 of the launch-bound shape (SDPA attention: one
    op per call for its sampled rows)."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=24, n_head=4,
                                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))

    def step():
        logits = model(tokens[:, :-1]).logits
        tinylm.functional.cross_entropy(logits, tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    with OpCount() as bare:
        step()
    with probe(model):
        step()
    with OpCount() as ops:
        with probe(model) as run:
            before = ops.host_reads
            step()
            inside = ops.host_reads - before
        run.stats  # noqa: B018
    assert ops.total <= 1.5 * bare.total, (bare.total, ops.total)
    assert inside == 0
