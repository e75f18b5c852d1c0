"""The watch's precursor signals, each figure against a plain-torch reference computed here in float64.

Attention (every layer of any model: tinylm on its fused and explicit paths, Hugging Face GPT-2
with eager and SDPA attention, nanoGPT on its flash and non-flash paths): the largest |logit|
over the unmasked entries, the mean row entropy and its ceiling (mean of ln(keys a row may
attend to)), on the sampled query rows (all rows up to 64, else 64 evenly spaced). The head's
log Z = logsumexp of each row of logits; the residual stream's peak ratio max|x| / median|x|
(the median over the sampled token rows x all features); the fractions of zeros and of
fp16 / bf16 underflow. The history with these keys round-trips through torch.save and
check_history; one without them still reads. Negative controls: a softmax that is not
attention-shaped (or outside every block) is not counted, masked entries never reach
max_logit, a malformed signal is refused.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tinylm
from diagnostics import Watch
from diagnostics.jobs.history import check_history, to_rows
from diagnostics.measure.distributed import exchange
from diagnostics.measure.eager_attention import eager_rows
from diagnostics.measure.sdpa import row_statistics

from test_nanogpt import small_gpt


# ---------------------------------------------------------------- references (float64, plain torch)


def rows_of(T: int, rows: int = 64) -> torch.Tensor:
    """The stated sample: every row up to 64, else 64 evenly spaced rows (first and last included)."""
    return torch.arange(T) if T <= rows else torch.linspace(0, T - 1, rows).round().long().unique()


def attention_reference(scores: torch.Tensor, allowed: torch.Tensor) -> dict[str, float]:
    """max |s| over the allowed entries, mean row entropy and mean ln(allowed keys) of the sampled rows."""
    idx = rows_of(scores.shape[-2])
    s = scores.double().index_select(-2, idx)
    ok = allowed.expand(scores.shape).index_select(-2, idx)
    p = torch.softmax(s.masked_fill(~ok, -math.inf), -1).nan_to_num(0.0)
    h = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return {"max_logit": s.abs()[ok].max().item(), "entropy_mean": h.mean().item(),
            "entropy_ceiling": ok.sum(-1).clamp(min=1).double().log().mean().item(), "rows": float(h.numel())}


def peak_reference(x: torch.Tensor) -> float:
    a = x.detach().double().reshape(-1, x.shape[-1]).abs()
    return (a.max() / a.index_select(0, rows_of(a.shape[0])).flatten().median()).item()


def logits_reference(z: torch.Tensor) -> dict[str, float]:
    lz = torch.logsumexp(z.detach().double(), -1).flatten()
    return {"logz_mean": lz.mean().item(), "logz_std": lz.std(unbiased=False).item(),
            "logz_absmax": lz.abs().max().item(), "max_logit": z.detach().double().abs().max().item()}


def watched(model, run, every=1):
    """One recorded step of ``run(model)`` (returns the loss) under a Watch; the record."""
    watch = Watch(model, every=every)
    with watch.step(0):
        loss = run(model)
        loss.backward()
    watch.record(loss)
    return watch.history["records"][0], watch


def close(got: dict, want: dict, rel=1e-5, keys=None):
    for k in keys or want:
        assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-7), (k, got[k], want[k])


# ---------------------------------------------------------------- (a) tinylm


def _tiny(window=None, layers=2, T=12):
    cfg = tinylm.ModelConfig(vocab_size=40, context_length=T, d_model=16, num_layers=layers, num_heads=2, d_ff=32,
                             sliding_window=window)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))


def _tiny_reference(model, x):
    """The explicit path's scores of each layer, the block outputs and the logits, from hooks."""
    got: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: got.__setitem__(n, o.detach()))
             for n, m in model.named_modules() if n.endswith("attn.scores") or n.startswith("layers.")
             and n.count(".") == 1 or n == "lm_head"]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("window", [None, 3])
def test_tinylm_attention_logits_entropy_and_ceiling(window):
    model = _tiny(window)
    x = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))
    ref = _tiny_reference(model, x)
    rec, _ = watched(model, lambda m: m(x).logsumexp(-1).mean())
    T = 12
    for i in range(2):
        s = ref[f"layers.{i}.attn.scores"]
        t = torch.arange(T)
        allowed = (t[None, :] <= t[:, None]) & ((t[:, None] - t[None, :] < window) if window else True)
        want = attention_reference(s, allowed)
        got = rec["attention"][f"layers.{i}.attn.probs"]
        close(got, want)
        ceiling = sum(math.log(min(t + 1, window or T)) for t in range(T)) / T
        assert got["entropy_ceiling"] == pytest.approx(ceiling, rel=1e-12)
        assert 0 < got["entropy_mean"] / got["entropy_ceiling"] <= 1
    for i in range(2):
        assert rec["stats"][f"layers.{i}"]["fwd_peak"] == pytest.approx(peak_reference(ref[f"layers.{i}"]), rel=1e-6)
    close(rec["logits"], logits_reference(ref["lm_head"]))
    assert rec["stats"]["lm_head"]["fwd_peak"] == pytest.approx(peak_reference(ref["lm_head"]), rel=1e-6)
    assert "fwd_peak" not in rec["stats"]["layers.0.ffn"]  # not the residual stream or the head


