"""What tinylm's own model dispatches: a bare forward+backward in the launch-bound regime (a small,
deep model, where a GPU pays per op) dispatches no more aten ops than torch's built-ins do."""

from __future__ import annotations

import pytest
import torch

import tinylm
from diagnostics.measure.opcount import OpCount
from tinylm.reference import BuiltinLM

#: the launch-bound shape: d_model 64, 24 layers, 4 heads, T 32, batch 4
SHAPE = dict(d_model=64, num_layers=24, num_heads=4, context_length=32, vocab_size=512)
BATCH = 4
#: tinylm's bare pass may dispatch at most this many times BuiltinLM's ops
BOUND = 1.05


def _textbook_rope(x, cos, sin):
    """The rotation as the formula reads: even and odd slices, four products, interleaved back."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)


def _textbook_rms_norm(x, weight, eps):
    """RMSNorm as the formula reads: divide by sqrt(mean square + eps)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    out = xf / torch.sqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (out * weight.to(out.dtype) if weight is not None else out).to(x.dtype)


@pytest.fixture(scope="module")
def launch_bound():
    config = tinylm.preset("tiny", **SHAPE)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    builtin = BuiltinLM(config)
    builtin.load_state_dict(model.state_dict())
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["context_length"] + 1),
                           generator=torch.Generator().manual_seed(1))
    return model, builtin, tokens


def _ops(model, tokens) -> tuple[int, torch.Tensor]:
    """(aten ops of one bare forward+backward of the next-token loss, the logits)."""
    with OpCount() as ops:
        logits = model(tokens[:, :-1])
        tinylm.functional.cross_entropy(logits, tokens[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    return ops.total, logits.detach()


def test_bare_pass_dispatches_at_most_1_05x_builtin_ops(launch_bound):
    model, builtin, tokens = launch_bound
    ours, logits = _ops(model, tokens)
    theirs, ref = _ops(builtin, tokens)
    assert ours <= BOUND * theirs, (ours, theirs, ours / theirs)
    assert torch.allclose(logits, ref, rtol=1e-4, atol=1e-4)  # and the same function


def test_negative_control_the_formulas_op_by_op_exceed_the_bound(launch_bound, monkeypatch):
    """The same count rejects RoPE as slices and four products and RMSNorm as sqrt then divide,
    which compute the same logits."""
    model, builtin, tokens = launch_bound
    _, logits = _ops(model, tokens)
    monkeypatch.setattr(tinylm.functional, "apply_rope", _textbook_rope)
    monkeypatch.setattr(tinylm.functional, "rms_norm", _textbook_rms_norm)
    ours, textbook = _ops(model, tokens)
    theirs, _ = _ops(builtin, tokens)
    assert ours > BOUND * theirs, (ours, theirs)
    assert torch.allclose(textbook, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_apply_rope_rounds_as_the_formula_does(dtype):
    """apply_rope and the formula written out agree bitwise, values and gradients (the same
    products and sums); a rotation of the halves (x_k, x_{k+d/2}) does not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 16, generator=g).to(dtype)
    ang = tinylm.functional.rope_angles(100.0, 16, torch.arange(8))  # (T, d_k/2), float64
    cos, sin = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)
    up = torch.randn(2, 3, 8, 16, generator=g).to(dtype)
    grads = []
    for fn in (tinylm.functional.apply_rope, _textbook_rope):
        xx = x.clone().requires_grad_(True)
        out = fn(xx, cos, sin)
        out.backward(up)
        grads.append((out.detach(), xx.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    x1, x2 = x[..., :8], x[..., 8:]  # negative control: pairs (x_k, x_{k+d/2}), the same angles
    halves = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    assert not torch.allclose(halves.double(), grads[0][0].double(), atol=0.1)
