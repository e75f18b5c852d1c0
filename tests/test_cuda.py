"""The CUDA paths held to the plain-torch reference: the reducer on the device (torch.compile'd
row reductions) against :mod:`diagnostics.measure.reference` on the CPU, tinylm's fused attention
against its explicit path, the blockwise attention statistics against the explicit tensors',
fp16/bf16 under- and overflow counts, a whole probe on the device against the same probe on
the CPU (tinylm, and a Hugging Face GPT-2 whose SDPA calls are measured by groups), and a
``torch.compile``d model against the eager one.

Contract as on the CPU: counts and max |x| exactly; mean and M2 to float64 rounding of the
sums (the device sums in another order); figures of a whole model to the float32 rounding by
which the device's kernels and the CPU's differ. Every test carries the ``cuda`` marker and is
skipped, with the reason, where torch sees no CUDA device.
"""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import probe
from diagnostics.measure import attention, reference
from diagnostics.measure.reducer import reduce
from diagnostics.measure.reference import ATTN_FIELDS, FIELDS
from tinylm import functional as TF

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: torch.cuda.is_available() is False")]

U64 = torch.finfo(torch.float64).eps / 2
_SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, 3e-5, 6.1e-5, 6.2e-5, 65504.0, 65536.0,
            -7e4, 1.7e38, 3.4e38, 1.0, -2.5]


def _check(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, names=FIELDS) -> list:
    """Fields of ``got`` (the device's) that break the contract against ``want`` (the reference)."""
    bad = []
    f = x.detach().double().cpu().reshape(-1)
    f = f[torch.isfinite(f)]
    scale = float(f.abs().sum()) if f.numel() else 0.0
    for n, a, b in zip(names, got.cpu().tolist(), want.cpu().tolist()):
        if n in ("mean", "m2", "entropy_mean", "entropy_m2", "entropy_min"):
            tol = (f.numel() + 4) * U64 * (scale if n == "mean" else max(abs(b), scale * scale)) + 1e-300
            if n.startswith("entropy"):
                tol = 1e-9 * max(abs(b), 1.0)
            if not (a == b or abs(a - b) <= tol):
                bad.append((n, a, b))
        elif a != b and not (math.isnan(a) and math.isnan(b)):
            bad.append((n, a, b))
    return bad


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (3, 1000)), (torch.float32, (1, 7)),
                                         (torch.float32, (2, 4, 64, 64)), (torch.bfloat16, (2, 4, 64, 64)),
                                         (torch.float16, (2, 4, 64, 64))])
def test_reducer_on_cuda_equals_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3.0
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (len(_SPECIAL),), generator=g)] = torch.tensor(_SPECIAL, dtype=torch.float64)
    x = x.to(dtype)
    assert _check(reduce(x.cuda()).moments, reference.moments(x), x) == []
    if x.dim() == 4:  # causal (..., T, T): scores, and probabilities with their panel
        assert _check(reduce(x.cuda(), causal=True).moments,
                      reference.moments(x, reference.causal_mask(64)), x) == []
        p = torch.softmax(x.float().nan_to_num(0.0, 0.0, 0.0).masked_fill(~reference.causal_mask(64), -math.inf), -1)
        p = p.to(dtype)
        r = reduce(p.cuda(), causal=True, probs=True)
        assert _check(r.moments, reference.moments(p, reference.causal_mask(64)), p) == []
        assert _check(r.panel, reference.panel(p), p, ATTN_FIELDS) == []