def test_tinylm_explicit_path_gives_the_same_figures():
    model = _tiny()
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    fused, _ = watched(model, lambda m: m(x).square().mean())
    for m in model.modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            m.explicit = True
    explicit, _ = watched(model, lambda m: m(x).square().mean())
    assert set(explicit["attention"]) == set(fused["attention"]) == {f"layers.{i}.attn.probs" for i in range(2)}
    for name, a in fused["attention"].items():
        close(explicit["attention"][name], a, rel=1e-5)


class Wrapped(nn.Module):
    """A tinylm model inside another module (as a LightningModule holds it): its fused attention
    calls scaled_dot_product_attention, and is measured once, by its own observer."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def test_a_wrapped_tinylm_attention_is_measured_once():
    model = _tiny()
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(9))
    bare, _ = watched(model, lambda m: m(x).square().mean())
    wrapped, _ = watched(Wrapped(model), lambda m: m(x).square().mean())
    assert set(wrapped["attention"]) == {f"model.{n}" for n in bare["attention"]}
    for name, a in bare["attention"].items():
        assert wrapped["attention"][f"model.{name}"]["rows"] == 2 * 2 * 12  # B x H x T, not twice
        close(wrapped["attention"][f"model.{name}"], a, rel=1e-9)


# ---------------------------------------------------------------- (b) Hugging Face GPT-2, eager and SDPA

transformers = pytest.importorskip("transformers")


def _gpt2(impl: str, T=10):
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=T, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                  eos_token_id=0, attn_implementation=impl, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # larger weights: attention far from uniform
        for blk in model.transformer.h:
            blk.attn.c_attn.weight.mul_(20.0)
    return model


def _qk(model, x, mask):
    """Each layer's q and k from a hook on c_attn (split into heads), then the scaled scores."""
    got = {}
    hooks = [blk.attn.c_attn.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o.detach()))
             for n, blk in enumerate(model.transformer.h)]
    try:
        with torch.no_grad():
            out = model(x, attention_mask=mask, output_attentions=model.config._attn_implementation == "eager")
    finally:
        for h in hooks:
            h.remove()
    scores = {}
    H, D = model.config.n_head, model.config.n_embd
    for n, o in got.items():
        q, k, _ = o.double().split(D, dim=2)
        q = q.view(*q.shape[:2], H, -1).transpose(1, 2)
        k = k.view(*k.shape[:2], H, -1).transpose(1, 2)
        scores[n] = (q @ k.transpose(-1, -2)) / math.sqrt(D // H)
    return scores, out


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_every_layer_against_q_and_k(impl):
    model = _gpt2(impl)
    x = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0  # right padding: the padded keys are masked (finfo.min in eager, False in SDPA)
    scores, out = _qk(model, x, mask)
    rec, _ = watched(model, lambda m: m(x, attention_mask=mask, labels=x).loss)
    t = torch.arange(10)
    allowed = (t[None, :] <= t[:, None])[None, None] & mask.bool()[:, None, None, :]
    assert set(rec["attention"]) == {f"transformer.h.{i}.attn.probs" for i in range(2)}
    for i in range(2):
        want = attention_reference(scores[i], allowed)
        got = rec["attention"][f"transformer.h.{i}.attn.probs"]
        close(got, want, rel=1e-5)
        assert got["max_logit"] < 1e3  # the masked entries (finfo.min) never count
        if impl == "eager":  # the model's own weights agree with the entropy measured
            p = out.attentions[i].double()
            h = -(p * p.clamp_min(1e-300).log()).sum(-1)
            assert got["entropy_mean"] == pytest.approx(h.mean().item(), rel=1e-4)


def test_gpt2_eager_and_sdpa_agree():
    x = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(4))
    recs = [watched(_gpt2(impl), lambda m: m(x, labels=x).loss)[0] for impl in ("eager", "sdpa")]
    assert set(recs[0]["attention"]) == set(recs[1]["attention"]) == {f"transformer.h.{i}.attn.probs" for i in range(2)}
    for name, a in recs[0]["attention"].items():
        close(recs[1]["attention"][name], a, rel=1e-5)


