"""Every tensor a job hands a user's model is contiguous: inputs and targets, in every job.

A user's forward may ``.view`` what it is given (nanoGPT's does ``targets.view(-1)``), and a
slice of token windows (``batch[:, 1:]``) cannot be viewed flat. ``Strict`` below raises, as
such a forward does, on any non-contiguous tensor it receives, and records what it saw; each
job runs it, each with the token sources it takes (random ids, (N, T+1) windows, a 1-D stream,
an ``inputs=`` that builds non-contiguous tensors). The negative controls show that ``Strict``
rejects exactly what nanoGPT's view rejects.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
import tinylm
from diagnostics import DiagnoseOptions, DiffOptions
from tinylm.data import get_batch

V, T = 29, 8
V_ = V  # the vocabulary, where V names a tensor


class Strict(nn.Module):
    """A tiny LM whose forward(idx, targets=None) views idx and targets flat, as nanoGPT's does, and
    returns (logits, loss); ``seen`` counts the tensors it was handed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, V, bias=False)
        self.seen, self.last_only = 0, True

    def forward(self, idx, targets=None):
        self.seen += 1
        flat = idx.view(-1)  # raises on a non-contiguous idx
        x = self.emb(flat).view(*idx.shape, 16)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.head(x)
        if targets is None:
            return (logits[:, [-1], :] if self.last_only else logits), None
        self.seen += 1
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def _windows():
    return torch.randint(0, V, (6, T + 1), generator=torch.Generator().manual_seed(1))


def _stream():
    return np.random.default_rng(2).integers(0, V, 500).astype(np.uint16)


def test_strict_rejects_what_a_view_rejects():  # negative control: the checks below can fail
    w = _windows()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        Strict()(w[:, :-1], w[:, 1:])
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        Strict()(w[:, :-1].T.contiguous().T)
    logits, loss = Strict()(w[:, :-1].contiguous(), w[:, 1:].contiguous())
    assert logits.shape == (6, T, V) and loss.dim() == 0


@pytest.mark.parametrize("source", ["random", "windows", "stream"])
def test_diagnose_hands_contiguous_inputs_and_targets(source):
    tokens = {"random": None, "windows": _windows(), "stream": _stream()}[source]
    model = Strict()
    result = diagnostics.diagnose(model, tokens, DiagnoseOptions(batch_size=2, batches=2, seq_len=T))
    batches = 3 if source == "windows" else 2  # given windows: all of them, in batches of 2
    assert model.seen == 2 * batches and result.header.loss > 0  # each batch with its targets


def test_inputs_and_loss_fn_get_contiguous_tensors():
    seen = []

    def loss_fn(logits, targets):
        seen.append(targets.is_contiguous())
        return F.cross_entropy(logits.flatten(0, 1), targets.view(-1))

    model = Strict()
    model.last_only = False  # called without targets: every position's logits
    # an inputs= that builds a non-contiguous tensor, in a dict and in a tuple
    for inputs in (lambda ids: {"idx": ids.T.contiguous().T}, lambda ids: (ids.T.contiguous().T,)):
        diagnostics.diagnose(model, _windows(), DiagnoseOptions(batch_size=2, batches=1, inputs=inputs,
                                                                loss_fn=loss_fn))
    assert len(seen) == 6 and all(seen)  # 3 batches of given windows, twice


@pytest.mark.parametrize("source", ["random", "windows", "stream"])
def test_fingerprint_and_diff_hand_contiguous_inputs_and_targets(source):
    tokens = {"random": None, "windows": _windows(), "stream": _stream()}[source]
    a, b = Strict(), Strict()
    result = diagnostics.diff(a, b, tokens, DiffOptions(batch_size=2, seq_len=T, k=4))
    assert a.seen == 2 and b.seen == 2  # each called once, with its targets: every position's logits
    assert result.same


def test_call_model_makes_every_tensor_contiguous_and_copies_none_that_is():
    from diagnostics.measure.outputs import call_model, contiguous

    w = _windows()
    ids, targets = w[:, :-1], w[:, 1:]
    assert not targets.is_contiguous()
    logits, loss = call_model(Strict(), ids, targets)
    assert logits.shape == (6, T, V) and loss.dim() == 0
    x = torch.zeros(3, 4)
    nested = contiguous({"a": (x, [x.T]), "b": 3})
    assert nested["a"][0] is x and nested["a"][1][0].is_contiguous() and nested["b"] == 3


def test_get_batch_windows_are_contiguous():
    x, y = get_batch(np.arange(100), 4, 7, torch.Generator().manual_seed(0))
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])


class _StrictLM(tinylm.TransformerLM):
    def forward(self, token_ids, *args, **kwargs):
        token_ids.view(-1)  # raises on a non-contiguous batch
        return super().forward(token_ids, *args, **kwargs)


def test_train_watched_hands_contiguous_batches():
    from diagnostics.jobs import train_watched
    from tinylm.train import TrainOptions

    cfg = tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    model = _StrictLM(cfg, generator=torch.Generator().manual_seed(0))
    out = train_watched(model, _stream(), TrainOptions(steps=2, batch_size=2, watch_every=1))
    assert out.iteration == 2


USER_IMPL = '''
import math
import torch
import tinylm


def scaled_dot_product_attention(Q, K, V, mask=None):  # views V flat, as a user's code may
    flat = V.view(-1, V.shape[-1])
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ flat.view(V.shape)


class LM(tinylm.TransformerLM):
    def forward(self, token_ids, token_positions=None):
        token_ids.view(-1)
        return super().forward(token_ids, token_positions)


def transformer_lm(config, generator=None):
    return LM(config, generator=generator)
'''


def test_props_hand_a_users_functions_and_modules_contiguous_tensors(tmp_path):
    from props import impl as props_impl

    (tmp_path / "viewing.py").write_text(USER_IMPL)
    user = props_impl.load(str(tmp_path / "viewing.py"))
    Q = torch.randn(2, 3, 4, dtype=torch.float64)
    V = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)  # as the attention properties read P out
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # negative control
        user.obj.scaled_dot_product_attention(Q, Q, V.transpose(-2, -1))
    out = user.scaled_dot_product_attention(Q, Q, V.transpose(-2, -1))
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    cfg = tinylm.ModelConfig(vocab_size=V_, context_length=T, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    tok = torch.arange(T).expand(2, T)
    raw = user.obj.transformer_lm(cfg)
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # negative control
        raw(tok)
    assert user.transformer_lm(cfg)(tok).shape == (2, T, V_)