@pytest.mark.parametrize("dtype,lo,hi", [(torch.float16, 2.0**-24, 2.0**16), (torch.bfloat16, 2.0**-133, 2.0**127)])
def test_fp16_and_bf16_under_and_overflow_counts_on_cuda(dtype, lo, hi):
    """Values on both sides of each threshold: the device counts exactly what the reference counts."""
    edges = torch.tensor([2.0**-126, 2.0**-127, 2.0**-14, 2.0**-15, 2.0**16, 2.0**15, 2.0**127, 2.0**126,
                          0.0, 1.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    x = torch.cat([edges, -edges, torch.exp(torch.empty(5000, dtype=torch.float64).uniform_(
        math.log(lo), math.log(hi), generator=g))]).to(torch.float32)
    for t in (x, x.to(dtype)):
        got, want = reduce(t.cuda()).moments.cpu(), reference.moments(t)
        for field in ("n_zero", "n_fp16_under", "n_fp16_over", "n_bf16_under", "n_bf16_over", "count"):
            i = FIELDS.index(field)
            assert got[i] == want[i], (t.dtype, field)
    assert reference.moments(x)[FIELDS.index("n_fp16_under")] > 0  # the check sees the thresholds


CFG = tinylm.ModelConfig(vocab_size=96, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=96)


def _model(device="cuda", **changes):
    return tinylm.TransformerLM(CFG.replace(**changes), generator=torch.Generator().manual_seed(0)).to(device)


def _tokens(B=3, T=48, device="cuda"):
    return torch.randint(0, CFG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1)).to(device)


def _grads(model, tok, explicit: bool):
    for m in model.modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = explicit
    model.zero_grad(set_to_none=True)
    logits = model(tok[:, :-1])
    TF.cross_entropy(logits, tok[:, 1:]).backward()
    for m in model.modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = False
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.float64, 1e-10)])
def test_fused_attention_on_cuda_equals_the_explicit_path(dtype, tol):
    """torch's fused kernel on the device (flash / memory-efficient) against tinylm's explicit path."""
    model = _model().to(dtype)
    tok = _tokens()
    (lf, gf), (le, ge) = _grads(model, tok, False), _grads(model, tok, True)
    assert float((lf - le).abs().max()) <= tol * float(le.abs().max())
    for n in gf:
        assert float((gf[n] - ge[n]).abs().max()) <= tol * float(ge[n].abs().max()) + 1e-30, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_attention_statistics_on_cuda_equal_the_explicit_tensors(dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, 3, 80, 16, generator=g).to(dtype).cuda() for _ in range(4))
    qe, ke, ve = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = TF.attention_scores(qe, ke, TF.causal_mask(80, device="cuda"))
    p = TF.softmax(s, dim=-1)
    got = {}
    s.register_hook(lambda t: got.__setitem__("ds", reduce(t, causal=True).moments))
    p.register_hook(lambda t: got.__setitem__("dp", reduce(t, causal=True).moments))
    want_p = reduce(p.detach(), causal=True, probs=True)
    want_s = reduce(s.detach(), causal=True).moments
    (p @ ve).backward(dO)
    stats = attention.statistics(q, k, v, dO)
    rel = 1e-6 if dtype == torch.float32 else 1e-2  # float32 products summed in other orders; bf16: a few ulp

    def close(a, b, names=FIELDS):
        """Sizes exactly; other counts exactly in float32, to 0.1% of the entries in bf16 (an entry
        at a threshold may round across it); moments to ``rel``."""
        out = []
        got, want = a.cpu().tolist(), b.cpu().tolist()
        entries = want[0]
        for n, x, y in zip(names, got, want):
            if n in ("n_total", "count", "rows", "rows_after_first"):
                ok = x == y
            elif n.startswith(("n_", "rows_")):
                ok = x == y if dtype == torch.float32 else abs(x - y) <= 1e-3 * entries
            elif n == "mean":
                ok = abs(x - y) <= rel * (abs(y) + 1.0)
            else:
                ok = abs(x - y) <= rel * abs(y)
            if not ok:
                out.append((n, x, y))
        return out
    assert close(stats["scores"], want_s) == [] and close(stats["probs"], want_p.moments) == []
    assert close(stats["panel"], want_p.panel, ATTN_FIELDS) == []
    if dtype == torch.float32:
        assert close(stats["scores_grad"], got["ds"]) == [] and close(stats["probs_grad"], got["dp"]) == []


