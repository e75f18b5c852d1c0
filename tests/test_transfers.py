"""Host transfers: the counter of diagnostics.measure.transfers, and what the probe and the watch make.

A recorded step moves its statistics to the host once, however many layers the model has; a
step the watch does not record makes no transfer of its own (a loss given as a tensor is read
once, as the loop without a watch reads it to log it). On a CPU nothing moves, so the counter
counts the calls that would be transfers on an accelerator; a per-layer ``.item()`` loop is
the negative control.
"""

import contextlib

import torch
import torch.nn.functional as F

import tinylm
from diagnostics import Watch, probe
from diagnostics.measure.transfers import TransferCounter


def _model(layers):
    cfg = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=layers, num_heads=2, d_ff=32)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))


def _x():
    return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))


def test_the_counter_counts_what_would_move_and_restores_tensor():
    x = torch.randn(4)
    tolist, cpu = torch.Tensor.tolist, torch.Tensor.cpu
    with TransferCounter() as c:
        x.sum().item()
        float(x[0])
        bool(x[1] > 0)
        x.tolist()
        x.cpu()
        x.numpy()  # refuses a device tensor: never a transfer
        x.to("cpu")  # from the CPU: nothing would move
        (x * 2).sum()
    assert dict(c.counts) == {"item": 3, "tolist": 1, "cpu": 1}
    assert c.total == 5
    assert torch.Tensor.tolist is tolist and torch.Tensor.cpu is cpu


def _vectors(model):
    with probe(model) as run:
        model(_x()[:, :-1]).sum().backward()
    vectors, _ = run.vectors()
    return list(vectors.values())


def _steps(layers, every, loss_as_tensor=True):
    """Transfers counted in each of steps 0 (recorded when ``every``) and 1 (not recorded) of a
    small loop; ``every`` None: the same loop without a watch."""
    model = _model(layers)
    watch = Watch(model, every=every) if every is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for t in range(2):
        x = _x()
        with TransferCounter() as c:
            with (watch.step(t) if watch is not None else contextlib.nullcontext()):
                loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
            if watch is not None:
                watch.record(loss if loss_as_tensor else 1.5, lr=0.1)
        counts.append(c.total)
    if watch is not None and every:
        assert len(watch.history["records"]) == 1
        assert all(st["count"] > 0 for st in watch.history["records"][0]["stats"].values())
    return counts


def _own(layers, loss_as_tensor=True):
    """The watch's own transfers at steps 0 (recorded) and 1 (not): against the loop without it
    (tinylm's RoPE reads its largest position, a transfer per attention layer, in both)."""
    with_watch, without = _steps(layers, 2, loss_as_tensor), _steps(layers, None)
    return [a - b for a, b in zip(with_watch, without)]


def test_a_recorded_step_moves_once_whatever_the_depth():
    shallow, deep = _own(1), _own(4)
    assert shallow[0] == deep[0] == 1  # the loss, every site's moments and the update ratios together
    assert shallow[1] == deep[1] == 1  # a step not recorded: the tensor loss read once
    assert _own(2, loss_as_tensor=False) == [1, 0]  # a float loss: nothing at a step not recorded


def test_probe_stats_move_once_whatever_the_depth():
    for layers in (1, 4):
        model = _model(layers)
        with probe(model) as run:
            model(_x()[:, :-1]).sum().backward()
        with TransferCounter() as c:
            stats = run.stats
        assert len(stats.tensors) > 10 * layers
        assert c.total == 1, layers


def test_negative_control_a_per_layer_item_loop_is_caught_and_grows():
    """One .item() per watched tensor, the way not to do it: counted, and it grows with depth."""
    totals = []
    for layers in (1, 4):
        vectors = _vectors(_model(layers))
        with TransferCounter() as c:
            [v[2].item() for v in vectors]
        assert c.counts["item"] == len(vectors)
        totals.append(c.total)
    assert totals[1] > totals[0] + 20