def test_gpt2_log_z_and_peak_ratio():
    model = _gpt2("eager")
    x = torch.randint(0, 50, (8, 10), generator=torch.Generator().manual_seed(5))  # 80 token rows: 64 sampled
    got = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o[0] if
                                                                                           isinstance(o, tuple) else o))
             for n in ("transformer.h.0", "transformer.h.1", "lm_head")]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    rec, _ = watched(model, lambda m: m(x, labels=x).loss)
    close(rec["logits"], logits_reference(got["lm_head"]))
    for site in ("transformer.h.0", "transformer.h.1", "lm_head"):
        assert rec["stats"][site]["fwd_peak"] == pytest.approx(peak_reference(got[site]), rel=1e-6), site


# ---------------------------------------------------------------- (c) nanoGPT, flash and not


@pytest.mark.parametrize("flash", [True, False])
def test_nanogpt_both_paths(flash):
    model = small_gpt(flash=flash)
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(6))
    got = {}
    hooks = [blk.attn.c_attn.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o.detach()))
             for n, blk in enumerate(model.transformer.h)]
    with torch.no_grad():
        model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
    for h in hooks:
        h.remove()
    rec, _ = watched(model, lambda m: m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1])
    t = torch.arange(16)
    for i in range(3):
        q, k, _ = got[i].split(32, dim=2)
        q, k = (z.view(2, 16, 4, 8).transpose(1, 2) for z in (q, k))
        want = attention_reference(q @ k.transpose(-1, -2) / math.sqrt(8), t[None, :] <= t[:, None])
        close(rec["attention"][f"transformer.h.{i}.attn.probs"], want, rel=1e-5)
    assert rec["logits"]["logz_std"] > 0


# ---------------------------------------------------------------- (d) zeros and underflow, a softmax not attention


class ReluBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        gate = torch.softmax(x, dim=-1)  # a 3-D softmax: not attention
        odd = torch.softmax(x.view(*x.shape[:2], 2, -1).transpose(1, 2), dim=1)  # 4-D, not over the last dim
        return torch.relu(self.lin(x * gate)) + 0 * odd.sum()


class ReluNet(nn.Module):
    def __init__(self, V=20, d=8, layers=2):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(ReluBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        z = self.head(h)
        return torch.softmax(z.view(*z.shape[:2], 1, -1), dim=-1).view_as(z) * 0 + z  # a softmax outside the blocks


def test_zero_and_underflow_fractions_against_hooks():
    torch.manual_seed(0)
    model = ReluNet()
    with torch.no_grad():
        model.head.weight.mul_(1e-4)  # tiny gradients at the blocks: some fp16 underflow
    x = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(7))
    out, grads = {}, {}

    def keep(name):
        def hook(m, i, o):
            out[name] = o.detach()
            o.register_hook(lambda g: grads.__setitem__(name, g.detach()))
        return hook
    hooks = [model.get_submodule(n).register_forward_hook(keep(n)) for n in ("blocks.0", "blocks.1")]
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    for h in hooks:
        h.remove()
    model.zero_grad()
    rec, _ = watched(model, lambda m: F.cross_entropy(m(x).flatten(0, 1), x.flatten()))
    for n in ("blocks.0", "blocks.1"):
        st, y, g = rec["stats"][n], out[n].double(), grads[n].double()
        assert st["fwd_zero"] == pytest.approx((y == 0).double().mean().item(), abs=1e-12) and st["fwd_zero"] > 0
        assert st["grad_zero"] == pytest.approx((g == 0).double().mean().item(), abs=1e-12)
        assert st["grad_fp16_under"] == pytest.approx(((g != 0) & (g.abs() < 2**-14)).double().mean().item(),
                                                      abs=1e-12)
        assert st["grad_bf16_under"] == pytest.approx(((g != 0) & (g.abs() < 2**-126)).double().mean().item(),
                                                      abs=1e-12)
    assert any(rec["stats"][n]["grad_fp16_under"] > 0 for n in ("blocks.0", "blocks.1"))
    assert rec["attention"] == {}  # no softmax there is attention-shaped inside a block


# ---------------------------------------------------------------- (e) the history


