"""The probe's own work is clocked as its own, and its gradient hooks are put on cheaply.

* The attention watch's measurement (the SDPA calls' sampled rows, at the flush of their queue; an
  eager softmax's, in its call) is the probe's work: it counts in ``run.seconds`` (the hook bodies
  and the exit), not in the pass's torch time, for a nanoGPT-style block, an eager-softmax block
  and a Hugging Face GPT-2.
* :func:`diagnostics.measure.hooks.tensor_hook` runs each hook once, in the order the tensor's
  hooks were put on (``register_hook``'s interleaved), with the gradient ``register_hook``'s
  would get; a leaf or a tensor a torch-function mode would see takes ``register_hook`` itself.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from benchmarks.verdict_zoo import NanoGPT, hf
from diagnostics import ProbeOptions, probe
from diagnostics.measure import eager_attention, sdpa
from diagnostics.measure.hooks import tensor_hook

PAUSE = 0.05  # seconds each measured call is made to take


class EagerBlock(nn.Module):
    """A block whose attention forms its logits and calls a softmax itself (minGPT's way)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.attn = EagerAttention(d, heads)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class EagerAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
        s = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class BlocksLM(nn.Module):
    """An embedding, L blocks of ``block`` (a class taking d) and a head."""

    def __init__(self, block: type, L: int = 2, d: int = 32, vocab: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([block(d) for _ in range(L)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _slowed(monkeypatch, module, name: str, calls: list, pause: list) -> None:
    real = getattr(module, name)

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(pause[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, slow)


def _hf_gpt2():
    pytest.importorskip("transformers")
    return hf("gpt2", L=2, d=32, V=64)()


# the SDPA calls of the two blocks are measured together at the queue's flush (one group), each eager
# softmax in its call
@pytest.mark.parametrize("build,module,name,n", [(lambda: NanoGPT(L=2, d=32, vocab=64), sdpa, "_group_kernel", 1),
                                                 (lambda: BlocksLM(EagerBlock), eager_attention, "eager_rows", 2),
                                                 (_hf_gpt2, sdpa, "_group_kernel", 1)],
                         ids=["nanogpt-sdpa", "eager-softmax", "hf-gpt2"])
def test_the_watch_measurement_counts_as_the_probes_work_not_torchs(monkeypatch, build, module, name, n):
    model, calls, pause = build(), [], [0.0]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    _slowed(monkeypatch, module, name, calls, pause)

    def pass_under(options: ProbeOptions) -> tuple[float, float]:
        """(the pass's wall seconds less the hook bodies', the hook bodies')"""
        with probe(model, options) as run:
            t0 = time.perf_counter()
            out = model(ids)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            logits.float().sum().backward()
            return time.perf_counter() - t0 - run.seconds, run.seconds
    pass_under(ProbeOptions())  # warm: what a first pass compiles or builds
    rest, _ = pass_under(ProbeOptions())
    pause[0] = PAUSE
    calls.clear()
    slow_rest, own = pass_under(ProbeOptions())
    assert len(calls) == n  # one call per measurement, each made to take PAUSE
    assert own >= n * PAUSE, own  # the measurement is in the hook bodies...
    assert slow_rest - rest < PAUSE, (slow_rest, rest)  # ...and not in what is left to torch (n PAUSE if it were)
    # negative control: without the watch nothing is measured and the pauses never happen
    calls.clear()
    _, own = pass_under(ProbeOptions(attention=False))
    assert calls == [] and own < PAUSE


def test_tensor_hook_runs_each_hook_once_in_order_with_the_gradient_register_hook_gives():
    x = torch.randn(5, requires_grad=True)
    y = x * 2
    seen = []
    tensor_hook(y, lambda g: seen.append(("a", g.clone())))
    y.register_hook(lambda g: seen.append(("b", g.clone())))
    tensor_hook(y, lambda g: seen.append(("c", g.clone())))
    y.sin().sum().backward()
    assert [k for k, _ in seen] == ["a", "b", "c"]
    want = torch.cos(y.detach())
    assert all(torch.equal(g, want) for _, g in seen)
    # negative control: the gradient of another tensor of the graph is not what a hook on y sees
    assert not torch.equal(x.grad, want)


def test_tensor_hook_on_a_leaf_and_under_a_torch_function_mode_takes_register_hook():
    seen, modes = [], []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            modes.append(func)
            return func(*args, **(kwargs or {}))
    leaf = torch.randn(3, requires_grad=True)
    tensor_hook(leaf, lambda g: seen.append("leaf"))
    y = leaf * 3
    with Seen():
        tensor_hook(y, lambda g: seen.append("y"))
    assert torch.Tensor.register_hook in modes  # the mode saw the hook put on, as register_hook's would be
    modes.clear()
    with Seen(), torch._C.DisableTorchFunction():
        tensor_hook(y, lambda g: seen.append("y2"))
    assert torch.Tensor.register_hook not in modes  # negative control: overrides off, the entry made directly
    y.sum().backward()
    assert seen == ["y", "y2", "leaf"]
    assert torch.equal(leaf.grad, torch.full((3,), 3.0))


def test_a_probe_leaves_no_gradient_hook_working_after_it_exits():
    model = NanoGPT(L=1, d=32, vocab=64)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with probe(model) as run:
        out = model(ids)
    steps, before = run.steps, {k: v for k, v in run.stats.tensors.items() if k[1] == "backward"}
    out.sum().backward()  # the graph outlived the probe: its hooks run and do nothing
    assert before == {} and not any(k[1] == "backward" for k in run.stats.tensors) and run.steps == steps
    # negative control: the same backward inside the probe is measured
    with probe(model) as run:
        model(ids).sum().backward()
    assert any(k[1] == "backward" for k in run.stats.tensors)


# ----------------------------------------------------------------------------- attention caught by name

from torch.nn.functional import scaled_dot_product_attention as held_sdpa  # noqa: E402  (held: not caught by name)


class HeldBlock(nn.Module):
    """A nanoGPT block whose attention calls the SDPA function it imported (held, not looked up)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.ln, self.qkv, self.proj = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln(x)).split(d, dim=2))
        y = held_sdpa(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, d))


def _intercepted(monkeypatch) -> list:
    from diagnostics.measure.eager_attention import EagerAttentionWatch

    n, real = [], EagerAttentionWatch.__torch_function__

    def counted(self, *args, **kwargs):
        n.append(1)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(EagerAttentionWatch, "__torch_function__", counted)
    return n


@pytest.mark.parametrize("build", [lambda: NanoGPT(L=2, d=32, vocab=64), _hf_gpt2], ids=["nanogpt", "hf-gpt2"])
def test_attention_looked_up_by_name_is_measured_without_the_mode_after_the_first_pass(monkeypatch, build):
    model, n = build(), _intercepted(monkeypatch)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    got = []
    for _ in range(3):
        n.clear()
        with probe(model) as run:
            out = model(ids)
            (out if isinstance(out, torch.Tensor) else out.logits).float().sum().backward()
        got.append((len(n), run.stats))
    assert got[0][0] > 0 and got[1][0] == 0 and got[2][0] == 0  # the mode: on the first pass only
    first, later = got[0][1], got[2][1]
    assert sum(k[0].endswith(".scores") for k in later.tensors) == 2
    assert later.tensors == first.tensors and later.attention == first.attention and later.order == first.order
    assert F.scaled_dot_product_attention is sdpa.SDPA  # the function put back


def test_attention_through_a_held_function_keeps_the_mode_and_is_measured_every_pass(monkeypatch):
    model, n = BlocksLM(HeldBlock), _intercepted(monkeypatch)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        n.clear()
        with probe(model) as run:
            model(ids).sum().backward()
        assert n and sum(k[0].endswith(".scores") for k in run.stats.tensors) == 2
    # negative control: told (wrongly) that this model's attention is caught by name, the held calls are missed
    from diagnostics.measure import attention_watch

    attention_watch._BY_NAME[model] = True
    with probe(model) as run:
        model(ids).sum().backward()
    assert not any(k[0].endswith(".scores") for k in run.stats.tensors)
    assert model not in attention_watch._BY_NAME  # a watched run with nothing caught: learned again
    with probe(model) as run:
        model(ids).sum().backward()
    assert sum(k[0].endswith(".scores") for k in run.stats.tensors) == 2


def test_the_function_is_put_back_when_the_step_raises_and_other_threads_pass_through_unmeasured():
    import threading

    model = NanoGPT(L=2, d=32, vocab=64)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    with probe(model):
        model(ids)  # learned: caught by name from the next probe on
    q = torch.randn(1, 2, 4, 8)
    other = []

    def elsewhere():  # another thread's call while this one's watched module runs
        other.append(F.scaled_dot_product_attention(q, q, q))

    class Boom(RuntimeError):
        pass

    def raise_in_block(module, args):
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        raise Boom()
    handle = model.blocks[1].ln_1.register_forward_pre_hook(raise_in_block)  # block 1 runs: its watch is on
    try:
        with pytest.raises(Boom), probe(model) as run:
            assert F.scaled_dot_product_attention is not sdpa.SDPA  # the name catch is on
            model(ids)
    finally:
        handle.remove()
    assert F.scaled_dot_product_attention is sdpa.SDPA
    assert len(other) == 1 and torch.equal(other[0], sdpa.SDPA(q, q, q))
    scores = [k for k in run.stats.tensors if k[0].endswith(".scores")]
    assert scores == [("blocks.0.scores", "forward")]  # block 0's call measured, the other thread's not