def test_probe_on_cuda_equals_the_probe_on_the_cpu():
    """Every site and direction: the same counts; variances to the float32 rounding by which the
    device's kernels and the CPU's differ; the attention panels likewise."""
    tok = _tokens(device="cpu")
    stats = {}
    for device in ("cpu", "cuda"):
        model = _model(device)
        with probe(model) as run:
            TF.cross_entropy(model(tok[:, :-1].to(device)), tok[:, 1:].to(device)).backward()
        stats[device] = run.stats
    c, d = stats["cpu"], stats["cuda"]
    assert list(c.tensors) == list(d.tensors) and c.order == d.order
    for key, m in c.tensors.items():
        n = d.tensors[key]
        assert (n.n_total, n.count) == (m.n_total, m.count), key
        assert abs(n.var - m.var) <= 1e-3 * m.var + 1e-30, key
    for name, a in c.attention.items():
        b = d.attention[name]
        assert (a.rows, a.rows_after_first) == (b.rows, b.rows_after_first)
        assert abs(a.entropy_mean - b.entropy_mean) <= 1e-4 * a.entropy_mean


def test_probe_on_cuda_makes_no_transfer_per_layer():
    """A probed step's transfers to the host do not grow with depth: the hooks keep their figures
    on the device, and reading them is one packed transfer."""
    from diagnostics.measure.transfers import TransferCounter

    counts = {}
    for layers in (2, 4):
        model = _model(num_layers=layers)
        tok = _tokens()
        with probe(model) as run:  # warm-up: compiled reductions
            TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()
        counter = TransferCounter()
        with probe(model) as run:
            with counter:
                TF.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()
        counts[layers] = counter.syncs
        run.stats
    assert counts[2] == counts[4], counts


def test_compiled_model_on_cuda_equals_the_eager_model():
    model = _model()
    tok = _tokens()
    eager = model(tok[:, :-1]).detach()
    compiled = torch.compile(model)
    got = compiled(tok[:, :-1]).detach()
    assert float((got - eager).abs().max()) <= 1e-4 * float(eager.abs().max())
    loss = TF.cross_entropy(compiled(tok[:, :-1]), tok[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _hf_gpt2(layers: int, device: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=CFG.vocab_size, n_positions=64, n_embd=64, n_layer=layers, n_head=4,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device)


def test_sdpa_model_on_cuda_equals_the_cpu_and_waits_for_no_layer():
    """A Hugging Face GPT-2 (SDPA): its calls' sampled rows, measured by groups at the queue's flush
    (the masked formulas on the device, numba's loop on the CPU), give the CPU's figures to float32
    rounding; and a probed pass's host transfers do not grow with depth (no call waits)."""
    from diagnostics.measure.transfers import TransferCounter

    tok = _tokens(device="cpu")
    stats = {}
    for device in ("cpu", "cuda"):
        model = _hf_gpt2(2, device)
        with probe(model) as run:
            out = model(tok[:, :-1].to(device)).logits
            TF.cross_entropy(out, tok[:, 1:].to(device)).backward()
        stats[device] = run.stats
    c, d = stats["cpu"], stats["cuda"]
    scores = [k for k in c.tensors if k[0].endswith(".scores")]
    assert len(scores) == 2 and set(scores) <= set(d.tensors)
    for key in scores:
        m, n = c.tensors[key], d.tensors[key]
        assert (n.n_total, n.count) == (m.n_total, m.count), key
        assert abs(n.var - m.var) <= 1e-3 * m.var, key
    for name, a in c.attention.items():
        b = d.attention[name]
        assert (a.rows, a.rows_after_first) == (b.rows, b.rows_after_first)
        assert abs(a.entropy_mean - b.entropy_mean) <= 1e-4 * a.entropy_mean
    counts = {}
    for layers in (2, 4):
        model, tok_d = _hf_gpt2(layers, "cuda"), tok.cuda()
        with probe(model):  # warm-up
            TF.cross_entropy(model(tok_d[:, :-1]).logits, tok_d[:, 1:]).backward()
        counter = TransferCounter()
        with probe(model) as run:
            with counter:
                TF.cross_entropy(model(tok_d[:, :-1]).logits, tok_d[:, 1:]).backward()
        counts[layers] = counter.syncs
        run.stats
    assert counts[2] == counts[4], counts