def test_history_with_signals_round_trips_and_old_one_reads():
    model = _tiny()
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(8))
    _, watch = watched(model, lambda m: m(x).square().mean())
    buf = io.BytesIO()
    torch.save(watch.history, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    h, why = check_history(loaded)
    assert why is None and h["records"][0]["logits"] == watch.history["records"][0]["logits"]
    stats = {r.statistic for r in to_rows(h)}
    assert {"frac_zero", "frac_fp16_underflow", "frac_bf16_underflow", "peak_ratio", "max_logit",
            "entropy_ceiling", "rows", "logz_mean", "logz_std", "logz_absmax"} <= stats
    head_rows = [r for r in to_rows(h) if r.kind == "logits" and r.statistic == "logz_mean"]
    assert [(r.name, r.direction) for r in head_rows] == [(None, "forward")]  # the model's, as the loss
    # an old history: without any of the new keys it still reads, and its rows are as before
    old = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    for rec in old["records"]:
        rec.pop("logits")
        for st in rec["stats"].values():
            for k in ("fwd_zero", "grad_zero", "grad_fp16_under", "grad_bf16_under", "fwd_peak"):
                st.pop(k, None)
        for a in rec["attention"].values():
            for k in ("max_logit", "entropy_ceiling", "rows"):
                a.pop(k)
    assert check_history(old)[1] is None
    assert not {"frac_zero", "peak_ratio", "max_logit", "entropy_ceiling", "logz_mean"} & {r.statistic
                                                                                           for r in to_rows(old)}
    # a malformed signal is refused (the negative control of the check)
    bad = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    bad["records"][0]["logits"]["logz_mean"] = "high"
    assert check_history(bad)[0] is None
    bad = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    bad["records"][0]["stats"]["lm_head"]["fwd_peak"] = [1.0]
    assert check_history(bad)[0] is None


# ---------------------------------------------------------------- (f) negative controls and merges


def test_masked_entries_never_reach_max_logit():
    s = torch.randn(1, 2, 5, 5)
    t = torch.arange(5)
    big = torch.finfo(torch.float32).min
    masked = s.masked_fill(t[None, :] > t[:, None], -math.inf)
    additive = s + torch.where(t[None, :] > t[:, None], big, 0.0)  # Hugging Face's finfo.min mask
    filled = s.masked_fill(t[None, :] > t[:, None], big)  # masked_fill(finfo.min)
    want = attention_reference(s, t[None, :] <= t[:, None])
    for x in (masked, additive, filled):
        _, panel, vec = eager_rows(x)
        assert vec[0].item() == pytest.approx(want["max_logit"], rel=1e-6)
        assert vec[1].item() / vec[2].item() == pytest.approx(want["entropy_ceiling"], rel=1e-12)
        assert panel[1].item() == pytest.approx(want["entropy_mean"], rel=1e-5)
    # the control: had the masked entries been scores, the largest |logit| would be finfo.max
    assert additive.abs().max().item() > 1e38


def test_exchange_max_ignores_nan_unless_all_are():
    got = exchange([("a", "max", [1.0, math.nan]), ("b", "max", torch.tensor([2.0, -3.0], dtype=torch.float64))])
    assert got["a"][0] == 1.0 and math.isnan(got["a"][1]) and got["b"] == [2.0, -3.0]


def test_diagnose_probe_does_not_take_signals_by_default():
    from diagnostics import probe

    model = _tiny()
    with probe(model) as run:
        model(torch.randint(0, 40, (2, 12))).sum().backward()
    assert run.signals is None


class _Waits(TorchDispatchMode):
    """Counts the ops that make the host wait for an accelerator: reading a value
    (``_local_scalar_dense``) or sizing a result by the data (nonzero, masked_select, boolean indexing)."""

    WAITS = ("_local_scalar_dense", "nonzero", "masked_select")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean = name == "index" and any(getattr(t, "dtype", None) == torch.bool for t in args[1] if t is not None)
        self.count += name in self.WAITS or boolean
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("which", ["eager", "sdpa", "nanogpt"])
def test_a_recorded_step_never_waits_for_the_device_per_layer(which):
    """The signals (SDPA and eager attention included) stay on the device until the record's one
    exchange: the recorded step makes no op that waits, as a loop given a float loss makes none."""
    model = small_gpt(flash=False) if which == "nanogpt" else _gpt2(which)
    x = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(10))
    run = (lambda m: m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1]) if which == "nanogpt" else (lambda m: m(x[:, :-1], labels=x[:, :-1]).loss)
    watch = Watch(model, every=1)
    with _Waits() as waits:
        with watch.step(0):
            run(model).backward()
        watch.record(1.5)
    assert waits.count == 0 and watch.history["records"][0]["attention"]
    # a probe without signals measures the rows by the same masked formulas: nothing waits either
    with _Waits() as waits:
        row_statistics(torch.randn(1, 2, 4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert waits.count == 0
    # the control: selecting the allowed entries (how those rows were measured before) waits
    with _Waits() as waits:
        s = torch.randn(1, 2, 4, 4)
        s[s.isfinite() & torch.ones(4, 4, dtype=torch.bool).tril()].sum()
    assert waits.count > 0
