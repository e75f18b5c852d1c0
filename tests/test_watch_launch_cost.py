"""What a recorded watch step dispatches in the launch-bound regime (a small, deep model): op
counts are deterministic, so they are held where a GPU pays per op."""

from __future__ import annotations

import pytest
import torch

import tinylm
from diagnostics import Watch
from diagnostics.jobs import watch_record
from diagnostics.measure import update_sums
from diagnostics.measure.opcount import OpCount

VOCAB, T, BATCH = 512, 32, 4


def _model(kind: str, layers: int):
    if kind == "tinylm":
        config = tinylm.preset("tiny", num_layers=layers, context_length=T, d_model=64, num_heads=4, vocab_size=VOCAB)
        return tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=64, n_layer=layers, n_head=4,
                                     attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train(False)


def _counts(model) -> dict[str, int]:
    """Aten ops of one training step (AdamW) plain, under the watch's probe alone
    (``Watch.capture``, nothing recorded) and recorded (``Watch(every=1, optimizer=opt)``: the
    optimizer's figures too), each after a warm-up."""
    tokens = torch.randint(0, VOCAB, (BATCH, T + 1), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    watch = Watch(model, every=1, optimizer=opt)
    t = [0]

    def loss_of():
        out = model(tokens[:, :-1])
        loss = tinylm.functional.cross_entropy(getattr(out, "logits", out), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def plain():
        float(loss_of().detach())

    def probed():
        with watch.capture():
            loss = loss_of()
        float(loss.detach())

    def recorded():
        with watch.step(t[0]):
            loss = loss_of()
        watch.record(loss)
        t[0] += 1

    out = {}
    with watch:
        for name, fn in (("plain", plain), ("probed", probed), ("recorded", recorded)):
            fn()
            fn()
            with OpCount() as ops:
                fn()
            out[name] = ops.total
    return out


@pytest.mark.parametrize("kind", ["tinylm", "gpt2"])
def test_a_recorded_step_dispatches_at_most_1_5x_a_plain_step(kind, monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    n = _counts(_model(kind, 4))
    assert n["recorded"] <= 1.5 * n["plain"], n


def test_negative_control_statistics_one_torch_op_at_a_time_exceed_the_bound(monkeypatch):
    """The same bound rejects a recorded step whose probe takes its statistics op by op."""
    monkeypatch.setenv("TINYLM_REDUCER", "reference")
    n = _counts(_model("tinylm", 2))
    assert n["recorded"] > 1.5 * n["plain"], n


def _own_growth(monkeypatch) -> int:
    """The watch's own ops (a recorded step's beyond its probe's pass) at 4 layers minus at 2."""
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    own = []
    for layers in (2, 4):
        n = _counts(_model("tinylm", layers))
        own.append(n["recorded"] - n["probed"])
    return own[1] - own[0]


def test_the_watchs_own_ops_grow_by_at_most_one_per_layer(monkeypatch):
    """Two more layers add 18 parameters to copy, measure and take the optimizer's sums of, and
    12 sites to move to the host; the watch's own work adds at most the one read of each
    attention's largest logit."""
    assert _own_growth(monkeypatch) <= 2


def test_negative_control_a_copy_per_parameter_grows_with_the_layers(monkeypatch):
    """The same count sees a watch that clones parameter by parameter, hands each entry to the
    exchange as it is and takes the optimizer's sums one parameter at a time."""
    monkeypatch.setattr(watch_record, "copy_params", lambda params: {n: p.detach().clone() for n, p in params.items()})
    import diagnostics.jobs.watch as watch_module

    monkeypatch.setattr(watch_module, "copy_params", watch_record.copy_params)
    monkeypatch.setattr(watch_module, "host_values", lambda entries, group=None: entries)
    monkeypatch.setattr(update_sums, "sums", lambda now, was, grads: None)
    monkeypatch.setattr(update_sums, "counts", lambda v, steps, beta2, eps: None)
    assert _own_growth(monkeypatch) >= 4 * 18


def _vector(model, sums=None, counts=None) -> torch.Tensor:
    """The optimizer figures' sums (:meth:`OptimizerSignals.vector`: Adam's eps counts, then each
    parameter's update sums) of one AdamW step of ``model``; ``sums``, ``counts``: replace
    :func:`diagnostics.measure.update_sums.sums` and ``counts``."""
    from diagnostics.jobs.watch_record import copy_params
    from diagnostics.measure import optimizer

    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    signals = optimizer.OptimizerSignals(opt, params)
    tokens = torch.randint(0, VOCAB, (BATCH, T + 1), generator=torch.Generator().manual_seed(2))
    real = update_sums.sums, update_sums.counts
    try:
        update_sums.sums, update_sums.counts = sums or real[0], counts or real[1]
        for _ in range(2):  # the second step: Adam's state in place
            tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            signals.arm(copy_params(params))
            opt.step()
            opt.zero_grad()
        return signals.vector()
    finally:
        update_sums.sums, update_sums.counts = real
        signals.close()


def test_the_one_op_sums_are_the_per_parameter_sums_to_the_bit():
    taken = []

    def spy(op):
        def call(*args):
            taken.append((op, len(args[0])))
            return getattr(torch.ops.tinylm, op)(*args)
        return call
    one = _vector(_model("tinylm", 1), spy("update_sums"), spy("eps_counts"))
    n = len(list(_model("tinylm", 1).parameters()))
    assert taken[-2:] == [("update_sums", n), ("eps_counts", n)]  # every parameter through the two ops
    each = _vector(_model("tinylm", 1), lambda *a: None, lambda *a: None)
    assert one.dtype == torch.float64 and one[1] > 0 and torch.equal(one, each)


def test_negative_control_float32_sums_are_not_the_same():
    """The same comparison sees sums taken in float32 (the difference and the dots rounded)."""
    def float32(now, was, grads):
        return torch.stack([torch.stack([((p - w).flatten() @ g.flatten()), (p - w).flatten() @ (p - w).flatten(),
                                         g.flatten() @ g.flatten()]) for p, w, g in zip(now, was, grads)]).double()
    assert not torch.equal(_vector(_model("tinylm", 1), float32), _vector(_model("tinylm", 1)))
