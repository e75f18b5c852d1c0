"""The pathology zoo: small models of known truth, each diagnosed, the verdicts scored.

Every case is a model built in code with a fixed seed, with the verdict it must get:
healthy (no finding), or the one cause it was built to have (docs/verdicts.md), at the
severity that cause has at that strength. Healthy cases span the init schemes, depths,
widths, norm placements, FFN kinds, RoPE or not, sequence lengths, and a short ordinary
training run; broken cases cover every cause at two strengths (mild and severe). Nine cases
are not tinylm models (a plain PyTorch GELU residual LM, Hugging Face GPT-2 and Llama built
from a config in code, nanoGPT-style models of 2, 4 and 6 blocks trained at lr 1e-2),
diagnosed through their block stack found by structure.

A case is right when the diagnosis reports exactly the expected set of causes (none for a
healthy model) and the worst severity expected. The script prints one line per case, the
confusion table (expected cause x reported primary cause) and the wrong ones, and exits 1
if any case is wrong or crashes.

    python benchmarks/verdict_zoo.py            # the whole zoo
    python benchmarks/verdict_zoo.py --quick    # the reduced zoo the default tests run
    python benchmarks/verdict_zoo.py --only dead
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tinylm  # noqa: E402
from tinylm import functional as F  # noqa: E402
from diagnostics import DiagnoseOptions, diagnose  # noqa: E402
from diagnostics.judge.causes import CAUSES, SEVERITIES  # noqa: E402

__all__ = ["Case", "CASES", "run_case", "main"]


@dataclass(frozen=True)
class Case:
    """One model of known truth. ``cause`` None: healthy (no finding at all)."""

    name: str
    build: Callable[[], nn.Module]
    cause: str | None
    severity: str | None
    strength: str = ""  # "mild" / "severe" for broken cases
    seq_len: int = 32
    quick: bool = False  # part of the reduced zoo (tests/test_zoo.py)


def _config(d=64, L=2, T=32, norm="pre", init="cs336", ffn="swiglu", rope=True, heads=None, tie=False, V=256):
    heads = heads or max(1, d // 32)
    return tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=d, num_layers=L, num_heads=heads,
                              d_ff=tinylm.default_d_ff(d), norm=norm, init=init, ffn=ffn, positions="rope" if rope else "none",
                              tie_embeddings=tie)


def _model(seed=0, **kw) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(_config(**kw), generator=torch.Generator().manual_seed(seed))


def fresh(seed=0, **kw) -> Callable[[], nn.Module]:
    return lambda: _model(seed, **kw)


class ScaledScores(tinylm.MultiHeadSelfAttention):
    """Attention whose scores are ``factor`` times the correct Q K^T / sqrt(d_k): factor sqrt(d_k)
    is the common bug of no scaling at all, d_k^(1/4) a scale of 1/d_k^(1/4)."""

    factor: float = 1.0

    def forward(self, x, token_positions=None):
        T = x.shape[-2]
        split = "... t (h d) -> ... h t d"
        from einops import rearrange

        q = rearrange(self.q_proj(x), split, h=self.num_heads)  # (..., H, T, d_k)
        k = rearrange(self.k_proj(x), split, h=self.num_heads)
        v = rearrange(self.v_proj(x), split, h=self.num_heads)
        if self.rope is not None:
            pos = torch.arange(T, device=x.device)
            q, k = self.rope(q, pos), self.rope(k, pos)
        scores = self.scores(F.attention_scores(q * self.factor, k, F.causal_mask(T, device=x.device)))
        probs = self.probs(F.softmax(scores, dim=-1))
        return self.output_proj(rearrange(probs @ v, "... h t d -> ... t (h d)"))


def scaled_scores(power: float, **kw) -> Callable[[], nn.Module]:
    """Scores d_k^power times too large in their std (power 1/2: no 1/sqrt(d_k) at all)."""
    def build():
        m = _model(**kw)
        for block in m.layers:
            block.attn.__class__ = ScaledScores
            block.attn.factor = block.attn.d_k ** power
        return m
    return build


def scaled_weights(factor: float | None = None, std: float | None = None, only: tuple[str, ...] = (),
                   **kw) -> Callable[[], nn.Module]:
    """Every block Linear's weight (or those whose names end with ``only``) times ``factor``, or
    redrawn N(0, std^2): the forgot-to-scale-the-init bugs."""
    def build():
        m = _model(**kw)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if not name.startswith("layers.") or p.dim() != 2 or (only and not name.endswith(only)):
                    continue
                if std is not None:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.mul_(factor)
        return m
    return build


def dead_gates(beta: float, **kw) -> Callable[[], nn.Module]:
    """SiLU gates driven far negative: every token's vector shares an offset c (+3 on every
    coordinate), and every gate row w1_j points against it with weight beta, so w1 x ~ -0.95 beta
    for every token."""
    def build():
        m = _model(**kw)
        d = m.config.d_model
        with torch.no_grad():
            m.token_embeddings.weight.add_(3.0)
            for block in m.layers:
                block.ffn.w1.weight.sub_(beta / d)
        return m
    return build


def zeroed_gates(**kw) -> Callable[[], nn.Module]:
    """Every w1 exactly zero: silu(0) = 0, so the gated hidden units are exactly zero."""
    def build():
        m = _model(**kw)
        with torch.no_grad():
            for block in m.layers:
                block.ffn.w1.weight.zero_()
        return m
    return build


def nan_weight(count: int, **kw) -> Callable[[], nn.Module]:
    def build():
        m = _model(**kw)
        with torch.no_grad():
            w = m.layers[-1].ffn.w1.weight.view(-1)
            w[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(2))[:count]] = float("nan")
        return m
    return build


def trained(steps: int, lr: float, clip: float = 1.0, **kw) -> Callable[[], nn.Module]:
    """A model after ``steps`` AdamW steps on the built-in corpus (bytes) at peak ``lr``."""
    def build():
        from tinylm.data import stdlib_corpus
        from tinylm.train import TrainOptions, train

        m = _model(**kw)
        opts = TrainOptions(steps=steps, batch_size=8, lr=lr, clip=clip, watch_every=0, stop_on_nonfinite=False,
                            warmup=0 if clip == 0 else None)
        train(m, stdlib_corpus(400_000), opts)
        m.eval()
        return m
    return build


class GeluBlock(nn.Module):
    """x + fc2(gelu(fc1 x)), no norm: the stream feeds each block's scale."""

    def __init__(self, d: int, gain: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        with torch.no_grad():
            self.fc1.weight.mul_(gain)
            self.fc2.weight.mul_(gain)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class GeluLM(nn.Module):
    """A plain PyTorch residual LM (not tinylm): embedding, L GELU blocks, a linear head. ``gain``
    scales the blocks' weights from torch's default init (variance gain 1/3 per Linear),
    ``head_gain`` the head's."""

    def __init__(self, gain: float = 1.0, d: int = 64, L: int = 8, vocab: int = 256, head_gain: float = 1.0,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([GeluBlock(d, gain) for _ in range(L)])
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.head.weight.mul_(head_gain)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class NanoBlock(nn.Module):
    """nanoGPT's block: x + attn(ln_1 x), then x + mlp(ln_2 x); causal SDPA attention, GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp_proj(torch.nn.functional.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """A plain nanoGPT-style LM (not tinylm): learned token and position embeddings, L pre-LayerNorm
    blocks, a final LayerNorm and a head tied to the token embedding; GPT-2's init (N(0, 0.02^2),
    the residual projections 0.02 / sqrt(2L))."""

    def __init__(self, L: int = 4, d: int = 64, heads: int = 4, vocab: int = 256, context: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList([NanoBlock(d, heads) for _ in range(L)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / (2 * L) ** 0.5)
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.ln_f(h))


def train_nanogpt(L: int, steps: int = 300, lr: float = 6e-3, warmup: int = 30, batch: int = 16, T: int = 64,
                  seed: int = 0) -> tuple[NanoGPT, float]:
    """A :class:`NanoGPT` trained hard but stably on the built-in corpus (the standard library's bytes):
    AdamW (0.9, 0.95, weight decay 0.1) at peak ``lr`` after a linear warm-up, cosine decay to lr/10,
    gradients clipped at 1. Returns (the model in eval mode, its mean loss over the last 20 steps)."""
    import math

    from tinylm.data import get_batch, stdlib_corpus

    m = NanoGPT(L=L, context=T, seed=seed)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    data, gen, last = stdlib_corpus(2_000_000), torch.Generator().manual_seed(seed), []
    for t in range(steps):
        frac = max(0.0, (t - warmup) / max(1, steps - warmup))
        for g in opt.param_groups:
            g["lr"] = lr * (t + 1) / warmup if t < warmup else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        x, y = get_batch(data, batch, T, gen)
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        last = (last + [loss.item()])[-20:]
    return m.eval(), sum(last) / len(last)


def nanogpt(L: int, steps: int = 300, lr: float = 6e-3) -> Callable[[], nn.Module]:
    return lambda: train_nanogpt(L, steps, lr)[0]


def hf(kind: str, std: float | None = None, L: int = 4, d: int = 64, V: int = 1000) -> Callable[[], nn.Module]:
    """A Hugging Face GPT2LMHeadModel or LlamaForCausalLM built from a config in code (nothing
    downloaded), at its own init, or with every parameter redrawn N(0, std^2)."""
    def build():
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        if kind == "gpt2":
            m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=d,
                                                                     n_layer=L, n_head=4))
        else:
            m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=V, hidden_size=d, intermediate_size=172, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64))
        if std is not None:
            with torch.no_grad():
                for p in m.parameters():
                    p.normal_(0, std)
        return m
    return build


def one_kind(build: Callable[[], nn.Module], suffix: str, factor: float) -> Callable[[], nn.Module]:
    """``build``'s model with every block weight whose name ends with ``suffix`` + ".weight" times
    ``factor``, everything else at its declared init: one kind of layer initialised with the wrong std."""
    def scaled():
        m = build()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith(f".{suffix}.weight"):
                    p.mul_(factor)
        return m
    return scaled


#: The kinds of a block of each family, and the factors each is scaled by (c in 1/8 ... 8: two each
#: way, to keep the zoo's time; 2 and 1/2 are the smallest a kind must be named at).
KINDS = {"tinylm": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w2", "ffn.w3"),
         "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj"),
         "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
FACTORS = (1 / 8, 1 / 2, 2.0, 8.0)


def _misscaled_cases() -> list:
    """One kind x c for every kind of the block of a fresh 4-block tinylm and of a Hugging Face Llama and
    GPT-2: cause kind_scale, fail where c is outside [1/4, 4] (init_drift), warn inside."""
    builds = {"tinylm": fresh(d=64, L=4), "llama": hf("llama"), "gpt2": hf("gpt2")}
    out = []
    for family, kinds in KINDS.items():
        for kind in kinds:
            for c in FACTORS:
                out.append(Case(f"{family} {kind} x{c:g}", one_kind(builds[family], kind, c), "kind_scale",
                                "warn" if 1 / 4 <= c <= 4 else "fail", "mild" if 1 / 4 <= c <= 4 else "severe",
                                quick=family == "tinylm" and kind == "ffn.w2" and c == 8.0))
    return out


H, F_, W = "healthy", "fail", "warn"
CASES: list[Case] = [
    # healthy: schemes, depths, widths, sequence lengths, norm placements, FFN kinds, RoPE, training
    Case("cs336 pre d64 L2 T16", fresh(d=64, L=2, T=16), None, None, seq_len=16, quick=True),
    Case("kaiming pre d64 L12 T64", fresh(d=64, L=12, T=64, init="kaiming"), None, None, seq_len=64, quick=True),
    Case("torch-default pre d128 L6 T128", fresh(d=128, L=6, T=128, init="torch-default"), None, None, seq_len=128),
    Case("gpt2 pre d64 L24 T32", fresh(d=64, L=24, init="gpt2"), None, None),
    Case("gpt2 pre d256 L4 T256", fresh(d=256, L=4, T=256, init="gpt2", heads=4), None, None, seq_len=256, quick=True),
    Case("small-init pre d256 L4 T64", fresh(d=256, L=4, T=64, init="small-init", heads=4), None, None, seq_len=64),
    Case("zero-residual pre d64 L8 T32", fresh(d=64, L=8, init="zero-residual"), None, None),
    Case("cs336 pre d64 L48 T16", fresh(d=64, L=48, T=16), None, None, seq_len=16),
    Case("kaiming pre d512 L2 T64", fresh(d=512, L=2, T=64, init="kaiming", heads=8), None, None, seq_len=64),
    Case("cs336 pre d64 L2 T1024", fresh(d=64, L=2, T=1024), None, None, seq_len=1024),
    Case("small-init pre d64 L24 T32", fresh(d=64, L=24, init="small-init"), None, None),
    Case("cs336 post d64 L2 T32", fresh(d=64, L=2, norm="post"), None, None, quick=True),
    Case("gpt2 post d128 L4 T32", fresh(d=128, L=4, norm="post", init="gpt2"), None, None),
    Case("cs336 pre silu-ffn d64 L4", fresh(d=64, L=4, ffn="silu"), None, None, quick=True),
    Case("cs336 pre NoPE d64 L6", fresh(d=64, L=6, rope=False), None, None),
    Case("gpt2 pre silu NoPE d128 L6", fresh(d=128, L=6, init="gpt2", ffn="silu", rope=False), None, None),
    Case("cs336 pre tied d64 L4", fresh(d=64, L=4, tie=True), None, None),
    Case("cs336 pre trained 60 steps", trained(60, 3e-3, d=64, L=2, T=32), None, None),
    # missing or wrong score scaling
    Case("scores x d_k^1/4 (d_k 64)", scaled_scores(0.25, d=128, L=2, heads=2), "score_scale", W, "mild", quick=True),
    Case("scores unscaled (d_k 64)", scaled_scores(0.5, d=128, L=2, heads=2), "score_scale", F_, "severe", quick=True),
    Case("scores x d_k^1/4 (d_k 32) L6", scaled_scores(0.25, d=128, L=6, heads=4), "score_scale", W, "mild"),
    Case("scores unscaled (d_k 32) L6", scaled_scores(0.5, d=128, L=6, heads=4), "score_scale", F_, "severe"),
    # saturated attention: q and k weights too large, scores scaled right
    Case("q,k weights x3.5", scaled_weights(3.5, only=("q_proj.weight", "k_proj.weight"), d=128, L=2, heads=2),
         "kind_scale", W, "mild"),
    Case("q,k weights x30", scaled_weights(30.0, only=("q_proj.weight", "k_proj.weight"), d=64, L=2),
         "kind_scale", F_, "severe"),
    Case("q,k weights x30, last block only", scaled_weights(30.0, only=("1.attn.q_proj.weight", "1.attn.k_proj.weight"),
                                                            d=64, L=2), "saturated_attention", W, "severe", quick=True),
    # dead units: SiLU gate inputs far in the flat region
    Case("gates pushed to -7", dead_gates(7.0, d=64, L=2), "dead_units", W, "mild"),
    Case("gates pushed to -20", dead_gates(20.0, d=64, L=2), "dead_units", F_, "severe", quick=True),
    Case("gates pushed to -20, silu ffn", dead_gates(20.0, d=64, L=4, ffn="silu"), "dead_units", F_, "severe"),
    Case("gates zeroed", zeroed_gates(d=64, L=2), "dead_units", F_, "severe"),
    # badly scaled init
    Case("block weights x4", scaled_weights(4.0, d=64, L=4), "init_scale", F_, "mild"),
    Case("block weights std 3", scaled_weights(std=3.0, d=64, L=4), "init_scale", F_, "severe", quick=True),
    Case("block weights N(0,1), L12", scaled_weights(std=1.0, d=128, L=12, heads=2), "init_scale", F_, "severe"),
    Case("block weights std 10, L12", scaled_weights(std=10.0, d=64, L=12), "init_scale", F_, "severe"),
    Case("block weights x0.1", scaled_weights(0.1, d=64, L=4), "init_scale", W, "mild"),
    Case("block weights std 1e-3", scaled_weights(std=1e-3, d=128, L=8, norm="none"), "init_scale", F_, "severe",
         quick=True),
    # no normalisation
    Case("no norm cs336 L4", fresh(d=64, L=4, norm="none"), "no_norm", F_, "mild", quick=True),
    Case("no norm cs336 L12", fresh(d=64, L=12, norm="none"), "no_norm", F_, "severe"),
    Case("no norm gpt2 d64 L8 (branches vanish)", fresh(d=64, L=8, norm="none", init="gpt2"), "no_norm", F_, "mild"),
    Case("no norm kaiming L8", fresh(d=128, L=8, norm="none", init="kaiming"), "no_norm", F_, "severe"),
    # deep post-norm
    Case("post-norm cs336 L12", fresh(d=64, L=12, norm="post"), "post_norm_depth", W, "mild", quick=True),
    Case("post-norm cs336 L48", fresh(d=64, L=48, norm="post", T=16), "post_norm_depth", W, "severe", seq_len=16),
    Case("post-norm kaiming L24", fresh(d=64, L=24, norm="post", init="kaiming"), "post_norm_depth", W, "severe"),
    # non-finite
    Case("one NaN weight", nan_weight(1, d=64, L=2), "non_finite", F_, "mild", quick=True),
    Case("many NaN weights", nan_weight(500, d=64, L=4), "non_finite", F_, "severe"),
    Case("diverged training (lr 30, no clip)", trained(12, 30.0, clip=0.0, d=64, L=2, norm="none"), "non_finite",
         F_, "severe"),
    # any nn.Module: plain PyTorch and Hugging Face models (block stack found by structure)
    Case("plain GELU residual d64 L8", lambda: GeluLM(), None, None),
    Case("HF GPT-2 d64 L4, its init", hf("gpt2"), None, None),
    Case("HF Llama d64 L4, its init", hf("llama"), None, None),
    Case("plain GELU residual, weights x4", lambda: GeluLM(gain=4.0), "no_norm", F_, "severe"),
    Case("HF GPT-2 d64 L4, every weight std 10", hf("gpt2", std=10.0), "init_scale", F_, "severe"),
    Case("plain GELU residual, head x100", lambda: GeluLM(L=2, head_gain=100.0), "logit_scale", W, "mild"),
    # plain nanoGPT-style models (pre-LayerNorm, not tinylm) trained hard but stably to a good loss
    Case("nanoGPT L2 trained lr 1e-2", nanogpt(2, 200, 1e-2), None, None, seq_len=64),
    Case("nanoGPT L4 trained lr 1e-2", nanogpt(4, 200, 1e-2), None, None, seq_len=64),
    Case("nanoGPT L6 trained lr 1e-2", nanogpt(6, 200, 1e-2), None, None, seq_len=64),
    # trained tinylm models, hard enough that every kind moves, none of them misscaled
    Case("cs336 pre trained 600 steps lr 3e-2", trained(600, 3e-2, d=64, L=4, T=32), None, None),
    # one kind of the block at c x its declared std, everything else at its declared init
    *_misscaled_cases(),
]


def run_case(case: Case) -> dict:
    """Diagnose one case: {"causes": [...], "severity": worst or None, "findings", "right", "error", "seconds"}."""
    t0 = time.perf_counter()
    out = {"case": case, "causes": [], "severity": None, "messages": [], "error": None, "right": False}
    try:
        torch.manual_seed(0)
        model = case.build()
        r = diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=case.seq_len, batches=2, theory="none"))
        out["causes"] = sorted({f.cause for f in r.findings})
        sev = [f.severity for f in r.findings]
        out["severity"] = min(sev, key=SEVERITIES.index) if sev else None
        out["primary"] = r.findings[0].cause if r.findings else None
        out["messages"] = [f"{f.severity} {f.cause}: {f.message}" for f in r.findings]
        expected = [] if case.cause is None else [case.cause]
        out["right"] = out["causes"] == expected and out["severity"] == case.severity
    except Exception:  # a crash is a wrong case, reported with its traceback
        out["error"] = traceback.format_exc(limit=4)
        out["primary"] = "crash"
    out["seconds"] = time.perf_counter() - t0
    return out


def confusion(results: list[dict]) -> str:
    """Expected cause x reported primary cause (the first finding's; "healthy" for none)."""
    labels = ["healthy", *CAUSES, "crash"]
    counts: dict[tuple[str, str], int] = {}
    for r in results:
        e = r["case"].cause or "healthy"
        g = r["primary"] or "healthy"
        counts[(e, g)] = counts.get((e, g), 0) + 1
    rows_used = [x for x in labels if any(k[0] == x for k in counts)]
    cols_used = [x for x in labels if any(k[1] == x for k in counts)]
    short = {x: x[:9] for x in labels}
    lines = ["expected \\ reported".ljust(22) + " ".join(short[c].rjust(9) for c in cols_used)]
    for e in rows_used:
        lines.append(e.ljust(22) + " ".join(str(counts.get((e, c), "")).rjust(9) for c in cols_used))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the reduced zoo (the cases the default tests run)")
    p.add_argument("--only", help="cases whose name or cause contains this text")
    p.add_argument("-v", "--verbose", action="store_true", help="every finding's message")
    args = p.parse_args(argv)
    cases = [c for c in CASES if (c.quick or not args.quick)
             and (not args.only or args.only in c.name or args.only in (c.cause or "healthy"))]
    t0 = time.perf_counter()
    print(f"verdict zoo: {len(cases)} cases; torch threads {torch.get_num_threads()}")
    results = []
    for c in cases:
        r = run_case(c)
        results.append(r)
        mark = "ok " if r["right"] else "BAD"
        expect = f"{c.cause or 'healthy'}{'/' + c.severity if c.severity else ''}"
        got = ",".join(r["causes"]) or "healthy"
        got += f"/{r['severity']}" if r["severity"] else ""
        print(f"{mark} {c.name:38s} {c.strength:6s} expected {expect:26s} got {got if not r['error'] else 'CRASH'}"
              f"  ({r['seconds']:.1f} s)", flush=True)
        if args.verbose or not r["right"]:
            for m in r["messages"]:
                print(f"      {m}")
    wrong = [r for r in results if not r["right"]]
    crashed = [r for r in results if r["error"]]
    print()
    print(confusion(results))
    print()
    print(f"{len(results) - len(wrong)} of {len(results)} right, {len(crashed)} crashed, "
          f"{time.perf_counter() - t0:.0f} s")
    for r in wrong:
        print(f"\nWRONG: {r['case'].name}: expected {r['case'].cause}/{r['case'].severity}, got {r['causes']}/"
              f"{r['severity']}")
        if r["error"]:
            print(r["error"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
