"""The probe's fixed costs cut without changing what it measures: one walk of the model kept while
its structure stays, hooks put in bulk, the attention watch on only inside attention modules, and
the sampled attention rows from one numba call."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import tinylm
from diagnostics.measure import numba_reducer, sdpa
from diagnostics.measure import sites as S
from diagnostics.measure.hooks import Hooks


def tiny(L: int = 2) -> tinylm.TransformerLM:
    cfg = tinylm.ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=L, num_heads=2, d_ff=32)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))


def test_the_walk_is_the_models_modules_and_parameters_and_is_found_again_after_a_change():
    model = tiny()
    first = S.model_walk(model)
    again = S.model_walk(model)  # from what was recorded
    assert again.sites is first.sites
    assert list(again.named.items()) == list(model.named_modules())
    assert again.params == list(model.named_parameters())
    model.layers[0].ffn.w1.weight = nn.Parameter(torch.zeros(32, 16))  # a parameter replaced
    now = S.model_walk(model)
    assert now.params == list(model.named_parameters()) and now.sites is not first.sites  # the control
    model.layers[1].attn.q_proj = tinylm.Linear(16, 16)  # a module replaced, deep inside
    later = S.model_walk(model)
    assert later.named["layers.1.attn.q_proj"] is model.layers[1].attn.q_proj and later.sites is not now.sites
    model.layers[0].ffn.w1.weight.data = torch.zeros(8, 16)  # a parameter's shape changed in place
    assert S.model_walk(model).sites is not later.sites


def test_hooks_run_as_registered_ones_and_are_all_removed():
    lin = nn.Linear(3, 3)
    calls = []
    hooks = Hooks()
    hooks.pre(lin, lambda m, a: calls.append("pre"))
    hooks.forward(lin, lambda m, a, o: calls.append("post"))
    hooks.forward(lin, lambda m, a, o: calls.append("always"), always_call=True)
    other = lin.register_forward_hook(lambda m, a, o: calls.append("theirs"))  # a user's hook stays
    lin(torch.zeros(1, 3))
    assert calls == ["pre", "post", "always", "theirs"]
    lin.forward = lambda x: 1 / 0
    with pytest.raises(ZeroDivisionError):
        lin(torch.zeros(1, 3))
    assert calls[4:] == ["pre", "always"]  # after the raise only the always-called hook runs
    del lin.forward
    hooks.remove()
    hooks.remove()  # idempotent
    assert list(lin._forward_hooks) == [other.id] and not lin._forward_pre_hooks
    assert not lin._forward_hooks_always_called
    other.remove()


def _rows_cases():
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    for dtype in (torch.float32, torch.float64):
        s = torch.randn(2, 3, 12, 12, generator=g, dtype=dtype) * 3
        odd = s.clone()
        odd[0, 0, 5, 2], odd[1, 1, 7, 3], odd[1, 2, 9, 0], odd[0, 2, 4, 1] = math.nan, math.inf, -math.inf, 0.0
        odd[0, 1, 6, 1] = 1e-9  # under fp16's smallest normal
        yield s, causal
        yield odd, causal
        yield s * 100, causal  # saturated rows
        yield s, torch.rand(2, 1, 12, 12, generator=g) > 0.4  # a mask per sequence, broadcast over heads
        yield s[:, :, :5], torch.rand(5, 12, generator=g) > 0.5  # rows with no key at all


def test_the_attention_rows_from_numba_are_the_torch_formulas(monkeypatch):
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    deadline = time.monotonic() + 60  # a cold numba cache is filled in the background
    while not numba_reducer.ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not numba_reducer.ready():
        pytest.skip("numba's cache is still being filled")
    for s, allowed in _rows_cases():
        # float64 logits without the signal would send the reference's moments to the compiled reducer
        for signal in ((True,) if s.dtype == torch.float64 else (False, True)):
            want, got = sdpa.row_statistics(s, allowed, signal), sdpa.rows_of(s, allowed, signal)
            for a, b in zip(want, got):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.allclose(b, a.double(), rtol=1e-5, atol=1e-9, equal_nan=True), (a, b)
    # the control: a wrong figure is told apart at that tolerance
    s, allowed = next(_rows_cases())
    want = sdpa.row_statistics(s, allowed)[1]
    assert not torch.allclose(sdpa.rows_of(s * 1.001, allowed)[1], want, rtol=1e-5, atol=1e-9)
    monkeypatch.setenv("TINYLM_REDUCER", "cuda")  # the CUDA structure: the torch formulas themselves
    assert all(torch.equal(a, b) for a, b in zip(sdpa.rows_of(s, allowed, True), sdpa.row_statistics(s, allowed, True)))


class _Mix(nn.Module):
    """Eager causal attention over 2 heads (the class name decides whether it counts as attention)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, d // 2).permute(2, 0, 3, 1, 4)  # each (B, 2, T, d/2)
        s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)


class MixAttention(_Mix):
    pass


class _Gate(nn.Module):
    """A softmax over a 4-D tensor's last dimension that sits beside the attention (not in it)."""

    def forward(self, x):
        return x * x.view(*x.shape[:2], 2, -1).softmax(-1).reshape(x.shape)  # (B, T, 2, d/2)


class _Block(nn.Module):
    def __init__(self, mix: type, gate: bool):
        super().__init__()
        self.mix, self.ff = mix(), nn.Linear(8, 8)
        self.gate = _Gate() if gate else None

    def forward(self, x):
        x = x + self.mix(x)
        return x + self.ff(self.gate(x) if self.gate is not None else x)


class _Net(nn.Module):
    def __init__(self, mix: type, gate: bool = False):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(20, 8), nn.ModuleList(_Block(mix, gate) for _ in range(2)), \
            nn.Linear(8, 20)

    def forward(self, t):
        x = self.emb(t)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_the_watch_is_on_in_attention_children_else_in_the_whole_block():
    from diagnostics import probe

    tokens = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    got = {}
    for label, net in (("named", _Net(MixAttention, gate=True)), ("unnamed", _Net(_Mix))):
        torch.manual_seed(0)
        with probe(net) as run:
            net(tokens).sum().backward()
        got[label] = sorted(k for k in run.stats.attention)
    # an attention child: its calls, not the gate's beside it (a 4-D softmax outside attention)
    assert got["named"] == ["blocks.0.mix.probs", "blocks.1.mix.probs"]
    # no attention child: the block and its children are watched, the innermost one names the call
    assert got["unnamed"] == ["blocks.0.mix.probs", "blocks.1.mix.probs"]
    net = _Net(_Mix, gate=True)
    with probe(net) as run:  # the control: a block watched whole sees the gate's softmax too
        net(tokens).sum().backward()
    assert sorted(run.stats.attention) == ["blocks.0.gate.probs", "blocks.0.mix.probs", "blocks.1.gate.probs",
                                           "blocks.1.mix.probs"]


def test_the_cold_start_check_covers_the_rows_loop(monkeypatch):
    """A fresh install fills numba's cache in the background (the torch formulas meanwhile): the
    check of that cache asks for the rows loop too, so its first use never compiles in a hook."""
    k, loop = numba_reducer._build(), numba_reducer.rows_loop()
    if not numba_reducer._cached(k):
        pytest.skip("numba's cache is not filled in this tree")
    monkeypatch.setattr(loop._cache._cache_file, "_index_path", "/nonexistent/index")
    assert not numba_reducer._cached(k)
    monkeypatch.undo()
    assert numba_reducer._cached(k)  # the control: the same check with the loop's index in place
